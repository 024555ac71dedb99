"""One rank of tests/context_parallel/test_ring.py and test_call.py: a gloo group of N processes runs every case on
the CPU in float64 and prints one JSON line per case with this rank's largest difference to the single-process
attention's shard (output, lse, max logit and every gradient), or the error a bad call raised.

With ``cuda`` as its fourth argument (tests/context_parallel/test_ring_gpu.py) the processes share one GPU: the
cases run in bfloat16 at MLA's 192/128 on the chunk kernels attnselect chooses there, each report holding this
rank's relative errors against a float64 reference and the chunk choices. gloo moves CPU tensors only, so there the
ring's K/V and dK/dV go through the host (a test-only stand-in for NCCL; everything else is the real path)."""

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

import attnselect
from attnselect.context_parallel import shard

MLA = dict(hq=2, hkv=2, dqk=48, dv=32)  # d_qk != d_v as MLA's 192/128, at test size
GQA = dict(hq=4, hkv=2, dqk=16, dv=16)


def cases(n: int, device: str = "cpu") -> dict:
    """name -> call description; thd lengths are multiples of 2N, the shortest exactly 2N."""
    c = 2 * n
    thd = [c, 3 * c, 2 * c]
    found = {}
    for causal in (False, True):
        tag = "causal" if causal else "full"
        found[f"bshd-mla-{tag}"] = dict(layout="bshd", b=2, s=2 * c, causal=causal, **MLA)
        found[f"bshd-gqa-{tag}"] = dict(layout="bshd", b=1, s=3 * c, causal=causal, **GQA)
        found[f"thd-mla-{tag}"] = dict(layout="thd", lengths=thd, causal=causal, **MLA)
        found[f"thd-gqa-{tag}"] = dict(layout="thd", lengths=thd[::-1], causal=causal, **GQA)
    found["sbhd-mla-causal"] = dict(layout="sbhd", b=2, s=c, causal=True, **MLA)
    found["sbhd-mla-causal-views"] = dict(layout="sbhd", b=2, s=2 * c, causal=True, views=True, **MLA)
    found["thd-mla-causal-views"] = dict(layout="thd", lengths=thd, causal=True, views=True, **MLA)
    found["bhsd-gqa-causal"] = dict(layout="bhsd", b=1, s=2 * c, causal=True, **GQA)
    found["bshd-causal-softcap-sinks-max-logit"] = dict(layout="bshd", b=1, s=2 * c, causal=True, softcap=3.0,
                                                         sinks=True, return_max_logit=True, **MLA)  # fmt: skip
    found["thd-causal-softcap-sinks-max-logit"] = dict(layout="thd", lengths=thd, causal=True, softcap=2.0,
                                                        sinks=True, return_max_logit=True, **GQA)  # fmt: skip
    found["thd-causal-inference"] = dict(layout="thd", lengths=thd, causal=True, grad=False, **MLA)
    if device == "cpu":
        return found
    mla = dict(hq=4, hkv=4, dqk=192, dv=128)  # the GPU cases: MLA's head dims, bfloat16, kernel-sized chunks
    gpu = {
        "bshd-mla-causal": dict(layout="bshd", b=2, s=256 * c, causal=True, **mla),
        "bshd-mla-full": dict(layout="bshd", b=1, s=128 * c, causal=False, **mla),
        "thd-mla-causal": dict(layout="thd", lengths=[c * 16, c * 100, c * 64], causal=True, **mla),
        "thd-mla-causal-max-seqlen-given": dict(
            layout="thd", lengths=[c * 16, c * 100, c * 64], causal=True, given=True, **mla
        ),  # fmt: skip
        "bshd-mla-causal-inference": dict(layout="bshd", b=2, s=256 * c, causal=True, grad=False, **mla),
        "thd-gqa-causal-inference": dict(
            layout="thd", lengths=[c * 8, c * 40], causal=True, grad=False, hq=8, hkv=2, dqk=128, dv=128
        ),  # fmt: skip
    }
    return {name: dict(case, dtype=torch.bfloat16) for name, case in gpu.items()}


def full_inputs(case: dict, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    layout = case["layout"]
    cu = None
    if layout == "thd":
        lengths = case["lengths"]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        shape = lambda h, d: (sum(lengths), h, d)  # noqa: E731
    else:
        b, s = case["b"], case["s"]
        shape = {"bshd": lambda h, d: (b, s, h, d), "sbhd": lambda h, d: (s, b, h, d),
                 "bhsd": lambda h, d: (b, h, s, d)}[layout]  # fmt: skip
    q = torch.randn(shape(case["hq"], case["dqk"]), generator=g, dtype=torch.float64)
    k = torch.randn(shape(case["hkv"], case["dqk"]), generator=g, dtype=torch.float64)
    v = torch.randn(shape(case["hkv"], case["dv"]), generator=g, dtype=torch.float64)
    d_out = torch.randn(shape(case["hq"], case["dv"]), generator=g, dtype=torch.float64)
    sinks = torch.randn(case["hq"], generator=g, dtype=torch.float64) if case.get("sinks") else None
    moved = [None if t is None else t.to(device) for t in (q, k, v, d_out, sinks, cu)]
    return moved


def run(q, k, v, sinks, case, **extra):
    options = dict(layout=case["layout"], causal=case["causal"], return_lse=True, softcap=case.get("softcap"),
                   sinks=sinks, return_max_logit=case.get("return_max_logit", False), **extra)  # fmt: skip
    return attnselect.attention(q, k, v, **options)


def lse_shard(lse, layout, n, rank, cu):
    """Rank's shard of an lse, (B, H, S) dense or (H, T) thd, through shard() (which cuts a token axis)."""
    if layout == "thd":
        return shard(lse.T.unsqueeze(-1), cp_size=n, rank=rank, layout="thd", cu_seqlens=cu)[0][..., 0].T
    return shard(lse.unsqueeze(-1), cp_size=n, rank=rank, layout="bhsd")[0][..., 0]


def check(case: dict, n: int, rank: int, group) -> dict:
    grad = case.get("grad", True)
    q, k, v, d_out, sinks, cu = full_inputs(case, seed=7)
    layout = case["layout"]
    full = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    full_sinks = sinks.clone().requires_grad_(grad) if sinks is not None else None
    packed = dict(cu_seqlens_q=cu) if layout == "thd" else {}
    out, lse, *max_logit = run(*full, full_sinks, case, **packed)
    if grad:
        (out * d_out).sum().backward()

    def local(x):
        return shard(x, cp_size=n, rank=rank, layout=layout, cu_seqlens=cu)

    parts = [local(t.detach())[0].requires_grad_(grad) for t in (q, k, v)]
    operands = parts
    if case.get("views"):  # q, k, v as views of one buffer (a fused projection's output), not contiguous
        buffer = torch.cat([p.detach() for p in parts], dim=-1).requires_grad_(grad)
        widths = [p.shape[-1] for p in parts]
        operands = list(buffer.split(widths, dim=-1))
    part_sinks = sinks.clone().requires_grad_(grad) if sinks is not None else None
    local_packed = dict(cu_seqlens_q=local(q)[1]) if layout == "thd" else {}
    got, got_lse, *got_max = run(*operands, part_sinks, case, cp_group=group, **local_packed)
    errors = {
        "out": (got - local(out.detach())[0]).abs().max().item(),
        "lse": (got_lse - lse_shard(lse, layout, n, rank, cu)).abs().max().item(),
    }
    if max_logit:  # each rank holds its local maximum; MAX over the group is the global one
        dist.all_reduce(got_max[0], op=dist.ReduceOp.MAX, group=group)
        errors["max_logit"] = (got_max[0] - max_logit[0]).abs().max().item()
    if grad:
        (got * local(d_out)[0]).sum().backward()
        if case.get("views"):
            for part, grad_part in zip(parts, buffer.grad.split(widths, dim=-1)):
                part.grad = grad_part
        for name, mine, theirs in zip("qkv", parts, full):
            errors[f"d{name}"] = (mine.grad - local(theirs.grad)[0]).abs().max().item()
        if sinks is not None:  # every rank's share of the sinks' gradient sums to the full one
            dist.all_reduce(part_sinks.grad, group=group)
            errors["dsinks"] = (part_sinks.grad - full_sinks.grad).abs().max().item()
    return {"errors": errors}


def check_on_gpu(case: dict, n: int, rank: int, group) -> dict:
    """Relative errors of this rank's bfloat16 shard against the float64 single-process attention's, beside those of
    the bfloat16 single-process attention (the kernels' own rounding), and the chunk choices made."""
    from attnselect.context_parallel import call as cp_call

    grad, layout = case.get("grad", True), case["layout"]
    q, k, v, d_out, _, cu = full_inputs(case, seed=11, device="cuda")
    packed = dict(cu_seqlens_q=cu) if layout == "thd" else {}
    exact = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    ref = attnselect.attention(*exact, layout=layout, causal=case["causal"], backend="reference", **packed)
    if grad:
        (ref * d_out).sum().backward()

    def local(x):
        return shard(x, cp_size=n, rank=rank, layout=layout, cu_seqlens=cu)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    parts = [local(t)[0].to(case["dtype"]).requires_grad_(grad) for t in (q, k, v)]
    local_packed = {}
    if layout == "thd":
        local_packed = dict(cu_seqlens_q=local(q)[1])
        if case.get("given"):  # both max_seqlen given: no host read of the boundaries
            local_packed.update(max_seqlen_q=max(case["lengths"]) // n, max_seqlen_kv=max(case["lengths"]) // n)
    chosen = []
    real_select = cp_call.select_packed if layout == "thd" else cp_call.select

    def spy(problem, **options):
        decision = real_select(problem, **options)
        chosen.append(str(decision.chosen))
        return decision

    setattr(cp_call, "select_packed" if layout == "thd" else "select", spy)
    try:
        out = attnselect.attention(*parts, layout=layout, causal=case["causal"], cp_group=group, **local_packed)
    finally:
        setattr(cp_call, "select_packed" if layout == "thd" else "select", real_select)
    errors = {"out": rel(out, local(ref.detach())[0])}
    if grad:
        (out * local(d_out)[0].to(out.dtype)).sum().backward()
        for name, mine, theirs in zip("qkv", parts, exact):
            errors[f"d{name}"] = rel(mine.grad, local(theirs.grad)[0])
    return {"errors": errors, "chosen": chosen}


def bad_calls(n: int, rank: int, group) -> dict:
    """name -> the error text a refused call raised on this rank (or 'no error')."""
    c = 2 * n
    q = torch.randn(1, c, 2, 8, dtype=torch.float64)
    v = torch.randn(1, c, 2, 4, dtype=torch.float64)
    odd = torch.randn(1, c + 1, 2, 8, dtype=torch.float64)
    cu_odd = torch.tensor([0, 3, c + 1], dtype=torch.int32)
    calls = {
        "odd-dense-length": lambda: attnselect.attention(odd, odd, odd, cp_group=group),
        "odd-thd-length": lambda: attnselect.attention(
            odd[0], odd[0], odd[0], layout="thd", cu_seqlens_q=cu_odd, cp_group=group
        ),  # fmt: skip
        "window": lambda: attnselect.attention(q, q, v, window=(2, 0), cp_group=group),
        "bottom-right": lambda: attnselect.attention(q, q, v, causal="bottom_right", cp_group=group),
        "dropout": lambda: attnselect.attention(q, q, v, dropout_p=0.1, cp_group=group),
        "mismatched-shards": lambda: attnselect.attention(
            *(torch.randn(1, 2 * (rank + 1), 2, 8, dtype=torch.float64) for _ in range(3)), cp_group=group
        ),
        # equal shapes, boundaries of different values: would run silently wrong without the check
        "mismatched-boundaries": lambda: attnselect.attention(
            q[0].repeat(2, 1, 1),
            q[0].repeat(2, 1, 1),
            v[0].repeat(2, 1, 1),
            layout="thd",
            cp_group=group,
            cu_seqlens_q=torch.tensor([0, 2 + 2 * (rank % 2), 2 * c], dtype=torch.int32),
        ),
        # one rank refuses its own shard (odd lengths): every rank raises, none waits in the ring
        "refused-on-one-rank": lambda: attnselect.attention(
            *(3 * [odd[0] if rank == 1 else q[0]]),
            layout="thd",
            cp_group=group,
            cu_seqlens_q=torch.tensor([0, 3, c + 1] if rank == 1 else [0, 2, c], dtype=torch.int32),
        ),
        # one rank trains, another does not: the backward ring would wait for it
        "training-on-one-rank": lambda: attnselect.attention(q.clone().requires_grad_(rank == 0), q, v, cp_group=group),
    }
    seen = {}
    for name, call in calls.items():
        try:
            call()
            seen[name] = "no error"
        except attnselect.InvalidInputError as exc:
            seen[name] = str(exc)
    return seen


def exchange_through_the_host():
    """gloo moves CPU tensors only: the ring's sends and receives go through host copies (tests on one GPU)."""
    from attnselect.context_parallel.ring import Ring

    exchange = Ring._exchange

    def staged(self, tensors):
        wait = exchange(self, [t.cpu() for t in tensors])
        return lambda: [t.to(tensors[0].device) for t in wait()]

    Ring._exchange = staged


def edge_calls(n: int, rank: int, group) -> dict:
    """name -> largest difference to the single-process shard (gradients included) of calls at the edges."""
    found = {}
    # an empty shard in training: zero gradients, as attention() gives
    empty = [torch.zeros(1, 0, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    attnselect.attention(*empty, causal=True, cp_group=group).sum().backward()
    found["empty-shard-training"] = max(t.grad.abs().max().item() if t.grad.numel() else 0.0 for t in empty)
    # q, k, v that require grad, under no_grad: an inference call
    case = dict(layout="thd", lengths=[2 * n, 6 * n], causal=True, **MLA)
    q, k, v, _, _, cu = full_inputs(case, seed=5)
    full = run(q, k, v, None, case, cu_seqlens_q=cu)[0]

    def local(x):
        return shard(x, cp_size=n, rank=rank, layout="thd", cu_seqlens=cu)

    parts = [local(t)[0].requires_grad_() for t in (q, k, v)]
    with torch.no_grad():
        out = run(*parts, None, case, cp_group=group, cu_seqlens_q=local(q)[1])[0]
    found["no-grad-inputs-require-grad"] = (out - local(full)[0]).abs().max().item()
    return found


def main(rank: int, world: int, port: str, device: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    group = dist.new_group(list(range(world)))
    if device == "cuda":
        exchange_through_the_host()
    for name, case in cases(world, device).items():
        try:
            result = check(case, world, rank, group) if device == "cpu" else check_on_gpu(case, world, rank, group)
        except Exception:
            result = {"raised": traceback.format_exc()}
        print(json.dumps({"rank": rank, "case": name, **result}), flush=True)
    if device == "cpu":
        print(json.dumps({"rank": rank, "case": "bad-calls", "errors": bad_calls(world, rank, group)}), flush=True)
        print(json.dumps({"rank": rank, "case": "edges", "errors": edge_calls(world, rank, group)}), flush=True)
        one = [dist.new_group([r]) for r in range(world)][rank]  # a group of this rank only
        q = torch.randn(1, 6, 2, 8, dtype=torch.float64)
        same = attnselect.attention(q, q, q, causal=True, cp_group=one) - attnselect.attention(q, q, q, causal=True)
        print(
            json.dumps({"rank": rank, "case": "group-of-one", "errors": {"out": same.abs().max().item()}}), flush=True
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else "cpu")

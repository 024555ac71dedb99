"""Microbenchmark: the host time attnselect.attention adds to a repeated call of the kernel it chose.

    python benchmarks/hot_path.py [--calls 500] [--repeats 31] [--out results/h200_hot_path]

Small calls repeated with the same shapes and options (the memoized fast path), each row timed as ``--calls``
calls from an empty queue, ``--repeats`` times in interleaved rounds (:func:`time_rows`; the packed case, whose
calls are slower, in shorter rounds, more of them: ``--packed-calls``, ``--packed-repeats``): the median host
microseconds per call with its quartiles (the time to return from the calls, which is what a host-bound loop
pays; the GPU drains the queue after; rounds short enough that the launch queue, about a thousand launches, never
fills), the median with the round's closing sync, and attnselect's row minus each other row, the median of the
per-round differences of host time. Rows per problem: attnselect's automatic choice,
and the same kernel called directly.

- Dense (CUDA: B1 S256 H16 192/128 inference bf16; CPU: a tiny float32 call), on tensors in the kernel's own
  layout so that neither side permutes (``layout="bhsd"`` for SDPA kernels, ``"bshd"`` for FlashAttention's):
  - SDPA kernels: torch's default dispatch, F.scaled_dot_product_attention (the fastest direct call where it
    reaches the chosen kernel), and the kernel forced with sdpa_kernel;
  - FlashAttention packages: the package's ``flash_attn_func``;
  - the backend object attnselect runs (``Backend.run``);
  - CUDA, cuDNN and mem-efficient: the aten op SDPA's dispatch calls once it has chosen that kernel;
  - attnselect's prepared runner alone (what a repeated call runs after its lookup), and the memo lookup alone,
    without a kernel.
- CUDA, packed (1024 tokens in 4 sequences, H16, 128/128, causal, both max_seqlen given, inference), the automatic
  choice and, where that is not the cuDNN frontend and the frontend is installed, the call forced to it:
  - the chosen package's ``flash_attn_varlen_func`` where it is a FlashAttention package, ``cudnn.sdpa_torch``
    where it is the cuDNN frontend (both on the caller's boundaries; that op also on the bucketed ones), torch's
    ``aten._flash_attention_forward`` where it is ``varlen_fa2``;
  - the chosen backend's packed kernel through its backend object (``Backend.run_packed``, boundaries
    bucketed where the backend buckets them);
  - torch's ``varlen_attn`` (a custom op over ``aten._flash_attention_forward``);
  - attnselect's prepared runner alone, and its memo lookup alone.

- A new packing on every call (:func:`new_packings`: 1 to 8 documents in 1024 tokens, no two alike in count and
  longest document, so each call misses attnselect's memo), inference and training: attnselect, the chosen
  package's varlen function or op called directly, torch's varlen_attn.
- The dense case in training (a forward and ``torch.autograd.grad``): attnselect, F.sdpa's default dispatch, the aten
  op, the package's function, the backend object; on bshd tensors too, beside F.sdpa on their transposed views.

``--profile`` adds cProfile's top functions (by own time) of each attnselect row to the report.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

import attnselect
from attnselect import backends, dispatch
from attnselect.backends.shape_cache import bucketed
from attnselect.execution import kernel_call
from attnselect.spec.options import CallOptions
from attnselect.spec.problem import describe_call


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


WARMUP = 20  # calls of each row before the rounds


def time_rows(rows: dict, device: str, calls: int, repeats: int) -> dict:
    """Per row: the median host time per call over ``repeats`` rounds of ``calls`` calls (from the first call to the
    return of the last, the queue empty at the start; the GPU drains it after), with the quartiles; the median with
    the round's closing sync (a GPU-bound row shows its GPU time there); and the per-round differences of the host
    times from the first row (attnselect's), which shares each round's host state.

    Rounds are interleaved, in alternating order (forwards, then backwards), with the garbage collector off: the
    host of a shared machine drifts by more than the differences measured (git show af40727:results/h200_hot_path.md
    and h200_hot_path_alternating.md there)."""
    for fn in rows.values():  # warm-up: choices, graphs, compiles
        for _ in range(WARMUP):
            fn()
    host = {name: [] for name in rows}
    synced = {name: [] for name in rows}
    gc.collect()
    gc.disable()
    try:
        for r in range(repeats):
            for name, fn in rows.items() if r % 2 == 0 else reversed(rows.items()):
                _sync(device)
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                host[name].append((time.perf_counter() - start) / calls * 1e6)
                _sync(device)
                synced[name].append((time.perf_counter() - start) / calls * 1e6)
    finally:
        gc.enable()
    first = host[next(iter(rows))]
    return {
        name: {"us": statistics.median(t), **_quartiles(t), "rounds": t, "synced_us": statistics.median(synced[name]),
               "first_minus_this": _quartiles_of([a - b for a, b in zip(first, t)])}
        for name, t in host.items()
    }  # fmt: skip


def _quartiles(values) -> dict:
    q1, _, q3 = statistics.quantiles(values, n=4)
    return {"q1": q1, "q3": q3}


def _quartiles_of(values) -> dict:
    return {"median": statistics.median(values), **_quartiles(values)}


def profile(fn, calls: int, sort: str = "tottime", lines: int = 25) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(sort).print_stats(lines)
    return "\n".join(line for line in text.getvalue().splitlines() if line.strip()).replace(str(Path.cwd()), ".")


def dense_inputs(device: str):
    """The dense case's (q, k, v, layout, chosen candidate): tensors in the chosen kernel's own layout."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = (1, 256, 16) if device == "cuda" else (1, 2, 8)
    dims = (192, 192, 128) if device == "cuda" else (16, 16, 16)
    q, k, v = (torch.randn(*shape, d, device=device, dtype=dtype) for d in dims)
    chosen = attnselect.select(attnselect.AttentionProblem.from_tensors(q, k, v)).chosen
    layout = backends.get(chosen.backend).layout  # the kernel's own layout: neither side permutes
    if layout == "bhsd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return q, k, v, layout, chosen


def dense_rows(device: str):
    q, k, v, layout, chosen = dense_inputs(device)
    backend = backends.get(chosen.backend)
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, layout=layout)
    call = kernel_call(problem)
    rows = {f"attnselect.attention ({chosen}, layout={layout})": lambda: attnselect.attention(q, k, v, layout=layout)}
    kernel = getattr(backend, "kernel", None)
    if kernel is not None and not chosen.padded:
        rows["F.scaled_dot_product_attention, default dispatch"] = lambda: F.scaled_dot_product_attention(q, k, v)

        def forced():
            with sdpa_kernel([kernel]):
                return F.scaled_dot_product_attention(q, k, v)

        rows[f"F.scaled_dot_product_attention in sdpa_kernel([{kernel.name}])"] = forced
        aten = backend.aten_op  # what the repeated runner calls where torch confirms the kernel serves the call
        if aten is not None and device == "cuda":  # below dispatch: what SDPA calls once it has chosen the kernel
            rows[f"torch.{aten.__name__}, the op SDPA's dispatch calls"] = lambda: aten(q, k, v, None, False)[0]
    module = getattr(backend, "module", None)
    if module is not None and not chosen.padded:
        function = importlib.import_module(module).flash_attn_func
        rows[f"{module}.flash_attn_func"] = lambda: function(q, k, v)
    if not chosen.padded:
        rows[f"{chosen.backend} backend object, run()"] = lambda: backend.run(q, k, v, call)
    rows.update(_dense_lookup_rows(q, k, v, CallOptions(layout)))
    return problem, chosen, rows


def dense_bshd_rows(device: str):
    """The size ladder's B8 S1k 192/128 causal inference rung as users call it, on bshd tensors (where attnselect ran
    behind F.sdpa's default on the same cuDNN kernel: results/h100_ladder_small_19f0ef5_nofa4.md): attention()
    beside F.sdpa's default dispatch and cuDNN's op on the transposed views, its prepared runner and its lookup. After
    ``attnselect.warmup`` of the problem, as the ladder's default runs: in a fresh process the first calls would rent
    a kernel that compiles nothing while the ranked one's compile is not yet paid (attnselect.choose.first_calls; on
    the H200 a row without it timed the cuDNN frontend: results/h200_hot_path_94ce3f9_fa4.md)."""
    shape, dims = ((8, 1024, 16), (192, 192, 128)) if device == "cuda" else ((1, 2, 8), (16, 16, 16))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(*shape, d, device=device, dtype=dtype) for d in dims)
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, causal=True)
    attnselect.warmup([problem], device=device)
    chosen = attnselect.select(problem).chosen
    rows = {f"attnselect.attention ({chosen}, layout=bshd, causal)": lambda: attnselect.attention(q, k, v, causal=True)}
    rows["F.scaled_dot_product_attention on the transposed views, default dispatch"] = lambda: (
        F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
    )
    op = backends.get("sdpa_cudnn").aten_op
    if op is not None and device == "cuda":
        rows[f"torch.{op.__name__} on the transposed views"] = lambda: op(
            *(t.transpose(1, 2) for t in (q, k, v)), None, False, 0.0, True
        )[0].transpose(1, 2)
    rows.update(_dense_lookup_rows(q, k, v, CallOptions("bshd", True)))
    return problem, chosen, rows


def _dense_lookup_rows(q, k, v, options: CallOptions) -> dict:
    """The rows of a dense call's two parts, each alone: the runner attention() prepared for calls like (q, k, v)
    with ``options``, and its memo lookup."""
    known = (q, k, v, options)
    runner = _prepared_runner(lambda: attnselect.attention(q, k, v, **options._asdict()), known)
    return {
        "attnselect's prepared runner alone (no lookup)": lambda: runner(q, k, v),
        "attnselect's memo lookup alone (dispatch.recall, no kernel)": lambda: dispatch.recall(*known),
    }


def dense_forced_rows(device: str, forced: str):
    """The dense case on bshd tensors with ``backend=forced`` (a FlashAttention package): attnselect beside the
    package's ``flash_attn_func`` called as a user would (``q, k, v`` only) and with the options attnselect passes,
    and the backend object."""
    dtype = torch.bfloat16
    q, k, v = (torch.randn(1, 256, 16, d, device=device, dtype=dtype) for d in (192, 192, 128))
    backend = backends.get(forced)
    problem = attnselect.AttentionProblem.from_tensors(q, k, v)
    call = kernel_call(problem)
    function = importlib.import_module(backend.module).flash_attn_func
    options = backend._options(call, 1, 1)
    rows = {
        f"attnselect.attention (backend={forced!r}, layout=bshd)": lambda: attnselect.attention(
            q, k, v, backend=forced, pad=False
        ),
        f"{backend.module}.flash_attn_func(q, k, v)": lambda: function(q, k, v),
        f"{backend.module}.flash_attn_func with attnselect's options {sorted(options)}": lambda: function(
            q, k, v, **options
        ),
        f"{forced} backend object, run()": lambda: backend.run(q, k, v, call),
    }
    return problem, forced, rows


def dense_training_rows(device: str):
    """The dense case in training: each row a forward and a backward (torch.autograd.grad, so no row accumulates
    into .grad), on the same inputs in the chosen kernel's own layout; attnselect also on bshd tensors, as most
    models call it, beside F.sdpa on the transposed views of the same tensors."""
    q, k, v, layout, _ = dense_inputs(device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, layout=layout)
    chosen = attnselect.select(problem).chosen
    backend = backends.get(chosen.backend)
    call = kernel_call(problem)
    inputs = (q, k, v)

    def trained(forward):
        def step():
            out = forward()
            out = out[0] if isinstance(out, tuple) else out
            return torch.autograd.grad(out, inputs, grad)

        return step

    grad = torch.randn_like(attnselect.attention(q, k, v, layout=layout))
    rows = {f"attnselect.attention ({chosen}, layout={layout}), fwd+bwd": trained(
        lambda: attnselect.attention(q, k, v, layout=layout)
    )}  # fmt: skip
    kernel = getattr(backend, "kernel", None)
    if kernel is not None and not chosen.padded:
        rows["F.scaled_dot_product_attention, default dispatch, fwd+bwd"] = trained(
            lambda: F.scaled_dot_product_attention(q, k, v)
        )
        aten = backend.aten_op
        if aten is not None and device == "cuda":
            rows[f"torch.{aten.__name__}, the op SDPA's dispatch calls, fwd+bwd"] = trained(
                lambda: aten(q, k, v, None, True)[0]
            )
    module = getattr(backend, "module", None)
    if module is not None and not chosen.padded:
        function = importlib.import_module(module).flash_attn_func
        rows[f"{module}.flash_attn_func, fwd+bwd"] = trained(lambda: function(q, k, v))
    if not chosen.padded:
        rows[f"{chosen.backend} backend object, run(), fwd+bwd"] = trained(lambda: backend.run(q, k, v, call))
    if layout == "bhsd":  # bshd tensors, as a model holds them: attnselect permutes, F.sdpa gets the views
        qs, ks, vs = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        grad_s = grad.transpose(1, 2).contiguous()

        def bshd_step(forward):
            return lambda: torch.autograd.grad(forward(), (qs, ks, vs), grad_s)

        rows["attnselect.attention, layout=bshd, fwd+bwd"] = bshd_step(lambda: attnselect.attention(qs, ks, vs))
        if kernel is not None and not chosen.padded:
            rows["F.scaled_dot_product_attention on bshd's transposed views, out back to bshd, fwd+bwd"] = bshd_step(
                lambda: F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qs, ks, vs))).transpose(1, 2)
            )
    return problem, chosen, rows


def _prepared_runner(call, known: tuple):
    """The runner attnselect.attention prepared for ``call()`` (recall's arguments ``known``) and runs on its
    repeats."""
    call()
    return dispatch.recall(*known).runner


def packed_rows(device: str, forced: str | None = None):
    """The packed case's rows: attnselect's automatic choice, or the call with ``backend=forced``, first."""
    dtype = torch.bfloat16
    lengths = [100, 300, 400, 224]
    m = max(lengths)
    cu = torch.tensor([0, 100, 400, 800, 1024], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(1024, 16, 128, device=device, dtype=dtype) for _ in range(3))
    shape = dict(layout="thd", cu_seqlens_q=cu, causal=True, max_seqlen_q=m, max_seqlen_kv=m)
    problem, packing = describe_call(q, k, v, CallOptions(**shape))
    chosen = attnselect.select(problem, backend=forced).chosen
    backend = backends.get(chosen.backend)
    call = kernel_call(problem)
    kwargs = dict(shape, backend=forced)
    name = f"attnselect.attention ({chosen}{', forced' if forced else ''})"
    rows = {name: lambda: attnselect.attention(q, k, v, **kwargs)}
    module = getattr(backend, "module", None)
    if module is not None and not chosen.padded:
        function = importlib.import_module(module).flash_attn_varlen_func
        rows[f"{module}.flash_attn_varlen_func"] = lambda: function(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m, causal=True
        )
    buckets = backend.shape_cache.buckets if backend.shape_cache is not None else None
    if chosen == attnselect.Candidate("cudnn_frontend"):  # the package's op, as the backend calls it
        import cudnn

        def op(p):
            return cudnn.sdpa_torch(
                q, k, v, scale=call.scale, is_causal=True, cu_seqlens_q=p.cu_seqlens_q,
                cu_seqlens_kv=p.cu_seqlens_kv, max_seqlen_q=p.max_seqlen_q, max_seqlen_kv=p.max_seqlen_kv,
            )  # fmt: skip

        rows["cudnn.sdpa_torch"] = lambda: op(packing)
        if buckets is not None:
            padded = bucketed(packing, buckets)
            rows["cudnn.sdpa_torch on the boundaries attnselect's buckets give it"] = lambda: op(padded)
    if not chosen.padded and backend.packs_thd(attnselect.Target.current()):
        rows[f"{chosen.backend} backend object, run_packed()"] = lambda: backend.run_packed(
            q, k, v, call, bucketed(packing, buckets) if buckets else packing
        )
    known = (q, k, v, CallOptions(**shape, backend=forced))
    runner = _prepared_runner(lambda: attnselect.attention(q, k, v, **kwargs), known)
    rows["attnselect's prepared runner alone (no lookup)"] = lambda: runner(q, k, v, cu, m, m)
    if chosen == attnselect.Candidate("varlen_fa2"):  # the op, with the arguments a causal call needs
        op = torch.ops.aten._flash_attention_forward.default
        rows["torch aten._flash_attention_forward"] = lambda: op(q, k, v, cu, cu, m, m, 0.0, True, False,
                                                                 scale=call.scale)  # fmt: skip
    from torch.nn.attention.varlen import varlen_attn

    rows["torch varlen_attn"] = lambda: varlen_attn(q, k, v, cu, cu, m, m, window_size=(-1, 0))
    rows["attnselect's memo lookup alone (dispatch.recall, no kernel)"] = lambda: dispatch.recall(*known)
    return problem, chosen, rows


def new_packings(total: int, count: int, device: str) -> list:
    """``count`` packings of ``total`` tokens, as (cu_seqlens, longest), no two with the same number of documents
    (1 to 8) and longest document: a call on each is one attnselect's memo has not seen (it keys packed calls on
    both), the first layer of a training step whose documents changed."""
    g = torch.Generator().manual_seed(0)
    shapes = [(n, longest) for n in range(1, 9) for longest in range(-(-total // n), total - n + 2)]
    shapes = [shapes[i] for i in torch.randperm(len(shapes), generator=g)[:count].tolist()]
    if len(shapes) < count:
        raise SystemExit(f"{total} tokens make {len(shapes)} distinct packings, fewer than the {count} asked for")
    packings = []
    for n, longest in shapes:
        lengths, rest = [longest], total - longest
        for i in range(n - 1, 0, -1):  # the rest in n - 1 documents, none longer than the longest, none empty
            low, high = max(1, rest - longest * (i - 1)), min(longest, rest - (i - 1))
            lengths.append(int(torch.randint(low, high + 1, (), generator=g)))
            rest -= lengths[-1]
        edges = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        assert int(edges[-1]) == total and max(lengths) == longest
        packings.append((edges.to(device), longest))
    return packings


def new_packing_rows(device: str, training: bool, calls: int):
    """The packed case with a new packing on every call (:func:`new_packings`, made before the rounds: a data
    loader's work): 1024 tokens (CUDA, H16, 128/128 bf16; CPU: 256 tokens), causal, both max_seqlen given. Rows:
    attnselect, the chosen package's varlen function or op called directly (CUDA), and torch's varlen_attn (CUDA);
    each a forward and a backward in training. ``calls``: how many calls the attnselect row makes in all."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    heads, total = (16, 1024) if device == "cuda" else (2, 256)
    packings = new_packings(total, calls, device)
    q, k, v = (torch.randn(total, heads, 128 if device == "cuda" else 16, device=device, dtype=dtype) for _ in range(3))
    inputs = tuple(t.requires_grad_(training) for t in (q, k, v))

    def row(forward):
        turn = iter(packings)

        def step():
            out = forward(*next(turn))
            out = out[0] if isinstance(out, tuple) else out
            return torch.autograd.grad(out, inputs, out) if training else out

        return step

    cu, m = packings[0]
    problem, _ = describe_call(q, k, v, CallOptions("thd", True, cu_seqlens_q=cu, max_seqlen_q=m, max_seqlen_kv=m))
    chosen = attnselect.select(problem).chosen
    rows = {f"attnselect.attention ({chosen}), a new packing each call": row(
        lambda cu, m: attnselect.attention(q, k, v, layout="thd", cu_seqlens_q=cu, causal=True, max_seqlen_q=m,
                                           max_seqlen_kv=m)
    )}  # fmt: skip
    backend = backends.get(chosen.backend)
    module = getattr(backend, "module", None)
    if module is not None and not chosen.padded:
        function = importlib.import_module(module).flash_attn_varlen_func
        rows[f"{module}.flash_attn_varlen_func, a new packing each call"] = row(
            lambda cu, m: function(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m,
                                   causal=True)
        )  # fmt: skip
    if chosen == attnselect.Candidate("cudnn_frontend"):
        import cudnn

        scale = kernel_call(problem).scale
        rows["cudnn.sdpa_torch, a new packing each call"] = row(
            lambda cu, m: cudnn.sdpa_torch(q, k, v, scale=scale, is_causal=True, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                           max_seqlen_q=m, max_seqlen_kv=m)
        )  # fmt: skip
    if device == "cuda":
        from torch.nn.attention.varlen import varlen_attn

        rows["torch varlen_attn, a new packing each call"] = row(
            lambda cu, m: varlen_attn(q, k, v, cu, cu, m, m, window_size=(-1, 0))
        )
    name = f"thd 1 to 8 documents in {total} tokens, a new packing each call, Hq=Hkv={heads} causal " + (
        "training" if training else "inference"
    )
    return name, chosen, rows


def write_report(out: str | None, report: dict, lines: list[str]) -> None:
    """Print the report's lines; with ``out``, write them to ``out``.md and the report to ``out``.json."""
    print("\n".join(lines))
    if out:
        Path(out + ".json").write_text(json.dumps(report, indent=1))
        Path(out + ".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--packed-calls", type=int, default=100, help="calls a round of the packed case (slower calls)")
    ap.add_argument("--packed-repeats", type=int, default=151)
    ap.add_argument("--training-calls", type=int, default=100, help="calls a round of the dense training case")
    ap.add_argument("--new-packing-calls", type=int, default=20, help="calls a round of the new-packing cases")
    ap.add_argument("--new-packing-repeats", type=int, default=31)
    ap.add_argument("--out", help="write .json and .md here")
    ap.add_argument("--profile", action="store_true", help="add cProfile's top functions of each attnselect row")
    ap.add_argument("--profile-sort", default="tottime", help="cProfile's order (tottime, cumulative)")
    ap.add_argument("--profile-lines", type=int, default=25)
    ap.add_argument("--only", help="only the cases whose name holds this text (after the rows are built)")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.no_grad():  # as the rows run: the prepared runners are those of inference
        cases = [(*dense_rows(device), a.calls, a.repeats, False)]
        cases.append((*dense_bshd_rows(device), max(a.calls // 5, 1), a.repeats, False))
        if device == "cuda":
            cases.append((*packed_rows(device), a.packed_calls, a.packed_repeats, False))
            if cases[-1][1].backend != "cudnn_frontend" and attnselect.Target.current().version(
                "nvidia-cudnn-frontend"
            ):
                cases.append((*packed_rows(device, forced="cudnn_frontend"), a.packed_calls, a.packed_repeats, False))
        if device == "cuda" and attnselect.Target.current().version("flash-attn-4"):
            cases.append((*dense_forced_rows(device, "flash_attn4"), a.calls // 5, a.repeats, False))
    new = (a.new_packing_calls, a.new_packing_repeats)
    packings = WARMUP + new[0] * (new[1] + 1)  # each row's calls: its warm-up, the rounds, a profile's round
    cases.append((*new_packing_rows(device, False, packings), *new, False))
    cases.append((*dense_training_rows(device), a.training_calls, a.repeats, True))
    cases.append((*new_packing_rows(device, True, packings), *new, True))
    report = {
        "meta": {"device": attnselect.Target.current().describe(), "date": time.strftime("%Y-%m-%d")},
        "cases": [],
    }  # fmt: skip
    lines = [
        "# Hot path: host time per repeated call\n",
        f"{report['meta']['device']}, {report['meta']['date']}. Each row timed as a number of calls from an empty "
        "queue, in interleaved rounds in alternating order, garbage collector off: median host us per call "
        "(quartiles), the median with the round's closing sync (a GPU-bound row shows its GPU time there), and "
        "attnselect's row minus each row, the median of the per-round differences of host time (quartiles). "
        "Produced by `benchmarks/hot_path.py`.\n",
    ]
    for problem, chosen, rows, calls, repeats, training in cases:
        described = problem if isinstance(problem, str) else problem.describe()
        if a.only and a.only not in described:
            continue
        with torch.set_grad_enabled(training):
            timed = time_rows(rows, device, calls, repeats)
            report["cases"].append(
                {"problem": described, "chosen": str(chosen), "calls": calls, "repeats": repeats, "rows": timed}
            )  # fmt: skip
            lines += [f"\n## {described}: {chosen}\n", f"{calls} calls a round, {repeats} rounds.\n",
                      "| row | host us per call | with the sync | attnselect minus this row, host us |",
                      "|---|---|---|---|"]  # fmt: skip
            for name, r in timed.items():
                d = r["first_minus_this"]
                diff = f"{d['median']:+.1f} ({d['q1']:+.1f}..{d['q3']:+.1f})"
                diff = "" if name == next(iter(timed)) else diff
                host = f"{r['us']:.1f} ({r['q1']:.1f}..{r['q3']:.1f})"
                lines.append(f"| {name} | {host} | {r['synced_us']:.1f} | {diff} |")
            if a.profile:
                name, fn = next(iter(rows.items()))
                heading = f"\ncProfile of `{name}`, {calls} calls, top {a.profile_lines} by {a.profile_sort}:\n"
                lines += [heading, "```", profile(fn, calls, a.profile_sort, a.profile_lines), "```"]
    write_report(a.out, report, lines)


if __name__ == "__main__":
    main()

"""One context-parallel call of :func:`attnselect.attention`: its checks, each chunk pair's decision, the ring.

Every check runs before any communication, and every rank makes the same decisions (the rules read shapes and
options only, which the ranks share; the measure policy broadcasts rank 0's timings). The first call of each shape
checks, with one small all-reduce, that every rank of the group passes the same shapes, options and choices.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections import OrderedDict

import torch
import torch.distributed as dist

from attnselect.call import require
from attnselect.context_parallel.ring import Halves, Ring, RingAttention, thd_halves
from attnselect.execution import apply_sinks, kernel_call, run_call
from attnselect.inputs import DENSE_AXES, lengths_of, packing_facts
from attnselect.problem import AttentionProblem, describe_call
from attnselect.selection import select, select_packed
from attnselect.target import target_for_device


def group_size(group) -> int:
    """The size of ``cp_group``, checked to be a process group this process belongs to."""
    require(isinstance(group, dist.ProcessGroup), "cp_group", type(group).__name__,
            "None or a torch.distributed ProcessGroup (e.g. Megatron's context-parallel group)")  # fmt: skip
    require(dist.get_rank(group) >= 0, "cp_group", "a group without this process", "a group this process is in")
    return dist.get_world_size(group)


def attention(q, k, v, *, cp_group, backend, pad, disable, **described):
    """``(out, lse, *max_logit)`` of this rank's shard (``described``: attention()'s options that describe a
    problem); lse in float32 (float64 for float64 input), carrying a gradient."""
    size, rank = group_size(cp_group), dist.get_rank(cp_group)
    problem, packing = describe_call(q, k, v, context_parallel_size=size, **described)
    layout, causal = problem.layout, problem.mask == "causal"
    lengths = _refuse_unsupported(problem, packing, q, k, described)
    target = target_for_device(q.device)
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    pairs, chosen = {}, []
    for kind, (pair, pair_packing) in _pairs(problem, packing, lengths, training).items():
        decide = select if layout != "thd" else select_packed
        candidate = decide(pair, target=target, backend=backend, pad=pad, disable=disable).chosen
        call = kernel_call(pair, described.get("scale"), described.get("softcap"))
        pairs[kind] = functools.partial(run_call, candidate, pair, call, packing=pair_packing, target=target)
        chosen.append(f"{kind}: {candidate}")
    shapes = f"{problem.describe()}, q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}"
    _check_ranks_agree(cp_group, rank, q, shapes, _signature(shapes, described, chosen))
    halves = None
    if causal:
        halves = (
            Halves(layout, q.shape[DENSE_AXES[layout][1]])
            if layout != "thd"
            else thd_halves(packing.cu_seqlens_q, q.shape[0])
        )
    ring = Ring(cp_group, rank, size, causal, layout, halves, pairs)
    if training:
        out, lse, *max_logit = RingAttention.apply(q, k, v, ring)
    else:
        out, lse, max_logit = ring.forward(q, k, v)
    sinks = described.get("sinks")
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks, layout)
    return out, lse, *max_logit


def _refuse_unsupported(problem: AttentionProblem, packing, q, k, described) -> tuple[list, list] | None:
    """Refuse what the ring does not serve; return the local (q, kv) sequence lengths of thd when they can be read
    without a sync (None: trusted, as attention() trusts both max_seqlen on a GPU)."""
    n = problem.context_parallel_size
    require(problem.window is None, "window", f"{problem.window} with cp_group",
            "None: sliding windows are not served under context parallelism yet")  # fmt: skip
    require(problem.mask in ("none", "causal"), "causal", f"{described.get('causal')!r} with cp_group",
            "False or True (top-left): bottom-right causal is not served under context parallelism yet")  # fmt: skip
    require(problem.dropout_p == 0.0, "dropout_p", f"{problem.dropout_p} with cp_group",
            "0.0: the ring's backward recomputes each chunk pair, which would draw a new dropout mask")  # fmt: skip
    require(not problem.cuda_graph_capture, "cp_group", "a call under CUDA graph capture",
            "a call outside capture: the ring checks its ranks on the host")  # fmt: skip
    if problem.layout != "thd":
        axis = DENSE_AXES[problem.layout][1]
        for name, t in (("q", q), ("k", k)):
            require(t.shape[axis] % 2 == 0, f"{name}.shape", f"a local sequence length of {t.shape[axis]}",
                    f"an even one: the global length is cut into {2 * n} chunks, 2 per rank")  # fmt: skip
        require(problem.mask == "none" or problem.seqlen_q == problem.seqlen_kv, "k.shape",
                f"{problem.seqlen_kv} local keys for {problem.seqlen_q} queries",
                "as many keys as queries under a causal mask with cp_group")  # fmt: skip
        return None
    require(not packing.has_gaps, "cu_seqlens_q_padded/cu_seqlens_kv_padded", "gaps between sequences",
            f"none with cp_group: pad each sequence to a multiple of {2 * n} tokens and pass it whole")  # fmt: skip
    require(problem.mask == "none" or packing.cu_seqlens_kv is packing.cu_seqlens_q, "cu_seqlens_kv",
            "keys with boundaries of their own", "None or the queries' boundaries under a causal mask with "
            "cp_group (self-attention)")  # fmt: skip
    trusted = (
        q.device.type != "cpu"
        and described.get("max_seqlen_q") is not None
        and (described.get("max_seqlen_kv") is not None)
    )
    if trusted:  # no host read: the boundaries are trusted, as attention() trusts them; the longest is checked
        for name in ("max_seqlen_q", "max_seqlen_kv"):
            require(described[name] % 2 == 0, name, described[name], f"an even local length (global / {n})")
        return None
    lengths = []
    for name, cu in (("cu_seqlens_q", packing.cu_seqlens_q), ("cu_seqlens_kv", packing.cu_seqlens_kv)):
        local = lengths_of(cu.tolist())
        odd = [length for length in local if length % 2]
        require(not odd, name, f"local sequence lengths {odd[:4]}",
                f"even ones: every global length a multiple of {2 * n} (2 chunks per rank)")  # fmt: skip
        lengths.append(local)
    return lengths[0], lengths[1]


def _pairs(problem: AttentionProblem, packing, lengths, training: bool) -> dict:
    """kind -> (problem, packing) of the chunk pairs the ring runs (ring.py's schedule)."""
    base = dataclasses.replace(problem, return_lse=True, sinks=False, training=training, window=None)
    if problem.mask == "none":
        return {"full": (base, packing)}
    if problem.layout != "thd":
        return {
            "diagonal": (base, None),
            "kv_half": (dataclasses.replace(base, mask="none", seqlen_kv=problem.seqlen_kv // 2), None),
            "q_half": (dataclasses.replace(base, mask="none", seqlen_q=problem.seqlen_q // 2), None),
        }
    cu = packing.cu_seqlens_q
    half = torch.div(cu, 2, rounding_mode="floor")
    halved = None if lengths is None else [n // 2 for n in lengths[0]]
    facts = functools.partial(packing_facts, "none", None)
    kv_half = dataclasses.replace(base, mask="none", seqlen_kv=problem.seqlen_kv // 2,
                                  **facts(*((None, None) if lengths is None else (lengths[0], halved))))  # fmt: skip
    q_half = dataclasses.replace(base, mask="none", seqlen_q=problem.seqlen_q // 2,
                                 **facts(*((None, None) if lengths is None else (halved, lengths[0]))))  # fmt: skip
    return {
        "diagonal": (base, packing),
        "kv_half": (kv_half, dataclasses.replace(packing, cu_seqlens_kv=half, offsets_kv=half,
                                                 max_seqlen_kv=problem.seqlen_kv // 2)),
        "q_half": (q_half, dataclasses.replace(packing, cu_seqlens_q=half, offsets_q=half,
                                               max_seqlen_q=problem.seqlen_q // 2)),
    }  # fmt: skip


def _signature(shapes: str, described: dict, chosen: list) -> str:
    """What every rank's call must share, as text: the problem and shapes, the options and the choices."""
    options = {name: tuple(value.shape) if isinstance(value, torch.Tensor) else value
               for name, value in described.items()}  # fmt: skip
    return f"{shapes} {options} {chosen}"


# (group, signature) pairs every rank of the group was found to share, the oldest first
_AGREED: OrderedDict[tuple, None] = OrderedDict()
_AGREED_SIZE = 4096


def _check_ranks_agree(group, rank: int, q, shapes: str, signature: str) -> None:
    """On the first call of each signature: one all-reduce of its checksum (MAX of it and of its negation), a host
    read of two integers (packed calls whose packing sizes change every step pay it once a step)."""
    if (group, signature) in _AGREED:
        _AGREED.move_to_end((group, signature))
        return
    checksum = zlib.crc32(signature.encode())
    device = q.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    seen = torch.tensor([checksum, -checksum], dtype=torch.int64, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    highest, lowest = seen.tolist()
    require(highest == checksum and -lowest == checksum, "cp_group",
            f"ranks whose calls differ (rank {rank}: {shapes})",
            "every rank to pass its shard of the same call: equal shapes, options and packing sizes")  # fmt: skip
    _AGREED[(group, signature)] = None
    if len(_AGREED) > _AGREED_SIZE:
        _AGREED.popitem(last=False)

"""One context-parallel call of :func:`attnselect.attention`: its checks, each chunk pair's decision, the ring.

Every rank validates its shard and decides each chunk pair's kernel (the rules read shapes and options only, which
the ranks share; the measure policy broadcasts rank 0's timings), then one small all-reduce checks, before the ring
starts, that every rank passes the same call (shapes, options, the boundaries it read, the choices) and that none
refused it: a mismatch, or a refusal on any rank, raises on every rank. Over NCCL that all-reduce, whose result the
host reads (a sync), runs on the first call of each signature only; a rank that diverges on a later call is then
not caught, and the ring fails or waits for the group's timeout.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections import OrderedDict

import torch
import torch.distributed as dist

from attnselect.choose.selection import select, select_packed
from attnselect.context_parallel.ring import Halves, Ring, RingAttention, thd_halves
from attnselect.errors import AttnSelectError, InvalidInputError
from attnselect.execution import apply_sinks, kernel_call, run_call
from attnselect.memos import TensorMemo
from attnselect.spec.options import DESCRIBING, CallOptions, require
from attnselect.spec.problem import AttentionProblem, describe_call
from attnselect.spec.target import target_for_device
from attnselect.spec.validate import DENSE_AXES, lengths_of, packing_facts


def group_size(group) -> int:
    """The size of ``cp_group``, checked to be a process group this process belongs to."""
    require(isinstance(group, dist.ProcessGroup), "cp_group", type(group).__name__,
            "None or a torch.distributed ProcessGroup (e.g. Megatron's context-parallel group)")  # fmt: skip
    require(dist.get_rank(group) >= 0, "cp_group", "a group without this process", "a group this process is in")
    return dist.get_world_size(group)


def attention(q, k, v, options: CallOptions):
    """``(out, lse, *max_logit)`` of this rank's shard for a ``cp_group`` (of ``options``) that :func:`group_size`
    checked and found larger than one; lse in float32 (float64 for float64 input), carrying a gradient."""
    cp_group = options.cp_group
    size, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    # the ring trains q, k and v; sinks that alone need a gradient get it from the merged result (apply_sinks)
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    facts, refused = [f"training={training}"], None
    try:
        problem, packing = describe_call(q, k, v, options, context_parallel_size=size)
        lengths = _local_lengths(problem, packing, q, options)
        facts.append(f"lengths={lengths}")
        _refuse_unsupported(problem, packing, q, k, lengths, options)
        halves = _halves(problem, packing, q)
        target = target_for_device(q.device)
        pairs = _chunk_kernels(problem, packing, halves, lengths, training, target, options)
        facts += [f"{kind}: {run.args[0]}" for kind, run in pairs.items()]
    except AttnSelectError as exc:  # every rank learns of it before any rank starts the ring
        refused = exc
    _check_ranks_agree(cp_group, rank, q, k, v, options, facts, refused)
    ring = Ring(cp_group, rank, size, problem.mask == "causal", problem.layout, halves, pairs)
    if training:
        out, lse, *max_logit = RingAttention.apply(q, k, v, ring)
    else:
        out, lse, max_logit = ring.forward(q, k, v)
    sinks = options.sinks
    if sinks is not None:  # each rank's sinks gradient is its share: the group's sum is the whole one
        out, lse = apply_sinks(out, lse, sinks, problem.layout)
    return out, lse, *max_logit


def _local_lengths(problem: AttentionProblem, packing, q, options: CallOptions) -> tuple[list, list] | None:
    """The local (q, kv) sequence lengths of a thd shard, read on the host (on a GPU a sync, as validation's own read
    there); None for dense input, and where attention() trusts the boundaries (both max_seqlen given on a GPU)."""
    if problem.layout != "thd":
        return None
    if q.device.type != "cpu" and options.max_seqlen_q is not None and options.max_seqlen_kv is not None:
        return None
    bounds_q = packing.cu_seqlens_q.tolist()
    same = packing.cu_seqlens_kv is packing.cu_seqlens_q
    return lengths_of(bounds_q), lengths_of(bounds_q if same else packing.cu_seqlens_kv.tolist())


def _refuse_unsupported(problem: AttentionProblem, packing, q, k, lengths, options: CallOptions) -> None:
    """Refuse what the ring does not serve, naming the argument."""
    n = problem.context_parallel_size
    problem.check_context_parallel()
    if problem.layout != "thd":
        axis = DENSE_AXES[problem.layout][1]
        for name, t in (("q", q), ("k", k)):
            require(t.shape[axis] % 2 == 0, f"{name}.shape", f"a local sequence length of {t.shape[axis]}",
                    f"an even one: the global length is cut into {2 * n} chunks, 2 per rank")  # fmt: skip
        require(problem.mask == "none" or problem.seqlen_q == problem.seqlen_kv, "k.shape",
                f"{problem.seqlen_kv} local keys for {problem.seqlen_q} queries",
                "as many keys as queries under a causal mask with cp_group")  # fmt: skip
        return
    require(not packing.has_gaps, "cu_seqlens_q_padded/cu_seqlens_kv_padded", "gaps between sequences",
            f"none with cp_group: pad each sequence to a multiple of {2 * n} tokens and pass it whole")  # fmt: skip
    require(problem.mask == "none" or packing.cu_seqlens_kv is packing.cu_seqlens_q, "cu_seqlens_kv",
            "keys with boundaries of their own", "None or the queries' boundaries under a causal mask with "
            "cp_group (self-attention)")  # fmt: skip
    if lengths is None:  # trusted boundaries: only the longest is checked
        for name in ("max_seqlen_q", "max_seqlen_kv"):
            value = getattr(options, name)
            require(value % 2 == 0, name, value, f"an even local length (global / {n})")
        return
    for name, local in zip(("cu_seqlens_q", "cu_seqlens_kv"), lengths):
        odd = [length for length in local if length % 2]
        require(not odd, name, f"local sequence lengths {odd[:4]}",
                f"even ones: every global length a multiple of {2 * n} (2 chunks per rank)")  # fmt: skip


# A shard's halves per boundary tensor, so every layer of a step shares them (and what kernels derive from them)
_HALVES = TensorMemo()


def _halves(problem: AttentionProblem, packing, q) -> Halves | None:
    """Where the shard's two chunks lie (causal only: the other schedules take whole shards)."""
    if problem.mask != "causal":
        return None
    if problem.layout != "thd":
        return Halves(problem.layout, q.shape[DENSE_AXES[problem.layout][1]])
    cu = packing.cu_seqlens_q
    return _HALVES.get((cu,), q.shape[0], lambda: thd_halves(cu, q.shape[0]))


def _chunk_kernels(problem, packing, halves, lengths, training, target, options: CallOptions) -> dict:
    """kind -> run(q, k, v) of each chunk pair the ring runs (ring.py's schedule), on attnselect's choice."""
    base = dataclasses.replace(problem, return_lse=True, sinks=False, training=training)
    if problem.mask == "none":
        pairs = {"full": (base, packing)}
    elif problem.layout != "thd":
        pairs = {
            "diagonal": (base, None),
            "kv_half": (dataclasses.replace(base, mask="none", seqlen_kv=problem.seqlen_kv // 2), None),
            "q_half": (dataclasses.replace(base, mask="none", seqlen_q=problem.seqlen_q // 2), None),
        }
    else:
        pairs = {"diagonal": (base, packing), **_thd_halves_pairs(base, packing, halves, lengths)}
    runs = {}
    for kind, (pair, pair_packing) in pairs.items():
        decide = select if pair.layout != "thd" else select_packed
        o = options
        candidate = decide(pair, target=target, backend=o.backend, pad=o.pad, disable=o.disable).chosen
        call = kernel_call(pair, o.scale, o.softcap)
        runs[kind] = functools.partial(run_call, candidate, pair, call, packing=pair_packing, target=target)
    return runs


def _thd_halves_pairs(base: AttentionProblem, packing, halves: Halves, lengths) -> dict:
    """The causal thd steps after the first: all queries against the keys' first halves, and the queries' second
    halves against all keys, with their packings and facts (no mask; every query sees a key)."""
    full = None if lengths is None else lengths[0]
    half = None if lengths is None else [n // 2 for n in full]
    h, s_q, s_kv = halves.boundaries, base.seqlen_q, base.seqlen_kv
    return {
        "kv_half": (
            dataclasses.replace(base, mask="none", seqlen_kv=s_kv // 2, **packing_facts("none", None, full, half)),
            packing._replace(cu_seqlens_kv=h, offsets_kv=h, max_seqlen_kv=s_kv // 2),
        ),
        "q_half": (
            dataclasses.replace(
                base, mask="none", seqlen_q=s_q // 2, tokens=base.tokens // 2, **packing_facts("none", None, half, full)
            ),
            packing._replace(cu_seqlens_q=h, offsets_q=h, max_seqlen_q=s_q // 2),
        ),
    }


# (group, signature) pairs every rank of an NCCL group was found to share, the oldest first
_AGREED: OrderedDict[tuple, None] = OrderedDict()
_AGREED_SIZE = 4096


def _check_ranks_agree(group, rank: int, q, k, v, options: CallOptions, facts: list, refused) -> None:
    """One all-reduce (MAX) of [checksum, -checksum, refused] over the group: raise on every rank when the ranks'
    calls differ in their shapes, the options that describe them, or any rank refused its own (module docstring: once
    per signature over NCCL)."""
    described = {name: getattr(options, name) for name in DESCRIBING}
    described = {name: tuple(x.shape) if isinstance(x, torch.Tensor) else x for name, x in described.items()}
    shapes = f"q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}"
    signature = f"{shapes} {described} {facts}"
    nccl = dist.get_backend(group) == "nccl"
    if nccl and refused is None and (group, signature) in _AGREED:
        _AGREED.move_to_end((group, signature))
        return
    checksum = zlib.crc32(signature.encode())
    seen = torch.tensor([checksum, -checksum, refused is not None], dtype=torch.int64,
                        device=q.device if nccl else torch.device("cpu"))  # fmt: skip
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    highest, lowest, any_refused = seen.tolist()
    if refused is not None:
        raise refused
    if any_refused:
        raise InvalidInputError(
            f"cp_group: got a call another rank refused (rank {rank} passed {shapes}), expected every rank to pass a "
            "shard it accepts: that rank's error names the argument"
        )
    require(highest == checksum and -lowest == checksum, "cp_group", f"ranks whose calls differ (rank {rank}: "
            f"{shapes}, {facts[1] if len(facts) > 1 else ''})", "every rank to pass its shard of the same call: "
            "equal shapes, options and local boundaries")  # fmt: skip
    if nccl:
        _AGREED[(group, signature)] = None
        if len(_AGREED) > _AGREED_SIZE:
            _AGREED.popitem(last=False)

"""Running one candidate exactly: layout changes, zero-padding and trimming, packed or per-sequence THD.

Padding zero-pads the last dim on the right; QK^T is unchanged, so with the scale kept at
1/sqrt(original d_qk) the output (trimmed to d_v) and the lse equal the native ones, and
the gradients reach only the original widths (F.pad's backward slices).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnselect.backends.base import get as backend_named
from attnselect.backends.shape_cache import bucketed
from attnselect.spec.options import Candidate, KernelCall, Packing
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target, target_for_device
from attnselect.spec.validate import check_boundaries, check_offsets, lengths_of

# Permutation taking a dense layout to another: _PERMUTE[(src, dst)].
_PERMUTE = {
    ("bshd", "bhsd"): (0, 2, 1, 3),
    ("sbhd", "bhsd"): (1, 2, 0, 3),
    ("bhsd", "bhsd"): None,
    ("bshd", "bshd"): None,
    ("sbhd", "bshd"): (1, 0, 2, 3),
    ("bhsd", "bshd"): (0, 2, 1, 3),
}
_INVERSE = {
    ("bhsd", "bshd"): (0, 2, 1, 3),
    ("bhsd", "sbhd"): (2, 0, 1, 3),
    ("bshd", "sbhd"): (1, 0, 2, 3),
    ("bshd", "bhsd"): (0, 2, 1, 3),
}


def run_candidate(
    candidate: Candidate,
    problem: AttentionProblem,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    packing: Packing | None = None,
    target: Target | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``candidate`` on validated tensors; returns (out, lse or None) in the caller's layout.

    ``packing`` is required for thd (see :func:`attnselect.spec.problem.describe_call`).
    """
    return run_call(candidate, problem, kernel_call(problem, scale), q, k, v, packing=packing, target=target)


def kernel_call(problem: AttentionProblem, scale: float | None = None, softcap: float | None = None) -> KernelCall:
    return KernelCall(
        mask=problem.mask,
        window=problem.window,
        scale=problem.default_scale if scale is None else float(scale),
        dropout_p=problem.dropout_p,
        return_lse=problem.return_lse or problem.sinks,  # sinks rescale the output by the lse (apply_sinks)
        deterministic=problem.deterministic,
        softcap=float(softcap) if softcap is not None else TIMING_SOFTCAP if problem.softcap else None,
        return_max_logit=problem.return_max_logit,
    )


TIMING_SOFTCAP = 50.0  # a softcap problem timed without a value (Gemma 2's attn_logit_softcapping)


def apply_sinks(out, lse, sinks, layout: str):
    """Learnable sinks as gpt-oss defines them: each head's sink logit joins every row's softmax denominator and
    is then dropped, so ``out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink)`` and the new lse is
    ``logaddexp(lse, sink)`` (transformers' flex integration, gpt-oss). Exact, and differentiable through the
    lse (rows that see no key keep a zero output). ``lse`` is (B, Hq, Sq), or (Hq, T) for thd."""
    sink = sinks.to(lse.dtype)
    sink = sink[:, None] if layout == "thd" else sink[None, :, None]
    weight = lse_as_rows(torch.sigmoid(lse - sink), layout)
    return out * weight[..., None].to(out.dtype), torch.logaddexp(lse, sink)


def lse_as_rows(lse: torch.Tensor, layout: str) -> torch.Tensor:
    """An lse-shaped tensor, (B, Hq, Sq) or (Hq, T) for thd, with its axes in the order of the output's rows
    (``out.shape[:-1]`` in ``layout``): a view."""
    return lse.permute(_LSE_TO_OUT[layout])


def rows_as_lse(rows: torch.Tensor, layout: str) -> torch.Tensor:
    """The inverse of :func:`lse_as_rows`."""
    return rows.permute(_OUT_TO_LSE[layout])


_LSE_TO_OUT = {"thd": (1, 0), "bshd": (0, 2, 1), "bhsd": (0, 1, 2), "sbhd": (2, 0, 1)}
_OUT_TO_LSE = {"thd": (1, 0), "bshd": (0, 2, 1), "bhsd": (0, 1, 2), "sbhd": (1, 2, 0)}


def run_call(
    candidate: Candidate,
    problem: AttentionProblem,
    call: KernelCall,
    q,
    k,
    v,
    *,
    packing: Packing | None = None,
    target: Target | None = None,
):
    """:func:`run_candidate` with the kernel options already built."""
    backend = backend_named(candidate.backend)
    if problem.layout != "thd":
        return dense_runner(backend, candidate.pad_to, problem.layout, call)(q, k, v)
    if backend.packs_thd(target or target_for_device(q.device)):
        return packed_runner(backend, candidate.pad_to, call)(q, k, v, packing)
    return _run_per_sequence(backend, candidate.pad_to, problem, call, q, k, v, packing)


def packed_runner(backend, pad_to, call: KernelCall, *, like: tuple | None = None):
    """``run(q, k, v, packing) -> (out, lse)`` of a backend's packed kernel for one call's options.

    ``like``: the first call's (q, k, v, packing) of calls that share its tensors' shapes, strides, dtypes and
    gradients, and whose one boundary tensor serves q, k and both offsets (attnselect.attention's memoized packed
    calls, a family at every packing's sizes). The runner is then ``run(q, k, v, cu_seqlens, max_seqlen_q,
    max_seqlen_kv)``, for any packing of those calls: a call pays for its boundaries (bucketing, where the backend
    buckets) once per boundary tensor and sizes (every layer of a step shares them), and a new packing whose choice
    is its family's runs the same runner."""
    kernel = backend.packed_runner(call, repeated=like is not None)
    buckets = backend.shape_cache.buckets if backend.shape_cache is not None else None  # few distinct shapes

    def run(q, k, v, packing):
        if q.shape[0] == 0 or k.shape[0] == 0:
            out, lse, *max_logit = _empty_result(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 1, call)
            return out[0], (lse[0] if lse is not None else None), *max_logit  # (1, H, T) -> (H, T)
        if buckets is not None:
            packing = bucketed(packing, buckets)
        if _plain_packed_call(pad_to, q, k, v):
            return kernel(q, k, v, packing)
        return _padded(lambda q, k, v: kernel(q, k, v, packing), pad_to, q, k, v)

    if like is None:
        return run
    first = like[3]
    cu = first.cu_seqlens_q
    if not (first.cu_seqlens_kv is cu and first.offsets_q is cu and first.offsets_kv is cu):
        raise ValueError("like: a repeated packed call has one boundary tensor for q, k and both offsets")
    if not _plain_packed_call(pad_to, *like[:3]):

        def run_padded(q, k, v, cu, max_q, max_kv):
            return run(q, k, v, Packing(cu, cu, max_q, max_kv, cu, cu))

        return run_padded
    # The last calls' (boundaries, their version, both max_seqlen, the packing the kernel got), newest first, in one
    # tuple a thread reads whole: a few, for packings that alternate (a pipeline's micro-batches, recomputation).
    recent = [()]

    def run_repeated(q, k, v, cu, max_q, max_kv):
        for seen in recent[0]:
            if cu is seen[0] and cu._version == seen[1] and max_q == seen[2] and max_kv == seen[3]:
                return kernel(q, k, v, seen[4])
        packing = Packing(cu, cu, max_q, max_kv, cu, cu)
        if buckets is not None:
            packing = bucketed(packing, buckets)
        # an inference tensor has no version to check, and an inference-mode result no autograd: not kept
        if not (cu.is_inference() or torch.is_inference_mode_enabled()):
            recent[0] = ((cu, cu._version, max_q, max_kv, packing), *recent[0][: RECENT_PACKINGS - 1])
        return kernel(q, k, v, packing)

    return run_repeated


RECENT_PACKINGS = 4  # boundaries a packed runner keeps worked out (bucketed): a step's layers share one


def _plain_packed_call(pad_to, q, k, v) -> bool:
    """Tokens to attend, no padding, the head dim at stride 1: the tensors reach the kernel as they are."""
    return q.shape[0] > 0 and k.shape[0] > 0 and pad_to is None and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1


def dense_runner(backend, pad_to, layout, call, *, like: tuple | None = None):
    """``run(q, k, v) -> (out, lse)`` for dense calls, with the layout permutations worked out once.

    ``like``: the first call's (q, k, v), whose shapes, strides, storage offsets, dtypes and gradients every call
    shares (attnselect.attention's memoized calls): the backend prepares its kernel for them here (``runner``'s
    ``like``, where they reach the kernel unpadded), and where they need no work the runner is that kernel (between
    the layout's permutations, or on bshd views through ``backend.bshd_runner``, checked for nothing again)."""
    to_kernel = _as_function(_PERMUTE[(layout, backend.layout)])
    from_kernel = _as_function(_INVERSE.get((backend.layout, layout)))
    seq_axis = 2 if backend.layout == "bhsd" else 1
    kernel_like = None
    if like is not None and pad_to is None:
        q, k, v = like if to_kernel is None else map(to_kernel, like)  # views: no work
        if q.shape[seq_axis] and k.shape[seq_axis] and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1:
            kernel_like = q, k, v  # what run() passes the kernel
    kernel = backend.runner(call, repeated=like is not None, like=kernel_like)
    if kernel_like is not None:  # every call is like the first: nothing to check again
        runner = kernel if to_kernel is None else _permuted(kernel, to_kernel, from_kernel)
        # the kernel's op on bshd views where the calls are permuted anyway: on the backend's own layout that op
        # costs four permutations more than the backend's runner (results/h200_hot_path_d7b14ce_fa4.md)
        direct = _bshd_runner(backend, layout, call, like) if layout != backend.layout else None
        return runner if direct is None else _unless_intercepted(direct, runner)

    def run(q, k, v):
        if to_kernel is not None:
            q, k, v = to_kernel(q), to_kernel(k), to_kernel(v)
        if q.shape[seq_axis] == 0 or k.shape[seq_axis] == 0:
            out, *stats = _empty_result(q, k, v, seq_axis, call)
        elif pad_to is None and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1:
            out, *stats = kernel(q, k, v)
        else:
            out, *stats = _padded(kernel, pad_to, q, k, v)
        return (from_kernel(out) if from_kernel is not None else out), *stats

    return run


def _permuted(kernel, to_kernel, from_kernel):
    """``kernel`` on the calls' tensors permuted to its layout, its output permuted back."""
    if from_kernel is None:
        return lambda q, k, v: kernel(to_kernel(q), to_kernel(k), to_kernel(v))

    def run(q, k, v):
        out, *stats = kernel(to_kernel(q), to_kernel(k), to_kernel(v))
        return from_kernel(out), *stats

    return run


def _unless_intercepted(direct, runner):
    """``direct`` (a kernel's own op), or ``runner`` (the backend's, reaching the op SDPA's dispatch calls) under a
    TorchDispatchMode or a functorch transform: those see ops by name or need their batching rules, which the
    kernels' own ops lack (selective activation checkpointing's save lists name SDPA's ops: torchtitan's
    _op_sac_save_list; vmap finds no batching rule for aten._efficient_attention_forward). Neither is in the memo's
    key, so each call looks (two C calls)."""
    modes, transforms = torch._C._len_torch_dispatch_stack, torch._C._functorch.peek_interpreter_stack

    def run(q, k, v):
        if modes() or transforms() is not None:
            return runner(q, k, v)
        return direct(q, k, v)

    return run


def _bshd_runner(backend, layout, call, like):
    """``run(q, k, v)`` through the backend's kernel on (batch, seq, heads, dim) views (``backend.bshd_runner``),
    the call's layout permuted to it: a bshd call reaches the kernel with no permutation at all. None where the
    backend has no such runner. For calls :func:`dense_runner` found to need no work (none empty, head dims at
    stride 1)."""
    to_bshd = _as_function(_PERMUTE[(layout, "bshd")])
    kernel = backend.bshd_runner(call, like if to_bshd is None else tuple(map(to_bshd, like)))  # views: no work
    if kernel is None or to_bshd is None:
        return kernel
    return _permuted(kernel, to_bshd, _as_function(_INVERSE[("bshd", layout)]))


def _as_function(perm):
    """A permutation as the cheapest call: a swap of two axes is a transpose (cheaper than permute)."""
    if perm is None:
        return None
    moved = [axis for axis, source in enumerate(perm) if axis != source]
    if len(moved) == 2:
        a, b = moved
        return lambda t: t.transpose(a, b)
    return lambda t: t.permute(perm)


def _padded(run, pad_to, q, k, v):
    """``run(q, k, v)`` with the head dim at stride 1, zero-padded to ``pad_to``, the output trimmed to d_v."""
    # Kernels read the head dim with stride 1 (sdp_utils check_last_dim_stride_equals_1).
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if pad_to is None:
        return run(q, k, v)
    d_v = v.shape[-1]
    out, *stats = run(*(t if t.shape[-1] == pad_to else F.pad(t, (0, pad_to - t.shape[-1])) for t in (q, k, v)))
    return out[..., :d_v], *stats  # zero-padded q and k leave every logit, so the lse and the max logit, unchanged


def _empty_result(q, k, v, seq_axis, call: KernelCall):
    """No queries, or no keys: zero output rows, lse = -inf and max logit = -inf (no visible key)."""
    out = _connected_zeros(list(q.shape[:-1]) + [v.shape[-1]], q, k, v)
    b, h, s = (q.shape[0], q.shape[1], q.shape[2]) if seq_axis == 2 else (q.shape[0], q.shape[2], q.shape[1])
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device) if call.return_lse else None
    if not call.return_max_logit:
        return out, lse
    return out, lse, torch.full((h,), float("-inf"), dtype=torch.float32, device=q.device)


def _connected_zeros(shape, q, k, v) -> torch.Tensor:
    """Zeros that keep autograd connected to q, k and v (empty sums are exact zeros), so they get zero gradients."""
    return q.new_zeros(shape) + sum(t.narrow(-1, 0, 0).sum() for t in (q, k, v))


def _run_per_sequence(backend, pad_to, problem, call, q, k, v, packing):
    """THD by slicing each sequence and running it dense. Reads the boundaries on the host (a sync).

    Tokens outside every sequence (the gaps of padded offsets) get a zero output and lse -inf.
    """
    read: dict[int, list[int]] = {}  # one host read per distinct tensor (boundaries and offsets often coincide)
    for t in (packing.cu_seqlens_q, packing.cu_seqlens_kv, packing.offsets_q, packing.offsets_kv):
        if id(t) not in read:
            read[id(t)] = t.tolist()
    bounds_q, bounds_kv, starts_q, starts_kv = (
        read[id(t)] for t in (packing.cu_seqlens_q, packing.cu_seqlens_kv, packing.offsets_q, packing.offsets_kv)
    )
    check_boundaries(
        "cu_seqlens_q", bounds_q, None if packing.has_gaps else q.shape[0], problem.seqlen_q, "max_seqlen_q"
    )
    check_boundaries(
        "cu_seqlens_kv", bounds_kv, None if packing.has_gaps else k.shape[0], problem.seqlen_kv, "max_seqlen_kv"
    )
    if packing.has_gaps:
        check_offsets("cu_seqlens_q_padded", starts_q, lengths_of(bounds_q), q.shape[0])
        check_offsets("cu_seqlens_kv_padded", starts_kv, lengths_of(bounds_kv), k.shape[0])
    pieces, lses, maxima, cursor = [], [], [], 0
    hq, d_v = q.shape[1], v.shape[-1]
    run_sequence = dense_runner(backend, pad_to, "bshd", call)
    for i in range(len(bounds_q) - 1):
        q0, n_q = starts_q[i], bounds_q[i + 1] - bounds_q[i]
        k0, n_kv = starts_kv[i], bounds_kv[i + 1] - bounds_kv[i]
        if q0 > cursor:  # a gap before this sequence
            pieces.append(q.new_zeros(q0 - cursor, hq, d_v))
            lses.append(torch.full((hq, q0 - cursor), float("-inf"), dtype=torch.float32, device=q.device))
        if n_q:
            out, lse, *max_logit = run_sequence(
                q[q0 : q0 + n_q].unsqueeze(0), k[k0 : k0 + n_kv].unsqueeze(0), v[k0 : k0 + n_kv].unsqueeze(0)
            )
            pieces.append(out.squeeze(0))
            lses.append(lse.squeeze(0) if lse is not None else None)
            maxima += max_logit
        cursor = q0 + n_q
    if cursor < q.shape[0]:  # trailing padding
        pieces.append(q.new_zeros(q.shape[0] - cursor, hq, d_v))
        lses.append(torch.full((hq, q.shape[0] - cursor), float("-inf"), dtype=torch.float32, device=q.device))
    out = torch.cat(pieces) if pieces else q.new_zeros(0, hq, d_v)
    if not out.requires_grad and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = out + _connected_zeros((), q, k, v)  # no sequence had a query: only gaps or nothing
    lse = None
    if call.return_lse:
        lse = torch.cat(lses, dim=1) if lses else torch.zeros(hq, 0, dtype=torch.float32, device=q.device)
    if not call.return_max_logit:
        return out, lse
    everywhere = torch.full((1, hq), float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse, torch.cat([everywhere, *(m[None] for m in maxima)]).amax(0)  # over the sequences

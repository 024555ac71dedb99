"""Running one candidate exactly: layout changes, zero-padding and trimming, the per-sequence THD path.

Padding zero-pads the last dim on the right; QK^T is unchanged, so with the scale kept at
1/sqrt(original d_qk) the output (trimmed to d_v) and the lse equal the native ones, and
the gradients reach only the original widths (F.pad's backward slices).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from attnselect import backends
from attnselect.backends.base import KernelCall
from attnselect.candidates import Candidate
from attnselect.inputs import check_boundaries
from attnselect.problem import AttentionProblem

# Permutation taking a dense layout to another: _PERMUTE[(src, dst)].
_PERMUTE = {
    ("bshd", "bhsd"): (0, 2, 1, 3), ("sbhd", "bhsd"): (1, 2, 0, 3), ("bhsd", "bhsd"): None,
    ("bshd", "bshd"): None, ("sbhd", "bshd"): (1, 0, 2, 3), ("bhsd", "bshd"): (0, 2, 1, 3),
}
_INVERSE = {
    ("bhsd", "bshd"): (0, 2, 1, 3), ("bhsd", "sbhd"): (2, 0, 1, 3), ("bshd", "sbhd"): (1, 0, 2, 3),
    ("bshd", "bhsd"): (0, 2, 1, 3),
}


def run_candidate(candidate: Candidate, problem: AttentionProblem, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, *, scale: Optional[float] = None, cu_seqlens_q=None, cu_seqlens_kv=None
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run ``candidate`` on validated tensors; returns (out, lse or None) in the caller's layout."""
    backend = backends.get(candidate.backend)
    call = KernelCall(mask=problem.mask, window=problem.window,
                      scale=problem.default_scale if scale is None else float(scale),
                      dropout_p=problem.dropout_p, return_lse=problem.return_lse,
                      deterministic=problem.deterministic)
    if problem.layout == "thd":
        return _run_per_sequence(backend, candidate.pad_to, problem, call, q, k, v, cu_seqlens_q, cu_seqlens_kv)
    return _run_dense(backend, candidate.pad_to, problem.layout, call, q, k, v)


def _run_dense(backend, pad_to, layout, call, q, k, v):
    perm = _PERMUTE[(layout, backend.layout)]
    if perm is not None:
        q, k, v = q.permute(perm), k.permute(perm), v.permute(perm)
    # Kernels read the head dim with stride 1 (sdp_utils check_last_dim_stride_equals_1).
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    seq_axis = 2 if backend.layout == "bhsd" else 1
    d_v = v.shape[-1]
    if q.shape[seq_axis] == 0 or k.shape[seq_axis] == 0:
        out, lse = _empty_result(q, k, v, seq_axis, call.return_lse)
    else:
        if pad_to is not None:
            q, k, v = (_pad(t, pad_to) for t in (q, k, v))
        out, lse = backend.run(q, k, v, call)
        if pad_to is not None:
            out = out[..., :d_v]
    back = _INVERSE.get((backend.layout, layout))
    return (out.permute(back) if back is not None else out), lse


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


def _empty_result(q, k, v, seq_axis, return_lse):
    """No queries, or no keys: zero output rows and lse = -inf (no visible key)."""
    shape = list(q.shape[:-1]) + [v.shape[-1]]
    # Empty sums are exact zeros that keep autograd connected, so q, k and v get zero gradients.
    out = q.new_zeros(shape) + sum(t.narrow(-1, 0, 0).sum() for t in (q, k, v))
    if not return_lse:
        return out, None
    b, h, s = (q.shape[0], q.shape[1], q.shape[2]) if seq_axis == 2 else (q.shape[0], q.shape[2], q.shape[1])
    return out, torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)


def _run_per_sequence(backend, pad_to, problem, call, q, k, v, cu_q, cu_kv):
    """THD by slicing each sequence and running it dense. Reads cu_seqlens on the host (one sync)."""
    cu_kv = cu_q if cu_kv is None else cu_kv
    bounds_q = cu_q.tolist()
    bounds_kv = bounds_q if cu_kv is cu_q else cu_kv.tolist()
    check_boundaries("cu_seqlens_q", bounds_q, q.shape[0], problem.seqlen_q, "max_seqlen_q")
    check_boundaries("cu_seqlens_kv", bounds_kv, k.shape[0], problem.seqlen_kv, "max_seqlen_kv")
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(zip(bounds_q[:-1], bounds_q[1:]), zip(bounds_kv[:-1], bounds_kv[1:])):
        if q1 == q0:
            continue
        out, lse = _run_dense(backend, pad_to, "bshd", call, q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0),
                              v[k0:k1].unsqueeze(0))
        outs.append(out.squeeze(0))
        if lse is not None:
            lses.append(lse.squeeze(0))
    out = torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[-1])
    # Tokens past the last boundary do not exist (check_boundaries ensures cu ends at T).
    if not call.return_lse:
        return out, None
    lse = torch.cat(lses, dim=1) if lses else torch.zeros(q.shape[1], 0, dtype=torch.float32, device=q.device)
    return out, lse

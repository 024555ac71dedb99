"""Stand-ins for the packed GPU kernels' ops with their documented semantics, computed with a dense reference on the
CPU (``cudnn.sdpa_torch`` of the cuDNN frontend, torch's ``aten._flash_attention_forward``), and the check that runs
a backend's packed path on them against the reference backend (tests/backends/test_cudnn_frontend.py,
test_varlen_fa2.py). The kernels themselves are tested against float64 on the GPU (tests/backends/test_thd_gpu.py).
"""

from __future__ import annotations

import torch

import attnselect
from attnselect.execution import run_candidate
from attnselect.spec.options import CallOptions, Candidate
from attnselect.spec.problem import describe_call
from helpers import rel_err, thd_inputs


def _attend(q, k, v, scale, top_left_causal, band):
    """(B, H, S, D) attention with an explicit visible-key rule; lse (B, H, S) with -inf on empty rows."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    sq, skv = q.shape[2], k.shape[2]
    i, j = torch.arange(sq).unsqueeze(1), torch.arange(skv).unsqueeze(0)
    allowed = torch.ones(sq, skv, dtype=torch.bool)
    if top_left_causal:
        allowed &= j <= i
    if band is not None:
        left, right = band
        diagonal = i + skv - sq
        if right >= 0:
            allowed &= j <= diagonal + right
        if left >= 0:
            allowed &= j >= diagonal - left
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.nan_to_num(scores.softmax(-1)) @ v, lse


def _packed(fn, q, k, v, cu_q, cu_kv):
    """Run a dense (B, H, S, D) function per sequence of (T, H, D) tensors; lse (T, H)."""
    outs, lses = [], []
    bq, bk = cu_q.tolist(), cu_kv.tolist()
    for i in range(len(bq) - 1):
        o, lse = fn(
            *(
                t.transpose(0, 1).unsqueeze(0)
                for t in (q[bq[i] : bq[i + 1]], k[bk[i] : bk[i + 1]], v[bk[i] : bk[i + 1]])
            )
        )
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0].transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def cudnn_sdpa_torch(
    q,
    k,
    v,
    *,
    scale=None,
    is_causal=False,
    causal_bottom_right=False,
    window_left=-1,
    window_right=-1,
    cu_seqlens_q=None,
    cu_seqlens_kv=None,
    max_seqlen_q=0,
    max_seqlen_kv=0,
    return_lse=False,
):
    """cudnn-frontend 1.32 python/cudnn/sdpa/fwd/torch_op.py and graph_analyzer.py, with the op's own checks.

    window_left is cuDNN's left bound, a window length: key j is kept when j > diagonal - window_left.
    """
    if causal_bottom_right and not (is_causal or window_left >= 0 or window_right >= 0):
        raise ValueError("causal_bottom_right only re-anchors an active diagonal band")
    if is_causal and window_right > 0:
        raise ValueError("is_causal masks every future column but window_right admits some")
    if window_left == 0:
        raise ValueError("sliding-window length must be >= 1")
    if causal_bottom_right:
        band = (window_left - 1 if window_left > 0 else -1, 0 if is_causal else window_right)
    else:
        assert window_left == window_right == -1, "a top-left window is not used by attnselect"
        band = None

    def dense(q, k, v):
        return _attend(q, k, v, scale, is_causal and not causal_bottom_right, band)

    if cu_seqlens_q is not None:
        assert max_seqlen_q > 0 and max_seqlen_kv > 0
        out, lse = _packed(dense, q, k, v, cu_seqlens_q, cu_seqlens_kv)
        lse = lse.unsqueeze(-1)  # stats are (T, H, 1)
    else:
        out, lse = dense(q, k, v)
        lse = lse.unsqueeze(-1)  # stats are (B, H, S, 1)
    return (out, lse.float()) if return_lse else out


def torch_flash_attention_forward(
    q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale, window_size_left=None,
    window_size_right=None,
):  # fmt: skip
    """aten._flash_attention_forward's packed path (attention.cpp, FA2's mha_varlen_fwd in flash_api.cpp): causal
    and windows bottom-right aligned, grouped K/V heads as they are, max_seqlen an upper bound, lse (H, T) float32
    with +inf on empty rows, five outputs; and its one-query shortcut (seqlenq_ngroups_swapped), which reshapes q
    as one query per sequence."""
    assert k.shape[-1] == q.shape[-1] and v.shape == (*k.shape[:2], q.shape[-1]) and q.shape[1] % k.shape[1] == 0
    assert dropout_p == 0.0 and not return_debug_mask
    assert max_q >= int((cu_q[1:] - cu_q[:-1]).max()) and max_k >= int((cu_k[1:] - cu_k[:-1]).max())
    left, right = (-1 if size is None else size for size in (window_size_left, window_size_right))  # value_or(-1)
    is_causal = is_causal and max_q != 1  # mha_varlen_fwd: one query a sequence is not masked
    window = (left, 0 if is_causal else right)
    if max_q == 1 and q.shape[1] > k.shape[1] and window == (-1, -1) and q.shape[0] != cu_q.numel() - 1:
        raise RuntimeError(f"shape '[{cu_q.numel() - 1}, {k.shape[1]}, ...]' is invalid for input of size {q.numel()}")
    out, lse = _packed(lambda a, b, c: _attend(a, b, c, scale, False, window), q, k, v, cu_q, cu_k)
    lse = lse.transpose(0, 1).masked_fill(torch.isneginf(lse.transpose(0, 1)), float("inf")).float()
    empty = q.new_empty(0)
    return out, lse, empty, empty, empty


CALLS = [
    dict(causal=True),
    dict(causal="bottom_right", return_lse=True),
    dict(window=(2, 1), return_lse=True),
    dict(window=(3, 0), causal=True),
    dict(),
]


LENGTHS = [([5, 1, 0, 9, 3], [5, 1, 0, 9, 3]), ([5, 1, 0, 9, 3], [7, 2, 0, 12, 3])]


def check_packed(backend, kwargs, lengths, dqk, pad):
    (q, k, v), cu_q, cu_kv = thd_inputs(*lengths, dqk=dqk, dv=16)
    q, k, v = (t.detach() for t in (q, k, v))
    if kwargs.get("causal") is True and lengths[0] != lengths[1]:
        cu_kv = cu_q
        k, v = k[: q.shape[0]], v[: q.shape[0]]
    problem, packing = describe_call(
        q, k, v, CallOptions(layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, **kwargs)
    )
    out, lse = run_candidate(
        Candidate(backend, dqk if pad else None),
        problem,
        q,
        k,
        v,
        packing=packing,
        target=attnselect.Target.preset("h200"),
    )
    ref, ref_lse = run_candidate(Candidate("reference"), problem, q, k, v, packing=packing)
    assert out.shape == ref.shape and rel_err(out, ref) < 1e-12
    if kwargs.get("return_lse"):
        assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape and rel_err(lse, ref_lse) < 1e-6

"""The reference backend (attnselect.backends.reference): the float64 oracle every kernel is checked against."""

from __future__ import annotations

import math

import torch

from attnselect import backends
from attnselect.spec.options import KernelCall

REFERENCE = backends.get("reference")


def _call(mask="none", window=None, scale=0.3, **options):
    return KernelCall(mask=mask, window=window, scale=scale, dropout_p=0.0, return_lse=True, **options)


def _naive(q, k, v, scale, visible):
    """softmax(QK^T * scale) V and its log-sum-exp, entry by entry in float64; rows that see no key: 0 and -inf."""
    b, hq, sq, _ = q.shape
    out = torch.zeros(b, hq, sq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float64)
    groups = hq // k.shape[1]
    for n in range(b):
        for h in range(hq):
            for i in range(sq):
                keys = [j for j in range(k.shape[2]) if visible(i, j)]
                if not keys:
                    continue
                logits = [scale * float(q[n, h, i] @ k[n, h // groups, j]) for j in keys]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                lse[n, h, i] = top + math.log(total)
                for w, j in zip(weights, keys):
                    out[n, h, i] += w / total * v[n, h // groups, j].double()
    return out, lse


def _inputs(sq, skv, hq=2, hkv=1, dqk=6, dv=3, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, hq, sq, dqk, generator=g, dtype=torch.float64)
    k = torch.randn(2, hkv, skv, dqk, generator=g, dtype=torch.float64)
    v = torch.randn(2, hkv, skv, dv, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def test_causal_mla_matches_softmax_of_scaled_scores_times_v_in_float64():
    q, k, v = _inputs(5, 7)  # d_qk 6 != d_v 3, grouped heads, top-left causal: query i sees keys j <= i
    out, lse = REFERENCE.run(q, k, v, _call("causal"))
    expected, expected_lse = _naive(q, k, v, 0.3, lambda i, j: j <= i)
    assert out.dtype == lse.dtype == torch.float64 and out.shape == (2, 2, 5, 3)
    assert torch.allclose(out, expected, atol=1e-12) and torch.allclose(lse, expected_lse, atol=1e-12)


def test_rows_that_see_no_key_give_zero_and_an_lse_of_minus_infinity_with_finite_gradients():
    q, k, v = (t.requires_grad_() for t in _inputs(6, 3))  # bottom-right: query i sees keys j <= i - 3
    out, lse = REFERENCE.run(q, k, v, _call("causal_bottom_right"))
    expected, expected_lse = _naive(q.detach(), k.detach(), v.detach(), 0.3, lambda i, j: j <= i - 3)
    assert torch.allclose(out, expected, atol=1e-12)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3])) and torch.isneginf(lse[:, :, :3]).all()
    assert torch.allclose(lse[:, :, 3:], expected_lse[:, :, 3:], atol=1e-12)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(q.grad[:, :, :3], torch.zeros_like(q.grad[:, :, :3]))


def test_half_precision_is_computed_in_float32_and_the_max_logit_is_over_visible_keys():
    q, k, v = _inputs(5, 7, dtype=torch.bfloat16)
    out, lse, max_logit = REFERENCE.run(q, k, v, _call("causal", return_max_logit=True))
    assert out.dtype == torch.bfloat16 and lse.dtype == max_logit.dtype == torch.float32 and max_logit.shape == (2,)
    expected, expected_lse = _naive(q.double(), k.double(), v.double(), 0.3, lambda i, j: j <= i)
    assert torch.allclose(out.double(), expected, atol=1e-2) and torch.allclose(lse.double(), expected_lse, atol=1e-5)
    scores = 0.3 * torch.einsum("bhqd,bkd->bhqk", q.double(), k.double()[:, 0])
    visible = torch.ones(5, 7, dtype=torch.bool).tril()
    assert torch.allclose(max_logit.double(), scores.masked_fill(~visible, float("-inf")).amax((0, 2, 3)), atol=1e-5)

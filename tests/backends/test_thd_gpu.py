"""Every packed (thd) candidate the GPU serves, against a float64 per-sequence reference.

Forward and the three gradients, for MLA 192/128, 128/128 and GQA, with mixed sequence lengths including 1 and 0,
and a decode-like pack of at most one query a sequence. Candidates come from the verdicts, so a backend is tested
wherever the rules say it serves (carry the cuDNN frontend wheel to include it: scripts/fetch_device_wheels.sh).
"""

from __future__ import annotations

import pytest
import torch

import attnselect
from attnselect.choose.candidates import judge
from attnselect.spec.options import CallOptions
from attnselect.spec.problem import describe_call
from attnselect.spec.target import Target
from helpers import rel_err, thd_inputs

LENGTHS_Q = [0, 1, 37, 256, 5, 130, 64]
LENGTHS_KV_LONGER = [3, 1, 40, 300, 5, 130, 80]
CASES = [  # (label, attention kwargs, input kwargs)
    ("mla-causal", dict(causal=True), dict(lengths_q=LENGTHS_Q, hq=8, hkv=8, dqk=192, dv=128)),
    ("equal-causal", dict(causal=True), dict(lengths_q=LENGTHS_Q, hq=8, hkv=8, dqk=128, dv=128)),
    (
        "mla-gqa-bottom-right",
        dict(causal="bottom_right"),
        dict(lengths_q=LENGTHS_Q, lengths_kv=LENGTHS_KV_LONGER, hq=8, hkv=2, dqk=192, dv=128),
    ),
    ("mla-window-lse", dict(window=(48, 0), return_lse=True), dict(lengths_q=LENGTHS_Q, hq=8, hkv=2, dqk=192, dv=128)),
    ("odd-59-causal", dict(causal=True), dict(lengths_q=LENGTHS_Q, hq=8, hkv=8, dqk=59, dv=59)),
    (  # at most one query a sequence, grouped heads, no mask: FA2's one-query shortcut needs one in every sequence
        "gqa-one-query-lse",
        dict(return_lse=True),
        dict(lengths_q=[1, 0, 1, 1], lengths_kv=[5, 3, 7, 1], hq=8, hkv=2, dqk=128, dv=128),
    ),
]


def _candidates():
    if not torch.cuda.is_available():
        return []
    params = []
    for label, kwargs, shape in CASES:
        (q, k, v), cu_q, cu_kv = thd_inputs(**shape, dtype=torch.bfloat16, device="cuda")
        problem, _ = describe_call(q, k, v, CallOptions(layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, **kwargs))
        for verdict in judge(problem, Target.current()):
            c = verdict.candidate
            if verdict.supported and c.backend != "reference":
                params.append(pytest.param(c.backend, c.pad_to, kwargs, shape, id=f"{label}-{c}".replace(" ", "_")))
    return params


@pytest.mark.gpu
@pytest.mark.parametrize("backend,pad_to,kwargs,shape", _candidates())
def test_thd_candidate_matches_float64(backend, pad_to, kwargs, shape):
    (q, k, v), cu_q, cu_kv = thd_inputs(**shape, dtype=torch.bfloat16, device="cuda")
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    grad_out = torch.randn(q.shape[0], q.shape[1], v.shape[-1], device="cuda", dtype=torch.float64)
    runs = []
    for tensors, choice in (
        ((q, k, v), dict(backend=backend, pad=pad_to is not None)),
        (exact, dict(backend="reference")),
    ):
        result = attnselect.attention(
            *tensors, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, **kwargs, **choice
        )
        out, lse = result if isinstance(result, tuple) else (result, None)
        out.backward(grad_out.to(out.dtype))
        runs.append((out, lse, [t.grad for t in tensors]))
    (out, lse, grads), (ref, ref_lse, ref_grads) = runs
    assert torch.isfinite(out).all() and rel_err(out, ref) < 2e-2
    for g, rg in zip(grads, ref_grads):
        assert torch.isfinite(g).all() and rel_err(g, rg) < 2e-2
    if kwargs.get("return_lse"):
        assert lse.shape == ref_lse.shape == (q.shape[1], q.shape[0]) and rel_err(lse, ref_lse) < 1e-2


def _frontend_installed():
    return torch.cuda.is_available() and Target.current().version("nvidia-cudnn-frontend") is not None


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [dict(causal=True, return_lse=True), dict(window=(48, 0), return_lse=True)])
def test_cudnn_frontend_bucketed_packing_equals_unbucketed_on_the_gpu(kwargs, monkeypatch):
    """Empty trailing sequences and a larger max_seqlen leave output, lse and gradients as they were."""
    import dataclasses

    from attnselect.backends import get

    if not _frontend_installed():
        pytest.skip("nvidia-cudnn-frontend is not installed here (scripts/fetch_device_wheels.sh)")
    frontend = get("cudnn_frontend")
    (q, k, v), cu_q, _ = thd_inputs(LENGTHS_Q[1:], hq=8, hkv=2, dqk=192, dv=128, dtype=torch.bfloat16, device="cuda")
    grad_out = torch.randn(q.shape[0], 8, 128, device="cuda", dtype=torch.bfloat16)
    runs = []
    for buckets in (type(frontend).shape_cache.buckets, None):
        monkeypatch.setattr(frontend, "shape_cache", dataclasses.replace(type(frontend).shape_cache, buckets=buckets))
        attnselect.clear_cache()  # the memoized call's runner holds the buckets it was prepared with
        out, lse = attnselect.attention(
            q,
            k,
            v,
            layout="thd",
            cu_seqlens_q=cu_q,
            backend="cudnn_frontend",
            max_seqlen_q=max(LENGTHS_Q),
            max_seqlen_kv=max(LENGTHS_Q),
            **kwargs,
        )
        runs.append((out, lse, torch.autograd.grad(out, (q, k, v), grad_out)))
    (out, lse, grads), (out0, lse0, grads0) = runs
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    for g, g0 in zip(grads, grads0):
        assert rel_err(g, g0) < 1e-3, "gradients moved with the bucket"


@pytest.mark.gpu
def test_a_copy_of_cu_seqlens_q_as_cu_seqlens_kv_is_self_attention_on_the_gpu():
    """Both max_seqlen given (as Megatron passes them) and cu_seqlens_kv a tensor of its own, equal in value."""
    (q, k, v), cu_q, _ = thd_inputs([37, 256, 5], hq=8, hkv=8, dqk=192, dv=128, dtype=torch.bfloat16, device="cuda")
    problem, _ = describe_call(
        q,
        k,
        v,
        CallOptions(
            layout="thd",
            cu_seqlens_q=cu_q,
            cu_seqlens_kv=cu_q.clone(),
            causal=True,
            window=(48, 0),
            max_seqlen_q=256,
            max_seqlen_kv=256,
        ),
    )
    assert problem.varlen_seqlens_match and not problem.varlen_rows_without_keys
    if _frontend_installed():  # not refused as unverified for keyless rows
        verdict = next(
            v for v in attnselect.select(problem).verdicts if v.candidate == attnselect.Candidate("cudnn_frontend")
        )
        assert verdict.supported, verdict.reasons

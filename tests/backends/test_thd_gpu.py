"""Every packed (thd) candidate the GPU serves, against a float64 per-sequence reference.

Forward and the three gradients, for MLA 192/128, 128/128 and GQA, with mixed sequence
lengths including 1 and 0. Candidates come from the verdicts, so a backend is tested
wherever the rules say it serves (carry the cuDNN frontend wheel to include it:
scripts/fetch_device_wheels.sh).
"""

from __future__ import annotations

import pytest
import torch

import attnselect
from attnselect.candidates import judge
from attnselect.inputs import describe_call
from attnselect.target import Target
from helpers import rel_err, thd_inputs

LENGTHS_Q = [0, 1, 37, 256, 5, 130, 64]
LENGTHS_KV_LONGER = [3, 1, 40, 300, 5, 130, 80]
CASES = [  # (label, attention kwargs, input kwargs)
    ("mla-causal", dict(causal=True), dict(lengths_q=LENGTHS_Q, hq=8, hkv=8, dqk=192, dv=128)),
    ("equal-causal", dict(causal=True), dict(lengths_q=LENGTHS_Q, hq=8, hkv=8, dqk=128, dv=128)),
    ("mla-gqa-bottom-right", dict(causal="bottom_right"),
     dict(lengths_q=LENGTHS_Q, lengths_kv=LENGTHS_KV_LONGER, hq=8, hkv=2, dqk=192, dv=128)),
    ("mla-window-lse", dict(window=(48, 0), return_lse=True), dict(lengths_q=LENGTHS_Q, hq=8, hkv=2, dqk=192, dv=128)),
]


def _candidates():
    if not torch.cuda.is_available():
        return []
    params = []
    for label, kwargs, shape in CASES:
        (q, k, v), cu_q, cu_kv = thd_inputs(**shape, dtype=torch.bfloat16, device="cuda")
        problem, _ = describe_call(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, **kwargs)
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
    for tensors, choice in (((q, k, v), dict(backend=backend, pad=pad_to is not None)), (exact, dict(backend="reference"))):
        result = attnselect.attention(*tensors, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, **kwargs, **choice)
        out, lse = result if isinstance(result, tuple) else (result, None)
        out.backward(grad_out.to(out.dtype))
        runs.append((out, lse, [t.grad for t in tensors]))
    (out, lse, grads), (ref, ref_lse, ref_grads) = runs
    assert torch.isfinite(out).all() and rel_err(out, ref) < 2e-2
    for g, rg in zip(grads, ref_grads):
        assert torch.isfinite(g).all() and rel_err(g, rg) < 2e-2
    if kwargs.get("return_lse"):
        assert lse.shape == ref_lse.shape == (q.shape[1], q.shape[0]) and rel_err(lse, ref_lse) < 1e-2

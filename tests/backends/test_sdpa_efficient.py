"""The memory-efficient SDPA backend (attnselect.backends.sdpa_efficient): d_qk != d_v, aligned head dims, no GQA."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from attnselect import AttentionProblem, Target, backends
from attnselect.execution import kernel_call

EFFICIENT = backends.get("sdpa_efficient")
H200 = Target.preset("h200")
ABSORBED = AttentionProblem(2, 128, 128, 16, 1, 576, 512, torch.bfloat16, mask="causal", training=True)


def test_it_serves_unequal_head_dims_of_any_width_and_a_deterministic_backward():
    assert EFFICIENT.not_supported_reasons(ABSORBED, H200) == []
    assert EFFICIENT.not_supported_reasons(dataclasses.replace(ABSORBED, deterministic=True), H200) == []
    assert EFFICIENT.not_supported_reasons(ABSORBED, Target.preset("cpu")) == ["runs on cuda only, not on cpu"]
    assert EFFICIENT.not_supported_reasons(ABSORBED, Target("next", capability=(13, 0))) == [
        "supports compute capability up to 12.1, the target has 13.0"
    ]


@pytest.mark.parametrize(
    "dtype,dims,served",
    [
        (torch.float16, (64, 64), True),
        (torch.float16, (60, 60), False),  # half precision: multiples of 8
        (torch.bfloat16, (64, 60), False),
        (torch.float32, (60, 60), True),  # float32: multiples of 4
        (torch.float32, (62, 62), False),
    ],
)
def test_head_dims_are_multiples_of_the_gemm_alignment(dtype, dims, served):
    problem = dataclasses.replace(ABSORBED, dtype=dtype, head_dim_qk=dims[0], head_dim_v=dims[1])
    reasons = EFFICIENT.not_supported_reasons(problem, H200)
    assert (not reasons) == served and all("head dims must be multiples of" in r for r in reasons)


def test_grouped_kv_heads_are_expanded_before_the_kernel(monkeypatch):
    """torch 2.11 refused enable_gqa for this kernel on the H200: K/V reach SDPA with Q's heads, without enable_gqa;
    a kernel that takes grouped heads (sdpa_math) gets them as they are."""
    seen = []

    def sdpa(q, k, v, *args, enable_gqa=False, **kwargs):
        seen.append((k.shape[1], v.shape[1], enable_gqa))
        return torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 8)
    call = kernel_call(AttentionProblem.from_tensors(q, k, v, layout="bhsd"))
    for name in ("sdpa_efficient", "sdpa_math"):
        out, lse = backends.get(name).run(q, k, v, call)
        assert out.shape == (1, 4, 8, 8) and lse is None
    assert seen == [(4, 4, False), (2, 2, True)]

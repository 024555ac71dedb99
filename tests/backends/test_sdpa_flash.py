"""SDPA's FlashAttention backend (attnselect.backends.sdpa_flash): equal head dims, CUDA's mask and backward limits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnselect import AttentionProblem, Target, backends

FLASH = backends.get("sdpa_flash")
H200 = Target.preset("h200")
EQUAL = AttentionProblem(2, 128, 128, 8, 8, 128, 128, torch.bfloat16, mask="causal", training=True)


def test_it_serves_equal_head_dims_only_and_on_cuda_no_mask_tensor():
    assert FLASH.not_supported_reasons(EQUAL, H200) == []
    assert FLASH.not_supported_reasons(dataclasses.replace(EQUAL, head_dim_qk=192), H200) == [
        "needs equal head dims, got d_qk=192 and d_v=128"
    ]
    window = dataclasses.replace(EQUAL, mask="sliding_window", window=(8, 0))
    assert FLASH.not_supported_reasons(window, H200) == [
        "mask 'sliding_window' is not supported (supports causal, causal_bottom_right, none)"
    ]
    fewer_queries = dataclasses.replace(EQUAL, seqlen_q=64)
    assert FLASH.not_supported_reasons(fewer_queries, H200) == [
        "top-left causal needs as many queries as keys on CUDA (check_flash_causal_non_square_seqlens)"
    ]
    assert FLASH.not_supported_reasons(dataclasses.replace(fewer_queries, mask="causal_bottom_right"), H200) == [
        "bottom-right causal with fewer or more queries than keys needs a mask tensor, which this kernel refuses"
    ]
    assert FLASH.not_supported_reasons(dataclasses.replace(EQUAL, mask="causal_bottom_right"), H200) == []


def test_on_the_cpu_it_takes_any_float_dtype_and_any_mask_but_no_dropout():
    cpu = Target.preset("cpu")
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        problem = dataclasses.replace(EQUAL, dtype=dtype, seqlen_q=64, mask="sliding_window", window=(8, 0))
        assert FLASH.not_supported_reasons(problem, cpu) == []
    assert FLASH.not_supported_reasons(dataclasses.replace(EQUAL, dtype=torch.float32, dropout_p=0.1), cpu) == [
        "does not support dropout (dropout_p=0.1)"
    ]


@pytest.mark.parametrize(
    "capability,head_dim,dropout_p,trains",
    [
        ((8, 6), 192, 0.0, True),
        ((8, 6), 200, 0.0, False),  # (192, 224] has no backward on sm86, sm87, sm89 and sm120+
        ((8, 9), 224, 0.0, False),
        ((12, 0), 256, 0.0, True),
        ((12, 0), 256, 0.1, False),  # above 224: not with dropout
        ((8, 0), 200, 0.0, True),  # the A100 and the H200 train every head dim up to 256
        ((9, 0), 256, 0.1, True),
    ],
)
def test_fa2_backward_head_dims_on_consumer_archs(capability, head_dim, dropout_p, trains):
    target = Target("gpu", capability=capability)
    problem = dataclasses.replace(EQUAL, head_dim_qk=head_dim, head_dim_v=head_dim, dropout_p=dropout_p)
    reasons = FLASH.not_supported_reasons(problem, target)
    assert (not reasons) == trains and all("FlashAttention-2's backward does not serve" in r for r in reasons)
    assert FLASH.not_supported_reasons(dataclasses.replace(problem, training=False), target) == []

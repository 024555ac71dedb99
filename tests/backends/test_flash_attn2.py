"""The FlashAttention-2 package backend (attnselect.backends.flash_attn2): its surface and flash-attn's own limits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnselect import AttentionProblem, Target, backends

FA2 = backends.get("flash_attn2")
A100 = Target.preset("a100", packages={"flash-attn": "2.6.3"})
EQUAL = AttentionProblem(2, 128, 128, 8, 8, 128, 128, torch.bfloat16, mask="causal", training=True)


def test_it_serves_equal_half_precision_head_dims_up_to_256_from_sm80_where_installed():
    assert FA2.not_supported_reasons(EQUAL, A100) == []
    assert FA2.not_supported_reasons(EQUAL, Target.preset("a100")) == ["package flash-attn is not installed"]
    assert FA2.not_supported_reasons(EQUAL, Target("T4", capability=(7, 5), packages={"flash-attn": "2.6.3"})) == [
        "needs compute capability >= 8.0, the target has 7.5"
    ]
    mla = dataclasses.replace(EQUAL, head_dim_qk=192)
    assert FA2.not_supported_reasons(mla, A100) == ["needs equal head dims, got d_qk=192 and d_v=128"]
    wide = dataclasses.replace(EQUAL, head_dim_qk=288, head_dim_v=288)
    assert FA2.not_supported_reasons(wide, A100) == ["head dims up to 256 only, got d_qk=288, d_v=288"]
    assert FA2.not_supported_reasons(dataclasses.replace(EQUAL, dtype=torch.float32), A100)


def test_its_causal_mask_is_bottom_right_aligned():
    fewer_queries = dataclasses.replace(EQUAL, seqlen_q=64)
    assert any("bottom-right aligned" in r for r in FA2.not_supported_reasons(fewer_queries, A100))
    assert FA2.not_supported_reasons(dataclasses.replace(fewer_queries, mask="causal_bottom_right"), A100) == []


@pytest.mark.parametrize("version,served", [("2.2.0", False), ("2.3.0", True), ("2.8.3", True)])
def test_sliding_windows_need_flash_attn_2_3(version, served):
    window = dataclasses.replace(EQUAL, mask="sliding_window", window=(16, 0))
    reasons = FA2.not_supported_reasons(window, Target.preset("a100", packages={"flash-attn": version}))
    assert reasons == ([] if served else [f"sliding windows need flash-attn >= 2.3, the target has {version}"])


def test_it_softcaps_or_drops_out_but_not_both_and_is_not_captured_in_cuda_graphs():
    assert FA2.not_supported_reasons(dataclasses.replace(EQUAL, softcap=True), A100) == []
    assert FA2.not_supported_reasons(dataclasses.replace(EQUAL, dropout_p=0.1), A100) == []
    assert FA2.not_supported_reasons(dataclasses.replace(EQUAL, softcap=True, dropout_p=0.1), A100) == [
        "cannot softcap with dropout (flash_api.cpp); drop one of softcap= and dropout_p="
    ]
    captured = FA2.not_supported_reasons(dataclasses.replace(EQUAL, cuda_graph_capture=True), A100)
    assert captured == ["is not verified under CUDA graph capture; warm up and capture with another backend"]

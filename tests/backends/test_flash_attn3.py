"""The FlashAttention-3 backend (attnselect.backends.flash_attn3): Hopper only, its head-dim pairs, no dropout."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnselect import AttentionProblem, Target, backends

FA3 = backends.get("flash_attn3")
H200 = Target.preset("h200", packages={"flash-attn-3": "3.0.0"})
MLA = AttentionProblem(2, 128, 128, 8, 8, 192, 128, torch.bfloat16, mask="causal", training=True)


def test_it_serves_mla_on_hopper_only_where_installed():
    assert FA3.not_supported_reasons(MLA, H200) == []
    assert FA3.not_supported_reasons(MLA, Target.preset("h200")) == ["package flash-attn-3 is not installed"]
    a100, b200 = (Target.preset(name, packages={"flash-attn-3": "3.0.0"}) for name in ("a100", "b200"))
    assert FA3.not_supported_reasons(MLA, a100) == ["needs compute capability >= 9.0, the target has 8.0"]
    assert FA3.not_supported_reasons(MLA, b200) == ["supports compute capability up to 9.0, the target has 10.0"]


@pytest.mark.parametrize(
    "dims,inference,training",
    [
        ((192, 128), True, True),
        ((128, 128), True, True),
        ((256, 256), True, True),
        ((64, 512), True, False),  # d_qk <= 64 with d_v <= 512: forward only above 256
        ((288, 288), False, False),
        ((128, 96), False, False),  # d_qk not in (128, 192]
        ((192, 96), False, False),  # d_v not in (96, 128]
        ((200, 128), False, False),
        ((60, 60), False, False),  # not a multiple of 8
    ],
)
def test_head_dims_follow_hopper_flash_api(dims, inference, training):
    problem = dataclasses.replace(MLA, head_dim_qk=dims[0], head_dim_v=dims[1], training=False)
    assert (not FA3.not_supported_reasons(problem, H200)) == inference
    assert (not FA3.not_supported_reasons(dataclasses.replace(problem, training=True), H200)) == training


def test_it_has_no_dropout_and_no_deterministic_backward_for_head_dims_of_256():
    assert FA3.not_supported_reasons(dataclasses.replace(MLA, dropout_p=0.1), H200) == [
        "does not support dropout (dropout_p=0.1)"
    ]
    assert FA3.not_supported_reasons(dataclasses.replace(MLA, deterministic=True), H200) == []
    wide = dataclasses.replace(MLA, head_dim_qk=256, head_dim_v=256, deterministic=True)
    assert FA3.not_supported_reasons(wide, H200) == ["no deterministic backward for head dims >= 256"]
    assert FA3.not_supported_reasons(dataclasses.replace(wide, training=False), H200) == []

"""The cuDNN SDPA backend (attnselect.backends.sdpa_cudnn): PyTorch's cuDNN gates per arch, version and option."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnselect
from attnselect import AttentionProblem, Target, backends
from helpers import MLA, verdict

CUDNN = backends.get("sdpa_cudnn")
H200 = Target.preset("h200")
EQUAL = AttentionProblem(2, 128, 128, 8, 8, 128, 128, torch.bfloat16, mask="causal")


def test_newer_torch_on_hopper_follows_the_newest_cudnn_gate():
    newer = Target.preset("h200", torch_version="2.13.0")
    padded = verdict(attnselect.select(AttentionProblem(**MLA, training=True), target=newer), "sdpa_cudnn", 192)
    assert any("9.22" in r for r in padded.reasons)
    assert verdict(attnselect.select(AttentionProblem(**MLA), target=newer), "sdpa_cudnn").supported


@pytest.mark.parametrize(
    "preset,dims,training,served",
    [
        ("a100", (192, 128), False, False),  # above 128: not on sm80
        ("h200", (256, 256), True, True),  # torch 2.11 + cuDNN 9.19 on the H200: up to 256, fwd and bwd
        ("h200", (288, 288), False, False),
        ("b200", (192, 128), True, True),  # MLA from cuDNN 9.11
        ("b200", (192, 192), False, False),  # other pairs above 128 need cuDNN > 9.22
        ("rtx-pro-6000", (192, 128), False, False),
    ],
)
def test_head_dims_above_128_follow_the_arch(preset, dims, training, served):
    problem = dataclasses.replace(EQUAL, head_dim_qk=dims[0], head_dim_v=dims[1], training=training)
    assert (not CUDNN.not_supported_reasons(problem, Target.preset(preset))) == served


def test_blackwell_trains_above_128_only_the_pairs_cudnn_has_a_backward_for():
    b200 = Target.preset("b200", cudnn_version="9.23.0")
    for dims, trains in (((192, 128), True), ((256, 256), True), ((192, 192), False), ((160, 160), False)):
        problem = dataclasses.replace(EQUAL, head_dim_qk=dims[0], head_dim_v=dims[1])
        assert CUDNN.not_supported_reasons(problem, b200) == []  # every pair up to 256 runs forward
        reasons = CUDNN.not_supported_reasons(dataclasses.replace(problem, training=True), b200)
        assert (not reasons) == trains and all("no backward kernel" in r for r in reasons)


def test_dropout_is_served_in_sixteenths_outside_cudnn_9_11_to_9_13():
    assert CUDNN.not_supported_reasons(dataclasses.replace(EQUAL, dropout_p=0.125), H200) == []
    assert CUDNN.not_supported_reasons(dataclasses.replace(EQUAL, dropout_p=0.1), H200) == [
        "dropout_p must be a multiple of 1/16, got 0.1"
    ]
    for version, served in (("9.10.0", True), ("9.11.1", False), ("9.13.0", False), ("9.14.0", True)):
        target = Target.preset("h200", cudnn_version=version)
        assert (not CUDNN.not_supported_reasons(dataclasses.replace(EQUAL, dropout_p=0.125), target)) == served
    one_query = dataclasses.replace(EQUAL, seqlen_q=1, mask="none", dropout_p=0.125)
    assert CUDNN.not_supported_reasons(one_query, H200) == [
        "dropout with seqlen_q == 1 is refused (check_cudnn_tensor_shapes)"
    ]


def test_it_refuses_what_pytorch_refuses_it_and_what_the_h200_measured_wrong():
    def reasons(**changes):
        return CUDNN.not_supported_reasons(dataclasses.replace(EQUAL, **changes), H200)

    assert reasons(deterministic=True) == [
        "is refused by PyTorch while deterministic algorithms are on (deterministic=True)"
    ]
    assert reasons(seqlen_q=1, seqlen_kv=1) == ["a key sequence of length 1 is refused (check_cudnn_tensor_shapes)"]
    assert reasons(batch=65536) == ["batch and heads must be <= 65535"]
    assert reasons(return_lse=True) == ["cannot return the log-sum-exp (return_lse=True)"]
    keyless = dict(seqlen_q=200, seqlen_kv=64, mask="causal_bottom_right")
    assert reasons(**keyless) == []  # forward: the rows that see no key are zeroed
    assert any("NaN gradients" in r for r in reasons(**keyless, training=True))
    assert CUDNN.not_supported_reasons(EQUAL, Target.preset("cpu")) == ["runs on cuda only, not on cpu"]

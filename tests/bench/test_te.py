"""The bench's TransformerEngine emulation (attnselect.bench.te) follows TE's rules and PR #3339's pad decision."""

from __future__ import annotations

import pytest
import torch

from attnselect import AttentionProblem, Candidate, Target
from attnselect.bench.te import te_choice
from attnselect.choose.candidates import judge

MLA = AttentionProblem(
    batch=2,
    seqlen_q=1024,
    seqlen_kv=1024,
    heads_q=16,
    heads_kv=16,
    head_dim_qk=192,
    head_dim_v=128,
    mask="causal",
    training=True,
)


@pytest.mark.parametrize(
    "preset,expected",
    [
        ("h200", Candidate("sdpa_cudnn")),  # fused serves natively; flash dropped on sm90+
        ("b200", Candidate("sdpa_cudnn")),  # fused 192/128 training with cuDNN >= 9.11
        ("a100", Candidate("sdpa_flash", 192)),  # native falls to unfused, padded gets FlashAttention: pad
    ],
)
def test_te_emulation_on_mla_training(preset, expected):
    target = Target.preset(preset)
    supported = {v.candidate for v in judge(MLA, target) if v.supported}
    assert te_choice(MLA, target, supported) == expected


def test_te_emulation_pads_for_fa2_and_falls_back_to_unfused():
    a100 = Target.preset("a100")
    equal = AttentionProblem(2, 1024, 1024, 16, 16, 128, 128, torch.bfloat16, mask="causal")
    supported = {v.candidate for v in judge(equal, a100) if v.supported}
    assert te_choice(equal, a100, supported) == Candidate("sdpa_flash")  # Flash > Fused below sm90
    absorbed = AttentionProblem(1, 1024, 1024, 16, 1, 576, 512, torch.bfloat16)
    supported = {v.candidate for v in judge(absorbed, Target.preset("h200")) if v.supported}
    assert te_choice(absorbed, Target.preset("h200"), supported) == Candidate("sdpa_math")  # unfused


def test_te_emulation_never_pads_equal_head_dims():
    a100 = Target.preset("a100")
    odd = AttentionProblem(2, 1024, 1024, 16, 16, 100, 100, torch.bfloat16, mask="causal")
    supported = {v.candidate for v in judge(odd, a100) if v.supported}
    assert odd.pad_target == 104 and te_choice(odd, a100, supported) == Candidate("sdpa_flash")

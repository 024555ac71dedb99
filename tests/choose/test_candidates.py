"""Verdicts on candidates (attnselect.choose.candidates): native and padded per backend, the caller's controls."""

from __future__ import annotations

import torch

import attnselect
from attnselect import AttentionProblem, Candidate, Target
from attnselect.backends import all_backends
from attnselect.choose.candidates import judge
from helpers import CPU, SELECTION_PROBLEM

P = SELECTION_PROBLEM


def test_judge_gives_every_backend_a_native_and_a_padded_verdict_the_callers_controls_and_failures_first():
    from attnselect.choose.settings import Overrides

    failed = {Candidate("sdpa_flash", 24): "RuntimeError: out of memory"}
    verdicts = judge(P, CPU, Overrides(disable=frozenset({"sdpa_math"})), failed)
    assert [v.candidate for v in verdicts] == [Candidate(b.name, pad) for b in all_backends() for pad in (None, 24)]
    reasons = {v.candidate: v.reasons for v in verdicts}
    assert reasons[Candidate("sdpa_math")] == ("disabled by the caller (disable / ATTNSELECT_DISABLE)",)
    assert reasons[Candidate("sdpa_flash", 24)] == ("failed at run time on this target: RuntimeError: out of memory",)
    assert reasons[Candidate("sdpa_flash")] == ("needs equal head dims, got d_qk=24 and d_v=16",)  # its kernel's
    assert reasons[Candidate("reference")] == reasons[Candidate("reference", 24)] == ()
    assert judge(P, CPU) == judge(P, CPU, Overrides(), {})  # no controls, no failures: the kernels' reasons only


def test_forced_backend_and_pad():
    assert attnselect.select(P, target=CPU, backend="reference").chosen == Candidate("reference")
    assert attnselect.select(P, target=CPU, backend="reference", pad=True).chosen == Candidate("reference", 24)
    assert attnselect.select(P, target=CPU, pad=False).chosen == Candidate("sdpa_math")


def test_reasons_are_short_enough_to_read():
    import itertools

    from attnselect.choose.candidates import judge

    targets = [Target.preset(name, packages={"flash-attn-4": "4.0.0b36", "nvidia-cudnn-frontend": "1.32.0"})
               for name in ("a100", "h200", "b200", "b300", "rtx-pro-6000", "cpu")]  # fmt: skip
    for target, (dqk, dv), layout, training in itertools.product(
        targets, [(192, 128), (192, 192), (576, 512), (59, 59)], ["bshd", "thd"], [True, False]
    ):
        p = AttentionProblem(2, 256, 128, 16, 2, dqk, dv, torch.bfloat16, layout=layout, mask="causal_bottom_right",
                             training=training)  # fmt: skip
        for verdict in judge(p, target):
            assert all(len(reason) <= 120 for reason in verdict.reasons), verdict

"""Decisions: memoization, invalidation, forcing, and the Decision's content."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import attnselect
from attnselect import AttentionProblem, Candidate, Target, backends
from attnselect.backends.sdpa_math import SdpaMath
from helpers import CPU, SELECTION_PROBLEM

P = SELECTION_PROBLEM


def test_memoized_decision_is_reused():
    assert attnselect.select(P, target=CPU) is attnselect.select(P, target=CPU)


def test_clear_cache_forgets():
    first = attnselect.select(P, target=CPU)
    attnselect.clear_cache()
    second = attnselect.select(P, target=CPU)
    assert first is not second and first == second


def test_environment_change_invalidates(monkeypatch):
    first = attnselect.select(P, target=CPU)
    assert first.chosen == Candidate("sdpa_flash", 24)
    monkeypatch.setenv("ATTNSELECT_PAD", "never")
    second = attnselect.select(P, target=CPU)
    assert second.chosen == Candidate("sdpa_math")
    monkeypatch.setenv("ATTNSELECT_DISABLE", "sdpa_math, sdpa_flash")
    assert attnselect.select(P, target=CPU).chosen == Candidate("reference")
    monkeypatch.delenv("ATTNSELECT_PAD")
    monkeypatch.delenv("ATTNSELECT_DISABLE")
    assert attnselect.select(P, target=CPU) == first


def test_registry_change_invalidates():
    first = attnselect.select(P, target=CPU)

    class FastFake(SdpaMath):
        name = "fake_first"

    fake = FastFake()
    try:
        backends.register(fake)
        # unknown to the preference table, so it ranks last, but it must appear in the verdicts
        assert any(v.candidate.backend == "fake_first" for v in attnselect.select(P, target=CPU).verdicts)
    finally:
        backends.unregister("fake_first")
    assert all(v.candidate.backend != "fake_first" for v in attnselect.select(P, target=CPU).verdicts)
    assert attnselect.select(P, target=CPU) == first


def test_forced_backend_that_cannot_serve_lists_its_reasons():
    with pytest.raises(attnselect.ForcedChoiceError) as err:
        attnselect.select(P, target=CPU, backend="sdpa_cudnn")
    assert "sdpa_cudnn native: runs on cuda only" in str(err.value)
    assert "sdpa_math" not in str(err.value)


def test_new_decision_is_logged_once(caplog):
    with caplog.at_level("INFO", logger="attnselect"):
        attnselect.select(P, target=CPU)
        attnselect.select(P, target=CPU)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "running sdpa_flash, padded to 24, because" in lines[0]


def test_disable_iterator_does_not_poison_the_memo():
    first = attnselect.select(P, target=CPU, disable=iter(["sdpa_flash"]))
    assert first.chosen.backend != "sdpa_flash"
    assert attnselect.select(P, target=CPU, disable=["sdpa_flash"]) is first
    assert attnselect.select(P, target=CPU).chosen.backend == "sdpa_flash"


def test_memo_is_bounded(monkeypatch):
    from attnselect.choose import selection

    monkeypatch.setattr(selection, "MEMO_SIZE", 3)
    for s in range(1, 8):
        attnselect.select(AttentionProblem(1, s, s, 1, 1, 8, 8, torch.float32), target=CPU)
    assert len(selection._MEMO) == 3


def test_cuda_graph_capture_keeps_only_capturable_candidates():
    h200 = Target.preset("h200", packages={"nvidia-cudnn-frontend": "1.32.0"})
    mla = AttentionProblem(2, 1024, 1024, 16, 16, 192, 128, mask="causal", training=True, cuda_graph_capture=True)
    d = attnselect.select(mla, target=h200)
    refused = {v.candidate.backend: v.reasons for v in d.verdicts if not v.supported}
    assert "CUDA graph capture" in refused["flex"][0] and "CUDA graph capture" in refused["cudnn_frontend"][0]
    assert d.chosen == Candidate("sdpa_cudnn") and "under CUDA graph capture" in mla.describe()
    packed = AttentionProblem(
        4, 4096, 4096, 16, 16, 192, 128, layout="thd", mask="causal", training=True, cuda_graph_capture=True
    )
    d = attnselect.select(packed, target=h200)
    assert d.chosen == Candidate("varlen_fa2", 192)  # packed kernels only: no per-sequence host reads
    assert any(
        "sequence by sequence" in r for v in d.verdicts if v.candidate.backend == "sdpa_cudnn" for r in v.reasons
    )
    # flash-attn 2 and 3 were never captured on our H200 (not installed there): refused, with the reason; FA4 was
    # (results/h200_gpu_tests_fa4.txt) and serves under capture
    with_fa = Target.preset("h200", packages={"flash-attn": "2.8.3", "flash-attn-3": "3.0.0", "flash-attn-4": "4.0.0"})
    equal = AttentionProblem(2, 1024, 1024, 16, 16, 128, 128, mask="causal", training=True, cuda_graph_capture=True)
    assert attnselect.select(equal, target=with_fa, backend="flash_attn4").chosen == Candidate("flash_attn4")
    for backend in ("flash_attn2", "flash_attn3"):
        uncaptured = attnselect.select(
            dataclasses.replace(equal, cuda_graph_capture=False), target=with_fa, backend=backend
        )
        assert uncaptured.chosen.backend == backend
        with pytest.raises(attnselect.ForcedChoiceError, match="not verified under CUDA graph capture"):
            attnselect.select(equal, target=with_fa, backend=backend)


@pytest.mark.parametrize(
    "installed",
    [{}, {"nvidia-cudnn-frontend": "1.32.0"}, {"nvidia-cudnn-frontend": "1.32.0", "flash-attn-4": "4.0.0b36"}],
)
def test_packed_decisions_carried_across_sizes_choose_what_a_fresh_selection_chooses(installed):
    """select_packed reuses a packed problem's decision at new sizes only where a full selection agrees: sizes that
    cross a rule (one key, a small training pack, a key sequence of length 1) are selected afresh."""
    import random

    from attnselect.choose.selection import select_packed

    rng = random.Random(0)
    for target in (Target.preset("h200", packages=installed), Target.preset("a100"), Target.preset("cpu")):
        for _ in range(300):
            seqlen = rng.choice([1, 2, 37, 300, 512, 513, 2048, 9000])
            problem = AttentionProblem(
                rng.choice([1, 3, 18, 120]),
                seqlen,
                rng.choice([seqlen, 1, 2 * seqlen]),
                16,
                rng.choice([16, 4]),
                192,
                rng.choice([128, 192]),
                layout="thd",
                mask=rng.choice(["causal", "causal_bottom_right", "none"]),
                training=rng.random() < 0.7,
                varlen_single_key=rng.random() < 0.3,
                dtype=torch.float32 if not target.is_cuda else torch.bfloat16,
            )
            try:
                fresh = attnselect.select(problem, target=target).chosen
            except attnselect.NoSupportedCandidateError:
                continue
            assert select_packed(problem, target=target).chosen == fresh, problem.describe()


def test_packed_decisions_at_new_sizes_judge_no_candidate_again(monkeypatch):
    from attnselect.choose import candidates, selection

    h200 = Target.preset("h200", packages={"nvidia-cudnn-frontend": "1.32.0"})
    judged = []
    real = candidates.judge
    monkeypatch.setattr(selection, "judge", lambda *a, **k: judged.append(1) or real(*a, **k))
    for batch, seqlen in ((18, 4096), (25, 9000), (13, 16384), (40, 3000)):
        problem = AttentionProblem(batch, seqlen, seqlen, 16, 16, 192, 128, layout="thd", mask="causal", training=True)
        assert selection.select_packed(problem, target=h200).chosen == Candidate("cudnn_frontend")
    assert len(judged) == 1


def test_packings_that_straddle_a_refinement_s_bound_carry_a_decision_within_each_table(monkeypatch):
    """Ranked by the rules table (no calibration holds on an H100), packings on both sides of the small-pack bound
    alternate between two tables: each table's decision is carried within it, so only the first packing of each is
    judged, and every packing gets what a fresh selection chooses there."""
    from attnselect.choose import candidates, selection

    h100 = Target.preset("h100", packages={"nvidia-cudnn-frontend": "1.32.0"})
    judged = []
    real = candidates.judge
    monkeypatch.setattr(selection, "judge", lambda *a, **k: judged.append(1) or real(*a, **k))
    sizes = ((4, 400), (30, 1024), (5, 380), (28, 1100), (3, 500), (32, 990), (6, 300))  # small, large, ...
    judged_by_packing = []
    for batch, seqlen in sizes:
        problem = AttentionProblem(batch, seqlen, seqlen, 16, 16, 128, 128, layout="thd", mask="causal",
                                   dtype=torch.bfloat16)  # fmt: skip
        before = len(judged)
        carried = selection.select_packed(problem, target=h100)
        judged_by_packing.append(len(judged) - before)
        assert carried.chosen == attnselect.select(problem, target=h100).chosen
        assert carried.chosen == Candidate("varlen_fa2" if batch < 10 else "cudnn_frontend")
        assert ("small pack" in carried.why) == (batch < 10)
    assert judged_by_packing == [1, 1, 0, 0, 0, 0, 0]  # each table's first packing only


def test_a_packed_decision_reads_recorded_failures_as_select_does_once_torch_distributed_starts(monkeypatch):
    """Failures recorded by earlier processes are not read under torch.distributed (ranks could read different cache
    files); a job that starts it after its first packed calls gets, at its next packing, what select() chooses."""
    from attnselect.choose import failures, selection

    h200 = Target.preset("h200", packages={"nvidia-cudnn-frontend": "1.32.0"})

    def pack(seqlen):
        return AttentionProblem(8, seqlen, seqlen, 16, 16, 128, 128, layout="thd", mask="causal", training=True,
                                dtype=torch.bfloat16)  # fmt: skip

    first, second, third = pack(2000), pack(2010), pack(2020)
    assert first.size_class == second.size_class == third.size_class
    usual = attnselect.select(first, target=h200).chosen
    monkeypatch.setattr(failures, "_RECORDED", {failures._entry_key(first, h200): {usual: "RuntimeError: recorded"}})
    attnselect.clear_cache()
    assert selection.select_packed(first, target=h200).chosen != usual
    assert selection.select_packed(second, target=h200).chosen != usual
    for module in (failures, selection):
        monkeypatch.setattr(module, "is_distributed", lambda: True)
    assert selection.select_packed(third, target=h200).chosen == attnselect.select(third, target=h200).chosen == usual


def test_a_table_s_decision_judges_again_only_what_a_packing_s_sizes_or_failures_can_change(monkeypatch):
    """Carried within a rules table, a decision's candidates are judged again at a new packing only where their
    verdict reads sizes, or their failure came or went (a recorded failure is not read under torch.distributed):
    on small packs with FA4 installed the choice, varlen_fa2, heads the table and reads no size, so later packings
    judge nothing, and each gets what a fresh selection chooses."""
    from attnselect.choose import selection

    h100 = Target.preset("h100", packages={"nvidia-cudnn-frontend": "1.32.0", "flash-attn-4": "4.0.0b36"})
    judged = []
    real = selection._reasons
    monkeypatch.setattr(selection, "_reasons", lambda c, *a: judged.append(c) or real(c, *a))
    judged_by_packing = []
    for batch, seqlen in ((4, 400), (5, 380), (3, 500), (6, 300)):
        problem = AttentionProblem(batch, seqlen, seqlen, 16, 16, 128, 128, layout="thd", mask="causal",
                                   dtype=torch.bfloat16)  # fmt: skip
        before = len(judged)
        carried = selection.select_packed(problem, target=h100)
        judged_by_packing.append(len(judged) - before)
        assert carried.chosen == attnselect.select(problem, target=h100).chosen == Candidate("varlen_fa2")
        assert "small pack" in carried.why
    assert judged_by_packing == [0, 0, 0, 0]  # the first by select(), the others carried with nothing judged again
    checks = ((Candidate("varlen_fa2"), True, False, False), (Candidate("flash_attn4"), False, False, True))
    asked = []

    def serves(c):
        asked.append(c)
        return c == Candidate("varlen_fa2")

    fa4_failed = {Candidate("flash_attn4"): "failed at run time"}
    assert selection._still_stands(checks, fa4_failed, serves) and asked == []  # nothing changed: nothing asked
    assert selection._still_stands(checks, {}, serves) and asked == [Candidate("flash_attn4")]  # its failure went
    asked.clear()
    assert not selection._still_stands(checks, {}, lambda c: asked.append(c) or True)  # and FA4 serves again


def test_a_failure_at_one_size_class_moves_a_table_s_decision_there_only():
    """Ranked by the rules table (an H100), FA4 failing at run time for the packings of one size class moves their
    choice to the next candidate, while packings of another size class under the same table keep FA4: each gets what
    a fresh selection chooses."""
    from attnselect.choose import failures, selection

    h100 = Target.preset("h100", packages={"nvidia-cudnn-frontend": "1.32.0", "flash-attn-4": "4.0.0b36"})

    def pack(batch, seqlen):
        return AttentionProblem(batch, seqlen, seqlen, 16, 16, 128, 128, layout="thd", mask="causal",
                                dtype=torch.bfloat16)  # fmt: skip

    failing, other = pack(30, 1024), pack(30, 8192)  # above the small-pack bound, in two size classes
    assert failing.size_class != other.size_class
    assert selection.select_packed(failing, target=h100).chosen == Candidate("flash_attn4")
    failures.mark_failed(failing, h100, Candidate("flash_attn4"), RuntimeError("no kernel image is available"))
    expected = {
        "small": Candidate("varlen_fa2"),
        "failing": Candidate("cudnn_frontend"),
        "other": Candidate("flash_attn4"),
    }
    for kind, problem in (("small", pack(4, 400)), ("failing", failing), ("other", other), ("failing", pack(29, 1000)),
                          ("other", pack(31, 8000)), ("failing", failing)):  # fmt: skip
        assert (problem.size_class == failing.size_class) == (kind == "failing")
        carried = selection.select_packed(problem, target=h100)
        assert carried.chosen == attnselect.select(problem, target=h100).chosen == expected[kind], problem.describe()


def _packed_calibration(tmp_path, monkeypatch, target):
    """A calibration of ``target`` whose packed curves cross: varlen_fa2 issues fastest, FA4 and the cuDNN frontend
    run fastest on the GPU, FA4 compiles on its first call (so the choice and its rental change with the sizes)."""
    import json

    from attnselect.choose import calibration
    from helpers import calibration_sample

    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))
    data = calibration_sample(target)
    for backend, host, gpu in (
        ("varlen_fa2", 80.0, 30.0),
        ("cudnn_frontend", 600.0, 20.0),
        ("flash_attn4", 300.0, 15.0),
    ):
        data["host_us"][backend] = {
            f"thd{pad} {phase}": host for pad in ("", "+pad") for phase in ("training", "inference")
        }
        data["gpu"][backend] = {
            f"thd 128/128{pad} {phase}": [[10.0, gpu], [1e4, gpu * 50]]
            for pad in ("", "+pad")
            for phase in ("training", "inference")
        }
    data["skipped"] = [b for b in data["skipped"] if b not in ("varlen_fa2", "cudnn_frontend")] + ["sdpa_cudnn"]
    calibration.user_path(target).write_text(json.dumps(data))
    calibration._parsed.cache_clear()
    attnselect.clear_cache()


def _calibrated_h200(tmp_path, monkeypatch) -> Target:
    """The H200 with the cuDNN frontend and FA4 under :func:`_packed_calibration`, no compile paid yet."""
    from attnselect.choose import first_calls

    target = Target.preset("h200", packages={"nvidia-cudnn-frontend": "1.32.0", "flash-attn-4": "4.0.0b36"})
    _packed_calibration(tmp_path, monkeypatch, target)
    first_calls.forget()
    return target


def _thd_training(batch: int, seqlen: int) -> AttentionProblem:
    """A packed causal training call of ``batch`` sequences up to ``seqlen`` tokens, H16, 128/128 bf16."""
    return AttentionProblem(batch, seqlen, seqlen, 16, 16, 128, 128, layout="thd", mask="causal", training=True,
                            dtype=torch.bfloat16)  # fmt: skip


def test_predicted_packed_decisions_at_new_sizes_judge_no_candidate_again(tmp_path, monkeypatch):
    """Ranked by predicted time, a packed call known but for its sizes is carried to the new sizes without judging
    every candidate again (select_packed's point: a training loop's packing changes every step)."""
    from attnselect.choose import candidates, selection

    target = _calibrated_h200(tmp_path, monkeypatch)
    judged, real = [], candidates.judge
    monkeypatch.setattr(selection, "judge", lambda *a, **k: judged.append(1) or real(*a, **k))
    decisions = []
    for batch, seqlen in ((18, 4096), (25, 9000), (13, 16384), (40, 3000), (2, 100)):
        problem = AttentionProblem(batch, seqlen, seqlen, 16, 16, 128, 128, layout="thd", mask="causal",
                                   training=True, dtype=torch.bfloat16)  # fmt: skip
        decisions.append(selection.select_packed(problem, target=target))
    assert all(d.predictions is not None for d in decisions) and len({d.chosen for d in decisions}) > 1
    assert len(judged) == 1
    carried = decisions[-1]
    assert "carried from" in carried.why and "supported candidates" not in carried.why


def test_a_draw_at_a_new_work_class_judges_again_only_the_verdicts_that_read_sizes(tmp_path, monkeypatch):
    """A candidate that serves a packed family by a verdict that reads no size (selection._judged_alike_at_every_size)
    is judged once per size class: draws at its new work classes judge again only the others (a refusal too: its
    reasons may name the sizes), and choose what select chooses there."""
    from attnselect.choose import selection
    from attnselect.spec.options import Verdict

    target = _calibrated_h200(tmp_path, monkeypatch)
    judged, reasons = [], selection._reasons
    monkeypatch.setattr(selection, "_reasons", lambda c, p, *a: judged.append(c) or reasons(c, p, *a))
    first = _thd_training(18, 4000)
    selection.select_packed(first, target=target)  # select's own judgement
    del judged[:]
    draws = 0
    for tokens in range(4200, 60000, 700):  # one size class, ever more work: new work classes
        problem = dataclasses.replace(first, tokens=tokens)
        assert problem.size_class == first.size_class
        before = len(judged)
        decision = selection.select_packed(problem, target=target)
        draws += len(judged) > before
        fresh = attnselect.select(problem, target=target)
        assert (decision.chosen, decision.rental) == (fresh.chosen, fresh.rental), problem.describe()
    verdicts = {c: Verdict(c, reasons(c, first, target, {})) for c in judged}
    alike = selection._judged_alike_at_every_size
    sizeless = {c for c, v in verdicts.items() if v.supported and alike(v, first, target, {})}
    assert draws > 3 and sizeless and all(judged.count(c) == 1 for c in sizeless)
    assert any(judged.count(c) > 1 for c in set(judged) - sizeless)  # those that read sizes: at each draw


def test_a_candidate_that_failed_at_one_size_class_serves_the_draws_of_another_alone(tmp_path, monkeypatch):
    """What a family's draws keep of a verdict that reads no size is kept per size class (its failures): a candidate
    that failed at run time at one size class is refused at new work classes there and still serves at another's,
    as a fresh select decides."""
    from attnselect.choose import first_calls, selection
    from attnselect.choose.failures import mark_failed

    target = _calibrated_h200(tmp_path, monkeypatch)
    failing, other = _thd_training(18, 4000), _thd_training(18, 12000)
    assert failing.size_class != other.size_class
    chosen = Candidate("flash_attn4")  # it serves by a verdict that reads no size
    first_calls.ran(chosen, failing)  # its compile paid: chosen where it is the fastest
    mark_failed(failing, target, chosen, RuntimeError("broken"))
    served = set()
    try:
        for tokens in range(4200, 40000, 1400):  # new work classes, the other size class's first
            for base in (other, failing):
                problem = dataclasses.replace(base, tokens=tokens + base.seqlen_q)
                decision = selection.select_packed(problem, target=target)
                fresh = attnselect.select(problem, target=target)
                assert (decision.chosen, decision.rental) == (fresh.chosen, fresh.rental), problem.describe()
                assert base is other or decision.chosen != chosen
                served.add(decision.chosen == chosen)
    finally:
        first_calls.forget()
    assert served == {True, False}


def test_a_packed_call_of_other_tokens_at_the_same_sizes_is_predicted_at_its_own_work(tmp_path, monkeypatch):
    """The family's key (the problem at size 0) is shared by q's every row count: a call of the same sequences and
    longest lengths in more tokens has more work, and is decided at it, not handed the last call's decision."""
    from attnselect.choose import selection

    target = _calibrated_h200(tmp_path, monkeypatch)
    few, many = (dataclasses.replace(_thd_training(8, 4096), tokens=tokens) for tokens in (4208, 32768))
    selection.select_packed(few, target=target)
    decision = selection.select_packed(many, target=target)
    fresh = attnselect.select(many, target=target)
    assert decision.problem.tokens == 32768 and decision.predictions[decision.chosen] == fresh.predictions[fresh.chosen]


def test_a_new_packing_in_a_known_work_class_predicts_nothing_again(tmp_path, monkeypatch):
    """A packed call's ranking is kept per work class, size class and rules table: a new packing whose sizes fall in
    a class seen before looks its ranking up (no prediction, no sort), and chooses what select chooses there."""
    from attnselect.choose import predict, rules, selection

    target = _calibrated_h200(tmp_path, monkeypatch)
    predicted, real = [], predict.Curve.at_class
    monkeypatch.setattr(predict.Curve, "at_class", lambda *a, **k: predicted.append(1) or real(*a, **k))
    curves, real_curve = [], rules.prediction_curve
    monkeypatch.setattr(rules, "prediction_curve", lambda *a, **k: curves.append(1) or real_curve(*a, **k))

    selection.select_packed(_thd_training(18, 4096), target=target)
    made = len(curves)  # select's, every supported candidate's
    selection.select_packed(_thd_training(18, 4000), target=target)  # a new class: predicted along the curves
    before = len(predicted)
    assert before and len(curves) > made  # the family's curves, made on its first ranking
    made = len(curves)
    same_class = _thd_training(18, 4001)
    assert predict.work_class(same_class) == predict.work_class(_thd_training(18, 4000))
    assert same_class.size_class == _thd_training(18, 4000).size_class
    carried = selection.select_packed(same_class, target=target)
    assert len(predicted) == before
    selection.select_packed(_thd_training(3, 1000), target=target)  # another class: predicted, no curve made again
    assert len(predicted) > before and len(curves) == made
    monkeypatch.setattr(predict.Curve, "at_class", real)
    fresh = attnselect.select(same_class, target=target)
    assert carried.chosen == fresh.chosen and carried.predictions[carried.chosen] == fresh.predictions[fresh.chosen]
    attnselect.clear_cache()  # a clear forgets the rankings too
    assert not selection._RANKINGS


def test_a_new_size_class_in_a_known_work_class_reuses_its_predictions(tmp_path, monkeypatch):
    """Predictions depend on the work class only (rules.prediction): a packing in another size class but a known work
    class is ranked again without predicting again, and chooses what select chooses there."""
    from attnselect.choose import predict, selection

    target = _calibrated_h200(tmp_path, monkeypatch)

    # scores on either side of 4**15 (size classes 15 and 14), the same work class
    upper, lower = _thd_training(4, 4096), _thd_training(4, 4095)
    assert predict.work_class(upper) == predict.work_class(lower)
    assert upper.size_class != lower.size_class
    selection.select_packed(_thd_training(5, 2048), target=target)
    selection.select_packed(upper, target=target)
    predicted, real = [], predict.Curve.at_class
    monkeypatch.setattr(predict.Curve, "at_class", lambda *a, **k: predicted.append(1) or real(*a, **k))
    carried = selection.select_packed(lower, target=target)
    assert not predicted
    monkeypatch.setattr(predict.Curve, "at_class", real)
    fresh = attnselect.select(lower, target=target)
    assert carried.chosen == fresh.chosen and carried.ranked == fresh.ranked[: len(carried.ranked)]
    assert carried.predictions == {c: fresh.predictions[c] for c in carried.ranked}


def test_a_packing_whose_carried_decision_is_unchanged_gets_the_earlier_decision(tmp_path, monkeypatch):
    """Where a new packing's carried decision would equal the one last carried in its class (work class, size class
    and rules table) but for its sizes (the same candidates judged alike, ranking and rental), select_packed returns
    that one rather than build its copy; a packing that changes any of them gets a decision of its own."""
    from attnselect.choose import first_calls, selection
    from attnselect.choose.failures import mark_failed

    target = _calibrated_h200(tmp_path, monkeypatch)

    def matches_select(decision, problem):
        fresh = attnselect.select(problem, target=target)
        return (decision.chosen, decision.rental) == (fresh.chosen, fresh.rental)

    selection.select_packed(_thd_training(18, 4096), target=target)
    first = selection.select_packed(_thd_training(18, 4000), target=target)  # carried: a decision of its own
    assert first.problem == _thd_training(18, 4000) and first.carried_from is not None
    assert first.rental is not None  # FA4 deferred until its compile is paid (_packed_calibration)
    same = selection.select_packed(_thd_training(18, 4001), target=target)  # the same class: nothing changes
    assert same is first and matches_select(same, _thd_training(18, 4001))
    other = selection.select_packed(_thd_training(2, 100), target=target)  # another class and choice
    assert other is not first and other.problem == _thd_training(2, 100)
    assert matches_select(other, _thd_training(2, 100))
    assert selection.select_packed(_thd_training(18, 3999), target=target) is first  # its class's decision, kept
    # the same class, the rental changed: FA4's compile paid, so FA4 runs at once
    first_calls.ran(first.rental.deferred, _thd_training(18, 4000))
    paid = selection.select_packed(_thd_training(18, 4002), target=target)
    assert paid is not first and paid.rental is None and matches_select(paid, _thd_training(18, 4002))
    # the chosen candidate failed at this signature (mark_failed clears the memos): decided again
    mark_failed(_thd_training(18, 4003), target, paid.chosen, RuntimeError("broken"))
    failed = selection.select_packed(_thd_training(18, 4003), target=target)
    assert failed.chosen != paid.chosen and matches_select(failed, _thd_training(18, 4003))


@pytest.mark.parametrize(
    "sizes, forced",
    [((2, 100), None), ((18, 4000), None), ((18, 4000), "flash_attn4")],
    ids=["compiles-nothing", "renting", "forced-compiling"],
)
def test_a_settled_packed_decision_is_returned_without_drawing_its_ranking_again(tmp_path, monkeypatch, sizes, forced):
    """A decision carried in a class stands while the process's paid compiles hold (first_calls.paid_state): a new
    packing in that class whose judged candidates are judged alike gets it back without the ranking drawn again,
    whether it rents (FA4's compile unpaid), compiles (FA4 forced) or neither; once a compile is paid it is drawn
    again, and one where a judged candidate is judged otherwise at its sizes is decided again, as select decides."""
    from attnselect.backends.base import get as backend_named
    from attnselect.choose import first_calls, predict, selection

    batch, seqlen = sizes
    target = _calibrated_h200(tmp_path, monkeypatch)
    selection.select_packed(_thd_training(18, 4096), target=target, backend=forced)
    first = selection.select_packed(_thd_training(batch, seqlen), target=target, backend=forced)
    assert (first.rental is not None) == (sizes == (18, 4000) and forced is None)
    again = _thd_training(batch, seqlen + 1)
    assert predict.work_class(again) == predict.work_class(first.problem)
    assert again.size_class == first.problem.size_class

    def drawn(*args, **kwargs):
        raise AssertionError("a settled decision's ranking drawn again")

    with monkeypatch.context() as patched:
        patched.setattr(first_calls, "drawn_rental", drawn)
        patched.setattr(itertools, "islice", drawn)  # a forced backend's draw
        assert selection.select_packed(again, target=target, backend=forced) is first
    fresh = attnselect.select(again, target=target, backend=forced)
    assert (first.chosen, first.rental) == (fresh.chosen, fresh.rental)
    first_calls.ran(Candidate("flash_attn4"), again)  # FA4's compile paid: no rental from now on
    paid = selection.select_packed(_thd_training(batch, seqlen + 2), target=target, backend=forced)
    fresh = attnselect.select(_thd_training(batch, seqlen + 2), target=target, backend=forced)
    assert (paid.chosen, paid.rental) == (fresh.chosen, fresh.rental)
    assert (paid is first) == (first.rental is None)  # the draw is alike where the paid compile did not rent
    first_calls.forget()
    chosen = backend_named(first.chosen.backend)
    monkeypatch.setattr(chosen, "extra_reasons_read_sizes", True)  # as a backend whose reasons read sizes says
    target = _calibrated_h200(tmp_path, monkeypatch)
    selection.select_packed(_thd_training(18, 4096), target=target, backend=forced)
    first = selection.select_packed(_thd_training(batch, seqlen), target=target, backend=forced)
    assert backend_named(first.chosen.backend) is chosen
    real = chosen.extra_reasons
    monkeypatch.setattr(
        chosen, "extra_reasons", lambda p, t: real(p, t) + (["too long"] if p.seqlen_q > seqlen + 1 else [])
    )
    longer = _thd_training(batch, seqlen + 2)
    assert predict.work_class(longer) == predict.work_class(first.problem)
    if forced is not None:  # the forced backend no longer serves: select says so
        with pytest.raises(attnselect.ForcedChoiceError):
            selection.select_packed(longer, target=target, backend=forced)
        return
    carried = selection.select_packed(longer, target=target)
    assert carried is not first and carried.chosen != first.chosen
    assert carried.chosen == attnselect.select(longer, target=target).chosen


def test_a_settled_packed_decision_judges_again_only_the_verdicts_sizes_can_change(tmp_path, monkeypatch):
    """Of a settled decision's verdicts, a new packing judges again only those its sizes can change: a candidate
    refused by its surface (varlen_fa2 native at 192/128: its head dims must be equal, whatever the sizes) stays
    refused, and the chosen one, varlen_fa2 padded, whose backend's reasons read no size (extra_reasons_read_sizes),
    stays served; where they read sizes, the chosen one is judged at the new sizes."""
    from attnselect.backends.base import get as backend_named
    from attnselect.choose import selection

    def mla(batch: int, seqlen: int) -> AttentionProblem:
        return _thd_training(batch, seqlen)._with(head_dim_qk=192)

    judged, real = [], selection._reasons
    monkeypatch.setattr(selection, "_reasons", lambda c, *a: judged.append(c) or real(c, *a))
    for reads_sizes in (False, True):
        monkeypatch.setattr(backend_named("varlen_fa2"), "extra_reasons_read_sizes", reads_sizes)
        target = _calibrated_h200(tmp_path, monkeypatch)
        selection.select_packed(mla(18, 4096), target=target)
        first = selection.select_packed(mla(2, 100), target=target)
        refused = {v.candidate for v in first.verdicts if not v.supported}
        assert Candidate("varlen_fa2") in refused and first.chosen == Candidate("varlen_fa2", 192)
        judged.clear()
        assert selection.select_packed(mla(2, 101), target=target) is first
        assert judged == ([first.chosen] if reads_sizes else [])
        assert attnselect.select(mla(2, 101), target=target).chosen == first.chosen


def test_a_settled_young_kernel_is_not_judged_again_where_its_allowlist_holds_no_span(tmp_path, monkeypatch):
    """FA4, a young kernel (its allowlist from the correctness grid), forced: its extra reasons read no size and the
    packaged grid holds no span for its key, so a new packing of a settled decision does not judge it again; where
    its reasons read sizes, it is judged at the new sizes."""
    from attnselect.backends import evidence
    from attnselect.backends.base import get as backend_named
    from attnselect.choose import selection

    judged, real = [], selection._reasons
    monkeypatch.setattr(selection, "_reasons", lambda c, *a: judged.append(c) or real(c, *a))
    for reads_sizes in (False, True):
        monkeypatch.setattr(backend_named("flash_attn4"), "extra_reasons_read_sizes", reads_sizes)
        target = _calibrated_h200(tmp_path, monkeypatch)
        selection.select_packed(_thd_training(18, 4096), target=target, backend="flash_attn4")
        first = selection.select_packed(_thd_training(18, 4000), target=target, backend="flash_attn4")
        assert first.chosen == Candidate("flash_attn4")
        assert not evidence.reads_sizes("flash_attn4", first.problem, target)
        judged.clear()
        assert selection.select_packed(_thd_training(18, 4001), target=target, backend="flash_attn4") is first
        assert judged == ([first.chosen] if reads_sizes else [])


def test_select_packed_of_a_dense_problem_is_select(tmp_path, monkeypatch):
    """A dense problem's reasons may read its sizes through its surface (FA4's causal mask is bottom-right aligned:
    it refuses top-left causal where the lengths differ), so select_packed carries nothing for it: it is select."""
    from attnselect.choose import selection

    def dense(batch: int, seqlen_q: int, seqlen_kv: int) -> AttentionProblem:
        return AttentionProblem(batch, seqlen_q, seqlen_kv, 16, 16, 128, 128, mask="causal", training=True,
                                dtype=torch.bfloat16)  # fmt: skip

    target = _calibrated_h200(tmp_path, monkeypatch)
    for forced in ("flash_attn4", None):
        for problem in (dense(4, 1024, 1024), dense(4, 1025, 1025), dense(4, 1040, 1024)):
            try:
                want = attnselect.select(problem, target=target, backend=forced)
            except attnselect.ForcedChoiceError:
                with pytest.raises(attnselect.ForcedChoiceError):
                    selection.select_packed(problem, target=target, backend=forced)
                continue
            assert selection.select_packed(problem, target=target, backend=forced) is want


def test_a_new_work_class_that_draws_alike_gets_the_decision_drawn_in_its_size_class(tmp_path, monkeypatch):
    """A packing of a work class not seen before, in a size class and rules table seen, gets the decision drawn
    there at another work class where its predicted order draws it alike (the same candidates judged first, in the
    same order, its choice ranked alone, no rental): no draw, no new Decision; select chooses the same. Where the
    order differs, or a rental is drawn, it is drawn anew. (Its sizes sit in one size class above the small-pack
    bound: one rules table.)"""
    from attnselect.choose import first_calls, selection
    from attnselect.choose.predict import work_class

    target = _calibrated_h200(tmp_path, monkeypatch)
    first_calls.ran(Candidate("flash_attn4"), _thd_training(4, 1100))  # its compile paid: no rental
    selection.select_packed(_thd_training(4, 1100), target=target)
    drawn = selection.select_packed(_thd_training(4, 1200), target=target)
    draws, real = [], first_calls.drawn_rental
    monkeypatch.setattr(first_calls, "drawn_rental", lambda *a: draws.append(1) or real(*a))
    for batch, seqlen in ((4, 1300), (3, 1500), (5, 1200)):
        problem = _thd_training(batch, seqlen)
        assert problem.size_class == drawn.problem.size_class and work_class(problem) != work_class(drawn.problem)
        assert selection.select_packed(problem, target=target) is drawn and not draws
        assert attnselect.select(problem, target=target).chosen == drawn.chosen
        draws.clear()  # select draws its own
    first_calls.forget()  # FA4's compile unpaid again: a rental is drawn, at the next class too
    rented = selection.select_packed(_thd_training(4, 1310), target=target)
    assert rented.rental is not None and draws == [1]
    assert rented.rental == attnselect.select(_thd_training(4, 1310), target=target).rental
    draws.clear()
    assert selection.select_packed(_thd_training(4, 1180), target=target) is not rented and draws == [1]


def test_a_thread_reads_a_settled_decision_with_its_own_verdicts_while_another_carries_a_new_one(tmp_path, monkeypatch):
    """Carrying a new decision in a class, a thread stores it with the verdicts the sizes can change and its paid
    state as one: another thread that looks in between gets the earlier decision with its own verdicts, judged at its
    sizes, never the new decision with the earlier verdicts. Flex, calibrated fastest here, refuses grouped heads
    below 128 queries (its extra reasons: size-dependent); the other thread's call is made where the first has
    built its decision."""
    import json

    from attnselect.choose import calibration, first_calls, predict, rules, selection
    from helpers import calibration_sample

    target = Target.preset("h200", packages={"nvidia-cudnn-frontend": "1.32.0", "flash-attn-4": "4.0.0b36"})
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))
    data = calibration_sample(target)
    for backend, host, gpu in (("varlen_fa2", 80.0, 30.0), ("cudnn_frontend", 600.0, 20.0),
                               ("flash_attn4", 300.0, 15.0), ("flex", 20.0, 10.0)):  # fmt: skip
        data["host_us"][backend] = {f"thd{p} {ph}": host for p in ("", "+pad") for ph in ("training", "inference")}
        data["gpu"][backend] = {
            f"thd 128/128{p} {ph}": [[10.0, gpu], [1e4, gpu * 50]]
            for p in ("", "+pad")
            for ph in ("training", "inference")
        }
    data["skipped"] = [b for b in data["skipped"] if b not in ("varlen_fa2", "cudnn_frontend", "flex")] + ["sdpa_cudnn"]
    calibration.user_path(target).write_text(json.dumps(data))
    calibration._parsed.cache_clear()
    attnselect.clear_cache()
    first_calls.forget()

    def grouped(seqlen: int) -> AttentionProblem:
        return AttentionProblem(18, seqlen, seqlen, 16, 4, 128, 128, layout="thd", mask="causal", training=True,
                                dtype=torch.bfloat16)  # fmt: skip

    def keyed(p):
        return predict.work_class(p), p.size_class, rules.table_for(p, target)[0]

    assert keyed(grouped(127)) == keyed(grouped(129)) == keyed(grouped(130))
    selection.select_packed(grouped(2048), target=target)
    assert selection.select_packed(grouped(129), target=target).chosen == Candidate("flex")
    real, other = selection._judged_alike_at_every_size, []

    def the_other_thread_looks(*args):
        if not other:
            other.append(selection.select_packed(grouped(130), target=target))
        return real(*args)

    monkeypatch.setattr(selection, "_judged_alike_at_every_size", the_other_thread_looks)
    assert selection.select_packed(grouped(127), target=target).chosen != Candidate("flex")  # too few queries
    assert other[0].chosen == attnselect.select(grouped(130), target=target).chosen == Candidate("flex")


def test_a_settled_packed_decision_follows_a_calibration_changed_with_the_cache_directory(tmp_path, monkeypatch):
    """A rental settled under one calibration is not returned under another (ATTNSELECT_CACHE_DIR changed, no cache
    cleared): the class's ranking and predictions are made again under the calibration in force."""
    import json

    from attnselect.choose import calibration, selection

    (tmp_path / "a").mkdir()
    target = _calibrated_h200(tmp_path / "a", monkeypatch)
    selection.select_packed(_thd_training(18, 4096), target=target)
    rented = selection.select_packed(_thd_training(18, 4000), target=target)
    assert rented.rental is not None and rented.rental.deferred == Candidate("flash_attn4")
    data = json.loads(calibration.user_path(target).read_text())
    data["first_call_ms"] = {**data.get("first_call_ms", {}), "flash_attn4": 10.0}  # FA4 compiles nothing there
    (tmp_path / "b").mkdir()
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path / "b"))
    calibration.user_path(target).write_text(json.dumps(data))
    calibration._parsed.cache_clear()
    carried = selection.select_packed(_thd_training(18, 4001), target=target)
    fresh = attnselect.select(_thd_training(18, 4001), target=target)
    assert carried.rental is None and (carried.chosen, carried.rental) == (fresh.chosen, fresh.rental)


def test_a_memoized_dense_decision_follows_a_calibration_changed_with_the_cache_directory(tmp_path, monkeypatch):
    """ATTNSELECT_CACHE_DIR changed, no cache cleared: select() and attention()'s memos are keyed on it, as the
    calibration is, so a memoized dense call is ranked under the calibration in force, as a new one is."""
    import json

    from attnselect.choose import calibration, first_calls
    from helpers import CALIBRATED_H200, calibration_sample

    data = calibration_sample(CALIBRATED_H200)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path / "a"))
    calibration.user_path(CALIBRATED_H200).write_text(json.dumps(data))
    calibration._parsed.cache_clear()
    attnselect.clear_cache()
    first_calls.forget()
    problem = AttentionProblem(2, 4096, 4096, 16, 16, 192, 128, mask="causal", training=True, dtype=torch.bfloat16)
    first = attnselect.select(problem, target=CALIBRATED_H200)
    assert str(tmp_path / "a") in first.calibration
    fastest = first.ranked[0].backend
    slower = {k: [[w, t * 100] for w, t in points] for k, points in data["gpu"][fastest].items()}
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path / "b"))
    calibration.user_path(CALIBRATED_H200).write_text(json.dumps({**data, "gpu": {**data["gpu"], fastest: slower}}))
    again, other = (attnselect.select(p, target=CALIBRATED_H200) for p in (problem, problem._with(batch=3)))
    assert again.ranked[0].backend != fastest and again.ranked[0] == other.ranked[0]
    assert str(tmp_path / "b") in again.calibration
    first_calls.forget()


def test_packed_rankings_are_bounded_in_all_families_together(tmp_path, monkeypatch):
    """The rankings of every packed family are bounded by MEMO_SIZE together, in one memo: past it the oldest is
    dropped and made again on use, choosing as before."""
    from attnselect.choose import selection

    target = _calibrated_h200(tmp_path, monkeypatch)
    monkeypatch.setattr(selection, "MEMO_SIZE", 3)
    sizes = [(18, 4096), (2, 100), (5, 2048), (60, 512), (1, 16384), (18, 4000)]
    for heads in (16, 8):  # two families
        for batch, seqlen in sizes:
            problem = _thd_training(batch, seqlen)._with(heads_q=heads, heads_kv=heads)
            carried = selection.select_packed(problem, target=target)
            assert carried.chosen == attnselect.select(problem, target=target).chosen
            assert len(selection._RANKINGS) <= 3


@pytest.mark.parametrize("forced", [None, "varlen_fa2"])
def test_predicted_packed_decisions_at_new_sizes_are_what_select_decides_there(tmp_path, monkeypatch, forced):
    """Ranked by predicted time, a decision carried to new sizes chooses, rents and ranks as select does at those
    sizes (the head of its ranking), as the predictions, the paid compiles, failures and cache clears change."""
    import random

    from attnselect.choose import first_calls
    from attnselect.choose.failures import mark_failed
    from attnselect.choose.selection import select_packed

    target = _calibrated_h200(tmp_path, monkeypatch)
    rng, seen, chosen = random.Random(0), set(), set()
    base = AttentionProblem(18, 4096, 4096, 16, 16, 128, 128, layout="thd", mask="causal", training=True,
                            dtype=torch.bfloat16)  # fmt: skip
    try:
        for step in range(400):
            if step == 150:  # FA4 compiled in this process: no rental from now on
                first_calls.ran(Candidate("flash_attn4"), base)
            if step == 250:  # the cuDNN frontend fails at some sizes: refused there
                mark_failed(base, target, Candidate("cudnn_frontend"), RuntimeError("broken"))
            if step == 300:
                attnselect.clear_cache()
            sizes = (rng.choice([1, 2, 5, 18, 60]), rng.choice([8, 16, 100, 512, 513, 1024, 4096, 16384]))
            if sizes in seen:
                continue
            seen.add(sizes)
            problem = AttentionProblem(
                sizes[0], sizes[1], sizes[1], 16, 16, 128, 128, layout="thd", mask="causal",
                training=rng.random() < 0.5, dtype=torch.bfloat16,
            )  # fmt: skip
            fresh = attnselect.select(problem, target=target, backend=forced)
            carried = select_packed(problem, target=target, backend=forced)
            assert carried.chosen == fresh.chosen and carried.rental == fresh.rental, problem.describe()
            assert carried.ranked == fresh.ranked[: len(carried.ranked)], problem.describe()
            if fresh.predictions is not None:  # at the sizes it describes: a decision drawn alike at another work
                # class may stand (selection._drawn_alike)
                own = attnselect.select(carried.problem, target=target, backend=forced).predictions
                assert carried.predictions[carried.chosen] == own[carried.chosen]
            assert select_packed(problem, target=target, backend=forced) is carried  # every layer of a step
            chosen.add((fresh.chosen, fresh.rental is not None))
    finally:
        first_calls.forget()
    if forced is None:  # the sizes changed the choice, and the rental came and went
        assert {c for c, _ in chosen} >= {Candidate("varlen_fa2"), Candidate("flash_attn4")}, chosen
        assert {rented for _, rented in chosen} == {True, False}


def test_a_predicted_packed_decision_carried_to_new_sizes_refuses_what_failed_there(tmp_path, monkeypatch):
    from attnselect.choose.failures import mark_failed
    from attnselect.choose.selection import select_packed

    target = Target.preset("h200", packages={"nvidia-cudnn-frontend": "1.32.0"})
    _packed_calibration(tmp_path, monkeypatch, target)
    small, large = (
        AttentionProblem(b, s, s, 16, 16, 128, 128, layout="thd", mask="causal", training=True, dtype=torch.bfloat16)
        for b, s in ((18, 4096), (60, 16384))
    )
    assert small.signature != large.signature  # another size class: failures are kept per signature
    frontend = Candidate("cudnn_frontend")
    assert attnselect.select(large, target=target).chosen == frontend
    mark_failed(large, target, frontend, RuntimeError("broken"))
    assert select_packed(small, target=target).chosen == frontend
    carried = select_packed(large, target=target)
    assert carried.chosen == attnselect.select(large, target=target).chosen != frontend
    assert carried.problem == large and "failed at run time" in str(carried.verdicts)


@pytest.mark.parametrize("paid", [False, True])
def test_carried_packed_decisions_settle_ties_as_select_does(tmp_path, monkeypatch, paid):
    """Under a calibration whose packed curves cross (FA4 issues slowly and runs fast, varlen_fa2 the other way), many
    packings' predicted times tie within rules.TIE_BAND: a new packing's carried decision chooses, rents and ranks as
    a fresh selection does, whatever packings came before in its size class."""
    import random

    from attnselect.choose import first_calls, rules, selection

    target = _calibrated_h200(tmp_path, monkeypatch)
    rng, ties = random.Random(1), 0
    for _ in range(400):
        problem = _thd_training(rng.choice([1, 2, 3, 5, 8, 13]), rng.choice([256, 700, 1000, 1500, 2048, 3000, 4096]))
        if paid:
            first_calls.ran(Candidate("flash_attn4"), problem)
        carried = selection.select_packed(problem, target=target)
        fresh = attnselect.select(problem, target=target)
        assert (carried.chosen, carried.rental) == (fresh.chosen, fresh.rental), problem.describe()
        assert carried.ranked == fresh.ranked[: len(carried.ranked)], problem.describe()
        ties += rules.tied(fresh.ranked[0], fresh.ranked, fresh.predictions)
    assert ties >= 5  # the band was met
    first_calls.forget()


def test_a_new_work_class_whose_order_brings_the_next_candidate_within_the_tie_band_is_drawn_anew(
    tmp_path, monkeypatch
):
    """A decision drawn at one work class is reused at another of its size class only where the next candidate stays
    beyond the tie band there too: varlen_fa2 (host 20, GPU 30 us) leads at the smaller work, where the cuDNN frontend
    runs 100 us on the GPU, and ties with it at the larger, where the frontend runs 32 us and costs less alone (host
    5): the larger packing's decision is drawn anew, as select draws it."""
    import json

    from attnselect.choose import calibration, first_calls, predict, selection
    from helpers import calibration_sample

    def packing(batch, seqlen):
        return AttentionProblem(batch, seqlen, seqlen, 16, 16, 128, 128, layout="thd", mask="causal", training=True,
                                dtype=torch.bfloat16)  # fmt: skip

    seed, small, large = packing(3, 1000), packing(4, 1024), packing(7, 1024)
    assert small.size_class == large.size_class and predict.work_class(small) != predict.work_class(large)
    target = Target.preset("h200", packages={"nvidia-cudnn-frontend": "1.32.0"})
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))
    data = calibration_sample(target)
    crossing = [[1.0, 100.0], [predict.work(small) * 1.05, 100.0], [predict.work(large) * 0.95, 32.0], [1e6, 32.0]]
    for backend, host, points in (("varlen_fa2", 20.0, [[1.0, 30.0], [1e6, 30.0]]), ("cudnn_frontend", 5.0, crossing)):
        keys = [(pad, phase) for pad in ("", "+pad") for phase in ("training", "inference")]
        data["host_us"][backend] = {f"thd{pad} {phase}": host for pad, phase in keys}
        data["gpu"][backend] = {f"thd 128/128{pad} {phase}": points for pad, phase in keys}
    data["first_call_ms"] = {}
    data["skipped"] = [b for b in data["skipped"] if b not in ("varlen_fa2", "cudnn_frontend")]
    data["skipped"] += ["sdpa_cudnn", "flex", "flash_attn4"]
    calibration.user_path(target).write_text(json.dumps(data))
    calibration._parsed.cache_clear()
    attnselect.clear_cache()
    first_calls.forget()
    selection.select_packed(seed, target=target)
    assert selection.select_packed(small, target=target).chosen == Candidate("varlen_fa2")
    fresh = attnselect.select(large, target=target)
    assert fresh.chosen == Candidate("cudnn_frontend")  # within the band, and shorter alone
    assert selection.select_packed(large, target=target).chosen == fresh.chosen


@pytest.mark.parametrize("calibrated", [False, True])
@pytest.mark.parametrize("asked", ["as attention() asks", "select_packed at every packing"])
def test_a_packed_class_s_standing_decision_is_what_select_packed_returns_there(tmp_path, monkeypatch, calibrated,
                                                                                asked):  # fmt: skip
    """Over random new packings of one family, as the paid compiles, failures and cache clears change: where a class
    (selection._Family.classify) has a standing decision, it is the decision select_packed returns there (one that
    rents too); asked as attention() asks (select_packed only where no class stands), each choice and rental is what a
    fresh select makes at those sizes."""
    import random

    from attnselect.choose import first_calls
    from attnselect.choose.failures import mark_failed
    from attnselect.choose.selection import select_packed, standing_decisions

    target = _calibrated_h200(tmp_path, monkeypatch) if calibrated else Target.preset("h100")
    rng, stood, rented, seen = random.Random(1), 0, 0, set()
    base = _thd_training(18, 4096)
    assert standing_decisions(base, target=target) is None  # no family yet
    try:
        for step in range(600):
            if step == 200:
                first_calls.ran(Candidate("flash_attn4"), base)
            if step == 350:
                mark_failed(base, target, Candidate("cudnn_frontend"), RuntimeError("broken"))
            if step == 450:
                attnselect.clear_cache()
            sizes = (rng.choice([1, 2, 3, 5, 18, 60]), rng.randrange(8, 20000))
            if sizes in seen:
                continue
            seen.add(sizes)
            problem = _thd_training(*sizes)
            standing = standing_decisions(problem, target=target)
            held = standing(problem) if standing is not None else None
            stood += held is not None
            if held is not None and asked == "as attention() asks":
                decision = held[1]
                fresh = attnselect.select(problem, target=target)
                assert decision.chosen == fresh.chosen and decision.rental == fresh.rental, problem.describe()
                continue
            decision = select_packed(problem, target=target)
            rented += decision.rental is not None
            assert held is None or held[1] is decision, problem.describe()
    finally:
        first_calls.forget()
    assert stood > 150  # of 600 packings, one in 3 or 4 falls in a class decided before (a loop's: most)
    assert rented > 0 if calibrated else rented == 0  # FA4's compile rented around until paid


def test_a_packed_family_s_class_is_what_carrying_a_decision_reads_of_its_sizes():
    """_Family.classify: whether the family's calibration ranks the call (one covers it, at enough queries), its work
    class where it does, its size class and its rules table, as the problem-level functions give them, at every
    size; on a target a calibration holds for (the H200 at the packaged one's versions) and on one none does."""
    from attnselect.choose import calibration, predict, rules, selection

    calibrated = Target.preset("h200", packages={"nvidia-cudnn-frontend": "1.32.0"}, torch_version="2.11.0+cu130",
                               cudnn_version="9.19.0")  # fmt: skip
    ranks = set()
    for target in (calibrated, Target.preset("a100")):
        for d_qk, d_v, training, mask in itertools.product((192, 128), (128,), (False, True), ("causal", "none")):
            first = AttentionProblem(4, 512, 512, 16, 16, d_qk, d_v, layout="thd", mask=mask, training=training,
                                     dtype=torch.bfloat16, tokens=4096)  # fmt: skip
            family = selection._Family(selection.select(first, target=target), first, (), target)
            for batch, longest, tokens in itertools.product((1, 2, 7, 40), (1, 15, 16, 300, 4096), (0, 4096, 65536)):
                problem = first._with(batch=batch, seqlen_q=longest, seqlen_kv=longest, tokens=tokens)
                holds = calibration.for_target(target)[0] is not None
                ranked = holds and calibration.outside(problem) is None
                expected = (ranked, predict.work_class(problem) if ranked else None, problem.size_class,
                            rules.table_for(problem, target)[0])  # fmt: skip
                assert family.classify(problem) == expected, problem.describe()
                assert family.classify(problem) == expected  # asked again: the same
                ranks.add((target.name, ranked))
    assert ranks == {(calibrated.name, True), (calibrated.name, False), ("NVIDIA A100", False)}


def test_a_class_stands_on_its_decision_while_its_sized_verdicts_and_paid_compiles_hold(monkeypatch):
    """selection._stand keeps a decision carried to a class, one that rents too; a packing of the class gets it where
    the paid compiles are as they were and the verdicts that read sizes judge alike at its sizes."""
    from attnselect.choose import first_calls, selection
    from attnselect.choose.first_calls import Rental
    from attnselect.spec.options import Verdict

    h200 = Target.preset("h200")
    problem = _thd_training(4, 512)
    decision = selection.select(problem, target=h200)
    family = selection._Family(decision, problem, (), h200)
    key, paid = family.classify(problem), first_calls.paid_state()
    entry = family.by_table[key[3]] = (decision, ())  # the rules table's decision there, as select_packed keeps it
    alike = problem._with(seqlen_q=513, seqlen_kv=513)  # the same class
    renting = dataclasses.replace(decision, rental=object.__new__(Rental))
    selection._stand(family, key, renting, paid, witness=entry)
    assert family.standing_at(alike) == (key, renting)  # a packed rental reads the paid compiles, not the sizes
    selection._stand(family, key, decision, paid, witness=entry)
    assert family.standing_at(alike) == (key, decision)
    assert family.standing_at(problem._with(batch=400)) is None  # another class
    own = decision.verdicts[0]
    selection._stand(family, key, decision, paid, sized=(own,), witness=entry)  # judged alike at the new sizes
    assert family.standing_at(alike) == (key, decision)
    refused = Verdict(own.candidate, ("refused at other sizes",))
    selection._stand(family, key, decision, paid, sized=(refused,), witness=entry)
    assert family.standing_at(alike) is None
    check = (decision.chosen, True, True, False)  # the table's standing check of its choice, read at each size
    entry = family.by_table[key[3]] = (decision, (check,))
    selection._stand(family, key, decision, paid, checks=entry[1], witness=entry)
    assert family.standing_at(alike) == (key, decision)
    reasons = selection._reasons
    monkeypatch.setattr(
        selection, "_reasons", lambda c, p, *a: ("too long",) if p.seqlen_q == 513 else reasons(c, p, *a)
    )
    assert family.standing_at(alike) is None  # the choice does not serve there: select_packed decides again
    monkeypatch.setattr(selection, "_reasons", reasons)
    selection._stand(family, key, decision, paid, witness=entry)
    monkeypatch.setattr(selection, "MEMO_SIZE", 2)  # bounded: past its size the classes start again
    selection._stand(family, ("another",), decision, paid, witness=entry)
    selection._stand(family, ("a third",), decision, paid, witness=entry)
    assert list(family.standing) == [("a third",)]
    selection._stand(family, key, decision, paid, witness=entry)
    try:
        first_calls.ran(Candidate("flash_attn4"), problem)  # a compile paid since: select_packed draws again
        assert family.standing_at(alike) is None
    finally:
        first_calls.forget()


def test_a_packing_the_rules_table_ranks_under_a_calibration_does_not_stand(tmp_path, monkeypatch):
    """Where a candidate the calibration cannot rank serves, the table ranks the call: whether one serves reads the
    packing's sizes, so no class stands on the table's decision there."""
    import json

    from attnselect.choose import calibration, selection

    target = _calibrated_h200(tmp_path, monkeypatch)
    data = json.loads(calibration.user_path(target).read_text())
    data["skipped"].remove("flex")  # flex serves these calls and has no curve: unranked
    calibration.user_path(target).write_text(json.dumps(data))
    calibration._parsed.cache_clear()
    attnselect.clear_cache()
    for seqlen in (4096, 4097, 4098):
        decision = selection.select_packed(_thd_training(18, seqlen), target=target)
        assert decision.predictions is None  # the table ranked it
    family = next(iter(selection._PACKED.values()))
    assert family.calibrated.unranked == (Candidate("flex"),) and family.standing == {}


def test_a_later_draw_where_a_class_was_carried_from_ends_its_standing(tmp_path, monkeypatch):
    """A class stands on the decision carried from its ranking's draw (calibrated) or its table's decision (the rules
    table) while that is what select_packed reads there: a later draw or table decision (another thread's, say)
    ends it, as does the ranking or the family leaving their bounded memos; a decision under another table leaves
    it standing, as select_packed would carry it still."""
    from attnselect.choose import first_calls, selection

    h100 = Target.preset("h100")  # no calibration holds: the rules table ranks
    for seqlen in (4096, 4097, 4098):  # one table, one class
        selection.select_packed(_thd_training(18, seqlen), target=h100)
    probe = _thd_training(18, 4099)
    standing = selection.standing_decisions(probe, target=h100)
    family = standing.__self__
    key, decision = standing(probe)
    selection.select_packed(_thd_training(2, 100), target=h100)  # the small-pack table: made there
    assert standing(probe) == (key, decision)
    entry = family.by_table[key[3]]
    family.by_table[key[3]] = (decision, entry[1])  # the same decision, decided again: another entry
    assert standing(probe) is None
    family.by_table[key[3]] = entry
    assert standing(probe) == (key, decision)
    monkeypatch.setattr(selection, "MEMO_SIZE", 1)  # the family leaves the memo: select_packed keeps a new one
    selection.select_packed(dataclasses.replace(probe, head_dim_qk=192), target=h100)
    assert standing(probe) is None

    target = _calibrated_h200(tmp_path, monkeypatch)
    monkeypatch.setattr(selection, "MEMO_SIZE", 4096)
    try:
        first_calls.ran(Candidate("flash_attn4"), probe)  # paid: nothing rents
        for seqlen in (4096, 4097, 4098):
            selection.select_packed(_thd_training(18, seqlen), target=target)
        standing = selection.standing_decisions(probe, target=target)
        key, decision = standing(probe)
        ranking = next(r for r in selection._RANKINGS.values() if r.decided and r.decided[0] is decision)
        drawn = ranking.decided
        ranking.decided = (*drawn[:2], drawn[2])  # drawn again alike: another draw
        assert standing(probe) is None
        ranking.decided = drawn
        assert standing(probe) == (key, decision)
        monkeypatch.setattr(selection, "MEMO_SIZE", 1)  # the ranking leaves the memo: select_packed draws anew there
        selection.select_packed(_thd_training(60, 300), target=target)
        assert ranking.decided is None and standing(probe) is None
    finally:
        first_calls.forget()


def test_a_packed_family_draws_as_select_does_under_random_prices_curves_failures_and_runs():
    """select_packed (its carried, drawn-alike and standing decisions, the draw stopping where none could rent around
    its first) chooses and rents as a fresh select() does, packing after packing, on the packaged H200 calibration
    with its packed first-call prices drawn at random (ties and free ones among them), curves scaled, failures
    recorded, candidates run or disabled, captured or compiled calls among them. Seeded."""
    import copy
    import json
    import logging
    import random

    from attnselect.choose import calibration, failures, first_calls, selection

    packages = (
        {"flash-attn-4": "4.0.0b36", "nvidia-cudnn-frontend": "1.32.0", "flash-attn": "2.8.3"},
        {"nvidia-cudnn-frontend": "1.32.0"},
        {"flash-attn-4": "4.0.0b36", "nvidia-cudnn-frontend": "1.32.0"},
    )
    targets = [Target.preset("h200", packages=p, torch_version="2.11.0+cu130", cudnn_version="9.19.0")
               for p in packages]  # fmt: skip
    base = calibration.packaged(targets[0])
    prices = [0.0, 20.0, 60.0, 71.795, 200.0, 200.0, 2717.0, 9437.0]
    runnable = [Candidate("varlen_fa2"), Candidate("varlen_fa2", 192), Candidate("cudnn_frontend"),
                Candidate("flash_attn4"), Candidate("cudnn_frontend", 192), Candidate("flash_attn4", 192)]  # fmt: skip
    logging.disable(logging.WARNING)
    compared = 0
    try:
        for trial in range(40):
            rng = random.Random(trial)
            target, data = rng.choice(targets), copy.deepcopy(base)
            for costs in data["first_call_ms"].values():
                for kind in [k for k in costs if k.startswith("thd")]:
                    costs[kind] = rng.choice(prices)
            for backend in ("varlen_fa2", "cudnn_frontend", "flash_attn4"):
                if rng.random() < 0.5:
                    f = rng.choice([0.3, 0.9, 1.0, 1.1])
                    for kind, points in data["gpu"].get(backend, {}).items():
                        if kind.startswith("thd"):
                            data["gpu"][backend][kind] = [[x, y * f] for x, y in points]
            calibration.user_path(target).write_text(json.dumps(data))
            calibration._parsed.cache_clear()
            attnselect.clear_cache()
            first_calls.forget()
            dims, training = rng.choice([(192, 128), (128, 128), (64, 64)]), rng.random() < 0.6
            graph = rng.choice([{}, {}, {"compiled_graph": True}, {"cuda_graph_capture": True}])
            disable = rng.choice([None, "flash_attn4", "cudnn_frontend", "varlen_fa2"])

            def pack(b: int, s: int, rng=rng, dims=dims, training=training, graph=graph) -> AttentionProblem:
                return AttentionProblem(b, s, s, 16, 16, *dims, layout="thd", mask="causal", training=training,
                                        tokens=max(b, int(b * s * rng.uniform(0.5, 1.0))), dtype=torch.bfloat16,
                                        **graph)  # fmt: skip

            sizes = [1, 2, 3, 4, 6, 9, 13], [256, 400, 700, 900, 1024, 1500, 2048, 4096]
            for _ in range(rng.choice([0, 0, 1])):
                failures.mark_failed(pack(*map(rng.choice, sizes)), target, rng.choice(runnable),
                                     MemoryError("out of memory"), falls_back=True)  # fmt: skip
            for _ in range(12):
                problem = pack(*map(rng.choice, sizes))
                if rng.random() < 0.15:
                    first_calls.ran(rng.choice(runnable), dataclasses.replace(problem, cuda_graph_capture=False))
                try:
                    carried = selection.select_packed(problem, target=target, disable=disable)
                except attnselect.NoSupportedCandidateError:
                    continue
                fresh = selection._decide(problem, target, carried.overrides)
                assert (carried.chosen, carried.rental) == (fresh.chosen, fresh.rental), (trial, problem.describe())
                assert carried.ranked == fresh.ranked[: len(carried.ranked)], (trial, problem.describe())
                standing = selection.standing_decisions(problem, target=target, disable=disable)
                held = standing(problem) if standing else None
                assert held is None or (held[1].chosen, held[1].rental) == (fresh.chosen, fresh.rental), trial
                compared += 1
    finally:
        logging.disable(logging.NOTSET)
        calibration._parsed.cache_clear()
        attnselect.clear_cache()
        first_calls.forget()
    assert compared > 300

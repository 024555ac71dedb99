"""Predicted times from a calibration, and the rules' ranking by them (attnselect.choose.predict, rules)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import attnselect
from attnselect import backends
from attnselect.choose import calibration, predict, rules
from attnselect.spec.masks import visible
from attnselect.spec.options import Candidate
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target
from helpers import CALIBRATED_H200 as H200
from helpers import calibration_sample as sample
from helpers import replaying_calibration_sample as replaying_sample


@pytest.mark.parametrize(
    "mask,window,sq,skv",
    [("none", None, 5, 7), ("causal", None, 6, 6), ("causal_bottom_right", None, 3, 8),
     ("causal_bottom_right", None, 8, 3), ("sliding_window", (2, 1), 9, 9), ("sliding_window", (2, 0), 4, 9),
     ("sliding_window_top_left", (3, 0), 6, 10)],
)  # fmt: skip
def test_visible_pairs_count_what_the_mask_shows(mask, window, sq, skv):
    shown = visible(mask, window, sq, skv, "cpu")
    assert predict.visible_pairs(mask, window, sq, skv) == (sq * skv if shown is None else int(shown.sum()))


def test_visible_pairs_in_closed_form_count_what_every_mask_shows():
    import random

    rng = random.Random(1)
    for _ in range(2000):
        sq, skv = rng.randint(1, 40), rng.randint(1, 40)
        mask = rng.choice(["none", "causal", "causal_bottom_right", "sliding_window", "sliding_window_top_left"])
        window = (rng.randint(-1, 45), rng.randint(-1, 45)) if mask.startswith("sliding") else None
        shown = visible(mask, window, sq, skv, "cpu")
        expected = sq * skv if shown is None else int(shown.sum())
        assert predict.visible_pairs(mask, window, sq, skv) == expected, (mask, window, sq, skv)
        assert predict._banded_pairs.__wrapped__(mask, window, sq, skv) == expected, (mask, window, sq, skv)


def _packed(lengths, tokens=None, mask="causal", window=None):
    """A packed problem of sequences of ``lengths`` (self-attention), with q's rows (``tokens``: their sum)."""
    tokens = sum(lengths) if tokens is None else tokens
    return AttentionProblem(len(lengths), max(lengths), max(lengths), 16, 16, 192, 128, layout="thd", mask=mask,
                            window=window, tokens=tokens)  # fmt: skip


def _exact_work(problem, lengths):
    return sum(predict.work(AttentionProblem(1, n, n, 16, 16, 192, 128, mask=problem.mask, window=problem.window))
               for n in lengths)  # fmt: skip


@pytest.mark.parametrize("mask,window", [("none", None), ("causal", None), ("sliding_window", (100, 0))])
def test_a_pack_s_work_is_its_longest_sequence_and_the_rest_of_its_tokens_shared_evenly(mask, window):
    """The host knows a pack's sequences, longest length and tokens, not its lengths: the work is one sequence at the
    longest and the others at an even share of the rest, exact for such packs, the least any pack of those three
    can do, and never more than every sequence at the longest (the pack without its tokens)."""
    import random

    assert predict.work(_packed([1000, 300, 300, 300], mask=mask, window=window)) == pytest.approx(
        _exact_work(_packed([1], mask=mask, window=window), [1000, 300, 300, 300])
    )
    rng = random.Random(3)
    for _ in range(300):
        lengths = [rng.randint(1, 2000) for _ in range(rng.randint(1, 30))]
        packed = _packed(lengths, mask=mask, window=window)
        exact, estimate = _exact_work(packed, lengths), predict.work(packed)
        assert estimate <= exact * 1.001 + 1e-9  # rounding the even share
        assert estimate <= predict.work(dataclasses.replace(packed, tokens=0)) * (1 + 1e-9)
    assert predict.work(_packed([500, 500], tokens=5000)) == predict.work(_packed([500, 500], tokens=0))  # gaps


def test_the_ladder_s_64k_packing_is_estimated_near_its_work_and_without_tokens_8x_above():
    """52 sequences, the longest 10269 tokens, in 65536 (results/cpu_explain_packed_64k_63c7283.txt): every sequence
    at the longest is 8x the tokens the pack has."""
    lengths = [10269] + [1084] * 50 + [1067]
    packed = _packed(lengths)
    assert sum(lengths) == 65536 and len(lengths) == 52
    assert predict.work(packed) == pytest.approx(_exact_work(packed, lengths), rel=0.01)
    assert predict.work(dataclasses.replace(packed, tokens=0)) > 8 * predict.work(packed)


def test_the_time_follows_the_curve_between_below_and_above_its_points():
    points = [[10.0, 20.0], [1000.0, 200.0]]
    assert predict._along(points, 1.0) == 20.0  # below the ladder: the first point (launch-bound)
    assert predict._along(points, 100.0) == pytest.approx(63.245, rel=1e-4)  # log-log between the two
    assert predict._along(points, 2000.0) == 400.0  # above: the last point's throughput


def test_a_candidate_s_curve_predicts_at_every_size_what_its_problem_at_that_size_is_predicted():
    """The curve (host time, GPU points, basis) does not depend on the call's sizes: one made at any size predicts a
    packed loop's every packing, at its work class."""
    import dataclasses

    base = AttentionProblem(3, 700, 700, 16, 16, 192, 128, mask="causal", training=True, dtype=torch.bfloat16)
    curves = {c: predict.curve(c, base, sample()) for c in (Candidate("sdpa_cudnn"), Candidate("flash_attn4", 192),
                                                            Candidate("sdpa_math"))}  # fmt: skip
    assert curves[Candidate("sdpa_cudnn")] and curves[Candidate("flash_attn4", 192)]
    assert curves[Candidate("sdpa_math")] is None  # not calibrated
    for c, curve in curves.items():
        for batch, seqlen in ((1, 16), (3, 700), (40, 5000), (2, 100000)):
            problem = dataclasses.replace(base, batch=batch, seqlen_q=seqlen, seqlen_kv=seqlen)
            expected = predict.predict(c, problem, sample())
            assert (curve.at(problem) if curve else None) == expected
            assert curve is None or curve.at_class(predict.work_class(problem)) == expected


def _with_forward(data: dict) -> dict:
    """``data`` with sdpa_cudnn's dense 192/128 inference curve: its training calls' forward share."""
    data["gpu"]["sdpa_cudnn"]["dense 192/128 inference"] = [[10.0, 6.0], [1e4, 300.0]]
    return data


def test_a_training_call_alone_hides_its_backward_s_host_time_behind_its_forward_s_gpu_time():
    """Alone, a training call issues its backward while its forward runs: it waits for the forward's host time, the
    longer of the forward's GPU time and the backward's host time, then the backward's GPU time (predict.Curve
    .forward: training's host time less inference's, the inference curve at the same work)."""
    data = _with_forward(sample())
    c = Candidate("sdpa_cudnn")
    backward_host = 60.0 - 25.0
    for seqlen in (64, 700, 5000, 40000):
        problem = AttentionProblem(1, seqlen, seqlen, 16, 16, 192, 128, mask="causal", training=True,
                                   dtype=torch.bfloat16)  # fmt: skip
        at = predict.class_work(predict.work_class(problem))
        forward_gpu = predict._along(data["gpu"]["sdpa_cudnn"]["dense 192/128 inference"], at)
        got = predict.predict(c, problem, data)
        assert got.hidden_us == pytest.approx(min(backward_host, forward_gpu))
        assert got.alone_us == pytest.approx(25.0 + max(forward_gpu, backward_host) + got.gpu_us - forward_gpu)
        assert got.total_us == predict.predict(c, problem, sample()).total_us  # a stack's time: unchanged
        inference = predict.predict(c, dataclasses.replace(problem, training=False), data)
        assert inference.hidden_us == 0.0 and inference.alone_us == inference.host_us + inference.gpu_us
    problem = AttentionProblem(1, 5000, 5000, 16, 16, 192, 128, mask="causal", training=True, dtype=torch.bfloat16)
    assert predict.predict(c, problem, data).hidden_us == backward_host  # the forward's GPU time is the longer
    # nothing to hide by without the inference curve (flash_attn4 here) or host time, or in a captured call
    assert predict.predict(Candidate("flash_attn4"), problem, data).hidden_us == 0.0
    no_host = _with_forward(sample())
    del no_host["host_us"]["sdpa_cudnn"]["dense inference"]
    assert predict.predict(c, problem, no_host).hidden_us == 0.0
    captured = predict.predict(c, dataclasses.replace(problem, cuda_graph_capture=True), data)
    assert captured.hidden_us == 0.0 and captured.alone_us == captured.gpu_us


def test_the_hidden_backward_host_time_reads_the_curve_s_own_dims_and_padding_and_dense_calls_alone():
    """Curve.forward: a padded candidate's inference host time and curve are the padded ones; a call predicted on
    the nearest calibrated dims reads the inference curve of those dims; the hidden time is at most the GPU time and
    none where inference's host time is the longer; a packed call alone keeps host + GPU (the ladders scored dense
    rungs only: results/cpu_ladder_rules_hidden.md)."""
    data = _with_forward(sample())
    data["host_us"]["sdpa_cudnn"]["dense+pad inference"] = 70.0
    data["gpu"]["sdpa_cudnn"]["dense 192/128+pad inference"] = [[10.0, 9.0], [1e4, 5000.0]]
    long = AttentionProblem(1, 5000, 5000, 16, 16, 192, 128, mask="causal", training=True, dtype=torch.bfloat16)
    padded = predict.predict(Candidate("sdpa_cudnn", 192), long, data)
    assert padded.hidden_us == pytest.approx(80.0 - 70.0)  # the padded host times, not the native ones (35)
    short = dataclasses.replace(long, seqlen_q=64, seqlen_kv=64)
    at = predict.class_work(predict.work_class(short))
    padded_short = predict.predict(Candidate("sdpa_cudnn", 192), short, data)
    assert padded_short.hidden_us == pytest.approx(min(10.0, predict._along([[10.0, 9.0], [1e4, 5000.0]], at)))
    # 128/128 is not calibrated: its curve and forward are the nearest dims', 192/128
    other_dims = predict.predict(Candidate("sdpa_cudnn"), dataclasses.replace(long, head_dim_qk=128), data)
    assert "nearest" in other_dims.basis and other_dims.hidden_us == 35.0
    # the forward's GPU time above the whole call's (a made-up inference curve) hides no more than the call's GPU time
    slow = _with_forward(sample())
    slow["host_us"]["sdpa_cudnn"]["dense inference"] = 0.0
    slow["gpu"]["sdpa_cudnn"]["dense 192/128 inference"] = [[10.0, 1e6], [1e4, 1e7]]
    bounded = predict.predict(Candidate("sdpa_cudnn"), short, slow)
    assert bounded.hidden_us == bounded.gpu_us < 60.0
    inverted = _with_forward(sample())
    inverted["host_us"]["sdpa_cudnn"]["dense inference"] = 90.0  # above training's 60
    assert predict.predict(Candidate("sdpa_cudnn"), long, inverted).hidden_us == 0.0
    packed_data = _with_forward(sample())
    packed_data["host_us"]["sdpa_cudnn"].update({"thd training": 60.0, "thd inference": 25.0})
    packed_data["gpu"]["sdpa_cudnn"].update({"thd 192/128 training": [[10.0, 20.0], [1e4, 1000.0]],
                                             "thd 192/128 inference": [[10.0, 6.0], [1e4, 300.0]]})  # fmt: skip
    packed = predict.predict(Candidate("sdpa_cudnn"), dataclasses.replace(_packed([3000, 1000, 1000]), training=True),
                             packed_data)  # fmt: skip
    assert packed is not None and packed.hidden_us == 0.0 and packed.alone_us == packed.host_us + packed.gpu_us


def test_a_tie_goes_to_the_candidate_whose_backward_host_time_its_forward_hides():
    """rules.settled: two candidates within the tie band, the one with the more host time faster alone once its
    backward's host time hides behind its forward's GPU time (the H200 ladders' B1 S8k 192/128 training: FA4 against
    sdpa_cudnn, results/cpu_ladder_rules_hidden.md)."""
    from attnselect.choose import rules

    a, b = Candidate("flash_attn4"), Candidate("sdpa_cudnn")
    lean = predict.Prediction(342.0, 2588.8, "test", None, 0.0)
    predicted = {a: predict.Prediction(576.5, 2448.0, "test", None, 0.0), b: lean}
    assert predicted[a].total_us < lean.total_us and predicted[a].alone_us > lean.alone_us
    assert list(rules.settled([a, b], predicted)) == [b, a]  # by host + GPU: sdpa_cudnn
    hiding = predict.Prediction(576.5, 2448.0, "test", None, 482.0)
    predicted = {a: hiding, b: dataclasses.replace(lean, hidden_us=307.4)}
    assert list(rules.settled([a, b], predicted)) == [a, b]


def test_a_prediction_is_the_longer_of_host_and_gpu_and_a_quarter_of_the_shorter():
    """In a stack of layers the shorter of host and GPU time hides behind the longer but for predict.UNHIDDEN of it;
    alone, a call waits for both."""
    problem = AttentionProblem(1, 256, 256, 16, 16, 192, 128, mask="causal", training=True, dtype=torch.bfloat16)
    small = predict.predict(Candidate("sdpa_cudnn"), problem, sample())
    assert predict.UNHIDDEN == 0.25 and small.host_us == 60.0 and small.gpu_us > small.host_us
    assert small.total_us == small.gpu_us + 15.0 and small.alone_us == small.gpu_us + 60.0
    captured = predict.Prediction(host_us=0.0, gpu_us=small.gpu_us, basis="graph")  # a graph's replay: GPU alone
    assert captured.total_us == captured.alone_us == small.gpu_us
    assert predict.predict(Candidate("sdpa_math"), problem, sample()) is None  # not calibrated
    other = AttentionProblem(1, 256, 256, 16, 16, 128, 128, training=True, dtype=torch.bfloat16)
    other_dims = predict.predict(Candidate("sdpa_cudnn"), other, sample())
    assert other_dims.basis == "dense 192/128 training (nearest calibrated dims)"
    assert predict.predict(Candidate("sdpa_flash", 192), problem, sample()) is None  # no curve of its own


def test_calls_of_one_work_class_are_predicted_alike_at_its_centre():
    """A call is predicted at its work's class (2^(1/8) steps): the calls of a class share their predictions, and
    a class's centre is within 2^(1/16) of each of its calls' work."""
    problems = [
        AttentionProblem(batch, seqlen, seqlen, 16, 16, 192, 128, mask="causal", training=True, dtype=torch.bfloat16)
        for batch in (1, 2, 3, 5) for seqlen in range(200, 4000, 37)
    ]  # fmt: skip
    by_class = {}
    for problem in problems:
        cls = predict.work_class(problem)
        assert 2 ** (-1 / 16) <= predict.class_work(cls) / predict.work(problem) <= 2 ** (1 / 16)
        time = predict.predict(Candidate("sdpa_cudnn"), problem, sample())
        assert by_class.setdefault(cls, time) == time
    assert len(by_class) > 20
    empty = AttentionProblem(0, 0, 0, 16, 16, 192, 128, layout="thd", dtype=torch.bfloat16)
    assert predict.class_work(predict.work_class(empty)) == 0.0


def test_a_captured_call_is_predicted_by_its_gpu_time_alone():
    """A CUDA graph replays a captured call without the host issuing it: its host time does not count."""
    import dataclasses

    problem = AttentionProblem(1, 256, 256, 16, 16, 192, 128, mask="causal", training=True, dtype=torch.bfloat16)
    eager = predict.predict(Candidate("sdpa_cudnn"), problem, sample())
    captured = predict.predict(Candidate("sdpa_cudnn"), dataclasses.replace(problem, cuda_graph_capture=True), sample())
    assert eager.host_us > 0 and captured.host_us == 0.0 and captured.total_us == captured.gpu_us == eager.gpu_us


@pytest.fixture
def calibrated(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))
    calibration._parsed.cache_clear()
    calibration.user_path(H200).write_text(json.dumps(sample()))
    attnselect.clear_cache()
    yield
    calibration._parsed.cache_clear()
    attnselect.clear_cache()


def test_small_calls_go_to_the_kernel_with_the_least_host_time_and_large_ones_to_the_fastest_gpu(calibrated):
    small = AttentionProblem(1, 256, 256, 16, 16, 192, 128, mask="causal", training=True, dtype=torch.bfloat16)
    large = AttentionProblem(4, 8192, 8192, 16, 16, 192, 128, mask="causal", training=True, dtype=torch.bfloat16)
    decision = attnselect.select(small, target=H200)
    assert decision.chosen == Candidate("sdpa_cudnn") and decision.predictions is not None
    assert "its predicted time" in decision.why and "is the lowest" in decision.why
    assert attnselect.select(large, target=H200).ranked[0] == Candidate("flash_attn4")  # chosen once compiled
    # the same call always gets the same choice
    assert attnselect.select(small, target=H200).chosen == decision.chosen


def test_explain_prints_each_candidates_predicted_time_and_its_parts(calibrated):
    problem = AttentionProblem(1, 256, 256, 16, 16, 192, 128, mask="causal", training=True, dtype=torch.bfloat16)
    report = attnselect.explain(problem, target=H200)
    ranked = "ranked:  by predicted time in a stack of layers, the longer of host and GPU and 25% of the shorter"
    assert f"{ranked} (calibration" in report and "predicted us (host, GPU)" in report
    row = next(line for line in report.splitlines() if line.startswith("sdpa_cudnn "))
    assert "(60.0," in row


def test_explain_json_holds_each_candidates_predicted_time_and_its_parts(calibrated):
    """``explain --json`` (Decision.to_dict): what the report prints, in fields a script can read."""
    problem = AttentionProblem(1, 256, 256, 16, 16, 192, 128, mask="causal", training=True, dtype=torch.bfloat16)
    decision = attnselect.select(problem, target=H200)
    data = json.loads(json.dumps(decision.to_dict()))
    assert data["ranked_by"] == "predicted time" and data["calibration"] == decision.calibration
    row = next(c for c in data["candidates"] if c["backend"] == "sdpa_cudnn" and c["pad_to"] is None)
    predicted = decision.predictions[Candidate("sdpa_cudnn")]
    assert predicted.host_us == 60.0  # the sample's host time (the report's row shows it too)
    assert row["predicted_us"] == {
        "total": predicted.total_us, "host": predicted.host_us, "gpu": predicted.gpu_us, "alone": predicted.alone_us,
        "hidden": predicted.hidden_us, "new_packing_host": None, "before_replay_host": None, "basis": predicted.basis,
    }  # fmt: skip
    refused = [c for c in data["candidates"] if not c["supported"]]
    assert refused and all("predicted_us" not in c for c in refused)
    rules = attnselect.select(problem, target=Target.preset("h100")).to_dict()
    assert rules["ranked_by"] == "rules table" and "attnselect calibrate" in rules["calibration"]
    assert all("predicted_us" not in c for c in rules["candidates"])


def test_explain_says_how_a_packed_call_s_work_was_taken(tmp_path, monkeypatch):
    """Without q's rows a pack's work is every sequence at the longest (up to 50x its work): explain says so, and how
    to give them."""
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))  # the packaged calibration
    calibration._parsed.cache_clear()
    attnselect.clear_cache()
    packaged = Target.preset("h200", packages={"flash-attn-4": "4.0.0b36", "nvidia-cudnn-frontend": "1.32.0"},
                             torch_version="2.11.0+cu130")  # fmt: skip
    problem = AttentionProblem(52, 10269, 10269, 16, 16, 192, 128, layout="thd", mask="causal", training=True)
    without, given = (attnselect.explain(dataclasses.replace(problem, tokens=t), target=packaged) for t in (0, 65536))
    assert "ranked:  by predicted time" in without and "ranked:  by predicted time" in given
    assert "work:    every sequence taken as long as the longest" in without and "work:" not in given
    attnselect.clear_cache()


def test_without_a_calibration_the_table_ranks_and_explain_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_packaged", lambda arch: (_ for _ in ()).throw(FileNotFoundError(arch)))
    calibration._parsed.cache_clear()
    attnselect.clear_cache()
    problem = AttentionProblem(1, 4096, 4096, 16, 16, 192, 128, mask="causal", training=True, dtype=torch.bfloat16)
    decision = attnselect.select(problem, target=H200)
    assert decision.predictions is None and decision.chosen == Candidate("flash_attn4")
    why = "no calibration for the NVIDIA H200 (sm90): `attnselect calibrate` on it makes one"
    assert f"ranked:  by the rules table ({why})" in decision.report()


def test_calls_unlike_the_calibrated_ones_are_ranked_by_the_table(calibrated):
    """Decoding, fp32, sliding windows and packed calls are not what calibrations measure: the table ranks them, and
    explain says why."""
    base = dict(batch=1, seqlen_q=256, seqlen_kv=256, heads_q=16, heads_kv=16, head_dim_qk=192, head_dim_v=128,
                training=True, dtype=torch.bfloat16)  # fmt: skip
    for change in (dict(seqlen_q=1, mask="causal_bottom_right"), dict(dtype=torch.float32),
                   dict(mask="sliding_window", window=(64, 0))):  # fmt: skip
        decision = attnselect.select(AttentionProblem(**{**base, **change}), target=H200)
        assert decision.predictions is None and "covers dense and packed bf16/fp16 calls" in decision.calibration


def test_a_calibration_missing_a_served_candidate_ranks_nothing(calibrated):
    """A candidate the calibration neither measured nor skipped would rank last on no evidence: the table ranks."""
    partial = sample(skipped=["sdpa_math", "reference"])
    calibration.user_path(H200).write_text(json.dumps(partial))
    calibration._parsed.cache_clear()
    attnselect.clear_cache()
    problem = AttentionProblem(1, 256, 256, 16, 16, 192, 128, mask="causal", training=True, dtype=torch.bfloat16)
    decision = attnselect.select(problem, target=H200)
    assert decision.predictions is None and "has no curve for" in decision.calibration


def test_the_same_machine_without_fa4_is_ranked_by_the_calibration_and_another_fa4_is_not(calibrated):
    problem = AttentionProblem(1, 256, 256, 16, 16, 192, 128, mask="causal", training=True, dtype=torch.bfloat16)
    without = attnselect.select(problem, target=Target.preset("h200"))
    assert without.predictions is not None and without.chosen == Candidate("sdpa_cudnn")
    other = attnselect.select(problem, target=Target.preset("h200", packages={"flash-attn-4": "4.0.0b40"}))
    assert other.predictions is None
    assert "does not hold for flash_attn4: flash-attn-4 4.0.0b40 is installed" in other.calibration


PACKED = AttentionProblem(8, 2048, 2048, 16, 16, 192, 128, layout="thd", mask="causal", training=True,
                          dtype=torch.bfloat16)  # fmt: skip


def test_packed_calls_rank_by_their_calibrated_curves_and_per_sequence_candidates_after(calibrated):
    """A packed candidate's curve was timed with a new packing every call, so what it rebuilds per packing on the
    GPU is in its GPU time; candidates that run sequence by sequence are not calibrated and rank after the packed
    ones."""
    data = sample()
    data["host_us"]["flash_attn4"].update({"thd training": 400.0, "thd+pad training": 420.0})
    data["gpu"]["flash_attn4"].update({"thd 192/128 training": [[10.0, 30.0], [1e4, 900.0]],
                                       "thd 192/128+pad training": [[10.0, 35.0], [1e4, 1100.0]]})  # fmt: skip
    calibration.user_path(H200).write_text(json.dumps(data))
    calibration._parsed.cache_clear()
    attnselect.clear_cache()
    decision = attnselect.select(PACKED, target=H200)
    assert decision.predictions is not None and decision.chosen == Candidate("flash_attn4")
    packs = [backends.get(c.backend).packs_thd(H200) for c in decision.ranked]
    assert packs == sorted(packs, reverse=True)  # every packed candidate first
    per_sequence = [c for c, p in zip(decision.ranked, packs) if not p]
    assert per_sequence and all(decision.predictions[c] is None for c in per_sequence)


def test_a_packed_call_s_host_time_is_spread_over_the_calls_that_share_its_packing(calibrated, caplog):
    """The first call of a packing decides and prepares for it (new_packing_us); the others sharing it take the
    time of a call on a packing seen: a stack ranks by their mean, a call alone waits for the first's."""
    data = sample()
    data["host_us"]["flash_attn4"].update({"thd training": 400.0, "dense training": 50.0})
    data["new_packing_us"] = {"flash_attn4": {"thd training": 1200.0, "thd+pad training": 1300.0}}
    data["host_us"]["flash_attn4"]["thd+pad training"] = 420.0
    data["gpu"]["flash_attn4"].update({"thd 192/128 training": [[10.0, 30.0], [1e4, 900.0]],
                                       "thd 192/128+pad training": [[10.0, 35.0], [1e4, 1100.0]]})  # fmt: skip
    assert calibration._problem(data) is None
    packed = predict.predict(Candidate("flash_attn4"), PACKED, data)
    assert packed.host_us == 400.0 + 800.0 / predict.PACKING_SHARED_BY and packed.new_packing_host_us == 1200.0
    assert packed.alone_us == 1200.0 + packed.gpu_us
    assert str(packed).endswith(f"(host 500.0, a new packing's call 1200.0, GPU {packed.gpu_us:.1f})")
    dense = predict.predict(Candidate("flash_attn4"), dataclasses.replace(PACKED, layout="bshd"), data)
    assert dense.host_us == 50.0 and dense.new_packing_host_us is None  # a dense call has no packing
    captured = predict.predict(Candidate("flash_attn4"), dataclasses.replace(PACKED, cuda_graph_capture=True), data)
    assert captured.host_us == 0.0 and captured.new_packing_host_us is None  # a replay issues nothing
    noisy = dict(data, host_us=dict(data["host_us"], flash_attn4={"thd training": 1500.0}))
    below = predict.predict(Candidate("flash_attn4"), PACKED, noisy)  # a new packing's below a seen one's: noise
    assert below.host_us == below.new_packing_host_us == 1500.0
    for bad in ({"flash_attn4": {"dense training": 1.0}}, {"flash_attn4": {"thd training": -1.0}}, [1.0]):
        assert "new_packing_us" in calibration._problem(dict(data, new_packing_us=bad))
    # a calibration whose new packings leave a packed backend out predicts every packed call from a seen packing's
    partial = dict(data, host_us=dict(data["host_us"], varlen_fa2={"thd training": 100.0}))
    with caplog.at_level("WARNING", logger="attnselect"):
        assert calibration.parse(json.dumps(partial), "partial")["new_packing_us"] == {}
    assert "has no new packing's host time for varlen_fa2 thd training:" in caplog.text
    calibration.user_path(H200).write_text(json.dumps(data))
    calibration._parsed.cache_clear()
    attnselect.clear_cache()
    report = attnselect.explain(PACKED, target=H200)
    assert (
        "host:    a packed call's is the mean over 8 calls sharing a packing; the first's, on a new packing: "
        "flash_attn4 native 1200.0 us" in report
    )


def test_a_forward_that_replays_is_predicted_at_its_replayed_host_time_in_inference():
    """FA4's runner replays its forward from a shape's third call (Backend.calls_before_replay): a dense call is
    predicted at the replayed host time (its shape's first calls are priced per shape: first_calls), a packed call at
    the mean over the calls sharing a packing, the first on a new packing, the second through the interface."""
    data, fa4 = replaying_sample(), Candidate("flash_attn4")
    calls = backends.get("flash_attn4").calls_before_replay
    assert calls == 2
    dense = AttentionProblem(1, 256, 256, 16, 16, 192, 128, mask="causal", dtype=torch.bfloat16)
    replayed = predict.predict(fa4, dense, data, calls_before_replay=calls)
    assert replayed.host_us == 15.0 and replayed.before_replay_us == 130.0
    assert predict.predict(fa4, dense, data).host_us == 130.0  # a backend that does not replay
    compiled = predict.predict(fa4, dataclasses.replace(dense, compiled_graph=True), data, calls_before_replay=calls)
    assert compiled.host_us == 130.0 and compiled.before_replay_us is None  # torch.compile calls FA4's function
    captured = dataclasses.replace(dense, cuda_graph_capture=True)
    assert predict.predict(fa4, captured, data, calls_before_replay=calls).host_us == 0.0
    training = predict.predict(fa4, dataclasses.replace(dense, training=True), data, calls_before_replay=calls)
    assert training.host_us == 300.0 and training.before_replay_us is None  # a gradient needs FA4's own call
    slower = dict(data, replayed_host_us={"flash_attn4": {"dense inference": 140.0}})
    assert predict.predict(fa4, dense, slower, calls_before_replay=calls).host_us == 130.0  # no replay to gain
    packed = dataclasses.replace(PACKED, training=False)
    mean = predict.predict(fa4, packed, data, calls_before_replay=calls)
    shared = predict.PACKING_SHARED_BY
    assert mean.host_us == pytest.approx((250.0 + 150.0 + (shared - 2) * 20.0) / shared)
    assert mean.new_packing_host_us == 250.0 and mean.before_replay_us == 150.0
    assert mean.alone_us == 250.0 + mean.gpu_us  # a call alone on a new packing: through the interface
    without = dict(data, new_packing_us={})
    alone = predict.predict(fa4, packed, without, calls_before_replay=calls)
    assert alone.host_us == pytest.approx((2 * 150.0 + (shared - 2) * 20.0) / shared)
    assert alone.new_packing_host_us == 150.0 and alone.alone_us == 150.0 + alone.gpu_us  # alone: the interface's
    found = data
    for own_call in (dataclasses.replace(dense, softcap=True), dataclasses.replace(dense, mask="sliding_window",
                                                                                   window=(64, 0))):  # fmt: skip
        curve, _ = rules.prediction_curve(fa4, own_call, H200, found)  # FA4's own call each time: no replay
        assert curve.host_us == 130.0 and curve.before_replay_us is None
    window_packed = dataclasses.replace(packed, mask="sliding_window", window=(64, 0))
    assert rules.prediction_curve(fa4, window_packed, H200, found)[0].before_replay_us == 150.0  # packed: replays
    for bad in ({"flash_attn4": {"dense training": 1.0}}, {"flash_attn4": {"dense inference": -1.0}}, [1.0]):
        assert "replayed_host_us" in calibration._problem(dict(data, replayed_host_us=bad))


def test_explain_prints_a_replayed_forward_s_host_time_and_its_first_calls(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))
    calibration.user_path(H200).write_text(json.dumps(replaying_sample()))
    attnselect.clear_cache()
    dense = AttentionProblem(1, 256, 256, 16, 16, 192, 128, mask="causal", dtype=torch.bfloat16)
    report = attnselect.select(dense, target=H200).report()
    assert "replay:  the host time above is the forward's replayed; the calls before the replay (a shape's, priced " \
        "per shape) go through the interface, a call: flash_attn4 native 130.0 us" in report  # fmt: skip
    entry = next(c for c in attnselect.select(dense, target=H200).to_dict()["candidates"]
                 if c["backend"] == "flash_attn4" and c["pad_to"] is None)  # fmt: skip
    assert entry["predicted_us"]["host"] == 15.0 and entry["predicted_us"]["before_replay_host"] == 130.0


def test_a_calibration_without_packed_curves_leaves_packed_calls_to_the_table(calibrated):
    decision = attnselect.select(PACKED, target=H200)
    assert decision.predictions is None and "has no curve for flash_attn4" in decision.calibration


def test_the_packaged_calibration_ranks_the_ladder_s_long_mla_training_calls_as_they_ran(tmp_path, monkeypatch):
    """On the H200 ladder at 94ce3f9, B1 S8k and S16k 192/128 training ran faster on FA4 than on sdpa_cudnn both alone
    and in a stack; predicted within the tie band, the time alone settles them on FA4 once its backward's host time
    hides behind its forward's GPU time (by host + GPU, sdpa_cudnn: what the ladder's default ran)."""
    import pathlib

    from attnselect.choose import first_calls, rules

    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))  # the packaged calibration
    calibration._parsed.cache_clear()
    attnselect.clear_cache()
    packaged = Target.preset("h200", packages={"flash-attn-4": "4.0.0b36", "nvidia-cudnn-frontend": "1.32.0"},
                             torch_version="2.11.0+cu130")  # fmt: skip
    results = pathlib.Path(__file__).parents[2] / "results"
    parts = (json.loads((results / f"h200_ladder_{name}_94ce3f9_fa4.json").read_text()) for name in ("medium", "large"))
    rungs = {entry["rung"]: entry for part in parts for entry in part["results"]}

    def warm(seqlen: int):  # the ladder's warm-up paid every compile
        problem = AttentionProblem(1, seqlen, seqlen, 16, 16, 192, 128, mask="causal", training=True,
                                   dtype=torch.bfloat16)  # fmt: skip
        for c in attnselect.select(problem, target=packaged).ranked:
            first_calls.ran(c, problem)
        return attnselect.select(problem, target=packaged)

    try:
        for seqlen in (8192, 16384):
            stats = rungs[f"bshd B1 S{seqlen} 192/128 training"]["stats"]
            for way in ("latency", "stack"):
                forced = stats[way]
                assert forced["forced flash_attn4 native"]["median"] < forced["forced sdpa_cudnn native"]["median"]
            decision = warm(seqlen)
            assert decision.chosen == Candidate("flash_attn4"), decision.why
            fa4, cudnn = (decision.predictions[Candidate(b)] for b in ("flash_attn4", "sdpa_cudnn"))
            assert cudnn.total_us <= fa4.total_us * (1 + rules.TIE_BAND)  # a tie, settled alone
            assert fa4.alone_us < cudnn.alone_us and fa4.host_us + fa4.gpu_us > cudnn.host_us + cudnn.gpu_us
        # B1 S4k: FA4 the lower in a stack, sdpa_cudnn alone (its rows there: sdpa_cudnn ahead alone, FA4 in a
        # stack); the tie's reason says what the forward's GPU time hides
        decision = warm(4096)
        hidden = decision.predictions[decision.chosen].hidden_us
        assert decision.chosen == Candidate("sdpa_cudnn") and hidden > 0
        assert f"hiding {hidden:.1f} us of its backward's host time" in decision.why
    finally:
        first_calls.forget()
        calibration._parsed.cache_clear()
        attnselect.clear_cache()


def test_a_prediction_s_init_takes_its_init_fields_and_works_out_the_others():
    """Prediction's own __init__ (its fields in one write) takes the dataclass's init fields, in their order and with
    their defaults, so dataclasses.replace and copies keep working; total_us and alone_us are worked out, as a
    replace works them out again."""
    import inspect

    fields = [f for f in dataclasses.fields(predict.Prediction) if f.init]
    parameters = list(inspect.signature(predict.Prediction.__init__).parameters.values())[1:]
    assert [p.name for p in parameters] == [f.name for f in fields]
    assert [p.default for p in parameters] == [
        inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default for f in fields
    ]
    assert {f.name for f in dataclasses.fields(predict.Prediction) if not f.init} == {"total_us", "alone_us"}
    p = predict.Prediction(30.0, 50.0, "test", 80.0, 5.0)
    assert (p.total_us, p.alone_us) == (50.0 + predict.UNHIDDEN * 30.0, 80.0 + 50.0 - 5.0)
    q = dataclasses.replace(p, gpu_us=10.0)
    assert (q.total_us, q.alone_us) == (30.0 + predict.UNHIDDEN * 10.0, 80.0 + 10.0 - 5.0) and q != p
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.host_us = 1.0

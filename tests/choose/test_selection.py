"""Decisions: memoization, invalidation, forcing, and the Decision's content."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnselect
from attnselect import AttentionProblem, Candidate, Target, backends
from attnselect.backends.sdpa_math import SdpaMath

P = AttentionProblem(
    batch=1,
    seqlen_q=64,
    seqlen_kv=64,
    heads_q=2,
    heads_kv=2,
    head_dim_qk=24,
    head_dim_v=16,
    dtype=torch.float32,
    mask="causal",
    training=True,
)
CPU = Target.preset("cpu")


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


def test_forced_backend_and_pad():
    assert attnselect.select(P, target=CPU, backend="reference").chosen == Candidate("reference")
    assert attnselect.select(P, target=CPU, backend="reference", pad=True).chosen == Candidate("reference", 24)
    assert attnselect.select(P, target=CPU, pad=False).chosen == Candidate("sdpa_math")


def test_forced_backend_that_cannot_serve_lists_its_reasons():
    with pytest.raises(attnselect.ForcedChoiceError) as err:
        attnselect.select(P, target=CPU, backend="sdpa_cudnn")
    assert "sdpa_cudnn native: runs on cuda only" in str(err.value)
    assert "sdpa_math" not in str(err.value)


def test_unknown_forced_backend_lists_known_ones(monkeypatch):
    with pytest.raises(attnselect.ForcedChoiceError, match="backend: got 'nope', expected one of .*sdpa_cudnn"):
        attnselect.select(P, target=CPU, backend="nope")
    monkeypatch.setenv("ATTNSELECT_BACKEND", "nope")
    with pytest.raises(attnselect.ForcedChoiceError, match="ATTNSELECT_BACKEND: got 'nope'"):
        attnselect.select(P, target=CPU)


@pytest.mark.parametrize(
    "variable,value",
    [("ATTNSELECT_PAD", "sometimes"), ("ATTNSELECT_POLICY", "guess"), ("ATTNSELECT_DISABLE", "sdpa_fast")],
)
def test_bad_environment_values_name_the_variable(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(attnselect.InvalidInputError, match=variable):
        attnselect.select(P, target=CPU)


def test_decision_lists_every_candidate_and_ranks_supported_ones():
    d = attnselect.select(P, target=CPU)
    assert len(d.verdicts) == 2 * len(backends.all_backends())
    assert [d.rank_of(c) for c in d.ranked] == list(range(1, len(d.ranked) + 1))
    assert all(v.supported == (v.candidate in d.ranked) for v in d.verdicts)
    assert d.policy == "rules"


def test_new_decision_is_logged_once(caplog):
    with caplog.at_level("INFO", logger="attnselect"):
        attnselect.select(P, target=CPU)
        attnselect.select(P, target=CPU)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "running sdpa_flash, padded to 24, because" in lines[0]


def test_explain_report_and_failed_explain():
    report = attnselect.explain(P, target=CPU)
    assert "chosen:  sdpa_flash padded to 24" in report and "sdpa_cudnn" in report
    with pytest.raises(attnselect.ForcedChoiceError, match="runs on cuda only"):
        attnselect.explain(P, target=CPU, backend="sdpa_cudnn")


def test_disable_iterator_does_not_poison_the_memo():
    first = attnselect.select(P, target=CPU, disable=iter(["sdpa_flash"]))
    assert first.chosen.backend != "sdpa_flash"
    assert attnselect.select(P, target=CPU, disable=["sdpa_flash"]) is first
    assert attnselect.select(P, target=CPU).chosen.backend == "sdpa_flash"


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"pad": ["always"]}, "pad"),
        ({"backend": ["reference"]}, "backend"),
        ({"disable": [1]}, "disable"),
        ({"policy": 3}, "policy"),
    ],
)
def test_control_of_the_wrong_type_names_the_argument(kwargs, name):
    with pytest.raises(attnselect.InvalidInputError, match=f"^{name}: got"):
        attnselect.select(P, target=CPU, **kwargs)


def test_memo_is_bounded(monkeypatch):
    from attnselect.choose import selection

    monkeypatch.setattr(selection, "MEMO_SIZE", 3)
    for s in range(1, 8):
        attnselect.select(AttentionProblem(1, s, s, 1, 1, 8, 8, torch.float32), target=CPU)
    assert len(selection._MEMO) == 3


def test_why_names_a_forced_pad():
    assert "the caller set pad='never'" in attnselect.select(P, target=CPU, pad=False).why


def test_overrides_block_like_sdpa_kernel(monkeypatch):
    assert attnselect.select(P, target=CPU).chosen == Candidate("sdpa_flash", 24)
    with attnselect.overrides(pad=False):
        assert attnselect.select(P, target=CPU).chosen == Candidate("sdpa_math")
        with attnselect.overrides(backend="reference"):  # nested: adds a field, keeps pad
            assert attnselect.select(P, target=CPU).chosen == Candidate("reference")
        assert attnselect.select(P, target=CPU, pad=True).chosen == Candidate("sdpa_flash", 24)  # keyword wins
    monkeypatch.setenv("ATTNSELECT_BACKEND", "sdpa_math")
    with attnselect.overrides(backend="reference"):  # the block wins over the environment
        assert attnselect.select(P, target=CPU).chosen.backend == "reference"
    assert attnselect.select(P, target=CPU).chosen.backend == "sdpa_math"


def test_overrides_are_checked_on_entry():
    with pytest.raises(attnselect.ForcedChoiceError, match="backend: got 'nope'"):
        with attnselect.overrides(backend="nope"):
            pass
    with pytest.raises(attnselect.InvalidInputError, match="disable"):
        with attnselect.overrides(disable=["sdpa_fast"]):
            pass


def test_overrides_reach_the_attention_fast_path():
    q, k, v = (torch.randn(1, 8, 2, d, dtype=torch.float64) for d in (24, 24, 16))
    attnselect.attention(q, k, v)
    with attnselect.overrides(backend="reference", disable="sdpa_flash"):
        inside = attnselect.attention(q, k, v)
    from attnselect import dispatch

    assert {known.chosen.backend for known in dispatch.known_calls()} == {"sdpa_flash", "reference"}
    assert torch.allclose(inside, attnselect.attention(q, k, v), atol=1e-12)


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
    cross a rule (one key, short documents, a key sequence of length 1) are selected afresh."""
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


def test_the_report_lists_a_supported_candidate_left_out_of_the_ranking_last():
    """measure drops a candidate that failed while it was timed from ranked; its verdict still says supported."""
    decision = attnselect.select(P, target=CPU)
    kept = dataclasses.replace(decision, ranked=decision.ranked[:1])
    report = kept.report()
    rows = [line.split()[:4] for line in report.splitlines()[3:] if line and line.split()[2:3] == ["yes"]]
    assert rows[0][3] == "1" and all(row[3] == "-" for row in rows[1:]) and len(rows) == len(decision.ranked)

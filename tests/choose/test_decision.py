"""A Decision's content (attnselect.choose.decision): every candidate's verdict, the ranking, why, the report."""

from __future__ import annotations

import dataclasses

import pytest

import attnselect
from attnselect import backends
from helpers import CPU, SELECTION_PROBLEM

P = SELECTION_PROBLEM


def test_decision_lists_every_candidate_and_ranks_supported_ones():
    d = attnselect.select(P, target=CPU)
    assert len(d.verdicts) == 2 * len(backends.all_backends())
    assert [d.rank_of(c) for c in d.ranked] == list(range(1, len(d.ranked) + 1))
    assert all(v.supported == (v.candidate in d.ranked) for v in d.verdicts)
    assert d.policy == "rules"


def test_explain_report_and_failed_explain():
    report = attnselect.explain(P, target=CPU)
    assert "chosen:  sdpa_flash padded to 24" in report and "sdpa_cudnn" in report
    with pytest.raises(attnselect.ForcedChoiceError, match="runs on cuda only"):
        attnselect.explain(P, target=CPU, backend="sdpa_cudnn")
    with pytest.raises(attnselect.InvalidInputError, match="^show_all: got 'yes', expected True or False"):
        attnselect.select(P, target=CPU).report(show_all="yes")


def test_why_names_a_forced_pad():
    assert "the caller set pad='never'" in attnselect.select(P, target=CPU, pad=False).why


def test_the_report_lists_a_supported_candidate_left_out_of_the_ranking_last():
    """measure drops a candidate that failed while it was timed from ranked; its verdict still says supported."""
    decision = attnselect.select(P, target=CPU)
    kept = dataclasses.replace(decision, ranked=decision.ranked[:1])
    report = kept.report()
    rows = [line.split()[:4] for line in report.splitlines()[3:] if line and line.split()[2:3] == ["yes"]]
    assert rows[0][3] == "1" and all(row[3] == "-" for row in rows[1:]) and len(rows) == len(decision.ranked)

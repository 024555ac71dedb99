"""The committed grids, judged again by today's rules, still agree with the machines they ran on: no row that the
rules serve failed or was wrong there."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from attnselect.choose.candidates import judge  # noqa: E402
from attnselect.spec.options import Candidate  # noqa: E402
from attnselect.spec.problem import AttentionProblem  # noqa: E402
from correctness_grid import SOURCE, pairs_missing, rows  # noqa: E402
from grid_report import agreement, target_of  # noqa: E402


# The young kernels' allowlists (attnselect.backends.evidence) refuse rows they passed there where the correctness
# grid has no passing row of their K/V grouping (99.60% agree).
@pytest.mark.parametrize("name,min_problems,min_share", [("h200_rules_grid", 200, 0.995), ("cpu_rules_grid", 280, 1.0)])
def test_rules_agree_with_the_recorded_grid(name, min_problems, min_share):
    rows = [json.loads(line) for line in (ROOT / "results" / f"{name}.jsonl").read_text().splitlines()]
    meta = json.loads((ROOT / "results" / f"{name}.jsonl.meta.json").read_text())
    problems = {(json.dumps(r["problem"], sort_keys=True), json.dumps(r.get("lengths"))) for r in rows}
    assert len(problems) >= min_problems
    judged = agreement(rows, target_of(meta))
    share = sum(r["agrees"] for r in judged) / len(judged)
    assert share >= min_share, f"rules agree with {meta['device']} on {share:.2%} of rows"
    # A row the rules call supported must really run and match: no disagreement of that kind is tolerated.
    assert not [r for r in judged if r["predicted"] and not r["really"]]


def test_no_row_of_the_correctness_grid_that_failed_is_served_today():
    records = [json.loads(line) for line in (ROOT / SOURCE).read_text().splitlines()]
    meta = json.loads((ROOT / (SOURCE + ".meta.json")).read_text())
    installed = {
        "flash-attn-4": meta["packages"]["flash_attn4"],
        "nvidia-cudnn-frontend": meta["packages"]["cudnn_frontend"],
    }
    target = target_of(meta).with_versions(packages=installed)
    assert len({r["row_key"] for r in records}) >= 200 and not pairs_missing(rows())
    served_but_failed = []
    verdicts = {}
    for r in records:
        if r["passed"]:
            continue
        key = json.dumps(r["problem"], sort_keys=True)
        if key not in verdicts:
            verdicts[key] = {v.candidate: v for v in judge(AttentionProblem.from_dict(r["problem"]), target)}
        if verdicts[key][Candidate(r["backend"], r["pad_to"])].supported:
            served_but_failed.append((r["row"]["id"], r["backend"], r["pad_to"], r["error"] or r["failures"]))
    assert served_but_failed == []

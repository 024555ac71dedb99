"""The committed rules grids, judged again by today's rules, still agree with the machines they ran on."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from grid_report import agreement, target_of  # noqa: E402


@pytest.mark.parametrize("name,min_problems,min_share", [("h200_rules_grid", 200, 0.99), ("cpu_rules_grid", 280, 1.0)])
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

"""The committed H200 grid, judged again by today's rules, still agrees on >= 99% of rows."""

from __future__ import annotations

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from grid_report import agreement  # noqa: E402

from attnselect import Target  # noqa: E402


def test_rules_agree_with_the_h200_grid():
    path = ROOT / "results" / "h200_rules_grid.jsonl"
    meta = json.loads((ROOT / "results" / "h200_rules_grid.jsonl.meta.json").read_text())
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    problems = {json.dumps(r["problem"], sort_keys=True) for r in rows}
    assert len(problems) >= 200
    target = Target(name="NVIDIA H200", capability=(9, 0), torch_version=meta["torch"], cudnn_version=meta["cudnn"])
    judged = agreement(rows, target)
    share = sum(r["agrees"] for r in judged) / len(judged)
    assert share >= 0.99, f"rules agree with the H200 on {share:.2%} of rows"
    # A row the rules call supported must really run and match: no disagreement of that kind is tolerated.
    assert not [r for r in judged if r["predicted"] and not r["really"]]

"""Turn rules-grid rows into a markdown report, judging every row again with the current rules.

    python benchmarks/grid_report.py results/h200_rules_grid.jsonl > results/h200_rules_grid.md

Reality (did it run, did it match float64) comes from the rows; the prediction is made
now, so the report always shows how today's rules agree with what the GPU did.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import sys

from attnselect.choose.candidates import judge
from attnselect.spec.options import Candidate
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target
from attnselect.spec.validate import packing_facts


def problem_of(d: dict, lengths=None) -> AttentionProblem:
    """A row's problem; thd facts are derived again from the row's lengths (older rows lack some)."""
    problem = AttentionProblem.from_dict(d)
    if lengths:
        problem = dataclasses.replace(problem, **packing_facts(problem.mask, problem.window, *lengths))
    return problem


def agreement(rows: list[dict], target: Target) -> list[dict]:
    """Each row with `predicted`, `reasons` and `agrees` recomputed from the current rules."""
    verdicts = {}
    out = []
    for r in rows:
        key = json.dumps([r["problem"], r.get("lengths")], sort_keys=True)  # judging needs the problem only
        if key not in verdicts:
            verdicts[key] = {v.candidate: v for v in judge(problem_of(r["problem"], r.get("lengths")), target)}
        v = verdicts[key][Candidate(r["backend"], r["pad_to"])]
        out.append(dict(r, predicted=v.supported, reasons=list(v.reasons), agrees=v.supported == r["really"]))
    return out


def target_of(meta: dict) -> Target:
    """The target a grid ran on, from its meta file (older files name an H200 only)."""
    if "target" not in meta:
        return Target(name="NVIDIA H200", capability=(9, 0), torch_version=meta["torch"], cudnn_version=meta["cudnn"])
    return Target.from_dict(meta["target"])


def main(path: str) -> None:
    meta = json.load(open(path + ".meta.json"))
    target = target_of(meta)
    rows = agreement([json.loads(line) for line in open(path)], target)
    problems = {(json.dumps(r["problem"], sort_keys=True), json.dumps(r.get("lengths"))) for r in rows}
    agree = sum(r["agrees"] for r in rows)
    print(
        f"# Rules against {target.name}\n\nMeasured {meta['date']} on {meta['device']} (CUDA {meta['cuda']}) by "
        f"`benchmarks/rules_grid.py`; predictions re-made by `benchmarks/grid_report.py` with the current rules.\n"
    )
    print(
        f"**{len(problems)} problems, {len(rows)} (problem, backend, padding) rows: the rules agree with the machine "
        f"on {agree}/{len(rows)} = {100 * agree / len(rows):.2f}%.**\n"
    )
    print(
        "A row is *really supported* when the forward (and, in training, the backward) runs and the output and "
        f"all three gradients match a float64 reference within a relative error of {meta['tolerance']} "
        "(dropout rows: finite and visibly dropped).\n"
    )
    print("| backend | padded to | head dims | rows | predicted supported | really supported | agree |")
    print("|---|---|---|---|---|---|---|")
    groups = collections.defaultdict(list)
    for r in rows:
        p = r["problem"]
        groups[(p["layout"] == "thd", r["backend"], r["pad_to"] or 0, p["head_dim_qk"], p["head_dim_v"])].append(r)
    print_header = True
    for (packed, backend, pad, dqk, dv), rs in sorted(groups.items()):
        if packed and print_header:
            print("| **packed (thd)** | | | | | | |")
            print_header = False
        print(
            f"| {backend} | {pad or '-'} | {dqk}/{dv} | {len(rs)} | {sum(r['predicted'] for r in rs)} | "
            f"{sum(r['really'] for r in rs)} | {sum(r['agrees'] for r in rs)} |"
        )
    wrong = [r for r in rows if not r["agrees"]]
    print(f"\n## Disagreements ({len(wrong)})\n")
    for r in wrong:
        p = problem_of(r["problem"], r.get("lengths"))
        print(
            f"- {p.describe()} | {r['backend']} {'padded to ' + str(r['pad_to']) if r['pad_to'] else 'native'}: "
            f"predicted {'supported' if r['predicted'] else 'unsupported'} ({'; '.join(r['reasons']) or 'no reason'}), "
            f"really {'supported' if r['really'] else 'unsupported'} ({r['error'] or 'ran and matched'})"
        )
    errors = collections.Counter((r["backend"], (r["error"] or "")[:110]) for r in rows if r["error"])
    print("\n## How unsupported rows failed\n")
    for (backend, error), n in errors.most_common():
        print(f"- {backend}, {n} rows: `{error}`")


if __name__ == "__main__":
    main(sys.argv[1])

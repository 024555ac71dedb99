"""How a call's predicted host and GPU times should combine, judged on a size ladder's measured rows.

    python benchmarks/ladder_rules.py results/h200_ladder_20c9c6a_fa4.json --out results/cpu_ladder_rules_20c9c6a

Any machine: the predictions are the packaged calibration's for the H200 preset at its library versions
(FlashAttention-4 stood in for where it is not installed: nothing runs), the times are the ladder's. For each dense
rung and each way (``latency``: a call alone, waiting for host and GPU; ``stack``: a layer of a pipelined step), every
rule below picks one of the candidates the ladder forced (its ``forced ...`` rows: the same calls through attnselect
with the backend and padding forced), and the rule's pick is scored by its measured time over the fastest forced
row's at that rung and way (1.0: it picked the fastest). Rules:

- ``max``: the least ``max(host, GPU)`` (what attnselect ranks by: a stack overlaps the host's work with the GPU's);
- ``sum``: the least ``host + GPU`` (a call alone waits for both);
- ``max, sum within B``: among the candidates whose ``max`` is within B (a fraction) of the least, the least ``sum``.

Packed rungs are left out: their choice is made per packing, and the ladder times each row over many packings.
Writes ``--out``.json (every pick) and .md (per rule and way: the geometric mean of the scores, the worst, and how
many rung-ways are within 3% of the fastest).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

BANDS = (0.05, 0.10, 0.15, 0.20, 0.30)


def predictions(rung: dict, target) -> dict:
    """{candidate as the ladder names it ("flash_attn4 native"): Prediction} at the rung's problem."""
    import attnselect
    from attnselect.choose import rules
    from attnselect.choose.candidates import judge

    problem = attnselect.AttentionProblem(
        rung["batch"], rung["seqlen"], rung["seqlen"], 16, 16, rung["d_qk"], rung["d_v"], mask="causal",
        dtype=torch.bfloat16, training=rung["phase"] == "training",
    )  # fmt: skip
    predicted, _, _ = rules.predictions(judge(problem, target), problem, target)
    return {str(c): p for c, p in (predicted or {}).items() if p is not None}


def pick(rule: str, band: float, predicted: dict) -> str:
    if rule == "max":
        return min(predicted, key=lambda c: predicted[c].total_us)
    if rule == "sum":
        return min(predicted, key=lambda c: predicted[c].host_us + predicted[c].gpu_us)
    least = min(p.total_us for p in predicted.values())
    near = [c for c, p in predicted.items() if p.total_us <= least * (1 + band)]
    return min(near, key=lambda c: predicted[c].host_us + predicted[c].gpu_us)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ladder", help="a size ladder's .json (benchmarks/ladder.py)")
    ap.add_argument("--out", help="write .json and .md here")
    a = ap.parse_args()
    os.environ["ATTNSELECT_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnselect-ladder-rules-")  # the packaged one
    sys.path.insert(0, str(Path(__file__).parent))
    import ladder as ladder_script
    from attnselect.spec.target import Target
    from new_packing_parts import _stand_in_for_flash_attn4

    report = json.loads(Path(a.ladder).read_text())
    packages = {"nvidia-cudnn-frontend": "1.32.0"}
    if "flash-attn-4" in report["meta"]["device"]:
        packages["flash-attn-4"] = "4.0.0b36"
        if "flash_attn" not in sys.modules:
            _stand_in_for_flash_attn4()
    target = Target.preset("h200", packages=packages, torch_version="2.11.0+cu130", cudnn_version="9.19.0")
    rungs = {ladder_script.rung_name(r): r for r in ladder_script.rungs(False)}
    rules_ = [("max", 0.0), ("sum", 0.0)] + [("max, sum within", b) for b in BANDS]
    picks, scores = [], {(rule, band, way): [] for rule, band in rules_ for way in ladder_script.WAYS}
    for entry in report["results"]:
        rung = rungs.get(entry["rung"])
        if rung is None or rung["layout"] != "bshd":
            continue
        predicted = predictions(rung, target)
        for way in ladder_script.WAYS:
            measured = {row[len("forced "):]: s["median"] for row, s in entry["stats"].get(way, {}).items()
                        if row.startswith("forced ")}  # fmt: skip
            served = {c: p for c, p in predicted.items() if c in measured}
            if len(served) < 2:
                continue
            fastest = min(measured[c] for c in served)
            for rule, band in rules_:
                chosen = pick(rule, band, served)
                score = fastest / measured[chosen]
                scores[(rule, band, way)].append(score)
                picks.append({"rung": entry["rung"], "way": way, "rule": rule, "band": band, "chosen": chosen,
                              "ms": measured[chosen], "fastest_ms": fastest, "score": score})  # fmt: skip
    lines = [
        "# How predicted host and GPU times combine, judged on the size ladder's forced rows\n",
        f"`benchmarks/ladder_rules.py {a.ladder}`, {time.strftime('%F')}, on {os.cpu_count()} CPU cores (nothing "
        f"runs): the packaged calibration's predictions for the H200 at the ladder's library versions ("
        f"{report['meta']['device']}), each rule's pick among the candidates the ladder forced at each dense rung, "
        "scored by the fastest forced row's measured time over the pick's (1.0: the fastest; the ladder's "
        f"{report['meta']['rounds']} rounds of {report['meta']['calls']} calls, medians).",
        "",
        "| rule | way | geometric mean | worst | within 3% of the fastest |",
        "|---|---|---|---|---|",
    ]
    for (rule, band, way), found in scores.items():
        if not found:
            continue
        name = rule if rule in ("max", "sum") else f"{rule} {band:.0%}"
        geo = math.exp(sum(map(math.log, found)) / len(found))
        good = sum(s >= 0.97 for s in found)
        lines.append(f"| {name} | {way} | {geo:.3f} | {min(found):.3f} | {good} of {len(found)} |")
    print("\n".join(lines))
    if a.out:
        Path(a.out + ".json").write_text(json.dumps({"ladder": a.ladder, "picks": picks}, indent=1))
        Path(a.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

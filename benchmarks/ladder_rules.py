"""How a call's predicted host and GPU times should combine, judged on size ladders' measured rows.

    python benchmarks/ladder_rules.py results/h200_ladder_20c9c6a_fa4.json --out results/cpu_ladder_rules_20c9c6a
    python benchmarks/ladder_rules.py results/h200_ladder*.json --out results/cpu_ladder_rules_all   # pooled

Any machine: the predictions are the packaged calibration's for the H200 preset at its library versions
(FlashAttention-4 stood in for where it is not installed: nothing runs), the times are the ladder's. For each dense
rung and each way (``latency``: a call alone, waiting for host and GPU; ``stack``: a layer of a pipelined step), every
rule below picks one of the candidates the ladder forced (its ``forced ...`` rows: the same calls through attnselect
with the backend and padding forced), and the rule's pick is scored by its measured time over the fastest forced
row's at that rung and way (1.0: it picked the fastest). Rules:

- ``max``: the least ``max(host, GPU)`` (a stack overlapping the host's work with the GPU's whole);
- ``sum``: the least ``host + GPU`` (a call alone waits for both);
- ``alone``: the least ``Prediction.alone_us`` (``sum`` less, in training, the backward's host time the forward's
  GPU time hides: ``attnselect.choose.predict.Curve.forward``);
- ``stack``: the least ``Prediction.total_us`` (what attnselect ranks by: ``max`` and part of the shorter,
  ``attnselect.choose.predict.UNHIDDEN``);
- ``max, sum within B``, ``stack, sum within B`` and ``stack, alone within B``: among the candidates whose ``max``
  (``stack``) is within B (a fraction) of the least, the least ``sum`` (``alone``); attnselect settles ties so:
  ``stack`` within ``rules.TIE_BAND``, by ``alone``;
- ``one choice in hindsight``: the candidate whose worse way scores best, chosen from the measured times (no rule
  can do better with one choice for both ways: where it scores below 0.97 in either way, the ladder's goal of 0.97x
  the fastest row on every rung-way is out of reach of any choice that does not know how the call is waited on);
- ``as run``: the candidate the ladder's default chose as it ran (its rung's ``chosen``: the rules table's order
  where the GPU had no calibration of its own, as on an H100), scored by its forced row like the others.

Ladders of another GPU than the H200 (an H100's) are judged with the H200's calibration all the same: how well
another GPU model's calibration of the same arch would rank that GPU's calls, against the order it ran by; with
``--calibration FILE`` (a calibration of that GPU, ``benchmarks/calibrate.py``'s), by that one instead.

Each rule is scored per way and on both (a rung's worse way; the tables count rungs). Packed rungs are left out:
their choice is made per packing, and the ladder times each row over many packings. Also how well the predictions
fit the forced rows' times: the median and root mean square of log(measured / predicted), alone against host + GPU
and ``alone`` (over every row and the training rows) and in a stack against ``max(host, GPU)`` and
``max + b * min`` (the overlap of a stack's host and GPU work being partial), over every row and over those where
neither time is twice the other. Writes ``--out``.json (every pick)
and .md (per rule and way: the geometric mean of the scores, the worst, and how many rungs are within 3% of the
fastest; the fit). Several ladders are pooled, each judged with FlashAttention-4 installed or not as it ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from attnselect.choose.rules import TIE_BAND

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


RANKED_BY = {
    "max": lambda p: max(p.host_us, p.gpu_us),
    "sum": lambda p: p.host_us + p.gpu_us,
    "alone": lambda p: p.alone_us,
    "stack": lambda p: p.total_us,
}


def pick(rule: str, band: float, predicted: dict, settle: str) -> str:
    """``rule`` (a key of :data:`RANKED_BY`) picks among ``predicted``; with a ``band``, the candidates within it of
    the least go by ``settle`` (a key of :data:`RANKED_BY`)."""
    by = RANKED_BY[rule]
    least = min(by(p) for p in predicted.values())
    near = [c for c, p in predicted.items() if by(p) <= least * (1 + band)]
    return min(near, key=lambda c: RANKED_BY[settle](predicted[c]) if band else by(predicted[c]))


HINDSIGHT = "one choice in hindsight"
AS_RUN = "as run"  # the ladder's default's own choice (its rung's ``chosen``), scored by its forced row alike
OVERLAPS = (0.0, 0.25, 0.5)  # b in a stack's max(host, GPU) + b * min(host, GPU)


def hindsight(measured: dict, served) -> str:
    """The candidate of ``served`` whose worse way is fastest against each way's fastest, by the measured times
    (``measured``: {way: {candidate: ms}})."""
    fastest = {way: min(times[c] for c in served) for way, times in measured.items()}
    return max(served, key=lambda c: min(fastest[way] / times[c] for way, times in measured.items()))


def geometric_mean(values) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def rms(values) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ladders", nargs="+", help="size ladders' .json (benchmarks/ladder.py), pooled")
    ap.add_argument("--out", help="write .json and .md here")
    ap.add_argument("--calibration", help="a calibration .json (benchmarks/calibrate.py) to predict by, in place of "
                    "the packaged H200's: the target takes its GPU's name")  # fmt: skip
    a = ap.parse_args()
    os.environ["ATTNSELECT_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnselect-ladder-rules-")  # the packaged one
    calibrated = json.loads(Path(a.calibration).read_text()) if a.calibration else None
    sys.path.insert(0, str(Path(__file__).parent))
    import ladder as ladder_script
    from attnselect.choose import calibration
    from attnselect.spec.target import Target
    from new_packing_parts import FA4_STAND_IN, _stand_ins

    machine = {}  # the machine --calibration ran on, as a target's fields
    if calibrated is not None:
        fp = calibrated["fingerprint"]
        machine = dict(name=fp["name"], capability=tuple(fp["capability"]), torch_version=fp["torch"],
                       cudnn_version=fp["cudnn"])  # fmt: skip
        # the user's calibration of its GPU model, in this run's cache directory
        calibration.user_path(Target(**machine)).write_text(json.dumps(calibrated))

    rules_ = [("max", 0.0, ""), ("sum", 0.0, ""), ("alone", 0.0, ""), ("stack", 0.0, ""), ("max", TIE_BAND, "sum")]
    rules_ += [("stack", b, settle) for b in BANDS for settle in ("sum", "alone")] + [(HINDSIGHT, 0.0, "")]
    rules_ += [(AS_RUN, 0.0, "")]
    ways = (*ladder_script.WAYS, "both")
    picks, scores = [], {(*rule, way): [] for rule in rules_ for way in ways}
    fit = {"latency, host + GPU": [], "latency, alone": [], "latency, host + GPU, training rows": [],
           "latency, alone, training rows": []}  # fmt: skip
    fit |= {f"stack, max + {b:g} min": [] for b in OVERLAPS}
    fit |= {f"stack, max + {b:g} min, neither time twice the other": [] for b in OVERLAPS}
    devices = []
    for path in a.ladders:
        report = json.loads(Path(path).read_text())
        packages = {"nvidia-cudnn-frontend": "1.32.0"}
        if "flash-attn-4" in report["meta"]["device"]:
            packages["flash-attn-4"] = "4.0.0b36"
            if "flash_attn" not in sys.modules:
                _stand_ins(FA4_STAND_IN)
        devices.append(f"{Path(path).name}: {report['meta']['device']}, {report['meta']['rounds']} rounds of "
                       f"{report['meta']['calls']} calls")  # fmt: skip
        target = Target.preset("h200", packages=packages, torch_version="2.11.0+cu130", cudnn_version="9.19.0")
        if calibrated is not None:  # the machine it ran on, with the ladder's packages
            target = dataclasses.replace(target, **machine)
            found, why = calibration.for_target(target)
            if found is None or why != str(calibration.user_path(target)):  # not a packaged one in its place
                held = why if found is None else f"{why} holds in its place"
                raise SystemExit(f"--calibration {a.calibration} does not hold: {held}")
        shapes = ladder_script.off_ladder_shapes(report)  # its --dense rungs too
        rungs = {ladder_script.rung_name(r): r for r in ladder_script.rungs(False, shapes)}
        for entry in report["results"]:
            rung = rungs.get(entry["rung"])
            if rung is None or rung["layout"] != "bshd":
                continue
            predicted = predictions(rung, target)
            measured = {way: {row[len("forced "):]: s["median"] for row, s in entry["stats"].get(way, {}).items()
                              if row.startswith("forced ")} for way in ladder_script.WAYS}  # fmt: skip
            served = {c: p for c, p in predicted.items() if all(c in times for times in measured.values())}
            if len(served) < 2:
                continue
            for c, p in served.items():
                for name, predicted_us in (("host + GPU", p.host_us + p.gpu_us), ("alone", p.alone_us)):
                    error = math.log(measured["latency"][c] * 1e3 / predicted_us)
                    fit[f"latency, {name}"].append(error)
                    if rung["phase"] == "training":
                        fit[f"latency, {name}, training rows"].append(error)
                for b in OVERLAPS:
                    stacked = max(p.host_us, p.gpu_us) + b * min(p.host_us, p.gpu_us)
                    error = math.log(measured["stack"][c] * 1e3 / stacked)
                    fit[f"stack, max + {b:g} min"].append(error)
                    if max(p.host_us, p.gpu_us) < 2 * min(p.host_us, p.gpu_us):  # where the overlap matters most
                        fit[f"stack, max + {b:g} min, neither time twice the other"].append(error)
            fastest = {way: min(times[c] for c in served) for way, times in measured.items()}
            for rule, band, settle in rules_:
                chosen = (entry["chosen"] if rule == AS_RUN
                          else hindsight(measured, served) if rule == HINDSIGHT
                          else pick(rule, band, served, settle))  # fmt: skip
                if chosen not in served:  # as run: a rung that failed (no choice), or a choice not forced both ways
                    continue
                both = 1.0
                for way, times in measured.items():
                    score = fastest[way] / times[chosen]
                    both = min(both, score)
                    scores[(rule, band, settle, way)].append(score)
                    picks.append({"ladder": path, "rung": entry["rung"], "way": way, "rule": rule, "band": band,
                                  "settled_by": settle, "chosen": chosen, "ms": times[chosen],
                                  "fastest_ms": fastest[way], "score": score})  # fmt: skip
                scores[(rule, band, settle, "both")].append(both)
    source = a.calibration or "the packaged H200 calibration"
    lines = [
        "# How predicted host and GPU times combine, judged on size ladders' forced rows\n",
        f"`benchmarks/ladder_rules.py {' '.join(a.ladders)}`, {time.strftime('%F')}, on {os.cpu_count()} CPU cores "
        f"(nothing runs): {source}'s predictions at each ladder's library versions, each "
        "rule's pick among the candidates the ladder forced at each dense rung, scored by the fastest forced row's "
        "measured time over the pick's (1.0: the fastest; medians of each ladder's rounds); `both`: a rung's worse "
        "way. Ladders:",
        "",
        *(f"- {d}" for d in devices),
        "",
        "| rule | way | geometric mean | worst | within 3% of the fastest |",
        "|---|---|---|---|---|",
    ]
    for (rule, band, settle, way), found in scores.items():
        if not found:
            continue
        name = f"{rule}, {settle} within {band:.0%}" if band else rule
        good = sum(s >= 0.97 for s in found)
        lines.append(f"| {name} | {way} | {geometric_mean(found):.3f} | {min(found):.3f} | {good} of {len(found)} |")
    lines += [
        "",
        "How the predictions fit the forced rows' measured times, log(measured / predicted) over every forced row of "
        "every dense rung scored:",
        "",
        "| way, predicted as | rows | median | root mean square |",
        "|---|---|---|---|",
        *(f"| {name} | {len(e)} | {statistics.median(e):+.3f} | {rms(e):.3f} |" for name, e in fit.items() if e),
    ]
    print("\n".join(lines))
    if a.out:
        Path(a.out + ".json").write_text(json.dumps({"ladders": a.ladders, "picks": picks}, indent=1))
        Path(a.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

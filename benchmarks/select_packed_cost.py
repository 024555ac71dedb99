"""The host time of ``select_packed`` for a new packing, on a preset target, from any machine (no GPU needed).

    python benchmarks/select_packed_cost.py [--target h200] [--fa4] [--calls 1000] [--rounds 9] [--out FILE]

A packed loop's new packing reaches attention()'s sibling branch, whose largest stage is the packed selection
(results/h200_new_packing_parts.md). This times that stage alone, as the H200 host runs it, on a target that the
packaged calibration holds for (the preset's torch and cuDNN set to the calibration's, the cuDNN frontend installed
and, with ``--fa4``, FlashAttention-4): 1024 tokens in 1 to 8 documents, H16, 128/128 bf16, causal, inference, each
call on a packing not seen before, every problem a size-only copy of one before it (as the sibling branch makes
them). Prints (and with ``--out`` writes as JSON) the median microseconds per call over ``--rounds`` rounds with the
round values. Run it from two checkouts (``PYTHONPATH=<other>/src``) to compare two versions on one host.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from pathlib import Path

import torch

import attnselect
from attnselect.choose import calibration
from attnselect.choose.selection import select_packed
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="h200")
    ap.add_argument("--fa4", action="store_true", help="FlashAttention-4 installed on the target")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out")
    a = ap.parse_args()
    packages = {"nvidia-cudnn-frontend": "1.32.0", **({"flash-attn-4": "4.0.0b36"} if a.fa4 else {})}
    target = Target.preset(a.target, packages=packages, torch_version="2.11.0+cu130", cudnn_version="9.19.0")
    source = calibration.for_target(target)[1]
    if not source:
        raise SystemExit(f"no packaged calibration holds for {target.describe()}")
    shapes = [(n, longest) for n in range(1, 9) for longest in range(-(-1024 // n), 1024 - n + 2)]
    random.Random(0).shuffle(shapes)
    problem = AttentionProblem(4, 400, 400, 16, 16, 128, 128, layout="thd", mask="causal", dtype=torch.bfloat16)
    select_packed(problem, target=target)  # the sibling: the first call of the loop
    chosen = str(select_packed(problem, target=target).chosen)
    rounds = []
    for _ in range(a.rounds):
        attnselect.clear_cache()
        select_packed(problem, target=target)
        start = time.perf_counter()
        for n, longest in shapes[: a.calls]:
            problem = problem._with(batch=n, seqlen_q=longest, seqlen_kv=longest)  # as the sibling branch makes it
            select_packed(problem, target=target)
        rounds.append((time.perf_counter() - start) / a.calls * 1e6)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(attnselect.__file__).parent).stdout.strip()  # fmt: skip
    report = {"target": target.describe(), "calibration": source, "chosen": chosen, "commit": commit,
              "date": time.strftime("%Y-%m-%d"), "us_per_call": statistics.median(rounds),
              "rounds": rounds}  # fmt: skip
    print(json.dumps(report))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

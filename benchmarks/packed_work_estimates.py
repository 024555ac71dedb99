"""How well a packed call's work is estimated from what the host knows without reading its lengths.

    python benchmarks/packed_work_estimates.py --out results/cpu_packed_work_estimates.md

Any machine, nothing runs on a GPU. A packed call's lengths sit on the device; reading them is a sync, so a
prediction knows only the pack's sequences, its longest lengths and q's rows (tokens). For two sets of seeded
packings, causal self-attention:

- ``ladder``: the size ladder's packings (``benchmarks/ladder.py``: lognormal document lengths filling 2k to 64k
  tokens, 64 seeds a size);
- ``calibration``: the packings a calibration times (``attnselect.choose.timing.NewPackings`` of
  ``attnselect.bench.calibrate.PACKED_LADDER``),

it writes, per size, the exact work (the sum of each sequence's) over two estimates: ``estimate``, what
``attnselect.choose.predict.work`` reads (one sequence at the longest, the rest of the tokens shared evenly by the
others), and ``batch x longest``, the same call without its tokens (every sequence as long as the longest). A ratio
of 1.0 is exact; the calibration's curves and the calls they predict must be read alike, so what matters is that the
ratio is about the same for both sets.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from attnselect.bench.calibrate import HEADS, PACKED_LADDER  # noqa: E402
from attnselect.choose.predict import work  # noqa: E402
from attnselect.choose.timing import NewPackings  # noqa: E402
from attnselect.spec.problem import AttentionProblem  # noqa: E402
from ladder import packing_lengths  # noqa: E402

LADDER_TOKENS = (2048, 8192, 16384, 65536)
SEEDS = 64


def ratios(lengths: list[int]) -> tuple[float, float]:
    """(exact / estimate, exact / batch x longest) of one packing's work."""
    longest, tokens = max(lengths), sum(lengths)
    problem = AttentionProblem(len(lengths), longest, longest, HEADS, HEADS, 192, 128, layout="thd", mask="causal")
    exact = sum(work(dataclasses.replace(problem, batch=1, seqlen_q=n, seqlen_kv=n)) for n in lengths)
    return exact / work(dataclasses.replace(problem, tokens=tokens)), exact / work(problem)


def packing_sets():
    """(set, size, [lengths of each packing])."""
    for tokens in LADDER_TOKENS:
        yield "ladder", f"{tokens} tokens", [packing_lengths(tokens, seed) for seed in range(SEEDS)]
    for batch, seqlen in PACKED_LADDER:
        problem = AttentionProblem(batch, seqlen, seqlen, HEADS, HEADS, 192, 128, layout="thd", mask="causal")
        packings = NewPackings(problem, torch.device("cpu"))
        lengths = [torch.diff(cu_q).tolist() for cu_q, *_ in packings._packings]
        yield "calibration", f"({batch}, {seqlen})", lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    lines = [
        "# Packed work: exact over estimated, causal self-attention (benchmarks/packed_work_estimates.py)",
        "",
        "Median (least..most) of exact / estimated work over each size's packings; `estimate` is what a prediction",
        "reads (attnselect.choose.predict.work with the pack's tokens), `batch x longest` the pack without them.",
        "",
        "| set | size | packings | sequences (median) | exact / estimate | exact / batch x longest |",
        "|---|---|---|---|---|---|",
    ]
    for name, size, packings in packing_sets():
        by_estimate, by_longest = zip(*(ratios(lengths) for lengths in packings))
        sequences = statistics.median(len(lengths) for lengths in packings)
        cells = [f"{statistics.median(r):.3f} ({min(r):.3f}..{max(r):.3f})" for r in (by_estimate, by_longest)]
        lines.append(f"| {name} | {size} | {len(packings)} | {sequences:g} | {cells[0]} | {cells[1]} |")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Do more turns settle what the bench's timings leave open? Medians of the same kernel, and of close ones.

On the problems where ``attnselect bench`` found the measure policy's choice more than 2% behind the
fastest candidate (dense 16k-token training, where ``sdpa_cudnn`` and the cuDNN frontend run cuDNN's
kernels and torch's default runs ``sdpa_cudnn``'s), it times the rules' choice twice as two steps (A, B:
the same kernel on the same inputs), the close candidate and torch's default, with the bench's rounds as
that run had them (``bench.timing_rounds`` without its later settling of near-ties: a screening round, then
31 short turns of the contenders) in several sessions, and then once with ``--scale`` times the rounds.
If A/B and torch's default over A come to 1.000 in the long session but not in the short ones, the
bench's medians are limited by their number of turns; the long session's ratio of the close candidate
to A is then its speed difference.

    python benchmarks/median_convergence.py --out results/h200_median_convergence [--sessions 3] [--scale 8]
"""

from __future__ import annotations

import argparse
import sys

from attnselect import Target
from attnselect.bench import timing_rounds
from attnselect.choose.timing import time_steps

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from noise_floor import case_steps, write_cases  # noqa: E402

CASES = [
    (
        "bshd B=1 Sq=16384 Skv=16384 Hq=16 Hkv=16 d_qk=192 d_v=128 bfloat16 mask=causal training",
        "sdpa_cudnn native",
        ["cudnn_frontend native"],
    ),
    (
        "bshd B=1 Sq=16384 Skv=16384 Hq=64 Hkv=8 d_qk=128 d_v=128 bfloat16 mask=causal training",
        "sdpa_cudnn native",
        ["cudnn_frontend native"],
    ),
]
SMOKE_CASES = [
    (
        "bshd B=2 Sq=64 Skv=64 Hq=4 Hkv=4 d_qk=192 d_v=128 float32 mask=causal inference",
        "sdpa_math native",
        ["reference native"],
    )
]


def run_case(
    fragment: str, twice: str, others: list[str], target: Target, sessions: int, scale: int, smoke: bool
) -> dict:
    problem, device, steps = case_steps(fragment, twice, others, target, smoke)
    a = f"{twice} (A)"
    case = {"problem": problem.describe(), "sessions": []}
    for turns in [1] * sessions + [scale]:
        rounds = {**timing_rounds(len(steps)), "settle": None}  # the rounds of the run at 34878ee
        rounds.update(
            repeats=rounds["repeats"] * turns, rounds=rounds["rounds"] * turns, budget_s=rounds["budget_s"] * turns
        )
        timings = time_steps(steps, device, **rounds)
        medians = {k: (None if isinstance(t, Exception) else t.median_ms) for k, t in timings.items()}
        spreads = {k: (None if isinstance(t, Exception) else [t.low_ms, t.high_ms]) for k, t in timings.items()}
        case["sessions"].append(
            {
                "rounds": rounds["rounds"],
                "medians_ms": medians,
                "p20_p80_ms": spreads,
                "over_a": {k: m / medians[a] for k, m in medians.items() if m and medians[a]},
            }
        )
    return case


def markdown(report: dict) -> str:
    lines = [
        f"# Do more turns settle the medians?\n\n{report['meta']['device']}, {report['meta']['date']}. "
        "Produced by `benchmarks/median_convergence.py`: the same kernel timed as two steps (A, B) beside "
        "a close candidate and torch's default (which runs A's kernel), with the bench's rounds in short "
        "sessions and then with many times as many rounds. Each cell: the median in ms and its ratio to A.\n"
    ]
    for case in report["cases"]:
        keys = list(case["sessions"][0]["medians_ms"])
        lines += [
            f"\n## {case['problem']}\n",
            "| session (rounds) | " + " | ".join(keys) + " |",
            "|---" * (len(keys) + 1) + "|",
        ]
        for session in case["sessions"]:
            cells = [
                f"{session['medians_ms'][k]:.3f} ({session['over_a'].get(k, float('nan')):.3f})"
                if session["medians_ms"][k]
                else "failed"
                for k in keys
            ]
            lines.append(f"| {session['rounds']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path prefix: writes OUT.json and OUT.md")
    parser.add_argument("--sessions", type=int, default=3, help="sessions with the bench's rounds")
    parser.add_argument("--scale", type=int, default=8, help="the last session's rounds, as a multiple")
    parser.add_argument("--smoke", action="store_true", help="a tiny CPU case (tests)")
    a = parser.parse_args(argv)
    write_cases(
        a.out,
        SMOKE_CASES if a.smoke else CASES,
        lambda fragment, twice, others, target: run_case(fragment, twice, others, target, a.sessions, a.scale, a.smoke),
        lambda case: [{k: round(v, 4) for k, v in s["over_a"].items()} for s in case["sessions"]],
        markdown,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

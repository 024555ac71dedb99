"""How far apart two timings of the same kernel land: the noise floor under ``attnselect bench``'s goals.

For a few problems of the bench suite where the measure policy and the bench disagreed, it times
the rules' choice twice as two separate steps ("A" and "B": the same kernel on the same inputs),
the close candidates and torch's default, side by side with ``attnselect.choose.timing.time_steps`` as
the bench did before 34878ee (warm-up, four interleaved rounds, about 1.5 s per step), in several independent
sessions, with and without the spin that lets the host issue a turn's repeats ahead of the GPU
(alternating session by session, the spin first in each pair, so the GPU's warming up lands on both).
It reports each session's medians, the A/B ratio within a session (what identical kernels differ
by), the spread of each step's median across sessions (what a second timing, e.g. the measure
policy's, can differ by) and each step's host time to issue one call.

    python benchmarks/noise_floor.py --out results/h200_noise_floor [--sessions 3] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from attnselect import Target
from attnselect.bench.runner import TORCH_DEFAULT, _torch_default, suite
from attnselect.choose.candidates import judge
from attnselect.choose.timing import candidate_step, random_inputs, time_steps

# (bench suite key fragment, the rules' choice timed twice, the other candidates timed)
CASES = [
    ("bshd B=1 Sq=16384 Skv=16384 Hq=64 Hkv=8 d_qk=128", "sdpa_cudnn native", ["cudnn_frontend native"]),
    (
        "thd 16 seqs, max sq=1024 skv=1024 Hq=16 Hkv=16 d_qk=192 d_v=128 bfloat16 mask=causal inference",
        "cudnn_frontend native",
        ["flex native", "varlen_fa2 padded to 192"],
    ),
    (
        "thd 4 seqs, max sq=4096 skv=4096 Hq=128 Hkv=128 d_qk=192 d_v=128 bfloat16 mask=causal inference",
        "cudnn_frontend native",
        ["sdpa_cudnn native"],
    ),
    (
        "bshd B=1 Sq=16384 Skv=16384 Hq=16 Hkv=16 d_qk=192 d_v=128 bfloat16 mask=causal training",
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


def _problem(fragment: str, smoke: bool):
    for problem, _ in suite(smoke).values():
        if fragment in problem.describe():
            return problem
    raise SystemExit(f"no problem of the suite matches {fragment!r}")


def _issue_ms(step, device) -> float:
    """The host's time to issue one call, median of five (the GPU idle and synchronised before each)."""
    times = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times)


def case_steps(fragment: str, twice: str, others: list[str], target: Target, smoke: bool):
    """(problem, device, steps): ``twice`` as two steps (A, B) on the same inputs, the supported ``others`` and
    torch's default, on the bench suite's problem that ``fragment`` names."""
    problem = _problem(fragment, smoke)
    device = torch.device("cuda" if target.is_cuda else "cpu")
    supported = {str(v.candidate): v.candidate for v in judge(problem, target) if v.supported}  # label -> candidate
    inputs = random_inputs(problem, device)
    steps = {
        f"{twice} (A)": candidate_step(supported[twice], problem, target, inputs),
        f"{twice} (B)": candidate_step(supported[twice], problem, target, inputs),
    }
    steps.update(
        {name: candidate_step(supported[name], problem, target, inputs) for name in others if name in supported}
    )
    steps[TORCH_DEFAULT] = lambda: _torch_default(problem, inputs)
    return problem, device, steps


def run_case(fragment: str, twice: str, others: list[str], target: Target, sessions: int, smoke: bool) -> dict:
    problem, device, steps = case_steps(fragment, twice, others, target, smoke)
    case = {"problem": problem.describe(), "issue_ms": {k: _issue_ms(s, device) for k, s in steps.items()}}
    medians = {mode: {key: [] for key in steps} for mode in ("spin", "no spin")}
    for _ in range(sessions):  # the two ways alternate (the spin first), so the GPU's warming up lands on both
        for mode in medians:
            timings = time_steps(
                steps,
                device,
                warmup=1,
                repeats=12,
                rounds=4,
                spin=mode == "spin",
                budget_s=(0.2 if smoke else 1.5) * len(steps),
            )
            for key, t in timings.items():
                medians[mode][key].append(None if isinstance(t, Exception) else t.median_ms)
    for mode, per_step in medians.items():
        a, b = per_step[f"{twice} (A)"], per_step[f"{twice} (B)"]
        case[mode] = {
            "medians_ms": per_step,
            "a_over_b": [x / y for x, y in zip(a, b) if x and y],
            "across_sessions": {k: max(v) / min(v) for k, v in per_step.items() if v and all(v)},
        }
    return case


def markdown(report: dict) -> str:
    lines = [
        f"# Noise floor of the timings\n\n{report['meta']['device']}, {report['meta']['date']}. "
        "Produced by `benchmarks/noise_floor.py`: the same kernel timed as two steps (A, B) beside the "
        "close candidates and torch's default, in independent sessions as `attnselect bench` times them; "
        "with and without the spin that lets the host issue a turn's repeats ahead of the GPU.\n"
    ]
    for case in report["cases"]:
        lines += [
            f"\n## {case['problem']}\n",
            "| step | host ms to issue a call | "
            + " | ".join(
                f"{mode}: session medians (ms) | {mode}: max/min across sessions" for mode in ("spin", "no spin")
            )
            + " |",
            "|---|---|" + "---|---|" * 2,
        ]
        for key, issue in case["issue_ms"].items():
            cells = []
            for mode in ("spin", "no spin"):
                values = case[mode]["medians_ms"][key]
                cells += [
                    ", ".join("failed" if v is None else f"{v:.3f}" for v in values),
                    f"{case[mode]['across_sessions'].get(key, float('nan')):.3f}",
                ]
            lines.append(f"| {key} | {issue:.3f} | " + " | ".join(cells) + " |")
        for mode in ("spin", "no spin"):
            ratios = ", ".join(f"{r:.3f}" for r in case[mode]["a_over_b"])
            lines.append(f"\nA/B (the same kernel, {mode}): {ratios}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path prefix: writes OUT.json and OUT.md")
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a tiny CPU case (tests)")
    a = parser.parse_args(argv)
    write_cases(
        a.out,
        SMOKE_CASES if a.smoke else CASES,
        lambda fragment, twice, others, target: run_case(fragment, twice, others, target, a.sessions, a.smoke),
        lambda case: {m: case[m]["a_over_b"] for m in ("spin", "no spin")},
        markdown,
    )
    return 0


def write_cases(out: str, cases: list, run, summary, markdown) -> dict:
    """``run(fragment, twice, others, target)`` for each case, printing its problem and ``summary(case)`` and
    writing OUT.json after each, then ``markdown(report)`` to OUT.md."""
    target = Target.current()
    report = {
        "meta": {"device": target.describe(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__},
        "cases": [],
    }
    for fragment, twice, others in cases:
        report["cases"].append(run(fragment, twice, others, target))
        print(report["cases"][-1]["problem"], summary(report["cases"][-1]), flush=True)
        with open(out + ".json", "w") as f:
            json.dump(report, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(markdown(report))
    return report


if __name__ == "__main__":
    sys.exit(main())

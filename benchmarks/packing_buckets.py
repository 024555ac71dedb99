"""Which packing buckets should the cuDNN frontend's packed calls get? Step time against graph builds.

    python benchmarks/packing_buckets.py --out results/h200_packing_buckets     # writes .json and .md (a GPU)

The frontend's torch op builds a cuDNN graph for every new (sequence count, max_seqlen, token total / 64)
of a packed call (attnselect.backends.cudnn_frontend). attnselect rounds the first two up before the call
(empty trailing sequences, a larger max_seqlen; results unchanged). Coarse buckets mean few builds but a
larger launch (more, mostly empty, sequences and longer bounds); fine ones the reverse. For each scheme and
each document distribution of benchmarks/training_loop.py (32k tokens a step, MLA 16 heads 192/128, causal,
bf16, forward+backward through attnselect with the frontend forced): the same packings twice, the first
pass building what it needs and the second, all built, timing the steady step (median). On the host, the
distinct keys of each scheme over 2000 packings, and over 200 loops of 43 steps the share of loops in which
a key first appears after step 13 (a rebuild spike after the first 10 timed steps). Chosen: the scheme with
the least expected step time over a run of 2000 steps, summed over the distributions: its steady step plus
its builds in 2000 steps times the measured cost of a build, spread over those steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

import attnselect
from attnselect import backends
from attnselect.backends.shape_cache import PackingBuckets, Rounding
from training_loop import D_QK, D_V, DISTRIBUTIONS, HEADS, TOKENS, packings

EXACT = Rounding(floor=1, per_doubling=0, multiple=1)
COUNTS = {
    "exact": EXACT,
    "pow2": Rounding(),
    "pow2>=16": Rounding(floor=16),
    "pow2>=64": Rounding(floor=64),
    "x8": Rounding(floor=8, per_doubling=0, multiple=8),
}
MAXIMA = {
    "exact": EXACT,
    "pow2": Rounding(floor=128),
    "2/doubling": Rounding(floor=128, per_doubling=2, multiple=64),
    "4/doubling": Rounding(floor=128, per_doubling=4, multiple=64),
    "x1024": Rounding(floor=1024, per_doubling=0, multiple=1024),
    "tokens": Rounding(floor=TOKENS),
}
SCHEMES = [
    ("exact", "exact"),
    ("exact", "pow2"),
    ("x8", "pow2"),
    ("x8", "2/doubling"),
    ("x8", "4/doubling"),
    ("pow2", "pow2"),
    ("pow2", "2/doubling"),
    ("pow2", "4/doubling"),
    ("pow2", "x1024"),
    ("pow2>=16", "pow2"),
    ("pow2>=16", "2/doubling"),
    ("pow2>=16", "4/doubling"),
    ("pow2>=64", "pow2"),
    ("pow2>=64", "2/doubling"),
    ("pow2>=64", "tokens"),
    ("pow2", "tokens"),
]
LOOP, SPIKE_AFTER, LOOPS = 43, 13, 200  # a 3 + 40 step loop; keys new after step 13 spike after 10 timed steps


def buckets(scheme) -> PackingBuckets:
    return PackingBuckets(sequences=COUNTS[scheme[0]], max_seqlen=MAXIMA[scheme[1]])


def keys(lengths_list, b: PackingBuckets) -> list[tuple[int, int]]:
    return [(b.sequences(len(lengths)), b.max_seqlen(max(lengths))) for lengths in lengths_list]


def late_key_share(loops: list, b: PackingBuckets) -> float:
    """The share of ``loops`` (lists of packings) in which some key first appears after step SPIKE_AFTER."""
    late = 0
    for loop in loops:
        seen = set()
        for step, key in enumerate(keys(loop, b)):
            if key not in seen and step >= SPIKE_AFTER:
                late += 1
                break
            seen.add(key)
    return late / len(loops)


def host_analysis(schemes) -> dict:
    """{(scheme, distribution): (keys in 2000 steps, late key share)}, computed on the host."""
    result = {}
    for name, spec in DISTRIBUTIONS.items():
        long_run = packings(dict(spec, seed=500), TOKENS, 2000)
        loops = [packings(dict(spec, seed=1000 + i), TOKENS, LOOP) for i in range(LOOPS)]
        for scheme in schemes:
            b = buckets(scheme)
            result[scheme, name] = (len(set(keys(long_run, b))), late_key_share(loops, b))
    return result


def timed_pass(lengths_list, q, k, v, grad_out) -> list[float]:
    times = []
    for lengths in lengths_list:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        out = attnselect.attention(
            q,
            k,
            v,
            layout="thd",
            cu_seqlens_q=cu,
            causal=True,
            max_seqlen_q=max(lengths),
            max_seqlen_kv=max(lengths),
            backend="cudnn_frontend",
        )
        torch.autograd.grad(out, (q, k, v), grad_out)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


GRID_COUNTS, GRID_MAXIMA = (1, 2, 4), ("exact", "pow2", "2 x pow2", "tokens")


def grid(q, k, v, grad_out, repeats: int = 10) -> list[dict]:
    """The steady step of one packing per distribution with its sequence count times 1, 2, 4 (empty trailing
    sequences) and max_seqlen exact, rounded to a power of two, twice that, or the token total: the cost of a
    larger launch, each configuration built first."""
    from attnselect.execution import kernel_call
    from attnselect.spec.options import Packing
    from attnselect.spec.problem import AttentionProblem

    frontend = backends.get("cudnn_frontend")
    problem = AttentionProblem(1, 1, 1, HEADS, HEADS, D_QK, D_V, layout="thd", mask="causal", training=True)
    call = kernel_call(problem)
    rows = []
    for name, spec in DISTRIBUTIONS.items():
        lengths = packings(dict(spec, seed=spec["seed"] + 200), TOKENS, 1)[0]
        longest, pow2 = max(lengths), Rounding(floor=128)(max(lengths))
        for factor in GRID_COUNTS:
            for label, bound in zip(GRID_MAXIMA, (longest, pow2, 2 * pow2, TOKENS)):
                padded = lengths + [0] * (len(lengths) * (factor - 1))
                cu = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                packing = Packing(cu, cu, bound, bound, cu, cu)

                def step(packing=packing):
                    out, _ = frontend.run_packed(q, k, v, call, packing)
                    torch.autograd.grad(out, (q, k, v), grad_out)

                step()
                torch.cuda.synchronize()
                times = []
                for _ in range(repeats):
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                    step()
                    end.record()
                    end.synchronize()
                    times.append(begin.elapsed_time(end))
                rows.append(
                    {
                        "distribution": name,
                        "documents": len(lengths),
                        "longest": longest,
                        "count_factor": factor,
                        "max_seqlen": label,
                        "bound": bound,
                        "gpu_median_ms": statistics.median(times),
                    }
                )
                print(
                    f"grid {name:<16} {len(lengths):3d} docs x{factor} max_seqlen {label:<8} ({bound:5d}): "
                    f"{rows[-1]['gpu_median_ms']:.2f} ms",
                    flush=True,
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--packings", type=int, default=20, help="packings per distribution and pass")
    ap.add_argument("--schemes", help="comma list of count/max schemes to time (default: all)")
    ap.add_argument("--render", help="re-make the report from this JSON (choice and markdown), no GPU")
    a = ap.parse_args()
    if a.render:
        report = json.loads(Path(a.render).read_text())
        report["chosen"] = choose(report["rows"])
        Path(a.out + ".json").write_text(json.dumps(report, indent=1))
        Path(a.out + ".md").write_text(markdown(report))
        print(markdown(report))
        return
    frontend = backends.get("cudnn_frontend")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (
        torch.randn(TOKENS, HEADS, D_QK, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        for _ in range(2)
    )
    v = torch.randn(TOKENS, HEADS, D_V, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    grad_out = torch.randn(TOKENS, HEADS, D_V, device="cuda", dtype=torch.bfloat16, generator=g)
    timed_pass(packings(dict(DISTRIBUTIONS["RL rollouts"], seed=99), TOKENS, 2), q, k, v, grad_out)  # process start
    launch = grid(q, k, v, grad_out)
    chosen = [tuple(x.split("/", 1)) for x in a.schemes.split(",")] if a.schemes else SCHEMES
    analysis, rows = host_analysis(chosen), []
    for scheme in chosen:
        b = buckets(scheme)
        frontend.shape_cache = dataclasses.replace(type(frontend).shape_cache, buckets=b)
        for name, spec in DISTRIBUTIONS.items():
            loop = packings(dict(spec, seed=spec["seed"] + 100), TOKENS, a.packings)
            first, steady = timed_pass(loop, q, k, v, grad_out), timed_pass(loop, q, k, v, grad_out)
            built = len(set(keys(loop, b)))
            long_run, late = analysis[scheme, name]
            row = {
                "counts": scheme[0],
                "max_seqlen": scheme[1],
                "distribution": name,
                "steady_median_ms": statistics.median(steady),
                "first_pass_ms": sum(first),
                "keys_built": built,
                "ms_per_build": (sum(first) - sum(steady)) / max(built, 1),
                "keys_in_2000_steps": long_run,
                "late_key_share": late,
            }
            rows.append(row)
            print(
                f"{scheme[0]:>8} / {scheme[1]:<10} {name:<16} steady {row['steady_median_ms']:6.2f} ms, "
                f"{built:2d} keys built ({row['ms_per_build']:.0f} ms each), {long_run:3d} keys in 2000 steps, "
                f"late keys in {row['late_key_share']:.0%} of loops",
                flush=True,
            )
    frontend.shape_cache = type(frontend).shape_cache
    report = {
        "meta": {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cudnn": attnselect.Target.current().cudnn_version,
            "cudnn_frontend": attnselect.Target.current().version("nvidia-cudnn-frontend"),
            "date": time.strftime("%Y-%m-%d"),
            "packings": a.packings,
        },
        "grid": launch,
        "rows": rows,
        "chosen": choose(rows),
    }
    Path(a.out + ".json").write_text(json.dumps(report, indent=1))
    Path(a.out + ".md").write_text(markdown(report))
    print(markdown(report))


RUN = 2000  # the steps a build is spread over when schemes are compared


def choose(rows) -> dict:
    """The scheme of least expected step time over RUN steps (steady step + builds x build cost / RUN), summed
    over the distributions; the cost of a build is the median measured where builds were many (exact keys)."""
    builds = [r["ms_per_build"] for r in rows if r["keys_built"] >= 5] or [120.0]
    build_ms = statistics.median(builds)
    schemes = {}
    for r in rows:
        schemes.setdefault((r["counts"], r["max_seqlen"]), []).append(r)
    cost = {
        s: sum(r["steady_median_ms"] + r["keys_in_2000_steps"] * build_ms / RUN for r in rs)
        for s, rs in schemes.items()
    }
    best = min(cost, key=cost.get)
    return {
        "counts": best[0],
        "max_seqlen": best[1],
        "build_ms": build_ms,
        "expected_ms": {f"{s[0]} / {s[1]}": c for s, c in sorted(cost.items(), key=lambda x: x[1])},
    }


def markdown(report) -> str:
    m = report["meta"]
    lines = [
        "# Packing buckets for the cuDNN frontend's packed calls\n",
        f"{m['device']}, torch {m['torch']}, cuDNN {m['cudnn']}, cudnn-frontend {m['cudnn_frontend']}, {m['date']}. "
        f"MLA 16 heads, 192/128, causal, bf16, {TOKENS} tokens a step, forward+backward, {m['packings']} packings "
        "per distribution, twice (the second pass timed with every graph built). Produced by "
        "`benchmarks/packing_buckets.py`.\n",
        "| sequence count | max_seqlen | distribution | steady step ms | keys built | ms per build | "
        "keys in 2000 steps | loops with a key new after step 13 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['counts']} | {r['max_seqlen']} | {r['distribution']} | {r['steady_median_ms']:.2f} | "
            f"{r['keys_built']} | {r['ms_per_build']:.0f} | {r['keys_in_2000_steps']} | {r['late_key_share']:.0%} |"
        )
    lines += [
        "\nThe cost of a larger launch: one packing per distribution, GPU ms of a forward+backward (median of "
        "10, every configuration built first):\n",
        "| distribution | documents | longest | sequence count | "
        + " | ".join(f"max_seqlen {m}" for m in GRID_MAXIMA)
        + " |",
        "|---|---|---|---|" + "---|" * len(GRID_MAXIMA),
    ]
    for name in DISTRIBUTIONS:
        for factor in GRID_COUNTS:
            cells = [r for r in report["grid"] if r["distribution"] == name and r["count_factor"] == factor]
            if cells:
                lines.append(
                    f"| {name} | {cells[0]['documents']} | {cells[0]['longest']} | x{factor} | "
                    + " | ".join(f"{r['gpu_median_ms']:.2f}" for r in cells)
                    + " |"
                )
    c = report["chosen"]
    lines += [
        f"\nExpected step over {RUN} steps, summed over the three distributions (steady step + builds x "
        f"{c['build_ms']:.0f} ms / {RUN}):\n",
        "| sequence count / max_seqlen | ms |",
        "|---|---|",
    ]
    lines += [f"| {scheme} | {ms:.2f} |" for scheme, ms in c["expected_ms"].items()]
    lines.append(f"\nChosen: sequence count {c['counts']}, max_seqlen {c['max_seqlen']}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

"""A training loop whose packing changes every step, as a data loader's does: wall time per step.

    python benchmarks/training_loop.py --out results/h200_training_loop       # writes .json and .md
    python benchmarks/training_loop.py --smoke --out /tmp/loop                # tiny, any device

MLA 16 heads, d_qk=192, d_v=128, causal, bf16, 32768 tokens a step in documents drawn from three seeded
distributions, a new packing every step, forward+backward of one attention call. Each step copies its
boundaries to the device (as a collator's batch arrives), runs the call with max_seqlen given (as Megatron
passes it) or read from the boundaries, differentiates it, and waits for the GPU: the step's wall time,
host included. 3 steps of warm-up, then ``--steps`` timed ones. Every row runs in a process of its own
(no cache of one row serves another), on the same packings as the other rows, in ``--rounds`` rounds, the
rows in turn in each (forward, then backward in the next), so that a drift of the GPU from one process to
the next lands on every row alike; each row's steps are pooled over its rounds, and rows are compared
step by step (the median of the per-step ratios on the same packings). Rows: attnselect's
choice, every packed candidate forced, torch's own `varlen_attn` with V padded (what a PyTorch user
writes), and FlashAttention-4's `flash_attn_varlen_func` called directly where installed. Reported: the
median step, the p90 step, the total of the first 10 timed steps, the slowest later step over the median
(raw, and over the time the row's median rate gives that step's work, since the long-tailed steps' work
varies several fold: a rebuild shows as a step far slower than its work explains), and TFLOP/s on useful
causal work (3.5 x 2 * H * (d_qk + d_v) * sum n(n+1)/2 a step, forward+backward).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HEADS, D_QK, D_V, TOKENS = 16, 192, 128, 32768
SMOKE = dict(heads=2, d_qk=24, d_v=16, tokens=96)

# Document lengths: lognormal(mu, sigma) clipped to [low, high], or uniform on [low, high].
DISTRIBUTIONS = {
    "long-tailed": dict(kind="lognormal", mu=6.5, sigma=1.3, low=16, high=16384, seed=1),
    "RL rollouts": dict(kind="uniform", low=1024, high=8192, seed=2),
    "short chat turns": dict(kind="lognormal", mu=5.5, sigma=0.8, low=32, high=2048, seed=3),
}
SMOKE_DISTRIBUTIONS = {"smoke": dict(kind="uniform", low=1, high=40, seed=4)}
TORCH_DEFAULT, FA4 = "torch varlen_attn, V padded", "FA4 flash_attn_varlen_func, called directly"
DEFAULT_GIVEN, DEFAULT_READ = "attnselect default, max_seqlen given", "attnselect default, max_seqlen read"
WITHOUT_FA4 = "attnselect default, FA4 disabled"  # what a machine without FA4 gets, side by side with one that has it


def packings(spec: dict, tokens: int, count: int) -> list[list[int]]:
    """``count`` packings of exactly ``tokens`` tokens: documents drawn until the step is full, the last cut."""
    rng, result = random.Random(spec["seed"]), []
    for _ in range(count):
        lengths = []
        while sum(lengths) < tokens:
            if spec["kind"] == "uniform":
                n = rng.randint(spec["low"], spec["high"])
            else:
                n = min(max(int(rng.lognormvariate(spec["mu"], spec["sigma"])), spec["low"]), spec["high"])
            lengths.append(min(n, tokens - sum(lengths)))
        result.append(lengths)
    return result


def useful_flops(lengths: list[int], heads: int, d_qk: int, d_v: int) -> float:
    return 3.5 * sum(2 * heads * (d_qk + d_v) * n * (n + 1) / 2 for n in lengths)


def row_names(device: str, smoke: bool) -> list[str]:
    """attnselect's choice (max_seqlen given and read), every packed candidate, torch's default, FA4."""
    import attnselect
    from attnselect import backends
    from attnselect.choose.candidates import judge

    geometry = _geometry(smoke)
    target = attnselect.Target.current(device)
    problem = _problem(8, 4096, geometry, device)
    forced = [
        str(v.candidate)
        for v in judge(problem, target)
        if v.supported and backends.get(v.candidate.backend).packs_thd(target)
    ]
    rows = [DEFAULT_GIVEN, DEFAULT_READ, *forced, TORCH_DEFAULT]
    if device == "cuda" and _fa4() is not None:
        rows += [FA4, WITHOUT_FA4]
    return rows


def _geometry(smoke: bool) -> dict:
    return SMOKE if smoke else dict(heads=HEADS, d_qk=D_QK, d_v=D_V, tokens=TOKENS)


def _problem(batch: int, longest: int, geometry: dict, device: str):
    """The loop's packed causal training problem: ``batch`` sequences, the longest ``longest`` tokens."""
    import attnselect

    return attnselect.AttentionProblem(batch, longest, longest, geometry["heads"], geometry["heads"], geometry["d_qk"],
                                       geometry["d_v"], dtype=_dtype(device), layout="thd", mask="causal",
                                       training=True)  # fmt: skip


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def _fa4():
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def attention_for(row: str):
    """``attend(q, k, v, cu, max_seqlen) -> out`` for one row."""
    import attnselect

    if row in (DEFAULT_GIVEN, DEFAULT_READ, WITHOUT_FA4):
        read, disable = row == DEFAULT_READ, ("flash_attn4",) if row == WITHOUT_FA4 else None
        return lambda q, k, v, cu, m: attnselect.attention(
            q,
            k,
            v,
            layout="thd",
            cu_seqlens_q=cu,
            causal=True,
            max_seqlen_q=None if read else m,
            max_seqlen_kv=None if read else m,
            disable=disable,
        )
    if row == TORCH_DEFAULT:
        from torch.nn.attention.varlen import varlen_attn

        def torch_default(q, k, v, cu, m):
            padded = F.pad(v, (0, q.shape[-1] - v.shape[-1])) if q.shape[-1] > v.shape[-1] else v
            return varlen_attn(q, k, padded, cu, cu, m, m, window_size=(-1, 0))[..., : v.shape[-1]]

        return torch_default
    if row == FA4:
        fa4 = _fa4()

        def flash_attn4(q, k, v, cu, m):
            out = fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m, causal=True)
            return out[0] if isinstance(out, tuple) else out

        return flash_attn4
    backend, _, padded = row.partition(" ")
    pad = padded.startswith("padded")
    return lambda q, k, v, cu, m: attnselect.attention(
        q, k, v, layout="thd", cu_seqlens_q=cu, causal=True, max_seqlen_q=m, max_seqlen_kv=m, backend=backend, pad=pad
    )


def run_row(row: str, device: str, steps: int, warmup: int, smoke: bool) -> dict:
    """Every distribution's loop for one row, in this process."""
    geometry = _geometry(smoke)
    dtype, heads, tokens = _dtype(device), geometry["heads"], geometry["tokens"]
    g = torch.Generator(device=device).manual_seed(0)
    q, k = (
        torch.randn(tokens, heads, geometry["d_qk"], device=device, dtype=dtype, generator=g).requires_grad_()
        for _ in range(2)
    )
    v = torch.randn(tokens, heads, geometry["d_v"], device=device, dtype=dtype, generator=g).requires_grad_()
    grad_out = torch.randn(tokens, heads, geometry["d_v"], device=device, dtype=dtype, generator=g)
    attend = attention_for(row)
    results = {}
    for name, spec in (SMOKE_DISTRIBUTIONS if smoke else DISTRIBUTIONS).items():
        loop = packings(spec, tokens, warmup + steps)
        times, gpu, flops = [], [], []
        try:
            for i, lengths in enumerate(loop):
                ms, gpu_ms = _step(attend, q, k, v, grad_out, lengths, device)
                if i >= warmup:
                    times.append(ms)
                    gpu.append(gpu_ms)
                    flops.append(useful_flops(lengths, heads, geometry["d_qk"], geometry["d_v"]))
        except Exception as exc:  # a row that cannot run this loop is itself a finding
            results[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
            continue
        results[name] = {
            "step_ms": times,
            "gpu_ms": gpu,
            "flops": flops,
            "documents": [min(map(len, loop[warmup:])), max(map(len, loop[warmup:]))],
            "max_seqlen": [min(map(max, loop[warmup:])), max(map(max, loop[warmup:]))],
        }
    return results


def _step(attend, q, k, v, grad_out, lengths, device):
    """One step: boundaries to the device, forward, backward, wait. (wall ms, GPU ms or None)."""
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    if cuda:
        begin.record()
    out = attend(q, k, v, cu, max(lengths))
    torch.autograd.grad(out, (q, k, v), grad_out)
    if cuda:
        end.record()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    return wall, (begin.elapsed_time(end) if cuda else None)


def summary(rounds: list[dict]) -> dict:
    """One row's loop over its rounds: pooled median and p90, the worst round's first 10 steps and spike."""
    if any("error" in r for r in rounds):
        return next(r for r in rounds if "error" in r)
    times = [t for r in rounds for t in r["step_ms"]]
    rate = statistics.median(t / f for r in rounds for t, f in zip(r["step_ms"], r["flops"]))  # ms per FLOP
    gpu = [t for r in rounds for t in r["gpu_ms"] if t is not None]
    median = statistics.median(times)
    return {
        "median_ms": median,
        "p90_ms": _quantile(times, 0.9),
        "first_10_total_ms": max(sum(r["step_ms"][:10]) for r in rounds),
        "worst_after_10_over_median": max(
            max(r["step_ms"][10:] or r["step_ms"]) / statistics.median(r["step_ms"]) for r in rounds
        ),
        "worst_after_10_over_work": max(
            (
                t / (f * rate)
                for r in rounds
                for t, f in zip(r["step_ms"][10:] or r["step_ms"], r["flops"][10:] or r["flops"])
            ),
            default=None,
        ),
        "tflops": sum(f for r in rounds for f in r["flops"]) / (sum(times) * 1e-3) / 1e12,
        "gpu_median_ms": statistics.median(gpu) if gpu else None,
        "steps": len(times),
        "rounds": len(rounds),
        "documents": rounds[0]["documents"],
        "max_seqlen": rounds[0]["max_seqlen"],
        "step_ms": [r["step_ms"] for r in rounds],
        "flops": rounds[0]["flops"],
    }


def paired(a: dict, b: dict) -> float:
    """The median over the same packings (every round, every step) of a's step time over b's."""
    return statistics.median(x / y for ra, rb in zip(a["step_ms"], b["step_ms"]) for x, y in zip(ra, rb))


def _quantile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def goals(report: dict) -> list[dict]:
    """The goals per distribution, from per-step ratios on the same packings: default within 5% of the fastest row
    it could run; against torch's default 2.5x on long-tailed and RL, 1.5x on short turns; no step after the first
    10 longer than 1.5x the median (no rebuild spikes); and where FA4 is installed, the default with FA4 disabled
    within 5% of the fastest row without FA4 (a machine without FA4 loses nothing)."""
    out = []
    attnselect_rows = (DEFAULT_GIVEN, DEFAULT_READ, WITHOUT_FA4)
    for name in report["distributions"]:
        rows = {row: r[name] for row, r in report["rows"].items() if "median_ms" in r.get(name, {})}
        if DEFAULT_GIVEN not in rows:
            out.append({"distribution": name, "error": "the default row did not run"})
            continue
        default = rows[DEFAULT_GIVEN]
        # every row the default could have been: each forced candidate, and FA4 (a backend once installed)
        forced = {row: paired(r, default) for row, r in rows.items() if row not in (*attnselect_rows, TORCH_DEFAULT)}
        fastest = min(forced, key=forced.get) if forced else None
        torch_ratio = paired(rows[TORCH_DEFAULT], default) if TORCH_DEFAULT in rows else None
        need = 1.5 if name == "short chat turns" else 2.5
        goal = {
            "distribution": name,
            "choice": report["choices"].get(name),
            "default_vs_fastest_forced": fastest and forced[fastest],
            "fastest_forced": fastest,
            "within_5_percent": bool(fastest) and forced[fastest] >= 0.95,
            "vs_torch_default": torch_ratio,
            "vs_torch_needed": need,
            "vs_torch_met": bool(torch_ratio) and torch_ratio >= need,
            "worst_after_10_over_median": default["worst_after_10_over_median"],
            "no_spikes": default["worst_after_10_over_median"] <= 1.5,
            "worst_after_10_over_work": default.get("worst_after_10_over_work"),
            "no_spikes_for_the_work": (default.get("worst_after_10_over_work") or 99) <= 1.5,
        }
        if WITHOUT_FA4 in rows:
            others = {
                row: paired(r, rows[WITHOUT_FA4])
                for row, r in rows.items()
                if row not in (*attnselect_rows, TORCH_DEFAULT, FA4) and not row.startswith("flash_attn4")
            }
            best = min(others, key=others.get) if others else None
            goal.update(
                without_fa4_vs_fastest=best and others[best],
                without_fa4_fastest=best,
                without_fa4_within_5_percent=bool(best) and others[best] >= 0.95,
            )
        out.append(goal)
    return out


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [
        "# Training loop with a new packing every step\n",
        f"{meta['device']}, torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}, "
        f"cudnn-frontend {meta['cudnn_frontend']}, FA4 {meta['flash_attn4']}, {meta['date']}, attnselect at "
        f"{meta['commit']}. {meta['geometry']}. {meta['steps']} timed steps after {meta['warmup']} of warm-up, "
        f"each row in a process of its own, {meta['rounds']} rounds of every row in turn (steps pooled). "
        "Wall time per step, host included (boundaries copied, forward, "
        f"backward, one sync). Produced by `benchmarks/training_loop.py`.\n",
    ]
    for name in report["distributions"]:
        spec = report["distributions"][name]
        lines += [
            f"\n## {name} ({_describe(spec)})\n",
            "| row | median ms | p90 ms | first 10 steps ms | slowest later step / median | ... / its work's time "
            "| TFLOP/s | GPU median ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row, results in report["rows"].items():
            r = results.get(name, {"error": "not run"})
            if "error" in r:
                lines.append(f"| {row} | failed: {r['error'][:120]} | | | | | | |")
                continue
            gpu = f"{r['gpu_median_ms']:.2f}" if r["gpu_median_ms"] is not None else "-"
            work = f"{r['worst_after_10_over_work']:.2f}" if r.get("worst_after_10_over_work") else "-"
            lines.append(
                f"| {row} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} | {r['first_10_total_ms']:.0f} | "
                f"{r['worst_after_10_over_median']:.2f} | {work} | {r['tflops']:.0f} | {gpu} |"
            )
        first = next((r[name] for r in report["rows"].values() if "documents" in r.get(name, {})), None)
        if first:
            lines.append(
                f"\nDocuments a step: {first['documents'][0]}-{first['documents'][1]}; max_seqlen "
                f"{first['max_seqlen'][0]}-{first['max_seqlen'][1]}. attnselect chose: "
                f"{report['choices'].get(name)}."
            )
    lines += [
        "\n## Goals\n",
        "Ratios are medians of per-step ratios on the same packings (a row's step time over the default's).\n",
        "| distribution | fastest other row vs default | within 5% | torch default vs default "
        "(needed) | slowest later step / median (<= 1.5) | ... / its work's time |",
        "|---|---|---|---|---|---|",
    ]
    for g in report["goals"]:
        if "error" in g:
            lines.append(f"| {g['distribution']} | {g['error']} | | | | |")
            continue
        vs_fastest = f"{g['default_vs_fastest_forced']:.3f} ({g['fastest_forced']})" if g["fastest_forced"] else "-"
        vs_torch = f"{g['vs_torch_default']:.2f}x" if g["vs_torch_default"] else "-"
        lines.append(
            f"| {g['distribution']} | {vs_fastest} | {'met' if g['within_5_percent'] else 'missed'} | "
            f"{vs_torch} ({g['vs_torch_needed']}x: {'met' if g['vs_torch_met'] else 'missed'}) | "
            f"{g['worst_after_10_over_median']:.2f} ({'met' if g['no_spikes'] else 'missed'}) | "
            + (f"{g['worst_after_10_over_work']:.2f} |" if g.get("worst_after_10_over_work") else "- |")
        )
    without = [g for g in report["goals"] if g.get("without_fa4_fastest")]
    if without:
        lines += [
            f"\nWith FA4 disabled ({WITHOUT_FA4!r}), against the fastest row without FA4 (within 5%):\n",
            "| distribution | fastest row without FA4 vs that default | within 5% |",
            "|---|---|---|",
        ]
        lines += [
            f"| {g['distribution']} | {g['without_fa4_vs_fastest']:.3f} ({g['without_fa4_fastest']}) | "
            f"{'met' if g['without_fa4_within_5_percent'] else 'missed'} |"
            for g in without
        ]
    return "\n".join(lines) + "\n"


def render(path: str, out: str) -> None:
    """Re-make a report's summaries, goals and markdown from its step times (per-step work from the seeds)."""
    report = json.loads(Path(path).read_text())
    smoke = report["distributions"] == SMOKE_DISTRIBUTIONS
    geometry = _geometry(smoke)
    warmup = report["meta"]["warmup"]
    for name, spec in report["distributions"].items():
        loop = packings(spec, geometry["tokens"], warmup + report["meta"]["steps"])[warmup:]
        flops = [useful_flops(p, geometry["heads"], geometry["d_qk"], geometry["d_v"]) for p in loop]
        for results in report["rows"].values():
            r = results.get(name, {})
            if "step_ms" in r:
                rounds = [
                    {
                        "step_ms": times,
                        "gpu_ms": [r["gpu_median_ms"]] if r["gpu_median_ms"] else [],
                        "flops": flops,
                        "documents": r["documents"],
                        "max_seqlen": r["max_seqlen"],
                    }
                    for times in r["step_ms"]
                ]
                results[name] = summary(rounds)
                results[name]["gpu_median_ms"] = r["gpu_median_ms"]
    report["goals"] = goals(report)
    Path(out + ".json").write_text(json.dumps(report, indent=1))
    Path(out + ".md").write_text(markdown(report))
    print(markdown(report))


def _describe(spec: dict) -> str:
    if spec["kind"] == "uniform":
        return f"uniform {spec['low']}..{spec['high']} tokens, seed {spec['seed']}"
    return f"lognormal({spec['mu']}, {spec['sigma']}) clipped to {spec['low']}..{spec['high']}, seed {spec['seed']}"


def choices(device: str, smoke: bool) -> dict:
    """attnselect's choice for each distribution's first timed packing (max_seqlen given)."""
    import attnselect

    geometry = _geometry(smoke)
    out = {}
    for name, spec in (SMOKE_DISTRIBUTIONS if smoke else DISTRIBUTIONS).items():
        lengths = packings(spec, geometry["tokens"], 4)[3]
        problem = _problem(len(lengths), max(lengths), geometry, device)
        out[name] = str(attnselect.select(problem, target=attnselect.Target.current(device)).chosen)
    return out


def meta(device: str, a) -> dict:
    import attnselect

    target = attnselect.Target.current(device)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    geometry = _geometry(a.smoke)
    return {
        "device": target.name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": target.cudnn_version,
        "cudnn_frontend": target.version("nvidia-cudnn-frontend"),
        "flash_attn4": target.version("flash-attn-4"),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit or "?",
        "steps": a.steps,
        "warmup": a.warmup,
        "rounds": a.rounds,
        "geometry": (
            f"MLA {geometry['heads']} heads, d_qk={geometry['d_qk']}, d_v={geometry['d_v']}, causal, "
            f"{str(_dtype(device)).replace('torch.', '')}, {geometry['tokens']} tokens a step, "
            "forward+backward"
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="path prefix of the .json and .md reports")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every row, in turn (each a process per row)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (any device): a check that it runs")
    ap.add_argument("--rows", help="rows to run, separated by ';' (default: all)")
    ap.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row here and print its JSON
    ap.add_argument("--render", help="re-make the report from this JSON (its packings re-drawn from their seeds)")
    a = ap.parse_args()
    if a.render:
        render(a.render, a.out)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.row:
        print(json.dumps(run_row(a.row, device, a.steps, a.warmup, a.smoke)))
        return
    rows = a.rows.split(";") if a.rows else row_names(device, a.smoke)
    report = {
        "meta": meta(device, a),
        "distributions": SMOKE_DISTRIBUTIONS if a.smoke else DISTRIBUTIONS,
        "choices": choices(device, a.smoke),
        "rows": {},
    }
    runs = {row: [] for row in rows}
    for turn in range(a.rounds):
        for row in rows if turn % 2 == 0 else rows[::-1]:
            started = time.perf_counter()
            command = [
                sys.executable,
                __file__,
                "--out",
                a.out,
                "--row",
                row,
                "--steps",
                str(a.steps),
                "--warmup",
                str(a.warmup),
            ] + (["--smoke"] if a.smoke else [])
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                error = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
                runs[row].append({name: {"error": error} for name in report["distributions"]})
            else:
                runs[row].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(
                f"round {turn + 1}, {row}: {time.perf_counter() - started:.0f} s; "
                + "; ".join(
                    f"{name} {statistics.median(r['step_ms']):.2f} ms"
                    if "step_ms" in r
                    else f"{name} {r['error'][:80]}"
                    for name, r in runs[row][-1].items()
                ),
                flush=True,
            )
    report["rows"] = {
        row: {name: summary([run[name] for run in runs[row]]) for name in report["distributions"]} for row in rows
    }
    report["goals"] = goals(report)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(report, indent=1))
    Path(a.out + ".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()

"""Time every packed (thd) candidate, native and padded, on three packings, forward and forward+backward.

    python benchmarks/thd_bench.py --out results/h200_thd_bench      # writes .json and .md
    python benchmarks/thd_bench.py --packings smoke --out /tmp/thd_smoke   # tiny packings, any device

MLA geometry: 16 heads, d_qk=192, d_v=128, causal, bf16 (float32 on the CPU). Each candidate
is timed with device events after warm-up (median of repeats, with the 20th and 80th
percentiles as its spread; attnselect.choose.timing.time_step), twice: calls queued back to back as
in a training loop (the headline, TFLOP/s from it) and each call alone (synchronised, so its
host overhead counts in full). The packing's masks are already built; flex's one-off
document-mask build per new packing is reported beside it. TFLOP/s count useful work only:
2 * H * (d_qk + d_v) * (visible
causal pairs) for the forward, 3.5 times that for forward+backward. The report also gives
the rules policy's choice against the fastest candidate and against torch's varlen_attn with
V padded (the varlen_fa2 candidate padded to 192).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

import attnselect
from attnselect.choose.candidates import judge
from attnselect.choose.timing import candidate_step, time_step
from attnselect.spec.options import CallOptions
from attnselect.spec.problem import describe_call
from attnselect.spec.target import Target

HEADS, D_QK, D_V = 16, 192, 128


def _random_lengths(total: int, low: int, high: int, seed: int) -> list[int]:
    rng, lengths = random.Random(seed), []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(low, high), total - sum(lengths)))
    return lengths


def packings(which: str) -> dict[str, list[int]]:
    if which == "smoke":
        return {"smoke-mixed": [5, 1, 0, 17, 9], "smoke-equal": [16, 16]}
    if which == "crossover":  # where do short documents stop favouring one kernel over another?
        return {f"16k tokens, documents of {n}": [n] * (16384 // n) for n in (128, 256, 512, 1024, 2048)} | {
            "32k tokens, documents of 256..1024": _random_lengths(32768, 256, 1024, seed=32)
        }
    eighteen = _random_lengths(32768 - 17 * 256, 0, 4096 - 256, seed=18)[:17]
    eighteen = [256 + n for n in eighteen] + [32768 - sum(256 + n for n in eighteen)]
    assert len(eighteen) == 18 and sum(eighteen) == 32768 and all(256 <= n <= 4096 for n in eighteen), eighteen
    return {
        "32k tokens, 18 sequences of 256..4096": eighteen,
        "64k tokens, 8 documents of 8k": [8192] * 8,
        "16k tokens, documents of 128..512": _random_lengths(16384, 128, 512, seed=16),
    }


def useful_flops(lengths: list[int], training: bool) -> float:
    forward = sum(2 * HEADS * (D_QK + D_V) * n * (n + 1) / 2 for n in lengths)
    return forward * (3.5 if training else 1.0)


def bench_packing(name, lengths, training, target, device, dtype, args):
    generator = torch.Generator(device=device).manual_seed(0)
    total = sum(lengths)
    q, k = (torch.randn(total, HEADS, D_QK, device=device, dtype=dtype, generator=generator) for _ in range(2))
    v = torch.randn(total, HEADS, D_V, device=device, dtype=dtype, generator=generator)
    grad_out = torch.randn(total, HEADS, D_V, device=device, dtype=dtype, generator=generator)
    for t in (q, k, v):
        t.requires_grad_(training)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)
    problem, packing = describe_call(
        q,
        k,
        v,
        CallOptions(layout="thd", cu_seqlens_q=cu, causal=True, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)),
    )
    decision = attnselect.select(problem, target=target)
    rows = []
    for verdict in judge(problem, target):
        if not verdict.supported or verdict.candidate.backend in args.skip:
            continue
        candidate = verdict.candidate
        step = candidate_step(candidate, problem, target, (q, k, v, grad_out, packing))
        try:
            queued, alone = (
                time_step(
                    step,
                    torch.device(device),
                    warmup=args.warmup,
                    repeats=args.repeats,
                    budget_s=args.budget,
                    queued=mode,
                )
                for mode in (True, False)
            )
        except Exception as exc:  # a candidate the rules admit but that fails is itself a finding
            rows.append({"candidate": str(candidate), "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            print(f"  {candidate}: FAILED {exc}", flush=True)
            continue
        setup_ms = None
        if candidate.backend == "flex":  # its document mask is built once per new cu_seqlens (each step)
            from attnselect.backends.flex import _document_block_mask

            fresh = lambda: _document_block_mask(
                packing._replace(cu_seqlens_q=packing.cu_seqlens_q.clone()),  # noqa: E731
                "causal",
                None,
                total,
                total,
                q.device,
            )
            setup_ms = time_step(fresh, torch.device(device), warmup=1, repeats=3, queued=False).median_ms
        rows.append(
            {
                "candidate": str(candidate),
                "backend": candidate.backend,
                "pad_to": candidate.pad_to,
                "median_ms": queued.median_ms,
                "p20_ms": queued.low_ms,
                "p80_ms": queued.high_ms,
                "alone_median_ms": alone.median_ms,
                "alone_p20_ms": alone.low_ms,
                "alone_p80_ms": alone.high_ms,
                "setup_ms_per_new_packing": setup_ms,
                "tflops": useful_flops(lengths, training) / (queued.median_ms * 1e-3) / 1e12,
            }
        )
        print(
            f"  {candidate}: {queued.median_ms:.3f} ms queued, {alone.median_ms:.3f} ms alone "
            f"({rows[-1]['tflops']:.1f} TFLOP/s)",
            flush=True,
        )
    timed_rows = [r for r in rows if "median_ms" in r]
    fastest = min(timed_rows, key=lambda r: r["median_ms"]) if timed_rows else None
    chosen = next((r for r in timed_rows if r["candidate"] == str(decision.chosen)), None)
    baseline = next((r for r in timed_rows if r["backend"] == "varlen_fa2" and r["pad_to"]), None)
    return {
        "packing": name,
        "lengths": lengths,
        "phase": "forward+backward" if training else "forward",
        "rules_choice": str(decision.chosen),
        "fastest": fastest and fastest["candidate"],
        "choice_vs_fastest": chosen and fastest and fastest["median_ms"] / chosen["median_ms"],
        "choice_vs_varlen_padded": chosen and baseline and baseline["median_ms"] / chosen["median_ms"],
        "candidates": rows,
    }


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [
        "# Packed (thd) MLA attention: every candidate\n",
        f"{meta['device']}, CUDA {meta['cuda']}, {meta['date']}; {HEADS} heads, d_qk={D_QK}, d_v={D_V}, causal, "
        f"{meta['dtype']}. TFLOP/s on useful (causal, unpadded) work; median of repeats, spread p20..p80; "
        f"calls queued back to back (TFLOP/s from these), and each call alone (synchronised). "
        f"Produced by `benchmarks/thd_bench.py`.\n",
    ]
    for rerun in meta.get("reruns", []):
        lines.append(
            f"Re-run on {rerun['date']} ({rerun['device']}), after a change of their rules: "
            f"{', '.join(rerun['packings'])}.\n"
        )
    for entry in report["results"]:
        lines.append(f"## {entry['packing']}, {entry['phase']}\n")
        lines.append(
            f"Rules choice: **{entry['rules_choice']}**; fastest: **{entry['fastest']}**; choice/fastest "
            f"speed {_ratio(entry['choice_vs_fastest'])}; choice vs varlen_attn with V padded "
            f"{_ratio(entry['choice_vs_varlen_padded'])}.\n"
        )
        lines.append("| candidate | queued ms | p20..p80 ms | TFLOP/s | alone ms (p20..p80) | setup per new packing |")
        lines.append("|---|---|---|---|---|---|")
        for r in sorted(entry["candidates"], key=lambda r: r.get("median_ms", float("inf"))):
            if "error" in r:
                lines.append(f"| {r['candidate']} | failed: {r['error']} | | | | |")
            else:
                setup = r["setup_ms_per_new_packing"]
                alone = (
                    f"{r['alone_median_ms']:.3f} ({r['alone_p20_ms']:.3f}..{r['alone_p80_ms']:.3f})"
                    if "alone_median_ms" in r
                    else "-"
                )
                lines.append(
                    f"| {r['candidate']} | {r['median_ms']:.3f} | {r['p20_ms']:.3f}..{r['p80_ms']:.3f} | "
                    f"{r['tflops']:.3g} | {alone} | {'-' if setup is None else f'{setup:.1f} ms'} |"
                )
        lines.append("")
    return "\n".join(lines)


def _ratio(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="path without extension; .json and .md are written")
    ap.add_argument(
        "--packings",
        choices=("issue", "crossover", "smoke"),
        default="issue",
        help="issue: the three packings of the benchmark; crossover: equal short documents, to place "
        "the rules' short-document threshold; smoke: tiny packings (CI / CPU)",
    )
    ap.add_argument("--only", default="", help="run only the packings whose name contains this text")
    ap.add_argument(
        "--into",
        help="with --only: replace those packings' rows in this earlier report (path without "
        "extension) instead of writing a new one, e.g. after a change of their rules",
    )
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--budget", type=float, default=4.0, help="seconds of timing per candidate at most")
    ap.add_argument("--skip", default="reference", help="comma list of backends not to time")
    args = ap.parse_args()
    args.skip = set(filter(None, args.skip.split(",")))
    if args.into and (not args.only or args.into == args.out):
        ap.error("--into: needs --only and a --out of its own (the earlier report is read after the run)")
    torch._dynamo.config.cache_size_limit = 256
    target = Target.current()
    device = "cuda" if target.is_cuda else "cpu"
    dtype = torch.bfloat16 if target.is_cuda else torch.float32
    report = {
        "meta": {
            "device": target.describe(),
            "cuda": torch.version.cuda,
            "torch": torch.__version__,
            "cudnn": target.cudnn_version,
            "cudnn_frontend": target.version("nvidia-cudnn-frontend"),
            "dtype": str(dtype).replace("torch.", ""),
            "date": time.strftime("%Y-%m-%d"),
        },
        "results": [],
    }
    for name, lengths in packings(args.packings).items():
        if args.only not in name:
            continue
        for training in (False, True):
            print(f"{name}, {'forward+backward' if training else 'forward'}", flush=True)
            report["results"].append(bench_packing(name, lengths, training, target, device, dtype, args))
            with open(args.out + ".json", "w") as f:  # after each packing, so a cut-short run keeps its rows
                json.dump(report, f, indent=1)
            with open(args.out + ".md", "w") as f:
                f.write(markdown(report))
    if args.into:
        report = merge_into(args.into, report)
    print(markdown(report))


def merge_into(path: str, rerun: dict) -> dict:
    """Replace the packings of ``rerun`` in the report at ``path`` (.json and .md), noting when they ran."""
    report = json.load(open(path + ".json"))
    names = {entry["packing"] for entry in rerun["results"]}
    kept = [entry for entry in report["results"] if entry["packing"] not in names]
    report["results"] = kept + rerun["results"]
    report["meta"].setdefault("reruns", []).append({"packings": sorted(names), **rerun["meta"]})
    with open(path + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(path + ".md", "w") as f:
        f.write(markdown(report))
    return report


if __name__ == "__main__":
    main()

"""Packed (thd) inference on the job: which packed kernel serves a pack fastest, host time included.

    python benchmarks/thd_inference.py --out results/h200_thd_inference    # writes .json and .md
    python benchmarks/thd_inference.py --smoke --out /tmp/thd_inference      # tiny, any device

A loop of steps as a server's prefill runs them: each step a new packing (its boundaries copied to the device, as a
batch arrives), then ``--layers`` calls of :func:`attnselect.attention` on it (a model's layers share one packing),
with both max_seqlen given, under ``torch.no_grad``. Rows: attnselect's default, and the call forced to each packed
candidate (``backend=``, ``pad=``), the same packings for every row, rows interleaved step by step. Per row: the wall
time a call (nothing waits inside a step, one sync at its end: host and GPU overlap as in a model, so a host-bound
kernel shows its host time) and the GPU time a call (CUDA events around the step's calls, a spin ahead so the host
issues them all first). Median over the timed steps, p20..p80.

Packings: 1k to 32k tokens a step, documents of 128..1024 or 32..256 tokens, 16 heads, d_qk/d_v 192/128 (MLA) and
128/128, causal, bf16. Each packing's work bound, ``H * (d_qk + d_v) * sequences * max_seqlen^2`` (the rules' pack
work with every sequence at the longest, :func:`attnselect.choose.rules.pack_work`), is reported beside it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time

import torch

import attnselect
from attnselect import backends
from attnselect.choose.candidates import judge
from attnselect.choose.rules import pack_work
from attnselect.choose.timing import SPIN_CYCLES_PER_MS
from attnselect.spec.options import CallOptions
from attnselect.spec.problem import describe_call
from attnselect.spec.target import Target

HEADS = 16
DEFAULT = "attnselect default"


def packing_lengths(total: int, low: int, high: int, rng: random.Random) -> list[int]:
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(low, high), total - sum(lengths)))
    return lengths


def configurations(smoke: bool) -> list[dict]:
    if smoke:
        return [{"total": 64, "documents": (4, 24), "dims": (16, 8)}]
    return [
        {"total": total, "documents": documents, "dims": dims}
        for dims in ((192, 128), (128, 128))
        for documents in ((128, 1024), (32, 256))
        for total in (1024, 2048, 4096, 8192, 16384, 32768)
    ]


SKIP = {"flex", "reference"}  # flex rebuilds its document mask for every new packing (results/h200_thd_crossover.md)


def _problem(q, k, v, lengths: list[int]):
    """The problem of one step's call, on boundaries made for it."""
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=q.device)
    m = max(lengths)
    return describe_call(
        q, k, v, CallOptions(layout="thd", cu_seqlens_q=cu, causal=True, max_seqlen_q=m, max_seqlen_kv=m)
    )[0]


def rows_for(problem, target) -> dict:
    """{row name: (backend, pad)}: the default, and every supported candidate that packs thd in one call."""
    rows = {DEFAULT: (None, None)}
    for verdict in judge(problem, target):
        backend = backends.get(verdict.candidate.backend)
        if verdict.supported and backend.packs_thd(target) and backend.name not in SKIP:
            rows[str(verdict.candidate)] = (backend.name, verdict.candidate.padded)
    return rows


def run_configuration(config: dict, args, target: Target, device: str, dtype) -> dict:
    d_qk, d_v = config["dims"]
    low, high = config["documents"]
    total = config["total"]
    g = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.randn(total, HEADS, d_qk, device=device, dtype=dtype, generator=g) for _ in range(2))
    v = torch.randn(total, HEADS, d_v, device=device, dtype=dtype, generator=g)
    rng = random.Random(total * 7 + low)
    steps = [packing_lengths(total, low, high, rng) for _ in range(args.warmup + args.steps)]
    rows = rows_for(_problem(q, k, v, steps[0]), target)
    wall = {name: [] for name in rows}
    gpu = {name: [] for name in rows}
    for i, lengths in enumerate(steps):
        for name, (backend, pad) in rows.items() if i % 2 == 0 else reversed(rows.items()):
            ms = _step(q, k, v, lengths, backend, pad, args.layers, device)
            if device == "cuda":  # the same step behind a spin: the GPU's own time
                gpu_ms = _step(q, k, v, lengths, backend, pad, args.layers, device, spin_ms=2 * ms + 1)
            if i >= args.warmup:
                wall[name].append(ms / args.layers * 1e3)
                if device == "cuda":
                    gpu[name].append(gpu_ms / args.layers * 1e3)
    choices = {
        str(attnselect.select(_problem(q, k, v, lengths), target=target).chosen) for lengths in steps[args.warmup :]
    }
    works = [_work(lengths, d_qk, d_v) for lengths in steps[args.warmup :]]
    return {
        "total": total,
        "documents": [low, high],
        "d_qk": d_qk,
        "d_v": d_v,
        "sequences": [min(map(len, steps)), max(map(len, steps))],
        "work": [min(works), max(works)],
        "default_chose": sorted(choices),
        "rows": {name: {"wall_us": _summary(wall[name]), "gpu_us": _summary(gpu[name])} for name in rows},
    }


def _work(lengths, d_qk, d_v) -> float:
    return float(pack_work(HEADS, d_qk, d_v, len(lengths), max(lengths), max(lengths)))


def _step(q, k, v, lengths, backend, pad, layers: int, device: str, *, spin_ms: float | None = None) -> float:
    """One step: the boundaries to the device, ``layers`` calls, one sync; its wall ms. ``spin_ms``: the GPU spins
    that long first, so that the host has issued every call when it ends; the ms between CUDA events around the
    calls (the GPU's time)."""
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    m = max(lengths)
    if spin_ms is not None:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(spin_ms * SPIN_CYCLES_PER_MS))
        begin.record()
    for _ in range(layers):
        attnselect.attention(q, k, v, layout="thd", cu_seqlens_q=cu, causal=True, max_seqlen_q=m, max_seqlen_kv=m,
                             backend=backend, pad=pad)  # fmt: skip
    if spin_ms is not None:
        end.record()
    if device == "cuda":
        torch.cuda.synchronize()
    return begin.elapsed_time(end) if spin_ms is not None else (time.perf_counter() - t0) * 1e3


def _summary(values: list[float]) -> dict | None:
    if not values:
        return None
    ordered = sorted(values)
    pick = lambda p: ordered[min(int(p * len(ordered)), len(ordered) - 1)]  # noqa: E731
    return {"median": statistics.median(values), "p20": pick(0.2), "p80": pick(0.8), "n": len(values)}


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [
        "# Packed (thd) inference on the job: the packed kernels, host time included\n",
        f"{meta['device']}, {meta['date']}; {HEADS} heads, causal, {meta['dtype']}, "
        f"{meta['layers']} calls a step (a model's layers) on a new packing every step, {meta['steps']} timed steps "
        f"after {meta['warmup']}, rows interleaved step by step. Wall: us a call, one sync a step (host and GPU "
        "overlapped); GPU: us a call from events around the step's calls. Median (p20..p80). Work: "
        "H * (d_qk + d_v) * sequences * max_seqlen^2 of the step's packings. Produced by "
        "`benchmarks/thd_inference.py`.\n",
    ]
    for entry in report["results"]:
        lines.append(
            f"## {entry['total']} tokens, documents of {entry['documents'][0]}..{entry['documents'][1]}, "
            f"{entry['d_qk']}/{entry['d_v']}\n"
        )
        lines.append(
            f"Sequences a step: {entry['sequences'][0]}-{entry['sequences'][1]}; work "
            f"{entry['work'][0]:.2g}-{entry['work'][1]:.2g}; the default chose: {', '.join(entry['default_chose'])}.\n"
        )
        lines.append("| row | wall us a call | GPU us a call |")
        lines.append("|---|---|---|")
        ordered = sorted(entry["rows"].items(), key=lambda item: (item[1]["wall_us"] or {}).get("median", 1e18))
        for name, row in ordered:
            lines.append(f"| {name} | {_cell(row['wall_us'])} | {_cell(row['gpu_us'])} |")
        lines.append("")
    return "\n".join(lines)


def _cell(summary: dict | None) -> str:
    if summary is None:
        return "-"
    return f"{summary['median']:.1f} ({summary['p20']:.1f}..{summary['p80']:.1f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="path without extension; .json and .md are written")
    ap.add_argument("--smoke", action="store_true", help="one tiny configuration (CI / CPU)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only-dims", default="", help="e.g. 128/128: only that geometry")
    args = ap.parse_args()
    target = Target.current()
    device = "cuda" if target.is_cuda else "cpu"
    dtype = torch.bfloat16 if target.is_cuda else torch.float32
    report = {
        "meta": {"device": target.describe(), "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
                 "date": time.strftime("%Y-%m-%d"), "layers": args.layers, "steps": args.steps,
                 "warmup": args.warmup},
        "results": [],
    }  # fmt: skip
    with torch.no_grad():
        for config in configurations(args.smoke):
            if args.only_dims and args.only_dims != "/".join(map(str, config["dims"])):
                continue
            entry = run_configuration(config, args, target, device, dtype)
            report["results"].append(entry)
            brief = {key: entry[key] for key in ("total", "documents", "d_qk", "work", "default_chose")}
            brief["wall_us"] = {name: round(row["wall_us"]["median"], 1) for name, row in entry["rows"].items()}
            print(json.dumps(brief), flush=True)
            with open(args.out + ".json", "w") as f:  # after each configuration: a cut-short run keeps its rows
                json.dump(report, f, indent=1)
            with open(args.out + ".md", "w") as f:
                f.write(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()

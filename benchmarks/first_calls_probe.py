"""What a first call costs, split: the process's one-off start-up, a new configuration, a new size of a known one.

    python benchmarks/first_calls_probe.py --out results/h200_first_calls_probe   # a GPU; writes .json and .md

attnselect.choose.first_calls charges a backend's first call of a configuration, and of a new shape, to the
candidate that would pay it. Whether a backend's first call pays once a process (cuDNN's library start-up), once a
configuration (FA4's compile: head dims, mask, phase) or once a size (a cuDNN graph built per shape) decides what
each charge should be; this probe splits them, the calibration keeps them
(attnselect.bench.calibrate.first_call_costs). Each backend runs in a fresh process (FA4 with an empty compile
cache), bshd, 16 heads, causal, bf16, forced through attnselect (``backend=``; training a forward and
``torch.autograd.grad``), and F.sdpa's default dispatch likewise. The calls, in order, each timed as synchronised wall
ms, then a second call of the same:

1. configuration A (128/128) at B1 S1024: the process's first call (start-up, configuration and size);
2. A at B1 S2048, then A at B2 S1536: new sizes of a known configuration;
3. configuration B (64/64) at B1 S1024: a new configuration, the process started;
4. B at B1 S2048: a new size of it.

Through attnselect a first call of a signature the correctness grid does not cover also runs the first-use
self-check (5.80-34.97 ms, results/h200_self_check_cost.md), as a user's does; the calibration measures with it off
(attnselect.bench.calibrate.first_call_costs), so its sizes' costs come out lower. A call's extra is its first time
less the second's. Start-up is call 1's extra less call 3's; size, the largest
extra of the new sizes' calls (a first larger size may load another kernel variant once: the calibration,
attnselect.bench.calibrate.first_call_costs, keeps the least of two). FlashAttention-4's forward replay
(attnselect.backends.flash_attn4_replay) is paused, as in the calibration: a second call would record the first's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BACKENDS = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "cudnn_frontend", "flash_attn4", "F.sdpa default")
CALLS = (  # (label, batch, seqlen, head dim of q/k, of v)
    ("A first", 1, 1024, 128, 128),
    ("A new size", 1, 2048, 128, 128),
    ("A another size", 2, 1536, 128, 128),
    ("B new configuration", 1, 1024, 64, 64),
    ("B new size", 1, 2048, 64, 64),
)
HEADS = 16


def child(backend: str, training: bool) -> dict:
    import torch
    import torch.nn.functional as F

    import attnselect
    from attnselect.backends import flash_attn4_replay

    def call(batch: int, seqlen: int, dqk: int, dv: int) -> float:
        g = torch.Generator(device="cuda").manual_seed(seqlen + dqk)
        q, k, v = (
            torch.randn(batch, seqlen, HEADS, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(
                training
            )
            for d in (dqk, dqk, dv)
        )
        torch.cuda.synchronize()
        started = time.perf_counter()
        if backend == "F.sdpa default":
            bhsd = (t.transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(*bhsd, is_causal=True)
        else:  # FA4's replay paused, as the calibration times its first calls (first_call_costs)
            with flash_attn4_replay.paused():
                out = attnselect.attention(q, k, v, causal=True, backend=backend)
        if training:
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        torch.cuda.synchronize()
        return (time.perf_counter() - started) * 1e3

    torch.zeros(1, device="cuda")  # the CUDA context, which every backend's process pays alike
    torch.cuda.synchronize()
    rows = {}
    for label, *shape in CALLS:
        try:
            first = call(*shape)
            rows[label] = {"first_ms": round(first, 3), "second_ms": round(call(*shape), 3)}
        except Exception as exc:  # a backend that does not serve the shape: reported, the others go on
            rows[label] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return rows


def derived(rows: dict) -> dict:
    """The extras of the calls that ran: start-up, configuration and size, ms."""
    extra = {label: r["first_ms"] - r["second_ms"] for label, r in rows.items() if "first_ms" in r}
    out = {}
    if "B new configuration" in extra:
        out["configuration_ms"] = round(extra["B new configuration"], 3)
        if "A first" in extra:
            out["start_up_ms"] = round(extra["A first"] - extra["B new configuration"], 3)
    sizes = [extra[k] for k in ("A new size", "A another size", "B new size") if k in extra]
    if sizes:
        out["size_ms"] = round(max(sizes), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a backend's process may take")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1] == "training")))
        return
    import torch

    import attnselect
    from attnselect.backends.base import get as backend_named

    target = attnselect.Target.current()
    results = []
    for backend in BACKENDS:
        if backend != "F.sdpa default" and backend_named(backend).target_reasons(target):
            print(backend, "not installed", flush=True)
            continue
        for phase in ("inference", "training"):
            with tempfile.TemporaryDirectory() as cache:  # an empty compile cache: a new user's first run
                env = dict(os.environ, ATTNSELECT_CACHE_DIR=cache)
                for name in ("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"):
                    env.pop(name, None)
                started = time.perf_counter()
                try:
                    done = subprocess.run(
                        [sys.executable, __file__, "--out", a.out, "--child", backend, phase],
                        env=env, capture_output=True, text=True, timeout=a.timeout,
                    )  # fmt: skip
                    rows = (
                        json.loads(done.stdout.strip().splitlines()[-1])
                        if done.returncode == 0
                        else {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
                    )
                except subprocess.TimeoutExpired:
                    rows = {"error": f"over {a.timeout:.0f} s"}
            process_s = time.perf_counter() - started
            row = {"backend": backend, "phase": phase, "process_s": round(process_s, 1), "calls": rows}
            if "error" not in rows:
                row.update(derived(rows))
            results.append(row)
            print(json.dumps(row), flush=True)
    report = {
        "meta": {
            "device": target.describe(),
            "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(),
            "flash_attn4": target.version("flash-attn-4"),
            "cudnn_frontend": target.version("nvidia-cudnn-frontend"),
            "attnselect": attnselect.__version__,
            "date": time.strftime("%Y-%m-%d"),
        },
        "rows": results,
    }
    Path(a.out + ".json").write_text(json.dumps(report, indent=1))
    m = report["meta"]
    lines = [
        "# First calls, split: start-up, a new configuration, a new size\n",
        f"{m['device']}, torch {m['torch']}, cuDNN {m['cudnn']}, flash-attn-4 {m['flash_attn4']}, cudnn-frontend "
        f"{m['cudnn_frontend']}, attnselect {m['attnselect']}, {m['date']}. Each backend in a fresh process; "
        "synchronised wall ms, a first call / the same call again. Produced by `benchmarks/first_calls_probe.py`.\n",
        "| backend | phase | " + " | ".join(label for label, *_ in CALLS) + " | start-up | configuration | size |",
        "|---|---|" + "---|" * (len(CALLS) + 3),
    ]
    for row in results:
        calls = row["calls"]
        if "error" in calls:
            lines.append(f"| {row['backend']} | {row['phase']} | failed: {calls['error'][:120]} |")
            continue
        cells = [
            f"{calls[label]['first_ms']:.1f} / {calls[label]['second_ms']:.2f}"
            if "first_ms" in calls.get(label, {})
            else "failed"
            for label, *_ in CALLS
        ]
        split = [f"{row[k]:.1f}" if k in row else "-" for k in ("start_up_ms", "configuration_ms", "size_ms")]
        lines.append(f"| {row['backend']} | {row['phase']} | " + " | ".join(cells + split) + " |")
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

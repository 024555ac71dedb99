"""Dense calls whose length changes from call to call, first calls included: attnselect against F.sdpa.

    python benchmarks/new_lengths.py --out results/h200_new_lengths   # a GPU; writes .json and .md

PyTorch's cuDNN attention builds a cuDNN graph for every new shape (results/h200_first_calls_probe_40a2f27_fa4.md:
42.4-151.5 ms a new size on the H200), and F.sdpa's default dispatch reaches it there. A server's prefill meets a new
prompt length at most calls; a training loop that pads each batch to its longest meets a new length most steps.
Each workload runs in a fresh process per row (its caches empty, as a new job's; one call at another shape first,
untimed, pays the process's start-up): ``--calls`` calls (``prefill``: B1, inference; ``training``: B4, a forward
and ``torch.autograd.grad``) whose lengths are drawn (seed 0) from ``--lengths`` distinct multiples of 16 between 256
and 4096, bshd, 16 heads, causal, bf16, 192/128; the loop's wall time, then the same calls again (every length
seen). Rows: attnselect's default; attnselect's default after ``attnselect.warmup`` of the configuration at a
length of the loop's range (:data:`WARMUP_LENGTH`: its fastest candidate's configuration paid, so a new length's
build is what is rented around); F.sdpa's default dispatch; F.sdpa inside ``sdpa_kernel`` of the mem-efficient
kernel (no per-shape build); where FlashAttention-4 is installed, attnselect forced to FA4 (its runner replays FA4's
forward from a shape's third call, attnselect.backends.flash_attn4_replay: the first pass's lengths mostly pay FA4's
interface, the second's replay in inference) and FA4's ``flash_attn_func`` called directly (its interface every
call). attnselect's rows log what they chose (its INFO log: decisions and rentals), and their
first calls include the first-use self-check where the correctness grid does not cover the call's signature (what
a user's first calls pay; 5.80-34.97 ms each, results/h200_self_check_cost.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS = ("attnselect default", "attnselect default after warmup()", "F.sdpa default", "F.sdpa mem-efficient")
FA4_ROWS = ("attnselect forced to FA4", "FA4 flash_attn_func")  # where flash_attn.cute imports
WORKLOADS = {"prefill": dict(batch=1, training=False), "training": dict(batch=4, training=True)}
HEADS, DQK, DV = 16, 192, 128
WARMUP_LENGTH = 2056  # in the loop's range, a length it may not meet (not a multiple of 16)


def lengths(count: int, distinct: int) -> list[int]:
    rng = random.Random(0)
    pool = rng.sample(range(256, 4097, 16), distinct)
    return [rng.choice(pool) for _ in range(count)]


def child(row: str, workload: str, count: int, distinct: int) -> dict:
    import logging

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attnselect

    log: dict = {}

    class Counted(logging.Handler):
        def emit(self, record):
            line = record.getMessage()
            line = line[line.find("| ") + 2 :][:160] if "| " in line else line[:160]
            log[line] = log.get(line, 0) + 1

    logging.getLogger("attnselect").addHandler(Counted(logging.INFO))
    logging.getLogger("attnselect").setLevel(logging.INFO)
    spec = WORKLOADS[workload]

    def call(seqlen: int) -> None:
        q, k, v = (
            torch.randn(spec["batch"], seqlen, HEADS, d, device="cuda", dtype=torch.bfloat16).requires_grad_(
                spec["training"]
            )
            for d in (DQK, DQK, DV)
        )
        if row == "attnselect forced to FA4":
            out = attnselect.attention(q, k, v, causal=True, backend="flash_attn4")
        elif row.startswith("attnselect"):
            out = attnselect.attention(q, k, v, causal=True)
        elif row == "FA4 flash_attn_func":
            from flash_attn.cute import flash_attn_func

            out = flash_attn_func(q, k, v, causal=True)
            out = out[0] if isinstance(out, tuple) else out  # (out, lse)
        else:
            bhsd = [t.transpose(1, 2) for t in (q, k, v)]
            if row == "F.sdpa default":
                out = F.scaled_dot_product_attention(*bhsd, is_causal=True)
            else:
                with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                    out = F.scaled_dot_product_attention(*bhsd, is_causal=True)
        if spec["training"]:
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    call(128)  # the process's start-up, at a length the loop never meets
    if row == "attnselect default after warmup()":  # the fastest candidate's configuration paid before the job, at a
        # length of the loop's range, where the loop's fastest candidate ranks first (at 128 the mem-efficient kernel,
        # which the start-up call ran, does): its later new lengths rent that kernel's build per shape alone
        length, dtype = WARMUP_LENGTH, torch.bfloat16
        problem = attnselect.AttentionProblem(spec["batch"], length, length, HEADS, HEADS, DQK, DV, dtype=dtype,
                                              mask="causal", training=spec["training"])  # fmt: skip
        attnselect.warmup([problem])
    torch.cuda.synchronize()
    sequence = lengths(count, distinct)
    passes = []
    for _ in range(2):
        started = time.perf_counter()
        for seqlen in sequence:
            call(seqlen)
        torch.cuda.synchronize()
        passes.append(time.perf_counter() - started)
    return {"first_pass_s": round(passes[0], 4), "second_pass_s": round(passes[1], 4), "log": log}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--lengths", type=int, default=100, help="distinct lengths the calls draw from")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--rows", action="append", default=[], help="run only these rows (repeatable)")
    ap.add_argument("--workloads", action="append", default=[], choices=list(WORKLOADS), help="run only these")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.calls, a.lengths)))
        return
    import torch

    import attnselect

    target = attnselect.Target.current()
    results = []
    try:
        import flash_attn.cute  # noqa: F401

        rows = ROWS + FA4_ROWS
    except ImportError:
        rows = ROWS
    rows = [row for row in rows if not a.rows or row in a.rows]
    for workload in a.workloads or WORKLOADS:
        for row in rows:
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, ATTNSELECT_CACHE_DIR=cache)
                command = [sys.executable, __file__, "--out", a.out, "--calls", str(a.calls), "--lengths",
                           str(a.lengths), "--child", row, workload]  # fmt: skip
                try:
                    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=a.timeout)
                    found = (
                        json.loads(done.stdout.strip().splitlines()[-1])
                        if done.returncode == 0
                        else {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
                    )
                except subprocess.TimeoutExpired:
                    found = {"error": f"over {a.timeout:.0f} s"}
            results.append({"workload": workload, "row": row, **found})
            print(json.dumps({k: v for k, v in results[-1].items() if k != "log"}), flush=True)
    meta = {
        "device": target.describe(),
        "torch": torch.__version__,
        "attnselect": attnselect.__version__,
        "calls": a.calls,
        "distinct_lengths": a.lengths,
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(a.out + ".json").write_text(json.dumps({"meta": meta, "rows": results}, indent=1))
    lines = [
        "# Dense calls of ever new lengths, first calls included\n",
        f"{meta['device']}, {meta['date']}. {a.calls} calls drawn from {a.lengths} lengths (256-4096), 16 heads, "
        "192/128, causal, bf16, each row in a fresh process; seconds for the loop, then for the same calls again. "
        "Produced by `benchmarks/new_lengths.py` (method in its docstring).\n",
        "| workload | row | first pass (s) | second pass (s) |",
        "|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['row']} | failed: {r['error'][:100]} | |")
        else:
            lines.append(f"| {r['workload']} | {r['row']} | {r['first_pass_s']:.4f} | {r['second_pass_s']:.4f} |")
    for r in results:
        if r.get("log"):
            lines += ["", f"{r['workload']}, {r['row']}: attnselect's log (line: times)", ""]
            lines += [f"- {line}: {n}" for line, n in sorted(r["log"].items(), key=lambda x: -x[1])[:8]]
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Where a packed training step's time goes: attnselect's choice against the same kernel forced and called directly.

    python benchmarks/packed_overhead.py --out results/h200_packed_overhead    # CUDA; writes .json and .md

One process, the short-chat-turn packings of benchmarks/training_loop.py (MLA 16 heads, 192/128, 32k tokens,
a new packing every step, both max_seqlen given). For every row, in interleaved rounds: the host time of the
forward call (enqueue, no sync), and the wall time of a forward+backward step (one sync). Rows: attnselect's
default, the default with FlashAttention-4 disabled, each of the two packed kernels forced, and both kernels
called directly (FA4's flash_attn_varlen_func; the cuDNN frontend through attnselect's backend object, which
is what the forced row runs after its choice). The gap between a forced row and its direct call is
attnselect's per-call host cost; a gap between the default and the forced row of its choice is a choice
that differs or is made again.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attnselect  # noqa: E402
import training_loop  # noqa: E402
from attnselect import backends  # noqa: E402
from attnselect.backends.shape_cache import bucketed  # noqa: E402
from attnselect.execution import kernel_call  # noqa: E402
from attnselect.spec.options import CallOptions, Packing  # noqa: E402
from attnselect.spec.problem import describe_call  # noqa: E402


def rows(q, k, v):
    def through(**options):
        return lambda cu, m: attnselect.attention(
            q, k, v, layout="thd", cu_seqlens_q=cu, causal=True, max_seqlen_q=m, max_seqlen_kv=m, **options
        )

    out = {
        "attnselect default": through(),
        "default, FA4 disabled": through(disable=("flash_attn4",)),
        "cudnn_frontend forced": through(backend="cudnn_frontend", pad=False),
    }
    problem, _ = describe_call(
        q,
        k,
        v,
        CallOptions(
            layout="thd",
            cu_seqlens_q=torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device),
            causal=True,
            max_seqlen_q=q.shape[0],
            max_seqlen_kv=q.shape[0],
        ),
    )
    call = kernel_call(problem)
    frontend = backends.get("cudnn_frontend")
    buckets = frontend.shape_cache.buckets  # as attnselect runs it: boundaries bucketed (few cuDNN graphs)
    out["cudnn_frontend backend object"] = lambda cu, m: frontend.run_packed(
        q, k, v, call, bucketed(Packing(cu, cu, m, m, cu, cu), buckets)
    )[0]
    fa4 = training_loop._fa4()
    if fa4 is not None:
        out["flash_attn4 forced"] = through(backend="flash_attn4", pad=False)
        out["FA4 called directly"] = lambda cu, m: fa4(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m, causal=True
        )[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    device, dtype = "cuda", torch.bfloat16
    tokens, heads = training_loop.TOKENS, training_loop.HEADS
    g = torch.Generator(device=device).manual_seed(0)
    q, k = (
        torch.randn(tokens, heads, training_loop.D_QK, device=device, dtype=dtype, generator=g).requires_grad_()
        for _ in range(2)
    )
    v = torch.randn(tokens, heads, training_loop.D_V, device=device, dtype=dtype, generator=g).requires_grad_()
    grad_out = torch.randn(tokens, heads, training_loop.D_V, device=device, dtype=dtype, generator=g)
    spec = training_loop.DISTRIBUTIONS["short chat turns"]
    loop = training_loop.packings(spec, tokens, a.steps)
    candidates = rows(q, k, v)
    host = {name: [] for name in candidates}
    step = {name: [] for name in candidates}
    for round_ in range(a.rounds + 1):  # round 0 warms every row (choices, graphs, compiles) and is not kept
        for name, attend in candidates.items():
            for lengths in loop:
                cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).to(device)
                m = max(lengths)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = attend(cu, m)
                t1 = time.perf_counter()
                torch.autograd.grad(out, (q, k, v), grad_out)
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                if round_:
                    host[name].append((t1 - t0) * 1e6)
                    step[name].append((t2 - t0) * 1e3)
    report = {
        "meta": {
            "device": attnselect.Target.current().describe(),
            "date": time.strftime("%Y-%m-%d"),
            "steps": a.steps,
            "rounds": a.rounds,
        },
        "rows": {
            name: {
                "forward_host_us": statistics.median(host[name]),
                "forward_host_us_p20_p80": statistics.quantiles(host[name], n=5)[::3],
                "step_ms": statistics.median(step[name]),
                "step_ms_p20_p80": statistics.quantiles(step[name], n=5)[::3],
            }
            for name in candidates
        },
    }
    lines = [
        "# Packed step: attnselect against the kernels it runs\n",
        f"{report['meta']['device']}, {report['meta']['date']}. Short chat turns (benchmarks/training_loop.py), "
        f"MLA 16 heads 192/128, 32k tokens, a new packing every step, both max_seqlen given; {a.steps} steps x "
        f"{a.rounds} rounds after one of warm-up, rows interleaved by round, one process. Produced by "
        "`benchmarks/packed_overhead.py`.\n",
        "| row | forward host us (p20..p80) | fwd+bwd step ms (p20..p80) |",
        "|---|---|---|",
    ]
    for name, r in report["rows"].items():
        lo, hi = r["forward_host_us_p20_p80"]
        slo, shi = r["step_ms_p20_p80"]
        lines.append(
            f"| {name} | {r['forward_host_us']:.0f} ({lo:.0f}..{hi:.0f}) | {r['step_ms']:.2f} ({slo:.2f}..{shi:.2f}) |"
        )
    Path(a.out + ".json").write_text(json.dumps(report, indent=1))
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

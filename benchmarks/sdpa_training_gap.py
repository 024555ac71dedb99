"""Why attnselect's ``sdpa_cudnn`` trains slower than F.sdpa's default dispatch, which reaches the same cuDNN kernel.

    python benchmarks/sdpa_training_gap.py --out results/h100_sdpa_training_gap   # a GPU; writes .json and .md

The size ladder's small dense training rungs (benchmarks/ladder.py: bshd tensors, 16 heads, causal, bf16, a forward
and ``torch.autograd.grad`` of q, k, v against a fixed output gradient) at B1 S1k 192/128 and 128/128, where
results/h100_ladder_small_509a3ed_fa4.md and the H200's ladders time F.sdpa's default 1.04-1.6x faster than
attnselect forced to ``sdpa_cudnn``. Rows: F.sdpa's default dispatch on the transposed views (the ladder's row);
attnselect.attention(backend="sdpa_cudnn"); ``torch.ops.aten._scaled_dot_product_cudnn_attention.default`` called on
the transposed views (the op attnselect calls, through the op overload where attnselect calls torch's own binding of
it, ``torch._scaled_dot_product_cudnn_attention``). Each row's fwd+bwd is timed with a sync per call (``--calls``
calls, ``--rounds`` rounds in alternating order, median ms), then profiled once: its CUDA kernels by name with their
GPU time, so a difference in what runs on the GPU (another kernel, a copy) shows by name.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attnselect

SHAPES = ((1, 1024, 192, 128), (1, 1024, 128, 128))
HEADS = 16


def rows_for(q, k, v):
    op = torch.ops.aten._scaled_dot_product_cudnn_attention.default
    views = lambda: tuple(t.transpose(1, 2) for t in (q, k, v))  # noqa: E731
    return {
        "F.sdpa default": lambda: F.scaled_dot_product_attention(*views(), is_causal=True).transpose(1, 2),
        "attnselect sdpa_cudnn": lambda: attnselect.attention(q, k, v, causal=True, backend="sdpa_cudnn"),
        "aten cudnn op on the views": lambda: op(*views(), None, True, 0.0, True)[0].transpose(1, 2),
    }


def step(fn, q, k, v, grad):
    out = fn()
    return torch.autograd.grad(out, (q, k, v), grad)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    report = {"device": attnselect.Target.current().describe(), "date": time.strftime("%Y-%m-%d"), "shapes": []}
    produced = ". Produced by `benchmarks/sdpa_training_gap.py` (method in its docstring)."
    lines = [
        "# attnselect's sdpa_cudnn against F.sdpa's default in training",
        "",
        f"{report['device']}, {report['date']}{produced}",
        "",
    ]
    for b, s, d_qk, d_v in SHAPES:
        torch.manual_seed(0)
        q, k = (torch.randn(b, s, HEADS, d_qk, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "qk")
        v = torch.randn(b, s, HEADS, d_v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(b, s, HEADS, d_v, device="cuda", dtype=torch.bfloat16)
        rows = rows_for(q, k, v)
        times = {name: [] for name in rows}
        for fn in rows.values():
            for _ in range(5):
                step(fn, q, k, v, grad)
        torch.cuda.synchronize()
        for r in range(a.rounds):
            for name in list(rows)[:: 1 if r % 2 == 0 else -1]:
                for _ in range(a.calls):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    step(rows[name], q, k, v, grad)
                    torch.cuda.synchronize()
                    times[name].append((time.perf_counter() - start) * 1e3)
        entry = {"shape": f"B{b} S{s} {d_qk}/{d_v}", "ms": {}, "kernels": {}}
        lines += [f"## bshd B{b} S{s} H{HEADS} {d_qk}/{d_v} causal bf16 training", ""]
        lines += ["| row | ms a call (quartiles) |", "|---|---|"]
        for name, ts in times.items():
            qs = statistics.quantiles(ts, n=4)
            entry["ms"][name] = {"median": statistics.median(ts), "q1": qs[0], "q3": qs[2], "n": len(ts)}
            lines.append(f"| {name} | {statistics.median(ts):.4f} ({qs[0]:.4f}..{qs[2]:.4f}) |")
        for name, fn in rows.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step(fn, q, k, v, grad)
                torch.cuda.synchronize()
            kernels = {}
            for e in prof.key_averages():
                if e.device_type == torch.autograd.DeviceType.CUDA and e.count:
                    us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                    kernels[e.key[:150]] = [e.count // 3, round(us / 3, 1)]
            entry["kernels"][name] = kernels
            lines += ["", f"{name}: CUDA kernels a call (count, GPU us)", ""]
            lines += [f"- {n}: {c}, {us}" for n, (c, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])]
        lines.append("")
        report["shapes"].append(entry)
        print("\n".join(lines[-40:]), flush=True)
    Path(a.out + ".json").write_text(json.dumps(report, indent=1))
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

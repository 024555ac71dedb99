"""FlashAttention-4's dense forward replayed (attnselect.backends.flash_attn4_replay) against FA4's flash_attn_func.

    python benchmarks/fa4_forward_replay.py [--calls 200] [--repeats 21] [--out results/h100_fa4_forward_replay]

On a GPU with flash-attn-4 installed, per dense inference shape (bf16, causal, 16 heads unless said): whether the
replay is recorded, whether its output (and log-sum-exp) equal flash_attn_func's bit for bit, and its error against
a float64 reference; then host time per call, timed as benchmarks/hot_path.py times its rows (calls from an empty
queue, interleaved rounds in alternating order; the column with the sync shows a GPU-bound row's GPU time):
FA4's flash_attn_func called directly, attnselect.attention forced to FA4 (its memo lookup and the replay), FA4's
runner as attnselect binds it with the replay and without, and F.scaled_dot_product_attention's default dispatch on
contiguous (B, H, S, D) copies.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import attnselect  # noqa: E402
from attnselect import backends  # noqa: E402
from attnselect.backends import flash_attn4_replay  # noqa: E402
from attnselect.execution import kernel_call  # noqa: E402
from hot_path import time_rows, write_report  # noqa: E402

SHAPES = (  # (batch, seqlen, heads_q, heads_kv, d_qk, d_v, return_lse)
    (1, 256, 16, 16, 192, 128, False),
    (1, 1024, 16, 16, 192, 128, False),
    (1, 4096, 16, 16, 192, 128, False),
    (4, 1024, 16, 16, 192, 128, False),
    (1, 1024, 16, 16, 128, 128, True),
    (1, 1024, 16, 4, 128, 128, False),
)


def _rows(q, k, v, return_lse: bool) -> tuple[dict, dict]:
    import flash_attn.cute as fa4

    scale = q.shape[-1] ** -0.5
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, causal=True, return_lse=return_lse)
    backend, call = backends.get("flash_attn4"), kernel_call(problem)
    recorded = []
    record = flash_attn4_replay.record

    def watched(*args):
        result = record(*args)
        recorded.append(result[1])
        return result

    flash_attn4_replay.record = watched
    try:
        replayed = backend.runner(call)
        replayed(q, k, v)
    finally:
        flash_attn4_replay.record = record
    kept = flash_attn4_replay.replays
    flash_attn4_replay.replays = lambda *args: None
    try:
        plain = backend.runner(call)
    finally:
        flash_attn4_replay.replays = kept
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    rows = {
        "attnselect.attention, FA4 forced": lambda: attnselect.attention(
            q, k, v, causal=True, return_lse=return_lse, backend="flash_attn4", pad=False
        ),
        "FA4 flash_attn_func, called directly": lambda: fa4.flash_attn_func(
            q, k, v, softmax_scale=scale, causal=True, return_lse=return_lse
        ),
        "FA4 runner, replayed": lambda: replayed(q, k, v),
        "FA4 runner, not replayed": lambda: plain(q, k, v),
    }
    if q.shape[2] == k.shape[2]:
        rows["F.sdpa default (bhsd copies)"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    direct = fa4.flash_attn_func(q, k, v, softmax_scale=scale, causal=True, return_lse=return_lse)
    again = replayed(q, k, v)
    reference = attnselect.attention(*(t.double() for t in (q, k, v)), causal=True, backend="reference")
    checks = {
        "recorded": recorded[-1] is not None if recorded else False,
        "out bit for bit": bool(torch.equal(again[0], direct[0])),
        "lse bit for bit": bool(torch.equal(again[1], direct[1])) if return_lse else None,
        "relative error against float64": float(
            (again[0].double() - reference).norm() / reference.norm().clamp_min(1e-30)
        ),
    }
    return rows, checks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--out")
    a = ap.parse_args()
    target = attnselect.Target.current()
    lines = ["# FlashAttention-4's dense forward replayed against its flash_attn_func", "",
             f"{target.describe()}. Produced by `benchmarks/fa4_forward_replay.py` (method in its docstring); "
             "host us per call: median (quartiles) over the rounds; inference, causal, bf16.", ""]  # fmt: skip
    report = {"target": target.describe(), "shapes": []}
    with torch.no_grad():
        for b, s, hq, hkv, dqk, dv, return_lse in SHAPES:
            q, k = (torch.randn(b, s, h, dqk, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv))
            v = torch.randn(b, s, hkv, dv, device="cuda", dtype=torch.bfloat16)
            rows, checks = _rows(q, k, v, return_lse)
            timed = time_rows(rows, "cuda", a.calls, a.repeats)
            name = f"B{b} S{s} H{hq}/{hkv} {dqk}/{dv}" + (" return_lse" if return_lse else "")
            report["shapes"].append({"shape": name, "checks": checks, "rows": timed})
            lines += [f"## {name}", "", ", ".join(f"{k}: {v}" for k, v in checks.items()), "",
                      "| row | host us per call | with the sync | attnselect minus this row, host us |",
                      "|---|---|---|---|"]  # fmt: skip
            for i, (row, t) in enumerate(timed.items()):
                d = t["first_minus_this"]
                minus = f"{d['median']:+.1f} ({d['q1']:+.1f}..{d['q3']:+.1f})" if i else ""
                host = f"{t['us']:.1f} ({t['q1']:.1f}..{t['q3']:.1f})"
                lines.append(f"| {row} | {host} | {t['synced_us']:.1f} | {minus} |")
            lines.append("")
    write_report(a.out, report, lines)


if __name__ == "__main__":
    main()

"""FlashAttention-4's forward replayed (attnselect.backends.flash_attn4_replay) against FA4's own functions.

    python benchmarks/fa4_forward_replay.py [--calls 200] [--repeats 21] [--out results/h100_fa4_forward_replay]

On a GPU with flash-attn-4 installed, inference, bf16, causal: per dense shape (16 heads unless said) and per
packing (the size ladder's first packings of 2048 and 8192 tokens, 192/128, called again and again as the layers of
a step share one), whether the replay was recorded, whether its output (and log-sum-exp) equal FA4's
flash_attn_func's (flash_attn_varlen_func's) bit for bit, dense: its error against a float64 reference; then host
time per call, timed as benchmarks/hot_path.py times its rows (calls from an empty queue, interleaved rounds in
alternating order; the column with the sync shows a GPU-bound row's GPU time): attnselect.attention forced to FA4
(its memo lookup and the replay), FA4's function called directly, FA4's runner as attnselect binds it with the
replay and without, and, dense, F.scaled_dot_product_attention's default dispatch on contiguous (B, H, S, D) copies.
The host times are what a host-bound loop pays a call; where the GPU's time is longer, the replay's saving hides
behind it (the column with the sync).
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


def _runners(call, packed: bool) -> tuple:
    """FA4's runner for ``call`` as attnselect binds it, with the replay (recording into the list returned) and
    without."""
    backend = backends.get("flash_attn4")
    bind = backend.packed_runner if packed else backend.runner
    recorded, record, replays = [], flash_attn4_replay.record, flash_attn4_replay.replays

    def watched(*args):
        result = record(*args)
        recorded.append(result[1])
        return result

    flash_attn4_replay.record = watched
    flash_attn4_replay.replays = lambda *args, **kwargs: None
    try:
        plain = bind(call, repeated=True)
    finally:
        flash_attn4_replay.replays = replays
    replayed = bind(call, repeated=True)
    return replayed, plain, recorded, lambda: setattr(flash_attn4_replay, "record", record)


def _checks(again, direct, recorded: list, return_lse: bool, reference=None) -> dict:
    checks = {
        "recorded": bool(recorded) and recorded[-1] is not None,
        "out bit for bit": bool(torch.equal(again[0], direct[0])),
        "lse bit for bit": bool(torch.equal(again[1], direct[1].float())) if return_lse else None,
    }
    if reference is not None:
        error = (again[0].double() - reference).norm() / reference.norm().clamp_min(1e-30)
        checks["relative error against float64"] = float(error)
    return checks


def _rows(q, k, v, return_lse: bool) -> tuple[dict, dict]:
    import flash_attn.cute as fa4

    scale = q.shape[-1] ** -0.5
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, causal=True, return_lse=return_lse)
    replayed, plain, recorded, restore = _runners(kernel_call(problem), packed=False)
    try:
        replayed(q, k, v)
        replayed(q, k, v)  # the shape's second call: recorded
    finally:
        restore()
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
    fresh = [torch.randn_like(t) for t in (q, k, v)]  # the replay on other data than it was recorded on
    again = replayed(*fresh)
    direct = fa4.flash_attn_func(*fresh, softmax_scale=scale, causal=True, return_lse=return_lse)
    reference = attnselect.attention(*(t.double() for t in fresh), causal=True, backend="reference")
    return rows, _checks(again, direct, recorded, return_lse, reference)


def _packed_rows(tokens: int, return_lse: bool) -> tuple[dict, dict, str]:
    """A packing of ``tokens`` (the size ladder's first, 192/128) called again and again, as the layers of a step
    share it: attnselect forced to FA4 and FA4's flash_attn_varlen_func."""
    import flash_attn.cute as fa4

    from attnselect.spec.options import Packing
    from ladder import packing_lengths

    lengths = packing_lengths(tokens, 1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    longest, scale = max(lengths), 192**-0.5
    q, k = (torch.randn(tokens, 16, 192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(tokens, 16, 128, device="cuda", dtype=torch.bfloat16)
    problem = attnselect.AttentionProblem(len(lengths), longest, longest, 16, 16, 192, 128, layout="thd",
                                          mask="causal", return_lse=return_lse, dtype=torch.bfloat16,
                                          tokens=tokens)  # fmt: skip
    packing = Packing(cu, cu, longest, longest, cu, cu)
    replayed, plain, recorded, restore = _runners(kernel_call(problem), packed=True)
    try:
        replayed(q, k, v, packing)
        replayed(q, k, v, packing)  # the packing's second call: recorded
    finally:
        restore()
    options = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
    rows = {
        "attnselect.attention, FA4 forced": lambda: attnselect.attention(
            q,
            k,
            v,
            layout="thd",
            cu_seqlens_q=cu,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
            causal=True,
            return_lse=return_lse,
            backend="flash_attn4",
            pad=False,
        ),
        "FA4 flash_attn_varlen_func, called directly": lambda: fa4.flash_attn_varlen_func(
            q, k, v, softmax_scale=scale, causal=True, return_lse=return_lse, **options
        ),
        "FA4 runner, replayed": lambda: replayed(q, k, v, packing),
        "FA4 runner, not replayed": lambda: plain(q, k, v, packing),
    }
    # the replay on other data and boundaries (the same count and longest) than it was recorded on
    fresh = [torch.randn_like(t) for t in (q, k, v)]
    other = torch.tensor([0, *torch.tensor(lengths[::-1]).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    again = replayed(*fresh, Packing(other, other, longest, longest, other, other))
    direct = fa4.flash_attn_varlen_func(*fresh, softmax_scale=scale, causal=True, return_lse=return_lse,
                                        **dict(options, cu_seqlens_q=other, cu_seqlens_k=other))  # fmt: skip
    name = f"thd {tokens} tokens ({len(lengths)} sequences, longest {longest}) 192/128"
    return rows, _checks(again, direct, recorded, return_lse), name


def _section(name: str, checks: dict, timed: dict) -> list[str]:
    """One case's part of the report: its checks, then its rows' host times."""
    lines = [f"## {name}", "", ", ".join(f"{k}: {v}" for k, v in checks.items()), "",
             "| row | host us per call | with the sync | attnselect minus this row, host us |",
             "|---|---|---|---|"]  # fmt: skip
    for i, (row, t) in enumerate(timed.items()):
        d = t["first_minus_this"]
        minus = f"{d['median']:+.1f} ({d['q1']:+.1f}..{d['q3']:+.1f})" if i else ""
        lines.append(f"| {row} | {t['us']:.1f} ({t['q1']:.1f}..{t['q3']:.1f}) | {t['synced_us']:.1f} | {minus} |")
    return [*lines, ""]


def _cases():
    """(rows, checks, name) of each dense shape, then of each packing, made as they are timed."""
    for b, s, hq, hkv, dqk, dv, return_lse in SHAPES:
        q, k = (torch.randn(b, s, h, dqk, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv))
        v = torch.randn(b, s, hkv, dv, device="cuda", dtype=torch.bfloat16)
        yield (*_rows(q, k, v, return_lse), f"B{b} S{s} H{hq}/{hkv} {dqk}/{dv}" + (" return_lse" if return_lse else ""))
    for tokens in (2048, 8192):
        yield _packed_rows(tokens, False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--out")
    a = ap.parse_args()
    target = attnselect.Target.current()
    lines = ["# FlashAttention-4's forward replayed against its own functions", "",
             f"{target.describe()}. Produced by `benchmarks/fa4_forward_replay.py` (method in its docstring); "
             "host us per call: median (quartiles) over the rounds; inference, causal, bf16.", ""]  # fmt: skip
    report = {"target": target.describe(), "shapes": []}
    with torch.no_grad():
        for rows, checks, name in _cases():
            timed = time_rows(rows, "cuda", a.calls, a.repeats)
            report["shapes"].append({"shape": name, "checks": checks, "rows": timed})
            lines += _section(name, checks, timed)
    write_report(a.out, report, lines)


if __name__ == "__main__":
    main()

"""Where attnselect's packed FlashAttention-4 calls lose time against ``flash_attn_varlen_func`` called directly.

    python benchmarks/fa4_packed_gap.py --out results/h200_fa4_packed_gap      # a GPU with FA4 installed

The size ladder's packed rungs (benchmarks/ladder.py) put FA4 forced through attnselect at 0.42 ms a call where FA4
called directly took 0.15 (2048 tokens, a new packing each call, 192/128 inference, latency), and 0.196 against 0.110
in a stack of 8 layers sharing each step's packing. This takes the ladder's packings (2048 tokens, or
``--tokens``; lognormal documents, H16, 192/128 bf16, causal, inference, or with ``--training`` each call's
backward too, ``torch.autograd.grad``) and times, per call (``latency``: a sync after each; ``stack``: 8
calls a packing, one sync), these rows in alternating order:

- FA4 called directly, as the ladder calls it (``causal=True`` and both max_seqlen);
- FA4 called directly with the keyword arguments attnselect's backend passes (``_options``);
- the backend's packed kernel alone (``packed_runner(call)``: the options bound, no lookup);
- attnselect.attention forced to FA4, with the self-check on as by default, and with ``ATTNSELECT_SELF_CHECK=0``;
- attnselect.attention as it chooses;

each on a new packing per call (``new``) and on one packing repeated (``same``). Then, for every row on new
packings, the host's time to return and the time to the sync after it, with Python's collector on and off, and for
attnselect's rows the stages of attention()'s path timed in place (:data:`STAGES`); and a cProfile of the direct,
the forced and the default row on new packings, by own time. Writes ``--out``.json and .md.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import time
from pathlib import Path

import torch

import attnselect
from attnselect import api, backends, dispatch, self_check
from attnselect.execution import kernel_call
from attnselect.spec.options import Packing
from ladder import packing_lengths

HEADS, D_QK, D_V, LAYERS = 16, 192, 128, 8
TOKENS = [2048]  # --tokens


def packings(count: int, start: int) -> list:
    out = []
    for turn in range(start, start + count):
        lengths = packing_lengths(TOKENS[0], turn)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        out.append((cu, max(lengths)))
    return out


# What attention() calls on a new packing's path (attnselect.api), each timed where the wrapper replaces it.
STAGES = (
    (api, "recall"), (api, "select_packed"), (api, "packed_runner"), (self_check, "needed"),
    (dispatch.Unknown, "remember"), (api.first_calls, "ran"),
)  # fmt: skip


def attribute(rows: dict, turn: int, calls: int) -> tuple[dict, int]:
    """{row: {part: median us a call}}: each row on ``calls`` new packings, a sync before each call, the host's time
    to return and the time to the sync after it, with Python's collector on and off; for attnselect's rows the
    stages of attention()'s path (:data:`STAGES`) timed in place, its own code and the kernel's run the rest."""
    spent: dict = {}

    def timed(owner, name):
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return real(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0) + time.perf_counter_ns() - start

        return real, wrapper

    out = {}
    for row, fn in rows.items():
        parts = {}
        for collector in (True, False):
            new = packings(calls, turn)
            turn += calls
            host, synced = [], []
            gc.collect()
            gc.enable() if collector else gc.disable()
            try:
                for cu, m in new:
                    torch.cuda.synchronize()
                    start = time.perf_counter_ns()
                    fn(cu, m)
                    returned = time.perf_counter_ns()
                    torch.cuda.synchronize()
                    host.append((returned - start) / 1e3)
                    synced.append((time.perf_counter_ns() - start) / 1e3)
            finally:
                gc.enable()
            tag = "" if collector else ", collector off"
            parts[f"host, to return{tag}"] = statistics.median(host)
            parts[f"to the sync{tag}"] = statistics.median(synced)
        if row.startswith("attnselect"):
            spent.clear()
            wrapped = [(owner, name, *timed(owner, name)) for owner, name in STAGES]
            for owner, name, _, wrapper in wrapped:
                setattr(owner, name, wrapper)
            new = packings(calls, turn)
            turn += calls
            try:
                torch.cuda.synchronize()
                start = time.perf_counter_ns()
                for cu, m in new:
                    fn(cu, m)
                whole = time.perf_counter_ns() - start
                torch.cuda.synchronize()
            finally:
                for owner, name, real, _ in wrapped:
                    setattr(owner, name, real)
            for name, ns in spent.items():
                parts[f"stage {name} (mean)"] = ns / calls / 1e3
            parts["all calls, stages timed (mean)"] = whole / calls / 1e3
        out[row] = parts
    return out, turn


def _with_backward(fn, inputs: tuple, grad_out):
    """``fn`` followed by the gradients of its output (the first of a tuple) with respect to ``inputs``."""

    def step(cu, m):
        out = fn(cu, m)
        return torch.autograd.grad(out[0] if isinstance(out, tuple) else out, inputs, grad_out)

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--attribute-calls", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=TOKENS[0], help="tokens a packing (the ladder's packed rungs)")
    ap.add_argument("--training", action="store_true", help="each call a forward and its backward (autograd.grad)")
    a = ap.parse_args()
    from flash_attn.cute import flash_attn_varlen_func

    TOKENS[0] = a.tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(a.tokens, HEADS, D_QK, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    v = torch.randn(a.tokens, HEADS, D_V, device="cuda", dtype=torch.bfloat16, generator=g)
    grad_out = torch.randn(a.tokens, HEADS, D_V, device="cuda", dtype=torch.bfloat16, generator=g)
    for t in (q, k, v):
        t.requires_grad_(a.training)
    first_cu, first_m = packings(1, 1)[0]
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, layout="thd", cu_seqlens_q=first_cu, causal=True,
                                                       max_seqlen_q=first_m, max_seqlen_kv=first_m)  # fmt: skip
    backend = backends.get("flash_attn4")
    call = kernel_call(problem)
    options = backend._options(call, 1, 1)
    kernel = backend.packed_runner(call, repeated=True)
    checks = [0]
    real_check = self_check.check
    self_check.check = lambda *args, **kw: checks.__setitem__(0, checks[0] + 1) or real_check(*args, **kw)

    def forced(cu, m):
        return attnselect.attention(q, k, v, layout="thd", cu_seqlens_q=cu, max_seqlen_q=m, max_seqlen_kv=m,
                                    causal=True, backend="flash_attn4")  # fmt: skip

    def forced_unchecked(cu, m):
        os.environ["ATTNSELECT_SELF_CHECK"] = "0"
        try:
            return forced(cu, m)
        finally:
            del os.environ["ATTNSELECT_SELF_CHECK"]

    rows = {
        "FA4 direct, the ladder's arguments": lambda cu, m: flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m, causal=True),
        "FA4 direct, attnselect's options": lambda cu, m: flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m, **options),
        "the backend's packed kernel alone": lambda cu, m: kernel(q, k, v, Packing(cu, cu, m, m, cu, cu)),
        "attnselect forced to FA4": forced,
        "attnselect forced to FA4, ATTNSELECT_SELF_CHECK=0": forced_unchecked,
        "attnselect default": lambda cu, m: attnselect.attention(q, k, v, layout="thd", cu_seqlens_q=cu,
                                                                 max_seqlen_q=m, max_seqlen_kv=m, causal=True),
    }  # fmt: skip
    if a.training:  # the backward too, as a training step takes it
        rows = {row: _with_backward(fn, (q, k, v), grad_out) for row, fn in rows.items()}
    with torch.enable_grad() if a.training else torch.no_grad():
        for fn in rows.values():  # compiles, first checks
            for cu, m in packings(3, 1):
                fn(cu, m)
        torch.cuda.synchronize()
        warm_checks = checks[0]
        times = {(way, kind, row): [] for way in ("latency", "stack") for kind in ("new", "same") for row in rows}
        turn = 1000
        for r in range(a.rounds):
            for row, fn in rows.items() if r % 2 == 0 else reversed(rows.items()):
                for kind in ("new", "same"):
                    new = packings(a.calls, turn)
                    turn += a.calls
                    for cu, m in new if kind == "new" else [new[0]] * a.calls:
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        fn(cu, m)
                        torch.cuda.synchronize()
                        times[("latency", kind, row)].append((time.perf_counter() - start) * 1e3)
                    new = packings(a.calls, turn)
                    turn += a.calls
                    for cu, m in new if kind == "new" else [new[0]] * a.calls:
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        for _ in range(LAYERS):
                            fn(cu, m)
                        torch.cuda.synchronize()
                        times[("stack", kind, row)].append((time.perf_counter() - start) * 1e3 / LAYERS)
        timed_checks = checks[0] - warm_checks
        attributed, turn = attribute(rows, turn, a.attribute_calls)
        profiles = {}
        for row in ("FA4 direct, the ladder's arguments", "attnselect forced to FA4", "attnselect default"):
            new = packings(a.calls, turn)
            turn += a.calls
            profiler = cProfile.Profile()
            profiler.enable()
            for cu, m in new:
                rows[row](cu, m)
            torch.cuda.synchronize()
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
            profiles[row] = text.getvalue()
    meta = {"device": attnselect.Target.current().describe(), "date": time.strftime("%Y-%m-%d"),
            "options": {key: repr(value) for key, value in options.items()}, "self_checks_timed": timed_checks,
            "self_checks_warm": warm_checks, "calls": a.calls, "rounds": a.rounds}  # fmt: skip
    lines = ["# attnselect's packed FA4 calls against FA4 called directly\n",
             f"{meta['device']}, {meta['date']}. Produced by `benchmarks/fa4_packed_gap.py` (method in its docstring): "
             f"{a.tokens} tokens, H{HEADS}, {D_QK}/{D_V} bf16, causal, {'training' if a.training else 'inference'}; "
             f"ms a call, median (quartiles) over "
             f"{a.rounds} rounds of {a.calls}. attnselect's options: {meta['options']}. Self-checks run while timed: "
             f"{timed_checks} (warm-up: {warm_checks}).\n"]  # fmt: skip
    for way in ("latency", "stack"):
        for kind in ("new", "same"):
            lines += [f"## {way}, {'a new packing each call' if kind == 'new' else 'one packing repeated'}\n",
                      "| row | ms a call |", "|---|---|"]  # fmt: skip
            for row in rows:
                t = sorted(times[(way, kind, row)])
                q1, q3 = t[len(t) // 4], t[3 * len(t) // 4]
                lines.append(f"| {row} | {statistics.median(t):.4f} ({q1:.4f}..{q3:.4f}) |")
            lines.append("")
    lines += [f"## Where a new packing's call goes, {a.attribute_calls} calls a row (us)\n"]
    for row, parts in attributed.items():
        lines += [f"{row}:\n", "| part | us a call |", "|---|---|"]
        lines += [f"| {part} | {us:.1f} |" for part, us in parts.items()]
        lines.append("")
    for row, text in profiles.items():
        lines += [f"## cProfile, {row}, {a.calls} new packings (own time)\n", "```", text.strip(), "```", ""]
    Path(a.out + ".md").write_text("\n".join(lines))
    Path(a.out + ".json").write_text(json.dumps({"meta": meta, "times": {" | ".join(key): t for key, t in
                                                                          times.items()}, "attributed": attributed},
                                                indent=1))  # fmt: skip
    print("\n".join(lines[:60]))


if __name__ == "__main__":
    main()

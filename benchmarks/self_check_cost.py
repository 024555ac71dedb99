"""What the first-use self-check (attnselect.self_check) costs a call, on the GPU, by size.

    python benchmarks/self_check_cost.py --out results/h200_self_check_cost     # writes .json and .md (a GPU)

For each case (the default choice, as a user's call gets it) the kernel is warmed first. Then, five times over,
the decision memo is cleared (attnselect.clear_cache) and one call runs its slow path with the check off
(ATTNSELECT_SELF_CHECK=0), then once more with it on (=all, the checked-signature set emptied), and a memoized call
runs ten times. Synchronised wall time; training cases time forward and backward. The check's cost is the
difference of the two first calls, paired within a repetition: median and range over the five.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

# name: (layout, batch, seqlen, heads, d_qk, d_v, training); causal, bf16, H K/V heads = H
CASES = {
    "dense B1 S256 H16 192/128 inference": ("bshd", 1, 256, 16, 192, 128, False),
    "dense B1 S256 H16 192/128 training": ("bshd", 1, 256, 16, 192, 128, True),
    "dense B4 S1024 H16 192/128 inference": ("bshd", 4, 1024, 16, 192, 128, False),
    "dense B4 S1024 H16 192/128 training": ("bshd", 4, 1024, 16, 192, 128, True),
    "dense B32 S1024 H16 128/128 training": ("bshd", 32, 1024, 16, 128, 128, True),
    "dense B1 S8192 H16 192/128 training": ("bshd", 1, 8192, 16, 192, 128, True),
    "dense B1 S32768 H16 192/128 training": ("bshd", 1, 32768, 16, 192, 128, True),
    "packed 8 x 1024 tokens H16 192/128 training": ("thd", 8, 1024, 16, 192, 128, True),
    "packed 8 x 1024 tokens H16 192/128 inference": ("thd", 8, 1024, 16, 192, 128, False),
}


def _case(name: str, repeats: int, device: str) -> dict:
    import torch

    import attnselect
    from attnselect import self_check

    layout, batch, seqlen, heads, dqk, dv, training = CASES[name]
    g = torch.Generator(device=device).manual_seed(0)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    kwargs = {"causal": True}
    if layout == "thd":
        tokens = batch * seqlen
        shapes = [(tokens, heads, dqk), (tokens, heads, dqk), (tokens, heads, dv)]
        cu = torch.arange(0, tokens + 1, seqlen, dtype=torch.int32, device=device)
        kwargs.update(layout="thd", cu_seqlens_q=cu, max_seqlen_q=seqlen, max_seqlen_kv=seqlen)
    else:
        shapes = [(batch, seqlen, heads, dqk), (batch, seqlen, heads, dqk), (batch, seqlen, heads, dv)]
    q, k, v = (
        torch.randn(s, device=device, dtype=torch.bfloat16, generator=g).requires_grad_(training) for s in shapes
    )
    dout = None

    def call() -> float:
        nonlocal dout
        sync()
        t0 = time.perf_counter()
        out = attnselect.attention(q, k, v, **kwargs)
        if training:
            dout = torch.ones_like(out) if dout is None else dout
            torch.autograd.grad(out, (q, k, v), dout)
        sync()
        return (time.perf_counter() - t0) * 1e3

    os.environ["ATTNSELECT_SELF_CHECK"] = "0"
    for _ in range(3):  # compiles, graph builds
        call()
    chosen = str(attnselect.select(attnselect.AttentionProblem.from_tensors(q, k, v, **kwargs)).chosen)
    off, on = [], []
    for _ in range(repeats):
        attnselect.clear_cache()
        os.environ["ATTNSELECT_SELF_CHECK"] = "0"
        off.append(call())
        attnselect.clear_cache()
        self_check._PASSED.clear()
        os.environ["ATTNSELECT_SELF_CHECK"] = "all"
        on.append(call())
    os.environ["ATTNSELECT_SELF_CHECK"] = "0"
    steady = statistics.median(call() for _ in range(10))
    cost = sorted(b - a for a, b in zip(off, on))
    return {
        "case": name,
        "chosen": chosen,
        "first_call_ms_check_off": statistics.median(off),
        "first_call_ms_check_on": statistics.median(on),
        "check_ms_median": statistics.median(cost),
        "check_ms_min": cost[0],
        "check_ms_max": cost[-1],
        "memoized_call_ms": steady,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", action="append", help="a case name's substring (repeatable)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to try the script")
    a = ap.parse_args()
    import torch

    import attnselect

    target = attnselect.Target.current(a.device)
    rows = []
    for name in CASES:
        if a.only and not any(s in name for s in a.only):
            continue
        try:
            row = _case(name, a.repeats, a.device)
        except Exception as exc:  # a case that cannot run here is reported, not hidden
            row = {"case": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        if a.device == "cuda":
            torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        rows.append(row)
    meta = {"device": target.describe(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    Path(a.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        "# The first-use self-check's cost on the GPU\n",
        f"{meta['device']}, {meta['date']}. Produced by `benchmarks/self_check_cost.py`: the "
        f"first call of a signature after the memo is cleared, with ATTNSELECT_SELF_CHECK=0 and =all, paired over "
        f"{a.repeats} repetitions (the check's cost: median [min, max]), beside a memoized call. Synchronised wall "
        "ms; training is forward and backward; causal, bf16.\n",
        "| case | chosen | first call, check off | first call, check on | check costs | memoized call |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error'][:100]} | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {r['chosen']} | {r['first_call_ms_check_off']:.2f} | {r['first_call_ms_check_on']:.2f} "
            f"| {r['check_ms_median']:.2f} [{r['check_ms_min']:.2f}, {r['check_ms_max']:.2f}] "
            f"| {r['memoized_call_ms']:.3f} |"
        )
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

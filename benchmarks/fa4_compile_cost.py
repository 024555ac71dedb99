"""What FlashAttention-4's compile-on-first-use costs a configuration, with and without its disk cache.

    python benchmarks/fa4_compile_cost.py --out results/h200_fa4_compile     # writes .json and .md (a GPU with FA4)

Each configuration runs through attnselect with the flash_attn4 backend forced, in three fresh processes:
the first with an empty compile cache (attnselect's default, under ATTNSELECT_CACHE_DIR), the second with
that cache filled by the first, the third with the cache switched off. Each process times its first call
(compiles or loads, then runs), and the median of five later calls (runs only), synchronised wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {
    "dense 192/128 causal, fwd+bwd (B2 S1024 H16)": dict(layout="bshd", dqk=192, dv=128, training=True),
    "packed 192/128 causal, fwd+bwd (4096 tokens, 5 sequences, H16)": dict(
        layout="thd", dqk=192, dv=128, training=True
    ),
}


def child(config: dict) -> dict:
    import torch

    import attnselect

    g = torch.Generator(device="cuda").manual_seed(0)
    if config["layout"] == "thd":
        shapes = [(4096, 16, config["dqk"]), (4096, 16, config["dqk"]), (4096, 16, config["dv"])]
        cu = torch.tensor([0, 100, 1100, 1200, 3000, 4096], dtype=torch.int32, device="cuda")
        kwargs = dict(layout="thd", cu_seqlens_q=cu, max_seqlen_q=1800, max_seqlen_kv=1800)
    else:
        shapes = [(2, 1024, 16, config["dqk"]), (2, 1024, 16, config["dqk"]), (2, 1024, 16, config["dv"])]
        kwargs = {}
    q, k, v = (
        torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(config["training"])
        for s in shapes
    )

    def call():
        out = attnselect.attention(q, k, v, causal=True, backend="flash_attn4", **kwargs)
        if config["training"]:
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        torch.cuda.synchronize()

    torch.cuda.synchronize()
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"first_ms": times[0], "later_ms": statistics.median(times[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(CONFIGS[a.child])))
        return
    import torch

    import attnselect

    target = attnselect.Target.current()
    rows = []
    for name in CONFIGS:
        with tempfile.TemporaryDirectory() as cache:
            row = {"config": name}
            for mode in ("cold cache", "warm cache", "cache off"):
                env = {k: v for k, v in os.environ.items() if not k.startswith("FLASH_ATTENTION_CUTE_DSL_CACHE")}
                env["ATTNSELECT_CACHE_DIR"] = cache
                if mode == "cache off":
                    env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "0"
                done = subprocess.run(
                    [sys.executable, __file__, "--out", a.out, "--child", name], env=env, capture_output=True, text=True
                )
                row[mode] = (
                    json.loads(done.stdout.strip().splitlines()[-1])
                    if done.returncode == 0
                    else {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
                )
                print(name, mode, row[mode], flush=True)
            rows.append(row)
    report = {
        "meta": {
            "device": target.name,
            "torch": torch.__version__,
            "flash_attn4": target.version("flash-attn-4"),
            "date": time.strftime("%Y-%m-%d"),
        },
        "rows": rows,
    }
    Path(a.out + ".json").write_text(json.dumps(report, indent=1))
    lines = [
        "# FlashAttention-4: the cost of a configuration's first call\n",
        f"{report['meta']['device']}, torch {report['meta']['torch']}, flash-attn-4 {report['meta']['flash_attn4']}, "
        f"{report['meta']['date']}. First call and the median of five later ones, synchronised wall ms, each in "
        "a fresh process. Produced by `benchmarks/fa4_compile_cost.py`.\n",
        "| configuration | cold cache: first / later | warm cache: first / later | cache off: first / later |",
        "|---|---|---|---|",
    ]
    for row in rows:
        cells = [
            f"{r['first_ms']:.0f} / {r['later_ms']:.2f}" if "first_ms" in r else f"failed: {r['error'][:80]}"
            for r in (row["cold cache"], row["warm cache"], row["cache off"])
        ]
        lines.append(f"| {row['config']} | " + " | ".join(cells) + " |")
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

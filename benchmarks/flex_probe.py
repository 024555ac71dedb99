"""Which feature of a call makes flex's compile fail: the call, then one change at a time, each in a fresh process.

    python benchmarks/flex_probe.py --out results/h200_flex_probe     # writes .json and .md (a GPU)
    python benchmarks/flex_probe.py --only softcap --out results/h200_flex_probe_softcap_training

The first call is the peer sweep's (benchmarks/peer_sweep.py) FlashAttention-3 case that flex failed to compile on
the H200 with "LoweringException: RuntimeError: unbacked_bindings": test_flash_attn_varlen_output[d256 dv256 128x217
mha local(99,73) float16 softcap15 fwd], thd, 9 sequences, two of them with no key. The variants named "softcap
..." start from a FlashAttention-2 case that flex raised on in training (SWEEP_CASE below).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

BASE = dict(
    cu_q=[0, 122, 235, 348, 459, 582, 693, 816, 943, 1053],
    cu_kv=[0, 0, 214, 416, 619, 817, 817, 1018, 1232, 1232],
    heads=6, d=256, dtype="float16", window=[99, 73], softcap=15.0, causal=False, max_seqlen=True, lse=True,
    training=False, another_total=False, before=(), patch=None, dense=False,
)  # fmt: skip
VARIANTS = {
    "the call": {},
    "bfloat16": dict(dtype="bfloat16"),
    "no softcap": dict(softcap=None),
    "no window": dict(window=None),
    "no empty key sequence": dict(cu_kv=[0, 107, 214, 416, 619, 817, 917, 1018, 1125, 1232]),
    "head dim 128": dict(d=128),
    "max_seqlen not given": dict(max_seqlen=False),
    "no lse": dict(lse=False),
    "causal window": dict(window=[99, 0], causal="bottom_right"),
    "training": dict(training=True),
    # Packed flex compiles with dynamic=None: a second token total makes the totals dynamic. These run one call of
    # another total first (the last sequence dropped), as a process with several packings does.
    "after another total": dict(another_total=True),
    "after another total, no softcap": dict(another_total=True, softcap=None),
    "after another total, no window": dict(another_total=True, window=None),
    "after another total, no empty key sequence": dict(
        another_total=True, cu_kv=[0, 107, 214, 416, 619, 817, 917, 1018, 1125, 1232]
    ),
    "after another total, bfloat16": dict(another_total=True, dtype="bfloat16"),
    "after another total, no lse": dict(another_total=True, lse=False),
    "after another total, head dim 128": dict(another_total=True, d=128, softcap=None),
    # A process that has compiled flex for other head dims: torch.compile's automatic dynamic shapes may then make
    # the head dim symbolic too (the peer sweep's and the GPU tests' processes had run many flex configurations).
    "after head dims 64 and 128": dict(before=[dict(d=64, softcap=None), dict(d=128, softcap=None)]),
    "after head dims 64 and 128, training": dict(
        training=True, before=[dict(d=64, softcap=None, training=True), dict(d=128, softcap=None, training=True)]
    ),
    "after head dims 64 and 128 and another total": dict(
        another_total=True, before=[dict(d=64, softcap=None), dict(d=128, softcap=None)]
    ),
}
# The peer sweep's FlashAttention-2 case that flex raised on in one worker (2026-12-03, without FA4):
# test_flash_attn_varlen_output[d128 2048x2048 mha none float16 softcap50], training, 4 sequences. That worker had
# run packed flex at two other totals before it (an inference call with the same softcap, a training call at head
# dim 64), so its totals were dynamic. `patch` tries a change to the backend: "mark_dynamic" marks the totals
# dynamic from a process's first packed call, "static" compiles every total (dynamic=False).
SWEEP_CASE = dict(
    cu_q=[0, 2032, 4067, 6103, 8136], cu_kv=[0, 2032, 4072, 6119, 8155], heads=4, d=128, dtype="float16",
    window=None, softcap=50.0, causal=False, training=True,
)  # fmt: skip
SHORTER = dict(cu_q=[0, 455, 1062], cu_kv=[0, 455, 1062])
VARIANTS.update({
    "softcap training": SWEEP_CASE,
    "softcap training after another total": dict(SWEEP_CASE, another_total=True),
    "softcap training after another total, no softcap": dict(SWEEP_CASE, another_total=True, softcap=None),
    "softcap inference after another total": dict(SWEEP_CASE, another_total=True, training=False),
    "softcap training after the worker's packed calls": dict(
        SWEEP_CASE, before=[dict(training=False, d=96), dict(SHORTER, d=64, softcap=None)]
    ),
    "softcap training after another total, totals marked dynamic": dict(
        SWEEP_CASE, another_total=True, patch="mark_dynamic"
    ),
    "softcap training after another total, every total compiled": dict(SWEEP_CASE, another_total=True, patch="static"),
})  # fmt: skip
# A second softcap in the process: FA3's thd training case with softcap 15 (test_flash_attn_varlen_output[d64 dv64
# 256x256 mha causal bfloat16 softcap15 unused]) before SWEEP_CASE, as in the peer sweep's workers at 942d778.
# "floats_symbolic" compiles as torch does by default (a float seen with a second value traced as symbolic); the
# backend compiles floats as constants (specialize_float). Dense calls compile with dynamic=False, floats constant
# either way: their rows are the control.
OTHER_SOFTCAP = dict(SHORTER, d=64, softcap=15.0, dtype="bfloat16", causal=True)
VARIANTS.update({
    "after softcap 15: softcap training": dict(SWEEP_CASE, before=[OTHER_SOFTCAP]),
    "after softcap 15: softcap training, floats symbolic": dict(
        SWEEP_CASE, before=[OTHER_SOFTCAP], patch="floats_symbolic"
    ),
    "after softcap 15: softcap training, same head dim and dtype before, floats symbolic": dict(
        SWEEP_CASE, before=[dict(OTHER_SOFTCAP, d=128, dtype="float16", causal=False)], patch="floats_symbolic"
    ),
    "after softcap 15: scale alone changed before, floats symbolic": dict(
        SWEEP_CASE, before=[dict(OTHER_SOFTCAP, softcap=50.0)], patch="floats_symbolic"
    ),
    "after softcap 15: dense softcap training": dict(SWEEP_CASE, dense=True, before=[dict(OTHER_SOFTCAP, dense=True)]),
    "after softcap 15: dense softcap training, floats symbolic": dict(
        SWEEP_CASE, dense=True, before=[dict(OTHER_SOFTCAP, dense=True)], patch="floats_symbolic"
    ),
})  # fmt: skip


def child(spec: dict) -> dict:
    import torch

    import attnselect

    if spec["patch"]:
        _patch_backend(spec["patch"])
    dtype = getattr(torch, spec["dtype"])
    first = None
    for earlier in spec["before"]:  # other configurations first, in this process
        child(dict(spec, **earlier, another_total=False, before=()))
    if spec["another_total"]:  # the same call without its last sequence, first
        first = child(dict(spec, cu_q=spec["cu_q"][:-1], cu_kv=spec["cu_kv"][:-1], another_total=False, before=()))[
            "status"
        ]
    g = torch.Generator(device="cuda").manual_seed(0)
    tq, tkv = spec["cu_q"][-1], spec["cu_kv"][-1]
    q = torch.randn(tq, spec["heads"], spec["d"], device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(tkv, spec["heads"], spec["d"], device="cuda", dtype=dtype, generator=g) for _ in range(2))
    for t in (q, k, v):
        t.requires_grad_(spec["training"])
    cu = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    lengths = lambda c: max(b - a for a, b in zip(c[:-1], c[1:]))  # noqa: E731
    kwargs = dict(layout="thd", cu_seqlens_q=cu(spec["cu_q"]), cu_seqlens_kv=cu(spec["cu_kv"]),
                  window=tuple(spec["window"]) if spec["window"] else None, softcap=spec["softcap"],
                  causal=spec["causal"], return_lse=spec["lse"])  # fmt: skip
    if spec["max_seqlen"]:
        kwargs.update(max_seqlen_q=lengths(spec["cu_q"]), max_seqlen_kv=lengths(spec["cu_kv"]))
    if spec["dense"]:  # one sequence of the packing's total, bshd
        q, k, v = (t.detach().unsqueeze(0).requires_grad_(spec["training"]) for t in (q, k, v))
        kwargs = dict(layout="bshd", window=kwargs["window"], softcap=spec["softcap"], causal=spec["causal"],
                      return_lse=spec["lse"])  # fmt: skip
    started = time.perf_counter()
    try:
        out = attnselect.attention(q, k, v, backend="flex", **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        if spec["training"]:
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        torch.cuda.synchronize()
        status = "ok"
    except Exception as exc:
        status = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        frames = traceback.extract_tb(exc.__traceback__)[-8:]  # compiled or eager: where it was raised
        status += " [" + " < ".join(f"{Path(f.filename).name}:{f.name}" for f in reversed(frames)) + "]"
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    if breaks:
        status += f" ({breaks} graph breaks)"
    if first is not None:
        status = f"first total: {first}; second total: {status}"
    return {"status": status, "seconds": round(time.perf_counter() - started, 1)}


def _patch_backend(patch: str) -> None:
    """Flex compiled otherwise than the backend does: packed totals marked dynamic at once or static, or floats
    symbolic."""
    import torch

    from attnselect.backends import flex as backend

    compiled = backend._compiled_flex
    if patch == "floats_symbolic":  # torch's default: a float seen with a second value becomes symbolic
        settings = backend._recompile_settings
        backend._recompile_settings = lambda: {k: v for k, v in settings().items() if k != "specialize_float"}
        return
    if patch == "static":
        backend._compiled_flex = lambda dynamic: compiled(False)
        return

    def marked(dynamic):
        fn = compiled(dynamic)
        if dynamic is not None:
            return fn

        def call(q, k, v, **options):
            for t in (q, k, v):
                torch._dynamo.mark_dynamic(t, 2)
            return fn(q, k, v, **options)

        return call

    backend._compiled_flex = marked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", help="run the variants whose name starts with this")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(dict(BASE, **VARIANTS[a.child]))))
        return
    import torch

    import attnselect

    procs = {
        name: subprocess.Popen(
            [sys.executable, __file__, "--out", a.out, "--child", name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for name in VARIANTS
        if not a.only or name.startswith(a.only)
    }
    rows = []
    for name, proc in procs.items():
        stdout, stderr = proc.communicate()
        lines = stdout.strip().splitlines()
        result = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"status": f"died: {stderr[-300:]}"}
        rows.append({"variant": name, "change": VARIANTS[name], **result})
        print(json.dumps(rows[-1]), flush=True)
    meta = {"device": attnselect.Target.current().describe(), "torch": torch.__version__, "date": time.strftime("%F")}
    Path(a.out + ".json").write_text(json.dumps({"meta": meta, "base": BASE, "rows": rows}, indent=1))
    lines = [
        "# flex on peer-sweep calls, one change at a time\n",
        f"{meta['device']}, {meta['date']}. Produced by `benchmarks/flex_probe.py` (each variant in a fresh process, "
        "flex forced).\n",
        "| variant | status | seconds |",
        "|---|---|---|",
    ]
    lines += [f"| {r['variant']} | {r['status'][:200]} | {r.get('seconds', '')} |" for r in rows]
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Where a repeated dense call's host time goes: attention() with parts of its memo lookup taken out, side by side.

    python benchmarks/hot_path_parts.py [--baseline OLD_dispatch.py] [--parts 2] [--out results/h200_hot_path_parts]

The dense case of benchmarks/hot_path.py (CUDA: B1 S256 H16 192/128 inference bf16 on the chosen kernel, in its own
layout; CPU: a tiny float32 call), timed as hot_path.py times its rows (calls from an empty queue, interleaved
rounds in alternating order): attention() as it is; with ``--baseline``, attention() on another version of
``dispatch.py`` whose ``recall`` takes ``(q, k, v, options)`` as this one's does (an earlier commit's, to compare
two versions in one process, on one host phase); attention() on copies of this ``dispatch.py`` with one more part
of its lookup taken out in each row (the tensors' storage offsets, their nested flags, the thread
and settings state); attention() on a fixed known call (no lookup at all: its frame
and the runner); F.sdpa's default dispatch; and the prepared runner alone. Each row's difference from the first is
what that part costs inside the call, where the kernel's own host work leaves the lookup's code and data cold.

The copies without a part are for timing only: without it a call can be served a runner prepared for another one.
Each replacement asserts that the code it removes is still there, so the script fails when dispatch.py changes.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

import attnselect
from attnselect import api, dispatch
from hot_path import dense_inputs, time_rows, write_report

# The parts of dispatch.recall's check taken out, cumulatively (the source text and what replaces it).
PARTS = (
    ("storage offsets", "offsets = (q.storage_offset(), k.storage_offset(), v.storage_offset())",
     "offsets = (0, 0, 0)"),
    ("nested flags", "if q.is_nested or k.is_nested or v.is_nested or (sinks is not None and sinks.is_nested):",
     "if False:"),
    ("thread and settings state", "_grad(), _deterministic(), _function_mode(),\n"
     "            _no_environment() or _environment(), _cache_dir(), _scope(),", ""),
)  # fmt: skip


def memo_module(name: str, source: str, replacements=()) -> types.ModuleType:
    """A separate copy of a dispatch.py source (its own memo), with ``replacements`` made."""
    for old, new in replacements:
        if old not in source:
            raise SystemExit(f"dispatch.py no longer holds {old!r}: update PARTS")
        source = source.replace(old, new)
    module = types.ModuleType(name)
    sys.modules[name] = module  # as an imported module is
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


def attention_on(recall, known_call) -> types.FunctionType:
    """attention() whose memo lookup is ``recall`` (with its ``KnownCall`` class)."""
    scope = dict(api.__dict__, recall=recall, KnownCall=known_call)
    fn = types.FunctionType(api.attention.__code__, scope, "attention", None, api.attention.__closure__)
    fn.__kwdefaults__ = dict(api.attention.__kwdefaults__)
    return fn


def rows_for(device: str, baseline: str | None) -> tuple[dict, str]:
    q, k, v, layout, chosen = dense_inputs(device)
    expected = attnselect.attention(q, k, v, layout=layout)
    call = functools.partial  # every row one call of it: no row pays for a Python frame of its own
    rows = {"attention()": call(attnselect.attention, q, k, v, layout=layout)}
    variants = []
    if baseline:
        variants.append((f"attention() on {Path(baseline).name}", memo_module("baseline", Path(baseline).read_text())))
    source = Path(dispatch.__file__).read_text()
    for i in range(len(PARTS)):
        name = "attention() without " + ", ".join(part for part, *_ in PARTS[: i + 1])
        variants.append((name, memo_module(f"without_{i}", source, [r for _, *r in PARTS[: i + 1]])))
    for name, module in variants:
        fn = attention_on(module.recall, module.KnownCall)
        if not torch.equal(fn(q, k, v, layout=layout), expected):
            raise SystemExit(f"{name}: another result")
        rows[name] = call(fn, q, k, v, layout=layout)
    known = dispatch.known_calls()[-1]
    fixed = attention_on(lambda *arguments: known, type(known))
    rows["attention() on a fixed known call (no lookup)"] = call(fixed, q, k, v, layout=layout)
    if not chosen.padded and chosen.backend.startswith("sdpa_"):
        rows["F.scaled_dot_product_attention, default dispatch"] = call(F.scaled_dot_product_attention, q, k, v)
    rows["attnselect's prepared runner alone"] = call(known.runner, q, k, v)
    return rows, f"{attnselect.AttentionProblem.from_tensors(q, k, v, layout=layout).describe()}: {chosen}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="another version of src/attnselect/dispatch.py to time beside this one")
    ap.add_argument("--parts", type=int, default=2, help="timings of all rows, one after another")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--out", help="write .json and .md here")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    meta = {"device": attnselect.Target.current().describe(), "date": time.strftime("%Y-%m-%d")}
    lines = [
        "# Hot path: where a repeated dense call's host time goes\n",
        f"{meta['device']}, {meta['date']}. Produced by `benchmarks/hot_path_parts.py`: each row timed as "
        f"{a.calls} calls from an empty queue, {a.repeats} interleaved rounds in alternating order; median host us "
        "per call (quartiles) and the first row minus each row, the median of the per-round differences "
        "(quartiles). Rows without a part of the lookup are for timing only.\n",
    ]
    report = {"meta": meta, "parts": []}
    with torch.no_grad():
        rows, case = rows_for(device, a.baseline)
        lines.append(f"## {case}\n")
        for part in range(a.parts):
            timed = time_rows(rows, device, a.calls, a.repeats)
            report["parts"].append({name: {key: r[key] for key in ("us", "q1", "q3", "first_minus_this")}
                                    for name, r in timed.items()})  # fmt: skip
            lines += [f"\nTiming {part + 1} of {a.parts}:\n", "| row | host us per call | first row minus this |",
                      "|---|---|---|"]  # fmt: skip
            for name, r in timed.items():
                d = r["first_minus_this"]
                diff = "" if name == "attention()" else f"{d['median']:+.2f} ({d['q1']:+.2f}..{d['q3']:+.2f})"
                lines.append(f"| {name} | {r['us']:.1f} ({r['q1']:.1f}..{r['q3']:.1f}) | {diff} |")
    write_report(a.out, report, lines)


if __name__ == "__main__":
    main()

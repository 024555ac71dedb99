"""Where torch's packed FlashAttention-2 (varlen_fa2) stops beating the cuDNN frontend on packs of equal head dims,
and which count of a pack's work, known to the host without reading its lengths, tells the two apart.

    python benchmarks/pack_crossover.py --out OUT [--tokens 4096 8192 ...] [--packings 8] [--rounds 3]
    python benchmarks/pack_crossover.py --device cpu --smoke --out OUT   # the method on the CPU, sdpa kernels

For packings of the size ladder's kind (benchmarks/ladder.py's ``packing_lengths``: lognormal documents, seeded) at
each ``--tokens``, and packs of equal documents (``--equal``: lengths that fill 16k tokens), 16 heads, ``--dims``
(default 128/128), causal, bf16, each of the two backends is forced through attention() and timed per packing, in
training (forward and backward) and inference: a ``stack`` of 8 layers on one packing (a model's step: the host
queues ahead of the GPU), and one call alone (``latency``), wall time synchronised, each on a fresh copy of the
boundaries (the same values: a cache keyed by rounded sizes, as the frontend's graphs, is not missed as a job's new
packings may miss it; benchmarks/ladder.py times those). Every packing is run once untimed first (the kernels'
compiles and graph caches are a job's first steps', not its steady state), then ``--rounds`` rounds alternate the
backends' order; a row holds the median. ``--seed-from`` draws other packings (a check of bounds fitted on earlier
ones).

Each packing's row holds three counts of its work, H * (d_qk + d_v) times: ``count`` (every sequence at the longest,
capped at T^2: what the "small training pack" rule compares), ``estimate`` (the longest plus the rest of the tokens
shared evenly: attnselect.choose.predict.rest_lengths, what the "small pack" rule compares) and ``exact`` (the sum
of each sequence's; the host cannot know it without a sync). For each count, the report gives the bound that loses
the least time when each packing goes to varlen_fa2 at or below it and to the frontend above it (for each way, and
for both), and what each such policy and attnselect's own rule lose against each packing's faster backend.

Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

import attnselect  # noqa: E402
from ladder import boundaries, packing_lengths  # noqa: E402

HEADS = 16
LAYERS = 8
COUNTS = ("count", "estimate", "exact")


def works(lengths: list[int], dims: tuple[int, int]) -> dict:
    """The pack's three work counts (see the module docstring): the rules' own count and estimate of the pack as a
    call describes it (attnselect.choose.rules), and its exact work."""
    from attnselect.choose import rules

    longest = max(lengths)
    problem = attnselect.AttentionProblem(len(lengths), longest, longest, HEADS, HEADS, *dims, layout="thd",
                                          mask="causal", tokens=sum(lengths))  # fmt: skip
    return {"count": rules._work(problem), "estimate": rules._pack_estimate(problem, None),
            "exact": rules.pack_work(HEADS, *dims, 1, 1, 1) * sum(n * n for n in lengths)}  # fmt: skip


def packs(
    tokens_list: list[int], packings: int, equal: list[int], equal_tokens: int, seed_from: int = 1
) -> list[tuple[str, list[int]]]:
    """(kind, lengths) of every packing timed."""
    found = [(f"ladder {t}", packing_lengths(t, seed)) for t in tokens_list
             for seed in range(seed_from, seed_from + packings)]  # fmt: skip
    found += [(f"equal {n}", [n] * max(equal_tokens // n, 1)) for n in equal]
    return found


class Layer:
    """One packing's tensors and a call of one backend on them."""

    def __init__(self, lengths: list[int], dims: tuple[int, int], device: str, training: bool):
        g = torch.Generator(device=device).manual_seed(0)
        total = sum(lengths)
        self.q, self.k, self.v = (
            torch.randn(total, HEADS, d, device=device, dtype=torch.bfloat16, generator=g).requires_grad_(training)
            for d in (dims[0], dims[0], dims[1])
        )
        self.grad = torch.randn(total, HEADS, dims[1], device=device, dtype=torch.bfloat16, generator=g)
        self.cu, self.longest = boundaries(lengths, device)
        self.training = training

    def step(self, backend: str, layers: int) -> None:
        cu = self.cu.clone()  # a fresh tensor (per-tensor caches see a new packing) of the same values
        kw = dict(layout="thd", cu_seqlens_q=cu, max_seqlen_q=self.longest, max_seqlen_kv=self.longest, causal=True)
        outs = [attnselect.attention(self.q, self.k, self.v, backend=backend, **kw) for _ in range(layers)]
        if self.training:
            torch.autograd.backward(outs, [self.grad] * layers)
            self.q.grad = self.k.grad = self.v.grad = None


def timed(layer: Layer, backend: str, layers: int, sync) -> float:
    """ms a layer, wall time synchronised."""
    sync()
    start = time.perf_counter()
    layer.step(backend, layers)
    sync()
    return (time.perf_counter() - start) * 1e3 / layers


def measure(args) -> list[dict]:
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rows = []
    for training in (True, False):
        for kind, lengths in packs(args.tokens, args.packings, args.equal, args.equal_tokens, args.seed_from):
            layer = Layer(lengths, tuple(args.dims), args.device, training)
            for backend in args.backends:  # untimed: compiles and graph caches
                layer.step(backend, 1)
            times = {(b, way): [] for b in args.backends for way in ("stack", "latency")}
            for r in range(args.rounds):
                for backend in args.backends if r % 2 == 0 else args.backends[::-1]:
                    times[(backend, "stack")].append(timed(layer, backend, LAYERS, sync))
                    times[(backend, "latency")].append(timed(layer, backend, 1, sync))
            row = {"phase": "training" if training else "inference", "kind": kind, "tokens": sum(lengths),
                   "sequences": len(lengths), "longest": max(lengths), **works(lengths, tuple(args.dims)),
                   "ms": {f"{b} {way}": statistics.median(v) for (b, way), v in times.items()}}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


WAYS = ("stack", "latency")


def scored(rows: list[dict], goes_low, low: str, high: str) -> dict:
    """{way: {"lost": ms, "best": ms, "worst": ratio}} when each packing ``goes_low(row)`` picks runs ``low`` and the
    others ``high``: the time lost over the packings against each packing's faster kernel, that least time, and the
    largest ratio of a packing's time to its faster one's."""
    found = {}
    for way in WAYS:
        got = [(r["ms"][f"{low if goes_low(r) else high} {way}"], min(r["ms"][f"{b} {way}"] for b in (low, high)))
               for r in rows]  # fmt: skip
        found[way] = {"lost": sum(g - b for g, b in got), "best": sum(b for _, b in got),
                      "worst": max(g / b for g, b in got)}  # fmt: skip
    return found


def at_most(count: str, bound: float):
    return lambda row: row[count] <= bound


def small_pack_rules(row: dict, training: bool) -> bool:
    """The "small pack" refinement (the estimate up to rules.SMALL_PACK_HEAD_TOKENS query rows x heads, else the count,
    at most rules.SMALL_PACK_WORK) or, in training, the "small training pack" one (the count at most
    rules.SMALL_TRAINING_PACK_WORK): the tables' own tests for varlen_fa2 before the frontend without them."""
    from attnselect.choose import rules

    small = row["estimate"] if row["tokens"] * HEADS <= rules.SMALL_PACK_HEAD_TOKENS else row["count"]
    return small <= rules.SMALL_PACK_WORK or (training and row["count"] <= rules.SMALL_TRAINING_PACK_WORK)


def chosen_low(row: dict, low: str, high: str, dims, training: bool) -> bool:
    """Whether attnselect's tables, on an H100 with the cuDNN frontend and without FA4, rank ``low`` above ``high``
    for the row's packing (its sequences, longest and tokens: what a call tells the host)."""
    from attnselect import AttentionProblem, Target
    from attnselect.choose import rules

    problem = AttentionProblem(row["sequences"], row["longest"], row["longest"], HEADS, HEADS, *dims, mask="causal",
                               layout="thd", training=training, tokens=row["tokens"])  # fmt: skip
    _, entries = rules.table_for(problem, Target.preset("h100", packages={"nvidia-cudnn-frontend": "1.32.0"}))
    return entries.index((low, False)) < entries.index((high, False))


def best_bound(rows: list[dict], count: str, ways: tuple[str, ...], low: str, high: str) -> float:
    """The bound on ``count`` (0 or a packing's count) that loses the least time over ``ways`` (each way's loss over
    its least time, summed), the lowest of equals."""
    candidates = [0.0] + sorted(r[count] for r in rows)

    def cost(bound: float) -> float:
        found = scored(rows, at_most(count, bound), low, high)
        return sum(found[w]["lost"] / found[w]["best"] for w in ways)

    return min(candidates, key=lambda b: (cost(b), b))


def _cells(found: dict) -> str:
    return " | ".join(f"{100 * found[w]['lost'] / found[w]['best']:.1f}% ({found[w]['worst']:.3f})" for w in WAYS)


def markdown(meta: dict, rows: list[dict]) -> str:
    from attnselect.choose import rules

    low, high = meta["backends"]
    lines = [
        f"# Packs of equal head dims: {low} against {high}, packing by packing",
        "",
        f"{meta['device']}, {meta['date']}. Produced by `benchmarks/pack_crossover.py` (method in its docstring):",
        f"{meta['dims'][0]}/{meta['dims'][1]}, {HEADS} heads, causal, bf16, ms a layer (median of {meta['rounds']}",
        f"rounds), `stack` {LAYERS} layers on one packing, `latency` one call; counts are H*(d_qk+d_v) times the pairs",
        "(count: every sequence at the longest, capped at T^2; estimate: the longest and the rest shared evenly;",
        "exact: the sum of each sequence's). A policy's cells: the time it loses over the packings against each",
        "packing's faster kernel, as a share of that least time, and (in brackets) its worst packing's time over the",
        f"faster one's. attnselect's rule: {low} where the estimate is at most rules.MEDIUM_EQUAL_PACK_WORK of the",
        'phase (the "medium equal-dims pack" refinement), else the general table\'s frontend.',
        "",
    ]
    for phase in ("training", "inference"):
        chosen = [r for r in rows if r["phase"] == phase]
        if not chosen:
            continue
        training = phase == "training"
        policies = [
            (f"all {high}", lambda r: False),
            (f"all {low}", lambda r: True),
            ("the small-pack rules alone", functools.partial(small_pack_rules, training=training)),
            (f"attnselect's tables (estimate <= {rules.MEDIUM_EQUAL_PACK_WORK[training]:.3g})",
             functools.partial(chosen_low, low=low, high=high, dims=meta["dims"], training=training)),
        ]  # fmt: skip
        for count in COUNTS:
            for ways in (("stack",), ("latency",), WAYS):
                bound = best_bound(chosen, count, ways, low, high)
                policies.append((f"best for {' and '.join(ways)}: {count} <= {bound:.3g}", at_most(count, bound)))
        lines += [f"## {phase}", "", f"{len(chosen)} packings.", "", "| policy | stack | latency |", "|---|---|---|"]
        lines += [f"| {name} | {_cells(scored(chosen, goes_low, low, high))} |" for name, goes_low in policies]
        lines += ["", f"| packing | sequences | longest | count | estimate | exact | {low} stack | {high} stack | "
                  f"{low} latency | {high} latency |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in sorted(chosen, key=lambda r: r["exact"]):
            ms = r["ms"]
            lines.append(f"| {r['kind']} | {r['sequences']} | {r['longest']} | {r['count']:.3g} | {r['estimate']:.3g} "
                         f"| {r['exact']:.3g} | {ms[f'{low} stack']:.4f} | {ms[f'{high} stack']:.4f} | "
                         f"{ms[f'{low} latency']:.4f} | {ms[f'{high} latency']:.4f} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 12288, 16384, 24576])
    ap.add_argument("--packings", type=int, default=6)
    ap.add_argument("--equal", type=int, nargs="*", default=[256, 512, 1024, 2048, 4096])
    ap.add_argument("--equal-tokens", type=int, default=16384)
    ap.add_argument("--seed-from", type=int, default=1, help="the first seed of the ladder's packings drawn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dims", type=int, nargs=2, default=[128, 128])
    ap.add_argument("--backends", nargs=2, help="low and high (default varlen_fa2 cudnn_frontend; CPU: sdpa kernels)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round (a check of the method)")
    ap.add_argument("--report", help="an earlier run's JSON: write its report again (OUT.md) with today's rule")
    args = ap.parse_args()
    if args.report:
        with open(args.report) as f:
            found = json.load(f)
        with open(args.out + ".md", "w") as f:
            f.write(markdown(found["meta"], found["rows"]))
        return
    if args.backends is None:
        args.backends = ["varlen_fa2", "cudnn_frontend"] if args.device == "cuda" else ["sdpa_math", "sdpa_flash"]
    if args.smoke:
        args.tokens, args.packings, args.equal, args.equal_tokens, args.rounds = [256], 2, [64], 256, 1
    os.environ.setdefault("ATTNSELECT_SELF_CHECK", "0")  # each kernel's first use is not what is timed
    meta = {"device": attnselect.Target.current().describe(), "date": time.strftime("%Y-%m-%d"),
            "dims": args.dims, "rounds": args.rounds, "backends": args.backends, "args": vars(args)}  # fmt: skip
    rows = measure(args)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(meta, rows))


if __name__ == "__main__":
    main()

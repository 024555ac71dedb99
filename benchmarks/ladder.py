"""A size ladder run as users run: attnselect's default beside every single-kernel way to make the same calls.

    python benchmarks/ladder.py --out results/h200_ladder             # a GPU; writes .json and .md, resumable
    python benchmarks/ladder.py --smoke --out /tmp/ladder              # tiny, any device
    python benchmarks/ladder.py --isolate --group --out ...            # a process for each layout, pair and phase
    python benchmarks/ladder.py --pool A.json B.json --out POOLED       # no run: the goals over parts run apart
    python benchmarks/ladder.py --dense 1,2048,128,128 --only S2048 --out ...  # a dense shape off the ladder (a probe)

Rungs (16 query and 16 K/V heads, causal, bf16; d_qk/d_v 192/128 and 128/128; inference and training, a forward and
``torch.autograd.grad``):

- dense, bshd: B1 S256, S1k, S4k, S8k, S16k, S32k and B8 S1k;
- packed (thd): 2k, 8k, 16k and 64k tokens a step in documents of lognormal lengths (seeded), a new packing every
  step, both max_seqlen given.

Each rung is timed two ways: ``latency``, one call then a sync (a call alone waits for host and GPU), and ``stack``, a
step of ``--layers`` calls then one sync (a stack of layers overlaps the host's work with the GPU's; packed: the step's
packing is new, its layers share it), per call. Rows: attnselect's default; every candidate explain lists as supported,
forced (a single-kernel policy: backend= and pad=), except the reference and sdpa_math (unfused references, not kernels
a user picks for speed) and flex (it compiles per shape: :data:`NOT_FORCED`); F.scaled_dot_product_attention's default
dispatch (dense, on the bshd tensors' transposed views, its output transposed back); torch's varlen_attn (packed, V
zero-padded to d_qk where d_v is smaller); FlashAttention-4's flash_attn_func / flash_attn_varlen_func called directly
where installed, and there attnselect's default with FA4 disabled too (what a machine without FA4 runs), judged against
the single-kernel rows without FA4; and the default again (``--control``): what two rows of the same calls differ by
(its calls give the default scale explicitly, so that they keep attnselect's memo entries of their own: packed, the
first row's calls would otherwise have made its new packings' sizes known, results/h200_ladder_probe_a2ec25d_fa4.json,
its rounds). Each row goes through the same packings (made before its clock starts). The default row runs after
``attnselect.warmup`` of the rung's problem (a job that precompiles its kernels; packed, at the bounds of its packings).
Rows run interleaved, ``--rounds`` rounds of ``--calls`` timed calls (``latency``: ``--latency-calls``, by default as
many as the stack's steps make; ``stack``: steps) after ``--warmup`` untimed ones, each row's block in a round after
``--round-warmup`` untimed calls, in an order shuffled per round (``--order``: a row's time depends on the row before
it; on the H200, FA4 called directly ran a stack of B1 S16k training calls about 5% slower after the row without FA4
than after the default's second row, where the order alternated (its place in the round may count too),
results/h200_ladder_probe2_a2ec25d_fa4.json, its rounds); the median and quartiles of the per-call ms of every round
pooled, and each round's median (``by_round``: the goals judged paired, round by round, beside the pooled ones).

Each rung keeps what attnselect logged at INFO while it ran (``log``: every new decision of every row, with the
reason, fallbacks and rentals, each line with the times it came), so a default row that ran something other than
the choice reported after the rounds shows it.

The report checks the goals (issue "Choose by predicted time"): on every rung and way, attnselect's default at
least 0.97x as fast as the fastest single-kernel row; over the ladder, its geometric mean at least 1.05x as fast
as each single-kernel policy's (each over the rung-ways the policy serves, with their count); never more than 3%
slower than F.sdpa's default dispatch where that serves the call natively (the dense rungs); beside them, the noise:
the default's second row over its first on each rung-way, and which misses are no larger than that. A ladder run in
parts (``--only``, one device call each) is judged whole by ``--pool``: the goals over every part's rungs together, on
one device and library versions, the rungs no part ran named.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HEADS = 16
PAIRS = [(192, 128), (128, 128)]
DENSE = [(1, 256), (1, 1024), (1, 4096), (1, 8192), (1, 16384), (1, 32768), (8, 1024)]
PACKED = [2048, 8192, 16384, 65536]
SMOKE = dict(heads=2, pairs=[(24, 16)], dense=[(1, 16), (2, 8)], packed=[48])
WAYS = ("latency", "stack")
DEFAULT, SDPA, VARLEN, FA4 = "attnselect default", "F.sdpa default", "torch varlen_attn", "FA4 called directly"
# Where FA4 is installed, the default as a machine without it gets it (FA4 left out of the candidates: the
# calibration's other backends hold there, attnselect.choose.calibration.package_changed), beside the same rows
NO_FA4 = "attnselect default, FA4 disabled"
DEFAULTS = (DEFAULT, NO_FA4)
# The default's calls timed as a second row, on memo entries of its own (callers): two rows of the same code, so their
# ratio is what a row's timing varies by on that rung-way (the noise the goals are judged in)
AGAIN = "attnselect default, again"
NOT_SINGLE = (*DEFAULTS, AGAIN)  # rows that are not a single-kernel way
UNFUSED = ("reference", "sdpa_math")  # references, not kernels a user picks for speed
# flex compiles per shape (40-56 s a dense compile on the H200: results/h200_flex_probe.md): forced at every rung it
# would spend the device budget compiling, and attnselect ranks it after every fused kernel that serves the call
NOT_FORCED = {**{b: "an unfused reference" for b in UNFUSED}, "flex": "compiles per shape (results/h200_flex_probe.md)"}


Shape = tuple[int, int, int, int]  # a dense shape off the ladder: (batch, seqlen, d_qk, d_v)


def rungs(smoke: bool, off_ladder: tuple[Shape, ...] = ()) -> list[dict]:
    """The ladder's rungs, then ``off_ladder``'s: dense shapes off the ladder, in both phases (``--dense``: a probe of
    choices the ladder's rungs do not show), each rung once (a shape on the ladder, or given twice, adds none)."""
    pairs, dense, packed = (SMOKE["pairs"], SMOKE["dense"], SMOKE["packed"]) if smoke else (PAIRS, DENSE, PACKED)
    out = []
    for phase in ("inference", "training"):
        for d_qk, d_v in pairs:
            out += [dict(layout="bshd", batch=b, seqlen=s, d_qk=d_qk, d_v=d_v, phase=phase) for b, s in dense]
            out += [dict(layout="thd", tokens=t, d_qk=d_qk, d_v=d_v, phase=phase) for t in packed]
    for phase in ("inference", "training"):
        out += [
            dict(layout="bshd", batch=b, seqlen=s, d_qk=d_qk, d_v=d_v, phase=phase) for b, s, d_qk, d_v in off_ladder
        ]
    once: dict[str, dict] = {}  # each rung once, where it first came
    for rung in out:
        once.setdefault(rung_name(rung), rung)
    return list(once.values())


def off_ladder_shapes(report: dict) -> tuple[Shape, ...]:
    """The ``--dense`` shapes a ladder's report ran (its meta's ``dense off the ladder``)."""
    return tuple(tuple(shape) for shape in report.get("meta", {}).get("dense off the ladder", ()))


def dense_shape(text: str) -> Shape:
    """``--dense``'s "B,S,DQK,DV" as (batch, seqlen, d_qk, d_v)."""
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdecimal() and p.strip().isascii() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected B,S,DQK,DV (four positive integers), got {text!r}")
    return tuple(int(p) for p in parts)


def rung_name(r: dict) -> str:
    size = f"B{r['batch']} S{r['seqlen']}" if r["layout"] == "bshd" else f"{r['tokens']} tokens, new packing a step"
    return f"{r['layout']} {size} {r['d_qk']}/{r['d_v']} {r['phase']}"


def packing_lengths(tokens: int, seed: int) -> list[int]:
    """Document lengths filling ``tokens``: lognormal (median about 700 tokens), the last one cut."""
    rng, lengths = random.Random(seed), []
    while sum(lengths) < tokens:
        lengths.append(min(max(int(rng.lognormvariate(6.5, 1.0)), 16), tokens - sum(lengths)))
    return lengths


def boundaries(lengths: list[int], device) -> tuple[torch.Tensor, int]:
    """(cu_seqlens, longest) of documents of these lengths, back to back, on ``device``."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return cu, max(lengths)


class Inputs:
    """A rung's tensors and, packed, its stream of new packings (each a (cu_seqlens, longest) on the device)."""

    def __init__(self, rung: dict, device: str, heads: int, dtype: torch.dtype):
        self.rung, self.device = rung, device
        training = rung["phase"] == "training"
        g = torch.Generator(device=device).manual_seed(0)
        if rung["layout"] == "bshd":
            lead = (rung["batch"], rung["seqlen"], heads)
        else:
            lead = (rung["tokens"], heads)
        self.q, self.k, self.v = (
            torch.randn(*lead, d, device=device, dtype=dtype, generator=g).requires_grad_(training)
            for d in (rung["d_qk"], rung["d_qk"], rung["d_v"])
        )
        self.grad = torch.randn(*lead, rung["d_v"], device=device, dtype=dtype, generator=g) if training else None
        self.turns: dict[str, int] = {}

    def packing(self, row: str):
        """The row's next packing: every row goes through the same sequence of packings, whatever the order rows
        run in; None for a dense rung."""
        if self.rung["layout"] != "thd":
            return None
        turn = self.turns[row] = self.turns.get(row, 0) + 1
        return self.packing_at(turn)

    def packing_at(self, turn: int):
        return boundaries(packing_lengths(self.rung["tokens"], turn), self.device)

    def warm_problem(self, problem):
        """What a job warms up for ``problem``: itself where dense; packed, its tokens in packings as its loader
        bounds them (:func:`packing_lengths`: documents of at least 16 tokens but the last, which is cut, the longest
        up to all of them)."""
        if self.rung["layout"] != "thd":
            return problem
        tokens = self.rung["tokens"]
        return dataclasses.replace(problem, batch=tokens // 16 + 1, seqlen_q=tokens, seqlen_kv=tokens)

    def problem(self):
        """The problem of the rung's calls as attention() describes them (packed: on the first packing)."""
        import attnselect

        if self.rung["layout"] != "thd":
            return attnselect.AttentionProblem.from_tensors(self.q, self.k, self.v, causal=True)
        cu, longest = self.packing_at(1)
        packed = dict(layout="thd", cu_seqlens_q=cu, max_seqlen_q=longest, max_seqlen_kv=longest, causal=True)
        return attnselect.AttentionProblem.from_tensors(self.q, self.k, self.v, **packed)


def callers(rung: dict, problem, target, device: str, control: bool = False) -> dict:
    """{row: fn(inputs, packing) -> out} for one rung; packing is (cu_seqlens, longest) or None (dense)."""
    import attnselect
    from attnselect import backends
    from attnselect.choose.candidates import judge

    thd = rung["layout"] == "thd"

    def through_attnselect(**kw):
        if thd:
            return lambda x, p: attnselect.attention(
                x.q, x.k, x.v, layout="thd", cu_seqlens_q=p[0], max_seqlen_q=p[1], max_seqlen_kv=p[1], causal=True,
                **kw,
            )  # fmt: skip
        return lambda x, p: attnselect.attention(x.q, x.k, x.v, causal=True, **kw)

    rows = {DEFAULT: through_attnselect()}
    for verdict in judge(problem, target):
        c = verdict.candidate
        if not verdict.supported or c.backend in NOT_FORCED:
            continue
        if thd and not backends.get(c.backend).packs_thd(target):
            continue  # sequence by sequence: not a kernel's speed
        rows[f"forced {c}"] = through_attnselect(backend=c.backend, pad=c.padded)
    if not thd:
        rows[SDPA] = lambda x, p: F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (x.q, x.k, x.v)), is_causal=True
        ).transpose(1, 2)
    elif device == "cuda":
        from torch.nn.attention.varlen import varlen_attn

        def varlen(x, p):
            d_qk, d_v = x.q.shape[-1], x.v.shape[-1]
            v = F.pad(x.v, (0, d_qk - d_v)) if d_v < d_qk else x.v
            return varlen_attn(x.q, x.k, v, p[0], p[0], p[1], p[1], window_size=(-1, 0))[..., :d_v]

        rows[VARLEN] = varlen
    fa4 = _fa4()
    if fa4 is not None and device == "cuda":
        rows[NO_FA4] = through_attnselect(disable="flash_attn4")
        dense, varlen_fa4 = fa4
        if thd:
            rows[FA4] = lambda x, p: _first(varlen_fa4(x.q, x.k, x.v, cu_seqlens_q=p[0], cu_seqlens_k=p[0],
                                                       max_seqlen_q=p[1], max_seqlen_k=p[1], causal=True))  # fmt: skip
        else:
            rows[FA4] = lambda x, p: _first(dense(x.q, x.k, x.v, causal=True))
    if control:  # the default scale given (the same value to the bit): the same calls, on memo entries of their own
        rows[AGAIN] = through_attnselect(scale=problem.default_scale)
    return rows


class _Counted(logging.Handler):
    """{line: times logged}, each line cut to 400 characters."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()[:400]
        self.lines[line] = self.lines.get(line, 0) + 1


class attnselect_log:  # noqa: N801 (a context manager)
    """{line: times logged} of the "attnselect" logger at INFO while it is open: every row's decisions (the default
    row's included), fallbacks and rentals, as they happened during a rung's warm-up and timed rounds."""

    def __enter__(self) -> dict:
        self.handler, self.logger = _Counted(), logging.getLogger("attnselect")
        self.level = self.logger.level
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)
        return self.handler.lines

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _fa4():
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_func, flash_attn_varlen_func


def _call(fn, x: Inputs, packing):
    out = fn(x, packing)
    if x.grad is not None:
        torch.autograd.grad(out, (x.q, x.k, x.v), x.grad)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_rung(rung: dict, rows: dict, x: Inputs, a) -> dict:
    """{"times": {way: {row: [ms per call of each timed call or step]}}, "by_round": {way: {row: [each round's
    median]}}, ...}, rows interleaved in each round's order (:func:`round_order`; a row's rounds apart show whether
    its spread is a round's, as where the host slowed for a while, or every call's)."""
    times = {way: {row: [] for row in rows} for way in WAYS}
    by_round = {way: {row: [] for row in rows} for way in WAYS}
    errors = {}

    def failed(name, exc):  # a row that cannot run the rung is reported, not fatal; its timings are dropped
        errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        for way in WAYS:
            times[way][name] = []

    with torch.enable_grad() if x.grad is not None else torch.no_grad():
        for name, fn in rows.items():  # warm-up: choices, compiles, graphs
            try:
                for _ in range(a.warmup):
                    _call(fn, x, x.packing(name))
                _sync(a.device)
            except Exception as exc:
                failed(name, exc)
        screened = screen(rows, x, a, errors)
        for r in range(a.rounds):
            live = [(name, fn) for name, fn in rows.items() if name not in errors and name not in screened]
            for name, fn in round_order(live, f"{rung_name(rung)}/{r}", a.order, r % 2):
                try:
                    for _ in range(a.round_warmup):  # untimed: what the row before left is not this row's
                        _call(fn, x, x.packing(name))
                    _sync(a.device)
                    for _ in range(a.latency_calls):  # latency: one call, then a sync
                        packing = x.packing(name)  # made before the clock starts (a data loader's work)
                        _sync(a.device)
                        start = time.perf_counter()
                        _call(fn, x, packing)
                        _sync(a.device)
                        times["latency"][name].append((time.perf_counter() - start) * 1e3)
                    for _ in range(a.calls):  # stack: a step of layers sharing the step's packing, one sync
                        packing = x.packing(name)
                        _sync(a.device)
                        start = time.perf_counter()
                        for _ in range(a.layers):
                            _call(fn, x, packing)
                        _sync(a.device)
                        times["stack"][name].append((time.perf_counter() - start) * 1e3 / a.layers)
                    for way, calls in (("latency", a.latency_calls), ("stack", a.calls)):
                        if calls > 0:
                            by_round[way][name].append(statistics.median(times[way][name][-calls:]))
                except Exception as exc:
                    failed(name, exc)
    by_round = {way: {row: medians for row, medians in rounds.items() if times[way][row]}
                for way, rounds in by_round.items()}  # fmt: skip
    return {"times": times, "by_round": by_round, "errors": errors, "screened": screened}


def round_order(rows: list, seed: str, order: str, odd: bool) -> list:
    """The rows in a round's order: ``alternate``, as listed, reversed in ``odd`` rounds; ``shuffle``, a random order
    seeded by ``seed`` (the rung and the round: each row's neighbours change from round to round and rung to rung, so
    what a row leaves to the next one spreads over the rows, not on a fixed neighbour)."""
    if order == "alternate":
        return rows[::-1] if odd else rows
    shuffled = list(rows)
    random.Random(seed).shuffle(shuffled)
    return shuffled


SCREEN_CALLS = 3  # a row's screen is the least of these: one-off costs (a self-check at a new size class, a graph
# built for a new packing's shape) leave a kernel no slower than it is


def screen(rows: dict, x: Inputs, a, errors: dict) -> dict:
    """{row: ms} of the forced rows left out of the timed rounds: :data:`SCREEN_CALLS` synchronised calls each (a new
    packing each, packed), and those whose least is slower than ``--screen`` times the fastest row's least leave
    (they cannot be the fastest single-kernel row; a policy's geometric mean over the rungs left then leaves out
    rungs where it lost by that much, which only lowers attnselect's advantage over it)."""
    if not a.screen:
        return {}
    once = {}
    for name, fn in rows.items():
        if name in errors:
            continue
        for _ in range(SCREEN_CALLS):
            packing = x.packing(name)
            _sync(a.device)
            start = time.perf_counter()
            _call(fn, x, packing)
            _sync(a.device)
            once[name] = min(once.get(name, math.inf), (time.perf_counter() - start) * 1e3)
    fastest = min(once.values(), default=0.0)
    return {n: ms for n, ms in once.items() if n.startswith("forced ") and ms > a.screen * fastest}


def _stats(values: list[float]) -> dict:
    q1, median, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "n": len(values)}


def goals(results: list[dict]) -> dict:
    """The three goals over the rungs measured so far (see the module docstring)."""
    per_row, worst, sdpa, no_fa4, unmeasured = [], None, [], [], []
    policies: dict[str, list[float]] = {}
    for entry in results:
        if not entry["stats"]:  # the rung's process failed: nothing of the default measured
            unmeasured.append({"rung": entry["rung"], "way": "every", "why": next(iter(entry["errors"].values()), "")})
        for way, rows in entry["stats"].items():
            for default in DEFAULTS:
                if default not in rows and (default == DEFAULT or FA4 in rows):  # FA4 installed: both defaults run
                    errors = entry["errors"]
                    why = errors.get(default) or errors.get(f"{default}: its warm-up") or "no times"
                    unmeasured.append({"rung": entry["rung"], "way": way, "row": default, "why": why})
            if DEFAULT not in rows:
                continue
            found = _way_verdicts(entry["rung"], way, rows, _pooled_speed)
            if "best" in found:
                per_row.append(found["best"])
                worst = found["best"]["speed"] if worst is None else min(worst, found["best"]["speed"])
            if "no_fa4" in found:
                no_fa4.append(found["no_fa4"])
            if "sdpa" in found:
                sdpa.append({"rung": entry["rung"], "way": way, "speed": found["sdpa"]})
            for policy, speed in found["policies"].items():
                policies.setdefault(policy, []).append(speed)
    geo = _geometric(policies)
    whole = not unmeasured  # a rung-way whose default has no times cannot be shown to meet a goal
    return {
        "against the fastest single-kernel row (goal >= 0.97 everywhere)": {
            "worst": worst, "met": whole and worst is not None and worst >= 0.97, "rows": per_row},
        "geometric mean against each single-kernel policy (goal >= 1.05)": {
            "policies": geo, "met": whole and bool(geo) and all(g["speed"] >= 1.05 for g in geo.values())},
        "against F.sdpa's default dispatch (goal >= 0.97)": {  # None: no dense rung measured (packed ones have no row)
            "worst": min((s["speed"] for s in sdpa), default=None),
            "met": (whole and all(s["speed"] >= 0.97 for s in sdpa)) if sdpa else None, "rows": sdpa},
        **({"without FA4: its default against the fastest single-kernel row without FA4 (goal >= 0.97)": {
            "worst": min(s["speed"] for s in no_fa4), "met": whole and all(s["speed"] >= 0.97 for s in no_fa4),
            "rows": no_fa4}} if no_fa4 else {}),
        **({"unmeasured: rung-ways without the default's times (every goal missed while any)": {
            "met": False, "rows": unmeasured}} if unmeasured else {}),
    }  # fmt: skip


def _way_verdicts(rung: str, way: str, rows: dict, ratio) -> dict:
    """One rung-way's ``rows`` as the goals read them, ``ratio(row's, base's)`` being a row's time over another's
    (None where it is not known): ``best``, the fastest single-kernel row against the default; ``no_fa4``, the fastest
    without FA4 against the default without it (where that row ran); ``sdpa``, F.sdpa's default; ``again``, the
    default's second row; ``policies``, each forced row's, by backend and padding."""

    def speed(name, base):
        return ratio(rows[name], rows[base])

    singles = {name: speed(name, DEFAULT) for name in rows if name not in NOT_SINGLE}
    singles = {name: over for name, over in singles.items() if over is not None}
    found: dict = {"policies": {n.removeprefix("forced "): r for n, r in singles.items() if n.startswith("forced ")}}
    if singles:
        best = min(singles, key=singles.get)
        found["best"] = {"rung": rung, "way": way, "best": best, "speed": singles[best]}
    if NO_FA4 in rows:
        without = {name: speed(name, NO_FA4) for name in singles if "flash_attn4" not in name and name != FA4}
        without = {name: over for name, over in without.items() if over is not None}
        if without:
            best = min(without, key=without.get)
            found["no_fa4"] = {"rung": rung, "way": way, "best": best, "speed": without[best]}
    for key, row in (("sdpa", SDPA), ("again", AGAIN)):
        if row in rows and (over := speed(row, DEFAULT)) is not None:
            found[key] = over
    return found


def _pooled_speed(theirs: dict, ours: dict) -> float:
    """A row's median over another's, every timed call pooled."""
    return theirs["median"] / ours["median"]


def _paired_speed(theirs: list[float], ours: list[float]) -> float | None:
    """The median over the rounds of a row's median over the default's; None where the row has not every round."""
    return statistics.median(t / o for t, o in zip(theirs, ours)) if len(theirs) == len(ours) else None


def _geometric(policies: dict[str, list[float]]) -> dict:
    """{policy: its geometric mean speed and the rung-ways it is over}."""
    return {p: {"speed": math.exp(statistics.fmean(map(math.log, r))), "rungs": len(r)} for p, r in policies.items()}


def judged(results: list[dict]) -> dict:
    """``{"goals": ..., "noise": ..., "paired": ...}`` of the rungs measured so far (:func:`goals`, :func:`noise`,
    :func:`paired`)."""
    found = goals(results)
    return {"goals": found, "noise": noise(results, found), "paired": paired(results)}


def noise(results: list[dict], found: dict) -> dict | None:
    """The default's second row (``--control``) over its first on each rung-way, and for each goal of ``found`` (as
    :func:`goals` gives them) how many of its misses are no larger than that spread on their rung-way (a miss by less
    than two rows of the same calls differ by; the without-FA4 goal's misses too, against the default's spread, its
    own row having no second); None where no rung has the second row."""
    spread = {}
    for entry in results:
        for way, rows in entry["stats"].items():
            if DEFAULT in rows and AGAIN in rows:
                spread[entry["rung"], way] = rows[AGAIN]["median"] / rows[DEFAULT]["median"]
    if not spread:
        return None
    within = {}
    for name, goal in found.items():
        misses = [r for r in goal.get("rows", []) if "speed" in r and r["speed"] < 0.97]
        if misses and not name.startswith("unmeasured"):
            spread_known = [r for r in misses if (r["rung"], r["way"]) in spread]
            inside = [r for r in spread_known if r["speed"] >= min(ratio := spread[r["rung"], r["way"]], 1 / ratio)]
            within[name] = {"misses": len(misses), "within": len(inside), "unjudged": len(misses) - len(spread_known)}
    rows = [{"rung": rung, "way": way, "again": ratio} for (rung, way), ratio in spread.items()]
    return {"rows": rows, "least": min(spread.values()), "most": max(spread.values()), "within": within}


def paired(results: list[dict]) -> dict | None:
    """The goals against rows of one machine's moment: on each rung-way, each row's median in a round over the
    default's in that round (rows interleaved, so both met the same state of the host and GPU), the median of those
    ratios over the rounds; the fastest single-kernel row by it, F.sdpa's default, each policy's geometric mean, the
    default without FA4 against the fastest row without FA4, and the default's second row so. None where no rung kept
    its rounds (``by_round``: rungs run before it was kept; ``unjudged`` counts those among rungs that did)."""
    rows, sdpa, no_fa4, again, policies, unjudged = [], [], [], [], {}, 0
    for entry in results:
        if entry.get("stats") and not entry.get("by_round"):
            unjudged += 1
        for way, by_row in entry.get("by_round", {}).items():
            if not by_row.get(DEFAULT):
                continue
            found = _way_verdicts(entry["rung"], way, by_row, _paired_speed)
            if "best" in found:
                rows.append(found["best"])
            if "no_fa4" in found:
                no_fa4.append(found["no_fa4"])
            if "sdpa" in found:
                sdpa.append({"rung": entry["rung"], "way": way, "speed": found["sdpa"]})
            if "again" in found:
                again.append({"rung": entry["rung"], "way": way, "again": found["again"]})
            for policy, speed in found["policies"].items():
                policies.setdefault(policy, []).append(speed)
    if not rows:
        return None
    geo = _geometric(policies)
    return {"against the fastest single-kernel row": rows, "against F.sdpa's default dispatch": sdpa,
            "without FA4: its default against the fastest single-kernel row without FA4": no_fa4,
            "policies": geo, "again": again, "unjudged": unjudged}  # fmt: skip


def paired_lines(found: dict | None) -> list[str]:
    """The report's lines of :func:`paired`."""
    if found is None:
        return []
    lines = ["\n## Paired by round\n",
             "Each row's median in a round over the default's in the same round, the median over the rounds (the goals "
             "above pool every call of a row instead):\n"]  # fmt: skip
    if found.get("unjudged"):
        lines.append(f"({found['unjudged']} rungs kept no rounds and are left out here.)\n")
    for name in ("against the fastest single-kernel row", "against F.sdpa's default dispatch",
                 "without FA4: its default against the fastest single-kernel row without FA4"):  # fmt: skip
        rows = found.get(name)
        if rows:
            met = sum(r["speed"] >= 0.97 for r in rows)
            worst = min(rows, key=lambda r: r["speed"])
            lines.append(f"- {name}: at least 0.97 on {met} of {len(rows)} rung-ways, worst {worst['speed']:.3f} "
                         f"({worst['rung']}, {worst['way']})")  # fmt: skip
    below = {policy: g for policy, g in found.get("policies", {}).items() if g["speed"] < 1.05}
    if found.get("policies"):
        lines.append(
            f"- geometric mean at least 1.05 against {len(found['policies']) - len(below)} of "
            f"{len(found['policies'])} single-kernel policies"
            + "".join(f"; {policy} {g['speed']:.3f} over {g['rungs']} rung-ways" for policy, g in below.items())
        )
    if found["again"]:
        spread = [r["again"] for r in found["again"]]
        lines.append(f"- the default's second row over its first: {min(spread):.3f} to {max(spread):.3f} over "
                     f"{len(spread)} rung-ways")  # fmt: skip
    misses = [r for r in found["against the fastest single-kernel row"] if r["speed"] < 0.97]
    if misses:
        lines.append("\nThe rung-ways below 0.97 against the fastest single-kernel row, paired:\n")
        lines += [f"- {r['rung']}, {r['way']}: {r['speed']:.3f} against {r['best']}" for r in misses]
    return lines


def noise_lines(found: dict | None) -> list[str]:
    """The report's lines of :func:`noise`."""
    if found is None:
        return []
    lines = [
        "\n## Noise\n",
        "The default timed again as a second row (the same calls, on memo entries of their own): its "
        f"median over the first row's {found['least']:.3f} to {found['most']:.3f} over {len(found['rows'])} "
        "rung-ways.\n",
    ]
    for name, count in found["within"].items():
        unjudged = count.get("unjudged", 0)
        aside = f" ({unjudged} on rung-ways without the second row)" if unjudged else ""
        lines.append(f"- {name}: {count['within']} of its {count['misses']} misses no larger than that spread on "
                     f"their rung-way{aside}")  # fmt: skip
    return lines


def markdown(report: dict) -> str:
    lines = ["# Size ladder: attnselect's default beside every single-kernel way\n",
             f"{report['meta']['device']}, {report['meta']['date']}. Produced by `benchmarks/ladder.py` (method in its "
             "docstring): per call ms, median (quartiles) of every timed call or step pooled over the rounds; "
             "`speed` is the row's median over attnselect's default (above 1: the default is faster); `paired`, "
             "where the rounds were kept, the median over the rounds of the row's median over the default's in "
             "each.\n"]  # fmt: skip
    skipped = report["meta"].get("not forced", {})
    if skipped:
        lines.append("Not forced: " + "; ".join(f"{b} ({why})" for b, why in skipped.items()) + ".\n")
    lines += [
        "## Goals\n",
        *goal_lines(report["goals"]),
        *noise_lines(report.get("noise")),
        *paired_lines(report.get("paired")),
    ]
    for entry in report["results"]:
        lines += [f"\n## {entry['rung']}\n", f"chosen: {entry['chosen']}\n"]
        for way, rows in entry["stats"].items():
            rounds = entry.get("by_round", {}).get(way, {})
            ours_by_round = rounds.get(DEFAULT)
            head, rule = ("| row | ms a call | speed | paired |", "|---|---|---|---|") if ours_by_round else (
                "| row | ms a call | speed |", "|---|---|---|")  # fmt: skip
            lines += [f"{way}:\n", head, rule]
            ours = rows.get(DEFAULT, {}).get("median")
            for name, s in sorted(rows.items(), key=lambda kv: kv[1]["median"]):
                speed = f"{s['median'] / ours:.3f}" if ours else ""
                row = f"| {name} | {s['median']:.4f} ({s['q1']:.4f}..{s['q3']:.4f}) | {speed} |"
                if ours_by_round:
                    by_pair = _paired_speed(rounds[name], ours_by_round) if name in rounds else None
                    row += f" {by_pair:.3f} |" if by_pair is not None else " |"
                lines.append(row)
            lines.append("")
        for name, error in entry["errors"].items():
            lines.append(f"- {name} could not run: {error}")
        for name, ms in entry.get("screened", {}).items():
            calls = entry.get("args", {}).get("screen_calls", 1)  # a rung run before its screen took the least
            lines.append(f"- {name} left out after one call of {ms:.3f} ms (`--screen`)" if calls == 1 else
                         f"- {name} left out, its least of {calls} calls {ms:.3f} ms (`--screen`)")  # fmt: skip
    return "\n".join(lines) + "\n"


def goal_lines(found: dict) -> list[str]:
    """The report's lines of :func:`goals`' verdicts."""
    lines = []
    for name, goal in found.items():
        if name.startswith("unmeasured"):
            lines.append(f"- {name}: {len(goal['rows'])}")
            lines += [f"  - {r['rung']}, {r['way']}: {r['why']}" for r in goal["rows"]]
            continue
        status = "not measured" if goal["met"] is None else "met" if goal["met"] else "**missed**"
        lines.append(f"- {name}: {status}"
                     + (f", worst {goal['worst']:.3f}" if goal.get("worst") is not None else ""))  # fmt: skip
        for policy, v in goal.get("policies", {}).items():
            lines.append(f"  - {policy}: {v['speed']:.3f} over {v['rungs']} rung-ways")
    return lines


def pool(paths: list[str], out: str) -> dict:
    """The goals over the rungs of the ladders at ``paths`` together (parts of one ladder, each run with ``--only``),
    written to ``out``.json and .md: the parts' device and library versions must be one, and no rung may be in two
    parts. The rungs of the ladder that no part ran are listed (the goals hold over the rungs run). The pooled .json
    holds the goals and the rungs' names; their rows stay in the parts."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    devices = sorted({r["meta"]["device"] for r in reports})
    if len(devices) != 1:
        raise SystemExit(f"--pool: parts of one ladder run on one device and library versions, got {devices}")
    results = [entry for r in reports for entry in r["results"]]
    names = [entry["rung"] for entry in results]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SystemExit(f"--pool: rungs in more than one part: {twice}")
    smoke = any(r["meta"].get("smoke") for r in reports)
    ladder = [rung_name(r) for r in rungs(smoke)]
    not_run = [n for n in ladder if n not in names]
    probes = [n for n in names if n not in ladder]  # --dense rungs: the goals are the ladder's
    results, names = [e for e in results if e["rung"] in ladder], [n for n in names if n in ladder]
    report = {"meta": {"device": devices[0], "parts": {p: r["meta"] for p, r in zip(paths, reports)},
                       "not run": not_run, "off the ladder": probes},
              "rungs": names, **judged(results)}  # fmt: skip
    lines = [
        "# Size ladder, its parts pooled\n",
        f"{devices[0]}. `benchmarks/ladder.py --pool` over {len(paths)} parts run apart (their own reports hold "
        "each rung's rows and the method), the goals judged over their rungs together:\n",
        *(
            f"- `{p}`: {r['meta']['date']}, {r['meta']['rounds']} rounds of {r['meta']['calls']} calls, "
            f"{len(r['results'])} rungs"
            for p, r in zip(paths, reports)
        ),  # fmt: skip
        "",
        f"Rungs run: {len(names)} of {len(names) + len(not_run)}"
        + (f"; not run: {', '.join(not_run)} (the goals hold over the rungs run)." if not_run else ".")
        + (f" Off the ladder, left out of the goals: {', '.join(probes)}." if probes else ""),
        "",
        "## Goals\n",
        *goal_lines(report["goals"]),
        *noise_lines(report["noise"]),
        *paired_lines(report["paired"]),
    ]
    Path(out + ".json").write_text(json.dumps(report, indent=1))
    Path(out + ".md").write_text("\n".join(lines) + "\n")
    return report


def readme_table(report: dict, pair: str = "192/128") -> str:
    """The README's performance table: per rung of ``pair``, the default's choice and ms a call beside the fastest
    single-kernel row and F.sdpa's default (latency: a call alone; stack: a layer of a pipelined step)."""
    lines = [
        "| rung | attnselect chose | latency, ms: attnselect / fastest single kernel | stack, ms a layer: attnselect "
        "/ fastest single kernel | stack: F.sdpa default |",
        "|---|---|---|---|---|",
    ]

    def cell(rows: dict) -> str:
        ours = rows.get(DEFAULT, {}).get("median")
        singles = {n: s["median"] for n, s in rows.items() if n not in NOT_SINGLE}
        if ours is None or not singles:
            return "-"
        best = min(singles, key=singles.get)
        return f"{ours:.3f} / {singles[best]:.3f} ({best.removeprefix('forced ')})"

    for entry in report["results"]:
        if f" {pair} " not in entry["rung"]:
            continue
        stats = entry["stats"]
        sdpa = stats.get("stack", {}).get(SDPA, {}).get("median")
        lines.append(
            f"| {entry['rung'].replace(f' {pair}', '')} | {entry['chosen']} | {cell(stats.get('latency', {}))} | "
            f"{cell(stats.get('stack', {}))} | {'-' if sdpa is None else f'{sdpa:.3f}'} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="PREFIX: writes PREFIX.json and PREFIX.md; resumes PREFIX.json")
    ap.add_argument("--pool", nargs="+", metavar="JSON", help="no run: the goals over these parts' rungs together")
    ap.add_argument("--smoke", action="store_true", help="tiny rungs on any device")
    ap.add_argument("--only", action="append", default=[], help="rungs whose name contains this (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=10, help="timed calls (latency) and steps (stack) a row and round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--round-warmup", type=int, default=1, help="untimed calls before each row's block in a round")
    ap.add_argument("--order", choices=("shuffle", "alternate"), default="shuffle", help="the rows' order in a round: "
                    "random, seeded by the round, or as listed and reversed in turn")  # fmt: skip
    ap.add_argument("--layers", type=int, default=8, help="calls a step in the stack way")
    ap.add_argument("--latency-calls", type=int, help="timed calls a row and round in the latency way (default: "
                    "--calls x --layers, the calls of the stack way's steps: a call alone varies more than a "
                    "step)")  # fmt: skip
    ap.add_argument("--control", action=argparse.BooleanOptionalAction, default=True, help="time the default "
                    "again as a row of its own: what two rows of the same calls differ by")  # fmt: skip
    ap.add_argument("--deadline", type=float, help="seconds from now: no rung starts after it (resume later)")
    ap.add_argument("--deadline-at", type=float, help=argparse.SUPPRESS)  # --isolate's: the parent's, in epoch seconds
    ap.add_argument("--screen", type=float, default=0.0, help="leave forced rows slower than this many times the "
                    "fastest row out of the timed rounds, each row's least of 3 calls (0: none)")  # fmt: skip
    ap.add_argument("--rung-timeout", type=float, default=600.0, help="seconds a rung may take (--isolate: a "
                    "process gets this for each rung it runs)")  # fmt: skip
    ap.add_argument("--rung", action="append", default=[], help="run these rungs alone (exact names; repeatable)")
    ap.add_argument("--dense", action="append", default=[], type=dense_shape, metavar="B,S,DQK,DV",
                    help="a dense shape off the ladder, as rungs of both phases after the ladder's (repeatable; "
                    "--only picks)")  # fmt: skip
    ap.add_argument("--isolate", action="store_true", help="each rung in a process of its own (what one rung leaves "
                    "allocated, or a broken CUDA context, cannot reach the next)")  # fmt: skip
    ap.add_argument("--group", action="store_true", help="with --isolate: the rungs of one layout, head-dim pair and "
                    "phase in one process (their configurations compile, or load, once), a rung whose process "
                    "fails recorded and the rest of its group run on in a new one")  # fmt: skip
    a = ap.parse_args()
    if a.pool:
        pool(a.pool, a.out)
        return
    if a.latency_calls is None:
        a.latency_calls = a.calls * a.layers
    if a.screen and (a.screen < 1 or a.warmup < 1):  # below 1 it would leave out the fastest; without a warm-up
        ap.error("--screen: 0 (none) or at least 1, after --warmup 1 or more (its calls must not compile)")
    started = time.time()
    deadline_at = a.deadline_at if a.deadline_at is not None else None if a.deadline is None else started + a.deadline
    if a.isolate:
        return isolated(a, deadline_at)
    import attnselect

    a.device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    target = attnselect.Target.current(a.device)
    path = Path(a.out + ".json")
    report = json.loads(path.read_text()) if path.exists() else {"results": []}
    # the shapes off the ladder of the rungs run so far, a resume's own added
    shapes = list(dict.fromkeys((*off_ladder_shapes(report), *a.dense)))
    report["meta"] = {"device": target.describe(), "date": time.strftime("%Y-%m-%d"), "smoke": a.smoke,
                      "rounds": a.rounds, "calls": a.calls, "latency_calls": a.latency_calls, "warmup": a.warmup,
                      "round_warmup": a.round_warmup, "order": a.order,
                      "layers": a.layers, "control": a.control,
                      "screen": a.screen, "not forced": NOT_FORCED,
                      **({"dense off the ladder": [list(shape) for shape in shapes]} if shapes else {})}  # fmt: skip
    done = {entry["rung"] for entry in report["results"]}
    heads = SMOKE["heads"] if a.smoke else HEADS
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    for rung in rungs(a.smoke, tuple(a.dense)):
        name = rung_name(rung)
        if name in done or (a.only and not any(o in name for o in a.only)) or (a.rung and name not in a.rung):
            continue
        if deadline_at is not None and time.time() > deadline_at:
            print(f"deadline: {name} and later rungs not run (run again to resume)", flush=True)
            break
        if a.device == "cuda":  # each rung's own peak: an earlier rung's tensors were released (below)
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        inputs = Inputs(rung, a.device, heads, dtype)
        with torch.enable_grad() if inputs.grad is not None else torch.no_grad():
            problem = inputs.problem()
        with attnselect_log() as log:
            # as a job that precompiles: no compile left to rent out, for the default and, where FA4 is installed,
            # the default without it (what a machine without FA4 runs)
            warm = inputs.warm_problem(problem)
            warmed = attnselect.warmup([warm], device=a.device)
            if _fa4() is not None and a.device == "cuda":
                warmed += attnselect.warmup([warm], device=a.device, disable="flash_attn4")
            rows = callers(rung, problem, target, a.device, control=a.control)
            measured = time_rung(rung, rows, inputs, a)
        for default, w in zip(DEFAULTS, warmed):
            if w.error:
                measured["errors"][f"{default}: its warm-up"] = w.error
        chosen = str(attnselect.select(problem, target=target).chosen)
        stats = {way: {row: _stats(t) for row, t in by_row.items() if t} for way, by_row in measured["times"].items()}
        peak = torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else None
        args = {k: getattr(a, k) for k in ("rounds", "calls", "latency_calls", "warmup", "round_warmup", "order",
                                           "layers", "screen")}  # fmt: skip
        args["screen_calls"] = SCREEN_CALLS
        report["results"].append({"rung": name, "chosen": chosen, "stats": stats, "errors": measured["errors"],
                                  "screened": measured["screened"], "by_round": measured["by_round"],
                                  "peak_gib": peak, "args": args,
                                  "log": sorted(log.items())})  # fmt: skip
        done.add(name)
        report.update(judged(report["results"]))
        _write(path, report)  # after every rung: a later call resumes
        print(
            f"{name}: chosen {chosen}; "
            + ", ".join(f"{way} {stats[way][DEFAULT]['median']:.3f} ms" for way in WAYS if DEFAULT in stats[way]),
            flush=True,
        )
        del inputs, problem, rows, measured  # released before the next rung's peak is reset
    report.update(judged(report["results"]))
    _write(path, report)
    Path(a.out + ".md").write_text(markdown(report))


def _write(path: Path, report: dict) -> None:
    """``report`` as ``path``'s JSON, whole or not at all (a process killed while writing leaves the last one)."""
    part = path.with_suffix(".json.part")
    part.write_text(json.dumps(report, indent=1))
    part.replace(path)


def isolated(a, deadline_at: float | None) -> None:
    """Every rung not yet in ``--out`` in a process of its own (``--rung``), or with ``--group`` one process for the
    rungs of each layout, head-dim pair and phase, until the deadline; then the report. A process that fails, runs
    past ``--rung-timeout`` for each of its rungs, or ends without finishing a rung records the first of its rungs not
    done as failed (a resume does not spend the device's time on it again); the rest of its group run on in a new
    process."""
    path = Path(a.out + ".json")
    passed = ["--out", a.out, "--rounds", str(a.rounds), "--calls", str(a.calls), "--latency-calls",
              str(a.latency_calls), "--warmup", str(a.warmup), "--round-warmup", str(a.round_warmup),
              "--order", a.order,
              "--layers", str(a.layers), "--screen", str(a.screen), *(["--smoke"] if a.smoke else []),
              "--control" if a.control else "--no-control",
              *(arg for shape in a.dense for arg in ("--dense", ",".join(map(str, shape)))),
              *(["--deadline-at", str(deadline_at)] if deadline_at is not None else [])]  # fmt: skip

    def done() -> set:
        return {e["rung"] for e in json.loads(path.read_text())["results"]} if path.exists() else set()

    groups: dict[tuple, list[str]] = {}
    for rung in rungs(a.smoke, tuple(a.dense)):
        name = rung_name(rung)
        if (not a.only or any(o in name for o in a.only)) and (not a.rung or name in a.rung):
            key = (rung["layout"], rung["d_qk"], rung["d_v"], rung["phase"]) if a.group else (name,)
            groups.setdefault(key, []).append(name)
    for names in groups.values():
        while left := [name for name in names if name not in done()]:
            if deadline_at is not None and time.time() > deadline_at:
                print(f"deadline: {left[0]} and later rungs not run (run again to resume)", flush=True)
                return _report(path, a.out)
            command = [sys.executable, __file__, *passed, *(arg for name in left for arg in ("--rung", name))]
            try:
                finished = subprocess.run(command, timeout=a.rung_timeout * len(left))
                failure = f"its process exited with {finished.returncode}" if finished.returncode else None
            except subprocess.TimeoutExpired:
                failure = f"its process ran past --rung-timeout ({a.rung_timeout:.0f} s for each of its rungs)"
            first = next((name for name in left if name not in done()), None)
            if first is None:
                continue
            if failure is None and first != left[0]:
                continue  # some ran, and its deadline stopped it: the loop's check stops
            if failure is None:
                if deadline_at is not None and time.time() > deadline_at:
                    continue  # it started none: the deadline
                failure = "its process ended without finishing it"
            print(f"{first}: {failure}", flush=True)  # recorded: a resume does not spend the device's time on it
            report = json.loads(path.read_text()) if path.exists() else {"results": []}
            report["results"].append({"rung": first, "chosen": "", "stats": {}, "errors": {"the rung": failure}})
            _write(path, report)
    _report(path, a.out)


def _report(path: Path, out: str) -> None:
    if path.exists():
        report = json.loads(path.read_text())
        report.setdefault("meta", {"device": "no rung finished", "date": time.strftime("%Y-%m-%d")})
        report.update(judged(report["results"]))
        _write(path, report)
        Path(out + ".md").write_text(markdown(report))


if __name__ == "__main__":
    main()

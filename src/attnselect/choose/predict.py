"""A candidate's predicted time for a call, from a calibration (:mod:`attnselect.choose.calibration`).

The GPU time comes from the candidate's curve over work sizes: interpolated between the two measured points around
the call's work (linear in log-log), the first point's time below the ladder (launch-bound), and the last point's
throughput above it. Work is the score pairs the mask leaves visible times the query heads times d_qk + d_v
(:func:`work`), so one curve covers batch, heads, lengths and masks. A call is predicted at its work's class
(:func:`work_class`: work rounded to a step of 2^(1/8), 9%), so the calls of a class share one ranking: a packed
loop's new packing every step finds its ranking made (:func:`attnselect.choose.selection.select_packed`). Where the
call's head dims were not calibrated, the candidate's curve at the nearest calibrated dims (by d_qk + d_v) stands
in, and the prediction says so. The host time is the backend's time to issue a call of that layout and phase (none
for a call captured into a CUDA graph: its replays issue nothing on the host). A packed call's is the mean over the
:data:`PACKING_SHARED_BY` calls of a step that share its packing, where the calibration measured a new packing's
call (``new_packing_us``: its runner's per-packing work and, at sizes not seen, its decision) beside a call on a
packing already seen. A backend whose runner replays its forward (FA4: ``Backend.calls_before_replay``, the calls of
a shape or packing it makes through its interface first) is predicted, in inference, at its replayed host time
(``replayed_host_us``): a dense call's first calls of a shape are priced per shape
(:mod:`attnselect.choose.first_calls`), and a packed call's mean counts them among the calls sharing a packing, each
packing taken as new. Not under torch.compile, whose calls run FA4's function once each.

The two combine as a stack of layers runs them (:data:`UNHIDDEN`): a model issues its layers' calls back to back, so
while the GPU runs one call the host issues the next, and a step takes the longer of the two and part of the shorter.
A call alone, synchronised, takes their sum (packed, with a new packing's host time), less, in dense training, the
backward's host time its forward's GPU time hides (:attr:`Curve.forward`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from attnselect.choose.calibration import CURVE_KEY, curve_key, host_key, replayed
from attnselect.spec import masks
from attnselect.spec.options import Candidate
from attnselect.spec.problem import AttentionProblem

# The share of the shorter of a call's host and GPU times a stack of layers does not hide behind the longer. Fitted
# on the H200 size ladders' forced dense rows (benchmarks/ladder_rules.py, results/cpu_ladder_rules_all.md: 474 rows
# of five runs), as the median of log(measured / predicted) for a layer of a stack: +0.061 against max(host, GPU),
# +0.155 on the 144 rows where neither time is twice the other; with a quarter of the shorter added, -0.003 and
# -0.034 (a half: -0.055 and -0.178). A call alone: +0.032 against host + GPU.
UNHIDDEN = 0.25
# The calls that share a packed step's packing, in a stack's prediction: the first pays the new packing's host time
# (its decision, its runner's per-packing work), the others the time of a call on a packing already seen. The size
# ladder's stacks share a packing across 8 layers (benchmarks/ladder.py, --layers); a model has as many or more.
PACKING_SHARED_BY = 8


@dataclass(frozen=True, init=False)
class Prediction:
    """A candidate's predicted host and GPU times for a call, and how they combine (worked out once: rankings read
    them many times a draw)."""

    host_us: float  # a call's host time in a stack of layers (packed: the mean over the calls sharing a packing)
    gpu_us: float
    basis: str  # the curve it comes from, e.g. "dense 192/128 training" or "... (nearest calibrated dims)"
    # packed: the host time of a new packing's call, where calibrated (a call alone on a new packing waits for it)
    new_packing_host_us: float | None = None
    # dense training: the backward's host time a call alone hides behind its forward's GPU time (:attr:`Curve.forward`)
    hidden_us: float = 0.0
    # a replayed forward's (``host_us``): the host time of the calls before it replays, where calibrated
    before_replay_us: float | None = None
    # a call's time in a stack of layers, where the host's work overlaps the GPU's but for UNHIDDEN of the shorter:
    # what candidates rank by
    total_us: float = field(init=False, compare=False, repr=False)
    # a call's time alone, waiting for host and GPU but for what the forward's GPU time hides of the backward's host
    # time: what settles a tie (attnselect.choose.rules.settled)
    alone_us: float = field(init=False, compare=False, repr=False)

    def __init__(
        self,
        host_us: float,
        gpu_us: float,
        basis: str,
        new_packing_host_us: float | None = None,
        hidden_us: float = 0.0,
        before_replay_us: float | None = None,
    ) -> None:
        longer, shorter = (host_us, gpu_us) if host_us >= gpu_us else (gpu_us, host_us)
        alone_host = host_us if new_packing_host_us is None else new_packing_host_us
        # the fields in one write (a frozen dataclass's own __init__ sets each one through object.__setattr__: a
        # microsecond a prediction, and a new packing's ranking makes one for each candidate)
        self.__dict__.update(
            host_us=host_us,
            gpu_us=gpu_us,
            basis=basis,
            new_packing_host_us=new_packing_host_us,
            hidden_us=hidden_us,
            before_replay_us=before_replay_us,
            total_us=longer + UNHIDDEN * shorter,
            alone_us=alone_host + gpu_us - hidden_us,
        )

    @property
    def before_replay_total_us(self) -> float | None:
        """A call's time in a stack before its forward replays (its host time :attr:`before_replay_us`), where it
        replays; None otherwise."""
        if self.before_replay_us is None:
            return None
        return Prediction(self.before_replay_us, self.gpu_us, self.basis).total_us

    def __str__(self) -> str:
        first = "" if self.new_packing_host_us is None else f", a new packing's call {self.new_packing_host_us:.1f}"
        return f"{self.total_us:.1f} us (host {self.host_us:.1f}{first}, GPU {self.gpu_us:.1f})"


def visible_pairs(mask: str, window, seqlen_q: int, seqlen_kv: int) -> int:
    """The (query, key) pairs a mask leaves visible in one sequence: query i sees keys i + offset - left ..
    i + offset + right (:func:`attnselect.spec.masks.band`), clipped to the keys. Summed in closed form (a new
    packing's first call predicts at its sizes): every pair without a mask, the triangle of a causal mask on as many
    queries as keys, else :func:`_banded_pairs`."""
    if mask == "none":
        return seqlen_q * seqlen_kv
    if seqlen_q == seqlen_kv and mask in ("causal", "causal_bottom_right"):  # both anchors coincide: i sees 0..i
        return seqlen_q * (seqlen_q + 1) // 2
    return _banded_pairs(mask, window, seqlen_q, seqlen_kv)


@functools.lru_cache(maxsize=4096)
def _banded_pairs(mask: str, window, seqlen_q: int, seqlen_kv: int) -> int:
    """:func:`visible_pairs` of any mask: between the points where either edge of the band meets the keys' ends, the
    count per query is linear in i."""
    band = masks.band(mask, window, seqlen_q, seqlen_kv)
    if band is None or seqlen_q == 0 or seqlen_kv == 0:
        return seqlen_q * seqlen_kv
    offset, left, right = band
    last = seqlen_kv - 1
    # query i's keys: max(i + low, 0) .. min(i + high, last); an unbounded edge is clipped at every query
    low = offset - left if left is not None else -seqlen_q - seqlen_kv
    high = offset + right if right is not None else seqlen_q + seqlen_kv
    cuts = sorted({0, seqlen_q, *(min(max(at, 0), seqlen_q) for at in (-low, last - high))})

    def count(i: int) -> int:
        return min(i + high, last) - max(i + low, 0) + 1

    total = 0
    for start, stop in zip(cuts, cuts[1:]):  # each edge clipped for all of [start, stop) or for none of it
        slope = count(start + 1) - count(start) if stop - start > 1 else 0
        first, end = start, stop  # the queries of this piece that see a key
        if slope > 0:
            first = max(start, start - count(start) + 1)
        elif slope < 0:
            end = min(stop, start + count(start))
        elif count(start) <= 0:
            continue
        if end > first:
            total += (end - first) * (count(first) + count(end - 1)) // 2
    return total


def work(problem: AttentionProblem) -> float:
    """The call's work in units of 1e6: visible score pairs x query heads x (d_qk + d_v).

    A packed call's lengths are not read (a sync); the host knows its sequences (``batch``), the longest lengths and
    q's rows (``tokens``). Its pairs are estimated as one sequence at the longest lengths and the others sharing the
    rest of the tokens evenly: the least the pairs can be, given the longest. Over the size ladder's and the
    calibration's seeded packings (results/cpu_packed_work_estimates.md) a causal pack's work is 1.0-1.9x this
    estimate, where batch x the longest's (a pack without ``tokens``) overstates it up to 50x."""
    return work_counter(problem)(problem.batch, problem.seqlen_q, problem.seqlen_kv, problem.tokens)


def work_counter(problem: AttentionProblem) -> Callable[[int, int, int, int], float]:
    """``work_at(sequences, seqlen_q, seqlen_kv, tokens)``: :func:`work` of ``problem`` at these sizes, its other
    fields as they are, read once here (a packed loop's family counts each new packing's work with one)."""
    mask, window = problem.mask, problem.window
    per_pair = problem.heads_q * (problem.head_dim_qk + problem.head_dim_v)

    def work_at(sequences: int, seqlen_q: int, seqlen_kv: int, tokens: int) -> float:
        pairs = visible_pairs(mask, window, seqlen_q, seqlen_kv)
        others = rest_lengths(sequences, seqlen_q, seqlen_kv, tokens)
        if others is None:
            pairs *= sequences
        else:
            pairs += (sequences - 1) * visible_pairs(mask, window, *others)
        return per_pair * pairs / 1e6

    return work_at


def rest_lengths(sequences: int, seqlen_q: int, seqlen_kv: int, tokens: int) -> tuple[int, int] | None:
    """The (q, kv) lengths :func:`work` estimates a packed call's sequences other than the longest at, given its
    sequence count, longest lengths and q's rows (``tokens``): the rest of the rows shared evenly, at most the
    longest; None where it does not know them (no ``tokens``, one sequence, a dense call), and every sequence counts
    at the longest."""
    if not (tokens and seqlen_q and sequences > 1):
        return None
    rest = (tokens - seqlen_q) / (sequences - 1) if tokens > seqlen_q else 0  # at least 0, at most the longest
    if rest > seqlen_q:
        rest = seqlen_q
    return round(rest), round(rest * seqlen_kv / seqlen_q)


WORK_STEPS = 8  # work classes per doubling of work
NO_WORK = -(2**31)  # the class of a call with no work (below every other)


def work_class(problem: AttentionProblem) -> int:
    """The class of the call's :func:`work`: ``round(WORK_STEPS * log2(work))`` (work 0 is the lowest class)."""
    return work_classes(problem)(problem.batch, problem.seqlen_q, problem.seqlen_kv, problem.tokens)


def work_classes(problem: AttentionProblem) -> Callable[[int, int, int, int], int]:
    """``work_class_at(sequences, seqlen_q, seqlen_kv, tokens)``: :func:`work_class` of ``problem`` at these sizes
    (:func:`work_counter`)."""
    work_at = work_counter(problem)

    def work_class_at(sequences: int, seqlen_q: int, seqlen_kv: int, tokens: int) -> int:
        at = work_at(sequences, seqlen_q, seqlen_kv, tokens)
        return round(WORK_STEPS * math.log2(at)) if at > 0 else NO_WORK

    return work_class_at


def class_work(work_class: int) -> float:
    """The work a class is predicted at: its centre, ``2 ** (work_class / WORK_STEPS)``."""
    return 2.0 ** (work_class / WORK_STEPS) if work_class != NO_WORK else 0.0


class Curve(NamedTuple):
    """What a calibration predicts a candidate's calls of one kind from, whatever their sizes: the host time of a call
    and the GPU curve's [work, us] points, with the basis that names the curve (:func:`curve`)."""

    host_us: float
    points: list
    basis: str
    new_packing_host_us: float | None = None
    # dense training: (the backward's host time, the forward's GPU curve), where the calibration has the same
    # candidate's inference curve and host time. A call alone issues its backward while its forward runs on the GPU
    # (autograd does not wait for it), so it waits for the forward's host time, the longer of the forward's GPU time
    # and the backward's host time, then the backward's GPU time. Over the H200 size ladders' forced dense training
    # rows (benchmarks/ladder_rules.py, results/cpu_ladder_rules_hidden.md) log(measured / predicted) alone had a
    # median of +0.049 and a root mean square of 0.174 so, against -0.065 and 0.191 for host + GPU. Packed calls keep
    # host + GPU: no packed rung was scored.
    forward: tuple[float, list] | None = None
    before_replay_us: float | None = None  # Prediction.before_replay_us

    def at(self, problem: AttentionProblem) -> Prediction:
        """The predicted time of ``problem``'s call, at its work class."""
        return self.at_class(work_class(problem))

    def at_class(self, work_class: int) -> Prediction:
        """The predicted time of a call of this work class."""
        at = class_work(work_class)
        gpu = _along(self.points, at)
        hidden = min(self.forward[0], _along(self.forward[1], at), gpu) if self.forward is not None else 0.0
        return Prediction(self.host_us, gpu, self.basis, self.new_packing_host_us, hidden, self.before_replay_us)


def predict(
    candidate: Candidate, problem: AttentionProblem, calibration: dict, *, calls_before_replay: int = 0
) -> Prediction | None:
    """The candidate's predicted time for ``problem``, or None where the calibration has no curve or host time of
    its backend for this layout and phase."""
    found = curve(candidate, problem, calibration, calls_before_replay=calls_before_replay)
    return found.at(problem) if found is not None else None


def curve(
    candidate: Candidate, problem: AttentionProblem, calibration: dict, *, calls_before_replay: int = 0
) -> Curve | None:
    """The :class:`Curve` that predicts ``candidate``'s calls like ``problem`` (its layout, head dims, padding, phase
    and capture, not its sizes), or None where the calibration has no curve or host time of its backend for them.
    ``calls_before_replay``: its backend's (``Backend.calls_before_replay``), where its forward's replayed host time
    counts."""
    kind = host_key(problem.layout, candidate.padded, problem.training)
    host = calibration["host_us"].get(candidate.backend, {}).get(kind)
    curves = calibration["gpu"].get(candidate.backend, {})
    key = curve_key(problem.layout, problem.head_dim_qk, problem.head_dim_v, candidate.padded, problem.training)
    basis = key
    if key not in curves:
        key = _nearest(curves, problem, candidate.padded)
        basis = f"{key} (nearest calibrated dims)"
    if key is None or host is None:
        return None
    if problem.cuda_graph_capture:  # a captured call is replayed from the graph: no host time to issue it
        return Curve(0.0, curves[key], basis)
    host = float(host)
    forward = _forward(candidate, problem, calibration, curves, key, host)
    # a forward that needs no gradient replays, but under torch.compile (a call each)
    replaying = calls_before_replay and not problem.compiled_graph
    replay = replayed(calibration, candidate.backend, kind) if replaying else None
    new = calibration.get("new_packing_us", {}).get(candidate.backend, {}).get(kind)
    if problem.layout != "thd":  # a shape's first calls: priced per shape (attnselect.choose.first_calls)
        if replay is not None:
            return Curve(replay, curves[key], basis, None, forward, host)
        return Curve(host, curves[key], basis, None, forward)
    if new is None and replay is None:
        return Curve(host, curves[key], basis)
    # the calls sharing a packing: the first on a new packing (its call does all a seen one does, and more), then
    # through the interface until the replay, if any; a call alone is the first
    first = max(float(new), host) if new is not None else host
    if replay is None:
        return Curve(host + (first - host) / PACKING_SHARED_BY, curves[key], basis, first)
    through = min(calls_before_replay, PACKING_SHARED_BY) - 1
    mean = (first + through * host + (PACKING_SHARED_BY - 1 - through) * replay) / PACKING_SHARED_BY
    return Curve(mean, curves[key], basis, first, None, host)


def _forward(
    candidate: Candidate, problem: AttentionProblem, calibration: dict, curves: dict, key: str, host: float
) -> tuple[float, list] | None:
    """:attr:`Curve.forward` of ``problem``'s call on the curve ``key`` of ``curves`` (the backend's) with this host
    time: for a dense training call, the backward's host time (training's less inference's) and the inference curve at
    the curve's dims and padding; None for other calls, and where either is not calibrated."""
    if not problem.training or problem.layout == "thd":
        return None
    forward_host = calibration["host_us"][candidate.backend].get(host_key(problem.layout, candidate.padded, False))
    layout, d_qk, d_v = CURVE_KEY.fullmatch(key).group(1, 2, 3)
    points = curves.get(curve_key(layout, int(d_qk), int(d_v), candidate.padded, False))
    if forward_host is None or points is None:
        return None
    return max(host - float(forward_host), 0.0), points


def _nearest(curves: dict, problem: AttentionProblem, padded: bool) -> str | None:
    """The key of the curve of the same layout, phase and padding at the nearest calibrated d_qk + d_v."""
    size = problem.head_dim_qk + problem.head_dim_v
    best = None
    for key in curves:  # keys the loader checked against CURVE_KEY
        d_qk, d_v = (int(d) for d in CURVE_KEY.fullmatch(key).group(2, 3))
        if key != curve_key(problem.layout, d_qk, d_v, padded, problem.training):  # another layout, phase, padding
            continue
        distance = abs(d_qk + d_v - size)
        if best is None or distance < best[0]:
            best = (distance, key)
    return best[1] if best else None


def _along(points: list, at: float) -> float:
    """The time at work ``at`` along measured [work, us] points (increasing work)."""
    if at <= points[0][0]:
        return float(points[0][1])
    if at >= points[-1][0]:
        return float(points[-1][1]) * at / points[-1][0]
    for (w0, t0), (w1, t1) in zip(points, points[1:]):
        if w0 <= at <= w1:
            if t0 <= 0 or t1 <= 0:
                return float(t0 + (t1 - t0) * (at - w0) / (w1 - w0))
            share = (math.log(at) - math.log(w0)) / (math.log(w1) - math.log(w0))
            return float(math.exp(math.log(t0) + share * (math.log(t1) - math.log(t0))))
    return float(points[-1][1])

"""The measure policy: time the supported candidates on this machine and keep the fastest.

Candidates are timed with :func:`attnselect.choose.timing.time_steps` on the problem's bucket. The fastest median wins,
except that a candidate the rules rank higher wins when its median lies inside the fastest one's spread and within
2% of it. Packed problems are measured on a bucket (powers of two of batch and lengths), so a loop whose packing
changes every step tunes a few times, not every step, and on a new packing of that bucket for every call, as such
a loop brings them: a candidate that builds something per packing pays for it in its timing. The time spent per
problem is bounded by ``TUNING_BUDGET_S``; candidates not reached by then keep their rules order behind the
measured ones, and the log says so. Measurements are kept in the decision cache (:mod:`attnselect.choose.store`); under
torch.distributed rank 0 measures and broadcasts, so every rank runs the same kernel.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import replace

import torch

from attnselect.backends.shape_cache import Rounding
from attnselect.choose import debug, store
from attnselect.choose.distributed import broadcast_from_rank_zero, is_distributed, rank
from attnselect.choose.timing import CONTENDER_FACTOR, Timing, candidate_step, random_inputs, time_steps
from attnselect.errors import InvalidInputError, NoSupportedCandidateError
from attnselect.spec.options import Candidate
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target

log = logging.getLogger("attnselect")

TUNING_BUDGET_S = 10.0  # per problem
TIE_TOLERANCE = 0.02  # a rules-preferred candidate this close to the fastest (and inside its spread) wins


def bucket(problem: AttentionProblem) -> AttentionProblem:
    """The problem a packed call is tuned as: batch and lengths rounded up to powers of two, its tokens left out (the
    bucket is timed on packings of its own: :class:`~attnselect.choose.timing.NewPackings`)."""
    if problem.layout != "thd":
        return problem
    up = Rounding()  # powers of two
    return dataclasses.replace(
        problem, batch=up(problem.batch), seqlen_q=up(problem.seqlen_q), seqlen_kv=up(problem.seqlen_kv), tokens=0
    )


def measure(
    problem: AttentionProblem, target: Target, ranked: tuple[Candidate, ...], budget_s: float | None = None
) -> dict[Candidate, Timing | None]:
    """Time the candidates side by side (:func:`time_steps`); None marks a candidate that failed.

    Candidates are warmed up in rules order while half the budget lasts; the rest keep their rules
    order, and the log says so. The timed rounds share what is left of the budget.
    """
    budget_s = TUNING_BUDGET_S if budget_s is None else budget_s  # read per call: tests and tools may change it
    device = torch.device("cuda" if target.is_cuda else "cpu")
    problem = bucket(problem)
    try:
        inputs = random_inputs(problem, device)
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError, or a size the allocator refuses
        raise _Untimeable(f"{type(exc).__name__}: {str(exc)[:200]}") from exc
    results = time_steps(
        {c: candidate_step(c, problem, target, inputs) for c in ranked},
        device,
        budget_s=budget_s,
        warmup_budget_s=budget_s / 2,
        finite=True,
        keep_within=CONTENDER_FACTOR,
    )
    timings: dict[Candidate, Timing | None] = {}
    for candidate, result in results.items():
        if isinstance(result, Exception):  # a candidate that fails while tuning is out, and said so
            log.warning(
                "attnselect: %s failed while tuning %s: %s: %s",
                candidate,
                problem.describe(),
                type(result).__name__,
                result,
            )
        timings[candidate] = result if isinstance(result, Timing) else None
    if len(results) < len(ranked):
        log.info(
            "attnselect: tuning budget of %.0f s spent after warming up %d of %d candidates for %s; the rest "
            "keep their rules order",
            budget_s,
            len(results),
            len(ranked),
            problem.describe(),
        )
    return timings


def choose(ranked: tuple[Candidate, ...], timings: dict[Candidate, Timing | None]) -> tuple[Candidate, ...]:
    """The candidates best first: measured by time, then the unmeasured in rules order; failed ones are dropped.

    A tie goes to the rules order: a median inside the fastest one's spread (p80) and within
    TIE_TOLERANCE of its median, so a noisy spread never costs more than that.
    """
    measured = [c for c in ranked if timings.get(c) is not None]
    if not measured:
        return tuple(c for c in ranked if c not in timings)
    fastest = timings[min(measured, key=lambda c: timings[c].median_ms)]
    tie = min(fastest.high_ms, fastest.median_ms * (1 + TIE_TOLERANCE))
    winner = next(c for c in measured if timings[c].median_ms <= tie)
    by_time = sorted((c for c in measured if c != winner), key=lambda c: timings[c].median_ms)
    return (winner, *by_time, *(c for c in ranked if c not in timings))


def measured(problem: AttentionProblem, target: Target, ranked: tuple[Candidate, ...]):
    """Rank by measurement: from the persistent cache, else timed here (by rank 0 under torch.distributed,
    then broadcast, so every rank runs the same kernel)."""
    if target not in (Target.current(), Target.current("cpu")):
        raise InvalidInputError(
            f"policy: 'measure' times kernels on this machine, but the target is "
            f"{target.describe()}; use policy='rules' to simulate other machines"
        )
    # A call under CUDA graph capture shares the measurement of the same call outside capture (its warm-up),
    # restricted to the candidates capture allows; nothing can be timed or broadcast while capturing.
    key = store.entry_key(bucket(replace(problem, cuda_graph_capture=False)), "measure", target)
    if problem.cuda_graph_capture:
        found = _from_store(store.lookup(key), ranked, key, problem)
        if found is None:
            debug.LOGGER.info(
                "attnselect: no measured decision for %s to reuse under CUDA graph capture (kernels "
                "cannot be timed while capturing); using the rules order. Warm up before capturing.",
                problem.describe(),
            )
            return ranked, None
        return found
    distributed = is_distributed()
    entry = None
    if not distributed or rank() == 0:
        entry = store.lookup(key)
        if _from_store(entry, ranked, key, problem) is None:
            try:
                entry = _measure_entry(problem, target, ranked)
            except _Untimeable as exc:  # nothing stored: a later process, or a smaller size, may time it
                log.warning("attnselect: cannot make inputs to time %s on %s (%s); the rules order stands",
                            problem.describe(), target.describe(), exc)  # fmt: skip
                entry = None
            else:
                store.remember(key, entry)
    if distributed:
        entry = broadcast_from_rank_zero(entry)
        if rank() != 0 and entry is not None:
            store.keep(key, entry)  # rank 0 wrote it; every rank finds it later (e.g. under CUDA graph capture)
    found = _from_store(entry, ranked, key, problem)
    return found if found is not None else (ranked, None)


class _Untimeable(Exception):
    """The measure policy could not make the problem's inputs on the target (too large for its memory)."""


def _measure_entry(problem, target, ranked) -> dict:
    timings = measure(problem, target, ranked)
    order = choose(ranked, timings)
    if not order:
        raise NoSupportedCandidateError(
            f"every supported candidate failed while tuning {problem.describe()}: " + "; ".join(str(c) for c in timings)
        )
    return {
        "ranked": [c.to_dict() for c in order],
        "timings": [
            {"candidate": c.to_dict(), "ms": None if t is None else [t.median_ms, t.low_ms, t.high_ms]}
            for c, t in timings.items()
        ],
    }


def _from_store(entry, ranked, key, problem):
    """(ranked, timings) from ``problem``'s cache entry at ``key``, or None when it is missing, malformed (one warning
    naming the problem), names no supported candidate or leaves its first one untimed."""
    if not entry or not isinstance(entry.get("timings"), list):  # missing, or written before timings were a list
        return None
    supported = set(ranked)
    try:
        order = tuple(c for c in (Candidate(**d) for d in entry["ranked"]) if c in supported)
        timings = {}
        for timed in entry["timings"]:
            c = Candidate(**timed["candidate"])
            if c in supported:
                timings[c] = None if timed["ms"] is None else Timing(*map(float, timed["ms"]))
    except (TypeError, KeyError, ValueError, AttributeError, OverflowError) as exc:  # OverflowError: an int past float
        store.malformed(key, exc, f"the measured decision for {problem.describe()}")
        return None
    if not order or timings.get(order[0]) is None:  # the choice's timing is what its decision reports
        return None
    return order, timings

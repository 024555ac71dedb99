"""The timing harness: steps timed side by side in interleaved rounds, and the inputs they run on.

Each step (a candidate's call, forward or forward+backward) runs on random inputs of the problem's shape:
warm-up, then timed repeats in interleaved rounds (every step takes its turn in each round, in another order
each round, so drift of clocks or temperature, and what ran just before, land on all of them alike), each
repeat timed with CUDA events (wall clock on the CPU); its median and 20th..80th percentile spread are kept.
The first round (three repeats each) screens: after it only the contenders (within 25% of the fastest) go on,
for many short turns rather than a few long ones, since on a GPU a kernel's time varies from turn to turn
(clock and power state) far more than within one turn. The measure policy (:mod:`attnselect.choose.measure`)
and ``attnselect bench`` time their candidates with it. Packed problems run on a new packing for every call
(:class:`NewPackings`), as a training loop brings them.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import statistics
import time
import traceback
from dataclasses import dataclass

import torch

from attnselect.spec.options import Candidate, Packing
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target

log = logging.getLogger("attnselect")

WARMUP, REPEATS = 1, 32  # repeats: two in each of the ROUNDS, fewer where the budget says so; the call that
# sizes the repeats (time_steps) follows the warm-up, a second one in effect
ROUNDS = 16  # interleaved rounds of repeats: drift lands on every candidate alike
CONTENDER_FACTOR = 1.25  # after the first round, candidates slower than this times the fastest stop
SCREENING_REPEATS = 3  # with a contender factor, the first round's repeats (fewer under a tight budget)
FAR_BEHIND = 4.0  # ... and steps whose sizing call took this times the fastest one's skip even that
SPIN_CYCLES_PER_MS = 2_000_000  # torch.cuda._sleep cycles per ms at a ~2 GHz SM clock (slower clocks spin longer)


@dataclass(frozen=True)
class Timing:
    median_ms: float
    low_ms: float  # 20th percentile
    high_ms: float  # 80th percentile
    repeats: int = 0  # the timed calls it rests on (0: not recorded, as in the decision cache)

    def __str__(self) -> str:
        return f"{self.median_ms:.3f} ms ({self.low_ms:.3f}..{self.high_ms:.3f})"


@dataclass(frozen=True)
class Settle:
    """After :func:`time_steps`' rounds, more rounds of the steps whose median lies within ``within`` times the
    fastest one's (a factor, as ``keep_within``), until ``seconds`` have passed or ``rounds`` rounds have run
    in all: near-ties get the turns that rank them (``attnselect bench``, which judges choices 2% apart,
    settles them). A step that fails while settling keeps its earlier timing, and the log says so."""

    within: float
    seconds: float
    rounds: int


def candidate_step(candidate: Candidate, problem: AttentionProblem, target: Target, inputs: tuple):
    """``step()``: one call of ``candidate`` on ``inputs`` (:func:`random_inputs`), with its backward when
    training; returns the output."""
    from attnselect.execution import kernel_call, run_call

    q, k, v, grad_out, packing = inputs
    call = kernel_call(problem)

    def step():
        out, _ = run_call(
            candidate, problem, call, q, k, v, target=target, packing=packing() if callable(packing) else packing
        )
        if problem.training:
            torch.autograd.grad(out, (q, k, v), grad_out)
        return out

    return step


def time_step(
    step,
    device: torch.device,
    *,
    warmup: int = WARMUP,
    repeats: int = REPEATS,
    budget_s: float | None = None,
    queued: bool = True,
) -> Timing:
    """Median and p20..p80 of ``step``'s timed repeats after warm-up (:func:`time_steps` of one step, in one
    round); raises its error if it fails."""
    result = time_steps({0: step}, device, warmup=warmup, repeats=repeats, rounds=1, budget_s=budget_s, queued=queued)[
        0
    ]
    if isinstance(result, Exception):
        raise result
    return result


def time_steps(
    steps: dict,
    device: torch.device,
    *,
    warmup: int = WARMUP,
    repeats: int = REPEATS,
    rounds: int = ROUNDS,
    budget_s: float | None = None,
    warmup_budget_s: float | None = None,
    queued: bool = True,
    spin: bool = True,
    finite: bool = False,
    keep_within: float | None = None,
    settle: Settle | None = None,
) -> dict:
    """Time several steps side by side: ``{key: Timing}``, or ``{key: the exception}`` where a step failed.

    Each step is warmed up (``finite``: its first output must be finite, or it fails), then every
    step runs its repeats in ``rounds`` interleaved rounds, so slow drift of clocks or
    temperature lands on all steps alike (each round in another order, :func:`_round_order`); a
    step's Timing is the median and p20..p80 of all its repeats (CUDA events on GPUs, wall clock
    on the CPU). A step that raises, in warm-up or in a round, gets its exception (its
    traceback's frames cleared, so the step's tensors are freed) and leaves the later rounds.
    ``queued`` (the default) issues a round's repeats back to back, each between its own pair of
    events, and waits once per round, as a training loop does; on a GPU each step's turn starts
    behind a spin (``torch.cuda._sleep``, :func:`_spin_ms`) long enough for the host to issue its
    repeats ahead, so a repeat measures the GPU's time even where the host is the slower (a step's
    host cost is not what is compared; what ran just before does not matter; ``spin=False`` leaves
    it out, and the timings of host-bound steps then depend on the queue). ``queued=False``
    waits after every repeat, which adds each call's host overhead in full (the latency of an
    isolated call). ``budget_s`` sizes the repeats, from one synchronised call of each step, so
    that everything fits in that many seconds from the start (where it buys less than one repeat
    a round, fewer rounds run), with at least three repeats for every step that stays to the end;
    ``warmup_budget_s`` stops warming up further steps once that many seconds have passed (those
    are left out of the result). ``keep_within``: the first round screens. Steps whose
    synchronised sizing call, less the host's time to issue it, took more than FAR_BEHIND times
    the fastest one's call leave before it, with that call's time; the rest run SCREENING_REPEATS
    repeats (fewer where half the budget left does not buy them); then steps slower than
    ``keep_within`` times the fastest leave with the first round's Timing, and with ``budget_s``
    the later rounds' repeats are sized for the steps still in contention. Should the contenders
    all fail later, the others' first-round Timings stand. ``settle`` (:class:`Settle`) then runs
    more rounds of the near-tied steps, on top of the budget. Each Timing counts its repeats.
    """
    start = time.perf_counter()
    results, ready, sizes, issue_ms = {}, {}, {}, {}
    spinning = queued and spin and device.type == "cuda"
    for key, step in steps.items():
        if warmup_budget_s is not None and ready and time.perf_counter() - start > warmup_budget_s:
            break
        try:
            for i in range(max(warmup, 1 if finite else 0)):
                out = step()
                if finite and i == 0 and not bool(torch.isfinite(out).all()):
                    raise FloatingPointError("non-finite output for finite input")
                del out  # not held through the rounds
            if budget_s is not None or spinning or keep_within is not None:
                sizes[key], issued = _sized_call(step, device)
                if spinning:
                    issue_ms[key] = issued
        except Exception as exc:  # a failing step is part of the result
            results[key] = _released(exc)
            continue
        ready[key] = step

    def fitting(share: float) -> int:
        """How many repeats of each ready step fit in ``share`` of the budget left (unbounded without one)."""
        if budget_s is None or not ready:
            return 1 << 30
        left_ms = max(budget_s - (time.perf_counter() - start), 0.0) * 1e3
        # A round of n repeats costs the spins' fixed part plus n times (sizes and the spins' part per repeat).
        spin_fixed = sum(_spin_ms(sizes[key], issue_ms.get(key, 0.0), 0) for key in ready)
        per_repeat = sum(sizes[key] + _spin_ms(sizes[key], issue_ms.get(key, 0.0), 1) for key in ready) - spin_fixed
        return int((left_ms * share - spin_fixed) / max(per_repeat, 1e-3))

    def schedule(rounds_left: int, least: int) -> tuple[int, int]:
        """(rounds, repeats in each) for up to ``rounds_left`` rounds: ceil(repeats / rounds) a round, fewer
        where the budget says so; where it buys less than one a round, as many rounds of one as it buys (about:
        one round's spins counted); ``least`` repeats in all at least."""
        if rounds_left < 1:
            return 0, 0
        per_round = max(1, -(-max(repeats, 1) // rounds))  # ceil(repeats / rounds)
        fits = fitting(1 / rounds_left)
        if fits >= 1:
            return rounds_left, max(min(per_round, fits), -(-least // rounds_left))
        count = min(rounds_left, max(fitting(1.0), least))
        return count, max(1, -(-least // max(count, 1)))

    def keep_within_of_fastest(factor: float) -> None:
        """Only the ready steps whose median lies within ``factor`` times the fastest one's go on."""
        fastest = min(statistics.median(samples[key]) for key in ready)
        for key in [key for key in ready if statistics.median(samples[key]) > factor * fastest]:
            del ready[key]

    samples = {key: [] for key in ready}

    def run_round(index: int, per_round: int, settling: bool = False) -> None:
        failed = {}
        pending = {}
        for key in _round_order(list(ready), index):
            step = ready[key]
            try:
                if key in issue_ms:  # a backlog, so the host issues every repeat before the GPU needs it
                    torch.cuda._sleep(int(_spin_ms(sizes[key], issue_ms[key], per_round) * SPIN_CYCLES_PER_MS) + 1)
                pending[key] = [_timed_call(step, device, wait=not queued) for _ in range(per_round)]
            except Exception as exc:
                failed[key] = exc
        for key, calls in pending.items():
            try:
                samples[key] += [elapsed() for elapsed in calls]
            except Exception as exc:  # an asynchronous error surfaces when its events are read
                failed[key] = exc
        for key, exc in failed.items():
            ready.pop(key, None)
            if settling:  # its rounds so far stand
                log.warning(
                    "attnselect: %s failed while settling a near-tie, after %d timed calls; those stand: %s: %s",
                    key,
                    len(samples[key]),
                    type(exc).__name__,
                    exc,
                )
            else:
                results[key] = _released(exc)

    index = 0
    if keep_within is None:
        count, per_round = schedule(rounds, least=3)
    else:  # the screening round; steps far behind on their sizing call, even less their host's time, skip it
        fastest = min((sizes[key] for key in ready), default=0.0)
        for key in [key for key in ready if sizes[key] - issue_ms.get(key, 0.0) > FAR_BEHIND * fastest]:
            results[key] = Timing(sizes[key], sizes[key], sizes[key], repeats=1)
            del ready[key]
        screening = max(1, min(SCREENING_REPEATS, fitting(1 / 2)))  # at most half of what is left
        run_round(0, screening)
        index = 1
        if ready:
            keep_within_of_fastest(keep_within)
        count, per_round = schedule(rounds - 1, least=max(3 - screening, 0))
    for _ in range(count):
        run_round(index, per_round)
        index += 1
    if settle is not None and len(ready) > 1:
        keep_within_of_fastest(settle.within)
        until = time.perf_counter() + settle.seconds
        while len(ready) > 1 and index < settle.rounds and time.perf_counter() < until:
            run_round(index, max(per_round, 1), settling=True)
            index += 1
    for key, times in samples.items():
        if key not in results:
            results[key] = _timing(times)
    return {key: results[key] for key in steps if key in results}


def _round_order(keys: list, index: int) -> list:
    """The order of round ``index``: it starts at the index-th step and runs forward in even rounds, backward
    in odd ones, so no step always follows the same one (what runs just before, a hot or an idle GPU,
    can shift a timing by a few percent)."""
    if not keys:
        return keys
    start = index % len(keys)
    if index % 2 == 0:
        return keys[start:] + keys[:start]
    return [keys[(start - i) % len(keys)] for i in range(len(keys))]


def _released(exc: BaseException) -> BaseException:
    """``exc`` with the frames of its traceback, and of the exceptions it chains, cleared of their locals:
    kept, they would hold a failed step's tensors (e.g. the parts of an allocation that ran out of memory)."""
    chained, seen = exc, set()
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        traceback.clear_frames(chained.__traceback__)
        chained = chained.__cause__ or chained.__context__
    return exc


def _spin_ms(size_ms: float, issue_ms: float, repeats: int) -> float:
    """Twice the host's lead needed to issue ``repeats`` calls before the GPU reaches them: the first call's
    issue time, plus what each call's issue time exceeds its GPU time (about ``size_ms - issue_ms``, the
    synchronised call less its issuing) by. Short for GPU-bound steps, so the GPU hardly rests."""
    gpu_ms = max(size_ms - issue_ms, 0.0)
    return 2 * (issue_ms + repeats * max(issue_ms - gpu_ms, 0.0))


def _sized_call(step, device: torch.device) -> tuple[float, float]:
    """One synchronised call of ``step``: (its time, the host's time to issue it), in ms."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    elapsed = _timed_call(step, device, wait=False)
    issued = (time.perf_counter() - t0) * 1e3
    return elapsed(), issued


def _timed_call(step, device: torch.device, *, wait: bool):
    """Run ``step`` once; returns a function that gives its time in ms (waiting for the GPU if needed)."""
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        if wait:
            end.synchronize()

        def elapsed():
            end.synchronize()
            return begin.elapsed_time(end)

        return elapsed
    t0 = time.perf_counter()
    step()
    ms = (time.perf_counter() - t0) * 1e3
    return lambda: ms


def _timing(times: list[float]) -> Timing:
    if len(times) < 2:
        return Timing(times[0], times[0], times[0], repeats=len(times))
    low, _, _, high = statistics.quantiles(times, n=5, method="inclusive")  # within the samples
    return Timing(statistics.median(times), low, high, repeats=len(times))


def random_inputs(problem: AttentionProblem, device: torch.device):
    """q, k, v (requiring grad when training), an output gradient and, for thd, :class:`NewPackings` of the
    problem's size (a packing per call) or None."""
    from attnselect.spec.validate import DENSE_AXES

    packings = NewPackings(problem, device) if problem.layout == "thd" else None

    def make(side: str, heads: int, head_dim: int, grad=problem.training):
        if packings is not None:
            shape = (packings.tokens_q if side == "q" else packings.tokens_kv, heads, head_dim)
        else:
            dims = [0, 0, 0, head_dim]
            sizes = (problem.batch, problem.seqlen_q if side == "q" else problem.seqlen_kv, heads)
            for axis, size in zip(DENSE_AXES[problem.layout], sizes):
                dims[axis] = size
            shape = tuple(dims)
        return torch.randn(shape, device=device, dtype=problem.dtype).requires_grad_(grad)

    q = make("q", problem.heads_q, problem.head_dim_qk)
    k = make("kv", problem.heads_kv, problem.head_dim_qk)
    v = make("kv", problem.heads_kv, problem.head_dim_v)
    grad_out = make("q", problem.heads_q, problem.head_dim_v, grad=False)
    return q, k, v, grad_out, packings


class NewPackings:
    """``packings()``: the next of ``COUNT`` packings of a thd problem's size, as new boundary tensors each call.

    A data loader brings a new packing every step; so does this, within the problem's size: with batch B and
    lengths Sq, Skv, each packing has between B/2 + 1 and B sequences (B when B is 1) whose longest lies in
    (S/2, S], over fixed token totals of B * S / 2 (S for one sequence), so that each call does about the
    work of a typical packing of that size; a problem that holds its tokens (q's rows) is packed in as many (at most
    B * S), with as many more sequences as they need. Query and key lengths keep the problem's ratio (both are whole
    multiples of one length per sequence, their greatest common divisor's share); they share one boundary
    tensor when Sq == Skv. The packings are drawn once (seeded) and copied to the device before timing;
    every call clones its boundaries, so per-tensor caches see a new packing.
    """

    COUNT = 64

    def __init__(self, problem: AttentionProblem, device: torch.device, seed: int = 0):
        rng = random.Random(seed)
        batch = max(problem.batch, 1)
        sq, skv = max(problem.seqlen_q, 1), max(problem.seqlen_kv, 1)
        unit = math.gcd(sq, skv)
        factors = (sq // unit, skv // unit)
        units = unit if batch == 1 else batch * unit // 2
        if problem.tokens:
            units = min(max(problem.tokens // factors[0], 1), batch * unit)
        self.tokens_q, self.tokens_kv = units * factors[0], units * factors[1]
        self._shared, self._next = sq == skv, 0
        self._batch, self._unit, self._units, self._factors, self._device = batch, unit, units, factors, device
        self._packings = [self._packing(_lengths(rng, batch, unit, units)) for _ in range(self.COUNT)]

    def _packing(self, lengths: list[int]) -> tuple:
        """(cu_q, cu_kv, longest query length, longest key length) of sequences of ``lengths`` units."""
        cu_q, cu_kv = (
            torch.tensor([0, *itertools.accumulate(n * f for n in lengths)], dtype=torch.int32, device=self._device)
            for f in self._factors
        )
        return cu_q, cu_kv, max(lengths) * self._factors[0], max(lengths) * self._factors[1]

    def spanning(self) -> list[Packing]:
        """Packings of these tokens whose longest sequence spans every length they allow, from the tokens' even share
        of B sequences up to S, in steps of about sqrt(2): at each longest length, one with as few sequences as hold
        the tokens and one with as many as B allows (none empty), the others sharing the rest evenly. A packed job's
        packings range over these works, and its choice with them (attnselect.warmup makes each choice's first
        call)."""
        batch, units = self._batch, self._units
        least, most = -(-units // batch), min(self._unit, units)
        found = []
        for top in sorted({min(round(least * 2 ** (i / 2)), most) for i in range(64)}):
            for count in sorted({-(-units // top), min(batch, units - top + 1)}):  # no empty sequence
                rest = units - top
                even = [rest // (count - 1) + (i < rest % (count - 1)) for i in range(count - 1)] if count > 1 else []
                cu_q, cu_kv, max_q, max_kv = self._packing([top, *even])
                found.append(Packing(cu_q, cu_q if self._shared else cu_kv, max_q, max_kv, cu_q,
                                     cu_q if self._shared else cu_kv))  # fmt: skip
        return found

    def sizes(self) -> list[tuple[int, int, int, int]]:
        """Each packing's sequences, longest query and key lengths, and query tokens: what a call's problem holds."""
        return [(cu_q.numel() - 1, max_q, max_kv, self.tokens_q) for cu_q, _, max_q, max_kv in self._packings]

    def causal_pairs(self) -> float:
        """The mean over the packings of the (query, key) pairs top-left causal leaves visible, sum n (n + 1) / 2."""
        pairs = [sum(n * (n + 1) / 2 for n in torch.diff(cu_q).tolist()) for cu_q, *_ in self._packings]
        return sum(pairs) / len(pairs)

    def __call__(self) -> Packing:
        cu_q, cu_kv, max_q, max_kv = self._packings[self._next % self.COUNT]
        self._next += 1
        cu_q = cu_q.clone()
        cu_kv = cu_q if self._shared else cu_kv.clone()
        return Packing(cu_q, cu_kv, max_q, max_kv, cu_q, cu_kv)


def _lengths(rng, batch: int, longest: int, tokens: int) -> list[int]:
    """``count`` in (batch/2, batch] lengths summing to ``tokens`` (at most batch x longest; more than batch/2
    sequences where they need more), the longest in (longest/2, longest]."""
    if batch == 1:
        return [tokens]
    count = rng.randint(max(batch // 2 + 1, -(-tokens // longest)), batch)
    top = rng.randint(min(max(longest // 2 + 1, -(-tokens // count)), tokens), min(longest, tokens))
    rest, left = [top], tokens - top
    for i in range(count - 1, 0, -1):  # i sequences still to place, each at most top, together `left`
        low, high = max(left - (i - 1) * top, 0), min(top, left)
        n = rng.randint(low, high) if i > 1 else left
        rest.append(n)
        left -= n
    rng.shuffle(rest)
    return rest

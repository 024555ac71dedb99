"""The measure policy: time the supported candidates on this machine and keep the fastest.

Each candidate runs on random inputs of the problem's shape (forward, or forward+backward
when training): warm-up, then repeats queued back to back, each timed with CUDA events
(wall clock on the CPU); its median and 20th..80th percentile spread are kept. The fastest median wins, except that a
candidate the rules rank higher wins when its median lies inside the fastest one's spread and
within 2% of it.
Packed problems are measured on a bucket (powers of two of batch and lengths) filled with
full-length sequences, so a loop whose packing changes every step tunes a few times, not
every step. The time spent per problem is bounded by ``TUNING_BUDGET_S``; candidates not
reached by then keep their rules order behind the measured ones, and the log says so.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch

from attnselect.backends.base import Packing
from attnselect.candidates import Candidate
from attnselect.problem import AttentionProblem
from attnselect.target import Target

log = logging.getLogger("attnselect")

TUNING_BUDGET_S = 10.0   # per problem
TIE_TOLERANCE = 0.02     # a rules-preferred candidate this close to the fastest (and inside its spread) wins
WARMUP, REPEATS = 2, 7


@dataclass(frozen=True)
class Timing:
    median_ms: float
    low_ms: float    # 20th percentile
    high_ms: float   # 80th percentile

    def __str__(self) -> str:
        return f"{self.median_ms:.3f} ms ({self.low_ms:.3f}..{self.high_ms:.3f})"


def bucket(problem: AttentionProblem) -> AttentionProblem:
    """The problem a packed call is tuned as: batch and lengths rounded up to powers of two."""
    if problem.layout != "thd":
        return problem
    up = lambda n: 1 << max(n - 1, 0).bit_length()   # noqa: E731
    return dataclasses.replace(problem, batch=up(problem.batch), seqlen_q=up(problem.seqlen_q),
                               seqlen_kv=up(problem.seqlen_kv))


def measure(problem: AttentionProblem, target: Target, ranked: tuple[Candidate, ...],
            budget_s: float = TUNING_BUDGET_S) -> dict[Candidate, Optional[Timing]]:
    """Time each candidate in rules order until the budget is spent; None marks a candidate that failed."""
    from attnselect.execution import kernel_call, run_call
    device = torch.device("cuda" if target.is_cuda else "cpu")
    problem = bucket(problem)
    q, k, v, grad_out, packing = random_inputs(problem, device)
    call = kernel_call(problem)
    timings: dict[Candidate, Optional[Timing]] = {}
    start = time.perf_counter()
    for candidate in ranked:
        if time.perf_counter() - start > budget_s:
            log.info("attnselect: tuning budget of %.0f s spent after %d of %d candidates for %s; the rest keep "
                     "their rules order", budget_s, len(timings), len(ranked), problem.describe())
            break

        def step():
            out, _ = run_call(candidate, problem, call, q, k, v, packing=packing, target=target)
            if problem.training:
                torch.autograd.grad(out, (q, k, v), grad_out)
            return out

        try:
            if not bool(torch.isfinite(step()).all()):
                raise FloatingPointError("non-finite output for finite input")
            timings[candidate] = time_step(step, device)
        except Exception as exc:   # a candidate that fails while tuning is out, and said so
            log.warning("attnselect: %s failed while tuning %s: %s: %s", candidate, problem.describe(),
                        type(exc).__name__, exc)
            timings[candidate] = None
    return timings


def choose(ranked: tuple[Candidate, ...], timings: dict[Candidate, Optional[Timing]]) -> tuple[Candidate, ...]:
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


def time_step(step, device: torch.device, *, warmup: int = WARMUP, repeats: int = REPEATS,
              budget_s: Optional[float] = None, queued: bool = True) -> Timing:
    """Median and p20..p80 of timed repeats after warm-up (CUDA events on GPUs, wall clock on the CPU).

    ``queued`` (the default) issues the repeats back to back, each between its own pair of events,
    and waits once at the end, as a training loop does: the host prepares the next call while the
    GPU runs this one, so a repeat measures the GPU's time unless the host is the slower of the two.
    ``queued=False`` waits after every repeat, which adds each call's host overhead in full (the
    latency of an isolated call). ``budget_s`` bounds the repeats to about that many seconds (at
    least three run); queued on a GPU, the first repeat is waited for to size them, since the host
    would otherwise queue every repeat long before the GPU has run them.
    """
    for _ in range(warmup):
        step()
    start, times, events = time.perf_counter(), [], []
    sized_by_first = device.type == "cuda" and queued and budget_s is not None
    while len(events) + len(times) < max(repeats, 1):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            events.append((begin, end))
            if not queued or (sized_by_first and len(events) == 1):
                end.synchronize()
            if sized_by_first and len(events) == 1:
                repeats = min(repeats, max(3, int(budget_s * 1e3 / max(begin.elapsed_time(end), 1e-3))))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        if (budget_s is not None and not sized_by_first and time.perf_counter() - start > budget_s
                and len(events) + len(times) >= 3):
            break
    if events:
        events[-1][1].synchronize()
        times = [begin.elapsed_time(end) for begin, end in events]
    if len(times) < 2:
        return Timing(times[0], times[0], times[0])
    low, _, _, high = statistics.quantiles(times, n=5, method="inclusive")   # within the samples
    return Timing(statistics.median(times), low, high)


def random_inputs(problem: AttentionProblem, device: torch.device):
    """q, k, v (requiring grad when training), an output gradient and, for thd, a full-length packing."""
    from attnselect.inputs import DENSE_AXES

    def shape(seqlen: int, heads: int, head_dim: int) -> tuple:
        if problem.layout == "thd":
            return problem.batch * seqlen, heads, head_dim
        dims = [0, 0, 0, head_dim]
        for axis, size in zip(DENSE_AXES[problem.layout], (problem.batch, seqlen, heads)):
            dims[axis] = size
        return tuple(dims)

    def make(*size, grad=problem.training):
        return torch.randn(shape(*size), device=device, dtype=problem.dtype).requires_grad_(grad)

    q = make(problem.seqlen_q, problem.heads_q, problem.head_dim_qk)
    k = make(problem.seqlen_kv, problem.heads_kv, problem.head_dim_qk)
    v = make(problem.seqlen_kv, problem.heads_kv, problem.head_dim_v)
    grad_out = make(problem.seqlen_q, problem.heads_q, problem.head_dim_v, grad=False)
    packing = None
    if problem.layout == "thd":
        def cu(seqlen):
            return torch.arange(0, (problem.batch + 1) * seqlen, max(seqlen, 1), dtype=torch.int32,
                                device=device)[:problem.batch + 1]
        cu_q, cu_kv = cu(problem.seqlen_q), cu(problem.seqlen_kv)
        packing = Packing(cu_q, cu_kv, problem.seqlen_q, problem.seqlen_kv, cu_q, cu_kv)
    return q, k, v, grad_out, packing

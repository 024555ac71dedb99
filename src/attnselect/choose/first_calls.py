"""What a process's first call of a configuration costs, and when paying it pays off.

Some kernels compile each configuration on its first call in a process: a forward and backward of FlashAttention-4
took 6.5-19 s on the H200, its disk cache of compiled kernels filled or not (results/h200_fa4_compile.md). The
calibration holds that cost per backend, by layout, padding and phase (``first_call_ms``: FA4's first forward and
backward of a configuration compiles about three times what its forward alone does), the process's one-off start-up
left out. Where the candidate predicted fastest has such a cost
still to pay in this process and another candidate needs no compile, the choice is a ski rental (Karlin, Manasse,
Rudolph and Sleator, "Competitive snoopy caching", 1988: rent until the rent paid equals the price of buying, then
buy; never more than twice the cost of knowing the future): the other candidate runs until the time it has lost
against the faster one, by their predicted times, reaches the compile's cost, then the faster one is chosen and pays
its compile. A one-off call does not pay seconds of compile to save microseconds, and a training loop reaches the
faster kernel after a bounded loss.

A configuration (the call at any size) is paid for in a process once a call of it has run there (:func:`ran`:
``attnselect.warmup`` makes those calls ahead of time) or its rent has reached the price (:func:`paid`). That is
process state, not a memo: clearing the decision caches does not forget it (:func:`forget` does, for tests).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

from attnselect.choose import calibration
from attnselect.choose.failures import eager_signature
from attnselect.spec.options import Candidate
from attnselect.spec.problem import AttentionProblem

COMPILING_MS = 1000.0  # a new configuration's first call this much longer than the next compiles: priced
# (FA4: 1.6-5.0 s; cuDNN's graphs 0.1-0.4 s, the others' lazily loaded kernels 0.01-0.03 s, on the H200:
# results/h200_first_calls_probe.md)

_PAID: set[tuple] = set()  # (candidate, configuration) whose first call this process has paid
_RENT: dict[tuple, int] = {}  # (deferred candidate, configuration) -> calls rented so far, at any size
_CHANGES = [0]  # how often _PAID changed: a decision drawn at one count stands while the count holds (paid_state)


class Rental(NamedTuple):
    """The candidate run meanwhile (``chosen``), the one deferred (``deferred``) and after how many calls the
    deferred one's compile has been paid in lost time (``calls``; 0 for a captured or compiled call, which keeps
    ``chosen`` for the graph's life)."""

    chosen: Candidate
    deferred: Candidate
    calls: int
    compile_ms: float
    lost_us: float  # per call

    def describe(self) -> str:
        head = (
            f"{self.deferred} is predicted {self.lost_us:.1f} us a call faster but compiles on its first call in this "
            f"process (about {self.compile_ms / 1e3:.1f} s, calibrated): "
        )
        if not self.calls:
            return head + (
                f"this captured or compiled call keeps {self.chosen}, as its eager warm-up ran (warmup() runs "
                f"{self.deferred} first)"
            )
        return head + (
            f"{self.chosen} runs until that much time is lost, {self.calls} calls, then {self.deferred} (rent until "
            "the rent reaches the price)"
        )


def rental(
    ranked: tuple[Candidate, ...], predicted: dict, first_call_ms: dict, problem: AttentionProblem
) -> Rental | None:
    """The rental where ``ranked[0]`` (ranked by ``predicted`` time) has a compile still to pay for ``problem`` in
    this process and a candidate that compiles nothing serves; None otherwise (choose ``ranked[0]``). A captured or
    compiled call whose fastest candidate is unpaid keeps the candidate its eager warm-up ran (``calls`` 0): it
    would otherwise compile inside the capture, unchecked (attnselect.self_check checks eager calls)."""
    return drawn_rental(iter(ranked), predicted, first_call_ms, problem)[1]


def drawn_rental(
    ranking: Iterator[Candidate], predicted: dict, first_call_ms: dict, problem: AttentionProblem
) -> tuple[tuple[Candidate, ...], Rental | None]:
    """:func:`rental` of the ranking ``ranking`` yields, drawing from it only as far as the rental needs: the
    candidates drawn (the ranking's head) and the rental."""
    best = next(ranking, None)
    if best is None:
        return (), None
    configuration = []  # worked out on first use: most candidates compile nothing

    def price(candidate: Candidate) -> float | None:
        """The compile ``candidate`` would pay on its first call of the configuration here (None: nothing to pay)."""
        ms = cost_ms(candidate, first_call_ms, problem)
        if ms < COMPILING_MS:
            return None
        if not configuration:
            configuration.append(_configuration(problem))
        return None if (candidate, configuration[0]) in _PAID else ms

    compile_ms, drawn = price(best), [best]
    if compile_ms is None or predicted.get(best) is None:
        return tuple(drawn), None
    for other in ranking:
        drawn.append(other)
        if price(other) is None and predicted.get(other) is not None:
            lost = predicted[other].total_us - predicted[best].total_us
            if lost <= 0:  # a tie settled by the time alone (attnselect.choose.rules.settled): what renting loses
                lost = predicted[other].alone_us - predicted[best].alone_us
            if lost <= 0:
                return tuple(drawn), None
            graph = problem.cuda_graph_capture or problem.compiled_graph
            calls = 0 if graph else max(math.ceil(compile_ms * 1e3 / lost), 1)
            return tuple(drawn), Rental(other, best, calls, compile_ms, lost)
    return tuple(drawn), None


def cost_ms(candidate: Candidate, first_call_ms: dict, problem: AttentionProblem) -> float:
    """What ``candidate``'s first call of ``problem``'s configuration costs beyond a later one, by the calibration's
    ``first_call_ms`` (:func:`attnselect.choose.calibration.first_call_ms`)."""
    return calibration.first_call_ms(
        first_call_ms, candidate.backend, problem.layout, candidate.padded, problem.training
    )


def rent_key(rental: Rental, problem: AttentionProblem) -> tuple:
    """What :func:`rent` counts under: the deferred candidate and the configuration (worked out once per runner)."""
    return rental.deferred, _configuration(problem)


def rent(rental: Rental, key: tuple) -> bool:
    """Count one call run meanwhile; True at the call that reaches the rental's count, or once the deferred
    candidate was paid otherwise (a forced call, another size's choice): the decisions are then made again. Calls of
    the configuration at other sizes count together: a packed loop's every step has new sizes."""
    if key in _PAID:
        return True
    calls = _RENT[key] = _RENT.get(key, 0) + 1
    if calls < rental.calls:
        return False
    _pay(key)
    return True


def ran(candidate: Candidate, problem: AttentionProblem) -> None:
    """A call of ``problem`` ran on ``candidate`` in this process: its configuration is compiled."""
    key = (candidate, _configuration(problem))
    if key not in _PAID:
        _pay(key)


def _pay(key: tuple) -> None:
    _PAID.add(key)
    _CHANGES[0] += 1


def paid_state() -> int:
    """A count that changes whenever what this process has paid for changes: a rental drawn (:func:`drawn_rental`)
    at one count is drawn alike while it holds, as the prices are all it reads of this process."""
    return _CHANGES[0]


paid = ran  # a rental whose rent reached the price: the deferred candidate is chosen from now on


def _configuration(problem: AttentionProblem) -> tuple:
    """What a compile is kept for: the problem's signature at any size (FA4 compiles per head dims, GQA ratio, mask,
    layout, dtype and phase, not per length: flash_attn/cute/interface.py compile_key)."""
    return eager_signature(problem.sizeless)


def forget() -> None:
    """Forget what this process has compiled (tests)."""
    _PAID.clear()
    _RENT.clear()
    _CHANGES[0] += 1

"""What a process's first call of a configuration, or of a new shape, costs, and when paying it pays off.

Some kernels compile each configuration on its first call in a process: a forward and backward of FlashAttention-4
took 6.5-19 s on the H200, its disk cache of compiled kernels filled or not (results/h200_fa4_compile.md). Others
build per shape: PyTorch's cuDNN attention builds a cuDNN graph for every new (batch, heads, lengths, head dims,
strides) (aten/src/ATen/native/cudnn/MHA.cpp, MHAParams), 42.4-151.5 ms a new size on the H200, where F.sdpa's
default dispatch, which reaches it there, pays it at every new length (results/h200_first_calls_probe_40a2f27_fa4.md).
The calibration holds both per backend, by layout, padding and phase: ``first_call_ms``, a new configuration's first
call, and ``new_size_ms``, a new shape's of a configuration that has run, each beyond a later call, the process's
one-off start-up left out. Where the candidate predicted fastest has such a cost still to pay in this process (at
least :data:`COMPILING_MS` a configuration, :data:`BUILDING_MS` a shape), the choice is a ski rental (Karlin,
Manasse, Rudolph and Sleator, "Competitive snoopy caching", 1988: rent until the rent paid equals the price of
buying, then buy; never more than twice the cost of knowing the future): the fastest candidate with nothing to pay
runs until the time it has lost against a faster one, by their predicted times, reaches that one's cost, then that
one is chosen and pays it. Where every calibrated candidate has a price (on the H200, MLA packed training: FA4
9.4 s, the cuDNN frontend 2.7 s, ``varlen_fa2`` padded 72 ms), the least is paid first, as a choice knowing the job
is one call long would, and that candidate rents. Where several faster ones have a price, the one rented towards is
the one whose price that loss pays back in the fewest calls, and the fastest is rented towards from there: a chain
of two-state rentals along the candidates' cost lines (multislope ski rental: Lotker, Patt-Shamir and Rawitz,
"Rent, lease or buy", 2008), each step never more than twice its own price. No bound over a whole chain is shown in
general: a step that saves little a call for a small price, before one that saves much for a large one, brings it
near three times what knowing the future would cost, and 3000 random draws of two to five candidates reached 3.5
times (a cheap step bought a few calls before a dearer, faster one). On the packaged H200 calibration's prices and
predicted times (dense and packed calls of 192/128, 128/128, 64/64 and 256/256, both phases, 256 to 32k tokens,
with FA4 and without) it stays within 1.62 times (both: tests/choose/test_first_calls.py). A one-off call does not
pay a compile or a graph to save microseconds, and a training loop reaches the faster kernel after a bounded loss.

A configuration (the call at any size) is paid for in a process once a call of it has run there, eager, captured,
compiled or ranked by the rules table (:func:`ran`: ``attnselect.warmup`` makes those calls ahead of time), or its
rent has reached the price (:func:`rent`: the time each call lost, at its own size, summed over the configuration's
calls at every size); so is a dense call's shape. A configuration's rent pays the first shape its candidate comes at
(its price was measured on a first call, which builds that call's shape), not the shape of the call that reached
it. That is process state, not a memo: clearing the decision caches does not forget it (:func:`forget` does, for
tests); the counts and shapes kept are bounded (:data:`SHAPES_KEPT`). Shapes are priced for dense calls only: a
packed call's per-packing builds are the shape cache's (:mod:`attnselect.choose.rules` ranks a candidate that
rebuilds per packing after those that do not).

A backend whose runner replays its forward from a shape's third call (FA4: ``Backend.calls_before_replay``,
attnselect.backends.flash_attn4_replay) is predicted at its replayed host time in inference
(:mod:`attnselect.choose.predict`), and its first calls of a dense shape, through its interface, are that shape's
price (:func:`replay_start_ms`: the calls before the replay, each at the calibration's ``host_us`` less its
``replayed_host_us``; on an H100, FA4's 81.9-87.5 us a call against 14.4-15.6 replayed,
results/h100_fa4_forward_replay_8e72048.md), rented around as a build per shape is, without the :data:`BUILDING_MS`
gate (measured, not a lazy load that every kernel pays alike). Those calls serve the call as the rented kernel's
would, so against a candidate run meanwhile the price is what they cost beyond that candidate's calls, by the
stack's time (:func:`_price`): where the candidate through its interface is no slower, it runs at once; else a
server whose lengths never repeat keeps the kernel with nothing to pay, and a shape called again and again reaches
the replay after losing at most that price. A shape is paid for once the deferred candidate's first call of it
runs; its runner keeps the replay, and a runner made again for the shape (its decision drawn again, the memo's
entry evicted, :func:`attnselect.clear_cache`, a one-off ``warmup`` call) makes its calls before the replay again,
unpriced.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from attnselect.backends.base import get as backend_named
from attnselect.choose import calibration
from attnselect.choose.failures import eager_signature
from attnselect.spec.options import Candidate
from attnselect.spec.problem import AttentionProblem

# A first call this much longer than the next builds something worth renting around, for a new configuration and for
# a new shape of one that ran. On the H200: FA4's configurations (2.6-8.9 s), cuDNN's (0.6-2.1 s), the cuDNN
# frontend's (53-2653 ms), not the other kernels' lazily loaded modules (5-47 ms); cuDNN's graph per shape
# (42-152 ms), where a new size costs the others 0.4-1.4 ms (results/h200_calibration.md,
# results/h200_first_calls_probe_40a2f27_fa4.md)
COMPILING_MS = 50.0
BUILDING_MS = 10.0

_PAID: set[tuple] = set()  # (candidate, configuration) whose first call this process has paid
# (candidate, configuration, shape) whose build this process has paid, the last SHAPES_KEPT paid (a server's lengths
# are many; a shape forgotten is at worst rented around again). A plain dict: no OrderedDict mutated across threads
_SHAPES: dict[tuple, None] = {}
SHAPES_KEPT = 1 << 16
_RENT: dict[tuple, float] = {}  # a rental's key (rent_key) -> the time its calls have lost so far, us
# (candidate, configuration) whose configuration's rent reached its price: its first call builds that call's shape
# too (the configuration's price was measured on a first call), whichever shape it comes at (_owed, ran)
_FIRST_SHAPE: set[tuple] = set()
_RAN_ONCE: set = set()  # the tokens ran_once has recorded (a compiled graph's op specs)
_RAN: set[tuple] = set()  # (candidate, configuration) that has run in this process (paid by its rent or not)
# id(rental) -> (rental, state()) where settled() last found a rental standing after payments elsewhere; bounded
_STOOD: dict[int, tuple] = {}
STOOD_KEPT = 4096
_CHANGES = [0]  # how often a configuration was paid or first ran: a packed decision drawn at one count stands while it
# holds
_SHAPE_CHANGES = [0]  # how often a shape was paid: with _CHANGES, what a rental was drawn at (Rental.drawn_at)


@dataclass(frozen=True)
class Rental:
    """The candidate run meanwhile (``chosen``), the one deferred (``deferred``) and after how many calls the
    deferred one's cost has been paid in lost time (``calls``; 0 for a captured or compiled call, which keeps
    ``chosen`` for the graph's life); ``shape``: the cost is the deferred candidate's build for this shape, its
    configuration having run (else its configuration's first call); ``own_ms``: what ``chosen``'s own first call
    costs, where every candidate had one to pay (the least of theirs), else 0; ``drawn``: the candidates the ranking
    was drawn through, each with what it owed then by ``costs``, and ``drawn_at`` the process's payments then
    (:func:`state`): the rental stands while they owe the same (:func:`settled`)."""

    chosen: Candidate
    deferred: Candidate
    calls: int
    compile_ms: float
    lost_us: float  # per call
    shape: bool = False
    own_ms: float = 0.0
    own_shape: bool = False  # ``own_ms`` is ``chosen``'s build for this shape (its configuration has run)
    # of ``compile_ms`` (a shape's), what the deferred candidate's calls before its replay cost beyond ``chosen``'s
    replay_ms: float = 0.0
    # how it was drawn, not what it does: left out of its equality (another draw of the same rental is the same)
    drawn: tuple = field(default=(), compare=False)  # ((candidate, what it owed), ...), the ranking's head
    drawn_at: tuple | None = field(default=None, compare=False)  # None: not known (its deferred and own are checked)
    costs: dict | None = field(default=None, compare=False)  # the calibration's prices it was drawn by

    def describe(self) -> str:
        builds = "builds for this shape" if self.shape else "compiles"
        before = (f"its calls of this shape before it replays its forward cost about {duration(self.replay_ms)} more "
                  f"than {self.chosen}'s")  # fmt: skip
        faster = f"{self.deferred} is predicted {self.lost_us:.1f} us a call faster"
        if self.replay_ms >= self.compile_ms:  # the price is the replay's start-up alone
            head = f"{faster} once it replays, but {before} (calibrated): "
        else:
            build = duration(self.compile_ms - self.replay_ms)
            head = f"{faster} but {builds} on its first call in this process (about {build}, calibrated)"
            head += f", and {before}: " if self.replay_ms else ": "
        if self.own_ms:
            least = duration(self.own_ms)
            head += f"every candidate has a first call to pay, {self.chosen}'s the least (about {least}): "
        if not self.calls:
            return head + (
                f"this captured or compiled call keeps {self.chosen}, which has no such first call to pay, for the "
                f"graph's life ({self.deferred}'s would compile inside the graph, unchecked; warmup() of the captured "
                "problem runs it first)"
            )
        return head + (
            f"{self.chosen} runs until that much time is lost, {self.calls} calls, then {self.deferred} (rent until "
            "the rent reaches the price)"
        )


def duration(ms: float) -> str:
    """A price for a person: milliseconds below 100, else seconds."""
    if ms < 100:
        return f"{ms:.{2 if ms < 10 else 1}f} ms"
    return f"{ms / 1e3:.{2 if ms < 1e3 else 1}f} s"


def rental(ranked: tuple[Candidate, ...], predicted: dict, costs: dict, problem: AttentionProblem) -> Rental | None:
    """The rental where ``ranked[0]`` (ranked by ``predicted`` time) has a first call still to pay for ``problem``
    in this process (``costs``: a calibration's ``first_call_ms`` and ``new_size_ms``) and a candidate with none
    serves, or, where every calibrated one has a price, a candidate with a lower price than its; None otherwise
    (choose ``ranked[0]``). A captured or compiled call whose fastest candidate has not run keeps the fastest with
    nothing to pay (``calls`` 0): the fastest would otherwise compile inside the graph, unchecked
    (attnselect.self_check checks eager calls); a captured call's ranking has what its eager warm-up ran first
    (:func:`ran_first`)."""
    return drawn_rental(iter(ranked), predicted, costs, problem)[1]


def drawn_rental(
    ranking: Iterator[Candidate], predicted: dict, costs: dict, problem: AttentionProblem,
    pool: Iterable[Candidate] | None = None,
) -> tuple[tuple[Candidate, ...], Rental | None]:  # fmt: skip
    """:func:`rental` of the ranking ``ranking`` yields, drawing from it only as far as the rental needs: the
    candidates drawn (the ranking's head) and the rental. ``pool``, where known: the candidates the ranking may yield
    after its first (read once that one is drawn); where none of them could make a rental out of the first
    (:func:`_none_rents`), no other is drawn (drawing judges a candidate)."""
    best = next(ranking, None)
    if best is None:
        return (), None
    at = _CHANGES[0], _SHAPE_CHANGES[0]  # state(), before anything is read
    keys: list = []  # the configuration and the shape, worked out on first use: most candidates build nothing
    owing = _owed(best, costs, problem, keys)
    if owing is None or predicted.get(best) is None:
        return (best,), None
    if pool is not None and _none_rents(best, owing, pool, predicted, costs, problem, keys):
        return (best,), None
    drawn, owes = [best], {best: owing}
    for other in ranking:
        drawn.append(other)
        owes[other] = _owed(other, costs, problem, keys)
        if owes[other] is None and predicted.get(other) is not None:  # ``other`` runs now, with nothing to pay
            # or one ranked above it whose price against it is none (its calls before its replay no slower)
            now = next((c for c in drawn[:-1] if owes[c] is not None and predicted.get(c) is not None
                        and not _price(c, other, owes[c], predicted, costs, problem)), other)  # fmt: skip
            if now is best:
                return tuple(drawn), None
            owes[now] = None  # it runs now: its first call pays its shape, which the rental stands on (settled)
            return tuple(drawn), _towards(now, drawn, owes, predicted, problem, costs, at)
    # every calibrated candidate has a first call to pay: the least price is paid now, as a choice knowing the job
    # is one call long would (its calls are the rent from there). Not for a captured or compiled call: no eager
    # warm-up ran any of them, so whichever it keeps compiles inside the graph, and it keeps it for the graph's life
    if problem.cuda_graph_capture or problem.compiled_graph:
        return tuple(drawn), None
    priced = [c for c in drawn if predicted.get(c) is not None]
    cheapest = min(priced, key=lambda c: owes[c][0])  # ties: the faster (the ranking's order)
    if cheapest is best:
        return tuple(drawn), None
    return tuple(drawn), _towards(cheapest, drawn, owes, predicted, problem, costs, at, own=owes[cheapest])


def _none_rents(
    best: Candidate, owing: tuple, pool: Iterable[Candidate], predicted: dict, costs: dict, problem: AttentionProblem,
    keys: list,
) -> bool:  # fmt: skip
    """Whether :func:`drawn_rental` keeps ``best`` (which owes ``owing``) with no rental, whichever of ``pool`` serve:
    none of them has nothing to pay (it would run meanwhile) and, but for a captured or compiled call (which keeps
    the fastest where all have a price), none has a lower price than ``best`` (the least price is paid first; ties go
    to the faster). Prices read no size. On the H200 without FA4, in MLA packed training every candidate has one,
    ``varlen_fa2`` padded the least (71.8 ms against the cuDNN frontend's 2976.1, results/h200_calibration.md), and
    where it is also predicted fastest (the ladder's 2048-token packings) no other candidate need be judged."""
    graph = problem.cuda_graph_capture or problem.compiled_graph
    for c in pool:
        if c == best or predicted.get(c) is None:  # one without a prediction neither rents nor is rented towards
            continue
        owes = _owed(c, costs, problem, keys)
        if owes is None or (not graph and owes[0] < owing[0]):
            return False
    return True


def _towards(
    other: Candidate, drawn: list, owes: dict, predicted: dict, problem: AttentionProblem, costs: dict, at: tuple,
    own: tuple[float, bool] | None = None,
) -> Rental | None:  # fmt: skip
    """The rental that runs ``other`` towards one of the candidates ranked above it (in ``drawn``, in rank order)
    that has a price: the one whose price what renting ``other`` loses against it pays back in the fewest calls (the
    next is rented towards from there); None where none is faster at a price. ``own``: ``other``'s own price, where
    every candidate had one; ``costs`` and ``at``: what the candidates drawn were judged by, and when."""
    steps = []
    above = drawn[: drawn.index(other)]
    for c in above:
        if owes[c] is None or predicted.get(c) is None:
            continue
        lost = predicted[other].total_us - predicted[c].total_us
        if lost <= 0:  # a tie settled by the time alone (attnselect.choose.rules.settled): what renting loses, by
            # the measure that ranked them (packed: a call alone on a new packing, as the tie was settled)
            lost = predicted[other].alone_us - predicted[c].alone_us
        if lost > 0:
            price = _price(c, other, owes[c], predicted, costs, problem)
            steps.append((price / lost, len(steps), c, lost, price))
    if not steps:
        return None
    graph = problem.cuda_graph_capture or problem.compiled_graph
    # a captured or compiled call keeps its candidate for the graph's life: what it waits for is the fastest
    _, _, deferred, lost, ms = steps[0] if graph and steps[0][2] == above[0] else min(steps)
    built, shape = owes[deferred]
    calls = 0 if graph else max(math.ceil(ms * 1e3 / lost), 1)
    own_ms, own_shape = own or (0.0, False)
    replay = ms - (built - replay_start_ms(deferred, costs, problem)) if shape else 0.0  # the price less its build
    drawn_owed = tuple((c, owes[c]) for c in drawn)
    return Rental(other, deferred, calls, ms, lost, shape, own_ms, own_shape, replay, drawn_owed, at, costs)


def _price(
    c: Candidate, other: Candidate, owes: tuple[float, bool], predicted: dict, costs: dict, problem: AttentionProblem
) -> float:  # fmt: skip
    """``c``'s price (ms) against running ``other`` meanwhile: what it owes (``owes``: :func:`_owed`), its replay's
    start-up (:func:`replay_start_ms`) taken as what its calls before the replay, through its interface, cost beyond
    ``other``'s by the stack's time (they serve those calls as ``other``'s would), none where they are no slower."""
    ms, shape = owes
    start = replay_start_ms(c, costs, problem) if shape else 0.0
    through = predicted[c].before_replay_total_us
    if not start or through is None:
        return ms
    beyond = max(through - predicted[other].total_us, 0.0) * _calls_before_replay(c, problem) / 1e3
    return ms - start + beyond


def ran_first(ranked: tuple[Candidate, ...], problem: AttentionProblem) -> tuple[Candidate, ...]:
    """``ranked`` with the candidates that have run ``problem``'s configuration in this process (a dense call's shape
    too) first, each part in its order: what a captured call keeps, ranked by the rules table or by predicted time
    (where none has run, a calibrated one rents around a candidate with a first call to pay: :func:`drawn_rental`).
    A first call inside a capture builds or compiles there, unchecked by the self-check (which checks eager calls),
    and cuDNN's graph build cannot: sdpa_cudnn's first call of a shape under capture raised
    CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED and invalidated the capture on an H100, where the eager
    warm-up had run sdpa_efficient (results/h100_pytest_api_captured_alone_cc0895f.txt)."""
    configuration = _configuration(problem)
    shape = None if problem.layout == "thd" else _shape(problem)
    warm = tuple(c for c in ranked if _has_run(c, configuration, shape))
    return (*warm, *(c for c in ranked if c not in warm)) if warm else ranked


def has_run(candidate: Candidate, problem: AttentionProblem) -> bool:
    """Whether ``candidate`` has run ``problem``'s configuration in this process (a dense call's shape too): what
    :func:`ran_first` puts first."""
    return _has_run(candidate, _configuration(problem), None if problem.layout == "thd" else _shape(problem))


def _has_run(candidate: Candidate, configuration: tuple, shape: tuple | None) -> bool:
    return (candidate, configuration) in _RAN and (shape is None or _paid((candidate, configuration, shape)))


def owed(candidate: Candidate, costs: dict, problem: AttentionProblem) -> tuple[float, bool] | None:
    """What ``candidate`` would pay on its first call of ``problem`` in this process by ``costs`` (a calibration's
    ``first_call_ms`` and ``new_size_ms``), ms, and whether for the shape; None where nothing is left to pay, or
    less than a rental would rent around (:data:`COMPILING_MS`, :data:`BUILDING_MS`)."""
    return _owed(candidate, costs, problem, [])


def _owed(candidate: Candidate, costs: dict, problem: AttentionProblem, keys: list) -> tuple[float, bool] | None:
    """:func:`owed`, with ``keys`` (the problem's configuration and shape) worked out into it on first use."""
    configuration_ms = cost_ms(candidate, costs.get("first_call_ms", {}), problem)
    shape_ms = 0.0
    if problem.layout != "thd":  # a build for the shape worth renting around, and a replay's start-up
        shape_ms = cost_ms(candidate, costs.get("new_size_ms", {}), problem)
        shape_ms = (shape_ms if shape_ms >= BUILDING_MS else 0.0) + replay_start_ms(candidate, costs, problem)
    if configuration_ms < COMPILING_MS and not shape_ms:
        return None
    if not keys:
        keys.append(_configuration(problem))
        keys.append(None if problem.layout == "thd" else _shape(problem))
    graph = problem.cuda_graph_capture or problem.compiled_graph
    # a captured or compiled call waits for the configuration to have run: its rent paid, it has not yet (the next
    # eager call compiles it), and a graph would compile it inside
    if not _paid((candidate, keys[0])) or (graph and (candidate, keys[0]) not in _RAN):
        return (configuration_ms, False) if configuration_ms >= COMPILING_MS else None
    if (
        keys[1] is not None
        and shape_ms
        and not _paid((candidate, keys[0], keys[1]))
        and (candidate, keys[0]) not in _FIRST_SHAPE
    ):
        return shape_ms, True
    return None


def replay_start_ms(candidate: Candidate, costs: dict, problem: AttentionProblem) -> float:
    """What ``candidate``'s first calls of a dense shape cost before its forward replays, beyond as many replayed
    calls, by ``costs`` (a calibration: its ``host_us`` less its ``replayed_host_us``, times
    ``Backend.calls_before_replay``), ms; 0.0 where it replays nothing there (a backend that does not, training,
    a captured call, one under torch.compile, a packed call: :mod:`attnselect.choose.predict` counts a packing's)."""
    calls = _calls_before_replay(candidate, problem)
    if not calls or problem.layout == "thd" or problem.cuda_graph_capture or problem.compiled_graph:
        return 0.0
    kind = calibration.host_key(problem.layout, candidate.padded, problem.training)
    again = calibration.replayed(costs, candidate.backend, kind)
    return 0.0 if again is None else calls * (costs["host_us"][candidate.backend][kind] - again) / 1e3


def _calls_before_replay(candidate: Candidate, problem: AttentionProblem) -> int:
    backend = backend_named(candidate.backend)
    return backend.replay_start_calls(problem) if backend is not None else 0


def cost_ms(candidate: Candidate, costs: dict, problem: AttentionProblem) -> float:
    """What ``candidate``'s first call of ``problem`` costs beyond a later one by ``costs`` (a calibration's
    ``first_call_ms`` or ``new_size_ms``: :func:`attnselect.choose.calibration.first_call_ms`)."""
    return calibration.first_call_ms(costs, candidate.backend, problem.layout, candidate.padded, problem.training)


def rent_key(rental: Rental, problem: AttentionProblem) -> tuple:
    """What :func:`rent` counts under: the deferred candidate, the configuration and, for a shape's build, the shape
    (worked out once per runner)."""
    configuration = _configuration(problem)
    return (rental.deferred, configuration, _shape(problem)) if rental.shape else (rental.deferred, configuration)


def settled(rental: Rental, problem: AttentionProblem) -> bool:
    """Whether ``rental`` would be drawn otherwise for ``problem`` now: what it defers has been paid in this process
    since it was drawn (a forced call, ``warmup``, the rent of another size's rental), the first call of its
    candidate with a price of its own (``own_ms``) has run, or any candidate it was drawn through owes otherwise (a
    faster one paid for: a chain's head, or one ranked between): a memoized decision holding it is drawn again.
    Nothing paid since it was drawn or found standing last, a comparison of counts."""
    now = state()
    if rental.drawn_at is not None and now == rental.drawn_at:
        return False
    stood = _STOOD.get(id(rental))
    if stood is not None and stood[0] is rental and stood[1] == now:
        return False
    if not rental.drawn:  # what it was drawn through not known: what it defers and what its own candidate owes
        key = rent_key(rental, problem)
        own = (rental.chosen, key[1], _shape(problem)) if rental.own_shape else (rental.chosen, key[1])
        return _paid(key) or bool(rental.own_ms and _paid(own))
    keys = [_configuration(problem), _shape(problem) if problem.layout != "thd" else None]
    if any(_owed(c, rental.costs, problem, keys) != owed for c, owed in rental.drawn):
        return True
    _STOOD[id(rental)] = rental, now  # asked again at these counts (a packed loop's every new packing): a lookup
    _trim(_STOOD, STOOD_KEPT)
    return False


def rent(rental: Rental, key: tuple) -> bool:
    """Count one call run meanwhile, by the time it lost against the deferred candidate (``lost_us``); True at the
    call whose loss, with the calls' before it, reaches the price, or once the deferred candidate was paid otherwise
    (a forced call, another size's choice): the decisions are then made again. Calls of a configuration's rental
    count together at every size, each at its own loss (a packed loop's every step has new sizes); a shape's, at that
    shape."""
    if _paid(key):
        return True
    # threads may each add a call's loss to the same sum: one is lost at worst (a get and a set, no pop between)
    lost = _RENT[key] = _RENT.get(key, 0.0) + rental.lost_us
    if lost < rental.compile_ms * 1e3 * (1 - 1e-9):  # the tolerance: the sum of equal losses, rounded
        _trim(_RENT)  # bounded, as _SHAPES: the first rented, the first forgotten
        return False
    if len(key) == 2:  # a configuration's: its first call builds the shape it comes at too (before it is counted)
        _FIRST_SHAPE.add(key)
    _pay(key)
    return True


def ran(candidate: Candidate, problem: AttentionProblem) -> None:
    """A call of ``problem`` ran on ``candidate`` in this process: its configuration is compiled, and a dense call's
    shape built."""
    configuration = _configuration(problem)
    key = (candidate, configuration)
    if key not in _PAID:
        _pay(key)
    if key not in _RAN:  # what a graph's draw reads too (_owed): a packed decision drawn before is drawn again
        _RAN.add(key)
        _CHANGES[0] += 1
    if problem.layout != "thd":
        _pay((candidate, configuration, _shape(problem)))
        _FIRST_SHAPE.discard(key)


def ran_once(token, candidate: Candidate, problem: AttentionProblem) -> None:
    """:func:`ran`, once for the calls ``token`` names (a compiled graph's op spec, whose problem and candidate are
    fixed): its later calls cost a set lookup."""
    if token not in _RAN_ONCE:
        ran(candidate, problem)
        if len(_RAN_ONCE) >= SHAPES_KEPT:  # bounded: a token forgotten is recorded again
            _RAN_ONCE.clear()
        _RAN_ONCE.add(token)


# a first call about to be made (warm-up's of the fastest candidate, or the deferred one's once its rent is paid), paid
# for as one that ran
paid = ran


def _paid(key: tuple) -> bool:
    return key in _PAID if len(key) == 2 else key in _SHAPES


def _pay(key: tuple) -> None:
    if len(key) == 2:  # a configuration: what a packed decision's draw reads (a shape is priced for dense calls)
        _PAID.add(key)
        _CHANGES[0] += 1
        return
    anew = _SHAPES.pop(key, False) is False  # paid again: the last to be forgotten
    _SHAPES[key] = None
    if anew:  # counted once it shows: a draw that reads the count sees the payment too
        _SHAPE_CHANGES[0] += 1
    _trim(_SHAPES)


def _trim(kept: dict, most: int | None = None) -> None:
    """Drop the oldest of ``kept`` past ``most`` (:data:`SHAPES_KEPT`)."""
    while len(kept) > (SHAPES_KEPT if most is None else most):
        try:
            kept.pop(next(iter(kept)), None)
        except (RuntimeError, StopIteration):  # another thread changed it meanwhile: the next call trims it
            break


def state() -> tuple[int, int]:
    """Counts that change whenever the configurations or the shapes this process has paid for change."""
    return _CHANGES[0], _SHAPE_CHANGES[0]


def paid_state() -> int:
    """A count that changes whenever the configurations this process has paid for change: a packed rental drawn
    (:func:`drawn_rental`) at one count is drawn alike while it holds, as the configurations' prices are all it reads
    of this process (shapes are priced for dense calls only)."""
    return _CHANGES[0]


def _configuration(problem: AttentionProblem) -> tuple:
    """What a compile is kept for: the problem's signature at any size (FA4 compiles per head dims, GQA ratio, mask,
    layout, dtype and phase, not per length: flash_attn/cute/interface.py compile_key)."""
    return eager_signature(problem.sizeless)


def _shape(problem: AttentionProblem) -> tuple:
    """What a per-shape build is kept for: the dense problem's signature (its layout, dims, mask, dtype, phase) with
    its batch, heads and lengths (cuDNN's MHAParams; the signature holds only a size class)."""
    p = problem
    return eager_signature(p), p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_kv


def forget() -> None:
    """Forget what this process has compiled (tests)."""
    _PAID.clear()
    _SHAPES.clear()
    _RENT.clear()
    _FIRST_SHAPE.clear()
    _RAN_ONCE.clear()
    _RAN.clear()
    _STOOD.clear()
    _CHANGES[0] += 1

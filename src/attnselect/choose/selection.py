"""`select`: judge every candidate, rank the supported ones, and memoize the decision."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import torch

from attnselect.backends import evidence
from attnselect.backends.base import get as backend_named
from attnselect.choose import calibration, debug, first_calls, measure, rules, settings
from attnselect.choose.candidates import candidate_reasons, judge, override_reasons
from attnselect.choose.decision import Decision, no_candidate_message
from attnselect.choose.distributed import is_distributed
from attnselect.choose.failures import eager_signature, failures
from attnselect.choose.predict import work_classes
from attnselect.choose.settings import MEMO_SIZE
from attnselect.errors import ForcedChoiceError, InvalidInputError, NoSupportedCandidateError
from attnselect.memos import generation, register_cache
from attnselect.spec.options import Candidate, Verdict
from attnselect.spec.problem import AttentionProblem, size_class_of
from attnselect.spec.target import Target

_MEMO: OrderedDict[tuple, Decision] = OrderedDict()
register_cache(_MEMO.clear)
_no_environment, _raw_environment, _scope = settings.no_environment, settings.raw_environment, settings.scope
_cache_dir = settings.cache_dir_key


def select(
    problem: AttentionProblem,
    *,
    target: Target | None = None,
    policy: str | None = None,
    backend: str | None = None,
    pad=None,
    disable=None,
) -> Decision:
    """Choose a candidate for ``problem`` on ``target`` (default: the live machine).

    ``backend`` forces a backend, ``pad`` is "auto", "always"/True or "never"/False, ``disable``
    excludes backends; each defaults to its ATTNSELECT_* variable. Raises
    :class:`NoSupportedCandidateError` or :class:`ForcedChoiceError` listing every reason.
    """
    if not isinstance(problem, AttentionProblem):
        hint = (
            " (AttentionProblem.from_tensors(q, k, v, ...) describes a call from its tensors)"
            if isinstance(problem, torch.Tensor)
            else ""
        )
        raise InvalidInputError(f"problem: got {type(problem).__name__}, expected an AttentionProblem{hint}")
    problem.check_context_parallel()  # what attention(cp_group=) refuses, select and explain refuse too
    target = Target.of(target)
    env, scoped = settings.environment(), settings.scope()
    if disable is not None and not isinstance(disable, str):
        disable = settings.names(disable, "disable")
    # pad's type too: 1 == True, and a valid pad=True decided before must not answer for pad=1 (resolve refuses it)
    key = (problem, target, policy, backend, pad, type(pad), disable, env, settings.cache_dir_key(), scoped)
    try:
        decision = _MEMO.get(key)
    except TypeError:  # an unhashable control: resolve() names it
        decision, key = None, None
    if decision is not None and _outdated(decision, problem):
        decision = None
    if decision is None:
        # Settings read only on some paths fail on every call alike: before anything is decided or memoized.
        debug.debug_level()
        evidence.allowlist_enabled()
        settings.self_check_mode()
        cleared = generation()
        decision = _decide(
            problem,
            target,
            settings.resolve(policy=policy, backend=backend, pad=pad, disable=disable, env=env, scoped=scoped),
        )
        if key is not None:
            _remember(_MEMO, key, decision, cleared)
        debug.log_decision(decision)
    return decision


# Packed problems change their sizes (sequence count, max lengths) every step of a loop: per problem with the sizes
# left out, under one set of controls (its family), the last decision, the problem it was last found to hold for
# (every layer of a step repeats it) and the candidates the caller's controls leave (they do not depend on the sizes).
_PACKED: OrderedDict[tuple, _Family] = OrderedDict()
register_cache(_PACKED.clear)


class _Family:
    """What :func:`select_packed` keeps for a packed problem without its sizes, under one set of controls; the memos
    of its predictions and rankings are keyed by this object."""

    __slots__ = ("last", "by_table", "allowed", "runs", "calibrated", "places", "failed", "drawn", "calibration",
                 "table_at", "standing", "class_at", "classified", "target", "ranks", "sizeless")  # fmt: skip

    def __init__(self, decision: Decision, held_for: AttentionProblem, allowed: tuple[Candidate, ...], target: Target):
        self.last = decision, held_for  # one tuple, swapped whole: a thread reads a decision with its sizes
        # per rules table: the decision select() last made there where the table ranked it (_carried), with what a
        # new packing must check for it to stand (_standing_checks): packings that straddle a refinement's bound
        # alternate between tables, and each keeps its own
        self.by_table: dict[tuple, tuple[Decision, tuple]] = {}
        self.allowed = allowed
        # what the target cannot run at any size (its package missing, another device) leaves the rankings
        self.runs = [c for c in allowed if not backend_named(c.backend).target_reasons(target)]
        self.calibrated: _Calibrated | None = None  # made on its first ranking under a calibration
        self.places: dict[tuple, dict] = {}  # per rules table: the allowed candidates' rules.table_places
        # per (size class, torch.distributed on): _failed (a signature reads no other size; failures recorded by
        # earlier processes are not read under torch.distributed, which a job may start after its first calls)
        self.failed: dict[tuple, dict] = {}
        # per key of self.failed: {candidate: ()} where it serves by a verdict that reads no size
        # (_judged_alike_at_every_size), so a draw at a new work class judges it once per size class (a refusal is
        # judged again: its reasons may name the sizes)
        self.sizeless: dict[tuple, dict] = {}
        # per (size class, rules table): the decision last drawn there at any work class, as ranking.decided holds
        # it, with the calibration it was drawn under and whether it settled a tie (_drawn_alike)
        self.drawn: dict[tuple, tuple] = {}
        # the calibration that holds on the target and where it comes from (calibration.for_target), and whether it
        # measures calls of this kind (calibration.covers_kind): the same for the family's life (its key holds the
        # target and the cache directory; a clear of the caches drops it)
        self.calibration = (*calibration.for_target(target), calibration.covers_kind(held_for))
        self.ranks = self.calibration[0] is not None and self.calibration[2]  # a calibration ranks its calls
        self.table_at = rules.table_chooser(held_for, target)  # rules.table_for at the family's every size, by sizes
        # per class (classify): the decision _carried returned there (_Standing): a packing of
        # the class gets it while it holds (standing_at)
        self.standing: dict[tuple, _Standing] = {}
        self.target = target
        self.class_at = _class_finder(held_for, self.ranks, self.table_at)  # classify, by sizes
        self.classified: tuple = (None, None)  # the problem classified last, and its class: a call asks more than once

    def classify(self, problem: AttentionProblem) -> tuple:
        """What :func:`_carried` reads of a packing's sizes: whether the family's calibration ranks it (where one
        covers the family's calls: at enough queries, :data:`calibration.MIN_QUERIES`), its work class (where it
        does), its size class and its rules table."""
        last, key = self.classified
        if problem is last:
            return key
        key = self.class_at(problem.batch, problem.seqlen_q, problem.seqlen_kv, problem.tokens)
        self.classified = problem, key
        return key

    def standing_at(self, problem: AttentionProblem) -> tuple[tuple, Decision] | None:
        """(its class, the decision) where :func:`select_packed` would return a decision carried to ``problem``'s class
        before (the paid compiles as they were, its verdicts that read sizes judged alike at ``problem``'s, the rules
        table's decision still standing there), without the rest of select_packed's work; None where only
        select_packed can tell. A clear of the caches (a failure, a rental's end) drops the family."""
        key = self.classify(problem)
        held = self.standing.get(key)
        if held is None or held.paid != first_calls.paid_state():
            return None
        # what select_packed reads there is what the decision was carried from (no later draw replaced it)
        if (held.ranking.decided if held.ranking is not None else self.by_table.get(key[3])) is not held.witness:
            return None
        if held.sized or held.checks:
            target = self.target
            failed = self.failed_at(problem, target)
            if not _judged_alike(held.sized, problem, target, failed) or not _still_stands(
                held.checks, failed, lambda c: not _reasons(c, problem, target, failed)
            ):
                return None
        return key, held.decision

    def calibrated_by(self, problem: AttentionProblem, target: Target, found: dict) -> _Calibrated:
        """What predicts the family's calls under the calibration ``found``, made on first use (and again under
        another calibration: a cache directory changed)."""
        held = self.calibrated
        if held is None or held.found is not found:
            held = self.calibrated = _Calibrated(found, {c: rules.prediction_curve(c, problem, target, found)
                                                         for c in self.runs})  # fmt: skip
        return held

    def failed_at(self, problem: AttentionProblem, target: Target) -> dict:
        key = (problem.size_class, is_distributed())
        failed = self.failed.get(key)
        if failed is None:
            failed = self.failed[key] = _failed(problem, target)
            self.sizeless[key] = {}  # what it judged alike at every size read these failures
        return failed


def _class_finder(problem: AttentionProblem, ranks: bool, table_at) -> Callable[[int, int, int, int], tuple]:
    """``class_at(sequences, seqlen_q, seqlen_kv, tokens)``: :meth:`_Family.classify` of the problem that differs from
    ``problem`` in those sizes alone, for a family whose calibration ``ranks`` its calls and whose rules tables
    ``table_at`` gives (:func:`rules.table_chooser`); the problem's other fields are read once, here."""
    work_class_at, heads, least = work_classes(problem), problem.heads_q, calibration.MIN_QUERIES

    def class_at(sequences: int, seqlen_q: int, seqlen_kv: int, tokens: int) -> tuple:
        size = size_class_of(sequences * heads * seqlen_q * seqlen_kv)
        if ranks and seqlen_q >= least:
            return (
                True,
                work_class_at(sequences, seqlen_q, seqlen_kv, tokens),
                size,
                table_at(sequences, seqlen_q, seqlen_kv, tokens)[0],
            )
        return False, None, size, table_at(sequences, seqlen_q, seqlen_kv, tokens)[0]

    return class_at


class _Calibrated:
    """What a calibration predicts a family's calls by at any size (rules.prediction_curve): each candidate's curve
    (None for those it leaves out), the candidates it cannot rank, those it times and the others, in the family's
    order, the others' order per rules table (they sort after the timed ones, by the table alone: the same at every
    work class) and the predictions per work class."""

    __slots__ = ("found", "curves", "unranked", "timed", "untimed", "tails", "predicted")

    def __init__(self, found: dict, curves: dict):
        self.found = found
        self.curves = {c: curve for c, (curve, _) in curves.items()}
        self.unranked = tuple(c for c, (_, why) in curves.items() if why)
        self.timed = tuple(c for c, curve in self.curves.items() if curve is not None)
        self.untimed = tuple(c for c, curve in self.curves.items() if curve is None)
        self.tails: dict[tuple, tuple] = {}
        self.predicted: dict[int, dict] = {}

    def predicted_at(self, work: int) -> dict:
        """{candidate: its prediction at the work class ``work``, or None}."""
        predicted = self.predicted.get(work)
        if predicted is None:
            predicted = self.predicted[work] = {c: curve.at_class(work) if curve is not None else None
                                                for c, curve in self.curves.items()}  # fmt: skip
        return predicted


def select_packed(problem: AttentionProblem, *, target: Target, backend=None, pad=None, disable=None) -> Decision:
    """:func:`select` for a packed call, without judging every candidate again when only the sizes changed.

    The rules' decision made for the same problem at other sizes is carried to the new sizes (the same chosen
    candidate and rental as :func:`select`'s), under the measure policy :func:`select` decides:

    - where a calibration ranks the call, the candidates are ordered by their predicted times at the new sizes and
      judged in that order only until the choice and its rental are settled: the decision's ``ranked`` is the head of
      select's ranking and its ``verdicts`` those of the candidates judged (explain and select judge them all); the
      decision last carried in the same work class, size class and rules table is returned again (describing its
      own sizes) where it differs from this one in its sizes only, and at a work class new there, the decision last
      drawn in the same size class and rules table where the new class's order draws it alike (:func:`_drawn_alike`);
    - where the table ranks it, the decision last made under the rules table of the new sizes (packings on both
      sides of a refinement's bound alternate between tables) stands (it is returned, describing its sizes) when its
      choice still serves them and has not failed for them, and no candidate that was refused there and that the
      table puts above the choice (any refused one, where the choice rebuilds per packing) serves them now.

    Otherwise, and for a problem that is not packed, :func:`select`.
    """
    if problem.layout != "thd":  # what a packing's sizes change is worked out for packed problems only
        return select(problem, target=target, backend=backend, pad=pad, disable=disable)
    cleared = generation()
    try:
        key = _family_key(problem, target, backend, pad, disable)
        family = _PACKED.get(key)
    except TypeError:  # an unhashable control: select() names it
        return select(problem, target=target, backend=backend, pad=pad, disable=disable)
    decision = made = None
    if family is not None:
        earlier, held_for = family.last
        if _same_sizes(problem, held_for) and not _outdated(earlier, problem):  # the key holds every other field
            decision = earlier
        elif earlier.policy == "rules":
            decision = _carried(family, earlier, problem, target)
    if decision is None:
        decision = made = select(problem, target=target, backend=backend, pad=pad, disable=disable)
    if family is None:
        allowed = tuple(  # what the controls leave: the same at every size
            v.candidate for v in decision.verdicts if not override_reasons(decision.overrides, v.candidate, problem)
        )
        family = _Family(decision, problem, allowed, target)
        dropped = _remember(_PACKED, key, family, cleared)
        if dropped is not None:  # its classes no longer stand: select_packed keeps a new family for its calls
            dropped.standing.clear()
    else:
        family.last = decision, problem
    if made is not None and made.policy == "rules" and made.predictions is None:  # ranked by the table (_carried)
        table_key, table = family.table_at(problem.batch, problem.seqlen_q, problem.seqlen_kv, problem.tokens)
        family.by_table[table_key] = (
            made,
            _standing_checks(made, problem, target, table, family.failed_at(problem, target)),
        )
    return decision


def _family_key(problem: AttentionProblem, target: Target, backend, pad, disable) -> tuple:
    # the raw ATTNSELECT_* values (settings.environment decodes them): a key, read for every new packing
    return (problem.sizeless, target, backend, pad, type(pad), disable, _no_environment() or _raw_environment(),
            _cache_dir(), _scope())  # fmt: skip


def standing_decisions(problem: AttentionProblem, *, target: Target, backend=None, pad=None, disable=None):
    """``standing_at(problem) -> (class, decision) | None`` for the packed loop of ``problem`` (made by
    :func:`select_packed`) under these controls and the present settings: :meth:`_Family.standing_at` of its family,
    which a caller that keeps those (attnselect.dispatch's memo of a family of packed calls) asks at a new packing
    before :func:`select_packed`; None where select_packed keeps no family for it."""
    try:
        family = _PACKED.get(_family_key(problem, target, backend, pad, disable))
    except TypeError:
        return None
    return family.standing_at if family is not None else None


def _same_sizes(problem: AttentionProblem, other: AttentionProblem) -> bool:
    """The same sizes, tokens included (a family's key, the problem at size 0, is shared by q's every row count)."""
    return (
        problem.batch == other.batch
        and problem.seqlen_q == other.seqlen_q
        and problem.seqlen_kv == other.seqlen_kv
        and problem.tokens == other.tokens
    )


def _remember(memo: OrderedDict, key, value, cleared: int):
    """``memo[key] = value``, the oldest entry past MEMO_SIZE dropped (and returned; else None); dropped again where a
    clear began after ``cleared`` (caches.generation() before the value was worked out)."""
    memo[key] = value
    dropped = memo.popitem(last=False)[1] if len(memo) > MEMO_SIZE else None
    if generation() != cleared:
        memo.pop(key, None)
    return dropped


def _carried(family: _Family, earlier: Decision, problem: AttentionProblem, target: Target) -> Decision | None:
    """The rules' ``earlier`` decision of ``family`` carried to ``problem``'s sizes (:func:`select_packed`), or None
    where only :func:`select` can tell. Where the decision last carried with the same ranking is this one but for
    its sizes (the same candidates judged alike, ranking and rental), that one is returned, describing its own
    sizes."""
    found, source, _ = family.calibration  # whether it covers the call: in key[0] (_Family.ranks, classify)
    key = family.classify(problem)
    if key[0] and problem.cuda_graph_capture:  # select() puts what its eager warm-up ran first (_decide)
        return None
    ranking = None
    if key[0]:  # a calibration ranks it: not calibration.outside
        ranking = _ranking(family, key, problem, target, found)
    failed = ranking.failed if ranking is not None else family.failed_at(problem, target)
    held = ranking.decided if ranking is not None else None  # one tuple: a thread reads a decision with its facts
    if held is None and ranking is not None:  # a work class new to its size class and table
        held = _drawn_alike(family.drawn.get(ranking.group), ranking)
    if held is not None and held[2] == first_calls.paid_state() and _judged_alike(held[1], problem, target, failed):
        ranking.decided = held
        _stand(family, key, held[0], held[2], sized=held[1], ranking=ranking, witness=held)
        return held[0]  # its candidates judged alike, in the same order, at the same prices: the same draw (logged)
    judged: dict[Candidate, tuple[str, ...]] = {}  # as judge() refuses them
    # candidates that served at another size of this class, by verdicts that read no size (under these failures: a
    # ranking made before torch.distributed started holds the others)
    at = (problem.size_class, is_distributed())
    alike = family.sizeless[at] if family.failed.get(at) is failed else {}

    def serves(c: Candidate) -> bool:
        if c not in judged:
            reasons = alike.get(c)
            judged[c] = reasons if reasons is not None else _reasons(c, problem, target, failed)
        return not judged[c]

    predicted = ranking.predicted if ranking is not None else None
    if predicted is not None and any(serves(c) for c in ranking.unranked):  # the table ranks the call (predictions)
        predicted = None
    if not predicted or not any(predicted.values()):  # the table ranks it: the decision last made under its table
        standing = family.by_table.get(key[3])
        if standing is None or not _still_stands(standing[1], failed, serves) or _outdated(standing[0], problem):
            return None
        if ranking is None:  # else whether the table ranks it read the unranked candidates' verdicts at these sizes
            _stand(family, key, standing[0], first_calls.paid_state(), checks=standing[1], witness=standing)
        return standing[0]
    ordered = rules.settled(ranking.ordered, predicted, serves)  # as rules.rank orders them
    paid = first_calls.paid_state()  # what drawn_rental reads of this process
    if earlier.overrides.backend is not None:  # a forced backend is never rented out (_decide)
        ranked, rental = tuple(itertools.islice(ordered, 1)), None
    else:
        # those not refused so far may still serve (those ranked before the first that serves were judged, and refused)
        pool = (c for c in ranking.ordered if not judged.get(c))
        ranked, rental = first_calls.drawn_rental(ordered, predicted, found, problem, pool)
    if not ranked or predicted[ranked[0]] is None:  # nothing it serves is calibrated: select() says why
        return None
    decision, sized = held[:2] if held is not None else (None, ())
    if not (
        decision is not None
        and decision.ranked == ranked
        and decision.rental == rental
        and (rental is None or decision.rental.drawn_at == rental.drawn_at)  # what settled() reads: the last draw
        and len(judged) == len(decision.verdicts)
        and all(judged.get(v.candidate) == v.reasons for v in decision.verdicts)
    ):
        decision = Decision(
            problem, target, earlier.policy, earlier.overrides, rental.chosen if rental else ranked[0], ranked,
            tuple(Verdict(c, reasons) for c, reasons in judged.items()),
            None, {c: predicted[c] for c in (*ranked, *(c for c, reasons in judged.items() if not reasons))}, source,
            rental, earlier.carried_from or earlier.problem,
        )  # fmt: skip
        # the verdicts a packing's sizes can change
        sized = tuple(
            v for v in decision.verdicts
            if v.candidate not in alike and not _judged_alike_at_every_size(v, problem, target, failed)
        )  # fmt: skip
        alike.update((v.candidate, ()) for v in decision.verdicts if v.supported and v not in sized)
        if decision.chosen != earlier.chosen or decision.rental != earlier.rental:  # another choice than the last
            debug.log_decision(decision)
    decided = ranking.decided = decision, sized, paid
    _stand(family, key, decision, paid, sized=sized, ranking=ranking, witness=decided)
    # a choice that settled a tie read the predicted times (rules.settled): not carried to another work class
    tie = rules.tied(decision.ranked[0], (c for c, reasons in judged.items() if not reasons), predicted)
    family.drawn[ranking.group] = decision, sized, paid, ranking.found, tie
    return decision


class _Standing(NamedTuple):
    """A decision carried to a class of a packed family, as :meth:`_Family.standing_at` gives it again."""

    decision: Decision
    paid: int  # first_calls.paid_state() it was carried at
    sized: tuple  # its verdicts that read a packing's sizes, judged alike again
    checks: tuple  # the rules table's standing checks it was carried under (_standing_checks), passed again
    ranking: _Ranking | None  # the calibrated ranking it was carried from; None: the rules table's decision
    witness: tuple  # that ranking's ``decided``, or the family's by_table entry, then: a later draw replaces it


def _stand(family: _Family, key: tuple, decision: Decision, paid: int, *, sized: tuple = (), checks: tuple = (),
           ranking: _Ranking | None = None, witness: tuple) -> None:  # fmt: skip
    """Keep ``decision``, carried to a packing of the class ``key`` at the paid compiles ``paid`` from ``witness`` (what
    ``ranking`` had decided, or the rules table's by_table entry), as what a packing of that class gets while those
    hold (:meth:`_Family.standing_at`), with what of it a packing's sizes can change: ``sized``, its verdicts that read
    them, judged alike again; ``checks``, the rules table's standing checks (:func:`_standing_checks`), passed again.
    A decision that rents stands too: a packed rental reads the paid compiles alone, not the sizes
    (:func:`attnselect.choose.first_calls.paid_state`), and the call kept for the class counts its calls towards the
    price (attnselect.api._renting), whose end clears the caches, the family with them."""
    if len(family.standing) >= MEMO_SIZE and key not in family.standing:  # bounded: a family of that many classes
        family.standing.clear()  # starts again
    family.standing[key] = _Standing(decision, paid, sized, checks, ranking, witness)


def _judged_alike(verdicts: tuple, problem: AttentionProblem, target: Target, failed: dict) -> bool:
    """Whether each of ``verdicts`` judges its candidate alike at ``problem`` (whose failures are ``failed``)."""
    return all(_reasons(v.candidate, problem, target, failed) == v.reasons for v in verdicts)


def _drawn_alike(drawn: tuple | None, ranking: _Ranking) -> tuple[Decision, tuple[Verdict, ...], int] | None:
    """The decision ``drawn`` at another work class of ``ranking``'s size class and rules table (with its sized
    verdicts and paid state, as ``ranking.decided`` holds it), where ``ranking`` draws it alike at the same verdicts
    and prices: drawn under the same calibration, it ranked its choice alone, rents nothing and settled no tie, so the
    draw read the order only, not the predicted times (attnselect.choose.first_calls.drawn_rental: no compile priced,
    no other candidate served, or none left could rent around the choice, which reads the prices and which
    candidates are predicted, the same at every work class; attnselect.choose.rules.settled); and the candidates it
    judged are those
    ``ranking`` judges first, in that order (those the calibration cannot rank, then its order up to the choice and
    any refused after it), and the next in ``ranking``'s order is predicted beyond the tie band of the choice's time
    there. None otherwise. Returned, it describes its own sizes and predictions, as a decision
    carried within a work class does."""
    if drawn is None:
        return None
    decision, sized, paid, found, tie = drawn
    if found is not ranking.found or decision.rental is not None or len(decision.ranked) != 1 or tie:
        return None
    judged = tuple(v.candidate for v in decision.verdicts)
    unranked, drawn = len(ranking.unranked), len(judged) - len(ranking.unranked)
    if judged[:unranked] != ranking.unranked or judged[unranked:] != ranking.ordered[:drawn]:
        return None
    # nor does the new class's order bring the next candidate within the tie band of the choice (rules.settled would
    # judge it, and it may tie): the order is by predicted time, so the rest are beyond it too
    following = ranking.ordered[drawn] if drawn < len(ranking.ordered) else None
    lead, time = ranking.predicted.get(decision.chosen), ranking.predicted.get(following)
    if lead is not None and time is not None and time.total_us <= lead.total_us * (1 + rules.TIE_BAND):
        return None
    return decision, sized, paid


class _Ranking:
    """The candidates a packed call's controls allow, in their predicted order at its work class, with their
    predictions (None for those the calibration leaves out), those the calibration cannot rank (where one of them
    serves, the table ranks the call), the failures known at the call's signature, and the decision last carried
    with it (None before the first): ``decided``, that decision, those of its verdicts a packing's sizes can change
    (the others refuse their candidate at every size) and the process's paid compiles it was drawn at
    (first_calls.paid_state), one tuple swapped whole. While those compiles hold, a packing whose verdicts are judged
    alike gets it without drawing the ranking again: the draw reads nothing else (the order and predictions are the
    key's, a failure clears it)."""

    __slots__ = ("ordered", "predicted", "unranked", "failed", "found", "group", "decided")

    def __init__(self, ordered: tuple, predicted: dict, unranked: tuple, failed: dict, found: dict, group: tuple):
        self.ordered, self.predicted, self.unranked, self.failed = ordered, predicted, unranked, failed
        self.found = found  # the calibration it was made under
        self.group = group  # its size class and rules table: the key of family.drawn
        self.decided: tuple[Decision, tuple[Verdict, ...], int] | None = None


# Per family, work class, size class and rules table: its :class:`_Ranking`, whose order is a function of that key
# (failures are kept per signature, which holds the size class), so a new packing in a known class looks its ranking
# up; a new failure clears it. A family is keyed by identity: no hash of its problem on a new packing.
_RANKINGS: OrderedDict[tuple, _Ranking] = OrderedDict()
register_cache(_RANKINGS.clear)


def _ranking(family: _Family, key: tuple, problem: AttentionProblem, target: Target, found: dict) -> _Ranking:
    """The ranking of ``problem``, of the class ``key`` (:meth:`_Family.classify`), made where new."""
    cleared = generation()
    _, work, size_class, table = key
    at = (family, work, size_class, table)
    ranking = _RANKINGS.get(at)
    if ranking is None or ranking.found is not found:  # made under another calibration (a cache directory changed)
        calibrated = family.calibrated_by(problem, target, found)
        predicted = calibrated.predicted_at(work)
        places = family.places.get(table)
        if places is None:
            places = family.places[table] = rules.table_places(problem, target, family.allowed)
        by = rules.order(problem, target, predicted, family.allowed, places)
        tail = calibrated.tails.get(table)  # those without a prediction sort last, by the table alone
        if tail is None:
            tail = calibrated.tails[table] = tuple(sorted(calibrated.untimed, key=by))
        ordered = (*sorted(calibrated.timed, key=by), *tail)
        ranking = _Ranking(ordered, predicted, calibrated.unranked, family.failed_at(problem, target), found, at[2:])
        dropped = _remember(_RANKINGS, at, ranking, cleared)
        if dropped is not None:  # no class stands on what it decided: select_packed draws a new one there
            dropped.decided = None
    return ranking


def _reasons(c: Candidate, problem: AttentionProblem, target: Target, failed: dict) -> tuple[str, ...]:
    """Why ``c`` cannot serve ``problem`` (as judge() refuses it, the caller's controls aside)."""
    return tuple(candidate_reasons(c, backend_named(c.backend), problem.padded(c.pad_to) if c.padded else problem,
                                   target, failed))  # fmt: skip


def _judged_alike_at_every_size(verdict: Verdict, problem: AttentionProblem, target: Target, failed: dict) -> bool:
    """Whether ``verdict`` judges its candidate alike whatever a packed ``problem``'s sizes (at its size class, whose
    failures are ``failed``): its backend's reasons read no size (its package and device type, its surface, whose
    packed reasons read none (:meth:`attnselect.backends.base.Surface.reasons`), its extra reasons where they say so
    (``extra_reasons_read_sizes``) and the correctness grid's allowlist where it holds no span for the kernel's key:
    :func:`attnselect.backends.evidence.reads_sizes`); or it refuses the candidate for its run-time failure at the
    problem's signature, its package or device type, or its surface. Its reasons' text may still name sizes: the
    decision that holds it describes its own."""
    c = verdict.candidate
    backend = backend_named(c.backend)
    if not verdict.supported and c in failed:
        return True
    if backend.target_reasons(target):
        return True
    kernel_problem = problem.padded(c.pad_to) if c.padded else problem
    if not backend.extra_reasons_read_sizes and not (
        target.device_type in backend.evidence_required and evidence.reads_sizes(c.backend, kernel_problem, target)
    ):
        return True
    return not verdict.supported and bool(backend.surfaces[target.device_type].reasons(kernel_problem, target))


def _standing_checks(made: Decision, problem: AttentionProblem, target: Target, table, failed: dict) -> tuple:
    """What a packing at other sizes must check for the rules' decision ``made`` for ``problem`` under the rules table
    ``table`` to stand (:func:`select_packed`'s conditions): its choice still serves, and no candidate refused there
    that the table puts above the choice (any refused one, where the choice rebuilds per packing) serves now, the
    caller's controls aside. One (candidate, whether it must serve, whether its verdict reads sizes
    (:func:`_judged_alike_at_every_size`), whether it had failed (``failed``: the problem's failures)) for each: the
    others' verdicts stand while their failures do."""
    chosen = made.chosen
    position = {name: i for i, name in enumerate(table)}
    cache = backend_named(chosen.backend).shape_cache
    above = (
        len(table)
        if cache is not None and cache.rebuilds_per_packing
        else position.get(rules.entry(chosen), len(table))
    )
    own = next((v for v in made.verdicts if v.candidate == chosen), None)  # judged again at every packing if none
    checks = [(chosen, True, own is None or not _judged_alike_at_every_size(own, problem, target, failed))]
    checks += (
        (v.candidate, False, not _judged_alike_at_every_size(v, problem, target, failed))
        for v in made.verdicts
        if not v.supported
        and not override_reasons(made.overrides, v.candidate, problem)
        and position.get(rules.entry(v.candidate), len(table)) <= above
    )
    return tuple((c, must_serve, sized, c in failed) for c, must_serve, sized in checks)


def _still_stands(checks: tuple, failed: dict, serves) -> bool:
    """Whether a rules decision stands at a packing whose failures are ``failed``: each candidate of its
    :func:`_standing_checks` whose verdict reads sizes, or whose failure came or went, judged again (``serves``)."""
    return all(
        serves(c) == must_serve for c, must_serve, sized, had_failed in checks if sized or (c in failed) != had_failed
    )


def _failed(problem: AttentionProblem, target: Target) -> dict:
    """{candidate: error}: those that failed at run time (:func:`failures`) and the backends, native and padded, a
    packaged peer sweep found wrong or crashing at this signature on this GPU and these versions
    (:func:`evidence.known_failures`), refused alike."""
    measured = evidence.known_failures(
        eager_signature(problem), target, lambda name: backend_named(name).package_version(target)
    )
    pads = (None,) if problem.pad_target is None else (None, problem.pad_target)
    found = {Candidate(backend, pad): finding for backend, finding in measured.items() for pad in pads}
    return {**found, **failures(problem, target)} if found else failures(problem, target)


def _decide(problem: AttentionProblem, target: Target, overrides: settings.Overrides) -> Decision:
    verdicts = judge(problem, target, overrides, _failed(problem, target))
    predicted, calibration, costs = rules.predictions(verdicts, problem, target)
    ranked = rules.rank(verdicts, problem, target, predicted)
    if not ranked:
        error = ForcedChoiceError if overrides.backend or overrides.pad != "auto" else NoSupportedCandidateError
        raise error(no_candidate_message(problem, target, verdicts, overrides))
    timings, rental, ran_at = None, None, None
    # Under torch.distributed every rank enters the measurement (and its broadcast), whatever it has left.
    if overrides.policy == "measure" and (len(ranked) > 1 or is_distributed()):
        ranked, timings = measure.measured(problem, target, ranked)
    elif overrides.backend is None:
        if problem.cuda_graph_capture:  # what its eager warm-up ran first, by the table or the calibration
            ran_at = first_calls.state()
            ranked = first_calls.ran_first(ranked, problem)
        if predicted is not None:  # a compile to pay first (attnselect.choose.first_calls)
            rental = first_calls.rental(ranked, predicted, costs, problem)
    return Decision(
        problem, target, overrides.policy, overrides, rental.chosen if rental else ranked[0], ranked, verdicts,
        timings, predicted, calibration, rental, ran_at=ran_at,
    )  # fmt: skip


def _outdated(decision: Decision, problem: AttentionProblem) -> bool:
    """Whether a memoized ``decision`` for ``problem`` is to be made again: what it rented around has been paid since
    (a forced call, warmup, another size's choice), or, for a captured call, a candidate may have run the call since
    (what first_calls.ran_first read: the configurations run and, dense, the shapes)."""
    if decision.rental is not None and first_calls.settled(decision.rental, problem):
        return True
    if decision.ran_at is None:
        return False
    now = first_calls.state()
    return now[0] != decision.ran_at[0] or (decision.problem.layout != "thd" and now[1] != decision.ran_at[1])

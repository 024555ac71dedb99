"""attention()'s memo of the calls it has validated and decided: a repeated call goes straight to its runner.

A call is known by everything validation, selection and its runner read: its options; the types, shapes, strides,
dtypes, devices and requires_grad of its tensors (q, k, v, the sinks, a packed call's boundaries), which of q, k and
v are one tensor, and the storage offsets of q, k and v; the gradient mode, deterministic algorithms, autocast,
TorchFunctionModes, the ATTNSELECT_* variables, the :func:`attnselect.overrides` scope and, for CUDA tensors, graph
capture. A change to the backend registry clears the memo (:func:`attnselect.backends.register`). Two levels:

- the recent calls (``RECENT``, newest first): one tuple of the options and the global state compared by value,
  one C++ check of the tensors (torch's ``TensorGuards``, what torch.compile's guards run on every call of a
  compiled function; it also sees inference mode and autocast for the tensors' device, through their dispatch keys),
  the offsets and, for a call on CUDA tensors, the capture state;
- every call decided before (``MEMO_SIZE``), by a hashable key of the same values; a hit there becomes recent.

A packed call is known in two steps, as a plan and its runs (FlashInfer's plan/run): its family, everything above
but its packing's sizes (the sequence count and both max_seqlen), which the tensors' guard leaves free (the
boundaries' length), then the sizes within the family. A training loop's new packing every step is found as a family
at once, without a key. Where its class (what the selection reads of its sizes) stands on the decision of a call
kept for that class, it is that call at its sizes (:func:`_class_call`); else it is decided from its sibling, the
call of the family decided last (:class:`Unknown`). The calls at each size are bounded apart from the families
(``MEMO_SIZE`` each), so a loop of many steps keeps its families whatever its packings.

Calls the key cannot describe are not known and take the slow path, which validates them: values that compare
equal to a valid one of another type (``1 == True``, ``True == 1.0``), lists and iterators, nested tensors, padded
offsets, and packed calls whose problem depends on the boundaries' values (on the CPU, without both ``max_seqlen``
as integers, or with keys that have their own boundaries).
"""

from __future__ import annotations

import logging
import operator
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import torch

from attnselect.choose import settings
from attnselect.choose.settings import MEMO_SIZE
from attnselect.memos import generation, register_cache
from attnselect.spec.options import Candidate, KernelCall
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target

try:  # what torch.compile's tensor guards run (torch/_dynamo/guards.py); absent, the memo keys every call
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # pragma: no cover (every supported torch has it)
    TensorGuards = None
    logging.getLogger("attnselect").info("torch has no TensorGuards: repeated calls are looked up by key only")

RECENT = 8  # recent calls checked before the key is built: a model's distinct attention calls, alternating layers


class KnownCall(NamedTuple):
    """A call validated and decided before: what running it again needs."""

    problem: AttentionProblem
    chosen: Candidate
    target: Target
    call: KernelCall  # kernel options, the scale included
    forced: bool  # the caller forced the backend: failures re-raise
    # run(q, k, v) (dense, the layout work prepared) or run(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_kv) (packed)
    runner: Callable | None


class _Family:
    """The packed calls that differ only in their packing's sizes: ``last``, the one decided last (the sibling of a
    new packing), and ``unchecked``, the (candidate, size class) pairs whose calls need no self-check (attention()
    keeps them: one problem at every size has one signature per size class); the calls themselves are in ``_SIZED``
    under ``(family, sizes)`` (identity-hashed: no hash of the call's state on a new packing).

    ``standing``: where the selection keeps a family for these calls, its ``standing_at(problem) -> (class,
    decision) | None`` (:func:`attnselect.choose.selection.standing_decisions`), and ``classes``, per class, the
    decision that stood there and the call attention() made of it: a new packing whose class still stands on that
    decision is that call at its own sizes, known without a decision (:func:`_class_call`; attention() keeps both)."""

    __slots__ = ("last", "unchecked", "standing", "classes")

    def __init__(self, last: KnownCall):
        self.last = last
        self.unchecked: set[tuple] = set()
        self.standing: Callable | None = None
        self.classes: dict[tuple, tuple] = {}


class _Entry(NamedTuple):
    state: tuple  # the options and the global state, as recall() builds them (a packed call's without its sizes)
    guard: object  # TensorGuards of the call's tensors (a packed call's boundaries' length free)
    offsets: tuple  # storage offsets of q, k, v (the key's last item)
    capturing: bool | None  # CUDA graph capture during the call; None where its tensors are not on CUDA
    known: KnownCall | None  # a dense call's
    family: _Family | None  # a packed call's


class Unknown(NamedTuple):
    """A call not decided before: :meth:`remember` keeps its decision, unless the memo was cleared meanwhile.

    ``sibling``: for a packed call, the one of its family decided last: the same tensors, options and state,
    validated then, at other sizes. The call's problem is the sibling's at the new sizes
    (:meth:`AttentionProblem._with`), without validating q, k and v again: a training loop's packing changes every
    step."""

    state: tuple
    tensors: tuple
    capturing: bool | None
    key: tuple | None  # None where the family was found among the recent calls (no key was built)
    generation: int  # caches.generation() when the call was looked up
    sizes: tuple | None = None  # a packed call's (sequence count, max_seqlen_q, max_seqlen_kv)
    family: _Family | None = None  # a packed call's, where its family was decided before (then recent)
    boundaries: int = -1  # where the packing's boundaries are in ``tensors`` (a packed call's, of a new family)
    problem: AttentionProblem | None = None  # a packed call's at its sizes, where recall asked for its class's call

    @property
    def sibling(self) -> KnownCall | None:
        return self.family.last if self.family is not None else None

    def sized_problem(self, sibling: KnownCall) -> AttentionProblem | None:
        """A packed call's problem, ``sibling``'s (its :attr:`sibling`, read once) at the call's sizes: the one recall
        made where it asked for the call's class, else made now; None where validation must name the sizes."""
        return self.problem if self.problem is not None else _problem_at(sibling, self.sizes)

    def remember(self, known: KnownCall) -> _Family | None:
        """Keep ``known`` as this call's decision; returns the packed family it joined (None for a dense call)."""
        family, entry = self.family, None
        if family is None:
            guard = None
            if TensorGuards is not None:
                sizes = [list(t.shape) if i != self.boundaries else [None] for i, t in enumerate(self.tensors)]
                guard = TensorGuards(
                    *self.tensors,
                    dynamic_dims_sizes=sizes,
                    dynamic_dims_strides=[list(t.stride()) for t in self.tensors],
                )
            family = _Family(known) if self.sizes is not None else None
            entry = _Entry(self.state, guard, self.key[-1], self.capturing, None if family else known, family)
            _keep(_CALLS, self.key, entry)
            _make_recent(entry)
        if family is not None:
            family.last = known
            _keep(_SIZED, (family, self.sizes), known)
        if generation() != self.generation:  # cleared while deciding: the decision may rest on what it forgot
            if entry is not None:
                _CALLS.pop(self.key, None)
                _set_recent([recent for recent in _RECENT if recent is not entry])
            if family is not None:
                _SIZED.pop((family, self.sizes), None)
        return family


def _keep(memo: OrderedDict, key, value) -> None:
    memo[key] = value
    if len(memo) > MEMO_SIZE:
        memo.popitem(last=False)


# By key: a dense call's _Entry and a packed family's _Entry (its key without the sizes).
_CALLS: OrderedDict[tuple, _Entry] = OrderedDict()
# Under (family, sizes): a packed call's KnownCall. Bounded apart from the families, so a loop's new packing every
# step does not push its family out.
_SIZED: OrderedDict[tuple, KnownCall] = OrderedDict()
_RECENT: list[_Entry] = []


def _clear() -> None:
    _CALLS.clear()
    _SIZED.clear()
    _set_recent([])


register_cache(_clear)


def forget_dense(problem: AttentionProblem) -> None:
    """Forget the dense calls decided for ``problem``, and those alone, captured or compiled ones included: their next
    call decides again (a rental at that shape has been paid: attnselect.choose.first_calls)."""
    eager = problem.eager

    def decided(entry: _Entry) -> bool:
        return entry.known is not None and entry.known.problem.eager == eager

    for key in [key for key, entry in list(_CALLS.items()) if decided(entry)]:
        _CALLS.pop(key, None)
    # every time: a recent call stays recent after the memo drops it (a hit there does not refresh it)
    _set_recent([recent for recent in _RECENT if not decided(recent)])


def known_calls() -> list[KnownCall]:
    """Every call decided before: the dense ones, then the packed ones, each oldest first."""
    dense = [entry.known for entry in _CALLS.values() if entry.known is not None]  # a family's holds none of its own
    return dense + list(_SIZED.values())


def _make_recent(entry: _Entry) -> None:
    """Check ``entry`` first from now on, unless it is recent already (found by key because its guard failed, as on
    tensors whose dispatch keys differ from the first call's: inference mode)."""
    if entry.guard is not None and not any(recent is entry for recent in _RECENT):
        _set_recent([entry, *_RECENT][:RECENT])


def _set_recent(entries: list[_Entry]) -> None:
    """Make ``entries`` the recent calls: a new list swapped in whole, so a thread checking the old one is not
    disturbed (recall reads the module's list once per call)."""
    global _RECENT
    _RECENT = entries


# What torch.is_grad_enabled, torch.are_deterministic_algorithms_enabled and torch.cuda.is_current_stream_capturing
# return, without their Python frames (this runs on every call; a recent call's capture state is read only for CUDA
# tensors: the guard has checked the device).
_grad = torch._C.is_grad_enabled
_deterministic = torch._C._get_deterministic_algorithms
# Autocast and TorchFunctionModes act on the calls a runner makes (SDPA is on autocast's lower-precision list; a
# mode may intercept it), so a runner prepared outside them does not serve inside them (backends/_sdpa.py). Autocast
# is in the key only: a recent call's TensorGuards check fails when autocast for its tensors' device changes, since
# it compares each tensor's dispatch keys after the thread's included and excluded keys, and that device's autocast
# key is excluded when off (torch/csrc/dynamo/guards.cpp LocalState::apply; c10 set_autocast_enabled). Autocast for
# another device does not act on these tensors' ops, and the autocast dtype is in neither.
_autocast = torch._C._is_any_autocast_enabled
_function_mode = torch._C._is_torch_function_mode_enabled
stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)  # a CPU build has no CUDA
# The current device's current stream, as a raw pointer (-1: the current device). A capture runs on another stream
# than the default one (0): CUDA cannot capture the legacy default stream, and torch's CUDAGraph.capture_begin refuses
# it ("CUDA graphs must be captured on a non-default stream"), so on the default stream stream_capturing() is False,
# and this answers that in a fraction of its time (it asks the CUDA runtime).
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0)
_no_environment, _environment, _cache_dir = settings.no_environment, settings.raw_environment, settings.cache_dir_key
_scope = settings.scope
_NUMBER = (float, int, type(None))
# A memo key's per-tensor facts, read by C getters (map over them costs a fraction of a generator per fact)
_SHAPE, _DTYPE, _DEVICE, _REQUIRES_GRAD = map(operator.attrgetter, ("shape", "dtype", "device", "requires_grad"))
_STRIDE = operator.methodcaller("stride")


def recall(q, k, v, options: tuple) -> KnownCall | Unknown | None:
    """The call's :class:`KnownCall` if it was decided before, or if it is a new packing of a class that stands
    (:func:`_class_call`); else :class:`Unknown`, or None where the memo cannot know it (see the module docstring).
    ``options``: a :class:`~attnselect.spec.options.CallOptions`, or a plain tuple of its fields (attention() builds
    its object only off this path)."""
    (
        layout, causal, window, scale, dropout_p, cu_q, cu_kv, max_q, max_kv, cu_q_padded, cu_kv_padded, return_lse,
        softcap, sinks, return_max_logit, _, backend, pad, disable,
    ) = options  # fmt: skip
    if cu_q_padded is not None or cu_kv_padded is not None:
        return None
    sizes = None  # a packed call's: its packing's sizes, apart from the state (its family's)
    if layout == "thd":
        if not (
            type(max_q) is int
            and type(max_kv) is int
            and (cu_kv is None or cu_kv is cu_q)
            and type(cu_q) is torch.Tensor
            and not cu_q.is_cpu
            and not cu_q.is_nested
            and cu_q.dim() == 1  # else validation names it
        ):
            return None
        sizes = (cu_q.shape[0], max_q, max_kv)
    elif cu_q is not None or cu_kv is not None or max_q is not None or max_kv is not None:
        return None  # a dense call given a packed call's arguments: validation refuses them
    if not (
        (causal is False or causal is True or type(causal) is str)
        and (scale is None or type(scale) in _NUMBER)
        and (softcap is None or type(softcap) in _NUMBER)
        and (return_lse is False or return_lse is True)
        and (return_max_logit is False or return_max_logit is True)
        and (pad is None or pad is True or pad is False or type(pad) is str)
        and (disable is None or type(disable) is str)
        and (window is None or (type(window) is tuple and all(type(x) is int for x in window)))
        and type(dropout_p) in (float, int)
    ):
        return None  # 1 == True and 2.0 == 2 as keys: the slow path refuses what it must, whatever ran before
    try:
        if q.is_nested or k.is_nested or v.is_nested or (sinks is not None and sinks.is_nested):
            return None  # TensorGuards cannot check a strided nested tensor (the process aborts); validation names it
        offsets = (q.storage_offset(), k.storage_offset(), v.storage_offset())
        # TensorGuards' check fails for a tensor passed twice: an aliased q, k or v is guarded once, its pattern kept
        aliases = None if k is not q and v is not q and v is not k else (k is q, v is q, v is k)
        state = (
            layout, causal, window, scale, dropout_p, return_lse, softcap, return_max_logit, backend, pad, disable,
            sinks is None, aliases, _grad(), _deterministic(), _function_mode(),
            _no_environment() or _environment(), _cache_dir(), _scope(),
        )  # fmt: skip
        tensors = (q, k, v) if aliases is None else tuple({id(t): t for t in (q, k, v)}.values())
        if cu_q is not None:
            tensors += (cu_q,) if sinks is None else (cu_q, sinks)
        elif sinks is not None:
            tensors += (sinks,)
        recent = None  # a recent call's (known, family, capturing): a family's calls are asked outside this try
        for entry_state, guard, entry_offsets, capturing, known, family in _RECENT:
            if (
                entry_state == state
                and guard.check(*tensors)
                and entry_offsets == offsets
                and (capturing is None or capturing is (raw_stream(-1) != 0 and stream_capturing()))  # None: not CUDA
            ):
                recent = known, family, capturing
                break
        if recent is None:
            capturing = stream_capturing() if q.is_cuda else None
            shapes = tuple(map(_SHAPE, tensors))
            if sizes is not None:  # the key of the family: the boundaries' length left out (they follow q, k and v)
                boundaries = len(tensors) - (1 if sinks is None else 2)
                shapes = shapes[:boundaries] + (None,) + shapes[boundaries + 1 :]
            key = (
                state, capturing, _autocast(), tuple(map(type, tensors)), shapes, tuple(map(_STRIDE, tensors)),
                tuple(map(_DTYPE, tensors)), tuple(map(_DEVICE, tensors)), tuple(map(_REQUIRES_GRAD, tensors)), offsets,
            )  # fmt: skip
            entry = _CALLS.get(key)
    except Exception:  # not tensors, an unhashable or incomparable option...: the slow path validates and names it
        return None
    if recent is not None:
        known, family, capturing = recent
        return known if family is None else _in_family(family, state, tensors, capturing, sizes, None)
    if entry is None:
        if sizes is None:
            return Unknown(state, tensors, capturing, key, generation())
        return Unknown(state, tensors, capturing, key, generation(), sizes, None, boundaries)
    _make_recent(entry)
    if entry.family is None:
        return entry.known
    return _in_family(entry.family, state, tensors, capturing, sizes, key)


def _in_family(family: _Family, state, tensors, capturing, sizes: tuple, key: tuple | None) -> KnownCall | Unknown:
    """The packed call of ``family`` at ``sizes``: known, the call of its class (:func:`_class_call`), or to decide
    from the family's sibling."""
    known = _SIZED.get((family, sizes))
    if known is not None:
        return known
    problem, cleared, standing = None, generation(), family.standing  # read once: attention() rebinds it
    if standing is not None:
        problem = _problem_at(family.last, sizes)
        if problem is not None:
            known = _class_call(family, sizes, problem, standing, cleared)
            if known is not None:
                return known
    return Unknown(state, tensors, capturing, key, cleared, sizes, family, problem=problem)


def _problem_at(sibling: KnownCall, sizes: tuple) -> AttentionProblem | None:
    """``sibling``'s problem, validated, at a new packing's ``sizes`` (the boundaries' length and both max_seqlen, as
    recall reads them); None where validation must name them (no boundaries, a max_seqlen out of range)."""
    boundaries, max_q, max_kv = sizes
    if boundaries and 0 <= max_q < 2**31 and 0 <= max_kv < 2**31:
        return sibling.problem._at_sizes(boundaries - 1, max_q, max_kv)
    return None


def _class_call(family: _Family, sizes: tuple, problem: AttentionProblem, standing, cleared: int) -> KnownCall | None:
    """A new packing of ``family`` at ``sizes`` (the boundaries' length and both max_seqlen), whose problem is
    ``problem``, in a class that stands (``standing``, the family's as read once) on the decision the call kept for
    that class was made of (``family.classes``): that call at these sizes, kept as the call at these sizes unless the
    memo was cleared since ``cleared`` (:func:`attnselect.memos.generation`); None where a decision must be made (a
    class not kept or no longer standing)."""
    stands = standing(problem)
    held = family.classes.get(stands[0]) if stands is not None else None
    if held is None or held[0] is not stands[1]:
        return None
    made = held[1]
    known = KnownCall(problem, made.chosen, made.target, made.call, made.forced, made.runner)
    family.last = known
    _keep(_SIZED, (family, sizes), known)
    if generation() != cleared:  # the memo was cleared meanwhile: the family is gone with what it stood on
        _SIZED.pop((family, sizes), None)
    return known

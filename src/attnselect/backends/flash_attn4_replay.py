"""FlashAttention-4's compiled forward called again without its Python interface.

FA4's ``flash_attn_func`` and ``flash_attn_varlen_func`` work out, in Python, on every call, what the compiled
kernel is called with: the compile key, tile sizes, scheduling and split choices, the output's allocation
(flash_attn/cute/interface.py, ``_flash_attn_fwd``, about 800 lines). That costs more host time than the kernel
takes at small and medium sizes. For a call that needs no gradient, every one of those choices follows from what
the key here holds (the tensors' shapes, strides, dtype and device, a packing's sequence count and longest lengths,
and the runner's options: FA4 reads no tensor's values on that path, the boundaries stay on the GPU), so the second
call of a key is made through FA4's function and recorded: the compiled kernel it called and the arguments it
called it with. Later calls of the key allocate the output (and the log-sum-exp) as that call did and call the same
kernel with the same arguments, their own tensors in place of the recorded ones. (The first call of a key is not
recorded: a one-off shape, a packing met once, pays nothing for it.)

A call is recorded only where it can be replayed alike: the kernel was called once and nothing else FA4 compiles
ran (no split-KV combine, no scheduler metadata or tile sums, which a pack of more than 256 sequences gets), the
kernel's tensors were q, k, v and the boundaries themselves (FA4 copied none: pointers aligned, last dim
contiguous), the output and log-sum-exp it wrote are those returned, and no other argument is a tensor. A process's
first recording of each compiled kernel (FA4's compile key, under the runner's function and options) is then
checked: replayed on that call's own inputs, it must give FA4's result bit for bit (one more kernel run and a
read-back, once; no recording under CUDA graph capture), else none of that kernel's calls is replayed, warned of.
(The check runs on the recorded call's own inputs, so it cannot tell two inputs apart that share memory; the GPU
tests replay on new data.) Otherwise the key keeps calling FA4's function. A replayed call checks its tensors'
pointers are aligned as FA4 requires (it copies unaligned ones: cute_dsl_utils.maybe_contiguous). Only the FA4
version this was read from is replayed (:data:`VERSIONS`). Two things FA4 reads per call are not in the key:
FLASH_ATTENTION_NUM_SMS (on sm90, with no split-KV and no MLA kernel, it changes nothing on this path) and FA4's log
level (in its compile key: a replay keeps the kernel recorded at the level of its recording).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
import sys
import threading
import types
from collections.abc import Callable

import torch

log = logging.getLogger("attnselect")

# The flash-attn-4 versions whose interface.py this follows (the compiled kernel's arguments: q, k, v, out, lse,
# then scalars and, packed, the boundaries; its compile caches as attributes named compile_cache).
VERSIONS = frozenset({"4.0.0b36"})
KEYS_KEPT = 64  # recorded keys per runner (a server's lengths are many: the oldest is recorded again)
ALIGN_BYTES = 16  # interface.py: maybe_contiguous(q, k, v) copies a tensor whose pointer is not 16-byte aligned
_RECORDING = threading.RLock()  # one recording at a time: it swaps FA4's compile caches for the call


class Recorded:
    """A recorded call: the compiled kernel, its arguments (the call's own tensors left as None, at ``places``: q, k,
    v, out, lse, then a packed call's cu_seqlens_q and cu_seqlens_k where the kernel took them), the output's and
    log-sum-exp's shapes and dtypes (None: no log-sum-exp) and FA4's compile key of the kernel."""

    __slots__ = ("kernel", "arguments", "places", "out", "lse", "compile_key")

    def __init__(self, kernel: Callable, arguments: list, places: tuple, out: tuple, lse: tuple | None,
                 compile_key=None):  # fmt: skip
        self.kernel, self.arguments, self.places, self.out, self.lse = kernel, arguments, places, out, lse
        self.compile_key = compile_key  # FA4's key of the compiled kernel in its cache

    def __call__(self, q, k, v, cu_seqlens: tuple = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = torch.empty(self.out[0], dtype=self.out[1], device=q.device)
        lse = torch.empty(self.lse[0], dtype=self.lse[1], device=q.device) if self.lse is not None else None
        arguments = self.arguments.copy()
        if q.requires_grad or k.requires_grad or v.requires_grad:  # under no_grad: FA4 passes detached views
            q, k, v = q.detach(), k.detach(), v.detach()
        for place, tensor in zip(self.places, (q, k, v, out, lse, *cu_seqlens)):
            arguments[place] = tensor
        self.kernel(*arguments)
        return out, lse


class _Proxy:
    """One of FA4's compile caches while a call is recorded: every access passes through; those of the recording
    thread are noted (which cache, and the compiled kernels called with their arguments)."""

    def __init__(self, name: str, cache, notes: list, thread: int):
        self.name, self.cache, self.notes, self.thread = name, cache, notes, thread

    def __contains__(self, key) -> bool:
        return key in self.cache

    def __setitem__(self, key, value) -> None:
        self.cache[key] = value

    def __getitem__(self, key):
        kernel = self.cache[key]
        if threading.get_ident() != self.thread:
            return kernel
        name, notes = self.name, self.notes

        def noted(*arguments):
            notes.append((name, key, kernel, list(arguments)))
            return kernel(*arguments)

        return noted

    def __getattr__(self, attribute):  # clear() and the like
        return getattr(self.cache, attribute)


def record(interface, call: Callable[[], tuple], q, k, v, cu_seqlens: tuple = ()) -> tuple[tuple, Recorded | None]:
    """Make ``call`` (``flash_attn_func`` on ``q``, ``k``, ``v``, or ``flash_attn_varlen_func`` on them and
    ``cu_seqlens``, FA4's ``interface`` module) with its compile caches watched: its result and the :class:`Recorded`
    call that replays it, or None where it cannot be replayed alike."""
    caches = _caches(interface)
    notes: list = []
    with _RECORDING:
        kept = {name: function.compile_cache for name, function in caches.items()}
        try:
            for name, function in caches.items():
                function.compile_cache = _Proxy(name, kept[name], notes, threading.get_ident())
            result = call()
        finally:
            for name, function in caches.items():
                function.compile_cache = kept[name]
    try:
        return result, _recorded(notes, result, (q, k, v), cu_seqlens)
    except Exception as exc:  # noqa: BLE001 (reading the notes is this module's work, not the kernel's: no failure)
        log.debug("attnselect: FlashAttention-4's forward is not replayed (%s: %s)", type(exc).__name__, exc)
        return result, None


def _caches(interface) -> dict:
    """{name: function} of the functions of FA4's ``interface`` module that keep a ``compile_cache`` (their own
    attribute: nothing else is asked of the module's objects)."""
    return {
        name: function
        for name, function in vars(interface).items()
        if isinstance(function, types.FunctionType) and "compile_cache" in function.__dict__
    }


def _recorded(notes: list, result, inputs: tuple, cu_seqlens: tuple) -> Recorded | None:
    """The :class:`Recorded` call of ``notes`` (what a recorded call ran), where it replays alike."""
    out, lse = (result[0], result[1]) if isinstance(result, tuple) else (result, None)
    if len(notes) != 1 or notes[0][0] != "_flash_attn_fwd":
        return None
    _, compile_key, kernel, arguments = notes[0]
    if len(arguments) < 5 or not all(_same(a, t) for a, t in zip(arguments[:3], inputs)):
        return None
    if not _same(arguments[3], out) or not out.is_contiguous():
        return None
    if lse is not None and not (_same(arguments[4], lse) and lse.is_contiguous()):
        return None
    if lse is None and arguments[4] is not None:
        return None
    # a packed call's boundaries, passed as they are (int32, contiguous: FA4 asserts it), q's before k's (one tensor
    # for both where the call passed one)
    found = [i for i, a in enumerate(arguments[5:], 5) if any(_same(a, t) for t in cu_seqlens)]
    if len(found) != len(cu_seqlens) or not all(_same(arguments[i], t) for i, t in zip(found, cu_seqlens)):
        return None
    places = [0, 1, 2, 3, 4, *found]
    if any(_holds_tensor(a) for i, a in enumerate(arguments) if i not in places):
        return None
    for place in places:
        arguments[place] = None
    return Recorded(kernel, arguments, tuple(places), (tuple(out.shape), out.dtype),
                    (tuple(lse.shape), lse.dtype) if lse is not None else None, compile_key)  # fmt: skip


def _checked(recorded: Recorded, result, q, k, v, cu_seqlens: tuple) -> bool:
    """Whether replaying ``recorded`` on the recorded call's own inputs gives FA4's ``result`` bit for bit (its
    output, and its log-sum-exp where it wrote one); a failure is warned of. One more kernel run and a read-back."""
    out, lse = (result[0], result[1]) if isinstance(result, tuple) else (result, None)
    try:
        again = recorded(q, k, v, cu_seqlens)
        alike = _bits_equal(again[0], out) and (lse is None or _bits_equal(again[1], lse))
    except Exception as exc:  # noqa: BLE001 (any failure of the replay leaves FA4's own call, warned)
        log.warning("attnselect: FlashAttention-4's forward replayed at %s raised %s: FA4's own call serves it",
                    tuple(q.shape), f"{type(exc).__name__}: {exc}")  # fmt: skip
        return False
    if not alike:
        log.warning("attnselect: FlashAttention-4's forward replayed at %s differed from FA4's own call: FA4's own "
                    "call serves it", tuple(q.shape))  # fmt: skip
    return alike


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN included: a warm-up on torch.empty's memory may hold some)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(_BITS[a.element_size()]),
                                                                     b.view(_BITS[b.element_size()]))  # fmt: skip


def _hashable(value):
    """``value`` as a key: dicts as sorted items, lists as tuples, recursively (FA4's compile keys are tuples)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


def _same(argument, tensor: torch.Tensor) -> bool:
    """Whether ``argument`` is ``tensor``'s memory as ``tensor`` lays it out (FA4 passes a detached view)."""
    return (
        isinstance(argument, torch.Tensor)
        and argument.data_ptr() == tensor.data_ptr()
        and argument.shape == tensor.shape
        and argument.stride() == tensor.stride()
        and argument.dtype == tensor.dtype
    )


def _holds_tensor(argument) -> bool:
    if isinstance(argument, torch.Tensor):
        return True
    if isinstance(argument, (tuple, list)):
        return any(_holds_tensor(a) for a in argument)
    return False


_SEEN = object()  # a key called once: its next call is recorded (a one-off packing pays no recording)
CALLS_BEFORE_REPLAY = 2  # a key's calls through FA4's function: the first (_SEEN), the second (recorded)
_PAUSED = [0]  # paused()'s depth, process-wide: above 0, every runner calls FA4's function, none records or replays
_PAUSING = threading.Lock()  # paused()'s changes of _PAUSED (a call reads it without)


@contextlib.contextmanager
def paused():
    """Within it (a block, or a function it decorates), FA4's runners in every thread of the process call its
    function, recording and replaying nothing: what a new shape's call costs, the time attnselect.bench.calibrate
    takes for its host times (the rules price a shape's first :data:`CALLS_BEFORE_REPLAY` calls at them,
    attnselect.choose.first_calls)."""
    with _PAUSING:
        _PAUSED[0] += 1
    try:
        yield
    finally:
        with _PAUSING:
            _PAUSED[0] -= 1


@contextlib.contextmanager
def replaying():
    """Within it, the pauses around it are lifted, process-wide: attnselect.bench.calibrate times FA4's replayed
    calls (``replayed_host_us``) within the paused calibration, round by round beside its interface's. Not for
    concurrent use: another thread's paused block is lifted too meanwhile, and one entered meanwhile pauses this
    one's calls."""
    with _PAUSING:
        depth, _PAUSED[0] = _PAUSED[0], 0
    try:
        yield
    finally:
        with _PAUSING:
            _PAUSED[0] += depth


# Per compiled kernel (FA4's function, its options and its compile key of the kernel, the device): True once a
# recording's check passed (:func:`_checked`), False once one failed (none of its calls is replayed then). As many as
# FA4 compiles (seconds each), so not bounded.
_CHECKED: dict[tuple, bool] = {}


class ForwardReplays:
    """A runner's replays of FA4's forward, per key: ``replays(q, k, v)`` is ``function(q, k, v, **options)`` (FA4's
    ``flash_attn_func``), and for a packed runner ``replays(q, k, v, packing)`` is ``function(q, k, v, cu_seqlens_q=...,
    cu_seqlens_k=..., max_seqlen_q=..., max_seqlen_k=..., **options)`` (``flash_attn_varlen_func``), replayed
    (:class:`Recorded`) where the key's second call was recorded. A key: the tensors' kind, shapes, strides, dtypes and
    device, whether they need a gradient, and a packing's boundaries' shapes, strides, dtypes and devices and its
    longest lengths (what FA4's host choices read; not the lengths, which stay on the GPU)."""

    def __init__(self, interface, function: Callable, options: dict, *, fixed: bool = False):
        self.interface, self.function, self.options = interface, function, options
        # every call has the first one's shapes, strides, dtypes and gradients (attention()'s memoized dense calls,
        # whose memo checked them): one key, not worked out again
        self.fixed = fixed
        self.kept: dict[tuple, object] = {}  # _SEEN, a Recorded call, or None: not replayable (the interface runs)
        self.options_key = (getattr(function, "__name__", repr(function)), _hashable(options))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing=None):
        if self.fixed:
            key, cu_seqlens, keywords = (), (), self.options
        elif packing is None:
            key, cu_seqlens, keywords = _tensors_key(q, k, v), (), self.options
        else:
            cu_q, cu_k = cu_seqlens = packing.cu_seqlens_q, packing.cu_seqlens_kv
            longest = packing.max_seqlen_q, packing.max_seqlen_kv
            key = (*_tensors_key(q, k, v), cu_q.shape, cu_k.shape, cu_q.stride(), cu_k.stride(), cu_q.dtype, cu_k.dtype,
                   cu_q.device, cu_k.device, longest)  # fmt: skip
            keywords = dict(self.options, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=packing.max_seqlen_q,
                            max_seqlen_k=packing.max_seqlen_kv)  # fmt: skip
        if _PAUSED[0] > 0:
            return self.function(q, k, v, **keywords)
        kept = self.kept.get(key)
        aligned = not (q.data_ptr() % ALIGN_BYTES or k.data_ptr() % ALIGN_BYTES or v.data_ptr() % ALIGN_BYTES)
        if type(kept) is Recorded and aligned:
            return kept(q, k, v, cu_seqlens)
        # a first call, one not replayed, one FA4 copies (maybe_contiguous), or one under CUDA graph capture (the
        # check of a recording reads its result back)
        if kept is not _SEEN or not aligned or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            if key not in self.kept:
                self._keep(key, _SEEN)
            return self.function(q, k, v, **keywords)
        result, recorded = record(self.interface, lambda: self.function(q, k, v, **keywords), q, k, v, cu_seqlens)
        if recorded is None:
            log.debug("attnselect: FlashAttention-4's forward at %s is not replayed (%s)", tuple(q.shape),
                      "it ran more than its kernel, or copied or returned other tensors")  # fmt: skip
        else:
            configuration = (*self.options_key, _hashable(recorded.compile_key), q.device)
            passed = _CHECKED.get(configuration)
            if passed is None:
                passed = _CHECKED[configuration] = _checked(recorded, result, q, k, v, cu_seqlens)
            recorded = recorded if passed else None
        self._keep(key, recorded)
        return result

    def _keep(self, key: tuple, value) -> None:
        kept = self.kept
        if len(kept) >= KEYS_KEPT and key not in kept:
            try:
                kept.pop(next(iter(kept)), None)
            except (RuntimeError, StopIteration):  # another thread changed it meanwhile
                pass
        kept[key] = value


def _tensors_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """What FA4's host choices read of q, k and v: their kind (a FakeTensor runs no kernel), shapes, strides, dtypes,
    device, and their needing a gradient (it then writes the lse, which its compile key reads)."""
    return (type(q), q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, q.requires_grad or k.requires_grad or v.requires_grad)  # fmt: skip


def replays(module, function: Callable, options: dict, *, fixed: bool = False) -> ForwardReplays | None:
    """:class:`ForwardReplays` of ``function`` (``module``'s ``flash_attn_func``) with ``options`` (``fixed``: every
    call like the first), or None where the installed FA4 is not a version this follows, or its interface module is
    not where it was."""
    interface = sys.modules.get(f"{module.__name__}.interface")
    if _installed_version() not in VERSIONS or interface is None or not hasattr(interface, "_flash_attn_fwd"):
        return None
    return ForwardReplays(interface, function, options, fixed=fixed)


@functools.cache
def _installed_version() -> str | None:
    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None

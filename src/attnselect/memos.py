"""What attnselect remembers between calls, and how it forgets.

**Files.** :func:`cache_dir`: where the decision cache (:mod:`attnselect.choose.store`) and kernels' compile caches
live.

**Clearing.** :func:`clear_cache` (``attnselect.clear_cache``) forgets every memoized decision: each cache registers
how to clear itself (:func:`register_cache`). A cache that stores what it worked out from state read earlier (a
decision made while another thread registered a backend, say) reads :func:`generation` before that work and checks
it after storing: a clear in between bumps it, and the cache then drops what it stored.

**:class:`TensorMemo`**: values computed from tensors, remembered while those very tensors live unchanged.
Packed calls hand the same boundary tensors to every layer of a step (Megatron's and TE's packed
sequence parameters, a collator's cu_seqlens), so work derived from them (a flex document mask, the
bucketed boundaries of the cuDNN frontend, whether two boundary tensors hold equal values) is done once
per tensor, not once per layer. An entry is keyed by the identity of its first tensor (the owner) and a
configuration; it holds weak references to every tensor it was computed from and their version
counters, so it hits only for the very same tensors, unchanged in place. Entries leave when their owner
is freed, so a new tensor at a reused address never hits them. Changes that bypass the version counter
(through ``.data`` or DLPack) are not seen. Inference tensors have no version counter, and what is computed
in inference mode is an inference tensor, which autograd cannot save for a later training call: nothing derived
from the one or computed in the other is remembered. (A WeakKeyDictionary would compare tensors with ==, elementwise.)
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Callable, Hashable
from pathlib import Path

import torch

_CLEARERS: list = []
_generation = [0]  # bumped before every clear


def register_cache(clear) -> None:
    """Have :func:`clear_cache` also call ``clear`` (for caches derived from decisions)."""
    _CLEARERS.append(clear)


def generation() -> int:
    """How many clears have begun: a value stored under an earlier one may come from the state they forgot."""
    return _generation[0]


_WARNED: set = set()  # the tags warn_once has warned of in this process


def warn_once(tag: str, message: str, *args) -> None:
    """Log ``message % args`` at WARNING the first time ``tag`` is seen in this process."""
    if tag not in _WARNED:
        _WARNED.add(tag)
        logging.getLogger("attnselect").warning(message, *args)


# os.environ encodes every key and decodes every value on each access, and raises and catches a KeyError for an unset
# one; on POSIX its raw bytes mapping answers the same question without that work (read on every attention call).
RAW_ENVIRON = getattr(os.environ, "_data", None) if os.name == "posix" else None


def environment_reader(name: str) -> Callable[[], str | None]:
    """``read()``: ``os.environ.get(name)``, from :data:`RAW_ENVIRON` where there is one: for variables read on every
    new packing."""
    if RAW_ENVIRON is None:
        return functools.partial(os.environ.get, name)
    get, raw = RAW_ENVIRON.get, name.encode()

    def read() -> str | None:
        value = get(raw)
        return None if value is None else os.fsdecode(value)

    return read


def cache_dir() -> Path:
    """Where attnselect keeps files between processes: ATTNSELECT_CACHE_DIR, else the user cache directory
    (platformdirs)."""
    directory = os.environ.get("ATTNSELECT_CACHE_DIR")
    if not directory:
        import platformdirs

        directory = platformdirs.user_cache_dir("attnselect")
    return Path(directory).expanduser()


def clear_cache() -> None:
    """Forget every memoized decision."""
    _generation[0] += 1
    for clear in _CLEARERS:
        clear()


class TensorMemo:
    """``get(tensors, config, compute)``: ``compute()``'s value, computed once per unchanged ``tensors``."""

    def __init__(self, per_owner: int = 8):
        self._entries: dict[int, dict] = {}  # id(owner) -> {config: (versions, weak references, value)}
        self._per_owner = per_owner  # configurations kept per owner (layers may alternate masks)

    def get(self, tensors: tuple[torch.Tensor, ...], config: Hashable, compute: Callable):
        owner = tensors[0]
        if torch.is_inference_mode_enabled() or any(t.is_inference() for t in tensors):
            return compute()
        versions = tuple(t._version for t in tensors)
        entries = self._entries.get(id(owner))
        hit = entries.get(config) if entries else None
        if hit is not None and hit[0] == versions and all(ref() is t for ref, t in zip(hit[1], tensors)):
            return hit[2]
        value = compute()
        if entries is None:
            entries = self._entries[id(owner)] = {}
            weakref.finalize(owner, self._entries.pop, id(owner), None)
        if len(entries) >= self._per_owner and config not in entries:
            entries.pop(next(iter(entries)))
        entries[config] = (versions, [weakref.ref(t) for t in tensors], value)
        return value

    def remembered(self, owner: torch.Tensor) -> dict:
        """{config: value} remembered for ``owner`` (for tests and debugging)."""
        return {config: entry[2] for config, entry in self._entries.get(id(owner), {}).items()}

    def clear(self) -> None:
        self._entries.clear()

"""The memoized state that :func:`attnselect.clear_cache` forgets: each cache registers how to clear itself.

A cache that stores what it worked out from state read earlier (a decision made while another thread registered a
backend, say) reads :func:`generation` before that work and checks it after storing: a clear in between bumps it, and
the cache then drops what it stored.
"""

from __future__ import annotations

_CLEARERS: list = []
_generation = [0]  # bumped before every clear


def register_cache(clear) -> None:
    """Have :func:`clear_cache` also call ``clear`` (for caches derived from decisions)."""
    _CLEARERS.append(clear)


def generation() -> int:
    """How many clears have begun: a value stored under an earlier one may come from the state they forgot."""
    return _generation[0]


def clear_cache() -> None:
    """Forget every memoized decision."""
    _generation[0] += 1
    for clear in _CLEARERS:
        clear()

"""The memoized state that :func:`attnselect.clear_cache` forgets: each cache registers how to clear itself."""

from __future__ import annotations

_CLEARERS: list = []


def register_cache(clear) -> None:
    """Have :func:`clear_cache` also call ``clear`` (for caches derived from decisions)."""
    _CLEARERS.append(clear)


def clear_cache() -> None:
    """Forget every memoized decision."""
    for clear in _CLEARERS:
        clear()

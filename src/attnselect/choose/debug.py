"""Debug logging on the standard ``logging`` module, logger ``"attnselect"``.

Like TransformerEngine's NVTE_DEBUG x NVTE_DEBUG_LEVEL: ``ATTNSELECT_DEBUG=1`` with
``ATTNSELECT_DEBUG_LEVEL=1`` (the default level) prints one INFO line per new decision,
``=2`` also every candidate with its verdict and reasons at DEBUG. Without ATTNSELECT_DEBUG
nothing is printed by attnselect itself; the lines still go to the "attnselect" logger for
applications that configure logging. Only new decisions log: memoized calls do no logging work.
"""

from __future__ import annotations

import logging
import os
import sys

from attnselect.errors import InvalidInputError

LOGGER = logging.getLogger("attnselect")
_LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}
_handler: logging.Handler | None = None


def debug_level() -> int:
    """0 (off), 1 (decisions) or 2 (every candidate), from ATTNSELECT_DEBUG x ATTNSELECT_DEBUG_LEVEL."""
    values = {}
    for name, allowed in (("ATTNSELECT_DEBUG", ("0", "1")), ("ATTNSELECT_DEBUG_LEVEL", ("0", "1", "2"))):
        value = os.environ.get(name, "1" if name.endswith("LEVEL") else "0").strip()
        if value not in allowed:
            raise InvalidInputError(f"{name}: got {value!r}, expected one of {allowed}")
        values[name] = int(value)
    return values["ATTNSELECT_DEBUG"] * values["ATTNSELECT_DEBUG_LEVEL"]


class _Stderr(logging.StreamHandler):
    """A stream handler that writes to whatever sys.stderr is now (test runners replace it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _apply(level: int) -> None:
    """Attach (or detach) attnselect's own stderr handler to match the requested level."""
    global _handler
    if level and _handler is None:
        _handler = _Stderr()
        _handler.setFormatter(logging.Formatter("[attnselect %(levelname)s] %(message)s"))
        LOGGER.addHandler(_handler)
    if _handler is not None:
        _handler.setLevel(_LEVELS[level])
    if level:
        LOGGER.setLevel(_LEVELS[level])


def log_decision(decision) -> None:
    """Log a new decision (a :class:`~attnselect.choose.decision.Decision`): one INFO line; with level 2 every
    candidate at DEBUG."""
    _apply(debug_level())
    if LOGGER.isEnabledFor(logging.INFO):  # the prose costs more than the decision
        LOGGER.info("%s | %s", decision.problem.describe(), decision.why)
    if LOGGER.isEnabledFor(logging.DEBUG):
        timings = decision.timings or {}
        for verdict in decision.verdicts:
            candidate = verdict.candidate
            if not verdict.supported:
                LOGGER.debug("  %s: not supported: %s", candidate, "; ".join(verdict.reasons))
                continue
            rank = decision.rank_of(candidate)
            text = f"supported, rank {rank}" if rank else "supported, but failed while tuning"
            if candidate in timings:
                text += f", measured {timings[candidate] or 'FAILED'}"
            LOGGER.debug("  %s: %s", candidate, text)

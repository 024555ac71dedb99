"""Candidates that raised at run time, or whose result the self-check found wrong: remembered in this process and,
unless the failure may pass (out of memory), in the decision cache for later processes on the same target
fingerprint. Failures are kept per problem signature (:attr:`AttentionProblem.signature`: head dims, GQA ratio, mask,
layout, dtype, phase, size class), so a packed loop whose sizes change every step does not meet the same failure
at every new packing."""

from __future__ import annotations

import json

import torch

from attnselect import caches, debug, store
from attnselect.candidates import Candidate
from attnselect.distributed import is_distributed
from attnselect.problem import AttentionProblem
from attnselect.target import Target

# Candidates that failed in this process: (problem signature, target) -> {candidate: error}. Kept across
# clear_cache(): they are facts about this machine and its library versions, not memoized choices.
_FAILED: dict[tuple, dict] = {}
# Those earlier processes recorded in the decision cache: its entry key -> {candidate: error}, read once per process.
_RECORDED: dict | None = None
FAILED_AT_RUN_TIME = "failed at run time"  # the policy field of their cache entries


def failures(problem: AttentionProblem, target: Target) -> dict:
    """{candidate: error} of the candidates that failed at run time for ``problem`` on ``target``: in this
    process, or recorded in the decision cache by an earlier one on the same target fingerprint (not under
    torch.distributed, where ranks could read different cache files and then disagree)."""
    failed = _FAILED.get((problem.signature, target), {})
    recorded = _recorded_failures()
    if not recorded or is_distributed():
        return failed
    earlier = recorded.get(_entry_key(problem, target))
    return {**earlier, **failed} if earlier else failed


def _recorded_failures() -> dict:
    global _RECORDED
    if _RECORDED is None:
        _RECORDED = {
            key: {Candidate(**f["candidate"]): f["error"] for f in entry.get("failed", ())}
            for key, entry in store.entries().items()
            if json.loads(key).get("policy") == FAILED_AT_RUN_TIME
        }
    return _RECORDED


def mark_failed(
    problem: AttentionProblem, target: Target, candidate: Candidate, error: BaseException, *, falls_back: bool = True
) -> None:
    """Record a run-time failure (one warning) and forget decisions, so the next call re-selects without it.

    Failures that may pass (out of memory) stay in this process; others are also recorded in the decision
    cache under the target fingerprint, so later processes on the same GPU and library versions skip the
    candidate too (the fingerprint changes with any version, which retries it)."""
    text = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
    _FAILED.setdefault((problem.signature, target), {})[candidate] = text
    transient = isinstance(error, _OUT_OF_MEMORY) or "out of memory" in str(error).lower()
    if not transient:
        store.remember(
            _entry_key(problem, target),
            {"failed": [{"candidate": candidate.to_dict(), "error": text}]},
            combine=_with_earlier,
        )
    debug.LOGGER.warning(
        "attnselect: %s failed on %s (%s); %s (%s)",
        candidate,
        problem.describe(),
        text,
        "falling back to the next candidate; ATTNSELECT_STRICT=1 raises instead" if falls_back else "raising it",
        "for this process only: it may pass" if transient else "recorded in the decision cache for this target",
    )
    caches.clear_cache()


def _entry_key(problem: AttentionProblem, target: Target) -> str:
    """The decision cache's key of a problem signature's failures on a target fingerprint."""
    return json.dumps(
        {"signature": list(problem.signature), "policy": FAILED_AT_RUN_TIME, "target": store.fingerprint(target)},
        sort_keys=True,
    )


_OUT_OF_MEMORY = (MemoryError, *((torch.OutOfMemoryError,) if hasattr(torch, "OutOfMemoryError") else ()))


def _with_earlier(old: dict | None, new: dict) -> dict:
    """A failure entry merged with what the file already holds (another process may have added to it)."""
    replaced = [f["candidate"] for f in new["failed"]]
    return {"failed": [f for f in (old or {}).get("failed", ()) if f["candidate"] not in replaced] + new["failed"]}

"""Verdicts on candidates (:class:`~attnselect.spec.options.Candidate`, (backend, pad_to) pairs).

Every registered backend gives a native candidate and, when the head dims differ or are not multiples of 8
(59/59, 15/15), a padded one: Q/K/V zero-padded to max(d_qk, d_v) rounded up to a multiple of 8
(:attr:`AttentionProblem.pad_target`), the output trimmed back.
"""

from __future__ import annotations

from attnselect.backends import evidence
from attnselect.backends.base import Backend, all_backends
from attnselect.choose.settings import Overrides
from attnselect.spec.options import Candidate, Verdict
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target

NO_OVERRIDES = Overrides()


def kernel_reasons(backend: Backend, problem: AttentionProblem, target: Target) -> list[str]:
    """Why ``backend`` cannot serve ``problem`` (the problem the kernel gets: padded where the candidate pads) on
    ``target``: its documented surface, then, for young kernels, the correctness grid's allowlist
    (:mod:`attnselect.backends.evidence`)."""
    reasons = backend.not_supported_reasons(problem, target)
    if not reasons and target.device_type in backend.evidence_required:
        reasons = evidence.reasons(backend.name, problem, target)
    return reasons


def candidate_reasons(
    candidate: Candidate, backend: Backend, kernel_problem: AttentionProblem, target: Target, failed: dict | None
) -> list[str]:
    """Why ``candidate`` cannot serve on ``target``, its controls aside: its run-time failure here (``failed``: see
    :func:`judge`), else its kernel's reasons for ``kernel_problem`` (the problem, padded where it pads)."""
    if failed and candidate in failed:
        return [f"failed at run time on this target: {failed[candidate]}"]
    return kernel_reasons(backend, kernel_problem, target)


def override_reasons(overrides: Overrides, candidate: Candidate, problem: AttentionProblem) -> list[str]:
    """Why the caller's controls exclude a candidate (empty when they allow it)."""
    if candidate.backend in overrides.disable:
        return ["disabled by the caller (disable / ATTNSELECT_DISABLE)"]
    if overrides.backend is not None and candidate.backend != overrides.backend:
        return [f"the caller forced backend {overrides.backend!r}"]
    if overrides.pad == "never" and candidate.padded:
        return ["padding is switched off (pad='never')"]
    if overrides.pad == "always" and not candidate.padded and problem.pad_target is not None:
        return ["padding is forced (pad='always')"]
    return []


def judge(
    problem: AttentionProblem, target: Target, overrides: Overrides = NO_OVERRIDES, failed: dict | None = None
) -> tuple[Verdict, ...]:
    """A verdict for every candidate of every registered backend, in registry order.

    ``failed`` maps candidates that raised at run time on this machine (this process, or an earlier one
    through the decision cache) to their error.
    """
    verdicts = []
    pad_target = problem.pad_target
    padded = problem if pad_target is None else problem.padded(pad_target)
    for backend in all_backends():
        options = [None] if pad_target is None else [None, pad_target]
        for pad_to in options:
            candidate = Candidate(backend.name, pad_to)
            reasons = override_reasons(overrides, candidate, problem)
            if not reasons or (failed and candidate in failed):  # a run-time failure is the reason given first
                reasons = candidate_reasons(candidate, backend, problem if pad_to is None else padded, target, failed)
            verdicts.append(Verdict(candidate, tuple(reasons)))
    return tuple(verdicts)

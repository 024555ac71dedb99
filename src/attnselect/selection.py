"""`select`: judge every candidate, rank the supported ones, and memoize the decision."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from attnselect import backends, debug, settings
from attnselect import policy as rules
from attnselect.candidates import Candidate, Verdict, judge
from attnselect.errors import ForcedChoiceError, NoSupportedCandidateError
from attnselect.problem import AttentionProblem
from attnselect.target import Target

@dataclass(frozen=True)
class Decision:
    """The outcome of one selection: the chosen candidate, the ranked alternatives, every verdict."""

    problem: AttentionProblem
    target: Target
    policy: str
    overrides: settings.Overrides
    chosen: Candidate
    ranked: tuple[Candidate, ...]
    verdicts: tuple[Verdict, ...]

    @property
    def why(self) -> str:
        key, _ = rules.table_for(self.problem, self.target)
        how = f"padded to {self.chosen.pad_to}" if self.chosen.padded else "native"
        because = (f"it ranks first of {len(self.ranked)} supported candidates in the {self.policy} "
                   f"table for {' '.join(key)}")
        if self.overrides.backend:
            because = f"the caller forced backend {self.overrides.backend!r} and " + because
        natives = [c for c in self.ranked if not c.padded]
        padded = [c for c in self.ranked if c.padded]
        if self.overrides.pad != "auto" and self.problem.different_head_dims:
            because += f"; the caller set pad={self.overrides.pad!r}"
        elif self.chosen.padded:
            because += (f"; padding wins over the best native candidate, {natives[0].backend}" if natives
                        else "; no native candidate is supported")
        elif self.problem.different_head_dims:
            because += (f"; the best padded candidate, {padded[0]}, ranks lower" if padded
                        else "; no padded candidate is supported")
        return f"running {self.chosen.backend}, {how}, because {because}"

    def rank_of(self, candidate: Candidate) -> Optional[int]:
        return self.ranked.index(candidate) + 1 if candidate in self.ranked else None

    def to_dict(self) -> dict:
        return {
            "problem": self.problem.to_dict(),
            "target": self.target.to_dict(),
            "policy": self.policy,
            "chosen": self.chosen.to_dict(),
            "why": self.why,
            "candidates": [{**v.candidate.to_dict(), "supported": v.supported, "reasons": list(v.reasons),
                            "rank": self.rank_of(v.candidate)} for v in self.verdicts],
        }


_MEMO: "OrderedDict[tuple, Decision]" = OrderedDict()
MEMO_SIZE = 4096   # distinct (problem, target, controls) decisions kept; the oldest go first


_CLEARERS = [_MEMO.clear]


def register_cache(clear) -> None:
    """Have :func:`clear_cache` also call ``clear`` (for caches derived from decisions)."""
    _CLEARERS.append(clear)


def clear_cache() -> None:
    """Forget every memoized decision."""
    for clear in _CLEARERS:
        clear()


def select(problem: AttentionProblem, *, target: Optional[Target] = None, policy: Optional[str] = None,
           backend: Optional[str] = None, pad=None, disable=None) -> Decision:
    """Choose a candidate for ``problem`` on ``target`` (default: the live machine).

    ``backend`` forces a backend, ``pad`` is "auto", "always"/True or "never"/False, ``disable``
    excludes backends; each defaults to its ATTNSELECT_* variable. Raises
    :class:`NoSupportedCandidateError` or :class:`ForcedChoiceError` listing every reason.
    """
    target = target or Target.current()
    env, scoped = settings.environment(), settings.scope()
    if disable is not None and not isinstance(disable, str):
        disable = settings.names(disable, "disable")
    key = (problem, target, policy, backend, pad, disable, env, scoped, backends.registry_version())
    try:
        decision = _MEMO.get(key)
    except TypeError:   # an unhashable control: resolve() names it
        decision, key = None, None
    if decision is None:
        decision = _decide(problem, target, settings.resolve(policy=policy, backend=backend, pad=pad,
                                                              disable=disable, env=env, scoped=scoped))
        if key is not None:
            _MEMO[key] = decision
            if len(_MEMO) > MEMO_SIZE:
                _MEMO.popitem(last=False)
        debug.log_decision(decision)
    return decision


def _decide(problem: AttentionProblem, target: Target, overrides: settings.Overrides) -> Decision:
    verdicts = judge(problem, target, overrides)
    ranked = rules.rank(verdicts, problem, target)
    if not ranked:
        error = ForcedChoiceError if overrides.backend or overrides.pad != "auto" else NoSupportedCandidateError
        raise error(no_candidate_message(problem, target, verdicts, overrides))
    return Decision(problem, target, overrides.policy, overrides, ranked[0], ranked, verdicts)


def no_candidate_message(problem, target, verdicts, overrides) -> str:
    forced = [f"backend={overrides.backend!r}"] * bool(overrides.backend) + [f"pad={overrides.pad!r}"] * (overrides.pad != "auto")
    head = (f"No attention candidate can serve {problem.describe()} on {target.describe()}"
            + (f" with {', '.join(forced)}" if forced else "") + ". Every candidate and why not:")
    lines = [head]
    for v in verdicts:
        if overrides.backend and v.candidate.backend != overrides.backend:
            continue
        lines.append(f"  {v.candidate}: " + "; ".join(v.reasons))
    return "\n".join(lines)

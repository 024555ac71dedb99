"""`Decision`: the outcome of one selection, and the sentence that says why."""

from __future__ import annotations

from dataclasses import dataclass

from attnselect.candidates import Candidate, Verdict
from attnselect.policies import rules
from attnselect.problem import AttentionProblem
from attnselect.settings import Overrides
from attnselect.target import Target


@dataclass(frozen=True)
class Decision:
    """The outcome of one selection: the chosen candidate, the ranked alternatives, every verdict."""

    problem: AttentionProblem
    target: Target
    policy: str
    overrides: Overrides
    chosen: Candidate
    ranked: tuple[Candidate, ...]
    verdicts: tuple[Verdict, ...]
    timings: dict | None = None  # measure policy: Candidate -> Timing, or None where it failed

    @property
    def why(self) -> str:
        key, _ = rules.table_for(self.problem, self.target)
        how = f"padded to {self.chosen.pad_to}" if self.chosen.padded else "native"
        because = (
            f"it ranks first of {len(self.ranked)} supported candidates in the {self.policy} table for {' '.join(key)}"
        )
        if self.timings:
            timed = {c: t for c, t in self.timings.items() if t is not None}
            fastest = min(timed, key=lambda c: timed[c].median_ms)
            because = f"it measured {timed[self.chosen]} against {len(timed)} timed candidates" + (
                " (the fastest)"
                if fastest == self.chosen
                else f", inside the spread of the fastest, {fastest} at {timed[fastest]}, and ranks higher in the rules"
            )
        if self.overrides.backend:
            because = f"the caller forced backend {self.overrides.backend!r} and " + because
        natives = [c for c in self.ranked if not c.padded]
        padded = [c for c in self.ranked if c.padded]
        if self.overrides.pad != "auto" and self.problem.pad_target is not None:
            because += f"; the caller set pad={self.overrides.pad!r}"
        elif self.chosen.padded:
            because += (
                f"; padding wins over the best native candidate, {natives[0].backend}"
                if natives
                else "; no native candidate is supported"
            )
        elif self.problem.pad_target is not None:
            because += (
                f"; the best padded candidate, {padded[0]}, ranks lower"
                if padded
                else "; no padded candidate is supported"
            )
        return f"running {self.chosen.backend}, {how}, because {because}"

    def rank_of(self, candidate: Candidate) -> int | None:
        return self.ranked.index(candidate) + 1 if candidate in self.ranked else None

    def to_dict(self) -> dict:
        return {
            "problem": self.problem.to_dict(),
            "target": self.target.to_dict(),
            "policy": self.policy,
            "chosen": self.chosen.to_dict(),
            "why": self.why,
            "candidates": [
                {
                    **v.candidate.to_dict(),
                    "supported": v.supported,
                    "reasons": list(v.reasons),
                    "rank": self.rank_of(v.candidate),
                }
                for v in self.verdicts
            ],
        }

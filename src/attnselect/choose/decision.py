"""`Decision`: the outcome of one selection, and its prose: the sentence that says why, the report `explain`
prints, and the message when no candidate serves."""

from __future__ import annotations

from dataclasses import dataclass, field

from attnselect.choose import calibration, first_calls, rules
from attnselect.choose.first_calls import Rental
from attnselect.choose.predict import PACKING_SHARED_BY, UNHIDDEN
from attnselect.choose.settings import Overrides
from attnselect.errors import InvalidInputError
from attnselect.spec.options import Candidate, Verdict
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target


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
    predictions: dict | None = None  # a calibration held: Candidate -> Prediction, or None where it has none
    calibration: str = ""  # the calibration's source, or why none holds
    rental: Rental | None = None  # a faster one has a first call to pay: chosen runs meanwhile (choose.first_calls)
    # select_packed's decision at other sizes that this one was carried from: ranked and verdicts hold only the
    # candidates judged until the choice settled (explain and select judge them all)
    carried_from: AttentionProblem | None = None
    # first_calls.state() where first_calls.ran_first ordered it (a captured call); None otherwise
    ran_at: tuple | None = field(default=None, compare=False)

    @property
    def why(self) -> str:
        key, _ = rules.table_for(self.problem, self.target)
        how = f"padded to {self.chosen.pad_to}" if self.chosen.padded else "native"
        refined = rules.refinement_reason(key, self.problem)
        because = (
            f"it ranks first of {len(self.ranked)} supported candidates in the {self.policy} table for {' '.join(key)}"
            + (f" ({refined})" if refined else "")
        )
        if self.predictions and self.predictions.get(self.chosen) is not None:
            mine = self.predictions[self.chosen]
            timed = {c: p for c, p in self.predictions.items() if p is not None}
            lowest = min(timed, key=lambda c: timed[c].total_us)
            among = (
                f"{len(self.ranked)} supported candidates (calibration {self.calibration})"
                if self.carried_from is None
                else f"the candidates that serve the call (calibration {self.calibration}; carried from the decision "
                f"for {self.carried_from.describe()}, judging candidates in predicted order until the choice settled)"
            )
            because = (
                f"its predicted time, {mine}, is the lowest of {among}"
                if timed[lowest].total_us >= mine.total_us
                else f"its predicted time, {mine}, is within {rules.TIE_BAND:.0%} of the lowest of {among}, "
                f"{lowest}'s {timed[lowest].total_us:.1f} us, and alone, host and GPU in turn, it takes the least of "
                f"those: {mine.alone_us:.1f} us"
                + (
                    f" (its forward's GPU time hiding {mine.hidden_us:.1f} us of its backward's host time)"
                    if mine.hidden_us
                    else ""
                )
            )
        first = self.first_ranked
        kept = first is not None and first != self.chosen and self.ran_at is not None  # first_calls.ran_first moved it
        if kept:
            ranks = (
                f"predicted fastest (calibration {self.calibration})"
                if self.predictions and self.predictions.get(first) is not None
                else f"first in the {self.policy} table for {' '.join(key)}"
            )
            because = (
                f"it has run this call (its configuration) in this process and {first}, {ranks}, has not: a "
                "captured call keeps what its warm-up ran (a first call would build or compile inside the capture, "
                "where the self-check does not look; warmup() of the captured problem runs it first)"
            )
        if self.timings:
            timed = {c: t for c, t in self.timings.items() if t is not None}
            fastest = min(timed, key=lambda c: timed[c].median_ms)
            because = f"it measured {timed[self.chosen]} against {len(timed)} timed candidates" + (
                " (the fastest)"
                if fastest == self.chosen
                else f", inside the spread of the fastest, {fastest} at {timed[fastest]}, and ranks higher in the rules"
            )
        if self.rental is not None:
            because = f"{self.rental.describe()}"
        if self.overrides.backend:
            because = f"the caller forced backend {self.overrides.backend!r} and " + because
        natives = [c for c in self.ranked if not c.padded]
        padded = [c for c in self.ranked if c.padded]
        if self.carried_from is not None:  # the candidates after the choice were not judged
            return f"running {self.chosen.backend}, {how}, because {because}"
        if self.overrides.pad != "auto" and self.problem.pad_target is not None:
            because += f"; the caller set pad={self.overrides.pad!r}"
        elif self.rental is not None or kept:  # the rental, or the warm-up, says why this candidate runs
            pass
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

    @property
    def first_ranked(self) -> Candidate | None:
        """The candidate the ranking puts first (by prediction or by the table), before a captured call's
        first_calls.ran_first put what has run the call ahead of it (``ranked[0]`` where nothing moved)."""
        if self.ran_at is None:
            return self.ranked[0] if self.ranked else None
        first = rules.rank(self.verdicts, self.problem, self.target, self.predictions)
        return first[0] if first else None

    def rank_of(self, candidate: Candidate) -> int | None:
        return self.ranked.index(candidate) + 1 if candidate in self.ranked else None

    def report(self, *, show_all: bool = False) -> str:
        """The report :func:`attnselect.explain` prints: the supported candidates by rank, then the others, one line
        per reason with the candidates it refuses (``show_all``: one row per candidate, every reason in full)."""
        if not isinstance(show_all, bool):
            raise InvalidInputError(f"show_all: got {show_all!r}, expected True or False")
        # a supported candidate can be left out of ranked (measure drops one that failed while it was timed): last
        unranked = len(self.ranked) + 1
        by_rank = sorted((v for v in self.verdicts if v.supported), key=lambda v: self.rank_of(v.candidate) or unranked)
        refused = [v for v in self.verdicts if not v.supported]
        predicted = self.predictions is not None
        found, source = calibration.for_target(self.target) if predicted else (None, "")
        # nothing priced: no column for it
        priced = found is not None and any(found[k] for k in ("first_call_ms", "new_size_ms", "replayed_host_us"))
        costs = found if priced else None
        columns_named = ("predicted us (host, GPU)",) * predicted + ("first call to pay",) * (costs is not None)
        rows = [("backend", "padded to", "supported", "rank", *columns_named, "reasons")]
        for verdict in by_rank + (refused if show_all else []):
            c = verdict.candidate
            rank = self.rank_of(c)
            time = (self.predictions or {}).get(c)
            cells = (c.backend, str(c.pad_to) if c.padded else "-", "yes" if verdict.supported else "no",
                     str(rank) if rank else "-")  # fmt: skip
            if predicted:
                shown = f"{time.total_us:.1f} ({time.host_us:.1f}, {time.gpu_us:.1f})" if time else "-"
                cells += (shown if verdict.supported else "",)
            if costs is not None:  # in this process, now (attnselect.choose.first_calls)
                due = first_calls.owed(c, costs, self.problem) if verdict.supported else None
                cells += (f"{first_calls.duration(due[0])} ({'its shape' if due[1] else 'compile'})" if due else "-",)
            reasons = "; ".join(verdict.reasons)
            if time is not None and time.basis.endswith("(nearest calibrated dims)"):
                reasons = f"predicted from {time.basis}"
            rows.append((*cells, reasons))
        columns = len(rows[0]) - 1
        widths = [max(len(r[i]) for r in rows) for i in range(columns)]
        lines = [f"problem: {self.problem.describe()}", f"target:  {self.target.describe()}"]
        if self.timings is None and predicted:  # measured: the why says so
            lines.append(
                f"ranked:  by predicted time in a stack of layers, the longer of host and GPU and "
                f"{UNHIDDEN:.0%} of the shorter (calibration {self.calibration})"
            )
            note = self._host_note(found, source)
            if note:
                lines.append(f"origin:  {note}")
            new_packing = {c: p.new_packing_host_us for c, p in self.predictions.items()
                           if p is not None and p.new_packing_host_us is not None}  # fmt: skip
            if new_packing:  # attnselect.choose.predict.curve
                lines.append(
                    f"host:    a packed call's is the mean over {PACKING_SHARED_BY} calls sharing a packing; the "
                    "first's, on a new packing: " + ", ".join(f"{c} {us:.1f} us" for c, us in new_packing.items())
                )
            replays = {c: p.before_replay_us for c, p in self.predictions.items()
                       if p is not None and p.before_replay_us is not None}  # fmt: skip
            if replays:  # attnselect.choose.predict.curve, attnselect.choose.first_calls.replay_start_ms
                where = ("a packing's, in its mean over the calls sharing it" if self.problem.layout == "thd"
                         else "a shape's, priced per shape")  # fmt: skip
                lines.append(
                    f"replay:  the host time above is the forward's replayed; the calls before the replay ({where}) "
                    "go through the interface, a call: " + ", ".join(f"{c} {us:.1f} us" for c, us in replays.items())
                )
            if self.problem.layout == "thd" and not self.problem.tokens and self.problem.batch > 1:
                lines.append(  # attnselect.choose.predict.work
                    "work:    every sequence taken as long as the longest, the most it can be: q's rows (tokens=, "
                    "--tokens) estimate it"
                )
        elif self.timings is None and self.calibration:
            lines.append(f"ranked:  by the rules table ({self.calibration})")
        lines.append("")
        for r in rows:
            lines.append(("  ".join(cell.ljust(w) for cell, w in zip(r[:columns], widths)) + "  " + r[-1]).rstrip())
        if refused and not show_all:
            groups: dict[str, list[str]] = {}
            for v in refused:
                names = groups.setdefault(_reason_group(v.reasons[0]), [])
                names += [] if v.candidate.backend in names else [v.candidate.backend]
            lines += [
                "",
                f"not supported: {len(refused)} candidates (explain(..., show_all=True) or --all lists each):",
            ]
            lines += [f"  {reason}: {', '.join(names)}" for reason, names in groups.items()]
        lines += ["", f"chosen:  {self.chosen}", f"why:     {self.why}"]
        return "\n".join(lines)

    def _host_note(self, found: dict | None, source: str) -> str | None:
        """:func:`calibration.host_note` of the calibration that ranked this decision, where ``found`` (read from
        ``source`` now) is still that one: a decision kept across a new calibration says nothing of the new one's."""
        if found is None or source != self.calibration:
            return None
        return calibration.host_note(found, source, self.target)

    def to_dict(self) -> dict:
        """The decision as JSON values (``explain --json``): what the report prints, its predicted times, measured
        times and first calls to pay in fields of their own."""
        costs = calibration.for_target(self.target)[0] if self.predictions is not None else None

        def candidate(v: Verdict) -> dict:
            c, entry = v.candidate, {**v.candidate.to_dict(), "supported": v.supported, "reasons": list(v.reasons),
                                     "rank": self.rank_of(v.candidate)}  # fmt: skip
            predicted = (self.predictions or {}).get(c)
            if predicted is not None and v.supported:
                entry["predicted_us"] = {
                    "total": predicted.total_us, "host": predicted.host_us, "gpu": predicted.gpu_us,
                    "alone": predicted.alone_us, "hidden": predicted.hidden_us,
                    "new_packing_host": predicted.new_packing_host_us,
                    "before_replay_host": predicted.before_replay_us,
                    "basis": predicted.basis,
                }  # fmt: skip
            timed = (self.timings or {}).get(c)
            if timed is not None:
                entry["measured_ms"] = {"median": timed.median_ms, "p20": timed.low_ms, "p80": timed.high_ms}
            due = first_calls.owed(c, costs, self.problem) if costs is not None and v.supported else None
            if due is not None:  # in this process, now (attnselect.choose.first_calls)
                entry["first_call_to_pay_ms"] = {"ms": due[0], "for": "its shape" if due[1] else "its configuration"}
            return entry

        ranked_by = "measured" if self.timings else "predicted time" if self.predictions is not None else "rules table"
        origin = self._host_note(*calibration.for_target(self.target)) if ranked_by == "predicted time" else None
        return {
            "problem": self.problem.to_dict(),
            "target": self.target.to_dict(),
            "policy": self.policy,
            "chosen": self.chosen.to_dict(),
            "why": self.why,
            "ranked_by": ranked_by,
            "calibration": self.calibration,  # its source, or why none holds
            "calibration_host": origin,  # explain's origin: line
            "rental": self.rental.describe() if self.rental is not None else None,
            "candidates": [candidate(v) for v in self.verdicts],
        }


def _reason_group(reason: str) -> str:
    """A refusal's first reason as a group heading: missing packages together, a reason over 120 characters cut
    (tests/choose/test_candidates.py keeps every reason shorter)."""
    if reason.startswith("package ") and reason.endswith(" is not installed"):
        return "package not installed"
    return reason if len(reason) <= 120 else reason[:117] + "..."


def no_candidate_message(problem: AttentionProblem, target: Target, verdicts: tuple, overrides: Overrides) -> str:
    """The error when no candidate serves: every candidate (the forced backend's alone) with its reasons."""
    forced = [f"backend={overrides.backend!r}"] * bool(overrides.backend) + [f"pad={overrides.pad!r}"] * (
        overrides.pad != "auto"
    )
    head = (
        f"No attention candidate can serve {problem.describe()} on {target.describe()}"
        + (f" with {', '.join(forced)}" if forced else "")
        + ". Every candidate and why not:"
    )
    lines = [head]
    for v in verdicts:
        if overrides.backend and v.candidate.backend != overrides.backend:
            continue
        lines.append(f"  {v.candidate}: " + "; ".join(v.reasons))
    return "\n".join(lines)

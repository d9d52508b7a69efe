"""The search: baseline, one change at a time with confirmation, the context step, the result.

The first trial calibrates: in one engine it runs the mode's minimum workload, then a workload
sized from it, warm, and the run's workload is sized from that (autotune/sizing.py); every later
trial runs that same spec, and the calibration trial is not one of the baseline runs the noise is
measured on. Every later trial is the best flags so far
plus exactly one change. A change whose first run beats the incumbent by more than the noise
threshold runs again, and is kept only when the second run agrees and the two together do not
cost another figure more than allowed. Ordered values are walked outwards and a walk ends at its
turning point (the first step that does not win).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from ..engine.text import Text, text_fields
from .eta import CONTEXT_FLAG, TimeLeft, candidate_trials, context_tiers, context_trials
from .flagset import Change, apply_change, same_flags
from .journal import Journal
from .modes import Mode
from .noise import Figures, Judgement, Spreads
from .plan import Candidate, Plan, Skipped
from .result import build_result
from .search_records import Incumbent, Kept, SearchSettings
from .sizing import Sizing, size_workload
from .trial_record import TrialRequest, TrialResult

# the directions of an ordered walk, as words in sentences
WALKS = {"up": Text("up"), "down": Text("down")}


class SearchFailed(RuntimeError):
    """The run cannot go on (the starting flags do not run); the message (a Text) says why."""


class Search:
    """One run of the search over a plan; the journal runs (or replays) and records the trials."""

    def __init__(
        self,
        plan: Plan,
        base_flags: list[str],
        settings: SearchSettings,
        journal: Journal,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.plan = plan
        self.base_flags = list(base_flags)
        self.settings = settings
        self.journal = journal
        self.objective = settings.objective
        self.rule = settings.rule
        self.mode: Mode = settings.mode
        self.results: dict[int, TrialResult] = {}
        self.kept: list[Kept] = []
        self.skipped: list[Skipped] = list(plan.skipped)
        # the starting value of each planned flag was measured too: a later run need not try it
        self.tried: list[str] = list(plan.starting)
        self.tries: dict[str, list[Text]] = defaultdict(list)  # flag -> "value (trial n: why)"
        self._turned: set[tuple[str, str]] = set()
        self._raised: set[str] = set()
        self._next = 0  # the index of the next planned candidate
        self.time_left = TimeLeft(clock)
        self.spreads = Spreads(0.0, {})
        self.incumbent: Incumbent | None = None
        self.context: dict[str, Any] = {}
        self.minimum = self.mode.workload_for(self.objective.clients, self.objective.agent)
        self.sizing: Sizing | None = None  # set by the calibration trial
        self.calibration_trial: int | None = None

    # ---- the phases -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Run every phase after the hardware one; returns the result (JSON-ready)."""
        self._calibrate()
        baseline = self._baseline()
        self._candidates()
        self._context()
        self.journal.progress("result", 0.0)
        return build_result(self, baseline)

    def _trial(self, request: TrialRequest) -> tuple[int, TrialResult]:
        n, result = self.journal.run_trial(request)
        self.results[n] = result
        return n, result

    def _request(
        self,
        flags: list[str],
        change: Change | None,
        role: str,
        context_tokens: int | None = None,
    ) -> TrialRequest:
        """A trial of `flags` with the run's sized workload."""
        assert self.sizing is not None, "the calibration trial comes first"
        return TrialRequest(tuple(flags), change, role, context_tokens, self.sizing.spec)

    def _calibrate(self) -> None:
        """The first trial: the mode's minimum workload on the starting flags, then the first
        estimate for the target, warm, in the same engine; the run's workload is sized from the
        warm stage. The minimum absorbs a cold start (compile caches)."""
        runs = self.mode.baseline_runs
        self._progress("baseline", 1 + runs + self._candidates_left() + self._context_estimate())
        self.journal.event(
            "phase",
            Text(
                "calibration: the mode's minimum workload on {origin}, then the first estimate of "
                "a {target_s:.0f} s workload, warm, to size the workload of every trial",
                origin=self.settings.base_origin,
                target_s=self.mode.target_s,
            ),
        )
        request = TrialRequest(
            tuple(self.base_flags),
            None,
            "calibration",
            workload=self.minimum,
            target_s=self.mode.target_s,
        )
        n, result = self._trial(request)
        self.calibration_trial = n
        sizing = self.sizing = size_workload(self.minimum, result, self.mode.target_s)
        verdict = "calibration" if result.ok else "failed"
        reason = (
            sizing.reason
            if result.ok
            else Text("{reason}: {error}", reason=sizing.reason, error=result.error or "")
        )
        self.journal.set_verdict(n, verdict, reason)
        self.journal.event("workload", sizing.reason, **sizing.to_json())

    def _baseline(self) -> Figures:
        runs = self.mode.baseline_runs
        self._progress("baseline", runs + self._candidates_left() + self._context_estimate())
        self.journal.event(
            "phase",
            Text("baseline: {runs} runs of {origin}", runs=runs, origin=self.settings.base_origin),
        )
        ok: list[tuple[int, TrialResult]] = []
        last_error: Text | None = None
        for i in range(runs):
            n, result = self._trial(self._request(self.base_flags, None, "baseline"))
            if result.ok:
                ok.append((n, result))
                self.journal.set_verdict(
                    n,
                    "base",
                    Text("baseline run {i}: {figures}", i=i + 1, figures=_figures(result)),
                )
            else:
                last_error = result.why_failed
                self.journal.set_verdict(n, "failed", last_error)
            left = runs - i - 1 + self._candidates_left() + self._context_estimate()
            self._progress("baseline", left)
        if not ok:
            raise SearchFailed(Text("the starting flags do not run ({error})", error=last_error))
        trials = [r for _n, r in ok]
        self.spreads = Spreads.measure(self.objective, trials)
        self.incumbent = Incumbent(list(self.base_flags), trials, [n for n, _r in ok])
        figures = self.incumbent.figures
        threshold = self.rule.threshold(self.spreads)
        if len(ok) < 2:
            self.journal.event(
                "noise",
                Text(
                    "only one baseline run succeeded: the run-to-run spread is unknown and the "
                    "{floor:.0%} floor applies",
                    floor=self.rule.min_gain,
                ),
            )
        score = self.objective.score(figures)
        self.journal.event(
            "noise",
            Text(
                "baseline {figure}: {score}; run-to-run spread {spread:.1%}; a change must gain "
                "more than {threshold:.1%}",
                figure=self.objective.label,
                score=_num(score),
                spread=self.spreads.objective,
                threshold=threshold,
            ),
            spreads=self.spreads.to_json(),
            threshold=threshold,
        )
        return figures

    def _candidates(self) -> None:
        self.journal.event(
            "phase",
            Text("one change at a time: {n} planned", n=len(self.plan.candidates)),
        )
        for i, candidate in enumerate(self.plan.candidates):
            self._next = i
            self._progress("candidates", self._candidates_left() + self._context_estimate())
            self._try(candidate)
        self._next = len(self.plan.candidates)

    def _try(self, candidate: Candidate) -> None:
        assert self.incumbent is not None
        change = candidate.change
        why_not = self._why_not(candidate)
        flags = apply_change(self.incumbent.flags, change)
        in_force = why_not is None and same_flags(flags, self.incumbent.flags)
        if in_force:
            why_not = Text("already in force")
        if why_not is not None:
            self.skipped.append(Skipped(change.flag, change.value, why_not))
            if not in_force:
                self.tried.append(change.key)
            self.journal.event("skip", Text("{change}: {why}", change=change.label, why=why_not))
            return
        self.tried.append(change.key)
        n1, first = self._trial(self._request(flags, change, "candidate"))
        if not first.ok:
            self._reject(candidate, n1, "failed", first.why_failed)
            return
        # one run's other figures are too noisy to refuse on: the two runs' mean is judged
        judged = self.rule.judge(
            self.objective, Figures.of(first), self.incumbent.figures, self.spreads, sides=False
        )
        if not judged.beats:
            self._reject(candidate, n1, "rejected", judged.reason)
            return
        self.journal.set_verdict(
            n1, "pending", Text("{reason}; running it again to confirm", reason=judged.reason)
        )
        # the best flags again and the confirmation, then the candidates after this one
        self._next += 1
        self._progress("candidates", 2 + self._candidates_left() + self._context_estimate())
        fresh = self._incumbent_again(n1)
        n2, second = self._trial(self._request(flags, change, "confirm"))
        verdict = self._confirm(first, second, fresh)
        if verdict.beats:
            reason = Text(
                "{reason} (trials {first} and {second})", reason=verdict.reason, first=n1, second=n2
            )
            self.journal.set_verdict(n1, "kept", reason)
            self.journal.set_verdict(
                n2, "confirm", Text("agrees: {figures}", figures=_figures(second))
            )
            self.incumbent = Incumbent(flags, [first, second], [n1, n2])
            self.kept.append(Kept(change, reason, (n1, n2), verdict.gain))
            self.tries[change.flag].append(
                Text(
                    "{value} kept (trials {first}, {second})",
                    value=_value(change),
                    first=n1,
                    second=n2,
                )
            )
            if candidate.walk == "up":
                self._raised.add(change.flag)
            self.journal.event(
                "kept", Text("kept {change}: {reason}", change=change.label, reason=reason)
            )
        else:
            self.journal.set_verdict(
                n2, "confirm", Text("does not agree: {reason}", reason=verdict.reason)
            )
            self._reject(candidate, n1, "rejected", Text("trial {n} did not confirm it", n=n2))

    def _incumbent_again(self, candidate_n: int) -> TrialResult | None:
        """The best flags once more, right before the confirmation run.

        The two runs stand side by side in time, so a machine that got quieter (or busier) since
        the incumbent was measured cannot make a change look better than it is.
        """
        assert self.incumbent is not None
        n, again = self._trial(self._request(self.incumbent.flags, None, "baseline"))
        if not again.ok:
            self.journal.set_verdict(n, "failed", again.why_failed)
            return None
        self.incumbent.runs.append(again)
        self.incumbent.trials.append(n)
        self.journal.set_verdict(
            n,
            "base",
            Text(
                "the best flags again, beside trial {n}: {figures}",
                n=candidate_n,
                figures=_figures(again),
            ),
        )
        return again

    def _confirm(
        self, first: TrialResult, second: TrialResult, fresh: TrialResult | None
    ) -> Judgement:
        """The second run must beat the incumbent's fresh run (or, without one, its median);
        the two runs together must beat the incumbent's median and spare the other figures."""
        assert self.incumbent is not None
        if not second.ok:
            return Judgement(
                False, 0.0, Text("the second run failed ({failure})", failure=second.why_failed)
            )
        reference = Figures.of(fresh) if fresh is not None else self.incumbent.figures
        again = self.rule.judge(
            self.objective, Figures.of(second), reference, self.spreads, sides=False
        )
        if again.gain <= self.rule.threshold(self.spreads):
            return Judgement(
                False,
                again.gain,
                Text("beside the best flags run again: {reason}", reason=again.reason),
            )
        both = Figures.mean([first, second])
        return self.rule.judge(self.objective, both, self.incumbent.figures, self.spreads)

    def _reject(self, candidate: Candidate, n: int, verdict: str, reason: Text) -> None:
        self.journal.set_verdict(n, verdict, reason)
        self.tries[candidate.change.flag].append(
            Text(
                "{value} (trial {n}: {reason})", value=_value(candidate.change), n=n, reason=reason
            )
        )
        if candidate.walk is not None:
            self._turned.add((candidate.change.flag, candidate.walk))

    def _why_not(self, candidate: Candidate) -> Text | None:
        """Why a planned step of a walk is no longer worth a trial, else None."""
        if candidate.walk is None or not self.mode.stop_at_turn:
            return None
        flag = candidate.change.flag
        if (flag, candidate.walk) in self._turned:
            return Text(
                "past the turning point: the step before it ({direction}) did not win",
                direction=WALKS[candidate.walk],
            )
        if candidate.walk == "down" and flag in self._raised:
            return Text("raising it won, so lowering it is not tried")
        return None

    # ---- context ----------------------------------------------------------------------------

    def _context_tiers(self, usable: int) -> list[int]:
        flags = self.incumbent.flags if self.incumbent else self.base_flags
        return context_tiers(usable, flags, self.settings.model_max_context, self.mode)

    def _context_estimate(self) -> int:
        if self.settings.pick_up and not self.kept:
            return 0
        if self.incumbent is None:
            return context_trials(self.base_flags, self.settings.model_max_context, self.mode)
        usable = self.incumbent.usable_context
        return 1 + len(self._context_tiers(usable)) if usable else 1

    def _context(self) -> None:
        assert self.incumbent is not None
        if self.settings.pick_up and not self.kept:
            self.journal.event(
                "phase",
                Text("context: skipped, no new change was kept (the last result's stands)"),
            )
            return
        usable = self.incumbent.usable_context
        if not usable:
            self.journal.event(
                "phase", Text("context: skipped, the engine did not say its context")
            )
            return
        tiers = self._context_tiers(usable)
        self.journal.event(
            "phase",
            Text(
                "context: prove {tokens} tokens, then try {tiers}",
                tokens=usable,
                tiers=", ".join(map(str, tiers)),
            )
            if tiers
            else Text("context: prove {tokens} tokens", tokens=usable),
        )
        self._progress("context", 1 + len(tiers))
        n, proof_run = self._trial(
            self._request(self.incumbent.flags, None, "context", context_tokens=usable)
        )
        proof = proof_run.context_proof
        if not proof_run.ok or proof is None:
            self.journal.set_verdict(n, "failed", proof_run.why_failed)
            self.context = {"usable_tokens": usable, "proven": False, "trials": [n]}
            return
        self.journal.set_verdict(
            n,
            "base",
            Text("{proof}; {figures}", proof=proof.message, figures=_figures(proof_run)),
        )
        self.context = {
            "usable_tokens": usable,
            "proven": proof.ok,
            "proof": proof.to_json(),
            "trials": [n],
            "tiers": [],
        }
        if not proof.ok:
            self.journal.event(
                "context",
                Text("the advertised context of {tokens} is not served", tokens=usable),
            )
            return
        reference = self.incumbent.figures
        for i, tier in enumerate(tiers):
            self._progress("context", len(tiers) - i)
            if not self._context_tier(tier, reference):
                break

    def _context_tier(self, tier: int, reference: Figures) -> bool:
        """Try one tier; True when it is kept (and the next may be tried)."""
        assert self.incumbent is not None
        change = Change(CONTEXT_FLAG, str(tier))
        flags = apply_change(self.incumbent.flags, change)
        n, run = self._trial(self._request(flags, change, "context", context_tokens=tier))
        self.context["trials"].append(n)
        proof = run.context_proof
        reason: Text | str
        if not run.ok or proof is None:
            reason = run.why_failed
            self.journal.set_verdict(n, "failed", reason)
        elif (run.usable_context or 0) < tier:
            reason = Text(
                "the engine advertises {tokens} tokens with these flags", tokens=run.usable_context
            )
            self.journal.set_verdict(n, "rejected", reason)
        elif not proof.ok:
            reason = proof.message
            self.journal.set_verdict(n, "rejected", reason)
        else:
            holds = self.rule.holds(self.objective, Figures.of(run), reference, self.spreads)
            reason = Text("{proof}; {holds}", proof=proof.message, holds=holds.reason)
            if holds.beats:
                self.journal.set_verdict(n, "kept", reason)
                self.incumbent = Incumbent(flags, [run], [n])
                self.kept.append(Kept(change, reason, (n,), holds.gain))
                self.context["usable_tokens"] = tier
                self.context["tiers"].append({"tokens": tier, "kept": True, "trial": n})
                self.journal.event(
                    "kept", Text("context {tokens}: {reason}", tokens=tier, reason=reason)
                )
                return True
            self.journal.set_verdict(n, "rejected", reason)
        self.context["tiers"].append(
            {"tokens": tier, "kept": False, "trial": n, **text_fields("why", reason)}
        )
        self.journal.event(
            "context", Text("context {tokens}: not kept ({reason})", tokens=tier, reason=reason)
        )
        return False

    # ---- progress and result ----------------------------------------------------------------

    def _candidates_left(self) -> int:
        """Trials the planned candidates not yet begun are expected to take."""
        return candidate_trials(
            self.plan.candidates[self._next :],
            self.mode.stop_at_turn,
            frozenset(self._turned),
            frozenset(self._raised),
        )

    def _progress(self, phase: str, trials_left: int) -> None:
        eta_s = self.time_left.update(trials_left, self._trial_s(), settle=self.journal.replaying)
        self.journal.progress(phase, eta_s)

    def _trial_s(self) -> float | None:
        """What a trial takes: the median of the sized ones, or, before any ran, the calibration
        trial with its workload replaced by the sized one's expected time."""
        n = self.calibration_trial
        sized = [r.duration_s for k, r in self.results.items() if k != n]
        if sized:
            return statistics.median(sized)
        calibration = self.results.get(n) if n is not None else None
        if calibration is None or self.sizing is None:
            return None
        expected_s = self.sizing.expected_s or calibration.workload_s or 0.0
        return calibration.duration_s - (calibration.workload_s or 0.0) + expected_s


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _figures(result: TrialResult) -> Text:
    prefill, decode = _num(result.prefill_tok_s), _num(result.decode_tok_s)
    if result.agent_tok_s is not None:
        return Text(
            "prefill {prefill}, decode {decode}, agent session {agent} tok/s",
            prefill=prefill,
            decode=decode,
            agent=_num(result.agent_tok_s),
        )
    if result.aggregate_tok_s is None:
        return Text("prefill {prefill}, decode {decode} tok/s", prefill=prefill, decode=decode)
    return Text(
        "prefill {prefill}, decode {decode}, aggregate {aggregate} tok/s",
        prefill=prefill,
        decode=decode,
        aggregate=_num(result.aggregate_tok_s),
    )


def _value(change: Change) -> Text | str:
    if change.value is None:
        return Text("the default")
    if isinstance(change.value, bool):
        return Text("on") if change.value else Text("off")
    return change.value

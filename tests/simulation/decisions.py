"""Decisions 23-29 as invariants, checked at every committed write and every callback execution
(docs/design/invariants.md, rows 10-16). Shared by the whole-server simulator (:mod:`.world`) and the property
test of orchestration faults (tests/conformance/test_orchestration_faults.py).

The engine's state alone cannot prove these: a skip recorded as ``target_not_found`` looks the same whether the
pass reached the step or a guard ended it first. So each check compares the state with what the world knows and
the engine does not: what the endpoint answered to each attempt, and what the code that answered says
(:class:`Answer`); which operator resolutions the API accepted, and the reasons given; which build ran each
callback. A check that could only restate the core's own bookkeeping would pass a core that is wrong in the
same way.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ryusen import OmittedResult
from ryusen._internal.wire import Phase
from ryusen_server.core.model import (
    Attempt,
    AttemptStatus,
    Blocker,
    BlockerType,
    CompensationStatus,
    Outcome,
    Recovery,
    RunPhase,
    RunState,
    StepState,
    StepStatus,
)
from ryusen_server.core.view import summary

Key = tuple[str, str, str, int]
"""(run, step, phase, generation): one attempt."""


@dataclass(frozen=True, slots=True)
class Answer:
    """What the endpoint answered to one attempt, and what the code that answered says about its step."""

    type: str
    """The attempt outcome's type: succeeded, failed, target_not_found, conflict, replay_failed, ..."""
    reason: str | None = None
    """A ``target_not_found``'s reason: no_compensator, retired or not_reached."""
    omitted: bool = False
    """A success whose result was over a limit (the SDK's, or the server's)."""
    nested: bool = False
    """A failure because the callback opened a step inside it (the SDK's ``concurrent_step`` error)."""
    build: str | None = None
    """The build whose code answered."""
    declares_no_compensator: bool = False
    """The code that answered calls this step and gives it no compensator."""
    retires: bool = False
    """The code that answered retires this step id (``retired_steps``)."""


@dataclass
class Ground:
    """What the world knows that the engine does not (filled in by the simulator or the test harness)."""

    answers: dict[Key, list[Answer]] = field(default_factory=lambda: defaultdict(list))
    resolved: set[tuple[str, str, str, int, str]] = field(default_factory=set)
    """Operator resolutions the API accepted: (run, step, phase, generation, action)."""
    reasons: set[str] = field(default_factory=set)
    """The reasons operators gave with them."""

    def operator_skipped(self, run: str, step_id: str) -> bool:
        return any(k[0] == run and k[1] == step_id and k[2] == "compensation" and k[4] == "skip" for k in self.resolved)

    def nested(self, key: Key) -> str | None:
        """The build whose callback of this attempt opened a step inside it, if one did."""
        return next((a.build or "?" for a in self.answers.get(key, ()) if a.nested), None)

    def omitted(self, key: Key) -> bool:
        """The attempt's callback ran and returned more than the limit."""
        return any(a.type == "succeeded" and a.omitted for a in self.answers.get(key, ()))


def omitted_success(step: StepState, attempt: Attempt) -> bool:
    """A forward attempt the engine recorded as succeeded with a result over the limit (decisions 25)."""
    return (
        attempt.phase is Phase.FORWARD
        and attempt.status is AttemptStatus.SUCCEEDED
        and (attempt.detail or "").startswith("result_too_large")
    )


class Decisions:
    """The checks of decisions 23-29. ``fail`` reports a violation (the text names the decision)."""

    def __init__(self, ground: Ground, fail: Callable[[str], None], *, unstable_after: int) -> None:
        self.ground = ground
        self.fail = fail
        self.unstable_after = unstable_after
        self.unknown: dict[Key, tuple[datetime | None, str | None]] = {}
        """Attempts seen Unknown: when and why (decisions 28)."""
        self.resolutions: dict[Key, tuple[str, str | None, str | None]] = {}
        self.step_count: dict[str, int] = {}
        self.unstable_candidate: dict[str, str | None] = {}
        """Per run, the id an ``unstable_step_id`` blocker waited to see announced again, as of the last write."""
        self.skips_checked: set[tuple[str, str]] = set()

    # ---- every committed write ----------------------------------------------------------------------

    def committed(self, state: RunState) -> None:
        run = state.id
        stopped = state.stop_intent is not None
        for step in state.steps:
            for a in step.attempts:
                key = (run, step.id, a.phase.value, a.generation)
                self._deadline_held(state, step, a)
                self._history_kept(key, a)
                self._success_not_failed(key, step, a)
            self._nested_not_told(state, step, stopped)
            self._oversized_held(state, step)
            if step.compensation_status is CompensationStatus.SKIPPED:
                self._skip_justified(state, step)
        self._summary_counts_operator_skips(state)
        self._completed_before_deadline(state)
        self._unstable_ids_blocked(state)
        if state.error is not None and state.error.type == "too_many_steps":
            self.fail(f"{run}: failed too_many_steps: an unstable step id burned the step budget (decisions 29)")

    def _deadline_held(self, state: RunState, step: StepState, a: Attempt) -> None:
        """Decisions 26: no forward task is authorized at or after the deadline."""
        deadline = state.deadline_at
        if deadline is None or a.phase is not Phase.FORWARD or a.authorized_at is None:
            return
        if a.authorized_at >= deadline:
            self.fail(
                f"{state.id}: forward {step.id} #{a.generation} authorized at {a.authorized_at.isoformat()},"
                f" at or after the deadline {deadline.isoformat()} (decisions 26)"
            )

    def _completed_before_deadline(self, state: RunState) -> None:
        deadline = state.deadline_at
        if deadline is None:
            return
        d = state.discovery
        if d is not None and d.authorized_at is not None and d.authorized_at >= deadline:
            self.fail(f"{state.id}: discovery #{d.seq} authorized at or after the deadline (decisions 26)")
        if state.outcome is Outcome.COMPLETED and state.finished_at is not None and state.finished_at >= deadline:
            self.fail(
                f"{state.id}: completed by a write at {state.finished_at.isoformat()}, at or after its deadline"
                f" {deadline.isoformat()} (decisions 26)"
            )

    def _history_kept(self, key: Key, a: Attempt) -> None:
        """Decisions 28: an attempt that was Unknown keeps when and why; a resolution keeps who, how and why."""
        run, step_id, phase, generation = key
        what = f"{run}: {step_id} {phase} #{generation}"
        if a.status is AttemptStatus.UNKNOWN and (a.unknown_at is None or not a.unknown_reason):
            self.fail(f"{what} is Unknown with no record of when or why (decisions 28)")
        if a.unknown_at is not None and key not in self.unknown:
            self.unknown[key] = (a.unknown_at, a.unknown_reason)
        elif key in self.unknown and (a.unknown_at, a.unknown_reason) != self.unknown[key]:
            self.fail(
                f"{what} was Unknown at {self.unknown[key][0]}; now {a.status.value} it records"
                f" {a.unknown_at} ({a.unknown_reason!r}) (decisions 28)"
            )
        if a.resolution is not None:
            recorded = (a.resolution.action, a.resolution.reason, a.resolution.by)
            first = self.resolutions.setdefault(key, recorded)
            if first != recorded:
                self.fail(f"{what}: its resolution {first} changed to {recorded} (decisions 28)")
            elif recorded[1] not in self.ground.reasons:
                self.fail(f"{what}: resolution {recorded} keeps no reason an operator gave (decisions 28)")
        elif key in self.resolutions:
            self.fail(f"{what}: lost its resolution {self.resolutions[key]} (decisions 28)")

    def _success_not_failed(self, key: Key, step: StepState, a: Attempt) -> None:
        """Decisions 25 (and 16): a callback that ran and succeeded, even with a result over the limit, is never
        recorded failed, unless an operator said so, or it was Unknown and retried under on_unknown="retry"."""
        if a.status is not AttemptStatus.FAILED or a.resolution is not None:
            return
        if a.error is not None and a.error.type == "unknown_outcome":
            return
        if step.external and a.waiting_since is not None:
            return  # decision 32: its callback only handed out the token; the completion (or its timeout) decides
        if step.external and a.error is not None and a.error.type == "Rejected":
            return  # a completion that failed it, before its callback's own answer was recorded
        answers = self.ground.answers.get(key, ())
        if any(ans.type == "succeeded" for ans in answers):
            big = any(ans.omitted for ans in answers)
            self.fail(
                f"{key[0]}: {key[1]} {key[2]} #{key[3]} ran and succeeded"
                f"{' (its result over the limit)' if big else ''}, recorded failed"
                f" ({a.error.type if a.error else None}) (decisions 25)"
            )

    def _nested_not_told(self, state: RunState, step: StepState, stopped: bool) -> None:
        """Decisions 23: a callback that opened a step is not a failure the function is told of, nor a failed
        compensation; only a stop (no forward retry follows it) ends it as the step's failure."""
        for phase, failed in (
            (Phase.FORWARD, step.status is StepStatus.FAILED and not stopped),
            (Phase.COMPENSATION, step.compensation_status is CompensationStatus.FAILED),
        ):
            if not failed:
                continue
            ran = [a for a in step.attempts if a.phase is phase and a.status is not AttemptStatus.FENCED]
            if not ran or ran[-1].resolution is not None:
                continue
            if self.ground.nested((state.id, step.id, phase.value, ran[-1].generation)) is not None:
                what = (
                    "the step is failed with no stop: the function is told"
                    if phase is Phase.FORWARD
                    else "it is recorded as a failed compensation"
                )
                self.fail(
                    f"{state.id}: {step.id} {phase.value} #{ran[-1].generation} opened a step inside the callback,"
                    f" and {what} (decisions 23)"
                )

    def _oversized_held(self, state: RunState, step: StepState) -> None:
        """Decisions 25: a step whose callback returned too much waits for an operator while the run goes on, and
        joins the unwind if the run stops."""
        held = [
            a
            for a in step.attempts
            if a.phase is Phase.FORWARD
            and a.resolution is None
            and a.status is AttemptStatus.SUCCEEDED  # the engine heard it (an answer on its way is not yet)
            and self.ground.omitted((state.id, step.id, "forward", a.generation))
        ]
        if not held:
            return
        if state.outcome is None and step.status is not StepStatus.PENDING:
            self.fail(
                f"{state.id}: {step.id} #{held[-1].generation} returned too much and is {step.status.value}, not"
                " held for an operator (decisions 25)"
            )
        unwinding = state.phase in (RunPhase.COMPENSATING, RunPhase.FINISHED) and state.outcome not in (
            None,
            Outcome.COMPLETED,
        )
        if unwinding and step.id not in {e.step_id for e in state.unwind}:
            self.fail(
                f"{state.id}: {step.id} ran and returned too much, and the stopped run's unwind leaves it out"
                " (decisions 25)"
            )

    def _skip_justified(self, state: RunState, step: StepState) -> None:
        """Decisions 24: a compensation is skipped only where the pass reached the step and current code gives
        it no compensator, where the release retires the step, or where an operator skipped it."""
        run = state.id
        if (run, step.id) in self.skips_checked:
            return
        self.skips_checked.add((run, step.id))
        undo = [a for a in step.attempts if a.phase is Phase.COMPENSATION]
        if not undo:
            self.fail(f"{run}: {step.id}'s compensation was skipped without asking the endpoint")
            return
        last = undo[-1]
        if last.resolution is not None and last.resolution.action == "skip":
            if not self.ground.operator_skipped(run, step.id):
                self.fail(f"{run}: {step.id}'s compensation records an operator's skip no operator made (decisions 24)")
            return
        answers = self.ground.answers.get((run, step.id, "compensation", last.generation), [])
        justified = any(
            ans.type == "target_not_found"
            and (
                (ans.reason == "no_compensator" and ans.declares_no_compensator)
                or (ans.reason == "retired" and ans.retires)
            )
            for ans in answers
        )
        if not justified:
            said = ", ".join(f"{ans.type}/{ans.reason}" for ans in answers) or "nothing"
            self.fail(
                f"{run}: {step.id}'s compensation was skipped, but its pass #{last.generation} did not reach it with"
                f" no compensator, the release does not retire it, and no operator skipped it (the endpoint said"
                f" {said}) (decisions 24)"
            )

    def _summary_counts_operator_skips(self, state: RunState) -> None:
        """Decisions 24: an operator's skip is counted apart: never "fully compensated"."""
        if state.phase is not RunPhase.FINISHED or state.recovery is not Recovery.COMPENSATED:
            return
        skipped = [
            e.step_id
            for e in state.unwind
            if e.status is CompensationStatus.SKIPPED
            and self.ground.operator_skipped(state.id, e.step_id)  # an operator asked (a request may not land)
            and _skipped_by_operator(state, e.step_id)  # and that is how the skip is recorded (checked above)
        ]
        text = summary(state)
        if skipped and ("fully compensated" in text or f"{len(skipped)} skipped by the operator" not in text):
            self.fail(f"{state.id}: the operator skipped {skipped}, and the summary says {text!r} (decisions 24)")
        if not skipped and "skipped by the operator" in text:
            self.fail(f"{state.id}: no operator skipped a compensation, and the summary says {text!r} (decisions 24)")

    def _unstable_ids_blocked(self, state: RunState) -> None:
        """Decisions 29: a write that adds a step at a location where the run's last ``unstable_after`` steps were
        each announced and abandoned carries an ``unstable_step_id`` blocker, unless the step is the id the
        blocker's candidate named in the write before (two passes after a wake announced it: stable)."""
        before = self.step_count.get(state.id, 0)
        self.step_count[state.id] = len(state.steps)
        confirmed = self.unstable_candidate.get(state.id)
        blocker = next((b for b in state.blockers if b.type is BlockerType.UNSTABLE_STEP_ID), None)
        self.unstable_candidate[state.id] = blocker.candidate_step_id if blocker is not None else None
        n = self.unstable_after
        for i in range(max(before, n), len(state.steps)):
            new = state.steps[i]
            recent = state.steps[i - n : i]
            stable = new.id == confirmed
            if (
                all(_abandoned(s, new.location) for s in recent)
                and blocker is None
                and not stable
                and state.outcome is None
            ):
                self.fail(
                    f"{state.id}: step {new.id} added at {new.location} after {n} ids announced there and abandoned"
                    f" ({', '.join(s.id for s in recent)}), with no unstable_step_id blocker (decisions 29)"
                )

    # ---- every callback execution ---------------------------------------------------------------------

    def effect(
        self, state: RunState, step: StepState, phase: str, generation: int, build: str | None, got: Any
    ) -> None:
        """A callback (``phase`` forward) or compensator starts, served by ``build``; ``got`` is what the
        compensator received."""
        run = state.id
        earlier = [a for a in step.attempts if a.phase.value == phase and a.generation < generation]
        for i, a in enumerate(earlier):
            if unheard(a) or any(later.resolution is not None for later in earlier[i:]):
                continue  # the engine never heard what it did, or an operator moved the step on since
            key = (run, step.id, phase, a.generation)
            if self.ground.nested(key) == build:
                self.fail(
                    f"{run}: {step.id} {phase} #{generation} ran with build {build}, whose #{a.generation} opened a"
                    " step inside the callback, and no operator resolved it (decisions 23)"
                )
            if phase == "forward" and self.ground.omitted(key):
                self.fail(
                    f"{run}: {step.id} #{generation} ran again after #{a.generation} returned too much, without an"
                    " operator's consent (decisions 25)"
                )
        if phase != "compensation":
            return
        omitted = step.omitted_result
        if omitted is not None:
            if not isinstance(got, OmittedResult) or (got.size, got.sha256) != (omitted.size, omitted.sha256):
                self.fail(
                    f"{run}: {step.id}'s compensator received {got!r:.80}, not an OmittedResult of {omitted.size}"
                    " bytes (decisions 25)"
                )
        elif _json(got) != _json(step.result):
            self.fail(f"{run}: {step.id}'s compensator received {got!r:.80}, not the recorded result (C3)")


def held_step_id(blocker: Blocker) -> str | None:
    """The step whose attempt (``blocker.phase``, ``generation``) a blocker holds. For a step opened inside a
    callback (decisions 23) the blocker's ``step_id`` names the step the callback opened, which the run never
    recorded, and ``first`` the step whose callback ran: an operator resolves that one."""
    if blocker.type is BlockerType.CONCURRENT_STEP and blocker.generation is not None and blocker.first is not None:
        return blocker.first.step_id
    return blocker.step_id


def _skipped_by_operator(state: RunState, step_id: str) -> bool:
    step = state.step(step_id)
    undo = [a for a in step.attempts if a.phase is Phase.COMPENSATION] if step is not None else []
    return bool(undo) and undo[-1].resolution is not None and undo[-1].resolution.action == "skip"


def unheard(attempt: Attempt) -> bool:
    """The engine never heard the attempt's answer: it is Unknown, or was and ``on_unknown="retry"`` retried it
    (consent to run the callback again, whatever it did)."""
    retried = attempt.error is not None and attempt.error.type == "unknown_outcome"
    return attempt.status is AttemptStatus.UNKNOWN or retried


def _abandoned(step: StepState, location: str | None) -> bool:
    """Announced at ``location`` and never run: each attempt fenced because its pass met another id."""
    return (
        step.status is StepStatus.PENDING
        and step.location == location
        and bool(step.attempts)
        and all(
            a.status is AttemptStatus.FENCED and (a.detail or "").startswith("target_not_found") for a in step.attempts
        )
    )


def _json(value: object) -> str:
    return json.dumps(value, sort_keys=True, default=str)

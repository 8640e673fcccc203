"""The invariants the simulator checks, as RFD 1 states them (docs/design/invariants.md explains each).

:meth:`Checker.committed` runs on every write that commits, with the state written; :meth:`Checker.effect`
runs as a callback or compensator starts executing, with the request that carries it and the durable state
at that moment; :meth:`Checker.at_end` compares fault-free runs with what their code says they must end with.
Decisions 23-29 are checked at the same moments by :class:`.decisions.Decisions`.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from ryusen._internal.wire import Phase, TaskRequest
from ryusen_server.core.model import (
    Attempt,
    AttemptStatus,
    CompensationStatus,
    Outcome,
    Recovery,
    RunPhase,
    RunState,
    StepStatus,
)

from . import workload
from .decisions import Decisions, omitted_success

if TYPE_CHECKING:
    from .world import Simulation

SETTLED = frozenset(
    {AttemptStatus.SUCCEEDED, AttemptStatus.FAILED, AttemptStatus.RETRY_AUTHORIZED, AttemptStatus.FENCED}
)
LIVE = frozenset({AttemptStatus.QUEUED, AttemptStatus.AUTHORIZED, AttemptStatus.UNKNOWN})
PHASE_ORDER = {RunPhase.RUNNING: 0, RunPhase.SETTLING: 1, RunPhase.COMPENSATING: 2, RunPhase.FINISHED: 3}
FINISHED_RECOVERY = frozenset({Recovery.NOT_REQUIRED, Recovery.COMPENSATED, Recovery.PARTIALLY_COMPENSATED})
UNWOUND = frozenset({CompensationStatus.COMPENSATED, CompensationStatus.SKIPPED})

Key = tuple[str, str, str, int]
"""(run, step, phase, generation): one attempt."""


class Checker:
    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.authorized: set[Key] = set()
        """Every attempt some committed write authorized."""
        self.at_stop: dict[str, set[tuple[str, int]]] = {}
        """Per stopped run: the forward attempts authorized before the write that recorded its stop intent."""
        self.accepted: dict[tuple[str, str], tuple[int, str]] = {}
        """(run, step) -> the generation whose success was accepted, and its result as JSON."""
        self.settled: dict[Key, tuple[str, str | None]] = {}
        self.outcome: dict[str, Outcome] = {}
        self.phase: dict[str, RunPhase] = {}
        self.version: dict[str, int] = {}
        self.ran: set[Key] = set()
        self.finished: set[str] = set()
        self.decisions = Decisions(sim.ground, self.fail, unstable_after=sim.settings.unstable_after)
        self.blockers_seen: Counter[str] = Counter()
        """Runs that showed each blocker type (figures)."""
        self._blocked: set[tuple[str, str]] = set()

    def fail(self, text: str) -> None:
        self.sim.violation(text)

    # ---- every committed write ----------------------------------------------------------------------

    def committed(self, state: RunState) -> None:
        run = state.id
        if state.version <= self.version.get(run, -1):
            self.fail(f"{run}: version {state.version} written after {self.version[run]}")
        self.version[run] = state.version
        stopped_before = run in self.at_stop
        if state.stop_intent is not None and not stopped_before:
            self.at_stop[run] = {(k[1], k[3]) for k in self.authorized if k[0] == run and k[2] == "forward"}
        for step in state.steps:
            live = {Phase.FORWARD: 0, Phase.COMPENSATION: 0}
            for a in step.attempts:
                key = (run, step.id, a.phase.value, a.generation)
                if a.status in LIVE:
                    live[a.phase] += 1
                if a.authorized_at is not None and key not in self.authorized:
                    self.authorized.add(key)
                    if a.phase is Phase.FORWARD and stopped_before:
                        self.fail(f"{run}: forward {step.id} #{a.generation} authorized after the stop intent")
                if a.status in SETTLED:
                    seen = (a.status.value, a.settled_at.isoformat() if a.settled_at else None)
                    if self.settled.setdefault(key, seen) != seen:
                        self.fail(
                            f"{run}: {step.id} {a.phase.value} #{a.generation} settled twice: {self.settled[key]} then {seen}"
                        )
                elif key in self.settled:
                    self.fail(
                        f"{run}: {step.id} {a.phase.value} #{a.generation} was {self.settled[key]}, now {a.status.value}"
                    )
            if any(n > 1 for n in live.values()):
                self.fail(f"{run}: {step.id} has more than one live attempt in a phase")
            # a success is accepted (the step completed), unless the callback returned too much: then the step
            # waits for an operator (decisions 25), who may move past that success (retry or fail it)
            succeeded = [
                a
                for a in step.attempts
                if a.phase is Phase.FORWARD
                and a.status is AttemptStatus.SUCCEEDED
                and not _moved_past(a)
                and not (omitted_success(step, a) and step.status is StepStatus.PENDING)
            ]
            if succeeded and step.status is not StepStatus.COMPLETED:
                self.fail(f"{run}: {step.id} #{succeeded[0].generation} succeeded but the step is {step.status.value}")
            if step.status is StepStatus.COMPLETED:
                winner = next(
                    (
                        a.generation
                        for a in reversed(step.attempts)
                        if a.phase is Phase.FORWARD and a.status is AttemptStatus.SUCCEEDED
                    ),
                    None,
                )
                if winner is None:
                    self.fail(f"{run}: {step.id} is completed with no succeeded forward attempt")
                else:
                    self.accepted.setdefault((run, step.id), (winner, _json(step.result)))
        for (r, step_id), (generation, result) in self.accepted.items():
            if r != run:
                continue
            kept = state.step(step_id)
            attempt = kept.attempt(Phase.FORWARD, generation) if kept is not None else None
            if (
                kept is None
                or attempt is None
                or attempt.status is not AttemptStatus.SUCCEEDED
                or _json(kept.result) != result
            ):
                self.fail(f"{run}: the accepted result of {step_id} #{generation} was lost or changed")
        self._axes(state)
        for blocker in state.blockers:
            if (run, blocker.type.value) not in self._blocked:
                self._blocked.add((run, blocker.type.value))
                self.blockers_seen[f"runs blocked by {blocker.type.value}"] += 1
        if state.outcome is Outcome.TIMED_OUT and (run, "timed out") not in self._blocked:
            self._blocked.add((run, "timed out"))
            self.blockers_seen["runs timed out"] += 1
        if state.phase is RunPhase.FINISHED and state.outcome is not Outcome.COMPLETED and run not in self.finished:
            self.finished.add(run)
            self._unwound(state)
        self.decisions.committed(state)

    def _unwound(self, state: RunState) -> None:
        """A run that failed, was cancelled or timed out has finished: every accepted success was compensated
        (its compensator ran, or an operator declared it compensated), or skipped where its code has no
        compensator (the endpoint said so), or, past a compensation that failed for good, not reached."""
        run = state.id
        accepted = [
            s
            for s in state.steps
            if any(
                a.phase is Phase.FORWARD and a.status is AttemptStatus.SUCCEEDED and not _moved_past(a)
                for a in s.attempts
            )
        ]
        if accepted and state.recovery is Recovery.NOT_REQUIRED:
            self.fail(f"{run}: finished {state.recovery.value} with accepted successes {[s.id for s in accepted]}")
        unwind = {e.step_id for e in state.unwind}
        for step in accepted:
            status = step.compensation_status
            undo = [a for a in step.attempts if a.phase is Phase.COMPENSATION]
            if step.id not in unwind:
                self.fail(f"{run}: the accepted success of {step.id} is not in the unwind")
            elif status is CompensationStatus.SKIPPED:
                if not any(a.status in (AttemptStatus.SUCCEEDED, AttemptStatus.FENCED) for a in undo):
                    self.fail(f"{run}: {step.id}'s compensation was skipped without asking the endpoint")
            elif status is CompensationStatus.COMPENSATED:
                ran = self.sim.executions[(run, step.id, "compensation")] > 0
                declared = any(
                    (run, step.id, "compensation", a.generation, "succeed") in self.sim.resolved for a in undo
                )
                if not ran and not declared:
                    self.fail(f"{run}: {step.id} is compensated, but its compensator never ran and no operator said so")
            elif status in (CompensationStatus.FAILED, CompensationStatus.NOT_REACHED):
                if state.recovery is not Recovery.PARTIALLY_COMPENSATED:
                    self.fail(f"{run}: {step.id}'s compensation is {status.value}, recovery {state.recovery}")
            else:
                self.fail(f"{run}: finished while {step.id}'s compensation is {status.value}")

    def _axes(self, state: RunState) -> None:
        run, phase, outcome, recovery = state.id, state.phase, state.outcome, state.recovery
        problem = None
        if (phase is RunPhase.RUNNING) != (outcome is None):
            problem = "running exactly while there is no outcome"
        elif outcome is Outcome.COMPLETED and (phase is not RunPhase.FINISHED or recovery is not None):
            problem = "a completed run is finished, with no recovery"
        elif phase is RunPhase.COMPENSATING and recovery is not Recovery.COMPENSATING:
            problem = "compensating with recovery compensating"
        elif phase is RunPhase.SETTLING and recovery not in (None, Recovery.PENDING):
            problem = "settling with recovery pending"
        elif phase is RunPhase.FINISHED and outcome is not Outcome.COMPLETED and recovery not in FINISHED_RECOVERY:
            problem = "a finished run that did not complete has its recovery's result"
        elif phase is RunPhase.FINISHED and state.finished_at is None:
            problem = "a finished run has its finish time"
        if problem is not None:
            self.fail(f"{run}: status axes: expected {problem}; got {phase}/{outcome}/{recovery}")
        if outcome is not None and self.outcome.setdefault(run, outcome) is not outcome:
            self.fail(f"{run}: outcome {self.outcome[run]} changed to {outcome}")
        before = self.phase.get(run, RunPhase.RUNNING)
        if PHASE_ORDER[phase] < PHASE_ORDER[before]:
            self.fail(f"{run}: phase went back from {before} to {phase}")
        self.phase[run] = phase

    # ---- every callback execution ---------------------------------------------------------------------

    def effect(self, request: TaskRequest, step_id: str, phase: str, build: str | None, received: object) -> None:
        run = request.run_id
        operation = request.operation
        if operation is None or request.step_id != step_id or operation.phase.value != phase:
            self.fail(f"{run}: {step_id} {phase} ran in a request for {request.step_id} {operation}")
            return
        gen = operation.generation
        key = (run, step_id, phase, gen)
        if key not in self.authorized:
            self.fail(f"{run}: {step_id} {phase} #{gen} ran without a durable authorization")
        if key in self.ran:
            self.fail(f"{run}: {step_id} {phase} #{gen} ran twice")
        self.ran.add(key)
        state = self.sim.store.peek(run)
        assert state is not None
        step = state.step(step_id)
        if step is None:
            self.fail(f"{run}: {step_id} ran but the run has no such step")
            return
        if phase == "forward" and run in self.at_stop and (step_id, gen) not in self.at_stop[run]:
            self.fail(f"{run}: forward {step_id} #{gen} ran, authorized after the stop intent")
        declared = step.retry if phase == "forward" else step.compensate_retry
        consented = declared is not None and declared.on_unknown == "retry"
        for a in step.attempts:
            if a.phase.value != phase or a.generation >= gen:
                continue
            if a.status is AttemptStatus.SUCCEEDED and not _moved_past(a):
                self.fail(f"{run}: {step_id} {phase} ran again (#{gen}) after #{a.generation}'s success was accepted")
            elif a.status in (AttemptStatus.QUEUED, AttemptStatus.AUTHORIZED):
                self.fail(f"{run}: {step_id} {phase} #{gen} ran while #{a.generation} is {a.status.value}")
            elif not consented and (
                a.status is AttemptStatus.UNKNOWN
                or (a.status is AttemptStatus.FAILED and a.error is not None and a.error.type == "unknown_outcome")
            ):
                # an Unknown is run again only with consent: the step's declared on_unknown="retry", or an
                # operator's retry (retry_authorized); a failure a late result or an operator reported is not Unknown
                self.fail(f"{run}: {step_id} {phase} #{gen} ran past Unknown #{a.generation} without consent")
        self.decisions.effect(state, step, phase, gen, build, received)
        if phase == "forward":
            return
        if not any(a.phase is Phase.FORWARD and a.status is AttemptStatus.SUCCEEDED for a in step.attempts):
            self.fail(f"{run}: {step_id} is compensated but its success was never accepted")
        for other in state.steps:
            forward = [a for a in other.attempts if a.phase is Phase.FORWARD]
            if forward and forward[-1].status in (AttemptStatus.AUTHORIZED, AttemptStatus.UNKNOWN):
                self.fail(
                    f"{run}: {step_id} compensated while {other.id} #{forward[-1].generation} is {forward[-1].status.value}"
                )
            if other.id == step_id:
                continue
            busy = [
                a
                for a in other.attempts
                if a.phase is Phase.COMPENSATION and a.status in (AttemptStatus.AUTHORIZED, AttemptStatus.UNKNOWN)
            ]
            if busy:
                self.fail(
                    f"{run}: {step_id} compensated while {other.id}'s compensation #{busy[0].generation} is {busy[0].status.value}"
                )
            later = (
                other.status is StepStatus.COMPLETED
                and other.has_compensation
                and other.completed_seq is not None
                and step.completed_seq is not None
                and other.completed_seq > step.completed_seq
            )
            if later and other.compensation_status not in UNWOUND:
                self.fail(
                    f"{run}: {step_id} compensated before {other.id}, which completed later"
                    f" (its compensation is {other.compensation_status.value})"
                )

    # ---- at the end -----------------------------------------------------------------------------------

    def at_end(self) -> None:
        sim = self.sim
        if not sim.profile.is_clean:
            return
        if sim.queue.dead:
            self.fail(f"a fault-free seed put {len(sim.queue.dead)} messages on the dead-letter queue")
        for run in sim.run_ids:
            state = sim.store.peek(run)
            assert state is not None
            want = workload.expected(sim.spec, sim.inputs[run])
            got = (state.outcome.value if state.outcome else None, state.recovery.value if state.recovery else None)
            if got != (want.outcome, want.recovery) or (
                want.outcome == "completed" and _json(state.output) != _json(want.output)
            ):
                self.fail(
                    f"{run}: ended {got} with {state.output!r}; its code says {want.outcome}/{want.recovery} with {want.output!r}"
                )
            for step_id, times in want.forward.items():
                if sim.executions[(run, step_id, "forward")] != times:
                    self.fail(f"{run}: {step_id} ran {sim.executions[(run, step_id, 'forward')]} times, not {times}")
            for step_id, times in want.undo_runs.items():
                if sim.executions[(run, step_id, "compensation")] != times:
                    self.fail(
                        f"{run}: {step_id}'s compensator ran {sim.executions[(run, step_id, 'compensation')]} times, not {times}"
                    )
            order = [e.step_id for e in state.unwind if e.status is CompensationStatus.COMPENSATED]
            if order != want.undone:
                self.fail(f"{run}: compensated {order}, not {want.undone}")

    def describe(self, run: str) -> str:
        state = self.sim.store.peek(run)
        if state is None:
            return f"{run}: not written"
        steps = ", ".join(
            f"{s.id}:{s.status.value}/{s.compensation_status.value}["
            + " ".join(f"{a.phase.value[0]}{a.generation}={a.status.value}" for a in s.attempts)
            + "]"
            for s in state.steps
        )
        discovery = (
            f"discovery #{state.discovery.seq} {state.discovery.status.value}" if state.discovery else "no discovery"
        )
        blockers = [b.type.value for b in state.blockers]
        return (
            f"{run} v{state.version} {state.phase.value}/{state.outcome}/{state.recovery} blockers={blockers}"
            f" due={state.work_due_at()} {discovery}; {steps}"
        )


def _moved_past(attempt: Attempt) -> bool:
    """A success an operator moved past: a result over the limit they retried (consent to run the callback
    again) or declared failed (decisions 25). Its step's outcome is what came after."""
    return attempt.resolution is not None and attempt.resolution.action in ("retry", "fail")


def _json(value: object) -> str:
    import json

    return json.dumps(value, sort_keys=True, default=str)

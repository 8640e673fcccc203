"""The engine core: ``decide(state, event, now=..., settings=...) -> Decision``.

Theory of operation. The core holds no I/O, clock, uuid or randomness: time
arrives as ``now`` and everything it creates gets an id derived from the run
(operation ids hash run, step and phase). Given a run's state and one event it
returns the next state and the commands an adapter carries out after it has
written that state with one conditional write (the version the decision was
made from must still be current). A lost race re-reads and decides again, so
every decision must be safe to make twice on the same message.

Forward path: a run starts ``running`` with discovery #1 queued. A delivered
task is *authorized* (the fence: refused once a stop intent exists) and then
invoked. Discovery reports the first step without a recorded outcome, which
gets forward attempt generation 1. A failed attempt consumes the step's retry
policy; exhaustion records one terminal failure and queues discovery, whose
replay raises ``StepFailed`` in the function. Completion records the output.

Recovery: an uncaught failure, a cancellation or the deadline decides the
outcome once. Effect attempts authorized before it must settle (``settling``);
then completed steps are compensated one at a time in reverse completion
order (``compensating``) until the unwind is ``compensated`` or stops
``partially_compensated``. An empty unwind is ``not_required``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from ryusen._internal.wire import (
    MAX_RUN_TIMEOUT_S,
    MAX_WAIT_S,
    AttemptResponse,
    CallbackFailed,
    CallbackSucceeded,
    ConcurrentStepConflict,
    ConflictFound,
    DefinitionConflict,
    DiscoveryResponse,
    DuplicateStepConflict,
    ErrorInfo,
    FunctionCompleted,
    FunctionFailed,
    FunctionNotFound,
    InvalidStep,
    NewStepBeforeTarget,
    OmittedValue,
    OutputNotJson,
    OutputTooLarge,
    Phase,
    ReplayFailed,
    RetryPolicyWire,
    StepPlan,
    StepReached,
    StepsReached,
    TargetNotFound,
    TaskKind,
    nested_step_build,
    nested_step_conflict,
    value_size,
)
from ryusen._internal.wire import Occurrence as WireOccurrence

from .events import (
    AttemptReported,
    CancelTimer,
    Command,
    CompletionReported,
    Decision,
    DiscoveryReported,
    EngineSettings,
    EnqueueTask,
    Event,
    HeartbeatReported,
    InvocationFailed,
    InvocationFailure,
    InvokeTask,
    RedeliverLater,
    Rejection,
    ReleaseRef,
    Resolve,
    ScheduleTimer,
    StartMayBeLost,
    StartRun,
    StopRequested,
    SweepRequested,
    TaskDelivered,
    WakeRequested,
)
from .model import (
    DEFINITION_BLOCKERS,
    LIVE_ATTEMPT,
    Attempt,
    AttemptStatus,
    Blocker,
    BlockerType,
    CompensationStatus,
    DiscoveryTask,
    Occurrence,
    Outcome,
    Recovery,
    Resolution,
    RunPhase,
    RunState,
    StaleSubmission,
    StepState,
    StepStatus,
    StopIntent,
    StopKind,
    TaskRef,
    TimerKind,
    TimerRef,
    UnwindEntry,
    carrier_of,
    sent_as_an_event_by_a_result_function,
)


def _conflict_key(blocker: Blocker) -> tuple[object, ...]:
    """Which blockers are "the same conflict seen again" (D7)."""
    calls = (blocker.first, blocker.second)
    return (blocker.type, blocker.step_id, *(c.step_id if c else None for c in calls))


@dataclass(frozen=True, slots=True, kw_only=True)
class CompensationTargetNotReached:
    """A compensation pass ended without reaching its target step (decisions 24): a blocker the core finds
    from a ``target_not_found`` report, not one the SDK reports as a conflict."""

    step_id: str
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ResultTooLarge:
    """A forward callback ran and returned more than the limit (decisions 25): a blocker, never a failure."""

    step_id: str
    omitted: OmittedValue


@dataclass(frozen=True, slots=True, kw_only=True)
class UnstableStepId:
    """Passes keep announcing new step ids at one location and abandoning them (decisions 29)."""

    step_ids: tuple[str, ...]
    location: str | None


HeldConflict = ConcurrentStepConflict | ResultTooLarge
"""Why an attempt whose callback ran holds its step: the engine cannot take its outcome and must not run it
again by itself (decisions 23, 25)."""


def _lease_end(attempt: Attempt) -> datetime:
    assert attempt.lease_expires_at is not None
    return attempt.lease_expires_at


def lease_expired(step: StepState, attempt: Attempt) -> str:
    """The detail of an attempt whose lease expired with no outcome: its timeout, or the heartbeat it missed,
    and the grace after it."""
    if attempt.authorized_at is None or attempt.respond_by is None or attempt.lease_expires_at is None:
        return "the attempt's lease expired with no result"
    timeout = (attempt.respond_by - attempt.authorized_at).total_seconds()
    beat_s = step.heartbeat_for(attempt.phase)
    if attempt.lease_expires_at < attempt.respond_by and beat_s is not None:
        since = attempt.heartbeat_at or attempt.authorized_at
        grace = (attempt.lease_expires_at - since).total_seconds() - beat_s
        return (
            f"no heartbeat within the step's heartbeat of {beat_s:g}s (+{grace:g}s grace)"
            f" {'since the last one' if attempt.heartbeat_at else 'since it started'}: its lease expired"
        )
    grace = (attempt.lease_expires_at - attempt.respond_by).total_seconds()
    return f"no result within the attempt's timeout of {timeout:g}s (+{grace:g}s grace): its lease expired"


class IllegalEventError(Exception):
    """An event that cannot apply to this state at all (a programming error, not a race)."""


def operation_id(run_id: str, step_id: str, phase: Phase) -> str:
    """The stable operation id of one (run, step, phase), shared by every generation."""
    digest = hashlib.sha256(f"{run_id}\x00{step_id}\x00{phase.value}".encode()).hexdigest()[:20]
    return f"op_{digest}"


def backoff_delay(policy: RetryPolicyWire, failed_attempts: int, *, seed: str) -> float:
    """Delay before the next attempt after ``failed_attempts`` failures, with equal jitter.

    The jitter is derived from ``seed`` (operation id and generation), so it is
    spread across operations yet reproducible: the core stays pure.
    """
    base = min(policy.max_delay_s, policy.initial_delay_s * policy.backoff ** max(0, failed_attempts - 1))
    fraction = int(hashlib.sha256(seed.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return base / 2 + fraction * base / 2


CHECK_PURITY = False
"""Tests set this: every decision then proves that it left the state it was given unchanged (costly)."""


PRESUMED_STARTED = (
    "authorized after the last save of a ryusen dev that was killed (its started log names it): it may have run"
)
"""The detail of an attempt recorded again after such a restart, Unknown at once (``presumed_started``)."""


COMPLETION_REFUSED = "completion_refused"
"""How a decision's note begins when it kept a completion as stale instead of taking it (decision 32)."""


def _live_forward(step: StepState) -> bool:
    """The step's forward attempt has not settled (queued, in flight, waiting or Unknown)."""
    attempts = step.attempts
    current = attempts[-1] if attempts else None
    if current is not None and current.phase is not Phase.FORWARD:
        current = step.current(Phase.FORWARD)
    return current is not None and current.status in LIVE_ATTEMPT


def _without_repeats(commands: list[Any]) -> list[Any]:
    """``commands`` in order, each equal one once (two repairs may ask for the same send)."""
    kept: list[Any] = []
    for command in commands:
        if command not in kept:
            kept.append(command)
    return kept


def decide(state: RunState | None, event: Event, *, now: datetime, settings: EngineSettings) -> Decision:
    """Decide one event. ``state`` is never mutated; the state decided is sealed (it will not change again)."""
    if not CHECK_PURITY or state is None:
        decision = _decide(state, event, now=now, settings=settings)
    else:
        before = state.model_dump_json()
        decision = _decide(state, event, now=now, settings=settings)
        if state.model_dump_json() != before:
            raise AssertionError(f"deciding {type(event).__name__} changed the state it was given")
    decision.state.seal()
    return decision


def _decide(state: RunState | None, event: Event, *, now: datetime, settings: EngineSettings) -> Decision:
    if isinstance(event, StartRun):
        if state is not None:
            return Decision(state=state, note="run already exists")
        return _Transition(None, now, settings).start(event)
    if state is None:
        raise IllegalEventError(f"{type(event).__name__} needs an existing run")
    t = _Transition(state.working_copy(), now, settings)
    if not (isinstance(event, StopRequested) and event.kind == "timeout"):
        t.enforce_deadline()  # decisions 26: before anything this event would authorize or complete
    if isinstance(event, TaskDelivered):
        t.delivery_id = event.delivery_id
        t.task_delivered(event.task, event.release)
    elif isinstance(event, DiscoveryReported):
        t.chain, t.delivery_id, t.claims = event.chain, event.delivery_id, event.claims
        t.discovery_reported(event.seq, event.response)
        t.invoke_own_authorization()
    elif isinstance(event, AttemptReported):
        t.chain, t.delivery_id, t.claims = event.chain, event.delivery_id, event.claims
        t.attempt_reported(event)
        t.invoke_own_authorization()
    elif isinstance(event, InvocationFailed):
        t.invocation_failed(event)
    elif isinstance(event, WakeRequested):
        t.wake(event)
    elif isinstance(event, SweepRequested):
        t.sweep(event)
    elif isinstance(event, StopRequested):
        t.stop(event)
    elif isinstance(event, HeartbeatReported):
        t.heartbeat(event)
    elif isinstance(event, Resolve):
        t.resolve(event)
    elif isinstance(event, StartMayBeLost):
        t.start_may_be_lost(event)
    elif isinstance(event, CompletionReported):
        t.completion_reported(event)
    else:  # pragma: no cover - exhaustive
        raise IllegalEventError(f"unknown event {event!r}")
    return t.decision(original=state)


class _Transition:
    """One decision in progress: a working copy of the state and the commands so far."""

    def __init__(self, state: RunState | None, now: datetime, settings: EngineSettings) -> None:
        self._state = state
        self.now = now
        self.settings = settings
        self.commands: list[Command] = []
        self.changed = False
        self.rejection: Rejection | None = None
        self.note: str | None = None
        self.delivery_id: str | None = None
        self.exact_leases = False
        """Every lease is judged at its end, whoever watches it (a sweep after every message was lost)."""
        self.claims: tuple[str, ...] = ()
        self.chain: ReleaseRef | None = None
        """The next task may be authorized and invoked at once, with this release (the dispatcher has time)."""
        self.next: DiscoveryResponse | None = None
        """The continuation a successful callback's response carried."""
        self.build_id: str | None = None
        """The build whose pass reported what ``discovered`` is deciding (a discovery's, or a continuation's)."""
        self._owned: set[int] = set()
        """The steps this decision copied (or created): only those may be changed."""
        self.stopped_here = False
        """This decision recorded the stop intent for a deadline that had passed (``enforce_deadline``)."""
        self.external_completion = False
        """This decision takes a completion from outside (decision 32): a success completes the step."""
        self._filling = False
        self._refill = False
        self.census_visited = 0
        """Steps the last ``group_census`` looked at (diagnostics: the suite checks it stays bounded)."""
        """``start_siblings`` is running (a wait already over settles its sibling at once, which asks again)."""

    @property
    def s(self) -> RunState:
        assert self._state is not None
        return self._state

    def decision(self, *, original: RunState) -> Decision:
        if self.rejection is not None:  # a refused request changes nothing (a deadline it found is found again)
            return Decision(state=original, rejection=self.rejection, note=self.note)
        if not self.changed:
            return Decision(state=original, commands=tuple(self.commands), rejection=self.rejection, note=self.note)
        self.s.version = original.version + 1
        self.s.updated_at = self.now
        return Decision(state=self.s, commands=tuple(self.commands), changed=True, note=self.note)

    def touch(self) -> None:
        self.changed = True

    # ---- copy on write: the state given to ``decide`` is never changed ------------

    def step(self, step_id: str) -> StepState | None:
        """The step, ready to change: copied from the given state the first time this decision needs it."""
        i = self.s.step_index(step_id)
        return self.own(i) if i is not None else None

    def own(self, i: int) -> StepState:
        step = self.s.steps[i]
        if id(step) not in self._owned:
            step = step.own_copy()  # one step and its attempts, never the whole run
            self.s.replace_step(i, step)
            self._owned.add(id(step))
        return step

    def edit(self, step: StepState) -> StepState:
        """``step``, read while scanning the state, made ready to change."""
        if id(step) in self._owned:
            return step
        edited = self.step(step.id)
        assert edited is not None
        return edited

    def set_unwind_status(self, step_id: str, status: CompensationStatus) -> None:
        i = self.s.unwind_index(step_id)
        if i is not None and (entry := self.s.unwind[i]).status is not status:
            self.s.replace_unwind_entry(i, entry.model_copy(update={"status": status}))

    def reject(self, code: str, message: str) -> None:
        self.rejection = Rejection(code=code, message=message)

    def ignore(self, note: str) -> None:
        self.note = note

    # ---- start ---------------------------------------------------------------

    def start(self, event: StartRun) -> Decision:
        state = RunState(
            id=event.run_id,
            app_id=event.app_id,
            function_id=event.function_id,
            input=event.input,
            created_at=self.now,
            updated_at=self.now,
            idempotency_key=event.idempotency_key,
            deadline_at=event.deadline_at,
            deadline_source=event.deadline_source,
            version=1,
            run_bytes=value_size(event.input),
            secret=event.secret,
        )
        self._state = state
        self.queue_discovery()
        if event.deadline_at is not None:
            self.commands.append(
                ScheduleTimer(timer=TimerRef(run_id=state.id, kind=TimerKind.DEADLINE, at=event.deadline_at))
            )
        return Decision(state=state, commands=tuple(self.commands), changed=True)

    # ---- helpers -------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        """Forward work is no longer authorized: an outcome other than completed is decided."""
        return self.s.outcome is not None

    def queue_discovery(self, delay_s: float = 0.0) -> None:
        s = self.s
        s.discovery_seq += 1
        s.discovery = DiscoveryTask(
            seq=s.discovery_seq,
            queued_at=self.now,
            not_before=self.now + timedelta(seconds=delay_s) if delay_s else None,
        )
        task = TaskRef(run_id=s.id, kind=TaskKind.DISCOVER, seq=s.discovery_seq)
        self.touch()
        if (release := self.take_chain(delay_s)) is not None and not self.stopping:
            return self.authorize_discovery(s.discovery, task, release)
        self.commands.append(EnqueueTask(task=task, delay_s=delay_s))
        return None

    def invoke_own_authorization(self) -> None:
        """A chained report found stale: if that is because its own write committed (the reply was lost and
        another write landed before the retry), the task it authorized is still this dispatcher's to invoke.
        So is one a deferring dispatcher it claims authorized and never sent (see ``claims``)."""
        if self.delivery_id is None or self.chain is None or any(isinstance(c, InvokeTask) for c in self.commands):
            return None
        d = self.s.discovery
        if d is not None and (self.owns(d) or self.claimable(d)):
            if not self.owns(d):
                self.reauthorize(d, self.settings.attempt_timeout_s)
            self.commands.append(InvokeTask(task=TaskRef(run_id=self.s.id, kind=TaskKind.DISCOVER, seq=d.seq)))
            return None
        for i, step in enumerate(self.s.steps):
            for phase in (Phase.FORWARD, Phase.COMPENSATION):
                attempt = step.current(phase)
                if attempt is None or not (self.owns(attempt) or self.claimable(attempt)):
                    continue
                kind = TaskKind.FORWARD if phase is Phase.FORWARD else TaskKind.COMPENSATE
                task = TaskRef(run_id=self.s.id, kind=kind, step_id=step.id, generation=attempt.generation)
                if not self.owns(attempt):
                    step = self.own(i)  # to be re-authorized: this decision's copy
                    attempt = step.current(phase)
                    assert attempt is not None
                    if phase is Phase.FORWARD and self.stopping:
                        # never sent, and a stop intent forbids sending it now: fenced, as a task never sent is
                        self.settle(attempt, AttemptStatus.FENCED, detail="never sent; fenced by the stop intent")
                        step.status = StepStatus.FENCED
                        return self.evaluate_recovery()
                    self.reauthorize(attempt, self.timeout_s(step, phase), step.heartbeat_for(phase))
                self.commands.append(InvokeTask(task=task))
                return None

    def claimable(self, task: DiscoveryTask | Attempt) -> bool:
        """Authorized by a delivery this one claims (a deferring dispatcher that never sent it)."""
        return task.status is AttemptStatus.AUTHORIZED and task.delivery_id in self.claims

    def reauthorize(self, task: DiscoveryTask | Attempt, timeout_s: float, heartbeat_s: float | None = None) -> None:
        """A claimed task, authorized afresh for this delivery: its window starts now. An attempt's lease is what
        ``authorize_attempt`` gave it: at most one heartbeat interval (decision 33), and the grace of the release
        it was authorized with (``acknowledged_lease_grace_s`` for one that acknowledges)."""
        task.delivery_id = self.delivery_id
        task.authorized_at = self.now
        grace = self.settings.lease_grace_s
        if isinstance(task, Attempt):
            task.respond_by = self.now + timedelta(seconds=timeout_s)
            grace = task.lease_grace_s if task.lease_grace_s is not None else grace
        silent_s = timeout_s if heartbeat_s is None else min(timeout_s, heartbeat_s)
        task.lease_expires_at = self.now + timedelta(seconds=silent_s + grace)
        self.touch()

    def owns(self, task: DiscoveryTask | Attempt) -> bool:
        return (
            task.status is AttemptStatus.AUTHORIZED
            and task.delivery_id == self.delivery_id
            and task.lease_expires_at is not None
            and self.now < task.lease_expires_at
        )

    def take_chain(self, delay_s: float) -> ReleaseRef | None:
        """The release to authorize a task with right away (once per decision), if the dispatcher can chain."""
        release, self.chain = (self.chain, None) if delay_s == 0 else (None, self.chain)
        return release

    def authorize_discovery(self, d: DiscoveryTask, task: TaskRef, release: ReleaseRef) -> None:
        d.status = AttemptStatus.AUTHORIZED
        d.authorized_at = self.now
        d.lease_expires_at = self.now + timedelta(seconds=self.settings.attempt_timeout_s + self.settings.lease_grace_s)
        d.release_id, d.build_id = release.release_id, release.build_id
        d.delivery_id = self.delivery_id
        self.touch()
        self.commands.append(InvokeTask(task=task))

    def new_attempt(self, step: StepState, phase: Phase, delay_s: float = 0.0) -> Attempt:
        """The next generation of (step, phase), recorded but not dispatched."""
        previous = step.current(phase)
        attempt = Attempt(
            phase=phase,
            generation=previous.generation + 1 if previous else 1,
            operation_id=operation_id(self.s.id, step.id, phase),
            queued_at=self.now,
            not_before=self.now + timedelta(seconds=delay_s) if delay_s else None,
        )
        step.attempts.append(attempt)
        self.touch()
        return attempt

    def queue_attempt(self, step: StepState, phase: Phase, delay_s: float = 0.0) -> Attempt:
        attempt = self.new_attempt(step, phase, delay_s)
        if step.sleep and phase is Phase.FORWARD and delay_s <= 0 and not self.stopping:
            self.slept(step, attempt)  # a wait already over: nothing to dispatch
            return attempt
        if self.s.presumed_started and self.presumed_unknown(step, attempt):
            return attempt
        kind = TaskKind.FORWARD if phase is Phase.FORWARD else TaskKind.COMPENSATE
        task = TaskRef(run_id=self.s.id, kind=kind, step_id=step.id, generation=attempt.generation)
        release = self.take_chain(delay_s)
        if release is not None and not (phase is Phase.FORWARD and self.stopping):
            # one write accepts what came back and authorizes this attempt; the dispatcher invokes it next
            self.authorize_unless_held(step, attempt, task, release)
        else:
            self.commands.append(EnqueueTask(task=task, delay_s=delay_s))
        return attempt

    def failures(self, step: StepState, phase: Phase) -> int:
        """Failed attempts of (step, phase): what its retry policy counts (a callback that opened a step spends
        no retry: decisions 23)."""
        return sum(
            1 for a in step.attempts if a.phase is phase and a.status is AttemptStatus.FAILED and not a.opened_a_step
        )

    def policy(self, step: StepState, phase: Phase) -> RetryPolicyWire:
        if phase is Phase.FORWARD:
            return step.retry or self.settings.forward_retry
        return step.compensate_retry or self.settings.compensate_retry

    def timeout_s(self, step: StepState, phase: Phase) -> float:
        declared = step.timeout_s if phase is Phase.FORWARD else step.compensate_timeout_s
        return declared or self.settings.attempt_timeout_s

    def settle(
        self, attempt: Attempt, status: AttemptStatus, *, error: ErrorInfo | None = None, detail: str | None = None
    ) -> None:
        attempt.status = status
        attempt.settled_at = self.now
        attempt.error = error.bounded(self.settings.max_value_bytes) if error is not None else None
        attempt.detail = detail
        attempt.retry_at = None
        self.touch()

    def clear_blockers(self, kind: BlockerType, step_id: str | None = None) -> None:
        s = self.s
        if s.blockers:
            kept = [b for b in s.blockers if not (b.type is kind and (step_id is None or b.step_id == step_id))]
            if len(kept) != len(s.blockers):
                s.blockers = kept
                self.touch()
        probing = s.probe_interval_s is not None or s.probe_due_at is not None
        if probing and kind in DEFINITION_BLOCKERS and not s.blocked_by_definition:
            s.probe_interval_s = None
            s.probe_due_at = None

    def clear_definition_blockers(self) -> None:
        for kind in DEFINITION_BLOCKERS:
            self.clear_blockers(kind)

    def send_again(self, queued: Attempt | DiscoveryTask, task: TaskRef, redeliveries: int) -> None:
        """Send a queued task again after the redelivery backoff, and record when it is due (``not_before``):
        its message is on its way until then, so the sweeper does not take it for lost."""
        delay_s = self.redelivery_delay(redeliveries)
        queued.not_before = self.now + timedelta(seconds=delay_s)
        self.commands.append(EnqueueTask(task=task, delay_s=delay_s))

    def redelivery_delay(self, redeliveries: int) -> float:
        doublings = min(max(0, redeliveries - 1), 40)  # past 2**40 the cap applies anyway; no overflow
        return min(self.settings.redelivery_max_s, self.settings.redelivery_initial_s * float(2**doublings))

    def finish(self, recovery: Recovery | None) -> None:
        self.clear_definition_blockers()  # nothing is left for current code to repair
        self.clear_blockers(BlockerType.ENDPOINT_FAILING)
        s = self.s
        deadline_fired = s.stop_intent is not None and s.stop_intent.kind is StopKind.TIMEOUT
        if s.deadline_at is not None and not deadline_fired:
            self.commands.append(CancelTimer(timer=TimerRef(run_id=s.id, kind=TimerKind.DEADLINE, at=s.deadline_at)))
        self.s.phase = RunPhase.FINISHED
        self.s.group = self.s.max_parallel = self.s.group_next = self.s.group_order = None
        self.s.group_live, self.s.group_halted = [], False
        self.s.recovery = recovery
        self.s.finished_at = self.now
        self.s.discovery = None
        self.touch()

    # ---- delivery and authorization -------------------------------------------

    def task_delivered(self, task: TaskRef, release: ReleaseRef | None) -> None:
        if task.kind is TaskKind.DISCOVER:
            self.discovery_delivered(task, release)
        else:
            self.attempt_delivered(task, release)

    def discovery_delivered(self, task: TaskRef, release: ReleaseRef | None) -> None:
        d = self.s.discovery
        if d is None or d.seq != task.seq or self.s.phase is RunPhase.FINISHED:
            self.reemit_stalled()
            return self.ignore(f"discovery #{task.seq} is no longer current")
        if d.status is AttemptStatus.AUTHORIZED:
            assert d.lease_expires_at is not None
            if self.now < d.lease_expires_at and self.delivery_id is not None and d.delivery_id == self.delivery_id:
                self.commands.append(InvokeTask(task=task))  # our own authorization committed (its reply was lost)
                return self.ignore(f"discovery #{d.seq} was authorized by this delivery")
            if self.now < d.lease_expires_at:
                self.commands.append(RedeliverLater(delay_s=(d.lease_expires_at - self.now).total_seconds()))
                return self.ignore(f"discovery #{d.seq} is in flight")
            # a lost discovery is repeatable: dispatch a fresh pass
            return self.queue_discovery()
        if d.not_before is not None and self.now < d.not_before:
            self.commands.append(RedeliverLater(delay_s=(d.not_before - self.now).total_seconds()))
            return self.ignore(f"discovery #{d.seq} is not due yet")
        if self.stopping:  # the fence: no discovery after a stop intent
            self.s.discovery = None
            self.touch()
            return self.ignore("discovery fenced by the stop intent")
        if not self.s.blocked_by_definition and self.beside_live_steps(""):
            # decision 30: the function goes on once its siblings have settled; the group's end queues the pass. (A
            # pass that repairs a definition blocker runs at once: siblings in flight are reported again and stay
            # in their group, so it cannot go past them.)
            self.s.discovery = None
            self.touch()
            return self.ignore("discovery fenced: steps declared together are still in flight")
        if release is None:
            d.redeliveries += 1
            self.touch()
            self.send_again(d, task, d.redeliveries)
            return self.ignore("the function has no synced release")
        self.authorize_discovery(d, task, release)

    def attempt_delivered(self, task: TaskRef, release: ReleaseRef | None) -> None:
        phase = task.phase
        assert phase is not None and task.step_id is not None and task.generation is not None
        if task.lease_timer:
            return self.lease_timer_delivered(task, phase)
        step = self.step(task.step_id)
        attempt = step.attempt(phase, task.generation) if step else None
        if step is not None and attempt is None and self.retry_is_due(step, phase, task):
            return self.retry_unknown(step, phase, task, release)
        if step is None or attempt is None or attempt is not step.current(phase):
            self.reemit_stalled()
            return self.ignore(f"{task.describe()} is not the current generation")
        if attempt.status is AttemptStatus.AUTHORIZED:
            assert attempt.lease_expires_at is not None
            own = self.delivery_id is not None and attempt.delivery_id == self.delivery_id
            if self.now < attempt.lease_expires_at and own:
                # this delivery's authorization committed but a lost race hid it: invoke, as decided then
                self.commands.append(InvokeTask(task=task))
                return self.ignore(f"{task.describe()} was authorized by this delivery")
            lost_at = self.lease_lost_at(attempt.delivery_id, attempt.lease_expires_at)
            if self.now < lost_at:
                self.commands.append(RedeliverLater(delay_s=(lost_at - self.now).total_seconds()))
                return self.ignore(f"{task.describe()} is in flight" + self.watching(attempt.lease_expires_at))
            return self.outcome_lost(step, attempt, lease_expired(step, attempt))
        if attempt.status is not AttemptStatus.QUEUED:
            self.reemit_stalled()
            return self.ignore(f"{task.describe()} is already {attempt.status}")
        if phase is Phase.FORWARD and self.stopping:
            self.settle(attempt, AttemptStatus.FENCED, detail="fenced by the stop intent before start authorization")
            step.status = StepStatus.FENCED
            return self.evaluate_recovery()
        if attempt.not_before is not None and self.now < attempt.not_before:
            self.commands.append(RedeliverLater(delay_s=(attempt.not_before - self.now).total_seconds()))
            return self.ignore(f"{task.describe()} is not due until {attempt.not_before.isoformat()}")
        if step.sleep and phase is Phase.FORWARD:
            return self.slept(step, attempt)
        if release is None:
            attempt.redeliveries += 1
            self.touch()
            self.send_again(attempt, task, attempt.redeliveries)
            return self.ignore("the function has no synced release")
        return self.authorize_unless_held(step, attempt, task, release)

    def slept(self, step: StepState, attempt: Attempt) -> None:
        """A durable wait is over (decision 31): its step completes, with no result, and the function goes on."""
        self.forward_outcome(step, attempt, CallbackSucceeded(result=None))
        attempt.detail = f"waited until {step.wait_until.isoformat()}" if step.wait_until else "waited"

    def authorize_unless_held(self, step: StepState, attempt: Attempt, task: TaskRef, release: ReleaseRef) -> None:
        """Authorize, unless an earlier attempt whose callback ran holds the step (``held_by``): its code would
        repeat the effect. The attempt is then fenced and the run stays blocked."""
        held = self.held_by(step, attempt.phase, release.build_id, before=attempt.generation)
        if held is None:
            return self.authorize(step, attempt, task, release)
        self.settle(attempt, AttemptStatus.FENCED, detail=f"not run: held by generation {held[0].generation}")
        if attempt.phase is Phase.FORWARD:
            step.status = StepStatus.PENDING
        else:
            step.compensation_status = CompensationStatus.PENDING
        return self.definition_conflict(held[1], holds=held[0])

    def held_by(
        self, step: StepState, phase: Phase, build_id: str | None, *, before: int | None = None
    ) -> tuple[Attempt, HeldConflict] | None:
        """An attempt of (step, phase) that ran (before generation ``before``, if given), whose outcome the engine
        could not take, so that it must not run the callback again by itself until an operator resolves it: the
        last one returned a result over the limit (decisions 25), or one whose callback opened a step ran with
        ``build_id``, which would nest again (decisions 23: once per build, also after a rollback). An operator's
        resolution of any of its attempts since moves the step on: consent covers what came before it."""
        ran = self.last_ran(step, phase, before=before)
        if ran is not None and ran.resolution is None and self.result_omitted(step, ran):
            assert step.omitted_result is not None
            return ran, ResultTooLarge(step_id=step.id, omitted=step.omitted_result)
        if build_id is None:
            return None
        for attempt in reversed(step.attempts):
            if attempt.phase is not phase or (before is not None and attempt.generation >= before):
                continue
            if attempt.resolution is not None:
                return None  # an operator resolved this step's attempt since: consent to run it again
            if attempt.opened_a_step and (nested_step_build(attempt.error) or attempt.build_id) == build_id:
                conflict = nested_step_conflict(attempt.error)
                assert conflict is not None
                return attempt, conflict
        return None

    def held_by_oversized_result(self) -> tuple[Attempt, HeldConflict] | None:
        """The attempt whose oversized result holds the run (its blocker names the step), if any."""
        for blocker in self.s.blockers:
            if blocker.type is BlockerType.RESULT_TOO_LARGE and blocker.step_id is not None:
                step = self.s.step(blocker.step_id)
                if step is not None and (held := self.held_by(step, Phase.FORWARD, None)) is not None:
                    return held
        return None

    @staticmethod
    def result_omitted(step: StepState, attempt: Attempt) -> bool:
        """``attempt`` succeeded with a result over the limit, and the step waits for an operator (decisions 25)."""
        return (
            attempt.phase is Phase.FORWARD
            and attempt.status is AttemptStatus.SUCCEEDED
            and step.omitted_result is not None
            and step.status is StepStatus.PENDING
        )

    @staticmethod
    def last_ran(step: StepState, phase: Phase, *, before: int | None = None) -> Attempt | None:
        """The latest attempt of (step, phase) (before generation ``before``) that was not fenced before it ran."""
        for attempt in reversed(step.attempts):
            if (
                attempt.phase is phase
                and (before is None or attempt.generation < before)
                and attempt.status is not AttemptStatus.FENCED
            ):
                return attempt
        return None

    def authorize(self, step: StepState, attempt: Attempt, task: TaskRef, release: ReleaseRef) -> None:
        """The fence: the attempt may run now; the adapter invokes it only after this is written."""
        phase = attempt.phase
        timeout = self.timeout_s(step, phase)
        attempt.status = AttemptStatus.AUTHORIZED
        attempt.authorized_at = self.now
        attempt.respond_by = self.now + timedelta(seconds=timeout)
        grace = self.settings.acknowledged_lease_grace_s if release.acknowledges else self.settings.lease_grace_s
        beat_s = step.heartbeat_for(phase)  # decision 33
        silent_s = timeout if beat_s is None else min(timeout, beat_s)
        attempt.lease_grace_s = grace
        attempt.lease_expires_at = self.now + timedelta(seconds=silent_s + grace)
        attempt.release_id, attempt.build_id = release.release_id, release.build_id
        attempt.delivery_id = self.delivery_id
        if phase is Phase.FORWARD:
            step.status = StepStatus.RUNNING
        else:
            step.compensation_status = CompensationStatus.RUNNING
        self.touch()
        self.commands.append(InvokeTask(task=task))

    def lease_lost_at(self, authorized_by: str | None, lease_expires_at: datetime) -> datetime:
        """When the message in hand takes an attempt in flight (authorized by the delivery ``authorized_by``) as
        lost: at the end of its lease if it is the attempt's carrier (:func:`carrier_of`), or if either names no
        carrier; otherwise ``lease_watch_grace_s`` later. The carrier is deleted when the attempt's answer is
        deferred to the queue (the store would not take it): the deferred answer is recorded first, so a store
        outage shorter than the grace never turns an answered attempt Unknown."""
        theirs = carrier_of(authorized_by)
        if theirs is None or self.exact_leases:
            return lease_expires_at
        if self.delivery_id is not None and carrier_of(self.delivery_id) in (None, theirs):
            return lease_expires_at
        return lease_expires_at + timedelta(seconds=self.settings.lease_watch_grace_s)

    def watching(self, lease_expires_at: datetime) -> str:
        """What an ignore says of an attempt whose lease ended and whose carrier is another message."""
        if self.now < lease_expires_at:
            return ""
        return " (its lease has ended: the message that carries it decides; this one only watches)"

    def lease_timer_delivered(self, task: TaskRef, phase: Phase) -> None:
        """A lease timer (the result function's): it watches its attempt while it is in flight and, with
        ``watches_before``, every attempt of the run a result function sent as an event and authorized before
        then. It comes back when the soonest of their leases ends (later, if heartbeats extended it) and takes
        that attempt as Unknown, as the attempt's own timer would, at its lease; once none is in flight it is
        done and watches nothing else. What it takes as Unknown may authorize a retry or an unwind, which this
        delivery then carries: the other attempts it watched are each given a lease timer of their own."""
        watched = self.watched_by_lease_timer(task, phase)
        if not watched:
            return self.ignore(f"lease timer of {task.describe()}, which is no longer in flight")
        step, attempt = min(watched, key=lambda w: _lease_end(w[1]))
        if self.now < _lease_end(attempt):
            self.commands.append(RedeliverLater(delay_s=(_lease_end(attempt) - self.now).total_seconds()))
            return self.ignore(f"{step.id} {attempt.phase} #{attempt.generation} is in flight")
        for other_step, other in watched:
            if other is attempt:
                continue
            kind = TaskKind.FORWARD if other.phase is Phase.FORWARD else TaskKind.COMPENSATE
            timer = TaskRef(
                run_id=self.s.id, kind=kind, step_id=other_step.id, generation=other.generation, lease_timer=True
            )
            delay_s = max(0.0, (_lease_end(other) - self.now).total_seconds())
            self.commands.append(EnqueueTask(task=timer, delay_s=delay_s))
        writable = self.step(step.id)  # the run's own steps are read-only: this one is changed
        assert writable is not None
        lost = writable.current(attempt.phase)
        assert lost is not None
        return self.outcome_lost(writable, lost, lease_expired(writable, lost))

    def watched_by_lease_timer(self, task: TaskRef, phase: Phase) -> list[tuple[StepState, Attempt]]:
        """The attempts in flight that the lease timer ``task`` watches (``TaskRef.watches_before``), read-only."""
        assert task.step_id is not None and task.generation is not None
        watched: list[tuple[StepState, Attempt]] = []
        for step in self.s.steps:
            for p in (Phase.FORWARD, Phase.COMPENSATION):
                a = step.current(p)
                if a is None or a.status is not AttemptStatus.AUTHORIZED or a.lease_expires_at is None:
                    continue
                if (step.id == task.step_id and p is phase and a.generation == task.generation) or (
                    task.watches_before is not None
                    and a.authorized_at is not None
                    and a.authorized_at <= task.watches_before
                    and sent_as_an_event_by_a_result_function(a.delivery_id)
                ):
                    watched.append((step, a))
        return watched

    def retry_is_due(self, step: StepState, phase: Phase, task: TaskRef) -> bool:
        """``task`` is the retry that ``on_unknown="retry"`` planned for the step's Unknown attempt."""
        current = step.current(phase)
        return (
            current is not None
            and current.status is AttemptStatus.UNKNOWN
            and current.retry_at is not None
            and task.generation == current.generation + 1
        )

    def retry_unknown(self, step: StepState, phase: Phase, task: TaskRef, release: ReleaseRef | None) -> None:
        """Start the planned retry of an Unknown attempt: in one write, the Unknown becomes a failed attempt
        and its next generation is authorized, so a stop can never fence the retry and leave the Unknown
        counted as a failure (decisions 19)."""
        unknown = step.current(phase)
        assert unknown is not None and unknown.retry_at is not None
        if self.now < unknown.retry_at:
            self.commands.append(RedeliverLater(delay_s=(unknown.retry_at - self.now).total_seconds()))
            return self.ignore(f"{task.describe()}: the retry of an Unknown attempt is not due yet")
        if release is None:
            unknown.redeliveries += 1
            self.touch()
            delay_s = self.redelivery_delay(unknown.redeliveries)
            unknown.retry_at = self.now + timedelta(seconds=delay_s)  # when its message is due again
            self.commands.append(EnqueueTask(task=task, delay_s=delay_s))
            return self.ignore("the function has no synced release")
        error = ErrorInfo(type="unknown_outcome", message=unknown.detail or "unknown outcome")
        self.settle(unknown, AttemptStatus.FAILED, error=error, detail="unknown outcome, retried (on_unknown=retry)")
        retry = self.new_attempt(step, phase)
        if self.s.presumed_started and self.presumed_unknown(step, retry):
            return None
        return self.authorize(step, retry, task, release)

    def reemit_stalled(self) -> None:
        """A stale message came back: watch over the run's tasks that have no message of their own.

        * A task in flight that a dispatcher authorized while chaining (in the write that accepted the
          previous outcome) has no message: this one becomes its lease timer. If its lease has expired,
          its outcome is lost (Unknown), as for any attempt; if not, this message is kept until it would.
        * The commands of a decision are sent after its write commits; if a send fails, the message that
          caused the decision is not deleted and comes back here. Any task still queued well past its due
          time gets its message again (a duplicate is harmless: delivery is idempotent); one not yet
          overdue keeps this message around until it would be, so the repair does not depend on the
          queue's visibility timeout.
        """
        s = self.s
        if s.phase is RunPhase.FINISHED:
            return
        grace = timedelta(seconds=self.settings.stalled_task_s)
        queued: list[tuple[TaskRef, datetime]] = []
        leases: list[datetime] = []
        d = s.discovery
        if d is not None and d.status is AttemptStatus.QUEUED:
            queued.append(
                (TaskRef(run_id=s.id, kind=TaskKind.DISCOVER, seq=d.seq), (d.not_before or d.queued_at) + grace)
            )
        elif d is not None and d.status is AttemptStatus.AUTHORIZED and d.lease_expires_at is not None:
            if self.now >= d.lease_expires_at:
                self.queue_discovery()  # a lost discovery is repeatable: a fresh pass
            else:
                leases.append(d.lease_expires_at)
        for step in s.steps:
            for phase, kind in ((Phase.FORWARD, TaskKind.FORWARD), (Phase.COMPENSATION, TaskKind.COMPENSATE)):
                a = step.current(phase)
                if a is not None and a.status is AttemptStatus.QUEUED:
                    task = TaskRef(run_id=s.id, kind=kind, step_id=step.id, generation=a.generation)
                    queued.append((task, (a.not_before or a.queued_at) + grace))
                elif a is not None and a.status is AttemptStatus.UNKNOWN and a.retry_at is not None:
                    task = TaskRef(run_id=s.id, kind=kind, step_id=step.id, generation=a.generation + 1)
                    queued.append((task, a.retry_at + grace))
                elif a is not None and a.status is AttemptStatus.AUTHORIZED and a.lease_expires_at is not None:
                    lost_at = self.lease_lost_at(a.delivery_id, a.lease_expires_at)
                    if self.now >= lost_at:
                        step = self.edit(step)
                        lost = step.current(phase)
                        assert lost is not None
                        self.outcome_lost(step, lost, lease_expired(step, lost))
                    else:
                        leases.append(lost_at)
        overdue = [task for task, at in queued if at <= self.now]
        self.commands.extend(EnqueueTask(task=task) for task in overdue)
        pending = [at for _, at in queued if at > self.now] if not overdue else []
        if pending or leases:
            self.commands.append(RedeliverLater(delay_s=(min(pending + leases) - self.now).total_seconds()))

    def sweep(self, event: SweepRequested) -> None:
        """The run's work is overdue and nothing may be on its way to move it: do what the lost message or
        timer would have. A passed deadline stops the run (its schedule was lost); a due probe wakes it;
        queued tasks past their time are sent again and expired leases settle as for a returning message
        (an Unknown for an attempt, a fresh pass for a discovery)."""
        s = self.s
        if s.phase is RunPhase.FINISHED:
            return self.ignore("the run is finished")
        if s.deadline_at is not None and s.outcome is None and self.now >= s.deadline_at:
            self.stop(StopRequested(kind="timeout"))
        elif s.probe_due_at is not None and self.now >= s.probe_due_at:
            self.wake(WakeRequested(source="probe"))
        self.exact_leases = event.messages_lost  # no message of the run survives: no carrier may come back
        self.reemit_stalled()
        if event.messages_lost:
            self.reemit_queued()
            self.resend_lease_timers()
            self.commands = _without_repeats(self.commands)
        # nothing carries a "redeliver later" here (there is no message): the sweeper comes back by the index
        self.commands = [c for c in self.commands if not isinstance(c, RedeliverLater)]
        return None

    def resend_lease_timers(self) -> None:
        """Every message of the run was lost (``ryusen dev`` restarted without its queue): each attempt still in flight
        gets a lease timer of its own, which takes it as Unknown when its lease ends (later, if heartbeats extend it),
        as its lost carrier would have; a later sweep would wait ``lease_watch_grace_s`` past the lease."""
        for step in self.s.steps:
            for phase, kind in ((Phase.FORWARD, TaskKind.FORWARD), (Phase.COMPENSATION, TaskKind.COMPENSATE)):
                a = step.current(phase)
                if a is None or a.status is not AttemptStatus.AUTHORIZED or a.lease_expires_at is None:
                    continue
                if a.lease_expires_at <= self.now:
                    continue  # judged by this sweep already (reemit_stalled, exact)
                timer = TaskRef(run_id=self.s.id, kind=kind, step_id=step.id, generation=a.generation, lease_timer=True)
                self.commands.append(EnqueueTask(task=timer, delay_s=(a.lease_expires_at - self.now).total_seconds()))

    def reemit_queued(self) -> None:
        """Send every queued task of the run again (an API request retried after its first try's sends
        failed; no message of the run may be in flight to repair it). A duplicate delivery is harmless."""
        s = self.s
        if s.phase is RunPhase.FINISHED:
            return
        if s.discovery is not None and s.discovery.status is AttemptStatus.QUEUED:
            self.commands.append(EnqueueTask(task=TaskRef(run_id=s.id, kind=TaskKind.DISCOVER, seq=s.discovery.seq)))
        for step in s.steps:
            for phase, kind in ((Phase.FORWARD, TaskKind.FORWARD), (Phase.COMPENSATION, TaskKind.COMPENSATE)):
                a = step.current(phase)
                if a is not None and a.status is AttemptStatus.QUEUED:
                    task = TaskRef(run_id=s.id, kind=kind, step_id=step.id, generation=a.generation)
                    wait_s = (a.not_before - self.now).total_seconds() if a.not_before is not None else 0.0
                    self.commands.append(EnqueueTask(task=task, delay_s=max(0.0, wait_s)))  # due when it was
                elif a is not None and a.status is AttemptStatus.UNKNOWN and a.retry_at is not None:
                    task = TaskRef(run_id=s.id, kind=kind, step_id=step.id, generation=a.generation + 1)
                    self.commands.append(EnqueueTask(task=task))

    def invocation_failed(self, event: InvocationFailed) -> None:
        task = event.task
        if task.kind is TaskKind.DISCOVER:
            d = self.s.discovery
            if d is None or d.seq != task.seq or d.status is not AttemptStatus.AUTHORIZED:
                return self.ignore(f"discovery #{task.seq} is no longer in flight")
            if event.delivery_id is not None and d.delivery_id != event.delivery_id:
                return self.ignore(f"discovery #{task.seq} was authorized by another delivery")
            if self.stopping:
                self.s.discovery = None
                self.touch()
                return self.evaluate_recovery()
            # discovery is repeatable: re-dispatch the same pass with backoff
            d.status = AttemptStatus.QUEUED
            d.redeliveries += 1
            d.authorized_at = d.lease_expires_at = None
            self.touch()
            self.send_again(d, task, d.redeliveries)
            return self.endpoint_failing(d.redeliveries, f"discovery #{d.seq}", event.detail)
        phase = task.phase
        assert phase is not None and task.step_id is not None
        step = self.step(task.step_id)
        attempt = step.attempt(phase, task.generation or 0) if step else None
        if step is None or attempt is None or attempt.status is not AttemptStatus.AUTHORIZED:
            return self.ignore(f"{task.describe()} is no longer in flight")
        if event.delivery_id is not None and attempt.delivery_id != event.delivery_id:
            return self.ignore(f"{task.describe()} was authorized by another delivery")
        if attempt.waiting_since is not None:  # decision 32: its callback answered; only its lease ends the wait
            return self.ignore(f"{task.describe()} answered and waits for its completion")
        if event.failure is InvocationFailure.UNREACHABLE:
            # nothing was sent: the callback provably did not run; same generation again
            attempt.status = AttemptStatus.QUEUED
            attempt.authorized_at = attempt.lease_expires_at = attempt.respond_by = None
            attempt.redeliveries += 1
            if phase is Phase.FORWARD and self.stopping:
                self.settle(attempt, AttemptStatus.FENCED, detail="never sent; fenced by the stop intent")
                step.status = StepStatus.FENCED
                return self.evaluate_recovery()
            self.touch()
            self.send_again(attempt, task, attempt.redeliveries)
            return self.endpoint_failing(attempt.redeliveries, task.describe(), event.detail, step, attempt)
        return self.outcome_lost(step, attempt, event.detail)

    def endpoint_failing(
        self,
        failures: int,
        what: str,
        detail: str,
        step: StepState | None = None,
        attempt: Attempt | None = None,
    ) -> None:
        """Say why a run waits when its endpoint keeps failing a task (the retries go on)."""
        if failures < self.settings.endpoint_failing_after:
            return
        message = f"the app's endpoint failed {what} {failures} times in a row; retrying with backoff"
        for blocker in self.s.blockers:
            if blocker.type is BlockerType.ENDPOINT_FAILING:
                blocker.count, blocker.last_seen_at, blocker.message, blocker.detail = (
                    failures,
                    self.now,
                    message,
                    detail,
                )
                return
        self.s.blockers.append(
            Blocker(
                type=BlockerType.ENDPOINT_FAILING,
                step_id=step.id if step else None,
                phase=attempt.phase if attempt else None,
                generation=attempt.generation if attempt else None,
                message=message,
                detail=detail,
                count=failures,
                first_seen_at=self.now,
                last_seen_at=self.now,
            )
        )

    def start_may_be_lost(self, event: StartMayBeLost) -> None:
        """The store lost the write that authorized this attempt, not the attempt: it may have run."""
        task = event.task
        phase, step_id, generation = task.phase, task.step_id, task.generation
        if phase is None or step_id is None or generation is None:
            return self.ignore("a discovery has no effect to lose")
        step = self.step(step_id)
        attempt = step.attempt(phase, generation) if step is not None else None
        current = step.current(phase) if step is not None else None
        if attempt is None and (current is None or current.generation < generation):
            # recorded and authorized in one write the kept state does not hold (a chained authorization): when
            # the run records it again, it is Unknown at once (``presumed_unknown``)
            key = self.presumed_key(step_id, phase, generation)
            if key not in self.s.presumed_started:
                self.s.presumed_started = [*self.s.presumed_started, key]
                self.touch()
            return self.ignore(f"{task.describe()} is not recorded: it is Unknown once it is")
        if step is None or attempt is None or attempt is not current:
            return self.ignore(f"{task.describe()} is not the current generation")
        if attempt.status is not AttemptStatus.QUEUED or step.sleep:
            return self.ignore(f"{task.describe()} is {attempt.status}: its state is known")
        return self.outcome_lost(step, attempt, event.reason)

    @staticmethod
    def presumed_key(step_id: str, phase: Phase, generation: int) -> str:
        return f"{step_id}\x00{phase.value}\x00{generation}"

    def presumed_unknown(self, step: StepState, attempt: Attempt) -> bool:
        """``attempt``, just recorded, is one a killed ``ryusen dev`` had authorized after its last save (its
        callback may have run): it is Unknown now, instead of being sent (``StartMayBeLost``)."""
        key = self.presumed_key(step.id, attempt.phase, attempt.generation)
        if step.sleep or key not in self.s.presumed_started:
            return False
        self.s.presumed_started = [k for k in self.s.presumed_started if k != key]
        self.outcome_lost(step, attempt, PRESUMED_STARTED)
        return True

    def await_completion(self, step: StepState, attempt: Attempt) -> None:
        """A step completed from outside (decision 32): its callback handed out the attempt's completion token and
        returned; the attempt waits for the completion until the step's timeout, which its own lease timer
        watches. A stop fences it: no completion is taken after."""
        if self.stopping:
            self.settle(attempt, AttemptStatus.FENCED, detail="fenced by the stop intent while waiting for completion")
            step.status = StepStatus.FENCED
            return self.evaluate_recovery()
        started = attempt.authorized_at or self.now
        if attempt.status is AttemptStatus.UNKNOWN:
            # a late answer of a callback thought lost: it ran and handed out the token, so the attempt waits
            # (watched by its lease, as any waiting attempt) and a retry planned for the Unknown is not needed
            attempt.status, attempt.settled_at, attempt.retry_at = AttemptStatus.AUTHORIZED, None, None
            step.status = StepStatus.RUNNING
        attempt.waiting_since = self.now
        attempt.lease_expires_at = max(self.now, started + timedelta(seconds=self.timeout_s(step, Phase.FORWARD)))
        attempt.detail = "waiting for its completion (the callback handed out the token)"
        self.touch()
        task = TaskRef(
            run_id=self.s.id, kind=TaskKind.FORWARD, step_id=step.id, generation=attempt.generation, lease_timer=True
        )
        delay = (attempt.lease_expires_at - self.now).total_seconds()
        self.commands.append(EnqueueTask(task=task, delay_s=delay))
        return None

    def completion_reported(self, event: CompletionReported) -> None:
        """A completion token came back with the step's result or error (decision 32): taken as the attempt's
        outcome if its generation is the current, unsettled one; otherwise kept as stale and refused."""
        step = self.step(event.step_id)
        if step is None or not step.external:
            return self.reject("completion_refused", f"step {event.step_id!r} is not completed from outside")
        attempt = step.attempt(event.phase, event.generation)
        current = step.current(event.phase)
        live = (
            attempt is current
            and attempt is not None
            and attempt.status in (AttemptStatus.AUTHORIZED, AttemptStatus.UNKNOWN)
        )
        if not live and attempt is not None and self.completion_taken(step, attempt, event):
            # the same completion again (a retried request whose first try committed): answered as taken
            self.reemit_queued()  # its first try's sends may have been lost with its answer
            return self.ignore("the same completion was already taken")
        if live and event.error is None and (too_large := self.oversized_result(event.result)) is not None:
            # refused, nothing recorded: the sender may send less (no callback ran that an operator must settle)
            return self.reject(too_large.type, too_large.message)
        response: AttemptResponse = (
            CallbackFailed(error=event.error) if event.error is not None else CallbackSucceeded(result=event.result)
        )
        self.external_completion = True
        report = AttemptReported(
            step_id=event.step_id,
            phase=event.phase,
            generation=event.generation,
            response=response,
            source="completion",
        )
        self.attempt_reported(report)
        if not live:
            status = (
                "replaced by a newer generation" if attempt is not current else str(attempt.status if attempt else "")
            )
            # kept as stale (written), and refused: the note says so, and the engine answers 409 after the write
            return self.ignore(
                f"{COMPLETION_REFUSED}: the token is for {event.step_id} #{event.generation}, which is {status}: the"
                " completion is kept on it, not taken"
            )
        return None

    @staticmethod
    def completion_taken(step: StepState, attempt: Attempt, event: CompletionReported) -> bool:
        """``event`` is the completion this attempt already took: the same result it succeeded with, or the same
        error it failed with (a step completed from outside settles by nothing else but an operator)."""
        if attempt.resolution is not None:
            return False
        if event.error is None:
            return attempt.status is AttemptStatus.SUCCEEDED and step.result == event.result
        return attempt.status is AttemptStatus.FAILED and attempt.error == event.error.bounded()

    def outcome_lost(self, step: StepState, attempt: Attempt, detail: str) -> None:
        """An authorized effect attempt whose outcome cannot be established (decisions 6.4)."""
        if attempt.waiting_since is not None and attempt.phase is Phase.FORWARD:
            # its callback ran and handed out the token; no completion came within the step's timeout
            error = ErrorInfo(
                type="completion_timeout",
                message=f"no completion within the step's timeout of {self.timeout_s(step, Phase.FORWARD):g}s",
            )
            return self.attempt_failed(step, attempt, error)
        policy = self.policy(step, attempt.phase)
        retry_left = self.failures(step, attempt.phase) + 1 < policy.max_attempts
        self.settle(attempt, AttemptStatus.UNKNOWN, detail=detail)
        attempt.settled_at = None  # Unknown is not a settlement: a late result or an operator settles it
        attempt.unknown_at, attempt.unknown_reason = self.now, detail  # kept whatever settles it (decisions 28)
        if attempt.phase is Phase.FORWARD:
            step.status = StepStatus.UNKNOWN
        else:
            step.compensation_status = CompensationStatus.UNKNOWN
            self.set_unwind_status(step.id, CompensationStatus.UNKNOWN)
        if policy.on_unknown == "retry" and retry_left and not (attempt.phase is Phase.FORWARD and self.stopping):
            # The callback is declared safe to run twice: plan the next generation after the backoff. Until it
            # starts, this attempt stays Unknown, so a late result still settles it and a stop still waits for it.
            failures = self.failures(step, attempt.phase) + 1
            delay = backoff_delay(policy, failures, seed=f"{attempt.operation_id}:{attempt.generation}")
            attempt.retry_at = self.now + timedelta(seconds=delay)
            attempt.detail = f"{detail}; retried at {attempt.retry_at.isoformat()} (on_unknown=retry)"
            kind = TaskKind.FORWARD if attempt.phase is Phase.FORWARD else TaskKind.COMPENSATE
            task = TaskRef(run_id=self.s.id, kind=kind, step_id=step.id, generation=attempt.generation + 1)
            self.commands.append(EnqueueTask(task=task, delay_s=delay))
            return None
        self.block_on_unknown(step, attempt)
        if self.stopping and self.s.phase is RunPhase.RUNNING:
            self.s.phase = RunPhase.SETTLING
        if self.s.probe_due_at is None:
            self.schedule_probe()  # nothing wakes an Unknown, but the probe keeps a blocked run in view

    def block_on_unknown(self, step: StepState, attempt: Attempt) -> None:
        label = "compensation" if attempt.phase is Phase.COMPENSATION else "step"
        self.s.blockers.append(
            Blocker(
                type=BlockerType.UNKNOWN_OUTCOME,
                step_id=step.id,
                phase=attempt.phase,
                generation=attempt.generation,
                message=f"unknown outcome of {step.id} {label} #{attempt.generation}",
                detail=attempt.detail,
                first_seen_at=self.now,
                last_seen_at=self.now,
            )
        )
        self.touch()

    # ---- discovery results ------------------------------------------------------

    def discovery_reported(self, seq: int, response: DiscoveryResponse) -> None:
        s = self.s
        d = s.discovery
        if d is None or d.seq != seq or d.status is not AttemptStatus.AUTHORIZED:
            if d is None or d.seq > seq:
                self.reemit_queued()  # as for a stale attempt report: a first try may have committed, its sends lost
            return self.ignore(f"discovery #{seq} is not in flight; its report is discarded")
        s.discovery = None
        self.build_id = d.build_id
        self.clear_blockers(BlockerType.ENDPOINT_FAILING)
        self.touch()
        if self.stopping:  # S4: authorized discovery in flight at the stop is discarded
            s.discoveries += 1
            self.ignore("discovery discarded: a stop intent exists")
            return self.evaluate_recovery()
        self.discovered(response)

    def discovered(self, response: DiscoveryResponse) -> None:
        """What a discovery pass (or the continuation after a callback) found, with current code."""
        s = self.s
        s.discoveries += 1
        if (held := self.held_by_oversized_result()) is not None:
            # a callback ran and returned too much: whatever current code does now (reaches another step,
            # completes, fails), only an operator or a stop moves the run on (decisions 25)
            return self.definition_conflict(held[1], holds=held[0])
        if isinstance(response, StepsReached):
            return self.siblings_reached(response.steps, response.max_parallel)
        if isinstance(response, StepReached) and self.beside_live_steps(response.step.id):
            # a pass that repairs a blocker (or runs beside a group) while other steps are in flight: the step it
            # found starts once they have settled, one at a time, as a group of its own with them
            return self.siblings_reached([response.step], 1)
        if isinstance(response, StepReached):
            plan = response.step
            known = s.step(plan.id)
            if known is not None and (held := self.held_by(known, Phase.FORWARD, self.build_id)):
                # the callback ran and its outcome could not be taken (it opened a step with this same build, or
                # returned too much): running it again would repeat its effect; the run stays blocked (23, 25)
                return self.definition_conflict(held[1], holds=held[0])
            verdict = self.unstable_step_id(plan) if known is None else None
            if isinstance(verdict, UnstableStepId):
                return self.definition_conflict(verdict)
            if verdict == "confirming":
                return None
            self.clear_definition_blockers()
            step = self.step(plan.id)
            if step is None and len(s.steps) >= self.settings.max_steps:
                return self.too_many_steps(plan)
            if (too_long := self.timeout_over_maximum(plan) or self.wait_too_far(plan, step)) is not None:
                return self.definition_conflict(too_long)
            if step is None:
                step = StepState(id=plan.id)
                s.add_step(step)
                self._owned.add(id(step))
            elif step.status in (StepStatus.COMPLETED, StepStatus.FAILED):
                return self.queue_discovery()  # the memo raced a settlement; replay again
            elif (current := step.current(Phase.FORWARD)) is not None and current.status in LIVE_ATTEMPT:
                return self.ignore(f"step {plan.id} already has a live attempt")
            self.take_plan(step, plan)
            self.queue_attempt(step, Phase.FORWARD, self.wait_s(step, plan))
        elif isinstance(response, FunctionCompleted | FunctionFailed) and self.beside_live_steps(""):
            # a pass beside steps in flight (a repair) found the function's end: it is taken once they have settled
            # (the discovery after them), never while one may still succeed and need undoing
            return self.ignore("the function's end waits for the steps in flight")
        elif isinstance(response, FunctionCompleted) and (size := value_size(response.output)) > (
            limit := self.settings.max_value_bytes
        ):
            self.definition_conflict(OutputTooLarge(size=size, limit=limit))  # decisions 20: block, never fail
        elif isinstance(response, FunctionCompleted):
            self.clear_definition_blockers()
            s.output = response.output
            s.outcome = Outcome.COMPLETED
            self.finish(None)
        elif isinstance(response, FunctionFailed):
            self.clear_definition_blockers()
            s.error = response.error.bounded(self.settings.max_value_bytes)
            s.outcome = Outcome.FAILED  # F7: the adapter's response decides the outcome
            s.recovery = Recovery.PENDING
            self.evaluate_recovery()
        elif isinstance(response, ConflictFound):
            self.definition_conflict(response.conflict)
        elif isinstance(response, FunctionNotFound):
            self.function_not_found(response.detail)

    # ---- steps declared together (decision 30) ------------------------------------------

    def beside_live_steps(self, step_id: str) -> bool:
        """Another step's forward attempt has not settled (a pass that ran beside it: one that repairs a definition
        blocker, or one queued before an operator started a step again). Looked up among the steps due (queued,
        in flight, an Unknown's retry) and the Unknowns that block: a few, not every step of the run."""
        s = self.s
        for i in s.steps_due():
            step = s.steps[i]
            if step.id != step_id and _live_forward(step):
                return True
        return any(
            b.type is BlockerType.UNKNOWN_OUTCOME and b.phase is Phase.FORWARD and b.step_id != step_id
            for b in s.blockers
        )

    def siblings_reached(self, reported: list[StepPlan], max_parallel: int) -> None:
        """A pass reported steps declared together: record each (as a step reported alone would be), and run up
        to ``max_parallel`` of them at once, the rest in declaration order as those settle. Every step still in
        flight joins the group: it counts against ``max_parallel``, and the discovery after the group waits for
        it (a repair pass may run beside it, and a release may no longer declare it)."""
        s = self.s
        ids = [plan.id for plan in reported]
        if len(set(ids)) != len(ids):  # an endpoint's SDK checks this; the engine does not take it on trust
            step_id = next(i for n, i in enumerate(ids) if i in ids[:n])
            first, second = (plan for plan in reported if plan.id == step_id)
            duplicate = DuplicateStepConflict(
                step_id=step_id,
                first=WireOccurrence(location=first.location, name=first.name),
                duplicate=WireOccurrence(location=second.location, name=second.name),
            )
            return self.definition_conflict(duplicate)
        plans = [plan for plan in reported if s.step(plan.id) is None or self.restartable(plan.id)]
        in_flight = [step.id for step in s.steps if _live_forward(step)]  # reported or not
        for plan in reported:
            known = s.step(plan.id)
            if known is not None and (held := self.held_by(known, Phase.FORWARD, self.build_id)):
                return self.definition_conflict(held[1], holds=held[0])  # its callback ran: not again (23, 25)
        new = [plan for plan in plans if s.step(plan.id) is None]
        if new:
            verdict = self.unstable_step_id(new[0])
            if isinstance(verdict, UnstableStepId):
                return self.definition_conflict(verdict)
            if verdict == "confirming":
                return None
        for plan in plans:
            known = s.step(plan.id)
            if (too_long := self.timeout_over_maximum(plan) or self.wait_too_far(plan, known)) is not None:
                return self.definition_conflict(too_long)
        if len(s.steps) + len(new) > self.settings.max_steps:
            return self.too_many_steps(new[self.settings.max_steps - len(s.steps)])
        self.clear_definition_blockers()
        group = s.discoveries
        tail = len(s.steps)  # where this group's new steps begin
        for plan in plans:
            step = self.step(plan.id)
            if step is None:
                step = StepState(id=plan.id)
                s.add_step(step)
                self._owned.add(id(step))
            self.take_plan(step, plan)
            self.wait_s(step, plan)
            step.group = group
        for step_id in in_flight:  # reported again while in flight (a wake): still this group's, not restarted
            step = self.step(step_id)
            assert step is not None
            step.group = group
        # the group's steps in declaration order: they start in it (a known step reported again may sit before a
        # new one in the run's steps, so the order is kept apart when it is not the steps' own)
        members = [i for plan in reported if (i := s.step_index(plan.id)) is not None]
        members += [i for step_id in in_flight if (i := s.step_index(step_id)) is not None and i not in members]
        in_order = members == sorted(members)
        s.group, s.group_halted = group, False
        s.group_order = None if in_order else members
        s.group_next = (members[0] if members else tail) if in_order else 0
        s.group_live = sorted(i for i in members if _live_forward(s.steps[i]))
        s.max_parallel = max_parallel
        self.touch()
        self.start_siblings()

    def restartable(self, step_id: str) -> bool:
        """A known step a pass reports again, that may start: neither settled nor in flight."""
        step = self.s.step(step_id)
        if step is None or step.status in (StepStatus.COMPLETED, StepStatus.FAILED):
            return False
        current = step.current(Phase.FORWARD)
        return current is None or current.status not in LIVE_ATTEMPT

    @staticmethod
    def take_plan(step: StepState, plan: StepPlan) -> None:
        step.name, step.location, step.has_compensation = plan.name, plan.location, plan.has_compensation
        step.retry, step.compensate_retry = plan.retry, plan.compensate_retry
        step.timeout_s, step.compensate_timeout_s = plan.timeout_s, plan.compensate_timeout_s
        step.heartbeat_s = plan.heartbeat_s
        step.external = plan.completion == "external"
        step.status = StepStatus.PENDING

    def in_group(self, step: StepState) -> bool:
        return step.group is not None and step.group == self.s.group

    def sibling_settled(self, step: StepState) -> None:
        """A step of the running group settled (or its pass did not reach it: it leaves the group, and the
        discovery after the group decides about it). Start the next sibling, or the discovery once none is left."""
        current = step.current(Phase.FORWARD)
        if step.status is StepStatus.PENDING and (current is None or current.status not in LIVE_ATTEMPT):
            step.group = None
        if step.status is StepStatus.FAILED:
            self.s.group_halted = True
        self.start_siblings()

    def group_census(self) -> tuple[int, int | None, bool]:
        """The running group: how many are in flight, the index of the next that has not started, and whether
        the group is halted (a sibling failed for good: no new sibling starts, as ``gather`` raises there).

        Bounded by the siblings in flight, not the run: the ones started are listed (``group_live``, checked
        here), and the next to start is looked for from where the last look ended (``group_next``)."""
        s = self.s
        steps, group = s.steps, s.group
        halted = s.group_halted
        live: list[int] = []
        self.census_visited = 0
        for i in s.group_live:
            self.census_visited += 1
            step = steps[i]
            if step.group == group and _live_forward(step):
                live.append(i)
            elif step.group == group and step.status is StepStatus.FAILED:
                halted = True
        order = s.group_order
        position = s.group_next or 0
        unstarted = None
        while position < (len(order) if order is not None else len(steps)):
            self.census_visited += 1
            i = order[position] if order is not None else position
            step = steps[i]
            if step.group == group and step.status is StepStatus.PENDING and not _live_forward(step):
                unstarted = i
                break
            if step.group == group and step.status is StepStatus.FAILED:
                halted = True
            position += 1
        if live != s.group_live:
            s.group_live = live  # replaced, never changed in place (a working copy shares it)
        s.group_next, s.group_halted = position, halted
        return len(live), unstarted, halted

    def start_siblings(self) -> None:
        """Keep up to ``max_parallel`` of the running group in flight, in declaration order; once none is in
        flight and none may start, the group is done and the next discovery runs (the function goes on, or
        raises a sibling's failure at its own await). A stop starts no sibling (P4); a definition blocker waits
        for a wake."""
        if self._filling:
            self._refill = True
            return None
        s = self.s
        self._filling = True
        try:
            while True:
                self._refill = False
                in_flight, unstarted, halted = self.group_census()
                may_start = not halted and not self.stopping and not s.blocked_by_definition
                if may_start and unstarted is not None and in_flight < (s.max_parallel or 1):
                    step = self.own(unstarted)
                    delay = max(0.0, (step.wait_until - self.now).total_seconds()) if step.wait_until else 0.0
                    s.group_live = [*s.group_live, unstarted]
                    self.queue_attempt(step, Phase.FORWARD, delay)
                    continue
                if not self._refill:
                    break
        finally:
            self._filling = False
        if in_flight == 0 and (unstarted is None or not may_start):
            s.group = s.max_parallel = s.group_next = s.group_order = None
            s.group_live, s.group_halted = [], False
            self.touch()
            if self.stopping:
                return self.evaluate_recovery()
            # also when blocked: a wake refused while siblings were in flight (a release synced meanwhile) is not
            # lost; a pass that meets the same conflict only counts it again (D7)
            self.queue_discovery()
        return None

    def wait_s(self, step: StepState, plan: StepPlan) -> float:
        """Seconds until ``step`` may start (decision 31): its due time is set from the plan the first time the
        step is recorded, and kept after (a replay, or a release that changes the wait, never moves it)."""
        if step.wait_until is None and (plan.sleep or plan.not_before is not None or plan.not_before_s is not None):
            step.sleep = plan.sleep
            if plan.not_before is not None:
                step.wait_until = datetime.fromtimestamp(plan.not_before, UTC)
            else:
                step.wait_until = self.now + timedelta(seconds=plan.not_before_s or 0.0)
        if step.wait_until is None:
            return 0.0
        return max(0.0, (step.wait_until - self.now).total_seconds())

    def unstable_step_id(self, plan: StepPlan) -> UnstableStepId | Literal["confirming"] | None:
        """A new step id where the last steps the run added, at the same location, were each abandoned before
        any attempt ran (its pass met yet another new id first): an id that changes on every pass, such as one
        made from a random number or the clock (decisions 29). Blocks before the run burns its step budget.

        While blocked, a wake's pass (a release, the probe, an operator) that announces a new id adds no step:
        the id becomes the blocker's candidate and another pass is asked for (``"confirming"``). The same id
        again is stable (None: the step is recorded and runs); another id blocks again, counted (D7)."""
        s = self.s
        blocker = next((b for b in s.blockers if b.type is BlockerType.UNSTABLE_STEP_ID), None)
        if blocker is not None:
            candidate, blocker.candidate_step_id = blocker.candidate_step_id, None
            self.touch()
            if candidate is None:
                blocker.candidate_step_id = plan.id
                self.queue_discovery()
                return "confirming"
            if candidate == plan.id:
                return None
            earlier = (blocker.step_ids or [])[-3:]
            return UnstableStepId(step_ids=(*earlier, candidate, plan.id), location=plan.location)
        n = self.settings.unstable_after
        recent = s.steps[-n:]
        if len(recent) < n or not all(self.abandoned(step, plan.location) for step in recent):
            return None
        return UnstableStepId(step_ids=(*(step.id for step in recent), plan.id), location=plan.location)

    @staticmethod
    def abandoned(step: StepState, location: str | None) -> bool:
        """A step announced at ``location`` whose every attempt was fenced because its pass did not reach it."""
        return (
            step.status is StepStatus.PENDING
            and step.location == location
            and bool(step.attempts)
            and all(
                a.status is AttemptStatus.FENCED and (a.detail or "").startswith("target_not_found")
                for a in step.attempts
            )
        )

    def timeout_over_maximum(self, plan: StepPlan) -> InvalidStep | None:
        """A step whose declared attempt timeout the deployment cannot hold (never clamped)."""
        for what, declared in (("timeout", plan.timeout_s), ("compensate_timeout", plan.compensate_timeout_s)):
            if declared is not None and declared > MAX_RUN_TIMEOUT_S:  # past it, a lease may not fit in a date
                message = (
                    f"step {plan.id!r} declares {what}={declared:g}s; the longest a step may declare is"
                    f" {MAX_RUN_TIMEOUT_S / 86_400:g} days"
                )
                return InvalidStep(step_id=plan.id, location=plan.location, message=message)
        maximum = self.settings.max_attempt_timeout_s
        if maximum is None:
            return None
        # a step completed from outside: its timeout bounds the wait for the completion, which no process spends
        forward = plan.timeout_s if plan.completion != "external" else None
        for what, declared in (("timeout", forward), ("compensate_timeout", plan.compensate_timeout_s)):
            if declared is not None and declared > maximum:
                message = (
                    f"step {plan.id!r} declares {what}={declared:g}s; this deployment's maximum attempt"
                    f" duration is {maximum:g}s"
                )
                return InvalidStep(step_id=plan.id, location=plan.location, message=message)
        return None

    def wait_too_far(self, plan: StepPlan, known: StepState | None) -> InvalidStep | None:
        """A step whose first attempt would wait past the longest durable wait (decision 31: a year), from
        ``sleep_until`` or ``not_before`` with a moment (``not_before_s`` is bounded on the wire). A step whose
        due time is recorded keeps it (W2): only a first record is checked."""
        if plan.not_before is None or (known is not None and known.wait_until is not None):
            return None
        ahead_s = plan.not_before - self.now.timestamp()
        if ahead_s <= MAX_WAIT_S:
            return None
        message = (
            f"step {plan.id!r} waits until a moment {ahead_s / 86_400:.0f} days away; a wait is at most"
            f" {MAX_WAIT_S / 86_400:g} days"
        )
        return InvalidStep(step_id=plan.id, location=plan.location, message=message)

    def too_many_steps(self, plan: StepPlan) -> None:
        """Discovery reached a step past ``max_steps``: the run fails, like an oversized output.

        Every task replays every recorded step, so a run's steps are bounded; the step is not
        recorded and never runs, and the steps the run completed are compensated. Work that needs
        more steps belongs in several runs.
        """
        limit = self.settings.max_steps
        self.s.error = ErrorInfo(
            type="too_many_steps",
            message=f"step {plan.id!r} would be step {limit + 1} of this run; the limit is {limit}",
            retryable=False,
        )
        self.s.outcome = Outcome.FAILED
        self.s.recovery = Recovery.PENDING
        self.evaluate_recovery()

    def function_not_found(self, detail: str) -> None:
        """Current code lacks the function: block (recoverable by a new release), never fail or skip."""
        s = self.s
        existing = [b for b in s.blockers if b.type is BlockerType.FUNCTION_NOT_FOUND]
        if existing:
            existing[0].count += 1
            existing[0].last_seen_at = self.now
        else:
            s.blockers.append(
                Blocker(
                    type=BlockerType.FUNCTION_NOT_FOUND,
                    message=f"the endpoint's current code has no function {s.function_id!r}",
                    detail=detail,
                    first_seen_at=self.now,
                    last_seen_at=self.now,
                )
            )
        self.schedule_probe()

    def schedule_probe(self) -> None:
        s = self.s
        interval = (
            self.settings.probe_initial_s
            if s.probe_interval_s is None
            else min(self.settings.probe_max_s, s.probe_interval_s * 2)
        )
        s.probe_interval_s = interval
        s.probe_due_at = self.now + timedelta(seconds=interval)
        self.commands.append(ScheduleTimer(timer=TimerRef(run_id=s.id, kind=TimerKind.PROBE, at=s.probe_due_at)))
        self.touch()

    def definition_conflict(
        self,
        conflict: DefinitionConflict | CompensationTargetNotReached | ResultTooLarge | UnstableStepId,
        *,
        holds: Attempt | None = None,
    ) -> None:
        """What current code got wrong becomes a definition blocker: recoverable, never a failure or a skip.

        The same conflict seen again updates its diagnostics only (D7); a different one replaces the
        blockers of earlier passes, which current code no longer shows. ``holds`` is the compensation
        attempt the conflict stopped, when it came from a compensation pass.
        """
        s = self.s
        found = self.conflict_blocker(conflict, holds)
        for blocker in s.blockers:
            if _conflict_key(blocker) == _conflict_key(found):
                blocker.count += 1
                blocker.last_seen_at = self.now
                blocker.message, blocker.detail = found.message, found.detail
                blocker.size, blocker.limit, blocker.step_ids = found.size, found.limit, found.step_ids
                blocker.first, blocker.duplicate, blocker.second = found.first, found.duplicate, found.second
                blocker.phase, blocker.generation = found.phase, found.generation
                break
        else:
            s.blockers = [b for b in s.blockers if b.type not in DEFINITION_BLOCKERS]
            s.blockers.append(found)
        self.schedule_probe()

    def conflict_blocker(
        self,
        conflict: DefinitionConflict | CompensationTargetNotReached | ResultTooLarge | UnstableStepId,
        holds: Attempt | None,
    ) -> Blocker:
        held = {"phase": holds.phase, "generation": holds.generation} if holds is not None else {}
        seen = {"first_seen_at": self.now, "last_seen_at": self.now}
        if isinstance(conflict, DuplicateStepConflict):
            return Blocker(
                type=BlockerType.DUPLICATE_STEP_ID,
                step_id=conflict.step_id,
                first=Occurrence(**conflict.first.model_dump()),
                duplicate=Occurrence(**conflict.duplicate.model_dump()),
                message=(
                    f"step id {conflict.step_id!r} is used twice in one pass"
                    f" (first at {conflict.first.location}, again at {conflict.duplicate.location})"
                ),
                **seen,
            )
        if isinstance(conflict, ConcurrentStepConflict):
            first, second = conflict.first, conflict.second
            message = (
                f"step {second.step_id!r} (at {second.location}) was started while step {first.step_id!r}"
                f" (at {first.location}) was still open, outside what runs together (decision 18)"
            )
            if first.step_id is None:  # decisions 18: a step from a thread that is not the function's own
                message = (
                    f"step {second.step_id!r} (at {second.location}) was started from a thread other than the"
                    " workflow function's own; steps run from the function's thread"
                )
            if holds is not None:  # decisions 23: opened inside the callback of the step it holds up
                message = (
                    f"step {second.step_id!r} (at {second.location}) was opened inside the callback of step"
                    f" {first.step_id!r} (at {first.location}), which ran (build"
                    f" {nested_step_build(holds.error) or holds.build_id}); a callback"
                    " cannot open steps. A release that moves it out, or an operator, moves the run on"
                )
            return Blocker(
                type=BlockerType.CONCURRENT_STEP,
                # the step the blocker holds up: the one whose callback ran, when it names an attempt to resolve
                step_id=first.step_id if holds is not None else second.step_id,
                first=Occurrence(**first.model_dump()),
                second=Occurrence(**second.model_dump()),
                message=message,
                **held,
                **seen,
            )
        if isinstance(conflict, NewStepBeforeTarget):
            target = self.s.step(conflict.step_id)
            new = conflict.first
            return Blocker(
                type=BlockerType.NEW_STEP_BEFORE_TARGET,
                step_id=conflict.step_id,
                first=Occurrence(**new.model_dump()),
                second=self.occurrence_of(conflict.step_id),
                message=(
                    f"current code reaches step {new.step_id!r} (at {new.location}), which has no recorded outcome,"
                    f" before step {conflict.step_id!r} (recorded at {target.location if target else '?'}),"
                    " whose compensation is due"
                ),
                **held,
                **seen,
            )
        if isinstance(conflict, UnstableStepId):
            ids = list(conflict.step_ids)
            return Blocker(
                type=BlockerType.UNSTABLE_STEP_ID,
                first=Occurrence(location=conflict.location),
                step_ids=ids,
                message=(
                    f"the step id at {conflict.location} changes on every pass ({', '.join(map(repr, ids[-3:]))}"
                    " ...): each pass abandons the id the last one announced, so no step there can complete"
                ),
                **seen,
            )
        if isinstance(conflict, ResultTooLarge):
            omitted = conflict.omitted
            return Blocker(
                type=BlockerType.RESULT_TOO_LARGE,
                step_id=conflict.step_id,
                first=self.occurrence_of(conflict.step_id),
                size=omitted.size,
                limit=omitted.limit,
                message=(
                    f"step {conflict.step_id!r} ran and returned a result of {omitted.size} bytes serialized; the"
                    f" limit is {omitted.limit}: it is neither failed nor retried"
                ),
                detail=f"sha256 {omitted.sha256}",
                **held,
                **seen,
            )
        if isinstance(conflict, CompensationTargetNotReached):
            target = self.s.step(conflict.step_id)
            build = holds.build_id if holds is not None else None
            return Blocker(
                type=BlockerType.COMPENSATION_TARGET_NOT_REACHED,
                step_id=conflict.step_id,
                second=self.occurrence_of(conflict.step_id),
                message=(
                    f"the compensation pass of build {build} ended without reaching step {conflict.step_id!r}"
                    f" (recorded at {target.location if target else '?'}), whose compensation is due"
                ),
                detail=conflict.detail,
                **held,
                **seen,
            )
        if isinstance(conflict, InvalidStep):
            return Blocker(
                type=BlockerType.INVALID_STEP,
                step_id=conflict.step_id,
                first=Occurrence(step_id=conflict.step_id, location=conflict.location),
                message=conflict.message,
                **seen,
            )
        if isinstance(conflict, OutputNotJson):
            return Blocker(type=BlockerType.OUTPUT_NOT_JSON, message=conflict.message, **seen)
        return Blocker(
            type=BlockerType.OUTPUT_TOO_LARGE,
            message=(
                f"the function returned an output of {conflict.size} bytes serialized; the limit is {conflict.limit}"
            ),
            **seen,
        )

    def occurrence_of(self, step_id: str) -> Occurrence:
        """Where the run recorded step ``step_id`` (its location and display name), for a blocker to name."""
        step = self.s.step(step_id)
        return Occurrence(step_id=step_id, location=step.location if step else None, name=step.name if step else None)

    def wake(self, event: WakeRequested) -> None:
        s = self.s
        due = s.probe_due_at is not None and self.now >= s.probe_due_at
        if s.phase is RunPhase.FINISHED or not s.blocked_by_definition:
            if event.source == "operator":
                self.reject("no_definition_blocker", "the run has no definition blocker to rediscover")
            if event.source == "probe" and due and s.phase is not RunPhase.FINISHED and s.blockers:
                self.schedule_probe()  # an Unknown waits for a person: keep looking, less and less often
                return self.ignore("still blocked; nothing current code can repair")
            if event.source == "probe" and due:
                s.probe_interval_s = s.probe_due_at = None
                self.touch()
            return self.ignore("nothing to wake")
        if event.source == "probe" and not due:
            return self.ignore("probe is not due")
        if event.source == "release_sync":
            for blocker in s.blockers:  # a candidate announced by older code proves nothing about the new release
                if blocker.type is BlockerType.UNSTABLE_STEP_ID and blocker.candidate_step_id is not None:
                    blocker.candidate_step_id = None
                    self.touch()
        if s.phase is RunPhase.COMPENSATING:
            entry = self.current_unwind_entry()
            step = self.step(entry.step_id) if entry else None
            current = step.current(Phase.COMPENSATION) if step else None
            if step is None or (current is not None and current.status in LIVE_ATTEMPT):
                return self.probe_finds_nothing_to_do(due, "compensation already in progress")
            # the blocker stays until a pass gets past it, so the probe keeps doubling (D7, decisions 6.8)
            self.probe_done(due)
            self.queue_attempt(step, Phase.COMPENSATION)
            return None
        if s.discovery is not None:
            return self.probe_finds_nothing_to_do(due, "a discovery pass is already queued")
        if self.stopping:
            return self.probe_finds_nothing_to_do(due, "no rediscovery after a stop intent")
        self.probe_done(due)
        self.queue_discovery()

    def probe_done(self, due: bool) -> None:
        """A due probe queued the work that looks again: its time is spent (the work, if it blocks again,
        schedules the next probe). A probe time left in the past would read as overdue work forever."""
        if due:
            self.s.probe_due_at = None
            self.touch()

    def probe_finds_nothing_to_do(self, due: bool, note: str) -> None:
        """A wake that finds the run's work already on its way: a due probe keeps looking, less often."""
        if due:
            self.schedule_probe()
        return self.ignore(note)

    # ---- heartbeats (decision 33) ----------------------------------------------------

    def heartbeat(self, event: HeartbeatReported) -> None:
        """A running callback is alive: its attempt's lease runs another heartbeat interval (never past its
        timeout's), and the details are kept. Anything but the attempt in flight changes nothing."""
        found = self.s.step_index(event.step_id)
        current = self.s.steps[found].current(event.phase) if found is not None else None
        if current is None or current.generation != event.generation or current.status is not AttemptStatus.AUTHORIZED:
            return self.ignore(f"heartbeat of {event.step_id} #{event.generation}, which is not in flight")
        if event.seq and event.seq <= current.heartbeat_seq:
            return self.ignore(f"heartbeat #{event.seq} of {event.step_id} was taken already (or a later one)")
        step = self.step(event.step_id)
        assert step is not None
        attempt = step.current(event.phase)
        assert attempt is not None and attempt.lease_expires_at is not None and attempt.respond_by is not None
        attempt.heartbeat_at = self.now
        attempt.heartbeat_details = event.details
        attempt.heartbeat_seq = max(attempt.heartbeat_seq, event.seq)
        if (beat_s := step.heartbeat_for(event.phase)) is not None:
            grace = timedelta(seconds=attempt.lease_grace_s or 0.0)
            until = min(attempt.respond_by, self.now + timedelta(seconds=beat_s)) + grace
            attempt.lease_expires_at = max(attempt.lease_expires_at, until)
        self.touch()
        return self.ignore("heartbeat")

    # ---- attempt results ---------------------------------------------------------

    def attempt_reported(self, event: AttemptReported) -> None:
        step = self.step(event.step_id)
        attempt = step.attempt(event.phase, event.generation) if step else None
        if step is None or attempt is None:
            return self.reject("attempt_not_found", f"no attempt {event.step_id} {event.phase} #{event.generation}")
        if attempt is not step.current(event.phase) or attempt.status not in (
            AttemptStatus.AUTHORIZED,
            AttemptStatus.UNKNOWN,
        ):
            reason = (
                "a newer generation exists"
                if attempt is not step.current(event.phase)
                else f"the generation is already {attempt.status}"
            )
            self.record_stale(attempt, event, reason)
            self.touch()
            if event.source == "late_submission" or attempt is step.current(event.phase):
                # a retried submission, or a dispatcher's write tried again after its answer was lost, may
                # follow a first try that committed and whose sends were lost with that answer
                self.reemit_queued()
            return self.ignore(f"stale submission for {event.step_id} #{event.generation}: {reason}")
        self.clear_blockers_for(step, attempt)
        self.clear_blockers(BlockerType.ENDPOINT_FAILING)
        self.next = event.next
        # a pass that did not reach its target got past nothing: the blockers stand (decisions 24, 29)
        target_not_reached = isinstance(event.response, TargetNotFound) and event.response.reason == "not_reached"
        if not isinstance(event.response, ConflictFound | FunctionNotFound) and not target_not_reached:
            if self.in_group(step):
                # a sibling's pass proves nothing about another sibling's blocker: only its own are cleared
                self.s.blockers = [
                    b for b in self.s.blockers if b.type not in DEFINITION_BLOCKERS or b.step_id != step.id
                ]
                self.touch()
            else:
                self.clear_definition_blockers()  # this pass got past whatever blocked the ones before it
        self.apply_outcome(step, attempt, event.response)

    def record_stale(self, attempt: Attempt, event: AttemptReported, reason: str) -> None:
        """A diagnostic of a submission that changed nothing; bounded so a run's record stays bounded."""
        if len(attempt.stale_submissions) >= self.settings.stale_submissions_kept:
            attempt.stale_submissions_dropped += 1
            return
        outcome = event.response.model_dump(mode="json")
        if "result" in outcome and (size := value_size(outcome["result"])) > self.settings.stale_result_kept_bytes:
            digest = hashlib.sha256(json.dumps(outcome["result"], separators=(",", ":")).encode()).hexdigest()
            outcome["result"] = {"not_kept": f"a result of {size} bytes", "sha256": digest}
        if isinstance(error := outcome.get("error"), dict):
            outcome["error"] = (
                ErrorInfo.model_validate(error).bounded(self.settings.stale_result_kept_bytes).model_dump()
            )
        attempt.stale_submissions.append(
            StaleSubmission(received_at=self.now, source=event.source, outcome=outcome, reason=reason)
        )

    def oversized_result(self, result: Any) -> ErrorInfo | None:
        """Why an accepted result cannot be recorded (decisions 6.11), or None when it can."""
        size = value_size(result)
        if size > self.settings.max_value_bytes:
            return ErrorInfo(
                type="result_too_large",
                message=f"result is {size} bytes serialized; the limit is {self.settings.max_value_bytes}",
                retryable=False,
            )
        if self.s.run_bytes + size > self.settings.max_run_bytes:
            return ErrorInfo(
                type="run_too_large",
                message=(
                    f"recording this {size}-byte result would take the run's input and results to"
                    f" {self.s.run_bytes + size} bytes; the limit is {self.settings.max_run_bytes}"
                ),
                retryable=False,
            )
        return None

    def oversized_compensation_result(self, result: Any) -> ErrorInfo | None:
        if (size := value_size(result)) > self.settings.max_value_bytes:
            return ErrorInfo(
                type="result_too_large",
                message=f"compensation result is {size} bytes serialized; the limit is {self.settings.max_value_bytes}",
                retryable=False,
            )
        return None

    def clear_blockers_for(self, step: StepState, attempt: Attempt) -> None:
        if attempt.status is AttemptStatus.UNKNOWN:
            self.s.blockers = [
                b
                for b in self.s.blockers
                if not (b.type is BlockerType.UNKNOWN_OUTCOME and b.step_id == step.id and b.phase is attempt.phase)
            ]
            self.touch()

    def record_step_error(self, step: StepState, error: ErrorInfo) -> None:
        """A step's terminal failure: replayed to the function in every task, so it counts toward the run's
        bytes, and is cut (with a note) when the run's budget is nearly spent."""
        budget = max(1024, self.settings.max_run_bytes - self.s.run_bytes)
        step.error = error.bounded(min(self.settings.max_value_bytes, budget))
        self.s.run_bytes += value_size(step.error.model_dump(mode="json"))

    def apply_outcome(self, step: StepState, attempt: Attempt, response: AttemptResponse) -> None:
        if attempt.phase is Phase.FORWARD:
            self.forward_outcome(step, attempt, response)
        else:
            self.compensation_outcome(step, attempt, response)

    def forward_outcome(self, step: StepState, attempt: Attempt, response: AttemptResponse) -> None:
        s = self.s
        if isinstance(response, CallbackSucceeded) and step.external and not self.external_completion:
            return self.await_completion(step, attempt)  # the callback handed out the token (decision 32)
        if isinstance(response, CallbackSucceeded):
            if (omitted := response.omitted or self.omitted(response.result, forward=True)) is not None:
                return self.forward_result_omitted(step, attempt, omitted)
            self.settle(attempt, AttemptStatus.SUCCEEDED)
            s.run_bytes += value_size(response.result)
            step.status = StepStatus.COMPLETED
            step.result = response.result
            step.omitted_result = None  # a later generation's success replaces an oversized one
            step.error = None
            s.completion_seq += 1
            step.completed_seq = s.completion_seq
            if self.stopping:
                return self.evaluate_recovery()  # S5: joins the unwind
            if self.in_group(step):
                return self.sibling_settled(step)  # decision 30: the function goes on once its siblings settle
            if self.s.group is not None and self.group_census()[0] > 0:
                # A step outside the running group, which an operator's retry of a sibling reopened beside it: the
                # function goes on once the group's siblings have settled (the discovery after the group), not now.
                return self.start_siblings()
            if self.next is not None:  # continuation: what the replay found next, in this same write
                self.build_id = attempt.build_id
                return self.discovered(self.next)
            return self.queue_discovery()
        if isinstance(response, CallbackFailed):
            conflict = nested_step_conflict(response.error)
            if conflict is not None and not self.external_completion:  # only the endpoint that ran it says so (23)
                return self.callback_opened_a_step(step, attempt, response.error, conflict)
            return self.attempt_failed(step, attempt, response.error)
        if isinstance(response, TargetNotFound | ReplayFailed):
            # decisions 16: the callback was not entered; discovery with current code finds what comes next
            if isinstance(response, ReplayFailed):
                detail = "replay_failed: code outside step.run raised before the step; its callback did not run"
                self.settle(attempt, AttemptStatus.FENCED, error=response.error, detail=detail)
            else:
                self.settle(attempt, AttemptStatus.FENCED, detail=f"target_not_found: {response.detail}")
            step.status = StepStatus.PENDING
            if self.stopping:
                step.status = StepStatus.FENCED
                return self.evaluate_recovery()
            if self.in_group(step):
                return self.sibling_settled(step)  # it leaves the group; the discovery after it decides
            # a step that current code keeps not reaching (an endpoint serving two revisions at once) backs off
            fenced = 0
            for earlier in reversed([a for a in step.attempts if a.phase is Phase.FORWARD]):
                if earlier.status is not AttemptStatus.FENCED:
                    break
                fenced += 1
            return self.queue_discovery(self.redelivery_delay(fenced - 1) if fenced > 1 else 0.0)
        if isinstance(response, ConflictFound | FunctionNotFound):
            what = response.conflict.code if isinstance(response, ConflictFound) else "function_not_found"
            self.settle(attempt, AttemptStatus.FENCED, detail=f"{what}: the callback did not run")
            step.status = StepStatus.PENDING
            if self.stopping:
                step.status = StepStatus.FENCED
                return self.evaluate_recovery()
            if self.in_group(step):
                step.group = None  # current code does not reach it as declared: the discovery after decides
            if isinstance(response, ConflictFound):
                return self.definition_conflict(response.conflict)
            return self.function_not_found(response.detail)
        raise IllegalEventError(f"unexpected response {response!r}")

    def omitted(self, result: Any, *, forward: bool) -> OmittedValue | None:
        """What is recorded instead of a result over the value limit (or, forward, the run's budget), or None."""
        too_large = self.oversized_result(result) if forward else self.oversized_compensation_result(result)
        if too_large is None:
            return None
        encoded = json.dumps(result, separators=(",", ":"), ensure_ascii=False).encode()
        limit = self.settings.max_value_bytes
        if forward and too_large.type == "run_too_large":
            limit = max(0, self.settings.max_run_bytes - self.s.run_bytes)
        return OmittedValue(size=len(encoded), sha256=hashlib.sha256(encoded).hexdigest(), limit=limit)

    def forward_result_omitted(self, step: StepState, attempt: Attempt, omitted: OmittedValue) -> None:
        """The callback ran and returned more than can be recorded (decisions 25): it ran its effect, so it is
        neither a failure nor retried. Its place in the unwind is kept (it is accepted should the run stop); the
        run blocks until an operator retries it with consent, supplies its result, or fails it."""
        self.settle(
            attempt,
            AttemptStatus.SUCCEEDED,
            detail=f"result_too_large: {omitted.size} bytes, over the {omitted.limit}-byte limit; not recorded",
        )
        step.omitted_result = omitted
        step.result = None
        self.s.completion_seq += 1
        step.completed_seq = self.s.completion_seq
        if self.stopping:
            step.status = StepStatus.COMPLETED  # accepted: it joins the unwind (S5)
            return self.evaluate_recovery()
        step.status = StepStatus.PENDING
        return self.definition_conflict(ResultTooLarge(step_id=step.id, omitted=omitted), holds=attempt)

    def callback_opened_a_step(
        self, step: StepState, attempt: Attempt, error: ErrorInfo, conflict: ConcurrentStepConflict
    ) -> None:
        """The callback ran and opened a step inside it (decisions 23). Not an ordinary failure: no retry is
        spent or scheduled, the function is not told, and the run blocks until a release, the probe or an
        operator moves it on; only a build other than this one runs the callback again."""
        self.settle(
            attempt,
            AttemptStatus.FAILED,
            error=error,
            detail="concurrent_step: the callback ran and opened a step inside it; no retry is spent",
        )
        if attempt.phase is Phase.FORWARD:
            if self.stopping:  # S6: no forward retry after a stop; the step stays out of the unwind
                step.status = StepStatus.FAILED
                self.record_step_error(step, error)
                return self.evaluate_recovery()
            step.status = StepStatus.PENDING
        else:
            step.compensation_status = CompensationStatus.PENDING
            self.set_unwind_status(step.id, CompensationStatus.PENDING)
        return self.definition_conflict(conflict, holds=attempt)

    def attempt_failed(self, step: StepState, attempt: Attempt, error: ErrorInfo, detail: str | None = None) -> None:
        error = error.bounded(self.settings.max_value_bytes)
        self.settle(attempt, AttemptStatus.FAILED, error=error, detail=detail)
        policy = self.policy(step, attempt.phase)
        failures = self.failures(step, attempt.phase)
        retry_allowed = error.retryable and failures < policy.max_attempts
        if attempt.phase is Phase.FORWARD:
            if self.stopping:  # S6: no forward retry after a stop
                step.status = StepStatus.FAILED
                self.record_step_error(step, error)
                return self.evaluate_recovery()
            if retry_allowed:
                step.status = StepStatus.PENDING  # F4: invisible to the function
                delay = backoff_delay(policy, failures, seed=f"{attempt.operation_id}:{attempt.generation}")
                self.queue_attempt(step, Phase.FORWARD, delay)
                return None
            step.status = StepStatus.FAILED  # F5: one terminal failure, then discovery
            self.record_step_error(step, error)
            if self.in_group(step):
                return self.sibling_settled(step)  # P3: raised at its own await once its siblings settle
            return self.queue_discovery()
        if retry_allowed:
            step.compensation_status = CompensationStatus.PENDING
            self.set_unwind_status(step.id, CompensationStatus.PENDING)
            delay = backoff_delay(policy, failures, seed=f"{attempt.operation_id}:{attempt.generation}")
            self.queue_attempt(step, Phase.COMPENSATION, delay)
            return None
        step.compensation_status = CompensationStatus.FAILED
        step.compensation_error = error
        self.set_unwind_status(step.id, CompensationStatus.FAILED)
        for entry in list(self.s.unwind):
            if entry.status is CompensationStatus.PENDING:
                self.set_unwind_status(entry.step_id, CompensationStatus.NOT_REACHED)
                other = self.step(entry.step_id)
                if other is not None:
                    other.compensation_status = CompensationStatus.NOT_REACHED
        self.finish(Recovery.PARTIALLY_COMPENSATED)
        return None

    def compensation_outcome(self, step: StepState, attempt: Attempt, response: AttemptResponse) -> None:
        if isinstance(response, CallbackSucceeded):
            omitted = response.omitted or self.omitted(response.result, forward=False)
            # a compensator that ran and returned too much still succeeded: its result is kept as a marker (25)
            detail = f"result_too_large: {omitted.size} bytes; kept as a marker" if omitted is not None else None
            self.settle(attempt, AttemptStatus.SUCCEEDED, detail=detail)
            step.compensation_status = CompensationStatus.COMPENSATED
            step.compensation_result = response.result if omitted is None else None
            step.compensation_omitted = omitted
            self.set_unwind_status(step.id, CompensationStatus.COMPENSATED)
            return self.advance_unwind()
        if isinstance(response, TargetNotFound):
            if response.reason == "not_reached":
                # The pass ended (returned, or a recorded failure propagated) before the step: a guard, an
                # external read or an early return can do that with any build, so it proves nothing about
                # current code. The unwind stops here until a release, the probe or an operator moves it on;
                # a skip is recorded only where the pass reached the step, or the release retired it (24).
                self.settle(
                    attempt,
                    AttemptStatus.FENCED,
                    detail=f"compensation_target_not_reached: the compensator did not run; {response.detail}",
                )
                step.compensation_status = CompensationStatus.PENDING
                return self.definition_conflict(
                    CompensationTargetNotReached(step_id=step.id, detail=response.detail), holds=attempt
                )
            what = "retired by the release" if response.reason == "retired" else "target_not_found"
            self.settle(attempt, AttemptStatus.SUCCEEDED, detail=f"{what}: {response.detail}")
            step.compensation_status = CompensationStatus.SKIPPED
            self.set_unwind_status(step.id, CompensationStatus.SKIPPED)
            return self.advance_unwind()
        if isinstance(response, CallbackFailed):
            if (conflict := nested_step_conflict(response.error)) is not None:
                return self.callback_opened_a_step(step, attempt, response.error, conflict)
            return self.attempt_failed(step, attempt, response.error)
        if isinstance(response, ReplayFailed):  # decisions 17: a failed attempt, never a skip
            detail = "replay_failed: code outside step.run raised before the target; its compensator did not run"
            return self.attempt_failed(step, attempt, response.error, detail=detail)
        if isinstance(response, ConflictFound):  # decisions 17: blocked until current code reaches the target
            self.settle(attempt, AttemptStatus.FENCED, detail=f"{response.conflict.code}: the compensator did not run")
            step.compensation_status = CompensationStatus.PENDING
            return self.definition_conflict(response.conflict, holds=attempt)
        if isinstance(response, FunctionNotFound):
            self.settle(attempt, AttemptStatus.FENCED, detail="function_not_found: the compensator did not run")
            step.compensation_status = CompensationStatus.PENDING
            return self.function_not_found(response.detail)
        raise IllegalEventError(f"unexpected response {response!r}")

    # ---- recovery -------------------------------------------------------------------

    def evaluate_recovery(self) -> None:
        """Start the unwind once every effect attempt authorized before the outcome has settled (S9)."""
        s = self.s
        if s.outcome is None or s.outcome is Outcome.COMPLETED or s.phase in (RunPhase.COMPENSATING, RunPhase.FINISHED):
            return None
        self.touch()
        s.recovery = Recovery.PENDING
        unsettled = [
            step
            for step in s.steps
            if (a := step.current(Phase.FORWARD)) is not None
            and a.status in (AttemptStatus.AUTHORIZED, AttemptStatus.UNKNOWN)
        ]
        if unsettled or (s.discovery is not None and s.discovery.status is AttemptStatus.AUTHORIZED):
            s.phase = RunPhase.SETTLING
            return None
        s.discovery = None
        for found in s.steps:
            if found.omitted_result is not None and found.status is not StepStatus.COMPLETED:
                # its callback ran and succeeded with a result too large to record (decisions 25): accepted, so
                # it is undone in its place, also when a retry the operator allowed had not settled
                self.edit(found).status = StepStatus.COMPLETED
        completed = sorted(  # a durable wait is no effect: nothing to undo (decision 31)
            (step for step in s.steps if step.status is StepStatus.COMPLETED and not step.sleep),
            key=lambda st: st.completed_seq or 0,
            reverse=True,
        )
        if not completed:
            return self.finish(Recovery.NOT_REQUIRED)
        # the plan: its entries say pending; the steps themselves are left as they are (a step in the unwind
        # whose compensation_status is still none is pending), so starting the unwind copies no step
        s.set_unwind([UnwindEntry(step_id=step.id) for step in completed])
        s.phase = RunPhase.COMPENSATING
        s.recovery = Recovery.COMPENSATING
        self.advance_unwind()

    def current_unwind_entry(self) -> UnwindEntry | None:
        return self.s.current_unwind_entry()

    def advance_unwind(self) -> None:
        entry = self.current_unwind_entry()
        if entry is None:
            return self.finish(Recovery.COMPENSATED)
        step = self.step(entry.step_id)
        assert step is not None
        current = step.current(Phase.COMPENSATION)
        if current is not None and current.status in LIVE_ATTEMPT:
            return None
        self.queue_attempt(step, Phase.COMPENSATION)
        return None

    # ---- stop intent --------------------------------------------------------------

    def enforce_deadline(self) -> None:
        """The deadline holds at authorization (decisions 26): once it has passed, whatever event comes first
        (a task's message, a callback's answer, a completing pass, an operator) records the stop intent before
        it is decided, so no forward work is authorized at or after the deadline and a pass that completes the
        run after it ends ``timed_out``. The deadline's timer only makes sure an idle run learns of it."""
        s = self.s
        if s.deadline_at is not None and s.outcome is None and self.now >= s.deadline_at:
            self.stop(StopRequested(kind="timeout", reason="the deadline had passed when the run next moved"))
            self.stopped_here = True

    def stop(self, event: StopRequested) -> None:
        s = self.s
        kind = StopKind.CANCEL if event.kind == "cancel" else StopKind.TIMEOUT
        if s.stop_intent is not None:
            if not self.stopped_here:
                self.reemit_queued()  # a retried cancel may follow one whose sends failed after its write
            return self.ignore("the stop intent is already recorded")
        if s.phase is RunPhase.FINISHED or s.outcome is not None:
            if event.kind == "cancel":
                self.reject(
                    "run_not_cancellable",
                    f"the run is {s.phase}" + (f" with outcome {s.outcome}" if s.outcome else ""),
                )
            return self.ignore("the run already has an outcome")
        if kind is StopKind.TIMEOUT and (s.deadline_at is None or self.now < s.deadline_at):
            return self.ignore("the deadline has not passed")
        s.stop_intent = StopIntent(kind=kind, at=self.now, reason=event.reason)
        s.outcome = Outcome.CANCELLED if kind is StopKind.CANCEL else Outcome.TIMED_OUT
        self.touch()
        self.clear_definition_blockers()  # they blocked forward work, which the stop ends
        if s.discovery is not None and s.discovery.status is AttemptStatus.QUEUED:
            s.discovery = None  # S3: fenced before start authorization
        elif s.discovery is not None:
            s.discovery = None  # S4: its report will be discarded
        for found in s.steps:
            current = found.current(Phase.FORWARD)
            if current is not None and current.opened_a_step and found.status is StepStatus.PENDING:
                # blocked by a callback that opened a step (decisions 23): it ran and failed, and no retry follows
                step = self.edit(found)
                step.status = StepStatus.FAILED
                assert current.error is not None
                self.record_step_error(step, current.error)
                continue
            if current is not None and current.status is AttemptStatus.AUTHORIZED and current.waiting_since:
                step = self.edit(found)  # decision 32: a waiting step is fenced; no completion is taken after
                current = step.current(Phase.FORWARD)
                assert current is not None
                detail = "fenced by the stop intent while waiting for completion"
                self.settle(current, AttemptStatus.FENCED, detail=detail)
                step.status = StepStatus.FENCED
                continue
            if current is None or current.status not in (AttemptStatus.UNKNOWN, AttemptStatus.QUEUED):
                continue
            step = self.edit(found)
            current = step.current(Phase.FORWARD)
            assert current is not None
            if current.status is AttemptStatus.UNKNOWN and current.retry_at is not None:
                current.retry_at = None  # its retry can no longer start: it blocks, like any Unknown (decisions 19)
                current.detail = (current.detail or "").split("; retried at", 1)[0]
                self.block_on_unknown(step, current)
            if current.status is AttemptStatus.QUEUED:
                self.settle(
                    current, AttemptStatus.FENCED, detail="fenced by the stop intent before start authorization"
                )
                if step.status is not StepStatus.COMPLETED:
                    step.status = StepStatus.FENCED
        self.evaluate_recovery()

    # ---- operator resolution ----------------------------------------------------------

    def resolve(self, event: Resolve) -> None:
        s = self.s
        step = self.step(event.step_id)
        attempt = step.attempt(event.phase, event.generation) if step else None
        if step is None:
            return self.reject("step_not_found", f"the run has no step {event.step_id!r}")
        if attempt is None:
            return self.reject(
                "attempt_not_found", f"step {event.step_id!r} has no {event.phase} generation {event.generation}"
            )
        current = step.current(event.phase)
        if attempt is current and self.blocked_compensation(step, attempt):
            return self.resolve_blocked_compensation(step, event)
        if current is not None and self.blocked_compensation(step, current) and self.fenced_since(step, attempt):
            # the probe fenced a newer generation after the operator read this one: none of them ran, and the
            # decision is about the step's blocked compensation, so it is taken (once: it ends the blocker)
            return self.resolve_blocked_compensation(step, event)
        if (
            event.action == "retry"
            and attempt.phase is Phase.COMPENSATION
            and attempt.status is AttemptStatus.FENCED
            and attempt.resolution is None
            and current is not None
            and current is not attempt
            and current.status is AttemptStatus.QUEUED
            and s.phase is RunPhase.COMPENSATING
        ):
            # a wake queued the next generation before the operator's retry of this fenced one: the consent is
            # recorded here, and the queued generation runs with it (nothing held it back once it is delivered)
            attempt.resolution = Resolution(action="retry", at=self.now, reason=event.reason, by=event.by)
            self.touch()
            return self.ignore(f"retry consented: generation {current.generation} is queued")
        if event.action == "skip" and not self._same_resolution(attempt, event, step):
            return self.reject(
                "skip_not_allowed",
                "only a compensation the unwind is blocked on (compensation_target_not_reached, or another definition"
                " blocker of the unwind) can be skipped; succeed or fail states what an attempt did",
            )
        if attempt.resolution is not None and attempt.status is not AttemptStatus.UNKNOWN:
            if self._same_resolution(attempt, event, step):
                self.reemit_queued()  # a retried request may follow one whose sends failed after its write
                return self.ignore("resolution already applied")
            return self.reject(
                "generation_settled",
                f"generation {event.generation} was already resolved by an operator ({attempt.resolution.action})",
            )
        held_attempt = attempt.opened_a_step and step.status is not StepStatus.COMPLETED
        if held_attempt or (attempt is self.last_ran(step, event.phase) and self.result_omitted(step, attempt)):
            # (an older attempt that opened a step, too: after a rollback the blocker names the one of its build)
            if current is not None and current is not attempt and current.status in LIVE_ATTEMPT:
                # a later generation has not settled: it is the one to wait for, or to resolve if Unknown
                return self.reject(
                    "attempt_in_flight",
                    f"generation {current.generation} is {current.status}: wait for its outcome or resolve it first",
                )
            return self.resolve_held(step, attempt, event)
        # idempotency: the same resolution repeated
        if attempt.status in (AttemptStatus.QUEUED, AttemptStatus.AUTHORIZED):
            return self.reject(
                "attempt_not_unknown",
                f"generation {event.generation} is {attempt.status}, not unknown: wait for its outcome or its lease",
            )
        if attempt.status is not AttemptStatus.UNKNOWN:
            if self._same_resolution(attempt, event, step):
                self.reemit_queued()  # a retried request may follow one whose sends failed after its write
                return self.ignore("resolution already applied")
            return self.reject(
                "generation_settled", f"generation {event.generation} is already {attempt.status}; nothing to resolve"
            )
        if attempt is not current:
            return self.reject("generation_not_current", f"generation {event.generation} is not the current one")
        if event.action == "retry":
            if event.phase is Phase.FORWARD and self.stopping:
                return self.reject("retry_after_stop", "a stop intent exists: no new forward attempt is allowed")
            if s.phase is RunPhase.FINISHED:
                return self.reject("run_finished", "the run is finished")
            self.clear_blockers_for(step, attempt)
            self.settle(attempt, AttemptStatus.RETRY_AUTHORIZED, detail="operator retry")
            attempt.resolution = Resolution(action="retry", at=self.now, reason=event.reason, by=event.by)
            return self.queue_operator_retry(step, event.phase)
        if (too_large := self.supplied_result_too_large(event)) is not None:
            return self.reject(too_large.type, too_large.message)
        self.clear_blockers_for(step, attempt)
        resolution = Resolution(action=event.action, at=self.now, reason=event.reason, by=event.by)
        if event.action == "succeed":
            self.external_completion = True  # the operator states the step's result (decision 32: also external)
            self.apply_outcome(step, attempt, CallbackSucceeded(result=event.result))
        else:
            error = event.error or ErrorInfo(type="declared_failure", message="declared failed by an operator")
            self.attempt_failed(step, attempt, error)
        attempt.detail = f"operator {event.action}"
        attempt.resolution = resolution

    @staticmethod
    def fenced_since(step: StepState, attempt: Attempt) -> bool:
        """``attempt`` is a compensation generation refused before it ran, and so is every one after it, none
        resolved by an operator: all the same blocked compensation."""
        if attempt.phase is not Phase.COMPENSATION:
            return False
        later = [a for a in step.attempts if a.phase is Phase.COMPENSATION and a.generation >= attempt.generation]
        return all(a.status is AttemptStatus.FENCED and a.resolution is None for a in later)

    def blocked_compensation(self, step: StepState, attempt: Attempt) -> bool:
        """This compensation attempt did not run because current code cannot reach its target (decisions 17)."""
        entry = self.current_unwind_entry()
        return (
            attempt.phase is Phase.COMPENSATION
            and attempt.status is AttemptStatus.FENCED
            and self.s.phase is RunPhase.COMPENSATING
            and self.s.blocked_by_definition
            and entry is not None
            and entry.step_id == step.id
        )

    def resolve_blocked_compensation(self, step: StepState, event: Resolve) -> None:
        """An operator moves a blocked unwind on: retry with current code, or state the compensation's outcome.

        The fenced generation stays as it settled; the operator's outcome is recorded as the next generation.
        """
        if event.action == "succeed" and (too_large := self.oversized_compensation_result(event.result)):
            return self.reject(too_large.type, too_large.message)
        self.clear_definition_blockers()
        if event.action == "retry":
            fenced = step.current(Phase.COMPENSATION)
            assert fenced is not None
            fenced.resolution = Resolution(action="retry", at=self.now, reason=event.reason, by=event.by)
            self.queue_attempt(step, Phase.COMPENSATION)
            return None
        resolved = self.new_attempt(step, Phase.COMPENSATION)
        resolved.resolution = Resolution(action=event.action, at=self.now, reason=event.reason, by=event.by)
        if event.action == "succeed":
            self.compensation_outcome(step, resolved, CallbackSucceeded(result=event.result))
        elif event.action == "skip":  # the operator's decision, counted apart in the summary (decisions 24)
            self.settle(resolved, AttemptStatus.SUCCEEDED)
            step.compensation_status = CompensationStatus.SKIPPED
            self.set_unwind_status(step.id, CompensationStatus.SKIPPED)
            self.advance_unwind()
        else:
            error = event.error or ErrorInfo(type="declared_failure", message="declared failed by an operator")
            self.attempt_failed(step, resolved, error)
        resolved.detail = f"operator {event.action}"
        return None

    def queue_operator_retry(self, step: StepState, phase: Phase) -> None:
        """An operator's consented retry: the step's phase is pending again, and its next generation is queued."""
        if phase is Phase.FORWARD:
            step.status = StepStatus.PENDING
            self.rejoin_group(step)
        else:
            step.compensation_status = CompensationStatus.PENDING
            self.set_unwind_status(step.id, CompensationStatus.PENDING)
        self.queue_attempt(step, phase)

    def rejoin_group(self, step: StepState) -> None:
        """A step declared together with others runs again by an operator's consent (decision 30): it is its
        group's again, so the discovery after the group waits for it (the group starts nothing else)."""
        s = self.s
        i = s.step_index(step.id)
        if step.group is None or i is None:
            return
        if s.group is not None and s.group != step.group:
            step.group = s.group  # an older group's: it counts in the group that runs now, and is waited for
        if s.group is None:
            s.group, s.max_parallel, s.group_order, s.group_next = step.group, None, None, len(s.steps)
            s.group_live, s.group_halted = [], True
        if i not in s.group_live:
            s.group_live = [*s.group_live, i]
        self.touch()

    def supplied_result_too_large(self, event: Resolve) -> ErrorInfo | None:
        """Why an operator's ``succeed`` cannot be recorded (over the value limit, or the run's), or None."""
        if event.action != "succeed":
            return None
        if event.phase is Phase.FORWARD:
            return self.oversized_result(event.result)
        return self.oversized_compensation_result(event.result)

    def resolve_held(self, step: StepState, attempt: Attempt, event: Resolve) -> None:
        """An operator moves on a run blocked by an attempt whose callback ran but whose outcome the engine could
        not take: it opened a step inside it (decisions 23), or returned too much (25). Retry is consent to run the
        callback again; succeed or fail states the outcome of the callback that ran, recorded as the next
        generation."""
        if event.action == "skip":
            return self.reject("skip_not_allowed", "only a blocked compensation can be skipped")
        if event.phase is Phase.FORWARD and self.stopping:
            if event.action == "retry":
                return self.reject("retry_after_stop", "a stop intent exists: no new forward attempt is allowed")
            return self.reject("generation_settled", f"generation {event.generation} is failed and the run is stopping")
        if self.s.phase is RunPhase.FINISHED:
            return self.reject("run_finished", "the run is finished")
        if (too_large := self.supplied_result_too_large(event)) is not None:
            return self.reject(too_large.type, too_large.message)
        self.clear_definition_blockers()
        resolution = Resolution(action=event.action, at=self.now, reason=event.reason, by=event.by)
        attempt.resolution = resolution
        if step.omitted_result is not None and event.action == "fail":
            step.omitted_result, step.completed_seq = None, None  # the operator says it did nothing to undo
        self.touch()
        if event.action == "retry":
            return self.queue_operator_retry(step, event.phase)
        resolved = self.new_attempt(step, event.phase)
        if event.action == "succeed":
            self.external_completion = True  # the operator states the step's result (decision 32: also external)
            self.apply_outcome(step, resolved, CallbackSucceeded(result=event.result))
        else:
            error = event.error or ErrorInfo(type="declared_failure", message="declared failed by an operator")
            self.attempt_failed(step, resolved, error)
        resolved.detail = f"operator {event.action}"
        resolved.resolution = resolution
        return None

    def _same_resolution(self, attempt: Attempt, event: Resolve, step: StepState) -> bool:
        if attempt.status is AttemptStatus.FENCED and attempt.phase is Phase.COMPENSATION:
            # a blocked compensation's resolution is the generation after it (resolve_blocked_compensation)
            # (past any newer generation the probe fenced before the operator's decision: fenced_since)
            following = step.attempt(attempt.phase, attempt.generation + 1)
            while following is not None and following.status is AttemptStatus.FENCED and following.resolution is None:
                following = step.attempt(attempt.phase, following.generation + 1)
            if following is None:
                return False
            if event.action == "retry":
                return False  # a retry is recorded on the fenced attempt itself (checked before this)
            attempt = following
        if event.action == "skip":
            return attempt.resolution is not None and attempt.resolution.action == "skip"
        if attempt.resolution is not None and attempt.status is not AttemptStatus.FENCED:
            if attempt.resolution.action != event.action:
                return False
            if event.action == "succeed":
                following = step.attempt(attempt.phase, attempt.generation + 1)
                settled = following if following is not None and following.resolution == attempt.resolution else None
                recorded = step.result if attempt.phase is Phase.FORWARD else step.compensation_result
                return (settled or attempt).status is AttemptStatus.SUCCEEDED and recorded == event.result
            return True
        if attempt.detail is None or not attempt.detail.startswith("operator"):
            return False
        if event.action == "retry":
            return attempt.status is AttemptStatus.RETRY_AUTHORIZED
        if event.action == "succeed":
            result: Any = step.result if attempt.phase is Phase.FORWARD else step.compensation_result
            return attempt.status is AttemptStatus.SUCCEEDED and result == event.result
        return attempt.status is AttemptStatus.FAILED

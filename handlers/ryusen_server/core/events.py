"""Events the core decides on, the commands it returns, and its settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from ryusen._internal.wire import (
    MAX_VALUE_BYTES,
    AttemptResponse,
    DiscoveryResponse,
    ErrorInfo,
    Phase,
    RetryPolicyWire,
)

from .model import DeadlineSource, RunState, TaskRef, TimerRef

# ---- settings ----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSettings:
    """Defaults of decisions 6.8; every one is a setting, tests shorten them."""

    forward_retry: RetryPolicyWire = field(
        default_factory=lambda: RetryPolicyWire(max_attempts=4, initial_delay_s=1.0, backoff=2.0, max_delay_s=300.0)
    )
    compensate_retry: RetryPolicyWire = field(
        default_factory=lambda: RetryPolicyWire(max_attempts=10, initial_delay_s=1.0, backoff=2.0, max_delay_s=600.0)
    )
    attempt_timeout_s: float = 300.0
    max_attempt_timeout_s: float | None = None
    """The longest attempt timeout (forward or compensation) a step may declare; a deployment sets it (an
    attempt's lease must fit what its dispatcher can hold). A step declaring more is an ``invalid_step``
    blocker: refused, never clamped. None: no maximum (the local server)."""
    lease_grace_s: float = 60.0
    """How long past an attempt's response window a late result is waited for before the lease expires."""
    acknowledged_lease_grace_s: float = 3.0
    """The same for an attempt of a release that acknowledges (``ReleaseRef.acknowledges``): its dispatcher has
    stopped waiting, and the outcome comes through the result path as soon as the callback ends; this covers
    the post and its write."""
    probe_initial_s: float = 60.0
    probe_max_s: float = 3600.0
    stalled_task_s: float = 60.0
    """A task still queued this long past its due time has probably lost its message (see reemit_stalled)."""
    lease_watch_grace_s: float = 900.0
    """How long past an attempt's lease a message that does not carry the attempt (a stale message, a duplicate
    of its task, the sweeper) waits before it takes the attempt's outcome as lost. The message that carries it
    (:func:`carrier_of`: the one whose delivery authorized it, kept as its lease timer) acts at the lease. A
    dispatcher that defers an answer while the store will not take it deletes its message: the deferred answer
    is then the attempt's only carrier, and this grace is how long a store outage may last before another
    message could take that attempt as Unknown while its answer waits on the queue."""
    redelivery_initial_s: float = 1.0
    redelivery_max_s: float = 60.0
    max_value_bytes: int = MAX_VALUE_BYTES
    """Each JSON value: run input, step result, error, run output (decisions 6.11)."""
    max_run_bytes: int = 4 * 1024 * 1024
    """The run input and its accepted step results together: what every task request replays."""
    unstable_after: int = 3
    """Steps announced at one location and abandoned without an outcome, one after another (a random or
    time-based id), before a pass that announces one more there is blocked with ``unstable_step_id``."""
    max_steps: int = 1000
    """Distinct step ids one run may reach; discovery reaching one more fails the run (``too_many_steps``)."""
    endpoint_failing_after: int = 5
    """Failed deliveries of one task in a row (nothing sent, or a lost discovery) before the run shows an
    ``endpoint_failing`` blocker; the retries go on regardless."""
    stale_submissions_kept: int = 20
    """Stale submissions recorded per attempt; later ones are only counted."""
    stale_result_kept_bytes: int = 4 * 1024
    """A stale submission's result is kept when at most this big; otherwise its size and digest."""


# ---- events ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StartRun:
    run_id: str
    app_id: str
    function_id: str
    input: Any
    idempotency_key: str | None = None
    deadline_at: datetime | None = None
    deadline_source: DeadlineSource = DeadlineSource.NONE
    secret: str | None = None
    """What the run's completion tokens are made with (decision 32): random, drawn by the engine, kept with the
    run (so a token outlives a key rotation and a ``ryusen dev`` restart), never shown."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseRef:
    release_id: str
    build_id: str
    acknowledges: bool = False
    """The release's SDK answers a long attempt ``accepted`` and posts its outcome (the ``acknowledge`` feature):
    no dispatcher waits, so the attempt's lease ends a short grace past its response window
    (``acknowledged_lease_grace_s``), not ``lease_grace_s`` past it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskDelivered:
    """A dispatch message arrived; ``release`` is the function's newest release (None if none)."""

    task: TaskRef
    release: ReleaseRef | None
    delivery_id: str | None = None
    """Names this delivery: a re-decision after a lost race recognises the authorization it wrote itself."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscoveryReported:
    seq: int
    response: DiscoveryResponse
    chain: ReleaseRef | None = None
    """The dispatcher can invoke the next task now, with this release: authorize it in this same write."""
    delivery_id: str | None = None
    """Names the chained authorization: a re-decision after a lost race (the write committed, its reply was
    lost, another write landed) recognises the task it authorized itself and invokes it."""
    claims: tuple[str, ...] = ()
    """Set by the receiver of a deferred answer: the delivery ids of the dispatchers that deferred it (the
    first, and any receiver that deferred it again). A task one of them authorized and never saw confirmed
    was never sent: it becomes this delivery's, re-authorized in this write (so that of two receivers of the
    same answer, one invokes it), however long ago its lease ran out."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptReported:
    step_id: str
    phase: Phase
    generation: int
    response: AttemptResponse
    source: Literal["response", "late_submission", "completion"] = "response"
    next: DiscoveryResponse | None = None
    """What the replay found after a successful callback (continuation): recorded in this same write."""
    chain: ReleaseRef | None = None
    """The dispatcher can invoke the next task now, with this release: authorize it in this same write."""
    delivery_id: str | None = None
    """Names the chained authorization: a re-decision after a lost race (the write committed, its reply was
    lost, another write landed) recognises the task it authorized itself and invokes it."""
    claims: tuple[str, ...] = ()
    """Set by the receiver of a deferred answer: the delivery ids of the dispatchers that deferred it (the
    first, and any receiver that deferred it again). A task one of them authorized and never saw confirmed
    was never sent: it becomes this delivery's, re-authorized in this write (so that of two receivers of the
    same answer, one invokes it), however long ago its lease ran out."""


class InvocationFailure(StrEnum):
    UNREACHABLE = "unreachable"
    """Nothing was sent (connection refused): the callback provably did not run."""
    LOST = "lost"
    """The request was sent and no well-formed, correctly signed result came back."""


@dataclass(frozen=True, slots=True, kw_only=True)
class InvocationFailed:
    task: TaskRef
    failure: InvocationFailure
    detail: str
    delivery_id: str | None = None
    """Given, the failure is about the task as that delivery authorized it, and only then (a dispatcher
    that never saw its authorization's write confirmed says it never sent it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WakeRequested:
    """Rediscover with current code: a release sync, the probe, or an operator."""

    source: Literal["release_sync", "probe", "operator"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepRequested:
    """The sweeper found the run's work overdue (``RunState.work_due_at``): whatever should have moved it (a
    task's message, the deadline's or the probe's schedule) may be lost. Decided as the lost message or timer
    would have been; a duplicate of anything still on its way is harmless."""

    messages_lost: bool = False
    """Every message of the run is known to be lost (a store brought back without its queue: ``ryusen dev``'s
    data directory): each queued task is sent again now, not only one well past its due time."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StopRequested:
    """Cancellation (an operator) or the run deadline (its timer)."""

    kind: Literal["cancel", "timeout"]
    reason: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Resolve:
    """An operator's resolution of one attempt (contract 2)."""

    step_id: str
    phase: Phase
    generation: int
    action: Literal["succeed", "fail", "retry", "skip"]
    """``skip`` only for a compensation the unwind is blocked on because no pass reached it (decisions 24)."""
    result: Any = None
    error: ErrorInfo | None = None
    reason: str | None = None
    """Why the operator decided so (kept on the attempt: decisions 28)."""
    by: str | None = None
    """Who resolved it, where the API knows (the caller's identity on AWS)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatReported:
    """A running callback's heartbeat (decision 33): the attempt is alive; ``details`` are shown on it."""

    step_id: str
    phase: Phase
    generation: int
    details: Any = None
    seq: int = 0
    """The heartbeat's number for its attempt (``Heartbeat.seq``): one not above the last taken is ignored."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StartMayBeLost:
    """An attempt was authorized (its callback may have run) after the last state the store kept: a ``ryusen dev``
    that was killed between its periodic saves. The attempt's outcome cannot be known: it is Unknown, never
    authorized again as if it had not started."""

    task: TaskRef
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletionReported:
    """A step completed from outside (decision 32): the result (or the error) its completion token brought, for
    the attempt the token names. Fenced like a late result: only the current, unsettled generation takes it."""

    step_id: str
    phase: Phase
    generation: int
    result: Any = None
    error: ErrorInfo | None = None
    source: str = "completion"


Event = (
    StartRun
    | StartMayBeLost
    | CompletionReported
    | HeartbeatReported
    | TaskDelivered
    | DiscoveryReported
    | AttemptReported
    | InvocationFailed
    | WakeRequested
    | SweepRequested
    | StopRequested
    | Resolve
)

# ---- commands ----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class EnqueueTask:
    task: TaskRef
    delay_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class InvokeTask:
    """Invoke the user endpoint for an authorized task (after the write commits)."""

    task: TaskRef


@dataclass(frozen=True, slots=True, kw_only=True)
class RedeliverLater:
    """Keep the delivered message and let it come back after ``delay_s`` (the lease timer)."""

    delay_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleTimer:
    timer: TimerRef


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelTimer:
    """A timer that will not be needed (a deadline of a run that finished first)."""

    timer: TimerRef


Command = EnqueueTask | InvokeTask | RedeliverLater | ScheduleTimer | CancelTimer


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejection:
    """A request the core refuses; ``code`` is returned by the API with a 409."""

    code: str
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    state: RunState
    commands: tuple[Command, ...] = ()
    changed: bool = False
    rejection: Rejection | None = None
    note: str | None = None
    """Why nothing changed (a stale delivery, a duplicate message): for logs and the UI."""

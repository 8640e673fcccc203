"""The engine service: load a run, let the core decide, write once, carry out commands.

Every public method is one flow of engineering.md's picture: read the run,
``decide``, write the new state with one conditional write on the version it
was decided from (a lost race re-reads and decides again), then send the
commands. Handlers (Lambda, ``ryusen dev``, ``ryusen.testing``) only call it.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import logging
import math
import random
import re
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from ryusen._internal.signing import (
    PREVIOUS_KEY_WINDOW_S,
    SIGNATURE_HEADER,
    Scope,
    Signature,
    SignatureError,
    answer_binding,
    app_key,
    key_id,
    parse,
    sign,
    split_keys,
    url_path,
    verify,
)
from ryusen._internal.wire import (
    COMPLETION_TOKEN_PREFIX,
    LAMBDA_EVENT,
    LAMBDA_EVENT_MARKER,
    LAMBDA_FUNCTION_ARN,
    MAX_HEARTBEAT_DETAILS_BYTES,
    MAX_ID_LENGTH,
    NESTED_STEP_ERROR,
    CompletionPost,
    DiscoveryResponse,
    ErrorInfo,
    Heartbeat,
    HeartbeatReply,
    LateResult,
    Manifest,
    MemoBase,
    MemoEntry,
    OperationInfo,
    Phase,
    TaskKind,
    TaskRequest,
    TaskResponse,
    completion_binding,
    completion_scope,
    encode_request,
    heartbeat_scope,
    json_value_problem,
    late_result_scope,
    task_scope,
    value_size,
)

from .core.decide import COMPLETION_REFUSED, decide
from .core.events import (
    AttemptReported,
    CancelTimer,
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
from .core.model import (
    RESULT_FUNCTION_CARRIER,
    RESULT_FUNCTION_EVENTS_CARRIER,
    Attempt,
    AttemptStatus,
    DeadlineSource,
    RunPhase,
    RunState,
    StepState,
    TaskRef,
    TimerKind,
    TimerRef,
    delivery_id_for,
)
from .core.view import memo
from .deferred import DeferredAnswer, DeferredEvent, WakeOrder
from .ports import (
    CHECK_HORIZON_S,
    ConflictError,
    EventInvoker,
    InvalidRequestError,
    Invoker,
    InvokeResult,
    NotFoundError,
    PayloadTooLargeError,
    Release,
    RunExistsError,
    RunStore,
    ServerError,
    StoreUnavailableError,
    TaskQueue,
    TimerService,
    VersionConflictError,
)

log = logging.getLogger("ryusen.engine")

_Posted = TypeVar("_Posted", LateResult, Heartbeat, CompletionPost)
"""What an SDK posts to the result URL unasked."""

MAX_RACES = 50
RUN_LOCK_STRIPES = 64
WAKES_PER_MESSAGE = 100
"""Blocked runs one wake message wakes; more are woken by the next (the index lists those still blocked)."""
MAX_DEFERRAL_DELAY_S = 30.0
"""The longest a deferred answer waits before it is tried again: once the store takes writes again it is
recorded within this long, well inside the sweeper's grace past an attempt's lease."""
RESPONSE_GRACE_FRACTION = 0.1
RESPONSE_GRACE_MIN_S = 0.5
RESPONSE_GRACE_MAX_S = 2.0
MAX_MANIFEST_FUNCTIONS = 200
"""The most functions one release (one app's manifest) may declare."""
MAX_MANIFEST_BYTES = 128 * 1024
"""The largest manifest a release is recorded from (its JSON): room for ``MAX_MANIFEST_FUNCTIONS`` functions
with the longest ids, and well under one store item (DynamoDB's 400 KB)."""
MAX_LATE_RESULT_BYTES = 1024 * 1024
MAX_HEARTBEAT_BYTES = 16 * 1024
"""The largest heartbeat body accepted (its details are at most ``MAX_HEARTBEAT_DETAILS_BYTES``)."""
"""The largest late result the server reads (a result is at most ``MAX_VALUE_BYTES``; the rest is room)."""
DISPATCH_MARGIN_S = 10.0
"""What a dispatcher keeps of its time budget to record an answer after it arrives."""
MIN_DISPATCH_BUDGET_S = DISPATCH_MARGIN_S + RESPONSE_GRACE_MAX_S + 3.0
"""A dispatcher with less time left than this does not start a task (the message comes back)."""


STORE_RETRY_FIRST_S = 0.05
STORE_RETRY_MAX_S = 2.0
STORE_RETRY_S = 20.0
"""The default of ``ServerSettings.store_retry_s`` (``RYUSEN_STORE_RETRY_S``)."""
STORE_RETRY_MAX_TRIES = 12
"""At most this many tries of one write (with the backoff, about 15 s at most)."""
STORE_RETRY_RESERVE_S = 3.0
"""What a dispatcher keeps of its time budget, after retrying a write, to defer the answer to the queue."""
MESSAGE_HOLD_MARGIN_S = 30.0
"""Beyond the retries of an answer's write and the time kept to defer it, how long the message in hand is kept
away: it comes back only after this dispatcher has recorded the answer, deferred it, or died."""
STORE_UNAVAILABLE_RETRY_S = 5.0
"""When a message whose work the store refused (nothing was sent) comes back."""
_CARRIER: ContextVar[str | None] = ContextVar("ryusen_carrier", default=None)
"""The identity of the dispatch message the current thread is delivering (``Engine.deliver``'s ``carrier``)."""


@contextlib.contextmanager
def carried_by(carrier: str | None) -> Iterator[None]:
    """Deliveries made within are carried by ``carrier`` (a message's identity): their ids carry its tag."""
    token = _CARRIER.set(carrier)
    try:
        yield
    finally:
        _CARRIER.reset(token)


def new_delivery_id() -> str:
    """A fresh delivery id, tagged with the message being delivered, if any (``core.model.delivery_id_for``)."""
    return delivery_id_for(_CARRIER.get(), uuid.uuid4().hex[:20])


FRONT_END_THROTTLED = 429
"""What a Lambda Function URL (or API Gateway) answers, unsigned, when it throttles a request before any
code runs: nothing was sent to the app, so it is sent again with backoff (never Unknown)."""


def response_grace_s(timeout_s: float) -> float:
    """How long past an attempt's timeout (the ``respond_by`` it gave the SDK) a dispatcher still listens for
    the HTTP answer: a tenth of the timeout, at least 0.5 s and at most 2 s.

    The grace covers an answer already on its way when the timeout is reached (its transfer, and the clocks
    of the server and the app disagreeing a little); an answer that comes later is the SDK's late result. It
    is proportional so that a short timeout means what it says (a 3 s step is Unknown after 3.5 s, not 5 s),
    and capped so that a long one is not stretched either.

    >>> [response_grace_s(t) for t in (1, 3, 12, 300)]
    [0.5, 0.5, 1.2, 2.0]
    """
    return round(min(RESPONSE_GRACE_MAX_S, max(RESPONSE_GRACE_MIN_S, RESPONSE_GRACE_FRACTION * timeout_s)), 3)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Window:
    """An authorized task's lease expiry, when its endpoint must have answered (``respond_by``), and the
    timeout that set it: its length and what declared it (for an Unknown's detail)."""

    lease_at: datetime
    respond_by: datetime
    timeout_s: float
    timeout_name: str

    @property
    def grace_s(self) -> float:
        return response_grace_s(self.timeout_s)

    def no_response(self) -> str:
        """The detail of an attempt that had no answer within its window."""
        return f"no response within {self.timeout_name} of {self.timeout_s:g}s (+{self.grace_s:g}s grace)"


def _window(state: RunState, task: TaskRef, settings: EngineSettings) -> _Window:
    default = "the server's attempt timeout"
    if task.kind is TaskKind.DISCOVER:
        d = state.discovery
        assert d is not None and d.authorized_at is not None and d.lease_expires_at is not None
        timeout_s = settings.attempt_timeout_s
        respond_by = d.authorized_at + timedelta(seconds=timeout_s)
        return _Window(lease_at=d.lease_expires_at, respond_by=respond_by, timeout_s=timeout_s, timeout_name=default)
    assert task.step_id is not None and task.phase is not None and task.generation is not None
    step = state.step(task.step_id)
    attempt = step.attempt(task.phase, task.generation) if step else None
    assert step is not None and attempt is not None
    assert attempt.lease_expires_at is not None and attempt.respond_by is not None
    assert attempt.authorized_at is not None
    forward = task.phase is Phase.FORWARD
    declared = step.timeout_s if forward else step.compensate_timeout_s
    name = default if declared is None else "the step's timeout" if forward else "the step's compensate_timeout"
    return _Window(
        lease_at=attempt.lease_expires_at,
        respond_by=attempt.respond_by,
        timeout_s=(attempt.respond_by - attempt.authorized_at).total_seconds(),  # what authorize() gave it
        timeout_name=name,
    )


NOTHING_RAN_ANYWHERE = frozenset(
    {"invalid_signature", "invalid_task_request", "method_not_allowed", "request_too_large"}
)
"""Signed refusals that mean no instance of the endpoint runs this request: its signature does not verify
with the app's keys (not the request the engine sent, or a key the endpoint does not hold yet), or it is not
a task request. Anything else signed and not a 200 leaves the outcome not known."""


def _authorizing_delivery(state: RunState, task: TaskRef) -> str | None:
    """The delivery id that authorized ``task`` in ``state`` (the state it was invoked from)."""
    if task.kind is TaskKind.DISCOVER:
        return state.discovery.delivery_id if state.discovery is not None else None
    step = state.step(task.step_id) if task.step_id is not None else None
    attempt = step.attempt(task.phase, task.generation) if step and task.phase and task.generation else None
    return attempt.delivery_id if attempt is not None else None


def _front_end_refusal(headers: dict[str, str]) -> bool:
    """The answer carries the mark AWS's front ends (a Lambda Function URL, API Gateway) put on a request they
    refused before any code ran: ``x-amzn-ErrorType: TooManyRequestsException``. A 429 without it (a proxy
    of yours, a load balancer) may come after the app ran, and is not known to mean nothing ran."""
    for name, value in headers.items():
        if name.lower() == "x-amzn-errortype":
            return value.split(":", 1)[0].strip() == "TooManyRequestsException"
    return False


def _signed(result: Any) -> bool:
    return any(name.lower() == SIGNATURE_HEADER.lower() for name in result.headers)


def _error_code(body: bytes) -> str:
    """The ``error.code`` of an endpoint's refusal ("?" if it has none)."""
    try:
        code = json.loads(body[:4096])["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return "?"
    return code if isinstance(code, str) and code.isascii() and len(code) <= 64 else "?"


SWEEP_GRACE_S = 300.0
"""How long past its due time a run's work must be before the sweeper repairs it (well past a message's
normal delay, so the sweeper does not race what is still on its way; a duplicate would be harmless)."""
SWEEP_LIMIT = 500
"""Runs the sweeper asks the index for at a time; a pass asks again until no run is due or its budget is spent."""
SWEEP_BUDGET_S = 40.0
"""How long one sweeper pass keeps looking at due runs (the sweep function runs every minute, for up to 60 s);
the next pass takes the rest."""
SWEEP_BACKOFF_MAX_S = 86_400.0
"""The longest the sweeper leaves an unfinished run without a look: a run unchanged for a while is looked at
again after as long as it has been unchanged (at least ``CHECK_HORIZON_S``), at most this long. It must stay
well under the store's renewal margin (``aws.store.RENEW_MARGIN_S``)."""


@dataclass(slots=True)
class SweepReport:
    checked: int = 0
    repaired: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    """Runs that could not be looked at (an error, logged); they come first again next pass."""


@dataclass(frozen=True, slots=True)
class Sent:
    """A signed request as sent: its scope and signature, and the app's keys, which its answer must be signed
    with as the answer to it."""

    scope: Scope
    header: str
    signature: Signature
    body: bytes
    keys: tuple[str, ...]


RELEASE_RECHECK_S = 1.0
"""The default of ``ServerSettings.release_recheck_s`` (``RYUSEN_RELEASE_RECHECK_S``)."""
ACKNOWLEDGE_AFTER_S = 0.1
"""The default of ``ServerSettings.acknowledge_after_s`` (``RYUSEN_ACKNOWLEDGE_AFTER_S``)."""
RESULT_CARRY_ON_S = 10.0
"""How long the result function goes on with a run after recording an outcome (invoking and recording the tasks
it authorizes, as a dispatcher chains) before it leaves the rest to the queue: the SDK's post waits for it."""
INLINE_UP_TO_S = 0.05
"""The default of ``ServerSettings.inline_up_to_s`` (``RYUSEN_INLINE_UP_TO_S``): where waiting costs what an event
saves, measured (docs/design/dispatch.md, way C item 6). A step waited for costs about $1.43 per million steps
plus a 512 MB dispatcher's time, $6.67 per million steps a second (the step and about 17 ms of its own work); one
sent as an event costs about $1.89, and nothing a second (bench/cost.py, 20-step runs, 2026-12-06). They meet
near 0.07 s; 0.05 s errs on the side of events, which never hold a dispatcher. (It was 0.25 s when an event
carried a lease timer of its own and cost about $2.5 more.)"""
INLINE_UP_TO_MAX_S = 1.0
"""The most ``inline_up_to_s`` may be: under ``INLINE_LISTEN_S`` less the SDK's late margin (1 s), so that an
answer as quick as the setting allows is never also posted as a late result."""
INLINE_LISTEN_S = 2.0
"""How long an attempt sent inline because its step has been quick (``inline_up_to_s``) is listened for. A callback
that runs longer this time posts its outcome to the result URL (its response window is this), and the message
watches its lease, as for an attempt sent as an event; so a step that is slow for once holds a dispatcher about
this long, not for its timeout."""
INLINE_LISTEN_GRACE_S = 0.25
"""How long past ``INLINE_LISTEN_S`` such an attempt's answer is still waited for."""
STEP_DURATIONS_KEPT = 5
"""How many recent attempts of a step ``StepDurations`` keeps."""
STEP_DURATIONS_NEEDED = 3
"""How many of them must have been seen, all within ``inline_up_to_s``, before an attempt goes inline."""
STEP_DURATIONS_LOOK_BACK = 16
"""How many of a run's newest steps a read of it is learned from (a step's durations, ``StepDurations.learn``)."""
SCHEDULED_LEASE_FROM_S = 60.0
"""The default of ``ServerSettings.scheduled_lease_from_s`` (``RYUSEN_SCHEDULED_LEASE_FROM_S``): an event's lease is
its timeout and a minute's grace, so any event's, and ``scheduled_lease_share`` decides."""
SCHEDULED_LEASE_SHARE = 4.0
"""The default of ``ServerSettings.scheduled_lease_share``."""
SCHEDULER_LATENESS_S = 60.0
"""EventBridge Scheduler delivers a one-time schedule within about a minute of its time (AWS documents a minute's
precision): a lease watch is due this long before its lease ends (not before now), and one that comes back early
waits on the queue for the rest of the lease, so the attempt is still taken as Unknown at its lease."""
LEASE_TIMER_MAX_DELAY_S = 900.0
"""SQS's longest delay: a lease timer for a longer lease comes back early and is kept until the lease ends."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    engine: EngineSettings = field(default_factory=EngineSettings)
    master_key: str | None = None
    """The deployment's master secret (several, comma-separated: the first signs, any verifies), from which
    each app's signing key is derived (decisions 21). None: no signing (insecure local mode only)."""
    master_keys_source: Callable[[], tuple[str | None, str | None]] | None = None
    """Where the master keys are read from when they are not fixed (a deployment's secret, cached and re-read
    so that a rotation takes effect): (the key to sign with, the one it replaced, still accepted when
    verifying while its window lasts). It wins over ``master_key``."""
    fresh_master_keys_source: Callable[[], tuple[str | None, str | None]] | None = None
    """The same keys, read again now (a few seconds' cache at most): what verifies an unsolicited message (a
    late result, a manifest) uses, so that an emergency rotation refuses the old key at once there."""
    previous_key_window_s: float = PREVIOUS_KEY_WINDOW_S
    """How long after a rotation a key secret's previous key is still accepted (``RYUSEN_PREVIOUS_KEY_WINDOW_S``)."""
    result_url: str | None = None
    """The server's late-result endpoint handed to SDKs (decisions 6.15)."""
    default_run_timeout_s: float | None = None
    max_run_timeout_s: float | None = None
    chain: bool = True
    """One invocation and one write per step: a forward attempt's request asks the SDK to continue its
    replay to the next step, and the write that accepts an answer authorizes the next task, which the same
    dispatcher invokes at once (while its time budget allows)."""
    acknowledge_after_s: float | None = ACKNOWLEDGE_AFTER_S
    """How long a dispatcher waits for an attempt's outcome before the endpoint (a release whose SDK announces
    ``acknowledge``) answers ``accepted`` and posts the outcome to ``result_url`` when its callback ends: no
    dispatcher waits through a long callback (``docs/design/dispatch.md``). None: every attempt is waited for."""
    chain_window_s: float = 60.0
    """The longest one dispatch message keeps chaining before the next task goes through the queue (a Lambda
    also stops at its own time limit): other runs' messages get a dispatcher in turn."""
    release_recheck_s: float = RELEASE_RECHECK_S
    """How long a chaining dispatcher uses the newest release it read before reading it again: after each
    callback it decides from the newest release (R1), and a release synced through another process reaches
    a chain within this long and DynamoDB's replication (the recheck is an eventually consistent read; 0: a
    consistent read after every callback). A sync through this process, and every new dispatch message, is
    seen at once."""
    index_settle_s: float = 0.0
    inline_up_to_s: float = INLINE_UP_TO_S
    """A dispatcher invokes an attempt to a Lambda endpoint that takes events (``lambda_event``) on its URL and
    waits, rather than sending it as an event, when the step's last attempts it has seen (by app, function, step
    name and phase: at least ``STEP_DURATIONS_NEEDED`` of the last ``STEP_DURATIONS_KEPT``) all took at most this
    long: a wait that short costs less than an event's lease timer and result post. It is listened for
    ``INLINE_LISTEN_S`` at most. The result function never does: the SDK's post waits for its carrying on, and
    that time would be billed to the app's Lambda. 0: every attempt of such an endpoint is an event."""
    scheduled_lease_from_s: float | None = SCHEDULED_LEASE_FROM_S
    """An attempt the result function sends as an event with a lease at least this long, after a step that took
    long enough (``scheduled_lease_share``), is watched by a lease timer that can be taken back
    (``TaskQueue.watch_lease``: a Scheduler schedule on AWS), deleted once its outcome is recorded, rather than by
    an SQS message, which cannot be, and which a step of minutes shares with one other step at most. None: SQS
    timers only (docs/design/dispatch.md, "A lease watch that is deleted")."""
    scheduled_lease_share: float = SCHEDULED_LEASE_SHARE
    """... and when the attempt whose outcome was just recorded took at least the new lease divided by this: an
    SQS timer, which watches what is authorized within its lease, would then serve fewer steps than this, and
    cost more than a schedule (a step of a second with a timeout of 10 minutes keeps sharing one SQS timer)."""
    store_retry_s: float = STORE_RETRY_S
    """How long a write the store keeps refusing (throttled past botocore's retries, a 5xx) is tried again
    before the caller gives up for now: a dispatcher then defers the answer it has to the queue (``deferred.py``)
    and a message that sent nothing comes back later. A dispatcher also stops in time to defer the answer
    before its invocation ends."""
    """How long the blocked-runs index may lag the table (a DynamoDB GSI): a release sync looks it up again
    after this long, for a run that blocked just before the sync."""


class _MessageLease:
    """The dispatch message is the lease timer of the task in flight: it must come back (become visible)
    no later than that task's lease expires. The first task's authorization sets its visibility; while
    chaining, it is extended only once less than half of the next task's lease is left of it, so a chain of
    quick steps costs a visibility change now and then, not one per step."""

    def __init__(self, change: Callable[[float], None] | None) -> None:
        self._change = change
        self._covered_until: float | None = None
        self.quick_missed = False
        """A step this delivery waited for on the quick path took longer than it was expected to: the rest of its
        chain goes as events (each step's own history may still say quick, but this endpoint is slow now)."""

    @property
    def from_message(self) -> bool:
        """Whether a received message carries this delivery (a dispatcher's), not the result function's post."""
        return self._change is not None

    def cover(self, lease_s: float) -> None:
        if self._change is None:
            return
        now = time.monotonic()
        if self._covered_until is not None and self._covered_until - now >= lease_s / 2:
            return
        self._change(lease_s)
        self._covered_until = now + lease_s

    def hold(self, seconds: float) -> None:
        """Keep the message away for at least ``seconds`` more: while this dispatcher retries the write of an
        answer it has, the message (the attempt's carrier) must not come back to another dispatcher, which
        would take the attempt as Unknown at its lease before this one records or defers the answer."""
        if self._change is None:
            return
        now = time.monotonic()
        if self._covered_until is not None and self._covered_until - now >= seconds:
            return
        try:
            self._change(seconds)
        except Exception:  # the queue failing too: the retries go on regardless
            log.warning("could not keep the message away while retrying a write", exc_info=True)
            return
        self._covered_until = now + seconds


class StepDurations:
    """How long this process saw the recent attempts of each step take, from authorization to outcome, by app,
    function, step name and phase: what decides whether an attempt to a Lambda endpoint that takes events is sent
    as one, or invoked on its URL and waited for (``ServerSettings.inline_up_to_s``). A guide to cost, never to
    correctness: either way the attempt is fenced, leased and recorded alike. Bounded (least recently seen out)."""

    def __init__(self, capacity: int = 4096) -> None:
        self._capacity = capacity
        self._seen: OrderedDict[tuple[str, ...], list[float]] = OrderedDict()
        self._learned: OrderedDict[tuple[str, str, str, int], None] = OrderedDict()
        """The attempts already learned from (run, step, phase, generation): a run read again adds nothing twice."""
        self._lock = threading.Lock()

    def learn(self, state: RunState) -> None:
        """Learn from the settled attempts (succeeded or failed) of the run's newest steps: how long each took from
        its authorization to its outcome, whoever recorded it (an inline answer, a posted outcome)."""
        for step in state.steps[-STEP_DURATIONS_LOOK_BACK:]:
            for attempt in step.attempts:
                if attempt.status not in (AttemptStatus.SUCCEEDED, AttemptStatus.FAILED):
                    continue
                if attempt.authorized_at is None or attempt.settled_at is None:
                    continue
                seen = (state.id, step.id, attempt.phase.value, attempt.generation)
                with self._lock:
                    if seen in self._learned:
                        continue
                    self._learned[seen] = None
                    while len(self._learned) > self._capacity * STEP_DURATIONS_KEPT:
                        self._learned.popitem(last=False)
                key = self._key(state, step, attempt.phase)
                self.seen(key, (attempt.settled_at - attempt.authorized_at).total_seconds())

    @staticmethod
    def _key(state: RunState, step: StepState, phase: Phase) -> tuple[str, ...]:
        return (state.app_id, state.function_id, step.name or step.id, phase.value)

    @classmethod
    def key(cls, state: RunState, step_id: str, phase: Phase) -> tuple[str, ...] | None:
        step = state.step(step_id)
        return cls._key(state, step, phase) if step is not None else None

    def seen(self, key: tuple[str, ...] | None, seconds: float) -> None:
        if key is None:
            return
        with self._lock:
            recent = self._seen.pop(key, [])
            recent = [*recent, max(0.0, seconds)][-STEP_DURATIONS_KEPT:]
            self._seen[key] = recent
            while len(self._seen) > self._capacity:
                self._seen.popitem(last=False)

    def quick(self, key: tuple[str, ...] | None, up_to_s: float) -> bool:
        if key is None or up_to_s <= 0:
            return False
        with self._lock:
            recent = self._seen.get(key, [])
            return len(recent) >= STEP_DURATIONS_NEEDED and max(recent) <= up_to_s


LEASE_TIMER_SHARE_MARGIN_S = 2.0
"""A lease timer the result function sent watches the attempts it authorizes later only while it is due this long
from now at least: it is then still on the queue when they are authorized, and reads them when it comes back."""


class RunLeaseTimers:
    """The lease timers this process's result function sent, by run: when each is due, and before when it watches
    what a result function authorized (``TaskRef.watches_before``). Bounded (least recently sent out): a run it
    has forgotten gets a timer of its own again. A guide to cost, never to correctness: an attempt goes without a
    timer of its own only while one sent here is surely still on the queue and due before its lease ends."""

    def __init__(self, capacity: int = 4096, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._capacity = capacity
        self._sent: OrderedDict[str, tuple[datetime, datetime, float]] = OrderedDict()
        self._monotonic = monotonic
        self._lock = threading.Lock()

    def watching(self, run_id: str, now: datetime, lease_ends_at: datetime) -> bool:
        """Whether a timer sent here watches an attempt of the run authorized by ``now`` whose lease ends then: it
        is due no later than the attempt's own timer would be (SQS delays by whole seconds, so that is the lease
        rounded up to the second from ``now``). Still on the queue is judged on the monotonic clock too: a wall
        clock stepped back cannot stretch it."""
        with self._lock:
            held = self._sent.get(run_id)
        if held is None:
            return False
        due_at, watches_before, on_queue_until = held
        own_due = now + timedelta(seconds=math.ceil(max(0.0, (lease_ends_at - now).total_seconds())))
        return now <= watches_before and due_at <= own_due and self._monotonic() <= on_queue_until

    def sent(self, run_id: str, due_at: datetime, watches_before: datetime, wait_s: float) -> None:
        on_queue_until = self._monotonic() + wait_s - LEASE_TIMER_SHARE_MARGIN_S
        with self._lock:
            self._sent.pop(run_id, None)
            self._sent[run_id] = (due_at, watches_before, on_queue_until)
            while len(self._sent) > self._capacity:
                self._sent.popitem(last=False)


class ParkedLeaseWatches:
    """The lease watches this process parked (``Engine._watch_lease_by_schedule``), so that it deletes each once its
    outcome is recorded here. Bounded (least recently parked out): a forgotten one is deleted if its step took long,
    else delivered, finds its attempt settled, and is done."""

    def __init__(self, capacity: int = 4096) -> None:
        self._capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, key: str) -> None:
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key)
            while len(self._keys) > self._capacity:
                self._keys.popitem(last=False)

    def parked(self, key: str) -> bool:
        """Whether this process parked ``key`` (and forgets it: it is deleted now)."""
        with self._lock:
            if key not in self._keys:
                return False
            del self._keys[key]
            return True


class SentMemos:
    """The memo this process last sent each run's endpoint, under the token it minted for it (``memo_cache``).

    The next request for the run sends only what changed since; an endpoint that does not hold that memo
    answers ``memo_miss`` and gets the whole one. A token is minted per request, so the memo it names is
    exactly what was sent with it, whatever else this or another process sends meanwhile. Runs beyond
    ``capacity`` are forgotten, least recently sent first (their next request carries the whole memo).
    """

    def __init__(self, capacity: int = 256, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        """What the memos remembered may add up to, serialized (each a run's recorded results and errors)."""
        self._runs: OrderedDict[str, tuple[str, dict[str, dict[str, Any]], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def prepare(
        self, run_id: str, whole: dict[str, dict[str, Any]]
    ) -> tuple[str, MemoBase | None, dict[str, dict[str, Any]]]:
        """For a request that carries memo ``whole``: its token, the memo it extends, and the entries to send."""
        token = uuid.uuid4().hex
        with self._lock:
            last = self._runs.pop(run_id, None)
            if last is not None:
                self._bytes -= last[2]
        if last is None:
            changed, base, size = whole, None, value_size(whole)
        else:
            previous_token, previous, size = last
            # an entry a decision did not touch is the same object as in the memo sent last: only the others
            # are compared, as JSON, so that a change Python calls equal (1 and true, 1 and 1.0) is still sent
            get = previous.get
            changed = {
                step_id: entry
                for step_id, entry in whole.items()
                if get(step_id) is not entry and not _same_json(get(step_id), entry)
            }
            added = sum(1 for step_id in changed if step_id not in previous)
            removed = (
                [] if len(previous) + added == len(whole) else [step_id for step_id in previous if step_id not in whole]
            )
            size += value_size(changed)
            base = MemoBase(token=previous_token, removed=removed, count=len(whole))
        if size <= self.max_bytes:
            with self._lock:
                self._runs[run_id] = (token, whole, size)
                self._bytes += size
                while self._runs and (len(self._runs) > self.capacity or self._bytes > self.max_bytes):
                    self._bytes -= self._runs.popitem(last=False)[1][2]
        return token, base, changed


def _authorized_at(state: RunState, task: TaskRef) -> datetime | None:
    """When ``state`` says the attempt ``task`` names was authorized."""
    if task.step_id is None or task.phase is None or task.generation is None:
        return None
    attempt = _attempt(state, task.step_id, task.phase, task.generation)
    return attempt.authorized_at if attempt is not None else None


def _attempt_took_s(state: RunState, step_id: str, phase: Phase, generation: int) -> float | None:
    """How long that attempt took, from its authorization to its outcome, if it has both."""
    attempt = _attempt(state, step_id, phase, generation)
    if attempt is None or attempt.authorized_at is None or attempt.settled_at is None:
        return None
    return (attempt.settled_at - attempt.authorized_at).total_seconds()


def _lease_watch_key(run_id: str, step_id: str, phase: Phase, generation: int) -> str:
    """Names one attempt's lease watch (``TaskQueue.watch_lease``), the same for its sender and its deleter."""
    digest = hashlib.sha256(f"{step_id}\n{phase.value}\n{generation}".encode()).hexdigest()[:12]
    return f"{run_id}-{digest}"


def _attempt(state: RunState, step_id: str, phase: Phase, generation: int) -> Attempt | None:
    """That attempt, as ``state`` holds it."""
    step = state.step(step_id)
    return step.attempt(phase, generation) if step is not None else None


def _attempt_in_flight(state: RunState, step_id: str, phase: Phase, generation: int) -> bool:
    """``state`` holds that attempt authorized and not yet settled."""
    attempt = _attempt(state, step_id, phase, generation)
    return attempt is not None and attempt.status is AttemptStatus.AUTHORIZED


def _values_problem(*outcomes: Any) -> str | None:
    """Why a JSON value an endpoint reported (an output, a result, an error's data) cannot be stored, or None."""
    for outcome in outcomes:
        if outcome is None:
            continue
        error = getattr(outcome, "error", None)
        for value in (getattr(outcome, "output", None), getattr(outcome, "result", None), error and error.data):
            if value is not None and (problem := json_value_problem(value)) is not None:
                return problem
    return None


def _same_json(a: Any, b: Any) -> bool:
    """Equal as JSON: Python's ``==`` with the types JSON tells apart (True is not 1, 1.0 is not 1)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_json(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@dataclass(frozen=True, slots=True)
class Delivered:
    """How a dispatcher should treat the message it delivered."""

    done: bool
    redeliver_after_s: float = 0.0
    in_flight: TaskRef | None = None
    """The attempt left in flight when the message is kept as its lease timer (it was answered ``accepted``, or
    its dispatcher stopped listening)."""
    authorized_at: datetime | None = None
    """When that attempt's authorization says it was authorized (what a run's lease timer compares with its
    ``watches_before``)."""


def _awaits(state: RunState, event: DeferredEvent) -> bool:
    """Whether ``state`` still waits for the answer ``event`` carries (its attempt in flight or Unknown, its
    discovery pass in flight): the answer is news, not one recorded before."""
    if isinstance(event, InvocationFailed):
        return True
    if isinstance(event, DiscoveryReported):
        d = state.discovery
        return d is not None and d.seq == event.seq and d.status is AttemptStatus.AUTHORIZED
    step = state.step(event.step_id)
    attempt = step.attempt(event.phase, event.generation) if step is not None else None
    return attempt is not None and attempt.status in (AttemptStatus.AUTHORIZED, AttemptStatus.UNKNOWN)


def _completion_token(key: str, run_id: str, step_id: str, phase: Phase, generation: int) -> str:
    binding = json.dumps([run_id, step_id, str(phase), generation], separators=(",", ":")).encode()
    named = base64.urlsafe_b64encode(binding).decode().rstrip("=")
    mac = hmac.new(key.encode(), b"ryusen completion token\n" + binding, hashlib.sha256).digest()
    return f"{COMPLETION_TOKEN_PREFIX}.{named}.{base64.urlsafe_b64encode(mac).decode().rstrip('=')}"


def _refuse_reserved_error(error: ErrorInfo | None) -> None:
    """An error a person or a system outside states (a completion, an operator's fail) cannot be of the type the
    SDK reports a callback that opened a step with (decisions 23): that holds the run and spends no retry, which
    only the endpoint that ran the callback may say."""
    if error is not None and error.type == NESTED_STEP_ERROR:
        raise InvalidRequestError(
            f"error type {NESTED_STEP_ERROR!r} is reserved: it is what the SDK reports for a callback that opened a"
            " step; give the failure a type of its own",
            code="reserved_error_type",
        )


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _memo_for(memo_entries: dict[str, dict[str, Any]], *, tracebacks: bool) -> dict[str, MemoEntry]:
    """The memo as a request carries it: a recorded step error keeps its ``traceback`` only for an SDK that
    announced ``tracebacks`` (an older SDK refuses unknown fields in ``ErrorInfo``)."""
    memo = {k: MemoEntry.model_validate(v) for k, v in memo_entries.items()}
    if tracebacks:
        return memo
    return {
        k: e.model_copy(update={"error": e.error.model_copy(update={"traceback": None})})
        if e.error is not None and e.error.traceback is not None
        else e
        for k, e in memo.items()
    }


def _check_same_input(existing: RunState, input: Any) -> None:
    """A start that names an existing run's idempotency key must ask for the same run (decision 34, K3): a
    different input under the same key is a caller's mistake, refused rather than answered with a run that
    did something else."""
    if _canonical(existing.input) != _canonical(input):
        raise ConflictError(
            f"idempotency key {existing.idempotency_key!r} was used to start run {existing.id} with a different"
            " input; use a new key for a new run",
            code="idempotency_key_reused",
            run_id=existing.id,
            idempotency_key=existing.idempotency_key,
        )


MAX_EVENT_BYTES = 256 * 1024
"""The largest asynchronous Lambda event a task is sent as (Lambda's limit for ``InvocationType=Event``); a larger
request goes to the release's URL and is waited for."""
_LAMBDA_FUNCTION_ARN = re.compile(LAMBDA_FUNCTION_ARN)


def _lambda_event(features: frozenset[str]) -> tuple[frozenset[str], str | None]:
    """The features an SDK announced, with ``lambda_event=<ARN>`` (its Lambda function takes attempts as events)
    taken apart: the features with ``lambda_event`` alone, and the ARN. A malformed ARN is refused, and nothing
    is recorded."""
    kept, arn = set(), None
    for feature in sorted(features):
        name, _, value = feature.partition("=")
        if name != LAMBDA_EVENT:
            kept.add(feature)
            continue
        if arn is not None:
            raise InvalidRequestError(
                "the endpoint announced lambda_event more than once: one function takes an app's events",
                code="invalid_lambda_function_arn",
            )
        if not _LAMBDA_FUNCTION_ARN.fullmatch(value):
            raise InvalidRequestError(
                "the endpoint announced lambda_event with something that is not a Lambda function's ARN"
                f" ({value[:200]!r})",
                code="invalid_lambda_function_arn",
            )
        kept.add(LAMBDA_EVENT)
        arn = value
    return frozenset(kept), arn


def _task_event(path: str, headers: dict[str, str], body: bytes) -> bytes:
    """A task request as the asynchronous event a Lambda endpoint's ``lambda_handler`` takes: the Function URL
    event it would have been sent (payload 2.0), marked as an event nobody waits on."""
    event = {
        LAMBDA_EVENT_MARKER: 1,
        "version": "2.0",
        "rawPath": path,
        "headers": {k.lower(): v for k, v in headers.items()},
        "requestContext": {"http": {"method": "POST", "path": path}},
        "body": body.decode(),
        "isBase64Encoded": False,
    }
    return json.dumps(event, separators=(",", ":")).encode()


class Engine:
    def __init__(
        self,
        *,
        store: RunStore,
        queue: TaskQueue,
        timers: TimerService,
        invoker: Invoker,
        settings: ServerSettings | None = None,
        clock: Callable[[], datetime] | None = None,
        new_id: Callable[[], str] | None = None,
        event_invoker: EventInvoker | None = None,
    ) -> None:
        self.store = store
        self.queue = queue
        self.timers = timers
        self.invoker = invoker
        self.event_invoker = event_invoker
        """Sends attempts to a Lambda endpoint that announced ``lambda_event`` as asynchronous events (way C of
        docs/design/dispatch.md); None: every attempt goes to the release's URL."""
        self.settings = settings or ServerSettings()
        self.clock = clock or (lambda: datetime.now(UTC))
        self.new_id = new_id or (lambda: "run_" + uuid.uuid4().hex)
        self.hooks: list[Callable[[str, Any], None]] = []
        """Observers of engine activity (the dev UI, ryusen.testing's fault injection)."""
        self.chain_guards: list[Callable[[], bool]] = []
        """Each must allow chaining the next task (``ryusen.testing`` stops a chain where a test wants to look)."""
        self.run_locks: tuple[threading.Lock, ...] | None = None
        """Decisions about one run are taken one at a time in this engine (striped by run id; held only around the
        read, the decision and the write, never around sends or hooks, so that no two are ever held at once):
        siblings settling at once would otherwise race for the same version and spend a write and a read on every
        loss. Other processes still race (the conditional write fences them). Set by ``serialize_runs`` (``ryusen
        dev``, one process with many dispatcher threads); None by default: tests that race writes on purpose, and
        the simulator, schedule their own interleavings."""
        self.sleep: Callable[[float], None] = time.sleep
        """How a retry waits (the simulator replaces it: its time is its own)."""
        self.sent_memos = SentMemos()
        """The memo this process last sent each run's endpoint (``memo_cache``), so the next sends what changed."""
        self.step_durations = StepDurations()
        """How long the recent attempts of each step took, as this process saw them (``inline_up_to_s``)."""
        self.run_lease_timers = RunLeaseTimers()
        """The lease timers this process's result function sent, by run (one timer for a run's steps)."""
        self.lease_watches = ParkedLeaseWatches()
        """The lease watches this process parked on the Scheduler, deleted once their outcomes are recorded here."""
        self._releases_read: dict[str, tuple[float, Release | None, int]] = {}
        """The newest release of each function as this process last read it, when (monotonic), and which read of
        this process (``_release_reads``) answered it."""
        self._release_reads: dict[str, int] = {}
        """How many consistent reads of each function's release this process began: of two reads in flight at
        once (dispatcher threads), the one begun later answers with at least what the other saw."""
        self._release_lock = threading.Lock()

    def _read_release(self, function_id: str) -> Release | None:
        """The newest release of ``function_id``, read consistently from the store and remembered for
        ``_newest_release``, unless a read this process began later already answered: that answer is newer or
        the same, and is kept (a read that began before a sync may answer after one that began after it)."""
        with self._release_lock:
            begun = self._release_reads[function_id] = self._release_reads.get(function_id, 0) + 1
        release = self.store.get_release(function_id)
        with self._release_lock:
            known = self._releases_read.get(function_id)
            if known is not None and known[2] > begun:
                return known[1]
            self._releases_read[function_id] = (time.monotonic(), release, begun)
        return release

    def _newest_release(self, function_id: str) -> Release | None:
        """The newest release of ``function_id`` as of at most ``release_recheck_s`` ago. Once this process has
        read it, a recheck is an eventually consistent read (half a read unit, the one read left on a step's
        path): one that names another release than the one remembered, newer or a lagging copy's older one, is
        read again consistently before it is used, so a process never goes back to a release it saw replaced. A
        sync another process made reaches it within the recheck and DynamoDB's replication (usually well under
        a second), as if it had landed that much later. A recheck of 0 reads consistently after every callback."""
        seen = self._releases_read.get(function_id)
        if seen is None or self.settings.release_recheck_s <= 0:
            return self._read_release(function_id)
        if time.monotonic() - seen[0] < self.settings.release_recheck_s:
            return seen[1]
        release = self.store.get_release(function_id, consistent=False)
        with self._release_lock:
            known = self._releases_read.get(function_id)  # as now: another thread may have read it meanwhile
            if known is not None and release == known[1]:
                self._releases_read[function_id] = (time.monotonic(), release, known[2])
                return release
        return self._read_release(function_id)

    def serialize_runs(self) -> None:
        """Take decisions about one run one at a time in this process (see ``run_locks``)."""
        self.run_locks = tuple(threading.Lock() for _ in range(RUN_LOCK_STRIPES))

    def master_keys(self, *, fresh: bool = False) -> list[str]:
        """The valid master keys, the one to sign with first (during a rotation's window, also the one it
        replaced). ``fresh``: read from the secret again now, not from the cache (for an unsolicited message)."""
        source = self.settings.master_keys_source
        if fresh and self.settings.fresh_master_keys_source is not None:
            source = self.settings.fresh_master_keys_source
        if source is not None:
            return [key for key in source() if key]
        return split_keys(self.settings.master_key)

    def app_keys(self, app_id: str, *, fresh: bool = False) -> list[str]:
        """App ``app_id``'s keys, derived from the master keys: what its messages are signed and verified with
        (empty: this engine signs nothing)."""
        return [app_key(master, app_id) for master in self.master_keys(fresh=fresh)]

    # ---- the decide/write/act loop ---------------------------------------------

    def apply(self, run_id: str, event: Event, *, known: RunState | None = None, known_fresh: bool = True) -> Decision:
        """Decide ``event`` on the current run, write it, carry out commands other than invocation.

        ``known`` is a state the caller just read or wrote; it saves one read,
        and the conditional write still catches it if it is out of date.
        ``known_fresh=False``: ``known`` is what this process remembers of the run (``RunStore.cached``), not a
        read. A decision that writes is still fenced by its conditional write (it succeeds only on the newest
        version, which proves the state was current); a decision that writes nothing is never taken on it: the
        run is read and the event decided again.
        """
        for _ in range(MAX_RACES):
            # one decision of a run at a time in this process (siblings settling at once would otherwise race for
            # the same version and spend a write and a read on every loss); other processes still race: the
            # conditional write fences them
            locks = self.run_locks
            with locks[hash(run_id) % len(locks)] if locks else contextlib.nullcontext():
                state: RunState | None
                if known is not None:
                    state, fresh, known = known, known_fresh, None
                else:
                    state, fresh = self.store.get(run_id), True
                if state is None:
                    raise NotFoundError(f"no run {run_id!r}", run_id=run_id)
                decision = decide(state, event, now=self.clock(), settings=self.settings.engine)
                if decision.changed:
                    try:
                        self.store.save(decision.state, expected_version=state.version)
                    except VersionConflictError as conflict:
                        known, known_fresh = conflict.current, True  # someone moved first: decide on what they wrote
                        continue
                elif not fresh:
                    self._emit("cached_state_read_again", (run_id, event))
                    continue  # nothing written proves the remembered state current: read it and decide again
            self._emit("decided", (event, decision))
            self._send(decision)
            return decision
        raise ServerError(f"run {run_id!r} is too contended; try again")

    def _apply_retrying(
        self,
        run_id: str,
        event: Event,
        *,
        known: RunState | None,
        deadline: float | None,
        on_retry: Callable[[], None] | None = None,
        known_fresh: bool = True,
    ) -> Decision:
        """:meth:`apply`, tried again with backoff while the store is unavailable (throttled past botocore's
        retries, a 5xx, a lost answer) and time is left: for ``store_retry_s``, and never past
        ``STORE_RETRY_RESERVE_S`` before ``deadline`` (a Lambda's remaining time). A try
        after a write whose answer was lost meets its own write (the version fence) and decides again on it.
        Raises the last :class:`StoreUnavailableError` when the time is up."""
        give_up_at = time.monotonic() + self.settings.store_retry_s
        if deadline is not None:
            give_up_at = min(give_up_at, deadline - STORE_RETRY_RESERVE_S)
        tries = 0
        while True:
            try:
                return self.apply(run_id, event, known=known, known_fresh=known_fresh)
            except StoreUnavailableError as exc:
                tries += 1
                pause = random.uniform(0, min(STORE_RETRY_MAX_S, STORE_RETRY_FIRST_S * 2**tries))
                if tries >= STORE_RETRY_MAX_TRIES or time.monotonic() + pause >= give_up_at:
                    log.warning(
                        "run %s: the store refused a write %d times (%s); giving up for now", run_id, tries, exc
                    )
                    raise
                self._emit("store_retry", (run_id, tries, exc.message))
                if on_retry is not None and tries == 1:
                    on_retry()
                known = None  # read again: the refused write may have committed
                self.sleep(pause)

    def _record_answer(
        self,
        run_id: str,
        event: DeferredEvent,
        *,
        known: RunState,
        deadline: float | None,
        lease: _MessageLease | None = None,
    ) -> Decision | None:
        """Record what an endpoint answered. While the store will not take it, retry within the time left
        (keeping the message in hand away meanwhile: ``lease``); then defer the answer to the queue
        (``deferred.py``) and return None: the answer is recorded when the deferred message is received, never
        lost to a throttle (its attempt would end Unknown at the lease's expiry)."""
        self._emit("answer", (run_id, event))
        hold_s = self.settings.store_retry_s + STORE_RETRY_RESERVE_S + MESSAGE_HOLD_MARGIN_S
        try:
            decision = self._apply_retrying(
                run_id,
                event,
                known=known,
                deadline=deadline,
                on_retry=(lambda: lease.hold(hold_s)) if lease is not None else None,
            )
        except StoreUnavailableError as exc:
            if lease is not None:
                # Away for as long as other messages wait past a lease: should the message's deletion fail too,
                # it comes back (as the attempt's carrier) only once the deferred answer has had that long.
                lease.hold(self.settings.engine.lease_watch_grace_s)
            if not self._defer(run_id, event, exc):
                raise
            return None
        self._emit("answer_recorded", (run_id, event))
        return decision

    def _defer(self, run_id: str, event: DeferredEvent, cause: StoreUnavailableError) -> bool:
        """Put ``event`` on the queue for a later dispatcher to record; False when the queue would not take it."""
        deferred = DeferredAnswer.of(run_id, event, self.store.seal_key())  # read at delivery: cached
        try:
            self.queue.defer(deferred, 1.0)
        except Exception as refused:  # noqa: BLE001 - too large for a message, or the queue failing too; reported
            self._emit("answer_dropped", (run_id, event, f"{type(refused).__name__}: {refused}"))
            log.error("run %s: could not record an answer (%s) nor defer it (%s)", run_id, cause, refused)
            return False
        self._emit("answer_deferred", (run_id, event))
        log.warning("run %s: the store is unavailable (%s); %s", run_id, cause, deferred.describe())
        return True

    def apply_deferred(
        self,
        deferred: DeferredAnswer,
        *,
        budget_s: float | None = None,
        on_authorized: Callable[[float], None] | None = None,
        carrier: str | None = None,
    ) -> Delivered:
        """Record an answer a dispatcher deferred while the store would not take it (a deferred message). Still
        unavailable: the answer goes back on the queue, a little later each time (the message in hand is then
        done). A next task the deferring dispatcher authorized in a write whose answer was lost is invoked
        here, as that dispatcher would have. ``carrier``: the message's identity, as for :meth:`deliver`."""
        with carried_by(carrier):
            return self._apply_deferred(deferred, budget_s, on_authorized)

    def _apply_deferred(
        self,
        deferred: DeferredAnswer,
        budget_s: float | None,
        on_authorized: Callable[[float], None] | None,
    ) -> Delivered:
        deadline = time.monotonic() + budget_s if budget_s is not None else None
        seal_key = self.store.seal_key()
        if not deferred.verify(seal_key):
            log.error("refused a deferred answer not sealed by this deployment: %s", deferred.describe())
            return Delivered(done=True)
        event = deferred.decoded()
        again = deferred
        if isinstance(event, AttemptReported | DiscoveryReported) and event.delivery_id is not None:
            # this receiver authorizes under its own delivery id, and claims what the deferring ones authorized
            event = replace(event, delivery_id=new_delivery_id(), claims=(event.delivery_id, *event.claims))
            # deferred again, it names this receiver too: a claim of its that committed unseen is claimed next
            again = DeferredAnswer.of(deferred.run_id, event, seal_key).model_copy(update={"tries": deferred.tries})
        before: RunState | None = None
        try:
            before = self.store.get(deferred.run_id)
            decision = self._apply_retrying(deferred.run_id, event, known=before, deadline=deadline)
        except NotFoundError:
            return Delivered(done=True)  # the run is gone (retention): nothing to record
        except StoreUnavailableError:
            # deferred again, naming this receiver too: a claim of its that committed unseen is claimed next
            self.queue.defer(again.again(seal_key), min(MAX_DEFERRAL_DELAY_S, 2.0 ** min(deferred.tries + 1, 10)))
            return Delivered(done=True)
        if before is None:
            return Delivered(done=True)  # the run is gone (retention): nothing to record
        self._emit("answer_recorded", (deferred.run_id, event))
        chain = getattr(event, "chain", None)
        if not any(isinstance(c, InvokeTask) for c in decision.commands):
            if _awaits(before, event):
                return Delivered(done=True)  # news, recorded: its next task went to the queue
            # Recorded before: this message is back as the lease timer of what its receiver carried on (a next
            # task tagged with this message), or it is a duplicate. It watches the run's leases as a stale task
            # message does, as the carrier of what it authorized.
            return self._watch(deferred.run_id, event, deadline)
        release = self._read_release(decision.state.function_id)
        if (
            chain is None
            or release is None
            or (release.release_id, release.build_id)
            != (
                chain.release_id,
                chain.build_id,
            )
        ):
            # Not the code it was authorized for: it is not invoked here, and this message, its carrier, comes back
            # at its lease to take it as Unknown (it was never sent: a retry runs it once).
            return self._watch(deferred.run_id, event, deadline)
        return self._carry_on(decision, release, deadline, on_authorized)

    def _watch(self, run_id: str, event: DeferredEvent, deadline: float | None) -> Delivered:
        """A deferred message whose answer is recorded: delivered as its attempt's (now stale) task would be, so that
        it looks at the run's leases (``reemit_stalled``), and kept while one it carries has not ended."""
        if isinstance(event, InvocationFailed):
            return Delivered(done=True)
        if isinstance(event, DiscoveryReported):
            task = TaskRef(run_id=run_id, kind=TaskKind.DISCOVER, seq=event.seq)
        else:
            kind = TaskKind.FORWARD if event.phase is Phase.FORWARD else TaskKind.COMPENSATE
            task = TaskRef(run_id=run_id, kind=kind, step_id=event.step_id, generation=event.generation)
        watched = TaskDelivered(task=task, release=None, delivery_id=new_delivery_id())
        try:
            decision = self._apply_retrying(run_id, watched, known=None, deadline=deadline)
        except StoreUnavailableError:
            return Delivered(done=False, redeliver_after_s=STORE_UNAVAILABLE_RETRY_S)
        for command in decision.commands:
            if isinstance(command, RedeliverLater):
                return Delivered(done=False, redeliver_after_s=command.delay_s)
        return Delivered(done=True)

    def _send(self, decision: Decision) -> None:
        for command in decision.commands:
            if isinstance(command, EnqueueTask):
                self.queue.send(command.task, command.delay_s, app_id=decision.state.app_id)
            elif isinstance(command, ScheduleTimer):
                self.timers.schedule(command.timer)
            elif isinstance(command, CancelTimer):
                self.timers.cancel(command.timer)

    def _emit(self, kind: str, payload: Any) -> None:
        for hook in self.hooks:
            hook(kind, payload)

    # ---- runs ------------------------------------------------------------------------

    def start_run(
        self,
        function_id: str,
        input: Any,
        *,
        idempotency_key: str | None = None,
        timeout_s: float | None = None,
    ) -> tuple[RunState, bool]:
        """Start a run; returns (run, created). The same idempotency key returns the same run."""
        release = self.store.get_release(function_id)
        manifest = release.function(function_id) if release else None
        if release is None or manifest is None:
            raise NotFoundError(f"no synced release declares function {function_id!r}", function_id=function_id)
        limit = self.settings.engine.max_value_bytes
        if (size := value_size(input)) > limit:
            raise PayloadTooLargeError(f"run input is {size} bytes serialized; the limit is {limit}", limit=limit)
        if idempotency_key is not None:
            existing = self._run_for_key(function_id, idempotency_key)
            if existing is not None:
                _check_same_input(existing, input)
                self._resend_first_discovery(existing)
                return existing, False
        deadline_at, source = self._deadline(function_id, timeout_s, manifest.timeout_s)
        now = self.clock()
        run_id = self.new_id()
        decision = decide(
            None,
            StartRun(
                run_id=run_id,
                app_id=release.app_id,
                function_id=function_id,
                input=input,
                idempotency_key=idempotency_key,
                deadline_at=deadline_at,
                deadline_source=source,
                secret=secrets.token_urlsafe(24),
            ),
            now=now,
            settings=self.settings.engine,
        )
        try:
            self.store.create(decision.state)
        except RunExistsError as exists:
            current = self.store.get(exists.run_id)
            if current is None:  # pragma: no cover - the key's run vanished
                raise ConflictError("idempotency key is taken by a run that no longer exists") from None
            _check_same_input(current, input)
            return current, False
        self._emit("decided", (None, decision))
        self._send(decision)
        return decision.state, True

    def _resend_first_discovery(self, state: RunState) -> None:
        """A retried start may follow a start whose queue send failed after the run was written:
        if discovery #1 is still queued, send it again (a duplicate delivery is harmless)."""
        d = state.discovery
        if d is not None and d.seq == 1 and d.status.value == "queued":
            self.queue.send(TaskRef(run_id=state.id, kind=TaskKind.DISCOVER, seq=1), app_id=state.app_id)

    def _run_for_key(self, function_id: str, key: str) -> RunState | None:
        run_id = self.store.run_for_idempotency_key(function_id, key)
        return self.store.get(run_id) if run_id else None

    def _deadline(
        self, function_id: str, timeout_s: float | None, function_timeout_s: float | None
    ) -> tuple[datetime | None, DeadlineSource]:
        maximum = self.settings.max_run_timeout_s
        if timeout_s is not None:
            declared, source = timeout_s, DeadlineSource.RUN_REQUEST
        elif function_timeout_s is not None:
            declared, source = function_timeout_s, DeadlineSource.FUNCTION
        elif self.settings.default_run_timeout_s is not None:
            declared, source = self.settings.default_run_timeout_s, DeadlineSource.DEPLOYMENT_DEFAULT
        else:
            return None, DeadlineSource.NONE
        if maximum is not None and declared > maximum:
            raise InvalidRequestError(
                f"function {function_id!r}: run timeout {declared:g}s ({source}) exceeds the maximum {maximum:g}s",
                code="timeout_exceeds_maximum",
                function_id=function_id,
                declared_s=declared,
                maximum_s=maximum,
            )
        return self.clock() + timedelta(seconds=declared), source

    def get_run(self, run_id: str) -> RunState:
        state = self.store.get(run_id)
        if state is None:
            raise NotFoundError(f"no run {run_id!r}", run_id=run_id)
        return state

    def cancel(self, run_id: str, reason: str | None = None) -> Decision:
        decision = self.apply(run_id, StopRequested(kind="cancel", reason=reason))
        if decision.rejection is not None:
            raise ConflictError(decision.rejection.message, code=decision.rejection.code)
        return decision

    def rediscover(self, run_id: str) -> Decision:
        decision = self.apply(run_id, WakeRequested(source="operator"))
        if decision.rejection is not None:
            raise ConflictError(decision.rejection.message, code=decision.rejection.code)
        return decision

    def resolve(self, run_id: str, event: Resolve) -> Decision:
        _refuse_reserved_error(event.error)
        limit = self.settings.engine.max_value_bytes
        if event.action == "succeed" and (size := value_size(event.result)) > limit:
            raise PayloadTooLargeError(f"result is {size} bytes serialized; the limit is {limit}", limit=limit)
        decision = self.apply(run_id, event)
        if decision.rejection is not None:
            rejection = decision.rejection
            if rejection.code in ("step_not_found", "attempt_not_found"):
                raise NotFoundError(rejection.message, code=rejection.code)
            raise ConflictError(rejection.message, code=rejection.code)
        return decision

    # ---- releases ---------------------------------------------------------------------

    def sync_release(
        self, app_id: str, url: str, manifest: Manifest, features: frozenset[str] = frozenset()
    ) -> Release:
        """Record a release and wake the blocked runs of its functions (R3, D5).

        The manifest is bounded before anything is read or written: at most ``MAX_MANIFEST_FUNCTIONS``
        functions, ``MAX_MANIFEST_BYTES`` in all, and every id (app, release, build, function) 1 to
        ``MAX_ID_LENGTH`` printable characters: a release is stored, and served to every client."""
        _check_manifest_bounds(manifest)
        features, lambda_function_arn = _lambda_event(features)
        if manifest.app_id != app_id:
            raise InvalidRequestError(
                f"the endpoint serves app {manifest.app_id!r}, not {app_id!r}", code="app_id_mismatch"
            )
        maximum = self.settings.max_run_timeout_s
        for fn in manifest.functions:
            if maximum is not None and fn.timeout_s is not None and fn.timeout_s > maximum:
                raise InvalidRequestError(
                    f"function {fn.id!r}: declared run timeout {fn.timeout_s:g}s exceeds the maximum {maximum:g}s",
                    code="timeout_exceeds_maximum",
                    function_id=fn.id,
                    declared_s=fn.timeout_s,
                    maximum_s=maximum,
                )
            owner = self.store.get_release(fn.id)
            if owner is not None and owner.app_id != app_id:
                raise ConflictError(
                    f"function {fn.id!r} belongs to app {owner.app_id!r}", code="function_owned_by_other_app"
                )
        release = Release(
            app_id=app_id,
            url=url,
            release_id=manifest.release_id,
            build_id=manifest.build_id,
            functions=tuple(manifest.functions),
            synced_at=self.clock(),
            signed=manifest.signed,
            features=features,
            lambda_function_arn=lambda_function_arn,
        )
        self.store.put_release(release)
        for fn in manifest.functions:
            self._releases_read.pop(fn.id, None)  # this process's chains read the release afresh
        # the blocked runs are woken by dispatchers (a sync returns at once, however many are blocked), and
        # looked up again once the index has caught up with runs that blocked just before this sync
        for fn in manifest.functions:
            order = WakeOrder(function_id=fn.id).sealed(self.store.seal_key())
            if self.store.runs_blocked_by_definition(fn.id):  # one index query; the wakes are the dispatchers'
                self.queue.wake(order)
            if self.settings.index_settle_s > 0:
                self.queue.wake(order, self.settings.index_settle_s)
        return release

    def carry_out_wake(self, order: WakeOrder) -> None:
        """A release sync's wake: each run of the function that a definition blocks (a second wake of a run is
        ignored), at most ``WAKES_PER_MESSAGE`` here and the rest by the same order sent again."""
        seal_key = self.store.seal_key()
        if not order.verify(seal_key):
            log.error("refused a wake order not sealed by this deployment: %s", order.describe())
            return
        if order.run_id is not None:
            self.apply(order.run_id, WakeRequested(source="release_sync"))
            return
        assert order.function_id is not None
        # in run id order, from where the last message of this order stopped: a woken run stays listed while
        # its discovery is on its way (or blocks again), so reading from the top would wake the same ones
        blocked = sorted(r for r in self.store.runs_blocked_by_definition(order.function_id) if r > (order.after or ""))
        for run_id in blocked[:WAKES_PER_MESSAGE]:
            try:
                self.apply(run_id, WakeRequested(source="release_sync"))
            except NotFoundError:
                continue  # gone since the index was read
        if len(blocked) > WAKES_PER_MESSAGE:
            self.queue.wake(order.model_copy(update={"after": blocked[WAKES_PER_MESSAGE - 1]}).sealed(seal_key))

    # ---- dispatch ---------------------------------------------------------------------

    def deliver(
        self,
        task: TaskRef,
        *,
        budget_s: float | None = None,
        on_authorized: Callable[[float], None] | None = None,
        carrier: str | None = None,
    ) -> Delivered:
        """Handle one dispatch message: authorize, invoke, and record what came back.

        ``budget_s`` is how long the caller may still run (a Lambda's remaining time): the dispatcher
        stops listening for the endpoint's answer in time to record it, and tells the SDK to submit a
        later answer to the result endpoint instead. ``on_authorized(lease_s)`` is called once the
        task is authorized, before the endpoint is invoked: the dispatcher makes its message invisible
        for the lease, so a dispatcher that dies mid-attempt is noticed when the lease expires.

        Everything that can fail for want of a resource (the signing key) happens before the
        authorization write: after it, only the invocation, so an authorized task is never left unsent.

        ``carrier`` is the message's identity (an SQS message id, the same at every receive): the delivery ids of
        this delivery's authorizations start with its tag, so that the message is known as the carrier of the
        attempts it authorized (``core.model.carrier_of``) when it comes back as their lease timer.
        """
        with carried_by(carrier):
            return self._deliver(task, budget_s, on_authorized)

    def _deliver(
        self, task: TaskRef, budget_s: float | None, on_authorized: Callable[[float], None] | None
    ) -> Delivered:
        deadline = time.monotonic() + budget_s if budget_s is not None else None
        if budget_s is not None and budget_s < MIN_DISPATCH_BUDGET_S:
            return Delivered(done=False)  # too little time left to hear an answer: the message comes back
        self.master_keys()  # read now (a cold start's secret): a failure leaves nothing authorized and unsent
        delivery_id = new_delivery_id()
        try:
            self.store.seal_key()  # read now too (once per process): deferring an answer must not need a read
            state = self.store.get(task.run_id)
            if state is None:
                return Delivered(done=True)
            release = self._read_release(state.function_id)  # a new message reads the release afresh
            if self.settings.inline_up_to_s > 0 and release is not None and release.lambda_function_arn is not None:
                self.step_durations.learn(state)  # e.g. a lease timer back: how long the run's steps took
            delivered = TaskDelivered(task=task, release=self._release_ref(release), delivery_id=delivery_id)
        except StoreUnavailableError as exc:
            log.warning("%s: the store is unavailable (%s); the message comes back", task.describe(), exc)
            return Delivered(done=False, redeliver_after_s=STORE_UNAVAILABLE_RETRY_S)
        try:
            # tried again on the same delivery id: a try whose write committed is recognised as this
            # dispatcher's own authorization, and its task is invoked, not left to the lease's expiry
            decision = self._apply_retrying(task.run_id, delivered, known=state, deadline=deadline)
        except StoreUnavailableError as exc:
            log.warning(
                "%s: the store is unavailable (%s); nothing was sent, the message comes back", task.describe(), exc
            )
            # A try may have committed the authorization, unseen: then only this delivery may invoke it, and it
            # never did. Say so, for when the store takes writes again (ignored unless it is this delivery's).
            never_sent = InvocationFailed(
                task=task,
                failure=InvocationFailure.UNREACHABLE,
                detail="never sent: the store did not confirm its authorization",
                delivery_id=delivery_id,
            )
            self._defer(task.run_id, never_sent, exc)
            return Delivered(done=False, redeliver_after_s=STORE_UNAVAILABLE_RETRY_S)
        return self._carry_on(decision, release, deadline, on_authorized)

    def _carry_on(
        self,
        decision: Decision,
        release: Release | None,
        deadline: float | None,
        on_authorized: Callable[[float], None] | None,
        *,
        chain_until: float | None = None,
    ) -> Delivered:
        """Invoke what ``decision`` authorized, record the answer, and go on while it authorizes the next (until
        ``chain_until``; by default ``chain_window_s`` from now)."""
        lease = _MessageLease(on_authorized)
        if chain_until is None:
            chain_until = time.monotonic() + self.settings.chain_window_s
        while True:
            # One write accepted the last answer and, with time left, authorized the next task: invoke it
            # now, with the state this process just wrote (no re-read, no message).
            for command in decision.commands:
                if isinstance(command, RedeliverLater):
                    return Delivered(done=False, redeliver_after_s=command.delay_s)
            invoke = next((c for c in decision.commands if isinstance(c, InvokeTask)), None)
            if invoke is None or release is None:
                return Delivered(done=True)
            outcome = self._invoke(decision.state, invoke.task, release, deadline, lease, chain_until)
            if isinstance(outcome, Delivered):
                return outcome
            decision, release = outcome

    def may_chain(self, deadline: float | None, chain_until: float | None = None) -> bool:
        """Whether the next task may be authorized and invoked by this dispatcher right away: chaining is on,
        the invocation has time for it, and this message has not been chaining for ``chain_window_s``
        (so that, where nothing limits an invocation, one long run cannot hold a dispatcher forever)."""
        if not self.settings.chain:
            return False
        now = time.monotonic()
        if deadline is not None and deadline - now < MIN_DISPATCH_BUDGET_S:
            return False
        if chain_until is not None and now >= chain_until:
            return False
        return all(guard() for guard in self.chain_guards)

    def _invoke(
        self,
        state: RunState,
        task: TaskRef,
        release: Release,
        deadline: float | None,
        lease: _MessageLease,
        chain_until: float | None = None,
    ) -> Delivered | tuple[Decision, Release | None]:
        now = self.clock()
        window = _window(state, task, self.settings.engine)
        lease_at, respond_by = window.lease_at, window.respond_by
        try:
            lease.cover(max(1.0, (lease_at - now).total_seconds()))  # the message is now the lease timer
        except Exception:
            log.warning("could not make the message of %s its lease; invoking anyway", task.describe(), exc_info=True)
        listen_until, cut = respond_by, False
        if deadline is not None:  # what is left of the budget now, after the reads and the write
            left = deadline - time.monotonic() - DISPATCH_MARGIN_S - window.grace_s
            latest = now + timedelta(seconds=max(1.0, left))
            if latest < respond_by:
                listen_until, cut = latest, True
        whole = memo(state)
        keys = self.app_keys(release.app_id)
        by_event = self._by_event(release, task, keys)
        grace_s = window.grace_s
        quick = False
        if by_event and lease.from_message and not lease.quick_missed and self.settings.inline_up_to_s > 0:
            self.step_durations.learn(state)
            if (
                task.step_id is not None
                and task.phase is not None
                and self.step_durations.quick(
                    StepDurations.key(state, task.step_id, task.phase), self.settings.inline_up_to_s
                )
            ):
                # The step has been quick: a dispatcher's wait costs less than an event's lease timer and result post.
                # It is listened for INLINE_LISTEN_S at most, and its timeout is judged at its lease, as an event's:
                # past the window the SDK posts the outcome to the result URL, and this message, the lease timer,
                # watches it. (Never in the result function: the SDK's post, which its carrying on holds, is billed
                # to the app's Lambda.)
                by_event, quick = False, True
                self._emit("quick", task)
                listen_until = min(listen_until, now + timedelta(seconds=INLINE_LISTEN_S))
                cut, grace_s = True, min(grace_s, INLINE_LISTEN_GRACE_S)
        cached = "memo_cache" in release.features and not by_event  # an event cannot be answered "memo_miss"
        token, base, changed = self.sent_memos.prepare(state.id, whole) if cached else (None, None, whole)
        request = self._task_request(
            state, task, changed, respond_by=listen_until, features=release.features, token=token, base=base
        )
        self._emit("invoke", (task, release.url))
        if keys and "signing_v2" not in release.features:
            # an SDK that predates these signatures would refuse the request, or worse, run it and answer in
            # a way that cannot be verified (an Unknown): nothing is sent, and syncing a release built with a
            # current SDK repairs the run
            detail = "the release's SDK predates signing v2: sync a release built with a current SDK"
            result: Any = InvokeResult(kind="unreachable", detail=detail)
            sent = None
        else:
            result, sent = self._post(release, request, keys, listen_until, grace_s, by_event=by_event)
        if base is not None and sent is not None and self._memo_missed(result, request, sent):
            # the endpoint does not hold the memo this request extends (another container, a restart):
            # it ran nothing, so the same request goes again with the whole memo and input
            entries = {k: MemoEntry.model_validate(v) for k, v in whole.items()}
            whole_request = request.model_copy(
                update={
                    "memo": entries,
                    "input": state.input,
                    "memo_base": None,
                    "respond_within_s": self._respond_within_s(listen_until, release.features),  # less the miss
                }
            )
            result, sent = self._post(release, whole_request, keys, listen_until, grace_s)
        self._emit("invoked", (task, result))
        if quick and (self.clock() - now).total_seconds() > self.settings.inline_up_to_s:
            lease.quick_missed = True  # no longer quick: the rest of this chain is not waited for
        if self._accepted(task, result, sent):
            # The endpoint runs the callback and will post its outcome to the result URL: nothing to record, and
            # no waiting. This message, the lease timer, comes back when the lease expires.
            self._emit("acknowledged", task)
            return Delivered(
                done=False,
                redeliver_after_s=max(1.0, (lease_at - self.clock()).total_seconds()),
                in_flight=task,
                authorized_at=_authorized_at(state, task),
            )
        if cut and result.kind == "timed_out" and task.kind is not TaskKind.DISCOVER:
            # This dispatcher had to stop listening before the attempt's own timeout. The attempt stays
            # authorized: the SDK was told (respond_by) to submit its result to the result endpoint, and
            # the message, the lease timer, comes back when the lease expires if nothing arrives.
            return Delivered(
                done=False,
                redeliver_after_s=max(1.0, (lease_at - self.clock()).total_seconds()),
                in_flight=task,
                authorized_at=_authorized_at(state, task),
            )
        if result.kind == "timed_out":
            result = replace(result, detail=window.no_response())  # the declared timeout, not the socket's
        chaining = self.may_chain(deadline, chain_until)
        newest: Release | None = None
        if chaining or request.continue_after:
            try:
                newest = self._newest_release(state.function_id)  # the newest release (R1), re-read now and then
            except StoreUnavailableError:
                chaining = False  # the answer is recorded without what the pass found next; no chain
        chain = newest if chaining else None
        ref = self._release_ref(chain)
        # What the pass found after the callback is what the code that ran it would do next; if a newer
        # release was synced meanwhile, the next task must be that code's discovery, not this answer's.
        same_code = newest is not None and (newest.release_id, newest.build_id) == (
            release.release_id,
            release.build_id,
        )
        event = self._event_for(
            task,
            result,
            chain=ref,
            delivery_id=new_delivery_id() if ref else None,
            trust_next=same_code,
            sent=sent,
        )
        if isinstance(event, InvocationFailed):
            # about the task as this delivery authorized it, and only then: the same generation may be sent
            # again (after "unreachable") by another delivery before a deferred copy of this is received
            event = replace(event, delivery_id=_authorizing_delivery(state, task))
        recorded = self._record_answer(task.run_id, event, known=state, deadline=deadline, lease=lease)
        if recorded is None:
            # Deferred on the queue: the deferred answer now carries the attempt, and is received until it is
            # recorded. This message is done, so that it cannot come back as the lease timer and take the attempt
            # as Unknown before its answer is recorded; other messages wait lease_watch_grace_s past the lease.
            return Delivered(done=True)
        try:
            self._wake_if_release_moved(recorded, state, release)
        except StoreUnavailableError:
            log.warning("run %s: could not look for a newer release after a pass blocked (the probe will)", state.id)
        return recorded, chain

    def _release_ref(self, release: Release | None) -> ReleaseRef | None:
        """What the core is told of the release a task is authorized with (None: no release is synced)."""
        if release is None:
            return None
        return ReleaseRef(
            release_id=release.release_id, build_id=release.build_id, acknowledges=self._acknowledging(release)
        )

    def _acknowledging(self, release: Release) -> bool:
        """Whether this release's attempts are asked to answer ``accepted`` when their callback runs long."""
        return (
            self.settings.acknowledge_after_s is not None
            and self.settings.result_url is not None
            and "acknowledge" in release.features
        )

    def _by_event(self, release: Release, task: TaskRef, keys: list[str]) -> bool:
        """Whether this task goes to the release's Lambda function as an asynchronous event: an attempt (a
        discovery pass is quick and answered inline), of a release that announced ``lambda_event``, from an engine
        that can send events and has a result URL for the outcome, and holds one key for the app (``keys``).

        During a rotation's window the engine holds two, and signs with the new one, which the app may not hold
        yet. On the URL, the app's refusal, signed with the key it holds, says that nothing ran, and the attempt
        is sent again later; an event's refusal reaches nobody, and the attempt would be Unknown at its lease.
        So until the previous key is dropped, attempts go to the URL, and are waited for."""
        return (
            self.event_invoker is not None
            and release.lambda_function_arn is not None
            and LAMBDA_EVENT in release.features
            and self.settings.result_url is not None
            and task.kind is not TaskKind.DISCOVER
            and len(keys) == 1
        )

    def _accepted(self, task: TaskRef, result: Any, sent: Sent | None) -> bool:
        """The endpoint answered ``accepted`` for this attempt, signed as the answer to the request ``sent``; or
        Lambda queued the attempt's event (its own answer, over the AWS API: nothing the app could forge)."""
        if result.kind == "queued":
            return task.kind is not TaskKind.DISCOVER
        if task.kind is TaskKind.DISCOVER or result.kind != "response" or result.status != 202:
            return False
        if self._signature_problem(result, sent) is not None:
            return False
        try:
            response = TaskResponse.model_validate_json(result.body)
        except ValidationError:
            return False
        return response.accepted and response.run_id == task.run_id and response.kind is task.kind

    def _post(
        self,
        release: Release,
        request: TaskRequest,
        keys: list[str],
        listen_until: datetime,
        grace_s: float,
        *,
        by_event: bool = False,
    ) -> tuple[Any, Sent | None]:
        """POST one request, signed with the app's key for its scope, and listen until ``listen_until`` and
        ``grace_s`` more for the answer: it, and what the answer must be signed for (None: nothing is signed).

        ``by_event``: the same signed request goes to the release's Lambda function as an asynchronous event
        instead, unless it is too large for one or Lambda refuses it as configured (no permission, no such
        function): then it goes to the URL, as before, and is waited for."""
        body = encode_request(request)  # a field the release's SDK did not announce is left out
        headers = {"content-type": "application/json"}
        sent: Sent | None = None
        if keys:
            scope = task_scope(request, path=url_path(release.url), app_id=release.app_id)
            header = sign(keys[0], scope, body, now=time.time(), nonce=secrets.token_hex(16))
            headers[SIGNATURE_HEADER] = header
            sent = Sent(scope=scope, header=header, signature=parse(header), body=body, keys=tuple(keys))
        if by_event and self.event_invoker is not None and release.lambda_function_arn is not None:
            payload = _task_event(url_path(release.url), headers, body)
            if len(payload) <= MAX_EVENT_BYTES:
                result = self.event_invoker.invoke_event(release.lambda_function_arn, payload)
                if result.kind != "refused":
                    return result, sent
                log.warning(
                    "run %s: Lambda refused the task event for %s (%s); sending it to the URL and waiting for it",
                    request.run_id,
                    release.lambda_function_arn,
                    result.detail,
                )
        timeout_s = max(0.0, (listen_until - self.clock()).total_seconds()) + grace_s
        result = self.invoker.invoke(release.url, body, headers, timeout_s=timeout_s)
        return result, sent

    @staticmethod
    def _signature_problem(result: Any, sent: Sent | None) -> str | None:
        """Why the answer's signature is not good as the answer to the request ``sent``, or None (and None
        where nothing was signed: an engine with no key)."""
        if sent is None:
            return None
        lowered = {k.lower(): v for k, v in result.headers.items()}
        try:
            verify(
                sent.keys,
                sent.scope.answer(),
                result.body,
                lowered.get(SIGNATURE_HEADER.lower()),
                now=time.time(),
                answers=answer_binding(sent.header, sent.body),
                nonce=sent.signature.nonce,
            )
        except SignatureError as exc:
            return exc.reason
        return None

    def _memo_missed(self, result: Any, request: TaskRequest, sent: Sent | None) -> bool:
        """The endpoint answered ``memo_miss`` to ``request`` (a short, signed answer that ran nothing, naming
        this request's run, kind and base memo: a miss relayed from another request is no answer at all)."""
        if result.kind != "response" or result.status != 200 or len(result.body) > 1024:
            return False
        if b"memo_miss" not in result.body:
            return False
        if self._signature_problem(result, sent) is not None:
            return False  # recorded as any unsigned answer is, by the usual path
        try:
            answer = TaskResponse.model_validate_json(result.body)
        except ValidationError:
            return False
        base = request.memo_base
        return (
            base is not None
            and answer.memo_miss == base.token
            and (answer.run_id, answer.kind) == (request.run_id, request.kind)
        )

    def _wake_if_release_moved(self, decision: Decision, before: RunState, release: Release) -> None:
        """A pass that just blocked on a definition conflict ran ``release``; if a newer one was synced
        meanwhile, that sync may have looked for blocked runs before this run was blocked (and on AWS
        the blocked-runs index lags the table), so wake it here. Costs one read, only when a pass blocks."""
        if not decision.changed or before.blocked_by_definition or not decision.state.blocked_by_definition:
            return
        newest = self.store.get_release(decision.state.function_id)
        if newest is not None and newest.release_id != release.release_id:
            self.apply(decision.state.id, WakeRequested(source="release_sync"), known=decision.state)

    def _respond_within_s(self, respond_by: datetime, features: frozenset[str]) -> float | None:
        """The seconds from now to ``respond_by``, in whole milliseconds rounded down, for an SDK that announced
        ``respond_within`` (None for one that did not: it is sent ``respond_by`` alone)."""
        if "respond_within" not in features:
            return None
        return int(max(0.0, (respond_by - self.clock()).total_seconds()) * 1000) / 1000

    def _task_request(
        self,
        state: RunState,
        task: TaskRef,
        memo_entries: dict[str, dict[str, Any]],
        *,
        respond_by: datetime,
        features: frozenset[str] = frozenset(),
        token: str | None = None,
        base: MemoBase | None = None,
    ) -> TaskRequest:
        """The request for ``task``: ``memo_entries`` is the whole memo, or with ``base`` what changed since it
        (and then the input is not sent either: the endpoint holds it with that memo). An attempt's request says
        when the server stops listening as ``respond_by`` (on the server's clock) and, to an SDK that announced
        ``respond_within``, as the seconds from now (``respond_within_s``), which the endpoint counts on its own
        clock from when the request arrives: its clock's skew does not matter (the time the request takes to
        arrive is not counted; the response grace covers it)."""
        common: dict[str, Any] = {
            "kind": task.kind,
            "run_id": state.id,
            "function_id": state.function_id,
            "input": None if base is not None else state.input,
            "memo": _memo_for(memo_entries, tracebacks="tracebacks" in features),
            "memo_token": token,
            "memo_base": base,
            "tracebacks": "tracebacks" in features,
            "parallel_steps": "parallel_steps" in features,
        }
        if task.kind is TaskKind.DISCOVER:
            return TaskRequest(**common)
        assert task.step_id is not None and task.generation is not None and task.phase is not None
        step = state.step(task.step_id)
        assert step is not None
        attempt = step.attempt(task.phase, task.generation)
        assert attempt is not None
        external = step.external and task.phase is Phase.FORWARD and "external_completion" in features
        token = self.completion_token(state, step.id, task.phase, attempt.generation) if external else None
        return TaskRequest(
            **common,
            step_id=step.id,
            operation=OperationInfo(
                id=attempt.operation_id, phase=task.phase, generation=attempt.generation, completion_token=token
            ),
            forward_result=step.result if task.phase is Phase.COMPENSATION else None,
            forward_result_omitted=(
                step.omitted_result if task.phase is Phase.COMPENSATION and "omitted_results" in features else None
            ),
            result_url=self.settings.result_url,
            respond_by=respond_by.timestamp(),
            respond_within_s=self._respond_within_s(respond_by, features),
            continue_after=(  # a step completed from outside ends its pass: what comes next waits for it
                self.settings.chain
                and task.kind is TaskKind.FORWARD
                and "continuation" in features
                and not external
                and not (step.group is not None and step.group == state.group)  # the next pass waits for siblings
            ),
            acknowledge_after_s=(
                self.settings.acknowledge_after_s
                if "acknowledge" in features and self.settings.result_url is not None
                else None
            ),
        )

    def _event_for(
        self,
        task: TaskRef,
        result: Any,
        *,
        chain: ReleaseRef | None = None,
        delivery_id: str | None = None,
        trust_next: bool = False,
        sent: Sent | None = None,
    ) -> DeferredEvent:
        """The event for what the endpoint answered. A signed request's answer must be signed as the answer
        to that request (``sent``)."""
        if result.kind == "unreachable":
            return InvocationFailed(task=task, failure=InvocationFailure.UNREACHABLE, detail=result.detail)
        if result.kind != "response":
            return InvocationFailed(task=task, failure=InvocationFailure.LOST, detail=result.detail)
        keys = sent is not None
        if result.status == FRONT_END_THROTTLED and _front_end_refusal(result.headers) and not _signed(result):
            # refused in front of the app (a Lambda Function URL's concurrency, an API Gateway's rate limit):
            # no code ran. An SDK never answers 429, and a signed answer would be checked as any other.
            return InvocationFailed(
                task=task,
                failure=InvocationFailure.UNREACHABLE,
                detail="throttled in front of the endpoint (HTTP 429): nothing ran; sent again with backoff",
            )
        if (problem := self._signature_problem(result, sent)) is not None:
            return InvocationFailed(
                task=task, failure=InvocationFailure.LOST, detail=f"HTTP {result.status}: {problem}"
            )
        if keys and result.status != 200:
            code = _error_code(result.body)
            if result.status in (400, 401, 405, 413) and code in NOTHING_RAN_ANYWHERE:
                # a signed refusal of this exact request for a reason that holds wherever it was sent: no
                # instance of the endpoint runs it, so it may be sent again
                return InvocationFailed(
                    task=task,
                    failure=InvocationFailure.UNREACHABLE,
                    detail=f"endpoint refused the task: HTTP {result.status} {code}",
                )
            # any other signed refusal (received before, too late to verify, a replay memory that could not
            # be checked) says nothing ran *there*: it may have run before or elsewhere, so the outcome is
            # not known; it is never simply sent again
            return InvocationFailed(
                task=task, failure=InvocationFailure.LOST, detail=f"HTTP {result.status}: the endpoint answered {code}"
            )
        if result.status != 200:
            return InvocationFailed(task=task, failure=InvocationFailure.LOST, detail=f"HTTP {result.status}")
        try:
            response = TaskResponse.model_validate_json(result.body)
        except ValidationError as exc:
            return InvocationFailed(
                task=task, failure=InvocationFailure.LOST, detail=f"malformed response: {exc.error_count()} errors"
            )
        if (problem := _values_problem(response.discovery, response.attempt, response.next)) is not None:
            # the SDK refuses such values itself; an answer that carries one cannot be stored as it is
            return InvocationFailed(
                task=task, failure=InvocationFailure.LOST, detail=f"malformed response: a value {problem}"
            )
        if task.kind is TaskKind.DISCOVER:
            if response.discovery is None:
                return InvocationFailed(task=task, failure=InvocationFailure.LOST, detail="response has no discovery")
            assert task.seq is not None
            return DiscoveryReported(seq=task.seq, response=response.discovery, chain=chain, delivery_id=delivery_id)
        if response.attempt is None:
            return InvocationFailed(task=task, failure=InvocationFailure.LOST, detail="response has no attempt outcome")
        assert task.step_id is not None and task.generation is not None and task.phase is not None
        return AttemptReported(
            step_id=task.step_id,
            phase=task.phase,
            generation=task.generation,
            response=response.attempt,
            next=response.next if trust_next else None,
            chain=chain,
            delivery_id=delivery_id,
        )

    # ---- late results and timers -----------------------------------------------------

    def submit_late_result(self, body: bytes, headers: dict[str, str]) -> Decision:
        """The SDK's late submission (decisions 6.15), through the API's result route: verified
        (:meth:`_verified_late_result`) and fenced like any result; what it lets the run do next is queued."""
        late, state, _ = self._verified_late_result(body, headers)
        decision = self.apply(
            late.run_id,
            AttemptReported(
                step_id=late.step_id,
                phase=late.phase,
                generation=late.generation,
                response=late.attempt,
                source="late_submission",
                next=self._trusted_next(late, state),
            ),
        )
        if decision.rejection is not None:
            raise NotFoundError(decision.rejection.message, code=decision.rejection.code)
        return decision

    def submit_result(
        self, body: bytes, headers: dict[str, str], *, budget_s: float | None = None, path: str | None = None
    ) -> Decision:
        """An attempt's outcome posted to the result function (an acknowledged attempt's, or a late one): verified
        and fenced as a late result, and, in the same write, the run's next task authorized with the newest
        release; that task is then invoked here, as a dispatcher chains, for at most ``RESULT_CARRY_ON_S``
        (``budget_s``: what the invocation has left). A store that refuses the write raises
        :class:`StoreUnavailableError`: the SDK holds the outcome and posts it again."""
        late, state, fresh = self._verified_late_result(body, headers, path=path, remembered=True)
        # No message carries what this invocation authorizes: its own carrier, which no message is, makes every
        # message of the run, and the sweeper, wait lease_watch_grace_s past the lease of an attempt it authorized
        # (its answer may be deferred to the queue); an attempt left in flight is watched by a lease timer below.
        release = self._newest_release(state.function_id) if state is not None else None
        events = release is not None and release.lambda_function_arn is not None and self.event_invoker is not None
        carrier = RESULT_FUNCTION_EVENTS_CARRIER if events else RESULT_FUNCTION_CARRIER
        with carried_by(f"{carrier}{uuid.uuid4().hex}"):
            return self._submit_result(late, state, budget_s, events=events, fresh=fresh)

    def _submit_result(
        self, late: LateResult, state: RunState | None, budget_s: float | None, *, events: bool, fresh: bool = True
    ) -> Decision:
        deadline = time.monotonic() + budget_s if budget_s is not None else None
        carry_until = time.monotonic() + RESULT_CARRY_ON_S
        if deadline is not None:
            carry_until = min(carry_until, deadline)
        release: Release | None = None
        if self.may_chain(deadline, carry_until) and state is not None:
            release = self._newest_release(state.function_id)
        ref = self._release_ref(release)
        event = AttemptReported(
            step_id=late.step_id,
            phase=late.phase,
            generation=late.generation,
            response=late.attempt,
            source="late_submission",
            next=self._trusted_next(late, state),
            chain=ref,
            delivery_id=new_delivery_id() if ref is not None else None,
        )
        try:
            decision = self._apply_retrying(late.run_id, event, known=state, deadline=deadline, known_fresh=fresh)
        except StoreUnavailableError as exc:
            # The store will not take it: the outcome is kept on the queue (deferred.py), as a dispatcher keeps an
            # answer it has, and the post is answered as taken, so the outcome no longer lives only in the SDK's
            # process. Its receiver records it, and claims a next task this write may have authorized unseen.
            if state is None or not self._defer(late.run_id, event, exc):
                raise
            return Decision(state=state)
        if decision.rejection is not None:
            raise NotFoundError(decision.rejection.message, code=decision.rejection.code)
        delivered = self._carry_on(decision, release, deadline, None, chain_until=carry_until)
        if delivered.in_flight is not None and delivered.in_flight.kind is not TaskKind.DISCOVER:
            # No message was received here to be the lease timer of the attempt this left in flight (answered
            # "accepted", or sent as an event): a lease timer this function sends watches it, comes back when its
            # lease ends (later, if heartbeats extended it) and is done once nothing it watches is in flight
            # (docs/design/dispatch.md). An attempt this function authorized and died before invoking or hearing
            # from is noticed by the sweeper. One timer for a run's steps sent as events: while a timer sent here
            # for the run is still on the queue and due before this attempt's lease ends, it watches this attempt
            # too (TaskRef.watches_before), and none is sent. Not for an attempt an endpoint may answer inline: its
            # answer could be deferred to the queue while the store refuses it, and only its own timer may decide
            # at its lease.
            now = self.clock()
            lease_ends_at = now + timedelta(seconds=max(0.0, delivered.redeliver_after_s))
            took_s = _attempt_took_s(decision.state, late.step_id, late.phase, late.generation)
            if events and self._watch_lease_by_schedule(
                decision.state, delivered.in_flight, now, lease_ends_at, after_s=took_s
            ):
                self._emit("lease_watch_scheduled", delivered.in_flight)
            elif events and self.run_lease_timers.watching(
                # judged at its authorization as written, if later: that is what the returning timer compares with
                # watches_before (a wall clock stepped back since the write would otherwise leave it unwatched)
                late.run_id,
                max(now, delivered.authorized_at or now),
                lease_ends_at,
            ):
                self._emit("lease_timer_shared", delivered.in_flight)
            else:
                wait_s = min(max(1.0, delivered.redeliver_after_s), LEASE_TIMER_MAX_DELAY_S)
                watches_before = now + timedelta(seconds=wait_s - LEASE_TIMER_SHARE_MARGIN_S)
                update: dict[str, Any] = {"lease_timer": True}
                if events:
                    update["watches_before"] = watches_before
                self.queue.send(delivered.in_flight.model_copy(update=update), wait_s, app_id=decision.state.app_id)
                if events:
                    # when it is due: SQS delays by whole seconds (and from the send, a few milliseconds later)
                    due_at = now + timedelta(seconds=math.ceil(wait_s))
                    self.run_lease_timers.sent(late.run_id, due_at, watches_before, wait_s)
        if events and self._lease_watched_by_schedule(decision.state, late.step_id, late.phase, late.generation):
            # Its outcome is recorded: the lease watch parked for it is not needed, and is not billed once deleted.
            # Last, after the next attempt is sent and watched: the delete is no part of that attempt's lease.
            self.queue.unwatch_lease(_lease_watch_key(late.run_id, late.step_id, late.phase, late.generation))
        return decision

    def _watch_lease_by_schedule(
        self, state: RunState, task: TaskRef, now: datetime, lease_ends_at: datetime, *, after_s: float | None
    ) -> bool:
        """Watch a long lease with a timer that can be taken back (``scheduled_lease_from_s``), after a step that took
        ``after_s``: due ``SCHEDULER_LATENESS_S`` before the lease ends, since Scheduler may deliver it up to that
        late. False when the lease is short, the step before was quick beside it (an SQS timer is then shared by
        many steps), or the queue has no such timer: then an SQS timer watches it, as before."""
        from_s = self.settings.scheduled_lease_from_s
        if from_s is None or task.step_id is None or task.phase is None or task.generation is None:
            return False
        lease_s = (lease_ends_at - now).total_seconds()
        if lease_s < from_s or after_s is None or after_s * self.settings.scheduled_lease_share < lease_s:
            return False
        key = _lease_watch_key(state.id, task.step_id, task.phase, task.generation)
        at = max(now, lease_ends_at - timedelta(seconds=SCHEDULER_LATENESS_S))
        if not self.queue.watch_lease(task.model_copy(update={"lease_timer": True}), at, key=key, app_id=state.app_id):
            return False
        self.lease_watches.add(key)
        return True

    def _lease_watched_by_schedule(self, state: RunState, step_id: str, phase: Phase, generation: int) -> bool:
        """Whether that attempt, now settled, may have had its lease watched by a schedule, which is then deleted:
        this process parked one for it, or its lease was long enough and it took long beside it (another container
        may have parked it). A quick step with a long timeout is neither, and costs no request; a schedule that
        was never made costs a delete that finds nothing, one not deleted costs its delivery."""
        from_s = self.settings.scheduled_lease_from_s
        attempt = _attempt(state, step_id, phase, generation)
        if from_s is None or attempt is None or attempt.status is AttemptStatus.AUTHORIZED:
            return False
        if self.lease_watches.parked(_lease_watch_key(state.id, step_id, phase, generation)):
            return True
        if attempt.authorized_at is None or attempt.respond_by is None or attempt.settled_at is None:
            return False
        window = (attempt.respond_by - attempt.authorized_at).total_seconds() + (attempt.lease_grace_s or 0.0)
        took = (attempt.settled_at - attempt.authorized_at).total_seconds()
        return window >= from_s and took * self.settings.scheduled_lease_share >= window

    def _verified_post(
        self,
        body: bytes,
        headers: dict[str, str],
        model: type[_Posted],
        scope_of: Callable[..., Scope],
        *,
        path: str | None,
        limit: int,
        what: str,
        read: Callable[[_Posted], RunState | None] | None = None,
    ) -> tuple[_Posted, RunState | None]:
        """A message an SDK posted unasked (a late result, a heartbeat), checked in this order: its size, its
        signature header's form (the body is not parsed without one), its shape, its ids, the key id against the
        keys of its run's app (the only read), and its signature over its scope at ``path`` (by default the result
        URL's), with the keys read afresh too, so an emergency rotation refuses the old key at once. Every refusal
        of the signature, whether the run exists or not, is the same answer: a caller without the run's key learns
        nothing about which runs exist. The run as read for the check (None on a server with no key); ``read``
        gets it for a post otherwise (by default, ``RunStore.get``)."""
        if len(body) > limit:
            raise PayloadTooLargeError(f"a {what} is at most {limit} bytes", limit=limit)
        masters = self.master_keys()
        header = {k.lower(): v for k, v in headers.items()}.get(SIGNATURE_HEADER.lower())
        signature: Signature | None = None
        if masters:
            try:
                signature = parse(header)  # an unsigned or malformed header: the body is not even parsed
            except SignatureError:
                raise _late_result_refused() from None
        try:
            posted = model.model_validate_json(body)
        except ValidationError as exc:
            if masters:
                raise _late_result_refused() from None
            raise InvalidRequestError(f"malformed {what}", errors=exc.errors(include_url=False)) from None
        if not all(0 < len(i) <= MAX_ID_LENGTH and i.isprintable() for i in (posted.run_id, posted.step_id)):
            raise _late_result_refused() if masters else InvalidRequestError(f"malformed {what}")  # nothing is read
        if signature is None:
            return posted, None
        state = read(posted) if read is not None else self.store.get(posted.run_id)
        keys = [app_key(master, state.app_id) for master in masters] if state is not None else []
        if signature.key_id not in {key_id(key) for key in keys}:
            raise _late_result_refused()  # no such run, or a key this server does not hold for its app
        assert state is not None
        scope = scope_of(posted, path=path or url_path(self.settings.result_url or "/v1/results"), app_id=state.app_id)
        try:
            verify(keys, scope, body, header, now=time.time())
            verify(self.app_keys(state.app_id, fresh=True), scope, body, header, now=time.time())
        except SignatureError:
            raise _late_result_refused() from None
        return posted, state

    def _verified_late_result(
        self, body: bytes, headers: dict[str, str], *, path: str | None = None, remembered: bool = False
    ) -> tuple[LateResult, RunState | None, bool]:
        """A posted outcome, checked as :meth:`_verified_post` says (at most ``MAX_LATE_RESULT_BYTES``), and its
        values. The run as read for the check (None on a server with no key), and whether it was read.

        ``remembered``: the check may use what this process remembers of the run (``RunStore.cached``), with no
        read, when that holds the attempt the outcome names still in flight: the usual case, since the result
        function that authorized it is most often the one its outcome comes back to. A run's app and an
        attempt's build never change, so the signature check and the trusted next step hold on it; the decision
        is fenced by its write (:meth:`apply`, ``known_fresh``)."""
        read = True

        def remembered_or_read(posted: LateResult) -> RunState | None:
            nonlocal read
            cached = self.store.cached(posted.run_id) if remembered else None
            if cached is not None and _attempt_in_flight(cached, posted.step_id, posted.phase, posted.generation):
                read = False
                return cached
            return self.store.get(posted.run_id)

        late, state = self._verified_post(
            body,
            headers,
            LateResult,
            late_result_scope,
            path=path,
            limit=MAX_LATE_RESULT_BYTES,
            what="late result",
            read=remembered_or_read,
        )
        if (problem := _values_problem(late.attempt, late.next)) is not None:
            raise InvalidRequestError(f"the late result's value {problem}", code="invalid_value")
        return late, state, read

    def submit_heartbeat(self, body: bytes, headers: dict[str, str], *, path: str | None = None) -> HeartbeatReply:
        """A running callback's heartbeat (decision 33), checked as a late result is (its size first, then its
        signature, with the same answer for every refusal), for the attempt in flight. Its reply says whether
        the run is stopping, so that the callback can finish or clean up."""
        beat, state = self._verified_post(
            body, headers, Heartbeat, heartbeat_scope, path=path, limit=MAX_HEARTBEAT_BYTES, what="heartbeat"
        )
        state = state or self.store.get(beat.run_id)  # on a server with no key, the run is read only here
        if state is None:
            raise NotFoundError(f"no run {beat.run_id!r}", run_id=beat.run_id)
        if (problem := json_value_problem(beat.details)) is not None or len(
            json.dumps(beat.details, separators=(",", ":"))
        ) > MAX_HEARTBEAT_DETAILS_BYTES:
            raise InvalidRequestError(
                f"heartbeat details must be JSON of at most {MAX_HEARTBEAT_DETAILS_BYTES} bytes"
                + (f" (a value {problem})" if problem else ""),
                code="invalid_value",
            )
        event = HeartbeatReported(
            step_id=beat.step_id, phase=beat.phase, generation=beat.generation, details=beat.details, seq=beat.seq
        )
        decision = self.apply(beat.run_id, event, known=state)
        step = decision.state.step(beat.step_id)
        attempt = step.current(beat.phase) if step is not None else None
        current = (
            attempt is not None and attempt.generation == beat.generation and attempt.status is AttemptStatus.AUTHORIZED
        )
        stop = decision.state.stop_intent
        return HeartbeatReply(
            current=current,
            stop_requested=(stop.kind.value if stop is not None and current and beat.phase is Phase.FORWARD else None),
            lease_expires_at=(
                attempt.lease_expires_at.timestamp() if current and attempt and attempt.lease_expires_at else None
            ),
        )

    def _trusted_next(self, late: LateResult, state: RunState | None) -> DiscoveryResponse | None:
        """What an acknowledged attempt's replay found next, when the build that found it is the one the run
        would replay next (R1: the newest release's); otherwise None, and the run's own discovery finds it."""
        if late.next is None or late.build_id is None or late.phase is not Phase.FORWARD or not self.settings.chain:
            return None
        state = state or self.store.get(late.run_id)
        if state is None:
            return None
        step = state.step(late.step_id)
        attempt = step.attempt(late.phase, late.generation) if step is not None else None
        newest = self._newest_release(state.function_id)
        if attempt is None or newest is None or not (attempt.build_id == newest.build_id == late.build_id):
            return None
        return late.next

    def sweep(
        self, *, grace_s: float = SWEEP_GRACE_S, limit: int = SWEEP_LIMIT, budget_s: float = SWEEP_BUDGET_S
    ) -> SweepReport:
        """Find runs whose work is overdue by more than ``grace_s`` with nothing on its way to move it, and
        repair them (issue 12): a task message or a deadline or probe schedule lost after the write that
        needed it. Reads the index of runs to check (``Store.runs_to_check``), never the whole table, ``limit``
        at a time, until none is due or ``budget_s`` has passed. A run whose work is not overdue gets its check
        time moved on (one small write): to when its work is due, and a run unchanged for a while to after as
        long again (``SWEEP_BACKOFF_MAX_S`` at most), so the work of a pass follows the runs actually due."""
        now = self.clock()
        before = now - timedelta(seconds=grace_s)
        report = SweepReport()
        until = time.monotonic() + budget_s
        seen: set[str] = set()
        while time.monotonic() < until:
            # a run that failed stays due: ask past it
            batch = [r for r in self.store.runs_to_check(before, limit + len(report.failed)) if r not in seen]
            if not batch:
                break
            for run_id in batch:
                if time.monotonic() >= until:
                    break
                seen.add(run_id)
                report.checked += 1
                try:
                    repaired = self._sweep_run(run_id, now, before)
                except Exception:  # one run's trouble must not keep the sweeper from the others
                    report.failed.append(run_id)
                    log.exception("sweeper: could not look at run %s; it is looked at again next pass", run_id)
                    continue
                if repaired:
                    report.repaired.append(run_id)
        return report

    # ---- steps completed from outside (decision 32) ----------------------------------

    def completion_token(self, state: RunState, step_id: str, phase: Phase, generation: int) -> str:
        """The token that completes this attempt from outside: it names the attempt, and a MAC made with the run's
        own secret says the engine handed it out (no one can make one for another attempt, or another run). The
        secret is kept with the run: a token outlives a key rotation and a ``ryusen dev`` restart. A run started
        before runs had a secret makes its tokens with the master key."""
        if state.secret:
            return _completion_token(state.secret, state.id, step_id, phase, generation)
        keys = self.master_keys()
        return _completion_token(keys[0] if keys else "", state.id, step_id, phase, generation)

    def read_completion_token(self, token: str) -> tuple[str, str, Phase, int]:
        """The attempt ``token`` names, if this deployment made it; else NotFoundError."""
        named = completion_binding(token)
        state = self.store.get(named[0]) if named is not None else None
        if named is not None and state is not None:
            keys = [state.secret] if state.secret else (self.master_keys(fresh=True) or [""])
            if any(hmac.compare_digest(_completion_token(key, *named), token) for key in keys):
                return named
        raise NotFoundError("no step waits for this completion token", code="completion_not_found")

    def complete(self, token: str, *, result: Any = None, error: ErrorInfo | None = None, source: str) -> Decision:
        """A step's completion from outside: the result (or the error) for the attempt ``token`` names.
        ConflictError ``completion_refused`` for a token whose attempt is no longer waiting (the completion is
        kept on it, as stale)."""
        _refuse_reserved_error(error)
        run_id, step_id, phase, generation = self.read_completion_token(token)
        limit = self.settings.engine.max_value_bytes
        if error is None and (size := value_size(result)) > limit:
            raise PayloadTooLargeError(f"the result is {size} bytes serialized; the limit is {limit}", limit=limit)
        event = CompletionReported(
            step_id=step_id, phase=phase, generation=generation, result=result, error=error, source=source
        )
        decision = self.apply(run_id, event)
        if decision.rejection is not None and decision.rejection.code in ("result_too_large", "run_too_large"):
            budget = limit if decision.rejection.code == "result_too_large" else self.settings.engine.max_run_bytes
            raise PayloadTooLargeError(decision.rejection.message, limit=budget)
        if decision.rejection is not None:
            raise ConflictError(decision.rejection.message, code=decision.rejection.code)
        if decision.note is not None and decision.note.startswith(COMPLETION_REFUSED):
            raise ConflictError(decision.note.split(": ", 1)[-1], code=COMPLETION_REFUSED)  # kept, as stale
        return decision

    def submit_completion(self, body: bytes, headers: dict[str, str], *, path: str | None = None) -> Decision:
        """A step's completion the app posted to the result URL (decision 32), signed with its key and checked as a
        late result is (:meth:`_verified_post`): the attempt it names must be the one its token names. Then taken
        as :meth:`complete` takes one from the operator API."""
        post, _ = self._verified_post(
            body, headers, CompletionPost, completion_scope, path=path, limit=MAX_LATE_RESULT_BYTES, what="completion"
        )
        if completion_binding(post.token) != (post.run_id, post.step_id, post.phase, post.generation):
            raise NotFoundError("no step waits for this completion token", code="completion_not_found")
        what, value = ("the error's data", post.error.data) if post.error is not None else ("the result", post.result)
        if (problem := json_value_problem(value)) is not None:
            raise InvalidRequestError(f"{what} {problem}", code="invalid_value")
        return self.complete(post.token, result=post.result, error=post.error, source="app")

    def presume_started(self, tasks: Iterable[TaskRef], reason: str) -> None:
        """Each of ``tasks`` was authorized after the state the store holds was kept (``ryusen dev`` killed between
        saves): its attempt is Unknown, not sent again as if it had never started (``StartMayBeLost``)."""
        for task in tasks:
            try:
                self.apply(task.run_id, StartMayBeLost(task=task, reason=reason))
            except NotFoundError:
                continue  # a run the store did not keep: nothing of it is sent again either

    def recover(self, run_ids: Iterable[str]) -> SweepReport:
        """Look at each of ``run_ids`` now, as the sweeper would once their work is overdue: for a store brought
        back without its queue and schedules (``ryusen dev``'s data directory), where no run's work has anything on
        its way. Work due later (a lease, a deadline) is left to the sweeper, which finds it when it is due."""
        now = self.clock()
        report = SweepReport()
        for run_id in run_ids:
            report.checked += 1
            try:
                if self._sweep_run(run_id, now, now, messages_lost=True):
                    report.repaired.append(run_id)
            except Exception:
                report.failed.append(run_id)
                log.exception("could not look at run %s; the sweeper looks at it again", run_id)
        return report

    def _sweep_run(self, run_id: str, now: datetime, before: datetime, *, messages_lost: bool = False) -> bool:
        """Look at one run the index named; whether it needed (and got) a repair."""
        repaired = False
        state = self.store.get(run_id)
        if state is None:
            return False
        due = state.work_due_at()
        if due is not None and (due <= before or messages_lost):  # lost messages: work due later has none either
            decision = self.apply(run_id, SweepRequested(messages_lost=messages_lost), known=state)
            if decision.changed or decision.commands:
                repaired = True
                log.warning(
                    "sweeper: run %s has had work due since %s and nothing moved it (its message or schedule was"
                    " lost, or is only late): %s",
                    run_id,
                    due.isoformat(),
                    ", ".join(type(c).__name__ for c in decision.commands) or decision.note or "decided again",
                )
            state = decision.state
            # Judged on the run as the repair left it. Work the repair re-sent keeps its old due time (it may be a
            # message merely slow in a backlog): the run is looked at again after as long again as that work has
            # been overdue, so a backlog gets a few duplicates, never one per pass. Work that is due for the first
            # time (a probe overdue by a day after an outage wakes the run, which queues a task) is looked at when
            # any fresh work is: past the grace after its due time.
            due = state.work_due_at()
            if due is not None and due <= before:
                if state.phase is not RunPhase.FINISHED:
                    self.store.defer_check(run_id, now + max(now - due, timedelta(seconds=SWEEP_GRACE_S)))
                return repaired
        # A write that queues work has it looked at within CHECK_HORIZON_S: the store rewrites the check time
        # with the first write after a run was unchanged that long. So a quiet run may wait as long again.
        quiet = (now - state.updated_at).total_seconds()
        later = now + timedelta(seconds=min(max(quiet, CHECK_HORIZON_S), SWEEP_BACKOFF_MAX_S))
        if due is not None:
            later = min(due, later)
        if state.phase is not RunPhase.FINISHED:
            self.store.defer_check(run_id, later)
        return repaired

    def fire_timer(self, timer: TimerRef) -> Decision | None:
        """What the Scheduler target (or the local runtime for moto) does when a timer is due."""
        if self.store.get(timer.run_id) is None:
            return None
        if timer.kind is TimerKind.DEADLINE:
            return self.apply(timer.run_id, StopRequested(kind="timeout"))
        return self.apply(timer.run_id, WakeRequested(source="probe"))


def _check_manifest_bounds(manifest: Manifest) -> None:
    """A manifest within the limits a release is stored with, or a 4xx that says which it breaks."""
    if len(manifest.functions) > MAX_MANIFEST_FUNCTIONS:
        raise InvalidRequestError(
            f"the manifest declares {len(manifest.functions)} functions; a release has at most"
            f" {MAX_MANIFEST_FUNCTIONS}: split the app",
            code="manifest_too_large",
            functions=len(manifest.functions),
            limit=MAX_MANIFEST_FUNCTIONS,
        )
    named = [("app id", manifest.app_id), ("release id", manifest.release_id), ("build id", manifest.build_id)]
    for what, value in [*named, *(("function id", fn.id) for fn in manifest.functions)]:
        if not 0 < len(value) <= MAX_ID_LENGTH or not value.isprintable():
            raise InvalidRequestError(
                f"the manifest's {what} must be 1 to {MAX_ID_LENGTH} printable characters"
                f" (it has {len(value)}; it is not repeated here)",
                code="invalid_manifest",
                limit=MAX_ID_LENGTH,
            )
    size = len(manifest.model_dump_json().encode())
    if size > MAX_MANIFEST_BYTES:
        raise InvalidRequestError(
            f"the manifest is {size} bytes; a release is at most {MAX_MANIFEST_BYTES}",
            code="manifest_too_large",
            limit=MAX_MANIFEST_BYTES,
        )


class SignatureRejectedError(ServerError):
    code = "invalid_signature"
    status = 401


def _late_result_refused() -> SignatureRejectedError:
    """The one answer to a late result whose signature does not hold, for whatever reason (no such run included)."""
    return SignatureRejectedError(
        "not a late result signed by the app of its run with a key this server holds (checked: the signature"
        " header, the run's app, the key id, the attempt, the result URL's path, the time)"
    )


TASK_ADAPTER: TypeAdapter[TaskRef] = TypeAdapter(TaskRef)
TIMER_ADAPTER: TypeAdapter[TimerRef] = TypeAdapter(TimerRef)

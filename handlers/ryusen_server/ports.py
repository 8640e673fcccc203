"""What the engine needs from the world: a store, a task queue, timers, an invoker.

Each port has a DynamoDB/SQS/Scheduler/HTTP implementation (``aws/``,
``invoker.py``) and an in-memory twin (``memory.py``) used by
``ryusen.testing``; one contract suite (tests/functional/test_store_contract.py)
runs against both stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from ryusen._internal.wire import FunctionManifest

from .core.model import RunPhase, RunState, TaskRef, TimerRef
from .deferred import DeferredAnswer, WakeOrder


class ServerError(Exception):
    """Base of the server's errors; ``code`` and ``status`` are what the API returns."""

    code = "server_error"
    status = 500

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class NotFoundError(ServerError):
    code = "not_found"
    status = 404


class ConflictError(ServerError):
    code = "conflict"
    status = 409


class InvalidRequestError(ServerError):
    code = "invalid_request"
    status = 422


class PayloadTooLargeError(ServerError):
    code = "payload_too_large"
    status = 413


class StoreUnavailableError(ServerError):
    """The store did not take a call, past its client's own retries: throttled (a hot partition, a new table's
    warm-up, a throttled index) or failing (a 5xx, a timeout, an answer lost on the way). Nothing is known to
    have changed unless the call was a write whose answer was lost: a conditional write tried again then
    meets its own first try (the fence says so), so every caller may simply try again later."""

    code = "store_unavailable"
    status = 503


class VersionConflictError(Exception):
    """The run moved on since it was read: re-read and decide again."""

    def __init__(self, current: RunState | None = None) -> None:
        super().__init__("run version changed")
        self.current = current


class RunExistsError(Exception):
    """A run with this id, or this function's idempotency key, already exists."""

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id)
        self.run_id = run_id


@dataclass(frozen=True, slots=True, kw_only=True)
class Release:
    """One synced release of an app: where it is served and what it declares (decisions 6.13)."""

    app_id: str
    url: str
    release_id: str
    build_id: str
    functions: tuple[FunctionManifest, ...]
    synced_at: datetime
    signed: bool = True
    features: frozenset[str] = frozenset()
    """What the release's SDK announced it understands (``X-Ryusen-Features``); a request field it did not
    announce is never sent to it."""
    lambda_function_arn: str | None = None
    """The Lambda function that serves the release, when its SDK announced ``lambda_event=<ARN>``: attempts may be
    sent to it as asynchronous events (:class:`EventInvoker`) rather than waited on at ``url``."""

    def function(self, function_id: str) -> FunctionManifest | None:
        for f in self.functions:
            if f.id == function_id:
                return f
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunPage:
    runs: list[dict[str, Any]]
    """Each run as a list shows it (``core.view.run_summary_view``): a store may keep this apart from the run and
    rewrite it only when it changes (a running run's step count may lag: ``DynamoStore`` rewrites it when the
    run's phase, words or blockers change, at 100 steps and each doubling after, and when it ends)."""
    cursor: str | None = None


@dataclass(slots=True)
class RequestCounter:
    """Counts AWS and endpoint requests for benchmarks (per adapter, by kind)."""

    counts: dict[str, int] = field(default_factory=dict)
    bytes_sent: dict[str, int] = field(default_factory=dict)
    largest_item: dict[str, int] = field(default_factory=dict)
    """The largest single item a request of each kind wrote (bytes, as DynamoDB bills them)."""
    item_sizes: list[int] | None = None
    """If a list, every item written is appended, by size (benchmarks: medians)."""
    write_units: int = 0
    """DynamoDB write units billed for the items written: one per KB of each, twice in a transaction."""

    def add(self, kind: str, nbytes: int = 0, *, items: Sequence[int] = (), transactional: bool = False) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if items:
            self.write_units += sum(max(1, -(-size // 1024)) for size in items) * (2 if transactional else 1)
        if nbytes:
            self.bytes_sent[kind] = self.bytes_sent.get(kind, 0) + nbytes
        if items and (largest := max(items)) > self.largest_item.get(kind, 0):
            self.largest_item[kind] = largest
        if items and self.item_sizes is not None:
            self.item_sizes.extend(items)

    def reset(self) -> None:
        self.counts.clear()
        self.bytes_sent.clear()
        self.largest_item.clear()
        self.write_units = 0
        if self.item_sizes is not None:
            self.item_sizes.clear()


class RunStore(Protocol):
    def get(self, run_id: str) -> RunState | None: ...

    def cached(self, run_id: str) -> RunState | None:
        """The newest state of the run this process has read or written, with no request; None if it has none.
        It may be out of date: a decision on it is fenced by its conditional write, and one that writes nothing
        is taken again on a read (``Engine.apply``, ``known_fresh``)."""

    def seal_key(self) -> str:
        """The deployment's key for sealing what the engine puts on its own queue (deferred answers, wake
        orders): made at random the first time, kept in the store, never rotated with the signing keys (an
        emergency rotation must not void what is on the queue). Whoever may read the store may act on runs
        anyway; whoever may only send to the queue (the Scheduler's role) cannot forge a seal."""

    def create(self, state: RunState) -> None:
        """Write a new run; raise :class:`RunExistsError` if its id or idempotency key is taken."""

    def save(self, state: RunState, *, expected_version: int) -> None:
        """Replace the run iff its stored version is ``expected_version``, else :class:`VersionConflictError`."""

    def run_for_idempotency_key(self, function_id: str, key: str) -> str | None:
        """The run started for ``function_id`` with idempotency key ``key``, if any."""

    def list_runs(
        self,
        *,
        function_id: str | None = None,
        phase: str | None = None,
        outcome: str | None = None,
        recovery: str | None = None,
        blocked: bool | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> RunPage:
        """Newest first, each run as a list shows it (:class:`RunPage`); read one run with :meth:`get` for all
        of it. A page holds at
        most ``limit`` runs; a store that bounds the reads of a page may return fewer, even none, with a
        cursor. The cursor is None exactly when no more runs match. ``recovery`` and ``blocked`` (the run has a
        blocker, or has none) filter as ``phase`` and ``outcome`` do."""

    def runs_blocked_by_definition(self, function_id: str) -> list[str]: ...

    def runs_to_check(self, before: datetime, limit: int) -> list[str]:
        """Up to ``limit`` unfinished runs whose check time is at or before ``before``, earliest first (an index,
        never the whole table). A write sets a run's check time no later than the first moment its work could
        be overdue: its ``work_due_at``, at most :data:`CHECK_HORIZON_S` after the write. A write that changes
        only the journal may leave it, except the first write after the run was unchanged for
        :data:`CHECK_HORIZON_S`, which always sets it: so the sweeper may put off a quiet run by as long as it
        has been quiet (``defer_check``)."""
        ...

    def defer_check(self, run_id: str, at: datetime) -> None:
        """Move an unfinished run's check time to ``at`` (the sweeper looked at it); a finished run is left
        out of the index."""
        ...

    def put_release(self, release: Release) -> None: ...

    def get_release(self, function_id: str, *, consistent: bool = True) -> Release | None:
        """The newest synced release that declares ``function_id``. ``consistent=False`` may answer from a copy
        a moment behind (DynamoDB's eventually consistent read, half the price): it may miss a sync of the last
        second or so, or name the release before it."""

    def list_releases(self) -> list[Release]:
        """The newest release of every app."""


CHECK_HORIZON_S = 600.0
"""The longest a run's check time may lie after the write that set it: work queued by a later write that
updates only the journal (not the head) is looked at within this time if its message was lost."""


def check_time(state: RunState, written_at: datetime) -> datetime | None:
    """A run's check time as of a write at ``written_at``: None once finished."""
    if state.phase is RunPhase.FINISHED:
        return None
    horizon = written_at + timedelta(seconds=CHECK_HORIZON_S)
    due = state.work_due_at()
    return min(due, horizon) if due is not None else horizon


class TaskQueue(Protocol):
    def send(self, task: TaskRef, delay_s: float = 0.0, *, app_id: str | None = None) -> None:
        """Put a task on the queue; ``app_id`` is its run's app, whose fair share of dispatch it is sent in
        (its message group, ``aws/queue.py``)."""

    def defer(self, answer: DeferredAnswer, delay_s: float = 0.0) -> None:
        """Keep an answer the store would not take on the queue, to be recorded when it is received
        (:meth:`Engine.apply_deferred`). Raises :class:`DeferralRefusedError` for one the queue cannot carry."""

    def wake(self, order: WakeOrder, delay_s: float = 0.0) -> None:
        """Put a release sync's wake on the queue (:meth:`Engine.carry_out_wake`)."""

    def watch_lease(self, task: TaskRef, at: datetime, *, key: str, app_id: str | None = None) -> bool:
        """Deliver the lease timer ``task`` at ``at`` or up to a minute later, in a way :meth:`unwatch_lease` can take
        back before then (an EventBridge Scheduler schedule on AWS). False when this queue has no such way, or the
        schedule was refused: nothing was sent, and the caller sends an ordinary timer."""

    def unwatch_lease(self, key: str) -> None:
        """Take back the lease timer ``key`` if it has not been delivered. Best effort: one that could not be taken
        back is delivered, finds its attempt settled, and is done."""


class TimerService(Protocol):
    def schedule(self, timer: TimerRef) -> None: ...

    def cancel(self, timer: TimerRef) -> None:
        """Drop a timer that will not be needed; one already fired or gone is fine."""


@dataclass(frozen=True, slots=True, kw_only=True)
class InvokeResult:
    """What came back from one HTTP invocation of a user endpoint."""

    kind: str
    """``response``; ``unreachable`` (nothing was sent); ``timed_out`` (sent, no answer in time); ``lost``
    (sent, then the connection dropped); from an :class:`EventInvoker`, also ``queued`` and ``refused``."""
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    detail: str = ""


class Invoker(Protocol):
    def invoke(self, url: str, body: bytes, headers: dict[str, str], *, timeout_s: float) -> InvokeResult: ...


class EventInvoker(Protocol):
    """Sends a task to a Lambda endpoint as an asynchronous event (``InvocationType=Event``): Lambda queues it and
    answers at once. Its result's ``kind`` is ``queued`` (Lambda took the event), ``unreachable`` (it provably did
    not: a throttle, a refusal), ``lost`` (sent, and whether it was queued is not known) or ``refused`` (it never
    will be as configured: no permission, no such function, too large; the engine then uses the URL)."""

    def invoke_event(self, function_arn: str, payload: bytes) -> InvokeResult: ...

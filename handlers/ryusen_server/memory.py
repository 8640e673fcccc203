"""In-memory twins of the store, queue and timers, on a clock the caller controls.

They keep the semantics the engine relies on from DynamoDB and SQS: a save
fails unless the stored version matches; a received message stays invisible
until deleted or its visibility lapses, then comes back.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

import pydantic_core

from .aws import journal
from .core import decide as _core
from .core.model import RunState, TaskRef, TimerRef
from .core.view import run_summary_view
from .deferred import DeferredAnswer, DeferredMessage, WakeMessage, WakeOrder
from .ports import (
    InvalidRequestError,
    Release,
    RequestCounter,
    RunExistsError,
    RunPage,
    VersionConflictError,
    check_time,
)


class MemoryStore:
    """Runs kept as the objects the engine wrote: a stored state is read-only (the core never changes the
    state it is given, and copies only what it changes), so a save costs the same at every run length.
    Under ``CHECK_PURITY`` (the test suite) each stored state is also kept serialized, and a read proves
    that nothing changed it in place since it was written; and each save proves that the DynamoDB store's
    journal entry for it (:mod:`.aws.journal`) reproduces it."""

    def __init__(self, counter: RequestCounter | None = None) -> None:
        self._runs: dict[str, RunState] = {}
        self._shadows: dict[str, str] = {}
        self._keys: dict[tuple[str, str], str] = {}
        self._releases: dict[str, Release] = {}
        self._check: dict[str, datetime] = {}
        """Run id -> check time (the DynamoDB store's sparse index), set by each write from the state's clock."""
        self._lock = threading.Lock()
        self._seal: str | None = None
        self.counter = counter or RequestCounter()

    def _read(self, run_id: str) -> RunState | None:
        with self._lock:
            state = self._runs.get(run_id)
            shadow = self._shadows.get(run_id)
        if state is not None and shadow is not None and state.model_dump_json() != shadow:
            raise AssertionError(f"run {run_id} was changed in place after it was stored")
        return state

    def _keep(self, state: RunState) -> None:
        self._runs[state.id] = state
        check = check_time(state, state.updated_at)
        if check is None:
            self._check.pop(state.id, None)
        else:
            self._check[state.id] = check
        if _core.CHECK_PURITY:
            self._shadows[state.id] = state.model_dump_json()

    def get(self, run_id: str) -> RunState | None:
        self.counter.add("store.read")
        return self._read(run_id)

    def peek(self, run_id: str) -> RunState | None:
        """Read without counting a request (test harness and benchmark bookkeeping)."""
        return self._read(run_id)

    def cached(self, run_id: str) -> RunState | None:
        return None  # a read here costs nothing: always read

    def create(self, state: RunState) -> None:
        self.counter.add("store.write")
        with self._lock:
            key = (state.function_id, state.idempotency_key) if state.idempotency_key is not None else None
            if key is not None and key in self._keys:
                raise RunExistsError(self._keys[key])
            if state.id in self._runs:
                raise RunExistsError(state.id)
            if key is not None:
                self._keys[key] = state.id
            self._keep(state)

    def save(self, state: RunState, *, expected_version: int) -> None:
        self.counter.add("store.write")
        with self._lock:
            stored = self._runs.get(state.id)
            if stored is None:
                raise VersionConflictError(None)
            if stored.version != expected_version:
                raise VersionConflictError(stored)
            if _core.CHECK_PURITY:
                # every transition the suite makes also proves the DynamoDB store's journal reproduces it
                delta = pydantic_core.from_json(pydantic_core.to_json(journal.diff(stored, state)))
                if journal.apply(stored, delta).model_dump_json() != state.model_dump_json():
                    raise AssertionError(f"run {state.id}: a journal entry would not reproduce {state.version}")
            self._keep(state)

    def run_for_idempotency_key(self, function_id: str, key: str) -> str | None:
        self.counter.add("store.read")
        with self._lock:
            return self._keys.get((function_id, key))

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
        self.counter.add("store.read")
        with self._lock:
            states = list(self._runs.values())
        states.sort(key=lambda s: (s.created_at, s.id), reverse=True)
        selected = [
            s
            for s in states
            if (function_id is None or s.function_id == function_id)
            and (phase is None or s.phase.value == phase)
            and (outcome is None or (s.outcome.value if s.outcome else None) == outcome)
            and (recovery is None or (s.recovery.value if s.recovery else None) == recovery)
            and (blocked is None or bool(s.blockers) == blocked)
        ]
        if limit < 1:
            raise InvalidRequestError("limit must be at least 1")
        if cursor is not None and not cursor.isdigit():
            raise InvalidRequestError("malformed cursor", code="invalid_cursor")
        start = int(cursor) if cursor else 0
        page = selected[start : start + limit]
        more = start + limit < len(selected)
        return RunPage(runs=[run_summary_view(s) for s in page], cursor=str(start + limit) if more else None)

    def runs_blocked_by_definition(self, function_id: str) -> list[str]:
        self.counter.add("store.read")
        with self._lock:
            states = list(self._runs.values())
        return [s.id for s in states if s.function_id == function_id and s.blocked_by_definition]

    def runs_to_check(self, before: datetime, limit: int) -> list[str]:
        self.counter.add("store.read")
        with self._lock:
            due = sorted((at, run_id) for run_id, at in self._check.items() if at <= before)
        return [run_id for _, run_id in due[:limit]]

    def check_time_of(self, run_id: str) -> datetime | None:
        """The run's check time in the index (test harness bookkeeping; not a request)."""
        with self._lock:
            return self._check.get(run_id)

    def defer_check(self, run_id: str, at: datetime) -> None:
        self.counter.add("store.write")
        with self._lock:
            if run_id in self._check:
                self._check[run_id] = at

    def put_release(self, release: Release) -> None:
        self.counter.add("store.write")
        with self._lock:
            for fn in release.functions:
                self._releases[fn.id] = release

    def seal_key(self) -> str:
        with self._lock:
            if self._seal is None:
                self._seal = secrets.token_hex(32)
            return self._seal

    def get_release(self, function_id: str, *, consistent: bool = True) -> Release | None:
        self.counter.add("store.read")
        with self._lock:
            return self._releases.get(function_id)

    def list_releases(self) -> list[Release]:
        with self._lock:
            newest: dict[str, Release] = {}
            for release in self._releases.values():
                if release.app_id not in newest or newest[release.app_id].synced_at <= release.synced_at:
                    newest[release.app_id] = release
        return list(newest.values())


@dataclass(slots=True)
class QueuedMessage:
    message_id: str
    task: TaskRef | DeferredMessage | WakeMessage
    visible_at: datetime
    receive_count: int = 0


class MemoryQueue:
    """An SQS-like queue on an injected clock: delays, visibility, redelivery, a dead-letter list."""

    def __init__(
        self,
        clock: Callable[[], datetime],
        *,
        visibility_timeout_s: float = 30.0,
        max_receive_count: int = 100,
        counter: RequestCounter | None = None,
    ) -> None:
        self._clock = clock
        self._messages: dict[str, QueuedMessage] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.visibility_timeout_s = visibility_timeout_s
        self.max_receive_count = max_receive_count
        self.dead_letters: list[TaskRef | DeferredMessage | WakeMessage] = []
        self.counter = counter or RequestCounter()
        self._watches: dict[str, str] = {}
        """Lease timers that can be taken back (:meth:`watch_lease`): key -> message id."""

    def drop_all(self) -> int:
        """Lose every message, delivered or not (a queue that did not survive a restart); how many there were."""
        with self._lock:
            count = len(self._messages)
            self._messages.clear()
            return count

    def send(self, task: TaskRef, delay_s: float = 0.0, *, app_id: str | None = None) -> None:
        self.counter.add("queue.send")
        with self._lock:
            mid = f"m{next(self._ids)}"
            self._messages[mid] = QueuedMessage(mid, task, self._clock() + timedelta(seconds=delay_s))

    def defer(self, answer: DeferredAnswer, delay_s: float = 0.0) -> None:
        self.counter.add("queue.send")
        with self._lock:
            mid = f"m{next(self._ids)}"
            deferred = DeferredMessage(deferred=answer)
            self._messages[mid] = QueuedMessage(mid, deferred, self._clock() + timedelta(seconds=delay_s))

    def wake(self, order: WakeOrder, delay_s: float = 0.0) -> None:
        self.counter.add("queue.send")
        with self._lock:
            mid = f"m{next(self._ids)}"
            self._messages[mid] = QueuedMessage(
                mid, WakeMessage(wake=order), self._clock() + timedelta(seconds=delay_s)
            )

    def watch_lease(self, task: TaskRef, at: datetime, *, key: str, app_id: str | None = None) -> bool:
        """A lease timer that can be taken back until it is due (as a Scheduler schedule on AWS)."""
        self.counter.add("queue.watch_lease")
        with self._lock:
            mid = f"m{next(self._ids)}"
            self._messages[mid] = QueuedMessage(mid, task, at)
            self._watches[key] = mid
        return True

    def unwatch_lease(self, key: str) -> None:
        self.counter.add("queue.unwatch_lease")
        with self._lock:
            mid = self._watches.pop(key, None)
            message = self._messages.get(mid) if mid is not None else None
            if message is not None and message.receive_count == 0 and message.visible_at > self._clock():
                del self._messages[message.message_id]  # not delivered yet: taken back

    def receive(self, max_messages: int = 10) -> list[QueuedMessage]:
        self.counter.add("queue.receive")
        now = self._clock()
        out: list[QueuedMessage] = []
        with self._lock:
            for message in sorted(self._messages.values(), key=lambda m: m.visible_at):
                if len(out) >= max_messages or message.visible_at > now:
                    break
                message.receive_count += 1
                if message.receive_count > self.max_receive_count:
                    del self._messages[message.message_id]
                    self.dead_letters.append(message.task)
                    continue
                message.visible_at = now + timedelta(seconds=self.visibility_timeout_s)
                out.append(message)
        return out

    def delete(self, message_id: str) -> None:
        self.counter.add("queue.delete")
        with self._lock:
            self._messages.pop(message_id, None)

    def change_visibility(self, message_id: str, delay_s: float) -> None:
        self.counter.add("queue.change_visibility")
        with self._lock:
            message = self._messages.get(message_id)
            if message is not None:
                message.visible_at = self._clock() + timedelta(seconds=delay_s)

    def next_visible_at(self) -> datetime | None:
        with self._lock:
            return min((m.visible_at for m in self._messages.values()), default=None)

    def pending(self) -> list[QueuedMessage]:
        with self._lock:
            return list(self._messages.values())


class MemoryTimers:
    """One-time schedules on the injected clock; the runtime fires what is due."""

    def __init__(self, clock: Callable[[], datetime], counter: RequestCounter | None = None) -> None:
        self._clock = clock
        self._timers: dict[str, TimerRef] = {}
        self._lock = threading.Lock()
        self.counter = counter or RequestCounter()
        self.fire_late_by = timedelta(0)
        """Fire each timer this late, as EventBridge Scheduler may (up to a minute): for tests of what must hold
        whatever the timer does."""

    def schedule(self, timer: TimerRef) -> None:
        self.counter.add("timers.schedule")
        with self._lock:
            self._timers[timer.name] = timer

    def cancel(self, timer: TimerRef) -> None:
        self.counter.add("timers.cancel")
        with self._lock:
            self._timers.pop(timer.name, None)

    def due(self) -> list[TimerRef]:
        now = self._clock()
        with self._lock:
            ready = [t for t in self._timers.values() if t.at + self.fire_late_by <= now]
            for t in ready:
                del self._timers[t.name]
        return sorted(ready, key=lambda t: t.at)

    def next_due_at(self) -> datetime | None:
        with self._lock:
            return min((t.at + self.fire_late_by for t in self._timers.values()), default=None)

    def pending(self) -> list[TimerRef]:
        with self._lock:
            return list(self._timers.values())

"""The durable state of a run, and the names of every status.

A run is described by three independent axes (decisions 1): ``phase`` (where
the engine is), ``outcome`` (why execution ended; set once) and ``recovery``
(what became of the unwind). Steps hold their attempts; each attempt is one
generation of one (step, phase) and settles at most once.

The state is a plain pydantic model so that the store can serialize it. A
state is read-only once it is stored or handed to ``decide``: the core never
mutates its input. ``decide`` works on a shallow working copy and copies only
the steps it changes (copy on write), so a decision costs the same at step 10
and step 10,000, and a new state shares every unchanged step with the old one.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import weakref
from collections.abc import Callable, Iterable
from datetime import datetime
from enum import StrEnum
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SerializerFunctionWrapHandler, model_serializer

from ryusen._internal.wire import ErrorInfo, OmittedValue, Phase, RetryPolicyWire, TaskKind, nested_step_conflict


class RunPhase(StrEnum):
    RUNNING = "running"
    SETTLING = "settling"
    COMPENSATING = "compensating"
    FINISHED = "finished"


class Outcome(StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


class Recovery(StrEnum):
    PENDING = "pending"
    COMPENSATING = "compensating"
    NOT_REQUIRED = "not_required"
    COMPENSATED = "compensated"
    PARTIALLY_COMPENSATED = "partially_compensated"


def _as_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


CHECK_DERIVED = False
"""Check what is worked out from a state's origin (``steps_due``, ``memo_entries``) against working it out from
every step (the test suite turns it on; the core must never depend on a stale copy)."""


class StepStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    UNKNOWN = "unknown"
    FENCED = "fenced"


class CompensationStatus(StrEnum):
    NONE = "none"
    PENDING = "pending"
    RUNNING = "running"
    COMPENSATED = "compensated"
    FAILED = "failed"
    SKIPPED = "skipped"
    UNKNOWN = "unknown"
    NOT_REACHED = "not_reached"


class AttemptStatus(StrEnum):
    QUEUED = "queued"
    AUTHORIZED = "authorized"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"
    RETRY_AUTHORIZED = "retry_authorized"
    FENCED = "fenced"


LIVE_ATTEMPT = frozenset({AttemptStatus.QUEUED, AttemptStatus.AUTHORIZED, AttemptStatus.UNKNOWN})
"""An attempt that has not settled."""


class BlockerType(StrEnum):
    DUPLICATE_STEP_ID = "duplicate_step_id"
    CONCURRENT_STEP = "concurrent_step"
    NEW_STEP_BEFORE_TARGET = "new_step_before_target"
    COMPENSATION_TARGET_NOT_REACHED = "compensation_target_not_reached"
    RESULT_TOO_LARGE = "result_too_large"
    UNSTABLE_STEP_ID = "unstable_step_id"
    OUTPUT_TOO_LARGE = "output_too_large"
    OUTPUT_NOT_JSON = "output_not_json"
    INVALID_STEP = "invalid_step"
    FUNCTION_NOT_FOUND = "function_not_found"
    UNKNOWN_OUTCOME = "unknown_outcome"
    ENDPOINT_FAILING = "endpoint_failing"


DEFINITION_BLOCKERS = frozenset(
    {
        BlockerType.DUPLICATE_STEP_ID,
        BlockerType.CONCURRENT_STEP,
        BlockerType.NEW_STEP_BEFORE_TARGET,
        BlockerType.COMPENSATION_TARGET_NOT_REACHED,
        BlockerType.RESULT_TOO_LARGE,
        BlockerType.UNSTABLE_STEP_ID,
        BlockerType.OUTPUT_TOO_LARGE,
        BlockerType.OUTPUT_NOT_JSON,
        BlockerType.INVALID_STEP,
        BlockerType.FUNCTION_NOT_FOUND,
    }
)
"""Blockers that current code can repair: a release sync, the probe or an operator rediscovers."""


class StopKind(StrEnum):
    CANCEL = "cancel"
    TIMEOUT = "timeout"


class DeadlineSource(StrEnum):
    RUN_REQUEST = "run_request"
    FUNCTION = "function"
    DEPLOYMENT_DEFAULT = "deployment_default"
    NONE = "none"


class _State(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)


def _without_unset(dumped: Any, fields: tuple[tuple[str, Any], ...]) -> Any:
    """``dumped`` without the fields that hold their default: a journal entry and a head stay as small as they
    were before those fields existed (the store writes one per step), and read back the same."""
    if isinstance(dumped, dict):
        for name, default in fields:
            if name in dumped and dumped[name] == default:
                del dumped[name]
    return dumped


class StaleSubmission(_State):
    received_at: datetime
    source: str
    outcome: dict[str, Any] | None = None
    """What was submitted (None only in a run read for a listing, where large values are left out)."""
    reason: str


class Resolution(_State):
    """How an operator settled or moved on an attempt (decisions 28): what they did, when, and why."""

    action: str
    at: datetime
    reason: str | None = None
    by: str | None = None


class Attempt(_State):
    phase: Phase
    generation: int
    operation_id: str
    status: AttemptStatus = AttemptStatus.QUEUED
    queued_at: datetime
    not_before: datetime | None = None
    authorized_at: datetime | None = None
    settled_at: datetime | None = None
    lease_expires_at: datetime | None = None
    respond_by: datetime | None = None
    release_id: str | None = None
    build_id: str | None = None
    error: ErrorInfo | None = None
    detail: str | None = None
    redeliveries: int = 0
    delivery_id: str | None = None
    """The delivery whose write authorized this attempt (see ``TaskDelivered.delivery_id``)."""
    retry_at: datetime | None = None
    """An Unknown attempt that ``on_unknown="retry"`` retries: its next generation starts then, unless a late
    result or an operator settles it first, or a stop makes it block (decisions 19)."""
    stale_submissions: list[StaleSubmission] = Field(default_factory=list)
    stale_submissions_dropped: int = 0
    """Stale submissions past the kept number: counted, not recorded."""
    resolution: Resolution | None = None
    """An operator's resolution of this attempt, if one settled it or moved past it."""
    waiting_since: datetime | None = None
    """Decision 32: the callback of a step completed from outside returned (it handed out the token); the attempt
    waits for its completion until its lease (the step's timeout) ends."""
    lease_grace_s: float | None = None
    """How long past its response window (or past a heartbeat's interval) the lease ran, as authorized."""
    heartbeat_at: datetime | None = None
    heartbeat_details: Any = None
    heartbeat_seq: int = 0
    """The last heartbeat (decision 33): when, the details it carried, and its number (``Heartbeat.seq``)."""
    unknown_at: datetime | None = None
    unknown_reason: str | None = None
    """When and why the attempt's outcome became Unknown: kept after a late result or an operator settles it
    (decisions 28), so the history shows it was not known for a while."""

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _without_unset(handler(self), (("waiting_since", None),))

    @property
    def opened_a_step(self) -> bool:
        """Its callback ran and opened a step inside it (decisions 23): failed, but no retry is spent."""
        return self.status is AttemptStatus.FAILED and nested_step_conflict(self.error) is not None


class StepState(_State):
    id: str
    name: str | None = None
    location: str | None = None
    has_compensation: bool = False
    retry: RetryPolicyWire | None = None
    compensate_retry: RetryPolicyWire | None = None
    timeout_s: float | None = None
    compensate_timeout_s: float | None = None
    heartbeat_s: float | None = None
    """Decision 33: an attempt silent for longer than this (no heartbeat) is Unknown before its timeout."""
    sleep: bool = False
    """Decision 31: a durable wait (``step.sleep``): no callback; the engine completes it at ``wait_until``."""
    external: bool = False
    """Decision 32: its result comes from outside (``completion="external"``): a successful callback only handed
    out the attempt's completion token; the attempt then waits for the completion, within the step's timeout."""
    wait_until: datetime | None = None
    """Decision 31: when a wait ends (a sleep completes, a ``not_before`` step's attempt may start); fixed when the
    step is first recorded, so no replay moves it."""
    group: int | None = None
    """Decision 30: the discovery pass (``RunState.discoveries``) that reported this step declared together with
    others; its siblings share it. None for a step reported alone, or one that left its group (its attempt's pass
    did not reach it: a later discovery decides)."""

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> Any:
        unset = (("sleep", False), ("external", False), ("wait_until", None), ("group", None))
        return _without_unset(handler(self), unset)

    def heartbeat_for(self, phase: Phase) -> float | None:
        """The heartbeat interval an attempt of ``phase`` must keep: the forward callback's (``step.run(heartbeat=)``
        declares it for the callback); a compensator is bounded by its ``compensate_timeout`` only."""
        return self.heartbeat_s if phase is Phase.FORWARD else None

    status: StepStatus = StepStatus.PENDING
    result: Any = None
    error: ErrorInfo | None = None
    completed_seq: int | None = None
    compensation_status: CompensationStatus = CompensationStatus.NONE
    compensation_result: Any = None
    compensation_error: ErrorInfo | None = None
    omitted_result: OmittedValue | None = None
    """The forward callback ran and returned more than the limit: what was not recorded (decisions 25)."""
    compensation_omitted: OmittedValue | None = None
    """The compensator succeeded and returned more than the limit: kept as this marker, not the value."""
    attempts: list[Attempt] = Field(default_factory=list)

    def own_copy(self) -> StepState:
        """A copy that may be changed without touching this step: its attempts are copied one level deep
        (the core replaces their nested values, and only appends to their lists). Much cheaper than a deep
        copy for a step with many attempts; the suite's purity check proves nothing shared is changed."""
        copy = self.model_copy()
        copy.attempts = [
            attempt.model_copy(update={"stale_submissions": list(attempt.stale_submissions)})
            for attempt in self.attempts
        ]
        return copy

    def due_at(self) -> datetime | None:
        """When this step next needs a message or a timer: its current attempt's due time if queued, its
        lease expiry if authorized, its automatic retry if Unknown (the earliest over both phases)."""
        due: datetime | None = None
        for phase in (Phase.FORWARD, Phase.COMPENSATION):
            a = self.current(phase)
            if a is None:
                continue
            when: datetime | None = None
            if a.status is AttemptStatus.QUEUED:
                when = a.not_before or a.queued_at
            elif a.status is AttemptStatus.AUTHORIZED and a.lease_expires_at is not None:
                when = a.lease_expires_at
            elif a.status is AttemptStatus.UNKNOWN and a.retry_at is not None:
                when = a.retry_at
            if when is not None and (due is None or when < due):
                due = when
        return due

    def memo_entry(self) -> dict[str, Any] | None:
        """What a task request replays for this step: its result once completed, its error once failed."""
        if self.status is StepStatus.COMPLETED:
            return {"status": "completed", "result": self.result}
        if self.status is StepStatus.FAILED:
            return {"status": "failed", "error": self.error.model_dump() if self.error else None}
        return None

    def current(self, phase: Phase) -> Attempt | None:
        for attempt in reversed(self.attempts):
            if attempt.phase is phase:
                return attempt
        return None

    def attempt(self, phase: Phase, generation: int) -> Attempt | None:
        for attempt in self.attempts:
            if attempt.phase is phase and attempt.generation == generation:
                return attempt
        return None


class DiscoveryTask(_State):
    seq: int
    status: AttemptStatus = AttemptStatus.QUEUED
    queued_at: datetime
    not_before: datetime | None = None
    authorized_at: datetime | None = None
    lease_expires_at: datetime | None = None
    release_id: str | None = None
    build_id: str | None = None
    redeliveries: int = 0
    delivery_id: str | None = None


class Occurrence(_State):
    step_id: str | None = None
    location: str | None = None
    name: str | None = None


class Blocker(_State):
    """Why a run cannot move on by itself. ``step_id``/``phase``/``generation`` name the attempt it holds up.

    ``first``/``duplicate``: the two calls of a duplicate step id. ``first``/``second``: the open step and the
    one refused (concurrent_step), or the unrecorded step met before the compensation target and that target
    (new_step_before_target).
    """

    type: BlockerType
    step_id: str | None = None
    phase: Phase | None = None
    generation: int | None = None
    first: Occurrence | None = None
    duplicate: Occurrence | None = None
    second: Occurrence | None = None
    message: str
    detail: str | None = None
    size: int | None = None
    limit: int | None = None
    """result_too_large: the result's serialized size, and the limit it is over."""
    step_ids: list[str] | None = None
    """unstable_step_id: the ids that passes announced at one location and then abandoned, and the newest."""
    candidate_step_id: str | None = None
    """unstable_step_id: the new id a wake's pass announced, which the next pass must announce again."""
    count: int = 1
    first_seen_at: datetime
    last_seen_at: datetime


class StopIntent(_State):
    kind: StopKind
    at: datetime
    reason: str | None = None


class UnwindEntry(_State):
    step_id: str
    status: CompensationStatus = CompensationStatus.PENDING


UNWIND_DONE = frozenset((CompensationStatus.COMPENSATED, CompensationStatus.SKIPPED))
"""Unwind entries the walk has passed."""


class RunState(_State):
    id: str
    app_id: str
    function_id: str
    input: Any = None
    output: Any = None
    error: ErrorInfo | None = None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None = None
    version: int = 0
    phase: RunPhase = RunPhase.RUNNING
    outcome: Outcome | None = None
    recovery: Recovery | None = None
    deadline_at: datetime | None = None
    deadline_source: DeadlineSource = DeadlineSource.NONE
    stop_intent: StopIntent | None = None
    idempotency_key: str | None = None
    steps: list[StepState] = Field(default_factory=list)
    secret: str | None = None
    """What the run's completion tokens are made with (decision 32): drawn by the engine at the start, never shown
    (a run started before it existed has none: its tokens are made with the master key)."""
    discovery: DiscoveryTask | None = None
    discovery_seq: int = 0
    completion_seq: int = 0
    group: int | None = None
    """Decision 30: the steps declared together that the run is running (``StepState.group``), until every one of
    them has settled and the next discovery is queued."""
    max_parallel: int | None = None
    """Decision 30: how many of ``group``'s steps may be in flight at once (the function's ``max_parallel``)."""
    group_live: list[int] = Field(default_factory=list)
    """The indexes of the running group's steps started and maybe not settled (checked at each census): what is in
    flight is counted from them, not from every step. Replaced, never changed in place."""
    group_order: list[int] | None = None
    """The running group's step indexes in declaration order, when that is not their order in ``steps`` (a known
    step reported again with new ones); None when it is. Replaced, never changed in place."""
    group_next: int | None = None
    """Where the running group's next step to start is looked for: a position in ``group_order`` when it is set,
    else an index in ``steps`` (every one before it has started, or is not the group's)."""
    group_halted: bool = False
    """A step of the running group failed for good: no new one starts (the function raises at its await)."""
    unwind: list[UnwindEntry] = Field(default_factory=list)
    blockers: list[Blocker] = Field(default_factory=list)
    probe_interval_s: float | None = None
    probe_due_at: datetime | None = None
    discoveries: int = 0
    """How many discovery passes reported (diagnostics)."""
    run_bytes: int = 0
    """Serialized size of the input and every accepted step result (bounded by ``max_run_bytes``)."""
    presumed_started: list[str] = Field(default_factory=list)
    """Attempts (``step\x00phase\x00generation``) a ``ryusen dev`` killed between saves logged as authorized, which
    the state it kept does not hold: recorded and authorized in one write after its last save. When the run
    records such an attempt again it is Unknown at once, not sent (its callback may have run: StartMayBeLost).
    Replaced, never changed in place (a working copy shares it)."""
    _positions: dict[str, int] | None = PrivateAttr(default=None)
    """Step id -> index in ``steps`` (steps are only appended, so a working copy may share it)."""
    _origin: weakref.ref[RunState] | None = PrivateAttr(default=None)
    _replaced: set[int] | None = PrivateAttr(default=None)
    _unwind_replaced: set[int] | None = PrivateAttr(default=None)
    """For a working copy: the state it was copied from, and the indexes of the steps replaced since (steps
    past the origin's are new). A hint that lets a store find what a decision changed without looking at
    every step; ``replaced_steps`` says when it holds. Likewise for the unwind's entries."""
    _unwind_positions: dict[str, int] | None = PrivateAttr(default=None)
    """Step id -> index in ``unwind`` (its entries are replaced in place, never moved)."""
    _unwind_done: int = PrivateAttr(default=0)
    """How many leading unwind entries are known to be compensated or skipped (where the walk resumes)."""
    _due_cache: tuple[list[StepState], int, dict[int, datetime]] | None = PrivateAttr(default=None)
    _memo_cache: tuple[list[StepState], int, dict[str, dict[str, Any]]] | None = PrivateAttr(default=None)
    """What ``steps_due`` and ``memo_entries`` found, for the steps list and count they found it in (a working
    copy has a list of its own, so it never reads its origin's as its own)."""
    _derived_from: tuple[list[StepState], int, dict[int, datetime], dict[str, dict[str, Any]]] | None = PrivateAttr(
        default=None
    )
    """For a working copy: its own steps list, and its origin's step count, steps due and memo when it was
    copied. With the steps replaced since (``_replaced``) and the steps added, they give the copy's own: a
    decision costs what it changed, not what the run holds. (Held for that list only: a copy of this state
    with other steps, ``model_copy(update=...)``, works its own out from every step.)"""
    _sealed: bool = PrivateAttr(default=True)
    """False while a decision may still change this working copy (``decide`` seals what it returns): what is
    worked out from an unsealed state is not kept, since a step it owns may still change in place."""

    def __eq__(self, other: object) -> bool:
        """Equal fields (the step index is a cache, not part of the state)."""
        if not isinstance(other, RunState):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]

    def step_index(self, step_id: str) -> int | None:
        positions = self._positions
        if positions is None or len(positions) < len(self.steps):
            positions = self._positions = {step.id: i for i, step in enumerate(self.steps)}
        i = positions.get(step_id)
        if i is None:
            return None  # every step of this state (and its origins) was put in the index
        if i >= len(self.steps) or self.steps[i].id != step_id:
            # the index is shared with a sibling copy (a decision that lost its race) that added the same id
            # elsewhere: this state's own steps decide
            positions = self._positions = {step.id: k for k, step in enumerate(self.steps)}
            return positions.get(step_id)
        return i

    def step(self, step_id: str) -> StepState | None:
        i = self.step_index(step_id)
        return self.steps[i] if i is not None else None

    def add_step(self, step: StepState) -> None:
        """Append a step. The index may be shared with the state this one was copied from: an entry past that
        state's last step, or naming another step at its index, is not found there (``step_index`` checks)."""
        self.steps.append(step)
        if self._positions is not None:
            self._positions[step.id] = len(self.steps) - 1

    def working_copy(self) -> RunState:
        """A copy whose own containers may be changed without touching this state; the steps, attempts and
        unwind entries in them are still this state's (copy one before changing it)."""
        copy = self.model_copy()
        copy.steps = list(self.steps)
        copy.unwind = list(self.unwind)
        copy.blockers = [b.model_copy(deep=True) for b in self.blockers]
        copy.discovery = self.discovery.model_copy() if self.discovery is not None else None
        copy._positions = self._positions
        copy._origin, copy._replaced, copy._unwind_replaced = weakref.ref(self), set(), set()
        copy._due_cache = copy._memo_cache = None
        copy._derived_from = (copy.steps, len(self.steps), self.steps_due(), self.memo_entries())
        copy._sealed = False
        return copy

    def forget_hints(self) -> None:
        """For a state made some other way than by the core (a journal replay): look everything up afresh."""
        self._origin = self._replaced = self._unwind_replaced = None
        self._due_cache = self._memo_cache = self._derived_from = None
        self._unwind_positions, self._unwind_done = None, 0

    def set_unwind(self, entries: list[UnwindEntry]) -> None:
        self.unwind = entries
        self._unwind_replaced = None  # rebuilt: compare every entry
        self._unwind_positions, self._unwind_done = None, 0

    def unwind_index(self, step_id: str) -> int | None:
        positions = self._unwind_positions
        if positions is None or len(positions) != len(self.unwind):
            positions = self._unwind_positions = {entry.step_id: i for i, entry in enumerate(self.unwind)}
        i = positions.get(step_id)
        if i is not None and (i >= len(self.unwind) or self.unwind[i].step_id != step_id):
            positions = self._unwind_positions = {entry.step_id: k for k, entry in enumerate(self.unwind)}
            i = positions.get(step_id)
        return i

    def replace_unwind_entry(self, i: int, entry: UnwindEntry) -> None:
        self.unwind[i] = entry
        if self._unwind_replaced is not None:
            self._unwind_replaced.add(i)
        if entry.status not in UNWIND_DONE and i < self._unwind_done:
            self._unwind_done = i

    def current_unwind_entry(self) -> UnwindEntry | None:
        """The first entry not compensated or skipped (the walk resumes where it was, not from the top)."""
        i = min(self._unwind_done, len(self.unwind))
        while i < len(self.unwind) and self.unwind[i].status in UNWIND_DONE:
            i += 1
        self._unwind_done = i
        return self.unwind[i] if i < len(self.unwind) else None

    def replaced_unwind(self, origin: RunState) -> set[int] | None:
        if self._origin is None or self._origin() is not origin or self._unwind_replaced is None:
            return None
        if len(self.unwind) != len(origin.unwind):
            return None
        return self._unwind_replaced

    def replace_step(self, i: int, step: StepState) -> None:
        self.steps[i] = step
        self._due_cache = self._memo_cache = None
        if self._replaced is not None:
            self._replaced.add(i)

    def replaced_steps(self, origin: RunState) -> set[int] | None:
        """The indexes of the steps (up to ``origin``'s count) that may differ from ``origin``'s, if this
        state is a working copy of ``origin``; None when that is not known (compare them all)."""
        if self._origin is None or self._origin() is not origin or self._replaced is None:
            return None
        return self._replaced

    def _changed_since_origin(self) -> tuple[tuple[int, dict[int, datetime], dict[str, Any]], Iterable[int]] | None:
        """What the origin worked out (its step count, steps due and memo) and the indexes of the steps that
        may differ from its (replaced or added since), for a working copy that knows them."""
        derived = self._derived_from
        if derived is None or derived[0] is not self.steps or self._replaced is None or len(self.steps) < derived[1]:
            return None
        base = (derived[1], derived[2], derived[3])
        return base, itertools.chain(sorted(self._replaced), range(derived[1], len(self.steps)))

    def seal(self) -> None:
        """This state will not change again (a decision's result): what is worked out from it may be kept."""
        self._sealed = True

    def steps_due(self) -> dict[int, datetime]:
        """Step index -> when it next needs a message or a timer (:meth:`work_due_at`), for the steps that do:
        usually none or one. A working copy works it out from its origin's."""
        cached = self._due_cache
        if cached is None or cached[0] is not self.steps or cached[1] != len(self.steps):
            cached = (self.steps, len(self.steps), self._work_out(1, lambda i: (i, self.steps[i].due_at())))
            if self._sealed:
                self._due_cache = cached
        if CHECK_DERIVED:
            full = {i: when for i, step in enumerate(self.steps) if (when := step.due_at()) is not None}
            assert cached[2] == full, f"steps_due worked out from the origin {cached[2]} is not {full}"
        return cached[2]

    def memo_entries(self) -> dict[str, dict[str, Any]]:
        """The recorded step outcomes a task request replays to the function (step id -> entry). A working
        copy works it out from its origin's. Shared: a caller must not change it."""
        cached = self._memo_cache
        if cached is None or cached[0] is not self.steps or cached[1] != len(self.steps):
            entries = self._work_out(2, lambda i: (self.steps[i].id, self.steps[i].memo_entry()))
            cached = (self.steps, len(self.steps), entries)
            if self._sealed:
                self._memo_cache = cached
        if CHECK_DERIVED:
            full = {step.id: entry for step in self.steps if (entry := step.memo_entry()) is not None}
            # as JSON, so that an entry Python calls equal but JSON does not (1 and true) is still caught
            assert _as_json(cached[2]) == _as_json(full), "memo_entries worked out from the origin is not the memo"
        return cached[2]

    def _work_out(self, which: int, entry_of: Callable[[int], tuple[Any, Any]]) -> dict[Any, Any]:
        """A mapping with an entry per step that has one (``entry_of(index)`` gives its key and value, None for
        none): for a working copy, its origin's (item ``which`` of what it captured) with only the steps
        replaced or added since looked at; otherwise every step."""
        changed = self._changed_since_origin()
        result: dict[Any, Any]
        if changed is not None:
            result, indexes = dict(cast("dict[Any, Any]", changed[0][which])), changed[1]
        else:
            result, indexes = {}, range(len(self.steps))
        for i in indexes:
            key, value = entry_of(i)
            if value is None:
                result.pop(key, None)
            else:
                result[key] = value
        return result

    @property
    def blocked_by_definition(self) -> bool:
        return any(b.type in DEFINITION_BLOCKERS for b in self.blockers)

    def work_due_at(self) -> datetime | None:
        """When the run next needs a message or a timer to move it: the earliest of a queued task's due time,
        an authorized task's lease expiry, an Unknown's automatic retry, the deadline (while the run has no
        outcome) and the probe. None for a finished run, or one that waits only for a person.

        A run whose work is overdue by more than the sweeper's grace has lost what should have moved it (a
        send or a schedule that failed after the write, a dispatcher that died while chaining): the sweeper
        finds it by this time, in an index, and repairs it (``SweepRequested``)."""
        if self.phase is RunPhase.FINISHED:
            return None
        due: list[datetime] = []
        d = self.discovery
        if d is not None and d.status is AttemptStatus.QUEUED:
            due.append(d.not_before or d.queued_at)
        elif d is not None and d.status is AttemptStatus.AUTHORIZED and d.lease_expires_at is not None:
            due.append(d.lease_expires_at)
        steps_due = self.steps_due()
        if steps_due:
            due.append(min(steps_due.values()))
        if self.deadline_at is not None and self.outcome is None:
            due.append(self.deadline_at)
        if self.probe_due_at is not None:
            due.append(self.probe_due_at)
        return min(due) if due else None


CARRIER_SEPARATOR = "."
"""Between a delivery id's carrier tag and the part that makes the delivery unique."""


RESULT_FUNCTION_CARRIER = "result function "
"""What the identity of a result function's invocation starts with: the carrier of the deliveries it makes,
which no message is (its tag starts with ``s``, never a hex digit, so never a message's tag)."""
RESULT_FUNCTION_EVENTS_CARRIER = "result function, events "
"""The same, for an invocation whose run's newest release takes attempts as Lambda events: what it leaves in
flight was sent as an event, whose outcome only a post brings (its tag starts with ``EVENTS_TAG``)."""
EVENTS_TAG = "r"


def carrier_tag(message_id: str) -> str:
    """The short tag of a dispatch message's identity (an SQS message id, kept across receives), which the
    delivery ids of its deliveries start with: 12 hex digits of its digest (a clash only makes another message
    act at a lease as its carrier would, as every message did before carriers were told apart). A result
    function's invocation has ``s`` and 11 of them, ``EVENTS_TAG`` if its run's release takes events."""
    digest = hashlib.sha256(message_id.encode()).hexdigest()
    if message_id.startswith(RESULT_FUNCTION_EVENTS_CARRIER):
        return EVENTS_TAG + digest[:11]
    if message_id.startswith(RESULT_FUNCTION_CARRIER):
        return "s" + digest[:11]
    return digest[:12]


def delivery_id_for(carrier: str | None, unique: str) -> str:
    """A delivery id: ``unique`` (random, drawn by the engine), prefixed with the tag of the message that carries
    the delivery, if it has one (``carrier``: its message id)."""
    return unique if carrier is None else f"{carrier_tag(carrier)}{CARRIER_SEPARATOR}{unique}"


def carrier_of(delivery_id: str | None) -> str | None:
    """The tag of the message that carried the delivery ``delivery_id`` names (None: it names none).

    The message whose delivery authorized an attempt is the attempt's carrier: it is kept on the queue as the
    attempt's lease timer, and it is the one that takes the attempt as Unknown when the lease ends. Any other
    message (a stale one, a duplicate, the sweeper) waits ``lease_watch_grace_s`` longer: the carrier may have
    been deleted because the attempt's answer was deferred to the queue while the store would not take it."""
    if delivery_id is None or CARRIER_SEPARATOR not in delivery_id:
        return None
    return delivery_id.split(CARRIER_SEPARATOR, 1)[0]


def sent_as_an_event_by_a_result_function(delivery_id: str | None) -> bool:
    """Whether the delivery ``delivery_id`` names was made by a result function for a release that takes attempts
    as Lambda events: what it left in flight is answered only by a post, never inline, so no answer of it can be
    deferred to the queue meanwhile, and a lease timer that result function sent may watch it."""
    tag = carrier_of(delivery_id)
    return tag is not None and tag.startswith(EVENTS_TAG)


class TaskRef(BaseModel):
    """What one dispatch message names: a discovery pass or one attempt."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    kind: TaskKind
    seq: int | None = None
    step_id: str | None = None
    generation: int | None = None
    lease_timer: bool = False
    """Only a lease timer (the result function's, which no dispatch message holds): it comes back when this
    attempt's lease ends, and watches it and the attempts named by ``watches_before``, nothing else, where a
    task's own message follows whatever its run has in flight. Left out of a message when False."""
    watches_before: datetime | None = None
    """A lease timer's: it also watches every attempt of its run that a result function sent as an event and
    authorized before this time (:func:`sent_as_an_event_by_a_result_function`) while it is in flight, and takes
    it as Unknown at its lease as the attempt's own timer would. The result function that sent it sends no timer
    for such an attempt it authorizes before then whose lease ends after the timer is due (one timer for a
    run's steps, not one per attempt). Left out of a message when None."""

    @property
    def phase(self) -> Phase | None:
        if self.kind is TaskKind.FORWARD:
            return Phase.FORWARD
        if self.kind is TaskKind.COMPENSATE:
            return Phase.COMPENSATION
        return None

    def describe(self) -> str:
        if self.kind is TaskKind.DISCOVER:
            return f"discovery #{self.seq}"
        return f"{self.step_id} {self.phase} #{self.generation}"


class TimerKind(StrEnum):
    DEADLINE = "deadline"
    PROBE = "probe"


class TimerRef(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    kind: TimerKind
    at: datetime

    @property
    def name(self) -> str:
        return f"ryusen-{self.kind}-{self.run_id}-{int(self.at.timestamp())}"

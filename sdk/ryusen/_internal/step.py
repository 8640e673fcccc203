"""``step.run`` and the replay that answers one task.

Theory of operation. A task runs the user's function from the top with the
memo of recorded step outcomes (or, for a chained run's next attempt, resumes
the kept pass that stopped at its step: ``kept.py``). ``step.run`` returns a recorded success,
raises :class:`StepFailed` for a recorded terminal failure, and otherwise
*stops the pass* at that step by raising :class:`Suspend` (a
``BaseException``, so a user's ``except Exception`` cannot swallow it). What
the pass reports is kept on the :class:`_Replay`, never carried only by the
exception, so code around the steps cannot change it (decisions 16):

* discover: the first step with no recorded outcome (its plan), or a
  definition conflict (a duplicate step id, two steps open at once, an output
  over the limit) found before any callback could run;
* forward: the target step's callback outcome, once the callback was entered,
  whatever the code around it does afterwards (a ``finally`` that raises, an
  ``except BaseException`` that returns);
* compensate: the target's compensator outcome; ``target_not_found`` with
  reason ``no_compensator`` when current code reaches the target and declares
  none, ``retired`` when the function ends without meeting it and retires its
  id, and ``not_reached`` (where the pass ended) when it ends without meeting
  it otherwise, which the server takes as proving nothing (decisions 24);
  ``new_step_before_target`` when an unrecorded step comes first;
  ``replay_failed`` when code outside ``step.run`` raises first (17).

A ``step.run`` refused while the target callback runs (opened inside it, or
from a thread it started) is remembered: if its ``ConcurrentStepError``
escapes the callback, the attempt reports ``concurrent_step`` with both steps
instead of an ordinary failure (decisions 23). A callback result over the
limit is reported as a success with what was omitted (decisions 25).

The step at which the pass stopped stays *open*: another ``step.run`` from a
different thread, or from inside the running callback, is two steps at once and
is refused with :class:`ConcurrentStepError` (decisions 18). The same code
re-entering ``step.run`` after swallowing the suspension just gets the
suspension again: nothing else runs in that pass.

Steps declared together (decision 30). In an async function ``step.run``
records its step when it is called (``_Declared``); the steps called before
the function awaits any of them are declared together. A discovery lets the
function's tasks settle, then reports every declared step with no recorded
outcome (``StepsReached``); an attempt's pass starts its target's callback
where it is called and stops there, and the other unrecorded steps it meets
wait for it. ``step.parallel`` does the same for a sync function.

Code outside ``step.run`` runs again on every pass; that is repeatable
orchestration, not deterministic replay (RFD 1). A kept pass runs it once for
several tasks, so what a callback left in memory is still there at the next
step; a pass from the top sees only the recorded results.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import hashlib
import inspect
import json
import logging
import math
import os
import sys
import threading
import traceback
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal, NoReturn, Protocol, TypeVar

import pydantic_core
from pydantic import ValidationError

from .errors import ConcurrentStepError, NonRetryableError, NoOperationError, StepFailed
from .heartbeat import SINK
from .wire import (
    DEFAULT_MAX_PARALLEL,
    FRAME_TEXT_LIMIT,
    MAX_FRAMES,
    MAX_SIBLINGS,
    MAX_VALUE_BYTES,
    MAX_WAIT_S,
    NESTED_STEP_ERROR,
    CallbackFailed,
    CallbackSucceeded,
    ConcurrentStepConflict,
    ConflictFound,
    DuplicateStepConflict,
    ErrorInfo,
    Frame,
    FunctionCompleted,
    FunctionFailed,
    InvalidStep,
    MemoEntry,
    NewStepBeforeTarget,
    Occurrence,
    OmittedValue,
    OperationInfo,
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
    Traceback,
    json_value_problem,
)

T = TypeVar("T")
log = logging.getLogger("ryusen")


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How a step's callback is retried after a failed attempt.

    >>> policy = RetryPolicy(max_attempts=6, initial_delay=timedelta(seconds=2))
    >>> policy.to_wire().initial_delay_s, policy.on_unknown
    (2.0, 'block')

    ``on_unknown="retry"`` declares the callback safe to run twice: an attempt
    whose outcome cannot be known then consumes a retry instead of blocking.
    """

    max_attempts: int = 4
    initial_delay: timedelta = timedelta(seconds=1)
    backoff: float = 2.0
    max_delay: timedelta = timedelta(minutes=5)
    on_unknown: Literal["block", "retry"] = "block"

    def __post_init__(self) -> None:
        if not 1 <= self.max_attempts <= 1000:
            raise ValueError(f"max_attempts must be between 1 and 1000, not {self.max_attempts}")
        if self.backoff < 1.0:
            raise ValueError("backoff must be at least 1.0")
        if self.initial_delay < timedelta(0) or self.max_delay < timedelta(0):
            raise ValueError("delays must not be negative")
        if self.on_unknown not in ("block", "retry"):
            raise ValueError("on_unknown must be 'block' or 'retry'")

    def to_wire(self) -> RetryPolicyWire:
        return RetryPolicyWire(
            max_attempts=self.max_attempts,
            initial_delay_s=self.initial_delay.total_seconds(),
            backoff=self.backoff,
            max_delay_s=self.max_delay.total_seconds(),
            on_unknown=self.on_unknown,
        )


@dataclass(frozen=True, slots=True)
class OmittedResult:
    """What a compensator receives in place of a forward result that was over the value limit (so it was not
    recorded): its serialized ``size`` in bytes, the ``sha256`` of its compact JSON, and the ``limit``.

    >>> def refund(charge: object) -> None:
    ...     if isinstance(charge, OmittedResult):
    ...         ...  # find the charge by ryusen.operation()'s idempotency key instead
    """

    size: int
    sha256: str
    limit: int


@dataclass(frozen=True, slots=True)
class Operation:
    """The operation a callback is executing: use ``id`` as an idempotency key.

    ``id`` is stable across every generation (retry) of one step's phase.
    """

    id: str
    phase: str
    generation: int
    completion_token: str | None = None
    """A step with ``completion="external"``: hand this out (an approval link, a webhook's reference); the step's
    result arrives with it (``POST /v1/completions/{token}``, ``Client.complete``). None for other steps."""


_current_operation: contextvars.ContextVar[Operation | None] = contextvars.ContextVar("ryusen_operation", default=None)


def operation() -> Operation:
    """The current operation, inside a forward or compensation callback.

    >>> def refund(charge: dict) -> None:
    ...     key = operation().id          # hand it to the payment API as idempotency key
    """
    op = _current_operation.get()
    if op is None:
        raise NoOperationError("ryusen.operation() is only available inside a step or compensation callback")
    return op


class Suspend(BaseException):
    """Ends a pass; carries what the task learned. Never raised to the user."""

    def __init__(self, outcome: Any) -> None:
        super().__init__("ryusen pass suspended")
        self.outcome = outcome


def _text(value: str) -> str:
    """``value`` as valid Unicode: a lone surrogate (from ``os.fsdecode``, say) becomes an escape."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def _describe(exc: BaseException) -> str:
    try:
        return _text(str(exc))
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises is still reported
        return f"<{type(exc).__name__} whose message cannot be printed>"


def error_info(exc: BaseException, *, retryable: bool = True, with_traceback: bool = False) -> ErrorInfo:
    """``exc`` as the server records it; with ``with_traceback`` (the server asked: ``tracebacks``), where it
    was raised too."""
    where = traceback_of(exc) if with_traceback else None
    if isinstance(exc, StepFailed):
        return ErrorInfo(
            type="StepFailed",
            message=_describe(exc),
            data=_jsonable({"step_id": exc.step_id, "error_type": exc.error_type, "data": exc.data}),
            retryable=retryable,
            traceback=where,
        ).bounded()
    data = getattr(exc, "data", None) if isinstance(exc, NonRetryableError) else None
    return ErrorInfo(
        type=_text(type(exc).__name__),
        message=_describe(exc),
        data=_jsonable(data),
        retryable=retryable,
        traceback=where,
    ).bounded()


_SDK_DIR = str(Path(__file__).resolve().parent.parent) + os.sep
"""Frames in files under here are Ryusen's own (step.run, the runner): left out of a user's traceback."""
_OUTER_FRAMES = 10


def traceback_of(exc: BaseException) -> Traceback | None:
    """Where ``exc`` was raised, outermost frame first: file (relative to the working directory when under it),
    line, function and source line; never locals. Ryusen's own frames are left out, and a deep stack keeps its
    outermost and innermost frames (``MAX_FRAMES``); ``omitted`` counts what was left out.

    >>> def charge():
    ...     raise KeyError("to")
    >>> try:
    ...     charge()
    ... except KeyError as exc:
    ...     where = traceback_of(exc)
    >>> [f.function for f in where.frames][-1], where.frames[-1].code
    ('charge', 'raise KeyError("to")')
    """
    try:
        summary = traceback.extract_tb(exc.__traceback__)
    except Exception:  # noqa: BLE001 - a traceback that cannot be read is left out, never fails the report
        return None
    frames: list[Frame] = []
    omitted = 0
    here = os.getcwd() + os.sep
    for entry in summary:
        filename = entry.filename or "?"
        if os.path.abspath(filename).startswith(_SDK_DIR):
            omitted += 1
            continue
        if filename.startswith(here):
            filename = filename[len(here) :]
        frames.append(
            Frame(
                file=_clip(filename),
                line=entry.lineno,
                function=_clip(entry.name or "?"),
                code=_clip(entry.line.strip()) if entry.line else None,
            )
        )
    if len(frames) > MAX_FRAMES:
        inner = MAX_FRAMES - _OUTER_FRAMES
        omitted += len(frames) - MAX_FRAMES
        frames = frames[:_OUTER_FRAMES] + frames[-inner:]
    if not frames and not omitted:
        return None
    return Traceback(frames=frames, omitted=omitted)


def _clip(text: str) -> str:
    text = _text(text)
    return text if len(text) <= FRAME_TEXT_LIMIT else text[: FRAME_TEXT_LIMIT - 1] + "…"


def _jsonable(value: Any) -> Any:
    checked, problem = check_value(value, "data")
    if problem is not None and problem.type == "not_json_serializable":
        try:
            return _text(repr(value))
        except Exception:  # noqa: BLE001
            return f"<{type(value).__name__}>"
    return checked


def _encode(value: Any) -> bytes:
    """Compact JSON in UTF-8; raises ValueError (or RecursionError) for anything that is not a JSON value."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def check_value(value: Any, what: str) -> tuple[Any, ErrorInfo | None]:
    """Serialize ``value`` as JSON and enforce the size limit (decisions 6.11).

    Not JSON: a type JSON does not have, a NaN or infinity, invalid Unicode (a lone surrogate), or
    nesting too deep to serialize.
    """
    try:
        encoded = _encode(value)
    except (TypeError, ValueError, RecursionError) as exc:
        message = f"{what} is not JSON: {_describe(exc)}"
        return None, ErrorInfo(type="not_json_serializable", message=message, retryable=False)
    if (size := len(encoded)) > MAX_VALUE_BYTES:
        return None, ErrorInfo(
            type=f"{what}_too_large",
            message=f"{what} is {size} bytes serialized; the limit is {MAX_VALUE_BYTES}",
            retryable=False,
        )
    checked = json.loads(encoded)
    if (problem := json_value_problem(checked)) is not None:  # nesting the server could not store
        return None, ErrorInfo(type="not_json_serializable", message=f"{what} {problem}", retryable=False)
    return checked, None


def _fresh(value: Any) -> Any:
    """A recorded value the function may change without changing the memo (a pass may replay it again)."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return pydantic_core.from_json(pydantic_core.to_json(value))


_LOCATIONS: dict[tuple[str, int], str] = {}
"""``file:line`` by file and line: every replayed ``step.run`` asks, at the same few places. (Not by code
object: two identical functions in different files have code objects that compare equal.)"""
_LOCATIONS_KEPT = 4096


def _caller_location(depth: int) -> str | None:
    """``file:line`` of the frame ``depth`` levels above this function's caller."""
    frame = sys._getframe(depth + 1)
    key = (frame.f_code.co_filename, frame.f_lineno)
    location = _LOCATIONS.get(key)
    if location is None:
        location = _text(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}")
        if len(_LOCATIONS) >= _LOCATIONS_KEPT:
            _LOCATIONS.clear()
        _LOCATIONS[key] = location
    return location


def _display_name(fn: Callable[..., Any], name: str | None) -> str:
    return _text(str(name or getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)))


def _context() -> tuple[int, asyncio.Task[Any] | None]:
    """Who is calling: the thread, and the asyncio task within it (gather runs each awaitable in a task)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running event loop in this thread
        task = None
    return threading.get_ident(), task


_PLAN_PROBLEMS = {
    "id": "a step id may have at most 256 characters",
    "timeout_s": "timeout must be a positive timedelta",
    "compensate_timeout_s": "compensate_timeout must be a positive timedelta",
}
"""What a rejected StepPlan field means in the words of ``step.run``'s arguments."""


@dataclass(slots=True)
class _Seen:
    """A ``step.run`` this pass met: its display name is worked out only if a conflict names it."""

    location: str | None
    fn: Callable[..., Any]
    given_name: str | None

    @property
    def name(self) -> str:
        return _display_name(self.fn, self.given_name)


@dataclass(slots=True)
class _Open:
    """The ``step.run`` at which this pass stopped: its callback is running, or it ended the pass."""

    step_id: str
    location: str | None
    name: str
    context: tuple[int, asyncio.Task[Any] | None]

    def occurrence(self) -> Occurrence:
        return Occurrence(step_id=self.step_id, location=self.location, name=self.name)


@dataclass(slots=True, eq=False)
class _Declared:
    """A ``step.run`` call as it was made (decision 30): its step exists from here, whether or not its awaitable
    is ever awaited. Steps declared before the function awaits any of them are declared together."""

    index: int
    step_id: str
    location: str | None
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    name: str | None
    compensate: Callable[[Any], Any] | None
    retry: RetryPolicy | None
    timeout: timedelta | None
    compensate_retry: RetryPolicy | None
    compensate_timeout: timedelta | None
    heartbeat: timedelta | None
    wait: Wait | None
    completion: str
    seen: _Seen
    duplicate_of: _Seen | None = None
    context: contextvars.Context | None = None
    """The context the call was made in: its callback runs in it, wherever it is started from."""
    awaitable: Any = None
    """What the call returned (an async function's): closed at the end of the pass if it was never awaited."""

    def entry_args(self) -> tuple[Any, ...]:
        """What :meth:`_Replay.enter` takes, in its order."""
        return (self.step_id, self.location, self.fn, self.name, self.compensate, self.retry, self.timeout,
                self.compensate_retry, self.compensate_timeout, self.heartbeat, self.wait, self.completion)  # fmt: skip


class _Declaring(BaseException):
    """Raised by ``step.run`` inside ``step.parallel``'s collection: the call is declared, not run."""


SETTLE_ROUNDS = 64
"""The most event-loop turns an async pass lets its tasks run before it decides what its waiting steps report:
three turns in a row in which no ``step.run`` is called or entered end it sooner."""


class CallbackInterruptedError(Exception):
    """The target callback was entered but did not finish (it raised a ``BaseException`` such as
    ``KeyboardInterrupt``, or was cancelled): there is no outcome to report, and ``target_not_found``
    would be a lie. The endpoint answers 500, which the server treats as an Unknown outcome."""


class Keeper(Protocol):
    """What a kept pass (``kept.py``) does for the replay: it is told when its callback finished, and it waits."""

    thread_id: int

    def attempt_finished(self, outcome: Any, *, going_on: bool) -> None: ...

    def wait_for_attempt(self, plan: Any) -> None: ...

    def run_callback(self, call: Callable[[], Any]) -> Any: ...


class _Replay:
    """One pass: the task, the memo, the ids seen so far, and what the pass reports.

    ``step.run`` may be called from several threads or asyncio tasks of one pass; a lock makes each
    decision about the pass (stop here, run the target, refuse a second step) atomic, and once the
    task has answered (:meth:`report`) the pass is closed: nothing more runs in it.
    """

    def __init__(
        self,
        kind: TaskKind,
        memo: dict[str, MemoEntry],
        target: str | None,
        operation: OperationInfo | None,
        forward_result: Any,
    ) -> None:
        self.kind = kind
        self.memo = memo
        self.target = target
        self.operation = operation
        self.forward_result = forward_result
        self.seen: dict[str, _Seen] = {}
        self.stopped_at: _Open | None = None
        """The step this pass stopped at (set once)."""
        self.outcome: Any = None
        """What this pass reports, once it has stopped (the target's outcome, a plan, a conflict...)."""
        self.entered = False
        """The target callback was entered: its outcome is what this task reports (decisions 16)."""
        self.closed = False
        self.target_without_compensator: str | None = None
        """Compensation: current code reached the target and declared no compensator (its location)."""
        self.recorded_failures: list[StepFailed] = []
        self.build_id: str | None = None
        """The build of the code running this pass, reported with a refusal of a step opened inside a callback:
        the server holds the callback by the build that ran it, whatever release it authorized (decisions 23)."""
        self.retired_steps: frozenset[str] = frozenset()
        """The function's retired step ids (``@app.function(retired_steps=...)``): decisions 24."""
        self.refused_in_callback: list[tuple[ConcurrentStepError, ConcurrentStepConflict]] = []
        """Steps refused while the target callback ran (decisions 23), with what each refusal names."""
        self.callback_done = threading.Event()
        self.parked: list[asyncio.Future[None]] = []
        self._lock = threading.RLock()
        self.keeper: Keeper | None = None
        """A pass kept between tasks (``kept.py``): it goes on after a successful callback, and waits at the next
        step for that step's attempt instead of ending there. None: the pass ends at its step, as every pass
        of a discovery or compensation task does."""
        self.keepable = True
        """Every ``step.run`` so far came from the thread the function runs on, and none was refused: only
        such a pass may go on after its callback (anything else gets a replay from the top, as before)."""
        self.function_thread: int | None = None
        """The thread the function runs on (set by what runs it): a ``step.run`` from any other thread is
        refused (decisions 18), whatever the timing."""
        self.tracebacks = False
        """The server asked for tracebacks (``tracebacks``): the errors this pass reports say where they were
        raised."""
        self.parallel = False
        """The server runs steps declared together at once (``parallel_steps``): a pass may report them all."""
        self.max_parallel = DEFAULT_MAX_PARALLEL
        self.declarations: list[_Declared] = []
        """Every ``step.run`` call of this pass, as made (decision 30)."""
        self.calls = 0
        """``step.run`` calls and entries so far: an async pass has settled when a few loop turns add none."""
        self.waiting: list[tuple[_Declared, asyncio.Future[None]]] = []
        """Awaited steps with no recorded outcome that are not this task's target (siblings, or the steps a
        discovery reports together): what they report is decided once the pass has settled."""
        self.attention: asyncio.Event | None = None
        """Set when a step starts waiting: the async runner then lets the pass settle and decides."""
        self.collecting: tuple[int, list[_Declared]] | None = None
        """``step.parallel`` is collecting its calls (a ``step.run`` meanwhile declares, and runs nothing)."""
        self.claimed: asyncio.Task[None] | None = None
        """An async attempt's target, claimed where it was called: its callback, started at once on the loop (the
        function stops there; the runner waits for it)."""
        self.had_siblings = False
        """This attempt's pass met steps declared with its target: no continuation is worth running after it."""

    # ---- step.run -----------------------------------------------------------------

    def declare(
        self,
        step_id: str,
        location: str | None,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None,
        compensate: Callable[[Any], Any] | None,
        retry: RetryPolicy | None,
        timeout: timedelta | None,
        compensate_retry: RetryPolicy | None,
        compensate_timeout: timedelta | None,
        heartbeat: timedelta | None,
        wait: Wait | None,
        completion: str,
    ) -> _Declared:
        """A ``step.run`` call, as it is made (decision 30): the step exists from now on in this pass. A second
        call with the same id is its duplicate, reported when either is awaited."""
        with self._lock:
            self.calls += 1
            declared = _Declared(len(self.declarations), step_id, location, fn, args, kwargs, name, compensate, retry,
                                 timeout, compensate_retry, compensate_timeout, heartbeat, wait, completion,
                                 _Seen(location, fn, name))  # fmt: skip
            declared.context = contextvars.copy_context()
            if self.closed or not isinstance(step_id, str) or not step_id:
                return declared  # entering it raises what applies (the pass has ended, an invalid id)
            if _current_operation.get() is not None:
                return declared  # opened inside a callback: not declared; entering it is refused (decisions 23)
            if self.function_thread is not None and threading.get_ident() != self.function_thread:
                # from another thread (decision 18 stays): refused where it is called, never reported or run
                self._refuse_from_another_thread(step_id, location, declared.seen.name)
            if isinstance(step_id, str) and step_id and not self.closed:
                first = self.seen.get(step_id)
                if first is not None:
                    declared.duplicate_of = first
                else:
                    self.seen[step_id] = declared.seen
                self.declarations.append(declared)
            return declared

    def enter(
        self,
        step_id: str,
        location: str | None,
        fn: Callable[..., Any],
        name: str | None,
        compensate: Callable[[Any], Any] | None,
        retry: RetryPolicy | None,
        timeout: timedelta | None,
        compensate_retry: RetryPolicy | None,
        compensate_timeout: timedelta | None,
        heartbeat: timedelta | None = None,
        wait: Wait | None = None,
        completion: str = "callback",
        *,
        declared: _Declared | None = None,
    ) -> tuple[str, Any]:
        """Decide what ``step.run`` does: ("return", value), ("execute", callable) or ("park", None); or raise.

        A declared call (``declared``: an async function's, or one of ``step.parallel``'s) with no recorded
        outcome that is not this task's target answers ("together", None) in a discovery and ("beside", None)
        otherwise: what it reports is decided with the steps declared with it (decision 30)."""
        if not isinstance(step_id, str) or not step_id:
            raise TypeError("step id must be a non-empty string")
        with self._lock:
            self.calls += 1
            if self.keeper is not None and self.keepable and threading.get_ident() != self.keeper.thread_id:
                self.keepable = False  # a step from another thread: the rest of this pass is not kept
            if self.closed:
                raise Suspend(self.outcome)  # the task has answered: nothing more runs in this pass
            if self.stopped_at is not None:
                if declared is not None and (moved := self._after_stop_together()) is not None:
                    return moved
                return self._after_stop(step_id, location, _display_name(fn, name))
            if self.function_thread is not None and threading.get_ident() != self.function_thread:
                self._refuse_from_another_thread(step_id, location, _display_name(fn, name))
            if declared is not None:
                first, seen = declared.duplicate_of, declared.seen
            else:
                first, seen = self.seen.get(step_id), _Seen(location, fn, name)
            display = seen.name if first is not None or step_id == self.target else ""
            if first is not None:
                if self.target_without_compensator is not None and step_id == self.target and compensate is None:
                    # the target's id used twice, and neither use declares a compensator: nothing to undo
                    detail = f"current code declares no compensator for step {step_id!r}"
                    self._stop(step_id, location, display, TargetNotFound(detail=detail, reason="no_compensator"))
                duplicate = DuplicateStepConflict(
                    step_id=step_id,
                    first=Occurrence(location=first.location, name=first.name),
                    duplicate=Occurrence(location=location, name=display),
                )
                self._stop(step_id, location, display, ConflictFound(conflict=duplicate))
            if declared is None:
                self.seen[step_id] = seen
            recorded = self.memo.get(step_id)
            if self.kind is TaskKind.COMPENSATE and step_id == self.target:
                if compensate is not None:
                    self._open(step_id, location, display)
                    return "execute", lambda: compensate(self.forward_result)
                if recorded is None or recorded.status != "completed":
                    detail = f"current code declares no compensator for step {step_id!r}"
                    self._stop(step_id, location, display, TargetNotFound(detail=detail, reason="no_compensator"))
                # no compensator here: the pass goes on, so a second use of the id is still found (decisions 17)
                self.target_without_compensator = location
            if recorded is not None and recorded.status == "completed":
                return "return", _fresh(recorded.result)
            display = display or seen.name
            if recorded is not None:
                err = recorded.error or ErrorInfo(type="Error", message="step failed")
                # a copy, as for a result: the function may change what it caught, the memo must not change
                failure = StepFailed(step_id, err.type, err.message, _fresh(err.data))
                self.recorded_failures.append(failure)
                raise failure
            if self.kind is TaskKind.DISCOVER:
                if declared is not None:
                    return "together", None
                plan = self._full_plan(step_id, location, display, compensate, retry, timeout, compensate_retry,
                                       compensate_timeout, heartbeat, wait, completion)  # fmt: skip
                # a wait, or a completion from outside: nothing to keep a pass for meanwhile
                waits = isinstance(plan, StepReached) and (wait is not None or completion != "callback")
                if self.keeper is not None and self.keepable and isinstance(plan, StepReached) and not waits:
                    # a kept pass reports the step and waits here for its attempt (Step.run calls the keeper)
                    self.stopped_at = _Open(step_id, location, display, _context())
                    self.outcome = plan
                    return "keep", plan
                self._stop(step_id, location, display, plan)
            if step_id != self.target:
                if declared is not None:
                    self.had_siblings = True
                    return "beside", None
                self._stop(step_id, location, display, self._before_target(step_id, location, display))
            self._open(step_id, location, display)
            return "execute", fn

    def _before_target(self, step_id: str, location: str | None, display: str) -> Any:
        """What an attempt's pass reports when it meets step ``step_id``, with no recorded outcome, and not its
        target: the target was not reached (or, compensating, why it cannot be)."""
        assert self.target is not None
        if self.kind is TaskKind.COMPENSATE and self.target in self.retired_steps:
            # the release retired the target: a step it no longer reaches is no conflict (decisions 24)
            detail = f"current code reaches step {step_id!r} and retires step {self.target!r}"
            return TargetNotFound(detail=detail, reason="retired")
        if self.kind is TaskKind.COMPENSATE and self.target_without_compensator is None:
            met = Occurrence(step_id=step_id, location=location, name=display)
            return ConflictFound(conflict=NewStepBeforeTarget(step_id=self.target, first=met))
        if self.kind is TaskKind.COMPENSATE:
            detail = f"current code declares no compensator for step {self.target!r}"
            return TargetNotFound(detail=detail, reason="no_compensator")
        return TargetNotFound(detail=f"current code reaches step {step_id!r} before {self.target!r}")

    def _full_plan(
        self,
        step_id: str,
        location: str | None,
        display: str,
        compensate: Callable[[Any], Any] | None,
        retry: RetryPolicy | None,
        timeout: timedelta | None,
        compensate_retry: RetryPolicy | None,
        compensate_timeout: timedelta | None,
        heartbeat: timedelta | None,
        wait: Wait | None,
        completion: str,
    ) -> StepReached | ConflictFound:
        plan = self._plan(step_id, location, display, compensate, retry, timeout, compensate_retry, compensate_timeout)
        if heartbeat is not None and isinstance(plan, StepReached):
            plan = self._with_heartbeat(plan, step_id, location, heartbeat)
        if wait is not None and isinstance(plan, StepReached):
            plan = self._with_wait(plan, step_id, location, wait)
        if completion != "callback" and isinstance(plan, StepReached):
            plan = self._with_completion(plan, step_id, location, completion)
        return plan

    # ---- steps declared together (decision 30) ------------------------------------------

    def _after_stop_together(self) -> tuple[str, Any] | None:
        """A declared ``step.run`` of the function's own thread after the pass stopped: the suspension again, or
        a wait for the running target; None where decision 18's refusal applies (inside a callback)."""
        if _current_operation.get() is not None:
            return None  # opened inside the running callback (or a task it started): refused (decisions 23)
        if self.function_thread is not None and threading.get_ident() != self.function_thread:
            return None
        if self.outcome is not None:
            raise Suspend(self.outcome)
        if self.entered:
            return "park", None
        return None

    def together_outcome(self) -> Any:
        """What a discovery reports for the steps declared in this pass with no recorded outcome: their plans
        in declaration order (one plan alone as before), or the first conflict among them."""
        pending: list[_Declared] = []
        for declared in self.declarations:
            if declared.duplicate_of is not None:
                first = declared.duplicate_of
                duplicate = DuplicateStepConflict(
                    step_id=declared.step_id,
                    first=Occurrence(location=first.location, name=first.name),
                    duplicate=Occurrence(location=declared.location, name=declared.seen.name),
                )
                return ConflictFound(conflict=duplicate)
            if declared.step_id not in self.memo:
                pending.append(declared)
        plans: list[StepPlan] = []
        for declared in pending:
            plan = self._full_plan(declared.step_id, declared.location, declared.seen.name, declared.compensate,
                                   declared.retry, declared.timeout, declared.compensate_retry,
                                   declared.compensate_timeout, declared.heartbeat, declared.wait,
                                   declared.completion)  # fmt: skip
            if isinstance(plan, ConflictFound):
                return plan
            plans.append(plan.step)
            if not self.parallel:
                break  # a server that runs one step at a time: the first now, the next in a later pass
        if len(plans) > MAX_SIBLINGS:
            first_pending = pending[0]
            message = (
                f"{len(plans)} steps are declared together from step {first_pending.step_id!r};"
                f" at most {MAX_SIBLINGS} may be"
            )
            step_id, where = _text(first_pending.step_id), first_pending.location
            return ConflictFound(conflict=InvalidStep(step_id=step_id, location=where, message=message))
        if len(plans) == 1:
            return StepReached(step=plans[0])
        return StepsReached(steps=plans, max_parallel=self.max_parallel)

    def stop_together(self, waiting: list[_Declared]) -> None:
        """End a discovery pass with what the steps declared together report (lock held)."""
        if self.outcome is None and not self.closed:
            self.outcome = self.together_outcome()
        if self.stopped_at is None and waiting:
            first = min(waiting, key=lambda d: d.index)
            self.stopped_at = _Open(first.step_id, first.location, first.seen.name, _context())

    def declared_target(self) -> _Declared | None:
        if self.target is None:
            return None
        return next((d for d in self.declarations if d.step_id == self.target and d.duplicate_of is None), None)

    async def wait_declared(self, declared: _Declared) -> NoReturn:
        """An awaited step with no recorded outcome that is not the target: wait until the pass decides."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._lock:
            decided = self.outcome is not None or self.closed or self.stopped_at is not None
            if not decided:
                self.waiting.append((declared, waiter))
        if not decided:
            if self.attention is not None:
                self.attention.set()
            await waiter
        if self.outcome is None and self.entered:
            await self.park()
        raise Suspend(self.outcome)

    async def pause_for_others(self) -> None:
        """A few loop turns, until the function's other tasks stop calling ``step.run``."""
        quiet = 0
        for _ in range(SETTLE_ROUNDS):
            before = self.calls
            await asyncio.sleep(0)
            quiet = quiet + 1 if self.calls == before else 0
            if quiet >= 3 or self.entered or self.closed:
                return

    async def settle(self, main: asyncio.Future[Any]) -> None:
        """Let the function's tasks run until they stop calling ``step.run`` (or the function ends)."""
        quiet = 0
        for _ in range(SETTLE_ROUNDS):
            before = self.calls
            await asyncio.sleep(0)
            if main.done():
                return
            quiet = quiet + 1 if self.calls == before else 0
            if quiet >= 3:
                return

    async def decide_waiting(self) -> None:
        """The pass has settled with steps waiting: a discovery reports them together; an attempt's pass runs its
        target (however it was declared) and reports it, or reports that it is not reached."""
        with self._lock:
            waiting, self.waiting = self.waiting, []
            if not waiting:
                return
            if self.kind is TaskKind.DISCOVER or self.entered or self.outcome is not None or self.closed:
                if self.kind is TaskKind.DISCOVER:
                    self.stop_together([d for d, _ in waiting])
                _release_all(waiting)
                return
            target = self.declared_target()
            if target is None:
                first = min((d for d, _ in waiting), key=lambda d: d.index)
                self.outcome = self._before_target(first.step_id, first.location, first.seen.name)
                self.stopped_at = _Open(first.step_id, first.location, first.seen.name, _context())
                _release_all(waiting)
                return
        try:
            await self.run_declared(target)
        finally:
            _release_all(waiting)

    def claim(self, declared: _Declared) -> bool:
        """An async attempt's pass calls its target: the pass stops here, and the runner runs the target's callback
        in the call's context (the function need not build what comes after it: a fan-out's other thousand
        steps). False where the call is not the target's (or not runnable from its declaration)."""
        if self.kind is TaskKind.DISCOVER or declared.step_id != self.target or declared.duplicate_of is not None:
            return False
        if self.kind is TaskKind.COMPENSATE and declared.compensate is None:
            return False
        with self._lock:
            if self.entered or self.closed or self.outcome is not None or self.stopped_at is not None:
                return False
            if self.function_thread is not None and threading.get_ident() != self.function_thread:
                return False
            if _current_operation.get() is not None:
                return False  # opened inside a callback: refused as before (decisions 23)
            self._open(declared.step_id, declared.location, declared.seen.name)
            # started now, not when the function has stopped: code that swallows the stop and waits on another
            # step waits for this callback, which must be running
            self.claimed = asyncio.get_running_loop().create_task(self.run_in_context(declared))
            if self.declarations and len(self.declarations) > 1:
                self.had_siblings = self.had_siblings or any(
                    d.step_id not in self.memo for d in self.declarations if d is not declared
                )
            return True

    async def run_in_context(self, declared: _Declared) -> None:
        """Run the target's callback (its pass is open), in the context its ``step.run`` was called in."""
        loop = asyncio.get_running_loop()
        callback = self.run_callback_async(_async_call(self, declared))
        task = loop.create_task(callback, context=declared.context) if declared.context else loop.create_task(callback)
        with contextlib.suppress(Suspend):
            await asyncio.shield(task)

    async def run_declared(self, declared: _Declared) -> None:
        """Run this attempt's target from its declaration: the function declared it and has not (or will not)
        run it itself (a task group cancelled its task, the function ended first)."""
        with self._lock:
            if self.entered or self.closed or self.outcome is not None:
                return
            if self.kind is TaskKind.COMPENSATE and declared.compensate is None:
                self.target_without_compensator = declared.location
                return
            self._open(declared.step_id, declared.location, declared.seen.name)
        await self.run_in_context(declared)

    async def finish_declared(self) -> None:
        """The function ended: an attempt whose target it declared and never ran still runs it (decision 30:
        each sibling settles on its own); then every step still waiting ends with the pass."""
        claimed, self.claimed = self.claimed, None
        if claimed is not None:
            await claimed
        elif self.kind is not TaskKind.DISCOVER and not self.entered and self.outcome is None and not self.closed:
            target = self.declared_target()
            if target is not None:
                await self.run_declared(target)
        with self._lock:
            waiting, self.waiting = self.waiting, []
        for _, waiter in waiting:
            waiter.cancel()
        for declared in self.declarations:  # never awaited (the pass stopped first): no warning about it
            awaitable = declared.awaitable
            if awaitable is not None and inspect.getcoroutinestate(awaitable) == inspect.CORO_CREATED:
                awaitable.close()

    # ---- step.parallel (a sync function's steps declared together) -----------------------

    def run_together(self, declared: list[_Declared], return_exceptions: bool) -> list[Any]:
        """``step.parallel``: the calls' recorded results (or failures) in order, once every one has one; else
        end the pass as one ``step.run`` among them would, with them all (decision 30)."""
        results: list[Any] = []
        failures: list[StepFailed] = []
        unrecorded: list[_Declared] = []
        target: tuple[_Declared, Any] | None = None
        for one in declared:
            try:
                action, value = self.enter(*one.entry_args(), declared=one)
            except StepFailed as failure:
                results.append(failure)
                failures.append(failure)
                continue
            if action == "return":
                results.append(value)
            elif action == "execute":
                target = (one, value)
                results.append(None)
            else:
                unrecorded.append(one)
                results.append(None)
        if target is not None:
            one, value = target
            with self._lock:
                self.keepable = False  # the rest of this pass waits for the siblings: not a continuation
                self.had_siblings = bool(unrecorded) or self.had_siblings
            call = value if self.kind is TaskKind.COMPENSATE else (lambda: value(*one.args, **one.kwargs))
            self.run_callback(one.step_id, _declaring(one.heartbeat, call))  # raises Suspend
        if failures and not return_exceptions:
            raise failures[0]  # as gather does: the first failure, in declaration order; no sibling starts
        if unrecorded:
            with self._lock:
                if self.kind is TaskKind.DISCOVER:
                    self.stop_together(unrecorded)
                elif self.outcome is None:
                    first = unrecorded[0]
                    self.outcome = self._before_target(first.step_id, first.location, first.seen.name)
                    self.stopped_at = _Open(first.step_id, first.location, first.seen.name, _context())
                raise Suspend(self.outcome)
        return results

    def _plan(
        self,
        step_id: str,
        location: str | None,
        display: str,
        compensate: Callable[[Any], Any] | None,
        retry: RetryPolicy | None,
        timeout: timedelta | None,
        compensate_retry: RetryPolicy | None,
        compensate_timeout: timedelta | None,
    ) -> StepReached | ConflictFound:
        """What discovery reports about a new step: its plan, or why the server could not record it."""
        try:
            return StepReached(
                step=StepPlan(
                    id=step_id,
                    name=display,
                    location=location,
                    has_compensation=compensate is not None,
                    retry=retry.to_wire() if retry else None,
                    compensate_retry=compensate_retry.to_wire() if compensate_retry else None,
                    timeout_s=timeout.total_seconds() if timeout is not None else None,
                    compensate_timeout_s=compensate_timeout.total_seconds() if compensate_timeout is not None else None,
                )
            )
        except (ValidationError, AttributeError, TypeError) as exc:
            problems = (
                "; ".join(_PLAN_PROBLEMS.get(str(e["loc"][0]), e["msg"]) for e in exc.errors(include_url=False))
                if isinstance(exc, ValidationError)
                else _describe(exc)
            )
            message = f"step.run({_text(step_id)[:80]!r}) cannot be recorded: {problems}"
            return ConflictFound(conflict=InvalidStep(step_id=_text(step_id), location=location, message=message))

    @staticmethod
    def _with_heartbeat(
        plan: StepReached, step_id: str, location: str | None, heartbeat: timedelta
    ) -> StepReached | ConflictFound:
        """The plan with its heartbeat interval (decision 33), or why it cannot be recorded."""
        seconds = heartbeat.total_seconds() if isinstance(heartbeat, timedelta) else None
        if seconds is None or seconds <= 0:
            message = f"step.run({_text(step_id)[:80]!r}) cannot be recorded: heartbeat must be a positive timedelta"
            return ConflictFound(conflict=InvalidStep(step_id=_text(step_id), location=location, message=message))
        return StepReached(step=plan.step.model_copy(update={"heartbeat_s": seconds}))

    @staticmethod
    def _with_wait(plan: StepReached, step_id: str, location: str | None, wait: Wait) -> StepReached | ConflictFound:
        """The plan with its wait (decision 31), or why it cannot be recorded."""
        problem = wait.problem()
        if problem is not None:
            message = f"{wait.call}({_text(step_id)[:80]!r}) cannot be recorded: {problem}"
            return ConflictFound(conflict=InvalidStep(step_id=_text(step_id), location=location, message=message))
        update = {"sleep": wait.sleep, "not_before": wait.at, "not_before_s": wait.after_s}
        return StepReached(step=plan.step.model_copy(update=update))

    @staticmethod
    def _with_completion(
        plan: StepReached, step_id: str, location: str | None, completion: Any
    ) -> StepReached | ConflictFound:
        """The plan of a step completed from outside (decision 32), or why it cannot be recorded."""
        if completion != "external":
            message = (
                f"step.run({_text(step_id)[:80]!r}) cannot be recorded: completion must be 'callback' or 'external'"
            )
            return ConflictFound(conflict=InvalidStep(step_id=_text(step_id), location=location, message=message))
        return StepReached(step=plan.step.model_copy(update={"completion": "external"}))

    def _stop(self, step_id: str, location: str | None, name: str, outcome: Any) -> NoReturn:
        """End the pass at this step with ``outcome``."""
        self.stopped_at = _Open(step_id, location, name, _context())
        self.outcome = outcome
        raise Suspend(outcome)

    def _open(self, step_id: str, location: str | None, name: str) -> None:
        """The target callback is about to run: from now on this task reports its outcome."""
        self.stopped_at = _Open(step_id, location, name, _context())
        self.entered = True

    def _refuse_from_another_thread(self, step_id: str, location: str | None, name: str) -> NoReturn:
        """A ``step.run`` from a thread that is not the function's, with no step open: two at once with the
        function itself, so refused by where it comes from rather than by timing (decisions 18). The pass
        ends at it with a ``concurrent_step`` conflict: the function's thread meets that end at its next
        ``step.run``, and another thread's step is refused as a second step after this one."""
        self.keepable = False
        refused = Occurrence(step_id=step_id, location=location, name=name)
        function = Occurrence(name="the workflow function's own thread")
        self.outcome = ConflictFound(conflict=ConcurrentStepConflict(first=function, second=refused))
        self.stopped_at = _Open(step_id, location, name, (self.function_thread or 0, None))
        raise ConcurrentStepError(step_id, open_step_id="", from_another_thread=True)

    def _after_stop(self, step_id: str, location: str | None, name: str) -> tuple[str, Any]:
        """``step.run`` after the pass stopped: the suspension again, or two steps at once."""
        first = self.stopped_at
        assert first is not None
        context = _context()
        sequential = first.context[0] == context[0] and first.context[1] is context[1]
        if self.outcome is not None and sequential:
            raise Suspend(self.outcome)  # the code swallowed the suspension and went on: nothing more runs
        inside_callback = _current_operation.get() is not None  # tasks a callback spawns inherit its operation
        if (
            self.entered
            and self.outcome is None
            and not inside_callback
            and context[1] is not None
            and context[1] is not first.context[1]
        ):
            # another asyncio task of the function while the target callback runs: wait for the callback to
            # finish instead of raising, so that a task group does not cancel it (decisions 16)
            return "park", None
        second = Occurrence(step_id=step_id, location=location, name=name)
        conflict = ConcurrentStepConflict(first=first.occurrence(), second=second)
        self.keepable = False
        refused = ConcurrentStepError(step_id, open_step_id=first.step_id)
        if not self.entered:
            self.outcome = ConflictFound(conflict=conflict)
        elif self.outcome is None:
            # opened while the target callback runs (inside it, or from a thread it started): if this error
            # escapes the callback, the attempt reports the refusal, not an ordinary failure (decisions 23)
            self.refused_in_callback.append((refused, conflict))
        raise refused

    # ---- the target callback ---------------------------------------------------------

    def operation_context(self) -> Operation:
        op = self.operation
        assert op is not None
        return Operation(id=op.id, phase=op.phase.value, generation=op.generation, completion_token=op.completion_token)

    def run_callback(self, step_id: str, call: Callable[[], Any]) -> Any:
        """Run the target callback and end the pass with its outcome; or, in a kept pass after a success,
        return the recorded result to the function, which goes on as the discovery that follows."""
        token = _current_operation.set(self.operation_context())
        outcome: Any = None
        going_on = False
        keeper = self.keeper
        try:
            try:
                # a kept pass runs the callback on its own thread, as the function around it, in the context
                # of the request that authorized this attempt with what the function set on top
                result = call() if keeper is None else keeper.run_callback(call)
                if inspect.isawaitable(result):
                    _close(result)
                    raise NonRetryableError(
                        f"step {step_id!r}: an async callback needs an async workflow function (async def)"
                    )
            except Exception as exc:  # noqa: BLE001 - every callback failure is reported
                outcome = self._failed(exc)
            else:
                outcome = self._succeeded(result)
        finally:
            _current_operation.reset(token)
            self._callback_finished(outcome)
            if outcome is not None:
                going_on = self._go_on(step_id, outcome)
        if going_on:
            return _fresh(outcome.result)
        raise Suspend(outcome)

    def _go_on(self, step_id: str, outcome: Any) -> bool:
        """After the target callback of a kept pass succeeded: hand its outcome to the task, and make the rest
        of this pass the discovery that follows, with the result recorded (the memo the server will hold)."""
        keeper = self.keeper
        if keeper is None:
            return False
        with self._lock:
            going_on = self.keepable and not self.closed and isinstance(outcome, CallbackSucceeded)
            if going_on:
                self.memo[step_id] = MemoEntry(status="completed", result=outcome.result)
                self.kind, self.target, self.operation = TaskKind.DISCOVER, None, None
                self.stopped_at, self.entered, self.outcome = None, False, None
                self.callback_done = threading.Event()
        keeper.attempt_finished(outcome, going_on=going_on)
        return going_on

    def resume(self, request_kind: TaskKind, memo: dict[str, MemoEntry], target: str, operation: OperationInfo) -> None:
        """A kept pass waiting at ``target`` becomes that step's attempt (called while it waits)."""
        with self._lock:
            self.kind, self.memo, self.target, self.operation = request_kind, memo, target, operation
            self.forward_result = None
            self.stopped_at, self.entered, self.outcome, self.closed = None, False, None, False
            self.callback_done = threading.Event()
            self.seen.pop(target, None)  # the same step.run call, entered again

    async def run_callback_async(self, call: Callable[[], Any]) -> NoReturn:
        token = _current_operation.set(self.operation_context())
        outcome: Any = None
        try:
            try:
                result = call()
                if inspect.isawaitable(result):
                    result = await result
            except Exception as exc:  # noqa: BLE001
                outcome = self._failed(exc)
            else:
                outcome = self._succeeded(result)
        finally:
            _current_operation.reset(token)
            self._callback_finished(outcome)
        raise Suspend(outcome)

    def _callback_finished(self, outcome: Any) -> None:
        """Record the callback's outcome (None: it was interrupted) before anyone is told it finished."""
        with self._lock:
            if outcome is not None:
                self.outcome = outcome
            parked, self.parked = self.parked, []
        self.callback_done.set()
        for waiter in parked:  # other tasks that waited for it end their pass now
            if not waiter.done():
                waiter.get_loop().call_soon_threadsafe(_release, waiter)

    async def park(self) -> NoReturn:
        """Wait, without running anything, until the target callback finishes (a second step meanwhile)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._lock:
            finished = self.callback_done.is_set()
            if not finished:
                self.parked.append(waiter)
        if not finished:
            await waiter
        raise Suspend(self.outcome)

    def _failed(self, exc: Exception) -> CallbackFailed:
        if (conflict := self._refusal_in(exc)) is not None:
            return CallbackFailed(error=nested_step_error(conflict, self.build_id))
        operation = self.operation
        what = f"{operation.phase} #{operation.generation}" if operation is not None else "attempt"
        level = logging.INFO if isinstance(exc, NonRetryableError) else logging.WARNING  # a decline is no surprise
        log.log(level, "the callback of step %r (%s) raised %s", self.target, what, type(exc).__name__, exc_info=exc)
        return CallbackFailed(
            error=error_info(exc, retryable=not isinstance(exc, NonRetryableError), with_traceback=self.tracebacks)
        )

    def _refusal_in(self, exc: BaseException) -> ConcurrentStepConflict | None:
        """The refusal of a step opened inside the callback, if ``exc`` is it, wraps it or groups it."""
        if not self.refused_in_callback:
            return None
        for found in _exception_chain(exc):
            for refused, conflict in self.refused_in_callback:
                if found is refused:
                    return conflict
        return None

    def _succeeded(self, value: Any) -> CallbackSucceeded | CallbackFailed:
        checked, problem = check_value(value, "result")
        if problem is not None and problem.type == "result_too_large":
            # the callback ran its effect: report that it succeeded, with what was too big to record (25)
            encoded = _encode(value)
            digest = hashlib.sha256(encoded).hexdigest()
            return CallbackSucceeded(omitted=OmittedValue(size=len(encoded), sha256=digest, limit=MAX_VALUE_BYTES))
        if problem is not None:
            return CallbackFailed(error=problem)
        return CallbackSucceeded(result=checked)

    # ---- what the pass reports --------------------------------------------------------

    async def wait_for_callback(self) -> None:
        """The function ended while the target callback still runs in another task (gather): let it finish."""
        while self.entered and not self.callback_done.is_set():
            await asyncio.sleep(0.001)

    def close(self) -> None:
        """End the pass from outside (its task stopped waiting for it): a ``step.run`` still to come runs
        nothing."""
        with self._lock:
            self.closed = True

    def report(self, *, output: Any = None, raised: BaseException | None = None) -> Any:
        """What this task reports, once the function has returned ``output`` or raised ``raised``.

        Closes the pass first: a ``step.run`` still to come (another thread, a stray task) runs nothing.
        A process interrupt (``KeyboardInterrupt``, ``SystemExit``, a cancellation) with nothing to
        report is raised again: the server then treats the task as lost, never as the function's failure.
        """
        with self._lock:
            self.closed = True
        if self.entered:
            self.callback_done.wait()  # a callback in another thread: its outcome is this task's
        for waiter in self.parked:
            waiter.cancel()
        for _, waiter in self.waiting:
            waiter.cancel()
        if self.entered:
            if self.outcome is None:
                raise CallbackInterruptedError(f"the callback of step {self.target!r} did not finish")
            return self.outcome
        if self.outcome is not None:
            return self.outcome
        if self.target_without_compensator is not None:
            return TargetNotFound(
                detail=f"current code declares no compensator for step {self.target!r}", reason="no_compensator"
            )
        if raised is not None and _interrupted(raised):
            raise raised
        if self.kind is TaskKind.DISCOVER:
            if raised is not None:
                log.warning("the function raised %s: the run fails", type(raised).__name__, exc_info=raised)
                return FunctionFailed(error=error_info(raised, with_traceback=self.tracebacks))
            return _completed(output)
        if raised is None:
            return self._not_reached(f"current code completes without reaching step {self.target!r}")
        if (failure := self._recorded_failure_in(raised)) is not None:
            return self._not_reached(
                f"current code ends with the recorded failure of step {failure.step_id!r}"
                f" before reaching step {self.target!r}"
            )
        return ReplayFailed(error=error_info(raised, with_traceback=self.tracebacks))

    def _not_reached(self, detail: str) -> TargetNotFound:
        """A compensation pass that ended without meeting its target: where it ended, and whether the function
        retired the target (only then may the server skip it: decisions 24)."""
        last = next(reversed(self.seen.items()), None)
        detail += f" (the pass ended after step {last[0]!r} at {last[1].location})" if last else " (it met no step)"
        if self.target in self.retired_steps:
            return TargetNotFound(detail=f"{detail}; the function retires step {self.target!r}", reason="retired")
        return TargetNotFound(detail=detail)

    def _recorded_failure_in(self, raised: BaseException) -> StepFailed | None:
        """A recorded ``StepFailed`` this pass raised, if ``raised`` is it, wraps it (``raise ... from``, or
        raised while handling it) or groups it (a TaskGroup): the function ended as its recorded run did."""
        for exc in _exception_chain(raised):
            if any(exc is failure for failure in self.recorded_failures):
                assert isinstance(exc, StepFailed)
                return exc
        return None


def _exception_chain(raised: BaseException) -> Iterator[BaseException]:
    """``raised``, what it wraps (``raise ... from``, or raised while handling) and what it groups."""
    seen: set[int] = set()
    pending = [raised]
    while pending:
        exc = pending.pop()
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        yield exc
        if isinstance(exc, BaseExceptionGroup):
            pending.extend(exc.exceptions)
        pending.extend(e for e in (exc.__cause__, exc.__context__) if e is not None)


def nested_step_error(conflict: ConcurrentStepConflict, build_id: str | None = None) -> ErrorInfo:
    """How an attempt reports that its callback opened a step and let the refusal escape (decisions 23): the
    callback ran, so it is not a plain failure to retry; the server blocks the run instead. ``build_id`` is the
    build of the code that ran it."""
    return ErrorInfo(
        type=NESTED_STEP_ERROR,
        message=(
            f"step {conflict.second.step_id!r} (at {conflict.second.location}) was opened inside the callback of"
            f" step {conflict.first.step_id!r} (at {conflict.first.location}); a callback cannot open steps"
        ),
        data={**conflict.model_dump(mode="json"), **({"build_id": build_id} if build_id else {})},
        retryable=False,
    )


def _release_all(waiting: list[tuple[_Declared, asyncio.Future[None]]]) -> None:
    for _, waiter in waiting:
        if not waiter.done():
            waiter.get_loop().call_soon_threadsafe(_release, waiter)


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _interrupted(exc: BaseException) -> bool:
    """A process or task being stopped, not the function failing: a ``KeyboardInterrupt``, or a cancellation
    of a task that is being cancelled. (A ``SystemExit`` from ``argparse``, say, is the function's failure.)"""
    if isinstance(exc, BaseExceptionGroup):
        return any(_interrupted(e) for e in exc.exceptions)
    if isinstance(exc, asyncio.CancelledError):
        try:
            task = asyncio.current_task()
        except RuntimeError:
            return True
        return task is None or task.cancelling() > 0
    return isinstance(exc, KeyboardInterrupt)


def _completed(output: Any) -> FunctionCompleted | ConflictFound:
    """A function's return value as discovery reports it; one that cannot be recorded blocks (decisions 20)."""
    try:
        encoded = _encode(output)
    except (TypeError, ValueError, RecursionError) as exc:
        return ConflictFound(
            conflict=OutputNotJson(message=f"the function's return value is not JSON: {_describe(exc)}")
        )
    if (size := len(encoded)) > MAX_VALUE_BYTES:
        return ConflictFound(conflict=OutputTooLarge(size=size, limit=MAX_VALUE_BYTES))
    output = json.loads(encoded)
    if (problem := json_value_problem(output)) is not None:
        return ConflictFound(conflict=OutputNotJson(message=f"the function's return value {problem}"))
    return FunctionCompleted(output=output)


@dataclass(frozen=True, slots=True)
class Wait:
    """A durable wait a step declares (decision 31): ``step.sleep`` (``sleep``), or ``not_before=`` on
    ``step.run``; until a Unix time (``at``) or for seconds after the server first records the step (``after_s``)."""

    call: str
    sleep: bool
    at: float | None = None
    after_s: float | None = None

    @classmethod
    def of(cls, call: str, value: Any, *, sleep: bool) -> Wait:
        """``value``, a ``timedelta`` (from when the step is first recorded) or an aware ``datetime``."""
        if isinstance(value, timedelta):
            return cls(call, sleep, after_s=value.total_seconds())
        if isinstance(value, datetime) and value.tzinfo is not None:
            return cls(call, sleep, at=value.timestamp())
        return cls(call, sleep, at=math.nan)  # refused by problem(), where the pass reports it

    def problem(self) -> str | None:
        what = "the wait" if self.sleep else "not_before"
        if self.at is not None and math.isnan(self.at):
            return f"{what} must be a timedelta or a timezone-aware datetime"
        if self.after_s is not None and not 0 <= self.after_s <= MAX_WAIT_S:
            return f"{what} must be between 0 and {MAX_WAIT_S / 86400:g} days"
        return None


def _slept() -> None:
    """What a durable wait's step runs: nothing (the server completes it at its due time)."""


class Step:
    """Handed to a workflow function: wraps each external effect in ``run``.

    >>> def checkout(order: dict, step: Step) -> dict:
    ...     stock = step.run("reserve-stock", reserve, order["sku"], compensate=release)
    ...     return {"stock": stock}
    """

    def __init__(self, replay: _Replay) -> None:
        self._replay = replay

    def run(
        self,
        step_id: str,
        fn: Callable[..., T],
        *args: Any,
        compensate: Callable[[Any], Any] | None = None,
        name: str | None = None,
        retry: RetryPolicy | None = None,
        timeout: timedelta | None = None,
        compensate_retry: RetryPolicy | None = None,
        compensate_timeout: timedelta | None = None,
        heartbeat: timedelta | None = None,
        not_before: timedelta | datetime | None = None,
        completion: Literal["callback", "external"] = "callback",
        **kwargs: Any,
    ) -> T:
        """Run ``fn(*args, **kwargs)`` as step ``step_id``, at most once per accepted result.

        Returns the recorded result on replay; raises :class:`StepFailed` when
        the step's retries are exhausted. ``compensate`` is called with the
        recorded result if the run later fails, is cancelled or times out.
        ``timeout`` bounds one forward attempt; ``compensate_timeout`` one
        compensation attempt (default: the server's attempt timeout, 5 min).
        ``heartbeat``: the callback calls :func:`ryusen.heartbeat` at least this
        often; an attempt silent for longer is Unknown before its timeout.
        ``not_before`` (a ``timedelta`` from when the step is first recorded, or
        an aware ``datetime``) delays its first attempt: a durable wait.
        ``completion="external"``: the callback hands out
        ``ryusen.operation().completion_token`` and the step's result comes from
        outside with it, within ``timeout`` (what the callback returns is not it).
        A ``step.run`` from another thread, or inside another step's callback,
        raises :class:`ConcurrentStepError`; run steps together with
        :meth:`parallel`.
        """
        wait = Wait.of("step.run", not_before, sleep=False) if not_before is not None else None
        return self._run(step_id, fn, args, kwargs, _caller_location(1), compensate, name, retry, timeout,  # type: ignore[no-any-return]
                         compensate_retry, compensate_timeout, heartbeat, wait, completion)  # fmt: skip

    def sleep(self, step_id: str, duration: timedelta) -> None:
        """Wait ``duration``, durably: step ``step_id`` completes that long after it is first recorded, however
        often the function is replayed meanwhile (no process waits). A stop during the wait ends it at once."""
        wait = Wait.of("step.sleep", duration if isinstance(duration, timedelta) else object(), sleep=True)
        self._run(
            step_id, _slept, (), {}, _caller_location(1), None, "durable wait", None, None, None, None, None, wait
        )

    def sleep_until(self, step_id: str, moment: datetime) -> None:
        """Wait, durably, until ``moment`` (a timezone-aware ``datetime``); at once if it has passed."""
        wait = Wait.of("step.sleep_until", moment if isinstance(moment, datetime) else object(), sleep=True)
        self._run(
            step_id, _slept, (), {}, _caller_location(1), None, "durable wait", None, None, None, None, None, wait
        )

    def parallel(self, *calls: Callable[[], Any], return_exceptions: bool = False) -> list[Any]:
        """Run several steps together (decision 30): each call runs one ``step.run`` (or ``step.sleep``), as a
        ``lambda``. Returns their results in order once all have settled; the steps run at once, up to the
        function's ``max_parallel``. A step that failed raises its :class:`StepFailed` (the first in order), after
        every sibling in flight has settled; with ``return_exceptions=True`` it is returned in its place.

        >>> def trip(data: dict, step: Step) -> list:
        ...     return step.parallel(
        ...         lambda: step.run("flight", book_flight, data, compensate=cancel_flight),
        ...         lambda: step.run("hotel", book_hotel, data, compensate=cancel_hotel),
        ...     )
        """
        replay = self._replay
        if replay.collecting is not None:
            raise TypeError("step.parallel cannot be called inside another step.parallel")
        collected: list[_Declared] = []
        replay.collecting = (threading.get_ident(), collected)
        try:
            for call in calls:
                if not callable(call):
                    raise TypeError("step.parallel takes callables, each calling step.run once: lambda: step.run(...)")
                before = len(collected)
                with contextlib.suppress(_Declaring):
                    call()
                if len(collected) != before + 1:
                    raise TypeError("each callable given to step.parallel must call step.run (or step.sleep) once")
        finally:
            replay.collecting = None
        return replay.run_together(collected, return_exceptions)

    def _run(
        self,
        step_id: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        location: str | None,
        compensate: Callable[[Any], Any] | None,
        name: str | None,
        retry: RetryPolicy | None,
        timeout: timedelta | None,
        compensate_retry: RetryPolicy | None,
        compensate_timeout: timedelta | None,
        heartbeat: timedelta | None,
        wait: Wait | None,
        completion: str = "callback",
    ) -> Any:
        replay = self._replay
        collecting = replay.collecting
        if collecting is not None and collecting[0] == threading.get_ident():  # inside step.parallel: declared
            declared = replay.declare(step_id, location, fn, args, kwargs, name, compensate, retry, timeout,
                                      compensate_retry, compensate_timeout, heartbeat, wait, completion)  # fmt: skip
            collecting[1].append(declared)
            raise _Declaring
        enter = functools.partial(
            replay.enter,
            step_id,
            location,
            fn,
            name,
            compensate,
            retry,
            timeout,
            compensate_retry,
            compensate_timeout,
            heartbeat,
            wait,
            completion,
        )
        action, value = enter()
        if action == "keep":  # a kept pass: wait here for this step's attempt (or end, if it does not come)
            assert replay.keeper is not None
            replay.keeper.wait_for_attempt(value)
            action, value = enter()
        if action == "return":
            return value
        if action == "park":  # pragma: no cover - only an asyncio task can park
            raise ConcurrentStepError(step_id, open_step_id=replay.target or "?")
        call = value if replay.kind is TaskKind.COMPENSATE else (lambda: value(*args, **kwargs))
        return replay.run_callback(step_id, _declaring(heartbeat, call))


class AsyncStep:
    """The ``step`` of an ``async def`` workflow function: ``await step.run(...)``.

    Accepts sync and async callbacks alike: a plain (not ``async def``) callback
    runs on a worker thread, with the context it was called in, so that it does not
    hold the event loop. Steps whose awaitables exist before the function awaits any
    of them (``asyncio.gather``, a task group, a comprehension) run together, at most
    the function's ``max_parallel`` at once (decision 30).
    """

    def __init__(self, replay: _Replay) -> None:
        self._replay = replay

    def run(
        self,
        step_id: str,
        fn: Callable[..., T | Awaitable[T]],
        *args: Any,
        compensate: Callable[[Any], Any] | None = None,
        name: str | None = None,
        retry: RetryPolicy | None = None,
        timeout: timedelta | None = None,
        compensate_retry: RetryPolicy | None = None,
        compensate_timeout: timedelta | None = None,
        heartbeat: timedelta | None = None,
        not_before: timedelta | datetime | None = None,
        completion: Literal["callback", "external"] = "callback",
        **kwargs: Any,
    ) -> Awaitable[T]:
        """Like :meth:`Step.run`, awaitable. The source location is taken where ``run`` is called."""
        location = _caller_location(1)
        wait = Wait.of("step.run", not_before, sleep=False) if not_before is not None else None
        return self._run(step_id, fn, args, kwargs, location, compensate, name, retry, timeout, compensate_retry,
                         compensate_timeout, heartbeat, wait, completion)  # fmt: skip

    def sleep(self, step_id: str, duration: timedelta) -> Awaitable[None]:
        """Like :meth:`Step.sleep`, awaitable."""
        wait = Wait.of("step.sleep", duration if isinstance(duration, timedelta) else object(), sleep=True)
        return self._run(
            step_id, _slept, (), {}, _caller_location(1), None, "durable wait", None, None, None, None, None, wait
        )

    def sleep_until(self, step_id: str, moment: datetime) -> Awaitable[None]:
        """Like :meth:`Step.sleep_until`, awaitable."""
        wait = Wait.of("step.sleep_until", moment if isinstance(moment, datetime) else object(), sleep=True)
        return self._run(
            step_id, _slept, (), {}, _caller_location(1), None, "durable wait", None, None, None, None, None, wait
        )

    def _run(
        self,
        step_id: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        location: str | None,
        compensate: Callable[[Any], Any] | None,
        name: str | None,
        retry: RetryPolicy | None,
        timeout: timedelta | None,
        compensate_retry: RetryPolicy | None,
        compensate_timeout: timedelta | None,
        heartbeat: timedelta | None,
        wait: Wait | None,
        completion: str = "callback",
    ) -> Awaitable[Any]:
        replay = self._replay
        # the step exists from the call on (decision 30): steps called before any is awaited run together
        declared = replay.declare(step_id, location, fn, args, kwargs, name, compensate, retry, timeout,
                                  compensate_retry, compensate_timeout, heartbeat, wait, completion)  # fmt: skip

        if replay.claim(declared):
            raise Suspend(None)  # this attempt's target: the pass stops at its call, and the runner runs it

        async def run() -> Any:
            try:
                action, value = replay.enter(*declared.entry_args(), declared=declared)
            except StepFailed:
                if replay.kind is not TaskKind.DISCOVER:
                    # let the other tasks reach their steps first: a task group cancels them when this raises, and
                    # an attempt's target among them must still be found (its callback or compensator runs)
                    await replay.pause_for_others()
                raise
            if action == "return":
                return value
            if action == "park":
                await replay.park()
            if action in ("together", "beside"):
                await replay.wait_declared(declared)
            await replay.run_callback_async(_async_call(replay, declared, value))

        declared.awaitable = awaitable = run()
        return awaitable


def _async_call(replay: _Replay, declared: _Declared, value: Any = None) -> Callable[[], Any]:
    """What runs an async pass's target: its callback (or compensator), with its heartbeat declared; a plain
    callback on a worker thread, so that it does not hold the event loop (other requests')."""
    compensating = replay.kind is TaskKind.COMPENSATE
    call: Callable[[], Any]
    if compensating:
        compensate = declared.compensate
        assert compensate is not None
        call = value if value is not None else (lambda: compensate(replay.forward_result))
    else:
        fn = value if value is not None else declared.fn
        call = lambda: fn(*declared.args, **declared.kwargs)  # noqa: E731
    call = _declaring(declared.heartbeat, call)
    if not _is_async(declared.compensate if compensating else declared.fn):
        call = _off_the_loop(call)
    return call


def _declaring(heartbeat: timedelta | None, call: Callable[[], Any]) -> Callable[[], Any]:
    """``call``, telling the heartbeat sink of the context it runs in (the attempt's request's, also in a kept pass)
    that the step declared ``heartbeat``: its heartbeats are posted at most a quarter of that apart."""
    if not isinstance(heartbeat, timedelta) or heartbeat.total_seconds() <= 0:
        return call

    def declared() -> Any:
        sink = SINK.get()
        if sink is not None:
            sink.declared(heartbeat.total_seconds())
        return call()

    return declared


def _is_async(fn: Any) -> bool:
    """``fn`` is an ``async def`` (a function, a method, a partial of one, or an object with an async ``__call__``)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _off_the_loop(call: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
    """A plain callback of an async function, run on a worker thread of the event loop, so that the loop goes on
    serving other requests while it blocks; in a copy of the context it is called in (``ryusen.operation()``
    works there). What it returns, if awaitable (``lambda: fetch(url)``), is awaited on the loop. The callback
    cannot be stopped once started: if the function stops waiting for it (a timeout around ``step.run``), it
    still runs to its end and its outcome is the attempt's (decisions 16), as it was when it ran on the loop."""

    async def run() -> Any:
        finished = asyncio.get_running_loop().run_in_executor(None, contextvars.copy_context().run, call)
        while True:
            try:
                result = await asyncio.shield(finished)
                break
            except asyncio.CancelledError:
                if finished.cancelled():  # pragma: no cover - the executor was shut down under it
                    raise
        if inspect.isawaitable(result):
            result = await result
        return result

    return run


def _close(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        close()


__all__ = ["AsyncStep", "OmittedResult", "Operation", "Phase", "RetryPolicy", "Step", "Suspend", "operation"]

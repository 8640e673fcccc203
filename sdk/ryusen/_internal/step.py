"""``step.run`` and the replay that answers one task.

Theory of operation. Every task runs the user's function from the top with the
memo of recorded step outcomes. ``step.run`` returns a recorded success,
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
* compensate: the target's compensator outcome; ``target_not_found`` only when
  the function ends without meeting the target or any unrecorded step (the
  step is gone from current code); ``new_step_before_target`` when an
  unrecorded step comes first; ``replay_failed`` when code outside
  ``step.run`` raises first (decisions 17).

The step at which the pass stopped stays *open*: another ``step.run`` from a
different thread or asyncio task, or from inside the running callback, is two
steps at once and is refused with :class:`ConcurrentStepError` (decisions 18).
The same code re-entering ``step.run`` after swallowing the suspension just
gets the suspension again: nothing else runs in that pass.

Code outside ``step.run`` runs again on every pass; that is repeatable
orchestration, not deterministic replay (RFD 1).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import json
import os
import sys
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, NoReturn, TypeVar

from .errors import ConcurrentStepError, NonRetryableError, NoOperationError, StepFailed
from .wire import (
    MAX_VALUE_BYTES,
    CallbackFailed,
    CallbackSucceeded,
    ConcurrentStepConflict,
    ConflictFound,
    DuplicateStepConflict,
    ErrorInfo,
    FunctionCompleted,
    FunctionFailed,
    MemoEntry,
    NewStepBeforeTarget,
    Occurrence,
    OperationInfo,
    OutputTooLarge,
    Phase,
    ReplayFailed,
    RetryPolicyWire,
    StepPlan,
    StepReached,
    TargetNotFound,
    TaskKind,
)

T = TypeVar("T")


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
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
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
class Operation:
    """The operation a callback is executing: use ``id`` as an idempotency key.

    ``id`` is stable across every generation (retry) of one step's phase.
    """

    id: str
    phase: str
    generation: int


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


def error_info(exc: BaseException, *, retryable: bool = True) -> ErrorInfo:
    if isinstance(exc, StepFailed):
        return ErrorInfo(
            type="StepFailed",
            message=str(exc),
            data={"step_id": exc.step_id, "error_type": exc.error_type, "data": exc.data},
            retryable=retryable,
        ).bounded()
    data = getattr(exc, "data", None) if isinstance(exc, NonRetryableError) else None
    return ErrorInfo(type=type(exc).__name__, message=str(exc), data=_jsonable(data), retryable=retryable).bounded()


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


def check_value(value: Any, what: str) -> tuple[Any, ErrorInfo | None]:
    """Serialize ``value`` as JSON and enforce the size limit (decisions 6.11)."""
    try:
        encoded = json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        return None, ErrorInfo(type="not_json_serializable", message=f"{what} is not JSON: {exc}", retryable=False)
    if (size := len(encoded.encode())) > MAX_VALUE_BYTES:
        return None, ErrorInfo(
            type=f"{what}_too_large",
            message=f"{what} is {size} bytes serialized; the limit is {MAX_VALUE_BYTES}",
            retryable=False,
        )
    return json.loads(encoded), None


def _caller_location(depth: int) -> str | None:
    """``file:line`` of the frame ``depth`` levels above this function's caller."""
    frame = sys._getframe(depth + 1)
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _display_name(fn: Callable[..., Any], name: str | None) -> str:
    return name or getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _context() -> tuple[int, asyncio.Task[Any] | None]:
    """Who is calling: the thread, and the asyncio task within it (gather runs each awaitable in a task)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running event loop in this thread
        task = None
    return threading.get_ident(), task


@dataclass(slots=True)
class _Seen:
    location: str | None
    name: str


@dataclass(slots=True)
class _Open:
    """The ``step.run`` at which this pass stopped: its callback is running, or it ended the pass."""

    step_id: str
    location: str | None
    name: str
    context: tuple[int, asyncio.Task[Any] | None]

    def occurrence(self) -> Occurrence:
        return Occurrence(step_id=self.step_id, location=self.location, name=self.name)


class CallbackInterruptedError(Exception):
    """The target callback was entered but did not finish (it raised a ``BaseException`` such as
    ``KeyboardInterrupt``, or was cancelled): there is no outcome to report, and ``target_not_found``
    would be a lie. The endpoint answers 500, which the server treats as an Unknown outcome."""


class _Replay:
    """One pass: the task, the memo, the ids seen so far, and what the pass reports."""

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
        self.callback_finished: asyncio.Event | None = None
        self.recorded_failures: list[StepFailed] = []

    # ---- step.run -----------------------------------------------------------------

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
    ) -> tuple[str, Any]:
        """Decide what ``step.run`` does: ("return", value) or ("execute", callable); or raise."""
        if not isinstance(step_id, str) or not step_id:
            raise TypeError("step id must be a non-empty string")
        display = _display_name(fn, name)
        if self.stopped_at is not None:
            self._after_stop(step_id, location, display)
        first = self.seen.get(step_id)
        if first is not None:
            duplicate = DuplicateStepConflict(
                step_id=step_id,
                first=Occurrence(location=first.location, name=first.name),
                duplicate=Occurrence(location=location, name=display),
            )
            self._stop(step_id, location, display, ConflictFound(conflict=duplicate))
        self.seen[step_id] = _Seen(location, display)
        if self.kind is TaskKind.COMPENSATE and step_id == self.target:
            if compensate is None:
                detail = f"current code declares no compensator for step {step_id!r}"
                self._stop(step_id, location, display, TargetNotFound(detail=detail))
            self._open(step_id, location, display)
            return "execute", lambda: compensate(self.forward_result)
        recorded = self.memo.get(step_id)
        if recorded is not None and recorded.status == "completed":
            return "return", json.loads(json.dumps(recorded.result))
        if recorded is not None:
            err = recorded.error or ErrorInfo(type="Error", message="step failed")
            failure = StepFailed(step_id, err.type, err.message, err.data)
            self.recorded_failures.append(failure)
            raise failure
        if self.kind is TaskKind.DISCOVER:
            plan = StepPlan(
                id=step_id,
                name=display,
                location=location,
                has_compensation=compensate is not None,
                retry=retry.to_wire() if retry else None,
                compensate_retry=compensate_retry.to_wire() if compensate_retry else None,
                timeout_s=timeout.total_seconds() if timeout else None,
                compensate_timeout_s=compensate_timeout.total_seconds() if compensate_timeout else None,
            )
            self._stop(step_id, location, display, StepReached(step=plan))
        if step_id != self.target:
            assert self.target is not None
            if self.kind is TaskKind.COMPENSATE:
                met = Occurrence(step_id=step_id, location=location, name=display)
                conflict = NewStepBeforeTarget(step_id=self.target, first=met)
                self._stop(step_id, location, display, ConflictFound(conflict=conflict))
            detail = f"current code reaches step {step_id!r} before {self.target!r}"
            self._stop(step_id, location, display, TargetNotFound(detail=detail))
        self._open(step_id, location, display)
        return "execute", fn

    def _stop(self, step_id: str, location: str | None, name: str, outcome: Any) -> NoReturn:
        """End the pass at this step with ``outcome``."""
        self.stopped_at = _Open(step_id, location, name, _context())
        self.outcome = outcome
        raise Suspend(outcome)

    def _open(self, step_id: str, location: str | None, name: str) -> None:
        """The target callback is about to run: from now on this task reports its outcome."""
        self.stopped_at = _Open(step_id, location, name, _context())
        self.entered = True

    def _after_stop(self, step_id: str, location: str | None, name: str) -> NoReturn:
        """``step.run`` after the pass stopped: the suspension again, or two steps at once."""
        first = self.stopped_at
        assert first is not None
        context = _context()
        sequential = first.context[0] == context[0] and first.context[1] is context[1]
        if self.outcome is not None and sequential:
            raise Suspend(self.outcome)  # the code swallowed the suspension and went on: nothing more runs
        if not self.entered:
            second = Occurrence(step_id=step_id, location=location, name=name)
            self.outcome = ConflictFound(conflict=ConcurrentStepConflict(first=first.occurrence(), second=second))
        raise ConcurrentStepError(step_id, open_step_id=first.step_id)

    # ---- the target callback ---------------------------------------------------------

    def operation_context(self) -> Operation:
        op = self.operation
        assert op is not None
        return Operation(id=op.id, phase=op.phase.value, generation=op.generation)

    def run_callback(self, step_id: str, call: Callable[[], Any]) -> NoReturn:
        token = _current_operation.set(self.operation_context())
        try:
            result = call()
            if inspect.isawaitable(result):
                _close(result)
                raise NonRetryableError(
                    f"step {step_id!r}: an async callback needs an async workflow function (async def)"
                )
        except Exception as exc:  # noqa: BLE001 - every callback failure is reported
            self._finish(self._failed(exc))
        finally:
            _current_operation.reset(token)
        self._finish(self._succeeded(result))

    async def run_callback_async(self, call: Callable[[], Any]) -> NoReturn:
        self.callback_finished = asyncio.Event()
        token = _current_operation.set(self.operation_context())
        try:
            result = call()
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:  # noqa: BLE001
            self._finish(self._failed(exc))
        finally:
            _current_operation.reset(token)
            self.callback_finished.set()
        self._finish(self._succeeded(result))

    def _failed(self, exc: Exception) -> CallbackFailed:
        return CallbackFailed(error=error_info(exc, retryable=not isinstance(exc, NonRetryableError)))

    def _succeeded(self, value: Any) -> CallbackSucceeded | CallbackFailed:
        checked, problem = check_value(value, "result")
        if problem is not None:
            return CallbackFailed(error=problem)
        return CallbackSucceeded(result=checked)

    def _finish(self, outcome: Any) -> NoReturn:
        self.outcome = outcome
        raise Suspend(outcome)

    # ---- what the pass reports --------------------------------------------------------

    async def wait_for_callback(self) -> None:
        """The function ended while the target callback still runs in another task (gather): let it finish."""
        if self.entered and self.outcome is None and self.callback_finished is not None:
            await self.callback_finished.wait()

    def report(self, *, output: Any = None, raised: BaseException | None = None) -> Any:
        """What this task reports, once the function has returned ``output`` or raised ``raised``."""
        if self.entered:
            if self.outcome is None:
                raise CallbackInterruptedError(f"the callback of step {self.target!r} did not finish")
            return self.outcome
        if self.outcome is not None:
            return self.outcome
        if self.kind is TaskKind.DISCOVER:
            if raised is not None:
                return FunctionFailed(error=error_info(raised))
            return _completed(output)
        if raised is None:
            return TargetNotFound(detail=f"current code completes without reaching step {self.target!r}")
        if any(raised is failure for failure in self.recorded_failures):
            assert isinstance(raised, StepFailed)
            return TargetNotFound(
                detail=f"current code ends with the recorded failure of step {raised.step_id!r}"
                f" before reaching step {self.target!r}"
            )
        return ReplayFailed(error=error_info(raised))


def _completed(output: Any) -> FunctionCompleted | FunctionFailed | ConflictFound:
    """A function's return value as discovery reports it; an output over the limit is a conflict (decisions 20)."""
    try:
        encoded = json.dumps(output, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        return FunctionFailed(
            error=ErrorInfo(type="not_json_serializable", message=f"output is not JSON: {exc}", retryable=False)
        )
    if (size := len(encoded.encode())) > MAX_VALUE_BYTES:
        return ConflictFound(conflict=OutputTooLarge(size=size, limit=MAX_VALUE_BYTES))
    return FunctionCompleted(output=json.loads(encoded))


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
        **kwargs: Any,
    ) -> T:
        """Run ``fn(*args, **kwargs)`` as step ``step_id``, at most once per accepted result.

        Returns the recorded result on replay; raises :class:`StepFailed` when
        the step's retries are exhausted. ``compensate`` is called with the
        recorded result if the run later fails, is cancelled or times out.
        ``timeout`` bounds one forward attempt; ``compensate_timeout`` one
        compensation attempt (default: the server's attempt timeout, 5 min).
        One step runs at a time: a ``step.run`` started while another is open
        raises :class:`ConcurrentStepError`.
        """
        replay = self._replay
        action, value = replay.enter(
            step_id, _caller_location(1), fn, name, compensate, retry, timeout, compensate_retry, compensate_timeout
        )
        if action == "return":
            return value  # type: ignore[no-any-return]
        call = value if replay.kind is TaskKind.COMPENSATE else (lambda: value(*args, **kwargs))
        replay.run_callback(step_id, call)


class AsyncStep:
    """The ``step`` of an ``async def`` workflow function: ``await step.run(...)``.

    Accepts sync and async callbacks alike. Await each step before starting
    the next: ``asyncio.gather`` of two steps raises :class:`ConcurrentStepError`.
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
        **kwargs: Any,
    ) -> Awaitable[T]:
        """Like :meth:`Step.run`, awaitable. The source location is taken where ``run`` is called."""
        location = _caller_location(1)

        async def run() -> T:
            replay = self._replay
            action, value = replay.enter(
                step_id, location, fn, name, compensate, retry, timeout, compensate_retry, compensate_timeout
            )
            if action == "return":
                return value  # type: ignore[no-any-return]
            call = value if replay.kind is TaskKind.COMPENSATE else (lambda: value(*args, **kwargs))
            await replay.run_callback_async(call)

        return run()


def _close(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        close()


__all__ = ["AsyncStep", "Operation", "Phase", "RetryPolicy", "Step", "Suspend", "operation"]

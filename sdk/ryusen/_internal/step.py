"""``step.run`` and the replay that answers one task.

Theory of operation. Every task runs the user's function from the top with the
memo of recorded step outcomes. ``step.run`` returns a recorded success,
raises :class:`StepFailed` for a recorded terminal failure, and otherwise ends
the pass by raising :class:`Suspend` (a ``BaseException``, so a user's
``except Exception`` cannot swallow it) carrying what the task learned:

* discover: the first step with no recorded outcome (its plan), or a
  duplicate step id conflict found before the second callback can run;
* forward: the target step's callback outcome;
* compensate: the target step's compensator outcome, or ``target_not_found``.

Code outside ``step.run`` runs again on every pass; that is repeatable
orchestration, not deterministic replay (RFD 1).
"""

from __future__ import annotations

import contextvars
import inspect
import json
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, TypeVar

from .errors import NonRetryableError, NoOperationError, StepFailed
from .wire import (
    MAX_VALUE_BYTES,
    CallbackFailed,
    CallbackSucceeded,
    ConflictFound,
    DuplicateStepConflict,
    ErrorInfo,
    MemoEntry,
    Occurrence,
    OperationInfo,
    Phase,
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


def _caller_location() -> str | None:
    frame = sys._getframe(3)
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _display_name(fn: Callable[..., Any], name: str | None) -> str:
    return name or getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


@dataclass(slots=True)
class _Seen:
    location: str | None
    name: str


class _Replay:
    """Bookkeeping of one pass: the task, the memo, and the ids seen so far."""

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

    def enter(
        self,
        step_id: str,
        fn: Callable[..., Any],
        name: str | None,
        compensate: Callable[[Any], Any] | None,
        retry: RetryPolicy | None,
        timeout: timedelta | None,
        compensate_retry: RetryPolicy | None,
        compensate_timeout: timedelta | None,
    ) -> tuple[str, Any]:
        """Decide what ``step.run`` does: ("return", value) or ("execute", callable)."""
        if not isinstance(step_id, str) or not step_id:
            raise TypeError("step id must be a non-empty string")
        location = _caller_location()
        display = _display_name(fn, name)
        first = self.seen.get(step_id)
        if first is not None:
            raise Suspend(
                ConflictFound(
                    conflict=DuplicateStepConflict(
                        step_id=step_id,
                        first=Occurrence(location=first.location, name=first.name),
                        duplicate=Occurrence(location=location, name=display),
                    )
                )
            )
        self.seen[step_id] = _Seen(location, display)
        recorded = self.memo.get(step_id)
        if self.kind is TaskKind.COMPENSATE and step_id == self.target:
            if compensate is None:
                raise Suspend(TargetNotFound(detail=f"current code declares no compensator for step {step_id!r}"))
            return "execute", lambda: compensate(self.forward_result)
        if recorded is not None and recorded.status == "completed":
            return "return", json.loads(json.dumps(recorded.result))
        if recorded is not None:
            err = recorded.error or ErrorInfo(type="Error", message="step failed")
            raise StepFailed(step_id, err.type, err.message, err.data)
        if self.kind is TaskKind.DISCOVER:
            raise Suspend(
                StepReached(
                    step=StepPlan(
                        id=step_id,
                        name=display,
                        location=location,
                        has_compensation=compensate is not None,
                        retry=retry.to_wire() if retry else None,
                        compensate_retry=compensate_retry.to_wire() if compensate_retry else None,
                        timeout_s=timeout.total_seconds() if timeout else None,
                        compensate_timeout_s=compensate_timeout.total_seconds() if compensate_timeout else None,
                    )
                )
            )
        if step_id != self.target:
            raise Suspend(TargetNotFound(detail=f"current code reaches step {step_id!r} before {self.target!r}"))
        return "execute", fn

    def operation_context(self) -> Operation:
        op = self.operation
        assert op is not None
        return Operation(id=op.id, phase=op.phase.value, generation=op.generation)

    def settle(self, value: Any) -> None:
        """After executing the target callback: end the pass with its outcome."""
        checked, problem = check_value(value, "result")
        if problem is not None:
            raise Suspend(CallbackFailed(error=problem))
        raise Suspend(CallbackSucceeded(result=checked))

    def fail(self, exc: Exception) -> None:
        raise Suspend(CallbackFailed(error=error_info(exc, retryable=not isinstance(exc, NonRetryableError))))


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
        """
        action, value = self._replay.enter(
            step_id, fn, name, compensate, retry, timeout, compensate_retry, compensate_timeout
        )
        if action == "return":
            return value  # type: ignore[no-any-return]
        token = _current_operation.set(self._replay.operation_context())
        try:
            if self._replay.kind is TaskKind.COMPENSATE:
                result = value()
            else:
                result = value(*args, **kwargs)
            if inspect.isawaitable(result):
                _close(result)
                raise NonRetryableError(
                    f"step {step_id!r}: an async callback needs an async workflow function (async def)"
                )
        except Exception as exc:  # noqa: BLE001 - every callback failure is reported
            self._replay.fail(exc)
        finally:
            _current_operation.reset(token)
        self._replay.settle(result)
        raise AssertionError("unreachable")


class AsyncStep:
    """The ``step`` of an ``async def`` workflow function: ``await step.run(...)``.

    Accepts sync and async callbacks alike.
    """

    def __init__(self, replay: _Replay) -> None:
        self._replay = replay

    async def run(
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
    ) -> T:
        """Like :meth:`Step.run`, awaitable."""
        action, value = self._replay.enter(
            step_id, fn, name, compensate, retry, timeout, compensate_retry, compensate_timeout
        )
        if action == "return":
            return value  # type: ignore[no-any-return]
        token = _current_operation.set(self._replay.operation_context())
        try:
            result = value() if self._replay.kind is TaskKind.COMPENSATE else value(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:  # noqa: BLE001
            self._replay.fail(exc)
        finally:
            _current_operation.reset(token)
        self._replay.settle(result)
        raise AssertionError("unreachable")


def _close(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        close()


__all__ = ["AsyncStep", "Operation", "Phase", "RetryPolicy", "Step", "Suspend", "operation"]

"""The SDK's errors: what user code raises and catches."""

from __future__ import annotations

from typing import Any


class RyusenError(Exception):
    """Base of the SDK's own errors; ``code`` is stable and machine-readable."""

    code = "ryusen_error"


class DefinitionError(RyusenError):
    """An app definition that cannot work (a function id registered twice, a bad argument)."""

    code = "invalid_definition"


class NoOperationError(RyusenError):
    """``ryusen.operation()`` was called outside a forward or compensation callback."""

    code = "no_operation"


class ConcurrentStepError(RyusenError):
    """A ``step.run`` was started while another ``step.run`` of the same run was still open.

    Steps run from the function's own thread (an async function may declare several
    together: ``asyncio.gather``). A step started from another thread (a thread pool's,
    say, even while the function only waits for it), or inside another step's callback,
    is refused, and the run gets a ``concurrent_step`` definition blocker naming both
    (unless the open step's callback already ran, whose outcome is reported first).

    >>> err = ConcurrentStepError("hotel", open_step_id="flight")
    >>> err.code, err.step_id, err.open_step_id
    ('concurrent_step', 'hotel', 'flight')

    ``from_another_thread``: refused because it came from a thread that is not the function's, with no other
    step open (``open_step_id`` is then empty).
    """

    code = "concurrent_step"

    def __init__(self, step_id: str, *, open_step_id: str, from_another_thread: bool = False) -> None:
        if from_another_thread:
            super().__init__(
                f"step {step_id!r} was started from a thread that is not the workflow function's own;"
                " steps run from the function's thread: call each step.run there (asyncio.gather or step.parallel"
                " runs several together)"
            )
        else:
            super().__init__(
                f"step {step_id!r} was started while step {open_step_id!r} is still open;"
                " a step cannot be opened inside another step's callback: open it in the workflow function"
            )
        self.step_id = step_id
        self.open_step_id = open_step_id


class StepFailed(Exception):  # noqa: N818 - public name fixed by the contract
    """Raised by ``step.run`` on replay of a step whose retries are exhausted.

    The recorded terminal failure of step ``step_id``: catch it to handle the
    failure (the run goes on and nothing is compensated), or let it escape to
    fail the run and start compensation.

    >>> try:
    ...     raise StepFailed("charge", "CardDeclined", "insufficient funds", {"code": 51})
    ... except StepFailed as failure:
    ...     (failure.step_id, failure.error_type)
    ('charge', 'CardDeclined')
    """

    def __init__(self, step_id: str, error_type: str, message: str, data: Any = None) -> None:
        super().__init__(f"step {step_id!r} failed: {error_type}: {message}")
        self.step_id = step_id
        self.error_type = error_type
        self.message = message
        self.data = data


class NonRetryableError(Exception):
    """Raise from a step callback to fail the step at once, skipping remaining retries.

    >>> def charge(card: str) -> dict:
    ...     raise NonRetryableError("card expired", data={"card": card})
    """

    def __init__(self, message: str, *, data: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.data = data


class CompletionError(RyusenError):
    """An app's completion of a step (``Ryusen.complete``) was not taken: ``code`` is the server's
    (``completion_refused``: the attempt no longer waits; ``completion_not_found``: no step waits for the token;
    ``late_result_refused``: the signature was refused), ``status`` its HTTP status (0: not delivered)."""

    def __init__(self, message: str, *, code: str, status: int) -> None:
        super().__init__(message)
        self.code = code
        self.status = status

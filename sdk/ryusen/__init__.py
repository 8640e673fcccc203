"""Ryusen: durable workflows for plain Python functions.

>>> from ryusen import Ryusen, Step
>>> app = Ryusen("shop")
>>> @app.function("checkout")
... def checkout(order: dict, step: Step) -> dict:
...     return step.run("reserve-stock", lambda: {"reserved": order["sku"]})
"""

from ._internal.app import Ryusen
from ._internal.client import ApiError, AsyncClient, Client, RunFailedError
from ._internal.errors import (
    CompletionError,
    ConcurrentStepError,
    DefinitionError,
    NonRetryableError,
    RyusenError,
    StepFailed,
)
from ._internal.heartbeat import StopRequested, heartbeat
from ._internal.step import AsyncStep, OmittedResult, Operation, RetryPolicy, Step, operation

__all__ = [
    "ApiError",
    "AsyncClient",
    "AsyncStep",
    "Client",
    "CompletionError",
    "ConcurrentStepError",
    "DefinitionError",
    "NonRetryableError",
    "OmittedResult",
    "Operation",
    "RetryPolicy",
    "RunFailedError",
    "Ryusen",
    "RyusenError",
    "Step",
    "StepFailed",
    "StopRequested",
    "heartbeat",
    "operation",
]
__version__ = "0.1.0"

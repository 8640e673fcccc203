"""The client for application code (decision 34): ``Client``, ``AsyncClient``, run handles and typed errors.

>>> from ryusen.client import Client, ConflictError
"""

from ._internal.client import (
    ApiError,
    AsyncClient,
    AsyncRunHandle,
    AuthorizationError,
    Client,
    ConflictError,
    ConnectionFailedError,
    InvalidRequestError,
    NotFoundError,
    Run,
    RunFailedError,
    RunHandle,
    RunPage,
    ServerUnavailableError,
    WaitTimeoutError,
)

__all__ = [
    "ApiError",
    "AsyncClient",
    "AsyncRunHandle",
    "AuthorizationError",
    "Client",
    "ConflictError",
    "ConnectionFailedError",
    "InvalidRequestError",
    "NotFoundError",
    "Run",
    "RunFailedError",
    "RunHandle",
    "RunPage",
    "ServerUnavailableError",
    "WaitTimeoutError",
]

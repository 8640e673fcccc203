"""The AWS fault layer for tests: what real AWS does that moto never does, injected per call.

moto answers every call at once and never throttles. Real DynamoDB throttles a hot partition, a new on-demand
table and a throttled index; SQS and Scheduler throttle too; any of them answers a 5xx now and then; a call
times out, and a write can commit while its answer is lost. A Lambda Function URL answers 429 before any
code runs when the function has no concurrency left.

:class:`AwsFaults` wraps every botocore client's API call (``BaseClient._make_api_call``, outside botocore's
own retries, so an injected fault is what a caller sees *after* those retries) and, for each call that
matches a rule, raises what botocore would raise then, with the real error codes and shapes:

* ``throttled``: ``ProvisionedThroughputExceededException`` (DynamoDB), ``ThrottlingException`` (others);
* ``transaction_throttled``: a ``TransactionCanceledException`` whose cancellation reasons name
  ``ThrottlingError`` (one reason per item, as DynamoDB gives them; botocore does not retry it);
* ``server_error``: ``InternalServerError`` (HTTP 500);
* ``timeout``: the connection timed out before the request was sent (``ConnectTimeoutError``);
* ``answer_lost``: the call goes through (a write commits) and then its answer is lost (``ReadTimeoutError``).

:class:`FrontEnd` is a Lambda Function URL's front end for a handler: ``throttle(n)`` answers the next ``n``
requests 429 (unsigned, nothing run), as Lambda does past the function's concurrency.

Clock skew and the environment freeze after a Lambda handler returns are endpoint faults: see
tests/functional/test_lambda_endpoint.py and tests/conformance/test_clock_skew.py.
"""

from __future__ import annotations

import contextvars
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import botocore.client
from botocore.exceptions import ClientError, ConnectTimeoutError, ReadTimeoutError

KINDS = ("throttled", "transaction_throttled", "server_error", "timeout", "answer_lost")

_THROTTLE_CODES = {"dynamodb": "ProvisionedThroughputExceededException"}
_THROTTLE_MESSAGES = {
    "dynamodb": "The level of configured provisioned throughput for the table was exceeded. Consider increasing"
    " your provisioning level with the UpdateTable API.",
}


@dataclass
class Rule:
    service: str
    operations: frozenset[str]
    kind: str
    times: int
    when: Callable[[dict[str, Any]], bool] | None = None
    caller: str | None = None
    hits: int = 0

    def matches(self, service: str, operation: str, params: dict[str, Any], caller: str | None) -> bool:
        if self.hits >= self.times or service != self.service:
            return False
        if self.operations and operation not in self.operations:
            return False
        if self.caller is not None and caller != self.caller:
            return False
        return self.when is None or self.when(params)


@dataclass
class Injected:
    service: str
    operation: str
    kind: str
    caller: str | None


@dataclass
class AwsFaults:
    """Rules of faults to inject, and a log of what was injected."""

    rules: list[Rule] = field(default_factory=list)
    injected: list[Injected] = field(default_factory=list)
    caller: contextvars.ContextVar[str] | None = None
    """Where a test names who is calling (the stack in a box: "dispatch", "api", ...), for ``caller=`` rules."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(
        self,
        service: str,
        *operations: str,
        kind: str = "throttled",
        times: int = 1,
        when: Callable[[dict[str, Any]], bool] | None = None,
        caller: str | None = None,
    ) -> Rule:
        """Fault the next ``times`` calls of ``service`` (any of ``operations``; none: every operation) whose
        parameters satisfy ``when`` (and, given ``caller``, made by that caller)."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault {kind!r}; one of {KINDS}")
        if kind == "transaction_throttled":
            operations = ("TransactWriteItems",)  # only a transaction is cancelled for its items' throttling
        rule = Rule(service, frozenset(operations), kind, times, when, caller)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def count(self, kind: str | None = None) -> int:
        return sum(1 for i in self.injected if kind is None or i.kind == kind)

    def _take(self, service: str, operation: str, params: dict[str, Any]) -> Rule | None:
        who = self.caller.get() if self.caller is not None else None
        with self._lock:
            for rule in self.rules:
                if rule.matches(service, operation, params, who):
                    rule.hits += 1
                    self.injected.append(Injected(service, operation, rule.kind, who))
                    return rule
        return None

    @contextmanager
    def installed(self) -> Iterator[AwsFaults]:
        """Inject into every botocore client's calls while the block runs."""
        original = botocore.client.BaseClient._make_api_call
        faults = self

        def make_api_call(client: Any, operation_name: str, api_params: dict[str, Any]) -> Any:
            service = client.meta.service_model.service_name
            rule = faults._take(service, operation_name, api_params)
            if rule is None:
                return original(client, operation_name, api_params)
            if rule.kind == "answer_lost":
                original(client, operation_name, api_params)
                raise ReadTimeoutError(endpoint_url=client.meta.endpoint_url)
            if rule.kind == "timeout":
                raise ConnectTimeoutError(endpoint_url=client.meta.endpoint_url)
            raise _client_error(service, operation_name, api_params, rule.kind)

        botocore.client.BaseClient._make_api_call = make_api_call  # type: ignore[method-assign]
        try:
            yield self
        finally:
            botocore.client.BaseClient._make_api_call = original  # type: ignore[method-assign]


def _client_error(service: str, operation: str, params: dict[str, Any], kind: str) -> ClientError:
    """What botocore raises when its retries are spent on this fault."""
    metadata = {"MaxAttemptsReached": True, "RetryAttempts": 4}
    if kind == "server_error":
        error = {"Code": "InternalServerError", "Message": "Internal server error"}
        return ClientError({"Error": error, "ResponseMetadata": {**metadata, "HTTPStatusCode": 500}}, operation)  # type: ignore[arg-type]
    if kind == "transaction_throttled":
        items = params.get("TransactItems", [None])
        reasons = [
            {
                "Code": "ThrottlingError",
                "Message": "Throughput exceeds the current capacity of your table or"
                " index. DynamoDB is automatically scaling your table or index so please try again shortly.",
            }
        ]
        reasons += [{"Code": "None"}] * (len(items) - 1)
        response = {
            "Error": {
                "Code": "TransactionCanceledException",
                "Message": "Transaction cancelled, please refer cancellation reasons for specific reasons"
                f" [{', '.join(r['Code'] for r in reasons)}]",
            },
            "CancellationReasons": reasons,
            "ResponseMetadata": {"HTTPStatusCode": 400, "RetryAttempts": 0},
        }
        return ClientError(response, operation)  # type: ignore[arg-type]
    code = _THROTTLE_CODES.get(service, "ThrottlingException")
    message = _THROTTLE_MESSAGES.get(service, "Rate exceeded")
    return ClientError(
        {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {**metadata, "HTTPStatusCode": 400}},
        operation,
    )  # type: ignore[arg-type]


def mentions(text: str) -> Callable[[dict[str, Any]], bool]:
    """A ``when`` for calls whose parameters mention ``text`` (a run id, a key)."""
    return lambda params: text in json.dumps(params, default=str)


class FrontEnd:
    """A Lambda Function URL's front end before ``handler``: it may throttle a request (429, unsigned, with
    Lambda's error type header) before any code runs."""

    BODY = b'{"Message":"Rate Exceeded."}'
    HEADERS = {"content-type": "application/json", "x-amzn-ErrorType": "TooManyRequestsException"}

    def __init__(self, handler: Callable[[dict[str, Any], Any], dict[str, Any]]) -> None:
        self.handler = handler
        self.throttles_left = 0
        self.throttled = 0
        self.ran = 0
        self._lock = threading.Lock()

    def throttle(self, times: int) -> None:
        with self._lock:
            self.throttles_left = times

    def __call__(self, event: dict[str, Any], context: Any) -> dict[str, Any]:
        with self._lock:
            throttle = self.throttles_left > 0
            if throttle:
                self.throttles_left -= 1
                self.throttled += 1
            else:
                self.ran += 1
        if throttle:
            return {"statusCode": 429, "headers": dict(self.HEADERS), "body": self.BODY.decode()}
        return self.handler(event, context)

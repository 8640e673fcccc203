"""Attempts sent to a Lambda endpoint as asynchronous events (``InvocationType=Event``: way C of
docs/design/dispatch.md).

Lambda answers 202 once it has queued the event, and the engine waits for nothing more: the endpoint's
``lambda_handler`` runs the attempt and posts the outcome to the result function. What each failure means for
the attempt, which the engine must tell apart (decisions 6.4):

- a 4xx Lambda answers (a throttle, too many requests, a function not ready) means the event was not queued:
  ``unreachable``, and the task is sent again later;
- no permission, no such function, an event too large or refused as malformed will not change by trying again:
  ``refused``, and the engine sends the request to the release's URL instead, and waits for it;
- a 5xx, or a connection lost after the request went, may have queued it: ``lost``, so the attempt is not known.
  A copy queued twice (botocore retries, or Lambda's own) is refused by the endpoint's shared replay memory.
"""

from __future__ import annotations

import logging
from typing import Any

from botocore.exceptions import (
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
)

from ..ports import InvokeResult, RequestCounter

log = logging.getLogger("ryusen.lambda_events")

REFUSED_CODES = frozenset(
    {
        "AccessDeniedException",
        "ResourceNotFoundException",
        "RequestTooLargeException",
        "InvalidRequestContentException",
        "InvalidParameterValueException",
        "UnrecognizedClientException",
        "KMSAccessDeniedException",
        "KMSDisabledException",
        "KMSInvalidStateException",
        "KMSNotFoundException",
    }
)
"""Lambda's refusals that trying again will not change: the engine uses the release's URL instead."""


class LambdaEventInvoker:
    """:class:`~ryusen_server.ports.EventInvoker` on Lambda's ``Invoke`` API."""

    def __init__(self, client: Any, counter: RequestCounter | None = None) -> None:
        self._client = client
        self.counter = counter or RequestCounter()

    def invoke_event(self, function_arn: str, payload: bytes) -> InvokeResult:
        self.counter.add("lambda.invoke_event", len(payload))
        try:
            response = self._client.invoke(FunctionName=function_arn, InvocationType="Event", Payload=payload)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if code in REFUSED_CODES:
                return InvokeResult(kind="refused", status=status, detail=f"Lambda refused the event ({code})")
            if 400 <= status < 500:
                return InvokeResult(kind="unreachable", status=status, detail=f"Lambda did not queue it ({code})")
            return InvokeResult(kind="lost", status=status, detail=f"Lambda answered {status} ({code})")
        except (EndpointConnectionError, ConnectTimeoutError) as exc:
            return InvokeResult(kind="unreachable", detail=f"Lambda's API could not be reached ({type(exc).__name__})")
        except Exception as exc:  # noqa: BLE001 - sent, and whether it was queued is not known
            return InvokeResult(kind="lost", detail=f"the event was sent, then {type(exc).__name__}")
        status = int(response.get("StatusCode") or 0)
        if status == 202:
            return InvokeResult(kind="queued", status=202)
        return InvokeResult(kind="lost", status=status, detail=f"Lambda answered {status} to an event")

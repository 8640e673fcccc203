"""Run Ryusen's Lambda handlers the way AWS calls them, on loopback: for tests without an AWS account.

``ApiGateway`` serves a handler over HTTP and turns each request into the REST (v1) proxy event
API Gateway would send. ``LambdaContext`` has a settable deadline, as a real invocation has.
``sqs_batch`` builds the event an SQS event source gives the dispatch handler.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

EVENTS = Path(__file__).resolve().parents[1] / "events"

Handler = Callable[[dict[str, Any], Any], dict[str, Any]]


class LambdaContext:
    """What a handler reads of its Lambda context; ``remaining_s`` counts down from creation."""

    function_name = "ryusen-test"
    memory_limit_in_mb = 512
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:ryusen-test"

    def __init__(self, remaining_s: float = 900.0) -> None:
        self.aws_request_id = uuid.uuid4().hex
        self._deadline = time.monotonic() + remaining_s

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))


def sample_event(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((EVENTS / name).read_text())
    return loaded


def rest_event(method: str, path: str, body: str | None, headers: dict[str, str], query: str = "") -> dict[str, Any]:
    """The REST API proxy event for one request (the shape of events/api_start_run.json)."""
    params = {k: v[-1] for k, v in parse_qs(query).items()} or None
    return {
        "resource": "/{proxy+}",
        "path": path,
        "httpMethod": method,
        "headers": headers,
        "multiValueHeaders": {k: [v] for k, v in headers.items()},
        "queryStringParameters": params,
        "multiValueQueryStringParameters": parse_qs(query) or None,
        "pathParameters": {"proxy": path.lstrip("/")},
        "stageVariables": None,
        "requestContext": {
            "accountId": "123456789012",
            "apiId": "box",
            "resourcePath": "/{proxy+}",
            "httpMethod": method,
            "path": f"/prod{path}",
            "stage": "prod",
            "requestId": uuid.uuid4().hex,
            "requestTimeEpoch": int(time.time() * 1000),
            "identity": {"sourceIp": "127.0.0.1"},
        },
        "body": body,
        "isBase64Encoded": False,
    }


class ApiGateway:
    """A REST API stage on loopback: each HTTP request becomes a proxy event for ``handler``.

    ``authorize(method, path, headers)`` may refuse a request with a status before the handler sees
    it, as IAM authorization on a route does (403 without a SigV4 signature).
    """

    def __init__(self, handler: Handler, authorize: Callable[[str, str, dict[str, str]], int | None] | None = None):
        self.handler = handler
        self.authorize = authorize
        self.server = make_server("127.0.0.1", 0, self._wsgi, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _wsgi(self, environ: dict[str, Any], start_response: Any) -> Any:
        request = Request(environ)
        headers = dict(request.headers.items())
        if self.authorize is not None and (status := self.authorize(request.method, request.path, headers)):
            body = json.dumps({"message": "Missing Authentication Token"})
            return Response(body, status=status, content_type="application/json")(environ, start_response)
        raw = request.get_data(as_text=True) or None
        event = rest_event(request.method, request.path, raw, headers, request.query_string.decode())
        result = self.handler(event, LambdaContext(29.0))
        response = Response(result.get("body") or "", status=int(result["statusCode"]))
        for name, value in (result.get("headers") or {}).items():
            response.headers[name] = value
        return response(environ, start_response)

    def close(self) -> None:
        self.server.shutdown()


def sqs_batch(messages: Sequence[dict[str, Any]], *, source_arn: str | None = None) -> dict[str, Any]:
    """The event an SQS event source sends for received ``messages`` (boto3 receive_message entries), from the
    queue ``source_arn`` (by default, the sample's)."""
    batch = sample_event("sqs_dispatch_batch.json")
    template = batch["Records"][0]
    if source_arn is not None:
        template = {**template, "eventSourceARN": source_arn}
    batch["Records"] = [
        {
            **template,
            "messageId": m["MessageId"],
            "receiptHandle": m["ReceiptHandle"],
            "body": m["Body"],
            # the event source passes the message's group (a fair queue's tenant) among its attributes
            "attributes": {**template["attributes"], **_group(m)},
            "messageAttributes": _message_attributes(m),
        }
        for m in messages
    ]
    return batch


def _message_attributes(message: dict[str, Any]) -> dict[str, Any]:
    """A received message's attributes in the event source's form (receive asked for them: ``["All"]``)."""
    return {
        name: {
            "stringValue": value.get("StringValue"),
            "stringListValues": [],
            "binaryListValues": [],
            "dataType": value["DataType"],
        }
        for name, value in message.get("MessageAttributes", {}).items()
    }


def _group(message: dict[str, Any]) -> dict[str, str]:
    group = message.get("Attributes", {}).get("MessageGroupId")
    return {"MessageGroupId": group} if group is not None else {}

"""The serve adapters (ASGI, WSGI, Lambda) only translate: the same signed task gives the same answer."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from typing import Any

import pytest

from ryusen import Ryusen, Step
from ryusen._internal.signing import SIGNATURE_HEADER, request_binding, sign, verify
from ryusen._internal.wire import TaskKind, TaskRequest

KEY = "adapter-key"


@pytest.fixture
def app() -> Ryusen:
    app = Ryusen("adapters", signing_key=KEY)

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        return step.run("s", lambda: data["x"] * 2)

    return app


def task() -> bytes:
    request = TaskRequest(kind=TaskKind.DISCOVER, run_id="r", function_id="wf", input={"x": 2})
    return request.model_dump_json().encode()


def check(status: int, headers: dict[str, str], body: bytes, request_signature: str) -> None:
    """A 200 whose body is signed for the request it answers (``bound_responses``; each adapter passes the
    request's ``X-Ryusen-Answer-Binding`` on)."""
    assert status == 200
    lowered = {k.lower(): v for k, v in headers.items()}
    binding = request_binding(request_signature, task())
    verify(KEY, body, lowered[SIGNATURE_HEADER.lower()], now=time.time(), answers=binding, bound=True)
    assert json.loads(body)["discovery"]["step"]["id"] == "s"


def test_asgi(app: Ryusen) -> None:
    body = task()
    sent: list[dict[str, Any]] = []
    chunks = [
        {"type": "http.request", "body": body[:10], "more_body": True},
        {"type": "http.request", "body": body[10:]},
    ]

    async def receive() -> dict[str, Any]:
        return chunks.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    header = sign(KEY, body, now=time.time())
    scope = {
        "type": "http",
        "method": "POST",
        "headers": [(SIGNATURE_HEADER.lower().encode(), header.encode()), (b"x-ryusen-answer-binding", b"1")],
    }
    asyncio.run(app.asgi()(scope, receive, send))
    start, payload = sent
    check(start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, payload["body"], header)


def test_asgi_get_returns_the_manifest(app: Ryusen) -> None:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app.asgi()({"type": "http", "method": "GET", "headers": []}, receive, send))
    assert json.loads(sent[1]["body"])["functions"] == [{"id": "wf", "timeout_s": None}]


def test_wsgi(app: Ryusen) -> None:
    body = task()
    captured: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        captured["status"], captured["headers"] = int(status.split()[0]), dict(headers)

    header = sign(KEY, body, now=time.time())
    environ = {
        "REQUEST_METHOD": "POST",
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.input": io.BytesIO(body),
        "HTTP_X_RYUSEN_SIGNATURE": header,
        "HTTP_X_RYUSEN_ANSWER_BINDING": "1",
    }
    out = b"".join(app.wsgi()(environ, start_response))
    check(captured["status"], captured["headers"], out, header)


@pytest.mark.parametrize("encoded", [False, True])
def test_lambda_function_url_event(app: Ryusen, encoded: bool) -> None:
    body = task()
    header = sign(KEY, body, now=time.time())
    event = {
        "version": "2.0",
        "requestContext": {"http": {"method": "POST"}},
        "headers": {SIGNATURE_HEADER.lower(): header, "x-ryusen-answer-binding": "1"},
        "body": base64.b64encode(body).decode() if encoded else body.decode(),
        "isBase64Encoded": encoded,
    }
    response = app.lambda_handler(event)
    check(response["statusCode"], response["headers"], response["body"].encode(), header)


def test_lambda_unsigned_is_refused(app: Ryusen) -> None:
    response = app.lambda_handler({"httpMethod": "POST", "headers": {}, "body": task().decode()})
    assert response["statusCode"] == 401

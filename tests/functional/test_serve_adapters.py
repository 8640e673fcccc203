"""The serve adapters (ASGI, WSGI, Lambda) only translate: the same signed task gives the same answer, and each
passes on the path the client sent, mounted or behind a stage, which the signature names."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import secrets
import threading
import time
from typing import Any

import pytest

import ryusen
from ryusen import AsyncStep, Ryusen, Step
from ryusen._internal.signing import SIGNATURE_HEADER, answer_binding, parse, sign, verify
from ryusen._internal.wire import OperationInfo, Phase, TaskKind, TaskRequest, task_scope

KEY = "adapter-key"
PATH = "/ryusen/tasks"


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


def signed(path: str = PATH) -> str:
    """The signature header the engine sends ``task()`` to ``path`` with."""
    scope = task_scope(TaskRequest.model_validate_json(task()), path=path, app_id="adapters")
    return sign(KEY, scope, task(), now=time.time(), nonce=secrets.token_hex(16))


def check(status: int, headers: dict[str, str], body: bytes, request_signature: str) -> None:
    """A 200 whose body is signed as the answer to the request it answers."""
    assert status == 200, body
    lowered = {k.lower(): v for k, v in headers.items()}
    request = parse(request_signature)
    scope = task_scope(TaskRequest.model_validate_json(task()), path=PATH, app_id="adapters").answer()
    answers = answer_binding(request_signature, task())
    verify([KEY], scope, body, lowered[SIGNATURE_HEADER.lower()], now=time.time(), answers=answers, nonce=request.nonce)
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

    header = signed()
    scope = {  # mounted under /ryusen: the client sent /ryusen/tasks
        "type": "http",
        "method": "POST",
        "root_path": "/ryusen",
        "path": "/tasks",
        "raw_path": PATH.encode(),
        "headers": [(SIGNATURE_HEADER.lower().encode(), header.encode())],
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

    header = signed()
    environ = {  # mounted under /ryusen (a WSGI server that gives no raw request URI)
        "REQUEST_METHOD": "POST",
        "SCRIPT_NAME": "/ryusen",
        "PATH_INFO": "/tasks",
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.input": io.BytesIO(body),
        "HTTP_X_RYUSEN_SIGNATURE": header,
    }
    out = b"".join(app.wsgi()(environ, start_response))
    check(captured["status"], captured["headers"], out, header)


@pytest.mark.parametrize("encoded", [False, True])
def test_lambda_function_url_event(app: Ryusen, encoded: bool) -> None:
    body = task()
    header = signed()
    event = {
        "version": "2.0",
        "rawPath": PATH,
        "requestContext": {"http": {"method": "POST"}},
        "headers": {SIGNATURE_HEADER.lower(): header},
        "body": base64.b64encode(body).decode() if encoded else body.decode(),
        "isBase64Encoded": encoded,
    }
    response = app.lambda_handler(event)
    check(response["statusCode"], response["headers"], response["body"].encode(), header)


def test_lambda_unsigned_is_refused(app: Ryusen) -> None:
    response = app.lambda_handler({"httpMethod": "POST", "headers": {}, "body": task().decode()})
    assert response["statusCode"] == 401


def test_lambda_rest_api_event_names_the_stage_in_its_path(app: Ryusen) -> None:
    """A REST API event's ``path`` lacks the stage the client sent; ``requestContext.path`` has it."""
    header = signed("/prod" + PATH)
    event = {
        "httpMethod": "POST",
        "path": PATH,
        "requestContext": {"path": "/prod" + PATH, "stage": "prod"},
        "headers": {SIGNATURE_HEADER: header},
        "body": task().decode(),
    }
    assert app.lambda_handler(event)["statusCode"] == 200


@pytest.mark.parametrize("adapter", ["asgi", "wsgi", "lambda"])
def test_a_request_signed_for_another_path_is_refused_by_every_adapter(app: Ryusen, adapter: str) -> None:
    header = signed("/elsewhere")
    body = task()
    if adapter == "lambda":
        event = {"rawPath": PATH, "requestContext": {"http": {"method": "POST"}}, "headers": {SIGNATURE_HEADER: header}}
        assert app.lambda_handler({**event, "body": body.decode()})["statusCode"] == 401
    elif adapter == "wsgi":
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": PATH,
            "CONTENT_LENGTH": str(len(body)),
            "wsgi.input": io.BytesIO(body),
            "HTTP_X_RYUSEN_SIGNATURE": header,
        }
        statuses: list[str] = []
        app.wsgi()(environ, lambda status, headers: statuses.append(status))
        assert statuses[0].startswith("401")
    else:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": PATH, "headers": [(b"x-ryusen-signature", header.encode())]}
        asyncio.run(app.asgi()(scope, receive, send))
        assert sent[0]["status"] == 401


# ---- an async workflow's plain callbacks do not hold the event loop ------------------------------------


def forward_task(run_id: str, step_id: str) -> tuple[bytes, str]:
    """A signed forward attempt of ``step_id`` in run ``run_id`` of the ``report`` function."""
    request = TaskRequest(
        kind=TaskKind.FORWARD,
        run_id=run_id,
        function_id="report",
        input={"step": step_id},
        step_id=step_id,
        operation=OperationInfo(id=f"op-{run_id}", phase=Phase.FORWARD, generation=1),
    )
    body = request.model_dump_json().encode()
    scope = task_scope(request, path=PATH, app_id="reports")
    return body, sign(KEY, scope, body, now=time.time(), nonce=secrets.token_hex(16))


async def post(asgi: Any, body: bytes, header: str) -> dict[str, Any]:
    """One POST through the ASGI app; the answer's JSON (its status checked)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": PATH, "headers": [(b"x-ryusen-signature", header.encode())]}
    await asgi(scope, receive, send)
    assert sent[0]["status"] == 200, sent
    answer: dict[str, Any] = json.loads(sent[1]["body"])
    return answer


def test_a_plain_callback_of_an_async_workflow_leaves_the_event_loop_to_other_runs() -> None:
    """Run A's step is a plain (blocking) function; while it runs, run B's request on the same ASGI app must be
    answered (issue 23: B's quick step waited 4.5 s behind A's). A's callback waits for B's answer, with a
    generous limit: on a blocked loop that answer cannot come, and A reports that it did not."""
    app = Ryusen("reports", signing_key=KEY)
    export_started = threading.Event()
    ping_answered = threading.Event()
    seen: dict[str, Any] = {}

    def export() -> str:
        seen["operation"] = ryusen.operation().id  # the attempt's operation, on the worker thread too
        export_started.set()
        seen["ping answered meanwhile"] = ping_answered.wait(10)
        return "exported"

    async def ping() -> str:
        return "pong"

    @app.function("report")
    async def report(data: Any, step: AsyncStep) -> Any:
        if data["step"] == "export":
            return await step.run("export", export)
        return await step.run("ping", lambda: ping())  # a plain callable that returns an awaitable

    async def two_runs() -> tuple[dict[str, Any], dict[str, Any]]:
        asgi = app.asgi()
        slow = asyncio.create_task(post(asgi, *forward_task("run-a", "export")))
        assert await asyncio.to_thread(export_started.wait, 10), "run A's callback never started"
        quick = await post(asgi, *forward_task("run-b", "ping"))
        ping_answered.set()
        return await slow, quick

    slow, quick = asyncio.run(two_runs())
    assert quick["attempt"] == {"type": "succeeded", "result": "pong"}
    assert slow["attempt"] == {"type": "succeeded", "result": "exported"}
    assert seen == {"operation": "op-run-a", "ping answered meanwhile": True}

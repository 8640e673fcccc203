"""The SDK's late-result path: an answer that comes after the dispatcher stopped listening (decisions 6.15).

It must reach the server even when the result endpoint fails for a while (a 5xx, a refused
connection), and it must stop, and say so, when the server refuses it for good (a 4xx).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

from ryusen import Ryusen, Step
from ryusen._internal import app as app_module
from ryusen._internal.signing import SIGNATURE_HEADER, sign, verify
from ryusen._internal.wire import LateResult, OperationInfo, Phase, TaskKind, TaskRequest, late_result_scope, task_scope

KEY = "late-key"


class ResultEndpoint:
    """A result endpoint that answers each POST with the next status in ``statuses`` (then 200)."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses
        self.received: list[dict[str, Any]] = []
        self.server = make_server("127.0.0.1", 0, self.wsgi, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/results"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wsgi(self, environ: dict[str, Any], start_response: Any) -> Any:
        request = Request(environ)
        body = request.get_data()
        scope = late_result_scope(LateResult.model_validate_json(body), path=request.path, app_id="late")
        verify([KEY], scope, body, request.headers.get(SIGNATURE_HEADER), now=time.time())  # the app's, for this
        status = self.statuses.pop(0) if self.statuses else 200
        self.received.append({"status": status, "body": json.loads(body)})
        return Response(json.dumps({"ok": status == 200}), status=status)(environ, start_response)


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(app_module, "LATE_RESULT_DELAYS_S", (0.05, 0.05, 0.05, 0.05))


@pytest.fixture
def app() -> Ryusen:
    app = Ryusen("late", signing_key=KEY)

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        return step.run("slow", lambda: {"done": True})

    return app


def forward_task(result_url: str, respond_in_s: float = -1.0) -> tuple[bytes, dict[str, str]]:
    request = TaskRequest(
        kind=TaskKind.FORWARD,
        run_id="run_1",
        function_id="wf",
        step_id="slow",
        operation=OperationInfo(id="op_1", phase=Phase.FORWARD, generation=1),
        result_url=result_url,
        respond_by=time.time() + respond_in_s,  # by default the dispatcher has stopped listening: submit late
    )
    body = request.model_dump_json().encode()
    scope = task_scope(request, path="/", app_id="late")
    return body, {SIGNATURE_HEADER: sign(KEY, scope, body, now=time.time(), nonce=secrets.token_hex(16))}


@pytest.fixture
def endpoint() -> Iterator[ResultEndpoint]:
    server = ResultEndpoint([])
    yield server
    server.server.shutdown()


def test_a_late_result_is_retried_through_server_errors(app: Ryusen, endpoint: ResultEndpoint) -> None:
    endpoint.statuses = [503, 502]
    app.handle("POST", *reversed(forward_task(endpoint.url)))
    assert [r["status"] for r in endpoint.received] == [503, 502, 200]
    assert endpoint.received[-1]["body"]["attempt"] == {"type": "succeeded", "result": {"done": True}}


def test_an_outcome_that_finishes_just_before_the_server_stops_listening_is_also_submitted(
    app: Ryusen, endpoint: ResultEndpoint
) -> None:
    """The dispatcher listens only a short grace past ``respond_by`` (issue 23: a tenth of the timeout, from
    0.5 s): an answer finished just before it may arrive after, so it also goes to the result endpoint (a second
    copy is a stale submission, and changes nothing)."""
    response = app.handle("POST", *reversed(forward_task(endpoint.url, respond_in_s=0.3)))
    assert response.status == 200
    assert [r["body"]["attempt"] for r in endpoint.received] == [{"type": "succeeded", "result": {"done": True}}]
    endpoint.received.clear()
    app.handle("POST", *reversed(forward_task(endpoint.url, respond_in_s=30.0)))  # well within the window
    assert endpoint.received == []


def test_a_refused_late_result_is_not_retried_and_is_logged(
    app: Ryusen, endpoint: ResultEndpoint, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint.statuses = [409]
    with caplog.at_level(logging.WARNING, logger="ryusen"):
        app.handle("POST", *reversed(forward_task(endpoint.url)))
    assert [r["status"] for r in endpoint.received] == [409]
    assert "run_1" in caplog.text and "slow" in caplog.text and "409" in caplog.text


def test_a_result_endpoint_that_stays_down_is_given_up_on_loudly(app: Ryusen, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="ryusen"):
        app.handle("POST", *reversed(forward_task("http://127.0.0.1:9/v1/results")))  # nothing listens
    assert "could not deliver the late result" in caplog.text and "run_1" in caplog.text


# ---- issue 25: an acknowledged attempt's outcome is posted before the process stops (drain) ------------------------


def test_a_stopping_server_drains_its_acknowledged_attempts_before_it_goes(endpoint: ResultEndpoint) -> None:
    """An attempt answered "accepted" runs on after the answer: ``drain`` (called on shutdown: the ASGI lifespan,
    ``ryusen dev``'s reload) waits until it has ended and its outcome is posted, so a deploy does not leave it
    Unknown; with too little time it says how many are still running."""
    app = Ryusen("late", signing_key=KEY)

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        return step.run("slow", lambda: time.sleep(0.6) or {"done": True})

    def acknowledged_task(run_id: str) -> tuple[dict[str, str], bytes]:
        request = TaskRequest(
            kind=TaskKind.FORWARD,
            run_id=run_id,
            function_id="wf",
            step_id="slow",
            operation=OperationInfo(id=f"op_{run_id}", phase=Phase.FORWARD, generation=1),
            result_url=endpoint.url,
            respond_by=time.time() + 30,
            acknowledge_after_s=0.05,
        )
        body = request.model_dump_json().encode()
        scope = task_scope(request, path="/", app_id="late")
        return {SIGNATURE_HEADER: sign(KEY, scope, body, now=time.time(), nonce=secrets.token_hex(16))}, body

    assert app.handle("POST", *acknowledged_task("run_1")).status == 202
    assert app.drain(0.01) == 1  # still running
    assert app.drain(10) == 0 and [r["body"]["run_id"] for r in endpoint.received] == ["run_1"]
    assert endpoint.received[0]["body"]["attempt"] == {"type": "succeeded", "result": {"done": True}}
    assert app.drain(0) == 0  # nothing left: returns at once

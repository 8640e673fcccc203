"""An endpoint whose clock disagrees with the engine's still submits a late result when, and only when, it is late.

``respond_by`` is a time on the engine's clock. An endpoint that read it on its own clock was wrong by its
skew: 5 s behind, it believed it still had time after the dispatcher had stopped listening, sent no late
result, and the step went Unknown; ahead, it sent late results for answers that arrived in time. The engine
now also sends how long the endpoint has (``respond_within_s``), and the SDK counts it on its own monotonic
clock from when the request arrived.

Each test runs the engine on wall time and the app over real HTTP, with a result endpoint in front of the
engine that counts the late results it receives.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

from ryusen import RetryPolicy, Ryusen, Step
from ryusen._internal.serve import wsgi_app
from ryusen._internal.wire import TaskRequest
from ryusen_server.core.events import EngineSettings
from ryusen_server.core.view import run_view
from ryusen_server.engine import Engine, ServerSettings
from ryusen_server.invoker import HttpInvoker
from ryusen_server.memory import MemoryQueue, MemoryStore, MemoryTimers
from ryusen_server.runtime import fire_due, handle_message
from ryusen_server.urls import EndpointPolicy
from ryusen_server.wiring import fetch_manifest

MASTER = "clock-skew-tests-master-key"

SKEWS = pytest.mark.parametrize("skew_s", [-60.0, -5.0, 5.0, 60.0], ids=lambda s: f"endpoint {s:+g}s")


class SkewedDeployment:
    """The engine on wall time; the app over HTTP with its clock ``skew_s`` off; a result endpoint."""

    def __init__(self, app: Ryusen, skew_s: float, *, without: frozenset[str] = frozenset()) -> None:
        app.clock = lambda: time.time() + skew_s
        self.late: list[bytes] = []
        self.requests: list[TaskRequest] = []
        self.fields: list[set[str]] = []
        self.refused: list[str] = []
        serve = wsgi_app(app)

        def endpoint(environ: dict[str, Any], start_response: Any) -> Any:
            if environ["REQUEST_METHOD"] == "POST":
                body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
                self.requests.append(TaskRequest.model_validate_json(body))
                self.fields.append(set(json.loads(body)))
                import io

                environ["wsgi.input"] = io.BytesIO(body)
            return serve(environ, start_response)

        self.app_server = make_server("127.0.0.1", 0, endpoint, threaded=True)
        self.result_server = make_server("127.0.0.1", 0, self._results, threaded=True)
        for server in (self.app_server, self.result_server):
            threading.Thread(target=server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.app_server.server_port}/"

        def clock() -> datetime:
            return datetime.now(UTC)

        self.store, self.queue, self.timers = MemoryStore(), MemoryQueue(clock), MemoryTimers(clock)
        self.engine = Engine(
            store=self.store,
            queue=self.queue,
            timers=self.timers,
            invoker=HttpInvoker(),
            settings=ServerSettings(
                engine=EngineSettings(lease_grace_s=3.0),  # an attempt nobody answers is Unknown 3 s past its lease
                master_key=MASTER,
                result_url=f"http://127.0.0.1:{self.result_server.server_port}/v1/results",
            ),
            clock=clock,
        )
        manifest, features = fetch_manifest(
            self.url, app_id=app.app_id, policy=EndpointPolicy.local(), keys=self.engine.app_keys
        )
        self.engine.sync_release(app.app_id, self.url, manifest, features - without)  # a release of an older SDK

    def _results(self, environ: dict[str, Any], start_response: Any) -> Any:
        request = Request(environ)
        body = request.get_data()
        self.late.append(body)
        try:
            self.engine.submit_late_result(body, dict(request.headers))
        except Exception as exc:  # noqa: BLE001 - the test reads what the engine refused
            self.refused.append(repr(exc))
            return Response("refused", status=409)(environ, start_response)
        return Response("{}", status=200)(environ, start_response)

    def run(self, function_id: str, seconds: float = 8.0) -> dict[str, Any]:
        """Start a run and drive it until it finishes (an Unknown blocks it: a late result may still settle it)."""
        state, _ = self.engine.start_run(function_id, {})
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            fire_due(self.engine, self.timers.due)
            for message in self.queue.receive(1):
                handle_message(self.engine, self.queue, message, message.message_id)
            view = run_view(self.store.peek(state.id))
            if view["phase"] == "finished":
                return view
            time.sleep(0.02)
        return run_view(self.store.peek(state.id))

    def close(self) -> None:
        self.app_server.shutdown()
        self.result_server.shutdown()


def charging_app(callback_s: float, timeout_s: float) -> Ryusen:
    app = Ryusen("skewed", master_key=MASTER)

    @app.function("pay")
    def pay(data: Any, step: Step) -> Any:
        def charge() -> str:
            time.sleep(callback_s)
            return "charged"

        once = RetryPolicy(max_attempts=1)
        return step.run("charge", charge, timeout=timedelta(seconds=timeout_s), retry=once)

    return app


@pytest.fixture
def deployments() -> Iterator[list[SkewedDeployment]]:
    made: list[SkewedDeployment] = []
    yield made
    for deployment in made:
        deployment.close()


@SKEWS
def test_a_late_answer_is_submitted_as_a_late_result_whatever_the_endpoint_s_clock_says(
    skew_s: float, deployments: list[SkewedDeployment]
) -> None:
    """The callback takes 2 s of a 1 s timeout: the dispatcher stops listening at 1.5 s, so the answer is late,
    and the SDK submits it to the result endpoint. The step completes with the attempt that ran; nothing is
    Unknown and nothing runs twice."""
    deployment = SkewedDeployment(charging_app(callback_s=2.0, timeout_s=1.0), skew_s)
    deployments.append(deployment)
    view = deployment.run("pay")
    assert deployment.refused == []
    assert len(deployment.late) == 1, f"{len(deployment.late)} late results"
    assert view["outcome"] == "completed" and view["output"] == "charged", view
    assert [a["status"] for a in view["steps"][0]["attempts"]] == ["succeeded"]


@SKEWS
def test_an_answer_in_time_is_not_submitted_late_whatever_the_endpoint_s_clock_says(
    skew_s: float, deployments: list[SkewedDeployment]
) -> None:
    """The callback answers at once, well within its 30 s: no late result is sent (an endpoint ahead of the
    engine used to send one for every answer, and to skip the continuation after it)."""
    deployment = SkewedDeployment(charging_app(callback_s=0.0, timeout_s=30.0), skew_s)
    deployments.append(deployment)
    view = deployment.run("pay")
    assert view["outcome"] == "completed" and view["output"] == "charged", view
    assert deployment.late == []
    forward = [r for r in deployment.requests if r.step_id == "charge"]
    assert forward and forward[0].continue_after
    assert [r.kind.value for r in deployment.requests].count("discover") == 1  # the continuation ran in the answer


def test_a_release_whose_sdk_did_not_announce_respond_within_gets_respond_by_alone(
    deployments: list[SkewedDeployment],
) -> None:
    """An older SDK refuses a field it does not know (400): the engine sends ``respond_within_s`` only to a release
    that announced ``respond_within``, and the SDK reads ``respond_by`` on its own clock, as before."""
    deployment = SkewedDeployment(
        charging_app(callback_s=0.0, timeout_s=30.0), 0.0, without=frozenset({"respond_within"})
    )
    deployments.append(deployment)
    view = deployment.run("pay")
    assert view["outcome"] == "completed" and view["output"] == "charged", view
    forward = [f for f, r in zip(deployment.fields, deployment.requests, strict=True) if r.step_id == "charge"]
    assert forward and all("respond_by" in f and "respond_within_s" not in f for f in forward)
    announced = SkewedDeployment(charging_app(callback_s=0.0, timeout_s=30.0), 0.0)
    deployments.append(announced)
    announced.run("pay")
    [sent] = [r for r in announced.requests if r.step_id == "charge"]
    assert sent.respond_within_s is not None and 29.0 < sent.respond_within_s <= 30.0


@pytest.mark.parametrize("budget", [-1, "NaN", 1e400, "soon"])
def test_a_budget_that_is_not_a_span_of_time_is_refused_before_anything_runs(budget: Any) -> None:
    ran: list[str] = []
    app = Ryusen("budget", insecure=True)
    app.function("pay")(lambda data, step: step.run("charge", lambda: ran.append("charge")))
    request = {
        "kind": "forward",
        "run_id": "r",
        "function_id": "pay",
        "step_id": "charge",
        "operation": {"id": "op", "phase": "forward", "generation": 1},
        "respond_within_s": budget,
    }
    body = json.dumps(request).replace("Infinity", "1e400").encode()
    response = app.handle("POST", {}, body)
    assert response.status == 400 and json.loads(response.body)["error"]["code"] == "invalid_task_request"
    assert ran == []

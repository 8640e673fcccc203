"""O2 (signing) and O3 (bad input), through the SDK handler, the engine and the API resolver."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ryusen import Ryusen, Step
from ryusen._internal.signing import SIGNATURE_HEADER, answer_binding, app_key, sign, verify
from ryusen._internal.wire import LateResult, TaskKind, TaskRequest, late_result_scope, task_scope
from ryusen.testing import WorkflowEnvironment
from ryusen_server.api import build_api
from ryusen_server.engine import SignatureRejectedError

MASTER = "k" * 32
KEY = app_key(MASTER, "secure")
EVENTS = Path(__file__).resolve().parents[2] / "events"


def signed_app(ran: list[str]) -> Ryusen:
    app = Ryusen("secure", signing_key=KEY)

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        ran.append("function body")
        return step.run("s", lambda: ran.append("callback") or "ok")

    return app


def discover_body() -> bytes:
    return TaskRequest(kind=TaskKind.DISCOVER, run_id="r1", function_id="wf", input=None).model_dump_json().encode()


def signed(key: str, body: bytes, *, now: float) -> str:
    """The header the engine sends ``body`` to app ``secure``'s endpoint at ``/`` with."""
    scope = task_scope(TaskRequest.model_validate_json(body), path="/", app_id="secure")
    return sign(key, scope, body, now=now, nonce=secrets.token_hex(16))


@pytest.mark.rfd("O2")
@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({}, id="unsigned"),
        pytest.param({SIGNATURE_HEADER: "t=1,v1=deadbeef"}, id="garbage"),
        pytest.param({SIGNATURE_HEADER: signed("other-key", discover_body(), now=time.time())}, id="wrong-key"),
        pytest.param({SIGNATURE_HEADER: signed(MASTER, discover_body(), now=time.time())}, id="the-master"),
        pytest.param({SIGNATURE_HEADER: signed(KEY, discover_body(), now=time.time() - 600)}, id="stale"),
    ],
)
def test_sdk_refuses_unsigned_tampered_or_stale_requests(headers: dict[str, str], request: Any) -> None:
    request_id = request.node.callspec.id
    ran: list[str] = []
    app = signed_app(ran)
    response = app.handle("POST", headers, discover_body())
    assert response.status == 401
    stale = request_id == "stale"  # this app's own request, too late: not "invalid", and not "nothing ran"
    assert json.loads(response.body)["error"]["code"] == ("stale_request" if stale else "invalid_signature")
    assert ran == []


@pytest.mark.rfd("O2")
def test_sdk_refuses_a_tampered_body() -> None:
    ran: list[str] = []
    app = signed_app(ran)
    header = signed(KEY, discover_body(), now=time.time())
    tampered = discover_body().replace(b'"r1"', b'"r2"')
    assert app.handle("POST", {SIGNATURE_HEADER: header}, tampered).status == 401
    assert ran == []
    ok = app.handle("POST", {SIGNATURE_HEADER: header}, discover_body())
    assert ok.status == 200 and ran == ["function body"]
    assert ok.headers[SIGNATURE_HEADER].startswith("v2,k=")  # responses are signed too


def signed_env(app: Ryusen) -> WorkflowEnvironment:
    env = WorkflowEnvironment()
    env.engine.settings = replace(env.engine.settings, master_key=MASTER)
    env.sync(app)
    return env


@pytest.mark.rfd("O2")
def test_signed_round_trip_through_the_engine() -> None:
    """Every request the engine sent the endpoint is signed with the app's key for its scope, and every
    answer is signed as the answer to exactly that request."""
    ran: list[str] = []
    env = signed_env(signed_app(ran))
    real = env.invoker.apps["inproc://secure"]
    exchanges: list[tuple[dict[str, str], bytes, Any]] = []

    def recording(method: str, headers: dict[str, str], body: bytes) -> Any:
        response = real(method, headers, body)
        exchanges.append((headers, body, response))
        return response

    env.invoker.apps["inproc://secure"] = recording
    run = env.run("wf")
    assert run.outcome == "completed" and run.output == "ok"
    assert ran.count("callback") == 1
    kinds = [TaskRequest.model_validate_json(body).kind for _, body, _ in exchanges]
    assert TaskKind.DISCOVER in kinds and TaskKind.FORWARD in kinds
    for headers, body, response in exchanges:
        scope = task_scope(TaskRequest.model_validate_json(body), path="/", app_id="secure")
        header = headers[SIGNATURE_HEADER]
        request_signature, _ = verify([KEY], scope, body, header, now=time.time())
        answer = {k.lower(): v for k, v in response.headers.items()}[SIGNATURE_HEADER.lower()]
        verify(
            [KEY],
            scope.answer(),
            response.body,
            answer,
            now=time.time(),
            answers=answer_binding(header, body),
            nonce=request_signature.nonce,
        )


@pytest.mark.rfd("O2")
def test_server_treats_a_forged_response_as_no_result() -> None:
    ran: list[str] = []
    app = signed_app(ran)
    env = signed_env(app)
    real = env.invoker.apps["inproc://secure"]

    def forger(method: str, headers: dict[str, str], body: bytes) -> Any:
        response = real(method, headers, body)
        request = json.loads(body)
        if request["kind"] == "forward":
            forged = response.body.replace(b'"ok"', b'"forged"')
            return type(response)(response.status, response.headers, forged)  # signature no longer matches
        return response

    env.invoker.apps["inproc://secure"] = forger
    run_id = env.start("wf")
    env.drive()
    run = env.get(run_id)
    # the effect ran, but its result cannot be established: Unknown, never the forged value
    assert run.step("s")["status"] == "unknown"
    assert run.step("s")["result"] is None
    assert run.blockers[0]["type"] == "unknown_outcome"


@pytest.mark.rfd("O2")
def test_server_rejects_a_forged_late_result() -> None:
    ran: list[str] = []
    env = signed_env(signed_app(ran))
    run_id = env.start("wf")
    env.drive()
    body = json.dumps(
        {
            "run_id": run_id,
            "step_id": "s",
            "phase": "forward",
            "generation": 1,
            "attempt": {"type": "succeeded", "result": "forged"},
        }
    ).encode()
    version = env.engine.get_run(run_id).version
    scope = late_result_scope(LateResult.model_validate_json(body), path="/v1/results", app_id="secure")
    forged = sign("wrong", scope, body, now=time.time(), nonce=secrets.token_hex(16))
    with pytest.raises(SignatureRejectedError):
        env.engine.submit_late_result(body, {SIGNATURE_HEADER: forged})
    with pytest.raises(SignatureRejectedError):
        env.engine.submit_late_result(body, {})
    assert env.engine.get_run(run_id).version == version


# ---- O3: the server API --------------------------------------------------------------


def rest_event(method: str, path: str, body: str | None = None, query: dict[str, str] | None = None) -> dict[str, Any]:
    event: dict[str, Any] = json.loads((EVENTS / "api_start_run.json").read_text())
    event.update(
        {
            "httpMethod": method,
            "path": path,
            "resource": path,
            "body": body,
            "queryStringParameters": query,
            "multiValueQueryStringParameters": {k: [v] for k, v in (query or {}).items()} or None,
        }
    )
    event["requestContext"] = {**event["requestContext"], "httpMethod": method, "path": path, "resourcePath": path}
    return event


@pytest.fixture
def api_env() -> tuple[WorkflowEnvironment, Any]:
    app = Ryusen("api-app")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        return step.run("s", lambda: data)

    env = WorkflowEnvironment(app)
    resolver = build_api(env.engine, lambda url: app.manifest())
    return env, resolver


def call(
    resolver: Any, method: str, path: str, body: str | None = None, query: dict[str, str] | None = None
) -> tuple[int, Any]:
    result = resolver.resolve(rest_event(method, path, body, query), None)
    return result["statusCode"], json.loads(result["body"])


def snapshot(env: WorkflowEnvironment) -> list[tuple[str, int]]:
    return sorted((r["id"], env.store.get(r["id"]).version) for r in env.store.list_runs(limit=200).runs)  # type: ignore[union-attr]


@pytest.mark.rfd("O3")
@pytest.mark.parametrize(
    ("method", "path", "body", "query", "status", "code"),
    [
        ("POST", "/v1/functions/nope/runs", '{"input": 1}', None, 404, "not_found"),
        ("GET", "/v1/runs/run_missing", None, None, 404, "not_found"),
        ("POST", "/v1/runs/run_missing/cancel", None, None, 404, "not_found"),
        ("POST", "/v1/runs/run_missing/rediscover", None, None, 404, "not_found"),
        ("POST", "/v1/functions/wf/runs", "{not json", None, 400, "malformed_json"),
        ("POST", "/v1/functions/wf/runs", "", None, 400, "malformed_json"),
        ("POST", "/v1/functions/wf/runs", "[1, 2]", None, 422, "invalid_request"),
        ("POST", "/v1/functions/wf/runs", '{"input": 1, "timeout_s": "soon"}', None, 422, "invalid_request"),
        ("POST", "/v1/functions/wf/runs", '{"input": 1, "timeout_s": -5}', None, 422, "invalid_request"),
        ("POST", "/v1/functions/wf/runs", '{"input": 1, "surprise": true}', None, 422, "invalid_request"),
        ("POST", "/v1/functions/wf/runs", '{"idempotency_key": 7}', None, 422, "invalid_request"),
        ("POST", "/v1/functions/wf/runs", json.dumps({"input": "x" * 300_000}), None, 413, "payload_too_large"),
        ("POST", "/v1/functions/wf/runs", json.dumps({"input": "x" * 1_100_000}), None, 413, "payload_too_large"),
        ("PUT", "/v1/apps/api-app", '{"url": "ftp://nowhere"}', None, 422, "invalid_request"),
        ("PUT", "/v1/apps/api-app", '{"url": 5}', None, 422, "invalid_request"),
        ("GET", "/v1/runs", None, {"limit": "many"}, 422, "invalid_request"),
        ("GET", "/v1/runs", None, {"limit": "0"}, 422, "invalid_request"),
        ("GET", "/v1/runs", None, {"phase": "queued"}, 422, "invalid_request"),
        ("GET", "/v1/runs", None, {"colour": "red"}, 422, "invalid_request"),
        ("GET", "/v1/runs", None, {"recovery": "undone"}, 422, "invalid_request"),
        ("GET", "/v1/runs", None, {"blocked": "yes"}, 422, "invalid_request"),
        ("GET", "/v1/runs", None, {"idempotency_key": "k1"}, 422, "invalid_request"),
        ("GET", "/v1/runs", None, {"function_id": "wf", "idempotency_key": "k" * 257}, 422, "invalid_request"),
        ("GET", "/v1/nothing-here", None, None, 404, "route_not_found"),
    ],
)
def test_bad_requests_get_structured_4xx_and_change_nothing(
    api_env: tuple[WorkflowEnvironment, Any],
    method: str,
    path: str,
    body: str | None,
    query: dict[str, str] | None,
    status: int,
    code: str,
) -> None:
    env, resolver = api_env
    existing = env.run("wf", 1)
    before = snapshot(env)
    got_status, payload = call(resolver, method, path, body, query)
    assert got_status == status, payload
    assert payload["error"]["code"] == code
    assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]
    assert snapshot(env) == before
    assert env.get(existing.id).outcome == "completed"


@pytest.mark.rfd("O3")
@pytest.mark.parametrize(
    ("body", "path_tail", "status", "code"),
    [
        ('{"action": "explode"}', "s/forward/1", 422, "invalid_request"),
        ('{"action": "fail"}', "s/forward/1", 422, "invalid_request"),
        ('{"action": "retry", "result": 1}', "s/forward/1", 422, "invalid_request"),
        ('{"action": "retry"}', "s/sideways/1", 422, "invalid_request"),
        ('{"action": "retry"}', "s/forward/zero", 422, "invalid_request"),
        ('{"action": "retry"}', "nope/forward/1", 404, "step_not_found"),
        ('{"action": "retry"}', "s/forward/9", 404, "attempt_not_found"),
        ('{"action": "succeed", "result": 2}', "s/forward/1", 409, "generation_settled"),
        ('{"action": "retry"}', "s/compensation/1", 404, "attempt_not_found"),
        ("{oops", "s/forward/1", 400, "malformed_json"),
        (json.dumps({"action": "succeed", "result": "x" * 300_000}), "s/forward/1", 413, "payload_too_large"),
    ],
)
def test_invalid_resolutions_are_refused_and_change_nothing(
    api_env: tuple[WorkflowEnvironment, Any], body: str, path_tail: str, status: int, code: str
) -> None:
    env, resolver = api_env
    run = env.run("wf", 1)
    before = snapshot(env)
    got_status, payload = call(resolver, "POST", f"/v1/runs/{run.id}/steps/{path_tail}/resolve", body)
    assert (got_status, payload["error"]["code"]) == (status, code), payload
    assert snapshot(env) == before


@pytest.mark.rfd("O3")
def test_cancel_of_a_finished_run_is_a_conflict(api_env: tuple[WorkflowEnvironment, Any]) -> None:
    env, resolver = api_env
    run = env.run("wf", 1)
    before = snapshot(env)
    status, payload = call(resolver, "POST", f"/v1/runs/{run.id}/cancel")
    assert status == 409 and payload["error"]["code"] == "run_not_cancellable"
    assert snapshot(env) == before


@pytest.mark.rfd("O3", "O4")
def test_valid_start_and_idempotent_retry_through_the_api(api_env: tuple[WorkflowEnvironment, Any]) -> None:
    env, resolver = api_env
    status, first = call(resolver, "POST", "/v1/functions/wf/runs", '{"input": 5, "idempotency_key": "order-1"}')
    assert status == 201 and first["phase"] == "running"
    status, again = call(resolver, "POST", "/v1/functions/wf/runs", '{"input": 5, "idempotency_key": "order-1"}')
    assert status == 200 and again["id"] == first["id"]
    assert len(env.store.list_runs().runs) == 1
    env.wait(first["id"])
    status, listed = call(resolver, "GET", "/v1/runs", None, {"function_id": "wf", "outcome": "completed"})
    assert status == 200 and [r["id"] for r in listed["runs"]] == [first["id"]]

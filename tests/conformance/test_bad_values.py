"""Values the server cannot store are refused where they enter, with a structured error and no change (issue
11, findings 4 and 9).

The review stored an input nested about 230 levels deep: from then on ``GET /v1/runs`` answered 500 for every
filter, the dev UI was blank, and the dispatcher failed on that run's message again and again. It also got
500s from a non-ASCII signature header, a ``timeout_s`` of 1e308 (``true`` became a 1 s deadline), a lone
surrogate, nesting of 256 and more, and ``Content-Length: -1``, which also held a worker thread until the
client hung up. One check now decides what a JSON value may be (:func:`json_value_problem`: nesting, finite
numbers, valid Unicode), at the API, in the SDK's own value check, and on what an endpoint answers.
"""

from __future__ import annotations

import io
import json
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

from ryusen import Ryusen, Step
from ryusen._internal.app import HandlerResponse
from ryusen._internal.serve import wsgi_app
from ryusen._internal.signing import SIGNATURE_HEADER, Scope, SignatureError, sign, verify
from ryusen._internal.wire import MAX_VALUE_DEPTH, TaskRequest, TaskResponse, json_value_problem
from ryusen.testing import WorkflowEnvironment
from ryusen_server.api import build_api
from ryusen_server.local.dev import wsgi_to_rest_event
from tests.conformance.test_security_and_bad_input import call, snapshot


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.fixture(params=["memory", "moto"])
def api_env(request: pytest.FixtureRequest) -> Iterator[tuple[WorkflowEnvironment, Any]]:
    app = Ryusen("values")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        return step.run("s", lambda: data)

    with WorkflowEnvironment(app, store=request.param) as env:
        yield env, build_api(env.engine, lambda url: (app.manifest(), frozenset()))


@pytest.mark.parametrize(
    ("body", "code", "says"),
    [
        (f'{{"input": {nested(MAX_VALUE_DEPTH + 1)}}}', "invalid_value", "nested deeper than 128"),
        (f'{{"input": {nested(230)}}}', "malformed_json", "nested deeper"),
        (f'{{"input": {nested(256)}}}', "malformed_json", "nested deeper"),
        (f'{{"input": {nested(5000)}}}', "malformed_json", "nested deeper"),
        ('{"input": NaN}', "malformed_json", "NaN is not JSON"),
        ('{"input": {"x": -Infinity}}', "malformed_json", "Infinity is not JSON"),
        ('{"input": "\\ud800"}', "malformed_json", "lone surrogate"),
        ('{"input": {"\\udc00": 1}}', "malformed_json", "lone surrogate"),
        ('{"input": ' + "9" * 5000 + "}", "malformed_json", "not JSON"),
        ('{"input": 1, "timeout_s": 1e308}', "invalid_request", ""),
        ('{"input": 1, "timeout_s": Infinity}', "malformed_json", "Infinity"),
        ('{"input": 1, "timeout_s": true}', "invalid_request", ""),
        ('{"input": 1, "timeout_s": "30"}', "invalid_request", ""),
    ],
)
def test_a_value_the_server_cannot_store_is_refused_and_changes_nothing(
    api_env: tuple[WorkflowEnvironment, Any], body: str, code: str, says: str
) -> None:
    env, resolver = api_env
    before = snapshot(env)
    status, answer = call(resolver, "POST", "/v1/functions/wf/runs", body)
    assert 400 <= status < 500 and answer["error"]["code"] == code, answer
    assert says in answer["error"]["message"]
    assert snapshot(env) == before
    status, listing = call(resolver, "GET", "/v1/runs")
    assert status == 200 and listing["runs"] == []


def test_the_deepest_value_allowed_is_stored_listed_and_run(api_env: tuple[WorkflowEnvironment, Any]) -> None:
    env, resolver = api_env
    status, run = call(resolver, "POST", "/v1/functions/wf/runs", f'{{"input": {nested(MAX_VALUE_DEPTH)}}}')
    assert status == 201, run
    status, answer = call(resolver, "POST", "/v1/functions/wf/runs", '{"input": 1, "timeout_s": 30}')
    assert status == 201, answer
    env.drive()
    status, listing = call(resolver, "GET", "/v1/runs")
    assert status == 200 and {r["outcome"] for r in listing["runs"]} == {"completed"}
    assert env.get(run["id"]).output == json.loads(nested(MAX_VALUE_DEPTH))


def test_an_operator_resolution_is_held_to_the_same_values(api_env: tuple[WorkflowEnvironment, Any]) -> None:
    env, resolver = api_env
    status, run = call(resolver, "POST", "/v1/functions/wf/runs", '{"input": 1}')
    assert status == 201
    before = snapshot(env)
    path = f"/v1/runs/{run['id']}/steps/s/forward/1/resolve"
    for body in (
        f'{{"action": "succeed", "result": {nested(MAX_VALUE_DEPTH + 1)}}}',
        '{"action": "fail", "error": {"type": "x", "message": "y", "data": {"n": NaN}}}',
        '{"action": "fail", "error": {"type": "\\ud800", "message": "y"}}',
    ):
        status, answer = call(resolver, "POST", path, body)
        assert 400 <= status < 500 and answer["error"]["code"] in ("invalid_value", "malformed_json"), answer
    assert snapshot(env) == before


def test_one_unreadable_run_does_not_break_the_listing() -> None:
    """Whatever wrote it (an older version, a bug), one run whose summary cannot be read is left out of the
    list and logged; every other run is still listed."""
    app = Ryusen("values")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        return data

    with WorkflowEnvironment(app, store="moto") as env:
        broken, fine = env.start("wf", 1), env.start("wf", 2)
        store: Any = env.store
        store._client.update_item(
            TableName=store.table_name,
            Key={"pk": {"S": f"RUN#{broken}"}, "sk": {"S": "RUN"}},
            UpdateExpression="SET summary = :s",
            ExpressionAttributeValues={":s": {"B": zlib.compress(b'{"not": "a run"')}},
        )
        page = env.store.list_runs(limit=10)
        assert [r["id"] for r in page.runs] == [fine]


def test_an_endpoint_answer_with_a_value_too_deep_to_store_is_no_answer() -> None:
    """The SDK refuses such values itself (below); an endpoint that sends one anyway has its answer treated as
    lost: the attempt is Unknown, not stored half-way or retried blindly."""
    app = Ryusen("deep")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        return step.run("s", lambda: 1)

    env = WorkflowEnvironment(app, signing=False)  # the answer is rewritten below
    endpoint = env.invoker.apps["inproc://deep"]

    def deep_answer(method: str, headers: dict[str, str], body: bytes) -> Any:
        response = endpoint(method, headers, body)
        if TaskRequest.model_validate_json(body).step_id == "s":
            answer = json.loads(response.body)
            answer["attempt"]["result"] = json.loads(nested(MAX_VALUE_DEPTH + 5))
            answer.pop("next", None)
            return HandlerResponse(200, response.headers, json.dumps(answer).encode())
        return response

    env.invoker.apps["inproc://deep"] = deep_answer
    run_id = env.start("wf")
    env.drive()
    attempt = env.get(run_id).step("s")["attempts"][0]
    assert attempt["status"] == "unknown" and "nested deeper" in attempt["detail"]


def test_the_sdk_refuses_results_and_outputs_the_server_could_not_store() -> None:
    app = Ryusen("deep-sdk")

    @app.function("result")
    def result(data: Any, step: Step) -> Any:
        return step.run("s", lambda: json.loads(nested(MAX_VALUE_DEPTH + 1)))

    @app.function("output")
    def output(data: Any, step: Step) -> Any:
        return json.loads(nested(MAX_VALUE_DEPTH + 1))

    env = WorkflowEnvironment(app)
    failed = env.run("result")
    assert failed.outcome == "failed" and failed.step("s")["error"]["type"] == "not_json_serializable"
    run_id = env.start("output")
    env.drive()
    assert [b["type"] for b in env.get(run_id).blockers] == ["output_not_json"]


@pytest.mark.parametrize(
    "header",
    [
        "v2,k=é,t=1,n=" + "0" * 32 + ",s=" + "0" * 64,
        "v2,k=" + "0" * 16 + ",t=١٢٣,n=" + "0" * 32 + ",s=" + "0" * 64,
        "v2,k=" + "0" * 16 + ",t=" + "9" * 5000 + ",n=" + "0" * 32 + ",s=" + "0" * 64,
        "v2,k=" + "0" * 16 + ",t=1,n=" + "0" * 32 + ",s=" + "0" * 5000,
        "v2,k=" + "0" * 16 + ",t=1,n=" + "0" * 32 + ",s=ABC",
        "v2,k=" + "0" * 16 + ",t=1,n=0,s=" + "0" * 64,
    ],
)
def test_a_malformed_signature_header_is_refused_not_a_crash(header: str) -> None:
    with pytest.raises(SignatureError, match="malformed"):
        verify(["key"], Scope("request", "POST", "/", "signed"), b"{}", header, now=1.0)
    app = Ryusen("signed", signing_key="k" * 32)
    response = app.handle("POST", {SIGNATURE_HEADER: header}, b"{}")
    assert response.status == 401 and json.loads(response.body)["error"]["code"] == "invalid_signature"
    assert sign("key", Scope("request", "POST", "/", "s"), b"{}", now=1.0, nonce="0" * 32).split("s=")[1].islower()


class _Unreadable(io.RawIOBase):
    def read(self, size: int = -1) -> bytes:
        raise AssertionError(f"read({size}): the body was read although its length was refused")


@pytest.mark.parametrize(("length", "status"), [("-1", 400), ("abc", 400), ("١٢", 400), (str(10**9), 413)])
def test_a_bad_content_length_is_refused_before_the_body_is_read(length: str, status: int) -> None:
    environ = {"REQUEST_METHOD": "POST", "CONTENT_LENGTH": length, "wsgi.input": _Unreadable(), "PATH_INFO": "/"}
    started: list[str] = []
    body = b"".join(wsgi_app(Ryusen("len"))(environ, lambda s, h: started.append(s)))
    assert started[0].startswith(str(status)) and json.loads(body)["error"]["code"]
    from ryusen_server.local.guard import RefusedError

    with pytest.raises(RefusedError) as refused:
        wsgi_to_rest_event({**environ, "PATH_INFO": "/v1/runs"})
    assert refused.value.status == status


def test_json_value_problem_agrees_with_what_a_round_trip_keeps() -> None:
    assert json_value_problem({"a": [1, 2.5, "é", None, True, {"b": []}]}) is None
    assert json_value_problem(json.loads(nested(MAX_VALUE_DEPTH))) is None
    assert json_value_problem(json.loads(nested(MAX_VALUE_DEPTH + 1))) == "nested deeper than 128 levels"
    assert json_value_problem({1: "x"}) == "has an object key that is not a string"
    assert json_value_problem((1, 2)) == "contains a tuple, which is not JSON"
    assert TaskResponse.model_validate_json('{"kind": "discover", "run_id": "r"}').memo_miss is None


def test_a_non_ascii_id_is_reached_through_the_dev_server() -> None:
    """Finding 10: WSGI hands the path over as Latin-1, so ``/v1/functions/café/runs`` did not reach café."""
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/v1/functions/café/runs".encode().decode("latin-1"),
        "CONTENT_LENGTH": "2",
        "CONTENT_TYPE": "application/json",
        "wsgi.input": io.BytesIO(b"{}"),
    }
    assert wsgi_to_rest_event(environ)["path"] == "/v1/functions/café/runs"
    app = Ryusen("unicode")

    @app.function("café")
    def cafe(data: Any, step: Step) -> Any:
        return step.run("thé", lambda: "ok")

    env = WorkflowEnvironment(app)
    resolver = build_api(env.engine, lambda url: (app.manifest(), frozenset()))
    status, run = call(resolver, "POST", "/v1/functions/café/runs", "{}")
    assert status == 201, run
    env.drive()
    status, view = call(resolver, "GET", f"/v1/runs/{run['id']}")
    assert view["outcome"] == "completed" and view["steps"][0]["id"] == "thé"


@pytest.mark.parametrize("generation", ["²", "①", "¹²", "\u0661", "9" * 5000, "0", "-1", "1.0"])
def test_a_generation_that_is_not_a_plain_number_is_a_4xx(
    api_env: tuple[WorkflowEnvironment, Any], generation: str
) -> None:
    env, resolver = api_env
    status, run = call(resolver, "POST", "/v1/functions/wf/runs", '{"input": 1}')
    before = snapshot(env)
    status, answer = call(
        resolver, "POST", f"/v1/runs/{run['id']}/steps/s/forward/{generation}/resolve", '{"action": "retry"}'
    )
    assert 400 <= status < 500, answer
    assert snapshot(env) == before


@pytest.mark.parametrize("path", ["/v1/functions/wf/runs", "/v1/results"])
def test_a_body_with_a_lone_surrogate_is_a_4xx(api_env: tuple[WorkflowEnvironment, Any], path: str) -> None:
    env, resolver = api_env
    before = snapshot(env)
    status, answer = call(resolver, "POST", path, '{"input": "\ud800"}')
    assert 400 <= status < 500, answer
    assert snapshot(env) == before


def test_an_app_cannot_declare_ids_or_timeouts_the_server_cannot_hold() -> None:
    """A review synced a function declared with ``timeout=timedelta.max``: the sync answered 200, and every
    start of that function then answered 500; ids of 3,000 characters broke the DynamoDB store's keys."""
    from datetime import timedelta

    from ryusen import DefinitionError
    from ryusen._internal.wire import Manifest

    app = Ryusen("ids")
    with pytest.raises(DefinitionError, match="ten years"):
        app.function("wf", timeout=timedelta.max)(lambda data, step: None)
    with pytest.raises(DefinitionError, match="1 to 256"):
        app.function("f" * 3000)(lambda data, step: None)
    with pytest.raises(DefinitionError, match="1 to 256"):
        Ryusen("a" * 3000)
    forged = {"app_id": "ids", "release_id": "r", "build_id": "b", "signed": False}
    for functions in ([{"id": "wf", "timeout_s": 1e300}], [{"id": "f" * 3000}]):
        with pytest.raises(ValueError):
            Manifest.model_validate({**forged, "functions": functions})

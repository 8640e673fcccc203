"""Signed answers bound to their requests, and captured requests refused when played back (issue 11,
findings 5 and 6; part of decision 21).

The review relayed run 1's signed response to run 2's request, and run 2 completed with run 1's result; and
it replayed a captured task request within the 300 s window, which ran the callback again, three times.
An SDK that announces ``bound_responses`` now signs every answer for the request it answers (the request's
signature is part of what it signs), and refuses a signed request it has already received.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from ryusen import Ryusen, Step
from ryusen._internal.app import HandlerResponse
from ryusen._internal.signing import (
    ANSWER_BINDING_HEADER,
    SIGNATURE_HEADER,
    SignatureError,
    request_binding,
    sign,
    verify,
)
from ryusen._internal.wire import FEATURES_HEADER, TaskRequest
from ryusen.testing import WorkflowEnvironment
from ryusen_server.engine import ServerSettings

KEY = "signatures-test-key-0123456789abcdef"


def signed_env(app: Ryusen) -> WorkflowEnvironment:
    env = WorkflowEnvironment(app)
    env.engine.settings = ServerSettings(engine=env.engine.settings.engine, signing_key=KEY)
    return env


def charging_app(calls: Counter[str]) -> Ryusen:
    app = Ryusen("bound", signing_key=KEY)

    @app.function("pay")
    def pay(data: Any, step: Step) -> Any:
        return step.run("charge", lambda: calls.update([f"charge-{data}"]) or f"receipt-{data}")

    return app


def test_an_answer_to_one_request_is_not_accepted_as_the_answer_to_another() -> None:
    calls: Counter[str] = Counter()
    app = charging_app(calls)
    env = signed_env(app)
    endpoint = env.invoker.apps["inproc://bound"]
    answers: dict[str, HandlerResponse] = {}

    def relay(method: str, headers: dict[str, str], body: bytes) -> Any:
        request = TaskRequest.model_validate_json(body)
        response = endpoint(method, headers, body)
        if request.step_id == "charge":
            first = next(iter(answers.values()), None)
            answers.setdefault(request.run_id, response)
            if first is not None:
                return first  # run 1's signed answer, relayed as run 2's
        return response

    env.invoker.apps["inproc://bound"] = relay
    first = env.run("pay", 1)
    assert first.output == "receipt-1"
    run_id = env.start("pay", 2)
    env.drive()
    run = env.get(run_id)
    assert run.output != "receipt-1" and run.step("charge")["attempts"][0]["status"] == "unknown"
    assert run.step("charge")["attempts"][0]["detail"] == "HTTP 200: signature does not match the body"
    assert calls == Counter({"charge-1": 1, "charge-2": 1})


def capturing_charges(app: Ryusen) -> tuple[WorkflowEnvironment, list[tuple[dict[str, str], bytes]]]:
    """A signed environment whose every charge request (headers, body) is kept, as someone on the path would."""
    env = signed_env(app)
    endpoint = env.invoker.apps["inproc://bound"]
    captured: list[tuple[dict[str, str], bytes]] = []

    def capturing(method: str, headers: dict[str, str], body: bytes) -> Any:
        if TaskRequest.model_validate_json(body).step_id == "charge":
            captured.append((dict(headers), body))
        return endpoint(method, headers, body)

    env.invoker.apps["inproc://bound"] = capturing
    return env, captured


def test_a_captured_request_played_back_runs_nothing() -> None:
    calls: Counter[str] = Counter()
    app = charging_app(calls)
    env, captured = capturing_charges(app)
    assert env.run("pay", 7).output == "receipt-7" and calls == Counter({"charge-7": 1})
    headers, body = captured[0]
    for _ in range(3):
        replayed = app.handle("POST", headers, body)
        assert replayed.status == 401 and json.loads(replayed.body)["error"]["code"] == "replayed_request"
    assert calls == Counter({"charge-7": 1})


def test_the_signed_string_of_an_answer_names_its_request() -> None:
    request = sign(KEY, b"{}", now=100.0)
    answer = sign(KEY, b'{"ok": 1}', now=100.0, answers=request)
    verify(KEY, b'{"ok": 1}', answer, now=100.0, answers=request, bound=True)
    other = sign(KEY, b"{ }", now=100.0)
    with pytest.raises(SignatureError, match="does not match"):
        verify(KEY, b'{"ok": 1}', answer, now=100.0, answers=other, bound=True)
    with pytest.raises(SignatureError, match="not signed for the request"):
        verify(KEY, b'{"ok": 1}', sign(KEY, b'{"ok": 1}', now=100.0), now=100.0, answers=request, bound=True)
    with pytest.raises(SignatureError, match="not a request's"):  # an answer's signature cannot sign a request
        verify(KEY, b'{"ok": 1}', answer, now=100.0)


def test_an_sdk_that_does_not_bind_its_answers_still_works_unbound() -> None:
    """An app on an SDK that predates ``bound_responses`` signs its answers as before; the server accepts
    them from it (and only from it: a release whose SDK announced the feature must bind every answer)."""
    calls: Counter[str] = Counter()
    app = charging_app(calls)
    env = signed_env(app)
    env.engine.sync_release(app.app_id, "inproc://bound", app.manifest(), frozenset({"continuation"}))
    endpoint = env.invoker.apps["inproc://bound"]

    def unbound(method: str, headers: dict[str, str], body: bytes) -> Any:
        response = endpoint(method, headers, body)
        resigned = {**response.headers, SIGNATURE_HEADER: sign(KEY, response.body, now=app.clock())}
        return HandlerResponse(response.status, resigned, response.body)

    env.invoker.apps["inproc://bound"] = unbound
    assert env.run("pay", 3).output == "receipt-3"
    manifest = app.handle("GET", {}, b"")
    assert "bound_responses" in manifest.headers[FEATURES_HEADER]


@pytest.mark.parametrize(
    "respell",
    [
        lambda h: h + ",a=0",
        lambda h: h + ",x",
        lambda h: h + ",",
        lambda h: "junk," + h,
        lambda h: ",".join(reversed(h.split(","))),
        lambda h: h.split(",")[0] + "," + h,
    ],
)
def test_a_played_back_request_is_refused_however_its_header_is_spelt(respell: Any) -> None:
    """A review replayed a capture with ``,a=0`` or a trailing comma added, or its parts swapped: the replay
    set remembered the header's text, so each spelling ran the charge again (1 call became 8)."""
    calls: Counter[str] = Counter()
    app = charging_app(calls)
    env, captured = capturing_charges(app)
    assert env.run("pay", 7).output == "receipt-7"
    headers, body = captured[0]
    headers = {**headers, SIGNATURE_HEADER: respell(headers[SIGNATURE_HEADER])}
    replayed = app.handle("POST", headers, body)
    assert replayed.status == 401 and calls == Counter({"charge-7": 1})


@pytest.mark.parametrize("how", ["again", "another body"])
def test_a_refusal_the_endpoint_gave_someone_else_does_not_make_the_engine_send_the_task_again(how: str) -> None:
    """A review relayed the engine's request (the charge ran), dropped the real answer, then got the endpoint
    to refuse the same signature (sent again, or over another body) and handed that signed refusal to the
    engine, which took it for "nothing ran" and charged again. A refusal is signed for the body the endpoint
    received, and "already received" means the outcome is not known."""
    calls: Counter[str] = Counter()
    app = charging_app(calls)
    env = signed_env(app)
    endpoint = env.invoker.apps["inproc://bound"]
    done: list[bool] = []

    def relaying(method: str, headers: dict[str, str], body: bytes) -> Any:
        request = TaskRequest.model_validate_json(body)
        if request.step_id != "charge" or done:
            return endpoint(method, headers, body)
        done.append(True)
        endpoint(method, headers, body)  # the charge runs; its answer is dropped
        return endpoint(method, headers, body if how == "again" else body.replace(b'"pay"', b'"pay" '))

    env.invoker.apps["inproc://bound"] = relaying
    run_id = env.start("pay", 9)
    env.drive()
    assert calls == Counter({"charge-9": 1})
    assert env.get(run_id).step("charge")["attempts"][0]["status"] == "unknown"


def test_an_sdk_binds_its_answer_only_when_the_server_asks() -> None:
    """A review: a new SDK behind a server that predates binding had every answer refused, because it bound
    them anyway. It binds only for a request that asks (``X-Ryusen-Answer-Binding``), which such a server
    does not send; its answers then verify as they always did."""
    app = charging_app(Counter())
    body = TaskRequest(kind="discover", run_id="r", function_id="pay", input=1).model_dump_json().encode()
    old_server = {SIGNATURE_HEADER: sign(KEY, body, now=app.clock())}
    answer = app.handle("POST", old_server, body)
    verify(KEY, answer.body, answer.headers[SIGNATURE_HEADER], now=app.clock())  # as a server before binding
    new_server = {SIGNATURE_HEADER: sign(KEY, body, now=app.clock() + 1), ANSWER_BINDING_HEADER: "1"}
    bound = app.handle("POST", new_server, body)
    binding = request_binding(new_server[SIGNATURE_HEADER], body)
    verify(KEY, bound.body, bound.headers[SIGNATURE_HEADER], now=app.clock(), answers=binding, bound=True)


def test_an_empty_key_secret_is_no_key() -> None:
    """A deployed engine whose secret holds an empty string ran unsigned: it now fails closed."""
    import boto3
    from moto import mock_aws

    from ryusen_server.wiring import SecretKey

    with mock_aws():
        client = boto3.client("secretsmanager", region_name="us-east-1")
        arn = client.create_secret(Name="ryusen/empty", SecretString="  ")["ARN"]
        with pytest.raises(RuntimeError, match="is empty"):
            SecretKey(client, arn).keys()

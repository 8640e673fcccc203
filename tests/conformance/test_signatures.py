"""Signatures as decisions 21 says (issue 11, findings 5 to 8 and 10's key rotation).

The review relayed run 1's signed response to run 2's request, and run 2 completed with run 1's result; it
replayed a captured task request within the 300 s window, which ran the callback again; a request signed for
one app was accepted by another, and any key holder could forge late results for any run; an SDK with no
key ran any POST; and one key only meant a rotation turned attempts in flight Unknown.

Each app now has its own key (derived from the deployment's master), named by a key id, several valid at
once; the signed string names the direction, method, path, app, run, step, phase and generation, the
timestamp, a nonce and the body's digest; an answer is signed for its request; an endpoint refuses what it
has received before; and an endpoint or server with no key refuses to run outside insecure local mode.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ryusen import Ryusen, Step
from ryusen._internal.app import HandlerResponse
from ryusen._internal.signing import (
    SIGNATURE_HEADER,
    Scope,
    SignatureError,
    app_key,
    key_id,
    parse,
    sign,
    verify,
)
from ryusen._internal.wire import LateResult, TaskRequest, late_result_scope, task_scope
from ryusen.testing import WorkflowEnvironment
from ryusen_server.engine import SignatureRejectedError

MASTER = "signatures-test-master-0123456789abcdef"
NEW_MASTER = "signatures-test-master-rotated-fedcba98"
NONCE = "0" * 32


def signed_env(*apps: Ryusen, master: str = MASTER) -> WorkflowEnvironment:
    env = WorkflowEnvironment()
    env.engine.settings = replace(env.engine.settings, master_key=master)
    for app in apps:
        env.sync(app)
    return env


def charging_app(calls: Counter[str], app_id: str = "bound", **keys: Any) -> Ryusen:
    app = Ryusen(app_id, **(keys or {"master_key": MASTER}))

    @app.function(f"pay-{app_id}" if app_id != "bound" else "pay")
    def pay(data: Any, step: Step) -> Any:
        return step.run("charge", lambda: calls.update([f"charge-{data}"]) or f"receipt-{data}")

    return app


def capturing(env: WorkflowEnvironment, url: str) -> list[tuple[dict[str, str], bytes]]:
    """Keep every charge request (headers, body) to ``url``, as someone on the path would."""
    endpoint = env.invoker.apps[url]
    captured: list[tuple[dict[str, str], bytes]] = []

    def keep(method: str, headers: dict[str, str], body: bytes) -> Any:
        if TaskRequest.model_validate_json(body).step_id == "charge":
            captured.append((dict(headers), body))
        return endpoint(method, headers, body)

    env.invoker.apps[url] = keep
    return captured


def error_code(response: HandlerResponse) -> str:
    return str(json.loads(response.body)["error"]["code"])


# ---- answers are bound to their requests (finding 5) ------------------------------------------------------


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
    assert env.run("pay", 1).output == "receipt-1"
    run_id = env.start("pay", 2)
    env.drive()
    run = env.get(run_id)
    assert run.output != "receipt-1" and run.step("charge")["attempts"][0]["status"] == "unknown"
    assert (
        run.step("charge")["attempts"][0]["detail"] == "HTTP 200: the answer is not signed for the request it answers"
    )
    assert calls == Counter({"charge-1": 1, "charge-2": 1})


@pytest.mark.parametrize("field", ["direction", "method", "path", "app_id", "run_id", "step_id", "phase", "generation"])
def test_a_signature_holds_only_for_the_scope_it_was_made_for(field: str) -> None:
    """Each part of the scope is signed: a signature moved to another direction, route, app or attempt fails."""
    scope = Scope("request", "POST", "/tasks", "shop", "run_1", "charge", "forward", "1")
    header = sign("k", scope, b"{}", now=100.0, nonce=NONCE)
    verify(["k"], scope, b"{}", header, now=100.0)
    other = {"direction": "response", "method": "GET"}.get(field, "other")
    with pytest.raises(SignatureError, match="does not match"):
        verify(["k"], replace(scope, **{field: other}), b"{}", header, now=100.0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.text(max_size=12), min_size=9, max_size=9),
    st.lists(st.text(max_size=12), min_size=9, max_size=9),
)
def test_two_different_scopes_never_share_a_signed_string(a: list[str], b: list[str]) -> None:
    """The fields are encoded unambiguously: no two scopes (whatever characters they hold) sign alike."""
    scope_a = Scope("request", *a[:8])  # type: ignore[arg-type]
    scope_b = Scope("request", *b[:8])  # type: ignore[arg-type]
    header = sign("k", scope_a, b"", now=1.0, nonce=NONCE)
    if scope_a == scope_b:
        verify(["k"], scope_b, b"", header, now=1.0)
    else:
        with pytest.raises(SignatureError):
            verify(["k"], scope_b, b"", header, now=1.0)


def test_an_answer_verifies_only_with_its_requests_digest_and_nonce() -> None:
    scope = Scope("request", "POST", "/", "shop", "r", "s", "forward", "1")
    request = parse(sign("k", scope, b"{}", now=100.0, nonce="1" * 32))
    answer = sign("k", scope.answer(), b'{"ok":1}', now=100.0, nonce=request.nonce, answers=request.digest)
    verify(["k"], scope.answer(), b'{"ok":1}', answer, now=100.0, answers=request.digest, nonce=request.nonce)
    with pytest.raises(SignatureError, match="does not match"):  # not a request: the direction is signed
        verify(["k"], scope, b'{"ok":1}', answer, now=100.0)
    other = parse(sign("k", scope, b"{ }", now=100.0, nonce="1" * 32))
    with pytest.raises(SignatureError, match="does not match"):
        verify(["k"], scope.answer(), b'{"ok":1}', answer, now=100.0, answers=other.digest, nonce=request.nonce)


# ---- replays (finding 6) ----------------------------------------------------------------------------------


def test_a_captured_request_played_back_runs_nothing() -> None:
    calls: Counter[str] = Counter()
    app = charging_app(calls)
    env = signed_env(app)
    captured = capturing(env, "inproc://bound")
    assert env.run("pay", 7).output == "receipt-7" and calls == Counter({"charge-7": 1})
    headers, body = captured[0]
    for _ in range(3):
        replayed = env.endpoint(app)("POST", headers, body)
        assert replayed.status == 401 and error_code(replayed) == "replayed_request"
    assert calls == Counter({"charge-7": 1})


@pytest.mark.parametrize(
    "respell",
    [
        lambda h: h + ",",
        lambda h: h.replace("v2,", "v2,,"),
        lambda h: h.upper(),
        lambda h: ",".join(reversed(h.split(","))),
        lambda h: h.replace("k=", "k= "),
    ],
)
def test_a_played_back_request_is_refused_however_its_header_is_spelt(respell: Any) -> None:
    calls: Counter[str] = Counter()
    app = charging_app(calls)
    env = signed_env(app)
    captured = capturing(env, "inproc://bound")
    assert env.run("pay", 7).output == "receipt-7"
    headers, body = captured[0]
    replayed = env.endpoint(app)("POST", {**headers, SIGNATURE_HEADER: respell(headers[SIGNATURE_HEADER])}, body)
    assert replayed.status == 401 and calls == Counter({"charge-7": 1})


@pytest.mark.parametrize("how", ["again", "another body"])
def test_a_refusal_the_endpoint_gave_someone_else_does_not_make_the_engine_send_the_task_again(how: str) -> None:
    """The engine's request is relayed first (the charge runs), the real answer dropped, and the endpoint's
    refusal of the same signature (sent again, or over another body) handed to the engine: "already
    received" means not known, and a refusal of another body is no answer to this request."""
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


def test_two_sends_of_one_request_are_two_messages() -> None:
    """The engine signs each send with a fresh nonce: a resend it makes itself (the memo it extended was
    missed) is not taken for a replay."""
    calls: Counter[str] = Counter()
    app = charging_app(calls)
    env = signed_env(app)
    app.memo_cache.capacity = 0  # every request that extends a memo is missed, and sent again whole
    assert env.run("pay", 3).output == "receipt-3" and calls == Counter({"charge-3": 1})


# ---- per-app keys, cross-app and re-targeted messages (finding 7) -----------------------------------------


def test_a_request_signed_for_one_app_is_refused_by_another() -> None:
    calls: Counter[str] = Counter()
    shop, billing = charging_app(calls, "shop"), charging_app(calls, "billing")
    env = signed_env(shop, billing)
    captured = capturing(env, "inproc://shop")
    assert env.run("pay-shop", 1).output == "receipt-1"
    headers, body = captured[0]
    refused = env.endpoint(billing)("POST", headers, body.replace(b"pay-shop", b"pay-billing"))
    assert refused.status == 401 and "does not hold" in json.loads(refused.body)["error"]["message"]
    # even an app given another app's key (a misconfiguration) refuses it: the app id is signed
    shared = Ryusen("billing", signing_key=app_key(MASTER, "shop"))
    shared.function("pay-billing")(lambda data, step: None)
    refused = shared.handle("POST", headers, body.replace(b"pay-shop", b"pay-billing"))
    assert refused.status == 401 and "does not match" in json.loads(refused.body)["error"]["message"]
    assert calls == Counter({"charge-1": 1})


def test_a_request_sent_to_another_path_is_refused() -> None:
    calls: Counter[str] = Counter()
    app = charging_app(calls)
    env = signed_env(app)
    captured = capturing(env, "inproc://bound")
    env.run("pay", 1)
    headers, body = captured[0]
    refused = app.handle("POST", headers, body, path="/admin/tasks")
    assert refused.status == 401 and calls == Counter({"charge-1": 1})


def late_result(run_id: str, generation: int = 1) -> LateResult:
    return LateResult.model_validate(
        {
            "run_id": run_id,
            "step_id": "charge",
            "phase": "forward",
            "generation": generation,
            "attempt": {"type": "succeeded", "result": "forged"},
        }
    )


def test_a_late_result_is_accepted_only_from_the_app_whose_run_it_is_about() -> None:
    """Any key holder could forge late results for any run: now only the run's app's key, for that attempt."""
    calls: Counter[str] = Counter()
    shop, billing = charging_app(calls, "shop"), charging_app(calls, "billing")
    env = signed_env(shop, billing)
    env.faults.lose_result("charge")
    run_id = env.start("pay-shop", 1)
    env.drive()
    assert env.get(run_id).step("charge")["attempts"][0]["status"] == "unknown"
    late = late_result(run_id)
    body = late.model_dump_json().encode()

    def signed(app_id: str, **changes: Any) -> dict[str, str]:
        scope = replace(late_result_scope(late, path="/v1/results", app_id=app_id), **changes)
        return {SIGNATURE_HEADER: sign(app_key(MASTER, app_id), scope, body, now=time.time(), nonce=NONCE)}

    for headers in (
        signed("billing"),  # another app's key, for another app
        {
            SIGNATURE_HEADER: sign(
                app_key(MASTER, "billing"),
                late_result_scope(late, path="/v1/results", app_id="shop"),
                body,
                now=time.time(),
                nonce=NONCE,
            )
        },
        signed("shop", generation="2"),  # this app's key, another attempt
        signed("shop", path="/v1/runs"),  # another route
        signed("shop", direction="response"),  # an answer's signature
        {},
    ):
        with pytest.raises(SignatureRejectedError):
            env.engine.submit_late_result(body, headers)
    assert env.get(run_id).step("charge")["attempts"][0]["status"] == "unknown"
    env.deliver_late_result(run_id, "charge")  # the SDK's own late result, signed by shop's key
    assert env.wait(run_id).output == "receipt-1"


def test_a_task_request_scope_names_its_attempt() -> None:
    request = TaskRequest.model_validate(
        {
            "kind": "forward",
            "run_id": "r",
            "function_id": "f",
            "step_id": "charge",
            "operation": {"id": "op", "phase": "compensation", "generation": 3},
        }
    )
    scope = task_scope(request, path="/t", app_id="shop")
    assert (scope.run_id, scope.step_id, scope.phase, scope.generation) == ("r", "charge", "compensation", "3")


# ---- several keys: rotation (finding 10) ------------------------------------------------------------------


def test_a_rotation_fails_nothing_in_flight() -> None:
    """The app is given the new key alongside the old one first; then the server signs with the new master
    while a request signed with the old one is in flight: its answer is signed with the key the request was
    (named by its key id), which the server still holds, and it is accepted."""
    calls: Counter[str] = Counter()
    app = charging_app(calls, signing_key=[app_key(NEW_MASTER, "bound"), app_key(MASTER, "bound")])
    env = signed_env(app, master=MASTER)

    def rotate() -> None:
        env.engine.settings = replace(env.engine.settings, master_key=f"{NEW_MASTER},{MASTER}")

    env.faults.before_invoke("charge", rotate)
    run_id = env.start("pay", 1)
    env.drive()
    charge = env.get(run_id).step("charge")["attempts"]
    assert env.get(run_id).output == "receipt-1" and [a["status"] for a in charge] == ["succeeded"]
    assert env.run("pay", 2).output == "receipt-2"  # signed with the new key from now on
    assert calls == Counter({"charge-1": 1, "charge-2": 1})


def test_a_key_the_other_side_does_not_hold_is_named_in_the_refusal() -> None:
    scope = Scope("request", "POST", "/", "shop")
    header = sign("new", scope, b"{}", now=1.0, nonce=NONCE)
    with pytest.raises(SignatureError, match=key_id("new")):
        verify(["old"], scope, b"{}", header, now=1.0)
    verify(["old", "new"], scope, b"{}", header, now=1.0)


# ---- no key: fail closed, or an announced insecure local mode (finding 8) ----------------------------------


def test_an_endpoint_without_a_key_runs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RYUSEN_SIGNING_KEY", "RYUSEN_MASTER_KEY", "RYUSEN_INSECURE_LOCAL"):
        monkeypatch.delenv(name, raising=False)
    calls: Counter[str] = Counter()
    app = Ryusen("keyless")
    app.function("pay")(lambda data, step: step.run("charge", lambda: calls.update(["charge"])))
    body = TaskRequest(kind="forward", run_id="r", function_id="pay", step_id="charge").model_dump_json().encode()
    refused = app.handle("POST", {}, body)
    assert refused.status == 503 and error_code(refused) == "no_signing_key" and calls == Counter()
    assert app.handle("GET", {}, b"").status == 503  # nor does it offer a manifest a server would sync


def test_insecure_local_mode_is_explicit_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("RYUSEN_SIGNING_KEY", "RYUSEN_MASTER_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RYUSEN_INSECURE_LOCAL", "1")
    app = Ryusen("local")
    app.function("pay")(lambda data, step: "ok")
    body = TaskRequest(kind="discover", run_id="r", function_id="pay").model_dump_json().encode()
    with caplog.at_level(logging.WARNING, logger="ryusen"):
        assert app.handle("POST", {}, body).status == 200
    assert any("INSECURE" in r.getMessage() for r in caplog.records)
    manifest = app.handle("GET", {}, b"")
    assert manifest.status == 200 and json.loads(manifest.body)["signed"] is False
    assert SIGNATURE_HEADER not in manifest.headers


def test_a_keyed_server_sends_nothing_to_a_release_whose_sdk_predates_these_signatures() -> None:
    """Its SDK would refuse the request, or answer so that it cannot be verified (an Unknown): nothing is sent,
    the run shows why, and a release on a current SDK repairs it."""
    calls: Counter[str] = Counter()
    app = charging_app(calls)
    env = signed_env()
    url = "inproc://bound"
    env._apps[url] = app
    env.invoker.apps[url] = env.endpoint(app)
    env.engine.sync_release("bound", url, app.manifest(), frozenset({"continuation", "memo_cache"}))
    run_id = env.start("pay", 1)
    env.drive(horizon=__import__("datetime").timedelta(minutes=5))
    run = env.get(run_id)
    assert calls == Counter() and run.outcome is None
    assert any("predates signing v2" in str(b) for b in run.blockers)
    env.sync(app)
    assert env.wait(run_id).output == "receipt-1" and calls == Counter({"charge-1": 1})


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


def test_there_is_no_insecure_mode_on_lambda(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RYUSEN_SIGNING_KEY", "RYUSEN_MASTER_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RYUSEN_INSECURE_LOCAL", "1")
    monkeypatch.setenv("AWS_LAMBDA_FUNCTION_NAME", "shop")
    app = Ryusen("deployed", insecure=True)
    app.function("pay")(lambda data, step: "ok")
    body = TaskRequest(kind="discover", run_id="r", function_id="pay").model_dump_json().encode()
    assert error_code(app.handle("POST", {}, body)) == "no_signing_key"


# ---- replays across the instances of one endpoint --------------------------------------------------------------


@pytest.fixture
def replay_table(monkeypatch: pytest.MonkeyPatch) -> Any:
    import boto3
    from moto import mock_aws

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        client = boto3.client("dynamodb", region_name="us-east-1")
        client.create_table(
            TableName="seen",
            KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
            AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
            BillingMode="PAY_PER_REQUEST",
        )
        yield client


def test_a_request_played_to_another_instance_runs_nothing_when_they_share_a_replay_table(
    replay_table: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each instance remembers what it accepted; a capture played to *another* container ran the charge
    again. With ``RYUSEN_REPLAY_TABLE`` every instance records what it accepts with a conditional write."""
    from ryusen._internal.replay import DynamoSeenRequests

    monkeypatch.setenv("RYUSEN_REPLAY_TABLE", "seen")
    calls: Counter[str] = Counter()
    first, second = charging_app(calls), charging_app(calls)  # two containers of one app
    assert isinstance(first.seen_requests, DynamoSeenRequests)
    first.seen_requests = DynamoSeenRequests("seen", client=replay_table)
    second.seen_requests = DynamoSeenRequests("seen", client=replay_table)
    env = signed_env(first)
    captured = capturing(env, "inproc://bound")
    assert env.run("pay", 5).output == "receipt-5"
    headers, body = captured[0]
    replayed = second.handle("POST", headers, body)
    assert replayed.status == 401 and error_code(replayed) == "replayed_request"
    assert calls == Counter({"charge-5": 1})


def test_a_replay_table_that_cannot_be_written_runs_nothing(replay_table: Any) -> None:
    """The endpoint runs nothing it could not record. Its refusal says nothing ran *there*; another instance
    may have run the same request (a second review relayed it to one instance, then to one whose write failed,
    and the engine charged again): a discovery is simply repeated, an attempt's outcome is not known."""
    from ryusen._internal.replay import DynamoSeenRequests

    calls: Counter[str] = Counter()
    app = charging_app(calls)
    app.seen_requests = DynamoSeenRequests("missing-table", client=replay_table)
    env = signed_env(app)
    run_id = env.start("pay", 6)
    env.drive(horizon=__import__("datetime").timedelta(seconds=5))
    assert calls == Counter()  # nothing ran unrecorded
    discovery = env.get(run_id).raw["discovery"]
    assert discovery["status"] == "queued" and discovery["redeliveries"] >= 1, discovery  # a discovery is repeated
    app.seen_requests = DynamoSeenRequests("seen", client=replay_table)  # the table is back
    assert env.wait(run_id).output == "receipt-6" and calls == Counter({"charge-6": 1})
    working, failing = app.seen_requests, DynamoSeenRequests("missing-table", client=replay_table)
    endpoint = env.invoker.apps["inproc://bound"]

    def failing_for_the_charge(method: str, headers: dict[str, str], body: bytes) -> Any:
        charge = TaskRequest.model_validate_json(body).step_id == "charge"
        app.seen_requests = failing if charge else working
        return endpoint(method, headers, body)

    env.invoker.apps["inproc://bound"] = failing_for_the_charge
    run_id = env.start("pay", 7)
    env.drive(horizon=__import__("datetime").timedelta(seconds=5))
    [attempt] = env.get(run_id).step("charge")["attempts"]
    assert attempt["status"] == "unknown" and "replay_check_unavailable" in attempt["detail"], attempt
    assert calls == Counter({"charge-6": 1})


# ---- review findings (the attack on b8c51d7) -------------------------------------------------------------------


def respelt(header: str, part: str) -> str:
    """``header`` with its timestamp moved on a second, or another key id: well-formed, and not the engine's."""
    pieces = dict(p.split("=", 1) for p in header.split(",")[1:])
    if part == "timestamp":
        pieces["t"] = str(int(pieces["t"]) + 1)
    else:
        pieces["k"] = "0" * 16
    return "v2," + ",".join(f"{k}={v}" for k, v in pieces.items())


@pytest.mark.parametrize("part", ["timestamp", "key id"])
@pytest.mark.parametrize("stopping", [False, True])
def test_a_refusal_of_a_respelt_copy_is_no_answer_to_the_real_request(part: str, stopping: bool) -> None:
    """A review relayed the engine's request (the charge ran), dropped the answer, sent the same body, nonce
    and HMAC again with another timestamp or key id, and handed the endpoint's signed refusal to the engine:
    it took it for "nothing ran" and charged again, or (with a cancel pending) settled the charge as never
    sent and skipped its refund. A refusal is now bound to the exact header that arrived."""
    calls: Counter[str] = Counter()
    app = Ryusen("bound", master_key=MASTER)

    @app.function("pay")
    def pay(data: Any, step: Step) -> Any:
        return step.run(
            "charge",
            lambda: calls.update(["charge"]) or "receipt",
            compensate=lambda receipt: calls.update(["refund"]),
        )

    env = signed_env(app)
    endpoint = env.invoker.apps["inproc://bound"]
    run_ids: list[str] = []
    refusals: list[HandlerResponse] = []

    def relaying(method: str, headers: dict[str, str], body: bytes) -> Any:
        if TaskRequest.model_validate_json(body).step_id != "charge" or calls["charge"]:
            return endpoint(method, headers, body)
        endpoint(method, headers, body)  # the charge runs; its answer is dropped
        if stopping:
            env.cancel(run_ids[0])
        copy = {**headers, SIGNATURE_HEADER: respelt(headers[SIGNATURE_HEADER], part)}
        refusal = endpoint(method, copy, body)
        refusals.append(refusal)  # checked below: an assertion here would be the engine's to swallow
        return refusal

    env.invoker.apps["inproc://bound"] = relaying
    run_ids.append(env.start("pay", 1))
    env.drive()
    run = env.get(run_ids[0])
    assert [(r.status, SIGNATURE_HEADER in r.headers) for r in refusals] == [(401, True)]  # signed, for the copy
    assert calls["charge"] == 1
    assert run.step("charge")["attempts"][0]["status"] == "unknown"  # not "never sent"
    if stopping:  # the Unknown blocks the compensation until someone decides: never a skipped refund
        assert run.phase == "settling" and [b["type"] for b in run.blockers] == ["unknown_outcome"]


@pytest.mark.parametrize("run_id", ["", "r" * 3000, "run\x00"])
def test_a_late_result_naming_no_possible_run_is_refused_before_anything_is_read(run_id: str) -> None:
    env = signed_env(charging_app(Counter()))
    before = dict(env.counter.counts)
    body = late_result("x").model_copy(update={"run_id": run_id}).model_dump_json().encode()
    with pytest.raises(SignatureRejectedError):
        env.engine.submit_late_result(body, {})
    assert env.counter.counts == before  # the store was not asked


def test_the_exact_request_played_back_after_the_window_is_not_a_refusal_that_makes_the_engine_resend() -> None:
    """A second review relayed the engine's request (the charge ran), held the engine's connection, and sent the
    identical request again after 300 s: the endpoint refused it as stale with a refusal bound to exactly the
    engine's request, which the engine took for "nothing ran" and charged again (or, under a cancel, skipped
    the refund). A stale request of this app's own is now answered ``stale_request``: not known."""
    calls: Counter[str] = Counter()
    app = charging_app(calls)
    env = signed_env(app)
    endpoint = env.invoker.apps["inproc://bound"]
    codes: list[str] = []

    def relaying_late(method: str, headers: dict[str, str], body: bytes) -> Any:
        if TaskRequest.model_validate_json(body).step_id != "charge" or calls:
            return endpoint(method, headers, body)
        endpoint(method, headers, body)  # the charge runs; its answer is dropped
        later = app.clock
        app.clock = lambda: later() + 301
        try:
            refusal = endpoint(method, headers, body)  # the identical request, past the window
        finally:
            app.clock = later
        codes.append(error_code(refusal))
        return refusal

    env.invoker.apps["inproc://bound"] = relaying_late
    run_id = env.start("pay", 8)
    env.drive()
    assert codes == ["stale_request"] and calls == Counter({"charge-8": 1})
    assert env.get(run_id).step("charge")["attempts"][0]["status"] == "unknown"


def test_the_replay_memory_never_forgets_a_request_that_could_still_verify() -> None:
    """A second review filled the in-process memory (100,000 requests in the window) and replayed a capture the
    memory had dropped to make room: it ran again. A full memory now runs nothing new instead."""
    from ryusen._internal.signing import ReplayCheckUnavailableError, SeenRequests, Signature

    seen = SeenRequests(most=3)
    first = Signature("0" * 16, 0, "0" * 32, "a" * 64)
    assert seen.first_time(first, 0.0)
    for digest in ("b", "c"):
        assert seen.first_time(Signature("0" * 16, 0, "0" * 32, digest * 64), 1.0)
    with pytest.raises(ReplayCheckUnavailableError):
        seen.first_time(Signature("0" * 16, 0, "0" * 32, "d" * 64), 2.0)
    assert not seen.first_time(first, 2.0)  # still remembered: a replay
    assert seen.first_time(Signature("0" * 16, 0, "0" * 32, "d" * 64), 601.0)  # the old ones have aged out

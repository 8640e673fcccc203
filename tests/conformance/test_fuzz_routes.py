"""Property-based fuzz of every server route and of the SDK endpoint (issue 11).

Hypothesis sends requests built from what broke things before (deep nesting, NaN and Infinity, lone
surrogates, huge numbers, odd ids and query strings, malformed signature headers) mixed with well-formed
ones, and checks after each: no answer of 500 or more, a refused request (4xx) changed nothing (runs,
their versions, releases), and a forged request to a keyed endpoint is refused.

CI runs a fixed budget (300 examples per test); explore longer with
    RYUSEN_FUZZ=2000 .venv/bin/pytest tests/conformance/test_fuzz_routes.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import time
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ryusen import Ryusen, Step
from ryusen._internal.signing import SIGNATURE_HEADER, app_key, sign
from ryusen._internal.wire import LateResult, Phase, TaskRequest, json_value_problem, late_result_scope, task_scope
from ryusen.testing import WorkflowEnvironment
from ryusen_server.api import build_api
from ryusen_server.engine import SignatureRejectedError
from tests.conformance.test_security_and_bad_input import rest_event

EXAMPLES = int(os.environ.get("RYUSEN_FUZZ", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
KEY = "fuzz-signing-key-0123456789abcdef0123"

ids = st.one_of(
    st.sampled_from(["wf", "fuzz-app", "run_000001", "s", "café", "", "..", "%2F", "a/b", "\u202e", "x" * 300]),
    st.text(min_size=0, max_size=40),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
)
signature_headers = st.one_of(
    st.none(),
    st.text(max_size=80),
    st.just("t=1,v1=" + "0" * 64),  # the old scheme's shape
    st.builds(  # well-formed, with a made-up key id, time, nonce and HMAC
        lambda k, t, n, d: f"v2,k={k},t={t},n={n},s={d}",
        st.text("0123456789abcdef", min_size=16, max_size=16),
        st.integers(min_value=0, max_value=10**12),
        st.text("0123456789abcdef", min_size=32, max_size=32),
        st.text("0123456789abcdef", min_size=64, max_size=64),
    ),
)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
)


@st.composite
def raw_json(draw: st.DrawFn) -> str:
    """JSON text, sometimes with what Python's json would write but JSON has not (NaN, lone surrogates,
    nesting past the limit, numbers past int's digits)."""
    kind = draw(st.sampled_from(["value", "value", "deep", "surrogate", "bignum", "garbage"]))
    if kind == "deep":
        depth = draw(st.integers(min_value=100, max_value=3000))
        return '{"input": ' + "[" * depth + "]" * depth + "}"
    if kind == "surrogate":
        high = draw(st.integers(min_value=0, max_value=255))
        return f'{{"input": "\\ud8{high:02x}", "reason": "\\udc00"}}'
    if kind == "bignum":
        return '{"input": ' + "9" * draw(st.integers(min_value=10, max_value=6000)) + "}"
    if kind == "garbage":
        return draw(st.text(max_size=60))
    body = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "input": json_values,
                "timeout_s": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.text()),
                "idempotency_key": st.one_of(ids, st.integers()),
                "url": st.one_of(
                    st.sampled_from(["http://169.254.169.254/", "http://127.0.0.1:1/", "ftp://x", "http://a b/"]),
                    st.text(max_size=30),
                ),
                "action": st.sampled_from(["succeed", "fail", "retry", "explode"]),
                "result": json_values,
                "error": st.one_of(
                    json_values, st.fixed_dictionaries({"type": ids, "message": ids, "data": json_values})
                ),
                "reason": st.one_of(st.text(max_size=30), st.integers()),
            },
        )
    )
    return json.dumps(body, allow_nan=True)


@st.composite
def nasty_value(draw: st.DrawFn) -> str:
    """One JSON value as text, of the kinds that broke the server before."""
    kind = draw(st.sampled_from(["deep", "deep_object", "surrogate", "constant", "bignum", "value"]))
    if kind == "deep":
        depth = draw(st.integers(min_value=120, max_value=3000))
        return "[" * depth + "]" * depth
    if kind == "deep_object":
        depth = draw(st.integers(min_value=120, max_value=400))
        return '{"a":' * depth + "1" + "}" * depth
    if kind == "surrogate":
        low = draw(st.integers(min_value=0, max_value=255))
        return f'"\\udc{low:02x}"'
    if kind == "constant":
        return draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "[NaN]", '{"x": Infinity}']))
    if kind == "bignum":
        return "9" * draw(st.integers(min_value=10, max_value=6000))
    return json.dumps(draw(json_values), allow_nan=True)


@st.composite
def nasty_body(draw: st.DrawFn) -> str:
    """A body whose fields are well named and whose value is nasty: what gets past parsing into a route."""
    field = draw(st.sampled_from(["input", "result", "reason", "timeout_s", "url", "error"]))
    value = draw(nasty_value())
    if field == "result":
        return f'{{"action": "succeed", "result": {value}}}'
    if field == "error":
        return f'{{"action": "fail", "error": {{"type": "x", "message": "y", "data": {value}}}}}'
    return f'{{"{field}": {value}}}'


ROUTES = [
    ("PUT", "/v1/apps/{a}", "fuzz-app"),
    ("GET", "/v1/functions", ""),
    ("POST", "/v1/functions/{a}/runs", "wf"),
    ("POST", "/v1/functions/{a}/runs", "wf"),
    ("GET", "/v1/runs", ""),
    ("GET", "/v1/runs/{a}", "run_000001"),
    ("POST", "/v1/runs/{a}/cancel", "run_000002"),
    ("POST", "/v1/runs/{a}/rediscover", "run_000001"),
    ("POST", "/v1/runs/{a}/steps/{b}/{c}/{d}/resolve", "run_000001"),
    ("POST", "/v1/results", ""),
    ("DELETE", "/v1/runs/{a}", "run_000001"),
]
"""(method, path, the id that reaches something: the fuzz uses it most of the time, so that what is past
routing (validation, the engine, the store) is what it tests)."""
AIMED = "\0aimed"


@pytest.fixture(scope="module")
def server() -> tuple[WorkflowEnvironment, Any, Ryusen]:
    app = Ryusen("fuzz-app")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        return step.run("s", lambda: data)

    env = WorkflowEnvironment(app)
    env.start("wf", {"seed": 1})  # runs to aim at, in flight: one to resolve and rediscover, one to cancel
    env.start("wf", {"seed": 2})
    return env, build_api(env.engine, lambda url: (app.manifest(), frozenset())), app


def state_of(env: WorkflowEnvironment) -> Any:
    runs = sorted((r["id"], env.store.get(r["id"]).version) for r in env.store.list_runs(limit=200).runs)  # type: ignore[union-attr]
    releases = sorted((r.app_id, r.release_id, str(r.synced_at)) for r in env.store.list_releases())
    return runs, releases


outcomes: Counter[str] = Counter()


@FUZZ
@given(
    route=st.sampled_from(ROUTES),
    a=st.one_of(st.just(AIMED), st.just(AIMED), ids),
    b=st.one_of(st.just(AIMED), ids),
    c=st.one_of(st.sampled_from(["forward", "compensation"]), ids),
    d=st.one_of(st.sampled_from(["1", "0", "-1", "99999999999999999999"]), ids),
    body=st.one_of(st.none(), raw_json(), nasty_body(), nasty_body()),
    query=st.dictionaries(
        st.sampled_from(["limit", "cursor", "phase", "outcome", "function_id", "x"]), st.text(max_size=20), max_size=3
    ),
    signature=signature_headers,
)
def test_no_route_answers_5xx_and_a_refused_request_changes_nothing(
    server: tuple[WorkflowEnvironment, Any, Ryusen],
    route: tuple[str, str, str],
    a: str,
    b: str,
    c: str,
    d: str,
    body: str | None,
    query: dict[str, str],
    signature: str | None,
) -> None:
    env, resolver, _ = server
    method, template, aimed = route
    path = template.format(a=aimed if a == AIMED else a, b="s" if b == AIMED else b, c=c, d=d)
    event = rest_event(method, path, body, query or None)
    if signature is not None:
        event["headers"] = {**(event.get("headers") or {}), SIGNATURE_HEADER: signature}
    before = state_of(env)
    result = resolver.resolve(event, None)
    status = int(result["statusCode"])
    outcomes[f"{status // 100}xx"] += 1
    assert status < 500, (method, path, body, result["body"][:500])
    payload = json.loads(result["body"])
    if status >= 400:
        assert isinstance(payload.get("error", {}).get("code"), str), payload
        assert state_of(env) == before, (method, path, body, payload)


def test_the_fuzz_reached_the_routes_and_some_requests_were_accepted() -> None:
    """The run above is worth something only if its requests got past routing and validation sometimes."""
    assert outcomes["2xx"] >= EXAMPLES // 20 and outcomes["4xx"] >= EXAMPLES // 2, outcomes


@FUZZ
@given(
    method=st.sampled_from(["POST", "GET", "PUT", "DELETE"]),
    body=st.one_of(st.binary(max_size=200), raw_json().map(str.encode), st.just(b"")),
    signature=signature_headers,
)
def test_a_keyed_endpoint_refuses_every_forged_task_and_never_fails(
    method: str, body: bytes, signature: str | None
) -> None:
    ran: list[str] = []
    app = Ryusen("fuzz-endpoint", signing_key=KEY)

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        return step.run("s", lambda: ran.append("s"))

    headers = {SIGNATURE_HEADER: signature} if signature is not None else {}
    response = app.handle(method, headers, body)
    assert response.status < 500, response.body[:300]
    if method == "POST":
        assert response.status == 401 and ran == [], response.body[:300]


# ---- genuine messages, then moved: every copy and every re-targeted or cross-app one is refused --------------

MASTER = "fuzz-master-key-0123456789abcdef0123"
MUTATIONS = (
    "replayed",
    "replayed later",
    "another path",
    "another app",
    "another app holding this app's key",
    "another run",
    "another step",
    "another phase",
    "another generation",
    "signed by the master",
    "signed by another app's key",
    "an answer's signature",
    "body changed",
    "header changed",
    "stale",
)
moved: Counter[str] = Counter()


def attempt_request(run_id: str, step_id: str, phase: str, generation: int) -> TaskRequest:
    return TaskRequest.model_validate(
        {
            "kind": "forward" if phase == "forward" else "compensate",
            "run_id": run_id,
            "function_id": "wf",
            "step_id": step_id,
            "operation": {"id": f"op-{generation}", "phase": phase, "generation": generation},
        }
    )


@FUZZ
@given(
    run_id=st.text(min_size=1, max_size=12),
    step_id=st.sampled_from(["charge", "ship"]),
    phase=st.sampled_from(["forward", "compensation"]),
    generation=st.integers(min_value=1, max_value=50),
    path=st.sampled_from(["/", "/ryusen", "/api/tasks"]),
    mutation=st.sampled_from(MUTATIONS),
)
def test_a_signed_request_moved_anywhere_else_runs_nothing(
    run_id: str, step_id: str, phase: str, generation: int, path: str, mutation: str
) -> None:
    """The engine's genuine request runs once; a copy of it, or it moved to another path, app, attempt or
    direction, or signed by any key but this app's, is refused and runs nothing."""
    ran: list[str] = []

    def app_named(app_id: str, **keys: Any) -> Ryusen:
        app = Ryusen(app_id, **(keys or {"master_key": MASTER}))

        @app.function("wf")
        def wf(data: Any, step: Step) -> Any:
            return step.run(step_id, lambda: ran.append(app_id) or "done", compensate=lambda r: ran.append("undo"))

        return app

    shop = app_named("shop")
    request = attempt_request(run_id, step_id, phase, generation)
    body = request.model_dump_json().encode()
    key = app_key(MASTER, "shop")
    now = time.time()
    header = sign(key, task_scope(request, path=path, app_id="shop"), body, now=now, nonce=secrets.token_hex(16))
    genuine = shop.handle("POST", {SIGNATURE_HEADER: header}, body, path=path)
    assert genuine.status == 200 and ran, genuine.body[:300]
    ran.clear()
    target, sent_path, sent_body, sent_header = shop, path, body, header
    other = attempt_request(run_id, step_id, phase, generation)
    if mutation == "replayed":
        pass
    elif mutation == "replayed later":
        shop.clock = lambda: now + 250  # inside the skew window
    elif mutation == "another path":
        sent_path = path + "x"
    elif mutation == "another app":
        target = app_named("billing")
    elif mutation == "another app holding this app's key":
        target = app_named("billing", signing_key=key)
    elif mutation in ("another run", "another step", "another phase", "another generation"):
        field = mutation.removeprefix("another ")
        operation = other.operation
        assert operation is not None
        if field == "run":
            other = other.model_copy(update={"run_id": run_id + "x"})
        elif field == "step":
            other = other.model_copy(update={"step_id": "ship" if step_id == "charge" else "charge"})
        elif field == "phase":
            flipped = "forward" if phase == "compensation" else "compensation"
            other = attempt_request(run_id, step_id, flipped, generation)
        else:
            other = attempt_request(run_id, step_id, phase, generation + 1)
        sent_body = other.model_dump_json().encode()  # under the genuine request's signature
    elif mutation in ("signed by the master", "signed by another app's key", "an answer's signature"):
        scope = task_scope(request, path=path, app_id="shop")
        signer = {"signed by the master": MASTER, "signed by another app's key": app_key(MASTER, "billing")}
        if mutation == "an answer's signature":
            sent_header = sign(key, scope.answer(), body, now=now, nonce=secrets.token_hex(16))
        else:
            sent_header = sign(signer[mutation], scope, body, now=now, nonce=secrets.token_hex(16))
    elif mutation == "body changed":
        sent_body = body.replace(b"}", b" }", 1)
    elif mutation == "header changed":
        digest = header.rsplit("s=", 1)[1]
        sent_header = header[: -len(digest)] + ("0" if digest[0] != "0" else "1") + digest[1:]
    elif mutation == "stale":
        target = app_named("shop")
        sent_header = sign(key, task_scope(request, path=path, app_id="shop"), body, now=now - 301, nonce="1" * 32)
    refused = target.handle("POST", {SIGNATURE_HEADER: sent_header}, sent_body, path=sent_path)
    assert refused.status == 401 and ran == [], (mutation, refused.status, refused.body[:300])
    moved[mutation] += 1


def test_every_kind_of_moved_message_was_tried() -> None:
    """The run above counts only if it tried each way of moving a message (and all of them were refused)."""
    assert set(moved) == set(MUTATIONS), moved


LATE_MUTATIONS = ("genuine", "another run", "another generation", "another phase", "another path", "another app")
late_moved: Counter[str] = Counter()


@settings(FUZZ, max_examples=max(60, EXAMPLES // 5))  # each example drives a run: a fifth of the budget
@given(
    mutation=st.sampled_from(LATE_MUTATIONS),
    result=json_values.filter(lambda v: json_value_problem(v) is None),
)
def test_a_late_result_is_accepted_only_as_the_app_signed_it(mutation: str, result: Any) -> None:
    """A late result signed by the run's app for its attempt is accepted; the same signature over another
    run, attempt or route, or by another app's key, is refused and changes nothing."""
    calls: Counter[str] = Counter()
    apps = []
    for app_id in ("shop", "billing"):
        app = Ryusen(app_id, master_key=MASTER)
        app.function(f"pay-{app_id}")(
            lambda data, step, app_id=app_id: step.run("charge", lambda: calls.update([app_id]) or "receipt")
        )
        apps.append(app)
    env = WorkflowEnvironment()
    env.engine.settings = dataclasses.replace(env.engine.settings, master_key=MASTER)
    for app in apps:
        env.sync(app)
    env.faults.lose_result("charge")
    run_id = env.start("pay-shop")
    env.drive()
    late = LateResult.model_validate(
        {
            "run_id": run_id,
            "step_id": "charge",
            "phase": "forward",
            "generation": 1,
            "attempt": {"type": "succeeded", "result": result},
        }
    )
    scope = late_result_scope(late, path="/v1/results", app_id="shop")
    key = app_key(MASTER, "shop")
    sent = late
    if mutation == "another run":
        sent = late.model_copy(update={"run_id": run_id + "0"})
    elif mutation == "another generation":
        sent = late.model_copy(update={"generation": 2})
    elif mutation == "another phase":
        sent = late.model_copy(update={"phase": Phase.COMPENSATION})
    elif mutation == "another path":
        scope = dataclasses.replace(scope, path="/v1/runs")
    elif mutation == "another app":
        key = app_key(MASTER, "billing")
    body = sent.model_dump_json().encode()
    signed = sign(
        key,
        scope,
        late.model_dump_json().encode() if mutation != "another app" else body,
        now=time.time(),
        nonce=secrets.token_hex(16),
    )
    before = env.engine.get_run(run_id).version
    if mutation == "genuine":
        env.engine.submit_late_result(body, {SIGNATURE_HEADER: signed})
        assert env.get(run_id).step("charge")["attempts"][0]["status"] == "succeeded"
    else:
        with pytest.raises(SignatureRejectedError):
            env.engine.submit_late_result(body, {SIGNATURE_HEADER: signed})
        assert env.engine.get_run(run_id).version == before
    late_moved[mutation] += 1


def test_every_kind_of_moved_late_result_was_tried() -> None:
    assert set(late_moved) == set(LATE_MUTATIONS), late_moved

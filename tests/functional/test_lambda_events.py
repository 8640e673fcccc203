"""Way C of docs/design/dispatch.md: a Lambda endpoint takes attempts as asynchronous events.

The server sends an attempt's signed request to the app's function with ``InvocationType=Event`` and waits for
nothing. These tests hold the SDK's side (``FreezingLambda`` from test_lambda_endpoint: the handler must have
posted the outcome before it returns, with nothing left running) and the server's (what it records at sync, and
what each answer of Lambda's API means for the attempt). The whole path, the event sent by the dispatcher and
by the result function, runs in the stack in a box (tests/infra/test_stack_in_a_box.py).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from ryusen import Ryusen, Step
from ryusen._internal.app import features
from ryusen._internal.signing import SeenRequests, Signature
from ryusen._internal.wire import FEATURES_HEADER, LAMBDA_EVENT_MARKER, TaskKind, TaskRequest
from ryusen.testing import WorkflowEnvironment
from ryusen_server.aws.lambda_events import LambdaEventInvoker
from ryusen_server.ports import InvalidRequestError
from tests.functional.test_lambda_endpoint import APP_ID, KEY, FreezingLambda, attempt, lambdas, signed_event  # noqa: F401
from tests.lambda_http import LambdaContext

ARN = "arn:aws:lambda:us-east-1:123456789012:function:shop"


class SharedSeen:
    """A replay memory every container shares (as DynamoSeenRequests is), in one process here."""

    shared = True

    def __init__(self) -> None:
        self.inner = SeenRequests()

    def first_time(self, signature: Signature, now: float) -> bool:
        return self.inner.first_time(signature, now)


def context(arn: str = ARN) -> LambdaContext:
    made = LambdaContext(900.0)
    made.invoked_function_arn = arn
    return made


def manifest_features(app: Ryusen, ctx: Any) -> list[str]:
    event = {
        "version": "2.0",
        "rawPath": "/",
        "headers": {},
        "requestContext": {"http": {"method": "GET", "path": "/"}},
    }
    answer = app.lambda_handler(event, ctx)
    return str(answer["headers"][FEATURES_HEADER]).split(",")


def test_a_lambda_endpoint_announces_lambda_event_only_with_a_replay_memory_its_containers_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lambda may deliver an event twice, and its copies may land on different containers: only a replay memory
    they share refuses the second. Without one, the endpoint stays waited on (as before)."""
    monkeypatch.setenv("AWS_LAMBDA_FUNCTION_NAME", "shop")
    shared = Ryusen(APP_ID, signing_key=KEY, seen_requests=SharedSeen())
    alone = Ryusen(APP_ID, signing_key=KEY)  # the process's own memory
    assert f"lambda_event={ARN}" in manifest_features(shared, context())
    assert not [f for f in manifest_features(alone, context()) if f.startswith("lambda_event")]
    assert "acknowledge" not in manifest_features(shared, context())  # Lambda freezes: never "accepted" inline
    monkeypatch.setenv("RYUSEN_LAMBDA_EVENTS", "0")
    assert not [f for f in manifest_features(shared, context()) if f.startswith("lambda_event")]
    monkeypatch.delenv("RYUSEN_LAMBDA_EVENTS")
    not_an_arn = context("ryusen-test")
    assert not [f for f in manifest_features(shared, not_an_arn) if f.startswith("lambda_event")]
    monkeypatch.delenv("AWS_LAMBDA_FUNCTION_NAME")
    assert not [f for f in features(None, shared_replay=True) if f.startswith("lambda_event")]  # not on Lambda


def event_for(request: TaskRequest) -> dict[str, Any]:
    """The event the server sends: the Function URL event it would have sent, marked as one nobody waits on."""
    return {LAMBDA_EVENT_MARKER: 1, **signed_event(request)}


def invoke_event(runtime: FreezingLambda, event: dict[str, Any]) -> dict[str, Any]:
    before = set(threading.enumerate())
    runtime.frozen = False
    try:
        result: dict[str, Any] = runtime.app.lambda_handler(event, context())
    finally:
        runtime.frozen = True
        runtime.left_running = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    return result


def shop_app(ran: list[str]) -> Ryusen:
    app = Ryusen(APP_ID, signing_key=KEY, seen_requests=SharedSeen())

    @app.function("f")
    def f(data: Any, step: Step) -> Any:
        def ship() -> str:
            ran.append("ship")
            time.sleep(0.3)
            return "shipped"

        return [step.run("ship", ship), step.run("notify", lambda: "sent")]

    return app


def test_an_attempt_event_runs_and_posts_its_outcome_with_the_next_step_before_the_handler_returns(
    lambdas: Callable[[Ryusen], FreezingLambda],  # noqa: F811
) -> None:
    """Nobody listens for an event's answer: the handler runs the attempt on its own thread, posts the outcome
    (with what the replay found next, and its build) to the result URL, and only then returns, with nothing left
    running at the freeze."""
    ran: list[str] = []
    runtime = lambdas(shop_app(ran))
    result = invoke_event(runtime, event_for(attempt("ship", result_url=runtime.result_url)))
    assert runtime.left_running == [], f"still running at the freeze: {runtime.left_running}"
    assert result["statusCode"] == 202 and json.loads(result["body"])["accepted"] is True
    assert ran == ["ship"]
    [(frozen, posted)] = runtime.late
    assert frozen is False, "the outcome was posted after the handler returned"
    assert posted["attempt"] == {"type": "succeeded", "result": "shipped"}
    assert posted["next"]["type"] == "step" and posted["next"]["step"]["id"] == "notify"
    assert posted["build_id"] == runtime.app.build_id


def test_a_copy_of_an_event_delivered_again_runs_nothing(
    lambdas: Callable[[Ryusen], FreezingLambda],  # noqa: F811
) -> None:
    """Lambda's async queue may deliver an event twice (and retries one whose invocation failed). The copy carries
    the same signed request, which the shared replay memory has seen: it is refused before any user code."""
    ran: list[str] = []
    runtime = lambdas(shop_app(ran))
    event = event_for(attempt("ship", result_url=runtime.result_url))
    first = invoke_event(runtime, event)
    again = invoke_event(runtime, json.loads(json.dumps(event)))
    assert first["statusCode"] == 202
    assert again["statusCode"] == 401 and json.loads(again["body"])["error"]["code"] == "replayed_request"
    assert ran == ["ship"], "the effect ran twice"
    assert len(runtime.late) == 1


def test_an_event_that_is_not_an_attempt_runs_nothing(
    lambdas: Callable[[Ryusen], FreezingLambda],  # noqa: F811
) -> None:
    """A discovery pass has no result URL route for its answer: the server never sends one as an event, and one
    that arrives anyway runs no user code and posts nothing."""
    ran: list[str] = []
    runtime = lambdas(shop_app(ran))
    discovery = TaskRequest(kind=TaskKind.DISCOVER, run_id="run_1", function_id="f", input={}, memo={})
    result = invoke_event(runtime, event_for(discovery))
    assert result["statusCode"] == 400 and json.loads(result["body"])["error"]["code"] == "not_an_attempt_event"
    assert ran == [] and runtime.late == []


def test_a_lambda_event_announced_with_something_else_than_an_arn_is_refused_and_nothing_recorded() -> None:
    app = Ryusen("events-app")

    @app.function("g")
    def g(data: Any, step: Step) -> Any:
        return step.run("a", lambda: 1)

    with WorkflowEnvironment() as env:
        manifest = app.manifest()
        with pytest.raises(InvalidRequestError) as refused:
            env.engine.sync_release(
                "events-app", "https://example.com/", manifest, frozenset({"signing_v2", "lambda_event=not-an-arn"})
            )
        assert refused.value.details["code"] == "invalid_lambda_function_arn"
        assert env.engine.store.get_release("g") is None
        release = env.engine.sync_release(
            "events-app", "https://example.com/", manifest, frozenset({"signing_v2", f"lambda_event={ARN}"})
        )
        assert release.lambda_function_arn == ARN and "lambda_event" in release.features
        assert env.engine.store.get_release("g") == release


class StubLambda:
    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome
        self.calls: list[dict[str, Any]] = []

    def invoke(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


def client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Invoke")


@pytest.mark.parametrize(
    ("outcome", "kind"),
    [
        ({"StatusCode": 202}, "queued"),
        (client_error("TooManyRequestsException", 429), "unreachable"),  # not queued: sent again later
        (client_error("ResourceConflictException", 409), "unreachable"),
        (client_error("AccessDeniedException", 403), "refused"),  # no grant: the URL instead
        (client_error("ResourceNotFoundException", 404), "refused"),
        (client_error("RequestTooLargeException", 413), "refused"),
        (client_error("ServiceException", 500), "lost"),  # it may have been queued: not known
        (EndpointConnectionError(endpoint_url="https://lambda"), "unreachable"),
        (ReadTimeoutError(endpoint_url="https://lambda"), "lost"),
        ({"StatusCode": 200}, "lost"),  # not what an event is answered with
    ],
)
def test_what_each_answer_of_lambdas_api_means_for_the_attempt(outcome: Any, kind: str) -> None:
    stub = StubLambda(outcome)
    result = LambdaEventInvoker(stub).invoke_event(ARN, b"{}")
    assert result.kind == kind, result
    assert stub.calls == [{"FunctionName": ARN, "InvocationType": "Event", "Payload": b"{}"}]

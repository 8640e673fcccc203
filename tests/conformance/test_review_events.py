"""Review of way C (attempts sent to a Lambda endpoint as asynchronous events), through the engine and the SDK.

The harness: the engine of ``ryusen.testing`` (virtual clock, in-process queue) with an event invoker standing in
for Lambda's async queue (``LambdaQueue``: an ``Invoke`` queues the event; ``pump`` runs the queued events through
the app's real ``lambda_handler``), and a loopback result URL whose posts go to ``Engine.submit_result`` as the
result function's do. The app holds its own key (derived from the environment's master) and a replay memory its
"containers" share, so it takes attempts as events exactly as on AWS.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

from ryusen import Ryusen, Step
from ryusen._internal.app import features
from ryusen._internal.signing import app_key
from ryusen._internal.wire import LAMBDA_EVENT_MARKER
from ryusen.testing import WorkflowEnvironment
from ryusen_server.ports import InvokeResult, RequestCounter, ServerError
from ryusen_server.wiring import AwsResources, event_invoker
from tests.functional.test_lambda_events import SharedSeen
from tests.lambda_http import LambdaContext

APP = "evshop"
ARN = f"arn:aws:lambda:us-east-1:123456789012:function:{APP}"


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


class LambdaQueue:
    """Lambda's asynchronous queue for the app's function (an ``EventInvoker``): ``invoke_event`` queues the event
    and answers "queued" (or what ``answers`` says next); ``pump`` runs what is queued through the app's
    ``lambda_handler``, as Lambda would, and records what each invocation returned."""

    def __init__(self, app: Ryusen) -> None:
        self.app = app
        self.queued: list[dict[str, Any]] = []
        self.sent: list[dict[str, Any]] = []
        """Every event ever queued (its parsed body too, as ``request``)."""
        self.answers: list[InvokeResult] = []
        """What the next Invokes answer instead of queuing (``refused``, ``unreachable``...); ``lost_but_queued``
        entries queue the event and answer ``lost``."""
        self.returned: list[dict[str, Any]] = []

    def invoke_event(self, function_arn: str, payload: bytes) -> InvokeResult:
        assert function_arn == ARN
        if self.answers:
            answer = self.answers.pop(0)
            if answer.detail != "lost_but_queued":
                return answer
            self.queue(payload)
            return InvokeResult(kind="lost", status=500, detail="Lambda answered 500 (ServiceException)")
        self.queue(payload)
        return InvokeResult(kind="queued", status=202)

    def queue(self, payload: bytes) -> None:
        event = json.loads(payload)
        self.queued.append(event)
        self.sent.append({**event, "request": json.loads(event["body"])})

    def pump(self, *, once: bool = False) -> int:
        """Run every queued event (and those their outcomes queue; ``once``: only those queued now); how many
        ran."""
        ran = 0
        limit = len(self.queued) if once else None
        while self.queued and (limit is None or ran < limit):
            event = self.queued.pop(0)
            context = LambdaContext(900.0)
            context.invoked_function_arn = ARN
            self.returned.append(self.app.lambda_handler(event, context))
            ran += 1
        return ran

    def steps_sent(self) -> list[tuple[str | None, str, int | None]]:
        """(step id, kind, generation) of every event sent."""
        out = []
        for e in self.sent:
            r = e["request"]
            out.append((r.get("step_id"), r["kind"], (r.get("operation") or {}).get("generation")))
        return out


class Harness:
    def __init__(self, app_factory: Callable[[str], Ryusen], monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("AWS_LAMBDA_FUNCTION_NAME", APP)
        self.env = WorkflowEnvironment()
        assert self.env.master_key is not None
        self.app = app_factory(app_key(self.env.master_key, APP))
        self.env.sync(self.app)
        self.lam = LambdaQueue(self.app)
        self.results: list[tuple[int, dict[str, Any]]] = []
        self.server = make_server("127.0.0.1", 0, self._results, handler_class=_Quiet)
        self.result_url = f"http://127.0.0.1:{self.server.server_port}/v1/results"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        engine = self.env.engine
        engine.settings = dataclasses.replace(engine.settings, result_url=self.result_url)
        engine.event_invoker = self.lam
        self.sync()

    def sync(self) -> None:
        """Sync the app as its Lambda handler announces itself: with ``lambda_event=<its ARN>``."""
        context = LambdaContext(900.0)
        context.invoked_function_arn = ARN
        answer = self.app.lambda_handler(
            {"version": "2.0", "rawPath": "/", "headers": {}, "requestContext": {"http": {"method": "GET"}}},
            context,
        )
        announced = frozenset(answer["headers"]["X-Ryusen-Features"].split(","))
        assert f"lambda_event={ARN}" in announced, announced
        self.env.engine.sync_release(APP, f"inproc://{APP}", self.app.manifest(), announced)

    def _results(self, environ: dict[str, Any], start_response: Any) -> Any:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length)
        headers = {k[5:].replace("_", "-").lower(): v for k, v in environ.items() if k.startswith("HTTP_")}
        status = 200
        try:
            self.env.engine.submit_result(body, headers, path=environ["PATH_INFO"])
        except ServerError as exc:
            status = exc.status
        self.results.append((status, json.loads(body)))
        start_response(f"{status} X", [("Content-Type", "application/json")])
        return [b"{}"]

    def settle(self, run_id: str, *, rounds: int = 50) -> Any:
        """Deliver what is due now and run the queued events, until neither is left; then let the virtual clock
        go on (leases, timers) once, and again, until the run finishes or nothing moves it."""
        for _ in range(rounds):
            moved = True
            while moved:
                moved = False
                while self.env.step_once():
                    moved = True
                if self.lam.pump():
                    moved = True
            if self.env._peek(run_id).phase.value == "finished":
                break
            due = self.env.next_due()
            if due is None:
                break
            self.env.clock.advance_to(due)
        return self.env.get(run_id)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.env.close()


def shop(ran: list[str], *, compensate: bool = False, fail_after: bool = False) -> Callable[[str], Ryusen]:
    def make(key: str) -> Ryusen:
        app = Ryusen(APP, signing_key=key, seen_requests=SharedSeen())

        def undo(name: str) -> Callable[[Any], Any] | None:
            if not compensate:
                return None

            def back(result: Any) -> Any:
                ran.append(f"undo-{name}")
                return {"undone": name}

            return back

        def effect(name: str) -> str:
            ran.append(name)
            return f"{name}-done"

        @app.function("buy")
        def buy(data: Any, step: Step) -> Any:
            first = step.run("reserve", effect, "reserve", compensate=undo("reserve"))
            second = step.run("charge", effect, "charge", compensate=undo("charge"))
            if fail_after:
                raise RuntimeError("the order was refused")
            return [first, second]

        return app

    return make


@pytest.fixture
def harness(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(app_factory: Callable[[str], Ryusen]) -> Harness:
        made.append(Harness(app_factory, monkeypatch))
        return made[-1]

    yield make
    for h in made:
        h.close()


def statuses(run: Any, phase: str = "forward") -> dict[str, list[str]]:
    """Each step's attempts' statuses in ``phase``."""
    return {s["id"]: [a["status"] for a in run.attempts(s["id"], phase)] for s in run.steps}


# ---- checked properties (these pass) --------------------------------------------------------------------------


def test_harness_every_attempt_goes_as_an_event_and_each_effect_runs_once(harness: Callable[..., Harness]) -> None:
    ran: list[str] = []
    h = harness(shop(ran))
    run_id = h.env.start("buy", {})
    run = h.settle(run_id)
    assert run.outcome == "completed", run.summary
    assert ran == ["reserve", "charge"]
    assert h.lam.steps_sent() == [("reserve", "forward", 1), ("charge", "forward", 1)]
    assert [r["statusCode"] for r in h.lam.returned] == [202, 202]
    assert [s for s, _ in h.results] == [200, 200]


def test_a_duplicated_dispatch_message_never_sends_a_second_event_while_one_is_queued(
    harness: Callable[..., Harness],
) -> None:
    """Every queue message is delivered twice (SQS at-least-once, or a stale copy): while the attempt's event waits
    in Lambda's queue, the copy finds the attempt authorized and in its lease, and sends nothing."""
    ran: list[str] = []
    h = harness(shop(ran))
    h.env.faults.duplicate_messages = True
    run_id = h.env.start("buy", {})
    while h.env.step_once():  # every copy delivered, no event run yet
        pass
    assert h.lam.steps_sent() == [("reserve", "forward", 1)]
    run = h.settle(run_id)
    assert run.outcome == "completed", run.summary
    assert ran == ["reserve", "charge"]
    assert h.lam.steps_sent() == [("reserve", "forward", 1), ("charge", "forward", 1)]


def test_a_run_cancelled_while_its_attempts_event_is_queued_waits_for_it_and_compensates_by_events(
    harness: Callable[..., Harness],
) -> None:
    """RFD: an authorized effectful attempt must settle before reverse recovery. The run is cancelled while the
    first step's event waits in Lambda's queue: the event still runs, its outcome is taken, no forward work follows,
    and the step's compensation is itself sent as an event and runs once."""
    ran: list[str] = []
    h = harness(shop(ran, compensate=True))
    run_id = h.env.start("buy", {})
    while h.env.step_once():
        pass
    assert h.lam.steps_sent() == [("reserve", "forward", 1)] and ran == []
    h.env.cancel(run_id)
    while h.env.step_once():
        pass
    assert h.env.get(run_id).phase != "finished"  # it waits for the queued attempt
    run = h.settle(run_id)
    assert run.summary == "cancelled, fully compensated", run.summary
    assert ran == ["reserve", "undo-reserve"]
    assert h.lam.steps_sent() == [("reserve", "forward", 1), ("reserve", "compensate", 1)]
    assert statuses(run) == {"reserve": ["succeeded"]}


def test_a_compensation_sent_as_an_event_runs_once_and_its_outcome_advances_the_unwind(
    harness: Callable[..., Harness],
) -> None:
    ran: list[str] = []
    h = harness(shop(ran, compensate=True, fail_after=True))
    run = h.settle(h.env.start("buy", {}))
    assert run.summary == "failed, fully compensated", run.summary
    assert ran == ["reserve", "charge", "undo-charge", "undo-reserve"]
    kinds = [k for _, k, _ in h.lam.steps_sent()]
    assert kinds == ["forward", "forward", "compensate", "compensate"]
    assert statuses(run, "compensation") == {"reserve": ["succeeded"], "charge": ["succeeded"]}


def test_an_event_lambda_refuses_goes_once_to_the_url_with_the_same_request(harness: Callable[..., Harness]) -> None:
    ran: list[str] = []
    h = harness(shop(ran))
    h.lam.answers = [InvokeResult(kind="refused", status=403, detail="Lambda refused the event (AccessDenied)")]
    run = h.settle(h.env.start("buy", {}))
    assert run.outcome == "completed", run.summary
    assert ran == ["reserve", "charge"]
    assert h.lam.steps_sent() == [("charge", "forward", 1)]  # reserve went to the URL instead


def test_an_event_lambda_did_not_queue_is_sent_again_and_runs_once(harness: Callable[..., Harness]) -> None:
    ran: list[str] = []
    h = harness(shop(ran))
    h.lam.answers = [InvokeResult(kind="unreachable", status=429, detail="Lambda did not queue it")]
    run = h.settle(h.env.start("buy", {}))
    assert run.outcome == "completed", run.summary
    assert ran == ["reserve", "charge"]
    assert statuses(run) == {"reserve": ["succeeded"], "charge": ["succeeded"]}


def test_a_lost_invoke_is_unknown_is_not_sent_again_and_its_late_outcome_settles_it(
    harness: Callable[..., Harness],
) -> None:
    ran: list[str] = []
    h = harness(shop(ran))
    h.lam.answers = [InvokeResult(kind="lost", detail="lost_but_queued")]
    run_id = h.env.start("buy", {})
    while h.env.step_once():
        pass
    assert statuses(h.env.get(run_id))["reserve"] == ["unknown"]
    run = h.settle(run_id)
    assert run.outcome == "completed", run.summary
    assert ran == ["reserve", "charge"]
    assert h.lam.steps_sent() == [("reserve", "forward", 1), ("charge", "forward", 1)]


def test_an_event_refused_as_stale_is_unknown_at_its_lease_not_stuck(
    harness: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event waited in Lambda's queue past the signature's window: refused before any user code, nothing posted.
    The attempt is not left authorized for ever: its lease timer takes it as Unknown."""
    ran: list[str] = []
    h = harness(shop(ran))
    run_id = h.env.start("buy", {})
    while h.env.step_once():
        pass
    real = h.app.clock
    h.app.clock = lambda: real() + 400.0  # the event runs 400 s after it was signed
    assert h.lam.pump() == 1
    assert h.lam.returned[-1]["statusCode"] == 401 and "stale_request" in h.lam.returned[-1]["body"]
    h.app.clock = real
    run = h.settle(run_id)
    assert ran == [] and h.results == []
    assert statuses(run)["reserve"] == ["unknown"]
    assert [b["type"] for b in run.blockers] == ["unknown_outcome"]


def test_an_event_the_result_function_sent_and_that_never_runs_is_unknown_at_its_lease(
    harness: Callable[..., Harness],
) -> None:
    """The result function records the first outcome and sends the next attempt as an event itself; no queue
    message carries that attempt. Lambda drops the event: the lease timer the result function sent takes it as
    Unknown (not left for the sweeper's 15 minutes)."""
    ran: list[str] = []
    h = harness(shop(ran))
    run_id = h.env.start("buy", {})
    while h.env.step_once():
        pass
    h.lam.pump(once=True)  # reserve runs; its outcome, posted, has the result function queue charge's event
    assert h.lam.steps_sent() == [("reserve", "forward", 1), ("charge", "forward", 1)]
    h.lam.queued.clear()  # Lambda loses charge's event
    run = h.settle(run_id)
    assert ran == ["reserve"]
    [charge] = run.attempts("charge")
    assert charge["status"] == "unknown"
    assert charge["unknown"]["at"] == charge["lease_expires_at"], "not taken at its lease (only the sweeper noticed)"


def test_an_event_without_a_valid_signature_runs_nothing_and_returns(harness: Callable[..., Harness]) -> None:
    ran: list[str] = []
    h = harness(shop(ran))
    run_id = h.env.start("buy", {})
    while h.env.step_once():
        pass
    [event] = h.lam.queued
    forged = json.loads(json.dumps(event))
    forged["headers"] = {k: v for k, v in forged["headers"].items() if k != "x-ryusen-signature"}
    tampered = json.loads(json.dumps(event))
    body = json.loads(tampered["body"])
    body["input"] = {"tampered": True}
    tampered["body"] = json.dumps(body)
    context = LambdaContext(900.0)
    context.invoked_function_arn = ARN
    for bad in (forged, tampered):
        answer = h.app.lambda_handler(bad, context)
        assert answer["statusCode"] == 401, answer
    assert ran == [] and h.results == []
    run = h.settle(run_id)  # the genuine event still runs: the forgeries did not burn its nonce
    assert run.outcome == "completed" and ran == ["reserve", "charge"]


# ---- findings (these fail today) ---------------------------------------------------------------------------------


class _Raw:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.body


class BotoLambda:
    """The engine's real event invoker (``wiring.event_invoker``: a botocore Lambda client with standard retries),
    whose HTTP tries are played from ``script`` (then: queued, 202), each try that reaches Lambda's queue putting
    the event in ``lam``:

    - ``"queued, read timeout"``: Lambda queued the event, and its answer never came back;
    - ``"connect"``: the connection could not be made (nothing reached Lambda);
    - ``"throttled"``: Lambda answered 429 TooManyRequestsException (nothing queued by this try)."""

    def __init__(self, lam: LambdaQueue | None, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.setenv(name, "testing")
        monkeypatch.setattr("botocore.retries.standard.ExponentialBackoff.delay_amount", lambda self, ctx: 0.0)
        resources = AwsResources(
            table_name="t", queue_url="q", queue_arn="a", schedule_group="g", scheduler_role_arn="r"
        )
        self.invoker = event_invoker(resources, RequestCounter())
        self.lam = lam
        self.script: list[str] = []
        self.tries = 0
        self.reached_queue = 0
        self.invoker._client.meta.events.register("before-send.lambda.Invoke", self._send)

    def _send(self, request: Any, **_: Any) -> AWSResponse:
        self.tries += 1
        step = self.script.pop(0) if self.script else "queued"
        if step == "connect":
            raise EndpointConnectionError(endpoint_url=request.url)
        if step == "connect timeout":
            raise ConnectTimeoutError(endpoint_url=request.url)
        if step == "throttled":
            body = json.dumps({"Type": "User", "message": "Rate exceeded"}).encode()
            headers = {"x-amzn-ErrorType": "TooManyRequestsException", "content-type": "application/json"}
            return AWSResponse(request.url, 429, headers, _Raw(body))
        self.reached_queue += 1
        if self.lam is not None:
            self.lam.queue(request.body if isinstance(request.body, bytes) else request.body.read())
        if step == "queued, read timeout":
            raise ReadTimeoutError(endpoint_url=request.url)
        assert step == "queued", step
        return AWSResponse(request.url, 202, {}, _Raw(b""))


@pytest.mark.parametrize("then", ["connect", "connect timeout", "throttled"])
def test_an_invoke_whose_first_try_may_have_queued_the_event_is_never_reported_unreachable(
    then: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """wiring.event_invoker gives Lambda's client botocore's standard retries. The first try reaches Lambda, which
    queues the event, and its answer is lost (a read timeout); botocore tries again, and those tries fail to connect
    (a network partition) or are throttled. Whether the event was queued is not known: the answer must be ``lost``
    (Unknown), never ``unreachable``, which the engine takes as "nothing was sent" and answers by sending the same
    generation again, as a new event with a new nonce that the replay memory does not refuse."""
    boto = BotoLambda(None, monkeypatch)
    boto.script = ["queued, read timeout", then, then, then]
    result = boto.invoker.invoke_event(ARN, b"{}")
    assert boto.reached_queue == 1  # the event was queued, and its answer lost
    assert boto.tries == 1  # botocore does not try again: a retry that could not connect would hide the first
    assert result.kind != "unreachable", result
    assert result.kind == "lost", result


def test_an_invoke_retried_by_botocore_after_a_lost_answer_never_runs_the_effect_twice(
    harness: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[str] = []
    h = harness(shop(ran))
    boto = BotoLambda(h.lam, monkeypatch)
    h.env.engine.event_invoker = boto.invoker
    boto.script = ["queued, read timeout", "connect", "connect", "connect"]  # the first Invoke only
    run = h.settle(h.env.start("buy", {}))
    reserve_events = [g for s, k, g in h.lam.steps_sent() if s == "reserve"]
    assert ran.count("reserve") == 1, f"the effect ran {ran.count('reserve')} times ({reserve_events} events)"
    assert run.outcome == "completed", run.summary


def test_a_run_cancelled_during_an_invoke_whose_answer_was_lost_does_not_finish_before_its_effect_settles(
    harness: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """RFD: "Compensation starts only after every effectful attempt authorized before cancellation or timeout has a
    durable resolved outcome." The run is cancelled while the first attempt's Invoke is in flight (its first try
    queued the event; botocore's further tries could not connect)."""
    ran: list[str] = []
    h = harness(shop(ran, compensate=True))
    boto = BotoLambda(h.lam, monkeypatch)
    h.env.engine.event_invoker = boto.invoker
    run_id = h.env.start("buy", {})
    cancelled: list[bool] = []

    def cancel_then_time_out(request: Any, **_: Any) -> None:
        if not cancelled:
            cancelled.append(True)
            h.env.cancel(run_id)  # the API's cancel, while the dispatcher waits on Invoke

    boto.invoker._client.meta.events.register_first("before-send.lambda.Invoke", cancel_then_time_out)
    boto.script = ["queued, read timeout", "connect", "connect", "connect"]
    while h.env.step_once():
        pass
    finished_before = h.env.get(run_id).phase == "finished"
    run = h.settle(run_id)  # Lambda runs the queued event now
    assert ran[:1] == ["reserve"]  # the effect did happen
    assert not finished_before, "the run finished while its authorized attempt's event was still queued"
    assert run.summary == "cancelled, fully compensated", run.summary
    assert "undo-reserve" in ran


def _rotate_master_before_the_first_attempt_is_signed(h: Harness) -> str:
    """The engine moves to a new master (its secret rotated) before it signs the first attempt; the app still
    holds only its old key. Returns the app's new key, which the test gives it later (its redeploy)."""
    import secrets

    old_master = h.env.master_key
    assert old_master is not None
    new_master = secrets.token_hex(32)
    engine = h.env.engine

    def rotate(kind: str, payload: Any) -> None:
        # at the first invoke (the discovery pass, whose request was signed just before): the first attempt is
        # signed with the new master's key
        if kind == "invoke" and engine.settings.master_key == old_master:
            engine.settings = dataclasses.replace(engine.settings, master_key=f"{new_master},{old_master}")

    engine.hooks.append(rotate)
    return app_key(new_master, APP)


def test_control_mid_rotation_an_attempt_sent_to_the_url_is_refused_and_sent_again_never_unknown(
    harness: Callable[..., Harness],
) -> None:
    """docs/security.md, "Rotating": an app that still holds only the old key when the engine has moved on refuses
    the new requests with a refusal signed by its old key, "the attempts are sent again later, never Unknown".
    Holds on the URL (no events)."""
    ran: list[str] = []
    h = harness(shop(ran))
    h.env.engine.event_invoker = None
    new_key = _rotate_master_before_the_first_attempt_is_signed(h)
    run_id = h.env.start("buy", {})
    while h.env.step_once():
        pass
    assert ran == []  # refused: the app does not hold the key the engine signs with
    h.app._signing_keys = [new_key, *h.app._signing_keys]  # the app is given its new key
    run = h.settle(run_id)
    assert run.outcome == "completed", run.summary
    assert statuses(run) == {"reserve": ["succeeded"], "charge": ["succeeded"]}


def test_mid_rotation_an_attempt_sent_as_an_event_is_refused_and_sent_again_never_unknown(
    harness: Callable[..., Harness],
) -> None:
    ran: list[str] = []
    h = harness(shop(ran))
    new_key = _rotate_master_before_the_first_attempt_is_signed(h)
    run_id = h.env.start("buy", {})
    while h.env.step_once():
        pass
    h.lam.pump()
    # while the engine holds two keys for the app, its attempts go to the URL, where a refusal is heard: no event
    assert ran == [] and h.lam.sent == []
    h.app._signing_keys = [new_key, *h.app._signing_keys]  # the app is given its new key
    run = h.settle(run_id)
    assert statuses(run)["reserve"][-1] == "succeeded", statuses(run)
    assert "unknown" not in statuses(run)["reserve"], statuses(run)
    assert run.outcome == "completed", run.summary


def test_a_manifest_announcing_two_lambda_event_arns_is_refused() -> None:
    from ryusen_server.ports import InvalidRequestError

    app = Ryusen("two-arns")

    @app.function("g")
    def g(data: Any, step: Step) -> Any:
        return step.run("a", lambda: 1)

    other = "arn:aws:lambda:us-east-1:123456789012:function:someone-else"
    announced = frozenset({*features(None), f"lambda_event={ARN}", f"lambda_event={other}"})
    with WorkflowEnvironment() as env, pytest.raises(InvalidRequestError):
        env.engine.sync_release("two-arns", "https://example.com/", app.manifest(), announced)


MALFORMED = {
    "body_is_an_object": {"body": {"kind": "forward"}},
    "headers_are_a_list": {"headers": ["x-ryusen-signature"]},
    "body_is_not_base64": {"body": "%%%not base64%%%", "isBase64Encoded": True},
}


@pytest.mark.parametrize("shape", sorted(MALFORMED))
def test_a_malformed_task_event_is_logged_and_answered_not_raised(shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_LAMBDA_FUNCTION_NAME", APP)
    ran: list[str] = []
    app = shop(ran)("k" * 64)
    event = {
        LAMBDA_EVENT_MARKER: 1,
        "version": "2.0",
        "rawPath": "/",
        "headers": {},
        "requestContext": {"http": {"method": "POST", "path": "/"}},
        "body": "{}",
        "isBase64Encoded": False,
        **MALFORMED[shape],
    }
    context = LambdaContext(900.0)
    context.invoked_function_arn = ARN
    answer = app.lambda_handler(event, context)
    assert 400 <= answer["statusCode"] < 500 and ran == []

"""What a dispatch Lambda must do on AWS that moto hides: its 15 minutes, and the lease as its message.

* An authorized attempt's message is made invisible for the attempt's lease, so a dispatcher that
  dies mid-attempt is noticed when the lease expires, not when the queue's visibility runs out.
* The dispatcher listens for the endpoint's answer only as long as its invocation has left; the SDK
  is told when that is, and submits a later answer to the result route instead (decisions 6.15).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import boto3
import pytest
from moto import mock_aws
from werkzeug.serving import make_server

from ryusen import Ryusen, Step
from ryusen_server.aws.queue import CARRIER_ATTRIBUTE, SqsQueue, create_queues
from ryusen_server.aws.store import create_table
from ryusen_server.aws.timers import create_schedule_group
from ryusen_server.lambdas import api as api_lambda
from ryusen_server.lambdas import dispatch as dispatch_lambda
from tests.lambda_http import ApiGateway, LambdaContext, sqs_batch
from tests.stack import wait_for

TIMELINE: list[tuple[str, float]] = []


def build_app() -> Ryusen:
    app = Ryusen("box")

    @app.function("quick")
    def quick(data: dict[str, Any], step: Step) -> Any:
        return step.run("charge", lambda: {"charged": True}, timeout=timedelta(seconds=1))

    def slow_report() -> dict[str, Any]:
        TIMELINE.append(("callback-start", time.monotonic()))
        time.sleep(8)
        TIMELINE.append(("callback-end", time.monotonic()))
        return {"report": "done"}

    @app.function("slow")
    def slow(data: dict[str, Any], step: Step) -> Any:
        return step.run("report", slow_report, timeout=timedelta(minutes=10))

    return app


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    with mock_aws():
        create_table(boto3.client("dynamodb"), "ryusen")
        sqs = boto3.client("sqs")
        url, _ = create_queues(sqs, "ryusen-dispatch")
        arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        create_schedule_group(boto3.client("scheduler"), "ryusen")
        gateway = ApiGateway(api_lambda.handler)
        env = {
            "RYUSEN_TABLE": "ryusen",
            "RYUSEN_QUEUE_URL": url,
            "RYUSEN_QUEUE_ARN": arn,
            "RYUSEN_SCHEDULER_ROLE_ARN": "arn:aws:iam::123456789012:role/scheduler",
            "RYUSEN_ENDPOINT_ALLOWED_NETWORKS": "127.0.0.0/8",  # the test app runs on loopback
            "RYUSEN_MASTER_KEY": "lambda-tests-master-key-0123456789abcdef",  # the app derives its key from it
            "RYUSEN_RESULT_URL": f"{gateway.url}/v1/results",
            "RYUSEN_LEASE_GRACE_S": "1",
            "POWERTOOLS_METRICS_NAMESPACE": "Ryusen",
            "RYUSEN_CHAIN_STEPS": "false",  # one message per task: these tests hold each one
        }
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(api_lambda, "_resolver", None)
        monkeypatch.setattr(dispatch_lambda, "_engine", None)
        server = make_server("127.0.0.1", 0, build_app().wsgi(), threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        env["app_url"] = f"http://127.0.0.1:{server.server_port}/"
        env["api_url"] = gateway.url
        yield env
        server.shutdown()
        gateway.close()


def call(aws: dict[str, str], method: str, path: str, body: Any = None) -> Any:
    import httpx

    response = httpx.request(method, aws["api_url"] + path, json=body, timeout=30)
    assert response.status_code < 300, response.text
    return response.json()


def receive(aws: dict[str, str], wait_s: int = 0) -> list[dict[str, Any]]:
    sqs = boto3.client("sqs")
    messages: list[dict[str, Any]] = sqs.receive_message(
        QueueUrl=aws["RYUSEN_QUEUE_URL"],
        MaxNumberOfMessages=10,
        WaitTimeSeconds=wait_s,
        MessageSystemAttributeNames=["MessageGroupId"],
        MessageAttributeNames=["All"],
    ).get("Messages", [])
    return messages


def dispatch(aws: dict[str, str], messages: list[dict[str, Any]], remaining_s: float = 900) -> set[str]:
    """One dispatch invocation; deletes what it handled, as the event source does. Returns the kept ids."""
    result = dispatch_lambda.handler(sqs_batch(messages), LambdaContext(remaining_s))
    kept = {f["itemIdentifier"] for f in result["batchItemFailures"]}
    sqs = boto3.client("sqs")
    for m in messages:
        if m["MessageId"] not in kept:
            sqs.delete_message(QueueUrl=aws["RYUSEN_QUEUE_URL"], ReceiptHandle=m["ReceiptHandle"])
    return kept


def test_an_authorized_attempt_is_noticed_at_its_lease_when_the_dispatcher_dies(
    aws: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    call(aws, "PUT", "/v1/apps/box", {"url": aws["app_url"]})
    run = call(aws, "POST", "/v1/functions/quick/runs", {"input": {}})
    dispatch(aws, receive(aws))  # discovery: the charge attempt is queued
    [message] = receive(aws)
    assert json.loads(message["Body"])["kind"] == "forward"

    class Killed(Exception):
        """The Lambda runtime killed the dispatcher after the attempt was authorized."""

    wired = dispatch_lambda.engine()
    with monkeypatch.context() as killed:
        killed.setattr(wired.engine.invoker, "invoke", lambda *a, **k: (_ for _ in ()).throw(Killed()))
        assert dispatch(aws, [message]) == {message["MessageId"]}
    # the lease is the attempt timeout (1 s) plus the grace (1 s): the message is back then, not after the
    # queue's visibility timeout (360 s)
    back = wait_for(lambda: receive(aws, wait_s=1), timeout=15, what="the message to return at the lease")
    dispatch(aws, back)
    view = call(aws, "GET", f"/v1/runs/{run['id']}")
    assert view["steps"][0]["status"] == "unknown"
    assert "lease expired" in view["steps"][0]["attempts"][0]["detail"]


def test_the_dispatcher_listens_no_longer_than_its_invocation_has_left_and_the_sdk_submits_late(
    aws: dict[str, str],
) -> None:
    TIMELINE.clear()
    call(aws, "PUT", "/v1/apps/box", {"url": aws["app_url"]})
    run = call(aws, "POST", "/v1/functions/slow/runs", {"input": {}})
    dispatch(aws, receive(aws))
    [message] = receive(aws)
    # 16 s left in this invocation: it stops listening after about 6 s (keeping 10 s to record an answer)
    kept = dispatch(aws, [message], remaining_s=16)
    TIMELINE.append(("dispatcher-returned", time.monotonic()))
    assert kept == {message["MessageId"]}  # the message stays: it is the attempt's lease timer
    events = dict(TIMELINE)
    assert events["dispatcher-returned"] < events.get("callback-end", float("inf")), "waited past its budget"
    attempt = call(aws, "GET", f"/v1/runs/{run['id']}")["steps"][0]["attempts"][0]
    assert attempt["status"] == "authorized"  # not Unknown: its own timeout (10 min) has not passed
    # the SDK finishes and submits the signed result to the result route
    done = wait_for(
        lambda: (r := call(aws, "GET", f"/v1/runs/{run['id']}"))["steps"][0]["status"] == "completed" and r,
        timeout=30,
        what="the late result",
    )
    assert done["steps"][0]["result"] == {"report": "done"}
    assert [a["status"] for a in done["steps"][0]["attempts"]] == ["succeeded"]


def test_the_master_key_is_read_from_secrets_manager_and_a_rotation_takes_effect(
    aws: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ryusen._internal.signing import app_key
    from ryusen_server.wiring import AwsResources, SecretKey, aws_engine

    secrets = boto3.client("secretsmanager")
    arn = secrets.create_secret(Name="ryusen/signing-key", SecretString="key-1")["ARN"]
    monkeypatch.setenv("RYUSEN_MASTER_KEY_SECRET_ARN", arn)
    monkeypatch.delenv("RYUSEN_MASTER_KEY", raising=False)
    monkeypatch.setattr(api_lambda, "_resolver", None)
    monkeypatch.setattr(dispatch_lambda, "_engine", None)
    signed = Ryusen("box", signing_key=app_key("key-1", "box"))  # the app holds its own key, not the master

    @signed.function("quick")
    def quick(data: dict[str, Any], step: Step) -> Any:
        return step.run("charge", lambda: {"charged": True})

    server = make_server("127.0.0.1", 0, signed.wsgi(), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        call(aws, "PUT", "/v1/apps/box", {"url": f"http://127.0.0.1:{server.server_port}/"})
        run = call(aws, "POST", "/v1/functions/quick/runs", {"input": {}})
        for _ in range(3):
            dispatch(aws, receive(aws))
        assert call(aws, "GET", f"/v1/runs/{run['id']}")["outcome"] == "completed"  # signed and verified
    finally:
        server.shutdown()
    # a rotation is read again once the cache's time is up, without a redeploy
    now = [0.0]
    key = SecretKey(secrets, arn, ttl_s=300, clock=lambda: now[0])
    assert key() == "key-1"
    secrets.put_secret_value(SecretId=arn, SecretString="key-2")
    assert key() == "key-1"
    now[0] = 301.0
    assert key() == "key-2"
    assert aws_engine(AwsResources.from_env()).engine.master_keys() == ["key-2", "key-1"]


def test_a_probe_of_a_blocked_run_reports_how_long_it_has_been_blocked(
    aws: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from datetime import UTC, datetime, timedelta

    test_an_authorized_attempt_is_noticed_at_its_lease_when_the_dispatcher_dies(aws, monkeypatch)  # an Unknown
    timers = dispatch_lambda.engine().engine.timers
    [(_name, body)] = timers.due(datetime.now(UTC) + timedelta(hours=1))  # type: ignore[attr-defined]
    assert json.loads(body)["timer"]["kind"] == "probe"
    capsys.readouterr()
    message = {"MessageId": "probe-1", "ReceiptHandle": "rh-probe-1", "Body": body}
    result = dispatch_lambda.handler(sqs_batch([message]), LambdaContext())
    assert result["batchItemFailures"] == []
    emitted = [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"_aws"' in line]
    assert any("BlockedRunAge" in m for m in emitted), emitted


def test_a_message_handled_writes_no_log_line(aws: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """Every step is a message or two here: a line each would be CloudWatch Logs bytes per step (a metric's EMF
    line is about 300 bytes). Lambda's Invocations and SQS's own metrics count them; only failures are logged."""
    call(aws, "PUT", "/v1/apps/box", {"url": aws["app_url"]})
    call(aws, "POST", "/v1/functions/quick/runs", {"input": {}})
    capsys.readouterr()
    dispatch(aws, receive(aws))  # discovery: the charge attempt is queued
    dispatch(aws, receive(aws))  # the attempt, answered inline
    written = capsys.readouterr()
    assert (written.out, written.err) == ("", "")


def test_a_key_rotation_in_flight_makes_nothing_unknown(aws: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatcher signs with the new master while the app still holds the old key: the app's refusal is
    signed with its key for exactly that request, which the server verifies with the previous master, so
    the attempt is sent again, never Unknown."""
    from ryusen._internal.signing import app_key

    secrets = boto3.client("secretsmanager")
    arn = secrets.create_secret(Name="ryusen/rotating", SecretString="key-1")["ARN"]
    monkeypatch.setenv("RYUSEN_MASTER_KEY_SECRET_ARN", arn)
    monkeypatch.delenv("RYUSEN_MASTER_KEY", raising=False)
    monkeypatch.setattr(api_lambda, "_resolver", None)
    monkeypatch.setattr(dispatch_lambda, "_engine", None)
    keys = {"app": [app_key("key-1", "box")]}
    signed = Ryusen("box")
    monkeypatch.setattr(type(signed), "signing_keys", property(lambda self: keys["app"]))
    ran: list[str] = []

    @signed.function("quick")
    def quick(data: dict[str, Any], step: Step) -> Any:
        return step.run("charge", lambda: ran.append("charge") or {"charged": True})

    server = make_server("127.0.0.1", 0, signed.wsgi(), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        call(aws, "PUT", "/v1/apps/box", {"url": f"http://127.0.0.1:{server.server_port}/"})
        run = call(aws, "POST", "/v1/functions/quick/runs", {"input": {}})
        dispatch(aws, receive(aws))  # discovery, all on key-1
        secrets.put_secret_value(SecretId=arn, SecretString="key-2")
        monkeypatch.setattr(dispatch_lambda, "_engine", None)  # a cold dispatcher: it signs with key-2
        dispatch(aws, receive(aws))  # the app (still key-1) refuses with a 401 signed with key-1
        view = call(aws, "GET", f"/v1/runs/{run['id']}")
        attempt = view["steps"][0]["attempts"][0]
        assert attempt["status"] == "queued" and view["blockers"] == [] and ran == []  # sent again later
        keys["app"] = [app_key("key-2", "box"), app_key("key-1", "box")]  # the app re-reads its secret

        def progress() -> dict[str, Any] | None:
            if messages := receive(aws, wait_s=1):
                dispatch(aws, messages)
            view: dict[str, Any] = call(aws, "GET", f"/v1/runs/{run['id']}")
            return view if view["phase"] == "finished" else None

        done = wait_for(progress, timeout=30, what="the run to finish on the new key")
    finally:
        server.shutdown()
    assert done["outcome"] == "completed" and ran == ["charge"]


def test_a_secret_that_cannot_be_read_leaves_nothing_authorized_and_a_cached_key_outlives_an_outage(
    aws: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ryusen_server.wiring import SecretKey

    secrets = boto3.client("secretsmanager")
    arn = secrets.create_secret(Name="ryusen/flaky", SecretString="key-1")["ARN"]
    monkeypatch.setenv("RYUSEN_MASTER_KEY_SECRET_ARN", arn)
    monkeypatch.delenv("RYUSEN_MASTER_KEY")  # the engine and the app both read the secret
    monkeypatch.setattr(dispatch_lambda, "_engine", None)
    call(aws, "PUT", "/v1/apps/box", {"url": aws["app_url"]})
    run = call(aws, "POST", "/v1/functions/quick/runs", {"input": {}})
    wired = dispatch_lambda.engine()

    def outage(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("ThrottlingException: rate exceeded")

    with monkeypatch.context() as down:
        down.setattr(wired.engine.settings.master_keys_source.__self__._client, "get_secret_value", outage)  # type: ignore[union-attr]
        [message] = receive(aws)
        assert dispatch(aws, [message]) == {message["MessageId"]}  # kept: it comes back
    assert call(aws, "GET", f"/v1/runs/{run['id']}")["discovery"]["status"] == "queued"  # nothing authorized
    now = [0.0]
    key = SecretKey(secrets, arn, ttl_s=300, clock=lambda: now[0])
    assert key() == "key-1"
    now[0] = 400.0
    with monkeypatch.context() as down:
        down.setattr(secrets, "get_secret_value", outage)
        assert key() == "key-1"  # the refresh failed: the key read before still signs


def test_time_spent_before_the_invocation_comes_off_the_budget(
    aws: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ryusen_server.ports import InvokeResult

    call(aws, "PUT", "/v1/apps/box", {"url": aws["app_url"]})
    call(aws, "POST", "/v1/functions/slow/runs", {"input": {}})  # its step may take 10 minutes
    dispatch(aws, receive(aws))
    [message] = receive(aws)
    wired = dispatch_lambda.engine()
    store_get = wired.engine.store.get
    sent: list[float] = []

    def slow_read(run_id: str) -> Any:
        time.sleep(4)  # a throttled read, retried by botocore
        return store_get(run_id)

    def recording(url: str, body: bytes, headers: dict[str, str], *, timeout_s: float) -> Any:
        sent.append(json.loads(body)["respond_by"])
        return InvokeResult(kind="timed_out", detail="the endpoint is still working")

    monkeypatch.setattr(wired.engine.store, "get", slow_read)
    monkeypatch.setattr(wired.engine.invoker, "invoke", recording)
    started = time.time()
    dispatch(aws, [message], remaining_s=25)
    # the invocation must end 10 s before the Lambda does, to record the answer; 4 s went on the read
    assert sent and sent[0] <= started + 25 - 10 - 2 + 0.5, sent[0] - started


def test_a_deployed_engine_refuses_to_start_without_a_signing_key(
    aws: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 11 finding 8: a server without a key accepted unsigned late results, with no warning on AWS.
    A deployed engine has no unsigned mode: without its key it does not start, so nothing unsigned is sent
    or accepted, and the message comes back until the deployment is fixed."""
    monkeypatch.delenv("RYUSEN_MASTER_KEY")
    monkeypatch.delenv("RYUSEN_MASTER_KEY_SECRET_ARN", raising=False)
    monkeypatch.setattr(dispatch_lambda, "_engine", None)
    with pytest.raises(RuntimeError, match="no unsigned mode"):
        dispatch_lambda.engine()
    from ryusen_server.lambdas import api as api_lambda

    monkeypatch.setattr(api_lambda, "_resolver", None)
    with pytest.raises(RuntimeError, match="no unsigned mode"):
        api_lambda.resolver()


def test_a_message_the_engine_keeps_is_replaced_before_the_dead_letter_queue_takes_it(aws: dict[str, str]) -> None:
    """Issue 24 (low): a message kept on purpose (here a duplicate of an attempt's message, waiting for the lease
    of the attempt another delivery is running) comes back again and again; each receive counts, and at 10 the
    redrive policy moved it to the dead-letter queue, whose alarm then fired for nothing. Past 7 receives the
    dispatcher now sends a fresh copy (its count starts again) and lets this one go."""
    TIMELINE.clear()
    call(aws, "PUT", "/v1/apps/box", {"url": aws["app_url"]})
    call(aws, "POST", "/v1/functions/slow/runs", {"input": {}})
    dispatch(aws, receive(aws))
    [message] = receive(aws)
    assert dispatch(aws, [message], remaining_s=16) == {message["MessageId"]}  # in flight: its lease timer
    batch = sqs_batch([message])
    batch["Records"][0]["attributes"]["ApproximateReceiveCount"] = "8"  # a duplicate, received 8 times
    result = dispatch_lambda.handler(batch, LambdaContext(900))
    assert result["batchItemFailures"] == []  # not kept: it would reach the DLQ after two more receives
    attributes = boto3.client("sqs").get_queue_attributes(
        QueueUrl=aws["RYUSEN_QUEUE_URL"], AttributeNames=["ApproximateNumberOfMessagesDelayed"]
    )["Attributes"]
    assert attributes["ApproximateNumberOfMessagesDelayed"] == "1"  # the fresh copy, due when the lease is


def test_a_fresh_copy_of_a_kept_message_still_carries_the_attempt_it_authorized(
    aws: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24: only the message whose delivery authorized an attempt (its carrier) takes it as Unknown at its
    lease; any other waits ``lease_watch_grace_s`` longer (the carrier is deleted when the attempt's answer is
    deferred). The fresh copy a kept message is replaced by names the message it replaces, so a carrier kept
    past 7 receives (a long step's lease timer) still decides at the lease."""
    resend = SqsQueue.resend
    # the copy is due when the lease ends (10 minutes): here at once, to look at it
    monkeypatch.setattr(SqsQueue, "resend", lambda self, body, _delay, **kw: resend(self, body, 0, **kw))
    call(aws, "PUT", "/v1/apps/box", {"url": aws["app_url"]})
    call(aws, "POST", "/v1/functions/slow/runs", {"input": {}})
    dispatch(aws, receive(aws))
    [message] = receive(aws)
    batch = sqs_batch([message])
    batch["Records"][0]["attributes"]["ApproximateReceiveCount"] = "8"
    result = dispatch_lambda.handler(batch, LambdaContext(16))  # authorizes the attempt; gives up listening
    assert result["batchItemFailures"] == []  # replaced by a fresh copy
    boto3.client("sqs").delete_message(QueueUrl=aws["RYUSEN_QUEUE_URL"], ReceiptHandle=message["ReceiptHandle"])
    [copy] = wait_for(lambda: receive(aws, 1), what="the fresh copy", timeout=40)
    assert copy["MessageId"] != message["MessageId"]
    assert copy["MessageAttributes"][CARRIER_ATTRIBUTE]["StringValue"] == message["MessageId"]
    record = dispatch_lambda.DispatchRecord.model_validate(sqs_batch([copy])["Records"][0])
    assert dispatch_lambda._carrier(record) == message["MessageId"]
    run = call(aws, "GET", "/v1/runs?function_id=slow")["runs"][0]
    attempt = call(aws, "GET", f"/v1/runs/{run['id']}")["steps"][0]["attempts"][0]
    assert attempt["status"] == "authorized"


def test_every_task_message_carries_its_runs_app_as_its_message_group(aws: dict[str, str]) -> None:
    """Issue 25: the dispatch queue is an SQS fair queue, whose tenant is a message's group. The first
    discovery (sent by the API) and the tasks the dispatcher sends after it are all in the run's app's group."""
    call(aws, "PUT", "/v1/apps/box", {"url": aws["app_url"]})
    run = call(aws, "POST", "/v1/functions/quick/runs", {"input": {}})
    groups = []
    while run["phase"] != "finished":
        messages = wait_for(lambda: receive(aws, 1), what="the run's next task", timeout=30)
        groups += [m["Attributes"].get("MessageGroupId") for m in messages]
        dispatch(aws, messages)
        run = call(aws, "GET", f"/v1/runs/{run['id']}")
    assert len(groups) >= 2 and set(groups) == {"box"}

"""The Lambda entry points, fed the sample events in events/, on moto in-process."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws
from werkzeug.serving import make_server

from ryusen import Ryusen, Step
from ryusen_server.aws.queue import create_queues
from ryusen_server.aws.store import create_table
from ryusen_server.aws.timers import create_schedule_group
from ryusen_server.lambdas import api as api_lambda
from ryusen_server.lambdas import dispatch as dispatch_lambda

EVENTS = Path(__file__).resolve().parents[2] / "events"


class Context:
    function_name = "ryusen-test"
    memory_limit_in_mb = 256
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:ryusen-test"
    aws_request_id = "req-1"

    @staticmethod
    def get_remaining_time_in_millis() -> int:
        return 30_000


def event(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((EVENTS / name).read_text())
    return loaded


@pytest.fixture
def app_url() -> Iterator[str]:
    app = Ryusen("shop")

    @app.function("checkout")
    def checkout(order: dict[str, Any], step: Step) -> Any:
        return step.run("reserve", lambda: {"sku": order["sku"]})

    server = make_server("127.0.0.1", 0, app.wsgi(), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    with mock_aws():
        create_table(boto3.client("dynamodb"), "ryusen")
        sqs = boto3.client("sqs")
        url, _ = create_queues(sqs, "ryusen-dispatch")
        arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        create_schedule_group(boto3.client("scheduler"), "ryusen")
        env = {
            "RYUSEN_TABLE": "ryusen",
            "RYUSEN_QUEUE_URL": url,
            "RYUSEN_QUEUE_ARN": arn,
            "RYUSEN_SCHEDULER_ROLE_ARN": "arn:aws:iam::123456789012:role/scheduler",
            "RYUSEN_ENDPOINT_ALLOWED_NETWORKS": "127.0.0.0/8",  # the test app runs on loopback
            "RYUSEN_MASTER_KEY": "lambda-tests-master-key-0123456789abcdef",  # the app derives its key from it
            "POWERTOOLS_METRICS_NAMESPACE": "Ryusen",
            # one queue message per task, so that a test can hold each one (chaining has its own test)
            "RYUSEN_CHAIN_STEPS": "false",
        }
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(api_lambda, "_resolver", None)
        monkeypatch.setattr(dispatch_lambda, "_engine", None)
        yield env


def api(method: str, path: str, body: Any = None) -> tuple[int, Any]:
    request = event("api_start_run.json")
    request.update({"httpMethod": method, "path": path, "body": json.dumps(body) if body is not None else None})
    response = api_lambda.handler(request, Context())  # type: ignore[arg-type]
    return response["statusCode"], json.loads(response["body"])


def drain(aws: dict[str, str]) -> int:
    """Feed queued messages to the dispatch handler as SQS event batches, as the event source would."""
    sqs = boto3.client("sqs")
    handled = 0
    for _ in range(50):
        messages = sqs.receive_message(QueueUrl=aws["RYUSEN_QUEUE_URL"], MaxNumberOfMessages=10).get("Messages", [])
        if not messages:
            return handled
        batch = event("sqs_dispatch_batch.json")
        template = batch["Records"][0]
        batch["Records"] = [
            {**template, "messageId": m["MessageId"], "receiptHandle": m["ReceiptHandle"], "body": m["Body"]}
            for m in messages
        ]
        result = dispatch_lambda.handler(batch, Context())  # type: ignore[arg-type]
        failed = {f["itemIdentifier"] for f in result["batchItemFailures"]}
        for m in messages:
            if m["MessageId"] not in failed:  # the event source deletes what succeeded
                sqs.delete_message(QueueUrl=aws["RYUSEN_QUEUE_URL"], ReceiptHandle=m["ReceiptHandle"])
        handled += len(messages)
    raise AssertionError("queue did not drain")


def test_sample_events_drive_a_run_through_both_handlers(aws: dict[str, str], app_url: str) -> None:
    status, release = api("PUT", "/v1/apps/shop", {"url": app_url})
    assert status == 200 and release["functions"][0]["id"] == "checkout"
    sample = event("api_start_run.json")
    response = api_lambda.handler(sample, Context())  # type: ignore[arg-type]
    assert response["statusCode"] == 201
    run = json.loads(response["body"])
    assert run["idempotency_key"] == "order-1001" and run["phase"] == "running"
    assert drain(aws) >= 3
    status, done = api("GET", f"/v1/runs/{run['id']}")
    assert status == 200 and done["outcome"] == "completed" and done["output"] == {"sku": "lamp"}
    # the same sample event again is an idempotent retry: the same run, 200
    again = api_lambda.handler(event("api_start_run.json"), Context())  # type: ignore[arg-type]
    assert again["statusCode"] == 200 and json.loads(again["body"])["id"] == run["id"]


def test_a_chaining_dispatcher_runs_every_step_of_a_short_run_from_one_message(
    aws: dict[str, str], app_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deployed default: the write that accepts a step's answer authorizes the next step, and the same
    invocation calls it, so a short run needs the start's message and nothing else."""
    monkeypatch.setenv("RYUSEN_CHAIN_STEPS", "true")
    api("PUT", "/v1/apps/shop", {"url": app_url})
    response = api_lambda.handler(event("api_start_run.json"), Context())  # type: ignore[arg-type]
    run = json.loads(response["body"])
    assert drain(aws) == 1
    status, done = api("GET", f"/v1/runs/{run['id']}")
    assert status == 200 and done["outcome"] == "completed" and done["output"] == {"sku": "lamp"}
    [step] = done["steps"]
    assert step["id"] == "reserve" and step["status"] == "completed" and len(step["attempts"]) == 1


def test_dispatch_reports_an_in_flight_attempt_as_a_batch_item_failure(aws: dict[str, str], app_url: str) -> None:
    api("PUT", "/v1/apps/shop", {"url": app_url})
    _, run = api("POST", "/v1/functions/checkout/runs", {"input": {"sku": "a"}})
    wired = dispatch_lambda.engine()
    from ryusen_server.core.events import ReleaseRef, TaskDelivered
    from ryusen_server.core.model import TaskRef

    # authorize discovery #1 without invoking (a dispatcher that died mid-task)
    task = TaskRef(run_id=run["id"], kind="discover", seq=1)
    wired.engine.apply(run["id"], TaskDelivered(task=task, release=ReleaseRef(release_id="x", build_id="y")))
    sqs = boto3.client("sqs")
    [message] = sqs.receive_message(QueueUrl=aws["RYUSEN_QUEUE_URL"]).get("Messages", [])
    batch = event("sqs_dispatch_batch.json")
    batch["Records"][0].update(
        {"messageId": message["MessageId"], "receiptHandle": message["ReceiptHandle"], "body": message["Body"]}
    )
    result = dispatch_lambda.handler(batch, Context())  # type: ignore[arg-type]
    assert result["batchItemFailures"] == [{"itemIdentifier": message["MessageId"]}]  # kept: it is the lease timer


def test_scheduler_timer_event_fires_the_deadline(aws: dict[str, str], app_url: str) -> None:
    api("PUT", "/v1/apps/shop", {"url": app_url})
    _, run = api("POST", "/v1/functions/checkout/runs", {"input": {"sku": "a"}, "timeout_s": 0.001})
    batch = event("scheduler_timer.json")
    body = json.loads(batch["Records"][0]["body"])
    body["timer"]["run_id"] = run["id"]
    body["timer"]["at"] = run["deadline"]["at"]
    batch["Records"][0]["body"] = json.dumps(body)
    result = dispatch_lambda.handler(batch, Context())  # type: ignore[arg-type]
    assert result["batchItemFailures"] == []
    _, after = api("GET", f"/v1/runs/{run['id']}")
    assert after["outcome"] == "timed_out" and after["recovery"] == "not_required"
    assert after["deadline"]["source"] == "run_request"


def test_a_poison_record_fails_alone_and_changes_no_run(aws: dict[str, str], app_url: str) -> None:
    api("PUT", "/v1/apps/shop", {"url": app_url})
    _, run = api("POST", "/v1/functions/checkout/runs", {"input": {"sku": "a"}})
    sqs = boto3.client("sqs")
    [message] = sqs.receive_message(QueueUrl=aws["RYUSEN_QUEUE_URL"]).get("Messages", [])
    batch = event("sqs_dispatch_batch.json")
    good = {**batch["Records"][0], "messageId": "good", "receiptHandle": message["ReceiptHandle"]}
    good["body"] = message["Body"]
    poison = [
        {**good, "messageId": "not-json", "body": "{not json"},
        {**good, "messageId": "wrong-shape", "body": json.dumps({"run_id": run["id"], "kind": "explode"})},
        {**good, "messageId": "extra-field", "body": json.dumps({**json.loads(message["Body"]), "x": 1})},
    ]
    batch["Records"] = [*poison, good]
    result = dispatch_lambda.handler(batch, Context())  # type: ignore[arg-type]
    assert sorted(f["itemIdentifier"] for f in result["batchItemFailures"]) == [
        "extra-field",
        "not-json",
        "wrong-shape",
    ]
    # the good record in the same batch was handled: discovery #1 ran and scheduled the step attempt
    _, after = api("GET", f"/v1/runs/{run['id']}")
    assert [s["id"] for s in after["steps"]] == ["reserve"]


def test_a_cursor_that_is_not_valid_unicode_is_refused_and_an_unexpected_error_is_a_structured_500(
    aws: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import base64

    cursor = base64.urlsafe_b64encode(b'{"before":"\\ud800#x"}').decode()
    request = event("api_start_run.json")
    request.update({"httpMethod": "GET", "path": "/v1/runs", "body": None, "queryStringParameters": {"cursor": cursor}})
    response = api_lambda.handler(request, Context())  # type: ignore[arg-type]
    assert response["statusCode"] == 422 and json.loads(response["body"])["error"]["code"] == "invalid_cursor"
    engine = api_lambda.resolver()
    monkeypatch.setattr(
        "ryusen_server.aws.store.DynamoStore.list_runs", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    )
    request["queryStringParameters"] = None
    response = api_lambda.handler(request, Context())  # type: ignore[arg-type]
    assert response["statusCode"] == 500
    assert json.loads(response["body"])["error"]["code"] == "internal_error" and "boom" not in response["body"]
    del engine

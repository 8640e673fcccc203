"""Review of 61ced61 (``app_dispatch_concurrency``: an app's dispatch queue of its own), on moto.

The dispatch Lambda's real handler over two queues: the shared dispatch queue and ``video``'s own (named in
``RYUSEN_APP_QUEUES``, as the stack writes it). Each batch is handed to the handler with the ``eventSourceARN`` of
the queue it was received from, as the event source does, and deleted from that queue unless kept. Every
``ChangeMessageVisibility`` the dispatcher makes is recorded with the queue it named.

Also ``ryusen dev``'s ``RYUSEN_DEV_APP_CONCURRENCY`` (parsing, and the share of an app whose message group is a
digest).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import pytest
from moto import mock_aws
from werkzeug.serving import make_server

from ryusen import Ryusen, Step
from ryusen_server.aws import queue as queue_module
from ryusen_server.aws.queue import CARRIER_ATTRIBUTE, app_queue_digest, create_queues, message_group
from ryusen_server.aws.store import create_table
from ryusen_server.aws.timers import create_schedule_group
from ryusen_server.lambdas import api as api_lambda
from ryusen_server.lambdas import dispatch as dispatch_lambda
from ryusen_server.local.dev import DevError
from tests.functional.conftest import aws_env  # noqa: F401
from tests.lambda_http import ApiGateway, LambdaContext, sqs_batch

MASTER = "review-app-queues-master-key-0123456789abcdef"


pytestmark = pytest.mark.usefixtures("aws_env")  # fake credentials for moto (tests/functional/conftest.py)


def _arn(sqs: Any, url: str) -> str:
    return str(sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"])


class Stack:
    """Two dispatch queues (shared, video's), the API, and two apps on loopback (``video`` and ``shop``)."""

    def __init__(self, env: dict[str, str], gateway: ApiGateway) -> None:
        self.env = env
        self.gateway = gateway
        self.sqs = boto3.client("sqs")
        self.shared_url, self.video_url = env["RYUSEN_QUEUE_URL"], env["video_url"]
        self.shared_arn, self.video_arn = env["RYUSEN_QUEUE_ARN"], env["video_arn"]
        self.visibility_changes: list[str] = []
        """The queue URL of every ChangeMessageVisibility the dispatcher made."""
        self.invoked: list[tuple[str, str]] = []
        """(the ARN of the queue whose message the dispatcher was handling, the task) for every invocation."""
        self.handling: str | None = None

    def call(self, method: str, path: str, body: Any = None) -> Any:
        import httpx

        response = httpx.request(method, self.gateway.url + path, json=body, timeout=30)
        assert response.status_code < 300, response.text
        return response.json()

    def receive(self, url: str) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = self.sqs.receive_message(
            QueueUrl=url,
            MaxNumberOfMessages=10,
            MessageSystemAttributeNames=["All"],
            MessageAttributeNames=["All"],
        ).get("Messages", [])
        return messages

    def dispatch(self, url: str, messages: list[dict[str, Any]], remaining_s: float = 900) -> set[str]:
        """One invocation of the dispatch function by ``url``'s event source; returns the kept message ids."""
        arn = self.shared_arn if url == self.shared_url else self.video_arn
        self.watch()
        self.handling = arn
        try:
            result = dispatch_lambda.handler(sqs_batch(messages, source_arn=arn), LambdaContext(remaining_s))
        finally:
            self.handling = None
        kept = {f["itemIdentifier"] for f in result["batchItemFailures"]}
        for m in messages:
            if m["MessageId"] not in kept:
                self.sqs.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
        return kept

    def drain(self, url: str, rounds: int = 10) -> None:
        for _ in range(rounds):
            messages = self.receive(url)
            if not messages:
                return
            for message in messages:
                self.dispatch(url, [message])

    _watched: object | None = None

    def watch(self) -> None:
        """Record the dispatcher's visibility changes (by queue) and invocations (by the queue it handles)."""
        wired = dispatch_lambda.engine()
        if self._watched is wired:
            return
        self._watched = wired

        def changed(params: dict[str, Any], **_: Any) -> None:
            self.visibility_changes.append(params["QueueUrl"])

        wired.sqs.meta.events.register("provide-client-params.sqs.ChangeMessageVisibility", changed)

        def hook(kind: str, payload: Any) -> None:
            if kind == "invoke":
                task, _url = payload
                self.invoked.append((self.handling or "?", f"{task.run_id} {task.describe()}"))

        wired.engine.hooks.append(hook)


def video_app() -> Ryusen:
    app = Ryusen("video")

    @app.function("encode-video")
    def encode_video(data: dict[str, Any], step: Step) -> Any:
        later = timedelta(seconds=data["not_before_s"]) if data.get("not_before_s") else None
        return step.run("encode", lambda: {"encoded": True}, timeout=timedelta(seconds=30), not_before=later)

    return app


def shop_app() -> Ryusen:
    app = Ryusen("shop")

    @app.function("checkout")
    def checkout(data: dict[str, Any], step: Step) -> Any:
        return step.run("charge", lambda: {"charged": True}, timeout=timedelta(seconds=30))

    return app


@pytest.fixture
def stack(monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    with mock_aws():
        create_table(boto3.client("dynamodb"), "ryusen")
        sqs = boto3.client("sqs")
        shared_url, _ = create_queues(sqs, "ryusen-dispatch")
        video_url = sqs.create_queue(QueueName=f"ryusen-0123abcd-{app_queue_digest('video')}")["QueueUrl"]
        create_schedule_group(boto3.client("scheduler"), "ryusen")
        gateway = ApiGateway(api_lambda.handler)
        env = {
            "RYUSEN_TABLE": "ryusen",
            "RYUSEN_QUEUE_URL": shared_url,
            "RYUSEN_QUEUE_ARN": _arn(sqs, shared_url),
            "RYUSEN_SCHEDULER_ROLE_ARN": "arn:aws:iam::123456789012:role/scheduler",
            "RYUSEN_ENDPOINT_ALLOWED_NETWORKS": "127.0.0.0/8",
            "RYUSEN_MASTER_KEY": MASTER,
            "RYUSEN_RESULT_URL": f"{gateway.url}/v1/results",
            "RYUSEN_LEASE_GRACE_S": "1",
            "POWERTOOLS_METRICS_NAMESPACE": "Ryusen",
            "RYUSEN_CHAIN_STEPS": "false",
            "RYUSEN_APP_QUEUES": app_queue_digest("video"),  # as the stack names video's queue
            "RYUSEN_APP_QUEUE_PREFIX": "ryusen-0123abcd-",
        }
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(api_lambda, "_resolver", None)
        monkeypatch.setattr(dispatch_lambda, "_engine", None)
        servers = []
        urls = {}
        for name, app in (("video", video_app()), ("shop", shop_app())):
            server = make_server("127.0.0.1", 0, app.wsgi(), threaded=True)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            servers.append(server)
            urls[name] = f"http://127.0.0.1:{server.server_port}/"
        made = Stack({**env, "video_url": video_url, "video_arn": _arn(sqs, video_url)}, gateway)
        for name, url in urls.items():
            made.call("PUT", f"/v1/apps/{name}", {"url": url})
        try:
            yield made
        finally:
            for server in servers:
                server.shutdown()
            gateway.close()


# ---- what held ------------------------------------------------------------------------------------------------


def test_an_apps_tasks_stay_on_its_queue_and_every_visibility_change_names_the_queue_they_came_from(
    stack: Stack,
) -> None:
    """video's discovery and step come and go through video's queue only, each visibility change names it; the
    shop's through the shared queue only."""
    video = stack.call("POST", "/v1/functions/encode-video/runs", {"input": {}})
    shop = stack.call("POST", "/v1/functions/checkout/runs", {"input": {}})
    for _ in range(4):
        stack.drain(stack.video_url)
        stack.drain(stack.shared_url)
    assert stack.call("GET", f"/v1/runs/{video['id']}")["outcome"] == "completed"
    assert stack.call("GET", f"/v1/runs/{shop['id']}")["outcome"] == "completed"
    video_invoked = [arn for arn, task in stack.invoked if video["id"] in task]
    shop_invoked = [arn for arn, task in stack.invoked if shop["id"] in task]
    assert video_invoked and set(video_invoked) == {stack.video_arn}
    assert shop_invoked and set(shop_invoked) == {stack.shared_arn}
    assert stack.visibility_changes  # the lease was put on the message (no RYUSEN_QUEUE_VISIBILITY_S here)
    assert set(stack.visibility_changes) <= {stack.video_url, stack.shared_url}
    assert stack.visibility_changes.count(stack.video_url) >= len(video_invoked)


def test_a_fresh_copy_of_a_kept_message_goes_back_to_the_queue_it_came_from(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past REFRESH_AFTER_RECEIVES receives a kept message is replaced by a copy (same group, same carrier): on
    video's queue, never on the shared one."""
    stack.call("POST", "/v1/functions/encode-video/runs", {"input": {}})
    [message] = stack.receive(stack.video_url)
    monkeypatch.setattr(dispatch_lambda, "process_message", lambda *a, **k: (False, 0.0))
    batch = sqs_batch([message], source_arn=stack.video_arn)
    batch["Records"][0]["attributes"]["ApproximateReceiveCount"] = str(dispatch_lambda.REFRESH_AFTER_RECEIVES)
    result = dispatch_lambda.handler(batch, LambdaContext(900))
    assert result["batchItemFailures"] == []  # the original is deleted; the copy takes over
    stack.sqs.delete_message(QueueUrl=stack.video_url, ReceiptHandle=message["ReceiptHandle"])
    assert stack.receive(stack.shared_url) == []
    [copy] = stack.receive(stack.video_url)
    assert json.loads(copy["Body"])["run_id"] == json.loads(message["Body"])["run_id"]
    assert copy["MessageAttributes"][CARRIER_ATTRIBUTE]["StringValue"] == message["MessageId"]
    assert copy["Attributes"].get("MessageGroupId") == message["Attributes"].get("MessageGroupId") == "video"


# ---- findings -------------------------------------------------------------------------------------------------


def test_an_apps_task_delayed_past_sqs_limit_is_not_run_by_a_shared_dispatcher(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SQS's 15-minute limit scaled down to 1 s: a 2 s not_before goes through the Scheduler, as 16 minutes would
    monkeypatch.setattr(queue_module, "MAX_DELAY_S", 1)
    run = stack.call("POST", "/v1/functions/encode-video/runs", {"input": {"not_before_s": 2}})
    stack.drain(stack.video_url)  # discovery, on video's queue: the step waits for its not_before
    assert stack.receive(stack.video_url) == [] and stack.receive(stack.shared_url) == []
    timers = dispatch_lambda.engine().engine.timers
    due = timers.due(datetime.now(UTC) + timedelta(minutes=1))  # type: ignore[attr-defined]
    assert len(due) == 1
    [(name, body)] = due
    group = timers.group  # type: ignore[attr-defined]
    target = boto3.client("scheduler").get_schedule(Name=name, GroupName=group)["Target"]["Arn"]
    assert target == stack.video_arn  # the schedule's target is video's own queue, not the shared one
    import time

    time.sleep(2.5)  # the step's not_before passes
    queue_url = {stack.video_arn: stack.video_url, stack.shared_arn: stack.shared_url}[target]
    stack.sqs.send_message(QueueUrl=queue_url, MessageBody=body)  # what the Scheduler's target does
    timers.delete(name)  # type: ignore[attr-defined]
    stack.drain(stack.shared_url)
    stack.drain(stack.video_url)
    assert stack.call("GET", f"/v1/runs/{run['id']}")["outcome"] == "completed"
    on_shared = [task for arn, task in stack.invoked if arn == stack.shared_arn and run["id"] in task]
    assert on_shared == [], f"video's step was invoked by a dispatcher of the shared queue: {on_shared}"


# ---- ryusen dev -----------------------------------------------------------------------------------------------


def test_dev_share_applies_to_an_app_whose_message_group_is_a_digest() -> None:
    """An app id SQS refuses as a group (not ASCII; over 128 characters) is sent with its digest as the group:
    RYUSEN_DEV_APP_CONCURRENCY names the app id and still caps it."""
    from tests.functional.test_dev_fair_dispatch import GroupedQueue, Tasks, stack_with

    long_id = "v" * 200
    assert message_group("café").startswith("sha256:") and message_group(long_id).startswith("sha256:")
    queue = GroupedQueue()
    for app in ("café", long_id):
        for i in range(4):
            queue.put(f"{app}/{i}", message_group(app))
    stack = stack_with({"RYUSEN_DEV_WORKERS": "6", "RYUSEN_DEV_APP_CONCURRENCY": f"café=1,{long_id}=2"})
    with Tasks(stack, queue, slow={"café", long_id}) as tasks:
        tasks.wait(lambda: tasks.running.get(long_id, 0) == 2, "the long id to hold its share")
        tasks.release.set()
        tasks.wait(lambda: len(tasks.finished) == 8, "every task to finish")
    assert tasks.most_running == {"café": 1, long_id: 2}


def test_dev_app_concurrency_is_read_and_a_duplicate_is_refused() -> None:
    from tests.functional.test_dev_fair_dispatch import stack_with

    assert stack_with({"RYUSEN_DEV_APP_CONCURRENCY": " video = 1 "}).dispatch.app_concurrency == {"video": 1}
    with pytest.raises(DevError, match="each app once"):  # the review's nit: it was taken silently, the last winning
        stack_with({"RYUSEN_DEV_APP_CONCURRENCY": "video=2,video=1"})


def test_dev_a_superscript_digit_is_refused_naming_the_setting() -> None:
    from tests.functional.test_dev_fair_dispatch import stack_with

    with pytest.raises(DevError, match="RYUSEN_DEV_APP_CONCURRENCY"):
        stack_with({"RYUSEN_DEV_APP_CONCURRENCY": "video=²"})

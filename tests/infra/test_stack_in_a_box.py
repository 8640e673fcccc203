"""The synthesized stack, created in moto and driven end to end (no AWS account): see tests/infra/box.py.

Runs of examples/shop.py (served as its Lambda behind a loopback Function URL) go through the API
function behind the template's routes and the dispatch function fed by the template's event source: a
completed checkout, a compensated one, a cancel, a deadline fired by the schedule the engine created, and
a late result that reaches the result route without AWS credentials. tests/infra/test_iam.py then checks
every AWS call these made against the template's roles.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import boto3
import httpx
import pytest
from moto import mock_aws

from ryusen_server.aws.store import ENTRY_PREFIX, _unpack
from tests.aws_faults import AwsFaults, FrontEnd
from tests.infra.box import Box, Call, caller, due_schedules, load_example, sigv4_headers
from tests.infra.conftest import Synthesized
from tests.lambda_http import ApiGateway, LambdaContext, sqs_batch
from tests.stack import wait_for


@dataclass
class Deployed:
    box: Box
    api_url: str
    shop_url: str
    env: dict[str, str]
    budget_s: float = 900.0
    front_end: FrontEnd | None = None
    """The shop's Function URL front end (it can throttle, as Lambda does past the function's concurrency)."""
    received: list[dict[str, Any]] = field(default_factory=list)
    """Every message the event source received, with its attributes (a task's message group among them)."""
    source: EventSource | None = None

    def api(self, method: str, path: str, body: Any = None, *, signed: bool = True) -> httpx.Response:
        url = self.api_url + path
        content = json.dumps(body).encode() if body is not None else b""
        headers = sigv4_headers(method, url, content) if signed else {"content-type": "application/json"}
        return httpx.request(method, url, content=content, headers=headers, timeout=60)

    def run(self, run_id: str) -> dict[str, Any]:
        response = self.api("GET", f"/v1/runs/{run_id}")
        assert response.status_code == 200, response.text
        view: dict[str, Any] = response.json()
        return view

    def start(self, data: dict[str, Any], **extra: Any) -> str:
        response = self.api("POST", "/v1/functions/checkout/runs", {"input": data, **extra})
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def finished(self, run_id: str, timeout: float = 60) -> dict[str, Any]:
        return wait_for(
            lambda: (r := self.run(run_id))["phase"] == "finished" and r,
            timeout=timeout,
            what=f"run {run_id} to finish",
        )


class EventSource:
    """The template's SQS event source: batches of its size to the dispatch function, deletions as AWS does."""

    def __init__(self, deployed: Deployed, handler: Any) -> None:
        self.deployed = deployed
        self.handler = handler
        self.stop = threading.Event()
        self.sqs = boto3.client("sqs", region_name="us-east-1")
        self.queue_url = deployed.env["RYUSEN_QUEUE_URL"]
        self.threads: list[threading.Thread] = []
        self.running: dict[str, int] = {}
        """Invocations running now, by the queue (its ARN) whose messages they handle."""
        self.most_running: dict[str, int] = {}
        self.handled: list[tuple[str, str]] = []
        """Each message handed to the dispatch function: (its queue's ARN, its body)."""
        self._lock = threading.Lock()
        # each of the template's event sources runs up to its maximum concurrency of invocations at once (4 at
        # most here); the Scheduler fires on its own
        mappings = [m["Properties"] for m in deployed.box.resources("AWS::Lambda::EventSourceMapping").values()]
        assert deployed.env["RYUSEN_QUEUE_ARN"] in [deployed.box.resolve(m["EventSourceArn"]) for m in mappings]
        for mapping in mappings:
            [queue] = mapping["EventSourceArn"]["Fn::GetAtt"][:1]
            source = (deployed.box.refs[queue], deployed.box.arns[queue], mapping)
            concurrency = min(4, int(mapping.get("ScalingConfig", {}).get("MaximumConcurrency", 4)))
            self.threads += [threading.Thread(target=self.loop, args=source, daemon=True) for _ in range(concurrency)]
        self.threads.append(threading.Thread(target=self.scheduler, daemon=True))

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)

    def scheduler(self) -> None:
        while not self.stop.wait(0.2):
            try:
                self.deliver_schedules()
            except Exception:
                logging.getLogger("box").exception("delivering schedules failed")

    def loop(self, queue_url: str, queue_arn: str, mapping: dict[str, Any]) -> None:
        batch_size = int(mapping["BatchSize"])
        reports_failures = "ReportBatchItemFailures" in mapping.get("FunctionResponseTypes", [])
        while not self.stop.is_set():
            messages = self.sqs.receive_message(
                QueueUrl=queue_url,
                MaxNumberOfMessages=batch_size,
                WaitTimeSeconds=1,
                MessageSystemAttributeNames=["All"],  # as the event source asks, the message group among them
                MessageAttributeNames=["All"],  # and a kept message's copy names the message it replaces
            ).get("Messages", [])
            if not messages:
                continue
            self.deployed.received.extend(messages)
            token = caller.set("dispatch")
            with self._lock:
                self.handled.extend((queue_arn, m["Body"]) for m in messages)
                self.running[queue_arn] = self.running.get(queue_arn, 0) + 1
                self.most_running[queue_arn] = max(self.most_running.get(queue_arn, 0), self.running[queue_arn])
            try:
                result = self.handler(sqs_batch(messages, source_arn=queue_arn), LambdaContext(self.deployed.budget_s))
            finally:
                caller.reset(token)
                with self._lock:
                    self.running[queue_arn] -= 1
            kept = {f["itemIdentifier"] for f in result.get("batchItemFailures", [])} if reports_failures else set()
            for message in messages:
                if message["MessageId"] not in kept:
                    self.sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])

    def deliver_schedules(self) -> None:
        """EventBridge Scheduler: a due schedule's input goes to its target, then the schedule is deleted."""
        env = self.deployed.env
        client = boto3.client("scheduler", region_name="us-east-1")
        for schedule in due_schedules(env["RYUSEN_SCHEDULE_GROUP"]):
            target = schedule["Target"]
            queues = {self.deployed.box.arns[n]: self.deployed.box.refs[n] for n in self.deployed.box.arns}
            assert target["Arn"] == env["RYUSEN_QUEUE_ARN"] or target["Arn"] in queues  # the shared, or an app's
            assert target["RoleArn"] == env["RYUSEN_SCHEDULER_ROLE_ARN"]
            assert target["DeadLetterConfig"]["Arn"] == env["RYUSEN_SCHEDULER_DLQ_ARN"]
            self.sqs.send_message(QueueUrl=queues.get(target["Arn"], self.queue_url), MessageBody=target["Input"])
            with contextlib.suppress(client.exceptions.ResourceNotFoundException):
                client.delete_schedule(Name=schedule["Name"], GroupName=env["RYUSEN_SCHEDULE_GROUP"])


@pytest.fixture(scope="module")
def deployed(synthesized: Synthesized) -> Iterator[Deployed]:
    saved = dict(os.environ)
    os.environ.update(
        {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    )
    with mock_aws():
        boto3.setup_default_session(region_name="us-east-1")
        box = Box(synthesized.template)
        box.create()
        session = boto3.DEFAULT_SESSION._session  # type: ignore[union-attr]
        session.get_component("event_emitter").register(
            "before-parameter-build", lambda **kw: box.record(caller.get())(**kw)
        )
        session.get_component("event_emitter").register(
            "before-call.lambda.Invoke", lambda **kw: box.invoke_event(**kw)
        )
        box.run_custom_resources()  # the example app's key, derived at deploy

        from ryusen_server.lambdas import api as api_lambda
        from ryusen_server.lambdas import dispatch as dispatch_lambda
        from ryusen_server.lambdas import results as results_lambda
        from ryusen_server.lambdas import sweep as sweep_lambda

        api_lambda._resolver = None
        dispatch_lambda._engine = None
        results_lambda._engine = None
        sweep_lambda._engine = None

        def api_handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
            token = caller.set("api")
            try:
                return api_lambda.handler(event, context)
            finally:
                caller.reset(token)

        gateway = ApiGateway(api_handler, authorize=box.authorize)
        base = {k: v for k, v in saved.items() if not k.startswith(("RYUSEN_", "POWERTOOLS_"))}
        # each function starts cold with exactly the environment the template gives it
        # ...except that the box serves the app's function URL on loopback, which a deployment's URL policy
        # refuses (a real function URL is public): the box allows loopback as the endpoint_allowed_networks
        # setting would
        loopback = {"RYUSEN_ENDPOINT_ALLOWED_NETWORKS": "127.0.0.0/8"}
        # the result function behind its Function URL (on loopback: plain http, so its own URL is set, where a
        # deployment's is read from the request's domain name)
        result_url = box.serve_function_url("ryusen_server.lambdas.results.handler", results_lambda.handler, "results")
        results_env = {
            **box.environment("ryusen_server.lambdas.results.handler", gateway.url),
            **loopback,
            "RYUSEN_RESULT_URL": result_url,
        }
        api_env = {**box.environment("ryusen_server.lambdas.api.handler", gateway.url), **loopback}
        dispatch_env = {**box.environment("ryusen_server.lambdas.dispatch.handler", gateway.url), **loopback}
        shop_env = box.environment("shop.lambda_handler", gateway.url)
        os.environ.clear()
        os.environ.update({**base, **api_env, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})
        token = caller.set("api")
        api_lambda.resolver()
        caller.reset(token)
        os.environ.clear()
        os.environ.update({**base, **results_env, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})
        token = caller.set("results")
        results_lambda.engine()  # cold, with exactly its own environment
        caller.reset(token)
        os.environ.clear()
        os.environ.update(
            {**base, **dispatch_env, **shop_env, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        )
        token = caller.set("dispatch")
        dispatch_lambda.engine()
        caller.reset(token)
        sweep_env = box.environment("ryusen_server.lambdas.sweep.handler", gateway.url)
        saved_env = dict(os.environ)
        os.environ.clear()
        os.environ.update({**base, **sweep_env, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})
        token = caller.set("sweep")
        sweep_lambda.engine()  # cold, with exactly its own environment
        caller.reset(token)
        os.environ.clear()
        os.environ.update(saved_env)
        shop = load_example()
        front_end = FrontEnd(shop.lambda_handler)
        shop_arn = box.function_arn("shop.lambda_handler")
        shop_url = box.function_url(front_end, arn=shop_arn)
        box.event_handlers[shop_arn] = (shop.lambda_handler, "shop")  # attempts sent as events (way C)
        deployed = Deployed(box=box, api_url=gateway.url, shop_url=shop_url, env=dispatch_env, front_end=front_end)
        source = deployed.source = EventSource(deployed, dispatch_lambda.handler)
        source.start()
        try:
            response = deployed.api("PUT", "/v1/apps/shop", {"url": shop_url})
            assert response.status_code == 200, response.text
            yield deployed
        finally:
            source.close()
            gateway.close()
            box.close()
            api_lambda._resolver = None
            dispatch_lambda._engine = None
            results_lambda._engine = None
            sweep_lambda._engine = None
    os.environ.clear()
    os.environ.update(saved)


def test_iam_routes_refuse_unsigned_requests(deployed: Deployed) -> None:
    assert deployed.api("GET", "/v1/runs", signed=False).status_code == 403
    assert deployed.api("GET", "/v1/functions").status_code == 200


def test_a_checkout_completes(deployed: Deployed) -> None:
    run = deployed.finished(deployed.start({"sku": "lamp", "qty": 1, "card": "4242", "amount": 30}))
    assert run["outcome"] == "completed" and [s["id"] for s in run["steps"]] == ["reserve-stock", "charge-card", "ship"]


@pytest.mark.rfd("K2")
def test_the_client_signs_with_sigv4_and_drives_the_deployed_api(deployed: Deployed) -> None:
    """Decision 34: ``ryusen.Client`` against the deployed API, its requests signed with the caller's AWS
    credentials (API Gateway's IAM authorization refuses them unsigned)."""
    from ryusen.client import AuthorizationError, Client, ConflictError, RunFailedError

    with Client(deployed.api_url, auth="none") as unsigned, pytest.raises(AuthorizationError) as refused:
        unsigned.list()
    assert refused.value.status == 403
    with Client(deployed.api_url, auth="sigv4") as client:
        assert {a["app_id"] for a in client.apps()} == {"shop"}
        assert "checkout" in {f["id"] for f in client.functions()}
        order = {"sku": "lamp", "qty": 1, "card": "4242", "amount": 30}
        handle = client.start("checkout", order, idempotency_key="box-client-1")
        output = handle.result(timeout=60)
        assert output and client.get(handle.id).outcome == "completed"
        assert client.start("checkout", order, idempotency_key="box-client-1").id == handle.id
        with pytest.raises(ConflictError) as reused:
            client.start("checkout", {**order, "amount": 31}, idempotency_key="box-client-1")
        assert reused.value.code == "idempotency_key_reused"
        assert handle.id in [r.id for r in client.list(function="checkout", limit=50).runs]
        slow = client.start("checkout", {**order, "slow_ship_s": 3})
        wait_for(lambda: any(s["id"] == "ship" and s["status"] == "running" for s in slow.get().steps))
        slow.cancel("customer")
        with pytest.raises(RunFailedError) as cancelled:
            slow.result(timeout=60)
        assert cancelled.value.run.summary == "cancelled, fully compensated"


def test_every_task_of_a_checkout_is_in_its_apps_message_group(deployed: Deployed) -> None:
    """Issue 25: the dispatch queue is an SQS fair queue whose tenant is the app; the API function's first
    discovery and the dispatch function's later tasks all carry the run's app as their group."""
    run_id = deployed.start({"sku": "lamp", "qty": 1, "card": "4242", "amount": 30})
    deployed.finished(run_id)
    tasks = [m for m in list(deployed.received) if json.loads(m["Body"]).get("run_id") == run_id]
    assert tasks and {m["Attributes"].get("MessageGroupId") for m in tasks} == {"shop"}


def test_a_declined_card_is_compensated(deployed: Deployed) -> None:
    run = deployed.finished(deployed.start({"sku": "lamp", "qty": 1, "card": "4000", "amount": 30}))
    assert run["summary"] == "failed, fully compensated"
    assert [u["step_id"] for u in run["unwind"]] == ["reserve-stock"]


def test_a_cancel_while_shipping_settles_then_compensates(deployed: Deployed) -> None:
    run_id = deployed.start({"sku": "lamp", "qty": 1, "card": "4242", "amount": 30, "slow_ship_s": 3})
    wait_for(
        lambda: any(s["id"] == "ship" and s["status"] == "running" for s in deployed.run(run_id)["steps"]),
        what="shipping to start",
    )
    assert deployed.api("POST", f"/v1/runs/{run_id}/cancel", {"reason": "customer"}).status_code == 202
    run = deployed.finished(run_id)
    assert run["summary"] == "cancelled, fully compensated"
    assert [u["step_id"] for u in run["unwind"]] == ["ship", "charge-card", "reserve-stock"]


def test_a_deadline_fires_from_the_schedule_the_engine_created(deployed: Deployed) -> None:
    run_id = deployed.start({"sku": "lamp", "qty": 1, "card": "4242", "amount": 30, "slow_ship_s": 4}, timeout_s=1)
    run = deployed.finished(run_id)
    assert run["summary"] == "timed out, fully compensated" and run["stop_intent"]["kind"] == "timeout"


def test_a_late_result_reaches_the_result_function_without_aws_credentials(deployed: Deployed) -> None:
    deployed.budget_s = 16  # the dispatcher stops listening after about 4 s, the shipment takes 7
    try:
        run_id = deployed.start({"sku": "lamp", "qty": 1, "card": "4242", "amount": 30, "slow_ship_s": 7})
        run = deployed.finished(run_id)
    finally:
        deployed.budget_s = 900
    assert run["outcome"] == "completed"
    ship_at = [s["id"] for s in run["steps"]].index("ship")
    ship = run["steps"][ship_at]
    assert [a["status"] for a in ship["attempts"]] == ["succeeded"]
    # the one write that accepted the shipment's success is the result function's (its Function URL, issue 25),
    # not the dispatcher's: the journal entry of this run that records ship completed and its attempt succeeded
    accepted = [c.function for c in run_writes(deployed, run_id) if completes_step(c.item, ship_at)]
    assert accepted == ["results"], accepted
    result_url = deployed.env["RYUSEN_RESULT_URL"]
    assert not result_url.startswith(deployed.api_url)  # the dispatcher hands SDKs the result function's URL
    unsigned = httpx.post(result_url, json={"run_id": run_id}, timeout=30)
    assert unsigned.status_code == 401 and unsigned.json()["error"]["code"] == "invalid_signature"
    assert httpx.get(result_url, timeout=30).status_code == 405
    # the API's route still takes a late result (an SDK handed its URL before an upgrade), and refuses the same
    assert deployed.api("POST", "/v1/results", {"run_id": run_id}, signed=False).status_code == 401


@dataclass
class RunWrite:
    function: str
    item: dict[str, Any]


def run_writes(deployed: Deployed, run_id: str) -> list[RunWrite]:
    """Every journal entry of ``run_id`` a function wrote (a PutItem, or the Put of a transaction)."""
    items: list[RunWrite] = []
    for call in deployed.box.calls:
        if call.operation == "PutItem":
            puts = [call.params["Item"]]
        elif call.operation == "TransactWriteItems":
            puts = [t["Put"]["Item"] for t in call.params["TransactItems"] if "Put" in t]
        else:
            continue
        items += [
            RunWrite(call.function, item)
            for item in puts
            if item["pk"]["S"] == f"RUN#{run_id}" and item["sk"]["S"].startswith(ENTRY_PREFIX)
        ]
    return items


def completes_step(item: dict[str, Any], index: int) -> bool:
    """The journal entry sets the step at ``index`` completed, with an attempt that succeeded."""
    delta, _ = _unpack(item["entry"]["B"])
    change = delta.get("steps", {}).get("set", {}).get(str(index), {})
    step = change.get("diff") or change.get("new") or {}
    attempts = step.get("attempts", {}).get("set", {}) if isinstance(step.get("attempts"), dict) else {}
    succeeded = any((a.get("diff") or a.get("new") or {}).get("status") == "succeeded" for a in attempts.values())
    return step.get("status") == "completed" and succeeded


def calls_of(deployed: Deployed, function: str) -> list[Call]:
    return [c for c in deployed.box.calls if c.function == function]


def test_every_function_called_aws(deployed: Deployed) -> None:
    """What tests/infra/test_iam.py checks against the template's roles was actually exercised."""
    for function in ("api", "dispatch", "shop"):
        assert calls_of(deployed, function), function
    time.sleep(0)


# ---- IAM proven against use ------------------------------------------------------------------------

ENGINE_RUNTIME = {
    "dynamodb:BatchGetItem",
    "dynamodb:BatchWriteItem",
    "dynamodb:GetItem",
    "dynamodb:PutItem",
    "dynamodb:Query",
    "dynamodb:UpdateItem",
    "sqs:SendMessage",
    "scheduler:CreateSchedule",
    "scheduler:DeleteSchedule",
    "iam:PassRole",
    "secretsmanager:GetSecretValue",
    "logs:CreateLogStream",
    "logs:PutLogEvents",
}
"""What every function that runs the engine may do (the API, the dispatcher, the sweeper)."""
KEPT = {
    "api": ENGINE_RUNTIME,
    "dispatch": ENGINE_RUNTIME
    | {
        "lambda:InvokeFunction",  # the example app's attempts, sent as events (way C): that function only
        "sqs:ChangeMessageVisibility",
        # what the SQS event source does on the function's behalf
        "sqs:ReceiveMessage",
        "sqs:DeleteMessage",
        "sqs:GetQueueAttributes",
        "sqs:GetQueueUrl",
    },
    # records outcomes and carries runs on as a dispatcher does, without a message (the next attempt as an event)
    "results": ENGINE_RUNTIME | {"lambda:InvokeFunction"},
    "shop": {"secretsmanager:GetSecretValue", "dynamodb:PutItem", "logs:CreateLogStream", "logs:PutLogEvents"},
    "sweep": ENGINE_RUNTIME - {"secretsmanager:GetSecretValue"},  # it signs and verifies nothing: no key
    # the custom resource that derives the example app's key at deploy: reads the master, writes the app's secret
    "derive_app_key": {
        "secretsmanager:GetSecretValue",
        "secretsmanager:PutSecretValue",
        "logs:CreateLogStream",
        "logs:PutLogEvents",
    },
}
"""Every action each role grants. A new grant must be added here on purpose (and be needed by the code)."""
HANDLER_OF = {
    "api": "ryusen_server.lambdas.api.handler",
    "dispatch": "ryusen_server.lambdas.dispatch.handler",
    "results": "ryusen_server.lambdas.results.handler",
    "shop": "shop.lambda_handler",
    "sweep": "ryusen_server.lambdas.sweep.handler",
    "derive_app_key": "derive_app_key.handler",
}


def granted(box: Box, handler: str) -> list[tuple[set[str], list[str], dict[str, Any]]]:
    """(actions, resources, conditions) of each Allow statement of the function's role, resolved."""
    role = box.function(handler)["Properties"]["Role"]["Fn::GetAtt"][0]
    statements: list[tuple[set[str], list[str], dict[str, Any]]] = []
    for policy in box.resources("AWS::IAM::Policy").values():
        if {"Ref": role} not in policy["Properties"]["Roles"]:
            continue
        for statement in policy["Properties"]["PolicyDocument"]["Statement"]:
            assert statement["Effect"] == "Allow"
            actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
            resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
            statements.append((set(actions), [str(box.resolve(r)) for r in resources], statement.get("Condition", {})))
    return statements


def needed(box: Box, call: Call) -> list[tuple[str, str]]:
    """The IAM (action, resource ARN) pairs one recorded API call needs."""
    region_account = "us-east-1:123456789012"
    table_arn = lambda name: f"arn:aws:dynamodb:{region_account}:table/{name}"  # noqa: E731
    queue_arn = {url: box.arns[name] for name, url in box.refs.items() if url.startswith("http")}
    params = call.params
    if call.service == "dynamodb":
        if call.operation == "TransactWriteItems":  # authorized as the item actions it contains
            kinds = {
                "Put": "PutItem",
                "Update": "UpdateItem",
                "Delete": "DeleteItem",
                "ConditionCheck": "ConditionCheckItem",
            }
            return [
                (f"dynamodb:{kinds[kind]}", table_arn(item[kind]["TableName"]))
                for item in params["TransactItems"]
                for kind in item
            ]
        if call.operation in ("BatchGetItem", "BatchWriteItem"):
            return [(f"dynamodb:{call.operation}", table_arn(name)) for name in params["RequestItems"]]
        arn = table_arn(params["TableName"])
        if "IndexName" in params:
            arn += f"/index/{params['IndexName']}"
        return [(f"dynamodb:{call.operation}", arn)]
    if call.service == "sqs":
        return [(f"sqs:{call.operation}", queue_arn[params["QueueUrl"]])]
    if call.service == "scheduler":
        arn = f"arn:aws:scheduler:{region_account}:schedule/{params['GroupName']}/{params['Name']}"
        pairs = [(f"scheduler:{call.operation}", arn)]
        if call.operation == "CreateSchedule":
            pairs.append(("iam:PassRole", params["Target"]["RoleArn"]))
        return pairs
    if call.service == "secretsmanager":
        return [(f"secretsmanager:{call.operation}", params["SecretId"])]
    if call.service == "lambda" and call.operation == "Invoke":
        return [("lambda:InvokeFunction", params["FunctionName"])]
    raise AssertionError(f"an AWS call the IAM check does not know: {call.service}.{call.operation}")


def test_every_aws_call_each_function_made_is_allowed_by_its_role_and_nothing_more_is(deployed: Deployed) -> None:
    import fnmatch

    # one more run that exercises the rest: an idempotency key (a transaction), a deadline schedule deleted
    run_id = deployed.start(
        {"sku": "lamp", "qty": 1, "card": "4242", "amount": 30}, idempotency_key="iam-1", timeout_s=3600
    )
    deployed.finished(run_id)
    from ryusen_server.lambdas import sweep as sweep_lambda

    token = caller.set("sweep")
    try:
        swept = sweep_lambda.handler({"source": "aws.events"}, LambdaContext(60))  # the rule's every-minute call
    finally:
        caller.reset(token)
    assert swept == {"checked": 0, "repaired": []}  # every run finished: nothing to look at
    box = deployed.box
    operations = {(c.function, c.operation) for c in box.calls}
    for expected in [
        ("api", "TransactWriteItems"),
        ("api", "CreateSchedule"),
        ("results", "DeleteSchedule"),  # the run's deadline, by the write that finished it (an event's outcome)
        ("dispatch", "ChangeMessageVisibility"),
        ("dispatch", "PutItem"),
        ("dispatch", "Invoke"),  # an attempt of the example app, sent as an event
        ("results", "PutItem"),  # the late result it accepted
        ("api", "GetSecretValue"),
        ("dispatch", "GetSecretValue"),
        ("shop", "GetSecretValue"),
        ("shop", "PutItem"),  # what it accepted, in the replay table its containers share
        ("derive_app_key", "PutSecretValue"),  # the example app's key, derived at deploy
        ("api", "Query"),
        ("sweep", "Query"),  # the index of runs to check
    ]:
        assert expected in operations, f"the scenarios never made {expected}: the check would prove nothing"
    for function, handler in HANDLER_OF.items():
        statements = granted(box, handler)
        actions = set().union(*(a for a, _, _ in statements))
        assert actions == KEPT[function], (function, actions ^ KEPT[function])
        for resources in (r for _, r, _ in statements):
            assert "*" not in resources, (function, resources)  # every grant names its resources
        for call in (c for c in box.calls if c.function == function):
            for action, resource in needed(box, call):
                assert any(
                    action in allowed and any(fnmatch.fnmatchcase(resource, pattern) for pattern in patterns)
                    for allowed, patterns, _ in statements
                ), f"{function} called {call.service}.{call.operation}: its role does not allow {action} on {resource}"


def test_a_checkout_completes_through_throttled_writes_and_a_throttled_function_url(deployed: Deployed) -> None:
    """Issue 24 in the stack as deployed: the DynamoDB writes of the dispatcher and of the result function (which
    records the outcomes of attempts sent as events, and authorizes the next) are throttled past botocore's
    retries (and transactions are cancelled for throttling), and the shop's Function URL answers 429 twice
    before running anything. Every step still runs once, and no attempt is ever Unknown."""
    assert deployed.front_end is not None
    faults = AwsFaults(caller=caller)
    with faults.installed():
        for who in ("dispatch", "results"):
            faults.add("dynamodb", "PutItem", kind="throttled", times=3, caller=who)
            faults.add("dynamodb", "TransactWriteItems", kind="transaction_throttled", times=2, caller=who)
        deployed.front_end.throttle(2)
        run = deployed.finished(deployed.start({"sku": "lamp", "qty": 1, "card": "4242", "amount": 30}), timeout=90)
    assert run["outcome"] == "completed", run["summary"]
    assert deployed.front_end.throttled == 2
    assert faults.count("throttled") == 6 and faults.count("transaction_throttled") >= 2
    attempts = [a for step in run["steps"] for a in step["attempts"]]
    assert [step["id"] for step in run["steps"]] == ["reserve-stock", "charge-card", "ship"]
    assert [a["status"] for a in attempts] == ["succeeded"] * 3  # each step ran once, and only once
    assert not [a for a in attempts if a.get("unknown")], "an attempt was Unknown"


# ---- issue 25: acknowledged attempts, the result function, heartbeats ----------------------------------------


def _encoder_app(master: str) -> Any:
    """An app served over WSGI (so it acknowledges long attempts), signing with its key derived from ``master``."""
    from datetime import timedelta

    import ryusen
    from ryusen import Ryusen, Step
    from ryusen._internal.signing import app_key

    app = Ryusen("encoder", signing_key=app_key(master, "encoder"))

    def encode(seconds: float) -> dict[str, Any]:
        for i in range(int(seconds * 10)):
            ryusen.heartbeat({"progress": round((i + 1) / (seconds * 10), 2)})
            time.sleep(0.1)
        return {"encoded": seconds}

    @app.function("publish")
    def publish(data: dict[str, Any], step: Step) -> Any:
        step.run("fetch", lambda: {"fetched": True})
        encoded = step.run(
            "encode", encode, data["seconds"], timeout=timedelta(minutes=5), heartbeat=timedelta(seconds=30)
        )
        step.run("notify", lambda: {"notified": True})
        return encoded

    return app


def test_a_long_step_is_acknowledged_and_its_outcome_carries_the_run_on_through_the_result_function(
    deployed: Deployed,
) -> None:
    """No dispatcher waits through the 2 s callback: the WSGI endpoint answers "accepted", the dispatch message
    stays as the lease timer, and the outcome posted to the result function is recorded there with the next step
    authorized in the same write and invoked from there (no queue message). Its heartbeats reach it too."""
    from werkzeug.serving import make_server

    from ryusen_server.lambdas import dispatch as dispatch_lambda

    master = dispatch_lambda.engine().engine.master_keys()[0]
    server = make_server("127.0.0.1", 0, _encoder_app(master).wsgi(), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/"
        synced = deployed.api("PUT", "/v1/apps/encoder", {"url": url})
        assert synced.status_code == 200, synced.text
        before = len(deployed.box.calls)
        response = deployed.api("POST", "/v1/functions/publish/runs", {"input": {"seconds": 2}})
        assert response.status_code == 201, response.text
        run_id = response.json()["id"]
        run = deployed.finished(run_id)
    finally:
        server.shutdown()
    assert run["outcome"] == "completed" and run["output"] == {"encoded": 2}
    steps = {s["id"]: s for s in run["steps"]}
    [encode] = steps["encode"]["attempts"]
    assert encode["status"] == "succeeded" and encode["unknown"] is None
    # its first heartbeat reached the result function (the next may go a quarter interval, 7.5 s, later)
    assert encode["heartbeat"]["details"] == {"progress": 0.05}
    writes = run_writes(deployed, run_id)
    encode_at = [s["id"] for s in run["steps"]].index("encode")
    assert [w.function for w in writes if completes_step(w.item, encode_at)] == ["results"]
    calls = deployed.box.calls[before:]
    # it carried the run on itself (notify answered inline, then the run completed): no task went through the queue,
    # and nothing was left in flight to need a lease timer
    assert not [c for c in calls if c.function == "results" and c.operation == "SendMessage"]
    assert [s["id"] for s in run["steps"]] == ["fetch", "encode", "notify"]


def _timed_dispatches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float, float]]:
    """Each dispatch record handled from now on: (its message, when its handling began, when it ended)."""
    from ryusen_server.lambdas import dispatch as dispatch_lambda

    spans: list[tuple[str, float, float]] = []
    handle = dispatch_lambda.record_handler

    def timed(record: Any, lambda_context: Any = None) -> None:
        began = time.monotonic()
        try:
            handle(record, lambda_context)
        finally:
            spans.append((json.dumps(record.body.model_dump(mode="json")), began, time.monotonic()))

    monkeypatch.setattr(dispatch_lambda, "record_handler", timed)
    return spans


@pytest.mark.rfd("H4")
def test_a_long_steps_cost_does_not_grow_with_its_duration(deployed: Deployed, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs whose middle step takes 0.5 s and 3 s make the same AWS requests and Lambda invocations, and no
    dispatch invocation lasts through the callback: each one that began while it ran ended before it did (an
    order of events, not a time limit). bench/cost.py prices it."""
    from werkzeug.serving import make_server

    from ryusen_server.lambdas import dispatch as dispatch_lambda

    spans = _timed_dispatches(monkeypatch)
    master = dispatch_lambda.engine().engine.master_keys()[0]
    server = make_server("127.0.0.1", 0, _encoder_app(master).wsgi(), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    made: dict[float, Counter[tuple[str, str]]] = {}
    try:
        url = f"http://127.0.0.1:{server.server_port}/"
        assert deployed.api("PUT", "/v1/apps/encoder", {"url": url}).status_code == 200
        for seconds in (0.5, 0.5, 3.0):  # the first warms the result function (its secret, its release cache)
            before, spans_before = len(deployed.box.calls), len(spans)
            response = deployed.api("POST", "/v1/functions/publish/runs", {"input": {"seconds": seconds}})
            assert response.status_code == 201, response.text
            started = time.monotonic()
            run = deployed.finished(response.json()["id"])
            assert run["outcome"] == "completed" and run["output"] == {"encoded": seconds}
            encode = next(s for s in run["steps"] if s["id"] == "encode")["attempts"][0]
            callback_ended = (
                started
                + (
                    datetime.fromisoformat(encode["settled_at"]) - datetime.fromisoformat(run["created_at"])
                ).total_seconds()
            )
            run_id = run["id"]
            ours = [(b, e) for body, b, e in spans[spans_before:] if run_id in body]
            during = [(b, e) for b, e in ours if b < callback_ended - 0.5]
            assert during and all(e < callback_ended for _, e in during)  # none waited for the callback
            # what is billed per step: writes, queue requests and dispatch invocations (reads vary with warm
            # caches, and the API's with this test's polling)
            made[seconds] = Counter(
                (c.function, c.operation)
                for c in deployed.box.calls[before:]
                if c.function not in ("test", "api") and c.operation in BILLED_PER_STEP
            )
            made[seconds][("dispatch", "Invoke")] = len(ours)
    finally:
        server.shutdown()
    assert made[0.5] == made[3.0], (made[0.5] - made[3.0], made[3.0] - made[0.5])
    assert made[3.0][("results", "PutItem")] + made[3.0][("results", "TransactWriteItems")] >= 1


@pytest.mark.rfd("H4")
def test_a_lambda_endpoints_long_step_is_sent_as_an_event_and_no_dispatcher_waits_for_it(
    deployed: Deployed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Way C (docs/design/dispatch.md): the example app, a Lambda, announces ``lambda_event`` with its ARN (its
    containers share a replay table). Its 3 s shipment is sent to it as an asynchronous event: no dispatch
    invocation lasts through the callback, the outcome is posted to the result function, which records it and
    sends the next attempt as an event itself. The same requests are made for a 0.5 s shipment. (With the quick
    path off: the shop's other steps, quick in the tests before, would go inline; its own test is below.)"""
    _inline_up_to(monkeypatch, 0.0)
    spans = _timed_dispatches(monkeypatch)
    shop_arn = deployed.box.function_arn("shop.lambda_handler")
    made: dict[float, Counter[tuple[str, str]]] = {}
    for seconds in (0.5, 0.5, 3.0):
        before, spans_before, events_before = len(deployed.box.calls), len(spans), len(deployed.box.events)
        started = time.monotonic()
        order = {"sku": "lamp", "qty": 1, "card": "4242", "amount": 30, "slow_ship_s": seconds}
        run = deployed.finished(deployed.start(order))
        assert run["outcome"] == "completed", run["summary"]
        ship = next(s for s in run["steps"] if s["id"] == "ship")["attempts"]
        assert [a["status"] for a in ship] == ["succeeded"] and ship[0]["unknown"] is None
        callback_ended = (
            started
            + (
                datetime.fromisoformat(ship[0]["settled_at"]) - datetime.fromisoformat(run["created_at"])
            ).total_seconds()
        )
        ours = [(b, e) for body, b, e in spans[spans_before:] if run["id"] in body]
        during = [(b, e) for b, e in ours if b < callback_ended - 0.5]
        assert during and all(e < callback_ended for _, e in during)  # none waited for the callback
        events = [e for arn, e in deployed.box.events[events_before:] if arn == shop_arn and run["id"] in e["body"]]
        assert len(events) == 3  # each step's attempt (reserve, charge, ship) went as an event; discovery did not
        calls = deployed.box.calls[before:]
        assert {c.function for c in calls if c.operation == "Invoke"} <= {"dispatch", "results"}
        assert [c for c in calls if c.function == "results" and c.operation == "Invoke"]  # it sent the next itself
        made[seconds] = Counter(
            (c.function, c.operation)
            for c in calls
            if c.function not in ("test", "api") and c.operation in BILLED_PER_STEP | {"Invoke"}
        )
        made[seconds][("dispatch", "handled")] = len(ours)
    assert made[0.5] == made[3.0], (made[0.5] - made[3.0], made[3.0] - made[0.5])


def _serve_for_events(deployed: Deployed, app: Any, name: str) -> str:
    """Serve a Lambda app ``name`` at a Function URL and for events (as its function's ARN), and sync it: the ARN."""
    arn = f"arn:aws:lambda:us-east-1:123456789012:function:{name}"
    url = deployed.box.function_url(app.lambda_handler, who="shop", arn=arn)
    deployed.box.event_handlers[arn] = (app.lambda_handler, "shop")
    synced = deployed.api("PUT", f"/v1/apps/{name}", {"url": url})
    assert synced.status_code == 200, synced.text
    return arn


def _event_app(deployed: Deployed, name: str) -> tuple[str, list[str]]:
    """A Lambda app (its containers sharing a replay memory) served at a Function URL and for events, synced:
    its function's ARN, and what its callbacks ran (a step's id, each time it ran)."""
    from datetime import timedelta

    from ryusen import Ryusen, Step
    from ryusen._internal.signing import SeenRequests, app_key
    from ryusen_server.lambdas import dispatch as dispatch_lambda

    class Shared(SeenRequests):
        shared = True

    master = dispatch_lambda.engine().engine.master_keys()[0]
    app = Ryusen(name, signing_key=app_key(master, name), seen_requests=Shared())
    ran: list[str] = []

    def effect(step_id: str, size: int) -> dict[str, Any]:
        ran.append(step_id)
        return {"step": step_id, "padding": "x" * size}

    @app.function(f"{name}-flow")
    def flow(data: dict[str, Any], step: Step) -> Any:
        first = step.run("first", effect, "first", data.get("size", 0), timeout=timedelta(seconds=5))
        second = step.run("second", effect, "second", 0, timeout=timedelta(seconds=5))
        return {"first": len(first["padding"]), "second": second["step"]}

    arn = _serve_for_events(deployed, app, name)
    return arn, ran


def _start(deployed: Deployed, function: str, data: dict[str, Any]) -> str:
    response = deployed.api("POST", f"/v1/functions/{function}/runs", {"input": data})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def test_a_copy_of_an_attempts_event_that_lambda_delivers_again_runs_nothing(deployed: Deployed) -> None:
    """Lambda's async queue delivers each event twice here. The copy carries the same signed request, which the
    app's shared replay memory refuses before any user code: each effect ran once, and no attempt is Unknown."""
    arn, ran = _event_app(deployed, "twice")
    handler, who = deployed.box.event_handlers[arn]
    answers: list[tuple[int, ...]] = []  # one (first delivery, copy) pair an event, appended whole

    def twice(event: dict[str, Any], context: Any) -> dict[str, Any]:
        pair = tuple(int(handler(json.loads(json.dumps(event)), context)["statusCode"]) for _ in range(2))
        answers.append(pair)
        return {"statusCode": 202}

    deployed.box.event_handlers[arn] = (twice, who)
    run = deployed.finished(_start(deployed, "twice-flow", {}))
    assert run["outcome"] == "completed", run["summary"]
    # The run completes when the second event's first delivery posts its outcome, which may be before that event's
    # copy is refused: wait for the copy (the events run on the box's event threads, not this one).
    deadline = time.monotonic() + 10
    while len(answers) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran == ["first", "second"], "an effect ran twice"
    assert answers == [(202, 401), (202, 401)]  # each copy refused as replayed
    attempts = [a for s in run["steps"] for a in s["attempts"]]
    assert [a["status"] for a in attempts] == ["succeeded", "succeeded"] and not [a for a in attempts if a["unknown"]]


QUICK_ON_A_LOADED_MACHINE_S = 0.6
"""The quick path's threshold in the tests that learn a step quick: a step here sleeps 0 s, yet an attempt's
authorization-to-outcome on a loaded 2-core CI machine (the app's first event, a thread switch) has taken more
than the default (0.05 s), and one such sample keeps the step off the quick path for its next five. Slow in these
tests is 0.7 s or more."""


def _inline_up_to(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Set ``inline_up_to_s`` in the box's dispatch and result functions (0: the quick path off)."""
    from ryusen_server.lambdas import dispatch as dispatch_lambda
    from ryusen_server.lambdas import results as results_lambda

    for wired in (dispatch_lambda.engine(), results_lambda.engine()):
        monkeypatch.setattr(wired.engine, "settings", replace(wired.engine.settings, inline_up_to_s=seconds))


def _app_sharing_replays(name: str) -> Any:
    """An app ``name`` signing with its key derived from the box's master, whose containers share a replay memory
    (so it may announce ``lambda_event``)."""
    from ryusen import Ryusen
    from ryusen._internal.signing import SeenRequests, app_key
    from ryusen_server.lambdas import dispatch as dispatch_lambda

    class Shared(SeenRequests):
        shared = True

    master = dispatch_lambda.engine().engine.master_keys()[0]
    return Ryusen(name, signing_key=app_key(master, name), seen_requests=Shared())


def _timed_app(
    deployed: Deployed,
    name: str,
    *,
    steps: tuple[str, ...] = ("a", "b", "c"),
    timeout_s: float = 8.0,
    retry: Any = None,
    default_s: float = 0.0,
) -> tuple[str, list[str], dict[str, float], Any]:
    """A Lambda app that takes events (as ``_event_app``) whose steps all call ``work`` (one step name), each with
    the given timeout and retry policy: its function's ARN, the step ids in the order their callbacks started, the
    sleeps (``slow[step_id]``: how long that step sleeps, once; else ``default_s``), and the app."""
    from ryusen import Step

    app = _app_sharing_replays(name)
    ran: list[str] = []
    slow: dict[str, float] = {}

    def work(step_id: str) -> str:
        ran.append(step_id)
        time.sleep(slow.pop(step_id, default_s))
        return step_id

    @app.function(f"{name}-flow")
    def flow(data: dict[str, Any], step: Step) -> Any:
        return [step.run(s, work, s, timeout=timedelta(seconds=timeout_s), retry=retry) for s in steps]

    arn = _serve_for_events(deployed, app, name)
    return arn, ran, slow, app


def _sent_as_events(deployed: Deployed, arn: str, run_id: str, since: int) -> list[str]:
    """The step ids of the run's attempts sent to ``arn`` as events since ``since``."""
    sent = [json.loads(e["body"]) for a, e in deployed.box.events[since:] if a == arn and run_id in e["body"]]
    return [body["step_id"] for body in sent]


def _messages_due_now() -> None:
    """Every message on the box's queues visible now (moto's delays and visibility ended), once."""
    from moto.sqs.models import sqs_backends

    for account in sqs_backends.values():
        for backend in account.values():
            for queue in backend.queues.values():
                for message in queue._messages:
                    message.delayed_until = 0.0
                    message.visible_at = 0.0


def _lease_timers_now(deployed: Deployed) -> None:
    """Run forward the lease timers of finished runs' attempts: the result function's, sent with a delay, and the
    dispatch messages kept as one (moto's delay or visibility is ended, as the lease's end would), again until
    the dispatchers have judged them all and the queue is empty (one handled at the moment of a pass may be kept
    again)."""

    sqs = boto3.client("sqs", region_name="us-east-1")
    names = [
        "ApproximateNumberOfMessages",
        "ApproximateNumberOfMessagesNotVisible",
        "ApproximateNumberOfMessagesDelayed",
    ]
    deadline = time.monotonic() + 60
    while True:
        time.sleep(0.5)  # a dispatcher still handling a message lets it go first
        _messages_due_now()
        time.sleep(0.5)
        counts = sqs.get_queue_attributes(QueueUrl=deployed.env["RYUSEN_QUEUE_URL"], AttributeNames=names)
        if all(v == "0" for v in counts["Attributes"].values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the dispatch queue did not empty: {counts['Attributes']}")


def test_a_step_a_lambda_endpoint_ran_quickly_is_waited_for_by_a_dispatcher_and_one_slow_for_once_holds_it_2_s(
    deployed: Deployed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 25's fast path, measured: an event costs about $0.57 per million steps more than an inline answer, and
    a dispatcher's wait $6.67 a second (docs/design/dispatch.md, way C item 6). A dispatcher that has seen a step's last three
    attempts take at most inline_up_to_s (from the runs it read: here, as their lease timers came back) invokes
    the next on the URL and waits, and chains the next steps so while they stay quick: a run of quick steps sends
    no event. A step quick until now that takes 3 s this time is listened for 2 s (INLINE_LISTEN_S): its SDK
    posts the outcome to the result function, which carries the run on with events; nothing is Unknown, each
    effect ran once. Once the dispatcher has read that run, the step goes as an event again. (The threshold is
    QUICK_ON_A_LOADED_MACHINE_S here.)"""
    _inline_up_to(monkeypatch, QUICK_ON_A_LOADED_MACHINE_S)
    arn, ran, slow, _ = _timed_app(deployed, "quick")
    before = len(deployed.box.events)
    run = deployed.finished(_start(deployed, "quick-flow", {}))
    assert run["outcome"] == "completed", run["summary"]
    assert _sent_as_events(deployed, arn, run["id"], before) == ["a", "b", "c"]  # nothing seen yet
    _lease_timers_now(deployed)  # each comes back to a dispatcher, which reads the run: three quick "work"s

    before = len(deployed.box.events)
    run = deployed.finished(_start(deployed, "quick-flow", {}))
    assert run["outcome"] == "completed", run["summary"]
    assert _sent_as_events(deployed, arn, run["id"], before) == []  # the dispatcher waited for each, and chained
    assert ran == ["a", "b", "c"] * 2, "an effect ran twice or not at all"

    slow["b"] = 3.0
    before = len(deployed.box.events)
    run = deployed.finished(_start(deployed, "quick-flow", {}))
    assert run["outcome"] == "completed", run["summary"]
    # "b" went inline, though slow this time: listened for 2 s, its outcome posted; the result function, which
    # never waits for a step (the app's Lambda would pay), sends "c" as an event
    assert _sent_as_events(deployed, arn, run["id"], before) == ["c"]
    b = next(s for s in run["steps"] if s["id"] == "b")["attempts"]
    assert [a["status"] for a in b] == ["succeeded"] and b[0]["unknown"] is None
    assert ran[-3:] == ["a", "b", "c"]
    _lease_timers_now(deployed)  # the dispatcher reads that run: "work" took 3 s once

    slow.clear()
    before = len(deployed.box.events)
    run = deployed.finished(_start(deployed, "quick-flow", {}))
    assert run["outcome"] == "completed", run["summary"]
    assert _sent_as_events(deployed, arn, run["id"], before) == ["a", "b", "c"]  # the last five hold the slow one
    assert ran == ["a", "b", "c"] * 4


def test_an_event_lambda_refuses_goes_to_the_url_and_is_waited_for(deployed: Deployed) -> None:
    """No grant (or no such function): Lambda refuses the event, and the engine sends the same attempt to the
    app's URL, as before events, and waits for it. The run completes; nothing ran twice."""
    arn, ran = _event_app(deployed, "refused")
    del deployed.box.event_handlers[arn]  # Lambda answers ResourceNotFoundException
    before = len(deployed.box.events)
    run = deployed.finished(_start(deployed, "refused-flow", {}))
    assert run["outcome"] == "completed", run["summary"]
    assert ran == ["first", "second"]
    assert len(deployed.box.events) == before  # nothing was queued
    assert [c for c in deployed.box.calls if c.operation == "Invoke" and c.params["FunctionName"] == arn]


def test_an_attempt_too_large_for_an_event_goes_to_the_url(deployed: Deployed) -> None:
    """An event is at most 256 KB: the second step's request carries the first's 200 KB result in its memo, with
    the run's input, so it goes to the URL and is waited for; the first, small, went as an event."""
    arn, ran = _event_app(deployed, "large")
    before = len(deployed.box.events)
    run_id = _start(deployed, "large-flow", {"size": 200_000, "ballast": "y" * 80_000})
    run = deployed.finished(run_id)
    assert run["outcome"] == "completed", run["summary"]
    assert ran == ["first", "second"]
    sent = [json.loads(e["body"]) for a, e in deployed.box.events[before:] if a == arn]
    assert [r.get("step_id") for r in sent] == ["first"]


def test_an_event_whose_invoke_answer_is_lost_is_unknown_and_never_run_again(
    deployed: Deployed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lambda's API fails with a 5xx after the request went (the event may or may not be queued): the engine
    cannot know whether the attempt runs. It is Unknown, and it is not sent again. Here the event was in fact
    queued and ran: its outcome, posted to the result function, settles the Unknown and the run goes on."""
    arn, ran = _event_app(deployed, "lost")
    box = deployed.box
    handler, who = box.event_handlers[arn]

    def later(event: dict[str, Any], context: Any) -> dict[str, Any]:
        time.sleep(1.0)  # Lambda's queue: the event runs after the engine has taken the failed Invoke's answer
        return handler(event, context)

    box.event_handlers[arn] = (later, who)
    original = box.invoke_event
    calls: list[int] = []

    def lost(params: dict[str, Any], **kw: Any) -> Any:
        answer = original(params, **kw)  # queued, and it runs
        calls.append(1)
        if len(calls) == 1:  # the first Invoke (the engine's client makes one try: botocore retries nothing)
            http = SimpleNamespace(status_code=500, headers={}, content=b"")
            return http, {"Error": {"Code": "ServiceException"}, "ResponseMetadata": {"HTTPStatusCode": 500}}
        return answer

    monkeypatch.setattr(box, "invoke_event", lost)
    run_id = _start(deployed, "lost-flow", {})
    run = deployed.finished(run_id)
    first = next(s for s in run["steps"] if s["id"] == "first")["attempts"]
    assert ran.count("first") == 1, "the attempt ran again"
    assert len(first) == 1 and first[0]["status"] == "succeeded"
    assert first[0]["unknown"] is not None  # taken as Unknown when the answer was lost, then settled late
    assert run["outcome"] == "completed", run["summary"]


BILLED_PER_STEP = {
    "PutItem",
    "TransactWriteItems",
    "BatchWriteItem",
    "UpdateItem",
    "SendMessage",
    "ReceiveMessage",
    "DeleteMessage",
    "ChangeMessageVisibility",
    "CreateSchedule",
    "DeleteSchedule",
}


def _relay_app(master: str) -> Any:
    """Two long steps over WSGI: the first's outcome reaches the result function, which invokes the second itself;
    the second heartbeats once, then goes silent for ``silent_s`` (a callback stuck, or its process gone)."""
    from datetime import timedelta

    import ryusen
    from ryusen import Ryusen, Step
    from ryusen._internal.signing import app_key

    app = Ryusen("relay", signing_key=app_key(master, "relay"))

    def stuck(silent_s: float) -> dict[str, Any]:
        ryusen.heartbeat({"progress": 0.1})
        time.sleep(silent_s)
        return {"done": True}

    @app.function("relay")
    def relay(data: dict[str, Any], step: Step) -> Any:
        step.run("first", lambda: time.sleep(0.5) or {"first": True})
        return step.run("stuck", stuck, data["silent_s"], timeout=timedelta(minutes=5), heartbeat=timedelta(seconds=2))

    return app


@pytest.mark.rfd("H2")
def test_an_attempt_the_result_function_left_in_flight_has_its_own_lease_timer(deployed: Deployed) -> None:
    """The result function invokes "stuck" and it is answered "accepted": no dispatch message holds its lease, so
    the function sends it a lease timer of its own. The callback heartbeats once and goes silent: it is Unknown
    within its heartbeat (2 s) and the grace (3 s) of that heartbeat, not at its 5-minute timeout, and the outcome
    it posts later settles it."""
    from werkzeug.serving import make_server

    from ryusen_server.lambdas import dispatch as dispatch_lambda

    master = dispatch_lambda.engine().engine.master_keys()[0]
    server = make_server("127.0.0.1", 0, _relay_app(master).wsgi(), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/"
        assert deployed.api("PUT", "/v1/apps/relay", {"url": url}).status_code == 200
        before = len(deployed.box.calls)
        response = deployed.api("POST", "/v1/functions/relay/runs", {"input": {"silent_s": 12}})
        assert response.status_code == 201, response.text
        run = deployed.finished(response.json()["id"], timeout=90)
    finally:
        server.shutdown()
    assert run["outcome"] == "completed" and run["output"] == {"done": True}
    [attempt] = next(s for s in run["steps"] if s["id"] == "stuck")["attempts"]
    assert attempt["status"] == "succeeded"  # the late outcome settled it
    assert attempt["unknown"] and attempt["unknown"]["reason"].startswith("no heartbeat within the step's heartbeat")
    silent = datetime.fromisoformat(attempt["unknown"]["at"]) - datetime.fromisoformat(attempt["heartbeat"]["at"])
    assert silent.total_seconds() < 2 + 3 + 3  # the heartbeat, the grace, and the timer's whole-second slack
    timers = [
        json.loads(c.params["MessageBody"])
        for c in deployed.box.calls[before:]
        if c.function == "results" and c.operation == "SendMessage"
    ]
    assert [t.get("step_id") for t in timers if t.get("lease_timer")] == ["stuck"]


FUNCTIONS = ("api", "dispatch", "results", "sweep", "shop")
"""The stack's functions and the example app's, as the box's calls name their callers."""


@pytest.mark.rfd("W4")
def test_a_thirty_day_sleep_makes_as_many_requests_as_a_one_day_sleep_and_none_while_it_waits(
    deployed: Deployed,
) -> None:
    """Decision 31 on AWS: a long wait is parked as one EventBridge Scheduler schedule whose target is the
    queue; nothing polls while it waits. The engine's clock is moved on past the wait (a box cannot wait 30
    days) and the schedule delivered as the Scheduler would; the requests of a 1-day and a 30-day sleep match."""
    from ryusen_server.lambdas import dispatch as dispatch_lambda
    from ryusen_server.lambdas import results as results_lambda

    env = deployed.env
    scheduler = boto3.client("scheduler", region_name="us-east-1")
    engines = [w.engine for w in (dispatch_lambda._engine, results_lambda._engine) if w is not None]
    real = [e.clock for e in engines]
    made: dict[float, Counter[tuple[str, str]]] = {}
    try:
        for days in (1.0, 30.0):
            before = len(deployed.box.calls)
            response = deployed.api(
                "POST", "/v1/functions/review-request/runs", {"input": {"customer": "ada", "wait_days": days}}
            )
            assert response.status_code == 201, response.text
            run_id = response.json()["id"]

            def parked(run_id: str = run_id) -> dict[str, Any] | None:
                listed = scheduler.list_schedules(GroupName=env["RYUSEN_SCHEDULE_GROUP"]).get("Schedules", [])
                for entry in listed:
                    schedule = scheduler.get_schedule(Name=entry["Name"], GroupName=env["RYUSEN_SCHEDULE_GROUP"])
                    if run_id in schedule["Target"]["Input"]:
                        return dict(schedule)
                return None

            schedule = wait_for(parked, what="the wait parked on the Scheduler")
            at = datetime.fromisoformat(schedule["ScheduleExpression"][3:-1]).replace(tzinfo=UTC)
            assert at - datetime.now(UTC) > timedelta(days=days) - timedelta(minutes=5)
            quiet = len(deployed.box.calls)
            time.sleep(2)  # while it waits: no function makes a request (the event source's long polls are AWS's)
            assert [c for c in deployed.box.calls[quiet:] if c.function in FUNCTIONS and run_id in repr(c.params)] == []
            # the wait is over: the engines' clocks move past it, and the Scheduler delivers the task
            offset = at - datetime.now(UTC) + timedelta(seconds=5)
            for engine in engines:
                engine.clock = lambda offset=offset: datetime.now(UTC) + offset
            sqs = boto3.client("sqs", region_name="us-east-1")
            sqs.send_message(QueueUrl=env["RYUSEN_QUEUE_URL"], MessageBody=schedule["Target"]["Input"])
            scheduler.delete_schedule(Name=schedule["Name"], GroupName=env["RYUSEN_SCHEDULE_GROUP"])
            run = deployed.finished(run_id)
            assert run["outcome"] == "completed" and run["output"]["asked"] == "ada"
            nap = next(s for s in run["steps"] if s["id"] == "until-review")
            assert nap["sleep"] and nap["attempts"][-1]["authorized_at"] is None  # no endpoint call for the wait
            made[days] = Counter(  # the run's own requests (a release's wake of blocked runs is not the run's)
                (c.service, c.operation)
                for c in deployed.box.calls[before:]
                # not the API's: this test's own polling of the run (GET, a Query each) is per poll, and how many
                # polls the run takes to finish is timing (CI once counted one more Query)
                if c.function in FUNCTIONS and c.function != "api" and run_id in repr(c.params)
            )
            for engine, clock in zip(engines, real, strict=True):
                engine.clock = clock
    finally:
        for engine, clock in zip(engines, real, strict=True):
            engine.clock = clock
    print("requests of a run with a 1-day and a 30-day sleep:", sorted(made[30.0].items()))
    assert made[1.0] == made[30.0], (made[1.0], made[30.0])
    assert made[30.0][("scheduler", "CreateSchedule")] >= 1

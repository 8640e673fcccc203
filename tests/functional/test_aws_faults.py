"""Issue 24, findings 3 and 4: what real AWS does to an answer the engine has in hand.

The dispatch Lambda handler runs on moto with tests/aws_faults.py injecting what botocore raises after its
own retries: a throttled write (``ProvisionedThroughputExceededException``, or a transaction cancelled with
``ThrottlingError``, which nothing retries), a 5xx, a write whose answer is lost. Before, any of these on the
write that records an endpoint's success failed the message; it came back at the lease's expiry and the step
was Unknown, so an operator had to act on a success the engine had. A Lambda Function URL's 429 (its front
end refusing before any code runs) was Unknown too.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from werkzeug.serving import make_server
from werkzeug.wrappers import Response

from ryusen import Ryusen, Step
from tests.aws_faults import AwsFaults, FrontEnd, mentions
from tests.functional.test_lambda_dispatch import aws, call, dispatch, receive  # noqa: F401 - the fixture

CALLS: list[str] = []


def build_app(faults: AwsFaults, arm: dict[str, Any]) -> Ryusen:
    app = Ryusen("box")

    def charge() -> dict[str, Any]:
        CALLS.append("charge")
        for kind, times in arm.get("faults", []):
            # from now on (the callback has run, its answer is on its way): the writes that record it fail
            faults.add("dynamodb", "PutItem", "TransactWriteItems", "UpdateItem", kind=kind, times=times)
        return {"charged": True}

    @app.function("quick")
    def quick(data: dict[str, Any], step: Step) -> Any:
        return step.run("charge", charge)

    return app


@pytest.fixture
def served(aws: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[AwsFaults, dict[str, Any]]]:  # noqa: F811
    CALLS.clear()
    monkeypatch.setenv("RYUSEN_STORE_RETRY_S", "2")
    faults, arm = AwsFaults(), {}
    server = make_server("127.0.0.1", 0, build_app(faults, arm).wsgi(), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    call(aws, "PUT", "/v1/apps/box", {"url": f"http://127.0.0.1:{server.server_port}/"})
    with faults.installed():
        yield faults, arm
    server.shutdown()


def run_to_the_charge(aws: dict[str, str]) -> tuple[str, dict[str, Any]]:  # noqa: F811
    run = call(aws, "POST", "/v1/functions/quick/runs", {"input": {}})
    dispatch(aws, receive(aws))  # discovery: the charge attempt is queued
    [message] = receive(aws)
    assert json.loads(message["Body"])["kind"] == "forward"
    return run["id"], message


def finish(aws: dict[str, str], run_id: str) -> dict[str, Any]:  # noqa: F811
    for _ in range(20):  # with the backoff of a task sent again (whole seconds on SQS)
        messages = receive(aws, wait_s=1)
        if messages:
            dispatch(aws, messages)
        view: dict[str, Any] = call(aws, "GET", f"/v1/runs/{run_id}")
        if view["phase"] == "finished":
            return view
    raise AssertionError(f"run {run_id} did not finish: {view['steps']}")


@pytest.mark.parametrize(
    "fault",
    [("throttled", 3), ("server_error", 2), ("answer_lost", 1)],
    ids=["throttled", "server_error", "answer_lost"],
)
def test_a_success_whose_write_is_refused_a_few_times_is_recorded_by_the_same_dispatcher(
    aws: dict[str, str],  # noqa: F811
    served: tuple[AwsFaults, dict[str, Any]],
    fault: tuple[str, int],
) -> None:
    faults, arm = served
    run_id, message = run_to_the_charge(aws)
    arm["faults"] = [fault]
    assert dispatch(aws, [message]) == set()  # handled: the answer is recorded, not left to the lease
    assert faults.count(fault[0]) >= 1, "the fault was never injected"
    arm.clear()
    step = call(aws, "GET", f"/v1/runs/{run_id}")["steps"][0]
    assert step["status"] == "completed" and step["result"] == {"charged": True}
    assert [a["status"] for a in step["attempts"]] == ["succeeded"]
    assert finish(aws, run_id)["outcome"] == "completed"
    assert CALLS == ["charge"]


def test_a_transaction_cancelled_for_throttling_is_tried_again_and_the_run_completes(
    aws: dict[str, str],  # noqa: F811
    served: tuple[AwsFaults, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """botocore does not retry a transaction cancelled with ``ThrottlingError``. With chaining, the answer of
    the last step and the run's completion are one transaction (the head's summary changes with it)."""
    faults, arm = served
    monkeypatch.setenv("RYUSEN_CHAIN_STEPS", "true")
    run = call(aws, "POST", "/v1/functions/quick/runs", {"input": {}})
    arm["faults"] = [("transaction_throttled", 2)]
    assert dispatch(aws, receive(aws)) == set()  # discovery, the charge, its answer and the completion
    assert faults.count("transaction_throttled") == 2
    view = call(aws, "GET", f"/v1/runs/{run['id']}")
    assert view["outcome"] == "completed" and view["steps"][0]["result"] == {"charged": True}
    assert [a["status"] for a in view["steps"][0]["attempts"]] == ["succeeded"]
    assert CALLS == ["charge"]


def test_a_success_the_store_keeps_refusing_is_deferred_to_the_queue_and_recorded_when_it_is_received(
    aws: dict[str, str],  # noqa: F811
    served: tuple[AwsFaults, dict[str, Any]],
) -> None:
    faults, arm = served
    run_id, message = run_to_the_charge(aws)
    arm["faults"] = [("throttled", 10_000)]  # the table refuses every write for as long as the dispatcher tries
    kept = dispatch(aws, [message])
    # the deferred answer now carries the attempt: the message, its lease timer until then, is deleted, so it cannot
    # come back and take the attempt as Unknown before the answer is recorded
    assert kept == set()
    faults.clear()  # the table recovers
    arm.clear()
    attempt = call(aws, "GET", f"/v1/runs/{run_id}")["steps"][0]["attempts"][0]
    assert attempt["status"] == "authorized"  # nothing recorded yet, and nothing lost
    [deferred] = receive(aws, wait_s=2)  # the answer, on the queue
    assert "deferred" in json.loads(deferred["Body"])
    assert dispatch(aws, [deferred]) == set()
    step = call(aws, "GET", f"/v1/runs/{run_id}")["steps"][0]
    assert step["status"] == "completed" and step["result"] == {"charged": True}
    assert [a["status"] for a in step["attempts"]] == ["succeeded"]
    assert step["attempts"][0].get("unknown_at") is None  # never Unknown
    assert finish(aws, run_id)["outcome"] == "completed"
    assert CALLS == ["charge"]


def test_a_deferred_answer_not_sealed_by_the_deployment_is_refused(
    aws: dict[str, str],  # noqa: F811
    served: tuple[AwsFaults, dict[str, Any]],
) -> None:
    """Anyone allowed to send to the queue (the Scheduler's role) cannot settle a step with a made-up answer."""
    run_id, message = run_to_the_charge(aws)
    forged = {
        "deferred": {
            "run_id": run_id,
            "kind": "attempt",
            "event": {
                "step_id": "charge",
                "phase": "forward",
                "generation": 1,
                "response": {"type": "succeeded", "result": {"charged": "forged"}},
            },
            "tries": 0,
            "seal": "0" * 64,
        }
    }
    boto3.client("sqs").send_message(QueueUrl=aws["RYUSEN_QUEUE_URL"], MessageBody=json.dumps(forged))
    [received] = receive(aws, wait_s=1)
    dispatch(aws, [received])
    step = call(aws, "GET", f"/v1/runs/{run_id}")["steps"][0]
    assert step["status"] != "completed" and step.get("result") is None
    dispatch(aws, [message])  # the real attempt runs and is recorded
    assert call(aws, "GET", f"/v1/runs/{run_id}")["steps"][0]["result"] == {"charged": True}


def test_a_front_end_429_sends_the_attempt_again_and_never_makes_it_unknown(
    aws: dict[str, str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    CALLS.clear()
    app = build_app(AwsFaults(), {})
    wsgi = app.wsgi()
    throttles = {"left": 0, "seen": 0}

    def front_end(environ: dict[str, Any], start_response: Any) -> Any:
        # the function URL's front end, out of concurrency: 429, unsigned, before any code runs
        if throttles["left"] > 0:
            throttles["left"] -= 1
            throttles["seen"] += 1
            response = Response(FrontEnd.BODY, status=429, headers=FrontEnd.HEADERS)
            return response(environ, start_response)
        return wsgi(environ, start_response)

    server = make_server("127.0.0.1", 0, front_end, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        call(aws, "PUT", "/v1/apps/box", {"url": f"http://127.0.0.1:{server.server_port}/"})
        run_id, message = run_to_the_charge(aws)
        throttles["left"] = 2  # the next two requests find the function out of concurrency
        dispatch(aws, [message])
        step = call(aws, "GET", f"/v1/runs/{run_id}")["steps"][0]
        assert step["status"] != "unknown", step
        assert step["attempts"][0]["status"] == "queued"  # the same generation, sent again with backoff
        assert throttles["seen"] == 1 and CALLS == []
        view = finish(aws, run_id)
        assert view["outcome"] == "completed" and throttles["seen"] == 2
        [attempt] = view["steps"][0]["attempts"]
        assert attempt["status"] == "succeeded" and attempt["redeliveries"] >= 1
        assert CALLS == ["charge"]
    finally:
        server.shutdown()


def test_the_fault_layer_raises_what_botocore_raises_after_its_retries(aws: dict[str, str]) -> None:  # noqa: F811
    """The layer's own check: the codes and shapes the store's handling relies on."""
    from botocore.exceptions import ClientError, ReadTimeoutError

    faults = AwsFaults()
    client = boto3.client("dynamodb")
    with faults.installed():
        faults.add("dynamodb", "PutItem", kind="throttled")
        with pytest.raises(ClientError) as throttled:
            client.put_item(TableName="ryusen", Item={"pk": {"S": "x"}, "sk": {"S": "y"}})
        assert throttled.value.response["Error"]["Code"] == "ProvisionedThroughputExceededException"
        faults.add("dynamodb", "TransactWriteItems", kind="transaction_throttled")
        items = [{"Put": {"TableName": "ryusen", "Item": {"pk": {"S": f"x{i}"}, "sk": {"S": "y"}}}} for i in range(2)]
        with pytest.raises(ClientError) as cancelled:
            client.transact_write_items(TransactItems=items)
        reasons = [r["Code"] for r in cancelled.value.response["CancellationReasons"]]  # type: ignore[typeddict-item]
        assert reasons == ["ThrottlingError", "None"]
        faults.add("dynamodb", "PutItem", kind="answer_lost", when=mentions("committed"))
        with pytest.raises(ReadTimeoutError):
            client.put_item(TableName="ryusen", Item={"pk": {"S": "committed"}, "sk": {"S": "y"}})
        item = client.get_item(TableName="ryusen", Key={"pk": {"S": "committed"}, "sk": {"S": "y"}})
        assert "Item" in item  # the write committed; only its answer was lost
    assert faults.count() == 3

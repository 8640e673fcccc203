"""Hostile review of the result function deciding on the state it remembers (``DynamoStore.cached``, no read).

FINDING R1 (store-level side effect of a decision the fence refuses). A decision taken on a remembered state that
is out of date is refused by the version fence -- but ``DynamoStore.save`` writes the decision's large values
(``_write_values``: unconditional BatchWriteItem, with the expiry of *that* decision's state) before the fenced
PutItem, and marks them in the process's value cache (``_ValueCache``: "it proves the item exists"). The decision
taken again on the run as read refers to the same value (same digest), finds it in the cache, and does not write it
again: the entry that commits refers to a value item whose ``expires_at`` is the one the refused decision computed.

When the refused decision *finished* the run (the last step's outcome, with the continuation the SDK found) its
values expire at now + retention; when the run actually read was cancelled meanwhile, the decision that commits
leaves the run unfinished (it unwinds), so the run's own items expire at finish + retention, later: the value item
of the last step's result expires first. That breaks the store's stated invariant ("the head is the first item of
a finished run to expire, and nothing of the run expires sooner"): once DynamoDB's TTL deletes that value item,
every read of the run raises ``RuntimeError: its value item ... is missing`` -- GET /v1/runs/{id} answers 500 and,
while the run is unfinished (a compensation that waits on an operator, with a retention under the sweeper's renewal
horizon of 23 days), no event can be decided on it ever again (the run stalls silently).

Before this change the result function read the run first, so such a refused decision needed a write landing in the
milliseconds between that read and its write; now it happens whenever anything else writes the run while a step
sent as an event runs (a cancel through the API, a heartbeat taken by another container, ...).

Fixed: a value item is known to exist (``DynamoStore._values_committed``) only once the write that refers to it has
committed, so the decision taken again writes it again, with its own expiry.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import boto3
import pytest

from ryusen_server.aws.store import DynamoStore
from tests.infra.test_stack_in_a_box import (  # noqa: F401
    Deployed,
    _app_sharing_replays,
    _inline_up_to,
    _lease_timers_now,
    _serve_for_events,
    _start,
    deployed,
)
from tests.stack import wait_for

PADDING = 3000
"""The last step's result is over ``OFFLOAD_BYTES`` (1024) serialized: it is a value item of its own."""


def _cancellable_app(deployed: Deployed, name: str) -> tuple[list[str], dict[str, float]]:  # noqa: F811
    """A Lambda app taking events: steps a (compensated, its compensator slow), b and c (the last, whose result is
    a large value). What ran, in order, and the sleeps of each step (once)."""
    from ryusen import Step

    app = _app_sharing_replays(name)
    ran: list[str] = []
    slow: dict[str, float] = {}

    def work(step_id: str) -> dict[str, Any]:
        ran.append(step_id)
        time.sleep(slow.pop(step_id, 0.0))
        return {"step": step_id, "padding": "x" * (PADDING if step_id == "c" else 0)}

    def undo(result: dict[str, Any]) -> dict[str, Any]:
        ran.append(f"undo-{result['step']}")
        time.sleep(slow.pop(f"undo-{result['step']}", 0.0))
        return {"undone": result["step"]}

    @app.function(f"{name}-flow")
    def flow(data: dict[str, Any], step: Step) -> Any:
        t = timedelta(seconds=10)
        a = step.run("a", work, "a", timeout=t, compensate=undo)
        b = step.run("b", work, "b", timeout=t)
        c = step.run("c", work, "c", timeout=t)
        return [a["step"], b["step"], len(c["padding"])]

    _serve_for_events(deployed, app, name)
    return ran, slow


def _items(deployed: Deployed, run_id: str) -> list[dict[str, Any]]:  # noqa: F811
    client = boto3.client("dynamodb", region_name="us-east-1")
    query: dict[str, Any] = {
        "TableName": deployed.env["RYUSEN_TABLE"],
        "KeyConditionExpression": "pk = :pk",
        "ExpressionAttributeValues": {":pk": {"S": f"RUN#{run_id}"}},
        "ConsistentRead": True,
    }
    items: list[dict[str, Any]] = []
    while True:
        page = client.query(**query)
        items += page.get("Items", [])
        if "LastEvaluatedKey" not in page:
            return items
        query["ExclusiveStartKey"] = page["LastEvaluatedKey"]


def _cancelled_while_c_runs(
    deployed: Deployed,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    name: str,
) -> tuple[str, list[str]]:
    """Every step as an event (c is sent, and its outcome taken, by the result function); the run is cancelled
    through the API while c runs (3 s), and a's compensator takes 4 s. The run's id and what ran so far."""
    _inline_up_to(monkeypatch, 0.0)
    ran, slow = _cancellable_app(deployed, name)
    slow["c"] = 3.0
    slow["undo-a"] = 4.0
    run_id = _start(deployed, f"{name}-flow", {})
    wait_for(lambda: "c" in ran or None, timeout=30, what="c to start")
    assert deployed.api("POST", f"/v1/runs/{run_id}/cancel", {"reason": "customer"}).status_code == 202
    return run_id, ran


def test_review_remembered_state_a_refused_decision_leaves_a_value_item_expiring_before_its_run(
    deployed: Deployed,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """c (the last step, a large result) runs as an event sent by the result function, which remembers the run with
    c in flight. The run is cancelled through the API meanwhile. c's outcome is decided on the remembered state: the
    run completes there (c's result, the continuation's output), so its value items get the expiry of a finished
    run, now + retention; that write is refused by the fence. Decided again on the cancelled run, c's outcome is
    recorded and the run unwinds (a's compensator takes 4 s), finishing later: its head expires 4 s after c's
    result's value item, which the committed entries refer to."""
    run_id, ran = _cancelled_while_c_runs(deployed, monkeypatch, "remembered")
    run = deployed.finished(run_id, timeout=60)
    assert run["outcome"] == "cancelled", run["summary"]
    assert ran == ["a", "b", "c", "undo-a"], ran

    items = _items(deployed, run_id)
    head = next(i for i in items if i["sk"]["S"] == "RUN")
    head_expires = int(head["expires_at"]["N"])
    early = {
        i["sk"]["S"]: head_expires - int(i["expires_at"]["N"])
        for i in items
        if "expires_at" in i and int(i["expires_at"]["N"]) < head_expires
    }
    writers = {
        (call.function, put["PutRequest"]["Item"]["expires_at"]["N"])
        for call in deployed.box.calls
        if call.operation == "BatchWriteItem"
        for put in call.params["RequestItems"][deployed.env["RYUSEN_TABLE"]]
        if put["PutRequest"]["Item"]["sk"]["S"] in early and put["PutRequest"]["Item"]["pk"]["S"] == f"RUN#{run_id}"
    }
    # the store's invariant (aws/store.py, "Retention"): the head is the first item of a finished run to expire
    assert not early, (
        f"items of the finished run expire before its head (by seconds): {early}, written by (function, expiry):"
        f" {writers}, head expires {head_expires}; once DynamoDB's TTL deletes them the run cannot be read within"
        " its retention"
    )


def test_review_remembered_state_a_value_item_gone_before_its_run_makes_the_run_unreadable(
    deployed: Deployed,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The consequence of the finding above: DynamoDB's TTL deletes an expired item late and in no order; the value
    item expiring first is gone while the run is still within its retention, and a process that has not cached the
    value (another container, a cold start) cannot read the run at all."""
    run_id, _ran = _cancelled_while_c_runs(deployed, monkeypatch, "remembered2")
    run = deployed.finished(run_id, timeout=60)
    assert run["outcome"] == "cancelled", run["summary"]

    _lease_timers_now(deployed)  # the box's queue drained first: nothing of the run is in flight any more
    client = boto3.client("dynamodb", region_name="us-east-1")
    table = deployed.env["RYUSEN_TABLE"]
    items = _items(deployed, run_id)
    head_expires = int(next(i for i in items if i["sk"]["S"] == "RUN")["expires_at"]["N"])
    # TTL at a moment before the head's expiry: every item already past its own expiry may be deleted
    now = head_expires - 1
    for item in items:
        if "expires_at" in item and int(item["expires_at"]["N"]) <= now:
            client.delete_item(TableName=table, Key={"pk": item["pk"], "sk": item["sk"]})
    fresh = DynamoStore(client, table, retention_s=30 * 86_400)  # a cold process of the deployment
    # (read now: the head is not past its expiry at ``now`` either, so nothing else differs at that moment)
    state = fresh.get(run_id)  # within its retention: the run must still be there, whole
    assert state is not None and state.outcome is not None


def test_review_remembered_state_an_unfinished_runs_value_item_expires_before_what_its_head_records(
    deployed: Deployed,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same interleaving, looked at while the run unwinds (a's compensator runs, the run is unfinished): the head
    records the earliest expiry of the run's items (``items_expire_at``), which is all the sweeper looks at to renew
    them (``defer_check``); c's result's value item expires 30 days (``LIVE_EXPIRY_S``) before that. With a
    retention under 23 days and a run that stays unfinished (a compensation blocked until an operator resolves it),
    the value item is deleted before the sweeper's first renewal, and the live run can never be read again."""
    run_id, ran = _cancelled_while_c_runs(deployed, monkeypatch, "remembered3")
    wait_for(lambda: "undo-a" in ran or None, timeout=30, what="a's compensator to start")
    items = _items(deployed, run_id)
    head = next(i for i in items if i["sk"]["S"] == "RUN")
    assert head["phase"]["S"] != "finished", head["phase"]  # still unwinding
    recorded = int(head["items_expire_at"]["N"])
    early = {
        i["sk"]["S"]: round((recorded - int(i["expires_at"]["N"])) / 86_400, 2)
        for i in items
        if i["sk"]["S"] != "RUN" and "expires_at" in i and int(i["expires_at"]["N"]) < recorded
    }
    try:
        assert not early, f"items of the unfinished run expire before its head's items_expire_at (by days): {early}"
    finally:
        deployed.finished(run_id, timeout=60)
        _lease_timers_now(deployed)

"""The result function reads nothing for an outcome whose attempt it authorized itself (issue 25: a read of the run
per step was $0.125 per million steps, a tenth of a step's bill).

It remembers the run as it wrote it. An outcome for an attempt that state holds in flight is decided on it, and the
decision's write (the journal entry of the next version, ``attribute_not_exists``) succeeds only if no one wrote
since: that proves the state current. If someone did (a cancel through the API, another container), the write is
refused, the run is read, and the outcome decided again. A decision that would write nothing is never taken on a
remembered state (``Engine.apply``, ``known_fresh``)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.infra.test_stack_in_a_box import (  # noqa: F401
    Deployed,
    _inline_up_to,
    _lease_timers_now,
    _start,
    _timed_app,
    deployed,
)
from tests.stack import wait_for


def _reads_of_run(deployed: Deployed, since: int, run_id: str, function: str) -> list[str]:  # noqa: F811
    """The DynamoDB reads ``function`` made of the run's items since call ``since``."""
    key = f"RUN#{run_id}"
    reads = []
    for call in deployed.box.calls[since:]:
        if call.function != function or call.service != "dynamodb":
            continue
        if call.operation == "Query" and call.params["ExpressionAttributeValues"][":pk"]["S"] == key:
            reads.append("Query")
        elif call.operation == "GetItem" and call.params["Key"]["pk"]["S"] == key:
            reads.append("GetItem")
    return reads


def test_outcomes_of_attempts_the_result_function_authorized_are_recorded_without_reading_the_run(
    deployed: Deployed,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Six steps sent as events: the dispatcher sends the first, so the result function reads the run once, for
    its outcome; it authorizes every later step itself and records their outcomes on the state it wrote."""
    _inline_up_to(monkeypatch, 0.0)  # every step as an event
    steps = tuple("abcdef")
    _arn, ran, _slow, _app = _timed_app(deployed, "noreads", steps=steps)
    before = len(deployed.box.calls)
    run = deployed.finished(_start(deployed, "noreads-flow", {}))
    assert run["outcome"] == "completed", run["summary"]
    assert ran == list(steps)
    reads = _reads_of_run(deployed, before, run["id"], "results")
    assert len(reads) <= 1, f"the result function read the run {len(reads)} times for {len(steps)} outcomes: {reads}"
    _lease_timers_now(deployed)


def test_an_outcome_after_a_cancel_elsewhere_is_decided_again_on_the_cancelled_run(
    deployed: Deployed,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While "c" runs (its event sent by the result function, which remembers the run with "c" in flight), the
    run is cancelled through the API: a write the result function never saw. "c"'s outcome is then decided on
    the remembered state, its write refused by the version fence, the run read, and the outcome decided again:
    recorded, and the run unwinds as cancelled, starting no step after "c"."""
    _inline_up_to(monkeypatch, 0.0)
    _arn, ran, slow, _app = _timed_app(deployed, "cancelled", steps=("a", "b", "c", "d"))
    slow["c"] = 3.0
    before = len(deployed.box.calls)
    run_id = _start(deployed, "cancelled-flow", {})
    wait_for(lambda: "c" in ran or None, timeout=30, what="c to start")
    assert deployed.api("POST", f"/v1/runs/{run_id}/cancel", {"reason": "customer"}).status_code == 202
    run = deployed.finished(run_id)
    assert run["outcome"] == "cancelled", run["summary"]
    assert ran == ["a", "b", "c"], ran  # nothing started after the cancel
    c = _step(run, "c")
    assert c["attempts"][-1]["status"] == "succeeded", c  # its outcome was recorded, not lost to the refusal
    # the cancel's journal entry is a version the result function also tried to write (refused: it exists)
    cancelled_at = _entries_written(deployed, before, run_id, "api")
    assert cancelled_at & _entries_written(deployed, before, run_id, "results"), (
        "the result function never wrote on the state it remembered from before the cancel"
    )
    _lease_timers_now(deployed)


def _entries_written(deployed: Deployed, since: int, run_id: str, function: str) -> set[str]:  # noqa: F811
    """The journal entries (``sk``) ``function`` tried to write for the run since call ``since``."""
    items: list[dict[str, Any]] = []
    for call in deployed.box.calls[since:]:
        if call.function != function or call.service != "dynamodb":
            continue
        if call.operation == "PutItem":
            items.append(call.params["Item"])
        elif call.operation == "TransactWriteItems":
            items += [t["Put"]["Item"] for t in call.params["TransactItems"] if "Put" in t]
    return {i["sk"]["S"] for i in items if i["pk"]["S"] == f"RUN#{run_id}" and i["sk"]["S"].startswith("EV#")}


def _step(run: dict[str, Any], step_id: str) -> dict[str, Any]:
    step: dict[str, Any] = next(s for s in run["steps"] if s["id"] == step_id)
    return step

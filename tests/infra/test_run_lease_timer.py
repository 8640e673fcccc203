"""One lease timer for a run's steps sent as events, not one per attempt (issue 25; docs/design/dispatch.md, "One
lease timer for a run's steps sent as events").

The result function leaves an attempt in flight (sent as an event, or answered "accepted") with no dispatch
message to watch its lease, so it sends a lease timer. For a Lambda app that takes events, a timer this function
sent for the run that comes back before the new event's lease ends watches it too: no new timer is sent, and when
that timer comes back it watches every event a result function sent before it was due, until each is settled or
taken as Unknown at its lease (exactly, as its own timer would). An HTTP endpoint's acknowledged attempt keeps a
timer of its own (tests/conformance/test_review_run_lease_timer.py)."""

from __future__ import annotations

import json
import math
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.infra.test_stack_in_a_box import (  # noqa: F401
    Deployed,
    _inline_up_to,
    _lease_timers_now,
    _messages_due_now,
    _start,
    _timed_app,
    deployed,
)
from tests.stack import wait_for


def _timers_sent(deployed: Deployed, since: int, run_id: str) -> list[dict[str, Any]]:  # noqa: F811
    """The lease timers the result function sent for the run since call ``since``."""
    sent = [
        json.loads(c.params["MessageBody"])
        for c in deployed.box.calls[since:]
        if c.function == "results" and c.operation == "SendMessage"
    ]
    return [t for t in sent if t.get("lease_timer") and t.get("run_id") == run_id]


def test_a_run_of_quick_steps_sent_as_events_sends_one_lease_timer_not_one_per_step(
    deployed: Deployed,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Six steps of an app that takes events, each done in well under its 11 s lease: the result function carries
    the run from the second step on and sent a lease timer for each (five, $0.4 per million steps each in SQS
    requests alone, with a dispatch invocation and a read when it comes back). Now the first timer watches the
    rest: one timer for the run, and nothing is left on the queue once it has come back."""
    _inline_up_to(monkeypatch, 0.0)  # every step as an event
    steps = tuple("abcdef")
    _arn, ran, _slow, _app = _timed_app(deployed, "onetimer", steps=steps)
    before = len(deployed.box.calls)
    run = deployed.finished(_start(deployed, "onetimer-flow", {}))
    assert run["outcome"] == "completed", run["summary"]
    assert ran == list(steps)
    timers = _timers_sent(deployed, before, run["id"])
    assert len(timers) == 1, f"{len(timers)} lease timers for one run of {len(steps)} steps: {timers}"
    _lease_timers_now(deployed)  # it comes back, finds nothing in flight, and is done (the queue empties)


def test_steps_of_a_tenth_of_a_second_with_a_timeout_of_a_fraction_of_a_second_share_one_lease_timer(
    deployed: Deployed,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same run with a timeout of 8.5 s and steps of 0.1 s: SQS delays by whole seconds, so the first timer
    (a lease of about 68.5 s) is due 69 s after its send, about 0.5 s after the next step's lease ends. That
    step's own timer would be due later still (its lease rounded up), so the first timer watches it. Before, it
    was refused, and every step sent a timer of its own (bench/cost.py at 0.1 s: 20 timers for a 20-step run)."""
    _inline_up_to(monkeypatch, 0.0)
    steps = tuple("abcdef")
    _arn, ran, _slow, _app = _timed_app(deployed, "tenths", steps=steps, timeout_s=8.5, default_s=0.1)
    before = len(deployed.box.calls)
    run = deployed.finished(_start(deployed, "tenths-flow", {}))
    assert run["outcome"] == "completed", run["summary"]
    assert ran == list(steps)
    timers = _timers_sent(deployed, before, run["id"])
    assert len(timers) == 1, f"{len(timers)} lease timers for one run of {len(steps)} steps: {timers}"
    _lease_timers_now(deployed)


def _shift_clocks(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The dispatch and result functions' clocks, ``seconds`` ahead from now on."""
    from ryusen_server.lambdas import dispatch as dispatch_lambda
    from ryusen_server.lambdas import results as results_lambda

    for wired in (dispatch_lambda.engine(), results_lambda.engine()):
        real = wired.engine.clock
        monkeypatch.setattr(wired.engine, "clock", lambda real=real: real() + timedelta(seconds=seconds))


def _losing_once(deployed: Deployed, arn: str, step_id: str) -> list[str]:  # noqa: F811
    """Make the app's events lose ``step_id``'s first attempt (Lambda took it, and its container died before the
    SDK posted: nothing ran, nothing is posted); the list returned names it once it is lost."""
    handler, who = deployed.box.event_handlers[arn]
    dropped: list[str] = []

    def losing(event: dict[str, Any], context: Any) -> dict[str, Any]:
        body = json.loads(event["body"])
        if body.get("step_id") == step_id and not dropped:
            dropped.append(step_id)
            return {"statusCode": 202}
        result: dict[str, Any] = handler(event, context)
        return result

    deployed.box.event_handlers[arn] = (losing, who)
    return dropped


def _finished_past_the_lease(
    deployed: Deployed,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    run_id: str,
    lease: datetime,
    step_id: str,
) -> dict[str, Any]:
    """Move the functions' clocks past ``lease`` and run the queue's delays forward until the run finishes; the
    run, whose ``step_id`` was lost once, has been retried (on_unknown="retry") and completed."""
    _shift_clocks(monkeypatch, (lease - datetime.now(UTC)).total_seconds() + 1.0)
    deadline = time.monotonic() + 30
    while (run := deployed.run(run_id))["phase"] != "finished":
        assert time.monotonic() < deadline, json.dumps(_attempts(run, step_id))
        _messages_due_now()
        time.sleep(0.5)
    assert run["outcome"] == "completed", run["summary"]
    [lost, retried] = _attempts(run, step_id)
    assert lost["unknown"] is not None and retried["status"] == "succeeded", (lost, retried)
    return run


def test_an_attempt_the_runs_timer_watches_that_goes_silent_is_unknown_at_its_lease(
    deployed: Deployed,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Step "c" is sent as an event that Lambda takes and loses (its container dies before the SDK posts): no
    timer of its own is sent, since "b"'s comes back before "c"'s lease ends. Once "c"'s lease has ended (here
    the functions' clocks are moved past it, and the queue's delays ended), that timer finds "b" settled and "c"
    in flight past its lease, and takes it as Unknown, as its own timer would: not lease_watch_grace_s (15
    minutes) later, as a message that does not carry it would. With on_unknown="retry" the retry runs "c" once
    and the run completes."""
    from ryusen import RetryPolicy

    _inline_up_to(monkeypatch, 0.0)
    retry = RetryPolicy(max_attempts=3, initial_delay=timedelta(0), on_unknown="retry")
    arn, ran, _slow, _app = _timed_app(deployed, "silent", steps=("a", "b", "c", "d"), timeout_s=1.0, retry=retry)
    dropped = _losing_once(deployed, arn, "c")
    before = len(deployed.box.calls)
    run_id = _start(deployed, "silent-flow", {})
    in_flight = wait_for(lambda: dropped and _attempts(deployed.run(run_id), "c"), timeout=30, what="c in flight")
    lease = datetime.fromisoformat(in_flight[0]["lease_expires_at"])
    assert (lease - datetime.now(UTC)).total_seconds() < 120, in_flight
    timers_then = _timers_sent(deployed, before, run_id)
    _finished_past_the_lease(deployed, monkeypatch, run_id, lease, "c")
    assert dropped == ["c"] and ran == ["a", "b", "c", "d"], ran  # "c" ran once: the retry
    assert [t["step_id"] for t in timers_then] == ["b"], f"not one lease timer for b and c: {timers_then}"


def _attempts(run: dict[str, Any], step_id: str) -> list[dict[str, Any]]:
    return list(next((s for s in run["steps"] if s["id"] == step_id), {"attempts": []})["attempts"])


def _lease_schedules(deployed: Deployed) -> list[dict[str, Any]]:  # noqa: F811
    """The lease watches parked on the Scheduler now (``ryusen-lease-*`` schedules), whenever they are due."""
    import boto3

    client = boto3.client("scheduler", region_name="us-east-1")
    group = deployed.env["RYUSEN_SCHEDULE_GROUP"]
    listed = client.list_schedules(GroupName=group).get("Schedules", [])
    return [
        client.get_schedule(Name=s["Name"], GroupName=group) for s in listed if s["Name"].startswith("ryusen-lease-")
    ]


def _scheduler_calls(deployed: Deployed, since: int, operation: str) -> list[dict[str, Any]]:  # noqa: F811
    return [c.params for c in deployed.box.calls[since:] if c.function == "results" and c.operation == operation]


def _steps_taken_as_long(monkeypatch: pytest.MonkeyPatch) -> None:
    """The result function judges a lease watch as if each step had taken as long as its lease (its
    ``scheduled_lease_share`` unbounded): the box's steps take milliseconds, a step of minutes would not."""
    from dataclasses import replace

    from ryusen_server.lambdas import results as results_lambda

    engine = results_lambda.engine().engine
    monkeypatch.setattr(engine, "settings", replace(engine.settings, scheduled_lease_share=math.inf))


def test_a_quick_step_with_a_long_timeout_keeps_sharing_the_runs_sqs_timer(
    deployed: Deployed,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps of milliseconds with a timeout of 5 minutes: one SQS timer watches them all (its lease covers the
    run), which costs less than a schedule a step; no schedule is created, and none is asked to be deleted."""
    _inline_up_to(monkeypatch, 0.0)
    steps = ("a", "b", "c", "d")
    _arn, ran, _slow, _app = _timed_app(deployed, "quicklong", steps=steps, timeout_s=300.0)
    before = len(deployed.box.calls)
    run = deployed.finished(_start(deployed, "quicklong-flow", {}))
    assert run["outcome"] == "completed", run["summary"]
    assert ran == list(steps)
    assert len(_timers_sent(deployed, before, run["id"])) == 1
    assert _scheduler_calls(deployed, before, "CreateSchedule") == []
    assert _scheduler_calls(deployed, before, "DeleteSchedule") == []  # nor a request to delete one per step
    _lease_timers_now(deployed)


def test_a_long_lease_is_watched_by_a_schedule_deleted_once_its_outcome_is_recorded(
    deployed: Deployed,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps with a timeout of 5 minutes (a lease of 6) sent as events: a step of minutes shares an SQS timer with
    one other step at most, and every timer comes back, to find its attempt settled (about $1.35 per million
    steps at 10 minutes). Each such attempt the result function sends is watched instead by a Scheduler schedule
    (billed only if delivered), due a minute before its lease ends, and deleted once its outcome is recorded: no
    SQS timer is sent, and no lease schedule is left once the run has finished."""
    _inline_up_to(monkeypatch, 0.0)
    _steps_taken_as_long(monkeypatch)
    steps = ("a", "b", "c")
    _arn, ran, _slow, _app = _timed_app(deployed, "longlease", steps=steps, timeout_s=300.0)
    before = len(deployed.box.calls)
    run = deployed.finished(_start(deployed, "longlease-flow", {}))
    assert run["outcome"] == "completed", run["summary"]
    assert ran == list(steps)
    assert _timers_sent(deployed, before, run["id"]) == []
    created = _scheduler_calls(deployed, before, "CreateSchedule")
    deleted = _scheduler_calls(deployed, before, "DeleteSchedule")
    # "a" was sent by the dispatcher (its message is its lease timer); "b" and "c" by the result function
    assert len(created) == 2 and all(c["Name"].startswith("ryusen-lease-run_") for c in created), created
    assert {c["Name"] for c in created} <= {d["Name"] for d in deleted}, (created, deleted)
    for schedule in created:
        due = datetime.fromisoformat(schedule["ScheduleExpression"][3:-1]).replace(tzinfo=UTC)
        assert timedelta(seconds=290) < due - datetime.now(UTC) < timedelta(seconds=301), schedule
    assert _lease_schedules(deployed) == []


def test_a_silent_attempt_watched_by_a_schedule_is_unknown_at_its_lease_not_before(
    deployed: Deployed,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Step "b" (a 5-minute timeout) is sent as an event that Lambda takes and loses. Its lease watch is a
    schedule. Delivered a minute before the lease ends (Scheduler's earliest), it finds "b" in flight and waits on
    the queue for the rest of the lease: "b" is not Unknown yet. Once the lease has ended (the functions' clocks
    moved past it, the queue's delays ended), it takes "b" as Unknown; with on_unknown="retry" the retry runs "b"
    once and the run completes."""
    from ryusen import RetryPolicy

    _inline_up_to(monkeypatch, 0.0)
    _steps_taken_as_long(monkeypatch)
    retry = RetryPolicy(max_attempts=3, initial_delay=timedelta(0), on_unknown="retry")
    arn, ran, _slow, _app = _timed_app(deployed, "lostlong", steps=("a", "b", "c"), timeout_s=300.0, retry=retry)
    dropped = _losing_once(deployed, arn, "b")
    run_id = _start(deployed, "lostlong-flow", {})
    in_flight = wait_for(lambda: dropped and _attempts(deployed.run(run_id), "b"), timeout=30, what="b in flight")
    [watch] = wait_for(lambda: _lease_schedules(deployed), timeout=10, what="b's lease watch")
    lease = datetime.fromisoformat(in_flight[0]["lease_expires_at"])
    due = datetime.fromisoformat(watch["ScheduleExpression"][3:-1]).replace(tzinfo=UTC)
    assert timedelta(seconds=59) <= lease - due <= timedelta(seconds=61), (lease, due)

    import boto3

    sqs = boto3.client("sqs", region_name="us-east-1")
    _shift_clocks(monkeypatch, (due - datetime.now(UTC)).total_seconds() + 1.0)  # Scheduler delivers it: early
    sqs.send_message(QueueUrl=deployed.env["RYUSEN_QUEUE_URL"], MessageBody=watch["Target"]["Input"])
    boto3.client("scheduler", region_name="us-east-1").delete_schedule(
        Name=watch["Name"], GroupName=deployed.env["RYUSEN_SCHEDULE_GROUP"]
    )  # delivered: Scheduler deletes it (ActionAfterCompletion)
    time.sleep(3)
    [b] = _attempts(deployed.run(run_id), "b")
    assert b["status"] == "authorized" and b["unknown"] is None, b  # not before its lease

    _finished_past_the_lease(deployed, monkeypatch, run_id, lease, "b")
    assert dropped == ["b"] and ran == ["a", "b", "c"], ran

"""Review of the uncommitted "lease watch that is deleted" change (docs/design/dispatch.md, "A lease watch that is
deleted, for long leases"), in the stack in a box, synthesized with a dispatch queue of its own for the app
``video`` (``app_dispatch_concurrency``, as tests/infra/test_app_queues.py).

Finding (first test): the result function's Scheduler requests are not bounded by the time it has: a
``CreateSchedule`` that hangs cannot fail over to the SQS timer before the function's timeout kills it.
Guards (the others): quick steps with the default timeout make no Scheduler request at all (an earlier state of the
change deleted a schedule for every attempt whose window was long enough, made or not: a ``DeleteSchedule`` per step
of the common default-timeout case; fixed while this review ran, by ``ParkedLeaseWatches`` and judging the settled
attempt's own duration); an app with a queue of its own gets its lease watches on that queue, and a silent attempt
there is Unknown at its lease."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import boto3
import pytest

from tests.infra import test_stack_in_a_box as box_tests
from tests.infra.conftest import Synthesized, synthesize
from tests.infra.test_run_lease_timer import (
    _attempts,
    _finished_past_the_lease,
    _losing_once,
    _scheduler_calls,
    _shift_clocks,
    _steps_taken_as_long,
)
from tests.infra.test_stack_in_a_box import Deployed, _inline_up_to, _start, _timed_app
from tests.stack import wait_for


@pytest.fixture(scope="module")
def synthesized_with_video(tmp_path_factory: pytest.TempPathFactory) -> Synthesized:
    return synthesize(Path(tmp_path_factory.mktemp("cdk-review-lease-watch")), app_dispatch_concurrency={"video": 2})


@pytest.fixture(scope="module")
def deployed(synthesized_with_video: Synthesized) -> Iterator[Deployed]:
    fixture = contextlib.contextmanager(box_tests.deployed.__wrapped__)  # type: ignore[attr-defined]
    with fixture(synthesized_with_video) as made:
        yield made


# ---- finding ---------------------------------------------------------------------------------------------------


def test_a_scheduler_request_that_hangs_fails_over_to_the_sqs_timer_within_the_result_functions_time(
    deployed: Deployed,
) -> None:
    """Review finding (fixed: ``wiring.lease_watch_scheduler``). docs/design/dispatch.md item 4: "A refused or failed CreateSchedule ... sends the SQS
    timer instead". The result function's Scheduler client is ``wiring.client``'s: botocore's default 60 s connect
    and read timeouts, and 5 retries (6 tries). A Scheduler endpoint that does not answer (a network partition, a
    regional brownout) fails ``watch_lease`` only after minutes; the function (60 s) is killed first, after it
    invoked the next attempt and before any timer watches it: only the sweeper does, 15 minutes past the lease. The
    same client makes the ``DeleteSchedule`` that sits before the next invoke (see
    tests/conformance/test_review_lease_watch.py). ``wiring.event_invoker`` shows the remedy: a client of its own
    with short timeouts (``CreateSchedule`` is idempotent by name, so a retry is safe)."""
    from ryusen_server.lambdas import results as results_lambda

    scheduler = results_lambda.engine().engine.queue._lease_watches  # where lease watches are parked
    assert scheduler is not None
    config = scheduler._client.meta.config
    retries = config.retries or {}
    tries = retries.get("total_max_attempts") or (retries.get("max_attempts", 4) + 1)
    worst_s = tries * (config.connect_timeout + config.read_timeout)
    timeout_s = int(deployed.box.function("ryusen_server.lambdas.results.handler")["Properties"]["Timeout"])
    assert worst_s < timeout_s / 2, (
        f"a hanging CreateSchedule fails after up to {worst_s:.0f} s ({tries} tries, connect {config.connect_timeout}"
        f" s, read {config.read_timeout} s); the result function is killed at {timeout_s} s, before the SQS fallback"
    )


# ---- guards ----------------------------------------------------------------------------------------------------


def test_guard_an_app_with_a_queue_of_its_own_gets_its_lease_watches_there_and_a_silent_attempt_is_unknown_at_its_lease(
    deployed: Deployed,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``video`` (``app_dispatch_concurrency``) takes events; its steps have a 5-minute timeout and are judged long.
    b's and c's lease watches target video's own queue (as its SQS timers would), with the Scheduler's role, and
    b's and the first c's are deleted once recorded. c's first event is lost: its schedule, delivered early to
    video's queue (as the Scheduler would, by the target), is handled there, waits, and takes c as Unknown at its
    lease; on_unknown="retry" runs c once more and the run completes."""
    from ryusen import RetryPolicy

    _inline_up_to(monkeypatch, 0.0)
    _steps_taken_as_long(monkeypatch)
    box = deployed.box
    [video_queue] = [n for n in box.resources("AWS::SQS::Queue") if n.startswith("EngineAppQueue")]
    video_arn, video_url = box.arns[video_queue], box.refs[video_queue]
    retry = RetryPolicy(max_attempts=3, initial_delay=timedelta(0), on_unknown="retry")
    arn, ran, _slow, _app = _timed_app(deployed, "video", steps=("a", "b", "c"), timeout_s=300.0, retry=retry)
    dropped = _losing_once(deployed, arn, "c")
    before = len(box.calls)
    run_id = _start(deployed, "video-flow", {})
    in_flight = wait_for(lambda: dropped and _attempts(deployed.run(run_id), "c"), timeout=30, what="c in flight")
    created = wait_for(lambda: len(_scheduler_calls(deployed, before, "CreateSchedule")) == 2 and True, timeout=10)
    assert created
    schedules = _scheduler_calls(deployed, before, "CreateSchedule")
    assert [json.loads(s["Target"]["Input"])["step_id"] for s in schedules] == ["b", "c"]
    for schedule in schedules:
        assert schedule["Target"]["Arn"] == video_arn, schedule["Target"]
        assert schedule["Target"]["RoleArn"] == deployed.env["RYUSEN_SCHEDULER_ROLE_ARN"]
    deleted = {d["Name"] for d in _scheduler_calls(deployed, before, "DeleteSchedule")}
    assert schedules[0]["Name"] in deleted and schedules[1]["Name"] not in deleted

    scheduler = boto3.client("scheduler", region_name="us-east-1")
    group = deployed.env["RYUSEN_SCHEDULE_GROUP"]
    watch = scheduler.get_schedule(Name=schedules[1]["Name"], GroupName=group)
    lease = datetime.fromisoformat(in_flight[0]["lease_expires_at"])
    due = datetime.fromisoformat(watch["ScheduleExpression"][3:-1]).replace(tzinfo=UTC)
    _shift_clocks(monkeypatch, (due - datetime.now(UTC)).total_seconds() - 30.0)  # delivered 30 s early
    sqs = boto3.client("sqs", region_name="us-east-1")
    sqs.send_message(QueueUrl=video_url, MessageBody=watch["Target"]["Input"])  # the Scheduler's SQS target
    scheduler.delete_schedule(Name=watch["Name"], GroupName=group)
    wait_for(
        lambda: any(a == video_arn and '"lease_timer":true' in b and '"c"' in b for a, b in deployed.source.handled),
        timeout=15,
        what="the lease watch handled from video's queue",
    )
    time.sleep(1)
    [c] = _attempts(deployed.run(run_id), "c")
    assert c["status"] == "authorized" and c["unknown"] is None, c  # not before its lease

    _finished_past_the_lease(deployed, monkeypatch, run_id, lease, "c")
    assert dropped == ["c"] and ran == ["a", "b", "c"], ran

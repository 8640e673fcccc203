"""The SQS queue and EventBridge Scheduler adapters, on moto (in-process).

moto never fires schedules, so these tests do what the local runtime does:
read ``SchedulerTimers.due(now)`` and put each due input on the dispatch queue,
as the real Scheduler's SQS target would.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import pytest
from moto import mock_aws

from ryusen_server.aws.queue import SqsMessage, SqsQueue, create_queues
from ryusen_server.aws.timers import SchedulerTimers, create_schedule_group, schedule_name
from ryusen_server.core.model import TaskRef, TimerKind, TimerRef
from ryusen_server.local.delays import LocalDelays
from ryusen_server.ports import RequestCounter

T0 = datetime(2030, 1, 1, tzinfo=UTC)
ROLE_ARN = "arn:aws:iam::123456789012:role/ryusen-scheduler"
GROUP = "ryusen"
VALID_NAME = re.compile(r"[0-9A-Za-z_.\-]{1,64}")


@dataclass
class Stack:
    sqs: Any
    scheduler: Any
    queue_url: str
    dlq_url: str
    queue_arn: str
    counter: RequestCounter
    timers: SchedulerTimers
    queue: SqsQueue

    def deliver_due(self, now: datetime) -> list[str]:
        """What EventBridge Scheduler would do at ``now``: each due input becomes a queue message."""
        fired = []
        for name, body in self.timers.due(now):
            self.sqs.send_message(QueueUrl=self.queue_url, MessageBody=body)
            self.timers.delete(name)
            fired.append(name)
        return fired

    def attribute(self, url: str, name: str) -> int:
        attributes = self.sqs.get_queue_attributes(QueueUrl=url, AttributeNames=[name])["Attributes"]
        return int(attributes[name])


@pytest.fixture
def stack(aws_env: None) -> Iterator[Stack]:
    with mock_aws():
        sqs = boto3.client("sqs", region_name="us-east-1")
        scheduler = boto3.client("scheduler", region_name="us-east-1")
        queue_url, dlq_url = create_queues(sqs, "ryusen-dispatch")
        queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        create_schedule_group(scheduler, GROUP)
        counter = RequestCounter()
        dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        timers = SchedulerTimers(
            scheduler,
            group=GROUP,
            target_arn=queue_arn,
            role_arn=ROLE_ARN,
            dead_letter_arn=dlq_arn,
            counter=counter,
            clock=lambda: T0,
        )
        queue = SqsQueue(sqs, queue_url, timers, counter, clock=lambda: T0)
        yield Stack(sqs, scheduler, queue_url, dlq_url, queue_arn, counter, timers, queue)


def forward(run_id: str = "run_1", generation: int = 1) -> TaskRef:
    return TaskRef(run_id=run_id, kind="forward", step_id="charge-card", generation=generation)


def poll(receive: Any, *, timeout_s: float = 15.0) -> list[SqsMessage]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        messages: list[SqsMessage] = receive()
        if messages:
            return messages
        time.sleep(0.1)
    raise AssertionError("no message arrived")


# ---- queue ------------------------------------------------------------------------


def test_create_queues_sets_the_redrive_policy_and_visibility(stack: Stack) -> None:
    attributes = stack.sqs.get_queue_attributes(QueueUrl=stack.queue_url, AttributeNames=["All"])["Attributes"]
    dlq_arn = stack.sqs.get_queue_attributes(QueueUrl=stack.dlq_url, AttributeNames=["QueueArn"])["Attributes"]
    redrive = json.loads(attributes["RedrivePolicy"])
    assert redrive["deadLetterTargetArn"] == dlq_arn["QueueArn"]
    assert int(redrive["maxReceiveCount"]) == 10
    assert attributes["VisibilityTimeout"] == "360"
    assert create_queues(stack.sqs, "ryusen-dispatch") == (stack.queue_url, stack.dlq_url)  # idempotent


def test_an_attempts_own_lease_timer_says_so_in_its_body(stack: Stack) -> None:
    timer = forward().model_copy(update={"lease_timer": True})  # the result function's, for one attempt
    stack.queue.send(timer)
    [message] = stack.queue.receive()
    assert message.task == timer and json.loads(message.body)["lease_timer"] is True
    assert "watches_before" not in message.body
    stack.queue.delete(message.message_id)
    # a run's lease timer (one for the run's steps): what it also watches round-trips
    shared = timer.model_copy(update={"watches_before": datetime(2030, 1, 1, 0, 0, 58, tzinfo=UTC)})
    stack.queue.send(shared)
    [message] = stack.queue.receive()
    assert message.task == shared and message.task.watches_before == shared.watches_before
    stack.queue.delete(message.message_id)


def test_send_receive_delete(stack: Stack) -> None:
    task = forward()
    stack.queue.send(task)
    [message] = stack.queue.receive()
    assert message.task == task and message.timer is None
    # the body is what it was before lease timers existed: a dispatcher not yet upgraded reads it
    assert message.body == task.model_dump_json(exclude={"lease_timer", "watches_before"})
    assert "lease_timer" not in message.body and "watches_before" not in message.body
    assert message.receive_count == 1
    stack.queue.delete(message.message_id)
    stack.queue.delete(message.message_id)  # deleting twice is harmless
    assert stack.attribute(stack.queue_url, "ApproximateNumberOfMessages") == 0
    assert stack.attribute(stack.queue_url, "ApproximateNumberOfMessagesNotVisible") == 0
    assert stack.counter.counts == {"sqs.send": 1, "sqs.receive": 1, "sqs.delete": 2}


def test_a_short_delay_uses_sqs_delay_seconds_rounded_up(stack: Stack) -> None:
    task = TaskRef(run_id="run_1", kind="discover", seq=2)
    stack.queue.send(task, delay_s=0.2)  # rounded up to one second: never early
    assert stack.queue.receive() == []
    assert stack.attribute(stack.queue_url, "ApproximateNumberOfMessagesDelayed") == 1
    [message] = poll(stack.queue.receive)
    assert message.task == task
    assert stack.scheduler.list_schedules(GroupName=GROUP)["Schedules"] == []


def test_with_a_hold_a_sub_second_delay_is_kept_there_and_sent_undelayed_when_due(stack: Stack) -> None:
    """``ryusen dev``: a delay SQS would round up to whole seconds is held in-process to the millisecond."""
    held: list[tuple[float, Callable[[], None]]] = []
    queue = SqsQueue(stack.sqs, stack.queue_url, stack.timers, stack.counter, hold=lambda d, f: held.append((d, f)))
    task = TaskRef(run_id="run_1", kind="discover", seq=2)
    queue.send(task, delay_s=0.2)
    queue.send(forward(generation=3), delay_s=1800.5)  # past SQS's limit: still the Scheduler's
    [(delay_s, send)] = held
    assert delay_s == 0.2 and queue.receive() == []  # nothing on SQS until the hold sends it
    assert len(stack.scheduler.list_schedules(GroupName=GROUP)["Schedules"]) == 1
    send()
    assert stack.attribute(stack.queue_url, "ApproximateNumberOfMessagesDelayed") == 0
    [message] = queue.receive()  # at once: no DelaySeconds
    assert message.task == task


def test_local_delays_send_each_when_due_in_due_order_and_retry_a_failed_send() -> None:
    delays = LocalDelays()
    sent: list[tuple[str, float]] = []
    failures = [RuntimeError("moto answered 500")]
    started = time.monotonic()

    def send(name: str) -> Callable[[], None]:
        def go() -> None:
            if name == "flaky" and failures:
                raise failures.pop()
            sent.append((name, time.monotonic() - started))

        return go

    try:
        delays.call_later(0.3, send("late"))
        delays.call_later(0.1, send("early"))
        delays.call_later(0.0, send("flaky"))
        deadline = time.monotonic() + 15
        while len(sent) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        delays.stop()
    assert [name for name, _ in sent] == ["early", "late", "flaky"]  # flaky failed once, then went 0.5 s later
    assert sent[0][1] >= 0.1 and sent[1][1] >= 0.3 and sent[2][1] >= 0.5  # never early
    assert delays.pending() == 0 and not failures


def test_a_delay_past_sqs_limit_becomes_a_schedule_that_delivers_the_same_task(stack: Stack) -> None:
    task = forward(generation=3)
    stack.queue.send(task, delay_s=1800.5)
    assert stack.queue.receive() == []
    assert stack.attribute(stack.queue_url, "ApproximateNumberOfMessagesDelayed") == 0
    [summary] = stack.scheduler.list_schedules(GroupName=GROUP)["Schedules"]
    schedule = stack.scheduler.get_schedule(Name=summary["Name"], GroupName=GROUP)
    assert schedule["ScheduleExpression"] == "at(2030-01-01T00:30:01)"
    assert schedule["Target"]["Arn"] == stack.queue_arn
    assert VALID_NAME.fullmatch(summary["Name"])

    assert stack.deliver_due(T0 + timedelta(seconds=1800)) == []  # not yet
    assert stack.deliver_due(T0 + timedelta(seconds=1801)) == [summary["Name"]]
    [message] = stack.queue.receive()
    assert message.task == task
    assert stack.scheduler.list_schedules(GroupName=GROUP)["Schedules"] == []


def test_sending_the_same_long_delay_twice_schedules_it_once(stack: Stack) -> None:
    stack.queue.send(forward(), delay_s=3600)
    stack.queue.send(forward(), delay_s=3600)
    stack.queue.send(forward(generation=2), delay_s=3600)
    assert len(stack.scheduler.list_schedules(GroupName=GROUP)["Schedules"]) == 2


def test_without_a_scheduler_a_long_delay_is_capped_not_lost(stack: Stack, caplog: pytest.LogCaptureFixture) -> None:
    queue = SqsQueue(stack.sqs, stack.queue_url, None, RequestCounter())
    with caplog.at_level(logging.WARNING, logger="ryusen.aws.queue"):
        queue.send(forward(), delay_s=7200)
    assert "no scheduler" in caplog.text
    assert stack.attribute(stack.queue_url, "ApproximateNumberOfMessagesDelayed") == 1


def test_change_visibility_hides_and_reveals_a_message(stack: Stack) -> None:
    stack.queue.send(forward())
    [first] = stack.queue.receive()
    assert stack.queue.receive() == []  # in flight: invisible for the queue's 360 s
    stack.queue.change_visibility(first.message_id, 0)
    [again] = stack.queue.receive()
    assert again.task == first.task and again.receive_count == 2
    stack.queue.change_visibility(again.message_id, 10**6)  # beyond 12 h: capped, not refused
    assert stack.queue.receive() == []
    assert stack.attribute(stack.queue_url, "ApproximateNumberOfMessagesNotVisible") == 1
    stack.queue.delete(again.message_id)
    stack.queue.change_visibility(again.message_id, 5)  # a deleted message: nothing to do
    assert stack.counter.counts["sqs.change_visibility"] == 3


def test_a_malformed_message_is_skipped_and_left_for_the_dead_letter_queue(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    # no visibility delay, so that every receive counts at once towards the redrive's maxReceiveCount
    stack.sqs.set_queue_attributes(QueueUrl=stack.queue_url, Attributes={"VisibilityTimeout": "0"})
    malformed = {"not json {", '{"run_id": "run_1", "kind": "teleport"}'}
    for body in sorted(malformed):
        stack.sqs.send_message(QueueUrl=stack.queue_url, MessageBody=body)
    stack.queue.send(forward())
    tasks: list[TaskRef | None] = []
    with caplog.at_level(logging.ERROR, logger="ryusen.aws.queue"):
        for _ in range(60):
            for message in stack.queue.receive():
                tasks.append(message.task)
                stack.queue.delete(message.message_id)
            if stack.attribute(stack.dlq_url, "ApproximateNumberOfMessages") == len(malformed):
                break
    assert tasks == [forward()]  # the malformed ones never reach a handler
    assert caplog.text.count("malformed dispatch message") >= 2 * len(malformed)
    dead = stack.sqs.receive_message(QueueUrl=stack.dlq_url, MaxNumberOfMessages=10)["Messages"]
    assert {m["Body"] for m in dead} == malformed
    assert stack.attribute(stack.queue_url, "ApproximateNumberOfMessages") == 0


# ---- timers -----------------------------------------------------------------------


def test_a_timer_is_a_one_time_schedule_targeting_the_queue(stack: Stack) -> None:
    timer = TimerRef(run_id="run_1", kind=TimerKind.DEADLINE, at=T0 + timedelta(minutes=5, microseconds=250))
    stack.timers.schedule(timer)
    schedule = stack.scheduler.get_schedule(Name=timer.name, GroupName=GROUP)
    assert schedule["ScheduleExpression"] == "at(2030-01-01T00:05:01)"  # rounded up: never early
    assert schedule["ScheduleExpressionTimezone"] == "UTC"
    assert schedule["FlexibleTimeWindow"] == {"Mode": "OFF"}
    assert schedule["ActionAfterCompletion"] == "DELETE"
    assert schedule["Target"]["Arn"] == stack.queue_arn
    assert schedule["Target"]["RoleArn"] == ROLE_ARN
    assert TimerRef.model_validate(json.loads(schedule["Target"]["Input"])["timer"]) == timer
    # a target that keeps failing (a wrong role, a deleted queue) is retried, then kept in a dead-letter queue
    dlq_arn = stack.sqs.get_queue_attributes(QueueUrl=stack.dlq_url, AttributeNames=["QueueArn"])["Attributes"]
    assert schedule["Target"]["DeadLetterConfig"] == {"Arn": dlq_arn["QueueArn"]}
    assert schedule["Target"]["RetryPolicy"]["MaximumRetryAttempts"] >= 100
    assert schedule["Target"]["RetryPolicy"]["MaximumEventAgeInSeconds"] == 86400


def test_a_cancelled_timer_deletes_its_schedule(stack: Stack) -> None:
    timer = TimerRef(run_id="run_1", kind=TimerKind.DEADLINE, at=T0 + timedelta(days=30))
    stack.timers.schedule(timer)
    stack.timers.cancel(timer)
    stack.timers.cancel(timer)  # already gone: fine
    assert stack.scheduler.list_schedules(GroupName=GROUP)["Schedules"] == []


def test_due_timers_reach_the_queue_as_timer_messages_then_are_deleted(stack: Stack) -> None:
    probe = TimerRef(run_id="run_1", kind=TimerKind.PROBE, at=T0 + timedelta(minutes=1))
    deadline = TimerRef(run_id="run_2", kind=TimerKind.DEADLINE, at=T0 + timedelta(hours=1))
    stack.timers.schedule(deadline)
    stack.timers.schedule(probe)
    assert stack.timers.due(T0) == []
    assert [name for name, _ in stack.timers.due(T0 + timedelta(hours=2))] == [probe.name, deadline.name]

    assert stack.deliver_due(T0 + timedelta(minutes=1)) == [probe.name]
    [message] = stack.queue.receive()
    assert message.timer == probe and message.task is None
    assert stack.timers.due(T0 + timedelta(minutes=59)) == []
    assert stack.deliver_due(T0 + timedelta(hours=1)) == [deadline.name]
    assert stack.timers.due(T0 + timedelta(days=1)) == []
    stack.timers.delete(deadline.name)  # already gone: fine


def test_due_reads_each_schedule_once(stack: Stack) -> None:
    for minutes in (1, 2, 3):
        stack.timers.schedule(TimerRef(run_id="run_1", kind=TimerKind.PROBE, at=T0 + timedelta(minutes=minutes)))
    for _ in range(5):
        stack.timers.due(T0)
    assert stack.counter.counts["scheduler.get_schedule"] == 3
    assert stack.counter.counts["scheduler.list_schedules"] == 5


def test_a_timer_in_the_past_is_scheduled_just_after_now(stack: Stack) -> None:
    timer = TimerRef(run_id="run_1", kind=TimerKind.DEADLINE, at=T0 - timedelta(hours=1))
    stack.timers.schedule(timer)
    schedule = stack.scheduler.get_schedule(Name=timer.name, GroupName=GROUP)
    assert schedule["ScheduleExpression"] == "at(2030-01-01T00:00:01)"


def test_scheduling_the_same_timer_twice_is_idempotent(stack: Stack) -> None:
    timer = TimerRef(run_id="run_1", kind=TimerKind.PROBE, at=T0 + timedelta(minutes=1))
    stack.timers.schedule(timer)
    stack.timers.schedule(timer)
    assert [s["Name"] for s in stack.scheduler.list_schedules(GroupName=GROUP)["Schedules"]] == [timer.name]
    assert stack.counter.counts["scheduler.create_schedule"] == 2


def test_names_aws_would_reject_are_made_valid_deterministically(stack: Stack) -> None:
    long_run = "run_" + "x" * 80
    odd_run = "run/with spaces:and#signs"
    timers = [
        TimerRef(run_id=long_run, kind=TimerKind.DEADLINE, at=T0 + timedelta(minutes=1)),
        TimerRef(run_id=long_run, kind=TimerKind.PROBE, at=T0 + timedelta(minutes=1)),
        TimerRef(run_id=odd_run, kind=TimerKind.PROBE, at=T0 + timedelta(minutes=1)),
    ]
    for timer in timers:
        assert not VALID_NAME.fullmatch(timer.name)
        stack.timers.schedule(timer)
        stack.timers.schedule(timer)  # the same sanitized name: still one schedule
    names = [s["Name"] for s in stack.scheduler.list_schedules(GroupName=GROUP)["Schedules"]]
    assert len(names) == 3 and all(VALID_NAME.fullmatch(n) for n in names)
    assert sorted(names) == sorted(schedule_name(t.name) for t in timers)
    due = stack.timers.due(T0 + timedelta(minutes=1))
    assert {TimerRef.model_validate(json.loads(body)["timer"]) for _, body in due} == set(timers)

    assert schedule_name("ryusen-probe-run_1-1700000000") == "ryusen-probe-run_1-1700000000"
    assert schedule_name("a" * 65) == schedule_name("a" * 65) != schedule_name("a" * 66)
    assert len(schedule_name("a" * 65)) == 64 and schedule_name("") != ""


def test_create_schedule_group_twice_keeps_its_schedules(stack: Stack) -> None:
    stack.timers.schedule(TimerRef(run_id="run_1", kind=TimerKind.PROBE, at=T0 + timedelta(minutes=1)))
    create_schedule_group(stack.scheduler, GROUP)
    assert len(stack.scheduler.list_schedules(GroupName=GROUP)["Schedules"]) == 1


# ---- fair sharing: each task in its app's message group --------------------------------


def groups(stack: Stack) -> list[str | None]:
    response = stack.sqs.receive_message(
        QueueUrl=stack.queue_url, MaxNumberOfMessages=10, MessageSystemAttributeNames=["MessageGroupId"]
    )
    return [m.get("Attributes", {}).get("MessageGroupId") for m in response.get("Messages", [])]


def test_a_task_is_sent_in_its_apps_message_group(stack: Stack) -> None:
    """A standard queue with message groups is an SQS fair queue: the app is the tenant (issue 25)."""
    stack.queue.send(forward(), app_id="shop")
    stack.queue.send(forward("run_2"))  # no app given (an older caller): no group, a tenant of its own
    assert sorted(groups(stack), key=str) == [None, "shop"]


def test_a_task_held_for_a_sub_second_delay_keeps_its_group(stack: Stack) -> None:
    held: list[Callable[[], None]] = []
    queue = SqsQueue(stack.sqs, stack.queue_url, stack.timers, hold=lambda _delay, send: held.append(send))
    queue.send(forward(), delay_s=0.2, app_id="shop")
    [send] = held
    send()
    assert groups(stack) == ["shop"]


def test_an_app_id_sqs_would_refuse_as_a_group_is_sent_as_its_digest(stack: Stack) -> None:
    for app_id in ("é" * 10, "a" * 256, "my shop"):
        stack.queue.send(forward(), app_id=app_id)
    sent = groups(stack)
    assert len(sent) == 3 and len(set(sent)) == 3
    assert all(g is not None and g.startswith("sha256:") and len(g) <= 128 for g in sent)
    assert all(33 <= ord(c) <= 126 for g in sent if g is not None for c in g)


def test_a_resent_message_stays_in_its_group(stack: Stack) -> None:
    stack.queue.resend(forward().model_dump_json(), 0, group="shop")
    assert groups(stack) == ["shop"]


def test_with_fair_queues_off_no_group_is_sent(stack: Stack) -> None:
    """``RYUSEN_FAIR_QUEUE=false``: for a partition whose standard queues refuse a message group."""
    queue = SqsQueue(stack.sqs, stack.queue_url, stack.timers, fair=False)
    queue.send(forward(), app_id="shop")
    queue.resend(forward().model_dump_json(), 0, group="shop")
    assert groups(stack) == [None, None]

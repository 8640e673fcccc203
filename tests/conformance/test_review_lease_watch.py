"""Review of the uncommitted "lease watch that is deleted" change (docs/design/dispatch.md, "A lease watch that is
deleted, for long leases"), through the engine and the SDK: the harness of tests/conformance/test_review_events.py
(the testing kit's engine, virtual clock and in-process queue, whose ``watch_lease`` stands in for the Scheduler;
Lambda's async queue; a loopback result URL whose posts go to ``Engine.submit_result``). Every step is judged long
(``scheduled_lease_share`` unbounded), so every attempt the result function sends is watched by a schedule.

Finding (first test): the schedule of the attempt whose outcome was just recorded is deleted between the write that
authorizes the next attempt and that attempt's invocation. The guards after it pin what was tried and held."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ryusen import RetryPolicy, Ryusen, Step
from ryusen._internal.wire import Phase
from tests.conformance.test_review_events import Harness
from tests.functional.test_lambda_events import SharedSeen

TIMEOUT = timedelta(seconds=300)


def flow(
    ran: list[str],
    *,
    fail_once: tuple[str, ...] = (),
    retry: RetryPolicy | None = None,
    compensate: bool = False,
    fail_at_end: bool = False,
) -> Callable[[str], Ryusen]:
    """Steps a, b, c of the default timeout (5 minutes: a lease of 6); a step in ``fail_once`` raises the first
    time; with ``compensate`` each has an undo; with ``fail_at_end`` the function fails after c."""

    def make(key: str) -> Ryusen:
        app = Ryusen("evshop", signing_key=key, seen_requests=SharedSeen())
        failed: set[str] = set()

        def work(name: str) -> str:
            ran.append(name)
            if name in fail_once and name not in failed:
                failed.add(name)
                raise RuntimeError(f"{name} failed once")
            return name

        def undo(name: str) -> Callable[[Any], Any] | None:
            if not compensate:
                return None

            def back(result: Any) -> Any:
                ran.append(f"undo-{name}")
                return None

            return back

        @app.function("buy")
        def buy(data: Any, step: Step) -> Any:
            out = [step.run(s, work, s, timeout=TIMEOUT, retry=retry, compensate=undo(s)) for s in ("a", "b", "c")]
            if fail_at_end:
                raise RuntimeError("refused at the end")
            return out

        return app

    return make


@pytest.fixture
def harness(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(app_factory: Callable[[str], Ryusen]) -> Harness:
        h = Harness(app_factory, monkeypatch)
        engine = h.env.engine
        engine.settings = dataclasses.replace(engine.settings, scheduled_lease_share=math.inf, inline_up_to_s=0.0)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def _trace(h: Harness, monkeypatch: pytest.MonkeyPatch, *, delete_takes: timedelta = timedelta(0)) -> list[Any]:
    """Record, in order, each lease watch parked and deleted and each event sent (with the virtual time it was sent
    at); a delete takes ``delete_takes`` of virtual time (a throttled ``DeleteSchedule``, retried by botocore)."""
    trace: list[Any] = []
    queue = h.env.queue
    watch, unwatch, invoke = queue.watch_lease, queue.unwatch_lease, h.lam.invoke_event

    def watching(task: Any, at: datetime, *, key: str, app_id: str | None = None) -> bool:
        trace.append(("watch", task.step_id, task.phase.value, task.generation, key))
        return bool(watch(task, at, key=key, app_id=app_id))

    def unwatching(key: str) -> None:
        # what the store holds of the attempt the key names, when its schedule is deleted
        named = next((e[1:4] for e in trace if e[0] == "watch" and e[4] == key), None)
        status = None
        if named is not None:
            state = h.env.engine.store.get(key.rsplit("-", 1)[0])
            step = state.step(named[0]) if state is not None else None
            attempt = step.attempt(Phase(named[1]), named[2]) if step is not None else None
            status = attempt.status.value if attempt is not None else None
        trace.append(("unwatch", key, status))
        h.env.clock.advance(delete_takes)
        unwatch(key)

    def invoking(function_arn: str, payload: bytes) -> Any:
        result = invoke(function_arn, payload)
        request = h.lam.sent[-1]["request"]
        trace.append(("invoke", request.get("step_id"), h.env.clock()))
        return result

    monkeypatch.setattr(queue, "watch_lease", watching)
    monkeypatch.setattr(queue, "unwatch_lease", unwatching)
    monkeypatch.setattr(h.lam, "invoke_event", invoking)
    return trace


def _watch_messages(h: Harness) -> dict[str, Any]:
    """The lease watches still parked (not taken back, not yet delivered), by key."""
    queue = h.env.queue
    pending = {m.message_id: m for m in queue.pending()}
    return {key: pending[mid] for key, mid in queue._watches.items() if mid in pending}


# ---- finding ---------------------------------------------------------------------------------------------------


def test_the_next_attempt_is_invoked_before_the_last_attempts_lease_watch_is_deleted(
    harness: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review finding (fixed: the delete is last). ``_submit_result`` deletes the settled attempt's schedule (``unwatch_lease``, a
    ``DeleteSchedule``) after the write that settled it *and authorized the next attempt*, but before
    ``_carry_on`` invokes that attempt. The delete is best effort, yet it sits on the next attempt's path: its lease
    runs from its authorization, and every second the delete takes (botocore's 5 tries with backoff under a
    throttle; up to the function's 60 s timeout with the client's 60 s connect and read timeouts) is taken from the
    60 s grace meant for Lambda's queue and a cold start. A result function killed there (its timeout) leaves the
    next attempt authorized, never sent, and watched by nothing but the sweeper, 15 minutes past its lease: it is
    then Unknown though it never ran (the run blocks unless on_unknown="retry"). Here a delete takes 40 s of
    virtual time: b's and c's events leave 40 s after they were authorized."""
    ran: list[str] = []
    h = harness(flow(ran))
    trace = _trace(h, monkeypatch, delete_takes=timedelta(seconds=40))
    run_id = h.env.start("buy", {})
    run = h.settle(run_id)
    assert run.outcome == "completed", run.summary
    assert ran == ["a", "b", "c"]
    for step_id in ("b", "c"):
        [attempt] = run.attempts(step_id)
        authorized = datetime.fromisoformat(attempt["authorized_at"])
        [sent_at] = [e[2] for e in trace if e[0] == "invoke" and e[1] == step_id]
        late = (sent_at - authorized).total_seconds()
        assert late < 1.0, f"{step_id}'s event was sent {late:.0f} s after its authorization, behind a delete: {trace}"


# ---- guards: what was tried and held ---------------------------------------------------------------------------


def test_guard_each_schedule_is_deleted_only_for_its_own_settled_attempt_and_none_is_left(
    harness: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """b fails once and is retried at once (same step, generation 2, in the write that records the failure); the
    run then fails after c and compensates c, b and a, each compensation sent as an event by the result function.
    Every key names one (step, phase, generation); a key is deleted only after the attempt it names has settled
    (never the retry's for the failure's, never the compensation's for the forward's), and once the run has
    finished no watch is left parked."""
    ran: list[str] = []
    retry = RetryPolicy(max_attempts=3, initial_delay=timedelta(0))
    h = harness(flow(ran, fail_once=("b",), retry=retry, compensate=True, fail_at_end=True))
    trace = _trace(h, monkeypatch)
    run_id = h.env.start("buy", {})
    run = h.settle(run_id)
    assert run.summary == "failed, fully compensated", run.summary
    assert ran == ["a", "b", "b", "c", "undo-c", "undo-b", "undo-a"], ran
    watched = {e[4]: e[1:4] for e in trace if e[0] == "watch"}
    assert len(watched) == len(set(watched.values())) >= 5, watched  # one key per attempt
    assert ("b", "forward", 2) in watched.values() and ("b", "compensation", 1) in watched.values()
    deleted = [e for e in trace if e[0] == "unwatch" and e[1] in watched]
    assert len(deleted) >= 5, trace
    for _, key, status in deleted:  # each settled (durably: in the store) when its schedule was deleted
        assert status in ("succeeded", "failed"), (watched[key], status, trace)
    assert _watch_messages(h) == {}


def test_guard_a_silent_retry_watched_by_a_schedule_is_unknown_at_its_lease_not_before_nor_left_unwatched(
    harness: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """b fails once; its retry (generation 2), sent by the result function in the write that records the failure,
    is lost in Lambda's queue. Deleting generation 1's schedule leaves generation 2's: it is delivered a minute
    before the lease ends (and again when Scheduler's minute-precision would make it 59 s early), waits, and takes
    b #2 as Unknown exactly at its lease; on_unknown="retry" runs b a third time and the run completes."""
    ran: list[str] = []
    retry = RetryPolicy(max_attempts=4, initial_delay=timedelta(0), on_unknown="retry")
    h = harness(flow(ran, fail_once=("b",), retry=retry))
    trace = _trace(h, monkeypatch)
    run_id = h.env.start("buy", {})
    while h.env.step_once():
        pass
    assert h.lam.pump(once=True) == 1  # a, whose post sends b #1
    assert h.lam.pump(once=True) == 1  # b #1 fails; the post sends b #2
    assert [s for s, _ in h.results] == [200, 200]
    assert h.lam.steps_sent()[-1] == ("b", "forward", 2)
    h.lam.queued.clear()  # b #2 is lost: nothing runs, nothing is posted
    [(key, message)] = [(k, m) for k, m in _watch_messages(h).items()]
    assert next(e for e in trace if e[0] == "watch" and e[4] == key)[1:4] == ("b", "forward", 2)
    b2 = h.env.get(run_id).attempts("b")[-1]
    lease = datetime.fromisoformat(b2["lease_expires_at"])
    assert lease - message.visible_at == timedelta(seconds=60)
    for at in (message.visible_at - timedelta(seconds=59), message.visible_at, lease - timedelta(seconds=1)):
        message.visible_at = at  # delivered then (early, as due, just before the lease)
        h.env.clock.advance_to(max(h.env.clock(), at))
        while h.env.step_once():
            pass
        assert h.env.get(run_id).attempts("b")[-1]["status"] == "authorized", at
    h.env.clock.advance_to(lease)
    while h.env.step_once():
        pass
    b2 = h.env.get(run_id).attempts("b")[1]
    assert b2["status"] != "authorized" and datetime.fromisoformat(b2["unknown"]["at"]) >= lease, b2
    run = h.settle(run_id)
    assert run.outcome == "completed", run.summary
    assert ran == ["a", "b", "b", "c"], ran


def test_guard_a_heartbeat_lease_after_a_long_step_is_watched_by_a_schedule_that_follows_the_heartbeats(
    harness: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked against docs/design/dispatch.md item 1 ("so does a heartbeat's short lease" keep sharing the run's
    SQS timer): with ``scheduled_lease_from_s`` now 60 s, a heartbeat's lease (30 s and the minute's grace: 90 s)
    after a step of 100 s *is* parked as a schedule, due 30 s after the authorization. That is safe, which this
    pins: delivered at once, it finds the lease moved by heartbeats every 20 s and waits, again and again, for
    5 minutes; once they stop it takes b as Unknown at its last lease, not before. (The default share, 4.)"""
    from ryusen_server.core.events import HeartbeatReported

    ran: list[str] = []
    holder: dict[str, Any] = {}

    def make(key: str) -> Ryusen:
        app = Ryusen("evshop", signing_key=key, seen_requests=SharedSeen())

        def slow(name: str) -> str:
            ran.append(name)
            holder["clock"].advance(timedelta(seconds=100))  # a step of 100 s (virtual)
            return name

        def beating(name: str) -> str:
            ran.append(name)
            return name

        @app.function("buy")
        def buy(data: Any, step: Step) -> Any:
            return [
                step.run("a", slow, "a", timeout=TIMEOUT),
                step.run("b", beating, "b", timeout=timedelta(seconds=600), heartbeat=timedelta(seconds=30)),
            ]

        return app

    h = harness(make)
    holder["clock"] = h.env.clock
    h.env.engine.settings = dataclasses.replace(h.env.engine.settings, scheduled_lease_share=4.0)
    trace = _trace(h, monkeypatch)
    run_id = h.env.start("buy", {})
    while h.env.step_once():
        pass
    assert h.lam.pump(once=True) == 1  # a (100 s); its post sends b, with a heartbeat's lease of 90 s
    assert [e[1:4] for e in trace if e[0] == "watch"] == [("b", "forward", 1)], trace
    h.lam.queued.clear()  # b "runs" elsewhere: only its heartbeats are heard
    [b] = h.env.get(run_id).attempts("b")
    first_lease = datetime.fromisoformat(b["lease_expires_at"])
    assert first_lease - datetime.fromisoformat(b["authorized_at"]) == timedelta(seconds=90)
    for seq in range(1, 16):  # heartbeats every 20 s for 5 minutes
        h.env.clock.advance(timedelta(seconds=20))
        beat = HeartbeatReported(step_id="b", phase=Phase.FORWARD, generation=1, details=None, seq=seq)
        h.env.engine.apply(run_id, beat)
        while h.env.step_once():
            pass
        assert h.env.get(run_id).attempts("b")[0]["status"] == "authorized", seq
    [b] = h.env.get(run_id).attempts("b")
    last_lease = datetime.fromisoformat(b["lease_expires_at"])
    assert last_lease > first_lease + timedelta(seconds=240)
    h.env.clock.advance_to(last_lease - timedelta(seconds=1))
    while h.env.step_once():
        pass
    assert h.env.get(run_id).attempts("b")[0]["status"] == "authorized"
    h.env.clock.advance_to(last_lease)
    while h.env.step_once():
        pass
    [b] = h.env.get(run_id).attempts("b")
    assert b["status"] != "authorized" and datetime.fromisoformat(b["unknown"]["at"]) >= last_lease, b


@pytest.mark.parametrize(
    "error",
    ["throttled", "validation", "connect_timeout", "read_timeout", "connection_closed", "no_credentials"],
)
def test_guard_a_failed_scheduler_request_never_escapes_and_a_failed_create_is_reported_for_the_sqs_fallback(
    error: str,
) -> None:
    """``SqsQueue.watch_lease`` answers False (the engine then sends the SQS timer) and ``unwatch_lease`` returns for
    each way a botocore call fails: an AWS refusal (``ClientError``), and the ``BotoCoreError`` family (timeouts, a
    connection lost, no credentials). A ``ConflictException`` (the same name, so the same attempt, created by a try
    whose answer was lost) is taken as created."""
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    from ryusen._internal.wire import TaskKind
    from ryusen_server.aws.queue import SqsQueue
    from ryusen_server.aws.timers import SchedulerTimers
    from ryusen_server.core.model import TaskRef

    def raised() -> Exception:
        if error == "throttled":
            return ClientError({"Error": {"Code": "ThrottlingException", "Message": "slow down"}}, "CreateSchedule")
        if error == "validation":
            return ClientError({"Error": {"Code": "ValidationException", "Message": "no"}}, "CreateSchedule")
        if error == "connect_timeout":
            return ConnectTimeoutError(endpoint_url="https://scheduler")
        if error == "read_timeout":
            return ReadTimeoutError(endpoint_url="https://scheduler")
        if error == "connection_closed":
            return ConnectionClosedError(endpoint_url="https://scheduler")
        return NoCredentialsError()

    class Failing:
        calls: list[str] = []

        def create_schedule(self, **kwargs: Any) -> None:
            self.calls.append(kwargs["Name"])
            raise raised()

        def delete_schedule(self, **kwargs: Any) -> None:
            self.calls.append(kwargs["Name"])
            raise raised()

    class Conflicting(Failing):
        def create_schedule(self, **kwargs: Any) -> None:
            raise ClientError({"Error": {"Code": "ConflictException", "Message": "exists"}}, "CreateSchedule")

    client = Failing()
    timers = SchedulerTimers(
        client, group="g", target_arn="arn:aws:sqs:us-east-1:1:q", role_arn="arn:aws:iam::1:role/r"
    )
    queue = SqsQueue(object(), "https://sqs/q", timers)  # type: ignore[arg-type]
    task = TaskRef(run_id="run_" + "0" * 32, kind=TaskKind.FORWARD, step_id="s", generation=1, lease_timer=True)
    at = datetime(2030, 1, 1, tzinfo=UTC)
    assert queue.watch_lease(task, at, key="run_" + "0" * 32 + "-0123456789ab", app_id="shop") is False
    queue.unwatch_lease("run_" + "0" * 32 + "-0123456789ab")
    assert len(client.calls) == 2 and all(len(n) <= 64 for n in client.calls), client.calls
    conflicting = SqsQueue(
        object(),
        "https://sqs/q",
        SchedulerTimers(  # type: ignore[arg-type]
            Conflicting(), group="g", target_arn="arn:aws:sqs:us-east-1:1:q", role_arn="arn:aws:iam::1:role/r"
        ),
    )
    assert conflicting.watch_lease(task, at, key="k", app_id="shop") is True


def test_guard_lease_watch_names_are_names_aws_accepts_whatever_the_run_id() -> None:
    """A schedule name is 1-64 characters of ``[0-9A-Za-z_.-]``. The engine's run ids (``run_`` and 32 hex) give
    62; any longer or odd id (another ``new_id``) goes through ``schedule_name``, for the create and the delete
    alike, and two attempts never share a name."""
    import re

    from ryusen_server.aws.queue import lease_watch_name
    from ryusen_server.aws.timers import schedule_name
    from ryusen_server.engine import _lease_watch_key

    names = set()
    for run_id in ("run_" + "f" * 32, "run_" + "f" * 60, "r:é/ü*" * 9, "x"):
        for step_id in ("a", "b" * 300, "c\nd"):
            for phase in (Phase.FORWARD, Phase.COMPENSATION):
                for generation in (1, 2, 10):
                    name = schedule_name(lease_watch_name(_lease_watch_key(run_id, step_id, phase, generation)))
                    assert re.fullmatch(r"[0-9A-Za-z_.\-]{1,64}", name), name
                    names.add(name)
    assert len(names) == 4 * 3 * 2 * 3
    assert len(lease_watch_name(_lease_watch_key("run_" + "f" * 32, "a", Phase.FORWARD, 1))) == 62

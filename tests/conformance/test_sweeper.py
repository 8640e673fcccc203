"""The sweeper (issue 12, item 2): a run whose work is overdue with nothing on its way to move it is repaired.

What moves a run is a message (a task, a delayed retry) or a schedule (its deadline, the probe of a blocked
run), each sent after the write that needed it. A send or a schedule that fails after that write committed,
with no message of the run left to notice (a start without an idempotency key, a retry's delayed message),
left the run waiting forever: "needs a sweeper" (docs/design/engine.md). Each test loses one such thing,
shows the run stuck, and shows one sweep repairing it, without running anything twice.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

from ryusen import RetryPolicy, Ryusen, Step, StepFailed
from ryusen.testing import WorkflowEnvironment
from ryusen_server.core.model import TaskKind
from ryusen_server.engine import SWEEP_GRACE_S

PAST_GRACE = timedelta(seconds=SWEEP_GRACE_S + 1)


def shop(calls: Counter[str], *, fail_charges: int = 0) -> Ryusen:
    app = Ryusen("shop")

    def charge() -> str:
        calls["charge"] += 1
        if calls["charge"] <= fail_charges:
            raise RuntimeError("card processor busy")
        return "receipt"

    @app.function("checkout")
    def checkout(order: Any, step: Step) -> Any:
        step.run("reserve", lambda: calls.update(["reserve"]) or "held", compensate=lambda _: calls.update(["release"]))
        return step.run(
            "charge", charge, retry=RetryPolicy(max_attempts=3), compensate=lambda _: calls.update(["refund"])
        )

    @app.function("blocked")
    def blocked(order: Any, step: Step) -> Any:
        step.run("reserve", lambda: calls.update(["reserve"]) or "held", compensate=lambda _: calls.update(["release"]))
        return step.run("charge", charge)  # an Unknown blocks (the default ``on_unknown``)

    return app


def losing_sends(env: WorkflowEnvironment, *, kinds: set[TaskKind], times: int = 1) -> list[Any]:
    """Drop the next ``times`` task messages of ``kinds`` after the write that needed them committed."""
    lost: list[Any] = []
    send = env.queue.send

    def dropping(task: Any, delay_s: float = 0.0, *, app_id: str | None = None) -> None:
        if task.kind in kinds and len(lost) < times:
            lost.append(task)
            return
        send(task, delay_s, app_id=app_id)

    env.queue.send = dropping  # type: ignore[method-assign]
    return lost


@pytest.fixture(params=["memory", "moto"])
def store(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_a_start_whose_first_message_was_lost_is_repaired(store: str) -> None:
    calls: Counter[str] = Counter()
    with WorkflowEnvironment(shop(calls), store=store) as env:
        lost = losing_sends(env, kinds={TaskKind.DISCOVER})
        run_id = env.start("checkout", {"sku": "lamp"})  # no idempotency key: nothing will retry it
        env.drive()
        assert lost and env.get(run_id).phase == "running" and calls == Counter()  # stuck
        report = env.engine.sweep()
        assert report.repaired == []  # not overdue past the grace yet: nothing on its way is raced
        env.advance(PAST_GRACE)
        report = env.engine.sweep()
        assert report.repaired == [run_id]
        run = env.wait(run_id)
        assert run.output == "receipt" and calls == Counter({"reserve": 1, "charge": 1})


def test_a_store_brought_back_without_its_queue_has_every_queued_task_sent_again_at_once() -> None:
    """``ryusen dev`` restores its table but not its queue (issue 26): a task queued a moment before the stop is
    not overdue past the sweeper's grace, yet nothing is on its way; ``recover`` sends it again now, once."""
    calls: Counter[str] = Counter()
    with WorkflowEnvironment(shop(calls)) as env:
        lost = losing_sends(env, kinds={TaskKind.DISCOVER})
        run_id = env.start("checkout", {"sku": "lamp"})
        env.drive()
        assert lost and calls == Counter()
        assert env.engine.sweep(grace_s=0).repaired == []  # the sweeper leaves a task this fresh alone
        report = env.engine.recover([run_id, "run_missing"])
        assert report.repaired == [run_id] and report.checked == 2 and report.failed == []
        assert [t.kind for t in env.pending_tasks()] == [TaskKind.DISCOVER]  # sent once
        run = env.wait(run_id)
        assert run.output == "receipt" and calls == Counter({"reserve": 1, "charge": 1})


def test_a_retry_whose_delayed_message_was_lost_is_repaired() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(shop(calls, fail_charges=1))
    lost = losing_sends(env, kinds={TaskKind.FORWARD})
    run_id = env.start("checkout", {"sku": "lamp"})
    env.drive()
    assert env.get(run_id).phase == "running" and calls["charge"] == 1 and lost
    env.advance(timedelta(minutes=10))
    assert env.engine.sweep().repaired == [run_id]
    assert env.wait(run_id).output == "receipt"
    assert calls == Counter({"reserve": 1, "charge": 2})  # the failed try and the retry: nothing ran twice


def test_a_deadline_whose_schedule_was_lost_still_stops_the_run(store: str) -> None:
    """The run waits on an Unknown charge; its deadline's schedule was never created: the sweeper times it
    out, and compensation waits on the Unknown as it would have."""
    calls: Counter[str] = Counter()
    with WorkflowEnvironment(shop(calls), store=store) as env:
        env.timers.schedule = lambda timer: None  # type: ignore[method-assign]  # every schedule is lost
        env.faults.lose_result("charge")
        run_id = env.start("blocked", {"sku": "lamp"}, timeout=timedelta(hours=1))
        env.drive()
        env.advance(timedelta(hours=3))
        env.drive()
        assert env.get(run_id).outcome is None  # the deadline passed two hours ago, unnoticed
        assert env.engine.sweep().repaired == [run_id]
        run = env.get(run_id)
        assert run.outcome == "timed_out" and [b["type"] for b in run.blockers] == ["unknown_outcome"]
        assert calls["reserve"] == 1 and calls["charge"] <= 1 and calls["release"] == 0  # the release waits


def test_a_probe_whose_schedule_was_lost_is_fired_by_the_sweeper() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(shop(calls))
    env.faults.lose_result("charge")
    run_id = env.start("blocked", {"sku": "lamp"})
    env.drive(horizon=timedelta(seconds=1))
    probe = env.engine.get_run(run_id).probe_due_at
    assert probe is not None
    for timer in env.timers.pending():  # the probe's schedule is lost
        env.timers.cancel(timer)
    env.clock.advance_to(probe + PAST_GRACE)
    assert env.engine.sweep().repaired == [run_id]
    assert env.engine.get_run(run_id).probe_due_at > probe  # probed, and the next probe scheduled


def test_the_sweeper_reads_only_runs_that_may_need_it_and_leaves_healthy_ones_alone(store: str) -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(shop(calls), store=store)
    finished = [env.run("checkout", {"n": n}).id for n in range(20)]
    lost = losing_sends(env, kinds={TaskKind.DISCOVER})
    stuck = env.start("checkout", {"n": "stuck"})
    assert lost
    env.advance(PAST_GRACE)
    report = env.engine.sweep()
    assert report.checked == 1 and report.repaired == [stuck]  # the 20 finished runs are not in the index
    assert all(env.get(run_id).outcome == "completed" for run_id in finished)
    env.drive()
    env.advance(PAST_GRACE)
    assert env.engine.sweep().checked == 0  # finished: out of the index
    env.close()


def test_a_sweep_of_a_run_whose_message_is_only_late_sends_a_harmless_duplicate() -> None:
    """The sweeper may race a message that is merely slow: the duplicate delivery is ignored."""
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(shop(calls))
    run_id = env.start("checkout", {"sku": "lamp"})  # its discovery message is on the queue, undelivered
    env.advance(PAST_GRACE)
    assert env.engine.sweep().repaired == [run_id]
    assert env.wait(run_id).output == "receipt" and calls == Counter({"reserve": 1, "charge": 1})


def test_a_failure_handled_in_the_function_is_not_mistaken_for_lost_work() -> None:
    app = Ryusen("handled")
    calls: Counter[str] = Counter()

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        try:
            step.run("flaky", lambda: (_ for _ in ()).throw(RuntimeError("no")), retry=RetryPolicy(max_attempts=1))
        except StepFailed:
            calls["handled"] += 1
        return "done"

    env = WorkflowEnvironment(app)
    assert env.run("wf").output == "done"
    env.advance(timedelta(hours=1))
    assert env.engine.sweep().checked == 0


def messages_for(env: WorkflowEnvironment, run_id: str) -> int:
    return sum(1 for message in env.queue.pending() if message.task.run_id == run_id)


def test_an_endpoint_that_is_down_gets_no_more_tasks_because_of_the_sweeper() -> None:
    """A review: a task sent again after an unreachable endpoint kept its old queue time, so every pass took
    it for lost and started one more message chain: 29 messages and 441 connection attempts in a 30-minute
    outage instead of 1 and 35. A task sent again records when it is due."""
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(shop(calls))
    env.faults.unreachable("charge", times=10_000)
    run_id = env.start("checkout", {"sku": "lamp"})
    for _ in range(30):
        env.drive(horizon=timedelta(minutes=1))
        env.clock.advance(timedelta(minutes=1))
        assert env.engine.sweep().repaired == []
        assert messages_for(env, run_id) <= 1
    env.faults._rules.clear()
    assert env.wait(run_id).output == "receipt" and calls["charge"] == 1


def test_a_backlog_gets_a_few_duplicates_not_one_per_pass() -> None:
    """A review: messages merely slow in a backlog (dispatchers saturated) look lost; every pass sent each
    again (50 runs, 20 passes: 550 messages). A run swept once is looked at again after as long again as it
    had been overdue."""
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(shop(calls))
    runs = [env.start("checkout", {"n": n}) for n in range(50)]
    for _ in range(20):  # nothing is delivered for 20 minutes
        env.clock.advance(timedelta(minutes=1))
        env.engine.sweep()
    total = sum(messages_for(env, run_id) for run_id in runs)
    assert total <= 50 * 4, total  # the first, and a resend at about 2, 4 and 8 (then 16) minutes overdue
    for run_id in runs:
        assert env.wait(run_id).outcome == "completed"
    assert calls["charge"] == 50  # each ran once however many messages it had


def test_one_run_that_cannot_be_repaired_does_not_keep_the_sweeper_from_the_others() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(shop(calls))
    losing_sends(env, kinds={TaskKind.DISCOVER}, times=3)
    runs = [env.start("checkout", {"n": n}) for n in range(3)]
    send = env.queue.send

    def failing_for_the_first(task: Any, delay_s: float = 0.0, *, app_id: str | None = None) -> None:
        if task.run_id == runs[0]:
            raise RuntimeError("SQS: ServiceUnavailable")
        send(task, delay_s, app_id=app_id)

    env.queue.send = failing_for_the_first  # type: ignore[method-assign]
    env.clock.advance(PAST_GRACE)
    report = env.engine.sweep()
    assert report.failed == [runs[0]] and sorted(report.repaired) == sorted(runs[1:])


def test_work_queued_by_a_repair_is_looked_at_after_the_grace_not_after_the_old_work_was_overdue() -> None:
    """The simulator (seeds 2507 and 2510): after a day with no probe (a clock jump, an outage), an operator's
    retry queued the next attempt and its message was lost. The sweeper fired the day-old probe and, judging the
    run by that day, looked at it again a day later: the retry waited a day for nothing. It is judged on the run as
    the repair left it."""
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(shop(calls))
    env.faults.lose_result("charge")
    run_id = env.start("blocked", {"sku": "lamp"})
    env.drive(horizon=timedelta(seconds=1))
    for timer in env.timers.pending():  # the probe's schedule is lost, and a day passes
        env.timers.cancel(timer)
    env.advance(timedelta(days=1))
    lost = losing_sends(env, kinds={TaskKind.FORWARD})
    env.resolve(run_id, "charge", generation=1, action="retry")
    assert lost and calls["charge"] == 1
    assert env.engine.sweep().repaired == [run_id]  # the day-old probe fires; the retry is not overdue yet
    env.advance(PAST_GRACE + timedelta(minutes=1))
    assert env.engine.sweep().repaired == [run_id]  # the retry's lost message is sent again
    assert env.wait(run_id).output == "receipt"
    assert calls == Counter({"reserve": 1, "charge": 2})  # the operator's retry: consented


def test_a_probe_that_queued_work_leaves_no_stale_probe_time_behind() -> None:
    """The simulator (seed 2275): a probe that fired a day late woke a run blocked in compensation and queued
    the compensation again, but kept its spent probe time. The run looked overdue by a day from then on, so
    the sweeper looked at it again only a day later, and the compensation, whose message was lost, waited."""
    calls: Counter[str] = Counter()

    def build(new_step: bool) -> Ryusen:
        app = Ryusen("undo", release_id=f"r{int(new_step)}", build_id=f"b{int(new_step)}")

        @app.function("order")
        def order(data: Any, step: Step) -> Any:
            if new_step:
                step.run("audit", lambda: calls.update(["audit"]))
            step.run(
                "reserve", lambda: calls.update(["reserve"]) or "held", compensate=lambda _: calls.update(["release"])
            )
            step.run("charge", fail, retry=RetryPolicy(max_attempts=1))

        return app

    def fail() -> None:
        raise RuntimeError("declined")

    env = WorkflowEnvironment(build(False))
    run_id = env.start("order", {})
    env.drive(until=lambda: env.engine.get_run(run_id).phase.value == "compensating")
    env.sync(build(True))  # a release that calls a new step before the one to compensate: blocked
    env.drive(horizon=timedelta(seconds=1))
    state = env.engine.get_run(run_id)
    assert [b.type.value for b in state.blockers] == ["new_step_before_target"] and state.probe_due_at is not None
    for timer in env.timers.pending():  # the probe fires a day late
        env.timers.cancel(timer)
    env.clock.advance_to(state.probe_due_at + timedelta(days=1))
    lost = losing_sends(env, kinds={TaskKind.COMPENSATE})
    env.engine.fire_timer(_probe(state))
    assert lost  # the compensation the probe queued has no message
    assert env.engine.get_run(run_id).probe_due_at is None  # the probe's time is spent
    env.engine.sweep()
    env.advance(PAST_GRACE + timedelta(minutes=1))
    assert env.engine.sweep().repaired == [run_id]
    env.sync(build(False))  # the fix: code that no longer calls the new step first
    assert env.wait(run_id).summary == "failed, fully compensated"
    assert calls["release"] == 1 and calls["audit"] == 0


def _probe(state: Any) -> Any:
    from ryusen_server.core.model import TimerKind, TimerRef

    return TimerRef(run_id=state.id, kind=TimerKind.PROBE, at=state.probe_due_at)

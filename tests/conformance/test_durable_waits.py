"""Durable waits (decision 31): ``step.sleep`` is a step with no callback that completes at its due time, and
``not_before=`` delays a step's first attempt. The due time is fixed when the step is first recorded; a stop
during a wait ends it at once; nothing waits in a process meanwhile."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ryusen import RetryPolicy, Ryusen, Step
from ryusen.testing import WorkflowEnvironment

DAY = timedelta(days=1)


def reminders(calls: Counter[str], log: list[tuple[str, datetime]], env_clock: list[Any], wait: timedelta) -> Ryusen:
    app = Ryusen("trips")

    def effect(name: str) -> str:
        calls[name] += 1
        log.append((name, env_clock[0]()))
        return name

    @app.function("trip")
    def trip(order: dict[str, Any], step: Step) -> Any:
        step.run("book", effect, "book", compensate=lambda _: calls.update(["cancel-booking"]))
        step.sleep("until-reminder", wait)
        return step.run("remind", effect, "remind")

    return app


def waiting(env: WorkflowEnvironment, run_id: str, step_id: str) -> bool:
    """The step is recorded and waits: its attempt is queued until its due time."""
    steps = [s for s in env.get(run_id).steps if s["id"] == step_id]
    return bool(steps) and steps[0]["attempts"][-1]["status"] == "queued" and steps[0]["wait_until"] is not None


def setup(wait: timedelta = 3 * DAY) -> tuple[WorkflowEnvironment, Counter[str], list[tuple[str, datetime]]]:
    calls: Counter[str] = Counter()
    log: list[tuple[str, datetime]] = []
    clock: list[Any] = [None]
    env = WorkflowEnvironment(reminders(calls, log, clock, wait))
    clock[0] = env.clock
    return env, calls, log


@pytest.mark.rfd("W1")
def test_a_sleep_completes_at_its_time_not_earlier() -> None:
    env, calls, log = setup()
    started = env.clock()
    run_id = env.start("trip", {})
    env.drive(until=lambda: waiting(env, run_id, "until-reminder"))
    view = env.get(run_id)
    due = datetime.fromisoformat(view.step("until-reminder")["wait_until"])
    assert due == started + 3 * DAY and view.step("until-reminder")["sleep"] is True
    env.advance(3 * DAY - timedelta(minutes=1))
    env.drive(horizon=timedelta(seconds=59))
    assert calls["remind"] == 0 and env.get(run_id).phase == "running"  # not a minute early
    run = env.wait(run_id)
    assert run.outcome == "completed" and run.output == "remind"
    [(_, reminded)] = [entry for entry in log if entry[0] == "remind"]
    assert reminded >= due and reminded - due < timedelta(seconds=5)
    nap = run.step("until-reminder")
    assert nap["status"] == "completed" and nap["result"] is None
    [attempt] = nap["attempts"]
    assert attempt["status"] == "succeeded" and attempt["authorized_at"] is None  # no endpoint was called
    assert calls == Counter({"book": 1, "remind": 1})


@pytest.mark.rfd("W1")
def test_a_sleep_survives_the_loss_of_every_message_and_still_waits_its_whole_time() -> None:
    """A restart that keeps the store and loses the queue (``ryusen dev``'s data directory): the wait's message
    is sent again at once, and the step still completes at its time, not when the message arrives."""
    env, calls, _ = setup(DAY)
    run_id = env.start("trip", {})
    env.drive(until=lambda: waiting(env, run_id, "until-reminder"))
    due = datetime.fromisoformat(env.get(run_id).step("until-reminder")["wait_until"])
    env.queue.drop_all()  # every message lost
    assert env.engine.recover([run_id]).repaired == [run_id]
    env.drive(horizon=timedelta(hours=23))
    assert calls["remind"] == 0
    run = env.wait(run_id)
    assert run.outcome == "completed" and env.clock() >= due


@pytest.mark.rfd("W2")
def test_a_replay_never_moves_the_due_time() -> None:
    """The wait is computed afresh on every pass (here it grows with each pass, and a later release declares
    another): the due time stays the one recorded when the step was first met."""
    passes = Counter[str]()
    app = Ryusen("trips", build_id="b1")

    @app.function("trip")
    def trip(order: dict[str, Any], step: Step) -> Any:
        passes["pass"] += 1
        step.run("book", lambda: "booked")
        step.sleep("nap", DAY + passes["pass"] * timedelta(hours=1))
        return step.run("after", lambda: "done")

    env = WorkflowEnvironment(app)
    started = env.clock()
    run_id = env.start("trip", {})
    env.drive(until=lambda: waiting(env, run_id, "nap"))
    first = env.get(run_id).step("nap")["wait_until"]
    recorded_by = passes["pass"]
    assert datetime.fromisoformat(first) == started + DAY + recorded_by * timedelta(hours=1)
    env.advance(timedelta(hours=2))
    later = Ryusen("trips", build_id="b2")

    @later.function("trip")
    def trip_v2(order: dict[str, Any], step: Step) -> Any:
        passes["pass"] += 1
        step.run("book", lambda: "booked")
        step.sleep("nap", 10 * DAY)  # ... and a new release declares a longer wait
        return step.run("after", lambda: "done")

    env.sync(later)
    env.drive(horizon=timedelta(hours=1))
    assert env.get(run_id).step("nap")["wait_until"] == first
    run = env.wait(run_id)
    assert run.outcome == "completed" and passes["pass"] > recorded_by  # replayed after, and the wait held
    assert datetime.fromisoformat(first) <= env.clock() < datetime.fromisoformat(first) + timedelta(minutes=1)


@pytest.mark.rfd("W3")
def test_a_stop_during_a_wait_compensates_at_once() -> None:
    env, calls, _ = setup(30 * DAY)
    run_id = env.start("trip", {})
    env.drive(until=lambda: waiting(env, run_id, "until-reminder"))
    env.advance(timedelta(hours=1))
    cancelled_at = env.clock()
    env.cancel(run_id)
    run = env.wait(run_id)
    assert run.summary == "cancelled, fully compensated"
    assert datetime.fromisoformat(run["finished_at"]) - cancelled_at < timedelta(minutes=1)  # not in 30 days
    assert calls == Counter({"book": 1, "cancel-booking": 1})
    nap = run.step("until-reminder")
    assert nap["status"] == "fenced" and nap["compensation"]["status"] in ("none", "skipped")
    assert [u["step_id"] for u in run["unwind"]] == ["book"]


@pytest.mark.rfd("W4")
def test_a_thirty_day_sleep_takes_as_many_decisions_as_a_one_day_sleep() -> None:
    """Nothing polls while a step waits: the run's writes and messages do not grow with the wait."""
    counts = []
    for wait in (DAY, 30 * DAY):
        env, calls, _ = setup(wait)
        decisions: list[Any] = []
        env.engine.hooks.append(lambda kind, payload: decisions.append(kind) if kind == "decided" else None)
        run = env.run("trip", {})
        assert run.outcome == "completed" and calls["remind"] == 1
        counts.append(len(decisions))
    assert counts[0] == counts[1]


def test_not_before_delays_a_steps_first_attempt_only() -> None:
    tries: list[datetime] = []
    app = Ryusen("shop")

    @app.function("follow-up")
    def follow_up(order: dict[str, Any], step: Step) -> Any:
        def email() -> str:
            tries.append(env.clock())
            if len(tries) == 1:
                raise ConnectionError("mail server busy")
            return "sent"

        policy = RetryPolicy(max_attempts=3, initial_delay=timedelta(seconds=10))
        return step.run("email", email, not_before=timedelta(hours=2), retry=policy)

    env = WorkflowEnvironment(app)
    started = env.clock()
    run = env.run("follow-up", {})
    assert run.output == "sent" and len(tries) == 2
    assert tries[0] >= started + timedelta(hours=2)
    assert tries[1] - tries[0] < timedelta(minutes=1)  # the retry waits its backoff, not two hours more


def test_sleep_until_a_moment_and_a_moment_already_past() -> None:
    app = Ryusen("shop")
    moments: dict[str, datetime] = {}

    @app.function("launch")
    def launch(order: dict[str, Any], step: Step) -> Any:
        step.sleep_until("past", datetime(2000, 1, 1, tzinfo=UTC))
        step.sleep_until("launch-day", datetime.fromisoformat(order["at"]))
        return step.run("announce", lambda: moments.setdefault("announced", env.clock()).isoformat())

    env = WorkflowEnvironment(app)
    at = env.clock() + timedelta(days=2)
    run = env.run("launch", {"at": at.isoformat()})
    assert run.outcome == "completed" and moments["announced"] >= at
    assert run.step("past")["status"] == "completed"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda step: step.sleep("nap", 5), "must be a timedelta or a timezone-aware datetime"),
        (lambda step: step.sleep_until("nap", datetime(2030, 1, 1)), "timezone-aware"),
        (lambda step: step.sleep("nap", timedelta(days=400)), "between 0 and 366 days"),
        (lambda step: step.run("x", lambda: 1, not_before=timedelta(seconds=-1)), "not_before must be between"),
    ],
)
def test_a_wait_that_cannot_be_recorded_blocks_with_a_clear_message(call: Any, message: str) -> None:
    app = Ryusen("shop")

    @app.function("f")
    def f(order: Any, step: Step) -> Any:
        return call(step)

    env = WorkflowEnvironment(app)
    run_id = env.start("f", {})
    env.drive(stop_when_blocked=run_id)
    [blocker] = env.get(run_id).blockers
    assert blocker["type"] == "invalid_step" and message in blocker["message"]


def test_an_async_workflow_sleeps_too() -> None:
    from ryusen import AsyncStep

    app = Ryusen("shop")

    @app.function("later")
    async def later(order: Any, step: AsyncStep) -> Any:
        await step.run("a", lambda: "a")
        await step.sleep("nap", timedelta(hours=5))
        return await step.run("b", lambda: "b")

    env = WorkflowEnvironment(app)
    started = env.clock()
    run = env.run("later", {})
    assert run.output == "b" and env.clock() >= started + timedelta(hours=5)


def test_ryusen_show_says_when_a_wait_ends() -> None:
    import io

    from rich.console import Console

    from ryusen_server import cli
    from ryusen_server.core.view import run_view

    env, _, _ = setup()
    run_id = env.start("trip", {})
    env.drive(until=lambda: waiting(env, run_id, "until-reminder"))
    state = env.engine.get_run(run_id)
    console = Console(width=200, record=True, file=io.StringIO(), color_system=None)
    cli.render_run(run_view(state), console=console)
    shown = console.export_text()
    assert "until-reminder" in shown and "sleeps until 01-04 00:00:00.0" in shown

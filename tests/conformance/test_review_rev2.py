"""Adversarial review of durable waits (decision 31) and steps completed from outside (decision 32)."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

import ryusen
from ryusen import RetryPolicy, Ryusen, Step
from ryusen.testing import WorkflowEnvironment


def approvals(tokens: list[str], calls: Counter[str], retry: RetryPolicy | None = None) -> Ryusen:
    app = Ryusen("approvals")

    def ask() -> str:
        calls["ask"] += 1
        token = ryusen.operation().completion_token
        assert token is not None
        tokens.append(token)
        return "asked"

    @app.function("expense")
    def expense(order: dict[str, Any], step: Step) -> Any:
        decision = step.run(
            "approval",
            ask,
            completion="external",
            timeout=timedelta(days=2),
            retry=retry or RetryPolicy(max_attempts=1),
        )
        return step.run("pay", lambda: calls.update(["pay"]) or {"paid": decision})

    return app


def attempt_statuses(env: WorkflowEnvironment, run_id: str) -> list[str]:
    steps = [s for s in env.get(run_id).steps if s["id"] == "approval"]
    return [a["status"] for a in steps[0]["attempts"]] if steps else []


@pytest.mark.rfd("X3")
def test_an_external_steps_callback_whose_late_result_settles_an_unknown_still_times_out() -> None:
    """The callback's answer was lost (Unknown, blocked); its late success says it handed out the token: the
    attempt then waits for its completion, and its timeout still applies. It must not stay Unknown with its
    blocker gone and no lease: a run no timer, sweeper or blocker ever moves again."""
    tokens: list[str] = []
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(approvals(tokens, calls))
    env.faults.lose_result("approval")
    run_id = env.start("expense", {})
    env.drive(stop_when_blocked=run_id)
    assert attempt_statuses(env, run_id) == ["unknown"] and env.get(run_id).blockers
    env.deliver_late_result(run_id, "approval")
    env.drive(horizon=timedelta(hours=1))
    assert attempt_statuses(env, run_id) == ["waiting"]  # not "unknown" with no blocker
    env.drive(horizon=timedelta(days=30))
    run = env.get(run_id)
    assert run.outcome == "failed" and run.step("approval")["error"]["type"] == "completion_timeout"
    assert calls == Counter({"ask": 1})


@pytest.mark.rfd("X1")
def test_a_late_success_of_an_external_callback_cancels_its_planned_unknown_retry() -> None:
    """``on_unknown="retry"`` planned a retry of the Unknown callback; its late success arrives first: the
    callback ran and handed out its token, so it is not run again (and the token it handed out stays good)."""
    tokens: list[str] = []
    calls: Counter[str] = Counter()
    policy = RetryPolicy(max_attempts=3, initial_delay=timedelta(minutes=5), on_unknown="retry")
    env = WorkflowEnvironment(approvals(tokens, calls, policy))
    env.faults.lose_result("approval")
    run_id = env.start("expense", {})
    env.drive(until=lambda: attempt_statuses(env, run_id) == ["unknown"])
    env.deliver_late_result(run_id, "approval")
    env.drive(horizon=timedelta(hours=1))
    assert calls["ask"] == 1, "the callback ran again though its success was taken"
    env.complete(tokens[0], "approved")
    run = env.wait(run_id)
    assert run.outcome == "completed" and run.output == {"paid": "approved"}


@pytest.mark.rfd("X1")
def test_a_token_outlives_a_master_key_rotation_while_its_step_still_waits() -> None:
    """A step may wait days (``timeout=timedelta(days=2)`` in the docs); a normal rotation keeps the previous
    master valid one day (``RYUSEN_PREVIOUS_KEY_WINDOW_S``). A token the callback handed out before the rotation
    must still complete the waiting step once that window has passed: the approver's link is all there is."""
    from dataclasses import replace

    tokens: list[str] = []
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(approvals(tokens, calls))
    run_id = env.start("expense", {})
    env.drive(until=lambda: attempt_statuses(env, run_id) == ["waiting"])
    env.advance(timedelta(hours=36))  # a rotation 12 hours in, and its one-day window over
    env.engine.settings = replace(env.engine.settings, master_key="rotated-" + (env.master_key or ""))
    assert attempt_statuses(env, run_id) == ["waiting"]
    env.complete(tokens[0], "approved")  # was NotFoundError (completion_not_found): tokens use the run's secret
    # the step took it (the rest of the run waits for the app to get the rotated key, which this test did not give)
    assert env.get(run_id).step("approval")["result"] == "approved"


@pytest.mark.parametrize(
    "moment",
    [
        datetime(9999, 12, 31, 23, 0, tzinfo=timezone(timedelta(hours=-12))),  # past the largest UTC datetime
        datetime(3000, 1, 1, tzinfo=UTC),  # 974 years: a sleep of at most a year (MAX_WAIT_S) says otherwise
    ],
)
def test_a_sleep_until_a_moment_too_far_blocks_with_a_clear_message(moment: datetime) -> None:
    """``sleep_until`` is bounded like ``sleep`` (a year): a moment the server cannot even represent must not
    make every decision on the run raise (the dispatcher's message comes back forever, nothing says why)."""
    app = Ryusen("shop")

    @app.function("f")
    def f(order: Any, step: Step) -> Any:
        step.sleep_until("far", moment)
        return "woke"

    env = WorkflowEnvironment(app)
    run_id = env.start("f", {})
    env.drive(stop_when_blocked=run_id, horizon=timedelta(days=1))
    [blocker] = env.get(run_id).blockers
    assert blocker["type"] == "invalid_step" and "far" in blocker["message"]


@pytest.mark.parametrize("completion", ["external", "callback"])
def test_a_step_timeout_past_what_a_date_can_hold_blocks_with_a_clear_message(completion: str) -> None:
    """No deployment maximum is set by default, and a step completed from outside is exempt from it anyway: a
    timeout such as ``timedelta.max`` must block the run with a message, not make its authorization raise (the
    task's message would come back forever)."""
    app = Ryusen("approvals")

    @app.function("f")
    def f(order: Any, step: Step) -> Any:
        return step.run("approval", lambda: "asked", completion=completion, timeout=timedelta.max)  # type: ignore[arg-type]

    env = WorkflowEnvironment(app)
    run_id = env.start("f", {})
    env.drive(stop_when_blocked=run_id, horizon=timedelta(days=1))
    [blocker] = env.get(run_id).blockers
    assert blocker["type"] == "invalid_step" and "approval" in blocker["message"]


def test_a_step_recorded_and_started_after_the_last_save_of_a_killed_dev_stack_is_not_run_again() -> None:
    """``ryusen dev`` saves every few seconds, and logs each authorization (``started.jsonl``) so a killed stack
    does not run a started callback again. With chaining (on by default) a step is recorded *and* authorized in
    one write (the discovery's report, or the previous step's continuation): the saved table then holds no such
    step, ``StartMayBeLost`` ignores the logged attempt ("not the current generation"), and the restored run's
    discovery records the step anew and runs its callback a second time, with no one told."""
    from ryusen_server.core.model import Phase as CorePhase
    from ryusen_server.core.model import TaskKind, TaskRef

    calls: Counter[str] = Counter()
    app = Ryusen("shop")

    @app.function("order")
    def order(data: Any, step: Step) -> Any:
        step.run("charge", lambda: calls.update(["charge"]) or "charged")
        return step.run("ship", lambda: calls.update(["ship"]) or "shipped")

    env = WorkflowEnvironment(app)
    run_id = env.start("order", {})
    saved = env.store.peek(run_id)  # the last save: the run, its discovery queued, no step yet
    assert saved is not None and not saved.steps
    env.drive()  # the stack runs on: each step recorded and authorized in one chained write
    assert calls == Counter({"charge": 1, "ship": 1})
    logged = [  # what started.jsonl holds: every attempt authorized since the save
        TaskRef(run_id=run_id, kind=TaskKind.FORWARD, step_id=s, generation=1) for s in ("charge", "ship")
    ]
    assert all(env.store.peek(run_id).step(t.step_id).attempt(CorePhase.FORWARD, 1) for t in logged)  # type: ignore[union-attr]

    # killed: the next stack loads the saved table, its queue empty, and reads the log
    env.queue.drop_all()
    with env.store._lock:
        env.store._keep(saved)
    env.engine.presume_started(logged, "authorized after the last save of a stack that was killed")
    env.engine.recover([run_id])
    env.drive(stop_when_blocked=run_id, horizon=timedelta(hours=1))
    assert calls == Counter({"charge": 1, "ship": 1}), "a callback started before the kill ran a second time"
    run = env.get(run_id)
    assert run.step("charge")["status"] == "unknown" and run.blockers[0]["type"] == "unknown_outcome"
    env.resolve(run_id, "charge", generation=1, action="succeed", result="charged")  # the operator checked
    env.drive(stop_when_blocked=run_id, horizon=timedelta(hours=1))
    assert env.get(run_id).step("ship")["status"] == "unknown" and calls["ship"] == 1  # it may have run, too


@pytest.mark.rfd("X1")
def test_a_dispatchers_late_invocation_failure_does_not_fail_a_step_already_waiting_for_its_completion() -> None:
    """The callback's answer came through the result URL (the dispatcher had stopped listening, or its own
    record was deferred while the store was unavailable) and the attempt waits; the dispatcher's "no response"
    (``InvocationFailed``, lost) is recorded after it. For any other step the attempt is settled and the report
    is ignored; a waiting attempt is still authorized, and the report must not fail it as a completion_timeout
    (a retry would ask the approver again and refuse the token they hold)."""
    from ryusen_server.core.events import InvocationFailed, InvocationFailure
    from ryusen_server.core.model import Phase as CorePhase
    from ryusen_server.core.model import TaskKind, TaskRef

    tokens: list[str] = []
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(approvals(tokens, calls, RetryPolicy(max_attempts=3)))
    run_id = env.start("expense", {})
    env.drive(until=lambda: attempt_statuses(env, run_id) == ["waiting"])
    attempt = env.store.peek(run_id).step("approval").attempt(CorePhase.FORWARD, 1)  # type: ignore[union-attr]
    task = TaskRef(run_id=run_id, kind=TaskKind.FORWARD, step_id="approval", generation=1)
    lost = InvocationFailed(
        task=task, failure=InvocationFailure.LOST, detail="no response within 30s", delivery_id=attempt.delivery_id
    )
    env.engine.apply(run_id, lost)
    assert attempt_statuses(env, run_id) == ["waiting"]
    env.complete(tokens[0], "approved")
    assert env.wait(run_id).output == {"paid": "approved"} and calls["ask"] == 1


@pytest.mark.rfd("X1")
def test_an_operators_succeed_on_an_unknown_external_step_is_its_result() -> None:
    """The callback's outcome was lost (Unknown, blocked). The operator resolves it ``succeed`` with the result
    (say, the approval they checked by hand): that is the step's result, as ``resolve`` says for any step; it must
    not be dropped while the step goes on waiting for a completion."""
    tokens: list[str] = []
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(approvals(tokens, calls))
    env.faults.lose_result("approval")
    run_id = env.start("expense", {})
    env.drive(stop_when_blocked=run_id)
    assert attempt_statuses(env, run_id) == ["unknown"]
    env.resolve(run_id, "approval", generation=1, action="succeed", result="approved by hand")
    env.drive(horizon=timedelta(hours=1))
    run = env.get(run_id)
    assert run.step("approval")["status"] == "completed" and run.step("approval")["result"] == "approved by hand"
    assert run.outcome == "completed" and run.output == {"paid": "approved by hand"}


def test_a_completion_over_the_runs_budget_is_refused_not_taken_and_held() -> None:
    """A completion's result that fits the value limit but not the run's budget (``max_run_bytes``): the engine
    should refuse it (413, nothing recorded, the sender may send less) rather than answer 200 and hold the run as
    if a callback had returned too much (an operator must then retry, asking the approver again)."""
    from ryusen_server.core.events import EngineSettings
    from ryusen_server.ports import PayloadTooLargeError

    tokens: list[str] = []
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(approvals(tokens, calls), settings=EngineSettings(max_run_bytes=4096))
    run_id = env.start("expense", {})
    env.drive(until=lambda: attempt_statuses(env, run_id) == ["waiting"])
    with pytest.raises(PayloadTooLargeError):
        env.complete(tokens[0], "x" * 5000)
    assert attempt_statuses(env, run_id) == ["waiting"] and not env.get(run_id).blockers

"""S: cancellation and run timeout, end to end through the engine and the SDK (ryusen.testing)."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import pytest

from ryusen import Ryusen, Step
from ryusen.testing import WorkflowEnvironment
from ryusen_server.core.events import EngineSettings
from ryusen_server.ports import InvalidRequestError


def shop(calls: Counter[str], *, fail_charge: bool = False) -> Ryusen:
    app = Ryusen("stop-shop")

    def effect(name: str) -> Any:
        calls[name] += 1
        if fail_charge and name == "charge":
            raise ConnectionError("card network down")
        return {"done": name}

    def undo(name: str) -> Any:
        return lambda result: calls.update([f"undo-{name}"]) or {"undone": name}

    @app.function("checkout")
    def checkout(data: Any, step: Step) -> Any:
        calls["pass"] += 1
        for name in ("reserve", "charge", "ship"):
            step.run(name, effect, name, compensate=undo(name))
        return "shipped"

    return app


def forward_statuses(run: Any) -> dict[str, list[str]]:
    return {s["id"]: [a["status"] for a in s["attempts"] if a["phase"] == "forward"] for s in run.steps}


@pytest.mark.rfd("S1", "S10")
def test_cancel_before_first_discovery_runs_no_user_code() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(shop(calls))
    run_id = env.start("checkout")
    env.cancel(run_id)
    run = env.wait(run_id)
    assert calls == Counter()
    assert (run.phase, run.outcome, run.recovery) == ("finished", "cancelled", "not_required")
    assert run.summary == "cancelled, compensation not required"
    assert run["stop_intent"]["kind"] == "cancel"


@pytest.mark.rfd("S1", "S11")
def test_timeout_before_first_discovery_runs_no_user_code() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(shop(calls))
    run_id = env.start("checkout", timeout=timedelta(seconds=5))
    env.advance(timedelta(seconds=6))  # the deadline passes before any dispatch
    run = env.wait(run_id)
    assert calls == Counter()
    assert (run.outcome, run.recovery) == ("timed_out", "not_required")
    assert run["deadline"]["source"] == "run_request"


@pytest.mark.rfd("S2", "S5", "S7", "S9", "S13")
def test_cancel_while_an_effect_is_in_flight_settles_it_then_compensates() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(shop(calls))
    run_id = env.start("checkout")
    seen: dict[str, Any] = {}

    def cancel_now() -> None:
        env.cancel(run_id)
        seen["after_cancel"] = env.get(run_id)

    env.faults.before_invoke("charge", cancel_now)
    run = env.wait(run_id)
    # S2: the acknowledged stop intent is durable and does not claim the effect stopped
    ack = seen["after_cancel"]
    assert ack["stop_intent"]["kind"] == "cancel" and ack.outcome == "cancelled"
    assert ack.phase == "settling" and ack.step("charge")["status"] == "running"
    # S5: the in-flight success was accepted and joins the unwind
    assert run.step("charge")["status"] == "completed"
    assert [u["step_id"] for u in run["unwind"]] == ["charge", "reserve"]
    # S7: nothing new was discovered after the stop
    assert "ship" not in forward_statuses(run) and calls["ship"] == 0
    assert calls["undo-charge"] == 1 and calls["undo-reserve"] == 1
    assert run.summary == "cancelled, fully compensated"  # S13


@pytest.mark.rfd("S3")
def test_forward_work_without_start_authorization_is_fenced() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(shop(calls))
    run_id = env.start("checkout")
    env.drive(until=lambda: any(s["id"] == "charge" for s in env.get(run_id).steps))
    assert env.get(run_id).attempts("charge")[0]["status"] == "queued"
    env.cancel(run_id)
    run = env.wait(run_id)
    assert calls["charge"] == 0
    assert run.attempts("charge")[0]["status"] == "fenced" and run.step("charge")["status"] == "fenced"
    assert [u["step_id"] for u in run["unwind"]] == ["reserve"]


@pytest.mark.rfd("S4", "S7")
def test_discovery_in_flight_at_the_stop_is_discarded() -> None:
    app = Ryusen("discard")
    calls: Counter[str] = Counter()
    holder: dict[str, Any] = {}

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        step.run("first", lambda: calls.update(["first"]) or 1, compensate=lambda r: calls.update(["undo-first"]))
        if "cancelled" not in holder:  # the stop lands while this discovery pass is running
            holder["cancelled"] = True
            holder["env"].cancel(holder["run_id"])
        step.run("second", lambda: calls.update(["second"]) or 2)
        return "done"

    env = WorkflowEnvironment(app)
    holder["env"] = env
    holder["run_id"] = env.start("wf")
    run = env.wait(holder["run_id"])
    assert [s["id"] for s in run.steps] == ["first"]  # the pass's report of "second" was discarded
    assert calls == Counter({"first": 1, "undo-first": 1})
    assert run.summary == "cancelled, fully compensated"


@pytest.mark.rfd("S6")
def test_late_failure_after_the_stop_is_a_failed_attempt_without_retry() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(shop(calls, fail_charge=True))
    run_id = env.start("checkout")
    env.faults.before_invoke("charge", lambda: env.cancel(run_id))
    run = env.wait(run_id)
    assert forward_statuses(run)["charge"] == ["failed"]  # no generation 2
    assert calls["charge"] == 1 and calls["undo-charge"] == 0
    assert [u["step_id"] for u in run["unwind"]] == ["reserve"]


@pytest.mark.rfd("S8", "S9")
def test_lost_contact_after_the_stop_is_unknown_and_blocks_compensation() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(shop(calls))
    run_id = env.start("checkout")
    env.faults.before_invoke("charge", lambda: env.cancel(run_id))
    env.faults.lose_result("charge")
    env.drive()
    run = env.get(run_id)
    assert run.phase == "settling" and run.recovery == "pending"
    assert run.step("charge")["status"] == "unknown"
    assert run.blockers[0]["type"] == "unknown_outcome"
    assert calls["undo-reserve"] == 0  # S9: compensation waits for the Unknown
    env.deliver_late_result(run_id, "charge")
    run = env.wait(run_id)
    assert run.summary == "cancelled, fully compensated"
    assert calls["undo-charge"] == 1 and calls["undo-reserve"] == 1


@pytest.mark.rfd("S11")
@pytest.mark.parametrize(
    ("function_timeout", "run_timeout", "default", "source", "seconds"),
    [
        (None, None, None, "none", None),
        (timedelta(minutes=10), None, None, "function", 600),
        (timedelta(minutes=10), 30.0, None, "run_request", 30),
        (None, None, timedelta(hours=2), "deployment_default", 7200),
        (timedelta(minutes=10), None, timedelta(hours=2), "function", 600),
    ],
)
def test_deadline_sources(
    function_timeout: timedelta | None,
    run_timeout: float | None,
    default: timedelta | None,
    source: str,
    seconds: int | None,
) -> None:
    app = Ryusen("deadlines")

    @app.function("wf", timeout=function_timeout)
    def wf(data: Any, step: Step) -> Any:
        return 1

    env = WorkflowEnvironment(app, default_run_timeout=default)
    run_id = env.start("wf", timeout=timedelta(seconds=run_timeout) if run_timeout else None)
    run = env.get(run_id)
    assert run["deadline"]["source"] == source
    if seconds is None:
        assert run["deadline"]["at"] is None
    else:
        at = datetime.fromisoformat(run["deadline"]["at"])
        assert at - datetime.fromisoformat(run["created_at"]) == timedelta(seconds=seconds)


@pytest.mark.rfd("S11")
def test_timeouts_above_the_maximum_are_rejected_never_clamped() -> None:
    app = Ryusen("too-long")

    @app.function("wf", timeout=timedelta(hours=48))
    def wf(data: Any, step: Step) -> Any:
        return 1

    with pytest.raises(InvalidRequestError) as at_sync:
        WorkflowEnvironment(app, max_run_timeout=timedelta(hours=24))
    assert at_sync.value.details["code"] == "timeout_exceeds_maximum"
    assert "wf" in at_sync.value.message and "172800" in at_sync.value.message and "86400" in at_sync.value.message

    short = Ryusen("short")

    @short.function("wf2")
    def wf2(data: Any, step: Step) -> Any:
        return 1

    env = WorkflowEnvironment(short, max_run_timeout=timedelta(hours=24))
    with pytest.raises(InvalidRequestError):
        env.start("wf2", timeout=timedelta(hours=25))
    assert env.store.list_runs().runs == []
    ok = env.start("wf2", timeout=timedelta(hours=24))
    assert env.get(ok)["deadline"]["source"] == "run_request"
    # the local default: no maximum at all
    assert WorkflowEnvironment(app).start("wf") is not None


@pytest.mark.rfd("S12", "S13")
def test_deadline_never_cuts_compensation_short() -> None:
    app = Ryusen("slow-undo")
    undo_attempts: list[datetime] = []

    def slow_refund(result: Any) -> Any:
        undo_attempts.append(env.clock.now)
        if len(undo_attempts) < 4:
            raise TimeoutError("refund API slow")
        return "refunded"

    @app.function("wf", timeout=timedelta(seconds=30))
    def wf(data: Any, step: Step) -> Any:
        step.run("charge", lambda: "ch_1", compensate=slow_refund)
        step.run("wait-for-stock", lambda: (_ for _ in ()).throw(ConnectionError("no stock yet")))
        return "done"

    env = WorkflowEnvironment(
        app,
        settings=EngineSettings(
            forward_retry=EngineSettings().forward_retry.model_copy(update={"max_attempts": 50, "initial_delay_s": 10}),
            compensate_retry=EngineSettings().compensate_retry.model_copy(update={"initial_delay_s": 20}),
        ),
    )
    run_id = env.start("wf")
    run = env.wait(run_id)
    assert run.outcome == "timed_out"
    deadline = datetime.fromisoformat(run["deadline"]["at"])
    assert max(undo_attempts) > deadline  # compensation went on well past the deadline
    assert run.recovery == "compensated" and run.summary == "timed out, fully compensated"


@pytest.mark.rfd("S13")
def test_timed_out_partially_compensated_keeps_both_outcomes() -> None:
    app = Ryusen("partial-timeout")

    @app.function("wf", timeout=timedelta(seconds=5))
    def wf(data: Any, step: Step) -> Any:
        step.run("a", lambda: 1, compensate=lambda r: (_ for _ in ()).throw(OSError("cannot undo")))
        step.run("never", lambda: (_ for _ in ()).throw(ConnectionError("down")))

    env = WorkflowEnvironment(
        app,
        settings=EngineSettings(
            forward_retry=EngineSettings().forward_retry.model_copy(update={"max_attempts": 100, "initial_delay_s": 2}),
            compensate_retry=EngineSettings().compensate_retry.model_copy(update={"max_attempts": 2}),
        ),
    )
    run = env.run("wf")
    assert (run.outcome, run.recovery) == ("timed_out", "partially_compensated")
    assert run.summary == "timed out, partially compensated"


@pytest.mark.rfd("S11")
def test_a_run_that_finishes_before_its_deadline_cancels_the_deadline_timer() -> None:
    app = Ryusen("quick")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        return step.run("a", lambda: "done")

    env = WorkflowEnvironment(app)
    run = env.run("wf", timeout=timedelta(days=30))
    assert run.outcome == "completed"
    assert [t.kind.value for t in env.timers.pending()] == []  # no schedule left to fire in 30 days

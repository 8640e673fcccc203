"""C10: a compensation pass that ends without reaching its target proves nothing (decision 24).

A guard that reads the outside world (``if the order is cancelled: return``) ends a replay before the step
whose compensation is due, whatever the build. That must never become a durable skip: the unwind blocks
with ``compensation_target_not_reached`` until a release, the probe or an operator moves it on. Only a
pass that reaches the target and finds no compensator, or a release that retired the step, skips it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from ryusen import Ryusen, Step
from ryusen.testing import WorkflowEnvironment
from ryusen_server.ports import ConflictError


def fulfilment(
    refunds: list[Any], orders: dict[str, str], *, build: str, retired: tuple[str, ...] = (), guard: bool = True
) -> Ryusen:
    app = Ryusen("orders", build_id=build)

    @app.function("fulfil", retired_steps=retired)
    def fulfil(order: Any, step: Step) -> Any:
        if guard and orders[order["id"]] == "cancelled":  # an external read, outside step.run
            return {"skipped": "order cancelled"}
        charge = step.run("charge", lambda: {"charge_id": "ch_1"}, compensate=lambda c: refunds.append(c))
        step.run("ship", lambda: {"parcel": "p1"})
        return charge

    return app


def cancelled_mid_run(env: WorkflowEnvironment, orders: dict[str, str]) -> str:
    run_id = env.start("fulfil", {"id": "o1"})
    env.drive(until=lambda: any(s["id"] == "charge" and s["status"] == "completed" for s in env.get(run_id).steps))
    orders["o1"] = "cancelled"  # the shop marks the order cancelled, then cancels the run
    env.cancel(run_id)
    return run_id


@pytest.mark.rfd("C10")
def test_a_pass_that_ends_before_the_target_blocks_the_unwind_instead_of_skipping() -> None:
    refunds: list[Any] = []
    orders = {"o1": "open"}
    env = WorkflowEnvironment(fulfilment(refunds, orders, build="b1"))
    run_id = cancelled_mid_run(env, orders)
    env.sync(fulfilment(refunds, orders, build="b2"))  # a routine deploy of the same code
    run = env.wait(run_id)

    assert refunds == []
    assert run.phase == "compensating" and run.recovery == "compensating"  # never "fully compensated"
    [blocker] = run.blockers
    assert blocker["type"] == "compensation_target_not_reached" and blocker["step_id"] == "charge"
    assert "without reaching step 'charge'" in blocker["detail"] and "b2" in blocker["message"]
    assert run.step("charge")["compensation"]["status"] == "pending"
    assert [u["status"] for u in run["unwind"]] == ["pending"]

    # the probe asks current code again: still blocked, diagnostics updated, still nothing recorded as a skip
    env.advance(timedelta(hours=2))
    run = env.wait(run_id)
    assert run.blockers[0]["count"] >= 2 and run.step("charge")["compensation"]["status"] == "pending"

    # the external state changes back (or a release fixes the guard): the next pass reaches the refund
    orders["o1"] = "open"
    env.rediscover(run_id)
    run = env.wait(run_id)
    assert refunds == [{"charge_id": "ch_1"}] and run.summary == "cancelled, fully compensated"


@pytest.mark.rfd("C10")
def test_the_same_build_that_completed_the_step_also_blocks_rather_than_fails() -> None:
    refunds: list[Any] = []
    orders = {"o1": "open"}
    env = WorkflowEnvironment(fulfilment(refunds, orders, build="b1"))
    run_id = cancelled_mid_run(env, orders)
    run = env.wait(run_id)
    assert refunds == [] and run.phase == "compensating"
    assert [b["type"] for b in run.blockers] == ["compensation_target_not_reached"]
    assert all(a["status"] != "failed" for a in run.attempts("charge", "compensation"))


@pytest.mark.rfd("C10")
def test_an_operator_skip_is_recorded_with_its_reason_and_counted_apart() -> None:
    refunds: list[Any] = []
    orders = {"o1": "open"}
    env = WorkflowEnvironment(fulfilment(refunds, orders, build="b1"))
    run_id = cancelled_mid_run(env, orders)
    run = env.wait(run_id)
    generation = run.attempts("charge", "compensation")[-1]["generation"]
    env.resolve(run_id, "charge", phase="compensation", generation=generation, action="skip", reason="refunded by hand")
    run = env.wait(run_id)
    assert refunds == [] and run.phase == "finished" and run.recovery == "compensated"
    assert run.summary == "cancelled, compensated, 1 skipped by the operator"
    assert run.step("charge")["compensation"]["status"] == "skipped"
    resolution = run.attempts("charge", "compensation")[-1]["resolution"]
    assert resolution["action"] == "skip" and resolution["reason"] == "refunded by hand"
    # repeating the same resolution is idempotent; a different one is refused
    env.resolve(run_id, "charge", phase="compensation", generation=generation, action="skip")
    assert env.get(run_id).summary == "cancelled, compensated, 1 skipped by the operator"


@pytest.mark.rfd("C10", "C2")
def test_a_retired_step_is_skipped_without_a_blocker_and_a_missing_compensator_still_is() -> None:
    refunds: list[Any] = []
    orders = {"o1": "open"}
    env = WorkflowEnvironment(fulfilment(refunds, orders, build="b1"))
    run_id = cancelled_mid_run(env, orders)
    env.wait(run_id)
    env.sync(fulfilment(refunds, orders, build="b2", retired=("charge",)))  # the release retires the step
    run = env.wait(run_id)
    assert run.summary == "cancelled, fully compensated" and refunds == []
    assert run.step("charge")["compensation"]["status"] == "skipped"
    assert "retired" in run.attempts("charge", "compensation")[-1]["detail"]


# ---- found by the attack review of decisions 23-29 ---------------------------------------------------------


@pytest.mark.rfd("C10")
def test_a_renamed_step_whose_old_id_is_retired_is_skipped() -> None:
    def release(renamed: bool) -> Ryusen:
        app = Ryusen("orders", build_id=f"renamed-{renamed}")

        @app.function("fulfil", retired_steps=("charge",) if renamed else ())
        def fulfil(order: Any, step: Step) -> Any:
            step.run("charge-v2" if renamed else "charge", lambda: {"charge_id": "ch_1"})
            step.run("ship", lambda: {"parcel": "p1"})
            return "shipped"

        return app

    env = WorkflowEnvironment(release(renamed=False))
    run_id = env.start("fulfil", {"id": "o1"})
    env.drive(until=lambda: any(s["id"] == "charge" and s["status"] == "completed" for s in env.get(run_id).steps))
    env.sync(release(renamed=True))
    env.cancel(run_id)
    run = env.wait(run_id)
    assert run.summary == "cancelled, fully compensated" and run.blockers == []
    assert run.step("charge")["compensation"]["status"] == "skipped"


@pytest.mark.rfd("C10", "U11")
def test_an_operator_retry_of_a_blocked_compensation_keeps_its_reason() -> None:
    refunds: list[Any] = []
    orders = {"o1": "open"}
    env = WorkflowEnvironment(fulfilment(refunds, orders, build="b1"))
    run_id = cancelled_mid_run(env, orders)
    run = env.wait(run_id)
    generation = run.attempts("charge", "compensation")[-1]["generation"]
    orders["o1"] = "open"
    env.resolve(run_id, "charge", phase="compensation", generation=generation, action="retry", reason="RET-42")
    run = env.wait(run_id)
    assert run.summary == "cancelled, fully compensated" and refunds == [{"charge_id": "ch_1"}]
    resolution = run.attempts("charge", "compensation")[generation - 1]["resolution"]
    assert resolution["action"] == "retry" and resolution["reason"] == "RET-42"


@pytest.mark.rfd("C10")
def test_a_resolution_of_the_blocked_compensation_read_before_a_probe_still_moves_the_unwind_on() -> None:
    """Found driving the client over ``ryusen dev``: the probe asks current code again and fences one more
    compensation generation, so the blocker names generation 2 a moment after the operator read generation 1.
    Neither ran; the operator's decision is about the step's blocked compensation, so it is taken, once."""
    refunds: list[Any] = []
    orders = {"o1": "open"}
    env = WorkflowEnvironment(fulfilment(refunds, orders, build="b1"))
    run_id = cancelled_mid_run(env, orders)
    read = env.wait(run_id)
    seen = read.blockers[0]["generation"]
    env.advance(timedelta(hours=2))  # the probe: still blocked, a newer fenced generation
    run = env.wait(run_id)
    assert run.blockers[0]["generation"] > seen
    assert [a["status"] for a in run.attempts("charge", "compensation")] == ["fenced"] * run.blockers[0]["generation"]
    env.resolve(run_id, "charge", phase="compensation", generation=seen, action="succeed", result={"refund": "by hand"})
    run = env.wait(run_id)
    assert refunds == [] and run.summary == "cancelled, fully compensated"
    assert run.step("charge")["compensation"]["result"] == {"refund": "by hand"}
    resolved = [a for a in run.attempts("charge", "compensation") if a["resolution"]]
    assert len(resolved) == 1 and resolved[0]["status"] == "succeeded"
    # the same request again changes nothing; a different one is refused
    env.resolve(run_id, "charge", phase="compensation", generation=seen, action="succeed", result={"refund": "by hand"})
    assert len([a for a in env.get(run_id).attempts("charge", "compensation") if a["resolution"]]) == 1
    with pytest.raises(ConflictError):
        env.resolve(run_id, "charge", phase="compensation", generation=seen, action="skip")


@pytest.mark.rfd("C10")
@pytest.mark.parametrize("store", ["memory", "moto"])
def test_a_run_list_counts_an_operator_skip_apart_as_the_run_does(store: str) -> None:
    """A list of runs says what the run says: never "fully compensated" after a skip (on the DynamoDB store
    too, whose list reads each run's head, not its journal)."""
    refunds: list[Any] = []
    orders = {"o1": "open"}
    with WorkflowEnvironment(fulfilment(refunds, orders, build="b1"), store=store) as env:
        run_id = cancelled_mid_run(env, orders)
        run = env.wait(run_id)
        generation = run.attempts("charge", "compensation")[-1]["generation"]
        env.resolve(run_id, "charge", phase="compensation", generation=generation, action="skip", reason="by hand")
        assert env.wait(run_id).summary == "cancelled, compensated, 1 skipped by the operator"
        [listed] = env.store.list_runs(recovery="compensated").runs
        assert listed["id"] == run_id and listed["summary"] == "cancelled, compensated, 1 skipped by the operator"
        assert listed["recovery"] == "compensated" and listed["steps"] == 2 and listed["blocked"] is False

"""D8: a ``step.run`` opened inside another step's callback (decision 23).

The outer callback ran (a card was charged) and then met a step it may not open. That is not an ordinary
failure: retrying would charge again, and failing would compensate a run that nothing failed. The run
blocks on a definition blocker naming both steps; the outer callback runs at most once per release that
still nests.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from ryusen import Ryusen, Step, StepFailed
from ryusen.testing import WorkflowEnvironment


def shop(charges: list[str], refunds: list[Any], *, nest: bool, build: str) -> Ryusen:
    app = Ryusen("shop", build_id=build)

    @app.function("fulfil")
    def fulfil(order: Any, step: Step) -> Any:
        step.run("reserve", lambda: {"sku": "lamp"}, compensate=lambda r: refunds.append(("release", r)))

        def charge() -> dict[str, str]:
            charges.append(build)
            if nest:  # a receipt sent as a step of its own, from inside the charge: refused
                step.run("email-receipt", lambda: "sent")
            return {"charge_id": f"ch_{len(charges)}"}

        try:
            paid = step.run("charge", charge, compensate=lambda c: refunds.append(("refund", c)))
        except StepFailed:
            return {"handled": True}  # the function must never be told about the refusal
        return {"paid": paid}

    return app


@pytest.mark.rfd("D8")
@pytest.mark.parametrize("kept_passes", [False, True])
def test_a_step_opened_inside_a_callback_blocks_the_run_without_running_the_callback_again(kept_passes: bool) -> None:
    charges: list[str] = []
    refunds: list[Any] = []
    env = WorkflowEnvironment(shop(charges, refunds, nest=True, build="b1"), kept_passes=kept_passes)
    run_id = env.start("fulfil")
    run = env.wait(run_id)

    assert charges == ["b1"]  # charged once: not retried as an ordinary failure
    assert run.phase == "running" and run.outcome is None and refunds == []  # not failed, nothing compensated
    [blocker] = run.blockers
    assert blocker["type"] == "concurrent_step"
    assert blocker["first"]["step_id"] == "charge" and blocker["second"]["step_id"] == "email-receipt"
    assert "test_nested_steps.py" in blocker["first"]["location"]
    assert "test_nested_steps.py" in blocker["second"]["location"]
    assert (blocker["step_id"], blocker["phase"], blocker["generation"]) == ("charge", "forward", 1)  # to resolve
    [attempt] = run.attempts("charge")
    assert attempt["status"] == "failed" and attempt["error"]["type"] == "concurrent_step"
    assert run.step("charge")["status"] == "pending" and run.step("charge")["error"] is None

    # the probe and an operator's rediscover find the same build: it still nests, so nothing runs again
    env.advance(timedelta(hours=3))
    run = env.wait(run_id)
    env.rediscover(run_id)
    run = env.wait(run_id)
    assert charges == ["b1"]
    assert run.blockers[0]["type"] == "concurrent_step" and run.blockers[0]["count"] >= 3

    # a release that no longer nests moves it on: the charge is tried again, as a retry under its policy
    env.sync(shop(charges, refunds, nest=False, build="b2"))
    run = env.wait(run_id)
    assert charges == ["b1", "b2"]
    assert run.summary == "completed" and run.output == {"paid": {"charge_id": "ch_2"}}
    assert [a["status"] for a in run.attempts("charge")] == ["failed", "succeeded"]
    assert refunds == []


@pytest.mark.rfd("D8")
def test_a_release_that_still_nests_runs_the_outer_callback_once_more_and_blocks_again() -> None:
    charges: list[str] = []
    refunds: list[Any] = []
    env = WorkflowEnvironment(shop(charges, refunds, nest=True, build="b1"))
    run_id = env.start("fulfil")
    env.wait(run_id)
    env.sync(shop(charges, refunds, nest=True, build="b2"))
    run = env.wait(run_id)
    assert charges == ["b1", "b2"]  # once per release that nests
    assert run.phase == "running" and [b["type"] for b in run.blockers] == ["concurrent_step"]
    env.advance(timedelta(hours=3))
    assert env.wait(run_id).outcome is None and charges == ["b1", "b2"]


@pytest.mark.rfd("D8")
def test_an_operator_may_retry_or_settle_the_nested_attempt_with_consent() -> None:
    charges: list[str] = []
    refunds: list[Any] = []
    env = WorkflowEnvironment(shop(charges, refunds, nest=True, build="b1"))
    run_id = env.start("fulfil")
    env.wait(run_id)
    # the operator knows the charge went through: supplies its result; the run goes on from there
    env.resolve(run_id, "charge", generation=1, action="succeed", result={"charge_id": "ch_ops"})
    run = env.wait(run_id)
    assert charges == ["b1"] and run.summary == "completed"
    assert run.output == {"paid": {"charge_id": "ch_ops"}}
    assert [a["status"] for a in run.attempts("charge")] == ["failed", "succeeded"]

    # an explicit retry is consent to run the callback again (with the same code it nests again)
    env2 = WorkflowEnvironment(shop(charges, refunds, nest=True, build="b1"))
    other = env2.start("fulfil")
    env2.wait(other)
    env2.resolve(other, "charge", generation=1, action="retry")
    run = env2.wait(other)
    assert charges == ["b1", "b1", "b1"] and run.blockers[0]["type"] == "concurrent_step"


@pytest.mark.rfd("D8")
def test_a_cancel_while_blocked_by_a_nested_step_compensates_what_completed() -> None:
    charges: list[str] = []
    refunds: list[Any] = []
    env = WorkflowEnvironment(shop(charges, refunds, nest=True, build="b1"))
    run_id = env.start("fulfil")
    env.wait(run_id)
    env.cancel(run_id)
    run = env.wait(run_id)
    assert run.outcome == "cancelled" and run.phase == "finished"
    assert refunds == [("release", {"sku": "lamp"})]  # the reserve is undone; the charge never completed
    assert charges == ["b1"]
    assert run.step("charge")["status"] == "failed" and run.step("charge")["error"]["type"] == "concurrent_step"
    assert run.blockers == []


@pytest.mark.rfd("D8")
def test_an_async_callback_that_awaits_a_step_and_a_thread_that_opens_one_block_alike() -> None:
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from ryusen import AsyncStep

    charges: list[str] = []
    app = Ryusen("async-shop")

    @app.function("fulfil")
    async def fulfil(order: Any, step: AsyncStep) -> Any:
        async def charge() -> dict[str, str]:
            charges.append("async")
            await asyncio.sleep(0)
            await step.run("email-receipt", lambda: "sent")  # refused inside the callback
            return {"charge_id": "ch_1"}

        return await step.run("charge", charge)

    @app.function("threaded")
    def threaded(order: Any, step: Step) -> Any:
        def charge() -> dict[str, str]:
            charges.append("thread")
            with ThreadPoolExecutor(1) as pool:  # a step opened from a thread the callback started
                pool.submit(step.run, "email-receipt", lambda: "sent").result()
            return {"charge_id": "ch_2"}

        return step.run("charge", charge)

    env = WorkflowEnvironment(app)
    for function_id in ("fulfil", "threaded"):
        run = env.run(function_id)
        assert [b["type"] for b in run.blockers] == ["concurrent_step"], function_id
        assert run.attempts("charge")[0]["error"]["type"] == "concurrent_step"
    assert charges == ["async", "thread"]


# ---- D9: a step id that changes on every pass (decision 29) ------------------------------------------------


def quotes(calls: list[str], *, stable: bool, build: str) -> Ryusen:
    import random

    app = Ryusen("quotes", build_id=build)

    @app.function("quote")
    def quote(order: Any, step: Step) -> Any:
        step_id = "quote" if stable else f"quote-{random.randint(0, 10**12)}"
        price = step.run(step_id, lambda: calls.append(step_id) or 42)
        return step.run("book", lambda: {"price": price})

    return app


@pytest.mark.rfd("D9")
def test_a_step_id_that_changes_on_every_pass_blocks_the_run_within_a_few_passes() -> None:
    calls: list[str] = []
    env = WorkflowEnvironment(quotes(calls, stable=False, build="b1"))
    run_id = env.start("quote")
    run = env.wait(run_id)

    assert run.phase == "running" and run.outcome is None and calls == []
    assert len(run.steps) <= 4  # not 1,000 steps and a too_many_steps failure
    [blocker] = run.blockers
    assert blocker["type"] == "unstable_step_id" and "test_nested_steps.py" in blocker["first"]["location"]
    assert len(blocker["step_ids"]) == 4 and all(i.startswith("quote-") for i in blocker["step_ids"])
    assert "changes on every pass" in blocker["message"]

    steps = len(run.steps)
    for _ in range(30):  # a month of probes and rediscovers: each asks current code, none adds a step
        env.advance(timedelta(days=1))
        env.wait(run_id)
    env.rediscover(run_id)
    run = env.wait(run_id)
    assert run.blockers[0]["type"] == "unstable_step_id" and run.blockers[0]["count"] >= 10
    assert len(run.steps) == steps and run.outcome is None and calls == []

    env.sync(quotes(calls, stable=True, build="b2"))  # the fix: a stable id
    run = env.wait(run_id)
    assert run.summary == "completed" and run.output == {"price": 42} and calls == ["quote"]


# ---- found by the attack review of decisions 23-29 ---------------------------------------------------------


@pytest.mark.rfd("D8", "C5")
@pytest.mark.parametrize("kept_passes", [False, True])
def test_a_compensator_that_opens_a_step_runs_at_most_once_per_build(kept_passes: bool) -> None:
    refunds: list[str] = []

    def release(build: str, *, nest: bool = True) -> Ryusen:
        app = Ryusen("shop", build_id=build)

        @app.function("fulfil")
        def fulfil(order: Any, step: Step) -> Any:
            def refund(charge: Any) -> None:
                refunds.append(build)
                if nest:
                    step.run("email-refund", lambda: "sent")  # refused inside the compensator

            step.run("charge", lambda: {"id": "ch_1"}, compensate=refund)
            raise RuntimeError("fraud check failed")

        return app

    env = WorkflowEnvironment(release("b1"), kept_passes=kept_passes)
    run_id = env.start("fulfil")
    run = env.wait(run_id)
    assert refunds == ["b1"] and [b["type"] for b in run.blockers] == ["concurrent_step"]
    for _ in range(5):  # probes and an operator's rediscover, with the same build: nothing runs again
        env.advance(timedelta(hours=1))
        env.wait(run_id)
    env.rediscover(run_id)
    run = env.wait(run_id)
    assert refunds == ["b1"] and run.phase == "compensating" and run.blockers[0]["count"] >= 3
    env.sync(release("b2", nest=False))  # the fix runs the compensator once more
    run = env.wait(run_id)
    assert refunds == ["b1", "b2"] and run.summary == "failed, fully compensated"


def refunding_shop(refunds: list[str], *, build: str, nest: bool = True) -> Ryusen:
    app = Ryusen("shop", build_id=build)

    @app.function("fulfil")
    def fulfil(order: Any, step: Step) -> Any:
        def refund(charge: Any) -> dict[str, str]:
            refunds.append(build)
            if nest:  # a notification sent as a step of its own, from inside the compensator: refused
                step.run("email-refund", lambda: "sent")
            return {"refunded": charge["charge_id"]}

        step.run("charge", lambda: {"charge_id": "ch_1"}, compensate=refund)
        raise RuntimeError("rejected")

    return app


@pytest.mark.rfd("D8")
def test_a_compensator_that_opens_a_step_runs_again_only_with_another_build() -> None:
    """Found by the simulator (seed 3 of issue 23's first sweep): the probe that wakes a blocked unwind queued
    the compensation again, and the hold looked at that queued attempt, not at the one that ran, so the
    compensator ran again with the build that nests."""
    refunds: list[str] = []
    env = WorkflowEnvironment(refunding_shop(refunds, build="b1"))
    run_id = env.start("fulfil")
    run = env.wait(run_id)
    assert refunds == ["b1"] and run.phase == "compensating"
    assert [b["type"] for b in run.blockers] == ["concurrent_step"]

    env.advance(timedelta(hours=3))  # the probe wakes the unwind: the same build would nest again
    run = env.wait(run_id)
    env.rediscover(run_id)
    run = env.wait(run_id)
    assert refunds == ["b1"]  # not run again
    assert [b["type"] for b in run.blockers] == ["concurrent_step"]
    undo = run.attempts("charge", "compensation")
    assert undo[0]["status"] == "failed" and undo[0]["error"]["type"] == "concurrent_step"
    assert len(undo) > 1 and all(a["status"] == "fenced" for a in undo[1:])  # woken, and held each time

    env.sync(refunding_shop(refunds, build="b2", nest=False))  # a release that no longer nests moves it on
    run = env.wait(run_id)
    assert refunds == ["b1", "b2"] and run.summary == "failed, fully compensated"


@pytest.mark.rfd("D8")
def test_going_back_to_a_build_that_nested_does_not_run_the_callback_again() -> None:
    charges: list[str] = []
    refunds: list[Any] = []
    env = WorkflowEnvironment(shop(charges, refunds, nest=True, build="b1"))
    run_id = env.start("fulfil")
    env.wait(run_id)
    env.sync(shop(charges, refunds, nest=True, build="b2"))
    env.wait(run_id)
    app = shop(charges, refunds, nest=True, build="b1")
    env.sync(app, release_id="b1-again")  # a rollback to the first build
    env.wait(run_id)
    assert charges == ["b1", "b2"]  # b1 already showed it nests


@pytest.mark.rfd("D8")
def test_a_release_that_lands_between_authorization_and_request_still_nests_once() -> None:
    """Found by the interleavings property test: the attempt records the release that authorized it, but the
    code that answered was a newer build at the same URL; the endpoint reports its build with the refusal, and
    the hold uses it."""
    charges: list[str] = []
    refunds: list[Any] = []
    env = WorkflowEnvironment(shop(charges, refunds, nest=False, build="b1"))
    invoke = env.invoker.invoke
    deployed: list[bool] = []

    def deploy_first(url: str, body: bytes, headers: dict[str, str], *, timeout_s: float) -> Any:
        if b'"charge"' in body and not deployed:  # the write authorized charge with b1; b2 lands before the POST
            deployed.append(True)
            env.sync(shop(charges, refunds, nest=True, build="b2"))
        return invoke(url, body, headers, timeout_s=timeout_s)

    env.invoker.invoke = deploy_first  # type: ignore[method-assign]
    run_id = env.start("fulfil")
    run = env.wait(run_id)
    env.advance(timedelta(hours=3))  # the probe wakes the run, with b2 still the newest release
    run = env.wait(run_id)
    assert [b["type"] for b in run.blockers] == ["concurrent_step"]
    assert charges == ["b2"]  # b2's callback ran once and nested: it must not run again with b2


# ---- found by the second attack review ------------------------------------------------------------------


@pytest.mark.rfd("D8", "U6")
def test_after_a_rollback_a_retry_of_the_generation_the_blocker_names_runs_the_callback() -> None:
    charges: list[str] = []
    refunds: list[Any] = []
    env = WorkflowEnvironment(shop(charges, refunds, nest=True, build="b1"))
    run_id = env.start("fulfil")
    env.wait(run_id)
    env.sync(shop(charges, refunds, nest=True, build="b2"))
    env.wait(run_id)
    env.sync(shop(charges, refunds, nest=False, build="b1"), release_id="b1-again")  # b1's build id, fixed code
    run = env.wait(run_id)
    assert charges == ["b1", "b2"]
    [blocker] = run.blockers
    assert blocker["generation"] == 1  # held by b1's own earlier attempt
    env.resolve(run_id, "charge", generation=1, action="retry", reason="b1 is fixed now")  # consent
    run = env.wait(run_id)
    assert charges == ["b1", "b2", "b1"] and run.summary == "completed"


@pytest.mark.rfd("D8", "C5")
def test_a_retry_of_a_held_compensators_fenced_generation_runs_it() -> None:
    refunds: list[str] = []
    env = WorkflowEnvironment(refunding_shop(refunds, build="b1"))
    run_id = env.start("fulfil")
    env.wait(run_id)
    env.advance(timedelta(hours=2))  # a probe queues the compensation again: held, fenced
    run = env.wait(run_id)
    fenced = run.attempts("charge", "compensation")[-1]
    assert fenced["status"] == "fenced" and refunds == ["b1"]
    env.sync(refunding_shop(refunds, build="b1", nest=False), release_id="b1-fixed")  # the same build id
    env.resolve(run_id, "charge", phase="compensation", generation=fenced["generation"], action="retry")
    run = env.wait(run_id)
    assert refunds == ["b1", "b1"] and run.summary == "failed, fully compensated"


@pytest.mark.rfd("D9")
def test_a_fix_released_while_an_unstable_id_waits_for_its_confirming_pass_is_not_blamed() -> None:
    calls: list[str] = []
    env = WorkflowEnvironment(quotes(calls, stable=False, build="b1"), chain_steps=False)
    run_id = env.start("quote")
    env.wait(run_id)
    env.rediscover(run_id)
    env.step_once()  # the wake's first pass: its id becomes the candidate, a confirming pass is queued
    assert env.get(run_id).blockers[0]["type"] == "unstable_step_id"
    env.sync(quotes(calls, stable=True, build="b2"))  # the fix lands before the confirming pass runs
    run = env.wait(run_id)
    assert run.summary == "completed" and calls == ["quote"]


@pytest.mark.rfd("D8", "U8")
def test_an_older_held_attempt_cannot_be_retried_while_a_later_generation_is_unknown() -> None:
    """Found by the simulator (seed 6205): resolving the generation a nested-step blocker named, while the
    operator's earlier retry had left a later generation Unknown, queued a second live attempt."""
    from ryusen_server.ports import ConflictError

    charges: list[str] = []
    refunds: list[Any] = []
    env = WorkflowEnvironment(shop(charges, refunds, nest=True, build="b1"))
    run_id = env.start("fulfil")
    env.wait(run_id)
    env.sync(shop(charges, refunds, nest=False, build="b2"))
    env.faults.lose_result("charge")  # b2's charge runs, and its answer is lost: Unknown
    run = env.wait(run_id)
    assert [a["status"] for a in run.attempts("charge")] == ["failed", "unknown"]
    with pytest.raises(ConflictError, match="generation 2 is unknown"):
        env.resolve(run_id, "charge", generation=1, action="retry")
    run = env.get(run_id)
    assert [a["status"] for a in run.attempts("charge")] == ["failed", "unknown"] and charges == ["b1", "b2"]

"""F13: a callback that ran but returned more than the value limit (decision 25).

The card was charged; only the answer is too big to record. That is neither a failure (which would never be
compensated) nor a reason to retry (which would charge again): the run blocks with ``result_too_large``. If
the run stops meanwhile, the step is undone like any accepted step, its compensator receiving an
``OmittedResult`` in place of the value.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from ryusen import OmittedResult, RetryPolicy, Ryusen, Step, StepFailed
from ryusen.testing import WorkflowEnvironment

BIG = "x" * 300_000


def payments(charges: list[str], refunds: list[Any], *, build: str, big: bool = True) -> Ryusen:
    app = Ryusen("payments", build_id=build)

    def charge() -> dict[str, str]:
        charges.append(build)
        return {"charge_id": f"ch_{len(charges)}", **({"receipt_pdf": BIG} if big else {})}

    @app.function("pay")
    def pay(order: Any, step: Step) -> Any:
        step.run("reserve", lambda: "r1", compensate=lambda r: refunds.append(("release", r)))
        try:
            paid = step.run(
                "charge", charge, compensate=lambda c: refunds.append(("refund", c)), retry=RetryPolicy(max_attempts=1)
            )
        except StepFailed as failure:
            return {"failed": failure.error_type}
        return {"charge_id": paid["charge_id"]}

    return app


@pytest.mark.rfd("F13")
def test_a_result_over_the_limit_blocks_the_run_and_is_never_retried_without_consent() -> None:
    charges: list[str] = []
    refunds: list[Any] = []
    env = WorkflowEnvironment(payments(charges, refunds, build="b1"))
    run_id = env.start("pay")
    run = env.wait(run_id)

    assert charges == ["b1"] and refunds == []
    assert run.phase == "running" and run.outcome is None
    [blocker] = run.blockers
    assert blocker["type"] == "result_too_large" and blocker["step_id"] == "charge"
    assert blocker["size"] > 300_000 and blocker["limit"] == 256 * 1024
    [attempt] = run.attempts("charge")
    assert attempt["status"] == "succeeded" and attempt["error"] is None
    assert run.step("charge")["omitted_result"]["size"] == blocker["size"]

    # neither the probe nor a release runs the charge again: that needs an operator's consent
    env.advance(timedelta(hours=3))
    env.sync(payments(charges, refunds, build="b2", big=False))
    run = env.wait(run_id)
    assert charges == ["b1"] and run.blockers[0]["type"] == "result_too_large"

    env.resolve(run_id, "charge", generation=1, action="retry", reason="b2 returns the receipt's id only")
    run = env.wait(run_id)
    assert charges == ["b1", "b2"] and run.summary == "completed" and run.output == {"charge_id": "ch_2"}
    assert run.attempts("charge")[0]["resolution"]["action"] == "retry"


@pytest.mark.rfd("F13", "S5")
def test_a_stop_while_blocked_undoes_the_step_with_an_omitted_result() -> None:
    charges: list[str] = []
    refunds: list[Any] = []
    env = WorkflowEnvironment(payments(charges, refunds, build="b1"))
    run_id = env.start("pay")
    env.wait(run_id)
    env.cancel(run_id)
    run = env.wait(run_id)
    assert run.summary == "cancelled, fully compensated"
    assert [u["step_id"] for u in run["unwind"]] == ["charge", "reserve"]  # accepted, in completion order
    (what, omitted), release = refunds
    assert what == "refund" and isinstance(omitted, OmittedResult)
    assert omitted.size == run.step("charge")["omitted_result"]["size"] and len(omitted.sha256) == 64
    assert release == ("release", "r1") and charges == ["b1"]


@pytest.mark.rfd("F13")
def test_an_operator_may_supply_the_result_or_declare_the_attempt_failed() -> None:
    charges: list[str] = []
    refunds: list[Any] = []
    env = WorkflowEnvironment(payments(charges, refunds, build="b1"))
    run_id = env.start("pay")
    env.wait(run_id)
    env.resolve(run_id, "charge", generation=1, action="succeed", result={"charge_id": "ch_ops"})
    run = env.wait(run_id)
    assert run.summary == "completed" and run.output == {"charge_id": "ch_ops"} and charges == ["b1"]

    other = env.start("pay")
    env.wait(other)
    env.resolve(other, "charge", generation=1, action="fail", error={"type": "Oversized", "message": "gave up"})
    run = env.wait(other)
    # a declared failure is a failed attempt: the policy (one attempt) is spent, the function is told
    assert run.summary == "completed" and run.output == {"failed": "Oversized"} and charges == ["b1", "b1"]


@pytest.mark.rfd("F13", "C4")
def test_a_compensator_that_returned_too_much_is_a_success_with_a_visible_marker() -> None:
    app = Ryusen("refunds")
    refunded: list[Any] = []

    def refund(charge: Any) -> str:
        refunded.append(charge)
        return BIG

    @app.function("pay")
    def pay(order: Any, step: Step) -> Any:
        step.run("charge", lambda: {"charge_id": "ch_1"}, compensate=refund)
        raise RuntimeError("fraud check failed")

    run = WorkflowEnvironment(app).run("pay")
    assert run.summary == "failed, fully compensated" and refunded == [{"charge_id": "ch_1"}]
    compensation = run.step("charge")["compensation"]
    assert compensation["status"] == "compensated" and compensation["result"] is None
    assert compensation["omitted_result"]["size"] > 300_000
    assert [a["status"] for a in run.attempts("charge", "compensation")] == ["succeeded"]


def rejecting(refunds: list[Any]) -> Ryusen:
    """A release whose pass rejects the order before it reaches ``charge``: the run fails."""
    app = Ryusen("payments", build_id="b2")

    @app.function("pay")
    def pay(order: Any, step: Step) -> Any:
        step.run("reserve", lambda: "r1", compensate=lambda r: refunds.append(("release", r)))
        raise RuntimeError("order rejected")

    return app


@pytest.mark.rfd("F13")
def test_a_result_over_the_limit_is_undone_when_the_run_fails_while_it_waits() -> None:
    """Found by the property test of orchestration faults (issue 23): a release whose pass failed without
    reaching the step ended the run around a charge that ran, and left it out of the unwind. A failure stops the
    run as a cancel does: the step joins the unwind, and its compensator receives an OmittedResult."""
    charges: list[str] = []
    refunds: list[Any] = []
    env = WorkflowEnvironment(payments(charges, refunds, build="b1"))
    run_id = env.start("pay")
    assert env.wait(run_id).blockers[0]["type"] == "result_too_large"

    env.sync(rejecting(refunds))  # the release wakes the run: its pass fails before the charge
    env.drive(until=lambda: env.get(run_id).outcome is not None)
    run = env.get(run_id)
    assert run.outcome == "failed" and [u["step_id"] for u in run["unwind"]] == ["charge", "reserve"]

    env.sync(payments(charges, refunds, build="b3", big=False))  # code that reaches the charge's compensator
    run = env.wait(run_id)
    assert charges == ["b1"] and run.summary == "failed, fully compensated"
    [(what, omitted), release] = refunds
    assert what == "refund" and isinstance(omitted, OmittedResult) and omitted.size > 300_000
    assert release == ("release", "r1")

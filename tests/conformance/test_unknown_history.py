"""U11: an attempt that was Unknown keeps that history, and a resolution keeps who, how and why (decision 28)."""

from __future__ import annotations

from typing import Any

import pytest

from ryusen import RetryPolicy, Ryusen, Step, StepFailed
from ryusen.testing import WorkflowEnvironment


def payments(charges: list[int]) -> Ryusen:
    app = Ryusen("payments")

    @app.function("pay")
    def pay(order: Any, step: Step) -> Any:
        try:
            return step.run(
                "charge", lambda: charges.append(1) or {"charge_id": "ch_1"}, retry=RetryPolicy(max_attempts=3)
            )
        except StepFailed as failure:
            return {"failed": failure.message}

    return app


@pytest.mark.rfd("U11", "U2")
def test_a_late_result_settles_an_unknown_attempt_and_it_stays_in_the_history() -> None:
    charges: list[int] = []
    env = WorkflowEnvironment(payments(charges))
    env.faults.lose_result("charge")
    run_id = env.start("pay")
    run = env.wait(run_id)
    [lost] = run.attempts("charge")
    assert lost["status"] == "unknown" and lost["unknown"]["reason"]
    env.deliver_late_result(run_id, "charge")
    run = env.wait(run_id)
    [settled] = run.attempts("charge")
    assert settled["status"] == "succeeded" and run.summary == "completed"
    assert settled["unknown"] == lost["unknown"]  # when and why it was Unknown, kept beside the outcome
    assert settled["resolution"] is None  # a late result, not an operator


@pytest.mark.rfd("U11", "U3", "U5")
def test_an_operator_resolution_keeps_who_how_and_why() -> None:
    charges: list[int] = []
    env = WorkflowEnvironment(payments(charges))
    env.faults.lose_result("charge")
    run_id = env.start("pay")
    env.wait(run_id)
    env.resolve(run_id, "charge", generation=1, action="succeed", result={"charge_id": "ch_9"}, reason="bank says paid")
    run = env.wait(run_id)
    [attempt] = run.attempts("charge")
    assert attempt["status"] == "succeeded" and attempt["unknown"]["reason"]
    resolution = attempt["resolution"]
    assert resolution["action"] == "succeed" and resolution["reason"] == "bank says paid"
    assert resolution["by"] == "ryusen.testing" and resolution["at"]
    assert run.output == {"charge_id": "ch_9"}
    # the same resolution again is idempotent; another one is refused
    env.resolve(run_id, "charge", generation=1, action="succeed", result={"charge_id": "ch_9"})
    from ryusen_server.ports import ConflictError

    with pytest.raises(ConflictError):
        env.resolve(run_id, "charge", generation=1, action="fail", error={"type": "x", "message": "y"})


@pytest.mark.rfd("U11", "U4")
def test_a_declared_failure_retries_under_the_policy_unless_it_is_final() -> None:
    charges: list[int] = []
    env = WorkflowEnvironment(payments(charges))
    env.faults.lose_result("charge")
    run_id = env.start("pay")
    env.wait(run_id)
    env.resolve(run_id, "charge", generation=1, action="fail", error={"type": "declared_failure", "message": "no"})
    run = env.wait(run_id)
    assert [a["status"] for a in run.attempts("charge")] == ["failed", "succeeded"] and len(charges) == 2

    final: list[int] = []
    env = WorkflowEnvironment(payments(final))
    env.faults.lose_result("charge")
    run_id = env.start("pay")
    env.wait(run_id)
    error = {"type": "declared_failure", "message": "card blocked", "retryable": False}
    env.resolve(run_id, "charge", generation=1, action="fail", error=error, reason="the bank confirmed")
    run = env.wait(run_id)
    assert [a["status"] for a in run.attempts("charge")] == ["failed"] and len(final) == 1
    assert run.output == {"failed": "card blocked"}
    assert run.attempts("charge")[0]["resolution"]["reason"] == "the bank confirmed"

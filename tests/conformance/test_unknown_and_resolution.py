"""U (Unknown outcomes, operator resolution), C5, O1 and O4, through the engine and the SDK."""

from __future__ import annotations

import threading
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

import ryusen
from ryusen import RetryPolicy, Ryusen, Step
from ryusen.testing import WorkflowEnvironment
from ryusen_server.core.events import EngineSettings
from ryusen_server.ports import ConflictError, NotFoundError

SHORT = EngineSettings(attempt_timeout_s=30, lease_grace_s=10)


def payments(calls: Counter[str], ops: list[tuple[str, int]] | None = None, *, on_unknown: str = "block") -> Ryusen:
    app = Ryusen("payments")

    def charge(amount: int) -> Any:
        calls["charge"] += 1
        op = ryusen.operation()
        if ops is not None:
            ops.append((op.id, op.generation))
        return {"charged": amount, "op": op.id}

    def refund(result: Any) -> Any:
        calls["refund"] += 1
        return {"refunded": result["charged"]}

    @app.function("pay")
    def pay(data: Any, step: Step) -> Any:
        charged = step.run(
            "charge",
            charge,
            data["amount"],
            compensate=refund,
            retry=RetryPolicy(on_unknown=on_unknown),  # type: ignore[arg-type]
        )
        receipt = step.run("receipt", lambda: calls.update(["receipt"]) or "sent")
        if data.get("fail"):
            raise RuntimeError("ledger rejected")
        return {"charged": charged, "receipt": receipt}

    return app


@pytest.mark.rfd("U1")
def test_lost_result_is_unknown_and_blocks_without_retry() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(payments(calls))
    env.faults.lose_result("charge")
    run_id = env.start("pay", {"amount": 5})
    env.drive()
    run = env.get(run_id)
    assert run.step("charge")["status"] == "unknown"
    assert [a["status"] for a in run.attempts("charge")] == ["unknown"]  # not retried, not failed
    assert run.phase == "running" and run.outcome is None
    assert run.blockers[0]["type"] == "unknown_outcome" and run.blockers[0]["step_id"] == "charge"
    assert calls == Counter({"charge": 1})
    assert "blocked: unknown outcome of charge step #1" in run.summary


@pytest.mark.rfd("U1")
def test_lease_expiry_makes_the_attempt_unknown() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(payments(calls), settings=SHORT)
    env.faults.crash_before_invoke("charge")  # the dispatcher dies after authorization
    run_id = env.start("pay", {"amount": 5})
    env.drive(horizon=timedelta(seconds=39))
    assert env.get(run_id).step("charge")["status"] == "running"  # the lease (30 s + 10 s) has not expired yet
    env.drive(horizon=timedelta(seconds=41))  # the message, made the lease at authorization, comes back at 40 s
    run = env.get(run_id)
    assert run.step("charge")["status"] == "unknown"
    assert "lease expired" in run.attempts("charge")[0]["detail"]
    assert calls["charge"] == 0  # it never ran, but Ryusen cannot know that


@pytest.mark.rfd("U2")
def test_late_result_resolves_unknown_and_later_ones_are_stale() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(payments(calls))
    env.faults.lose_result("charge")
    run_id = env.start("pay", {"amount": 5})
    env.drive()
    env.deliver_late_result(run_id, "charge")
    run = env.wait(run_id)
    assert run.outcome == "completed" and run.step("charge")["result"]["charged"] == 5
    assert run.blockers == []


@pytest.mark.rfd("U3", "U5")
def test_operator_success_is_authoritative_and_idempotent() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(payments(calls))
    env.faults.lose_result("charge")
    run_id = env.start("pay", {"amount": 5})
    env.drive()
    env.resolve(
        run_id, "charge", phase="forward", generation=1, action="succeed", result={"charged": 5, "op": "manual"}
    )
    version = env.engine.get_run(run_id).version
    env.resolve(
        run_id, "charge", phase="forward", generation=1, action="succeed", result={"charged": 5, "op": "manual"}
    )
    assert env.engine.get_run(run_id).version == version  # repeating it changes nothing
    with pytest.raises(ConflictError) as differently:
        env.resolve(
            run_id, "charge", phase="forward", generation=1, action="fail", error={"type": "X", "message": "no"}
        )
    assert differently.value.details["code"] == "generation_settled"
    run = env.wait(run_id)
    assert run.outcome == "completed" and run.step("charge")["result"] == {"charged": 5, "op": "manual"}
    assert run.attempts("charge")[0]["detail"] == "operator succeed"
    # the late result that finally arrives is a stale diagnostic
    env.deliver_late_result(run_id, "charge")
    after = env.get(run_id)
    assert after.step("charge")["result"] == {"charged": 5, "op": "manual"}
    assert len(after.attempts("charge")[0]["stale_submissions"]) == 1


@pytest.mark.rfd("U4")
def test_operator_failure_follows_phase_semantics() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(payments(calls))
    env.faults.lose_result("charge")
    run_id = env.start("pay", {"amount": 5})
    env.drive()
    env.resolve(
        run_id, "charge", generation=1, action="fail", error={"type": "declared_failure", "message": "bank says no"}
    )
    run = env.wait(run_id)
    # running: the forward retry policy applies, so generation 2 ran and succeeded
    assert [a["status"] for a in run.attempts("charge")] == ["failed", "succeeded"]
    assert run.outcome == "completed" and calls["charge"] == 2

    calls2: Counter[str] = Counter()
    env2 = WorkflowEnvironment(payments(calls2))
    env2.faults.lose_result("charge")
    run2 = env2.start("pay", {"amount": 5})
    env2.faults.before_invoke("charge", lambda: env2.cancel(run2))
    env2.drive()
    env2.resolve(run2, "charge", generation=1, action="fail", error={"type": "declared_failure", "message": "no"})
    done = env2.wait(run2)
    # after a stop: no forward retry, the step is not completed and stays out of the unwind
    assert [a["status"] for a in done.attempts("charge")] == ["failed"]
    assert done.recovery == "not_required" and calls2["refund"] == 0


@pytest.mark.rfd("U5")
def test_resolution_of_a_non_current_generation_is_refused() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(payments(calls))
    env.faults.lose_result("charge", times=2)
    run_id = env.start("pay", {"amount": 5})
    env.drive()
    env.resolve(run_id, "charge", generation=1, action="retry")
    env.drive()
    with pytest.raises(ConflictError) as stale:
        env.resolve(run_id, "charge", generation=1, action="succeed", result={"charged": 1})
    assert stale.value.details["code"] == "generation_settled"
    with pytest.raises(NotFoundError) as missing:
        env.resolve(run_id, "charge", generation=7, action="retry")
    assert missing.value.details["code"] == "attempt_not_found"


@pytest.mark.rfd("U6", "U7")
def test_explicit_retry_fences_g_and_creates_g_plus_one_with_the_same_operation_id() -> None:
    calls: Counter[str] = Counter()
    ops: list[tuple[str, int]] = []
    env = WorkflowEnvironment(payments(calls, ops))
    env.faults.lose_result("charge")
    run_id = env.start("pay", {"amount": 5})
    env.drive()
    env.resolve(run_id, "charge", generation=1, action="retry")
    run = env.wait(run_id)
    attempts = run.attempts("charge")
    assert [(a["generation"], a["status"]) for a in attempts] == [(1, "retry_authorized"), (2, "succeeded")]
    assert attempts[0]["operation_id"] == attempts[1]["operation_id"]
    assert [op for op, _ in ops] == [attempts[0]["operation_id"]] * 2 and [g for _, g in ops] == [1, 2]
    # U7: G's result arriving now is stale and changes nothing
    result_before = run.step("charge")["result"]
    env.deliver_late_result(run_id, "charge", generation=1)
    after = env.get(run_id)
    assert after.step("charge")["result"] == result_before and after.outcome == "completed"
    assert after.attempts("charge")[0]["stale_submissions"][0]["reason"] == "a newer generation exists"


@pytest.mark.rfd("U5")
def test_retry_of_a_settled_generation_is_refused_when_the_run_is_finished() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(payments(calls))
    run = env.run("pay", {"amount": 5})
    with pytest.raises(ConflictError) as refused:
        env.resolve(run.id, "charge", generation=1, action="retry")
    assert refused.value.details["code"] == "generation_settled"


@pytest.mark.rfd("U6")
def test_explicit_retry_only_while_forward_execution_or_compensation_is_active() -> None:
    """An Unknown forward attempt may be retried while the run goes forward, and an Unknown compensation while
    the unwind runs; between the two (a stop intent written, the unwind not begun) no retry is allowed. Each
    allowed retry is one write: G settles ``retry_authorized`` (a result for it is then stale) and G+1
    exists, queued, with G's operation id."""
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(payments(calls))

    def retry(run_id: str, phase: str) -> None:
        version = env.engine.get_run(run_id).version
        env.resolve(run_id, "charge", phase=phase, generation=1, action="retry")
        state = env.engine.get_run(run_id)
        assert state.version == version + 1  # one write
        [g, g_plus_one] = env.get(run_id).attempts("charge", phase)
        assert (g["generation"], g["status"]) == (1, "retry_authorized")
        assert (g_plus_one["generation"], g_plus_one["status"]) == (2, "queued")
        assert g_plus_one["operation_id"] == g["operation_id"]

    # forward execution active: allowed
    env.faults.lose_result("charge")
    going = env.start("pay", {"amount": 5})
    env.drive()
    assert env.get(going).phase == "running"
    retry(going, "forward")
    assert env.wait(going).outcome == "completed" and calls["charge"] == 2

    # a stop intent, the unwind not begun: forward is over and compensation has not started
    env.faults.lose_result("charge")
    stopped = env.start("pay", {"amount": 5})
    env.drive()
    env.cancel(stopped)
    assert env.get(stopped).phase == "settling"
    with pytest.raises(ConflictError) as refused:
        env.resolve(stopped, "charge", generation=1, action="retry")
    assert refused.value.details["code"] == "retry_after_stop"
    assert [a["status"] for a in env.get(stopped).attempts("charge")] == ["unknown"]

    # compensation active: allowed
    env.faults.lose_result("charge", phase="compensation")
    unwinding = env.start("pay", {"amount": 5, "fail": True})
    env.drive()
    assert env.get(unwinding).phase == "compensating"
    refunds = calls["refund"]
    retry(unwinding, "compensation")
    run = env.wait(unwinding)
    assert run.summary == "failed, fully compensated" and calls["refund"] == refunds + 1
    assert [a["status"] for a in run.attempts("charge", "compensation")] == ["retry_authorized", "succeeded"]


@pytest.mark.rfd("U9")
def test_forward_retry_after_a_stop_is_refused() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(payments(calls))
    env.faults.lose_result("charge")
    run_id = env.start("pay", {"amount": 5})
    env.drive()
    env.cancel(run_id)
    version = env.engine.get_run(run_id).version
    with pytest.raises(ConflictError) as refused:
        env.resolve(run_id, "charge", generation=1, action="retry")
    assert refused.value.details["code"] == "retry_after_stop"
    assert env.engine.get_run(run_id).version == version
    assert env.get(run_id).phase == "settling"


@pytest.mark.rfd("U10")
def test_on_unknown_retry_turns_unknown_into_a_normal_retry() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(payments(calls, on_unknown="retry"))
    env.faults.lose_result("charge")
    run = env.run("pay", {"amount": 5})
    assert [a["status"] for a in run.attempts("charge")] == ["failed", "succeeded"]
    assert run.attempts("charge")[0]["error"]["type"] == "unknown_outcome"
    assert run.outcome == "completed" and run.blockers == []
    # the default still blocks, for other steps and other apps
    blocking = WorkflowEnvironment(payments(Counter()))
    blocking.faults.lose_result("charge")
    rid = blocking.start("pay", {"amount": 5})
    blocking.drive()
    assert blocking.get(rid).step("charge")["status"] == "unknown"


@pytest.mark.rfd("C5")
def test_lost_compensation_result_halts_the_unwind_until_resolved() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(payments(calls))
    env.faults.lose_result("charge", phase="compensation")
    run_id = env.start("pay", {"amount": 5, "fail": True})
    env.drive()
    run = env.get(run_id)
    assert run.phase == "compensating" and run.recovery == "compensating"
    assert run.step("charge")["compensation"]["status"] == "unknown"
    assert run.blockers[0]["phase"] == "compensation"
    assert run.summary.startswith("failed, compensating (blocked: unknown outcome of charge compensation #1")
    assert calls["refund"] == 1  # it ran once; no second invocation while Unknown
    env.resolve(run_id, "charge", phase="compensation", generation=1, action="succeed", result={"refunded": 5})
    run = env.wait(run_id)
    assert run.summary == "failed, fully compensated" and calls["refund"] == 1


@pytest.mark.rfd("O1")
def test_every_attempt_is_visible_with_its_metadata() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(payments(calls))
    env.faults.lose_result("charge")
    run_id = env.start("pay", {"amount": 5, "fail": True})
    env.drive()
    env.resolve(run_id, "charge", generation=1, action="retry")
    env.drive()
    env.deliver_late_result(run_id, "charge", generation=1)
    run = env.wait(run_id)
    attempts = run.step("charge")["attempts"]
    assert [(a["phase"], a["generation"], a["status"]) for a in attempts] == [
        ("forward", 1, "retry_authorized"),
        ("forward", 2, "succeeded"),
        ("compensation", 1, "succeeded"),
    ]
    for a in attempts:
        assert a["operation_id"].startswith("op_")
        assert a["authorized_at"] and a["settled_at"] and a["release_id"] and a["build_id"]
    assert attempts[0]["stale_submissions"][0]["outcome"]["type"] == "succeeded"


@pytest.mark.rfd("O4")
def test_duplicate_messages_never_duplicate_acceptance_or_settlement() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(payments(calls))
    env.faults.duplicate_messages = True
    run = env.run("pay", {"amount": 5, "fail": True})
    assert calls == Counter({"charge": 1, "receipt": 1, "refund": 1})
    # one forward and one compensation attempt per step ("receipt" has no compensator: a recorded skip)
    assert [[a["phase"] for a in s["attempts"]] for s in run.steps] == [["forward", "compensation"]] * 2
    assert [u["status"] for u in run["unwind"]] == ["skipped", "compensated"]


@pytest.mark.rfd("O4")
@pytest.mark.parametrize("store", ["memory", "moto"])
def test_concurrent_handlers_on_one_message_authorize_once(store: str) -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(payments(calls), store=store)
    run_id = env.start("pay", {"amount": 5})
    env.drive(until=lambda: bool(env.get(run_id).steps))
    [task] = list(env.pending_tasks())
    barrier = threading.Barrier(4)

    def deliver() -> None:
        barrier.wait()
        env.engine.deliver(task)

    threads = [threading.Thread(target=deliver) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls["charge"] == 1
    assert [a["status"] for a in env.get(run_id).attempts("charge")] == ["succeeded"]
    env.close()


@pytest.mark.rfd("O4")
def test_same_idempotency_key_returns_the_same_run() -> None:
    env = WorkflowEnvironment(payments(Counter()))
    first = env.start("pay", {"amount": 5}, idempotency_key="order-7")
    again = env.start("pay", {"amount": 5}, idempotency_key="order-7")
    other = env.start("pay", {"amount": 5}, idempotency_key="order-8")
    assert first == again != other
    assert len(env.store.list_runs().runs) == 2


@pytest.mark.rfd("O4")
def test_a_send_that_fails_after_its_write_is_repaired_when_the_message_returns() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(payments(calls), chain_steps=False)  # every task is sent, discovery #2 too
    original = env.queue.send
    failures = {"left": 1}

    def flaky_send(task: Any, delay_s: float = 0.0, *, app_id: str | None = None) -> None:
        if task.kind.value == "discover" and task.seq == 2 and failures["left"]:
            failures["left"] -= 1
            raise ConnectionError("SQS unavailable")  # the write that queued discovery #2 has committed
        original(task, delay_s, app_id=app_id)

    env.queue.send = flaky_send  # type: ignore[method-assign]
    run = env.run("pay", {"amount": 5})
    assert failures["left"] == 0
    assert run.outcome == "completed" and calls == Counter({"charge": 1, "receipt": 1})


@pytest.mark.rfd("U7")
def test_repeated_stale_submissions_are_kept_bounded_and_change_nothing() -> None:
    """A late submitter that repeats itself cannot grow the run's record without bound."""
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(payments(calls), settings=EngineSettings(stale_submissions_kept=3))
    env.faults.lose_result("charge")
    run_id = env.start("pay", {"amount": 5})
    env.drive()
    [held] = env.faults.held
    env.resolve(run_id, "charge", generation=1, action="retry")
    done = env.wait(run_id)
    before = done.raw
    for _ in range(7):
        env.engine.submit_late_result(held.body, held.headers)
    after = env.get(run_id)
    [first, second] = after.attempts("charge")
    assert first["status"] == "retry_authorized" and second["status"] == "succeeded"
    assert len(first["stale_submissions"]) == 3 and first["stale_submissions_dropped"] == 4
    assert {s["reason"] for s in first["stale_submissions"]} == {"a newer generation exists"}
    assert after.step("charge")["result"] == before["steps"][0]["result"]  # the accepted result is untouched
    assert after.outcome == "completed"

"""C: compensation on uncaught failure, end to end through the engine and the SDK."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import pytest

import ryusen
from ryusen import RetryPolicy, Ryusen, Step
from ryusen._internal.wire import Phase
from ryusen.testing import WorkflowEnvironment
from ryusen_server.core.events import EngineSettings


def saga(log: list[tuple[str, Any]], *, fail: bool = True, compensators: bool = True) -> Ryusen:
    app = Ryusen("saga")

    def undo(name: str) -> Any:
        def compensate(result: Any) -> Any:
            op = ryusen.operation()
            log.append((f"undo-{name}", {"result": result, "op": op.id, "phase": op.phase, "gen": op.generation}))
            return {"undone": name}

        return compensate if compensators else None

    @app.function("trip")
    def trip(data: Any, step: Step) -> Any:
        flight = step.run("flight", lambda: {"pnr": "F1"}, compensate=undo("flight"))
        hotel = step.run("hotel", lambda: {"room": 12}, compensate=undo("hotel"))
        car = step.run("car", lambda: {"car": "C3"}, compensate=undo("car"))
        if fail:
            raise RuntimeError("payment authorization revoked")
        return [flight, hotel, car]

    return app


@pytest.mark.rfd("C1", "C3", "C4")
def test_unwind_reverses_completion_order_one_at_a_time() -> None:
    log: list[tuple[str, Any]] = []
    env = WorkflowEnvironment(saga(log))
    run_id = env.start("trip")
    in_flight: list[int] = []

    def watch(kind: str, payload: Any) -> None:
        if kind == "decided":
            state = payload[1].state
            live = [
                s.id
                for s in state.steps
                if (a := s.current(Phase.COMPENSATION)) is not None
                and a.status.value in ("queued", "authorized", "unknown")
            ]
            in_flight.append(len(live))

    env.engine.hooks.append(watch)
    run = env.wait(run_id)
    assert run.summary == "failed, fully compensated"
    assert [name for name, _ in log] == ["undo-car", "undo-hotel", "undo-flight"]  # C1
    assert max(in_flight) == 1  # one at a time
    assert [u["step_id"] for u in run["unwind"]] == ["car", "hotel", "flight"]
    # C3: the recorded forward result and a stable operation id of its own
    car = log[0][1]
    assert car["result"] == {"car": "C3"} and car["phase"] == "compensation" and car["gen"] == 1
    car_forward_op = run.attempts("car")[0]["operation_id"]
    assert car["op"] == run.attempts("car", "compensation")[0]["operation_id"] != car_forward_op
    # C4: compensation has its own attempts and result
    assert run.step("car")["compensation"] == {
        "status": "compensated",
        "result": {"undone": "car"},
        "error": None,
        "omitted_result": None,
    }


@pytest.mark.rfd("C4")
def test_compensation_has_its_own_retry_policy_and_stable_operation_id() -> None:
    app = Ryusen("refunds")
    ops: list[tuple[str, int]] = []

    def refund(charge: Any) -> Any:
        op = ryusen.operation()
        ops.append((op.id, op.generation))
        if op.generation < 3:
            raise TimeoutError("bank timed out")
        return {"refunded": charge["id"]}

    @app.function("pay")
    def pay(data: Any, step: Step) -> Any:
        step.run(
            "charge",
            lambda: {"id": "ch_1"},
            compensate=refund,
            retry=RetryPolicy(max_attempts=1),
            compensate_retry=RetryPolicy(max_attempts=5, initial_delay=timedelta(seconds=10)),
        )
        raise RuntimeError("fraud check failed")

    run = WorkflowEnvironment(app).run("pay")
    assert run.recovery == "compensated"
    comp = run.attempts("charge", "compensation")
    assert [a["status"] for a in comp] == ["failed", "failed", "succeeded"]
    assert len({op for op, _ in ops}) == 1 and [g for _, g in ops] == [1, 2, 3]  # one operation id, three generations
    delay = datetime.fromisoformat(comp[1]["not_before"]) - datetime.fromisoformat(comp[1]["queued_at"])
    assert timedelta(seconds=5) <= delay <= timedelta(seconds=10)  # the compensate_retry policy, not forward's


@pytest.mark.rfd("C2", "C8")
def test_missing_compensator_is_a_durable_skip() -> None:
    log: list[tuple[str, Any]] = []
    env = WorkflowEnvironment(saga(log, compensators=False))
    run = env.run("trip")
    assert run.recovery == "compensated" and run.summary == "failed, fully compensated"
    assert [u["status"] for u in run["unwind"]] == ["skipped", "skipped", "skipped"]
    attempt = run.attempts("car", "compensation")[0]
    assert attempt["status"] == "succeeded" and attempt["detail"].startswith("target_not_found")
    assert log == []


@pytest.mark.rfd("C2", "C8")
def test_current_code_decides_the_compensator_and_committed_recovery_is_never_reopened() -> None:
    calls: Counter[str] = Counter()

    def build(with_compensator: bool, release: str) -> Ryusen:
        app = Ryusen("evolve", release_id=release, build_id=release)

        @app.function("wf")
        def wf(data: Any, step: Step) -> Any:
            step.run(
                "a",
                lambda: "A",
                compensate=(lambda r: calls.update([f"undo-a@{release}"])) if with_compensator else None,
            )
            step.run("b", lambda: "B", compensate=None)
            raise RuntimeError("later failure")

        return app

    # release 1 declares no compensator for "a" (presence bit false); release 2 adds one
    env = WorkflowEnvironment(build(False, "r1"))
    run_id = env.start("wf")
    env.drive(until=lambda: env.get(run_id).phase == "compensating")
    assert env.get(run_id).step("a")["has_compensation"] is False
    env.sync(build(True, "r2"))
    run = env.wait(run_id)
    assert calls == Counter({"undo-a@r2": 1})  # C8: current code decided; the bit is diagnostic only
    assert [u["status"] for u in run["unwind"]] == ["skipped", "compensated"]


def unwind_statuses(env: WorkflowEnvironment, run_id: str) -> list[tuple[str, str]]:
    return [(u["step_id"], u["status"]) for u in env.get(run_id)["unwind"]]


@pytest.mark.rfd("C7")
def test_a_release_landing_mid_unwind_never_reopens_a_committed_compensation() -> None:
    """Releases land while the unwind is under way: after a compensation success (c) and a durable skip (b)
    committed, one release blocks the next compensation (a) and another repairs it. The wake that the repair
    brings resumes the walk at ``a``: neither the success nor the skip is reopened, though the newest code
    now has a compensator for ``b`` and a different one for ``c``."""
    calls: Counter[str] = Counter()

    def build(release: str, *, compensate_b: bool = False, new_first_step: bool = False) -> Ryusen:
        app = Ryusen("evolve", release_id=release, build_id=release)

        def undo(name: str) -> Any:
            return lambda result: calls.update([f"undo-{name}@{release}"])

        @app.function("wf")
        def wf(data: Any, step: Step) -> Any:
            if new_first_step:  # a step current code reaches before the one whose compensation is due
                step.run("audit", lambda: "logged")
            step.run("a", lambda: "A", compensate=undo("a"))
            step.run("b", lambda: "B", compensate=undo("b") if compensate_b else None)
            step.run("c", lambda: "C", compensate=undo("c"))
            raise RuntimeError("later failure")

        return app

    env = WorkflowEnvironment(build("r1"))
    run_id = env.start("wf")
    env.drive(until=lambda: ("b", "skipped") in unwind_statuses(env, run_id))
    # committed by r1: c's compensation succeeded, b's was skipped (r1 declares no compensator for b)
    assert unwind_statuses(env, run_id) == [("c", "compensated"), ("b", "skipped"), ("a", "pending")]
    committed = {sid: env.get(run_id).attempts(sid, "compensation") for sid in ("b", "c")}
    assert calls == Counter({"undo-c@r1": 1})

    # a release lands mid-unwind; its code reaches a new step before "a": the unwind blocks at "a"
    env.sync(build("r2", new_first_step=True))
    run = env.wait(run_id)
    assert run.phase == "compensating" and [b["type"] for b in run.blockers] == ["new_step_before_target"]
    assert run.blockers[0]["step_id"] == "a"

    # the next release repairs it, and has compensators for every step: its sync wakes the blocked unwind
    env.sync(build("r3", compensate_b=True))
    run = env.wait(run_id)
    assert run.summary == "failed, fully compensated"
    assert unwind_statuses(env, run_id) == [("c", "compensated"), ("b", "skipped"), ("a", "compensated")]
    assert calls == Counter({"undo-c@r1": 1, "undo-a@r3": 1})  # b's and c's new compensators never ran
    for sid, attempts in committed.items():
        assert run.attempts(sid, "compensation") == attempts, f"{sid}'s committed compensation was reopened"
    assert run.step("b")["compensation"]["status"] == "skipped"
    assert run.step("c")["compensation"]["status"] == "compensated"


@pytest.mark.rfd("C7")
def test_a_release_landing_while_the_last_compensation_attempt_fails_does_not_reopen_the_failure() -> None:
    """The release lands while the compensation's last allowed attempt is running; the failure it reports
    commits, and neither that release nor a later one with a working compensator reopens it."""
    calls: Counter[str] = Counter()
    env: WorkflowEnvironment

    def build(release: str, *, refund_works: bool) -> Ryusen:
        app = Ryusen("evolve", release_id=release, build_id=release)

        def refund(result: Any) -> Any:
            calls.update([f"refund@{release}"])
            if not refund_works:
                if release == "r1":  # the deploy lands while this attempt is in flight
                    env.sync(build("r2", refund_works=True))
                raise OSError("refund API down")
            return "refunded"

        @app.function("wf")
        def wf(data: Any, step: Step) -> Any:
            step.run("charge", lambda: "ch_1", compensate=refund, compensate_retry=RetryPolicy(max_attempts=1))
            raise RuntimeError("later failure")

        return app

    env = WorkflowEnvironment(build("r1", refund_works=False))
    run = env.run("wf")
    assert calls == Counter({"refund@r1": 1})
    assert run.summary == "failed, partially compensated"
    assert unwind_statuses(env, run.id) == [("charge", "failed")]
    version = env.engine.get_run(run.id).version
    env.sync(build("r3", refund_works=True))
    env.drive()
    assert env.engine.get_run(run.id).version == version
    assert calls == Counter({"refund@r1": 1})
    assert env.get(run.id).step("charge")["compensation"]["status"] == "failed"


@pytest.mark.rfd("C6")
def test_exhausted_compensation_finishes_partially_compensated() -> None:
    app = Ryusen("partial")
    undone: list[str] = []

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        step.run("first", lambda: 1, compensate=lambda r: undone.append("first"))
        step.run("second", lambda: 2, compensate=lambda r: (_ for _ in ()).throw(OSError("refund API down")))
        step.run("third", lambda: 3, compensate=lambda r: undone.append("third"))
        raise RuntimeError("boom")

    env = WorkflowEnvironment(
        app,
        settings=EngineSettings(
            compensate_retry=EngineSettings().compensate_retry.model_copy(update={"max_attempts": 3})
        ),
    )
    run = env.run("wf")
    assert run.phase == "finished" and run.recovery == "partially_compensated"
    assert run.summary == "failed, partially compensated"
    assert [(u["step_id"], u["status"]) for u in run["unwind"]] == [
        ("third", "compensated"),
        ("second", "failed"),
        ("first", "not_reached"),
    ]
    assert undone == ["third"]
    assert len(run.attempts("second", "compensation")) == 3
    assert run.step("first")["compensation"]["status"] == "not_reached"


@pytest.mark.rfd("C9")
def test_failed_step_is_never_compensated_only_accepted_successes() -> None:
    app = Ryusen("only-success")
    undone: list[str] = []

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        step.run("ok", lambda: 1, compensate=lambda r: undone.append("ok"))
        step.run(
            "broken",
            lambda: 1 / 0,
            compensate=lambda r: undone.append("broken"),
            retry=RetryPolicy(max_attempts=2, initial_delay=timedelta(seconds=1)),
        )

    run = WorkflowEnvironment(app).run("wf")
    assert run.outcome == "failed"
    assert undone == ["ok"]
    assert [u["step_id"] for u in run["unwind"]] == ["ok"]


@pytest.mark.rfd("S10")
def test_an_empty_unwind_is_not_required_and_never_compensating_a_nonempty_one_compensates() -> None:
    app = Ryusen("empty")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        if data["steps"]:
            step.run("reserve", lambda: "r1", compensate=lambda r: None)
        raise ValueError("fails")

    env = WorkflowEnvironment(app)
    phases: dict[str, list[str]] = {}
    env.engine.hooks.append(
        lambda k, p: phases.setdefault(p[1].state.id, []).append(p[1].state.phase.value) if k == "decided" else None
    )
    empty = env.run("wf", {"steps": False})
    assert empty.recovery == "not_required" and empty.summary == "failed, compensation not required"
    assert empty["unwind"] == [] and "compensating" not in phases[empty.id]
    nonempty = env.run("wf", {"steps": True})
    assert nonempty.summary == "failed, fully compensated"
    assert [u["step_id"] for u in nonempty["unwind"]] == ["reserve"] and "compensating" in phases[nonempty.id]


@pytest.mark.rfd("C4")
def test_compensation_has_its_own_attempt_timeout() -> None:
    app = Ryusen("timeouts")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        step.run(
            "a",
            lambda: 1,
            compensate=lambda r: "undone",
            timeout=timedelta(seconds=5),
            compensate_timeout=timedelta(minutes=2),
        )
        raise RuntimeError("fail")

    run = WorkflowEnvironment(app).run("wf")
    forward, compensation = run.step("a")["attempts"]

    def window(a: dict[str, Any]) -> timedelta:
        expires = datetime.fromisoformat(a["lease_expires_at"]) - datetime.fromisoformat(a["authorized_at"])
        return expires - timedelta(seconds=EngineSettings().lease_grace_s)

    assert window(forward) == timedelta(seconds=5)
    assert window(compensation) == timedelta(minutes=2)


@pytest.mark.rfd("C4")
def test_a_compensator_without_compensate_timeout_has_the_servers_attempt_timeout_not_the_steps() -> None:
    """``timeout`` bounds the forward attempt only: the compensator's default is the server's attempt timeout."""
    app = Ryusen("timeouts")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        step.run("a", lambda: 1, compensate=lambda r: "undone", timeout=timedelta(seconds=5))
        raise RuntimeError("fail")

    settings = EngineSettings(attempt_timeout_s=42)
    run = WorkflowEnvironment(app, settings=settings).run("wf")
    forward, compensation = run.step("a")["attempts"]
    assert compensation["phase"] == "compensation" and compensation["status"] == "succeeded"

    def window(a: dict[str, Any]) -> timedelta:
        expires = datetime.fromisoformat(a["lease_expires_at"]) - datetime.fromisoformat(a["authorized_at"])
        return expires - timedelta(seconds=settings.lease_grace_s)

    assert window(forward) == timedelta(seconds=5)
    assert window(compensation) == timedelta(seconds=42)


@pytest.mark.rfd("C1")
def test_the_same_saga_on_the_dynamodb_store_in_moto() -> None:
    log: list[tuple[str, Any]] = []
    with WorkflowEnvironment(saga(log), store="moto") as env:
        run = env.run("trip")
        assert run.summary == "failed, fully compensated"
        assert [name for name, _ in log] == ["undo-car", "undo-hotel", "undo-flight"]
        assert env.counter.counts["dynamodb.write"] > 0 and "store.write" not in env.counter.counts

"""Decisions 16-20: what replay promises when the code around the steps misbehaves.

A callback that ran is always reported (16); a compensation pass that cannot
reach its target skips only when the step is gone from current code (17); two
steps open at once are refused (18); an Unknown never becomes a failure by
exhaustion (19); a large return value blocks instead of compensating (20).
Each test here failed on the engine before these decisions were implemented.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

from ryusen import AsyncStep, RetryPolicy, Ryusen, Step, StepFailed
from ryusen._internal.wire import TaskKind, TaskRequest
from ryusen.testing import WorkflowEnvironment
from ryusen_server.core.events import EngineSettings

# ---- decision 16: a callback that ran is always reported ----------------------------------


@pytest.mark.rfd("F2", "U1")
def test_a_finally_that_raises_after_the_callback_does_not_run_it_again() -> None:
    app = Ryusen("metrics")
    calls: Counter[str] = Counter()

    def charge() -> dict[str, str]:
        calls["charge"] += 1
        return {"id": "ch_1"}

    def emit_metric() -> None:
        calls["metric"] += 1
        if calls["metric"] == 2:  # the pass that ran the charge: the metrics endpoint times out once
            raise ConnectionError("metrics endpoint timed out")

    @app.function("pay")
    def pay(data: Any, step: Step) -> Any:
        try:
            charged = step.run("charge", charge)
        finally:
            emit_metric()
        return charged

    run = WorkflowEnvironment(app).run("pay")
    assert calls["charge"] == 1, "the charge ran again after its pass ended in an exception"
    assert run.outcome == "completed" and run.output == {"id": "ch_1"}
    assert [a["status"] for a in run.attempts("charge")] == ["succeeded"]


@pytest.mark.rfd("F2", "C2")
def test_code_that_swallows_the_suspension_and_returns_cannot_hide_a_callback_that_ran() -> None:
    app = Ryusen("swallow")
    calls: Counter[str] = Counter()

    def charge() -> str:
        calls["charge"] += 1
        return "charged"

    def refund(result: Any) -> str:
        calls["refund"] += 1
        return "refunded"

    @app.function("pay")
    def pay(data: Any, step: Step) -> Any:
        try:
            step.run("charge", charge, compensate=refund)
        except BaseException:  # noqa: BLE001 - the user code under test swallows everything
            return "gave up"
        if data["fail"]:
            raise RuntimeError("ledger rejected")
        return "done"

    env = WorkflowEnvironment(app)
    run = env.run("pay", {"fail": False})
    assert calls["charge"] == 1 and run.output == "done"
    failed = env.run("pay", {"fail": True})
    assert calls == Counter({"charge": 2, "refund": 1})  # one charge for each run, and its refund ran
    assert failed.summary == "failed, fully compensated"
    assert failed.step("charge")["compensation"]["status"] == "compensated"


# ---- decision 17: a compensation pass that cannot reach its target ------------------------


def trip_app(calls: Counter[str], *, config_fails_in_compensation: bool = False, insert: bool = False) -> Ryusen:
    """``calls["compensation passes"]`` is counted by the test's endpoint (see ``count_compensation_passes``)."""
    app = Ryusen("trip", release_id="insert" if insert else "base", build_id="insert" if insert else "base")

    def read_config() -> dict[str, Any]:
        calls["config"] += 1
        if config_fails_in_compensation and calls["compensation passes"] == 1:
            raise TimeoutError("config service timed out")
        return {"currency": "EUR"}

    def undo(name: str) -> Any:
        def compensate(result: Any) -> str:
            calls[f"undo-{name}"] += 1
            return f"undid {result}"

        return compensate

    @app.function("trip")
    def trip(data: Any, step: Step) -> Any:
        read_config()
        if insert:  # a new release adds a step before the others
            step.run("insurance", lambda: calls.update(["insurance"]) or "policy-1", compensate=undo("insurance"))
        step.run("flight", lambda: calls.update(["flight"]) or "F1", compensate=undo("flight"))
        step.run("hotel", lambda: calls.update(["hotel"]) or "H1", compensate=undo("hotel"))
        raise RuntimeError("payment revoked")

    return app


def count_compensation_passes(env: WorkflowEnvironment, app_id: str, calls: Counter[str]) -> None:
    endpoint = env.invoker.apps[f"inproc://{app_id}"]

    def counting(method: str, headers: dict[str, str], body: bytes) -> Any:
        if TaskRequest.model_validate_json(body).kind is TaskKind.COMPENSATE:
            calls["compensation passes"] += 1
        return endpoint(method, headers, body)

    env.invoker.apps[f"inproc://{app_id}"] = counting


@pytest.mark.rfd("C2", "C4")
def test_an_exception_outside_step_run_during_compensation_is_a_failed_attempt_not_a_skip() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(trip_app(calls, config_fails_in_compensation=True))
    count_compensation_passes(env, "trip", calls)  # the config service times out in the first one (hotel's)
    run = env.run("trip")
    assert calls["undo-hotel"] == 1 and calls["undo-flight"] == 1
    assert run.summary == "failed, fully compensated"
    attempts = run.attempts("hotel", "compensation")
    assert [a["status"] for a in attempts] == ["failed", "succeeded"]
    assert attempts[0]["error"]["type"] == "TimeoutError"
    assert run.step("hotel")["compensation"]["status"] == "compensated"


@pytest.mark.rfd("C2", "C6")
def test_compensation_passes_that_keep_failing_end_partially_compensated() -> None:
    app = Ryusen("flaky-config")
    calls: Counter[str] = Counter()

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        if calls["undo-a"] == 0 and calls["passes"] >= 3:
            raise TimeoutError("config service down")  # every pass after the run failed
        calls["passes"] += 1
        step.run("a", lambda: "A", compensate=lambda r: calls.update(["undo-a"]))
        raise RuntimeError("rejected")

    compensate = RetryPolicy(max_attempts=3, initial_delay=timedelta(seconds=1)).to_wire()
    run = WorkflowEnvironment(app, settings=EngineSettings(compensate_retry=compensate)).run("wf")
    assert run.summary == "failed, partially compensated"
    assert [a["status"] for a in run.attempts("a", "compensation")] == ["failed"] * 3
    assert run.step("a")["compensation"]["status"] == "failed" and calls["undo-a"] == 0


@pytest.mark.rfd("C2", "D1", "D2", "D5", "R1", "R3")
def test_a_release_that_adds_a_step_before_the_target_blocks_the_unwind_until_fixed() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(trip_app(calls))
    run_id = env.start("trip")
    env.drive(until=lambda: env.get(run_id).phase == "compensating")
    env.sync(trip_app(calls, insert=True))  # deployed while the unwind is under way
    run = env.wait(run_id)
    assert run.phase == "compensating" and run.outcome == "failed" and run.recovery == "compensating"
    [blocker] = run.blockers
    assert blocker["type"] == "new_step_before_target"
    assert blocker["step_id"] == "hotel" and blocker["phase"] == "compensation"
    assert blocker["first"]["step_id"] == "insurance" and blocker["first"]["location"].startswith(
        "test_replay_guarantees.py:"
    )
    assert blocker["second"]["step_id"] == "hotel" and blocker["second"]["location"]
    assert calls["undo-hotel"] == 0 and calls["insurance"] == 0  # nothing ran, nothing was skipped
    assert run.step("hotel")["compensation"]["status"] == "pending"
    assert "compensated" not in run.summary
    # a release that no longer adds it wakes the run, and every compensator runs
    env.sync(trip_app(calls))
    run = env.wait(run_id)
    assert run.summary == "failed, fully compensated"
    assert calls["undo-hotel"] == 1 and calls["undo-flight"] == 1


@pytest.mark.rfd("C2", "U3", "U5")
def test_an_operator_may_resolve_a_compensation_blocked_by_a_new_step() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(trip_app(calls))
    run_id = env.start("trip")
    env.drive(until=lambda: env.get(run_id).phase == "compensating")
    env.sync(trip_app(calls, insert=True))
    [blocker] = env.wait(run_id).blockers
    env.resolve(
        run_id, "hotel", phase="compensation", generation=blocker["generation"], action="succeed", result="by hand"
    )
    # repeating it is idempotent
    env.resolve(
        run_id, "hotel", phase="compensation", generation=blocker["generation"], action="succeed", result="by hand"
    )
    run = env.wait(run_id)
    assert run.step("hotel")["compensation"] == {
        "status": "compensated",
        "result": "by hand",
        "error": None,
        "omitted_result": None,
    }
    # the next target, flight, meets the same new step: blocked again rather than skipped
    assert run.blockers[0]["type"] == "new_step_before_target" and run.blockers[0]["step_id"] == "flight"
    env.sync(trip_app(calls))
    run = env.wait(run_id)
    assert run.summary == "failed, fully compensated" and calls["undo-hotel"] == 0 and calls["undo-flight"] == 1


@pytest.mark.rfd("C2", "C10")
def test_a_removed_step_is_skipped_only_once_the_release_retires_it() -> None:
    calls: Counter[str] = Counter()

    def build(*, removed: bool, retired: tuple[str, ...] = ()) -> Ryusen:
        app = Ryusen("removed", release_id=f"{removed}{retired}", build_id=f"{removed}{retired}")

        @app.function("wf", retired_steps=retired)
        def wf(data: Any, step: Step) -> Any:
            step.run("a", lambda: "A", compensate=lambda r: calls.update(["undo-a"]))
            try:
                step.run("b", lambda: 1 / 0, retry=RetryPolicy(max_attempts=1))
            except StepFailed:
                if removed:
                    return "handled"  # current code ends here: step c is gone
            step.run("c", lambda: "C", compensate=lambda r: calls.update(["undo-c"]))
            raise RuntimeError("rejected")

        return app

    env = WorkflowEnvironment(build(removed=False))
    run_id = env.start("wf")
    env.drive(until=lambda: env.get(run_id).phase == "compensating")
    env.sync(build(removed=True))
    run = env.wait(run_id)
    # a pass that ends before c proves nothing (decisions 24): the unwind waits, nothing is skipped
    assert run.phase == "compensating" and [b["type"] for b in run.blockers] == ["compensation_target_not_reached"]
    assert calls == Counter()
    env.sync(build(removed=True, retired=("c",)))  # the release says so: c is gone on purpose
    run = env.wait(run_id)
    assert run.summary == "failed, fully compensated"
    assert [(u["step_id"], u["status"]) for u in run["unwind"]] == [("c", "skipped"), ("a", "compensated")]
    assert calls == Counter({"undo-a": 1})
    assert run.attempts("c", "compensation")[-1]["detail"].startswith("retired by the release")


# ---- decision 18: one step at a time --------------------------------------------------------


@pytest.mark.rfd("D1", "D2", "D7")
def test_two_steps_at_once_from_threads_are_refused_with_a_definition_blocker() -> None:
    """Decision 18 stays for sync code that opens steps from threads (decision 30 lets an async function declare
    steps together): the refusal blocks the run, names both steps, and the probe only counts it again."""
    from concurrent.futures import ThreadPoolExecutor

    from ryusen import ConcurrentStepError

    app = Ryusen("parallel")
    calls: Counter[str] = Counter()
    seen: list[Any] = []
    both_open = threading.Barrier(2, timeout=5)

    def book(what: str) -> str:
        calls[what] += 1
        return f"{what}-booked"

    def open_step(what: str) -> Any:
        both_open.wait()
        try:
            return step_of[0].run(what, book, what, name=f"book {what}")
        except ConcurrentStepError as exc:
            seen.append(exc)
            raise

    step_of: list[Step] = []

    @app.function("trip")
    def trip(data: Any, step: Step) -> Any:
        step_of[:] = [step]
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(open_step, ["flight", "hotel"]))

    env = WorkflowEnvironment(app)
    run_id = env.start("trip")
    env.drive(max_transitions=200, stop_when_blocked=run_id)
    run = env.get(run_id)
    assert calls == Counter(), "a callback ran although two steps were open at once"
    assert run.phase == "running" and run.outcome is None
    [blocker] = run.blockers
    assert blocker["type"] == "concurrent_step"
    assert blocker["second"]["step_id"] in ("flight", "hotel") and blocker["second"]["location"]
    assert blocker["second"]["step_id"] in blocker["message"]
    assert seen, "the thread's step.run was not refused"
    # the probe finds the same conflict: diagnostics only, nothing runs (D7)
    env.advance(timedelta(minutes=2))
    env.drive(max_transitions=50, stop_when_blocked=run_id)
    assert env.get(run_id).blockers[0]["count"] >= 2 and calls == Counter()


@pytest.mark.rfd("F2", "R1")
def test_a_release_that_starts_two_steps_at_once_mid_attempt_reports_the_running_callback_once() -> None:
    calls: Counter[str] = Counter()

    async def book(what: str) -> str:
        calls[what] += 1
        await asyncio.sleep(0)  # the callback is still running when the second step.run starts
        return f"{what}-booked"

    def build(*, gather: bool) -> Ryusen:
        app = Ryusen("parallel-later", release_id=str(gather), build_id=str(gather))

        @app.function("trip")
        async def trip(data: Any, step: AsyncStep) -> Any:
            if gather:
                return list(await asyncio.gather(step.run("flight", book, "flight"), step.run("hotel", book, "hotel")))
            return [await step.run("flight", book, "flight"), await step.run("hotel", book, "hotel")]

        return app

    env = WorkflowEnvironment(build(gather=False))
    run_id = env.start("trip")
    env.drive(until=lambda: any(t.kind.value == "forward" for t in env.pending_tasks()))
    env.sync(build(gather=True))  # deployed between discovery and the flight attempt
    run = env.wait(run_id)
    assert calls == Counter({"flight": 1, "hotel": 1})
    assert [a["status"] for a in run.attempts("flight")] == ["succeeded"]
    assert run.outcome == "completed" and run.output == ["flight-booked", "hotel-booked"]

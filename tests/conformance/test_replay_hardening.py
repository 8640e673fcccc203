"""Decisions 16-20 under attack: what an adversarial review of their first implementation found.

Each test reproduces one finding (F1-F13 of that review) and failed before its fix: an Unknown
converted to a failure and then fenced by a stop, a compensator skipped on a transient early
return, TaskGroups and threads that ran callbacks twice or crashed the handler, values that cannot
be reported, and retry loops with no delay or no end.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

from ryusen import AsyncStep, RetryPolicy, Ryusen, Step, StepFailed
from ryusen.testing import WorkflowEnvironment


def settled(env: WorkflowEnvironment, run_id: str, step_id: str, generation: int = 1) -> bool:
    step = env.engine.store.get(run_id).step(step_id)  # type: ignore[union-attr]
    attempt = step.attempt(step.attempts[0].phase, generation) if step else None
    return attempt is not None and attempt.status.value not in ("queued", "authorized")


# ---- F1: an Unknown converted to a retry, then a stop fences the retry -------------------------


@pytest.mark.rfd("S8", "S9", "U2", "U10")
def test_a_stop_during_an_unknown_retry_backoff_keeps_the_first_attempt_unknown() -> None:
    calls: Counter[str] = Counter()
    app = Ryusen("pay")

    @app.function("pay")
    def pay(data: Any, step: Step) -> Any:
        step.run(
            "charge",
            lambda: calls.update(["charge"]) or {"charge_id": "ch_1"},
            compensate=lambda r: calls.update(["refund"]) or "refunded",
            retry=RetryPolicy(max_attempts=3, on_unknown="retry", initial_delay=timedelta(seconds=30)),
        )
        return "paid"

    env = WorkflowEnvironment(app)
    env.faults.lose_result("charge")  # the charge ran; its response was lost
    run_id = env.start("pay")
    env.drive(until=lambda: settled(env, run_id, "charge"), horizon=timedelta(seconds=10))
    env.cancel(run_id)  # during the retry's backoff: the retry will never run
    run = env.wait(run_id)
    assert run.phase == "settling" and [b["type"] for b in run.blockers] == ["unknown_outcome"]
    assert [a["status"] for a in run.attempts("charge")] == ["unknown"]
    env.deliver_late_result(run_id, "charge", generation=1)  # the lost success arrives
    run = env.wait(run_id)
    assert run.summary == "cancelled, fully compensated"
    assert calls == Counter({"charge": 1, "refund": 1})


@pytest.mark.rfd("U2", "U10")
def test_a_late_result_during_an_unknown_retry_backoff_saves_the_retry() -> None:
    calls: Counter[str] = Counter()
    app = Ryusen("lookup")

    @app.function("quote")
    def quote(data: Any, step: Step) -> Any:
        return step.run(
            "rate",
            lambda: calls.update(["rate"]) or 1.08,
            retry=RetryPolicy(max_attempts=3, on_unknown="retry", initial_delay=timedelta(seconds=30)),
        )

    env = WorkflowEnvironment(app)
    env.faults.lose_result("rate")
    run_id = env.start("quote")
    env.drive(until=lambda: settled(env, run_id, "rate"), horizon=timedelta(seconds=10))
    env.deliver_late_result(run_id, "rate", generation=1)
    run = env.wait(run_id)
    assert run.output == 1.08 and calls["rate"] == 1
    assert [a["status"] for a in run.attempts("rate")] == ["succeeded"]


# ---- F2: a transient early return, with the same code that recorded the step --------------------


@pytest.mark.rfd("C2", "C10")
def test_an_early_return_in_a_compensation_pass_of_the_same_code_blocks_until_a_pass_reaches_the_step() -> None:
    calls: Counter[str] = Counter()
    app = Ryusen("shop")

    class ConfigUnavailable(Exception):
        pass

    def read_config() -> dict[str, str]:
        calls["config"] += 1
        if calls["config"] == 4:  # the config service blips once, in the compensation pass
            raise ConfigUnavailable("503 from config service")
        return {"currency": "EUR"}

    @app.function("checkout")
    def checkout(order: Any, step: Step) -> Any:
        try:
            read_config()
        except ConfigUnavailable:
            return {"status": "retry later"}  # graceful degradation: returns without reaching the step
        step.run("charge", lambda: {"charge_id": "ch_1"}, compensate=lambda r: calls.update(["refund"]))
        raise RuntimeError("warehouse rejected the order")

    env = WorkflowEnvironment(app)
    run = env.run("checkout")
    assert calls["refund"] == 0 and run.phase == "compensating"  # blocked, not skipped, not failed
    assert [b["type"] for b in run.blockers] == ["compensation_target_not_reached"]
    env.advance(timedelta(minutes=2))  # the probe asks current code again; the config service is back
    run = env.wait(run.id)
    assert calls["refund"] == 1 and run.summary == "failed, fully compensated"
    compensation = run.attempts("charge", "compensation")
    assert [a["status"] for a in compensation] == ["fenced", "succeeded"]
    assert compensation[0]["detail"].startswith("compensation_target_not_reached")


# ---- F3: asyncio.TaskGroup ----------------------------------------------------------------------


@pytest.mark.rfd("F2")
def test_steps_inside_a_task_group() -> None:
    calls: Counter[str] = Counter()
    app = Ryusen("tg")

    async def fetch(what: str) -> str:
        calls[what] += 1
        return f"{what}-ok"

    @app.function("one")
    async def one(data: Any, step: AsyncStep) -> Any:
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(step.run("fetch", fetch, "fetch"))
        return task.result()

    @app.function("two")
    async def two(data: Any, step: AsyncStep) -> Any:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(step.run("a", fetch, "a"))
            tg.create_task(step.run("b", fetch, "b"))
        return "both"

    env = WorkflowEnvironment(app)
    assert env.run("one").output == "fetch-ok" and calls == Counter({"fetch": 1})
    both = env.run("two")  # declared together (decision 30): each runs once, and the function goes on
    assert both.output == "both" and calls == Counter({"fetch": 1, "a": 1, "b": 1})


# ---- F4: threads ----------------------------------------------------------------------------------


@pytest.mark.rfd("F2")
def test_a_step_run_from_a_thread_after_the_task_answered_runs_nothing() -> None:
    """A stray thread of an earlier pass reaches ``step.run`` after that pass's task answered: nothing runs
    (a thread's step is refused anyway, decisions 18; this one comes after the pass closed)."""
    calls: Counter[str] = Counter()
    app = Ryusen("late-thread")
    release_stray = threading.Event()

    def stray(step: Step) -> None:
        release_stray.wait(30)
        try:
            step.run("charge", lambda: calls.update(["charge from the stray thread"]) or "ch_x")
        except BaseException:  # noqa: BLE001 - the pass has ended: whatever it raises, nothing ran
            calls["stray refused"] += 1
        finally:
            calls["stray returned"] += 1

    threads: list[threading.Thread] = []

    @app.function("pay")
    def pay(data: Any, step: Step) -> Any:
        calls["passes"] += 1
        if calls["passes"] == 1:  # the discovery pass leaves a thread behind
            threads.append(threading.Thread(target=stray, args=(step,)))
            threads[0].start()
        return step.run("charge", lambda: calls.update(["charge"]) or "ch_1")

    env = WorkflowEnvironment(app)
    run = env.run("pay")
    assert run.outcome == "completed" and run.output == "ch_1" and calls["charge"] == 1
    release_stray.set()  # the stray thread reaches step.run long after its pass answered
    threads[0].join(30)
    assert calls["stray returned"] == 1 and calls["stray refused"] == 1
    assert calls["charge from the stray thread"] == 0, "a callback ran in a pass whose task had answered"
    assert [a["status"] for a in env.get(run.id).attempts("charge")] == ["succeeded"]


# ---- F5: the compensation target's id duplicated by a new release ------------------------------


@pytest.mark.rfd("C2", "D1")
def test_a_duplicated_target_id_in_a_compensation_pass_blocks_instead_of_skipping() -> None:
    calls: Counter[str] = Counter()

    def build(v2: bool) -> Ryusen:
        app = Ryusen("shop", release_id=f"v{2 if v2 else 1}", build_id=f"b{2 if v2 else 1}")

        @app.function("checkout")
        def checkout(order: Any, step: Step) -> Any:
            if v2:
                step.run("charge", lambda: "card ok")  # a new pre-check, its id copy-pasted
            step.run("charge", lambda: "ch_1", compensate=lambda r: calls.update(["refund"]))
            raise RuntimeError("fraud check failed")

        return app

    env = WorkflowEnvironment(build(False))
    run_id = env.start("checkout")
    env.drive(until=lambda: env.get(run_id).phase == "compensating")
    env.sync(build(True))
    run = env.wait(run_id)
    assert [b["type"] for b in run.blockers] == ["duplicate_step_id"] and calls["refund"] == 0
    assert run.step("charge")["compensation"]["status"] == "pending"


# ---- F6: BaseException from user code -------------------------------------------------------------


@pytest.mark.rfd("F2", "U1")
def test_a_system_exit_in_a_finally_after_the_callback_still_reports_it() -> None:
    calls: Counter[str] = Counter()
    app = Ryusen("exit")

    @app.function("pay")
    def pay(data: Any, step: Step) -> Any:
        try:
            return step.run("charge", lambda: calls.update(["charge"]) or "ch_1")
        finally:
            calls["passes"] += 1
            if calls["passes"] == 2:  # the pass that ran the charge
                sys.exit("worker shutting down")

    run = WorkflowEnvironment(app).run("pay")
    assert run.outcome == "completed" and calls["charge"] == 1
    assert [a["status"] for a in run.attempts("charge")] == ["succeeded"]


@pytest.mark.rfd("F7")
def test_a_custom_base_exception_escaping_the_function_fails_it() -> None:
    app = Ryusen("bail")

    class Bail(BaseException):
        pass

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        step.run("charge", lambda: "ok", compensate=lambda r: None)
        raise Bail("give up")

    run = WorkflowEnvironment(app).run("wf")
    assert run.summary == "failed, fully compensated" and run.error["type"] == "Bail"


# ---- F7: recorded errors replayed in every task -----------------------------------------------------


@pytest.mark.rfd("F5", "F6", "F12")
def test_many_large_terminal_errors_keep_the_replay_within_its_limits() -> None:
    app = Ryusen("poller")
    calls: Counter[str] = Counter()

    def check(i: int) -> None:
        calls["check"] += 1
        raise RuntimeError(f"upstream said: {'<html>' + 'x' * 240_000}")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        for i in range(40):
            try:
                return step.run(f"check-{i}", check, i, retry=RetryPolicy(max_attempts=1))
            except StepFailed:
                continue
        return "gave up"

    env = WorkflowEnvironment(app)
    run = env.wait(env.start("wf"), max_transitions=2000)
    assert run.outcome == "completed" and run.output == "gave up" and calls["check"] == 40


@pytest.mark.rfd("O1")
def test_an_endpoint_that_keeps_failing_a_task_is_shown_as_a_blocker() -> None:
    app = Ryusen("down")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        return step.run("charge", lambda: "ok")

    env = WorkflowEnvironment(app)
    env.faults.unreachable("charge", phase="forward", times=12)
    run_id = env.start("wf")
    env.drive(until=lambda: bool(env.get(run_id).blockers))
    [blocker] = env.get(run_id).blockers
    assert blocker["type"] == "endpoint_failing" and "connection refused" in blocker["detail"]
    run = env.wait(run_id)  # the retries go on, and once the endpoint answers the run completes
    assert run.outcome == "completed" and run.blockers == []


# ---- F8: very long outages ---------------------------------------------------------------------------


@pytest.mark.rfd("U1")
def test_an_endpoint_refusing_connections_for_a_day_never_makes_an_attempt_unknown() -> None:
    app = Ryusen("outage")
    calls: Counter[str] = Counter()

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        return step.run("charge", lambda: calls.update(["charge"]) or "ok")

    env = WorkflowEnvironment(app)
    env.faults.unreachable("charge", phase="forward", times=1100)
    run = env.wait(env.start("wf"), max_transitions=20_000)
    assert run.outcome == "completed" and calls["charge"] == 1
    assert [a["status"] for a in run.attempts("charge")] == ["succeeded"]


# ---- F9, F11, F13: values and errors that cannot be reported as they are -------------------------------


@pytest.mark.rfd("F12", "C9")
def test_a_lone_surrogate_or_a_non_json_value_is_a_clear_failure_or_a_blocker_never_unknown() -> None:
    calls: Counter[str] = Counter()
    name = os.fsdecode(b"report-\xff.csv")  # 'report-\udcff.csv'
    app = Ryusen("values")

    @app.function("result")
    def result(data: Any, step: Step) -> Any:
        try:
            return step.run("list", lambda: calls.update(["list"]) or name)
        except StepFailed as failure:
            return failure.error_type

    @app.function("output")
    def output(data: Any, step: Step) -> Any:
        step.run("charge", lambda: "ch_1", compensate=lambda r: calls.update(["refund"]))
        return {"file": name} if data == "surrogate" else {"at": dt.datetime(2030, 1, 1)}

    env = WorkflowEnvironment(app)
    assert env.run("result").output == "not_json_serializable" and calls["list"] == 1
    for value in ("surrogate", "datetime"):
        run = env.run("output", value)
        assert run.outcome is None and [b["type"] for b in run.blockers] == ["output_not_json"], value
    assert calls["refund"] == 0


@pytest.mark.rfd("F4", "F12")
def test_a_callback_failure_that_cannot_be_printed_or_a_result_too_deep_is_a_failed_attempt() -> None:
    app = Ryusen("odd")

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("str() of this error is broken")

    def deep() -> Any:
        value: Any = []
        for _ in range(200_000):
            value = [value]
        return value

    def unprintable() -> None:
        raise Unprintable()

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        try:
            step.run("s", unprintable if data == "unprintable" else deep, retry=RetryPolicy(max_attempts=1))
        except StepFailed as failure:
            return failure.error_type

    env = WorkflowEnvironment(app)
    assert env.run("wf", "unprintable").output == "Unprintable"
    assert env.run("wf", "deep").output == "not_json_serializable"


# ---- F10: an endpoint whose revisions disagree ---------------------------------------------------------


def test_target_not_found_again_and_again_backs_off() -> None:
    import itertools

    def build(v: str) -> Ryusen:
        app = Ryusen("shop", release_id=v, build_id=v)

        @app.function("pay")
        def pay(data: Any, step: Step) -> Any:
            return step.run(f"charge-{v}", lambda: v)

        return app

    old, new = build("v1"), build("v2")
    env = WorkflowEnvironment(old)
    turn = itertools.cycle([old, new])  # an endpoint alternating between two revisions during a rollout
    env.invoker.apps["inproc://shop"] = lambda m, h, b: env.endpoint(next(turn))(m, h, b)
    # each task to the next revision: without the memo cache, whose misses take a second request
    env.engine.sent_memos.capacity = 0
    env.start("pay")
    start = env.clock.now
    with pytest.raises(RuntimeError, match="did not settle"):
        env.drive(max_transitions=200)
    assert env.clock.now - start > timedelta(minutes=5), "a hot loop: no delay between passes"


# ---- F12: step declarations the server cannot record ---------------------------------------------------


@pytest.mark.rfd("D2", "C9")
def test_a_step_declaration_the_server_cannot_record_blocks_and_compensates_nothing() -> None:
    calls: Counter[str] = Counter()
    app = Ryusen("decl")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        step.run("charge", lambda: "ch", compensate=lambda r: calls.update(["refund"]))
        if data == "long-id":
            step.run("order-" + "x" * 294, lambda: None)
        else:
            step.run("poll", lambda: None, timeout=timedelta(seconds=-1))
        return "ok"

    env = WorkflowEnvironment(app)
    for case in ("long-id", "negative-timeout"):
        run = env.run("wf", case)
        assert run.outcome is None and [b["type"] for b in run.blockers] == ["invalid_step"], case
        assert "256" in run.blockers[0]["message"] or "positive" in run.blockers[0]["message"]
    assert calls["refund"] == 0
    with pytest.raises(ValueError, match="1000"):
        RetryPolicy(max_attempts=5000)


@pytest.mark.rfd("F12", "D5")
def test_a_step_timeout_over_the_deployments_maximum_attempt_duration_is_refused_never_clamped() -> None:
    from ryusen_server.core.events import EngineSettings

    calls: Counter[str] = Counter()

    def build(minutes: int) -> Ryusen:
        app = Ryusen("long", release_id=f"r{minutes}", build_id=f"b{minutes}")

        @app.function("wf")
        def wf(data: Any, step: Step) -> Any:
            return step.run("report", lambda: calls.update(["report"]) or "ok", timeout=timedelta(minutes=minutes))

        return app

    env = WorkflowEnvironment(build(20), settings=EngineSettings(max_attempt_timeout_s=840))
    run_id = env.start("wf")
    [blocker] = env.wait(run_id).blockers
    assert blocker["type"] == "invalid_step" and blocker["step_id"] == "report"
    assert "1200" in blocker["message"] and "840" in blocker["message"] and calls["report"] == 0
    env.sync(build(10))
    assert env.wait(run_id).outcome == "completed" and calls["report"] == 1


# ---- a second review ------------------------------------------------------------------------------


@pytest.mark.rfd("D6", "D7", "C2")
def test_a_blocked_unwind_is_probed_less_and_less_often_and_counts_the_conflict() -> None:
    def build(v2: bool) -> Ryusen:
        app = Ryusen("shop", release_id=f"v{int(v2)}", build_id=f"b{int(v2)}")

        @app.function("checkout")
        def checkout(order: Any, step: Step) -> Any:
            if v2:
                step.run("fraud-check", lambda: "ok")
            step.run("charge", lambda: "ch_1", compensate=lambda r: None)
            raise RuntimeError("warehouse rejected the order")

        return app

    env = WorkflowEnvironment(build(False))
    run_id = env.start("checkout")
    env.drive(until=lambda: env.get(run_id).phase == "compensating")
    env.sync(build(True))
    start = env.clock.now
    env.drive(until=lambda: env.clock.now >= start + timedelta(hours=12), horizon=timedelta(hours=12))
    state = env.engine.get_run(run_id)
    [blocker] = state.blockers
    assert blocker.count >= 5 and state.probe_interval_s == 3600  # doubled up to the hourly cap
    assert len(state.step("charge").attempts) < 30  # one pass per probe, not one a minute


@pytest.mark.rfd("C2", "C10")
def test_a_retired_step_whose_pass_ends_with_a_wrapped_recorded_failure_is_skipped() -> None:
    calls: Counter[str] = Counter()

    class ShippingError(Exception):
        pass

    def ship() -> None:
        from ryusen import NonRetryableError

        raise NonRetryableError("no courier")

    def build(v2: bool) -> Ryusen:
        app = Ryusen("shop", release_id=f"v{int(v2)}", build_id=f"b{int(v2)}")

        @app.function("checkout", retired_steps=("charge",) if v2 else ())
        def checkout(order: Any, step: Step) -> Any:
            step.run("reserve", lambda: "r1", compensate=lambda r: calls.update(["release"]))
            if not v2:  # v2 moved payment out of this workflow
                step.run("charge", lambda: "ch_1", compensate=lambda r: calls.update(["refund"]))
            try:
                step.run("ship", ship)
            except StepFailed as failure:
                raise ShippingError("could not ship the order") from failure
            return "ok"

        return app

    env = WorkflowEnvironment(build(False))
    run_id = env.start("checkout")
    env.drive(until=lambda: env.get(run_id).outcome is not None)
    env.sync(build(True))
    run = env.wait(run_id)
    assert run.summary == "failed, fully compensated" and calls == Counter({"release": 1})
    assert [(u["step_id"], u["status"]) for u in run["unwind"]] == [("charge", "skipped"), ("reserve", "compensated")]


@pytest.mark.rfd("C2", "C10")
def test_an_early_return_after_an_unrelated_redeploy_blocks_instead_of_skipping() -> None:
    calls: Counter[str] = Counter()
    blip = {"once": False}

    def build(n: int) -> Ryusen:
        app = Ryusen("shop", release_id=f"r{n}", build_id=f"b{n}")

        @app.function("checkout")
        def checkout(order: Any, step: Step) -> Any:
            if blip["once"]:
                blip["once"] = False
                return {"status": "config unavailable, retry later"}  # a transient early return
            step.run("charge", lambda: "ch_1", compensate=lambda r: calls.update(["refund"]))
            raise RuntimeError("warehouse rejected the order")

        return app

    env = WorkflowEnvironment(build(1))
    run_id = env.start("checkout")
    env.drive(until=lambda: env.get(run_id).phase == "compensating")
    env.sync(build(2))  # any unrelated deploy gives a new build id
    blip["once"] = True
    run = env.wait(run_id)
    assert calls["refund"] == 0 and [b["type"] for b in run.blockers] == ["compensation_target_not_reached"]
    env.advance(timedelta(minutes=2))  # the probe
    run = env.wait(run_id)
    assert calls["refund"] == 1 and run.summary == "failed, fully compensated"
    statuses = [a["status"] for a in run.attempts("charge", "compensation")]
    assert statuses == ["fenced", "succeeded"]


@pytest.mark.rfd("F2")
def test_a_callback_that_finishes_just_as_the_function_gives_up_on_it_is_reported() -> None:
    """The function stops waiting for its callback (a step is started from its own thread only, decisions 18:
    here an async function's timeout around a plain callback, which runs on a worker thread to its end)."""
    tally: Counter[str] = Counter()
    for i in range(8):
        app = Ryusen(f"thr{i}")

        def charge() -> dict[str, Any]:
            time.sleep(0.1)
            return {"receipt": list(range(20_000))}  # checking the result takes a while

        @app.function("pay")
        async def pay(data: Any, step: AsyncStep) -> Any:
            try:
                return await asyncio.wait_for(step.run("charge", charge), timeout=0.02)
            except TimeoutError:
                raise RuntimeError("charge took too long") from None

        run = WorkflowEnvironment(app).run("pay")
        tally[run.attempts("charge")[0]["status"]] += 1
    assert tally == Counter({"succeeded": 8})


@pytest.mark.rfd("F2")
def test_steps_gathered_inside_a_callback_are_refused_not_hung() -> None:
    from ryusen import ConcurrentStepError

    app = Ryusen("nest")
    seen: list[str] = []

    @app.function("wf")
    async def wf(data: Any, step: AsyncStep) -> Any:
        async def outer() -> int:
            try:
                a, b = await asyncio.gather(step.run("x", lambda: 1), step.run("y", lambda: 2))
            except ConcurrentStepError as exc:
                seen.append(exc.step_id)
                return -1
            return a + b

        return await step.run("outer", outer)

    run = WorkflowEnvironment(app).run("wf")
    assert run.output == -1 and seen


def test_a_sync_workflow_served_by_asgi_runs_off_the_event_loop() -> None:
    app = Ryusen("asgi-sync", insecure=True)  # called directly, unsigned

    def fetch_rate() -> float:
        async def call() -> float:
            return 1.08

        return asyncio.run(call())  # a sync callback that runs its own event loop

    @app.function("quote")
    def quote(data: Any, step: Step) -> Any:
        return step.run("rate", fetch_rate)

    from ryusen._internal.wire import OperationInfo, Phase, TaskKind, TaskRequest

    request = TaskRequest(
        kind=TaskKind.FORWARD,
        run_id="r",
        function_id="quote",
        step_id="rate",
        operation=OperationInfo(id="op", phase=Phase.FORWARD, generation=1),
    )
    response = asyncio.run(app.handle_async("POST", {}, request.model_dump_json().encode()))
    assert '"succeeded"' in response.body.decode() and "1.08" in response.body.decode()


@pytest.mark.rfd("F7")
def test_a_system_exit_from_user_code_is_the_functions_failure() -> None:
    app = Ryusen("argparse")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        step.run("charge", lambda: "ok", compensate=lambda r: None)
        raise SystemExit(2)  # argparse, on bad arguments

    run = WorkflowEnvironment(app).run("wf")
    assert run.summary == "failed, fully compensated" and run.error["type"] == "SystemExit"

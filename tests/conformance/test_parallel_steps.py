"""Steps declared together (decision 30). In an async function, ``step.run`` returns an awaitable; the steps whose
awaitables exist before the function awaits any of them (``asyncio.gather``, a task group, a comprehension) are
reported together and run at once, at most ``max_parallel`` in flight, the rest in declaration order. Each one
settles, retries and goes Unknown on its own; a failure is raised at its own await once its siblings have
settled; the unwind stays reverse completion order, one at a time; a stop starts no new sibling."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import pytest

import ryusen
from ryusen import AsyncStep, NonRetryableError, RetryPolicy, Ryusen, Step, StepFailed
from ryusen.testing import WorkflowEnvironment


def tokens_by_step(tokens: dict[str, str]) -> Any:
    """A callback that hands out its completion token under its step's name (an approval request, say)."""

    def ask(name: str) -> str:
        token = ryusen.operation().completion_token
        assert token is not None
        tokens[name] = token
        return "asked"

    return ask


# ---- P1 -------------------------------------------------------------------------------------------------


@pytest.mark.rfd("P1")
def test_steps_declared_together_take_the_time_of_the_slowest_not_the_sum() -> None:
    app = Ryusen("trip")

    @app.function("trip")
    async def trip(data: Any, step: AsyncStep) -> Any:
        await asyncio.gather(
            step.sleep("flight", timedelta(hours=3)),
            step.sleep("hotel", timedelta(hours=1)),
            step.sleep("car", timedelta(hours=2)),
        )
        return "booked"

    env = WorkflowEnvironment(app)
    run = env.run("trip")
    assert run.outcome == "completed" and run.output == "booked"
    took = datetime.fromisoformat(run["finished_at"]) - datetime.fromisoformat(run["created_at"])
    assert timedelta(hours=3) <= took < timedelta(hours=4), took  # the slowest (3 h), not the sum (6 h)


@pytest.mark.rfd("P1")
def test_every_sibling_is_in_flight_before_any_settles_and_each_runs_once() -> None:
    tokens: dict[str, str] = {}
    calls: Counter[str] = Counter()
    app = Ryusen("approvals")
    ask = tokens_by_step(tokens)

    @app.function("sign-off")
    async def sign_off(data: Any, step: AsyncStep) -> Any:
        decisions = await asyncio.gather(
            *(step.run(who, ask, who, completion="external", timeout=timedelta(days=1)) for who in data)
        )
        calls["after"] += 1
        return dict(zip(data, decisions, strict=True))

    env = WorkflowEnvironment(app)
    run_id = env.start("sign-off", ["legal", "finance", "cto"])
    env.drive(until=lambda: len(tokens) == 3)
    view = env.get(run_id)
    assert [s["attempts"][-1]["status"] for s in view.steps] == ["waiting"] * 3  # all three at once
    assert calls["after"] == 0
    for who in ("cto", "legal", "finance"):  # in any order
        env.complete(tokens[who], {"ok": who})
    run = env.wait(run_id)
    assert run.output == {"legal": {"ok": "legal"}, "finance": {"ok": "finance"}, "cto": {"ok": "cto"}}
    assert [len(s["attempts"]) for s in run.steps] == [1, 1, 1]


def test_a_sync_function_declares_steps_together_with_step_parallel() -> None:
    app = Ryusen("sync")
    calls: Counter[str] = Counter()

    def book(what: str) -> str:
        calls[what] += 1
        return f"{what}-ok"

    @app.function("trip")
    def trip(data: Any, step: Step) -> Any:
        booked = step.parallel(
            lambda: step.run("flight", book, "flight"),
            lambda: step.run("hotel", book, "hotel"),
            lambda: step.sleep("settle", timedelta(minutes=5)),
        )
        return [*booked, step.run("confirm", book, "confirm")]

    env = WorkflowEnvironment(app)
    run = env.run("trip")
    assert run.outcome == "completed" and run.output == ["flight-ok", "hotel-ok", None, "confirm-ok"]
    assert calls == Counter({"flight": 1, "hotel": 1, "confirm": 1})
    [first] = [s for s in run.steps if s["id"] == "flight"]
    [hotel] = [s for s in run.steps if s["id"] == "hotel"]
    assert first["group"] == hotel["group"] is not None  # reported together by one pass


def test_step_parallel_refuses_a_callable_that_runs_no_step() -> None:
    app = Ryusen("sync")

    @app.function("wrong")
    def wrong(data: Any, step: Step) -> Any:
        return step.parallel(lambda: step.run("a", lambda: 1), lambda: 2)

    run = WorkflowEnvironment(app).run("wrong")
    assert run.outcome == "failed" and run.error is not None
    assert "must call step.run" in run.error["message"]


# ---- P2 -------------------------------------------------------------------------------------------------


@pytest.mark.rfd("P2")
def test_max_parallel_bounds_the_siblings_in_flight_and_the_rest_start_in_declaration_order() -> None:
    tokens: dict[str, str] = {}
    app = Ryusen("bounded")
    ask = tokens_by_step(tokens)
    names = [f"s{i}" for i in range(5)]

    @app.function("fan", max_parallel=2)
    async def fan(data: Any, step: AsyncStep) -> Any:
        return await asyncio.gather(*(step.run(n, ask, n, completion="external") for n in names))

    env = WorkflowEnvironment(app)
    run_id = env.start("fan")
    env.drive(until=lambda: len(tokens) == 2)
    env.drive(horizon=timedelta(minutes=1))
    assert sorted(tokens) == ["s0", "s1"]  # two in flight; the other three have not started
    view = env.get(run_id)
    assert [len(s["attempts"]) for s in view.steps] == [1, 1, 0, 0, 0]
    env.complete(tokens["s1"], 1)
    env.drive(until=lambda: len(tokens) == 3)
    assert "s2" in tokens and "s3" not in tokens  # the next in declaration order
    env.complete(tokens["s0"], 0)
    env.drive(until=lambda: len(tokens) == 4)
    assert "s3" in tokens
    for n in ("s2", "s3"):
        env.complete(tokens[n], int(n[1]))
    env.drive(until=lambda: len(tokens) == 5)
    env.complete(tokens["s4"], 4)
    run = env.wait(run_id)
    assert run.outcome == "completed" and run.output == [0, 1, 2, 3, 4]


def test_max_parallel_must_be_a_whole_number_in_range() -> None:
    app = Ryusen("bad")
    for bad in (0, 101, 2.5, True):
        with pytest.raises(ryusen.DefinitionError):
            app.function(f"f{bad}", max_parallel=bad)  # type: ignore[arg-type]


# ---- P3 -------------------------------------------------------------------------------------------------


@pytest.mark.rfd("P3")
def test_a_sibling_failure_surfaces_at_its_await_after_the_others_settle_and_they_are_undone_in_reverse() -> None:
    tokens: dict[str, str] = {}
    undone: list[str] = []
    seen: list[str] = []
    app = Ryusen("trip")
    ask = tokens_by_step(tokens)

    def cancel(result: Any) -> None:
        undone.append(result["kind"])

    @app.function("trip")
    async def trip(data: Any, step: AsyncStep) -> Any:
        try:
            await asyncio.gather(
                *(
                    step.run(k, ask, k, completion="external", compensate=cancel, retry=RetryPolicy(max_attempts=1))
                    for k in ("flight", "hotel", "car")
                )
            )
        except StepFailed as failed:
            seen.append(failed.step_id)
            raise
        return "booked"

    env = WorkflowEnvironment(app)
    run_id = env.start("trip")
    env.drive(until=lambda: len(tokens) == 3)
    env.complete(tokens["hotel"], error={"type": "SoldOut", "message": "no rooms", "retryable": False})
    env.drive(horizon=timedelta(minutes=1))
    view = env.get(run_id)
    assert view.outcome is None and view.phase == "running" and not seen  # the others are still in flight
    env.complete(tokens["car"], {"kind": "car"})
    env.complete(tokens["flight"], {"kind": "flight"})
    run = env.wait(run_id)
    assert seen == ["hotel"]  # raised at its own await, once its siblings had settled
    assert run.outcome == "failed" and run.recovery == "compensated"
    assert undone == ["flight", "car"]  # reverse completion order (car completed first), one at a time
    assert [e["step_id"] for e in run["unwind"]] == ["flight", "car"]


def test_a_function_that_handles_a_sibling_failure_goes_on_with_the_others_results() -> None:
    app = Ryusen("handled")
    calls: Counter[str] = Counter()

    def quote(vendor: str) -> int:
        calls[vendor] += 1
        if vendor == "b":
            raise NonRetryableError("vendor b is down")
        return {"a": 10, "c": 7}[vendor]

    @app.function("cheapest")
    async def cheapest(data: Any, step: AsyncStep) -> Any:
        quotes = await asyncio.gather(*(step.run(v, quote, v) for v in "abc"), return_exceptions=True)
        return min(q for q in quotes if isinstance(q, int))

    run = WorkflowEnvironment(app).run("cheapest")
    assert run.outcome == "completed" and run.output == 7 and calls == Counter({"a": 1, "b": 1, "c": 1})


@pytest.mark.rfd("P3")
def test_after_a_sibling_fails_no_queued_sibling_starts_and_the_function_fails_at_the_await() -> None:
    tokens: dict[str, str] = {}
    app = Ryusen("bounded")
    ask = tokens_by_step(tokens)
    undone: list[str] = []

    @app.function("fan", max_parallel=2)
    async def fan(data: Any, step: AsyncStep) -> Any:
        steps = [
            step.run(n, ask, n, completion="external", compensate=lambda r: undone.append(r))
            for n in ("s0", "s1", "s2", "s3")
        ]
        return await asyncio.gather(*steps)

    env = WorkflowEnvironment(app)
    run_id = env.start("fan")
    env.drive(until=lambda: len(tokens) == 2)
    env.complete(tokens["s0"], error={"type": "Declined", "message": "no", "retryable": False})
    env.drive(horizon=timedelta(minutes=1))
    assert sorted(tokens) == ["s0", "s1"]  # s2 did not start after s0 failed for good
    env.complete(tokens["s1"], "s1")
    run = env.wait(run_id)
    assert run.outcome == "failed" and run.error is not None and run.error["type"] == "StepFailed"
    assert sorted(tokens) == ["s0", "s1"] and undone == ["s1"]
    assert [len(s["attempts"]) for s in run.steps if s["id"] in ("s2", "s3")] == [0, 0]


@pytest.mark.rfd("P3")
def test_siblings_in_a_task_group_are_compensated_even_when_the_group_cancels_their_tasks() -> None:
    """A task group cancels its other tasks when one raises: in the compensation pass the failed sibling's
    recorded failure is raised first, and the completed sibling's compensator still runs (from its call)."""
    tokens: dict[str, str] = {}
    undone: list[str] = []
    app = Ryusen("tg")
    ask = tokens_by_step(tokens)

    @app.function("pair")
    async def pair(data: Any, step: AsyncStep) -> Any:
        async with asyncio.TaskGroup() as group:
            group.create_task(step.run("bad", ask, "bad", completion="external"))
            group.create_task(step.run("good", ask, "good", completion="external", compensate=undone.append))
        return "both"

    env = WorkflowEnvironment(app)
    run_id = env.start("pair")
    env.drive(until=lambda: len(tokens) == 2)
    env.complete(tokens["good"], "good")
    env.complete(tokens["bad"], error={"type": "Nope", "message": "no", "retryable": False})
    run = env.wait(run_id)
    assert run.outcome == "failed" and run.recovery == "compensated" and undone == ["good"]


# ---- P4 -------------------------------------------------------------------------------------------------


@pytest.mark.rfd("P4")
def test_a_stop_starts_no_new_sibling_and_the_siblings_in_flight_settle() -> None:
    app = Ryusen("stop")
    calls: Counter[str] = Counter()
    undone: list[str] = []

    def book(what: str) -> str:
        calls[what] += 1
        return what

    @app.function("fan", max_parallel=2)
    async def fan(data: Any, step: AsyncStep) -> Any:
        names = ["a", "b", "c", "d", "e"]
        return await asyncio.gather(*(step.run(n, book, n, compensate=undone.append) for n in names))

    env = WorkflowEnvironment(app)
    run_id = env.start("fan")
    invoked: list[str] = []

    def cancel_at_the_second() -> None:
        invoked.append("x")
        if len(invoked) == 2:  # the second sibling is authorized and about to be invoked
            env.cancel(run_id)

    env.faults.before_invoke(None, cancel_at_the_second, times=10)  # type: ignore[arg-type]
    run = env.wait(run_id)
    assert run.outcome == "cancelled" and run.recovery == "compensated"
    ran = sorted(calls)
    assert len(ran) == 2 and all(calls[n] == 1 for n in ran)  # authorized before the stop: they settle (S5)
    assert sorted(undone) == ran  # every sibling that ran is undone; none started after the stop
    for s in run.steps:
        assert s["id"] in ran or all(a["status"] == "fenced" for a in s["attempts"])


# ---- P5 -------------------------------------------------------------------------------------------------


@pytest.mark.rfd("P5")
def test_an_unknown_sibling_blocks_recovery_until_resolved() -> None:
    app = Ryusen("unknown")
    calls: Counter[str] = Counter()
    undone: list[str] = []

    def book(what: str) -> str:
        calls[what] += 1
        return what

    @app.function("trip")
    async def trip(data: Any, step: AsyncStep) -> Any:
        return await asyncio.gather(*(step.run(n, book, n, compensate=undone.append) for n in ("a", "b", "c")))

    env = WorkflowEnvironment(app)
    run_id = env.start("trip")
    env.faults.lose_result("b")  # b's callback runs; its outcome never arrives: Unknown at its lease's end
    env.drive(stop_when_blocked=run_id, max_transitions=200)
    env.advance(timedelta(minutes=10))
    env.drive(stop_when_blocked=run_id, max_transitions=200)
    view = env.get(run_id)
    assert [b["type"] for b in view.blockers] == ["unknown_outcome"] and view.blockers[0]["step_id"] == "b"
    assert view.step("a")["status"] == view.step("c")["status"] == "completed"  # the others settled on their own
    env.cancel(run_id)
    env.drive(horizon=timedelta(minutes=5))
    view = env.get(run_id)
    assert view.phase == "settling" and undone == []  # no compensation while b is Unknown (S8)
    env.resolve(run_id, "b", generation=1, action="succeed", result="b", reason="the booking exists")
    run = env.wait(run_id)
    assert run.outcome == "cancelled" and run.recovery == "compensated" and sorted(undone) == ["a", "b", "c"]
    assert calls == Counter({"a": 1, "b": 1, "c": 1})


# ---- P6 -------------------------------------------------------------------------------------------------


@pytest.mark.rfd("P6")
def test_a_fan_out_over_a_thousand_items_completes_with_at_most_1_1_writes_per_step() -> None:
    app = Ryusen("fan-out")

    def price(i: int) -> int:
        return i * 2

    @app.function("prices")
    async def prices(data: Any, step: AsyncStep) -> Any:
        return sum(await asyncio.gather(*(step.run(f"item-{i}", price, i) for i in range(data))))

    env = WorkflowEnvironment(app)
    env.sync(app)
    env.counter.reset()
    run = env.run("prices", 1000)
    assert run.outcome == "completed" and run.output == sum(i * 2 for i in range(1000))
    assert len(run.steps) == 1000
    writes = env.counter.counts["store.write"]
    assert writes / 1000 <= 1.1, env.counter.counts
    invocations = env.counter.counts["endpoint.invoke"]
    assert invocations / 1000 <= 1.1, env.counter.counts


# ---- the example app's trip: parallel steps, an approval from outside, a durable wait ---------------------


def _shop() -> Any:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "shop.py"
    spec = importlib.util.spec_from_file_location("shop_for_trips", path)
    assert spec is not None and spec.loader is not None
    shop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shop)
    return shop


@pytest.mark.rfd("P1", "P3")
def test_the_example_trip_books_in_parallel_waits_for_approval_and_reminds_a_day_before(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shop = _shop()
    env = WorkflowEnvironment(shop.app)
    run_id = env.start("trip", {"traveller": "ada", "total": 2400, "departure_in_days": 10})
    printed: list[str] = []

    def asked() -> bool:
        printed.append(capsys.readouterr().out)
        return "ryusen complete" in "".join(printed)

    env.drive(until=asked)
    view = env.get(run_id)
    assert [view.step(k)["status"] for k in ("flight", "hotel", "car")] == ["completed"] * 3
    assert view.step("flight")["group"] == view.step("car")["group"] is not None  # booked together
    assert view.attempts("approval")[-1]["status"] == "waiting"
    token = "".join(printed).split("ryusen complete ", 1)[1].split()[0]  # as the app printed it
    env.complete(token, {"approved": True})
    done = env.wait(run_id)
    assert done.outcome == "completed" and done.output["reminded"] == "ada" and len(done.output["bookings"]) == 3
    started = datetime.fromisoformat(done["created_at"])
    reminded = datetime.fromisoformat(done.step("reminder")["attempts"][0]["authorized_at"])
    assert reminded - started >= timedelta(days=9)  # a day before departure, not before


def test_the_example_trip_cancels_what_it_booked_when_the_car_is_sold_out() -> None:
    shop = _shop()
    run = WorkflowEnvironment(shop.app).run("trip", {"traveller": "bo", "total": 300, "car": "none-left"})
    assert run.outcome == "failed" and run.recovery == "compensated"
    assert run.step("car")["status"] == "failed"
    cancelled = sorted(b["kind"] for b in shop.BOOKINGS.values() if b["cancelled"])
    assert cancelled == ["flight", "hotel"]


def test_branches_of_several_steps_run_their_first_steps_together_then_their_next() -> None:
    app = Ryusen("branches")

    @app.function("pairs")
    async def pairs(data: Any, step: AsyncStep) -> Any:
        async def branch(k: str) -> int:
            first = await step.run(f"{k}-1", lambda: 1)
            return first + await step.run(f"{k}-2", lambda: 2)

        return await asyncio.gather(branch("x"), branch("y"))

    run = WorkflowEnvironment(app).run("pairs")
    assert run.outcome == "completed" and run.output == [3, 3]
    groups = {s["id"]: s["group"] for s in run.steps}
    assert groups["x-1"] == groups["y-1"] != groups["x-2"] == groups["y-2"]


def test_code_that_swallows_the_pass_s_stop_and_awaits_another_step_does_not_hang_the_attempt() -> None:
    """An attempt's pass stops at its target's call; the callback is already running, so code that catches
    everything there and awaits another step waits for it and the pass ends as usual."""
    app = Ryusen("swallow")
    calls: Counter[str] = Counter()

    @app.function("f")
    async def f(data: Any, step: AsyncStep) -> Any:
        try:
            out = await asyncio.gather(*(step.run(f"i{i}", lambda i=i: calls.update([f"i{i}"]) or i) for i in range(3)))
        except BaseException:  # noqa: BLE001 - what the test is about
            out = None
        return [out, await step.run("after", lambda: calls.update(["after"]) or "a")]

    run = WorkflowEnvironment(app).run("f")
    assert run.outcome == "completed" and run.output == [[0, 1, 2], "a"]
    assert calls == Counter({"i0": 1, "i1": 1, "i2": 1, "after": 1})

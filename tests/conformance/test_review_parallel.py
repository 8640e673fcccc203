"""An adversarial review of steps declared together (decision 30, P1-P6), kept as regression tests.

The tests whose docstrings describe a defect failed on the reviewed commit (30830ce) and pass since its fixes; the
others record attacks that held."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest

from ryusen import AsyncStep, NonRetryableError, RetryPolicy, Ryusen, Step
from ryusen.testing import WorkflowEnvironment
from tests.conformance.test_parallel_steps import tokens_by_step


def within(seconds: float, body: Callable[[], Any]) -> Any:
    """Run ``body`` on a daemon thread; fail (instead of hanging the suite) if it has not returned in time."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = body()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"the pass hung: nothing returned within {seconds}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def in_flight(env: WorkflowEnvironment, run_id: str) -> list[str]:
    view = env.get(run_id)
    return [
        s["id"]
        for s in view.steps
        if s["attempts"] and s["attempts"][-1]["status"] in ("authorized", "waiting", "queued")
    ]


# ---- 1. a group found by the continuation after a step ------------------------------------------------------


@pytest.mark.rfd("P1")
def test_siblings_after_a_first_step_still_run_together_when_the_continuation_finds_them() -> None:
    """A step, then three one-hour waits declared together. The engine chains (continue_after), so the pass
    that finds the group is the SDK's continuation after the first step's callback, whose discovery request
    is built without ``parallel_steps`` (``_discovery_after`` in app.py). It reports the first sibling alone
    (observed: w0 ran alone with no group, then w1 and w2 together: 2 h). Expected: the slowest (1 h)."""
    app = Ryusen("trip")

    @app.function("trip")
    async def trip(data: Any, step: AsyncStep) -> Any:
        await step.run("quote", lambda: 1)
        await asyncio.gather(*(step.sleep(f"w{i}", timedelta(hours=1)) for i in range(3)))
        return "done"

    env = WorkflowEnvironment(app)
    run = env.run("trip")
    assert run.outcome == "completed"
    took = datetime.fromisoformat(run["finished_at"]) - datetime.fromisoformat(run["created_at"])
    groups = {s["id"]: s.get("group") for s in run.steps}
    assert took < timedelta(hours=2), (took, groups)  # observed: 2 h, w0 in no group


@pytest.mark.rfd("P2")
def test_max_parallel_holds_for_a_group_the_continuation_finds() -> None:
    """``max_parallel=2``, a first step, then four external steps declared together. The continuation's
    replay is made by ``_replay(discovery)`` without the registered function, so even once it reports the
    group it reports the default ``max_parallel`` (10), not the function's. Expected: exactly two in flight
    (observed today: one, since the continuation reports one step at a time)."""
    tokens: dict[str, str] = {}
    app = Ryusen("bounded")
    ask = tokens_by_step(tokens)

    @app.function("fan", max_parallel=2)
    async def fan(data: Any, step: AsyncStep) -> Any:
        await step.run("first", lambda: 0)
        return await asyncio.gather(*(step.run(n, ask, n, completion="external") for n in ("a", "b", "c", "d")))

    env = WorkflowEnvironment(app)
    env.start("fan")
    env.drive(horizon=timedelta(minutes=5))
    assert sorted(tokens) == ["a", "b"], sorted(tokens)


def test_the_continuations_discovery_request_carries_parallel_steps() -> None:
    """Direct check of the SDK: the discovery request the continuation runs must carry the request's
    ``parallel_steps`` (``_discovery_after`` in app.py builds it without)."""
    from ryusen._internal import app as sdk_app
    from ryusen._internal.wire import CallbackSucceeded, OperationInfo, Phase, TaskKind, TaskRequest

    request = TaskRequest(
        kind=TaskKind.FORWARD,
        run_id="r",
        function_id="f",
        input=None,
        memo={},
        step_id="first",
        operation=OperationInfo(id="op", phase=Phase.FORWARD, generation=1),
        continue_after=True,
        parallel_steps=True,
    )
    discovery = sdk_app._discovery_after(request, CallbackSucceeded(result=0), None)
    assert discovery is not None
    assert discovery.parallel_steps, "the continuation's discovery drops parallel_steps"


def test_max_parallel_is_lost_by_the_continuation_even_once_it_carries_parallel_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``_discovery_after`` patched to carry ``parallel_steps`` (the first defect fixed), the continuation's
    replay is still made without the registered function (``replay = _replay(discovery)`` in
    ``Ryusen._continuation`` and ``_execute_async``), so it reports ``max_parallel=10``. Expected: two of the
    four in flight (``max_parallel=2``); observed: four."""
    from ryusen._internal import app as sdk_app

    original = sdk_app._discovery_after

    def carrying(request: Any, outcome: Any, run_input: Any) -> Any:
        found = original(request, outcome, run_input)
        return found.model_copy(update={"parallel_steps": request.parallel_steps}) if found is not None else None

    monkeypatch.setattr(sdk_app, "_discovery_after", carrying)
    tokens: dict[str, str] = {}
    app = Ryusen("bounded")
    ask = tokens_by_step(tokens)

    @app.function("fan", max_parallel=2)
    async def fan(data: Any, step: AsyncStep) -> Any:
        await step.run("first", lambda: 0)
        return await asyncio.gather(*(step.run(n, ask, n, completion="external") for n in ("a", "b", "c", "d")))

    env = WorkflowEnvironment(app)
    env.start("fan")
    env.drive(horizon=timedelta(minutes=5))
    assert sorted(tokens) == ["a", "b"], sorted(tokens)


# ---- 2. a claimed target in a task the function does not await first ---------------------------------------


@pytest.mark.rfd("P1")
def test_gather_with_return_exceptions_over_helper_coroutines_does_not_hang_a_sibling_attempt() -> None:
    """Siblings declared in helper coroutines, gathered with ``return_exceptions=True``. In the attempt of
    ``s1``, its ``step.run`` is claimed in its own task: the Suspend ends that task only, and gather (which
    returns exceptions) keeps waiting for ``s0``'s task, which parks (``wait_declared`` -> ``park``) until the
    target's callback finishes. That callback runs only in ``finish_declared``, once the function is done:
    a deadlock (step.py ``wait_declared``/``decide_waiting``, app.py ``_pass_async``). Expected: s1's
    callback runs and its attempt reports; observed: the pass never returns."""
    calls: Counter[str] = Counter()
    app = Ryusen("gather")

    def book(i: int) -> int:
        calls[f"s{i}"] += 1
        return i

    @app.function("fan")
    async def fan(data: Any, step: AsyncStep) -> Any:
        async def one(i: int) -> Any:
            return await step.run(f"s{i}", book, i)

        results = await asyncio.gather(one(0), one(1), return_exceptions=True)
        return [r if isinstance(r, int) else repr(r) for r in results]

    env = WorkflowEnvironment(app)
    run = within(20, lambda: env.run("fan"))
    assert run.outcome == "completed" and run.output == [0, 1]
    assert calls == Counter({"s0": 1, "s1": 1})


@pytest.mark.rfd("P1")
def test_tasks_awaited_one_after_another_do_not_hang_a_sibling_attempt() -> None:
    """``tasks = [create_task(one(i)) ...]; [await t for t in tasks]``: the steps are declared together (the
    discovery reports both). In ``s1``'s attempt the function awaits ``s0``'s task first, which parks until the
    claimed ``s1`` callback has run, and that runs only after the function ends: the pass hangs. Expected:
    the run completes with each callback run once."""
    calls: Counter[str] = Counter()
    tokens: dict[str, str] = {}
    ask = tokens_by_step(tokens)
    app = Ryusen("tasks")

    def book(i: int) -> int:
        calls[f"s{i}"] += 1
        return i

    @app.function("fan")
    async def fan(data: Any, step: AsyncStep) -> Any:
        async def approval() -> Any:  # s0 waits for someone: it is unrecorded while s1's attempt runs
            return await step.run("s0", ask, "s0", completion="external", timeout=timedelta(days=1))

        async def one() -> Any:
            return await step.run("s1", book, 1)

        tasks = [asyncio.create_task(approval()), asyncio.create_task(one())]
        return [await t for t in tasks]

    env = WorkflowEnvironment(app)
    run_id = env.start("fan")
    within(20, lambda: env.drive(horizon=timedelta(minutes=5)))
    assert calls == Counter({"s1": 1}) and "s0" in tokens
    env.complete(tokens["s0"], 0)
    run = within(20, lambda: env.wait(run_id))
    assert run.outcome == "completed" and run.output == [0, 1]


# ---- 3. compensation of a sibling whose task a task group cancels before it declares -----------------------


@pytest.mark.rfd("P3")
def test_a_sibling_in_a_task_group_is_compensated_when_its_task_is_cancelled_before_its_step_run() -> None:
    """Siblings in a task group, each in a helper that awaits something (a lookup) before its ``step.run``.
    ``good`` completes, ``bad`` fails for good; the discovery raises ``bad``'s failure and the task group
    cancels ``good``'s task at its first await, before ``good``'s ``step.run``. The compensation pass of
    ``good`` does the same: it never declares ``good``, ends with ``bad``'s recorded failure and reports
    ``target_not_found``/``not_reached``, so the unwind blocks (compensation_target_not_reached) until an
    operator skips it - a completed sibling whose compensator never runs. P3 says settled siblings are
    compensated on unwind; the existing task-group test only covers ``create_task(step.run(...))``, where the
    call happens in the function itself. Expected: recovery ``compensated`` with ``undone == ["good"]``."""
    tokens: dict[str, str] = {}
    undone: list[str] = []
    app = Ryusen("tg")
    ask = tokens_by_step(tokens)

    @app.function("pair")
    async def pair(data: Any, step: AsyncStep) -> Any:
        async def bad() -> Any:
            return await step.run("bad", ask, "bad", completion="external")

        async def good() -> Any:
            await asyncio.sleep(0)  # looks something up first
            return await step.run("good", ask, "good", completion="external", compensate=undone.append)

        async with asyncio.TaskGroup() as group:
            group.create_task(bad())
            group.create_task(good())
        return "both"

    env = WorkflowEnvironment(app)
    run_id = env.start("pair")
    env.drive(until=lambda: len(tokens) == 2)
    assert env.get(run_id).step("good")["group"] == env.get(run_id).step("bad")["group"]  # declared together
    env.complete(tokens["good"], "good")
    env.complete(tokens["bad"], error={"type": "Nope", "message": "no", "retryable": False})
    run = env.wait(run_id)
    assert [b["type"] for b in run.blockers] == [], run.blockers
    assert run.outcome == "failed" and run.recovery == "compensated" and undone == ["good"]


# ---- 4. a discovery while siblings are still in flight --------------------------------------------------------


def nesting_app(tokens: dict[str, str], calls: Counter[str], *, nest: bool, build: str) -> Ryusen:
    app = Ryusen("nest", build_id=build)
    ask = tokens_by_step(tokens)

    @app.function("trip")
    async def trip(data: Any, step: AsyncStep) -> Any:
        async def charge() -> str:
            calls["a"] += 1
            if nest:
                await step.run("inner", lambda: "x")  # a callback that opens a step (decision 23)
            return "charged"

        return await asyncio.gather(
            step.run("b", ask, "b", completion="external", timeout=timedelta(days=3)),
            step.run("c", ask, "c", completion="external", timeout=timedelta(days=3)),
            step.run("a", charge),
        )

    return app


@pytest.mark.rfd("P1")
def test_a_release_that_unblocks_one_sibling_does_not_spin_discoveries_while_others_are_in_flight() -> None:
    """Sibling ``a``'s callback opens a step (decision 23): the run blocks, ``b`` and ``c`` keep waiting for their
    completions. A fixed release wakes the run: ``wake`` queues a discovery although the group still has
    siblings in flight. That discovery reports ``[a, b, c]``; ``siblings_reached`` starts ``a`` in a *new* group
    (``b``, ``c`` are live, so they are left out and keep the old group number). When ``a`` settles the new group
    is empty, so ``start_siblings`` queues a discovery; it reports ``[b, c]`` again, neither may start, the new
    (empty) group is done at once and queues the next discovery: a discovery loop that runs as long as ``b`` and
    ``c`` wait (days), each one a write and an endpoint invocation (decide.py ``wake``/``siblings_reached``/
    ``start_siblings``). Expected: no discovery while siblings are in flight; a handful of passes in all."""
    tokens: dict[str, str] = {}
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(nesting_app(tokens, calls, nest=True, build="b1"))
    run_id = env.start("trip")
    env.drive(stop_when_blocked=run_id, max_transitions=500)
    view = env.get(run_id)
    assert [b["type"] for b in view.blockers] == ["concurrent_step"], view.blockers
    assert sorted(tokens) == ["b", "c"]
    env.counter.reset()
    env.sync(nesting_app(tokens, calls, nest=False, build="b2"))  # the fix: a release wakes the run
    try:
        # not chained, so that the loop goes through the queue and max_transitions ends it (chained, one
        # message ran 100,015 discovery invocations and 100,035 writes in a row before its chain was cut)
        env.drive(horizon=timedelta(minutes=10), max_transitions=300, chain=False)
    except RuntimeError as exc:  # "workflow did not settle within max_transitions"
        pytest.fail(f"{exc}: {dict(env.counter.counts)}")
    assert env.get(run_id).step("a")["status"] == "completed"
    assert env.counter.counts["endpoint.invoke"] < 20, dict(env.counter.counts)


@pytest.mark.rfd("P1")
def test_a_siblings_report_does_not_clear_the_blocker_another_sibling_raised() -> None:
    """Sibling ``a``'s callback opens a step (decision 23) and blocks the run; then ``b``'s and ``c``'s callbacks
    report (they handed out their tokens). ``attempt_reported`` clears every definition blocker on any report
    that is not a conflict ("this pass got past whatever blocked the ones before it"), which held for one step
    at a time but not for siblings: ``b``'s pass got past nothing of ``a``'s. Observed: the run shows no
    blocker while ``a`` sits pending with a held attempt (and ``stop_when_blocked`` never stops);
    expected: the concurrent_step blocker on ``a`` stays until a release or an operator moves it on
    (decide.py ``attempt_reported`` -> ``clear_definition_blockers``)."""
    tokens: dict[str, str] = {}
    calls: Counter[str] = Counter()
    app = Ryusen("nest", build_id="b1")
    ask = tokens_by_step(tokens)

    @app.function("trip")
    async def trip(data: Any, step: AsyncStep) -> Any:
        async def charge() -> str:
            calls["a"] += 1
            await step.run("inner", lambda: "x")
            return "charged"

        return await asyncio.gather(
            step.run("a", charge),
            step.run("b", ask, "b", completion="external", timeout=timedelta(days=3)),
            step.run("c", ask, "c", completion="external", timeout=timedelta(days=3)),
        )

    env = WorkflowEnvironment(app)
    run_id = env.start("trip")
    env.drive(horizon=timedelta(minutes=10), max_transitions=500)
    view = env.get(run_id)
    assert sorted(tokens) == ["b", "c"] and view.step("a")["status"] == "pending"
    assert [b["type"] for b in view.blockers] == ["concurrent_step"], view.blockers


# ---- 5. definition errors -------------------------------------------------------------------------------------


def test_a_step_declared_from_another_thread_in_an_async_function_is_refused_not_run() -> None:
    """An async function hands ``step.run`` to a worker thread (``asyncio.to_thread``), which calls it and
    drops the awaitable. ``AsyncStep._run`` -> ``_Replay.declare`` has no thread check, so the call is
    declared: the discovery reports it with the function's own step, and the attempt's pass runs its callback
    from the declaration (``decide_waiting`` -> ``run_declared``). Decision 18's refusal is meant to stay for
    steps from threads. Observed: ``from-thread``'s callback runs and the run completes; expected: a
    ``concurrent_step`` blocker (a step from a thread that is not the function's), nothing run."""
    calls: Counter[str] = Counter()
    app = Ryusen("threads")

    def effect(name: str) -> str:
        calls[name] += 1
        return name

    @app.function("f")
    async def f(data: Any, step: AsyncStep) -> Any:
        await asyncio.to_thread(lambda: step.run("from-thread", effect, "from-thread"))
        return await step.run("main", effect, "main")

    env = WorkflowEnvironment(app)
    run = env.run("f")
    assert calls["from-thread"] == 0, (run.outcome, dict(calls))
    assert [b["type"] for b in run.blockers] == ["concurrent_step"]


def test_sibling_ids_in_a_discovery_are_checked_for_duplicates_by_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine trusts a StepsReached's plans to have distinct ids (``siblings_reached``). An endpoint that
    reports ``[x, x, y]`` (an SDK that does not check, another language's SDK, a hand-written endpoint) must
    get a ``duplicate_step_id`` blocker, as the SDK's own check gives; nothing of ``x`` may run."""
    from ryusen._internal import step as sdk_step
    from ryusen._internal.wire import StepsReached

    original = sdk_step._Replay.together_outcome

    def doubled(self: Any) -> Any:
        found = original(self)
        if isinstance(found, StepsReached):
            return found.model_copy(update={"steps": [found.steps[0], *found.steps]})
        return found

    monkeypatch.setattr(sdk_step._Replay, "together_outcome", doubled)
    calls: Counter[str] = Counter()
    app = Ryusen("dups")

    @app.function("f")
    async def f(data: Any, step: AsyncStep) -> Any:
        return await asyncio.gather(step.run("x", lambda: calls.update(["x"])), step.run("y", lambda: 2))

    env = WorkflowEnvironment(app)
    run = env.run("f")
    assert [b["type"] for b in run.blockers] == ["duplicate_step_id"], (run.outcome, run.blockers, dict(calls))
    assert calls["x"] == 0


# ---- 6. older server, kept passes ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_server_that_does_not_run_steps_together_gets_them_one_at_a_time(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A server that does not send ``parallel_steps`` (the SDK's features synced without it): the steps of a
    gather / step.parallel are reported one at a time and each callback runs once; failures and
    compensation still work. (Held.)"""
    from ryusen._internal import app as sdk_app

    monkeypatch.setattr(sdk_app, "SDK_FEATURES", tuple(f for f in sdk_app.SDK_FEATURES if f != "parallel_steps"))
    calls: Counter[str] = Counter()
    undone: list[str] = []
    app = Ryusen("old")

    def book(name: str) -> str:
        calls[name] += 1
        if name == "c":
            raise NonRetryableError("no")
        return name

    if kind == "async":

        @app.function("f")
        async def fa(data: Any, step: AsyncStep) -> Any:
            return await asyncio.gather(*(step.run(n, book, n, compensate=undone.append) for n in "abc"))

    else:

        @app.function("f")
        def fs(data: Any, step: Step) -> Any:
            return step.parallel(*(lambda n=n: step.run(n, book, n, compensate=undone.append) for n in "abc"))

    env = WorkflowEnvironment(app)
    run = env.run("f")
    assert run.outcome == "failed" and run.recovery == "compensated", (run.outcome, run.blockers)
    assert calls == Counter({"a": 1, "b": 1, "c": 1}) and undone == ["b", "a"]
    assert all(s.get("group") is None for s in run.steps)


@pytest.mark.parametrize("kept_passes", [False, True], ids=["replay", "kept"])
def test_step_parallel_in_kept_passes_runs_each_callback_once_and_unwinds_in_reverse(kept_passes: bool) -> None:
    """step.parallel after a first step (the kept pass goes on into the group) and before a last one that fails:
    each callback once, the same steps as a replay from the top (check_discovery), and compensation in
    reverse completion order. (Held.)"""
    calls: Counter[str] = Counter()
    undone: list[str] = []
    app = Ryusen("kept")

    def book(name: str) -> str:
        calls[name] += 1
        if name == "last":
            raise NonRetryableError("declined")
        return name

    @app.function("f")
    def f(data: Any, step: Step) -> Any:
        step.run("first", book, "first", compensate=undone.append)
        got = step.parallel(
            lambda: step.run("p", book, "p", compensate=undone.append),
            lambda: step.run("q", book, "q", compensate=undone.append),
            lambda: step.run("r", book, "r", compensate=undone.append),
        )
        step.run("last", book, "last")
        return got

    with WorkflowEnvironment(app, kept_passes=kept_passes, check_discovery=kept_passes) as env:
        run = env.run("f")
    assert run.outcome == "failed" and run.recovery == "compensated", run.blockers
    assert calls == Counter({"first": 1, "p": 1, "q": 1, "r": 1, "last": 1})
    order = sorted((s for s in run.steps if s["id"] != "last"), key=lambda s: s["completed_seq"] or 0)
    assert undone == [s["id"] for s in reversed(order)]


# ---- 7. cost per settlement -----------------------------------------------------------------------------------


@pytest.mark.rfd("P6")
def test_a_siblings_settlement_does_not_scan_every_step_of_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each settlement calls ``start_siblings``, which calls ``group_census`` at least twice, and each census walks
    every step of the run (decide.py ``group_census``): O(steps) per settlement, O(n^2) per fan-out. Profiled on
    a 1,000-item fan-out (max_parallel=10): group_census is 1.9 s of the engine's 2.4 s of decisions, ~1 ms of
    CPU per write at the run's size limit, and growing with it. Expected: work per settlement bounded by the
    siblings in flight (here measured as steps visited per settlement, < 50 for max_parallel=10)."""
    from ryusen_server.core import decide as core

    visited = Counter[str]()
    original = core._Transition.group_census

    def counting(self: Any) -> Any:
        found = original(self)
        visited["steps"] += self.census_visited
        visited["censuses"] += 1
        return found

    monkeypatch.setattr(core._Transition, "group_census", counting)
    app = Ryusen("fan-out")

    @app.function("prices")
    async def prices(data: Any, step: AsyncStep) -> Any:
        return sum(await asyncio.gather(*(step.run(f"item-{i}", lambda i=i: i) for i in range(data))))

    run = WorkflowEnvironment(app).run("prices", 300)
    assert run.outcome == "completed"
    per_settlement = visited["steps"] / 300
    assert per_settlement < 50, (per_settlement, dict(visited))


# ---- 8. more attacks -----------------------------------------------------------------------------------------


def test_a_compensation_pass_with_a_later_step_after_a_gather_that_returns_exceptions_does_not_hang() -> None:
    """The same deadlock in an unwind. Release 1 gathers direct ``step.run`` calls (forward works); release 2
    moves them into helper coroutines gathered with ``return_exceptions=True``. In ``s1``'s compensation pass the
    claim's Suspend ends only its own task; gather returns it as a value, the function goes on to
    ``step.run("charge")``, which parks (``_after_stop_together`` -> "park") until a compensator that runs only
    once the function ends. Expected: the compensators run in reverse order; observed: the pass hangs."""
    undone: list[str] = []

    def release(helpers: bool) -> Ryusen:
        app = Ryusen("shop", build_id="b2" if helpers else "b1")

        @app.function("f")
        async def f(data: Any, step: AsyncStep) -> Any:
            if helpers:

                async def one(i: int) -> Any:
                    return await step.run(f"s{i}", lambda i=i: i, compensate=undone.append)

                await asyncio.gather(one(0), one(1), return_exceptions=True)
            else:
                await asyncio.gather(*(step.run(f"s{i}", lambda i=i: i, compensate=undone.append) for i in (0, 1)))
            await step.run("charge", lambda: (_ for _ in ()).throw(NonRetryableError("declined")))
            return "ok"

        return app

    env = WorkflowEnvironment(release(False))
    run_id = env.start("f")
    env.drive(until=lambda: env.get(run_id).outcome is not None)
    env.sync(release(True))
    run = within(20, lambda: env.wait(run_id))
    assert run.outcome == "failed" and run.recovery == "compensated", run.blockers
    assert sorted(undone) == [0, 1]


def test_duplicate_queue_messages_run_no_sibling_twice() -> None:
    """Every queue message delivered twice, max_parallel=2 over six siblings with a retry each: every callback
    runs once per attempt. (Held.)"""
    calls: Counter[str] = Counter()
    app = Ryusen("dup")

    def book(name: str) -> str:
        calls[name] += 1
        if calls[name] == 1 and name in ("b", "e"):
            raise RuntimeError("flaky")
        return name

    @app.function("f", max_parallel=2)
    async def f(data: Any, step: AsyncStep) -> Any:
        return await asyncio.gather(*(step.run(n, book, n, retry=RetryPolicy(max_attempts=3)) for n in "abcdef"))

    env = WorkflowEnvironment(app)
    env.faults.duplicate_messages = True
    run = env.run("f")
    assert run.outcome == "completed" and run.output == list("abcdef")
    assert calls == Counter({"a": 1, "b": 2, "c": 1, "d": 1, "e": 2, "f": 1})


@pytest.mark.rfd("P4")
def test_a_stop_while_a_sibling_retries_and_others_wait_in_queue_starts_nothing_new() -> None:
    """max_parallel=2: ``a`` waits for a completion, ``b`` failed once and waits for its retry (backoff), ``c``
    and ``d`` have not started. A cancel fences ``b``'s queued retry and starts neither ``c`` nor ``d``; ``a``
    is fenced as a waiting external step. (Held.)"""
    tokens: dict[str, str] = {}
    calls: Counter[str] = Counter()
    app = Ryusen("stop")
    ask = tokens_by_step(tokens)

    def flaky(name: str) -> str:
        calls[name] += 1
        raise RuntimeError("flaky")

    @app.function("f", max_parallel=2)
    async def f(data: Any, step: AsyncStep) -> Any:
        return await asyncio.gather(
            step.run("a", ask, "a", completion="external"),
            step.run("b", flaky, "b", retry=RetryPolicy(max_attempts=5, initial_delay=timedelta(hours=1))),
            step.run("c", flaky, "c"),
            step.run("d", flaky, "d"),
        )

    env = WorkflowEnvironment(app)
    run_id = env.start("f")
    env.drive(until=lambda: "a" in tokens and calls["b"] == 1)
    env.drive(horizon=timedelta(minutes=1))
    env.cancel(run_id)
    run = env.wait(run_id)
    assert run.outcome == "cancelled" and run.recovery == "not_required"
    assert calls == Counter({"b": 1}) and list(tokens) == ["a"]

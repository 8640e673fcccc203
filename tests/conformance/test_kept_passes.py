"""Kept passes: a chained run's function goes on from step to step instead of replaying from the top.

Each test holds a kept pass to what a replay from the top would do: the same steps, each callback once per
attempt, every execution's ``finally`` run, compensation in reverse. What a pass saves is only the replays:
the function's top runs once per pass, not once per task.
"""

from __future__ import annotations

import contextvars
import decimal
import logging
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

import ryusen._internal.app as sdk_app
from ryusen import Ryusen, Step
from ryusen._internal.wire import OperationInfo, Phase, TaskKind, TaskRequest
from ryusen.testing import DiscoveryDivergenceError, WorkflowEnvironment
from tests.stack import wait_for

KEPT = pytest.mark.parametrize("kept_passes", [False, True], ids=["replay every task", "kept passes"])


class Tally:
    """What a workflow's executions did: how often the function's top ran, its ``finally`` ran, and each
    callback ran."""

    def __init__(self) -> None:
        self.tops = 0
        self.finallys = 0
        self.callbacks: Counter[str] = Counter()
        self.order: list[str] = []
        self._lock = threading.Lock()

    def top(self) -> None:
        with self._lock:
            self.tops += 1

    def done(self) -> None:
        with self._lock:
            self.finallys += 1

    def ran(self, name: str, value: Any = None) -> Any:
        with self._lock:
            self.callbacks[name] += 1
            self.order.append(name)
        return value if value is not None else name


def chain_app(tally: Tally, name: str = "kept") -> Ryusen:
    """``steps(n)``: n steps in a row, each returning its index, the output their sum."""
    app = Ryusen(name)

    @app.function("steps")
    def steps(data: Any, step: Step) -> Any:
        tally.top()
        try:
            total = 0
            for i in range(data["n"]):
                total += step.run(f"s{i}", lambda i=i: tally.ran(f"s{i}", i))
            return total
        finally:
            tally.done()

    return app


def run_steps(env: WorkflowEnvironment, n: int) -> Any:
    return env.run("steps", {"n": n})


# ---- what a kept pass saves --------------------------------------------------------------------------------


def test_a_chained_run_executes_its_function_from_the_top_a_number_of_times_that_does_not_grow() -> None:
    """With kept passes the function's top runs a fixed number of times whatever the run's length, and every
    attempt after the first is served by the pass that found its step; without them it runs twice a step."""
    tops: dict[tuple[bool, int], int] = {}
    for kept in (True, False):
        for n in (30, 60):
            tally = Tally()
            app = chain_app(tally)
            with WorkflowEnvironment(app, kept_passes=kept) as env:
                run = run_steps(env, n)
                left = len(app.kept_passes)
            assert run.outcome == "completed" and run.output == sum(range(n))
            assert tally.callbacks == Counter({f"s{i}": 1 for i in range(n)})
            assert tally.finallys == tally.tops  # every execution ended, none is left waiting
            tops[(kept, n)] = tally.tops
            if kept:
                assert app.kept_passes.resumed == n - 1
                assert left == 0  # the last pass finished with the function
            else:
                assert app.kept_passes.resumed == 0 and app.kept_passes.started == 0
    assert tops[(True, 30)] == tops[(True, 60)] <= 4
    assert tops[(False, 60)] >= 2 * 60 and tops[(False, 60)] - tops[(False, 30)] >= 2 * 30


# ---- anything else ends the pass, and the task replays ---------------------------------------------------


@KEPT
def test_another_endpoint_instance_serves_the_next_step(kept_passes: bool) -> None:
    """Before s3's attempt the instance that kept the pass is gone (its passes end, as a process that
    stops): s3 replays from the top on the "other" instance, and the run is the same."""
    tally = Tally()
    app = chain_app(tally)
    with WorkflowEnvironment(app, kept_passes=kept_passes) as env:
        env.faults.before_invoke("s3", app.kept_passes.clear)
        run = run_steps(env, 6)
    assert run.outcome == "completed" and run.output == 15
    assert tally.callbacks == Counter({f"s{i}": 1 for i in range(6)})
    assert tally.finallys == tally.tops
    if kept_passes:
        assert app.kept_passes.started == 2  # s0's pass, then s3's
        assert app.kept_passes.resumed == 4  # s1, s2; s4, s5


def test_a_pass_kept_longer_than_its_idle_time_ends_and_the_step_replays() -> None:
    tally = Tally()
    app = chain_app(tally)
    app.kept_passes.idle_s = 0.05
    with WorkflowEnvironment(app, kept_passes=True) as env:
        env.faults.before_invoke("s2", lambda: time.sleep(0.3))
        run = run_steps(env, 4)
    assert run.outcome == "completed" and run.output == 6
    assert tally.callbacks == Counter({f"s{i}": 1 for i in range(4)})
    assert tally.finallys == tally.tops
    assert app.kept_passes.started == 2 and app.kept_passes.resumed == 2


def test_runs_beyond_the_capacity_replay_instead_of_pushing_a_kept_pass_out() -> None:
    """Capacity 1 and two runs whose steps interleave (each step goes through the queue): the first run keeps
    its pass to the end, the second replays from the top until there is room (each pushing the other's out
    resumed none: test_kept_memory.py), and both runs are right."""
    tally = Tally()
    app = chain_app(tally)
    app.kept_passes.capacity = 1
    with WorkflowEnvironment(app, kept_passes=True) as env:
        first, second = env.start("steps", {"n": 5}), env.start("steps", {"n": 5})
        env.drive(chain=False)
        views = [env.get(first), env.get(second)]
        left = len(app.kept_passes)
    assert [v.outcome for v in views] == ["completed", "completed"] and [v.output for v in views] == [10, 10]
    assert tally.callbacks == Counter({f"s{i}": 2 for i in range(5)})
    assert tally.finallys == tally.tops and left == 0
    assert app.kept_passes.resumed == 4 and app.kept_passes.started == 2  # the second run's last step has room


@KEPT
def test_a_failed_attempt_ends_the_pass_and_its_retry_replays(kept_passes: bool) -> None:
    tally = Tally()
    app = Ryusen("retry")
    failures = {"b": 1}

    def b() -> str:
        tally.ran("b")
        if failures["b"]:
            failures["b"] -= 1
            raise RuntimeError("card declined, once")
        return "b"

    @app.function("abc")
    def abc(data: Any, step: Step) -> Any:
        tally.top()
        try:
            return [
                step.run("a", lambda: tally.ran("a")),
                step.run("b", b),
                step.run("c", lambda: tally.ran("c")),
            ]
        finally:
            tally.done()

    with WorkflowEnvironment(app, kept_passes=kept_passes) as env:
        run = env.run("abc")
        left = len(app.kept_passes)
    assert run.outcome == "completed" and run.output == ["a", "b", "c"]
    assert tally.callbacks == Counter({"a": 1, "b": 2, "c": 1}) and tally.order == ["a", "b", "b", "c"]
    assert tally.finallys == tally.tops and left == 0


@KEPT
def test_a_cancel_during_a_callback_compensates_in_reverse_and_runs_no_later_step(kept_passes: bool) -> None:
    """The run is cancelled while b's callback runs (b's result is still accepted, as RFD 1 says of an
    attempt in flight): the pass that went on to c ends, c never runs, and a and b are undone in reverse."""
    tally = Tally()
    app = Ryusen("cancel")
    env_box: dict[str, Any] = {}

    def b() -> str:
        env_box["env"].cancel(env_box["run"])
        return tally.ran("b")

    @app.function("abc")
    def abc(data: Any, step: Step) -> Any:
        tally.top()
        try:
            step.run("a", lambda: tally.ran("a"), compensate=lambda _: tally.ran("undo-a"))
            step.run("b", b, compensate=lambda _: tally.ran("undo-b"))
            step.run("c", lambda: tally.ran("c"), compensate=lambda _: tally.ran("undo-c"))
            return "done"
        finally:
            tally.done()

    with WorkflowEnvironment(app, kept_passes=kept_passes) as env:
        env_box["env"], env_box["run"] = env, env.start("abc")
        env.drive(chain=True)
        run = env.get(env_box["run"])
        left = len(app.kept_passes)
    assert run.outcome == "cancelled"
    assert tally.order == ["a", "b", "undo-b", "undo-a"]
    assert tally.finallys == tally.tops and left == 0


@KEPT
def test_a_duplicate_step_id_blocks_the_run_as_a_replay_does(kept_passes: bool) -> None:
    tally = Tally()
    app = Ryusen("dup")

    @app.function("aba")
    def aba(data: Any, step: Step) -> Any:
        tally.top()
        try:
            step.run("a", lambda: tally.ran("a"))
            step.run("b", lambda: tally.ran("b"))
            step.run("a", lambda: tally.ran("a-again"))
            return "done"
        finally:
            tally.done()

    with WorkflowEnvironment(app, kept_passes=kept_passes) as env:
        run_id = env.start("aba")
        env.drive(chain=True, stop_when_blocked=run_id)
        run = env.get(run_id)
        left = len(app.kept_passes)
    assert run.outcome is None and [b["type"] for b in run.blockers] == ["duplicate_step_id"]
    assert tally.callbacks == Counter({"a": 1, "b": 1})
    assert tally.finallys == tally.tops and left == 0


def test_an_engine_that_no_longer_holds_the_memo_it_sent_gets_a_replay() -> None:
    """The engine forgets the memos it sent (a new process): its next request carries the whole memo under
    a new token, which is not the one the pass extends, so the pass ends and the step replays."""
    tally = Tally()
    app = chain_app(tally)
    with WorkflowEnvironment(app, kept_passes=True) as env:
        env.engine.sent_memos.capacity = 0
        run = run_steps(env, 5)
    assert run.outcome == "completed" and run.output == 10
    assert tally.callbacks == Counter({f"s{i}": 1 for i in range(5)})
    assert app.kept_passes.resumed == 0 and tally.finallys == tally.tops


def test_a_lost_result_retried_by_an_operator_runs_the_step_again_and_the_rest_once() -> None:
    tally = Tally()
    app = Ryusen("lost")

    @app.function("abc")
    def abc(data: Any, step: Step) -> Any:
        tally.top()
        try:
            return [step.run(s, lambda s=s: tally.ran(s)) for s in ("a", "b", "c")]
        finally:
            tally.done()

    with WorkflowEnvironment(app, kept_passes=True) as env:
        env.faults.lose_result("b")
        run_id = env.start("abc")
        env.drive(chain=True, stop_when_blocked=run_id)
        blocked = env.get(run_id)
        assert [b["type"] for b in blocked.blockers] == ["unknown_outcome"]
        assert tally.callbacks == Counter({"a": 1, "b": 1})  # c is not reached while b's outcome is Unknown
        env.resolve(run_id, "b", generation=1, action="retry")
        env.drive(chain=True)
        run = env.get(run_id)
        left = len(app.kept_passes)
    assert run.outcome == "completed" and run.output == ["a", "b", "c"]
    assert tally.callbacks == Counter({"a": 1, "b": 2, "c": 1})
    assert tally.finallys == tally.tops and left == 0  # the pass left at c ended at b's retry


def test_an_async_function_is_not_kept() -> None:
    app = Ryusen("async")
    ran: list[str] = []

    @app.function("two")
    async def two(data: Any, step: Step) -> Any:
        return [await step.run(s, lambda s=s: ran.append(s) or s) for s in ("a", "b")]

    with WorkflowEnvironment(app, kept_passes=True) as env:
        run = env.run("two")
    assert run.outcome == "completed" and run.output == ["a", "b"] and ran == ["a", "b"]
    assert app.kept_passes.started == 0 and app.kept_passes.resumed == 0


# ---- what code outside step.run may rely on -------------------------------------------------------------


def memory_app(ran: list[str]) -> Ryusen:
    """A callback leaves its confirmation in memory instead of returning it, and the next step depends on it."""
    app = Ryusen("mem")

    class Booking:
        confirmation: str | None = None

    @app.function("book")
    def book(data: Any, step: Step) -> Any:
        booking = Booking()

        def reserve() -> bool:
            ran.append("reserve")
            booking.confirmation = "CONF-1"
            return True

        step.run("reserve", reserve)
        if booking.confirmation is None:
            step.run("notify", lambda: ran.append("notify") or "notified")
        step.run("archive", lambda: ran.append("archive") or "archived")
        return "booked"

    return app


def test_check_discovery_names_the_step_a_callback_s_memory_decided() -> None:
    ran: list[str] = []
    with (
        WorkflowEnvironment(memory_app(ran), kept_passes=True, check_discovery=True) as env,
        pytest.raises(DiscoveryDivergenceError) as caught,
    ):
        env.run("book")
    message = str(caught.value)
    assert "after step 'reserve'" in message and "'archive'" in message and "'notify'" in message


def test_without_the_check_a_choice_made_from_memory_is_revisited_by_the_next_replay() -> None:
    """What RFD 1 allows ("later discovery may emit different step IDs"), made visible. The kept pass, with
    the confirmation in its memory, skips notify and goes on to archive. The function's end is always
    replayed from the recorded results, and that replay, as a cold endpoint does from the start, sees no
    confirmation: notify is a newly encountered step and runs. Every step still runs once."""
    kept: list[str] = []
    with WorkflowEnvironment(memory_app(kept), kept_passes=True) as env:
        warm = env.run("book")
    cold: list[str] = []
    with WorkflowEnvironment(memory_app(cold), kept_passes=False) as env:
        replayed = env.run("book")
    assert warm.outcome == replayed.outcome == "completed" and warm.output == replayed.output == "booked"
    assert cold == ["reserve", "notify", "archive"]
    assert kept == ["reserve", "archive", "notify"]
    assert [s["id"] for s in warm.steps] == ["reserve", "archive", "notify"]


def test_check_discovery_passes_a_workflow_that_decides_from_recorded_results() -> None:
    tally = Tally()
    app = chain_app(tally)
    with WorkflowEnvironment(app, kept_passes=True, check_discovery=True) as env:
        run = run_steps(env, 8)
    assert run.outcome == "completed" and run.output == 28 and env.discovery_divergences == []
    assert app.kept_passes.resumed == 7


def behind_middleware(env: WorkflowEnvironment, app: Ryusen, on_request: Any) -> None:
    """Serve ``app`` behind a middleware that runs each request in a context of its own, after
    ``on_request(n)`` (n counts the requests from 1) has set what it likes there."""
    url = f"inproc://{app.app_id}"
    inner = env.invoker.apps[url]
    served = iter(range(1, 1_000_000))

    def middleware(method: str, headers: dict[str, str], body: bytes) -> Any:
        def serve() -> Any:
            on_request(next(served))
            return inner(method, headers, body)

        return contextvars.copy_context().run(serve)

    env.invoker.apps[url] = middleware


# ---- a callback runs where the request runs (the attack review of kept passes) ------------------------


@KEPT
def test_a_callback_sees_what_the_function_around_it_set_up_and_its_own_request_s_context(
    kept_passes: bool,
) -> None:
    """The function holds a re-entrant lock around its steps, opens a thread-bound connection, sets a
    contextvar and a decimal context, and keeps a thread-local; its callbacks use each. The endpoint's
    middleware sets a request id. A kept pass runs each callback on the function's own thread, with the
    serving request's contextvars added: each step sees all of it, as a replay on one thread does (the
    second review's reproductions hung, failed, or recorded other values when callbacks ran elsewhere)."""
    guard = threading.RLock()
    tenant: contextvars.ContextVar[str] = contextvars.ContextVar("tenant", default="<unset>")
    request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
    local = threading.local()
    app = Ryusen("affinity")

    @app.function("f")
    def f(data: Any, step: Step) -> Any:
        db = sqlite3.connect(":memory:")
        local.user = "alice"
        token = tenant.set(data["tenant"])
        rows = []
        try:
            with guard, decimal.localcontext() as precision:
                precision.prec = 4
                for i in range(3):

                    def effect(i: int = i) -> list[Any]:
                        with guard:
                            db.execute("create table if not exists t(x)")
                            db.execute("insert into t values (?)", (i,))
                        third = str(decimal.Decimal(1) / decimal.Decimal(3))
                        return [i, tenant.get(), local.user, third, request_id.get()]

                    rows.append(step.run(f"s{i}", effect))
            return rows
        finally:
            tenant.reset(token)
            db.close()

    with WorkflowEnvironment(app, kept_passes=kept_passes) as env:
        behind_middleware(env, app, lambda n: request_id.set(f"req-{n}"))
        done = threading.Event()
        box: dict[str, Any] = {}

        def drive() -> None:
            box["run"] = env.run("f", {"tenant": "acme"})
            done.set()

        threading.Thread(target=drive, daemon=True).start()
        assert done.wait(20), "the run hung"
    run = box["run"]
    assert run.outcome == "completed", run.error
    assert [row[:4] for row in run.output] == [[i, "acme", "alice", "0.3333"] for i in range(3)]
    ids = [row[4] for row in run.output]
    assert len(set(ids)) == 3 and all(i and i.startswith("req-") for i in ids)
    if kept_passes:
        assert app.kept_passes.resumed == 2


def test_a_callback_that_waits_on_what_its_request_holds_is_answered_as_unknown_and_submitted_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The request's thread holds a lock the callback needs (a middleware's), and the callback runs on the
    pass thread: the request stops waiting a while after the server stopped listening (``respond_by``, plus
    ``KEPT_GIVE_UP_AFTER_S``, shortened here); once it lets the lock go, the callback finishes, its outcome
    goes to the late-result path, the server records it, and the pass ends (its ``finally`` runs). Nothing
    hangs (the first review's reproduction hung forever)."""
    guard = threading.Lock()
    app = Ryusen("held", insecure=True)
    finished = threading.Event()
    monkeypatch.setattr(sdk_app, "KEPT_GIVE_UP_AFTER_S", 0.2)

    @app.function("f")
    def f(data: Any, step: Step) -> Any:
        try:

            def charge() -> int:
                with guard:
                    return 10

            return step.run("a", charge) + step.run("b", lambda: 1)
        finally:
            finished.set()

    server = ResultServer(app)
    try:
        request = server.authorized("a", respond_by=time.time() + 0.3)
        with guard, pytest.raises(sdk_app.CallbackInterruptedError, match="after the server stopped listening"):
            app.execute(request, request)
        assert finished.wait(30)
        recorded = server.recorded("a")  # the late result goes on a thread of its own, to the server
        assert recorded["status"] == "completed" and recorded["result"] == 10
        assert [a["status"] for a in recorded["attempts"]] == ["succeeded"]
        assert len(app.kept_passes) == 0
    finally:
        server.close()


def test_a_pass_still_kept_when_the_process_exits_runs_its_finally(tmp_path: Path) -> None:
    marker = tmp_path / "finally-ran"
    script = f"""
from ryusen import Ryusen, Step
from ryusen._internal.wire import OperationInfo, Phase, TaskKind, TaskRequest
app = Ryusen("exit", insecure=True)
@app.function("f")
def f(data, step: Step):
    try:
        return step.run("a", lambda: 1) + step.run("b", lambda: 2)
    finally:
        open({str(marker)!r}, "w").write("ran")
request = TaskRequest(kind=TaskKind.FORWARD, run_id="r1", function_id="f", input={{}}, memo={{}}, step_id="a",
    operation=OperationInfo(id="op-a", phase=Phase.FORWARD, generation=1), continue_after=True, memo_token="t1")
response = app.execute(request, request)
assert response.next.step.id == "b" and len(app.kept_passes) == 1
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert marker.read_text() == "ran"


def chained_request(step_id: str = "a") -> TaskRequest:
    return TaskRequest(
        kind=TaskKind.FORWARD,
        run_id="r1",
        function_id="f",
        input={},
        memo={},
        step_id=step_id,
        operation=OperationInfo(id=f"op-{step_id}", phase=Phase.FORWARD, generation=1),
        continue_after=True,
        memo_token="t1",
    )


class ResultServer:
    """The server's side of a late result: an engine (in a ``WorkflowEnvironment``) that holds a run whose
    attempt is authorized, behind a real result URL the SDK posts to, as a deployment's is."""

    def __init__(self, app: Ryusen) -> None:
        self.env = WorkflowEnvironment(app, signing=False)  # the app is insecure: it sends late results unsigned
        self.refused: list[str] = []
        self.server = make_server("127.0.0.1", 0, self.wsgi, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/results"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wsgi(self, environ: dict[str, Any], start_response: Any) -> Any:
        request = Request(environ)
        try:
            self.env.engine.submit_late_result(request.get_data(), dict(request.headers))
        except Exception as exc:  # noqa: BLE001 - whatever the engine refused, the test reads it
            self.refused.append(repr(exc))
            return Response("refused", status=409)(environ, start_response)
        return Response("{}", status=200)(environ, start_response)

    def authorized(self, step_id: str, *, respond_by: float) -> TaskRequest:
        """Start a run of ``f`` and authorize its attempt at ``step_id`` (the dispatcher dies before sending it):
        the request that attempt's dispatcher would send, with ``respond_by``."""
        env = self.env
        env.faults.crash_before_invoke(step_id)
        self.run_id = env.start("f", {})
        env.drive(until=lambda: any(a["status"] == "authorized" for a in self.attempts(step_id)))
        [attempt] = self.attempts(step_id)
        return chained_request(step_id).model_copy(
            update={
                "run_id": self.run_id,
                "operation": OperationInfo(id=attempt["operation_id"], phase=Phase.FORWARD, generation=1),
                "result_url": self.url,
                "respond_by": respond_by,
            }
        )

    def attempts(self, step_id: str) -> list[dict[str, Any]]:
        run = self.env.get(self.run_id)
        return run.attempts(step_id) if any(s["id"] == step_id for s in run.steps) else []

    def recorded(self, step_id: str) -> dict[str, Any]:
        """The step as the server recorded it, once its attempt settled (polled, with a generous limit)."""
        settled = wait_for(
            lambda: self.refused or [a for a in self.attempts(step_id) if a["status"] not in ("queued", "authorized")],
            timeout=30,
            what=f"the server to record the late result of {step_id}",
        )
        assert not self.refused, self.refused
        assert len(settled) == 1, settled
        return self.env.get(self.run_id).step(step_id)

    def close(self) -> None:
        self.server.shutdown()
        self.env.close()


def test_slow_code_after_a_step_spends_the_continuation_budget_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass still going when the budget after its callback ends is not kept, and the answer goes without a
    next step (the server runs the discovery as a task): no second replay with a budget of its own."""
    monkeypatch.setattr(sdk_app, "CONTINUATION_MAX_S", 0.2)
    app = Ryusen("slow", insecure=True)
    tops: list[int] = []
    ran: list[str] = []
    answered = threading.Event()
    finished = threading.Event()

    @app.function("f")
    def f(data: Any, step: Step) -> Any:
        tops.append(1)
        try:
            a = step.run("a", lambda: ran.append("a") or 1)
            answered.wait(30)  # slow code after the step: it lasts until the request has been answered
            return [a, step.run("b", lambda: ran.append("b") or 2)]
        finally:
            finished.set()

    request = chained_request()
    response = app.execute(request, request)
    answered.set()
    assert response.attempt is not None and response.attempt.type == "succeeded" and response.next is None
    assert len(app.kept_passes) == 0 and len(tops) == 1  # no replay from the top after the budget
    assert finished.wait(30), "the pass did not end"
    assert ran == ["a"] and len(tops) == 1  # the pass that outlasted its budget ran nothing more
    app.kept_passes.clear(wait_s=5)


def test_a_failure_only_the_kept_pass_met_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Code between steps raises once, in the kept pass; the replay from the recorded results that decides
    what the run does does not. The run goes on, and the log says what the pass met."""
    app = Ryusen("flaky")
    state = {"after_a": False, "failed": False}

    def check_quota() -> None:
        if state["after_a"] and not state["failed"]:
            state["failed"] = True
            raise RuntimeError("quota service unavailable")

    @app.function("f")
    def f(data: Any, step: Step) -> Any:
        a = step.run("a", lambda: state.update(after_a=True) or 1)
        check_quota()
        return [a, step.run("b", lambda: 2)]

    with caplog.at_level(logging.WARNING, logger="ryusen"), WorkflowEnvironment(app, kept_passes=True) as env:
        run = env.run("f")
    assert run.outcome == "completed" and run.output == [1, 2]
    assert any(
        "after step 'a' the function raised RuntimeError: quota service unavailable" in r.getMessage()
        for r in caplog.records
    )


def test_a_callback_still_runs_and_goes_late_when_its_request_gave_up_before_it_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slow code before the step outlasts the request's patience: as without a kept pass, the callback still
    runs (its attempt is authorized) and its outcome is submitted late, so the attempt settles, as the server
    records, instead of turning Unknown (the third review found it answered 500 and ran nothing)."""
    app = Ryusen("slow-setup", insecure=True)
    ran: list[str] = []
    slow, gave_up = threading.Event(), threading.Event()
    monkeypatch.setattr(sdk_app, "KEPT_GIVE_UP_AFTER_S", 0.1)

    @app.function("f")
    def f(data: Any, step: Step) -> Any:
        if slow.is_set():  # slow code before the step, in the attempt's pass: until the request has given up
            gave_up.wait(30)
        return step.run("a", lambda: ran.append("a") or 10) + step.run("b", lambda: 1)

    server = ResultServer(app)
    try:
        request = server.authorized("a", respond_by=time.time() + 0.1)
        slow.set()
        with pytest.raises(sdk_app.CallbackInterruptedError):
            app.execute(request, request)
        gave_up.set()
        recorded = server.recorded("a")
        assert ran == ["a"]
        assert recorded["status"] == "completed" and recorded["result"] == 10
        assert [a["status"] for a in recorded["attempts"]] == ["succeeded"]
        app.kept_passes.clear(wait_s=5)
        assert len(app.kept_passes) == 0
    finally:
        server.close()


def test_a_callback_sees_its_own_request_s_context_and_not_an_earlier_one_s() -> None:
    """A middleware sets a trace span only on the request that started the pass; the callbacks of later
    requests must not see it (the third review: they did), and what a callback sets does not reach the
    function around it."""
    span: contextvars.ContextVar[str | None] = contextvars.ContextVar("span", default=None)
    marker: contextvars.ContextVar[str | None] = contextvars.ContextVar("marker", default=None)
    app = Ryusen("spans")
    seen_by_body: list[str | None] = []

    def effect(i: int) -> list[Any]:
        value = span.get()
        marker.set(f"set-by-s{i}")
        return [i, value]

    @app.function("f")
    def f(data: Any, step: Step) -> Any:
        rows = []
        for i in range(3):
            rows.append(step.run(f"s{i}", effect, i))
            seen_by_body.append(marker.get())
        return rows

    with WorkflowEnvironment(app, kept_passes=True) as env:
        # request 1 is the discovery, request 2 starts the pass at s0
        behind_middleware(env, app, lambda n: span.set("span-of-request-2") if n == 2 else None)
        run = env.run("f")
    assert run.outcome == "completed"
    assert run.output == [[0, "span-of-request-2"], [1, None], [2, None]]
    assert app.kept_passes.resumed == 2
    assert all(value is None for value in seen_by_body)


def test_a_request_that_fails_while_it_waits_ends_its_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The request raises after the pass went on to the next step (an interrupt, a server shutting down):
    the pass is not kept, so it must end now rather than wait out its idle time (the second review: it
    waited with nobody to end it)."""
    app = Ryusen("gone", insecure=True)
    app.kept_passes.idle_s = 60.0
    finished = threading.Event()

    @app.function("f")
    def f(data: Any, step: Step) -> Any:
        try:
            return step.run("a", lambda: 1) + step.run("b", lambda: 2)
        finally:
            finished.set()

    answer = sdk_app.LivePass.answer

    def answer_then_fail(self: Any, *args: Any) -> Any:
        answer(self, *args)
        raise KeyboardInterrupt

    monkeypatch.setattr(sdk_app.LivePass, "answer", answer_then_fail)
    request = chained_request()
    with pytest.raises(KeyboardInterrupt):
        app.execute(request, request)
    assert finished.wait(5), "the pass still waits at step b"
    assert len(app.kept_passes) == 0

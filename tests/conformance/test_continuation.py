"""The continuation after a callback is a discovery pass, and changes nothing a discovery pass would decide.

With chaining (the default), a forward attempt's request asks the SDK to go on after a successful callback:
it replays the function from the top with that result recorded, as the discovery task the server would send
next, on a budget of its own, and reports it with the callback's outcome. Each test runs the same workflow
with chaining off and on and expects the same run: what a review of the first design found (the rest of the
same execution was used instead, on the callback's clock).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from werkzeug.serving import make_server

from ryusen import ConcurrentStepError, RetryPolicy, Ryusen, Step
from ryusen._internal.serve import wsgi_app
from ryusen._internal.wire import FEATURES_HEADER, TaskKind, TaskRequest
from ryusen.testing import WorkflowEnvironment
from ryusen_server.core.events import EngineSettings
from ryusen_server.core.view import run_view
from ryusen_server.engine import Engine, ServerSettings
from ryusen_server.invoker import HttpInvoker
from ryusen_server.memory import MemoryQueue, MemoryStore, MemoryTimers
from ryusen_server.runtime import fire_due, handle_message
from ryusen_server.urls import EndpointPolicy
from ryusen_server.wiring import fetch_manifest

MASTER = "continuation-tests-master-key"

CHAINING = pytest.mark.parametrize("chain_steps", [False, True], ids=["one task per message", "chained"])


@CHAINING
def test_a_step_from_another_thread_is_refused_until_a_release_runs_it_on_the_function_s_thread(
    chain_steps: bool,
) -> None:
    """A thread's ``step.run`` is refused however it overlaps the function's own step (decisions 18), even when
    the function handles the refusal: the run blocks, no callback runs, and a release that starts the step from
    the function's own thread wakes it."""
    ran: list[str] = []

    def release(threaded: bool) -> Ryusen:
        app = Ryusen("threads", release_id=f"threaded-{threaded}", build_id=f"b-{threaded}")

        @app.function("fan")
        def fan(data: Any, step: Step) -> Any:
            def best_effort_b() -> Any:
                try:
                    return step.run("b", lambda: ran.append("b") or 2)
                except ConcurrentStepError:
                    return "b-later"

            if not threaded:
                return [step.run("a", lambda: ran.append("a") or 1), best_effort_b()]
            with ThreadPoolExecutor(2) as pool:
                second = pool.submit(best_effort_b)
                return [step.run("a", lambda: ran.append("a") or 1), second.result()]

        return app

    env = WorkflowEnvironment(release(threaded=True), chain_steps=chain_steps)
    run_id = env.start("fan")
    [blocker] = env.wait(run_id).blockers
    assert blocker["type"] == "concurrent_step" and blocker["second"]["step_id"] == "b" and ran == []
    env.sync(release(threaded=False))
    run = env.wait(run_id)
    assert run.outcome == "completed" and run.output == [1, 2]
    assert [s["id"] for s in run.steps] == ["a", "b"] and Counter(ran) == Counter({"a": 1, "b": 1})


@CHAINING
def test_what_a_callback_left_in_memory_does_not_decide_the_next_step(chain_steps: bool) -> None:
    """The callback sets an attribute of an object its pass created, instead of returning it. Every replay
    from the recorded results sees the attribute unset. The kept pass that goes on after the callback sees
    it set and reaches the function's end; an end is always replayed from the recorded results, and that
    replay finds notify (test_kept_passes shows a choice from memory followed by a step of its own)."""
    app = Ryusen("mem")
    ran: list[str] = []

    class Booking:
        confirmation: str | None = None

    @app.function("book")
    def book(data: Any, step: Step) -> Any:
        booking = Booking()

        def reserve() -> bool:
            ran.append("reserve")
            booking.confirmation = "CONF-1"  # not part of the recorded result
            return True

        step.run("reserve", reserve)
        if booking.confirmation is None:
            step.run("notify", lambda: ran.append("notify") or "notified")
        return {"confirmation": booking.confirmation}

    run = WorkflowEnvironment(app, chain_steps=chain_steps).run("book")
    assert run.outcome == "completed" and run.output == {"confirmation": None}
    assert ran == ["reserve", "notify"]


def shop_release(variant: str, ran: list[str], deploys: list[Any]) -> Ryusen:
    """Release a ends after ship; release b adds a receipt. Ship's callback runs what ``deploys`` holds."""
    app = Ryusen("shop", release_id=f"r-{variant}", build_id=f"b-{variant}")

    def ship() -> str:
        ran.append(f"ship@{variant}")
        while deploys:
            deploys.pop()()
        return "shipped"

    @app.function("order")
    def order(data: Any, step: Step) -> str:
        step.run("ship", ship)
        if variant == "b":
            step.run("receipt", lambda: ran.append(f"receipt@{variant}") or "sent")
        return "done"

    return app


@CHAINING
def test_a_release_synced_while_a_callback_runs_decides_what_comes_next(chain_steps: bool) -> None:
    """Release a ends after ship; release b, synced while ship's callback runs, adds a receipt. The task after
    ship runs the newest release (decisions 5), so the receipt is sent, whatever a's code said next."""
    ran: list[str] = []
    deploys: list[Any] = []

    def build(variant: str) -> Ryusen:
        return shop_release(variant, ran, deploys)

    env = WorkflowEnvironment(build("a"), chain_steps=chain_steps)
    deploys.append(lambda: env.sync(build("b")))
    run = env.run("order")
    assert run.outcome == "completed" and [s["id"] for s in run.steps] == ["ship", "receipt"]
    assert ran == ["ship@a", "receipt@b"]


@pytest.mark.parametrize(
    ("recheck_s", "ran_after_ship"),
    [(0.0, ["receipt@b"]), (3600.0, [])],
    ids=["read after every callback", "within release_recheck_s"],
)
def test_a_release_synced_through_another_process_reaches_a_chain_within_release_recheck_s(
    recheck_s: float, ran_after_ship: list[str]
) -> None:
    """A chaining dispatcher reads the newest release after a callback only once ``release_recheck_s`` has
    passed since it last read it (the read was one per step). Release b is synced through another engine
    process while ship's callback runs: with 0 the step after ship is b's; within the recheck time the chain
    goes on with a's answer, as if b had landed just after it. A sync through the same process is seen at
    once (the test above)."""
    ran: list[str] = []
    deploys: list[Any] = []

    def build(variant: str) -> Ryusen:
        return shop_release(variant, ran, deploys)

    env = WorkflowEnvironment(build("a"))
    env.engine.settings = replace(env.engine.settings, release_recheck_s=recheck_s)

    def sync_through_another_process() -> None:
        this = env.engine
        env.engine = Engine(
            store=this.store, queue=this.queue, timers=this.timers, invoker=this.invoker, settings=this.settings
        )
        try:
            env.sync(build("b"))
        finally:
            env.engine = this

    deploys.append(sync_through_another_process)
    run = env.run("order")
    assert run.outcome == "completed" and ran == ["ship@a", *ran_after_ship]
    assert run.step("ship")["attempts"][0]["release_id"] == "r-a"


def test_a_recheck_of_the_newest_release_is_an_eventually_consistent_read_once_it_was_read() -> None:
    """The recheck is the one read left on a step's path: after a process's first (consistent) read of a
    function's release, it rechecks with an eventually consistent read, half the read units (issue 25)."""
    ran: list[str] = []
    env = WorkflowEnvironment(shop_release("b", ran, []), store="moto")
    env.engine.settings = replace(env.engine.settings, release_recheck_s=1e-9)  # rechecked after every callback
    reads: list[bool] = []
    read = env.store.get_release

    def spy(function_id: str, *, consistent: bool = True) -> Any:
        reads.append(consistent)
        return read(function_id, consistent=consistent)

    env.store.get_release = spy  # type: ignore[method-assign]
    try:
        assert env.run("order").outcome == "completed" and ran == ["ship@b", "receipt@b"]
        # consistent: the first read, and a new message's (it reads afresh); every recheck after a callback not
        assert reads[0] is True and reads.count(False) >= 2 and reads.count(True) <= 2, reads
    finally:
        env.close()


def test_a_lagging_copy_that_names_the_release_before_never_takes_a_chain_back_to_it() -> None:
    """An eventually consistent read may answer from a copy that has not seen the last sync: the release it
    names differs from the one this process remembers, so it is read again consistently, and the chain goes on
    with the newest (R1), never the one it replaced."""
    ran: list[str] = []
    deploys: list[Any] = []
    env = WorkflowEnvironment(shop_release("a", ran, deploys))
    env.engine.settings = replace(env.engine.settings, release_recheck_s=1e-9)  # rechecked after every callback
    old = env.store.get_release("order")
    read = env.store.get_release
    lagging: list[bool] = []

    def lagging_copy(function_id: str, *, consistent: bool = True) -> Any:
        if not consistent:
            lagging.append(True)
            return old  # the copy has not seen release b
        return read(function_id, consistent=consistent)

    env.store.get_release = lagging_copy  # type: ignore[method-assign]
    deploys.append(lambda: env.sync(shop_release("b", ran, deploys)))  # synced while ship's callback runs
    run = env.run("order")
    assert run.outcome == "completed" and ran == ["ship@a", "receipt@b"], ran
    assert lagging, "the chain rechecked the release through the lagging copy"
    assert run.step("receipt")["attempts"][0]["release_id"] == "r-b"


@pytest.mark.parametrize("consistent", [False, True], ids=["a lagging recheck", "a consistent read begun first"])
def test_a_read_of_the_release_that_answers_late_never_takes_a_process_back(consistent: bool) -> None:
    """Two dispatcher threads of one process read the release at once, and the slower answers with the release
    before (a copy that lags, or a consistent read begun before the sync): the process keeps the newer one the
    other thread read. (The simulator found the lagging recheck taking a process back; seed 9750.)"""
    env = WorkflowEnvironment(shop_release("a", [], []))
    engine = env.engine
    engine.settings = replace(engine.settings, release_recheck_s=1e-9)
    old = engine._newest_release("order")  # read once: a recheck comes next
    assert old is not None and old.release_id == "r-a"
    env.engine = Engine(store=env.store, queue=engine.queue, timers=engine.timers, invoker=engine.invoker)
    env.sync(shop_release("b", [], []))  # through another process: this one still remembers a
    env.engine = engine
    read = env.store.get_release
    slow: list[str] = []

    def interleaved(function_id: str, *, consistent: bool = True) -> Any:
        if not slow and consistent == wanted:
            slow.append("in flight")
            other = engine._newest_release(function_id)  # the other thread, while this read is in flight
            assert other is not None and other.release_id == "r-b"
            return old  # this read answers last, with the release before
        return read(function_id, consistent=consistent)

    wanted = consistent
    env.store.get_release = interleaved  # type: ignore[method-assign]
    first = engine._read_release("order") if consistent else engine._newest_release("order")
    assert slow == ["in flight"]
    assert first is not None and first.release_id == "r-b", first
    again = engine._newest_release("order")
    assert again is not None and again.release_id == "r-b"


# ---- over HTTP: the continuation has a budget of its own --------------------------------------------------


class HttpEngine:
    """The engine on its in-memory store and queue, on wall time, calling an app served over real HTTP."""

    def __init__(
        self, app: Any, *, settings: EngineSettings, chain: bool = True, master_key: str | None = MASTER
    ) -> None:
        self.server = make_server("127.0.0.1", 0, app, threaded=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/"

        def clock() -> datetime:
            return datetime.now(UTC)

        self.store, self.queue, self.timers = MemoryStore(), MemoryQueue(clock), MemoryTimers(clock)
        self.engine = Engine(
            store=self.store,
            queue=self.queue,
            timers=self.timers,
            invoker=HttpInvoker(),
            settings=ServerSettings(engine=settings, chain=chain, master_key=master_key),
            clock=clock,
        )

    def sync(self, app_id: str) -> None:
        manifest, features = fetch_manifest(
            self.url, app_id=app_id, policy=EndpointPolicy.local(), keys=self.engine.app_keys
        )
        self.engine.sync_release(app_id, self.url, manifest, features)

    def drive(self, run_id: str, seconds: float) -> dict[str, Any]:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            fire_due(self.engine, self.timers.due)
            for message in self.queue.receive(1):
                handle_message(self.engine, self.queue, message, message.message_id)
            view = run_view(self.store.peek(run_id))
            if view["phase"] == "finished":
                return view
            time.sleep(0.02)
        return run_view(self.store.peek(run_id))

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def slow_after_charge() -> tuple[Ryusen, Counter[str]]:
    app = Ryusen("slow", master_key=MASTER)
    calls: Counter[str] = Counter()

    @app.function("pay")
    def pay(data: Any, step: Step) -> str:
        policy = RetryPolicy(max_attempts=3, initial_delay=timedelta(seconds=0.1), on_unknown=data["on_unknown"])
        step.run("charge", lambda: calls.update(["charge"]) or "charged", timeout=timedelta(seconds=1), retry=policy)
        time.sleep(4.0)  # ordinary code between steps (an external read), longer than the step's timeout
        return "ok"

    return app, calls


@pytest.mark.parametrize("on_unknown", ["block", "retry"])
def test_slow_code_after_a_step_does_not_count_against_its_timeout(
    slow_after_charge: tuple[Ryusen, Counter[str]], on_unknown: str
) -> None:
    """The charge's callback answers at once; the code after it takes longer than the charge's timeout. The
    charge is accepted as it ran (not Unknown, not run again), and the slow pass is the server's own task."""
    app, calls = slow_after_charge
    http = HttpEngine(wsgi_app(app), settings=EngineSettings(lease_grace_s=1.0))
    try:
        http.sync("slow")
        state, _ = http.engine.start_run("pay", {"on_unknown": on_unknown})
        view = http.drive(state.id, 30)
    finally:
        http.close()
    assert view["outcome"] == "completed" and view["blockers"] == []
    assert [a["status"] for a in view["steps"][0]["attempts"]] == ["succeeded"] and calls["charge"] == 1


# ---- an app on an SDK that predates continuation ---------------------------------------------------------

PROTOCOL_1_REQUEST_FIELDS = {
    "protocol",
    "kind",
    "run_id",
    "function_id",
    "input",
    "memo",
    "step_id",
    "operation",
    "forward_result",
    "result_url",
    "respond_by",
}
"""What a TaskRequest held before continuation: an SDK of then refuses any other field (400)."""


def test_an_app_on_an_sdk_without_continuation_still_runs_with_chaining_on() -> None:
    """Its manifest announces no features: the server never sends it ``continue_after`` (which its wire
    models would refuse), and chains through separate discovery passes instead."""
    app = Ryusen("legacy", insecure=True)  # an SDK without signing_v2 is served only by an unkeyed server
    calls: Counter[str] = Counter()

    @app.function("two")
    def two(data: Any, step: Step) -> Any:
        return [step.run(name, lambda name=name: calls.update([name]) or name) for name in ("a", "b")]

    handler = wsgi_app(app)
    kinds: Counter[str] = Counter()
    refused: list[str] = []

    def previous_sdk(environ: dict[str, Any], start_response: Any) -> Any:
        if environ["REQUEST_METHOD"] == "POST":
            length = int(environ.get("CONTENT_LENGTH") or 0)
            body = environ["wsgi.input"].read(length)
            unknown = set(json.loads(body)) - PROTOCOL_1_REQUEST_FIELDS
            if unknown:
                refused.append(",".join(sorted(unknown)))
                start_response("400 Bad Request", [("content-type", "application/json")])
                return [b'{"error": {"code": "invalid_task_request"}}']
            kinds[TaskRequest.model_validate_json(body).kind.value] += 1
            import io

            environ["wsgi.input"] = io.BytesIO(body)

        def without_features(status: str, headers: list[tuple[str, str]], *rest: Any) -> Any:
            kept = [(k, v) for k, v in headers if k.lower() != FEATURES_HEADER.lower()]
            return start_response(status, kept, *rest)

        return handler(environ, without_features)

    http = HttpEngine(previous_sdk, settings=EngineSettings(), master_key=None)
    try:
        http.sync("legacy")
        assert http.store.get_release("two") is not None and http.store.get_release("two").features == frozenset()  # type: ignore[union-attr]
        state, _ = http.engine.start_run("two", None)
        view = http.drive(state.id, 20)
    finally:
        http.close()
    assert refused == [] and view["outcome"] == "completed" and view["output"] == ["a", "b"]
    assert calls == Counter({"a": 1, "b": 1})
    assert kinds == Counter({"discover": 3, "forward": 2})  # each answer needs its discovery pass, as before


def test_a_response_without_a_continuation_has_only_protocol_1_fields() -> None:
    """A server that predates continuation refuses unknown response fields: ``next`` is sent only when the
    request asked for it and there is one."""
    app = Ryusen("plain")

    @app.function("one")
    def one(data: Any, step: Step) -> Any:
        return step.run("a", lambda: "a")

    env = WorkflowEnvironment(app)
    bodies: list[dict[str, Any]] = []
    endpoint = env.invoker.apps["inproc://plain"]

    def recording(method: str, headers: dict[str, str], body: bytes) -> Any:
        response = endpoint(method, headers, body)
        bodies.append({"kind": TaskRequest.model_validate_json(body).kind, "response": json.loads(response.body)})
        return response

    env.invoker.apps["inproc://plain"] = recording
    env.engine.settings = replace(env.engine.settings, chain=False)
    assert env.run("one").outcome == "completed"
    forward = [b["response"] for b in bodies if b["kind"] is TaskKind.FORWARD]
    assert forward and all(set(r) == {"protocol", "kind", "run_id", "attempt", "discovery"} for r in forward)


# ---- the dispatch message while chaining -------------------------------------------------------------------


def test_a_chain_extends_its_message_only_when_the_next_lease_needs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The message must come back no later than the lease of the task in flight; a chain of quick steps
    extends it once less than half a lease is left, not at every step."""
    from ryusen_server import engine as engine_module

    now = [1000.0]
    monkeypatch.setattr(engine_module.time, "monotonic", lambda: now[0])
    changes: list[tuple[float, float]] = []
    lease = engine_module._MessageLease(lambda seconds: changes.append((now[0], seconds)))
    lease.cover(61.0)  # the first task: the message becomes its lease
    for _ in range(60):  # sixty one-second steps, each with a 61 s lease
        now[0] += 1.0
        lease.cover(61.0)
    assert [at for at, _ in changes] == [1000.0, 1031.0]  # every ~30 s, not every step
    covered_until = changes[-1][0] + changes[-1][1]
    assert covered_until >= now[0] + 61.0 / 2  # it comes back before the current task's lease runs out
    now[0] += 1.0
    lease.cover(360.0)  # a long step next: its lease is more than what is left
    assert changes[-1] == (now[0], 360.0)


def test_a_chain_hands_over_to_the_queue_after_its_window_so_other_runs_get_a_dispatcher() -> None:
    app = Ryusen("fair")

    @app.function("three")
    def three(data: Any, step: Step) -> Any:
        return [step.run(f"s{i}", lambda i=i: i) for i in range(3)]

    env = WorkflowEnvironment(app)
    env.engine.settings = replace(env.engine.settings, chain_window_s=0.0)
    received: list[str] = []
    receive = env.queue.receive

    def counting(max_messages: int = 1) -> Any:
        messages = receive(max_messages)
        received.extend(m.task.run_id for m in messages)
        return messages

    env.queue.receive = counting  # type: ignore[method-assign]
    first, second = env.start("three"), env.start("three")
    env.drive()
    assert env.get(first).output == [0, 1, 2] and env.get(second).output == [0, 1, 2]
    assert received.index(second) < len(received) - received[::-1].index(first) - 1  # the runs took turns

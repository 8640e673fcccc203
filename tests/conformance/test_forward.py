"""F: forward execution, end to end through the engine and the SDK (ryusen.testing, in-process)."""

from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

from ryusen import NonRetryableError, RetryPolicy, Ryusen, Step, StepFailed
from ryusen.testing import WorkflowEnvironment
from ryusen_server.core.events import TaskDelivered
from ryusen_server.core.model import TaskRef


def make_env(app: Ryusen, *, chain_steps: bool = True) -> WorkflowEnvironment:
    return WorkflowEnvironment(app, chain_steps=chain_steps)


@pytest.mark.rfd("F1")
def test_new_run_is_running_with_first_discovery_queued() -> None:
    app = Ryusen("f1")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        return data

    env = make_env(app)
    run_id = env.start("wf", {"x": 1})
    run = env.get(run_id)
    assert run.phase == "running"
    assert run.outcome is None and run.recovery is None
    assert run["discovery"]["status"] == "queued" and run["discovery"]["seq"] == 1
    assert [t.kind.value for t in env.pending_tasks()] == ["discover"]
    assert env.wait(run_id).outcome == "completed"


@pytest.mark.rfd("F2", "F11")
def test_accepted_result_is_memoized_and_output_recorded() -> None:
    app = Ryusen("f2")
    calls: Counter[str] = Counter()

    def effect(name: str) -> dict[str, str]:
        calls[name] += 1
        return {"done": name}

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        a = step.run("a", effect, "a")
        b = step.run("b", effect, "b")
        return {"a": a, "b": b}

    env = make_env(app)
    run = env.run("wf", None)
    assert run.outcome == "completed"
    assert run.output == {"a": {"done": "a"}, "b": {"done": "b"}}  # F11
    assert calls == Counter({"a": 1, "b": 1})  # F2: never again after acceptance
    assert run["discoveries"] == 3  # every pass after acceptance returned the recorded result
    assert [len(s["attempts"]) for s in run.steps] == [1, 1]


@pytest.mark.rfd("F2")
def test_duplicate_delivery_never_reruns_an_accepted_step() -> None:
    app = Ryusen("f2dup")
    calls: Counter[str] = Counter()

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        return step.run("a", lambda: calls.update(["a"]) or 1)

    env = make_env(app)
    env.faults.duplicate_messages = True
    run = env.run("wf")
    assert run.outcome == "completed"
    assert calls["a"] == 1
    # a late redelivery of the forward task after acceptance changes nothing
    state = env.engine.get_run(run.id)
    decision = env.engine.apply(
        run.id, TaskDelivered(task=TaskRef(run_id=run.id, kind="forward", step_id="a", generation=1), release=None)
    )
    assert not decision.changed
    assert env.engine.get_run(run.id).version == state.version


@pytest.mark.rfd("F3")
def test_code_outside_steps_reruns_and_new_ids_execute() -> None:
    app = Ryusen("f3")
    passes: list[int] = []
    calls: Counter[str] = Counter()

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        passes.append(1)  # outside step.run: runs on every pass
        first = step.run("first", lambda: calls.update(["first"]) or "one")
        if len(passes) >= 3:  # a later pass takes a branch the earlier ones did not
            step.run("late-branch", lambda: calls.update(["late"]) or "new")
        return first

    env = make_env(app, chain_steps=False)  # one pass per task, so that the third is a discovery
    run = env.run("wf")
    assert run.outcome == "completed"
    assert len(passes) >= 4  # discovery ×3 plus forward replays
    assert calls == Counter({"first": 1, "late": 1})
    assert [s["id"] for s in run.steps] == ["first", "late-branch"]
    assert run.step("first")["result"] == "one"


@pytest.mark.rfd("F4", "F5")
def test_retries_are_invisible_and_exhaustion_records_one_terminal_failure() -> None:
    app = Ryusen("f4")
    seen_by_function: list[str] = []
    attempts: Counter[str] = Counter()

    def flaky() -> str:
        attempts["flaky"] += 1
        raise ConnectionError(f"boom {attempts['flaky']}")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        try:
            step.run("flaky", flaky, retry=RetryPolicy(max_attempts=3, initial_delay=timedelta(seconds=2)))
        except StepFailed as failure:
            seen_by_function.append(failure.message)
            return "handled"
        return "ok"

    env = make_env(app)
    run_id = env.start("wf")
    # drive until the second attempt has failed: the function has seen nothing yet (F4)
    env.drive(until=lambda: attempts["flaky"] == 2)
    assert seen_by_function == []
    assert env.get(run_id).step("flaky")["status"] in ("pending", "running")
    run = env.wait(run_id)
    assert attempts["flaky"] == 3
    forward = run.attempts("flaky")
    assert [a["status"] for a in forward] == ["failed", "failed", "failed"]
    # backoff: generation 2 waited 1-2 s (equal jitter around 2 s), generation 3 2-4 s
    from datetime import datetime

    def delay(a: dict[str, Any]) -> float:
        return (datetime.fromisoformat(a["not_before"]) - datetime.fromisoformat(a["queued_at"])).total_seconds()

    assert 1.0 <= delay(forward[1]) <= 2.0
    assert 2.0 <= delay(forward[2]) <= 4.0
    # F5: exactly one terminal failure, seen once on replay; the run was not failed by exhaustion
    assert seen_by_function == ["boom 3"]
    assert run.step("flaky")["status"] == "failed"
    assert run.outcome == "completed" and run.output == "handled"


@pytest.mark.rfd("F5", "F7")
def test_exhaustion_schedules_discovery_and_the_adapter_response_fails_the_run() -> None:
    app = Ryusen("f5")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        step.run("bad", lambda: 1 / 0, retry=RetryPolicy(max_attempts=2, initial_delay=timedelta(seconds=1)))
        return "unreachable"

    env = make_env(app)
    run_id = env.start("wf")
    env.drive(until=lambda: env.get(run_id).step("bad")["status"] == "failed" if env.get(run_id).steps else False)
    after_exhaustion = env.get(run_id)
    assert after_exhaustion.outcome is None  # not failed by the exhaustion itself
    assert after_exhaustion["discovery"]["status"] == "queued"
    run = env.wait(run_id)
    assert run.outcome == "failed"  # F7: the uncaught StepFailed reached the entry adapter
    assert run.error["type"] == "StepFailed"
    assert run.recovery == "not_required" and run.phase == "finished"


@pytest.mark.rfd("F6", "F8", "C9")
def test_handled_failure_completes_without_compensation_and_stays_visible() -> None:
    app = Ryusen("f6")
    compensated: list[str] = []

    def decline() -> None:
        raise NonRetryableError("declined", data={"code": 51})

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        step.run("reserve", lambda: "r1", compensate=lambda r: compensated.append(r))
        try:
            step.run("charge", decline, compensate=lambda r: compensated.append("charge"))
        except StepFailed as failure:
            assert failure.step_id == "charge"
            assert failure.error_type == "NonRetryableError" and failure.data == {"code": 51}
            return step.run("fallback", lambda: "invoice")
        return "charged"

    env = make_env(app)
    run = env.run("wf")
    assert run.outcome == "completed" and run.recovery is None
    assert run.output == "invoice"
    assert compensated == []  # F8 / C9: completed runs never compensate
    assert run.step("charge")["status"] == "failed"
    assert run.step("charge")["error"]["message"] == "declined"
    assert run.attempts("charge")[0]["status"] == "failed"
    assert run["unwind"] == []


@pytest.mark.rfd("F7")
def test_uncaught_exception_fails_run_and_starts_recovery_atomically() -> None:
    app = Ryusen("f7")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        step.run("a", lambda: "A", compensate=lambda r: "undone")
        raise ValueError("bad input after step a")

    env = make_env(app)
    run_id = env.start("wf")
    decisions: list[Any] = []
    env.engine.hooks.append(lambda kind, payload: decisions.append(payload) if kind == "decided" else None)
    run = env.wait(run_id)
    failing = [d for _, d in decisions if d.state.outcome is not None and d.state.outcome.value == "failed"]
    first = failing[0].state
    # the same write that set the outcome started recovery (the compensation is already queued)
    assert first.phase.value == "compensating" and first.recovery.value == "compensating"
    assert first.step("a").attempts[-1].phase.value == "compensation"
    error = dict(run.error or {})
    where = error.pop("traceback")  # where workflow code raised it (issue 26)
    assert error == {"type": "ValueError", "message": "bad input after step a", "data": None, "retryable": True}
    assert where["frames"][-1]["code"] == 'raise ValueError("bad input after step a")'
    assert run.summary == "failed, fully compensated"


@pytest.mark.rfd("F9")
def test_non_retryable_error_fails_the_step_at_once() -> None:
    app = Ryusen("f9")
    calls: Counter[str] = Counter()

    def fatal() -> None:
        calls["fatal"] += 1
        raise NonRetryableError("no such account")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        try:
            step.run("fatal", fatal, retry=RetryPolicy(max_attempts=10))
        except StepFailed:
            return "handled"

    run = make_env(app).run("wf")
    assert calls["fatal"] == 1
    assert len(run.attempts("fatal")) == 1
    assert run.step("fatal")["error"]["retryable"] is False


@pytest.mark.rfd("F10")
def test_success_and_failure_are_explicit_wire_values() -> None:
    app = Ryusen("f10")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        return step.run("s", lambda: None if data else (_ for _ in ()).throw(KeyError("k")))

    bodies: list[dict[str, Any]] = []
    env = make_env(app, chain_steps=False)  # each answer in a response of its own (continuation: next test)
    original = env.invoker.apps["inproc://f10"]

    def recording(method: str, headers: dict[str, str], body: bytes) -> Any:
        response = original(method, headers, body)
        bodies.append(json.loads(response.body))
        return response

    env.invoker.apps["inproc://f10"] = recording
    env.run("wf", True)  # a success whose value is null is still an explicit success
    env.run(
        "wf",
        False,
    )
    attempts = [b["attempt"] for b in bodies if b["kind"] == "forward"]
    assert {"type": "succeeded", "result": None} in attempts
    failed = [a for a in attempts if a["type"] == "failed"]
    assert failed and failed[0]["error"]["type"] == "KeyError"
    discoveries = [b["discovery"]["type"] for b in bodies if b["kind"] == "discover"]
    assert "completed" in discoveries and "step" in discoveries


@pytest.mark.rfd("F4", "F5")
def test_a_continuation_reports_the_callback_and_what_came_after_it_as_explicit_wire_values() -> None:
    """With continuation (the default), a forward attempt's response carries the callback's outcome and,
    after a success, what the replay found next; a failed callback ends the pass with nothing after it."""
    app = Ryusen("f11")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        first = step.run("s", lambda: None if data else (_ for _ in ()).throw(KeyError("k")))
        step.run("t", lambda: "t")
        return first

    bodies: list[dict[str, Any]] = []
    env = make_env(app)
    original = env.invoker.apps["inproc://f11"]

    def recording(method: str, headers: dict[str, str], body: bytes) -> Any:
        request = json.loads(body)
        response = original(method, headers, body)
        bodies.append({"request": request, "response": json.loads(response.body)})
        return response

    env.invoker.apps["inproc://f11"] = recording
    assert env.run("wf", True).outcome == "completed"
    forward = [b for b in bodies if b["request"]["kind"] == "forward"]
    assert all(b["request"]["continue_after"] is True for b in forward)
    by_step = {b["request"]["step_id"]: b["response"] for b in forward}
    assert by_step["s"]["attempt"] == {"type": "succeeded", "result": None}
    assert by_step["s"]["next"]["type"] == "step" and by_step["s"]["next"]["step"]["id"] == "t"
    assert by_step["t"]["next"] == {"type": "completed", "output": None}
    assert [b["request"]["kind"] for b in bodies] == ["discover", "forward", "forward"]  # one pass per step
    bodies.clear()
    assert env.run("wf", False).outcome == "failed"
    failed = [b["response"] for b in bodies if b["request"]["kind"] == "forward"]
    assert failed and all(r["attempt"]["type"] == "failed" and r.get("next") is None for r in failed)


@pytest.mark.rfd("F12")
def test_oversized_values_are_refused_not_truncated() -> None:
    from ryusen_server.ports import PayloadTooLargeError

    app = Ryusen("f12")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        if data == "big-result":
            try:
                step.run("big", lambda: "x" * (300 * 1024))
            except StepFailed as failure:
                return failure.error_type
        return "y" * (300 * 1024)

    env = make_env(app)
    with pytest.raises(PayloadTooLargeError):
        env.start("wf", "z" * (300 * 1024))
    assert env.store.list_runs().runs == []  # nothing was created
    run = env.run("wf", "big-result")  # decisions 25: it ran, so it blocks, neither failed nor retried
    assert run.outcome is None and run.blockers[0]["type"] == "result_too_large"
    assert len(run.attempts("big")) == 1 and run.step("big")["result"] is None
    run = env.run("wf", "big-output")  # decisions 20: blocked for a release that returns less, not failed
    assert run.outcome is None and run.blockers[0]["type"] == "output_too_large"
    assert run.output is None


def test_async_workflow_runs_with_sync_and_async_callbacks_even_inside_an_event_loop() -> None:
    import asyncio

    from ryusen import AsyncStep

    app = Ryusen("async-app")

    async def fetch(x: int) -> int:
        await asyncio.sleep(0)
        return x * 2

    @app.function("wf")
    async def wf(data: Any, step: AsyncStep) -> Any:
        a = await step.run("a", fetch, data)
        b = await step.run("b", lambda: a + 1)
        return [a, b]

    env = make_env(app)
    assert env.run("wf", 5).output == [10, 11]

    async def inside_a_loop() -> Any:  # a user's async test calling the environment
        return env.run("wf", 1).output

    assert asyncio.run(inside_a_loop()) == [2, 3]


@pytest.mark.rfd("F9")
def test_async_callback_in_a_sync_workflow_fails_at_once() -> None:
    app = Ryusen("misuse")

    async def coro() -> int:
        return 1

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        try:
            step.run("a", coro)
        except StepFailed as failure:
            return failure.message

    run = make_env(app).run("wf")
    assert len(run.attempts("a")) == 1
    assert "needs an async workflow function" in run.output


@pytest.mark.rfd("F12", "F13")
def test_the_server_enforces_value_limits_itself_and_bounds_the_whole_run() -> None:
    """The engine does not trust the endpoint to check sizes: its own limits decide."""
    from ryusen.testing import EngineSettings

    app = Ryusen("f12-server")
    undone: list[str] = []

    @app.function("wf")
    def wf(size: int, step: Step) -> Any:
        for i in range(5):
            step.run(f"s{i}", lambda: "x" * size, compensate=lambda r, i=i: undone.append(f"s{i}"))
        return "done"

    # per value: the endpoint's own limit is 256 KiB; the server's is set lower here
    env = WorkflowEnvironment(app, settings=EngineSettings(max_value_bytes=1000, max_run_bytes=10**9))
    run = env.run("wf", 2000)
    assert run.outcome is None and run.blockers[0]["type"] == "result_too_large"  # ran: blocked (decisions 25)
    assert run.blockers[0]["size"] == 2002 and run.blockers[0]["limit"] == 1000
    assert len(run.attempts("s0")) == 1  # not retried: the callback succeeded
    assert run.step("s0").get("result") is None and run.step("s0")["omitted_result"]["size"] == 2002
    # the whole run: input plus accepted results; the third 2000-byte result would pass 5000
    undone.clear()
    env = WorkflowEnvironment(app, settings=EngineSettings(max_value_bytes=10**6, max_run_bytes=5000))
    run_id = env.start("wf", 2000)
    run = env.wait(run_id)
    assert [s["status"] for s in run.steps[:3]] == ["completed", "completed", "pending"]
    blocker = run.blockers[0]
    assert blocker["type"] == "result_too_large" and blocker["step_id"] == "s2" and blocker["limit"] < 5000
    env.cancel(run_id)  # a stop undoes the accepted steps, the one over the budget too, in reverse
    run = env.wait(run_id)
    assert run.outcome == "cancelled" and run.recovery == "compensated"
    assert undone == ["s2", "s1", "s0"]


@pytest.mark.rfd("F12")
def test_results_that_outgrow_a_dynamodb_item_are_kept_whole_on_the_dynamodb_store() -> None:
    """Six 200 KiB results that zlib cannot shrink: 1.2 MB of run, three times DynamoDB's item limit."""
    import base64
    import hashlib
    import random

    app = Ryusen("f12-large-run")
    digests: list[str] = []
    undone: list[str] = []

    def blob(i: int) -> str:
        text = base64.b64encode(random.Random(i).randbytes(150 * 1024)).decode()
        digests.append(hashlib.sha256(text.encode()).hexdigest())
        return text

    @app.function("wf")
    def wf(n: int, step: Step) -> Any:
        for i in range(n):
            step.run(f"s{i}", blob, i, compensate=lambda r: undone.append(hashlib.sha256(r.encode()).hexdigest()))
        raise RuntimeError("fail after the last step, so every recorded result is handed back")

    with WorkflowEnvironment(app, store="moto") as env:
        run = env.run("wf", 6)
        assert run.summary == "failed, fully compensated"
        assert len(digests) == 6  # each callback ran once: every result was accepted and replayed from the store
        assert undone == digests[::-1]  # each compensator got its step's recorded result, whole
        assert all(len(run.step(f"s{i}")["result"]) == 200 * 1024 for i in range(6))


@pytest.mark.rfd("F12")
def test_a_run_that_reaches_more_steps_than_the_limit_fails_and_compensates() -> None:
    from ryusen.testing import EngineSettings

    app = Ryusen("f12-steps")
    ran: list[str] = []
    undone: list[str] = []

    @app.function("wf")
    def wf(n: int, step: Step) -> Any:
        for i in range(n):
            step.run(f"s{i}", lambda i=i: ran.append(f"s{i}"), compensate=lambda _, i=i: undone.append(f"s{i}"))
        return "done"

    env = WorkflowEnvironment(app, settings=EngineSettings(max_steps=3))
    assert env.run("wf", 3).outcome == "completed"  # the limit itself is allowed
    ran.clear()
    run = env.run("wf", 5)
    assert run.summary == "failed, fully compensated"
    assert run.error["type"] == "too_many_steps" and "the limit is 3" in run.error["message"]
    assert ran == ["s0", "s1", "s2"] and [s["id"] for s in run.steps] == ["s0", "s1", "s2"]  # s3 never ran
    assert undone == ["s2", "s1", "s0"]


def test_an_enormous_display_name_is_cut_and_says_so_and_the_run_goes_on() -> None:
    """Names, locations and details are diagnostics: bounded with a note, never a reason to stall a run."""
    import base64
    import random

    app = Ryusen("long-name")
    name = base64.b64encode(random.Random(7).randbytes(600 * 1024)).decode()  # over DynamoDB's item limit alone

    @app.function("wf")
    def wf(_: Any, step: Step) -> Any:
        return step.run("a", lambda: "ok", name=name)

    with WorkflowEnvironment(app, store="moto") as env:
        run = env.run("wf")
    assert run.outcome == "completed" and run.output == "ok"
    shown = run.step("a")["name"]
    assert shown.startswith(name[:1000]) and shown.endswith(f"[cut: it was {len(name)} characters]")


@pytest.mark.rfd("F12")
def test_an_oversized_error_is_cut_and_says_so() -> None:
    app = Ryusen("f12-error")

    @app.function("wf")
    def wf(_: Any, step: Step) -> Any:
        def explode() -> None:
            raise NonRetryableError("boom " + "e" * (400 * 1024))

        return step.run("explode", explode)

    run = make_env(app).run("wf")
    error = run.step("explode")["error"]
    assert error["type"] == "NonRetryableError" and error["message"].startswith("boom eee")
    assert len(error["message"]) < 10_000 and "error cut: it was" in error["message"]

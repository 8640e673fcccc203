"""Bytes to the endpoint: a warm endpoint is sent only what it lacks (the ``memo_cache`` feature).

Every task replays the run's memo of recorded outcomes to the function. Issue 10 found each request
carrying the whole memo: a run of twenty 100 KB results sent the endpoint about 40 MB, growing with the
square of the run's length. Now the engine names each memo it sends, the next request for the run carries
only what changed, and an endpoint that does not hold the named memo (another container, a restart)
answers ``memo_miss`` before running anything and gets the whole memo in the next round trip.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from ryusen import NonRetryableError, Ryusen, Step, StepFailed
from ryusen._internal.app import HandlerResponse
from ryusen._internal.memo_cache import MemoCache
from ryusen._internal.wire import MemoBase, MemoEntry, TaskKind, TaskRequest, TaskResponse
from ryusen.testing import WorkflowEnvironment
from ryusen_server.engine import SentMemos

RESULT_BYTES = 100_000
KEY = "memo-cache-test-key-0123456789abcdef"


def big_results_app(calls: Counter[str], steps: int = 20) -> Ryusen:
    """``steps`` steps, each returning a distinct ~100 KB string; the output digests every one the replay saw."""
    app = Ryusen("big")

    def produce(i: int) -> str:
        calls[f"s{i}"] += 1
        return f"{i:03d}" + "x" * RESULT_BYTES

    def undo(result: str) -> None:
        calls[f"undo-{result[:3]}"] += 1

    @app.function("big")
    def big(data: Any, step: Step) -> Any:
        seen = [step.run(f"s{i}", produce, i, compensate=undo) for i in range(steps)]
        if data == "fail":
            raise RuntimeError("rejected after every step")
        return hashlib.sha256("".join(seen).encode()).hexdigest()

    return app


def expected_digest(steps: int = 20) -> str:
    return hashlib.sha256("".join(f"{i:03d}" + "x" * RESULT_BYTES for i in range(steps)).encode()).hexdigest()


def recorded(env: WorkflowEnvironment, url: str) -> list[tuple[TaskRequest, TaskResponse, int]]:
    """Every request the endpoint at ``url`` answers from now on: (request as sent, response, bytes)."""
    seen: list[tuple[TaskRequest, TaskResponse, int]] = []
    endpoint = env.invoker.apps[url]

    def recording(method: str, headers: dict[str, str], body: bytes) -> Any:
        response = endpoint(method, headers, body)
        seen.append((TaskRequest.model_validate_json(body), TaskResponse.model_validate_json(response.body), len(body)))
        return response

    env.invoker.apps[url] = recording
    return seen


def test_a_warm_endpoint_is_sent_each_recorded_result_once_not_with_every_task() -> None:
    """The issue's figure: twenty 100 KB results. Each result reaches the endpoint once, after its step
    completed, instead of with every later task; the function still replays every one of them."""
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(big_results_app(calls))
    seen = recorded(env, "inproc://big")
    run = env.run("big")
    assert run.outcome == "completed" and run.output == expected_digest()
    assert all(calls[f"s{i}"] == 1 for i in range(20))
    sent = env.counter.bytes_sent["endpoint.invoke"]
    assert sent < 3 * 20 * RESULT_BYTES, (
        f"{sent} bytes sent for 2 MB of results (the whole memo with every task: 19 MB before the cache)"
    )
    assert not any(response.memo_miss for _, response, _ in seen)
    for request, _, _ in seen[1:]:
        assert request.memo_base is not None and len(request.memo) <= 1 and request.input is None


def test_compensation_replays_the_cached_memo_and_gets_the_forward_result() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(big_results_app(calls, steps=5))
    run = env.run("big", "fail")
    assert run.summary == "failed, fully compensated"
    assert [calls[f"undo-{i:03d}"] for i in range(5)] == [1] * 5
    assert env.counter.bytes_sent["endpoint.invoke"] < 4 * 5 * RESULT_BYTES


@pytest.mark.parametrize("how", ["restarted", "another container"])
def test_an_endpoint_without_the_memo_runs_nothing_and_gets_the_whole_memo(how: str) -> None:
    """Mid-run, the endpoint loses its memos (a restart) or a new container of the same code answers: the
    request that extends a memo it lacks is answered ``memo_miss`` before any code runs, the engine sends
    it again with the whole memo and the input, and the run goes on with each step run once."""
    calls: Counter[str] = Counter()
    app = big_results_app(calls, steps=6)
    env = WorkflowEnvironment(app)
    seen = recorded(env, "inproc://big")
    inner = env.invoker.apps["inproc://big"]
    fresh = big_results_app(calls, steps=6)

    def losing_memos(method: str, headers: dict[str, str], body: bytes) -> Any:
        if calls["s2"] == 1 and not losing_memos.done:  # type: ignore[attr-defined]
            losing_memos.done = True  # type: ignore[attr-defined]
            if how == "restarted":
                app.memo_cache.clear()
            else:
                env.invoker.apps["inproc://big"] = env.endpoint(fresh)  # the recording wrapper sees only the old one
                seen.append((TaskRequest.model_validate_json(body), _memo_miss_of(fresh, headers, body), len(body)))
                return env.endpoint(fresh)(method, headers, body)
        return inner(method, headers, body)

    losing_memos.done = False  # type: ignore[attr-defined]
    env.invoker.apps["inproc://big"] = losing_memos
    run = env.run("big")
    assert run.outcome == "completed" and run.output == expected_digest(6)
    assert all(calls[f"s{i}"] == 1 for i in range(6)), calls
    misses = [i for i, (_, response, _) in enumerate(seen) if response.memo_miss]
    assert len(misses) == 1, [(r.kind, r.step_id, bool(r.memo_base), a.memo_miss) for r, a, _ in seen]
    missed, again = seen[misses[0]][0], seen[misses[0] + 1][0] if how == "restarted" else None
    assert missed.memo_base is not None
    if again is not None:  # the same task, now with the whole memo and the input
        assert again.memo_base is None and again.memo_token == missed.memo_token and again.step_id == missed.step_id
        assert set(again.memo) == {"s0", "s1", "s2"} and again.kind == missed.kind


def _memo_miss_of(app: Ryusen, headers: dict[str, str], body: bytes) -> TaskResponse:
    """What ``app`` answers to ``body``, without keeping anything it is sent (a peek for the test)."""
    probe = MemoCache()
    probe._held = app.memo_cache._held.copy()
    request = TaskRequest.model_validate_json(body)
    resolved = probe.resolve(request)
    missed = request.memo_base.token if resolved is None and request.memo_base else None
    return TaskResponse(kind=request.kind, run_id=request.run_id, memo_miss=missed)


def test_an_sdk_that_did_not_announce_the_memo_cache_gets_the_whole_memo_every_time() -> None:
    calls: Counter[str] = Counter()
    app = big_results_app(calls, steps=3)
    env = WorkflowEnvironment(app, signing=False)  # an SDK that predates the memo cache predates signing v2
    env.engine.sync_release(app.app_id, "inproc://big", app.manifest(), frozenset({"continuation"}))
    bodies: list[dict[str, Any]] = []
    endpoint = env.invoker.apps["inproc://big"]

    def recording(method: str, headers: dict[str, str], body: bytes) -> Any:
        bodies.append(json.loads(body))
        return endpoint(method, headers, body)

    env.invoker.apps["inproc://big"] = recording
    assert env.run("big").output == expected_digest(3)
    assert bodies and all("memo_token" not in b and "memo_base" not in b for b in bodies)
    assert [len(b["memo"]) for b in bodies] == [0, 0, 1, 2]  # discovery, then each forward with the whole memo


# ---- the endpoint's cache -----------------------------------------------------------------------------------


def _request(run_id: str, memo: dict[str, Any], *, token: str, base: MemoBase | None = None) -> TaskRequest:
    return TaskRequest(
        kind=TaskKind.DISCOVER,
        run_id=run_id,
        function_id="f",
        input=None if base else {"order": 1},
        memo={k: MemoEntry(status="completed", result=v) for k, v in memo.items()},
        memo_token=token,
        memo_base=base,
    )


def test_the_endpoint_applies_a_change_only_to_the_memo_it_names_for_that_run() -> None:
    cache = MemoCache()
    first = cache.resolve(_request("r1", {"a": 1, "b": 2}, token="t1"))
    assert first is not None and set(first.memo) == {"a", "b"}
    change = _request("r1", {"c": 3, "a": 10}, token="t2", base=MemoBase(token="t1", removed=["b"], count=2))
    whole = cache.resolve(change)
    assert whole is not None and whole.input == {"order": 1} and whole.memo_base is None
    assert {k: e.result for k, e in whole.memo.items()} == {"a": 10, "c": 3}
    # another run's request naming this run's memo, a count that does not match, a memo never held: misses
    assert cache.resolve(_request("r2", {}, token="t3", base=MemoBase(token="t2", count=2))) is None
    assert cache.resolve(_request("r1", {}, token="t4", base=MemoBase(token="t2", count=3))) is None
    assert cache.resolve(_request("r1", {}, token="t5", base=MemoBase(token="nope", count=0))) is None
    assert cache.misses == 3 and cache.hits == 1
    # what a request's code does to its memo does not change the memo kept
    whole.memo.clear()
    again = cache.resolve(_request("r1", {}, token="t6", base=MemoBase(token="t2", count=2)))
    assert again is not None and set(again.memo) == {"a", "c"}


def test_the_endpoint_keeps_a_bounded_number_of_memos_and_bytes() -> None:
    cache = MemoCache(entries=3)
    for run in range(5):
        assert cache.resolve(_request(f"r{run}", {"a": run}, token=f"t{run}")) is not None
    assert len(cache) == 3 and cache.held("t0") is None and cache.held("t4") is not None
    for n in range(4):  # one run's newer memos replace its older ones
        base = MemoBase(token=f"t4-{n - 1}" if n else "t4", count=1)
        assert cache.resolve(_request("r4", {}, token=f"t4-{n}", base=base)) is not None
    assert [cache.held(t) is not None for t in ("t4-1", "t4-2", "t4-3")] == [False, True, True]


def test_the_endpoints_memory_bound_counts_objects_not_request_bytes() -> None:
    """A review found the bound counting request bytes: ``[{}, {}, ...]`` is 3 bytes an element as JSON and
    about 64 as Python objects, so 63 MB of such requests held 1.2 GB. The bound is on the objects held."""
    small_json = [{} for _ in range(20_000)]  # 60 KB as JSON
    cache = MemoCache(max_bytes=4 * 1024 * 1024)
    for run in range(10):
        assert cache.resolve(_request(f"r{run}", {"a": small_json}, token=f"t{run}")) is not None
    assert cache.held_bytes <= 4 * 1024 * 1024
    assert 1 <= len(cache) < 10  # each holds over 1 MB of objects for 60 KB of JSON
    assert cache.resolve(_request("big", {"a": [{} for _ in range(100_000)]}, token="huge")) is not None
    assert cache.held("huge") is None  # over the whole bound: used once, not kept


def test_the_engine_forgets_memos_past_its_byte_budget() -> None:
    memos = SentMemos(capacity=100, max_bytes=50_000)
    for run in range(10):
        _, base, changed = memos.prepare(f"r{run}", {"a": {"status": "completed", "result": "x" * 10_000}})
        assert base is None and set(changed) == {"a"}
    _, base, _ = memos.prepare("r9", {"a": {"status": "completed", "result": "x" * 10_000}})
    assert base is not None  # the newest runs are remembered...
    _, base, changed = memos.prepare("r0", {"a": {"status": "completed", "result": "x" * 10_000}})
    assert base is None and set(changed) == {"a"}  # ...the oldest were forgotten: the whole memo again
    _, base, _ = memos.prepare("huge", {"a": {"status": "completed", "result": "x" * 60_000}})
    _, base, _ = memos.prepare("huge", {"a": {"status": "completed", "result": "x" * 60_000}})
    assert base is None  # over the budget on its own: never remembered


def test_a_change_python_calls_equal_is_still_sent() -> None:
    memos = SentMemos()
    memos.prepare("r", {"a": {"status": "completed", "result": 1}})
    _, base, changed = memos.prepare("r", {"a": {"status": "completed", "result": True}})
    assert base is not None and changed == {"a": {"status": "completed", "result": True}}
    _, base, changed = memos.prepare("r", {"a": {"status": "completed", "result": True}})
    assert changed == {}


def test_a_memo_miss_is_believed_only_when_signed() -> None:
    """With a signing key, an unsigned ``memo_miss`` (from anything between the engine and the endpoint) is
    treated as any unsigned answer is: the attempt's outcome is not known. The engine does not send the
    task again, so nothing can make it run an effect twice."""
    calls: Counter[str] = Counter()
    app = Ryusen("signed", master_key=KEY)

    @app.function("one")
    def one(data: Any, step: Step) -> Any:
        return [step.run(n, lambda n=n: calls.update([n]) or n) for n in ("a", "b")]

    env = WorkflowEnvironment(app)
    env.engine.settings = replace(env.engine.settings, master_key=KEY)
    endpoint = env.invoker.apps["inproc://signed"]
    forged: list[TaskRequest] = []
    sent: list[TaskRequest] = []

    def forging(method: str, headers: dict[str, str], body: bytes) -> Any:
        request = TaskRequest.model_validate_json(body)
        sent.append(request)
        if request.memo_base is not None and not forged:
            forged.append(request)
            miss = TaskResponse(kind=request.kind, run_id=request.run_id, memo_miss=True)
            return HandlerResponse(200, {"content-type": "application/json"}, miss.model_dump_json().encode())
        return endpoint(method, headers, body)

    env.invoker.apps["inproc://signed"] = forging
    run_id = env.start("one")
    env.drive()
    assert [(r.kind, r.step_id) for r in forged] == [(TaskKind.FORWARD, "a")]
    assert [r.step_id for r in sent].count("a") == 1  # not sent again with the whole memo
    run = env.get(run_id)
    assert run.steps[0]["attempts"][0]["status"] == "unknown" and calls["a"] == 0
    assert [b["type"] for b in run.blockers] == ["unknown_outcome"]


def test_a_function_that_changes_its_input_or_results_does_not_change_what_the_next_task_replays() -> None:
    """The endpoint keeps the run's input and memo between tasks; each pass gets its own copies, as it did
    when every request was parsed afresh, so what one pass changes is not what the next one replays."""
    app = Ryusen("mutating")
    calls: Counter[str] = Counter()

    @app.function("wf")
    def wf(data: dict[str, Any], step: Step) -> Any:
        data["seen"] = data.get("seen", 0) + 1
        first = step.run("a", lambda: calls.update(["a"]) or {"items": [1]})
        first["items"].append(99)
        second = step.run("b", lambda: calls.update(["b"]) or {"items": [2]})
        second["items"].append(99)
        return {"seen": data["seen"], "a": first, "b": step.run("c", lambda: calls.update(["c"]) or "c") and second}

    env = WorkflowEnvironment(app)
    run = env.run("wf", {"order": 7})
    assert run.output == {"seen": 1, "a": {"items": [1, 99]}, "b": {"items": [2, 99]}}
    assert calls == Counter({"a": 1, "b": 1, "c": 1}) and app.memo_cache.hits >= 3


def test_an_async_function_that_changes_its_input_does_not_change_the_pass_after_its_callback() -> None:
    app = Ryusen("mutating-async")

    @app.function("wf")
    async def wf(data: dict[str, Any], step: Step) -> Any:
        data["seen"] = data.get("seen", 0) + 1
        await step.run("a", lambda: "a")
        await step.run("b", lambda: "b")
        return data["seen"]

    assert WorkflowEnvironment(app).run("wf", {"order": 7}).output == 1


def test_a_signed_memo_miss_answers_only_the_request_that_named_its_memo() -> None:
    """A review replayed a genuine signed ``memo_miss`` of one run as the answer to another run's forward
    request, after that request had reached the endpoint and run its callback: the engine sent the task
    again and the charge ran twice. A miss names the memo it lacks; any other is no answer at all."""
    calls: Counter[str] = Counter()
    app = Ryusen("signed", master_key=KEY)

    @app.function("one")
    def one(data: Any, step: Step) -> Any:
        step.run("reserve", lambda: calls.update(["reserve"]) or 1)
        return step.run("charge", lambda: calls.update(["charge"]) or 2)

    env = WorkflowEnvironment(app)
    env.engine.settings = replace(env.engine.settings, master_key=KEY)
    endpoint = env.invoker.apps["inproc://signed"]
    captured: list[HandlerResponse] = []

    def harvesting(method: str, headers: dict[str, str], body: bytes) -> Any:
        if TaskRequest.model_validate_json(body).memo_base is not None and not captured:
            app.memo_cache.clear()
            captured.append(endpoint(method, headers, body))
            return captured[0]
        return endpoint(method, headers, body)

    env.invoker.apps["inproc://signed"] = harvesting
    assert env.run("one").outcome == "completed" and TaskResponse.model_validate_json(captured[0].body).memo_miss
    calls.clear()

    def substituting(method: str, headers: dict[str, str], body: bytes) -> Any:
        request = TaskRequest.model_validate_json(body)
        response = endpoint(method, headers, body)
        if request.step_id == "charge" and request.memo_base is not None:
            return captured[0]  # the charge ran; the engine is told "memo_miss" about another memo
        return response

    env.invoker.apps["inproc://signed"] = substituting
    run_id = env.start("one")
    env.drive()
    run = env.get(run_id)
    assert calls == Counter({"reserve": 1, "charge": 1})
    assert run.step("charge")["attempts"][0]["status"] == "unknown"


def test_what_a_function_does_to_a_caught_failure_does_not_change_what_later_tasks_replay() -> None:
    """A review: the endpoint kept the recorded failure's data and handed the same object to every pass, so
    a function that annotated the failure it caught changed the memo. Its compensation pass no longer
    reached the charge, and the refund was skipped. Every pass gets its own copy, as of a result."""
    calls: Counter[str] = Counter()
    app = Ryusen("annotating")

    def check() -> None:
        raise NonRetryableError("limit check failed", data={"limit": 100})

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        try:
            step.run("check", check)
            info: dict[str, Any] = {}
        except StepFailed as failure:
            info = failure.data
        if not info.get("escalated"):
            step.run(
                "charge", lambda: calls.update(["charge"]) or "ch_1", compensate=lambda r: calls.update(["refund"])
            )
        info["escalated"] = True  # annotates the failure it caught
        raise RuntimeError("over the limit")

    run = WorkflowEnvironment(app).run("wf")
    assert run.summary == "failed, fully compensated" and calls == Counter({"charge": 1, "refund": 1})


def test_many_runs_in_flight_on_one_endpoint_still_hit() -> None:
    """A review interleaved 40 runs (one task each at a time) on one endpoint process: with 64 memos kept
    there, 150 of 400 requests missed. The endpoint keeps enough memos for that, within its memory bound."""
    app = Ryusen("many")

    @app.function("five")
    def five(data: Any, step: Step) -> Any:
        return [step.run(f"s{i}", lambda i=i: i) for i in range(5)]

    env = WorkflowEnvironment(app, chain_steps=False)
    runs = [env.start("five") for _ in range(40)]
    env.drive()
    assert all(env.get(r).outcome == "completed" for r in runs)
    assert app.memo_cache.misses == 0 and app.memo_cache.hits >= 40 * 4


def test_a_replayed_step_is_located_in_its_own_file(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two identical functions in different files have code objects that compare equal: a location cache
    keyed by code object reported the second at the first one's file."""
    source = "def wf(data, step):\n    a = step.run('a', lambda: 1)\n    return step.run('a', lambda: 2)\n"
    for name in ("orders_v1", "orders_v2"):
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    app = Ryusen("located")
    for name in ("orders_v1", "orders_v2"):
        app.function(name)(importlib.import_module(name).wf)
    env = WorkflowEnvironment(app)
    for name in ("orders_v1", "orders_v2"):
        run_id = env.start(name)
        env.drive()
        [blocker] = env.get(run_id).blockers
        assert f"{name}.py:2" in json.dumps(blocker) and f"{name}.py:3" in json.dumps(blocker), blocker

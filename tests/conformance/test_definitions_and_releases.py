"""D (definition conflicts) and R (releases), end to end through the engine and the SDK."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest

from ryusen import Ryusen, Step
from ryusen._internal.wire import TaskRequest
from ryusen.testing import WorkflowEnvironment
from ryusen_server.core.events import EngineSettings
from ryusen_server.ports import ConflictError


def release_a(calls: Counter[str]) -> Ryusen:
    """Release A: calls "charge" twice in one pass (decisions 4)."""
    app = Ryusen("billing", build_id="build-a", release_id="release-a")

    @app.function("invoice")
    def invoice(data: Any, step: Step) -> Any:
        first = step.run("charge", lambda: calls.update(["charge"]) or {"charged": 10}, name="charge amount")
        fee = step.run("charge", lambda: calls.update(["fee"]) or {"fee": 1}, name="charge fee")
        return {"first": first, "fee": fee}

    return app


def release_b(calls: Counter[str]) -> Ryusen:
    """Release B: the second call is renamed "charge-fee"."""
    app = Ryusen("billing", build_id="build-b", release_id="release-b")

    @app.function("invoice")
    def invoice(data: Any, step: Step) -> Any:
        first = step.run("charge", lambda: calls.update(["charge-b"]) or {"charged": 99})
        fee = step.run("charge-fee", lambda: calls.update(["fee"]) or {"fee": 1})
        return {"first": first, "fee": fee}

    return app


@pytest.mark.rfd("D1", "D2", "D3", "D5", "R3")
def test_duplicate_step_id_blocks_then_new_release_repairs() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(release_a(calls))
    run_id = env.start("invoice")
    env.drive(horizon=timedelta(seconds=1))  # the probe would wake it again after a minute
    run = env.get(run_id)
    # D1: blocked, not failed, not compensated; the second callback never ran
    assert run.phase == "running" and run.outcome is None and run.recovery is None
    assert calls == Counter({"charge": 1})
    assert run["unwind"] == []
    # D2: the blocker names the id, both locations and display names
    [blocker] = run.blockers
    assert blocker["type"] == "duplicate_step_id" and blocker["step_id"] == "charge"
    assert blocker["first"]["name"] == "charge amount" and blocker["duplicate"]["name"] == "charge fee"
    assert blocker["first"]["location"].startswith("test_definitions_and_releases.py:")
    assert blocker["duplicate"]["location"].startswith("test_definitions_and_releases.py:")
    assert blocker["first"]["location"] != blocker["duplicate"]["location"]
    # D3: the first occurrence keeps its accepted result
    assert run.step("charge")["status"] == "completed" and run.step("charge")["result"] == {"charged": 10}
    # D5 / R3: syncing release B wakes the run; current code, normal memoization
    env.sync(release_b(calls))
    run = env.wait(run_id)
    assert run.outcome == "completed"
    assert run.output == {"first": {"charged": 10}, "fee": {"fee": 1}}
    assert calls == Counter({"charge": 1, "fee": 1})  # "charge" was not rerun under release B
    assert run.blockers == []
    assert run.step("charge-fee")["attempts"][0]["release_id"] == "release-b"


@pytest.mark.rfd("D4")
@pytest.mark.parametrize("kept_passes", [True, False], ids=["kept-passes", "every-task-from-the-top"])
def test_exclusive_branches_share_an_id_and_its_result(kept_passes: bool) -> None:
    app = Ryusen("branches")
    calls: Counter[str] = Counter()
    passes: list[tuple[str, str]] = []
    """Per pass that reached "notify": the branch it took, and what "notify" returned to it."""

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        # a flag read outside step.run flips between passes: one pass takes one branch, the next the other,
        # and never the same id twice in a pass
        if len(passes) % 2 == 0:
            got = step.run("notify", lambda: calls.update(["email"]) or "email")
            passes.append(("email branch", got))
        else:
            got = step.run("notify", lambda: calls.update(["sms"]) or "sms")
            passes.append(("sms branch", got))
        again = step.run("after", lambda: "done")
        return [got, again]

    run = WorkflowEnvironment(app, kept_passes=kept_passes).run("wf")
    assert run.outcome == "completed" and run.blockers == []
    assert sum(calls.values()) == 1  # one callback ran, in whichever branch its attempt's pass took
    accepted = run.step("notify")["result"]
    assert run.output == [accepted, "done"]
    # both branches reached "notify" after its result was accepted, and each got that result back
    assert {branch for branch, got in passes if got == accepted} == {"email branch", "sms branch"}, passes


@pytest.mark.rfd("D6", "D7")
def test_probe_and_operator_rediscover_observe_the_conflict_without_side_effects() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(release_a(calls), settings=EngineSettings(probe_initial_s=60.0, probe_max_s=240.0))
    run_id = env.start("invoice")
    env.drive(horizon=timedelta(seconds=1))
    first = env.get(run_id).blockers[0]
    assert first["count"] == 1
    # the probe fires after 60 s, then 120 s, then is capped at 240 s
    env.drive(horizon=timedelta(seconds=61))
    assert env.get(run_id).blockers[0]["count"] == 2
    env.drive(horizon=timedelta(seconds=121))
    assert env.get(run_id).blockers[0]["count"] == 3
    probe_due = env.get(run_id)
    state = env.engine.get_run(run_id)
    assert state.probe_interval_s == 240.0
    # an operator rediscover observes it again: diagnostics only
    env.rediscover(run_id)
    env.drive(horizon=timedelta(seconds=1))
    blocker = env.get(run_id).blockers[0]
    assert blocker["count"] == 4 and blocker["last_seen_at"] > first["last_seen_at"]
    assert env.engine.get_run(run_id).probe_interval_s == 240.0  # capped
    # D7: no callbacks ran again, no terminal failure, nothing compensated
    assert calls == Counter({"charge": 1})
    run = env.get(run_id)
    assert [s["status"] for s in run.steps] == ["completed"]
    assert len(run.step("charge")["attempts"]) == 1
    assert run.outcome is None and probe_due.outcome is None


@pytest.mark.rfd("D6")
def test_rediscover_without_a_definition_blocker_is_refused() -> None:
    app = Ryusen("plain")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        return 1

    env = WorkflowEnvironment(app)
    run = env.run("wf")
    before = env.engine.get_run(run.id).version
    with pytest.raises(ConflictError) as info:
        env.rediscover(run.id)
    assert info.value.details["code"] == "no_definition_blocker"
    assert env.engine.get_run(run.id).version == before


@pytest.mark.rfd("R1", "R2")
def test_no_pinning_each_task_uses_the_newest_release_and_records_it() -> None:
    def build(release: str, result: str, log: list[str]) -> Ryusen:
        app = Ryusen("evolving", release_id=release, build_id=f"build-{release}")

        @app.function("wf")
        def wf(data: Any, step: Step) -> Any:
            a = step.run("a", lambda: log.append(f"a@{release}") or result)
            b = step.run("b", lambda: log.append(f"b@{release}") or result)
            return [a, b]

        return app

    log: list[str] = []
    env = WorkflowEnvironment(build("r1", "one", log))
    run_id = env.start("wf")
    env.drive(until=lambda: bool(env.get(run_id).steps) and env.get(run_id).step("a")["status"] == "completed")
    env.sync(build("r2", "two", log))  # deploy while the run is in flight
    run = env.wait(run_id)
    assert log == ["a@r1", "b@r2"]
    assert run.output == ["one", "two"]  # a's accepted result stands; b ran current code
    assert run.attempts("a")[0]["release_id"] == "r1" and run.attempts("a")[0]["build_id"] == "build-r1"
    assert run.attempts("b")[0]["release_id"] == "r2" and run.attempts("b")[0]["build_id"] == "build-r2"
    # metadata only: the run itself carries no release affinity
    assert "release_id" not in run.raw


@pytest.mark.rfd("D5", "R1", "C8")
def test_a_release_without_the_function_blocks_runs_instead_of_failing_them() -> None:
    undone: list[str] = []

    def with_function(release: str) -> Ryusen:
        app = Ryusen("moving", release_id=release, build_id=release)

        @app.function("wf")
        def wf(data: Any, step: Step) -> Any:
            step.run("a", lambda: "A", compensate=lambda r: undone.append(f"a@{release}"))
            step.run("b", lambda: "B")
            return "done"

        return app

    without = Ryusen("moving", release_id="r2", build_id="r2")

    @without.function("other")
    def other(data: Any, step: Step) -> Any:
        return None

    env = WorkflowEnvironment(with_function("r1"))
    run_id = env.start("wf")
    env.drive(until=lambda: bool(env.get(run_id).steps) and env.get(run_id).step("a")["status"] == "completed")
    env.sync(without)  # the function is removed from the app
    run = env.wait(run_id)
    assert run.outcome is None and run.phase == "running"  # blocked, not failed
    [blocker] = run.blockers
    assert blocker["type"] == "function_not_found" and "wf" in blocker["message"]
    assert undone == []
    env.sync(with_function("r3"))  # it comes back: the release wakes the run
    run = env.wait(run_id)
    assert run.outcome == "completed" and run.blockers == []
    assert run.attempts("b")[-1]["release_id"] == "r3"


@pytest.mark.rfd("D1")
def test_cancelling_a_run_blocked_by_a_duplicate_id_clears_the_blocker() -> None:
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(release_a(calls))
    run_id = env.start("invoice")
    assert env.wait(run_id).blockers
    env.cancel(run_id)
    run = env.wait(run_id)
    assert run.summary == "cancelled, fully compensated" and run.blockers == []
    assert env.engine.get_run(run_id).probe_due_at is None


@pytest.mark.rfd("D5", "R3")
def test_a_release_synced_while_the_blocking_pass_is_in_flight_still_wakes_the_run() -> None:
    """The blocked-runs index is read by the sync before the pass has written its blocker (on AWS, a GSI
    also lags its table): the pass itself sees the newer release after its write and wakes the run."""
    calls: Counter[str] = Counter()
    old, new = release_a(calls), release_b(calls)
    env = WorkflowEnvironment(old)
    synced: list[bool] = []

    def old_code_answering_while_the_fix_is_synced(method: str, headers: dict[str, str], body: bytes) -> Any:
        request = TaskRequest.model_validate_json(body)
        # the pass that finds the duplicate: a discovery after charge, or charge's own attempt continuing past it
        if not synced and ("charge" in request.memo or request.step_id == "charge"):
            synced.append(True)
            env.sync(new)  # the fix lands now; the run is not blocked yet, so the sync wakes nothing
        return env.endpoint(old)(method, headers, body)

    env.invoker.apps["inproc://billing"] = old_code_answering_while_the_fix_is_synced
    run_id = env.start("invoice")
    env.drive(until=lambda: env.get(run_id).phase == "finished", horizon=timedelta(seconds=30))  # before any probe
    run = env.get(run_id)
    assert synced and run.outcome == "completed" and calls["charge"] == 1 and calls["fee"] == 1


@pytest.mark.rfd("D5", "R3")
def test_a_release_sync_looks_again_when_the_blocked_runs_index_lags() -> None:
    """On AWS the blocked-runs index is a GSI: a run that blocked just before a sync may not be in it yet."""
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(release_a(calls))
    run_id = env.start("invoice")
    env.drive(horizon=timedelta(seconds=1))  # blocked, before any probe
    lookups = env.store.runs_blocked_by_definition
    answers: list[int] = []

    def lagging(function_id: str) -> list[str]:
        found = lookups(function_id)
        answers.append(len(found))
        return [] if len(answers) == 1 else found  # the first lookup does not see the run yet

    env.store.runs_blocked_by_definition = lagging  # type: ignore[method-assign]
    env.engine.settings = replace(env.engine.settings, index_settle_s=0.01)
    env.sync(release_b(calls))
    run = env.wait(run_id)
    assert answers == [1, 1] and run.outcome == "completed" and calls["fee"] == 1


def test_a_release_sync_returns_without_waking_each_blocked_run_itself() -> None:
    """Issue 24 (finding 7): a sync woke every blocked run in its own request, one read and one write each, so
    a sync with thousands of blocked runs outlived API Gateway's 29 s. Dispatchers wake them now."""
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(release_a(calls))
    run_ids = [env.start("invoice", idempotency_key=f"order-{i}") for i in range(30)]
    env.drive(horizon=timedelta(seconds=1))  # all blocked, before any probe
    assert all(env.store.peek(r).blocked_by_definition for r in run_ids)  # type: ignore[union-attr]
    writes = env.store.counter.counts.get("store.write", 0)
    env.sync(release_b(calls))
    assert env.store.counter.counts.get("store.write", 0) - writes <= 2  # the release; no run is written
    assert all(env.store.peek(r).blocked_by_definition for r in run_ids)  # type: ignore[union-attr]  # not yet: the wake is on the queue
    for run_id in run_ids:
        assert env.wait(run_id).outcome == "completed"
    assert calls["fee"] == 30

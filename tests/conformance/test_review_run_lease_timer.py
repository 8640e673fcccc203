"""Adversarial review of 72cf321 ("one lease timer for a run's steps"): a result function's lease timer with
``watches_before`` also watches every attempt a result function authorized before then, and judges each exactly at
its lease. Each finding's test fails against the reviewed commit (and passes against 72cf321^ unless said)."""

from __future__ import annotations

import time as real_time
from collections import Counter
from dataclasses import replace
from datetime import timedelta
from typing import Any

from ryusen import RetryPolicy, Ryusen, Step
from ryusen.testing import WorkflowEnvironment
from ryusen_server.core.model import AttemptStatus, TaskRef
from tests.functional.test_store_outages import FlakyStore, _flaky_env, pending_deferred

RESULT_URL = "https://results.example/"


def three_steps(
    calls: Counter[str], holder: dict[str, Any], *, ship_fault: str | None = "down", ship_retry: bool = True
) -> Ryusen:
    """charge, pack (slow: answered "accepted" to whoever invokes it), ship (its callback ends in a store outage)."""
    app = Ryusen("shop")

    def charge() -> dict[str, Any]:
        calls["charge"] += 1
        return {"charged": True}

    def pack() -> dict[str, Any]:
        calls["pack"] += 1
        real_time.sleep(0.3)  # longer than acknowledge_after_s (0.1 s): the endpoint answers "accepted"
        return {"packed": True}

    def ship() -> dict[str, Any]:
        calls["ship"] += 1
        if calls["ship"] == 1 and "store" in holder and ship_fault is not None:
            setattr(holder["store"], ship_fault, True)
        return {"shipped": True}

    retry = RetryPolicy(max_attempts=3, on_unknown="retry") if ship_retry else None

    @app.function("order")
    def order(data: Any, step: Step) -> Any:
        return {
            "charge": step.run("charge", charge),
            "pack": step.run("pack", pack),
            "ship": step.run("ship", ship, retry=retry),
        }

    return app


def attempts(env: WorkflowEnvironment, run_id: str, step_id: str) -> list[Any]:
    state = env.store.peek(run_id)
    assert state is not None
    step = state.step(step_id)
    return list(step.attempts) if step is not None else []


def status(env: WorkflowEnvironment, run_id: str, step_id: str) -> str | None:
    found = attempts(env, run_id, step_id)
    return found[-1].status.value if found else None


def post_result(env: WorkflowEnvironment, app: Ryusen, run_id: str, step_id: str, result: Any, **extra: Any) -> None:
    """The SDK's post of attempt 1's outcome to the result function, signed as the SDK signs it (``extra``: what
    its replay found next, and the build)."""
    from ryusen._internal.wire import CallbackSucceeded, LateResult, Phase

    late = LateResult(
        run_id=run_id,
        step_id=step_id,
        phase=Phase.FORWARD,
        generation=1,
        attempt=CallbackSucceeded(result=result),
        **extra,
    )
    env.engine.submit_result(late.model_dump_json().encode(), env._signed_late_result(app.app_id, late))


def lease_timers(env: WorkflowEnvironment) -> list[TaskRef]:
    return [m.task for m in env.queue.pending() if isinstance(m.task, TaskRef) and m.task.lease_timer]


def _pack_left_in_flight(
    monkeypatch: Any, *, ship_retry: bool = True, kept_passes: bool = False, ship_fault: str | None = "down"
) -> tuple[WorkflowEnvironment, FlakyStore, Ryusen, str, Counter[str]]:
    """charge's outcome is posted to the result function, which carries on to pack, answered "accepted": pack's
    lease timer (``watches_before`` about pack's lease) goes on the queue."""
    calls: Counter[str] = Counter()
    holder: dict[str, Any] = {}
    app = three_steps(calls, holder, ship_retry=ship_retry, ship_fault=ship_fault)
    monkeypatch.setattr(app, "_deliver_acknowledged", lambda request, outcome: None)  # the test posts
    env, flaky = _flaky_env(app, chain_steps=True, kept_passes=kept_passes)
    holder["store"] = flaky
    env.engine.settings = replace(env.engine.settings, result_url=RESULT_URL)
    env.faults.crash_before_invoke("charge")  # the dispatcher stops listening; the endpoint posts the outcome
    run_id = env.start("order")
    env.drive(until=lambda: status(env, run_id, "charge") == "authorized")
    post_result(env, app, run_id, "charge", {"charged": True})  # carries on: pack, answered "accepted"
    real_time.sleep(0.5)
    assert status(env, run_id, "pack") == "authorized" and calls["pack"] == 1
    [timer] = lease_timers(env)
    assert timer.step_id == "pack"
    return env, flaky, app, run_id, calls


# ---- finding 1: the run's timer takes an answered attempt, its answer deferred, as Unknown at its lease ------------


def test_an_answer_the_result_function_deferred_is_not_taken_as_unknown_by_the_runs_lease_timer(
    monkeypatch: Any,
) -> None:
    """FINDING (high). The result function leaves pack in flight ("accepted") and sends pack's lease timer with
    ``watches_before`` about pack's lease. pack's outcome is posted; the same function carries on to ship, which
    answers inline, but the store refuses the write of ship's success: the answer is deferred to the queue and the
    carry-on returns done (``_record_answer`` -> None: "so that it cannot come back as the lease timer and take the
    attempt as Unknown before its answer is recorded; other messages wait lease_watch_grace_s past the lease").
    ship was authorized by a result function before ``watches_before``, so pack's timer now watches it and takes it
    as Unknown exactly at its lease, not ``lease_watch_grace_s`` (15 min) past it. A store outage a little longer
    than ship's lease (here about its timeout) turns an answered step Unknown, and with ``on_unknown="retry"`` the
    retry runs ship again before the deferred success lands. Before 72cf321 pack's timer watched pack only: ship ran
    once, its deferred success recorded. Expected: ship ran once and was never Unknown."""
    env, flaky, app, run_id, calls = _pack_left_in_flight(monkeypatch)
    env.clock.advance(timedelta(seconds=5))
    post_result(env, app, run_id, "pack", {"packed": True})  # carries on: ship answers inline; its write refused
    [deferred] = pending_deferred(env)
    ship = attempts(env, run_id, "ship")[0]
    assert ship.status is AttemptStatus.AUTHORIZED and calls["ship"] == 1
    env.clock.advance_to(ship.lease_expires_at + timedelta(seconds=1))  # an outage a little past ship's lease
    flaky.down = False
    env.queue.change_visibility(deferred.message_id, 60)  # its backoff: the deferred answer's next try, 1 min on
    env.wait(run_id)
    first = attempts(env, run_id, "ship")[0]
    assert first.unknown_at is None and calls["ship"] == 1, (
        f"ship went Unknown at {first.unknown_at} (lease {first.lease_expires_at}: {first.unknown_reason}) while its"
        f" success was deferred, and ran {calls['ship']} times"
    )


def _next_after(step_id: str, *, ship_retry: bool) -> Any:
    """What ``step_id``'s replay finds next (the following step's plan), as an acknowledged attempt's SDK posts it."""
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(three_steps(calls, {}, ship_retry=ship_retry), chain_steps=True, kept_passes=True)
    found: list[Any] = []

    def seen(kind: str, payload: Any) -> None:
        event = payload[0]
        if kind == "decided" and getattr(event, "step_id", None) == step_id and getattr(event, "next", None):
            found.append(event.next)

    env.engine.hooks.append(seen)
    env.run("order")
    env.close()
    return found[0]


def test_a_step_a_result_function_authorized_in_a_write_whose_answer_was_lost_is_not_unknown_before_it_is_sent(
    monkeypatch: Any,
) -> None:
    """FINDING (high). pack is left in flight by the result function, with its lease timer (``watches_before``
    about pack's lease). pack's success is posted with ``next`` (ship's plan): the result function's write
    records it and authorizes ship, commits, and its answer is lost; the store then refuses writes. The result
    function defers the posted outcome with its delivery id, so that the deferred answer's receiver claims ship
    (``invoke_own_authorization``: re-authorized and invoked, ship has never run) once the store is back: every
    other watcher waits ``lease_watch_grace_s`` past ship's lease for it. pack's timer does not: ship is
    authorized by a result function before ``watches_before``, so at ship's lease it takes ship, never sent, as
    Unknown. The receiver then finds ship Unknown, not AUTHORIZED, claims nothing, and the run (ship's default
    ``on_unknown``) is blocked on the Unknown outcome of a callback that never ran, for an operator to resolve,
    after an outage of about one step timeout. Before 72cf321: the receiver claimed and sent ship, which ran once
    and the run completed. Expected: ship runs once, is never Unknown, and the run completes."""
    following = _next_after("pack", ship_retry=False)
    env, flaky, app, run_id, calls = _pack_left_in_flight(
        monkeypatch, ship_retry=False, kept_passes=True, ship_fault=None
    )
    build = attempts(env, run_id, "pack")[0].build_id
    env.clock.advance(timedelta(seconds=5))
    flaky.commit_then_down = True  # the write that authorizes ship commits; its answer is lost; the store refuses
    post_result(env, app, run_id, "pack", {"packed": True}, next=following, build_id=build)
    [deferred] = pending_deferred(env)
    ship = attempts(env, run_id, "ship")[0]
    assert ship.status is AttemptStatus.AUTHORIZED and calls["ship"] == 0
    env.clock.advance_to(ship.lease_expires_at + timedelta(seconds=1))  # an outage a little past ship's lease
    flaky.down = False
    env.queue.change_visibility(deferred.message_id, 60)  # its backoff: the deferred answer's next try, 1 min on
    env.wait(run_id)
    first = attempts(env, run_id, "ship")[0]
    run = env.get(run_id)
    assert first.unknown_at is None and calls["ship"] == 1 and run.outcome == "completed", (
        f"ship ran {calls['ship']} times; its first attempt is {first.status.value} (unknown_at {first.unknown_at},"
        f" lease {first.lease_expires_at}); run {run.summary}"
    )

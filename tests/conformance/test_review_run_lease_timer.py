"""Adversarial review of 72cf321 ("one lease timer for a run's steps"): a result function's lease timer with
``watches_before`` also watched every attempt a result function authorized before then, and judged each exactly
at its lease. Findings 1 and 2 (one root: the run's timer judged exactly an attempt the result function never
left in flight, whose answer or authorization a deferred message carries) failed against 72cf321 and pass
against 72cf321^; fixed by sharing a timer only between attempts sent as events (whose outcome only a post
brings), which these endpoints, answering over HTTP, are not. Finding 3 is about a field 72cf321^ did not have.
The guards at the end hold what was tried and held."""

from __future__ import annotations

import time as real_time
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ryusen import RetryPolicy, Ryusen, Step
from ryusen._internal.wire import CallbackSucceeded, Phase, StepPlan, StepsReached, TaskKind
from ryusen.testing import WorkflowEnvironment
from ryusen_server.core.decide import decide
from ryusen_server.core.events import (
    AttemptReported,
    Decision,
    DiscoveryReported,
    EngineSettings,
    HeartbeatReported,
    RedeliverLater,
    ReleaseRef,
    StartRun,
    StopRequested,
    TaskDelivered,
)
from ryusen_server.core.model import RESULT_FUNCTION_EVENTS_CARRIER, AttemptStatus, RunState, TaskRef, delivery_id_for
from tests.conformance.test_review_carriers2 import _post as post_result
from tests.conformance.test_review_issue25 import attempts
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


def status(env: WorkflowEnvironment, run_id: str, step_id: str) -> str | None:
    found = attempts(env, run_id, step_id)
    return found[-1].status.value if found else None


def lease_timers(env: WorkflowEnvironment) -> list[TaskRef]:
    return [m.task for m in env.queue.pending() if isinstance(m.task, TaskRef) and m.task.lease_timer]


def _pack_left_in_flight(
    monkeypatch: pytest.MonkeyPatch,
    *,
    ship_retry: bool = True,
    kept_passes: bool = False,
    ship_fault: str | None = "down",
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
    monkeypatch: pytest.MonkeyPatch,
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
    monkeypatch: pytest.MonkeyPatch,
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


# ---- finding 3: a run's lease timer is unreadable by a dispatcher of the release before --------------------------


def test_a_lease_timer_of_an_attempt_an_endpoint_may_answer_inline_is_readable_by_the_release_before() -> None:
    """FINDING 3 (low; a deploy's window and a rollback). aws/queue.py leaves ``lease_timer`` and ``watches_before``
    out of a body when unset, "as before they existed", so that a dispatcher not yet upgraded reads it. A run's
    lease timer for attempts sent as events has ``watches_before``, which the dispatcher of 72cf321^ (a TaskRef
    with ``extra="forbid"``, stood in for here by its exact fields) refuses as a malformed message. Fixed as far as
    it can be: only a release that takes events gets such a timer (the timer of any other acknowledged attempt is
    read as before, below); during a deploy, CloudFormation updates the result function before the dispatch
    function, and a refused timer comes back after the queue's visibility timeout to a dispatcher upgraded by
    then; a rollback past this version must wait for the queue's run timers (docs/deploy.md)."""
    from pydantic import BaseModel, ConfigDict

    from ryusen_server.aws.queue import SqsQueue

    class PreviousTaskRef(BaseModel):  # core/model.py TaskRef at 72cf321^
        model_config = ConfigDict(frozen=True, extra="forbid")
        run_id: str
        kind: TaskKind
        seq: int | None = None
        step_id: str | None = None
        generation: int | None = None
        lease_timer: bool = False

    class Client:
        bodies: list[str] = []

        def send_message(self, **kw: Any) -> None:
            self.bodies.append(kw["MessageBody"])

    client = Client()
    queue = SqsQueue(client, "https://sqs.example/q", fair=False)  # type: ignore[arg-type]
    timer = TaskRef(run_id="run1", kind=TaskKind.FORWARD, step_id="a", generation=1, lease_timer=True)
    queue.send(timer, 60.0)
    shared = timer.model_copy(update={"watches_before": at(58)})
    queue.send(shared, 60.0)
    [body, shared_body] = client.bodies
    PreviousTaskRef.model_validate_json(body)
    with pytest.raises(ValueError, match="watches_before"):
        PreviousTaskRef.model_validate_json(shared_body)  # what deploy.md says of a rollback


# ---- regression guards (pure core): what held ------------------------------------------------------------------

T0 = datetime(2030, 1, 1, tzinfo=UTC)
RELEASE = ReleaseRef(release_id="r1", build_id="b1")
BY_RESULT_FUNCTION = f"{RESULT_FUNCTION_EVENTS_CARRIER}0123abcd"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def core(state: RunState | None, event: object, seconds: float = 0.0) -> Decision:
    return decide(state, event, now=at(seconds), settings=EngineSettings())  # type: ignore[arg-type]


def _a_and_b_by_result_functions(heartbeat_s: float | None = None) -> RunState:
    """Steps a and b declared together, each authorized by a result function (a at 0 s, b at 1 s); a settled."""
    state = core(None, StartRun(run_id="run1", app_id="a", function_id="f", input=1)).state
    state = core(
        state, TaskDelivered(task=TaskRef(run_id="run1", kind=TaskKind.DISCOVER, seq=1), release=RELEASE)
    ).state
    plans = [StepPlan(id="a"), StepPlan(id="b", heartbeat_s=heartbeat_s, timeout_s=600)]
    state = core(state, DiscoveryReported(seq=1, response=StepsReached(steps=plans, max_parallel=2))).state
    for seconds, step_id in enumerate("ab"):
        task = TaskRef(run_id="run1", kind=TaskKind.FORWARD, step_id=step_id, generation=1)
        delivery = delivery_id_for(BY_RESULT_FUNCTION, f"u{step_id}")
        state = core(state, TaskDelivered(task=task, release=RELEASE, delivery_id=delivery), seconds).state
    done = AttemptReported(step_id="a", phase=Phase.FORWARD, generation=1, response=CallbackSucceeded(result=1))
    return core(state, done, 2).state


def _runs_timer(watches_before: datetime) -> TaskDelivered:
    task = TaskRef(
        run_id="run1", kind=TaskKind.FORWARD, step_id="a", generation=1, lease_timer=True, watches_before=watches_before
    )
    return TaskDelivered(task=task, release=RELEASE, delivery_id=delivery_id_for("timer-message", "u"))


def _b(state: RunState) -> Any:
    step = state.step("b")
    assert step is not None
    return step.current(Phase.FORWARD)


def test_guard_the_runs_timer_follows_the_heartbeats_of_an_attempt_it_watches() -> None:
    """Held. b (heartbeat every 30 s, so its lease is one interval and the grace) is watched by a's timer. Its
    heartbeats extend its lease: the timer, back at b's first lease, is kept until the extended one, takes nothing
    before, and takes b as Unknown exactly at the lease its last heartbeat gave it."""
    state = _a_and_b_by_result_functions(heartbeat_s=30)
    first = _b(state).lease_expires_at
    beat = HeartbeatReported(step_id="b", phase=Phase.FORWARD, generation=1, seq=1)
    state = core(state, beat, 20).state
    extended = _b(state).lease_expires_at
    assert extended > first
    back = core(state, _runs_timer(at(1)), (first - T0).total_seconds())
    assert not back.changed and _b(back.state).status is AttemptStatus.AUTHORIZED
    [later] = [c for c in back.commands if isinstance(c, RedeliverLater)]
    assert first + timedelta(seconds=later.delay_s) == extended
    taken = core(state, _runs_timer(at(1)), (extended - T0).total_seconds())
    assert _b(taken.state).status is AttemptStatus.UNKNOWN


def test_guard_the_runs_timer_still_takes_an_attempt_it_watches_while_the_run_is_cancelled() -> None:
    """Held. The run is cancelled while b, watched by a's timer, is in flight: a stop waits for what is in flight,
    and nothing but that timer judges b at its lease. The timer back at b's lease takes it as Unknown (the run
    settles on it), as b's own timer did before the change: no silent wait for the sweeper's grace."""
    state = _a_and_b_by_result_functions()
    state = core(state, StopRequested(kind="cancel"), 3).state
    assert _b(state).status is AttemptStatus.AUTHORIZED
    lease = _b(state).lease_expires_at
    taken = core(state, _runs_timer(at(1)), (lease - T0).total_seconds())
    assert _b(taken.state).status is AttemptStatus.UNKNOWN

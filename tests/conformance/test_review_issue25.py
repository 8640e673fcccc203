"""Adversarial review of issue 25 (acknowledged dispatch, the result function, heartbeats): each test names the
finding it demonstrates and fails against the reviewed commit."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest

from ryusen import RetryPolicy, Ryusen, Step
from ryusen._internal.wire import CallbackSucceeded, LateResult, Phase
from ryusen.testing import WorkflowEnvironment

RESULT_URL = "https://results.example/"


def payments(charges: list[int], *, timeout_s: float = 30.0, heartbeat_s: float | None = None) -> Ryusen:
    app = Ryusen("payments")

    @app.function("pay")
    def pay(order: Any, step: Step) -> Any:
        first = step.run(
            "charge",
            lambda: charges.append(1) or {"charge_id": "ch_1"},
            timeout=timedelta(seconds=timeout_s),
            heartbeat=timedelta(seconds=heartbeat_s) if heartbeat_s else None,
            retry=RetryPolicy(max_attempts=3, on_unknown="retry"),
        )
        second = step.run("ship", lambda: {"shipped": True}, timeout=timedelta(seconds=timeout_s))
        return {"first": first, "second": second}

    return app


def attempts(env: WorkflowEnvironment, run_id: str, step_id: str) -> list[Any]:
    state = env.store.peek(run_id)
    assert state is not None
    step = state.step(step_id)
    return list(step.attempts) if step is not None else []


def post_late(env: WorkflowEnvironment, app: Ryusen, run_id: str, step_id: str, generation: int, result: Any) -> None:
    """The SDK's post of attempt ``generation``'s outcome (a late result), signed as the SDK signs it."""
    late = LateResult(
        run_id=run_id,
        step_id=step_id,
        phase=Phase.FORWARD,
        generation=generation,
        attempt=CallbackSucceeded(result=result),
    )
    headers = env._signed_late_result(app.app_id, late)
    env.engine.submit_late_result(late.model_dump_json().encode(), headers)


# FINDING A: an SDK served on AWS Lambda announces the "acknowledge" feature (SDK_FEATURES is static), yet it never
# acknowledges there (_on_lambda). The engine gives every attempt of an acknowledging release the 3 s
# acknowledged_lease_grace_s instead of lease_grace_s (60 s), so a Lambda endpoint's late result -- the only way a
# step longer than the dispatcher gets its outcome in -- now has 3 s, not 60 s, past respond_by: an on_unknown="retry"
# step is run a second time although its first outcome arrived within the grace it had before this change.
def test_review25_a_lambda_endpoint_keeps_the_late_result_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_LAMBDA_FUNCTION_NAME", "payments-endpoint")  # the endpoint runs on Lambda
    charges: list[int] = []
    app = payments(charges)
    env = WorkflowEnvironment(app)
    env.engine.settings = replace(env.engine.settings, result_url=RESULT_URL)  # a deployment: the result function
    # the dispatcher that invoked attempt 1 stopped listening (its own time limit): the attempt stays authorized and
    # the endpoint, still running the callback, submits the outcome itself when it ends
    env.faults.crash_before_invoke("charge")
    run_id = env.start("pay")
    env.drive(
        until=lambda: (
            bool(attempts(env, run_id, "charge")) and attempts(env, run_id, "charge")[0].status.value == "authorized"
        )
    )
    [first] = attempts(env, run_id, "charge")
    assert first.respond_by is not None
    late_at = first.respond_by + timedelta(seconds=10)  # well within lease_grace_s (60 s)
    env.drive(until=lambda: env.clock.now >= late_at, horizon=late_at - env.clock.now)
    env.advance(late_at - env.clock.now)
    post_late(env, app, run_id, "charge", 1, {"charge_id": "ch_1"})
    run = env.wait(run_id)
    assert run.summary == "completed"
    statuses = [a["status"] for a in run.attempts("charge")]
    assert statuses == ["succeeded"], f"attempts {statuses}: the lease ended 3 s past respond_by and the step ran again"


def signed_heartbeat(env: WorkflowEnvironment, app_id: str, body: bytes) -> dict[str, str]:
    """Headers signing ``body`` (exactly these bytes) as the SDK signs a heartbeat posted to the result URL."""
    import os
    import time

    from ryusen._internal.signing import SIGNATURE_HEADER, app_key, sign, url_path
    from ryusen._internal.wire import Heartbeat, heartbeat_scope

    assert env.master_key is not None
    beat = Heartbeat.model_validate_json(body)
    path = url_path(env.engine.settings.result_url or "/v1/results")
    scope = heartbeat_scope(beat, path=path, app_id=app_id)
    key = app_key(env.master_key, app_id)
    return {SIGNATURE_HEADER: sign(key, scope, body, now=time.time(), nonce=os.urandom(16).hex())}


def long_step_in_flight(heartbeat_s: float = 10.0) -> tuple[WorkflowEnvironment, Ryusen, str]:
    """A run whose step ``encode`` (heartbeat ``heartbeat_s``) is authorized, its callback running elsewhere."""
    app = Ryusen("media")

    @app.function("encode")
    def encode(video: Any, step: Step) -> Any:
        return step.run(
            "encode", lambda: {"ok": True}, timeout=timedelta(hours=1), heartbeat=timedelta(seconds=heartbeat_s)
        )

    env = WorkflowEnvironment(app)
    env.faults.crash_before_invoke("encode")
    run_id = env.start("encode")

    def authorized() -> bool:
        found = attempts(env, run_id, "encode")
        return bool(found) and found[-1].status.value == "authorized"

    env.drive(until=authorized)
    return env, app, run_id


# FINDING C: submit_heartbeat checks the details with _values_problem(beat.details), which only looks at an
# outcome's .output/.result/.error.data attributes: a plain JSON value has none, so heartbeat details are never
# checked. NaN and Infinity (which JSON does not have: the run's view then is not JSON) and values nested past
# MAX_VALUE_DEPTH are recorded on the attempt. One-line fix:
# json_value_problem(beat.details).
@pytest.mark.parametrize(
    "details",
    ["NaN", "Infinity", "[" * 150 + "]" * 150],
    ids=["nan", "infinity", "nested-150"],
)
def test_review25_heartbeat_details_that_are_not_storable_json_are_refused(details: str) -> None:
    from ryusen_server.ports import InvalidRequestError

    env, app, run_id = long_step_in_flight()
    body = (
        f'{{"kind": "heartbeat", "run_id": "{run_id}", "step_id": "encode", "phase": "forward",'
        f' "generation": 1, "seq": 1, "details": {details}}}'
    ).encode()
    before = env.store.peek(run_id)
    with pytest.raises(InvalidRequestError):
        env.engine.submit_heartbeat(body, signed_heartbeat(env, app.app_id, body))
    after = env.store.peek(run_id)
    assert after is not None and before is not None and after.version == before.version  # nothing recorded


def shop(ships: list[int]) -> Ryusen:
    app = Ryusen("shop")

    @app.function("order")
    def order(o: Any, step: Step) -> Any:
        charge = step.run("charge", lambda: {"charge_id": "ch_1"}, timeout=timedelta(seconds=30))
        ship = step.run(
            "ship",
            lambda: ships.append(1) or {"tracking": "t1"},
            timeout=timedelta(hours=1),
            heartbeat=timedelta(seconds=10),
        )
        return {"charge": charge, "ship": ship}

    return app


# FINDING B: the result function (Engine.submit_result) authorizes the run's next task in the write that records a
# posted outcome and invokes it itself, but no message is its lease timer: _carry_on's Delivered(done=False, ...)
# is dropped. When no earlier message of the run is still out -- here the posted outcome settles an attempt that had
# already gone Unknown, whose message was deleted -- and the result function dies after that write (or the next
# task's acknowledged outcome is lost, or its heartbeats stop), only the sweeper notices, SWEEP_GRACE_S (300 s) past
# the lease: the step is not Unknown "within its heartbeat interval plus the lease grace" (issue 25, Done means).
def test_review25_a_task_the_result_function_authorized_has_a_lease_timer() -> None:
    from ryusen.testing import _Crash

    ships: list[int] = []
    app = shop(ships)
    env = WorkflowEnvironment(app)
    env.engine.settings = replace(env.engine.settings, result_url=RESULT_URL)
    env.faults.crash_before_invoke("charge")
    run_id = env.start("order")
    run = env.wait(run_id)  # charge's lease expires with no outcome: Unknown, blocked; its message is done
    assert [a["status"] for a in run.attempts("charge")] == ["unknown"]
    assert not list(env.pending_tasks())
    # the endpoint's post of charge's outcome reaches the result function, which records it, authorizes ship in the
    # same write, and dies invoking it (a crash, its 60 s limit, a throttled write of the answer...)
    late = LateResult(
        run_id=run_id,
        step_id="charge",
        phase=Phase.FORWARD,
        generation=1,
        attempt=CallbackSucceeded(result={"charge_id": "ch_1"}),
    )
    env.faults.crash_before_invoke("ship")
    with pytest.raises(_Crash):
        env.engine.submit_result(late.model_dump_json().encode(), env._signed_late_result(app.app_id, late))
    [ship] = attempts(env, run_id, "ship")
    assert ship.status.value == "authorized" and ship.lease_expires_at is not None
    # a deployment: messages and timers as due, and the sweeper every minute. The result function died between its
    # write and the invocation, so no lease timer was sent for ship (one is sent only for an attempt left in flight,
    # answered "accepted": tests/infra/test_stack_in_a_box.py): the sweeper notices, within lease_watch_grace_s
    # (15 minutes: ship's answer could be deferred on the queue, issue 24) and a few minutes past the lease, as
    # docs/design/dispatch.md says (it was never noticed before: the kit has no sweeper)
    grace = timedelta(seconds=env.engine.settings.engine.lease_watch_grace_s)
    deadline = ship.lease_expires_at + grace + timedelta(minutes=7)
    while env.clock.now < deadline:
        env.drive(horizon=timedelta(minutes=1))
        env.advance(min(timedelta(minutes=1), deadline - env.clock.now))
        env.engine.sweep()
    [ship] = attempts(env, run_id, "ship")[:1]
    assert ship.status.value != "authorized", (
        f"ship is still authorized {env.clock.now - ship.lease_expires_at} past its lease: nothing watches it"
    )


# FINDING D: a heartbeat is verified for its signature and its clock skew (300 s) only: nothing records its nonce,
# so one genuine heartbeat, captured (a proxy's or a Function URL's request log) and replayed, extends the lease of
# an attempt whose callback is dead for up to 5 minutes past its heartbeat interval, and rolls its details back.
def test_review25_a_replayed_heartbeat_does_not_extend_the_lease_again() -> None:
    env, app, run_id = long_step_in_flight(heartbeat_s=10.0)
    body = (
        f'{{"kind": "heartbeat", "run_id": "{run_id}", "step_id": "encode", "phase": "forward",'
        f' "generation": 1, "seq": 1, "details": {{"progress": 0.1}}}}'
    ).encode()
    headers = signed_heartbeat(env, app.app_id, body)
    env.engine.submit_heartbeat(body, headers)  # the genuine one
    [attempt] = attempts(env, run_id, "encode")
    lease = attempt.lease_expires_at
    env.advance(timedelta(seconds=12))  # the callback died; its lease (10 s + 3 s grace) is about to end
    with contextlib.suppress(Exception):  # a refusal is the right answer
        env.engine.submit_heartbeat(body, headers)  # the same bytes and signature, again
    [attempt] = attempts(env, run_id, "encode")
    assert attempt.lease_expires_at == lease, "a replayed heartbeat extended the lease of a dead callback"

"""Issue 24: a deferred answer, and what its receiver may claim and send (found by a second review of 332960c,
each failed there): a stale deferred "unreachable" must not re-queue a generation another delivery runs; a
receiver's claim that committed unseen must be claimable by the next receiver; a chained step never sent is
claimed (and re-authorized) however long the outage lasted."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

from ryusen.testing import WorkflowEnvironment
from tests.functional.test_store_outages import chained_env, until_deferred


def _until_deferred(env: WorkflowEnvironment, run_id: str) -> None:
    until_deferred(env)
    ship = env.store.peek(run_id).step("ship")  # type: ignore[union-attr]
    assert ship is not None and ship.attempts[0].status.value == "authorized"  # by the deferring dispatcher


def test_a_receiver_whose_claim_committed_unseen_does_not_strand_the_claimed_step() -> None:
    """The receiver of a deferred answer claims "ship" (re-stamps it with its own delivery id D2) in a write that
    commits, but whose answer is lost, and the store keeps refusing reads and writes past the retries.
    apply_deferred then re-defers the ORIGINAL answer (delivery id D1). Every later receiver claims D1, but "ship"
    is now D2's: nobody invokes it, and it goes Unknown at its lease's expiry although it was never sent.
    (deliver() covers the same case with a deferred "never sent"; apply_deferred does not.)"""
    calls: Counter[str] = Counter()
    env, flaky = chained_env(calls)
    run_id = env.start("order")
    _until_deferred(env, run_id)
    before = env.store.peek(run_id).step("ship").attempts[0].delivery_id  # type: ignore[union-attr]
    # the store takes writes again for one write whose answer is lost; then reads and writes fail for a while
    flaky.down = False
    flaky.commit_then_down = True
    flaky.reads_too = True
    due = env.next_due()
    assert due is not None
    env.clock.advance_to(due)
    assert env.step_once()  # the receiver of the deferred answer
    after = env.store.peek(run_id).step("ship").attempts[0]  # type: ignore[union-attr]
    assert after.delivery_id != before and calls["ship"] == 0  # claimed (committed), never sent
    flaky.down = False
    flaky.reads_too = False
    run = env.wait(run_id)
    ship = env.store.peek(run_id).step("ship")  # type: ignore[union-attr]
    unknown = [a.generation for a in ship.attempts if a.unknown_at is not None]
    assert not unknown, f"ship #{unknown} went Unknown though it was never sent; run {run.outcome} {run.blockers}"
    assert run.outcome == "completed" and calls == Counter({"charge": 1, "ship": 1})


def test_a_chained_step_never_sent_is_not_unknown_after_an_outage_longer_than_its_lease() -> None:
    """The write recording "charge" commits (authorizing "ship" under D1, chained), its answer is lost, and the
    table stays throttled for 10 minutes (the simulator's outages go to 15). The deferred answer comes back every
    <= 30 s and is re-deferred. When the store recovers, the receiver may claim "ship" only while D1's lease is
    live (owns(): now < lease_expires_at; 300 s + grace): it has expired, so nobody invokes "ship" and the next
    look at it expires it as lost -> Unknown, blocking on a person, although the engine knows it never sent it."""
    calls: Counter[str] = Counter()
    env, flaky = chained_env(calls)
    run_id = env.start("order")
    _until_deferred(env, run_id)
    start = env.clock.now
    while env.clock.now < start + timedelta(minutes=10):
        if not env.step_once():
            due = env.next_due()
            assert due is not None
            env.clock.advance_to(min(due, start + timedelta(minutes=10)))
    assert calls["ship"] == 0
    flaky.down = False
    run = env.wait(run_id)
    ship = env.store.peek(run_id).step("ship")  # type: ignore[union-attr]
    unknown = [a.generation for a in ship.attempts if a.unknown_at is not None]
    assert not unknown, f"ship #{unknown} went Unknown though it was never sent; run {run.outcome} {run.blockers}"
    assert run.outcome == "completed" and calls == Counter({"charge": 1, "ship": 1})


def test_a_stale_deferred_unreachable_does_not_requeue_the_generation_another_delivery_is_running() -> None:
    """A dispatcher D1 sends "charge" #1 and the Function URL refuses it (429, x-amzn-ErrorType:
    TooManyRequestsException: nothing ran). The write that re-queues #1 (same generation) commits, its answer is
    lost, and the retries are refused: the UNREACHABLE is deferred WITHOUT a delivery id (only deliver()'s "never
    sent" carries one). #1 is QUEUED in the store; its message (or the sweeper) sends it, and D2 authorizes #1
    and invokes it. While the callback runs, the deferred UNREACHABLE is received: it names #1, #1 is AUTHORIZED,
    so it is taken as D2's failure: #1 is re-queued and sent again, and a third delivery runs the charge again
    while D2's is still running. (Fix: every InvocationFailed carries the delivery id that sent the task, and
    the core ignores one that is not the live authorization's, as it does for "never sent".)"""
    calls: Counter[str] = Counter()
    import json

    from ryusen_server.core.model import TaskKind, TaskRef
    from ryusen_server.ports import InvokeResult
    from tests.functional.test_store_outages import _flaky_env, charge_app

    env, flaky = _flaky_env(charge_app(calls))
    real_intercept = env.invoker.intercept
    state = {"refused": False, "raced": False, "deferred": None}

    def front_end(url: str, body: bytes, headers: dict[str, str]) -> InvokeResult | None:
        request = json.loads(body)
        if request.get("step_id") == "charge" and not state["refused"]:
            state["refused"] = True
            flaky.commit_then_down = True  # the re-queue commits, its answer is lost ...
            flaky.reads_too = True  # ... and the store refuses reads and writes past the retries
            return InvokeResult(
                kind="response",
                status=429,
                headers={"x-amzn-ErrorType": "TooManyRequestsException"},
                body=b'{"message":"Rate Exceeded."}',
            )
        if request.get("step_id") == "charge" and state["deferred"] is not None and not state["raced"]:
            state["raced"] = True
            env.engine.apply_deferred(state["deferred"])  # the deferred answer, received meanwhile
        return real_intercept(url, body, headers) if real_intercept is not None else None

    env.invoker.intercept = front_end
    run_id = env.start("order")
    [message] = until_deferred(env)
    flaky.down = flaky.reads_too = False
    charge = env.store.peek(run_id).step("charge").attempts[0]  # type: ignore[union-attr]
    assert charge.status.value == "queued" and calls["charge"] == 0  # re-queued in the store, nothing ran
    state["deferred"] = message.task.deferred
    # the message of #1 (or the sweeper's re-send) comes back: D2 authorizes #1 and invokes it
    if charge.not_before is not None:
        env.clock.advance_to(charge.not_before)
    delivered = env.engine.deliver(TaskRef(run_id=run_id, kind=TaskKind.FORWARD, step_id="charge", generation=1))
    assert state["raced"], (delivered, charge)
    run = env.wait(run_id)
    assert calls["charge"] == 1, f"the charge ran {calls['charge']} times; run {run.outcome}"

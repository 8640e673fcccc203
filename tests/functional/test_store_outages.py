"""Issue 24: what a store outage (DynamoDB refusing writes, and reads, past botocore's retries) must not do.

Found by a review of the first fixes, each failed on that code: a deferred answer made Unknown by the sweeper,
a wake order looping over the first 100 blocked runs, forged wake orders, an unsigned 429 after the callback
ran, a deferred answer voided by an emergency rotation, a chained next step left authorized and never sent,
an authorization whose answer was lost. Then the simulator found a duplicated deferred answer invoking a
chained step twice. They use ``ryusen.testing`` (memory store, virtual clock) with a store wrapper that refuses
writes the way the DynamoDB store does past botocore's retries (``StoreUnavailableError``)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from datetime import timedelta
from typing import Any

from ryusen import Ryusen, Step
from ryusen.testing import WorkflowEnvironment
from ryusen_server.core.model import TaskRef
from ryusen_server.deferred import DeferredMessage, WakeMessage, WakeOrder
from ryusen_server.ports import InvokeResult, StoreUnavailableError


class FlakyStore:
    """A store whose writes (``save``/``create``) fail as a throttled DynamoDB's do while ``down``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.down = False
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _gate(self) -> None:
        if self.down:
            self.refused += 1
            raise StoreUnavailableError("DynamoDB: ProvisionedThroughputExceededException after retries")

    commit_then_down = False
    """The next save commits, its answer is lost, and the store is down from then on (botocore's retries of it
    and every later write are throttled)."""

    reads_too = False
    """While ``down``, reads fail too (a partition in trouble, not only write throttling)."""

    def get(self, run_id: str) -> Any:
        if self.reads_too:
            self._gate()
        return self.inner.get(run_id)

    def save(self, state: Any, *, expected_version: int) -> None:
        self._gate()
        self.inner.save(state, expected_version=expected_version)
        if self.commit_then_down:
            self.commit_then_down, self.down = False, True
            raise StoreUnavailableError("DynamoDB: 500 after the write committed; retries throttled")

    def create(self, state: Any) -> None:
        self._gate()
        self.inner.create(state)


def charge_app(calls: Counter[str], on_charge: Any = None) -> Ryusen:
    app = Ryusen("shop")

    def charge() -> dict[str, Any]:
        calls["charge"] += 1
        if on_charge is not None:
            on_charge()
        return {"charged": True}

    @app.function("order")
    def order(data: Any, step: Step) -> Any:
        return step.run("charge", charge)

    return app


def _flaky_env(
    app: Ryusen, *, chain_steps: bool = False, kept_passes: bool = False
) -> tuple[WorkflowEnvironment, FlakyStore]:
    env = WorkflowEnvironment(app, chain_steps=chain_steps, kept_passes=kept_passes)
    flaky = FlakyStore(env.store)
    env.engine.store = flaky  # type: ignore[assignment]
    env.engine.sleep = lambda _s: None
    # the dispatcher gives up quickly (the default retries 20 s)
    env.engine.settings = replace(env.engine.settings, store_retry_s=0.5)
    return env, flaky


def pending_deferred(env: WorkflowEnvironment) -> list[Any]:
    return [m for m in env.queue.pending() if isinstance(m.task, DeferredMessage)]


def until_deferred(env: WorkflowEnvironment) -> list[Any]:
    """Deliver until an answer is deferred to the queue; the deferred messages."""
    for _ in range(20):
        env.step_once()
        if pending_deferred(env):
            break
    deferred = pending_deferred(env)
    assert deferred, "the answer was never deferred"
    return deferred


# ---- 1. a deferred answer loses to the sweeper (or to the lease message) --------------------------------------


def test_a_deferred_success_is_not_made_unknown_by_the_sweeper_after_the_store_recovers() -> None:
    """A success is deferred to the queue while the run's partition is throttled for ~10 minutes. The deferred
    answer comes back with a doubling delay (2, 4, ... 512 s), so after the store recovers it may not be received
    again for up to as long as it has already waited. The sweeper does not know about it: at the lease's expiry
    plus SWEEP_GRACE_S (about 11 minutes after the deferral) it expires the attempt as lost -> Unknown. The same
    happens when the lease message comes back at 15 minutes (DEFERRAL_COVER_S), before the deferred answer's
    next receive at ~17 minutes.

    What should happen: the answer the engine had in hand is recorded (succeeded, never Unknown); the charge
    ran once. (Fix: cap the deferred answer's backoff well under the sweeper's grace and the lease cover, e.g.
    <= 30-60 s, and do not let a sweep or a lease message expire an attempt while a deferred answer for it may
    still be on its way, e.g. extend the lease cover each time the answer is re-deferred.)"""
    calls: Counter[str] = Counter()
    holder: dict[str, FlakyStore] = {}

    def throttle_from_now() -> None:
        holder["store"].down = True  # the callback ran; the write that records it is throttled

    env, flaky = _flaky_env(charge_app(calls, throttle_from_now))
    holder["store"] = flaky
    run_id = env.start("order")
    start = env.clock.now
    # deliver until the answer is deferred
    until_deferred(env)
    deferred_at = env.clock.now
    # the partition stays throttled for 10 minutes: every receive of the deferred answer re-defers it
    while env.clock.now < deferred_at + timedelta(minutes=10):
        if not env.step_once():
            due = env.next_due()
            assert due is not None
            env.clock.advance_to(min(due, deferred_at + timedelta(minutes=10)))
    flaky.down = False  # the table recovers
    # the sweeper runs every minute; drive everything else as it comes
    for _ in range(2000):
        if env.step_once():
            continue
        due = env.next_due()
        if due is None:
            break
        minute = env.clock.now + timedelta(minutes=1)
        env.clock.advance_to(min(due, minute))
        if env.clock.now == minute:
            env.engine.sweep()
        if env.clock.now > start + timedelta(hours=2):
            break
    run = env.get(run_id)
    [attempt] = run.attempts("charge")
    assert calls["charge"] == 1
    assert attempt["status"] == "succeeded"  # the deferred answer does land in the end (it resolves the Unknown)
    # ... but the attempt was Unknown (with an unknown_outcome blocker asking a person to act) from the sweep at
    # ~11 min until the deferred answer's receive at ~17 min: an operator following the blocker's remedy
    # ("retry") charges twice; "fail" discards the success. Issue 24: no Unknown where the engine had the answer.
    unknown_at = env.store.peek(run_id).steps[0].attempts[0].unknown_at  # type: ignore[union-attr]
    assert unknown_at is None, f"Unknown at {unknown_at} while its answer was deferred (deferred at {deferred_at})"


# ---- 2. a release sync's wake loops forever over the first 100 blocked runs -----------------------------------


def blocking_release(calls: Counter[str], release_id: str) -> Ryusen:
    """Calls "charge" twice in one pass: a duplicate_step_id definition blocker."""
    app = Ryusen("billing", build_id=f"build-{release_id}", release_id=release_id)

    @app.function("invoice")
    def invoice(data: Any, step: Step) -> Any:
        first = step.run("charge", lambda: calls.update(["charge"]) or {"charged": 10})
        fee = step.run("charge", lambda: calls.update(["fee"]) or {"fee": 1})
        return {"first": first, "fee": fee}

    return app


def test_a_wake_with_over_100_blocked_runs_ends_when_the_release_does_not_unblock_them() -> None:
    """150 runs are blocked by a definition. A release is synced that does not fix it (or fixes only some:
    the point is the runs stay listed in the blocked index while their discovery is queued or after it
    re-blocks). carry_out_wake wakes blocked[:100] and, since more than 100 are listed, sends the same order
    again at once. The index lists the same runs first every time, so: the order never ends (a message loop
    that re-reads the index and 100 runs per receive, forever, and re-queues discovery of the same runs after
    each re-block), and runs 101-150 are never woken by the sync (they wait for their probe).

    What should happen: one sync wakes each blocked run at most once and the wake messages end. (Fix: page the
    order with a cursor, e.g. WakeOrder(function_id, after=<last run id>) or the index's LastEvaluatedKey,
    instead of re-reading from the top; or carry the release id and skip runs already woken for it.)"""
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(blocking_release(calls, "r1"), chain_steps=False)
    run_ids = [env.start("invoice", idempotency_key=f"o-{i}") for i in range(150)]
    env.drive(horizon=timedelta(seconds=1))
    assert all(env.store.peek(r).blocked_by_definition for r in run_ids)  # type: ignore[union-attr]
    woken: Counter[str] = Counter()

    def observe(kind: str, payload: Any) -> None:
        if kind == "decided":
            event, decision = payload
            if type(event).__name__ == "WakeRequested" and getattr(event, "source", "") == "release_sync":
                woken[decision.state.id] += 1

    env.engine.hooks.append(observe)
    env.sync(blocking_release(calls, "r2"))  # a new release that still calls "charge" twice
    wake_messages = 0
    for _ in range(3000):  # without moving the clock: no probe, only what the sync queued
        pending = [m for m in env.queue.pending() if m.visible_at <= env.clock.now]
        if not pending:
            break
        wake_messages += sum(1 for m in pending if isinstance(m.task, WakeMessage))
        env.step_once()
    still_waking = [m for m in env.queue.pending() if isinstance(m.task, WakeMessage)]
    never_woken = [r for r in run_ids if woken[r] == 0]
    assert not still_waking, f"the wake order is still looping after {wake_messages} wake messages"
    assert not never_woken, f"{len(never_woken)} blocked runs were never woken by the sync"


def test_a_forged_wake_order_on_the_queue_is_refused() -> None:
    """Deferred answers are sealed so that a role allowed sqs:SendMessage (the Scheduler's) cannot act on runs;
    wake orders are not sealed at all. A forged ``{"wake": {"run_id": ...}}`` is carried out: here it makes
    a blocked run re-run its discovery (an endpoint invocation) whenever the sender likes; with a function id
    and > 100 blocked runs it starts the endless loop of the test above.

    What should happen: a wake order not sealed by the deployment is refused, like a deferred answer. (Fix:
    seal WakeOrder with the same master-derived key as DeferredAnswer.)"""
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(blocking_release(calls, "r1"), chain_steps=False)
    run_id = env.start("invoice")
    env.drive(horizon=timedelta(seconds=1))
    assert env.store.peek(run_id).blocked_by_definition  # type: ignore[union-attr]
    discoveries: list[str] = []
    env.engine.hooks.append(
        lambda kind, payload: (
            discoveries.append(payload[0].describe())
            if kind == "invoke" and isinstance(payload[0], TaskRef) and payload[0].kind.value == "discover"
            else None
        )
    )
    env.queue.wake(WakeOrder(run_id=run_id))  # what anyone with sqs:SendMessage can put on the queue
    while env.step_once():
        pass
    assert discoveries == [], f"a forged wake order made the engine invoke the endpoint: {discoveries}"


# ---- 3. an unsigned 429 after the callback ran re-runs the effect ---------------------------------------------


def test_an_unsigned_429_after_the_callback_ran_does_not_run_the_callback_again() -> None:
    """The engine treats ANY unsigned HTTP 429 as "nothing ran" and sends the same generation again. A 429 can
    come from something between the engine and the app after the app ran: a user's reverse proxy / WAF /
    API gateway with a response-side quota, a load balancer answering 429 when the upstream was slow, or an
    on-path attacker replacing the signed answer. Before issue 24 an unsigned answer was LOST (Unknown: an
    operator decides); now the callback is silently run a second time (a second charge).

    What should happen: the effect runs at most once without a person's decision; an unsigned 429 can only be
    trusted as "not sent" where the front end provably refused before the app (e.g. Lambda's own
    ``x-amzn-ErrorType: TooManyRequestsException`` on a Function URL the release declares as Lambda), and
    otherwise it is LOST like any unsigned answer. (At minimum: only when the release is known to be behind a
    Lambda Function URL.)"""
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(charge_app(calls), chain_steps=False)
    proxied = {"left": 1}
    real_intercept = env.invoker.intercept

    def proxy(url: str, body: bytes, headers: dict[str, str]) -> InvokeResult | None:
        request = json.loads(body)
        forwarded = real_intercept(url, body, headers)
        if forwarded is not None or request.get("kind") != "forward" or proxied["left"] == 0:
            return forwarded
        proxied["left"] -= 1
        env.invoker.apps[url]("POST", headers, body)  # the app runs the callback ...
        # ... and the proxy answers with its own 429, unsigned (a plain proxy, no Lambda headers at all)
        return InvokeResult(kind="response", status=429, headers={}, body=b"Too Many Requests")

    env.invoker.intercept = proxy
    run_id = env.start("order")
    run = env.wait(run_id)
    assert calls["charge"] == 1, f"the charge ran {calls['charge']} times; run {run.outcome}"


# ---- 4. a deferred answer sealed before an emergency rotation is dropped --------------------------------------


def test_a_deferred_answer_survives_an_emergency_key_rotation() -> None:
    """An answer deferred while the store throttles is sealed with the master key of the moment. An operator
    who rotates the key in an emergency (``ryusen key rotate --emergency``: no previous key kept) meanwhile
    makes every deferred answer on the queue fail ``verify``; apply_deferred logs an error and returns None,
    the message is deleted, and the success the engine had becomes Unknown at the lease's expiry.

    What should happen: an answer the engine itself verified is not lost to a rotation of the signing key.
    (Fix: seal deferred answers with a key that is not rotated with the app-signing master, e.g. a separate
    queue-sealing secret, or KMS; or keep the old key for sealing only; at the very least, do not delete the
    message: leave it to the DLQ with an alarm.)"""
    calls: Counter[str] = Counter()
    holder: dict[str, FlakyStore] = {}
    env, flaky = _flaky_env(charge_app(calls, lambda: setattr(holder["store"], "down", True)))
    holder["store"] = flaky
    run_id = env.start("order")
    until_deferred(env)
    flaky.down = False
    env.engine.settings = replace(env.engine.settings, master_key="f" * 64)  # emergency rotation: old key gone
    run = env.wait(run_id)
    assert calls["charge"] == 1
    assert run.attempts("charge")[0]["status"] == "succeeded", run.attempts("charge")


# ---- 5. a write that committed but whose answer was lost, then throttles: a false Unknown --------------------


def two_step_app(calls: Counter[str], on_charge: Any = None) -> Ryusen:
    app = Ryusen("shop2")

    def charge() -> dict[str, Any]:
        calls["charge"] += 1
        if on_charge is not None:
            on_charge()
        return {"charged": True}

    @app.function("order")
    def order(data: Any, step: Step) -> Any:
        step.run("charge", charge)
        return step.run("ship", lambda: calls.update(["ship"]) or {"shipped": True})

    return app


def chained_env(calls: Counter[str]) -> tuple[WorkflowEnvironment, FlakyStore]:
    """Two chained steps; the write that records "charge" (and authorizes "ship") commits, its answer is lost,
    and the store is down from then on, until the test brings it back."""
    holder: dict[str, FlakyStore] = {}
    app = two_step_app(calls, lambda: setattr(holder["store"], "commit_then_down", True))
    env = WorkflowEnvironment(app, chain_steps=True)
    flaky = FlakyStore(env.store)
    holder["store"] = flaky
    env.engine.store = flaky  # type: ignore[assignment]
    env.engine.sleep = lambda _s: None
    env.engine.settings = replace(env.engine.settings, store_retry_s=0.5)
    return env, flaky


def test_a_chained_next_step_authorized_by_a_write_whose_answer_was_lost_is_not_made_unknown() -> None:
    """With chaining, the write that records "charge" also authorizes "ship" (AttemptReported with a chain). That
    write commits, its answer is lost, and the retries are throttled: the dispatcher defers the answer (without the
    chain) and keeps its message away for 15 minutes. "ship" is AUTHORIZED in the store but was never sent, and
    nothing will send it: the deferred answer is a stale report (it re-sends only QUEUED work), so when the
    message comes back after the lease, "ship" is expired as lost -> Unknown, blocking on a person although the
    engine knows it never invoked it.

    What should happen: "ship" runs once, never Unknown. (Fix: when a deferred answer meets an attempt that its
    own first try authorized by chaining (same delivery), re-queue it; or carry the chained authorization's
    delivery id in the deferred answer and let the receiver invoke it; or never chain on a write that is being
    retried after an unknown result.)"""
    calls: Counter[str] = Counter()
    env, flaky = chained_env(calls)
    run_id = env.start("order")
    until_deferred(env)
    flaky.down = False  # the table recovers at once
    run = env.wait(run_id)
    ship = env.store.peek(run_id).step("ship")  # type: ignore[union-attr]
    assert ship is not None
    unknown = [a.generation for a in ship.attempts if a.unknown_at is not None]
    assert calls["charge"] == 1
    assert not unknown, f"ship #{unknown} went Unknown though it was never sent; run {run.outcome} {run.blockers}"
    assert run.outcome == "completed" and calls["ship"] == 1


# ---- 6. an authorization that committed but whose answer was lost, then throttles ----------------------------


def test_an_authorization_whose_answer_was_lost_is_invoked_when_its_message_returns() -> None:
    """deliver() retries the authorization write with the same delivery id, so a retry that meets its own
    committed write invokes the task. But when every retry is throttled, the message comes back in 5 s with a
    NEW delivery id (uuid4 per receive): it finds the attempt authorized by someone else, waits for the lease,
    and expires it as lost -> Unknown, although nothing was ever sent.

    What should happen: the attempt is invoked once and succeeds, never Unknown. (Fix: make the delivery id a
    function of the message (the SQS message id), so the same message coming back recognises its own
    authorization and invokes it.) Holds up when only writes are throttled: the retry reads its own write.)"""
    calls: Counter[str] = Counter()
    env, flaky = _flaky_env(charge_app(calls))
    run_id = env.start("order")
    # discovery first (queue-driven), until the charge attempt is queued
    for _ in range(20):
        state = env.store.peek(run_id)
        if state is not None and state.step("charge") is not None:
            break
        env.step_once()
    flaky.commit_then_down = True  # the next save (the charge's authorization) commits; its answer is lost
    flaky.reads_too = True  # and the partition refuses reads too while the dispatcher retries
    env.step_once()
    attempt = env.store.peek(run_id).step("charge").attempts[0]  # type: ignore[union-attr]
    assert attempt.status.value == "authorized" and calls["charge"] == 0  # authorized, never sent
    flaky.down = False
    run = env.wait(run_id)
    [attempt] = env.store.peek(run_id).step("charge").attempts[:1]  # type: ignore[union-attr]
    assert attempt.unknown_at is None, f"never sent, yet Unknown: {attempt.detail}"
    assert run.outcome == "completed" and calls["charge"] == 1


def test_a_deferred_answer_delivered_twice_invokes_the_next_step_once() -> None:
    """SQS may deliver the deferred answer twice. Each receiver claims the chained authorization the deferring
    dispatcher made, in a fenced write: one wins and invokes it; the other finds it taken (found by the
    simulator, which ran "ship" twice before the claim)."""
    calls: Counter[str] = Counter()
    env, flaky = chained_env(calls)
    run_id = env.start("order")
    [deferred] = until_deferred(env)
    again = deferred.task.deferred  # the same answer, delivered again: to another dispatcher, at the same time
    real_intercept = env.invoker.intercept
    raced = []

    def while_ship_runs(url: str, body: bytes, headers: dict[str, str]) -> InvokeResult | None:
        if json.loads(body).get("step_id") == "ship" and not raced:
            raced.append(env.engine.apply_deferred(again))  # the second receiver decides meanwhile
        return real_intercept(url, body, headers) if real_intercept is not None else None

    env.invoker.intercept = while_ship_runs
    flaky.down = False
    run = env.wait(run_id)
    assert raced, "the second receiver never raced the first"
    assert run.outcome == "completed"
    assert calls == Counter({"charge": 1, "ship": 1})

"""Adversarial review of the lease-carrier fixes (15cab65, c4e6130): each test names the defect it demonstrates
and fails against the reviewed code."""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest

from ryusen import RetryPolicy, Ryusen
from ryusen.testing import WorkflowEnvironment, _Crash
from ryusen_server.core.model import AttemptStatus, TaskRef
from ryusen_server.runtime import process_message
from tests.conformance.test_review_carriers import (
    RESULT_URL,
    attempt,
    attempt_status,
    flaky_env,
    post_result,
    two_steps,
)
from tests.functional.test_store_outages import FlakyStore, _flaky_env, until_deferred


def kept_flaky_env(app: Ryusen) -> tuple[WorkflowEnvironment, FlakyStore]:
    """``flaky_env`` served as a warm endpoint process is (kept passes): a callback's answer carries the next step
    (``next``), so the write that records it authorizes that step itself, as on a deployment."""
    return _flaky_env(app, chain_steps=True, kept_passes=True)


def _sweep_every_minute(env: WorkflowEnvironment, until: Any) -> None:
    """A deployment from now: messages and timers as due, and the sweeper every minute, until ``until``."""
    while env.clock.now < until:
        while env.step_once():
            pass
        env.clock.advance(min(timedelta(minutes=1), until - env.clock.now))
        env.engine.sweep()


def _charge_deferred(
    calls: Counter[str], *, committed: bool = False, **kw: Any
) -> tuple[WorkflowEnvironment, FlakyStore, str, Ryusen]:
    """A chained two-step run whose charge succeeded and whose success is deferred (the store refuses writes from
    the callback on). ``committed``: the write of that success, which authorized ship, committed before the store
    went down (its answer lost), so ship is authorized and was never sent."""
    holder: dict[str, FlakyStore] = {}

    def throttle() -> None:
        if calls["charge"] == 1:
            if committed:
                holder["store"].commit_then_down = True
            else:
                holder["store"].down = True

    app = two_steps(calls, on_charge=throttle, **kw)
    env, flaky = kept_flaky_env(app)
    holder["store"] = flaky
    run_id = env.start("order")
    until_deferred(env)
    return env, flaky, run_id, app


# ---- 1. _apply_deferred's release-mismatch return ---------------------------------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="known limit (docs/deploy.md): a next step authorized for a release synced over meanwhile is not sent by"
    " the deferred answer's receiver; its carrier (that message) takes it as Unknown at its lease (it never ran: a"
    " retry runs it once)",
)
def test_a_deferred_answer_received_after_a_release_sync_does_not_leave_the_next_step_authorized_and_unsent() -> None:
    """Medium. The write of charge's success, which also authorized ship (chained), committed and its answer was
    lost; the dispatcher deferred the answer. Its receiver claims that never-sent authorization
    (``invoke_own_authorization``: re-authorized under this message's tag) and the decision says ``InvokeTask``.
    Only then does ``_apply_deferred`` compare the deferred ``chain`` with the current release; a release was
    synced during the outage (a deploy, a ``ryusen dev`` reload), so it returns ``Delivered(done=True)`` ("not the
    code it was authorized for: its lease decides"). Ship was never sent, and the one message that would judge its
    lease at its end, its carrier, is the one just deleted: every other watcher waits ``lease_watch_grace_s``. In
    the kit nothing moves the run again; on a deployment the sweeper takes ship as Unknown 15 minutes past its
    lease: a false Unknown (ship never ran) that blocks the run for an operator. (Without the commit, the same
    return leaves the chained discovery pass authorized and unsent until the sweeper, ~11 minutes.) The first
    review named this return; 15cab65 left it. Fix: compare the release before applying and apply the answer with
    ``chain=None`` when it is not current (the next task is then queued as a message, and a claimed authorization
    re-queued), or keep the message as the carrier of what it authorized (done=False until that lease)."""
    calls: Counter[str] = Counter()
    env, flaky, run_id, app = _charge_deferred(calls, committed=True)
    assert attempt_status(env, run_id, "ship") == "authorized" and calls["ship"] == 0
    env.sync(app, release_id="shop-v2")  # a deploy while the answer waits on the queue
    flaky.down = False
    env.clock.advance(timedelta(seconds=1))
    assert env.step_once()  # the deferred answer: charge succeeds, ship authorized for the old release, not sent
    ship = attempt(env, run_id, "ship")
    lease = ship.lease_expires_at
    _sweep_every_minute(env, lease + timedelta(minutes=8))
    run = env.get(run_id)
    ship = attempt(env, run_id, "ship")
    assert calls["ship"] == 1 and run.outcome == "completed", (
        f"ship was never sent and is {ship.status.value} 8 minutes past its lease (unknown_at={ship.unknown_at});"
        f" run {run.summary}"
    )


# ---- 2. a duplicate receive of a deferred message decides on a stale ``before`` ------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="known limit: a deferred message received twice at once: the second receive, deciding on a stale read, is done and deletes the carrier of what the first carried on; a silent next step is then Unknown lease_watch_grace_s past its lease",
)
def test_a_duplicate_receive_of_a_deferred_answer_does_not_delete_the_carrier_of_what_the_first_carried_on() -> None:
    """Low. SQS may hand the same deferred message (one message id, so one carrier tag) to two dispatchers at once.
    Both read ``before`` while charge is still authorized, so for both ``_awaits(before, event)`` is true. The first
    records charge and carries on (discovery, then ship, authorized under the message's tag) and its dispatcher
    dies invoking ship (or ship answers "accepted"): the message is ship's lease timer. The second's write meets
    the first's at the version fence, decides again and finds charge stale; it neither owns nor claims ship, so no
    ``InvokeTask``. Because ``before`` said "awaiting", it skips ``_watch`` and returns ``Delivered(done=True)``: the
    message, ship's carrier, is deleted. Every other watcher waits ``lease_watch_grace_s``: a silent ship is
    Unknown 15-20 minutes past its lease, not at it. A task message received twice keeps itself in the same race
    (``attempt_delivered`` -> ``RedeliverLater``). Fix: decide "the answer was recorded before" from the decision
    (a stale report), not from the ``before`` read; or ``_watch`` on every return that invoked nothing."""
    calls: Counter[str] = Counter()
    env, flaky, run_id, _app = _charge_deferred(calls)
    flaky.down = False
    env.clock.advance(timedelta(seconds=1))
    [message] = env.queue.receive(max_messages=1)
    mid = message.message_id
    env.faults.crash_before_invoke("ship")  # the first receiver dies invoking ship (its message: ship's lease)
    read = flaky.get
    raced: list[str] = []

    def first_receiver_runs_meanwhile(run_id_: str) -> Any:
        snapshot = read(run_id_)  # the second receiver's ``before``: charge still authorized
        if not raced:
            raced.append("first")
            with contextlib.suppress(_Crash):
                process_message(
                    env.engine, message.task, on_authorized=lambda s: env.queue.change_visibility(mid, s), carrier=mid
                )
        return snapshot

    flaky.get = first_receiver_runs_meanwhile  # type: ignore[method-assign]
    done, _later = process_message(env.engine, message.task, carrier=mid)  # the second receiver
    del flaky.get
    assert raced
    ship = attempt(env, run_id, "ship")
    assert ship.status is AttemptStatus.AUTHORIZED and calls["ship"] == 0
    if done:
        env.queue.delete(mid)
    _sweep_every_minute(env, ship.lease_expires_at + timedelta(minutes=8))
    ship = attempt(env, run_id, "ship")
    assert ship.status is AttemptStatus.UNKNOWN, (
        f"the second receiver returned done={done} (its carrier deleted): ship is still {ship.status.value} 8 minutes"
        " past its lease"
    )


# ---- 3. the carrier's return during a store outage re-defers an answer already recorded ---------------------------


@pytest.mark.xfail(
    strict=True,
    reason="known limit: a deferred message back as a lease timer while the store refuses is deferred again as a new message (so that a claim of its that committed unseen is claimed next), which carries nothing: a silent next step is then Unknown lease_watch_grace_s past its lease",
)
def test_a_deferred_message_back_as_a_lease_timer_during_an_outage_stays_the_carrier() -> None:
    """Low. A deferred answer's receiver recorded charge and carried on to ship (tagged with the deferred message,
    kept as ship's lease timer); ship goes silent (here the dispatcher dies invoking it). At ship's lease the
    message comes back while the store refuses writes: ``_apply_deferred`` re-applies the old answer, the write is
    refused, and the ``StoreUnavailableError`` branch re-defers it as a NEW message (a new id, so a new carrier tag)
    and returns done: ship's carrier is deleted. When the store is back, the copy finds its answer recorded and
    ``_watch``es as a stranger to ship: ship is Unknown only ``lease_watch_grace_s`` (15 min) past its lease
    instead of seconds after the outage. The same holds for a ``_watch`` whose answer's ``before`` read fails.
    Fix: when the answer is already recorded (``not _awaits(before, ...)``), keep the message on a refused write
    (``done=False``, ``STORE_UNAVAILABLE_RETRY_S``) instead of re-deferring it; or give a re-deferred copy the
    carrier identity of the message it replaces (as ``resend`` does)."""
    calls: Counter[str] = Counter()
    env, flaky, run_id, _app = _charge_deferred(calls)
    flaky.down = False
    env.faults.crash_before_invoke("ship")
    env.clock.advance(timedelta(seconds=1))
    assert env.step_once()  # the deferred answer: charge recorded, ship authorized under its tag, then the crash
    ship = attempt(env, run_id, "ship")
    assert ship.status is AttemptStatus.AUTHORIZED and calls["ship"] == 0
    env.clock.advance_to(ship.lease_expires_at + timedelta(seconds=1))
    flaky.down = True  # a short outage just as the carrier comes back
    assert env.step_once()
    env.clock.advance(timedelta(seconds=10))
    flaky.down = False
    _sweep_every_minute(env, ship.lease_expires_at + timedelta(minutes=3))
    ship = attempt(env, run_id, "ship")
    assert ship.status is AttemptStatus.UNKNOWN, (
        f"ship is still {ship.status.value} 3 minutes past its lease, 2 after a 10-second outage: its carrier was"
        " replaced by a re-deferred copy"
    )


# ---- 4. the result function's write that committed unseen -----------------------------------------------------


def _next_after_charge(app: Ryusen) -> Any:
    """What charge's replay finds next (ship's plan), as an acknowledged attempt's SDK posts it (``next``)."""
    env = WorkflowEnvironment(app, chain_steps=True, kept_passes=True)
    found: list[Any] = []
    env.engine.hooks.append(
        lambda kind, payload: (
            found.append(payload[0].next)
            if kind == "decided" and getattr(payload[0], "next", None) is not None and not found
            else None
        )
    )
    env.run("order")
    env.close()
    return found[0]


def _post(env: WorkflowEnvironment, app: Ryusen, run_id: str, step_id: str, result: Any, **extra: Any) -> None:
    """The SDK's post of attempt 1's outcome to the result function (with what its replay found next, if given)."""
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


def test_a_task_the_result_function_authorized_in_a_write_whose_answer_was_lost_is_sent() -> None:
    """Medium. The result function records charge's posted success and, in the same write, authorizes ship (the
    SDK's ``next``, trusted). That write commits, its answer is lost, and the store refuses the retries: it answers
    503 and the SDK posts again later. Ship is authorized, never sent. The SDK's repost runs under a new
    ``carried_by("result function <uuid>")`` with a new delivery id and no ``claims``: charge is stale, and
    ``invoke_own_authorization`` neither owns nor claims ship. A dispatcher in the same spot defers its answer with
    the delivery id, and the receiver claims and invokes the task (test_store_outages); the result function has no
    such path. Ship is tagged with a carrier no message has, so charge's message (back at charge's lease) and the
    sweeper wait ``lease_watch_grace_s``: 15 minutes past its lease ship, which never ran, is taken as Unknown and
    the run blocks for an operator (before 15cab65: the same false Unknown, at the lease). Fix: make the result
    function's delivery id a function of the posted outcome (run, step, phase, generation), so a repost owns the
    authorization its first try committed; or, on a refused write, defer the posted outcome to the queue with its
    delivery id (a receiver then claims the authorization, as for a dispatcher)."""
    calls: Counter[str] = Counter()
    app = two_steps(calls)
    following = _next_after_charge(app)
    calls.clear()
    env, flaky = kept_flaky_env(app)
    env.engine.settings = replace(env.engine.settings, result_url=RESULT_URL)
    env.faults.crash_before_invoke("charge")  # the dispatcher stops listening; the endpoint posts the outcome
    run_id = env.start("order")
    env.drive(until=lambda: attempt_status(env, run_id, "charge") == "authorized")
    build = attempt(env, run_id, "charge").build_id
    flaky.commit_then_down = True  # the result function's write commits; its answer is lost; the store refuses
    # taken: the outcome is deferred to the queue with its delivery id (before: a 503, and the SDK posted again)
    _post(env, app, run_id, "charge", {"charged": True}, next=following, build_id=build)
    ship = attempt(env, run_id, "ship")
    assert ship.status is AttemptStatus.AUTHORIZED and calls["ship"] == 0
    flaky.down = False
    _sweep_every_minute(env, ship.lease_expires_at + timedelta(minutes=20))
    ship = attempt(env, run_id, "ship")
    run = env.get(run_id)
    assert calls["ship"] == 1 and run.outcome == "completed", (
        f"ship was never sent; it is {ship.status.value} (Unknown {ship.unknown_at - ship.lease_expires_at if ship.unknown_at else '-'}"
        f" past its lease); run {run.summary}"
    )


# ---- 5. an acknowledged attempt's lease timer and a posted outcome the store refused ---------------------------


@pytest.mark.xfail(
    strict=True,
    reason="known limit (docs/deploy.md): an acknowledged attempt's lease timer judges at the lease; an outcome the"
    " result function deferred while the store refused it races it, and settles the Unknown when it lands (with"
    " on_unknown='retry', declared safe to run twice, the retry may run first)",
)
def test_an_acknowledged_outcome_posted_during_a_short_outage_is_not_taken_as_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """High. The result function carries the run on to ship (tagged with its own carrier) and ship answers
    "accepted": ship gets a ``lease_timer`` message, which ``lease_timer_delivered`` judges exactly at the lease,
    grace or not. Ship's callback ends and the SDK posts its success to the result function while the store refuses
    writes (a 2-minute throttle): ``submit_result`` retries ~15 s and answers 503 (the SDK holds the outcome and
    posts again, every 30 s after its first tries). Unlike a dispatcher with an answer in hand, it does not defer
    it to the queue, and nothing makes the attempt's carrier wait: the lease timer, kept every 5 s while the store
    refuses, is the first write once the store is back and takes ship as Unknown (its lease is the timeout plus
    ``acknowledged_lease_grace_s``, 3 s). With ``on_unknown="retry"`` the retry is due in 1 s and runs ship again
    before the SDK's next post, which is then stale. An outage of 2 minutes, well under ``lease_watch_grace_s``,
    ran the step twice: issue 24 ("no Unknown where the engine had the answer") is open on the path every
    acknowledged step answers through (a dispatcher's kept message, the carrier of an acknowledged attempt it
    invoked, does the same). Fix: on a refused write, the result function defers the posted outcome to the queue
    (answering 202) as a dispatcher does, and an acknowledged attempt's carrier (lease timer or kept message)
    waits ``lease_watch_grace_s`` past the lease before taking it as Unknown, or at least while a post of it
    was refused."""
    import time as real_time

    calls: Counter[str] = Counter()
    holder: dict[str, Any] = {}

    def slow_ship() -> None:
        real_time.sleep(0.3)  # longer than acknowledge_after_s (0.1 s): the endpoint answers "accepted"

    app = two_steps(calls, on_ship=slow_ship, ship_retry=RetryPolicy(max_attempts=3, on_unknown="retry"))
    # the SDK's own post of ship's outcome is made by the test (below), at the time it matters
    monkeypatch.setattr(app, "_deliver_acknowledged", lambda request, outcome: None)
    env, flaky = flaky_env(app)
    holder["store"] = flaky
    env.engine.settings = replace(env.engine.settings, result_url=RESULT_URL)
    env.faults.crash_before_invoke("charge")  # the dispatcher stops listening; the endpoint posts the outcome
    run_id = env.start("order")
    env.drive(until=lambda: attempt_status(env, run_id, "charge") == "authorized")
    post_result(env, app, run_id, "charge", {"charged": True})  # carries on: ship, answered "accepted"
    real_time.sleep(0.5)
    ship = attempt(env, run_id, "ship")
    assert ship.status is AttemptStatus.AUTHORIZED and calls["ship"] == 1
    timers = [m for m in env.queue.pending() if isinstance(m.task, TaskRef) and m.task.lease_timer]
    assert timers, "no lease timer for ship"
    env.clock.advance_to(ship.lease_expires_at - timedelta(seconds=2))  # ship's callback ends ...
    flaky.down = True  # ... during a store throttle: the result function defers the outcome to the queue
    post_result(env, app, run_id, "ship", {"shipped": True})
    outage_ends = env.clock.now + timedelta(minutes=2)
    while env.clock.now < outage_ends:  # the lease timer comes back meanwhile and is kept (the store refuses)
        while env.step_once():
            pass
        env.clock.advance(timedelta(seconds=5))
    flaky.down = False
    next_post = env.clock.now + timedelta(seconds=20)  # the SDK's next try (30 s apart by now)
    while env.clock.now < next_post:
        while env.step_once():
            pass
        env.clock.advance(timedelta(seconds=1))
    real_time.sleep(0.5)
    post_result(env, app, run_id, "ship", {"shipped": True})  # the SDK's next try: the store takes it
    first = attempt(env, run_id, "ship")
    assert first.unknown_at is None and calls["ship"] == 1, (
        f"ship went Unknown {first.unknown_at - first.lease_expires_at if first.unknown_at else ''} past its lease"
        f" while the SDK held its success (a 2-minute outage), and ran {calls['ship']} times"
    )


# ---- 6. ryusen dev restarted: a lease still running when the queue was lost ------------------------------------


def test_after_a_restart_that_lost_every_message_a_running_lease_is_judged_at_its_end() -> None:
    """Low. ``ryusen dev`` restarted keeps its runs and loses its queue; it calls ``Engine.recover`` (a sweep with
    ``messages_lost=True``: ``exact_leases``). docs/design/engine.md: "A sweep after every message was lost
    (``ryusen dev`` restarted) judges every lease at its end". It does so only for leases already over at the
    restart: for one still running, ``reemit_stalled`` finds nothing due and ``sweep`` drops its ``RedeliverLater``;
    later sweeps are ordinary (``exact_leases`` False), so an attempt tagged with a carrier that did not survive
    the restart waits ``lease_watch_grace_s``: Unknown 15-20 minutes past its lease, where before the carriers the
    sweeper took it 5-10 minutes past (its callback died with the app processes ``ryusen dev`` restarted). Fix:
    ``recover`` re-sends a lease timer (``lease_timer=True``) for each attempt in flight, or records on the run that
    its carriers are gone (judged exactly from then on)."""
    calls: Counter[str] = Counter()
    app = two_steps(calls)
    env = WorkflowEnvironment(app, chain_steps=False)
    env.faults.crash_before_invoke("charge")
    run_id = env.start("order")
    env.drive(until=lambda: attempt_status(env, run_id, "charge") == "authorized")
    charge = attempt(env, run_id, "charge")
    env.clock.advance(timedelta(seconds=30))  # restarted mid-attempt: the queue is new, the runs are kept
    env.queue.drop_all()
    env.engine.recover([run_id])
    _sweep_every_minute(env, charge.lease_expires_at + timedelta(minutes=11))
    charge = attempt(env, run_id, "charge")
    assert charge.status is AttemptStatus.UNKNOWN, (
        f"charge is still {charge.status.value} 11 minutes past its lease after a restart that lost its carrier"
    )

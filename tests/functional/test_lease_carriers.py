"""Issue 24, "no Unknown where the engine had the answer": the attempt's carrier, and everything else that watches
its lease.

The simulator with store outages found attempts taken as Unknown while the success a dispatcher held was on the
queue, deferred because the store would not take it. Each was another message than the attempt's own lease timer:
a duplicate or stale task message (every stale message watches the run's leases), the same message received again
by another dispatcher while the first still retried its write, or the sweeper. Each test here failed on ad09d9c.

Now only the message that carries an attempt (its delivery authorized it, and it is kept as its lease timer) takes
it as Unknown when the lease ends; any other message, and the sweeper, wait ``lease_watch_grace_s`` (15 minutes)
past the lease. A dispatcher that defers an answer deletes its message, so the deferred answer is the attempt's only
carrier, and it keeps its message away while it retries the write."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

import ryusen_server.engine as engine_module
from ryusen.testing import EPOCH, WorkflowEnvironment
from ryusen_server.core.model import AttemptStatus, TaskKind, TaskRef
from tests.functional.test_store_outages import FlakyStore, _flaky_env, charge_app, until_deferred


def _deferred_charge() -> tuple[WorkflowEnvironment, FlakyStore, str, Counter[str]]:
    """A run whose charge ran and whose success is deferred: the store refuses writes from the callback on."""
    calls: Counter[str] = Counter()
    holder: dict[str, FlakyStore] = {}

    def throttle_from_now() -> None:
        holder["store"].down = True

    env, flaky = _flaky_env(charge_app(calls, throttle_from_now))
    holder["store"] = flaky
    run_id = env.start("order")
    until_deferred(env)
    return env, flaky, run_id, calls


def _charge(env: WorkflowEnvironment, run_id: str) -> Any:
    state = env.store.peek(run_id)
    assert state is not None
    return state.steps[0].attempts[0]


def _drive(env: WorkflowEnvironment, hours: float = 2.0) -> None:
    until = env.clock.now + timedelta(hours=hours)
    while env.clock.now < until:
        if env.step_once():
            continue
        due = env.next_due()
        if due is None:
            return
        env.clock.advance_to(min(due, until))


def test_the_dispatcher_that_defers_an_answer_deletes_its_message() -> None:
    env, _flaky, run_id, _calls = _deferred_charge()
    tasks = [m.task for m in env.queue.pending() if isinstance(m.task, TaskRef)]
    assert tasks == []  # before: the charge's message stayed, to come back in 15 minutes as its lease timer
    assert _charge(env, run_id).status is AttemptStatus.AUTHORIZED


def test_a_message_whose_deletion_fails_after_a_deferral_stays_away_for_the_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The deletion of the deferring dispatcher's message fails too (the queue failing as well): the message was
    already kept away for ``lease_watch_grace_s``, so it cannot come back as the carrier before the deferred answer
    has had that long."""
    calls: Counter[str] = Counter()
    holder: dict[str, FlakyStore] = {}

    def throttle_from_now() -> None:
        holder["store"].down = True

    env, flaky = _flaky_env(charge_app(calls, throttle_from_now))
    holder["store"] = flaky
    monkeypatch.setattr(env.queue, "delete", lambda _message_id: None)  # every deletion is lost
    run_id = env.start("order")
    until_deferred(env)
    [kept] = [m for m in env.queue.pending() if isinstance(m.task, TaskRef) and m.task.step_id == "charge"]
    grace = timedelta(seconds=env.engine.settings.engine.lease_watch_grace_s)
    assert kept.visible_at >= env.clock.now + grace
    assert _charge(env, run_id).status is AttemptStatus.AUTHORIZED


def test_a_duplicate_of_the_task_received_after_the_lease_leaves_a_deferred_success_alone() -> None:
    """SQS delivers at least once, and the sweeper re-sends a task it thinks lost: a second copy of the charge's
    task is received after the attempt's lease, once the store is back, before the deferred answer (which a
    backlog delays). Before, that copy took the attempt as Unknown: an operator was asked to decide on a
    success the engine had, and ``retry`` would have charged twice."""
    env, flaky, run_id, calls = _deferred_charge()
    [deferred] = [m for m in env.queue.pending() if not isinstance(m.task, TaskRef)]
    lease = _charge(env, run_id).lease_expires_at
    env.queue.send(TaskRef(run_id=run_id, kind=TaskKind.FORWARD, step_id="charge", generation=1))
    env.clock.advance_to(lease + timedelta(seconds=1))
    flaky.down = False
    env.queue.change_visibility(deferred.message_id, 300)  # the deferred answer comes after the copy
    assert env.step_once()  # the copy
    assert _charge(env, run_id).status is AttemptStatus.AUTHORIZED  # not Unknown: it only watches
    _drive(env)
    charge = _charge(env, run_id)
    assert charge.status is AttemptStatus.SUCCEEDED and charge.unknown_at is None
    assert env.get(run_id).outcome == "completed"
    assert calls["charge"] == 1


def test_a_dispatcher_retrying_an_answers_write_keeps_its_message_from_another_dispatcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store refuses the write of the charge's success, and the dispatcher retries it for up to
    ``store_retry_s``. Before, its message came back when the lease ended, in the middle of the retries, and
    another dispatcher receiving it took the attempt as Unknown. Now the message stays away for the retries."""
    calls: Counter[str] = Counter()
    holder: dict[str, FlakyStore] = {}
    seen: list[list[Any]] = []

    def late_then_throttled() -> None:
        env.clock.advance_to(_charge(env, run_id).lease_expires_at - timedelta(seconds=1))  # a long callback
        holder["store"].down = True

    env, flaky = _flaky_env(charge_app(calls, late_then_throttled))
    env.engine.settings = replace(env.engine.settings, store_retry_s=20.0)  # the default
    # the dispatcher measures what its message is covered for on its monotonic clock: here the virtual one
    virtual = SimpleNamespace(
        monotonic=lambda: (env.clock.now - EPOCH).total_seconds(), time=time.time, sleep=time.sleep
    )
    monkeypatch.setattr(engine_module, "time", virtual)
    holder["store"] = flaky
    gate = flaky._gate

    def refuse_and_look() -> None:
        if flaky.down and flaky.refused == 1:  # the first retry: the retries have gone on past the lease
            env.clock.advance_to(_charge(env, run_id).lease_expires_at + timedelta(seconds=5))
            seen.append(env.queue.receive())  # what another dispatcher polling now would get
        gate()

    flaky._gate = refuse_and_look  # type: ignore[method-assign]
    run_id = env.start("order")
    until_deferred(env)
    assert seen == [[]]
    assert _charge(env, run_id).status is AttemptStatus.AUTHORIZED


def test_the_sweeper_waits_the_watch_grace_past_a_lease_and_then_takes_the_attempt_as_lost() -> None:
    """The sweeper cannot know of a deferred answer: it waits ``lease_watch_grace_s`` past the lease (before, its
    own 5 minutes). An answer that is truly lost (here the deferred message with it) still ends Unknown then."""
    env, flaky, run_id, _calls = _deferred_charge()
    lease = _charge(env, run_id).lease_expires_at
    for message in list(env.queue.pending()):
        env.queue.delete(message.message_id)  # the queue lost the deferred answer too
    flaky.down = False
    grace = timedelta(minutes=15)  # lease_watch_grace_s, by default
    env.clock.advance_to(lease + timedelta(seconds=301))
    while _charge(env, run_id).status is AttemptStatus.AUTHORIZED and env.clock.now < lease + 2 * grace:
        env.engine.sweep()  # every minute, as the sweep function runs
        if _charge(env, run_id).status is AttemptStatus.AUTHORIZED:
            env.clock.advance(timedelta(minutes=1))
    charge = _charge(env, run_id)
    assert charge.status is AttemptStatus.UNKNOWN and charge.unknown_at is not None
    assert "lease expired" in (charge.detail or "")
    # before, the first look (5 minutes past the lease) took it; now not before the grace, nor much after it
    assert lease + grace <= charge.unknown_at <= lease + grace + timedelta(minutes=6), charge.unknown_at - lease


def test_the_carrier_still_takes_a_silent_attempt_as_unknown_at_its_lease() -> None:
    """What the carrier changes nothing of: an attempt whose endpoint never answers is Unknown when its lease ends
    (its own message comes back then), not ``lease_watch_grace_s`` later."""
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(charge_app(calls), chain_steps=False)
    env.faults.crash_before_invoke("charge")  # the dispatcher dies once the attempt is authorized
    run_id = env.start("order")
    for _ in range(10):
        env.step_once()
    charge = _charge(env, run_id)
    assert charge.status is AttemptStatus.AUTHORIZED
    env.clock.advance_to(charge.lease_expires_at + timedelta(seconds=1))
    assert env.step_once()
    assert _charge(env, run_id).status is AttemptStatus.UNKNOWN

"""Review of 82bee4f: a run's lease timer watches an attempt authorized within a second of the last when the timer is
due no later than that attempt's own timer would be (its lease rounded up to SQS's whole second), so it may now come
back up to a second after the watched attempt's lease ended. What was tried, and held (each test pins it):

- the timer is never due later than the attempt's own timer would decide it, nor less than 2 s after the attempt
  was authorized (so it reads it), over fractional leases, leases past SQS's 900 s cap, and a wall clock stepped
  back or forward between the two sends;
- coming back inside that second, it takes the attempt as Unknown (never before its lease, and not left in
  flight); coming back before the lease, as an early delivery would, it waits for the lease exactly;
- a heartbeat that moved the watched attempt's lease is waited for, not taken at the old lease."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ryusen._internal.wire import CallbackSucceeded, Phase, StepPlan, StepsReached, TaskKind
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
    TaskDelivered,
)
from ryusen_server.core.model import RESULT_FUNCTION_EVENTS_CARRIER, AttemptStatus, RunState, TaskRef, delivery_id_for
from ryusen_server.engine import LEASE_TIMER_MAX_DELAY_S, LEASE_TIMER_SHARE_MARGIN_S, RunLeaseTimers

T0 = datetime(2030, 1, 1, tzinfo=UTC)
SETTINGS = EngineSettings()
RELEASE = ReleaseRef(release_id="r1", build_id="b1")
BY_RESULT_FUNCTION = f"{RESULT_FUNCTION_EVENTS_CARRIER}0123abcd"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _sent_as_the_engine_does(timers: RunLeaseTimers, now: datetime, redeliver_after_s: float) -> datetime:
    """What ``Engine._submit_result`` records for a timer it sends; the time SQS makes it visible (whole seconds)."""
    wait_s = min(max(1.0, redeliver_after_s), LEASE_TIMER_MAX_DELAY_S)
    watches_before = now + timedelta(seconds=wait_s - LEASE_TIMER_SHARE_MARGIN_S)
    due_at = now + timedelta(seconds=math.ceil(wait_s))
    timers.sent("run1", due_at, watches_before, wait_s)
    return due_at


def test_a_shared_timer_is_never_due_after_the_watched_attempts_own_timer_would_decide_it() -> None:
    """A grid of A's lease (fractional, and past 900 s), B's authorization after it, B's lease, and B's wall clock
    stepped back or forward against A's: whenever B is watched, the timer is visible no later than B's own timer
    would decide B (at ``now + ceil(lease)``: past 900 s, its first return and one visibility change), under a
    second after B's lease (as B's stored lease reads), and at least the margin after B's authorization."""
    checked = watched = 0
    for lease_a in (61.0, 61.05, 62.1, 68.45, 68.95, 899.5, 900.0, 1000.3):
        for after_s in (0.05, 0.3, 0.7, 0.95, 1.5, 30.0, 58.0, 59.5, 60.5, 840.0, 897.0, 899.2):
            for lease_b in (60.2, 61.05, 62.2, 68.5, 68.99, 899.9, 900.4, 1200.0):
                for step_s in (-5.0, -0.5, 0.0, 0.5, 1.5):  # B's wall clock against A's (the monotonic one is true)
                    mono = [1000.0]
                    timers = RunLeaseTimers(monotonic=lambda: mono[0])
                    visible_at = _sent_as_the_engine_does(timers, at(0), lease_a)
                    mono[0] += after_s
                    now_b = at(after_s + step_s)
                    lease_end_b = now_b + timedelta(seconds=lease_b)  # as stored, on B's wall clock
                    checked += 1
                    if not timers.watching("run1", now_b, lease_end_b):
                        continue
                    watched += 1
                    what = (lease_a, after_s, lease_b, step_s)
                    # A's wall clock is the true one: B's instants on it are now_b - step_s
                    own_decides_at = now_b - timedelta(seconds=step_s) + timedelta(seconds=math.ceil(lease_b))
                    assert visible_at <= own_decides_at or step_s > 0, what
                    assert visible_at - lease_end_b < timedelta(seconds=1), what
                    authorized_real = at(after_s)
                    assert visible_at - authorized_real >= timedelta(seconds=LEASE_TIMER_SHARE_MARGIN_S), what
    assert checked and watched > 50, (checked, watched)


def _a_then_b(b_at: float, *, timeout_s: float = 8.5, heartbeat_s: float | None = None) -> RunState:
    """Steps a and b (each with the timeout ``timeout_s``) declared together: a sent as an event by a result function
    at 0 s and settled at 0.1 s, b sent as one at ``b_at``."""
    start = StartRun(run_id="run1", app_id="a", function_id="f", input=1)
    state = decide(None, start, now=at(0), settings=SETTINGS).state
    discover = TaskRef(run_id="run1", kind=TaskKind.DISCOVER, seq=1)
    state = decide(state, TaskDelivered(task=discover, release=RELEASE), now=at(0), settings=SETTINGS).state
    plans = [StepPlan(id=s, timeout_s=timeout_s, heartbeat_s=heartbeat_s) for s in ("a", "b")]
    state = decide(
        state,
        DiscoveryReported(seq=1, response=StepsReached(steps=plans, max_parallel=2)),
        now=at(0),
        settings=SETTINGS,
    ).state
    for seconds, step_id in ((0.0, "a"), (b_at, "b")):
        task = TaskRef(run_id="run1", kind=TaskKind.FORWARD, step_id=step_id, generation=1)
        delivery = delivery_id_for(BY_RESULT_FUNCTION, f"unique{step_id}")
        state = decide(
            state, TaskDelivered(task=task, release=RELEASE, delivery_id=delivery), now=at(seconds), settings=SETTINGS
        ).state
    reported = AttemptReported(step_id="a", phase=Phase.FORWARD, generation=1, response=CallbackSucceeded(result=1))
    return decide(state, reported, now=at(max(0.1, b_at)), settings=SETTINGS).state


def _attempt(state: RunState, step_id: str):  # type: ignore[no-untyped-def]
    step = state.step(step_id)
    assert step is not None
    current = step.current(Phase.FORWARD)
    assert current is not None
    return current


def _timer_back(state: RunState, watches_before: datetime, seconds: float) -> Decision:
    task = TaskRef(
        run_id="run1", kind=TaskKind.FORWARD, step_id="a", generation=1, lease_timer=True, watches_before=watches_before
    )
    event = TaskDelivered(task=task, release=RELEASE, delivery_id=delivery_id_for("timer-message", "u"))
    return decide(state, event, now=at(seconds), settings=SETTINGS)


def test_a_timer_back_within_the_second_after_a_watched_attempts_lease_takes_it_as_unknown_never_before() -> None:
    """The commit's own case: a's timer is sent 0.05 s after a's authorization, for the 68.45 s left of its lease
    (timeout 8.5 s and the 60 s grace): SQS makes it visible at 69.05 s. b, authorized at 0.2 s, has a lease to
    68.7 s and is watched (its own timer would be due at 69.25 s). At 69.05 s b is Unknown: not left in flight, and
    not before its lease. Delivered early (at 68.2 s), the timer waits for b's lease exactly."""
    state = _a_then_b(0.2)
    lease_a, lease_b = _attempt(state, "a").lease_expires_at, _attempt(state, "b").lease_expires_at
    assert lease_a == at(68.5) and lease_b == at(68.7)
    mono = [1000.0]
    timers = RunLeaseTimers(monotonic=lambda: mono[0])
    visible_at = _sent_as_the_engine_does(timers, at(0.05), (lease_a - at(0.05)).total_seconds())
    mono[0] += 0.2
    assert timers.watching("run1", at(0.25), lease_b)  # b goes without a timer of its own
    assert lease_b < visible_at == at(69.05)
    watches_before = at(0.05 + 68.45 - LEASE_TIMER_SHARE_MARGIN_S)

    back = _timer_back(state, watches_before, 69.05)
    b = _attempt(back.state, "b")
    assert b.status is AttemptStatus.UNKNOWN and b.unknown_at is not None and b.unknown_at >= lease_b

    early = _timer_back(state, watches_before, 68.2)
    assert _attempt(early.state, "b").status is AttemptStatus.AUTHORIZED
    [redeliver] = [c for c in early.commands if isinstance(c, RedeliverLater)]
    assert at(68.2) + timedelta(seconds=redeliver.delay_s) == lease_b


def test_a_heartbeat_that_moved_the_watched_attempts_lease_past_the_timer_is_waited_for() -> None:
    """b heartbeats (every 5.5 s, timeout 100 s) at 60 s: its lease moves from 65.7 s to 125.5 s. a's timer, visible
    at 66.05 s, after b's first lease, finds b in flight with the later lease and waits for it."""
    state = _a_then_b(0.2, timeout_s=100.0, heartbeat_s=5.5)
    first = _attempt(state, "b").lease_expires_at
    assert first == at(65.7)
    mono = [1000.0]
    timers = RunLeaseTimers(monotonic=lambda: mono[0])
    lease_a = _attempt(state, "a").lease_expires_at
    assert lease_a is not None
    visible_at = _sent_as_the_engine_does(timers, at(0.05), (lease_a - at(0.05)).total_seconds())
    mono[0] += 0.2
    assert timers.watching("run1", at(0.25), first) and first < visible_at == at(66.05)
    beat = HeartbeatReported(step_id="b", phase=Phase.FORWARD, generation=1, details=None, seq=1)
    state = decide(state, beat, now=at(60), settings=SETTINGS).state
    moved = _attempt(state, "b").lease_expires_at
    assert moved == at(125.5)
    back = _timer_back(state, at(0.05 + 65.45 - LEASE_TIMER_SHARE_MARGIN_S), 66.05)
    assert _attempt(back.state, "b").status is AttemptStatus.AUTHORIZED
    [redeliver] = [c for c in back.commands if isinstance(c, RedeliverLater)]
    assert at(66.05) + timedelta(seconds=redeliver.delay_s) == moved


# ---- through the engine: a wall clock stepped back while the result function carries the run on --------------


@pytest.mark.parametrize("step_s", [0.0, 0.3], ids=["clock_steady", "clock_stepped_forward_then_back"])
def test_an_event_authorized_past_watches_before_on_a_clock_then_stepped_back_is_left_with_no_lease_timer(
    monkeypatch: pytest.MonkeyPatch, step_s: float
) -> None:
    """Not from 82bee4f (its rule is the same before it), found attacking it with a stepped wall clock.

    The result function decides whether the run's timer watches the event it just left in flight by its clock
    *after* invoking it (``now``), but the timer watches what was authorized by ``watches_before`` by the
    attempt's ``authorized_at``, written *before*. The monotonic guard only asks whether the timer is still on
    the queue. So: "a"'s timer is sent at 0 s; 0.1 s (true time) before its ``watches_before`` the wall clock
    reads ``step_s`` ahead when "a"'s outcome authorizes "b", and is stepped back before the result function
    reads it again. With 0.3 s, "b" is authorized after ``watches_before`` yet judged before it: no timer is
    sent for "b", "a"'s timer comes back, finds "a" settled and "b" outside what it watches, and is done. "b"'s
    event is lost: "b" stays in flight past its lease, with nothing but the sweeper (15 minutes and more after
    the lease) to take it as Unknown. With a steady clock "b" is Unknown once its lease has ended."""
    from ryusen_server.engine import RunLeaseTimers
    from tests.conformance.test_review_events import APP, Harness
    from tests.functional.test_lambda_events import SharedSeen

    def make(key: str) -> Any:
        from ryusen import Ryusen, Step

        app = Ryusen(APP, signing_key=key, seen_requests=SharedSeen())

        @app.function("buy")
        def buy(data: Any, step: Step) -> Any:
            return [step.run(s, str, s, timeout=timedelta(seconds=8.5)) for s in ("p", "a", "b")]

        return app

    h = Harness(make, monkeypatch)
    try:
        engine, clock = h.env.engine, h.env.clock
        offset = [timedelta(0)]
        monkeypatch.setattr(engine, "clock", lambda: clock() + offset[0])  # the wall clock, as stepped
        true_start = clock()
        engine.run_lease_timers = RunLeaseTimers(monotonic=lambda: (clock() - true_start).total_seconds())
        timers: list[str | None] = []
        sent = engine.run_lease_timers.sent

        def counted(run_id: str, *args: Any) -> None:
            timers.append(run_id)
            sent(run_id, *args)

        monkeypatch.setattr(engine.run_lease_timers, "sent", counted)
        engine.hooks.append(  # stepped back once an attempt is invoked, before the result function reads it again
            lambda kind, payload: offset.__setitem__(0, timedelta(0)) if kind == "invoked" else None
        )
        run_id = h.env.start("buy", {})
        while h.env.step_once():
            pass
        assert h.lam.pump(once=True) == 1  # p runs; its post to the result function authorizes "a", sent as an event
        [(_due_at, watches_before, _)] = engine.run_lease_timers._sent.values()
        clock.advance_to(watches_before - timedelta(seconds=0.1))
        offset[0] = timedelta(seconds=step_s)  # the wall clock stepped forward
        assert h.lam.pump(once=True) == 1  # a runs; its post authorizes "b", sent as an event
        [b] = h.env.get(run_id).attempts("b")
        assert (datetime.fromisoformat(b["authorized_at"]) > watches_before) is (step_s > 0.1)
        assert len(timers) == 1, "b got a timer of its own"  # a's timer watches b, the result function judged
        assert [e["request"]["step_id"] for e in h.lam.sent] == ["p", "a", "b"]
        h.lam.queued.clear()  # b's event is lost: nothing runs, nothing is posted
        lease = datetime.fromisoformat(b["lease_expires_at"])
        clock.advance_to(lease + timedelta(seconds=60))  # a minute past b's lease: every timer due comes back
        for _ in range(5):
            while h.env.step_once():
                pass
            clock.advance(timedelta(seconds=2))
        [b] = h.env.get(run_id).attempts("b")
        assert b["status"] != "authorized", "b is in flight a minute past its lease and no lease timer watches it"
        assert datetime.fromisoformat(b["unknown"]["at"]) >= lease
    finally:
        h.close()

"""One lease timer for a run's steps, in the pure core: what a result function's lease timer watches
(``TaskRef.watches_before``), and when it takes an attempt as Unknown."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from ryusen._internal.wire import CallbackSucceeded, Phase, StepPlan, StepsReached, TaskKind
from ryusen_server.core.decide import decide
from ryusen_server.core.events import (
    AttemptReported,
    Decision,
    DiscoveryReported,
    EngineSettings,
    EnqueueTask,
    RedeliverLater,
    ReleaseRef,
    StartRun,
    TaskDelivered,
)
from ryusen_server.core.model import (
    RESULT_FUNCTION_CARRIER,
    RESULT_FUNCTION_EVENTS_CARRIER,
    AttemptStatus,
    RunState,
    TaskRef,
    carrier_tag,
    delivery_id_for,
    sent_as_an_event_by_a_result_function,
)

T0 = datetime(2030, 1, 1, tzinfo=UTC)
SETTINGS = EngineSettings()
RELEASE = ReleaseRef(release_id="r1", build_id="b1")
BY_RESULT_FUNCTION = f"{RESULT_FUNCTION_EVENTS_CARRIER}0123abcd"
BY_RESULT_FUNCTION_OVER_HTTP = f"{RESULT_FUNCTION_CARRIER}0123abcd"
BY_MESSAGE = "a1b2c3d4-sqs-message-id"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def run(state: RunState | None, event: object, seconds: float = 0.0) -> Decision:
    return decide(state, event, now=at(seconds), settings=SETTINGS)  # type: ignore[arg-type]


def two_in_flight(carrier_a: str, carrier_b: str) -> RunState:
    """Steps a and b declared together, authorized at 0 s and 1 s by deliveries their carriers made."""
    state = run(None, StartRun(run_id="run1", app_id="a", function_id="f", input=1)).state
    discover = TaskRef(run_id="run1", kind=TaskKind.DISCOVER, seq=1)
    state = run(state, TaskDelivered(task=discover, release=RELEASE)).state
    together = StepsReached(steps=[StepPlan(id="a"), StepPlan(id="b")], max_parallel=2)
    state = run(state, DiscoveryReported(seq=1, response=together)).state
    for seconds, (step_id, carrier) in enumerate((("a", carrier_a), ("b", carrier_b))):
        task = TaskRef(run_id="run1", kind=TaskKind.FORWARD, step_id=step_id, generation=1)
        delivery = delivery_id_for(carrier, f"unique{step_id}")
        state = run(state, TaskDelivered(task=task, release=RELEASE, delivery_id=delivery), seconds).state
    return state


def timer(step_id: str, watches_before: datetime | None) -> TaskDelivered:
    task = TaskRef(
        run_id="run1", kind=TaskKind.FORWARD, step_id=step_id, generation=1, lease_timer=True,
        watches_before=watches_before,
    )  # fmt: skip
    return TaskDelivered(task=task, release=RELEASE, delivery_id=delivery_id_for("timer-message", "u"))


def status(state: RunState, step_id: str) -> AttemptStatus:
    step = state.step(step_id)
    assert step is not None
    current = step.current(Phase.FORWARD)
    assert current is not None
    return current.status


def lease(state: RunState, step_id: str) -> datetime:
    step = state.step(step_id)
    assert step is not None
    current = step.current(Phase.FORWARD)
    assert current is not None and current.lease_expires_at is not None
    return current.lease_expires_at


def test_what_a_result_function_sent_as_an_event_is_told_apart_from_a_message_and_from_an_http_endpoint() -> None:
    assert sent_as_an_event_by_a_result_function(delivery_id_for(BY_RESULT_FUNCTION, "u"))
    assert not sent_as_an_event_by_a_result_function(delivery_id_for(BY_RESULT_FUNCTION_OVER_HTTP, "u"))
    assert not sent_as_an_event_by_a_result_function(delivery_id_for(BY_MESSAGE, "u"))
    assert not sent_as_an_event_by_a_result_function("u")  # no carrier at all
    tags = {carrier_tag(f"message-{i}") for i in range(2000)}
    assert not any(t[0] in "rs" for t in tags) and all(len(t) == 12 for t in tags)
    assert len(carrier_tag(BY_RESULT_FUNCTION)) == 12 and carrier_tag(BY_RESULT_FUNCTION_OVER_HTTP)[0] == "s"


def test_a_timer_whose_attempt_settled_watches_what_a_result_function_authorized_before_it_was_due() -> None:
    state = two_in_flight(BY_RESULT_FUNCTION, BY_RESULT_FUNCTION)
    state = run(state, AttemptReported(step_id="a", phase=Phase.FORWARD, generation=1,
                                       response=CallbackSucceeded(result=1)), 2).state  # fmt: skip
    b_lease = lease(state, "b")
    # a's timer comes back at a's lease: a is settled, b (authorized before watches_before) is still in flight
    back = (lease(state, "a") - T0).total_seconds()
    decision = run(state, timer("a", watches_before=at(1)), back)
    assert decision.state.version == state.version  # nothing written
    [redeliver] = [c for c in decision.commands if isinstance(c, RedeliverLater)]
    assert at(back) + timedelta(seconds=redeliver.delay_s) == b_lease
    # at b's lease: b is Unknown, exactly then (not lease_watch_grace_s later)
    decision = run(state, timer("a", watches_before=at(1)), (b_lease - T0).total_seconds())
    assert status(decision.state, "b") is AttemptStatus.UNKNOWN


def test_without_watches_before_a_timer_watches_its_attempt_only() -> None:
    state = two_in_flight(BY_RESULT_FUNCTION, BY_RESULT_FUNCTION)
    state = run(state, AttemptReported(step_id="a", phase=Phase.FORWARD, generation=1,
                                       response=CallbackSucceeded(result=1)), 2).state  # fmt: skip
    decision = run(state, timer("a", watches_before=None), (lease(state, "b") - T0).total_seconds() + 1)
    assert status(decision.state, "b") is AttemptStatus.AUTHORIZED
    assert not decision.commands  # done: deleted


def test_an_attempt_authorized_after_watches_before_carried_by_a_message_or_sent_over_http_is_not_watched() -> None:
    cases = ((BY_RESULT_FUNCTION, at(0.5)), (BY_MESSAGE, at(1)), (BY_RESULT_FUNCTION_OVER_HTTP, at(1)))
    for carrier_b, watches_before in cases:
        state = two_in_flight(BY_RESULT_FUNCTION, carrier_b)
        state = run(state, AttemptReported(step_id="a", phase=Phase.FORWARD, generation=1,
                                           response=CallbackSucceeded(result=1)), 2).state  # fmt: skip
        decision = run(state, timer("a", watches_before=watches_before), (lease(state, "b") - T0).total_seconds())
        assert status(decision.state, "b") is AttemptStatus.AUTHORIZED, carrier_b
        assert not decision.commands, carrier_b


def test_two_watched_attempts_past_their_leases_one_is_taken_and_the_other_gets_a_timer_of_its_own() -> None:
    state = two_in_flight(BY_RESULT_FUNCTION, BY_RESULT_FUNCTION)
    past = (lease(state, "b") - T0).total_seconds() + 5
    decision = run(state, timer("a", watches_before=at(1)), past)
    assert status(decision.state, "a") is AttemptStatus.UNKNOWN  # the sooner lease
    assert status(decision.state, "b") is AttemptStatus.AUTHORIZED
    timers = [c for c in decision.commands if isinstance(c, EnqueueTask) and c.task.lease_timer]
    assert [(c.task.step_id, c.task.watches_before, c.delay_s) for c in timers] == [("b", None, 0.0)]
    own = [c.task for c in timers]
    # that timer takes b at once
    again = run(decision.state, TaskDelivered(task=own[0], release=RELEASE, delivery_id="v"), past)
    assert status(again.state, "b") is AttemptStatus.UNKNOWN


def test_a_result_function_counts_on_its_timer_only_while_it_is_surely_on_the_queue_whatever_the_wall_clock() -> None:
    """``RunLeaseTimers``: a 60 s timer watches what is authorized up to 2 s before it is due, and whose lease ends
    after; a wall clock stepped back 10 s does not stretch that (the monotonic clock is asked too)."""
    from ryusen_server.engine import RunLeaseTimers

    mono = [1000.0]
    timers = RunLeaseTimers(monotonic=lambda: mono[0])
    timers.sent("run1", due_at=at(60), watches_before=at(58), wait_s=60.0)
    assert timers.watching("run1", at(30), lease_ends_at=at(90))
    assert not timers.watching("run1", at(30), lease_ends_at=at(59))  # its lease ends before the timer is due
    assert not timers.watching("run1", at(59), lease_ends_at=at(120))  # the timer may be back already
    assert not timers.watching("other", at(30), lease_ends_at=at(90))
    mono[0] += 59.0  # 59 s went by, and the wall clock was stepped back 10 s: it reads 49 s
    assert not timers.watching("run1", at(49), lease_ends_at=at(120))


def test_a_timer_due_when_the_attempts_own_timer_would_be_watches_it_though_sqs_rounded_its_delay_up() -> None:
    """SQS delays by whole seconds, so a timer sent for a lease of 62.1 s is due 63 s after its send. An attempt
    authorized 0.1 s later, whose lease ends 62.2 s from the first send, would get a timer of its own due 63.1 s
    from then (62.1 rounded up): the run's timer, due 0.1 s sooner, watches it. Before, it was refused (due 0.8 s
    after the lease), and a run of 0.1 s steps sent as events sent a timer per step (bench/cost.py: 1.05 dispatch
    invocations and 3.1 SQS requests a step, $3.71 per million steps against $2.20 at 1 s)."""
    from ryusen_server.engine import RunLeaseTimers

    mono = [1000.0]
    timers = RunLeaseTimers(monotonic=lambda: mono[0])
    timers.sent("run1", due_at=at(63), watches_before=at(60.1), wait_s=62.1)
    mono[0] += 0.1
    assert timers.watching("run1", at(0.1), lease_ends_at=at(62.2))
    # never later than its own timer would come back: a lease that ends 0.95 s sooner is not watched
    assert not timers.watching("run1", at(0.1), lease_ends_at=at(61.05))

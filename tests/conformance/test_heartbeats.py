"""Long steps and heartbeats (decision 33, issue 25), on the virtual clock: the pure core, and the testing kit
through the real engine and SDK. Over HTTP on ``ryusen dev``: ``test_over_http.py``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

import ryusen
from ryusen import Ryusen, Step
from ryusen._internal.wire import CallbackSucceeded, Phase, StepPlan, StepReached, TaskKind
from ryusen.testing import WorkflowEnvironment
from ryusen_server.core.decide import decide
from ryusen_server.core.events import (
    AttemptReported,
    DiscoveryReported,
    EngineSettings,
    HeartbeatReported,
    RedeliverLater,
    ReleaseRef,
    StartRun,
    TaskDelivered,
)
from ryusen_server.core.model import AttemptStatus, RunState, TaskRef

NOW = datetime(2030, 1, 1, tzinfo=UTC)
SETTINGS = EngineSettings()
ACKNOWLEDGING = ReleaseRef(release_id="r1", build_id="b1", acknowledges=True)
ENCODE = TaskRef(run_id="run1", kind=TaskKind.FORWARD, step_id="encode", generation=1)


def in_flight(*, heartbeat_s: float | None = 60.0, timeout_s: float = 6 * 3600) -> RunState:
    """A run whose step ``encode`` (timeout 6 h, heartbeat 1 min) was authorized at NOW."""
    state = decide(
        None, StartRun(run_id="run1", app_id="a", function_id="f", input=1), now=NOW, settings=SETTINGS
    ).state
    discover = TaskRef(run_id="run1", kind=TaskKind.DISCOVER, seq=1)
    state = decide(state, TaskDelivered(task=discover, release=ACKNOWLEDGING), now=NOW, settings=SETTINGS).state
    plan = StepReached(step=StepPlan(id="encode", timeout_s=timeout_s, heartbeat_s=heartbeat_s))
    state = decide(state, DiscoveryReported(seq=1, response=plan), now=NOW, settings=SETTINGS).state
    return decide(state, TaskDelivered(task=ENCODE, release=ACKNOWLEDGING), now=NOW, settings=SETTINGS).state


def attempt_of(state: RunState) -> Any:
    step = state.step("encode")
    assert step is not None
    attempt = step.current(Phase.FORWARD)
    assert attempt is not None
    return attempt


def beat(state: RunState, at: datetime, details: Any = None, generation: int = 1) -> RunState:
    event = HeartbeatReported(step_id="encode", phase=Phase.FORWARD, generation=generation, details=details)
    return decide(state, event, now=at, settings=SETTINGS).state


def test_a_step_with_a_heartbeat_gets_a_lease_of_one_interval_not_its_whole_timeout() -> None:
    attempt = attempt_of(in_flight())
    assert attempt.status is AttemptStatus.AUTHORIZED
    assert attempt.respond_by == NOW + timedelta(hours=6)
    assert attempt.lease_expires_at == NOW + timedelta(seconds=60 + SETTINGS.acknowledged_lease_grace_s)
    # without a heartbeat, the lease is the whole timeout plus the grace, as before
    assert attempt_of(in_flight(heartbeat_s=None)).lease_expires_at == NOW + timedelta(hours=6, seconds=3)


@pytest.mark.rfd("H1")
def test_heartbeats_keep_a_six_hour_step_in_flight_to_its_end_on_the_virtual_clock() -> None:
    state = in_flight()
    now = NOW
    for minute in range(1, 360):
        now = NOW + timedelta(minutes=minute)
        state = beat(state, now, {"progress": minute / 360})
        # the lease timer comes back: the attempt is still in flight, and the timer is set for the new lease
        decision = decide(state, TaskDelivered(task=ENCODE, release=ACKNOWLEDGING), now=now, settings=SETTINGS)
        assert attempt_of(decision.state).status is AttemptStatus.AUTHORIZED
        assert [c for c in decision.commands if isinstance(c, RedeliverLater)]
    attempt = attempt_of(state)
    assert attempt.heartbeat_at == now and attempt.heartbeat_details == {"progress": 359 / 360}
    assert attempt.lease_expires_at == now + timedelta(seconds=63)
    done = AttemptReported(
        step_id="encode", phase=Phase.FORWARD, generation=1, response=CallbackSucceeded(result="encoded")
    )
    state = decide(state, done, now=now + timedelta(seconds=30), settings=SETTINGS).state
    assert attempt_of(state).status is AttemptStatus.SUCCEEDED and attempt_of(state).unknown_at is None


@pytest.mark.rfd("H2")
def test_a_step_whose_heartbeats_stop_is_unknown_one_interval_and_the_grace_after_the_last() -> None:
    state = beat(in_flight(), NOW + timedelta(minutes=10))
    last = NOW + timedelta(minutes=10)
    early = decide(
        state, TaskDelivered(task=ENCODE, release=ACKNOWLEDGING), now=last + timedelta(seconds=62), settings=SETTINGS
    )
    assert attempt_of(early.state).status is AttemptStatus.AUTHORIZED
    late = decide(
        state, TaskDelivered(task=ENCODE, release=ACKNOWLEDGING), now=last + timedelta(seconds=63), settings=SETTINGS
    )
    attempt = attempt_of(late.state)
    assert attempt.status is AttemptStatus.UNKNOWN  # 5 h 49 min before its timeout
    assert attempt.unknown_reason == attempt.detail
    assert (
        attempt.detail
        == "no heartbeat within the step's heartbeat of 60s (+3s grace) since the last one: its lease expired"
    )


def test_a_heartbeat_never_extends_a_lease_past_the_timeout_nor_revives_what_is_not_in_flight() -> None:
    state = in_flight(timeout_s=90)
    state = beat(state, NOW + timedelta(seconds=80))
    assert attempt_of(state).lease_expires_at == NOW + timedelta(seconds=93)  # the timeout's end, plus the grace
    lost = decide(
        state, TaskDelivered(task=ENCODE, release=ACKNOWLEDGING), now=NOW + timedelta(seconds=93), settings=SETTINGS
    ).state
    assert attempt_of(lost).status is AttemptStatus.UNKNOWN
    after = decide(
        lost,
        HeartbeatReported(step_id="encode", phase=Phase.FORWARD, generation=1),
        now=NOW + timedelta(seconds=95),
        settings=SETTINGS,
    )
    assert not after.changed and attempt_of(after.state).status is AttemptStatus.UNKNOWN
    other = decide(
        state, HeartbeatReported(step_id="encode", phase=Phase.FORWARD, generation=2), now=NOW, settings=SETTINGS
    )
    assert not other.changed
    nothing = decide(
        state, HeartbeatReported(step_id="nope", phase=Phase.FORWARD, generation=1), now=NOW, settings=SETTINGS
    )
    assert not nothing.changed


# ---- through the testing kit: the real engine and SDK, on the virtual clock ----------------------------------


@pytest.mark.rfd("H1")
def test_a_six_hour_step_heartbeats_through_the_engine_and_completes_on_the_virtual_clock() -> None:
    app = Ryusen("encoder")
    leases: list[tuple[datetime, datetime]] = []
    env: WorkflowEnvironment

    @app.function("encode")
    def encode(data: Any, step: Step) -> Any:
        def work() -> str:
            for minute in range(360):
                env.clock.advance(timedelta(minutes=1))
                ryusen.heartbeat({"progress": (minute + 1) / 360})
                state = env.store.get(run_id)
                assert state is not None and state.step("encode") is not None
                leases.append((env.clock.now, attempt_of(state).lease_expires_at))
            return "encoded"

        return step.run("encode", work, timeout=timedelta(hours=7), heartbeat=timedelta(minutes=2))

    env = WorkflowEnvironment(app)
    run_id = env.start("encode")
    run = env.wait(run_id)
    assert run.outcome == "completed" and run.output == "encoded"
    [attempt] = run.attempts("encode")
    assert attempt["status"] == "succeeded" and attempt["unknown"] is None
    assert attempt["heartbeat"]["details"] == {"progress": 1.0}
    # every heartbeat (one a minute, each past the last one's 30 s spacing) moved the lease past the clock
    assert len(leases) == 360 and all(lease > now + timedelta(minutes=2) for now, lease in leases)


def test_a_heartbeat_outside_a_callback_does_nothing_and_oversized_details_are_refused() -> None:
    ryusen.heartbeat({"progress": 0.5})  # a unit test calling the callback directly: no attempt, nothing sent
    app = Ryusen("noisy")
    errors: list[str] = []

    @app.function("noisy")
    def noisy(data: Any, step: Step) -> Any:
        def work() -> str:
            try:
                ryusen.heartbeat({"log": "x" * 5000})
            except ValueError as exc:
                errors.append(str(exc))
            return "done"

        return step.run("work", work, heartbeat=timedelta(minutes=1))

    run = WorkflowEnvironment(app).run("noisy")
    assert run.outcome == "completed"
    assert errors and "the limit is 4096" in errors[0]


def test_the_sdk_posts_at_most_one_heartbeat_per_quarter_interval_and_a_stop_sticks() -> None:
    from ryusen._internal.heartbeat import HeartbeatSink
    from ryusen._internal.wire import Heartbeat, HeartbeatReply

    posted: list[Heartbeat] = []
    reply = HeartbeatReply(current=True)

    def post(beat: Heartbeat) -> HeartbeatReply:
        posted.append(beat)
        return reply

    sink = HeartbeatSink(post=post, run_id="r", step_id="s", phase=Phase.FORWARD, generation=1)
    sink.declared(3600.0)
    for i in range(100):
        sink.beat({"i": i})
    assert [b.details for b in posted] == [{"i": 0}]  # the next may go 15 minutes later
    stopping = HeartbeatSink(post=post, run_id="r", step_id="s", phase=Phase.FORWARD, generation=1, throttled=False)
    reply = HeartbeatReply(current=True, stop_requested="timeout")
    for _ in range(2):  # raised by this heartbeat and every later one, without asking the server again
        with pytest.raises(ryusen.StopRequested) as raised:
            stopping.beat(None)
        assert raised.value.kind == "timeout" and raised.value.code == "stop_requested"
    assert len(posted) == 2


def test_a_heartbeat_not_signed_by_the_runs_app_is_refused_and_changes_nothing() -> None:
    from ryusen._internal.signing import SIGNATURE_HEADER, sign
    from ryusen._internal.wire import Heartbeat, heartbeat_scope
    from ryusen_server.engine import SignatureRejectedError

    app = Ryusen("victim")
    held: list[str] = []

    @app.function("long")
    def long(data: Any, step: Step) -> Any:
        def work() -> str:
            held.append(run_id)
            beat = Heartbeat(run_id=run_id, step_id="work", phase=Phase.FORWARD, generation=1, seq=1, details="forged")
            body = beat.model_dump_json().encode()
            before = env.store.get(run_id)
            scope = heartbeat_scope(beat, path="/v1/results", app_id="victim")
            for headers in (
                {},  # unsigned
                {SIGNATURE_HEADER: "t=1,v1=00"},  # malformed
                {SIGNATURE_HEADER: sign("k" * 64, scope, body, now=__import__("time").time(), nonce="ab" * 16)},
            ):
                with pytest.raises(SignatureRejectedError):
                    env.engine.submit_heartbeat(body, headers)
            assert env.store.get(run_id) == before  # nothing written
            return "done"

        return step.run("work", work, heartbeat=timedelta(minutes=1))

    env = WorkflowEnvironment(app)
    run_id = env.start("long")
    run = env.wait(run_id)
    assert held and run.outcome == "completed" and run.attempts("work")[0]["heartbeat"] is None


def test_a_steps_heartbeat_binds_its_forward_callback_not_its_compensator() -> None:
    """``heartbeat=`` is declared for the callback: the compensator, which need not heartbeat, is bounded by its
    ``compensate_timeout`` only (the simulator found compensators Unknown one interval after they started)."""
    app = Ryusen("refunds")
    leases: list[tuple[datetime, datetime]] = []
    env: WorkflowEnvironment

    def refund(charge: Any) -> str:
        state = env.store.get(run_id)
        assert state is not None and state.step("charge") is not None
        attempt = state.step("charge").current(Phase.COMPENSATION)  # type: ignore[union-attr]
        leases.append((env.clock.now, attempt.lease_expires_at))
        return "refunded"

    @app.function("pay")
    def pay(data: Any, step: Step) -> Any:
        step.run(
            "charge",
            lambda: {"charge": 1},
            compensate=refund,
            heartbeat=timedelta(seconds=10),
            compensate_timeout=timedelta(minutes=5),
        )
        raise RuntimeError("the order was refused")

    env = WorkflowEnvironment(app)
    run_id = env.start("pay")
    run = env.wait(run_id)
    assert run.summary == "failed, fully compensated"
    [(now, lease)] = leases
    assert lease >= now + timedelta(minutes=5)  # not the 10 s heartbeat's

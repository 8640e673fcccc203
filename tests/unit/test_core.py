"""The pure core: decide(state, event, now) on hand-made events; no store, no SDK."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from ryusen._internal.wire import (
    CallbackFailed,
    CallbackSucceeded,
    ErrorInfo,
    FunctionCompleted,
    Phase,
    RetryPolicyWire,
    StepPlan,
    StepReached,
    TaskKind,
)
from ryusen_server.core.decide import IllegalEventError, backoff_delay, decide, operation_id
from ryusen_server.core.events import (
    AttemptReported,
    DiscoveryReported,
    EngineSettings,
    EnqueueTask,
    InvocationFailed,
    InvocationFailure,
    InvokeTask,
    RedeliverLater,
    ReleaseRef,
    StartRun,
    StopRequested,
    TaskDelivered,
)
from ryusen_server.core.model import RunState, TaskRef

NOW = datetime(2030, 1, 1, tzinfo=UTC)
SETTINGS = EngineSettings()
RELEASE = ReleaseRef(release_id="r1", build_id="b1")


def started() -> RunState:
    return decide(None, StartRun(run_id="run1", app_id="a", function_id="f", input=1), now=NOW, settings=SETTINGS).state


def discover(state: RunState, step_id: str = "s", now: datetime = NOW) -> RunState:
    seq = state.discovery.seq if state.discovery else 0
    task = TaskRef(run_id=state.id, kind=TaskKind.DISCOVER, seq=seq)
    state = decide(state, TaskDelivered(task=task, release=RELEASE), now=now, settings=SETTINGS).state
    plan = StepReached(step=StepPlan(id=step_id))
    return decide(state, DiscoveryReported(seq=seq, response=plan), now=now, settings=SETTINGS).state


def forward_task(step_id: str, generation: int) -> TaskRef:
    return TaskRef(run_id="run1", kind=TaskKind.FORWARD, step_id=step_id, generation=generation)


def test_start_queues_discovery_one() -> None:
    decision = decide(None, StartRun(run_id="run1", app_id="a", function_id="f", input=1), now=NOW, settings=SETTINGS)
    assert decision.changed and decision.state.version == 1
    assert decision.commands == (EnqueueTask(task=TaskRef(run_id="run1", kind=TaskKind.DISCOVER, seq=1)),)


def test_decide_never_mutates_its_input() -> None:
    state = started()
    frozen = state.model_dump_json()
    discover(state)
    assert state.model_dump_json() == frozen


def test_authorization_then_duplicate_delivery_waits_for_the_lease() -> None:
    state = discover(started())
    task = forward_task("s", 1)
    authorized = decide(state, TaskDelivered(task=task, release=RELEASE), now=NOW, settings=SETTINGS)
    assert authorized.commands == (InvokeTask(task=task),)
    again = decide(
        authorized.state, TaskDelivered(task=task, release=RELEASE), now=NOW + timedelta(seconds=10), settings=SETTINGS
    )
    assert not again.changed
    [command] = again.commands
    assert isinstance(command, RedeliverLater)
    assert command.delay_s == pytest.approx(SETTINGS.attempt_timeout_s + SETTINGS.lease_grace_s - 10)


def test_lease_expiry_on_redelivery_makes_the_attempt_unknown() -> None:
    state = discover(started())
    task = forward_task("s", 1)
    state = decide(state, TaskDelivered(task=task, release=RELEASE), now=NOW, settings=SETTINGS).state
    late = NOW + timedelta(seconds=SETTINGS.attempt_timeout_s + SETTINGS.lease_grace_s + 1)
    state = decide(state, TaskDelivered(task=task, release=RELEASE), now=late, settings=SETTINGS).state
    step = state.step("s")
    assert step is not None and step.status.value == "unknown"
    assert state.blockers[0].type.value == "unknown_outcome"
    assert state.discovery is None  # nothing moves past an Unknown


def test_unreachable_redelivers_the_same_generation() -> None:
    state = discover(started())
    task = forward_task("s", 1)
    state = decide(state, TaskDelivered(task=task, release=RELEASE), now=NOW, settings=SETTINGS).state
    decision = decide(
        state,
        InvocationFailed(task=task, failure=InvocationFailure.UNREACHABLE, detail="refused"),
        now=NOW,
        settings=SETTINGS,
    )
    attempt = decision.state.step("s").current(Phase.FORWARD)  # type: ignore[union-attr]
    assert attempt is not None and attempt.generation == 1 and attempt.status.value == "queued"
    assert decision.commands == (EnqueueTask(task=task, delay_s=1.0),)


def test_result_for_a_settled_generation_is_a_stale_submission() -> None:
    state = discover(started())
    task = forward_task("s", 1)
    state = decide(state, TaskDelivered(task=task, release=RELEASE), now=NOW, settings=SETTINGS).state
    ok = AttemptReported(step_id="s", phase=Phase.FORWARD, generation=1, response=CallbackSucceeded(result=1))
    state = decide(state, ok, now=NOW, settings=SETTINGS).state
    other = AttemptReported(step_id="s", phase=Phase.FORWARD, generation=1, response=CallbackSucceeded(result=2))
    decision = decide(state, other, now=NOW, settings=SETTINGS)
    step = decision.state.step("s")
    assert step is not None and step.result == 1
    assert step.attempts[0].stale_submissions[0].reason.startswith("the generation is already")


def test_failed_attempt_with_retries_left_queues_next_generation_with_backoff() -> None:
    state = discover(started())
    task = forward_task("s", 1)
    state = decide(state, TaskDelivered(task=task, release=RELEASE), now=NOW, settings=SETTINGS).state
    failed = AttemptReported(
        step_id="s", phase=Phase.FORWARD, generation=1, response=CallbackFailed(error=ErrorInfo(type="E", message="m"))
    )
    decision = decide(state, failed, now=NOW, settings=SETTINGS)
    [command] = decision.commands
    assert isinstance(command, EnqueueTask) and command.task.generation == 2
    assert 0.5 <= command.delay_s <= 1.0
    assert decision.state.discovery is None  # the function does not see it


def test_discovery_report_for_an_old_pass_is_ignored() -> None:
    state = started()
    decision = decide(state, DiscoveryReported(seq=7, response=FunctionCompleted(output=1)), now=NOW, settings=SETTINGS)
    assert not decision.changed and decision.note


def test_stop_before_authorization_finishes_not_required() -> None:
    decision = decide(started(), StopRequested(kind="cancel"), now=NOW, settings=SETTINGS)
    state = decision.state
    assert (state.phase.value, state.outcome.value, state.recovery.value) == ("finished", "cancelled", "not_required")  # type: ignore[union-attr]
    assert state.discovery is None and not decision.commands


def test_events_other_than_start_need_a_run() -> None:
    with pytest.raises(IllegalEventError):
        decide(None, StopRequested(kind="cancel"), now=NOW, settings=SETTINGS)


def test_operation_ids_are_stable_and_distinct_per_phase() -> None:
    assert operation_id("r", "s", Phase.FORWARD) == operation_id("r", "s", Phase.FORWARD)
    assert operation_id("r", "s", Phase.FORWARD) != operation_id("r", "s", Phase.COMPENSATION)
    assert operation_id("r", "s", Phase.FORWARD) != operation_id("r2", "s", Phase.FORWARD)


def test_backoff_grows_caps_and_jitters_deterministically() -> None:
    policy = RetryPolicyWire(max_attempts=10, initial_delay_s=1, backoff=2, max_delay_s=300)
    delays = [backoff_delay(policy, n, seed=f"op:{n}") for n in range(1, 12)]
    for n, delay in enumerate(delays, start=1):
        base = min(300, 2 ** (n - 1))
        assert base / 2 <= delay <= base
    assert backoff_delay(policy, 3, seed="x") == backoff_delay(policy, 3, seed="x")
    assert len({round(backoff_delay(policy, 5, seed=f"op{i}"), 6) for i in range(20)}) > 10

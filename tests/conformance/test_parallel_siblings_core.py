"""Steps declared together (decision 30) in the pure core, as the whole-server simulator and a review found them
wanting (issue 27): a wake's repair pass beside a sibling in flight keeps that sibling in its group; a group's
siblings start in the order the pass declared them, even where a known step re-reported comes before a new one in
the run's steps; an operator's retry of a held sibling does not run beside a discovery."""

from __future__ import annotations

from datetime import UTC, datetime

from ryusen._internal.wire import (
    NESTED_STEP_ERROR,
    CallbackFailed,
    CallbackSucceeded,
    ConcurrentStepConflict,
    ConflictFound,
    DuplicateStepConflict,
    ErrorInfo,
    Occurrence,
    Phase,
    StepPlan,
    StepReached,
    StepsReached,
    TargetNotFound,
    TaskKind,
)
from ryusen_server.core.decide import decide
from ryusen_server.core.events import (
    AttemptReported,
    DiscoveryReported,
    EngineSettings,
    ReleaseRef,
    Resolve,
    StartRun,
    TaskDelivered,
    WakeRequested,
)
from ryusen_server.core.model import AttemptStatus, RunState, TaskRef

NOW = datetime(2030, 1, 1, tzinfo=UTC)
SETTINGS = EngineSettings()
RELEASE = ReleaseRef(release_id="r1", build_id="b1")


def apply(state: RunState | None, event: object) -> RunState:
    return decide(state, event, now=NOW, settings=SETTINGS).state  # type: ignore[arg-type]


def started(ids: list[str], max_parallel: int) -> RunState:
    state = apply(None, StartRun(run_id="run1", app_id="a", function_id="f", input=1))
    state = apply(state, TaskDelivered(task=TaskRef(run_id="run1", kind=TaskKind.DISCOVER, seq=1), release=RELEASE))
    together = StepsReached(steps=[StepPlan(id=i) for i in ids], max_parallel=max_parallel)
    return apply(state, DiscoveryReported(seq=1, response=together))


def deliver(state: RunState, step_id: str, generation: int = 1) -> RunState:
    task = TaskRef(run_id="run1", kind=TaskKind.FORWARD, step_id=step_id, generation=generation)
    return apply(state, TaskDelivered(task=task, release=RELEASE))


def forward(state: RunState, step_id: str) -> list[AttemptStatus]:
    step = state.step(step_id)
    assert step is not None
    return [a.status for a in step.attempts if a.phase is Phase.FORWARD]


def test_a_wake_s_repair_pass_beside_a_sibling_in_flight_keeps_it_in_its_group() -> None:
    """A run held by a definition blocker while a sibling is in flight: a wake (a release sync, say) repairs it at
    once. Its pass reports the sibling in flight again, which stays in the group (not restarted, still counted),
    and the discovery after the group waits for both."""
    state = started(["a", "b"], max_parallel=2)
    state = deliver(deliver(state, "a"), "b")
    duplicate = DuplicateStepConflict(step_id="x", first=Occurrence(location="f.py:1"), duplicate=Occurrence())
    state = apply(state, AttemptReported(step_id="a", phase=Phase.FORWARD, generation=1,
                                         response=ConflictFound(conflict=duplicate)))  # fmt: skip
    assert state.blocked_by_definition and forward(state, "b") == [AttemptStatus.AUTHORIZED]
    state = apply(state, WakeRequested(source="release_sync"))
    assert state.discovery is not None
    seq = state.discovery.seq
    state = apply(state, TaskDelivered(task=TaskRef(run_id="run1", kind=TaskKind.DISCOVER, seq=seq), release=RELEASE))
    assert state.discovery is not None and state.discovery.status is AttemptStatus.AUTHORIZED
    again = StepsReached(steps=[StepPlan(id="a"), StepPlan(id="b")], max_parallel=2)
    state = apply(state, DiscoveryReported(seq=seq, response=again))
    assert not state.blocked_by_definition
    assert forward(state, "a") == [AttemptStatus.FENCED, AttemptStatus.QUEUED]  # repaired: it starts again
    assert forward(state, "b") == [AttemptStatus.AUTHORIZED]  # still in flight, not restarted
    assert state.group is not None and {s.group for s in state.steps} == {state.group}
    state = apply(state, AttemptReported(step_id="b", phase=Phase.FORWARD, generation=1,
                                         response=CallbackSucceeded(result=2)))  # fmt: skip
    assert state.discovery is None  # a is still to settle
    state = deliver(state, "a", generation=2)
    state = apply(state, AttemptReported(step_id="a", phase=Phase.FORWARD, generation=2,
                                         response=CallbackSucceeded(result=1)))  # fmt: skip
    assert state.discovery is not None and state.group is None  # the discovery after the group


def test_siblings_start_in_declaration_order_when_a_known_step_is_reported_after_a_new_one() -> None:
    state = started(["a", "b"], max_parallel=2)
    state = deliver(deliver(state, "a"), "b")
    # b's pass did not reach it (a release moved it): it leaves the group, and a later pass declares n before it
    missed = TargetNotFound(detail="current code reaches step 'a' before 'b'")
    state = apply(state, AttemptReported(step_id="b", phase=Phase.FORWARD, generation=1, response=missed))
    state = apply(state, AttemptReported(step_id="a", phase=Phase.FORWARD, generation=1,
                                         response=CallbackSucceeded(result=1)))  # fmt: skip
    assert state.discovery is not None
    seq = state.discovery.seq
    state = apply(state, TaskDelivered(task=TaskRef(run_id="run1", kind=TaskKind.DISCOVER, seq=seq), release=RELEASE))
    together = StepsReached(steps=[StepPlan(id="n"), StepPlan(id="b")], max_parallel=1)
    state = apply(state, DiscoveryReported(seq=seq, response=together))
    assert forward(state, "n") == [AttemptStatus.QUEUED]  # declared first: it starts first
    assert forward(state, "b") == [AttemptStatus.FENCED]  # its earlier attempt only: it waits for n


def test_an_operators_retry_of_a_held_sibling_does_not_run_beside_the_discovery_a_rediscover_queued() -> None:
    state = started(["a", "b"], max_parallel=2)
    state = deliver(deliver(state, "a"), "b")
    final = ErrorInfo(type="Boom", message="no", retryable=False)
    state = apply(state, AttemptReported(step_id="b", phase=Phase.FORWARD, generation=1,
                                         response=CallbackFailed(error=final)))  # fmt: skip
    opened = ConcurrentStepConflict(first=Occurrence(step_id="a"), second=Occurrence(step_id="a-receipt"))
    nested = ErrorInfo(type=NESTED_STEP_ERROR, message="opened a step", data={**opened.model_dump(), "build_id": "b1"})
    state = apply(state, AttemptReported(step_id="a", phase=Phase.FORWARD, generation=1,
                                         response=CallbackFailed(error=nested)))  # fmt: skip
    assert state.blocked_by_definition
    state = apply(state, WakeRequested(source="operator"))  # the blocker's remedy: rediscover with current code
    assert state.discovery is not None
    seq = state.discovery.seq
    state = apply(state, Resolve(step_id="a", phase=Phase.FORWARD, generation=1, action="retry", reason="r", by="o"))
    state = deliver(state, "a", generation=2)
    state = apply(state, TaskDelivered(task=TaskRef(run_id="run1", kind=TaskKind.DISCOVER, seq=seq), release=RELEASE))
    running = forward(state, "a")[-1] is AttemptStatus.AUTHORIZED
    assert not (running and state.discovery is not None and state.discovery.status is AttemptStatus.AUTHORIZED)


def test_a_step_in_flight_that_a_repair_pass_no_longer_reports_still_counts_against_max_parallel() -> None:
    """Seed 8181: a release renames sibling b while it waits; the repair pass reports [a, b2]. b is still in
    flight: it joins the new group, so a restarts beside it and b2 waits for a slot."""
    state = started(["a", "b"], max_parallel=2)
    state = deliver(deliver(state, "a"), "b")
    duplicate = DuplicateStepConflict(step_id="x", first=Occurrence(location="f.py:1"), duplicate=Occurrence())
    state = apply(state, AttemptReported(step_id="a", phase=Phase.FORWARD, generation=1,
                                         response=ConflictFound(conflict=duplicate)))  # fmt: skip
    state = apply(state, WakeRequested(source="release_sync"))
    assert state.discovery is not None
    seq = state.discovery.seq
    state = apply(state, TaskDelivered(task=TaskRef(run_id="run1", kind=TaskKind.DISCOVER, seq=seq), release=RELEASE))
    renamed = StepsReached(steps=[StepPlan(id="a"), StepPlan(id="b2")], max_parallel=2)
    state = apply(state, DiscoveryReported(seq=seq, response=renamed))
    assert forward(state, "b") == [AttemptStatus.AUTHORIZED] and forward(state, "a")[-1] is AttemptStatus.QUEUED
    assert forward(state, "b2") == []  # two in flight already (a, and b that no pass declares now)
    state = apply(state, AttemptReported(step_id="b", phase=Phase.FORWARD, generation=1,
                                         response=CallbackSucceeded(result=2)))  # fmt: skip
    assert forward(state, "b2") == [AttemptStatus.QUEUED]  # b settled: a slot for b2


def test_a_step_a_repair_pass_finds_alone_waits_for_the_step_in_flight() -> None:
    """Seed 3418: an operator retries a held step while a repair pass is queued; the pass (a release renamed the
    step) reports one new step. It starts once the step in flight has settled: one at a time."""
    state = apply(None, StartRun(run_id="run1", app_id="a", function_id="f", input=1))
    state = apply(state, TaskDelivered(task=TaskRef(run_id="run1", kind=TaskKind.DISCOVER, seq=1), release=RELEASE))
    state = apply(state, DiscoveryReported(seq=1, response=StepsReached(steps=[StepPlan(id="s0"), StepPlan(id="s1")],
                                                                        max_parallel=1)))  # fmt: skip
    state = deliver(state, "s0")
    opened = ConcurrentStepConflict(first=Occurrence(step_id="s0"), second=Occurrence(step_id="inner"))
    nested = ErrorInfo(type=NESTED_STEP_ERROR, message="opened a step", data={**opened.model_dump(), "build_id": "b1"})
    state = apply(state, AttemptReported(step_id="s0", phase=Phase.FORWARD, generation=1,
                                         response=CallbackFailed(error=nested)))  # fmt: skip
    assert state.blocked_by_definition
    state = apply(state, WakeRequested(source="operator"))  # a repair pass is queued...
    assert state.discovery is not None
    seq = state.discovery.seq
    state = apply(state, TaskDelivered(task=TaskRef(run_id="run1", kind=TaskKind.DISCOVER, seq=seq), release=RELEASE))
    assert state.discovery is not None and state.discovery.status is AttemptStatus.AUTHORIZED  # ...and runs
    state = apply(state, Resolve(step_id="s0", phase=Phase.FORWARD, generation=1, action="retry", reason="r", by="o"))
    state = deliver(state, "s0", generation=2)
    assert forward(state, "s0")[-1] is AttemptStatus.AUTHORIZED  # the operator's retry runs meanwhile
    state = apply(state, DiscoveryReported(seq=seq, response=StepReached(step=StepPlan(id="s0r1"))))
    assert forward(state, "s0r1") == []  # recorded, not started beside s0's retry
    state = apply(state, AttemptReported(step_id="s0", phase=Phase.FORWARD, generation=2,
                                         response=CallbackSucceeded(result=0)))  # fmt: skip
    assert forward(state, "s0r1") == [AttemptStatus.QUEUED]


def test_a_discovery_queued_before_an_operator_starts_a_step_again_waits_for_it() -> None:
    state = started(["a", "b"], max_parallel=1)
    state = deliver(state, "a")
    opened = ConcurrentStepConflict(first=Occurrence(step_id="a"), second=Occurrence(step_id="inner"))
    nested = ErrorInfo(type=NESTED_STEP_ERROR, message="opened a step", data={**opened.model_dump(), "build_id": "b1"})
    state = apply(state, AttemptReported(step_id="a", phase=Phase.FORWARD, generation=1,
                                         response=CallbackFailed(error=nested)))  # fmt: skip
    state = apply(state, WakeRequested(source="operator"))
    assert state.discovery is not None
    seq = state.discovery.seq
    state = apply(state, Resolve(step_id="a", phase=Phase.FORWARD, generation=1, action="retry", reason="r", by="o"))
    state = deliver(state, "a", generation=2)
    state = apply(state, TaskDelivered(task=TaskRef(run_id="run1", kind=TaskKind.DISCOVER, seq=seq), release=RELEASE))
    assert state.discovery is None  # fenced: the discovery after the group waits for a's retry
    state = apply(state, AttemptReported(step_id="a", phase=Phase.FORWARD, generation=2,
                                         response=CallbackSucceeded(result=0)))  # fmt: skip
    assert forward(state, "b") == [AttemptStatus.QUEUED]  # the group goes on: b in its turn

"""Acknowledged dispatch and heartbeats (issue 25, decision 33) where the whole-server simulator found them wrong.

Seed 8172 (tests/simulation, 10,000 seeds at 2f02b5c): a chained write authorized a step's attempt, committed,
and its answer was lost; the dispatcher deferred the answer, and its receiver claimed the attempt (never sent)
and re-authorized it for its own delivery. ``reauthorize`` gave it the lease of an attempt that neither heartbeats
nor acknowledges: its timeout plus ``lease_grace_s``. So a step that declares ``heartbeat`` was Unknown only after
its whole timeout (6 hours here, not 63 s: H2), and an attempt of an acknowledging release only 60 s after its
timeout, not 3 s, while the attempt still recorded the 3 s grace it was authorized with."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from ryusen._internal.wire import Phase, StepPlan, StepReached, TaskKind
from ryusen_server.core.decide import decide
from ryusen_server.core.events import (
    DiscoveryReported,
    EngineSettings,
    InvokeTask,
    ReleaseRef,
    StartRun,
    TaskDelivered,
)
from ryusen_server.core.model import Attempt, AttemptStatus, RunState, TaskRef

NOW = datetime(2030, 1, 1, tzinfo=UTC)
SETTINGS = EngineSettings()
ACKNOWLEDGING = ReleaseRef(release_id="r1", build_id="b1", acknowledges=True)
WAITED_ON = ReleaseRef(release_id="r1", build_id="b1")


def claimed(plan: StepPlan, release: ReleaseRef, *, later_s: float = 30.0) -> tuple[Attempt, Attempt]:
    """Step ``encode``'s attempt as the chained write D1 authorized it (never sent: its answer was lost and
    deferred), and as the deferred answer's receiver D2 claimed and re-authorized it ``later_s`` after."""
    state: RunState = decide(
        None, StartRun(run_id="run1", app_id="a", function_id="f", input=1), now=NOW, settings=SETTINGS
    ).state
    discover = TaskRef(run_id="run1", kind=TaskKind.DISCOVER, seq=1)
    state = decide(state, TaskDelivered(task=discover, release=release), now=NOW, settings=SETTINGS).state
    reached = StepReached(step=plan)
    first = DiscoveryReported(seq=1, response=reached, chain=release, delivery_id="D1")
    state = decide(state, first, now=NOW, settings=SETTINGS).state
    authorized = _encode(state)
    assert authorized.status is AttemptStatus.AUTHORIZED and authorized.delivery_id == "D1"
    again = DiscoveryReported(seq=1, response=reached, chain=release, delivery_id="D2", claims=("D1",))
    decision = decide(state, again, now=NOW + timedelta(seconds=later_s), settings=SETTINGS)
    assert any(isinstance(c, InvokeTask) for c in decision.commands), decision.commands  # D2 sends it now
    reclaimed = _encode(decision.state)
    assert reclaimed.delivery_id == "D2"
    return authorized, reclaimed


def _encode(state: RunState) -> Attempt:
    step = state.step("encode")
    assert step is not None
    attempt = step.current(Phase.FORWARD)
    assert attempt is not None
    return attempt


def test_a_claimed_attempt_of_a_step_that_heartbeats_keeps_a_lease_of_one_interval() -> None:
    plan = StepPlan(id="encode", timeout_s=6 * 3600, heartbeat_s=60)
    authorized, reclaimed = claimed(plan, ACKNOWLEDGING)
    assert authorized.lease_expires_at == NOW + timedelta(seconds=60 + 3)  # one interval and the short grace
    at = NOW + timedelta(seconds=30)
    assert reclaimed.authorized_at == at and reclaimed.respond_by == at + timedelta(hours=6)
    assert reclaimed.lease_expires_at == at + timedelta(seconds=60 + 3), (
        f"re-authorized with a lease to {reclaimed.lease_expires_at}: a silent callback is noticed only after"
        " its whole timeout"
    )


@pytest.mark.parametrize(("release", "grace_s"), [(ACKNOWLEDGING, 3.0), (WAITED_ON, 60.0)])
def test_a_claimed_attempt_keeps_the_grace_of_its_release(release: ReleaseRef, grace_s: float) -> None:
    authorized, reclaimed = claimed(StepPlan(id="encode", timeout_s=30), release)
    assert authorized.lease_grace_s == reclaimed.lease_grace_s == grace_s
    assert reclaimed.respond_by is not None
    assert reclaimed.lease_expires_at == reclaimed.respond_by + timedelta(seconds=grace_s)

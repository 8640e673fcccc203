"""A step that is not in the running group settles while the group runs (decision 30): the function goes on only
once the group's siblings have settled, whichever way the step's outcome came (found by the whole-server simulator,
seed 8863 of 2026-12-06).

How a step outside the group can be in flight beside it: sibling a's callback opened a step (held: it must not run
again by itself), a release no longer reaches a, the group ends and the function goes on to step c. While c runs,
an operator retries a, which reopens a's group. c's outcome then arrives, posted with the continuation its replay
found (the SDK's ``next``): that continuation, a discovery pass's finding, was recorded and its step started while
a was still in flight."""

from __future__ import annotations

from typing import Any

from ryusen._internal.wire import (
    CallbackSucceeded,
    Phase,
    StepPlan,
    StepReached,
)
from ryusen_server.core.events import AttemptReported, DiscoveryReported, Resolve
from ryusen_server.core.model import AttemptStatus, RunState
from tests.conformance.test_review_completion_groups import (
    RELEASE2,
    apply,
    deliver,
    forward,
    held_a_beside_completed_b,
    live,
    repair_pass,
    report,
)


def _c_in_flight_beside_as_reopened_group() -> RunState:
    state = held_a_beside_completed_b()
    state, seq = repair_pass(state)  # the new release does not reach a: the function goes on to c
    state = apply(state, DiscoveryReported(seq=seq, response=StepReached(step=StepPlan(id="c"))))
    state = deliver(state, "c", release=RELEASE2)
    assert forward(state, "c") == [AttemptStatus.AUTHORIZED]
    state = apply(state, Resolve(step_id="a", phase=Phase.FORWARD, generation=1, action="retry", reason="r", by="o"))
    state = deliver(state, "a", generation=2, release=RELEASE2)
    assert live(state) == ["a", "c"] and state.group is not None and state.step("a").group == state.group  # type: ignore[union-attr]
    return state


def test_a_continuation_posted_while_a_retried_sibling_reopened_its_group_waits_for_the_group() -> None:
    """c's outcome comes with the step its replay found next (d): nothing starts while a's retry runs."""
    state = _c_in_flight_beside_as_reopened_group()
    state = apply(state, _c_succeeded(next=StepReached(step=StepPlan(id="d"))))
    assert forward(state, "c") == [AttemptStatus.SUCCEEDED]
    assert state.step("d") is None or forward(state, "d") == [], "d started while a's retry runs"
    assert state.discovery is None or state.discovery.status is not AttemptStatus.AUTHORIZED
    state = report(state, "a", CallbackSucceeded(result=1), generation=2)
    assert live(state) == ["d"] or (state.discovery is not None and live(state) == [])  # now the function goes on


def test_an_outcome_carried_on_at_once_beside_a_reopened_group_authorizes_no_discovery_until_it_is_done() -> None:
    """c's outcome without a continuation the engine may use (a release was synced since its replay), recorded by
    the result function, which authorizes the next task in the same write (``chain``): the simulator's seed 8863.
    The discovery after c must wait for a's retry."""
    state = _c_in_flight_beside_as_reopened_group()
    state = apply(state, _c_succeeded(chain=RELEASE2, delivery_id="result-function-1"))
    assert forward(state, "c") == [AttemptStatus.SUCCEEDED]
    assert state.discovery is None or state.discovery.status is not AttemptStatus.AUTHORIZED, (
        "a discovery authorized while a's retry is in flight"
    )
    state = report(state, "a", CallbackSucceeded(result=1), generation=2)
    assert state.discovery is not None and live(state) == []  # now the function goes on


def _c_succeeded(**kwargs: Any) -> AttemptReported:
    return AttemptReported(
        step_id="c", phase=Phase.FORWARD, generation=1, response=CallbackSucceeded(result=3), **kwargs
    )

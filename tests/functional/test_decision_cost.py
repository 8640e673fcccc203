"""A decision costs what it changes, not what the run holds (issue 10, item 4): what every save and every task
needs from the whole run (the steps with work on its way, the memo) is worked out from the state a decision
started from and the steps it replaced or added, not from every step again."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from ryusen import Ryusen, Step
from ryusen.testing import WorkflowEnvironment
from ryusen_server.core import decide as core
from ryusen_server.core import model
from ryusen_server.core.events import EngineSettings

STEPS = 400


@pytest.mark.parametrize("store", ["memory", "moto"])
def test_the_steps_looked_at_per_decision_do_not_grow_with_the_run(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "CHECK_PURITY", False)
    monkeypatch.setattr(model, "CHECK_DERIVED", False)  # (it looks at every step, to check the answer)
    looked: Counter[str] = Counter()
    due_at, memo_entry = model.StepState.due_at, model.StepState.memo_entry

    def counting_due_at(self: model.StepState) -> Any:
        looked["due_at"] += 1
        return due_at(self)

    def counting_memo_entry(self: model.StepState) -> Any:
        looked["memo_entry"] += 1
        return memo_entry(self)

    monkeypatch.setattr(model.StepState, "due_at", counting_due_at)
    monkeypatch.setattr(model.StepState, "memo_entry", counting_memo_entry)

    app = Ryusen("long")

    @app.function("straight")
    def straight(data: Any, step: Step) -> int:
        return sum(step.run(f"step-{i}", lambda i=i: i) for i in range(STEPS))

    with WorkflowEnvironment(app, store=store, settings=EngineSettings(max_steps=STEPS)) as env:
        run = env.run("straight")
    assert run.outcome == "completed" and run.output == sum(range(STEPS))
    # walking every step on every save and every task would look at about STEPS**2 / 2 = 80,000 steps each
    # (each step is a few decisions); worked out from the origin, it is a few per decision
    assert 0 < looked["due_at"] < 12 * STEPS, looked
    assert 0 < looked["memo_entry"] < 12 * STEPS, looked


def test_what_is_worked_out_from_the_origin_is_what_every_step_says() -> None:
    """The suite runs with ``CHECK_DERIVED`` on, which checks each derived answer against the full one; this
    checks the check itself: a cache made stale by hand is caught."""
    app = Ryusen("short")

    @app.function("two")
    def two(data: Any, step: Step) -> int:
        return step.run("a", lambda: 1) + step.run("b", lambda: 2)

    with WorkflowEnvironment(app) as env:
        run = env.run("two")
        state = env.engine.store.get(run.id)
    assert state is not None and model.CHECK_DERIVED
    entries = state.memo_entries()
    assert set(entries) == {"a", "b"}
    stale = dict(entries)
    del stale["b"]
    state._memo_cache = (state.steps, len(state.steps), stale)
    with pytest.raises(AssertionError, match="memo_entries"):
        state.memo_entries()


def finished_state(env: WorkflowEnvironment, run_id: str) -> model.RunState:
    state = env.engine.store.get(run_id)
    assert state is not None
    return state


def three_steps_completed() -> model.RunState:
    """The stored state of a finished run of three steps, a, b and c, each completed."""
    app = Ryusen("three")

    @app.function("three")
    def three(data: Any, step: Step) -> int:
        return sum(step.run(name, lambda: 1) for name in ("a", "b", "c"))

    with WorkflowEnvironment(app) as env:
        return finished_state(env, env.run("three").id)


def test_a_step_changed_in_place_during_a_decision_is_seen_by_a_later_look() -> None:
    """Found by the attack review: a decision that owns a step, looks at the memo (or the steps due), then
    changes the step in place, must not be answered from what it worked out before the change. Nothing is
    kept from a state that a decision may still change (it is sealed when decided)."""
    state = three_steps_completed()
    copy = state.working_copy()
    owned = copy.steps[1].own_copy()
    copy.replace_step(1, owned)
    assert copy.memo_entries()["b"]["status"] == "completed"
    owned.status = model.StepStatus.FAILED  # in place, as a decision changes a step it owns
    assert copy.memo_entries()["b"]["status"] == "failed"
    copy.seal()
    assert copy.memo_entries()["b"]["status"] == "failed"


def test_a_copy_with_other_steps_works_its_own_out() -> None:
    """``model_copy(update={"steps": ...})`` keeps the private attributes: what the original worked out (or
    would derive from its origin) must not answer for the copy's other steps."""
    state = three_steps_completed()
    assert set(state.memo_entries()) == {"a", "b", "c"}
    fewer = state.model_copy(update={"steps": state.steps[:1]})
    assert set(fewer.memo_entries()) == {"a"}
    pending = [s.model_copy(update={"status": model.StepStatus.PENDING, "result": None}) for s in state.steps]
    other = state.model_copy(update={"steps": pending})  # as many steps, none of them completed
    assert other.memo_entries() == {}


def test_the_check_tells_apart_what_json_tells_apart() -> None:
    """A stale entry holding ``true`` where the step holds ``1`` is equal in Python, not in JSON."""
    app = Ryusen("one")

    @app.function("one")
    def one(data: Any, step: Step) -> int:
        return step.run("a", lambda: 1)

    with WorkflowEnvironment(app) as env:
        state = finished_state(env, env.run("one").id)
    assert state.memo_entries() == {"a": {"status": "completed", "result": 1}}
    state._memo_cache = (state.steps, len(state.steps), {"a": {"status": "completed", "result": True}})
    with pytest.raises(AssertionError, match="memo_entries"):
        state.memo_entries()

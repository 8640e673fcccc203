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

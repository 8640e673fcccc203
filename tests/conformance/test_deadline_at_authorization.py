"""S14: the deadline holds at authorization, not only when its timer fires (decision 26).

The deadline's timer can be late (a second on ``ryusen dev``, up to a minute on AWS). Whatever the timer
does, no forward task is authorized at or after the deadline, and a run whose completing pass commits after
it ends ``timed_out`` and is compensated.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from ryusen import Ryusen, Step
from ryusen.testing import WorkflowEnvironment


def slow_app(env_box: list[WorkflowEnvironment], calls: list[str], *, steps: int = 3, slow_s: float = 2.5) -> Ryusen:
    app = Ryusen("slow")

    def work(name: str) -> str:
        calls.append(name)
        env_box[0].advance(timedelta(seconds=slow_s))  # the callback takes slow_s of (virtual) time
        return f"{name}-done"

    @app.function("pipeline")
    def pipeline(data: Any, step: Step) -> Any:
        return [
            step.run(f"s{i}", work, f"s{i}", compensate=lambda r, i=i: calls.append(f"undo-s{i}")) for i in range(steps)
        ]

    return app


def environment(calls: list[str], **kwargs: Any) -> WorkflowEnvironment:
    box: list[WorkflowEnvironment] = []
    env = WorkflowEnvironment(slow_app(box, calls, **kwargs))
    box.append(env)
    return env


@pytest.mark.rfd("S14", "S12")
def test_no_step_is_authorized_after_the_deadline_even_before_its_timer_fires() -> None:
    calls: list[str] = []
    env = environment(calls)
    env.timers.fire_late_by = timedelta(minutes=1)  # as on AWS: the deadline's schedule fires a minute late
    run_id = env.start("pipeline", timeout=timedelta(seconds=2))
    run = env.wait(run_id)

    assert calls == ["s0", "undo-s0"]  # s1 was never authorized: s0 finished after the deadline
    assert run.summary == "timed out, fully compensated"
    deadline = run["deadline"]["at"]
    authorized = [a["authorized_at"] for s in run.steps for a in s["attempts"] if a["phase"] == "forward"]
    assert all(at < deadline for at in authorized)


@pytest.mark.rfd("S14")
def test_a_run_whose_completing_pass_commits_after_the_deadline_times_out_and_compensates() -> None:
    calls: list[str] = []
    env = environment(calls, steps=1)
    env.timers.fire_late_by = timedelta(minutes=1)
    run = env.run("pipeline", timeout=timedelta(seconds=2))
    assert run.outcome == "timed_out" and run.output is None
    assert calls == ["s0", "undo-s0"] and run.summary == "timed out, fully compensated"


@pytest.mark.rfd("S14")
def test_work_delivered_after_the_deadline_is_fenced_without_the_timer() -> None:
    calls: list[str] = []
    env = environment(calls, slow_s=0.0)
    env.timers.fire_late_by = timedelta(hours=1)
    run_id = env.start("pipeline", timeout=timedelta(seconds=2))
    env.advance(timedelta(seconds=3))  # the first discovery's message arrives after the deadline
    run = env.wait(run_id)
    assert calls == [] and run.summary == "timed out, compensation not required"

"""Generated workflows for the simulator: their shape, the code each release serves, and what a run of them
must end with when nothing goes wrong.

A workflow is groups of steps. A group may be wrapped in ``try/except StepFailed`` (the failure of one of its
steps skips the rest of the group), and a step inside it may be wrapped again (nested: its failure is handled
where it happens). A step's callback fails its first ``fails`` executions; with ``fails`` at least its
``max_attempts`` it fails for good. Compensators fail their first ``undo_fails`` executions, always fewer than
their attempts. The function may raise at its end (the run fails after every step succeeded).

A release of the same app may rename, add or remove steps: :func:`variant` derives one from a workflow.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Literal

from ryusen import RetryPolicy, Ryusen, Step, StepFailed

APP_ID = "sim"
FUNCTION_ID = "saga"


@dataclass(frozen=True, slots=True)
class StepSpec:
    id: str
    fails: int
    """Executions of the callback that raise before one succeeds (at least ``max_attempts``: it fails for good)."""
    max_attempts: int
    compensate: bool
    undo_fails: int
    undo_attempts: int
    caught: bool
    """The function catches this step's ``StepFailed`` right where it is raised."""
    on_unknown: Literal["block", "retry"]
    undo_on_unknown: Literal["block", "retry"] = "block"

    @property
    def succeeds(self) -> bool:
        return self.fails < self.max_attempts


@dataclass(frozen=True, slots=True)
class GroupSpec:
    steps: tuple[StepSpec, ...]
    caught: bool
    """The group is wrapped in ``try/except StepFailed``: a failure of one of its steps skips the rest of it."""


@dataclass(frozen=True, slots=True)
class WorkflowSpec:
    groups: tuple[GroupSpec, ...]
    raise_at_end: bool
    release: int = 0
    """Which release of the app this is (0: the first)."""

    @property
    def steps(self) -> list[StepSpec]:
        return [s for g in self.groups for s in g.steps]

    def describe(self) -> str:
        parts = []
        for g in self.groups:
            inner = " ".join(
                f"{s.id}{'!' if not s.succeeds else ''}{f'~{s.fails}' if s.fails else ''}"
                f"{'+undo' if s.compensate else ''}{'(caught)' if s.caught else ''}"
                f"{'[retry-unknown]' if s.on_unknown == 'retry' else ''}"
                for s in g.steps
            )
            parts.append(f"try{{{inner}}}" if g.caught else inner)
        return " | ".join(parts) + (" | raise" if self.raise_at_end else "")


def generate(rng: random.Random, *, clean: bool = False) -> WorkflowSpec:
    """A workflow of 1 to 6 steps. ``clean``: every step succeeds first time (a fault-free baseline's shape
    still varies: compensators, groups)."""
    groups: list[GroupSpec] = []
    n = 0
    for _ in range(rng.randint(1, 4)):
        steps = []
        for _ in range(rng.randint(1, 2)):
            max_attempts = rng.randint(1, 3)
            fails = 0 if clean else rng.choice([0, 0, 0, 1, 2, max_attempts])
            undo_attempts = rng.randint(1, 3)
            steps.append(
                StepSpec(
                    id=f"s{n}",
                    fails=fails,
                    max_attempts=max_attempts,
                    compensate=rng.random() < 0.7,
                    undo_fails=0 if clean else rng.randint(0, undo_attempts - 1),
                    undo_attempts=undo_attempts,
                    caught=rng.random() < 0.25,
                    on_unknown=rng.choice(["block", "block", "retry"]),
                    undo_on_unknown=rng.choice(["block", "block", "retry"]),
                )
            )
            n += 1
        groups.append(GroupSpec(tuple(steps), caught=rng.random() < 0.3))
    return WorkflowSpec(tuple(groups), raise_at_end=rng.random() < 0.2)


def variant(spec: WorkflowSpec, rng: random.Random, release: int) -> tuple[WorkflowSpec, str]:
    """A later release of ``spec``'s app: the same code, or one step renamed, added or removed."""
    how = rng.choice(["same", "rename", "add", "remove"])
    groups = [list(g.steps) for g in spec.groups]
    flat = [(gi, si) for gi, g in enumerate(groups) for si in range(len(g))]
    gi, si = rng.choice(flat)
    if how == "rename":
        groups[gi][si] = replace(groups[gi][si], id=f"{groups[gi][si].id}r{release}")
    elif how == "add":
        new = StepSpec(f"n{release}", 0, 2, rng.random() < 0.5, 0, 1, False, "block")
        groups[gi].insert(rng.randint(0, len(groups[gi])), new)
    elif how == "remove" and len(flat) > 1:
        del groups[gi][si]
    else:
        how = "same"
    kept = tuple(GroupSpec(tuple(g), spec.groups[i].caught) for i, g in enumerate(groups) if g)
    return replace(spec, groups=kept, release=release), how


@dataclass(frozen=True, slots=True)
class Expected:
    outcome: str
    recovery: str | None
    output: Any
    forward: dict[str, int]
    """Executions of each step's callback."""
    undone: list[str]
    """The steps compensated, in order."""
    undo_runs: dict[str, int]


def expected(spec: WorkflowSpec, data: Any) -> Expected:
    """What a run of ``spec`` ends with when nothing goes wrong (no fault, no operator, no new release)."""
    completed: list[StepSpec] = []
    forward: dict[str, int] = {}
    results: list[Any] = []
    failed = False
    for group in spec.groups:
        for s in group.steps:
            forward[s.id] = min(s.fails + 1, s.max_attempts)
            if s.succeeds:
                completed.append(s)
                results.append(result_of(s.id, data))
                continue
            if s.caught:
                results.append(None)
                continue
            if not group.caught:
                failed = True
            break
        if failed:
            break
    if not failed and not spec.raise_at_end:
        return Expected("completed", None, results, forward, [], {})
    undone = [s.id for s in reversed(completed) if s.compensate]
    # every accepted success is in the unwind: one whose code has no compensator is skipped (target_not_found)
    recovery = "compensated" if completed else "not_required"
    return Expected(
        "failed", recovery, None, forward, undone, {s.id: s.undo_fails + 1 for s in completed if s.compensate}
    )


def result_of(step_id: str, data: Any) -> dict[str, Any]:
    return {"step": step_id, "order": data}


Effect = Callable[[str, str], int]
"""The simulator's hook, called by a callback as it runs: (step id, phase) -> how many times this callback
ran before for this run (the callback fails while that is below its ``fails``)."""


def build_app(spec: WorkflowSpec, on_effect: Effect, *, master_key: str, seen: Any) -> Ryusen:
    """The app of one release of ``spec``, holding the deployment's master (as ``ryusen dev``'s apps do)."""
    app = Ryusen(
        APP_ID,
        master_key=master_key,
        seen_requests=seen,
        release_id=f"r{spec.release}",
        build_id=f"b{spec.release}",
    )

    def callback(s: StepSpec) -> Callable[[Any], Any]:
        def run(data: Any) -> Any:
            before = on_effect(s.id, "forward")
            if before < s.fails:
                raise ConnectionError(f"{s.id} failed (execution {before + 1})")
            return result_of(s.id, data)

        return run

    def compensator(s: StepSpec) -> Callable[[Any], Any] | None:
        if not s.compensate:
            return None

        def undo(result: Any) -> Any:
            before = on_effect(s.id, "compensation")
            if before < s.undo_fails:
                raise ConnectionError(f"undo {s.id} failed (execution {before + 1})")
            return {"undone": s.id}

        return undo

    def run_step(step: Step, s: StepSpec, data: Any) -> Any:
        return step.run(
            s.id,
            callback(s),
            data,
            compensate=compensator(s),
            retry=RetryPolicy(max_attempts=s.max_attempts, initial_delay=timedelta(seconds=1), on_unknown=s.on_unknown),
            compensate_retry=RetryPolicy(
                max_attempts=s.undo_attempts, initial_delay=timedelta(seconds=1), on_unknown=s.undo_on_unknown
            ),
        )

    @app.function(FUNCTION_ID)
    def saga(data: Any, step: Step) -> Any:
        results: list[Any] = []
        for group in spec.groups:
            try:
                for s in group.steps:
                    if s.caught:
                        try:
                            results.append(run_step(step, s, data))
                        except StepFailed:
                            results.append(None)
                    else:
                        results.append(run_step(step, s, data))
            except StepFailed:
                if not group.caught:
                    raise
        if spec.raise_at_end:
            raise RuntimeError("rejected at the end")
        return results

    return app

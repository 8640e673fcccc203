"""Decisions 16 and 17 under generated workflows whose code outside ``step.run`` raises.

Hypothesis builds a workflow (steps with and without compensators, flaky callbacks, handled and
uncaught failures) and a fault plan: code around the steps raises before, between and after them, in
``finally`` blocks and at the end, in discovery, forward or compensation passes, a bounded number of
times. Some plans also deploy a second release mid-run that removes a step, drops a compensator,
returns early, or inserts a new step (which a later release takes out again). The run goes through
the real engine and SDK (``ryusen.testing``), and at the end:

* no callback of a (step, phase, generation) ran twice, and one that ran is never recorded as not run
  (fenced), which is how a second charge used to start;
* every accepted success is in the unwind once recovery has begun;
* ``compensated`` only when every compensator ran, or current code (the release that served the
  pass) does not reach that step or declares no compensator for it;
* the run finished, or carries a blocker that names its remedy.

CI runs 200 examples; explore longer with
    RYUSEN_ORCHESTRATION_FAULTS=1000 .venv/bin/pytest tests/conformance/test_orchestration_faults.py
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import ryusen
from ryusen import RetryPolicy, Ryusen, Step, StepFailed
from ryusen._internal.app import HandlerResponse
from ryusen._internal.wire import TaskKind, TaskRequest, TaskResponse
from ryusen.testing import WorkflowEnvironment
from ryusen_server.core.events import EngineSettings

EXAMPLES = int(os.environ.get("RYUSEN_ORCHESTRATION_FAULTS", "200"))
PASSES = ("discover", "forward", "compensate")


@dataclass(frozen=True)
class StepSpec:
    id: str
    compensator: bool
    flaky: int
    """Failures of the forward callback before it succeeds; 3 exhausts its 3 attempts."""
    handled: bool
    """A terminal failure is caught by the function (no compensation) rather than escaping."""
    flaky_compensator: int


@dataclass(frozen=True)
class Release:
    version: int
    steps: tuple[StepSpec, ...]
    return_before: str | None = None
    """Current code returns before reaching this step."""
    insert_before: str | None = None
    """Current code runs a new step ``audit`` before this one."""


@dataclass(frozen=True)
class Fault:
    point: str
    """start, before:<id>, finally:<id>, after:<id> or end."""
    passes: frozenset[str]
    times: int


@dataclass(frozen=True)
class Plan:
    first: Release
    fails: bool
    faults: tuple[Fault, ...]
    second: Release | None
    switch_after: int
    """Deliveries before the second release is synced."""


PASS_SETS = st.one_of(
    st.just(frozenset({"compensate"})),
    st.just(frozenset({"forward"})),
    st.just(frozenset({"forward", "compensate"})),
    st.sets(st.sampled_from(PASSES), min_size=1).map(frozenset),
)
"""A fault in a discovery pass fails the run at once, so forward and compensation passes are drawn more often."""


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    n = draw(st.integers(min_value=1, max_value=4))
    steps = tuple(
        StepSpec(
            id=f"s{i}",
            compensator=draw(st.booleans()) or draw(st.booleans()),
            flaky=draw(st.sampled_from([0, 0, 0, 1, 3])),
            handled=draw(st.booleans()),
            flaky_compensator=draw(st.sampled_from([0, 0, 1, 2])),
        )
        for i in range(n)
    )
    points = ["start", "end", *(f"{kind}:{s.id}" for s in steps for kind in ("before", "finally", "after"))]
    faults = tuple(
        Fault(
            point=draw(st.sampled_from(points)),
            passes=draw(PASS_SETS),
            times=draw(st.integers(min_value=1, max_value=2)),
        )
        for _ in range(draw(st.integers(min_value=0, max_value=4)))
    )
    first = Release(1, steps)
    change = draw(st.sampled_from(["none", "none", "remove", "no_compensator", "return_early", "insert"]))
    target = draw(st.sampled_from(steps))
    second: Release | None
    if change == "remove":
        second = Release(2, tuple(s for s in steps if s is not target))
    elif change == "no_compensator":
        second = Release(2, tuple(replace(s, compensator=False) if s is target else s for s in steps))
    elif change == "return_early":
        second = Release(2, steps, return_before=target.id)
    elif change == "insert":
        second = Release(2, steps, insert_before=target.id)
    else:
        second = None
    return Plan(first, draw(st.booleans()), faults, second, draw(st.integers(min_value=0, max_value=12)))


@dataclass
class Harness:
    """The generated app's world: fault budgets, callback counts, and what each pass reported."""

    plan: Plan
    faults_left: dict[tuple[str, str], int] = field(default_factory=dict)
    executions: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    """(step, phase, generation) -> callback executions."""
    compensated: set[str] = field(default_factory=set)
    attempts: Counter[tuple[str, str]] = field(default_factory=Counter)
    skips: list[tuple[str, Release]] = field(default_factory=list)
    """Compensation passes that reported target_not_found: (step, the release that served it)."""
    skippable: set[str] = field(default_factory=set)
    """Steps a compensation pass reached and found no compensator for (the only ground for a skip)."""
    current_pass: str = "discover"
    raised: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        for fault in self.plan.faults:
            for kind in fault.passes:
                key = (fault.point, kind)
                self.faults_left[key] = self.faults_left.get(key, 0) + fault.times

    def fault(self, point: str) -> None:
        key = (point, self.current_pass)
        if self.faults_left.get(key, 0) > 0:
            self.faults_left[key] -= 1
            self.raised[f"{point.split(':')[0]} in {self.current_pass}"] += 1
            raise TimeoutError(f"orchestration fault at {point} in a {self.current_pass} pass")

    def app(self, release: Release) -> Ryusen:
        app = Ryusen("faults", release_id=f"v{release.version}", build_id=f"v{release.version}")
        harness = self

        def callback(spec: StepSpec) -> Any:
            def forward() -> str:
                op = ryusen.operation()
                harness.executions[(spec.id, "forward", op.generation)] += 1
                harness.attempts[(spec.id, "forward")] += 1
                if harness.attempts[(spec.id, "forward")] <= spec.flaky:
                    raise ConnectionError(f"{spec.id} flaked")
                return f"{spec.id}-done"

            return forward

        def compensator(spec: StepSpec) -> Any:
            def compensate(result: Any) -> str:
                op = ryusen.operation()
                harness.executions[(spec.id, "compensation", op.generation)] += 1
                harness.attempts[(spec.id, "compensation")] += 1
                if harness.attempts[(spec.id, "compensation")] <= spec.flaky_compensator:
                    raise ConnectionError(f"undo {spec.id} flaked")
                harness.compensated.add(spec.id)
                return f"undid {result}"

            return compensate

        def audit() -> str:
            harness.executions[("audit", "forward", ryusen.operation().generation)] += 1
            return "audited"

        @app.function("wf")
        def wf(data: Any, step: Step) -> Any:
            harness.fault("start")
            for spec in release.steps:
                if spec.id == release.return_before:
                    return "returned early"
                if spec.id == release.insert_before:
                    step.run("audit", audit)
                harness.fault(f"before:{spec.id}")
                try:
                    try:
                        step.run(
                            spec.id,
                            callback(spec),
                            compensate=compensator(spec) if spec.compensator else None,
                            retry=RetryPolicy(max_attempts=3, initial_delay=timedelta(seconds=1)),
                        )
                    finally:
                        harness.fault(f"finally:{spec.id}")
                except StepFailed:
                    if not spec.handled:
                        raise
                harness.fault(f"after:{spec.id}")
            harness.fault("end")
            if harness.plan.fails:
                raise RuntimeError("order rejected")
            return "ok"

        return app

    def serve(self, env: WorkflowEnvironment, release: Release) -> None:
        """Sync ``release`` and watch every task it serves: which pass it is, and what it reported."""
        app = self.app(release)
        env.sync(app)
        url = f"inproc://{app.app_id}"

        def handle(method: str, headers: dict[str, str], body: bytes) -> HandlerResponse:
            request = TaskRequest.model_validate_json(body)
            self.current_pass = request.kind.value
            response = env.endpoint(app)(method, headers, body)
            if request.kind is TaskKind.COMPENSATE and response.status == 200:
                outcome = TaskResponse.model_validate_json(response.body).attempt
                if outcome is not None and outcome.type == "target_not_found":
                    assert request.step_id is not None
                    self.skips.append((request.step_id, release))
                    if outcome.reason != "not_reached":  # only these may become a skip (decisions 24)
                        self.skippable.add(request.step_id)
            return response

        env.invoker.apps[url] = handle


def reaches_with_compensator(release: Release, step_id: str) -> bool:
    """Does this release's code reach ``step_id`` and declare a compensator for it?"""
    for spec in release.steps:
        if spec.id == release.return_before:
            return False
        if spec.id == step_id:
            return spec.compensator
    return False


def probe_past_passes_that_ended_early(env: WorkflowEnvironment, run_id: str, run: Any) -> Any:
    """A compensation pass that ended before its step (a fault in its ``finally``) blocks the unwind
    (decisions 24); the probe asks current code again, and the faults, which have budgets, run out."""
    for _ in range(6):
        if not any(b["type"] == "compensation_target_not_reached" for b in run.blockers):
            return run
        event("a compensation pass ended before its step: blocked, then probed")
        env.advance(timedelta(hours=2))
        run = env.wait(run_id, max_transitions=5_000)
    return run


def run_plan(plan: Plan) -> None:
    harness = Harness(plan)
    env = WorkflowEnvironment(
        settings=EngineSettings(
            compensate_retry=RetryPolicy(max_attempts=4, initial_delay=timedelta(seconds=1)).to_wire(),
            redelivery_initial_s=1.0,
        )
    )
    harness.serve(env, plan.first)
    run_id = env.start("wf")
    for _ in range(plan.switch_after):
        if not env.step_once():
            break
    if plan.second is not None:
        harness.serve(env, plan.second)
    run = env.wait(run_id, max_transitions=5_000)
    run = probe_past_passes_that_ended_early(env, run_id, run)
    if run.blockers and plan.second is not None and plan.second.insert_before is not None:
        event("blocked by a new step before the target, then fixed")
        allowed = {"new_step_before_target", "compensation_target_not_reached"}
        assert {b["type"] for b in run.blockers} <= allowed, run.blockers
        harness.serve(env, replace(plan.second, version=3, insert_before=None))
        run = env.wait(run_id, max_transitions=5_000)
        run = probe_past_passes_that_ended_early(env, run_id, run)

    # no callback of a (step, phase, generation) ran twice
    twice = {key: n for key, n in harness.executions.items() if n > 1}
    assert not twice, f"callbacks ran twice: {twice}"
    # the run ended, or says why it waits and what to do
    assert run.phase == "finished" or (run.blockers and all(b["remedy"] for b in run.blockers)), run.summary
    state = env.engine.get_run(run_id)
    # an attempt whose callback ran is recorded with that callback's outcome, never as fenced (did not run)
    for step in state.steps:
        for attempt in step.attempts:
            ran = harness.executions[(step.id, attempt.phase.value, attempt.generation)]
            if ran:
                assert attempt.status.value != "fenced", (
                    f"{step.id} {attempt.phase} #{attempt.generation} ran: {attempt}"
                )
    completed = {s.id for s in state.steps if s.status.value == "completed"}
    if run.phase in ("compensating", "finished") and run.outcome not in (None, "completed"):
        # every accepted success is in the unwind
        assert completed == {u["step_id"] for u in run["unwind"]}, (completed, run["unwind"])
    if run.recovery == "compensated":
        for entry in run["unwind"]:
            if entry["status"] == "compensated":
                assert entry["step_id"] in harness.compensated, f"{entry['step_id']} compensated without running"
            else:
                assert entry["status"] == "skipped", entry
                # decisions 24: a skip only where a pass reached the step and found no compensator
                assert entry["step_id"] in harness.skippable, f"{entry['step_id']} skipped by a pass that ended early"
                servers = [release for step_id, release in harness.skips if step_id == entry["step_id"]]
                assert servers, f"{entry['step_id']} skipped with no target_not_found reported"
                assert not any(reaches_with_compensator(r, entry["step_id"]) for r in servers), (
                    f"{entry['step_id']} skipped although the release that served the pass reaches its compensator"
                )
    event(f"ended {run.phase}/{run.outcome}/{run.recovery}" + (" blocked" if run.blockers else ""))
    for blocker in run.blockers:
        event(f"blocked by {blocker['type']}")
    for kind in harness.raised:
        event(f"raised {kind}")


@pytest.mark.rfd("F2", "F3", "C1", "C2")
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=plans())
def test_orchestration_faults_never_rerun_a_callback_or_skip_a_compensator(plan: Plan) -> None:
    run_plan(plan)

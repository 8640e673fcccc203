"""Decisions 16, 17 and 23-29 under generated workflows whose code outside ``step.run`` raises.

Hypothesis builds a workflow (steps with and without compensators, flaky callbacks, handled and
uncaught failures) and a fault plan: code around the steps raises before, between and after them, in
``finally`` blocks and at the end, in discovery, forward or compensation passes, a bounded number of
times. Some plans also deploy a second release mid-run that removes a step (or removes and retires it),
drops a compensator, returns early, inserts a new step (which a later release takes out again), stops
opening a step inside a callback, returns less, or drops a guard.

Decisions 23-29's cases: a callback that opens a step inside it; a guard at the top of the function
that returns early once the order is marked cancelled (an external read), so that after a cancel every
compensation pass ends before its target; callbacks that return more than the value limit (over the
server's limit, set small here, or over the SDK's own 256 KiB); callbacks that take virtual time, with
a run deadline that falls while one runs and a deadline timer that fires late; a step id that changes on
every pass. When the run is blocked, an operator does what the blockers say: resolves the attempt a
blocker holds (retry, succeed, fail, skip, with a reason), or deploys the fix. The run goes through the
real engine and SDK (``ryusen.testing``); at every committed write and every callback the checks of
decisions 23-29 (tests/simulation/decisions.py) run, and at the end:

* no callback of a (step, phase, generation) ran twice, and one that ran is never recorded as not run
  (fenced), which is how a second charge used to start;
* every accepted success is in the unwind once recovery has begun;
* ``compensated`` only when every compensator ran, an operator said so, or the pass reached the step and
  its code declares no compensator, or the release retires it;
* the run finished, or carries a blocker that names its remedy.

CI runs 200 examples; a long run is 1,000 (docs/testing.md):
    RYUSEN_ORCHESTRATION_FAULTS=1000 .venv/bin/pytest tests/conformance/test_orchestration_faults.py
"""

from __future__ import annotations

import itertools
import os
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

import ryusen
from ryusen import OmittedResult, RetryPolicy, Ryusen, Step, StepFailed
from ryusen._internal.app import HandlerResponse
from ryusen._internal.wire import MAX_VALUE_BYTES, NESTED_STEP_ERROR, TaskKind, TaskRequest, TaskResponse, value_size
from ryusen.testing import WorkflowEnvironment
from ryusen_server.core.events import EngineSettings
from ryusen_server.core.model import RunState
from ryusen_server.ports import ConflictError, NotFoundError
from tests.simulation.decisions import Answer, Decisions, Ground, held_step_id

EXAMPLES = int(os.environ.get("RYUSEN_ORCHESTRATION_FAULTS", "200"))


def event(text: str) -> None:
    """Hypothesis's statistics, when a plan runs as one of its examples (not in the broken-core tests)."""
    if currently_in_test_context():
        hypothesis_event(text)


PASSES = ("discover", "forward", "compensate")
SERVER_LIMIT = 4096
"""The engine's value limit here: a ``server`` result is over it, an ``sdk`` one over the SDK's 256 KiB."""
BIG = {"server": SERVER_LIMIT + 2048, "sdk": MAX_VALUE_BYTES + 1024}


@dataclass(frozen=True)
class StepSpec:
    id: str
    compensator: bool
    flaky: int
    """Failures of the forward callback before it succeeds; 3 exhausts its 3 attempts."""
    handled: bool
    """A terminal failure is caught by the function (no compensation) rather than escaping."""
    flaky_compensator: int
    nests: bool = False
    """The callback opens a step inside it (decisions 23)."""
    big: str = ""
    """The callback returns more than the limit: ``server`` or ``sdk`` (decisions 25)."""
    slow_s: int = 0
    """Virtual seconds the callback takes (a deadline may pass while it runs: decisions 26)."""
    unstable: bool = False
    """Its id changes on every pass (decisions 29)."""


@dataclass(frozen=True)
class Release:
    version: int
    steps: tuple[StepSpec, ...]
    return_before: str | None = None
    """Current code returns before reaching this step."""
    insert_before: str | None = None
    """Current code runs a new step ``audit`` before this one."""
    guard: bool = False
    """The function starts with ``if the order is cancelled: return`` (an external read)."""
    retired: tuple[str, ...] = ()


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
    """Deliveries before the second release is synced (and the order cancelled, if it is)."""
    cancel: bool = False
    """At the switch the order is marked cancelled and the run cancelled (the guard then ends every pass)."""
    timeout_s: int | None = None
    timer_late_s: int = 0
    operator: tuple[str, ...] = ("retry",)
    """What the operator does with each attempt a blocker holds, round after round."""


PASS_SETS = st.one_of(
    st.just(frozenset({"compensate"})),
    st.just(frozenset({"forward"})),
    st.just(frozenset({"forward", "compensate"})),
    st.sets(st.sampled_from(PASSES), min_size=1).map(frozenset),
)
"""A fault in a discovery pass fails the run at once, so forward and compensation passes are drawn more often."""
CHANGES = [
    "none",
    "none",
    "remove",
    "retire",
    "no_compensator",
    "return_early",
    "insert",
    "unnest",
    "shrink",
    "unguard",
]


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    n = draw(st.integers(min_value=1, max_value=4))
    cases = draw(st.booleans())  # half the plans have decisions 23-29's cases, half the earlier ones alone
    steps = tuple(
        StepSpec(
            id=f"s{i}",
            compensator=draw(st.booleans()) or draw(st.booleans()),
            flaky=draw(st.sampled_from([0, 0, 0, 1, 3])),
            handled=draw(st.booleans()),
            flaky_compensator=draw(st.sampled_from([0, 0, 1, 2])),
            nests=cases and draw(st.sampled_from([False, False, False, True])),
            big=draw(st.sampled_from(["", "", "", "server", "sdk"])) if cases else "",
            slow_s=draw(st.sampled_from([0, 0, 2, 4, 8])) if cases else 0,
            unstable=cases and draw(st.sampled_from([False] * 7 + [True])),
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
    first = Release(1, steps, guard=cases and draw(st.booleans()))
    change = draw(st.sampled_from(CHANGES))
    target = draw(st.sampled_from(steps))
    second: Release | None
    if change in ("remove", "retire"):
        retired = (target.id,) if change == "retire" else ()
        second = Release(2, tuple(s for s in steps if s is not target), guard=first.guard, retired=retired)
    elif change == "no_compensator":
        second = Release(
            2, tuple(replace(s, compensator=False) if s is target else s for s in steps), guard=first.guard
        )
    elif change == "return_early":
        second = Release(2, steps, return_before=target.id, guard=first.guard)
    elif change == "insert":
        second = Release(2, steps, insert_before=target.id, guard=first.guard)
    elif change == "unnest":
        second = Release(2, tuple(replace(s, nests=False) for s in steps), guard=first.guard)
    elif change == "shrink":
        second = Release(2, tuple(replace(s, big="") for s in steps), guard=first.guard)
    elif change == "unguard":
        second = Release(2, steps)
    else:
        second = None
    return Plan(
        first,
        draw(st.booleans()),
        faults,
        second,
        draw(st.integers(min_value=0, max_value=12)),
        cancel=cases and draw(st.booleans()),
        timeout_s=draw(st.sampled_from([None, None, 3, 6, 12, 30])) if cases else None,
        timer_late_s=draw(st.sampled_from([0, 1, 60])),
        operator=tuple(draw(st.lists(st.sampled_from(["retry", "succeed", "fail", "skip"]), min_size=1, max_size=3))),
    )


@dataclass
class Harness:
    """The generated app's world: fault budgets, callback counts, what each pass reported, and what the
    checks of decisions 23-29 compare the engine's state with."""

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
    order_cancelled: bool = False
    ground: Ground = field(default_factory=Ground)
    violations: list[str] = field(default_factory=list)
    checks: Decisions | None = None
    env: WorkflowEnvironment | None = None
    run_id: str | None = None
    serving: Release | None = None
    ids: itertools.count[int] = field(default_factory=itertools.count)
    serving_fix: Release | None = None

    def __post_init__(self) -> None:
        for fault in self.plan.faults:
            for kind in fault.passes:
                key = (fault.point, kind)
                self.faults_left[key] = self.faults_left.get(key, 0) + fault.times
        self.checks = Decisions(self.ground, self.violations.append, unstable_after=EngineSettings().unstable_after)

    def fault(self, point: str) -> None:
        key = (point, self.current_pass)
        if self.faults_left.get(key, 0) > 0:
            self.faults_left[key] -= 1
            self.raised[f"{point.split(':')[0]} in {self.current_pass}"] += 1
            raise TimeoutError(f"orchestration fault at {point} in a {self.current_pass} pass")

    def effect(self, step_id: str, phase: str, generation: int, received: Any = None) -> None:
        """A callback starts: decisions 23 and 25's checks with the durable state at that moment."""
        assert self.env is not None and self.run_id is not None and self.checks is not None
        state = self.env.store.peek(self.run_id)
        assert state is not None
        step = state.step(step_id)
        assert step is not None, f"{step_id} ran, and the run has no such step"
        build = f"v{self.serving.version}" if self.serving is not None else None
        self.checks.effect(state, step, phase, generation, build, received)

    def app(self, release: Release) -> Ryusen:
        app = Ryusen("faults", release_id=f"v{release.version}", build_id=f"v{release.version}")
        harness = self

        def callback(spec: StepSpec, step: Step, step_id: str) -> Any:
            def forward() -> Any:
                op = ryusen.operation()
                harness.executions[(step_id, "forward", op.generation)] += 1
                harness.attempts[(spec.id, "forward")] += 1
                harness.effect(step_id, "forward", op.generation)
                if spec.slow_s:
                    assert harness.env is not None
                    harness.env.advance(timedelta(seconds=spec.slow_s))  # the deadline may pass meanwhile
                if spec.nests:  # refused, and the refusal escapes the callback (decisions 23)
                    step.run(f"{step_id}-receipt", lambda: "sent")
                if harness.attempts[(spec.id, "forward")] <= spec.flaky:
                    raise ConnectionError(f"{spec.id} flaked")
                if spec.big:
                    return {"blob": "x" * BIG[spec.big]}
                return f"{spec.id}-done"

            return forward

        def compensator(spec: StepSpec, step_id: str) -> Any:
            def compensate(result: Any) -> str:
                op = ryusen.operation()
                harness.executions[(step_id, "compensation", op.generation)] += 1
                harness.attempts[(spec.id, "compensation")] += 1
                harness.effect(step_id, "compensation", op.generation, result)
                if harness.attempts[(spec.id, "compensation")] <= spec.flaky_compensator:
                    raise ConnectionError(f"undo {spec.id} flaked")
                harness.compensated.add(step_id)
                return f"undid {result.size if isinstance(result, OmittedResult) else result}"

            return compensate

        def audit() -> str:
            harness.executions[("audit", "forward", ryusen.operation().generation)] += 1
            return "audited"

        @app.function("wf", retired_steps=release.retired)
        def wf(data: Any, step: Step) -> Any:
            if release.guard and harness.order_cancelled:
                return "the order was cancelled"  # an external read: ends compensation passes too
            harness.fault("start")
            for spec in release.steps:
                if spec.id == release.return_before:
                    return "returned early"
                if spec.id == release.insert_before:
                    step.run("audit", audit)
                harness.fault(f"before:{spec.id}")
                step_id = f"{spec.id}-{next(harness.ids)}" if spec.unstable else spec.id
                try:
                    try:
                        step.run(
                            step_id,
                            callback(spec, step, step_id),
                            compensate=compensator(spec, step_id) if spec.compensator else None,
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
            self.serving = release
            try:
                response = env.endpoint(app)(method, headers, body)
            finally:
                self.serving = None
            if response.status == 200 and request.operation is not None and request.step_id is not None:
                outcome = TaskResponse.model_validate_json(response.body).attempt
                if outcome is not None:
                    self.record(request, release, outcome)
                if request.kind is TaskKind.COMPENSATE and outcome is not None and outcome.type == "target_not_found":
                    self.skips.append((request.step_id, release))
                    if outcome.reason != "not_reached":  # only these may become a skip (decisions 24)
                        self.skippable.add(request.step_id)
            return response

        env.invoker.apps[url] = handle

    def record(self, request: TaskRequest, release: Release, outcome: Any) -> None:
        """What the endpoint answered to an attempt, and what the code that answered says about its step."""
        assert request.operation is not None and request.step_id is not None
        base = request.step_id.rsplit("-", 1)[0]  # an unstable id is its step's id and a number
        spec = next((s for s in release.steps if s.id == request.step_id or (s.unstable and s.id == base)), None)
        audit = request.step_id == "audit" and release.insert_before is not None  # called with no compensator
        error = getattr(outcome, "error", None)
        answer = Answer(
            type=outcome.type,
            reason=getattr(outcome, "reason", None),
            omitted=getattr(outcome, "omitted", None) is not None
            or (outcome.type == "succeeded" and value_size(getattr(outcome, "result", None)) > SERVER_LIMIT),
            nested=error is not None and error.type == NESTED_STEP_ERROR,
            build=f"v{release.version}",
            declares_no_compensator=audit or (spec is not None and not spec.compensator),
            retires=request.step_id in release.retired,
        )
        key = (request.run_id, request.step_id, request.operation.phase.value, request.operation.generation)
        self.ground.answers[key].append(answer)
        if answer.omitted:
            event("a callback returned more than the limit")
        if answer.nested:
            event("a callback opened a step inside it")
        if outcome.type == "target_not_found":
            event(f"a {request.kind.value} pass did not find its target ({answer.reason})")

    def watch(self, env: WorkflowEnvironment) -> None:
        """Run the checks of decisions 23-29 at every write the engine commits."""
        store = env.store
        save, create = store.save, store.create
        checks = self.checks
        assert checks is not None

        def saved(state: RunState, *, expected_version: int) -> None:
            save(state, expected_version=expected_version)
            checks.committed(state)

        def created(state: RunState) -> None:
            create(state)
            checks.committed(state)

        store.save = saved  # type: ignore[method-assign]
        store.create = created  # type: ignore[method-assign]

    def operate(self, env: WorkflowEnvironment, run_id: str, round_: int, fix: Release) -> bool:
        """An operator does what the blockers say: resolves each attempt a blocker holds (the plan's action for
        this round, with a reason), or deploys the fix when no blocker names an attempt. False: nothing to do."""
        state = env.store.peek(run_id)
        assert state is not None
        if state.phase.value == "finished" or not state.blockers:
            return False
        action = self.plan.operator[round_ % len(self.plan.operator)]
        acted = False
        for blocker in state.blockers:
            step_id = held_step_id(blocker)
            if step_id is None or blocker.phase is None or blocker.generation is None:
                continue
            if blocker.type.value == "unknown_outcome" and action == "skip":
                continue
            reason = f"round {round_}: {action} {blocker.type.value}"
            key = (run_id, step_id, blocker.phase.value, blocker.generation, action)
            fresh = key not in self.ground.resolved
            self.ground.resolved.add(key)
            self.ground.reasons.add(reason)
            try:
                env.resolve(
                    run_id,
                    step_id,
                    phase=blocker.phase.value,
                    generation=blocker.generation,
                    action=action,
                    result="operator" if action == "succeed" else None,
                    error={"type": "declared_failure", "message": "operator"} if action == "fail" else None,
                    reason=reason,
                )
            except (ConflictError, NotFoundError) as exc:
                if fresh:
                    self.ground.resolved.discard(key)
                event(f"the operator's {action} was refused ({exc.code})")
                continue
            event(f"the operator's {action} of a {blocker.type.value} blocker committed")
            acted = True
        if not acted and state.blocked_by_definition and self.serving_fix is None:
            self.serving_fix = fix
            self.serve(env, fix)
            event("the operator deployed the fix")
            acted = True
        return acted


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


def fixed(plan: Plan) -> Release:
    """The release an operator deploys for a definition blocker: the first code with no step opened inside a
    callback, results within the limit, stable ids and no guard, retiring what it no longer calls."""
    steps = tuple(replace(s, nests=False, big="", unstable=False) for s in plan.first.steps)
    return Release(4, steps, retired=("audit",))


def run_plan(plan: Plan) -> None:
    harness = Harness(plan)
    env = WorkflowEnvironment(
        settings=EngineSettings(
            compensate_retry=RetryPolicy(max_attempts=4, initial_delay=timedelta(seconds=1)).to_wire(),
            redelivery_initial_s=1.0,
            max_value_bytes=SERVER_LIMIT,
        )
    )
    harness.env = env
    harness.watch(env)
    env.timers.fire_late_by = timedelta(seconds=plan.timer_late_s)
    harness.serve(env, plan.first)
    run_id = harness.run_id = env.start("wf", timeout=timedelta(seconds=plan.timeout_s) if plan.timeout_s else None)
    for _ in range(plan.switch_after):
        if not env.step_once():
            break
    if plan.second is not None:
        harness.serve(env, plan.second)
    if plan.cancel:
        harness.order_cancelled = True
        try:
            env.cancel(run_id)
        except ConflictError:
            event("the cancel came after the run ended")
    run = env.wait(run_id, max_transitions=5_000)
    run = probe_past_passes_that_ended_early(env, run_id, run)
    if run.blockers and plan.second is not None and plan.second.insert_before is not None:
        event("blocked by a new step before the target, then fixed")
        harness.serve(env, replace(plan.second, version=3, insert_before=None))
        run = env.wait(run_id, max_transitions=5_000)
    for round_ in range(4):
        if not harness.operate(env, run_id, round_, fixed(plan)):
            break
        run = env.wait(run_id, max_transitions=5_000)

    assert not harness.violations, harness.violations[0]
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
                declared = any(k[1] == entry["step_id"] and k[4] == "succeed" for k in harness.ground.resolved)
                assert entry["step_id"] in harness.compensated or declared, (
                    f"{entry['step_id']} compensated without running"
                )
            else:
                assert entry["status"] == "skipped", entry
                if harness.ground.operator_skipped(run_id, entry["step_id"]):
                    continue
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


# ---- the checks catch a broken engine -------------------------------------------------------------------

S0 = StepSpec(id="s0", compensator=True, flaky=0, handled=False, flaky_compensator=0)
CAUGHT = {
    "D23: a callback that opened a step is retried as an ordinary failure": (
        Plan(Release(1, (replace(S0, nests=True),)), False, (), None, 0),
        "opened a step inside the callback",
    ),
    "D24: a compensation pass that ended before its target records a skip": (
        # s1 flakes once, so the run waits for its retry when the order is cancelled and the run with it
        Plan(Release(1, (S0, replace(S0, id="s1", flaky=1)), guard=True), False, (), None, 1, cancel=True),
        "did not reach it with no compensator",
    ),
    "D25: a callback that returned too much is recorded failed": (
        Plan(Release(1, (replace(S0, big="server"),)), True, (), None, 0),
        "ran and succeeded (its result over the limit), recorded failed",
    ),
    "D26: the deadline is enforced only when its timer fires": (
        Plan(
            Release(1, tuple(replace(S0, id=f"s{i}", slow_s=4) for i in range(3))),
            False,
            (),
            None,
            0,
            timeout_s=6,
            timer_late_s=60,
        ),
        "at or after the deadline",
    ),
}


@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_the_checks_catch_a_broken_core(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each plan passes with the engine as it is, and fails, naming the decision, with the engine broken as the
    simulator breaks it (tests/conformance/test_simulation.py)."""
    from ryusen_server.core import decide as decide_module
    from tests.conformance.test_simulation import BROKEN

    plan, expected = CAUGHT[name]
    run_plan(plan)
    attribute, breaks, _ = BROKEN[name]
    monkeypatch.setattr(decide_module._Transition, attribute, breaks(getattr(decide_module._Transition, attribute)))
    with pytest.raises(AssertionError, match=re.escape(expected)):
        run_plan(plan)

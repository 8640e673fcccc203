"""U8 and O4 under random interleavings: a hypothesis state machine drives the engine (core + store +
queue + SDK) through deliveries, duplicate messages, lost and late results, lease expiries, cancels and
operator resolutions, and checks the invariants after every rule.

The engine chains (its default): a forward attempt's response carries what the replay found next, and
one write accepts it and authorizes the next task, which the same dispatcher invokes. So the machine
also loses just the continuation, lands a cancel or a new release between an endpoint's answer and the
write that accepts it, and delivers a duplicate message for a chained task while it is in flight.

Releases may also bring decisions 23 and 25's cases: ``n`` charges and then opens a step inside the charge
callback, ``x`` ships and returns more than the value limit; an operator may also skip. At every write and
every callback, the checks of decisions 23-29 (tests/simulation/decisions.py) run against what the endpoint
answered.

CI runs a fixed budget; explore longer with
    RYUSEN_INTERLEAVINGS=5000 .venv/bin/pytest tests/conformance/test_interleavings.py
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import ryusen
from ryusen import RetryPolicy, Ryusen, Step
from ryusen._internal.wire import NESTED_STEP_ERROR, MemoEntry, Phase, TaskKind, TaskRequest, TaskResponse, value_size
from ryusen.testing import WorkflowEnvironment
from ryusen_server.core.events import EngineSettings
from ryusen_server.core.model import Attempt, AttemptStatus, RunState, TaskRef
from ryusen_server.core.view import memo
from ryusen_server.invoker import InvokeResult
from ryusen_server.ports import ConflictError
from tests.simulation.decisions import Answer, Decisions, Ground

STEPS = ("reserve", "charge", "ship")
SETTLED = {AttemptStatus.SUCCEEDED, AttemptStatus.FAILED, AttemptStatus.RETRY_AUTHORIZED, AttemptStatus.FENCED}
EXAMPLES = int(os.environ.get("RYUSEN_INTERLEAVINGS", "200"))
VALUE_LIMIT = 4096
"""The engine's value limit here (release ``x`` ships a result over it)."""

Watch = Any
"""Called as a callback starts: (step id, phase, generation, what a compensator received)."""


def build_app(fail_next: Counter[str], executions: Counter[str], variant: str = "a", watch: Watch = None) -> Ryusen:
    """``variant`` b is the same code as a new build; c adds a step ``gift`` between charge and ship; n opens a
    step inside the charge callback (decisions 23); x ships and returns more than the limit (decisions 25)."""
    app = Ryusen("interleave", release_id=f"r-{variant}", build_id=f"b-{variant}")
    opened: list[Step] = []

    def effect(name: str) -> dict[str, str]:
        executions[name] += 1
        if watch is not None:
            watch(name, "forward", ryusen.operation().generation, None)
        if fail_next[name] > 0:
            fail_next[name] -= 1
            raise ConnectionError(f"{name} flaked")
        if name == "charge" and variant == "n":
            opened[-1].run("receipt", lambda: "sent")  # refused; the refusal escapes the callback
        if name == "ship" and variant == "x":
            return {"done": name, "label": "x" * (VALUE_LIMIT + 1024)}
        return {"done": name}

    def undo(name: str) -> Any:
        def compensate(result: Any) -> Any:
            executions[f"undo-{name}"] += 1
            if watch is not None:
                watch(name, "compensation", ryusen.operation().generation, result)
            if fail_next[f"undo-{name}"] > 0:
                fail_next[f"undo-{name}"] -= 1
                raise ConnectionError(f"undo {name} flaked")
            return {"undone": name}

        return compensate

    @app.function("saga")
    def saga(data: Any, step: Step) -> Any:
        opened.append(step)
        for name in STEPS:
            if name == "ship" and variant == "c":
                step.run("gift", effect, "gift", compensate=undo("gift"), retry=RetryPolicy(max_attempts=3))
            step.run(name, effect, name, compensate=undo(name), retry=RetryPolicy(max_attempts=3))
        if data.get("fail"):
            raise RuntimeError("rejected")
        return "ok"

    return app


class Interleavings(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fail_next: Counter[str] = Counter()
        self.executions: Counter[str] = Counter()
        self.ground = Ground()
        self.violations: list[str] = []
        self.checks = Decisions(self.ground, self.violations.append, unstable_after=EngineSettings().unstable_after)
        self.serving: TaskRequest | None = None
        self.apps = [build_app(self.fail_next, self.executions, watch=self.watch)]
        """Every revision the endpoint has served (each keeps its memos)."""
        self.env = WorkflowEnvironment(
            self.apps[0],
            settings=EngineSettings(
                attempt_timeout_s=20, lease_grace_s=5, redelivery_initial_s=1, max_value_bytes=VALUE_LIMIT
            ),
            signing=False,  # lose_next_continuation rewrites what the endpoint answered
        )
        store = self.env.store
        save, create = store.save, store.create

        def saved(state: RunState, *, expected_version: int) -> None:
            save(state, expected_version=expected_version)
            self.checks.committed(state)

        def created(state: RunState) -> None:
            create(state)
            self.checks.committed(state)

        store.save = saved  # type: ignore[method-assign]
        store.create = created  # type: ignore[method-assign]
        self.run_ids = [self.env.start("saga", {"fail": False}), self.env.start("saga", {"fail": True})]
        self.settled: dict[tuple[str, str, str, int], tuple[str, str | None]] = {}
        self.accepted: dict[tuple[str, str], Any] = {}
        self.after_answer: list[str] = []
        """What happens between the next forward answer and the write that accepts it."""
        self.drop_next_continuation = False
        self.duplicate_in_flight = False
        self.authorized_at_stop: dict[str, set[tuple[str, int]]] = {}
        """Per cancelled run: the forward attempts authorized when the stop intent was written."""
        self.after_the_fence: list[str] = []
        self.check_memo_after: list[tuple[TaskRequest, RunState]] = []
        """Requests that named their memo (``memo_cache``), with the run they were built from."""
        self.wrong_memos: list[str] = []
        self.invoke = self.env.invoker.invoke
        self.env.invoker.invoke = self.invoking  # type: ignore[method-assign]

    def invoking(self, url: str, body: bytes, headers: dict[str, str], *, timeout_s: float) -> InvokeResult:
        request = TaskRequest.model_validate_json(body)
        if request.memo_token is not None:
            self.check_memo_after.append((request, self.state(request.run_id)))
        forward = request.kind is TaskKind.FORWARD and request.operation is not None
        if forward and self.duplicate_in_flight and request.operation is not None:
            self.duplicate_in_flight = False
            event("a duplicate message arrived for a task in flight")
            task = TaskRef(
                run_id=request.run_id,
                kind=TaskKind.FORWARD,
                step_id=request.step_id,
                generation=request.operation.generation,
            )
            self.env.engine.deliver(task)  # another dispatcher: the task is someone else's (lease)
        if forward and request.operation is not None and request.run_id in self.authorized_at_stop:
            key = (request.step_id or "", request.operation.generation)
            if key not in self.authorized_at_stop[request.run_id]:
                self.after_the_fence.append(f"{request.run_id} {key} invoked, authorized after the stop intent")
        self.serving = request
        try:
            result = self.invoke(url, body, headers, timeout_s=timeout_s)
        finally:
            self.serving = None
        self.record(request, result)
        self.check_held_memos()
        if not forward or result.kind != "response" or result.body is None:
            return result
        if self.drop_next_continuation:
            self.drop_next_continuation = False
            response = TaskResponse.model_validate_json(result.body)
            if response.next is not None:
                event("a continuation was lost")
                result = InvokeResult(
                    kind="response",
                    status=result.status,
                    headers=result.headers,
                    body=response.model_copy(update={"next": None}).model_dump_json().encode(),
                )
        while self.after_answer:
            what = self.after_answer.pop()
            if what == "cancel":
                event("a cancel raced a chained write")
                self.cancel_run(request.run_id)
            else:
                event("a release changed between a callback and its write")
                self.apps.append(build_app(self.fail_next, self.executions, what, watch=self.watch))
                self.env.sync(self.apps[-1])
        return result

    def watch(self, name: str, phase: str, generation: int, received: Any) -> None:
        """A callback starts: decisions 23 and 25's checks, with the durable state at that moment."""
        request = self.serving
        if request is None:  # pragma: no cover - every callback runs inside a request
            self.violations.append(f"{name} {phase} ran outside a request")
            return
        state = self.state(request.run_id)
        step = state.step(name)
        if step is None:
            self.violations.append(f"{request.run_id}: {name} ran, and the run has no such step")
            return
        self.checks.effect(state, step, phase, generation, self.apps[-1].build_id, received)

    def record(self, request: TaskRequest, result: InvokeResult) -> None:
        """What the endpoint answered to an attempt (the latest release serves every request)."""
        if request.operation is None or request.step_id is None or result.body is None:
            return
        if result.kind != "response" or result.status != 200:
            return
        outcome = TaskResponse.model_validate_json(result.body).attempt
        if outcome is None:
            return
        error = getattr(outcome, "error", None)
        omitted = getattr(outcome, "omitted", None) is not None or (
            outcome.type == "succeeded" and value_size(getattr(outcome, "result", None)) > VALUE_LIMIT
        )
        answer = Answer(
            type=outcome.type,
            reason=getattr(outcome, "reason", None),
            omitted=omitted,
            nested=error is not None and error.type == NESTED_STEP_ERROR,
            build=self.apps[-1].build_id,
        )
        key = (request.run_id, request.step_id, request.operation.phase.value, request.operation.generation)
        self.ground.answers[key].append(answer)
        if answer.nested:
            event("a callback opened a step inside it")
        if answer.omitted:
            event("a callback returned more than the limit")

    # ---- rules --------------------------------------------------------------------

    @rule()
    def deliver(self) -> None:
        self.env.step_once()

    @rule(n=st.integers(min_value=2, max_value=25))
    def deliver_several(self, n: int) -> None:
        for _ in range(n):
            if not self.env.step_once():
                return

    @rule(seconds=st.integers(min_value=1, max_value=60))
    def time_passes(self, seconds: int) -> None:
        self.env.advance(timedelta(seconds=seconds))
        self.env.step_once()

    @rule(on=st.booleans())
    def duplicate_messages(self, on: bool) -> None:
        self.env.faults.duplicate_messages = on

    @rule(callback=st.sampled_from([*STEPS, *(f"undo-{s}" for s in STEPS)]))
    def callback_fails_next(self, callback: str) -> None:
        self.fail_next[callback] += 1

    @rule(step=st.sampled_from([*STEPS, None]), phase=st.sampled_from(["forward", "compensation", None]))
    def lose_next_result(self, step: str | None, phase: str | None) -> None:
        """The next result of ``step`` in ``phase`` is lost (None: of whichever attempt answers next)."""
        self.env.faults.lose_result(step, phase=phase)  # type: ignore[arg-type]

    @rule(step=st.sampled_from(STEPS))
    def crash_before_invoke(self, step: str) -> None:
        self.env.faults.crash_before_invoke(step)

    @rule(which=st.integers(min_value=0, max_value=1), chance=st.integers(min_value=0, max_value=3))
    def cancel(self, which: int, chance: int) -> None:
        if chance:
            return  # cancels are rarer than other events, so runs also get far
        self.cancel_run(self.run_ids[which])

    def cancel_run(self, run_id: str) -> None:
        try:
            self.env.cancel(run_id)
        except ConflictError:  # finished, or already failed: refused without change
            return
        self.authorized_at_stop.setdefault(
            run_id,
            {
                (step.id, a.generation)
                for step in self.state(run_id).steps
                for a in step.attempts
                if a.phase.value == "forward" and a.status is not AttemptStatus.QUEUED
            },
        )

    @rule()
    def lose_next_continuation(self) -> None:
        self.drop_next_continuation = True

    @rule(what=st.sampled_from(["cancel", "a", "b", "c", "n", "x"]))
    def between_answer_and_write(self, what: str) -> None:
        self.after_answer.append(what)

    @rule()
    def duplicate_while_in_flight(self) -> None:
        self.duplicate_in_flight = True

    @rule(keep=st.integers(min_value=0, max_value=2))
    def endpoint_loses_its_memos(self, keep: int) -> None:
        """Another container answers next, or this one was restarted or evicted memos (``memo_cache``)."""
        event("the endpoint lost its memos")
        for app in self.apps:
            app.memo_cache.clear()
            app.memo_cache.entries = keep or 64

    def check_held_memos(self) -> None:
        """Whatever memo an endpoint holds under a token is the whole memo of the request that named it."""
        while self.check_memo_after:
            request, state = self.check_memo_after.pop()
            expected = {k: MemoEntry.model_validate(v) for k, v in memo(state).items()}
            for app in self.apps:
                held = app.memo_cache.held(request.memo_token or "")
                if held is not None and (held[1] != expected or held[0] != state.input):
                    self.wrong_memos.append(f"{request.run_id} {request.kind} {request.step_id}: {held} != {expected}")

    @rule(pick=st.integers(min_value=0, max_value=50))
    def late_result(self, pick: int) -> None:
        held = self.env.faults.held
        if held:
            h = held[pick % len(held)]
            self.env.deliver_late_result(h.run_id, h.step_id, phase=h.phase, generation=h.generation)

    @precondition(lambda self: bool(self.waiting()))
    @rule(pick=st.integers(min_value=0, max_value=50), action=st.sampled_from(["succeed", "fail", "retry"]))
    def resolve_waiting(self, pick: int, action: str) -> None:
        """An attempt that waits for a person (an Unknown, a blocked compensation): its resolution must commit
        unless the rules refuse that action there."""
        waits = self.waiting()
        self.resolve_one_waiting(*waits[pick % len(waits)], action)

    @rule(pick=st.integers(min_value=0, max_value=50), action=st.sampled_from(["succeed", "fail", "retry", "skip"]))
    def resolve_any(self, pick: int, action: str) -> None:
        """Any attempt, which the rules may refuse (refused without change)."""
        candidates = [
            (run_id, step.id, attempt.phase.value, attempt.generation)
            for run_id in self.run_ids
            for step in self.state(run_id).steps
            for attempt in step.attempts
        ]
        if not candidates:
            return
        run_id, step_id, phase, generation = candidates[pick % len(candidates)]
        with contextlib.suppress(ConflictError):
            self.resolve_now(run_id, step_id, phase, generation, action)

    def waiting(self) -> list[tuple[str, str, str, int]]:
        return [
            (run_id, step.id, phase, a.generation)
            for run_id in self.run_ids
            for step in self.state(run_id).steps
            for phase in ("forward", "compensation")
            if (a := self.attempt(run_id, step.id, phase)) is not None and self.waits_for_a_person(run_id, step.id, a)
        ]

    def attempt(self, run_id: str, step_id: str, phase: str) -> Attempt | None:
        step = self.state(run_id).step(step_id)
        return step.current(Phase(phase)) if step is not None else None

    def waits_for_a_person(self, run_id: str, step_id: str, attempt: Attempt) -> bool:
        state = self.state(run_id)
        if attempt.status is AttemptStatus.UNKNOWN:
            return True
        blocked = state.phase.value == "compensating" and state.blocked_by_definition
        entry = state.current_unwind_entry()
        return (
            blocked
            and attempt.phase is Phase.COMPENSATION
            and attempt.status is AttemptStatus.FENCED
            and entry is not None
            and entry.step_id == step_id
        )

    def resolve_one_waiting(self, run_id: str, step_id: str, phase: str, generation: int, action: str) -> None:
        state = self.state(run_id)
        unknown = self.attempt(run_id, step_id, phase)
        assert unknown is not None
        refused = (
            unknown.status is AttemptStatus.UNKNOWN
            and action == "retry"
            and ((phase == "forward" and state.outcome is not None) or state.phase.value == "finished")
        )
        if refused:  # U6: no operator retry of a forward attempt after a stop intent
            with pytest.raises(ConflictError):
                self.resolve_now(run_id, step_id, phase, generation, action)
            RESOLUTIONS["refused"] += 1
            return
        self.resolve_now(run_id, step_id, phase, generation, action)  # a refusal here fails the example
        after = self.state(run_id).step(step_id)
        assert after is not None
        if unknown.status is AttemptStatus.UNKNOWN:
            settled = after.attempt(Phase(phase), generation)
            assert settled is not None
            expected = {"succeed": "succeeded", "fail": "failed", "retry": "retry_authorized"}[action]
            assert settled.status.value == expected, f"resolve {action} of an Unknown left it {settled.status}"
        else:  # a blocked compensation: the operator's outcome (or a retry) is the next generation
            assert after.attempt(Phase(phase), generation + 1) is not None
        event(f"an operator {action} committed")
        RESOLUTIONS[action] += 1

    def resolve_now(self, run_id: str, step_id: str, phase: str, generation: int, action: str) -> None:
        """An operator's resolution, told to the checks of decisions 23-29 (kept only if it commits)."""
        key = (run_id, step_id, phase, generation, action)
        fresh = key not in self.ground.resolved
        self.ground.resolved.add(key)
        self.ground.reasons.add(f"interleavings {action}")
        try:
            self.env.resolve(
                run_id,
                step_id,
                phase=phase,
                generation=generation,
                action=action,
                result={"operator": True} if action == "succeed" else None,
                error={"type": "declared_failure", "message": "operator"} if action == "fail" else None,
                reason=f"interleavings {action}",
            )
        except ConflictError:
            if fresh:
                self.ground.resolved.discard(key)
            raise

    def teardown(self) -> None:
        for run_id in self.run_ids:
            state = self.state(run_id)
            event(f"run ended {state.phase.value}/{state.outcome}/{state.recovery}")
            if any(a.status is AttemptStatus.RETRY_AUTHORIZED for s in state.steps for a in s.attempts):
                event("an operator retry happened")
            if any(a.stale_submissions for s in state.steps for a in s.attempts):
                event("a stale submission was kept")
        # an operator settles what the example left waiting for a person: each resolution must commit
        for i, waiting in enumerate(self.waiting()):
            self.resolve_one_waiting(*waiting, ("retry", "fail", "succeed")[(i + waiting[3]) % 3])
            self.invariants_hold()

    def invariants_hold(self) -> None:
        self.decisions_23_to_29_hold()
        self.no_generation_settles_twice()
        self.accepted_success_is_never_replaced_or_lost()
        self.compensation_waits_for_authorized_effects()
        self.one_live_attempt_per_step_phase()
        self.outcome_is_set_once()

    # ---- invariants ---------------------------------------------------------------

    def state(self, run_id: str) -> RunState:
        state = self.env.store.peek(run_id)
        assert state is not None
        return state

    @invariant()
    def no_generation_settles_twice(self) -> None:
        for run_id in self.run_ids:
            for step in self.state(run_id).steps:
                for a in step.attempts:
                    key = (run_id, step.id, a.phase.value, a.generation)
                    if a.status in SETTLED:
                        seen = (a.status.value, a.settled_at.isoformat() if a.settled_at else None)
                        assert self.settled.setdefault(key, seen) == seen, f"{key} settled twice"
                    else:
                        assert key not in self.settled, f"{key} was settled, now {a.status}"

    @invariant()
    def accepted_success_is_never_replaced_or_lost(self) -> None:
        for run_id in self.run_ids:
            state = self.state(run_id)
            for key, result in self.accepted.items():
                if key[0] == run_id:
                    step = state.step(key[1])
                    assert step is not None and step.status.value == "completed" and step.result == result
            for step in state.steps:
                if step.status.value == "completed":
                    self.accepted.setdefault((run_id, step.id), step.result)

    @invariant()
    def compensation_waits_for_authorized_effects(self) -> None:
        for run_id in self.run_ids:
            state = self.state(run_id)
            compensating = any(a.phase.value == "compensation" for s in state.steps for a in s.attempts)
            if compensating:
                for step in state.steps:
                    forward = [a for a in step.attempts if a.phase.value == "forward"]
                    if forward:
                        assert forward[-1].status not in (AttemptStatus.AUTHORIZED, AttemptStatus.UNKNOWN), (
                            f"compensation began while {step.id} forward #{forward[-1].generation} is {forward[-1].status}"
                        )

    @invariant()
    def decisions_23_to_29_hold(self) -> None:
        """Checked at every write and every callback (tests/simulation/decisions.py); reported here."""
        assert not self.violations, self.violations[0]

    @invariant()
    def an_endpoint_replays_the_memo_the_engine_sent(self) -> None:
        assert not self.wrong_memos, self.wrong_memos

    @invariant()
    def nothing_forward_is_authorized_after_the_stop_intent(self) -> None:
        assert not self.after_the_fence, self.after_the_fence

    @invariant()
    def no_generation_runs_its_callback_twice(self) -> None:
        """Every execution of a callback belongs to an attempt of its own (chaining adds none)."""
        attempts: Counter[str] = Counter()
        for run_id in self.run_ids:
            for step in self.state(run_id).steps:
                for a in step.attempts:
                    attempts[step.id if a.phase.value == "forward" else f"undo-{step.id}"] += 1
        for callback, count in self.executions.items():
            assert count <= attempts[callback], f"{callback} ran {count} times for {attempts[callback]} attempts"

    @invariant()
    def one_live_attempt_per_step_phase(self) -> None:
        for run_id in self.run_ids:
            for step in self.state(run_id).steps:
                for phase in ("forward", "compensation"):
                    live = [
                        a
                        for a in step.attempts
                        if a.phase.value == phase and a.status.value in ("queued", "authorized", "unknown")
                    ]
                    assert len(live) <= 1

    @invariant()
    def outcome_is_set_once(self) -> None:
        for run_id in self.run_ids:
            state = self.state(run_id)
            previous = getattr(self, f"_outcome_{run_id}", None)
            if previous is not None:
                assert state.outcome == previous
            if state.outcome is not None:
                setattr(self, f"_outcome_{run_id}", state.outcome)


RESOLUTIONS: Counter[str] = Counter()
"""Operator resolutions of attempts that waited for a person, across the examples of one test: by action
when they committed, and "refused" when the rules refused them."""


class TestInterleavings(Interleavings.TestCase):  # type: ignore[name-defined,misc]
    settings = settings(
        max_examples=EXAMPLES,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )

    def runTest(self) -> None:
        RESOLUTIONS.clear()
        super().runTest()
        # each example checks the resolutions it made; an engine refusing every one would still pass them all
        # if no example reached one, so the examples together must have committed every kind
        assert all(RESOLUTIONS[action] > 0 for action in ("succeed", "fail", "retry")), RESOLUTIONS

    runTest.is_hypothesis_test = True  # type: ignore[attr-defined]  # --hypothesis-show-statistics reports it


pytest.mark.rfd("U8", "O4")(TestInterleavings)

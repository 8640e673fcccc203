"""Adversarial review of app-signed completions (decision 32: ``Ryusen.complete``, ``Engine.submit_completion``) and
of the core changes for steps declared together (decision 30: ``siblings_reached``, ``beside_live_steps``,
``rejoin_group``, the discovery fence, ``group_census``).

Kept as regression tests: those whose docstrings describe a defect failed on the reviewed commit and pass since
its fixes; the others are attacks that held."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

import ryusen
from ryusen import RetryPolicy, Ryusen, Step
from ryusen._internal.signing import SIGNATURE_HEADER, app_key, sign
from ryusen._internal.wire import (
    NESTED_STEP_ERROR,
    CallbackFailed,
    CallbackSucceeded,
    CompletionPost,
    ConcurrentStepConflict,
    ConflictFound,
    DuplicateStepConflict,
    ErrorInfo,
    FunctionCompleted,
    Occurrence,
    Phase,
    StepPlan,
    StepReached,
    StepsReached,
    TaskKind,
    completion_scope,
    late_result_scope,
)
from ryusen.testing import WorkflowEnvironment
from ryusen_server.core.decide import decide
from ryusen_server.core.events import (
    AttemptReported,
    CompletionReported,
    DiscoveryReported,
    EngineSettings,
    ReleaseRef,
    Resolve,
    StartRun,
    TaskDelivered,
    WakeRequested,
)
from ryusen_server.core.model import AttemptStatus, RunPhase, RunState, StepStatus, TaskRef
from ryusen_server.ports import ServerError

# ---------------------------------------------------------------------------------------------------------------
# helpers: an app with a step completed from outside


def approvals(tokens: list[str], calls: Counter[str], app_id: str = "approvals", *, attempts: int = 1) -> Ryusen:
    app = Ryusen(app_id)

    def ask(order: dict[str, Any]) -> str:
        calls["ask"] += 1
        token = ryusen.operation().completion_token
        assert token is not None
        tokens.append(token)
        return "asked"

    @app.function("expense")
    def expense(order: dict[str, Any], step: Step) -> Any:
        step.run(
            "reserve-budget",
            lambda: calls.update(["reserve"]) or "held",
            compensate=lambda _: calls.update(["release"]),
        )
        decision = step.run(
            "approval",
            ask,
            order,
            completion="external",
            timeout=timedelta(days=2),
            retry=RetryPolicy(max_attempts=attempts, initial_delay=timedelta(seconds=1)),
        )
        if not decision["approved"]:
            raise RuntimeError("expense rejected")
        return step.run("pay", lambda: calls.update(["pay"]) or {"paid": order["amount"]})

    return app


def waiting(env: WorkflowEnvironment, run_id: str) -> bool:
    steps = [s for s in env.get(run_id).steps if s["id"] == "approval"]
    return bool(steps) and steps[0]["attempts"][-1]["status"] == "waiting"


def started_waiting(
    app_id: str = "approvals", **kw: Any
) -> tuple[WorkflowEnvironment, Ryusen, str, list[str], Counter[str]]:
    tokens: list[str] = []
    calls: Counter[str] = Counter()
    app = approvals(tokens, calls, app_id, **kw)
    env = WorkflowEnvironment(app)
    run_id = env.start("expense", {"amount": 40})
    env.drive(until=lambda: waiting(env, run_id))
    return env, app, run_id, tokens, calls


def signed_body(
    env: WorkflowEnvironment,
    post: CompletionPost,
    *,
    signer_app_id: str,
    scope_app_id: str | None = None,
    raw: bytes | None = None,
    path: str = "/v1/results",
    scope_fn: Any = completion_scope,
) -> tuple[bytes, dict[str, str]]:
    key = app_key(env.engine.master_keys()[0], signer_app_id)
    body = raw if raw is not None else post.model_dump_json(exclude_none=True).encode()
    scope = scope_fn(post, path=path, app_id=scope_app_id or signer_app_id)
    headers = {"content-type": "application/json"}
    headers[SIGNATURE_HEADER] = sign(key, scope, body, now=time.time(), nonce=os.urandom(16).hex())
    return body, headers


def post_for(run_id: str, token: str, generation: int = 1, **kw: Any) -> CompletionPost:
    return CompletionPost(run_id=run_id, step_id="approval", phase="forward", generation=generation, token=token, **kw)


def version(env: WorkflowEnvironment, run_id: str) -> int:
    return env.engine.get_run(run_id).version


# ---------------------------------------------------------------------------------------------------------------
# completions: attacks that should be refused with nothing changed


def test_another_apps_key_cannot_complete_a_run_of_this_app() -> None:
    """App B signs (with its own key, for its own app id or the victim's) a completion naming app A's run and A's
    token: refused, nothing changes."""
    env, _app, run_id, tokens, calls = started_waiting()
    before = version(env, run_id)
    post = post_for(run_id, tokens[0], result={"approved": True})
    for scope_app in ("intruder", "approvals"):
        body, headers = signed_body(env, post, signer_app_id="intruder", scope_app_id=scope_app)
        with pytest.raises(ServerError):
            env.engine.submit_completion(body, headers, path="/v1/results")
    assert version(env, run_id) == before and waiting(env, run_id) and calls["pay"] == 0


def test_a_post_naming_the_signers_own_run_cannot_carry_another_runs_token() -> None:
    """An app signs a completion for a run of its own but carries a token for another run (of its own app): the
    binding check refuses it; neither run changes."""
    tokens: list[str] = []
    calls: Counter[str] = Counter()
    app = approvals(tokens, calls)
    env = WorkflowEnvironment(app)
    r1 = env.start("expense", {"amount": 1})
    r2 = env.start("expense", {"amount": 2})
    env.drive(until=lambda: waiting(env, r1) and waiting(env, r2))
    t1 = next(t for t in tokens if r1 in json.dumps(env.engine.read_completion_token(t)))
    v1, v2 = version(env, r1), version(env, r2)
    post = CompletionPost(
        run_id=r2, step_id="approval", phase="forward", generation=1, token=t1, result={"approved": True}
    )
    body, headers = signed_body(env, post, signer_app_id="approvals")
    with pytest.raises(ServerError):
        env.engine.submit_completion(body, headers, path="/v1/results")
    assert (version(env, r1), version(env, r2)) == (v1, v2)


def test_a_late_result_or_heartbeat_signature_does_not_stand_for_a_completion() -> None:
    """A completion body signed with the late result's scope (no ``completion`` mark): refused."""
    env, _app, run_id, tokens, _calls = started_waiting()
    before = version(env, run_id)
    post = post_for(run_id, tokens[0], result={"approved": True})
    body, headers = signed_body(env, post, signer_app_id="approvals", scope_fn=late_result_scope)
    with pytest.raises(ServerError):
        env.engine.submit_completion(body, headers, path="/v1/results")
    assert version(env, run_id) == before


def test_a_signed_completion_altered_after_signing_is_refused() -> None:
    """The body is changed (another result) after it was signed: refused."""
    env, _app, run_id, tokens, _calls = started_waiting()
    before = version(env, run_id)
    post = post_for(run_id, tokens[0], result={"approved": False})
    _, headers = signed_body(env, post, signer_app_id="approvals")
    forged = post_for(run_id, tokens[0], result={"approved": True}).model_dump_json(exclude_none=True).encode()
    with pytest.raises(ServerError):
        env.engine.submit_completion(forged, headers, path="/v1/results")
    assert version(env, run_id) == before


def test_a_replayed_signed_completion_for_an_old_generation_is_refused_after_a_retry() -> None:
    """A signed completion for generation 1, replayed after the timeout retried the step (generation 2 waits): not
    taken; the new token's attempt still waits."""
    env, _app, run_id, tokens, calls = started_waiting(attempts=2)
    post = post_for(run_id, tokens[0], result={"approved": True})
    body, headers = signed_body(env, post, signer_app_id="approvals")
    env.advance(timedelta(days=2, hours=1))
    env.drive(until=lambda: len(tokens) == 2 and waiting(env, run_id))
    with pytest.raises(ServerError) as refused:
        env.engine.submit_completion(body, headers, path="/v1/results")
    assert refused.value.details.get("code") == "completion_refused" or refused.value.status in (404, 409)
    assert waiting(env, run_id) and calls["pay"] == 0


def test_a_token_with_a_forged_mac_signed_by_the_app_is_not_found() -> None:
    """The app signs a post whose token names the right attempt but whose MAC is not the deployment's (a token of
    another deployment, or a made-up one): 404 completion_not_found, nothing changes."""
    env, _app, run_id, tokens, _calls = started_waiting()
    before = version(env, run_id)
    prefix, named, _mac = tokens[0].split(".")
    forged = f"{prefix}.{named}.{'A' * 43}"
    post = post_for(run_id, forged, result={"approved": True})
    body, headers = signed_body(env, post, signer_app_id="approvals")
    with pytest.raises(ServerError) as refused:
        env.engine.submit_completion(body, headers, path="/v1/results")
    assert refused.value.status == 404
    assert version(env, run_id) == before


def test_a_token_of_another_deployment_for_the_same_run_id_is_not_found() -> None:
    """Two deployments (environments) each hold a run with the same id; a token from one is refused by the other."""
    _env1, _a1, run1, tokens1, _c1 = started_waiting()
    env2, app2, run2, _tokens2, _c2 = started_waiting()
    if run1 != run2:
        # rewrite the other deployment's token to name this run: its MAC (made with the other run's secret) fails
        prefix, _named, mac = tokens1[0].split(".")
        _p, named2, _m = _tokens2[0].split(".")
        token = f"{prefix}.{named2}.{mac}"
    else:
        token = tokens1[0]
    before = version(env2, run2)
    with pytest.raises(ryusen.CompletionError) as refused:
        app2.complete(token, {"approved": True})
    assert refused.value.code == "completion_not_found"
    assert version(env2, run2) == before


def test_oversized_and_malformed_completion_bodies_are_refused_before_anything_is_read() -> None:
    env, _app, run_id, tokens, _calls = started_waiting()
    before = version(env, run_id)
    huge = post_for(run_id, tokens[0], result="x" * (8 * 1024 * 1024))
    body, headers = signed_body(env, huge, signer_app_id="approvals")
    with pytest.raises(ServerError) as too_large:
        env.engine.submit_completion(body, headers, path="/v1/results")
    assert too_large.value.status == 413
    for raw in (b"{", b'{"kind":"completion"}', b"[]", b'{"kind":"completion","run_id":"' + b"r" * 5000 + b'"}'):
        small = post_for(run_id, tokens[0], result=1)
        _b, h = signed_body(env, small, signer_app_id="approvals", raw=raw)
        with pytest.raises(ServerError):
            env.engine.submit_completion(raw, h, path="/v1/results")
    assert version(env, run_id) == before


def test_a_completion_for_a_step_not_completed_from_outside_is_refused() -> None:
    """The app signs a completion naming ``reserve-budget`` (an ordinary step) with a token minted for it (as the
    engine would for that attempt): refused, the step is not completed by it."""
    env, _app, run_id, _tokens, _calls = started_waiting()
    state = env.store.get(run_id)
    assert state is not None
    token = (
        env.engine.completion_token(state, "reserve-budget", Phase.FORWARD, 1)
        if hasattr(env.engine, "completion_token")
        else None
    )
    if token is None:
        pytest.skip("no public way to mint a token here")
    before = version(env, run_id)
    post = CompletionPost(run_id=run_id, step_id="reserve-budget", phase="forward", generation=1, token=token,
                          result="forged")  # fmt: skip
    body, headers = signed_body(env, post, signer_app_id="approvals")
    with pytest.raises(ServerError):
        env.engine.submit_completion(body, headers, path="/v1/results")
    assert env.get(run_id).step("reserve-budget")["result"] == "held"
    assert version(env, run_id) >= before


# ---------------------------------------------------------------------------------------------------------------
# completions: defects


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), datetime(2030, 1, 1, tzinfo=UTC), b"raw", {1, 2}],
    ids=["nan", "inf", "datetime", "bytes", "set"],
)
def test_app_complete_refuses_a_result_that_is_not_json_instead_of_recording_another_value(value: Any) -> None:
    """Found in review, fixed. ``app.complete(token, float("nan"))`` (or a datetime, bytes, a set) is serialized by pydantic's
    ``model_dump_json`` in ``Ryusen.complete`` / ``WorkflowEnvironment._app_completion`` before the server's
    ``json_value_problem`` check sees it: NaN/Infinity become ``null``, a datetime or bytes a string, a set a list.
    The step then completes with a value the app never passed (an approval recorded as ``None``).

    Expected: refused (``CompletionError`` ``invalid_value``, as the late-result path and the value checks refuse
    non-JSON values), and the step still waits."""
    env, app, run_id, tokens, _calls = started_waiting()
    with pytest.raises((ryusen.CompletionError, ValueError, TypeError)):
        app.complete(tokens[0], value)
    assert waiting(env, run_id), f"the step was completed with {env.get(run_id).step('approval')['result']!r}"


def test_a_signed_completions_error_data_that_is_not_json_is_refused() -> None:
    """Found in review, fixed. ``Engine.submit_completion`` checks ``json_value_problem`` on the result only; an ``error`` whose
    ``data`` holds NaN (the JSON parser takes ``NaN``) is recorded on the run. The late-result path
    (``_values_problem``) checks an error's data too.

    Expected: ``invalid_value``, nothing recorded."""
    env, _app, run_id, tokens, _calls = started_waiting()
    before = version(env, run_id)
    post = post_for(run_id, tokens[0], error=ErrorInfo(type="Rejected", message="no", retryable=False, data={"x": 1}))
    raw = post.model_dump_json(exclude_none=True).replace('"x":1', '"x":NaN').encode()
    _b, headers = signed_body(env, post, signer_app_id="approvals", raw=raw)
    with pytest.raises(ServerError):
        env.engine.submit_completion(raw, headers, path="/v1/results")
    assert version(env, run_id) == before and waiting(env, run_id)


def test_a_completion_cannot_forge_the_engines_nested_step_conflict() -> None:
    """Found in review, fixed. Whoever holds a completion token (an approver's link, a webhook caller) may fail the attempt; but an
    error of the engine's reserved type ``NESTED_STEP_ERROR`` (``concurrent_step``) carrying a
    ``ConcurrentStepConflict`` and a build id in its data is taken through ``completion_reported`` ->
    ``attempt_reported`` -> ``forward_outcome`` -> ``nested_step_conflict`` exactly like an SDK's report of a callback
    that opened a step inside it (decisions 23): the attempt is recorded as "the callback ran and opened a step; no
    retry is spent", and with the current build id the attempt is *held* and the run blocks on a definition blocker
    that blames the code (only an operator or another build moves it on).

    Expected: a completion's error is the attempt's ordinary failure (here ``retryable: False``: the step fails and
    the run compensates, releasing the budget), or the reserved type is refused; never a definition blocker."""
    env, app, run_id, tokens, calls = started_waiting()
    build_id = env.get(run_id).attempts("approval")[0]["build_id"]
    opened = ConcurrentStepConflict(first=Occurrence(step_id="approval"), second=Occurrence(step_id="ghost"))
    forged = {"type": NESTED_STEP_ERROR, "message": "opened a step", "retryable": False,
              "data": {**opened.model_dump(mode="json"), "build_id": build_id}}  # fmt: skip
    try:
        app.complete(tokens[0], error=forged)
    except ryusen.CompletionError:
        assert waiting(env, run_id)  # refused: fine
        return
    env.drive(horizon=timedelta(minutes=5))
    view = env.get(run_id)
    assert not view.blockers, f"a completion made the run blocked: {[b['type'] for b in view.blockers]}"
    assert view.phase == "finished" and calls["release"] == 1  # the rejected expense's budget is released


def test_a_forged_nested_step_error_from_another_build_reruns_the_callback_without_spending_a_retry() -> None:
    """Found in review (same root as above), fixed. With a build id other than the current one, the forged ``concurrent_step``
    error makes the engine run the callback again at once (a new generation, a new token, another approval email)
    although the completer said ``retryable: False`` and the step allows one attempt: no retry is spent, so a token
    holder can make the callback run again and again.

    Expected: ``retryable: False`` with ``max_attempts=1`` fails the step; the callback runs once."""
    env, app, _run_id, tokens, calls = started_waiting()
    opened = ConcurrentStepConflict(first=Occurrence(step_id="approval"), second=Occurrence(step_id="ghost"))
    forged = {"type": NESTED_STEP_ERROR, "message": "opened a step", "retryable": False,
              "data": {**opened.model_dump(mode="json"), "build_id": "another-build"}}  # fmt: skip
    with pytest.raises(ryusen.CompletionError) if False else _nothing():
        app.complete(tokens[0], error=forged)
    env.drive(horizon=timedelta(minutes=5))
    assert calls["ask"] == 1, f"the callback ran {calls['ask']} times for a step with max_attempts=1"


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return isinstance(exc[1], ryusen.CompletionError)  # a refusal is fine too


# ---------------------------------------------------------------------------------------------------------------
# steps declared together: the pure core

NOW = datetime(2030, 1, 1, tzinfo=UTC)
SETTINGS = EngineSettings()
RELEASE = ReleaseRef(release_id="r1", build_id="b1")
RELEASE2 = ReleaseRef(release_id="r2", build_id="b2")


def apply(state: RunState | None, event: object, now: datetime = NOW) -> RunState:
    return decide(state, event, now=now, settings=SETTINGS).state  # type: ignore[arg-type]


def started(plans: list[StepPlan], max_parallel: int) -> RunState:
    state = apply(None, StartRun(run_id="run1", app_id="a", function_id="f", input=1))
    state = apply(state, TaskDelivered(task=TaskRef(run_id="run1", kind=TaskKind.DISCOVER, seq=1), release=RELEASE))
    return apply(state, DiscoveryReported(seq=1, response=StepsReached(steps=plans, max_parallel=max_parallel)))


def deliver(state: RunState, step_id: str, generation: int = 1, release: ReleaseRef = RELEASE) -> RunState:
    task = TaskRef(run_id="run1", kind=TaskKind.FORWARD, step_id=step_id, generation=generation)
    return apply(state, TaskDelivered(task=task, release=release))


def report(state: RunState, step_id: str, response: Any, generation: int = 1) -> RunState:
    return apply(state, AttemptReported(step_id=step_id, phase=Phase.FORWARD, generation=generation,
                                        response=response))  # fmt: skip


def forward(state: RunState, step_id: str) -> list[AttemptStatus]:
    step = state.step(step_id)
    assert step is not None
    return [a.status for a in step.attempts if a.phase is Phase.FORWARD]


def live(state: RunState) -> list[str]:
    return [s.id for s in state.steps if (c := s.current(Phase.FORWARD)) is not None and c.status in (
        AttemptStatus.QUEUED, AttemptStatus.AUTHORIZED, AttemptStatus.UNKNOWN)]  # fmt: skip


def duplicate_conflict() -> ConflictFound:
    return ConflictFound(conflict=DuplicateStepConflict(step_id="x", first=Occurrence(location="f.py:1"),
                                                        duplicate=Occurrence()))  # fmt: skip


def repair_pass(state: RunState, release: ReleaseRef = RELEASE2) -> tuple[RunState, int]:
    state = apply(state, WakeRequested(source="release_sync"))
    assert state.discovery is not None
    seq = state.discovery.seq
    state = apply(state, TaskDelivered(task=TaskRef(run_id="run1", kind=TaskKind.DISCOVER, seq=seq), release=release))
    assert state.discovery is not None and state.discovery.status is AttemptStatus.AUTHORIZED
    return state, seq


def test_external_siblings_completed_from_outside_settle_the_group_and_queue_its_discovery() -> None:
    """Two external siblings wait; completions settle each; the discovery after the group is queued once both have."""
    state = started([StepPlan(id="a", completion="external"), StepPlan(id="b", completion="external")], 2)
    state = deliver(deliver(state, "a"), "b")
    state = report(report(state, "a", CallbackSucceeded(result="asked")), "b", CallbackSucceeded(result="asked"))
    assert forward(state, "a") == [AttemptStatus.AUTHORIZED] and state.discovery is None
    state = apply(state, CompletionReported(step_id="a", phase=Phase.FORWARD, generation=1, result=1))
    assert state.discovery is None
    state = apply(state, CompletionReported(step_id="b", phase=Phase.FORWARD, generation=1, result=2))
    assert state.discovery is not None and state.group is None


def test_a_repair_pass_that_completes_the_function_does_not_finish_the_run_under_a_sibling_in_flight() -> None:
    """Found in review, fixed. A sibling (a) meets a definition conflict while b is in flight; a wake's repair pass runs at once
    beside b (the fence lets a repair through). The new release no longer calls these steps and the pass returns
    ``FunctionCompleted``: ``discovered`` finishes the run (``finish`` clears the group) with b's attempt still
    authorized. b's effect then runs for a run that is already completed: its success is never compensated should
    it be wrong, its failure is never seen by the function (P3/P4: siblings in flight settle and are recorded).

    Expected: the run does not finish while a step of it is in flight (the pass's outcome waits for b, or the
    pass is asked again after b settles)."""
    state = started([StepPlan(id="a"), StepPlan(id="b", has_compensation=True)], 2)
    state = deliver(deliver(state, "a"), "b")
    state = report(state, "a", duplicate_conflict())
    assert state.blocked_by_definition and forward(state, "b") == [AttemptStatus.AUTHORIZED]
    state, seq = repair_pass(state)
    state = apply(state, DiscoveryReported(seq=seq, response=FunctionCompleted(output="done")))
    assert not (state.phase is RunPhase.FINISHED and "b" in live(state)), "finished with b in flight"


def test_a_repair_pass_that_reaches_a_completed_step_beside_a_sibling_in_flight_does_not_stall() -> None:
    """A repair pass beside sibling b reports (alone) a step that has completed meanwhile: the group made of b ends
    when b settles and queues its discovery (no stall)."""
    state = started([StepPlan(id="a"), StepPlan(id="b")], 2)
    state = deliver(deliver(state, "a"), "b")
    state = report(state, "a", duplicate_conflict())
    state, seq = repair_pass(state)
    state = apply(state, DiscoveryReported(seq=seq, response=StepReached(step=StepPlan(id="b"))))
    assert forward(state, "b") == [AttemptStatus.AUTHORIZED]
    state = report(state, "b", CallbackSucceeded(result=2))
    assert state.discovery is not None, "nothing queued after the group: the run stalls"


def test_max_parallel_holds_when_a_repair_pass_declares_fewer_slots_than_steps_in_flight() -> None:
    """Group [a, b, c] at max_parallel 3, all in flight; a conflicts; a repair pass declares [a, n] at max_parallel
    1. b and c (in flight) join; neither a nor n may start until in flight < 1."""
    state = started([StepPlan(id="a"), StepPlan(id="b"), StepPlan(id="c")], 3)
    state = deliver(deliver(deliver(state, "a"), "b"), "c")
    state = report(state, "a", duplicate_conflict())
    state, seq = repair_pass(state)
    state = apply(state, DiscoveryReported(seq=seq, response=StepsReached(steps=[StepPlan(id="a"), StepPlan(id="n")],
                                                                          max_parallel=1)))  # fmt: skip
    assert set(live(state)) == {"b", "c"}, live(state)
    state = report(state, "b", CallbackSucceeded(result=2))
    assert set(live(state)) == {"c"}
    state = report(state, "c", CallbackSucceeded(result=3))
    assert set(live(state)) == {"a"}
    state = deliver(state, "a", generation=2, release=RELEASE2)
    state = report(state, "a", CallbackSucceeded(result=1), generation=2)
    assert set(live(state)) == {"n"}


def test_an_operators_retry_of_a_held_sibling_from_an_older_group_runs_inside_a_group() -> None:
    """Found in review, fixed. Sibling a (group 1) is held (its callback opened a step); b is in flight. A repair pass
    with a new release reports only ``c`` (a renamed): c joins b in a new group (group 2, max_parallel 1). An
    operator then retries a's held attempt. ``rejoin_group`` returns early (``s.group != step.group``), so a's retry
    runs outside any group: beside b while the group allows one at a time, and uncounted by the discovery fence,
    so the discovery after group 2 may run (and the function finish) while a's retry is in flight.

    Expected: a's retry counts against the running group (an operator's retry starts at once, even past
    max_parallel), and no discovery is authorized while it is in flight."""
    state = started([StepPlan(id="a"), StepPlan(id="b")], 2)
    state = deliver(deliver(state, "a"), "b")
    opened = ConcurrentStepConflict(first=Occurrence(step_id="a"), second=Occurrence(step_id="inner"))
    nested = ErrorInfo(type=NESTED_STEP_ERROR, message="opened a step", data={**opened.model_dump(), "build_id": "b1"})
    state = report(state, "a", CallbackFailed(error=nested))
    assert state.blocked_by_definition
    state, seq = repair_pass(state)
    state = apply(state, DiscoveryReported(seq=seq, response=StepReached(step=StepPlan(id="c"))))
    assert forward(state, "b") == [AttemptStatus.AUTHORIZED] and forward(state, "c") == []  # c waits for b
    state = apply(state, Resolve(step_id="a", phase=Phase.FORWARD, generation=1, action="retry", reason="r", by="o"))
    state = deliver(state, "a", generation=2, release=RELEASE2)
    violations = []
    # an operator's retry is consent to run it now: it starts at once, beside b, and counts in the running group
    # (no new sibling starts while it runs), which the discovery after the group waits for
    assert forward(state, "a")[-1] is AttemptStatus.AUTHORIZED and state.step("a").group == state.group  # type: ignore[union-attr]
    state = report(state, "b", CallbackSucceeded(result=2))
    if forward(state, "c") == [AttemptStatus.QUEUED]:
        state = report(deliver(state, "c", release=RELEASE2), "c", CallbackSucceeded(result=3))
    if state.discovery is not None and state.discovery.status is AttemptStatus.QUEUED:
        seq = state.discovery.seq
        task = TaskRef(run_id="run1", kind=TaskKind.DISCOVER, seq=seq)
        state = apply(state, TaskDelivered(task=task, release=RELEASE2))
        if state.discovery is not None and state.discovery.status is AttemptStatus.AUTHORIZED and "a" in live(state):
            violations.append("the discovery after the group authorized while a's retry is in flight")
            state = apply(state, DiscoveryReported(seq=seq, response=FunctionCompleted(output="done")))
            if state.phase is RunPhase.FINISHED and "a" in live(state):
                violations.append("the run finished with a's retry in flight")
    assert not violations, violations


def held_a_beside_completed_b() -> RunState:
    """Siblings a and b: b completed; a's callback opened a step, so a is held (the run blocked on it)."""
    state = started([StepPlan(id="a"), StepPlan(id="b")], 2)
    state = deliver(deliver(state, "a"), "b")
    state = report(state, "b", CallbackSucceeded(result=2))
    opened = ConcurrentStepConflict(first=Occurrence(step_id="a"), second=Occurrence(step_id="inner"))
    nested = ErrorInfo(type=NESTED_STEP_ERROR, message="opened a step", data={**opened.model_dump(), "build_id": "b1"})
    state = report(state, "a", CallbackFailed(error=nested))
    assert state.blocked_by_definition
    return state


def test_a_held_sibling_retried_while_no_group_runs_then_the_group_ends_and_queues_its_discovery() -> None:
    """rejoin_group with no group running: a held sibling's retry reopens its group; its settlement ends the group
    and queues the discovery (no stall); nothing else starts beside it."""
    state = held_a_beside_completed_b()
    state = apply(state, Resolve(step_id="a", phase=Phase.FORWARD, generation=1, action="retry", reason="r", by="o"))
    assert live(state) == ["a"] and state.group is not None
    state = deliver(state, "a", generation=2)
    state = report(state, "a", CallbackSucceeded(result=1), generation=2)
    assert state.discovery is not None and state.group is None


def test_a_discovery_fenced_by_a_group_whose_sibling_goes_unknown_resumes_after_the_operator_resolves_it() -> None:
    """A discovery delivered while a sibling is in flight is fenced; the sibling's lease lapses (Unknown); the
    operator declares it failed: the group ends and its discovery is queued (not fenced forever)."""
    state = started([StepPlan(id="a"), StepPlan(id="b")], 2)
    state = deliver(deliver(state, "a"), "b")
    state = report(state, "a", CallbackSucceeded(result=1))
    assert state.discovery is None
    later = NOW + timedelta(hours=2)
    task = TaskRef(run_id="run1", kind=TaskKind.FORWARD, step_id="b", generation=1)
    state = apply(state, TaskDelivered(task=task, release=RELEASE), now=later)
    b = state.step("b")
    assert b is not None
    if b.current(Phase.FORWARD).status is not AttemptStatus.UNKNOWN:  # type: ignore[union-attr]
        pytest.skip("the lease did not lapse this way")
    final = ErrorInfo(type="declared_failure", message="no", retryable=False)
    state = apply(state, Resolve(step_id="b", phase=Phase.FORWARD, generation=1, action="fail", reason="r", by="o",
                                 error=final), now=later)  # fmt: skip
    assert state.discovery is not None and state.group is None
    assert state.step("b").status is StepStatus.FAILED  # type: ignore[union-attr]

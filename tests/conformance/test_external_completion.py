"""Steps completed from outside (decision 32): ``completion="external"``. The callback runs once per attempt and
hands out the attempt's completion token; the step waits (``waiting``, not Unknown) for its result, which comes
with the token; a completion is fenced like a late result; the step's timeout fails the attempt and a retry
hands out a new token; a stop fences a waiting step."""

from __future__ import annotations

import os
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

import ryusen
from ryusen import RetryPolicy, Ryusen, Step
from ryusen.testing import ConflictError, WorkflowEnvironment
from ryusen_server.ports import NotFoundError


def approvals(tokens: list[str], calls: Counter[str], *, attempts: int = 1) -> Ryusen:
    app = Ryusen("approvals")

    def ask(order: dict[str, Any]) -> str:
        calls["ask"] += 1
        token = ryusen.operation().completion_token
        assert token is not None
        tokens.append(token)  # an approval link in an email, say
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


@pytest.mark.rfd("X1")
def test_a_step_waits_until_completed_from_outside_and_its_result_is_memoized() -> None:
    tokens: list[str] = []
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(approvals(tokens, calls))
    run_id = env.start("expense", {"amount": 40})
    env.drive(until=lambda: waiting(env, run_id))
    view = env.get(run_id)
    [attempt] = view.attempts("approval")
    assert attempt["status"] == "waiting" and attempt["waiting_since"] and not view.blockers  # not Unknown
    env.advance(timedelta(hours=20))
    env.drive(horizon=timedelta(hours=1))
    assert env.get(run_id).phase == "running" and calls["pay"] == 0  # still waiting, nothing polled meanwhile
    env.complete(tokens[0], {"approved": True, "by": "maria"})
    run = env.wait(run_id)
    assert run.outcome == "completed" and run.output == {"paid": 40}
    assert run.step("approval")["result"] == {"approved": True, "by": "maria"}  # the completion, not "asked"
    assert calls == Counter({"reserve": 1, "ask": 1, "pay": 1})  # the callback ran once; replays used the memo
    with pytest.raises(ConflictError) as again:
        env.complete(tokens[0], {"approved": False})
    assert again.value.details.get("code") == "completion_refused"
    assert env.get(run_id).step("approval")["result"] == {"approved": True, "by": "maria"}


@pytest.mark.rfd("X2", "X3")
def test_the_timeout_fails_the_attempt_a_retry_hands_out_a_new_token_and_the_old_one_is_refused() -> None:
    tokens: list[str] = []
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(approvals(tokens, calls, attempts=2))
    run_id = env.start("expense", {"amount": 40})
    env.drive(until=lambda: waiting(env, run_id))
    env.advance(timedelta(days=2, minutes=1))
    env.drive(until=lambda: len(tokens) == 2 and waiting(env, run_id))
    first, second = env.get(run_id).attempts("approval")
    assert first["status"] == "failed" and first["error"]["type"] == "completion_timeout"
    assert second["status"] == "waiting" and tokens[0] != tokens[1]
    with pytest.raises(ConflictError) as stale:
        env.complete(tokens[0], {"approved": True})  # the old generation's token
    assert stale.value.details.get("code") == "completion_refused"
    [kept] = env.get(run_id).attempts("approval")[0]["stale_submissions"]
    assert kept["source"] == "completion" and kept["outcome"]["result"] == {"approved": True}
    forged = tokens[1][:-4] + ("AAAA" if not tokens[1].endswith("AAAA") else "BBBB")
    with pytest.raises(NotFoundError):
        env.complete(forged, {"approved": True})  # a token this deployment did not make
    env.complete(tokens[1], {"approved": True})
    assert env.wait(run_id).output == {"paid": 40}


@pytest.mark.rfd("X3")
def test_with_no_retry_left_the_timeout_fails_the_step_and_the_run_compensates() -> None:
    tokens: list[str] = []
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(approvals(tokens, calls))
    run_id = env.start("expense", {"amount": 40})
    env.drive(until=lambda: waiting(env, run_id))
    env.advance(timedelta(days=3))
    run = env.wait(run_id)
    assert run.summary == "failed, fully compensated" and calls["release"] == 1
    assert run.step("approval")["error"]["type"] == "completion_timeout"


@pytest.mark.rfd("X4")
def test_a_stop_fences_a_waiting_step_and_no_completion_is_taken_after() -> None:
    tokens: list[str] = []
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(approvals(tokens, calls))
    run_id = env.start("expense", {"amount": 40})
    env.drive(until=lambda: waiting(env, run_id))
    env.cancel(run_id)
    run = env.wait(run_id)
    assert run.summary == "cancelled, fully compensated" and calls["release"] == 1
    approval = run.step("approval")
    assert approval["status"] == "fenced" and approval["attempts"][-1]["status"] == "fenced"
    assert [u["step_id"] for u in run["unwind"]] == ["reserve-budget"]
    with pytest.raises(ConflictError):
        env.complete(tokens[0], {"approved": True})
    assert calls["pay"] == 0


def test_a_completion_can_fail_the_step_for_good() -> None:
    tokens: list[str] = []
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(approvals(tokens, calls, attempts=3))
    run_id = env.start("expense", {"amount": 40})
    env.drive(until=lambda: waiting(env, run_id))
    env.complete(tokens[0], error={"type": "Rejected", "message": "over budget", "retryable": False})
    run = env.wait(run_id)
    assert run.summary == "failed, fully compensated" and len(tokens) == 1  # no retry: it was final
    assert run.step("approval")["error"]["message"] == "over budget"


def test_a_fast_completion_before_the_callback_returns_is_taken() -> None:
    """The approver may click before the callback has even returned: the completion settles the attempt, and
    the callback's own answer, arriving after, changes nothing."""
    app = Ryusen("approvals")
    env: WorkflowEnvironment

    @app.function("quick")
    def quick(order: Any, step: Step) -> Any:
        def ask() -> str:
            token = ryusen.operation().completion_token
            assert token is not None
            env.complete(token, {"approved": True})  # completed from inside the callback's own time
            return "asked"

        return step.run("approval", ask, completion="external", timeout=timedelta(hours=1))

    env = WorkflowEnvironment(app)
    run = env.run("quick", {})
    assert run.outcome == "completed" and run.output == {"approved": True}
    [attempt] = run.attempts("approval")
    assert attempt["status"] == "succeeded" and attempt["stale_submissions"][0]["reason"]


@pytest.mark.rfd("X3")
def test_a_late_answer_after_the_attempt_went_unknown_waits_and_its_timeout_still_fails_it() -> None:
    """Found by the simulator: the callback's answer was lost, the attempt went Unknown, then the answer came
    late. The callback handed out its token, so the attempt waits, and its timeout is watched: without that it
    stayed Unknown with no blocker, and nothing would ever move it."""
    tokens: list[str] = []
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(approvals(tokens, calls, attempts=2))
    env.faults.lose_result("approval")
    run_id = env.start("expense", {"amount": 40})
    env.drive(stop_when_blocked=run_id)
    assert env.get(run_id).attempts("approval")[0]["status"] == "unknown"
    env.deliver_late_result(run_id, "approval")
    env.drive(horizon=timedelta(minutes=1))
    view = env.get(run_id)
    assert view.attempts("approval")[0]["status"] == "waiting" and not view.blockers
    env.advance(timedelta(days=2, minutes=1))
    env.drive(until=lambda: len(env.get(run_id).attempts("approval")) == 2)
    first = env.get(run_id).attempts("approval")[0]
    assert first["status"] == "failed" and first["error"]["type"] == "completion_timeout"
    assert first["unknown"] is not None  # its Unknown stays in its history
    env.drive(until=lambda: env.get(run_id).attempts("approval")[-1]["status"] == "waiting")
    env.complete(tokens[-1], {"approved": True})
    assert env.wait(run_id).output == {"paid": 40}


def test_the_example_shops_refund_over_its_limit_waits_for_an_approval(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "shop.py"
    spec = importlib.util.spec_from_file_location("shop_for_completions", path)
    assert spec is not None and spec.loader is not None
    shop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shop)
    env = WorkflowEnvironment(shop.app)
    small = env.run("refund-request", {"charge_id": "ch_1", "amount": 20})
    assert small.output["refunded"] == "ch_1"  # under the limit: no approval
    run_id = env.start("refund-request", {"charge_id": "ch_2", "amount": 500})
    env.drive(until=lambda: any(s["id"] == "approval" for s in env.get(run_id).steps) and waiting_on(env, run_id))
    printed = capsys.readouterr().out
    token = printed.split("ryusen complete ", 1)[1].split()[0]  # what the app printed, as an email would carry it
    env.complete(token, {"approved": True})
    assert env.wait(run_id).output["refunded"] == "ch_2"


def waiting_on(env: WorkflowEnvironment, run_id: str) -> bool:
    return env.get(run_id).attempts("approval")[-1]["status"] == "waiting"


@pytest.mark.rfd("X2")
def test_the_same_completion_sent_again_is_taken_once_and_answered_as_taken() -> None:
    """A completion whose write committed and whose answer was lost (a throttled or timed-out API call) is sent
    again by the client: the same result for the same token is the completion already taken, not a refusal."""
    tokens: list[str] = []
    calls: Counter[str] = Counter()
    env = WorkflowEnvironment(approvals(tokens, calls))
    run_id = env.start("expense", {"amount": 40})
    env.drive(until=lambda: waiting(env, run_id))
    env.complete(tokens[0], {"approved": True})
    version = env.engine.get_run(run_id).version
    env.complete(tokens[0], {"approved": True})  # the retry: no ConflictError, nothing written
    assert env.engine.get_run(run_id).version == version
    assert env.wait(run_id).output == {"paid": 40} and calls["pay"] == 1
    with pytest.raises(ConflictError):
        env.complete(tokens[0], {"approved": False})  # another result for it is still refused


@pytest.mark.rfd("X2")
def test_an_apps_signed_completion_is_taken_only_for_the_attempt_its_token_names() -> None:
    """``app.complete`` posts to the result URL signed with the app's key (here handed to the engine as the result
    function would). The attempt the post names must be the token's; an unsigned post is refused; either way
    nothing changes."""
    from ryusen._internal.signing import SIGNATURE_HEADER, app_key, sign
    from ryusen._internal.wire import CompletionPost, completion_scope
    from ryusen_server.ports import ServerError

    tokens: list[str] = []
    calls: Counter[str] = Counter()
    app = approvals(tokens, calls)
    env = WorkflowEnvironment(app)
    run_id = env.start("expense", {"amount": 40})
    env.drive(until=lambda: waiting(env, run_id))
    state = env.store.get(run_id)
    assert state is not None
    key = app_key(env.engine.master_keys()[0], state.app_id)
    path = "/v1/results"

    def post(generation: int, *, signed: bool = True) -> Any:
        body_model = CompletionPost(run_id=run_id, step_id="approval", phase="forward", generation=generation,
                                    token=tokens[0], result={"approved": True, "by": "webhook"})  # fmt: skip
        body = body_model.model_dump_json(exclude_none=True).encode()
        headers = {"content-type": "application/json"}
        if signed:
            scope = completion_scope(body_model, path=path, app_id=state.app_id)
            headers[SIGNATURE_HEADER] = sign(key, scope, body, now=time.time(), nonce=os.urandom(16).hex())
        return env.engine.submit_completion(body, headers, path=path)

    with pytest.raises(ServerError):
        post(1, signed=False)
    with pytest.raises(NotFoundError):
        post(2)  # signed, but it names another attempt than its token does
    assert waiting(env, run_id) and calls["pay"] == 0
    post(1)
    run = env.wait(run_id)
    assert run.outcome == "completed" and run.step("approval")["result"] == {"approved": True, "by": "webhook"}


@pytest.mark.rfd("X5")
def test_the_app_completes_a_step_itself_in_the_testing_kit() -> None:
    """``app.complete`` (a webhook the app serves) works in ``ryusen.testing`` as on a server: signed with the app's
    key and taken by the engine; a second, different completion is refused with ``CompletionError``."""
    tokens: list[str] = []
    calls: Counter[str] = Counter()
    app = approvals(tokens, calls)
    env = WorkflowEnvironment(app)
    run_id = env.start("expense", {"amount": 40})
    env.drive(until=lambda: waiting(env, run_id))
    answer = app.complete(tokens[0], {"approved": True, "by": "webhook"})
    assert answer["taken"] is True and answer["run_id"] == run_id
    run = env.wait(run_id)
    assert run.outcome == "completed" and run.step("approval")["result"] == {"approved": True, "by": "webhook"}
    with pytest.raises(ryusen.CompletionError) as refused:
        app.complete(tokens[0], error={"type": "Rejected", "message": "too late", "retryable": False})
    assert refused.value.code == "completion_refused" and refused.value.status == 409
    with pytest.raises(ryusen.CompletionError) as bogus:
        app.complete("not-a-token", {"approved": True})
    assert bogus.value.code == "completion_not_found"

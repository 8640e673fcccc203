"""Review of 82bee4f in the stack in a box: a run's lease timer now watches an event authorized within a second of
the last whose lease ends before the timer is due (by less than SQS's rounding). What was tried, and held: such an
event gone silent is not taken as Unknown before its lease, is taken once its lease has ended (not left in flight
unwatched), and with on_unknown="retry" its step runs once more, not twice more."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.infra.test_run_lease_timer import _attempts, _shift_clocks, _timers_sent
from tests.infra.test_stack_in_a_box import (  # noqa: F401
    Deployed,
    _inline_up_to,
    _messages_due_now,
    _start,
    _timed_app,
    deployed,
)
from tests.stack import wait_for


def test_a_silent_event_whose_lease_ends_before_the_runs_timer_is_due_is_unknown_after_its_lease_not_before(
    deployed: Deployed,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Timeout 8.5 s: "b"'s timer (a lease of about 68.5 s, rounded up to 69 s) is due after "c"'s lease ends, since
    "c" was authorized within half a second of "b"; "c" is watched by it (no timer of its own) and its event is
    lost. With the clocks just before "c"'s lease and the timer made visible early, "c" stays in flight; just after
    its lease (inside the second the rounding allows), "c" is Unknown, at or after its lease, and retried once."""
    from ryusen import RetryPolicy
    from ryusen_server.lambdas import results as results_lambda

    _inline_up_to(monkeypatch, 0.0)
    retry = RetryPolicy(max_attempts=3, initial_delay=timedelta(0), on_unknown="retry")
    arn, ran, _slow, _app = _timed_app(deployed, "rounded", steps=("a", "b", "c", "d"), timeout_s=8.5, retry=retry)
    handler, who = deployed.box.event_handlers[arn]
    dropped: list[str] = []

    def losing(event: dict[str, Any], context: Any) -> dict[str, Any]:
        if json.loads(event["body"]).get("step_id") == "c" and not dropped:
            dropped.append("c")
            return {"statusCode": 202}  # queued, then lost: nothing runs, nothing is posted
        result: dict[str, Any] = handler(event, context)
        return result

    deployed.box.event_handlers[arn] = (losing, who)
    before = len(deployed.box.calls)
    run_id = _start(deployed, "rounded-flow", {})
    in_flight: Any = wait_for(lambda: dropped and _attempts(deployed.run(run_id), "c"), timeout=30, what="c in flight")
    lease = datetime.fromisoformat(in_flight[0]["lease_expires_at"])
    due_at, _watches_before, _mono = results_lambda.engine().engine.run_lease_timers._sent[run_id]
    assert [t["step_id"] for t in _timers_sent(deployed, before, run_id)] == ["b"], "c got a timer of its own"
    if not lease < due_at:
        pytest.skip(f"c was authorized too long after b on this machine: lease {lease}, b's timer due {due_at}")

    _shift_clocks(monkeypatch, (lease - datetime.now(UTC)).total_seconds() - 3.0)  # 3 s before c's lease
    early = len(deployed.box.calls)
    for _ in range(4):
        _messages_due_now()  # b's timer comes back early: c is in flight, its lease not ended
        time.sleep(0.5)
    assert _attempts(deployed.run(run_id), "c")[0]["status"] == "authorized", "c taken before its lease"
    kept = [
        c for c in deployed.box.calls[early:] if c.function == "dispatch" and c.operation == "ChangeMessageVisibility"
    ]
    assert kept, "b's timer did not come back early: the check above proved nothing"

    # the clocks 2 s on now: move them to 0.3 s after c's lease, before b's timer is due
    _shift_clocks(monkeypatch, 1.3)
    deadline = time.monotonic() + 30
    while (run := deployed.run(run_id))["phase"] != "finished":
        assert time.monotonic() < deadline, json.dumps(_attempts(run, "c"))  # left in flight: nothing watches it
        _messages_due_now()
        time.sleep(0.5)
    assert run["outcome"] == "completed", run["summary"]
    assert ran == ["a", "b", "c", "d"], ran  # "c" ran once: the retry
    [lost, retried] = _attempts(run, "c")
    assert lost["unknown"] is not None and retried["status"] == "succeeded", (lost, retried)
    assert datetime.fromisoformat(lost["unknown"]["at"]) >= lease, (lost["unknown"], lease)

"""Durable waits over HTTP on ``ryusen dev`` (decision 31): a sleep completes at its time, not earlier, also
across a restart of the stack (its state is kept; its queue is not), and no process waits meanwhile."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ryusen.client import Client
from tests.stack import launch, wait_for


@pytest.mark.rfd("W1")
def test_a_sleep_completes_at_its_time_across_a_restart_of_ryusen_dev(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:10]
    first = launch(tmp_path)
    stack = next(first)
    with Client(stack.url) as client:
        run = client.start("sleepy", {"tag": tag, "sleep_s": 8})
        waiting = wait_for(
            lambda: (r := run.get()).steps and any(s["id"] == "nap" for s in r.steps) and r, what="the nap"
        )
        due = datetime.fromisoformat(waiting.step("nap")["wait_until"])
        assert waiting.step("nap")["sleep"] is True and waiting.step("before")["status"] == "completed"
    first.close()  # the stack stops in the middle of the wait

    second = launch(tmp_path)
    stack = next(second)
    try:
        with Client(stack.url) as client:
            assert client.get(run.id).step("nap")["wait_until"] == due.isoformat()  # the due time was kept
            if datetime.now(UTC) < due:
                assert stack.invocations(f"{tag}:after") == 0
            done = client.wait(run.id, timeout=60)
            assert done.outcome == "completed", done.summary
            nap = done.step("nap")
            assert datetime.fromisoformat(nap["attempts"][-1]["settled_at"]) >= due  # not earlier
            after = done.step("after")["attempts"][0]
            assert datetime.fromisoformat(after["authorized_at"]) >= due
            assert stack.invocations(f"{tag}:after") == 1 and stack.invocations(f"{tag}:before") == 1
    finally:
        second.close()

"""Adversarial review of decision 32 on ``ryusen dev``: a restart keeps the runs (their state directory), so the
tokens their callbacks handed out must keep working."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from ryusen.client import Client
from tests.stack import launch, wait_for


def token_of(log_file: Path, tag: str) -> str:
    lines = log_file.read_text().splitlines() if log_file.exists() else []
    found = [line.split(":token:", 1)[1] for line in lines if line.startswith(f"{tag}:token:")]
    return found[-1] if found else ""


@pytest.mark.rfd("X5")
def test_a_completion_token_handed_out_before_a_restart_of_ryusen_dev_still_completes_its_step(tmp_path: Path) -> None:
    """The approval link was emailed before the developer restarted ``ryusen dev``: the run and its waiting step
    were kept, so the link must still complete it (not 404 ``completion_not_found`` because the session's master
    key, which made the token, was drawn afresh)."""
    tag = uuid.uuid4().hex[:10]
    first = launch(tmp_path)
    stack = next(first)
    with Client(stack.url) as client:
        run = client.start("approval", {"tag": tag})
        token = wait_for(lambda: token_of(stack.log_file, tag), what="the callback to hand out its token")
        wait_for(lambda: (r := run.get()).steps and r.step("approve")["attempts"][-1]["status"] == "waiting")
    first.close()

    second = launch(tmp_path)
    stack = next(second)
    try:
        with Client(stack.url) as client:
            assert client.get(run.id).step("approve")["attempts"][-1]["status"] == "waiting"
            client.complete(token, {"approved": True})
            done = client.wait(run.id, timeout=60)
            assert done.outcome == "completed" and done.step("approve")["result"] == {"approved": True}
            assert stack.invocations(f"{tag}:pay") == 1
    finally:
        second.close()

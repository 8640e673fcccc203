"""Steps declared together over HTTP on ``ryusen dev`` (decision 30): they run at once, so the run takes about
as long as its slowest sibling; each runs once and the function goes on when all have settled."""

from __future__ import annotations

import uuid
from datetime import datetime
from pathlib import Path

import pytest

from ryusen.client import Client
from tests.stack import launch


@pytest.mark.rfd("P1")
def test_siblings_run_at_once_over_http_on_ryusen_dev(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:10]
    stack_gen = launch(tmp_path)
    stack = next(stack_gen)
    try:
        with Client(stack.url) as client:
            run = client.start("trip", {"tag": tag, "seconds": 2.0})
            done = client.wait(run.id, timeout=120)
            assert done.outcome == "completed", done.summary
            assert done.output == ["flight", "hotel", "car"]
            kinds = ("flight", "hotel", "car")
            for kind in kinds:
                assert stack.invocations(f"{tag}:start-{kind}") == 1 and stack.invocations(f"{tag}:end-{kind}") == 1
            # every sibling started before any of them ended: they overlapped (the log is in the order it happened)
            log = [line for line in stack.log_file.read_text().splitlines() if line.startswith(f"{tag}:")]
            starts = [log.index(f"{tag}:start-{k}") for k in kinds]
            ends = [log.index(f"{tag}:end-{k}") for k in kinds]
            assert max(starts) < min(ends), log
            # and so the server's own record: each attempt was authorized before the first one settled
            attempts = [done.step(k)["attempts"][0] for k in kinds]
            authorized = max(datetime.fromisoformat(a["authorized_at"]) for a in attempts)
            settled = min(datetime.fromisoformat(a["settled_at"]) for a in attempts)
            assert authorized < settled
            confirm = done.step("confirm")["attempts"][0]
            assert datetime.fromisoformat(confirm["authorized_at"]) >= max(
                datetime.fromisoformat(a["settled_at"]) for a in attempts
            )
    finally:
        stack_gen.close()

"""``ryusen dev`` keeps its runs across restarts in a data directory, and says where (issue 26)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from ryusen.client import Client, NotFoundError
from tests.stack import free_port, launch, wait_for


def tag() -> str:
    return uuid.uuid4().hex[:10]


def test_runs_and_their_history_survive_a_restart_and_a_run_in_flight_goes_on(tmp_path: Path) -> None:
    first = launch(tmp_path)
    stack = next(first)
    output = stack.output.read_text()
    assert f"state kept in {tmp_path / '.ryusen'}" in output and "nothing saved yet" in output
    with Client(stack.url) as client:
        done = client.start("straight", {"tag": tag()}, idempotency_key="order-1")
        done.result(timeout=60)
        slow = client.start("slow", {"tag": tag(), "sleep_s": 1})
        wait_for(lambda: (slow.get().steps and slow.get().step("first")["status"] == "completed") or None)
    first.close()  # SIGTERM: the stack saves its table as it stops

    second = launch(tmp_path)
    stack = next(second)
    try:
        assert "2 run(s) restored" in stack.output.read_text()
        with Client(stack.url) as client:
            kept = client.get(done.id)
            assert kept.outcome == "completed" and [s["id"] for s in kept.steps] == ["a", "b", "c"]
            # the idempotency key still names its run
            again = client.start("straight", kept.input, idempotency_key="order-1")
            assert not again.created and again.id == done.id
            # the run that was in flight goes on, on the new session's release
            finished = client.wait(slow.id, timeout=60)
            assert finished.outcome == "completed", finished.summary
            assert {r.id for r in client.list(limit=10).runs} >= {done.id, slow.id}
    finally:
        second.close()

    fresh = launch(tmp_path, args=("--fresh",))
    stack = next(fresh)
    try:
        assert "started fresh" in stack.output.read_text()
        with Client(stack.url) as client:
            assert client.list().runs == []
            try:
                client.get(done.id)
                raise AssertionError("a fresh stack still had the run")
            except NotFoundError:
                pass
    finally:
        fresh.close()


def test_a_killed_stack_keeps_what_it_saved_and_a_second_stack_cannot_share_the_directory(tmp_path: Path) -> None:
    data = tmp_path / "state"
    first = launch(tmp_path, args=("--data", str(data)))
    stack = next(first)
    with Client(stack.url) as client:
        run = client.start("straight", {"tag": tag()})
        run.result(timeout=60)
    wait_for(lambda: ((data / "table.jsonl").exists() and run.id in (data / "table.jsonl").read_text()) or None)

    # another ryusen dev on the same directory is refused, and says why
    other = subprocess.run(
        [str(Path(sys.executable).parent / "ryusen"), "dev", "--port", str(free_port()), "--data", str(data)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert other.returncode == 1 and "another ryusen dev is using" in other.stderr

    os.kill(stack.process.pid, signal.SIGKILL)  # no chance to save at the end
    stack.process.wait(timeout=20)
    first.close()
    second = launch(tmp_path, args=("--data", str(data)))
    stack = next(second)
    try:
        with Client(stack.url) as client:
            assert client.get(run.id).outcome == "completed"
    finally:
        second.close()


def test_a_stack_whose_terminal_closes_keeps_what_it_answered(tmp_path: Path) -> None:
    """Closing the terminal ``ryusen dev`` runs in sends it SIGHUP: it stops as for Ctrl-C and saves its table.
    Otherwise a run the API answered as started (and a step it recorded) in the last seconds is gone after the
    restart: a start retried with its idempotency key starts it again, and its steps run twice."""
    first = launch(tmp_path)
    stack = next(first)
    apps = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(stack.process.pid)], capture_output=True, text=True, check=False
    ).stdout.split()
    try:
        with Client(stack.url) as client:
            started = client.start("straight", {"tag": tag()}, idempotency_key="order-hup")
            assert started.created
        os.kill(stack.process.pid, signal.SIGHUP)
        stack.process.wait(timeout=60)
    finally:
        first.close()
        for pid in apps:  # the app processes this stack started, should it have left them behind
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    second = launch(tmp_path)
    stack = next(second)
    try:
        with Client(stack.url) as client:
            kept = client.get(started.id)  # NotFoundError: the start the API answered was lost
            again = client.start("straight", kept.input, idempotency_key="order-hup")
            assert not again.created and again.id == started.id
    finally:
        second.close()

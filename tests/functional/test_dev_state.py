"""``ryusen dev`` keeps its runs across restarts in a data directory, and says where (issue 26)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
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
    subprocess.run(["pkill", "-f", f"serve_app {tmp_path}"], check=False)  # the app process it leaves behind
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
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)

    second = launch(tmp_path)
    stack = next(second)
    try:
        with Client(stack.url) as client:
            kept = client.get(started.id)  # NotFoundError: the start the API answered was lost
            again = client.start("straight", kept.input, idempotency_key="order-hup")
            assert not again.created and again.id == started.id
    finally:
        second.close()


def test_an_attempt_started_after_the_last_save_of_a_killed_stack_is_unknown_not_run_again(tmp_path: Path) -> None:
    """A stack killed between its saves (every few seconds) lost the write that authorized an attempt whose
    callback then ran. Sent again after a restart, it would run twice with no one told: the authorization log
    (``started.jsonl``) names it, and it comes back Unknown instead."""
    t = tag()
    first = launch(tmp_path)
    stack = next(first)
    table = tmp_path / ".ryusen" / "table.jsonl"
    with Client(stack.url) as client:
        run = client.start("delayed", {"tag": t, "delay_s": 8, "sleep_s": 20, "timeout_s": 2})

        wait_for(lambda: any(s["id"] == "slow" for s in client.get(run.id).steps), what="the slow step")
        queued_at = time.time()  # queued until its not_before: the next save holds it so
        wait_for(lambda: table.exists() and table.stat().st_mtime > queued_at, what="a save", timeout=60)

        def started() -> bool:
            steps = {s["id"]: s for s in client.get(run.id).steps}
            return "slow" in steps and steps["slow"]["attempts"][-1]["status"] == "authorized"

        wait_for(started, what="the slow step's attempt to be authorized", timeout=60)
    os.kill(stack.process.pid, signal.SIGKILL)  # before the next save
    stack.process.wait(timeout=20)
    first.close()
    subprocess.run(["pkill", "-f", f"serve_app {tmp_path}"], check=False)  # the orphaned app and its callback
    wait_for(lambda: stack.invocations(f"{t}:slow-start") == 1, what="the callback to have started once")

    second = launch(tmp_path)
    stack = next(second)
    try:
        with Client(stack.url) as client:
            unknown = wait_for(lambda: (r := client.get(run.id)).blocked and r, what="the attempt Unknown", timeout=60)
            [blocker] = unknown.blockers
            assert blocker["type"] == "unknown_outcome" and blocker["step_id"] == "slow"
            assert unknown.step("slow")["status"] == "unknown"
            client.wait(run.id, timeout=5, return_when_blocked=True)  # nothing moves on by itself
            assert stack.invocations(f"{t}:slow-start") == 1  # never run a second time
    finally:
        second.close()

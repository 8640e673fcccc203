"""Run `ryusen dev` as a user would (the console script, in its own process) for tests over HTTP."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

T = TypeVar("T")
APPS = Path(__file__).resolve().parent / "apps"

FAST_SETTINGS = {
    "RYUSEN_RETRY_INITIAL_DELAY_S": "0.1",
    "RYUSEN_COMPENSATE_INITIAL_DELAY_S": "0.1",
    "RYUSEN_REDELIVERY_INITIAL_S": "0.2",
    "RYUSEN_PROBE_INITIAL_S": "2",
    "RYUSEN_PROBE_MAX_S": "4",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(check: Callable[[], T | None], *, timeout: float = 90.0, what: str = "condition") -> T:
    """Poll ``check`` until it returns something truthy (generous limit; never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last value: {last!r}")


@dataclass
class DevStack:
    url: str
    app_file: Path
    log_file: Path
    process: subprocess.Popen[str]
    output: Path

    @property
    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30.0)

    def start(self, function_id: str, data: Any, **extra: Any) -> dict[str, Any]:
        response = self.client.post(f"/v1/functions/{function_id}/runs", json={"input": data, **extra})
        assert response.status_code in (200, 201), response.text
        run: dict[str, Any] = response.json()
        return run

    def run(self, run_id: str) -> dict[str, Any]:
        response = self.client.get(f"/v1/runs/{run_id}")
        assert response.status_code == 200, response.text
        view: dict[str, Any] = response.json()
        return view

    def wait_finished(self, run_id: str, timeout: float = 90.0) -> dict[str, Any]:
        return wait_for(
            lambda: (r := self.run(run_id))["phase"] == "finished" and r,
            timeout=timeout,
            what=f"run {run_id} to finish",
        )

    def invocations(self, line: str) -> int:
        if not self.log_file.exists():
            return 0
        return sum(1 for entry in self.log_file.read_text().splitlines() if entry == line)

    def functions(self) -> dict[str, Any]:
        return {f["id"]: f for f in self.client.get("/v1/functions").json()["functions"]}


def launch(tmp: Path, app_source: str = "http_app.py", args: tuple[str, ...] = ()) -> Iterator[DevStack]:
    app_file = tmp / app_source
    shutil.copy(APPS / app_source, app_file)
    log_file = tmp / "invocations.log"
    port = free_port()
    output = tmp / "ryusen-dev.out"
    env = {**os.environ, **FAST_SETTINGS, "RYUSEN_TEST_LOG": str(log_file), "PYTHONUNBUFFERED": "1"}
    for name in ("RYUSEN_SIGNING_KEY", "RYUSEN_MASTER_KEY", "RYUSEN_INSECURE_LOCAL"):
        env.pop(name, None)  # ryusen dev makes the keys of its session
    ryusen = Path(sys.executable).parent / "ryusen"
    with output.open("w") as out:
        process = subprocess.Popen(
            [str(ryusen), "dev", "--port", str(port), *args, f"{app_file}:app"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            cwd=tmp,
        )
    stack = DevStack(f"http://127.0.0.1:{port}", app_file, log_file, process, output)
    try:
        wait_for(
            lambda: process.poll() is not None or "ready" in output.read_text(), timeout=120, what="ryusen dev to start"
        )
        if process.poll() is not None:
            pytest.fail(f"ryusen dev exited with {process.returncode}:\n{output.read_text()}")
        yield stack
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()

"""The dev app servers answer only to a loopback ``Host`` (issue 24, low): a page whose name was rebound to
127.0.0.1 (DNS rebinding) could read an app's manifest from ``ryusen dev``'s app server, which answered any
``Host``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def app_server() -> Iterator[int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("sdk", "handlers")),
        "RYUSEN_MASTER_KEY": "dev-host-test-master-0123456789abcdef",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ryusen_server.local.serve_app",
            str(ROOT / "tests/apps/http_app.py"),
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        assert "serving app" in proc.stdout.readline()
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_dev_app_server_refuses_a_host_that_is_not_loopback(app_server: int) -> None:
    url = f"http://127.0.0.1:{app_server}/"
    for host in (f"rebound.example:{app_server}", "rebound.example", f"127.0.0.1:{app_server + 1}", ""):
        response = httpx.get(url, headers={"Host": host}, timeout=10)
        assert response.status_code == 421, host
        assert response.json()["error"]["code"] == "foreign_host"
        assert "conformance" not in response.text  # nothing of the app's manifest
    for host in (f"127.0.0.1:{app_server}", f"localhost:{app_server}"):
        response = httpx.get(url, headers={"Host": host}, timeout=10)
        assert response.status_code == 200 and response.json()["app_id"] == "conformance"

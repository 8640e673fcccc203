"""The dev UI as ``ryusen dev`` serves it (issue 26): the page carries the session token and loads the built
files; the built files are served with their types and are valid JavaScript; ``ryusen dev`` refuses to start
unbuilt, naming the build script; the engine's decisions reach each open page's event stream as the run's id
and version; and the front end's one time format. The browser tests (tests/browser) drive the UI itself."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ryusen_server.local import dev, ui

ROOT = Path(__file__).resolve().parents[2]
NODE = shutil.which("node")


def test_the_page_carries_the_session_token_and_loads_only_its_own_files() -> None:
    page = ui.index_html('tok"en<').decode()
    assert '<meta name="ryusen-session" content="tok&quot;en&lt;">' in page  # escaped
    assert '<script type="module" src="/static/app.js"></script>' in page
    assert '<link rel="stylesheet" href="/static/app.css">' in page
    assert "http" not in page.replace("http-equiv", "")  # nothing from a CDN: the UI works offline
    assert "<script>" not in page  # no inline script: the page's CSP allows only its own files
    csp = dict(dev.UI_HEADERS)["Content-Security-Policy"]
    assert "script-src 'self';" in csp


def test_ryusen_dev_refuses_to_start_unbuilt_and_names_the_build_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(ui, "STATIC_DIR", tmp_path)
    assert dev.run_dev(port=1) == 1
    err = capsys.readouterr().err
    assert "the dev UI is not built" in err and "./scripts/build-ui" in err
    assert ui.static_file("app.js") is None
    assert ui.static_file("../ui.py") is None  # only the built files, by name


def test_the_built_files_are_served_with_their_types(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "app.js").write_text("export {};")
    (tmp_path / "app.css").write_text("body{}")
    monkeypatch.setattr(ui, "STATIC_DIR", tmp_path)
    ui.check_built()
    answers: list[tuple[str, dict[str, str]]] = []

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        answers.append((status, dict(headers)))

    events = ui.RunEvents()
    body = b"".join(dev._serve_ui("/static/app.js", b"page", events, start_response))
    assert body == b"export {};" and answers[-1][1]["Content-Type"].startswith("text/javascript")
    b"".join(dev._serve_ui("/static/app.css", b"page", events, start_response))
    assert answers[-1][1]["Content-Type"].startswith("text/css")
    assert b"".join(dev._serve_ui("/", b"page", events, start_response)) == b"page"
    assert answers[-1][1]["X-Frame-Options"] == "DENY"
    b"".join(dev._serve_ui("/static/other.js", b"page", events, start_response))
    assert answers[-1][0].startswith("404")


def decided(run_id: str, version: int) -> tuple[None, Any]:
    state = SimpleNamespace(id=run_id, version=version, function_id="fn", phase=SimpleNamespace(value="running"))
    return None, SimpleNamespace(state=state)


def test_each_open_page_is_told_which_run_changed() -> None:
    events = ui.RunEvents()
    first, second = events.stream(), events.stream()
    assert next(first).startswith(b"retry:") and next(second).startswith(b"retry:")
    events.hook("invoke", ("task", "url"))  # not a decision: nothing
    events.hook("decided", decided("run_1", 3))
    for stream in (first, second):
        chunk = next(stream).decode()
        assert chunk.startswith("event: run\ndata: ") and chunk.endswith("\n\n")
        assert json.loads(chunk.split("data: ", 1)[1]) == {
            "run_id": "run_1",
            "version": 3,
            "function_id": "fn",
            "phase": "running",
        }
    events.hook("decided", ("malformed",))  # a hook never raises into the engine
    done = threading.Event()

    def drain() -> None:
        assert list(first) == []
        done.set()

    threading.Thread(target=drain, daemon=True).start()
    events.close()  # the stack stops: every stream ends
    assert done.wait(5)
    assert list(events.stream()) == []  # none opens after


def test_a_page_that_falls_behind_is_told_to_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ui.RunEvents, "QUEUE", 3)
    events = ui.RunEvents()
    stream = events.stream()
    next(stream)
    for version in range(10):
        events.hook("decided", decided("run_1", version))
    assert next(stream).startswith(b"event: reload")


@pytest.mark.skipif(NODE is None, reason="Node.js is not installed")
def test_one_time_format_throughout() -> None:
    program = """
import { formatDuration, formatTime, shellQuote } from "./ui/src/lib/format.js";
process.env.TZ = "UTC";
console.log(JSON.stringify([
  formatTime("2026-12-03T14:05:06.123+00:00"), formatTime(null),
  formatDuration(1234), formatDuration(85), formatDuration(12345), formatDuration(125000), formatDuration(null),
  shellQuote("run_1"), shellQuote("it's done"),
]));
"""
    assert NODE is not None
    done = subprocess.run(
        [NODE, "--input-type=module", "-e", program],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={"TZ": "UTC", "PATH": "/usr/bin:/bin"},
    )
    assert json.loads(done.stdout) == [
        "2026-12-03 14:05:06.123",
        "\u2013",  # an en dash: no value
        "1.2 s",
        "0.085 s",
        "12.3 s",
        "2 min 5 s",
        "\u2013",  # an en dash: no value
        "run_1",
        "'it'\\''s done'",
    ]


@pytest.mark.skipif(NODE is None, reason="Node.js is not installed")
def test_the_built_bundle_parses() -> None:
    built = ui.STATIC_DIR / "app.js"
    if not built.is_file():
        pytest.skip("the UI is not built (./scripts/build-ui)")
    assert NODE is not None
    done = subprocess.run([NODE, "--check", str(built)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr

"""The development UI in headless Chromium against a real `ryusen dev` stack (skipped without chromium)."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stack import DevStack, launch, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    yield from launch(tmp_path_factory.mktemp("ui"))


def rendered(url: str, tmp: Path) -> str:
    assert CHROMIUM is not None
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp / 'profile'}",
            "--virtual-time-budget=8000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_ui_explains_a_compensated_run_and_a_blocked_one(stack: DevStack, tmp_path: Path) -> None:
    t = uuid.uuid4().hex[:8]
    failed = stack.wait_finished(stack.start("saga", {"tag": t})["id"])
    blocked = stack.start("dup", {"tag": t})["id"]
    wait_for(lambda: stack.run(blocked)["blockers"], what="the duplicate step id blocker")

    page = rendered(f"{stack.url}/#run={failed['id']}", tmp_path)
    assert "failed, fully compensated" in page
    assert "Unwind (reverse completion order)" in page
    unwind = page[page.index("Unwind (reverse completion order)") :]
    assert unwind.index(">ship<") < unwind.index(">charge<") < unwind.index(">reserve<")  # newest first

    page = rendered(f"{stack.url}/#run={blocked}", tmp_path)
    assert "duplicate_step_id" in page and "charge amount" in page and "charge fee" in page
    assert "Forward work is blocked, not failed" in page
    assert "Rediscover" in page


def test_ui_shows_a_blocked_unwind_with_both_locations_and_its_remedies(stack: DevStack, tmp_path: Path) -> None:
    t = uuid.uuid4().hex[:8]
    run_id = stack.start("audited", {"tag": t})["id"]
    wait_for(lambda: stack.run(run_id)["blockers"], what="the new_step_before_target blocker")
    page = rendered(f"{stack.url}/#run={run_id}", tmp_path)
    assert "new_step_before_target" in page
    assert "new step <code>audit</code> at http_app.py:" in page
    assert "before target <code>book</code> at http_app.py:" in page
    assert "the compensator cannot be reached" in page  # the remedy
    assert "Rediscover" in page and "It succeeded…" in page

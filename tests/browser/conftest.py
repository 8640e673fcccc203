"""Browser tests of the dev UI: ``ryusen dev`` over the test app (as ``tests/stack.py`` launches it), driven with
Playwright on the system's Chromium (no ``playwright install``: /work/shared/facts/browser.md)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ryusen_server.local.ui import STATIC_DIR, STATIC_FILES
from tests.stack import DevStack, launch

sync_api = pytest.importorskip("playwright.sync_api")

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("RYUSEN_CHROMIUM", "/usr/bin/chromium")
TIMEOUT_MS = 60_000
"""What a test waits for the page at most (polling: never a fixed sleep)."""
sync_api.expect.set_options(timeout=TIMEOUT_MS)  # expect()'s own default is 5 s: too short on a loaded machine


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    if not all((STATIC_DIR / name).is_file() for name in STATIC_FILES):
        subprocess.run([str(ROOT / "scripts" / "build-ui")], check=True)
    # the launched ryusen dev (and its app process) import this checkout's code, whichever checkout the console
    # script was installed from
    before = os.environ.get("PYTHONPATH")
    paths = [str(ROOT / name) for name in ("sdk", "handlers", "infra")]
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *([before] if before else [])])
    try:
        yield from launch(tmp_path_factory.mktemp("browser"))
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Playwright's sync API runs an event loop on this thread until it stops: it stops with the module, so that
    the tests after it (asyncio.run) find none running."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (set RYUSEN_CHROMIUM)")
    with sync_api.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Any, stack: DevStack) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    yield opened
    context.close()
    assert errors == [], f"the page raised: {errors}"

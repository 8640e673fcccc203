"""``ryusen dev`` restarts an app whose process dies mid-step, however often it dies.

The project's CI (stop 23) saw the conformance app's ``crashes`` function kill its process twice in a row: the
dispatcher's retry reached the restarted process before ``ryusen dev`` had read its manifest, the process died
again while starting, and the supervisor gave up on it for good. Every later run on that stack then blocked
with ``endpoint_failing``. Here the restarted process dies while its manifest is being read.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from ryusen_server.local.dev import DevStack, free_port
from tests.stack import wait_for

APP = """
import os
from pathlib import Path

from ryusen import Ryusen

LAUNCHES = Path(__file__).with_name("launches")
launch = int(LAUNCHES.read_text()) + 1 if LAUNCHES.exists() else 1
LAUNCHES.write_text(str(launch))


class DiesOnItsSecondLaunch(Ryusen):
    def wsgi(self):
        inner = super().wsgi()

        def app(environ, start_response):
            if launch == 2:
                os._exit(17)  # the retry of a crashing step arrives before the manifest is read
            return inner(environ, start_response)

        return app


app = DiesOnItsSecondLaunch("supervised")


@app.function("noop")
def noop(data, step):
    return data
"""


def test_an_app_that_dies_again_while_restarting_is_restarted_until_it_answers(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(APP)
    lines: list[str] = []
    stack = DevStack(port=free_port(), apps=[f"{tmp_path / 'app.py'}:app"], out=lines.append)
    stack.start()
    try:
        [proc] = stack._processes
        first = proc.process
        assert first is not None
        first.kill()  # the app dies mid-step
        wait_for(lambda: (tmp_path / "launches").read_text() == "3", what="a third launch", timeout=30)
        manifest = wait_for(lambda: _manifest(proc.url), what="the app to answer again", timeout=30)
        assert manifest["app_id"] == "supervised"
        assert any("restarting it" in line for line in lines)
    finally:
        stack.stop()


def _manifest(url: str) -> dict[str, object] | None:
    try:
        response = httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None

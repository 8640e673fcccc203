"""A step's ``timeout`` is what the dispatcher waits for (issue 23): the attempt turns Unknown at the declared
timeout plus a small grace (a tenth of it, at least 0.5 s and at most 2 s), and the Unknown names the timeout.

The engine runs in this process on its in-memory store and queue, on wall time, and calls the app over real
HTTP (the grace is the HTTP invoker's: ``ryusen.testing`` invokes in-process, where nothing times out).
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta
from typing import Any

import pytest

from ryusen import Ryusen, Step
from ryusen._internal.serve import wsgi_app
from ryusen_server.core.events import EngineSettings
from ryusen_server.core.view import run_view
from ryusen_server.engine import response_grace_s
from ryusen_server.runtime import fire_due, handle_message
from tests.conformance.test_continuation import MASTER, HttpEngine


def blocked_view(http: HttpEngine, run_id: str, limit_s: float = 60.0) -> dict[str, Any]:
    """Drive the engine until the run shows a blocker (a generous limit; polls, never a fixed sleep)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        fire_due(http.engine, http.timers.due)
        for message in http.queue.receive(1):
            handle_message(http.engine, http.queue, message, message.message_id)
        state = http.store.peek(run_id)
        assert state is not None
        view = run_view(state)
        if view["blockers"]:
            return view
        time.sleep(0.02)
    raise AssertionError(f"run {run_id} never blocked")


@pytest.mark.parametrize(
    ("step_timeout_s", "attempt_timeout_s", "named"),
    [(2.0, 300.0, "the step's timeout of 2s"), (None, 2.0, "the server's attempt timeout of 2s")],
    ids=["declared by the step", "the server's default"],
)
def test_an_attempt_is_unknown_at_its_timeout_plus_a_small_grace_and_says_so(
    step_timeout_s: float | None, attempt_timeout_s: float, named: str
) -> None:
    app = Ryusen("timeouts", master_key=MASTER)
    answer = threading.Event()

    @app.function("slow")
    def slow(data: Any, step: Step) -> Any:
        timeout = timedelta(seconds=step_timeout_s) if step_timeout_s else None
        return step.run("wait", lambda: answer.wait(30) and "answered", timeout=timeout)

    http = HttpEngine(wsgi_app(app), settings=EngineSettings(attempt_timeout_s=attempt_timeout_s))
    try:
        http.sync("timeouts")
        state, _ = http.engine.start_run("slow", None)
        view = blocked_view(http, state.id)
    finally:
        answer.set()  # the callback answers now; with no result endpoint its late outcome goes nowhere
        http.close()
    [step] = view["steps"]
    [attempt] = step["attempts"]
    [blocker] = view["blockers"]
    assert step["status"] == "unknown" and blocker["type"] == "unknown_outcome"
    grace = response_grace_s(2.0)
    assert grace == 0.5
    assert attempt["detail"] == f"no response within {named} (+{grace:g}s grace)"
    # when the Unknown was recorded, from the attempt's start: never before its timeout, and within its
    # timeout and grace (the old dispatcher listened 2 s past any timeout: 4 s here); 1 s of slack for a
    # busy machine
    waited = datetime.fromisoformat(blocker["first_seen_at"]) - datetime.fromisoformat(attempt["authorized_at"])
    assert timedelta(seconds=2.0) <= waited < timedelta(seconds=2.0 + grace + 1.0)


def test_the_grace_is_a_tenth_of_the_timeout_between_half_a_second_and_two_seconds() -> None:
    assert [response_grace_s(t) for t in (0.2, 3.0, 5.0, 12.0, 20.0, 300.0, 900.0)] == [
        0.5,
        0.5,
        0.5,
        1.2,
        2.0,
        2.0,
        2.0,
    ]

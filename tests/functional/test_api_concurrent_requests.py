"""Requests the API resolves at once each keep their own event (issue 24, low).

Powertools' resolver keeps the event it is resolving on the class, so where ``ryusen dev`` serves its API
from threads, a request's log (and its route, body and caller) could name another request's event. The
review saw dev logs name the wrong request.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, cast

import pytest

from ryusen_server.api import build_api
from ryusen_server.ports import NotFoundError
from tests.conformance.test_security_and_bad_input import rest_event


class SlowEngine:
    """Looking up run ``a`` waits until another request was answered meanwhile, then fails unexpectedly."""

    def __init__(self) -> None:
        self.a_started = threading.Event()
        self.b_answered = threading.Event()

    def get_run(self, run_id: str) -> Any:
        if run_id == "run-a":
            self.a_started.set()
            assert self.b_answered.wait(10)
            raise RuntimeError("the store fell over")
        raise NotFoundError(f"no run {run_id}", code="run_not_found")


def test_a_request_resolved_while_another_is_keeps_its_own_event_in_its_log(caplog: pytest.LogCaptureFixture) -> None:
    engine = SlowEngine()
    resolver = build_api(cast(Any, engine), lambda app_id, url: cast(Any, None))
    answers: dict[str, Any] = {}

    def request_a() -> None:
        answers["a"] = resolver.resolve(rest_event("GET", "/v1/runs/run-a"), cast(Any, None))

    first = threading.Thread(target=request_a)
    with caplog.at_level(logging.ERROR, logger="ryusen.api"):
        first.start()
        assert engine.a_started.wait(10)
        answers["b"] = resolver.resolve(rest_event("GET", "/v1/runs/run-b"), cast(Any, None))
        engine.b_answered.set()
        first.join(10)
    assert answers["a"]["statusCode"] == 500 and answers["b"]["statusCode"] == 404
    [record] = [r for r in caplog.records if r.name == "ryusen.api"]
    assert record.getMessage() == "unexpected error answering GET /v1/runs/run-a"

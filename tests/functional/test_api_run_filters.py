"""``GET /v1/runs`` filters by recovery, by whether the run is blocked, and by idempotency key (issue 26: the
dev UI's run list filters and searches with them)."""

from __future__ import annotations

from typing import Any

import pytest

from ryusen import Ryusen, Step
from ryusen.testing import WorkflowEnvironment
from ryusen_server.api import build_api
from tests.conformance.test_security_and_bad_input import call


@pytest.fixture
def api() -> tuple[WorkflowEnvironment, Any]:
    app = Ryusen("filters-app")

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        step.run("charge", lambda: "charged", compensate=lambda charged: "refunded")
        if data == "fail":
            raise RuntimeError("declined")
        if data == "dup":
            step.run("charge", lambda: "again")
        return data

    env = WorkflowEnvironment(app)
    return env, build_api(env.engine, lambda app_id, url: (app.manifest(), frozenset()))


def listed(resolver: Any, **query: str) -> list[str]:
    status, body = call(resolver, "GET", "/v1/runs", None, query)
    assert status == 200, body
    return [r["id"] for r in body["runs"]]


def test_runs_are_listed_by_recovery_blockers_and_idempotency_key(api: tuple[WorkflowEnvironment, Any]) -> None:
    env, resolver = api
    ok = env.run("wf", "ok", idempotency_key="order-1").id
    failed = env.run("wf", "fail").id
    blocked = env.start("wf", "dup")
    env.drive()
    assert env.get(blocked).blockers, "a duplicate step id blocks the run"

    assert listed(resolver, recovery="compensated") == [failed]
    assert listed(resolver, blocked="true") == [blocked]
    assert set(listed(resolver, blocked="false")) == {ok, failed}
    assert listed(resolver, function_id="wf", idempotency_key="order-1") == [ok]
    assert listed(resolver, function_id="wf", idempotency_key="order-1", outcome="failed") == []
    assert listed(resolver, function_id="wf", idempotency_key="order-2") == []
    assert listed(resolver, function_id="other", idempotency_key="order-1") == []

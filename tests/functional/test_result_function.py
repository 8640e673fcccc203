"""The result function's Lambda handler (issue 25): a Function URL event in, the engine's answer out. The whole
path (signatures, the write, carrying the run on) runs in the stack in a box (tests/infra)."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace
from typing import Any

import pytest

from ryusen._internal.wire import HeartbeatReply
from ryusen_server.engine import ServerSettings
from ryusen_server.lambdas import results
from ryusen_server.ports import StoreUnavailableError
from tests.lambda_http import LambdaContext


class FakeEngine:
    def __init__(self) -> None:
        self.settings = ServerSettings()
        self.posted: list[tuple[str, bytes, float | None]] = []
        self.refuse: Exception | None = None

    def submit_heartbeat(self, body: bytes, headers: dict[str, str], *, path: str | None = None) -> HeartbeatReply:
        self.posted.append(("heartbeat", body, None))
        return HeartbeatReply(current=True, stop_requested="cancel")

    def submit_result(
        self, body: bytes, headers: dict[str, str], *, budget_s: float | None = None, path: str | None = None
    ) -> Any:
        if self.refuse is not None:
            raise self.refuse
        self.posted.append(("result", body, budget_s))
        return SimpleNamespace(note=None)

    def submit_completion(self, body: bytes, headers: dict[str, str], *, path: str | None = None) -> Any:
        self.posted.append(("completion", body, None))
        return SimpleNamespace(state=SimpleNamespace(id="r", phase=SimpleNamespace(value="running"), outcome=None))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    engine = FakeEngine()
    monkeypatch.setattr(results, "_engine", SimpleNamespace(engine=engine))
    return engine


def event(body: bytes, *, method: str = "POST", encoded: bool = True) -> dict[str, Any]:
    return {
        "version": "2.0",
        "headers": {"content-type": "application/json"},
        "requestContext": {"http": {"method": method, "path": "/"}, "domainName": "abc.lambda-url.us-east-1.on.aws"},
        "body": base64.b64encode(body).decode() if encoded else body.decode(),
        "isBase64Encoded": encoded,
    }


def test_an_outcome_is_handed_on_with_the_time_left_and_the_url_is_the_functions_own(fake: FakeEngine) -> None:
    answer = results.handler(event(b'{"run_id": "r"}'), LambdaContext(60))
    assert answer["statusCode"] == 202 and json.loads(answer["body"]) == {"accepted": True, "note": None}
    [(kind, body, budget)] = fake.posted
    assert kind == "result" and body == b'{"run_id": "r"}' and budget is not None and 50 < budget <= 57
    assert fake.settings.result_url == "https://abc.lambda-url.us-east-1.on.aws/"  # what it hands SDKs on


def test_an_apps_completion_is_taken_as_a_completion(fake: FakeEngine) -> None:
    post = b'{"kind": "completion", "run_id": "r", "step_id": "s", "phase": "forward", "generation": 1, "token": "t"}'
    answer = results.handler(event(post, encoded=False), LambdaContext(60))
    assert answer["statusCode"] == 200 and json.loads(answer["body"]) == {
        "taken": True,
        "run_id": "r",
        "phase": "running",
        "outcome": None,
    }
    assert [k for k, _, _ in fake.posted] == ["completion"]


def test_a_heartbeat_gets_its_reply(fake: FakeEngine) -> None:
    beat = b'{"kind": "heartbeat", "run_id": "r", "step_id": "s", "phase": "forward", "generation": 1}'
    answer = results.handler(event(beat, encoded=False), LambdaContext(60))
    assert answer["statusCode"] == 200 and json.loads(answer["body"])["stop_requested"] == "cancel"
    assert [k for k, _, _ in fake.posted] == ["heartbeat"]


def test_bad_requests_get_a_structured_error_and_reach_nothing(fake: FakeEngine) -> None:
    cases = [
        (event(b"{}", method="GET"), 405, "method_not_allowed"),
        ({**event(b"{}"), "body": "***not base64***"}, 400, "malformed_body"),
        (event(b"x" * (3 * 1024 * 1024), encoded=False), 413, "payload_too_large"),
    ]
    for bad, status, code in cases:
        answer = results.handler(bad, LambdaContext(60))
        assert answer["statusCode"] == status and json.loads(answer["body"])["error"]["code"] == code
    assert fake.posted == []


def test_a_store_outage_answers_503_so_the_sdk_posts_again(fake: FakeEngine) -> None:
    fake.refuse = StoreUnavailableError("throttled")
    answer = results.handler(event(b'{"run_id": "r"}'), LambdaContext(60))
    assert answer["statusCode"] == 503 and json.loads(answer["body"])["error"]["code"] == "store_unavailable"


def test_an_outcome_a_heartbeat_or_a_completion_taken_writes_no_log_line(
    fake: FakeEngine, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Every step posts here: a line each would be CloudWatch Logs bytes per step (a metric's EMF line is about
    300 bytes). Lambda's own Invocations metric counts these posts; only refusals and outages are logged."""
    beat = b'{"kind": "heartbeat", "run_id": "r", "step_id": "s", "phase": "forward", "generation": 1}'
    done = b'{"kind": "completion", "run_id": "r", "step_id": "s", "phase": "forward", "generation": 1, "token": "t"}'
    capsys.readouterr()
    for body in (b'{"run_id": "r"}', beat, done, b'{"run_id": "r"}'):
        assert results.handler(event(body), LambdaContext(60))["statusCode"] in (200, 202)
    written = capsys.readouterr()
    assert (written.out, written.err) == ("", "")
    fake.refuse = StoreUnavailableError("throttled")
    assert results.handler(event(b'{"run_id": "r"}'), LambdaContext(60))["statusCode"] == 503
    assert "could not take a posted outcome" in caplog.text  # an outage is still logged

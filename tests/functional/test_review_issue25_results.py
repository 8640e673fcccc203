"""Adversarial review of issue 25: the result function's Lambda handler (handlers/ryusen_server/lambdas/results.py).
Each test names its finding and fails against the reviewed commit."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from ryusen._internal.wire import HeartbeatReply
from ryusen_server.engine import ServerSettings
from ryusen_server.lambdas import results
from tests.lambda_http import LambdaContext


class FakeEngine:
    def __init__(self) -> None:
        self.settings = ServerSettings()
        self.posted: list[bytes] = []

    def submit_heartbeat(self, body: bytes, headers: dict[str, str], *, path: str | None = None) -> HeartbeatReply:
        self.posted.append(body)
        return HeartbeatReply(current=True)

    def submit_result(
        self, body: bytes, headers: dict[str, str], *, budget_s: float | None = None, path: str | None = None
    ) -> Any:
        self.posted.append(body)
        return SimpleNamespace(note=None)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    engine = FakeEngine()
    monkeypatch.setattr(results, "_engine", SimpleNamespace(engine=engine))
    return engine


def event(body: str, *, domain: str = "abc.lambda-url.us-east-1.on.aws") -> dict[str, Any]:
    return {
        "version": "2.0",
        "headers": {"content-type": "application/json"},
        "requestContext": {"http": {"method": "POST", "path": "/"}, "domainName": domain},
        "body": body,
        "isBase64Encoded": False,
    }


# FINDING F: the result URL the result function hands SDKs (in every task request it sends while carrying a run
# on) is taken from the first request's requestContext.domainName, whatever it is, before anything about the
# request is checked. Whoever can put an event in front of the function with another domain (a direct Invoke by a
# principal allowed only to invoke, a proxy or CDN forwarding its own Host) makes every SDK post outcomes, results
# and heartbeats of every run to that host for the container's life. Take it from configuration, or accept only
# the form of a Lambda URL domain (*.lambda-url.<region>.on.aws), and only from a request that verified.
def test_review25_the_result_url_is_not_taken_from_an_unchecked_request(fake: FakeEngine) -> None:
    results.handler(event("{}", domain="collector.attacker.example"), LambdaContext(60))
    assert fake.settings.result_url != "https://collector.attacker.example/", (
        "an unauthenticated request chose where every SDK posts its outcomes"
    )


# FINDING G: ryusen.heartbeat() posts synchronously (urllib, HEARTBEAT_TIMEOUT_S = 5 s). An async step's callback
# (AsyncStep, served on an ASGI loop by handle_async) that calls it blocks the whole event loop for the post: every
# other request on that server (other runs' attempts, whose 0.25 s acknowledgement window is then missed) waits.
def test_review25_a_heartbeat_in_an_async_callback_does_not_block_the_event_loop() -> None:
    import ryusen
    from ryusen._internal.heartbeat import SINK, HeartbeatSink
    from ryusen._internal.wire import Phase

    def slow_post(beat: Any) -> HeartbeatReply:
        time.sleep(1.0)  # a result URL that takes a second to answer
        return HeartbeatReply(current=True)

    async def main() -> float:
        SINK.set(HeartbeatSink(post=slow_post, run_id="r", step_id="s", phase=Phase.FORWARD, generation=1))
        gaps: list[float] = []

        async def ticker() -> None:
            last = time.monotonic()
            for _ in range(30):
                await asyncio.sleep(0.05)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        async def callback() -> None:  # an async step's callback
            await asyncio.sleep(0.1)
            ryusen.heartbeat({"progress": 0.5})

        await asyncio.gather(ticker(), callback())
        return max(gaps)

    assert threading.current_thread() is threading.main_thread()
    worst = asyncio.run(main())
    assert worst < 0.5, f"the event loop was blocked for {worst:.2f}s by one heartbeat"

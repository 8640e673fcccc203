"""Invokers: how the engine calls an app's endpoint.

``HttpInvoker`` tells apart a request that provably never reached the app
(connection refused: ``unreachable``) from one whose outcome is unknown (sent,
then timed out or dropped: ``lost``), as decisions 6.4 requires.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from ryusen._internal.app import HandlerResponse

from .ports import InvokeResult, RequestCounter
from .urls import EndpointPolicy, EndpointRefusedError


class HttpInvoker:
    def __init__(self, counter: RequestCounter | None = None, *, policy: EndpointPolicy | None = None) -> None:
        """``policy``: what the endpoint URL may reach (decisions 22), checked before each request, which then
        goes to the address the check resolved; None only where nothing but loopback is served (tests)."""
        self._client = httpx.Client(http2=False, follow_redirects=False)
        self.counter = counter or RequestCounter()
        self.policy = policy

    def invoke(self, url: str, body: bytes, headers: dict[str, str], *, timeout_s: float) -> InvokeResult:
        """POST the task and read the answer within ``timeout_s`` in all (an answer that trickles in counts
        as timed out once the time is up, as a silent one does)."""
        self.counter.add("endpoint.invoke", len(body))
        extensions: dict[str, Any] | None = None
        if self.policy is not None:
            try:
                target = self.policy.check(url)
            except EndpointRefusedError as exc:
                return InvokeResult(kind="unreachable", detail=f"not sent: {exc.message}")
            url, headers = target.url, {**headers, "Host": target.host_header}
            extensions = {"sni_hostname": target.sni_hostname} if target.sni_hostname else None
        timeout = httpx.Timeout(timeout_s, connect=min(10.0, timeout_s))
        deadline = time.monotonic() + timeout_s
        try:
            with self._client.stream(
                "POST", url, content=body, headers=headers, timeout=timeout, extensions=extensions
            ) as response:
                watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), response.close)
                watchdog.daemon = True
                watchdog.start()
                try:
                    content = b"".join(response.iter_bytes())
                finally:
                    watchdog.cancel()
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout("the answer did not complete in time")
                return InvokeResult(
                    kind="response", status=response.status_code, headers=dict(response.headers), body=content
                )
        # Details name the error's kind only: an exception's text may quote what the other end sent (a
        # banner, a header line), and nothing an endpoint answers is repeated unless it is a valid answer.
        except httpx.ConnectError as exc:
            return InvokeResult(kind="unreachable", detail=f"connection failed before sending ({type(exc).__name__})")
        except httpx.ConnectTimeout:
            return InvokeResult(kind="unreachable", detail="connect timed out")
        except httpx.TimeoutException as exc:
            return InvokeResult(
                kind="timed_out", detail=f"no response within {timeout_s:g}s after sending ({type(exc).__name__})"
            )
        except (httpx.HTTPError, httpx.StreamError) as exc:
            if time.monotonic() > deadline:
                return InvokeResult(kind="timed_out", detail=f"no complete response within {timeout_s:g}s")
            return InvokeResult(kind="lost", detail=f"connection lost after sending ({type(exc).__name__})")

    def close(self) -> None:
        self._client.close()


Handler = Callable[[str, dict[str, str], bytes], HandlerResponse]


class InProcessInvoker:
    """Calls an app's framework-agnostic handler directly (``ryusen.testing``), keyed by URL."""

    def __init__(self, counter: RequestCounter | None = None) -> None:
        self.apps: dict[str, Handler] = {}
        self.counter = counter or RequestCounter()
        self.intercept: Callable[[str, bytes, dict[str, str]], InvokeResult | None] | None = None

    def invoke(self, url: str, body: bytes, headers: dict[str, str], *, timeout_s: float) -> InvokeResult:
        self.counter.add("endpoint.invoke", len(body))
        if self.intercept is not None:
            forced = self.intercept(url, body, headers)
            if forced is not None:
                return forced
        handler = self.apps.get(url)
        if handler is None:
            return InvokeResult(kind="unreachable", detail=f"nothing serves {url}")
        response = handler("POST", headers, body)
        status = response.status
        return InvokeResult(kind="response", status=status, headers=dict(response.headers), body=response.body)

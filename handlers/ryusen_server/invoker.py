"""Invokers: how the engine calls an app's endpoint.

``HttpInvoker`` tells apart a request that provably never reached the app
(connection refused: ``unreachable``) from one whose outcome is unknown (sent,
then timed out or dropped: ``lost``), as decisions 6.4 requires.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from ryusen._internal.app import HandlerResponse

from .ports import InvokeResult, RequestCounter
from .urls import EndpointPolicy, EndpointRefusedError

WORKER_SLACK_S = 0.25
"""How long past the deadline the caller waits for the worker's own answer (a timeout it reports itself
names what timed out better)."""


class _Call:
    """One invocation on its worker thread: its result, whether the request had begun to be sent (before
    that, nothing of it can have reached the endpoint), and the connections it opened (shut if abandoned)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result = InvokeResult(kind="lost", detail="no result")
        self.sending = False
        self._streams: list[Any] = []
        self._lock = threading.Lock()
        self._abandoned = False

    def trace(self, event: str, info: dict[str, Any]) -> None:
        if event.endswith("send_request_headers.started"):
            self.sending = True
        elif event == "connection.connect_tcp.complete":
            with self._lock:
                self._streams.append(info.get("return_value"))
                abandoned = self._abandoned
            if abandoned:
                self.abandon()

    def run(self, send: Callable[..., InvokeResult], *args: Any) -> None:
        try:
            self.result = send(*args)
        except Exception as exc:  # noqa: BLE001 - reported as the invocation's outcome, never raised in a thread
            self.result = InvokeResult(kind="lost" if self.sending else "unreachable", detail=type(exc).__name__)
        finally:
            self.done.set()

    def abandon(self) -> None:
        """Shut the sockets this call opened: a worker blocked reading a trickle ends now."""
        with self._lock:
            self._abandoned = True
            streams = list(self._streams)
        for stream in streams:
            sock = stream.get_extra_info("socket") if stream is not None else None
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class HttpInvoker:
    def __init__(self, counter: RequestCounter | None = None, *, policy: EndpointPolicy | None = None) -> None:
        """``policy``: what the endpoint URL may reach (decisions 22), checked before each request, which then
        goes to the address the check resolved; None only where nothing but loopback is served (tests)."""
        self._client = httpx.Client(http2=False, follow_redirects=False)
        self.counter = counter or RequestCounter()
        self.policy = policy

    def invoke(self, url: str, body: bytes, headers: dict[str, str], *, timeout_s: float) -> InvokeResult:
        """POST the task and have its whole answer within ``timeout_s``: one deadline for the connection, the
        request, the status line and headers, and the body. An endpoint that trickles its answer, a byte now
        and then inside every read timeout, is timed out when the time is up, as a silent one is.

        The call runs on a worker thread while this one waits for the deadline; at the deadline the
        connection is shut (when this call opened it) and the worker is left to end on its own."""
        self.counter.add("endpoint.invoke", len(body))
        extensions: dict[str, Any] = {}
        if self.policy is not None:
            try:
                target = self.policy.check(url)
            except EndpointRefusedError as exc:
                return InvokeResult(kind="unreachable", detail=f"not sent: {exc.message}")
            url, headers = target.url, {**headers, "Host": target.host_header}
            if target.sni_hostname:
                extensions["sni_hostname"] = target.sni_hostname
        deadline = time.monotonic() + timeout_s
        call = _Call()
        extensions["trace"] = call.trace
        worker = threading.Thread(
            target=call.run, args=(self._send, url, body, headers, timeout_s, extensions, deadline), daemon=True
        )
        worker.start()
        if call.done.wait(max(0.0, deadline - time.monotonic()) + WORKER_SLACK_S):
            return call.result
        call.abandon()
        if not call.sending:
            return InvokeResult(kind="unreachable", detail=f"no connection within {timeout_s:g}s (nothing sent)")
        return InvokeResult(kind="timed_out", detail=f"no complete response within {timeout_s:g}s")

    def _send(
        self,
        url: str,
        body: bytes,
        headers: dict[str, str],
        timeout_s: float,
        extensions: dict[str, Any],
        deadline: float,
    ) -> InvokeResult:
        timeout = httpx.Timeout(timeout_s, connect=min(10.0, timeout_s))
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

"""Issue 24, finding 9: one overall deadline per call to an endpoint.

httpx's timeouts are per read: an endpoint that sends a byte of its headers now and then, each inside the read
timeout, held a dispatcher 128 s past a 3 s timeout. The dispatcher must be free when the time is up, and say
whether anything can have reached the endpoint.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from ryusen_server.invoker import HttpInvoker
from ryusen_server.ports import InvokeResult


class Trickler:
    """A TCP server that reads a request, then sends an HTTP status line and headers a byte at a time, one
    every 0.2 s, for as long as the client listens (or never accepts, with ``accept=False``)."""

    def __init__(self, *, accept: bool = True) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1 if accept else 0)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.client_left = threading.Event()
        if accept:
            threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        conn.recv(65536)
        line = b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10_000
        try:
            for byte in line:
                if self.stop.wait(0.2):
                    break
                conn.sendall(bytes([byte]))
        except OSError:
            self.client_left.set()
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture
def trickler() -> Iterator[Trickler]:
    server = Trickler()
    yield server
    server.close()


def invoke_in_thread(invoker: HttpInvoker, url: str, timeout_s: float) -> tuple[threading.Thread, list[InvokeResult]]:
    results: list[InvokeResult] = []
    thread = threading.Thread(target=lambda: results.append(invoker.invoke(url, b"{}", {}, timeout_s=timeout_s)))
    thread.daemon = True
    thread.start()
    return thread, results


def test_an_endpoint_that_trickles_its_headers_is_timed_out_when_the_time_is_up(trickler: Trickler) -> None:
    invoker = HttpInvoker()
    thread, results = invoke_in_thread(invoker, f"http://127.0.0.1:{trickler.port}/", timeout_s=1.0)
    # without one deadline the trickle (a byte every 0.2 s, inside every read timeout) holds the call for
    # the whole 10,000 bytes (over half an hour): it must be over long before that
    thread.join(timeout=30)
    assert not thread.is_alive(), "the invocation was still waiting for the trickle after 30 s"
    [result] = results
    assert result.kind == "timed_out", result
    assert "1s" in result.detail
    # the connection this call opened is shut, so the endpoint sees the dispatcher leave
    assert trickler.client_left.wait(10), "the trickling connection was left open"

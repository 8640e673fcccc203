"""``ryusen ui --server URL`` (issue 26): the dev UI's page served on loopback, ``/v1/*`` forwarded to the API as
it was asked, and the local guard's rules kept (a browser's change needs the page's session token)."""

from __future__ import annotations

import io
import json
from typing import Any

import httpx

from ryusen_server.local.remote_ui import remote_ui_app


def call(
    app: Any, method: str, path: str, body: bytes = b"", host: str = "127.0.0.1:8701", **headers: str
) -> tuple[str, bytes]:
    environ = {
        "REQUEST_METHOD": method,
        "PATH_INFO": path.split("?")[0],
        "QUERY_STRING": path.split("?")[1] if "?" in path else "",
        "HTTP_HOST": host,
        "CONTENT_LENGTH": str(len(body)),
        "CONTENT_TYPE": "application/json" if body else "",
        "wsgi.input": io.BytesIO(body),
        **{f"HTTP_{k.upper()}": v for k, v in headers.items()},
    }
    status: list[str] = []
    out = b"".join(app(environ, lambda s, h: status.append(s)))
    return status[0], out


def test_the_api_is_forwarded_and_a_browsers_change_needs_the_session_token() -> None:
    seen: list[httpx.Request] = []

    def api(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(202, json={"id": "run_1", "phase": "running"})

    app = remote_ui_app("http://127.0.0.1:9/", "tok", lambda: 8701, transport=httpx.MockTransport(api))
    status, page = call(app, "GET", "/")
    assert status.startswith("200") and b'content="remote"' in page and b'content="tok"' in page
    status, body = call(app, "GET", "/v1/runs?phase=running")
    assert status.startswith("202") and json.loads(body)["id"] == "run_1"
    assert str(seen[-1].url) == "http://127.0.0.1:9/v1/runs?phase=running"
    status, _ = call(app, "POST", "/v1/runs/run_1/cancel", b'{"reason": "x"}', ORIGIN="http://127.0.0.1:8701")
    assert status.startswith("403") and len(seen) == 1  # no token: refused here, never forwarded
    status, _ = call(
        app, "POST", "/v1/runs/run_1/cancel", b'{"reason": "x"}', ORIGIN="http://127.0.0.1:8701", X_RYUSEN_SESSION="tok"
    )
    assert status.startswith("202") and seen[-1].content == b'{"reason": "x"}' and seen[-1].method == "POST"
    status, _ = call(app, "GET", "/v1/runs", host="rebound.example:8701")
    assert status.startswith("421") and len(seen) == 2  # a name rebound to loopback reaches nothing

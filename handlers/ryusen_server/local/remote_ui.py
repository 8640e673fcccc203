"""``ryusen ui --server URL``: the dev UI on loopback over a deployed API.

The page and its built files are served here; ``/v1/*`` is forwarded to the deployed API, signed with SigV4
with the caller's AWS credentials (``ryusen._internal.client``; a loopback server goes unsigned). The same rules
as ``ryusen dev`` hold (``local/guard.py``): a loopback ``Host``, and a browser's change carries the session
token only this page was given. There is no event stream: the page refetches what it shows every few seconds.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Iterable
from typing import Any

import httpx

from ryusen._internal.client import _settings
from ryusen._internal.serve import content_length

from ..api import MAX_BODY_BYTES
from .guard import UI_HEADERS, RefusedError, guarded
from .ui import index_html, static_file


def remote_ui_app(
    server: str, session_token: str, port: Callable[[], int], *, transport: httpx.BaseTransport | None = None
) -> Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]:
    """The WSGI app: the page, its files, and ``/v1/*`` forwarded to ``server``."""
    base, auth = _settings(server, "auto")
    upstream = httpx.Client(base_url=base, auth=auth, timeout=30.0, transport=transport)
    page = index_html(session_token, title="Ryusen", mode="remote")

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = str(environ.get("PATH_INFO", "/"))
        method = str(environ["REQUEST_METHOD"])
        if method == "GET" and path in ("/", "/index.html"):
            start_response("200 OK", [("Content-Type", "text/html; charset=utf-8"), *UI_HEADERS])
            return [page]
        if method == "GET" and path.startswith("/static/") and (found := static_file(path[8:])) is not None:
            start_response("200 OK", [("Content-Type", found[1]), ("Cache-Control", "no-cache")])
            return [found[0]]
        if not path.startswith("/v1/") or path == "/v1/results":
            return RefusedError(404, "route_not_found", f"no route {method} {path}").answer(start_response)
        length = content_length(environ)
        if length is None or length > MAX_BODY_BYTES:
            return RefusedError(413, "payload_too_large", "request body too large").answer(start_response)
        body = environ["wsgi.input"].read(length) if length else b""
        headers = {"accept": str(environ.get("HTTP_ACCEPT", "application/json"))}
        if environ.get("CONTENT_TYPE"):
            headers["content-type"] = str(environ["CONTENT_TYPE"])
        query = str(environ.get("QUERY_STRING", ""))
        try:
            answer = upstream.request(method, path + (f"?{query}" if query else ""), content=body, headers=headers)
        except httpx.HTTPError as exc:
            return RefusedError(502, "upstream_unreachable", f"{server}: {exc}").answer(start_response)
        start_response(
            f"{answer.status_code} {answer.reason_phrase or 'Status'}",
            [("Content-Type", answer.headers.get("content-type", "application/json"))],
        )
        return [answer.content]

    return guarded(app, port, session_token=session_token)


def run_remote_ui(server: str, port: int) -> int:
    from werkzeug.serving import make_server

    token = secrets.token_urlsafe(32)
    app = remote_ui_app(server, token, lambda: port)
    http = make_server("127.0.0.1", port, app, threaded=True)
    print(f"ryusen ui: {server} at http://127.0.0.1:{port}/ (Ctrl-C to stop)", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        http.serve_forever()
    return 0

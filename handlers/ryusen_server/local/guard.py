"""What keeps web pages from driving the local stack (issue 11, findings 2 and 3).

``ryusen dev`` serves its API, its UI and an embedded moto on loopback. Loopback is not a boundary for a
browser: any page the developer opens may send requests to ``127.0.0.1`` (a cross-site ``text/plain`` POST
needs no preflight), and a page whose name is rebound to ``127.0.0.1`` (DNS rebinding) is even same-origin.
So every request must name the server by a loopback ``Host``; a request that changes anything must not come
from another site (``Origin``, ``Sec-Fetch-Site``), must be JSON when it has a body (which a cross-site page
cannot send without a preflight the stack never grants), and, when a browser sends it, must carry the
session token that only the UI's own page was given. Local processes (the CLI, the SDK's late results,
scripts) send no browser headers and need no token: the stack trusts its machine's user, as docs/security.md
says.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Iterable
from typing import Any

from ryusen._internal.serve import content_length

SESSION_HEADER = "X-Ryusen-Session"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def loopback_hosts(port: int) -> frozenset[str]:
    return frozenset({f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"})


class RefusedError(Exception):
    """A request the local stack refuses before its API sees it: a structured error, as the API's."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def answer(self, start_response: Callable[..., Any]) -> list[bytes]:
        body = json.dumps({"error": {"code": self.code, "message": self.message}}).encode()
        start_response(
            f"{self.status} Refused", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        )
        return [body]


def loopback_only(app: Callable[..., Iterable[bytes]], port: Callable[[], int]) -> Callable[..., Iterable[bytes]]:
    """``app`` (a dev app server's endpoint) answering only requests that name it by a loopback ``Host``: a page
    whose name was rebound to ``127.0.0.1`` (DNS rebinding) reaches nothing, not even the manifest. A refusal
    is a 421 ``foreign_host``, before the app sees the request."""

    def only_loopback(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        host = str(environ.get("HTTP_HOST", "")).lower()
        if host not in loopback_hosts(port()):
            refused = RefusedError(
                421, "foreign_host", f"this app server answers only to 127.0.0.1:{port()} or localhost:{port()}"
            )
            return refused.answer(start_response)
        return app(environ, start_response)

    return only_loopback


def _browser(environ: dict[str, Any]) -> bool:
    """Sent by a browser: a page's request carries at least one of these; the CLI, boto3 and the SDK none."""
    return any(k in environ for k in ("HTTP_ORIGIN", "HTTP_SEC_FETCH_SITE", "HTTP_REFERER", "HTTP_COOKIE"))


def check(environ: dict[str, Any], port: int, *, session_token: str | None, browsers: bool = True) -> None:
    """Raise :class:`RefusedError` unless the request may reach the local stack on ``port``.

    ``browsers=False`` (the embedded moto) refuses every request a browser sends.
    """
    host = str(environ.get("HTTP_HOST", "")).lower()
    if host not in loopback_hosts(port):
        raise RefusedError(
            421, "foreign_host", f"this server answers only to 127.0.0.1:{port} or localhost:{port}, not {host!r}"
        )
    if not browsers:
        if _browser(environ):
            raise RefusedError(403, "cross_site_request", "a browser may not reach this server")
        return  # boto3 and its own content types
    if environ.get("REQUEST_METHOD", "GET") in SAFE_METHODS:
        return
    origin = environ.get("HTTP_ORIGIN")
    if origin is not None and origin.lower() not in {f"http://{h}" for h in loopback_hosts(port)}:
        raise RefusedError(403, "cross_site_request", f"a request from {origin!r} may not change anything here")
    site = environ.get("HTTP_SEC_FETCH_SITE")
    if site is not None and site.lower() not in ("same-origin", "none"):
        raise RefusedError(403, "cross_site_request", f"a {site} request may not change anything here")
    length = content_length(environ)
    content_type = str(environ.get("CONTENT_TYPE", "")).split(";", 1)[0].strip().lower()
    if length and content_type != "application/json":
        raise RefusedError(415, "json_required", "a request body must be JSON (Content-Type: application/json)")
    if session_token is not None and _browser(environ):
        given = str(environ.get("HTTP_X_RYUSEN_SESSION", ""))
        if not hmac.compare_digest(given.encode("utf-8", "replace"), session_token.encode()):
            raise RefusedError(403, "session_token_required", "a browser's change needs the dev UI's session token")


def guarded(
    app: Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]],
    port: Callable[[], int],
    *,
    session_token: str | None = None,
    browsers: bool = True,
) -> Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]:
    """``app`` behind :func:`check` (``port`` read per request: a server learns its port once bound)."""

    def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        try:
            check(environ, port(), session_token=session_token, browsers=browsers)
        except RefusedError as refused:
            return refused.answer(start_response)
        return app(environ, start_response)

    return wsgi


UI_HEADERS = [
    (
        "Content-Security-Policy",
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline';"
        " img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    ),
    ("X-Frame-Options", "DENY"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
]
"""The UI page's headers: never framed (no clickjacking of Cancel), its token never leaves it."""

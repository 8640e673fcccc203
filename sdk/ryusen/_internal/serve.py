"""Serve adapters: they only translate a framework's request to :meth:`Ryusen.handle`."""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    from .app import Ryusen

log = logging.getLogger("ryusen")

MAX_REQUEST_BYTES = 8 * 1024 * 1024
"""The largest task request an endpoint reads (the app's own check answers 413 above it)."""

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


DRAIN_ON_SHUTDOWN_S = 30.0
"""How long an ASGI server's shutdown waits for attempts answered ``accepted`` to end and post their outcomes."""


def asgi_app(app: Ryusen) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    # attempts answered "accepted" end and post their outcomes first (a deploy, a scale-in)
                    await asyncio.to_thread(app.drain, DRAIN_ON_SHUTDOWN_S)
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        chunks = []
        received, more = 0, True
        while more:
            message = await receive()
            chunk = message.get("body", b"")
            received += len(chunk)
            if received <= MAX_REQUEST_BYTES + 1:  # past the limit it is refused: kept no further
                chunks.append(chunk)
            more = message.get("more_body", False)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        response = await app.handle_async(scope["method"], headers, b"".join(chunks), path=asgi_path(scope))
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [(k.encode(), v.encode()) for k, v in response.headers.items()],
            }
        )
        await send({"type": "http.response.body", "body": response.body})

    return asgi


def asgi_path(scope: Scope) -> str:
    """The path the client sent (``raw_path``, which a mount does not shorten), as a task request is signed."""
    raw = scope.get("raw_path")
    if isinstance(raw, bytes) and raw:
        return raw.decode("latin-1").split("?", 1)[0]
    return quote(str(scope.get("root_path", "")) + str(scope.get("path", "/")), safe="/:@!$&'()*+,;=-._~")


def wsgi_path(environ: dict[str, Any]) -> str:
    """The path the client sent: the raw request URI where the server gives it, else the mount's
    ``SCRIPT_NAME`` and ``PATH_INFO`` (PEP 3333 strings) encoded again."""
    raw = environ.get("RAW_URI") or environ.get("REQUEST_URI")
    if isinstance(raw, str) and raw.startswith("/"):
        return raw.split("?", 1)[0]
    whole = (environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "")).encode("latin-1", "replace")
    return quote(whole, safe="/:@!$&'()*+,;=-._~") or "/"


def lambda_path(event: dict[str, Any]) -> str:
    """The path the client sent: a REST API's ``requestContext.path`` (with the stage), else ``rawPath``
    (Function URLs, HTTP APIs), else ``path``."""
    context = event.get("requestContext") or {}
    for path in (context.get("path"), event.get("rawPath"), event.get("path")):
        if isinstance(path, str) and path.startswith("/"):
            return path
    return "/"


_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    405: "Method Not Allowed",
    413: "Payload Too Large",
    503: "Service Unavailable",
}


def content_length(environ: dict[str, Any]) -> int | None:
    """A WSGI request's ``Content-Length`` (0 when absent), or None when it is not a whole number: a
    negative one would otherwise read until the client hangs up."""
    raw = str(environ.get("CONTENT_LENGTH") or "0").strip()
    if not raw.isascii() or not raw.isdigit() or len(raw) > 15:
        return None
    return int(raw)


def wsgi_app(app: Ryusen) -> Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]:
    def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        length = content_length(environ)
        headers = {
            key[5:].replace("_", "-").lower(): value for key, value in environ.items() if key.startswith("HTTP_")
        }
        if environ.get("CONTENT_TYPE"):
            headers["content-type"] = environ["CONTENT_TYPE"]
        if length is None:
            response = app._error(400, "invalid_content_length", "Content-Length must be a whole number of bytes")
        elif length > MAX_REQUEST_BYTES:  # refused before reading it
            response = app._error(413, "request_too_large", "task request is too large")
        else:
            body = environ["wsgi.input"].read(length) if length else b""
            response = app.handle(environ["REQUEST_METHOD"], headers, body, path=wsgi_path(environ))
        start_response(
            f"{response.status} {_REASONS.get(response.status, 'Error')}",
            [*response.headers.items(), ("Content-Length", str(len(response.body)))],
        )
        return [response.body]

    return wsgi


def handle_lambda_event(app: Ryusen, event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """Function URL and API Gateway HTTP API (payload 2.0) or REST API (1.0) events, served as on Lambda
    (``ServeOptions.on_lambda``: nothing runs after the return), with the invocation's ``context``."""
    from .app import ServeOptions
    from .wire import LAMBDA_EVENT_MARKER

    try:
        method = event.get("httpMethod") or event.get("requestContext", {}).get("http", {}).get("method", "POST")
        raw = event.get("body") or ""
        body = base64.b64decode(raw, validate=True) if event.get("isBase64Encoded") else raw.encode()
        headers = {str(k).lower(): str(v) for k, v in (event.get("headers") or {}).items()}
    except (AttributeError, TypeError, ValueError) as exc:
        # not an event of a shape Lambda sends (only a principal allowed to invoke the function can send one):
        # refused, and logged without its contents
        log.error("an event of a shape no Function URL or task event has was refused (%s)", type(exc).__name__)
        response = app._error(400, "invalid_event", "the event is not a Function URL or task event")
        return {"statusCode": response.status, "headers": response.headers, "body": response.body.decode()}
    if event.get(LAMBDA_EVENT_MARKER) == 1:  # an attempt sent as an asynchronous event: nobody waits for this
        response = app.serve_event(headers, body, lambda_path(event), context)
        return {"statusCode": response.status, "headers": response.headers, "body": response.body.decode()}
    options = ServeOptions(on_lambda=True, lambda_context=context)
    response = app._serve(method, headers, body, lambda_path(event), app.signing_keys, options=options)
    return {"statusCode": response.status, "headers": response.headers, "body": response.body.decode()}

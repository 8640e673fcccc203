"""The development UI: a Preact + htm front end (``ui/src``), built by ``./scripts/build-ui`` into ``static/``.

``ryusen dev`` serves the page (:func:`index_html`, which carries the session token a browser's change must
send), the two built files, and ``/dev/events``: a server-sent event for each run the engine decided on, so the
page refetches only what it shows (:class:`RunEvents`).
"""

from __future__ import annotations

import contextlib
import html
import json
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_FILES = {"app.js": "text/javascript; charset=utf-8", "app.css": "text/css; charset=utf-8"}
"""The built files, by name, with their content types."""

BUILD_COMMAND = "./scripts/build-ui"


class UiNotBuiltError(Exception):
    """The UI's built files are missing (a checkout where ``./scripts/build-ui`` has not run)."""


def check_built(directory: Path | None = None) -> None:
    directory = directory or STATIC_DIR
    missing = [name for name in STATIC_FILES if not (directory / name).is_file()]
    if missing:
        raise UiNotBuiltError(
            f"the dev UI is not built ({', '.join(missing)} missing in {directory}); run {BUILD_COMMAND}"
            " (it needs Node.js and npm; ./scripts/bootstrap runs it too)"
        )


def static_file(name: str, directory: Path | None = None) -> tuple[bytes, str] | None:
    """A built file's bytes and content type, or None if ``name`` is not one."""
    directory = directory or STATIC_DIR
    content_type = STATIC_FILES.get(name)
    if content_type is None:
        return None
    try:
        return (directory / name).read_bytes(), content_type
    except FileNotFoundError:
        return None


def index_html(session_token: str, *, title: str = "Ryusen dev", mode: str = "dev") -> bytes:
    """The page: the built script and style, the session token (only this page gets it), and the mode
    (``dev``: live events; ``remote``: ``ryusen ui`` over a deployed API, which polls)."""
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<meta name="ryusen-session" content="{html.escape(session_token)}">'
        f'<meta name="ryusen-mode" content="{html.escape(mode)}">'
        '<link rel="stylesheet" href="/static/app.css">'
        '<script type="module" src="/static/app.js"></script>'
        '</head><body><div id="app"></div></body></html>\n'
    ).encode()


class RunEvents:
    """Which runs changed, for every open page: the engine's ``decided`` hook publishes the run's id and version,
    each ``/dev/events`` stream reads its own bounded queue (a stream that falls behind is told to reload)."""

    QUEUE = 1_000
    PING_S = 15.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: list[queue.Queue[dict[str, Any] | None]] = []
        self._closed = False

    def hook(self, kind: str, payload: Any) -> None:
        """An engine hook (``engine.hooks``): never raises, never blocks the engine."""
        if kind != "decided":
            return
        try:
            state = payload[1].state
            event = {
                "run_id": state.id,
                "version": state.version,
                "function_id": state.function_id,
                "phase": state.phase.value,
            }
        except (AttributeError, IndexError, TypeError):
            return
        self.publish(event)

    def publish(self, event: dict[str, Any]) -> None:
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            try:
                stream.put_nowait(event)
            except queue.Full:
                with self._lock, contextlib.suppress(queue.Empty, queue.Full):
                    while not stream.empty():  # behind: drop what it holds, tell it to refetch everything
                        stream.get_nowait()
                    stream.put_nowait({"reload": True})

    def close(self) -> None:
        with self._lock:
            self._closed = True
            streams = list(self._streams)
        for stream in streams:
            with contextlib.suppress(queue.Full):
                stream.put_nowait(None)

    def stream(self) -> Iterator[bytes]:
        """One page's stream, as ``text/event-stream`` chunks, until the page goes or the stack stops."""
        mine: queue.Queue[dict[str, Any] | None] = queue.Queue(self.QUEUE)
        with self._lock:
            if self._closed:
                return
            self._streams.append(mine)
        try:
            yield b"retry: 1000\n: connected\n\n"
            while True:
                try:
                    event = mine.get(timeout=self.PING_S)
                except queue.Empty:
                    yield b": ping\n\n"
                    continue
                if event is None:
                    return
                name = "reload" if event.get("reload") else "run"
                yield f"event: {name}\ndata: {json.dumps(event)}\n\n".encode()
        finally:
            with self._lock:
                if mine in self._streams:
                    self._streams.remove(mine)


__all__ = ["BUILD_COMMAND", "STATIC_DIR", "RunEvents", "UiNotBuiltError", "check_built", "index_html", "static_file"]

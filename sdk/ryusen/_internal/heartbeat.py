"""Heartbeats from a running callback (decision 33): ``ryusen.heartbeat(details)``.

While an attempt's callback runs, the endpoint puts a :class:`HeartbeatSink` in its context. A heartbeat
posts ``details`` to the server's result URL, signed like a late result (``heartbeat_scope``). The server
extends the attempt's lease by the step's ``heartbeat`` interval and shows the details on the attempt. Its
reply says whether a stop intent was recorded; if one was, this heartbeat and every later one raise
:class:`StopRequested` in the callback. Calls closer together than a quarter of the interval (5 s for a step
that declares none) post nothing, so a tight loop may call it freely. Outside a callback it does nothing.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import RyusenError
from .wire import MAX_HEARTBEAT_DETAILS_BYTES, Heartbeat, HeartbeatReply, Phase, json_value_problem

log = logging.getLogger("ryusen")

UNDECLARED_INTERVAL_S = 5.0
"""How often heartbeats are posted at most for a step that declares no ``heartbeat`` (stop delivery, details)."""


class StopRequested(RyusenError):  # noqa: N818 - the RFD's name for it
    """The run is stopping (``kind``: ``cancel`` or ``timeout``) while this callback runs: finish or clean up
    and return (or raise). Raised by :func:`heartbeat`; raised again by every later heartbeat of the attempt."""

    code = "stop_requested"

    def __init__(self, kind: str) -> None:
        super().__init__(f"the run is stopping ({kind}): finish or clean up and return")
        self.kind = kind


@dataclass
class HeartbeatSink:
    """Where one attempt's heartbeats go (one per attempt request)."""

    post: Callable[[Heartbeat], HeartbeatReply | None]
    run_id: str
    step_id: str
    phase: Phase
    generation: int
    interval_s: float = UNDECLARED_INTERVAL_S
    """The least time between two posts (a quarter of the step's ``heartbeat``)."""
    throttled: bool = True
    """False: every heartbeat is posted (``ryusen.testing``, whose virtual clock does not move on its own)."""
    _last_sent: float | None = None
    _seq: int = 0
    _stop: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def declared(self, heartbeat_s: float | None) -> None:
        """The step's ``heartbeat`` interval, as the callback starts."""
        if heartbeat_s is not None:
            self.interval_s = heartbeat_s / 4

    def beat(self, details: Any) -> None:
        problem = json_value_problem(details)
        if problem is not None:
            raise ValueError(f"heartbeat details must be JSON: the value {problem}")
        size = len(json.dumps(details, separators=(",", ":"), allow_nan=False))
        if size > MAX_HEARTBEAT_DETAILS_BYTES:
            raise ValueError(
                f"heartbeat details are {size} bytes serialized; the limit is {MAX_HEARTBEAT_DETAILS_BYTES}"
            )
        now = time.monotonic()
        with self._lock:
            if self._stop is not None:
                raise StopRequested(self._stop)
            if self.throttled and self._last_sent is not None and now - self._last_sent < self.interval_s:
                return
            self._last_sent = now
            self._seq += 1
            beat = Heartbeat(
                run_id=self.run_id,
                step_id=self.step_id,
                phase=self.phase,
                generation=self.generation,
                seq=self._seq,
                details=details,
            )
        if _on_event_loop():
            # an async callback: the post must not hold the loop (other requests' attempts run on it); a stop it
            # brings back is raised by the next heartbeat
            threading.Thread(target=self._post, args=(beat,), daemon=True).start()
            return
        self._post(beat)
        with self._lock:
            if self._stop is not None:
                raise StopRequested(self._stop)

    def _post(self, beat: Heartbeat) -> None:
        reply = self.post(beat)
        if reply is not None and reply.stop_requested is not None:
            with self._lock:
                self._stop = reply.stop_requested


def _on_event_loop() -> bool:
    """Called from a coroutine (an ``async def`` callback), on its event loop's thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


SINK: contextvars.ContextVar[HeartbeatSink | None] = contextvars.ContextVar("ryusen_heartbeat", default=None)


def heartbeat(details: Any = None) -> None:
    """Tell the server this step's callback is alive, with optional JSON ``details`` (at most 4 KB; a
    ``{"progress": 0.4}`` shows as a progress bar). Raises :class:`StopRequested` once the run is stopping.
    Outside a running callback (a test, a discovery pass) it does nothing."""
    sink = SINK.get()
    if sink is not None:
        sink.beat(details)

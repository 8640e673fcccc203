"""Delayed sends kept in this process, to the millisecond (``ryusen dev``).

Theory of operation. SQS delays a message by whole seconds (``DelaySeconds``),
so on AWS a retry the policy wants in 0.15 s waits 1 s; moto, besides, notices
a delayed message only when its receive's one-second wait ends, so locally the
same retry waited about 2 s. ``ryusen dev`` runs its queue in this process
anyway, so a delayed task is held here instead: one thread keeps the sends in
a heap by due time and makes each when it is due, with no delay, which wakes
the dispatch loop's receive at once. A send that fails (moto answering 500
under load) is tried again shortly; nothing held is dropped while the stack
runs (and when it stops, its in-memory queue goes with it).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("ryusen.dev.delays")

RETRY_FAILED_SEND_S = 0.5
"""How long after a failed send it is tried again."""


class LocalDelays:
    """Calls each function given to :meth:`call_later` when its delay has passed, on one thread of its own."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()  # equal due times keep their order (and functions are never compared)
        self._changed = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="ryusen-delays", daemon=True)
        self._thread.start()

    def call_later(self, delay_s: float, send: Callable[[], None]) -> None:
        """Call ``send`` in ``delay_s`` seconds (never sooner)."""
        with self._changed:
            heapq.heappush(self._due, (self._clock() + max(0.0, delay_s), next(self._order), send))
            self._changed.notify()

    def pending(self) -> int:
        """How many sends are held."""
        with self._changed:
            return len(self._due)

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._stopped and (not self._due or self._due[0][0] > self._clock()):
                    wait = self._due[0][0] - self._clock() if self._due else None
                    self._changed.wait(wait)
                if self._stopped:
                    return
                _, _, send = heapq.heappop(self._due)
            try:
                send()
            except Exception:
                log.warning("a delayed send failed; trying again in %ss", RETRY_FAILED_SEND_S, exc_info=True)
                self.call_later(RETRY_FAILED_SEND_S, send)

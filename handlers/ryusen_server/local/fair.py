"""Fair dispatch on ``ryusen dev``: which received message a free worker runs next.

Theory of operation. Each task message carries its run's app as its message
group (SQS's ``MessageGroupId``, set in ``aws/queue.py``; on AWS the same
group makes the dispatch queue a fair queue). The dev dispatch loop receives
what its free workers could run and adds each message here, in its app's
line. ``next`` hands a free worker to the apps with waiting messages in turn
(round robin), skipping an app whose tasks already hold ``app_workers``
workers: its messages wait here, kept invisible by the loop, rather than take
a worker another app could use. So one app's slow steps hold at most its
share of the workers, and another app's task starts as soon as it is received.

A message without a group (a Scheduler timer, a message sent by an older
engine) is a line of its own, as on a fair queue: it never waits for a share.
Nothing here blocks, sleeps or reads a clock; the loop holds one lock around
every call.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class FairShare(Generic[T]):
    """Waiting messages by app, and the workers each app's tasks hold."""

    def __init__(self, *, workers: int, app_workers: int, app_concurrency: Mapping[str, int] | None = None) -> None:
        """``app_concurrency``: the share of each named app, instead of ``app_workers``."""
        if not 1 <= app_workers <= workers:
            raise ValueError(f"app_workers must be 1 to workers ({workers}), not {app_workers}")
        self.workers = workers
        self.app_workers = app_workers
        self.app_concurrency = dict(app_concurrency or {})
        self._lines: dict[Hashable, deque[T]] = {}
        """Waiting messages by app, in the apps' turn order (an app served goes to the back)."""
        self._held: dict[Hashable, int] = {}
        self._busy = 0
        self._waiting = 0

    @property
    def free(self) -> int:
        """Workers not running a task."""
        return self.workers - self._busy

    @property
    def waiting(self) -> int:
        """Messages received and not yet started."""
        return self._waiting

    def add(self, app: Hashable | None, item: T) -> None:
        """A received message of ``app`` (None: no group, a line of its own)."""
        key = object() if app is None else app
        self._lines.setdefault(key, deque()).append(item)
        self._waiting += 1

    def next(self) -> tuple[Hashable, T] | None:
        """The next message to start and its app (give the app to :meth:`done` when it ends), or None if no
        worker is free or every app with waiting messages holds its share."""
        if self._busy >= self.workers:
            return None
        for app, line in self._lines.items():
            if self._held.get(app, 0) < self.share(app):
                item = line.popleft()
                del self._lines[app]
                if line:
                    self._lines[app] = line  # to the back of the turn order
                self._held[app] = self._held.get(app, 0) + 1
                self._busy += 1
                self._waiting -= 1
                return app, item
        return None

    def share(self, app: Hashable) -> int:
        """The most workers ``app``'s tasks may hold at once."""
        return self.app_concurrency.get(app, self.app_workers) if isinstance(app, str) else self.app_workers

    def done(self, app: Hashable) -> None:
        """A task of ``app`` (as :meth:`next` named it) ended: its worker is free."""
        held = self._held[app] - 1
        if held:
            self._held[app] = held
        else:
            del self._held[app]
        self._busy -= 1

    def waiting_items(self) -> Iterator[T]:
        """Every waiting message (the loop keeps them invisible)."""
        for line in self._lines.values():
            yield from line

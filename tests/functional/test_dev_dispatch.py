"""``ryusen dev``'s dispatch loop takes from the queue only what its workers are free to run. A message received
and left waiting in the pool outlives its visibility, is delivered again, and looks lost to the sweeper: in
issue 12's 1,000-run load that made some 300 needless repairs and as many duplicate tasks."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

from ryusen_server.local.dev import DevStack


class Queue:
    """Hands out as many messages as each receive asks for, and counts what is out and not yet handled."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent = 0
        self.out = 0
        self.most_out = 0
        self.asked: list[int] = []

    def receive_message(self, *, MaxNumberOfMessages: int, **_: Any) -> dict[str, Any]:
        with self.lock:
            self.asked.append(MaxNumberOfMessages)
            messages = [{"Body": str(self.sent + i), "ReceiptHandle": "r"} for i in range(MaxNumberOfMessages)]
            self.sent += len(messages)
            self.out += len(messages)
            self.most_out = max(self.most_out, self.out)
        return {"Messages": messages}


def test_the_dispatch_loop_receives_only_what_its_free_workers_can_run() -> None:
    queue = Queue()
    stack = DevStack(port=0, out=lambda _: None)
    settings = SimpleNamespace(attempt_timeout_s=30, lease_grace_s=5)
    stack.wired = SimpleNamespace(sqs=queue, engine=SimpleNamespace(settings=SimpleNamespace(engine=settings)))  # type: ignore[assignment]
    stack.resources = SimpleNamespace(queue_url="q")  # type: ignore[assignment]
    handled: list[str] = []

    def handle(message: dict[str, Any], **_: Any) -> None:
        time.sleep(0.01)  # a task takes a while: the loop must not pile messages up meanwhile
        with queue.lock:
            queue.out -= 1
            handled.append(message["Body"])

    stack._handle = handle  # type: ignore[method-assign]
    loop = threading.Thread(target=stack._dispatch_loop, daemon=True)
    loop.start()
    deadline = time.monotonic() + 10
    while len(handled) < 200 and time.monotonic() < deadline:
        time.sleep(0.01)
    stack._stop.set()
    loop.join(10)
    assert len(handled) >= 200 and not loop.is_alive()
    assert queue.most_out <= stack.dispatch.workers  # never more received than workers free to run them
    assert max(queue.asked) <= min(10, stack.dispatch.workers)

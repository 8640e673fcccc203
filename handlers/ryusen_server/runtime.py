"""Drivers shared by ``ryusen dev`` and ``ryusen.testing``: the dispatch loop body and timer firing.

In AWS, SQS's event source and EventBridge Scheduler drive the engine through
the Lambda handlers; locally the same ``Engine.deliver`` and
``Engine.fire_timer`` are called from here (moto never fires schedules).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from .core.model import TaskRef, TimerRef
from .engine import Engine

log = logging.getLogger("ryusen.runtime")


class ReceivedMessage(Protocol):
    @property
    def task(self) -> TaskRef: ...


class ReceivingQueue(Protocol):
    def receive(self, max_messages: int = 10) -> Sequence[ReceivedMessage]: ...

    def delete(self, message_id: str) -> None: ...

    def change_visibility(self, message_id: str, delay_s: float) -> None: ...


def handle_message(engine: Engine, queue: ReceivingQueue, message: ReceivedMessage, message_id: str) -> None:
    """Deliver one message; delete it when handled, or keep it as the lease timer."""
    try:
        delivered = engine.deliver(message.task)
    except Exception:
        log.exception("delivering %s failed; the message will be redelivered", message.task.describe())
        return
    if delivered.done:
        queue.delete(message_id)
    else:
        queue.change_visibility(message_id, max(1.0, delivered.redeliver_after_s))


def fire_due(engine: Engine, due: Callable[[], list[TimerRef]]) -> int:
    fired = 0
    for timer in due():
        try:
            engine.fire_timer(timer)
        except Exception:
            log.exception("firing %s failed", timer.name)
        fired += 1
    return fired


def process_body(engine: Engine, body: str) -> tuple[bool, float]:
    """One dispatch-queue message, as the dispatch Lambda and ``ryusen dev`` both handle it.

    The queue carries task messages (a TaskRef) and, from EventBridge
    Scheduler, timer messages (``{"timer": TimerRef}``). Returns (done,
    redeliver_after_s): a message that is not done stays on the queue as the
    lease timer of an attempt in flight.
    """
    data = json.loads(body)
    if isinstance(data, dict) and "timer" in data:
        engine.fire_timer(TimerRef.model_validate(data["timer"]))
        return True, 0.0
    delivered = engine.deliver(TaskRef.model_validate(data))
    return delivered.done, delivered.redeliver_after_s

"""Drivers shared by ``ryusen dev`` and ``ryusen.testing``: the dispatch loop body and timer firing.

In AWS, SQS's event source and EventBridge Scheduler drive the engine through
the Lambda handlers; locally the same ``Engine.deliver`` and
``Engine.fire_timer`` are called from here (moto never fires schedules).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from pydantic import BaseModel, ConfigDict, TypeAdapter

from .core.model import TaskRef, TimerRef
from .deferred import DeferredMessage, WakeMessage
from .engine import STORE_UNAVAILABLE_RETRY_S, Engine
from .ports import StoreUnavailableError

log = logging.getLogger("ryusen.runtime")


class ReceivedMessage(Protocol):
    @property
    def task(self) -> TaskRef | DeferredMessage | WakeMessage: ...


class ReceivingQueue(Protocol):
    def receive(self, max_messages: int = 10) -> Sequence[ReceivedMessage]: ...

    def delete(self, message_id: str) -> None: ...

    def change_visibility(self, message_id: str, delay_s: float) -> None: ...


LEASE_TOLERANCE_S = 2.0
"""A message already invisible for about the lease is left as it is (no ChangeMessageVisibility)."""


def lease_keeper(change_visibility: Callable[[float], None], visible_after_s: float | None) -> Callable[[float], None]:
    """``on_authorized`` for a received message: make it invisible for the task's lease, so that it
    comes back (and the attempt's lease is checked) when the lease expires, not when the visibility
    the message was received with runs out. ``visible_after_s``: that visibility, if known."""

    received = [True]

    def keep(lease_s: float) -> None:
        first, received[0] = received[0], False
        if first and visible_after_s is not None and abs(lease_s - visible_after_s) <= LEASE_TOLERANCE_S:
            return  # just received with that visibility: it already is the lease (later calls extend it)
        change_visibility(lease_s)

    return keep


def handle_message(engine: Engine, queue: ReceivingQueue, message: ReceivedMessage, message_id: str) -> None:
    """Deliver one message; delete it when handled, or keep it as the lease timer."""
    try:
        done, redeliver_after_s = process_message(
            engine,
            message.task,
            on_authorized=lambda lease_s: queue.change_visibility(message_id, lease_s),
            carrier=message_id,
        )
    except Exception:
        log.exception("delivering %s failed; the message will be redelivered", _describe(message.task))
        return
    if done:
        queue.delete(message_id)
    else:
        queue.change_visibility(message_id, max(1.0, redeliver_after_s))


def _describe(message: DispatchMessage) -> str:
    if isinstance(message, TimerMessage):
        return message.timer.name
    if isinstance(message, DeferredMessage):
        return message.deferred.describe()
    if isinstance(message, WakeMessage):
        return message.wake.describe()
    return message.describe()


def fire_due(engine: Engine, due: Callable[[], list[TimerRef]]) -> int:
    fired = 0
    for timer in due():
        try:
            engine.fire_timer(timer)
        except Exception:
            log.exception("firing %s failed", timer.name)
        fired += 1
    return fired


class TimerMessage(BaseModel):
    """What an EventBridge Scheduler schedule puts on the dispatch queue when a timer is due."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    timer: TimerRef


DispatchMessage = TaskRef | TimerMessage | DeferredMessage | WakeMessage
"""One dispatch-queue message: a task (discovery pass or attempt), a due timer, an answer deferred while the
store would not take it, or a release sync's wake (``deferred.py``)."""

_DISPATCH_MESSAGE: TypeAdapter[DispatchMessage] = TypeAdapter(DispatchMessage)


def parse_dispatch_body(body: str | bytes) -> DispatchMessage:
    """A dispatch message from its JSON body; raises pydantic's ValidationError for anything else."""
    return _DISPATCH_MESSAGE.validate_json(body)


def process_message(
    engine: Engine,
    message: DispatchMessage,
    *,
    budget_s: float | None = None,
    on_authorized: Callable[[float], None] | None = None,
    carrier: str | None = None,
) -> tuple[bool, float]:
    """One parsed dispatch-queue message, as the dispatch Lambda and ``ryusen dev`` both handle it.

    Returns (done, redeliver_after_s): a task message that is not done stays on
    the queue as the lease timer of an attempt in flight. ``budget_s``,
    ``on_authorized`` and ``carrier`` (the message's identity) are :meth:`Engine.deliver`'s.
    """
    if isinstance(message, TimerMessage):
        try:
            engine.fire_timer(message.timer)
        except StoreUnavailableError as exc:
            log.warning("firing %s: the store is unavailable (%s); the message comes back", message.timer.name, exc)
            return False, STORE_UNAVAILABLE_RETRY_S
        return True, 0.0
    if isinstance(message, DeferredMessage):
        delivered = engine.apply_deferred(
            message.deferred, budget_s=budget_s, on_authorized=on_authorized, carrier=carrier
        )
        return delivered.done, delivered.redeliver_after_s
    if isinstance(message, WakeMessage):
        try:
            engine.carry_out_wake(message.wake)
        except StoreUnavailableError as exc:
            log.warning("%s: the store is unavailable (%s); the message comes back", message.wake.describe(), exc)
            return False, STORE_UNAVAILABLE_RETRY_S
        return True, 0.0
    delivered = engine.deliver(message, budget_s=budget_s, on_authorized=on_authorized, carrier=carrier)
    return delivered.done, delivered.redeliver_after_s


def process_body(
    engine: Engine,
    body: str,
    *,
    on_authorized: Callable[[float], None] | None = None,
    carrier: str | None = None,
) -> tuple[bool, float]:
    """:func:`process_message` for a raw message body (the local dispatch loop)."""
    return process_message(engine, parse_dispatch_body(body), on_authorized=on_authorized, carrier=carrier)

"""The dispatch queue on SQS (a standard queue with a dead-letter queue).

Theory of operation. A task is one message whose body is the TaskRef JSON.
``send`` delays it with SQS's per-message ``DelaySeconds``, which counts whole
seconds: a delay is rounded up (never early), so on AWS a retry the policy
wants in 0.15 s waits 1 s. Given a ``hold`` (``ryusen dev``, whose queue lives
in its own process), a delay is kept there instead, to the millisecond, and
the message is sent when it is due. SQS caps DelaySeconds at 900 s, so a
longer delay is parked as a
one-time EventBridge Scheduler schedule whose target is this queue and whose
input is the same body: the task arrives on the queue when it is due, as if
it had been sent then. The queue also carries the Scheduler's timer messages
(``{"timer": ...}``), so ``receive`` returns both kinds.

Fair sharing between apps (issue 25). A task is sent with its run's app as
its ``MessageGroupId`` (``message_group``). On a standard queue that makes
the dispatch queue an SQS fair queue: when one app's messages take a
disproportionate share of the messages in flight (or of the consumers'
time), SQS hands out the other apps' messages first. A group does not order
a standard queue's messages or hold one back while another of its group is
in flight (that is a FIFO queue's meaning), and nothing else changes for the
consumer. ``ryusen dev`` reads the same group to share its workers
(``local/fair.py``). Timers and tasks parked on the Scheduler arrive without
a group (its SQS target documents a group for FIFO queues only); a message
without one is a tenant of its own.

A received message is not deleted until its handler is done with it; while
an attempt is in flight, its message is kept invisible for the lease's
remaining time (``change_visibility``) and so is the attempt's lease timer.
A message that keeps failing moves to the dead-letter queue after
``MAX_RECEIVE_COUNT`` receives (the queue's redrive policy).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from botocore.exceptions import BotoCoreError, ClientError
from pydantic import ValidationError

from ..core.model import TaskRef, TimerRef
from ..deferred import DeferralRefusedError, DeferredAnswer, DeferredMessage, WakeMessage, WakeOrder
from ..ports import RequestCounter
from ..runtime import TimerMessage, parse_dispatch_body
from .timers import schedule_name

if TYPE_CHECKING:
    from mypy_boto3_sqs.client import SQSClient

    from .timers import SchedulerTimers

log = logging.getLogger("ryusen.aws.queue")

MAX_DELAY_S = 900
"""SQS's limit on DelaySeconds; longer delays go through the Scheduler."""
MAX_VISIBILITY_S = 43_200
"""SQS's limit on a visibility timeout (12 hours)."""
MAX_MESSAGE_BYTES = 262_144
"""SQS's limit on a message's body (256 KiB)."""
MAX_RECEIVE_COUNT = 10
REFRESH_AFTER_RECEIVES = MAX_RECEIVE_COUNT - 3
"""A message the engine keeps is replaced by a fresh copy at this many receives (the DLQ takes it at 10)."""
CARRIER_ATTRIBUTE = "RyusenCarrier"
"""The message attribute of a kept message's fresh copy naming the message it replaces (its carrier identity)."""
VISIBILITY_TIMEOUT_S = 360
"""The queue's default visibility: the default attempt timeout (300 s) plus the lease grace (60 s)."""
RETENTION_S = 1_209_600
"""14 days, SQS's maximum: a message may be an attempt's lease timer for a long time."""

MAX_GROUP_LENGTH = 128
"""SQS's limit on a MessageGroupId, which may hold only printable ASCII without spaces."""

DelayHold = Callable[[float, Callable[[], None]], None]
"""Where a delayed send can be kept instead of SQS's whole-second ``DelaySeconds``: ``hold(delay_s, send)``
calls ``send`` once ``delay_s`` has passed (``ryusen dev``'s ``LocalDelays.call_later``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SqsMessage:
    """One received message: a task (``task``) or a Scheduler timer (``timer``); exactly one is set."""

    message_id: str
    """The receipt handle: what :meth:`SqsQueue.delete` and :meth:`SqsQueue.change_visibility` take."""
    body: str
    task: TaskRef | None = None
    timer: TimerRef | None = None
    deferred: DeferredAnswer | None = None
    wake: WakeOrder | None = None
    sqs_message_id: str = ""
    receive_count: int = 1


def message_group(app_id: str) -> str:
    """The MessageGroupId of an app's task messages: the app id itself when SQS takes it (1-128 printable
    ASCII characters, no space), otherwise ``sha256:`` and the id's digest (an app id may be 256 characters of
    any kind). Two apps sharing a group would only share their fair share, never each other's messages.

    >>> message_group("shop")
    'shop'
    >>> message_group("café")[:7], len(message_group("café"))
    ('sha256:', 71)
    """
    if len(app_id) <= MAX_GROUP_LENGTH and all(33 <= ord(c) <= 126 for c in app_id):
        return app_id
    return "sha256:" + hashlib.sha256(app_id.encode()).hexdigest()


def app_queue_digest(app_id: str) -> str:
    """What names an app's own dispatch queue (``ryusen_infra.engine.app_queue_digest`` computes the same)."""
    return hashlib.sha256(app_id.encode()).hexdigest()[:12]


def lease_watch_name(key: str) -> str:
    """The schedule name of a lease watch (``SqsQueue.watch_lease``): ``key`` names the attempt."""
    return f"ryusen-lease-{key}"


def _error_code(exc: Exception) -> str:
    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Code", "error"))
    return type(exc).__name__


def parse_body(body: str) -> TaskRef | TimerRef | DeferredAnswer | WakeOrder:
    """A dispatch message's body: a TaskRef, ``{"timer": TimerRef}`` or ``{"deferred": DeferredAnswer}``. Raises
    ValueError if none."""
    message = parse_dispatch_body(body)
    if isinstance(message, TimerMessage):
        return message.timer
    if isinstance(message, WakeMessage):
        return message.wake
    return message.deferred if isinstance(message, DeferredMessage) else message


class SqsQueue:
    """:class:`~ryusen_server.ports.TaskQueue` (and ``runtime.ReceivingQueue``) on SQS."""

    def __init__(
        self,
        sqs_client: SQSClient,
        queue_url: str,
        scheduler: SchedulerTimers | None = None,
        counter: RequestCounter | None = None,
        *,
        clock: Callable[[], datetime] | None = None,
        hold: DelayHold | None = None,
        fair: bool = True,
        app_queues: Mapping[str, tuple[str, str]] | None = None,
        lease_watches: SchedulerTimers | None = None,
    ) -> None:
        """``hold``: keep delays up to ``MAX_DELAY_S`` there instead of in ``DelaySeconds`` (``ryusen dev``).
        ``fair``: send each task with its app's message group (``RYUSEN_FAIR_QUEUE``; off only where SQS has
        no fair queues and would refuse a group on a standard queue). ``app_queues``: the queue (URL, ARN) of each
        app that has one of its own (``app_dispatch_concurrency``), by :func:`app_queue_digest`: its tasks go there,
        those delayed past 15 minutes too (through the Scheduler), anything else to ``queue_url``."""
        self._client = sqs_client
        self.queue_url = queue_url
        self._scheduler = scheduler
        self.counter = counter or RequestCounter()
        self._clock = clock or (lambda: datetime.now(UTC))
        self._hold = hold
        self._fair = fair
        self._app_queues = dict(app_queues or {})
        self._lease_watches = lease_watches or scheduler
        """Where lease watches are parked: a Scheduler client that gives up within seconds (``watch_lease``)."""

    def send(self, task: TaskRef, delay_s: float = 0.0, *, app_id: str | None = None) -> None:
        """Send a task; ``app_id``, its run's app, becomes its message group (fair dispatch between apps)."""
        unset = {"lease_timer": not task.lease_timer, "watches_before": task.watches_before is None}
        body = task.model_dump_json(exclude={k for k, v in unset.items() if v})  # as before they existed
        group = message_group(app_id) if app_id is not None and self._fair else None
        own = self._app_queues.get(app_queue_digest(app_id)) if app_id is not None and self._app_queues else None
        url = own[0] if own is not None else self.queue_url
        if self._hold is not None and 0 < delay_s <= MAX_DELAY_S:
            self._hold(delay_s, lambda: self._send_message(body, 0, group, url=url))  # to the millisecond
            return
        delay = max(0, math.ceil(delay_s))
        if delay > MAX_DELAY_S:
            if self._scheduler is not None:
                at = self._clock() + timedelta(seconds=delay)
                target = own[1] if own is not None else None  # an app's own queue, not the shared dispatchers
                self._scheduler.schedule_message(self._delayed_name(task, body, at), at, body, target_arn=target)
                return
            # without a scheduler the task still must not be lost: it arrives early instead
            log.warning("no scheduler: %s is delayed %ss instead of %ss", task.describe(), MAX_DELAY_S, delay)
            delay = MAX_DELAY_S
        self._send_message(body, delay, group, url=url)

    def watch_lease(self, task: TaskRef, at: datetime, *, key: str, app_id: str | None = None) -> bool:
        """A lease timer parked as a one-time Scheduler schedule named by ``key``, which :meth:`unwatch_lease`
        deletes once its attempt has settled: Scheduler bills the schedules it delivers, not those deleted first.
        False without a scheduler, or when the schedule is refused (a throttle): the caller sends it on SQS."""
        if self._lease_watches is None:
            return False
        unset = {"lease_timer": not task.lease_timer, "watches_before": task.watches_before is None}
        body = task.model_dump_json(exclude={k for k, v in unset.items() if v})
        own = self._app_queues.get(app_queue_digest(app_id)) if app_id is not None and self._app_queues else None
        try:
            self._lease_watches.schedule_message(lease_watch_name(key), at, body, target_arn=own[1] if own else None)
        except (ClientError, BotoCoreError) as exc:
            log.warning("lease watch %s not scheduled (%s): sent on the queue instead", key, _error_code(exc))
            return False
        return True

    def unwatch_lease(self, key: str) -> None:
        """Delete the lease watch's schedule; one already delivered or gone is fine, and a failed delete only
        costs its delivery."""
        if self._lease_watches is None:
            return
        try:
            self._lease_watches.delete(schedule_name(lease_watch_name(key)))
        except (ClientError, BotoCoreError) as exc:
            log.warning("lease watch %s not deleted (%s): it will be delivered", key, _error_code(exc))

    def defer(self, answer: DeferredAnswer, delay_s: float = 0.0) -> None:
        """Put a deferred answer on the queue (``deferred.py``); one over SQS's message limit is refused."""
        body = DeferredMessage(deferred=answer).model_dump_json()
        if (size := len(body.encode())) > MAX_MESSAGE_BYTES:
            raise DeferralRefusedError(f"the deferred answer is {size} bytes; an SQS message holds {MAX_MESSAGE_BYTES}")
        if self._hold is not None and 0 < delay_s <= MAX_DELAY_S:
            self._hold(delay_s, lambda: self._send_message(body, 0))
            return
        self._send_message(body, max(0, min(MAX_DELAY_S, math.ceil(delay_s))))

    def wake(self, order: WakeOrder, delay_s: float = 0.0) -> None:
        """Put a release sync's wake on the queue."""
        body = WakeMessage(wake=order).model_dump_json()
        if self._hold is not None and 0 < delay_s <= MAX_DELAY_S:
            self._hold(delay_s, lambda: self._send_message(body, 0))
            return
        self._send_message(body, max(0, min(MAX_DELAY_S, math.ceil(delay_s))))

    def resend(self, body: str, delay_s: float, *, group: str | None = None, carrier: str | None = None) -> None:
        """Send a received message's body again as a new message (its receive count starts again), due in
        ``delay_s`` at most 15 minutes (if it was wanted later, it comes back early and is kept again), in the
        message group it was received in. ``carrier``: the identity the copy keeps (``CARRIER_ATTRIBUTE``)."""
        delay = max(0, min(MAX_DELAY_S, math.ceil(delay_s)))
        self._send_message(body, delay, group if self._fair else None, carrier=carrier)

    def _send_message(
        self, body: str, delay: int, group: str | None = None, *, carrier: str | None = None, url: str | None = None
    ) -> None:
        self.counter.add("sqs.send", len(body))
        extra: dict[str, Any] = {}
        if group is not None:
            extra["MessageGroupId"] = group
        if carrier is not None:
            extra["MessageAttributes"] = {CARRIER_ATTRIBUTE: {"DataType": "String", "StringValue": carrier}}
        self._client.send_message(QueueUrl=url or self.queue_url, MessageBody=body, DelaySeconds=delay, **extra)

    @staticmethod
    def _delayed_name(task: TaskRef, body: str, at: datetime) -> str:
        # deterministic: sending the same task for the same second twice schedules it once
        digest = hashlib.sha256(f"{body}\n{int(at.timestamp())}".encode()).hexdigest()[:12]
        return f"ryusen-task-{task.run_id}-{digest}"

    def receive(self, max_messages: int = 10, wait_s: float = 0.0) -> list[SqsMessage]:
        """Up to ``max_messages`` (at most 10) visible messages, long-polling up to ``wait_s`` (at most 20)."""
        self.counter.add("sqs.receive")
        response = self._client.receive_message(
            QueueUrl=self.queue_url,
            MaxNumberOfMessages=max(1, min(10, max_messages)),
            WaitTimeSeconds=max(0, min(20, math.ceil(wait_s))),
            MessageSystemAttributeNames=["ApproximateReceiveCount"],
        )
        out: list[SqsMessage] = []
        for raw in response.get("Messages", []):
            body, receipt = raw.get("Body", ""), raw["ReceiptHandle"]
            count = int(raw.get("Attributes", {}).get("ApproximateReceiveCount", "1"))
            try:
                parsed = parse_body(body)
            except (ValueError, ValidationError):
                # Not ours to interpret. It is left on the queue untouched (not deleted): it comes back
                # after the visibility timeout and, after MAX_RECEIVE_COUNT receives, the redrive policy
                # moves it to the dead-letter queue, where an operator can still read it.
                log.error(
                    "malformed dispatch message %s (receive %d of %d before the DLQ): %.200r",
                    raw.get("MessageId"),
                    count,
                    MAX_RECEIVE_COUNT,
                    body,
                )
                continue
            out.append(
                SqsMessage(
                    message_id=receipt,
                    body=body,
                    task=parsed if isinstance(parsed, TaskRef) else None,
                    timer=parsed if isinstance(parsed, TimerRef) else None,
                    deferred=parsed if isinstance(parsed, DeferredAnswer) else None,
                    wake=parsed if isinstance(parsed, WakeOrder) else None,
                    sqs_message_id=raw.get("MessageId", ""),
                    receive_count=count,
                )
            )
        return out

    def delete(self, message_id: str) -> None:
        """Delete a received message by its receipt handle; one already gone is fine."""
        self.counter.add("sqs.delete")
        try:
            self._client.delete_message(QueueUrl=self.queue_url, ReceiptHandle=message_id)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "ReceiptHandleIsInvalid":
                raise
            log.debug("delete: receipt handle no longer valid (message already deleted)")

    def change_visibility(self, message_id: str, delay_s: float) -> None:
        """Make a received message visible again in ``delay_s`` (capped at 12 hours)."""
        self.counter.add("sqs.change_visibility")
        try:
            self._client.change_message_visibility(
                QueueUrl=self.queue_url,
                ReceiptHandle=message_id,
                VisibilityTimeout=max(0, min(MAX_VISIBILITY_S, math.ceil(delay_s))),
            )
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code in ("ReceiptHandleIsInvalid", "MessageNotInflight"):
                log.debug("change_visibility: message no longer in flight (%s)", code)
            elif code == "InvalidParameterValue":
                # AWS refuses to keep a message invisible past 12 h after its first receive; it then
                # returns early, and the engine simply asks for more time again (harmless).
                log.warning("change_visibility refused: %s", exc)
            else:
                raise


def create_queues(sqs_client: SQSClient, name: str) -> tuple[str, str]:
    """Create the dispatch queue ``name`` and its dead-letter queue ``{name}-dlq``; returns both URLs."""
    dlq_url = sqs_client.create_queue(QueueName=f"{name}-dlq", Attributes={"MessageRetentionPeriod": str(RETENTION_S)})[
        "QueueUrl"
    ]
    dlq_arn = sqs_client.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    queue_url = sqs_client.create_queue(
        QueueName=name,
        Attributes={
            "VisibilityTimeout": str(VISIBILITY_TIMEOUT_S),
            "MessageRetentionPeriod": str(RETENTION_S),
            "RedrivePolicy": json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": str(MAX_RECEIVE_COUNT)}),
        },
    )["QueueUrl"]
    return queue_url, dlq_url

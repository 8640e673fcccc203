"""Lambda entry point for the dispatch queue (SQS event source, partial batch failures).

Each record is parsed by Powertools' parser into :class:`DispatchRecord`,
whose body is a task or a Scheduler timer message. A record that does not
parse is a poison message: it is reported as a batch item failure without
touching any run, and SQS's redrive policy moves it to the dead-letter queue.

A message that is not done (an attempt still in flight) gets its visibility
set to the lease's remaining time and is reported as a batch item failure,
so SQS keeps it: the message itself is the attempt's lease timer.
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from typing import Any

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.batch import BatchProcessor, EventType, process_partial_response
from aws_lambda_powertools.utilities.parser.models import SqsRecordModel
from aws_lambda_powertools.utilities.typing import LambdaContext
from pydantic import Json

from ..aws.queue import CARRIER_ATTRIBUTE, MAX_VISIBILITY_S, REFRESH_AFTER_RECEIVES, SqsQueue
from ..core.events import WakeRequested
from ..runtime import DispatchMessage, lease_keeper, process_message
from ..wiring import AwsEngine, AwsResources, aws_engine

logger = Logger(service="ryusen-dispatch")
metrics = Metrics(namespace="Ryusen", service="dispatch")


class DispatchRecord(SqsRecordModel):
    """An SQS record of the dispatch queue, its JSON body parsed and validated."""

    body: Json[DispatchMessage]


# a batch of in-flight attempts is normal, not an error: report item failures, never raise
processor = BatchProcessor(event_type=EventType.SQS, model=DispatchRecord, raise_on_entire_batch_failure=False)
_engine: AwsEngine | None = None


VISIBILITY_SAFETY_S = 30.0
"""Kept off SQS's 12-hour visibility limit: the receive happened a little before this handler started."""


class KeepMessageError(Exception):
    """Marks a message to stay on the queue (the attempt's lease has not expired)."""


def engine() -> AwsEngine:
    global _engine
    if _engine is None:
        _engine = aws_engine(AwsResources.from_env(), deployed=True)
        _engine.engine.hooks.append(_observe)
    return _engine


def _observe(kind: str, payload: Any) -> None:
    """Metrics of what the engine decided: how long a probed run has been blocked (the alarm's input)."""
    if kind != "decided":
        return
    event, decision = payload
    state = decision.state
    if isinstance(event, WakeRequested) and event.source == "probe" and state.blockers:
        oldest = min(blocker.first_seen_at for blocker in state.blockers)
        age = (datetime.now(UTC) - oldest).total_seconds()
        metrics.add_metric(name="BlockedRunAge", unit=MetricUnit.Seconds, value=max(0.0, age))


def record_handler(record: DispatchRecord, lambda_context: LambdaContext | None = None) -> None:
    wired = engine()
    # the queue the record came from (an app with a queue of its own, or the shared one): its visibility is
    # changed, and a fresh copy of it sent, there
    queue = SqsQueue(wired.sqs, AwsResources.from_env().queue_url_of(record.eventSourceARN), counter=wired.counter)
    received = time.monotonic()

    def change_visibility(seconds: float) -> None:
        # SQS refuses (does not clamp) a visibility past 12 hours from this receive: stay inside it
        inside = MAX_VISIBILITY_S - (time.monotonic() - received) - VISIBILITY_SAFETY_S
        queue.change_visibility(record.receiptHandle, max(1.0, min(seconds, inside)))

    # the time this invocation has left bounds how long it listens for an endpoint's answer
    budget_s = lambda_context.get_remaining_time_in_millis() / 1000 if lambda_context is not None else None
    keep = lease_keeper(change_visibility, _queue_visibility_s())
    try:
        done, redeliver_after_s = process_message(
            wired.engine, record.body, budget_s=budget_s, on_authorized=keep, carrier=_carrier(record)
        )
    except Exception:
        # reported as a batch item failure: the message comes back (and goes to the DLQ after maxReceiveCount);
        # Lambda's own Errors metric never sees it, so this metric is what the dispatch-errors alarm watches
        metrics.add_metric(name="DispatchErrors", unit=MetricUnit.Count, value=1)
        logger.exception("dispatch of a message failed; it will be redelivered")
        raise
    if not done:
        if _receives(record) >= REFRESH_AFTER_RECEIVES:
            # Kept on purpose (a lease timer, the watch over a run's chained tasks), yet every receive counts
            # towards the dead-letter queue: past a few, a fresh copy takes over and this one is deleted, so a
            # message the engine keeps never reaches the DLQ and raises its alarm.
            queue.resend(
                record.body.model_dump_json(),
                redeliver_after_s,
                group=record.attributes.MessageGroupId,
                carrier=_carrier(record),
            )
            return
        change_visibility(redeliver_after_s)
        raise KeepMessageError(f"in flight; back in {redeliver_after_s:.0f}s")


def _carrier(record: DispatchRecord) -> str:
    """The message's identity as the carrier of what it authorized: its id, or the id of the message it is a fresh
    copy of (``CARRIER_ATTRIBUTE``), so that the copy still carries its attempts' leases."""
    kept = record.messageAttributes.get(CARRIER_ATTRIBUTE)
    if kept is not None and kept.stringValue:
        return kept.stringValue
    return record.messageId


def _receives(record: DispatchRecord) -> int:
    try:
        return int(record.attributes.ApproximateReceiveCount)
    except (AttributeError, TypeError, ValueError):
        return 1


def _queue_visibility_s() -> float | None:
    """The dispatch queue's visibility timeout (the deployment sets it), which a received message has."""
    raw = os.environ.get("RYUSEN_QUEUE_VISIBILITY_S")
    return float(raw) if raw else None


@logger.inject_lambda_context
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return dict(
        process_partial_response(event=event, record_handler=record_handler, processor=processor, context=context)
    )

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

from typing import Any

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.batch import BatchProcessor, EventType, process_partial_response
from aws_lambda_powertools.utilities.parser.models import SqsRecordModel
from aws_lambda_powertools.utilities.typing import LambdaContext
from pydantic import Json

from ..runtime import DispatchMessage, process_message
from ..wiring import AwsEngine, AwsResources, aws_engine

logger = Logger(service="ryusen-dispatch")
metrics = Metrics(namespace="Ryusen", service="dispatch")


class DispatchRecord(SqsRecordModel):
    """An SQS record of the dispatch queue, its JSON body parsed and validated."""

    body: Json[DispatchMessage]


# a batch of in-flight attempts is normal, not an error: report item failures, never raise
processor = BatchProcessor(event_type=EventType.SQS, model=DispatchRecord, raise_on_entire_batch_failure=False)
_engine: AwsEngine | None = None


class KeepMessageError(Exception):
    """Marks a message to stay on the queue (the attempt's lease has not expired)."""


def engine() -> AwsEngine:
    global _engine
    if _engine is None:
        _engine = aws_engine(AwsResources.from_env())
    return _engine


def record_handler(record: DispatchRecord) -> None:
    wired = engine()
    done, redeliver_after_s = process_message(wired.engine, record.body)
    metrics.add_metric(name="MessagesHandled", unit=MetricUnit.Count, value=1)
    if not done:
        wired.sqs.change_message_visibility(
            QueueUrl=AwsResources.from_env().queue_url,
            ReceiptHandle=record.receiptHandle,
            VisibilityTimeout=int(min(43200, max(1, redeliver_after_s))),
        )
        raise KeepMessageError(f"in flight; back in {redeliver_after_s:.0f}s")


@logger.inject_lambda_context
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return dict(
        process_partial_response(event=event, record_handler=record_handler, processor=processor, context=context)
    )

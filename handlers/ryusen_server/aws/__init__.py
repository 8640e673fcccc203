"""AWS adapters of the engine's ports: DynamoDB store, SQS queue, EventBridge Scheduler timers.

Each adapter only translates: a port call becomes one (or a few, named) AWS
requests, and botocore's errors become the domain errors of ``ports.py``.
The in-memory twins in ``memory.py`` have the same semantics; the store
contract suite (tests/functional/test_store_contract.py) runs against both.
"""

from __future__ import annotations

from .queue import SqsMessage, SqsQueue, create_queues
from .store import DynamoStore, create_table
from .timers import SchedulerTimers, create_schedule_group, schedule_name

__all__ = [
    "DynamoStore",
    "SchedulerTimers",
    "SqsMessage",
    "SqsQueue",
    "create_queues",
    "create_schedule_group",
    "create_table",
    "schedule_name",
]

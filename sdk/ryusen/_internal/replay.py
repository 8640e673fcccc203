"""Replay memory shared by every instance of an endpoint (decision 21).

:class:`~ryusen._internal.signing.SeenRequests` remembers the requests one process accepted. An endpoint that
runs as several processes (Lambda containers, replicas behind a load balancer) shares what it has seen in a
DynamoDB table instead, so that a captured request played to another instance within the skew window is
refused there too: each accepted request is recorded with a conditional write, which fails if any instance
recorded it before.

The table (yours, in the app's account): partition key ``pk`` (string), TTL attribute ``expires_at``. The
SDK reads its name from ``RYUSEN_REPLAY_TABLE``, or takes the store as ``Ryusen(..., seen_requests=...)``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

__all__ = ["DynamoSeenRequests", "ReplayCheckUnavailableError", "SeenStore"]

from .signing import MAX_SKEW_S, ReplayCheckUnavailableError, SeenRequests, Signature

log = logging.getLogger("ryusen")


class SeenStore(Protocol):
    def first_time(self, signature: Signature, now: float) -> bool:
        """Record the request ``signature`` names; False if it was recorded before (a replay)."""
        ...


class DynamoSeenRequests:
    """Requests accepted by any instance, recorded in a DynamoDB table for twice the skew window.

    A process memory in front answers a replay to this instance without a write. A table that cannot be
    written raises :class:`ReplayCheckUnavailableError`: the endpoint refuses the request (nothing runs
    here), and since another instance may have run it, the server records its outcome as not known; it never
    runs a request it could not record.
    """

    shared = True
    """Every instance refuses what another accepted: an endpoint with this store may take attempts as Lambda
    events (``lambda_event``), which Lambda may deliver twice."""

    def __init__(self, table: str, *, client: Any = None, window_s: float = MAX_SKEW_S) -> None:
        self.table = table
        self.window_s = window_s
        self._client = client
        self._local = SeenRequests(window_s)
        self._lock = threading.Lock()

    def _dynamodb(self) -> Any:
        with self._lock:
            if self._client is None:
                import boto3  # only here: the Lambda runtime has it; the SDK does not depend on it

                self._client = boto3.client("dynamodb")
            return self._client

    def first_time(self, signature: Signature, now: float) -> bool:
        if not self._local.first_time(signature, now):
            return False
        client = self._dynamodb()
        try:
            client.put_item(
                TableName=self.table,
                Item={
                    "pk": {"S": f"seen#{signature.digest}"},
                    "expires_at": {"N": str(int(now + 2 * self.window_s))},
                },
                ConditionExpression="attribute_not_exists(pk)",
            )
        except client.exceptions.ConditionalCheckFailedException:
            return False  # another instance accepted it first
        except Exception as exc:
            log.warning("could not record a request in the replay table %s", self.table, exc_info=True)
            raise ReplayCheckUnavailableError(f"the replay table {self.table} could not be written") from exc
        return True

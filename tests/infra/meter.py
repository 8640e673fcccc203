"""A billing meter for the stack in a box: what AWS would bill for each request the deployed functions make.

It watches from outside the engine. botocore's event hooks see every AWS call a function makes (who made it is
the box's ``caller``), and wrappers around each Lambda handler time every invocation. Nothing here reads the
engine's own counters. The units are AWS's own:

* **DynamoDB** write request units: 1 per KB of the item, rounded up. A Put or an Update bills the larger of
  the item before and after; a Delete bills the item it deletes. A write whose condition fails bills the
  existing item (at least 1). An item in ``TransactWriteItems`` counts twice, and so does a ConditionCheck.
  A write also bills each global secondary index whose entry it adds, changes or removes: a changed index key
  is a delete plus a put. The entry is the table's keys, the index's keys and the projected attributes.
  Read request units: 1 per 4 KB of each item for a strongly consistent read, half for an eventually
  consistent one, and at least one unit per item asked for. A Query bills the total size it read. A read
  with a ``ProjectionExpression`` bills the whole item. The before and after images come from the table
  itself, read by a private client whose calls are not metered.
* **SQS**: one request per 64 KB of payload (a send, a receive that returned messages, a batch), and one per
  delete or visibility change. Empty receives are the event source's long polling, a fixed cost per queue.
  They are counted apart (``idle_receives``).
* **EventBridge Scheduler**: the schedules delivered (``invocations``). Its API calls are counted but not
  priced.
* **Lambda**: invocations and billed milliseconds (wall time rounded up to the millisecond) per function.
  When a function waits for the user's endpoint, the endpoint's real time is replaced by its simulated time
  (``Meter.endpoint_sleeps``, matched by ``Meter.settle_endpoint_time``). A REST API request is one invocation
  of the API function.
* **Logs**: the bytes a function writes to stdout or stderr (Powertools' logs and metrics), plus about 250
  bytes of platform lines per invocation (START, END, REPORT).

Sizes follow "Item sizes and formats" in the DynamoDB developer guide. A name or a string counts its UTF-8
bytes, binary its raw bytes, and a number about one byte per two significant digits plus one. A list or a map
counts 3 bytes plus one per element.
"""

from __future__ import annotations

import base64
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

KB = 1024
PLATFORM_LOG_BYTES = 250
"""START, END and REPORT lines of one invocation (a REPORT line is about 130 bytes)."""
STORAGE_OVERHEAD_BYTES = 100
"""DynamoDB's per-item storage overhead, in the table and in each index."""

PRICES = {
    "wru": 0.625,  # DynamoDB on-demand, $ per million write request units
    "rru": 0.125,  # $ per million read request units
    "sqs": 0.40,  # SQS standard, $ per million requests (64 KB chunks)
    "scheduler": 1.00,  # EventBridge Scheduler, $ per million invocations
    "lambda_request": 0.20,  # Lambda, $ per million requests
    "lambda_gb_s": 0.0000133334,  # Lambda arm64, $ per GB-second
    "api_gateway": 3.50,  # API Gateway REST, $ per million requests
    "secrets": 5.00,  # Secrets Manager, $0.05 per 10,000 GetSecretValue
    # not in shared/facts/aws.md: us-east-1 list prices, check before publishing
    "storage_gb_month": 0.25,  # DynamoDB Standard table class, $ per GB-month stored
    "pitr_gb_month": 0.20,  # DynamoDB point-in-time recovery, $ per GB-month of table data
    "logs_gb": 0.50,  # CloudWatch Logs ingestion (standard class; Lambda logs' first tier), $ per GB
    "egress_gb": 0.09,  # data transfer out to the internet, $ per GB (the user's endpoint, at worst)
}
"""Dollars, us-east-1 on-demand (shared/facts/aws.md for the first nine)."""


# ---- sizes and units ---------------------------------------------------------------------------------------


def _number_size(text: str) -> int:
    digits = text.lstrip("-").replace(".", "").split("e")[0].split("E")[0].strip("0") or "0"
    return math.ceil(len(digits) / 2) + 1


def _binary_size(value: Any) -> int:
    if isinstance(value, bytes | bytearray):
        return len(value)
    return len(base64.b64decode(value))  # as it is on the wire


def value_size(value: Mapping[str, Any]) -> int:
    """The size DynamoDB gives one attribute value (the low-level ``{"S": ...}`` form)."""
    [(kind, v)] = value.items()
    if kind == "S":
        return len(v.encode())
    if kind == "N":
        return _number_size(v)
    if kind == "B":
        return _binary_size(v)
    if kind in ("BOOL", "NULL"):
        return 1
    if kind == "SS":
        return sum(len(s.encode()) for s in v)
    if kind == "NS":
        return sum(_number_size(n) for n in v)
    if kind == "BS":
        return sum(_binary_size(b) for b in v)
    if kind == "L":
        return 3 + sum(1 + value_size(e) for e in v)
    if kind == "M":
        return 3 + sum(1 + len(k.encode()) + value_size(e) for k, e in v.items())
    raise ValueError(f"unknown attribute type {kind!r}")


def item_size(item: Mapping[str, Any] | None) -> int:
    """An item's size as DynamoDB bills it: each attribute's name plus its value."""
    if not item:
        return 0
    return sum(len(name.encode()) + value_size(value) for name, value in item.items())


def write_units(size: int) -> int:
    return max(1, math.ceil(size / KB))


def read_units(size: int, *, consistent: bool) -> float:
    units = max(1, math.ceil(size / (4 * KB)))
    return float(units) if consistent else units / 2


@dataclass(frozen=True)
class Index:
    name: str
    keys: tuple[str, ...]
    projection: str
    """``ALL``, ``KEYS_ONLY`` or ``INCLUDE``."""
    included: tuple[str, ...] = ()


@dataclass(frozen=True)
class TableSchema:
    keys: tuple[str, ...]
    indexes: tuple[Index, ...] = ()

    @staticmethod
    def from_template(properties: Mapping[str, Any]) -> TableSchema:
        """A table's keys and global secondary indexes, from its ``AWS::DynamoDB::Table`` properties."""
        indexes = tuple(
            Index(
                name=gsi["IndexName"],
                keys=tuple(k["AttributeName"] for k in gsi["KeySchema"]),
                projection=gsi["Projection"]["ProjectionType"],
                included=tuple(gsi["Projection"].get("NonKeyAttributes", [])),
            )
            for gsi in properties.get("GlobalSecondaryIndexes") or []
        )
        return TableSchema(keys=tuple(k["AttributeName"] for k in properties["KeySchema"]), indexes=indexes)

    def key_of(self, item: Mapping[str, Any]) -> dict[str, Any]:
        return {k: item[k] for k in self.keys}

    def entry(self, index: Index, item: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The index's entry for ``item`` (None: the item is not in this sparse index)."""
        if item is None or any(k not in item for k in index.keys):
            return None
        names = set(self.keys) | set(index.keys)
        if index.projection == "ALL":
            names = set(item)
        elif index.projection == "INCLUDE":
            names |= set(index.included)
        return {k: v for k, v in item.items() if k in names}

    def index_write_units(self, before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> int:
        """What one item's change bills on the table's indexes."""
        units = 0
        for index in self.indexes:
            old, new = self.entry(index, before), self.entry(index, after)
            if old == new:
                continue
            if old is None or new is None:
                units += write_units(item_size(old or new))
            elif any(old[k] != new[k] for k in index.keys):
                units += write_units(item_size(old)) + write_units(item_size(new))  # a delete and a put
            else:
                units += write_units(max(item_size(old), item_size(new)))
        return units

    def stored_bytes(self, item: Mapping[str, Any]) -> tuple[int, int]:
        """(table bytes, index bytes) ``item`` keeps stored, with the per-item overhead."""
        table = item_size(item) + STORAGE_OVERHEAD_BYTES
        index = sum(
            item_size(entry) + STORAGE_OVERHEAD_BYTES
            for entry in (self.entry(ix, item) for ix in self.indexes)
            if entry is not None
        )
        return table, index


# ---- the meter ----------------------------------------------------------------------------------------------


@dataclass
class Usage:
    """What one stretch of activity would be billed, by function (the box's ``caller``)."""

    wru: Counter[str] = field(default_factory=Counter)
    index_wru: Counter[str] = field(default_factory=Counter)
    rru: Counter[str] = field(default_factory=Counter)
    sqs: Counter[str] = field(default_factory=Counter)
    idle_receives: int = 0
    scheduler_calls: Counter[str] = field(default_factory=Counter)
    scheduler_invocations: int = 0
    secrets: Counter[str] = field(default_factory=Counter)
    invocations: Counter[str] = field(default_factory=Counter)
    billed_ms: Counter[str] = field(default_factory=Counter)
    log_bytes: Counter[str] = field(default_factory=Counter)
    api_requests: Counter[str] = field(default_factory=Counter)
    """REST API requests that reached the API function, by ``METHOD /route``."""
    egress_bytes: int = 0
    receipts: list[tuple[str, str]] = field(default_factory=list)
    """(queue URL, receipt handle) of each message received (to fast-forward a kept message's timer)."""
    visibility_s: list[int] = field(default_factory=list)
    """The visibility timeouts the functions set on messages they kept (the lease timers)."""
    operations: Counter[str] = field(default_factory=Counter)
    """``function service.Operation`` -> calls (for reading what a figure is made of)."""


class Meter:
    """Install with :meth:`install`; read and reset :attr:`usage`.

    ``caller`` names who is calling (the box's context variable); calls by ``excluded`` callers are the
    user's (their endpoint) or the harness's, and are not metered. ``event_source`` is the caller the box's SQS event source and Scheduler run as: its
    receives and deletes are billed (AWS bills the event source's requests), and a message it sends is a
    Scheduler delivery.
    """

    def __init__(
        self,
        schemas: Mapping[str, TableSchema],
        caller: Callable[[], str],
        private_client: Callable[[], Any],
        *,
        excluded: Iterable[str] = (),
        event_source: str = "test",
    ) -> None:
        self.schemas = dict(schemas)
        self.caller = caller
        self.private_client = private_client
        """A DynamoDB client for :meth:`peek` (its calls are not metered)."""
        self._local = threading.local()
        self.excluded = set(excluded)
        self.event_source = event_source
        self.lock = threading.Lock()
        self.usage = Usage()
        self.memory_mb: dict[str, int] = {}
        self.invocation_spans: list[tuple[str, float, float, list[float]]] = []
        """(function, start, end, [billed ms]) of each invocation, for :meth:`settle_endpoint_time`."""
        self.endpoint_sleeps: list[tuple[float, float, float]] = []
        """(start, end, simulated seconds) of each callback's sleep on the endpoint."""

    def reset(self) -> Usage:
        with self.lock:
            usage, self.usage = self.usage, Usage()
            self.invocation_spans, self.endpoint_sleeps = [], []
        return usage

    # ---- AWS calls -----------------------------------------------------------------------------------------

    def install(self) -> Callable[[], None]:
        """Meter every AWS call any boto3 client makes (``BaseClient._make_api_call``, wrapped: a client copies
        its session's event hooks when it is made, so hooks added later would miss the functions' clients).
        Returns what undoes it."""
        import botocore.client

        original = botocore.client.BaseClient._make_api_call
        meter = self

        def _make_api_call(client: Any, operation: str, params: dict[str, Any]) -> Any:
            if getattr(meter._local, "peeking", False):
                return original(client, operation, params)
            state = meter._before(client.meta.service_model.service_name, operation, params)
            if state is None:
                return original(client, operation, params)
            try:
                parsed = original(client, operation, params)
            except botocore.exceptions.ClientError as exc:
                meter._after(state, dict(exc.response), failed=True)
                raise
            meter._after(state, parsed, failed=False)
            return parsed

        botocore.client.BaseClient._make_api_call = _make_api_call  # type: ignore[method-assign]

        def uninstall() -> None:
            botocore.client.BaseClient._make_api_call = original  # type: ignore[method-assign]

        return uninstall

    def peek(self, table: str, key: dict[str, Any]) -> dict[str, Any] | None:
        """The item as it is now, read without being metered."""
        self._local.peeking = True
        try:
            item = self.private_client().get_item(TableName=table, Key=key, ConsistentRead=True).get("Item")
        finally:
            self._local.peeking = False
        return dict(item) if item is not None else None

    def _before(self, service: str, operation: str, params: dict[str, Any]) -> dict[str, Any] | None:
        who = self.caller()
        if who in self.excluded or (who == self.event_source and service != "sqs"):
            return None  # the user's, the harness's, or the box playing the Scheduler (looking for due schedules)
        state: dict[str, Any] = {"who": who, "service": service, "operation": operation, "params": dict(params)}
        if service == "dynamodb":
            state["before"] = [
                (table, key, self.peek(table, key)) for table, key, _ in self._written(params, operation)
            ]
        return state

    def _after(self, state: dict[str, Any], parsed: dict[str, Any], *, failed: bool) -> None:
        who, service, operation, params = state["who"], state["service"], state["operation"], state["params"]
        with self.lock:
            self.usage.operations[f"{who} {service}.{operation}"] += 1
        if service == "dynamodb":
            self._dynamodb(who, operation, params, parsed, state["before"], failed)
        elif service == "sqs":
            self._sqs(who, operation, params, parsed)
        elif service == "scheduler":
            with self.lock:
                self.usage.scheduler_calls[operation] += 1
        elif service == "secretsmanager" and operation == "GetSecretValue":
            with self.lock:
                self.usage.secrets[who] += 1

    def _written(self, params: Mapping[str, Any], operation: str) -> list[tuple[str, dict[str, Any], str]]:
        """(table, key, kind) of each item a write request names."""
        found: list[tuple[str, dict[str, Any], str]] = []

        def add(table: str, kind: str, item: Mapping[str, Any] | None = None, key: Mapping[str, Any] | None = None):
            schema = self.schemas.get(table)
            if schema is not None:
                found.append((table, schema.key_of(item) if item is not None else dict(key or {}), kind))

        if operation == "PutItem":
            add(params["TableName"], "Put", item=params["Item"])
        elif operation in ("UpdateItem", "DeleteItem"):
            add(params["TableName"], operation[:-4], key=params["Key"])
        elif operation == "TransactWriteItems":
            for element in params["TransactItems"]:
                [(kind, body)] = element.items()
                if kind == "Put":
                    add(body["TableName"], kind, item=body["Item"])
                else:
                    add(body["TableName"], kind, key=body["Key"])
        elif operation == "BatchWriteItem":
            for table, requests in params["RequestItems"].items():
                for request in requests:
                    if "PutRequest" in request:
                        add(table, "Put", item=request["PutRequest"]["Item"])
                    else:
                        add(table, "Delete", key=request["DeleteRequest"]["Key"])
        return found

    def _dynamodb(
        self,
        who: str,
        operation: str,
        params: Mapping[str, Any],
        parsed: Mapping[str, Any],
        before: list[tuple[str, dict[str, Any], dict[str, Any] | None]],
        failed: bool,
    ) -> None:
        wru = index_wru = 0
        rru = 0.0
        if before:
            kinds = [kind for _, _, kind in self._written(params, operation)]
            factor = 2 if operation == "TransactWriteItems" else 1
            for (table, key, old), kind in zip(before, kinds, strict=True):
                if failed or kind == "ConditionCheck":
                    wru += factor * write_units(item_size(old))
                    continue
                new = self.peek(table, key)
                size = item_size(old) if kind == "Delete" else max(item_size(old), item_size(new))
                wru += factor * write_units(size)
                index_wru += self.schemas[table].index_write_units(old, new)
        elif operation == "GetItem" and params["TableName"] in self.schemas:
            item = parsed.get("Item")
            if item is not None and "ProjectionExpression" in params:
                item = self.peek(params["TableName"], params["Key"])
            rru = read_units(item_size(item), consistent=bool(params.get("ConsistentRead")))
        elif operation == "BatchGetItem":
            for table, request in params["RequestItems"].items():
                if table not in self.schemas:
                    continue
                items = list(parsed.get("Responses", {}).get(table, []))
                if "ProjectionExpression" in request:
                    items = [self.peek(table, self.schemas[table].key_of(i)) or i for i in items]
                unprocessed = len(parsed.get("UnprocessedKeys", {}).get(table, {}).get("Keys", []))
                missing = len(request["Keys"]) - len(items) - unprocessed
                consistent = bool(request.get("ConsistentRead"))
                rru += sum(read_units(item_size(i), consistent=consistent) for i in items)
                rru += missing * read_units(0, consistent=consistent)
        elif operation in ("Query", "Scan") and params["TableName"] in self.schemas:
            items = list(parsed.get("Items", []))
            if "ProjectionExpression" in params and "IndexName" not in params:
                schema = self.schemas[params["TableName"]]
                items = [self.peek(params["TableName"], schema.key_of(i)) or i for i in items]
            total = sum(item_size(i) for i in items)
            rru = read_units(total, consistent=bool(params.get("ConsistentRead")))
        with self.lock:
            self.usage.wru[who] += wru
            self.usage.index_wru[who] += index_wru
            self.usage.rru[who] += rru  # type: ignore[assignment]

    def _sqs(self, who: str, operation: str, params: Mapping[str, Any], parsed: Mapping[str, Any]) -> None:
        def chunks(payload: int) -> int:
            return max(1, math.ceil(payload / (64 * KB)))

        def attributes(message: Mapping[str, Any]) -> int:
            return sum(
                len(name.encode()) + len(str(v.get("StringValue", "")).encode())
                for name, v in (message.get("MessageAttributes") or {}).items()
            )

        requests, idle = 1, 0
        if operation == "ChangeMessageVisibility":
            with self.lock:
                self.usage.visibility_s.append(int(params["VisibilityTimeout"]))
        if operation == "SendMessage":
            requests = chunks(len(params["MessageBody"].encode()) + attributes(params))
        elif operation == "SendMessageBatch":
            requests = chunks(sum(len(e["MessageBody"].encode()) + attributes(e) for e in params["Entries"]))
        elif operation == "ReceiveMessage":
            messages = parsed.get("Messages", [])
            if not messages:
                requests, idle = 0, 1
            else:
                requests = chunks(sum(len(m["Body"].encode()) + attributes(m) for m in messages))
                with self.lock:
                    self.usage.receipts += [(params["QueueUrl"], m["ReceiptHandle"]) for m in messages]
        with self.lock:
            self.usage.sqs[who] += requests
            self.usage.idle_receives += idle
            if who == self.event_source and operation == "SendMessage":
                self.usage.scheduler_invocations += 1  # the box's Scheduler delivering a due schedule

    # ---- Lambda --------------------------------------------------------------------------------------------

    def timed(
        self, function: str, handler: Callable[..., Any], *, system_log_level: str = "INFO"
    ) -> Callable[..., Any]:
        """``handler``, metered as one invocation of ``function`` per call. Lambda writes its START, END and
        REPORT lines (:data:`PLATFORM_LOG_BYTES`) for every invocation at the function's system log level INFO (its
        template's ``LoggingConfig.SystemLogLevel``, INFO by default), and at WARN only for one that failed."""

        def invoke(event: Any, context: Any) -> Any:
            started = time.perf_counter()
            failed = True
            try:
                answer = handler(event, context)
                failed = False
                return answer
            finally:
                ended = time.perf_counter()
                billed = [float(math.ceil((ended - started) * 1000))]
                with self.lock:
                    self.usage.invocations[function] += 1
                    if failed or system_log_level not in ("WARN", "ERROR", "FATAL"):
                        self.usage.log_bytes[function] += PLATFORM_LOG_BYTES
                    if isinstance(event, dict) and "httpMethod" in event:  # a REST API request
                        self.usage.api_requests[f"{event['httpMethod']} {event['path']}"] += 1
                    self.invocation_spans.append((function, started, ended, billed))

        invoke.__wrapped__ = handler  # type: ignore[attr-defined]
        return invoke

    def endpoint_sleep(self, started: float, ended: float, simulated_s: float) -> None:
        """A callback on the user's endpoint slept from ``started`` to ``ended`` (``time.perf_counter``) and
        stands for ``simulated_s`` seconds of the user's work."""
        with self.lock:
            self.endpoint_sleeps.append((started, ended, simulated_s))

    def settle_endpoint_time(self, waiting: Iterable[str]) -> int:
        """Replace, in the billed time of the invocations of the functions ``waiting``, each endpoint sleep that falls entirely
        within one of them (the function waited for it: an inline answer) by its simulated time. A sleep that
        outlasts the invocation (an acknowledged attempt) is not the function's. Returns how many were replaced."""
        settled = 0
        waiting = set(waiting)
        with self.lock:
            for started, ended, simulated in self.endpoint_sleeps:
                holders = [s for s in self.invocation_spans if s[0] in waiting and s[1] <= started and ended <= s[2]]
                if not holders:
                    continue
                assert len(holders) == 1, "an endpoint sleep inside two invocations: run one workflow at a time"
                holders[0][3][0] += (simulated - (ended - started)) * 1000
                settled += 1
            self.usage.billed_ms = Counter()
            for function, _, _, billed in self.invocation_spans:
                self.usage.billed_ms[function] += math.ceil(billed[0])
        return settled


class LogTap:
    """A stand-in for ``sys.stdout`` or ``sys.stderr``: what a metered function writes is counted as log bytes
    (CloudWatch Logs ingests it) and dropped; anything else goes through to ``real``. Install it before the
    handlers' modules are imported: Powertools' logger keeps the stream it found then."""

    def __init__(self, meter: Meter, real: Any) -> None:
        self.meter = meter
        self.real = real

    def write(self, text: str) -> int:
        who = self.meter.caller()
        if who in self.meter.memory_mb:
            with self.meter.lock:
                self.meter.usage.log_bytes[who] += len(text.encode())
            return len(text)
        return int(self.real.write(text))

    def flush(self) -> None:
        self.real.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


__all__ = [
    "PRICES",
    "Index",
    "LogTap",
    "Meter",
    "TableSchema",
    "Usage",
    "item_size",
    "read_units",
    "value_size",
    "write_units",
]

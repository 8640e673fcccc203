"""The run store on one DynamoDB table: conditional writes are the engine's fencing.

Theory of operation. Every item has a string ``pk`` and ``sk``:

=============================  ===========  ==========================================
pk                             sk           what
=============================  ===========  ==========================================
``RUN#{run_id}``               ``RUN``      the run: ``version`` (N), ``body`` (B,
                                            zlib of the run's JSON, large values
                                            left out), and index attributes (below)
``RUN#{run_id}``               ``VAL#{sha256}``
                                            one large value of the run (``value``,
                                            B, zlib of its JSON), content-addressed
``IDEM#{function_id}#{key}``   ``IDEM#{function_id}``
                                            an idempotency key: ``run_id`` of its run
``FN#{function_id}``           ``RELEASE``  the newest release declaring the function
``APPS``                       ``APP#{app_id}``
                                            the newest release of each app
=============================  ===========  ==========================================

(The idempotency item's ``sk`` repeats the function id so that the pair is
unambiguous even when a function id or a key contains ``#``. App releases
share one partition so that ``list_releases`` is one Query, not a Scan.)

A run item carries the index attributes ``function_id``, ``phase``,
``outcome`` (only once decided) and ``created_at`` (fixed-width UTC ISO), and
two GSIs read them:

* ``runs_by_created``: partition ``list_pk`` = ``RUNS#{shard}``, one of
  :data:`LIST_SHARDS` values chosen by a digest of the run id (one partition
  key value takes about 1,000 writes per second, so a constant would cap the
  whole deployment's run starts and status changes), sort ``list_sk`` =
  ``{created_at}#{run_id}``. A page queries every shard newest first
  (``ScanIndexForward=False``, before the cursor), merges, and keeps the
  newest; the cursor is the ``list_sk`` of the last run returned. The index
  projects only the filter attributes (not the body): a save that changes
  neither phase nor outcome then costs no index write, which keeps the
  per-step path at one write. A page's bodies are fetched with one
  BatchGetItem.
* ``runs_blocked_by_definition``: partition ``blocked_fn`` = function id, an
  attribute written only while the run has a duplicate-step-id blocker (a
  sparse index, keys only).

Large values. A JSON value of the run (its input, output and error, a step's
result, error, compensation result and compensation error, an attempt's
error, a stale submission's outcome) over :data:`OFFLOAD_BYTES` serialized is
not kept in the body: the body records where it goes and the SHA-256 digest of
its JSON, and the value is an item of its own keyed by that digest. So the run
item stays small however large its values (each up to 256 KiB, a run's input
and results up to 4 MiB together, far past DynamoDB's 400 KB item limit), and
the per-step rewrite of the run item does not rewrite old results. A run with
many steps and many smaller values, whose compressed body would pass
:data:`BODY_BUDGET_BYTES`, keeps only values up to :data:`SMALL_OFFLOAD_BYTES`
in its body when that makes the body smaller. With the engine's step limit
that keeps a run under the item limit unless it has thousands of attempts
(docs/design/engine.md, "Known gaps"); a save past it is
:class:`PayloadTooLargeError`, before any value item is written.

A listing reads run bodies only: its runs carry None where large values were
(the summary a list shows needs none of them).

A value item never changes (its key is its content), so it needs no fencing:
new value items are written first (BatchWriteItem), then the run item with its
conditional write. If that write loses a race, the value items stay and are
simply found again when the winning or the next decision refers to them. A
process remembers the values it has written or read (:class:`_ValueCache`), so
a value is written once and, in a warm process, read once. Reading a run is a
GetItem, plus one BatchGetItem when it refers to values this process has not
seen. A run's value items share its partition, so whatever removes a run later
finds them with one Query.

Writes: ``create`` is a conditional Put (``attribute_not_exists(pk)``), or a
transaction of that Put and the idempotency item's conditional Put when the
run has a key; ``save`` is one Put conditioned on ``version = :expected``
(each after the new value items, if any). A
failed condition becomes :class:`RunExistsError` or
:class:`VersionConflictError` carrying the current item, read from the error
itself (``ReturnValuesOnConditionCheckFailure=ALL_OLD``), never by a second
request. Every run write carries a fresh ``write_token``: when botocore
retries a write whose first try committed but whose reply was lost, the retry
fails its own condition, and the token on the item it finds tells the store
that the write was its own (a success), not someone else's. Every request is
counted as ``dynamodb.read`` or ``dynamodb.write`` (a transaction or batch is
one request; writes also add their item bytes).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import secrets
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

import pydantic_core
from botocore.exceptions import ClientError
from pydantic import TypeAdapter

from ..core.model import RunState
from ..ports import (
    InvalidRequestError,
    PayloadTooLargeError,
    Release,
    RequestCounter,
    RunExistsError,
    RunPage,
    ServerError,
    VersionConflictError,
)

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.client import DynamoDBClient
    from mypy_boto3_dynamodb.type_defs import AttributeValueTypeDef, QueryInputTypeDef

log = logging.getLogger("ryusen.aws.store")

LIST_INDEX = "runs_by_created"
BLOCKED_INDEX = "runs_blocked_by_definition"
LIST_PARTITION = "RUNS"
LIST_SHARDS = 16
"""Partition keys of the listing index (``RUNS#0`` ...): fixed for a table's life."""
APPS_PARTITION = "APPS"
MAX_KEY_BYTES = 2048
"""DynamoDB's limit on a partition key value."""
MAX_ITEM_BYTES = 400 * 1024
"""DynamoDB's limit on an item (names and values)."""
OFFLOAD_BYTES = 1024
"""A value over this many bytes serialized gets its own item (see the module docstring)..."""
BODY_BUDGET_BYTES = 128 * 1024
SMALL_OFFLOAD_BYTES = 128
"""...and over this many, in a run whose body would otherwise pass the budget (compressed)."""
VALUE_CACHE_BYTES = 64 * 1024 * 1024
"""How many bytes of large values one process remembers."""

_RELEASE = TypeAdapter(Release)
_TRANSIENT_RETRIES = 5
BATCH_RETRY_BUDGET_S = 20.0
"""How long a batch request keeps retrying the items DynamoDB left unprocessed (throttling) before it fails."""


def _batch_backoff(attempt: int) -> float:
    """Exponential backoff with full jitter for unprocessed batch items: 50 ms doubling, capped at 2 s."""
    return secrets.SystemRandom().uniform(0, min(2.0, 0.05 * 2**attempt))


def _with_write_token(item: dict[str, AttributeValueTypeDef]) -> tuple[dict[str, AttributeValueTypeDef], str]:
    """``item`` marked with a token of its own write (see the module docstring)."""
    token = secrets.token_hex(12)
    return {**item, "write_token": {"S": token}}, token


def _expired(item: Mapping[str, Any]) -> bool:
    """A finished run past its retention (its items may already be partly deleted)."""
    expires = item.get("expires_at", {}).get("N")
    return expires is not None and float(expires) <= time.time()


def _written_by(item: Mapping[str, Any] | None, token: str) -> bool:
    """Is ``item`` (returned by a failed condition) the one this write's earlier try put?"""
    return bool(item) and cast("Mapping[str, Any]", item).get("write_token", {}).get("S") == token


class ThrottledError(ServerError):
    """DynamoDB kept throttling a batch past the retry budget: nothing is decided, the caller tries again later
    (a dispatch message comes back; an API request answers 503)."""

    code = "throttled"
    status = 503


def _run_key(run_id: str) -> dict[str, AttributeValueTypeDef]:
    return {"pk": {"S": f"RUN#{run_id}"}, "sk": {"S": "RUN"}}


def _idempotency_pk(function_id: str, key: str) -> str:
    return f"IDEM#{function_id}#{key}"


def _idempotency_key(function_id: str, key: str) -> dict[str, AttributeValueTypeDef]:
    return {"pk": {"S": _idempotency_pk(function_id, key)}, "sk": {"S": f"IDEM#{function_id}"}}


def _utc_iso(moment: datetime) -> str:
    """Fixed-width UTC ISO-8601, so that string order is time order."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


Path = list[str | int]


def _value_slots(doc: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str, Path]]:
    """Every place in a dumped run that holds a JSON value of unbounded size (the offload candidates)."""
    for key in ("input", "output", "error"):
        yield doc, key, [key]
    for i, step in enumerate(doc.get("steps", [])):
        for key in ("result", "compensation_result", "error", "compensation_error"):
            yield step, key, ["steps", i, key]
        for j, attempt in enumerate(step.get("attempts", [])):
            yield attempt, "error", ["steps", i, "attempts", j, "error"]
            for k, submission in enumerate(attempt.get("stale_submissions", [])):
                yield submission, "outcome", ["steps", i, "attempts", j, "stale_submissions", k, "outcome"]


def _value_key(run_id: str, digest: str) -> dict[str, AttributeValueTypeDef]:
    return {"pk": {"S": f"RUN#{run_id}"}, "sk": {"S": f"VAL#{digest}"}}


@dataclass(frozen=True, slots=True)
class _Encoded:
    item: dict[str, AttributeValueTypeDef]
    values: dict[str, bytes]
    """The run's large values: digest to serialized JSON."""


def _encode_run(state: RunState) -> _Encoded:
    """The run item and its large values; a run whose body passes the budget keeps only small values in it,
    when that makes the body smaller (a value that compresses well can cost less inline than its digest)."""
    encoded = _encode_with(state, OFFLOAD_BYTES)
    if len(encoded.item["body"]["B"]) > BODY_BUDGET_BYTES:
        smaller = _encode_with(state, SMALL_OFFLOAD_BYTES)
        if len(smaller.item["body"]["B"]) < len(encoded.item["body"]["B"]):
            return smaller
    return encoded


def _encode_with(state: RunState, offload_bytes: int) -> _Encoded:
    doc = state.model_dump(mode="json")
    offloaded: list[tuple[Path, str]] = []
    values: dict[str, bytes] = {}
    for holder, key, path in _value_slots(doc):
        value = holder.get(key)
        if value is None:
            continue
        raw = pydantic_core.to_json(value)
        if len(raw) <= offload_bytes:
            continue
        digest = hashlib.sha256(raw).hexdigest()
        holder[key] = None
        offloaded.append((path, digest))
        values[digest] = raw
    body = pydantic_core.to_json({"state": doc, "offloaded": offloaded})
    return _Encoded(item=_run_item(state, zlib.compress(body)), values=values)


def _split_body(item: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[Path, str]]]:
    """A run item's state (large values still out) and where each large value goes."""
    loaded = pydantic_core.from_json(zlib.decompress(item["body"]["B"]))
    return loaded["state"], [(path, digest) for path, digest in loaded["offloaded"]]


def _place(doc: dict[str, Any], path: Path, value: Any) -> None:
    target: Any = doc
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value


def _run_id_of(item: Mapping[str, Any]) -> str:
    return str(item["pk"]["S"]).removeprefix("RUN#")


class _ValueCache:
    """Large values this process has written or read, by (run id, digest), least recently used out first.

    A value item is immutable and never deleted while its run exists, so an
    entry can never be stale: it both saves a read and proves the item exists.
    """

    def __init__(self, limit_bytes: int) -> None:
        self._entries: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self._bytes = 0
        self._limit = limit_bytes
        self._lock = threading.Lock()

    def get(self, run_id: str, digest: str) -> bytes | None:
        with self._lock:
            raw = self._entries.get((run_id, digest))
            if raw is not None:
                self._entries.move_to_end((run_id, digest))
            return raw

    def put(self, run_id: str, digest: str, raw: bytes) -> None:
        with self._lock:
            if (run_id, digest) in self._entries:
                self._entries.move_to_end((run_id, digest))
                return
            self._entries[(run_id, digest)] = raw
            self._bytes += len(raw)
            while self._bytes > self._limit and self._entries:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= len(dropped)


def _run_item(state: RunState, body: bytes) -> dict[str, AttributeValueTypeDef]:
    created = _utc_iso(state.created_at)
    item: dict[str, AttributeValueTypeDef] = {
        **_run_key(state.id),
        "version": {"N": str(state.version)},
        "body": {"B": body},
        "function_id": {"S": state.function_id},
        "phase": {"S": state.phase.value},
        "created_at": {"S": created},
        "list_pk": {"S": _list_partition(state.id)},
        "list_sk": {"S": f"{created}#{state.id}"},
    }
    if state.outcome is not None:
        item["outcome"] = {"S": state.outcome.value}
    if state.blocked_by_definition:
        item["blocked_fn"] = {"S": state.function_id}
    return item


def _item_bytes(item: Mapping[str, Any]) -> int:
    """Approximately DynamoDB's item size: attribute names plus values (what write units are billed on)."""
    size = 0
    for name, value in item.items():
        size += len(name.encode())
        for kind, raw in value.items():
            if kind == "B":
                size += len(raw)
            elif kind in ("S", "N"):
                size += len(str(raw).encode())
    return size


def _error_code(exc: ClientError) -> str:
    return exc.response.get("Error", {}).get("Code", "")


def _is_item_too_large(exc: ClientError) -> bool:
    return _error_code(exc) == "ValidationException" and "size" in exc.response.get("Error", {}).get("Message", "")


def _list_partition(run_id: str) -> str:
    return f"{LIST_PARTITION}#{int(hashlib.sha256(run_id.encode()).hexdigest()[:8], 16) % LIST_SHARDS}"


def _encode_cursor(item: Mapping[str, Any]) -> str:
    """A page's cursor: the ``list_sk`` of its last run (every shard resumes below it)."""
    body = json.dumps({"before": item["list_sk"]["S"]}, separators=(",", ":"))
    return base64.urlsafe_b64encode(body.encode()).decode()


def _decode_cursor(cursor: str) -> str:
    """The ``list_sk`` a cursor stands for; anything else a client sends is an invalid request."""
    try:
        key = json.loads(base64.urlsafe_b64decode(cursor.encode()))
    except (ValueError, binascii.Error):
        raise InvalidRequestError("invalid cursor", code="invalid_cursor") from None
    if not (isinstance(key, dict) and set(key) == {"before"} and isinstance(key["before"], str)):
        raise InvalidRequestError("invalid cursor", code="invalid_cursor")
    before = str(key["before"])
    try:
        encoded = before.encode()
    except UnicodeEncodeError:  # a lone surrogate: never a key the index holds
        raise InvalidRequestError("invalid cursor", code="invalid_cursor") from None
    if "#" not in before or len(encoded) > 1024:
        raise InvalidRequestError("invalid cursor", code="invalid_cursor")
    return before


class DynamoStore:
    """:class:`~ryusen_server.ports.RunStore` on one DynamoDB table (see the module docstring)."""

    def __init__(
        self,
        client: DynamoDBClient,
        table_name: str,
        counter: RequestCounter | None = None,
        *,
        retention_s: float | None = None,
    ) -> None:
        self._client = client
        self.table_name = table_name
        self.counter = counter or RequestCounter()
        self.retention_s = retention_s
        """How long a finished run's items are kept (the table's TTL attribute ``expires_at``); None: forever."""
        self._values = _ValueCache(VALUE_CACHE_BYTES)

    # ---- runs -----------------------------------------------------------------------

    def get(self, run_id: str) -> RunState | None:
        self.counter.add("dynamodb.read")
        # consistent: the engine decides on what it reads, then writes on that version
        item = self._client.get_item(TableName=self.table_name, Key=_run_key(run_id), ConsistentRead=True).get("Item")
        if not item or _expired(item):
            return None  # past its retention: DynamoDB deletes expired items late and in no order
        return self._decode([item])[0]

    def peek(self, run_id: str) -> RunState | None:
        """Read without counting a request (test harness and benchmark bookkeeping)."""
        item = self._client.get_item(TableName=self.table_name, Key=_run_key(run_id), ConsistentRead=True).get("Item")
        return self._decode([item], count=False)[0] if item else None

    def create(self, state: RunState) -> None:
        encoded = self._write_values_and_encode(state)
        run = encoded.item
        if state.idempotency_key is None:
            self._put_new_run(state, run)
        else:
            self._put_new_run_with_key(state, run, state.idempotency_key)

    def _put_new_run(self, state: RunState, run: dict[str, AttributeValueTypeDef]) -> None:
        run, token = _with_write_token(run)
        self.counter.add("dynamodb.write", _item_bytes(run))
        try:
            self._client.put_item(
                TableName=self.table_name,
                Item=run,
                ConditionExpression="attribute_not_exists(pk)",
                ReturnValuesOnConditionCheckFailure="ALL_OLD",
            )
        except ClientError as exc:
            if _error_code(exc) == "ConditionalCheckFailedException":
                if _written_by(cast("Mapping[str, Any]", exc.response).get("Item"), token):
                    return  # our first try committed; this was botocore's retry of it
                raise RunExistsError(state.id) from None
            if _is_item_too_large(exc):
                raise PayloadTooLargeError(f"run {state.id} is larger than a DynamoDB item") from None
            raise

    def _put_new_run_with_key(self, state: RunState, run: dict[str, AttributeValueTypeDef], key: str) -> None:
        idem: dict[str, AttributeValueTypeDef] = {
            **_idempotency_key(state.function_id, key),
            "run_id": {"S": state.id},
        }
        if len(_idempotency_pk(state.function_id, key).encode()) > MAX_KEY_BYTES:
            raise InvalidRequestError("idempotency key is too long", code="idempotency_key_too_long")
        run, token = _with_write_token(run)
        for attempt in range(_TRANSIENT_RETRIES):
            self.counter.add("dynamodb.write", _item_bytes(run) + _item_bytes(idem))
            try:
                self._client.transact_write_items(
                    TransactItems=[
                        {
                            "Put": {
                                "TableName": self.table_name,
                                "Item": run,
                                "ConditionExpression": "attribute_not_exists(pk)",
                                "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
                            }
                        },
                        {
                            "Put": {
                                "TableName": self.table_name,
                                "Item": idem,
                                "ConditionExpression": "attribute_not_exists(pk)",
                                "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
                            }
                        },
                    ]
                )
                return
            except ClientError as exc:
                if _error_code(exc) != "TransactionCanceledException":
                    raise
                cancelled = cast("list[Mapping[str, Any]]", exc.response.get("CancellationReasons", []))
                reasons = [r.get("Code", "None") for r in cancelled]
                if reasons and reasons[0] == "ConditionalCheckFailed" and _written_by(cancelled[0].get("Item"), token):
                    return  # our first try committed (AWS answers a retry with the same request token so, moto not)
                if len(reasons) == 2 and reasons[1] == "ConditionalCheckFailed":
                    # the key is taken (checked before the run id, as MemoryStore does)
                    holder = cancelled[1].get("Item")
                    raise RunExistsError(self._key_holder(holder, state.function_id, key) or state.id) from None
                if len(reasons) == 2 and reasons[0] == "ConditionalCheckFailed":
                    raise RunExistsError(state.id) from None
                if "ValidationError" in reasons:
                    raise PayloadTooLargeError(f"run {state.id} is larger than a DynamoDB item") from None
                if "TransactionConflict" not in reasons or attempt == _TRANSIENT_RETRIES - 1:
                    raise
                # a concurrent create of the same key is in flight: once it commits, our condition fails
                time.sleep(0.02 * 2**attempt)

    def _key_holder(self, item: Mapping[str, Any] | None, function_id: str, key: str) -> str | None:
        """The run id holding an idempotency key: from the cancelled transaction, else one read."""
        if item is None:
            self.counter.add("dynamodb.read")
            item = self._client.get_item(
                TableName=self.table_name, Key=_idempotency_key(function_id, key), ConsistentRead=True
            ).get("Item")
        if not item or "run_id" not in item:
            return None
        return str(item["run_id"]["S"])

    def save(self, state: RunState, *, expected_version: int) -> None:
        encoded = self._write_values_and_encode(state)
        run, token = _with_write_token(encoded.item)
        expires = self._expires_at(state)
        if expires is not None:
            run["expires_at"] = expires
        self.counter.add("dynamodb.write", _item_bytes(run))
        try:
            self._client.put_item(
                TableName=self.table_name,
                Item=run,
                ConditionExpression="version = :expected",
                ExpressionAttributeValues={":expected": {"N": str(expected_version)}},
                ReturnValuesOnConditionCheckFailure="ALL_OLD",
            )
        except ClientError as exc:
            if _error_code(exc) == "ConditionalCheckFailedException":
                # the stored run (if any) comes back in the error: no second read
                current = cast("Mapping[str, Any]", exc.response).get("Item")
                if _written_by(current, token):
                    return  # our first try committed; this was botocore's retry of it
                raise VersionConflictError(self._decode([current])[0] if current else None) from None
            if _is_item_too_large(exc):
                raise PayloadTooLargeError(f"run {state.id} is larger than a DynamoDB item") from None
            raise
        if expires is not None:
            self._expire_with_run(state, encoded.values, expires)

    def _expires_at(self, state: RunState) -> AttributeValueTypeDef | None:
        if self.retention_s is None or state.finished_at is None:
            return None
        return {"N": str(int(state.finished_at.timestamp() + self.retention_s))}

    def _expire_with_run(self, state: RunState, values: Mapping[str, bytes], expires: AttributeValueTypeDef) -> None:
        """A finished run's value items and idempotency key expire with it (written again with the TTL)."""
        items: list[dict[str, AttributeValueTypeDef]] = [
            {**_value_key(state.id, digest), "value": {"B": zlib.compress(raw)}, "expires_at": expires}
            for digest, raw in values.items()
        ]
        if state.idempotency_key is not None:
            items.append(
                {
                    **_idempotency_key(state.function_id, state.idempotency_key),
                    "run_id": {"S": state.id},
                    "expires_at": expires,
                }
            )
        if items:
            self._batch_write(items)

    def run_for_idempotency_key(self, function_id: str, key: str) -> str | None:
        if len(_idempotency_pk(function_id, key).encode()) > MAX_KEY_BYTES:
            return None  # too long to have been stored; create() rejects it
        return self._key_holder(None, function_id, key)

    def list_runs(
        self,
        *,
        function_id: str | None = None,
        phase: str | None = None,
        outcome: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> RunPage:
        """Newest first. Reads the index until ``limit + 1`` runs match (or it ends), so a page is full
        whenever more runs match, and the cursor is None exactly when none do."""
        if limit < 1:
            raise InvalidRequestError("limit must be at least 1", code="invalid_limit")
        before = _decode_cursor(cursor) if cursor else None
        matches: list[Mapping[str, Any]] = []
        for shard in range(LIST_SHARDS):
            matches.extend(self._list_shard(shard, function_id, phase, outcome, before, limit + 1))
        matches.sort(key=lambda item: str(item["list_sk"]["S"]), reverse=True)
        page = matches[:limit]
        ids = [_run_id_of(item) for item in page]
        runs = self._get_many(ids)
        next_cursor = _encode_cursor(page[-1]) if len(matches) > limit else None
        return RunPage(runs=[runs[i] for i in ids if i in runs], cursor=next_cursor)

    def _list_shard(
        self,
        shard: int,
        function_id: str | None,
        phase: str | None,
        outcome: str | None,
        before: str | None,
        wanted: int,
    ) -> list[Mapping[str, Any]]:
        """Up to ``wanted`` index items of one shard that match the filters, newest first, below ``before``."""
        values: dict[str, AttributeValueTypeDef] = {":runs": {"S": f"{LIST_PARTITION}#{shard}"}}
        condition = "list_pk = :runs"
        if before is not None:
            condition += " AND list_sk < :before"
            values[":before"] = {"S": before}
        filters: list[str] = []
        names: dict[str, str] = {}
        for attribute, value in (("function_id", function_id), ("phase", phase), ("outcome", outcome)):
            if value is not None:
                filters.append(f"#{attribute} = :{attribute}")
                names[f"#{attribute}"] = attribute
                values[f":{attribute}"] = {"S": value}
        query: QueryInputTypeDef = {
            "TableName": self.table_name,
            "IndexName": LIST_INDEX,
            "KeyConditionExpression": condition,
            "ExpressionAttributeValues": values,
            "ScanIndexForward": False,
        }
        if filters:
            query["FilterExpression"] = " AND ".join(filters)
            query["ExpressionAttributeNames"] = names
        matches: list[Mapping[str, Any]] = []
        page_size = wanted
        while True:
            query["Limit"] = page_size  # items evaluated before the filter
            self.counter.add("dynamodb.read")
            response = self._client.query(**query)
            matches.extend(response.get("Items", []))
            start = response.get("LastEvaluatedKey")
            if len(matches) >= wanted or not start:
                return matches[:wanted]
            query["ExclusiveStartKey"] = start
            page_size = min(page_size * 2, 1000)  # a selective filter: read more per request

    def _get_many(self, run_ids: Sequence[str]) -> dict[str, RunState]:
        """Bodies of a page of runs, by id: BatchGetItem in chunks of 100, retrying unprocessed keys."""
        items = self._batch_get([_run_key(run_id) for run_id in run_ids], projection="pk, body")
        return {state.id: state for state in self._decode(items, values=False)}

    # ---- large values (see the module docstring) ---------------------------------------

    def _write_values_and_encode(self, state: RunState) -> _Encoded:
        """Encode ``state`` and write its new value items; refuse a run item DynamoDB would refuse, first."""
        encoded = _encode_run(state)
        if (size := _item_bytes(encoded.item)) > MAX_ITEM_BYTES:
            limit = MAX_ITEM_BYTES
            raise PayloadTooLargeError(f"run {state.id} is {size} bytes as a DynamoDB item; the limit is {limit}")
        self._write_values(state.id, encoded.values)
        return encoded

    def _write_values(self, run_id: str, values: Mapping[str, bytes]) -> None:
        """Write the value items this process does not know to exist yet (BatchWriteItem, 25 a request)."""
        new = {digest: raw for digest, raw in values.items() if self._values.get(run_id, digest) is None}
        if not new:
            return
        items: list[dict[str, AttributeValueTypeDef]] = [
            {**_value_key(run_id, digest), "value": {"B": zlib.compress(raw)}} for digest, raw in new.items()
        ]
        self._batch_write(items)
        for digest, raw in new.items():
            self._values.put(run_id, digest, raw)

    def _decode(self, items: Sequence[Mapping[str, Any]], *, count: bool = True, values: bool = True) -> list[RunState]:
        """Run items to runs, their large values put back (read in BatchGetItem requests where not cached),
        or, with ``values=False`` (a listing), left out as None."""
        split = [(_run_id_of(item), *_split_body(item)) for item in items]
        if not values:
            return [RunState.model_validate(doc) for _, doc, _ in split]
        found: dict[tuple[str, str], bytes] = {}
        for run_id, _, offloaded in split:
            for _, digest in offloaded:
                if (raw := self._values.get(run_id, digest)) is not None:
                    found[(run_id, digest)] = raw
        wanted = {(run_id, digest) for run_id, _, offloaded in split for _, digest in offloaded} - found.keys()
        found.update(self._read_values(sorted(wanted), count=count))
        runs: list[RunState] = []
        for run_id, doc, offloaded in split:
            for path, digest in offloaded:
                if (run_id, digest) not in found:
                    raise RuntimeError(f"run {run_id}: its value item {digest} is missing")
                _place(doc, path, pydantic_core.from_json(found[(run_id, digest)]))
            runs.append(RunState.model_validate(doc))
        return runs

    def _read_values(self, wanted: Sequence[tuple[str, str]], *, count: bool) -> dict[tuple[str, str], bytes]:
        found: dict[tuple[str, str], bytes] = {}
        keys = [_value_key(run_id, digest) for run_id, digest in wanted]
        for item in self._batch_get(keys, consistent=True, count=count):
            run_id, digest = _run_id_of(item), str(item["sk"]["S"]).removeprefix("VAL#")
            raw = zlib.decompress(item["value"]["B"])
            found[(run_id, digest)] = raw
            self._values.put(run_id, digest, raw)
        return found

    def _batch_get(
        self,
        keys: Sequence[dict[str, AttributeValueTypeDef]],
        *,
        projection: str | None = None,
        consistent: bool = False,
        count: bool = True,
    ) -> list[Mapping[str, Any]]:
        """BatchGetItem in requests of 100 keys, retrying unprocessed keys."""
        items: list[Mapping[str, Any]] = []
        for offset in range(0, len(keys), 100):
            request: Any = {"Keys": list(keys[offset : offset + 100]), "ConsistentRead": consistent}
            if projection is not None:
                request["ProjectionExpression"] = projection
            started, attempt = time.monotonic(), 0
            while True:
                if count:
                    self.counter.add("dynamodb.read")
                response = self._client.batch_get_item(RequestItems={self.table_name: request})
                items.extend(response.get("Responses", {}).get(self.table_name, []))
                unprocessed = response.get("UnprocessedKeys", {}).get(self.table_name)
                if not unprocessed:
                    break
                request = {**request, "Keys": list(unprocessed["Keys"])}
                if time.monotonic() - started > BATCH_RETRY_BUDGET_S:
                    raise ThrottledError(f"DynamoDB left {len(request['Keys'])} keys unprocessed for {attempt} retries")
                time.sleep(_batch_backoff(attempt))
                attempt += 1
        return items

    def _batch_write(self, items: Sequence[dict[str, AttributeValueTypeDef]]) -> None:
        """Unconditional Puts in BatchWriteItem requests of 25, retrying unprocessed items."""
        for offset in range(0, len(items), 25):
            requests: Any = [{"PutRequest": {"Item": item}} for item in items[offset : offset + 25]]
            started, attempt = time.monotonic(), 0
            while True:
                self.counter.add("dynamodb.write", sum(_item_bytes(r["PutRequest"]["Item"]) for r in requests))
                response = self._client.batch_write_item(RequestItems={self.table_name: requests})
                requests = response.get("UnprocessedItems", {}).get(self.table_name)
                if not requests:
                    break
                if time.monotonic() - started > BATCH_RETRY_BUDGET_S:
                    raise ThrottledError(f"DynamoDB left {len(requests)} items unwritten for {attempt} retries")
                time.sleep(_batch_backoff(attempt))
                attempt += 1

    def runs_blocked_by_definition(self, function_id: str) -> list[str]:
        run_ids: list[str] = []
        query: QueryInputTypeDef = {
            "TableName": self.table_name,
            "IndexName": BLOCKED_INDEX,
            "KeyConditionExpression": "blocked_fn = :fn",
            "ExpressionAttributeValues": {":fn": {"S": function_id}},
        }
        while True:
            self.counter.add("dynamodb.read")
            response = self._client.query(**query)
            run_ids.extend(_run_id_of(item) for item in response.get("Items", []))
            start = response.get("LastEvaluatedKey")
            if not start:
                return run_ids
            query["ExclusiveStartKey"] = start

    # ---- releases ---------------------------------------------------------------------

    def put_release(self, release: Release) -> None:
        """One item per declared function and one for the app, in BatchWriteItem requests of 25."""
        body = _RELEASE.dump_json(release).decode()
        keys: list[dict[str, AttributeValueTypeDef]] = [
            {"pk": {"S": f"FN#{fn_id}"}, "sk": {"S": "RELEASE"}}
            for fn_id in dict.fromkeys(f.id for f in release.functions)
        ]
        keys.append({"pk": {"S": APPS_PARTITION}, "sk": {"S": f"APP#{release.app_id}"}})
        self._batch_write([{**key, "release": {"S": body}} for key in keys])

    def get_release(self, function_id: str) -> Release | None:
        self.counter.add("dynamodb.read")
        item = self._client.get_item(
            TableName=self.table_name,
            Key={"pk": {"S": f"FN#{function_id}"}, "sk": {"S": "RELEASE"}},
            ConsistentRead=True,  # a release just synced is what the next run must use (R1)
        ).get("Item")
        return _RELEASE.validate_json(item["release"]["S"]) if item else None

    def list_releases(self) -> list[Release]:
        releases: list[Release] = []
        query: QueryInputTypeDef = {
            "TableName": self.table_name,
            "KeyConditionExpression": "pk = :apps",
            "ExpressionAttributeValues": {":apps": {"S": APPS_PARTITION}},
            "ConsistentRead": True,
        }
        while True:
            self.counter.add("dynamodb.read")
            response = self._client.query(**query)
            releases.extend(_RELEASE.validate_json(item["release"]["S"]) for item in response.get("Items", []))
            start = response.get("LastEvaluatedKey")
            if not start:
                return releases
            query["ExclusiveStartKey"] = start


def create_table(client: DynamoDBClient, table_name: str) -> None:
    """Create the table and its GSIs (on-demand) if missing, and wait until it is active."""
    strings = ("pk", "sk", "list_pk", "list_sk", "blocked_fn")
    try:
        client.create_table(
            TableName=table_name,
            BillingMode="PAY_PER_REQUEST",
            AttributeDefinitions=[{"AttributeName": name, "AttributeType": "S"} for name in strings],
            KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}, {"AttributeName": "sk", "KeyType": "RANGE"}],
            GlobalSecondaryIndexes=[
                {
                    "IndexName": LIST_INDEX,
                    "KeySchema": [
                        {"AttributeName": "list_pk", "KeyType": "HASH"},
                        {"AttributeName": "list_sk", "KeyType": "RANGE"},
                    ],
                    "Projection": {
                        "ProjectionType": "INCLUDE",
                        "NonKeyAttributes": ["function_id", "phase", "outcome"],
                    },
                },
                {
                    "IndexName": BLOCKED_INDEX,
                    "KeySchema": [
                        {"AttributeName": "blocked_fn", "KeyType": "HASH"},
                        {"AttributeName": "list_sk", "KeyType": "RANGE"},
                    ],
                    "Projection": {"ProjectionType": "KEYS_ONLY"},
                },
            ],
        )
    except ClientError as exc:
        if _error_code(exc) != "ResourceInUseException":  # it exists already: just wait for it
            raise
    client.get_waiter("table_exists").wait(TableName=table_name, WaiterConfig={"Delay": 1, "MaxAttempts": 120})

"""The run store on one DynamoDB table: conditional writes are the engine's fencing.

Theory of operation. Every item has a string ``pk`` and ``sk``:

=============================  ===========  ==========================================
pk                             sk           what
=============================  ===========  ==========================================
``RUN#{run_id}``               ``RUN``      the run: ``version`` (N), ``body`` (B,
                                            zlib of ``RunState.model_dump_json()``),
                                            and index attributes (below)
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

* ``runs_by_created``: partition ``list_pk`` = ``RUNS`` (a constant), sort
  ``list_sk`` = ``{created_at}#{run_id}``; newest first with
  ``ScanIndexForward=False``. It projects only the filter attributes (not the
  body): a save that changes neither phase nor outcome then costs no index
  write, which keeps the per-step path at one write. A page is read from the
  index, filtered, then its bodies are fetched with one BatchGetItem.
* ``runs_blocked_by_definition``: partition ``blocked_fn`` = function id, an
  attribute written only while the run has a duplicate-step-id blocker (a
  sparse index, keys only).

Writes: ``create`` is a conditional Put (``attribute_not_exists(pk)``), or a
transaction of that Put and the idempotency item's conditional Put when the
run has a key; ``save`` is one Put conditioned on ``version = :expected``. A
failed condition becomes :class:`RunExistsError` or
:class:`VersionConflictError` carrying the current item, read from the error
itself (``ReturnValuesOnConditionCheckFailure=ALL_OLD``), never by a second
request. Every request is counted as ``dynamodb.read`` or ``dynamodb.write``
(a transaction or batch is one request; writes also add their item bytes).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import time
import zlib
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

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
    VersionConflictError,
)

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.client import DynamoDBClient
    from mypy_boto3_dynamodb.type_defs import AttributeValueTypeDef, QueryInputTypeDef

log = logging.getLogger("ryusen.aws.store")

LIST_INDEX = "runs_by_created"
BLOCKED_INDEX = "runs_blocked_by_definition"
LIST_PARTITION = "RUNS"
APPS_PARTITION = "APPS"
MAX_KEY_BYTES = 2048
"""DynamoDB's limit on a partition key value."""

_RELEASE = TypeAdapter(Release)
_CURSOR_KEYS = frozenset({"pk", "sk", "list_pk", "list_sk"})
_TRANSIENT_RETRIES = 5


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


def _run_item(state: RunState) -> dict[str, AttributeValueTypeDef]:
    created = _utc_iso(state.created_at)
    item: dict[str, AttributeValueTypeDef] = {
        **_run_key(state.id),
        "version": {"N": str(state.version)},
        "body": {"B": zlib.compress(state.model_dump_json().encode())},
        "function_id": {"S": state.function_id},
        "phase": {"S": state.phase.value},
        "created_at": {"S": created},
        "list_pk": {"S": LIST_PARTITION},
        "list_sk": {"S": f"{created}#{state.id}"},
    }
    if state.outcome is not None:
        item["outcome"] = {"S": state.outcome.value}
    if state.blocked_by_definition:
        item["blocked_fn"] = {"S": state.function_id}
    return item


def _decode_run(item: Mapping[str, Any]) -> RunState:
    return RunState.model_validate_json(zlib.decompress(item["body"]["B"]))


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


def _encode_cursor(item: Mapping[str, Any]) -> str:
    key = {name: {"S": item[name]["S"]} for name in sorted(_CURSOR_KEYS)}
    return base64.urlsafe_b64encode(json.dumps(key, separators=(",", ":")).encode()).decode()


def _decode_cursor(cursor: str) -> dict[str, AttributeValueTypeDef]:
    """The ExclusiveStartKey a cursor stands for; anything else a client sends is an invalid request."""
    try:
        key = json.loads(base64.urlsafe_b64decode(cursor.encode()))
    except (ValueError, binascii.Error):
        raise InvalidRequestError("invalid cursor", code="invalid_cursor") from None
    valid = (
        isinstance(key, dict)
        and set(key) == _CURSOR_KEYS
        and all(isinstance(v, dict) and set(v) == {"S"} and isinstance(v["S"], str) for v in key.values())
        and key["list_pk"]["S"] == LIST_PARTITION
        and key["pk"]["S"].startswith("RUN#")
    )
    if not valid:
        raise InvalidRequestError("invalid cursor", code="invalid_cursor")
    return cast("dict[str, AttributeValueTypeDef]", key)


class DynamoStore:
    """:class:`~ryusen_server.ports.RunStore` on one DynamoDB table (see the module docstring)."""

    def __init__(self, client: DynamoDBClient, table_name: str, counter: RequestCounter | None = None) -> None:
        self._client = client
        self.table_name = table_name
        self.counter = counter or RequestCounter()

    # ---- runs -----------------------------------------------------------------------

    def get(self, run_id: str) -> RunState | None:
        self.counter.add("dynamodb.read")
        # consistent: the engine decides on what it reads, then writes on that version
        item = self._client.get_item(TableName=self.table_name, Key=_run_key(run_id), ConsistentRead=True).get("Item")
        return _decode_run(item) if item else None

    def peek(self, run_id: str) -> RunState | None:
        """Read without counting a request (test harness and benchmark bookkeeping)."""
        item = self._client.get_item(TableName=self.table_name, Key=_run_key(run_id), ConsistentRead=True).get("Item")
        return _decode_run(item) if item else None

    def create(self, state: RunState) -> None:
        run = _run_item(state)
        if state.idempotency_key is None:
            self._put_new_run(state, run)
        else:
            self._put_new_run_with_key(state, run, state.idempotency_key)

    def _put_new_run(self, state: RunState, run: dict[str, AttributeValueTypeDef]) -> None:
        self.counter.add("dynamodb.write", _item_bytes(run))
        try:
            self._client.put_item(TableName=self.table_name, Item=run, ConditionExpression="attribute_not_exists(pk)")
        except ClientError as exc:
            if _error_code(exc) == "ConditionalCheckFailedException":
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
                reasons = [r.get("Code", "None") for r in exc.response.get("CancellationReasons", [])]
                if len(reasons) == 2 and reasons[1] == "ConditionalCheckFailed":
                    # the key is taken (checked before the run id, as MemoryStore does)
                    holder = cast("Mapping[str, Any]", exc.response["CancellationReasons"][1]).get("Item")
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
        run = _run_item(state)
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
                raise VersionConflictError(_decode_run(current) if current else None) from None
            if _is_item_too_large(exc):
                raise PayloadTooLargeError(f"run {state.id} is larger than a DynamoDB item") from None
            raise

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
        values: dict[str, AttributeValueTypeDef] = {":runs": {"S": LIST_PARTITION}}
        filters: list[str] = []
        names: dict[str, str] = {}
        for attribute, wanted in (("function_id", function_id), ("phase", phase), ("outcome", outcome)):
            if wanted is not None:
                filters.append(f"#{attribute} = :{attribute}")
                names[f"#{attribute}"] = attribute
                values[f":{attribute}"] = {"S": wanted}
        query: QueryInputTypeDef = {
            "TableName": self.table_name,
            "IndexName": LIST_INDEX,
            "KeyConditionExpression": "list_pk = :runs",
            "ExpressionAttributeValues": values,
            "ScanIndexForward": False,
        }
        if filters:
            query["FilterExpression"] = " AND ".join(filters)
            query["ExpressionAttributeNames"] = names
        start = _decode_cursor(cursor) if cursor else None
        matches: list[Mapping[str, Any]] = []
        page_size = limit + 1
        while True:
            if start is not None:
                query["ExclusiveStartKey"] = start
            query["Limit"] = page_size  # items evaluated before the filter
            self.counter.add("dynamodb.read")
            response = self._client.query(**query)
            for item in response.get("Items", []):
                matches.append(item)
                if len(matches) > limit:
                    break
            start = response.get("LastEvaluatedKey")
            if len(matches) > limit or not start:
                break
            page_size = min(page_size * 2, 1000)  # a selective filter: read more per request
        page = matches[:limit]
        ids = [str(item["pk"]["S"]).removeprefix("RUN#") for item in page]
        runs = self._get_many(ids)
        next_cursor = _encode_cursor(page[-1]) if len(matches) > limit else None
        return RunPage(runs=[runs[i] for i in ids if i in runs], cursor=next_cursor)

    def _get_many(self, run_ids: Sequence[str]) -> dict[str, RunState]:
        """Bodies of a page of runs, by id: BatchGetItem in chunks of 100, retrying unprocessed keys."""
        found: dict[str, RunState] = {}
        for offset in range(0, len(run_ids), 100):
            keys = [_run_key(run_id) for run_id in run_ids[offset : offset + 100]]
            for attempt in range(_TRANSIENT_RETRIES + 1):
                self.counter.add("dynamodb.read")
                response = self._client.batch_get_item(
                    RequestItems={self.table_name: {"Keys": keys, "ProjectionExpression": "pk, body"}}
                )
                for item in response.get("Responses", {}).get(self.table_name, []):
                    found[str(item["pk"]["S"]).removeprefix("RUN#")] = _decode_run(item)
                unprocessed = response.get("UnprocessedKeys", {}).get(self.table_name)
                if not unprocessed:
                    break
                keys = list(unprocessed["Keys"])
                if attempt == _TRANSIENT_RETRIES:
                    raise RuntimeError(f"DynamoDB left {len(keys)} keys unprocessed after {attempt} retries")
                time.sleep(0.02 * 2**attempt)
        return found

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
            run_ids.extend(str(item["pk"]["S"]).removeprefix("RUN#") for item in response.get("Items", []))
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
        items: list[dict[str, AttributeValueTypeDef]] = [{**key, "release": {"S": body}} for key in keys]
        for offset in range(0, len(items), 25):
            requests: Any = [{"PutRequest": {"Item": item}} for item in items[offset : offset + 25]]
            for attempt in range(_TRANSIENT_RETRIES + 1):
                self.counter.add("dynamodb.write", sum(_item_bytes(r["PutRequest"]["Item"]) for r in requests))
                response = self._client.batch_write_item(RequestItems={self.table_name: requests})
                requests = response.get("UnprocessedItems", {}).get(self.table_name)
                if not requests:
                    break
                if attempt == _TRANSIENT_RETRIES:
                    raise RuntimeError(f"DynamoDB left {len(requests)} release items unwritten")
                time.sleep(0.02 * 2**attempt)

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

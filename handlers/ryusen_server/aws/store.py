"""The run store on one DynamoDB table: conditional writes are the engine's fencing.

Theory of operation. Every item has a string ``pk`` and ``sk``:

=============================  ===========  ==========================================
pk                             sk           what
=============================  ===========  ==========================================
``RUN#{run_id}``               ``RUN``      the run's head: ``body`` (B, zlib of the run's
                                            JSON when it was created, large values left
                                            out), ``summary`` (B, the run as a list
                                            shows it), ``head_version`` and the index
                                            attributes (below)
``RUN#{run_id}``               ``EV#{version:012d}``
                                            a journal entry: ``entry`` (B, zlib of what
                                            changed from the version before, see
                                            :mod:`.journal`, large values left out)
``RUN#{run_id}``               ``VAL#{sha256}``
                                            one large value of the run (``value``,
                                            B, zlib of its JSON), content-addressed
``IDEM#{function_id}#{key}``   ``IDEM#{function_id}``
                                            an idempotency key: ``run_id`` of its run
``REL#{sha256}``               ``RELEASE``  one synced release (``release``, its JSON), never changed
``FN#{function_id}#{copy}``    ``RELEASE``  ``release_ref``: the digest of the newest release declaring
                                            the function, in :data:`RELEASE_COPIES` copies
``APPS``                       ``APP#{app_id}``
                                            ``release_ref`` of the newest release of each app
=============================  ===========  ==========================================

Every ``B`` attribute above is zlib. The head's ``body`` and ``summary`` and each journal entry are
compressed with a preset dictionary (:mod:`.journal_dictionary`, named in the stream's header): alone, an
entry is mostly field names, which the dictionary holds. Items written before dictionaries, and large values,
are plain zlib; a read takes either.

(The idempotency item's ``sk`` repeats the function id so that the pair is
unambiguous even when a function id or a key contains ``#``. App releases
share one partition so that ``list_releases`` is one Query, not a Scan.)

The journal (docs/design/run-journal.md). A run is its head's ``body`` with
its entries applied in order. A save writes the entry of the next version
with ``attribute_not_exists(sk)``: of two writers of one version exactly one
succeeds, so the entry's key is the fence. An entry holds only what the
decision changed (a step or two, an attempt, a few run fields), so a write
costs the same at step 10 and at step 10,000; an entry over
:data:`ENTRY_BUDGET_BYTES` packed also moves its smaller values out, to stay
within two write units. A process keeps the newest state of the runs it
touched (:class:`_RunCache`): reading one is a consistent Query for the
entries after that version, usually none. A process that never saw the run
reads the head and every entry in one (paginated) Query. The result function
reads nothing at all for an outcome whose attempt the state it keeps holds in
flight (``cached``): its decision's write is fenced by the entry's key like any
other, and a decision that would write nothing is taken again on a read.

The head shows what a list shows. A save that changes it (phase, outcome,
recovery, blockers, the finish, the step count every
:data:`STEP_COUNT_REFRESH` steps and each doubling after) writes its entry and the head's update in
one transaction, the update conditioned on an older ``head_version``: a list
never shows a version that was not written, nor misses one that was. Such
saves are a few per run; every other save is the entry's PutItem alone.

The head carries the index attributes ``function_id``, ``phase``,
``outcome`` (only once decided) and ``created_at`` (fixed-width UTC ISO), and
two GSIs read them:

* ``runs_by_created``: partition ``list_pk`` = ``RUNS#{shard}``, one of
  :data:`LIST_SHARDS` values chosen by a digest of the run id (one partition
  key value takes about 1,000 writes per second, so a constant would cap the
  whole deployment's run starts and status changes), sort ``list_sk`` =
  ``{created_at}#{run_id}``. A page queries every shard newest first
  (``ScanIndexForward=False``, before the cursor), at most
  :data:`LIST_SCAN_ITEMS` index items a shard, merges, and keeps the newest
  of those above the point every shard reached; the cursor is the ``list_sk``
  of the last run returned, or that point (a selective filter can give a short
  page, even an empty one, with a cursor). The index
  projects only the filter attributes. A page's summaries are fetched with
  one BatchGetItem of the heads (the runs it returns carry no steps; the page
  gives their step counts).
* ``runs_blocked_by_definition``: partition ``blocked_fn`` = function id, an
  attribute written only while the run has a duplicate-step-id blocker (a
  sparse index, keys only).
* ``runs_to_check``: partition ``check_pk`` = ``CHECK#{shard}`` (the listing's
  shards), sort ``check_at`` (fixed-width UTC ISO), written only while the run
  is unfinished (sparse, keys only): when the sweeper should look at it
  (:func:`~ryusen_server.ports.check_time`). The head is rewritten only a few
  times per run, so the sweeper moves ``check_at`` on (``defer_check``) for a
  run it looked at whose work is not overdue.

Large values. A JSON value (a run's input, output and error, a step's
result, error, compensation result and compensation error, an attempt's
error, a stale submission's outcome) over :data:`OFFLOAD_BYTES` serialized is
not kept in the head or an entry: the item records where it goes and the
SHA-256 digest of its JSON, and the value is an item of its own keyed by that
digest. A value item never changes (its key is its content), so it needs no
fencing: new value items are written first (BatchWriteItem), then the entry.
If that write loses a race, the value items stay and are simply found again
when the winning or the next decision refers to them. A process remembers the
values it has written or read (:class:`_ValueCache`), so a value is written
once and, in a warm process, read once.

Retention. Every item gets its ``expires_at`` when it is written: the finish
plus the retention once the run has finished, else the write plus the
retention plus :data:`LIVE_EXPIRY_S`. The head records the earliest expiry of
the run's items (``items_expire_at``); when the sweeper moves an unfinished
run's check time (``defer_check``) past what that allows, the run's items are
written again with a later expiry. The save that finishes a run sets the head's
expiry to the finish plus the retention, in the same transaction as its entry:
the head is the first item of a finished run to expire, and nothing of the run
expires sooner. DynamoDB deletes expired items late and in no order, so a read
that meets any expired item of a run answers that the run is gone.

Writes: ``create`` is a conditional Put of the head
(``attribute_not_exists(pk)``), or a transaction of that Put and the
idempotency item's conditional Put when the run has a key. A failed
condition becomes :class:`RunExistsError` or :class:`VersionConflictError`
(carrying the current run: the cached state and the entries after it, one
Query). Every run write carries a fresh ``write_token``: when botocore
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

import botocore.exceptions
import pydantic_core
from botocore.exceptions import ClientError
from pydantic import TypeAdapter

from ..core import decide as _core
from ..core.model import RunState
from ..core.view import run_summary_view, summary
from ..ports import (
    CHECK_HORIZON_S,
    InvalidRequestError,
    PayloadTooLargeError,
    Release,
    RequestCounter,
    RunExistsError,
    RunPage,
    StoreUnavailableError,
    VersionConflictError,
    check_time,
)
from . import journal, journal_dictionary

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.client import DynamoDBClient
    from mypy_boto3_dynamodb.type_defs import AttributeValueTypeDef, QueryInputTypeDef

log = logging.getLogger("ryusen.aws.store")

LIST_INDEX = "runs_by_created"
BLOCKED_INDEX = "runs_blocked_by_definition"
CHECK_INDEX = "runs_to_check"
CHECK_PARTITION = "CHECK"
LIST_PARTITION = "RUNS"
LIST_SHARDS = 16
"""Partition keys of the listing index (``RUNS#0`` ...): fixed for a table's life."""
LIST_SCAN_ITEMS = 500
"""The most index items a listing page reads from one shard: 16 shards, about 8,000 items of under 200 bytes,
about 200 read units and at most 64 requests a page, well within API Gateway's 29 s."""
APPS_PARTITION = "APPS"
RELEASE_PREFIX = "REL#"
RELEASE_COPIES = 8
"""Copies of each function's release pointer: a read picks one at random, so a busy function's reads (every
start and every new dispatch message) spread over this many partitions (docs/design/scale.md)."""
RELEASE_CACHE = 64
"""How many release bodies one process remembers (they never change: a sync writes a new one)."""
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
RUN_CACHE_RUNS = 256
"""How many runs' newest states one process remembers."""
ENTRY_BUDGET_BYTES = 1536
"""A journal entry's packed change over this many bytes also offloads its values over ``SMALL_OFFLOAD_BYTES``
(so that an entry stays within 2 write units, 2 KB with its key and attribute names)."""
STEP_COUNT_REFRESH = 100
"""A run's head item (what a list shows) is rewritten with its step count at this many steps, and at each
doubling after (see ``_step_count_band``)."""
LIVE_EXPIRY_S = 30 * 86_400
"""With a retention, an item written while its run is unfinished expires this long after the write, plus the
retention; the sweeper's look at a run that lives longer writes its items again with a later expiry."""
RENEW_MARGIN_S = 7 * 86_400
"""How long past a run's next look by the sweeper its items must still outlive the retention (a sweeper
that is late by up to this long loses nothing)."""
HEAD_SK = "RUN"
ENTRY_PREFIX = "EV#"
VALUE_PREFIX = "VAL#"

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


class ThrottledError(StoreUnavailableError):
    """DynamoDB kept throttling a batch past the retry budget: nothing is decided, the caller tries again later
    (a dispatch message comes back; an API request answers 503)."""

    code = "throttled"
    status = 503


def _run_key(run_id: str) -> dict[str, AttributeValueTypeDef]:
    return {"pk": {"S": f"RUN#{run_id}"}, "sk": {"S": "RUN"}}


def _release_key(digest: str) -> dict[str, AttributeValueTypeDef]:
    return {"pk": {"S": f"{RELEASE_PREFIX}{digest}"}, "sk": {"S": "RELEASE"}}


def _release_pointer_key(function_id: str, copy: int) -> dict[str, AttributeValueTypeDef]:
    return {"pk": {"S": f"FN#{function_id}#{copy}"}, "sk": {"S": "RELEASE"}}


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

VALUE_KEYS = frozenset(("input", "output", "error", "result", "compensation_result", "compensation_error", "outcome"))
"""The fields that hold a JSON value of unbounded size (the offload candidates), at any depth of a dumped
run or a journal delta; a value is never looked into."""


def _offload(doc: Any, offload_bytes: int) -> tuple[list[tuple[Path, str]], dict[str, bytes]]:
    """Take every value over ``offload_bytes`` serialized out of ``doc`` (in place): where each went, by
    digest, and the values."""
    offloaded: list[tuple[Path, str]] = []
    values: dict[str, bytes] = {}

    def walk(node: Any, path: Path) -> None:
        children: Iterator[tuple[str | int, Any]]
        children = iter(node.items()) if isinstance(node, dict) else enumerate(node)
        for key, value in list(children):
            if value is None:
                continue
            if isinstance(key, str) and key in VALUE_KEYS and isinstance(node, dict):
                raw = pydantic_core.to_json(value)
                if len(raw) > offload_bytes:
                    digest = hashlib.sha256(raw).hexdigest()
                    node[key] = None
                    offloaded.append(([*path, key], digest))
                    values[digest] = raw
            elif isinstance(value, dict | list):
                walk(value, [*path, key])

    walk(doc, [])
    return offloaded, values


def _value_key(run_id: str, digest: str) -> dict[str, AttributeValueTypeDef]:
    return {"pk": {"S": f"RUN#{run_id}"}, "sk": {"S": f"VAL#{digest}"}}


def _entry_key(run_id: str, version: int) -> dict[str, AttributeValueTypeDef]:
    return {"pk": {"S": f"RUN#{run_id}"}, "sk": {"S": f"{ENTRY_PREFIX}{version:012d}"}}


@dataclass(frozen=True, slots=True)
class _Packed:
    blob: bytes
    """zlib of ``{"doc": ..., "offloaded": [[path, digest], ...]}``"""
    values: dict[str, bytes]
    """The large values: digest to serialized JSON."""


def _compress(raw: bytes) -> bytes:
    """zlib with the current preset dictionary (:mod:`.journal_dictionary`): an entry is mostly field names and
    shape, which the dictionary holds, so it packs to about a third of plain zlib's size."""
    compressor = zlib.compressobj(zdict=journal_dictionary.CURRENT)
    return compressor.compress(raw) + compressor.flush()


FDICT = 0x20
"""The bit of a zlib stream's second byte that says a DICTID (the dictionary's Adler-32) follows (RFC 1950; the
first byte's low nibble is 8, deflate, and the two bytes are a multiple of 31)."""


def _decompress(blob: bytes) -> bytes:
    """An item's compressed bytes, with the dictionary its stream names, or none (plain zlib, as every item was
    written before dictionaries). A dictionary this code does not know is a ``zlib.error`` that says so."""
    if len(blob) >= 6 and blob[0] & 0x0F == 8 and (blob[0] << 8 | blob[1]) % 31 == 0 and blob[1] & FDICT:
        ident = int.from_bytes(blob[2:6], "big")
        dictionary = journal_dictionary.DICTIONARIES.get(ident)
        if dictionary is None:
            raise zlib.error(
                f"written with store dictionary 0x{ident:08x}, which this version of Ryusen does not know"
                " (written by a newer one: deploy it again)"
            )
        decompressor = zlib.decompressobj(zdict=dictionary)
        raw = decompressor.decompress(blob) + decompressor.flush()
        if not decompressor.eof:  # cut short (zlib.decompress says so for a plain stream)
            raise zlib.error("incomplete or truncated stream")
        return raw
    return zlib.decompress(blob)


def _pack(doc: Any, *, budget: int) -> _Packed:
    """``doc`` compressed, its values over :data:`OFFLOAD_BYTES` out; if that is still over ``budget`` bytes,
    also those over :data:`SMALL_OFFLOAD_BYTES`, when that makes it smaller."""
    packed = _pack_with(doc, OFFLOAD_BYTES)
    if len(packed.blob) > budget:
        smaller = _pack_with(doc, SMALL_OFFLOAD_BYTES)
        if len(smaller.blob) < len(packed.blob):
            return smaller
    return packed


def _pack_with(doc: Any, offload_bytes: int) -> _Packed:
    doc = pydantic_core.from_json(pydantic_core.to_json(doc))  # a copy to take values out of
    offloaded, values = _offload(doc, offload_bytes)
    blob = _compress(pydantic_core.to_json({"doc": doc, "offloaded": offloaded}))
    return _Packed(blob=blob, values=values)


def _unpack(blob: bytes) -> tuple[Any, list[tuple[Path, str]]]:
    """A packed document (large values still out) and where each large value goes."""
    loaded = pydantic_core.from_json(_decompress(blob))
    return loaded["doc"], [(path, digest) for path, digest in loaded["offloaded"]]


def _place(doc: Any, path: Path, value: Any) -> None:
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


class _ReleaseCache:
    """Release bodies by digest, least recently used out first (a body never changes)."""

    def __init__(self, limit: int) -> None:
        self._bodies: OrderedDict[str, Release] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def get(self, digest: str) -> Release | None:
        with self._lock:
            release = self._bodies.get(digest)
            if release is not None:
                self._bodies.move_to_end(digest)
            return release

    def put(self, digest: str, release: Release) -> None:
        with self._lock:
            self._bodies[digest] = release
            self._bodies.move_to_end(digest)
            while len(self._bodies) > self._limit:
                self._bodies.popitem(last=False)


class _RunCache:
    """The newest state of each run this process has read or written, least recently used out first.

    Never trusted as current: a read asks only for the journal entries after the
    cached version (one Query), and a write is fenced by its entry's key. A
    cached state is read-only, like every state the core is given.
    """

    def __init__(self, limit: int) -> None:
        self._runs: OrderedDict[str, RunState] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def get(self, run_id: str) -> RunState | None:
        with self._lock:
            state = self._runs.get(run_id)
            if state is not None:
                self._runs.move_to_end(run_id)
            return state

    def put(self, state: RunState) -> None:
        with self._lock:
            held = self._runs.get(state.id)
            if held is not None and held.version > state.version:
                return  # a concurrent read in this process saw newer entries
            self._runs[state.id] = state
            self._runs.move_to_end(state.id)
            while len(self._runs) > self._limit:
                self._runs.popitem(last=False)


def _reproduces(base: RunState, delta: journal.Delta, state: RunState) -> bool:
    """Does ``delta``, after a JSON round trip, turn ``base`` into exactly ``state`` (compared as JSON)?"""
    replayed = journal.apply(base, pydantic_core.from_json(pydantic_core.to_json(delta)))
    return replayed.model_dump_json() == state.model_dump_json()


def _step_count_band(steps: int) -> int:
    """0 below :data:`STEP_COUNT_REFRESH` steps, then one more each time the count doubles: the head's step
    count is rewritten when the band changes (from 100 steps on, a listed count is at least half the real
    one; below, it is the count when the head was last rewritten, for the phase, the words or the blockers;
    a run of 10,000 steps rewrites it 7 times)."""
    return 0 if steps < STEP_COUNT_REFRESH else (steps // STEP_COUNT_REFRESH).bit_length()


def _head_fields(state: RunState, expires: int | None) -> tuple[Any, ...]:
    """What a run's head item shows (a run list's summary and the index attributes): the head is rewritten
    when this changes (the step count in bands, ``_step_count_band``)."""
    return (
        state.phase,
        state.outcome,
        state.recovery,
        state.finished_at,
        tuple(b.message for b in state.blockers),
        summary(state),  # its words count the operator's skips too (decisions 24)
        state.blocked_by_definition,
        _step_count_band(len(state.steps)),
        expires,
    )


def _summary_doc(state: RunState) -> dict[str, Any]:
    """The run as a list shows it (:func:`run_summary_view`, its id in the key): a few hundred bytes less than
    the run itself, which the head's body already holds as created, so that the head stays within one write
    unit where it used to hold the run twice (a start and a finish's transaction one unit more each)."""
    doc = run_summary_view(state)
    del doc["id"]
    return doc


_LISTED_FIELDS = (
    "app_id",
    "function_id",
    "phase",
    "outcome",
    "recovery",
    "summary",
    "created_at",
    "finished_at",
    "steps",
    "blocked",
)
"""What a head's summary in the list's form holds (``run_summary_view`` but its id)."""


def _listed(run_id: str, item: Mapping[str, Any]) -> dict[str, Any]:
    """A head's ``summary`` as a list shows it; ValueError if it is not one. A head written before summaries were
    the list's own form holds the run without steps and unwind, and its step count apart (its words miss the
    operator's skips)."""
    doc = pydantic_core.from_json(_decompress(item["summary"]["B"]))
    if not isinstance(doc, dict):
        raise ValueError(f"a summary is a JSON object, not {type(doc).__name__}")
    if "summary" not in doc:
        return run_summary_view(RunState.model_validate(doc), int(item["step_count"]["N"]))
    missing = [name for name in _LISTED_FIELDS if name not in doc]
    if missing:
        raise ValueError(f"a summary without {', '.join(missing)}")
    return {"id": run_id, **{name: doc[name] for name in _LISTED_FIELDS}}  # a later release's extra fields: not shown


def _index_attributes(state: RunState) -> dict[str, AttributeValueTypeDef]:
    created = _utc_iso(state.created_at)
    item: dict[str, AttributeValueTypeDef] = {
        "function_id": {"S": state.function_id},
        "phase": {"S": state.phase.value},
        "created_at": {"S": created},
        "list_pk": {"S": _list_partition(state.id)},
        "list_sk": {"S": f"{created}#{state.id}"},
        "summary": {"B": _compress(pydantic_core.to_json(_summary_doc(state)))},
        "head_version": {"N": str(state.version)},
    }
    if state.outcome is not None:
        item["outcome"] = {"S": state.outcome.value}
    if state.blocked_by_definition:
        item["blocked_fn"] = {"S": state.function_id}
    check = check_time(state, state.updated_at)
    if check is not None:
        item["check_pk"] = {"S": _list_partition(state.id).replace(LIST_PARTITION, CHECK_PARTITION, 1)}
        item["check_at"] = {"S": _utc_iso(check)}
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


UNAVAILABLE_CODES = frozenset(
    {
        "ProvisionedThroughputExceededException",
        "ThrottlingException",
        "RequestLimitExceeded",
        "InternalServerError",
        "ServiceUnavailable",
    }
)
"""Errors that say DynamoDB did not take a call now (throttled, or failing), not that the call was wrong."""
_CONNECTION_ERRORS = (
    botocore.exceptions.ConnectionError,
    botocore.exceptions.HTTPClientError,
)


def _unavailable(exc: Exception) -> str | None:
    """Why ``exc`` (raised by a DynamoDB call after botocore's retries) means the store is unavailable for
    now, or None for an answer about the call itself (a condition, a validation, a conflict)."""
    if isinstance(exc, _CONNECTION_ERRORS):
        return f"{type(exc).__name__} (the call may or may not have been applied)"
    if not isinstance(exc, ClientError):
        return None
    code = _error_code(exc)
    if code in UNAVAILABLE_CODES:
        return code
    if code == "TransactionCanceledException":
        # botocore does not retry a transaction cancelled because one of its items was throttled
        reasons = {r.get("Code", "None") for r in exc.response.get("CancellationReasons", [])}
        if "ThrottlingError" in reasons and reasons <= {"ThrottlingError", "TransactionConflict", "None"}:
            return "TransactionCanceledException (ThrottlingError)"
    return None


class _GuardedClient:
    """The DynamoDB client, with each call's "not now" answers raised as :class:`StoreUnavailableError`."""

    def __init__(self, client: DynamoDBClient) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)
        if not callable(method):
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except Exception as exc:
                reason = _unavailable(exc)
                if reason is None:
                    raise
                raise StoreUnavailableError(f"DynamoDB {name}: {reason}", operation=name) from exc

        return call


def _is_item_too_large(exc: ClientError) -> bool:
    return _error_code(exc) == "ValidationException" and "size" in exc.response.get("Error", {}).get("Message", "")


def _list_partition(run_id: str) -> str:
    return f"{LIST_PARTITION}#{int(hashlib.sha256(run_id.encode()).hexdigest()[:8], 16) % LIST_SHARDS}"


def _encode_cursor(list_sk: str) -> str:
    """A page's cursor: the ``list_sk`` every shard resumes below."""
    body = json.dumps({"before": list_sk}, separators=(",", ":"))
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
        self._client = cast("DynamoDBClient", _GuardedClient(client))
        self.table_name = table_name
        self.counter = counter or RequestCounter()
        self.retention_s = retention_s
        """How long a finished run's items are kept (the table's TTL attribute ``expires_at``); None: forever."""
        self._values = _ValueCache(VALUE_CACHE_BYTES)
        self._runs = _RunCache(RUN_CACHE_RUNS)
        self._seal_key: str | None = None
        self._release_bodies = _ReleaseCache(RELEASE_CACHE)
        self.list_scan_items = LIST_SCAN_ITEMS
        """The most index items one listing page reads from each shard (see ``list_runs``)."""

    # ---- runs -----------------------------------------------------------------------

    def get(self, run_id: str) -> RunState | None:
        return self._read(run_id, count=True)

    def cached(self, run_id: str) -> RunState | None:
        cached = self._runs.get(run_id)
        return None if cached is None or self._past_retention(cached) else cached

    def peek(self, run_id: str) -> RunState | None:
        """Read without counting a request (test harness and benchmark bookkeeping)."""
        return self._read(run_id, count=False)

    def _read(self, run_id: str, *, count: bool) -> RunState | None:
        """The run as of its newest journal entry: the cached state and the entries after it (one Query), or
        the head and every entry (a run this process has not seen)."""
        cached = self._runs.get(run_id)
        if cached is not None:
            if self._past_retention(cached):
                return None
            after = f"{ENTRY_PREFIX}{cached.version + 1:012d}"
            items = self._query_run(run_id, after, f"{ENTRY_PREFIX}~", count=count)
            if not items:
                return cached
            if any(_expired(item) for item in items):
                return None
            state = self._replay(run_id, cached, items, count=count)
            self._runs.put(state)
            return state
        # consistent: the engine decides on what it reads, then writes on that version
        items = self._query_run(run_id, ENTRY_PREFIX, HEAD_SK, count=count)
        if not items or items[-1]["sk"]["S"] != HEAD_SK:
            return None
        head, entries = items[-1], items[:-1]
        if any(_expired(item) for item in items):
            return None  # past its retention: DynamoDB deletes expired items late and in no order
        base_doc, offloaded = _unpack(head["body"]["B"])
        self._fill(run_id, [(base_doc, offloaded)], count=count)
        base = RunState.model_validate(base_doc)
        state = self._replay(run_id, base, entries, count=count)
        self._runs.put(state)
        return state

    def _past_retention(self, state: RunState) -> bool:
        expires = self._expires_at(state)
        return expires is not None and expires <= time.time()

    def _query_run(self, run_id: str, low: str, high: str, *, count: bool) -> list[Mapping[str, Any]]:
        """A run's items with ``low <= sk <= high``, in key order (every page)."""
        query: QueryInputTypeDef = {
            "TableName": self.table_name,
            "KeyConditionExpression": "pk = :pk AND sk BETWEEN :low AND :high",
            "ExpressionAttributeValues": {":pk": {"S": f"RUN#{run_id}"}, ":low": {"S": low}, ":high": {"S": high}},
            "ConsistentRead": True,
        }
        items: list[Mapping[str, Any]] = []
        while True:
            if count:
                self.counter.add("dynamodb.read")
            response = self._client.query(**query)
            items.extend(response.get("Items", []))
            start = response.get("LastEvaluatedKey")
            if not start:
                return items
            query["ExclusiveStartKey"] = start

    def _replay(self, run_id: str, state: RunState, entries: Sequence[Mapping[str, Any]], *, count: bool) -> RunState:
        """``state`` with the journal ``entries`` after it applied, in order (each must be the next version)."""
        unpacked = [_unpack(entry["entry"]["B"]) for entry in entries]
        self._fill(run_id, unpacked, count=count)
        for entry, (delta, _) in zip(entries, unpacked, strict=True):
            version = int(str(entry["sk"]["S"]).removeprefix(ENTRY_PREFIX))
            if version != state.version + 1:
                raise RuntimeError(f"run {run_id}: journal entry {version} follows version {state.version}")
            state = journal.apply(state, delta)
            if state.version != version:
                raise RuntimeError(f"run {run_id}: journal entry {version} holds version {state.version}")
        return state

    def create(self, state: RunState) -> None:
        packed = _pack(state.model_dump(mode="json"), budget=BODY_BUDGET_BYTES)
        run: dict[str, AttributeValueTypeDef] = {
            **_run_key(state.id),
            "body": {"B": packed.blob},
            **_index_attributes(state),
        }
        item_expires = self._item_expires_at(state)
        if item_expires is not None:
            run["expires_at"] = {"N": str(item_expires)}
            run["items_expire_at"] = {"N": str(item_expires)}
        if (size := _item_bytes(run)) > MAX_ITEM_BYTES:
            raise PayloadTooLargeError(
                f"run {state.id} is {size} bytes as a DynamoDB item; the limit is {MAX_ITEM_BYTES}"
            )
        written = self._write_values(state.id, packed.values, item_expires)
        if state.idempotency_key is None:
            self._put_new_run(state, run)
        else:
            self._put_new_run_with_key(state, run, state.idempotency_key)
        self._values_committed(state.id, written)
        self._runs.put(state)

    def _fill(self, run_id: str, docs: Sequence[tuple[Any, Sequence[tuple[Path, str]]]], *, count: bool) -> None:
        """Put the large values back into ``docs`` (in place): from the cache, else in BatchGetItem requests."""
        wanted = {digest for _, offloaded in docs for _, digest in offloaded}
        found = {d: raw for d in wanted if (raw := self._values.get(run_id, d)) is not None}
        missing = sorted(wanted - found.keys())
        if missing:
            found.update(
                {d: raw for (_, d), raw in self._read_values([(run_id, d) for d in missing], count=count).items()}
            )
        for doc, offloaded in docs:
            for path, digest in offloaded:
                if digest not in found:
                    raise RuntimeError(f"run {run_id}: its value item {digest} is missing")
                _place(doc, path, pydantic_core.from_json(found[digest]))

    def _put_new_run(self, state: RunState, run: dict[str, AttributeValueTypeDef]) -> None:
        run, token = _with_write_token(run)
        self.counter.add("dynamodb.write", _item_bytes(run), items=[_item_bytes(run)])
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
        if "expires_at" in run:
            idem["expires_at"] = run["expires_at"]
        if len(_idempotency_pk(state.function_id, key).encode()) > MAX_KEY_BYTES:
            raise InvalidRequestError("idempotency key is too long", code="idempotency_key_too_long")
        run, token = _with_write_token(run)
        puts = [
            {
                "Put": {
                    "TableName": self.table_name,
                    "Item": item,
                    "ConditionExpression": "attribute_not_exists(pk)",
                    "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
                }
            }
            for item in (run, idem)
        ]
        failure = self._transact(puts, [_item_bytes(run), _item_bytes(idem)])
        if failure is None:
            return
        exc, cancelled = failure
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
        raise exc

    def _transact(self, items: list[Any], sizes: list[int]) -> tuple[ClientError, list[Mapping[str, Any]]] | None:
        """One TransactWriteItems, tried again while another transaction on the same items is in flight (once
        that commits, a condition decides). None when it committed, else the error and its reasons per item."""
        for attempt in range(_TRANSIENT_RETRIES):
            self.counter.add("dynamodb.write", sum(sizes), items=sizes, transactional=True)
            try:
                self._client.transact_write_items(TransactItems=items)
                return None
            except ClientError as exc:
                if _error_code(exc) != "TransactionCanceledException":
                    raise
                cancelled = cast("list[Mapping[str, Any]]", exc.response.get("CancellationReasons", []))
                reasons = {r.get("Code", "None") for r in cancelled}
                retry = reasons <= {"TransactionConflict", "None"} and "TransactionConflict" in reasons
                if not retry or attempt == _TRANSIENT_RETRIES - 1:
                    return exc, cancelled
                time.sleep(0.02 * 2**attempt)
        raise AssertionError("unreachable")

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
        """Append the journal entry of ``state``'s version: a Put that only succeeds if no entry holds that
        version yet (the fence), carrying what changed since ``expected_version``. When what a list shows
        changes too, the head item's update goes in the same transaction."""
        base = self._runs.get(state.id)
        if base is None or base.version != expected_version:
            base = self.get(state.id)
            if base is None or base.version != expected_version:
                raise VersionConflictError(base)
        if state.version != expected_version + 1:
            raise ValueError(f"run {state.id}: version {state.version} does not follow {expected_version}")
        delta = journal.diff(base, state)
        if _core.CHECK_PURITY and not _reproduces(base, delta, state):
            raise AssertionError(f"run {state.id}: its journal entry does not reproduce version {state.version}")
        expires = self._expires_at(state)
        item_expires = self._item_expires_at(state)
        packed = _pack(delta, budget=ENTRY_BUDGET_BYTES)
        entry: dict[str, AttributeValueTypeDef] = {**_entry_key(state.id, state.version), "entry": {"B": packed.blob}}
        if item_expires is not None:
            entry["expires_at"] = {"N": str(item_expires)}
        if (size := _item_bytes(entry)) > MAX_ITEM_BYTES:
            raise PayloadTooLargeError(
                f"run {state.id}: one change of {size} bytes is larger than a DynamoDB item ({MAX_ITEM_BYTES})"
            )
        written = self._write_values(state.id, packed.values, item_expires)
        entry, token = _with_write_token(entry)
        # the first write after a quiet spell rewrites the check time the sweeper may have put off (ports)
        quiet = (state.updated_at - base.updated_at).total_seconds() >= CHECK_HORIZON_S
        if not quiet and _head_fields(state, expires) == _head_fields(base, self._expires_at(base)):
            self._put_entry(state, entry, token)
        else:
            self._put_entry_and_head(state, entry, token, expires)
        self._values_committed(state.id, written)
        self._runs.put(state)

    def _put_entry(self, state: RunState, entry: dict[str, AttributeValueTypeDef], token: str) -> None:
        self.counter.add("dynamodb.write", _item_bytes(entry), items=[_item_bytes(entry)])
        try:
            self._client.put_item(
                TableName=self.table_name,
                Item=entry,
                ConditionExpression="attribute_not_exists(sk)",
                ReturnValuesOnConditionCheckFailure="ALL_OLD",
            )
        except ClientError as exc:
            if _error_code(exc) != "ConditionalCheckFailedException":
                raise
            if not _written_by(cast("Mapping[str, Any]", exc.response).get("Item"), token):
                raise VersionConflictError(self.get(state.id)) from None
            # our first try committed; this was botocore's retry of it

    def _put_entry_and_head(
        self, state: RunState, entry: dict[str, AttributeValueTypeDef], token: str, expires: int | None
    ) -> None:
        """The entry and the head's new summary in one transaction: a list never shows a version that was
        not written, and never misses one that was (a few writes in a run's life: start, blockers, end)."""
        attributes = _index_attributes(state)
        if expires is not None:
            attributes["expires_at"] = {"N": str(expires)}
        names = {f"#{name}": name for name in attributes}
        values = {f":{name}": value for name, value in attributes.items()}
        expression = "SET " + ", ".join(f"#{name} = :{name}" for name in attributes)
        dropped = [name for name in ("outcome", "blocked_fn", "check_pk", "check_at") if name not in attributes]
        if dropped:
            expression += " REMOVE " + ", ".join(f"#{name}" for name in dropped)
            names.update({f"#{name}": name for name in dropped})
        transaction: list[Any] = [
            {
                "Put": {
                    "TableName": self.table_name,
                    "Item": entry,
                    "ConditionExpression": "attribute_not_exists(sk)",
                    "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
                }
            },
            {
                "Update": {
                    "TableName": self.table_name,
                    "Key": _run_key(state.id),
                    "UpdateExpression": expression,
                    "ConditionExpression": "attribute_exists(pk) AND #head_version < :head_version",
                    "ExpressionAttributeNames": names,
                    "ExpressionAttributeValues": values,
                }
            },
        ]
        failure = self._transact(transaction, [_item_bytes(entry), _item_bytes(attributes)])
        if failure is None:
            return
        exc, cancelled = failure
        reasons = [r.get("Code", "None") for r in cancelled]
        if reasons and reasons[0] == "ConditionalCheckFailed":
            if _written_by(cancelled[0].get("Item"), token):
                return  # our first try committed; this was botocore's retry of it
            raise VersionConflictError(self.get(state.id)) from None
        if len(reasons) == 2 and reasons[1] == "ConditionalCheckFailed":
            # no head at an older version: the run is gone (past its retention) or never was
            raise VersionConflictError(self.get(state.id)) from None
        if "ValidationError" in reasons:
            raise PayloadTooLargeError(f"run {state.id}: a change is larger than a DynamoDB item") from None
        raise exc

    def _expires_at(self, state: RunState) -> int | None:
        if self.retention_s is None or state.finished_at is None:
            return None
        return int(state.finished_at.timestamp() + self.retention_s)

    def _item_expires_at(self, state: RunState) -> int | None:
        """The expiry an item of ``state``'s run gets when it is written: the finish plus the retention once the
        run has finished, else the write plus the retention plus :data:`LIVE_EXPIRY_S` (renewed by the
        sweeper's look while the run lives, ``defer_check``)."""
        if self.retention_s is None:
            return None
        if state.finished_at is not None:
            return int(state.finished_at.timestamp() + self.retention_s)
        return int(state.updated_at.timestamp() + self.retention_s + LIVE_EXPIRY_S)

    def _renew(self, run_id: str, expires: int) -> None:
        """Write an unfinished run's journal, value items and idempotency key again with a later expiry
        (BatchWriteItem, 25 a request; they never change, so a concurrent save loses nothing)."""
        items = [
            {**item, "expires_at": {"N": str(expires)}}
            for item in self._query_run(run_id, ENTRY_PREFIX, f"{VALUE_PREFIX}~", count=True)
            if item["sk"]["S"] != HEAD_SK and int(item.get("expires_at", {}).get("N", "0")) < expires
        ]
        state = self._read(run_id, count=True)
        if state is not None and state.idempotency_key is not None:
            items.append(
                {
                    **_idempotency_key(state.function_id, state.idempotency_key),
                    "run_id": {"S": run_id},
                    "expires_at": {"N": str(expires)},
                }
            )
        if items:
            self._batch_write(cast("list[dict[str, AttributeValueTypeDef]]", items))

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
        recovery: str | None = None,
        blocked: bool | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> RunPage:
        """Newest first. Each shard of the index is read until ``limit + 1`` runs match, it ends, or
        ``list_scan_items`` of its items were read: a page costs a bounded number of reads whatever the
        filter. A page holds the runs that matched above the point every shard reached (the newest of them,
        up to ``limit``); it may hold fewer, even none, with a cursor to go on. The cursor is None exactly
        when no run is left to read.

        ``recovery`` and ``blocked`` are not index attributes: they filter the page's summaries once read (a
        page read past runs that did not match them may hold fewer runs, with its cursor as without them)."""
        if limit < 1:
            raise InvalidRequestError("limit must be at least 1", code="invalid_limit")
        before = _decode_cursor(cursor) if cursor else None
        matches: list[Mapping[str, Any]] = []
        floor: str | None = None  # every shard was read down to here (inclusive)
        for shard in range(LIST_SHARDS):
            found, reached = self._list_shard(shard, function_id, phase, outcome, before, limit + 1)
            matches.extend(found)
            if reached is not None and (floor is None or reached > floor):
                floor = reached
        if floor is not None:
            matches = [item for item in matches if str(item["list_sk"]["S"]) >= floor]
        matches.sort(key=lambda item: str(item["list_sk"]["S"]), reverse=True)
        page = matches[:limit]
        ids = [_run_id_of(item) for item in page]
        runs = self._get_many(ids)
        if recovery is not None or blocked is not None:
            runs = {
                run_id: listed
                for run_id, listed in runs.items()
                if (recovery is None or listed["recovery"] == recovery)
                and (blocked is None or listed["blocked"] == blocked)
            }
        if len(matches) > limit:
            next_cursor: str | None = _encode_cursor(page[-1]["list_sk"]["S"])
        else:
            next_cursor = _encode_cursor(floor) if floor is not None else None
        return RunPage(runs=[runs[i] for i in ids if i in runs], cursor=next_cursor)

    def _list_shard(
        self,
        shard: int,
        function_id: str | None,
        phase: str | None,
        outcome: str | None,
        before: str | None,
        wanted: int,
    ) -> tuple[list[Mapping[str, Any]], str | None]:
        """Index items of one shard that match the filters, newest first, below ``before``: read until
        ``wanted`` match, the shard ends or ``list_scan_items`` were read. Also the ``list_sk`` of the last
        item read when the shard may hold more (None: it was read to its end)."""
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
        left = self.list_scan_items
        page_size = min(wanted, left)
        while True:
            query["Limit"] = page_size  # items read before the filter
            self.counter.add("dynamodb.read")
            response = self._client.query(**query)
            matches.extend(response.get("Items", []))
            left -= int(response.get("ScannedCount", page_size))
            start = response.get("LastEvaluatedKey")
            if not start:
                return matches, None
            if len(matches) >= wanted or left <= 0:
                return matches, str(start["list_sk"]["S"])
            query["ExclusiveStartKey"] = start
            page_size = min(page_size * 2, 1000, left)  # a selective filter: read more per request

    def _get_many(self, run_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The head items of a page of runs, by id, as a list shows them: BatchGetItem in chunks of 100,
        retrying unprocessed keys."""
        items = self._batch_get([_run_key(run_id) for run_id in run_ids], projection="pk, summary, step_count")
        runs: dict[str, dict[str, Any]] = {}
        for item in items:
            run_id = _run_id_of(item)
            try:
                runs[run_id] = _listed(run_id, item)
            except (ValueError, KeyError, zlib.error):
                # one item this code cannot read must not break every listing: it is left out, and said so
                log.exception("run %s: its summary cannot be read; left out of the list", run_id)
        return runs

    # ---- large values (see the module docstring) ---------------------------------------

    def _write_values(self, run_id: str, values: Mapping[str, bytes], expires: int | None = None) -> dict[str, bytes]:
        """Write the value items this process does not know to exist yet (BatchWriteItem, 25 a request), with the
        expiry of the write they come before; returns them, for :meth:`_values_committed` once it has committed.
        Until then they are not known to exist: should that write be refused (someone wrote the run meanwhile), the
        decision taken again writes them again, with its own expiry (the refused decision's may be sooner: a run
        it would have finished expires before one that goes on)."""
        new = {digest: raw for digest, raw in values.items() if self._values.get(run_id, digest) is None}
        if not new:
            return new
        items: list[dict[str, AttributeValueTypeDef]] = [
            {**_value_key(run_id, digest), "value": {"B": zlib.compress(raw)}} for digest, raw in new.items()
        ]
        if expires is not None:
            for item in items:
                item["expires_at"] = {"N": str(expires)}
        self._batch_write(items)
        return new

    def _values_committed(self, run_id: str, written: Mapping[str, bytes]) -> None:
        """The write that refers to ``written`` (value items just written) committed: they are known to exist,
        with an expiry that lasts as long as that write's."""
        for digest, raw in written.items():
            self._values.put(run_id, digest, raw)

    def _read_values(self, wanted: Sequence[tuple[str, str]], *, count: bool) -> dict[tuple[str, str], bytes]:
        found: dict[tuple[str, str], bytes] = {}
        keys = [_value_key(run_id, digest) for run_id, digest in wanted]
        for item in self._batch_get(keys, consistent=True, count=count):
            run_id, digest = _run_id_of(item), str(item["sk"]["S"]).removeprefix("VAL#")
            raw = _decompress(item["value"]["B"])
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
                sizes = [_item_bytes(r["PutRequest"]["Item"]) for r in requests]
                self.counter.add("dynamodb.write", sum(sizes), items=sizes)
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

    def runs_to_check(self, before: datetime, limit: int) -> list[str]:
        """Each shard's runs due by ``before``, oldest first, merged; at most ``limit``."""
        found: list[tuple[str, str]] = []
        for shard in range(LIST_SHARDS):
            query: QueryInputTypeDef = {
                "TableName": self.table_name,
                "IndexName": CHECK_INDEX,
                "KeyConditionExpression": "check_pk = :pk AND check_at <= :before",
                "ExpressionAttributeValues": {
                    ":pk": {"S": f"{CHECK_PARTITION}#{shard}"},
                    ":before": {"S": _utc_iso(before)},
                },
                "Limit": limit,
            }
            self.counter.add("dynamodb.read")
            response = self._client.query(**query)
            found.extend((item["check_at"]["S"], _run_id_of(item)) for item in response.get("Items", []))
        return [run_id for _, run_id in sorted(found)[:limit]]

    def defer_check(self, run_id: str, at: datetime) -> None:
        """Move the run's check time to ``at``. With a retention, its items must outlive that look plus the
        retention (and :data:`RENEW_MARGIN_S`, for a late sweeper): the update is conditioned on that, and
        when it fails the items are written again with a later expiry (``_renew``), then the head."""
        values: dict[str, AttributeValueTypeDef] = {":at": {"S": _utc_iso(at)}}
        condition = "attribute_exists(check_at)"  # a finished run stays out of the index
        if self.retention_s is not None:
            condition += " AND items_expire_at >= :needed"
            values[":needed"] = {"N": str(int(at.timestamp() + self.retention_s + RENEW_MARGIN_S))}
        self.counter.add("dynamodb.write")
        try:
            self._client.update_item(
                TableName=self.table_name,
                Key=_run_key(run_id),
                UpdateExpression="SET check_at = :at",
                ConditionExpression=condition,
                ExpressionAttributeValues=values,
                ReturnValuesOnConditionCheckFailure="ALL_OLD",
            )
            return
        except ClientError as exc:
            if _error_code(exc) != "ConditionalCheckFailedException":
                raise
            head = cast("Mapping[str, Any]", exc.response).get("Item")
        if self.retention_s is None or not head or "check_at" not in head:
            return  # finished (or gone): nothing to move
        expires = int(at.timestamp() + self.retention_s + LIVE_EXPIRY_S)
        self._renew(run_id, expires)
        self.counter.add("dynamodb.write")
        try:
            self._client.update_item(
                TableName=self.table_name,
                Key=_run_key(run_id),
                UpdateExpression="SET check_at = :at, expires_at = :expires, items_expire_at = :expires",
                ConditionExpression="attribute_exists(check_at)",  # a run that finished meanwhile keeps its expiry
                ExpressionAttributeValues={":at": {"S": _utc_iso(at)}, ":expires": {"N": str(expires)}},
            )
        except ClientError as exc:
            if _error_code(exc) != "ConditionalCheckFailedException":
                raise

    # ---- releases ---------------------------------------------------------------------

    def put_release(self, release: Release) -> None:
        """The release once (an item keyed by its digest, never changed), then a small pointer to it for each
        of :data:`RELEASE_COPIES` copies per declared function and one for the app (BatchWriteItem, 25 a
        request): a sync writes the manifest once, whatever the number of functions."""
        body = _RELEASE.dump_json(release).decode()
        digest = hashlib.sha256(body.encode()).hexdigest()
        item: dict[str, AttributeValueTypeDef] = {**_release_key(digest), "release": {"S": body}}
        if (size := _item_bytes(item)) > MAX_ITEM_BYTES:
            raise PayloadTooLargeError(f"the release is {size} bytes as a DynamoDB item; the limit is {MAX_ITEM_BYTES}")
        self.counter.add("dynamodb.write", size, items=[size])
        self._client.put_item(TableName=self.table_name, Item=item)  # first: a pointer never names a missing body
        self._release_bodies.put(digest, release)
        keys: list[dict[str, AttributeValueTypeDef]] = [
            _release_pointer_key(fn_id, copy)
            for fn_id in dict.fromkeys(f.id for f in release.functions)
            for copy in range(RELEASE_COPIES)
        ]
        keys.append({"pk": {"S": APPS_PARTITION}, "sk": {"S": f"APP#{release.app_id}"}})
        self._batch_write([{**key, "release_ref": {"S": digest}} for key in keys])

    def seal_key(self) -> str:
        """The queue's seal key (:meth:`RunStore.seal_key`): read once per process; made by the first process
        that finds none (a conditional put, so racing processes agree on one)."""
        if self._seal_key is None:
            key = {"pk": {"S": "CONFIG"}, "sk": {"S": "SEAL"}}
            self.counter.add("dynamodb.read")
            item = self._client.get_item(TableName=self.table_name, Key=key, ConsistentRead=True).get("Item")
            if item is None:
                made = secrets.token_hex(32)
                self.counter.add("dynamodb.write", items=[64])
                try:
                    self._client.put_item(
                        TableName=self.table_name,
                        Item={**key, "seal_key": {"S": made}},
                        ConditionExpression="attribute_not_exists(pk)",
                    )
                except ClientError as exc:
                    if _error_code(exc) != "ConditionalCheckFailedException":
                        raise
                self.counter.add("dynamodb.read")
                item = self._client.get_item(TableName=self.table_name, Key=key, ConsistentRead=True).get("Item")
            assert item is not None
            self._seal_key = str(item["seal_key"]["S"])
        return self._seal_key

    def get_release(self, function_id: str, *, consistent: bool = True) -> Release | None:
        """One read of one of the function's pointers, picked at random (the copies spread the reads of a busy
        function over several partitions), strongly consistent unless asked (a release just synced is what the
        next run must use, R1), then the body, which never changes: from this process's memory, else one
        strongly consistent read (the pointer may be newer than a copy of the body)."""
        copy = secrets.randbelow(RELEASE_COPIES)
        self.counter.add("dynamodb.read")
        item = self._client.get_item(
            TableName=self.table_name, Key=_release_pointer_key(function_id, copy), ConsistentRead=consistent
        ).get("Item")
        if item is None:  # a table synced before the copies: the release inline under the function's old key
            self.counter.add("dynamodb.read")
            item = self._client.get_item(
                TableName=self.table_name,
                Key={"pk": {"S": f"FN#{function_id}"}, "sk": {"S": "RELEASE"}},
                ConsistentRead=True,
            ).get("Item")
        if item is None:
            return None
        return self._release_of(item)

    def _release_of(self, item: Mapping[str, Any]) -> Release:
        """The release a pointer names, from memory or read (a table written before pointers holds it inline)."""
        if "release" in item:
            return _RELEASE.validate_json(item["release"]["S"])
        digest = str(item["release_ref"]["S"])
        known = self._release_bodies.get(digest)
        if known is not None:
            return known
        self.counter.add("dynamodb.read")
        body = self._client.get_item(TableName=self.table_name, Key=_release_key(digest), ConsistentRead=True).get(
            "Item"
        )
        if body is None:
            raise RuntimeError(f"release {digest} is named by a pointer but missing")
        release = _RELEASE.validate_json(body["release"]["S"])
        self._release_bodies.put(digest, release)
        return release

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
            releases.extend(self._release_of(item) for item in response.get("Items", []))
            start = response.get("LastEvaluatedKey")
            if not start:
                return releases
            query["ExclusiveStartKey"] = start


def create_table(client: DynamoDBClient, table_name: str) -> None:
    """Create the table and its GSIs (on-demand) if missing, and wait until it is active."""
    strings = ("pk", "sk", "list_pk", "list_sk", "blocked_fn", "check_pk", "check_at")
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
                {
                    "IndexName": CHECK_INDEX,
                    "KeySchema": [
                        {"AttributeName": "check_pk", "KeyType": "HASH"},
                        {"AttributeName": "check_at", "KeyType": "RANGE"},
                    ],
                    "Projection": {"ProjectionType": "KEYS_ONLY"},
                },
            ],
        )
    except ClientError as exc:
        if _error_code(exc) != "ResourceInUseException":  # it exists already: just wait for it
            raise
    client.get_waiter("table_exists").wait(TableName=table_name, WaiterConfig={"Delay": 1, "MaxAttempts": 120})

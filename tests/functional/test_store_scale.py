"""The DynamoDB store at scale (issue 24, findings 7-9): what one request costs, and on which key."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto import mock_aws

from ryusen_server.aws.store import DynamoStore, create_table
from ryusen_server.ports import RequestCounter

from .test_store_contract import release

TABLE = "ryusen-scale"


@pytest.fixture
def client(aws_env: None) -> Iterator[Any]:
    with mock_aws():
        dynamodb = boto3.client("dynamodb", region_name="us-east-1")
        create_table(dynamodb, TABLE)
        yield dynamodb


def keys_read(client: Any) -> Counter[str]:
    """Counts each GetItem and Query by the partition key it reads (a botocore hook on every request)."""
    reads: Counter[str] = Counter()

    def count(params: dict[str, Any], **kwargs: Any) -> None:
        if "Key" in params:
            reads[params["Key"]["pk"]["S"]] += 1
        elif "ExpressionAttributeValues" in params and "IndexName" not in params:
            pk = next(v["S"] for v in params["ExpressionAttributeValues"].values() if "S" in v)
            reads[pk] += 1

    client.meta.events.register("provide-client-params.dynamodb.GetItem", count)
    client.meta.events.register("provide-client-params.dynamodb.Query", count)
    return reads


# ---- finding 9: a release is stored once -------------------------------------------------------


def test_a_sync_writes_the_release_once_not_once_per_function(client: Any) -> None:
    """Before, each declared function's item held the whole release: 300 functions wrote 300 copies
    (300 x the manifest's bytes). Now the release is one item and each function has a small pointer."""
    counter = RequestCounter()
    store = DynamoStore(client, TABLE, counter)
    functions = [f"fn_{i:03d}_{'x' * 40}" for i in range(300)]
    big = release("shop", "r1", functions, 0)
    body = len(big.functions) * 60  # at least this many bytes: each function's id and manifest
    store.put_release(big)
    written = counter.bytes_sent["dynamodb.write"]
    assert written < 3 * body + 300 * 8 * 200, (written, body)
    assert store.get_release("fn_007_" + "x" * 40) == big
    assert DynamoStore(client, TABLE).get_release(functions[-1]) == big  # a process that never saw it
    assert store.list_releases() == [big]


def test_a_function_whose_pointer_is_missing_reads_as_unsynced(client: Any) -> None:
    store = DynamoStore(client, TABLE)
    store.put_release(release("shop", "r1", ["checkout"], 0))
    assert store.get_release("refund") is None


# ---- finding 7: no hot key on the release ------------------------------------------------------


def test_reads_of_one_function_s_release_spread_over_several_keys(client: Any) -> None:
    """Every start and every new dispatch message reads the release (strongly consistent, R1): before, all
    on one item (``FN#checkout``), about 2,000 reads a second on one key at 1,000 runs a second. Now they
    spread over the function's copies, and the release body, which never changes, is read once a process."""
    store = DynamoStore(client, TABLE)
    store.put_release(release("shop", "r1", ["checkout"], 0))
    reads = keys_read(client)
    for _ in range(400):
        assert store.get_release("checkout") is not None
    assert sum(reads.values()) <= 401, reads  # one pointer read each, the body once
    busiest = max(reads.values())
    assert busiest < 400 / 4, reads


def test_a_release_synced_before_the_pointers_is_still_found(client: Any) -> None:
    """A table written by the previous version holds each function's release inline under ``FN#{id}``."""
    old = release("shop", "r0", ["checkout"], 0)
    from ryusen_server.aws.store import _RELEASE

    client.put_item(
        TableName=TABLE,
        Item={"pk": {"S": "FN#checkout"}, "sk": {"S": "RELEASE"}, "release": {"S": _RELEASE.dump_json(old).decode()}},
    )
    store = DynamoStore(client, TABLE)
    assert store.get_release("checkout") == old
    new = release("shop", "r1", ["checkout"], 5)
    store.put_release(new)
    assert store.get_release("checkout") == new


# ---- finding 8: retention is set when an item is written --------------------------------------

DAY = 86_400


def started(run_id: str, key: str | None = None) -> Any:
    from ryusen_server.core.decide import decide
    from ryusen_server.core.events import EngineSettings, StartRun

    from .test_store_contract import T0

    start = StartRun(run_id=run_id, app_id="a", function_id="f", input={"blob": "x" * 5000}, idempotency_key=key)
    return decide(None, start, now=T0, settings=EngineSettings()).state


def items_of(client: Any, run_id: str) -> list[dict[str, Any]]:
    items = client.scan(TableName=TABLE)["Items"]
    mine = [i for i in items if i["pk"]["S"] == f"RUN#{run_id}" or i.get("run_id", {}).get("S") == run_id]
    return sorted(mine, key=lambda i: (i["pk"]["S"], i["sk"]["S"]))


def expiry(item: dict[str, Any]) -> int:
    assert "expires_at" in item, item["sk"]["S"]
    return int(item["expires_at"]["N"])


def test_finishing_a_run_rewrites_none_of_its_items(client: Any) -> None:
    """Before, a run's items carried no expiry while it lived and the finishing save wrote every one of them
    again with it (about 2.1 write units a step instead of 1.1; a crash part-way left items that never
    expire). Now every item gets its expiry when it is written, and the finish is one write."""
    from datetime import timedelta

    from ryusen_server.core.model import Outcome, RunPhase

    counter = RequestCounter()
    store = DynamoStore(client, TABLE, counter, retention_s=90 * DAY)
    state = started("run_1", key="order-1")
    store.create(state)
    for version in range(2, 12):  # ten more entries, each a step of the run
        moved = state.model_copy(update={"version": version, "updated_at": state.updated_at + timedelta(minutes=1)})
        store.save(moved, expected_version=state.version)
        state = moved
    live = items_of(client, "run_1")
    assert len(live) == 13  # head, 10 entries, the large input, the idempotency key
    assert all(expiry(item) >= state.updated_at.timestamp() + 90 * DAY for item in live)
    finished_at = state.updated_at + timedelta(hours=1)
    done = state.model_copy(
        update={
            "version": state.version + 1,
            "phase": RunPhase.FINISHED,
            "outcome": Outcome.COMPLETED,
            "finished_at": finished_at,
            "updated_at": finished_at,
        }
    )
    counter.reset()
    store.save(done, expected_version=state.version)
    assert counter.counts == {"dynamodb.write": 1}, counter.counts  # the entry and the head: one transaction
    kept_until = finished_at.timestamp() + 90 * DAY
    items = items_of(client, "run_1")
    assert all(expiry(item) >= kept_until for item in items)  # nothing goes before the retention has passed
    head = next(i for i in items if i["sk"]["S"] == "RUN")
    assert expiry(head) == int(kept_until)  # the head goes first: the run then reads as gone
    assert min(expiry(i) for i in items) == expiry(head)


def test_a_run_that_never_finishes_has_its_items_renewed_by_the_sweeper_s_look(client: Any) -> None:
    """A run blocked for months (an Unknown no one resolves) must not lose its items: when the sweeper looks
    at it (``defer_check``) and its items would expire within the retention of its next look, they are
    written again with a later expiry (a cost paid once a month by a run that lives that long)."""
    from datetime import timedelta

    store = DynamoStore(client, TABLE, retention_s=90 * DAY)
    state = started("run_1", key="order-1")
    store.create(state)
    first = min(expiry(i) for i in items_of(client, "run_1"))
    store.defer_check("run_1", state.updated_at + timedelta(days=1))  # nothing to renew yet
    assert min(expiry(i) for i in items_of(client, "run_1")) == first
    much_later = state.updated_at + timedelta(days=400)
    store.defer_check("run_1", much_later)
    items = items_of(client, "run_1")
    assert len(items) == 3  # head, large input, key
    assert all(expiry(i) >= much_later.timestamp() + 90 * DAY for i in items)
    assert store.get("run_1") == state


# ---- finding 7: the sweeper may look at a quiet run less often ----------------------------------


def check_at(store: DynamoStore, run_id: str) -> str:
    item: Any = store._client.get_item(
        TableName=store.table_name, Key={"pk": {"S": f"RUN#{run_id}"}, "sk": {"S": "RUN"}}
    )["Item"]
    return str(item["check_at"]["S"])


def test_a_write_after_a_quiet_spell_brings_the_check_time_back(client: Any) -> None:
    """The sweeper may look at a quiet run less often only because the first write after a quiet spell of
    ``CHECK_HORIZON_S`` rewrites the head's check time: work that write queued, if its message is lost, is
    still looked at within ``CHECK_HORIZON_S``. Before, such a write updated only the journal."""
    from datetime import UTC, datetime, timedelta

    from ryusen_server.ports import CHECK_HORIZON_S

    from ..conformance.test_sweeper_scale import waiting_for_a_person

    dynamo = DynamoStore(client, TABLE)
    created = datetime(2030, 1, 1, tzinfo=UTC)
    state = waiting_for_a_person("run_1", created)
    dynamo.create(state)
    dynamo.defer_check("run_1", created + timedelta(days=1))  # the sweeper backed off
    woke = created + timedelta(hours=2)
    moved = state.model_copy(update={"version": 2, "updated_at": woke, "discovery": None})
    dynamo.save(moved, expected_version=1)
    horizon = (woke + timedelta(seconds=CHECK_HORIZON_S)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    assert check_at(dynamo, "run_1") <= horizon, check_at(dynamo, "run_1")


# ---- finding 7: a filtered listing reads a bounded number of index items a page -------------------


def test_a_filtered_listing_reads_a_bounded_number_of_index_items_a_page(client: Any) -> None:
    """Before, a page read each index shard until it found enough matches or ran out: with millions of runs
    and a selective filter, whole shards (a 504 past API Gateway's 29 s). Now a page reads at most
    ``list_scan_items`` index items a shard and returns what matched with a cursor to go on."""
    from datetime import timedelta

    from ryusen_server.core.decide import decide
    from ryusen_server.core.events import EngineSettings, StartRun

    from .test_store_contract import T0

    store = DynamoStore(client, TABLE)
    for i in range(201):
        function_id = "rare" if i == 0 else "common"
        start = StartRun(run_id=f"run_{i:03d}", app_id="a", function_id=function_id, input=None)
        store.create(decide(None, start, now=T0 + timedelta(seconds=i), settings=EngineSettings()).state)
    scanned: list[int] = []

    def count(parsed: dict[str, Any], **kwargs: Any) -> None:
        scanned[-1] += int(parsed.get("ScannedCount", 0))

    client.meta.events.register("after-call.dynamodb.Query", count)
    store.list_scan_items = 4
    found, cursor, pages = [], None, 0
    while True:
        scanned.append(0)
        page = store.list_runs(function_id="rare", limit=10, cursor=cursor)
        assert scanned[-1] <= 16 * 4, scanned  # 16 shards, at most 4 index items each
        found += [run["id"] for run in page.runs]
        pages += 1
        cursor = page.cursor
        if cursor is None:
            break
    assert found == ["run_000"] and pages > 1
    newest = store.list_runs(limit=5)
    assert [r["id"] for r in newest.runs] == [f"run_{i:03d}" for i in range(200, 195, -1)]

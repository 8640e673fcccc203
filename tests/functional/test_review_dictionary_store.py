"""Review probes of the run store's preset-dictionary compression (issue 25's storage bill).

What the review found and is fixed: the dictionary generator read the store with plain zlib; a dictionary
stream cut short read as whole. What it found and is documented (docs/deploy.md, Upgrading): during the deploy
that brings the dictionary, a container still on the older code cannot read a run the newer code wrote (its
read fails and is retried; nothing is lost)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import math
import os
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ryusen_server.aws import store as store_module
from ryusen_server.aws.store import DynamoStore
from ryusen_server.ports import RequestCounter

from .test_journal import TABLE, client  # noqa: F401 - client: the fixture, used by name
from .test_store_contract import Runs

ROOT = Path(__file__).resolve().parents[2]
DAY = 86_400


def items_of(client: Any, run_id: str) -> list[dict[str, Any]]:  # noqa: F811
    return client.query(
        TableName=TABLE,
        KeyConditionExpression="pk = :pk",
        ExpressionAttributeValues={":pk": {"S": f"RUN#{run_id}"}},
        ConsistentRead=True,
    )["Items"]


def test_the_dictionary_generator_can_still_read_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/journal-dictionary makes the next dictionary from items the store writes, read with plain
    zlib.decompress: those items now need the current dictionary (Z_NEED_DICT, 'Error 2')."""
    loader = importlib.machinery.SourceFileLoader("journal_dictionary_script", str(ROOT / "scripts/journal-dictionary"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    for name, value in {
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    import logging

    logging.disable(logging.CRITICAL)
    try:
        assert module.documents()
    finally:
        logging.disable(logging.NOTSET)


def test_a_truncated_dictionary_stream_is_an_error_like_a_truncated_plain_one(client: Any) -> None:  # noqa: F811
    """zlib.decompress refuses a stream cut short (no Adler-32 check); decompressobj().decompress + flush()
    returns whatever it got: a dictionary item that lost its trailer reads as if whole."""
    runs = Runs(DynamoStore(client, TABLE, RequestCounter()))
    state = runs.run_step(runs.start("run_1"), "reserve", {"id": 7})
    blob = next(i["entry"]["B"] for i in items_of(client, state.id) if "entry" in i)
    plain = zlib.compress(store_module._decompress(blob))
    with pytest.raises(zlib.error):
        zlib.decompress(plain[:-4])
    with pytest.raises(zlib.error):
        store_module._decompress(blob[:-4])


@pytest.mark.parametrize("wbits", range(9, 16))
def test_no_plain_zlib_stream_looks_like_a_dictionary_stream(wbits: int) -> None:
    data = os.urandom(64) + b'{"doc":{}}' * 10
    for level in range(-1, 10):
        for strategy in (zlib.Z_DEFAULT_STRATEGY, zlib.Z_FILTERED, zlib.Z_HUFFMAN_ONLY, zlib.Z_RLE, zlib.Z_FIXED):
            c = zlib.compressobj(level, zlib.DEFLATED, wbits, 8, strategy)
            blob = c.compress(data) + c.flush()
            assert not blob[1] & store_module.FDICT
            assert store_module._decompress(blob) == data


def test_a_mixed_run_is_renewed_expired_listed_and_read_cold(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Plain items (written before the change, with a large offloaded input) and dictionary items in one run,
    through the sweeper's renewal, another process's cold read, the list, and retention after the finish."""
    big = {"blob": os.urandom(3000).hex()}
    with monkeypatch.context() as old:
        old.setattr(store_module, "_compress", zlib.compress)
        before = Runs(DynamoStore(client, TABLE, retention_s=90 * DAY))
        state = before.run_step(before.start("run_1", key="order-1", input=big), "reserve", {"id": 7})
    after = Runs(DynamoStore(client, TABLE, retention_s=90 * DAY))
    state = after.run_step(state, "charge", {"r": "x" * 600})
    after.store.defer_check(state.id, state.updated_at + timedelta(days=400))  # _renew rewrites every item
    kinds = {bool(v["B"][1] & store_module.FDICT) for i in items_of(client, state.id) for v in i.values() if "B" in v}
    assert kinds == {True, False}
    cold = DynamoStore(client, TABLE, retention_s=90 * DAY)
    assert cold.get(state.id) == state
    assert [r["id"] for r in cold.list_runs().runs] == [state.id]
    state = after.complete(state)
    assert DynamoStore(client, TABLE, retention_s=90 * DAY).get(state.id) == state


def wru(item_bytes: int) -> int:
    return math.ceil(item_bytes / 1024)


@pytest.mark.parametrize("n", [1, 3, 6])
@pytest.mark.parametrize("size", [100, 200, 400, 900])
def test_the_budget_never_costs_more_write_units(n: int, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry with n incompressible values of ``size`` bytes: write units of the entry plus its value items,
    with and without the dictionary."""
    delta = {
        "steps": {
            "set": {str(i): {"diff": {"status": "completed", "result": os.urandom(size // 2).hex()}} for i in range(n)}
        }
    }

    def cost() -> int:
        packed = store_module._pack(delta, budget=store_module.ENTRY_BUDGET_BYTES)
        return wru(len(packed.blob) + 60) + sum(wru(len(zlib.compress(v)) + 80) for v in packed.values.values())

    new = cost()
    monkeypatch.setattr(store_module, "_compress", zlib.compress)
    assert new <= cost()

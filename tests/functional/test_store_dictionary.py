"""The run store compresses its items with a preset dictionary, and reads items written before it had one.

A journal entry alone is mostly field names; zlib's preset dictionary (``ryusen_server.aws.journal_dictionary``)
holds them. Each compressed stream names its dictionary by Adler-32, so a table that holds items of both
kinds (a deployment upgraded mid-run) reads as one, and a dictionary is frozen once written with.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any

import pydantic_core
import pytest

from ryusen_server.aws import journal_dictionary
from ryusen_server.aws import store as store_module

from .test_journal import TABLE, client, store  # noqa: F401 - client: the fixture, used by name
from .test_store_contract import Runs


def compressed(client: Any, run_id: str) -> dict[str, bytes]:  # noqa: F811
    """Every compressed attribute of the run's items, by ``sk/attribute``."""
    items = client.query(
        TableName=TABLE,
        KeyConditionExpression="pk = :pk",
        ExpressionAttributeValues={":pk": {"S": f"RUN#{run_id}"}},
        ConsistentRead=True,
    )["Items"]
    return {f"{i['sk']['S']}/{name}": v["B"] for i in items for name, v in i.items() if "B" in v}


def dictionary_of(blob: bytes) -> int | None:
    """The DICTID a zlib stream names, or None (RFC 1950: FDICT is bit 5 of the second byte)."""
    assert blob[0] & 0x0F == 8, "not a zlib stream"
    return int.from_bytes(blob[2:6], "big") if blob[1] & 0x20 else None


def test_every_dictionary_is_named_by_its_adler32_and_the_current_one_is_frozen() -> None:
    """An item names its dictionary by Adler-32: a dictionary whose bytes changed would leave every item
    written with it unreadable. CURRENT_ID is written out by hand so that such a change fails here."""
    assert journal_dictionary.DICTIONARIES, "no dictionary"
    for ident, dictionary in journal_dictionary.DICTIONARIES.items():
        assert zlib.adler32(dictionary) == ident
    assert zlib.adler32(journal_dictionary.CURRENT) == journal_dictionary.CURRENT_ID == 0x08CECDBA
    assert journal_dictionary.DICTIONARIES[journal_dictionary.CURRENT_ID] is journal_dictionary.CURRENT


def test_a_runs_items_are_written_with_the_current_dictionary_and_pack_smaller(client: Any) -> None:  # noqa: F811
    runs = Runs(store(client))
    state = runs.complete(runs.run_step(runs.run_step(runs.start("run_1"), "reserve", {"id": 7}), "charge", 30))
    blobs = compressed(client, state.id)
    entries = {k: v for k, v in blobs.items() if k.startswith("EV#")}
    assert len(entries) == state.version - 1 and "RUN/body" in blobs and "RUN/summary" in blobs
    assert {dictionary_of(b) for b in blobs.values()} == {journal_dictionary.CURRENT_ID}
    plain = sum(len(zlib.compress(store_module._decompress(b))) for b in entries.values())
    packed = sum(len(b) for b in entries.values())
    assert packed * 2 < plain, f"the dictionary packs the entries to {packed} bytes, plain zlib to {plain}"
    assert store(client).get(state.id) == state  # another process reads it back


def test_a_run_written_before_dictionaries_is_read_listed_and_carried_on(
    client: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A deployment upgraded while a run is in flight: the run's head and first entries are plain zlib, its
    next entries name the dictionary. Another process reads all of them, lists the run, and finishes it."""
    with monkeypatch.context() as old:
        old.setattr(store_module, "_compress", zlib.compress)  # as the store wrote before dictionaries
        before = Runs(store(client))
        state = before.run_step(before.start("run_1"), "reserve", {"id": 7})
    assert {dictionary_of(b) for b in compressed(client, state.id).values()} == {None}
    after = Runs(store(client))
    assert after.store.get(state.id) == state
    state = after.complete(after.run_step(state, "charge", 30))
    kinds = {dictionary_of(b) for b in compressed(client, state.id).values()}
    assert kinds == {None, journal_dictionary.CURRENT_ID}, "the table should now hold items of both kinds"
    reader = store(client)
    assert reader.get(state.id) == state
    page = reader.list_runs()
    assert [r["id"] for r in page.runs] == [state.id] and page.runs[0]["outcome"] == state.outcome


def test_an_item_naming_a_dictionary_this_version_does_not_know_is_refused_by_name(
    client: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A rollback to a release older than the dictionary it was written with: the read fails saying so (not
    as a corrupt item), and a list leaves the run out rather than failing every page."""
    runs = Runs(store(client))
    state = runs.complete(runs.run_step(runs.start("run_1"), "reserve", {"id": 7}))
    monkeypatch.setattr(journal_dictionary, "DICTIONARIES", {})
    with pytest.raises(zlib.error, match=r"store dictionary 0x08cecdba, which this version of Ryusen does not"):
        store(client).get(state.id)
    with caplog.at_level(logging.ERROR, logger="ryusen.aws.store"):
        assert store(client).list_runs().runs == []
    assert "its summary cannot be read" in caplog.text


def test_a_stream_that_names_no_dictionary_but_is_not_zlib_is_still_an_error() -> None:
    with pytest.raises(zlib.error):
        store_module._decompress(b"not zlib at all")
    assert pydantic_core.from_json(store_module._decompress(zlib.compress(b'{"a": 1}'))) == {"a": 1}

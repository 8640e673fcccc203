"""The billing meter's arithmetic (tests/infra/meter.py): item sizes, units and index writes as AWS bills them."""

from __future__ import annotations

from tests.infra.meter import Index, TableSchema, item_size, read_units, value_size, write_units


def test_sizes_follow_dynamodb_rules() -> None:
    assert value_size({"S": "héllo"}) == 6  # UTF-8 bytes
    assert value_size({"N": "12345"}) == 4  # 5 significant digits: 3 + 1
    assert value_size({"B": b"\x00" * 10}) == 10
    assert value_size({"BOOL": True}) == 1
    assert value_size({"L": [{"S": "ab"}, {"N": "1"}]}) == 3 + (1 + 2) + (1 + 2)
    assert value_size({"M": {"k": {"S": "v"}}}) == 3 + 1 + 1 + 1
    assert item_size({"pk": {"S": "RUN#1"}, "sk": {"S": "RUN"}}) == 2 + 5 + 2 + 3


def test_units_round_up_per_kb_and_per_4_kb() -> None:
    assert write_units(0) == 1 and write_units(1024) == 1 and write_units(1025) == 2
    assert read_units(4096, consistent=True) == 1.0 and read_units(4097, consistent=True) == 2.0
    assert read_units(100, consistent=False) == 0.5


def test_index_writes_bill_what_an_item_change_does_to_each_index() -> None:
    schema = TableSchema(keys=("pk", "sk"), indexes=(Index("check", ("check_pk", "check_at"), "KEYS_ONLY"),))
    base = {"pk": {"S": "RUN#1"}, "sk": {"S": "RUN"}}
    checked = {**base, "check_pk": {"S": "CHECK#0"}, "check_at": {"S": "2026-12-05T00:00:00"}}
    moved = {**checked, "check_at": {"S": "2026-12-05T00:05:00"}}
    assert schema.index_write_units(None, base) == 0  # not in the sparse index
    assert schema.index_write_units(None, checked) == 1  # added
    assert schema.index_write_units(checked, {**checked, "other": {"S": "x"}}) == 0  # nothing projected changed
    assert schema.index_write_units(checked, moved) == 2  # its key changed: a delete and a put
    assert schema.index_write_units(checked, base) == 1  # removed


def test_platform_log_lines_are_billed_per_invocation_at_info_and_only_for_a_failure_at_warn() -> None:
    import pytest

    from tests.infra.meter import PLATFORM_LOG_BYTES, Meter

    meter = Meter({}, lambda: "results", lambda: None)

    def fails(event: object, context: object) -> None:
        raise RuntimeError("timed out")

    quiet = meter.timed("results", lambda event, context: "ok", system_log_level="WARN")
    chatty = meter.timed("api", lambda event, context: "ok")
    failing = meter.timed("dispatch", fails, system_log_level="WARN")
    assert quiet({}, None) == "ok" and chatty({}, None) == "ok"
    with pytest.raises(RuntimeError):
        failing({}, None)
    assert meter.usage.log_bytes == {"api": PLATFORM_LOG_BYTES, "dispatch": PLATFORM_LOG_BYTES}
    assert meter.usage.invocations == {"results": 1, "api": 1, "dispatch": 1}

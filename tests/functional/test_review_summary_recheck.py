"""Review of the head's summary taking the list's own form (DynamoStore._summary_doc / _listed).

Findings: the first two tests are regressions (the same corrupt heads were left out and logged before the
change; checked against `git archive HEAD`). The step-count test shows behaviour that predates the change but
contradicts the RunPage docstring the change added. The last test held up."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto import mock_aws

from ryusen_server.aws import store as store_module
from ryusen_server.aws.store import DynamoStore, create_table
from ryusen_server.core.view import run_summary_view
from ryusen_server.ports import RequestCounter
from tests.functional.test_store_contract import TABLE, Runs


@pytest.fixture
def dynamo(aws_env: None) -> Iterator[DynamoStore]:
    with mock_aws():
        client = boto3.client("dynamodb", region_name="us-east-1")
        create_table(client, TABLE)
        yield DynamoStore(client, TABLE, RequestCounter())


def set_summary(store: DynamoStore, run_id: str, raw: bytes) -> None:
    store._client.update_item(
        TableName=store.table_name,
        Key={"pk": {"S": f"RUN#{run_id}"}, "sk": {"S": "RUN"}},
        UpdateExpression="SET summary = :s",
        ExpressionAttributeValues={":s": {"B": zlib.compress(raw)}},
    )


@pytest.mark.parametrize("raw", [b"null", b"7", b'"a summary"', b"[1]", b'{"not": "a run"}'])
def test_one_head_whose_summary_is_valid_json_but_not_a_summary_does_not_break_the_listing(
    dynamo: DynamoStore, raw: bytes
) -> None:
    """The promise kept for invalid JSON (test_bad_values): one run this code cannot read is left out and
    logged, every other run is still listed. Before the change, any such doc failed RunState.model_validate
    (a ValueError, caught); now `"summary" in doc` / `{**doc}` raise TypeError, which is not caught."""
    runs = Runs(dynamo)
    runs.start("run_broken")
    fine = runs.start("run_fine")
    set_summary(dynamo, "run_broken", raw)
    assert dynamo.list_runs().runs == [run_summary_view(fine)]


def test_a_head_in_a_list_form_missing_a_filtered_field_does_not_break_a_filtered_listing(
    dynamo: DynamoStore,
) -> None:
    """A list-form doc without "recovery" (a later release's form, a bug) reads fine in _get_many, then the
    filter's listed["recovery"] raises KeyError outside the try: every filtered listing fails."""
    runs = Runs(dynamo)
    runs.start("run_broken")
    fine = runs.start("run_fine")
    doc = run_summary_view(fine)
    del doc["id"], doc["recovery"], doc["blocked"]
    set_summary(dynamo, "run_broken", json.dumps(doc).encode())
    assert [r["id"] for r in dynamo.list_runs(blocked=False).runs] == ["run_fine"]


def test_old_format_heads_filter_by_recovery_and_blocked_as_new_ones_do(
    dynamo: DynamoStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = Runs(dynamo)
    written = store_module._index_attributes

    def as_before(state: Any) -> dict[str, Any]:
        item = written(state)
        doc = state.model_dump(mode="json", exclude={"steps", "unwind"})
        item["summary"] = {"B": store_module._compress(json.dumps(doc).encode())}
        item["step_count"] = {"N": str(len(state.steps))}
        return item

    with monkeypatch.context() as before:
        before.setattr(store_module, "_index_attributes", as_before)
        old_blocked = runs.block(runs.start("run_old_blocked"))
        old_comp = runs.fail(runs.run_step(runs.start("run_old_comp"), "charge", {"id": 1}))
    new_blocked = runs.block(runs.start("run_new_blocked"))
    cold = DynamoStore(dynamo._client, TABLE, RequestCounter())
    assert {r["id"] for r in cold.list_runs(blocked=True).runs} == {old_blocked.id, new_blocked.id}
    assert [r["id"] for r in cold.list_runs(recovery=old_comp.recovery.value).runs] == [old_comp.id]  # type: ignore[union-attr]
    assert {r["id"] for r in cold.list_runs(blocked=False).runs} == {old_comp.id}

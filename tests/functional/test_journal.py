"""The DynamoDB store's journal under several processes and faults (findings of the review of the journal).

A run is a head item and one journal entry per version (docs/design/run-journal.md). These tests run
two stores on one table as two processes would, and break writes in the middle.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta, timezone
from typing import Any

import boto3
import pydantic_core
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from ryusen._internal.wire import (
    CallbackSucceeded,
    ConflictFound,
    DuplicateStepConflict,
    ErrorInfo,
    FunctionCompleted,
    Occurrence,
    Phase,
    StepPlan,
    StepReached,
)
from ryusen_server.aws import journal
from ryusen_server.aws.store import DynamoStore, create_table
from ryusen_server.core.events import AttemptReported, DiscoveryReported, TaskDelivered, WakeRequested
from ryusen_server.core.model import RunState, TaskRef
from ryusen_server.ports import RequestCounter, StoreUnavailableError

from .test_store_contract import RELEASE_REF, Runs

TABLE = "ryusen-journal"
CONFLICT = ConflictFound(
    conflict=DuplicateStepConflict(
        step_id="charge", first=Occurrence(location="a.py:1"), duplicate=Occurrence(location="a.py:2")
    )
)


@pytest.fixture
def client(aws_env: None) -> Iterator[Any]:
    with mock_aws():
        dynamodb = boto3.client("dynamodb", region_name="us-east-1")
        create_table(dynamodb, TABLE)
        yield dynamodb


def store(client: Any, **kwargs: Any) -> DynamoStore:
    return DynamoStore(client, TABLE, RequestCounter(), **kwargs)


def deliver_discovery(runs: Runs, state: RunState) -> RunState:
    assert state.discovery is not None
    task = TaskRef(run_id=state.id, kind="discover", seq=state.discovery.seq)
    return runs.apply(state, TaskDelivered(task=task, release=RELEASE_REF))


def complete_step(runs: Runs, state: RunState, step_id: str) -> RunState:
    task = TaskRef(run_id=state.id, kind="forward", step_id=step_id, generation=1)
    state = runs.apply(state, TaskDelivered(task=task, release=RELEASE_REF))
    report = AttemptReported(step_id=step_id, phase=Phase.FORWARD, generation=1, response=CallbackSucceeded(result=1))
    return runs.apply(state, report)


def test_a_run_blocked_again_by_another_process_is_in_the_blocked_index(client: Any) -> None:
    """B read the run while it was blocked; A unblocked it; B's save blocks it again. The head (the blocked
    index a release sync reads) must say blocked, or the sync never wakes the run."""
    a, b = store(client), store(client)
    ra, rb = Runs(a), Runs(b)
    state = ra.block(ra.start("run_1"))
    assert b.get("run_1") == state
    state = ra.apply(state, WakeRequested(source="release_sync"))
    state = ra.discover(state, StepReached(step=StepPlan(id="s1", has_compensation=True)))
    assert not state.blockers and a.runs_blocked_by_definition("checkout") == []
    state = deliver_discovery(ra, complete_step(ra, state, "s1"))
    assert state.discovery is not None
    current = b.get("run_1")
    assert current is not None
    state = rb.apply(current, DiscoveryReported(seq=state.discovery.seq, response=CONFLICT))
    assert state.blocked_by_definition
    assert store(client).runs_blocked_by_definition("checkout") == ["run_1"]


def test_a_run_unblocked_by_another_process_leaves_the_blocked_index(client: Any) -> None:
    a, b = store(client), store(client)
    ra, rb = Runs(a), Runs(b)
    state = ra.start("run_1")
    assert b.get("run_1") == state
    state = deliver_discovery(ra, ra.apply(ra.block(state), WakeRequested(source="release_sync")))
    assert state.discovery is not None
    current = b.get("run_1")
    assert current is not None
    found = StepReached(step=StepPlan(id="s1", has_compensation=True))
    state = rb.apply(current, DiscoveryReported(seq=state.discovery.seq, response=found))
    assert not state.blockers
    assert store(client).runs_blocked_by_definition("checkout") == []
    [listed] = store(client).list_runs().runs
    assert listed["blocked"] is False


class FailingTransactions:
    """The client, but the next transaction fails (throttled), as a crash or an outage between two writes
    would leave it."""

    def __init__(self, client: Any) -> None:
        self._client, self.fail = client, False

    def transact_write_items(self, **kwargs: Any) -> Any:
        if self.fail:
            self.fail = False
            error = {"Error": {"Code": "ProvisionedThroughputExceededException", "Message": "throttled"}}
            raise ClientError(error, "TransactWriteItems")  # type: ignore[arg-type]
        return self._client.transact_write_items(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_a_failed_finishing_write_leaves_no_finished_entry_behind_a_running_head(client: Any) -> None:
    """Before, the finishing entry and the head were two writes: a failure between them left a finished run
    listed as running forever, and with retention only its last entry expiring (so a partial TTL deletion
    served the previous version as current). Now they are one transaction."""
    flaky = FailingTransactions(client)
    kept = store(flaky, retention_s=3600)
    runs = Runs(kept)
    state = deliver_discovery(runs, runs.run_step(runs.start("run_1"), "s1", {"v": 1}))
    assert state.discovery is not None
    finish = DiscoveryReported(seq=state.discovery.seq, response=FunctionCompleted(output="ok"))
    flaky.fail = True
    with pytest.raises(StoreUnavailableError):  # the throttle, as the engine sees it: try again later
        runs.apply(state, finish)
    assert store(client).get("run_1") == state  # nothing of the failed write is visible
    assert [r["phase"] for r in store(client).list_runs().runs] == ["running"]
    done = runs.apply(state, finish)  # the engine decides again (the message comes back) and the write lands
    assert [r["id"] for r in store(client).list_runs(phase="finished").runs] == ["run_1"]
    items = client.query(
        TableName=TABLE,
        KeyConditionExpression="pk = :pk",
        ExpressionAttributeValues={":pk": {"S": "RUN#run_1"}},
    )["Items"]
    assert all("expires_at" in item for item in items), [i["sk"]["S"] for i in items if "expires_at" not in i]
    # TTL deletes expired items late and in no order: once any is gone, the run reads as gone, never older
    last = max(item["sk"]["S"] for item in items if item["sk"]["S"].startswith("EV#"))
    client.delete_item(TableName=TABLE, Key={"pk": {"S": "RUN#run_1"}, "sk": {"S": last}})
    assert done.finished_at is not None
    later = done.finished_at.timestamp() + 3601
    real_time = time.time
    try:
        time.time = lambda: later  # type: ignore[assignment]
        assert store(client, retention_s=3600).get("run_1") is None
    finally:
        time.time = real_time  # type: ignore[assignment]


def test_a_change_between_values_python_calls_equal_is_kept(client: Any) -> None:
    """``1 == 1.0 == True`` and dicts compare without key order: the entry must still carry the change."""
    runs = Runs(store(client))
    state = runs.run_step(runs.start("run_1"), "s1", 1)
    for result in (True, 1.0):
        step = state.steps[0].model_copy(update={"result": result})
        new = state.model_copy(update={"steps": [step], "version": state.version + 1})
        assert pydantic_core.to_json(journal.apply(state, journal.diff(state, new))) == pydantic_core.to_json(new)
    moved = state.updated_at.astimezone(timezone(timedelta(hours=9)))
    before = state.model_copy(update={"output": {"a": 2, "b": 1}})
    new = state.model_copy(update={"updated_at": moved, "output": {"b": 1, "a": 2}, "version": state.version + 1})
    assert pydantic_core.to_json(journal.apply(before, journal.diff(before, new))) == pydantic_core.to_json(new)


def test_an_attempt_whose_error_data_changes_between_equal_python_values_is_kept(client: Any) -> None:
    """Attempts are compared with ``==`` first; their error data is untyped (``1 == True``)."""
    runs = Runs(store(client))
    state = runs.start("run_1")
    state = deliver_discovery(runs, state)
    assert state.discovery is not None
    state = runs.apply(state, DiscoveryReported(seq=state.discovery.seq, response=StepReached(step=StepPlan(id="s1"))))
    step = state.steps[0]
    failed = step.attempts[0].model_copy(update={"error": ErrorInfo(type="E", message="m", data=1)})
    before = state.model_copy(update={"steps": [step.model_copy(update={"attempts": [failed]})]})
    changed = failed.model_copy(update={"error": ErrorInfo(type="E", message="m", data=True)})
    after = before.model_copy(
        update={"steps": [before.steps[0].model_copy(update={"attempts": [changed]})], "version": before.version + 1}
    )
    replayed = journal.apply(before, pydantic_core.from_json(pydantic_core.to_json(journal.diff(before, after))))
    assert replayed.model_dump_json() == after.model_dump_json()


def test_a_step_index_shared_with_a_sibling_copy_still_finds_this_copys_steps() -> None:
    """Two decisions from one state (one of them loses its race) share the step index: the loser adding the
    same step id at another position must not hide the step from the other."""
    from datetime import UTC, datetime

    from ryusen_server.core.model import StepState

    origin = RunState(
        id="run_1",
        app_id="shop",
        function_id="checkout",
        created_at=datetime(2030, 1, 1, tzinfo=UTC),
        updated_at=datetime(2030, 1, 1, tzinfo=UTC),
        steps=[StepState(id="a")],
    )
    assert origin.step_index("a") == 0  # builds the index the copies share
    winner, loser = origin.working_copy(), origin.working_copy()
    winner.add_step(StepState(id="z"))
    loser.add_step(StepState(id="y"))
    loser.add_step(StepState(id="z"))
    assert winner.step_index("z") == 1 and loser.step_index("z") == 2
    assert winner.step("y") is None

"""A DynamoDB write whose first try committed but whose answer was lost (shared/facts/aws.md).

boto3 retries such a request, and the retry then fails its own condition. The store must tell its
own committed write from someone else's, or a created run is never dispatched and a decision's
commands (the invocation of an authorized attempt) are dropped. These tests make botocore retry the
first try of every conditional write once, after it committed, the way a lost reply does on AWS.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import boto3
import pytest
from moto import mock_aws

from ryusen import Ryusen, Step
from ryusen.testing import WorkflowEnvironment
from ryusen_server.aws.store import DynamoStore, create_table
from ryusen_server.core.decide import decide
from ryusen_server.core.events import EngineSettings, StartRun
from tests.functional.test_store_contract import T0

WRITES = ("PutItem", "TransactWriteItems")


class LostReplies:
    """Makes botocore retry the first try of chosen writes although it committed (its reply "was lost")."""

    def __init__(self, client: Any) -> None:
        self.lost: Counter[str] = Counter()
        self.armed = True
        for operation in WRITES:
            client.meta.events.register(f"needs-retry.dynamodb.{operation}", self._needs_retry)

    def _needs_retry(self, response: Any, attempts: int, caught_exception: Any, operation: Any, **_: Any) -> Any:
        if not self.armed or attempts != 1 or caught_exception is not None or response is None:
            return None
        if response[0].status_code != 200:
            return None
        self.lost[operation.name] += 1
        return 0  # retry at once: botocore sends the same request again


@pytest.fixture
def dynamo(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[DynamoStore, LostReplies]]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with mock_aws():
        client = boto3.client("dynamodb", region_name="us-east-1")
        create_table(client, "ryusen-test")
        yield DynamoStore(client, "ryusen-test"), LostReplies(client)


def new_run(run_id: str, key: str | None = None) -> Any:
    start = StartRun(run_id=run_id, app_id="a", function_id="f", input={"n": 1}, idempotency_key=key)
    return decide(None, start, now=T0, settings=EngineSettings()).state


def test_a_create_whose_reply_was_lost_is_recognised_as_its_own(dynamo: tuple[DynamoStore, LostReplies]) -> None:
    store, replies = dynamo
    store.create(new_run("run_1"))  # before the fix: RunExistsError("run_1"), its own write
    assert replies.lost["PutItem"] == 1
    assert store.get("run_1") is not None


def test_a_create_with_a_key_whose_reply_was_lost_is_recognised(dynamo: tuple[DynamoStore, LostReplies]) -> None:
    store, replies = dynamo
    store.create(new_run("run_1", key="order-7"))
    assert replies.lost["TransactWriteItems"] == 1
    assert store.run_for_idempotency_key("f", "order-7") == "run_1"


def test_a_save_whose_reply_was_lost_is_recognised_as_its_own(dynamo: tuple[DynamoStore, LostReplies]) -> None:
    store, replies = dynamo
    replies.armed = False
    state = new_run("run_1")
    store.create(state)
    replies.armed = True
    moved = state.model_copy(update={"version": state.version + 1})
    store.save(moved, expected_version=state.version)  # before the fix: VersionConflictError with itself
    assert replies.lost["PutItem"] == 1
    stored = store.get("run_1")
    assert stored is not None and stored.version == moved.version


def test_someone_elses_write_is_still_a_conflict(dynamo: tuple[DynamoStore, LostReplies]) -> None:
    from ryusen_server.ports import RunExistsError, VersionConflictError

    store, replies = dynamo
    replies.armed = False
    state = new_run("run_1")
    store.create(state)
    with pytest.raises(RunExistsError):
        store.create(new_run("run_1"))
    store.save(state.model_copy(update={"version": 2}), expected_version=1)
    with pytest.raises(VersionConflictError) as conflict:
        store.save(state.model_copy(update={"version": 2}), expected_version=1)
    assert conflict.value.current is not None and conflict.value.current.version == 2


def test_runs_complete_when_every_first_write_loses_its_reply() -> None:
    app = Ryusen("lost-replies")
    calls: Counter[str] = Counter()

    @app.function("pay")
    def pay(data: Any, step: Step) -> Any:
        charged = step.run("charge", lambda: calls.update(["charge"]) or "charged")
        step.run("receipt", lambda: calls.update(["receipt"]) or "sent")
        if data.get("fail"):
            raise RuntimeError("rejected")
        return charged

    with WorkflowEnvironment(app, store="moto") as env:
        assert isinstance(env.store, DynamoStore)
        replies = LostReplies(env.store._client)
        run = env.run("pay", {})
        keyed = env.engine.start_run("pay", {"fail": True}, idempotency_key="k1")[0].id
        failed = env.wait(keyed)
    # journal entries (PutItem); the keyed create and each save that changes what a list shows (transactions)
    assert replies.lost["PutItem"] > 5 and replies.lost["TransactWriteItems"] > 1
    assert run.outcome == "completed" and run.blockers == []  # no spurious Unknown, no stuck run
    assert failed.summary == "failed, fully compensated"  # two skips: no compensators
    assert calls == Counter({"charge": 2, "receipt": 2})


class Throttling:
    """Wraps the DynamoDB client: the first ``times`` batch requests leave every item unprocessed, as a
    throttled table does (BatchWriteItem and BatchGetItem answer 200 with UnprocessedItems/Keys)."""

    def __init__(self, client: Any, times: int) -> None:
        self._client = client
        self.left = times

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def batch_write_item(self, **kwargs: Any) -> Any:
        if self.left > 0:
            self.left -= 1
            return {"UnprocessedItems": kwargs["RequestItems"]}
        return self._client.batch_write_item(**kwargs)

    def batch_get_item(self, **kwargs: Any) -> Any:
        if self.left > 0:
            self.left -= 1
            return {"Responses": {}, "UnprocessedKeys": kwargs["RequestItems"]}
        return self._client.batch_get_item(**kwargs)


def test_unprocessed_batch_items_are_retried_with_backoff_through_a_throttled_spell(
    dynamo: tuple[DynamoStore, LostReplies], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ryusen_server.aws.store as store_module

    store, replies = dynamo
    replies.armed = False
    sleeps: list[float] = []
    monkeypatch.setattr(store_module.time, "sleep", sleeps.append)
    throttled = DynamoStore(Throttling(store._client, times=9), "ryusen-test")  # type: ignore[arg-type]
    state = new_run("run_1").model_copy(update={"input": "x" * 5000})  # a large value: its own item
    throttled.create(state)  # before the fix: RuntimeError after five retries within 0.6 s
    fresh = DynamoStore(Throttling(store._client, times=9), "ryusen-test")  # type: ignore[arg-type]
    got = fresh.get("run_1")
    assert got is not None and got.input == "x" * 5000
    assert len(sleeps) == 18 and all(0 <= s <= 2.0 for s in sleeps)  # backed off (jittered), each wait capped


def test_the_listing_index_spreads_runs_over_many_partition_keys(dynamo: tuple[DynamoStore, LostReplies]) -> None:
    """One constant index partition key takes about 1,000 writes/s in all (shared/facts/aws.md)."""
    store, replies = dynamo
    replies.armed = False
    for i in range(64):
        store.create(new_run(f"run_{i:03d}"))
    items = store._client.scan(TableName=store.table_name, ProjectionExpression="list_pk")["Items"]
    keys = {item["list_pk"]["S"] for item in items if "list_pk" in item}
    assert len(keys) >= 8, keys
    assert [r["id"] for r in store.list_runs(limit=5).runs] == [f"run_{i:03d}" for i in range(63, 58, -1)]


def test_a_finished_run_and_everything_it_stored_expire_after_the_retention(
    dynamo: tuple[DynamoStore, LostReplies],
) -> None:
    from ryusen_server.core.model import Outcome, RunPhase

    store, replies = dynamo
    replies.armed = False
    kept = DynamoStore(store._client, store.table_name, retention_s=86_400)
    state = new_run("run_1", key="order-9").model_copy(update={"input": {"blob": "x" * 5000}})
    kept.create(state)
    items = store._client.scan(TableName=store.table_name)["Items"]
    live_until = T0.timestamp() + 86_400  # a live run's items outlive its last write plus the retention
    assert all(int(item["expires_at"]["N"]) > live_until for item in items), items
    finished_at = T0 + timedelta(hours=2)
    done = state.model_copy(
        update={"version": 2, "phase": RunPhase.FINISHED, "outcome": Outcome.COMPLETED, "finished_at": finished_at}
    )
    kept.save(done, expected_version=1)
    items = store._client.scan(TableName=store.table_name)["Items"]
    kinds = sorted(item["sk"]["S"].split("#")[0] for item in items)
    assert kinds == ["EV", "IDEM", "RUN", "VAL"]  # the journal entry, the key, the head, the large input
    expected = int(finished_at.timestamp()) + 86_400  # kept at least the retention after the finish
    assert all(int(item["expires_at"]["N"]) >= expected for item in items), items
    assert next(int(i["expires_at"]["N"]) for i in items if i["sk"]["S"] == "RUN") == expected  # the head first


def charging_app() -> tuple[Ryusen, Counter[str]]:
    """An app whose one step charges, with a refund as its compensator; the counter records both."""
    app = Ryusen("aba")
    calls: Counter[str] = Counter()

    @app.function("pay")
    def pay(data: Any, step: Step) -> Any:
        return step.run(
            "charge", lambda: calls.update(["charge"]) or "ch_1", compensate=lambda r: calls.update(["refund"])
        )

    return app, calls


def test_an_authorization_whose_reply_was_lost_behind_another_write_is_still_invoked() -> None:
    """The authorize write commits, its reply is lost, an operator's cancel lands before botocore's retry:
    the retry meets someone else's write. The attempt was authorized by this delivery (before the stop),
    so it is invoked and settles, instead of being left to become Unknown at its lease."""
    app, calls = charging_app()
    with WorkflowEnvironment(app, store="moto", chain_steps=False) as env:  # the charge has a message of its own
        assert isinstance(env.store, DynamoStore)
        run_id = env.start("pay")
        env.step_once()  # discovery: the charge attempt is queued
        replies = LostReplies(env.store._client)
        cancelled: list[bool] = []

        def cancel_in_between(**kwargs: Any) -> None:
            if replies.lost["PutItem"] == 1 and not cancelled:
                cancelled.append(True)
                env.cancel(run_id)  # lands between the lost reply and the retry

        env.store._client.meta.events.register("before-send.dynamodb.PutItem", cancel_in_between)  # each try
        env.step_once()  # the charge's delivery: authorize (reply lost), cancel, retry, invoke
        replies.armed = False
        run = env.wait(run_id)
    assert cancelled and calls == Counter({"charge": 1, "refund": 1})
    assert run.summary == "cancelled, fully compensated" and run.blockers == []


def test_a_chained_authorization_whose_reply_was_lost_behind_another_write_is_still_invoked() -> None:
    """The same race when the discovery's answer and the charge's authorization are one write (chaining): the
    re-decision finds the discovery already accepted, and the charge authorized by this very write."""
    app, calls = charging_app()
    with WorkflowEnvironment(app, store="moto") as env:
        assert isinstance(env.store, DynamoStore)
        run_id = env.start("pay")
        replies = LostReplies(env.store._client)
        replies.armed = False
        cancelled: list[bool] = []
        writes: Counter[str] = Counter()

        def arm_for_the_combined_write(**kwargs: Any) -> None:
            writes["PutItem"] += 1
            replies.armed = writes["PutItem"] == 2  # 1: the discovery's authorization; 2: answer + charge's

        def cancel_in_between(**kwargs: Any) -> None:
            if replies.lost["PutItem"] == 1 and not cancelled:
                cancelled.append(True)
                env.cancel(run_id)  # lands between the lost reply and the retry

        env.store._client.meta.events.register("provide-client-params.dynamodb.PutItem", arm_for_the_combined_write)
        env.store._client.meta.events.register("before-send.dynamodb.PutItem", cancel_in_between)
        env.step_once()  # discovery, then (chained) the charge
        replies.armed = False
        run = env.wait(run_id)
    assert cancelled and replies.lost["PutItem"] == 1
    assert calls == Counter({"charge": 1, "refund": 1})
    assert [a["status"] for a in run.attempts("charge")] == ["succeeded"]
    assert run.summary == "cancelled, fully compensated" and run.blockers == []


def test_an_expired_run_reads_as_gone_even_before_dynamodb_deletes_it(dynamo: tuple[DynamoStore, LostReplies]) -> None:
    from ryusen_server.core.model import Outcome, RunPhase

    store, replies = dynamo
    replies.armed = False
    kept = DynamoStore(store._client, store.table_name, retention_s=60)
    state = new_run("run_old")
    kept.create(state)
    done = state.model_copy(
        update={"version": 2, "phase": RunPhase.FINISHED, "outcome": Outcome.COMPLETED, "finished_at": T0}
    )
    kept.save(done, expected_version=1)  # T0 is in 2030 ... so it has not expired yet
    assert kept.get("run_old") is not None
    long_ago = done.model_copy(update={"version": 3, "finished_at": T0.replace(year=2020)})
    kept.save(long_ago, expected_version=2)
    assert kept.get("run_old") is None


def test_a_completion_whose_write_lost_its_reply_is_taken_once_and_not_refused() -> None:
    """Decision 32 on DynamoDB: the write that takes a completion commits and its reply is lost, so botocore sends
    it again and the store meets its own first try: taken once. A caller that saw no answer sends the completion
    again: the same completion, answered as taken, not refused (and nothing more written)."""
    import ryusen
    from ryusen.testing import WorkflowEnvironment as Env

    tokens: list[str] = []
    app = Ryusen("approvals")

    @app.function("expense")
    def expense(data: Any, step: Step) -> Any:
        def ask() -> str:
            token = ryusen.operation().completion_token
            assert token is not None
            tokens.append(token)
            return "asked"

        return step.run("approval", ask, completion="external", timeout=timedelta(hours=1))

    with Env(app, store="moto") as env:
        assert isinstance(env.store, DynamoStore)
        run_id = env.start("expense", {})
        env.drive(until=lambda: bool(tokens) and env.get(run_id).attempts("approval")[-1]["status"] == "waiting")
        replies = LostReplies(env.store._client)
        env.complete(tokens[0], {"approved": True})  # no ConflictError although the write was sent twice
        replies.armed = False
        assert sum(replies.lost.values()) >= 1
        version = env.engine.get_run(run_id).version
        env.complete(tokens[0], {"approved": True})  # the caller's own retry
        assert env.engine.get_run(run_id).version == version
        run = env.wait(run_id)
    assert run.outcome == "completed" and run.output == {"approved": True}
    assert run.attempts("approval")[0]["stale_submissions"] == []

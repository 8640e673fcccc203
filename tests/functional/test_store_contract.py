"""The RunStore contract, run against every store: the in-memory twin and DynamoDB (on moto).

Runs are built by the real core (``decide``), and every transition is
written the way the engine writes it: ``save(new, expected_version=old.version)``.
"""

from __future__ import annotations

import base64
import json
import random
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import pytest
from moto import mock_aws

from ryusen import Ryusen, Step
from ryusen._internal.wire import (
    CallbackSucceeded,
    ConflictFound,
    DiscoveryResponse,
    DuplicateStepConflict,
    ErrorInfo,
    FunctionCompleted,
    FunctionFailed,
    FunctionManifest,
    Occurrence,
    Phase,
    StepPlan,
    StepReached,
)
from ryusen.testing import WorkflowEnvironment
from ryusen_server.aws import store as store_module
from ryusen_server.aws.store import LIST_SHARDS, DynamoStore, create_table
from ryusen_server.core.decide import decide
from ryusen_server.core.events import (
    AttemptReported,
    DiscoveryReported,
    EngineSettings,
    Event,
    ReleaseRef,
    StartRun,
    StopRequested,
    TaskDelivered,
    WakeRequested,
)
from ryusen_server.core.model import RunState, TaskRef
from ryusen_server.core.view import run_summary_view
from ryusen_server.memory import MemoryStore
from ryusen_server.ports import (
    InvalidRequestError,
    PayloadTooLargeError,
    Release,
    RequestCounter,
    RunExistsError,
    RunStore,
    VersionConflictError,
)
from tests.infra.meter import item_size

T0 = datetime(2030, 1, 1, tzinfo=UTC)
SETTINGS = EngineSettings()
RELEASE_REF = ReleaseRef(release_id="rel-1", build_id="build-1")
TABLE = "ryusen-contract"


class OneRequestAtATime:
    """A DynamoDB client on moto whose requests are atomic, as DynamoDB's are: moto checks a condition and
    then writes without a lock, so two threads can both pass it (a transaction, which copies the table
    first, leaves a wide window). Concurrent requests here are serialized, not reordered."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)
        if not callable(method) or name.startswith("_") or name in ("meta", "exceptions", "get_waiter"):
            return method

        def atomic(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return method(*args, **kwargs)

        return atomic


@pytest.fixture(params=["memory", "dynamodb"])
def store(request: pytest.FixtureRequest, aws_env: None) -> Iterator[RunStore]:
    if request.param == "memory":
        yield MemoryStore()
        return
    with mock_aws():
        client = boto3.client("dynamodb", region_name="us-east-1")
        create_table(client, TABLE)
        yield DynamoStore(OneRequestAtATime(client), TABLE, RequestCounter())  # type: ignore[arg-type]


# ---- runs driven through the real core ----------------------------------------------


@dataclass
class Runs:
    """Start runs and move them on through ``decide``, writing each transition like the engine does."""

    store: RunStore

    def start(
        self,
        run_id: str,
        *,
        function_id: str = "checkout",
        at: datetime = T0,
        key: str | None = None,
        input: object = None,
    ) -> RunState:
        decision = decide(
            None,
            StartRun(
                run_id=run_id,
                app_id="shop",
                function_id=function_id,
                input={"sku": "A1", "n": 2} if input is None else input,
                idempotency_key=key,
            ),
            now=at,
            settings=SETTINGS,
        )
        self.store.create(decision.state)
        return decision.state

    def apply(self, state: RunState, event: Event, at: datetime = T0) -> RunState:
        decision = decide(state, event, now=at, settings=SETTINGS)
        assert decision.changed
        self.store.save(decision.state, expected_version=state.version)
        return decision.state

    def discover(self, state: RunState, response: DiscoveryResponse) -> RunState:
        """Deliver the queued discovery and report ``response`` for it."""
        assert state.discovery is not None
        seq = state.discovery.seq
        state = self.apply(
            state, TaskDelivered(task=TaskRef(run_id=state.id, kind="discover", seq=seq), release=RELEASE_REF)
        )
        return self.apply(state, DiscoveryReported(seq=seq, response=response))

    def run_step(self, state: RunState, step_id: str, result: object) -> RunState:
        """Discovery reaches ``step_id``; its forward attempt is delivered and succeeds with ``result``."""
        state = self.discover(state, StepReached(step=StepPlan(id=step_id, has_compensation=True)))
        task = TaskRef(run_id=state.id, kind="forward", step_id=step_id, generation=1)
        state = self.apply(state, TaskDelivered(task=task, release=RELEASE_REF))
        response = CallbackSucceeded(result=result)
        return self.apply(state, AttemptReported(step_id=step_id, phase=Phase.FORWARD, generation=1, response=response))

    def complete(self, state: RunState) -> RunState:
        return self.discover(state, FunctionCompleted(output={"ok": True}))

    def fail(self, state: RunState) -> RunState:
        return self.discover(state, FunctionFailed(error=ErrorInfo(type="ValueError", message="no stock")))

    def cancel(self, state: RunState) -> RunState:
        return self.apply(state, StopRequested(kind="cancel", reason="test"))

    def block(self, state: RunState) -> RunState:
        conflict = DuplicateStepConflict(
            step_id="charge", first=Occurrence(location="a.py:1"), duplicate=Occurrence(location="a.py:2")
        )
        return self.discover(state, ConflictFound(conflict=conflict))

    def unblock(self, state: RunState) -> RunState:
        """A release sync wakes the run; the rediscovery with fixed code completes it."""
        return self.complete(self.apply(state, WakeRequested(source="release_sync")))


@pytest.fixture
def runs(store: RunStore) -> Runs:
    return Runs(store)


def ids(states: list[RunState] | list[dict[str, Any]]) -> list[str]:
    return [s["id"] if isinstance(s, dict) else s.id for s in states]


def shown(states: list[RunState]) -> list[dict[str, Any]]:
    """``states`` as a list shows them."""
    return [run_summary_view(s) for s in states]


def incompressible(seed: int, size: int = 200 * 1024) -> str:
    """JSON text that zlib cannot shrink: random bytes in base64."""
    return base64.b64encode(random.Random(seed).randbytes(size * 3 // 4)).decode()


def run_of_many_steps(run_id: str, count: int, fields: Callable[[int], dict[str, Any]]) -> RunState:
    """A run whose one step completed through the core, then ``count`` steps like it with ``fields(i)``
    (copied, not driven: building a large run through ``decide`` step by step takes minutes)."""
    runs = Runs(MemoryStore())
    one = runs.run_step(runs.start(run_id), "s", {"v": "x"})
    [step] = one.steps
    steps = [step.model_copy(update={"id": f"s{i:03d}", **fields(i)}, deep=True) for i in range(count)]
    return one.model_copy(update={"steps": steps})


# ---- create / get / save ------------------------------------------------------------


def test_create_then_get_returns_an_equal_run(store: RunStore, runs: Runs) -> None:
    created = runs.start("run_1", key="order-7")
    assert store.get("run_1") == created
    assert store.get("run_missing") is None


def test_every_transition_round_trips(store: RunStore, runs: Runs) -> None:
    state = runs.block(runs.start("run_1"))
    assert store.get("run_1") == state and state.blocked_by_definition
    state = runs.unblock(state)
    assert store.get("run_1") == state and state.outcome == "completed"


def test_a_run_far_larger_than_a_dynamodb_item_round_trips(store: RunStore, runs: Runs) -> None:
    """Each value may be 256 KiB and a run's input and results 4 MiB: far past DynamoDB's 400 KB item."""
    state = runs.start("run_big", input={"blob": incompressible(0)})
    for i in range(1, 6):
        state = runs.run_step(state, f"s{i}", {"blob": incompressible(i)})
    state = runs.fail(state)  # the unwind starts: the compensation tasks carry the recorded results
    assert state.run_bytes > 1_000_000 and state.recovery == "compensating"
    assert store.get("run_big") == state
    [listed] = store.list_runs().runs  # a listing leaves large values and steps out: what it shows is the same
    assert listed == run_summary_view(state)


def test_a_run_of_many_steps_with_results_just_under_the_offload_size_round_trips(store: RunStore) -> None:
    """600 results of ~1 KB that zlib cannot shrink, each small enough to stay in a run body on its own."""
    state = run_of_many_steps("run_many", 600, lambda i: {"result": {"v": incompressible(i, 1000)}})
    store.create(state)
    assert store.get("run_many") == state


def test_create_with_a_taken_run_id_is_refused(store: RunStore, runs: Runs) -> None:
    first = runs.start("run_1")
    with pytest.raises(RunExistsError) as exc:
        runs.start("run_1", function_id="other")
    assert exc.value.run_id == "run_1"
    assert store.get("run_1") == first


def test_save_on_the_stored_version_replaces_the_run(store: RunStore, runs: Runs) -> None:
    started = runs.start("run_1")
    cancelled = runs.cancel(started)
    assert cancelled.version == started.version + 1
    assert store.get("run_1") == cancelled


def test_save_on_a_stale_version_raises_with_the_current_run(store: RunStore, runs: Runs) -> None:
    started = runs.start("run_1")
    current = runs.cancel(started)
    stale = decide(started, StopRequested(kind="timeout"), now=T0, settings=SETTINGS).state
    with pytest.raises(VersionConflictError) as exc:
        store.save(stale, expected_version=started.version)
    assert exc.value.current == current
    assert store.get("run_1") == current


def test_save_of_a_run_that_does_not_exist_raises_without_a_current_run(store: RunStore, runs: Runs) -> None:
    ghost = decide(
        None, StartRun(run_id="run_ghost", app_id="shop", function_id="checkout", input=None), now=T0, settings=SETTINGS
    ).state
    with pytest.raises(VersionConflictError) as exc:
        store.save(ghost, expected_version=ghost.version)
    assert exc.value.current is None
    assert store.get("run_ghost") is None


@pytest.mark.rfd("O4")
def test_concurrent_saves_on_the_same_version_exactly_one_wins(store: RunStore, runs: Runs) -> None:
    for trial in range(10):
        started = runs.start(f"run_{trial}")
        assert started.discovery is not None
        task = TaskRef(run_id=started.id, kind="discover", seq=started.discovery.seq)
        rivals = [
            decide(started, TaskDelivered(task=task, release=RELEASE_REF), now=T0, settings=SETTINGS).state,
            decide(started, StopRequested(kind="cancel"), now=T0, settings=SETTINGS).state,
        ]
        barrier = threading.Barrier(len(rivals))
        won: list[RunState] = []
        lost: list[VersionConflictError] = []

        def save(state: RunState) -> None:
            barrier.wait()
            try:
                store.save(state, expected_version=started.version)
                won.append(state)
            except VersionConflictError as exc:
                lost.append(exc)

        threads = [threading.Thread(target=save, args=(s,)) for s in rivals]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(lost) == 1
        assert lost[0].current == won[0] == store.get(started.id)


# ---- idempotency keys ---------------------------------------------------------------


@pytest.mark.rfd("O4")
def test_a_second_create_with_the_same_key_names_the_first_run(store: RunStore, runs: Runs) -> None:
    first = runs.start("run_1", key="order-7")
    with pytest.raises(RunExistsError) as exc:
        runs.start("run_2", key="order-7")
    assert exc.value.run_id == "run_1"
    assert store.get("run_2") is None  # nothing half-written
    assert store.get("run_1") == first
    assert store.run_for_idempotency_key("checkout", "order-7") == "run_1"  # type: ignore[attr-defined]
    assert store.run_for_idempotency_key("checkout", "order-8") is None  # type: ignore[attr-defined]


def test_idempotency_keys_are_per_function(store: RunStore, runs: Runs) -> None:
    runs.start("run_1", function_id="checkout", key="k")
    runs.start("run_2", function_id="refund", key="k")
    # '#' in a function id or a key must not make two (function, key) pairs collide
    runs.start("run_3", function_id="a#b", key="c")
    runs.start("run_4", function_id="a", key="b#c")
    finder = store.run_for_idempotency_key  # type: ignore[attr-defined]
    assert [finder("checkout", "k"), finder("refund", "k"), finder("a#b", "c"), finder("a", "b#c")] == [
        "run_1",
        "run_2",
        "run_3",
        "run_4",
    ]


@pytest.mark.rfd("O4")
def test_concurrent_creates_with_one_key_make_one_run(store: RunStore) -> None:
    contenders = [
        decide(
            None,
            StartRun(run_id=f"run_{i}", app_id="shop", function_id="checkout", input=i, idempotency_key="order-7"),
            now=T0,
            settings=SETTINGS,
        ).state
        for i in range(4)
    ]
    barrier = threading.Barrier(len(contenders))
    created: list[str] = []
    refused: list[str] = []

    def create(state: RunState) -> None:
        barrier.wait()
        try:
            store.create(state)
            created.append(state.id)
        except RunExistsError as exc:
            refused.append(exc.run_id)

    threads = [threading.Thread(target=create, args=(s,)) for s in contenders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(created) == 1
    assert refused == created * 3
    assert [store.get(s.id) is not None for s in contenders].count(True) == 1


# ---- listing ------------------------------------------------------------------------


@pytest.fixture
def listed(runs: Runs) -> list[RunState]:
    """Twelve runs of three functions in every phase/outcome, two of them created at the same instant."""
    out: list[RunState] = []
    for i in range(12):
        function_id = ("checkout", "refund", "report")[i % 3]
        at = T0 + timedelta(minutes=i if i != 7 else 6)  # run_06 and run_07 tie on created_at
        state = runs.start(f"run_{i:02d}", function_id=function_id, at=at)
        if i % 4 == 1:
            state = runs.complete(state)
        elif i % 4 == 2:
            state = runs.fail(state)
        elif i % 4 == 3:
            state = runs.cancel(state)
        out.append(state)
    return out


def newest_first(states: list[RunState]) -> list[RunState]:
    return sorted(states, key=lambda s: (s.created_at, s.id), reverse=True)


def all_pages(store: RunStore, limit: int, **filters: Any) -> list[list[str]]:
    pages: list[list[str]] = []
    cursor: str | None = None
    while True:
        page = store.list_runs(limit=limit, cursor=cursor, **filters)
        pages.append(ids(page.runs))
        cursor = page.cursor
        if cursor is None:
            return pages
        assert len(pages) < 50, "pagination does not end"


def test_list_runs_is_newest_first(store: RunStore, listed: list[RunState]) -> None:
    page = store.list_runs()
    assert page.runs == shown(newest_first(listed))
    assert page.cursor is None
    assert ids(page.runs)[4:6] == ["run_07", "run_06"]  # a tie on created_at is ordered by id


@pytest.mark.parametrize(
    "filters",
    [
        {"function_id": "refund"},
        {"phase": "running"},
        {"phase": "finished"},
        {"outcome": "completed"},
        {"outcome": "cancelled"},
        {"function_id": "checkout", "phase": "finished"},
        {"function_id": "report", "outcome": "failed"},
        {"function_id": "nobody"},
    ],
)
def test_list_runs_filters(store: RunStore, listed: list[RunState], filters: dict[str, str]) -> None:
    def matches(s: RunState) -> bool:
        return (
            filters.get("function_id", s.function_id) == s.function_id
            and filters.get("phase", s.phase.value) == s.phase.value
            and ("outcome" not in filters or (s.outcome is not None and s.outcome.value == filters["outcome"]))
        )

    expected = newest_first([s for s in listed if matches(s)])
    assert store.list_runs(**filters).runs == shown(expected)  # type: ignore[arg-type]


@pytest.fixture
def listed_blocked(runs: Runs, listed: list[RunState]) -> list[RunState]:
    """``listed``, with two of its running runs blocked (a duplicate step id) and one finished with a step
    compensated, so recovery and blockers vary."""
    out = list(listed)
    for i in (0, 4):
        out[i] = runs.block(out[i])
    state = runs.start("run_12", function_id="checkout", at=T0 + timedelta(minutes=12))
    state = runs.run_step(state, "charge", {"id": "ch_1"})
    out.append(runs.fail(state))
    return out


@pytest.mark.parametrize(
    "filters",
    [
        {"blocked": True},
        {"blocked": False},
        {"recovery": "not_required"},
        {"recovery": "compensating"},
        {"recovery": "compensated"},
        {"function_id": "checkout", "blocked": True},
        {"phase": "running", "blocked": False},
        {"outcome": "failed", "recovery": "not_required"},
    ],
)
def test_list_runs_filters_by_recovery_and_blockers(
    store: RunStore, listed_blocked: list[RunState], filters: dict[str, Any]
) -> None:
    def matches(s: RunState) -> bool:
        return (
            filters.get("function_id", s.function_id) == s.function_id
            and filters.get("phase", s.phase.value) == s.phase.value
            and ("outcome" not in filters or (s.outcome is not None and s.outcome.value == filters["outcome"]))
            and ("recovery" not in filters or (s.recovery is not None and s.recovery.value == filters["recovery"]))
            and filters.get("blocked", bool(s.blockers)) == bool(s.blockers)
        )

    expected = newest_first([s for s in listed_blocked if matches(s)])
    if filters.get("blocked") is True or filters.get("recovery") == "compensating":
        assert expected, "the fixture has runs of every kind asked for"
    assert ids(store.list_runs(**filters).runs) == ids(expected)
    assert [run_id for page in all_pages(store, 2, **filters) for run_id in page] == ids(expected)


@pytest.mark.parametrize("limit", [1, 2, 5, 12, 13])
def test_pagination_returns_every_run_exactly_once(store: RunStore, listed: list[RunState], limit: int) -> None:
    pages = all_pages(store, limit)
    assert [run_id for page in pages for run_id in page] == ids(newest_first(listed))
    assert all(len(page) == limit for page in pages[:-1])
    assert 1 <= len(pages[-1]) <= limit  # no empty trailing page: the cursor ends with the last run


@pytest.mark.parametrize(
    ("limit", "filters"),
    [
        (1, {"outcome": "completed"}),
        (2, {"function_id": "report"}),
        (3, {"phase": "running"}),
        (2, {"function_id": "refund", "phase": "finished"}),
    ],
)
def test_pagination_with_filters(store: RunStore, listed: list[RunState], limit: int, filters: dict[str, str]) -> None:
    expected = ids(store.list_runs(limit=100, **filters).runs)
    assert expected
    pages = all_pages(store, limit, **filters)
    assert [run_id for page in pages for run_id in page] == expected
    assert all(len(page) == limit for page in pages[:-1])


def test_list_of_an_empty_store(store: RunStore) -> None:
    page = store.list_runs(limit=3)
    assert page.runs == [] and page.cursor is None


# ---- blocked runs -------------------------------------------------------------------


def test_runs_blocked_by_definition_follow_the_blocker(store: RunStore, runs: Runs) -> None:
    blocked = runs.block(runs.start("run_1"))
    runs.block(runs.start("run_2", function_id="refund"))
    runs.start("run_3")
    assert store.runs_blocked_by_definition("checkout") == ["run_1"]
    assert store.runs_blocked_by_definition("refund") == ["run_2"]
    assert store.runs_blocked_by_definition("report") == []
    runs.unblock(blocked)
    assert store.runs_blocked_by_definition("checkout") == []
    assert store.runs_blocked_by_definition("refund") == ["run_2"]


# ---- releases -----------------------------------------------------------------------


def release(app_id: str, release_id: str, functions: list[str], minutes: int) -> Release:
    return Release(
        app_id=app_id,
        url=f"http://127.0.0.1:9000/{app_id}",
        release_id=release_id,
        build_id=f"build-{release_id}",
        functions=tuple(FunctionManifest(id=f, timeout_s=3600.0 if f == "checkout" else None) for f in functions),
        synced_at=T0 + timedelta(minutes=minutes),
        signed=app_id != "unsigned",
    )


def test_releases_newest_per_function_and_per_app(store: RunStore) -> None:
    assert store.get_release("checkout") is None
    assert store.list_releases() == []
    shop_1 = release("shop", "r1", ["checkout", "refund"], 0)
    store.put_release(shop_1)
    assert store.get_release("checkout") == shop_1
    shop_2 = release("shop", "r2", ["checkout"], 5)
    reports = release("unsigned", "r9", ["report"], 3)
    store.put_release(shop_2)
    store.put_release(reports)
    assert store.get_release("checkout") == shop_2
    assert store.get_release("refund") == shop_1  # the newest release that declares it
    assert store.get_release("report") == reports
    assert store.get_release("nobody") is None
    by_app = {r.app_id: r for r in store.list_releases()}
    assert by_app == {"shop": shop_2, "unsigned": reports}
    assert len(store.list_releases()) == 2


# ---- DynamoDB only: what it costs and what it refuses -------------------------------


@pytest.fixture
def dynamo(aws_env: None) -> Iterator[DynamoStore]:
    with mock_aws():
        client = boto3.client("dynamodb", region_name="us-east-1")
        create_table(client, TABLE)
        yield DynamoStore(client, TABLE, RequestCounter())


def test_dynamo_one_request_per_store_call_on_the_step_path(dynamo: DynamoStore) -> None:
    runs = Runs(dynamo)
    started = runs.start("run_1", key="order-7")  # a transaction: one write request
    assert dynamo.counter.counts == {"dynamodb.write": 1}
    dynamo.counter.reset()
    assert dynamo.get("run_1") == started
    stepped = runs.run_step(started, "reserve", {"ok": True})
    dynamo.counter.reset()
    assert dynamo.get("run_1") == stepped
    runs.run_step(stepped, "charge", {"ok": True})
    # a transition that changes no summary field is one journal entry (written after the one read)
    assert dynamo.counter.counts == {"dynamodb.read": 1, "dynamodb.write": 4}
    assert dynamo.counter.largest_item["dynamodb.write"] < 1024  # the entry carries the change only
    dynamo.counter.reset()
    runs.cancel(dynamo.get("run_1"))
    # the cancel changes what a list shows: its journal entry and the head item, in one transaction
    assert dynamo.counter.counts == {"dynamodb.read": 1, "dynamodb.write": 1}
    dynamo.counter.reset()
    with pytest.raises(VersionConflictError) as exc:
        dynamo.save(stepped.model_copy(update={"version": stepped.version + 1}), expected_version=stepped.version)
    assert exc.value.current == dynamo.peek("run_1")
    # the write's condition fails; the current run is the cached one and the entries after it (one query)
    assert dynamo.counter.counts == {"dynamodb.read": 1}


def test_dynamo_a_run_head_stays_within_one_write_unit_from_its_start_to_its_end() -> None:
    """The head is written at the start and rewritten in the finish's transaction (twice its write units): over
    1 KB, each costs one more unit. It holds the run as created and what a list shows, not the run twice."""
    app = Ryusen("shop")

    @app.function("checkout")
    def checkout(order: Any, step: Step) -> Any:
        step.run("reserve", lambda: {"reservation": "r_81c2e9"}, compensate=lambda r: None)
        step.run("charge", lambda: {"charge_id": "ch_3QX0aF2eZvKYlo2C"}, compensate=lambda c: None)
        return step.run("ship", lambda: (_ for _ in ()).throw(ValueError("no courier")))

    with WorkflowEnvironment(app, store="moto") as env:
        store = env.store
        assert isinstance(store, DynamoStore)
        store.retention_s = 30 * 86400  # the deployed default: every item carries its expiry
        env.engine.new_id = lambda: "run_" + "5f0e3c1b9a7d42e8b6c4a2f0d8e6b4c2"  # as long as the engine's
        sizes: list[int] = []

        def head_bytes(run_id: str) -> int:
            key = {"pk": {"S": f"RUN#{run_id}"}, "sk": {"S": "RUN"}}
            item = store._client.get_item(TableName=store.table_name, Key=key)["Item"]
            return item_size(item)

        order = {
            "order_id": "ord_7Hq2",
            "sku": "lamp-oak-40",
            "qty": 1,
            "card": "4242",
            "amount": 30,
            "currency": "EUR",
        }
        run_id = env.start("checkout", {**order, "address": {"city": "Lyon", "postcode": "69002"}})
        sizes.append(head_bytes(run_id))
        run = env.wait(run_id)
        sizes.append(head_bytes(run_id))
        assert run.summary == "failed, fully compensated"
        assert max(sizes) <= 1024, sizes


def test_dynamo_lists_a_run_whose_head_was_written_before_summaries_took_the_list_form(
    dynamo: DynamoStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run written by the release before (its head's summary the run without steps, its step count apart) is
    still listed after an upgrade, as it was shown then."""
    runs = Runs(dynamo)
    written = store_module._index_attributes

    def as_before(state: RunState) -> dict[str, Any]:
        item = written(state)
        doc = state.model_dump(mode="json", exclude={"steps", "unwind"})
        item["summary"] = {"B": store_module._compress(json.dumps(doc).encode())}
        item["step_count"] = {"N": str(len(state.steps))}
        return item

    with monkeypatch.context() as before:
        before.setattr(store_module, "_index_attributes", as_before)
        state = runs.complete(runs.run_step(runs.start("run_1"), "reserve", {"id": 7}))
        old_blocked = runs.block(runs.start("run_2", at=T0 + timedelta(minutes=1)))
        old_compensating = runs.fail(runs.run_step(runs.start("run_3", at=T0 + timedelta(minutes=2)), "a", 1))
    new_blocked = runs.block(runs.start("run_4", at=T0 + timedelta(minutes=3)))
    cold = DynamoStore(boto3.client("dynamodb", region_name="us-east-1"), TABLE, RequestCounter())
    assert cold.list_runs().runs[-1] == run_summary_view(state) and cold.list_runs().runs[-1]["steps"] == 1
    # old heads and new filter alike (recovery and blockers are read from the summaries)
    assert ids(cold.list_runs(blocked=True).runs) == [new_blocked.id, old_blocked.id]
    assert ids(cold.list_runs(recovery="compensating").runs) == [old_compensating.id]
    assert ids(cold.list_runs(blocked=False).runs) == [old_compensating.id, state.id]


def set_summary(store: DynamoStore, run_id: str, raw: bytes) -> None:
    """Overwrite a run's head summary with ``raw``, compressed (a head this code did not write)."""
    store._client.update_item(
        TableName=store.table_name,
        Key={"pk": {"S": f"RUN#{run_id}"}, "sk": {"S": "RUN"}},
        UpdateExpression="SET summary = :s",
        ExpressionAttributeValues={":s": {"B": zlib.compress(raw)}},
    )


@pytest.mark.parametrize("raw", [b"null", b"7", b'"a summary"', b"[1]", b'{"not": "a run"}'])
def test_dynamo_lists_the_other_runs_when_a_head_holds_json_that_is_no_summary(dynamo: DynamoStore, raw: bytes) -> None:
    """One run this code cannot read is left out and logged; every other run is still listed (the review found
    such JSON raised TypeError through every listing)."""
    runs = Runs(dynamo)
    runs.start("run_broken")
    fine = runs.start("run_fine")
    set_summary(dynamo, "run_broken", raw)
    assert dynamo.list_runs().runs == [run_summary_view(fine)]


def test_dynamo_a_summary_in_the_list_form_without_a_field_is_left_out_of_a_filtered_list(dynamo: DynamoStore) -> None:
    """A summary without ``recovery`` or ``blocked`` (a later release's form, a bug) is no summary: left out,
    not read by the filter (the review found it raised KeyError through every filtered listing)."""
    runs = Runs(dynamo)
    runs.start("run_broken")
    fine = runs.start("run_fine")
    doc = run_summary_view(fine)
    del doc["id"], doc["recovery"], doc["blocked"]
    set_summary(dynamo, "run_broken", json.dumps(doc).encode())
    assert ids(dynamo.list_runs(blocked=False).runs) == ["run_fine"]
    assert ids(dynamo.list_runs().runs) == ["run_fine"]


def test_dynamo_keeps_large_values_out_of_the_run_item(dynamo: DynamoStore) -> None:
    runs = Runs(dynamo)
    state = runs.run_step(runs.start("run_big"), "reserve", {"blob": incompressible(1)})
    dynamo.counter.reset()
    state = runs.run_step(state, "charge", {"ok": True})
    # four transitions, each one small conditional write: the 200 KiB result is not written again
    assert dynamo.counter.counts == {"dynamodb.write": 4}
    assert dynamo.counter.bytes_sent["dynamodb.write"] < 4 * 1024
    dynamo.counter.reset()
    state = runs.run_step(state, "ship", {"label": incompressible(2, 8 * 1024)})
    # the transition that accepts a large result writes its value item first: one more request
    assert dynamo.counter.counts == {"dynamodb.write": 5}
    # another process (nothing cached) reads the run item and its large values: two requests
    cold = DynamoStore(boto3.client("dynamodb", region_name="us-east-1"), TABLE, RequestCounter())
    assert cold.get("run_big") == state
    assert cold.counter.counts == {"dynamodb.read": 2}
    assert cold.get("run_big") == state
    assert cold.counter.counts == {"dynamodb.read": 3}  # the values are immutable: cached


def test_dynamo_a_listing_reads_no_large_values(dynamo: DynamoStore) -> None:
    runs = Runs(dynamo)
    state = runs.run_step(runs.start("run_big", input={"blob": incompressible(0)}), "reserve", {"b": incompressible(1)})
    state = runs.complete(state)  # a running run's step count in a list may lag (exact once it ends)
    cold = DynamoStore(boto3.client("dynamodb", region_name="us-east-1"), TABLE, RequestCounter())
    [listed] = cold.list_runs().runs
    # one index query per shard, then the head items: no value items, no journal
    assert cold.counter.counts == {"dynamodb.read": LIST_SHARDS + 1}
    assert listed == run_summary_view(state) and listed["steps"] == 1


def test_dynamo_refuses_a_run_item_over_the_item_limit_before_writing_anything(dynamo: DynamoStore) -> None:
    """Display names stay in the run item: 400 steps with 1.5 KB names that zlib cannot shrink."""
    state = run_of_many_steps(
        "run_wide", 400, lambda i: {"name": incompressible(i, 1500), "result": {"big": incompressible(i)}}
    )
    with pytest.raises(PayloadTooLargeError):
        dynamo.create(state)
    assert dynamo.counter.counts == {}  # no value item was written for a run that cannot be
    assert dynamo.get("run_wide") is None


def test_dynamo_keeps_well_compressing_small_values_in_a_big_body_when_that_is_smaller(dynamo: DynamoStore) -> None:
    """Past the body budget, small values move out only if that shrinks the body (a digest may cost more)."""
    from ryusen_server.aws import store as dynamo_store

    state = run_of_many_steps(
        "run_mixed", 200, lambda i: {"name": incompressible(i, 1000), "result": {"note": f"{i} " + "ok " * 150}}
    )
    doc = state.model_dump(mode="json")
    first = dynamo_store._pack_with(doc, dynamo_store.OFFLOAD_BYTES)
    assert len(first.blob) > dynamo_store.BODY_BUDGET_BYTES and not first.values
    chosen = dynamo_store._pack(doc, budget=dynamo_store.BODY_BUDGET_BYTES)
    assert chosen.values == {} and chosen.blob == first.blob
    dynamo.create(state)
    assert dynamo.get("run_mixed") == state


def test_dynamo_a_lost_race_returns_the_current_run_with_its_large_values(dynamo: DynamoStore) -> None:
    runs = Runs(dynamo)
    started = runs.start("run_big", input={"blob": incompressible(0)})
    current = runs.run_step(started, "reserve", {"blob": incompressible(1)})
    cold = DynamoStore(boto3.client("dynamodb", region_name="us-east-1"), TABLE, RequestCounter())
    stale = decide(started, StopRequested(kind="cancel"), now=T0, settings=SETTINGS).state
    with pytest.raises(VersionConflictError) as exc:
        cold.save(stale, expected_version=started.version)
    assert exc.value.current == current
    assert dynamo.get("run_big") == current


def test_dynamo_rejects_a_forged_cursor(dynamo: DynamoStore) -> None:
    Runs(dynamo).start("run_1")
    for cursor in ("not base64!", "eyJhIjogMX0=", "bnVsbA=="):
        with pytest.raises(InvalidRequestError):
            dynamo.list_runs(cursor=cursor)
    with pytest.raises(InvalidRequestError):
        dynamo.list_runs(limit=0)


def test_dynamo_refuses_an_idempotency_key_longer_than_a_dynamodb_key(dynamo: DynamoStore) -> None:
    with pytest.raises(InvalidRequestError):
        Runs(dynamo).start("run_1", key="k" * 3000)
    assert dynamo.get("run_1") is None
    assert dynamo.run_for_idempotency_key("checkout", "k" * 3000) is None

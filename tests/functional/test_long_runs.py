"""Runs far past what one DynamoDB item holds, on the DynamoDB store (moto): a write costs the same at step
10 and at step 10,000, a step may have 1,000 attempts, and a long run can still be cancelled and compensated.

Before the journal, a run lived in one item rewritten whole by every write: about 270 steps with long
display names, or a step with many attempts, passed DynamoDB's 400 KB item limit, after which the run could
not be saved (it stopped advancing, and cancel failed with PayloadTooLargeError).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import boto3
import pytest
from moto import mock_aws

from ryusen._internal.wire import (
    CallbackFailed,
    CallbackSucceeded,
    ErrorInfo,
    Phase,
    RetryPolicyWire,
    StepPlan,
    StepReached,
)
from ryusen_server.aws.store import DynamoStore, create_table
from ryusen_server.core import decide as core
from ryusen_server.core import model
from ryusen_server.core.decide import decide
from ryusen_server.core.events import (
    AttemptReported,
    DiscoveryReported,
    EngineSettings,
    EnqueueTask,
    Event,
    ReleaseRef,
    StartRun,
    StopRequested,
    TaskDelivered,
)
from ryusen_server.core.model import RunState, TaskRef
from ryusen_server.ports import RequestCounter

T0 = datetime(2030, 1, 1, tzinfo=UTC)
RELEASE = ReleaseRef(release_id="rel-1", build_id="build-1")
TWO_WRITE_UNITS = 2 * 1024
TABLE = "ryusen-long"


@pytest.fixture
def dynamo(aws_env: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[DynamoStore]:
    # proving each decision pure reads the whole run, and so does checking what a state derives from its
    # origin against every step: O(steps) per decision, too slow at 10,000 steps
    monkeypatch.setattr(core, "CHECK_PURITY", False)
    monkeypatch.setattr(model, "CHECK_DERIVED", False)
    with mock_aws():
        client = boto3.client("dynamodb", region_name="us-east-1")
        create_table(client, TABLE)
        yield DynamoStore(client, TABLE, RequestCounter(item_sizes=[]))


class Driver:
    """Moves a run through the real core, writing every transition as the engine does."""

    def __init__(self, store: DynamoStore, settings: EngineSettings) -> None:
        self.store, self.settings, self.now = store, settings, T0

    def apply(self, state: RunState | None, event: Event) -> RunState:
        self.now += timedelta(milliseconds=10)
        decision = decide(state, event, now=self.now, settings=self.settings)
        assert decision.rejection is None, decision.rejection
        if state is None:
            self.store.create(decision.state)
        elif decision.changed:
            self.store.save(decision.state, expected_version=state.version)
        return decision.state

    def first_step(self, state: RunState, plan: StepPlan) -> RunState:
        """The first discovery reaches ``plan``; its forward attempt is delivered."""
        assert state.discovery is not None
        seq = state.discovery.seq
        state = self.apply(
            state, TaskDelivered(task=TaskRef(run_id=state.id, kind="discover", seq=seq), release=RELEASE)
        )
        state = self.apply(state, DiscoveryReported(seq=seq, response=StepReached(step=plan)))
        task = TaskRef(run_id=state.id, kind="forward", step_id=plan.id, generation=1)
        return self.apply(state, TaskDelivered(task=task, release=RELEASE, delivery_id="chain"))

    def step(self, state: RunState, step_id: str, after: StepPlan) -> RunState:
        """``step_id``'s attempt succeeds, and its continuation reached ``after``: the one write that accepts
        the result also records ``after`` and authorizes its attempt (what a chaining dispatcher writes)."""
        report = AttemptReported(
            step_id=step_id,
            phase=Phase.FORWARD,
            generation=1,
            response=CallbackSucceeded(result={"n": step_id}),
            next=StepReached(step=after),
            chain=RELEASE,
            delivery_id="chain",
        )
        state = self.apply(state, report)
        attempt = state.steps[-1].attempts[-1]
        assert state.steps[-1].id == after.id and attempt.status == "authorized"
        return state


def row(i: int) -> StepPlan:
    # long display names, which the run item kept in full: such a run was past 400 KB by step ~300
    return StepPlan(id=f"row-{i}", name=f"row {i} " + "n" * 1200, has_compensation=i % 100 == 0)


def test_a_10000_step_run_writes_the_same_size_at_every_step_and_cancels_into_compensation(
    dynamo: DynamoStore,
) -> None:
    steps = int(__import__("os").environ.get("LONG_STEPS", "10000"))
    driver = Driver(dynamo, EngineSettings(max_steps=steps + 1))
    state = driver.apply(None, StartRun(run_id="run_long", app_id="shop", function_id="batch", input={"rows": steps}))
    sizes = dynamo.counter.item_sizes
    assert sizes is not None
    early: list[int] = []
    state = driver.first_step(state, row(0))
    for i in range(steps - 1):
        state = driver.step(state, f"row-{i}", after=row(i + 1))
        if i == 20:
            early = list(sizes)
    # the last step: a plain report (its continuation will find the function's end: not needed here)
    report = AttemptReported(
        step_id=f"row-{steps - 1}", phase=Phase.FORWARD, generation=1, response=CallbackSucceeded(result=None)
    )
    state = driver.apply(state, report)
    late = sizes[-len(early) :]
    assert max(sizes) <= TWO_WRITE_UNITS, max(sizes)  # every write, from the first to the last
    assert statistics.median(late) <= 1.2 * statistics.median(early), (
        statistics.median(early),
        statistics.median(late),
    )

    # another process (nothing cached) reads the whole run back
    cold = DynamoStore(dynamo._client, TABLE, RequestCounter())
    assert cold.get("run_long") == state and len(state.steps) == steps

    # cancel the long run: every completed step's compensation runs, newest first, each outcome written
    # with the authorization of the next one (a chaining dispatcher); steps without a compensator skip
    sizes.clear()
    state = driver.apply(state, StopRequested(kind="cancel", reason="too long"))
    assert state.recovery == "compensating" and state.phase == "compensating"
    compensated: list[str] = []
    step_id = state.unwind[0].step_id
    task = TaskRef(run_id=state.id, kind="compensate", step_id=step_id, generation=1)
    state = driver.apply(state, TaskDelivered(task=task, release=RELEASE, delivery_id="chain"))
    while state.phase != "finished":
        report = AttemptReported(
            step_id=step_id,
            phase=Phase.COMPENSATION,
            generation=1,
            response=CallbackSucceeded(result=None),
            chain=RELEASE,
            delivery_id="chain",
        )
        state = driver.apply(state, report)
        compensated.append(step_id)
        done = len(compensated)
        assert all(u.status in ("compensated", "skipped") for u in state.unwind[done - 1 : done])
        if done < len(state.unwind):
            step_id = state.unwind[done].step_id
            step = state.step(step_id)
            assert step is not None and step.attempts[-1].status == "authorized"  # the chained one
    assert compensated == [f"row-{i}" for i in range(steps - 1, -1, -1)]
    assert state.outcome == "cancelled" and state.recovery == "compensated"
    assert max(sizes) <= TWO_WRITE_UNITS, max(sizes)
    assert DynamoStore(dynamo._client, TABLE, RequestCounter()).get("run_long") == state


def test_a_step_with_1000_attempts(dynamo: DynamoStore) -> None:
    """A step that fails 999 times and succeeds at its 1,000th attempt (its policy's limit): every retry is
    the task the engine enqueued, delivered after its delay; every write stays small."""
    driver = Driver(dynamo, EngineSettings())
    state = driver.apply(None, StartRun(run_id="run_flaky", app_id="shop", function_id="wait", input=None))
    policy = RetryPolicyWire(max_attempts=1000, initial_delay_s=1.0, backoff=1.0, max_delay_s=1.0)
    state = driver.first_step(state, StepPlan(id="probe", retry=policy))
    for n in range(1, 1001):
        error = ErrorInfo(type="ConnectionError", message=f"down (attempt {n})")
        response = CallbackSucceeded(result="up") if n == 1000 else CallbackFailed(error=error)
        decision = decide(
            state,
            AttemptReported(step_id="probe", phase=Phase.FORWARD, generation=n, response=response),
            now=driver.now,
            settings=driver.settings,
        )
        dynamo.save(decision.state, expected_version=state.version)
        state = decision.state
        if n == 1000:
            break
        [retry] = [c for c in decision.commands if isinstance(c, EnqueueTask)]
        assert retry.task.generation == n + 1
        assert 0 < retry.delay_s <= 1.0  # the policy's delay, jittered
        driver.now += timedelta(seconds=retry.delay_s)
        state = driver.apply(state, TaskDelivered(task=retry.task, release=RELEASE))
    [probe] = state.steps
    assert probe.status == "completed" and probe.result == "up"
    assert [a.status for a in probe.attempts] == ["failed"] * 999 + ["succeeded"]
    sizes = dynamo.counter.item_sizes
    assert sizes is not None and max(sizes) <= TWO_WRITE_UNITS, max(sizes or [0])
    assert DynamoStore(dynamo._client, TABLE, RequestCounter()).get("run_flaky") == state

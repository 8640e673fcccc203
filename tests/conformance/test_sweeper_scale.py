"""The sweeper at scale (issue 24, finding 7): its work follows the runs actually due.

Before, every unfinished run was looked at every 10 minutes and a pass looked at 500 runs: past about 5,000
long-lived runs the sweeper fell behind without bound.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta

from ryusen.testing import WorkflowEnvironment
from ryusen_server.core.decide import decide
from ryusen_server.core.events import EngineSettings, StartRun
from ryusen_server.core.model import RunState, TaskKind
from ryusen_server.engine import Engine
from ryusen_server.memory import MemoryQueue, MemoryStore, MemoryTimers

from .test_sweeper import PAST_GRACE, losing_sends, shop


def waiting_for_a_person(run_id: str, at: datetime) -> RunState:
    """An unfinished run with no work due (what a run blocked on an Unknown looks like to the sweeper)."""
    start = StartRun(run_id=run_id, app_id="a", function_id="f", input=None)
    state = decide(None, start, now=at, settings=EngineSettings()).state
    state = state.model_copy(update={"discovery": None})
    assert state.work_due_at() is None
    return state


class Deferrals(MemoryStore):
    """A memory store that records when the sweeper asks to look at each run again."""

    def __init__(self) -> None:
        super().__init__()
        self.deferred: dict[str, datetime] = {}

    def defer_check(self, run_id: str, at: datetime) -> None:
        self.deferred[run_id] = at
        super().defer_check(run_id, at)


def test_a_run_unchanged_for_long_is_looked_at_less_and_less() -> None:
    from datetime import UTC

    created = datetime(2030, 1, 1, tzinfo=UTC)
    store = Deferrals()
    now = created
    engine = Engine(
        store=store, queue=MemoryQueue(lambda: now), timers=MemoryTimers(lambda: now), invoker=None, clock=lambda: now
    )  # type: ignore[arg-type]
    store.create(waiting_for_a_person("run_1", created))
    looks = 0
    while now < created + timedelta(days=7):
        now += timedelta(minutes=1)
        looks += engine.sweep().checked
    assert store.deferred["run_1"] - now >= timedelta(hours=12)  # a run a week quiet: looked at twice a day at most
    assert looks <= 30, looks  # before: every 10 minutes, about 1,000 looks in a week


def test_a_pass_pages_through_every_run_due_not_just_the_first_batch() -> None:
    calls: Counter[str] = Counter()
    with WorkflowEnvironment(shop(calls)) as env:
        lost = losing_sends(env, kinds={TaskKind.DISCOVER}, times=30)
        runs = [env.start("checkout", {"n": n}) for n in range(30)]
        assert len(lost) == 30
        env.advance(PAST_GRACE)
        report = env.engine.sweep(limit=10)
        assert report.checked == 30 and sorted(report.repaired) == sorted(runs)  # before: 10, in one pass

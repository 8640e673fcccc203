"""One step at a time, from the function's own thread (decisions 18): a ``step.run`` started from another thread
is refused with ``ConcurrentStepError`` and the run blocks with a ``concurrent_step`` definition blocker, the
same way every time, whatever the threads' timing and with kept passes on or off (issue 23: a thread pool's
steps were refused in 7 of 10 runs without kept passes and in none with them).
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ryusen import ConcurrentStepError, Ryusen, Step
from ryusen.testing import WorkflowEnvironment

KEPT = pytest.mark.parametrize("kept_passes", [False, True], ids=["replay every task", "kept passes"])
RUNS = 10


def outcomes(app: Ryusen, function_id: str, *, kept_passes: bool) -> Counter[str]:
    """What ``RUNS`` runs of the function came to: each run's outcome, or its blockers' types."""
    seen: Counter[str] = Counter()
    with WorkflowEnvironment(app, kept_passes=kept_passes) as env:
        for _ in range(RUNS):
            run = env.run(function_id)
            seen[run.outcome or ",".join(b["type"] for b in run.blockers)] += 1
    return seen


@KEPT
def test_steps_mapped_over_a_thread_pool_are_refused_every_time(kept_passes: bool) -> None:
    app = Ryusen("fan-out")
    ran: Counter[str] = Counter()

    def price(sku: str) -> int:
        ran[sku] += 1
        return len(sku)

    @app.function("quote")
    def quote(data: Any, step: Step) -> Any:
        with ThreadPoolExecutor(3) as pool:
            return sum(pool.map(lambda sku: step.run(f"price-{sku}", price, sku), ["a1", "b22", "c333"]))

    assert outcomes(app, "quote", kept_passes=kept_passes) == Counter({"concurrent_step": RUNS})
    assert ran == Counter()  # no callback of a refused step ran
    with WorkflowEnvironment(app, kept_passes=kept_passes) as env:
        [blocker] = env.run("quote").blockers
    prices = {"price-a1", "price-b22", "price-c333"}  # which thread comes first is the threads' timing
    assert blocker["type"] == "concurrent_step" and blocker["second"]["step_id"] in prices


@KEPT
def test_a_step_handed_to_another_thread_is_refused_even_when_no_other_step_is_open(kept_passes: bool) -> None:
    """The function waits for the thread: nothing else is open, and the step is still refused (by the thread
    it came from, not by timing), so its callback never runs and the blocker names where it was started."""
    app = Ryusen("handed-over")
    ran: list[str] = []
    refused: list[ConcurrentStepError] = []

    def effect(name: str) -> str:
        ran.append(name)
        return f"{name}-done"

    @app.function("pay")
    def pay(data: Any, step: Step) -> Any:
        step.run("reserve", effect, "reserve")
        with ThreadPoolExecutor(1) as pool:
            try:
                return pool.submit(step.run, "charge", effect, "charge").result()
            except ConcurrentStepError as exc:
                refused.append(exc)
                raise

    with WorkflowEnvironment(app, kept_passes=kept_passes) as env:
        runs = [env.run("pay") for _ in range(3)]
    for run in runs:
        [blocker] = run.blockers
        assert blocker["type"] == "concurrent_step" and blocker["second"]["step_id"] == "charge"
        assert blocker["first"]["name"] == "the workflow function's own thread" and "step_id" not in blocker["first"]
    assert ran == ["reserve"] * 3 and refused and all(e.step_id == "charge" for e in refused)

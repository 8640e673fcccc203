"""Review of the eventually consistent release recheck (engine._newest_release).

Found: with release_recheck_s=0 (documented as a read after every callback) a release synced through another
process never reached a chain while copies lagged (0 now reads consistently). The rest held up."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from ryusen import RetryPolicy, Ryusen, Step
from ryusen.testing import WorkflowEnvironment
from ryusen_server.engine import Engine
from ryusen_server.ports import StoreUnavailableError
from tests.conformance.test_continuation import shop_release


def rechecked(app: Ryusen, store: str) -> WorkflowEnvironment:
    """An environment whose engine rechecks the newest release after every callback (an eventually consistent
    read: a recheck of 0 reads consistently)."""
    env = WorkflowEnvironment(app, store=store)
    env.engine.settings = replace(env.engine.settings, release_recheck_s=1e-9)
    return env


def other_process_sync(env: WorkflowEnvironment, app: Any) -> None:
    this = env.engine
    env.engine = Engine(
        store=this.store, queue=this.queue, timers=this.timers, invoker=this.invoker, settings=this.settings
    )
    try:
        env.sync(app)
    finally:
        env.engine = this


@pytest.mark.parametrize("store", ["memory", "moto"])
def test_a_failed_confirm_read_after_a_differing_recheck_neither_loses_nor_repeats_a_step(store: str) -> None:
    ran: list[str] = []
    deploys: list[Any] = []
    env = rechecked(shop_release("a", ran, deploys), store)
    read = env.store.get_release
    failures: list[str] = []

    def flaky(function_id: str, *, consistent: bool = True) -> Any:
        # the confirm read (consistent, after an eventual one that named another release) fails once
        if consistent and failures == ["armed"]:
            failures.append("failed")
            raise StoreUnavailableError("throttled")
        release = read(function_id, consistent=consistent)
        if not consistent and release is not None and release.release_id == "r-b" and not failures:
            failures.append("armed")
        return release

    env.store.get_release = flaky  # type: ignore[method-assign]
    deploys.append(lambda: other_process_sync(env, shop_release("b", ran, deploys)))
    try:
        run = env.run("order")
        assert failures == ["armed", "failed"], failures
        assert run.outcome == "completed", run.summary
        assert Counter(ran) == Counter({"ship@a": 1, "receipt@b": 1}), ran
    finally:
        env.close()


@pytest.mark.parametrize("store", ["memory", "moto"])
def test_a_lagging_copy_naming_no_release_is_confirmed_not_used(store: str) -> None:
    ran: list[str] = []
    deploys: list[Any] = []
    env = rechecked(shop_release("b", ran, deploys), store)
    read = env.store.get_release
    lagged: list[bool] = []

    def lagging(function_id: str, *, consistent: bool = True) -> Any:
        if not consistent:
            lagged.append(True)
            return None
        return read(function_id, consistent=consistent)

    env.store.get_release = lagging  # type: ignore[method-assign]
    try:
        run = env.run("order")
        assert lagged and run.outcome == "completed" and ran == ["ship@b", "receipt@b"], ran
    finally:
        env.close()


@pytest.mark.parametrize("store", ["memory", "moto"])
def test_a_resync_of_the_same_release_id_with_a_new_build_is_taken(store: str) -> None:
    """Same release id, another build (a re-sync after a hotfix): the eventual read differs, is confirmed."""
    ran: list[str] = []
    deploys: list[Any] = []
    env = rechecked(shop_release("a", ran, deploys), store)
    b = shop_release("b", ran, deploys)
    b._release_id = "r-a"
    deploys.append(lambda: other_process_sync(env, b))
    try:
        run = env.run("order")
        assert run.outcome == "completed" and ran == ["ship@a", "receipt@b"], ran
    finally:
        env.close()


def refund_release(variant: str, refunds: list[Any], deploys: list[Any]) -> Ryusen:
    """Release a charges without a compensator; release b adds the refund (decisions 5: "adds a compensator to
    a completed step: used during unwind"). Ship fails for good; its callback runs what ``deploys`` holds."""
    app = Ryusen("shop", release_id=f"r-{variant}", build_id=f"b-{variant}")

    def ship() -> str:
        while deploys:
            deploys.pop()()
        raise ValueError("no courier")

    @app.function("order")
    def order(data: Any, step: Step) -> str:
        refund = (lambda c: refunds.append((variant, c))) if variant == "b" else None
        step.run("charge", lambda: {"charge_id": "ch_1"}, compensate=refund)
        step.run("ship", ship, retry=RetryPolicy(max_attempts=1))
        return "done"

    return app


def lagging_eventual_reads(env: WorkflowEnvironment) -> list[Any]:
    """Every eventually consistent read answers from a copy that has not seen the last sync (the release this
    process read first), as the change's own test_a_lagging_copy... and the simulator's SimStore do."""
    read = env.store.get_release
    first: list[Any] = []
    answered: list[Any] = []

    def lagging(function_id: str, *, consistent: bool = True) -> Any:
        if not first:
            first.append(read(function_id))
        if not consistent:
            answered.append(first[0].release_id if first[0] else None)
            return first[0]
        return read(function_id, consistent=consistent)

    env.store.get_release = lagging  # type: ignore[method-assign]
    return answered


@pytest.mark.parametrize("store", ["memory", "moto"])
def test_a_compensator_synced_through_another_process_before_the_unwind_is_used_through_lagging_rechecks(
    store: str,
) -> None:
    """Rechecked after every callback through copies that lag: b (adding the refund) is synced, and committed,
    while ship's callback runs, before the run fails: the unwind must ask b (R1, decisions 5), and refund once."""
    refunds: list[Any] = []
    deploys: list[Any] = []
    env = rechecked(refund_release("a", refunds, deploys), store)
    lagged = lagging_eventual_reads(env)
    deploys.append(lambda: other_process_sync(env, refund_release("b", refunds, deploys)))
    try:
        run = env.run("order")
        assert lagged and set(lagged) == {"r-a"}
        assert refunds == [("b", {"charge_id": "ch_1"})], (run.summary, refunds)
    finally:
        env.close()


@pytest.mark.parametrize("store", ["memory", "moto"])
def test_with_release_recheck_0_a_step_added_by_a_release_synced_through_another_process_runs(store: str) -> None:
    """The change's own harness (test_continuation's shop_release) with release_recheck_s=0 and lagging copies:
    0 reads consistently after every callback, as documented, so the step b adds runs."""
    ran: list[str] = []
    deploys: list[Any] = []
    env = WorkflowEnvironment(shop_release("a", ran, deploys), store=store)
    env.engine.settings = replace(env.engine.settings, release_recheck_s=0.0)
    lagging_eventual_reads(env)
    deploys.append(lambda: other_process_sync(env, shop_release("b", ran, deploys)))
    try:
        run = env.run("order")
        assert run.outcome == "completed" and ran == ["ship@a", "receipt@b"], ran
    finally:
        env.close()

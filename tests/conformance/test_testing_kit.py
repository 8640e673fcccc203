"""O5: ``ryusen.testing`` sees what a replay from the top sees (decisions 27).

A workflow whose next step depends on what a callback left in memory works while one execution of the
function serves the run (a kept pass) and fails after any replay from the top (another endpoint instance,
a restart, a transient error). The testing kit therefore replays every task from the top unless a test asks
for kept passes, and what one environment is asked for never reaches another.
"""

from __future__ import annotations

from typing import Any

import pytest

from ryusen import RetryPolicy, Ryusen, Step
from ryusen.testing import DiscoveryDivergenceError, WorkflowEnvironment


class OrdersApi:
    """A client that keeps its session token in memory, as many HTTP clients do."""

    def __init__(self) -> None:
        self.token: str | None = None

    def login(self) -> str:
        self.token = "tok-1"  # left in memory, not returned
        return "logged in"

    def fetch(self) -> dict[str, Any]:
        if self.token is None:
            raise PermissionError("401 Unauthorized: no session token")
        return {"orders": 3}


def orders_app(name: str = "orders") -> Ryusen:
    """``login`` stores a token on a client made outside ``step.run``; ``fetch`` uses it."""
    app = Ryusen(name)

    @app.function("sync-orders")
    def sync_orders(data: Any, step: Step) -> Any:
        api = OrdersApi()
        step.run("login", api.login)
        return step.run("fetch", api.fetch, retry=RetryPolicy(max_attempts=1))

    return app


def booking_app(name: str = "booking") -> Ryusen:
    """A choice between steps made from what a callback left in memory (check_discovery finds it)."""
    app = Ryusen(name)

    @app.function("book")
    def book(data: Any, step: Step) -> Any:
        found: dict[str, str] = {}

        def reserve() -> bool:
            found["confirmation"] = "CONF-1"
            return True

        step.run("reserve", reserve)
        if "confirmation" not in found:
            step.run("notify-desk", lambda: "paged")
        step.run("archive", lambda: "archived")
        return "booked"

    return app


def assert_fails_as_after_a_replay(run: Any) -> None:
    assert run.outcome == "failed", run.summary
    [fetch] = run.attempts("fetch")
    assert fetch["status"] == "failed" and "401 Unauthorized" in fetch["error"]["message"]


@pytest.mark.rfd("O5")
def test_by_default_a_step_that_needs_what_a_callback_left_in_memory_fails_as_after_a_replay() -> None:
    """The default environment replays every task from the top: fetch runs on a new client, without the token,
    as it does in production once the run's next attempt reaches another instance."""
    app = orders_app()
    with WorkflowEnvironment(app) as env:
        run = env.run("sync-orders")
    assert_fails_as_after_a_replay(run)
    assert app.kept_passes.started == 0 and app.kept_passes.resumed == 0


@pytest.mark.rfd("O5")
def test_kept_passes_are_an_explicit_option_and_a_replay_from_the_top_breaks_the_same_workflow() -> None:
    """With ``kept_passes=True`` one execution serves both steps and the run completes; the moment the
    instance that kept it is gone (before fetch's attempt), fetch replays from the top and fails."""
    kept = orders_app()
    with WorkflowEnvironment(kept, kept_passes=True) as env:
        warm = env.run("sync-orders")
    assert warm.outcome == "completed" and warm.output == {"orders": 3}
    assert kept.kept_passes.resumed == 1

    restarted = orders_app()
    with WorkflowEnvironment(restarted, kept_passes=True) as env:
        env.faults.before_invoke("fetch", restarted.kept_passes.clear)  # another instance serves fetch
        cold = env.run("sync-orders")
    assert_fails_as_after_a_replay(cold)


@pytest.mark.rfd("O5")
def test_check_discovery_works_with_kept_passes() -> None:
    with (
        WorkflowEnvironment(booking_app(), kept_passes=True, check_discovery=True) as env,
        pytest.raises(DiscoveryDivergenceError, match="after step 'reserve'") as caught,
    ):
        env.run("book")
    assert "'archive'" in str(caught.value) and "'notify-desk'" in str(caught.value)


@pytest.mark.rfd("O5")
def test_options_of_one_environment_never_reach_another_serving_the_same_app() -> None:
    """One app object (as a module-level app is) served by environments in turn: each gets what it asked for,
    whatever the one before it asked."""
    app = orders_app()
    with WorkflowEnvironment(app, kept_passes=False) as env:
        assert_fails_as_after_a_replay(env.run("sync-orders"))
    with WorkflowEnvironment(app, kept_passes=True) as env:
        warm = env.run("sync-orders")
    assert warm.outcome == "completed" and app.kept_passes.resumed == 1  # the first did not turn them off
    with WorkflowEnvironment(app) as env:
        assert_fails_as_after_a_replay(env.run("sync-orders"))
    assert app.kept_passes.resumed == 1  # nor did the second leave them on

    booking = booking_app()
    with (
        WorkflowEnvironment(booking, kept_passes=True, check_discovery=True) as env,
        pytest.raises(DiscoveryDivergenceError),
    ):
        env.run("book")
    with WorkflowEnvironment(booking, kept_passes=True) as env:  # no check asked for here
        run = env.run("book")
    assert run.outcome == "completed" and [s["id"] for s in run.steps] == ["reserve", "archive", "notify-desk"]


@pytest.mark.rfd("O5")
def test_two_environments_at_once_serve_one_app_each_as_asked() -> None:
    app = orders_app()
    with WorkflowEnvironment(app, kept_passes=True) as warm_env, WorkflowEnvironment(app) as cold_env:
        cold = cold_env.run("sync-orders")
        warm = warm_env.run("sync-orders")
    assert_fails_as_after_a_replay(cold)
    assert warm.outcome == "completed" and warm.output == {"orders": 3}

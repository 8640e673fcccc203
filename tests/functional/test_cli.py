"""The ``ryusen`` command line against a fake server API (httpx.MockTransport), and ``render_run`` on run views."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.abc import MetaPathFinder
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result
from rich.console import Console

from ryusen import NonRetryableError, RetryPolicy, Ryusen, Step
from ryusen._internal import client as client_module
from ryusen.testing import WorkflowEnvironment
from ryusen_server import cli
from tests.stack import DevStack, launch

SERVER = "http://127.0.0.1:8700"
APP_URL = "http://127.0.0.1:9123/"

Handler = Callable[[httpx.Request], httpx.Response]


@dataclass
class Seen:
    method: str
    url: httpx.URL
    body: Any
    headers: httpx.Headers

    @property
    def path(self) -> str:
        return self.url.raw_path.decode().split("?")[0]

    @property
    def query(self) -> dict[str, str]:
        return dict(self.url.params)


@dataclass
class FakeServer:
    """Routes ``(method, absolute url without query)`` to queued responses; records every request."""

    routes: dict[tuple[str, str], list[Handler | httpx.Response]] = field(default_factory=dict)
    requests: list[Seen] = field(default_factory=list)

    def on(self, method: str, path: str, *responses: Handler | httpx.Response | Any, status: int = 200) -> None:
        url = path if path.startswith("http") else SERVER + path
        queued = self.routes.setdefault((method, url), [])
        for response in responses:
            if isinstance(response, httpx.Response) or callable(response):
                queued.append(response)
            else:
                queued.append(httpx.Response(status, json=response))

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append(Seen(request.method, request.url, body, request.headers))
        url = str(request.url.copy_with(query=None))
        queued = self.routes.get((request.method, url))
        if not queued:
            return httpx.Response(
                404, json={"error": {"code": "route_not_found", "message": f"no route {request.method} {url}"}}
            )
        response = queued.pop(0) if len(queued) > 1 else queued[0]
        return response(request) if callable(response) else response


@pytest.fixture(autouse=True)
def _no_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # output that is not a terminal renders 100 columns wide


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> FakeServer:
    fake = FakeServer()
    real = cli.make_client
    monkeypatch.setattr(cli, "make_client", lambda url: real(url, transport=httpx.MockTransport(fake.handle)))
    monkeypatch.delenv("RYUSEN_URL", raising=False)
    return fake


@dataclass
class FakeClock:
    now: float = 1000.0
    sleeps: list[float] = field(default_factory=list)

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(round(seconds, 3))
        self.now += seconds

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(client_module, "sleep", fake.sleep)  # the CLI waits through ryusen.Client
    monkeypatch.setattr(client_module, "clock", fake)
    return fake


def ryusen(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli.cli, list(args), env=env, prog_name="ryusen")


def error(code: str, message: str, status: int) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message}})


# --- run views built by hand -------------------------------------------------------------------------------------


def attempt(phase: str, generation: int, status: str, at: str, until: str | None, **extra: Any) -> dict[str, Any]:
    return {
        "phase": phase,
        "generation": generation,
        "operation_id": f"op_{phase[:4]}_{generation}",
        "status": status,
        "queued_at": f"2030-01-01T12:00:{at}+00:00",
        "not_before": None,
        "authorized_at": f"2030-01-01T12:00:{at}+00:00",
        "settled_at": f"2030-01-01T12:00:{until}+00:00" if until else None,
        "release_id": "shop-abc",
        "build_id": "b1",
        "error": None,
        "detail": None,
        "redeliveries": 0,
        "stale_submissions": [],
        **extra,
    }


def step(step_id: str, status: str, location: str, attempts: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "id": step_id,
        "name": None,
        "location": location,
        "status": status,
        "has_compensation": True,
        "result": None,
        "error": None,
        "completed_seq": None,
        "compensation": {"status": "none", "result": None, "error": None},
        "attempts": attempts,
        **extra,
    }


def run_view(**overrides: Any) -> dict[str, Any]:
    view: dict[str, Any] = {
        "id": "run_1",
        "app_id": "shop",
        "function_id": "checkout",
        "phase": "running",
        "outcome": None,
        "recovery": None,
        "summary": "running",
        "input": {"sku": "lamp", "amount": 30},
        "output": None,
        "error": None,
        "created_at": "2030-01-01T12:00:00+00:00",
        "finished_at": None,
        "deadline": {"at": "2030-01-01T13:00:00+00:00", "source": "function"},
        "stop_intent": None,
        "blockers": [],
        "steps": [],
        "unwind": [],
    }
    view.update(overrides)
    return view


def saga_view() -> dict[str, Any]:
    """A failed checkout whose unwind is blocked on an Unknown compensation attempt."""
    connection = {"type": "ConnectionError", "message": "card network timed out", "data": None}
    declined = {"type": "NonRetryableError", "message": "card declined", "data": {"decline_code": "stolen"}}
    return run_view(
        phase="compensating",
        outcome="failed",
        recovery="compensating",
        summary="failed, compensating (blocked: unknown outcome of reserve-stock compensation #1)",
        error={"type": "StepFailed", "message": "step 'charge-card' failed: card declined", "data": None},
        blockers=[
            {
                "type": "unknown_outcome",
                "step_id": "reserve-stock",
                "phase": "compensation",
                "generation": 1,
                "message": "unknown outcome of reserve-stock compensation #1",
                "detail": "no response within 30 s",
                "count": 3,
                "first_seen_at": "2030-01-01T12:00:04.100000+00:00",
                "last_seen_at": "2030-01-01T12:00:09.300000+00:00",
            }
        ],
        steps=[
            step(
                "reserve-stock",
                "completed",
                "shop.py:12",
                [
                    attempt("forward", 1, "succeeded", "01.2", "01.5"),
                    attempt("compensation", 1, "unknown", "04.0", None, detail="no response within 30 s"),
                ],
                result={"hold": "h_77"},
                completed_seq=1,
                compensation={"status": "unknown", "result": None, "error": None},
            ),
            step(
                "book-shipping",
                "completed",
                "shop.py:14",
                [
                    attempt("forward", 1, "succeeded", "01.6", "01.7"),
                    attempt("compensation", 1, "failed", "03.0", "03.1", error=connection),
                    attempt("compensation", 2, "succeeded", "03.6", "03.8", release_id="shop-def"),
                ],
                result={"label": "L9"},
                completed_seq=2,
                compensation={"status": "compensated", "result": {"voided": "L9"}, "error": None},
            ),
            step(
                "charge-card",
                "failed",
                "shop.py:15",
                [
                    attempt("forward", 1, "failed", "01.8", "02.0", error=connection),
                    attempt("forward", 2, "failed", "02.4", "02.9", error=declined, redeliveries=1),
                ],
                error=declined,
            ),
        ],
        unwind=[
            {"step_id": "book-shipping", "status": "compensated"},
            {"step_id": "reserve-stock", "status": "unknown"},
        ],
    )


def rendered(view: dict[str, Any], width: int = 100) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    cli.render_run(view, console=console)
    return console.export_text()


# --- requests and output ----------------------------------------------------------------------------------------


def test_sync_reads_the_app_id_from_the_manifest_then_puts_the_release(server: FakeServer) -> None:
    server.on("GET", APP_URL, {"app_id": "shop", "release_id": "shop-abc", "build_id": "b1", "functions": []})
    server.on(
        "PUT",
        "/v1/apps/shop",
        {
            "app_id": "shop",
            "release_id": "shop-abc",
            "build_id": "b1",
            "functions": [{"id": "checkout"}],
            "signed": True,
        },
    )
    result = ryusen("sync", APP_URL)
    assert result.exit_code == 0, result.output
    assert [(r.method, str(r.url)) for r in server.requests] == [("GET", APP_URL), ("PUT", SERVER + "/v1/apps/shop")]
    assert server.requests[1].body == {"url": APP_URL}
    assert "synced app shop: release shop-abc" in result.stdout and "checkout" in result.stdout


def test_sync_with_app_skips_the_manifest(server: FakeServer) -> None:
    server.on("PUT", "/v1/apps/shop", {"app_id": "shop", "release_id": "r2", "build_id": "b2", "functions": []})
    result = ryusen("sync", APP_URL, "--app", "shop")
    assert result.exit_code == 0, result.output
    assert [(r.method, r.path, r.body) for r in server.requests] == [("PUT", "/v1/apps/shop", {"url": APP_URL})]


def test_sync_explains_an_endpoint_that_serves_no_manifest(server: FakeServer) -> None:
    server.on("GET", APP_URL, httpx.Response(200, text="<html>hello</html>"))
    result = ryusen("sync", APP_URL)
    assert result.exit_code == 1
    assert "--app" in result.stderr
    assert all(r.method == "GET" for r in server.requests)


def test_run_posts_the_input_key_and_timeout(server: FakeServer) -> None:
    server.on("POST", "/v1/functions/checkout/runs", run_view(), status=201)
    result = ryusen(
        "run", "checkout", "--input", '{"sku": "lamp", "qty": 1}', "--idempotency-key", "order-7", "--timeout", "90"
    )
    assert result.exit_code == 0, result.output
    [request] = server.requests
    assert (request.method, request.path) == ("POST", "/v1/functions/checkout/runs")
    assert request.body == {"input": {"sku": "lamp", "qty": 1}, "idempotency_key": "order-7", "timeout_s": 90.0}
    assert "started run_1" in result.stdout and "ryusen show run_1" in result.stdout


def test_run_sends_only_the_input_when_nothing_else_is_given(server: FakeServer) -> None:
    server.on("POST", "/v1/functions/checkout/runs", run_view(), status=200)
    result = ryusen("run", "checkout", "--input", "null")
    assert result.exit_code == 0, result.output
    assert server.requests[0].body == {"input": None}
    assert "existing run" in result.stdout  # 200: the idempotency key named an existing run


@pytest.mark.parametrize(
    "args",
    [
        ["run", "checkout", "--input", "{sku: lamp}"],
        ["run", "checkout", "--input", ""],
        ["resolve", "run_1", "charge", "--phase", "forward", "--generation", "1", "--succeed", "{oops"],
        ["resolve", "run_1", "charge", "--phase", "forward", "--generation", "1"],
        ["resolve", "run_1", "charge", "--phase", "forward", "--generation", "1", "--retry", "--fail", "x"],
        ["resolve", "run_1", "charge", "--phase", "forward", "--generation", "1", "--retry", "--final"],
        ["resolve", "run_1", "charge", "--phase", "sideways", "--generation", "1", "--retry"],
        ["resolve", "run_1", "charge", "--phase", "forward", "--generation", "0", "--retry"],
        ["runs", "--phase", "done"],
    ],
)
def test_bad_arguments_are_usage_errors_and_send_nothing(server: FakeServer, args: list[str]) -> None:
    result = ryusen(*args)
    assert result.exit_code == 2, result.output
    assert server.requests == []


def test_run_without_input_starts_the_function_with_null(server: FakeServer) -> None:
    server.on("POST", "/v1/functions/checkout/runs", run_view(), status=201)
    result = ryusen("run", "checkout")
    assert result.exit_code == 0, result.output
    assert server.requests[0].body == {"input": None}


def test_apps_and_functions_list_what_is_synced(server: FakeServer) -> None:
    release = {"release_id": "shop-abc", "build_id": "abc", "url": APP_URL, "synced_at": "2030-01-01T12:00:00+00:00"}
    server.on("GET", "/v1/apps", {"apps": [{"app_id": "shop", **release, "signed": True, "functions": ["checkout"]}]})
    server.on(
        "GET",
        "/v1/functions",
        {"functions": [{"id": "checkout", "app_id": "shop", "timeout_s": 3600, "release": release}]},
    )
    apps = ryusen("apps")
    assert apps.exit_code == 0, apps.output
    assert "shop" in apps.stdout and "shop-abc" in apps.stdout and "checkout" in apps.stdout
    functions = ryusen("functions")
    assert functions.exit_code == 0, functions.output
    assert "checkout" in functions.stdout and "3600 s" in functions.stdout and "shop-abc" in functions.stdout
    assert json.loads(ryusen("functions", "--json").stdout)["functions"][0]["id"] == "checkout"


def test_a_prefix_of_a_recent_runs_id_names_it(server: FakeServer) -> None:
    full = "run_0123456789abcdef0123456789abcdef"
    server.on("GET", "/v1/runs/0123456789abcdef", error("not_found", "no run 0123456789abcdef", 404))
    server.on("GET", "/v1/runs", {"runs": [{"id": "run_ffff"}, {"id": full}], "cursor": None})
    server.on("GET", f"/v1/runs/{full}", run_view(id=full))
    result = ryusen("show", "0123456789abcdef")
    assert result.exit_code == 0, result.output
    assert full in result.stdout
    assert [r.url.path for r in server.requests] == ["/v1/runs/0123456789abcdef", "/v1/runs", f"/v1/runs/{full}"]


def test_an_ambiguous_or_unknown_prefix_is_refused(server: FakeServer) -> None:
    server.on("GET", "/v1/runs/run_0123", error("not_found", "no run", 404))
    short = ryusen("show", "run_0123")
    assert short.exit_code == 1 and "not_found" in short.stderr  # too short to look up: the API's answer
    server.on("POST", "/v1/runs/run_0123456/cancel", error("not_found", "no run", 404))
    server.on("GET", "/v1/runs", {"runs": [{"id": "run_0123456a"}, {"id": "run_0123456b"}], "cursor": None})
    ambiguous = ryusen("cancel", "run_0123456")
    assert ambiguous.exit_code == 1 and "more than one run" in ambiguous.stderr
    server.on("GET", "/v1/runs/run_abcdef12", error("not_found", "no run", 404))
    unknown = ryusen("show", "run_abcdef12")
    assert unknown.exit_code == 1 and "no run's id starts with it" in unknown.stderr
    assert [r.method for r in server.requests].count("POST") == 1  # the cancel, refused: nothing was cancelled


def test_resolve_without_the_attempt_acts_on_the_steps_one_blocker(server: FakeServer) -> None:
    blocked = run_view(blockers=[{"type": "unknown_outcome", "step_id": "charge", "phase": "forward", "generation": 3}])
    server.on("GET", "/v1/runs/run_1", blocked)
    server.on("POST", "/v1/runs/run_1/steps/charge/forward/3/resolve", run_view(summary="running"))
    result = ryusen("resolve", "run_1", "charge", "--fail", "declined", "--final", "--reason", "bank said so")
    assert result.exit_code == 0, result.output
    assert "resolved charge forward #3 (fail)" in result.stdout
    assert server.requests[-1].body == {
        "action": "fail",
        "error": {"type": "declared_failure", "message": "declined", "retryable": False},
        "reason": "bank said so",
    }
    none = ryusen("resolve", "run_1", "ship", "--retry")
    assert none.exit_code == 1 and "no blocker on step 'ship'" in none.stderr and "--phase" in none.stderr


def test_resolve_without_the_attempt_follows_the_blocker_a_probe_moved_on(server: FakeServer) -> None:
    """The blocked run's probe fenced generation 1 and names 2 in the blocker between the CLI's read and its
    resolve: the step's blocker is what was meant, so the CLI resolves generation 2."""

    def blocked(generation: int) -> dict[str, Any]:
        blocker = {"type": "new_step_before_target", "step_id": "book", "phase": "compensation"}
        return run_view(blockers=[{**blocker, "generation": generation}])

    server.on("GET", "/v1/runs/run_1", blocked(1), blocked(2))
    server.on(
        "POST", "/v1/runs/run_1/steps/book/compensation/1/resolve", error("generation_settled", "it is fenced", 409)
    )
    server.on("POST", "/v1/runs/run_1/steps/book/compensation/2/resolve", run_view(summary="compensating"))
    result = ryusen("resolve", "run_1", "book", "--succeed", '{"undone": "by hand"}')
    assert result.exit_code == 0, result.output
    assert "resolved book compensation #2 (succeed)" in result.stdout


def test_show_follow_prints_the_run_again_as_it_changes_until_it_finishes(server: FakeServer, clock: FakeClock) -> None:
    running = run_view()
    finished = run_view(phase="finished", outcome="completed", summary="completed", output={"ok": True})
    server.on("GET", "/v1/runs/run_1", running, running, running, finished)
    result = ryusen("show", "run_1", "--follow")
    assert result.exit_code == 0, result.output
    assert result.stdout.count("run_1") >= 2 and "completed" in result.stdout
    assert len(server.requests) == 4 and clock.sleeps == [1.0, 1.0, 1.0]


def test_bad_input_json_says_what_is_wrong(server: FakeServer) -> None:
    result = ryusen("run", "checkout", "--input", "{sku: lamp}")
    assert result.exit_code == 2
    assert "--input" in result.stderr and "not valid JSON" in result.stderr


def test_run_wait_polls_until_finished_with_a_growing_interval(server: FakeServer, clock: FakeClock) -> None:
    server.on("POST", "/v1/functions/checkout/runs", run_view(), status=201)
    finished = run_view(
        phase="finished",
        outcome="completed",
        summary="completed",
        finished_at="2030-01-01T12:00:03+00:00",
        output={"charge": "ch_1"},
    )
    running = [run_view(steps=[step("reserve-stock", "running", "shop.py:12", [])]) for _ in range(5)]
    server.on("GET", "/v1/runs/run_1", run_view(), *running, finished)
    result = ryusen("run", "checkout", "--input", "{}", "--wait")
    assert result.exit_code == 0, result.output
    polls = [r for r in server.requests if r.method == "GET"]
    assert len(polls) == 7
    assert clock.sleeps[0] == 0.2 and clock.sleeps == sorted(clock.sleeps) and max(clock.sleeps) == 1.0
    assert "completed" in result.stdout and "ch_1" in result.stdout


def test_run_wait_exits_1_when_the_run_does_not_complete(server: FakeServer, clock: FakeClock) -> None:
    server.on("POST", "/v1/functions/checkout/runs", run_view(), status=201)
    failed = run_view(
        phase="finished",
        outcome="failed",
        recovery="not_required",
        summary="failed, compensation not required",
        error={"type": "ValueError", "message": "no such sku", "data": None},
    )
    server.on("GET", "/v1/runs/run_1", failed)
    result = ryusen("run", "checkout", "--input", "{}", "--wait")
    assert result.exit_code == 1
    assert "failed, compensation not required" in result.stdout and "ValueError: no such sku" in result.stdout


def test_run_wait_stops_when_a_blocked_run_does_not_move(server: FakeServer, clock: FakeClock) -> None:
    server.on("POST", "/v1/functions/checkout/runs", run_view(), status=201)
    server.on("GET", "/v1/runs/run_1", run_view(), saga_view())
    result = ryusen("run", "checkout", "--input", "{}", "--wait", "--wait-timeout", "600")
    assert result.exit_code == 1
    assert "BLOCKED" in result.stdout and "blocked" in result.stderr
    assert clock.now - 1000.0 < 10  # stopped soon after the run stopped moving, not at --wait-timeout


def test_run_wait_gives_up_at_the_wait_timeout_with_exit_2(server: FakeServer, clock: FakeClock) -> None:
    server.on("POST", "/v1/functions/checkout/runs", run_view(), status=201)
    server.on("GET", "/v1/runs/run_1", run_view())
    result = ryusen("run", "checkout", "--input", "{}", "--wait", "--wait-timeout", "5")
    assert result.exit_code == 2
    assert "did not finish within 5 s" in result.stderr
    assert 5.0 <= clock.now - 1000.0 < 6.5


def test_runs_lists_a_table_with_the_filters_as_query(server: FakeServer) -> None:
    summaries = [
        {
            "id": "run_b",
            "function_id": "checkout",
            "phase": "finished",
            "outcome": "failed",
            "recovery": "compensated",
            "summary": "failed, fully compensated",
            "created_at": "2030-01-01T12:01:00+00:00",
            "finished_at": "2030-01-01T12:01:05+00:00",
            "steps": 3,
            "blocked": False,
        },
        {
            "id": "run_a",
            "function_id": "checkout",
            "phase": "settling",
            "outcome": "cancelled",
            "recovery": None,
            "summary": "cancelled, settling",
            "created_at": "2030-01-01T12:00:00+00:00",
            "finished_at": None,
            "steps": 2,
            "blocked": True,
        },
    ]
    server.on("GET", "/v1/runs", {"runs": summaries, "cursor": "c2"})
    result = ryusen("runs", "--function", "checkout", "--phase", "finished", "--outcome", "failed", "--limit", "5")
    assert result.exit_code == 0, result.output
    assert server.requests[0].query == {
        "function_id": "checkout",
        "phase": "finished",
        "outcome": "failed",
        "limit": "5",
    }
    lines = result.stdout.splitlines()
    assert "RUN" in lines[0] and "SUMMARY" in lines[0]
    assert any("run_b" in line and "failed, fully compensated" in line for line in lines)
    assert any("run_a" in line and "(blocked)" in line for line in lines)
    assert "--cursor c2" in result.stdout
    assert max(len(line) for line in lines) <= 100


def test_runs_says_when_there_are_none(server: FakeServer) -> None:
    server.on("GET", "/v1/runs", {"runs": [], "cursor": None})
    result = ryusen("runs")
    assert result.exit_code == 0
    assert server.requests[0].query == {"limit": "20"}
    assert "no runs" in result.stdout


def test_show_renders_the_timeline_and_json_prints_the_view(server: FakeServer) -> None:
    server.on("GET", "/v1/runs/run_1", saga_view())
    result = ryusen("show", "run_1")
    assert result.exit_code == 0, result.output
    assert "BLOCKED" in result.stdout and "\x1b[" not in result.stdout  # no colour when not a terminal
    result = ryusen("show", "run_1", "--json")
    assert json.loads(result.stdout) == saga_view()


def test_cancel_posts_the_stop_intent(server: FakeServer) -> None:
    server.on("POST", "/v1/runs/run_1/cancel", run_view(summary="cancelled, settling"), status=202)
    result = ryusen("cancel", "run_1")
    assert result.exit_code == 0, result.output
    assert [(r.method, r.path, r.body) for r in server.requests] == [("POST", "/v1/runs/run_1/cancel", None)]
    assert "cancelled, settling" in result.stdout
    ryusen("cancel", "run_1", "--reason", "customer asked")
    assert server.requests[1].body == {"reason": "customer asked"}


def test_rediscover_posts(server: FakeServer) -> None:
    server.on("POST", "/v1/runs/run_1/rediscover", run_view(), status=202)
    result = ryusen("rediscover", "run_1")
    assert result.exit_code == 0, result.output
    assert [(r.method, r.path) for r in server.requests] == [("POST", "/v1/runs/run_1/rediscover")]


@pytest.mark.parametrize(
    ("action", "body"),
    [
        (["--succeed", '{"charge_id": "ch_1"}'], {"action": "succeed", "result": {"charge_id": "ch_1"}}),
        (["--succeed", "null"], {"action": "succeed", "result": None}),
        (
            ["--fail", "the bank never saw it"],
            {
                "action": "fail",
                "error": {"type": "declared_failure", "message": "the bank never saw it", "retryable": True},
            },
        ),
        (
            ["--fail", "card blocked", "--final", "--reason", "the bank confirmed"],
            {
                "action": "fail",
                "error": {"type": "declared_failure", "message": "card blocked", "retryable": False},
                "reason": "the bank confirmed",
            },
        ),
        (["--retry"], {"action": "retry"}),
        (["--skip", "--reason", "refunded by hand"], {"action": "skip", "reason": "refunded by hand"}),
    ],
)
def test_resolve_posts_the_action(server: FakeServer, action: list[str], body: dict[str, Any]) -> None:
    path = "/v1/runs/run_1/steps/charge-card/compensation/2/resolve"
    server.on("POST", path, run_view())
    result = ryusen("resolve", "run_1", "charge-card", "--phase", "compensation", "--generation", "2", *action)
    assert result.exit_code == 0, result.output
    assert [(r.method, r.path, r.body) for r in server.requests] == [("POST", path, body)]


def test_path_segments_are_quoted(server: FakeServer) -> None:
    result = ryusen("resolve", "run_1", "a/b c", "--phase", "forward", "--generation", "1", "--retry")
    assert result.exit_code == 1
    assert server.requests[0].path == "/v1/runs/run_1/steps/a%2Fb%20c/forward/1/resolve"


# --- errors --------------------------------------------------------------------------------------------------------


def test_a_404_prints_the_code_and_message(server: FakeServer) -> None:
    server.on("GET", "/v1/runs/nope", error("not_found", "no run 'nope'", 404))
    result = ryusen("show", "nope")
    assert result.exit_code == 1
    assert result.stderr.strip() == "error: not_found: no run 'nope'"
    assert result.stdout == ""


def test_a_409_prints_the_reason(server: FakeServer) -> None:
    path = "/v1/runs/run_1/steps/charge-card/forward/1/resolve"
    server.on("POST", path, error("generation_settled", "generation 1 is already succeeded; nothing to resolve", 409))
    result = ryusen("resolve", "run_1", "charge-card", "--phase", "forward", "--generation", "1", "--retry")
    assert result.exit_code == 1
    assert "error: generation_settled: generation 1 is already succeeded" in result.stderr


def test_an_error_that_is_not_the_api_shape_still_says_something(server: FakeServer) -> None:
    server.on("GET", "/v1/runs/run_1", httpx.Response(502, text="Bad Gateway"))
    server.on("GET", "/v1/runs/run_2", httpx.Response(403, json={"message": "Missing Authentication Token"}))
    assert ryusen("show", "run_1").stderr.strip() == "error: HTTP 502: Bad Gateway"
    assert ryusen("show", "run_2").stderr.strip() == "error: HTTP 403: Missing Authentication Token"


def test_connection_refused_hints_at_ryusen_dev(server: FakeServer) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    server.on("GET", "/v1/runs", refuse)
    result = ryusen("runs")
    assert result.exit_code == 1
    assert "cannot connect to http://127.0.0.1:8700" in result.stderr and "ryusen dev" in result.stderr


def test_a_server_that_is_not_a_url_is_a_usage_error(server: FakeServer) -> None:
    result = ryusen("--server", "127.0.0.1:8700", "runs")
    assert result.exit_code == 2 and "--server" in result.stderr
    assert server.requests == []


def test_sync_cannot_reach_the_app(server: FakeServer) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    server.on("GET", APP_URL, refuse)
    result = ryusen("sync", APP_URL)
    assert result.exit_code == 1
    assert f"cannot read the manifest at {APP_URL}: cannot connect to {APP_URL}" in result.stderr
    assert "ryusen dev" not in result.stderr


def test_the_server_comes_from_the_option_or_ryusen_url(server: FakeServer) -> None:
    server.on("GET", "http://127.0.0.1:9999/v1/runs/run_1", run_view())
    assert ryusen("--server", "http://127.0.0.1:9999", "show", "run_1").exit_code == 0
    assert ryusen("show", "run_1", env={"RYUSEN_URL": "http://127.0.0.1:9999/"}).exit_code == 0
    assert [str(r.url) for r in server.requests] == ["http://127.0.0.1:9999/v1/runs/run_1"] * 2


# --- signing -------------------------------------------------------------------------------------------------------


@pytest.fixture
def aws_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "session-token")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def test_a_deployed_server_is_called_with_sigv4(server: FakeServer, aws_credentials: None) -> None:
    api = "https://abc123.execute-api.eu-west-1.amazonaws.com/prod"
    server.on("GET", APP_URL, {"app_id": "shop"})
    server.on("PUT", api + "/v1/apps/shop", {"app_id": "shop", "release_id": "r", "build_id": "b", "functions": []})
    result = ryusen("--server", api, "sync", APP_URL)
    assert result.exit_code == 0, result.output
    manifest, put = server.requests
    assert put.path == "/prod/v1/apps/shop"
    authorization = put.headers["authorization"]
    assert authorization.startswith("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/")
    assert "/eu-west-1/execute-api/aws4_request" in authorization
    assert "SignedHeaders=host;x-amz-date;x-amz-security-token" in authorization
    assert put.headers["x-amz-security-token"] == "session-token" and "x-amz-date" in put.headers
    assert "authorization" not in manifest.headers  # the app's endpoint is another origin: never signed


def test_the_region_falls_back_to_the_api_hostname(
    server: FakeServer, aws_credentials: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    api = "https://abc123.execute-api.ap-south-1.amazonaws.com"
    server.on("GET", api + "/v1/runs/run_1", run_view())
    assert ryusen("--server", api, "show", "run_1").exit_code == 0
    assert "/ap-south-1/execute-api/" in server.requests[0].headers["authorization"]


def test_the_region_in_the_api_url_wins_over_the_environment(server: FakeServer, aws_credentials: None) -> None:
    api = "https://abc123.execute-api.ap-northeast-1.amazonaws.com/prod"  # AWS_REGION says eu-west-1
    server.on("GET", api + "/v1/runs/run_1", run_view())
    assert ryusen("--server", api, "show", "run_1").exit_code == 0
    assert "/ap-northeast-1/execute-api/" in server.requests[0].headers["authorization"]


def test_a_loopback_server_is_called_unsigned(server: FakeServer, aws_credentials: None) -> None:
    for url in ("http://127.0.0.1:8700", "http://localhost:8700", "http://[::1]:8700"):
        server.on("GET", url + "/v1/runs/run_1", run_view())
        assert ryusen("--server", url, "show", "run_1").exit_code == 0
    assert [r.headers.get("authorization") for r in server.requests] == [None, None, None]


def test_missing_aws_credentials_are_a_clear_error(
    server: FakeServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    result = ryusen("--server", "https://api.example.com", "show", "run_1")
    assert result.exit_code == 1
    assert "no AWS credentials" in result.stderr
    assert server.requests == []


# --- ryusen dev ----------------------------------------------------------------------------------------------------


def test_dev_delegates_to_run_dev(monkeypatch: pytest.MonkeyPatch) -> None:
    from ryusen_server.local import dev

    calls: list[dict[str, Any]] = []

    def run_dev(**kwargs: Any) -> int:
        calls.append(kwargs)
        return 0

    monkeypatch.setattr(dev, "run_dev", run_dev)
    assert ryusen("dev", "examples/shop.py:app", "pkg.mod:app", env={"RYUSEN_DEV_DATA": None}).exit_code == 0
    assert ryusen("dev", "--port", "9001", "--data", "/tmp/d", "--fresh").exit_code == 0
    assert calls == [
        {"port": 8700, "apps": ["examples/shop.py:app", "pkg.mod:app"], "data": Path(".ryusen"), "fresh": False},
        {"port": 9001, "apps": [], "data": Path("/tmp/d"), "fresh": True},
    ]


def test_dev_without_the_local_extra_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoMoto(MetaPathFinder):
        def find_spec(self, name: str, path: Any, target: Any = None) -> None:
            if name == "ryusen_server.local.dev":
                raise ModuleNotFoundError("No module named 'moto'", name="moto")

    import ryusen_server.local

    monkeypatch.delitem(sys.modules, "ryusen_server.local.dev", raising=False)
    monkeypatch.delattr(ryusen_server.local, "dev", raising=False)
    monkeypatch.setattr(sys, "meta_path", [NoMoto(), *sys.meta_path])
    result = ryusen("dev")
    assert result.exit_code == 1
    assert "pip install 'ryusen[local]'" in result.stderr


def test_dev_reports_the_local_extra_missing_when_the_stack_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from ryusen_server.local import dev

    def run_dev(**kwargs: Any) -> int:
        raise ModuleNotFoundError("No module named 'watchfiles'", name="watchfiles")

    monkeypatch.setattr(dev, "run_dev", run_dev)
    result = ryusen("dev")
    assert result.exit_code == 1
    assert "'watchfiles'" in result.stderr and "pip install 'ryusen[local]'" in result.stderr


# --- render_run ----------------------------------------------------------------------------------------------------


def test_render_run_shows_header_blocker_timeline_unwind_and_error() -> None:
    text = rendered(saga_view())
    lines = text.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 100
    # header
    assert "run_1" in lines[0] and "checkout" in lines[0]
    assert "failed, compensating (blocked: unknown outcome of reserve-stock compensation #1)" in text
    assert "phase compensating · outcome failed · recovery compensating" in text
    assert "deadline 2030-01-01 13:00:00.0 UTC (the function's timeout)" in text
    assert 'input {"sku": "lamp", "amount": 30}' in text
    # the blocker, with what to do about it
    assert "BLOCKED (1)" in text
    assert "unknown_outcome: unknown outcome of reserve-stock compensation #1" in text
    assert "cause: no response within 30 s" in text
    assert "seen 3 times, last seen 12:00:09.3" in text
    assert "ryusen resolve run_1 reserve-stock --phase compensation --generation 1" in text
    # steps in discovery order, forward attempts under each
    steps_at = text.index("Steps (3")
    unwind_at = text.index("Unwind")
    steps, unwind = text[steps_at:unwind_at], text[unwind_at:]
    assert steps.index("reserve-stock") < steps.index("book-shipping") < steps.index("charge-card")
    assert "shop.py:15" in steps
    charge = [line for line in steps.splitlines() if line.strip().startswith("forward #")][-2:]
    assert "failed" in charge[0] and "12:00:01.8 → 12:00:02.0" in charge[0]
    assert "ConnectionError: card network timed out" in charge[0]
    assert "forward #2" in charge[1] and "NonRetryableError: card declined" in charge[1]
    assert "redelivered once" in steps[steps.index("forward #2") :]
    assert "release shop-abc" in steps
    assert 'result {"hold": "h_77"}' in steps
    assert "compensation #" not in steps  # compensation attempts belong to the unwind
    # the unwind in unwind order, with compensation status and attempts
    assert unwind.index("book-shipping") < unwind.index("reserve-stock")
    assert "compensated" in unwind and '→ {"voided": "L9"}' in unwind
    assert "compensation #1  failed" in unwind and "compensation #2  succeeded" in unwind
    assert "release shop-def" in unwind  # the release changed between attempts
    assert "12:00:04.0 → …" in unwind and "no response within 30 s" in unwind
    # the error last
    assert lines[-1].startswith("Error") and "StepFailed: step 'charge-card' failed: card declined" in lines[-1]


def test_render_run_shows_duplicate_step_id_locations_and_a_completed_output() -> None:
    blocked = run_view(
        summary="running (blocked: step id 'charge' is used twice)",
        blockers=[
            {
                "type": "duplicate_step_id",
                "step_id": "charge",
                "message": "step id 'charge' is used twice",
                "count": 1,
                "first": {"location": "shop.py:12", "name": "charge_card"},
                "duplicate": {"location": "shop.py:20", "name": "charge_fee"},
                "first_seen_at": "2030-01-01T12:00:01+00:00",
                "last_seen_at": "2030-01-01T12:00:01+00:00",
            }
        ],
        deadline={"at": None, "source": "none"},
    )
    text = rendered(blocked)
    assert "duplicate_step_id: step id 'charge' is used twice" in text
    assert "first call at shop.py:12  charge_card" in text and "duplicate call at shop.py:20  charge_fee" in text
    assert "ryusen rediscover run_1" in text and "no deadline" in text
    assert "Unwind" not in text  # nothing decided yet
    completed = run_view(
        phase="finished",
        outcome="completed",
        summary="completed",
        output={"charge": {"charge_id": "ch_1"}},
        steps=[step("charge", "completed", "shop.py:12", [attempt("forward", 1, "succeeded", "01.0", "01.4")])],
    )
    text = rendered(completed)
    assert "Output" in text and '"charge_id": "ch_1"' in text and "Unwind" not in text


def test_render_run_of_a_view_the_engine_made() -> None:
    """The field names render_run reads are the ones view.run_view writes."""
    app = Ryusen("shop")
    tries = iter([ConnectionError("card network timed out")])

    def charge(amount: int) -> dict[str, Any]:
        for failure in tries:
            raise failure
        raise NonRetryableError("card declined")

    @app.function("checkout")
    def checkout(order: dict[str, Any], step: Step) -> dict[str, Any]:
        hold = step.run("reserve-stock", lambda: {"hold": "h1"}, compensate=lambda r: {"released": r["hold"]})
        step.run("book-shipping", lambda: {"label": "L9"}, compensate=lambda r: {"voided": r["label"]})
        step.run("charge-card", charge, order["amount"], retry=RetryPolicy(max_attempts=3))
        return hold

    env = WorkflowEnvironment(app)
    env.faults.lose_result("reserve-stock", phase="compensation")
    view = env.run("checkout", {"sku": "lamp", "amount": 30}).raw
    assert view["blockers"], view["summary"]
    text = rendered(view)
    assert "BLOCKED (1)" in text and "--phase compensation --generation 1" in text
    assert "ConnectionError: card network timed out" in text and "card declined" in text
    unwind = text[text.index("Unwind") :]
    assert unwind.index("book-shipping") < unwind.index("reserve-stock")
    assert "compensation #1  unknown" in unwind
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 100


def test_render_run_shows_the_blockers_of_decisions_17_and_18_with_their_remedies() -> None:

    app = Ryusen("blocked")
    failed: list[str] = []

    @app.function("unwind")
    def unwind(data: Any, step: Step) -> Any:
        if failed:  # current code reaches a step this run never ran, before the one to undo
            step.run("audit", lambda: "audited")
        ran: list[str] = []
        step.run("book", lambda: ran.append("book") or "booked", compensate=lambda r: "undone")
        if not ran:  # a pass that replayed every step (not the book's attempt continuing) fails the run
            failed.append("yes")
        raise RuntimeError("fraud check failed")

    @app.function("parallel")
    def parallel(data: Any, step: Step) -> Any:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:  # a step from a thread that is not the function's: refused (18)
            return pool.submit(step.run, "hotel", lambda: 2).result()

    env = WorkflowEnvironment(app)
    text = rendered(env.run("unwind").raw)
    assert "new_step_before_target: current code reaches step 'audit'" in text
    assert "new step audit at test_cli.py:" in text and "before target book at test_cli.py:" in text
    assert "the compensator cannot be reached" in text
    assert "ryusen rediscover run_000001" in text
    assert "ryusen resolve run_000001 book --phase compensation --generation 1" in text
    text = rendered(env.run("parallel").raw)
    assert "concurrent_step: step 'hotel'" in text
    assert "the workflow function's own thread" in text and "then started hotel at" in text
    assert "own thread, never from another thread" in " ".join(text.split())
    assert "ryusen rediscover run_000002" in text


def test_the_run_view_fits_an_80_column_terminal_too() -> None:
    assert max(len(line.rstrip()) for line in rendered(saga_view(), width=80).splitlines()) <= 80


# --- over the real `ryusen dev` stack -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    yield from launch(tmp_path_factory.mktemp("dev"))


def test_the_commands_over_ryusen_dev(stack: DevStack) -> None:
    """The real client against the real server: requests, run views and errors as the API makes them."""
    server = ["--server", stack.url]
    saga = ryusen(*server, "run", "saga", "--input", '{"tag": "cli-saga"}', "--wait", "--wait-timeout", "120")
    assert saga.exit_code == 1, saga.output
    assert "failed, fully compensated" in saga.stdout and "Unwind" in saga.stdout
    assert "RuntimeError: order rejected after shipping" in saga.stdout
    assert "raised at http_app.py:" in saga.stdout  # where, as the app's SDK reported it

    blocked = ryusen(*server, "run", "dup", "--input", '{"tag": "cli-dup"}', "--wait", "--wait-timeout", "120")
    assert blocked.exit_code == 1, blocked.output
    assert "duplicate_step_id" in blocked.stdout and "blocked" in blocked.stderr
    run_id = blocked.stdout.split()[1]

    listing = ryusen(*server, "runs", "--function", "dup")
    assert listing.exit_code == 0 and run_id in listing.stdout
    view = json.loads(ryusen(*server, "show", run_id, "--json").stdout)
    assert view["id"] == run_id and view["blockers"][0]["type"] == "duplicate_step_id"
    # the dev UI shows the first 16 characters of an id: they name the run
    assert json.loads(ryusen(*server, "show", run_id[:16], "--json").stdout)["id"] == run_id
    apps = ryusen(*server, "apps")
    assert apps.exit_code == 0 and "conformance" in apps.stdout
    functions = ryusen(*server, "functions")
    assert functions.exit_code == 0 and "dup" in functions.stdout and "straight" in functions.stdout
    assert ryusen(*server, "rediscover", run_id).exit_code == 0
    assert ryusen(*server, "cancel", run_id).exit_code == 0
    refused = ryusen(*server, "resolve", run_id, "charge", "--phase", "forward", "--generation", "7", "--retry")
    assert refused.exit_code == 1 and refused.stderr.startswith("error: ")
    missing = ryusen(*server, "show", "run_missing")
    assert missing.exit_code == 1 and missing.stderr.startswith("error: not_found: ")


def test_what_a_run_holds_is_shown_as_text_never_as_terminal_controls_or_markup() -> None:
    """Issue 11 finding 10: `ryusen show` and `ryusen runs` passed raw terminal escapes through (a step id
    could retitle the window or hide lines) and read rich markup in ids."""
    hostile = "pay\x1b]0;pwned\x07\x1b[2J[bold red]x[/bold red]\x9b31m"
    runs = [{"id": hostile, "function_id": hostile, "summary": hostile, "steps": 1, "created_at": None}]
    console = Console(width=200, record=True, file=io.StringIO(), color_system=None)
    cli.render_runs(runs, console=console)
    out = console.export_text()
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out
    assert "\\x1b]0;pwned\\x07" in out and "[bold red]x[/bold red]" in out and "\\x9b31m" in out
    full = view_with_hostile_step(hostile)
    console = Console(width=200, record=True, file=io.StringIO(), color_system=None)
    cli.render_run(full, console=console)
    out = console.export_text()
    assert "\x1b" not in out and "\\x1b[2J" in out and "[bold red]x[/bold red]" in out


def view_with_hostile_step(text: str) -> dict[str, Any]:
    return {
        "id": "run_1",
        "function_id": "checkout",
        "phase": "finished",
        "outcome": "failed",
        "summary": f"failed ({text})",
        "created_at": "2026-12-03T10:00:00+00:00",
        "input": {"k": text},
        "blockers": [],
        "steps": [{"id": text, "name": text, "status": "failed", "attempts": [], "location": text}],
        "unwind": [],
        "error": {"type": text, "message": text},
    }


def test_key_derive_prints_the_apps_own_key_which_the_server_derives_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from ryusen._internal.signing import app_key, key_id

    monkeypatch.setenv("RYUSEN_MASTER_KEY", "master-1,master-0")
    result = CliRunner().invoke(cli.cli, ["key", "derive", "shop"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == app_key("master-1", "shop") != app_key("master-1", "billing")
    assert key_id(app_key("master-1", "shop")) in result.stderr
    monkeypatch.delenv("RYUSEN_MASTER_KEY")
    refused = CliRunner().invoke(cli.cli, ["key", "derive", "shop"])
    assert refused.exit_code != 0 and "no master key" in refused.output


def test_show_keeps_an_unknown_and_a_resolution_in_the_history_and_offers_the_skip(server: FakeServer) -> None:
    """Decisions 24 and 28 in the CLI: when and why an attempt was Unknown, who resolved it and why, and the
    commands that move a blocked unwind on."""
    app = Ryusen("history")
    guard = {"ends_early": False}

    @app.function("pay")
    def pay(order: Any, step: Step) -> Any:
        if guard["ends_early"]:
            return "order withdrawn"
        step.run("charge", lambda: {"charge_id": "ch_1"}, compensate=lambda c: None)
        step.run("ship", lambda: "shipped")
        raise RuntimeError("rejected")

    env = WorkflowEnvironment(app)
    env.faults.lose_result("ship")
    run_id = env.start("pay")
    env.wait(run_id)
    env.cancel(run_id)  # settling: the unwind waits for the Unknown shipment
    guard["ends_early"] = True
    env.resolve(run_id, "ship", generation=1, action="succeed", result="shipped", reason="courier confirmed")
    env.wait(run_id)
    view = env.get(run_id).raw
    assert [b["type"] for b in view["blockers"]] == ["compensation_target_not_reached"]
    server.on("GET", f"/v1/runs/{run_id}", view)
    text = " ".join(ryusen("show", run_id).stdout.split())
    assert "was unknown from" in text and "injected: response lost" in text
    assert "operator succeed by ryusen.testing" in text and "courier confirmed" in text
    assert f"ryusen rediscover {run_id}" in text and "--skip" in text


def test_show_prints_a_running_attempts_last_heartbeat_with_a_progress_bar() -> None:
    """Decision 33 / issue 25: the details of the last heartbeat on the attempt, a bar where they carry a fraction."""
    beat = {"at": "2030-01-01T12:05:00+00:00", "details": {"progress": 0.4, "chunk": 12}}
    other = {"at": "2030-01-01T12:05:01+00:00", "details": "uploading"}
    view = run_view(
        steps=[
            step("encode", "running", "app.py:10", [attempt("forward", 1, "authorized", "01.0", None, heartbeat=beat)]),
            step(
                "upload", "running", "app.py:11", [attempt("forward", 1, "authorized", "02.0", None, heartbeat=other)]
            ),
        ]
    )
    text = rendered(view, width=140)
    assert "last heartbeat" in text and "[########............] 40%" in text and '{"chunk": 12}' in text
    assert '"uploading"' in text


def test_a_prefix_matched_only_among_the_newest_runs_does_not_cancel_a_run() -> None:
    """The lookup reads the newest 1,000 runs; when older runs remain unread, one match there does not show that
    the prefix names one run: the run the operator copied the prefix from may be older, and a cancel would stop
    a different run."""
    fake = FakeServer()
    newer = "run_abcdef12" + "0" * 24
    fake.on("POST", "/v1/runs/abcdef12/cancel", error("not_found", "no run abcdef12", 404))
    pages = [{"runs": [{"id": newer}], "cursor": "c1"}] + [
        {"runs": [{"id": f"run_{i:032x}"}], "cursor": f"c{i + 2}"} for i in range(cli.PREFIX_SEARCH_PAGES)
    ]
    fake.on("GET", "/v1/runs", *pages)  # older runs remain after the pages read
    fake.on("POST", f"/v1/runs/{newer}/cancel", run_view(id=newer, summary="cancelling"))
    real = cli.make_client
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "make_client", lambda url: real(url, transport=httpx.MockTransport(fake.handle)))
        patch.delenv("RYUSEN_URL", raising=False)
        result = ryusen("cancel", "abcdef12")
    cancelled = [r.url.path for r in fake.requests if r.method == "POST" and r.url.path != "/v1/runs/abcdef12/cancel"]
    assert cancelled == [], f"cancelled {cancelled} from a prefix matched among part of the runs"
    assert result.exit_code == 1 and "full id" in result.stderr


def test_show_marks_steps_declared_together() -> None:
    view = run_view(
        steps=[
            step("flight", "completed", "trip.py:9", [attempt("forward", 1, "succeeded", "01.0", "02.0")], group=1),
            step("hotel", "running", "trip.py:10", [attempt("forward", 1, "authorized", "01.0", None)], group=1),
            step("confirm", "pending", "trip.py:12", [], group=None),
        ]
    )
    lines = rendered(view).splitlines()
    flight = next(line for line in lines if "flight" in line and "trip.py:9" in line)
    confirm = next(line for line in lines if "confirm" in line and "trip.py:12" in line)
    assert "parallel group 1 (2 steps)" in flight and "parallel group" not in confirm

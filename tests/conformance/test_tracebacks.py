"""Errors carry where they were raised (issue 26): for an exception in workflow code and in a callback, its type,
message and frames (file, line, function, source line; no locals), bounded, on the run or the attempt, in the
API's view, ``ryusen show`` and the dev UI; and in the app's own log."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from typing import Any

import pytest
from rich.console import Console

from ryusen import NonRetryableError, Ryusen, Step
from ryusen._internal.wire import MAX_FRAMES, SDK_FEATURES, ErrorInfo, TaskKind, TaskRequest, encode_request
from ryusen.testing import WorkflowEnvironment
from ryusen_server import cli

THIS_FILE = "test_tracebacks.py"


def lookup(order: dict[str, Any]) -> str:
    return str(order["card"]["number"])  # KeyError: the order has no card number


def charge(order: dict[str, Any]) -> str:
    return lookup(order)


def deep(n: int) -> int:
    if n == 0:
        raise RecursionError("too deep to go on")
    return deep(n - 1)


def shop() -> Ryusen:
    app = Ryusen("tracebacks")

    @app.function("pay")
    def pay(order: dict[str, Any], step: Step) -> Any:
        return step.run("charge", charge, order)

    @app.function("route")
    def route(order: dict[str, Any], step: Step) -> Any:
        step.run("reserve", lambda: "ok")
        return order["to"]  # KeyError in workflow code

    @app.function("deep")
    def deep_fn(order: dict[str, Any], step: Step) -> Any:
        return step.run("dive", deep, 100)

    @app.function("decline")
    def decline(order: dict[str, Any], step: Step) -> Any:
        def card() -> None:
            raise NonRetryableError("card declined", data={"code": "stolen"})

        return step.run("charge", card)

    return app


def frames_of(error: dict[str, Any]) -> list[dict[str, Any]]:
    return list(error["traceback"]["frames"])


def test_a_callbacks_exception_is_recorded_on_its_attempt_with_its_frames() -> None:
    with WorkflowEnvironment(shop()) as env:
        run = env.run("pay", {"card": {}})
    assert run.summary == "failed, compensation not required"
    [first, *_] = run.attempts("charge")
    error = first["error"]
    assert error["type"] == "KeyError" and error["message"] == "'number'"
    frames = frames_of(error)
    assert [f["function"] for f in frames[-2:]] == ["charge", "lookup"]
    assert frames[-1]["file"].endswith(THIS_FILE) and frames[-1]["line"] > 0
    assert frames[-1]["code"] == 'return str(order["card"]["number"])  # KeyError: the order has no card number'
    assert not any("ryusen/_internal" in f["file"] for f in frames)  # the SDK's own frames are left out
    assert error["traceback"]["omitted"] >= 1
    assert set(frames[-1]) == {"file", "line", "function", "code"}  # where, never what: no locals


def test_an_exception_in_workflow_code_is_recorded_on_the_run_with_its_frames() -> None:
    with WorkflowEnvironment(shop()) as env:
        run = env.run("route", {})
    error = run.error
    assert error is not None and error["type"] == "KeyError"
    inner = frames_of(error)[-1]
    assert inner["function"] == "route" and inner["code"] == 'return order["to"]  # KeyError in workflow code'


def test_a_deep_stack_keeps_its_outer_and_inner_frames_and_counts_the_rest() -> None:
    with WorkflowEnvironment(shop()) as env:
        run = env.run("deep", {})
    where = run.attempts("dive")[0]["error"]["traceback"]
    assert len(where["frames"]) == MAX_FRAMES
    assert where["omitted"] >= 100 + 1 - MAX_FRAMES
    assert where["frames"][-1]["code"] == 'raise RecursionError("too deep to go on")'


def test_an_error_over_the_value_limit_drops_its_traceback_before_its_message() -> None:
    from ryusen._internal.step import error_info

    try:
        lookup({"card": {}})
    except KeyError as exc:
        small = error_info(exc, with_traceback=True)
    assert small.traceback is not None
    big = small.model_copy(update={"message": "m" * 2000})
    cut = big.bounded(limit=1500)
    assert cut.traceback is None and cut.message.startswith("m" * 100)
    fits = big.bounded(limit=100_000)
    assert fits.traceback is not None and fits.message == "m" * 2000


def test_an_error_without_a_traceback_is_written_as_before() -> None:
    """An older server or SDK refuses unknown fields: an error with no traceback carries no such key, and a
    request says ``tracebacks`` only to an SDK that announced it."""
    plain = ErrorInfo(type="ValueError", message="bad")
    assert "traceback" not in json.loads(plain.model_dump_json()) and "traceback" not in plain.model_dump()
    request = TaskRequest(kind=TaskKind.DISCOVER, run_id="r", function_id="f", input=None, memo={})
    assert "tracebacks" not in json.loads(encode_request(request))
    assert json.loads(encode_request(request.model_copy(update={"tracebacks": True})))["tracebacks"] is True
    assert "tracebacks" in SDK_FEATURES


def test_the_app_logs_a_callbacks_traceback_and_a_decline_quietly(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ryusen"), WorkflowEnvironment(shop()) as env:
        env.run("pay", {"card": {}})
        env.run("decline", {})
    raised = [r for r in caplog.records if "raised KeyError" in r.getMessage()]
    assert raised and raised[0].levelno == logging.WARNING and raised[0].exc_info is not None
    declined = [r for r in caplog.records if "raised NonRetryableError" in r.getMessage()]
    assert declined and all(r.levelno == logging.INFO for r in declined)


def test_ryusen_show_collapses_a_traceback_to_its_innermost_frame_and_expands_it_on_request() -> None:
    with WorkflowEnvironment(shop()) as env:
        run = env.run("route", {})
        view = env.engine.get_run(run.id)
    from ryusen_server.core.view import run_view

    full = run_view(view)
    collapsed = render(full, tracebacks=False)
    assert "raised at " in collapsed and 'in route: return order["to"]' in collapsed
    assert "Traceback (most recent call last)" not in collapsed
    expanded = render(full, tracebacks=True)
    assert "Traceback (most recent call last)" in expanded and 'return order["to"]' in expanded


def render(view: dict[str, Any], *, tracebacks: bool) -> str:
    console = Console(width=200, record=True, file=io.StringIO(), color_system=None)
    cli.render_run(view, console=console, tracebacks=tracebacks)
    return console.export_text()


def test_a_request_to_an_sdk_that_did_not_announce_tracebacks_carries_no_traceback_in_its_memo() -> None:
    """A step's terminal failure is replayed to the function in every later request (the memo). An SDK that
    predates tracebacks (an app rolled back, an endpoint serving two revisions during a deploy) refuses unknown
    fields in ``ErrorInfo``: a request to it must not carry the ``traceback`` a newer SDK reported."""
    from ryusen import StepFailed
    from ryusen_server.core.model import TaskRef
    from ryusen_server.core.view import memo

    app = Ryusen("tracebacks-older")

    @app.function("fallback")
    def fallback(order: dict[str, Any], step: Step) -> Any:
        def card() -> None:
            raise NonRetryableError("card declined")

        with contextlib.suppress(StepFailed):
            step.run("charge", card)
        return step.run("invoice", lambda: "sent")

    with WorkflowEnvironment(app) as env:
        run = env.run("fallback", {})
        assert run.output == "sent"
        state = env.engine.get_run(run.id)
    recorded = state.step("charge").error
    assert recorded is not None and recorded.traceback is not None  # the newer SDK reported where it was raised
    request = env.engine._task_request(
        state,
        TaskRef(run_id=state.id, kind=TaskKind.DISCOVER, seq=1),
        memo(state),
        respond_by=state.created_at,
        features=frozenset(SDK_FEATURES) - {"tracebacks"},
    )
    sent = json.loads(encode_request(request))
    assert sent["memo"]["charge"]["status"] == "failed"
    assert "traceback" not in sent["memo"]["charge"]["error"], "an older SDK refuses this request"

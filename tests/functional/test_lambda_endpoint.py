"""The SDK on a Lambda endpoint: nothing it started may still run when the handler returns.

Lambda freezes the execution environment when the handler returns: its threads stop where they are until
the next invocation, which may never come. So on Lambda a handler returns only once every callback it started
has finished and its outcome is submitted, no pass waits for a next request (holding the function's locks
through the freeze), and callbacks run on the handler's thread, where main-thread-only APIs work.

``FreezingLambda`` is a test Lambda runtime on loopback: it invokes the app's ``lambda_handler`` on the test's
(main) thread with a Lambda context, as the Python runtime does, and at the return it records every thread the
invocation started that is still running: in AWS, that work would be frozen there. Its result endpoint notes
whether each late result arrived during an invocation or while the environment was frozen (in AWS, one sent
then was never sent).
"""

from __future__ import annotations

import json
import logging
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

from ryusen import Ryusen, Step
from ryusen._internal import app as sdk_app
from ryusen._internal.signing import SIGNATURE_HEADER, sign, verify
from ryusen._internal.wire import (
    LateResult,
    OperationInfo,
    Phase,
    TaskKind,
    TaskRequest,
    TaskResponse,
    late_result_scope,
    task_scope,
)
from tests.lambda_http import LambdaContext

KEY = "lambda-endpoint-key"
APP_ID = "on-lambda"


class FreezingLambda:
    """A Lambda runtime for one app: invokes its handler with a Function URL event, then freezes."""

    def __init__(self, app: Ryusen, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("AWS_LAMBDA_FUNCTION_NAME", "shop")  # what the Lambda runtime sets
        self.app = app
        self.frozen = True
        self.late: list[tuple[bool, dict[str, Any]]] = []
        """Each late result received: (while frozen, its body)."""
        self.late_statuses: list[int] = []
        """What the result endpoint answers each late result with, in turn (then 200)."""
        self.left_running: list[threading.Thread] = []
        """Threads the last invocation started that still ran when its handler returned."""
        self.server = make_server("127.0.0.1", 0, self._results)  # one thread, started before any invocation
        self.result_url = f"http://127.0.0.1:{self.server.server_port}/v1/results"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _results(self, environ: dict[str, Any], start_response: Any) -> Any:
        request = Request(environ)
        body = request.get_data()
        scope = late_result_scope(LateResult.model_validate_json(body), path=request.path, app_id=APP_ID)
        verify([KEY], scope, body, request.headers.get(SIGNATURE_HEADER), now=time.time())
        self.late.append((self.frozen, json.loads(body)))
        status = self.late_statuses.pop(0) if self.late_statuses else 200
        return Response("{}", status=status)(environ, start_response)

    def invoke(self, request: TaskRequest, *, context: LambdaContext | None = None, via: str = "lambda_handler") -> Any:
        """Invoke the handler with ``request`` (signed, in a Function URL event), as the Lambda runtime does.

        ``via="wsgi"``: the app served by a web framework inside Lambda (the Lambda Web Adapter), where only
        the environment says it is on Lambda. ``context``: the invocation's (15 minutes left by default). Returns
        the status and the parsed answer."""
        event = signed_event(request)
        headers, body = event["headers"], event["body"].encode()
        before = set(threading.enumerate())
        self.frozen = False
        try:
            if via == "wsgi":
                answer = self.app.handle("POST", headers, body, path="/")
                status, text = answer.status, answer.body.decode()
            else:
                result = self.app.lambda_handler(event, context or LambdaContext(900.0))
                status, text = result["statusCode"], result["body"]
        finally:
            self.frozen = True  # the handler returned: the environment freezes
            self.left_running = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        return status, json.loads(text)

    def close(self) -> None:
        self.server.shutdown()
        self.app.kept_passes.clear(wait_s=5)  # what today's code left running (the tests fail before this)


def signed_event(request: TaskRequest) -> dict[str, Any]:
    """``request`` signed with the app's key for ``/``, in the Function URL event (payload 2.0) it arrives in."""
    body = request.model_dump_json(exclude_none=True).encode()
    headers = {
        "content-type": "application/json",
        SIGNATURE_HEADER: sign(
            KEY, task_scope(request, path="/", app_id=APP_ID), body, now=time.time(), nonce=secrets.token_hex(16)
        ),
    }
    return {
        "version": "2.0",
        "rawPath": "/",
        "headers": headers,
        "requestContext": {"http": {"method": "POST", "path": "/"}},
        "body": body.decode(),
        "isBase64Encoded": False,
    }


def attempt(step_id: str, *, result_url: str, window_s: float = 30.0, memo: dict[str, Any] | None = None) -> Any:
    """A chained forward attempt at ``step_id``, as a dispatcher sends it (continuation on, a memo token)."""
    return TaskRequest(
        kind=TaskKind.FORWARD,
        run_id="run_1",
        function_id="f",
        input={},
        memo=memo or {},
        step_id=step_id,
        operation=OperationInfo(id=f"op-{step_id}", phase=Phase.FORWARD, generation=1),
        continue_after=True,
        memo_token=f"token-{step_id}",
        result_url=result_url,
        respond_by=time.time() + window_s,
        respond_within_s=window_s,
    )


@pytest.fixture
def lambdas(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Ryusen], FreezingLambda]]:
    made: list[FreezingLambda] = []

    def make(app: Ryusen) -> FreezingLambda:
        made.append(FreezingLambda(app, monkeypatch))
        return made[-1]

    yield make
    for runtime in made:
        runtime.close()


def test_a_step_that_outlasts_its_window_is_answered_and_submitted_late_before_the_handler_returns(
    lambdas: Callable[[Ryusen], FreezingLambda], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The callback takes 1.5 s; the dispatcher stops listening after 0.3 s. Before, the handler answered 500 while
    the callback still ran, and its outcome was to be posted later from a thread the freeze stopped: the step went
    Unknown. Now the handler waits for the callback, posts its outcome as a late result, and only then returns."""
    monkeypatch.setattr(sdk_app, "KEPT_GIVE_UP_AFTER_S", 0.2)  # today's code gives up this long after the window
    app = Ryusen(APP_ID, signing_key=KEY)
    ran_on: list[threading.Thread] = []

    @app.function("f")
    def f(data: Any, step: Step) -> Any:
        def ship() -> str:
            ran_on.append(threading.current_thread())
            time.sleep(1.5)
            return "shipped"

        return [step.run("ship", ship), step.run("notify", lambda: "sent")]

    runtime = lambdas(app)
    status, _ = runtime.invoke(attempt("ship", result_url=runtime.result_url, window_s=0.3))
    assert runtime.left_running == [], f"still running at the freeze: {runtime.left_running}"
    assert status == 200
    assert [frozen for frozen, _ in runtime.late] == [False], "the late result was not submitted before the return"
    assert runtime.late[0][1]["attempt"] == {"type": "succeeded", "result": "shipped"}
    assert ran_on == [threading.main_thread()]


@pytest.mark.parametrize("via", ["lambda_handler", "wsgi"])
def test_no_pass_waits_through_the_freeze_holding_the_function_s_lock(
    via: str, lambdas: Callable[[Ryusen], FreezingLambda]
) -> None:
    """The function holds a lock around its steps. Before, the kept pass waited at the next step with the lock
    held when the handler returned: through the freeze, another invocation replaying the run blocked on it. Now
    the attempt is answered with the next step, and nothing of the pass is left holding anything."""
    guard = threading.Lock()
    app = Ryusen(APP_ID, signing_key=KEY)

    @app.function("f")
    def f(data: Any, step: Step) -> Any:
        with guard:
            return [step.run("a", lambda: 1), step.run("b", lambda: 2)]

    runtime = lambdas(app)
    status, body = runtime.invoke(attempt("a", result_url=runtime.result_url), via=via)
    assert runtime.left_running == [], f"still running at the freeze: {runtime.left_running}"
    assert not guard.locked(), "the function's lock is held through the freeze"
    answer = TaskResponse.model_validate(body)
    assert status == 200 and answer.attempt is not None and answer.attempt.type == "succeeded"
    assert answer.next is not None and answer.next.type == "step" and answer.next.step.id == "b"
    assert len(app.kept_passes) == 0
    assert runtime.late == []  # answered in time: nothing goes late


def test_a_callback_runs_on_the_handler_s_thread_where_main_thread_apis_work(
    lambdas: Callable[[Ryusen], FreezingLambda],
) -> None:
    """``signal.signal`` works only on the main thread, which is the one the Lambda runtime calls the handler
    on. Before, a kept pass ran the callback on a thread of its own, and the call failed there."""
    app = Ryusen(APP_ID, signing_key=KEY)

    @app.function("f")
    def f(data: Any, step: Step) -> Any:
        def with_a_timer() -> str:
            previous = signal.signal(signal.SIGALRM, signal.SIG_IGN)
            signal.signal(signal.SIGALRM, previous)
            return "set"

        return [step.run("a", with_a_timer), step.run("b", lambda: 2)]

    runtime = lambdas(app)
    status, body = runtime.invoke(attempt("a", result_url=runtime.result_url))
    answer = TaskResponse.model_validate(body)
    assert status == 200 and answer.attempt is not None
    assert answer.attempt.model_dump(exclude_none=True) == {"type": "succeeded", "result": "set"}
    assert runtime.left_running == []


def test_late_result_retries_end_before_the_lambda_s_own_time_does(
    lambdas: Callable[[Ryusen], FreezingLambda], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The result endpoint keeps failing, and the invocation has 3 s left: the retries stop while the handler can
    still return (Lambda would otherwise end it mid-try, and nothing would say what the outcome was), and the
    outcome is logged for an operator to resolve the attempt with."""
    monkeypatch.setattr(sdk_app, "LATE_RESULT_DELAYS_S", (0.3,) * 30)  # about 9 s of retries
    app = Ryusen(APP_ID, signing_key=KEY)
    app.function("f")(lambda data, step: step.run("a", lambda: "done"))
    runtime = lambdas(app)
    runtime.late_statuses = [503] * 100
    context = LambdaContext(3.0)
    with caplog.at_level(logging.ERROR, logger="ryusen"):
        status, _ = runtime.invoke(attempt("a", result_url=runtime.result_url, window_s=0.0), context=context)
    assert status == 200
    assert context.get_remaining_time_in_millis() > 0, "the handler outlived its Lambda invocation"
    assert 1 <= len(runtime.late) < 30 and all(not frozen for frozen, _ in runtime.late)
    assert "could not deliver the late result" in caplog.text and '"result":"done"' in caplog.text


def test_an_invocation_shorter_than_the_response_window_is_named_in_the_log(
    lambdas: Callable[[Ryusen], FreezingLambda], caplog: pytest.LogCaptureFixture
) -> None:
    """A function timeout below a step's: if the callback ran that long, Lambda would end it and the attempt
    would be Unknown. The SDK cannot prevent it; it says so, naming the run and the step."""
    app = Ryusen(APP_ID, signing_key=KEY)
    app.function("f")(lambda data, step: step.run("a", lambda: "done"))
    runtime = lambdas(app)
    with caplog.at_level(logging.WARNING, logger="ryusen"):
        status, _ = runtime.invoke(attempt("a", result_url=runtime.result_url, window_s=60.0), context=LambdaContext(5))
        assert status == 200 and "run_1 step a: this Lambda invocation has" in caplog.text
        caplog.clear()
        runtime.invoke(attempt("a", result_url=runtime.result_url, window_s=60.0), context=LambdaContext(900))
    assert "this Lambda invocation has" not in caplog.text

"""``ryusen.Client`` and ``AsyncClient`` (decision 34) against the real ``ryusen dev`` stack, and what they send
and raise, request by request, against a fake transport."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import ryusen
from ryusen.client import (
    ApiError,
    AsyncClient,
    AuthorizationError,
    Client,
    ConflictError,
    ConnectionFailedError,
    InvalidRequestError,
    NotFoundError,
    RunFailedError,
    ServerUnavailableError,
    WaitTimeoutError,
)
from tests.stack import DevStack, free_port, launch, wait_for


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    yield from launch(tmp_path_factory.mktemp("client"))


def tag() -> str:
    return uuid.uuid4().hex[:10]


# --- against ryusen dev ----------------------------------------------------------------------------------------------


@pytest.mark.rfd("K1")
def test_the_client_drives_every_operator_action_over_ryusen_dev(stack: DevStack) -> None:
    with Client(stack.url) as client:
        # apps and functions, and a sync of the app from its own URL
        [app] = client.apps()
        assert app["app_id"] == "conformance" and "straight" in app["functions"]
        assert {f["id"] for f in client.functions()} >= {"straight", "slow", "dup", "audited"}
        synced = client.sync(app["url"])
        assert synced["app_id"] == "conformance" and synced["release_id"]

        # start, get, wait, result, list
        t = tag()
        handle = client.start("straight", {"tag": t}, idempotency_key=f"order-{t}")
        assert handle.created and handle.id.startswith("run_")
        output = handle.result(timeout=60)
        assert [output[n]["step"] for n in ("a", "b", "c")] == ["a", "b", "c"]
        run = handle.get()
        assert run.finished and run.outcome == "completed" and run.input == {"tag": t}
        assert [s["id"] for s in run.steps] == ["a", "b", "c"] and run.step("b")["status"] == "completed"
        listed = client.list(function="straight", limit=5)
        assert handle.id in [r.id for r in listed.runs] and all(r.function_id == "straight" for r in listed.runs)
        assert next(r for r in client.runs(function="straight") if r.id == handle.id).step_count == 3

        # cancel: a run in its slow step settles it, then compensates
        t = tag()
        slow = client.start("slow", {"tag": t, "sleep_s": 2})
        wait_for(lambda: slow.get().step("first")["status"] == "completed" if slow.get().steps else None)
        cancelled = slow.cancel("customer asked")
        assert cancelled.view["stop_intent"]["reason"] == "customer asked"
        with pytest.raises(RunFailedError) as failed:
            slow.result(timeout=90)
        assert failed.value.run.outcome == "cancelled" and failed.value.run.recovery == "compensated"

        # rediscover: a run blocked on its definition
        t = tag()
        dup = client.start("dup", {"tag": t})
        blocked = dup.wait(timeout=90, return_when_blocked=True)
        assert blocked.blocked and blocked.blockers[0]["type"] == "duplicate_step_id"
        assert dup.id in [r.id for r in client.list(function="dup", blocked=True).runs]
        assert dup.id not in [r.id for r in client.list(function="dup", blocked=False).runs]
        assert client.rediscover(dup.id).id == dup.id
        client.cancel(dup.id)

        # resolve (succeed) without naming the attempt: the step's one blocker is meant; the reason is kept
        t = tag()
        audited = client.start("audited", {"tag": t})
        waiting = audited.wait(timeout=90, return_when_blocked=True)
        assert [b["type"] for b in waiting.blockers] == ["new_step_before_target"]
        client.resolve(audited.id, "book", "succeed", result={"undone": "by hand"}, reason="refunded in the console")
        done = audited.wait(timeout=90)
        assert done.summary == "failed, fully compensated"
        book = done.step("book")
        assert book["compensation"]["result"] == {"undone": "by hand"}
        [resolved] = [a for a in book["attempts"] if a["resolution"]]
        assert resolved["resolution"]["action"] == "succeed"
        assert resolved["resolution"]["reason"] == "refunded in the console"

        # resolve (fail, final) an Unknown outcome: the run fails and compensates what completed
        t = tag()
        unknown = client.start("slow", {"tag": t, "sleep_s": 15, "timeout_s": 1})
        stuck = wait_for(lambda: (r := unknown.get()).blocked and r, what="the attempt to be Unknown", timeout=60)
        [blocker] = stuck.blockers
        assert blocker["type"] == "unknown_outcome" and blocker["step_id"] == "slow"
        client.resolve(unknown.id, "slow", "fail", error="the provider says it never ran", final=True)
        with pytest.raises(RunFailedError) as declared:
            unknown.result(timeout=90)
        assert declared.value.run.recovery == "compensated"
        assert declared.value.run.step("slow")["error"]["message"] == "the provider says it never ran"

        # refusals are typed, with the API's code
        with pytest.raises(NotFoundError) as missing:
            client.get("run_missing")
        assert missing.value.code == "not_found" and missing.value.status == 404
        with pytest.raises(NotFoundError):
            client.start("no-such-function", {})
        with pytest.raises(ConflictError) as refused:
            client.resolve(handle.id, "b", "retry", phase="forward", generation=1)
        assert refused.value.status == 409 and refused.value.message
        with pytest.raises(ValueError, match="no blocker on step 'b'"):
            client.resolve(handle.id, "b", "retry")


@pytest.mark.rfd("K3")
def test_a_reused_idempotency_key_with_a_different_input_is_refused_and_changes_nothing(stack: DevStack) -> None:
    t = tag()
    key = f"order-{t}"
    with Client(stack.url) as client:
        first = client.start("straight", {"tag": t}, idempotency_key=key)
        again = client.start("straight", {"tag": t}, idempotency_key=key)
        assert first.created and not again.created and again.id == first.id
        before = client.list(function="straight", limit=200).runs
        [found] = client.list(function="straight", idempotency_key=key).runs
        assert found.id == first.id
        with pytest.raises(ConflictError) as reused:
            client.start("straight", {"tag": t, "steps": ["x"]}, idempotency_key=key)
        assert reused.value.code == "idempotency_key_reused" and reused.value.status == 409
        assert reused.value.details["run_id"] == first.id
        assert "different input" in reused.value.message
        assert [r.id for r in client.list(function="straight", limit=200).runs] == [r.id for r in before]
        # the same key for another function is another run
        other = client.start("saga", {"tag": t}, idempotency_key=key)
        assert other.created and other.id != first.id
        assert set(first.result(timeout=60)) == {"a", "b", "c"}


@pytest.mark.rfd("K1")
def test_the_async_client_starts_waits_lists_and_cancels_over_ryusen_dev(stack: DevStack) -> None:
    async def scenario() -> None:
        async with AsyncClient(stack.url) as client:
            t = tag()
            handles = await asyncio.gather(*(client.start("straight", {"tag": f"{t}-{i}"}) for i in range(3)))
            outputs = await asyncio.gather(*(h.result(timeout=60) for h in handles))
            assert all(o["a"]["step"] == "a" for o in outputs) and len({o["a"]["op"] for o in outputs}) == 3
            page = await client.list(function="straight", limit=200)
            assert {h.id for h in handles} <= {r.id for r in page.runs}
            seen = [r.id async for r in client.runs(function="straight")]
            assert {h.id for h in handles} <= set(seen)
            slow = await client.start("slow", {"tag": t, "sleep_s": 2})
            for _ in range(600):  # until its first step is done: then there is something to compensate
                steps = (await slow.get()).steps
                if steps and steps[0]["status"] == "completed":
                    break
                await asyncio.sleep(0.1)
            await client.cancel(slow.id, "not needed")
            run = await slow.wait(timeout=90)
            assert run.outcome == "cancelled" and run.recovery == "compensated"
            with pytest.raises(NotFoundError):
                await client.get("run_missing")
            assert {a["app_id"] for a in await client.apps()} == {"conformance"}

    asyncio.run(scenario())


# --- request by request ----------------------------------------------------------------------------------------------


class Recorder:
    def __init__(self, *responses: httpx.Response) -> None:
        self.responses = list(responses)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.responses.pop(0) if len(self.responses) > 1 else self.responses[0]

    def body(self, i: int = -1) -> Any:
        content = self.requests[i].content
        return json.loads(content) if content else None


VIEW = {"id": "run_1", "function_id": "f", "phase": "running", "summary": "running", "steps": [], "blockers": []}


def client_for(recorder: Recorder, url: str = "http://127.0.0.1:8700", **kwargs: Any) -> Client:
    return Client(url, transport=httpx.MockTransport(recorder), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "body"),
    [
        ({"action": "succeed", "result": {"ok": 1}}, {"action": "succeed", "result": {"ok": 1}}),
        ({"action": "succeed"}, {"action": "succeed", "result": None}),
        (
            {"action": "fail", "error": "declined"},
            {"action": "fail", "error": {"type": "declared_failure", "message": "declined", "retryable": True}},
        ),
        (
            {"action": "fail", "error": {"type": "Declined", "message": "no", "data": {"code": 5}}, "final": True},
            {"action": "fail", "error": {"type": "Declined", "message": "no", "data": {"code": 5}, "retryable": False}},
        ),
        ({"action": "retry", "reason": "safe"}, {"action": "retry", "reason": "safe"}),
        ({"action": "skip"}, {"action": "skip"}),
    ],
)
def test_resolve_sends_each_action_as_the_api_takes_it(kwargs: dict[str, Any], body: dict[str, Any]) -> None:
    recorder = Recorder(httpx.Response(200, json=VIEW))
    with client_for(recorder) as client:
        run = client.resolve("run_1", "charge card", phase="forward", generation=2, **kwargs)
    assert run.id == "run_1"
    [request] = recorder.requests
    assert request.method == "POST" and request.url.raw_path == b"/v1/runs/run_1/steps/charge%20card/forward/2/resolve"
    assert recorder.body() == body


def _blocked_view(generation: int) -> dict[str, Any]:
    blocker = {"type": "new_step_before_target", "step_id": "book", "phase": "compensation", "generation": generation}
    return {**VIEW, "phase": "compensating", "blockers": [blocker]}


def _settled() -> httpx.Response:
    return httpx.Response(409, json={"error": {"code": "generation_settled", "message": "generation 1 is fenced"}})


def test_resolving_the_steps_blocker_follows_it_when_a_probe_moved_it_to_the_next_generation() -> None:
    """A blocked run's probe takes its blocked pass again, fencing that generation and naming the next in the
    blocker (``ryusen dev`` probes a second after the run blocks, then at doubling intervals): a resolve of the
    generation the caller read a moment before is refused. Naming only the step means its blocker, whichever
    generation it is at now: the client reads it again and resolves that one."""
    recorder = Recorder(
        httpx.Response(200, json=_blocked_view(1)),
        _settled(),
        httpx.Response(200, json=_blocked_view(2)),
        httpx.Response(200, json=VIEW),
    )
    with client_for(recorder) as client:
        assert client.resolve("run_1", "book", "succeed", result={"undone": "by hand"}).id == "run_1"
    posts = [r.url.raw_path for r in recorder.requests if r.method == "POST"]
    assert posts == [
        b"/v1/runs/run_1/steps/book/compensation/1/resolve",
        b"/v1/runs/run_1/steps/book/compensation/2/resolve",
    ]


def test_a_resolve_refused_for_another_reason_or_of_a_named_generation_is_not_sent_again() -> None:
    still = Recorder(httpx.Response(200, json=_blocked_view(1)), _settled(), httpx.Response(200, json=_blocked_view(1)))
    with client_for(still) as client, pytest.raises(ConflictError, match="generation_settled"):
        client.resolve("run_1", "book", "succeed")  # the blocker did not move: the refusal stands
    named = Recorder(_settled())
    with client_for(named) as client, pytest.raises(ConflictError):
        client.resolve("run_1", "book", "succeed", phase="compensation", generation=1)
    assert [r.method for r in named.requests] == ["POST"]


def test_the_async_client_follows_a_blocker_a_probe_moved_too() -> None:
    recorder = Recorder(
        httpx.Response(200, json=_blocked_view(3)),
        _settled(),
        httpx.Response(200, json=_blocked_view(4)),
        httpx.Response(200, json=VIEW),
    )

    async def scenario() -> list[bytes]:
        async with AsyncClient("http://127.0.0.1:8700", transport=httpx.MockTransport(recorder)) as client:
            await client.resolve("run_1", "book", "skip")
        return [r.url.raw_path for r in recorder.requests if r.method == "POST"]

    assert asyncio.run(scenario())[-1] == b"/v1/runs/run_1/steps/book/compensation/4/resolve"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"action": "fail"},
        {"action": "retry", "result": 1},
        {"action": "retry", "error": "x"},
        {"action": "skip", "final": True},
    ],
)
def test_a_resolve_the_api_would_refuse_is_refused_before_sending(kwargs: dict[str, Any]) -> None:
    recorder = Recorder(httpx.Response(200, json=VIEW))
    with client_for(recorder) as client, pytest.raises(ValueError):
        client.resolve("run_1", "charge", phase="forward", generation=1, **kwargs)
    assert recorder.requests == []


def test_start_sends_input_key_and_timeout_and_tells_a_new_run_from_an_existing_one() -> None:
    recorder = Recorder(httpx.Response(201, json=VIEW), httpx.Response(200, json=VIEW))
    with client_for(recorder) as client:
        first = client.start("check out", {"sku": "lamp"}, idempotency_key="o-1", timeout=90)
        again = client.start("check out", {"sku": "lamp"}, idempotency_key="o-1", timeout=90)
    assert first.created and not again.created and first.id == again.id == "run_1"
    assert recorder.requests[0].url.raw_path == b"/v1/functions/check%20out/runs"
    assert recorder.body(0) == {"input": {"sku": "lamp"}, "idempotency_key": "o-1", "timeout_s": 90.0}


@pytest.mark.parametrize(
    ("status", "body", "kind", "code"),
    [
        (404, {"error": {"code": "not_found", "message": "no run"}}, NotFoundError, "not_found"),
        (409, {"error": {"code": "idempotency_key_reused", "message": "m", "run_id": "r"}}, ConflictError, None),
        (422, {"error": {"code": "invalid_request", "message": "m"}}, InvalidRequestError, "invalid_request"),
        (413, {"error": {"code": "payload_too_large", "message": "m"}}, InvalidRequestError, "payload_too_large"),
        (403, {"message": "Missing Authentication Token"}, AuthorizationError, "http_403"),
        (503, {"error": {"code": "store_unavailable", "message": "m"}}, ServerUnavailableError, "store_unavailable"),
        (429, {"message": "Too Many Requests"}, ServerUnavailableError, "http_429"),
        (502, None, ServerUnavailableError, "http_502"),
    ],
)
def test_refusals_are_typed_and_carry_the_apis_code(
    status: int, body: Any, kind: type[ApiError], code: str | None
) -> None:
    response = httpx.Response(status, json=body) if body is not None else httpx.Response(status, text="Bad Gateway")
    with client_for(Recorder(response)) as client, pytest.raises(kind) as raised:
        client.get("run_1")
    assert raised.value.status == status
    assert raised.value.code == (code or "idempotency_key_reused")
    if status == 409:
        assert raised.value.details == {"run_id": "r"}
    if status == 502:
        assert str(raised.value) == "HTTP 502: Bad Gateway"


def test_no_server_is_a_connection_error_that_says_where() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with Client(url) as client, pytest.raises(ConnectionFailedError) as raised:
        client.get("run_1")
    assert raised.value.code == "connection_failed" and url in raised.value.message
    assert "ryusen dev" in raised.value.message


def test_wait_times_out_with_the_run_as_last_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    from ryusen._internal import client as module

    now = [0.0]
    monkeypatch.setattr(module, "clock", lambda: now[0])
    monkeypatch.setattr(module, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    with client_for(Recorder(httpx.Response(200, json=VIEW))) as client, pytest.raises(WaitTimeoutError) as late:
        client.wait("run_1", timeout=5)
    assert late.value.run.id == "run_1" and isinstance(late.value, TimeoutError)
    assert now[0] == pytest.approx(5.0)


def test_a_deployed_api_is_signed_with_sigv4_for_its_own_region(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    recorder = Recorder(httpx.Response(200, json={"apps": []}))
    with client_for(recorder, "https://abc.execute-api.ap-south-1.amazonaws.com/prod") as client:
        assert client.apps() == []
    [request] = recorder.requests
    assert request.url.path == "/prod/v1/apps"
    assert "/ap-south-1/execute-api/aws4_request" in request.headers["authorization"]
    unsigned = Recorder(httpx.Response(200, json={"apps": []}))
    with client_for(unsigned, "http://localhost:8700") as client:
        client.apps()
    assert "authorization" not in unsigned.requests[0].headers


def test_the_client_is_exported_from_the_package() -> None:
    assert ryusen.Client is Client and ryusen.AsyncClient is AsyncClient and ryusen.ApiError is ApiError
    with pytest.raises(ValueError, match="http"):
        Client("127.0.0.1:8700")


def test_aws_credentials_are_not_sent_in_the_clear_to_a_remote_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auth="auto"`` signs every host but loopback; over plain http a signed request (its session token, a
    signature anyone on the path can replay for minutes) travels in the clear: refused before anything is sent."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "session-token")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    recorder = Recorder(httpx.Response(200, json={"apps": []}))
    try:
        with client_for(recorder, "http://api.example.com") as client:
            client.apps()
    except (ValueError, ApiError):
        pass
    sent = [r.headers for r in recorder.requests]
    assert not any("authorization" in h or "x-amz-security-token" in h for h in sent), "signed over plain http"

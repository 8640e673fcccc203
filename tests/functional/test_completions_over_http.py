"""Steps completed from outside over HTTP on ``ryusen dev`` and through the client (decision 32, X5)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from ryusen.client import Client, ConflictError, NotFoundError
from tests.stack import DevStack, launch, wait_for


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    yield from launch(tmp_path_factory.mktemp("completions"))


def token_of(stack: DevStack, tag: str) -> str:
    lines = stack.log_file.read_text().splitlines() if stack.log_file.exists() else []
    found = [line.split(":token:", 1)[1] for line in lines if line.startswith(f"{tag}:token:")]
    return found[-1] if found else ""


@pytest.mark.rfd("X5")
def test_a_step_is_completed_over_http_through_the_client(stack: DevStack) -> None:
    tag = uuid.uuid4().hex[:10]
    with Client(stack.url) as client:
        run = client.start("approval", {"tag": tag})
        token = wait_for(lambda: token_of(stack, tag), what="the callback to hand out its token")
        waiting = wait_for(
            lambda: (r := run.get()).steps and r.step("approve")["attempts"][-1]["status"] == "waiting" and r,
            what="the step to wait",
        )
        attempt = waiting.step("approve")["attempts"][-1]
        assert attempt["completion_token"] == token  # the operator API shows what completes it
        assert not waiting.blocked
        done = client.complete(token, {"approved": True, "by": "maria"})
        assert done.id == run.id
        finished = run.wait(timeout=60)
        assert finished.outcome == "completed" and finished.step("approve")["result"] == {
            "approved": True,
            "by": "maria",
        }
        assert stack.invocations(f"{tag}:pay") == 1
        with pytest.raises(ConflictError) as refused:
            client.complete(token, {"approved": False})
        assert refused.value.code == "completion_refused" and refused.value.status == 409
        with pytest.raises(NotFoundError) as unknown:
            client.complete("rc1.e30.AAAA", {"approved": True})
        assert unknown.value.code == "completion_not_found"


@pytest.mark.rfd("X5")
def test_a_step_is_failed_over_http_and_its_run_compensates(stack: DevStack) -> None:
    tag = uuid.uuid4().hex[:10]
    with Client(stack.url) as client:
        run = client.start("approval", {"tag": tag})
        token = wait_for(lambda: token_of(stack, tag), what="the token")
        wait_for(lambda: (r := run.get()).steps and r.step("approve")["attempts"][-1]["status"] == "waiting")
        client.fail(token, "over budget", final=True)
        finished = run.wait(timeout=60)
        assert finished.summary == "failed, fully compensated"
        assert finished.step("approve")["error"]["message"] == "over budget"
        assert stack.invocations(f"{tag}:undo-reserve") == 1
        with pytest.raises(ConflictError):
            client.fail(token, "again")


def test_a_bad_completion_request_changes_nothing(stack: DevStack) -> None:
    tag = uuid.uuid4().hex[:10]
    with Client(stack.url) as client:
        run = client.start("approval", {"tag": tag})
        token = wait_for(lambda: token_of(stack, tag), what="the token")
        wait_for(lambda: (r := run.get()).steps and r.step("approve")["attempts"][-1]["status"] == "waiting")
        version = run.get().view["version"]
        for body in ({}, {"result": 1, "error": {"type": "x", "message": "y"}}, {"error": None}, {"resultt": 1}):
            response = client._http.post(f"/v1/completions/{token}", json=body)
            assert response.status_code == 422, (body, response.text)
        assert run.get().view["version"] == version
        client.complete(token, {"approved": True})
        assert run.wait(timeout=60).outcome == "completed"


@pytest.mark.rfd("X5")
def test_the_app_completes_a_step_itself_signed_with_its_own_key(stack: DevStack) -> None:
    """The app's webhook calls ``app.complete(token, ...)``: posted to the result URL with the app's signature, no
    operator credentials. An unsigned post of the same completion is refused and changes nothing."""
    import httpx

    tag = uuid.uuid4().hex[:10]
    with Client(stack.url) as client:
        run = client.start("approval", {"tag": tag, "self_complete": True})
        finished = run.wait(timeout=60)
        assert finished.outcome == "completed", finished.summary
        assert finished.step("approve")["result"] == {"approved": True, "by": "the app's webhook"}
        assert stack.invocations(f"{tag}:completed:True") == 1 and stack.invocations(f"{tag}:pay") == 1
        # the same completion, posted without the app's signature: refused, and the run is as it was
        token = token_of(stack, tag)
        forged = {
            "kind": "completion",
            "run_id": run.id,
            "step_id": "approve",
            "phase": "forward",
            "generation": 1,
            "token": token,
            "result": {"approved": False},
        }
        answer = httpx.post(f"{stack.url}/v1/results", json=forged, timeout=10)
        assert answer.status_code in (401, 403), answer.text
        assert client.get(run.id).step("approve")["result"] == {"approved": True, "by": "the app's webhook"}

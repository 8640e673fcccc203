"""Key rotation (issue 24, finding 6).

The review rotated the master as docs/security.md said and found the old key still signed accepted late
results and task requests for ever: the engine and a secret-reading app kept AWSPREVIOUS with no end, so a
leaked key was never locked out. Mid-rotation (the apps given the new key first, as the procedure says), an
app signed its late results and manifests with the new key, which the engine did not hold yet: late results
were refused and syncs failed.

Now the previous key holds for a window after the rotation (the current version's creation date), an
emergency rotation (``ryusen key rotate --emergency``) keeps none and the engine verifies unsolicited
messages with keys read afresh, and an app signs what it sends unasked with a key the engine holds.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import boto3
import httpx
import pytest
from click.testing import CliRunner
from moto import mock_aws
from werkzeug.serving import make_server

from ryusen import Ryusen, Step
from ryusen._internal import app as app_module
from ryusen._internal.serve import wsgi_app
from ryusen._internal.signing import SIGNATURE_HEADER, app_key, sign
from ryusen._internal.wire import LateResult, TaskRequest, TaskResponse, late_result_scope
from ryusen.testing import WorkflowEnvironment
from ryusen_server.cli import cli
from ryusen_server.lambdas import api as api_lambda
from ryusen_server.lambdas import dispatch as dispatch_lambda
from ryusen_server.ports import InvalidRequestError
from ryusen_server.urls import EndpointPolicy
from ryusen_server.wiring import fetch_manifest
from tests.functional.test_lambda_dispatch import aws, call  # noqa: F401 - the fixture, used by name

OLD = "rotation-test-master-old-0123456789abcdef"
NEW = "rotation-test-master-new-fedcba9876543210"


def late_body(run_id: str) -> bytes:
    late = {
        "run_id": run_id,
        "step_id": "charge",
        "phase": "forward",
        "generation": 1,
        "attempt": {"type": "succeeded", "result": {"charged": True}},
    }
    return json.dumps(late).encode()


def post_late(stack: dict[str, str], run_id: str, master: str) -> httpx.Response:
    """A late result about ``run_id`` signed as app ``box`` would sign it with the key derived from ``master``."""
    body = late_body(run_id)
    scope = late_result_scope(LateResult.model_validate_json(body), path="/v1/results", app_id="box")
    header = sign(app_key(master, "box"), scope, body, now=time.time(), nonce=__import__("secrets").token_hex(16))
    return httpx.post(
        stack["api_url"] + "/v1/results",
        content=body,
        headers={"content-type": "application/json", SIGNATURE_HEADER: header},
        timeout=30,
    )


def refused(response: httpx.Response) -> bool:
    return response.status_code == 401 and response.json()["error"]["code"] == "invalid_signature"


@pytest.fixture
def keyed(aws: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, str], str, Any]:  # noqa: F811
    """The Lambda API and its app both reading the master from a secret (as the CDK example app does)."""
    secrets = boto3.client("secretsmanager")
    arn = secrets.create_secret(Name="ryusen/rotation", SecretString=OLD)["ARN"]
    monkeypatch.setenv("RYUSEN_MASTER_KEY_SECRET_ARN", arn)
    monkeypatch.delenv("RYUSEN_MASTER_KEY", raising=False)
    monkeypatch.setattr(api_lambda, "_resolver", None)
    monkeypatch.setattr(dispatch_lambda, "_engine", None)
    return aws, arn, secrets


def test_the_previous_key_is_refused_once_its_window_after_the_rotation_has_passed(
    keyed: tuple[dict[str, str], str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    stack, arn, secrets = keyed
    monkeypatch.setenv("RYUSEN_PREVIOUS_KEY_WINDOW_S", "2")
    call(stack, "PUT", "/v1/apps/box", {"url": stack["app_url"]})
    run = call(stack, "POST", "/v1/functions/quick/runs", {"input": {}})
    secrets.put_secret_value(SecretId=arn, SecretString=NEW)
    monkeypatch.setattr(api_lambda, "_resolver", None)  # a cold API: it reads the rotated secret
    assert not refused(post_late(stack, run["id"], OLD))  # within the window the old key still verifies
    assert not refused(post_late(stack, run["id"], NEW))
    time.sleep(2.5)  # the window (2 s after the new version was made) passes
    assert refused(post_late(stack, run["id"], OLD))
    assert not refused(post_late(stack, run["id"], NEW))


def test_an_app_reading_its_key_from_a_secret_drops_the_previous_key_after_the_window(
    aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with mock_aws():
        secrets = boto3.client("secretsmanager")
        arn = secrets.create_secret(Name="app/key", SecretString="app-key-1")["ARN"]
        secrets.put_secret_value(SecretId=arn, SecretString="app-key-2")
        for name in ("RYUSEN_SIGNING_KEY", "RYUSEN_MASTER_KEY", "RYUSEN_MASTER_KEY_SECRET_ARN"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("RYUSEN_SIGNING_KEY_SECRET_ARN", arn)
        monkeypatch.setenv("RYUSEN_PREVIOUS_KEY_WINDOW_S", "2")
        app = Ryusen("box")
        assert app.signing_keys == ["app-key-2", "app-key-1"]
        time.sleep(2.5)
        assert app.signing_keys == ["app-key-2"]  # a task request signed with the old key is refused now


def test_an_emergency_rotation_refuses_the_old_key_at_once(keyed: tuple[dict[str, str], str, Any]) -> None:
    stack, arn, secrets = keyed
    call(stack, "PUT", "/v1/apps/box", {"url": stack["app_url"]})  # the API has read the key: it holds it cached
    run = call(stack, "POST", "/v1/functions/quick/runs", {"input": {}})
    assert not refused(post_late(stack, run["id"], OLD))
    result = CliRunner().invoke(cli, ["key", "rotate", "--secret", arn, "--emergency"])
    assert result.exit_code == 0, result.output
    stages = secrets.describe_secret(SecretId=arn)["VersionIdsToStages"]
    assert sorted(map(tuple, stages.values())) == [(), ("AWSCURRENT",)]  # no previous version is kept
    new = secrets.get_secret_value(SecretId=arn)["SecretString"]
    assert new != OLD and OLD not in result.output + result.stderr and new not in result.output + result.stderr
    # the warm API, whose cache is minutes from expiring, refuses the old key at once
    assert refused(post_late(stack, run["id"], OLD))
    assert not refused(post_late(stack, run["id"], new))
    response = httpx.put(stack["api_url"] + "/v1/apps/box", json={"url": stack["app_url"]}, timeout=30)
    assert response.status_code == 422 and response.json()["error"]["code"] == "unsigned_app"  # the app: old key


def test_a_normal_rotation_keeps_the_previous_key_and_says_for_how_long(keyed: tuple[dict[str, str], str, Any]) -> None:
    _, arn, secrets = keyed
    result = CliRunner().invoke(cli, ["key", "rotate", "--secret", arn])
    assert result.exit_code == 0, result.output
    assert "RYUSEN_PREVIOUS_KEY_WINDOW_S" in result.output
    assert secrets.get_secret_value(SecretId=arn, VersionStage="AWSPREVIOUS")["SecretString"] == OLD


# ---- mid-rotation: what an app sends unasked is signed with a key the engine holds ------------------------------


def test_mid_rotation_an_app_signs_its_late_result_with_the_key_the_engine_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The app was given its new key first (new, old); the engine still signs with the old master. The app's
    late result is signed with the key the engine's requests were, which the engine verifies."""
    calls: Counter[str] = Counter()
    app = Ryusen("bound", signing_key=[app_key(NEW, "bound"), app_key(OLD, "bound")])

    @app.function("pay")
    def pay(data: Any, step: Step) -> Any:
        return step.run("charge", lambda: calls.update(["charge"]) or f"receipt-{data}")

    env = WorkflowEnvironment()
    env.engine.settings = replace(env.engine.settings, master_key=OLD, result_url="http://results.test/v1/results")
    env.sync(app)
    env.faults.lose_result("charge")
    run_id = env.start("pay", 1)
    env.drive()
    assert env.get(run_id).step("charge")["attempts"][0]["status"] == "unknown"
    sent: list[tuple[dict[str, str], bytes]] = []

    class Accepted:
        def __enter__(self) -> Accepted:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def read(self) -> bytes:
            return b"{}"

    def urlopen(request: Any, timeout: float) -> Accepted:
        sent.append((dict(request.header_items()), request.data))
        return Accepted()

    monkeypatch.setattr(app_module.urllib.request, "urlopen", urlopen)
    request = TaskRequest.model_validate(
        {
            "kind": "forward",
            "run_id": run_id,
            "function_id": "pay",
            "step_id": "charge",
            "operation": {"id": "charge", "phase": "forward", "generation": 1},
            "result_url": "http://results.test/v1/results",
            "respond_by": time.time() - 5,  # the dispatcher stopped listening: the outcome goes late
        }
    )
    response = TaskResponse.model_validate(
        {"kind": "forward", "run_id": run_id, "attempt": {"type": "succeeded", "result": "receipt-1"}}
    )
    app._submit_late(request, response)
    [(headers, body)] = sent
    env.engine.submit_late_result(body, headers)
    assert env.wait(run_id).output == "receipt-1" and calls == Counter({"charge": 1})


@pytest.fixture
def rotating_app() -> Iterator[str]:
    app = Ryusen("rotating", signing_key=[app_key(NEW, "rotating"), app_key(OLD, "rotating")])

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        return step.run("s", lambda: data)

    server = make_server("127.0.0.1", 0, wsgi_app(app), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()


def test_mid_rotation_a_sync_verifies(rotating_app: str) -> None:
    """The engine holds only the old master: the manifest request names the key it holds, and the app (which
    holds the new key too) signs its manifest with that one."""
    manifest, _ = fetch_manifest(
        rotating_app,
        app_id="rotating",
        policy=EndpointPolicy.local(),
        keys=lambda app_id: [app_key(OLD, app_id)],
    )
    assert manifest.app_id == "rotating" and manifest.signed
    # and once the engine has moved on (new first, old still valid), it signs with the new key
    manifest, _ = fetch_manifest(
        rotating_app,
        app_id="rotating",
        policy=EndpointPolicy.local(),
        keys=lambda app_id: [app_key(NEW, app_id)],
    )
    assert manifest.signed
    with pytest.raises(InvalidRequestError) as refusal:  # a key neither holds is still refused
        fetch_manifest(
            rotating_app,
            app_id="rotating",
            policy=EndpointPolicy.local(),
            keys=lambda app_id: [app_key("some-other-master", app_id)],
        )
    assert refusal.value.details.get("code") == "unsigned_app"

"""Bounded inputs at the API and sync boundary (issue 24, finding 9 and the low items).

The review synced a signed, valid manifest of 1,300 functions (accepted), a 425 KB manifest (a 500 from the
store), and a 300,000-character release id (accepted and served to every client); an endpoint that trickled
its headers held a sync 128 s past the documented 10 s; a host label over 63 characters gave a 500. Each is
now a structured 4xx (or the sync's one deadline), and nothing is recorded.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
from werkzeug.serving import make_server

from ryusen import Ryusen, Step
from ryusen._internal.serve import wsgi_app
from ryusen._internal.signing import SIGNATURE_HEADER, app_key, sign
from ryusen._internal.wire import LateResult, Manifest, late_result_scope
from ryusen.testing import WorkflowEnvironment
from ryusen_server import wiring
from ryusen_server.api import build_api
from ryusen_server.engine import MAX_MANIFEST_FUNCTIONS
from ryusen_server.ports import InvalidRequestError
from ryusen_server.urls import EndpointPolicy, EndpointRefusedError
from ryusen_server.wiring import fetch_manifest
from tests.conformance.test_security_and_bad_input import call, rest_event
from tests.functional.test_lambda_dispatch import aws  # noqa: F401 - the fixture, used by name


def manifest(functions: int = 1, **fields: Any) -> Manifest:
    return Manifest.model_validate(
        {
            "app_id": "big",
            "release_id": "r1",
            "build_id": "b1",
            "functions": [{"id": f"fn-{i}"} for i in range(functions)],
            "signed": True,
            **fields,
        }
    )


def sync_with(env: WorkflowEnvironment, served: Manifest) -> tuple[int, Any]:
    resolver = build_api(env.engine, lambda app_id, url: (served, frozenset()))
    return call(resolver, "PUT", "/v1/apps/big", json.dumps({"url": "https://big.example.com/"}))


@pytest.mark.parametrize(
    ("served", "code"),
    [
        (manifest(1_300), "manifest_too_large"),
        (manifest(MAX_MANIFEST_FUNCTIONS + 1), "manifest_too_large"),
        (manifest(release_id="r" * 300_000), "invalid_manifest"),
        (manifest(build_id="b" * 257), "invalid_manifest"),
        (manifest(release_id="r1\x1b]0;owned\x07"), "invalid_manifest"),
        (manifest(release_id=""), "invalid_manifest"),
    ],
    ids=["1300-functions", "one-too-many", "300k-release-id", "long-build-id", "escape-in-release-id", "empty"],
)
def test_a_manifest_over_the_bounds_is_a_structured_4xx_and_records_nothing(served: Manifest, code: str) -> None:
    env = WorkflowEnvironment(Ryusen("unused"))
    status, body = sync_with(env, served)
    assert (status, body["error"]["code"]) == (422, code)
    assert "r" * 1000 not in body["error"]["message"]  # the offending value is not repeated
    assert env.engine.store.list_releases() == []
    assert all(env.engine.store.get_release(f.id) is None for f in served.functions[:5])


def test_a_manifest_at_the_bounds_is_accepted() -> None:
    env = WorkflowEnvironment(Ryusen("unused"))
    status, body = sync_with(env, manifest(MAX_MANIFEST_FUNCTIONS, release_id="r" * 256))
    assert status == 200 and len(body["functions"]) == MAX_MANIFEST_FUNCTIONS


@pytest.fixture
def big_app() -> Iterator[str]:
    """A signed app whose manifest is 425 KB (a long release id)."""
    app = Ryusen("box", release_id="r" * 425_000)

    @app.function("quick")
    def quick(data: Any, step: Step) -> Any:
        return step.run("charge", lambda: data)

    server = make_server("127.0.0.1", 0, wsgi_app(app), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()


def test_a_425_kb_manifest_is_a_structured_4xx_on_the_deployed_api(aws: dict[str, str], big_app: str) -> None:  # noqa: F811
    response = httpx.put(aws["api_url"] + "/v1/apps/box", json={"url": big_app}, timeout=30)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "manifest_too_large"
    assert httpx.get(aws["api_url"] + "/v1/functions", timeout=30).json() == {"functions": []}


@pytest.fixture
def trickling_endpoint() -> Iterator[str]:
    """An endpoint that sends its status line, then its headers a byte every 0.2 s (about 5 s), and no body."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\n")
                try:
                    for byte in b"Content-Type: application/json\r\nX-Pad: " + b"p" * 4 + b"\r\n":
                        if stop.wait(0.2):
                            return
                        conn.sendall(bytes([byte]))
                    conn.sendall(b"Content-Length: 0\r\nConnection: close\r\n\r\n")
                except OSError:
                    continue  # the client hung up

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/"
    stop.set()
    thread.join()
    listener.close()


def test_a_sync_whose_endpoint_trickles_its_headers_gives_up_at_its_one_deadline(
    trickling_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """httpx's timeout is per read: each byte came well within it, so the headers held the sync as long as the
    endpoint liked. The fetch now has one deadline for connecting, headers and body together."""
    monkeypatch.setattr(wiring, "MANIFEST_TIMEOUT_S", 1.0)
    with pytest.raises(InvalidRequestError) as refused:
        fetch_manifest(trickling_endpoint, policy=EndpointPolicy.local())
    assert refused.value.details.get("code") == "endpoint_unreachable"
    assert "took over 1s" in refused.value.message


@pytest.mark.parametrize(
    "url",
    [
        "https://" + "a" * 64 + ".example.com/",
        "https://a..example.com/",
        "https://" + ".".join(["a" * 60] * 5) + "/",
    ],
    ids=["label-over-63", "empty-label", "name-over-253"],
)
def test_a_host_that_is_no_dns_name_is_refused_with_a_structured_4xx(url: str) -> None:
    with pytest.raises(EndpointRefusedError):
        EndpointPolicy().check(url)
    env = WorkflowEnvironment(Ryusen("unused"))
    resolver = build_api(env.engine, wiring.manifest_fetcher(EndpointPolicy(), lambda app_id: []))
    status, body = call(resolver, "PUT", "/v1/apps/big", json.dumps({"url": url}))
    assert (status, body["error"]["code"]) == (422, "endpoint_refused")


# ---- late results: bounded, and the same refusal whether the run exists or not --------------------------------

MASTER = "bounded-inputs-master-0123456789abcdef"


def late_result_env() -> tuple[WorkflowEnvironment, str, Any]:
    app = Ryusen("shop", master_key=MASTER)

    @app.function("pay")
    def pay(data: Any, step: Step) -> Any:
        return step.run("charge", lambda: "receipt")

    env = WorkflowEnvironment()
    env.engine.settings = replace(env.engine.settings, master_key=MASTER)
    env.sync(app)
    env.faults.lose_result("charge")
    run_id = env.start("pay", 1)
    env.drive()
    return env, run_id, build_api(env.engine, lambda app_id, url: (manifest(), frozenset()))


def post_result(resolver: Any, body: bytes, headers: dict[str, str]) -> tuple[int, Any]:
    event = rest_event("POST", "/v1/results", body.decode())
    event["headers"] = {**(event.get("headers") or {}), **headers}
    result = resolver.resolve(event, None)
    return result["statusCode"], json.loads(result["body"])


def late(run_id: str) -> bytes:
    return json.dumps(
        {
            "run_id": run_id,
            "step_id": "charge",
            "phase": "forward",
            "generation": 1,
            "attempt": {"type": "succeeded", "result": "forged"},
        }
    ).encode()


def signed(body: bytes, key: str, app_id: str = "shop") -> dict[str, str]:
    scope = late_result_scope(LateResult.model_validate_json(body), path="/v1/results", app_id=app_id)
    return {SIGNATURE_HEADER: sign(key, scope, body, now=time.time(), nonce=secrets.token_hex(16))}


def test_a_late_result_is_refused_alike_for_runs_that_exist_and_runs_that_do_not() -> None:
    env, run_id, resolver = late_result_env()
    for key in ("a-key-nobody-holds", app_key(MASTER, "someone-else"), app_key("another-master", "shop")):
        answers = [
            post_result(resolver, late(target), signed(late(target), key)) for target in (run_id, "run_" + "0" * 32)
        ]
        assert answers[0] == answers[1]
        status, body = answers[0]
        assert (status, body["error"]["code"]) == (401, "invalid_signature")
    for headers in ({}, {SIGNATURE_HEADER: "v2,k=zz"}):
        answers = [post_result(resolver, late(target), headers) for target in (run_id, "run_" + "0" * 32)]
        assert answers[0] == answers[1] and answers[0][0] == 401
    assert env.get(run_id).step("charge")["attempts"][0]["status"] == "unknown"  # nothing changed
    env.deliver_late_result(run_id, "charge")  # the app's own, signed with its key: accepted
    assert env.wait(run_id).output == "receipt"


def test_a_late_result_over_the_limit_or_without_a_well_formed_signature_is_not_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env, run_id, resolver = late_result_env()
    parsed: list[int] = []
    real = LateResult.model_validate_json

    def spy(data: Any, *args: Any, **kwargs: Any) -> Any:
        parsed.append(len(data))
        return real(data, *args, **kwargs)

    headers = signed(late(run_id), app_key(MASTER, "shop"))  # a well-formed header with the run's app's key
    huge = late(run_id)[:-1] + b', "pad": "' + b"x" * (8 * 1024 * 1024) + b'"}'
    monkeypatch.setattr(LateResult, "model_validate_json", spy)
    status, body = post_result(resolver, huge, headers)
    assert (status, body["error"]["code"]) == (413, "payload_too_large")
    for headers in ({}, {SIGNATURE_HEADER: "v1,whatever"}, {SIGNATURE_HEADER: "v2,k=" + "0" * 16}):
        status, body = post_result(resolver, late(run_id), headers)
        assert (status, body["error"]["code"]) == (401, "invalid_signature"), headers
        assert parsed == [], headers
    assert parsed == []  # none of those bodies was parsed
    assert env.get(run_id).step("charge")["attempts"][0]["status"] == "unknown"

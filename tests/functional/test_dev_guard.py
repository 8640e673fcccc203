"""Web pages cannot drive the local stack (issue 11, findings 2 and 3), on a real `ryusen dev`.

The review found the dev API without a Host check (DNS rebinding worked), a cross-site ``text/plain`` POST
that needed no preflight starting a run with the attacker's input (201), a UI that could be framed and
whose Cancel asked nothing, and an embedded moto granting CORS to every origin. Each test sends what such a
page would and expects a structured refusal and nothing changed.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.stack import DevStack, launch

EVIL = "http://evil.example"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    yield from launch(tmp_path_factory.mktemp("guard"))


def run_count(stack: DevStack) -> int:
    return len(stack.client.get("/v1/runs", params={"limit": "200"}).json()["runs"])


def moto_url(stack: DevStack) -> str:
    found = re.search(r"moto\s+(http://127\.0\.0\.1:\d+)", stack.output.read_text())
    assert found, stack.output.read_text()
    return found.group(1)


def session_token(stack: DevStack) -> str:
    page = stack.client.get("/").text
    found = re.search(r'name="ryusen-session" content="([^"]+)"', page)
    assert found
    return found.group(1)


def test_a_foreign_host_is_refused_so_dns_rebinding_reaches_nothing(stack: DevStack) -> None:
    before = run_count(stack)
    for method, path in (("GET", "/v1/runs"), ("GET", "/"), ("POST", "/v1/functions/straight/runs")):
        response = httpx.request(
            method, stack.url + path, headers={"Host": "rebound.evil.example"}, json={"input": {}}, timeout=10
        )
        assert response.status_code == 421 and response.json()["error"]["code"] == "foreign_host", response.text
    assert run_count(stack) == before


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({"Origin": EVIL, "Content-Type": "text/plain"}, "cross_site_request"),
        ({"Origin": EVIL, "Content-Type": "application/json"}, "cross_site_request"),
        ({"Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"}, "cross_site_request"),
        ({"Sec-Fetch-Site": "same-site", "Content-Type": "application/json"}, "cross_site_request"),
        ({"Content-Type": "text/plain"}, "json_required"),
        ({"Content-Type": "application/x-www-form-urlencoded"}, "json_required"),
        ({"Origin": "null", "Content-Type": "application/json"}, "cross_site_request"),
    ],
)
def test_a_cross_site_write_is_refused_and_starts_nothing(stack: DevStack, headers: dict[str, str], code: str) -> None:
    before = run_count(stack)
    response = stack.client.post(
        "/v1/functions/straight/runs", content=b'{"input": {"attacker": true}}', headers=headers
    )
    assert response.status_code in (403, 415) and response.json()["error"]["code"] == code, response.text
    assert run_count(stack) == before


def test_the_uis_own_page_may_act_with_its_session_token_and_only_with_it(stack: DevStack) -> None:
    own = {"Origin": stack.url, "Sec-Fetch-Site": "same-origin", "Content-Type": "application/json"}
    before = run_count(stack)
    refused = stack.client.post("/v1/functions/straight/runs", content=b'{"input": {}}', headers=own)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "session_token_required"
    wrong = stack.client.post(
        "/v1/functions/straight/runs", content=b'{"input": {}}', headers={**own, "X-Ryusen-Session": "guess"}
    )
    assert wrong.status_code == 403 and run_count(stack) == before
    token = session_token(stack)
    created = stack.client.post(
        "/v1/functions/straight/runs",
        content=b'{"input": {"tag": "ui-1"}}',
        headers={**own, "X-Ryusen-Session": token},
    )
    assert created.status_code == 201, created.text
    plain = stack.client.post("/v1/functions/straight/runs", json={"input": {"tag": "cli-1"}})
    assert plain.status_code == 201  # the CLI and scripts send no browser headers


def test_the_ui_cannot_be_framed_and_asks_before_it_cancels(stack: DevStack) -> None:
    page = stack.client.get("/")
    csp = page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and page.headers["x-frame-options"] == "DENY"
    assert "script-src 'self';" in csp and "<script>" not in page.text  # no inline script runs on the page
    # cancelling asks first: a form that needs a reason (tests/browser/test_dev_ui.py drives it)


def test_the_embedded_moto_grants_no_origin_and_answers_no_browser(stack: DevStack) -> None:
    moto = moto_url(stack)
    preflight = httpx.options(
        moto + "/",
        headers={"Origin": EVIL, "Access-Control-Request-Method": "POST", "Host": moto.removeprefix("http://")},
        timeout=10,
    )
    assert "access-control-allow-origin" not in preflight.headers
    scan = httpx.post(
        moto + "/",
        headers={"Origin": EVIL, "X-Amz-Target": "DynamoDB_20120810.ListTables", "Content-Type": "application/json"},
        content=b"{}",
        timeout=10,
    )
    assert scan.status_code == 403 and "access-control-allow-origin" not in scan.headers
    rebound = httpx.post(
        moto + "/",
        headers={"Host": "rebound.evil.example", "X-Amz-Target": "DynamoDB_20120810.ListTables"},
        content=b"{}",
        timeout=10,
    )
    assert rebound.status_code == 421


def test_a_negative_content_length_is_refused_at_once(stack: DevStack, tmp_path: Path) -> None:
    """It used to make the server read until the client hung up, holding a worker thread."""
    port = int(stack.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(
            b"POST /v1/functions/straight/runs HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
            b"Content-Type: application/json\r\nContent-Length: -1\r\n\r\n" % port
        )
        answer = b""
        while chunk := raw.recv(4096):  # the server closes the connection: within the socket's 10 s, or this raises
            answer += chunk
    assert answer.startswith((b"HTTP/1.1 400", b"HTTP/1.0 400")), answer[:200]
    assert b"invalid_content_length" in answer

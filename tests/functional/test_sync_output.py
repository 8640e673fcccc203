"""``ryusen sync`` prints what an endpoint said as data (issue 24, low): an endpoint's release id, build id,
function ids or error text with terminal escape sequences (retitle the window, clear the screen, move the
cursor) or line breaks reached the operator's terminal as they were."""

from __future__ import annotations

import httpx

from tests.functional.test_cli import APP_URL, FakeServer, ryusen, server  # noqa: F401 - the fixture, by name

ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x9b31m"


def test_sync_shows_an_endpoints_escape_sequences_instead_of_sending_them_to_the_terminal(
    server: FakeServer,  # noqa: F811
) -> None:
    server.on("GET", APP_URL, {"app_id": "shop" + ESCAPES, "release_id": "r", "build_id": "b", "functions": []})
    server.on(
        "PUT",
        "/v1/apps/shop%1B%5D0%3Bpwned%07%1B%5B2J%C2%9B31m",
        {
            "app_id": "shop" + ESCAPES,
            "release_id": "r1" + ESCAPES + "\nsynced app bank: release forged",
            "build_id": "b1" + ESCAPES,
            "functions": [{"id": "checkout" + ESCAPES}],
            "signed": True,
        },
    )
    result = ryusen("sync", APP_URL)
    assert result.exit_code == 0, result.output
    assert not any(ch in result.stdout for ch in "\x1b\x07\x9b")
    assert "\\x1b]0;pwned\\x07" in result.stdout and "checkout\\x1b" in result.stdout
    assert result.stdout.count("\n") == 2  # the endpoint's line break does not make a line of its own
    assert "\\x0asynced app bank" in result.stdout


def test_an_error_an_endpoint_answered_is_shown_without_its_escape_sequences(server: FakeServer) -> None:  # noqa: F811
    server.on("GET", APP_URL, httpx.Response(500, text="down" + ESCAPES))
    result = ryusen("sync", APP_URL)
    assert result.exit_code == 1
    assert not any(ch in result.stderr for ch in "\x1b\x07\x9b")
    assert "down\\x1b]0;pwned" in result.stderr

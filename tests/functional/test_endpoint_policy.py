"""What an app may register as its endpoint (decisions 22; issue 11, finding 1).

The security review registered a fake credentials service and a text page as an app's URL: ``PUT
/v1/apps/{id}`` fetched them and its error repeated what came back (pydantic prints input values), a
secret key and a password. On AWS any IAM caller of the API could have read the metadata service. Now the
URL must pass the deployment's policy before anything is fetched (public addresses only unless a network
is allowed; loopback on ``ryusen dev``), the name is resolved once and that address used, and nothing an
endpoint answers is repeated unless it is a well-formed manifest signed with the server's key.
"""

from __future__ import annotations

import ipaddress
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

from ryusen import Ryusen, Step
from ryusen._internal.serve import wsgi_app
from ryusen._internal.wire import FEATURES_HEADER
from ryusen.testing import WorkflowEnvironment
from ryusen_server.api import build_api
from ryusen_server.invoker import HttpInvoker
from ryusen_server.ports import InvalidRequestError
from ryusen_server.urls import EndpointPolicy, EndpointRefusedError
from ryusen_server.wiring import fetch_manifest, manifest_fetcher
from tests.conformance.test_security_and_bad_input import call

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
KEY = "policy-test-signing-key-0123456789abcdef"


@pytest.fixture
def credentials_service() -> Iterator[str]:
    """A loopback service answering every GET with a secret, as the metadata service would."""

    @Request.application
    def answer(request: Request) -> Response:
        if request.path == "/text":
            return Response(f"password={SECRET}", content_type="text/plain")
        body = {"AccessKeyId": "ASIAEXAMPLE", "SecretAccessKey": SECRET, "app_id": SECRET, "functions": SECRET}
        return Response(json.dumps(body), content_type="application/json")

    server = make_server("127.0.0.1", 0, answer, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture
def app_server() -> Iterator[tuple[Ryusen, str]]:
    app = Ryusen("policy-app", signing_key=KEY)

    @app.function("wf")
    def wf(data: Any, step: Step) -> Any:
        return step.run("s", lambda: data)

    server = make_server("127.0.0.1", 0, wsgi_app(app), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield app, f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()


def api(policy: EndpointPolicy, keys: list[str] | None = None) -> tuple[WorkflowEnvironment, Any]:
    env = WorkflowEnvironment(Ryusen("unused"))
    return env, build_api(env.engine, manifest_fetcher(policy, lambda app_id: keys or []))


def sync(resolver: Any, url: str) -> tuple[int, Any]:
    return call(resolver, "PUT", "/v1/apps/policy-app", json.dumps({"url": url}))


@pytest.mark.parametrize("path", ["/latest/meta-data/iam/security-credentials/role", "/text"])
def test_a_loopback_service_is_refused_before_it_is_fetched_on_a_deployment(
    credentials_service: str, path: str
) -> None:
    env, resolver = api(EndpointPolicy())
    status, body = sync(resolver, credentials_service + path)
    assert (status, body["error"]["code"]) == (422, "endpoint_refused")
    assert "loopback" in body["error"]["message"] and SECRET not in json.dumps(body)
    assert env.store.list_releases() == []


@pytest.mark.parametrize("path", ["/latest/meta-data/iam/security-credentials/role", "/text"])
def test_what_a_non_manifest_answer_says_is_never_repeated(credentials_service: str, path: str) -> None:
    """Where loopback is allowed (``ryusen dev``), the fetch happens; its answer is not a manifest, and the
    error says so without quoting it."""
    env, resolver = api(EndpointPolicy.local())
    status, body = sync(resolver, credentials_service + path)
    assert (status, body["error"]["code"]) == (422, "invalid_manifest")
    assert SECRET not in json.dumps(body) and "ASIA" not in json.dumps(body)
    assert env.store.list_releases() == []


@pytest.mark.parametrize(
    ("address", "what"),
    [
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("::ffff:169.254.169.254", "link-local"),
        ("10.0.0.7", "private"),
        ("192.168.1.1", "private"),
        ("fd00:ec2::254", "private"),
        ("0.0.0.0", "private"),
        ("100.64.0.1", "not public"),
        ("2002:7f00:1::", "loopback"),
        ("2002:a9fe:a9fe::", "link-local"),
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", "loopback"),
    ],
)
def test_addresses_that_are_not_public_are_refused_without_a_request(address: str, what: str) -> None:
    host = f"[{address}]" if ":" in address else address
    with pytest.raises(EndpointRefusedError, match=what):
        EndpointPolicy().check(f"http://{host}/latest/meta-data/")


def test_a_name_is_checked_for_every_address_it_has_and_then_used_by_address() -> None:
    """A name with one public and one private address is refused (a second lookup could pick either); an
    accepted name is resolved once and the request goes to that address, with the name as Host and as the
    TLS server name, so a DNS answer that changes afterwards cannot redirect it."""
    answers = {"mixed.example": ["93.184.216.34", "10.1.2.3"], "public.example": ["93.184.216.34"]}
    lookups: list[str] = []

    def resolver(host: str, port: int) -> list[str]:
        lookups.append(host)
        return answers[host]

    policy = EndpointPolicy(resolver=resolver)
    with pytest.raises(EndpointRefusedError, match="private"):
        policy.check("https://mixed.example/api")
    target = policy.check("https://public.example/api/ryusen?x=1")
    assert target.url == "https://93.184.216.34/api/ryusen?x=1"
    assert (target.host_header, target.sni_hostname) == ("public.example", "public.example")
    answers["public.example"] = ["169.254.169.254"]  # rebinding: the next lookup would say the metadata service
    assert policy.check("https://public.example/api").url == "https://93.184.216.34/api"
    assert lookups == ["mixed.example", "public.example"]


def test_a_setting_allows_a_private_network_and_only_that_one() -> None:
    policy = EndpointPolicy.from_env({"RYUSEN_ENDPOINT_ALLOWED_NETWORKS": "10.0.0.0/8, fd00::/8"})
    assert policy.allowed == (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("fd00::/8"))
    assert policy.check("http://10.2.3.4:8080/x").url == "http://10.2.3.4:8080/x"
    with pytest.raises(EndpointRefusedError):
        policy.check("http://192.168.0.1/x")
    with pytest.raises(EndpointRefusedError, match="link-local"):
        policy.check("http://169.254.169.254/")
    with pytest.raises(ValueError, match="not a CIDR"):
        EndpointPolicy.from_env({"RYUSEN_ENDPOINT_ALLOWED_NETWORKS": "10.0.0.0/8,private"})


@pytest.mark.parametrize(
    "url",
    [
        "http://user:secret@93.184.216.34/",
        "http://93.184.216.34/\r\nX-Injected: 1",
        "http://93.184.216.34/a b",
        "http://93.184.216.34/#frag",
        "file:///etc/passwd",
        "http://93.184.216.34:99999/",
        "http:///nohost",
        "http://exämple.com/",
    ],
)
def test_malformed_urls_are_refused_with_a_structured_error_and_nothing_stored(url: str) -> None:
    env, resolver = api(EndpointPolicy())
    status, body = sync(resolver, url)
    assert 400 <= status < 500 and body["error"]["code"] in ("endpoint_refused", "invalid_request")
    assert "secret" not in json.dumps(body) and env.store.list_releases() == []


def test_a_server_with_a_key_refuses_an_app_that_does_not_sign_with_it(app_server: tuple[Ryusen, str]) -> None:
    """Finding 8: a keyed server used to sync an unsigned app, whose runs then retried discovery forever."""
    _, url = app_server
    env, resolver = api(EndpointPolicy.local(), keys=["some-other-key-0123456789abcdefgh"])
    status, body = sync(resolver, url)
    assert (status, body["error"]["code"]) == (422, "unsigned_app") and env.store.list_releases() == []
    env, resolver = api(EndpointPolicy.local(), keys=[KEY])
    status, body = sync(resolver, url)
    assert status == 200 and body["signed"] is True
    assert (
        fetch_manifest(url, app_id="policy-app", policy=EndpointPolicy.local(), keys=lambda app_id: [KEY])[0].app_id
        == "policy-app"
    )


def test_the_dispatcher_does_not_send_a_task_to_an_address_the_policy_refuses() -> None:
    invoker = HttpInvoker(policy=EndpointPolicy())
    result = invoker.invoke("http://169.254.169.254/latest", b"{}", {}, timeout_s=1)
    assert result.kind == "unreachable" and "not sent" in (result.detail or "")
    assert invoker.counter.counts == {"endpoint.invoke": 1}


def test_what_a_non_http_endpoint_answers_is_not_repeated_in_the_run() -> None:
    """A review pointed a release at a socket that answers with a banner (or a header line) holding a
    secret: the invoker's detail quoted it, and the run view showed it to anyone who could read runs."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]

    def answer() -> None:
        for reply in (b"SSH-2.0-OpenSSH_9.6 db_password=hunter2\r\n\r\n", b"HTTP/1.1 200 OK\r\nAWS hunter2\r\n\r\n"):
            conn, _ = listener.accept()
            conn.recv(65536)
            conn.sendall(reply)
            conn.close()

    threading.Thread(target=answer, daemon=True).start()
    invoker = HttpInvoker(policy=EndpointPolicy.local())
    for _ in range(2):
        result = invoker.invoke(f"http://127.0.0.1:{port}/", b"{}", {}, timeout_s=5)
        assert result.kind == "lost" and "hunter2" not in (result.detail or ""), result
        assert "RemoteProtocolError" in (result.detail or "")
    listener.close()


@pytest.mark.parametrize("url", ["http://8.8.8.8%zz.evil.example/", "http://[fe80::1%25eth0]/", "http://8.8.8.8%00/"])
def test_a_host_with_a_percent_is_refused_so_the_name_connected_to_is_the_one_checked(url: str) -> None:
    with pytest.raises(EndpointRefusedError, match="'%'"):
        EndpointPolicy(resolver=lambda host, port: ["93.184.216.34"]).check(url)
    assert EndpointPolicy().check("http://8.8.8.8:80/x").url == "http://8.8.8.8:80/x"


def test_a_manifest_that_drips_in_is_given_up_on_at_the_total_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """httpx's timeout bounds each read: an endpoint sending a byte a second would hold the API for ever."""
    import contextlib
    import socket
    import time

    from ryusen_server import wiring
    from ryusen_server.ports import InvalidRequestError

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    def drip() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        with contextlib.suppress(OSError):  # the fetch gives up and closes its end
            for _ in range(20):
                time.sleep(0.25)
                conn.sendall(b"x")
        conn.close()

    threading.Thread(target=drip, daemon=True).start()
    monkeypatch.setattr(wiring, "MANIFEST_TIMEOUT_S", 1.0)
    started = time.monotonic()
    with pytest.raises(InvalidRequestError, match="took over 1s"):
        fetch_manifest(f"http://127.0.0.1:{port}/", policy=EndpointPolicy.local())
    assert time.monotonic() - started < 3
    listener.close()


def test_a_manifest_holds_only_for_the_app_it_is_synced_as(app_server: tuple[Ryusen, str]) -> None:
    """Decision 21: the manifest is signed for its app id; the same key does not make it another app's."""
    _, url = app_server
    with pytest.raises(InvalidRequestError) as refused:
        fetch_manifest(url, app_id="other-app", policy=EndpointPolicy.local(), keys=lambda app_id: [KEY])
    assert refused.value.details["code"] == "unsigned_app"


def test_the_features_a_manifest_announces_are_signed_with_it(app_server: tuple[Ryusen, str]) -> None:
    """Something on the path that rewrites ``X-Ryusen-Features`` (to make the server send an old protocol, or
    fields the SDK never announced) makes the manifest unverifiable."""
    app, _ = app_server
    inner = wsgi_app(app)

    def rewriting(environ: dict[str, Any], start_response: Any) -> Any:
        def restart(status: str, headers: list[tuple[str, str]], *rest: Any) -> Any:
            kept = [(k, "continuation" if k.lower() == FEATURES_HEADER.lower() else v) for k, v in headers]
            return start_response(status, kept, *rest)

        return inner(environ, restart)

    assert refused_sync(rewriting).details["code"] == "unsigned_app"


def refused_sync(endpoint: Any) -> InvalidRequestError:
    """What a keyed sync of policy-app served by the WSGI ``endpoint`` raises."""
    server = make_server("127.0.0.1", 0, endpoint, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(InvalidRequestError) as refused:
            fetch_manifest(
                f"http://127.0.0.1:{server.server_port}/",
                app_id="policy-app",
                policy=EndpointPolicy.local(),
                keys=lambda app_id: [KEY],
            )
    finally:
        server.shutdown()
    return refused.value


def test_a_manifest_signed_for_an_earlier_fetch_is_not_accepted_by_a_later_sync() -> None:
    """A review kept the previous release's signed manifest (anyone may GET it) and played it back to a sync
    within the five minutes a signature is fresh: the server recorded the old release and its older features.
    A sync now sends a challenge the manifest's signature must carry."""
    old = Ryusen("policy-app", signing_key=KEY, release_id="r1", build_id="b1")
    captured = old.handle("GET", {}, b"")
    assert captured.status == 200

    def playing_back(environ: dict[str, Any], start_response: Any) -> Any:
        start_response("200 OK", list(captured.headers.items()))
        return [captured.body]

    refused = refused_sync(playing_back)
    assert refused.details["code"] == "unsigned_app" and "not signed for the request" in refused.message

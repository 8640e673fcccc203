"""A client for application code (decision 34): start runs, watch them, and act on them as an operator.

``Client`` and its twin ``AsyncClient`` speak the server API (contract 2), the same requests the ``ryusen``
command line makes (the command line is built on ``Client``). Against ``ryusen dev`` (a loopback URL)
requests go unsigned; against a deployed API they are signed with SigV4 for API Gateway's IAM authorization,
with the standard AWS credential chain (botocore, imported only then) and the region taken from the API's URL.

Every refusal is an :class:`ApiError` carrying the API's error ``code``; its subclasses say which kind
(:class:`NotFoundError`, :class:`ConflictError`, ...), so callers can catch what they handle.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal
from urllib.parse import quote, urlsplit

import httpx

from .errors import RyusenError

DEFAULT_URL = "http://127.0.0.1:8700"
"""Where ``ryusen dev`` serves its API; ``RYUSEN_URL`` overrides it."""
REQUEST_TIMEOUT_S = 30.0
SIGV4_SERVICE = "execute-api"

POLL_INITIAL_S = 0.2
POLL_MAX_S = 1.0
POLL_GROWTH = 1.5
BLOCKED_QUIET_S = 2.0
"""``wait(..., return_when_blocked=True)``: how long a blocked run must stay unchanged before waiting stops."""

sleep: Callable[[float], None] = time.sleep
clock: Callable[[], float] = time.monotonic
"""``Client.wait``'s time sources (tests replace them)."""

Auth = Literal["auto", "sigv4", "none"]
Records = list[dict[str, Any]]
"""A list of JSON objects (``list`` is a method name inside the clients)."""
ResolveAction = Literal["succeed", "fail", "retry", "skip"]


# --- errors -----------------------------------------------------------------------------------------------------------


class ApiError(RyusenError):
    """The server API refused a request, or could not be reached.

    ``code`` is the API's error code (``not_found``, ``idempotency_key_reused``, ``resolution_not_allowed``...),
    ``status`` the HTTP status (0 when no answer came), ``details`` the rest of the error body.
    """

    def __init__(self, message: str, *, code: str, status: int = 0, details: dict[str, Any] | None = None) -> None:
        # a refusal in the API's shape reads "code: message"; any other answer (a proxy's, API Gateway's own)
        # reads "HTTP 403: Forbidden"
        super().__init__(f"HTTP {status}: {message}" if code == f"http_{status}" else f"{code}: {message}")
        self.message = message
        self.code = code
        self.status = status
        self.details: dict[str, Any] = details or {}


class ConnectionFailedError(ApiError):
    """No answer: the server is not running, not reachable, or the request timed out. Nothing is known to have
    changed unless the request was a start or an action, which the caller may repeat (a start safely so with an
    idempotency key)."""


class InvalidRequestError(ApiError):
    """400, 413, 422: the request is malformed, too large or does not match the API's shape."""


class AuthorizationError(ApiError):
    """401 or 403: the credentials were refused (or missing) for this API."""


class NotFoundError(ApiError):
    """404: no such run, function, step or route."""


class ConflictError(ApiError):
    """409: the request is not allowed in the run's present state (an idempotency key reused with a different
    input, a resolution of an attempt that is not Unknown, ...); ``code`` says which."""


class ServerUnavailableError(ApiError):
    """5xx or 429: the server could not answer now; the request may be repeated."""


class RunFailedError(RyusenError):
    """``result()`` of a run that finished without completing: ``run.outcome`` is failed, cancelled or
    timed_out; ``run.error`` says why, ``run.recovery`` how far it was undone."""

    def __init__(self, run: Run) -> None:
        error = run.error or {}
        reason = f": {error.get('type')}: {error.get('message')}" if error else ""
        super().__init__(f"run {run.id} {run.summary or run.outcome}{reason}")
        self.run = run


class WaitTimeoutError(RyusenError, TimeoutError):
    """``wait()`` ran out of time; ``run`` is the run as last seen."""

    def __init__(self, run: Run, timeout_s: float) -> None:
        super().__init__(f"run {run.id} had not finished after {timeout_s:g}s: {run.summary}")
        self.run = run


_BY_STATUS: dict[int, type[ApiError]] = {
    400: InvalidRequestError,
    401: AuthorizationError,
    403: AuthorizationError,
    404: NotFoundError,
    409: ConflictError,
    413: InvalidRequestError,
    422: InvalidRequestError,
    429: ServerUnavailableError,
}


def _error_for(status: int, body: Any, text: str) -> ApiError:
    kind = _BY_STATUS.get(status, ServerUnavailableError if status >= 500 else ApiError)
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            details = {k: v for k, v in error.items() if k not in {"code", "message"}}
            return kind(error["message"], code=str(error.get("code", "error")), status=status, details=details)
        if isinstance(body.get("message"), str):  # API Gateway's own refusals ({"message": "Forbidden"})
            return kind(body["message"], code=f"http_{status}", status=status)
    return kind(text.strip()[:200] or f"HTTP {status}", code=f"http_{status}", status=status)


# --- what the API answers ---------------------------------------------------------------------------------------------


def parse_time(value: Any) -> datetime | None:
    """An ISO-8601 time from a run view, or None (absent, or not a time)."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Run:
    """A run as the API showed it. The commonly read fields are attributes; ``view`` is the whole run view
    (contract 2), steps and attempts included. A run from ``list`` is a summary: ``steps`` is empty there, and
    ``step_count`` says how many it has."""

    id: str
    app_id: str | None
    function_id: str
    phase: str
    outcome: str | None
    recovery: str | None
    summary: str
    input: Any
    output: Any
    error: dict[str, Any] | None
    created_at: datetime | None
    finished_at: datetime | None
    deadline_at: datetime | None
    idempotency_key: str | None
    blockers: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    step_count: int
    view: dict[str, Any] = field(repr=False)

    @classmethod
    def from_view(cls, view: dict[str, Any]) -> Run:
        steps = view.get("steps")
        deadline = view.get("deadline")
        blockers = view.get("blockers")
        return cls(
            id=str(view["id"]),
            app_id=view.get("app_id"),
            function_id=str(view.get("function_id", "")),
            phase=str(view.get("phase", "")),
            outcome=view.get("outcome"),
            recovery=view.get("recovery"),
            summary=str(view.get("summary", "")),
            input=view.get("input"),
            output=view.get("output"),
            error=view.get("error"),
            created_at=parse_time(view.get("created_at")),
            finished_at=parse_time(view.get("finished_at")),
            deadline_at=parse_time(deadline.get("at")) if isinstance(deadline, dict) else None,
            idempotency_key=view.get("idempotency_key"),
            blockers=list(blockers) if isinstance(blockers, list) else [],
            steps=list(steps) if isinstance(steps, list) else [],
            step_count=len(steps) if isinstance(steps, list) else int(steps or 0),
            view=view,
        )

    @property
    def finished(self) -> bool:
        return self.phase == "finished"

    @property
    def blocked(self) -> bool:
        """Something needs a person (an Unknown outcome, a definition blocker): see ``blockers``' remedies."""
        return bool(self.blockers) or bool(self.view.get("blocked"))

    def step(self, step_id: str) -> dict[str, Any]:
        """The step's view (status, result, compensation, attempts); KeyError if the run has no such step."""
        for step in self.steps:
            if step.get("id") == step_id:
                return step
        raise KeyError(step_id)


@dataclass(frozen=True, slots=True)
class RunPage:
    """One page of ``list``: newest first; pass ``cursor`` back for the next page (None: this was the last)."""

    runs: list[Run]
    cursor: str | None


# --- the requests -----------------------------------------------------------------------------------------------------


def _segment(value: str | int) -> str:
    if isinstance(value, str) and not value:
        raise ValueError("an id must not be empty")
    return quote(str(value), safe="")


@dataclass(frozen=True, slots=True)
class _Call:
    method: str
    path: str
    parse: Callable[[int, Any], Any]
    body: Any = None
    params: dict[str, Any] | None = None


def _run(_: int, body: Any) -> Run:
    return Run.from_view(body)


def _seconds(value: timedelta | float | None, what: str) -> float | None:
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not seconds > 0:
        raise ValueError(f"{what} must be positive")
    return seconds


class _Requests:
    """What each method asks of the API and how its answer is read; the sync and async clients send them."""

    @staticmethod
    def start(function: str, input: Any, idempotency_key: str | None, timeout: timedelta | float | None) -> _Call:
        body: dict[str, Any] = {"input": input}
        if idempotency_key is not None:
            body["idempotency_key"] = idempotency_key
        if (timeout_s := _seconds(timeout, "timeout")) is not None:
            body["timeout_s"] = timeout_s

        def parse(status: int, b: Any) -> tuple[Run, bool]:
            return Run.from_view(b), status == 201  # 200: the idempotency key named an existing run

        return _Call("POST", f"/v1/functions/{_segment(function)}/runs", parse, body)

    @staticmethod
    def get(run_id: str) -> _Call:
        return _Call("GET", f"/v1/runs/{_segment(run_id)}", _run)

    @staticmethod
    def list(
        function: str | None,
        phase: str | None,
        outcome: str | None,
        limit: int | None,
        cursor: str | None,
        recovery: str | None = None,
        blocked: bool | None = None,
        idempotency_key: str | None = None,
    ) -> _Call:
        params = {
            "function_id": function,
            "phase": phase,
            "outcome": outcome,
            "recovery": recovery,
            "blocked": None if blocked is None else str(blocked).lower(),
            "idempotency_key": idempotency_key,
            "limit": limit,
            "cursor": cursor,
        }

        def parse(_: int, body: Any) -> RunPage:
            return RunPage([Run.from_view(r) for r in body.get("runs", [])], body.get("cursor"))

        return _Call("GET", "/v1/runs", parse, params={k: v for k, v in params.items() if v is not None})

    @staticmethod
    def cancel(run_id: str, reason: str | None) -> _Call:
        return _Call("POST", f"/v1/runs/{_segment(run_id)}/cancel", _run, {"reason": reason} if reason else None)

    @staticmethod
    def rediscover(run_id: str) -> _Call:
        return _Call("POST", f"/v1/runs/{_segment(run_id)}/rediscover", _run)

    @staticmethod
    def resolve(
        run_id: str,
        step_id: str,
        phase: str,
        generation: int,
        action: ResolveAction,
        result: Any,
        error: str | dict[str, Any] | None,
        final: bool,
        reason: str | None,
    ) -> _Call:
        body: dict[str, Any] = {"action": action}
        if action == "succeed":
            body["result"] = result
        elif result is not None:
            raise ValueError(f"action {action!r} takes no result")
        if action == "fail":
            if error is None:
                raise ValueError("action 'fail' needs an error (a message, or {'type', 'message', 'data'})")
            info: dict[str, Any] = (
                {"type": "declared_failure", "message": error} if isinstance(error, str) else dict(error)
            )
            info.setdefault("retryable", not final)
            body["error"] = info
        elif error is not None or final:
            raise ValueError("error= and final= go with action 'fail'")
        if reason is not None:
            body["reason"] = reason
        path = f"/v1/runs/{_segment(run_id)}/steps/{_segment(step_id)}/{_segment(phase)}/{_segment(generation)}/resolve"
        return _Call("POST", path, _run, body)

    @staticmethod
    def complete(token: str, result: Any, error: str | dict[str, Any] | None, final: bool) -> _Call:
        if not isinstance(token, str) or not token:
            raise ValueError("token must be the completion token the step's callback handed out")
        if error is None:
            if final:
                raise ValueError("final= goes with fail")
            body: dict[str, Any] = {"result": result}
        else:
            info: dict[str, Any] = (
                {"type": "declared_failure", "message": error} if isinstance(error, str) else dict(error)
            )
            info.setdefault("retryable", not final)
            body = {"error": info}
        return _Call("POST", f"/v1/completions/{_segment(token)}", _run, body)

    @staticmethod
    def sync(app_id: str, url: str) -> _Call:
        return _Call("PUT", f"/v1/apps/{_segment(app_id)}", lambda _, b: b, {"url": url})

    @staticmethod
    def manifest(url: str) -> _Call:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"an app's URL must be http(s)://...: {url!r}")

        def parse(_: int, body: Any) -> dict[str, Any]:
            if not isinstance(body, dict) or not isinstance(body.get("app_id"), str):
                raise ApiError(f"{url} did not return a Ryusen manifest (no app_id)", code="not_a_manifest")
            return body

        return _Call("GET", url, parse)

    @staticmethod
    def functions() -> _Call:
        return _Call("GET", "/v1/functions", lambda _, b: list(b.get("functions", [])))

    @staticmethod
    def apps() -> _Call:
        return _Call("GET", "/v1/apps", lambda _, b: list(b.get("apps", [])))


def blocker_for(run: Run, step_id: str, phase: str | None) -> tuple[str, int]:
    """The phase and generation of the one blocked attempt of ``step_id`` (what ``resolve`` acts on when the
    caller names only the step)."""
    found = {
        (str(b["phase"]), int(b["generation"]))
        for b in run.blockers
        if b.get("step_id") == step_id
        and b.get("generation") is not None
        and b.get("phase") is not None
        and (phase is None or b.get("phase") == phase)
    }
    if len(found) != 1:
        what = "no blocker" if not found else f"{len(found)} blockers"
        raise ValueError(
            f"run {run.id} has {what} on step {step_id!r}{f' ({phase})' if phase else ''}: pass phase= and generation="
        )
    return found.pop()


RESOLVE_FOLLOWS = 3
"""How many times a resolve that names only the step follows its blocker to a newer generation."""


def blocker_moved(
    refusal: ConflictError, attempt: tuple[str, int], run: Run, step_id: str, phase: str | None
) -> tuple[str, int] | None:
    """The attempt the step's blocker names now, if ``refusal`` says the one resolved had settled and the blocker
    has moved on from it; else None (the refusal stands). A blocked run's probe takes its blocked pass again,
    which fences the generation it held and names the next in the same blocker: a resolve of the generation read
    a moment before meets ``generation_settled``, while the caller who named only the step meant the blocker."""
    if refusal.code != "generation_settled":
        return None
    try:
        now = blocker_for(run, step_id, phase)
    except ValueError:
        return None  # no blocker on the step any more: someone else moved it on
    return now if now != attempt else None


def _check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not run_id:
        raise ValueError("run_id must be a non-empty string")
    return run_id


# --- transport --------------------------------------------------------------------------------------------------------


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def signing_region(url: str, configured: str | None = None) -> str:
    """The region a request to ``url`` is signed for: the API's own where its URL says (``*.execute-api.<region>
    .amazonaws.com``), else ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` / the profile's (a custom domain)."""
    match = re.search(r"\.execute-api\.([a-z0-9-]+)\.amazonaws\.com(\.cn)?$", urlsplit(url).hostname or "")
    if match:
        return match.group(1)
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or configured
    if region:
        return region
    raise AuthorizationError(
        f"cannot tell the AWS region to sign requests to {url} with; set AWS_REGION", code="no_region"
    )


def _sigv4(url: str) -> Any:
    """An httpx auth that signs requests to ``url``'s origin with SigV4 (``execute-api``); others go unsigned."""
    try:
        import botocore.exceptions
        import botocore.session
    except ImportError:
        raise AuthorizationError(
            f"signing requests to {url} with SigV4 needs botocore: pip install boto3", code="no_botocore"
        ) from None

    try:
        session = botocore.session.get_session()
        credentials = session.get_credentials()
    except botocore.exceptions.BotoCoreError as exc:
        raise AuthorizationError(
            f"cannot load AWS credentials to sign requests to {url}: {exc}", code="no_credentials"
        ) from None
    if credentials is None:
        raise AuthorizationError(
            f"no AWS credentials found to sign requests to {url} (a deployed API is called with SigV4; "
            "configure the AWS credential chain)",
            code="no_credentials",
        )
    frozen_source = credentials
    region = signing_region(url, session.get_config_variable("region"))
    base = httpx.URL(url)
    origin = (base.scheme, base.host, base.port)

    class SigV4(httpx.Auth):
        requires_request_body = True

        def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
            if (request.url.scheme, request.url.host, request.url.port) == origin:
                from botocore.auth import SigV4Auth
                from botocore.awsrequest import AWSRequest

                signed = AWSRequest(method=request.method, url=str(request.url), data=request.content)
                try:  # refreshable credentials (SSO, assumed roles) refresh here
                    frozen = frozen_source.get_frozen_credentials()
                except botocore.exceptions.BotoCoreError as exc:
                    raise AuthorizationError(f"cannot refresh AWS credentials: {exc}", code="no_credentials") from None
                SigV4Auth(frozen, SIGV4_SERVICE, region).add_auth(signed)
                for name in ("Authorization", "X-Amz-Date", "X-Amz-Security-Token"):
                    if name in signed.headers:
                        request.headers[name] = signed.headers[name]
            yield request

    return SigV4()


def _settings(url: str | None, auth: Auth) -> tuple[str, Any]:
    base = (url or os.environ.get("RYUSEN_URL") or DEFAULT_URL).rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"url must be http(s)://...: {base!r}")
    if auth not in ("auto", "sigv4", "none"):
        raise ValueError("auth must be 'auto', 'sigv4' or 'none'")
    sign = auth == "sigv4" or (auth == "auto" and not is_loopback(base))
    if sign and base.startswith("http://") and not is_loopback(base):
        raise ValueError(
            f"{base} is plain http: a request signed with AWS credentials would travel in the clear; use the API's"
            " https:// URL (or auth='none' for a server that takes unsigned requests)"
        )
    return base, _sigv4(base) if sign else None


def _unreachable(url: str, method: str, path: str, exc: Exception) -> ConnectionFailedError:
    """``url`` is the API's; ``path`` may be another origin's absolute URL (an app's manifest)."""
    target = path if path.startswith(("http://", "https://")) else url
    where = {"url": target}
    if isinstance(exc, httpx.ConnectError):
        local = target == url and is_loopback(url)
        hint = " (is `ryusen dev` running? or pass the deployed API's URL)" if local else ""
        return ConnectionFailedError(f"cannot connect to {target}{hint}", code="connection_failed", details=where)
    if isinstance(exc, httpx.TimeoutException):
        return ConnectionFailedError(f"{method} {path}: no answer in time ({exc})", code="timeout", details=where)
    return ConnectionFailedError(f"{method} {path} failed: {exc}", code="connection_failed", details=where)


def _read(call: _Call, response: httpx.Response) -> Any:
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code >= 400:
        raise _error_for(response.status_code, body, response.text)
    if body is None:
        raise ApiError(
            f"{call.method} {call.path}: HTTP {response.status_code} with a body that is not JSON",
            code="malformed_answer",
            status=response.status_code,
        )
    return call.parse(response.status_code, body)


# --- the clients ------------------------------------------------------------------------------------------------------


class Client:
    """The server API for application code.

    >>> client = Client("http://127.0.0.1:8700")   # ryusen dev; a deployed API's URL is signed with SigV4
    >>> client.url
    'http://127.0.0.1:8700'

    ``url`` defaults to ``RYUSEN_URL``, then ``ryusen dev``'s. ``auth="auto"`` signs requests to any host but
    loopback; ``"sigv4"`` always signs (an API behind a proxy on loopback), ``"none"`` never does.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        auth: Auth = "auto",
        timeout: float = REQUEST_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url, signer = _settings(url, auth)
        self._http = httpx.Client(
            base_url=self.url,
            auth=signer,
            timeout=timeout,
            headers={"user-agent": "ryusen-client"},
            transport=transport,
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: _Call) -> Any:
        try:
            response = self._http.request(call.method, call.path, json=call.body, params=call.params)
        except httpx.HTTPError as exc:
            raise _unreachable(self.url, call.method, call.path, exc) from None
        return _read(call, response)

    # -- runs

    def start(
        self,
        function: str,
        input: Any = None,
        *,
        idempotency_key: str | None = None,
        timeout: timedelta | float | None = None,
    ) -> RunHandle:
        """Start a run of ``function`` with ``input``. With ``idempotency_key``, starting again returns the same
        run (``handle.created`` is False); the same key with a different input raises ConflictError
        ``idempotency_key_reused``. ``timeout`` bounds the whole run (its deadline)."""
        run, created = self._send(_Requests.start(function, input, idempotency_key, timeout))
        return RunHandle(self, run.id, run, created)

    def handle(self, run_id: str) -> RunHandle:
        """A handle on an existing run (no request is made)."""
        return RunHandle(self, _check_run_id(run_id), None, False)

    def get(self, run_id: str) -> Run:
        return self._send(_Requests.get(_check_run_id(run_id)))  # type: ignore[no-any-return]

    def wait(self, run_id: str, timeout: timedelta | float | None = None, *, return_when_blocked: bool = False) -> Run:
        """Poll until the run finishes; WaitTimeoutError after ``timeout`` (None: no limit). With
        ``return_when_blocked``, also return once the run is blocked and has not changed for a moment (an
        Unknown outcome waits for a person, or for a late result)."""
        limit = _seconds(timeout, "timeout")
        deadline = None if limit is None else clock() + limit
        interval, last, since = POLL_INITIAL_S, None, clock()
        while True:
            run = self.get(run_id)
            now = clock()
            if run.finished:
                return run
            if run.view != last:
                last, since = run.view, now
            elif return_when_blocked and run.blocked and now - since >= BLOCKED_QUIET_S:
                return run
            if deadline is not None and now >= deadline:
                raise WaitTimeoutError(run, limit or 0.0)
            sleep(interval if deadline is None else min(interval, max(deadline - now, 0.0)))
            interval = min(interval * POLL_GROWTH, POLL_MAX_S)

    def result(self, run_id: str, timeout: timedelta | float | None = None) -> Any:
        """Wait for the run and return its output; RunFailedError if it finished failed, cancelled or timed
        out."""
        run = self.wait(run_id, timeout)
        if run.outcome != "completed":
            raise RunFailedError(run)
        return run.output

    def list(
        self,
        *,
        function: str | None = None,
        phase: str | None = None,
        outcome: str | None = None,
        recovery: str | None = None,
        blocked: bool | None = None,
        idempotency_key: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> RunPage:
        """One page of runs, newest first (summaries: ``get`` a run for its steps). ``idempotency_key`` (with
        ``function``) finds the run that key started."""
        call = _Requests.list(function, phase, outcome, limit, cursor, recovery, blocked, idempotency_key)
        return self._send(call)  # type: ignore[no-any-return]

    def runs(
        self,
        *,
        function: str | None = None,
        phase: str | None = None,
        outcome: str | None = None,
        recovery: str | None = None,
        blocked: bool | None = None,
    ) -> Iterator[Run]:
        """Every run that matches, newest first, page after page."""
        cursor: str | None = None
        while True:
            page = self.list(
                function=function, phase=phase, outcome=outcome, recovery=recovery, blocked=blocked, cursor=cursor
            )
            yield from page.runs
            if not page.cursor:
                return
            cursor = page.cursor

    # -- operator actions

    def cancel(self, run_id: str, reason: str | None = None) -> Run:
        """Record the stop intent: the run stops starting steps, settles what is in flight, and compensates."""
        return self._send(_Requests.cancel(_check_run_id(run_id), reason))  # type: ignore[no-any-return]

    def rediscover(self, run_id: str) -> Run:
        """Retry a run blocked on its definition (a duplicate step id...), after a fix is released."""
        return self._send(_Requests.rediscover(_check_run_id(run_id)))  # type: ignore[no-any-return]

    def resolve(
        self,
        run_id: str,
        step_id: str,
        action: ResolveAction,
        *,
        result: Any = None,
        error: str | dict[str, Any] | None = None,
        final: bool = False,
        phase: str | None = None,
        generation: int | None = None,
        reason: str | None = None,
    ) -> Run:
        """Decide a blocked attempt: ``"succeed"`` with its ``result``, ``"fail"`` with an ``error`` (a message
        or ``{"type", "message", "data"}``; ``final=True`` allows no retry), ``"retry"``, or ``"skip"`` (a
        compensation no pass reached). Without ``phase`` and ``generation``, the step's one blocker is meant,
        at whatever generation it is when the server takes the resolution (see :func:`blocker_moved`)."""
        if phase is not None and generation is not None:
            call = _Requests.resolve(run_id, step_id, phase, generation, action, result, error, final, reason)
            return self._send(call)  # type: ignore[no-any-return]
        attempt = blocker_for(self.get(run_id), step_id, phase)
        for _ in range(RESOLVE_FOLLOWS):
            call = _Requests.resolve(run_id, step_id, *attempt, action, result, error, final, reason)
            try:
                return self._send(call)  # type: ignore[no-any-return]
            except ConflictError as exc:
                if (moved := blocker_moved(exc, attempt, self.get(run_id), step_id, phase)) is None:
                    raise
                attempt = moved
        call = _Requests.resolve(run_id, step_id, *attempt, action, result, error, final, reason)
        return self._send(call)  # type: ignore[no-any-return]

    # -- steps completed from outside (decision 32)

    def complete(self, token: str, result: Any = None) -> Run:
        """Complete the step waiting for ``token`` (``ryusen.operation().completion_token``) with ``result``: it
        is the step's result, and the run goes on. ConflictError ``completion_refused`` if the attempt the token
        names no longer waits (a retry replaced it, it timed out, a stop fenced it); NotFoundError for a token
        this deployment did not make."""
        return self._send(_Requests.complete(token, result, None, False))  # type: ignore[no-any-return]

    def fail(self, token: str, error: str | dict[str, Any], *, final: bool = False) -> Run:
        """Fail the step waiting for ``token``: ``error`` is a message or ``{"type", "message", "data"}``; the
        step's retry policy applies (a retry hands out a new token), or none with ``final=True``."""
        return self._send(_Requests.complete(token, None, error, final))  # type: ignore[no-any-return]

    # -- apps and functions

    def manifest(self, url: str) -> dict[str, Any]:
        """The manifest an app's endpoint serves at ``url`` (its app id, functions, release and build)."""
        return self._send(_Requests.manifest(url))  # type: ignore[no-any-return]

    def sync(self, url: str, *, app_id: str | None = None) -> dict[str, Any]:
        """Record a release of the app served at ``url`` (the server reads its manifest) and wake its blocked
        runs; ``app_id`` defaults to the manifest's."""
        if app_id is None:
            app_id = str(self.manifest(url)["app_id"])
        return self._send(_Requests.sync(app_id, url))  # type: ignore[no-any-return]

    def functions(self) -> Records:
        """Every function with its newest release."""
        return self._send(_Requests.functions())  # type: ignore[no-any-return]

    def apps(self) -> Records:
        """Every app with its newest release and its functions."""
        return self._send(_Requests.apps())  # type: ignore[no-any-return]


class AsyncClient:
    """``Client`` for asyncio code: the same methods, awaited."""

    def __init__(
        self,
        url: str | None = None,
        *,
        auth: Auth = "auto",
        timeout: float = REQUEST_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url, signer = _settings(url, auth)
        self._http = httpx.AsyncClient(
            base_url=self.url,
            auth=signer,
            timeout=timeout,
            headers={"user-agent": "ryusen-client"},
            transport=transport,
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _send(self, call: _Call) -> Any:
        try:
            response = await self._http.request(call.method, call.path, json=call.body, params=call.params)
        except httpx.HTTPError as exc:
            raise _unreachable(self.url, call.method, call.path, exc) from None
        return _read(call, response)

    async def start(
        self,
        function: str,
        input: Any = None,
        *,
        idempotency_key: str | None = None,
        timeout: timedelta | float | None = None,
    ) -> AsyncRunHandle:
        run, created = await self._send(_Requests.start(function, input, idempotency_key, timeout))
        return AsyncRunHandle(self, run.id, run, created)

    def handle(self, run_id: str) -> AsyncRunHandle:
        return AsyncRunHandle(self, _check_run_id(run_id), None, False)

    async def get(self, run_id: str) -> Run:
        return await self._send(_Requests.get(_check_run_id(run_id)))  # type: ignore[no-any-return]

    async def wait(
        self, run_id: str, timeout: timedelta | float | None = None, *, return_when_blocked: bool = False
    ) -> Run:
        limit = _seconds(timeout, "timeout")
        loop = asyncio.get_running_loop()
        deadline = None if limit is None else loop.time() + limit
        interval, last, since = POLL_INITIAL_S, None, loop.time()
        while True:
            run = await self.get(run_id)
            now = loop.time()
            if run.finished:
                return run
            if run.view != last:
                last, since = run.view, now
            elif return_when_blocked and run.blocked and now - since >= BLOCKED_QUIET_S:
                return run
            if deadline is not None and now >= deadline:
                raise WaitTimeoutError(run, limit or 0.0)
            await asyncio.sleep(interval if deadline is None else min(interval, max(deadline - now, 0.0)))
            interval = min(interval * POLL_GROWTH, POLL_MAX_S)

    async def result(self, run_id: str, timeout: timedelta | float | None = None) -> Any:
        run = await self.wait(run_id, timeout)
        if run.outcome != "completed":
            raise RunFailedError(run)
        return run.output

    async def list(
        self,
        *,
        function: str | None = None,
        phase: str | None = None,
        outcome: str | None = None,
        recovery: str | None = None,
        blocked: bool | None = None,
        idempotency_key: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> RunPage:
        call = _Requests.list(function, phase, outcome, limit, cursor, recovery, blocked, idempotency_key)
        return await self._send(call)  # type: ignore[no-any-return]

    async def runs(
        self,
        *,
        function: str | None = None,
        phase: str | None = None,
        outcome: str | None = None,
        recovery: str | None = None,
        blocked: bool | None = None,
    ) -> AsyncIterator[Run]:
        cursor: str | None = None
        while True:
            page = await self.list(
                function=function, phase=phase, outcome=outcome, recovery=recovery, blocked=blocked, cursor=cursor
            )
            for run in page.runs:
                yield run
            if not page.cursor:
                return
            cursor = page.cursor

    async def cancel(self, run_id: str, reason: str | None = None) -> Run:
        return await self._send(_Requests.cancel(_check_run_id(run_id), reason))  # type: ignore[no-any-return]

    async def rediscover(self, run_id: str) -> Run:
        return await self._send(_Requests.rediscover(_check_run_id(run_id)))  # type: ignore[no-any-return]

    async def resolve(
        self,
        run_id: str,
        step_id: str,
        action: ResolveAction,
        *,
        result: Any = None,
        error: str | dict[str, Any] | None = None,
        final: bool = False,
        phase: str | None = None,
        generation: int | None = None,
        reason: str | None = None,
    ) -> Run:
        if phase is not None and generation is not None:
            call = _Requests.resolve(run_id, step_id, phase, generation, action, result, error, final, reason)
            return await self._send(call)  # type: ignore[no-any-return]
        attempt = blocker_for(await self.get(run_id), step_id, phase)
        for _ in range(RESOLVE_FOLLOWS):
            call = _Requests.resolve(run_id, step_id, *attempt, action, result, error, final, reason)
            try:
                return await self._send(call)  # type: ignore[no-any-return]
            except ConflictError as exc:
                if (moved := blocker_moved(exc, attempt, await self.get(run_id), step_id, phase)) is None:
                    raise
                attempt = moved
        call = _Requests.resolve(run_id, step_id, *attempt, action, result, error, final, reason)
        return await self._send(call)  # type: ignore[no-any-return]

    async def complete(self, token: str, result: Any = None) -> Run:
        return await self._send(_Requests.complete(token, result, None, False))  # type: ignore[no-any-return]

    async def fail(self, token: str, error: str | dict[str, Any], *, final: bool = False) -> Run:
        return await self._send(_Requests.complete(token, None, error, final))  # type: ignore[no-any-return]

    async def manifest(self, url: str) -> dict[str, Any]:
        return await self._send(_Requests.manifest(url))  # type: ignore[no-any-return]

    async def sync(self, url: str, *, app_id: str | None = None) -> dict[str, Any]:
        if app_id is None:
            app_id = str((await self.manifest(url))["app_id"])
        return await self._send(_Requests.sync(app_id, url))  # type: ignore[no-any-return]

    async def functions(self) -> Records:
        return await self._send(_Requests.functions())  # type: ignore[no-any-return]

    async def apps(self) -> Records:
        return await self._send(_Requests.apps())  # type: ignore[no-any-return]


class RunHandle:
    """A started (or named) run: ``id``, ``created`` (False when an idempotency key found an existing run), and
    the run's actions without repeating its id."""

    def __init__(self, client: Client, run_id: str, run: Run | None, created: bool) -> None:
        self.client = client
        self.id = run_id
        self.run = run
        """The run as the start answered it (None for ``client.handle``)."""
        self.created = created

    def __repr__(self) -> str:
        return f"RunHandle({self.id!r})"

    def get(self) -> Run:
        return self.client.get(self.id)

    def wait(self, timeout: timedelta | float | None = None, *, return_when_blocked: bool = False) -> Run:
        return self.client.wait(self.id, timeout, return_when_blocked=return_when_blocked)

    def result(self, timeout: timedelta | float | None = None) -> Any:
        return self.client.result(self.id, timeout)

    def cancel(self, reason: str | None = None) -> Run:
        return self.client.cancel(self.id, reason)


class AsyncRunHandle:
    """``RunHandle`` for ``AsyncClient``."""

    def __init__(self, client: AsyncClient, run_id: str, run: Run | None, created: bool) -> None:
        self.client = client
        self.id = run_id
        self.run = run
        self.created = created

    def __repr__(self) -> str:
        return f"AsyncRunHandle({self.id!r})"

    async def get(self) -> Run:
        return await self.client.get(self.id)

    async def wait(self, timeout: timedelta | float | None = None, *, return_when_blocked: bool = False) -> Run:
        return await self.client.wait(self.id, timeout, return_when_blocked=return_when_blocked)

    async def result(self, timeout: timedelta | float | None = None) -> Any:
        return await self.client.result(self.id, timeout)

    async def cancel(self, reason: str | None = None) -> Run:
        return await self.client.cancel(self.id, reason)


__all__ = [
    "ApiError",
    "AsyncClient",
    "AsyncRunHandle",
    "AuthorizationError",
    "Client",
    "ConflictError",
    "ConnectionFailedError",
    "InvalidRequestError",
    "NotFoundError",
    "Run",
    "RunFailedError",
    "RunHandle",
    "RunPage",
    "ServerUnavailableError",
    "WaitTimeoutError",
]

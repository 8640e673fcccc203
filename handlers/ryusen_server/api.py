"""The server API (contract 2) as a Powertools REST resolver over the engine.

Routes parse and validate at the edge (Powertools' parser over pydantic models,
extra fields refused)
and translate the engine's errors into ``{"error": {"code", "message"}}`` with
a 4xx status. Nothing is written unless the request is valid.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Literal

from aws_lambda_powertools.event_handler import APIGatewayRestResolver, Response
from aws_lambda_powertools.utilities.parser import parse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ryusen._internal.wire import (
    MAX_RUN_TIMEOUT_S,
    MAX_VALUE_DEPTH,
    ErrorInfo,
    Manifest,
    Phase,
    json_value_problem,
    loads_strict,
)

from .core.events import Resolve
from .core.model import Outcome, Recovery, RunPhase, RunState
from .core.view import run_summary_view, run_view
from .engine import MAX_HEARTBEAT_BYTES, MAX_LATE_RESULT_BYTES, Engine
from .ports import InvalidRequestError, PayloadTooLargeError, ServerError

logger = logging.getLogger("ryusen.api")

MAX_BODY_BYTES = 1024 * 1024

ManifestFetcher = Callable[[str, str], tuple[Manifest, frozenset[str]]]
"""GET app ``app_id``'s endpoint's manifest (app id, URL): it, and the features its SDK announced."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class SyncRequest(_Body):
    url: str = Field(min_length=1, max_length=2048, pattern=r"^https?://")


class StartRunRequest(_Body):
    input: Any = None
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=256)
    timeout_s: float | None = Field(default=None, gt=0, le=MAX_RUN_TIMEOUT_S, strict=True, allow_inf_nan=False)


class CompletionRequest(_Body):
    """The result of a step completed from outside, or its failure: exactly one (decision 32)."""

    result: Any = None
    error: ErrorInfo | None = None
    """``retryable: false`` fails the step for good; otherwise its retry policy applies (a new token)."""


class CancelRequest(_Body):
    reason: str | None = Field(default=None, max_length=1024)


class ResolveRequest(_Body):
    action: Literal["succeed", "fail", "retry", "skip"]
    result: Any = None
    error: ErrorInfo | None = None
    reason: str | None = Field(default=None, max_length=1024)
    """Why: kept on the attempt with the resolution (decisions 28)."""


_LIST_FILTERS = ("function_id", "phase", "outcome", "recovery", "blocked", "idempotency_key")
"""What ``GET /v1/runs`` filters on (each optional; ``idempotency_key`` needs ``function_id``)."""


def _matches(state: RunState, params: dict[str, str]) -> bool:
    """``state`` passes the listing's filters other than its function and idempotency key."""
    return (
        params.get("phase") in (None, state.phase.value)
        and params.get("outcome") in (None, state.outcome.value if state.outcome else None)
        and params.get("recovery") in (None, state.recovery.value if state.recovery else None)
        and params.get("blocked") in (None, "true" if state.blockers else "false")
    )


def _caller(api: Any) -> str | None:
    """Who made the request, where API Gateway's IAM authorization says (the caller's ARN); None locally."""
    try:
        identity = api.current_event.request_context.identity
        return str(identity.user_arn) if identity.user_arn else None
    except (AttributeError, KeyError, TypeError):
        return None


class MalformedJsonError(ServerError):
    code = "malformed_json"
    status = 400


def _checked_value(what: str, value: Any) -> Any:
    """``value`` if the server can store it (:func:`json_value_problem`), else a 422 that says why."""
    if (problem := json_value_problem(value)) is not None:
        raise InvalidRequestError(f"{what} {problem}", code="invalid_value")
    return value


def error_body(exc: ServerError) -> str:
    """The JSON body that answers ``exc``: ``{"error": {"code", "message", ...details}}``."""
    return _error_payload(str(exc.details.get("code", exc.code)), exc.message, exc.details)


def _error_payload(code: str, message: str, details: dict[str, Any] | None) -> str:
    payload: dict[str, Any] = {"code": code, "message": message}
    payload.update({k: v for k, v in (details or {}).items() if k != "code"})
    return json.dumps({"error": payload}, default=str)


def _error_response(status: int, code: str, message: str, details: dict[str, Any] | None = None) -> Response[str]:
    return Response(status_code=status, content_type="application/json", body=_error_payload(code, message, details))


def _json(status: int, body: Any) -> Response[str]:
    return Response(status_code=status, content_type="application/json", body=json.dumps(body, default=str))


_CURRENT_EVENT: ContextVar[Any] = ContextVar("ryusen_api_event", default=None)


class RequestResolver(APIGatewayRestResolver):
    """Powertools' REST resolver with the event it is resolving kept per request.

    Powertools keeps the current event on the class (``BaseRouter.current_event``): where requests are
    resolved at once (``ryusen dev`` serves its API from threads), one request would route, read its body and
    log by another's event. Here each request's event is its own (a context variable: per thread, per task).
    """

    @property
    def current_event(self) -> Any:
        return _CURRENT_EVENT.get()

    @current_event.setter
    def current_event(self, value: Any) -> None:
        _CURRENT_EVENT.set(value)

    def resolve(self, event: Any, context: Any) -> dict[str, Any]:
        token = _CURRENT_EVENT.set(self._to_proxy_event(event))
        try:
            return super().resolve(event, context)
        finally:
            _CURRENT_EVENT.reset(token)


def build_api(engine: Engine, fetch_manifest: ManifestFetcher) -> APIGatewayRestResolver:
    api = RequestResolver(strip_prefixes=[])

    def view(state: RunState) -> dict[str, Any]:
        """The run view, with each attempt of a step completed from outside showing its completion token (what an
        operator completes it with: the operator API is theirs)."""
        shown = run_view(state)
        for step in shown["steps"]:
            if step.get("external"):
                for attempt in step["attempts"]:
                    if attempt["phase"] == "forward":
                        attempt["completion_token"] = engine.completion_token(
                            state, step["id"], Phase.FORWARD, attempt["generation"]
                        )
        return shown

    def body_of(model: type[_Body], *, optional: bool = False) -> Any:
        raw = api.current_event.body
        if raw is not None and len(raw.encode("utf-8", "surrogatepass")) > MAX_BODY_BYTES:
            raise PayloadTooLargeError(f"request body is over {MAX_BODY_BYTES} bytes", limit=MAX_BODY_BYTES)
        if raw is None or raw.strip() == "":
            if optional:
                return model()
            raise MalformedJsonError("request body is empty; a JSON object is required")
        try:
            data = loads_strict(raw, max_depth=MAX_VALUE_DEPTH + 3)  # a value's own, and the objects around it
        except ValueError as exc:
            raise MalformedJsonError(f"request body is not acceptable JSON: {exc}") from None
        if not isinstance(data, dict):
            raise InvalidRequestError("request body must be a JSON object")
        return parse(event=data, model=model)

    @api.exception_handler(ServerError)  # type: ignore[untyped-decorator]
    def server_error(exc: ServerError) -> Response[str]:
        code = str(exc.details.get("code", exc.code))
        return _error_response(exc.status, code, exc.message, exc.details)

    @api.exception_handler(ValidationError)  # type: ignore[untyped-decorator]
    def validation_error(exc: ValidationError) -> Response[str]:
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors(include_url=False)]
        return _error_response(
            422, "invalid_request", "the request does not match the expected shape", {"errors": errors}
        )

    @api.exception_handler(Exception)  # type: ignore[untyped-decorator]
    def unexpected(exc: Exception) -> Response[str]:
        logger.exception("unexpected error answering %s %s", api.current_event.http_method, api.current_event.path)
        return _error_response(500, "internal_error", "the server failed to answer; the request may be retried")

    @api.not_found
    def not_found(_: Exception) -> Response[str]:
        return _error_response(
            404, "route_not_found", f"no route {api.current_event.http_method} {api.current_event.path}"
        )

    @api.put("/v1/apps/<app_id>")
    def sync_app(app_id: str) -> Response[str]:
        request = body_of(SyncRequest)
        manifest, features = fetch_manifest(app_id, request.url)
        release = engine.sync_release(app_id, request.url, manifest, features)
        return _json(
            200,
            {
                "app_id": release.app_id,
                "url": release.url,
                "release_id": release.release_id,
                "build_id": release.build_id,
                "functions": [f.model_dump() for f in release.functions],
                "synced_at": release.synced_at.isoformat(),
                "signed": release.signed,
            },
        )

    @api.get("/v1/apps")
    def list_apps() -> Response[str]:
        apps = [
            {
                "app_id": release.app_id,
                "url": release.url,
                "release_id": release.release_id,
                "build_id": release.build_id,
                "synced_at": release.synced_at.isoformat(),
                "signed": release.signed,
                "functions": [f.id for f in release.functions],
            }
            for release in sorted(engine.store.list_releases(), key=lambda r: r.app_id)
        ]
        return _json(200, {"apps": apps})

    @api.get("/v1/functions")
    def list_functions() -> Response[str]:
        functions = []
        for release in engine.store.list_releases():
            for fn in release.functions:
                functions.append(
                    {
                        "id": fn.id,
                        "app_id": release.app_id,
                        "timeout_s": fn.timeout_s,
                        "release": {
                            "release_id": release.release_id,
                            "build_id": release.build_id,
                            "url": release.url,
                            "synced_at": release.synced_at.isoformat(),
                        },
                    }
                )
        return _json(200, {"functions": functions})

    @api.post("/v1/functions/<function_id>/runs")
    def start_run(function_id: str) -> Response[str]:
        request = body_of(StartRunRequest)
        run_input = _checked_value("input", request.input)
        state, created = engine.start_run(
            function_id, run_input, idempotency_key=request.idempotency_key, timeout_s=request.timeout_s
        )
        return _json(201 if created else 200, view(state))

    @api.get("/v1/runs")
    def list_runs() -> Response[str]:
        params = api.current_event.query_string_parameters or {}
        unknown = set(params) - {*_LIST_FILTERS, "limit", "cursor"}
        if unknown:
            raise InvalidRequestError(f"unknown query parameters: {', '.join(sorted(unknown))}")
        choices = {"phase": RunPhase, "outcome": Outcome, "recovery": Recovery}
        for name, enum in choices.items():
            if (value := params.get(name)) is not None and value not in {v.value for v in enum}:
                raise InvalidRequestError(f"{name} must be one of {', '.join(v.value for v in enum)}")
        blocked = params.get("blocked")
        if blocked is not None and blocked not in ("true", "false"):
            raise InvalidRequestError("blocked must be true or false")
        key, function_id = params.get("idempotency_key"), params.get("function_id")
        if key is not None and not function_id:
            raise InvalidRequestError("idempotency_key needs function_id: a key names a run of one function")
        if key is not None and not 1 <= len(key) <= 256:
            raise InvalidRequestError("idempotency_key must be 1 to 256 characters")
        try:
            limit = int(params.get("limit", "50"))
        except ValueError:
            raise InvalidRequestError("limit must be an integer") from None
        if not 1 <= limit <= 200:
            raise InvalidRequestError("limit must be between 1 and 200")
        if key is not None and function_id:
            held = engine.store.run_for_idempotency_key(function_id, key)
            state = engine.store.get(held) if held is not None and params.get("cursor") is None else None
            matching = state is not None and _matches(state, params)
            runs = [run_summary_view(state)] if state is not None and matching else []
            return _json(200, {"runs": runs, "cursor": None})
        page = engine.store.list_runs(
            function_id=function_id,
            phase=params.get("phase"),
            outcome=params.get("outcome"),
            recovery=params.get("recovery"),
            blocked=None if blocked is None else blocked == "true",
            limit=limit,
            cursor=params.get("cursor"),
        )
        return _json(200, {"runs": page.runs, "cursor": page.cursor})

    @api.get("/v1/runs/<run_id>")
    def get_run(run_id: str) -> Response[str]:
        return _json(200, view(engine.get_run(run_id)))

    @api.post("/v1/runs/<run_id>/cancel")
    def cancel_run(run_id: str) -> Response[str]:
        request = body_of(CancelRequest, optional=True)
        engine.get_run(run_id)
        decision = engine.cancel(run_id, request.reason)
        return _json(202, view(decision.state))

    @api.post("/v1/runs/<run_id>/rediscover")
    def rediscover(run_id: str) -> Response[str]:
        engine.get_run(run_id)
        decision = engine.rediscover(run_id)
        return _json(202, view(decision.state))

    @api.post("/v1/runs/<run_id>/steps/<step_id>/<phase>/<generation>/resolve")
    def resolve(run_id: str, step_id: str, phase: str, generation: str) -> Response[str]:
        if phase not in {p.value for p in Phase}:
            raise InvalidRequestError(f"phase must be one of {', '.join(p.value for p in Phase)}")
        if not (generation.isascii() and generation.isdigit() and len(generation) <= 9) or int(generation) < 1:
            raise InvalidRequestError("generation must be a positive integer")
        request = body_of(ResolveRequest)
        _checked_value("result", request.result)
        _checked_value("error data", request.error.data if request.error is not None else None)
        if request.action == "fail" and request.error is None:
            raise InvalidRequestError('action \'fail\' needs an error: {"type": ..., "message": ...}')
        if request.action != "succeed" and request.result is not None:
            raise InvalidRequestError(f"action {request.action!r} takes no result")
        engine.get_run(run_id)
        decision = engine.resolve(
            run_id,
            Resolve(
                step_id=step_id,
                phase=Phase(phase),
                generation=int(generation),
                action=request.action,
                result=request.result,
                error=request.error,
                reason=request.reason,
                by=_caller(api),
            ),
        )
        return _json(200, view(decision.state))

    @api.post("/v1/completions/<token>")
    def complete(token: str) -> Response[str]:
        request = body_of(CompletionRequest)
        given = request.model_fields_set & {"result", "error"}
        if len(given) != 1 or (request.error is None and "error" in given):
            raise InvalidRequestError('give exactly one of "result" (any JSON value) or "error" ({"type", "message"})')
        _checked_value("result", request.result)
        _checked_value("error data", request.error.data if request.error is not None else None)
        decision = engine.complete(token, result=request.result, error=request.error, source=_caller(api) or "api")
        return _json(200, view(decision.state))

    @api.get("/v1/openapi.json")
    def openapi_document() -> Response[str]:
        from .openapi import document

        return _json(200, document())

    @api.post("/v1/results")
    def late_result() -> Response[str]:
        raw = api.current_event.body or ""
        headers = dict(api.current_event.headers or {})
        body = raw.encode("utf-8", "surrogatepass")
        if is_heartbeat(body):  # decision 33: posted to the same result URL
            return _json(200, engine.submit_heartbeat(body, headers).model_dump(mode="json"))
        if is_completion(body):  # decision 32: an app completes a step itself, signed with its key
            return _json(200, completion_answer(engine.submit_completion(body, headers)))
        decision = engine.submit_late_result(body, headers)
        return _json(202, {"accepted": decision.note is None, "note": decision.note})

    return api


def is_completion(body: bytes) -> bool:
    """A body posted to the result URL is an app's completion of a step (decision 32): marked so. (Past the size
    any post may have, it is not parsed here: the late result's own checks refuse it.)"""
    if len(body) > MAX_LATE_RESULT_BYTES:
        return False
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return isinstance(parsed, dict) and parsed.get("kind") == "completion"


def completion_answer(decision: Any) -> dict[str, Any]:
    """What an app is told of its completion: the run, and where it is now (not the run's whole view)."""
    state = decision.state
    return {"taken": True, "run_id": state.id, "phase": state.phase.value, "outcome": state.outcome}


def is_heartbeat(body: bytes) -> bool:
    """A body posted to the result URL is a heartbeat (decision 33), not a late result: small, and marked so."""
    if len(body) > MAX_HEARTBEAT_BYTES:
        return False  # a late result's own checks refuse it
    try:
        parsed = json.loads(body)
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get("kind") == "heartbeat"

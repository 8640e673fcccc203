"""The server API's OpenAPI document, built from the models its routes parse and answer with.

Request bodies are the models ``api.py`` validates them with; answers are ``schema.py``'s, which a test holds
to what the API sends. ``ryusen dev`` and a deployment serve it at ``GET /v1/openapi.json``;
``python -m ryusen_server.openapi --markdown`` writes the reference in docs/api.md (a test keeps it current).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from ryusen import __version__

from . import schema
from .api import CancelRequest, CompletionRequest, ResolveRequest, StartRunRequest, SyncRequest
from .core.model import Outcome, Recovery, RunPhase

REF = "#/components/schemas/{model}"


@dataclass(frozen=True)
class Param:
    name: str
    where: str  # path or query
    description: str
    schema: dict[str, Any] = field(default_factory=lambda: {"type": "string"})
    required: bool = True


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    summary: str
    description: str
    answers: dict[int, tuple[type[BaseModel] | None, str]]
    body: type[BaseModel] | None = None
    body_required: bool = True
    params: tuple[Param, ...] = ()
    refusals: tuple[tuple[int, str], ...] = ()
    """(status, the codes it carries): the refusals particular to this route."""
    tag: str = "runs"


RUN_ID = Param("run_id", "path", "The run's id (`run_...`).")
FUNCTION_ID = Param("function_id", "path", "The function's id, as the app declares it.")

ROUTES: tuple[Route, ...] = (
    Route(
        "PUT",
        "/v1/apps/{app_id}",
        "Sync an app",
        "Read the manifest the app serves at `url` (signed with the app's key), record it as the app's newest"
        " release, and wake the runs of its functions that wait for a fix. Sync again after every deploy.",
        {200: (schema.SyncAnswer, "The release recorded.")},
        body=SyncRequest,
        params=(Param("app_id", "path", "The app's id, as its manifest declares it."),),
        refusals=(
            (409, "`function_owned_by_other_app`: another app declares one of its functions"),
            (
                422,
                "`invalid_manifest`, `unsigned_app`, `manifest_too_large`, `app_id_mismatch`,"
                " `timeout_exceeds_maximum`, `endpoint_unreachable`, `endpoint_refused`",
            ),
        ),
        tag="apps",
    ),
    Route(
        "GET",
        "/v1/apps",
        "List apps",
        "Every synced app with its newest release.",
        {200: (schema.AppList, "The apps, by id.")},
        tag="apps",
    ),
    Route(
        "GET",
        "/v1/functions",
        "List functions",
        "Every function of every synced app, with the release that runs its next tasks.",
        {200: (schema.FunctionList, "The functions.")},
        tag="apps",
    ),
    Route(
        "POST",
        "/v1/functions/{function_id}/runs",
        "Start a run",
        "Start a run of the function with `input`. With `idempotency_key`, starting again returns the same run"
        " (200 instead of 201); the same key with a different input is refused. `timeout_s` sets the run's"
        " deadline (else the function's timeout, else the deployment's default).",
        {201: (schema.RunView, "The new run."), 200: (schema.RunView, "The run this idempotency key started.")},
        body=StartRunRequest,
        params=(FUNCTION_ID,),
        refusals=(
            (404, "`not_found`: no synced release declares the function"),
            (409, "`idempotency_key_reused`: the key started a run with another input (`run_id` names it)"),
            (413, "`payload_too_large`: the input is over the value limit"),
            (422, "`invalid_request`, `invalid_value`, `timeout_exceeds_maximum`"),
        ),
    ),
    Route(
        "GET",
        "/v1/runs",
        "List runs",
        "Runs, newest first, a page at a time.",
        {200: (schema.RunPage, "One page of runs.")},
        params=(
            Param("function_id", "query", "Only runs of this function.", required=False),
            Param("phase", "query", "Only runs in this phase.", {"enum": [p.value for p in RunPhase]}, False),
            Param("outcome", "query", "Only runs with this outcome.", {"enum": [o.value for o in Outcome]}, False),
            Param("recovery", "query", "Only runs with this recovery.", {"enum": [r.value for r in Recovery]}, False),
            Param(
                "blocked", "query", "Only blocked runs, or only runs not blocked.", {"enum": ["true", "false"]}, False
            ),
            Param(
                "idempotency_key",
                "query",
                "The run this key started (with `function_id`): a page of one run, or of none.",
                required=False,
            ),
            Param(
                "limit",
                "query",
                "Runs per page.",
                {"type": "integer", "minimum": 1, "maximum": 200, "default": 50},
                False,
            ),
            Param("cursor", "query", "The `cursor` of the previous page.", required=False),
        ),
        refusals=((422, "`invalid_request`: an unknown parameter or a bad value"),),
    ),
    Route(
        "GET",
        "/v1/runs/{run_id}",
        "Get a run",
        "The run with its steps, attempts, blockers and unwind.",
        {200: (schema.RunView, "The run.")},
        params=(RUN_ID,),
        refusals=((404, "`not_found`"),),
    ),
    Route(
        "POST",
        "/v1/runs/{run_id}/cancel",
        "Cancel a run",
        "Record the stop intent: no new step starts, what is in flight settles, and the completed steps are"
        " compensated in reverse. The reason is kept with the stop intent.",
        {202: (schema.RunView, "The run, with its stop intent.")},
        body=CancelRequest,
        body_required=False,
        params=(RUN_ID,),
        refusals=((404, "`not_found`"),),
    ),
    Route(
        "POST",
        "/v1/runs/{run_id}/rediscover",
        "Rediscover a run",
        "Run the function again from the top for a run blocked on its definition (a duplicate step id, a"
        " compensation target not reached...), once a fix is synced or the world it read has changed.",
        {202: (schema.RunView, "The run, its discovery queued.")},
        params=(RUN_ID,),
        refusals=((404, "`not_found`"), (409, "`no_definition_blocker`")),
    ),
    Route(
        "POST",
        "/v1/runs/{run_id}/steps/{step_id}/{phase}/{generation}/resolve",
        "Resolve an attempt",
        "An operator's decision about an attempt the run is blocked on: `succeed` with the result it had, `fail`"
        " with an error (`retryable: false` for a final failure), `retry` (consent to run the callback again),"
        " or `skip` a compensation no pass reached. The reason is kept on the attempt. Repeating the same"
        " decision changes nothing.",
        {200: (schema.RunView, "The run after the decision.")},
        body=ResolveRequest,
        params=(
            RUN_ID,
            Param("step_id", "path", "The step's id."),
            Param("phase", "path", "`forward` or `compensation`.", {"enum": ["forward", "compensation"]}),
            Param("generation", "path", "The attempt's generation.", {"type": "integer", "minimum": 1}),
        ),
        refusals=(
            (404, "`not_found`"),
            (
                409,
                "`attempt_not_unknown`, `generation_settled`, `generation_not_current`, `attempt_in_flight`,"
                " `skip_not_allowed`, `retry_after_stop`, `run_finished`, `step_not_found`, `attempt_not_found`",
            ),
        ),
    ),
    Route(
        "POST",
        "/v1/completions/{token}",
        "Complete a step",
        'Complete a step that waits for a completion from outside (`completion="external"`) with the token its'
        " callback handed out: `result` becomes the step's result and the run goes on; `error` fails the attempt"
        " (its retry policy applies, and a retry hands out a new token; `retryable: false` fails it for good)."
        " Only the attempt the token names, while it waits, takes it; any other completion is kept on the attempt"
        " and refused.",
        {200: (schema.RunView, "The run after the completion.")},
        body=CompletionRequest,
        params=(Param("token", "path", "The completion token (`ryusen.operation().completion_token`)."),),
        refusals=(
            (404, "`completion_not_found`: a token this deployment did not make"),
            (409, "`completion_refused`: the attempt no longer waits (kept on it as stale)"),
            (413, "`payload_too_large`"),
            (422, "`invalid_request`, `invalid_value`: not exactly one of `result` and `error`"),
        ),
    ),
    Route(
        "GET",
        "/v1/openapi.json",
        "This document",
        "The API's OpenAPI document.",
        {200: (None, "The OpenAPI 3.1 document.")},
        tag="meta",
    ),
)

COMMON_REFUSALS = (
    (400, "`malformed_json`, `invalid_content_length`"),
    (500, "`internal_error`: the request may be repeated"),
    (503, "`store_unavailable`: try again later; nothing changed unless the request was a write, which is safe"),
)


def _schemas() -> dict[str, Any]:
    """The JSON schema of every model the routes name, with ``$ref``s into ``components``."""
    models: list[type[BaseModel]] = [schema.ErrorBody]
    for route in ROUTES:
        if route.body is not None:
            models.append(route.body)
        models += [model for model, _ in route.answers.values() if model is not None]
    unique = list(dict.fromkeys(models))
    # one schema per model: an answer's fields are what it validates as (an error's traceback is left out when
    # there is none, which its serialization schema could not say)
    _, document = models_json_schema([(m, "validation") for m in unique], ref_template=REF)
    return dict(sorted(document.get("$defs", {}).items()))


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def document(server_url: str | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the server API."""
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        responses: dict[str, Any] = {}
        for status, (model, text) in sorted(route.answers.items()):
            answer: dict[str, Any] = {"description": text}
            if model is not None:
                answer["content"] = {"application/json": {"schema": _ref(model)}}
            else:
                answer["content"] = {"application/json": {"schema": {"type": "object"}}}
            responses[str(status)] = answer
        for status, codes in (*route.refusals, *COMMON_REFUSALS):
            responses[str(status)] = {
                "description": codes,
                "content": {"application/json": {"schema": _ref(schema.ErrorBody)}},
            }
        operation: dict[str, Any] = {
            "operationId": _operation_id(route),
            "summary": route.summary,
            "description": route.description,
            "tags": [route.tag],
            "responses": responses,
        }
        if route.params:
            operation["parameters"] = [
                {
                    "name": p.name,
                    "in": p.where,
                    "required": p.required or p.where == "path",
                    "description": p.description,
                    "schema": p.schema,
                }
                for p in route.params
            ]
        if route.body is not None:
            operation["requestBody"] = {
                "required": route.body_required,
                "content": {"application/json": {"schema": _ref(route.body)}},
            }
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Ryusen server API",
            "version": __version__,
            "description": (
                "Start and watch runs, and act on them as an operator. `ryusen dev` serves it on loopback,"
                " unsigned; a deployment serves it behind API Gateway, where every request is signed with"
                " SigV4 (service `execute-api`) and authorized by IAM. Every refusal is"
                ' `{"error": {"code": "...", "message": "..."}}` with a 4xx or 5xx status.'
            ),
        },
        **({"servers": [{"url": server_url}]} if server_url else {}),
        "tags": [
            {"name": "runs", "description": "Start, read and act on runs."},
            {"name": "apps", "description": "Apps, their releases and functions."},
            {"name": "meta", "description": "About the API."},
        ],
        "paths": paths,
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {
                "sigv4": {
                    "type": "apiKey",
                    "name": "Authorization",
                    "in": "header",
                    "description": "AWS Signature Version 4 (a deployment only; `ryusen dev` takes none).",
                }
            },
        },
        "security": [{"sigv4": []}],
    }


def _operation_id(route: Route) -> str:
    words = route.summary.lower().replace("this document", "openapi document").split()
    return words[0] + "".join(w.capitalize() for w in words[1:])


# ---- the reference in markdown -------------------------------------------------------------------------------------


def _type_of(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        name = str(prop["$ref"]).rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in prop:
        kinds = [_type_of(p) for p in prop["anyOf"]]
        return " or ".join(dict.fromkeys(kinds))
    if "enum" in prop:
        return " \\| ".join(f"`{v}`" for v in prop["enum"])
    if prop.get("type") == "array":
        return f"array of {_type_of(prop.get('items', {}))}"
    kind = prop.get("type")
    if kind is None:
        return "any JSON"
    if kind == "string" and prop.get("format") == "date-time":
        return "date-time"
    return str(kind)


def markdown() -> str:
    """docs/api.md: the routes, then every model, from :func:`document`."""
    doc = document()
    lines = [
        "# HTTP API reference",
        "",
        "<!-- generated by `python -m ryusen_server.openapi --markdown`: do not edit by hand -->",
        "",
        doc["info"]["description"],
        "",
        "The same document, as OpenAPI 3.1 JSON: `GET /v1/openapi.json` (with `ryusen dev` running:",
        "http://127.0.0.1:8700/v1/openapi.json). `ryusen.Client` (docs/client.md) makes every request below.",
        "",
        "| request | what it does |",
        "|---|---|",
    ]
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            anchor = op["operationId"].lower()
            lines.append(f"| [`{method.upper()} {path}`](#{anchor}) | {op['summary']} |")
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            lines += ["", f'<a id="{op["operationId"].lower()}"></a>', f"## {op['summary']}", ""]
            lines += [f"`{method.upper()} {path}`", "", op["description"], ""]
            if op.get("parameters"):
                lines += ["| parameter | in | what |", "|---|---|---|"]
                for p in op["parameters"]:
                    need = "" if p["required"] else " (optional)"
                    lines.append(f"| `{p['name']}` | {p['in']}{need} | {p['description']} |")
                lines.append("")
            if body := op.get("requestBody"):
                name = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
                need = "" if body["required"] else " (optional)"
                lines += [f"Body{need}: [{name}](#{name.lower()})", ""]
            lines += ["| status | answer |", "|---|---|"]
            for status, answer in op["responses"].items():
                ref = answer.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref")
                shown = f"[{ref.rsplit('/', 1)[-1]}](#{ref.rsplit('/', 1)[-1].lower()}): " if ref else ""
                lines.append(f"| {status} | {shown}{answer['description']} |")
    lines += ["", "# Models"]
    for name, model in doc["components"]["schemas"].items():
        lines += ["", f'<a id="{name.lower()}"></a>', f"## {name}", ""]
        if model.get("description"):
            lines += [" ".join(str(model["description"]).split()), ""]
        if "enum" in model:
            lines += ["One of " + ", ".join(f"`{v}`" for v in model["enum"]) + ".", ""]
            continue
        props = model.get("properties", {})
        if not props:
            continue
        required = set(model.get("required", []))
        lines += ["| field | type | what |", "|---|---|---|"]
        for prop_name, prop in props.items():
            need = "" if prop_name in required else " (optional)"
            what = " ".join(str(prop.get("description", "")).split())
            lines.append(f"| `{prop_name}`{need} | {_type_of(prop)} | {what} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--markdown", action="store_true", help="Print the reference as docs/api.md has it.")
    args = parser.parse_args(argv)
    sys.stdout.write(markdown() if args.markdown else json.dumps(document(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

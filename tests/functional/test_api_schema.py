"""The HTTP API reference is generated from the API's own models (issue 26), and those models hold to what the
API answers: every answer of a varied set of runs validates against them with unknown fields refused, and
docs/api.md is the reference as generated now."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from ryusen import NonRetryableError, RetryPolicy, Ryusen, Step
from ryusen.testing import WorkflowEnvironment
from ryusen_server import openapi, schema
from ryusen_server.api import build_api
from tests.conformance.test_security_and_bad_input import call

ROOT = Path(__file__).resolve().parents[2]


def app() -> Ryusen:
    shop = Ryusen("schema-shop")

    @shop.function("checkout", timeout=timedelta(hours=1))
    def checkout(order: dict[str, Any], step: Step) -> Any:
        step.run("reserve", lambda: {"sku": order["sku"]}, compensate=lambda r: {"released": r["sku"]})
        if order.get("decline"):
            step.run("charge", lambda: (_ for _ in ()).throw(NonRetryableError("declined", data={"code": 5})))
        charge = step.run(
            "charge", lambda: {"charge_id": "ch_1"}, retry=RetryPolicy(max_attempts=2), compensate=lambda c: None
        )
        if order.get("fail_after"):
            raise ValueError("rejected after the charge")
        return charge

    @shop.function("dup")
    def dup(order: Any, step: Step) -> Any:
        step.run("a", lambda: 1)
        return step.run("a", lambda: 2)

    @shop.function("unknown")
    def unknown(order: Any, step: Step) -> Any:
        step.run("done", lambda: 1, compensate=lambda r: None)
        return step.run("lost", lambda: "sent")

    @shop.function("approve")
    def approve(order: Any, step: Step) -> Any:
        return step.run("approval", lambda: "asked", completion="external", timeout=timedelta(hours=1))

    return shop


def answers() -> list[tuple[type[BaseModel], Any]]:
    """Real answers of every route, each with the model it must validate as."""
    shop = app()
    env = WorkflowEnvironment(shop)
    announced = env.engine.store.get_release("checkout").features  # type: ignore[union-attr]
    resolver = build_api(env.engine, lambda app_id, _: (shop.manifest(), announced))
    seen: list[tuple[type[BaseModel], Any]] = []

    def api(model: type[BaseModel], method: str, path: str, body: Any = None, query: Any = None) -> Any:
        status, answer = call(resolver, method, path, None if body is None else json.dumps(body), query)
        assert status < 400, answer
        seen.append((model, answer))
        return answer

    api(schema.SyncAnswer, "PUT", "/v1/apps/schema-shop", {"url": "https://shop.example.com/ryusen"})
    env.sync(shop)  # the kit's in-process endpoint serves the next tasks again
    env.faults.lose_result("lost")
    runs = [
        api(
            schema.RunView,
            "POST",
            "/v1/functions/checkout/runs",
            {"input": {"sku": "lamp"}, "idempotency_key": "k", "timeout_s": 600},
        ),
        api(schema.RunView, "POST", "/v1/functions/checkout/runs", {"input": {"sku": "lamp", "decline": True}}),
        api(schema.RunView, "POST", "/v1/functions/checkout/runs", {"input": {"sku": "lamp", "fail_after": True}}),
        api(schema.RunView, "POST", "/v1/functions/dup/runs", {"input": None}),
        api(schema.RunView, "POST", "/v1/functions/unknown/runs", {}),
    ]
    cancelled = api(schema.RunView, "POST", "/v1/functions/checkout/runs", {"input": {"sku": "desk"}})
    api(schema.RunView, "POST", f"/v1/runs/{cancelled['id']}/cancel", {"reason": "changed my mind"})
    env.drive(until=lambda: all(env.get(r["id"]).phase == "finished" or env.get(r["id"]).blockers for r in runs))
    unknown = api(schema.RunView, "GET", f"/v1/runs/{runs[4]['id']}")
    [blocker] = unknown["blockers"]
    api(
        schema.RunView,
        "POST",
        f"/v1/runs/{unknown['id']}/steps/lost/forward/{blocker['generation']}/resolve",
        {"action": "fail", "error": {"type": "declared_failure", "message": "never sent"}, "reason": "checked"},
    )
    api(schema.RunView, "POST", f"/v1/runs/{runs[3]['id']}/rediscover")
    env.drive(until=lambda: all(env.get(r["id"]).phase == "finished" or env.get(r["id"]).blockers for r in runs))
    for run in [*runs, cancelled]:
        api(schema.RunView, "GET", f"/v1/runs/{run['id']}")
    approving = api(schema.RunView, "POST", "/v1/functions/approve/runs", {"input": {}})
    env.drive(until=lambda: '"status": "waiting"' in json.dumps(env.get(approving["id"]).steps))
    waiting = api(schema.RunView, "GET", f"/v1/runs/{approving['id']}")
    token = waiting["steps"][0]["attempts"][-1]["completion_token"]
    api(schema.RunView, "POST", f"/v1/completions/{token}", {"result": {"approved": True}})
    api(schema.RunPage, "GET", "/v1/runs", query={"limit": "3"})
    api(schema.RunPage, "GET", "/v1/runs", query={"function_id": "checkout", "outcome": "failed"})
    api(schema.FunctionList, "GET", "/v1/functions")
    api(schema.AppList, "GET", "/v1/apps")
    status, refused = call(resolver, "GET", "/v1/runs/run_missing")
    assert status == 404
    seen.append((schema.ErrorBody, refused))
    return seen


def test_every_answer_validates_against_the_models_the_reference_is_made_from() -> None:
    seen = answers()
    for model, answer in seen:
        model.model_validate(answer)  # extra="forbid": a field the model lacks fails here
    views = [a for m, a in seen if m is schema.RunView]
    # the set is varied: a traceback, an Unknown's history, a resolution, a blocker, a stop intent, a deadline
    blob = json.dumps(views)
    for present in (
        '"traceback"',
        '"unknown": {',
        '"resolution": {',
        '"remedy"',
        '"kind": "cancel"',
        '"run_request"',
        '"status": "waiting"',
        '"completion_token": "rc1.',
    ):
        assert present in blob, present


def test_the_document_names_every_route_the_api_serves() -> None:
    doc = openapi.document()
    assert doc["openapi"] == "3.1.0"
    served = {
        (method, path)
        for method, path in [
            ("put", "/v1/apps/{app_id}"),
            ("get", "/v1/apps"),
            ("get", "/v1/functions"),
            ("post", "/v1/functions/{function_id}/runs"),
            ("get", "/v1/runs"),
            ("get", "/v1/runs/{run_id}"),
            ("post", "/v1/runs/{run_id}/cancel"),
            ("post", "/v1/runs/{run_id}/rediscover"),
            ("post", "/v1/runs/{run_id}/steps/{step_id}/{phase}/{generation}/resolve"),
            ("post", "/v1/completions/{token}"),
            ("get", "/v1/openapi.json"),
        ]
    }
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert documented == served
    api_source = (ROOT / "handlers" / "ryusen_server" / "api.py").read_text()
    for _, path in served:  # every documented route is one api.py declares (its <param> form)
        declared = path.replace("{", "<").replace("}", ">")
        assert f'"{declared}"' in api_source, declared
    refs = {m for m in json.dumps(doc).split('"') if m.startswith("#/components/schemas/")}
    assert {r.rsplit("/", 1)[-1] for r in refs} <= set(doc["components"]["schemas"])


def test_ryusen_dev_and_a_deployment_serve_the_document() -> None:
    shop = app()
    env = WorkflowEnvironment(shop)
    resolver = build_api(env.engine, lambda app_id, url: (shop.manifest(), frozenset()))
    status, doc = call(resolver, "GET", "/v1/openapi.json")
    assert status == 200 and doc == json.loads(json.dumps(openapi.document()))


def test_docs_api_md_is_the_reference_as_generated() -> None:
    written = (ROOT / "docs" / "api.md").read_text()
    if os.environ.get("RYUSEN_WRITE_API_DOCS"):
        (ROOT / "docs" / "api.md").write_text(openapi.markdown())
        pytest.skip("docs/api.md written")
    assert written == openapi.markdown(), (
        "docs/api.md is out of date: python -m ryusen_server.openapi --markdown > docs/api.md"
    )

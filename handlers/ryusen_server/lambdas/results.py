"""Lambda entry point for the result function: a Lambda Function URL (auth ``NONE``) that SDKs post outcomes and
heartbeats to (docs/design/dispatch.md).

An endpoint that acknowledged an attempt posts its outcome here when the callback ends; a callback posts its
heartbeats here. Neither carries AWS credentials: the app's signature is the authentication, checked by the
engine exactly as on the API's ``/v1/results`` route. A Function URL costs a Lambda request, where API
Gateway's REST API costs $3.50 per million, which would be more than the rest of a step.

An outcome is recorded with the run's next task authorized in the same write, and that task is invoked here
(``Engine.submit_result``), so that a run of long steps needs no queue message per step.

The result URL handed to SDKs is this function's own URL. A function's environment cannot name its own URL
(the template would be circular), so unless ``RYUSEN_RESULT_URL`` is set it is read from the
``requestContext.domainName`` of the first request that verified, and only in the form of a Function URL's
domain.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import replace
from typing import Any

from aws_lambda_powertools import Logger
from aws_lambda_powertools.utilities.typing import LambdaContext

from ..api import completion_answer, error_body, is_completion, is_heartbeat
from ..engine import MAX_LATE_RESULT_BYTES
from ..ports import ServerError
from ..wiring import AwsEngine, AwsResources, aws_engine

logger = Logger(service="ryusen-results")
_engine: AwsEngine | None = None

RESERVE_S = 3.0
"""Kept of the invocation's time to answer the SDK after carrying the run on."""
FRESH_KEYS_RECHECK_S = 10.0
"""How long the keys read afresh to verify a posted outcome or heartbeat are reused: an emergency rotation
refuses the old key here within this time (the API's route reads the secret for every late result), and a
post per long step does not cost a Secrets Manager read ($5 per million steps): a check every 10 s is one
request while the key is not rotated, at most $1.31 a month for a container busy all month (bench/cost.py)."""


FUNCTION_URL_DOMAIN = re.compile(r"[a-z0-9]{1,64}\.lambda-url\.[a-z0-9-]{1,32}\.on\.aws")
"""What a Lambda Function URL's domain looks like (``<url-id>.lambda-url.<region>.on.aws``)."""


def engine() -> AwsEngine:
    global _engine
    if _engine is None:
        _engine = aws_engine(AwsResources.from_env(), deployed=True, fresh_keys_recheck_s=FRESH_KEYS_RECHECK_S)
    return _engine


def _learn_own_url(wired: AwsEngine, domain: Any) -> None:
    """Take this function's URL, to hand SDKs, from a request that verified (never from one that did not), and only
    in the form of a Function URL's domain; until then the tasks it sends carry no result URL (they are waited
    for, not acknowledged)."""
    if wired.engine.settings.result_url is not None or not isinstance(domain, str):
        return
    if FUNCTION_URL_DOMAIN.fullmatch(domain):
        wired.engine.settings = replace(wired.engine.settings, result_url=f"https://{domain}/")


def _answer(status: int, body: Any) -> dict[str, Any]:
    return {"statusCode": status, "headers": {"content-type": "application/json"}, "body": json.dumps(body)}


@logger.inject_lambda_context(correlation_id_path="requestContext.requestId")
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    http = (event.get("requestContext") or {}).get("http") or {}
    path = str(http.get("path") or "/")  # what the SDK's signature covers: the path it posted to
    if http.get("method") != "POST":
        return _answer(405, {"error": {"code": "method_not_allowed", "message": "POST an outcome or a heartbeat"}})
    raw = event.get("body") or ""
    if len(raw) > 2 * MAX_LATE_RESULT_BYTES:  # before decoding: base64 is a third longer
        return _answer(413, {"error": {"code": "payload_too_large", "message": "the body is too large"}})
    try:
        body = base64.b64decode(raw, validate=True) if event.get("isBase64Encoded") else raw.encode()
    except ValueError:
        return _answer(400, {"error": {"code": "malformed_body", "message": "the body is not valid base64"}})
    headers = {str(k): str(v) for k, v in (event.get("headers") or {}).items()}
    wired = engine()
    domain = (event.get("requestContext") or {}).get("domainName")
    try:
        if is_heartbeat(body):
            reply = wired.engine.submit_heartbeat(body, headers, path=path)
            _learn_own_url(wired, domain)
            return _answer(200, reply.model_dump(mode="json"))
        if is_completion(body):  # decision 32: the app completes a step itself
            taken = wired.engine.submit_completion(body, headers, path=path)
            _learn_own_url(wired, domain)
            return _answer(200, completion_answer(taken))
        budget_s = max(0.0, context.get_remaining_time_in_millis() / 1000 - RESERVE_S)
        decision = wired.engine.submit_result(body, headers, budget_s=budget_s, path=path)
        _learn_own_url(wired, domain)
    except ServerError as exc:
        if exc.status >= 500:
            logger.warning("could not take a posted outcome", extra={"code": exc.code, "error": exc.message})
        return {"statusCode": exc.status, "headers": {"content-type": "application/json"}, "body": error_body(exc)}
    return _answer(202, {"accepted": decision.note is None, "note": decision.note})

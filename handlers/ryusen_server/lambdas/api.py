"""Lambda entry point for the server API (API Gateway REST, IAM-authorized)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.event_handler import APIGatewayRestResolver
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from ..api import build_api
from ..wiring import AwsResources, aws_engine

logger = Logger(service="ryusen-api")
metrics = Metrics(namespace="Ryusen", service="api")
_resolver: APIGatewayRestResolver | None = None


def resolver() -> APIGatewayRestResolver:
    global _resolver
    if _resolver is None:
        wired = aws_engine(AwsResources.from_env(), deployed=True)
        _resolver = build_api(wired.engine, wired.fetcher())
    return _resolver


@logger.inject_lambda_context(correlation_id_path="requestContext.requestId")
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    response = resolver().resolve(event, context)
    status = int(response.get("statusCode", 500))
    if status >= 400:
        metrics.add_metric(
            name="ApiClientErrors" if status < 500 else "ApiServerErrors", unit=MetricUnit.Count, value=1
        )
    return response

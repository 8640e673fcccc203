"""Lambda entry point for the sweeper (issue 12): every minute, on an EventBridge schedule.

It repairs runs whose work is overdue with nothing on its way to move it (a task message or a schedule lost
after the write that needed it; docs/design/engine.md), reading only the index of runs to check.
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from ..engine import SWEEP_BUDGET_S
from ..wiring import AwsEngine, AwsResources, aws_engine

logger = Logger(service="ryusen-sweep")
metrics = Metrics(namespace="Ryusen", service="sweep")
_engine: AwsEngine | None = None


def engine() -> AwsEngine:
    global _engine
    if _engine is None:
        _engine = aws_engine(AwsResources.from_env(), deployed=True, signs=False)  # it holds no key
    return _engine


@logger.inject_lambda_context
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    # a pass stops in time to report: within its budget and the invocation's time left
    left_s = context.get_remaining_time_in_millis() / 1000 - 15.0
    report = engine().engine.sweep(budget_s=max(1.0, min(SWEEP_BUDGET_S, left_s)))
    metrics.add_metric(name="SweptRuns", unit=MetricUnit.Count, value=report.checked)
    metrics.add_metric(name="RepairedRuns", unit=MetricUnit.Count, value=len(report.repaired))
    if report.repaired:
        logger.warning("repaired runs whose work was overdue", extra={"runs": report.repaired})
    return {"checked": report.checked, "repaired": report.repaired}

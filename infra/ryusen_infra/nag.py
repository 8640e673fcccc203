"""cdk-nag's AwsSolutions rules that Ryusen's design deliberately does not follow, each with its reason."""

from __future__ import annotations

import aws_cdk as cdk
from cdk_nag import NagPackSuppression, NagSuppressions

from .engine import RyusenEngine
from .example import ShopExample


def suppress(engine: RyusenEngine) -> None:
    """Record why each finding below is by design (cdk-nag then reports it as suppressed, with the reason)."""
    stack = cdk.Stack.of(engine)
    results = engine.api.root.get_resource("v1").get_resource("results")  # type: ignore[union-attr]
    assert results is not None
    NagSuppressions.add_resource_suppressions(
        results,
        [
            NagPackSuppression(
                id="AwsSolutions-APIG4",
                reason="SDKs post late results without AWS credentials; every result carries the app's HMAC"
                " signature, which the handler verifies before it reads the body (decisions 6.15, 21)",
            ),
            NagPackSuppression(id="AwsSolutions-COG4", reason="authenticated by the app's HMAC signature"),
        ],
        apply_to_children=True,
    )
    NagSuppressions.add_resource_suppressions(
        engine.api,
        [
            NagPackSuppression(
                id="AwsSolutions-COG4", reason="operators and CI call the API with IAM (SigV4), not Cognito users"
            ),
            NagPackSuppression(
                id="AwsSolutions-APIG2",
                reason="the handler validates every body strictly (pydantic models, extra fields refused) and"
                " answers a structured 4xx; a gateway validator would duplicate that schema",
            ),
            NagPackSuppression(
                id="AwsSolutions-APIG6",
                reason="execution logging needs the account-wide API Gateway CloudWatch Logs role, which a fresh"
                " account does not have (the stage would be refused); the API's metrics count requests and errors",
            ),
            NagPackSuppression(
                id="AwsSolutions-APIG3",
                reason="IAM-authorized API with stage throttling (the result route has its own); set"
                " RyusenSettings.web_acl_arn to attach a WAF web ACL with a rate-based rule per IP",
            ),
        ],
        apply_to_children=True,
    )
    if not engine.settings.api_access_logs:
        NagSuppressions.add_resource_suppressions(
            engine.api,
            [
                NagPackSuppression(
                    id="AwsSolutions-APIG1",
                    reason="access logs need the account-wide API Gateway CloudWatch Logs role, so they are opt-in"
                    " (ryusen:api_access_logs, docs/deploy.md); the API's metrics count requests and errors, alarmed",
                )
            ],
            apply_to_children=True,
        )
    if engine.settings.api_account_logs_role:
        NagSuppressions.add_resource_suppressions(
            engine.api_logs_role,
            [
                NagPackSuppression(
                    id="AwsSolutions-IAM4",
                    reason="AWS's policy made for exactly this role (API Gateway pushing logs), kept current by AWS",
                    applies_to=[
                        "Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AmazonAPIGatewayPushToCloudWatchLogs"
                    ],
                )
            ],
        )
    for function in (engine.api_function, engine.dispatch_function, engine.result_function, engine.sweep_function):
        NagSuppressions.add_resource_suppressions(
            function.role,  # type: ignore[arg-type]
            [
                NagPackSuppression(
                    id="AwsSolutions-IAM5",
                    reason="the table's own indexes (index/*), and the schedules of Ryusen's own group, whose"
                    " names are made per run and timer",
                    applies_to=[
                        f"Resource::<{stack.get_logical_id(engine.table.node.default_child)}.Arn>/index/*",  # type: ignore[arg-type]
                        "Resource::arn:<AWS::Partition>:scheduler:<AWS::Region>:<AWS::AccountId>:schedule/"
                        f"<{stack.get_logical_id(engine.schedule_group)}>/*",
                    ],
                )
            ],
            apply_to_children=True,
        )
    NagSuppressions.add_resource_suppressions(
        engine.scheduler_dead_letter_queue,
        [
            NagPackSuppression(
                id="AwsSolutions-SQS3",
                reason="it is a dead-letter queue: EventBridge Scheduler's, set on each schedule's target",
            )
        ],
    )
    NagSuppressions.add_resource_suppressions(
        engine.master_key,
        [
            NagPackSuppression(
                id="AwsSolutions-SMG4",
                reason="apps hold keys derived from it; docs/security.md gives the rotation procedure",
            )
        ],
    )


def suppress_example(shop: ShopExample) -> None:
    """The example app's findings that are by design."""
    NagSuppressions.add_resource_suppressions(
        shop.app_key,
        [
            NagPackSuppression(
                id="AwsSolutions-SMG4",
                reason="the app's key is derived from the master at deploy, so it changes when the master does:"
                " docs/deploy.md's rotation procedure writes the new derived key here",
            )
        ],
    )

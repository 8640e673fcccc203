"""``ShopExample``: examples/shop.py deployed as a Lambda behind a Function URL, the way a user's app runs.

The Function URL has no AWS authorization (``AuthType.NONE``): every task request and response is
signed with the app's key (Ryusen's HMAC), which the function derives from the engine's master secret at
cold start (an app deployed with the engine; docs/security.md says when to give an app only its own key).
Its containers share what they have accepted in a small replay table, so a captured request played to
another container is refused too. Register it with ``ryusen sync <FunctionUrl>``; the URL is a stack output.
"""

from __future__ import annotations

import shutil

import aws_cdk as cdk
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda
from aws_cdk import aws_logs as logs
from constructs import Construct

from .bundling import ARCHITECTURE, REPO, RUNTIME, LocalPip, _staged_sources
from .engine import RyusenEngine, function_role


class ShopExample(Construct):
    """examples/shop.py as a Lambda Function URL, signed with ``engine``'s key."""

    def __init__(self, scope: Construct, construct_id: str, *, engine: RyusenEngine) -> None:
        super().__init__(scope, construct_id)
        source = _staged_sources("shop-src")
        shutil.copy(REPO / "examples" / "shop.py", f"{source}/shop.py")
        code = aws_lambda.Code.from_asset(
            source,
            bundling=cdk.BundlingOptions(image=RUNTIME.bundling_image, local=LocalPip(source), command=["false"]),
        )
        log_group = logs.LogGroup(self, "Logs", retention=engine.settings.log_retention)
        self.replay_table = dynamodb.Table(
            self,
            "ReplayTable",
            partition_key=dynamodb.Attribute(name="pk", type=dynamodb.AttributeType.STRING),
            billing_mode=dynamodb.BillingMode.PAY_PER_REQUEST,
            time_to_live_attribute="expires_at",  # an entry is needed for twice the 5-minute skew window
            point_in_time_recovery_specification=dynamodb.PointInTimeRecoverySpecification(
                point_in_time_recovery_enabled=True
            ),
            removal_policy=cdk.RemovalPolicy.DESTROY,
        )
        self.function = aws_lambda.Function(
            self,
            "Function",
            runtime=RUNTIME,
            architecture=ARCHITECTURE,
            role=function_role(self, "Role", log_group),
            handler="shop.lambda_handler",
            code=code,
            timeout=cdk.Duration.minutes(15),
            memory_size=256,
            environment={
                "RYUSEN_MASTER_KEY_SECRET_ARN": engine.master_key.secret_arn,
                "RYUSEN_REPLAY_TABLE": self.replay_table.table_name,
            },
            log_group=log_group,
        )
        self.function.add_to_role_policy(
            iam.PolicyStatement(actions=["secretsmanager:GetSecretValue"], resources=[engine.master_key.secret_arn])
        )
        self.function.add_to_role_policy(
            iam.PolicyStatement(actions=["dynamodb:PutItem"], resources=[self.replay_table.table_arn])
        )
        self.url = self.function.add_function_url(auth_type=aws_lambda.FunctionUrlAuthType.NONE)
        period = cdk.Duration.minutes(5)
        self.throttles_alarm = cloudwatch.Alarm(
            self,
            "Throttles",
            alarm_description="Lambda throttled the example app: its Function URL answered 429 to dispatchers"
            " (docs/deploy.md, Concurrency)",
            metric=cloudwatch.MathExpression(
                expression="t", using_metrics={"t": self.function.metric_throttles(statistic="Sum")}, period=period
            ),
            threshold=0,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD,
            evaluation_periods=1,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        engine.notify(self.throttles_alarm)

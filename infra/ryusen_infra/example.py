"""``ShopExample``: examples/shop.py deployed as a Lambda behind a Function URL, the way a user's app runs.

The Function URL has no AWS authorization (``AuthType.NONE``): every task request and response is
signed with the app's key (Ryusen's HMAC). The app holds only its own key, in a secret of its own, which a
custom resource derives from the engine's master at deploy (``derive_app_key.py``); the app may not read the
master, which could sign for every app (docs/security.md).
Its containers share what they have accepted in a small replay table, so a captured request played to
another container is refused too. Register it with ``ryusen sync <FunctionUrl>``; the URL is a stack output.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import aws_cdk as cdk
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda
from aws_cdk import aws_logs as logs
from aws_cdk import aws_secretsmanager as secretsmanager
from constructs import Construct

from .bundling import ARCHITECTURE, REPO, RUNTIME, LocalPip, _staged_sources
from .engine import RyusenEngine, function_role

APP_ID = "shop"
"""examples/shop.py's app id (``Ryusen(\"shop\")``): its key is derived for it."""


class ShopExample(Construct):
    """examples/shop.py as a Lambda Function URL, signed with ``engine``'s key."""

    def __init__(self, scope: Construct, construct_id: str, *, engine: RyusenEngine) -> None:
        super().__init__(scope, construct_id)
        source = _staged_sources("shop-src")
        shutil.copy(REPO / "examples" / "shop.py", f"{source}/shop.py")
        shutil.copy(Path(__file__).with_name("derive_app_key.py"), f"{source}/derive_app_key.py")
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
        self.app_key = self._app_key(engine, code, APP_ID)
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
            retry_attempts=0,  # an attempt sent as an event is never run again by Lambda (its replay table refuses)
            environment={
                "RYUSEN_SIGNING_KEY_SECRET_ARN": self.app_key.secret_arn,
                "RYUSEN_REPLAY_TABLE": self.replay_table.table_name,
            },
            log_group=log_group,
        )
        self.function.node.add_dependency(self.app_key_resource)  # its key is written before it runs
        self.function.add_to_role_policy(
            iam.PolicyStatement(actions=["secretsmanager:GetSecretValue"], resources=[self.app_key.secret_arn])
        )
        self.function.add_to_role_policy(
            iam.PolicyStatement(actions=["dynamodb:PutItem"], resources=[self.replay_table.table_arn])
        )
        self.url = self.function.add_function_url(auth_type=aws_lambda.FunctionUrlAuthType.NONE)
        engine.allow_lambda_endpoint(self.function)  # attempts as asynchronous events: no dispatcher waits on them
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

    def _app_key(self, engine: RyusenEngine, code: aws_lambda.Code, app_id: str) -> secretsmanager.Secret:
        """The app's own secret, holding its key derived from the master by a custom resource at deploy."""
        secret = secretsmanager.Secret(
            self,
            "AppKey",
            description=f"Ryusen app {app_id!r}: its signing key, derived from the master at deploy",
            generate_secret_string=secretsmanager.SecretStringGenerator(exclude_punctuation=True),  # replaced
        )
        log_group = logs.LogGroup(self, "DeriveKeyLogs", retention=engine.settings.log_retention)
        self.derive_key_function = aws_lambda.Function(
            self,
            "DeriveKey",
            runtime=RUNTIME,
            architecture=ARCHITECTURE,
            role=function_role(self, "DeriveKeyRole", log_group),
            handler="derive_app_key.handler",
            code=code,
            timeout=cdk.Duration.minutes(1),
            memory_size=256,
            log_group=log_group,
        )
        self.derive_key_function.add_to_role_policy(
            iam.PolicyStatement(actions=["secretsmanager:GetSecretValue"], resources=[engine.master_key.secret_arn])
        )
        self.derive_key_function.add_to_role_policy(
            iam.PolicyStatement(actions=["secretsmanager:PutSecretValue"], resources=[secret.secret_arn])
        )
        self.app_key_resource = cdk.CustomResource(
            self,
            "AppKeyDerived",
            service_token=self.derive_key_function.function_arn,
            resource_type="Custom::RyusenAppKey",
            properties={
                "AppId": app_id,
                "MasterKeySecretArn": engine.master_key.secret_arn,
                "AppKeySecretArn": secret.secret_arn,
            },
        )
        return secret

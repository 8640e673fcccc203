"""``ShopExample``: examples/shop.py deployed as a Lambda behind a Function URL, the way a user's app runs.

The Function URL has no AWS authorization (``AuthType.NONE``): every task request and response is
signed with the app's key (Ryusen's HMAC), which the function reads from the engine's secret at cold
start. Register it with ``ryusen sync <FunctionUrl>``; the URL is a stack output.
"""

from __future__ import annotations

import shutil

import aws_cdk as cdk
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
            environment={"RYUSEN_MASTER_KEY_SECRET_ARN": engine.master_key.secret_arn},
            log_group=log_group,
        )
        self.function.add_to_role_policy(
            iam.PolicyStatement(actions=["secretsmanager:GetSecretValue"], resources=[engine.master_key.secret_arn])
        )
        self.url = self.function.add_function_url(auth_type=aws_lambda.FunctionUrlAuthType.NONE)

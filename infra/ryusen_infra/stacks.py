"""Ready stacks: ``RyusenStack`` (the engine) and ``ShopExampleStack`` (the example app, Function URL)."""

from __future__ import annotations

from typing import Any

import aws_cdk as cdk
from constructs import Construct

from . import nag
from .engine import RyusenEngine, RyusenSettings
from .example import ShopExample


class RyusenStack(cdk.Stack):
    """The engine in a stack of its own, its URLs as outputs; ``example=True`` adds examples/shop.py."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        settings: RyusenSettings | None = None,
        example: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(scope, construct_id, **kwargs)
        self.engine = RyusenEngine(self, "Engine", settings=settings)
        nag.suppress(self.engine)
        cdk.CfnOutput(self, "ApiUrl", value=self.engine.api.url, description="ryusen --server / RYUSEN_URL")
        cdk.CfnOutput(self, "MasterKeySecret", value=self.engine.master_key.secret_arn)
        cdk.CfnOutput(self, "DashboardName", value=self.engine.dashboard.dashboard_name)
        if example:
            self.shop = ShopExample(self, "Shop", engine=self.engine)
            nag.suppress_example(self.shop)
            cdk.CfnOutput(self, "ShopUrl", value=self.shop.url.url, description="ryusen sync <this URL>")
            cdk.CfnOutput(self, "ShopKeySecret", value=self.shop.app_key.secret_arn)

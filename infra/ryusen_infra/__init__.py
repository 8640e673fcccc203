"""Ryusen on AWS with CDK: ``RyusenEngine`` to compose into your app, ``RyusenStack`` ready to deploy."""

from .engine import RyusenEngine, RyusenSettings
from .example import ShopExample
from .stacks import RyusenStack

__all__ = ["RyusenEngine", "RyusenSettings", "RyusenStack", "ShopExample"]

"""The synthesized stack, once per test session (bundling skipped: the staged sources stand in for the asset)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "1")
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")
INFRA = Path(__file__).resolve().parents[2] / "infra"
sys.path.insert(0, str(INFRA))


@dataclass
class Synthesized:
    stack: Any
    assertions: Any
    """``aws_cdk.assertions.Template`` of the stack (``has_resource_properties``, ``Match``, ``Capture``)."""
    template: dict[str, Any]
    messages: list[Any]

    def resources(self, kind: str) -> dict[str, dict[str, Any]]:
        return {name: r for name, r in self.template["Resources"].items() if r["Type"] == kind}

    def function(self, handler: str) -> tuple[str, dict[str, Any]]:
        [(name, resource)] = [
            (n, r) for n, r in self.resources("AWS::Lambda::Function").items() if r["Properties"]["Handler"] == handler
        ]
        return name, resource


def synthesize(tmp: Path, **settings: Any) -> Synthesized:
    import aws_cdk as cdk
    from aws_cdk.assertions import Template
    from cdk_nag import AwsSolutionsChecks

    from ryusen_infra import RyusenSettings, RyusenStack

    app = cdk.App(context={"aws:cdk:bundling-stacks": []}, outdir=str(tmp))
    stack = RyusenStack(app, "Ryusen", settings=RyusenSettings(**settings), example=True)
    cdk.Aspects.of(app).add(AwsSolutionsChecks())
    assembly = app.synth()
    assertions = Template.from_stack(stack)
    return Synthesized(
        stack=stack,
        assertions=assertions,
        template=assertions.to_json(),
        messages=list(assembly.get_stack_by_name("Ryusen").messages),
    )


@pytest.fixture(scope="session")
def synthesized(tmp_path_factory: pytest.TempPathFactory) -> Synthesized:
    return synthesize(tmp_path_factory.mktemp("cdk"))

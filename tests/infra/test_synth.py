"""`python infra/app.py` synthesizes the deployable templates on a machine with Node, without Docker or AWS.

This is the real thing: the Lambda code is bundled by pip for arm64 (wheels from the package index),
and cdk-nag's checks run on the whole app.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_python_infra_app_py_synthesizes_with_local_bundling(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # no credentials at all
    env.update({"CDK_OUTDIR": str(tmp_path), "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "1"})
    done = subprocess.run(
        [sys.executable, str(REPO / "infra" / "app.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    template = json.loads((tmp_path / "Ryusen.template.json").read_text())
    functions = [r for r in template["Resources"].values() if r["Type"] == "AWS::Lambda::Function"]
    assert {f["Properties"]["Handler"] for f in functions} == {
        "ryusen_server.lambdas.api.handler",
        "ryusen_server.lambdas.dispatch.handler",
        "ryusen_server.lambdas.results.handler",
        "ryusen_server.lambdas.sweep.handler",
        "shop.lambda_handler",
        "derive_app_key.handler",  # the example app's key, derived at deploy (in the example's asset)
    }
    assets = [p for p in tmp_path.glob("asset.*") if p.is_dir()]
    assert len(assets) == 2
    for asset in assets:
        assert (asset / "ryusen_server" / "lambdas" / "dispatch.py").exists()
        assert (asset / "aws_lambda_powertools").is_dir()
        [core] = list((asset / "pydantic_core").glob("_pydantic_core.*.so"))
        assert "aarch64" in core.name and "314" in core.name  # built for the Lambda runtime, not this machine
    shop = next(a for a in assets if (a / "shop.py").exists())
    assert "lambda_handler = app.lambda_handler" in (shop / "shop.py").read_text()
    assert (shop / "derive_app_key.py").exists()
    report = (tmp_path / "AwsSolutions--Ryusen-NagReport.csv").read_text()
    assert "Non-Compliant" not in report


def settings_from_context(context: dict[str, object]) -> object:
    """What infra/app.py makes of ``cdk ... -c key=value`` (values arrive as strings from the command line)."""
    import importlib.util

    import aws_cdk as cdk

    spec = importlib.util.spec_from_file_location("ryusen_infra_app", REPO / "infra" / "app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.settings_from(cdk.App(context=context))


def test_the_api_logs_context_options_reach_the_settings() -> None:
    default = settings_from_context({})
    assert (default.api_access_logs, default.api_account_logs_role) == (False, False)  # type: ignore[attr-defined]
    asked = settings_from_context({"ryusen:api_access_logs": "true", "ryusen:api_account_logs_role": "true"})
    assert (asked.api_access_logs, asked.api_account_logs_role) == (True, True)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="ryusen:api_access_logs"):
        settings_from_context({"ryusen:api_access_logs": "yes please"})


def test_the_dispatch_concurrency_context_reaches_the_settings_and_defaults_to_the_settings_default() -> None:
    from ryusen_infra import RyusenSettings

    assert settings_from_context({}).dispatch_concurrency == RyusenSettings().dispatch_concurrency  # type: ignore[attr-defined]
    assert settings_from_context({"ryusen:dispatch_concurrency": "40"}).dispatch_concurrency == 40  # type: ignore[attr-defined]
    assert settings_from_context({}).dispatch_memory_mb == 512  # type: ignore[attr-defined]
    assert settings_from_context({"ryusen:dispatch_memory_mb": "256"}).dispatch_memory_mb == 256  # type: ignore[attr-defined]


def test_the_lambda_dependencies_are_pinned_whole_and_installed_without_upgrade(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24: the asset held whatever pip found newest that day. Now every package of the closure is pinned to
    the version the tests ran against, pip installs exactly those (no dependency resolution, no ``--upgrade``)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    from ryusen_infra import bundling

    lambda_env = {"python_version": bundling.PYTHON_VERSION, "python_full_version": f"{bundling.PYTHON_VERSION}.0"}
    lambda_env |= {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "aarch64", "extra": ""}
    pins = [Requirement(line) for line in bundling.RUNTIME_REQUIREMENTS]
    pinned = {metadata.distribution(r.name).metadata["Name"].lower().replace("_", "-"): r for r in pins}
    for requirement in pins:
        [spec] = requirement.specifier
        assert spec.operator == "==", requirement
        installed = metadata.version(requirement.name)
        assert spec.version == installed, f"{requirement} is not the {installed} the tests run with"
        for needed in metadata.requires(requirement.name) or []:
            dependency = Requirement(needed)
            if dependency.marker is None or dependency.marker.evaluate(lambda_env):
                name = dependency.name.lower().replace("_", "-")
                assert name in pinned or name in ("boto3", "botocore"), f"{requirement.name} needs {needed}: unpinned"

    commands: list[list[str]] = []
    monkeypatch.setattr(bundling.subprocess, "run", lambda command, **_: commands.append(command))
    source = Path(bundling._staged_sources("pins-test"))
    assert bundling.LocalPip(str(source)).try_bundle(str(tmp_path / "out"))
    [command] = commands
    assert "--upgrade" not in command and "-U" not in command
    assert "--no-deps" in command  # exactly the closure above, nothing resolved anew
    requirements = Path(command[command.index("-r") + 1]).read_text().split()
    assert requirements == list(bundling.RUNTIME_REQUIREMENTS)


def test_the_alarm_notification_context_reaches_the_settings() -> None:
    default = settings_from_context({})
    assert (default.alarm_email, default.alarm_topic_arn) == (None, None)  # type: ignore[attr-defined]
    asked = settings_from_context(
        {"ryusen:alarm_email": "ops@example.com", "ryusen:alarm_topic_arn": "arn:aws:sns:us-east-1:123456789012:x"}
    )
    assert asked.alarm_email == "ops@example.com"  # type: ignore[attr-defined]
    assert asked.alarm_topic_arn == "arn:aws:sns:us-east-1:123456789012:x"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("dispatch_concurrency", "lots"),
        ("dispatch_concurrency", "0"),
        ("dispatch_memory_mb", "half"),
        ("retention_days", "-3"),
        ("max_run_timeout_s", "nan"),
    ],
)
def test_a_malformed_number_setting_is_refused_naming_its_key(name: str, value: str) -> None:
    """Before, ``-c ryusen:dispatch_concurrency=lots`` failed with Python's own "invalid literal for int()"."""
    with pytest.raises(ValueError, match=f"ryusen:{name} must be a positive"):
        settings_from_context({f"ryusen:{name}": value})


def test_the_fair_queue_context_reaches_the_settings_and_is_on_by_default() -> None:
    assert settings_from_context({}).fair_queue is True  # type: ignore[attr-defined]
    assert settings_from_context({"ryusen:fair_queue": "false"}).fair_queue is False  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="ryusen:fair_queue must be true or false"):
        settings_from_context({"ryusen:fair_queue": "sometimes"})


def test_the_app_dispatch_concurrency_context_reaches_the_settings_and_a_malformed_one_is_refused() -> None:
    assert settings_from_context({}).app_dispatch_concurrency == {}  # type: ignore[attr-defined]
    asked = settings_from_context({"ryusen:app_dispatch_concurrency": "video=10,reports=4"})
    assert asked.app_dispatch_concurrency == {"video": 10, "reports": 4}  # type: ignore[attr-defined]
    from_json = settings_from_context({"ryusen:app_dispatch_concurrency": {"video": 3}})  # cdk.json's form
    assert from_json.app_dispatch_concurrency == {"video": 3}  # type: ignore[attr-defined]
    for malformed in ("video", "video=lots", "=4", "video=4,,"):
        with pytest.raises(ValueError, match="ryusen:app_dispatch_concurrency must be APP=N pairs"):
            settings_from_context({"ryusen:app_dispatch_concurrency": malformed})

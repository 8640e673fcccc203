"""The CDK app: ``python infra/app.py`` (or ``cdk synth`` in infra/) writes the templates to infra/cdk.out.

No AWS account, credentials or Docker are needed to synthesize: the Lambda code is bundled here with pip.
Settings come from CDK context (``cdk deploy -c ryusen:example=true``) with RFD 1's defaults.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ryusen_infra import RyusenSettings, RyusenStack


def flag(app: cdk.App, name: str, default: bool = False) -> bool:
    """A yes/no context setting: ``true`` or ``false`` (``-c`` gives strings, cdk.json may give booleans)."""
    value = app.node.try_get_context(f"ryusen:{name}")
    if value is None:
        return default
    if str(value).lower() not in ("true", "false"):
        raise ValueError(f"ryusen:{name} must be true or false, not {value!r}")
    return str(value).lower() == "true"


def number(app: cdk.App, name: str, *, whole: bool = False) -> float | None:
    """A positive number context setting (``-c ryusen:NAME=30``); anything else is refused, naming the key."""
    value = app.node.try_get_context(f"ryusen:{name}")
    if value is None or value == "":
        return None
    try:
        parsed = int(str(value)) if whole else float(str(value))
    except ValueError:
        parsed = -1
    if not parsed > 0 or parsed == float("inf"):
        kind = "a positive whole number" if whole else "a positive number"
        raise ValueError(f"ryusen:{name} must be {kind}, not {value!r}")
    return parsed


def app_concurrency(app: cdk.App, name: str) -> dict[str, int]:
    """``-c ryusen:NAME=video=10,reports=4`` (or a JSON object in cdk.json): app id -> a whole number; anything
    else is refused, naming the key (the numbers' range is the settings' check)."""
    value = app.node.try_get_context(f"ryusen:{name}")
    if value in (None, ""):
        return {}
    pairs = value.items() if isinstance(value, dict) else (p.rpartition("=")[::2] for p in str(value).split(","))
    out: dict[str, int] = {}
    for app_id, raw in pairs:
        text, key = str(raw).strip(), str(app_id).strip()
        if not key or not (text.isascii() and text.isdigit()) or key in out:
            raise ValueError(
                f"ryusen:{name} must be APP=N pairs, each app once, separated by commas (video=10,reports=4): {value!r}"
            )
        out[key] = int(text)
    return out


def settings_from(app: cdk.App) -> RyusenSettings:
    def seconds(name: str) -> cdk.Duration | None:
        value = number(app, name)
        return cdk.Duration.seconds(value) if value is not None else None

    defaults = RyusenSettings()
    retention_days = number(app, "retention_days")
    dispatch_concurrency = number(app, "dispatch_concurrency", whole=True)
    dispatch_memory_mb = number(app, "dispatch_memory_mb", whole=True)
    return RyusenSettings(
        default_run_timeout=seconds("default_run_timeout_s"),
        max_run_timeout=seconds("max_run_timeout_s"),
        max_attempt_timeout=seconds("max_attempt_timeout_s") or defaults.max_attempt_timeout,
        dispatch_concurrency=int(dispatch_concurrency) if dispatch_concurrency else defaults.dispatch_concurrency,
        dispatch_memory_mb=int(dispatch_memory_mb) if dispatch_memory_mb else defaults.dispatch_memory_mb,
        app_dispatch_concurrency=app_concurrency(app, "app_dispatch_concurrency"),
        retention=cdk.Duration.days(retention_days) if retention_days else defaults.retention,
        fair_queue=flag(app, "fair_queue", default=True),
        api_access_logs=flag(app, "api_access_logs"),
        api_account_logs_role=flag(app, "api_account_logs_role"),
        alarm_email=app.node.try_get_context("ryusen:alarm_email") or None,
        alarm_topic_arn=app.node.try_get_context("ryusen:alarm_topic_arn") or None,
    )


def main() -> cdk.App:
    app = cdk.App(outdir=os.environ.get("CDK_OUTDIR") or str(Path(__file__).resolve().parent / "cdk.out"))
    example = flag(app, "example", default=True)
    RyusenStack(app, "Ryusen", settings=settings_from(app), example=example)
    cdk.Aspects.of(app).add(AwsSolutionsChecks())  # every finding is fixed or suppressed with its reason
    app.synth()
    return app


if __name__ == "__main__":
    main()

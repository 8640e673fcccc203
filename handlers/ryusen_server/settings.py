"""Deployment settings, read from the environment (the CDK stack and ``ryusen dev`` set them).

Every setting has the default of decisions 6.8; tests and ``ryusen dev`` may
shorten the time-based ones.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ryusen._internal.signing import PREVIOUS_KEY_WINDOW_S
from ryusen._internal.wire import RetryPolicyWire

from .core.events import EngineSettings
from .engine import (
    ACKNOWLEDGE_AFTER_S,
    INLINE_UP_TO_MAX_S,
    INLINE_UP_TO_S,
    RELEASE_RECHECK_S,
    SCHEDULED_LEASE_FROM_S,
    SCHEDULED_LEASE_SHARE,
    STORE_RETRY_S,
    ServerSettings,
)


def _float(env: Mapping[str, str], name: str, default: float | None) -> float | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"setting {name} must be a number of seconds, not {raw!r}") from None
    if value <= 0:
        raise ValueError(f"setting {name} must be positive")
    return value


def _seconds_or_never(env: Mapping[str, str], name: str, default: float) -> float:
    """Seconds, where 0 is allowed (no wait: every time)."""
    raw = env.get(name)
    if raw is not None and raw.strip() in ("0", "0.0"):
        return 0.0
    return _req(env, name, default)


def _count(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"setting {name} must be a positive whole number, not {raw!r}")
    return int(raw)


def _req(env: Mapping[str, str], name: str, default: float) -> float:
    value = _float(env, name, default)
    assert value is not None
    return value


def engine_settings(env: Mapping[str, str] | None = None) -> EngineSettings:
    env = os.environ if env is None else env
    base = EngineSettings()
    forward = base.forward_retry
    compensate = base.compensate_retry
    return _checked(
        EngineSettings(
            forward_retry=RetryPolicyWire(
                max_attempts=int(_req(env, "RYUSEN_RETRY_MAX_ATTEMPTS", forward.max_attempts)),
                initial_delay_s=_req(env, "RYUSEN_RETRY_INITIAL_DELAY_S", forward.initial_delay_s),
                backoff=forward.backoff,
                max_delay_s=_req(env, "RYUSEN_RETRY_MAX_DELAY_S", forward.max_delay_s),
            ),
            compensate_retry=RetryPolicyWire(
                max_attempts=int(_req(env, "RYUSEN_COMPENSATE_MAX_ATTEMPTS", compensate.max_attempts)),
                initial_delay_s=_req(env, "RYUSEN_COMPENSATE_INITIAL_DELAY_S", compensate.initial_delay_s),
                backoff=compensate.backoff,
                max_delay_s=_req(env, "RYUSEN_COMPENSATE_MAX_DELAY_S", compensate.max_delay_s),
            ),
            attempt_timeout_s=_req(env, "RYUSEN_ATTEMPT_TIMEOUT_S", base.attempt_timeout_s),
            max_attempt_timeout_s=_float(env, "RYUSEN_MAX_ATTEMPT_TIMEOUT_S", None),
            lease_grace_s=_req(env, "RYUSEN_LEASE_GRACE_S", base.lease_grace_s),
            acknowledged_lease_grace_s=_req(env, "RYUSEN_ACKNOWLEDGED_LEASE_GRACE_S", base.acknowledged_lease_grace_s),
            probe_initial_s=_req(env, "RYUSEN_PROBE_INITIAL_S", base.probe_initial_s),
            probe_max_s=_req(env, "RYUSEN_PROBE_MAX_S", base.probe_max_s),
            redelivery_initial_s=_req(env, "RYUSEN_REDELIVERY_INITIAL_S", base.redelivery_initial_s),
            redelivery_max_s=_req(env, "RYUSEN_REDELIVERY_MAX_S", base.redelivery_max_s),
            max_steps=_count(env, "RYUSEN_MAX_STEPS", base.max_steps),
        )
    )


def _checked(settings: EngineSettings) -> EngineSettings:
    maximum = settings.max_attempt_timeout_s
    if maximum is not None and settings.attempt_timeout_s > maximum:
        raise ValueError(
            f"setting RYUSEN_ATTEMPT_TIMEOUT_S ({settings.attempt_timeout_s:g}s) exceeds"
            f" RYUSEN_MAX_ATTEMPT_TIMEOUT_S ({maximum:g}s)"
        )
    return settings


def server_settings(env: Mapping[str, str] | None = None) -> ServerSettings:
    env = os.environ if env is None else env
    return ServerSettings(
        engine=engine_settings(env),
        master_key=env.get("RYUSEN_MASTER_KEY") or None,
        result_url=env.get("RYUSEN_RESULT_URL") or None,
        default_run_timeout_s=_float(env, "RYUSEN_DEFAULT_RUN_TIMEOUT_S", None),
        max_run_timeout_s=_float(env, "RYUSEN_MAX_RUN_TIMEOUT_S", None),
        index_settle_s=_float(env, "RYUSEN_INDEX_SETTLE_S", None) or 0.0,
        release_recheck_s=_seconds_or_never(env, "RYUSEN_RELEASE_RECHECK_S", RELEASE_RECHECK_S),
        chain=_flag(env, "RYUSEN_CHAIN_STEPS", True),
        acknowledge_after_s=_acknowledge_after(env),
        inline_up_to_s=_inline_up_to(env),
        scheduled_lease_from_s=_scheduled_lease_from(env),
        scheduled_lease_share=_finite(env, "RYUSEN_SCHEDULED_LEASE_SHARE", SCHEDULED_LEASE_SHARE),
        store_retry_s=_req(env, "RYUSEN_STORE_RETRY_S", STORE_RETRY_S),
        previous_key_window_s=_seconds_or_never(env, "RYUSEN_PREVIOUS_KEY_WINDOW_S", PREVIOUS_KEY_WINDOW_S),
    )


def _acknowledge_after(env: Mapping[str, str]) -> float | None:
    """``RYUSEN_ACKNOWLEDGE_AFTER_S``: seconds (0 allowed), or ``never`` (every attempt is waited for)."""
    raw = env.get("RYUSEN_ACKNOWLEDGE_AFTER_S")
    if raw is not None and raw.strip().lower() == "never":
        return None
    value = _seconds_or_never(env, "RYUSEN_ACKNOWLEDGE_AFTER_S", ACKNOWLEDGE_AFTER_S)
    if value > 900:
        raise ValueError(f"setting RYUSEN_ACKNOWLEDGE_AFTER_S must be at most 900 seconds, or never, not {raw!r}")
    return value


def _finite(env: Mapping[str, str], name: str, default: float) -> float:
    """A positive, finite number."""
    value = _req(env, name, default)
    if not math.isfinite(value):
        raise ValueError(f"setting {name} must be a positive number, not {env.get(name)!r}")
    return value


def _scheduled_lease_from(env: Mapping[str, str]) -> float | None:
    """``RYUSEN_SCHEDULED_LEASE_FROM_S``: seconds (0: every lease of an event), or ``never`` (SQS timers only)."""
    raw = env.get("RYUSEN_SCHEDULED_LEASE_FROM_S")
    if raw is not None and raw.strip().lower() == "never":
        return None
    value = _seconds_or_never(env, "RYUSEN_SCHEDULED_LEASE_FROM_S", SCHEDULED_LEASE_FROM_S)
    if not math.isfinite(value):
        raise ValueError(f"setting RYUSEN_SCHEDULED_LEASE_FROM_S must be a number of seconds or never, not {raw!r}")
    return value


def _inline_up_to(env: Mapping[str, str]) -> float:
    """``RYUSEN_INLINE_UP_TO_S``: seconds from 0 (off: every attempt of a Lambda endpoint that takes events is one)
    to ``INLINE_UP_TO_MAX_S``."""
    raw = env.get("RYUSEN_INLINE_UP_TO_S")
    if raw is None or raw.strip() == "":
        return INLINE_UP_TO_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 <= value <= INLINE_UP_TO_MAX_S:  # NaN fails this too
        raise ValueError(
            f"setting RYUSEN_INLINE_UP_TO_S must be a number of seconds from 0 (off) to {INLINE_UP_TO_MAX_S:g},"
            f" not {raw!r}"
        )
    return value + 0.0  # -0 is 0


def flag_setting(env: Mapping[str, str], name: str, default: bool) -> bool:
    """A yes/no setting (true/false, on/off, yes/no, 1/0); anything else raises ValueError naming it."""
    return _flag(env, name, default)


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"setting {name} must be true or false, not {raw!r}")


DEV_WORKERS = 8
"""Tasks ``ryusen dev`` runs at once (a deployment's dispatch Lambda scales out instead)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DevDispatchSettings:
    """How ``ryusen dev`` shares its dispatch workers between apps (``local/fair.py``)."""

    workers: int = DEV_WORKERS
    """``RYUSEN_DEV_WORKERS``: tasks run at once, across all apps."""
    app_workers: int = DEV_WORKERS // 2
    """``RYUSEN_DEV_APP_WORKERS``: the most workers one app's tasks may hold at once (default: half the
    workers), so that one app's slow steps always leave room for the others."""
    app_concurrency: Mapping[str, int] = field(default_factory=dict)
    """``RYUSEN_DEV_APP_CONCURRENCY`` (``video=2,reports=3``): the most workers a named app's tasks may hold,
    instead of ``app_workers``: the deployment's ``app_dispatch_concurrency``, on ``ryusen dev``."""


def dev_dispatch_settings(env: Mapping[str, str] | None = None) -> DevDispatchSettings:
    """``ryusen dev``'s worker settings; a malformed or inconsistent one raises ValueError naming it."""
    env = os.environ if env is None else env
    workers = _count(env, "RYUSEN_DEV_WORKERS", DEV_WORKERS)
    app_workers = _count(env, "RYUSEN_DEV_APP_WORKERS", max(1, workers // 2))
    if app_workers > workers:
        raise ValueError(
            f"setting RYUSEN_DEV_APP_WORKERS ({app_workers}) must be at most RYUSEN_DEV_WORKERS ({workers})"
        )
    app_concurrency: dict[str, int] = {}
    raw = env.get("RYUSEN_DEV_APP_CONCURRENCY", "").strip()
    for pair in raw.split(",") if raw else ():
        app_id, _, count = pair.rpartition("=")
        count = count.strip()
        whole = count.isascii() and count.isdigit()
        if not app_id.strip() or app_id.strip() in app_concurrency or not whole or not 1 <= int(count) <= workers:
            raise ValueError(
                "setting RYUSEN_DEV_APP_CONCURRENCY must be APP=N pairs separated by commas, each app once and each"
                f" N from 1 to RYUSEN_DEV_WORKERS ({workers}), not {raw!r}"
            )
        app_concurrency[app_id.strip()] = int(count)
    return DevDispatchSettings(workers=workers, app_workers=app_workers, app_concurrency=app_concurrency)

"""Deployment settings from the environment: defaults of decisions 6.8, and refusals of bad values."""

from __future__ import annotations

import pytest

from ryusen_server.core.events import EngineSettings
from ryusen_server.settings import engine_settings, server_settings


def test_no_variables_give_the_documented_defaults() -> None:
    assert engine_settings({}) == EngineSettings()
    server = server_settings({})
    assert server.default_run_timeout_s is None and server.max_run_timeout_s is None and server.master_key is None


def test_variables_override_their_settings() -> None:
    settings = engine_settings(
        {"RYUSEN_MAX_STEPS": "50", "RYUSEN_RETRY_MAX_ATTEMPTS": "2", "RYUSEN_ATTEMPT_TIMEOUT_S": "1.5"}
    )
    assert settings.max_steps == 50
    assert settings.forward_retry.max_attempts == 2
    assert settings.attempt_timeout_s == 1.5
    assert server_settings({"RYUSEN_MAX_RUN_TIMEOUT_S": "3600"}).max_run_timeout_s == 3600
    assert server_settings({}).release_recheck_s == 1.0
    assert server_settings({"RYUSEN_RELEASE_RECHECK_S": "0"}).release_recheck_s == 0.0
    assert server_settings({"RYUSEN_RELEASE_RECHECK_S": "2.5"}).release_recheck_s == 2.5
    with pytest.raises(ValueError, match="RYUSEN_RELEASE_RECHECK_S"):
        server_settings({"RYUSEN_RELEASE_RECHECK_S": "-1"})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("RYUSEN_MAX_STEPS", "0"),
        ("RYUSEN_MAX_STEPS", "many"),
        ("RYUSEN_MAX_STEPS", "2.5"),
        ("RYUSEN_ATTEMPT_TIMEOUT_S", "-1"),
        ("RYUSEN_ATTEMPT_TIMEOUT_S", "soon"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=name):
        engine_settings({name: value})


def test_the_default_attempt_timeout_must_fit_the_maximum() -> None:
    with pytest.raises(ValueError, match="RYUSEN_MAX_ATTEMPT_TIMEOUT_S"):
        engine_settings({"RYUSEN_ATTEMPT_TIMEOUT_S": "900", "RYUSEN_MAX_ATTEMPT_TIMEOUT_S": "840"})
    assert engine_settings({"RYUSEN_MAX_ATTEMPT_TIMEOUT_S": "840"}).max_attempt_timeout_s == 840


def test_the_fair_queue_setting_is_on_unless_turned_off_and_a_malformed_one_is_refused() -> None:
    from ryusen_server.wiring import AwsResources

    base = {
        "RYUSEN_TABLE": "t",
        "RYUSEN_QUEUE_URL": "q",
        "RYUSEN_QUEUE_ARN": "arn",
        "RYUSEN_SCHEDULER_ROLE_ARN": "role",
    }
    assert AwsResources.from_env(base).fair_queue is True
    assert AwsResources.from_env({**base, "RYUSEN_FAIR_QUEUE": "false"}).fair_queue is False
    with pytest.raises(ValueError, match="RYUSEN_FAIR_QUEUE must be true or false"):
        AwsResources.from_env({**base, "RYUSEN_FAIR_QUEUE": "perhaps"})


def test_a_deployments_app_queues_are_read_and_a_malformed_setting_stops_the_cold_start() -> None:
    """``RYUSEN_APP_QUEUES`` and ``RYUSEN_APP_QUEUE_PREFIX`` (the stack writes them for ``app_dispatch_concurrency``):
    each app's queue, named by its digest beside the shared one; a record is handled on the queue its
    ``eventSourceARN`` names; a value the stack would not write is refused."""
    from ryusen_infra.engine import app_queue_digest as infra_digest
    from ryusen_server.aws.queue import app_queue_digest
    from ryusen_server.wiring import AwsResources

    base = {
        "RYUSEN_TABLE": "t",
        "RYUSEN_QUEUE_URL": "https://sqs.us-east-1.amazonaws.com/123456789012/Ryusen-DispatchQueue-X",
        "RYUSEN_QUEUE_ARN": "arn:aws:sqs:us-east-1:123456789012:Ryusen-DispatchQueue-X",
        "RYUSEN_SCHEDULER_ROLE_ARN": "arn:aws:iam::123456789012:role/s",
    }
    digest = app_queue_digest("video")
    assert digest == infra_digest("video")  # the stack names the queue as the engine finds it
    env = {**base, "RYUSEN_APP_QUEUES": digest, "RYUSEN_APP_QUEUE_PREFIX": "ryusen-0123abcd-"}
    resources = AwsResources.from_env(env)
    url = f"https://sqs.us-east-1.amazonaws.com/123456789012/ryusen-0123abcd-{digest}"
    arn = f"arn:aws:sqs:us-east-1:123456789012:ryusen-0123abcd-{digest}"
    assert resources.app_queues == {digest: (url, arn)}
    assert resources.queue_url_of(arn) == url
    assert resources.queue_url_of(base["RYUSEN_QUEUE_ARN"]) == base["RYUSEN_QUEUE_URL"]
    assert resources.queue_url_of("arn:aws:sqs:us-east-1:123456789012:unknown") == base["RYUSEN_QUEUE_URL"]
    assert AwsResources.from_env(base).app_queues == {}
    for queues, prefix in (("video", "p-"), (digest, "no spaces "), (f"{digest},xyz", "p-")):
        with pytest.raises(RuntimeError, match="RYUSEN_APP_QUEUES"):
            AwsResources.from_env({**base, "RYUSEN_APP_QUEUES": queues, "RYUSEN_APP_QUEUE_PREFIX": prefix})


def test_attempts_as_lambda_events_can_be_turned_off_in_the_engines_functions(aws_env: None) -> None:
    """``RYUSEN_LAMBDA_EVENTS=false`` (docs/deploy.md): the engine gets no event invoker, so every attempt of a
    release that announced ``lambda_event`` goes to its URL; by default it has one."""
    from moto import mock_aws

    from ryusen_server.aws.lambda_events import LambdaEventInvoker
    from ryusen_server.wiring import AwsResources, aws_engine

    base = {
        "RYUSEN_TABLE": "t",
        "RYUSEN_QUEUE_URL": "https://sqs.us-east-1.amazonaws.com/123456789012/q",
        "RYUSEN_QUEUE_ARN": "arn:aws:sqs:us-east-1:123456789012:q",
        "RYUSEN_SCHEDULER_ROLE_ARN": "arn:aws:iam::123456789012:role/s",
    }
    settings = server_settings({"RYUSEN_MASTER_KEY": "events-off-master-key-0123456789abcdef"})
    with mock_aws():
        on = aws_engine(AwsResources.from_env(base), settings)
        off = aws_engine(AwsResources.from_env({**base, "RYUSEN_LAMBDA_EVENTS": "false"}), settings)
    assert isinstance(on.engine.event_invoker, LambdaEventInvoker)
    assert off.engine.event_invoker is None


def test_the_quick_path_setting_is_read_and_a_bad_value_stops_the_cold_start() -> None:
    """``RYUSEN_INLINE_UP_TO_S``: how quick a Lambda endpoint's step must have been to be waited for rather than
    sent as an event (0: never). A value that is not a number, negative or over 1 s names the setting (a quicker
    wait would not be listened for long enough: the SDK posts an answer within 1 s of its window late too)."""
    from ryusen_server.engine import INLINE_UP_TO_S

    assert server_settings({}).inline_up_to_s == INLINE_UP_TO_S == 0.05
    assert server_settings({"RYUSEN_INLINE_UP_TO_S": "0"}).inline_up_to_s == 0.0
    assert server_settings({"RYUSEN_INLINE_UP_TO_S": "0.5"}).inline_up_to_s == 0.5
    for zero in ("0.00", "00", "-0", "0e0"):
        assert server_settings({"RYUSEN_INLINE_UP_TO_S": zero}).inline_up_to_s == 0.0
    for bad in ("soon", "-1", "1.5", "nan", "-nan", "inf"):
        with pytest.raises(ValueError, match="RYUSEN_INLINE_UP_TO_S"):
            server_settings({"RYUSEN_INLINE_UP_TO_S": bad})


def test_the_lease_watch_settings_are_read_and_a_bad_value_stops_the_cold_start() -> None:
    """``RYUSEN_SCHEDULED_LEASE_FROM_S`` (seconds, or ``never``: SQS timers only) and
    ``RYUSEN_SCHEDULED_LEASE_SHARE``: when a result function parks an event's lease watch on the Scheduler. A
    value that is not a number, negative, or not finite names the setting."""
    from ryusen_server.engine import SCHEDULED_LEASE_FROM_S, SCHEDULED_LEASE_SHARE

    default = server_settings({})
    assert (default.scheduled_lease_from_s, default.scheduled_lease_share) == (60.0, 4.0)
    assert (SCHEDULED_LEASE_FROM_S, SCHEDULED_LEASE_SHARE) == (60.0, 4.0)
    assert server_settings({"RYUSEN_SCHEDULED_LEASE_FROM_S": "never"}).scheduled_lease_from_s is None
    assert server_settings({"RYUSEN_SCHEDULED_LEASE_FROM_S": " Never "}).scheduled_lease_from_s is None
    assert server_settings({"RYUSEN_SCHEDULED_LEASE_FROM_S": "0"}).scheduled_lease_from_s == 0.0
    assert server_settings({"RYUSEN_SCHEDULED_LEASE_FROM_S": "300"}).scheduled_lease_from_s == 300.0
    assert server_settings({"RYUSEN_SCHEDULED_LEASE_SHARE": "8"}).scheduled_lease_share == 8.0
    for bad in ("soon", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match="RYUSEN_SCHEDULED_LEASE_FROM_S"):
            server_settings({"RYUSEN_SCHEDULED_LEASE_FROM_S": bad})
    for bad in ("many", "0", "-4", "nan", "inf"):
        with pytest.raises(ValueError, match="RYUSEN_SCHEDULED_LEASE_SHARE"):
            server_settings({"RYUSEN_SCHEDULED_LEASE_SHARE": bad})

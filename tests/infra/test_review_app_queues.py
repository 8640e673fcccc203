"""Review of 61ced61 (``app_dispatch_concurrency``): the synthesized template, and what a bad setting gets.

Template-only (no stack in a box): each app's queue, its event source, grants, alarms; the limits the setting's
check promises against the ones AWS enforces at deploy time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.infra.conftest import Synthesized, synthesize

REGION, ACCOUNT, STACK = "us-east-1", "123456789012", "Ryusen"
LAMBDA_ENV_LIMIT = 4096
"""Lambda: "The total size of all environment variables doesn't exceed 4 KB" (keys and values); a function
whose variables are larger is refused by Lambda at deploy time, not by the synth."""


@pytest.fixture(scope="module")
def video(tmp_path_factory: pytest.TempPathFactory) -> Synthesized:
    return synthesize(Path(tmp_path_factory.mktemp("cdk-review-video")), app_dispatch_concurrency={"video": 3})


@pytest.fixture(scope="module")
def most_apps(tmp_path_factory: pytest.TempPathFactory) -> Synthesized:
    from ryusen_infra.engine import MAX_APP_QUEUES

    apps = {f"app-{i:02d}": 2 for i in range(MAX_APP_QUEUES)}
    return synthesize(Path(tmp_path_factory.mktemp("cdk-review-most")), app_dispatch_concurrency=apps)


def _queue_name(logical_id: str) -> str:
    """CloudFormation's generated name: the stack's name, the logical id and 12 random characters (80 at most)."""
    return f"{STACK}-{logical_id}-ABCDEFGHIJKL"[:80]


def _resolve(value: Any, resources: dict[str, Any]) -> str:
    """A deployed value of the same length as AWS's for the queues' URL and ARN; other tokens a short stand-in
    (an underestimate: the secret's ARN, the function URL and the role's ARN are all longer)."""
    if isinstance(value, str):
        return value
    if "Fn::Join" in value:
        sep, parts = value["Fn::Join"]
        return str(sep).join(_resolve(p, resources) for p in parts)
    if "Ref" in value:
        name = value["Ref"]
        if resources.get(name, {}).get("Type") == "AWS::SQS::Queue":
            return f"https://sqs.{REGION}.amazonaws.com/{ACCOUNT}/{_queue_name(name)}"
        return "x" * 40
    if "Fn::GetAtt" in value:
        name, attribute = value["Fn::GetAtt"]
        if resources.get(name, {}).get("Type") == "AWS::SQS::Queue" and attribute == "Arn":
            return f"arn:aws:sqs:{REGION}:{ACCOUNT}:{_queue_name(name)}"
        return "x" * 40
    raise AssertionError(f"unexpected token {value!r}")


def _env_size(synthesized: Synthesized, handler: str) -> int:
    resources = synthesized.template["Resources"]
    variables = synthesized.function(handler)[1]["Properties"]["Environment"]["Variables"]
    return sum(len(k.encode()) + len(_resolve(v, resources).encode()) for k, v in variables.items())


def _policies_naming(synthesized: Synthesized, logical_id: str) -> dict[str, set[str]]:
    """Role policy -> the actions of its statements whose resources name ``logical_id``."""
    out: dict[str, set[str]] = {}
    for name, policy in synthesized.resources("AWS::IAM::Policy").items():
        for statement in policy["Properties"]["PolicyDocument"]["Statement"]:
            if logical_id in json.dumps(statement.get("Resource")):
                actions = statement["Action"]
                out.setdefault(name, set()).update([actions] if isinstance(actions, str) else actions)
    return out


# ---- what held ------------------------------------------------------------------------------------------------


def test_an_app_queue_is_built_like_the_shared_one_but_for_its_cap(video: Synthesized) -> None:
    engine = video.stack.engine
    shared_id = video.stack.get_logical_id(engine.queue.node.default_child)
    [app_queue] = engine.app_queues.values()
    app_id = video.stack.get_logical_id(app_queue.node.default_child)
    resources = video.template["Resources"]
    shared, own = resources[shared_id], resources[app_id]
    named = {k: v for k, v in own["Properties"].items() if k != "QueueName"}  # named by the app's digest
    assert named == shared["Properties"]  # SSE, visibility, retention, the same DLQ and count
    assert own.get("DeletionPolicy") == shared.get("DeletionPolicy")
    assert own["Properties"]["SqsManagedSseEnabled"] is True
    # enforce_ssl: a queue policy denying anything but TLS
    [ssl] = [
        p for p in video.resources("AWS::SQS::QueuePolicy").values() if {"Ref": app_id} in p["Properties"]["Queues"]
    ]
    assert "aws:SecureTransport" in json.dumps(ssl)
    mappings = {
        m["Properties"]["EventSourceArn"]["Fn::GetAtt"][0]: m["Properties"]
        for m in video.resources("AWS::Lambda::EventSourceMapping").values()
    }
    strip = lambda p: {k: v for k, v in p.items() if k not in ("EventSourceArn", "ScalingConfig")}  # noqa: E731
    assert strip(mappings[app_id]) == strip(mappings[shared_id])
    assert mappings[app_id]["ScalingConfig"] == {"MaximumConcurrency": 3}


def test_an_app_queue_is_granted_to_the_engines_functions_and_to_the_scheduler_for_delayed_tasks(
    video: Synthesized,
) -> None:
    engine = video.stack.engine
    [app_queue] = engine.app_queues.values()
    app_id = video.stack.get_logical_id(app_queue.node.default_child)
    granted = _policies_naming(video, app_id)
    roles = {
        video.stack.get_logical_id(f.role.node.find_child("DefaultPolicy").node.default_child): name
        for name, f in (
            ("api", engine.api_function),
            ("dispatch", engine.dispatch_function),
            ("results", engine.result_function),
            ("sweep", engine.sweep_function),
        )
    }
    scheduler = video.stack.get_logical_id(engine.scheduler_role.node.find_child("DefaultPolicy").node.default_child)
    roles[scheduler] = "scheduler"  # a task of the app's delayed past 15 minutes arrives on its queue
    by_role = {roles.get(policy, policy): actions for policy, actions in granted.items()}
    assert set(by_role) == {"api", "dispatch", "results", "sweep", "scheduler"}, by_role
    for name in ("api", "results", "sweep", "scheduler"):
        assert by_role[name] == {"sqs:SendMessage"}, (name, by_role[name])
    assert {"sqs:SendMessage", "sqs:ChangeMessageVisibility", "sqs:ReceiveMessage", "sqs:DeleteMessage"} <= by_role[
        "dispatch"
    ]
    assert not any("*" in a for a in by_role["dispatch"])
    assert [m.entry.data for m in video.messages if "AwsSolutions" in str(m.entry.data)] == []


def test_an_app_queues_backlog_alarms_and_its_dead_letters_reach_the_shared_alarm(video: Synthesized) -> None:
    [app_queue] = video.stack.engine.app_queues.values()
    app_id = video.stack.get_logical_id(app_queue.node.default_child)
    alarms = video.resources("AWS::CloudWatch::Alarm").values()
    [age] = [
        a
        for a in alarms
        if a["Properties"].get("Dimensions") == [{"Name": "QueueName", "Value": {"Fn::GetAtt": [app_id, "QueueName"]}}]
    ]
    assert age["Properties"]["MetricName"] == "ApproximateAgeOfOldestMessage"
    dlq = video.template["Resources"][app_id]["Properties"]["RedrivePolicy"]["deadLetterTargetArn"]["Fn::GetAtt"][0]
    assert any(json.dumps({"Fn::GetAtt": [dlq, "QueueName"]}) in json.dumps(a) for a in alarms)


def test_the_most_apps_the_check_allows_synthesize_within_cloudformations_resource_limit(
    most_apps: Synthesized,
) -> None:
    assert len(most_apps.template["Resources"]) <= 500


def test_the_most_apps_the_check_allows_leave_cdk_nag_nothing_unexplained(most_apps: Synthesized) -> None:
    assert [m.entry.data for m in most_apps.messages if "AwsSolutions" in str(m.entry.data)] == []


@pytest.mark.parametrize(
    "bad",
    [{"video": 1}, {"video": 1001}, {"video": True}, {"video": 2.5}, {"": 2}, {"x" * 257: 2}, {"a\tb": 2}],
)
def test_a_bad_app_dispatch_concurrency_is_refused_naming_the_setting(bad: dict[str, Any]) -> None:
    from ryusen_infra import RyusenSettings

    with pytest.raises(ValueError, match="app_dispatch_concurrency"):
        RyusenSettings(app_dispatch_concurrency=bad).check()


def test_more_apps_than_the_maximum_are_refused() -> None:
    from ryusen_infra import RyusenSettings
    from ryusen_infra.engine import MAX_APP_QUEUES

    with pytest.raises(ValueError, match=f"at most {MAX_APP_QUEUES} apps"):
        RyusenSettings(app_dispatch_concurrency={f"a{i}": 2 for i in range(MAX_APP_QUEUES + 1)}).check()


# ---- findings -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "handler",
    [
        "ryusen_server.lambdas.dispatch.handler",
        "ryusen_server.lambdas.api.handler",
        "ryusen_server.lambdas.results.handler",
        "ryusen_server.lambdas.sweep.handler",
    ],
)
def test_the_most_apps_the_check_allows_fit_lambdas_environment_limit(most_apps: Synthesized, handler: str) -> None:
    size = _env_size(most_apps, handler)
    assert size <= LAMBDA_ENV_LIMIT, f"{handler}: {size} bytes of environment variables"


def test_how_many_apps_fit_lambdas_environment_limit(tmp_path: Path) -> None:
    """Measures where the deploy would start to fail: each app adds its 12-hex digest and a comma to the
    environment (the review found about 240 bytes an app, its URL and ARN, before)."""
    from ryusen_infra.engine import MAX_APP_QUEUES

    one = _env_size(synthesize(tmp_path / "one", app_dispatch_concurrency={"app-00": 2}), DISPATCH)
    two = _env_size(synthesize(tmp_path / "two", app_dispatch_concurrency={"app-00": 2, "app-01": 2}), DISPATCH)
    per_app = two - one
    fits = 1 + (LAMBDA_ENV_LIMIT - one) // per_app
    print(f"dispatch env: {one} bytes with one app queue, {per_app} bytes per more app: {fits} apps fit")
    assert per_app == 13 and fits > 5 * MAX_APP_QUEUES


DISPATCH = "ryusen_server.lambdas.dispatch.handler"


@pytest.mark.parametrize("app_id", ["café", "video encoder"])
def test_any_valid_app_id_may_have_a_queue_of_its_own(app_id: str) -> None:
    from ryusen_infra import RyusenSettings

    assert app_id.isprintable() and 0 < len(app_id) <= 256  # what the engine takes as an app id
    RyusenSettings(app_dispatch_concurrency={app_id: 2}).check()


def test_a_context_value_that_is_not_a_whole_number_is_refused_naming_the_key() -> None:
    from tests.infra.test_synth import settings_from_context

    with pytest.raises(ValueError, match="ryusen:app_dispatch_concurrency"):
        settings_from_context({"ryusen:app_dispatch_concurrency": "video=²"})


def test_the_dashboard_shows_each_app_queue(video: Synthesized) -> None:
    [app_queue] = video.stack.engine.app_queues.values()
    app_id = video.stack.get_logical_id(app_queue.node.default_child)
    [dashboard] = video.resources("AWS::CloudWatch::Dashboard").values()
    assert re.search(app_id, json.dumps(dashboard["Properties"]["DashboardBody"]))

"""The synthesized template has the properties the runtime depends on (Match and Capture; no logical ids)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aws_cdk.assertions import Capture, Match

from ryusen_server.aws.store import BLOCKED_INDEX, CHECK_INDEX, LIST_INDEX
from tests.infra.conftest import Synthesized, synthesize

HANDLERS = ("ryusen_server.lambdas.api.handler", "ryusen_server.lambdas.dispatch.handler")


def test_the_dispatch_event_source_reports_item_failures_one_record_at_a_time(synthesized: Synthesized) -> None:
    synthesized.assertions.has_resource_properties(
        "AWS::Lambda::EventSourceMapping",
        {
            "BatchSize": 1,  # one attempt per invocation: each can use the whole 15 minutes
            "FunctionResponseTypes": ["ReportBatchItemFailures"],  # a kept message is an attempt's lease
            "ScalingConfig": {"MaximumConcurrency": Match.any_value()},
        },
    )


def test_the_default_concurrency_fits_a_fresh_accounts_quota(synthesized: Synthesized) -> None:
    """Issue 24: a new account may run as few as 10 Lambda executions at once, shared by every function. Each
    dispatcher waits on one request to the app's function, and the API and the sweeper need one each: by
    default, all of them at once fit. No function reserves concurrency (Lambda refuses a reservation that
    leaves too little unreserved, which on such an account is any)."""
    from ryusen_infra.engine import FRESH_ACCOUNT_CONCURRENCY

    [mapping] = synthesized.resources("AWS::Lambda::EventSourceMapping").values()
    dispatchers = mapping["Properties"]["ScalingConfig"]["MaximumConcurrency"]
    app_requests, api, sweep = dispatchers, 1, 1
    assert FRESH_ACCOUNT_CONCURRENCY == 10
    assert dispatchers + app_requests + api + sweep <= FRESH_ACCOUNT_CONCURRENCY
    assert dispatchers >= 2  # the event source's minimum
    for name, function in synthesized.resources("AWS::Lambda::Function").items():
        assert "ReservedConcurrentExecutions" not in function["Properties"], name


def test_the_queue_outlives_the_dispatcher_and_redrives_to_a_dead_letter_queue(synthesized: Synthesized) -> None:
    _, dispatch = synthesized.function("ryusen_server.lambdas.dispatch.handler")
    timeout = dispatch["Properties"]["Timeout"]
    assert timeout == 360  # the default attempt's lease: 5 minutes and the 1-minute grace
    dlq = Capture()
    synthesized.assertions.has_resource_properties(
        "AWS::SQS::Queue",
        {
            "VisibilityTimeout": Match.any_value(),
            "RedrivePolicy": {"deadLetterTargetArn": {"Fn::GetAtt": [dlq, "Arn"]}, "maxReceiveCount": 10},
        },
    )
    [queue] = [r for r in synthesized.resources("AWS::SQS::Queue").values() if "RedrivePolicy" in r["Properties"]]
    assert queue["Properties"]["VisibilityTimeout"] >= timeout
    assert synthesized.template["Resources"][dlq.as_string()]["Type"] == "AWS::SQS::Queue"
    visibility = dispatch["Properties"]["Environment"]["Variables"]["RYUSEN_QUEUE_VISIBILITY_S"]
    assert float(visibility) == queue["Properties"]["VisibilityTimeout"]  # what lease_keeper compares with


def test_no_secret_is_in_any_environment_variable(synthesized: Synthesized) -> None:
    [master] = [n for n in synthesized.resources("AWS::SecretsManager::Secret") if "SigningKey" in n]
    synthesized.assertions.has_resource_properties(
        "AWS::SecretsManager::Secret", {"GenerateSecretString": {"PasswordLength": 64, "ExcludePunctuation": True}}
    )
    for name, function in synthesized.resources("AWS::Lambda::Function").items():
        variables: dict[str, Any] = function["Properties"].get("Environment", {}).get("Variables", {})
        assert "RYUSEN_SIGNING_KEY" not in variables and "RYUSEN_MASTER_KEY" not in variables, name
        handler = function["Properties"]["Handler"]
        if handler.startswith("ryusen_server.") and handler != "ryusen_server.lambdas.sweep.handler":
            assert variables["RYUSEN_MASTER_KEY_SECRET_ARN"] == {"Ref": master}, name  # where to read it, not it
        for key, value in variables.items():
            if isinstance(value, str):  # a literal: a setting, never a long random string
                assert not re.fullmatch(r"[A-Za-z0-9+/=_-]{24,}", value), (name, key)


def test_the_example_app_holds_a_key_derived_for_it_and_may_not_read_the_master(synthesized: Synthesized) -> None:
    """Issue 24: the example app held the master, which signs for every app. Now a custom resource derives the
    app's key at deploy into a secret of the app's own, before the app's function is created."""
    secrets = synthesized.resources("AWS::SecretsManager::Secret")
    [master] = [n for n in secrets if "SigningKey" in n]
    [app_secret] = [n for n in secrets if n != master]
    shop_name, shop = synthesized.function("shop.lambda_handler")
    variables = shop["Properties"]["Environment"]["Variables"]
    assert variables["RYUSEN_SIGNING_KEY_SECRET_ARN"] == {"Ref": app_secret}
    assert "RYUSEN_MASTER_KEY_SECRET_ARN" not in variables

    def readable(handler: str) -> set[str]:
        role = synthesized.function(handler)[1]["Properties"]["Role"]["Fn::GetAtt"][0]
        return {
            resource["Ref"]
            for policy in synthesized.resources("AWS::IAM::Policy").values()
            if {"Ref": role} in policy["Properties"]["Roles"]
            for statement in policy["Properties"]["PolicyDocument"]["Statement"]
            if "secretsmanager:GetSecretValue" in _as_list(statement["Action"])
            for resource in _as_list(statement["Resource"])
        }

    assert readable("shop.lambda_handler") == {app_secret}
    assert readable("derive_app_key.handler") == {master}
    [(derived, resource)] = synthesized.resources("Custom::RyusenAppKey").items()
    deriver, _ = synthesized.function("derive_app_key.handler")
    assert resource["Properties"] == {
        "ServiceToken": {"Fn::GetAtt": [deriver, "Arn"]},
        "AppId": "shop",
        "MasterKeySecretArn": {"Ref": master},
        "AppKeySecretArn": {"Ref": app_secret},
    }
    assert derived in synthesized.template["Resources"][shop_name]["DependsOn"]


def test_every_route_is_iam_authorized_but_the_late_result_route(synthesized: Synthesized) -> None:
    methods = synthesized.resources("AWS::ApiGateway::Method")
    resources = synthesized.resources("AWS::ApiGateway::Resource")

    def path(resource_ref: dict[str, Any]) -> str:
        parts: list[str] = []
        ref = resource_ref
        while "Ref" in ref and ref["Ref"] in resources:
            props = resources[ref["Ref"]]["Properties"]
            parts.insert(0, props["PathPart"])
            ref = props["ParentId"]
        return "/" + "/".join(parts)

    auth = {
        (path(m["Properties"]["ResourceId"]), m["Properties"]["HttpMethod"]): m["Properties"]["AuthorizationType"]
        for m in methods.values()
    }
    assert auth == {("/v1/{proxy+}", "ANY"): "AWS_IAM", ("/v1/results", "POST"): "NONE"}
    synthesized.assertions.has_resource_properties(
        "AWS::ApiGateway::Stage", {"MethodSettings": Match.array_with([Match.object_like({"ThrottlingRateLimit": 50})])}
    )


def test_the_scheduler_role_may_only_send_to_the_dispatch_queues(synthesized: Synthesized) -> None:
    synthesized.assertions.has_resource_properties(
        "AWS::IAM::Role",
        {
            "AssumeRolePolicyDocument": {
                "Statement": [
                    {
                        "Action": "sts:AssumeRole",
                        "Effect": "Allow",
                        "Principal": {"Service": "scheduler.amazonaws.com"},
                        "Condition": {"StringEquals": {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}},
                    }
                ]
            }
        },
    )
    policies = [
        p
        for p in synthesized.resources("AWS::IAM::Policy").values()
        if any("Scheduler" in r["Ref"] for r in p["Properties"]["Roles"])
    ]
    [policy] = policies
    [statement] = policy["Properties"]["PolicyDocument"]["Statement"]
    assert statement["Action"] == "sqs:SendMessage" and statement["Effect"] == "Allow"
    assert len(statement["Resource"]) == 2  # the dispatch queue and the scheduler's dead-letter queue


def test_alarms_watch_dead_letters_api_errors_dispatch_errors_and_blocked_runs(synthesized: Synthesized) -> None:
    alarms = synthesized.resources("AWS::CloudWatch::Alarm").values()
    metrics = sorted(a["Properties"].get("MetricName", "(math)") for a in alarms)
    assert metrics == sorted(
        [
            "ApproximateNumberOfMessagesVisible",
            "ApproximateNumberOfMessagesVisible",
            "ApproximateAgeOfOldestMessage",
            "5XXError",
            "DispatchErrors",
            "Errors",
            "BlockedRunAge",
            "(math)",  # DynamoDB throttled requests
            "(math)",  # engine functions throttled
            "(math)",  # the example app's function throttled
        ]
    )
    synthesized.assertions.has_resource_properties(
        "AWS::CloudWatch::Alarm",
        {"MetricName": "BlockedRunAge", "Namespace": "Ryusen", "Statistic": "Maximum", "Threshold": 3600},
    )
    synthesized.assertions.resource_count_is("AWS::CloudWatch::Dashboard", 1)


def _alarm_metrics(alarm: dict[str, Any]) -> list[dict[str, Any]]:
    """The metrics a math-expression alarm adds up."""
    return [m["MetricStat"]["Metric"] for m in alarm["Properties"].get("Metrics", []) if "MetricStat" in m]


def test_alarms_watch_throttles_and_the_dispatch_queues_oldest_message(synthesized: Synthesized) -> None:
    """Issue 24: DynamoDB and Lambda throttles, and a dispatch queue falling behind, alarm."""
    alarms = list(synthesized.resources("AWS::CloudWatch::Alarm").values())
    table = next(
        name
        for name, t in synthesized.resources("AWS::DynamoDB::Table").items()
        if len(t["Properties"]["KeySchema"]) == 2
    )
    [dynamodb] = [a for a in alarms if any(m["MetricName"] == "ThrottledRequests" for m in _alarm_metrics(a))]
    operations = set()
    for metric in _alarm_metrics(dynamodb):
        dimensions = {d["Name"]: d["Value"] for d in metric["Dimensions"]}
        assert (metric["Namespace"], dimensions["TableName"]) == ("AWS/DynamoDB", {"Ref": table})
        operations.add(dimensions["Operation"])
    assert {"GetItem", "PutItem", "UpdateItem", "Query", "TransactWriteItems", "BatchWriteItem"} <= operations
    engine = {
        name
        for name, f in synthesized.resources("AWS::Lambda::Function").items()
        if f["Properties"]["Handler"].startswith("ryusen_server.lambdas.")
    }
    [shop] = [
        n
        for n, f in synthesized.resources("AWS::Lambda::Function").items()
        if f["Properties"]["Handler"] == "shop.lambda_handler"
    ]
    throttled = [
        {d["Value"]["Ref"] for m in _alarm_metrics(a) for d in m["Dimensions"]}
        for a in alarms
        if any(m["MetricName"] == "Throttles" for m in _alarm_metrics(a))
    ]
    assert sorted(throttled, key=len) == [{shop}, engine]
    [queue] = [
        name for name, q in synthesized.resources("AWS::SQS::Queue").items() if "RedrivePolicy" in q["Properties"]
    ]
    [age] = [a for a in alarms if a["Properties"].get("MetricName") == "ApproximateAgeOfOldestMessage"]
    assert age["Properties"]["Dimensions"] == [{"Name": "QueueName", "Value": {"Fn::GetAtt": [queue, "QueueName"]}}]
    assert age["Properties"]["Threshold"] == (15 + 1 + 15) * 60  # the longest lease (15 min + 1), and 15 minutes
    for alarm in alarms:
        assert "AlarmActions" not in alarm["Properties"]  # nobody to notify unless asked


def test_alarms_notify_an_email_address_or_a_topic_given_as_settings(tmp_path: Path) -> None:
    by_email = synthesize(tmp_path / "email", alarm_email="ops@example.com")
    [topic] = by_email.resources("AWS::SNS::Topic")
    by_email.assertions.has_resource_properties(
        "AWS::SNS::Subscription", {"Protocol": "email", "Endpoint": "ops@example.com", "TopicArn": {"Ref": topic}}
    )
    alarms = by_email.resources("AWS::CloudWatch::Alarm").values()
    assert [a["Properties"]["AlarmActions"] for a in alarms] == [[{"Ref": topic}]] * len(alarms)
    assert [f for f in by_email.messages if "AwsSolutions" in str(f.entry.data)] == []
    assert cfn_lint(tmp_path, by_email) == ""

    arn = "arn:aws:sns:us-east-1:123456789012:on-call"
    by_topic = synthesize(tmp_path / "topic", alarm_topic_arn=arn)
    by_topic.assertions.resource_count_is("AWS::SNS::Topic", 0)
    alarms = by_topic.resources("AWS::CloudWatch::Alarm").values()
    assert [a["Properties"]["AlarmActions"] for a in alarms] == [[arn]] * len(alarms)

    from ryusen_infra import RyusenSettings

    with pytest.raises(ValueError, match="alarm_email"):
        RyusenSettings(alarm_email="not an address").check()
    with pytest.raises(ValueError, match="alarm_topic_arn"):
        RyusenSettings(alarm_topic_arn="on-call").check()


def test_functions_are_arm64_on_a_current_python_with_their_own_log_groups(synthesized: Synthesized) -> None:
    functions = synthesized.resources("AWS::Lambda::Function")
    for name, function in functions.items():
        props = function["Properties"]
        assert props["Architectures"] == ["arm64"] and props["Runtime"] == "python3.14", name
        assert "LoggingConfig" in props, name
    for group in synthesized.resources("AWS::Logs::LogGroup").values():
        assert group["Properties"]["RetentionInDays"] == 30
    _, api = synthesized.function("ryusen_server.lambdas.api.handler")
    assert api["Properties"]["Timeout"] == 29


def test_engine_functions_log_json_and_no_platform_line_for_a_successful_invocation(synthesized: Synthesized) -> None:
    """Every step is an invocation or two of these functions. Lambda's START, END and REPORT lines are about 250
    bytes an invocation, at CloudWatch Logs' price per byte: at system level WARN only a failed or timed-out
    invocation's report is kept (Lambda's Duration and Errors metrics still count them all)."""
    engine_functions = [
        props
        for function in synthesized.resources("AWS::Lambda::Function").values()
        if str((props := function["Properties"]).get("Handler", "")).startswith("ryusen_server.lambdas.")
    ]
    assert len(engine_functions) >= 4  # api, dispatch, results, sweep
    for props in engine_functions:
        config = props["LoggingConfig"]
        assert config["LogFormat"] == "JSON", props["Handler"]
        assert config["SystemLogLevel"] == "WARN", props["Handler"]
        assert config["ApplicationLogLevel"] == "INFO", props["Handler"]


def test_a_finished_run_is_kept_30_days_by_default_as_its_logs_are(synthesized: Synthesized) -> None:
    """Temporal Cloud's default retention (Lambda durable functions keep 14 days, Step Functions 90): the run
    store's storage is the largest part of a step's cost after its write (docs/performance.md)."""
    for handler in HANDLERS:
        assert (
            synthesized.function(handler)[1]["Properties"]["Environment"]["Variables"]["RYUSEN_RETENTION_DAYS"] == "30"
        )
    assert {g["Properties"]["RetentionInDays"] for g in synthesized.resources("AWS::Logs::LogGroup").values()} == {30}


def test_the_example_app_shares_a_replay_table_it_may_only_put_items_in(synthesized: Synthesized) -> None:
    """Decision 21: a request replayed to another container of the app is refused there too."""
    tables = {
        name: table
        for name, table in synthesized.resources("AWS::DynamoDB::Table").items()
        if table["Properties"]["KeySchema"] == [{"AttributeName": "pk", "KeyType": "HASH"}]
    }
    [(replay, table)] = tables.items()
    assert table["Properties"]["TimeToLiveSpecification"] == {"AttributeName": "expires_at", "Enabled": True}
    shop = [
        f
        for f in synthesized.resources("AWS::Lambda::Function").values()
        if f["Properties"]["Handler"] == "shop.lambda_handler"
    ]
    assert [f["Properties"]["Environment"]["Variables"]["RYUSEN_REPLAY_TABLE"] for f in shop] == [{"Ref": replay}]
    grants = [
        statement
        for policy in synthesized.resources("AWS::IAM::Policy").values()
        for statement in policy["Properties"]["PolicyDocument"]["Statement"]
        if any(r == {"Fn::GetAtt": [replay, "Arn"]} for r in _as_list(statement["Resource"]))
    ]
    assert [g["Action"] for g in grants] == ["dynamodb:PutItem"]


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def test_the_table_has_the_keys_and_indexes_the_store_reads(synthesized: Synthesized) -> None:
    synthesized.assertions.has_resource_properties(
        "AWS::DynamoDB::Table",
        {
            "KeySchema": [{"AttributeName": "pk", "KeyType": "HASH"}, {"AttributeName": "sk", "KeyType": "RANGE"}],
            "BillingMode": "PAY_PER_REQUEST",
            "PointInTimeRecoverySpecification": {"PointInTimeRecoveryEnabled": True},
            "TimeToLiveSpecification": {"AttributeName": "expires_at", "Enabled": True},
            "GlobalSecondaryIndexes": Match.array_with(
                [
                    Match.object_like(
                        {
                            "IndexName": LIST_INDEX,
                            "Projection": Match.object_like({"NonKeyAttributes": ["function_id", "phase", "outcome"]}),
                        }
                    ),
                    Match.object_like({"IndexName": BLOCKED_INDEX}),
                    Match.object_like(
                        {
                            "IndexName": CHECK_INDEX,
                            "KeySchema": [
                                {"AttributeName": "check_pk", "KeyType": "HASH"},
                                {"AttributeName": "check_at", "KeyType": "RANGE"},
                            ],
                            "Projection": {"ProjectionType": "KEYS_ONLY"},
                        }
                    ),
                ]
            ),
        },
    )


def test_settings_reach_the_functions_and_impossible_ones_are_refused(tmp_path: Path) -> None:
    import aws_cdk as cdk

    custom = synthesize(
        tmp_path,
        default_run_timeout=cdk.Duration.hours(1),
        max_run_timeout=cdk.Duration.days(2),
        dispatch_concurrency=10,
        dispatch_memory_mb=256,
        retention=None,
        fair_queue=False,
    )
    for handler in HANDLERS:
        variables = custom.function(handler)[1]["Properties"]["Environment"]["Variables"]
        assert variables["RYUSEN_FAIR_QUEUE"] == "false"
        assert variables["RYUSEN_DEFAULT_RUN_TIMEOUT_S"] == "3600"
        assert variables["RYUSEN_MAX_RUN_TIMEOUT_S"] == "172800"
        assert "RYUSEN_RETENTION_DAYS" not in variables
        assert variables["RYUSEN_MAX_ATTEMPT_TIMEOUT_S"] == "900"
    custom.assertions.has_resource_properties(
        "AWS::Lambda::EventSourceMapping", {"ScalingConfig": {"MaximumConcurrency": 10}}
    )
    assert custom.function("ryusen_server.lambdas.dispatch.handler")[1]["Properties"]["MemorySize"] == 256
    from ryusen_infra import RyusenSettings

    with pytest.raises(ValueError, match="max_attempt_timeout"):
        RyusenSettings(max_attempt_timeout=cdk.Duration.hours(13)).check()
    with pytest.raises(ValueError, match="dispatch_concurrency"):
        RyusenSettings(dispatch_concurrency=1).check()
    with pytest.raises(ValueError, match="dispatch_memory_mb"):
        RyusenSettings(dispatch_memory_mb=64).check()


def test_cdk_nag_finds_nothing_unexplained(synthesized: Synthesized) -> None:
    findings = [m.entry.data for m in synthesized.messages if "AwsSolutions" in str(m.entry.data)]
    assert findings == []


def test_cfn_lint_finds_nothing(tmp_path: Path, synthesized: Synthesized) -> None:
    assert cfn_lint(tmp_path, synthesized) == ""


def cfn_lint(tmp_path: Path, synthesized: Synthesized) -> str:
    """cfn-lint's findings on the template (empty: none)."""
    template = tmp_path / "Ryusen.template.json"
    template.write_text(json.dumps(synthesized.template))
    # W3005: CDK adds a DependsOn on each function's role policy next to the GetAtt of the role; harmless
    done = subprocess.run(
        [str(Path(sys.executable).parent / "cfn-lint"), "--ignore-checks", "W3005", "--", str(template)],
        capture_output=True,
        text=True,
        check=False,
    )
    return "" if done.returncode == 0 else done.stdout + done.stderr


def test_the_result_route_has_a_throttle_of_its_own(synthesized: Synthesized) -> None:
    synthesized.assertions.has_resource_properties(
        "AWS::ApiGateway::Stage",
        {
            "MethodSettings": Match.array_with(
                [
                    Match.object_like(
                        {"ResourcePath": "/~1v1~1results", "HttpMethod": "POST", "ThrottlingRateLimit": 500}
                    )
                ]
            )
        },
    )


def test_the_sweeper_runs_every_minute(synthesized: Synthesized) -> None:
    """Issue 12: a run whose task message or schedule was lost after its write is repaired within minutes."""
    [(name, sweep)] = [
        (name, f)
        for name, f in synthesized.resources("AWS::Lambda::Function").items()
        if f["Properties"]["Handler"] == "ryusen_server.lambdas.sweep.handler"
    ]
    rules = list(synthesized.resources("AWS::Events::Rule").values())
    assert [r["Properties"]["ScheduleExpression"] for r in rules] == ["rate(1 minute)"]
    assert rules[0]["Properties"]["Targets"][0]["Arn"] == {"Fn::GetAtt": [name, "Arn"]}
    # issue 24: the sweeper holds no key, and its environment does not even name the secret
    assert "RYUSEN_MASTER_KEY_SECRET_ARN" not in sweep["Properties"]["Environment"]["Variables"]


def test_a_default_deploy_needs_no_api_gateway_account_setting(synthesized: Synthesized) -> None:
    """Issue 24: a stage with access logs is refused until the account names a CloudWatch Logs role. By default
    the stage logs nothing that needs that role, and the stack does not touch the account-wide setting."""
    [stage] = synthesized.resources("AWS::ApiGateway::Stage").values()
    assert "AccessLogSetting" not in stage["Properties"]
    for method in stage["Properties"].get("MethodSettings", []):
        assert method.get("LoggingLevel", "OFF") == "OFF" and not method.get("DataTraceEnabled"), method
    synthesized.assertions.resource_count_is("AWS::ApiGateway::Account", 0)


def test_access_logs_with_the_opt_in_account_role_come_after_the_account_setting(tmp_path: Path) -> None:
    custom = synthesize(tmp_path, api_access_logs=True, api_account_logs_role=True)
    [(account, setting)] = custom.resources("AWS::ApiGateway::Account").items()
    role = setting["Properties"]["CloudWatchRoleArn"]["Fn::GetAtt"][0]
    props = custom.template["Resources"][role]["Properties"]
    assert props["AssumeRolePolicyDocument"]["Statement"] == [
        {"Action": "sts:AssumeRole", "Effect": "Allow", "Principal": {"Service": "apigateway.amazonaws.com"}}
    ]
    assert custom.template["Resources"][role]["DeletionPolicy"] == "Retain"  # the account setting outlives the stack
    [stage] = custom.resources("AWS::ApiGateway::Stage").values()
    assert "DestinationArn" in stage["Properties"]["AccessLogSetting"]
    assert account in stage["DependsOn"]  # created once the account names the role
    assert [f for f in custom.messages if "AwsSolutions" in str(f.entry.data)] == []
    assert cfn_lint(tmp_path, custom) == ""


def test_access_logs_alone_rely_on_the_account_role_being_set_already(tmp_path: Path) -> None:
    custom = synthesize(tmp_path, api_access_logs=True)
    [stage] = custom.resources("AWS::ApiGateway::Stage").values()
    assert "DestinationArn" in stage["Properties"]["AccessLogSetting"]
    custom.assertions.resource_count_is("AWS::ApiGateway::Account", 0)


def test_the_runs_table_and_the_master_key_outlive_the_stack(synthesized: Synthesized) -> None:
    """Issue 24: docs/deploy.md says `cdk destroy` keeps the runs; the key that verifies their late results and
    signs for every app is kept with them, and the table cannot be deleted by accident."""
    [secret] = [r for n, r in synthesized.resources("AWS::SecretsManager::Secret").items() if "SigningKey" in n]
    assert (secret["DeletionPolicy"], secret["UpdateReplacePolicy"]) == ("Retain", "Retain")
    synthesized.assertions.has_resource(
        "AWS::DynamoDB::Table",
        {
            "DeletionPolicy": "Retain",
            "UpdateReplacePolicy": "Retain",
            "Properties": Match.object_like(
                {
                    "DeletionProtectionEnabled": True,
                    "KeySchema": Match.array_with([{"AttributeName": "sk", "KeyType": "RANGE"}]),
                }
            ),
        },
    )


def test_the_sweeper_may_not_read_the_master_key(synthesized: Synthesized) -> None:
    """Issue 24: the sweeper only reads runs and sends their messages and schedules; it signs nothing."""
    [secret] = [n for n, r in synthesized.resources("AWS::SecretsManager::Secret").items() if "SigningKey" in n]
    _, sweep = synthesized.function("ryusen_server.lambdas.sweep.handler")
    role = sweep["Properties"]["Role"]["Fn::GetAtt"][0]
    for policy in synthesized.resources("AWS::IAM::Policy").values():
        if {"Ref": role} in policy["Properties"]["Roles"]:
            for statement in policy["Properties"]["PolicyDocument"]["Statement"]:
                assert {"Ref": secret} not in _as_list(statement["Resource"]), statement


def test_an_app_with_a_dispatch_concurrency_of_its_own_gets_its_own_queue_and_capped_event_source(
    tmp_path: Path,
) -> None:
    """Issue 25, fair sharing on AWS: an app named in ``app_dispatch_concurrency`` has a dispatch queue of its own
    (redriving to the same dead-letter queue), whose event source runs at most that many dispatchers; every
    function that sends tasks may send there and knows the queue (``RYUSEN_APP_QUEUES``), and cdk-nag finds
    nothing new."""
    import json

    from ryusen_infra import RyusenSettings

    custom = synthesize(tmp_path, app_dispatch_concurrency={"video": 3})
    engine = custom.stack.engine
    [video] = engine.app_queues.values()
    video_id = custom.stack.get_logical_id(video.node.default_child)
    queue = custom.template["Resources"][video_id]["Properties"]
    assert queue["RedrivePolicy"]["maxReceiveCount"] == 10
    assert queue["RedrivePolicy"]["deadLetterTargetArn"] == {
        "Fn::GetAtt": [custom.stack.get_logical_id(engine.dead_letter_queue.node.default_child), "Arn"]
    }
    mappings = {
        m["Properties"]["EventSourceArn"]["Fn::GetAtt"][0]: m["Properties"]
        for m in custom.resources("AWS::Lambda::EventSourceMapping").values()
    }
    assert mappings[video_id]["ScalingConfig"] == {"MaximumConcurrency": 3}
    assert mappings[video_id]["BatchSize"] == 1 and mappings[video_id]["FunctionResponseTypes"] == [
        "ReportBatchItemFailures"
    ]
    assert len(mappings) == 2  # the shared queue's, and video's
    from ryusen_infra.engine import app_queue_digest

    assert queue["QueueName"] == f"{engine.app_queue_prefix}{app_queue_digest('video')}"
    for handler in (*HANDLERS, "ryusen_server.lambdas.results.handler", "ryusen_server.lambdas.sweep.handler"):
        variables = custom.function(handler)[1]["Properties"]["Environment"]["Variables"]
        assert variables["RYUSEN_APP_QUEUES"] == app_queue_digest("video")
        assert variables["RYUSEN_APP_QUEUE_PREFIX"] == engine.app_queue_prefix
    granted = json.dumps(custom.resources("AWS::IAM::Policy"))
    assert (
        granted.count(video_id) >= 5
    )  # SendMessage for api, dispatch, results, the Scheduler; ChangeMessageVisibility
    assert [m.entry.data for m in custom.messages if "AwsSolutions" in str(m.entry.data)] == []
    ages = [
        a["Properties"]["Dimensions"]
        for a in custom.resources("AWS::CloudWatch::Alarm").values()
        if a["Properties"].get("MetricName") == "ApproximateAgeOfOldestMessage"
    ]
    assert [{"Name": "QueueName", "Value": {"Fn::GetAtt": [video_id, "QueueName"]}}] in ages  # its backlog alarms
    RyusenSettings(app_dispatch_concurrency={"café": 2, "video encoder": 3}).check()  # any app id
    for bad in ({"video": 1}, {"video": 1001}, {"": 4}, {"a\tb": 4}, {"video": True}):
        with pytest.raises(ValueError, match="app_dispatch_concurrency"):
            RyusenSettings(app_dispatch_concurrency=bad).check()

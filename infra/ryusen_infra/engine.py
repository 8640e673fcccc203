"""``RyusenEngine``: the whole server in one construct, to compose into your own CDK app.

What it creates, and why each piece is shaped the way it is:

* **table**: one DynamoDB table (``pk``/``sk``, on demand, point-in-time recovery, TTL on
  ``expires_at``) with the two indexes the store reads (``runs_by_created`` over 16 partition keys,
  ``runs_blocked_by_definition``, sparse). Its conditional writes are the engine's fencing.
* **queue** and **dead_letter_queue**: the dispatch queue carries every task and timer message. Its
  visibility timeout equals the dispatch function's timeout (Lambda refuses less), which is the default
  attempt's lease; a message that fails ``max_receive_count`` times moves to the dead-letter queue, which
  an alarm watches.
* **sweep_function**: every minute (an EventBridge rule), repairs runs whose work is overdue with nothing on
  its way (a task message or a schedule lost after its write), reading the ``runs_to_check`` index.
* **dispatch_function**: the SQS event source, one record per invocation (``batch_size=1``: an attempt
  can use the whole invocation) with ``ReportBatchItemFailures`` (a kept message is an attempt's lease
  timer; without it the event source would delete it) and a maximum concurrency.
* **api_function** and **api**: the server API as a REST API with IAM (SigV4) authorization on every
  route except ``POST /v1/results``, where SDKs submit late results signed with the app's key (they
  have no AWS credentials; the handler verifies the signature and refuses anything else).
* **master_key**: a Secrets Manager secret holding the master key every app's signing key is derived
  from (decisions 21); the functions read it at cold start (never an environment variable) and again every
  5 minutes, so a rotation takes effect.
* **scheduler_role**, **schedule_group**, **scheduler_dead_letter_queue**: EventBridge Scheduler puts
  deadline, probe and long-delay messages on the dispatch queue through a role that may do exactly
  that; a target that keeps failing leaves its input in a dead-letter queue, with an alarm.
* **alarms** and **dashboard**: dead-letter queues not empty, API 5xx, dispatch errors, runs blocked for
  long, DynamoDB and Lambda throttles, a dispatch queue falling behind; and the figures an operator looks at
  first. Alarms notify ``alarm_topic`` (or ``alarm_topic_arn``, or a topic made for ``alarm_email``).

Every function gets a policy of its own, listing the actions its code calls on the resources it calls
them on (tests/infra proves the list against what the handlers really call on moto).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aws_cdk as cdk
from aws_cdk import aws_apigateway as apigateway
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_cloudwatch_actions as cloudwatch_actions
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as events_targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda
from aws_cdk import aws_lambda_event_sources as event_sources
from aws_cdk import aws_logs as logs
from aws_cdk import aws_scheduler as scheduler
from aws_cdk import aws_secretsmanager as secretsmanager
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from aws_cdk import aws_sqs as sqs
from aws_cdk import aws_wafv2 as wafv2
from constructs import Construct

from .bundling import ARCHITECTURE, RUNTIME, lambda_code

LIST_INDEX = "runs_by_created"
BLOCKED_INDEX = "runs_blocked_by_definition"
CHECK_INDEX = "runs_to_check"
LAMBDA_MAX_TIMEOUT = cdk.Duration.minutes(15)
LEASE_GRACE = cdk.Duration.minutes(1)
FRESH_ACCOUNT_CONCURRENCY = 10
"""How many Lambda executions a new account may run at once in a region (AWS lowers new accounts' quota and
raises it with use; the usual quota is 1,000). The default dispatch concurrency fits in it (docs/deploy.md)."""
MAX_APP_QUEUES = 20
"""The most apps with a dispatch queue of their own: each is an event source of the dispatch function, polling
whether or not it has work (a few cents a month each) and counting against the account's Lambda concurrency, and
each adds statements to the engine's roles (past about 25 apps, CDK splits the dispatch role's policy)."""


def app_queue_digest(app_id: str) -> str:
    """What names an app's own dispatch queue (``ryusen_server.aws.queue.app_queue_digest`` computes the same)."""
    return hashlib.sha256(app_id.encode()).hexdigest()[:12]


MAX_VISIBILITY = cdk.Duration.hours(12)
"""SQS's longest visibility timeout: an attempt's lease (its timeout plus the grace) must fit in it."""


@dataclass(frozen=True, kw_only=True)
class RyusenSettings:
    """The deployment's settings (all optional; the defaults are RFD 1's, decisions 6.8)."""

    default_run_timeout: cdk.Duration | None = None
    """The deadline of runs whose function and start request declare none (shown on the run as its source)."""
    max_run_timeout: cdk.Duration | None = None
    """A larger declared run timeout is refused (at sync or at start), never clamped."""
    attempt_timeout: cdk.Duration = cdk.Duration.minutes(5)
    """A step attempt's timeout when the step declares none."""
    max_attempt_timeout: cdk.Duration = cdk.Duration.minutes(15)
    """The longest attempt timeout a step may declare (``invalid_step`` beyond it). At most 42,840 s (SQS's 12-hour
    visibility, less the lease grace and a margin: ``check``); past what the dispatcher listens for, the SDK posts
    the answer to the result function."""
    forward_max_attempts: int = 4
    forward_initial_delay: cdk.Duration = cdk.Duration.seconds(1)
    compensate_max_attempts: int = 10
    compensate_initial_delay: cdk.Duration = cdk.Duration.seconds(1)
    retention: cdk.Duration | None = cdk.Duration.days(30)
    """How long a finished run is kept (DynamoDB TTL); None keeps runs forever. 30 days by default, as its logs
    (``log_retention``) and as Temporal Cloud's default; storage is the largest part of a step's cost after its
    write, and grows with this (docs/performance.md)."""
    dispatch_concurrency: int = 4
    """At most this many dispatch functions run at once (the event source's maximum concurrency, 2-1000). Each
    waits on one request to an app, which on Lambda is one more execution: the default, 4, fills a fresh account's
    quota of 10 with 4 app requests, the API and the sweeper, leaving the result function no headroom (its
    throttled posts are retried). Raise it with the quota (docs/deploy.md, "Concurrency")."""
    dispatch_memory_mb: int = 512
    """The dispatch function's memory (128-10,240 MB), which sets its CPU share. ``bench/dispatcher_size.py`` measured
    about 5 ms of CPU per step and a peak of 125 MB: 512 MB adds about 17 ms a step; 256 MB adds about 34 ms and
    halves what a second of waiting costs ($3.33 per million steps instead of $6.67), which is what a Lambda
    endpoint's long steps cost, since the dispatcher waits for them (docs/deploy.md, "What it costs")."""
    app_dispatch_concurrency: Mapping[str, int] = field(default_factory=dict)
    """Apps whose tasks get a dispatch queue of their own, by app id, with at most this many dispatch functions
    running them at once (that queue's event source's maximum concurrency, 2-1000). An app not named here shares
    the dispatch queue, and ``dispatch_concurrency``, with the others. What it bounds is the dispatchers an app
    holds: an app whose attempts are answered inline (a Lambda app without events) holds one for each step in
    flight, and with this, no more than its own share, however slow its steps. Timers and tasks delayed past 15
    minutes still arrive through the shared queue (docs/security.md, "What one app can take from another")."""
    fair_queue: bool = True
    """Send each task with its run's app as its message group, which makes the dispatch queue an SQS fair
    queue: when one app's messages take a disproportionate share of those in flight, or of the dispatchers'
    time, SQS hands out the other apps' messages first (docs/security.md, "What one app can take from
    another"). Turn it off only in a partition whose standard queues refuse a message group."""
    log_retention: logs.RetentionDays = logs.RetentionDays.ONE_MONTH
    alarm_topic: sns.ITopic | None = None
    """Where alarms notify, as a topic of your CDK app (optional)."""
    alarm_topic_arn: str | None = None
    """Where alarms notify, as an existing SNS topic's ARN (``ryusen:alarm_topic_arn``), if no ``alarm_topic``."""
    alarm_email: str | None = None
    """An address subscribed to the alarm topic (``ryusen:alarm_email``); without a topic, the stack creates
    one. SNS mails a confirmation link first: nothing is delivered until it is followed."""
    queue_age_alarm_after: cdk.Duration | None = None
    """Alarm when the dispatch queue's oldest message is older than this (default: the longest attempt's lease,
    ``max_attempt_timeout`` plus a minute, and 15 minutes more): the dispatchers are not keeping up."""
    blocked_alarm_after: cdk.Duration = cdk.Duration.hours(1)
    """Alarm when a probed run has been blocked longer than this."""
    api_rate_limit: int = 50
    api_burst_limit: int = 100
    """Every route but the result route: operators' and CI's calls."""
    result_rate_limit: int = 500
    result_burst_limit: int = 1000
    """The result route, which SDKs call without AWS credentials: a throttle of its own, larger, so that
    operators' traffic cannot crowd it out (and a WAF web ACL can rate-limit callers by address)."""
    endpoint_allowed_networks: tuple[str, ...] = ()
    """Networks (CIDRs) besides the public internet that an app's endpoint URL may resolve to (decisions 22):
    a VPC's private range, say. Loopback, private and link-local addresses (the instance metadata service)
    are refused otherwise."""
    web_acl_arn: str | None = None
    """A WAF web ACL to associate with the API's stage (recommended: a rate-based rule per IP, since
    anyone can reach the result route; requests that fail the signature check are refused, but still count)."""
    api_access_logs: bool = False
    """Write the API stage's access log to a log group. API Gateway refuses such a stage until the account (in
    this region) names a CloudWatch Logs role; off by default, so that a deploy to a fresh account works."""
    api_account_logs_role: bool = False
    """Create that role and set it as the account's (``AWS::ApiGateway::Account``, one per account and region:
    it replaces any role set before, and stays after the stack is deleted). The stage is created after it."""

    def check(self) -> None:
        if not 2 <= self.dispatch_concurrency <= 1000:
            raise ValueError(f"dispatch_concurrency must be 2-1000, not {self.dispatch_concurrency}")
        if len(self.app_dispatch_concurrency) > MAX_APP_QUEUES:
            raise ValueError(f"app_dispatch_concurrency names at most {MAX_APP_QUEUES} apps")
        for app_id, concurrency in self.app_dispatch_concurrency.items():
            if not isinstance(app_id, str) or not 1 <= len(app_id) <= 256 or not app_id.isprintable():
                raise ValueError(f"app_dispatch_concurrency: {app_id!r} is not an app id (1-256 printable characters)")
            if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 2 <= concurrency <= 1000:
                raise ValueError(f"app_dispatch_concurrency[{app_id!r}] must be 2-1000, not {concurrency!r}")
        if not 128 <= self.dispatch_memory_mb <= 10_240:
            raise ValueError(f"dispatch_memory_mb must be 128-10240 (Lambda's range), not {self.dispatch_memory_mb}")
        longest = MAX_VISIBILITY.to_seconds() - LEASE_GRACE.to_seconds() - 300
        if self.max_attempt_timeout.to_seconds() > longest:
            raise ValueError(
                f"max_attempt_timeout may be at most {longest:g} s: its lease (plus a minute) must fit well inside"
                " SQS's 12-hour visibility limit"
            )
        if self.attempt_timeout.to_seconds() > self.max_attempt_timeout.to_seconds():
            raise ValueError("attempt_timeout must not exceed max_attempt_timeout")
        if self.alarm_email is not None and not re.fullmatch(r"[^@\s]+@[^@\s]+\.[^@\s]+", self.alarm_email):
            raise ValueError(f"alarm_email must be an email address, not {self.alarm_email!r}")
        if self.alarm_topic_arn is not None and not re.fullmatch(
            r"arn:[\w-]+:sns:[\w-]+:\d{12}:[\w-]+", self.alarm_topic_arn
        ):
            raise ValueError(f"alarm_topic_arn must be an SNS topic's ARN, not {self.alarm_topic_arn!r}")
        default, maximum = self.default_run_timeout, self.max_run_timeout
        if default and maximum and default.to_seconds() > maximum.to_seconds():
            raise ValueError("default_run_timeout must not exceed max_run_timeout")

    @property
    def queue_age_threshold(self) -> cdk.Duration:
        """When the dispatch queue's oldest message is late: a message kept as an attempt's lease timer is as old
        as its lease; past the longest lease and 15 minutes, messages wait for a dispatcher."""
        if self.queue_age_alarm_after is not None:
            return self.queue_age_alarm_after
        longest_lease = self.max_attempt_timeout.to_seconds() + LEASE_GRACE.to_seconds()
        return cdk.Duration.seconds(longest_lease + cdk.Duration.minutes(15).to_seconds())

    @property
    def dispatch_timeout(self) -> cdk.Duration:
        """The dispatch function's timeout, and the queue's visibility: the default attempt's lease (its
        timeout plus the grace), so that for most attempts the message is already invisible for exactly the
        lease and needs no ChangeMessageVisibility; capped at Lambda's 15 minutes. The dispatcher stops
        listening before its time is up, and a later answer reaches the result route."""
        lease = self.attempt_timeout.to_seconds() + LEASE_GRACE.to_seconds()
        return cdk.Duration.seconds(min(lease, LAMBDA_MAX_TIMEOUT.to_seconds()))

    def environment(self) -> dict[str, str]:
        """The settings as the server reads them (``ryusen_server.settings``)."""
        env = {
            "RYUSEN_ATTEMPT_TIMEOUT_S": _seconds(self.attempt_timeout),
            "RYUSEN_MAX_ATTEMPT_TIMEOUT_S": _seconds(self.max_attempt_timeout),
            "RYUSEN_LEASE_GRACE_S": _seconds(LEASE_GRACE),
            "RYUSEN_RETRY_MAX_ATTEMPTS": str(self.forward_max_attempts),
            "RYUSEN_RETRY_INITIAL_DELAY_S": _seconds(self.forward_initial_delay),
            "RYUSEN_COMPENSATE_MAX_ATTEMPTS": str(self.compensate_max_attempts),
            "RYUSEN_COMPENSATE_INITIAL_DELAY_S": _seconds(self.compensate_initial_delay),
        }
        if self.default_run_timeout is not None:
            env["RYUSEN_DEFAULT_RUN_TIMEOUT_S"] = _seconds(self.default_run_timeout)
        if self.max_run_timeout is not None:
            env["RYUSEN_MAX_RUN_TIMEOUT_S"] = _seconds(self.max_run_timeout)
        if self.retention is not None:
            env["RYUSEN_RETENTION_DAYS"] = f"{self.retention.to_days():g}"
        if self.endpoint_allowed_networks:
            env["RYUSEN_ENDPOINT_ALLOWED_NETWORKS"] = ",".join(self.endpoint_allowed_networks)
        if not self.fair_queue:
            env["RYUSEN_FAIR_QUEUE"] = "false"
        return env


def function_role(scope: Construct, construct_id: str, log_group: logs.ILogGroup) -> iam.Role:
    """A function's own role: it may write to its own log group, and nothing else until granted."""
    role = iam.Role(scope, construct_id, assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"))
    role.add_to_policy(
        iam.PolicyStatement(
            sid="Logs", actions=["logs:CreateLogStream", "logs:PutLogEvents"], resources=[log_group.log_group_arn]
        )
    )
    return role


def _seconds(duration: cdk.Duration) -> str:
    return f"{duration.to_seconds():g}"


class RyusenEngine(Construct):
    """The Ryusen server: table, queues, functions, API, schedules' role, secret, alarms, dashboard."""

    def __init__(self, scope: Construct, construct_id: str, *, settings: RyusenSettings | None = None) -> None:
        super().__init__(scope, construct_id)
        self.settings = settings = settings or RyusenSettings()
        settings.check()
        stack = cdk.Stack.of(self)

        self.table = dynamodb.Table(
            self,
            "Table",
            partition_key=dynamodb.Attribute(name="pk", type=dynamodb.AttributeType.STRING),
            sort_key=dynamodb.Attribute(name="sk", type=dynamodb.AttributeType.STRING),
            billing_mode=dynamodb.BillingMode.PAY_PER_REQUEST,
            point_in_time_recovery_specification=dynamodb.PointInTimeRecoverySpecification(
                point_in_time_recovery_enabled=True
            ),
            time_to_live_attribute="expires_at",
            removal_policy=cdk.RemovalPolicy.RETAIN,  # the runs outlive the stack (docs/deploy.md, Removing)
            deletion_protection=True,
        )
        self.table.add_global_secondary_index(
            index_name=LIST_INDEX,
            partition_key=dynamodb.Attribute(name="list_pk", type=dynamodb.AttributeType.STRING),
            sort_key=dynamodb.Attribute(name="list_sk", type=dynamodb.AttributeType.STRING),
            projection_type=dynamodb.ProjectionType.INCLUDE,
            non_key_attributes=["function_id", "phase", "outcome"],
        )
        self.table.add_global_secondary_index(
            index_name=BLOCKED_INDEX,
            partition_key=dynamodb.Attribute(name="blocked_fn", type=dynamodb.AttributeType.STRING),
            sort_key=dynamodb.Attribute(name="list_sk", type=dynamodb.AttributeType.STRING),
            projection_type=dynamodb.ProjectionType.KEYS_ONLY,
        )
        self.table.add_global_secondary_index(  # the sweeper's: unfinished runs by when to look at them
            index_name=CHECK_INDEX,
            partition_key=dynamodb.Attribute(name="check_pk", type=dynamodb.AttributeType.STRING),
            sort_key=dynamodb.Attribute(name="check_at", type=dynamodb.AttributeType.STRING),
            projection_type=dynamodb.ProjectionType.KEYS_ONLY,
        )

        retention = cdk.Duration.days(14)
        self.dead_letter_queue = sqs.Queue(
            self,
            "DeadLetterQueue",
            retention_period=retention,
            enforce_ssl=True,
            encryption=sqs.QueueEncryption.SQS_MANAGED,
        )
        self.queue = sqs.Queue(
            self,
            "DispatchQueue",
            visibility_timeout=settings.dispatch_timeout,
            retention_period=retention,
            enforce_ssl=True,
            encryption=sqs.QueueEncryption.SQS_MANAGED,
            dead_letter_queue=sqs.DeadLetterQueue(max_receive_count=10, queue=self.dead_letter_queue),
        )
        self.app_queues: dict[str, sqs.Queue] = {}
        """The dispatch queue of each app named in ``app_dispatch_concurrency``, named ``app_queue_prefix`` and its
        app's digest, so that the functions' environment names them in 13 bytes an app (Lambda allows 4 KB)."""
        where = f"{stack.stack_name}/{self.node.path}"
        self.app_queue_prefix = "ryusen-" + hashlib.sha256(where.encode()).hexdigest()[:8] + "-"
        """This deployment's app queues' names begin so (by its stack's name and the construct's path: one stack's
        app queues are not another's, in an account's region)."""
        for app_id in sorted(settings.app_dispatch_concurrency):
            digest = app_queue_digest(app_id)  # a logical id and a name that never change for the app
            self.app_queues[app_id] = sqs.Queue(
                self,
                f"AppQueue{digest}",
                queue_name=f"{self.app_queue_prefix}{digest}",
                visibility_timeout=settings.dispatch_timeout,
                retention_period=retention,
                enforce_ssl=True,
                encryption=sqs.QueueEncryption.SQS_MANAGED,
                dead_letter_queue=sqs.DeadLetterQueue(max_receive_count=10, queue=self.dead_letter_queue),
            )
        self.scheduler_dead_letter_queue = sqs.Queue(
            self,
            "SchedulerDeadLetterQueue",
            retention_period=retention,
            enforce_ssl=True,
            encryption=sqs.QueueEncryption.SQS_MANAGED,
        )

        self.master_key = secretsmanager.Secret(
            self,
            "SigningKey",  # the logical id of the secret since the first release: kept, so it is not replaced
            description="Ryusen's master key: each app's HMAC signing key is derived from it (read by the functions)",
            generate_secret_string=secretsmanager.SecretStringGenerator(password_length=64, exclude_punctuation=True),
            removal_policy=cdk.RemovalPolicy.RETAIN,  # kept with the runs, whose late results it verifies
        )

        self.schedule_group = scheduler.CfnScheduleGroup(self, "ScheduleGroup")
        self.scheduler_role = iam.Role(
            self,
            "SchedulerRole",
            description="EventBridge Scheduler puts Ryusen's timer and delayed task messages on the dispatch queue",
            assumed_by=iam.ServicePrincipal(
                "scheduler.amazonaws.com", conditions={"StringEquals": {"aws:SourceAccount": stack.account}}
            ),
        )
        self.scheduler_role.add_to_policy(
            iam.PolicyStatement(
                actions=["sqs:SendMessage"],
                # an app's task delayed past SQS's 15 minutes arrives on the app's own queue
                resources=[
                    self.queue.queue_arn,
                    self.scheduler_dead_letter_queue.queue_arn,
                    *(q.queue_arn for q in self.app_queues.values()),
                ],
            )
        )

        code = lambda_code()
        common = {
            "RYUSEN_TABLE": self.table.table_name,
            "RYUSEN_QUEUE_URL": self.queue.queue_url,
            "RYUSEN_QUEUE_ARN": self.queue.queue_arn,
            "RYUSEN_QUEUE_VISIBILITY_S": _seconds(settings.dispatch_timeout),
            "RYUSEN_SCHEDULE_GROUP": self.schedule_group.ref,
            "RYUSEN_SCHEDULER_ROLE_ARN": self.scheduler_role.role_arn,
            "RYUSEN_SCHEDULER_DLQ_ARN": self.scheduler_dead_letter_queue.queue_arn,
            "RYUSEN_MASTER_KEY_SECRET_ARN": self.master_key.secret_arn,
            "POWERTOOLS_METRICS_NAMESPACE": "Ryusen",
            **settings.environment(),
        }
        if self.app_queues:
            common["RYUSEN_APP_QUEUE_PREFIX"] = self.app_queue_prefix
            common["RYUSEN_APP_QUEUES"] = ",".join(app_queue_digest(a) for a in sorted(self.app_queues))
        self.api_function = self._function(
            "ApiFunction",
            "ryusen_server.lambdas.api.handler",
            code,
            {**common, "RYUSEN_INDEX_SETTLE_S": "2"},  # a release sync looks again once the GSI caught up
            cdk.Duration.seconds(29),
            "api",
        )
        self.api = apigateway.RestApi(
            self,
            "Api",
            description="Ryusen's server API (contract 2): SigV4 on every route but the late-result route",
            deploy_options=apigateway.StageOptions(
                stage_name="v1api",
                throttling_rate_limit=settings.api_rate_limit,
                throttling_burst_limit=settings.api_burst_limit,
                method_options={
                    "/v1/results/POST": apigateway.MethodDeploymentOptions(
                        throttling_rate_limit=settings.result_rate_limit,
                        throttling_burst_limit=settings.result_burst_limit,
                    )
                },
                **self._access_logs(settings),
            ),
            cloud_watch_role=False,
        )
        if settings.api_account_logs_role:
            self.api.deployment_stage.node.add_dependency(self._api_account_logs_role())
        if settings.web_acl_arn is not None:
            wafv2.CfnWebACLAssociation(
                self, "ApiWebAcl", resource_arn=self.api.deployment_stage.stage_arn, web_acl_arn=settings.web_acl_arn
            )
        integration = apigateway.LambdaIntegration(self.api_function)
        v1 = self.api.root.add_resource("v1")
        v1.add_resource("{proxy+}").add_method("ANY", integration, authorization_type=apigateway.AuthorizationType.IAM)
        # SDKs submit late results here without AWS credentials; the handler verifies the app's signature
        v1.add_resource("results").add_method("POST", integration, authorization_type=apigateway.AuthorizationType.NONE)

        # SDKs post outcomes and heartbeats to the result function's URL, without AWS credentials (the app's
        # signature authenticates them): a Lambda request per post, not an API Gateway one (docs/design/dispatch.md)
        self.result_function = self._function(
            "ResultFunction",
            "ryusen_server.lambdas.results.handler",
            code,
            common,
            cdk.Duration.seconds(60),
            "results",
            memory_mb=256,
        )
        self.result_url = self.result_function.add_function_url(auth_type=aws_lambda.FunctionUrlAuthType.NONE)
        cdk.CfnOutput(
            self, "ResultUrl", value=self.result_url.url, description="Where SDKs post outcomes and heartbeats"
        )

        self.dispatch_function = self._function(
            "DispatchFunction",
            "ryusen_server.lambdas.dispatch.handler",
            code,
            {**common, "RYUSEN_RESULT_URL": self.result_url.url},
            settings.dispatch_timeout,
            "dispatch",
            memory_mb=settings.dispatch_memory_mb,
        )
        self.dispatch_function.add_event_source(
            event_sources.SqsEventSource(
                self.queue,
                batch_size=1,
                report_batch_item_failures=True,
                max_concurrency=settings.dispatch_concurrency,
            )
        )
        for app_id, queue in self.app_queues.items():
            self.dispatch_function.add_event_source(
                event_sources.SqsEventSource(
                    queue,
                    batch_size=1,
                    report_batch_item_failures=True,
                    max_concurrency=settings.app_dispatch_concurrency[app_id],
                )
            )
        for function in (self.api_function, self.dispatch_function, self.result_function):
            self._grant_runtime(function)
            function.add_to_role_policy(
                iam.PolicyStatement(
                    sid="SigningKey", actions=["secretsmanager:GetSecretValue"], resources=[self.master_key.secret_arn]
                )
            )
        self.dispatch_function.add_to_role_policy(
            iam.PolicyStatement(
                actions=["sqs:ChangeMessageVisibility"],
                resources=[self.queue.queue_arn, *(q.queue_arn for q in self.app_queues.values())],
            )
        )

        self.sweep_function = self._function(
            "SweepFunction",
            "ryusen_server.lambdas.sweep.handler",
            code,
            {k: v for k, v in common.items() if k != "RYUSEN_MASTER_KEY_SECRET_ARN"},
            cdk.Duration.minutes(5),
            "sweep",
        )
        # The sweeper signs and verifies nothing (it reads runs, sends messages and schedules): it neither reads
        # nor names the master key (its engine holds none and calls no endpoint; tests/infra proves its calls).
        self._grant_runtime(self.sweep_function)
        events.Rule(
            self,
            "SweepSchedule",
            description="Ryusen's sweeper: repairs runs whose work is overdue with nothing on its way",
            schedule=events.Schedule.rate(cdk.Duration.minutes(1)),
            targets=[events_targets.LambdaFunction(self.sweep_function, retry_attempts=0)],
        )

        self.alarm_topic = self._alarm_topic(settings)
        self.alarms = self._alarms(settings)
        self.dashboard = self._dashboard()

    # ---- pieces -------------------------------------------------------------------------------

    def allow_lambda_endpoint(self, function: aws_lambda.IFunction) -> None:
        """Let the engine send ``function``'s attempts as asynchronous events (way C of docs/design/dispatch.md):
        the dispatch and result functions may invoke it, and nothing else. Without this grant, Lambda refuses the
        event and the engine sends each attempt to the app's URL and waits for it.

        The app must also refuse a copy of an event Lambda delivers twice: its SDK announces ``lambda_event`` only
        with a replay table its containers share (``RYUSEN_REPLAY_TABLE``). Set the function's
        ``retry_attempts`` to 0 as well: a retry is refused there anyway, but need not be sent. The grant is for the
        unqualified function, which its Function URL invokes; an app served from an alias announces the alias's
        ARN, which needs a grant of its own."""
        for engine_function in (self.dispatch_function, self.result_function):
            # the function as its Function URL invokes it (unqualified): no version or alias wildcard
            engine_function.add_to_role_policy(
                iam.PolicyStatement(actions=["lambda:InvokeFunction"], resources=[function.function_arn])
            )

    def _access_logs(self, settings: RyusenSettings) -> dict[str, Any]:
        """The stage's access-log options: none unless asked (they need the account's API Gateway logs role)."""
        if not settings.api_access_logs:
            return {}
        return {
            "access_log_destination": apigateway.LogGroupLogDestination(
                logs.LogGroup(self, "ApiAccessLogs", retention=settings.log_retention)
            ),
            "access_log_format": apigateway.AccessLogFormat.json_with_standard_fields(
                caller=True,
                http_method=True,
                ip=True,
                protocol=True,
                request_time=True,
                resource_path=True,
                response_length=True,
                status=True,
                user=True,
            ),
        }

    def _api_account_logs_role(self) -> apigateway.CfnAccount:
        """The account-wide role API Gateway writes logs with, set as the account's (opt-in). The role is kept
        when the stack is deleted: the account setting still names it, and other APIs may log through it."""
        self.api_logs_role = iam.Role(
            self,
            "ApiGatewayLogsRole",
            description="API Gateway writes the account's API logs to CloudWatch Logs (set by Ryusen's stack)",
            assumed_by=iam.ServicePrincipal("apigateway.amazonaws.com"),
            managed_policies=[
                iam.ManagedPolicy.from_aws_managed_policy_name("service-role/AmazonAPIGatewayPushToCloudWatchLogs")
            ],
        )
        self.api_logs_role.apply_removal_policy(cdk.RemovalPolicy.RETAIN)
        account = apigateway.CfnAccount(self, "ApiGatewayAccount", cloud_watch_role_arn=self.api_logs_role.role_arn)
        account.node.add_dependency(self.api_logs_role)
        return account

    def _function(
        self,
        construct_id: str,
        handler: str,
        code: aws_lambda.Code,
        environment: dict[str, str],
        timeout: cdk.Duration,
        service: str,
        *,
        memory_mb: int = 512,
    ) -> aws_lambda.Function:
        log_group = logs.LogGroup(self, f"{construct_id}Logs", retention=self.settings.log_retention)
        return aws_lambda.Function(
            self,
            construct_id,
            runtime=RUNTIME,
            architecture=ARCHITECTURE,
            role=function_role(self, f"{construct_id}Role", log_group),
            handler=handler,
            code=code,
            timeout=timeout,
            memory_size=memory_mb,
            environment={**environment, "POWERTOOLS_SERVICE_NAME": f"ryusen-{service}"},
            log_group=log_group,
            # Every step is an invocation or two: Lambda's START, END and REPORT lines (about 250 bytes) would be
            # CloudWatch Logs bytes per step. At system level WARN Lambda keeps only a failed or timed-out
            # invocation's report; its metrics (Invocations, Duration, Errors) still count every invocation.
            logging_format=aws_lambda.LoggingFormat.JSON,
            system_log_level_v2=aws_lambda.SystemLogLevel.WARN,
            application_log_level_v2=aws_lambda.ApplicationLogLevel.INFO,
        )

    def _grant_runtime(self, function: aws_lambda.Function) -> None:
        """What the engine calls, on exactly these resources (tests/infra/test_iam.py keeps the list)."""
        index_arns = f"{self.table.table_arn}/index/*"
        statements = [
            iam.PolicyStatement(
                sid="RunStore",
                actions=[
                    "dynamodb:GetItem",
                    "dynamodb:PutItem",
                    "dynamodb:UpdateItem",  # a run's head item (what a list shows), when that changes
                    "dynamodb:Query",
                    "dynamodb:BatchGetItem",
                    "dynamodb:BatchWriteItem",  # a transaction (a run with its idempotency key) needs PutItem only
                ],
                resources=[self.table.table_arn, index_arns],
            ),
            iam.PolicyStatement(
                sid="Dispatch",
                actions=["sqs:SendMessage"],
                resources=[self.queue.queue_arn, *(q.queue_arn for q in self.app_queues.values())],
            ),
            iam.PolicyStatement(
                sid="Timers",
                actions=["scheduler:CreateSchedule", "scheduler:DeleteSchedule"],
                resources=[
                    cdk.Stack.of(self).format_arn(
                        service="scheduler",
                        resource="schedule",
                        resource_name=f"{self.schedule_group.ref}/*",
                        arn_format=cdk.ArnFormat.SLASH_RESOURCE_NAME,
                    )
                ],
            ),
            iam.PolicyStatement(
                sid="PassSchedulerRole",
                actions=["iam:PassRole"],
                resources=[self.scheduler_role.role_arn],
                conditions={"StringEquals": {"iam:PassedToService": "scheduler.amazonaws.com"}},
            ),
        ]
        for statement in statements:
            function.add_to_role_policy(statement)

    def _alarms(self, settings: RyusenSettings) -> list[cloudwatch.Alarm]:
        period = cdk.Duration.minutes(5)

        def ryusen_metric(name: str, statistic: str, metric_period: cdk.Duration = period) -> cloudwatch.Metric:
            return cloudwatch.Metric(
                namespace="Ryusen",
                metric_name=name,
                dimensions_map={"service": "dispatch"},
                period=metric_period,
                statistic=statistic,
            )

        def alarm(
            construct_id: str, description: str, metric: cloudwatch.IMetric, threshold: float = 0
        ) -> cloudwatch.Alarm:
            return cloudwatch.Alarm(
                self,
                construct_id,
                alarm_description=description,
                metric=metric,
                threshold=threshold,
                comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD,
                evaluation_periods=1,
                treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
            )

        def throttles(*functions: aws_lambda.Function) -> cloudwatch.IMetric:
            metrics = {f"t{i}": f.metric_throttles(period=period, statistic="Sum") for i, f in enumerate(functions)}
            return cloudwatch.MathExpression(expression=" + ".join(metrics), using_metrics=metrics, period=period)

        alarms = [
            alarm(
                "DeadLetterQueueNotEmpty",
                "Dispatch messages failed 10 times and were set aside: see docs/deploy.md",
                self.dead_letter_queue.metric_approximate_number_of_messages_visible(period=period),
            ),
            alarm(
                "SchedulerDeadLetterQueueNotEmpty",
                "EventBridge Scheduler could not deliver a deadline, probe or delayed task",
                self.scheduler_dead_letter_queue.metric_approximate_number_of_messages_visible(period=period),
            ),
            alarm(
                "ApiServerErrors",
                "The server API answered 5xx",
                self.api.metric_server_error(period=period, statistic="Sum"),
            ),
            alarm(
                "DispatchErrors",
                "Dispatch records failed (they are retried, then set aside in the DLQ)",
                ryusen_metric("DispatchErrors", "Sum"),
            ),
            alarm(
                "DispatchFunctionErrors",
                "The dispatch function itself failed (timeouts, crashes)",
                self.dispatch_function.metric_errors(period=period, statistic="Sum"),
            ),
            alarm(
                "RunsBlockedForLong",
                "A run has waited on a blocker (an Unknown outcome, a definition conflict) for long:"
                " `ryusen runs` and `ryusen show RUN` say why and what to do",
                ryusen_metric("BlockedRunAge", "Maximum", cdk.Duration.hours(1)),
                threshold=settings.blocked_alarm_after.to_seconds(),
            ),
            alarm(
                "TableThrottles",
                "DynamoDB throttled the engine's requests (a hot key, a new table's warm-up, the table's quota):"
                " see docs/deploy.md",
                self.table.metric_throttled_requests_for_operations(
                    operations=[
                        dynamodb.Operation.GET_ITEM,
                        dynamodb.Operation.PUT_ITEM,
                        dynamodb.Operation.UPDATE_ITEM,
                        dynamodb.Operation.QUERY,
                        dynamodb.Operation.BATCH_GET_ITEM,
                        dynamodb.Operation.BATCH_WRITE_ITEM,
                        dynamodb.Operation.TRANSACT_WRITE_ITEMS,
                    ],
                    period=period,
                ),
            ),
            alarm(
                "FunctionThrottles",
                "Lambda throttled the engine's functions: the account's concurrency is used up (docs/deploy.md,"
                " Concurrency)",
                throttles(self.api_function, self.dispatch_function, self.result_function, self.sweep_function),
            ),
            alarm(
                "DispatchQueueBehind",
                "The dispatch queue's oldest message waits longer than the longest lease: the dispatchers do not"
                " keep up (too few, or throttled)",
                self.queue.metric_approximate_age_of_oldest_message(period=period, statistic="Maximum"),
                threshold=settings.queue_age_threshold.to_seconds(),
            ),
        ]
        for app_id, queue in self.app_queues.items():
            alarms.append(
                alarm(
                    f"AppQueueBehind{queue.node.id.removeprefix('AppQueue')}",
                    f"App {app_id[:200]!r}'s dispatch queue's oldest message waits longer than the longest lease: its"
                    " dispatchers (app_dispatch_concurrency) do not keep up",
                    queue.metric_approximate_age_of_oldest_message(period=period, statistic="Maximum"),
                    threshold=settings.queue_age_threshold.to_seconds(),
                )
            )
        for each in alarms:
            self.notify(each)
        return alarms

    def notify(self, alarm: cloudwatch.Alarm) -> None:
        """Send ``alarm`` to the alarm topic, if there is one (an app's construct may add its own alarms)."""
        if self.alarm_topic is not None:
            alarm.add_alarm_action(cloudwatch_actions.SnsAction(self.alarm_topic))

    def _alarm_topic(self, settings: RyusenSettings) -> sns.ITopic | None:
        topic = settings.alarm_topic
        if topic is None and settings.alarm_topic_arn is not None:
            topic = sns.Topic.from_topic_arn(self, "AlarmTopicImported", settings.alarm_topic_arn)
        if topic is None and settings.alarm_email is not None:
            topic = sns.Topic(self, "AlarmTopic", display_name="Ryusen alarms", enforce_ssl=True)
        if settings.alarm_email is not None:
            assert topic is not None
            topic.add_subscription(subscriptions.EmailSubscription(settings.alarm_email))
        return topic

    def _alarm(self, construct_id: str) -> cloudwatch.Alarm:
        [found] = [a for a in self.alarms if a.node.id == construct_id]
        return found

    def _dashboard(self) -> cloudwatch.Dashboard:
        dashboard = cloudwatch.Dashboard(self, "Dashboard")
        dashboard.add_widgets(
            cloudwatch.GraphWidget(
                title="Dispatch queue",
                left=[
                    self.queue.metric_approximate_number_of_messages_visible(),
                    self.queue.metric_approximate_age_of_oldest_message(),
                ],
                right=[self.dead_letter_queue.metric_approximate_number_of_messages_visible()],
            ),
            cloudwatch.GraphWidget(
                title="Dispatch function",
                left=[self.dispatch_function.metric_invocations(), self.dispatch_function.metric_errors()],
                right=[self.dispatch_function.metric_duration(statistic="p99")],
            ),
            cloudwatch.GraphWidget(
                title="API",
                left=[self.api.metric_count(), self.api.metric_client_error(), self.api.metric_server_error()],
                right=[self.api.metric_latency(statistic="p99")],
            ),
            cloudwatch.GraphWidget(
                title="Runs blocked (seconds, max)",
                left=[self._alarm("RunsBlockedForLong").metric],
            ),
            cloudwatch.GraphWidget(
                title="Throttled (DynamoDB requests, Lambda invocations)",
                left=[self._alarm("TableThrottles").metric, self._alarm("FunctionThrottles").metric],
            ),
        )
        if self.app_queues:
            dashboard.add_widgets(
                cloudwatch.GraphWidget(
                    title="Apps' own dispatch queues (oldest message, seconds)",
                    left=[
                        q.metric_approximate_age_of_oldest_message(label=app_id[:40])
                        for app_id, q in self.app_queues.items()
                    ],
                )
            )
        return dashboard

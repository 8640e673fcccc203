"""The stack in a box: the synthesized template's resources created in moto, its functions run in-process.

``Box`` reads the template, creates each resource the runtime touches (table with its indexes, queues
with their redrive policies, schedule group, secret; roles as ARNs), resolves each function's
environment from the template's intrinsics, and runs the handlers as AWS would call them:

* the API function behind a loopback "API Gateway" whose routes and authorization come from the
  template's ``AWS::ApiGateway::Resource``/``Method`` items (IAM routes want a SigV4 header);
* the dispatch function fed by an "event source" with the template's batch size and response types
  (without ``ReportBatchItemFailures`` every record of a successful invocation is deleted, as on AWS);
* EventBridge Scheduler: due schedules are delivered to their target, after checking the target, role
  and dead-letter queue are the template's;
* the example app's function behind a loopback "Function URL".

Every AWS call a function makes is recorded (service, operation, parameters) for tests/infra/test_iam.py.
Any disagreement between the template and the code (a name, an index, a variable, a route) fails here.
"""

from __future__ import annotations

import base64
import contextvars
import importlib.util
import json
import secrets
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import boto3
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

from tests.lambda_http import ApiGateway, LambdaContext

REGION, ACCOUNT = "us-east-1", "123456789012"
API_ID, STAGE_HOST = "boxapi", "boxapi.execute-api.us-east-1.amazonaws.com"
REPO = Path(__file__).resolve().parents[2]

caller: contextvars.ContextVar[str] = contextvars.ContextVar("caller", default="test")


@dataclass
class Call:
    function: str
    service: str
    operation: str
    params: dict[str, Any]


@dataclass
class Box:
    template: dict[str, Any]
    calls: list[Call] = field(default_factory=list)
    refs: dict[str, str] = field(default_factory=dict)
    arns: dict[str, str] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    """A Lambda Function URL resource's logical id -> the loopback URL serving its function."""
    servers: list[Any] = field(default_factory=list)
    event_handlers: dict[str, tuple[Callable[[dict[str, Any], Any], dict[str, Any]], str]] = field(default_factory=dict)
    """A Lambda function's ARN -> (its handler, the caller it runs as): what an asynchronous ``Invoke`` runs."""
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    """Every asynchronous event the box's Lambda queued: (the function's ARN, the event)."""

    # ---- resources -------------------------------------------------------------------------

    def resources(self, kind: str) -> dict[str, dict[str, Any]]:
        return {name: r for name, r in self.template["Resources"].items() if r["Type"] == kind}

    def create(self) -> None:
        """Create what the runtime needs, in dependency order (dead-letter queues before their queues)."""
        for name in self.resources("AWS::IAM::Role"):
            self.refs[name] = f"box-{name}"
            self.arns[name] = f"arn:aws:iam::{ACCOUNT}:role/box-{name}"
        for name in self.resources("AWS::SecretsManager::Secret"):
            client = boto3.client("secretsmanager", region_name=REGION)
            arn = client.create_secret(Name=f"box/{name}", SecretString=uuid.uuid4().hex * 2)["ARN"]
            self.refs[name] = self.arns[name] = arn
        for name, table in self.resources("AWS::DynamoDB::Table").items():
            self._table(name, table["Properties"])
        queues = self.resources("AWS::SQS::Queue")
        for name in sorted(queues, key=lambda n: "RedrivePolicy" in queues[n]["Properties"]):
            self._queue(name, queues[name]["Properties"])
        for name in self.resources("AWS::Scheduler::ScheduleGroup"):
            group = f"box-{name}"[:64]
            boto3.client("scheduler", region_name=REGION).create_schedule_group(Name=group)
            self.refs[name] = group
        for name in self.resources("AWS::ApiGateway::RestApi"):
            self.refs[name] = API_ID
        for name, stage in self.resources("AWS::ApiGateway::Stage").items():
            self.refs[name] = stage["Properties"]["StageName"]
        for name in self.resources("AWS::Logs::LogGroup"):
            self.refs[name] = f"box-{name}"
            self.arns[name] = f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:box-{name}:*"
        for name in self.resources("AWS::Lambda::Function"):
            self.refs[name] = f"box-{name}"
            self.arns[name] = f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:box-{name}"

    def _table(self, name: str, props: dict[str, Any]) -> None:
        client = boto3.client("dynamodb", region_name=REGION)
        table = f"box-{name}"
        request: dict[str, Any] = {
            "TableName": table,
            "KeySchema": props["KeySchema"],
            "AttributeDefinitions": props["AttributeDefinitions"],
            "BillingMode": props["BillingMode"],
        }
        if "GlobalSecondaryIndexes" in props:
            request["GlobalSecondaryIndexes"] = props["GlobalSecondaryIndexes"]
        client.create_table(**request)
        self.refs[name] = table
        self.arns[name] = f"arn:aws:dynamodb:{REGION}:{ACCOUNT}:table/{table}"

    def _queue(self, name: str, props: dict[str, Any]) -> None:
        sqs = boto3.client("sqs", region_name=REGION)
        attributes = {
            key: str(props[source])
            for key, source in (
                ("VisibilityTimeout", "VisibilityTimeout"),
                ("MessageRetentionPeriod", "MessageRetentionPeriod"),
            )
            if source in props
        }
        if "RedrivePolicy" in props:
            policy = props["RedrivePolicy"]
            attributes["RedrivePolicy"] = json.dumps(
                {
                    "deadLetterTargetArn": self.resolve(policy["deadLetterTargetArn"]),
                    "maxReceiveCount": policy["maxReceiveCount"],
                }
            )
        url = sqs.create_queue(QueueName=props.get("QueueName") or f"box-{name}"[:80], Attributes=attributes)[
            "QueueUrl"
        ]
        self.refs[name] = url
        self.arns[name] = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]

    def resolve(self, value: Any) -> Any:
        """A template value with its intrinsics resolved to the box's resources."""
        if isinstance(value, str | int | float):
            return value
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        if "Ref" in value:
            ref = value["Ref"]
            pseudo = {
                "AWS::Region": REGION,
                "AWS::AccountId": ACCOUNT,
                "AWS::URLSuffix": "amazonaws.com",
                "AWS::Partition": "aws",
            }
            if ref in pseudo:
                return pseudo[ref]
            if ref not in self.refs:
                raise KeyError(f"the box has no resource {ref!r} (type {self.template['Resources'][ref]['Type']})")
            return self.refs[ref]
        if "Fn::GetAtt" in value:
            name, attribute = value["Fn::GetAtt"]
            if attribute == "Arn":
                return self.arns[name]
            if attribute == "FunctionUrl" and name in self.urls:
                return self.urls[name]
            raise KeyError(f"Fn::GetAtt {name}.{attribute}")
        if "Fn::Join" in value:
            separator, parts = value["Fn::Join"]
            return separator.join(str(self.resolve(p)) for p in parts)
        raise KeyError(f"unsupported intrinsic {value!r}")

    def run_custom_resources(self) -> None:
        """CloudFormation's Create of each custom resource: its function (a module of infra/ryusen_infra) is
        called with the event CloudFormation sends, and must answer SUCCESS at the response URL."""
        answers: list[dict[str, Any]] = []

        def wsgi(environ: dict[str, Any], start_response: Any) -> Any:
            answers.append(json.loads(Request(environ).get_data()))
            return Response("")(environ, start_response)

        server = make_server("127.0.0.1", 0, wsgi)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            for name, resource in self.template["Resources"].items():
                if not resource["Type"].startswith("Custom::"):
                    continue
                properties = {k: self.resolve(v) for k, v in resource["Properties"].items()}
                function = self.template["Resources"][resource["Properties"]["ServiceToken"]["Fn::GetAtt"][0]]
                module_name, handler = function["Properties"]["Handler"].split(".")
                path = REPO / "infra" / "ryusen_infra" / f"{module_name}.py"
                spec = importlib.util.spec_from_file_location(f"box_{module_name}", path)
                assert spec is not None and spec.loader is not None
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                event = {
                    "RequestType": "Create",
                    "ResponseURL": f"http://127.0.0.1:{server.server_port}/",
                    "StackId": f"arn:aws:cloudformation:{REGION}:{ACCOUNT}:stack/box/1",
                    "RequestId": uuid.uuid4().hex,
                    "LogicalResourceId": name,
                    "ResourceType": resource["Type"],
                    "ResourceProperties": properties,
                }
                token = caller.set(module_name)
                try:
                    getattr(module, handler)(event, LambdaContext())
                finally:
                    caller.reset(token)
                answer = answers.pop()
                assert answer["Status"] == "SUCCESS", answer
        finally:
            server.shutdown()

    # ---- functions ---------------------------------------------------------------------------

    def function(self, handler: str) -> dict[str, Any]:
        [found] = [f for f in self.resources("AWS::Lambda::Function").values() if f["Properties"]["Handler"] == handler]
        return found

    def environment(self, handler: str, api_url: str) -> dict[str, str]:
        """The function's environment, as the template gives it; the API's URL points at the loopback stage."""
        variables = self.function(handler)["Properties"]["Environment"]["Variables"]
        env = {k: str(self.resolve(v)) for k, v in variables.items()}
        stage = self.resolve({"Ref": next(iter(self.resources("AWS::ApiGateway::Stage")))})
        public = f"https://{STAGE_HOST}/{stage}"
        return {k: v.replace(public, api_url) for k, v in env.items()}

    def routes(self) -> dict[tuple[str, str], str]:
        """(path, method) -> authorization type, from the template's API resources and methods."""
        resources = self.resources("AWS::ApiGateway::Resource")

        def path(ref: dict[str, Any]) -> str:
            parts: list[str] = []
            while "Ref" in ref and ref["Ref"] in resources:
                props = resources[ref["Ref"]]["Properties"]
                parts.insert(0, props["PathPart"])
                ref = props["ParentId"]
            return "/" + "/".join(parts)

        return {
            (path(m["Properties"]["ResourceId"]), m["Properties"]["HttpMethod"]): m["Properties"]["AuthorizationType"]
            for m in self.resources("AWS::ApiGateway::Method").values()
        }

    def authorize(self, method: str, path: str, headers: dict[str, str]) -> int | None:
        """API Gateway's answer before the function: 403 for an unknown route or a missing SigV4 signature."""
        routes = self.routes()
        auth = routes.get((path, method))
        if auth is None:
            prefix = "/".join(path.split("/")[:2])
            auth = routes.get((f"{prefix}/{{proxy+}}", "ANY"))
        if auth is None:
            return 403
        if auth == "AWS_IAM" and not headers.get("Authorization", "").startswith("AWS4-HMAC-SHA256"):
            return 403
        return None

    def record(self, function: str) -> Callable[..., None]:
        def before_parameter_build(params: dict[str, Any], model: Any, **_: Any) -> None:
            self.calls.append(Call(function, model.service_model.service_name, model.name, dict(params)))

        return before_parameter_build

    # ---- serving -----------------------------------------------------------------------------

    def serve_function_url(
        self, handler_name: str, handler: Callable[[dict[str, Any], Any], dict[str, Any]], who: str
    ) -> str:
        """Serve the template's Function URL of the function whose handler is ``handler_name`` with ``handler``
        (as the caller ``who``), on loopback; ``Fn::GetAtt <url>.FunctionUrl`` resolves to it from then on."""
        target = next(
            name
            for name, f in self.resources("AWS::Lambda::Function").items()
            if f["Properties"]["Handler"] == handler_name
        )
        [url_id] = [
            name
            for name, u in self.resources("AWS::Lambda::Url").items()
            if u["Properties"]["TargetFunctionArn"] == {"Fn::GetAtt": [target, "Arn"]}
        ]
        self.urls[url_id] = self.function_url(handler, who=who)
        return self.urls[url_id]

    def function_arn(self, handler_name: str) -> str:
        """The ARN of the template's function whose handler is ``handler_name``."""
        [name] = [
            n for n, f in self.resources("AWS::Lambda::Function").items() if f["Properties"]["Handler"] == handler_name
        ]
        return self.arns[name]

    def invoke_event(self, params: dict[str, Any], **_: Any) -> tuple[Any, dict[str, Any]] | None:
        """Lambda's ``Invoke`` with ``InvocationType=Event`` (a ``before-call`` hook: moto would need Docker to run
        a function): the event is queued, which here means its handler starts on a thread of its own, as the
        caller it was registered with, and 202 is answered at once. A function the box serves no events for is
        Lambda's ResourceNotFoundException. A synchronous ``Invoke`` is not something the engine makes."""
        from urllib.parse import unquote

        headers = params.get("headers") or {}
        assert headers.get("X-Amz-Invocation-Type") == "Event", "the box's Lambda runs asynchronous events only"
        arn = unquote(params["url_path"].split("/functions/", 1)[1].split("/invocations", 1)[0])
        served = self.event_handlers.get(arn)
        if served is None:
            body = {"Type": "User", "message": f"Function not found: {arn}"}
            http = SimpleNamespace(status_code=404, headers={}, content=b"")
            error = {"Error": {"Code": "ResourceNotFoundException", "Message": body["message"]}}
            return http, {**error, "ResponseMetadata": {"HTTPStatusCode": 404}}
        handler, who = served
        event = json.loads(params["body"])
        self.events.append((arn, event))

        def run() -> None:
            token = caller.set(who)
            try:
                context = LambdaContext()
                context.invoked_function_arn = arn
                handler(event, context)
            finally:
                caller.reset(token)

        threading.Thread(target=run, daemon=True).start()
        http = SimpleNamespace(status_code=202, headers={}, content=b"")
        return http, {"StatusCode": 202, "ResponseMetadata": {"HTTPStatusCode": 202}}

    def function_url(
        self,
        handler: Callable[[dict[str, Any], Any], dict[str, Any]],
        *,
        who: str = "shop",
        arn: str | None = None,
    ) -> str:
        """A loopback Lambda Function URL (payload 2.0 events) for ``handler``, called as ``who`` (as the function
        ``arn``, when given: what its context names)."""

        def wsgi(environ: dict[str, Any], start_response: Any) -> Any:
            request = Request(environ)
            body = request.get_data()
            event = {
                "version": "2.0",
                "rawPath": request.path,
                "headers": {k.lower(): v for k, v in request.headers.items()},
                "requestContext": {
                    "http": {"method": request.method, "path": request.path},
                    "domainName": request.host,
                    "requestId": secrets.token_hex(8),
                },
                "body": base64.b64encode(body).decode(),
                "isBase64Encoded": True,
            }
            token = caller.set(who)
            context = LambdaContext()
            if arn is not None:
                context.invoked_function_arn = arn
            try:
                result = handler(event, context)
            finally:
                caller.reset(token)
            return Response(result["body"], status=result["statusCode"], headers=result.get("headers"))(
                environ, start_response
            )

        server = make_server("127.0.0.1", 0, wsgi, threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.servers.append(server)
        return f"http://127.0.0.1:{server.server_port}/"

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()


def sigv4_headers(method: str, url: str, body: bytes) -> dict[str, str]:
    """What an operator's client adds (the CLI signs the same way)."""
    request = AWSRequest(method=method, url=url, data=body, headers={"content-type": "application/json"})
    SigV4Auth(Credentials("AKIDBOX", "box-secret"), "execute-api", REGION).add_auth(request)
    return dict(request.headers.items())


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("box_shop", REPO / "examples" / "shop.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def due_schedules(group: str) -> Iterator[dict[str, Any]]:
    client = boto3.client("scheduler", region_name=REGION)
    now = datetime.now(UTC)
    for listed in client.list_schedules(GroupName=group).get("Schedules", []):
        try:
            schedule = client.get_schedule(Name=listed["Name"], GroupName=group)
        except client.exceptions.ResourceNotFoundException:
            continue  # deleted since it was listed (its run finished first)
        moment = datetime.fromisoformat(schedule["ScheduleExpression"][3:-1]).replace(tzinfo=UTC)
        if moment <= now:
            yield schedule


__all__ = ["ApiGateway", "Box", "Call", "caller", "due_schedules", "load_example", "sigv4_headers"]

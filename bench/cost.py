"""What Ryusen bills on AWS per million steps, by step duration, counted from outside the stack in a box.

    PYTHONPATH=sdk:handlers:infra .venv/bin/python bench/cost.py            # 20-step runs, every endpoint kind
    PYTHONPATH=sdk:handlers:infra .venv/bin/python bench/cost.py --quick    # 6-step runs
    PYTHONPATH=sdk:handlers:infra .venv/bin/python bench/cost.py --kinds http --durations 1,600
    PYTHONPATH=sdk:handlers:infra .venv/bin/python bench/cost.py --kinds event --durations 1 --split 100
                                                           # a run's own cost apart from its steps
**What runs.** The stack in a box (tests/infra/box.py, with the fixture of tests/infra/test_stack_in_a_box.py)
creates the synthesized CDK template's resources in moto. It runs the real handlers (API, dispatch, sweep,
and any other ``ryusen_server.lambdas`` function the template has) with the template's environment, and the
default retention (30 days) is on. A workflow of N steps runs there, one run at a time. Each step's callback
takes a duration D, for D = 0.1 s, 1 s, 10 s and 10 minutes. Two kinds of user endpoint serve it:

* ``http``: the app served over WSGI on loopback, as ``ryusen dev`` or any long-lived server does. Its SDK
  acknowledges an attempt that runs past ``acknowledge_after_s``: it answers ``accepted`` and posts the
  outcome to the result URL later.
* ``lambda``: the app's ``lambda_handler`` behind a loopback Function URL, with a replay memory of its own
  container's. On Lambda the SDK answers inline (Lambda freezes the process once it answers), so the
  dispatcher waits for the whole callback.
* ``event``: the same Lambda app, whose containers share a replay table (as examples/shop.py's do), so it
  announces ``lambda_event``: each attempt is sent to the function as an asynchronous event (``Invoke`` with
  ``InvocationType=Event``, which the box answers 202 and runs on a thread of its own: moto needs Docker to run a
  function), and the handler posts the outcome to the result function before it returns. The ``Invoke`` request
  bills the user's function, not Ryusen; the replay table's writes are the user's too.

**Simulated time.** A step's cost to Ryusen depends on D in only two ways. The first is which path the
attempt takes. If the callback ends within ``acknowledge_after_s`` (0.1 s), it is answered inline and the
dispatcher pays for D. Otherwise it is acknowledged, the dispatcher pays for those 0.1 s, and the outcome
comes back by the result path. The second is what happens while the callback runs: the lease timer (the
dispatch message comes back at the step's timeout plus the grace), heartbeats (not used here) and the
sweeper. So the callback sleeps D itself when D <= ``--real-up-to`` (1 s). A longer D is run on a
compressed clock: the callback sleeps 1 s. A step declares a timeout 2 s past what it sleeps. That is beyond
the SDK's late margin (1 s): a callback that ends closer to its timeout posts its outcome a second time. The
events on the engine's side happen in the same order as at D: the
``accepted`` answer at 0.1 s, the posted outcome, then the lease's end. What watches a lease is judged at D
too: a step of D whose lease (its timeout and the 60 s grace of an event) and duration would have it watched by
a Scheduler schedule (``scheduled_lease_from_s``, ``scheduled_lease_share``) is watched by one on the compressed
clock, and one that would not be is not. Every handler invocation is billed
its own measured wall time. The one exception is a callback sleep that falls entirely within a dispatch
invocation, which means the dispatcher waited for it (an inline answer). That sleep is billed at D instead of
the time actually slept. The bench checks this: on the ``http`` endpoint every compressed attempt must have
been answered ``accepted``. The endpoint's own compute, and its own AWS calls, are the user's and are not
counted. Wall times here are moto's in-process times on a shared machine, not DynamoDB's network round
trips. Cold starts (init) are not counted: the box's functions are warm. Each endpoint kind first runs its
workflow once, uncounted, as a warm-up.

**What is counted** (tests/infra/meter.py; prices in its ``PRICES``):

* DynamoDB write and read request units, from the sizes of the items written and read (the table's and each
  global index's).
* Storage for the retention (30 days by default; the bench prints what 90 would add): the bytes a run leaves
  in the table and its indexes (with 100 bytes of overhead per item), at $0.25 per GB-month, plus
  point-in-time recovery ($0.20 per GB-month of table data; it is on in the template).
* SQS requests in 64 KB chunks. That includes the event source's receives that return messages and its
  deletes (AWS bills the event source's polling); its empty long polls are a fixed cost, printed apart.
* Scheduler invocations.
* Lambda requests, and GB-seconds per function at the template's memory and the arm64 price.
* API Gateway REST requests: starting a run, and results posted to ``/v1/results``.
* CloudWatch Logs: the bytes each function writes, plus its START, END and REPORT lines at the template's
  system log level (WARN: only a failed invocation's).
* Secrets Manager reads, counted per step but priced per container (printed apart, like the sweeper): a
  container reads the key at its start and checks it again on a timer, whatever its steps.
* Data sent to the user's endpoint, priced as internet egress (at worst) for an endpoint served over HTTP. An app on
  Lambda in the engine's region is sent its attempts free: Lambda bills data transfer only from outside the
  function's region.

The sweeper (every minute, whatever the load) and the event source's idle polling are per deployment, not
per step. They are printed as a monthly figure. The peers are priced as published: Step Functions Standard
at $25 per million state transitions, counting one per step. Lambda durable functions bill about $8 per
million durable operations plus the data written (a secondary source: shared/facts/aws.md). Both leave out
the user's compute, as Ryusen's figure does.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.infra

from tests.infra.box import REGION, caller
from tests.infra.meter import PRICES, LogTap, Meter, TableSchema, Usage

DURATIONS_S = (0.1, 1.0, 10.0, 600.0)


def _default_retention_days() -> float:
    """How long the stack keeps a finished run by default (``RyusenSettings.retention``)."""
    from ryusen_infra import RyusenSettings

    retention = RyusenSettings().retention
    assert retention is not None
    return float(retention.to_days())


RETENTION_DAYS = _default_retention_days()
DAYS_PER_MONTH = 365.25 / 12
STORAGE_ROW = f"DynamoDB storage, {RETENTION_DAYS:g} days + PITR"
MINUTES_PER_MONTH = 60 * 24 * DAYS_PER_MONTH
PEERS = {
    "Step Functions Standard": (25.00, "$25 per million state transitions, 1 per step"),
    "Lambda durable functions": (8.00, "about $8 per million durable operations + data written (secondary source)"),
}
METER: Meter | None = None
"""The meter the callbacks report their sleeps to (set by :func:`main`)."""


def work(index: int, sleep_s: float, simulated_s: float) -> dict[str, Any]:
    """A step's callback: sleeps ``sleep_s`` standing for ``simulated_s`` of the user's work."""
    started = time.perf_counter()
    time.sleep(sleep_s)
    if METER is not None:
        METER.endpoint_sleep(started, time.perf_counter(), simulated_s)
    return {"i": index}


def make_app(app_id: str, function_id: str, key: str, *, shared_replay: bool = False) -> Any:
    """The bench's app. ``shared_replay``: its replay memory stands for a table every container shares (the
    replay table's writes are the user's, not counted), which lets it announce ``lambda_event`` on Lambda."""
    from ryusen import Ryusen, Step
    from ryusen._internal.signing import SeenRequests

    class SharedSeenRequests(SeenRequests):
        shared = True

    app = Ryusen(app_id, signing_key=key, seen_requests=SharedSeenRequests() if shared_replay else SeenRequests())

    @app.function(function_id)
    def steps(data: dict[str, Any], step: Step) -> dict[str, Any]:
        timeout = timedelta(seconds=data["timeout_s"])
        for i in range(data["steps"]):
            step.run(f"step-{i}", work, i, data["sleep_s"], data["simulated_s"], timeout=timeout)
        return {"steps": data["steps"]}

    return app


@dataclass
class Endpoint:
    kind: str
    function_id: str
    answers: Counter[int] = field(default_factory=Counter)
    """HTTP statuses the endpoint answered attempts with (202: accepted)."""
    received_bytes: int = 0

    def seen(self, status: int, size: int) -> None:
        self.answers[status] += 1
        self.received_bytes += size


def serve_http(app: Any, endpoint: Endpoint) -> tuple[str, Any]:
    """The app's WSGI application on loopback, threaded (the SDK acknowledges there)."""
    from werkzeug.serving import make_server

    inner = app.wsgi()

    def wsgi(environ: dict[str, Any], start_response: Any) -> Any:
        token = caller.set("endpoint")
        size = int(environ.get("CONTENT_LENGTH") or 0) + sum(
            len(k) + len(str(v)) + 4 for k, v in environ.items() if k.startswith("HTTP_")
        )
        status: list[int] = []

        def start(line: str, headers: Any, *rest: Any) -> Any:
            status.append(int(line.split()[0]))
            return start_response(line, headers, *rest)

        try:
            body = inner(environ, start)
        finally:
            caller.reset(token)
        if environ["REQUEST_METHOD"] == "POST":
            endpoint.seen(status[0], size)
        return body

    server = make_server("127.0.0.1", 0, wsgi, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}/", server


def lambda_endpoint(app: Any, endpoint: Endpoint) -> Callable[[dict[str, Any], Any], dict[str, Any]]:
    """The app's Lambda handler, for the box's Function URL (it answers inline)."""

    def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
        result: dict[str, Any] = app.lambda_handler(event, context)
        if event["requestContext"]["http"]["method"] == "POST":
            size = len(event.get("body") or "") * 3 // 4 + sum(len(k) + len(v) + 4 for k, v in event["headers"].items())
            endpoint.seen(int(result["statusCode"]), size)
        return result

    return handler


@dataclass
class Scenario:
    kind: str
    duration_s: float
    steps: int
    usage: Usage
    stored: tuple[int, int]
    """(table bytes, index bytes) the run left stored."""
    answers: Counter[int]
    egress_bytes: int
    settled: int
    """Endpoint sleeps billed to a waiting dispatcher at their simulated time."""
    wall_s: float
    left_in_flight: int = 0
    """Dispatch messages still invisible when the bench stopped waiting (their return is not counted)."""
    fast_forwarded: int = 0
    """Kept messages whose visibility timer the bench ran forward after the run ended."""


@dataclass
class Bench:
    deployed: Any
    meter: Meter
    table: str
    queue_url: str
    steps: int
    real_up_to_s: float
    waiting: tuple[str, ...] = ("dispatch", "results")
    """The functions that invoke the user's endpoint, and so may wait for it."""
    fast_forwarded: int = 0
    last_queue: dict[str, str] = field(default_factory=dict)

    def head_phase(self, run_id: str) -> str | None:
        item = self.meter.peek(self.table, {"pk": {"S": f"RUN#{run_id}"}, "sk": {"S": "RUN"}})
        return item["phase"]["S"] if item and "phase" in item else None

    def queue_empty(self) -> bool:
        import boto3

        attributes = boto3.client("sqs", region_name=REGION).get_queue_attributes(
            QueueUrl=self.queue_url,
            AttributeNames=[
                "ApproximateNumberOfMessages",
                "ApproximateNumberOfMessagesNotVisible",
                "ApproximateNumberOfMessagesDelayed",  # lease timers sent with a delay: not yet back
            ],
        )["Attributes"]
        self.last_queue = attributes
        return all(v == "0" for v in attributes.values())

    def settle(self, timeout_s: float) -> bool:
        try:
            wait_until(self.queue_empty, timeout_s, "the queue to empty")
        except TimeoutError:
            return False
        return True

    def fast_forward(self) -> None:
        import boto3

        sqs = boto3.client("sqs", region_name=REGION)
        with self.meter.lock:
            receipts = list(self.meter.usage.receipts)
        self.fast_forwarded = 0
        for queue_url, receipt in receipts:
            try:
                sqs.change_message_visibility(QueueUrl=queue_url, ReceiptHandle=receipt, VisibilityTimeout=0)
            except sqs.exceptions.ClientError:
                continue  # deleted, or received again since
            self.fast_forwarded += 1
        # a message sent with a delay (an acknowledged attempt's lease timer) has no receipt to change yet: its
        # delay is ended in moto's queue instead, which is what its timer running out would do
        from moto.sqs.models import sqs_backends

        for account in sqs_backends.values():
            for backend in account.values():
                for queue in backend.queues.values():
                    for message in queue._messages:
                        if message.delayed:
                            message.delayed_until = 0.0
                            self.fast_forwarded += 1

    def stored(self) -> tuple[int, int]:
        import boto3

        schema = self.meter.schemas[self.table]
        client = boto3.client("dynamodb", region_name=REGION)
        table = index = 0
        for page in client.get_paginator("scan").paginate(TableName=self.table):
            for item in page["Items"]:
                t, i = schema.stored_bytes(item)
                table, index = table + t, index + i
        return table, index

    def lease_watch_as_at(self, duration_s: float) -> None:
        """What watches a lease is judged at the step's true duration and lease, not the compressed ones: a step of
        D seconds (a timeout of D + 2 s, and the 60 s grace of an event) that would be watched by a Scheduler
        schedule at D (``scheduled_lease_from_s``, ``scheduled_lease_share``) is watched by one here too, and one
        that would not be is not, whatever its compressed lease."""
        from dataclasses import replace

        from ryusen_server.engine import SCHEDULED_LEASE_FROM_S, SCHEDULED_LEASE_SHARE
        from ryusen_server.lambdas import results as results_lambda

        engine = results_lambda.engine().engine
        from_s: float | None = SCHEDULED_LEASE_FROM_S
        share = SCHEDULED_LEASE_SHARE
        if duration_s > self.real_up_to_s:
            lease_s = duration_s + 2 + engine.settings.engine.lease_grace_s
            scheduled = lease_s >= SCHEDULED_LEASE_FROM_S and duration_s * SCHEDULED_LEASE_SHARE >= lease_s
            from_s, share = (0.0, math.inf) if scheduled else (None, share)
        engine.settings = replace(engine.settings, scheduled_lease_from_s=from_s, scheduled_lease_share=share)

    def run(self, endpoint: Endpoint, duration_s: float) -> Scenario:
        sleep_s = duration_s if duration_s <= self.real_up_to_s else self.real_up_to_s
        timeout_s = sleep_s + 2  # past the SDK's late margin (1 s), which would post an inline outcome again
        self.lease_watch_as_at(duration_s)
        before = self.stored()
        self.fast_forwarded = 0
        endpoint.answers.clear()
        endpoint.received_bytes = 0
        self.meter.reset()
        started = time.perf_counter()
        data = {"steps": self.steps, "sleep_s": sleep_s, "simulated_s": duration_s, "timeout_s": timeout_s}
        response = self.deployed.api("POST", f"/v1/functions/{endpoint.function_id}/runs", {"input": data})
        assert response.status_code == 201, response.text
        run_id = str(response.json()["id"])
        wait_until(lambda: self.head_phase(run_id) == "finished", 60 + self.steps * (sleep_s + 5), "the run to end")
        wall = time.perf_counter() - started
        # what the run left in flight: lease timers coming back (timeout + the acknowledged grace), deletions
        left = 0
        if not self.settle(timeout_s + 3 + 5):
            # a message kept for longer (a redelivery timer of minutes): its timer is run forward, so that it
            # comes back now and what it costs then is counted with this run
            self.fast_forward()
            if not self.settle(15):
                left = int(self.last_queue["ApproximateNumberOfMessagesNotVisible"]) + int(
                    self.last_queue["ApproximateNumberOfMessagesDelayed"]
                )
        time.sleep(1.5)
        settled = self.meter.settle_endpoint_time(self.waiting)
        usage = self.meter.reset()
        after = self.stored()
        view = self.deployed.run(run_id)
        assert view["outcome"] == "completed", view["summary"]
        return Scenario(
            kind=endpoint.kind,
            duration_s=duration_s,
            steps=self.steps,
            usage=usage,
            stored=(after[0] - before[0], after[1] - before[1]),
            answers=Counter(endpoint.answers),
            # Lambda bills data transfer only to and from outside the function's region (Lambda's pricing page): an
            # app on Lambda in the engine's region costs nothing to send attempts to; a server may be anywhere
            egress_bytes=endpoint.received_bytes if endpoint.kind == "http" else 0,
            settled=settled,
            wall_s=wall,
            left_in_flight=left,
            fast_forwarded=self.fast_forwarded,
        )


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


# ---- pricing -----------------------------------------------------------------------------------------------


def line_items(s: Scenario, memory_mb: dict[str, int]) -> dict[str, float]:
    """Dollars per million steps, by line item."""
    u, per = s.usage, 1_000_000 / s.steps / 1_000_000  # per step, in millions: $/M-units x units/step
    months = RETENTION_DAYS / DAYS_PER_MONTH
    table_gb, index_gb = s.stored[0] / 1024**3, s.stored[1] / 1024**3
    items: dict[str, float] = {
        "DynamoDB writes (table)": sum(u.wru.values()) * PRICES["wru"] * per,
        "DynamoDB writes (indexes)": sum(u.index_wru.values()) * PRICES["wru"] * per,
        "DynamoDB reads": sum(u.rru.values()) * PRICES["rru"] * per,
        STORAGE_ROW: (
            ((table_gb + index_gb) * PRICES["storage_gb_month"] + table_gb * PRICES["pitr_gb_month"])
            * months
            * 1_000_000
            / s.steps
        ),
        "SQS requests": sum(u.sqs.values()) * PRICES["sqs"] * per,
        "Scheduler invocations": u.scheduler_invocations * PRICES["scheduler"] * per,
        "Lambda requests": sum(u.invocations.values()) * PRICES["lambda_request"] * per,
    }
    for function in sorted(memory_mb):
        if u.invocations.get(function) or function in ("dispatch", "api", "results"):
            gb_s = u.billed_ms[function] / 1000 * memory_mb[function] / 1024
            items[f"Lambda GB-s: {function}"] = gb_s * PRICES["lambda_gb_s"] * 1_000_000 / s.steps
    items["API Gateway requests"] = sum(u.api_requests.values()) * PRICES["api_gateway"] * per
    items["CloudWatch Logs"] = sum(u.log_bytes.values()) / 1024**3 * PRICES["logs_gb"] * 1_000_000 / s.steps
    # Secrets Manager is per container, not per step: printed apart (see report)
    items["data out to the endpoint"] = s.egress_bytes / 1024**3 * PRICES["egress_gb"] * 1_000_000 / s.steps
    return items


def label(duration_s: float) -> str:
    return f"{duration_s / 60:g} min" if duration_s >= 60 else f"{duration_s:g} s"


def print_table(kind: str, scenarios: list[Scenario], memory_mb: dict[str, int], note: str) -> None:
    columns = [line_items(s, memory_mb) for s in scenarios]
    names = list(dict.fromkeys(name for c in columns for name in c))
    header = "| $ per million steps | " + " | ".join(label(s.duration_s) for s in scenarios) + " |"
    print(f"\n{kind}: {note}\n")
    print(header)
    print("|---|" + "---:|" * len(scenarios))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{c.get(name, 0.0):.3f}" for c in columns) + " |")
    print("| **Ryusen, total** | " + " | ".join(f"**{sum(c.values()):.2f}**" for c in columns) + " |")
    for peer, (price, _) in PEERS.items():
        mark = "†" if "durable" in peer else ""
        print(f"| {peer}{mark} | " + " | ".join(f"{price:.2f}" for _ in scenarios) + " |")
    print("\nper step (counted):\n")
    print("| per step | " + " | ".join(label(s.duration_s) for s in scenarios) + " |")
    print("|---|" + "---:|" * len(scenarios))
    functions = sorted({f for s in scenarios for f in s.usage.invocations})

    def row(name: str, values: list[float], fmt: str = "{:.2f}") -> None:
        print(f"| {name} | " + " | ".join(fmt.format(v) for v in values) + " |")

    for f in functions:
        row(f"invocations: {f}", [s.usage.invocations[f] / s.steps for s in scenarios])
        row(f"billed ms: {f}", [s.usage.billed_ms[f] / s.steps for s in scenarios], "{:.1f}")
    row(
        "write units (table + indexes)",
        [(sum(s.usage.wru.values()) + sum(s.usage.index_wru.values())) / s.steps for s in scenarios],
    )
    row("read units", [sum(s.usage.rru.values()) / s.steps for s in scenarios])
    row(
        "Secrets Manager reads (per container, not in the total)",
        [sum(s.usage.secrets.values()) / s.steps for s in scenarios],
    )
    row("SQS requests", [sum(s.usage.sqs.values()) / s.steps for s in scenarios])
    row(
        "Scheduler schedules created and deleted (not billed)",
        [
            (s.usage.scheduler_calls["CreateSchedule"] + s.usage.scheduler_calls["DeleteSchedule"]) / s.steps
            for s in scenarios
        ],
    )
    row("Scheduler deliveries", [s.usage.scheduler_invocations / s.steps for s in scenarios])
    row("API Gateway requests", [sum(s.usage.api_requests.values()) / s.steps for s in scenarios])
    row("stored bytes (table + indexes)", [sum(s.stored) / s.steps for s in scenarios], "{:.0f}")
    row("log bytes", [sum(s.usage.log_bytes.values()) / s.steps for s in scenarios], "{:.0f}")
    row("answered accepted (202)", [s.answers.get(202, 0) / s.steps for s in scenarios])
    row("endpoint sleeps billed to a waiting function at D", [s.settled / s.steps for s in scenarios])
    row(
        "kept or delayed messages run forward after the run, per run",
        [float(s.fast_forwarded) for s in scenarios],
        "{:.0f}",
    )
    row("messages left in flight (not counted), per run", [float(s.left_in_flight) for s in scenarios], "{:.0f}")


# ---- the box -------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def box_with_meter(meter: Meter) -> Iterator[tuple[Any, dict[str, int]]]:
    """The stack in a box, each ``ryusen_server.lambdas`` handler the template has metered as its function."""
    import importlib

    from tests.infra import test_stack_in_a_box
    from tests.infra.conftest import synthesize

    with tempfile.TemporaryDirectory() as tmp:
        synthesized = synthesize(Path(tmp))
    memory_mb: dict[str, int] = {}
    patched: list[tuple[Any, Any]] = []
    for resource in synthesized.resources("AWS::Lambda::Function").values():
        handler = resource["Properties"]["Handler"]
        if not handler.startswith("ryusen_server.lambdas."):
            continue
        module_name, attribute = handler.rsplit(".", 1)
        function = module_name.rsplit(".", 1)[1]  # the box's caller name for it
        module = importlib.import_module(module_name)
        memory_mb[function] = int(resource["Properties"].get("MemorySize", 128))
        patched.append((module, getattr(module, attribute)))
        level = str(resource["Properties"].get("LoggingConfig", {}).get("SystemLogLevel", "INFO"))
        setattr(module, attribute, meter.timed(function, getattr(module, attribute), system_log_level=level))
    meter.memory_mb.update(memory_mb)
    deployed_fixture = contextlib.contextmanager(test_stack_in_a_box.deployed.__wrapped__)  # type: ignore[attr-defined]
    try:
        with deployed_fixture(synthesized) as deployed:
            meter.schemas = {
                deployed.box.refs[name]: TableSchema.from_template(r["Properties"])
                for name, r in deployed.box.resources("AWS::DynamoDB::Table").items()
            }
            yield deployed, memory_mb
    finally:
        for module, original in patched:
            module.handler = original


def main() -> int:
    global METER
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6-step runs")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 20)")
    parser.add_argument("--durations", default=None, help="step durations in seconds (default 0.1,1,10,600)")
    parser.add_argument("--kinds", default="http,lambda,event", help="endpoint kinds: http, lambda, event")
    parser.add_argument("--real-up-to", type=float, default=1.0, help="longer steps run on a compressed clock")
    parser.add_argument(
        "--split",
        type=int,
        default=None,
        metavar="STEPS",
        help="also run STEPS-step runs, and print what a run costs apart from its steps (a line through both)",
    )
    args = parser.parse_args()
    steps = args.steps or (6 if args.quick else 20)
    durations = [float(d) for d in args.durations.split(",")] if args.durations else list(DURATIONS_S)
    kinds = args.kinds.split(",")

    import logging

    import boto3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    token = caller.set("bench")
    private: list[Any] = []

    def private_client() -> Any:
        if not private:
            private.append(boto3.session.Session(region_name=REGION).client("dynamodb"))
        return private[0]

    meter = Meter({}, caller.get, private_client, excluded={"bench", "endpoint", "shop", "derive_app_key"})
    METER = meter
    sys.stdout = LogTap(meter, sys.stdout)  # type: ignore[assignment]
    sys.stderr = LogTap(meter, sys.stderr)  # type: ignore[assignment]
    results: dict[str, list[Scenario]] = {}
    try:
        with box_with_meter(meter) as (deployed, memory_mb):
            uninstall = meter.install()
            try:
                results, sweep = measure(deployed, meter, steps, durations, kinds, args.real_up_to, args.split)
            finally:
                uninstall()
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        caller.reset(token)
    report(results, sweep, memory_mb, steps)
    if args.split:
        report_split(results, memory_mb, steps, args.split)
    return 0


def measure(
    deployed: Any,
    meter: Meter,
    steps: int,
    durations: list[float],
    kinds: list[str],
    real_up_to_s: float,
    split: int | None = None,
) -> tuple[dict[str, list[Scenario]], Usage]:
    """Each kind at each duration in ``steps``-step runs (and in ``split``-step runs after them, kept under the
    kind's name with ``@split``)."""
    import boto3

    from ryusen._internal.signing import app_key

    env = deployed.env
    master = boto3.client("secretsmanager", region_name=REGION).get_secret_value(
        SecretId=env["RYUSEN_MASTER_KEY_SECRET_ARN"]
    )["SecretString"]
    endpoints: list[Endpoint] = []
    for kind in kinds:
        app_id = f"bench-{kind}"
        endpoint = Endpoint(kind, f"steps-{kind}")
        app = make_app(app_id, endpoint.function_id, app_key(master.strip(), app_id), shared_replay=kind == "event")
        if kind == "http":
            url, server = serve_http(app, endpoint)
            deployed.box.servers.append(server)
        elif kind == "event":
            # a Lambda whose containers share a replay table: attempts are sent to it as asynchronous events
            arn = f"arn:aws:lambda:{REGION}:123456789012:function:{app_id}"
            handler = lambda_endpoint(app, endpoint)
            url = deployed.box.function_url(handler, arn=arn)
            deployed.box.event_handlers[arn] = (handler, "shop")
        else:
            url = deployed.box.function_url(lambda_endpoint(app, endpoint))
        response = deployed.api("PUT", f"/v1/apps/{app_id}", {"url": url})
        assert response.status_code == 200, response.text
        endpoints.append(endpoint)
    bench = Bench(deployed, meter, env["RYUSEN_TABLE"], env["RYUSEN_QUEUE_URL"], steps, real_up_to_s)
    results: dict[str, list[Scenario]] = {}
    for endpoint in endpoints:
        # a warm-up run, not counted: the functions' containers are warm, and the dispatchers have read a run of
        # this workflow (what an endpoint that takes events gets waited for depends on it: the quick path)
        bench.run(endpoint, durations[0])
        for duration in durations:
            scenario = bench.run(endpoint, duration)
            if endpoint.kind in ("http", "event") and duration > real_up_to_s:
                # the compressed clock is honest only if no dispatcher waited for a compressed callback
                assert scenario.settled == 0, f"a dispatcher waited for a callback of {duration} s"
                assert scenario.answers.get(202, 0) >= steps, f"attempts of {duration} s were not acknowledged"
            print(
                f"{endpoint.kind:6} {label(duration):>7}: {scenario.wall_s:5.1f} s wall,"
                f" answers {dict(scenario.answers)}, visibility {scenario.usage.visibility_s},"
                f" forwarded {scenario.fast_forwarded}, left {scenario.left_in_flight},"
                f" api {dict(scenario.usage.api_requests)}, ops {dict(scenario.usage.operations)}",
                file=sys.__stderr__,
            )
            results.setdefault(endpoint.kind, []).append(scenario)
        if split:
            bench.steps = split
            for duration in durations:
                results.setdefault(f"{endpoint.kind}@{split}", []).append(bench.run(endpoint, duration))
            bench.steps = steps
    # one sweeper pass over a quiet table, as its every-minute rule calls it
    from tests.lambda_http import LambdaContext

    from ryusen_server.lambdas import sweep as sweep_lambda

    meter.reset()
    token = caller.set("sweep")
    try:
        sweep_lambda.handler({"source": "aws.events"}, LambdaContext(60))
    finally:
        caller.reset(token)
    meter.settle_endpoint_time(())
    return results, meter.reset()


def report_split(results: dict[str, list[Scenario]], memory_mb: dict[str, int], steps: int, split: int) -> None:
    """What a run costs apart from its steps, and each step apart from its run: the cost of a whole run is taken
    as a line in its steps, through the ``steps``- and ``split``-step runs at each duration."""
    print(f"\nA run and its steps apart ({steps}- and {split}-step runs), $ per million:\n")
    print("| kind | step takes | per run | per step | per step in runs of 20 / 100 / 1,000 | $1.50 from |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, short in results.items():
        long = results.get(f"{kind}@{split}")
        if "@" in kind or not long:
            continue
        for a, b in zip(short, long, strict=True):
            runs = [sum(line_items(x, memory_mb).values()) * x.steps for x in (a, b)]  # $ per million runs
            per_step = (runs[1] - runs[0]) / (b.steps - a.steps)
            per_run = runs[0] - per_step * a.steps
            at = " / ".join(f"{per_step + per_run / n:.2f}" for n in (20, 100, 1000))
            reach = f"{math.ceil(per_run / (1.5 - per_step))} steps" if per_step < 1.5 else "never"
            print(f"| {kind} | {label(a.duration_s)} | {per_run:.2f} | {per_step:.2f} | {at} | {reach} |")


def report(results: dict[str, list[Scenario]], sweep: Usage, memory_mb: dict[str, int], steps: int) -> None:
    notes = {
        "http": "the app served over HTTP (WSGI, threaded): it acknowledges attempts past 0.1 s",
        "lambda": "the app as a Lambda behind a Function URL: it answers inline, the dispatcher waits",
        "event": "the app as a Lambda whose containers share a replay table: attempts are sent as asynchronous"
        " events, and its outcomes posted to the result function",
    }
    print(f"Ryusen cost per million steps: {steps}-step runs, us-east-1 prices, {datetime.now(UTC):%Y-%m-%d}")
    for kind, scenarios in results.items():
        if "@" in kind:  # the longer runs of --split: their line is report_split's
            continue
        print_table(kind, scenarios, memory_mb, notes.get(kind, kind))
    sweep_ms = sum(sweep.billed_ms.values())
    sweep_cost = (
        (
            PRICES["lambda_request"]
            + sweep_ms / 1000 * memory_mb.get("sweep", 512) / 1024 * PRICES["lambda_gb_s"] * 1_000_000
            + sum(sweep.rru.values()) * PRICES["rru"]
            + sum(sweep.log_bytes.values()) / 1024**3 * PRICES["logs_gb"] * 1_000_000
        )
        * MINUTES_PER_MONTH
        / 1_000_000
    )
    idle = 5 * 3 * MINUTES_PER_MONTH * PRICES["sqs"] / 1_000_000  # 5 pollers, 20 s long polls (AWS's, not the box's)
    print(
        f"\nPer deployment, not per step: the sweeper (every minute; one pass over a quiet table here took"
        f" {sweep_ms} ms and {sum(sweep.rru.values()):g} read units) ${sweep_cost:.2f} a month; the event source's"
        f" empty long polls (about 5 pollers x 3 a minute) ${idle:.2f} a month."
    )
    secrets_month = (2 + MINUTES_PER_MONTH * 6) * PRICES["secrets"] / 1_000_000
    print(
        "Per container, not per step: Secrets Manager. A function's container reads the signing key at its start"
        " (two requests) and checks it again every 5 minutes; the result function checks at most every 10 s while"
        " results arrive (so that an emergency rotation refuses the old key there within 10 s). A check is one"
        f" request unless the key was rotated: at most ${secrets_month:.2f} a month for a result-function"
        " container busy all month, whatever its steps (the bench's short runs counted the reads in the row above)."
    )
    print("† from a secondary source (shared/facts/aws.md). Step Functions: one state transition per step.")
    for kind, scenarios in results.items():
        if "@" in kind:
            continue
        storage = [line_items(s, memory_mb)[STORAGE_ROW] for s in scenarios]
        longer = ", ".join(f"${x * (90 / RETENTION_DAYS - 1):.2f}" for x in storage)
        print(f"With 90 days' retention (Step Functions' history), {kind}: storage adds {longer} per million steps.")
    if any(s.duration_s > 360 for ss in results.values() for s in ss if s.kind == "lambda"):
        print(
            "A Lambda endpoint's step longer than the dispatcher's timeout (360 s) cannot be waited for on AWS:"
            " its column shows what waiting would cost."
        )


if __name__ == "__main__":
    sys.exit(main())

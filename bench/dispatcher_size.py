"""How much memory the dispatch function needs: its CPU per step and its peak memory, measured, and what each
Lambda memory size would add to a step's latency and cost (issue 25, "the dispatcher's size").

    PYTHONPATH=sdk:handlers:infra .venv/bin/python bench/dispatcher_size.py
    PYTHONPATH=sdk:handlers:infra .venv/bin/python bench/dispatcher_size.py --runs 10 --steps 50

**What runs.** moto serves DynamoDB, SQS and the Scheduler on loopback (its server, in this process); the API
function's handler serves the server API behind a loopback API Gateway; an app with one workflow of N quick
steps is served over WSGI. R runs are started. Then the dispatch function's real handler
(``ryusen_server.lambdas.dispatch.handler``, with Powertools' batch processor, logging and metrics) runs in a
**process of its own**, as the Lambda would: it receives the dispatch queue's messages one at a time (batch
size 1, as the template sets), hands each to the handler, and deletes what the handler did not keep, until
the queue stays empty. Everything it does is its own: signing, botocore's serialization and parsing, the
engine's decisions, the HTTP calls to the app. moto's work and the app's run in the parent, so they are not
counted in its CPU time.

**What is measured** in that process: CPU time (user + system) for its start (imports and the engine's
wiring: what a cold start runs) and for each invocation; wall time per invocation; the peak resident memory
(``ru_maxrss``).

**What it means on Lambda.** Lambda gives a function CPU in proportion to its memory: one vCPU at 1,769 MB
(AWS's documentation), so a fifth of one at 354 MB. The dispatcher is single-threaded, so a size above
1,769 MB adds nothing. A step's CPU time at size M is at least the CPU time measured here divided by
min(1, M / 1769): this machine's cores stand in for one full vCPU (Lambda's arm64 cores are comparable, not
the same). The time the dispatcher spends waiting (for DynamoDB, SQS and the endpoint) does not change
with M. So the table prints, per size, the CPU milliseconds a step adds, the cold start's, whether the peak
memory fits, and what a second of waiting costs (GB-s at the arm64 price). That last figure is what a
Lambda endpoint's steps cost per second of callback, since the dispatcher waits for them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FULL_VCPU_MB = 1769
"""Lambda's memory at which a function has the equivalent of one full vCPU (AWS Lambda documentation)."""
GB_S_PRICE = 0.0000133334
"""Lambda arm64, dollars per GB-second (us-east-1)."""
SIZES_MB = (128, 256, 384, 512, 768, 1024, 1769)
CURRENT_MB = 512
"""The dispatch function's memory in the template (infra/ryusen_infra/engine.py)."""
MASTER_KEY = "bench-dispatcher-size-master-key-0123456789"


def _environment(endpoint: str, queue_url: str, queue_arn: str, result_url: str) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "RYUSEN_TABLE": "ryusen",
        "RYUSEN_QUEUE_URL": queue_url,
        "RYUSEN_QUEUE_ARN": queue_arn,
        "RYUSEN_SCHEDULER_ROLE_ARN": "arn:aws:iam::123456789012:role/scheduler",
        "RYUSEN_ENDPOINT_ALLOWED_NETWORKS": "127.0.0.0/8",
        "RYUSEN_MASTER_KEY": MASTER_KEY,
        "RYUSEN_RESULT_URL": result_url,
        "POWERTOOLS_METRICS_NAMESPACE": "Ryusen",
        "POWERTOOLS_LOG_LEVEL": "WARNING",
    }


def _child() -> None:
    """The dispatch Lambda: receive, handle, delete; print what it measured as one JSON line."""
    started = time.process_time()
    import boto3
    from tests.lambda_http import LambdaContext, sqs_batch

    from ryusen_server.lambdas import dispatch as dispatch_lambda

    dispatch_lambda.engine()  # the wiring a cold start does (its clients, the secret-less key)
    cold_cpu = time.process_time() - started
    sqs = boto3.client("sqs")
    queue_url = os.environ["RYUSEN_QUEUE_URL"]
    cpu: list[float] = []
    wall: list[float] = []
    idle_since = time.monotonic()
    while time.monotonic() - idle_since < 3.0:
        messages = sqs.receive_message(
            QueueUrl=queue_url,
            MaxNumberOfMessages=1,
            WaitTimeSeconds=1,
            MessageSystemAttributeNames=["All"],
            MessageAttributeNames=["All"],
        ).get("Messages", [])
        if not messages:
            continue
        idle_since = time.monotonic()
        c0, w0 = time.process_time(), time.perf_counter()
        result = dispatch_lambda.handler(sqs_batch(messages), LambdaContext(360.0))
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
        kept = {f["itemIdentifier"] for f in result.get("batchItemFailures", [])}
        for message in messages:
            if message["MessageId"] not in kept:
                sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"cold_cpu_s": cold_cpu, "cpu_s": cpu, "wall_s": wall, "peak_rss_mb": peak_kb / 1024}))


def _parent(runs: int, steps: int) -> None:
    os.environ["MOTO_DISABLE_GLOBAL_CORS"] = "true"
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(_environment(endpoint, "", "", ""))

    import boto3
    import httpx
    from tests.lambda_http import ApiGateway
    from werkzeug.serving import make_server

    from ryusen import Ryusen, Step
    from ryusen_server.aws.queue import create_queues
    from ryusen_server.aws.store import create_table
    from ryusen_server.aws.timers import create_schedule_group
    from ryusen_server.lambdas import api as api_lambda

    create_table(boto3.client("dynamodb"), "ryusen")
    sqs = boto3.client("sqs")
    queue_url, _ = create_queues(sqs, "ryusen-dispatch")
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    create_schedule_group(boto3.client("scheduler"), "ryusen")
    gateway = ApiGateway(api_lambda.handler)
    env = _environment(endpoint, queue_url, queue_arn, f"{gateway.url}/v1/results")
    os.environ.update(env)
    os.environ["POWERTOOLS_METRICS_DISABLED"] = "true"  # the API's metrics, here (the dispatcher's are kept)

    app = Ryusen("box")

    @app.function("order")
    def order(data: Any, step: Step) -> Any:
        return [step.run(f"s{i}", lambda i=i: {"n": i}, timeout=timedelta(seconds=30)) for i in range(steps)]

    server = make_server("127.0.0.1", 0, app.wsgi(), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    app_url = f"http://127.0.0.1:{server.server_port}/"

    def call(method: str, path: str, body: Any = None) -> Any:
        response = httpx.request(method, gateway.url + path, json=body, timeout=30)
        response.raise_for_status()
        return response.json()

    call("PUT", "/v1/apps/box", {"url": app_url})
    run_ids = [call("POST", "/v1/functions/order/runs", {"input": {}})["id"] for _ in range(runs)]

    paths = os.pathsep.join(str(ROOT / p) for p in ("sdk", "handlers", "infra", "."))
    child_env = {k: v for k, v in os.environ.items() if k != "POWERTOOLS_METRICS_DISABLED"}
    child_env.update(env, PYTHONPATH=paths)
    done = subprocess.run(
        [sys.executable, __file__, "--child"], env=child_env, cwd=ROOT, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        sys.exit(f"the dispatcher process failed:\n{done.stderr[-4000:]}")
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    outcomes = [call("GET", f"/v1/runs/{r}")["outcome"] for r in run_ids]
    server.shutdown()
    gateway.close()
    moto.stop()
    _report(measured, runs, steps, outcomes)


def _report(measured: dict[str, Any], runs: int, steps: int, outcomes: list[str]) -> None:
    total_steps = runs * steps
    cpu, wall = measured["cpu_s"], measured["wall_s"]
    cpu_per_step_ms = 1000 * sum(cpu) / total_steps
    wall_per_step_ms = 1000 * sum(wall) / total_steps
    print(f"{runs} runs of {steps} steps: {len(cpu)} dispatch invocations; outcomes {sorted(set(outcomes))}")
    print(f"per step: {cpu_per_step_ms:.2f} ms CPU, {wall_per_step_ms:.2f} ms wall (this machine)")
    print(
        f"per invocation: CPU median {1000 * statistics.median(cpu):.1f} ms,"
        f" p95 {1000 * sorted(cpu)[int(0.95 * (len(cpu) - 1))]:.1f} ms, max {1000 * max(cpu):.1f} ms"
    )
    print(f"cold start (imports and wiring): {1000 * measured['cold_cpu_s']:.0f} ms CPU")
    print(f"peak resident memory: {measured['peak_rss_mb']:.0f} MB")
    print()
    print(
        "| memory | vCPU share | CPU a step adds | cold start CPU | peak memory fits"
        " | $ per million steps per second waited |"
    )
    print("|---:|---:|---:|---:|---|---:|")
    for size in SIZES_MB:
        share = min(1.0, size / FULL_VCPU_MB)
        fits = "yes" if measured["peak_rss_mb"] * 1.25 <= size else "no"  # a quarter of headroom
        mark = " (now)" if size == CURRENT_MB else ""
        print(
            f"| {size} MB{mark} | {share:.2f} | {cpu_per_step_ms / share:.1f} ms |"
            f" {1000 * measured['cold_cpu_s'] / share:,.0f} ms | {fits} |"
            f" ${size / 1024 * GB_S_PRICE * 1e6:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child()
    else:
        _parent(args.runs, args.steps)


if __name__ == "__main__":
    main()

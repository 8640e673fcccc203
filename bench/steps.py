"""Per-step cost of a straight-line workflow: requests, bytes and latency.

    .venv/bin/python bench/steps.py            # 20- and 100-step runs, ryusen.testing and the ryusen dev stack
    .venv/bin/python bench/steps.py --quick    # 20 steps only
    .venv/bin/python bench/steps.py --quick --result-bytes 100000   # each result 100 KB, incompressible
    .venv/bin/python bench/steps.py --steps 20,200,1000 --store moto --no-dev   # DynamoDB store on moto

In-process, short runs are repeated after a warm-up run and the median is printed (one run is a
few milliseconds: a single figure would be noise).

For each environment and run length it prints, per step: invocations of the
user endpoint, store (DynamoDB) reads and writes, SQS requests and Scheduler
calls; per run: bytes sent to the endpoint and bytes written to the store; and
the median milliseconds per step (the gap between consecutive step
settlements). Figures, not assertions: docs/performance.md records them.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

APP_SOURCE = """
import base64
import random

from ryusen import Ryusen, Step

app = Ryusen("bench")

def work(i: int, size: int | None) -> dict:
    if size is None:
        return {"i": i, "payload": "x" * 64}
    return {"i": i, "payload": base64.b64encode(random.Random(i).randbytes(size * 3 // 4)).decode()}

@app.function("straight")
def straight(data: dict, step: Step) -> dict:
    total = 0
    for i in range(data["steps"]):
        total += step.run(f"step-{i}", work, i, data.get("result_bytes"))["i"]
    return {"total": total}
"""


SQS_KINDS = (
    "queue.send",
    "queue.receive",
    "queue.delete",
    "sqs.send",
    "sqs.receive",
    "sqs.delete",
    "sqs.change_visibility",
)


def per_step_ms(view: dict[str, Any]) -> float:
    settled = sorted(
        datetime.fromisoformat(a["settled_at"])
        for s in view["steps"]
        for a in s["attempts"]
        if a["phase"] == "forward" and a["settled_at"]
    )
    gaps = [(b - a).total_seconds() * 1000 for a, b in itertools.pairwise(settled)]
    return statistics.median(gaps) if gaps else 0.0


PRICES = {
    "wru": 0.625,  # DynamoDB on-demand, per million write request units (1 KB each)
    "rru": 0.125,  # per million read request units (a strongly consistent read up to 4 KB)
    "sqs": 0.40,  # SQS standard, per million requests
    "lambda": 0.20,  # Lambda, per million requests (duration is billed apart: see docs/deploy.md)
    "scheduler": 1.00,  # EventBridge Scheduler, per million invocations
}
"""us-east-1 on-demand prices (shared/facts/aws.md), dollars per million."""


def cost_per_million_steps(
    steps: int, counts: dict[str, int], sent: dict[str, int], write_units: int
) -> dict[str, float]:
    """Ryusen's own AWS cost per million steps, from the requests counted for one run.

    Write units: as the store counted them, one per KB of each item written, twice for an item in a
    transaction (a head update counts its changed attributes, not the whole head). Reads: one unit each
    (every read here is under 4 KB). Lambda requests: one dispatch invocation per message sent (the event
    source delivers one record per invocation).
    """

    def per(*kinds: str) -> float:
        return sum(counts.get(k, 0) for k in kinds) / steps

    wru = write_units / steps
    messages = per("sqs.send", "queue.send")
    return {
        "dynamodb": wru * PRICES["wru"] + per("store.read", "dynamodb.read") * PRICES["rru"],
        "sqs": per(*SQS_KINDS) * PRICES["sqs"],
        "lambda": messages * PRICES["lambda"],
        "scheduler": per("timers.schedule", "scheduler.create_schedule") * PRICES["scheduler"],
    }


class WriteSizes:
    """The size of every item the store writes (for the median and the write units)."""

    def __init__(self, counter: Any) -> None:
        counter.item_sizes = []
        self.sizes: list[int] = counter.item_sizes

    def line(self, steps: int) -> str:
        if not self.sizes:
            return ""
        units = [max(1, -(-size // 1024)) for size in self.sizes]
        tail = self.sizes[-max(1, len(self.sizes) // 10) :]  # the last tenth of the run's writes
        return (
            f"{'':26} | writes: median {statistics.median(self.sizes):,.0f} B, last tenth median"
            f" {statistics.median(tail):,.0f} B, max {max(self.sizes):,} B; write units median"
            f" {statistics.median(units):.0f}, max {max(units)}"
        )


def report(
    env: str, steps: int, counts: dict[str, int], sent: dict[str, int], ms: float, wall_s: float, write_units: int = 0
) -> None:
    def per(kinds: tuple[str, ...]) -> float:
        return sum(counts.get(k, 0) for k in kinds) / steps

    units = f" ({write_units / steps:.2f} units)" if write_units else ""
    print(
        f"{env:15} {steps:4} steps | per step: invoke {per(('endpoint.invoke',)):.2f}"
        f"  ddb read {per(('store.read', 'dynamodb.read')):.2f}"
        f"  ddb write {per(('store.write', 'dynamodb.write')):.2f}{units}"
        f"  sqs {per(SQS_KINDS):.2f}"
        f"  scheduler {per(('timers.schedule', 'scheduler.create_schedule')):.2f}"
        f" | per run: endpoint bytes {sent.get('endpoint.invoke', 0):,}"
        f"  store bytes {sent.get('store.write', 0) + sent.get('dynamodb.write', 0):,}"
        f" | median {ms:.1f} ms/step  (wall {wall_s:.2f} s)"
    )
    if "dynamodb.write" in counts:  # the in-memory store's byte counts are not DynamoDB's: no cost line
        cost = cost_per_million_steps(steps, counts, sent, write_units)
        parts = "  ".join(f"{k} ${v:.2f}" for k, v in cost.items())
        total = sum(cost.values())
        print(f"{'':26} | Ryusen-side cost ${total:.2f} per million steps ({parts}; Lambda duration apart)")


def bench_testing(steps: int, result_bytes: int | None, store: str, *, report_it: bool = True) -> None:
    """One environment per repetition: short runs are repeated (up to 5 times, about 2,000 steps in all) and
    the median wall time per step is reported; the counts are the last repetition's (they do not vary)."""
    from ryusen.testing import WorkflowEnvironment
    from ryusen_server.core.events import EngineSettings

    repetitions = max(1, min(5, 2000 // steps)) if report_it else 1
    per_step: list[float] = []
    walls: list[float] = []
    for _ in range(repetitions):
        namespace: dict[str, Any] = {}
        exec(compile(APP_SOURCE, "bench_app.py", "exec"), namespace)
        settings = EngineSettings(max_steps=max(steps, 1000))
        with WorkflowEnvironment(namespace["app"], store=store, settings=settings, kept_passes=True) as env:
            env.counter.reset()
            sizes = WriteSizes(env.counter)
            started = time.perf_counter()
            run = env.run("straight", {"steps": steps, "result_bytes": result_bytes})
            wall = time.perf_counter() - started
            assert run.outcome == "completed", run.summary
        walls.append(wall)
        per_step.append(wall * 1000 / steps)
    if not report_it:
        return
    # virtual time does not move between steps here, so latency is wall time per step
    name = "ryusen.testing" if store == "memory" else f"testing ({store})"
    counter = env.counter
    ms = statistics.median(per_step)
    report(
        name, steps, dict(counter.counts), dict(counter.bytes_sent), ms, statistics.median(walls), counter.write_units
    )
    if repetitions > 1:
        print(f"{'':26} | ms/step over {repetitions} runs: " + ", ".join(f"{v:.2f}" for v in per_step))
    if sizes.line(steps):
        print(sizes.line(steps))


def bench_dev(steps_list: list[int], result_bytes: int | None) -> None:
    from ryusen_server.local.dev import DevStack, free_port

    with tempfile.TemporaryDirectory() as tmp:
        app_file = Path(tmp) / "bench_app.py"
        app_file.write_text(APP_SOURCE)
        port = free_port()
        stack = DevStack(port=port, apps=[f"{app_file}:app"], out=lambda line: None)
        stack.start()
        try:
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
            assert stack.wired is not None
            finished = threading.Event()

            def on_decision(kind: str, payload: Any) -> None:
                # the engine tells us when the run finishes: no API polling inflates the counts
                if kind == "decided" and payload[1].state.phase.value == "finished":
                    finished.set()

            stack.wired.engine.hooks.append(on_decision)
            sizes = WriteSizes(stack.counter)
            for steps in steps_list:
                finished.clear()
                stack.counter.reset()
                started = time.perf_counter()
                run_id = client.post(
                    "/v1/functions/straight/runs", json={"input": {"steps": steps, "result_bytes": result_bytes}}
                ).json()["id"]
                assert finished.wait(600), "run did not finish"
                wall = time.perf_counter() - started
                counts = dict(stack.counter.counts)
                sent = dict(stack.counter.bytes_sent)
                units = stack.counter.write_units
                view = client.get(f"/v1/runs/{run_id}").json()
                assert view["outcome"] == "completed", view["summary"]
                report("ryusen dev", steps, counts, sent, per_step_ms(view), wall, units)
                if sizes.line(steps):
                    print(sizes.line(steps))
        finally:
            stack.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 steps only")
    parser.add_argument("--no-dev", action="store_true", help="skip the ryusen dev stack")
    parser.add_argument(
        "--result-bytes",
        type=int,
        default=None,
        help="each step returns this many incompressible bytes",
    )
    parser.add_argument("--steps", default=None, help="run lengths, comma-separated (default 20,100)")
    parser.add_argument(
        "--store", choices=("memory", "moto"), default="memory", help="ryusen.testing's store (moto: DynamoDB's)"
    )
    args = parser.parse_args()
    lengths = [20] if args.quick else [20, 100]
    if args.steps:
        lengths = [int(n) for n in args.steps.split(",")]
    bench_testing(20, args.result_bytes, args.store, report_it=False)  # warm-up: imports, first-call costs
    for steps in lengths:
        bench_testing(steps, args.result_bytes, args.store)
    if not args.no_dev:
        bench_dev(lengths, args.result_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

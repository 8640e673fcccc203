"""A fan-out of parallel steps (decision 30): wall time against the slowest sibling, requests per step, memory.

    .venv/bin/python bench/fanout.py                    # 100 and 1,000 siblings: ryusen.testing, then ryusen dev
    .venv/bin/python bench/fanout.py --items 100 --no-dev
    .venv/bin/python bench/fanout.py --store moto --no-dev   # the DynamoDB store on moto

The workflow ``asyncio.gather``s one step per item (``max_parallel`` 10, the default), then returns the sum.

* ``ryusen.testing`` (in-process, virtual clock): per step, invocations of the endpoint, store reads and
  writes, queue requests; per run, the bytes sent to the endpoint; the peak Python memory the whole run
  allocated (tracemalloc: engine, store and SDK together) and the CPU wall time it took.
* ``ryusen dev`` (real HTTP, real concurrency), twice per size: with instant callbacks (each answered within the
  dispatcher's request: the next sibling is authorized in the write that accepts one, and invoked at once), and
  with callbacks that sleep a drawn 0.1-0.5 s (past ``acknowledge_after_s``: the endpoint acknowledges and posts
  the result, so the next sibling is sent as a message, as any long step's successor is). For the second it
  prints the run's wall time against its slowest sibling and against the sum of all siblings divided by
  ``max_parallel`` (the best any bounded scheduler can do).

Figures, not assertions: docs/performance.md records them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from steps import SQS_KINDS

VERBOSE = False
APP_SOURCE = """
import asyncio
import random

from ryusen import AsyncStep, Ryusen

app = Ryusen("fanout")


async def price(i: int, seconds: float) -> dict:
    if seconds:
        await asyncio.sleep(seconds)
    return {"i": i, "price": i * 2}


@app.function("fan-out")
async def fan_out(data: dict, step: AsyncStep) -> dict:
    durations = [random.Random(i).uniform(0.1, 0.5) if data.get("sleep") else 0.0 for i in range(data["items"])]
    quotes = await asyncio.gather(
        *(step.run(f"item-{i}", price, i, durations[i]) for i in range(data["items"]))
    )
    return {"total": sum(q["price"] for q in quotes), "slowest_s": max(durations), "sum_s": sum(durations)}
"""


def _per(counts: dict[str, int], kinds: tuple[str, ...], steps: int) -> float:
    return sum(counts.get(k, 0) for k in kinds) / steps


def line(env: str, items: int, counts: dict[str, int], sent: dict[str, int], extra: str) -> None:
    print(
        f"{env:15} {items:5} siblings | per step: invoke {_per(counts, ('endpoint.invoke',), items):.3f}"
        f"  store read {_per(counts, ('store.read', 'dynamodb.read'), items):.2f}"
        f"  store write {_per(counts, ('store.write', 'dynamodb.write'), items):.3f}"
        f"  queue {_per(counts, SQS_KINDS, items):.2f}"
        f" | endpoint bytes {sent.get('endpoint.invoke', 0):,} | {extra}"
    )


def bench_testing(items: int, store: str) -> None:
    from ryusen.testing import WorkflowEnvironment
    from ryusen_server.core.events import EngineSettings

    namespace: dict[str, Any] = {}
    exec(compile(APP_SOURCE, "fanout_app.py", "exec"), namespace)
    settings = EngineSettings(max_steps=max(items, 1000))
    with WorkflowEnvironment(namespace["app"], store=store, settings=settings) as env:
        env.counter.reset()
        tracemalloc.start()
        started = time.perf_counter()
        run = env.run("fan-out", {"items": items})
        wall = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert run.outcome == "completed", run.summary
        name = "ryusen.testing" if store == "memory" else f"testing ({store})"
        extra = f"peak memory {peak / 1e6:.1f} MB (traced)  CPU wall {wall:.1f} s"
        line(name, items, dict(env.counter.counts), dict(env.counter.bytes_sent), extra)


def bench_dev(items_list: list[int]) -> None:
    from ryusen_server.local.dev import DevStack, free_port

    with tempfile.TemporaryDirectory() as tmp:
        app_file = Path(tmp) / "fanout_app.py"
        app_file.write_text(APP_SOURCE)
        port = free_port()
        stack = DevStack(port=port, apps=[f"{app_file}:app"], out=lambda line: None)
        stack.start()
        try:
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
            assert stack.wired is not None
            finished: set[str] = set()
            changed = threading.Condition()

            def on_decision(kind: str, payload: Any) -> None:
                if kind == "decided" and payload[1].state.phase.value == "finished":
                    with changed:
                        finished.add(payload[1].state.id)
                        changed.notify_all()

            stack.wired.engine.hooks.append(on_decision)
            for items in items_list:
                for sleep in (False, True):
                    stack.counter.reset()
                    started = time.perf_counter()
                    run_id = client.post(
                        "/v1/functions/fan-out/runs", json={"input": {"items": items, "sleep": sleep}}
                    ).json()["id"]
                    with changed:
                        assert changed.wait_for(lambda rid=run_id: rid in finished, 1800), "run did not finish"
                    wall = time.perf_counter() - started
                    counts, sent = dict(stack.counter.counts), dict(stack.counter.bytes_sent)
                    view = client.get(f"/v1/runs/{run_id}").json()
                    assert view["outcome"] == "completed", view["summary"]
                    out = view["output"]
                    if sleep:
                        bound = max(out["sum_s"] / 10, out["slowest_s"])  # max_parallel 10: none does better
                        extra = (
                            f"0.1-0.5 s each: wall {wall:.1f} s; slowest sibling {out['slowest_s']:.2f} s;"
                            f" sum/max_parallel {out['sum_s'] / 10:.1f} s ({wall / bound:.2f}x the best possible)"
                        )
                    else:
                        extra = f"instant callbacks: wall {wall:.1f} s"
                    line("ryusen dev", items, counts, sent, extra)
                    if VERBOSE:
                        print(counts)
        finally:
            stack.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", default="100,1000", help="fan-out sizes, comma-separated (default 100,1000)")
    parser.add_argument("--store", default="memory", choices=("memory", "moto"), help="ryusen.testing's store")
    parser.add_argument("--no-dev", action="store_true", help="skip the ryusen dev stack")
    parser.add_argument("--verbose", action="store_true", help="print every request count")
    args = parser.parse_args()
    global VERBOSE
    VERBOSE = args.verbose
    sizes = [int(n) for n in args.items.split(",")]
    for items in sizes:
        bench_testing(items, args.store)
    if not args.no_dev:
        bench_dev(sizes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

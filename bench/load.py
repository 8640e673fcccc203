"""Load on the ``ryusen dev`` stack: many concurrent runs of a 10-step workflow with compensations (issue 12).

    .venv/bin/python bench/load.py                 # 1,000 runs, faults in a tenth of them
    .venv/bin/python bench/load.py --runs 100      # a quicker look

Every step's callback and compensator appends a line to a log the bench reads afterwards, so that what ran is
counted from the effects themselves, not from what the engine says. A tenth of the runs carry faults:
a third of those fail for good at step 7 (the run is compensated), a third fail once at step 4 and are
retried (the retry policy is the consent to run it again), a third make their endpoint process crash in the
middle of step 5's callback once (the attempt's outcome is not known: the run waits on an Unknown, as it
must; the bench resolves it as an operator would, with ``retry``, which is consent).

It prints: runs started, finished, lost (not finished, with no blocker saying why, at the end); throughput
(steps per second over the wall time); the time per step (the gap between consecutive step settlements in
a run: p50 and p99 over every run); steps run twice without consent (a successful callback or a compensator
that ran more than once for one run where no retry was consented); and the dead-letter queue's depth.
Figures, not assertions: docs/performance.md records them.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

STEPS = 10

APP_SOURCE = """
import os

from ryusen import RetryPolicy, Ryusen, Step

app = Ryusen("load")
LOG = os.environ["RYUSEN_LOAD_LOG"]
MARKS = os.environ["RYUSEN_LOAD_MARKS"]


def effect(n: int, what: str) -> None:
    with open(LOG, "a") as log:
        log.write(f"{n} {what}\\n")


def once(n: int, what: str) -> bool:
    '''True the first time (n, what) is asked, across processes: a fault that happens once.'''
    try:
        fd = os.open(os.path.join(MARKS, f"{n}-{what}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def work(n: int, i: int, fault: str | None) -> int:
    if fault == "fails" and i == 7:
        effect(n, f"failed {i}")
        raise RuntimeError("declined")
    if fault == "flaky" and i == 4 and once(n, "flaky"):
        effect(n, f"failed {i}")
        raise RuntimeError("busy, try again")
    if fault == "crash" and i == 5 and once(n, "crash"):
        effect(n, f"crashed {i}")
        os._exit(1)  # the endpoint process dies mid-callback: its outcome cannot be known
    effect(n, f"forward {i}")
    return i


def undo(n: int, i: int) -> None:
    effect(n, f"compensate {i}")


@app.function("order")
def order(data: dict, step: Step) -> int:
    n, fault = data["n"], data.get("fault")
    total = 0
    for i in range(%(steps)d):
        total += step.run(
            f"step-{i}",
            work,
            n,
            i,
            fault,
            compensate=lambda _r, i=i: undo(n, i),
            retry=RetryPolicy(max_attempts=2),
        )
    return total
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def step_gaps_ms(view: dict[str, Any]) -> list[float]:
    settled = sorted(
        datetime.fromisoformat(a["settled_at"])
        for s in view["steps"]
        for a in s["attempts"]
        if a["phase"] == "forward" and a["settled_at"] and a["status"] == "succeeded"
    )
    return [(b - a).total_seconds() * 1000 for a, b in itertools.pairwise(settled)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--faulty", type=float, default=0.1, help="the share of runs with faults")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for every run")
    args = parser.parse_args()

    from ryusen_server.local.dev import DevStack, free_port

    with tempfile.TemporaryDirectory() as tmp:
        log_file, marks = Path(tmp) / "effects.log", Path(tmp) / "marks"
        marks.mkdir()
        app_file = Path(tmp) / "load_app.py"
        app_file.write_text(APP_SOURCE % {"steps": STEPS})
        port = free_port()
        env = {**os.environ, "RYUSEN_LOAD_LOG": str(log_file), "RYUSEN_LOAD_MARKS": str(marks)}
        stack = DevStack(port=port, apps=[f"{app_file}:app"], env=env, out=lambda line: None)
        stack.start()
        try:
            return run_load(stack, port, args)
        finally:
            stack.stop()
            effects = log_file.read_text().splitlines() if log_file.exists() else []
            report_effects(effects)


faults_of: dict[int, str | None] = {}
resolved: Counter[str] = Counter()
consented: set[tuple[str, str]] = set()
"""(run input n, "forward i") an operator consented to run again (a retry of its Unknown attempt)."""


def run_load(stack: Any, port: int, args: argparse.Namespace) -> int:
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    kinds = ("fails", "flaky", "crash")
    every = max(1, round(1 / args.faulty)) if args.faulty > 0 else 0
    for n in range(args.runs):
        faults_of[n] = kinds[(n // every) % 3] if every and n % every == 0 else None
    run_ids: dict[int, str] = {}
    lock = threading.Lock()

    def start(n: int) -> None:
        body = {"input": {"n": n, "fault": faults_of[n]}}
        run_id = client.post("/v1/functions/order/runs", json=body).json()["id"]
        with lock:
            run_ids[n] = run_id

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(start, range(args.runs)))
    print(f"started {len(run_ids)} runs in {time.perf_counter() - started:.1f}s", flush=True)
    views: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline and len(views) < len(run_ids):
        summaries = listing(client)  # a few list requests, not one read per run (they would slow the engine)
        for n, run_id in run_ids.items():
            summary = summaries.get(run_id)
            if n in views or summary is None:
                continue
            if summary["phase"] == "finished":
                views[n] = client.get(f"/v1/runs/{run_id}").json()
            elif summary["blocked"]:
                view = client.get(f"/v1/runs/{run_id}").json()
                if any(b["type"] == "unknown_outcome" for b in view.get("blockers", [])):
                    resolve_unknowns(client, n, view)  # as an operator would: run it again (consent)
        print(f"  {len(views)}/{len(run_ids)} finished at {time.perf_counter() - started:.0f}s", flush=True)
        time.sleep(5)
    wall = time.perf_counter() - started
    lost = [run_ids[n] for n in run_ids if n not in views]
    outcomes = Counter(v["outcome"] for v in views.values())
    gaps = [g for v in views.values() for g in step_gaps_ms(v)]
    steps_settled = sum(  # callbacks and compensators that completed
        1 for v in views.values() for s in v["steps"] for a in s["attempts"] if a["status"] == "succeeded"
    )
    sqs = stack.wired.sqs
    dlq = next(u for u in sqs.list_queues()["QueueUrls"] if u.endswith("-dlq"))
    attributes = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["ApproximateNumberOfMessages"])
    depth = int(attributes["Attributes"]["ApproximateNumberOfMessages"])
    print(f"runs: {len(run_ids)} started, {len(views)} finished ({dict(outcomes)}), {len(lost)} not finished")
    print(f"operator resolutions (retry of an Unknown, consented): {resolved['retry']}")
    print(f"wall {wall:.0f}s; throughput {steps_settled / wall:.1f} steps/s ({steps_settled} steps and compensations)")
    print(f"time per step: p50 {percentile(gaps, 0.5):.0f} ms, p99 {percentile(gaps, 0.99):.0f} ms ({len(gaps)} gaps)")
    calm = [g for n, v in views.items() if faults_of[n] is None for g in step_gaps_ms(v)]
    print(
        f"time per step in runs without faults: p50 {percentile(calm, 0.5):.0f} ms,"
        f" p90 {percentile(calm, 0.9):.0f} ms, p99 {percentile(calm, 0.99):.0f} ms ({len(calm)} gaps)"
    )
    print(f"dead-letter queue: {depth} messages")
    slowest = sorted(
        ((gap, n) for n, v in views.items() if faults_of[n] is None for gap in step_gaps_ms(v)), reverse=True
    )[:3]
    for gap, n in slowest:  # what the slowest waits in runs without faults of their own were
        attempts = [
            f"{s['id']}/{a['phase']}#{a['generation']} {a['status']}" + (f" ({a['detail']})" if a.get("detail") else "")
            for s in views[n]["steps"]
            for a in s["attempts"]
            if a["status"] != "succeeded"
        ]
        print(f"  a {gap / 1000:.0f} s wait in {views[n]['id']}: {'; '.join(attempts) or 'every attempt succeeded'}")
    if lost:
        print("not finished:", ", ".join(lost[:10]))
    return 0


def listing(client: httpx.Client) -> dict[str, dict[str, Any]]:
    """Every run of the bench's function, as the run list shows it (id -> summary)."""
    runs: dict[str, dict[str, Any]] = {}
    params: dict[str, Any] = {"function_id": "order", "limit": 200}
    while True:
        page = client.get("/v1/runs", params=params).json()
        runs.update((r["id"], r) for r in page["runs"])
        if not page.get("cursor"):
            return runs
        params["cursor"] = page["cursor"]


def resolve_unknowns(client: httpx.Client, n: int, view: dict[str, Any]) -> None:
    """Retry every Unknown attempt of the run (the endpoint crashed under it, maybe after its effect)."""
    for step in view["steps"]:
        for attempt in step["attempts"]:
            if attempt["status"] == "unknown":
                path = f"/v1/runs/{view['id']}/steps/{step['id']}/{attempt['phase']}/{attempt['generation']}/resolve"
                answer = client.post(path, json={"action": "retry"})
                if answer.status_code < 300:
                    resolved["retry"] += 1
                    index = step["id"].removeprefix("step-")
                    what = "forward" if attempt["phase"] == "forward" else "compensate"
                    consented.add((str(n), f"{what} {index}"))


def report_effects(lines: list[str]) -> None:
    """Steps run twice without consent, counted from the effects: a successful forward callback or a
    compensator that ran more than once for one run (a retry after a failure or an Unknown is consented)."""
    counts = Counter(tuple(line.split(" ", 1)) for line in lines)
    # a failed or crashed try logs no "forward" line (it died or raised before the effect): its retry is the
    # first run of the effect, so any count over one here is an effect that ran twice
    unconsented = {
        key: c
        for key, c in counts.items()
        if c > 1 and key[1].split()[0] in ("forward", "compensate") and key not in consented
    }
    again = sum(1 for key, c in counts.items() if c > 1 and key in consented)
    print(f"effects logged: {len(lines)}; steps run twice without consent: {len(unconsented)}")
    print(f"steps run again with consent (an operator's retry of an Unknown): {again}")
    for (n, what), c in list(unconsented.items())[:10]:
        print(f"  run input {n}: {what} ran {c} times")


if __name__ == "__main__":
    sys.exit(main())

"""One long step on the ``ryusen dev`` stack, with heartbeats: it completes, and no dispatcher waits for it
(issue 25: "a 20-minute step completes on the ryusen dev stack").

    PYTHONPATH=sdk:handlers:infra .venv/bin/python bench/long_step.py                  # 20 minutes
    PYTHONPATH=sdk:handlers:infra .venv/bin/python bench/long_step.py --minutes 2

The app's workflow runs one step, ``encode``, whose callback works for the given time and calls
``ryusen.heartbeat`` every 10 s with its progress; the step declares ``heartbeat=30 s`` (so its lease is 30 s,
renewed by each heartbeat) and a timeout of the duration plus 10 minutes. Then a second step, ``publish``,
returns at once. The limits are the short ones a long step lives with: a lease of 30 s where a step without
heartbeats would hold one of its whole timeout, and dispatch workers that never wait for a callback (the
endpoint acknowledges attempts that run past 0.1 s). While the step runs, the bench starts a quick run every
minute, which must not wait behind it.

Prints the run's outcome, the attempts of ``encode`` (one, never Unknown), the heartbeats taken, the longest
time a dispatch worker spent on one message, and the quick runs' times.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

APP_SOURCE = """
import time
from datetime import timedelta

import ryusen
from ryusen import Ryusen, Step

app = Ryusen("long")
SECONDS = {seconds}


def encode() -> dict:
    started = time.monotonic()
    while (done := time.monotonic() - started) < SECONDS:
        ryusen.heartbeat({{"done_s": round(done), "of_s": SECONDS, "fraction": round(done / SECONDS, 3)}})
        time.sleep(min(10.0, max(0.0, SECONDS - done)))
    return {{"encoded_s": round(time.monotonic() - started, 1)}}


@app.function("encode-video")
def encode_video(data: dict, step: Step) -> dict:
    video = step.run(
        "encode", encode, heartbeat=timedelta(seconds=30), timeout=timedelta(seconds=SECONDS + 600)
    )
    return step.run("publish", lambda: {{"published": True, **video}})


@app.function("quick")
def quick(data: dict, step: Step) -> dict:
    return step.run("ping", lambda: {{"pong": True}})
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    args = parser.parse_args()
    seconds = round(args.minutes * 60)

    from ryusen_server.local.dev import DevStack, free_port

    with tempfile.TemporaryDirectory() as tmp:
        app_file = Path(tmp) / "long_app.py"
        app_file.write_text(APP_SOURCE.format(seconds=seconds))
        port = free_port()
        stack = DevStack(port=port, apps=[f"{app_file}:app"], out=lambda line: None)
        stack.start()
        try:
            assert stack.wired is not None
            handled: list[float] = []
            heartbeats = [0]
            lock = threading.Lock()

            def on_event(kind: str, payload: Any) -> None:
                if kind == "decided" and type(payload[0]).__name__ == "HeartbeatReported":
                    with lock:
                        heartbeats[0] += 1

            stack.wired.engine.hooks.append(on_event)
            original = stack._handle

            def timed(message: dict[str, Any], visible_for_s: float | None = None) -> None:
                started = time.monotonic()
                try:
                    original(message, visible_for_s)
                finally:
                    with lock:
                        handled.append(time.monotonic() - started)

            stack._handle = timed  # type: ignore[method-assign]
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
            started = time.monotonic()
            run_id = client.post("/v1/functions/encode-video/runs", json={"input": {}}).json()["id"]
            quick: list[float] = []
            view: dict[str, Any] = {}
            next_quick = started + 60
            while time.monotonic() - started < seconds + 900:
                view = client.get(f"/v1/runs/{run_id}").json()
                if view["phase"] == "finished":
                    break
                if time.monotonic() >= next_quick:
                    next_quick += 60
                    t0 = time.monotonic()
                    other = client.post("/v1/functions/quick/runs", json={"input": {}}).json()["id"]
                    while client.get(f"/v1/runs/{other}").json()["phase"] != "finished":
                        time.sleep(0.05)
                    quick.append(time.monotonic() - t0)
                time.sleep(1.0)
            wall = time.monotonic() - started
            encode = next(s for s in view["steps"] if s["id"] == "encode")
            print(f"run {run_id}: {view['phase']}, outcome {view.get('outcome')}, {wall / 60:.1f} minutes")
            print(f"encode: {[a['status'] for a in encode['attempts']]}; result {encode.get('result')}")
            print(f"heartbeats taken: {heartbeats[0]}")
            print(
                f"dispatch workers: {len(handled)} messages, longest {max(handled):.2f} s on one,"
                f" median {statistics.median(handled) * 1000:.0f} ms"
            )
            if quick:
                print(
                    f"quick runs meanwhile: {len(quick)}, median {statistics.median(quick):.2f} s,"
                    f" slowest {max(quick):.2f} s"
                )
            return 0 if view.get("outcome") == "completed" else 1
        finally:
            stack.stop()


if __name__ == "__main__":
    raise SystemExit(main())

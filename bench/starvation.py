"""One app's slow steps, another app's checkout: how long the checkout takes, unloaded and loaded (issue 25's
starvation scenario), on ``ryusen dev`` and in the stack in a box.

    PYTHONPATH=sdk:handlers:infra .venv/bin/python bench/starvation.py                    # both
    PYTHONPATH=sdk:handlers:infra .venv/bin/python bench/starvation.py --where box --slow-s 8

**The scenario.** App ``video`` starts ``--runs`` runs (10) whose one step's callback takes ``--slow-s`` seconds.
While those steps run, the example shop's checkout is started ``--samples`` times, one after another, each
timed from outside: from the start request until the run's view says it finished (polled every 20 ms). The
same checkouts are timed before, on the same stack with nothing else running. Printed: the medians, the slowest
loaded checkout (the first one waits behind whatever video holds; the median hides that) against the unloaded
median, and how many of video's runs were still running when the last loaded checkout ended (if none were, the
checkouts did not run beside video's steps, and the figure says nothing).

**Where, and how video is served.**

* ``ryusen dev``: both apps served by ``ryusen dev`` over HTTP, so video's attempts are acknowledged after
  0.1 s and hold no dispatch worker; then again with ``RYUSEN_ACKNOWLEDGE_AFTER_S=never``, where every
  attempt is waited for and each of video's slow steps holds a worker (its share is half the workers).
* the stack in a box (tests/infra), with four dispatch invocations at once on the shared queue (the template's
  default ``dispatch_concurrency``), synthesized with ``app_dispatch_concurrency={"video-own": 2}``; the shop is
  the example app (a Lambda taking attempts as events). Video is served three ways: over HTTP, acknowledging;
  as a Lambda answering inline on the shared queue; and as a Lambda answering inline with a queue of its own
  (``video-own``).

Wall times here are moto's and this machine's (two cores shared by everything), not AWS's: compare the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository: tests.infra

ORDER = {"sku": "lamp", "qty": 1, "card": "4242", "amount": 30}

VIDEO_SOURCE = """
import time
from datetime import timedelta

from ryusen import Ryusen, Step

app = Ryusen("video")


def encode(seconds: float) -> dict:
    time.sleep(seconds)
    return {"encoded_s": seconds}


@app.function("encode-video")
def encode_video(data: dict, step: Step) -> dict:
    return step.run("encode", encode, data["seconds"], timeout=timedelta(seconds=data["seconds"] + 60))
"""


def timed_checkouts(start: Callable[[], str], finished: Callable[[str], bool], samples: int) -> list[float]:
    times = []
    for _ in range(samples):
        began = time.monotonic()
        run_id = start()
        while not finished(run_id):
            time.sleep(0.02)
        times.append(time.monotonic() - began)
    return times


def line(label: str, unloaded: list[float], loaded: list[float], note: str = "") -> str:
    u, lo, worst = statistics.median(unloaded), statistics.median(loaded), max(loaded)
    return f"| {label} | {u:.2f} s | {lo:.2f} s | {worst:.2f} s | {worst / u:.1f}x | {note} |"


# ---- ryusen dev ------------------------------------------------------------------------------------------------


def on_dev(args: argparse.Namespace, acknowledge: bool) -> str:
    import httpx

    from ryusen_server.local.dev import DevStack, free_port

    env = {**os.environ}
    if not acknowledge:
        env["RYUSEN_ACKNOWLEDGE_AFTER_S"] = "never"
    with tempfile.TemporaryDirectory() as tmp:
        video = Path(tmp) / "video_app.py"
        video.write_text(VIDEO_SOURCE)
        port = free_port()
        apps = [f"{ROOT / 'examples' / 'shop.py'}:app", f"{video}:app"]
        stack = DevStack(port=port, apps=apps, out=lambda _: None, env=env, data=Path(tmp) / "data")
        stack.start()
        try:
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)

            def start() -> str:
                return str(client.post("/v1/functions/checkout/runs", json={"input": ORDER}).json()["id"])

            def finished(run_id: str) -> bool:
                return bool(client.get(f"/v1/runs/{run_id}").json()["phase"] == "finished")

            timed_checkouts(start, finished, 1)  # warm
            unloaded = timed_checkouts(start, finished, args.samples)
            videos = [
                client.post("/v1/functions/encode-video/runs", json={"input": {"seconds": args.slow_s}}).json()["id"]
                for _ in range(args.runs)
            ]
            time.sleep(1.0)  # video's steps begin
            loaded = timed_checkouts(start, finished, args.samples)
            still = sum(not finished(r) for r in videos)
            for run_id in videos:
                while not finished(run_id):
                    time.sleep(0.2)
        finally:
            stack.stop()
    how = "video acknowledged (no worker held)" if acknowledge else "video waited for (acknowledging off)"
    return line(f"ryusen dev, {how}", unloaded, loaded, f"{still} of {args.runs} video runs still running after")


# ---- the stack in a box ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def box() -> Iterator[Any]:
    from tests.infra import test_stack_in_a_box
    from tests.infra.conftest import synthesize

    with tempfile.TemporaryDirectory() as tmp:
        synthesized = synthesize(Path(tmp), app_dispatch_concurrency={"video-own": 2})
    fixture = contextlib.contextmanager(test_stack_in_a_box.deployed.__wrapped__)  # type: ignore[attr-defined]
    with fixture(synthesized) as deployed:
        yield deployed


def video_app(app_id: str, master: str) -> Any:
    from ryusen import Ryusen, Step
    from ryusen._internal.signing import app_key

    app = Ryusen(app_id, signing_key=app_key(master, app_id))  # its process's own replay memory: no events

    def encode(seconds: float) -> dict[str, Any]:
        time.sleep(seconds)
        return {"encoded_s": seconds}

    @app.function(f"{app_id}-encode")
    def encode_video(data: dict[str, Any], step: Step) -> Any:
        return step.run("encode", encode, data["seconds"], timeout=timedelta(seconds=data["seconds"] + 60))

    return app


def in_box(args: argparse.Namespace) -> list[str]:
    from werkzeug.serving import make_server

    from ryusen_server.lambdas import dispatch as dispatch_lambda

    lines = []
    with box() as deployed:

        def finished(run_id: str) -> bool:
            return bool(deployed.run(run_id)["phase"] == "finished")

        def start() -> str:
            return str(deployed.start(ORDER))

        timed_checkouts(start, finished, 1)  # warm
        unloaded = timed_checkouts(start, finished, args.samples)
        master = dispatch_lambda.engine().engine.master_keys()[0]
        for app_id, how in (
            ("video-http", "video over HTTP, acknowledged"),
            ("video-lambda", "video a Lambda answering inline, shared queue"),
            ("video-own", "video a Lambda answering inline, a queue of its own (2 dispatchers)"),
        ):
            app = video_app(app_id, master)
            if app_id == "video-http":
                server = make_server("127.0.0.1", 0, app.wsgi(), threaded=True)
                threading.Thread(target=server.serve_forever, daemon=True).start()
                deployed.box.servers.append(server)
                url = f"http://127.0.0.1:{server.server_port}/"
            else:
                url = deployed.box.function_url(app.lambda_handler, who="video")
            assert deployed.api("PUT", f"/v1/apps/{app_id}", {"url": url}).status_code == 200
            videos = []
            for _ in range(args.runs):
                response = deployed.api(
                    "POST", f"/v1/functions/{app_id}-encode/runs", {"input": {"seconds": args.slow_s}}
                )
                videos.append(response.json()["id"])
            time.sleep(1.0)
            loaded = timed_checkouts(start, finished, args.samples)
            still = sum(not finished(r) for r in videos)
            for run_id in videos:
                deployed.finished(run_id, timeout=args.runs * args.slow_s + 120)
            lines.append(line(f"stack in a box, {how}", unloaded, loaded, f"{still} of {args.runs} still running"))
    return lines


def main() -> int:
    import logging

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--where", default="dev,box", help="dev, box")
    parser.add_argument("--runs", type=int, default=10, help="video's runs")
    parser.add_argument("--slow-s", type=float, default=20.0, help="video's step, seconds")
    parser.add_argument("--samples", type=int, default=5, help="checkouts timed, unloaded and loaded")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    lines = []
    where = args.where.split(",")
    if "dev" in where:
        lines += [on_dev(args, acknowledge=True), on_dev(args, acknowledge=False)]
    if "box" in where:
        lines += in_box(args)
    print(f"\nvideo: {args.runs} runs of a {args.slow_s:g} s step; {args.samples} checkouts timed each way (medians)\n")
    print("| where, and how video is served | checkout unloaded | loaded | slowest loaded | slowest / unloaded | |")
    print("|---|---:|---:|---:|---:|---|")
    for each in lines:
        print(each)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Memory of kept passes: many interleaved runs with large step results, kept passes on and off.

    .venv/bin/python bench/kept_memory.py                       # 300 runs x 50 steps x 40 KB, kept on and off
    .venv/bin/python bench/kept_memory.py --runs 120 --modes kept
    .venv/bin/python bench/kept_memory.py --runs 40 --steps 20  # a short one
    .venv/bin/python bench/kept_memory.py --engine-memos all     # the engine remembers every memo it sent

Each mode runs in a process of its own (so that its peak RSS is its own), through ``ryusen.testing`` with
the engine in the same process: the runs are started together and every task goes through the queue, so
the runs' steps interleave one by one (the order that pushes a least-recently-used cache out first). Each
result is about ``--result-kb`` KB of JSON (rows of an order export). The process samples itself while the
runs go on and prints, per mode: the peak RSS (engine and endpoint together: the engine's store holds every
result too), the peak of what the endpoint's kept passes and memo cache held (their own accounting, in
bytes as Python objects), passes started and resumed, the most threads alive, and the wall time.
The engine remembers the memo it last sent each run for at most 256 runs and 64 MB (``SentMemos``); beyond
that its next request for a run carries the whole memo, which no kept pass can be resumed by (and the
endpoint's memo cache does not help). ``--engine-memos all`` lifts those two bounds, to show the endpoint's
own. Figures, not assertions: docs/performance.md records them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from typing import Any

MB = 1024 * 1024


def result_of(i: int, kb: int) -> dict[str, Any]:
    """About ``kb`` KB of JSON: rows of about 400 bytes."""
    rows = [{"id": f"{i}-{r}", "sku": f"SKU-{r:05d}", "qty": r % 7, "note": "n" * 340} for r in range(kb * 1024 // 400)]
    return {"step": i, "rows": rows}


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Sampler:
    """The peaks of what the endpoint holds, read every ``every_s`` seconds from a thread of its own."""

    def __init__(self, app: Any, every_s: float = 0.05) -> None:
        self.app = app
        self.every_s = every_s
        self.peaks: dict[str, int] = {"rss": 0, "kept_bytes": 0, "cache_bytes": 0, "kept": 0, "threads": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        kept = self.app.kept_passes
        now = {
            "rss": rss_bytes(),
            "kept_bytes": int(getattr(kept, "held_bytes", 0)),
            "cache_bytes": int(self.app.memo_cache.held_bytes),
            "kept": len(kept),
            "threads": threading.active_count(),
        }
        for name, value in now.items():
            self.peaks[name] = max(self.peaks[name], value)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def one_mode(kept: bool, runs: int, steps: int, kb: int, engine_memos_all: bool) -> dict[str, Any]:
    from ryusen import Ryusen, Step
    from ryusen.testing import WorkflowEnvironment
    from ryusen_server.core.events import EngineSettings

    app = Ryusen("export")

    @app.function("export")
    def export(data: dict[str, Any], step: Step) -> dict[str, Any]:
        rows = 0
        for i in range(data["steps"]):
            rows += len(step.run(f"page-{i}", result_of, i, data["kb"])["rows"])
        return {"rows": rows}

    started = time.perf_counter()
    with (
        WorkflowEnvironment(app, kept_passes=kept, settings=EngineSettings(max_steps=max(steps, 1000))) as env,
        Sampler(app) as sampler,
    ):
        if engine_memos_all:
            env.engine.sent_memos.capacity, env.engine.sent_memos.max_bytes = runs, 1 << 40
        ids = [env.start("export", {"steps": steps, "kb": kb}) for _ in range(runs)]
        env.drive(chain=False)  # every task through the queue: the runs' steps interleave
        outcomes = [env.get(run_id).outcome for run_id in ids]
    wall = time.perf_counter() - started
    assert outcomes == ["completed"] * runs, outcomes
    return {
        "mode": "kept passes" if kept else "replay every task",
        "peak_rss_mb": round(max(sampler.peaks["rss"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / MB),
        "kept_bytes_mb": round(sampler.peaks["kept_bytes"] / MB, 1),
        "cache_bytes_mb": round(sampler.peaks["cache_bytes"] / MB, 1),
        "most_kept": sampler.peaks["kept"],
        "most_threads": sampler.peaks["threads"],
        "started": app.kept_passes.started,
        "resumed": app.kept_passes.resumed,
        "budget_mb": round(getattr(app.kept_passes, "max_bytes", 0) / MB, 1),
        "wall_s": round(wall, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--result-kb", type=int, default=40)
    parser.add_argument("--modes", default="kept,replay", help="kept, replay, or both (comma-separated)")
    parser.add_argument("--engine-memos", choices=["default", "all"], default="default")
    parser.add_argument("--child", choices=["kept", "replay"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        engine_all = args.engine_memos == "all"
        print(json.dumps(one_mode(args.child == "kept", args.runs, args.steps, args.result_kb, engine_all)))
        return 0
    print(
        f"{args.runs} interleaved runs x {args.steps} steps x {args.result_kb} KB results"
        f" (the engine remembers {'every memo it sent' if args.engine_memos == 'all' else 'its default'})"
    )
    for mode in args.modes.split(","):
        command = [sys.executable, __file__, "--child", mode, "--runs", str(args.runs), "--steps", str(args.steps)]
        command += ["--result-kb", str(args.result_kb), "--engine-memos", args.engine_memos]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
            return 1
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"{figures['mode']:>18}: peak RSS {figures['peak_rss_mb']:,} MB | held by kept passes (peak)"
            f" {figures['kept_bytes_mb']} MB of {figures['budget_mb']} MB, memo cache {figures['cache_bytes_mb']} MB"
            f" | kept at most {figures['most_kept']}, threads at most {figures['most_threads']}"
            f" | passes started {figures['started']:,}, resumed {figures['resumed']:,} | {figures['wall_s']} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

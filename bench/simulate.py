"""The whole server under deterministic fault simulation, for many seeds (issue 12; docs/testing.md).

    .venv/bin/python bench/simulate.py --seeds 10000            # seeds 0..9999, on every core
    .venv/bin/python bench/simulate.py --seeds 500 --first 20000
    .venv/bin/python bench/simulate.py --seed 349 --trace       # replay one seed and print its whole trace
    .venv/bin/python bench/simulate.py --seed 2275 --trace --before-dispatch   # as it ran before issue 25

Prints seeds, scheduling events, runs by how they ended, faults injected by kind, callback executions, how
often each case of decisions 23-29 came up (callbacks that opened a step, results over the limit, guards that
ended passes, skips by reason, operator resolutions, blockers, timeouts), the new dispatch path's (attempts
answered accepted, outcomes posted, retried, settling an Unknown, ``next`` used, heartbeats, stops seen by
callbacks), and violations (each with its seed,
and the command that replays it). Figures, not assertions: the CI test
(tests/conformance/test_simulation.py) asserts on a fixed number of seeds.

Python randomizes string hashing per process; the bench fixes ``PYTHONHASHSEED`` so that a seed replays
exactly in any process.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _setup() -> None:
    for path in (ROOT, ROOT / "sdk", ROOT / "handlers"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    logging.disable(logging.CRITICAL)  # the engine logs every injected failure; the trace tells them


def run_block(seeds: list[int], new_dispatch: bool = True) -> dict[str, Any]:
    _setup()
    from tests.simulation.world import Simulation

    out: dict[str, Any] = {"seeds": 0, "events": 0, "effects": 0, "faults": Counter(), "outcomes": Counter()}
    out["cases"] = Counter()
    out["violations"] = []
    out["clean"] = 0
    for seed in seeds:
        report = Simulation(seed, new_dispatch=new_dispatch).run()
        out["seeds"] += 1
        out["events"] += report.events
        out["effects"] += report.effects
        out["faults"].update(report.faults)
        out["outcomes"].update(report.outcomes)
        out["cases"].update(report.cases)
        out["clean"] += report.profile.is_clean
        if report.violations:
            out["violations"].append((seed, report.violations[0]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=1000, help="how many seeds (default 1000)")
    parser.add_argument("--first", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--seed", type=int, help="replay this one seed")
    parser.add_argument("--trace", action="store_true", help="with --seed: print the whole trace")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--before-dispatch",
        action="store_true",
        help="run seeds as before issue 25's dispatch path (no acknowledging release, no heartbeats)",
    )
    args = parser.parse_args()
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    _setup()
    if args.seed is not None:
        from tests.simulation.world import Simulation

        report = Simulation(args.seed, new_dispatch=not args.before_dispatch).run()
        print(report.trace_text(len(report.trace)) if args.trace else report.trace_text(60))
        print(f"\nseed {args.seed}: {report.events} events, faults {dict(report.faults)}, runs {dict(report.outcomes)}")
        print(f"decisions 23-29: {dict(report.cases)}")
        print("violations:", *(report.violations or ["none"]), sep="\n  ")
        return 1 if report.violations else 0
    seeds = list(range(args.first, args.first + args.seeds))
    blocks = [seeds[i :: args.workers * 8] for i in range(args.workers * 8)]
    started = time.monotonic()
    total: dict[str, Any] = {"seeds": 0, "events": 0, "effects": 0, "clean": 0}
    faults: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    cases: Counter[str] = Counter()
    violations: list[tuple[int, str]] = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        new_dispatch = [not args.before_dispatch] * len(blocks)
        for result in pool.map(run_block, [b for b in blocks if b], new_dispatch):
            for key in total:
                total[key] += result[key]
            faults.update(result["faults"])
            outcomes.update(result["outcomes"])
            cases.update(result["cases"])
            violations.extend(result["violations"])
    elapsed = time.monotonic() - started
    print(f"seeds {total['seeds']} ({args.first}..{args.first + args.seeds - 1}), {total['clean']} of them fault-free")
    print(f"scheduling events {total['events']:,}; callback executions {total['effects']:,}")
    print(f"faults injected {sum(faults.values()):,}:")
    for kind, count in sorted(faults.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:20s} {count:8,}")
    print("runs by how they ended:")
    for kind, count in sorted(outcomes.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:34s} {count:8,}")
    print("decisions 23-29 and the dispatch path (issue 25, decision 33), how often each case came up:")
    for kind, count in sorted(cases.items()):
        print(f"  {kind:48s} {count:8,}")
    print(f"violations {len(violations)}")
    for seed, text in sorted(violations)[:20]:
        print(f"  seed {seed}: {text.splitlines()[0][:200]}")
        print(f"    replay: .venv/bin/python bench/simulate.py --seed {seed} --trace")
    per_seed_ms = elapsed / max(1, total["seeds"]) * 1000
    print(f"wall time {elapsed:.0f} s on {args.workers} processes ({per_seed_ms:.0f} ms per seed)")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())

"""What kept passes may hold: a bound in bytes, within the memo cache's budget, and no thrash.

A waiting pass holds its run's memo (the recorded results its function was handed) until the run's next
attempt. Those memos are the ones the endpoint's memo cache holds for the same runs, so a pass keeps its
run's memo in the cache while it waits, and the passes together hold no more than their share of the
cache's budget. When the budget or the count of passes is full, a pass already kept keeps its place: a new
run's attempt replays from the top instead of pushing another run's pass out, and a pass that no longer
fits ends for good, so that passes never push each other out in turn (issue 23: more than 256 interleaved
runs resumed none and started 15,000 pass threads; 120 runs of 50 steps with 40 KB results held 1.18 GB).
bench/kept_memory.py measures it.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from ryusen import Ryusen, Step
from ryusen._internal.memo_cache import footprint
from ryusen._internal.wire import MemoEntry
from ryusen.testing import WorkflowEnvironment

KB = 1024


def pages_app(ran: Counter[str], name: str = "pages") -> Ryusen:
    """``export``: ``data["steps"]`` steps, each returning about ``data["kb"]`` KB; the output counts rows."""
    app = Ryusen(name)

    def page(i: int, kb: int) -> dict[str, Any]:
        ran[f"page-{i}"] += 1
        return {"rows": [{"n": i, "text": "x" * 200} for _ in range(kb * KB // 220)]}

    @app.function("export")
    def export(data: Any, step: Step) -> Any:
        return sum(len(step.run(f"page-{i}", page, i, data["kb"])["rows"]) for i in range(data["steps"]))

    return app


def interleave(env: WorkflowEnvironment, app: Ryusen, runs: int, data: dict[str, Any]) -> list[int]:
    """Start ``runs`` runs together and deliver their tasks one at a time (the runs' steps interleave); after
    every delivery, the bytes the kept passes hold. Checks that every run completed."""
    ids = [env.start("export", data) for _ in range(runs)]
    held: list[int] = []
    env._chain = False  # as drive(chain=False): every task through the queue
    for _ in range(100_000):
        if not env.step_once():
            due = env.next_due()
            if due is None:
                break
            env.clock.advance_to(due)
        held.append(app.kept_passes.held_bytes)
    env._chain = True
    assert [env.get(i).outcome for i in ids] == ["completed"] * runs
    return held


def test_kept_passes_hold_no_more_than_their_share_of_the_memo_cache_s_budget() -> None:
    ran: Counter[str] = Counter()
    app = pages_app(ran)
    app.memo_cache.max_bytes = 2 * 1024 * KB
    app.kept_passes.max_bytes = 1024 * KB
    with WorkflowEnvironment(app, kept_passes=True) as env:
        held = interleave(env, app, 12, {"steps": 8, "kb": 8})
    assert max(held) <= app.kept_passes.max_bytes
    assert max(held) >= app.kept_passes.max_bytes // 2  # the budget was used, not left empty
    assert app.kept_passes.resumed >= 12  # passes were kept and resumed within it
    assert ran == Counter({f"page-{i}": 12 for i in range(8)})  # each step's callback once per run
    assert app.kept_passes.held_bytes == 0 and app.memo_cache.pinned_bytes == 0  # every pass ended


def test_what_a_waiting_pass_holds_is_its_run_s_memo_in_the_cache_and_the_result_it_reported() -> None:
    ran: Counter[str] = Counter()
    app = pages_app(ran)
    with WorkflowEnvironment(app, kept_passes=True) as env:
        run_id = env.start("export", {"steps": 3, "kb": 4})
        env.drive(until=lambda: len(app.kept_passes) == 1 and ran["page-1"] == 1)
        [(token, memo)] = [(t, m) for t, m in app.memo_cache.pinned().items()]
        size = app.memo_cache.size_of(token)
        assert size is not None and set(memo) == {"page-0"}  # the memo page-1's attempt was sent
        page_1 = env.store.peek(run_id).memo_entries()["page-1"]  # type: ignore[union-attr]
        # the result as the SDK checked it (parsed from its own JSON): what the pass reported and holds
        reported = footprint(MemoEntry(status="completed", result=json.loads(json.dumps(page_1["result"]))))
        assert app.kept_passes.held_bytes == app.memo_cache.pinned_bytes == size + reported
        assert env.wait(run_id).outcome == "completed"
    assert app.kept_passes.held_bytes == 0


def test_more_interleaved_runs_than_kept_passes_do_not_thrash() -> None:
    """Capacity 4 and 10 runs whose steps interleave: four runs keep their passes to the end and the others
    replay from the top (a least-recently-used policy pushed every pass out before its next attempt: no pass
    resumed, a new one started for every attempt)."""
    ran: Counter[str] = Counter()
    app = pages_app(ran)
    app.kept_passes.capacity = 4
    with WorkflowEnvironment(app, kept_passes=True) as env:
        interleave(env, app, 10, {"steps": 6, "kb": 1})
    assert app.kept_passes.resumed >= 4 * 5
    assert app.kept_passes.started <= 10
    assert ran == Counter({f"page-{i}": 10 for i in range(6)})


def test_a_run_whose_passes_are_never_resumed_gets_no_new_ones() -> None:
    """The engine keeps no memo it sent (a new process each time, say): every request carries the whole memo,
    so no pass can be resumed. After two passes that served one attempt each, the run replays from the top
    (it started a pass for every attempt)."""
    ran: Counter[str] = Counter()
    app = pages_app(ran)
    with WorkflowEnvironment(app, kept_passes=True) as env:
        env.engine.sent_memos.capacity = 0
        run = env.run("export", {"steps": 8, "kb": 1})
    assert run.outcome == "completed" and ran == Counter({f"page-{i}": 1 for i in range(8)})
    assert app.kept_passes.resumed == 0 and app.kept_passes.started == 2

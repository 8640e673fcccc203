"""Every group over real HTTP: `ryusen dev` (moto server, dispatch loop, scheduler loop) and the SDK on loopback."""

from __future__ import annotations

import itertools
import signal
import subprocess
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.stack import DevStack, launch, wait_for


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    yield from launch(tmp_path_factory.mktemp("dev"))


def tag() -> str:
    return uuid.uuid4().hex[:8]


@pytest.mark.rfd("F1", "F2", "F11", "R2")
def test_straight_run_memoizes_each_step_over_http(stack: DevStack) -> None:
    t = tag()
    started = stack.start("straight", {"tag": t})
    assert started["phase"] == "running" and started["outcome"] is None
    run = stack.wait_finished(started["id"])
    assert run["outcome"] == "completed" and run["recovery"] is None
    assert set(run["output"]) == {"a", "b", "c"}
    assert [stack.invocations(f"{t}:{n}") for n in "abc"] == [1, 1, 1]
    release = stack.functions()["straight"]["release"]["release_id"]
    for step in run["steps"]:
        [attempt] = step["attempts"]
        assert attempt["release_id"] == release and attempt["build_id"]
        assert attempt["authorized_at"] and attempt["settled_at"]


@pytest.mark.rfd("F4", "F5", "F6", "C9")
def test_retries_then_handled_failure_over_http(stack: DevStack) -> None:
    t = tag()
    recovered = stack.wait_finished(stack.start("handled", {"tag": t, "attempts": 3, "failures": 2})["id"])
    assert recovered["output"] == "recovered"
    assert [a["status"] for a in recovered["steps"][0]["attempts"]] == ["failed", "failed", "succeeded"]
    t2 = tag()
    handled = stack.wait_finished(stack.start("handled", {"tag": t2, "attempts": 2, "failures": 5})["id"])
    assert handled["outcome"] == "completed" and handled["output"] == {"handled": "ConnectionError"}
    assert stack.invocations(f"{t2}:flaky") == 2
    assert stack.invocations(f"{t2}:undo-flaky") == 0
    assert handled["steps"][0]["status"] == "failed" and handled["unwind"] == []


def test_sub_second_retry_delays_are_not_rounded_up_to_whole_seconds_over_http(stack: DevStack) -> None:
    """The policy asks 0.05-0.1 s, 0.1-0.2 s, then 0.2-0.4 s before the retries (issue 23: SQS's whole-second
    DelaySeconds made them 2, 2 and 2 s on ``ryusen dev``). Asserted on the recorded attempt times."""
    t = tag()
    run = stack.wait_finished(stack.start("handled", {"tag": t, "attempts": 4, "failures": 3})["id"])
    attempts = run["steps"][0]["attempts"]
    assert [a["status"] for a in attempts] == ["failed", "failed", "failed", "succeeded"]
    for failed, retry in itertools.pairwise(attempts):
        settled, due = datetime.fromisoformat(failed["settled_at"]), datetime.fromisoformat(retry["not_before"])
        started = datetime.fromisoformat(retry["authorized_at"])
        assert timedelta(0) < due - settled <= timedelta(seconds=0.4)  # the policy's delay, as decided
        assert started >= due  # never early
        gap = started - settled
        assert gap < timedelta(seconds=1.0), f"retry #{retry['generation']} began {gap} after the failure"


@pytest.mark.rfd("C1", "C3", "F7")
def test_uncaught_failure_compensates_in_reverse_over_http(stack: DevStack) -> None:
    t = tag()
    run = stack.wait_finished(stack.start("saga", {"tag": t})["id"])
    assert run["outcome"] == "failed" and run["recovery"] == "compensated"
    assert run["summary"] == "failed, fully compensated"
    assert [u["step_id"] for u in run["unwind"]] == ["ship", "charge", "reserve"]
    assert [stack.invocations(f"{t}:undo-{n}") for n in ("ship", "charge", "reserve")] == [1, 1, 1]
    ship = next(s for s in run["steps"] if s["id"] == "ship")
    assert ship["compensation"]["result"]["undone"] == "ship"
    comp_op = ship["compensation"]["result"]["op"]
    assert comp_op == ship["attempts"][-1]["operation_id"] != ship["attempts"][0]["operation_id"]


@pytest.mark.rfd("D1", "D2", "D3", "D5", "R1", "R3")
def test_duplicate_id_blocks_and_a_saved_fix_repairs_the_run(stack: DevStack) -> None:
    t = tag()
    run_id = stack.start("dup", {"tag": t})["id"]
    blocked = wait_for(lambda: (r := stack.run(run_id))["blockers"] and r, what="duplicate_step_id blocker")
    [blocker] = blocked["blockers"]
    assert blocker["type"] == "duplicate_step_id" and blocker["step_id"] == "charge"
    assert blocker["first"]["location"].startswith("http_app.py:") and blocker["first"]["name"] == "charge amount"
    assert blocker["duplicate"]["name"] == "charge fee"
    assert blocked["outcome"] is None and blocked["phase"] == "running"
    assert stack.invocations(f"{t}:fee") == 0
    old_release = stack.functions()["dup"]["release"]["release_id"]
    # the developer renames the second id and saves: ryusen dev reloads, syncs, and the run wakes
    source = stack.app_file.read_text()
    fixed = source.replace('step.run("charge", effect, "fee"', 'step.run("charge-fee", effect, "fee"')
    stack.app_file.write_text(fixed.replace('VARIANT = "a"', 'VARIANT = "b"'))
    run = stack.wait_finished(run_id, timeout=120)
    assert run["outcome"] == "completed" and run["output"] == ["charge", "fee", "b"]
    assert stack.invocations(f"{t}:charge") == 1 and stack.invocations(f"{t}:fee") == 1
    new_release = stack.functions()["dup"]["release"]["release_id"]
    assert new_release != old_release
    steps = {s["id"]: s for s in run["steps"]}
    assert steps["charge"]["attempts"][0]["release_id"] == old_release
    assert steps["charge-fee"]["attempts"][0]["release_id"] == new_release


@pytest.mark.rfd("O2")
def test_app_endpoint_refuses_unsigned_requests_over_http(stack: DevStack) -> None:
    url = stack.functions()["straight"]["release"]["url"]
    manifest = httpx.get(url).json()
    assert manifest["app_id"] == "conformance" and manifest["signed"] is True
    body = b'{"kind": "discover", "run_id": "r", "function_id": "straight", "input": {"tag": "x"}}'
    unsigned = httpx.post(url, content=body)
    assert unsigned.status_code == 401 and unsigned.json()["error"]["code"] == "invalid_signature"
    forged = httpx.post(url, content=body, headers={"X-Ryusen-Signature": "t=1,v1=00"})
    assert forged.status_code == 401


@pytest.mark.rfd("O3")
def test_bad_requests_over_http_change_nothing(stack: DevStack) -> None:
    client = stack.client
    before = client.get("/v1/runs", params={"limit": 200}).json()["runs"]
    cases: list[tuple[str, str, Any, int, str]] = [
        ("POST", "/v1/functions/no-such-fn/runs", {"input": 1}, 404, "not_found"),
        ("GET", "/v1/runs/run_nope", None, 404, "not_found"),
        ("POST", "/v1/functions/straight/runs", b"{broken", 400, "malformed_json"),
        ("POST", "/v1/functions/straight/runs", {"input": {}, "timeout_s": "x"}, 422, "invalid_request"),
        ("POST", "/v1/functions/straight/runs", {"input": "x" * 300_000}, 413, "payload_too_large"),
        ("POST", "/v1/runs/run_nope/cancel", None, 404, "not_found"),
    ]
    for method, path, body, status, code in cases:
        if isinstance(body, bytes):
            response = client.request(method, path, content=body, headers={"content-type": "application/json"})
        else:
            response = client.request(method, path, json=body)
        assert response.status_code == status, (path, response.text)
        assert response.json()["error"]["code"] == code
    after = client.get("/v1/runs", params={"limit": 200}).json()["runs"]
    assert [(r["id"], r["phase"]) for r in after] == [(r["id"], r["phase"]) for r in before]


def test_ryusen_dev_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    gen = launch(tmp_path)
    stack = next(gen)
    stack.process.send_signal(signal.SIGINT)
    try:
        code = stack.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("ryusen dev did not stop within 30 s of Ctrl-C")
    assert code == 0
    assert "stopping" in stack.output.read_text()
    with pytest.raises(httpx.ConnectError):
        httpx.get(stack.url + "/v1/functions", timeout=2)
    gen.close()


@pytest.mark.rfd("U1", "U2", "O1")
def test_callback_that_outlives_its_attempt_timeout_is_unknown_then_its_late_result_lands(stack: DevStack) -> None:
    t = tag()
    # The endpoint answers "accepted" after 0.1 s and posts the outcome when the callback ends (issue 25): no
    # dispatcher waits. The attempt's lease ends its timeout (1 s) plus the acknowledged grace (3 s) after its
    # authorization; the callback takes 8 s.
    run_id = stack.start("slow", {"tag": t, "sleep_s": 8, "timeout_s": 1})["id"]
    unknown = wait_for(
        lambda: (r := stack.run(run_id))["blockers"] and r, what="the attempt to become Unknown", timeout=60
    )
    slow_step = next(s for s in unknown["steps"] if s["id"] == "slow")
    [blocker] = unknown["blockers"]
    assert slow_step["status"] == "unknown" and blocker["type"] == "unknown_outcome"
    [unknown_attempt] = slow_step["attempts"]
    assert unknown_attempt["detail"] == "no result within the attempt's timeout of 1s (+3s grace): its lease expired"
    # recorded times: Unknown no sooner than the lease's end, and within 1.5 s of slack after it
    waited = datetime.fromisoformat(blocker["first_seen_at"]) - datetime.fromisoformat(unknown_attempt["authorized_at"])
    assert timedelta(seconds=1 + 3) <= waited < timedelta(seconds=1 + 3 + 1.5)
    # the SDK finishes the callback and submits the signed result to the server's result endpoint
    run = stack.wait_finished(run_id, timeout=60)
    assert run["outcome"] == "completed" and run["output"]["slept"] == 8
    assert stack.invocations(f"{t}:slow-start") == 1  # never retried
    [attempt] = next(s for s in run["steps"] if s["id"] == "slow")["attempts"]
    assert attempt["status"] == "succeeded" and attempt["settled_at"]
    assert attempt["unknown"]["reason"]  # it was not known for a while (decisions 28)


def test_long_callbacks_hold_no_dispatcher_so_another_run_goes_past_them_over_http(stack: DevStack) -> None:
    """Issue 25: the endpoint answers "accepted" and no dispatcher waits through a callback. Ten runs whose
    middle step takes 4 s (more than the stack's 8 dispatch workers) do not hold up a run started after them:
    it completes before any of their long callbacks has ended. Each long step's outcome, posted with what the
    replay found next, is its result (never Unknown), and each run goes on from it."""
    tags = [tag() for _ in range(10)]
    slow_runs = [stack.start("slow", {"tag": t, "sleep_s": 4, "timeout_s": 30})["id"] for t in tags]
    wait_for(lambda: sum(stack.invocations(f"{t}:slow-start") for t in tags) == 10, what="every long step to start")
    quick = stack.wait_finished(stack.start("straight", {"tag": tag()})["id"])
    assert quick["outcome"] == "completed"
    finished_quick = max(datetime.fromisoformat(s["attempts"][-1]["settled_at"]) for s in quick["steps"])
    for run_id, t in zip(slow_runs, tags, strict=True):
        run = stack.wait_finished(run_id, timeout=60)
        assert run["outcome"] == "completed" and run["output"]["slept"] == 4
        [attempt] = next(s for s in run["steps"] if s["id"] == "slow")["attempts"]
        assert attempt["status"] == "succeeded" and attempt["unknown"] is None
        assert datetime.fromisoformat(attempt["settled_at"]) > finished_quick  # the quick run did not wait
        assert stack.invocations(f"{t}:slow-start") == 1 and stack.invocations(f"{t}:after") == 1


@pytest.mark.rfd("S2", "S5", "S13")
def test_cancel_while_an_effect_is_in_flight_over_http(stack: DevStack) -> None:
    t = tag()
    run_id = stack.start("slow", {"tag": t, "sleep_s": 2})["id"]
    wait_for(lambda: stack.invocations(f"{t}:slow-start") == 1, what="the slow callback to start")
    response = stack.client.post(f"/v1/runs/{run_id}/cancel", json={"reason": "customer asked"})
    assert response.status_code == 202
    ack = response.json()
    assert ack["stop_intent"]["kind"] == "cancel" and ack["outcome"] == "cancelled"
    assert ack["phase"] == "settling"  # the in-flight effect has not been claimed stopped
    run = stack.wait_finished(run_id)
    assert run["summary"] == "cancelled, fully compensated"
    assert [u["step_id"] for u in run["unwind"]] == ["slow", "first"]
    assert stack.invocations(f"{t}:after") == 0
    assert stack.invocations(f"{t}:undo-slow") == 1 and stack.invocations(f"{t}:undo-first") == 1


@pytest.mark.rfd("S11", "S12", "S13")
def test_run_deadline_fires_through_the_local_scheduler_and_compensates(stack: DevStack) -> None:
    t = tag()
    started = stack.start("slow", {"tag": t, "sleep_s": 3}, timeout_s=1.5)
    assert started["deadline"]["source"] == "run_request" and started["deadline"]["at"]
    run = stack.wait_finished(started["id"])
    assert run["outcome"] == "timed_out" and run["stop_intent"]["kind"] == "timeout"
    assert run["summary"] == "timed out, fully compensated"  # the in-flight step settled, then both were undone
    assert stack.invocations(f"{t}:after") == 0
    assert stack.invocations(f"{t}:undo-slow") == 1 and stack.invocations(f"{t}:undo-first") == 1


@pytest.mark.rfd("F2", "U1")
def test_a_finally_that_raises_after_the_callback_does_not_run_it_again_over_http(stack: DevStack) -> None:
    t = tag()
    run = stack.wait_finished(stack.start("metrics", {"tag": t})["id"])
    assert stack.invocations(f"{t}:charge") == 1
    assert run["outcome"] == "completed" and run["output"]["step"] == "charge"
    [attempt] = run["steps"][0]["attempts"]
    assert attempt["status"] == "succeeded"


@pytest.mark.rfd("C2", "C4")
def test_an_exception_outside_step_run_during_compensation_is_retried_not_skipped_over_http(stack: DevStack) -> None:
    t = tag()
    run = stack.wait_finished(stack.start("config_trip", {"tag": t})["id"])
    assert run["summary"] == "failed, fully compensated"
    assert stack.invocations(f"{t}:undo-hotel") == 1 and stack.invocations(f"{t}:undo-flight") == 1
    hotel = next(s for s in run["steps"] if s["id"] == "hotel")
    compensation = [a for a in hotel["attempts"] if a["phase"] == "compensation"]
    assert [a["status"] for a in compensation] == ["failed", "succeeded"]
    assert compensation[0]["error"]["type"] == "TimeoutError"


@pytest.mark.rfd("C2", "U3", "U5")
def test_a_new_step_before_the_target_blocks_the_unwind_until_an_operator_resolves_over_http(
    stack: DevStack,
) -> None:
    t = tag()
    run_id = stack.start("audited", {"tag": t})["id"]
    blocked = wait_for(
        lambda: (r := stack.run(run_id))["blockers"] and r, what="the new_step_before_target blocker", timeout=60
    )
    [blocker] = blocked["blockers"]
    assert blocker["type"] == "new_step_before_target" and blocker["step_id"] == "book"
    assert blocker["first"]["step_id"] == "audit" and blocker["first"]["location"].startswith("http_app.py:")
    assert blocker["second"]["location"].startswith("http_app.py:") and blocker["remedy"]
    assert blocked["phase"] == "compensating" and "compensated" not in blocked["summary"]
    assert stack.invocations(f"{t}:undo-book") == 0 and stack.invocations(f"{t}:audit") == 0
    path = f"/v1/runs/{run_id}/steps/book/compensation/{blocker['generation']}/resolve"
    response = stack.client.post(path, json={"action": "succeed", "result": {"undone": "by hand"}})
    assert response.status_code == 200, response.text
    run = stack.wait_finished(run_id)
    assert run["summary"] == "failed, fully compensated"
    book = next(s for s in run["steps"] if s["id"] == "book")
    assert book["compensation"]["result"] == {"undone": "by hand"}
    assert stack.invocations(f"{t}:undo-book") == 0 and stack.invocations(f"{t}:audit") == 0


@pytest.mark.rfd("U1", "U10", "U3")
def test_on_unknown_retry_with_no_retry_left_stays_unknown_over_http(stack: DevStack) -> None:
    t = tag()
    run_id = stack.start("crashes", {"tag": t})["id"]
    blocked = wait_for(
        lambda: (r := stack.run(run_id))["blockers"] and r, what="the second Unknown to block", timeout=120
    )
    step = blocked["steps"][0]
    assert [a["status"] for a in step["attempts"]] == ["failed", "unknown"]
    assert step["attempts"][0]["error"]["type"] == "unknown_outcome"
    assert step["status"] == "unknown" and blocked["outcome"] is None
    [blocker] = blocked["blockers"]
    assert blocker["type"] == "unknown_outcome" and blocker["generation"] == 2
    assert stack.invocations(f"{t}:crash") == 2
    # the operator checks the external system and declares the outcome
    path = f"/v1/runs/{run_id}/steps/crash/forward/2/resolve"
    assert stack.client.post(path, json={"action": "succeed", "result": {"checked": True}}).status_code == 200
    run = stack.wait_finished(run_id)
    assert run["outcome"] == "completed" and run["output"] == {"checked": True}
    assert stack.invocations(f"{t}:crash") == 2


# ---- issue 23 findings 1-4 (decisions 23-26) over HTTP -----------------------------------------------------


@pytest.mark.rfd("D8")
def test_a_step_opened_inside_a_callback_blocks_without_charging_again_over_http(stack: DevStack) -> None:
    t = tag()
    run_id = stack.start("nested", {"tag": t})["id"]
    run = wait_for(lambda: (r := stack.run(run_id))["blockers"] and r, what="the nested-step blocker")
    [blocker] = run["blockers"]
    assert blocker["type"] == "concurrent_step"
    assert (blocker["first"]["step_id"], blocker["second"]["step_id"]) == ("charge", "email-receipt")
    assert run["outcome"] is None and run["steps"][0]["attempts"][0]["error"]["type"] == "concurrent_step"
    # the probe (every 2-4 s on this stack) asks the same build again: nothing runs twice
    wait_for(lambda: stack.run(run_id)["blockers"][0]["count"] >= 2, what="a probe of the same build")
    assert stack.invocations(f"{t}:charge") == 1 and stack.invocations(f"{t}:email-receipt") == 0
    assert stack.invocations(f"{t}:undo-charge") == 0


@pytest.mark.rfd("C10")
def test_a_guard_that_ends_the_compensation_pass_blocks_instead_of_skipping_over_http(stack: DevStack) -> None:
    t = tag()
    run_id = stack.start("guarded", {"tag": t, "sleep_s": 1.5})["id"]
    wait_for(lambda: stack.invocations(f"{t}:slow-start"), what="the shipment to start")
    with stack.log_file.open("a") as log:
        log.write(f"{t}:order-cancelled\n")  # the shop marks the order cancelled, then cancels the run
    assert stack.client.post(f"/v1/runs/{run_id}/cancel").status_code == 202
    run = wait_for(
        lambda: (r := stack.run(run_id))["blockers"] and r["phase"] == "compensating" and r,
        what="the unwind to block",
    )
    assert [b["type"] for b in run["blockers"]] == ["compensation_target_not_reached"]
    assert run["recovery"] == "compensating" and "fully compensated" not in run["summary"]
    assert stack.invocations(f"{t}:undo-ship") == 0 and stack.invocations(f"{t}:undo-charge") == 0
    # the guard's read changes back: a rediscover reaches the steps, and both are undone
    lines = [line for line in stack.log_file.read_text().splitlines() if line != f"{t}:order-cancelled"]
    stack.log_file.write_text("".join(f"{line}\n" for line in lines))
    assert stack.client.post(f"/v1/runs/{run_id}/rediscover").status_code == 202
    run = stack.wait_finished(run_id)
    assert run["summary"] == "cancelled, fully compensated"
    assert stack.invocations(f"{t}:undo-ship") == 1 and stack.invocations(f"{t}:undo-charge") == 1


@pytest.mark.rfd("F13")
def test_a_result_over_the_limit_blocks_then_is_undone_with_an_omitted_result_over_http(stack: DevStack) -> None:
    t = tag()
    run_id = stack.start("oversized", {"tag": t})["id"]
    run = wait_for(lambda: (r := stack.run(run_id))["blockers"] and r, what="the result_too_large blocker")
    [blocker] = run["blockers"]
    assert blocker["type"] == "result_too_large" and blocker["size"] > 300_000
    assert run["steps"][0]["attempts"][0]["status"] == "succeeded" and run["outcome"] is None
    assert stack.client.post(f"/v1/runs/{run_id}/cancel").status_code == 202
    run = stack.wait_finished(run_id)
    assert run["summary"] == "cancelled, fully compensated"
    size = run["steps"][0]["omitted_result"]["size"]
    assert stack.invocations(f"{t}:charge") == 1
    assert stack.invocations(f"{t}:undo-charge:OmittedResult:{size}") == 1


@pytest.mark.rfd("S14")
def test_no_step_starts_after_the_deadline_over_http(stack: DevStack) -> None:
    t = tag()
    run_id = stack.start("slow", {"tag": t, "sleep_s": 2.5}, timeout_s=2)["id"]
    run = stack.wait_finished(run_id)
    assert run["outcome"] == "timed_out" and run["summary"] == "timed out, fully compensated"
    assert stack.invocations(f"{t}:after") == 0  # never authorized: the slow step ended after the deadline
    deadline = datetime.fromisoformat(run["deadline"]["at"])
    for step in run["steps"]:
        for attempt in step["attempts"]:
            if attempt["phase"] == "forward" and attempt["authorized_at"]:
                assert datetime.fromisoformat(attempt["authorized_at"]) < deadline


# ---- decision 33: long steps and heartbeats (issue 25) -------------------------------------------------------


@pytest.mark.rfd("H1")
def test_a_step_longer_than_its_heartbeat_completes_while_it_heartbeats_over_http(stack: DevStack) -> None:
    """The callback takes about 8 s; its heartbeat interval is 2 s and the acknowledged grace 3 s, so its lease
    would end after 5 s: only the heartbeats keep it in flight. No dispatcher waits meanwhile."""
    t = tag()
    run_id = stack.start("beating", {"tag": t, "beats": 16, "every_s": 0.5, "heartbeat_s": 2})["id"]
    wait_for(
        lambda: any(a["heartbeat"] for s in stack.run(run_id)["steps"] if s["id"] == "encode" for a in s["attempts"]),
        what="the first heartbeat to be shown on the attempt",
    )
    run = stack.wait_finished(run_id, timeout=60)
    assert run["outcome"] == "completed" and run["output"] == {"beats": 16}
    [attempt] = next(s for s in run["steps"] if s["id"] == "encode")["attempts"]
    assert attempt["status"] == "succeeded" and attempt["unknown"] is None
    assert attempt["heartbeat"]["details"]["progress"] > 0.5  # the last heartbeat's details are kept
    assert stack.invocations(f"{t}:encode-start") == 1 and stack.invocations(f"{t}:after") == 1


@pytest.mark.rfd("H2")
def test_a_step_whose_heartbeats_stop_is_unknown_long_before_its_timeout_over_http(stack: DevStack) -> None:
    """Two heartbeats, then 15 s of silence, with a heartbeat of 2 s and a timeout of 120 s: Unknown within
    the heartbeat plus the grace of the last heartbeat; the outcome that comes later settles it (U2)."""
    t = tag()
    payload = {"tag": t, "beats": 2, "every_s": 0.2, "silent_s": 15, "heartbeat_s": 2, "timeout_s": 120}
    run_id = stack.start("beating", payload)["id"]
    blocked = wait_for(lambda: (r := stack.run(run_id))["blockers"] and r, what="the silent attempt to be Unknown")
    [attempt] = next(s for s in blocked["steps"] if s["id"] == "encode")["attempts"]
    assert attempt["status"] == "unknown"
    assert attempt["detail"].startswith("no heartbeat within the step's heartbeat of 2s")
    unknown_at = datetime.fromisoformat(attempt["unknown"]["at"])
    last_beat = datetime.fromisoformat(attempt["heartbeat"]["at"])
    assert unknown_at - last_beat < timedelta(seconds=2 + 3 + 1.5)  # heartbeat + grace, and slack for the timer
    assert unknown_at - datetime.fromisoformat(attempt["authorized_at"]) < timedelta(seconds=20)  # not 120 s
    run = stack.wait_finished(run_id, timeout=60)
    assert run["outcome"] == "completed" and run["output"] == {"beats": 2}
    assert stack.invocations(f"{t}:encode-start") == 1


@pytest.mark.rfd("H3")
def test_a_cancel_reaches_the_running_callback_through_its_heartbeat_over_http(stack: DevStack) -> None:
    t = tag()
    run_id = stack.start("beating", {"tag": t, "beats": 200, "every_s": 0.1, "heartbeat_s": 2})["id"]
    wait_for(lambda: stack.invocations(f"{t}:encode-start"), what="the callback to start")
    assert stack.client.post(f"/v1/runs/{run_id}/cancel", json={"reason": "changed my mind"}).status_code == 202
    run = stack.wait_finished(run_id, timeout=60)
    assert stack.invocations(f"{t}:stop-seen") == 1
    encode = next(s for s in run["steps"] if s["id"] == "encode")
    assert encode["result"]["stopped"] == "cancel" and encode["result"]["at_beat"] < 199
    # the callback returned, so its step completed and is undone with the rest (C1); nothing after it ran
    assert run["summary"] == "cancelled, fully compensated"
    assert stack.invocations(f"{t}:undo-encode") == 1 and stack.invocations(f"{t}:after") == 0

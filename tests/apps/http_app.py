"""The app the conformance tests serve over real HTTP with `ryusen dev`.

Callbacks append a line to $RYUSEN_TEST_LOG for every execution, so a test in
another process can count physical invocations.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import ryusen
from ryusen import NonRetryableError, RetryPolicy, Ryusen, Step, StepFailed

app = Ryusen("conformance")
VARIANT = "a"


def record(what: str) -> None:
    with open(os.environ["RYUSEN_TEST_LOG"], "a") as f:
        f.write(f"{what}\n")


def times(what: str) -> int:
    try:
        with open(os.environ["RYUSEN_TEST_LOG"]) as f:
            return sum(1 for line in f if line.strip() == what)
    except FileNotFoundError:
        return 0


def effect(name: str, tag: str) -> dict[str, Any]:
    record(f"{tag}:{name}")
    return {"step": name, "op": ryusen.operation().id}


def flaky(tag: str, failures: int) -> str:
    record(f"{tag}:flaky")
    if times(f"{tag}:flaky") <= failures:
        raise ConnectionError("upstream unavailable")
    return "recovered"


def undo(tag: str, name: str) -> Any:
    def compensate(result: dict[str, Any]) -> dict[str, Any]:
        record(f"{tag}:undo-{name}")
        return {"undone": result.get("step", name), "op": ryusen.operation().id}

    return compensate


@app.function("straight")
def straight(data: dict[str, Any], step: Step) -> dict[str, Any]:
    tag = data["tag"]
    return {n: step.run(n, effect, n, tag, compensate=undo(tag, n)) for n in data.get("steps", ["a", "b", "c"])}


@app.function("handled")
def handled(data: dict[str, Any], step: Step) -> Any:
    tag = data["tag"]
    policy = RetryPolicy(max_attempts=data["attempts"], initial_delay=timedelta(milliseconds=100))
    try:
        return step.run("flaky", flaky, tag, data["failures"], retry=policy, compensate=undo(tag, "flaky"))
    except StepFailed as failure:
        return {"handled": failure.error_type}


@app.function("saga")
def saga(data: dict[str, Any], step: Step) -> Any:
    tag = data["tag"]
    for name in ("reserve", "charge", "ship"):
        step.run(name, effect, name, tag, compensate=undo(tag, name))
    if data.get("declined"):
        step.run("notify", lambda: (_ for _ in ()).throw(NonRetryableError("declined")))
    raise RuntimeError("order rejected after shipping")


@app.function("dup")
def dup(data: dict[str, Any], step: Step) -> Any:
    tag = data["tag"]
    first = step.run("charge", effect, "charge", tag, name="charge amount")
    second = step.run("charge", effect, "fee", tag, name="charge fee")
    return [first["step"], second["step"], VARIANT]


def slow(tag: str, seconds: float) -> dict[str, Any]:
    record(f"{tag}:slow-start")
    time.sleep(seconds)
    record(f"{tag}:slow-end")
    return {"slept": seconds, "op": ryusen.operation().id}


@app.function("slow")
def slow_fn(data: dict[str, Any], step: Step) -> Any:
    tag = data["tag"]
    step.run("first", effect, "first", tag, compensate=undo(tag, "first"))
    timeout = timedelta(seconds=data["timeout_s"]) if data.get("timeout_s") else None
    result = step.run("slow", slow, tag, data["sleep_s"], timeout=timeout, compensate=undo(tag, "slow"))
    step.run("after", effect, "after", tag, compensate=undo(tag, "after"))
    return result


# ---- decisions 16, 17 and 19 over HTTP ------------------------------------------------------


@app.function("metrics")
def metrics(data: dict[str, Any], step: Step) -> Any:
    """A ``finally`` that raises once, in the pass that ran the charge (decisions 16)."""
    tag = data["tag"]
    try:
        charged = step.run("charge", effect, "charge", tag)
    finally:
        record(f"{tag}:metric")
        if times(f"{tag}:metric") == 2:
            raise ConnectionError("metrics endpoint timed out")
    return charged


@app.function("config_trip")
def config_trip(data: dict[str, Any], step: Step) -> Any:
    """A config read outside step.run that times out once, in the first compensation pass (decisions 17)."""
    tag = data["tag"]
    if times(f"{tag}:failed") and not times(f"{tag}:config-outage"):
        record(f"{tag}:config-outage")
        raise TimeoutError("config service timed out")
    step.run("flight", effect, "flight", tag, compensate=undo(tag, "flight"))
    ran: list[str] = []
    step.run("hotel", lambda: ran.append("hotel") or effect("hotel", tag), compensate=undo(tag, "hotel"))
    if not ran:  # a pass that replayed every step (not the hotel's attempt continuing): this one fails the run
        record(f"{tag}:failed")
    raise RuntimeError("payment revoked")


@app.function("audited")
def audited(data: dict[str, Any], step: Step) -> Any:
    """Once the run has failed, current code reaches a new step first: the unwind blocks (decisions 17)."""
    tag = data["tag"]
    if times(f"{tag}:failed"):
        step.run("audit", effect, "audit", tag)
    ran: list[str] = []
    step.run("book", lambda: ran.append("book") or effect("book", tag), compensate=undo(tag, "book"))
    if not ran:  # a pass that replayed every step (not the book's attempt continuing): this one fails the run
        record(f"{tag}:failed")
    raise RuntimeError("fraud check failed")


def crash(tag: str) -> dict[str, Any]:
    record(f"{tag}:crash")
    os._exit(17)  # the app process dies mid-effect: nobody knows what happened


@app.function("crashes")
def crashes(data: dict[str, Any], step: Step) -> Any:
    """Every attempt loses its outcome; the step declares itself safe to retry once (decisions 19)."""
    tag = data["tag"]
    policy = RetryPolicy(max_attempts=2, initial_delay=timedelta(milliseconds=100), on_unknown="retry")
    return step.run("crash", crash, tag, retry=policy, compensate=undo(tag, "crash"))


# ---- decisions 23-26 over HTTP (issue 23) ---------------------------------------------------


@app.function("nested")
def nested(data: dict[str, Any], step: Step) -> Any:
    """The charge's callback opens a step of its own: refused, and the run blocks (decisions 23)."""
    tag = data["tag"]

    def charge() -> dict[str, Any]:
        charged = effect("charge", tag)
        step.run("email-receipt", effect, "email-receipt", tag)
        return charged

    return step.run("charge", charge, compensate=undo(tag, "charge"))


@app.function("guarded")
def guarded(data: dict[str, Any], step: Step) -> Any:
    """A guard on an external read, outside step.run, ends every pass once the order is cancelled (24)."""
    tag = data["tag"]
    if times(f"{tag}:order-cancelled"):
        return {"skipped": "order cancelled"}
    step.run("charge", effect, "charge", tag, compensate=undo(tag, "charge"))
    step.run("ship", slow, tag, data["sleep_s"], compensate=undo(tag, "ship"))
    return "shipped"


@app.function("oversized")
def oversized(data: dict[str, Any], step: Step) -> Any:
    """The charge ran, and returned more than the value limit (decisions 25)."""
    tag = data["tag"]

    def refund(charge: Any) -> str:
        record(f"{tag}:undo-charge:{type(charge).__name__}:{getattr(charge, 'size', '')}")
        return "refunded"

    def charge() -> dict[str, Any]:
        return {**effect("charge", tag), "receipt_pdf": "x" * 300_000}

    step.run("charge", charge, compensate=refund)
    return "paid"


# ---- decision 33: long steps and heartbeats (issue 25) --------------------------------------


@app.function("beating")
def beating(data: dict[str, Any], step: Step) -> Any:
    """A long callback that heartbeats ``beats`` times, ``every_s`` apart, then (``silent_s``) goes quiet; it
    stops early, and says so, when a heartbeat tells it the run is stopping."""
    tag = data["tag"]

    def encode() -> dict[str, Any]:
        record(f"{tag}:encode-start")
        beats = data["beats"]
        for i in range(beats):
            try:
                ryusen.heartbeat({"progress": round((i + 1) / beats, 3)})
            except ryusen.StopRequested as stop:
                record(f"{tag}:stop-seen")
                return {"stopped": stop.kind, "at_beat": i}
            time.sleep(data["every_s"])
        time.sleep(data.get("silent_s", 0))
        return {"beats": beats}

    result = step.run(
        "encode",
        encode,
        heartbeat=timedelta(seconds=data["heartbeat_s"]),
        timeout=timedelta(seconds=data.get("timeout_s", 120)),
        compensate=undo(tag, "encode"),
    )
    step.run("after", effect, "after", tag, compensate=undo(tag, "after"))
    return result


# ---- issue 26: a run of many steps, for the dev UI's large-run page ----------------------------


def trivial(index: int) -> int:
    return index


@app.function("many")
def many(data: dict[str, Any], step: Step) -> Any:
    """``n`` trivial steps, one after another (no invocation log: a thousand lines would only slow the test)."""
    total = 0
    for i in range(data["n"]):
        total += step.run(f"s{i:04d}", trivial, i)
    return {"steps": data["n"], "total": total}


# ---- decision 31 over HTTP (issue 27) --------------------------------------------------------


@app.function("sleepy")
def sleepy(data: dict[str, Any], step: Step) -> Any:
    """A durable wait of ``sleep_s`` seconds between two steps (the first one undone if the run stops)."""
    tag = data["tag"]
    step.run("before", effect, "before", tag, compensate=undo(tag, "before"))
    step.sleep("nap", timedelta(seconds=data["sleep_s"]))
    return step.run("after", effect, "after", tag)


@app.function("delayed")
def delayed(data: dict[str, Any], step: Step) -> Any:
    """A slow callback whose first attempt waits ``delay_s`` seconds (``not_before``) before it may start."""
    tag = data["tag"]
    step.run("first", effect, "first", tag, compensate=undo(tag, "first"))
    wait = timedelta(seconds=data["delay_s"])
    timeout = timedelta(seconds=data["timeout_s"])
    return step.run("slow", slow, tag, data["sleep_s"], timeout=timeout, not_before=wait, compensate=undo(tag, "slow"))


# ---- decision 32 over HTTP (issue 27) --------------------------------------------------------


@app.function("approval")
def approval(data: dict[str, Any], step: Step) -> Any:
    """An approval completed from outside: the callback hands out its token (here, into the invocation log, as an
    email would carry a link); the step's result is what the approver sends."""
    tag = data["tag"]
    step.run("reserve", effect, "reserve", tag, compensate=undo(tag, "reserve"))

    def ask() -> str:
        token = ryusen.operation().completion_token
        record(f"{tag}:token:{token}")
        if data.get("self_complete"):  # the app's own webhook completes it, signed with the app's key
            import threading

            def webhook() -> None:
                time.sleep(0.5)
                try:
                    answer = app.complete(token, {"approved": True, "by": "the app's webhook"})
                    record(f"{tag}:completed:{answer.get('taken')}")
                except ryusen.CompletionError as exc:
                    record(f"{tag}:refused:{exc.code}")

            threading.Thread(target=webhook, daemon=True).start()
        return "asked"

    wait = timedelta(seconds=data.get("timeout_s", 600))
    decision = step.run("approve", ask, completion="external", timeout=wait)
    return step.run("pay", effect, "pay", tag) if decision.get("approved") else {"rejected": decision}


# ---- decision 30 over HTTP (issue 27) --------------------------------------------------------


async def book(what: str, tag: str, seconds: float) -> dict[str, Any]:
    """A slow booking: the invocation log shows when it started and ended, so a test can see overlap."""
    import asyncio

    record(f"{tag}:start-{what}")
    await asyncio.sleep(seconds)
    record(f"{tag}:end-{what}")
    return {"booked": what, "op": ryusen.operation().id}


@app.function("trip", max_parallel=3)
async def trip(data: dict[str, Any], step: ryusen.AsyncStep) -> Any:
    """Flight, hotel and car booked together (each undone if the run stops), then a confirmation."""
    import asyncio

    tag, seconds = data["tag"], data.get("seconds", 2.0)
    kinds = data.get("kinds", ["flight", "hotel", "car"])
    booked = await asyncio.gather(*(step.run(k, book, k, tag, seconds, compensate=undo(tag, k)) for k in kinds))
    await step.run("confirm", effect, "confirm", tag)
    return [b["booked"] for b in booked]

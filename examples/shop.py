"""A checkout saga: reserve stock, charge the card, ship; each step knows how to undo itself.

Run it locally:   ryusen dev examples/shop.py:app
Then start runs:  ryusen run checkout --input '{"sku": "lamp", "qty": 1, "card": "4242", "amount": 30}' --wait

Inputs that show the engine at work:

* ``"card": "4000"``: the card is declined (a ``NonRetryableError``); the
  function lets the failure escape, so the run fails and the reserved stock
  is released (compensation in reverse order).
* ``"card": "flaky"``: the payment API fails twice, then succeeds: retries
  with backoff, invisible to the function.
* ``"express": true`` with ``"sku": "piano"``: express shipping is refused
  (a terminal step failure); the function catches ``StepFailed`` and falls
  back to standard shipping, a *handled* failure: the run completes and
  nothing is compensated.
* ``"fail_after_ship": true``: everything succeeds, then the function raises:
  all three steps are compensated, newest first.
* ``"slow_ship_s": 20``: shipping takes 20 seconds. ``ryusen cancel RUN`` while
  it runs: the shipment in flight settles, then everything is compensated
  ("cancelled, fully compensated"). Or start the run with ``--timeout 5``: the
  deadline passes mid-shipment, and the run ends "timed out, fully compensated".
* ``"crash_in_ship": true``: the app process dies while shipping (the first
  attempt only). Ryusen cannot know whether the parcel went out: the step is
  Unknown and the run is blocked. ``ryusen dev`` restarts the app; you decide,
  for example ``ryusen resolve RUN ship --phase forward --generation 1 --retry``
  (or ``--succeed '{"tracking": "trk_manual", "express": false}'``).

A durable wait: ``ryusen run review-request --input '{"customer": "ada", "wait_days": 14}'`` records the
order's follow-up and waits 14 days before asking for a review. No process waits meanwhile: the step completes
when its time comes, also across restarts of ``ryusen dev`` (``"wait_days": 0.0003`` waits about 26 seconds).

A step completed from outside: ``ryusen run refund-request --input '{"charge_id": "ch_1", "amount": 500}'``
waits for a person's approval (the app prints the command that gives it: ``ryusen complete TOKEN --result
'{"approved": true}'``; ``ryusen show RUN`` shows it too); within two days, or the step fails.

A trip, with all three: ``ryusen run trip --input '{"traveller": "ada", "total": 2400, "departure_in_days":
0.001}'`` books the flight, the hotel and the car at once (steps in parallel), waits for a manager's approval
because the total is over 1,000 (the app prints the ``ryusen complete`` command), then waits until a day before
departure to send a reminder. ``"car": "none-left"`` makes the car booking fail: the flight and hotel are cancelled
once it has. A rejected approval cancels all three, newest booking first.

The "systems" here are in-memory dictionaries so the example runs anywhere;
a real app would call its inventory, payment and shipping services, passing
``ryusen.operation().id`` as the idempotency key.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

import ryusen
from ryusen import NonRetryableError, RetryPolicy, Ryusen, Step, StepFailed

app = Ryusen("shop")

_lock = threading.Lock()
STOCK: dict[str, int] = {"lamp": 100, "piano": 3, "chair": 50}
CHARGES: dict[str, dict[str, Any]] = {}
SHIPMENTS: dict[str, dict[str, Any]] = {}
_flaky_calls: dict[str, int] = {}


def reserve_stock(sku: str, qty: int) -> dict[str, Any]:
    with _lock:
        if STOCK.get(sku, 0) < qty:
            raise NonRetryableError(f"only {STOCK.get(sku, 0)} of {sku} left", data={"sku": sku})
        STOCK[sku] -= qty
    return {"sku": sku, "qty": qty, "reservation": ryusen.operation().id}


def release_stock(reservation: dict[str, Any]) -> dict[str, Any]:
    with _lock:
        STOCK[reservation["sku"]] = STOCK.get(reservation["sku"], 0) + reservation["qty"]
    return {"released": reservation["qty"]}


def charge_card(card: str, amount: int) -> dict[str, Any]:
    key = ryusen.operation().id  # the payment API's idempotency key: stable across retries
    if card == "4000":
        raise NonRetryableError("card declined", data={"decline_code": "insufficient_funds"})
    if card == "flaky":
        _flaky_calls[key] = _flaky_calls.get(key, 0) + 1
        if _flaky_calls[key] < 3:
            raise ConnectionError("payment API timed out")
    with _lock:
        charge = CHARGES.setdefault(key, {"charge_id": f"ch_{key[-8:]}", "amount": amount, "refunded": False})
    return dict(charge)


def refund(charge: dict[str, Any]) -> dict[str, Any]:
    with _lock:
        for stored in CHARGES.values():
            if stored["charge_id"] == charge["charge_id"]:
                stored["refunded"] = True
    return {"refunded": charge["charge_id"], "refund_key": ryusen.operation().id}


def ship(sku: str, express: bool, slow_s: float = 0, crash: bool = False) -> dict[str, Any]:
    if express and sku == "piano":
        raise NonRetryableError("pianos cannot ship express")
    if crash and ryusen.operation().generation == 1:
        os._exit(17)  # the process dies mid-effect: nobody knows whether the parcel left
    time.sleep(slow_s)
    tracking = f"trk_{ryusen.operation().id[-8:]}"
    with _lock:
        SHIPMENTS[tracking] = {"sku": sku, "express": express, "cancelled": False}
    return {"tracking": tracking, "express": express}


def cancel_shipment(shipment: dict[str, Any]) -> dict[str, Any]:
    with _lock:
        SHIPMENTS[shipment["tracking"]]["cancelled"] = True
    return {"cancelled": shipment["tracking"]}


@app.function("checkout", timeout=timedelta(hours=1))
def checkout(order: dict[str, Any], step: Step) -> dict[str, Any]:
    stock = step.run("reserve-stock", reserve_stock, order["sku"], order.get("qty", 1), compensate=release_stock)
    charge = step.run(
        "charge-card",
        charge_card,
        order["card"],
        order["amount"],
        compensate=refund,
        retry=RetryPolicy(max_attempts=5, initial_delay=timedelta(milliseconds=200)),
    )
    try:
        shipment = step.run(
            "ship",
            ship,
            order["sku"],
            order.get("express", False),
            order.get("slow_ship_s", 0),
            order.get("crash_in_ship", False),
            compensate=cancel_shipment,
        )
    except StepFailed:
        # handled failure: fall back to standard shipping; nothing is compensated
        shipment = step.run("ship-standard", ship, order["sku"], False, compensate=cancel_shipment)
    if order.get("fail_after_ship"):
        raise RuntimeError("order rejected by the fraud check after shipping")
    return {"stock": stock, "charge": charge, "shipment": shipment}


def ask_for_approval(order: dict[str, Any]) -> str:
    """Hand out the completion token: a real app would email an approval link that carries it."""
    token = ryusen.operation().completion_token
    print(f"refund of {order['amount']} waits for approval: ryusen complete {token} --result '{{\"approved\": true}}'")
    return "asked"


@app.function("refund-request")
def refund_request(order: dict[str, Any], step: Step) -> dict[str, Any]:
    """A refund over a limit waits for a person's approval: a step completed from outside."""
    if order["amount"] > order.get("limit", 100):
        decision = step.run(
            "approval", ask_for_approval, order, completion="external", timeout=timedelta(days=order.get("days", 2))
        )
        if not decision.get("approved"):
            return {"refunded": False}
    return step.run("refund", refund, {"charge_id": order["charge_id"], "amount": order["amount"]})


def ask_for_review(customer: str) -> dict[str, Any]:
    return {"asked": customer, "request_id": f"rv_{ryusen.operation().id[-8:]}"}


@app.function("review-request")
def review_request(order: dict[str, Any], step: Step) -> dict[str, Any]:
    """Some time after an order, ask for a review: a durable wait, then one step."""
    step.sleep("until-review", timedelta(days=order.get("wait_days", 14)))
    return step.run("ask-for-review", ask_for_review, order["customer"])


BOOKINGS: dict[str, dict[str, Any]] = {}


async def book(kind: str, trip: dict[str, Any]) -> dict[str, Any]:
    """Book one part of a trip (an airline's, a hotel's or a car rental's API), keyed by the operation id."""
    if trip.get(kind) == "none-left":
        raise NonRetryableError(f"no {kind} available")
    key = ryusen.operation().id
    with _lock:
        booking = BOOKINGS.setdefault(key, {"kind": kind, "ref": f"{kind[:2]}_{key[-6:]}", "cancelled": False})
    return dict(booking)


async def cancel_booking(booking: dict[str, Any]) -> dict[str, Any]:
    with _lock:
        for stored in BOOKINGS.values():
            if stored["ref"] == booking["ref"]:
                stored["cancelled"] = True
    return {"cancelled": booking["ref"]}


def ask_manager(trip: dict[str, Any]) -> str:
    token = ryusen.operation().completion_token
    print(f"trip of {trip['total']} waits for approval: ryusen complete {token} --result '{{\"approved\": true}}'")
    return "asked"


def remind(traveller: str, refs: list[str]) -> dict[str, Any]:
    return {"reminded": traveller, "bookings": refs}


@app.function("trip", max_parallel=3)
async def trip(data: dict[str, Any], step: ryusen.AsyncStep) -> dict[str, Any]:
    """Book flight, hotel and car in parallel; over 1,000, wait for a manager's approval; a day before departure,
    send a reminder. Any failure cancels what was booked, newest first."""
    import asyncio

    bookings = await asyncio.gather(
        *(step.run(kind, book, kind, data, compensate=cancel_booking) for kind in ("flight", "hotel", "car"))
    )
    if data["total"] > 1000:
        decision = await step.run("approval", ask_manager, data, completion="external", timeout=timedelta(days=3))
        if not decision.get("approved"):
            raise NonRetryableError("the manager did not approve the trip")
    days = max(0.0, data.get("departure_in_days", 7) - 1)
    await step.sleep("until-reminder", timedelta(days=days))
    refs = [b["ref"] for b in bookings]
    return await step.run("reminder", remind, data["traveller"], refs)


lambda_handler = app.lambda_handler
"""The entry point when this app is deployed as a Lambda behind a Function URL (infra/ryusen_infra/example.py)."""

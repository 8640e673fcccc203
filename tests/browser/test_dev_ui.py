"""The dev UI in a real browser (issue 26): start a run and watch it live, filter and search the list, deep links
and Back, cancel with a reason and see the unwind, resolve an Unknown with a reason, read a traceback, and a
1,000-step run whose page stays a screen or two high."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.stack import DevStack, wait_for

ROOT = Path(__file__).resolve().parents[2]


def tag() -> str:
    return uuid.uuid4().hex[:10]


def finished(stack: DevStack, function_id: str, data: Any, **extra: Any) -> dict[str, Any]:
    run = stack.start(function_id, data, **extra)
    return stack.wait_finished(run["id"], timeout=240)


def open_run(page: Any, stack: DevStack, run_id: str) -> None:
    page.goto(f"{stack.url}/#/runs/{run_id}")
    expect(page.locator(".run-page")).to_have_attribute("data-run-id", run_id)


def test_a_run_started_from_the_ui_goes_live_to_completed(page: Any, stack: DevStack) -> None:
    page.goto(f"{stack.url}/#/functions")
    row = page.locator('tr[data-function-id="straight"]')
    expect(row).to_contain_text("conformance")  # its app, and its newest release beside it
    row.get_by_role("button", name="Start a run…").click()
    form = page.locator('form[data-action="start"]')
    mine = tag()
    form.locator('textarea[name="input"]').fill("{not json")
    expect(form.locator(".problem")).to_contain_text("not JSON")
    expect(form.get_by_role("button", name="Start run")).to_be_disabled()
    form.locator('textarea[name="input"]').fill(f'{{"tag": "{mine}", "steps": ["a", "b"]}}')
    form.locator('input[name="idempotency_key"]').fill(f"order-{mine}")
    expect(form.locator(".cli")).to_contain_text(f'ryusen run straight --input \'{{"tag":"{mine}"')
    form.get_by_role("button", name="Start run").click()

    expect(page).to_have_url(re.compile(r"#/runs/run_[0-9a-f]+$"))
    run_id = page.url.rsplit("/", 1)[1]
    # no polling in the dev UI: only the server's events bring the page from running to completed
    expect(page.locator("[data-summary]")).to_have_text("completed")
    expect(page.locator(".waterfall")).to_have_attribute("data-steps", "2")
    expect(page.locator(".facts")).to_contain_text(f"order-{mine}")
    assert stack.run(run_id)["input"] == {"tag": mine, "steps": ["a", "b"]}

    page.get_by_role("button", name="Rerun with the same input").click()
    expect(page).not_to_have_url(re.compile(run_id))
    rerun = page.url.rsplit("/", 1)[1]
    expect(page.locator("[data-summary]")).to_have_text("completed")
    assert stack.run(rerun)["input"] == {"tag": mine, "steps": ["a", "b"]}


def test_the_list_filters_searches_and_keeps_a_selection_across_live_updates(page: Any, stack: DevStack) -> None:
    mine = tag()
    saga = finished(stack, "saga", {"tag": mine})
    straight = finished(stack, "straight", {"tag": mine}, idempotency_key=f"key-{mine}")
    page.goto(f"{stack.url}/#/runs")
    expect(page.locator(f'tr[data-run-id="{saga["id"]}"]')).to_be_visible()

    page.locator('select[name="function_id"]').select_option("saga")
    expect(page).to_have_url(re.compile(r"function_id=saga"))
    expect(page.locator(f'tr[data-run-id="{saga["id"]}"]')).to_be_visible()
    expect(page.locator(f'tr[data-run-id="{straight["id"]}"]')).to_have_count(0)
    wait_for(
        lambda: set(page.locator("tr.run-row td:nth-child(2)").all_inner_texts()) == {"saga"},
        what="only runs of saga listed",
    )
    page.locator('select[name="recovery"]').select_option("compensated")
    expect(page).to_have_url(re.compile(r"recovery=compensated"))
    expect(page.locator(f'tr[data-run-id="{saga["id"]}"]')).to_be_visible()
    page.locator('select[name="blocked"]').select_option("true")
    expect(page.locator("tr.run-row")).to_have_count(0)
    expect(page.locator(".empty")).to_contain_text("No runs match")
    page.go_back()  # the filters are in the URL: Back undoes the last one
    expect(page.locator('select[name="blocked"]')).to_have_value("")
    expect(page.locator(f'tr[data-run-id="{saga["id"]}"]')).to_be_visible()

    # search: an idempotency key (of any function), then a prefix of a run id
    page.goto(f"{stack.url}/#/runs")
    # the unfiltered list first: the hash change is taken asynchronously, and it empties the search box when it is,
    # so text typed before it lands would be wiped and Enter would search for nothing (a flake seen once in CI)
    expect(page.locator('select[name="function_id"]')).to_have_value("")
    expect(page.locator(f'tr[data-run-id="{straight["id"]}"]')).to_be_visible()
    page.locator('input[name="q"]').fill(f"key-{mine}")
    page.locator('input[name="q"]').press("Enter")
    expect(page).to_have_url(re.compile(r"q=key-"))
    expect(page.locator("tr.run-row")).to_have_count(1)
    expect(page.locator(f'tr[data-run-id="{straight["id"]}"]')).to_be_visible()
    page.locator('input[name="q"]').fill(saga["id"].removeprefix("run_")[:10])
    page.locator('input[name="q"]').press("Enter")
    expect(page.locator(f'tr[data-run-id="{saga["id"]}"]')).to_be_visible()
    expect(page.locator("tr.run-row")).to_have_count(1)

    # a live update of the newest page keeps what the reader selected
    page.goto(f"{stack.url}/#/runs")
    cell = page.locator(f'tr[data-run-id="{straight["id"]}"] td.summary')
    expect(cell).to_be_visible()
    cell.evaluate(
        "el => { const r = document.createRange(); r.selectNodeContents(el); getSelection().removeAllRanges(); getSelection().addRange(r); }"
    )
    selected = page.evaluate("getSelection().toString()")
    assert selected == "completed"
    newer = stack.start("straight", {"tag": tag()})
    expect(page.locator(f'tr[data-run-id="{newer["id"]}"]')).to_be_visible()  # arrived by the event stream
    stack.wait_finished(newer["id"])
    expect(page.locator(f'tr[data-run-id="{newer["id"]}"] td.summary')).to_have_text("completed")
    assert page.evaluate("getSelection().toString()") == selected
    assert cell.evaluate("el => getSelection().containsNode(el, true)")


def test_a_deep_link_opens_the_run_and_back_and_forward_follow_history(page: Any, stack: DevStack) -> None:
    saga = finished(stack, "saga", {"tag": tag()})
    open_run(page, stack, saga["id"])
    expect(page.locator("h1")).to_contain_text(saga["id"])
    page.locator('.wf-row[data-step-id="charge"]').click()
    expect(page.locator(".step-detail")).to_have_attribute("data-step-id", "charge")
    page.get_by_role("link", name="runs of saga").click()
    expect(page).to_have_url(re.compile(r"#/runs\?function_id=saga$"))
    expect(page.locator('select[name="function_id"]')).to_have_value("saga")
    page.locator(f'tr[data-run-id="{saga["id"]}"] a').click()
    expect(page).to_have_url(re.compile(f"#/runs/{saga['id']}$"))
    page.go_back()
    expect(page).to_have_url(re.compile(r"#/runs\?function_id=saga$"))
    expect(page.locator(f'tr[data-run-id="{saga["id"]}"]')).to_be_visible()
    page.go_back()
    expect(page.locator(".run-page")).to_have_attribute("data-run-id", saga["id"])
    page.go_forward()
    expect(page.locator('select[name="function_id"]')).to_have_value("saga")


def test_a_traceback_shows_its_innermost_frame_and_opens_to_every_frame(page: Any, stack: DevStack) -> None:
    saga = finished(stack, "saga", {"tag": tag()})
    open_run(page, stack, saga["id"])
    error = page.locator(".io .error").first
    expect(error).to_contain_text("RuntimeError: order rejected after shipping")
    summary = error.locator(".traceback summary")
    expect(summary).to_contain_text(re.compile(r"raised at http_app\.py:\d+ in saga"))
    expect(error.locator(".traceback pre")).not_to_be_visible()
    summary.click()
    expect(error.locator(".traceback pre")).to_contain_text("Traceback (most recent call last):")
    expect(error.locator(".traceback pre")).to_contain_text('raise RuntimeError("order rejected after shipping")')
    # the unwind, newest first, each compensation's result on its step
    expect(page.locator(".unwind-row")).to_have_count(3)
    assert page.locator(".unwind-row code").all_inner_texts() == ["ship", "charge", "reserve"]
    page.locator('.unwind-row[data-step-id="ship"]').click()
    expect(page.locator(".step-detail .compensation")).to_contain_text("undone")


def test_cancel_with_a_reason_stops_the_run_and_shows_its_unwind(page: Any, stack: DevStack) -> None:
    mine = tag()
    # long enough that the run is still going when the cancel is sent on a loaded machine (it settles, then undoes)
    run = stack.start("slow", {"tag": mine, "sleep_s": 12})
    wait_for(lambda: stack.invocations(f"{mine}:slow-start"), what="the slow step to start")
    open_run(page, stack, run["id"])
    page.get_by_role("button", name="Cancel run…").click()
    form = page.locator('form[data-action="cancel"]')
    expect(form.get_by_role("button", name="Cancel run")).to_be_disabled()  # a reason first
    form.locator('textarea[name="reason"]').fill("customer called to cancel")
    expect(form.locator(".cli")).to_contain_text(f"ryusen cancel {run['id']} --reason 'customer called to cancel'")
    form.get_by_role("button", name="Cancel run").click()
    expect(page.locator(".stop-intent")).to_contain_text("cancel")
    expect(page.locator(".stop-intent [data-reason]")).to_have_text("customer called to cancel")
    expect(page.locator(".marker-stop").first).to_be_attached()  # the stop intent on the waterfall
    expect(page.locator("[data-summary]")).to_have_text("cancelled, fully compensated")
    assert page.locator(".unwind-row code").all_inner_texts() == ["slow", "first"]
    expect(page.locator(".unwind-row .badge")).to_have_text(["compensated", "compensated"])
    assert stack.run(run["id"])["stop_intent"]["reason"] == "customer called to cancel"


def test_an_unknown_outcome_is_resolved_with_a_reason_kept_on_the_attempt(page: Any, stack: DevStack) -> None:
    mine = tag()
    run = stack.start("slow", {"tag": mine, "sleep_s": 15, "timeout_s": 1})
    open_run(page, stack, run["id"])
    blocker = page.locator('[data-blocker="unknown_outcome"]')
    expect(blocker).to_contain_text("unknown outcome of slow")
    expect(blocker.locator(".remedy")).to_contain_text("resolve it once you know what it did")
    expect(page.locator('.wf-row[data-step-id="slow"] .mark-unknown')).to_be_attached()
    blocker.get_by_role("button", name="Resolve slow…").click()
    form = blocker.locator('form[data-action="resolve"]')
    form.locator('textarea[name="result"]').fill('{"slept": 0, "op": "by hand"')
    expect(form.locator(".problem")).to_contain_text("not JSON")
    form.locator('textarea[name="result"]').fill('{"slept": 0, "op": "by hand"}')
    form.locator('textarea[name="reason"]').fill("the provider's dashboard shows it done")
    expect(form.locator(".cli")).to_contain_text(
        f"ryusen resolve {run['id']} slow --phase forward --generation 1 --succeed"
    )
    form.get_by_role("button", name="Resolve: succeed").click()
    expect(page.locator("[data-summary]")).to_have_text("completed")
    page.locator('.wf-row[data-step-id="slow"]').click()
    resolution = page.locator('.step-detail .resolution[data-resolution="succeed"]')
    expect(resolution).to_contain_text("the provider's dashboard shows it done")
    view = stack.run(run["id"])
    assert view["output"] == {"slept": 0, "op": "by hand"}


def test_a_waiting_step_shows_when_its_wait_ends(page: Any, stack: DevStack) -> None:
    """Decision 31: a durable wait is shown with its due time, and says that nothing runs meanwhile."""
    run = stack.start("sleepy", {"tag": tag(), "sleep_s": 600})
    wait_for(lambda: any(s["id"] == "nap" for s in stack.run(run["id"])["steps"]), what="the nap")
    due = next(s for s in stack.run(run["id"])["steps"] if s["id"] == "nap")["wait_until"]
    open_run(page, stack, run["id"])
    page.locator('.wf-row[data-step-id="nap"]').click()
    wait = page.locator(".step-detail .wait")
    expect(wait).to_have_attribute("data-wait-until", due)
    expect(wait).to_contain_text("a durable wait: completes at")
    expect(wait).to_contain_text("waiting: no process runs meanwhile")
    stack.client.post(f"/v1/runs/{run['id']}/cancel", json={"reason": "test done"})


def test_a_step_waiting_for_its_completion_shows_how_to_complete_it_and_is_completed_from_the_page(
    page: Any, stack: DevStack
) -> None:
    """Decision 32: the waiting attempt's token, the CLI command and the HTTP call, and a form that completes it."""
    run = stack.start("approval", {"tag": tag()})
    wait_for(
        lambda: any(
            s["id"] == "approve" and s["attempts"][-1]["status"] == "waiting" for s in stack.run(run["id"])["steps"]
        ),
        what="the approval to wait",
    )
    open_run(page, stack, run["id"])
    page.locator('.wf-row[data-step-id="approve"]').click()
    box = page.locator(".step-detail .completion")
    expect(box).to_contain_text("Waiting for its completion from outside")
    token = box.get_attribute("data-token")
    assert token and token.startswith("rc1.")
    expect(box.locator("pre")).to_contain_text(f"ryusen complete {token} --result JSON")
    box.locator("textarea").fill('{"approved": true, "by": "the browser"}')
    box.locator("button[type=submit]").click()
    expect(page.locator(".run-page [data-summary]")).to_have_text("completed", timeout=60_000)
    done = stack.wait_finished(run["id"])
    assert next(s for s in done["steps"] if s["id"] == "approve")["result"] == {"approved": True, "by": "the browser"}


def test_a_thousand_step_run_stays_within_a_screen_or_two(page: Any, stack: DevStack) -> None:
    run = finished(stack, "many", {"tag": tag(), "n": 1000})
    assert len(run["steps"]) == 1000
    open_run(page, stack, run["id"])
    expect(page.locator(".waterfall")).to_have_attribute("data-steps", "1000")
    height, viewport = page.evaluate("[document.documentElement.scrollHeight, innerHeight]")
    assert height <= 2.5 * viewport, (height, viewport)
    rendered = page.locator(".wf-row").count()
    assert 0 < rendered < 60, rendered  # only the rows in view
    page.locator(".wf-rows").evaluate("el => { el.scrollTop = el.scrollHeight; }")
    expect(page.locator('.wf-row[data-step-id="s0999"]')).to_be_visible()
    page.locator('.wf-row[data-step-id="s0999"]').click()
    expect(page.locator(".step-detail")).to_contain_text("s0999")
    assert page.locator(".wf-row").count() < 60
    height = page.evaluate("document.documentElement.scrollHeight")
    assert height <= 3 * viewport, (height, viewport)


@pytest.mark.skipif(not os.environ.get("RYUSEN_UI_SCREENSHOTS"), reason="RYUSEN_UI_SCREENSHOTS=1 writes docs/images")
def test_screenshots_for_the_docs(page: Any, stack: DevStack) -> None:
    finished(stack, "straight", {"tag": tag()})
    saga = finished(stack, "saga", {"tag": tag()})
    page.goto(f"{stack.url}/#/runs")
    expect(page.locator("tr.run-row").first).to_be_visible()
    page.screenshot(path=str(ROOT / "docs" / "images" / "dev-ui-runs.png"))
    open_run(page, stack, saga["id"])
    page.locator('.wf-row[data-step-id="ship"]').click()
    page.screenshot(path=str(ROOT / "docs" / "images" / "dev-ui-run.png"), full_page=True)


def test_steps_declared_together_are_marked_side_by_side_in_the_waterfall(page: Any, stack: DevStack) -> None:
    """Decision 30: siblings carry the group mark in the waterfall, and a sibling's detail names the others."""
    run = stack.start("trip", {"tag": tag(), "seconds": 0.2})
    wait_for(lambda: stack.run(run["id"])["phase"] == "finished", what="the trip")
    open_run(page, stack, run["id"])
    for kind in ("flight", "hotel", "car"):
        expect(page.locator(f'.wf-row.in-group[data-step-id="{kind}"] .group-mark')).to_have_count(1)
    expect(page.locator('.wf-row[data-step-id="confirm"] .group-mark')).to_have_count(0)
    page.locator('.wf-row[data-step-id="hotel"]').click()
    expect(page.locator(".step-detail .group")).to_contain_text("declared together with flight, car")

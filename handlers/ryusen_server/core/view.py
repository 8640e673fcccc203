"""The run view (contract 2) and the human summary that joins outcome and recovery (decisions 1)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ryusen._internal.wire import Phase

from .model import (
    Attempt,
    AttemptStatus,
    Blocker,
    BlockerType,
    CompensationStatus,
    Outcome,
    Recovery,
    RunPhase,
    RunState,
    StepState,
)

_OUTCOME_WORDS = {
    Outcome.COMPLETED: "completed",
    Outcome.FAILED: "failed",
    Outcome.CANCELLED: "cancelled",
    Outcome.TIMED_OUT: "timed out",
}
_RECOVERY_WORDS = {
    Recovery.PENDING: "compensation pending",
    Recovery.COMPENSATING: "compensating",
    Recovery.NOT_REQUIRED: "compensation not required",
    Recovery.COMPENSATED: "fully compensated",
    Recovery.PARTIALLY_COMPENSATED: "partially compensated",
}


REMEDIES = {
    BlockerType.DUPLICATE_STEP_ID: (
        "Forward work is blocked, not failed, and nothing is compensated. Give one of the two calls another"
        " step id and sync the app: the new release wakes the run; or rediscover once fixed."
    ),
    BlockerType.CONCURRENT_STEP: (
        "Call step.run from the workflow function's own thread, never from another thread or inside a step's"
        " callback (to run steps together, declare them together: asyncio.gather, or step.parallel), then sync"
        " the app: the new release wakes the run."
    ),
    BlockerType.NEW_STEP_BEFORE_TARGET: (
        "Current code reaches a step with no recorded outcome before the step whose compensation is due,"
        " so the compensator cannot be reached. Sync a release that reaches the target first (or no longer"
        " calls the new step): the unwind goes on. If you undid the effect yourself, resolve the compensation."
    ),
    BlockerType.COMPENSATION_TARGET_NOT_REACHED: (
        "The compensation pass ended (an early return, a guard on an external read, a recorded failure) before"
        " reaching the step whose compensation is due, so its compensator did not run, and nothing is skipped on"
        " that evidence. Make the pass reach the step (or retire its id: @app.function(retired_steps=[...])) and"
        " sync the app: the unwind goes on; if what the guard read has changed back, rediscover. If you undid"
        " the effect yourself, resolve the compensation: succeed, fail, or skip, with a reason."
    ),
    BlockerType.RESULT_TOO_LARGE: (
        "The step's callback ran and returned more than the value limit, so its result could not be recorded."
        " It ran its effect: it is neither failed nor retried. Sync a release that returns less (keep large data"
        " elsewhere and return a reference), then retry the attempt (consent to run it again); or resolve it:"
        " succeed with the result it should have recorded, or fail it. If the run stops, the step is undone"
        " like any accepted step, and its compensator receives an OmittedResult."
    ),
    BlockerType.UNSTABLE_STEP_ID: (
        "A step id is made from something that changes on every pass (a random number, the clock, a fresh uuid),"
        " so every pass looks for a step the last one never ran. Make the id stable (derive it from the run's input"
        " or a recorded step result; put a random value in a step of its own) and sync the app: the run wakes."
    ),
    BlockerType.OUTPUT_TOO_LARGE: (
        "The function's return value is over the value limit. Sync a release that returns less (keep large data"
        " elsewhere and return a reference): the run wakes and completes. Its steps are not compensated."
    ),
    BlockerType.OUTPUT_NOT_JSON: (
        "The function's return value is not JSON (a datetime, a set, invalid Unicode...). Sync a release that"
        " returns a JSON value: the run wakes and completes. Its steps are not compensated."
    ),
    BlockerType.INVALID_STEP: (
        "A step.run the server cannot record (see the message): nothing ran and nothing is compensated. Sync a"
        " release that fixes the call: the run wakes."
    ),
    BlockerType.ENDPOINT_FAILING: (
        "Ryusen keeps retrying this task with backoff (the cause is shown); nothing ran twice. Check that the app's"
        " endpoint is up and answers signed requests; the blocker clears once it answers."
    ),
    BlockerType.FUNCTION_NOT_FOUND: (
        "The endpoint's current code has no such function. Sync a release that has it again: the run wakes."
    ),
    BlockerType.UNKNOWN_OUTCOME: (
        "Ryusen cannot know whether this attempt's effect happened, so it neither retries nor compensates past"
        " it. A late result settles it; or resolve it once you know what it did."
    ),
}
"""What an operator can do about each blocker, shown with it in the API, the CLI and the dev UI."""

NESTED_STEP_REMEDY = (
    "A step.run was called inside another step's callback, which ran: its effect may have happened, so it is"
    " neither retried nor compensated, and it will not run again with this build. Move the inner step out of"
    " the callback and sync the app: the callback then runs once more, as a retry. If you know what it did,"
    " resolve that generation instead: succeed with its result, fail it, or retry it (with consent to run it again)."
)


def blocker_view(blocker: Blocker) -> dict[str, Any]:
    nested = blocker.type is BlockerType.CONCURRENT_STEP and blocker.generation is not None
    remedy = NESTED_STEP_REMEDY if nested else REMEDIES[blocker.type]
    return {**blocker.model_dump(mode="json", exclude_none=True), "remedy": remedy}


def summary(state: RunState) -> str:
    """E.g. "cancelled, fully compensated" or "failed, compensating (blocked: ...)"."""
    if state.outcome is None:
        text = "running"
    elif state.outcome is Outcome.COMPLETED:
        text = "completed"
    else:
        text = _OUTCOME_WORDS[state.outcome]
        if state.phase is RunPhase.SETTLING:
            text += ", settling"
        elif state.recovery is Recovery.COMPENSATED and (skipped := operator_skips(state)):
            text += f", compensated, {skipped} skipped by the operator"  # never "fully" (decisions 24)
        elif state.recovery is not None:
            text += ", " + _RECOVERY_WORDS[state.recovery]
    if state.blockers:
        text += " (blocked: " + "; ".join(b.message for b in state.blockers) + ")"
    return text


def operator_skips(state: RunState) -> int:
    """Unwind entries an operator skipped (their compensator never ran): counted apart in the summary."""
    count = 0
    for entry in state.unwind:
        if entry.status is not CompensationStatus.SKIPPED:
            continue
        step = state.step(entry.step_id)
        last = step.current(Phase.COMPENSATION) if step is not None else None
        if last is not None and last.resolution is not None and last.resolution.action == "skip":
            count += 1
    return count


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def attempt_view(attempt: Attempt) -> dict[str, Any]:
    return {
        "phase": attempt.phase.value,
        "generation": attempt.generation,
        "operation_id": attempt.operation_id,
        # decision 32: an attempt whose callback handed out its completion token waits for the completion
        "status": "waiting"
        if attempt.waiting_since and attempt.status is AttemptStatus.AUTHORIZED
        else attempt.status.value,
        "waiting_since": _iso(attempt.waiting_since),
        "queued_at": _iso(attempt.queued_at),
        "not_before": _iso(attempt.not_before),
        "authorized_at": _iso(attempt.authorized_at),
        "settled_at": _iso(attempt.settled_at),
        "lease_expires_at": _iso(attempt.lease_expires_at),
        "release_id": attempt.release_id,
        "build_id": attempt.build_id,
        "error": attempt.error.model_dump() if attempt.error else None,
        "detail": attempt.detail,
        "redeliveries": attempt.redeliveries,
        "stale_submissions": [s.model_dump(mode="json") for s in attempt.stale_submissions],
        "stale_submissions_dropped": attempt.stale_submissions_dropped,
        "resolution": attempt.resolution.model_dump(mode="json") if attempt.resolution else None,
        "unknown": ({"at": _iso(attempt.unknown_at), "reason": attempt.unknown_reason} if attempt.unknown_at else None),
        "heartbeat": (
            {"at": _iso(attempt.heartbeat_at), "details": attempt.heartbeat_details} if attempt.heartbeat_at else None
        ),
    }


def step_view(step: StepState, *, in_unwind: bool = False) -> dict[str, Any]:
    """``in_unwind``: the step is in the run's unwind plan (then a compensation status of none is pending)."""
    compensation = step.compensation_status
    if compensation is CompensationStatus.NONE and in_unwind:
        compensation = CompensationStatus.PENDING
    return {
        "id": step.id,
        "name": step.name,
        "location": step.location,
        "status": step.status.value,
        "has_compensation": step.has_compensation,
        "sleep": step.sleep,
        "external": step.external,
        "wait_until": _iso(step.wait_until),
        "group": step.group,
        "result": step.result,
        "error": step.error.model_dump() if step.error else None,
        "completed_seq": step.completed_seq,
        "omitted_result": step.omitted_result.model_dump() if step.omitted_result else None,
        "compensation": {
            "status": compensation.value,
            "result": step.compensation_result,
            "error": step.compensation_error.model_dump() if step.compensation_error else None,
            "omitted_result": step.compensation_omitted.model_dump() if step.compensation_omitted else None,
        },
        "attempts": [attempt_view(a) for a in step.attempts],
    }


def run_view(state: RunState) -> dict[str, Any]:
    unwinding = {entry.step_id for entry in state.unwind}
    return {
        "id": state.id,
        "app_id": state.app_id,
        "function_id": state.function_id,
        "phase": state.phase.value,
        "outcome": state.outcome.value if state.outcome else None,
        "recovery": state.recovery.value if state.recovery else None,
        "summary": summary(state),
        "input": state.input,
        "output": state.output,
        "error": state.error.model_dump() if state.error else None,
        "created_at": _iso(state.created_at),
        "updated_at": _iso(state.updated_at),
        "finished_at": _iso(state.finished_at),
        "version": state.version,
        "idempotency_key": state.idempotency_key,
        "deadline": {"at": _iso(state.deadline_at), "source": state.deadline_source.value},
        "stop_intent": state.stop_intent.model_dump(mode="json") if state.stop_intent else None,
        "blockers": [blocker_view(b) for b in state.blockers],
        "discovery": state.discovery.model_dump(mode="json") if state.discovery else None,
        "discoveries": state.discoveries,
        "steps": [step_view(s, in_unwind=s.id in unwinding) for s in state.steps],
        "unwind": [u.model_dump(mode="json") for u in state.unwind],
    }


def run_summary_view(state: RunState, step_count: int | None = None) -> dict[str, Any]:
    """The short form used by run lists (``step_count`` where ``state`` is a summary without its steps)."""
    return {
        "id": state.id,
        "app_id": state.app_id,
        "function_id": state.function_id,
        "phase": state.phase.value,
        "outcome": state.outcome.value if state.outcome else None,
        "recovery": state.recovery.value if state.recovery else None,
        "summary": summary(state),
        "created_at": _iso(state.created_at),
        "finished_at": _iso(state.finished_at),
        "steps": len(state.steps) if step_count is None else step_count,
        "blocked": bool(state.blockers),
    }


def memo(state: RunState) -> dict[str, dict[str, Any]]:
    """The recorded step outcomes a task request replays to the function (shared: not to be changed)."""
    return state.memo_entries()


__all__ = ["Phase", "memo", "run_summary_view", "run_view", "summary"]

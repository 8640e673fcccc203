"""What the server API answers, as models: the source of its OpenAPI document (``openapi.py``).

The views themselves are built by ``core/view.py`` and the routes in ``api.py``; these models describe them
field by field, reusing the engine's own models where a view shows one as it is (a blocker, a stop intent, an
unwind entry, an error). tests/functional/test_api_schema.py validates real answers against them (unknown
fields refused), so the reference cannot drift from what the API sends.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ryusen._internal.wire import ErrorInfo, FunctionManifest, OmittedValue, Phase

from .core.model import (
    AttemptStatus,
    Blocker,
    CompensationStatus,
    DeadlineSource,
    DiscoveryTask,
    Outcome,
    Recovery,
    Resolution,
    RunPhase,
    StaleSubmission,
    StepStatus,
    StopIntent,
    UnwindEntry,
)


class _View(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class UnknownMark(_View):
    """When the attempt became Unknown, and why; kept after it is settled."""

    at: datetime | None
    reason: str | None


class HeartbeatMark(_View):
    """The attempt's last heartbeat, and the details it carried."""

    at: datetime | None
    details: Any = None


class AttemptView(_View):
    """One attempt of a step: one generation of its forward or compensation phase."""

    phase: Phase
    generation: int
    operation_id: str = Field(description="Stable across generations: an idempotency key for the effect.")
    status: AttemptStatus | Literal["waiting"] = Field(
        description="`waiting`: a step completed from outside whose callback handed out the completion token."
    )
    waiting_since: datetime | None = Field(description="When its callback returned and the wait began.")
    completion_token: str | None = Field(
        default=None,
        description="A step completed from outside: what completes this attempt (`POST /v1/completions/{token}`).",
    )
    queued_at: datetime | None
    not_before: datetime | None = Field(description="A backoff wait: not sent before this time.")
    authorized_at: datetime | None = Field(description="When a dispatcher authorized it and called the endpoint.")
    settled_at: datetime | None
    lease_expires_at: datetime | None = Field(description="Without an outcome by then, the attempt is Unknown.")
    release_id: str | None
    build_id: str | None
    error: ErrorInfo | None
    detail: str | None
    redeliveries: int
    stale_submissions: list[StaleSubmission] = Field(description="Results that came for it too late or twice.")
    stale_submissions_dropped: int
    resolution: Resolution | None = Field(description="An operator's decision about it, with the reason given.")
    unknown: UnknownMark | None
    heartbeat: HeartbeatMark | None


class CompensationView(_View):
    status: CompensationStatus
    result: Any = None
    error: ErrorInfo | None
    omitted_result: OmittedValue | None


class StepView(_View):
    """A step as the function declared it, with its attempts in order."""

    id: str
    name: str | None
    location: str | None = Field(description="Where the function called step.run (file:line).")
    status: StepStatus
    has_compensation: bool
    external: bool = Field(description='Its result comes from outside (`completion="external"`).')
    sleep: bool = Field(description="A durable wait (`step.sleep`): no callback; it completes at `wait_until`.")
    wait_until: datetime | None = Field(description="When the step's wait ends (`step.sleep`, or `not_before=`).")
    group: int | None = Field(
        description="Steps declared together (decision 30) share it: the discovery pass that reported them."
    )
    result: Any = None
    error: ErrorInfo | None
    completed_seq: int | None
    omitted_result: OmittedValue | None
    compensation: CompensationView
    attempts: list[AttemptView]


class BlockerView(Blocker):
    """Why the run cannot move on by itself, and what a person can do about it."""

    remedy: str


class Deadline(_View):
    at: datetime | None
    source: DeadlineSource


class RunView(_View):
    """A run: where it is (phase), how it ended (outcome), how far it was undone (recovery), and every step."""

    id: str
    app_id: str
    function_id: str
    phase: RunPhase
    outcome: Outcome | None
    recovery: Recovery | None
    summary: str = Field(description='Outcome and recovery in words, e.g. "failed, fully compensated".')
    input: Any = None
    output: Any = None
    error: ErrorInfo | None = Field(description="What the function raised, for a failed run.")
    created_at: datetime
    updated_at: datetime | None
    finished_at: datetime | None
    version: int
    idempotency_key: str | None
    deadline: Deadline
    stop_intent: StopIntent | None
    blockers: list[BlockerView]
    discovery: DiscoveryTask | None
    discoveries: int
    steps: list[StepView]
    unwind: list[UnwindEntry] = Field(description="Steps to compensate, in reverse order of completion.")


class RunSummary(_View):
    """A run in a list: no steps, only how many."""

    id: str
    app_id: str
    function_id: str
    phase: RunPhase
    outcome: Outcome | None
    recovery: Recovery | None
    summary: str
    created_at: datetime
    finished_at: datetime | None
    steps: int
    blocked: bool


class RunPage(_View):
    runs: list[RunSummary]
    cursor: str | None = Field(description="Pass it back as `cursor` for the next page; null on the last.")


class ReleaseRef(_View):
    release_id: str
    build_id: str
    url: str
    synced_at: datetime


class FunctionView(_View):
    id: str
    app_id: str
    timeout_s: float | None
    release: ReleaseRef = Field(description="The app's newest release, which runs its next tasks.")


class FunctionList(_View):
    functions: list[FunctionView]


class AppView(_View):
    app_id: str
    url: str
    release_id: str
    build_id: str
    synced_at: datetime
    signed: bool
    functions: list[str]


class AppList(_View):
    apps: list[AppView]


class SyncAnswer(_View):
    app_id: str
    url: str
    release_id: str
    build_id: str
    functions: list[FunctionManifest] = Field(description="What the release declares.")
    synced_at: datetime
    signed: bool


class ErrorDetail(BaseModel):
    """A refusal: ``code`` says which (snake_case), ``message`` says why; some carry more fields."""

    model_config = ConfigDict(extra="allow")

    code: str
    message: str


class ErrorBody(_View):
    error: ErrorDetail


__all__ = [
    "AppList",
    "AttemptView",
    "ErrorBody",
    "FunctionList",
    "RunPage",
    "RunView",
    "SyncAnswer",
]

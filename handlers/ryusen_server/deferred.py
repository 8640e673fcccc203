"""Deferred answers: what an endpoint answered, kept on the dispatch queue while the store will not take it.

A dispatcher that has a verified answer in hand (a step's outcome, a discovery pass, "nothing was sent")
and cannot write it, because DynamoDB throttles or fails past botocore's retries and its own retries in the
time it has left, must not drop it: the attempt would end Unknown at its lease's expiry, and an operator
would have to act on a success the engine had. It puts the answer on the dispatch queue instead (SQS is
another service: a throttled table does not throttle it), and whichever dispatcher receives it records it
as it would have been recorded then (:meth:`Engine.apply_deferred`). The core fences it like any answer: one
that finds its attempt already settled changes nothing.

A deferred answer (and a wake order) is sealed with the deployment's seal key, kept in the store and never
rotated with the signing keys, so a message someone else put on the queue (a role allowed
``sqs:SendMessage``) cannot settle a step or make the engine call an endpoint, and an emergency rotation of
the signing key voids nothing on the queue. The answer is the one the endpoint
signed; its signature was verified before it was deferred and is not kept (it binds the request's timestamp,
which is stale by the time the answer is received again).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter

from .core.events import AttemptReported, DiscoveryReported, InvocationFailed

DeferredEvent = AttemptReported | DiscoveryReported | InvocationFailed
"""What a dispatcher records for an endpoint's answer."""

_ADAPTERS: dict[str, TypeAdapter[Any]] = {
    "attempt": TypeAdapter(AttemptReported),
    "discovery": TypeAdapter(DiscoveryReported),
    "invocation_failed": TypeAdapter(InvocationFailed),
}
_SEAL_CONTEXT = b"ryusen queue seal v1"


class DeferredAnswer(BaseModel):
    """One answer kept on the queue: the run it is about, the event it is recorded as, and its seal."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    kind: Literal["attempt", "discovery", "invocation_failed"]
    event: dict[str, Any]
    tries: int = 0
    """How many receives found the store still unavailable (each puts it back a little later)."""
    seal: str = ""
    """HMAC of the rest with the deployment's seal key (:meth:`RunStore.seal_key`)."""

    @staticmethod
    def of(run_id: str, event: DeferredEvent, seal_key: str) -> DeferredAnswer:
        """The deferred form of ``event``, sealed. What the replay found after the callback is left out (a
        release may be synced meanwhile; a discovery pass finds it again); the chained authorization is kept,
        so that the receiver recognises a next task this dispatcher's first try authorized, and invokes it."""
        if isinstance(event, AttemptReported):
            kind: Literal["attempt", "discovery", "invocation_failed"] = "attempt"
            event = replace(event, next=None)
        elif isinstance(event, DiscoveryReported):
            kind = "discovery"
        else:
            kind = "invocation_failed"
        body = _ADAPTERS[kind].dump_python(event, mode="json")
        return DeferredAnswer(run_id=run_id, kind=kind, event=body).sealed(seal_key)

    def again(self, seal_key: str) -> DeferredAnswer:
        """This answer after one more receive that could not record it."""
        return self.model_copy(update={"tries": self.tries + 1}).sealed(seal_key)

    def sealed(self, seal_key: str) -> DeferredAnswer:
        return self.model_copy(update={"seal": _seal(seal_key, self)})

    def verify(self, seal_key: str) -> bool:
        """Sealed by this deployment (see :meth:`RunStore.seal_key`)."""
        return hmac.compare_digest(_seal(seal_key, self), self.seal)

    def decoded(self) -> DeferredEvent:
        event: DeferredEvent = _ADAPTERS[self.kind].validate_python(self.event)
        return event

    def describe(self) -> str:
        e = self.event
        what = e.get("step_id") or (f"discovery #{e.get('seq')}" if self.kind == "discovery" else "")
        if self.kind == "invocation_failed":
            task = e.get("task", {})
            what = task.get("step_id") or f"discovery #{task.get('seq')}"
        return f"deferred answer ({self.kind}) for run {self.run_id} {what}".rstrip()


def _seal(seal_key: str, message: BaseModel) -> str:
    """HMAC-SHA256 of everything in ``message`` but its seal, by kind of message, under the seal key."""
    key = hmac.new(seal_key.encode(), _SEAL_CONTEXT, hashlib.sha256).digest()
    content = json.dumps(
        {"kind": type(message).__name__, **message.model_dump(mode="json", exclude={"seal"})},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hmac.new(key, content.encode(), hashlib.sha256).hexdigest()


class DeferredMessage(BaseModel):
    """The dispatch-queue message that carries a deferred answer."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    deferred: DeferredAnswer


class DeferralRefusedError(Exception):
    """The queue cannot carry this answer (larger than a message may be)."""


class WakeOrder(BaseModel):
    """A release sync's wake, done by a dispatcher rather than by the sync's request: the runs of a function
    blocked by a definition (looked up in the index when the message is received), or one run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    function_id: str | None = None
    run_id: str | None = None
    after: str | None = None
    """Of a function's order: the run id this order's last message stopped at (the next one goes on after it)."""
    seal: str = ""
    """HMAC of the rest with the deployment's seal key: only the engine orders wakes."""

    def sealed(self, seal_key: str) -> WakeOrder:
        return self.model_copy(update={"seal": _seal(seal_key, self)})

    def verify(self, seal_key: str) -> bool:
        return hmac.compare_digest(_seal(seal_key, self), self.seal)

    def describe(self) -> str:
        return f"wake run {self.run_id}" if self.run_id else f"wake the blocked runs of {self.function_id}"


class WakeMessage(BaseModel):
    """The dispatch-queue message that carries a wake order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    wake: WakeOrder

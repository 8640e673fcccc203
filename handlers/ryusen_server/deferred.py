"""Deferred answers: what an endpoint answered, kept on the dispatch queue while the store will not take it.

A dispatcher that has a verified answer in hand (a step's outcome, a discovery pass, "nothing was sent")
and cannot write it, because DynamoDB throttles or fails past botocore's retries and its own retries in the
time it has left, must not drop it: the attempt would end Unknown at its lease's expiry, and an operator
would have to act on a success the engine had. It puts the answer on the dispatch queue instead (SQS is
another service: a throttled table does not throttle it), and whichever dispatcher receives it records it
as it would have been recorded then (:meth:`Engine.apply_deferred`). The core fences it like any answer: one
that finds its attempt already settled changes nothing.

A deferred answer is sealed with a key derived from the deployment's master key, so a message someone else put
on the queue (a role allowed ``sqs:SendMessage``) cannot settle a step. The answer is the one the endpoint
signed; its signature was verified before it was deferred and is not kept (it binds the request's timestamp,
which is stale by the time the answer is received again).
"""

from __future__ import annotations

import hashlib
import hmac
import json
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
_SEAL_CONTEXT = b"ryusen deferred answer v1"


class DeferredAnswer(BaseModel):
    """One answer kept on the queue: the run it is about, the event it is recorded as, and its seal."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    kind: Literal["attempt", "discovery", "invocation_failed"]
    event: dict[str, Any]
    tries: int = 0
    """How many receives found the store still unavailable (each puts it back a little later)."""
    seal: str = ""
    """HMAC of the rest with the deferred-answer key (empty where the engine has no master key: local only)."""

    @staticmethod
    def of(run_id: str, event: DeferredEvent, master_keys: list[str]) -> DeferredAnswer:
        """The deferred form of ``event``, sealed with the first master key. What a dispatcher decided only for
        itself is left out: the chained authorization (the receiver does not invoke) and what the replay
        found after the callback (a release may be synced meanwhile; a discovery pass finds it again)."""
        if isinstance(event, AttemptReported):
            kind: Literal["attempt", "discovery", "invocation_failed"] = "attempt"
            event = AttemptReported(
                step_id=event.step_id,
                phase=event.phase,
                generation=event.generation,
                response=event.response,
                source=event.source,
            )
        elif isinstance(event, DiscoveryReported):
            kind, event = "discovery", DiscoveryReported(seq=event.seq, response=event.response)
        else:
            kind = "invocation_failed"
        body = _ADAPTERS[kind].dump_python(event, mode="json")
        unsealed = DeferredAnswer(run_id=run_id, kind=kind, event=body)
        return unsealed.sealed(master_keys[0]) if master_keys else unsealed

    def again(self, master_keys: list[str]) -> DeferredAnswer:
        """This answer after one more receive that could not record it."""
        unsealed = self.model_copy(update={"tries": self.tries + 1, "seal": ""})
        return unsealed.sealed(master_keys[0]) if master_keys else unsealed

    def sealed(self, master_key: str) -> DeferredAnswer:
        return self.model_copy(update={"seal": _seal(master_key, self)})

    def verify(self, master_keys: list[str]) -> bool:
        """Sealed by one of ``master_keys`` (without keys, only an unsealed answer is accepted: local mode)."""
        if not master_keys:
            return self.seal == ""
        return any(hmac.compare_digest(_seal(key, self), self.seal) for key in master_keys)

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


def _seal(master_key: str, deferred: DeferredAnswer) -> str:
    key = hmac.new(master_key.encode(), _SEAL_CONTEXT, hashlib.sha256).digest()
    content = json.dumps(
        {"run_id": deferred.run_id, "kind": deferred.kind, "event": deferred.event, "tries": deferred.tries},
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

    def describe(self) -> str:
        return f"wake run {self.run_id}" if self.run_id else f"wake the blocked runs of {self.function_id}"


class WakeMessage(BaseModel):
    """The dispatch-queue message that carries a wake order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    wake: WakeOrder

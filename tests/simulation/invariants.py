"""The invariants the simulator checks, as RFD 1 states them (docs/design/invariants.md explains each).

The new dispatch path (issue 25, decision 33) adds its own (:meth:`Checker._dispatch_rules`,
:meth:`Checker.heartbeat_replied`): an attempt answered ``accepted`` is settled only by its posted outcome (the
same outcome), an operator, or, once Unknown, a retry the step consented to; an attempt goes Unknown by its lease
no sooner than its lease; a lease never runs past ``respond_by`` plus its grace, nor past one heartbeat interval
(plus the grace) after the latest heartbeat; a heartbeat never changes an attempt that is not in flight; a
heartbeat's reply says the run is stopping only for a forward attempt in flight of a run with a stop intent.

Steps declared together (decision 30) add theirs (:meth:`Checker._siblings`): never more forward attempts in flight
(authorized or Unknown; a queued one is not running) than the function's ``max_parallel``; a group's siblings start
(their first attempt in the group) in the order the pass that reported them declared them; none starts after the
stop intent, nor after a sibling of its group failed for good; the next discovery is not authorized while a sibling
of the group runs; no compensation is authorized while a forward attempt is in flight (an Unknown sibling blocks
the unwind). The unwind's order (reverse completion, one at a time) is :meth:`Checker.effect`'s, siblings included.

:meth:`Checker.committed` runs on every write that commits, with the state written; :meth:`Checker.effect`
runs as a callback or compensator starts executing, with the request that carries it and the durable state
at that moment; :meth:`Checker.at_end` compares fault-free runs with what their code says they must end with.
Decisions 23-29 are checked at the same moments by :class:`.decisions.Decisions`.
"""

from __future__ import annotations

import threading
from collections import Counter
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from ryusen._internal.wire import Heartbeat, HeartbeatReply, Phase, TaskRequest
from ryusen_server.core.model import (
    Attempt,
    AttemptStatus,
    CompensationStatus,
    Outcome,
    Recovery,
    RunPhase,
    RunState,
    StepState,
    StepStatus,
)

from . import workload
from .decisions import Decisions, Key, omitted_success

if TYPE_CHECKING:
    from .world import Simulation

SETTLED = frozenset(
    {AttemptStatus.SUCCEEDED, AttemptStatus.FAILED, AttemptStatus.RETRY_AUTHORIZED, AttemptStatus.FENCED}
)
LIVE = frozenset({AttemptStatus.QUEUED, AttemptStatus.AUTHORIZED, AttemptStatus.UNKNOWN})
PHASE_ORDER = {RunPhase.RUNNING: 0, RunPhase.SETTLING: 1, RunPhase.COMPENSATING: 2, RunPhase.FINISHED: 3}
FINISHED_RECOVERY = frozenset({Recovery.NOT_REQUIRED, Recovery.COMPENSATED, Recovery.PARTIALLY_COMPENSATED})
UNWOUND = frozenset({CompensationStatus.COMPENSATED, CompensationStatus.SKIPPED})

POSTED = {"succeeded": AttemptStatus.SUCCEEDED, "failed": AttemptStatus.FAILED}
"""What a posted outcome of each type settles its attempt as."""


class Checker:
    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.authorized: set[Key] = set()
        """Every attempt some committed write authorized."""
        self.at_stop: dict[str, set[tuple[str, int]]] = {}
        """Per stopped run: the forward attempts authorized before the write that recorded its stop intent."""
        self.accepted: dict[tuple[str, str], tuple[int, str]] = {}
        """(run, step) -> the generation whose success was accepted, and its result as JSON."""
        self.settled: dict[Key, tuple[str, str | None]] = {}
        self.outcome: dict[str, Outcome] = {}
        self.phase: dict[str, RunPhase] = {}
        self.version: dict[str, int] = {}
        self.ran: set[Key] = set()
        self.finished: set[str] = set()
        self.decisions = Decisions(sim.ground, self.fail, unstable_after=sim.settings.unstable_after)
        self.blockers_seen: Counter[str] = Counter()
        """Runs that showed each blocker type (figures)."""
        self._blocked: set[tuple[str, str]] = set()
        self.last_beat: dict[Key, datetime] = {}
        """The latest heartbeat each attempt's writes have shown (two containers' clocks: not always the last)."""
        self.seen: dict[Key, tuple[AttemptStatus, object, str, object]] = {}
        """Each attempt as the last write showed it: status, heartbeat time, its details, lease."""
        self.ack_settled: set[Key] = set()
        self.stopped_early: set[Key] = set()
        self.unknown_seen: set[Key] = set()
        self.waits: dict[tuple[str, str], datetime] = {}
        """Each step's wait's due time as first recorded (decision 31)."""
        self.slept: set[Key] = set()
        self.groups: dict[str, _Group] = {}
        """Per run, the group of steps declared together it runs (or ran last) (decision 30)."""
        self.discoveries_authorized: dict[str, int] = {}
        """Per run, the discovery it had authorized at the last write checked."""
        self.run_group: dict[str, int | None] = {}
        """Per run, its ``group`` as the last write showed it."""
        self.forward_seen: dict[tuple[str, str], int] = {}
        """(run, step) -> its forward attempts as of the last write."""

    def fail(self, text: str) -> None:
        self.sim.violation(text)

    # ---- every committed write ----------------------------------------------------------------------

    def committed(self, state: RunState) -> None:
        run = state.id
        if state.version <= self.version.get(run, -1):
            self.fail(f"{run}: version {state.version} written after {self.version[run]}")
        self.version[run] = state.version
        stopped_before = run in self.at_stop
        if state.stop_intent is not None and not stopped_before:
            self.at_stop[run] = {(k[1], k[3]) for k in self.authorized if k[0] == run and k[2] == "forward"}
        for step in state.steps:
            live = {Phase.FORWARD: 0, Phase.COMPENSATION: 0}
            for a in step.attempts:
                key = (run, step.id, a.phase.value, a.generation)
                if a.status in LIVE:
                    live[a.phase] += 1
                if a.authorized_at is not None and key not in self.authorized:
                    self.authorized.add(key)
                    if a.phase is Phase.FORWARD and stopped_before:
                        self.fail(f"{run}: forward {step.id} #{a.generation} authorized after the stop intent")
                if a.status in SETTLED:
                    seen = (a.status.value, a.settled_at.isoformat() if a.settled_at else None)
                    if self.settled.setdefault(key, seen) != seen:
                        self.fail(
                            f"{run}: {step.id} {a.phase.value} #{a.generation} settled twice: {self.settled[key]} then {seen}"
                        )
                elif key in self.settled:
                    self.fail(
                        f"{run}: {step.id} {a.phase.value} #{a.generation} was {self.settled[key]}, now {a.status.value}"
                    )
                self._dispatch_rules(run, step, a, key)
            if any(n > 1 for n in live.values()):
                self.fail(f"{run}: {step.id} has more than one live attempt in a phase")
            # a success is accepted (the step completed), unless the callback returned too much: then the step
            # waits for an operator (decisions 25), who may move past that success (retry or fail it)
            succeeded = [
                a
                for a in step.attempts
                if a.phase is Phase.FORWARD
                and a.status is AttemptStatus.SUCCEEDED
                and not _moved_past(a)
                and not (omitted_success(step, a) and step.status is StepStatus.PENDING)
            ]
            if succeeded and step.status is not StepStatus.COMPLETED:
                self.fail(f"{run}: {step.id} #{succeeded[0].generation} succeeded but the step is {step.status.value}")
            if step.status is StepStatus.COMPLETED:
                winner = next(
                    (
                        a.generation
                        for a in reversed(step.attempts)
                        if a.phase is Phase.FORWARD and a.status is AttemptStatus.SUCCEEDED
                    ),
                    None,
                )
                if winner is None:
                    self.fail(f"{run}: {step.id} is completed with no succeeded forward attempt")
                else:
                    self.accepted.setdefault((run, step.id), (winner, _json(step.result)))
                    if (
                        step.external
                        and not (isinstance(step.result, dict) and step.result.get("generation") == winner)
                        and not any(a.resolution for a in step.attempts)
                    ):
                        # decision 32: the result a completion brought is the one its token's attempt took
                        self.fail(f"{run}: {step.id} #{winner} completed with {step.result!r}, not its token's")
        for (r, step_id), (generation, result) in self.accepted.items():
            if r != run:
                continue
            kept = state.step(step_id)
            attempt = kept.attempt(Phase.FORWARD, generation) if kept is not None else None
            if (
                kept is None
                or attempt is None
                or attempt.status is not AttemptStatus.SUCCEEDED
                or _json(kept.result) != result
            ):
                self.fail(f"{run}: the accepted result of {step_id} #{generation} was lost or changed")
        self._siblings(state)
        self._axes(state)
        for blocker in state.blockers:
            if (run, blocker.type.value) not in self._blocked:
                self._blocked.add((run, blocker.type.value))
                self.blockers_seen[f"runs blocked by {blocker.type.value}"] += 1
        if state.outcome is Outcome.TIMED_OUT and (run, "timed out") not in self._blocked:
            self._blocked.add((run, "timed out"))
            self.blockers_seen["runs timed out"] += 1
        if state.phase is RunPhase.FINISHED and state.outcome is not Outcome.COMPLETED and run not in self.finished:
            self.finished.add(run)
            self._unwound(state)
        self.decisions.committed(state)

    # ---- steps declared together (decision 30) ---------------------------------------------------------

    def _siblings(self, state: RunState) -> None:
        run = state.id
        running = _running(state)
        limit = max(spec.max_parallel for spec in self.sim.specs)
        if len(running) > limit:
            self.fail(
                f"{run}: {len(running)} forward attempts in flight {running}, max_parallel is {limit}: {_describe(state)}"
            )
        # (1: a step a repair pass found alone beside steps in flight waits for them, one at a time)
        allowed = {spec.max_parallel for spec in self.sim.specs} | {1}
        if state.max_parallel is not None and state.max_parallel not in allowed:
            self.fail(f"{run}: runs a group at max_parallel {state.max_parallel}; its code says {limit}")
        known = self.groups.get(run)
        reopened = known is not None and known.group == state.group  # an operator's retry reopens the same group
        if state.group is not None and state.group != self.run_group.get(run) and not reopened:
            self._group_recorded(state)
        self.run_group[run] = state.group
        group = self.groups.get(run)
        if group is not None:
            self._group_rules(state, group, running)
        compensating = [
            f"{s.id} #{a.generation}"
            for s in state.steps
            for a in s.attempts
            if a.phase is Phase.COMPENSATION and a.status is AttemptStatus.AUTHORIZED
        ]
        if compensating and running:
            self.fail(
                f"{run}: compensation {compensating} authorized while forward {running} is in flight (S8, P5):"
                f" {_describe(state)}"
            )
        for s in state.steps:
            self.forward_seen[(run, s.id)] = sum(1 for a in s.attempts if a.phase is Phase.FORWARD)

    def _group_recorded(self, state: RunState) -> None:
        """A write recorded a group: its siblings are the steps a pass an endpoint answered reported together, in
        the order it declared them. Steps already in flight before the write (a repair pass ran beside them, or a
        release no longer declares them) join it as started: they count against ``max_parallel``, and the
        discovery after the group waits for them."""
        run = state.id
        members = {s.id for s in state.steps if s.group == state.group}
        counts = {s.id: sum(1 for a in s.attempts if a.phase is Phase.FORWARD) for s in state.steps}
        running = {
            s.id
            for s in state.steps
            if s.group == state.group and _live(s) and counts[s.id] == self.forward_seen.get((run, s.id), 0)
        }
        declared = members - running
        order = next(
            (
                [i for i in ids if i in declared]
                for ids in reversed(self.sim.reported.get(run, []))
                if declared <= set(ids)
            ),
            None,
        )
        if order is None:
            self.fail(f"{run}: group {state.group} of {sorted(members)}: no pass reported these steps together")
            return
        self.sim.cases["a group of steps declared together recorded"] += 1
        if running:
            self.sim.cases["a group recorded beside steps in flight"] += 1
        order = sorted(running) + order
        base = {i: self.forward_seen.get((run, i), 0) - (1 if i in running else 0) for i in order}
        discovery = state.discovery.seq if state.discovery is not None else None
        self.groups[run] = _Group(state.group, order, base, discovery)

    def _group_rules(self, state: RunState, group: _Group, running: list[str]) -> None:
        run = state.id
        steps = {i: state.step(i) for i in group.order}
        started = [
            i
            for i, s in steps.items()
            if s is not None and sum(1 for a in s.attempts if a.phase is Phase.FORWARD) > group.base[i]
        ]
        # P2: in declaration order (a queued sibling has started: its authorization may race its siblings')
        if started != group.order[: len(started)]:
            self.fail(
                f"{run}: siblings {group.order} started as {started}: not in declaration order (P2): {_describe(state)}"
            )
        again = {i for ids in self.sim.reported.get(run, [])[group.reports_at_freeze :] for i in ids}
        if group.frozen is not None and not set(started) <= group.frozen | again:
            # a later pass that reports a sibling again declares it anew (the function caught the failure and
            # went on: an async function's gather does not cancel its other awaits): it may start then
            self.fail(
                f"{run}: sibling {sorted(set(started) - group.frozen)} started after {group.why} (P3, P4):"
                f" {_describe(state)}"
            )
        failed = [i for i, s in steps.items() if s is not None and s.status is StepStatus.FAILED]
        if group.frozen is None and (failed or state.stop_intent is not None):
            group.frozen = group.started
            group.reports_at_freeze = len(self.sim.reported.get(run, []))
            group.why = f"{failed[0]} failed for good" if failed else "the stop intent"
            self.sim.cases[f"a group halted: {'a sibling failed for good' if failed else 'a stop'}"] += 1
        group.started = set(started)
        in_flight = [i for i in group.order if any(r.startswith(f"{i} #") for r in running)]
        d = state.discovery
        repair = state.blocked_by_definition  # a wake's pass that repairs a blocker may run beside them
        authorized = d is not None and d.status is AttemptStatus.AUTHORIZED
        # checked as the pass is authorized: one authorized as a repair may still run when an operator then starts
        # a sibling
        newly = authorized and d is not None and self.discoveries_authorized.get(run) != d.seq
        if authorized and d is not None:
            self.discoveries_authorized[run] = d.seq
        if newly and d is not None and d.seq != group.discovery and in_flight and not repair:
            self.fail(
                f"{run}: discovery #{d.seq} authorized while siblings {in_flight} are in flight: {_describe(state)}"
            )
        if len(in_flight) > 1:
            self.sim.cases[f"siblings in flight at once: {len(in_flight)}"] += 1

    def _unwound(self, state: RunState) -> None:
        """A run that failed, was cancelled or timed out has finished: every accepted success was compensated
        (its compensator ran, or an operator declared it compensated), or skipped where its code has no
        compensator (the endpoint said so), or, past a compensation that failed for good, not reached."""
        run = state.id
        accepted = [
            s
            for s in state.steps
            if not s.sleep  # a durable wait is no effect: nothing to undo (decision 31)
            and any(
                a.phase is Phase.FORWARD and a.status is AttemptStatus.SUCCEEDED and not _moved_past(a)
                for a in s.attempts
            )
        ]
        if accepted and state.recovery is Recovery.NOT_REQUIRED:
            self.fail(f"{run}: finished {state.recovery.value} with accepted successes {[s.id for s in accepted]}")
        unwind = {e.step_id for e in state.unwind}
        for step in accepted:
            status = step.compensation_status
            undo = [a for a in step.attempts if a.phase is Phase.COMPENSATION]
            if step.id not in unwind:
                self.fail(f"{run}: the accepted success of {step.id} is not in the unwind")
            elif status is CompensationStatus.SKIPPED:
                if not any(a.status in (AttemptStatus.SUCCEEDED, AttemptStatus.FENCED) for a in undo):
                    self.fail(f"{run}: {step.id}'s compensation was skipped without asking the endpoint")
            elif status is CompensationStatus.COMPENSATED:
                if isinstance(step.result, dict) and "stopped" in step.result:
                    self.sim.cases["a callback that returned early on a stop: compensated in the unwind"] += 1
                ran = self.sim.executions[(run, step.id, "compensation")] > 0
                declared = any(
                    (run, step.id, "compensation", a.generation, "succeed") in self.sim.resolved for a in undo
                )
                if not ran and not declared:
                    self.fail(f"{run}: {step.id} is compensated, but its compensator never ran and no operator said so")
            elif status in (CompensationStatus.FAILED, CompensationStatus.NOT_REACHED):
                if state.recovery is not Recovery.PARTIALLY_COMPENSATED:
                    self.fail(f"{run}: {step.id}'s compensation is {status.value}, recovery {state.recovery}")
            else:
                self.fail(f"{run}: finished while {step.id}'s compensation is {status.value}")

    def _axes(self, state: RunState) -> None:
        run, phase, outcome, recovery = state.id, state.phase, state.outcome, state.recovery
        problem = None
        if (phase is RunPhase.RUNNING) != (outcome is None):
            problem = "running exactly while there is no outcome"
        elif outcome is Outcome.COMPLETED and (phase is not RunPhase.FINISHED or recovery is not None):
            problem = "a completed run is finished, with no recovery"
        elif phase is RunPhase.COMPENSATING and recovery is not Recovery.COMPENSATING:
            problem = "compensating with recovery compensating"
        elif phase is RunPhase.SETTLING and recovery not in (None, Recovery.PENDING):
            problem = "settling with recovery pending"
        elif phase is RunPhase.FINISHED and outcome is not Outcome.COMPLETED and recovery not in FINISHED_RECOVERY:
            problem = "a finished run that did not complete has its recovery's result"
        elif phase is RunPhase.FINISHED and state.finished_at is None:
            problem = "a finished run has its finish time"
        if problem is not None:
            self.fail(f"{run}: status axes: expected {problem}; got {phase}/{outcome}/{recovery}")
        if outcome is not None and self.outcome.setdefault(run, outcome) is not outcome:
            self.fail(f"{run}: outcome {self.outcome[run]} changed to {outcome}")
        before = self.phase.get(run, RunPhase.RUNNING)
        if PHASE_ORDER[phase] < PHASE_ORDER[before]:
            self.fail(f"{run}: phase went back from {before} to {phase}")
        self.phase[run] = phase

    # ---- the new dispatch path: acknowledged attempts and heartbeats (issue 25, decision 33) ----------------

    def _waits(self, run: str, step: StepState, a: Attempt, key: Key) -> None:
        """Decision 31: a wait's due time, once recorded, never moves; nothing starts before it; a sleep calls
        no endpoint and completes no earlier than its due time."""
        what = f"{run}: {step.id} {a.phase.value} #{a.generation}"
        if step.wait_until is not None:
            first = self.waits.setdefault((run, step.id), step.wait_until)
            if first != step.wait_until:
                self.fail(f"{run}: {step.id}'s wait moved from {first} to {step.wait_until}")
            early = a.authorized_at is not None and a.authorized_at < step.wait_until
            if a.phase is Phase.FORWARD and a.generation == 1 and early:
                self.fail(f"{what} started at {a.authorized_at}, before its wait ends at {step.wait_until}")
        if step.sleep and a.phase is Phase.FORWARD:
            if a.authorized_at is not None:
                self.fail(f"{what}: a durable wait called the endpoint")
            if a.status is AttemptStatus.SUCCEEDED and key not in self.slept:
                self.slept.add(key)
                if step.wait_until is None or a.settled_at is None or a.settled_at < step.wait_until:
                    self.fail(f"{what} completed at {a.settled_at}, before its wait ends at {step.wait_until}")
                else:
                    self.sim.cases["a durable wait completed at its time"] += 1

    def _dispatch_rules(self, run: str, step: StepState, a: Attempt, key: Key) -> None:
        what = f"{run}: {step.id} {a.phase.value} #{a.generation}"
        self._waits(run, step, a, key)
        if a.heartbeat_at is not None:
            self.last_beat[key] = max(self.last_beat.get(key, a.heartbeat_at), a.heartbeat_at)
        lease, grace = a.lease_expires_at, a.lease_grace_s
        waits = a.waiting_since is not None  # decision 32: its lease is the wait for the completion, not the answer
        if not waits and lease is not None and a.respond_by is not None and grace is not None and a.authorized_at:
            if lease > a.respond_by + timedelta(seconds=grace):
                self.fail(f"{what}: its lease runs to {lease}, past respond_by {a.respond_by} + {grace:g}s grace")
            if (beat_s := step.heartbeat_for(a.phase)) is not None:  # the forward callback's heartbeat only
                since = max(a.authorized_at, self.last_beat.get(key, a.authorized_at))
                if lease > since + timedelta(seconds=beat_s + grace):
                    self.fail(
                        f"{what}: its lease runs to {lease}, more than one heartbeat ({beat_s:g}s) and the"
                        f" grace after {since} (its start, or its latest heartbeat)"
                    )
        if (
            a.unknown_at is not None
            and not waits  # decision 32: a late answer of a step completed from outside extends the lease after
            and lease is not None
            and "lease expired" in (a.unknown_reason or "")
            and a.unknown_at < lease
        ):
            self.fail(f"{what} went Unknown at {a.unknown_at} by its lease, which runs to {lease}")
        if a.status is AttemptStatus.UNKNOWN and key not in self.unknown_seen:
            self.unknown_seen.add(key)
            if "no heartbeat within" in (a.unknown_reason or ""):
                self.sim.cases[f"{a.phase.value} attempt Unknown by a missed heartbeat (before its timeout)"] += 1
        shown = (a.status, a.heartbeat_at, _json(a.heartbeat_details), lease)
        before = self.seen.get(key)
        self.seen[key] = shown
        if (
            before is not None
            and before[0] not in (AttemptStatus.QUEUED, AttemptStatus.AUTHORIZED)
            and before[1:] != shown[1:]
            and not (waits and before[0] is AttemptStatus.UNKNOWN)  # its late answer: it waits for completion
        ):
            self.fail(f"{what} was {before[0].value}, and its heartbeat or lease changed: {before[1:]} -> {shown[1:]}")
        if step.external and (a.waiting_since is not None or a.status is not AttemptStatus.UNKNOWN):
            self.ack_settled.add(key)  # decision 32: a completion, its timeout or a stop settles it, not the post
        if key in self.sim.accepted_by_endpoint and a.status in SETTLED and key not in self.ack_settled:
            self.ack_settled.add(key)
            self._acknowledged_settled(what, a, key, before[0] if before is not None else None)
        if (
            a.phase is Phase.FORWARD
            and a.status is AttemptStatus.SUCCEEDED
            and step.status is StepStatus.COMPLETED
            and isinstance(step.result, dict)
            and "stopped" in step.result
            and key not in self.stopped_early
        ):
            self.stopped_early.add(key)
            self.sim.cases["a callback that returned early on a stop: its success accepted"] += 1

    def _acknowledged_settled(self, what: str, a: Attempt, key: Key, before: AttemptStatus | None) -> None:
        """An attempt its endpoint answered ``accepted`` is settled by its posted outcome, an operator, or a retry
        of its Unknown the step consented to (``on_unknown="retry"``): by nothing else."""
        if a.resolution is not None:
            return
        if a.status is AttemptStatus.FAILED and a.error is not None and a.error.type == "unknown_outcome":
            return
        actor = self.sim._by_thread.get(threading.get_ident())
        posting = actor.posting if actor is not None else None
        if (posting is None or posting[0] != key) and key in self.sim.posted_outcomes:
            posting = (key, self.sim.posted_outcomes[key])  # posted, deferred by the result function: its receiver
        if posting is None or posting[0] != key:
            self.fail(f"{what} was answered accepted, and is {a.status.value} by no posted outcome nor operator")
        elif posting[1] in POSTED and POSTED[posting[1]] is not a.status:
            self.fail(f"{what}: its posted outcome was {posting[1]}, and it is recorded {a.status.value}")
        else:
            self.sim.cases[f"acknowledged attempt settled by its posted outcome ({a.status.value})"] += 1
            if before is AttemptStatus.UNKNOWN:
                self.sim.cases["acknowledged attempt Unknown by its lease, then settled by its posted outcome"] += 1

    def heartbeat_replied(self, beat: Heartbeat, reply: HeartbeatReply) -> None:
        """Right after the engine answered a heartbeat (nothing else has run since its write)."""
        run = beat.run_id
        what = f"{run}: heartbeat of {beat.step_id} {beat.phase.value} #{beat.generation}"
        state = self.sim.store.peek(run)
        step = state.step(beat.step_id) if state is not None else None
        attempt = step.attempt(beat.phase, beat.generation) if step is not None else None
        if reply.current and (attempt is None or attempt.status is not AttemptStatus.AUTHORIZED):
            self.fail(f"{what}: the reply says it is in flight; it is {attempt.status.value if attempt else 'absent'}")
        if reply.stop_requested is not None:
            if state is None or state.stop_intent is None:
                self.fail(f"{what}: the reply says the run is stopping; it has no stop intent")
            elif beat.phase is not Phase.FORWARD or not reply.current:
                self.fail(f"{what}: the reply says stop to an attempt that is not a forward one in flight")
            elif state.stop_intent.kind.value != reply.stop_requested:
                self.fail(f"{what}: the reply says {reply.stop_requested}, the stop intent is {state.stop_intent.kind}")
            else:
                self.sim.cases[f"a heartbeat's reply said stop ({reply.stop_requested})"] += 1

    # ---- every callback execution ---------------------------------------------------------------------

    def effect(self, request: TaskRequest, step_id: str, phase: str, build: str | None, received: object) -> None:
        run = request.run_id
        operation = request.operation
        if operation is None or request.step_id != step_id or operation.phase.value != phase:
            self.fail(f"{run}: {step_id} {phase} ran in a request for {request.step_id} {operation}")
            return
        gen = operation.generation
        key = (run, step_id, phase, gen)
        if key not in self.authorized:
            self.fail(f"{run}: {step_id} {phase} #{gen} ran without a durable authorization")
        if key in self.ran:
            self.fail(f"{run}: {step_id} {phase} #{gen} ran twice")
        self.ran.add(key)
        state = self.sim.store.peek(run)
        assert state is not None
        step = state.step(step_id)
        if step is None:
            self.fail(f"{run}: {step_id} ran but the run has no such step")
            return
        if phase == "forward" and run in self.at_stop and (step_id, gen) not in self.at_stop[run]:
            self.fail(f"{run}: forward {step_id} #{gen} ran, authorized after the stop intent")
        declared = step.retry if phase == "forward" else step.compensate_retry
        consented = declared is not None and declared.on_unknown == "retry"
        for a in step.attempts:
            if a.phase.value != phase or a.generation >= gen:
                continue
            if a.status is AttemptStatus.SUCCEEDED and not _moved_past(a):
                self.fail(f"{run}: {step_id} {phase} ran again (#{gen}) after #{a.generation}'s success was accepted")
            elif a.status in (AttemptStatus.QUEUED, AttemptStatus.AUTHORIZED):
                self.fail(f"{run}: {step_id} {phase} #{gen} ran while #{a.generation} is {a.status.value}")
            elif not consented and (
                a.status is AttemptStatus.UNKNOWN
                or (a.status is AttemptStatus.FAILED and a.error is not None and a.error.type == "unknown_outcome")
            ):
                # an Unknown is run again only with consent: the step's declared on_unknown="retry", or an
                # operator's retry (retry_authorized); a failure a late result or an operator reported is not Unknown
                self.fail(f"{run}: {step_id} {phase} #{gen} ran past Unknown #{a.generation} without consent")
        self.decisions.effect(state, step, phase, gen, build, received)
        if phase == "forward":
            return
        if not any(a.phase is Phase.FORWARD and a.status is AttemptStatus.SUCCEEDED for a in step.attempts):
            self.fail(f"{run}: {step_id} is compensated but its success was never accepted")
        for other in state.steps:
            forward = [a for a in other.attempts if a.phase is Phase.FORWARD]
            if forward and forward[-1].status in (AttemptStatus.AUTHORIZED, AttemptStatus.UNKNOWN):
                self.fail(
                    f"{run}: {step_id} compensated while {other.id} #{forward[-1].generation} is {forward[-1].status.value}"
                )
            if other.id == step_id:
                continue
            busy = [
                a
                for a in other.attempts
                if a.phase is Phase.COMPENSATION and a.status in (AttemptStatus.AUTHORIZED, AttemptStatus.UNKNOWN)
            ]
            if busy:
                self.fail(
                    f"{run}: {step_id} compensated while {other.id}'s compensation #{busy[0].generation} is {busy[0].status.value}"
                )
            later = (
                other.status is StepStatus.COMPLETED
                and other.has_compensation
                and other.completed_seq is not None
                and step.completed_seq is not None
                and other.completed_seq > step.completed_seq
            )
            if later and other.compensation_status not in UNWOUND:
                self.fail(
                    f"{run}: {step_id} compensated before {other.id}, which completed later"
                    f" (its compensation is {other.compensation_status.value})"
                )

    # ---- at the end -----------------------------------------------------------------------------------

    def at_end(self) -> None:
        sim = self.sim
        if not sim.profile.is_clean:
            return
        if sim.queue.dead:
            self.fail(f"a fault-free seed put {len(sim.queue.dead)} messages on the dead-letter queue")
        for run in sim.run_ids:
            state = sim.store.peek(run)
            assert state is not None
            want = workload.expected(sim.spec, sim.inputs[run])
            got = (state.outcome.value if state.outcome else None, state.recovery.value if state.recovery else None)
            if got != (want.outcome, want.recovery) or (
                want.outcome == "completed" and _json(state.output) != _json(want.output)
            ):
                self.fail(
                    f"{run}: ended {got} with {state.output!r}; its code says {want.outcome}/{want.recovery} with {want.output!r}"
                )
            for step_id, times in want.forward.items():
                if sim.executions[(run, step_id, "forward")] != times:
                    self.fail(f"{run}: {step_id} ran {sim.executions[(run, step_id, 'forward')]} times, not {times}")
            for step_id, times in want.undo_runs.items():
                if sim.executions[(run, step_id, "compensation")] != times:
                    self.fail(
                        f"{run}: {step_id}'s compensator ran {sim.executions[(run, step_id, 'compensation')]} times, not {times}"
                    )
            order = [e.step_id for e in state.unwind if e.status is CompensationStatus.COMPENSATED]
            # reverse completion order: steps declared together complete in any order among themselves (P3)
            seq = {s.id: s.completed_seq or 0 for s in state.steps}
            if not want.exact:
                continue
            if sorted(order) != sorted(want.undone) or order != sorted(order, key=lambda i: -seq[i]):
                self.fail(f"{run}: compensated {order}, not {want.undone} in reverse completion order")
            elif not any(g.parallel for g in sim.spec.groups) and order != want.undone:
                self.fail(f"{run}: compensated {order}, not {want.undone}")

    def describe(self, run: str) -> str:
        state = self.sim.store.peek(run)
        if state is None:
            return f"{run}: not written"
        return _describe(state)


def _live(step: StepState) -> bool:
    current = step.current(Phase.FORWARD)
    return current is not None and current.status in (
        AttemptStatus.QUEUED,
        AttemptStatus.AUTHORIZED,
        AttemptStatus.UNKNOWN,
    )


def _describe(state: RunState) -> str:
    """One line: the run's axes, blockers, discovery, group, and each step with its attempts."""
    run = state.id
    steps = ", ".join(
        f"{s.id}:{s.status.value}/{s.compensation_status.value}{f'<g{s.group}>' if s.group is not None else ''}["
        + " ".join(f"{a.phase.value[0]}{a.generation}={a.status.value}" for a in s.attempts)
        + "]"
        for s in state.steps
    )
    discovery = (
        f"discovery #{state.discovery.seq} {state.discovery.status.value}" if state.discovery else "no discovery"
    )
    blockers = [b.type.value for b in state.blockers]
    return (
        f"{run} v{state.version} {state.phase.value}/{state.outcome}/{state.recovery} blockers={blockers}"
        f" due={state.work_due_at()} {discovery} group={state.group}; {steps}"
    )


class _Group:
    """A group of steps declared together as the checker follows it (decision 30): from the write that recorded
    it, whatever the engine does with the steps' ``group`` since."""

    def __init__(self, group: int | None, order: list[str], base: dict[str, int], discovery: int | None) -> None:
        self.group = group
        self.order = order
        """Its siblings, in the order the pass declared them."""
        self.base = base
        """Each sibling's forward attempts before the group was recorded: one more means it started."""
        self.discovery = discovery
        """The discovery the run held when the group was recorded (the pass that reported it)."""
        self.started: set[str] = set()
        """The siblings started as of the last write."""
        self.frozen: set[str] | None = None
        """Once a sibling failed for good, or the run's stop intent: the siblings started before (no other may)."""
        self.why = ""
        self.reports_at_freeze = 0
        """How many passes had reported steps when it froze (a pass after may declare a sibling again)."""


def _running(state: RunState) -> list[str]:
    """Forward attempts in flight: authorized (its callback may run), or Unknown (it may still be running)."""
    return [
        f"{s.id} #{a.generation}"
        for s in state.steps
        for a in s.attempts
        if a.phase is Phase.FORWARD and a.status in (AttemptStatus.AUTHORIZED, AttemptStatus.UNKNOWN)
    ]


def _moved_past(attempt: Attempt) -> bool:
    """A success an operator moved past: a result over the limit they retried (consent to run the callback
    again) or declared failed (decisions 25). Its step's outcome is what came after."""
    return attempt.resolution is not None and attempt.resolution.action in ("retry", "fail")


def _json(value: object) -> str:
    import json

    return json.dumps(value, sort_keys=True, default=str)

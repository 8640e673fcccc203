"""The whole server under a deterministic fault simulation (issue 12; tests/simulation, docs/testing.md).

Each seed generates a workflow and a fault profile, runs one to three runs of it through the real engine,
store, queue, timers and SDK with faults at every I/O boundary, checks the invariants at every committed
write and callback, and liveness at the end. CI runs a fixed number of seeds; run more with

    RYUSEN_SIM_SEEDS=10000 .venv/bin/pytest tests/conformance/test_simulation.py -k seeds
    .venv/bin/python bench/simulate.py --seeds 10000      # the same, with figures

A failing seed prints its trace; replay it alone with ``bench/simulate.py --seed N --trace``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from ryusen._internal.wire import CallbackSucceeded, ErrorInfo, TargetNotFound
from ryusen_server.core import decide as decide_module
from ryusen_server.core import view as view_module
from ryusen_server.core.events import InvokeTask
from ryusen_server.core.model import AttemptStatus, CompensationStatus, StepStatus
from ryusen_server.engine import Engine, SweepReport
from tests.simulation.world import Profile, Simulation

SEEDS = int(os.environ.get("RYUSEN_SIM_SEEDS", "400"))


def _run(seed: int, profile: Profile | None = None, *, new_dispatch: bool = True) -> Any:
    report = Simulation(seed, profile, new_dispatch=new_dispatch).run()
    if report.violations:
        pytest.fail(f"seed {seed}: {report.violations[0]}\n\n{report.trace_text()}", pytrace=False)
    return report


@pytest.mark.rfd("U8", "O4")
@pytest.mark.parametrize("block", range(8))
def test_seeds(block: int) -> None:
    """Every seed, in eight blocks (each a test, so a failure names its block and the suite can spread them)."""
    for seed in range(block, SEEDS, 8):
        _run(seed)


REGRESSION_SEEDS = {
    3: "a compensator that opened a step inside it ran again with the same build when the probe woke the unwind:"
    " the hold looked at the queued attempt being authorized, not at the one that ran (issue 23; test_nested_steps.py"
    " has it alone)",
    1134: "the simulator's own check of decision 23 took an operator's resolution of a later generation of a"
    " compensation (which moves the step on: its failure is retried under the policy) for a re-run without consent",
    1193: "the simulator's own check of decision 25 counted an oversized answer the engine had not yet heard (the"
    " attempt still authorized) as a success the step should be held on",
    6205: "an operator's retry of an older attempt whose callback opened a step, while a later generation was still"
    " Unknown, queued a second live attempt (issue 23's second review let an older held attempt be resolved;"
    " test_nested_steps.py has it alone)",
    2510: "an operator's retry of an Unknown, after a day-long clock jump, lost its message; the sweeper fired the"
    " day-old probe and, judging the run by it, looked at it again a day later (test_sweeper.py has it alone)",
    2275: "a probe that fired a day late queued a blocked compensation again but kept its spent probe time, so"
    " the run looked a day overdue and the sweeper, backing off, left the compensation's lost message for a day",
    9750: "a dispatcher's recheck of the release, answered late by a copy that lagged, took its process back to the"
    " release before after another thread of it had used the newer one (test_continuation.py has it alone)",
    8172: "a deferred answer's receiver claimed a chained attempt (never sent) of an acknowledging release and"
    " re-authorized it with the lease of one that neither acknowledges nor heartbeats: its timeout plus 60 s, not"
    " one heartbeat interval plus 3 s (issue 25; test_acknowledged_dispatch.py has it alone)",
}
"""Seeds that found a bug, with what they found (each fixed, each also a test of its own elsewhere). Each runs as
it did when it found the bug (a seed before issue 25's dispatch path: ``new_dispatch=False``) and as it runs now."""


@pytest.mark.parametrize("seed", sorted(REGRESSION_SEEDS))
def test_regression_seed(seed: int) -> None:
    _run(seed, new_dispatch=False)  # as the seed ran when it found the bug (before issue 25's dispatch path)
    _run(seed)


def test_a_seed_replays_exactly() -> None:
    first = Simulation(17).run()
    again = Simulation(17).run()
    assert first.events > 50 and sum(first.faults.values()) > 0
    assert first.trace == again.trace


def test_fault_free_seeds_end_as_their_code_says() -> None:
    """No fault, no operator, no release: each run's outcome, output, recovery, callback executions and
    compensation order are what the generated code says (``workload.expected``); dispatchers still race."""
    outcomes: set[str] = set()
    for seed in range(40):
        report = _run(seed, Profile.clean(random.Random(seed)))
        assert not report.faults
        outcomes.update(report.outcomes)
    assert {"completed/None", "failed/compensated"} <= outcomes  # fault-free code fails only by raising at its end


def test_faults_of_every_kind_are_injected() -> None:
    from tests.simulation.world import ALL_FAULTS, EVENT_FAULTS

    seen: set[str] = set()
    for seed in range(240):  # steps declared together (issue 27) drew other workflows: 120 seeds no longer do
        seen.update(f for f in _run(seed).faults if f not in EVENT_FAULTS)  # those have a test of their own
        if seen == ALL_FAULTS:
            break
    assert seen == ALL_FAULTS, f"never injected: {sorted(ALL_FAULTS - seen)}"


def test_faults_of_attempts_sent_as_events_are_injected() -> None:
    """Way C (attempts as Lambda events): every fault of Lambda's ``Invoke`` comes up, and each copy of an event
    Lambda delivers twice is refused by the replay memory the endpoint's instances share (the simulator's
    violation otherwise)."""
    from tests.simulation.world import EVENT_FAULTS

    seen: set[str] = set()
    events = 0
    for seed in range(400):
        report = _run(seed)
        seen.update(f for f in report.faults if f in EVENT_FAULTS)
        events += report.cases["attempt sent as an event"]
        if seen == set(EVENT_FAULTS):
            break
    assert seen == set(EVENT_FAULTS), f"never injected: {sorted(set(EVENT_FAULTS) - seen)}"
    assert events > 50


# ---- the simulator catches a broken engine ------------------------------------------------------------


def _reinvoke_on_expired_lease(original: Callable[..., Any]) -> Callable[..., Any]:
    """Broken: a dispatcher that finds an expired lease invokes the same generation again."""

    def outcome_lost(self: Any, step: Any, attempt: Any, detail: str) -> None:
        if "lease expired" in detail:
            from ryusen_server.core.model import TaskRef

            task = TaskRef(
                run_id=self.s.id,
                kind=decide_module.TaskKind.FORWARD
                if attempt.phase.value == "forward"
                else decide_module.TaskKind.COMPENSATE,
                step_id=step.id,
                generation=attempt.generation,
            )
            self.commands.append(InvokeTask(task=task))
            return None
        return original(self, step, attempt, detail)

    return outcome_lost


def _always_retry_unknowns(original: Callable[..., Any]) -> Callable[..., Any]:
    """Broken: every Unknown is retried, as if each step declared ``on_unknown="retry"``."""

    def policy(self: Any, step: Any, phase: Any) -> Any:
        return original(self, step, phase).model_copy(update={"on_unknown": "retry"})

    return policy


def _skip_compensation_after_a_stop(original: Callable[..., Any]) -> Callable[..., Any]:
    """Broken: after a cancel or a timeout, every compensation is marked skipped and none runs."""

    def advance_unwind(self: Any) -> Any:
        while self.s.stop_intent is not None and (entry := self.current_unwind_entry()) is not None:
            self.step(entry.step_id).compensation_status = CompensationStatus.SKIPPED
            self.set_unwind_status(entry.step_id, CompensationStatus.SKIPPED)
        return original(self)

    return advance_unwind


def _leave_a_late_success_out_of_the_unwind(original: Callable[..., Any]) -> Callable[..., Any]:
    """Broken: a forward success reported after the stop intent is accepted but never joins the unwind."""

    def forward_outcome(self: Any, step: Any, attempt: Any, response: Any) -> Any:
        if isinstance(response, CallbackSucceeded) and self.stopping and self.oversized_result(response.result) is None:
            self.settle(attempt, AttemptStatus.SUCCEEDED)
            step.status, step.result = StepStatus.FENCED, response.result
            return self.evaluate_recovery()
        return original(self, step, attempt, response)

    return forward_outcome


def _drop_resolutions(original: Callable[..., Any]) -> Callable[..., Any]:
    """Broken: an operator's resolution of an Unknown is accepted and changes nothing."""

    def resolve(self: Any, event: Any) -> Any:
        step = self.step(event.step_id)
        attempt = step.attempt(event.phase, event.generation) if step else None
        if attempt is not None and attempt.status is AttemptStatus.UNKNOWN:
            return self.ignore("dropped")
        return original(self, event)

    return resolve


def _nested_step_is_an_ordinary_failure(original: Callable[..., Any]) -> Callable[..., Any]:
    """Broken (decision 23, as before it): a callback that opened a step is an ordinary failure, retried."""

    def callback_opened_a_step(self: Any, step: Any, attempt: Any, error: Any, conflict: Any) -> Any:
        ordinary = ErrorInfo(type="ConcurrentStepError", message=error.message)  # retryable, and not held
        return self.attempt_failed(step, attempt, ordinary)

    return callback_opened_a_step


def _hold_the_queued_attempt(original: Callable[..., Any]) -> Callable[..., Any]:
    """Broken (decision 23, the bug the simulator found): the hold looks at the attempt being authorized (queued,
    so it never ran) instead of the one that ran, so a probe runs a compensator that nests again, same build."""

    def held_by(self: Any, step: Any, phase: Any, build_id: Any, *, before: Any = None) -> Any:
        ran = self.last_ran(step, phase)  # the queued attempt itself, when one is being authorized (not ``before``)
        if ran is None or ran.resolution is not None:
            return None
        if self.result_omitted(step, ran):
            return ran, decide_module.ResultTooLarge(step_id=step.id, omitted=step.omitted_result)
        if ran.opened_a_step and build_id is not None and ran.build_id == build_id:
            return ran, decide_module.nested_step_conflict(ran.error)
        return None

    return held_by


def _skip_a_target_not_reached(original: Callable[..., Any]) -> Callable[..., Any]:
    """Broken (decision 24, as before it): a compensation pass that ended before its target records a skip."""

    def compensation_outcome(self: Any, step: Any, attempt: Any, response: Any) -> Any:
        if isinstance(response, TargetNotFound) and response.reason == "not_reached":
            response = response.model_copy(update={"reason": "no_compensator"})
        return original(self, step, attempt, response)

    return compensation_outcome


def _oversized_result_fails(original: Callable[..., Any]) -> Callable[..., Any]:
    """Broken (decision 25, as before it): a callback that ran and returned too much is a failure."""

    def forward_result_omitted(self: Any, step: Any, attempt: Any, omitted: Any) -> Any:
        error = ErrorInfo(type="result_too_large", message=f"result is {omitted.size} bytes", retryable=False)
        return self.attempt_failed(step, attempt, error)

    return forward_result_omitted


def _forget_the_unknown(original: Callable[..., Any]) -> Callable[..., Any]:
    """Broken (decision 28, as before it): a late result or an operator settles an Unknown, and it reads as if
    it had never been Unknown."""

    def settle(self: Any, attempt: Any, status: Any, **kwargs: Any) -> Any:
        original(self, attempt, status, **kwargs)
        if status is not AttemptStatus.UNKNOWN:
            attempt.unknown_at = attempt.unknown_reason = None

    return settle


def _heartbeat_past_the_timeout(original: Callable[..., Any]) -> Callable[..., Any]:
    """Broken (decision 33): a heartbeat extends the lease a whole interval, past the attempt's timeout."""

    def heartbeat(self: Any, event: Any) -> Any:
        step = self.s.steps[i] if (i := self.s.step_index(event.step_id)) is not None else None
        attempt = step.current(event.phase) if step is not None else None
        if attempt is None or attempt.generation != event.generation or attempt.status is not AttemptStatus.AUTHORIZED:
            return original(self, event)
        original(self, event)
        step = self.step(event.step_id)
        attempt = step.current(event.phase)
        if step.heartbeat_s is not None:
            grace = timedelta(seconds=step.heartbeat_s + (attempt.lease_grace_s or 0.0))
            attempt.lease_expires_at = max(attempt.lease_expires_at, self.now + grace)
        return None

    return heartbeat


def _heartbeat_revives(original: Callable[..., Any]) -> Callable[..., Any]:
    """Broken (decision 33): a heartbeat of an attempt that is no longer in flight (Unknown, settled) is taken:
    its details kept, its lease extended."""

    def heartbeat(self: Any, event: Any) -> Any:
        step = self.step(event.step_id)
        attempt = step.attempt(event.phase, event.generation) if step is not None else None
        if attempt is None or attempt.status is AttemptStatus.AUTHORIZED or attempt.lease_expires_at is None:
            return original(self, event)
        attempt.heartbeat_at, attempt.heartbeat_details = self.now, event.details
        if step.heartbeat_s is not None and attempt.respond_by is not None:
            until = min(attempt.respond_by, self.now + timedelta(seconds=step.heartbeat_s))
            attempt.lease_expires_at = max(attempt.lease_expires_at, until)
        self.touch()
        return self.ignore("heartbeat")

    return heartbeat


def _expired_lease_fails(original: Callable[..., Any]) -> Callable[..., Any]:
    """Broken (issue 25): an attempt whose lease expired is failed (a timeout), not Unknown, so an acknowledged
    attempt whose outcome is still on its way is settled by nothing it did."""

    def outcome_lost(self: Any, step: Any, attempt: Any, detail: str) -> Any:
        if "lease expired" in detail:
            return self.attempt_failed(step, attempt, ErrorInfo(type="timeout", message=detail))
        return original(self, step, attempt, detail)

    return outcome_lost


BROKEN = {
    "compensation is skipped after a stop": (
        "advance_unwind",
        _skip_compensation_after_a_stop,
        ("skipped without asking the endpoint",),
    ),
    "a success after the stop is left out of the unwind": (
        "forward_outcome",
        _leave_a_late_success_out_of_the_unwind,
        ("succeeded but the step is",),
    ),
    "an operator's resolution does nothing": (
        "resolve",
        _drop_resolutions,
        ("still waits on an Unknown",),
    ),
    "an expired lease re-invokes its generation": (
        "outcome_lost",
        _reinvoke_on_expired_lease,
        ("ran twice", "ran without a durable authorization"),
    ),
    "forward work is not fenced by a stop": (
        "stopping",
        lambda original: property(lambda self: False),
        ("after the stop intent", "status axes", "compensated while", "authorized at or after the deadline"),
    ),
    "an Unknown is retried without consent": (
        "policy",
        _always_retry_unknowns,
        ("without consent",),
    ),
    "D23: a callback that opened a step is retried as an ordinary failure": (
        "callback_opened_a_step",
        _nested_step_is_an_ordinary_failure,
        ("opened a step inside the callback",),
    ),
    "D23: the hold looks at the queued attempt, not the one that ran": (
        "held_by",
        _hold_the_queued_attempt,
        ("opened a step inside the callback, and no operator resolved it (decisions 23)",),
    ),
    "D24: a compensation pass that ended before its target records a skip": (
        "compensation_outcome",
        _skip_a_target_not_reached,
        ("did not reach it with no compensator, the release does not retire it",),
    ),
    "D25: a callback that returned too much is recorded failed": (
        "forward_result_omitted",
        _oversized_result_fails,
        (
            "ran and succeeded (its result over the limit), recorded failed",
            "its posted outcome was succeeded, and it is recorded failed",  # the same, seen as its posted outcome
        ),
    ),
    "D26: the deadline is enforced only when its timer fires": (
        "enforce_deadline",
        lambda original: lambda self: None,
        ("at or after the deadline", "at or after its deadline"),
    ),
    "D28: an Unknown settled later forgets it was Unknown": (
        "settle",
        _forget_the_unknown,
        ("was Unknown at",),
    ),
    "H: a heartbeat extends a lease past the attempt's timeout": (
        "heartbeat",
        _heartbeat_past_the_timeout,
        ("past respond_by",),
    ),
    "H: a heartbeat changes an attempt no longer in flight": (
        "heartbeat",
        _heartbeat_revives,
        ("its heartbeat or lease changed", "went Unknown at"),
    ),
    "issue 25: an expired lease fails an attempt, even one answered accepted": (
        "outcome_lost",
        _expired_lease_fails,
        ("by no posted outcome nor operator",),
    ),
    "D29: step ids that change on every pass are never blocked": (
        "unstable_step_id",
        lambda original: lambda self, plan: None,
        ("with no unstable_step_id blocker (decisions 29)",),
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_the_simulator_catches_a_broken_core(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    attribute, breaks, expected = BROKEN[name]
    monkeypatch.setattr(decide_module._Transition, attribute, breaks(getattr(decide_module._Transition, attribute)))
    caught = _first_violation(range(300))
    assert caught is not None, f"{name}: 300 seeds found nothing"
    assert any(text in caught for text in expected), caught


def test_the_simulator_catches_a_summary_that_hides_an_operator_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken (decision 24): the summary does not count the operator's skips, so it says "fully compensated"."""
    monkeypatch.setattr(view_module, "operator_skips", lambda state: 0)
    caught = _first_violation(range(300))
    assert caught is not None and "the operator skipped" in caught, caught


def test_the_simulator_catches_a_heartbeat_reply_that_stops_a_run_with_no_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken (decision 33): every heartbeat's reply says the run is stopping (the callback returns early)."""
    submit = Engine.submit_heartbeat

    def stop_always(self: Engine, body: bytes, headers: dict[str, str]) -> Any:
        reply = submit(self, body, headers)
        return reply.model_copy(update={"stop_requested": "cancel"}) if reply.current else reply

    monkeypatch.setattr(Engine, "submit_heartbeat", stop_always)
    caught = _first_violation(range(300))
    assert caught is not None and "the reply says the run is stopping; it has no stop intent" in caught, caught


def test_the_simulator_catches_a_process_that_goes_back_to_a_release_a_lagging_copy_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Broken (R1): a recheck's eventually consistent answer is used unconfirmed, so a copy that lags takes a
    process back to a release it saw replaced (or to none)."""

    def unconfirmed(self: Engine, function_id: str) -> Any:
        if function_id not in self._releases_read:
            return self._read_release(function_id)
        release = self.store.get_release(function_id, consistent=False)
        self._releases_read[function_id] = (0.0, release, 0)
        return release

    monkeypatch.setattr(Engine, "_newest_release", unconfirmed)
    caught = _first_violation(range(300))
    assert caught is not None and "R1: a process went back to release" in caught, caught


def test_the_simulator_catches_a_missing_sweeper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the sweeper, a send lost after its write leaves a run that waits for nothing, silently."""
    monkeypatch.setattr(Engine, "sweep", lambda self, **_: SweepReport())
    caught = _first_violation(range(300))
    assert caught is not None and "stalled" in caught, caught


def _first_violation(seeds: range) -> str | None:
    for seed in seeds:
        report = Simulation(seed).run()
        if report.violations:
            return f"seed {seed}: {report.violations[0]}"
    return None

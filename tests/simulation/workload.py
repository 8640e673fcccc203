"""Generated workflows for the simulator: their shape, the code each release serves, and what a run of them
must end with when nothing goes wrong.

A workflow is groups of steps. A group may be wrapped in ``try/except StepFailed`` (the failure of one of its
steps skips the rest of the group), and a step inside it may be wrapped again (nested: its failure is handled
where it happens). A step's callback fails its first ``fails`` executions; with ``fails`` at least its
``max_attempts`` it fails for good. Compensators fail their first ``undo_fails`` executions, always fewer than
their attempts. The function may raise at its end (the run fails after every step succeeded).

Beyond that, the code users write that decisions 23-29 are about (issue 23): a callback (or a compensator) that
opens a step inside it; a guard on external state (the order was cancelled) that returns before a group, which
ends compensation passes before their target; a callback or compensator that returns more than the value limit
(over the simulated server's limit, or over the SDK's own 256 KiB); a callback that takes virtual time (so a
run's deadline falls while it runs); a step id that changes on every pass. None of them is in a fault-free
seed's workflow.

Steps declared together (decision 30): a group may declare its steps together (``step.parallel``: 2 to 5 siblings,
run up to the function's ``max_parallel`` at once), a sibling's durable wait a sibling of its own; each sibling
fails, retries, goes Unknown or fails for good on its own, and one that fails for good raises at the group's await
(as ``gather`` does) once its siblings in flight have settled.

And long steps (decision 33): a step may declare ``heartbeat=`` (and a timeout a few intervals long); its callback
works a while between heartbeats (``ryusen.heartbeat``), a few times, and returns early, with a result of its own,
once a heartbeat says the run is stopping (``StopRequested``). How long each pause is, and whether the callback goes
silent, the world decides (:class:`Hooks`).

A release of the same app may rename, add, remove or retire steps, stop or start nesting, return less, make an
unstable id stable or drop the guard: :func:`variant` derives one from a workflow; :func:`fixed` is the release
an operator deploys as the remedy of a definition blocker.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Literal, Protocol

import ryusen
from ryusen import OmittedResult, RetryPolicy, Ryusen, Step, StepFailed, StopRequested, heartbeat
from ryusen._internal.wire import MAX_VALUE_BYTES

APP_ID = "sim"
FUNCTION_ID = "saga"
SERVER_VALUE_LIMIT = 16 * 1024
"""The simulated server's value limit (``EngineSettings.max_value_bytes``): a result over it but under the SDK's
256 KiB reaches the server, which omits it; one over 256 KiB the SDK omits itself (decisions 25: both paths)."""
BIG = {"server": SERVER_VALUE_LIMIT + 4096, "sdk": MAX_VALUE_BYTES + 1024}
"""How many bytes a ``big`` callback's result carries, by the limit it is over."""


@dataclass(frozen=True, slots=True)
class StepSpec:
    id: str
    fails: int
    """Executions of the callback that raise before one succeeds (at least ``max_attempts``: it fails for good)."""
    max_attempts: int
    compensate: bool
    undo_fails: int
    undo_attempts: int
    caught: bool
    """The function catches this step's ``StepFailed`` right where it is raised."""
    on_unknown: Literal["block", "retry"]
    undo_on_unknown: Literal["block", "retry"] = "block"
    nests: bool = False
    """The callback opens a step inside it and lets the refusal escape (decisions 23)."""
    undo_nests: bool = False
    big: Literal["", "server", "sdk"] = ""
    """The callback returns more than the limit: the server's, or the SDK's own (decisions 25)."""
    undo_big: bool = False
    takes_s: float = 0.0
    """Virtual time the callback takes: a run's deadline may pass while it runs (decisions 26)."""
    unstable: bool = False
    """Its id changes on every pass, as one made from a random number or the clock would (decisions 29)."""
    heartbeat_s: float | None = None
    """Decision 33: the step declares this heartbeat interval (and ``timeout_s``); its callback posts ``beats``
    heartbeats, working ``beat_every_s`` of virtual time before each (more than the interval: its lease may end)."""
    beats: int = 0
    beat_every_s: float = 0.0
    timeout_s: float | None = None
    wait_s: float = 0.0
    """Decision 31: a durable wait (``step.sleep``) of this many seconds of virtual time comes before the step."""
    external_s: float = 0.0
    """Decision 32: the step is completed from outside within this many seconds (its callback hands out the
    token; an approver in the world completes it, or the timeout fails it)."""

    @property
    def succeeds(self) -> bool:
        return self.fails < self.max_attempts

    @property
    def plain(self) -> bool:
        """None of decisions 23-29's cases: a fault-free run of it ends as :func:`expected` says."""
        return not (
            self.nests or self.undo_nests or self.big or self.undo_big or self.takes_s or self.unstable or self.beats
        )


@dataclass(frozen=True, slots=True)
class GroupSpec:
    steps: tuple[StepSpec, ...]
    caught: bool
    """The group is wrapped in ``try/except StepFailed``: a failure of one of its steps skips the rest of it."""
    parallel: bool = False
    """Decision 30: its steps are declared together (``step.parallel``; a step's wait is a sibling before it), and
    none of them is caught alone: the first that fails for good raises at the group's await."""


@dataclass(frozen=True, slots=True)
class WorkflowSpec:
    groups: tuple[GroupSpec, ...]
    raise_at_end: bool
    release: int = 0
    """Which release of the app this is (0: the first)."""
    guard_at: int | None = None
    """Before this group the function returns early if the run's order is cancelled (an external read): a
    compensation pass that meets the guard ends before its target (decisions 24)."""
    retired: tuple[str, ...] = ()
    """Step ids this release retires (``@app.function(retired_steps=...)``)."""
    max_parallel: int = 10
    """Decision 30: how many steps declared together may run at once (``@app.function(max_parallel=...)``)."""

    @property
    def steps(self) -> list[StepSpec]:
        return [s for g in self.groups for s in g.steps]

    def step_spec(self, step_id: str) -> StepSpec | None:
        """The step this code calls ``step_id`` (an unstable id is its step's id, ``-q`` and a number)."""
        base = step_id.rsplit("-q", 1)[0]
        return next((s for s in self.steps if s.id == step_id or (s.unstable and s.id == base)), None)

    def describe(self) -> str:
        parts = []
        for gi, g in enumerate(self.groups):
            inner = " ".join(
                f"{s.id}{'!' if not s.succeeds else ''}{f'~{s.fails}' if s.fails else ''}"
                f"{'+undo' if s.compensate else ''}{'(caught)' if s.caught else ''}"
                f"{'[retry-unknown]' if s.on_unknown == 'retry' else ''}"
                f"{'[nests]' if s.nests else ''}{'[undo-nests]' if s.undo_nests else ''}"
                f"{f'[big:{s.big}]' if s.big else ''}{'[undo-big]' if s.undo_big else ''}"
                f"{f'[{s.takes_s:g}s]' if s.takes_s else ''}{'[unstable-id]' if s.unstable else ''}"
                f"{f'[heartbeat {s.heartbeat_s:g}s x{s.beats} every {s.beat_every_s:g}s]' if s.heartbeat_s else ''}"
                f"{f'[after a {s.wait_s:g}s wait]' if s.wait_s else ''}"
                f"{f'[completed from outside within {s.external_s:g}s]' if s.external_s else ''}"
                for s in g.steps
            )
            guard = "guard: " if self.guard_at == gi else ""
            inner = f"together({inner})" if g.parallel else inner
            parts.append(guard + (f"try{{{inner}}}" if g.caught else inner))
        retired = f" | retires {','.join(self.retired)}" if self.retired else ""
        together = f" | max_parallel {self.max_parallel}" if any(g.parallel for g in self.groups) else ""
        return " | ".join(parts) + (" | raise" if self.raise_at_end else "") + retired + together


def generate(
    rng: random.Random,
    *,
    clean: bool = False,
    long_steps: random.Random | None = None,
    waits: random.Random | None = None,
    parallel: random.Random | None = None,
) -> WorkflowSpec:
    """A workflow of 1 to 4 groups of steps. ``clean``: every step succeeds first time, and none has a case of
    decisions 23-29 (a fault-free baseline's shape still varies: compensators, groups). ``long_steps``: where the
    steps that heartbeat are drawn from (a generator of their own, so a seed that draws none is the workflow it was
    before heartbeats); None: no step heartbeats. ``parallel``: where groups of steps declared together (decision
    30) and their extra siblings are drawn from (likewise); None: none is."""
    groups: list[GroupSpec] = []
    n = 0
    max_parallel = parallel.randint(1, 3) if parallel is not None else 10
    for _ in range(rng.randint(1, 4)):
        together = parallel is not None and parallel.random() < 0.35
        steps = []
        for _ in range(rng.randint(1, 2)):
            steps.append(_draw_step(rng, f"s{n}", clean, long_steps, waits))
            n += 1
        if together:
            assert parallel is not None
            for _ in range(max(0, parallel.randint(2, 5) - len(steps))):  # 2 to 5 siblings
                steps.append(_draw_step(parallel, f"s{n}", clean, long_steps, waits))
                n += 1
            steps = [replace(s, caught=False) for s in steps]  # the group's await raises the first failure
        groups.append(GroupSpec(tuple(steps), caught=rng.random() < 0.3, parallel=together))
    guard_at = rng.randrange(len(groups)) if not clean and rng.random() < 0.4 else None
    spec = WorkflowSpec(tuple(groups), raise_at_end=rng.random() < 0.2, guard_at=guard_at)
    return replace(spec, max_parallel=max_parallel) if any(g.parallel for g in groups) else spec


def _draw_step(
    rng: random.Random, step_id: str, clean: bool, long_steps: random.Random | None, waits: random.Random | None
) -> StepSpec:
    max_attempts = rng.randint(1, 3)
    fails = 0 if clean else rng.choice([0, 0, 0, 1, 2, max_attempts])
    undo_attempts = rng.randint(1, 3)
    spec = StepSpec(
        id=step_id,
        fails=fails,
        max_attempts=max_attempts,
        compensate=rng.random() < 0.7,
        undo_fails=0 if clean else rng.randint(0, undo_attempts - 1),
        undo_attempts=undo_attempts,
        caught=rng.random() < 0.25,
        on_unknown=rng.choice(["block", "block", "retry"]),
        undo_on_unknown=rng.choice(["block", "block", "retry"]),
    )
    if not clean:
        spec = _with_cases(spec, rng)
        if long_steps is not None:
            spec = _with_heartbeat(spec, long_steps)
        if waits is not None and waits.random() < 0.2:  # a generator of its own, as for long steps
            spec = replace(spec, wait_s=waits.choice([2.0, 45.0, 3600.0, 3 * 86400.0]))
        if waits is not None and waits.random() < 0.15 and spec.heartbeat_s is None and not spec.nests:
            spec = replace(spec, external_s=waits.choice([30.0, 600.0, 86400.0]), big="")
    return spec


def _with_cases(spec: StepSpec, rng: random.Random) -> StepSpec:
    """Decisions 23-29's cases, each now and then."""
    return replace(
        spec,
        nests=rng.random() < 0.07,
        undo_nests=spec.compensate and rng.random() < 0.05,
        big=rng.choice(["server", "sdk"]) if rng.random() < 0.08 else "",
        undo_big=spec.compensate and rng.random() < 0.1,
        takes_s=round(rng.uniform(1, 25), 1) if rng.random() < 0.4 else 0.0,
        unstable=rng.random() < 0.04,
    )


def _with_heartbeat(spec: StepSpec, rng: random.Random) -> StepSpec:
    """Now and then a long step (decision 33): a heartbeat interval, a timeout of a few intervals, and a callback
    that heartbeats one to five times, working up to 1.3 intervals before each (past its lease, sometimes)."""
    if rng.random() >= 0.3:
        return spec
    interval = rng.choice([4.0, 10.0, 20.0])
    return replace(
        spec,
        heartbeat_s=interval,
        timeout_s=interval * rng.choice([3, 8]),
        beats=rng.randint(1, 5),
        beat_every_s=round(interval * rng.uniform(0.2, 1.3), 1),
    )


VARIANTS = ("same", "rename", "add", "remove", "retire", "unnest", "nest", "shrink", "stabilize", "unguard")


def variant(spec: WorkflowSpec, rng: random.Random, release: int) -> tuple[WorkflowSpec, str]:
    """A later release of ``spec``'s app: the same code, or one step renamed, added, removed, or removed and
    retired; a step that stops (or starts) opening a step inside its callback; callbacks that return less; an
    unstable step id made stable; the guard dropped."""
    how = rng.choice(VARIANTS)
    groups = [list(g.steps) for g in spec.groups]
    flat = [(gi, si) for gi, g in enumerate(groups) for si in range(len(g))]
    gi, si = rng.choice(flat)
    retired = spec.retired
    guard_at = spec.guard_at
    chosen = groups[gi][si]
    if how == "rename":
        groups[gi][si] = replace(chosen, id=f"{chosen.id}r{release}")
    elif how == "add":
        new = StepSpec(f"n{release}", 0, 2, rng.random() < 0.5, 0, 1, False, "block")
        groups[gi].insert(rng.randint(0, len(groups[gi])), new)
    elif how in ("remove", "retire") and len(flat) > 1:
        del groups[gi][si]
        if how == "retire":
            retired = tuple(sorted({*retired, chosen.id}))
    elif how == "unnest" and any(s.nests or s.undo_nests for s in spec.steps):
        groups = [[replace(s, nests=False, undo_nests=False) for s in g] for g in groups]
    elif how == "nest":
        groups[gi][si] = replace(chosen, nests=True)
    elif how == "shrink" and any(s.big or s.undo_big for s in spec.steps):
        groups = [[replace(s, big="", undo_big=False) for s in g] for g in groups]
    elif how == "stabilize" and any(s.unstable for s in spec.steps):
        groups = [[replace(s, unstable=False) for s in g] for g in groups]
    elif how == "unguard" and guard_at is not None:
        guard_at = None
    else:
        how = "same"
    kept = [(replace(spec.groups[i], steps=tuple(g)), i) for i, g in enumerate(groups) if g]
    if guard_at is not None:  # the guard stays before the same group (or the next one left)
        later = [k for k, (_, i) in enumerate(kept) if i >= guard_at]
        guard_at = later[0] if later else None
    return replace(spec, groups=tuple(g for g, _ in kept), release=release, retired=retired, guard_at=guard_at), how


def fixed(spec: WorkflowSpec, release: int, ids_seen: set[str]) -> WorkflowSpec:
    """What an operator deploys as the remedy of a definition blocker: ``spec`` (the first code) with no step
    opened inside a callback, results within the limit, stable step ids and no guard, retiring every step id
    an earlier release had that this one does not (renamed or added steps: their compensation passes cannot
    reach them)."""
    groups = tuple(
        replace(
            g,
            steps=tuple(
                replace(s, nests=False, undo_nests=False, big="", undo_big=False, unstable=False) for s in g.steps
            ),
        )
        for g in spec.groups
    )
    own = {s.id for g in groups for s in g.steps}
    return replace(spec, groups=groups, release=release, guard_at=None, retired=tuple(sorted(ids_seen - own)))


@dataclass(frozen=True, slots=True)
class Expected:
    outcome: str
    recovery: str | None
    output: Any
    forward: dict[str, int]
    """Executions of each step's callback."""
    undone: list[str]
    """The steps compensated, in order (in reverse completion order: steps declared together complete in any order
    among themselves, so :meth:`.invariants.Checker.at_end` takes their order from when each completed)."""
    undo_runs: dict[str, int]
    exact: bool = True
    """False where timing decides: a group declared together with a sibling that fails for good (which siblings
    after it start depends on when it fails). Fault-free seeds, the only ones compared, have none."""


def expected(spec: WorkflowSpec, data: Any) -> Expected:
    """What a run of ``spec`` ends with when nothing goes wrong (no fault, no operator, no new release)."""
    completed: list[StepSpec] = []
    forward: dict[str, int] = {}
    results: list[Any] = []
    failed = False
    exact = True
    for group in spec.groups:
        if group.parallel:  # decision 30: every sibling runs, unless one fails for good (then the group raises)
            if all(s.succeeds for s in group.steps):
                for s in group.steps:
                    forward[s.id] = min(s.fails + 1, s.max_attempts)
                    completed.append(s)
                    results.append(result_of(s.id, data))
                continue
            exact = False
            if not group.caught:
                failed = True
                break
            continue
        for s in group.steps:
            forward[s.id] = min(s.fails + 1, s.max_attempts)
            if s.succeeds:
                completed.append(s)
                results.append(result_of(s.id, data))
                continue
            if s.caught:
                results.append(None)
                continue
            if not group.caught:
                failed = True
            break
        if failed:
            break
    if not failed and not spec.raise_at_end:
        return Expected("completed", None, results, forward, [], {}, exact)
    undone = [s.id for s in reversed(completed) if s.compensate]
    # every accepted success is in the unwind: one whose code has no compensator is skipped (target_not_found)
    recovery = "compensated" if completed else "not_required"
    return Expected(
        "failed", recovery, None, forward, undone, {s.id: s.undo_fails + 1 for s in completed if s.compensate}, exact
    )


def result_of(step_id: str, data: Any) -> dict[str, Any]:
    return {"step": step_id, "order": data}


class Hooks(Protocol):
    """What a release's code reaches of the simulated world while it runs (the simulator implements it)."""

    def effect(self, step_id: str, phase: str, received: Any = None) -> int:
        """A callback starts executing: (step id, phase, what a compensator received) -> how many times this
        callback ran before for this run (the callback fails while that is below its ``fails``)."""
        ...

    def takes(self, seconds: float) -> None:
        """The callback takes this long (virtual time passes while it runs)."""
        ...

    def order_cancelled(self) -> bool:
        """The guard's external read: is the order of the run this request is about marked cancelled?"""
        ...

    def fresh_id(self, base: str) -> str:
        """A step id made from something that changes on every pass (decisions 29)."""
        ...

    def pause(self, seconds: float) -> None:
        """A long step's callback works this long before its next heartbeat (the world may let it go silent
        here: it never heartbeats again nor returns)."""
        ...

    def handed_out(self, step_id: str, token: str) -> None:
        """A step completed from outside: its callback handed out this completion token (decision 32)."""
        ...

    def stop_seen(self, kind: str) -> None:
        """A heartbeat raised ``StopRequested`` in the callback (it returns early)."""
        ...


def big_value(kind: str) -> dict[str, str]:
    """A result over the server's limit (``server``) or over the SDK's own 256 KiB (``sdk``)."""
    return {"blob": "x" * BIG[kind]}


def build_app(spec: WorkflowSpec, hooks: Hooks, *, master_key: str, seen: Any) -> Ryusen:
    """The app of one release of ``spec``, holding the deployment's master (as ``ryusen dev``'s apps do)."""
    app = Ryusen(
        APP_ID,
        master_key=master_key,
        seen_requests=seen,
        release_id=f"r{spec.release}",
        build_id=f"b{spec.release}",
    )

    def works(s: StepSpec) -> str | None:
        """A long step's work between heartbeats (decision 33); the stop's kind if a heartbeat said the run is
        stopping (the callback then returns early)."""
        for i in range(s.beats):
            hooks.pause(s.beat_every_s)
            try:
                heartbeat({"progress": round((i + 1) / s.beats, 2)})
            except StopRequested as stop:
                hooks.stop_seen(stop.kind)
                return stop.kind
        return None

    def callback(step: Step, s: StepSpec, step_id: str) -> Callable[[Any], Any]:
        def run(data: Any) -> Any:
            before = hooks.effect(step_id, "forward")
            if s.takes_s:
                hooks.takes(s.takes_s)
            if (stopped := works(s)) is not None:
                return {**result_of(s.id, data), "stopped": stopped}  # finish early, with what was done
            if s.nests:  # refused (ConcurrentStepError), and the refusal escapes the callback (decisions 23)
                step.run(f"{step_id}-receipt", lambda: "sent")
            if before < s.fails:
                raise ConnectionError(f"{step_id} failed (execution {before + 1})")
            if s.big:
                return big_value(s.big)
            if s.external_s:
                token = ryusen.operation().completion_token
                assert token is not None, "a step completed from outside is handed its token"
                hooks.handed_out(step_id, token)
                return "asked"  # not the step's result: the completion brings that
            return result_of(s.id, data)

        return run

    def compensator(step: Step, s: StepSpec, step_id: str) -> Callable[[Any], Any] | None:
        if not s.compensate:
            return None

        def undo(result: Any) -> Any:
            before = hooks.effect(step_id, "compensation", result)
            if s.undo_nests:
                step.run(f"{step_id}-undo-receipt", lambda: "sent")
            if before < s.undo_fails:
                raise ConnectionError(f"undo {step_id} failed (execution {before + 1})")
            if s.undo_big:
                return big_value("server")
            return {"undone": s.id, "had": "omitted" if isinstance(result, OmittedResult) else "result"}

        return undo

    def run_step(step: Step, s: StepSpec, data: Any) -> Any:
        retry = RetryPolicy(max_attempts=s.max_attempts, initial_delay=timedelta(seconds=1), on_unknown=s.on_unknown)
        long: dict[str, Any] = {}
        if s.external_s:
            long = {"completion": "external", "timeout": timedelta(seconds=s.external_s)}
        if s.heartbeat_s is not None:
            long = {"heartbeat": timedelta(seconds=s.heartbeat_s)}
            if s.timeout_s is not None:
                long["timeout"] = timedelta(seconds=s.timeout_s)
        undo_retry = RetryPolicy(
            max_attempts=s.undo_attempts, initial_delay=timedelta(seconds=1), on_unknown=s.undo_on_unknown
        )
        if s.unstable:  # another call site: its own location (decisions 29 counts abandoned ids per location)
            step_id = hooks.fresh_id(s.id)
            return step.run(
                step_id,
                callback(step, s, step_id),
                data,
                compensate=compensator(step, s, step_id),
                retry=retry,
                compensate_retry=undo_retry,
                **long,
            )
        return step.run(
            s.id,
            callback(step, s, s.id),
            data,
            compensate=compensator(step, s, s.id),
            retry=retry,
            compensate_retry=undo_retry,
            **long,
        )

    def together(step: Step, group: GroupSpec, data: Any) -> list[Any]:
        """Decision 30: the group's steps declared together (a step's wait a sibling before it); their results in
        order once all have settled, or the first failure in declaration order (as ``gather`` raises it)."""
        calls: list[Callable[[], Any]] = []
        kept: list[bool] = []
        for s in group.steps:
            if s.wait_s:
                calls.append(lambda s=s: step.sleep(f"{s.id}-wait", timedelta(seconds=s.wait_s)))  # type: ignore[misc]
                kept.append(False)
            calls.append(lambda s=s: run_step(step, s, data))  # type: ignore[misc]
            kept.append(True)
        return [r for r, keep in zip(step.parallel(*calls), kept, strict=True) if keep]

    @app.function(FUNCTION_ID, retired_steps=spec.retired, max_parallel=spec.max_parallel)
    def saga(data: Any, step: Step) -> Any:
        results: list[Any] = []
        for gi, group in enumerate(spec.groups):
            if spec.guard_at == gi and hooks.order_cancelled():
                return {"order": "cancelled", "results": results}  # an early return on an external read
            try:
                if group.parallel:
                    results.extend(together(step, group, data))
                    continue
                for s in group.steps:
                    if s.wait_s:  # decision 31: a durable wait first
                        step.sleep(f"{s.id}-wait", timedelta(seconds=s.wait_s))
                    if s.caught:
                        try:
                            results.append(run_step(step, s, data))
                        except StepFailed:
                            results.append(None)
                    else:
                        results.append(run_step(step, s, data))
            except StepFailed:
                if not group.caught:
                    raise
        if spec.raise_at_end:
            raise RuntimeError("rejected at the end")
        return results

    return app

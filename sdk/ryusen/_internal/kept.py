"""Kept passes: a chained run's function goes on from step to step instead of replaying from the top.

Without them, every task replays the function from the top: a forward attempt replays to its step and
runs the callback, and the continuation after it (``continue_after``) replays from the top once more to
find the next step. At step *n* that is *n* replayed ``step.run`` calls, so a run's endpoint time grows
with the square of its length.

A kept pass is one execution of the function that serves a run's chained tasks one after another, as
Temporal's sticky cache keeps a workflow in a worker's memory:

1. A forward attempt with ``continue_after`` starts the function in a thread of its own (the pass). It
   replays to the target step and runs its callback there, in the request's context with what the
   function set on top (``run_callback``); the request reports the callback's outcome. A callback still
   running ``KEPT_GIVE_UP_AFTER_S`` after the server stopped listening frees the request, and its
   outcome is submitted as a late result once there.
2. After a success the function goes on, in the same execution: ``step.run`` returns the recorded result
   (a fresh copy of the JSON the server will hold), and the rest of the pass is the discovery that follows.
   At the next step with no recorded outcome it does not run the callback: the request reports the step
   as ``next``, and the pass waits there, kept by this process under the run's id.
3. The next request for the run, if it is that step's forward attempt and extends the memo this pass was
   last sent by exactly the result it reported, resumes the pass at that ``step.run``: its callback runs
   with the new request's operation, and the pass goes on as in 2.

Anything else ends the kept pass (its waiting ``step.run`` raises the pass-ending ``Suspend``, so the
function's ``finally`` blocks run) and the task replays from the top as before: a request for another
step or another kind of task, a memo that is not the one expected (another engine process, a resolution,
a rediscovery), another endpoint instance, a pass kept longer than ``KEPT_PASS_IDLE_S`` (10 s), a pass that
no longer fits the bounds. Either way the server records what a pass of current code over the same recorded
results reports; the two differ only where code outside ``step.run`` decides from something that is not a
recorded result (below).

What the passes hold is bounded (``KeptPasses``; tests/conformance/test_kept_memory.py): at most
``KEPT_PASSES`` per app, holding at most ``KEPT_PASS_SHARE`` of the memo cache's budget, counted as the
memos they are pinned to there (the memo a waiting pass holds is the one its next request extends) and the
results they reported. A pass kept keeps its place; an attempt with no room for a pass replays from the top,
and a run whose pass no longer fits, or whose passes are not resumed ``UNKEPT_PASSES`` times in a row, is
given no other, so that passes never push each other out in turn.

What a kept pass changes for the function is only what a replay would have recomputed: code outside
``step.run`` runs once per execution instead of once per task, so what it keeps in memory (or what a
callback left there) is still there at the next step. RFD 1 allows this ("discovery is repeatable
orchestration"), and it is why a value later steps rely on belongs in a step's result: a replay from the
top (a cold endpoint, another instance) sees only recorded results. ``ryusen.testing`` therefore replays
every task from the top unless a test asks for kept passes (decisions 27), and with them can compare each
pass with a replay (``WorkflowEnvironment(kept_passes=True, check_discovery=True)``).

A pass is kept only while it is simple enough to be the same as a replay: no ``step.run`` was refused
(``ConcurrentStepError``). A ``step.run`` from a thread that is not the pass's own is always refused, kept
pass or not (decisions 18, ``tests/conformance/test_steps_from_threads.py``), so a pass never spreads its
steps over threads. Async functions are not kept (each request runs them on a loop of its own).

No pass is kept on AWS Lambda (``ServeOptions.on_lambda``): Lambda freezes the environment when the handler
returns, so a pass waiting there would hold the function's locks through the freeze, and a callback left
running would stall. There every task replays from the top on the handler's thread.
"""

from __future__ import annotations

import atexit
import contextvars
import json
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .memo_cache import MemoCache, footprint
from .step import CallbackInterruptedError, Step, Suspend, _Replay
from .wire import CallbackSucceeded, MemoEntry, StepReached, TaskKind, TaskRequest

if TYPE_CHECKING:
    from .app import RegisteredFunction

log = logging.getLogger("ryusen")

_UNSET = object()

KEPT_PASSES = 256
"""Kept passes per app, at most (each holds a waiting thread). ``RYUSEN_KEPT_PASSES`` sets it (0 turns kept
passes off)."""
KEPT_PASS_SHARE = 0.75
"""What the kept passes may hold, at most, as a share of the memo cache's budget (``MEMO_CACHE_BYTES``): the
memos they are pinned to there and the results they reported. The rest is for the memos of runs without one."""
UNKEPT_PASSES = 2
"""A run whose passes ended this many times in a row without serving its next attempt (another instance
served it, the server sent the whole memo again) gets no new pass in this process: it replays from the top."""
UNKEPT_RUNS_REMEMBERED = 4096
"""Runs whose passes were not kept, remembered at most (the least recently noted is forgotten first)."""
KEPT_PASS_IDLE_S = 10.0
"""How long a kept pass waits for its run's next attempt before it ends (the engine chains the next
attempt at once; this covers a hand-over through the queue). Short, because what the function holds
(its locals, a lock taken around ``step.run``) stays held while it waits."""
KEPT_GIVE_UP_AFTER_S = 10.0
"""How long after ``respond_by`` (when the server stops listening, less its grace) a request stops waiting for
a kept pass's callback: the answer can no longer be heard, and the request may hold what the callback waits
for. The callback still runs to its end, and its outcome is submitted late."""
EXIT_WAIT_S = 2.0
"""At interpreter exit, how long the kept passes have, in all, to end (their ``finally`` blocks run)."""

_registries: weakref.WeakSet[KeptPasses] = weakref.WeakSet()


@atexit.register
def _end_kept_passes_at_exit() -> None:
    """The pass threads are daemons (a waiting pass must not keep a process alive); at exit, end them and
    give them a moment, so that the functions' ``finally`` and ``with`` blocks run."""
    deadline = time.monotonic() + EXIT_WAIT_S
    for registry in list(_registries):
        registry.clear(wait_s=max(deadline - time.monotonic(), 0.0))


def kept_passes_from_env() -> int:
    raw = os.environ.get("RYUSEN_KEPT_PASSES")
    if raw is None or not raw.strip():
        return KEPT_PASSES
    try:
        value = int(raw)
    except ValueError:
        log.warning("RYUSEN_KEPT_PASSES=%r is not a number; keeping %d passes", raw, KEPT_PASSES)
        return KEPT_PASSES
    return max(0, value)


class LivePass:
    """One execution of a run's function, in a thread of its own, serving that run's chained attempts.

    The request thread and the pass thread hand over through ``_changed``: the request waits for the
    callback's outcome (or the end of the pass), then for what comes next (the pass waiting at a step, or
    ending); the pass waits at a step for :meth:`resume` or :meth:`end`.
    """

    def __init__(self, registered: RegisteredFunction, request: TaskRequest, *, idle_s: float) -> None:
        assert request.kind is TaskKind.FORWARD and request.step_id is not None and request.operation is not None
        self.run_id = request.run_id
        self.function_id = request.function_id
        self.idle_s = idle_s
        self.replay = _Replay(TaskKind.FORWARD, dict(request.memo), request.step_id, request.operation, None)
        self.replay.tracebacks = request.tracebacks
        self.replay.keeper = self
        self.serving = request.step_id
        """The step whose attempt this pass runs (or last ran)."""
        self._registered = registered
        self._input = request.input
        self._changed = threading.Condition()
        self._attempt: Any = None
        self._going_on = False
        self._finished = False
        self._final: Any = None
        self._final_error: BaseException | None = None
        self._waiting: StepReached | None = None
        """The step this pass waits at (reported as ``next``), while it waits."""
        self._resumed = False
        self._ended = False
        self.expects: tuple[str, str, MemoEntry] | None = None
        """What the next request must say to resume this pass: the memo token it extends, and the one entry
        it adds (the step whose result this pass reported)."""
        self.on_end: Any = None
        """Called (with this pass) when the pass ends while kept: the registry forgets it."""
        context = contextvars.copy_context()  # what the request that starts the pass had set (a logging context)
        self._start = context.copy()
        """The context the pass started in (the first request's): what the function itself set differs."""
        self._request_context = self._start
        """The context of the request being served (``resume``): what its callback starts from."""
        self.abandoned = False
        """The request stopped waiting for the callback (``answer``): its outcome is submitted late."""
        self.on_late: Callable[[Any], None] | None = None
        """Where an abandoned attempt's outcome goes (the app's late-result submission)."""
        self._thread = threading.Thread(
            target=context.run, args=(self._main,), name=f"ryusen-pass-{request.run_id[:40]}", daemon=True
        )
        self.thread_id = 0
        self.overran = False
        """The pass was still going when the request's budget after the callback ran out (``answer``)."""
        self.pinned: str | None = None
        """The memo token this pass holds pinned in the memo cache while it is kept (``KeptPasses.keep``)."""

    # ---- the pass thread -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def _main(self) -> None:
        # before the function runs: the replay refuses a step from any other thread
        self.thread_id = self.replay.function_thread = threading.get_ident()
        output: Any = None
        raised: BaseException | None = None
        try:
            output = self._registered.fn(self._input, Step(self.replay))
        except BaseException as exc:  # noqa: BLE001 - the replay decides what is reported (a Suspend too)
            raised = exc
        final: Any = None
        error: BaseException | None = None
        try:
            final = self.replay.report(output=output, raised=raised)
        except BaseException as exc:  # noqa: BLE001 - handed to the request that waits (CallbackInterruptedError)
            error = exc
        with self._changed:
            self._finished, self._final, self._final_error = True, final, error
            self._waiting = None
            self._changed.notify_all()

    def attempt_finished(self, outcome: Any, *, going_on: bool) -> None:
        """The callback finished (from the pass thread): the request may answer with its outcome; or, if it
        gave up waiting (``abandoned``), the outcome goes to the server as a late result (``on_late``)."""
        with self._changed:
            self._attempt, self._going_on = outcome, going_on
            abandoned = self.abandoned
            self._changed.notify_all()
        if abandoned:
            self.end()  # nobody waits for what comes next: the pass is not kept
            if self.on_late is not None:  # on a thread of its own: the function must not wait on the network
                threading.Thread(target=self.on_late, args=(outcome,), name="ryusen-late-result", daemon=True).start()

    def run_callback(self, call: Callable[[], Any]) -> Any:
        """Run the target callback on the pass thread, where the function runs (its locks, connections and
        thread-locals are the callback's), in the context of the request that authorized this attempt with
        every contextvar the function set since the pass started (its own, ``ryusen.operation()``) on top:
        what a replay on that request's thread would see. What the callback sets stays in that copy."""
        body, start = contextvars.copy_context(), self._start
        served = self._request_context.copy()

        def run() -> Any:
            for var, value in body.items():
                if start.get(var, _UNSET) is not value:  # set by the function (or by the replay for it)
                    var.set(value)
            return call()

        return served.run(run)

    def wait_for_attempt(self, plan: Any) -> None:
        """At a step with no recorded outcome (from the pass thread): report it and wait for its attempt.

        Returns once :meth:`resume` made the replay that step's attempt; raises ``Suspend`` (ending the
        pass) when the pass ends instead: ended by the registry, or not resumed within ``idle_s``."""
        deadline = time.monotonic() + self.idle_s
        with self._changed:
            self._waiting = plan
            self._changed.notify_all()
            while not (self._resumed or self._ended):
                left = deadline - time.monotonic()
                if left <= 0:
                    self._ended = True
                    break
                self._changed.wait(left)
            resumed, self._resumed, self._waiting = self._resumed and not self._ended, False, None
        if not resumed:
            if self.on_end is not None:
                self.on_end(self)
            raise Suspend(plan)

    # ---- the request thread ----------------------------------------------------------

    def answer(self, budget: Callable[[], float], give_up_s: float | None = None) -> tuple[Any, Any]:
        """The current request's attempt outcome, and the step this pass now waits at (None: it does not wait
        at one: it ended, or did not go on after the callback, or was still going ``budget()`` seconds after
        the callback's end). Raises what the pass raised when it reported nothing
        (``CallbackInterruptedError``), and ``CallbackInterruptedError`` when the callback has not finished
        ``give_up_s`` seconds from now (the pass is then ``abandoned``: its outcome goes late)."""
        with self._changed:
            answered = self._changed.wait_for(
                lambda: self._attempt is not None or self._finished, timeout=None if give_up_s is None else give_up_s
            )
            if not answered:
                # the server stopped listening a while ago (a callback that outlives ``respond_by``, or one
                # waiting on something this request holds): free the request; the callback still runs to
                # its end and its outcome goes to the late-result path, as without a kept pass
                self.abandoned = True
                raise CallbackInterruptedError(
                    f"step {self.serving!r} of run {self.run_id} had not finished {KEPT_GIVE_UP_AFTER_S:g}s after"
                    " the server stopped listening; its outcome will be submitted as a late result"
                )
            attempt, going_on = self._attempt, self._going_on
            if attempt is None or not going_on:
                # the pass ended at its step (a failure, a conflict, a step from another thread): its report
                self._changed.wait_for(lambda: self._finished)
                if self._final_error is not None:
                    raise self._final_error
                return self._final, None
            left = budget()
            if left > 0:
                self._changed.wait_for(lambda: self._waiting is not None or self._finished, timeout=left)
            if self._waiting is not None or self._finished:
                return attempt, self._waiting
        self.overran = True
        self.end()  # still going: a step.run still to come runs nothing, and the pass is not kept
        log.warning(
            "the kept pass of run %s was still going %.1fs after step %r; the server will run the discovery as a task",
            self.run_id,
            max(left, 0.0),
            self.serving,
        )
        return attempt, None

    @property
    def final_report(self) -> Any:
        """What the pass reported when it ended at the function's end or a conflict (None: it did not)."""
        with self._changed:
            return self._final if self._finished else None

    @property
    def waiting(self) -> bool:
        with self._changed:
            return self._waiting is not None and not self._ended and not self._finished

    def resume(self, request: TaskRequest, sent: TaskRequest) -> bool:
        """Make this waiting pass the attempt ``request`` asks for, if ``sent`` (the request as it came, its
        memo only what changed) is the attempt of the step it waits at, extending exactly the memo it holds.
        False: it is not (the caller ends it and replays from the top)."""
        with self._changed:
            plan = self._waiting
            if plan is None or self._ended or self._finished or self.expects is None:
                return False
            token, step_id, entry = self.expects
            base = sent.memo_base
            if (
                request.kind is not TaskKind.FORWARD
                or not request.continue_after
                or request.function_id != self.function_id
                or request.step_id != plan.step.id
                or request.operation is None
                or base is None
                or base.token != token
                or base.removed
                or set(sent.memo) != {step_id}
                or not _same_entry(sent.memo[step_id], entry)
            ):
                return False
            self.replay.resume(TaskKind.FORWARD, request.memo, plan.step.id, request.operation)
            self.serving = plan.step.id
            self._request_context = contextvars.copy_context()
            self._attempt, self._going_on, self._resumed, self._waiting = None, False, True, None
            self._changed.notify_all()
            return True

    def kept_for(self, request: TaskRequest, attempt: Any) -> None:
        """After ``request`` was answered with ``attempt`` and the step this pass waits at: what the run's
        next request must extend for this pass to serve it."""
        if request.memo_token is not None and isinstance(attempt, CallbackSucceeded) and request.step_id:
            self.expects = (request.memo_token, request.step_id, MemoEntry(status="completed", result=attempt.result))
        else:
            self.expects = None

    def end(self) -> None:
        """End the pass (it is not resumed): its waiting ``step.run`` raises the pass-ending ``Suspend``."""
        with self._changed:
            self._ended = True
            self._changed.notify_all()
        self.replay.close()

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the pass thread to finish (its ``finally`` blocks to run)."""
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)


def _same_entry(a: MemoEntry, b: MemoEntry) -> bool:
    """The same recorded outcome, compared as JSON (1 and true differ, as they do to the function)."""
    try:
        return json.dumps(a.model_dump(mode="json"), sort_keys=True) == json.dumps(
            b.model_dump(mode="json"), sort_keys=True
        )
    except (TypeError, ValueError):
        return False


class KeptPasses:
    """The passes this app keeps, by run id, within two bounds: at most ``capacity`` passes (each a waiting
    thread), holding at most ``max_bytes`` (the memos they are pinned to in ``memos``, the memo cache, and the
    results they reported).

    The bounds are kept by admission, not by pushing passes out: a pass already kept keeps its place until
    its run's next attempt resumes it or it ends; a chained attempt with no pass waiting starts one only if
    its memo fits beside the others (and the cache holds it: a pass is resumed only by a request that extends
    that memo), otherwise it replays from the top, as without kept passes. A pass that no longer fits when
    it reaches its next step (its run's results grew) ends, and its run is not given another: runs beyond
    the bounds are replayed, not passed around in turn (a least-recently-used pass is the one whose attempt
    comes next when more runs interleave than fit, so pushing it out keeps none and starts a thread for
    every attempt). Likewise a run whose passes end ``UNKEPT_PASSES`` times in a row without serving its next
    attempt replays from the top.
    """

    def __init__(
        self,
        capacity: int | None = None,
        idle_s: float = KEPT_PASS_IDLE_S,
        *,
        memos: MemoCache,
        max_bytes: int | None = None,
    ) -> None:
        self.capacity = kept_passes_from_env() if capacity is None else capacity
        self.idle_s = idle_s
        self.memos = memos
        self.max_bytes = int(memos.max_bytes * KEPT_PASS_SHARE) if max_bytes is None else max_bytes
        self._passes: OrderedDict[str, LivePass] = OrderedDict()
        self._lock = threading.Lock()
        self._unkept: OrderedDict[str, int] = OrderedDict()
        """Runs whose latest passes were not kept or not resumed: how many in a row."""
        self.resumed = 0
        """Requests a kept pass served (figures for tests and benchmarks)."""
        self.started = 0
        """Passes started for a chained attempt: a replay from the top."""
        self.replayed = 0
        """Chained attempts that started no pass (the bounds, or a run whose passes were not resumed)."""
        self._running: weakref.WeakSet[LivePass] = weakref.WeakSet()
        """Every pass whose thread may still run (kept or not): what ``clear(wait_s=...)`` waits for."""
        _registries.add(self)

    @property
    def held_bytes(self) -> int:
        """What the kept passes hold: their memos and the results they reported (:meth:`MemoCache.pin`)."""
        return self.memos.pinned_bytes

    def admits(self, request: TaskRequest) -> bool:
        """Whether a chained attempt that no pass waits for starts one: there is room for another pass and for its
        memo (which the cache must hold), and the run's passes were not left unkept ``UNKEPT_PASSES`` times."""
        size = self.memos.hold(request)
        with self._lock:
            admitted = (
                size is not None
                and self._unkept.get(request.run_id, 0) < UNKEPT_PASSES
                and len(self._passes) < self.capacity
                and self.memos.pinned_bytes + size <= self.max_bytes
            )
            if not admitted:
                self.replayed += 1
        return admitted

    def start(self, live: LivePass) -> None:
        """Start ``live``'s thread (a new pass for a chained attempt)."""
        with self._lock:
            self._running.add(live)
            self.started += 1
        live.start()

    def take(self, run_id: str) -> LivePass | None:
        with self._lock:
            live = self._passes.pop(run_id, None)
        if live is not None:
            self._release(live)
        return live

    def resumed_by(self, run_id: str) -> None:
        """The run's kept pass serves its attempt."""
        with self._lock:
            self.resumed += 1
            self._unkept.pop(run_id, None)

    def not_resumed(self, run_id: str) -> None:
        """The run's kept pass could not serve its attempt (another memo, another step): it ended unused."""
        with self._lock:
            self._note_unkept(run_id, 1)

    def keep(self, live: LivePass) -> bool:
        """Keep ``live``, waiting at its next step, with its memo pinned in the cache, if it fits within the
        bounds beside the passes already kept; else end it, and give its run no other pass."""
        expects = live.expects
        reported = footprint(expects[2]) if expects is not None else 0
        other = self.take(live.run_id)  # a duplicate delivery's pass for the same run: one is enough
        if other is not None and other is not live:
            other.end()
        kept = False
        with self._lock:
            if expects is not None and self.capacity > 0 and len(self._passes) < self.capacity:
                kept = self.memos.pin(expects[0], reported, within=self.max_bytes)
            if kept:
                assert expects is not None
                live.pinned = expects[0]
                live.on_end = self._forget
                self._passes[live.run_id] = live
            else:
                self._note_unkept(live.run_id, UNKEPT_PASSES)
        if not kept:
            live.end()
        return kept

    def drop(self, run_id: str) -> None:
        """The run's next task is not a chained attempt: its kept pass (if any) ends."""
        live = self.take(run_id)
        if live is not None:
            live.end()
            self.not_resumed(run_id)

    def _forget(self, live: LivePass) -> None:
        """``live`` ended while kept (it waited longer than ``idle_s``), or after it was taken."""
        with self._lock:
            idle = self._passes.get(live.run_id) is live
            if idle:
                del self._passes[live.run_id]
                self._note_unkept(live.run_id, 1)
        self._release(live)

    def _release(self, live: LivePass) -> None:
        """``live`` no longer holds its memo: unpin it."""
        with self._lock:
            token, live.pinned = live.pinned, None
        if token is not None:
            self.memos.unpin(token)

    def _note_unkept(self, run_id: str, times: int) -> None:
        """(With the lock held.)"""
        self._unkept[run_id] = self._unkept.pop(run_id, 0) + times
        while len(self._unkept) > UNKEPT_RUNS_REMEMBERED:
            self._unkept.popitem(last=False)

    def clear(self, *, wait_s: float = 0.0) -> None:
        """End every kept pass (as a process that stops: no run is noted as unkept); with ``wait_s``, also wait
        up to that long for every pass thread still running (those ended earlier too) to finish, so that the
        functions' ``finally`` blocks have run."""
        with self._lock:
            passes = list(self._passes.values())
            self._passes.clear()
            self._unkept.clear()
            running = list(self._running) if wait_s > 0 else []
        for live in passes:
            self._release(live)
            live.end()
        deadline = time.monotonic() + wait_s
        for live in running:
            live.join(max(deadline - time.monotonic(), 0.0))

    def __len__(self) -> int:
        return len(self._passes)

"""Test your workflows through the real engine, in-process, on a virtual clock.

``WorkflowEnvironment`` runs an app's functions through Ryusen's engine core
and its in-memory store and queue (the same semantics as DynamoDB and SQS),
calling the app's handler directly. Time is virtual: retries, backoff and
deadlines take no wall time. Faults can be injected between any two
transitions. Requires the server extra (``pip install 'ryusen[server]'``).

>>> from ryusen.testing import WorkflowEnvironment
>>> env = WorkflowEnvironment(app)                        # doctest: +SKIP
>>> run = env.run("checkout", {"sku": "A1", "amount": 30})  # doctest: +SKIP
>>> run.outcome, run.recovery                              # doctest: +SKIP
('completed', None)
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from ryusen._internal.app import DiscoveryDivergence, HandlerResponse, Ryusen, ServeOptions, features
from ryusen._internal.signing import SIGNATURE_HEADER, app_key, sign, url_path
from ryusen._internal.wire import (
    CompletionPost,
    Heartbeat,
    HeartbeatReply,
    LateResult,
    Manifest,
    Phase,
    TaskKind,
    TaskRequest,
    completion_scope,
    late_result_scope,
)

try:
    from ryusen_server.aws.store import DynamoStore, create_table
    from ryusen_server.core.events import EngineSettings, Resolve
    from ryusen_server.core.model import RunState, TaskRef
    from ryusen_server.core.view import run_view
    from ryusen_server.deferred import DeferredAnswer, WakeMessage, WakeOrder
    from ryusen_server.engine import Engine, ServerSettings
    from ryusen_server.invoker import InProcessInvoker
    from ryusen_server.memory import MemoryQueue, MemoryStore, MemoryTimers
    from ryusen_server.ports import (
        ConflictError,
        InvalidRequestError,
        InvokeResult,
        NotFoundError,
        PayloadTooLargeError,
        RequestCounter,
        ServerError,
    )
    from ryusen_server.runtime import fire_due, handle_message
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("ryusen.testing needs the server extra: pip install 'ryusen[server]'") from exc

__all__ = [
    "ConflictError",
    "DiscoveryDivergenceError",
    "EngineSettings",
    "Faults",
    "InvalidRequestError",
    "NotFoundError",
    "PayloadTooLargeError",
    "RunView",
    "VirtualClock",
    "WorkflowEnvironment",
]

EPOCH = datetime(2030, 1, 1, tzinfo=UTC)


class VirtualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: datetime = EPOCH) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, delta: timedelta) -> None:
        self.now += delta

    def advance_to(self, moment: datetime) -> None:
        if moment > self.now:
            self.now = moment


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


@dataclass(frozen=True)
class RunView:
    """A run as the API shows it (``raw``), with shortcuts for the fields tests read most."""

    raw: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    @property
    def id(self) -> str:
        return str(self.raw["id"])

    @property
    def phase(self) -> str:
        return str(self.raw["phase"])

    @property
    def outcome(self) -> str | None:
        return _opt_str(self.raw["outcome"])

    @property
    def recovery(self) -> str | None:
        return _opt_str(self.raw["recovery"])

    @property
    def summary(self) -> str:
        return str(self.raw["summary"])

    @property
    def output(self) -> Any:
        return self.raw["output"]

    @property
    def error(self) -> dict[str, Any] | None:
        error = self.raw["error"]
        return dict(error) if error is not None else None

    @property
    def blockers(self) -> list[dict[str, Any]]:
        return list(self.raw["blockers"])

    @property
    def steps(self) -> list[dict[str, Any]]:
        return list(self.raw["steps"])

    def step(self, step_id: str) -> dict[str, Any]:
        for step in self.raw["steps"]:
            if step["id"] == step_id:
                return dict(step)
        raise KeyError(f"run has no step {step_id!r}; steps: {[s['id'] for s in self.raw['steps']]}")

    def attempts(self, step_id: str, phase: str = "forward") -> list[dict[str, Any]]:
        return [a for a in self.step(step_id)["attempts"] if a["phase"] == phase]


@dataclass
class _Rule:
    step_id: str | None
    phase: str | None
    kind: str
    times: int
    action: Callable[[], None] | None = None


@dataclass
class HeldResult:
    run_id: str
    step_id: str
    phase: str
    generation: int
    body: bytes
    headers: dict[str, str]


@dataclass
class Faults:
    """Faults to inject; each rule applies to the next ``times`` matching invocations."""

    _rules: list[_Rule] = field(default_factory=list)
    duplicate_messages: bool = False
    held: list[HeldResult] = field(default_factory=list)

    def lose_result(self, step_id: str, *, phase: str = "forward", times: int = 1) -> None:
        """The callback runs, but its response never reaches the server (the attempt becomes Unknown).

        The response is kept: ``env.deliver_late_result(...)`` submits it later.
        """
        self._rules.append(_Rule(step_id, phase, "lose", times))

    def unreachable(self, step_id: str | None = None, *, phase: str | None = None, times: int = 1) -> None:
        """The endpoint refuses the connection before anything is sent (the callback does not run)."""
        self._rules.append(_Rule(step_id, phase, "unreachable", times))

    def crash_before_invoke(self, step_id: str, *, phase: str = "forward", times: int = 1) -> None:
        """The dispatcher dies after authorizing the attempt and before invoking: the lease must expire."""
        self._rules.append(_Rule(step_id, phase, "crash", times))

    def before_invoke(
        self, step_id: str, action: Callable[[], None], *, phase: str = "forward", times: int = 1
    ) -> None:
        """Run ``action`` (e.g. a cancel) while the authorized attempt is about to be invoked."""
        self._rules.append(_Rule(step_id, phase, "before", times, action))

    def take(self, step_id: str | None, phase: str | None, kinds: tuple[str, ...]) -> _Rule | None:
        for rule in self._rules:
            if (
                rule.kind in kinds
                and rule.times > 0
                and rule.step_id in (None, step_id)
                and rule.phase in (None, phase)
            ):
                rule.times -= 1
                return rule
        return None


class _Crash(BaseException):
    """Simulates the dispatcher process dying mid-task."""


class DiscoveryDivergenceError(AssertionError):
    """With ``kept_passes=True, check_discovery=True``: an execution that went on after a step reached another
    next step than a discovery from the recorded results does (the message names both, and the run)."""


class WorkflowEnvironment:
    """The engine, in-process, on a virtual clock, serving ``app`` (or several apps)."""

    def __init__(
        self,
        *apps: Ryusen,
        settings: EngineSettings | None = None,
        default_run_timeout: timedelta | None = None,
        max_run_timeout: timedelta | None = None,
        start: datetime = EPOCH,
        store: str = "memory",
        chain_steps: bool = True,
        signing: bool = True,
        kept_passes: bool = False,
        check_discovery: bool = False,
    ) -> None:
        """``store="moto"`` keeps runs in Ryusen's DynamoDB store on an in-process moto
        (slower; close the environment, or use it as a context manager, to stop moto).

        ``chain_steps=False`` runs the engine as a deployment with ``RYUSEN_CHAIN_STEPS=false`` does:
        no continuation after a callback, and every task a queue message of its own.

        ``signing=False`` runs unsigned, as insecure local mode does (for a test that rewrites what an
        endpoint answers); by default every task is signed as on a deployment.

        By default every task replays the function from the top, as after a restart, on another endpoint
        instance or after a transient error: a workflow whose next step needs what a callback left in memory
        (a token stored on a client made outside ``step.run``) fails here as it does there (decisions 27).
        ``kept_passes=True`` serves the apps as a warm endpoint process does: one execution of a chained run's
        function goes on from step to step (a kept pass), so such a workflow passes while nothing replays.

        ``check_discovery=True`` (with ``kept_passes=True``) also replays from the top wherever a kept pass goes
        on to a next step, and raises :class:`DiscoveryDivergenceError` when the two reach different steps: code
        outside ``step.run`` that decides from state a callback left in memory (or a clock, a random value).
        Without kept passes there is nothing to compare: every task already replays from the top.

        These options hold for this environment only: the apps served here are not changed, so an app served by
        several environments (one after another, or at once) gets each one's options in each."""
        self.clock = VirtualClock(start)
        self.counter = RequestCounter()
        self._mock: Any = None
        self.store: MemoryStore | DynamoStore
        if store == "memory":
            self.store = MemoryStore(self.counter)
        elif store == "moto":
            self.store = self._moto_store()
        else:
            raise ValueError(f"store must be 'memory' or 'moto', not {store!r}")
        self.queue = MemoryQueue(self.clock, counter=self.counter)
        self.timers = MemoryTimers(self.clock, counter=self.counter)
        self.invoker = InProcessInvoker(self.counter)
        self.faults = Faults()
        self.master_key = secrets.token_hex(32) if signing else None
        """Every task is signed as on a deployment: with the app's key, derived from this environment's master
        (an app with keys of its own is served with those, and the engine's master must then be its)."""
        ids = iter(range(1, 1 << 62))
        self.engine = Engine(
            store=self.store,
            queue=self,  # sends go through the fault layer below
            timers=self.timers,
            invoker=self.invoker,
            settings=ServerSettings(
                engine=settings or EngineSettings(),
                default_run_timeout_s=default_run_timeout.total_seconds() if default_run_timeout else None,
                max_run_timeout_s=max_run_timeout.total_seconds() if max_run_timeout else None,
                chain=chain_steps,
                master_key=self.master_key,
            ),
            clock=self.clock,
            new_id=lambda: f"run_{next(ids):06d}",
        )
        self.invoker.intercept = self._intercept
        self._chain = True
        self.engine.chain_guards.append(lambda: self._chain)
        self._apps: dict[str, Ryusen] = {}
        self._keys: dict[str, list[str]] = {}
        self.discovery_divergences: list[DiscoveryDivergence] = []
        """What ``check_discovery`` found and ``drive`` has not raised yet."""
        self._options = ServeOptions(
            kept_passes=kept_passes,
            on_divergence=self.discovery_divergences.append if check_discovery else None,
            heartbeats=self._heartbeat,
            heartbeats_throttled=False,  # every heartbeat reaches the engine: the virtual clock moves when told
        )
        for app in apps:
            self.sync(app)

    def _moto_store(self) -> DynamoStore:
        import os

        import boto3
        from moto import mock_aws

        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            os.environ.setdefault(name, "testing")
        self._mock = mock_aws()
        self._mock.start()
        client = boto3.client("dynamodb", region_name="us-east-1")
        create_table(client, "ryusen-testing")
        return DynamoStore(client, "ryusen-testing", self.counter)

    def close(self) -> None:
        """End the kept passes of the apps served here, and stop the in-process moto of ``store="moto"``."""
        for app in self._apps.values():
            app.kept_passes.clear(wait_s=5.0)  # their functions' finally blocks have run when close returns
        if self._mock is not None:
            self._mock.stop()
            self._mock = None

    def __enter__(self) -> WorkflowEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- apps --------------------------------------------------------------------

    def sync(self, app: Ryusen, *, release_id: str | None = None) -> None:
        """Serve ``app`` and sync it as the newest release (as ``ryusen dev`` does on reload)."""
        url = f"inproc://{app.app_id}"
        previous = self._apps.get(url)
        if previous is not None and previous is not app:
            previous.kept_passes.clear()  # the endpoint is replaced: what the old code kept running ends
        self._apps[url] = app
        self.invoker.apps[url] = self.endpoint(app)
        app.complete_via = functools.partial(self._app_completion, app.app_id)  # app.complete, taken in-process
        manifest = app.manifest()
        if release_id is not None:
            manifest = Manifest.model_validate({**manifest.model_dump(), "release_id": release_id})
        self.engine.sync_release(app.app_id, url, manifest, frozenset(features(self._options)))

    def endpoint(self, app: Ryusen) -> Callable[[str, dict[str, str], bytes], HandlerResponse]:
        """``app``'s handler as its endpoint would run it, with this environment's options: with its own keys, or
        if it has none, the key this environment's engine derives for it from the master it signs with."""
        options = self._options
        if app.signing_keys:
            return lambda method, headers, body: app._serve(
                method, headers, body, "/", app.signing_keys, options=options
            )
        master = self.engine.master_keys()
        keys = [app_key(master[0], app.app_id)] if master else []
        self._keys[app.app_id] = keys
        return lambda method, headers, body: app._serve(
            method, headers, body, "/", keys, insecure=not keys, options=options
        )

    def _signed_late_result(self, app_id: str, late: LateResult) -> dict[str, str]:
        """The headers the SDK of app ``app_id`` sends a late result with."""
        app = next(a for a in self._apps.values() if a.app_id == app_id)
        keys = app.signing_keys or self._keys.get(app_id, [])
        if not keys:
            return {}
        scope = late_result_scope(late, path=url_path(self.engine.settings.result_url or "/v1/results"), app_id=app_id)
        return {
            SIGNATURE_HEADER: sign(
                keys[0], scope, late.model_dump_json().encode(), now=time.time(), nonce=secrets.token_hex(16)
            )
        }

    def _app_completion(self, app_id: str, post: CompletionPost) -> dict[str, Any]:
        """``app.complete`` in this environment: signed with the app's key and handed to the engine as the result
        endpoint would; a refusal is the ``CompletionError`` the app would get."""
        from ryusen._internal.errors import CompletionError
        from ryusen_server.api import completion_answer

        app = next(a for a in self._apps.values() if a.app_id == app_id)
        keys = app.signing_keys or self._keys.get(app_id, [])
        path = url_path(self.engine.settings.result_url or "/v1/results")
        body = post.model_dump_json(exclude_none=True).encode()
        headers = {"content-type": "application/json"}
        if keys:
            scope = completion_scope(post, path=path, app_id=app_id)
            headers[SIGNATURE_HEADER] = sign(keys[0], scope, body, now=time.time(), nonce=secrets.token_hex(16))
        try:
            return completion_answer(self.engine.submit_completion(body, headers, path=path))
        except ServerError as exc:
            raise CompletionError(exc.message, code=str(exc.details.get("code", exc.code)), status=exc.status) from None

    def _heartbeat(self, beat: Heartbeat, headers: dict[str, str]) -> HeartbeatReply | None:
        """A callback's heartbeat, handed to the engine as its result endpoint would (on the virtual clock)."""
        try:
            return self.engine.submit_heartbeat(beat.model_dump_json().encode(), headers)
        except ServerError:
            return None

    # ---- queue with faults ---------------------------------------------------------

    def send(self, task: TaskRef, delay_s: float = 0.0, *, app_id: str | None = None) -> None:
        self.queue.send(task, delay_s, app_id=app_id)
        if self.faults.duplicate_messages:
            self.queue.send(task, delay_s, app_id=app_id)

    def defer(self, answer: DeferredAnswer, delay_s: float = 0.0) -> None:
        self.queue.defer(answer, delay_s)

    def wake(self, order: WakeOrder, delay_s: float = 0.0) -> None:
        self.queue.wake(order, delay_s)

    def watch_lease(self, task: TaskRef, at: datetime, *, key: str, app_id: str | None = None) -> bool:
        return self.queue.watch_lease(task, at, key=key, app_id=app_id)

    def unwatch_lease(self, key: str) -> None:
        self.queue.unwatch_lease(key)

    def _intercept(self, url: str, body: bytes, headers: dict[str, str]) -> InvokeResult | None:
        request = TaskRequest.model_validate_json(body)
        step_id = request.step_id
        phase = request.operation.phase.value if request.operation else None
        if request.kind is TaskKind.DISCOVER:
            step_id, phase = None, None
        rule = self.faults.take(step_id, phase, ("unreachable",))
        if rule is not None:
            return InvokeResult(kind="unreachable", detail="injected: connection refused")
        if request.kind is TaskKind.DISCOVER:
            return None
        rule = self.faults.take(step_id, phase, ("crash",))
        if rule is not None:
            raise _Crash()
        rule = self.faults.take(step_id, phase, ("before",))
        if rule is not None and rule.action is not None:
            rule.action()
        rule = self.faults.take(step_id, phase, ("lose",))
        if rule is not None:
            response = self.invoker.apps[url]("POST", headers, body)
            assert request.operation is not None and step_id is not None
            from ryusen._internal.wire import TaskResponse

            answer = TaskResponse.model_validate_json(response.body)
            if answer.memo_miss:  # nothing ran: the response to lose is the one to the whole memo, sent next
                rule.times += 1
                return InvokeResult(
                    kind="response", status=response.status, headers=response.headers, body=response.body
                )
            outcome = answer.attempt
            late = LateResult.model_validate(
                {
                    "run_id": request.run_id,
                    "step_id": step_id,
                    "phase": request.operation.phase,
                    "generation": request.operation.generation,
                    "attempt": outcome.model_dump() if outcome is not None else None,
                }
            )
            self.faults.held.append(
                HeldResult(
                    request.run_id,
                    step_id,
                    request.operation.phase.value,
                    request.operation.generation,
                    late.model_dump_json().encode(),
                    self._signed_late_result(self._apps[url].app_id, late),
                )
            )
            return InvokeResult(kind="lost", detail="injected: response lost after the callback ran")
        return None

    # ---- driving ---------------------------------------------------------------------

    def start(
        self,
        function_id: str,
        input: Any = None,
        *,
        idempotency_key: str | None = None,
        timeout: timedelta | None = None,
    ) -> str:
        state, _ = self.engine.start_run(
            function_id, input, idempotency_key=idempotency_key, timeout_s=timeout.total_seconds() if timeout else None
        )
        return state.id

    def step_once(self) -> bool:
        """Deliver the next visible message or fire the next due timer; False if nothing was due now."""
        if fire_due(self.engine, self.timers.due):
            return True
        messages = self.queue.receive(max_messages=1)
        if not messages:
            return False
        message = messages[0]
        with contextlib.suppress(_Crash):  # the message stays in flight; it returns when its visibility lapses
            handle_message(self.engine, self.queue, message, message.message_id)
        return True

    def next_due(self) -> datetime | None:
        candidates = [t for t in (self.queue.next_visible_at(), self.timers.next_due_at()) if t is not None]
        return min(candidates, default=None)

    def drive(
        self,
        *,
        until: Callable[[], bool] | None = None,
        max_transitions: int = 100_000,
        horizon: timedelta = timedelta(days=30),
        stop_when_blocked: str | None = None,
        chain: bool | None = None,
    ) -> None:
        """Run until ``until()`` holds or nothing is left to do within ``horizon`` of virtual time.

        With ``stop_when_blocked=run_id``, also stop (without moving the clock)
        once that run has a blocker and nothing else is due now: time would
        only bring probes or its deadline.

        The engine runs one step per write, chaining each step's next task into the
        write that accepts its answer, as it does on AWS. While ``until`` is given
        (and ``chain`` is not True), it does not chain: every task goes through the
        queue, so ``until`` is checked between any two steps.
        """
        limit = self.clock.now + horizon
        self._chain = chain if chain is not None else until is None
        try:
            self._drive(until, limit, max_transitions, stop_when_blocked)
        finally:
            self._chain = True

    def _drive(
        self,
        until: Callable[[], bool] | None,
        limit: datetime,
        max_transitions: int,
        stop_when_blocked: str | None,
    ) -> None:
        for _ in range(max_transitions):
            if until is not None and until():
                return
            if self.step_once():
                self._raise_divergences()
                continue
            if stop_when_blocked is not None and self._waits_for_someone(stop_when_blocked):
                return
            due = self.next_due()
            if due is None or due > limit:
                return
            self.clock.advance_to(due)
        raise RuntimeError("workflow did not settle within max_transitions")

    def _raise_divergences(self) -> None:
        if self.discovery_divergences:
            raise DiscoveryDivergenceError(self.discovery_divergences.pop(0).describe())

    def _waits_for_someone(self, run_id: str) -> bool:
        """The run has a blocker that only a release, an operator or a late result removes (an endpoint
        that keeps failing is retried by the engine itself: time is worth moving for). A release's wake on
        its way is worth moving for too."""
        if any(isinstance(message.task, WakeMessage) for message in self.queue.pending()):
            return False
        return any(b.type.value != "endpoint_failing" for b in self._peek(run_id).blockers)

    def run(self, function_id: str, input: Any = None, **kwargs: Any) -> RunView:
        """Start a run and drive it until it finishes or is blocked with nothing left to do."""
        run_id = self.start(function_id, input, **kwargs)
        return self.wait(run_id)

    def wait(self, run_id: str, **kwargs: Any) -> RunView:
        """Drive until the run finishes, or is blocked (a duplicate step id, an Unknown) with nothing due."""
        kwargs.setdefault("stop_when_blocked", run_id)
        kwargs.setdefault("chain", True)
        self.drive(until=lambda: self._peek(run_id).phase.value == "finished", **kwargs)
        return self.get(run_id)

    def _peek(self, run_id: str) -> RunState:
        state = self.store.peek(run_id)
        if state is None:
            raise KeyError(f"no run {run_id!r}")
        return state

    def get(self, run_id: str) -> RunView:
        """The run view, as ``GET /v1/runs/{id}`` returns it."""
        return RunView(run_view(self._peek(run_id)))

    def advance(self, delta: timedelta) -> None:
        """Move the virtual clock; nothing is delivered until the next ``step_once``/``drive``."""
        self.clock.advance(delta)

    def expire_leases(self) -> None:
        """Move the clock past the lease of every authorized attempt (after ``faults.crash_before_invoke``)."""
        leases = [
            attempt.lease_expires_at
            for message in self.queue.pending()
            if isinstance(message.task, TaskRef) and (state := self.store.peek(message.task.run_id)) is not None
            for step in state.steps
            for attempt in step.attempts
            if attempt.status.value == "authorized" and attempt.lease_expires_at is not None
        ]
        if leases:
            self.clock.advance_to(max(leases) + timedelta(seconds=1))

    # ---- operator actions ---------------------------------------------------------------

    def cancel(self, run_id: str) -> None:
        self.engine.cancel(run_id)

    def rediscover(self, run_id: str) -> None:
        self.engine.rediscover(run_id)

    def resolve(
        self,
        run_id: str,
        step_id: str,
        *,
        phase: str = "forward",
        generation: int,
        action: str,
        result: Any = None,
        error: dict[str, Any] | None = None,
        reason: str | None = None,
    ) -> None:
        """An operator's resolution (``action``: succeed, fail, retry, or skip for a blocked compensation), with
        the reason kept on the attempt."""
        from ryusen._internal.wire import ErrorInfo

        self.engine.resolve(
            run_id,
            Resolve(
                step_id=step_id,
                phase=Phase(phase),
                generation=generation,
                action=action,  # type: ignore[arg-type]
                result=result,
                error=ErrorInfo.model_validate(error) if error else None,
                reason=reason,
                by="ryusen.testing",
            ),
        )

    def complete(self, token: str, result: Any = None, *, error: dict[str, Any] | None = None) -> None:
        """Complete a step from outside (decision 32) with the token its callback handed out
        (``ryusen.operation().completion_token``): its ``result``, or an ``error`` (``{"type", "message"}``;
        ``"retryable": False`` fails it for good). Raises ``ConflictError`` (``completion_refused``) when the
        token's attempt no longer waits (a newer generation, a settled one, a stop fenced it)."""
        from ryusen._internal.wire import ErrorInfo

        self.engine.complete(
            token, result=result, error=ErrorInfo.model_validate(error) if error else None, source="ryusen.testing"
        )

    def deliver_late_result(
        self, run_id: str, step_id: str, *, phase: str = "forward", generation: int | None = None
    ) -> None:
        """Submit a result held back by ``faults.lose_result`` through the late-result endpoint path."""
        for held in list(self.faults.held):
            if (
                held.run_id == run_id
                and held.step_id == step_id
                and held.phase == phase
                and (generation is None or held.generation == generation)
            ):
                self.faults.held.remove(held)
                self.engine.submit_late_result(held.body, held.headers)
                return
        raise KeyError(f"no held result for {run_id} {step_id} {phase}")

    def pending_tasks(self) -> Iterator[TaskRef]:
        for message in self.queue.pending():
            if isinstance(message.task, TaskRef):
                yield message.task

"""The app: registered functions, task execution, the manifest, and the request handler.

One framework-agnostic handler (:meth:`Ryusen.handle`) takes a method, headers
and body and returns a status, headers and body; the serve adapters in
``serve.py`` only translate to ASGI, WSGI and Lambda events.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import hashlib
import inspect
import json
import logging
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pydantic import ValidationError

from .errors import DefinitionError
from .heartbeat import SINK, HeartbeatSink
from .kept import KEPT_GIVE_UP_AFTER_S, KeptPasses, LivePass
from .memo_cache import MemoCache
from .replay import DynamoSeenRequests, ReplayCheckUnavailableError, SeenStore
from .serve import MAX_REQUEST_BYTES
from .signing import (
    CHALLENGE_HEADER,
    KEY_IDS_HEADER,
    PREVIOUS_KEY_WINDOW_S,
    SIGNATURE_HEADER,
    Scope,
    SecretRead,
    SeenRequests,
    SignatureError,
    StaleSignatureError,
    answer_binding,
    app_key,
    choose_key,
    is_nonce,
    parse,
    parse_key_ids,
    read_secret,
    sign,
    split_keys,
    url_path,
    verify,
)
from .step import AsyncStep, CallbackInterruptedError, OmittedResult, Step, _fresh, _Replay
from .wire import (
    DEFAULT_MAX_PARALLEL,
    FEATURES_HEADER,
    LAMBDA_EVENT,
    LAMBDA_FUNCTION_ARN,
    MAX_ID_LENGTH,
    MAX_PARALLEL_LIMIT,
    MAX_RUN_TIMEOUT_S,
    SDK_FEATURES,
    CallbackFailed,
    CallbackSucceeded,
    CompletionPost,
    ErrorInfo,
    FunctionFailed,
    FunctionManifest,
    FunctionNotFound,
    Heartbeat,
    HeartbeatReply,
    LateResult,
    Manifest,
    MemoEntry,
    TaskKind,
    TaskRequest,
    TaskResponse,
    completion_binding,
    completion_scope,
    heartbeat_scope,
    late_result_scope,
    received_task_scope,
)

LATE_RESULT_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0)
"""Waits between tries of a late result whose delivery failed with a server error (about 2 minutes)."""
ACKNOWLEDGED_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, *(30.0,) * 30)
"""Waits between tries of an acknowledged attempt's outcome whose delivery failed with a server error (about 16
minutes: the server waits for nothing else, and a store outage may last that long)."""
LATE_MARGIN_S = 1.0
HEARTBEAT_TIMEOUT_S = 5.0
"""How long one heartbeat's post may take (it holds the callback that called ``ryusen.heartbeat``)."""
"""An outcome finished this close to ``respond_by`` is also submitted as a late result (see ``_submit_late``)."""
LAMBDA_RESERVE_S = 1.0
"""On Lambda, the time a handler keeps, of what its invocation has left, to return: a late result is not tried
again (nor a try let run) past it."""
LAMBDA_ENV = "AWS_LAMBDA_FUNCTION_NAME"
"""Set by the Lambda runtime in every function's environment: this process is a Lambda execution environment."""

log = logging.getLogger("ryusen")


@dataclass(frozen=True, slots=True)
class RegisteredFunction:
    id: str
    fn: Callable[..., Any]
    timeout: timedelta | None
    is_async: bool
    retired_steps: frozenset[str] = frozenset()
    """Step ids this release has removed on purpose: a compensation pass that does not reach one of them
    records a skip (decisions 24) instead of blocking the unwind."""
    max_parallel: int = DEFAULT_MAX_PARALLEL
    """Decision 30: the most steps declared together that run at once; the rest start in declaration order."""


INSECURE_ENV = "RYUSEN_INSECURE_LOCAL"
"""Set to ``1`` to serve without a signing key: anyone who can reach the endpoint can run its callbacks."""


@dataclass(frozen=True, slots=True)
class _Answering:
    """What an answer to a verified request is signed with: the key the request was signed with, the
    request's scope and signature (the answer holds for that request only)."""

    secret: str
    scope: Scope
    nonce: str
    answers: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeOptions:
    """How one endpoint serves the app, where it differs from what the app does by itself: ``ryusen.testing``
    serves an app with its environment's options, so that nothing is set on the app and no option of one
    environment reaches another (decisions 27)."""

    kept_passes: bool = True
    """Keep a chained run's pass between its attempts (``kept.py``), within the app's ``kept_passes``; False:
    every task replays the function from the top, as a cold endpoint does."""
    on_divergence: Callable[[DiscoveryDivergence], None] | None = None
    """Check discovery: where a kept pass stops at a step, also run the discovery from the top with the recorded
    results, answer with what that reaches, and hand each difference here (None: no check)."""
    on_lambda: bool = False
    """Served by a Lambda handler (``lambda_handler``), as the endpoint also is whenever ``AWS_LAMBDA_FUNCTION_NAME``
    is set: Lambda freezes the environment when the handler returns, so nothing may run after it. No kept pass,
    every callback and the continuation run on the handler's thread, and a late result is submitted (with its
    retries) before the handler returns."""
    lambda_context: Any = None
    """The Lambda invocation's context (``lambda_handler``'s second argument): its remaining time ends the
    late-result retries while the handler can still return."""
    heartbeats: Callable[[Heartbeat, dict[str, str]], HeartbeatReply | None] | None = None
    """Where heartbeats go instead of the result URL, with their signed headers (``ryusen.testing`` hands them to
    its engine in-process)."""
    heartbeats_throttled: bool = True
    """Heartbeats closer together than a quarter of their interval are not posted (False: every one is)."""


@dataclass(frozen=True, slots=True)
class ResponseWindow:
    """When the server stops listening for one request's answer, on this process's monotonic clock (``closes_at``;
    None: the request did not say, as a discovery's does not).

    Worked out once, when the request arrives: from ``respond_within_s`` (the span the server gave, counted
    from then), or, from an engine that predates it, from ``respond_by`` read on this process's wall clock (off
    by as much as this clock disagrees with the server's). Time the request spent on its way is not counted:
    the server listens a short grace past the end (``LATE_MARGIN_S`` covers an answer that is near it)."""

    closes_at: float | None

    @classmethod
    def of(cls, request: TaskRequest, *, arrived: float, wall: float) -> ResponseWindow:
        """The window of ``request``, which arrived at ``arrived`` (``time.monotonic()``), when the wall clock
        read ``wall``."""
        if request.respond_within_s is not None:
            return cls(arrived + request.respond_within_s)
        if request.respond_by is not None:
            return cls(arrived + (request.respond_by - wall))
        return cls(None)

    def left(self) -> float | None:
        """Seconds until the server stops listening (negative: it has stopped), or None when it did not say."""
        return None if self.closes_at is None else self.closes_at - time.monotonic()


@dataclass(frozen=True, slots=True)
class HandlerResponse:
    status: int
    headers: dict[str, str]
    body: bytes


class Ryusen:
    """A Ryusen app: a set of workflow functions served at one endpoint.

    >>> app = Ryusen("shop")
    >>> @app.function("checkout")
    ... def checkout(order: dict, step: Step) -> dict:
    ...     return {"ok": True}

    The app's signing keys (decisions 21) come from the first of these that is set: ``signing_key`` (one key or
    several: the first signs, any verifies), ``RYUSEN_SIGNING_KEY`` (comma-separated), the Secrets Manager
    secret ``RYUSEN_SIGNING_KEY_SECRET_ARN`` names; or they are derived from the deployment's master secret
    (``master_key``, ``RYUSEN_MASTER_KEY``, ``RYUSEN_MASTER_KEY_SECRET_ARN``), which lets this process sign for
    every app of the deployment. With no key the endpoint refuses every task, unless it was started in
    insecure local mode (``insecure=True`` or ``RYUSEN_INSECURE_LOCAL=1``), which it announces in its logs and
    manifest.
    """

    def __init__(
        self,
        app_id: str,
        *,
        signing_key: str | list[str] | None = None,
        master_key: str | None = None,
        insecure: bool = False,
        seen_requests: SeenStore | None = None,
        release_id: str | None = None,
        build_id: str | None = None,
        kept_passes: int | None = None,
    ) -> None:
        if not app_id or not isinstance(app_id, str) or len(app_id) > MAX_ID_LENGTH:
            raise DefinitionError(f"app id must be a string of 1 to {MAX_ID_LENGTH} characters")
        self.app_id = app_id
        self._signing_keys = [signing_key] if isinstance(signing_key, str) else list(signing_key or [])
        self._server_key_id: str | None = None
        self._result_url: str | None = None
        """The result URL the server's requests carry (``complete`` posts there)."""
        self.complete_via: Callable[[CompletionPost], dict[str, Any]] | None = None
        """Where ``complete`` hands a completion instead of posting it (``ryusen.testing`` takes it in-process)."""
        """The id of the key the server signed the last request this process verified with: a key the server
        holds, which what this app sends unasked (a late result) is signed with (:func:`choose_key`)."""
        self._master_key = master_key
        self._insecure = insecure
        self._warned_insecure = False
        self._release_id = release_id
        self._build_id = build_id
        self._digest: tuple[list[str], str] | None = None
        self._functions: dict[str, RegisteredFunction] = {}
        self.clock: Callable[[], float] = time.time
        table = os.environ.get("RYUSEN_REPLAY_TABLE")
        self.seen_requests: SeenStore = seen_requests or (DynamoSeenRequests(table) if table else SeenRequests())
        """Signed requests accepted in the last minutes, one played back again is refused: this process's
        memory, or with ``RYUSEN_REPLAY_TABLE`` (or ``seen_requests``) a store every instance shares."""
        self.memo_cache = MemoCache()
        self._draining = threading.Condition()
        self._acknowledged_running = 0
        """Attempts answered ``accepted`` whose outcome is not posted yet (:meth:`drain`)."""
        """The memos this process was sent, for the requests that extend them (the ``memo_cache`` feature)."""
        self.kept_passes = KeptPasses(kept_passes, memos=self.memo_cache)
        """Executions of chained runs' functions waiting at their next step for its attempt, so that it need not
        replay from the top (``kept.py``): at most ``kept_passes`` (default 256, ``RYUSEN_KEPT_PASSES``; 0: none)."""

    @property
    def signing_keys(self) -> list[str]:
        """This app's valid keys, the one to sign with first (see the class docstring for where they come from).

        A secret (AWS Secrets Manager, the way a deployed engine shares keys with an app on Lambda) is read
        with boto3, which the Lambda runtime provides, and read again after 5 minutes so a rotation takes
        effect; its AWSPREVIOUS version stays valid. The SDK itself does not depend on boto3.
        """
        keys = [k for k in self._signing_keys if k] or split_keys(os.environ.get("RYUSEN_SIGNING_KEY"))
        if keys:
            return keys
        secret = os.environ.get("RYUSEN_SIGNING_KEY_SECRET_ARN")
        if secret:
            return [k for k in _secret_keys(secret, time.monotonic()) if k]
        masters = [self._master_key] if self._master_key else split_keys(os.environ.get("RYUSEN_MASTER_KEY"))
        master_secret = os.environ.get("RYUSEN_MASTER_KEY_SECRET_ARN")
        if not masters and master_secret:
            masters = [k for k in _secret_keys(master_secret, time.monotonic()) if k]
        return [app_key(master, self.app_id) for master in masters]

    @property
    def signing_key(self) -> str | None:
        """The key this app signs with (None: no key)."""
        keys = self.signing_keys
        return keys[0] if keys else None

    @property
    def insecure(self) -> bool:
        """Started in insecure local mode (``insecure=True`` or ``RYUSEN_INSECURE_LOCAL=1``): with no key, tasks
        run unsigned. A key, when there is one, is always used. On AWS Lambda there is no such mode."""
        asked = self._insecure or os.environ.get(INSECURE_ENV) == "1"
        if asked and os.environ.get("AWS_LAMBDA_FUNCTION_NAME"):
            if not self._warned_insecure:
                self._warned_insecure = True
                log.error(
                    "app %r: insecure local mode is refused on AWS Lambda; it runs nothing without a key", self.app_id
                )
            return False
        return asked

    @property
    def functions(self) -> dict[str, RegisteredFunction]:
        return dict(self._functions)

    def function(
        self,
        function_id: str,
        *,
        timeout: timedelta | None = None,
        retired_steps: Iterable[str] = (),
        max_parallel: int = DEFAULT_MAX_PARALLEL,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Register a workflow function ``fn(input, step)`` under ``function_id``.

        ``timeout`` is the run timeout every run of this function inherits.

        ``retired_steps`` names step ids this code no longer calls, on purpose: when a run's unwind reaches
        a completed step with a retired id, its compensation is skipped. Without it, a compensation pass that
        ends before its step (an early return, a guard on an external read) blocks the unwind until a release,
        the probe or an operator moves it on: a pass that did not reach the step proves nothing about it.

        ``max_parallel`` bounds the steps declared together (``asyncio.gather``, a task group, ``step.parallel``)
        that run at once (decision 30); the rest start in declaration order as those settle.
        """
        retired = frozenset(retired_steps)
        if isinstance(max_parallel, bool) or not isinstance(max_parallel, int):
            raise DefinitionError(f"function {function_id!r}: max_parallel must be a whole number")
        if not 1 <= max_parallel <= MAX_PARALLEL_LIMIT:
            raise DefinitionError(f"function {function_id!r}: max_parallel must be between 1 and {MAX_PARALLEL_LIMIT}")
        if isinstance(retired_steps, str) or not all(isinstance(r, str) and r for r in retired):
            raise DefinitionError(f"function {function_id!r}: retired_steps must be a list of step ids")
        if not function_id or not isinstance(function_id, str) or len(function_id) > MAX_ID_LENGTH:
            raise DefinitionError(f"function id must be a string of 1 to {MAX_ID_LENGTH} characters")
        if timeout is not None and not timedelta(0) < timeout <= timedelta(seconds=MAX_RUN_TIMEOUT_S):
            raise DefinitionError(f"function {function_id!r}: timeout must be positive and at most ten years")

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            if function_id in self._functions:
                raise DefinitionError(f"function id {function_id!r} is registered twice in app {self.app_id!r}")
            self._functions[function_id] = RegisteredFunction(
                function_id, fn, timeout, inspect.iscoroutinefunction(fn), retired, max_parallel
            )
            return fn

        return register

    # ---- identity ----------------------------------------------------------

    @property
    def build_id(self) -> str:
        """A digest of the source of the modules that define this app's functions."""
        if self._build_id:
            return self._build_id
        env = os.environ.get("RYUSEN_BUILD_ID")
        if env:
            return env
        modules = sorted({f.fn.__module__ or "" for f in self._functions.values()})
        if self._digest is not None and self._digest[0] == modules:
            return self._digest[1]  # the code this process runs does not change under it: worked out once
        digest = hashlib.sha256()
        for name in modules:
            module = sys.modules.get(name) if name else None
            try:
                digest.update(inspect.getsource(module).encode() if module else name.encode())
            except (OSError, TypeError):
                digest.update(name.encode())
        self._digest = (modules, digest.hexdigest()[:16])
        return self._digest[1]

    @property
    def release_id(self) -> str:
        return self._release_id or os.environ.get("RYUSEN_RELEASE_ID") or f"{self.app_id}-{self.build_id[:12]}"

    def manifest(self) -> Manifest:
        return Manifest(
            app_id=self.app_id,
            release_id=self.release_id,
            build_id=self.build_id,
            functions=[
                FunctionManifest(id=f.id, timeout_s=f.timeout.total_seconds() if f.timeout else None)
                for f in self._functions.values()
            ],
            signed=bool(self.signing_keys),
        )

    # ---- executing a task --------------------------------------------------

    def execute(
        self,
        request: TaskRequest,
        sent: TaskRequest | None = None,
        *,
        options: ServeOptions | None = None,
        window: ResponseWindow | None = None,
    ) -> TaskResponse:
        """Run one task to its outcome (synchronously; async functions get an event loop).

        What the task reports is decided by the replay, never by how the function
        ended: a callback that ran is reported even if the code around it raised
        or returned early (decisions 16). ``sent`` is the request as it arrived (with
        ``memo_base``, its memo only what changed), which a kept pass must extend. ``options``: how this
        endpoint serves the app (:class:`ServeOptions`; None: as the app does by itself). ``window``: when the
        server stops listening (None: counted from now).
        """
        window = window or self._window(request)
        registered = self._functions.get(request.function_id)
        if registered is None:
            return self._not_found(request)
        if registered.is_async:
            return _run_coroutine(self.execute_async(request, sent, options=options, window=window))
        if (
            request.kind is TaskKind.FORWARD
            and request.continue_after
            and request.memo_token is not None
            and self.kept_passes.capacity > 0
            and (options is None or options.kept_passes)
            and not _on_lambda(options)  # a pass must not outlive its request there (it is frozen with it)
        ):
            served = self._execute_kept(registered, request, sent, options, window)
            if served is not None:
                return served
        elif len(self.kept_passes):
            self.kept_passes.drop(request.run_id)  # not a chained attempt: the run's kept pass is of no use
        pristine = _fresh(request.input) if request.continue_after else None  # the pass may change its input
        first = _replay(request, registered)
        outcome = self._pass(registered, request, first)
        following = (
            self._continuation(registered, request, outcome, pristine, window, inline=_on_lambda(options))
            if not first.had_siblings  # a step declared with others: the next discovery waits for them all
            else None
        )
        return _respond(request, outcome, following)

    def _execute_kept(
        self,
        registered: RegisteredFunction,
        request: TaskRequest,
        sent: TaskRequest | None,
        options: ServeOptions | None,
        window: ResponseWindow,
    ) -> TaskResponse | None:
        """A chained forward attempt, served by the run's kept pass when it waits at this step, or by a new one
        (``kept.py``); the pass goes on after a successful callback, and is kept at the next step. None: no pass
        waits for it and none may start (the registry's bounds): the attempt replays from the top."""
        kept = self.kept_passes
        live = kept.take(request.run_id)
        if live is not None and (sent is None or not live.resume(request, sent)):
            live.end()
            kept.not_resumed(request.run_id)
            live = None
        if live is None:
            if not kept.admits(request):
                return None
            run_input = _fresh(request.input)  # the pass may change its input; a replay needs it as it arrived
            live = LivePass(registered, request, idle_s=kept.idle_s)
            live.replay.build_id = self.build_id
            kept.start(live)
        else:
            run_input = request.input  # the pass that goes on has its own; this one came fresh from JSON
            kept.resumed_by(request.run_id)
        live.on_late = lambda outcome: self._submit_late(request, _respond(request, outcome), window)
        give_up_s = None
        if (left := window.left()) is not None:  # well after the server has stopped listening (kept.py)
            give_up_s = max(left, 0.0) + KEPT_GIVE_UP_AFTER_S
        try:
            attempt, waiting_at = live.answer(lambda: _continuation_budget(window), give_up_s)
        except BaseException:
            if not live.abandoned:  # an abandoned pass still runs its callback, whose outcome goes late
                live.end()  # the request is gone (an interrupt): the pass must not wait at a step
            raise
        if waiting_at is not None and live.waiting:
            if options is not None and options.on_divergence is not None:
                replayed = self._continuation(registered, request, attempt, run_input, window)
                if replayed is not None and _as_json(replayed) != _as_json(waiting_at):
                    options.on_divergence(
                        DiscoveryDivergence(request.run_id, request.function_id, request.step_id, waiting_at, replayed)
                    )
                    live.end()
                    return _respond(request, attempt, replayed)
            live.kept_for(request, attempt)
            kept.keep(live)
            return _respond(request, attempt, waiting_at)
        if live.overran:
            # still going after the continuation's budget (slow code after a step): the answer goes without
            # a next step, and the server runs the discovery as a task of its own, as without a kept pass
            return _respond(request, attempt)
        # The pass did not stop at a step: it ended (completed, failed, met a conflict), or did not go on
        # after the callback. What the run does then is what a replay from the top with the recorded results
        # does, as without a kept pass (a fault in code after a step is not the run's failure unless a
        # replay fails too); once a run, so its cost does not grow with the run.
        following = self._continuation(registered, request, attempt, run_input, window)
        ended = live.final_report
        if isinstance(ended, FunctionFailed) and following is not None and not isinstance(following, FunctionFailed):
            log.warning(
                "run %s (%s): after step %r the function raised %s: %s; a replay from the recorded results "
                "did not, and that replay decides what the run does",
                request.run_id,
                request.function_id,
                request.step_id,
                ended.error.type,
                ended.error.message[:500],
            )
        return _respond(request, attempt, following)

    def _pass(self, registered: RegisteredFunction, request: TaskRequest, replay: _Replay) -> Any:
        """One pass of a plain function: what the replay reports once the function returned or raised."""
        output: Any = None
        raised: BaseException | None = None
        replay.function_thread = threading.get_ident()
        replay.build_id = self.build_id
        try:
            output = registered.fn(request.input, Step(replay))
        except BaseException as exc:  # noqa: BLE001 - the replay decides what is reported (a pass-ending Suspend too)
            raised = exc
        return replay.report(output=output, raised=raised)

    def _continuation(
        self,
        registered: RegisteredFunction,
        request: TaskRequest,
        outcome: Any,
        run_input: Any,
        window: ResponseWindow,
        *,
        inline: bool = False,
    ) -> Any:
        """After a successful forward callback (``continue_after``): a discovery pass, replayed from the top
        with the callback's result recorded, run within the same request but on a budget of its own. It is
        the pass the server would otherwise send next; None (the server sends it) when it runs out of time.

        ``inline`` (on Lambda): on this thread, to its end, as nothing may go on after the handler returns; a pass
        that outlasts its budget delays the answer, and the callback's outcome then goes as a late result."""
        discovery = _discovery_after(request, outcome, run_input)
        if discovery is None:
            return None
        budget = _continuation_budget(window)
        if budget <= 0:
            return None
        replay = _replay(discovery, registered)
        if inline:
            try:
                return self._pass(registered, discovery, replay)
            except Exception:  # noqa: BLE001 - an interrupted pass: the server runs its own discovery
                return None
        context = contextvars.copy_context()
        future = _continuations().submit(context.run, self._pass, registered, discovery, replay)
        try:
            return future.result(timeout=budget)
        except concurrent.futures.TimeoutError:
            future.cancel()
            replay.close()  # a pass still running starts no step; the server runs its own discovery
            log.warning(
                "the discovery after step %r of run %s took over %.1fs; the server will run it as a task",
                request.step_id,
                request.run_id,
                budget,
            )
            return None
        except BaseException:  # noqa: BLE001 - an interrupted pass: the server runs its own discovery
            return None

    async def execute_async(
        self,
        request: TaskRequest,
        sent: TaskRequest | None = None,
        *,
        options: ServeOptions | None = None,
        window: ResponseWindow | None = None,
    ) -> TaskResponse:
        window = window or self._window(request)
        registered = self._functions.get(request.function_id)
        if registered is None:
            return self._not_found(request)
        if not registered.is_async:  # a plain function (and its callbacks) must not block the server's loop
            return await asyncio.to_thread(self.execute, request, sent, options=options, window=window)
        pristine = _fresh(request.input) if request.continue_after else None  # the pass may change its input
        first = _replay(request, registered)
        outcome = await self._pass_async(registered, request, first)
        following: Any = None
        # a step declared with others: the server runs the next discovery once they all have settled
        discovery = _discovery_after(request, outcome, pristine) if not first.had_siblings else None
        budget = _continuation_budget(window) if discovery is not None else 0.0
        if discovery is not None and budget > 0:
            replay = _replay(discovery, registered)
            try:
                following = await asyncio.wait_for(self._pass_async(registered, discovery, replay), budget)
            except TimeoutError:
                replay.close()
                log.warning(
                    "the discovery after step %r of run %s took over %.1fs; the server will run it as a task",
                    request.step_id,
                    request.run_id,
                    budget,
                )
            except Exception:  # noqa: BLE001 - an interrupted pass: the server runs its own discovery
                following = None
        return _respond(request, outcome, following)

    async def _pass_async(self, registered: RegisteredFunction, request: TaskRequest, replay: _Replay) -> Any:
        raised: BaseException | None = None
        output: Any = None
        replay.function_thread = threading.get_ident()  # the event loop's
        replay.build_id = self.build_id
        attention = replay.attention = asyncio.Event()
        main = asyncio.ensure_future(registered.fn(request.input, AsyncStep(replay)))
        try:
            # steps the function awaits with no recorded outcome wait; once its tasks have settled, the pass
            # decides what they report together (decision 30)
            while not main.done():
                noticed = asyncio.ensure_future(attention.wait())
                try:
                    await asyncio.wait((main, noticed), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    noticed.cancel()
                if main.done():
                    break
                attention.clear()
                await replay.settle(main)
                if not main.done():
                    await replay.decide_waiting()
            try:
                output = main.result()
            except BaseException as exc:  # noqa: BLE001 - a Suspend, possibly inside an exception group (TaskGroup)
                raised = exc
        finally:
            if not main.done():
                main.cancel()
        await replay.finish_declared()
        await replay.wait_for_callback()
        return replay.report(output=output, raised=raised)

    def _not_found(self, request: TaskRequest) -> TaskResponse:
        detail = f"app {self.app_id!r} has no function {request.function_id!r}"
        return _respond(request, FunctionNotFound(detail=detail))

    # ---- the HTTP handler --------------------------------------------------

    def handle(self, method: str, headers: dict[str, str], body: bytes, *, path: str = "/") -> HandlerResponse:
        """Answer one HTTP request: GET returns the manifest, a signed POST runs a task.

        ``path`` is the path the request was sent to, as the sender named it (the serve adapters pass it):
        a task request is signed for its path, and holds at no other."""
        return self._serve(method, headers, body, path, self.signing_keys)

    def _serve(
        self,
        method: str,
        headers: dict[str, str],
        body: bytes,
        path: str,
        keys: list[str],
        *,
        insecure: bool = False,
        options: ServeOptions | None = None,
    ) -> HandlerResponse:
        """:meth:`handle` with this app's keys ``keys`` (``ryusen.testing`` serves an app that has none of its
        own with the key its environment derives for it, or in-process and ``insecure``, unsigned), and with
        ``options`` (its environment's)."""
        arrived, wall = time.monotonic(), self.clock()
        admitted = self._admit(method, headers, body, path, keys, insecure=insecure, options=options)
        if isinstance(admitted, HandlerResponse):
            return admitted
        sent, answering = admitted
        if sent.result_url is not None:
            self._result_url = sent.result_url  # where ``complete`` posts: the server's own result URL
        request = self.memo_cache.resolve(sent)
        if request is None:
            return self._reply(200, encode_response(_memo_miss(sent)), answering)
        window = ResponseWindow.of(request, arrived=arrived, wall=wall)
        if options is not None and options.lambda_context is not None:
            _warn_short_invocation(request, window, options.lambda_context)
        beating = SINK.set(self._heartbeat_sink(request, options, keys))  # the callback's heartbeats (decision 33)
        try:
            if _acknowledges(request, options):
                return self._serve_acknowledging(request, sent, options, window, answering)
            try:
                response = self.execute(request, sent, options=options, window=window)
            except CallbackInterruptedError as exc:
                return self._error(500, "callback_interrupted", str(exc), answering)
        finally:
            SINK.reset(beating)
        self._submit_late(request, response, window, lambda_context=options.lambda_context if options else None)
        return self._reply(200, encode_response(response), answering)

    def complete(
        self, token: str, result: Any = None, *, error: dict[str, Any] | None = None, result_url: str | None = None
    ) -> dict[str, Any]:
        """Complete a step from inside this app (decision 32): a webhook handler, say, with the token the step's
        callback handed out. Posted to the server's result URL, signed with this app's key, so no operator
        credentials are needed. ``error`` (``{"type", "message", "retryable"}``) fails the attempt instead.
        ``result_url``: where to post; by default the one the server's requests carry (or ``RYUSEN_RESULT_URL``).
        Raises :class:`CompletionError` when it is not taken (the same completion sent again is taken once)."""
        from .errors import CompletionError

        named = completion_binding(token) if isinstance(token, str) else None
        if named is None:
            raise CompletionError("not a completion token", code="completion_not_found", status=0)
        from .step import check_value

        checked, problem = check_value(result if error is None else (error or {}).get("data"), "result")
        if problem is not None:  # refused here, as the server would: never sent as some other value
            raise CompletionError(problem.message, code="invalid_value", status=0)
        if error is None:
            result = checked
        run_id, step_id, phase, generation = named
        post = CompletionPost(
            run_id=run_id,
            step_id=step_id,
            phase=phase,
            generation=generation,
            token=token,
            result=result if error is None else None,
            error=ErrorInfo.model_validate(error) if error is not None else None,
        )
        if self.complete_via is not None:
            return self.complete_via(post)
        url = result_url or self._result_url or os.environ.get("RYUSEN_RESULT_URL")
        if not url or not url.startswith(("http://", "https://")):
            raise CompletionError(
                "no result URL to post the completion to: pass result_url=, or set RYUSEN_RESULT_URL",
                code="no_result_url",
                status=0,
            )
        body = post.model_dump_json(exclude_none=True).encode()
        headers = {"content-type": "application/json"}
        key = choose_key(self.signing_keys, [self._server_key_id] if self._server_key_id else [])
        if key is not None:
            scope = completion_scope(post, path=url_path(url), app_id=self.app_id)
            headers[SIGNATURE_HEADER] = sign(key, scope, body, now=self.clock(), nonce=os.urandom(16).hex())
        req = urllib.request.Request(url, data=body, headers=headers, method="POST")  # noqa: S310 - checked http(s)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310
                answer: dict[str, Any] = json.loads(resp.read() or b"{}")
                return answer
        except urllib.error.HTTPError as exc:
            raw = exc.read()[:2000]
            try:
                detail = json.loads(raw).get("error") or {}
            except (ValueError, AttributeError):
                detail = {}
            code = str(detail.get("code") or f"http_{exc.code}")
            raise CompletionError(str(detail.get("message") or raw[:300]), code=code, status=exc.code) from None
        except OSError as exc:
            raise CompletionError(f"the completion was not delivered: {exc}", code="not_delivered", status=0) from exc

    def drain(self, timeout_s: float = 30.0) -> int:
        """Wait, at most ``timeout_s``, until every attempt this process answered ``accepted`` has ended and its
        outcome has been posted (or given up on); call it when the server shuts down (a deploy, a scale-in), after
        it stops taking requests: an attempt cut short there is Unknown at its lease's end. Returns how many were
        still running. ``app.asgi()`` drains on the ASGI lifespan's shutdown; ``ryusen dev`` on a reload."""
        deadline = time.monotonic() + timeout_s
        with self._draining:
            while self._acknowledged_running > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._draining.wait(left)
            return self._acknowledged_running

    def _acknowledged_started(self) -> None:
        with self._draining:
            self._acknowledged_running += 1

    def _acknowledged_ended(self) -> None:
        with self._draining:
            self._acknowledged_running -= 1
            self._draining.notify_all()

    def _serve_acknowledging(
        self,
        request: TaskRequest,
        sent: TaskRequest,
        options: ServeOptions | None,
        window: ResponseWindow,
        answering: _Answering | None,
    ) -> HandlerResponse:
        """An attempt the server asked to acknowledge (``acknowledge_after_s``): it runs on a thread of its own;
        if it ends within that time its outcome is the answer, as for any request; otherwise the answer is
        ``accepted`` at once, and the outcome, with what the replay found next, goes to the result URL when the
        attempt ends. Exactly one of the two carries it (``_Acknowledgement``)."""
        assert request.acknowledge_after_s is not None
        ack = _Acknowledgement(on_accepted=self._acknowledged_started)

        def attempt() -> None:
            outcome: TaskResponse | CallbackInterruptedError
            try:
                outcome = self.execute(request, sent, options=options, window=window)
            except CallbackInterruptedError as exc:
                outcome = exc
            except BaseException as exc:  # the thread must hand something over
                log.exception("run %s: the attempt's thread failed", request.run_id)
                outcome = CallbackInterruptedError(f"{type(exc).__name__}: {exc}")
            if ack.finish(outcome):
                try:
                    self._deliver_acknowledged(request, outcome)
                finally:
                    self._acknowledged_ended()

        context = contextvars.copy_context()
        name = f"ryusen-attempt-{request.step_id}"
        threading.Thread(target=context.run, args=(attempt,), name=name, daemon=True).start()
        outcome = ack.wait(request.acknowledge_after_s)
        if outcome is None:
            accepted = TaskResponse(kind=request.kind, run_id=request.run_id, accepted=True)
            return self._reply(202, encode_response(accepted), answering)
        if isinstance(outcome, CallbackInterruptedError):
            return self._error(500, "callback_interrupted", str(outcome), answering)
        self._submit_late(request, outcome, window)
        return self._reply(200, encode_response(outcome), answering)

    async def _serve_acknowledging_async(
        self, request: TaskRequest, sent: TaskRequest, window: ResponseWindow, answering: _Answering | None
    ) -> HandlerResponse:
        """:meth:`_serve_acknowledging` on the event loop: the attempt is a task of its own, which goes on after an
        ``accepted`` answer (the loop of an ASGI server runs on) and posts its outcome from a thread."""
        assert request.acknowledge_after_s is not None
        task = asyncio.ensure_future(self.execute_async(request, sent, window=window))
        done, _ = await asyncio.wait({task}, timeout=request.acknowledge_after_s)
        if not done:
            _ACKNOWLEDGED_TASKS.add(task)  # the loop holds tasks weakly
            self._acknowledged_started()

            def finished(task: asyncio.Task[TaskResponse]) -> None:
                _ACKNOWLEDGED_TASKS.discard(task)
                outcome: TaskResponse | CallbackInterruptedError
                if task.cancelled():
                    outcome = CallbackInterruptedError("the attempt's task was cancelled")
                elif isinstance(exc := task.exception(), CallbackInterruptedError):
                    outcome = exc
                elif exc is not None:
                    outcome = CallbackInterruptedError(f"{type(exc).__name__}: {exc}")
                else:
                    outcome = task.result()

                def deliver() -> None:
                    try:
                        self._deliver_acknowledged(request, outcome)
                    finally:
                        self._acknowledged_ended()

                threading.Thread(target=deliver, daemon=True).start()

            task.add_done_callback(finished)
            accepted = TaskResponse(kind=request.kind, run_id=request.run_id, accepted=True)
            return self._reply(202, encode_response(accepted), answering)
        try:
            response = task.result()
        except CallbackInterruptedError as exc:
            return self._error(500, "callback_interrupted", str(exc), answering)
        await asyncio.to_thread(self._submit_late, request, response, window)
        return self._reply(200, encode_response(response), answering)

    def _heartbeat_sink(
        self, request: TaskRequest, options: ServeOptions | None, keys: list[str]
    ) -> HeartbeatSink | None:
        """Where the heartbeats of the attempt ``request`` asks for go, signed with ``keys`` (the keys the request
        was served with); None: not an attempt, or nowhere to go."""
        url = request.result_url
        if request.operation is None or request.step_id is None:
            return None
        post: Callable[[Heartbeat], HeartbeatReply | None]
        if options is not None and options.heartbeats is not None:
            deliver = options.heartbeats
            path = url_path(url) if url else "/v1/results"
            post = lambda beat: deliver(beat, self._heartbeat_headers(beat, path, keys))  # noqa: E731
        elif url is not None and url.startswith(("http://", "https://")):
            post = functools.partial(self._post_heartbeat, url, keys)
        else:
            return None
        return HeartbeatSink(
            post=post,
            throttled=options.heartbeats_throttled if options is not None else True,
            run_id=request.run_id,
            step_id=request.step_id,
            phase=request.operation.phase,
            generation=request.operation.generation,
        )

    def _heartbeat_headers(self, beat: Heartbeat, path: str, keys: list[str]) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        key = choose_key(keys, [self._server_key_id] if self._server_key_id else [])
        if key is not None:
            scope = heartbeat_scope(beat, path=path, app_id=self.app_id)
            body = beat.model_dump_json().encode()
            headers[SIGNATURE_HEADER] = sign(key, scope, body, now=self.clock(), nonce=os.urandom(16).hex())
        return headers

    def _post_heartbeat(self, url: str, keys: list[str], beat: Heartbeat) -> HeartbeatReply | None:
        """Post one heartbeat, signed; its reply, or None when it could not be delivered (logged: the attempt's
        lease is extended by the next one that is, or it ends and the attempt is Unknown)."""
        body = beat.model_dump_json().encode()
        headers = self._heartbeat_headers(beat, url_path(url), keys)
        req = urllib.request.Request(url, data=body, headers=headers, method="POST")  # noqa: S310 - checked http(s)
        try:
            with urllib.request.urlopen(req, timeout=HEARTBEAT_TIMEOUT_S) as resp:  # noqa: S310
                return HeartbeatReply.model_validate_json(resp.read())
        except urllib.error.HTTPError as exc:
            problem = f"HTTP {exc.code}: {exc.read()[:300]!r}"
        except (OSError, ValidationError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        log.warning("a heartbeat of run %s step %s was not delivered (%s)", beat.run_id, beat.step_id, problem)
        return None

    def _deliver_acknowledged(
        self, request: TaskRequest, outcome: TaskResponse | CallbackInterruptedError, *, lambda_context: Any = None
    ) -> None:
        """The outcome of an attempt answered ``accepted`` (or taken as an asynchronous event), posted to the
        result URL with what the replay found next (the server takes that only from the build it would run next).
        With the Lambda invocation's ``lambda_context``, the tries end while the handler can still return."""
        what = _describe(request)
        if isinstance(outcome, CallbackInterruptedError) or outcome.attempt is None:
            log.error(
                "%s was acknowledged but ended without an outcome (%s): it becomes Unknown when its lease expires",
                what,
                outcome if isinstance(outcome, CallbackInterruptedError) else "no attempt outcome",
            )
            return
        assert request.operation is not None and request.step_id is not None and request.result_url is not None
        result = LateResult(
            run_id=request.run_id,
            step_id=request.step_id,
            phase=request.operation.phase,
            generation=request.operation.generation,
            attempt=outcome.attempt,
            next=outcome.next,
            build_id=self.build_id if outcome.next is not None else None,
        )
        delays = (0.0, *ACKNOWLEDGED_DELAYS_S)
        self._post_result(
            request.result_url, result, what, delays, near=False, lambda_context=lambda_context, noun="result"
        )

    def serve_event(self, headers: dict[str, str], body: bytes, path: str, context: Any) -> HandlerResponse:
        """A task request the server sent as an asynchronous Lambda event (``InvocationType=Event``): nobody waits
        for an answer, so the attempt runs here, on the handler's thread, and its outcome goes to the result URL
        (with what the replay found next) before the handler returns, as an acknowledged attempt's does.

        The request is admitted exactly as on the URL: signed for this path, fresh, and never seen before by any
        container (the shared replay memory that announcing ``lambda_event`` requires). A copy Lambda delivers
        again is refused there and runs nothing; so is a request that waited in Lambda's queue past the skew
        window. Nothing is posted for a refused request: the attempt becomes Unknown when its lease ends, as
        for any silence. The returned answer goes nowhere (Lambda drops an event's result); it is what was
        decided, for the log and for tests."""
        options = ServeOptions(on_lambda=True, lambda_context=context)
        arrived, wall = time.monotonic(), self.clock()
        admitted = self._admit("POST", headers, body, path, self.signing_keys, options=options)
        if isinstance(admitted, HandlerResponse):
            log.error(
                "a task event was refused before it ran (HTTP %s: %s); if it was an attempt, it becomes Unknown"
                " when its lease ends",
                admitted.status,
                admitted.body[:300].decode(errors="replace"),
            )
            return admitted
        sent, answering = admitted
        if sent.result_url is not None:
            self._result_url = sent.result_url
        request = self.memo_cache.resolve(sent)
        if (
            request is None
            or request.kind is TaskKind.DISCOVER
            or request.operation is None
            or request.step_id is None
            or request.result_url is None
        ):
            # the server sends only attempts this way, with their whole memo and a result URL: anything else has
            # nowhere to put its answer, so it runs nothing
            log.error("a task event that is not an attempt with a result URL was ignored (run %s)", sent.run_id)
            return self._error(400, "not_an_attempt_event", "only an attempt is taken as an event", answering)
        window = ResponseWindow.of(request, arrived=arrived, wall=wall)
        beating = SINK.set(self._heartbeat_sink(request, options, self.signing_keys))  # decision 33
        outcome: TaskResponse | CallbackInterruptedError
        try:
            outcome = self.execute(request, sent, options=options, window=window)
        except CallbackInterruptedError as exc:
            outcome = exc
        finally:
            SINK.reset(beating)
        self._deliver_acknowledged(request, outcome, lambda_context=context)
        accepted = TaskResponse(kind=request.kind, run_id=request.run_id, accepted=True)
        return self._reply(202, encode_response(accepted), answering)

    async def handle_async(
        self, method: str, headers: dict[str, str], body: bytes, *, path: str = "/"
    ) -> HandlerResponse:
        arrived, wall = time.monotonic(), self.clock()
        admitted = self._admit(method, headers, body, path, self.signing_keys)
        if isinstance(admitted, HandlerResponse):
            return admitted
        sent, answering = admitted
        if sent.result_url is not None:
            self._result_url = sent.result_url  # where ``complete`` posts: the server's own result URL
        request = self.memo_cache.resolve(sent)
        if request is None:
            return self._reply(200, encode_response(_memo_miss(sent)), answering)
        window = ResponseWindow.of(request, arrived=arrived, wall=wall)
        beating = SINK.set(self._heartbeat_sink(request, None, self.signing_keys))  # decision 33
        try:
            if _acknowledges(request, None):
                return await self._serve_acknowledging_async(request, sent, window, answering)
            try:
                response = await self.execute_async(request, sent, window=window)
            except CallbackInterruptedError as exc:
                return self._error(500, "callback_interrupted", str(exc), answering)
        finally:
            SINK.reset(beating)
        await asyncio.to_thread(self._submit_late, request, response, window)
        return self._reply(200, encode_response(response), answering)

    def _admit(
        self,
        method: str,
        headers: dict[str, str],
        body: bytes,
        path: str,
        keys: list[str],
        *,
        insecure: bool = False,
        options: ServeOptions | None = None,
    ) -> tuple[TaskRequest, _Answering | None] | HandlerResponse:
        """The task request to run and what its answer is signed with, or the answer that refuses it (before
        any user code): a GET (the manifest), another method, an oversized body, no key outside insecure local
        mode, a malformed request, a signature that is not this app's for this request at this path, a replay."""
        insecure = insecure or self.insecure
        if method == "GET":
            lowered = {k.lower(): v for k, v in headers.items()}
            held = choose_key(keys, parse_key_ids(lowered.get(KEY_IDS_HEADER.lower())))  # mid-rotation: the server's
            challenge = lowered.get(CHALLENGE_HEADER.lower())
            shared = bool(getattr(self.seen_requests, "shared", False))
            announced = features(options, shared_replay=shared)
            return self._manifest_reply(path, [held] if held else keys, insecure, challenge, announced)
        if method != "POST":
            return self._error(405, "method_not_allowed", f"{method} is not supported")
        if len(body) > MAX_REQUEST_BYTES:
            return self._error(413, "request_too_large", "task request is too large")
        if not keys and not insecure:
            return self._error(
                503,
                "no_signing_key",
                f"this endpoint has no signing key and was not started in insecure local mode ({INSECURE_ENV}=1):"
                " it runs nothing",
            )
        header = {k.lower(): v for k, v in headers.items()}.get(SIGNATURE_HEADER.lower())
        if keys:
            try:
                parse(header)  # an unsigned or malformed request is refused before its body is parsed
            except SignatureError as exc:
                return self._error(401, "invalid_signature", exc.reason)
        elif self.insecure:
            self._warn_insecure()  # (in-process, ryusen.testing unsigned, is not a mode anyone deploys)
        answering: _Answering | None = None
        if keys:
            scope = received_task_scope(body, path=path, app_id=self.app_id)
            try:
                signature, secret = verify(keys, scope, body, header, now=self.clock())
            except StaleSignatureError as exc:
                # this app's own, genuine request, too late: it may have run here or elsewhere before, so the
                # refusal says "stale", which the server records as not known (never "nothing ran")
                stale = _Answering(keys[0], scope.answer(), parse(header).nonce, answer_binding(str(header), body))
                return self._error(401, "stale_request", exc.reason, stale)
            except SignatureError as exc:
                # refused, signed with this app's key as the answer to exactly what arrived: the server tells
                # "it ran nothing" (a request signed with a key this app does not hold yet, mid-rotation) from
                # a forgery, and a refusal of anything else is no answer to its own request
                claimed = parse(header)
                assert header is not None  # parse() accepted it
                refusal = _Answering(keys[0], scope.answer(), claimed.nonce, answer_binding(header, body))
                return self._error(401, "invalid_signature", exc.reason, refusal)
            assert header is not None
            answering = _Answering(secret, scope.answer(), signature.nonce, answer_binding(header, body))
            self._server_key_id = signature.key_id
            try:
                first = self.seen_requests.first_time(signature, self.clock())
            except ReplayCheckUnavailableError as exc:
                # nothing runs unrecorded; another instance may have run it, so the server records the
                # outcome as not known
                return self._error(503, "replay_check_unavailable", str(exc), answering)
            if not first:
                # the server signs every send afresh: this one was received before, so what it asked for may
                # have run (the server records this answer's outcome as not known)
                return self._error(401, "replayed_request", "this signed request was already received", answering)
        try:
            sent = TaskRequest.model_validate_json(body)
        except ValidationError as exc:
            return self._error(400, "invalid_task_request", str(exc.errors(include_url=False)[:3]), answering)
        return sent, answering

    def _manifest_reply(
        self, path: str, keys: list[str], insecure: bool, challenge: str | None, announced: tuple[str, ...]
    ) -> HandlerResponse:
        """The manifest, signed (with the features it announces) as this app's answer to a GET at ``path``, with
        the server's ``challenge`` as the nonce (so that it holds for that fetch only)."""
        manifest = self.manifest().model_copy(update={"signed": bool(keys)})
        body = manifest.model_dump_json().encode()
        features = ",".join(announced)
        headers = {"content-type": "application/json", FEATURES_HEADER: features}
        if keys:
            scope = Scope("response", "GET", path, self.app_id, extra=features)
            nonce = challenge if challenge is not None and is_nonce(challenge) else os.urandom(16).hex()
            headers[SIGNATURE_HEADER] = sign(keys[0], scope, body, now=self.clock(), nonce=nonce)
        elif not insecure:
            body = json.dumps(
                {"error": {"code": "no_signing_key", "message": "this endpoint has no signing key"}}
            ).encode()
            return HandlerResponse(503, {"content-type": "application/json"}, body)
        return HandlerResponse(200, headers, body)

    def _warn_insecure(self) -> None:
        if not self._warned_insecure:
            self._warned_insecure = True
            log.warning(
                "INSECURE: app %r runs tasks without verifying signatures (%s=1); anyone who can reach this"
                " endpoint can run its callbacks. Never deploy it so.",
                self.app_id,
                INSECURE_ENV,
            )

    def _reply(self, status: int, body: bytes, answering: _Answering | None = None) -> HandlerResponse:
        """An answer, signed as the answer to the request ``answering`` names (unsigned: a request that could
        not be verified, or insecure local mode)."""
        headers = {"content-type": "application/json"}
        if answering is not None:
            headers[SIGNATURE_HEADER] = sign(
                answering.secret,
                answering.scope,
                body,
                now=self.clock(),
                nonce=answering.nonce,
                answers=answering.answers,
            )
        return HandlerResponse(status, headers, body)

    def _error(self, status: int, code: str, message: str, answering: _Answering | None = None) -> HandlerResponse:
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        return self._reply(status, body, answering)

    def _window(self, request: TaskRequest) -> ResponseWindow:
        """The response window of ``request``, counted from now (it is being served as it arrives)."""
        return ResponseWindow.of(request, arrived=time.monotonic(), wall=self.clock())

    def _submit_late(
        self,
        request: TaskRequest,
        response: TaskResponse,
        window: ResponseWindow | None = None,
        *,
        lambda_context: Any = None,
    ) -> None:
        """Submit an effect outcome to the server when its response window has closed (decisions 6.15).

        The dispatcher stopped listening at ``respond_by`` (the attempt's timeout, or earlier when the
        dispatcher itself had to stop, as a Lambda must before 15 minutes), so the outcome goes to the
        server's result endpoint, signed like a response. A server error or a failed connection is
        retried (``LATE_RESULT_DELAYS_S``); a refusal (4xx: a stale generation, a bad signature) is
        final. Either way the outcome is logged, so an operator can resolve the attempt by hand.

        An outcome finished within ``LATE_MARGIN_S`` before ``respond_by`` is also submitted, once, as the
        response leaves: the dispatcher listens only a short grace past ``respond_by``, and a response that
        arrives after it would otherwise leave the attempt Unknown. The copy that lands second is a stale
        submission and changes nothing.

        This runs on the request's thread, before the answer goes: on Lambda, which freezes the environment once
        the handler returns, the result is delivered (or given up on) first. With the invocation's
        ``lambda_context``, the retries end while the handler still has ``LAMBDA_RESERVE_S`` to return (Lambda
        would otherwise end it mid-try, and with it the log that names the outcome).
        """
        attempt = response.attempt
        left = (window or self._window(request)).left()  # when the server stops listening (ResponseWindow)
        if (
            request.result_url is None
            or left is None
            or request.operation is None
            or request.step_id is None
            or not isinstance(attempt, CallbackSucceeded | CallbackFailed)
            or left >= LATE_MARGIN_S
        ):
            return
        near = left >= 0  # the response may still arrive in time: one try, no retries
        late = LateResult(
            run_id=request.run_id,
            step_id=request.step_id,
            phase=request.operation.phase,
            generation=request.operation.generation,
            attempt=attempt,
        )
        # On Lambda (an attempt whose dispatcher stopped listening: its deadline, or the engine's quick path for a
        # Lambda endpoint that takes events), the outcome is tried as long as an event's: the server waits for
        # nothing else, and the tries end with the invocation anyway. Elsewhere, about 2 minutes.
        later = ACKNOWLEDGED_DELAYS_S if lambda_context is not None else LATE_RESULT_DELAYS_S
        delays = (0.0,) if near else (0.0, *later)
        what = _describe(request)
        self._post_result(request.result_url, late, what, delays, near=near, lambda_context=lambda_context)

    def _post_result(
        self,
        url: str,
        result: LateResult,
        what: str,
        delays: tuple[float, ...],
        *,
        near: bool,
        lambda_context: Any,
        noun: str = "late result",
    ) -> None:
        """Post ``result`` to the server's result endpoint, signed, trying again after each of ``delays`` on a
        server error or a failed connection; a refusal (4xx: a stale generation, a bad signature) is final.
        Either way the outcome is logged, so that an operator can resolve the attempt by hand."""
        if not url.startswith(("http://", "https://")):
            log.error("could not deliver the %s of %s: result URL %r is not http(s)", noun, what, url)
            return
        body = result.model_dump_json(exclude_none=True).encode()
        scope = late_result_scope(result, path=url_path(url), app_id=self.app_id)
        problem = ""
        for delay in delays:
            try_s = LATE_MARGIN_S if near else 30.0
            if (remaining := _lambda_remaining_s(lambda_context)) is not None:
                try_s = min(try_s, remaining - delay - LAMBDA_RESERVE_S)
                if try_s < 0.1:  # no time for another try before the invocation ends
                    problem = f"{problem}; " if problem else ""
                    problem += f"{remaining:.1f}s left in the Lambda invocation, too little for another try"
                    if near:  # the answer itself is still on its way
                        log.info("no copy of the result of %s was sent ahead of its response (%s)", what, problem)
                        return
                    break
            time.sleep(delay)
            headers = {"content-type": "application/json"}
            key = choose_key(self.signing_keys, [self._server_key_id] if self._server_key_id else [])
            if key is not None:
                nonce = os.urandom(16).hex()
                headers[SIGNATURE_HEADER] = sign(key, scope, body, now=self.clock(), nonce=nonce)
            req = urllib.request.Request(url, data=body, headers=headers, method="POST")  # noqa: S310 - scheme checked above
            try:
                with urllib.request.urlopen(req, timeout=try_s) as resp:  # noqa: S310
                    resp.read()
                log.info("delivered the %s of %s", noun, what)
                return
            except urllib.error.HTTPError as exc:
                problem = f"HTTP {exc.code}: {exc.read()[:500]!r}"
                if exc.code < 500 and exc.code != 429:
                    log.warning("the server refused the %s of %s (%s); not retried", noun, what, problem)
                    return
            except OSError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if near:
                log.info(
                    "the copy of the result of %s sent ahead of its response was not delivered (%s)", what, problem
                )
                return
            log.warning("%s of %s not delivered yet (%s); retrying", noun, what, problem)
        log.error(
            "could not deliver the %s of %s (%s): the attempt becomes Unknown when its lease expires;"
            " resolve it with the outcome %s",
            noun,
            what,
            problem,
            result.attempt.model_dump_json(),
        )

    # ---- serving -----------------------------------------------------------

    def asgi(self) -> Any:
        """An ASGI application (mount it in Starlette or FastAPI, or serve it with uvicorn)."""
        from .serve import asgi_app

        return asgi_app(self)

    def wsgi(self) -> Any:
        """A WSGI application (mount it in Flask, or serve it with any WSGI server)."""
        from .serve import wsgi_app

        return wsgi_app(self)

    def lambda_handler(self, event: dict[str, Any], context: Any = None) -> dict[str, Any]:
        """A Lambda handler for a Function URL or API Gateway (REST or HTTP API) event.

        It returns only once everything it started has ended (Lambda freezes the environment then): the callback
        runs on this thread, to its end, and an outcome the server no longer listens for is submitted as a late
        result first (``ServeOptions.on_lambda``)."""
        from .serve import handle_lambda_event

        return handle_lambda_event(self, event, context)


_SECRETS: dict[str, tuple[float, SecretRead]] = {}
SECRET_TTL_S = 300.0
PREVIOUS_KEY_WINDOW_ENV = "RYUSEN_PREVIOUS_KEY_WINDOW_S"


def _secret_keys(secret_id: str, now: float) -> tuple[str | None, str | None]:
    """(current, previous) signing keys from the secret, read again after ``SECRET_TTL_S``; a failed
    re-read keeps the keys read before. The previous key (AWSPREVIOUS) holds only for the window after the
    rotation (``RYUSEN_PREVIOUS_KEY_WINDOW_S``, default a day), and not at all once an emergency rotation
    detached it."""
    cached = _SECRETS.get(secret_id)
    if cached is None or now - cached[0] > SECRET_TTL_S:
        import boto3  # only here: the Lambda runtime has it; the SDK does not depend on it

        try:
            known = cached[1] if cached else None
            if known is not None and known.keys(time.time(), _previous_key_window_s())[1] is not None:
                known = None  # a previous key still accepted: see whether it was detached since
            read = read_secret(boto3.client("secretsmanager"), secret_id, known=known)
        except Exception:
            if cached is None:
                raise
            log.warning(
                "could not re-read the signing key from %s; keeping the one read before", secret_id, exc_info=True
            )
            read = cached[1]
        cached = (now, read)
        _SECRETS[secret_id] = cached
    return cached[1].keys(time.time(), _previous_key_window_s())


def _previous_key_window_s() -> float:
    raw = os.environ.get(PREVIOUS_KEY_WINDOW_ENV, "").strip()
    try:
        return float(raw) if raw else PREVIOUS_KEY_WINDOW_S
    except ValueError:
        log.warning("%s=%r is not a number of seconds; using %g", PREVIOUS_KEY_WINDOW_ENV, raw, PREVIOUS_KEY_WINDOW_S)
        return PREVIOUS_KEY_WINDOW_S


def features(options: ServeOptions | None, *, shared_replay: bool = False) -> tuple[str, ...]:
    """The features this SDK announces where it is served so: all of them, except ``acknowledge`` on Lambda,
    which freezes the process once the handler returns, so an attempt there is never answered ``accepted`` (the
    server then keeps the late-result grace of an attempt it waits for).

    On Lambda, ``lambda_event=<this function's ARN>`` too, when the replay memory is ``shared_replay`` (every
    container refuses a request another accepted, so a copy of an event Lambda delivers twice runs nothing), the
    invocation's context names the function, and ``RYUSEN_LAMBDA_EVENTS`` is not ``0``: the server may then send
    attempts as asynchronous events, which no dispatcher waits on."""
    if not _on_lambda(options):
        return SDK_FEATURES
    announced = tuple(f for f in SDK_FEATURES if f != "acknowledge")
    arn = getattr(options.lambda_context if options is not None else None, "invoked_function_arn", None)
    wanted = os.environ.get(LAMBDA_EVENTS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
    if shared_replay and wanted and isinstance(arn, str) and _LAMBDA_ARN.fullmatch(arn):
        announced = (*announced, f"{LAMBDA_EVENT}={arn}")
    return announced


LAMBDA_EVENTS_ENV = "RYUSEN_LAMBDA_EVENTS"
"""``0`` keeps a Lambda endpoint from announcing ``lambda_event``: every attempt is then sent to its URL and waited
for (the dispatcher pays for the wait)."""
_LAMBDA_ARN = re.compile(LAMBDA_FUNCTION_ARN)


def _on_lambda(options: ServeOptions | None) -> bool:
    """Served where the environment freezes when the handler returns: by ``lambda_handler``, or in a Lambda
    function (the runtime sets ``AWS_LAMBDA_FUNCTION_NAME``; the app may be behind a web adapter there)."""
    return (options is not None and options.on_lambda) or bool(os.environ.get(LAMBDA_ENV))


def _lambda_remaining_s(context: Any) -> float | None:
    """What the Lambda invocation has left, in seconds (None: no context, or one that does not say)."""
    remaining = getattr(context, "get_remaining_time_in_millis", None)
    if not callable(remaining):
        return None
    try:
        return float(remaining()) / 1000.0
    except (TypeError, ValueError):
        return None


def _warn_short_invocation(request: TaskRequest, window: ResponseWindow, context: Any) -> None:
    """Say so when the Lambda invocation ends before the server stops listening: if the callback runs until then,
    Lambda ends it, nothing answers and nothing is submitted late, and the attempt becomes Unknown."""
    remaining, left = _lambda_remaining_s(context), window.left()
    if request.operation is None or remaining is None or left is None or remaining >= left + LAMBDA_RESERVE_S:
        return
    log.warning(
        "run %s step %s: this Lambda invocation has %.1fs left, and the server listens for %.1fs: a callback that"
        " runs past the invocation's end is stopped there, and its attempt becomes Unknown. Give the app's function"
        " a timeout above its longest step's, with time for a late result.",
        request.run_id,
        request.step_id,
        remaining,
        left,
    )


def _acknowledges(request: TaskRequest, options: ServeOptions | None) -> bool:
    """Whether this attempt is answered ``accepted`` if its callback runs long: the server asked, it gave a result
    URL to deliver the outcome to, and nothing freezes this process once the answer is sent (Lambda does)."""
    return (
        request.acknowledge_after_s is not None
        and request.kind is not TaskKind.DISCOVER
        and request.operation is not None
        and request.step_id is not None
        and request.result_url is not None
        and not _on_lambda(options)
    )


_ACKNOWLEDGED_TASKS: set[asyncio.Task[TaskResponse]] = set()
"""Attempts on an event loop that were answered ``accepted`` and still run."""


class _Acknowledgement:
    """Who carries an acknowledgeable attempt's outcome: the HTTP answer, if the attempt ends before the answer
    says ``accepted``; otherwise the post to the result URL. Decided once, under a lock."""

    def __init__(self, on_accepted: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._outcome: Any = None
        self._accepted = False
        self._on_accepted = on_accepted

    def finish(self, outcome: Any) -> bool:
        """The attempt ended with ``outcome``: True if the answer already said ``accepted`` (post it)."""
        with self._lock:
            self._outcome = outcome
            self._done.set()
            return self._accepted

    def wait(self, timeout_s: float) -> Any:
        """The outcome, if the attempt ends within ``timeout_s``; None once the answer is to say ``accepted``."""
        self._done.wait(timeout_s)
        with self._lock:
            if self._done.is_set():
                return self._outcome
            self._accepted = True
            if self._on_accepted is not None:
                self._on_accepted()  # under the lock: counted before the attempt can finish and post
            return None


def _describe(request: TaskRequest) -> str:
    if request.operation is None:
        return f"run {request.run_id} {request.kind}"
    op = request.operation
    return f"run {request.run_id} step {request.step_id} {op.phase} #{op.generation}"


def _run_coroutine(coro: Any) -> TaskResponse:
    """Run an async workflow to completion, also when the caller is itself inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)  # type: ignore[no-any-return]
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()  # type: ignore[no-any-return]


def _replay(request: TaskRequest, registered: RegisteredFunction | None = None) -> _Replay:
    forward_result: Any = request.forward_result
    if (omitted := request.forward_result_omitted) is not None:
        forward_result = OmittedResult(size=omitted.size, sha256=omitted.sha256, limit=omitted.limit)
    replay = _Replay(request.kind, request.memo, request.step_id, request.operation, forward_result)
    replay.tracebacks = request.tracebacks
    replay.parallel = request.parallel_steps
    if registered is not None:
        replay.retired_steps = registered.retired_steps
        replay.max_parallel = registered.max_parallel
    return replay


CONTINUATION_MAX_S = 5.0
"""The longest a discovery pass after a callback may take within the callback's request; a longer one is
left to the server, which sends it as a task of its own."""
CONTINUATION_MARGIN_S = 1.0
"""How long before the server stops listening (``respond_by``) the response must be on its way."""

_continuation_pool: concurrent.futures.ThreadPoolExecutor | None = None
_continuation_pool_lock = threading.Lock()


def _continuations() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that run continuation passes of plain functions (so a pass that hangs can be left)."""
    global _continuation_pool
    with _continuation_pool_lock:
        if _continuation_pool is None:
            _continuation_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=8, thread_name_prefix="ryusen-continuation"
            )
        return _continuation_pool


def _discovery_after(request: TaskRequest, outcome: Any, run_input: Any) -> TaskRequest | None:
    """The discovery pass that follows a forward attempt whose callback succeeded, if the server asked.

    ``run_input`` is the run's input as the request brought it, before the forward pass could change it."""
    if not request.continue_after or request.kind is not TaskKind.FORWARD or request.step_id is None:
        return None
    if not isinstance(outcome, CallbackSucceeded):
        return None
    memo = {**request.memo, request.step_id: MemoEntry(status="completed", result=outcome.result)}
    return TaskRequest(
        kind=TaskKind.DISCOVER,
        run_id=request.run_id,
        function_id=request.function_id,
        input=run_input,
        memo=memo,
        tracebacks=request.tracebacks,
        parallel_steps=request.parallel_steps,  # the server runs what it finds together as it would any pass's
    )


def _continuation_budget(window: ResponseWindow) -> float:
    budget = CONTINUATION_MAX_S
    if (left := window.left()) is not None:
        budget = min(budget, left - CONTINUATION_MARGIN_S)
    return budget


def encode_response(response: TaskResponse) -> bytes:
    """A response as JSON; ``next``, ``memo_miss`` and ``accepted`` only when set, so a server that predates them
    can read it."""
    unset = {name for name in ("next", "memo_miss", "accepted") if not getattr(response, name)}
    return response.model_dump_json(exclude=unset or None).encode()


def _memo_miss(request: TaskRequest) -> TaskResponse:
    """The answer to a request that extends a memo this process does not hold: it names that memo, so the
    server takes it only as the answer to that request."""
    assert request.memo_base is not None
    return TaskResponse(kind=request.kind, run_id=request.run_id, memo_miss=request.memo_base.token)


@dataclass(frozen=True)
class DiscoveryDivergence:
    """Where a kept pass and a discovery from the recorded results went different ways (``check_discovery``): after
    the callback of ``after_step``, the pass that went on reached ``kept`` and the replay ``replayed``."""

    run_id: str
    function_id: str
    after_step: str | None
    kept: Any
    replayed: Any

    def describe(self) -> str:
        return (
            f"run {self.run_id} ({self.function_id}): after step {self.after_step!r} the execution that went on "
            f"reached {_reached(self.kept)}, but a discovery from the recorded results reaches "
            f"{_reached(self.replayed)}. Code outside step.run decides from something that is not a recorded "
            "result (state a callback left in memory, a clock, a random value); a cold endpoint or another "
            "instance takes the second way. RFD 1 allows this, but if the choice must hold, return what later "
            "steps need from the step that produces it."
        )


def _reached(outcome: Any) -> str:
    step = getattr(outcome, "step", None)
    if step is not None and getattr(step, "id", None):
        return f"step {step.id!r}"
    return type(outcome).__name__


def _as_json(value: Any) -> str:
    try:
        return json.dumps(value.model_dump(mode="json"), sort_keys=True)
    except (AttributeError, TypeError, ValueError):
        return repr(value)


def _respond(request: TaskRequest, outcome: Any, following: Any = None) -> TaskResponse:
    if request.kind is TaskKind.DISCOVER:
        return TaskResponse(kind=request.kind, run_id=request.run_id, discovery=outcome)
    return TaskResponse(kind=request.kind, run_id=request.run_id, attempt=outcome, next=following)

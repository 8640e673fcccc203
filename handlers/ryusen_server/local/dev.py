"""``ryusen dev``: the whole server on one machine, on an embedded moto.

Theory of operation. moto's server runs in this process on a loopback port;
the table, dispatch queue (with its dead-letter queue) and schedule group are
created on it. The ``api`` Lambda handler is served over HTTP by translating
each request into an API Gateway event. A dispatch loop receives from the
queue and hands each message to the same ``process_body`` the dispatch Lambda
runs. moto never fires schedules, so a timer loop reads due schedules and
sends their input to the dispatch queue, as EventBridge Scheduler's SQS target
would. A delayed task is held in this process until it is due (``delays.py``),
so that sub-second retry delays are not rounded up to SQS's whole seconds.
Each APP runs in its own process (``serve_app``) on its own port, is synced as
a release, and is restarted and synced again when its file changes.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import logging
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qsl

import httpx

from ryusen._internal.serve import content_length

from ..api import MAX_BODY_BYTES, build_api

if TYPE_CHECKING:
    from aws_lambda_powertools.utilities.typing import LambdaContext
from ryusen._internal.wire import TaskKind

from ..aws.queue import CARRIER_ATTRIBUTE, MAX_DELAY_S, REFRESH_AFTER_RECEIVES, create_queues, message_group
from ..aws.store import create_table
from ..aws.timers import create_schedule_group
from ..core.events import InvokeTask
from ..core.model import TaskRef
from ..ports import RequestCounter
from ..runtime import lease_keeper, process_body
from ..settings import DevDispatchSettings, dev_dispatch_settings, server_settings
from ..urls import EndpointPolicy
from ..wiring import AwsEngine, AwsResources, aws_engine, client
from . import emulator
from .delays import LocalDelays
from .fair import FairShare
from .guard import UI_HEADERS, RefusedError, guarded
from .serve_app import AppSpecError, source_file, split_spec
from .state import DevState, StateDirError
from .ui import RunEvents, UiNotBuiltError, check_built, index_html, static_file

log = logging.getLogger("ryusen.dev")

DEFAULT_PORT = 8700


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DevError(Exception):
    pass


@dataclass
class AppProcess:
    """One APP argument: its process, port, and the release it last synced."""

    spec: str
    port: int
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    app_id: str | None = None
    release_id: str | None = None
    restart_at: float | None = None
    """When the supervisor tries again to restart a process that died while running (monotonic clock)."""
    restart_delay_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def start(self, timeout_s: float = 30.0) -> dict[str, Any]:
        self.process = subprocess.Popen(  # noqa: S603 - our own module, by path
            [sys.executable, "-m", "ryusen_server.local.serve_app", self.spec, "--port", str(self.port)],
            env=self.env,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code, self.process = self.process.returncode, None  # waits for the next change of its file
                raise DevError(f"app {self.spec} exited with status {code} while starting")
            try:
                response = httpx.get(self.url, timeout=1.0)
                if response.status_code == 200:
                    manifest: dict[str, Any] = response.json()
                    return manifest
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise DevError(f"app {self.spec} did not answer on {self.url} within {timeout_s:g}s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process = None


@dataclass
class DevStack:
    port: int = DEFAULT_PORT
    apps: list[str] = field(default_factory=list)
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    out: Callable[[str], None] = print
    counter: RequestCounter = field(default_factory=RequestCounter)
    data: Path | None = None
    """Where the stack keeps its table across restarts (``local/state.py``); None: nowhere (tests, benches)."""
    fresh: bool = False
    """Forget what ``data`` holds and start empty."""

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._processes: list[AppProcess] = []
        self._restart_lock = threading.Lock()  # a reload and a crash restart never overlap
        self._moto: Any = None
        self._http: Any = None
        self.wired: AwsEngine | None = None
        self.resources: AwsResources | None = None
        self._delays: LocalDelays | None = None
        """Delayed sends, held in this process until due (``local/delays.py``)."""
        self._visibility_s: float | None = None
        """The visibility the dispatch loop receives messages with (the default lease)."""
        self.dispatch = _dispatch_settings(self.env)
        """How the dispatch loop shares its workers between apps (``RYUSEN_DEV_WORKERS``, ``_APP_WORKERS``)."""
        self._monotonic: Callable[[], float] = time.monotonic
        self.session_token = secrets.token_urlsafe(32)
        """What a browser's change must carry (``X-Ryusen-Session``): given only to the UI's own page."""
        self.state: DevState | None = None
        self._saved_units = -1
        self._maybe_started: list[str] = []
        self._events: RunEvents | None = None

    # ---- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        for spec in self.apps:
            split_spec(spec)  # fail fast on a malformed spec
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._check_port_free(self.port)
        for name, value in (("AWS_ACCESS_KEY_ID", "ryusen-dev"), ("AWS_SECRET_ACCESS_KEY", "ryusen-dev")):
            os.environ.setdefault(name, value)
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        moto_port = free_port()
        self._moto = _local_moto(moto_port)
        self._spawn(self._moto.serve_forever, "ryusen-moto")
        endpoint = f"http://127.0.0.1:{moto_port}"
        self.resources = self._create_resources(endpoint)
        restored = self._restore()
        master = self.env.get("RYUSEN_MASTER_KEY") or secrets.token_hex(32)
        settings_env = dict(self.env)
        settings_env["RYUSEN_MASTER_KEY"] = master
        settings_env["RYUSEN_RESULT_URL"] = f"http://127.0.0.1:{self.port}/v1/results"
        self._delays = LocalDelays()  # sub-second retry delays as asked, not rounded up to SQS's whole seconds
        self.wired = aws_engine(
            self.resources,
            server_settings(settings_env),
            self.counter,
            EndpointPolicy.local(),
            hold=self._delays.call_later,
        )
        self.wired.engine.serialize_runs()  # one process, many dispatcher threads: they need not race each other
        self._serve_api()
        self._spawn(self._dispatch_loop, "ryusen-dispatch")
        self._spawn(self._timer_loop, "ryusen-timers")
        # each app signs with its own key, derived from this session's master (the app processes derive it: a
        # local process is trusted on this machine, docs/security.md)
        app_env = {**os.environ, **dict(self.env), "RYUSEN_MASTER_KEY": master}
        app_env.pop("RYUSEN_SIGNING_KEY", None)
        app_env.pop("RYUSEN_RELEASE_ID", None)
        for spec in self.apps:
            proc = AppProcess(spec=spec, port=free_port(), env=app_env)
            self._processes.append(proc)
            self._start_and_sync(proc)
            self._spawn(functools.partial(self._watch, proc), f"ryusen-watch-{proc.port}")
        self._spawn(self._supervise, "ryusen-supervise")
        if self.state is not None:
            self.wired.engine.hooks.append(self._note_started)
        if restored:
            started = [TaskRef.model_validate_json(line) for line in self._maybe_started]
            # authorized after the last save of a stack that was killed: they may have run (local/state.py)
            self.wired.engine.presume_started(started, STARTED_UNSAVED)
            # their task messages and schedules were not kept: what the sweeper does for a lost one, at once
            self.wired.engine.recover(restored)
        self.out(f"ryusen dev: server API  http://127.0.0.1:{self.port}/v1")
        self.out(f"ryusen dev: dev UI      http://127.0.0.1:{self.port}/")
        self.out(f"ryusen dev: moto        {endpoint}  (table {self.resources.table_name})")
        self.out("ryusen dev: messages to and from each app are signed with its own key, made for this session")
        for proc in self._processes:
            self.out(f"ryusen dev: app {proc.app_id!r} ({proc.spec}) at {proc.url}, release {proc.release_id}")

    def stop(self) -> None:
        self._stop.set()
        if self._delays is not None:
            self._delays.stop()
        for proc in self._processes:
            proc.stop()  # an app drains first: what it answered accepted posts its outcome to the API
        if self._events is not None:
            self._events.close()  # the pages' event streams end, so their threads do
        if self._http is not None:
            self._http.shutdown()
        for thread in self._threads:
            if thread.name != "ryusen-moto":
                thread.join(timeout=5)
        self._save(final=True)  # nothing writes any more: the table as it is
        if self._moto is not None:
            with contextlib.suppress(Exception):
                self._moto.shutdown()
            self._moto = None
        for thread in self._threads:
            thread.join(timeout=5)
        if self.state is not None:
            self.state.release()

    # ---- state across restarts -------------------------------------------------------

    def _restore(self) -> list[str]:
        """Take the data directory and load what it holds; the ids of the runs restored."""
        if self.data is None:
            return []
        assert self.resources is not None
        self.state = DevState(self.data, client("dynamodb", self.resources), self.resources.table_name)
        try:
            self.state.acquire(fresh=self.fresh)
            runs = self.state.load()
            self._maybe_started = self.state.started_since_save()
        except StateDirError as exc:
            self.state.release()
            self.state = None
            raise DevError(str(exc)) from None
        where = str(self.data.resolve())
        kept = f"{len(runs)} run(s) restored" if runs else "nothing saved yet" if not self.fresh else "started fresh"
        self.out(f"ryusen dev: state kept in {where} ({kept}; --fresh starts clean)")
        return runs

    def _note_started(self, kind: str, payload: Any) -> None:
        """The engine's ``decided`` hook: log each attempt a decision authorized, before the endpoint is called."""
        if kind != "decided" or self.state is None:
            return
        _, decision = payload
        started = [
            c.task.model_dump_json()
            for c in decision.commands
            if isinstance(c, InvokeTask) and c.task.kind is not TaskKind.DISCOVER
        ]
        self.state.note_started(started)

    def _save(self, *, final: bool = False) -> None:
        """Save the table if anything was written since the last save (every time at the end)."""
        if self.state is None or self._moto is None:
            return
        units = self.counter.counts.get("dynamodb.write", 0)
        if units == self._saved_units and not final:
            return
        try:
            self.state.save()
            self._saved_units = units
        except Exception:
            log.exception("saving ryusen dev's state to %s failed", self.state.directory)

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _check_port_free(self, port: int) -> None:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                raise DevError(f"port {port} is in use; choose another with --port") from None

    def _create_resources(self, endpoint: str) -> AwsResources:
        base = AwsResources(
            table_name="ryusen",
            queue_url="",
            queue_arn="",
            schedule_group="ryusen",
            scheduler_role_arn="arn:aws:iam::123456789012:role/ryusen-scheduler",
            endpoint_url=endpoint,
        )
        create_table(client("dynamodb", base), base.table_name)
        sqs = client("sqs", base)
        queue_url, dlq_url = create_queues(sqs, "ryusen-dispatch")
        dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        create_schedule_group(client("scheduler", base), base.schedule_group)
        return AwsResources(
            table_name=base.table_name,
            queue_url=queue_url,
            queue_arn=arn,
            schedule_group=base.schedule_group,
            scheduler_role_arn=base.scheduler_role_arn,
            scheduler_dlq_arn=dlq_arn,
            endpoint_url=endpoint,
        )

    # ---- apps -----------------------------------------------------------------------

    def _start_and_sync(self, proc: AppProcess) -> None:
        assert self.wired is not None
        manifest = proc.start()
        release = self.wired.engine.sync_release(
            manifest["app_id"], proc.url, *self.wired.fetcher()(manifest["app_id"], proc.url)
        )
        proc.app_id, proc.release_id = release.app_id, release.release_id

    def _supervise(self) -> None:
        """Restart an app whose process exited (a crash mid-step), and sync it again.

        A process that dies again while restarting (the retry of the step that crashed it can arrive before its
        manifest is read) is tried again after 1 s, doubling to 30 s, until it answers: it was running before,
        so nothing but a change of its file would make a reload succeed where a restart cannot.
        """
        while not self._stop.wait(0.5):
            for proc in self._processes:
                with self._restart_lock:
                    if self._stop.is_set():
                        return
                    process = proc.process
                    if process is not None and process.poll() is None:
                        continue
                    if process is not None:
                        self.out(f"ryusen dev: app {proc.spec} exited with status {process.returncode}; restarting it")
                        proc.process, proc.restart_at, proc.restart_delay_s = None, time.monotonic(), 0.0
                    if proc.restart_at is None or time.monotonic() < proc.restart_at:
                        continue  # running, waiting for a change of its file, or not yet due
                    try:
                        self._start_and_sync(proc)
                    except Exception as exc:  # noqa: BLE001 - keep supervising
                        if proc.process is not None and proc.process.poll() is None:
                            proc.stop()  # answered but did not sync: start it clean next time
                        proc.process = None
                        proc.restart_delay_s = min(30.0, max(1.0, proc.restart_delay_s * 2))
                        proc.restart_at = time.monotonic() + proc.restart_delay_s
                        self.out(
                            f"ryusen dev: restart of {proc.spec} failed: {exc}; "
                            f"trying again in {proc.restart_delay_s:g}s"
                        )
                    else:
                        proc.restart_at = None
                        self.out(f"ryusen dev: restarted {proc.spec}; synced release {proc.release_id}")

    def _watch(self, proc: AppProcess) -> None:
        path = source_file(proc.spec)
        if path is None:
            return
        from watchfiles import watch

        for changes in watch(path.parent, stop_event=self._stop, debounce=300, raise_interrupt=False):
            if not any(Path(p).suffix == ".py" for _, p in changes):
                continue
            self.out(f"ryusen dev: {path.name} changed; reloading {proc.spec}")
            with self._restart_lock:
                proc.stop()
                proc.restart_at = None  # a reload replaces any restart still to come
                try:
                    self._start_and_sync(proc)
                except Exception as exc:  # noqa: BLE001 - keep serving the others
                    self.out(f"ryusen dev: reload of {proc.spec} failed: {exc}")
                    continue
            self.out(f"ryusen dev: synced {proc.app_id!r} release {proc.release_id}")

    # ---- the API over HTTP ------------------------------------------------------------

    def _serve_api(self) -> None:
        from werkzeug.serving import make_server

        assert self.wired is not None
        resolver = build_api(self.wired.engine, self.wired.fetcher())

        events = RunEvents()
        self._events = events
        self.wired.engine.hooks.append(events.hook)
        page = index_html(self.session_token)

        def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "/")
            if environ["REQUEST_METHOD"] == "GET" and not path.startswith("/v1/"):
                return _serve_ui(path, page, events, start_response)
            try:
                event = wsgi_to_rest_event(environ)
            except RefusedError as refused:
                return refused.answer(start_response)
            result = resolver.resolve(event, cast("LambdaContext", _LocalContext()))
            payload = result.get("body") or ""
            raw = base64.b64decode(payload) if result.get("isBase64Encoded") else payload.encode()
            headers = [(k, str(v)) for k, v in (result.get("headers") or {}).items()]
            for k, values in (result.get("multiValueHeaders") or {}).items():
                headers.extend((k, str(v)) for v in values)
            headers.append(("Content-Length", str(len(raw))))
            start_response(f"{result['statusCode']} {_reason(result['statusCode'])}", headers)
            return [raw]

        checked = guarded(wsgi, lambda: self.port, session_token=self.session_token)
        self._http = make_server("127.0.0.1", self.port, checked, threaded=True)
        self._spawn(self._http.serve_forever, "ryusen-api")

    # ---- engine loops -----------------------------------------------------------------

    def _dispatch_loop(self) -> None:
        """Receive what the free workers could run, and start each message as its app's share allows
        (``local/fair.py``): one app's slow steps never hold every worker.

        A message is received only for a free worker: one left waiting past its visibility would come back,
        and be delivered twice (issue 12). A message whose app holds its share waits here, and while it does
        it is kept invisible (made invisible for the whole visibility again once half of it has passed); when
        it starts, it is handed the visibility it still has, from which the attempt's lease is set."""
        assert self.wired is not None and self.resources is not None
        sqs = self.wired.sqs
        queue_url = self.resources.queue_url
        settings = self.wired.engine.settings.engine
        visibility = int(settings.attempt_timeout_s + settings.lease_grace_s)
        self._visibility_s = float(visibility)
        share: FairShare[_Received] = FairShare(
            workers=self.dispatch.workers,
            app_workers=self.dispatch.app_workers,
            # messages name their app by its message group (the app id, or its digest where SQS would refuse it)
            app_concurrency={message_group(a): n for a, n in self.dispatch.app_concurrency.items()},
        )
        lock = threading.Lock()  # around ``share`` and the waiting messages' visibility
        freed = threading.Event()

        def keep_waiting_invisible() -> None:
            now = self._monotonic()
            for waiting in share.waiting_items():
                if waiting.invisible_until - now > visibility / 2:
                    continue
                try:
                    self.counter.add("sqs.change_visibility")
                    sqs.change_message_visibility(
                        QueueUrl=queue_url, ReceiptHandle=waiting.message["ReceiptHandle"], VisibilityTimeout=visibility
                    )
                except Exception:
                    if self._stop.is_set():
                        return
                    log.exception("keeping a waiting message invisible failed; it may be delivered again")
                waiting.invisible_until = now + visibility

        def run(app: Hashable, received: _Received, visible_for_s: float) -> None:
            try:
                self._handle(received.message, visible_for_s=visible_for_s)
            finally:
                with lock:
                    share.done(app)
                    start_ready()
                freed.set()

        def start_ready() -> None:
            now = self._monotonic()
            while (picked := share.next()) is not None:
                app, received = picked
                pool.submit(run, app, received, max(0.0, received.invisible_until - now))

        with ThreadPoolExecutor(max_workers=self.dispatch.workers, thread_name_prefix="ryusen-task") as pool:
            while not self._stop.is_set():
                with lock:
                    keep_waiting_invisible()
                    start_ready()
                    ask = min(10, share.free) if share.waiting < MAX_WAITING else 0
                if ask == 0:
                    freed.wait(0.5)
                    freed.clear()
                    continue
                try:
                    self.counter.add("sqs.receive")
                    messages = sqs.receive_message(
                        QueueUrl=queue_url,
                        MaxNumberOfMessages=ask,
                        WaitTimeSeconds=1,
                        VisibilityTimeout=visibility,
                        MessageSystemAttributeNames=["MessageGroupId", "ApproximateReceiveCount"],
                        MessageAttributeNames=[CARRIER_ATTRIBUTE],
                    ).get("Messages", [])
                except Exception:
                    if self._stop.is_set():
                        return
                    log.exception("receive failed")
                    time.sleep(0.5)
                    continue
                with lock:
                    received_at = self._monotonic()
                    for message in messages:
                        app = message.get("Attributes", {}).get("MessageGroupId") or None
                        share.add(app, _Received(message=message, invisible_until=received_at + visibility))
                    start_ready()

    def _handle(self, message: dict[str, Any], visible_for_s: float | None = None) -> None:
        """Deliver one received message; ``visible_for_s``: how long it is still invisible (default: the
        visibility it was received with)."""
        assert self.wired is not None and self.resources is not None
        sqs, queue_url = self.wired.sqs, self.resources.queue_url

        def change_visibility(seconds: float) -> None:
            self.counter.add("sqs.change_visibility")
            sqs.change_message_visibility(
                QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"], VisibilityTimeout=_whole_s(seconds)
            )

        kept_as = message.get("MessageAttributes", {}).get(CARRIER_ATTRIBUTE, {}).get("StringValue")
        carrier = kept_as or message.get("MessageId")
        try:
            keep = lease_keeper(change_visibility, self._visibility_s if visible_for_s is None else visible_for_s)
            done, later = process_body(self.wired.engine, message["Body"], on_authorized=keep, carrier=carrier)
        except Exception:
            log.exception("dispatch of a message failed; it will be redelivered")
            return
        if done:
            self.counter.add("sqs.delete")
            sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])
        elif int(message.get("Attributes", {}).get("ApproximateReceiveCount", "1")) >= REFRESH_AFTER_RECEIVES:
            # Kept on purpose, yet every receive counts towards the dead-letter queue (10): past a few, a fresh copy
            # takes over, naming the message it replaces (the carrier of what it authorized), as on AWS.
            group = message.get("Attributes", {}).get("MessageGroupId")
            self.counter.add("sqs.send")
            sqs.send_message(
                QueueUrl=queue_url,
                MessageBody=message["Body"],
                DelaySeconds=max(0, min(MAX_DELAY_S, math.ceil(later))),
                MessageAttributes={CARRIER_ATTRIBUTE: {"DataType": "String", "StringValue": carrier}},
                **({"MessageGroupId": group} if group else {}),
            )
            self.counter.add("sqs.delete")
            sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])
        else:
            self.counter.add("sqs.change_visibility")
            sqs.change_message_visibility(
                QueueUrl=queue_url,
                ReceiptHandle=message["ReceiptHandle"],
                VisibilityTimeout=_whole_s(later),
            )

    def _timer_loop(self) -> None:
        assert self.wired is not None and self.resources is not None
        timers = self.wired.engine.timers
        sqs, queue_url = self.wired.sqs, self.resources.queue_url
        next_sweep = time.monotonic() + SWEEP_EVERY_S
        next_save = time.monotonic() + SAVE_EVERY_S
        while not self._stop.wait(0.5):
            if time.monotonic() >= next_save:
                next_save = time.monotonic() + SAVE_EVERY_S
                self._save()
            if time.monotonic() >= next_sweep:  # what the deployment's scheduled sweeper does
                next_sweep = time.monotonic() + SWEEP_EVERY_S
                try:
                    self.wired.engine.sweep()
                except Exception:
                    if self._stop.is_set():
                        return
                    log.exception("the sweep failed")
            try:
                due = timers.due(datetime.now(UTC))  # type: ignore[attr-defined]
                for name, payload in due:
                    # what EventBridge Scheduler's SQS target does: the input becomes a queue message
                    self.counter.add("sqs.send")
                    sqs.send_message(QueueUrl=queue_url, MessageBody=payload)
                    timers.delete(name)  # type: ignore[attr-defined]
            except Exception:
                if self._stop.is_set():
                    return
                log.exception("firing due schedules failed")


def _dispatch_settings(env: Mapping[str, str]) -> DevDispatchSettings:
    try:
        return dev_dispatch_settings(env)
    except ValueError as exc:
        raise DevError(str(exc)) from None


def _whole_s(seconds: float) -> int:
    """A visibility timeout for SQS: whole seconds, rounded up (a message never comes back before it is due,
    only to be put back for the rest), 1 s to 12 hours."""
    return max(1, min(43_200, math.ceil(seconds)))


MAX_WAITING = 1_000
"""Messages ``ryusen dev`` keeps received while their apps hold their shares; past this it stops receiving
until some have started (each waiting one costs a ChangeMessageVisibility every half visibility)."""


@dataclass(slots=True, kw_only=True)
class _Received:
    """A received message waiting for, or running on, a worker."""

    message: dict[str, Any]
    invisible_until: float
    """When SQS makes it visible again (monotonic clock), unless it is deleted or kept longer first."""


SWEEP_EVERY_S = 60.0
STARTED_UNSAVED = (
    "ryusen dev was stopped without saving after it authorized this attempt: its callback may have run, and its"
    " outcome is not known"
)
SAVE_EVERY_S = 5.0
"""How often a running stack saves its table, when something was written (``local/state.py``): a stack that
is killed loses at most this much; one stopped with Ctrl-C or SIGTERM loses nothing."""
"""How often ``ryusen dev`` looks for runs whose work is overdue with nothing on its way (as the deployment's
scheduled sweeper does every minute)."""


class _LocalContext:
    function_name = "ryusen-api-local"
    memory_limit_in_mb = 512
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:ryusen-api-local"
    aws_request_id = "local"

    @staticmethod
    def get_remaining_time_in_millis() -> int:
        return 30_000


_REASONS = {
    200: "OK",
    201: "Created",
    202: "Accepted",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    413: "Payload Too Large",
    422: "Unprocessable Entity",
    500: "Internal Server Error",
}


def _serve_ui(path: str, page: bytes, events: RunEvents, start_response: Callable[..., Any]) -> Iterable[bytes]:
    """A GET outside the API: the page, its built files, the run events, or a 404."""
    if path in ("/", "/ui", "/index.html"):
        return _answer(start_response, "200 OK", "text/html; charset=utf-8", page, UI_HEADERS)
    if path == "/dev/events":
        start_response(
            "200 OK",
            [("Content-Type", "text/event-stream"), ("Cache-Control", "no-store"), ("X-Accel-Buffering", "no")],
        )
        return events.stream()
    if path.startswith("/static/") and (found := static_file(path.removeprefix("/static/"))) is not None:
        body, content_type = found
        return _answer(start_response, "200 OK", content_type, body, [("Cache-Control", "no-cache")])
    if path.startswith("/static/"):
        try:
            check_built()
        except UiNotBuiltError as exc:
            body = str(exc).encode()
            return _answer(start_response, "503 Service Unavailable", "text/plain; charset=utf-8", body, [])
    body = json.dumps({"error": {"code": "route_not_found", "message": f"no route GET {path}"}}).encode()
    return _answer(start_response, "404 Not Found", "application/json", body, [])


def _answer(
    start_response: Callable[..., Any], status: str, content_type: str, body: bytes, headers: list[tuple[str, str]]
) -> list[bytes]:
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body))), *headers])
    return [body]


def _reason(status: int) -> str:
    return _REASONS.get(status, "Status")


def _local_moto(port: int) -> Any:
    """The embedded moto on loopback: its global CORS off (a page that found its port could otherwise read
    and rewrite the whole table), a loopback ``Host`` required (no DNS rebinding), no browser at all."""
    os.environ["MOTO_DISABLE_GLOBAL_CORS"] = "true"
    from moto.moto_server import threaded_moto_server, werkzeug_app
    from werkzeug.serving import make_server

    werkzeug_app.DISABLE_GLOBAL_CORS = True  # type: ignore[attr-defined] # read at import: set where it is used
    emulator.install()  # holds up under load: failed transactions undo only what they named (emulator.py)
    backend = werkzeug_app.DomainDispatcherApplication(werkzeug_app.create_backend_app)
    app = guarded(emulator.one_at_a_time(backend), lambda: port, browsers=False)
    handler = threaded_moto_server.MotoRequestHandler  # type: ignore[attr-defined]
    return make_server("127.0.0.1", port, app, threaded=True, request_handler=handler)


def wsgi_to_rest_event(environ: dict[str, Any]) -> dict[str, Any]:
    """An API Gateway REST (payload 1.0) event for a WSGI request, as API Gateway would build it."""
    length = content_length(environ)
    if length is None:
        raise RefusedError(400, "invalid_content_length", "Content-Length must be a whole number of bytes")
    if length > MAX_BODY_BYTES:  # refused before it is read
        raise RefusedError(413, "payload_too_large", f"request body is over {MAX_BODY_BYTES} bytes")
    body = environ["wsgi.input"].read(length) if length else b""
    headers = {k[5:].replace("_", "-").title(): v for k, v in environ.items() if k.startswith("HTTP_")}
    if environ.get("CONTENT_TYPE"):
        headers["Content-Type"] = environ["CONTENT_TYPE"]
    query = dict(parse_qsl(environ.get("QUERY_STRING", ""), keep_blank_values=True))
    try:
        text, is_b64 = body.decode(), False
    except UnicodeDecodeError:
        text, is_b64 = base64.b64encode(body).decode(), True
    try:  # WSGI gives the path's bytes as Latin-1; API Gateway gives the UTF-8 text
        path = str(environ.get("PATH_INFO", "/")).encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        raise RefusedError(400, "invalid_path", "the request path is not UTF-8") from None
    return {
        "resource": path,
        "path": path,
        "httpMethod": environ["REQUEST_METHOD"],
        "headers": headers,
        "multiValueHeaders": {k: [v] for k, v in headers.items()},
        "queryStringParameters": query or None,
        "multiValueQueryStringParameters": {k: [v] for k, v in query.items()} or None,
        "pathParameters": None,
        "stageVariables": None,
        "requestContext": {
            "resourcePath": path,
            "httpMethod": environ["REQUEST_METHOD"],
            "path": path,
            "stage": "local",
            "requestId": secrets.token_hex(8),
            "identity": {"sourceIp": environ.get("REMOTE_ADDR", "127.0.0.1")},
        },
        "body": text if body else None,
        "isBase64Encoded": is_b64,
    }


def run_dev(
    *, port: int = DEFAULT_PORT, apps: list[str] | None = None, data: Path | None = None, fresh: bool = False
) -> int:
    """Run the stack until Ctrl-C (or SIGTERM, or SIGHUP), keeping its state in ``data``."""
    try:
        check_built()
    except UiNotBuiltError as exc:
        print(f"ryusen dev: {exc}", file=sys.stderr)
        return 1
    try:
        stack = DevStack(port=port, apps=list(apps or []), data=data, fresh=fresh)
    except DevError as exc:
        print(f"ryusen dev: {exc}", file=sys.stderr)
        return 1
    try:
        stack.start()
    except (DevError, AppSpecError) as exc:
        print(f"ryusen dev: {exc}", file=sys.stderr)
        stack.stop()
        return 1
    except BaseException:
        stack.stop()  # never leave a half-started stack behind
        raise
    stopped = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stopped.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal)  # its terminal closed: stop as for Ctrl-C, saving the table
    print("ryusen dev: ready. Ctrl-C to stop.", flush=True)
    try:
        while not stopped.wait(0.5):
            pass
    finally:
        with contextlib.suppress(OSError):  # a closed terminal refuses the write; the stop must still save
            print("ryusen dev: stopping", flush=True)
        stack.stop()
    return 0


__all__ = ["DevStack", "json", "run_dev"]

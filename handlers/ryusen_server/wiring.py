"""Build the engine on AWS (or on moto, for ``ryusen dev``) from settings.

The Lambda handlers and ``ryusen dev`` call :func:`aws_engine`; nothing else
constructs boto3 clients.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import boto3
import httpx
from botocore.config import Config

from ryusen._internal.signing import (
    CHALLENGE_HEADER,
    KEY_IDS_HEADER,
    PREVIOUS_KEY_WINDOW_S,
    SIGNATURE_HEADER,
    Scope,
    SecretRead,
    SignatureError,
    key_ids_header,
    read_secret,
    url_path,
    verify,
)
from ryusen._internal.wire import FEATURES_HEADER, Manifest

from .aws.lambda_events import LambdaEventInvoker
from .aws.queue import DelayHold, SqsQueue
from .aws.store import DynamoStore
from .aws.timers import SchedulerTimers
from .engine import MAX_MANIFEST_BYTES, Engine, ServerSettings
from .invoker import HttpInvoker
from .ports import InvalidRequestError, InvokeResult, RequestCounter
from .settings import flag_setting, server_settings
from .urls import EndpointPolicy


@dataclass(frozen=True, slots=True, kw_only=True)
class AwsResources:
    table_name: str
    queue_url: str
    queue_arn: str
    schedule_group: str
    scheduler_role_arn: str
    scheduler_dlq_arn: str | None = None
    master_key_secret_arn: str | None = None
    retention_days: float | None = None
    """How long a finished run is kept (the table's TTL); None: forever."""
    """The Secrets Manager secret holding the master key every app's key is derived from (a deployment never
    puts a key in its environment)."""
    """Where a schedule whose target keeps failing leaves its input (the deployment's scheduler DLQ)."""
    endpoint_url: str | None = None
    region: str = "us-east-1"
    fair_queue: bool = True
    """Send each task with its app's message group, making the dispatch queue an SQS fair queue
    (``RYUSEN_FAIR_QUEUE``, ``aws/queue.py``)."""
    app_queues: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """The dispatch queues of apps that have one of their own (the CDK setting ``app_dispatch_concurrency``), whose
    event source caps how many dispatchers run their tasks at once: the app's digest (``app_queue_digest``) ->
    (URL, ARN). The stack names them ``RYUSEN_APP_QUEUE_PREFIX`` and the digests in ``RYUSEN_APP_QUEUES`` (commas),
    in the shared queue's account and region. Every other app's tasks, and every timer, wake and deferred answer,
    go to ``queue_url``."""
    lambda_events: bool = True
    """Send attempts to a Lambda endpoint that announces ``lambda_event`` as asynchronous events, waiting for none
    of them (``RYUSEN_LAMBDA_EVENTS``; ``aws/lambda_events.py``). False: every attempt goes to the app's URL."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AwsResources:
        env = os.environ if env is None else env
        return cls(
            table_name=env["RYUSEN_TABLE"],
            queue_url=env["RYUSEN_QUEUE_URL"],
            queue_arn=env["RYUSEN_QUEUE_ARN"],
            schedule_group=env.get("RYUSEN_SCHEDULE_GROUP", "ryusen"),
            scheduler_role_arn=env["RYUSEN_SCHEDULER_ROLE_ARN"],
            scheduler_dlq_arn=env.get("RYUSEN_SCHEDULER_DLQ_ARN") or None,
            master_key_secret_arn=env.get("RYUSEN_MASTER_KEY_SECRET_ARN") or None,
            retention_days=float(env["RYUSEN_RETENTION_DAYS"]) if env.get("RYUSEN_RETENTION_DAYS") else None,
            endpoint_url=env.get("RYUSEN_AWS_ENDPOINT_URL") or None,
            region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
            fair_queue=flag_setting(env, "RYUSEN_FAIR_QUEUE", True),
            lambda_events=flag_setting(env, "RYUSEN_LAMBDA_EVENTS", True),
            app_queues=_app_queues(
                env.get("RYUSEN_APP_QUEUES", ""),
                env.get("RYUSEN_APP_QUEUE_PREFIX", ""),
                env["RYUSEN_QUEUE_URL"],
                env["RYUSEN_QUEUE_ARN"],
            ),
        )

    def queue_url_of(self, arn: str | None) -> str:
        """The URL of the dispatch queue whose ARN an SQS record names (its ``eventSourceARN``): an app's own, or
        the shared one (also for an ARN that is neither)."""
        for url, queue_arn in self.app_queues.values():
            if queue_arn == arn:
                return url
        return self.queue_url


def _app_queues(raw: str, prefix: str, shared_url: str, shared_arn: str) -> dict[str, tuple[str, str]]:
    """The apps' own queues the stack names (``RYUSEN_APP_QUEUES``, ``RYUSEN_APP_QUEUE_PREFIX``), beside the shared
    one: refused at a cold start if they are not what the stack writes."""
    digests = [d.strip() for d in raw.split(",") if d.strip()]
    if not digests:
        return {}
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,60}", prefix) or not all(re.fullmatch(r"[0-9a-f]{12}", d) for d in digests):
        raise RuntimeError(
            "RYUSEN_APP_QUEUES must be the apps' queue digests (12 hex digits each, commas between) and"
            " RYUSEN_APP_QUEUE_PREFIX their names' prefix, as the stack writes them"
        )
    url_base, arn_base = shared_url.rsplit("/", 1)[0], shared_arn.rsplit(":", 1)[0]
    return {d: (f"{url_base}/{prefix}{d}", f"{arn_base}:{prefix}{d}") for d in digests}


def client(service: str, resources: AwsResources) -> Any:
    return boto3.client(
        service,  # type: ignore[call-overload]
        region_name=resources.region,
        endpoint_url=resources.endpoint_url,
        config=Config(retries={"mode": "standard", "max_attempts": 5}, max_pool_connections=32),
    )


def lease_watch_scheduler(resources: AwsResources, counter: RequestCounter) -> SchedulerTimers:
    """Where the result function parks lease watches (``SqsQueue.watch_lease``): the Scheduler with short timeouts
    and two tries, so that a throttled or hanging ``CreateSchedule`` fails over to the SQS timer within seconds,
    well inside the function's time, rather than after botocore's minutes of retries. A try whose answer was lost
    is safe to repeat: the name is the attempt's, and a schedule that exists already counts as made."""
    scheduler = boto3.client(
        "scheduler",
        region_name=resources.region,
        endpoint_url=resources.endpoint_url,
        config=Config(retries={"mode": "standard", "total_max_attempts": 2}, connect_timeout=2, read_timeout=3),
    )
    return SchedulerTimers(
        scheduler,
        group=resources.schedule_group,
        target_arn=resources.queue_arn,
        role_arn=resources.scheduler_role_arn,
        dead_letter_arn=resources.scheduler_dlq_arn,
        counter=counter,
    )


def event_invoker(resources: AwsResources, counter: RequestCounter) -> LambdaEventInvoker:
    """What sends attempts to Lambda endpoints as events: Lambda's API, with a short read timeout (``Invoke`` with
    ``InvocationType=Event`` answers once the event is queued) and no retries of botocore's. A try whose answer was
    lost may have queued the event; a retry that then could not connect would be all the invoker sees, and it
    would take the attempt as never sent and send it again, with a new signature the replay memory does not know:
    the effect would run twice. One try, whose failure the engine classifies, and whose "not sent" is true."""
    lambda_client = boto3.client(
        "lambda",
        region_name=resources.region,
        endpoint_url=resources.endpoint_url,
        config=Config(retries={"mode": "standard", "total_max_attempts": 1}, connect_timeout=3, read_timeout=10),
    )
    return LambdaEventInvoker(lambda_client, counter)


@dataclass(slots=True)
class AwsEngine:
    engine: Engine
    sqs: Any
    counter: RequestCounter
    policy: EndpointPolicy
    """What an app may register as its endpoint (decisions 22), for the manifest fetch and every task."""

    def fetcher(self) -> Callable[[str, str], tuple[Manifest, frozenset[str]]]:
        """The manifest fetch the API syncs releases with: under the URL policy, verified with the app's keys,
        read afresh (an emergency rotation refuses the old key at once)."""
        engine = self.engine
        return manifest_fetcher(self.policy, lambda app_id: engine.app_keys(app_id, fresh=True))


def aws_engine(
    resources: AwsResources,
    settings: ServerSettings | None = None,
    counter: RequestCounter | None = None,
    policy: EndpointPolicy | None = None,
    *,
    deployed: bool = False,
    hold: DelayHold | None = None,
    signs: bool = True,
    fresh_keys_recheck_s: float = 0.0,
) -> AwsEngine:
    """``policy`` defaults to the deployment's (``RYUSEN_ENDPOINT_ALLOWED_NETWORKS``; public addresses only).

    ``deployed`` (the Lambda handlers): there is no unsigned mode; without a signing key (its secret, or
    ``RYUSEN_MASTER_KEY``) the engine refuses to start rather than send unsigned tasks and accept unsigned
    results.

    ``signs=False`` (the sweeper): an engine that never calls an endpoint and holds no key; it refuses to
    invoke anything.

    ``hold``: where the queue keeps delayed sends instead of SQS's whole-second ``DelaySeconds`` (``ryusen
    dev``: its queue is in-process, so a delay is honoured to the millisecond).

    ``fresh_keys_recheck_s``: how long keys read afresh (to verify an unsolicited message again) are reused. 0
    (every time) where such messages are rare; the result function, which takes one per long step, re-reads
    the secret at most this often, so an emergency rotation refuses the old key there within that time."""
    counter = counter or RequestCounter()
    policy = policy or EndpointPolicy.from_env(os.environ)
    sqs = client("sqs", resources)
    timers = SchedulerTimers(
        client("scheduler", resources),
        group=resources.schedule_group,
        target_arn=resources.queue_arn,
        role_arn=resources.scheduler_role_arn,
        dead_letter_arn=resources.scheduler_dlq_arn,
        counter=counter,
    )
    settings = settings or server_settings()
    if deployed and signs and resources.master_key_secret_arn is None and not settings.master_key:
        raise RuntimeError(
            "a deployed Ryusen engine signs every task and accepts only signed results: set"
            " RYUSEN_MASTER_KEY_SECRET_ARN (the CDK stack does); there is no unsigned mode on AWS"
        )
    if resources.master_key_secret_arn is not None:
        key = SecretKey(
            client("secretsmanager", resources),
            resources.master_key_secret_arn,
            window_s=settings.previous_key_window_s,
            recheck_s=fresh_keys_recheck_s,
        )
        settings = replace(settings, master_keys_source=key.keys, fresh_master_keys_source=key.fresh_keys)
    engine = Engine(
        store=DynamoStore(
            client("dynamodb", resources),
            resources.table_name,
            counter,
            retention_s=resources.retention_days * 86_400 if resources.retention_days is not None else None,
        ),
        queue=SqsQueue(
            sqs,
            resources.queue_url,
            timers,
            counter,
            hold=hold,
            fair=resources.fair_queue,
            app_queues=resources.app_queues,
            lease_watches=lease_watch_scheduler(resources, counter),
        ),
        timers=timers,
        invoker=HttpInvoker(counter, policy=policy) if signs else _NoInvoker(),
        settings=settings,
        event_invoker=event_invoker(resources, counter) if signs and resources.lambda_events else None,
    )
    return AwsEngine(engine=engine, sqs=sqs, counter=counter, policy=policy)


log = logging.getLogger("ryusen.wiring")


class SecretKey:
    """The signing key in a Secrets Manager secret: read on first use (the Lambda's cold start) and again once
    ``ttl_s`` has passed, so a rotated key takes effect within that time without a redeploy.

    The key a rotation replaced (AWSPREVIOUS) is still accepted for ``window_s`` after the rotation (the time
    the current version was made, on ``wall``'s clock), then never. An emergency rotation detaches AWSPREVIOUS
    (``ryusen key rotate --emergency``): there is no previous key to accept. :meth:`fresh_keys` reads the
    secret again first (unless it was read in the last ``recheck_s``): an unsolicited message that verifies
    (a late result, a manifest) is verified again with it, so an emergency rotation refuses the old key at
    once there."""

    def __init__(
        self,
        client: Any,
        secret_id: str,
        *,
        ttl_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        window_s: float = PREVIOUS_KEY_WINDOW_S,
        wall: Callable[[], float] = time.time,
        recheck_s: float = 0.0,
    ) -> None:
        self._client = client
        self._secret_id = secret_id
        self._ttl_s = ttl_s
        self._clock = clock
        self._window_s = window_s
        self._wall = wall
        self._recheck_s = recheck_s
        self._read: SecretRead | None = None
        self._read_at = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> str | None:
        return self.keys()[0]

    def keys(self) -> tuple[str | None, str | None]:
        """(current, previous): the key to sign with, and the one a rotation replaced while its window lasts,
        still accepted when verifying so that a rotation fails nothing in flight."""
        return self._keys(self._ttl_s)

    def fresh_keys(self) -> tuple[str | None, str | None]:
        """:meth:`keys`, read from the secret again unless it was read in the last ``recheck_s`` (by default:
        always). What asks for it is rare: a sync (an IAM caller), and a late result that already verified
        with the cached keys, so a flood of unsigned messages never costs a read of the secret."""
        return self._keys(self._recheck_s)

    def _keys(self, max_age_s: float) -> tuple[str | None, str | None]:
        with self._lock:
            if self._read is None or self._clock() - self._read_at >= max_age_s:
                try:
                    known = self._read
                    if known is not None and known.keys(self._wall(), self._window_s)[1] is not None:
                        known = None  # a previous key still accepted: see whether it was detached since
                    read = read_secret(self._client, self._secret_id, known=known)
                    if read.current is None:  # an empty secret is no key: fail closed, never unsigned
                        raise RuntimeError(f"the signing key secret {self._secret_id} is empty")
                except Exception:
                    if self._read is None:
                        raise  # a cold start without the key: fail closed, the message comes back
                    log.warning("could not re-read the signing key; keeping the one read before", exc_info=True)
                    self._read_at = self._clock()
                else:
                    self._read, self._read_at = read, self._clock()
            return self._read.keys(self._wall(), self._window_s)


MANIFEST_MAX_BYTES = MAX_MANIFEST_BYTES
"""The largest manifest a sync reads (what a release is recorded from, at most)."""
MANIFEST_TIMEOUT_S = 10.0
"""One deadline for the whole manifest fetch: connecting, the headers and the body together."""


class _Deadline:
    """Cuts a fetch's connection when its deadline passes, wherever the fetch is: httpx's timeouts are per
    read, so an endpoint that trickles its headers (or body) a byte at a time would hold the caller without
    end. The socket is learned from httpx's ``trace`` extension, and shut down from a timer thread; the
    blocked read then fails at once."""

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    def trace(self, event: str, info: dict[str, Any]) -> None:
        if event not in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            return
        stream = info.get("return_value")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if isinstance(sock, socket.socket):
            with self._lock:
                self._sockets.append(sock)
                if self.expired:
                    _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def fetch_manifest(
    url: str,
    *,
    app_id: str = "",
    policy: EndpointPolicy | None = None,
    keys: Callable[[str], list[str]] | None = None,
) -> tuple[Manifest, frozenset[str]]:
    """GET an app endpoint's manifest (what ``PUT /v1/apps/{id}`` records as a release), and the features its
    SDK announced in ``X-Ryusen-Features`` (none from an SDK that predates them).

    The URL must pass ``policy`` (decisions 22; by default only public addresses) and is fetched at the
    address the policy checked, within ``MANIFEST_TIMEOUT_S`` in all and ``MANIFEST_MAX_BYTES``. With ``keys``
    (an app id's keys: the server's), the manifest must be signed by app ``app_id`` as the answer to a GET of
    this URL's path, with the features it announces: an app the server cannot verify is refused here, not
    left to fail every task later. The request names the ids of the keys the server holds
    (``X-Ryusen-Key-Ids``), so an app that already holds a newer key signs with one the server holds. Nothing
    the endpoint answered is repeated in an error unless it is a well-formed, verified manifest: the
    fetch must not be a way to read what some other service would answer.
    """
    target = (policy or EndpointPolicy()).check(url)
    valid_keys = keys(app_id) if keys is not None else []
    challenge = secrets.token_hex(16)  # the manifest must be signed for this fetch: an older one is no answer
    headers = {"Host": target.host_header, "Accept": "application/json", CHALLENGE_HEADER: challenge}
    if valid_keys:
        headers[KEY_IDS_HEADER] = key_ids_header(valid_keys)
    slow = InvalidRequestError(f"{url} took over {MANIFEST_TIMEOUT_S:g}s to answer", code="endpoint_unreachable")
    try:
        with (
            _Deadline(MANIFEST_TIMEOUT_S) as deadline,
            httpx.Client(follow_redirects=False, timeout=MANIFEST_TIMEOUT_S) as http,
        ):
            extensions: dict[str, Any] = {"trace": deadline.trace}
            if target.sni_hostname:
                extensions["sni_hostname"] = target.sni_hostname
            try:
                with http.stream("GET", target.url, headers=headers, extensions=extensions) as response:
                    received = bytearray()
                    for chunk in response.iter_bytes():
                        received += chunk
                        if len(received) > MANIFEST_MAX_BYTES:
                            raise InvalidRequestError(
                                f"{url} answered with over {MANIFEST_MAX_BYTES} bytes; a manifest is at most that",
                                code="manifest_too_large",
                                limit=MANIFEST_MAX_BYTES,
                            )
                    if deadline.expired:
                        raise slow
                    body = bytes(received)
            except httpx.HTTPError:
                if deadline.expired:
                    raise slow from None
                raise
    except httpx.HTTPError as exc:
        raise InvalidRequestError(f"cannot reach {url}: {type(exc).__name__}", code="endpoint_unreachable") from None
    if response.status_code != 200:
        raise InvalidRequestError(
            f"{url} answered HTTP {response.status_code} to the manifest request", code="invalid_manifest"
        )
    try:
        manifest = Manifest.model_validate_json(body)
    except ValueError:
        raise InvalidRequestError(
            f"{url} did not answer with a Ryusen manifest (its answer is not repeated here)", code="invalid_manifest"
        ) from None
    announced = response.headers.get(FEATURES_HEADER, "")
    if valid_keys:
        scope = Scope("response", "GET", url_path(url), app_id, extra=announced)
        try:
            verify(valid_keys, scope, body, response.headers.get(SIGNATURE_HEADER), now=time.time(), nonce=challenge)
        except SignatureError as exc:
            raise InvalidRequestError(
                f"the manifest from {url} is not signed with app {app_id!r}'s key ({exc.reason}); give the app"
                f" its key (RYUSEN_SIGNING_KEY from `ryusen key derive {app_id}`, with the same RYUSEN_MASTER_KEY the"
                " server was started with), and build it with a current SDK. An app in insecure local mode"
                " (RYUSEN_INSECURE_LOCAL=1) signs nothing, and no server accepts it, `ryusen dev` included",
                code="unsigned_app",
            ) from None
    features = frozenset(f.strip() for f in announced.split(",") if f.strip())
    return manifest, features


def manifest_fetcher(
    policy: EndpointPolicy, keys: Callable[[str], list[str]]
) -> Callable[[str, str], tuple[Manifest, frozenset[str]]]:
    """``fetch_manifest(app_id, url)`` under a deployment's URL policy and app keys (what the API is built with)."""
    return lambda app_id, url: fetch_manifest(url, app_id=app_id, policy=policy, keys=keys)


class _NoInvoker:
    """The invoker of an engine that must never call an endpoint (the sweeper: it holds no signing key)."""

    def invoke(self, url: str, body: bytes, headers: dict[str, str], *, timeout_s: float) -> InvokeResult:
        raise RuntimeError("this engine holds no signing key and calls no endpoint")

"""A deterministic simulation of the whole server: the real core, engine, store, SDK and endpoint, with a
seeded scheduler that decides the order of everything and injects faults at every I/O boundary (issue 12).

Each concurrent activity (a dispatcher handling one message, a timer firing, the sweeper, an operator, a
client starting a run) is an :class:`Actor`: a thread that runs only while the scheduler lets it. Every call
an actor makes to the world (a DynamoDB read or write, an SQS send, a Scheduler call, an HTTP request to the
endpoint) first parks it at a *boundary*; the scheduler then picks, from a seeded RNG, which parked actor
moves next and what happens to its call: it goes through; the process dies before it or after it; it fails
(throttled past botocore's retries, a 5xx); it commits but its answer is lost; a send is lost or doubled;
the endpoint is unreachable, answers 502, or its answer is lost, late or never heard. Between any two steps
the scheduler may also let time pass (leases expire while an answer is on its way), jump the clock, deliver
messages in any order and more than once, fire timers late or twice, and, as operators do, cancel runs (and
mark their orders cancelled, which a workflow's guard reads), resolve Unknowns and held or blocked attempts
(retry, succeed, fail, skip, with a reason), rediscover, and sync a release whose code renames, adds, removes or
retires steps, or stops (or starts) opening steps inside callbacks, returning too much, or using unstable ids.

The new dispatch path (issue 25, decision 33) too: most seeds' releases announce ``acknowledge`` to a server with a
result URL, so an attempt's callback runs on an endpoint thread of its own (an actor, started as the request
arrives); one that has not ended when the endpoint answers is answered ``202 accepted``, and its outcome, with what
the replay found next, is posted to the result endpoint later (delayed past the lease, lost, doubled, or retried
as the SDK does while the store refuses it). Long steps heartbeat through the result endpoint while they work,
may go silent, and return early once a heartbeat says the run is stopping.

Only one thread runs at a time, and every choice comes from the seed, so a seed replays exactly (in one
process; run the bench with ``PYTHONHASHSEED=0`` to replay across processes). The invariants
(:mod:`.invariants`) are checked at every committed write and every callback execution, and liveness at the
end: with the faults over and delivery fair, every run finishes or carries a blocker that names its remedy.
"""

from __future__ import annotations

import contextvars
import json
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from ryusen._internal.app import (
    ACKNOWLEDGED_DELAYS_S,
    HandlerResponse,
    ResponseWindow,
    ServeOptions,
    _memo_miss,
    encode_response,
)
from ryusen._internal.app import _acknowledges as acknowledges
from ryusen._internal.heartbeat import SINK
from ryusen._internal.signing import SIGNATURE_HEADER, SeenRequests, app_key, sign, url_path
from ryusen._internal.step import CallbackInterruptedError
from ryusen._internal.wire import (
    NESTED_STEP_ERROR,
    SDK_FEATURES,
    ErrorInfo,
    Heartbeat,
    HeartbeatReply,
    LateResult,
    Phase,
    StepReached,
    StepsReached,
    TaskRequest,
    TaskResponse,
    late_result_scope,
    value_size,
)
from ryusen_server.aws.queue import MAX_RECEIVE_COUNT
from ryusen_server.core.events import AttemptReported, DiscoveryReported, EngineSettings, InvocationFailed, Resolve
from ryusen_server.core.model import (
    DEFINITION_BLOCKERS,
    AttemptStatus,
    BlockerType,
    RunPhase,
    RunState,
    TaskRef,
    TimerRef,
)
from ryusen_server.core.view import REMEDIES
from ryusen_server.deferred import DeferredAnswer, DeferredMessage, WakeMessage, WakeOrder
from ryusen_server.engine import (
    INLINE_UP_TO_S,
    RELEASE_RECHECK_S,
    SCHEDULED_LEASE_FROM_S,
    SWEEP_GRACE_S,
    Engine,
    ServerSettings,
)
from ryusen_server.memory import MemoryStore
from ryusen_server.ports import (
    InvokeResult,
    Release,
    RunPage,
    ServerError,
    StoreUnavailableError,
    VersionConflictError,
)
from ryusen_server.runtime import DispatchMessage, TimerMessage, lease_keeper, process_message

from . import workload
from .decisions import Answer, Ground, Key, held_step_id
from .invariants import Checker

EPOCH = datetime(2030, 1, 1, tzinfo=UTC)
VISIBILITY_S = 60.0
"""The dispatch queue's visibility timeout (a received message comes back after this unless changed)."""
SWEEP_EVERY_S = 60.0
MAX_ACTORS = 4
STALL = timedelta(hours=6)
"""Fair delivery for this long redoes any lost work (or twice as long as it had been overdue, if longer)."""
RESULT_URL = "sim://results.sim/v1/results"
"""The server's result URL: posts and heartbeats are signed for its path. Not http(s), so the SDK posts nothing
to it by itself: the simulated endpoint hands them to the engine as an actor the scheduler runs."""
ACKNOWLEDGING = 0.7
"""The share of seeds whose releases announce ``acknowledge`` (each later release keeps it, or not, 4 times in 5)."""


class Crash(BaseException):
    """The process running this actor died here (a Lambda timeout, an OOM, a host failure)."""


class Killed(Crash):
    """The seed is over: every actor still parked dies at its boundary (never caught, unlike a crash of a call
    made on the actor's behalf by another process, such as a heartbeat's result endpoint)."""


class Silent(BaseException):
    """A long step's callback goes silent here: it never heartbeats again and never returns."""


class InjectedError(Exception):
    """An AWS or HTTP call failed as botocore reports it after its retries: throttled, a 5xx, a timeout."""


# ---- faults ----------------------------------------------------------------------------------------------

WRITE_FAULTS = ("crash_before", "crash_after", "error_before", "error_after", "throttled")
"""A conditional write: the process dies before or after it commits; it fails; it commits and its answer is
lost past botocore's retries; it is throttled and botocore's retries get it through."""
READ_FAULTS = ("crash_before", "error_before", "throttled")
SEND_FAULTS = ("crash_before", "crash_after", "error_before", "lost", "duplicate", "delayed")
DEFER_FAULTS = ("crash_before", "crash_after", "error_before", "duplicate", "delayed")
"""Sending a deferred answer: SQS keeps what it accepted (a "lost" send models a message of work the sweeper
repairs; an answer is not work anyone could redo)."""
SCHEDULE_FAULTS = ("crash_before", "crash_after", "error_before", "lost")
LEASE_WATCH_FAULTS = ("crash_before", "crash_after", "error_before", "error_after")
"""Creating a lease watch's schedule (``SqsQueue.watch_lease``): refused (the engine sends an SQS timer), or created
with its answer lost (both watch the attempt). A created schedule is not lost."""
INVOKE_FAULTS = ("crash_before", "unreachable", "bad_gateway", "duplicate_request", "front_end_throttled")
ANSWER_FAULTS = ("crash_after", "answer_lost", "answer_late", "bad_gateway_after")
DELIVERY_FAULTS = ("duplicate_delivery", "reordered")
OUTAGE_FAULTS = ("store_outage",)
"""A stretch of time in which DynamoDB refuses every write (a hot partition, a new table's warm-up), and half
the time every read too: long enough that a dispatcher's retries run out and it defers what it has."""
TIMER_FAULTS = ("fired_late", "fired_twice")
POST_FAULTS = ("post_lost", "post_delayed", "post_doubled")
"""An acknowledged attempt's outcome, posted to the result endpoint: the endpoint dies before it posts; the post
arrives 5 s to 2 min late (often past the lease: the attempt is Unknown first); it arrives twice."""
CALLBACK_FAULTS = ("crash_before", "callback_silent")
"""An acknowledged attempt's callback, between two stretches of work: the endpoint's process dies; the callback
goes silent (no more heartbeats, no outcome, ever)."""
HEARTBEAT_FAULTS = ("heartbeat_lost", "heartbeat_reply_lost")
EVENT_FAULTS = ("event_throttled", "event_refused", "event_lost_queued", "event_lost_not_queued", "event_twice")
"""An attempt sent to a Lambda endpoint as an asynchronous event (way C): Lambda throttles the ``Invoke`` (not
queued); refuses it as configured (no grant: the engine uses the URL); its answer is lost after it queued the
event, or before; its async queue delivers the event twice. Drawn from a generator of their own."""
EVENT_RATE = 0.15
"""How often an ``Invoke`` of a faulty seed meets one of ``EVENT_FAULTS``."""
EVENTS = 0.5
"""The share of new-dispatch seeds whose releases served on Lambda (not acknowledging) take attempts as events."""
ACCEPTED_FAULTS = ("accepted_replayed",)
"""An attempt's answer is replaced by the signed ``accepted`` the endpoint gave another request."""
DISPATCH_FAULTS = frozenset(POST_FAULTS + CALLBACK_FAULTS[1:] + HEARTBEAT_FAULTS + ACCEPTED_FAULTS)
"""Faults of the new dispatch path (issue 25, decision 33), drawn from a generator of their own: a seed drawn
before them keeps its profile."""
ALL_FAULTS = (
    frozenset(
        WRITE_FAULTS
        + READ_FAULTS
        + SEND_FAULTS
        + SCHEDULE_FAULTS
        + LEASE_WATCH_FAULTS
        + INVOKE_FAULTS
        + ANSWER_FAULTS
        + DELIVERY_FAULTS
        + TIMER_FAULTS
        + OUTAGE_FAULTS
    )
    | DISPATCH_FAULTS
)


@dataclass(frozen=True, slots=True)
class Profile:
    """What a seed may do: how often a boundary faults and which faults, operators and releases it has."""

    rate: float
    kinds: frozenset[str]
    operators: bool
    releases: bool
    jumps: bool
    skew_s: float
    runs: int
    chaos_events: int

    @staticmethod
    def draw(rng: random.Random) -> Profile:
        if rng.random() < 0.1:
            return Profile.clean(rng)
        kinds = frozenset(k for k in sorted(ALL_FAULTS - DISPATCH_FAULTS) if rng.random() < 0.6)
        return Profile(
            rate=rng.choice([0.02, 0.05, 0.1, 0.2]),
            kinds=kinds,
            operators=rng.random() < 0.7,
            releases=rng.random() < 0.5,
            jumps=rng.random() < 0.4,
            skew_s=rng.choice([0.0, 0.0, 2.0, 10.0]),
            runs=rng.randint(1, 3),
            chaos_events=rng.randint(100, 500),
        )

    @staticmethod
    def clean(rng: random.Random) -> Profile:
        """No fault, no operator, no release: every run must end as the code says (:func:`workload.expected`);
        dispatchers still race."""
        return Profile(0.0, frozenset(), False, False, False, 0.0, rng.randint(1, 3), 0)

    @property
    def is_clean(self) -> bool:
        return self.rate == 0.0 and not (self.operators or self.releases or self.jumps or self.skew_s)


# ---- actors and the scheduler ----------------------------------------------------------------------------


class Actor:
    """One concurrent activity, run by its own thread only while the scheduler hands it the baton."""

    def __init__(self, sim: Simulation, name: str, body: Callable[[], None], *, endpoint: bool = False) -> None:
        self.sim = sim
        self.name = name
        self.body = body
        self.resume = threading.Semaphore(0)
        self.at: tuple[str, str, tuple[str, ...]] | None = None
        """The boundary it is parked at: (kind, detail, the faults possible there)."""
        self.verdict = "ok"
        self.kill = False
        self.finished = False
        self.endpoint = endpoint
        """A thread of the user's endpoint (an acknowledged attempt's callback), not a server process: it does not
        count against ``MAX_ACTORS``."""
        self.wake_at: datetime | None = None
        """It works (virtual time) until then: the scheduler does not move it before."""
        self.handback: threading.Semaphore | None = None
        """Who gets the baton when it next parks or ends, if not the scheduler (the actor that forked it)."""
        self.job: Job | None = None
        """The attempt it runs, if it is an endpoint's thread."""
        self.posting: tuple[Key, str] | None = None
        """The acknowledged attempt whose outcome (its type) this actor is posting to the result endpoint."""
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def give_back(self) -> None:
        """Hand the baton on: to the actor that forked this one, the first time, else to the scheduler."""
        if self.handback is not None:
            handback, self.handback = self.handback, None
            handback.release()
        else:
            self.sim.baton.release()

    def _main(self) -> None:
        self.resume.acquire()
        try:
            if not self.kill:
                self.body()
        except Crash:
            self.sim.note(f"{self.name}: its process died")
            self.sim.answers.pop(self.name, None)  # what it had in hand died with it (an Unknown is right then)
        except (InjectedError, ServerError) as exc:
            self.sim.note(f"{self.name}: failed: {type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - the engine raised what it never should: a violation
            self.sim.violation(f"{self.name} raised {type(exc).__name__}: {exc}")
        finally:
            self.finished = True
            self.give_back()


@dataclass(slots=True)
class Message:
    id: str
    body: DispatchMessage
    visible_at: datetime
    receives: int = 0


@dataclass(slots=True)
class Held:
    """A late result an endpoint's SDK will submit to the result endpoint."""

    body: bytes
    headers: dict[str, str]
    times: int
    due: datetime = EPOCH
    """Not posted before then."""
    acknowledged: LateResult | None = None
    """The outcome of an attempt answered ``accepted`` (signed afresh for each try, tried again as the SDK does
    while the server answers 5xx: ``ACKNOWLEDGED_DELAYS_S``)."""
    tries: int = 0


@dataclass(slots=True)
class Job:
    """An attempt an acknowledging endpoint runs on a thread of its own."""

    request: TaskRequest
    spec: workload.WorkflowSpec
    slow: bool
    """Its callback runs past ``acknowledge_after_s`` even with no work of its own to do."""
    finished: bool = False
    outcome: TaskResponse | CallbackInterruptedError | None = None
    """None once finished: the callback went silent (or the process died)."""
    accepted: bool = False
    """The endpoint answered ``accepted``: the outcome goes to the result endpoint."""

    @property
    def key(self) -> Key:
        assert self.request.operation is not None and self.request.step_id is not None
        op = self.request.operation
        return (self.request.run_id, self.request.step_id, op.phase.value, op.generation)


SERVING: contextvars.ContextVar[tuple[TaskRequest, workload.WorkflowSpec, Job | None] | None] = contextvars.ContextVar(
    "sim_serving", default=None
)
"""The request a callback serves, the release whose code runs it, and its job if an endpoint thread runs it (a
context variable: a kept pass runs callbacks on its own thread, in the request's context)."""


@dataclass
class Report:
    seed: int
    profile: Profile
    spec: str
    events: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    blocked_at_end: int = 0
    effects: int = 0
    trace: list[str] = field(default_factory=list)
    cases: Counter[str] = field(default_factory=Counter)
    """How often each case of decisions 23-29 came up: what endpoints answered, guards, resolutions, blockers."""

    def trace_text(self, last: int = 200) -> str:
        lines = self.trace[-last:]
        return "\n".join(lines)


class Simulation:
    def __init__(self, seed: int, profile: Profile | None = None, *, new_dispatch: bool = True) -> None:
        """``new_dispatch``: False runs the seed as it ran before the new dispatch path (issue 25, decision 33): no
        release acknowledges, no step heartbeats, none of its faults (a seed that found a bug before it replays
        as it did then)."""
        self.seed = seed
        self.rng = random.Random(seed)
        self.profile = profile or Profile.draw(self.rng)
        self.now = EPOCH
        self.baton = threading.Semaphore(0)
        self.actors: list[Actor] = []
        self.current: Actor | None = None
        self._by_thread: dict[int, Actor] = {}
        self.chaos = True
        self.calm_since = EPOCH
        self.overdue_at_calm: dict[str, timedelta] = {}
        """How long each run's work had been overdue when the faults ended."""
        self.faults: Counter[str] = Counter()
        self.trace: list[str] = []
        self.violations: list[str] = []
        self.events = 0
        self.ids = iter(range(1, 1 << 40))

        self.xrng = random.Random(f"dispatch-{seed}")
        """The new dispatch path's own draws (issue 25, decision 33), apart from ``rng``: a seed whose releases do
        not acknowledge and whose steps do not heartbeat replays as it did before them."""
        self.new_dispatch = new_dispatch
        self.acknowledging = self.xrng.random() < ACKNOWLEDGING and new_dispatch
        if not self.profile.is_clean and new_dispatch:
            extra = frozenset(k for k in sorted(DISPATCH_FAULTS) if self.xrng.random() < 0.6)
            self.profile = replace(self.profile, kinds=self.profile.kinds | extra)
        self.erng = random.Random(f"events-{seed}")
        """Way C's own draws (attempts as Lambda events), apart from ``rng`` and ``xrng``."""
        self.evented = new_dispatch and self.erng.random() < EVENTS
        """Releases of this seed served on Lambda announce ``lambda_event``: attempts go to them as events."""
        if self.evented and not self.profile.is_clean:
            self.profile = replace(self.profile, kinds=self.profile.kinds | frozenset(EVENT_FAULTS))
        self.accepted_by_endpoint: set[Key] = set()
        """Attempts whose endpoint answered ``accepted`` (or whose event Lambda queued): only their posted outcome,
        an operator, or their lease (Unknown) may settle them."""
        self.store = SimStore(self)
        self.queue = SimQueue(self)
        self.timers = SimTimers(self)
        self.invoker = SimInvoker(self)
        self.lambda_events = SimLambdaEvents(self)
        self.settings = EngineSettings(
            attempt_timeout_s=30,
            lease_grace_s=5,
            redelivery_initial_s=1,
            max_value_bytes=workload.SERVER_VALUE_LIMIT,
        )
        self.ground = Ground()
        """What the world knows that the engine does not: the endpoint's answers, the operators' resolutions."""
        self.resolved = self.ground.resolved
        self.check = Checker(self)
        self.held: list[Held] = []
        self.starts: list[tuple[int, Any, float | None]] = []
        """Starts whose client heard no answer: it sends the same start again (same idempotency key)."""
        self.next_sweep = self.now + timedelta(seconds=SWEEP_EVERY_S)
        self.outage_until: datetime | None = None
        self.outage_reads = False

        master = f"{self.rng.getrandbits(256):064x}"
        self.master = master
        self.seen = SeenRequests()
        """Shared by every endpoint instance (``RYUSEN_REPLAY_TABLE``): a duplicated request is refused anywhere."""
        self.skews = [timedelta(0), timedelta(seconds=self.rng.uniform(-1, 1) * self.profile.skew_s)]
        settings = self.settings
        # a long lease of an event watched by a schedule deleted once its outcome is recorded: never, as deployed (a
        # lease of 2 minutes after a step that took a quarter of it), or for every event (drawn apart, as below)
        lease_from_s, lease_share = random.Random(f"lease-watch-{self.seed}").choice(
            ((None, 4.0), (SCHEDULED_LEASE_FROM_S, 4.0), (0.0, math.inf))
        )
        self.engines = [
            Engine(
                store=self.store,
                queue=self.queue,
                timers=self.timers,
                invoker=self.invoker,
                settings=ServerSettings(
                    engine=settings,
                    chain=True,
                    master_key=master,
                    result_url=RESULT_URL,
                    # the quick path (a dispatcher waits for a Lambda endpoint's step seen quick, rather than send
                    # it as an event): off, as deployed, or taken for any step seen under 10 s, so that many of the
                    # waits are cut at INLINE_LISTEN_S and end in a posted outcome. Drawn apart, so that each seed's
                    # other draws stay what they were.
                    inline_up_to_s=random.Random(f"inline-{self.seed}").choice((0.0, INLINE_UP_TO_S, 10.0)),
                    scheduled_lease_from_s=lease_from_s,
                    scheduled_lease_share=lease_share,
                    # the simulation's time is not the process's: a recheck after every callback in half the
                    # seeds (an eventually consistent read, through a copy that may lag: SimStore.get_release;
                    # 0 would read consistently), else the deployed second of wall time, which a seed's few
                    # milliseconds never reach
                    release_recheck_s=random.Random(f"recheck-{self.seed}").choice((1e-9, RELEASE_RECHECK_S)),
                ),
                clock=self._clock_of(i),
                new_id=lambda: f"run_{next(self.ids):04d}",
                event_invoker=self.lambda_events,
            )
            for i in range(2)
        ]
        for engine in self.engines:
            self._watch_releases(engine)
        self.result_function = random.Random(f"results-{self.seed}").random() < 0.5
        """Acknowledged outcomes are posted to the result function (``Engine.submit_result``: it records the outcome,
        carries the run on, and sends lease timers, one for a run's steps), else through the API's result route
        (``submit_late_result``: what comes next is queued). Drawn apart, so that each seed's other draws stay."""
        self.jumps: list[datetime] = []
        """When the clock jumped (everything stalled: a process mid-retry too, past the time it kept its message
        away)."""
        self.posted_outcomes: dict[Key, str] = {}
        """Acknowledged outcomes posted to the result function (their type): one it took while the store refused it
        is deferred to the queue, whose receiver records it (even if the function died after deferring it)."""
        self.answers: dict[str, set[tuple[Any, ...]]] = {}
        """Answers each dispatcher had in hand and has not yet recorded, deferred or given up on (by actor)."""
        self.deferred_answers: set[tuple[Any, ...]] = set()
        """Answers on the queue, deferred while the store would not take them, not yet recorded."""
        self.unknown_deferred: set[tuple[Any, ...]] = set()
        """Deferred answers whose attempt was found Unknown (each looked at once)."""
        self.late_answers: set[tuple[Any, ...]] = set()
        """Answers a dispatcher came to hold for an attempt that was no longer in flight (already Unknown)."""
        self.answered_at: dict[tuple[Any, ...], datetime] = {}
        """When each answer first came into a dispatcher's hand."""
        for engine in self.engines:
            engine.sleep = lambda seconds: None  # a retry's backoff: the simulation's time is its own
            engine.run_locks = None  # the scheduler interleaves the activities itself (a lock would deadlock it)
            engine.hooks.append(self._observe_answers)
        long_steps = self.xrng if new_dispatch else None
        waits = random.Random(f"waits-{seed}") if new_dispatch else None
        together = random.Random(f"parallel-{seed}") if new_dispatch else None  # decision 30, as for waits
        self.spec = workload.generate(
            self.rng, clean=self.profile.is_clean, long_steps=long_steps, waits=waits, parallel=together
        )
        self.reported: dict[str, list[list[str]]] = {}
        """Per run, the steps each pass an endpoint answered reported (``StepsReached``, in declaration order, or
        ``StepReached``): a discovery's, or an attempt's ``next``."""
        self.specs = [self.spec]
        self.releases = 0
        self.run_ids: list[str] = []
        self.inputs: dict[str, Any] = {}
        self.executions: Counter[tuple[str, str, str]] = Counter()
        self.spec_at: dict[str, workload.WorkflowSpec] = {}
        self.cancelled_orders: set[str] = set()
        self.tokens: list[tuple[str, str, int, str]] = []
        """Completion tokens callbacks handed out (decision 32): run, step, generation, token."""
        """Runs whose order is marked cancelled in the world outside (what a workflow's guard reads)."""
        self.cases: Counter[str] = Counter()
        """How often each case of decisions 23-29 came up (figures for bench/simulate.py)."""
        self.fixed_release: workload.WorkflowSpec | None = None
        self.operator_actions = 0
        self._publish(self.spec)

    # ---- the clock -----------------------------------------------------------------------------

    def _clock_of(self, container: int) -> Callable[[], datetime]:
        return lambda: self.now + self.skews[container]

    def advance(self, seconds: float, why: str) -> None:
        self.now += timedelta(seconds=seconds)
        self.note(f"time +{seconds:.1f}s ({why})")

    # ---- trace and violations ---------------------------------------------------------------------

    def _observe_answers(self, kind: str, payload: Any) -> None:
        """Follow each answer a dispatcher has in hand until the core has it: recorded, or deferred to the queue
        and recorded from there. Only the process dying, or the queue failing as well as the store, may lose
        one (issue 24: a throttled write must not turn a success the engine had into an Unknown)."""
        if kind == "quick":
            self.cases["quick step of a Lambda endpoint that takes events waited for on its URL"] += 1
            return
        if kind == "lease_timer_shared":
            self.cases["event left in flight by the result function, watched by the run's lease timer"] += 1
            return
        if kind == "cached_state_read_again":
            self.cases["a decision on a remembered state wrote nothing: read again and decided again"] += 1
            return
        actor = self._by_thread.get(threading.get_ident())
        holder = actor.name if actor is not None else "setup"
        if kind == "decided":
            event, decision = payload
            if isinstance(event, AttemptReported) and event.source == "late_submission" and event.next is not None:
                self._next_used(actor, decision.state, event)
            key = _answer_key(decision.state.id, event)
            if key is not None:
                for held in self.answers.values():
                    held.discard(key)
                self.deferred_answers.discard(key)
            for waiting in self.deferred_answers:
                if waiting[0] != decision.state.id or waiting[1] != "attempt" or waiting in self.unknown_deferred:
                    continue
                step = decision.state.step(waiting[2])
                attempt = step.attempt(Phase(waiting[3]), waiting[4]) if step is not None else None
                if attempt is not None and attempt.status is AttemptStatus.UNKNOWN:
                    self.unknown_deferred.add(waiting)
                    if (waiting[0], *waiting[2:]) in self.posted_outcomes:
                        # the stated limit (docs/deploy.md): an acknowledged attempt's own lease timer judges at the
                        # lease; an outcome the result function deferred while the store refused it races it
                        self.cases["a posted outcome deferred by the result function, Unknown by its lease"] += 1
                        continue
                    if waiting in self.late_answers:
                        # it reached a dispatcher after the attempt's lease ended: a late result, and it settles it
                        self.cases["an answer deferred that came after its attempt's lease (a late result)"] += 1
                        continue
                    answered = self.answered_at[waiting]
                    waited = (self.now - answered).total_seconds()
                    if any(answered <= jump < self.now for jump in self.jumps):
                        # the stated limit (docs/deploy.md): the dispatcher holding the answer stalled (the clock
                        # jumped) past the time it kept its message away; that message, the attempt's carrier,
                        # came back and took it as Unknown at its lease. The deferred answer settles it late.
                        self.cases["Unknown while its answer was held by a dispatcher that stalled"] += 1
                        continue
                    if waited > self.engines[0].settings.engine.lease_watch_grace_s:
                        # the stated limit (docs/deploy.md): an answer held (by its dispatcher, or on the queue) for
                        # longer than the grace (here the clock jumped: everything stalled) may find its attempt
                        # taken by another message
                        self.cases["Unknown after its answer was held past lease_watch_grace_s"] += 1
                        continue
                    # issue 24: no Unknown where the engine had the answer. Only the carrier of an attempt takes
                    # it as Unknown at its lease, and a dispatcher deferring the answer deletes its carrier; any
                    # other message waits lease_watch_grace_s (longer than the simulator's outages) past the lease
                    self.violation(f"{waiting} went Unknown while its answer, in hand before, was deferred")
            return
        if kind == "acknowledged":
            task = payload
            key = (task.run_id, task.step_id, task.phase.value if task.phase else "", task.generation)
            if key not in self.accepted_by_endpoint:
                self.violation(f"{holder} took an answer for {task.describe()} as accepted; its endpoint never said so")
            self.cases["engine heard accepted: the message is the lease timer"] += 1
            return
        if kind not in ("answer", "answer_deferred", "answer_dropped"):
            return
        run_id, event = payload[0], payload[1]
        key = _answer_key(run_id, event)
        if key is None:
            return
        if kind == "answer":
            self.answers.setdefault(holder, set()).add(key)
            self.answered_at.setdefault(key, self.now)
            state = self.store.inner.peek(run_id)
            step = state.step(key[2]) if state is not None and key[1] == "attempt" else None
            attempt = step.attempt(Phase(key[3]), key[4]) if step is not None else None
            lease = attempt.lease_expires_at if attempt is not None else None
            if attempt is not None and (
                attempt.status is not AttemptStatus.AUTHORIZED or (lease is not None and self.now >= lease)
            ):
                # the engine had no answer when its lease ended (the carrier may take the attempt as Unknown then,
                # and the answer settles it as a late result): what is promised covers answers in hand before
                self.late_answers.add(key)
            return
        self.answers.get(holder, set()).discard(key)
        if kind == "answer_deferred":
            self.deferred_answers.add(key)
            self.answered_at.setdefault(key, self.now)  # a posted outcome the result function deferred: now
            self.cases["answer deferred to the queue (store unavailable)"] += 1
        else:
            self.note(f"{holder}: an answer could be neither recorded nor deferred: {payload[2]}")
            self.cases["answer dropped (store and queue both failed)"] += 1

    def _next_used(self, actor: Actor | None, state: RunState, event: AttemptReported) -> None:
        """A posted outcome's ``next`` was used: it was found by the build that ran the attempt."""
        step = state.step(event.step_id)
        attempt = step.attempt(event.phase, event.generation) if step is not None else None
        newest = self.store.inner.get_release(workload.FUNCTION_ID)
        held = actor.posting if actor is not None else None
        if held is None or held[0] != (state.id, event.step_id, event.phase.value, event.generation):
            self.violation(f"{state.id}: {event.step_id} #{event.generation}: a next was used that no post carried")
        elif attempt is None or newest is None:
            return
        elif attempt.build_id != newest.build_id:
            self.cases["acknowledged outcome's next used, though a newer release was synced (release cache)"] += 1
        else:
            self.cases["acknowledged outcome's next used"] += 1

    def _answers_kept(self) -> None:
        for holder, keys in self.answers.items():
            for key in keys:
                self.violation(f"{holder} had an answer in hand and neither recorded nor deferred it: {key}")
        for key in self.deferred_answers:
            self.violation(f"an answer deferred to the queue was never recorded: {key}")

    def note(self, text: str) -> None:
        self.trace.append(f"{self.events:5d} {(self.now - EPOCH).total_seconds():9.1f}s  {text}")

    def _watch_releases(self, engine: Engine) -> None:
        """R1 within one process: the release a process decides from never goes back to one synced before one it
        already used (its rechecks may be answered by a copy that lags, ``SimStore.get_release``)."""
        newest = engine._newest_release
        used: dict[str, int] = {}

        def watched(function_id: str) -> Release | None:
            release = newest(function_id)
            synced = self.store.releases_synced.get(function_id, [])
            order = max((i for i, r in enumerate(synced) if r == release), default=-1)
            if order < used.get(function_id, -1):
                self.violation(
                    f"R1: a process went back to release {release.release_id if release else None} of"
                    f" {function_id} after it used {synced[used[function_id]].release_id}"
                )
            used[function_id] = max(order, used.get(function_id, -1))
            return release

        engine._newest_release = watched  # type: ignore[method-assign]

    def violation(self, text: str) -> None:
        self.note(f"VIOLATION: {text}")
        self.violations.append(text)

    # ---- boundaries ---------------------------------------------------------------------------

    def boundary(self, kind: str, detail: str, faults: tuple[str, ...]) -> str:
        """Called by the world before each call an actor makes: park until the scheduler moves this actor,
        and return what happens to the call ("ok", or a fault it injected)."""
        actor = self._by_thread.get(threading.get_ident())
        if actor is None:
            return "ok"  # the simulator's own setup or checks
        actor.at = (kind, detail, faults)
        actor.give_back()
        actor.resume.acquire()
        actor.wake_at = None
        if actor.kill:
            raise Killed()
        return actor.verdict

    def _verdict(self, faults: tuple[str, ...]) -> str:
        if not self.chaos or not faults or self.rng.random() >= self.profile.rate:
            return "ok"
        possible = [f for f in faults if f in self.profile.kinds]
        return self.rng.choice(possible) if possible else "ok"

    def spawn(self, name: str, body: Callable[[], None]) -> None:
        actor = Actor(self, name, body)
        self.actors.append(actor)
        actor.thread.start()
        self._by_thread[actor.thread.ident or 0] = actor
        self.note(f"{name}: begins")
        self._run(actor)

    def fork(self, name: str, body: Callable[[], None], job: Job | None = None) -> None:
        """From an actor: start another one now (the endpoint starts a thread for an attempt as its request
        arrives), run it until its first boundary or its end, then go on. The scheduler moves it from there."""
        parent = self._by_thread.get(threading.get_ident())
        assert parent is not None, "fork is called by an actor"
        actor = Actor(self, name, body, endpoint=True)
        actor.job = job
        back = threading.Semaphore(0)
        actor.handback = back
        self.actors.append(actor)
        actor.thread.start()
        self._by_thread[actor.thread.ident or 0] = actor
        self.note(f"{name}: begins")
        actor.resume.release()
        back.acquire()
        if actor.finished:
            self._reap(actor)

    def _reap(self, actor: Actor) -> None:
        self.actors.remove(actor)
        self._by_thread.pop(actor.thread.ident or 0, None)
        actor.thread.join()

    def sleep(self, seconds: float, what: str, faults: tuple[str, ...] = ()) -> str:
        """The calling actor works ``seconds`` of virtual time: it parks, and moves on no sooner (or first
        meets one of ``faults``). Outside an actor (a kept pass's thread) the clock moves at once."""
        actor = self._by_thread.get(threading.get_ident())
        if actor is None:
            self.advance(seconds, what)
            return "ok"
        actor.wake_at = self.now + timedelta(seconds=seconds)
        verdict = self.boundary("endpoint.works", f"{what} ({seconds:g}s)", faults)
        _fail_before(verdict, "")
        return verdict

    def inject(self, kind: str) -> bool:
        """Whether fault ``kind`` happens to what is not a call (a post the endpoint makes, or not)."""
        if not self.chaos or kind not in self.profile.kinds or self.xrng.random() >= self.profile.rate:
            return False
        self.faults[kind] += 1
        return True

    def _run(self, actor: Actor) -> None:
        self.current = actor
        actor.resume.release()
        self.baton.acquire()
        self.current = None
        for done in [a for a in self.actors if a.finished]:  # it, and any endpoint thread it started that ended
            self._reap(done)

    def _resume(self, actor: Actor) -> None:
        assert actor.at is not None
        kind, detail, faults = actor.at
        actor.verdict = self._verdict(faults)
        if actor.verdict != "ok":
            self.faults[actor.verdict] += 1
        self.note(f"{actor.name}: {kind} {detail}" + (f" -> {actor.verdict}" if actor.verdict != "ok" else ""))
        self._run(actor)

    def kill_all(self) -> None:
        for actor in list(self.actors):
            actor.kill = True
            self._run(actor)

    # ---- the apps -----------------------------------------------------------------------------------

    def _publish(self, spec: workload.WorkflowSpec) -> Release:
        """Serve a release of the app (two endpoint instances: a request may reach either) and sync it."""
        url = f"https://endpoint.sim/r{spec.release}"
        apps = [workload.build_app(spec, self, master_key=self.master, seen=self.seen) for _ in range(2)]
        self.invoker.endpoints[url] = apps
        self.spec_at[url] = spec
        if (
            spec.release and self.new_dispatch and self.xrng.random() < 0.2
        ):  # a release served another way (on Lambda: inline), or back
            self.acknowledging = not self.acknowledging
        features = frozenset(f for f in SDK_FEATURES if f != "acknowledge" or self.acknowledging)
        if self.evented and not self.acknowledging:  # on Lambda, with a replay table its containers share
            features |= {f"lambda_event={SimLambdaEvents.arn_of(spec.release)}"}
        return self.engines[0].sync_release(workload.APP_ID, url, apps[0].manifest(), features)

    # ---- what a release's code reaches of the world (workload.Hooks) ------------------------------------

    def effect(self, step_id: str, phase: str, received: Any = None) -> int:
        serving = SERVING.get()
        assert serving is not None, "a callback ran outside a request"
        request, spec, job = serving
        key = (request.run_id, step_id, phase)
        before = self.executions[key]
        self.executions[key] += 1
        build = f"b{spec.release}"
        self.check.effect(request, step_id, phase, build, received)
        self.note(f"  effect {request.run_id} {step_id} {phase} #{before + 1}")
        if job is not None and job.slow:  # on an endpoint thread: it runs past acknowledge_after_s
            self.sleep(round(self.xrng.uniform(0.3, 8.0), 1), "the callback runs", CALLBACK_FAULTS[:1])
        return before

    def takes(self, seconds: float) -> None:
        self.cases["callback took time"] += 1
        serving = SERVING.get()
        if serving is not None and serving[2] is not None:
            self.sleep(seconds, "the callback runs", CALLBACK_FAULTS[:1])
        else:
            self.advance(seconds, "the callback runs")

    def pause(self, seconds: float) -> None:
        serving = SERVING.get()
        self.cases["a long step worked between heartbeats"] += 1
        if serving is None or serving[2] is None:  # the dispatcher waits for it (a release that does not acknowledge)
            self.advance(seconds, "the callback works before its next heartbeat")
            return
        if self.sleep(seconds, "the callback works before its next heartbeat", CALLBACK_FAULTS) == "callback_silent":
            raise Silent()

    def stop_seen(self, kind: str) -> None:
        self.cases[f"a heartbeat raised StopRequested ({kind}): the callback returned early"] += 1

    def handed_out(self, step_id: str, token: str) -> None:
        serving = SERVING.get()
        assert serving is not None and serving[0].operation is not None, "a token handed out outside a request"
        request = serving[0]
        self.tokens.append((request.run_id, step_id, request.operation.generation, token))
        self.note(f"  token handed out: {request.run_id} {step_id} #{request.operation.generation}")

    def order_cancelled(self) -> bool:
        serving = SERVING.get()
        assert serving is not None, "the guard read the order outside a request"
        request = serving[0]
        cancelled = request.run_id in self.cancelled_orders
        if cancelled:
            self.cases[f"guard returned early in a {request.kind.value} pass"] += 1
        return cancelled

    def fresh_id(self, base: str) -> str:
        return f"{base}-q{next(self.ids)}"

    # ---- what the scheduler can do ----------------------------------------------------------------------

    def _choices(self) -> list[tuple[float, str, Any]]:
        choices: list[tuple[float, str, Any]] = [
            (4.0, "resume", actor) for actor in self.actors if actor.wake_at is None or actor.wake_at <= self.now
        ]
        if sum(not a.endpoint for a in self.actors) < MAX_ACTORS:
            visible = self.queue.visible()
            if visible:
                choices.append((3.0, "dispatch", visible))
            due = self.timers.due()
            if due:
                choices.append((2.0, "timer", due))
            if any(h.due <= self.now for h in self.held):
                choices.append((0.5, "late result", None))
            if self.starts:
                choices.append((1.0, "client retries", None))
            if self.now >= self.next_sweep:
                choices.append((1.0, "sweep", None))
            if self.chaos and self.profile.operators:
                choices.append((0.2, "operator", None))
                if self._long_steps_running():  # so that a stop reaches a callback through its heartbeat now and then
                    choices.append((0.3, "operator cancels a run whose long step runs", None))
            if self.chaos and self.profile.releases and self.releases < 3:
                # more often while an acknowledged outcome carrying ``next`` is on its way (is it still trusted?)
                nexts = any(h.acknowledged is not None and h.acknowledged.next is not None for h in self.held)
                choices.append((0.3 if nexts else 0.05, "release", None))
        if self.chaos and "store_outage" in self.profile.kinds and self.outage_until is None:
            choices.append((0.03, "store outage", None))
        if self.chaos and not (self.profile.is_clean and self._endpoint_busy()):
            # a fault-free seed's acknowledged outcomes arrive within their leases: no time passes meanwhile
            choices.append((0.3, "time passes", None))
            if self.profile.jumps:
                choices.append((0.02, "clock jumps", None))
        return choices

    def step(self) -> bool:
        """Take one scheduling decision; False if nothing can happen without time passing."""
        choices = self._choices()
        if not choices:
            return False
        total = sum(w for w, _, _ in choices)
        pick = self.rng.uniform(0, total)
        for weight, what, arg in choices:
            pick -= weight
            if pick <= 0:
                break
        self.events += 1
        if what == "resume":
            self._resume(arg)
        elif what == "dispatch":
            message = arg[0]
            if self.chaos and "reordered" in self.profile.kinds:
                message = self.rng.choice(arg)  # SQS keeps no order: any visible message may come first
                if message is not arg[0]:
                    self.faults["reordered"] += 1
            self._dispatch(message)
        elif what == "timer":
            self._fire(self.rng.choice(arg))
        elif what == "client retries":
            i, data, timeout = self.starts.pop(0)
            self.spawn(f"client{i} (again)", lambda: self._start(i, data, timeout))
        elif what == "late result":
            self._late_result()
        elif what == "sweep":
            self.next_sweep = self.now + timedelta(seconds=SWEEP_EVERY_S)
            engine = self.rng.choice(self.engines)
            self.spawn("sweeper", lambda: self._sweep(engine))
        elif what == "operator":
            self._operator()
        elif what == "operator cancels a run whose long step runs":
            run_id = self.rng.choice(self._long_steps_running())
            engine = self.rng.choice(self.engines)
            self.spawn(f"operator: cancel {run_id}", lambda: _refused_ok(lambda: engine.cancel(run_id)))
        elif what == "release":
            self._release()
        elif what == "store outage":
            seconds = self.rng.choice([5.0, 20.0, 60.0, 300.0, 900.0])
            self.outage_until = self.now + timedelta(seconds=seconds)
            self.outage_reads = self.rng.random() < 0.5
            self.faults["store_outage"] += 1
            reads = "reads and writes" if self.outage_reads else "writes"
            self.note(f"dynamodb: refuses {reads} for {seconds:.0f}s")
        elif what == "time passes":
            self.advance(self.rng.uniform(0.5, 40), "while work is in flight")
        elif what == "clock jumps":
            self.jumps.append(self.now)
            self.advance(self.rng.choice([300, 3600, 86400]), "the clock jumps")
        return True

    def _sweep(self, engine: Engine) -> None:
        report = engine.sweep()
        if report.repaired or report.failed:
            self.note(f"sweeper: repaired {report.repaired}, failed {report.failed}")

    def _dispatch(self, message: Message) -> None:
        message.receives += 1
        if message.receives > MAX_RECEIVE_COUNT:
            self.queue.dead_letter(message)
            return
        message.visible_at = self.now + timedelta(seconds=VISIBILITY_S)
        if self.chaos and "duplicate_delivery" in self.profile.kinds and self.rng.random() < self.profile.rate:
            self.faults["duplicate_delivery"] += 1
            self.queue.put(message.body, 0.0)  # SQS delivers at least once
        container = self.rng.randrange(2)
        engine = self.engines[container]
        name = f"dispatcher{container}[{message.id} {_describe(message.body)}]"
        self.spawn(name, lambda: self._handle(engine, message))

    def _handle(self, engine: Engine, message: Message) -> None:
        """What the dispatch Lambda does with one record."""

        def change_visibility(seconds: float) -> None:
            self.queue.change_visibility(message, seconds)

        keep = lease_keeper(change_visibility, VISIBILITY_S)
        try:
            done, after = process_message(engine, message.body, on_authorized=keep, carrier=message.id)
        except (InjectedError, ServerError) as exc:
            self.note(f"dispatch of {message.id} failed ({type(exc).__name__}: {exc}); it comes back")
            return
        if done:
            self.queue.delete(message)
        else:
            change_visibility(max(1.0, after))

    def _fire(self, timer: TimerRef) -> None:
        """EventBridge Scheduler puts the timer's message on the dispatch queue (at least once, maybe late)."""
        self.timers.fired(timer)
        if self.chaos and "fired_late" in self.profile.kinds and self.rng.random() < self.profile.rate:
            self.faults["fired_late"] += 1
            self.timers.later(timer, self.rng.uniform(1, 120))
            return
        self.note(f"scheduler: {timer.name} fires")
        self.queue.put(TimerMessage(timer=timer), 0.0)
        if self.chaos and "fired_twice" in self.profile.kinds and self.rng.random() < self.profile.rate:
            self.faults["fired_twice"] += 1
            self.queue.put(TimerMessage(timer=timer), self.rng.uniform(0, 30))

    def _long_steps_running(self) -> list[str]:
        """Runs (not yet stopping) whose forward attempt of a step that heartbeats runs on an endpoint thread."""
        runs = []
        for actor in self.actors:
            job = actor.job
            if job is None or job.request.operation is None or job.request.operation.phase is not Phase.FORWARD:
                continue
            step = job.spec.step_spec(job.request.step_id or "")
            state = self.store.peek(job.request.run_id)
            if step is not None and step.beats and state is not None and state.stop_intent is None:
                runs.append(job.request.run_id)
        return sorted(set(runs))

    def _endpoint_busy(self) -> bool:
        """An acknowledged attempt's callback still runs, or its outcome is on its way."""
        return any(a.endpoint for a in self.actors) or any(h.acknowledged is not None for h in self.held)

    def _late_result(self) -> None:
        held = self.rng.choice([h for h in self.held if h.due <= self.now])
        held.times -= 1
        if held.times <= 0:
            self.held.remove(held)
        engine = self.rng.choice(self.engines)
        if held.acknowledged is not None:
            late = held.acknowledged
            self.spawn(
                f"result endpoint [{late.run_id} {late.step_id} {late.phase.value} #{late.generation}]",
                lambda: self._submit_acknowledged(engine, held),
            )
            return
        self.spawn("result endpoint", lambda: self._submit(engine, held))

    def _submit(self, engine: Engine, held: Held) -> None:
        try:
            engine.submit_late_result(held.body, held.headers)
        except ServerError as exc:
            self.note(f"result endpoint: refused: {exc.code}")

    def _submit_acknowledged(self, engine: Engine, held: Held) -> None:
        """The SDK posts an acknowledged attempt's outcome (``_deliver_acknowledged``): signed afresh each try,
        tried again after a server error or a dropped connection (the result endpoint's process died), for
        about 16 minutes; a refusal (4xx) is final."""
        late = held.acknowledged
        assert late is not None
        actor = self._by_thread[threading.get_ident()]
        key: Key = (late.run_id, late.step_id, late.phase.value, late.generation)
        actor.posting = (key, late.attempt.type)
        self._next_figures(late)
        body = late.model_dump_json(exclude_none=True).encode()
        scope = late_result_scope(late, path=url_path(RESULT_URL), app_id=workload.APP_ID)
        nonce = f"{self.xrng.getrandbits(128):032x}"
        header = sign(app_key(self.master, workload.APP_ID), scope, body, now=time.time(), nonce=nonce)
        try:
            if self.result_function:
                self.posted_outcomes[key] = late.attempt.type
                engine.submit_result(body, {SIGNATURE_HEADER: header}, budget_s=60.0)
                self.cases["acknowledged outcome posted to the result function"] += 1
            else:
                engine.submit_late_result(body, {SIGNATURE_HEADER: header})
        except Killed:
            raise
        except ServerError as exc:
            if exc.status < 500:
                self.note(f"result endpoint: refused: {exc.code}")
                self.cases[f"acknowledged outcome refused ({exc.code})"] += 1
                return
            self._post_again(held, f"{type(exc).__name__}: {exc}")
        except (Crash, InjectedError) as exc:
            self._post_again(held, f"the result endpoint failed ({type(exc).__name__})")
            raise
        else:
            self.cases["acknowledged outcome posted and taken"] += 1
        finally:
            actor.posting = None

    def _post_again(self, held: Held, why: str) -> None:
        if held.tries >= len(ACKNOWLEDGED_DELAYS_S):
            self.note(f"result endpoint: the SDK gives up on the outcome ({why})")
            self.cases["acknowledged outcome given up after the SDK's retries"] += 1
            return
        delay = ACKNOWLEDGED_DELAYS_S[held.tries]
        self.held.append(replace(held, times=1, due=self.now + timedelta(seconds=delay), tries=held.tries + 1))
        self.note(f"result endpoint: {why}; the SDK posts again in {delay:g}s")
        self.cases["acknowledged outcome posted again after a server error"] += 1

    def _next_figures(self, late: LateResult) -> None:
        """How often a posted outcome's ``next`` is one the server may use (the attempt's build is the newest
        release's), and how often a release was synced in between."""
        if late.next is None:
            return
        state = self.store.peek(late.run_id)
        step = state.step(late.step_id) if state is not None else None
        attempt = step.attempt(late.phase, late.generation) if step is not None else None
        newest = self.store.inner.get_release(workload.FUNCTION_ID)
        if attempt is None or newest is None:
            return
        if attempt.build_id == late.build_id == newest.build_id:
            self.cases["acknowledged outcome posted with next, from the newest release's build"] += 1
        else:
            self.cases["acknowledged outcome posted with next, a release synced since (next not to be used)"] += 1

    def start_runs(self) -> None:
        for i in range(self.profile.runs):
            data = {"order": i}
            timeouts: list[float | None] = [None, None, None, None, 45.0, 120.0, 900.0]
            timeout = self.rng.choice(timeouts) if not self.profile.is_clean else None
            self.spawn(f"client{i}", self._starter(i, data, timeout))

    def _starter(self, i: int, data: Any, timeout: float | None) -> Callable[[], None]:
        return lambda: self._start(i, data, timeout)

    def _start(self, i: int, data: Any, timeout: float | None) -> None:
        """A client starts a run with an idempotency key, and retries until it hears an answer."""
        try:
            state, _ = self.engines[0].start_run(
                workload.FUNCTION_ID, data, idempotency_key=f"order-{i}", timeout_s=timeout
            )
        except (InjectedError, StoreUnavailableError, Crash):
            self.note(f"client{i}: no answer; it will retry the start")
            self.starts.append((i, data, timeout))
            raise
        if state.id not in self.run_ids:
            self.run_ids.append(state.id)
            self.inputs[state.id] = data

    def _operator(self) -> None:
        runs = [r for r in self.run_ids if (s := self.store.peek(r)) is not None and s.phase is not RunPhase.FINISHED]
        if not runs:
            return None
        run_id = self.rng.choice(runs)
        engine = self.rng.choice(self.engines)
        kinds = ["cancel", "resolve", "resolve", "resolve", "rediscover", "order"]
        if self.tokens:
            kinds += ["complete", "complete", "complete"]
        what = self.rng.choice(kinds)
        if what == "complete":
            return self._approver(engine)
        if what == "cancel":
            if self.rng.random() < 0.5:  # the cancel flow marks the order cancelled first (a guard reads it)
                self.cancelled_orders.add(run_id)
            self.spawn(f"operator: cancel {run_id}", lambda: _refused_ok(lambda: engine.cancel(run_id)))
        elif what == "order":  # the order's status changes outside (cancelled, or reinstated)
            self.cancelled_orders ^= {run_id}
            self.note(f"the order of {run_id} is {'cancelled' if run_id in self.cancelled_orders else 'reinstated'}")
        elif what == "rediscover":
            self.spawn(f"operator: rediscover {run_id}", lambda: _refused_ok(lambda: engine.rediscover(run_id)))
        else:
            resolution = self._pick_resolution(run_id)
            if resolution is not None:
                self._spawn_resolution(engine, run_id, resolution)

    def _approver(self, engine: Engine) -> None:
        """Someone outside completes a step with a token a callback handed out (decision 32): most often the
        newest, sometimes an older one (a stale link), and now and then a failure instead of a result."""
        run_id, step_id, generation, token = (
            self.tokens[-1] if self.rng.random() < 0.6 else self.rng.choice(self.tokens)
        )
        failing = self.rng.random() < 0.2
        final = failing and self.rng.random() < 0.5
        result = {"approved": True, "step": step_id, "generation": generation}
        error = ErrorInfo(type="Rejected", message="declined by the approver", retryable=not final)

        def complete() -> None:
            try:
                if failing:
                    engine.complete(token, error=error, source="approver")
                else:
                    engine.complete(token, result=result, source="approver")
            except ServerError as exc:
                if exc.status >= 500:
                    raise
                self.cases[f"completion refused ({exc.details.get('code', exc.code)})"] += 1
                return
            self.cases[f"completion taken ({'failure' if failing else 'result'})"] += 1

        self.spawn(f"approver: complete {run_id} {step_id} #{generation}", complete)

    def _spawn_resolution(self, engine: Engine, run_id: str, resolution: Resolve) -> None:
        key = (run_id, resolution.step_id, resolution.phase.value, resolution.generation, resolution.action)
        assert resolution.reason is not None
        self.ground.reasons.add(resolution.reason)

        def resolve() -> None:
            fresh = key not in self.resolved
            self.resolved.add(key)  # before the write that records it: the checker reads it there
            try:
                engine.resolve(run_id, resolution)
            except ServerError as exc:
                if exc.status >= 500:
                    raise  # the write may have landed: the resolution stays counted
                if fresh:
                    self.resolved.discard(key)  # refused: nothing was written
                self.note(f"operator: refused: {exc.code}")
                return
            self.cases[f"operator {resolution.action} accepted"] += 1

        what = f"{resolution.action} {run_id} {resolution.step_id} {resolution.phase.value} #{resolution.generation}"
        self.spawn(f"operator: {what}", resolve)

    def _pick_resolution(self, run_id: str, *, unknown_only: bool = False, held_only: bool = False) -> Resolve | None:
        """An operator's resolution: of an attempt a blocker names (half the time, when one does), or of any
        attempt (most are refused: they are not Unknown, held or blocked); ``unknown_only``: of an Unknown."""
        state = self.store.peek(run_id)
        assert state is not None
        named = [
            (step.id, step.attempt(b.phase, b.generation))
            for b in state.blockers
            if (held := held_step_id(b)) is not None and b.phase is not None and b.generation is not None
            if (step := state.step(held)) is not None
        ]
        attempts = [(step_id, a) for step_id, a in named if a is not None]
        if unknown_only:
            attempts = [
                (step.id, a) for step in state.steps for a in step.attempts if a.status is AttemptStatus.UNKNOWN
            ]
        elif not held_only and (not attempts or self.rng.random() < 0.5):
            attempts = [(step.id, a) for step in state.steps for a in step.attempts]
        if not attempts:
            return None
        step_id, attempt = self.rng.choice(attempts)
        actions = ["retry", "retry", "succeed", "fail"]
        if attempt.phase is Phase.COMPENSATION and attempt.status is AttemptStatus.FENCED:
            actions.append("skip")  # a blocked compensation may be skipped, with a reason (decisions 24)
        if (unknown_only or held_only) and attempt.phase is Phase.FORWARD and state.stop_intent is not None:
            actions = ["succeed", "fail"]  # what the remedy allows: no forward retry after a stop
        action = self.rng.choice(actions)
        self.operator_actions += 1
        return Resolve(
            step_id=step_id,
            phase=attempt.phase,
            generation=attempt.generation,
            action=action,  # type: ignore[arg-type]
            result={"operator": step_id} if action == "succeed" else None,
            error=ErrorInfo(type="declared_failure", message="the operator declared it failed")
            if action == "fail"
            else None,
            reason=f"operator decision {self.operator_actions}",
            by="sim-operator",
        )

    def _release(self) -> None:
        self.releases += 1
        spec, how = workload.variant(self.specs[-1], self.rng, self.releases)
        self.specs.append(spec)
        self.spawn(f"deploy: release r{spec.release} ({how}: {spec.describe()})", lambda: self._sync(spec))

    def _sync(self, spec: workload.WorkflowSpec) -> None:
        self._publish(spec)

    # ---- a whole seed ---------------------------------------------------------------------------------

    def run(self) -> Report:
        report = Report(self.seed, self.profile, self.spec.describe())
        self.note(f"seed {self.seed}: {self.profile}")
        self.note(f"workflow: {self.spec.describe()}")
        try:
            self.start_runs()
            for _ in range(self.profile.chaos_events):
                if not self.step() or self.violations:
                    break
            self.chaos = False
            self.outage_until = None
            self.calm_since = self.now
            for run_id in self.run_ids:
                due = self._due_at(run_id)
                if due is not None and due < self.now:
                    self.overdue_at_calm[run_id] = self.now - due
            self.note("faults end: delivery is fair from here")
            if not self.violations:
                self._settle()
            rounds = 0
            while not self.violations and rounds < 6 and self._operator_round():
                rounds += 1
                self._settle()
            if not self.violations:
                self._remedies_worked()
            if not self.violations:
                self._answers_kept()
            if not self.violations:
                self.check.at_end()
        finally:
            self.kill_all()
        report.events = self.events
        report.faults = self.faults
        report.violations = self.violations
        report.trace = self.trace
        report.effects = sum(self.executions.values())
        report.cases = self.cases + self.check.blockers_seen
        for run_id in self.run_ids:
            state = self.store.peek(run_id)
            assert state is not None
            if state.phase is RunPhase.FINISHED:
                report.outcomes[f"{state.outcome}/{state.recovery}"] += 1
            else:
                report.outcomes["blocked"] += 1
                report.blocked_at_end += 1
        return report

    def _settle(self, max_events: int = 20_000) -> None:
        """Without faults, deliver fairly until every run is finished or waits for a person; the sweeper must
        repair whatever the faults lost.

        Lost work must be redone within 6 hours of fair delivery, or, for work that had already been overdue
        for a long time when delivery became fair (a clock jump, a long outage), within twice that time (the
        sweeper backs off as long as a run's work has been overdue). A run that is not moved by then has
        *stalled*; one with nothing on its way at all (no message, no timer, no check time) stalled *silently*."""
        for _ in range(max_events):
            if self.violations:
                return
            if self.step():
                continue
            if self._all_settled():
                return
            unsettled = self._unsettled()
            due = [
                t
                for t in (self.queue.next_visible_at(), self.timers.next_due_at(), self._endpoint_due_at())
                if t is not None
            ]
            # the sweeper passes every minute: a run's check time comes before a message days away (a lease
            # timer of a step waiting a day for its completion, a durable wait) when what it watches was lost
            checks = [at for r in unsettled if (at := self.store.inner.check_time_of(r)) is not None]
            sweep_at = None
            if checks:
                next_pass = self.now + timedelta(seconds=SWEEP_EVERY_S)
                sweep_at = max(next_pass, min(checks) + timedelta(seconds=SWEEP_GRACE_S + SWEEP_EVERY_S))
            if due and min(due) <= self.now + timedelta(days=2) and (sweep_at is None or min(due) <= sweep_at):
                target = max(self.now, min(due))
            else:  # nothing is on its way before: only the sweeper can find what was lost, at a run's check time
                if sweep_at is None:
                    for run_id in unsettled:
                        self.violation(f"{run_id} stalled silently: {self.check.describe(run_id)}")
                    return
                target = sweep_at
                self.next_sweep = target
            if (stalled := self._stalled_by(target, unsettled)) is not None:
                self.violation(stalled)
                return
            if target > self.now:
                self.advance((target - self.now).total_seconds(), "nothing to do until then")
        self.violation(f"no quiet within {max_events} events: {[self.check.describe(r) for r in self._unsettled()]}")

    def _stalled_by(self, moment: datetime, unsettled: list[str]) -> str | None:
        """Why a run that nothing moves before ``moment`` has stalled by then, or None."""
        fair = moment - self.calm_since
        for run_id in unsettled:
            due = self._due_at(run_id)
            if due is None:
                return f"{run_id} stalled silently: unfinished, no blocker, nothing due: {self.check.describe(run_id)}"
            if moment - due <= STALL:
                continue
            allowed = max(STALL, 2 * self.overdue_at_calm.get(run_id, timedelta(0)))
            if fair > allowed:
                return (
                    f"{run_id} stalled: its work was due at {due}, and after {fair} of fair delivery nothing has done"
                    f" it: {self.check.describe(run_id)}"
                )
        return None

    def _unsettled(self) -> list[str]:
        out = []
        for run_id in self.run_ids:
            state = self.store.peek(run_id)
            assert state is not None
            if state.phase is RunPhase.FINISHED:
                continue
            waits_for_a_person = any(b.type is not BlockerType.ENDPOINT_FAILING for b in state.blockers)
            if waits_for_a_person and self._due_at(run_id) is None:
                continue
            out.append(run_id)
        return out

    def _due_at(self, run_id: str) -> datetime | None:
        """When the run's work other than its probe is due (None: it waits only for a person, or is finished)."""
        state = self.store.peek(run_id)
        assert state is not None
        return state.model_copy(update={"probe_due_at": None}).work_due_at()

    def _endpoint_due_at(self) -> datetime | None:
        """When an endpoint thread next moves on, or an outcome is next posted."""
        moments = [a.wake_at for a in self.actors if a.wake_at is not None]
        moments += [h.due for h in self.held if h.acknowledged is not None]
        return min(moments, default=None)

    def _all_settled(self) -> bool:
        deferred = any(isinstance(m.body, DeferredMessage) for m in self.queue.messages.values())
        posts = any(h.acknowledged is not None for h in self.held)  # every outcome posted is delivered (or refused)
        return (
            not self.actors
            and not deferred
            and not posts
            and len(self.run_ids) == self.profile.runs
            and not self._unsettled()
        )

    def _remedies_worked(self) -> None:
        """After the operator did what each blocker said, no run waits on an Unknown, and none waits on nothing;
        a definition blocker may stay (its remedy is new code, which the operator only guessed at)."""
        for run_id in self.run_ids:
            state = self.store.peek(run_id)
            assert state is not None
            if state.phase is RunPhase.FINISHED:
                continue
            types = {b.type for b in state.blockers}
            if BlockerType.UNKNOWN_OUTCOME in types:
                self.violation(
                    f"{run_id} still waits on an Unknown the operator resolved: {self.check.describe(run_id)}"
                )
            elif not types & DEFINITION_BLOCKERS:
                self.violation(f"{run_id} stalled silently after the remedies: {self.check.describe(run_id)}")

    def _operator_round(self) -> bool:
        """An operator reads each blocked run's blockers and does what their remedies say; False if none.

        An Unknown is resolved. A definition blocker's remedy is new code: first the operator deploys the fix
        (:func:`workload.fixed`), which wakes every run it blocks; in later rounds what the fix cannot move (a
        result over the limit, a compensation no pass reached) is resolved, or the run rediscovered."""
        acted = False
        defined: list[str] = []
        for run_id in self.run_ids:
            state = self.store.peek(run_id)
            assert state is not None
            if state.phase is RunPhase.FINISHED:
                continue
            for blocker in state.blockers:
                if blocker.type is not BlockerType.ENDPOINT_FAILING and not REMEDIES.get(blocker.type):
                    self.violation(f"{run_id}: blocker {blocker.type} names no remedy")
            waiting = [
                t
                for t in self.tokens
                if t[0] == run_id
                and (step := state.step(t[1])) is not None
                and (a := step.attempt(Phase.FORWARD, t[2])) is not None
                and a.waiting_since is not None
                and a.status is AttemptStatus.AUTHORIZED
            ]
            if waiting and self.rng.random() < 0.7:  # the approver gets to it (or the step's timeout fails it)
                acted = True
                self.tokens.append(waiting[-1])
                self._approver(self.engines[0])
            types = {b.type for b in state.blockers}
            if BlockerType.UNKNOWN_OUTCOME in types:
                resolution = self._pick_resolution(run_id, unknown_only=True)
                if resolution is not None:
                    acted = True
                    self._spawn_resolution(self.engines[0], run_id, resolution)
            if types & DEFINITION_BLOCKERS:
                defined.append(run_id)
        if defined and self.fixed_release is None:
            self.releases += 1
            ids = {s.id for spec in self.specs for s in spec.steps}
            self.fixed_release = fix = workload.fixed(self.spec, self.releases, ids)
            self.specs.append(fix)
            self.spawn(f"deploy: release r{fix.release} (the fix: {fix.describe()})", lambda: self._sync(fix))
            return True
        engine = self.engines[0]
        for run_id in defined:
            acted = True
            resolution = self._pick_resolution(run_id, held_only=True)
            if resolution is not None:
                self._spawn_resolution(engine, run_id, resolution)
            else:
                self._spawn_rediscover(engine, run_id)
        return acted

    def _spawn_rediscover(self, engine: Engine, run_id: str) -> None:
        self.spawn(f"operator: rediscover {run_id}", lambda: _refused_ok(lambda: engine.rediscover(run_id)))


def _acknowledges(request: TaskRequest) -> bool:
    """The SDK's own rule, for an endpoint that is not on Lambda."""
    return acknowledges(request, None)


def _fail_before(verdict: str, failure: str, error: type[Exception] = InjectedError) -> None:
    """What a call's verdict does before the call: the process dies, or the call fails with ``failure``."""
    if verdict == "crash_before":
        raise Crash()
    if verdict == "error_before":
        raise error(failure)


def _refused_ok(action: Callable[[], Any]) -> None:
    """An operator action the API refuses (409, 404) changes nothing: that is fine here."""
    try:
        action()
    except ServerError as exc:
        if exc.status >= 500:
            raise


def _describe(body: DispatchMessage) -> str:
    if isinstance(body, TimerMessage):
        return body.timer.name
    if isinstance(body, DeferredMessage):
        return body.deferred.describe()
    if isinstance(body, WakeMessage):
        return body.wake.describe()
    return body.describe()


def _answer_key(run_id: str, event: Any) -> tuple[Any, ...] | None:
    """What identifies an endpoint's answer, however it travels (in hand, deferred, recorded)."""
    if isinstance(event, AttemptReported):
        return (run_id, "attempt", event.step_id, event.phase.value, event.generation)
    if isinstance(event, DiscoveryReported):
        return (run_id, "discovery", event.seq)
    if isinstance(event, InvocationFailed):
        return (run_id, "failed", event.task.describe(), event.failure.value)
    return None


# ---- the world's I/O, each call a boundary ---------------------------------------------------------------


class SimStore:
    """The in-memory store (DynamoDB's semantics), every call a boundary; the checker sees every commit."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.inner = MemoryStore()
        self.committed: dict[str, list[RunState]] = {}
        """Every state of each run as written, oldest first (what a process may still remember)."""
        self.rng = random.Random(f"cache-{sim.seed}")
        """Its own draws, apart from the simulation's: what the process remembers of a run."""
        self.handed_out_of_date: set[tuple[str, int]] = set()
        self.releases_synced: dict[str, list[Release]] = {}
        """Every release synced for each function, oldest first (what a lagging copy may still name)."""
        self.lag_rng = random.Random(f"lag-{sim.seed}")
        """Its own draws: what an eventually consistent read of a release answers."""

    def cached(self, run_id: str) -> RunState | None:
        """What the DynamoDB store's process remembers of the run, at its most out of date: nothing, the newest
        state, or any older state written before (another process wrote since)."""
        states = self.committed.get(run_id)
        draw = self.rng.random()
        if not states or draw < 0.2:
            return None
        if draw < 0.6:
            return states[-1]
        state = self.rng.choice(states)
        if state is not states[-1]:
            self.sim.cases["a result decided on a remembered state out of date"] += 1
            self.handed_out_of_date.add((run_id, state.version))
        return state

    def peek(self, run_id: str) -> RunState | None:
        return self.inner.peek(run_id)

    def _down(self, reading: bool) -> bool:
        sim = self.sim
        if sim.outage_until is None or sim.now >= sim.outage_until:
            return False
        return sim.outage_reads or not reading

    def _read(self, what: str) -> None:
        # what the DynamoDB store raises for a call throttled or failing past botocore's retries
        verdict = self.sim.boundary("store.read", what, READ_FAULTS)
        _fail_before(verdict, f"DynamoDB {what}: ProvisionedThroughputExceeded after retries", StoreUnavailableError)
        if self._down(reading=True):
            raise StoreUnavailableError(f"DynamoDB {what}: throttled (an outage) after retries")

    def _write(self, what: str, commit: Callable[[], None]) -> None:
        verdict = self.sim.boundary("store.write", what, WRITE_FAULTS)
        _fail_before(verdict, f"DynamoDB {what}: throttled after retries", StoreUnavailableError)
        if self._down(reading=False):
            raise StoreUnavailableError(f"DynamoDB {what}: throttled (an outage) after retries")
        commit()
        if verdict == "crash_after":
            raise Crash()
        if verdict == "error_after":
            raise StoreUnavailableError(f"DynamoDB {what}: committed, but the answer was lost after retries")

    def seal_key(self) -> str:
        return self.inner.seal_key()  # read once per process on AWS (cached): not a boundary here

    def get(self, run_id: str) -> RunState | None:
        self._read(f"GetItem {run_id}")
        return self.inner.get(run_id)

    def create(self, state: RunState) -> None:
        def commit() -> None:
            self.inner.create(state)
            self.committed[state.id] = [state]
            self.sim.check.committed(state)

        self._write(f"create {state.id}", commit)

    def save(self, state: RunState, *, expected_version: int) -> None:
        def commit() -> None:
            try:
                self.inner.save(state, expected_version=expected_version)
            except VersionConflictError:
                if (state.id, expected_version) in self.handed_out_of_date:
                    self.sim.cases["a decision on a remembered state out of date: its write refused by the fence"] += 1
                raise
            self.committed[state.id].append(state)
            self.sim.check.committed(state)

        self._write(f"save {state.id} v{expected_version}->v{state.version}", commit)

    def run_for_idempotency_key(self, function_id: str, key: str) -> str | None:
        self._read(f"idempotency key {key}")
        return self.inner.run_for_idempotency_key(function_id, key)

    def list_runs(self, **kwargs: Any) -> RunPage:
        self._read("list runs")
        return self.inner.list_runs(**kwargs)

    def runs_blocked_by_definition(self, function_id: str) -> list[str]:
        self._read("blocked-runs index")
        return self.inner.runs_blocked_by_definition(function_id)

    def runs_to_check(self, before: datetime, limit: int) -> list[str]:
        self._read("runs-to-check index")
        return self.inner.runs_to_check(before, limit)

    def defer_check(self, run_id: str, at: datetime) -> None:
        self._write(f"defer check {run_id}", lambda: self.inner.defer_check(run_id, at))

    def put_release(self, release: Release) -> None:
        def commit() -> None:
            self.inner.put_release(release)
            for function in release.functions:
                self.releases_synced.setdefault(function.id, []).append(release)

        self._write(f"put release {release.release_id}", commit)

    def get_release(self, function_id: str, *, consistent: bool = True) -> Release | None:
        """An eventually consistent read answers from a copy that may lag: a third of them name a release
        synced before the newest (or none yet)."""
        self._read("release")
        synced = self.releases_synced.get(function_id, [])
        if not consistent and synced and self.lag_rng.random() < 1 / 3:
            self.sim.cases["a release read from a lagging copy"] += 1
            return self.lag_rng.choice([None, *synced[:-1]])
        return self.inner.get_release(function_id, consistent=consistent)

    def list_releases(self) -> list[Release]:
        self._read("releases")
        return self.inner.list_releases()


class SimQueue:
    """SQS: at-least-once, any order among visible messages, visibility as the lease timer, a dead-letter queue."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.messages: dict[str, Message] = {}
        self.dead: list[DispatchMessage] = []
        self.watches: dict[str, str] = {}
        """Lease watches parked on the Scheduler (``watch_lease``): key -> the message it delivers."""

    def put(self, body: DispatchMessage, delay_s: float) -> None:
        mid = f"m{next(self.sim.ids)}"
        self.messages[mid] = Message(mid, body, self.sim.now + timedelta(seconds=delay_s))

    def send(self, task: TaskRef, delay_s: float = 0.0, *, app_id: str | None = None) -> None:
        verdict = self.sim.boundary("sqs.send", f"{task.describe()} +{delay_s:.0f}s", SEND_FAULTS)
        _fail_before(verdict, "SQS SendMessage failed after retries")
        if verdict == "lost":
            return
        self.put(task, delay_s + (self.sim.rng.uniform(1, 60) if verdict == "delayed" else 0.0))
        if verdict == "duplicate":
            self.put(task, delay_s)
        if verdict == "crash_after":
            raise Crash()

    def defer(self, answer: DeferredAnswer, delay_s: float = 0.0) -> None:
        verdict = self.sim.boundary("sqs.send", f"{answer.describe()} +{delay_s:.0f}s", DEFER_FAULTS)
        _fail_before(verdict, "SQS SendMessage failed after retries")
        body = DeferredMessage(deferred=answer)
        self.put(body, delay_s + (self.sim.rng.uniform(1, 60) if verdict == "delayed" else 0.0))
        if verdict == "duplicate":
            self.put(body, delay_s)
        if verdict == "crash_after":
            raise Crash()

    def wake(self, order: WakeOrder, delay_s: float = 0.0) -> None:
        verdict = self.sim.boundary("sqs.send", f"{order.describe()} +{delay_s:.0f}s", SEND_FAULTS)
        _fail_before(verdict, "SQS SendMessage failed after retries")
        if verdict == "lost":
            return  # the probe wakes a blocked run in time
        self.put(WakeMessage(wake=order), delay_s + (self.sim.rng.uniform(1, 60) if verdict == "delayed" else 0.0))
        if verdict == "duplicate":
            self.put(WakeMessage(wake=order), delay_s)
        if verdict == "crash_after":
            raise Crash()

    def watch_lease(self, task: TaskRef, at: datetime, *, key: str, app_id: str | None = None) -> bool:
        """A lease watch parked on the Scheduler (``SqsQueue.watch_lease``): delivered to the queue within a minute
        of ``at``, before or after (Scheduler's precision), unless taken back first. A create that failed may have created
        it (its answer lost): the engine then sends an SQS timer as well."""
        verdict = self.sim.boundary("scheduler.create", f"lease watch {key}", LEASE_WATCH_FAULTS)
        if verdict == "crash_before":
            raise Crash()
        if verdict == "error_before":
            return False
        mid = f"m{next(self.sim.ids)}"
        # Scheduler delivers within about a minute of its time (AWS documents a minute's precision): early or late
        due = max(self.sim.now, at + timedelta(seconds=self.sim.rng.uniform(-60, 60)))
        self.messages[mid] = Message(mid, task, due)
        self.watches[key] = mid
        self.sim.cases["lease watches scheduled"] += 1
        if verdict == "crash_after":
            raise Crash()
        return verdict != "error_after"

    def unwatch_lease(self, key: str) -> None:
        """Delete a lease watch's schedule: one not yet delivered is gone; a failed delete is delivered anyway."""
        verdict = self.sim.boundary("scheduler.delete", f"lease watch {key}", ("crash_before", "error_before"))
        if verdict == "crash_before":
            raise Crash()
        if verdict == "error_before":
            return  # logged by the adapter: the watch is delivered, finds its attempt settled, and is done
        mid = self.watches.pop(key, None)
        message = self.messages.get(mid) if mid is not None else None
        if message is not None and message.receives == 0 and message.visible_at > self.sim.now:
            del self.messages[message.id]
            self.sim.cases["lease watches taken back"] += 1

    def change_visibility(self, message: Message, seconds: float) -> None:
        verdict = self.sim.boundary(
            "sqs.change_visibility", f"{message.id} {seconds:.0f}s", ("crash_before", "error_before")
        )
        _fail_before(verdict, "SQS ChangeMessageVisibility failed")
        if message.id in self.messages:
            message.visible_at = self.sim.now + timedelta(seconds=seconds)

    def delete(self, message: Message) -> None:
        verdict = self.sim.boundary("sqs.delete", message.id, ("crash_before", "error_before"))
        if verdict == "crash_before":
            raise Crash()
        if verdict == "error_before":
            return  # the batch's deletion failed: the message comes back (a duplicate delivery)
        self.messages.pop(message.id, None)

    def dead_letter(self, message: Message) -> None:
        self.messages.pop(message.id, None)
        self.dead.append(message.body)
        self.sim.note(f"sqs: {message.id} {_describe(message.body)} moved to the dead-letter queue")

    def visible(self) -> list[Message]:
        now = self.sim.now
        return sorted((m for m in self.messages.values() if m.visible_at <= now), key=lambda m: (m.visible_at, m.id))

    def next_visible_at(self) -> datetime | None:
        return min((m.visible_at for m in self.messages.values()), default=None)


class SimTimers:
    """EventBridge Scheduler: one-time schedules by name, fired at least once, maybe late."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.pending: dict[str, TimerRef] = {}
        self.extra: dict[str, float] = {}

    def schedule(self, timer: TimerRef) -> None:
        verdict = self.sim.boundary("scheduler.create", timer.name, SCHEDULE_FAULTS)
        _fail_before(verdict, "Scheduler CreateSchedule failed after retries")
        if verdict != "lost":
            self.pending[timer.name] = timer
            self.extra.pop(timer.name, None)
        if verdict == "crash_after":
            raise Crash()

    def cancel(self, timer: TimerRef) -> None:
        verdict = self.sim.boundary("scheduler.delete", timer.name, ("crash_before", "error_before"))
        _fail_before(verdict, "Scheduler DeleteSchedule failed after retries")
        self.pending.pop(timer.name, None)

    def _at(self, timer: TimerRef) -> datetime:
        return timer.at + timedelta(seconds=self.extra.get(timer.name, 0.0))

    def due(self) -> list[TimerRef]:
        return sorted((t for t in self.pending.values() if self._at(t) <= self.sim.now), key=lambda t: t.name)

    def fired(self, timer: TimerRef) -> None:
        self.pending.pop(timer.name, None)

    def later(self, timer: TimerRef, seconds: float) -> None:
        self.pending[timer.name] = timer
        self.extra[timer.name] = self.extra.get(timer.name, 0.0) + seconds

    def next_due_at(self) -> datetime | None:
        return min((self._at(t) for t in self.pending.values()), default=None)


class SimLambdaEvents:
    """Lambda's ``Invoke`` with ``InvocationType=Event`` (way C), for releases that announced ``lambda_event``.

    A queued event is an actor of the endpoint's: it first waits in Lambda's queue (the scheduler runs it later),
    then runs as the SDK's ``serve_event`` does: admitted as on the URL (the replay memory every instance shares
    refuses a copy delivered twice), the attempt run on its thread, and its outcome posted to the result endpoint,
    as an acknowledged attempt's is."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.ran: set[str] = set()
        """The signatures of the events that ran (a copy of one must be refused)."""

    @staticmethod
    def arn_of(release: int) -> str:
        return f"arn:aws:lambda:us-east-1:123456789012:function:sim-r{release}"

    def invoke_event(self, function_arn: str, payload: bytes) -> InvokeResult:
        sim = self.sim
        release = int(function_arn.rsplit("-r", 1)[1])
        url = f"https://endpoint.sim/r{release}"
        event = json.loads(payload)
        body = event["body"].encode()
        request = TaskRequest.model_validate_json(body)
        what = f"Invoke {function_arn} {request.kind.value} {request.run_id} {request.step_id or ''}".rstrip()
        # (a dispatcher dying before the Invoke is one dying before any call: the HTTP boundary has it)
        verdict = sim.boundary("lambda.invoke", what, ("crash_after",))
        if verdict == "ok" and sim.chaos and EVENT_FAULTS[0] in sim.profile.kinds and sim.erng.random() < EVENT_RATE:
            verdict = sim.erng.choice(EVENT_FAULTS)  # Lambda's own faults, at a rate of their own
            sim.faults[verdict] += 1
            sim.note(f"  -> {verdict}")
        if verdict == "event_throttled":
            return InvokeResult(kind="unreachable", status=429, detail="injected: Lambda did not queue it")
        if verdict == "event_refused":
            sim.cases["event refused by Lambda: sent to the URL"] += 1
            return InvokeResult(kind="refused", status=403, detail="injected: AccessDeniedException")
        if verdict == "event_lost_not_queued":
            return InvokeResult(kind="lost", status=500, detail="injected: Lambda answered 500, nothing queued")
        op = request.operation
        assert op is not None and request.step_id is not None, "only an attempt goes as an event"
        key = (request.run_id, request.step_id, op.phase.value, op.generation)
        sim.accepted_by_endpoint.add(key)  # Lambda's 202 is the endpoint's "accepted"
        for _ in range(2 if verdict == "event_twice" else 1):
            self._queue(url, event, body, request)
        if verdict == "crash_after":
            raise Crash()
        if verdict == "event_lost_queued":
            sim.cases["event queued, its Invoke's answer lost (Unknown)"] += 1
            return InvokeResult(kind="lost", status=500, detail="injected: Lambda answered 500 after queuing it")
        sim.cases["attempt sent as an event"] += 1
        return InvokeResult(kind="queued", status=202)

    def _queue(self, url: str, event: dict[str, Any], body: bytes, request: TaskRequest) -> None:
        sim = self.sim
        invoker = sim.invoker
        spec = sim.spec_at[url]
        app = invoker.endpoints[url][sim.rng.randrange(len(invoker.endpoints[url]))]
        headers = {k.lower(): v for k, v in event["headers"].items()}
        path = event["rawPath"]
        op = request.operation
        assert op is not None
        name = f"event r{spec.release} [{request.run_id} {request.step_id} {op.phase.value} #{op.generation}]"
        job = Job(request, spec, slow=sim.xrng.random() < 0.6)
        job.accepted = True  # nobody waits for an answer: the outcome is posted

        def run() -> None:
            sim.sleep(round(sim.erng.uniform(0.0, 3.0), 1), "the event waits in Lambda's queue")
            admitted = app._admit("POST", headers, body, path, app.signing_keys)
            if isinstance(admitted, HandlerResponse):
                sim.note(f"  the event was refused before it ran (HTTP {admitted.status})")
                sim.cases[f"event refused by the endpoint (HTTP {admitted.status})"] += 1
                return
            sent, _ = admitted
            resolved = app.memo_cache.resolve(sent)
            assert resolved is not None, "an event carries its whole memo"
            job.request = resolved
            window = ResponseWindow.of(resolved, arrived=time.monotonic(), wall=app.clock())
            signature = headers.get(SIGNATURE_HEADER.lower(), "")
            if signature in self.ran:
                sim.violation(f"a copy of the event for {job.key} ran: the shared replay memory let it through")
            self.ran.add(signature)
            sim.cases["event ran"] += 1
            invoker._work(app, job, sent, window)

        sim.fork(name, run, job)


class SimInvoker:
    """HTTP to the user's endpoint: each release is served at its own URL by two instances.

    An attempt whose request carries ``acknowledge_after_s`` is served as the SDK's threaded endpoint serves it
    (``_serve_acknowledging``), with an actor for the thread: it starts as the request arrives and runs until it
    first has to wait (its callback works, or heartbeats); if it ended by then its outcome is the answer, else the
    answer is a signed ``202 accepted`` and the outcome is posted to the result endpoint when it ends. Heartbeats,
    from either kind of endpoint, go to the engine's ``submit_heartbeat`` as the result endpoint's."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.endpoints: dict[str, list[Any]] = {}
        self.waiting = ServeOptions(heartbeats=self._heartbeat, heartbeats_throttled=False)
        """How an endpoint the dispatcher waits on serves (kept passes, as an app serves by itself)."""
        self.threaded = ServeOptions(kept_passes=False, heartbeats=self._heartbeat, heartbeats_throttled=False)
        """How an acknowledging endpoint runs an attempt on its thread (the simulator's actor)."""
        self.last_accepted: HandlerResponse | None = None
        """The last signed ``accepted`` an endpoint gave (a replay of it is a fault)."""

    def invoke(self, url: str, body: bytes, headers: dict[str, str], *, timeout_s: float) -> InvokeResult:
        sim = self.sim
        request = TaskRequest.model_validate_json(body)
        what = f"POST {url} {request.kind.value} {request.run_id} {request.step_id or ''}".rstrip()
        verdict = sim.boundary("http.request", what, INVOKE_FAULTS)
        if verdict == "crash_before":
            raise Crash()
        if verdict == "unreachable":
            return InvokeResult(kind="unreachable", detail="injected: connection refused")
        if verdict == "bad_gateway":
            return InvokeResult(kind="response", status=502, body=b'{"message": "Bad Gateway"}')
        if verdict == "front_end_throttled":  # a Function URL out of concurrency: 429 before any code runs
            headers = {"x-amzn-ErrorType": "TooManyRequestsException"}
            return InvokeResult(kind="response", status=429, headers=headers, body=b'{"Message":"Rate Exceeded."}')
        apps = self.endpoints[url]
        instance = sim.rng.randrange(len(apps))
        response = self._serve(apps[instance], url, request, headers, body)
        if verdict == "duplicate_request":  # the network delivers the request twice (maybe to the other instance)
            again = self._serve(apps[sim.rng.randrange(len(apps))], url, request, headers, body)
            sim.note(f"  a duplicate of the request got HTTP {again.status}")
        replayed = self.last_accepted
        if request.operation is not None and replayed not in (None, response) and sim.inject("accepted_replayed"):
            assert replayed is not None
            sim.note("  the answer is replaced by the signed accepted another request got")
            response = replayed
        answer = sim.boundary("http.response", f"{what} -> HTTP {response.status}", ANSWER_FAULTS)
        if answer == "crash_after":
            raise Crash()
        if answer == "answer_lost":
            return InvokeResult(kind="lost", detail="injected: the connection dropped before the answer")
        if answer == "bad_gateway_after":
            return InvokeResult(kind="response", status=502, body=b'{"message": "Bad Gateway"}')
        if answer == "answer_late":
            self._hold_late(url, request, response.status, response.body)
            return InvokeResult(kind="timed_out", detail="injected: no answer in time")
        return InvokeResult(kind="response", status=response.status, headers=response.headers, body=response.body)

    def _serve(self, app: Any, url: str, request: TaskRequest, headers: dict[str, str], body: bytes) -> Any:
        spec = self.sim.spec_at[url]
        if _acknowledges(request):
            return self._serve_acknowledging(app, url, spec, headers, body)
        token = SERVING.set((request, spec, None))
        try:
            response = app._serve("POST", headers, body, url_path(url), app.signing_keys, options=self.waiting)
        finally:
            SERVING.reset(token)
        if response.status == 200:
            answered = TaskResponse.model_validate_json(response.body)
            self._together(request.run_id, answered)
            if request.operation is not None and request.step_id is not None:
                self._record(request, spec, answered)
        return response

    def _serve_acknowledging(
        self, app: Any, url: str, spec: workload.WorkflowSpec, headers: dict[str, str], body: bytes
    ) -> HandlerResponse:
        """``Ryusen._serve_acknowledging``, with an actor for the attempt's thread: the outcome is the answer if
        the attempt ended before it had to wait for anything, else the answer is ``accepted``."""
        sim = self.sim
        admitted = app._admit("POST", headers, body, url_path(url), app.signing_keys)
        if isinstance(admitted, HandlerResponse):
            return admitted  # refused (a replayed request, a bad signature): nothing runs
        sent, answering = admitted
        request = app.memo_cache.resolve(sent)
        if request is None:
            return app._reply(200, encode_response(_memo_miss(sent)), answering)  # type: ignore[no-any-return]
        window = ResponseWindow.of(request, arrived=time.monotonic(), wall=app.clock())
        job = Job(request, spec, slow=sim.xrng.random() < 0.6)
        op = request.operation
        assert op is not None
        name = f"endpoint r{spec.release} [{request.run_id} {request.step_id} {op.phase.value} #{op.generation}]"
        sim.fork(name, lambda: self._work(app, job, sent, window), job)
        if job.finished:  # within acknowledge_after_s: answered as any request is
            outcome = job.outcome
            if isinstance(outcome, CallbackInterruptedError):
                return app._error(500, "callback_interrupted", str(outcome), answering)  # type: ignore[no-any-return]
            assert outcome is not None
            sim.cases["acknowledgeable attempt answered inline"] += 1
            self._together(request.run_id, outcome)
            self._record(request, spec, outcome)
            return app._reply(200, encode_response(outcome), answering)  # type: ignore[no-any-return]
        job.accepted = True
        sim.accepted_by_endpoint.add(job.key)
        sim.cases["attempt answered 202 accepted"] += 1
        accepted = TaskResponse(kind=request.kind, run_id=request.run_id, accepted=True)
        response: HandlerResponse = app._reply(202, encode_response(accepted), answering)
        self.last_accepted = response
        return response

    def _work(self, app: Any, job: Job, sent: TaskRequest, window: ResponseWindow) -> None:
        """The endpoint's thread for one attempt: run it, and post its outcome if the answer said ``accepted``."""
        sim = self.sim
        token = SERVING.set((job.request, job.spec, job))
        beating = SINK.set(app._heartbeat_sink(job.request, self.threaded, app.signing_keys))
        outcome: TaskResponse | CallbackInterruptedError | None
        try:
            outcome = app.execute(job.request, sent, options=self.threaded, window=window)
        except CallbackInterruptedError as exc:
            outcome = exc
        except Silent:
            sim.note("  the callback went silent: no heartbeat, no outcome, ever")
            sim.cases["a long step's callback went silent"] += 1
            outcome = None
        finally:
            SINK.reset(beating)
            SERVING.reset(token)
        job.finished, job.outcome = True, outcome
        if job.accepted:
            self._post(app, job)

    def _post(self, app: Any, job: Job) -> None:
        """``Ryusen._deliver_acknowledged``: the outcome, with what the replay found next and the build that found
        it, goes to the result endpoint (an actor of its own, when the scheduler lets it)."""
        sim, outcome = self.sim, job.outcome
        if outcome is None:
            return
        if isinstance(outcome, CallbackInterruptedError) or outcome.attempt is None:
            sim.note(f"  {job.key} was acknowledged and ended with no outcome: its lease will say Unknown")
            return
        self._together(job.request.run_id, outcome)
        self._record(job.request, job.spec, outcome)
        op = job.request.operation
        assert op is not None and job.request.step_id is not None
        late = LateResult(
            run_id=job.request.run_id,
            step_id=job.request.step_id,
            phase=op.phase,
            generation=op.generation,
            attempt=outcome.attempt,
            next=outcome.next,
            build_id=app.build_id if outcome.next is not None else None,
        )
        if sim.inject("post_lost"):
            sim.note(f"  the endpoint dies before it posts the outcome of {job.key}")
            return
        due = sim.now + timedelta(seconds=sim.xrng.uniform(5, 120) if sim.inject("post_delayed") else 0.0)
        times = 2 if sim.inject("post_doubled") else 1
        sim.held.append(Held(b"", {}, times=times, due=due, acknowledged=late))
        sim.note(f"  the outcome of {job.key} ({outcome.attempt.type}) is posted" + (" twice" if times > 1 else ""))

    def _heartbeat(self, beat: Heartbeat, headers: dict[str, str]) -> HeartbeatReply | None:
        """A callback's heartbeat, posted to the result endpoint (its own process: its failure is not the
        caller's); its reply, or None when it did not arrive or its reply was lost."""
        sim = self.sim
        what = f"POST {RESULT_URL} heartbeat {beat.run_id} {beat.step_id} {beat.phase.value} #{beat.generation}"
        verdict = sim.boundary("http.heartbeat", what, HEARTBEAT_FAULTS)
        if verdict == "heartbeat_lost":
            return None
        engine = sim.engines[sim.xrng.randrange(len(sim.engines))]
        try:
            reply = engine.submit_heartbeat(beat.model_dump_json().encode(), headers)
        except Killed:
            raise
        except (Crash, InjectedError, ServerError) as exc:
            sim.note(f"  the heartbeat was not taken ({type(exc).__name__}: {exc})")
            return None
        sim.check.heartbeat_replied(beat, reply)
        sim.cases["heartbeat taken" if reply.current else "heartbeat of an attempt no longer in flight"] += 1
        if verdict == "heartbeat_reply_lost":
            return None
        return reply

    def _together(self, run_id: str, response: TaskResponse) -> None:
        """Steps a pass reported declared together (decision 30), in the order it declared them."""
        for found in (response.discovery, response.next):
            if isinstance(found, StepsReached):
                self.sim.reported.setdefault(run_id, []).append([plan.id for plan in found.steps])
                self.sim.cases["a pass reported steps declared together"] += 1
            elif isinstance(found, StepReached):
                self.sim.reported.setdefault(run_id, []).append([found.step.id])

    def _record(self, request: TaskRequest, spec: workload.WorkflowSpec, response: TaskResponse) -> None:
        """What the endpoint answered to an attempt, and what the code that answered says about its step."""
        outcome = response.attempt
        if outcome is None or request.operation is None or request.step_id is None:
            return
        step = spec.step_spec(request.step_id)
        answer = Answer(
            type=outcome.type,
            reason=getattr(outcome, "reason", None),
            omitted=getattr(outcome, "omitted", None) is not None
            or (
                outcome.type == "succeeded"
                and value_size(getattr(outcome, "result", None)) > self.sim.settings.max_value_bytes
            ),
            nested=getattr(outcome, "error", None) is not None and outcome.error.type == NESTED_STEP_ERROR,  # type: ignore[union-attr]
            build=f"b{spec.release}",
            declares_no_compensator=step is not None and not step.compensate,
            retires=request.step_id in spec.retired,
        )
        phase = request.operation.phase.value
        self.sim.ground.answers[(request.run_id, request.step_id, phase, request.operation.generation)].append(answer)
        case = {
            "failed": "opened a step inside the callback" if answer.nested else None,
            "succeeded": None
            if not answer.omitted
            else "returned too much (the SDK omitted it)"
            if getattr(outcome, "omitted", None) is not None
            else "returned too much (over the server's limit)",
            "target_not_found": f"target not found ({answer.reason})",
        }.get(outcome.type)
        if case is not None:
            self.sim.cases[f"{phase}: {case}"] += 1

    def _hold_late(self, url: str, request: TaskRequest, status: int, body: bytes) -> None:
        """The SDK, past ``respond_by``, submits its answer to the result endpoint (once, or twice)."""
        if status != 200 or request.operation is None or request.step_id is None:
            return
        answer = TaskResponse.model_validate_json(body)
        if answer.attempt is None or answer.attempt.type not in ("succeeded", "failed"):
            return  # only a callback's outcome is submitted late (a conflict ran nothing)
        late = LateResult.model_validate(
            {
                "run_id": request.run_id,
                "step_id": request.step_id,
                "phase": request.operation.phase,
                "generation": request.operation.generation,
                "attempt": answer.attempt.model_dump(),
            }
        )
        payload = late.model_dump_json().encode()
        key = app_key(self.sim.master, workload.APP_ID)
        scope = late_result_scope(late, path="/v1/results", app_id=workload.APP_ID)
        nonce = f"{self.sim.rng.getrandbits(128):032x}"
        header = sign(key, scope, payload, now=time.time(), nonce=nonce)
        self.sim.held.append(Held(payload, {SIGNATURE_HEADER: header}, times=self.sim.rng.choice([1, 1, 2])))

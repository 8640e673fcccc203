"""The wire protocol between the Ryusen server and an app's endpoint.

Shared by the SDK and the server: one set of pydantic models, so both sides
agree on every field. Success and failure are explicit variants (a ``type``
discriminator), never an exception to emulate (RFD 1, checklist F10).

A task request asks the endpoint to do one of three things:

* ``discover``: run the function with the memo of recorded step outcomes and
  report what happened next (a step to execute, completion, an uncaught
  failure, or a definition conflict).
* ``forward``: replay up to one step and execute its callback.
* ``compensate``: replay up to one completed step and execute its compensator
  with the recorded forward result.
"""

from __future__ import annotations

import base64
import json
import math
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from .signing import Scope

PROTOCOL_VERSION = "1"
FEATURES_HEADER = "X-Ryusen-Features"
"""Sent with the manifest: what this SDK understands beyond protocol 1's first form (comma-separated).
A header, so that a server that predates it ignores it, and a request field the SDK did not announce is
never sent to it (its wire models refuse unknown fields)."""
SDK_FEATURES = (
    "continuation",
    "memo_cache",
    "signing_v2",
    "omitted_results",
    "respond_within",
    "acknowledge",
    "heartbeat",
    "tracebacks",
    "external_completion",
    "parallel_steps",
)
"""``continuation``: a forward request may carry ``continue_after``, and its response ``next``.
``memo_cache``: a request may carry ``memo_token`` and ``memo_base``, and its response ``memo_miss``.
``signing_v2``: messages are signed as decisions 21 says (``signing.py``): per-app keys with key ids, the
scope of each message signed, answers bound to their request, replays refused. A server sends nothing to a
release that does not announce it.
``omitted_results``: a compensation request may carry ``forward_result_omitted`` (decisions 25).
``respond_within``: a request may carry ``respond_within_s``, the time the endpoint has, which it counts on its
own clock from when the request arrived (``respond_by`` alone is read on the endpoint's clock: a skew error).
``acknowledge``: an attempt's request may carry ``acknowledge_after_s``; an endpoint whose callback is still
running then answers ``accepted`` (the dispatcher stops waiting) and delivers the outcome, with what the replay
found next, to the result URL (``docs/design/dispatch.md``).
``heartbeat``: a step's plan may carry ``heartbeat_s``, and a callback posts heartbeats to the result URL.
``tracebacks``: a request may carry ``tracebacks``; an error the endpoint then reports may carry its
``traceback`` (an error without one is sent as before).
``external_completion``: a step's plan may say ``completion: "external"``, and an attempt's operation may carry
its ``completion_token`` (decision 32).
``parallel_steps``: a request may carry ``parallel_steps``; a discovery pass the endpoint then answers may report
several steps declared together (``StepsReached``, decision 30). Without it, they are reported one at a time.

One more is announced only where it holds, with a value: ``lambda_event=<function ARN>`` (``LAMBDA_EVENT``), from an
app served by ``lambda_handler`` whose replay memory every container shares (``RYUSEN_REPLAY_TABLE``). The server
may then invoke that function with an attempt's request as an asynchronous event (``InvocationType=Event``) instead
of waiting on its URL; the handler runs the attempt and posts the outcome, with what the replay found next, to the
result URL before it returns (way C of ``docs/design/dispatch.md``). A copy of the event delivered again (Lambda's
own retries, or its queue's duplicates) is refused by the shared replay memory before it runs anything."""
LAMBDA_EVENT = "lambda_event"
"""The feature a Lambda endpoint announces as ``lambda_event=<ARN>``: it takes attempts as asynchronous events."""
LAMBDA_FUNCTION_ARN = r"arn:aws[a-z-]*:lambda:[a-z0-9-]+:\d{12}:function:[A-Za-z0-9_-]{1,64}(:[A-Za-z0-9$_-]{1,128})?"
"""A Lambda function's ARN, with its version or alias if it names one (what ``lambda_event=`` may carry)."""
LAMBDA_EVENT_MARKER = "ryusen_task_event"
"""The key that marks an asynchronous event carrying a task request (its value is 1), beside the fields of a
Function URL event (``headers``, ``body``, ``rawPath``): what the handler would have been sent on its URL."""
MAX_WAIT_S = 366 * 24 * 3600.0
"""The longest durable wait a step may declare (decision 31): a year."""
MAX_VALUE_BYTES = 256 * 1024
"""Default limit for run input, step results, errors and run output (serialized JSON)."""
ERROR_MESSAGE_KEPT = 8 * 1024
"""How much of an oversized error's message is kept (the rest is cut, and the error says so)."""


DIAGNOSTIC_LIMIT = 2048
DIAGNOSTIC_KEPT = 1024
"""Display names, source locations and detail texts over the limit keep their first characters and say they were cut."""


def _cut(text: str) -> str:
    """Diagnostic text bounded to :data:`DIAGNOSTIC_LIMIT` characters, with a note when cut (never cut twice).

    >>> _cut("short")
    'short'
    >>> cut = _cut("n" * 5000)
    >>> len(cut) < 1100, cut.endswith("[cut: it was 5000 characters]"), _cut(cut) == cut
    (True, True, True)
    """
    if len(text) <= DIAGNOSTIC_LIMIT:
        return text
    return f"{text[:DIAGNOSTIC_KEPT]} [cut: it was {len(text)} characters]"


DiagnosticText = Annotated[str, AfterValidator(_cut)]
"""Text shown to people (names, locations, details): never a reason to refuse a response, never unbounded."""


MAX_VALUE_DEPTH = 128
"""How deeply a JSON value may nest (arrays and objects): far beyond real data, and far enough inside the
limits of the JSON parsers the server and DynamoDB's items pass through that a value stored is always read."""


def json_value_problem(value: Any, max_depth: int = MAX_VALUE_DEPTH) -> str | None:
    """Why a parsed JSON value cannot be accepted, or None: nested deeper than ``max_depth``, a NaN or
    infinity (which JSON does not have, and which would otherwise become null), invalid Unicode (a lone
    surrogate, which cannot be stored), a key that is not a string, or a type that is not JSON.

    >>> json_value_problem({"a": [1, 2.5, "x", None, True]}) is None
    True
    >>> json_value_problem([[[1]]], max_depth=2)
    'nested deeper than 2 levels'
    >>> json_value_problem({"n": float("nan")})
    'contains NaN or Infinity, which JSON does not have'
    >>> json_value_problem("a" + chr(0xD800))
    'contains invalid Unicode (a lone surrogate)'
    """
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and not _valid_text(item):
                return "contains invalid Unicode (a lone surrogate)"
        elif isinstance(item, bool) or item is None or isinstance(item, int):
            continue
        elif isinstance(item, float):
            if not math.isfinite(item):
                return "contains NaN or Infinity, which JSON does not have"
        elif isinstance(item, dict):
            if depth >= max_depth:
                return f"nested deeper than {max_depth} levels"
            for key, child in item.items():
                if not isinstance(key, str):
                    return "has an object key that is not a string"
                stack.append((key, depth + 1))
                stack.append((child, depth + 1))
        elif isinstance(item, list):
            if depth >= max_depth:
                return f"nested deeper than {max_depth} levels"
            stack.extend((child, depth + 1) for child in item)
        else:
            return f"contains a {type(item).__name__}, which is not JSON"
    return None


def _valid_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def loads_strict(text: str | bytes, max_depth: int = MAX_VALUE_DEPTH) -> Any:
    """Parse JSON as the server accepts it: ``ValueError`` with a message fit to show for anything
    :func:`json_value_problem` refuses, for NaN and Infinity literals, and for nesting too deep to parse."""

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        value = json.loads(text, parse_constant=constant)
    except RecursionError:
        raise ValueError(f"nested deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    problem = json_value_problem(value, max_depth)
    if problem is not None:
        raise ValueError(problem)
    return value


def value_size(value: Any) -> int:
    """A JSON value's size as the limits count it: compact ``json.dumps``, UTF-8 bytes."""
    return len(json.dumps(value, separators=(",", ":")).encode())


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Phase(StrEnum):
    FORWARD = "forward"
    COMPENSATION = "compensation"


class TaskKind(StrEnum):
    DISCOVER = "discover"
    FORWARD = "forward"
    COMPENSATE = "compensate"


MAX_FRAMES = 40
"""A traceback keeps at most this many frames: the outermost 10 and the innermost 30."""
FRAME_TEXT_LIMIT = 300
"""Each frame's file, function and source line keep this many characters."""


class Frame(_Wire):
    """One frame of a traceback: where, never what was in it (no locals)."""

    file: str = Field(max_length=FRAME_TEXT_LIMIT)
    line: int | None = None
    function: str = Field(max_length=FRAME_TEXT_LIMIT)
    code: str | None = Field(default=None, max_length=FRAME_TEXT_LIMIT)
    """The source line, as the file read when the error was reported."""


class Traceback(_Wire):
    """Where an exception was raised: its frames in the user's code, outermost first. Frames inside Ryusen's
    SDK are left out, and so are the middle frames of a deep stack; ``omitted`` counts both."""

    frames: list[Frame] = Field(max_length=MAX_FRAMES)
    omitted: int = Field(default=0, ge=0)


class ErrorInfo(_Wire):
    """A structured error: the error's type name, message and optional JSON data; and, from an SDK that
    reports them, where it was raised (``traceback``)."""

    type: str
    message: str
    data: Any = None
    retryable: bool = True
    traceback: Traceback | None = None

    @model_serializer(mode="wrap")
    def _without_missing_traceback(self, handler: SerializerFunctionWrapHandler) -> Any:
        # an error without a traceback is written as before it existed: a reader that predates the field (an
        # older server or SDK, whose wire models refuse unknown fields) reads it, and stored runs keep their size
        dumped = handler(self)
        if isinstance(dumped, dict) and dumped.get("traceback", ...) is None:
            del dumped["traceback"]
        return dumped

    def bounded(self, limit: int = MAX_VALUE_BYTES) -> ErrorInfo:
        """This error, or, when it is over ``limit`` serialized, a copy that says what was cut.

        The type and retryability are kept; ``data`` is dropped and the message
        cut to its first :data:`ERROR_MESSAGE_KEPT` characters, followed by a
        note with the original size, so nothing is lost without a trace.

        >>> big = ErrorInfo(type="ValueError", message="x" * 300_000)
        >>> cut = big.bounded()
        >>> cut.type, len(cut.message) < 9000, "was 300" in cut.message
        ('ValueError', True, True)
        """
        size = value_size(self.model_dump(mode="json"))
        if size <= limit:
            return self
        if self.traceback is not None:  # where it was raised goes first
            return self.model_copy(update={"traceback": None}).bounded(limit)
        note = f" [error cut: it was {size} bytes serialized, over the {limit}-byte limit; data dropped]"
        kept = min(ERROR_MESSAGE_KEPT, max(256, limit // 2))
        return ErrorInfo(type=self.type[:256], message=self.message[:kept] + note, data=None, retryable=self.retryable)


class OmittedValue(_Wire):
    """A value a callback returned that was over the limit, so it was not recorded (decisions 25): its size and
    the SHA-256 of its compact JSON, so that it can still be told apart and checked against a copy."""

    size: int = Field(ge=0)
    sha256: str = Field(min_length=64, max_length=64)
    limit: int = Field(ge=0)


class OperationInfo(_Wire):
    id: str
    phase: Phase
    generation: int
    completion_token: str | None = None
    """``external_completion``: the token that completes this attempt from outside (decision 32)."""

    @model_serializer(mode="wrap")
    def _as_before(self, handler: SerializerFunctionWrapHandler) -> Any:
        dumped = handler(self)  # no token: written as before (an SDK that predates it reads it)
        if isinstance(dumped, dict) and dumped.get("completion_token", ...) is None:
            del dumped["completion_token"]
        return dumped


class MemoEntry(_Wire):
    """A recorded outcome of one step, replayed to the function by ``step.run``."""

    status: Literal["completed", "failed"]
    result: Any = None
    error: ErrorInfo | None = None


class MemoBase(_Wire):
    """The memo a request's ``memo`` extends (``memo_cache``): the whole memo is that one's entries, less
    ``removed``, with ``memo``'s added or replacing them; it has ``count`` entries. Its input is that memo's."""

    token: str = Field(min_length=1, max_length=64)
    removed: list[str] = Field(default_factory=list)
    count: int = Field(ge=0)


class RetryPolicyWire(_Wire):
    max_attempts: int = Field(ge=1, le=1000)
    initial_delay_s: float = Field(ge=0)
    backoff: float = Field(ge=1.0)
    max_delay_s: float = Field(ge=0)
    on_unknown: Literal["block", "retry"] = "block"


class StepPlan(_Wire):
    """What discovery learned about a step the function reached."""

    id: str = Field(min_length=1, max_length=256)
    name: DiagnosticText | None = None
    location: DiagnosticText | None = None
    has_compensation: bool = False
    retry: RetryPolicyWire | None = None
    compensate_retry: RetryPolicyWire | None = None
    timeout_s: float | None = Field(default=None, gt=0)
    compensate_timeout_s: float | None = Field(default=None, gt=0)
    heartbeat_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Decision 33: the longest an attempt of this step may go without a heartbeat before it is Unknown."""
    sleep: bool = False
    """Decision 31: a durable wait (``step.sleep``), with no callback: the server completes it at its due time."""
    not_before: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """Decision 31: the step's first attempt starts no earlier than this Unix time."""
    not_before_s: float | None = Field(default=None, ge=0, le=MAX_WAIT_S, allow_inf_nan=False)
    """Decision 31: ... no earlier than this many seconds after the server first records the step."""
    completion: Literal["callback", "external"] = "callback"
    """Decision 32: ``external``: the callback hands out the attempt's completion token, and the step's result
    comes from outside (``POST /v1/completions/{token}``), within the step's timeout."""

    @model_serializer(mode="wrap")
    def _as_before(self, handler: SerializerFunctionWrapHandler) -> Any:
        # a plan without a wait is written as before waits existed: a server that predates them reads it
        dumped = handler(self)
        if isinstance(dumped, dict):
            for name, unset in (
                ("sleep", False),
                ("not_before", None),
                ("not_before_s", None),
                ("completion", "callback"),
            ):
                if dumped.get(name, unset) == unset and name in dumped:
                    del dumped[name]
        return dumped


class Occurrence(_Wire):
    """Where a step was called: its id (when it differs from the conflict's), source location and display name."""

    step_id: str | None = None
    location: DiagnosticText | None = None
    name: DiagnosticText | None = None


class DuplicateStepConflict(_Wire):
    """The same step id twice in one pass, found before the second callback could run (D1)."""

    code: Literal["duplicate_step_id"] = "duplicate_step_id"
    step_id: str
    first: Occurrence
    duplicate: Occurrence


class ConcurrentStepConflict(_Wire):
    """A second ``step.run`` opened while ``first`` was still open (decisions 18): one step at a time."""

    code: Literal["concurrent_step"] = "concurrent_step"
    first: Occurrence
    second: Occurrence


class NewStepBeforeTarget(_Wire):
    """A compensation pass met ``first``, a step with no recorded outcome, before its target ``step_id`` (17)."""

    code: Literal["new_step_before_target"] = "new_step_before_target"
    step_id: str
    first: Occurrence


class OutputTooLarge(_Wire):
    """The function returned an output over the value limit (decisions 20): a blocker, never a failure."""

    code: Literal["output_too_large"] = "output_too_large"
    size: int
    limit: int


class OutputNotJson(_Wire):
    """The function returned a value that is not JSON (a ``datetime``, a ``set``, invalid Unicode)."""

    code: Literal["output_not_json"] = "output_not_json"
    message: DiagnosticText


class InvalidStep(_Wire):
    """A ``step.run`` the server cannot record (an id over 256 characters, a timeout that is not positive)."""

    code: Literal["invalid_step"] = "invalid_step"
    step_id: DiagnosticText
    location: DiagnosticText | None = None
    message: DiagnosticText


NESTED_STEP_ERROR = "concurrent_step"
"""The error type of an attempt whose callback opened a step and let the refusal escape (decisions 23); its
``data`` is the :class:`ConcurrentStepConflict` (the step whose callback ran, and the step it opened)."""


def nested_step_conflict(error: ErrorInfo | None) -> ConcurrentStepConflict | None:
    """The conflict an attempt's error reports when its callback opened a step (decisions 23), else None."""
    if error is None or error.type != NESTED_STEP_ERROR or not isinstance(error.data, dict):
        return None
    try:
        return ConcurrentStepConflict.model_validate({k: v for k, v in error.data.items() if k != "build_id"})
    except ValueError:
        return None


def nested_step_build(error: ErrorInfo | None) -> str | None:
    """The build whose callback opened a step, as the endpoint reported it with the refusal (decisions 23)."""
    data = error.data if error is not None and error.type == NESTED_STEP_ERROR else None
    build = data.get("build_id") if isinstance(data, dict) else None
    return build if isinstance(build, str) else None


DefinitionConflict = Annotated[
    DuplicateStepConflict | ConcurrentStepConflict | NewStepBeforeTarget | OutputTooLarge | OutputNotJson | InvalidStep,
    Field(discriminator="code"),
]
"""What current code got wrong in a pass: recoverable by a release, the probe or an operator, never a failure."""


class TaskRequest(_Wire):
    protocol: str = PROTOCOL_VERSION
    kind: TaskKind
    run_id: str
    function_id: str
    input: Any = None
    memo: dict[str, MemoEntry] = Field(default_factory=dict)
    step_id: str | None = None
    operation: OperationInfo | None = None
    forward_result: Any = None
    forward_result_omitted: OmittedValue | None = None
    """``omitted_results``: the forward result was over the limit and not recorded; the compensator receives
    an ``OmittedResult`` with its size and digest in place of the value (decisions 25)."""
    result_url: str | None = None
    """Where to submit a result that could not be returned in the response (decisions 6.15)."""
    respond_by: float | None = None
    """Unix time after which the server no longer waits for the HTTP response (on the server's clock)."""
    respond_within_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """``respond_within``: how many seconds after the server sent this request it stops waiting for the HTTP
    response (``respond_by``, as a span). The endpoint counts it on its own monotonic clock from when the request
    arrived, so a wall clock that disagrees with the server's does not move it."""
    continue_after: bool = False
    """Forward: after the callback succeeds, keep replaying with its result, up to the next step with no
    recorded outcome (without running it), the function's end, or a conflict; report that as ``next``."""
    memo_token: str | None = Field(default=None, min_length=1, max_length=64)
    """``memo_cache``: the name the server gave this request's whole memo and input. An endpoint may keep
    them under it, for a later request of the same run to extend (``memo_base``)."""
    acknowledge_after_s: float | None = Field(default=None, ge=0, le=900, allow_inf_nan=False)
    """``acknowledge``: an attempt whose callback has not finished this many seconds after the request arrived
    is answered ``accepted`` at once, and its outcome goes to ``result_url`` when the callback ends."""
    tracebacks: bool = False
    """``tracebacks``: report where an error was raised (``ErrorInfo.traceback``)."""
    parallel_steps: bool = False
    """``parallel_steps``: the server runs steps declared together concurrently; a pass may report them all
    (``StepsReached``)."""
    memo_base: MemoBase | None = None
    """``memo_cache``: ``memo`` holds only what changed since the memo named ``memo_base.token``, and
    ``input`` is not sent. An endpoint that does not hold that memo runs nothing and answers ``memo_miss``;
    the server then sends the whole memo."""


def task_scope(request: TaskRequest, *, path: str, app_id: str) -> Scope:
    """The signature scope of a task request sent to ``path`` of app ``app_id``: the run it is about, and for
    an attempt its step, phase and generation (:meth:`Scope.answer` for the answer's)."""
    operation = request.operation
    return Scope(
        direction="request",
        method="POST",
        path=path,
        app_id=app_id,
        run_id=request.run_id,
        step_id=request.step_id or "",
        phase=str(operation.phase) if operation is not None else "",
        generation=str(operation.generation) if operation is not None else "",
    )


def received_task_scope(body: bytes, *, path: str, app_id: str) -> Scope:
    """The scope a received task request names, read from its JSON as it arrived (before it is validated, so
    that a request the SDK cannot parse is still told apart: signed, it is refused with a signed answer; not
    signed, it is refused as unsigned). For a well-formed request it equals :func:`task_scope`."""
    raw: Any
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError):
        raw = None
    raw = raw if isinstance(raw, dict) else {}
    operation: Any = raw.get("operation") if isinstance(raw.get("operation"), dict) else {}

    def text(value: Any) -> str:
        return value if isinstance(value, str) else "" if value is None else json.dumps(value)

    return Scope(
        direction="request",
        method="POST",
        path=path,
        app_id=app_id,
        run_id=text(raw.get("run_id")),
        step_id=text(raw.get("step_id")),
        phase=text(operation.get("phase")),
        generation=text(operation.get("generation")),
    )


def heartbeat_scope(beat: Heartbeat, *, path: str, app_id: str) -> Scope:
    """The signature scope of a heartbeat posted to ``path`` (the result URL's): a late result's, marked as a
    heartbeat, so that neither can stand for the other."""
    return _posted_scope(beat, path=path, app_id=app_id, extra="heartbeat")


def late_result_scope(late: LateResult, *, path: str, app_id: str) -> Scope:
    """The signature scope of a late result posted to ``path`` (the result URL's) about app ``app_id``'s run."""
    return _posted_scope(late, path=path, app_id=app_id)


def completion_scope(post: CompletionPost, *, path: str, app_id: str) -> Scope:
    """The signature scope of an app's completion posted to ``path`` (the result URL's): the attempt its token
    names, marked as a completion, so that it stands for no late result or heartbeat."""
    return _posted_scope(post, path=path, app_id=app_id, extra="completion")


def _posted_scope(posted: LateResult | Heartbeat | CompletionPost, *, path: str, app_id: str, extra: str = "") -> Scope:
    """What an SDK's unasked post about one attempt is signed for: the attempt, at ``path``."""
    return Scope(
        direction="request",
        method="POST",
        path=path,
        app_id=app_id,
        run_id=posted.run_id,
        step_id=posted.step_id,
        phase=str(posted.phase),
        generation=str(posted.generation),
        extra=extra,
    )


FEATURE_FIELDS = (
    "continue_after",
    "memo_token",
    "memo_base",
    "forward_result_omitted",
    "respond_within_s",
    "acknowledge_after_s",
    "tracebacks",
    "parallel_steps",
)
"""Request fields an SDK understands only if it announced their feature: sent only when set."""


def encode_request(request: TaskRequest) -> bytes:
    """A request as JSON, without the feature fields it does not use (an older SDK refuses unknown fields)."""
    unused = {name for name in FEATURE_FIELDS if getattr(request, name) in (None, False)}  # a 0 s budget is sent
    return request.model_dump_json(exclude=unused or None).encode()


# ---- responses -------------------------------------------------------------


class StepReached(_Wire):
    type: Literal["step"] = "step"
    step: StepPlan


DEFAULT_MAX_PARALLEL = 10
MAX_PARALLEL_LIMIT = 100
"""The most siblings a function may have in flight at once (``max_parallel``)."""
MAX_SIBLINGS = 10_000
"""The most steps one pass may declare together."""


class StepsReached(_Wire):
    """Decision 30: steps declared together (their awaitables existed before the function awaited any of them),
    in declaration order, with no recorded outcome. The server runs up to ``max_parallel`` of them at once."""

    type: Literal["steps"] = "steps"
    steps: list[StepPlan] = Field(min_length=2, max_length=MAX_SIBLINGS)
    max_parallel: int = Field(default=DEFAULT_MAX_PARALLEL, ge=1, le=MAX_PARALLEL_LIMIT)


class FunctionCompleted(_Wire):
    type: Literal["completed"] = "completed"
    output: Any = None


class FunctionFailed(_Wire):
    type: Literal["failed"] = "failed"
    error: ErrorInfo


class ConflictFound(_Wire):
    type: Literal["conflict"] = "conflict"
    conflict: DefinitionConflict


class FunctionNotFound(_Wire):
    """The endpoint's current code has no such function (it was removed or renamed)."""

    type: Literal["function_not_found"] = "function_not_found"
    detail: DiagnosticText = ""


DiscoveryResponse = Annotated[
    StepReached | StepsReached | FunctionCompleted | FunctionFailed | ConflictFound | FunctionNotFound,
    Field(discriminator="type"),
]


class CallbackSucceeded(_Wire):
    type: Literal["succeeded"] = "succeeded"
    result: Any = None
    omitted: OmittedValue | None = None
    """The callback returned a value over the limit (``result`` is then null): it ran, so the step is neither
    failed nor retried; the server blocks the run (decisions 25). Left out of the JSON when unset, so a server
    that predates it still reads every other success."""

    @model_serializer(mode="wrap")
    def _without_unset_omitted(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict) and data.get("omitted") is None:
            data.pop("omitted", None)
        return data


class CallbackFailed(_Wire):
    type: Literal["failed"] = "failed"
    error: ErrorInfo


class TargetNotFound(_Wire):
    """The target callback was not entered in this pass (decisions 16), and current code does not call it.

    Forward: the pass ended, or met another new step, before the target. Compensation: the target declares
    no compensator (a durable skip), or the function ended without meeting the target (a skip only if it
    retires the target's id; otherwise the unwind blocks: decisions 24).
    """

    type: Literal["target_not_found"] = "target_not_found"
    detail: DiagnosticText = ""
    reason: Literal["not_reached", "no_compensator", "retired"] = "not_reached"
    """``no_compensator``: current code reaches the compensation target and declares no compensator.
    ``retired``: the pass did not reach the target, and the function declares its id retired (decisions 24).
    ``not_reached``: the pass ended without reaching the target, which proves nothing about it."""


class ReplayFailed(_Wire):
    """Code outside ``step.run`` raised before the pass reached its target; the target callback did not run."""

    type: Literal["replay_failed"] = "replay_failed"
    error: ErrorInfo


AttemptResponse = Annotated[
    CallbackSucceeded | CallbackFailed | TargetNotFound | ReplayFailed | ConflictFound | FunctionNotFound,
    Field(discriminator="type"),
]


class TaskResponse(_Wire):
    """The body an endpoint returns for a task request."""

    protocol: str = PROTOCOL_VERSION
    kind: TaskKind
    run_id: str
    discovery: DiscoveryResponse | None = None
    attempt: AttemptResponse | None = None
    next: DiscoveryResponse | None = None
    """What the replay found after a successful callback (``continue_after``): repeatable orchestration,
    like a discovery pass, so nothing in it ran an effect."""
    memo_miss: str | None = Field(default=None, min_length=1, max_length=64)
    """``memo_cache``: the token of the memo the request extends (``memo_base``), which this endpoint does not
    hold; nothing ran, and ``discovery`` and ``attempt`` are empty. The server sends that request again with
    the whole memo (and takes a miss naming another memo as no answer at all)."""
    accepted: bool = False
    """``acknowledge``: the attempt's callback is running and its outcome will be posted to the result URL;
    ``attempt`` and ``next`` are empty. The server stops waiting: the attempt's lease notices silence."""


class LateResult(_Wire):
    """An attempt's outcome posted to the server's result endpoint: after the response window closed (a late
    result), or after the endpoint acknowledged the task (``accepted``)."""

    run_id: str
    step_id: str
    phase: Phase
    generation: int
    attempt: AttemptResponse
    """A late result carries a callback's outcome; an acknowledged attempt's may carry any attempt outcome (its
    replay may also have ended before the callback, or without reaching it)."""
    next: DiscoveryResponse | None = None
    """What the replay found after a successful forward callback (``continue_after``), as a response's ``next``;
    the server uses it only when ``build_id`` is the build it would run next (R1)."""
    build_id: str | None = Field(default=None, max_length=256)
    """The build that found ``next``."""


MAX_HEARTBEAT_DETAILS_BYTES = 4096
"""The largest heartbeat ``details`` the server keeps (serialized); larger ones are refused."""


class Heartbeat(_Wire):
    """A running callback's heartbeat (decision 33), posted to the result URL: the attempt is alive, and
    ``details`` (JSON, e.g. ``{"progress": 0.4}``) is shown on it."""

    kind: Literal["heartbeat"] = "heartbeat"
    run_id: str
    step_id: str
    phase: Phase
    generation: int
    seq: int = Field(ge=1, le=2**53)
    """Counts the attempt's posted heartbeats from 1: the server takes each once, in order, so a heartbeat sent
    again (a retry, or a replay by whoever captured it) extends nothing."""
    details: Any = None


class CompletionPost(_Wire):
    """Decision 32: a step's completion posted by the app itself to the result URL, signed with the app's key (the
    other way in is ``POST /v1/completions/{token}`` on the operator API). The token's attempt is named again, so
    that the signature covers it; ``error`` fails the attempt, else ``result`` completes it."""

    kind: Literal["completion"] = "completion"
    run_id: str
    step_id: str
    phase: Phase
    generation: int
    token: str = Field(min_length=1, max_length=2048)
    result: Any = None
    error: ErrorInfo | None = None


COMPLETION_TOKEN_PREFIX = "rc1"  # noqa: S105 - a format's name, not a secret


def completion_binding(token: str) -> tuple[str, str, Phase, int] | None:
    """The attempt a completion token claims to name (not proven: only the server can check its MAC), or None for
    a string of no such form."""
    parts = token.split(".")
    if len(token) > 2048 or len(parts) != 3 or parts[0] != COMPLETION_TOKEN_PREFIX:
        return None
    try:
        named = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
        run_id, step_id, phase, generation = named
        if not (isinstance(run_id, str) and isinstance(step_id, str) and isinstance(generation, int)):
            return None
        return run_id, step_id, Phase(phase), generation
    except (ValueError, TypeError):
        return None


class HeartbeatReply(_Wire):
    """The server's answer to a heartbeat."""

    current: bool
    """The attempt is still the one in flight (False: it was settled, replaced or declared Unknown)."""
    stop_requested: Literal["cancel", "timeout"] | None = None
    """A stop intent was recorded while this forward attempt ran: the callback should finish or clean up."""
    lease_expires_at: float | None = None
    """When the attempt is Unknown without another heartbeat (seconds since the epoch, the server's clock)."""


# ---- manifest --------------------------------------------------------------


MAX_ID_LENGTH = 256
"""The longest app or function id (a store key holds it, with room to spare under DynamoDB's 2 KB)."""
MAX_RUN_TIMEOUT_S = 10 * 366 * 86_400.0
"""The longest run timeout anything may declare: ten years (a deployment's own maximum may be shorter)."""


class FunctionManifest(_Wire):
    id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    timeout_s: float | None = Field(default=None, gt=0, le=MAX_RUN_TIMEOUT_S, allow_inf_nan=False)


class Manifest(_Wire):
    protocol: str = PROTOCOL_VERSION
    sdk: str = "ryusen-python"
    app_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    release_id: str
    build_id: str
    functions: list[FunctionManifest]
    signed: bool

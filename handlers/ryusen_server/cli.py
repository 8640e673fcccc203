"""The ``ryusen`` command line (contract 3): a thin client of the server API.

Every command but ``dev`` makes requests to the server API (contract 2) at
``--server`` (or ``RYUSEN_URL``). Requests to a loopback server (``ryusen
dev``) go unsigned; requests to any other host are signed with SigV4 for API
Gateway's IAM authorization, with the caller's default AWS credential chain.
The httpx client comes from ``make_client`` so tests can hand in a fake
transport. ``render_run`` draws the run view as a timeline; it is pure (view
in, console out) so it can be tested without a server.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from datetime import datetime
from functools import update_wrapper
from pathlib import Path
from typing import Any, NoReturn, TypeVar
from urllib.parse import urlsplit

import click
import httpx
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from ryusen._internal import client as client_module
from ryusen._internal.client import (
    RESOLVE_FOLLOWS,
    ApiError,
    Client,
    ConflictError,
    ConnectionFailedError,
    NotFoundError,
    ResolveAction,
    blocker_for,
    blocker_moved,
    is_loopback,
    parse_time,
)
from ryusen._internal.client import WaitTimeoutError as ClientWaitTimeoutError

from .core.model import DEFINITION_BLOCKERS

DEFAULT_SERVER = "http://127.0.0.1:8700"
DEFAULT_DEV_PORT = 8700

PHASES = ("running", "settling", "compensating", "finished")
OUTCOMES = ("completed", "failed", "cancelled", "timed_out")


class CliError(click.ClickException):
    """A failure to report as ``error: ...`` on stderr, with exit status 1."""

    def show(self, file: Any = None) -> None:
        # what a server or an endpoint said is data: its control characters are shown, never acted on
        click.echo(f"error: {printable(self.format_message())}", err=True)


# --- talking to the server -------------------------------------------------------------------------------------------
#
# The command line is built on ``ryusen.Client`` (decision 34: the client drives every operator action the CLI
# has); this part only makes the client lazily (``dev`` and ``key`` need no server) and words its errors.


def make_client(server: str, *, transport: httpx.BaseTransport | None = None) -> Client:
    """The client for ``server``: unsigned on loopback, SigV4 otherwise (tests replace or wrap this)."""
    return Client(server, transport=transport)


class Api:
    """The server the command was pointed at: its client, made on first use."""

    def __init__(self, server: str) -> None:
        self.server = server
        self._client: Client | None = None

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = make_client(self.server)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def describe(self, exc: ApiError) -> str:
        """What to print for a refusal or a failure to reach the server."""
        if isinstance(exc, ConnectionFailedError) and exc.code == "connection_failed":
            if exc.details.get("url", self.server) != self.server:
                return str(exc.message)
            hint = (
                " (is `ryusen dev` running? start it, or point --server / RYUSEN_URL at a deployed API)"
                if is_loopback(self.server)
                else ""
            )
            return f"cannot connect to {self.server}{hint}"
        if isinstance(exc, ConnectionFailedError):
            return str(exc.message)
        return str(exc)


class _Commands(click.Group):
    """Every command's ``ApiError`` becomes ``error: ...`` on stderr, exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ApiError as exc:
            api = ctx.find_object(Api)
            raise CliError(api.describe(exc) if api is not None else str(exc)) from None


F = TypeVar("F", bound=Callable[..., Any])


def pass_client(f: F) -> F:
    """Hand the command the server's ``Client`` as its first argument."""

    def new_func(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        api = ctx.find_object(Api)
        assert api is not None, "the ryusen group sets the Api"
        return ctx.invoke(f, api.client, *args, **kwargs)

    return update_wrapper(new_func, f)  # type: ignore[return-value]


def wait_for_run(client: Client, run_id: str, *, timeout_s: float) -> tuple[dict[str, Any], bool]:
    """Wait until the run finishes (True) or is blocked with nothing moving (False)."""
    try:
        run = client.wait(run_id, timeout_s, return_when_blocked=True)
    except ClientWaitTimeoutError as timeout:
        raise WaitTimeoutError(timeout.run.view) from None
    return run.view, run.finished


class WaitAbandonedError(CliError):
    exit_code = 2


class WaitTimeoutError(Exception):
    def __init__(self, view: dict[str, Any]) -> None:
        super().__init__("timed out waiting")
        self.view = view


# --- rendering -------------------------------------------------------------------------------------------------------

_SUMMARY_STYLE = {
    None: "bold cyan",
    "completed": "bold green",
    "failed": "bold red",
    "cancelled": "bold yellow",
    "timed_out": "bold yellow",
}
_STATUS_STYLE = {
    "completed": "green",
    "succeeded": "green",
    "compensated": "green",
    "failed": "red",
    "unknown": "bold magenta",
    "fenced": "dim",
    "retry_authorized": "yellow",
    "skipped": "dim",
    "not_reached": "dim",
    "none": "dim",
    "pending": "cyan",
    "queued": "cyan",
    "running": "cyan",
    "authorized": "cyan",
}
_DEADLINE_SOURCE = {
    "run_request": "from the run request",
    "function": "the function's timeout",
    "deployment_default": "the deployment default",
}
VALUE_WIDTH = 72
"""Results and inputs are shown on one line, cut to this many characters (``show --json`` has them whole)."""
PIPE_WIDTH = 100
"""The width of output that is not going to a terminal (rich would assume 80)."""
ATTEMPT_INDENT = 5


def _zone(moment: datetime) -> str:
    offset = moment.utcoffset()
    if offset is None:
        return ""
    return " UTC" if not offset else f" {moment.strftime('%z')}"


def _full_time(value: Any) -> str:
    moment = parse_time(value)
    if moment is None:
        return str(value) if value else "—"
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 100_000}{_zone(moment)}"


def _clock_time(value: Any, day: str | None) -> str:
    """``12:00:01.2``, with the date in front when it is not the run's creation day."""
    moment = parse_time(value)
    if moment is None:
        return str(value) if value else "…"
    text = moment.strftime("%H:%M:%S.") + str(moment.microsecond // 100_000)
    if day is not None and moment.strftime("%Y-%m-%d") != day:
        text = moment.strftime("%m-%d ") + text
    return text


def _compact(value: Any, width: int = VALUE_WIDTH) -> str:
    text = json.dumps(value, separators=(", ", ": "), default=str, ensure_ascii=False)
    return text if len(text) <= width else text[: width - 1] + "…"


def _status(value: Any) -> Text:
    text = str(value) if value is not None else "—"
    return Text(text, style=_STATUS_STYLE.get(text, ""))


def _heartbeat_details(details: Any) -> str:
    """A heartbeat's details on one line: a progress bar when they carry a fraction (``{"progress": 0.4}``)."""
    if details is None:
        return ""
    progress = details.get("progress") if isinstance(details, dict) else None
    if isinstance(progress, int | float) and not isinstance(progress, bool) and 0 <= progress <= 1:
        filled = round(progress * 20)
        rest = {k: v for k, v in details.items() if k != "progress"}
        more = f" {_short(json.dumps(rest, default=str))}" if rest else ""
        return f": [{'#' * filled}{'.' * (20 - filled)}] {progress:.0%}{more}"
    return f": {_short(json.dumps(details, default=str))}"


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _error_line(error: Any) -> str:
    if not isinstance(error, dict):
        return str(error)
    line = f"{error.get('type', 'error')}: {error.get('message', '')}"
    if error.get("data") is not None:
        line += f" {_compact(error['data'], 40)}"
    return line


def traceback_lines(error: Any, *, expanded: bool) -> list[str]:
    """Where ``error`` was raised: collapsed, its innermost frame and how to see the rest; expanded, every frame
    (outermost first), as Python prints them."""
    where = error.get("traceback") if isinstance(error, dict) else None
    if not isinstance(where, dict) or not isinstance(where.get("frames"), list):
        return []
    frames = [f for f in where["frames"] if isinstance(f, dict)]
    omitted = where.get("omitted") or 0
    if not frames:
        return [f"raised inside Ryusen's SDK ({omitted} frames left out)"] if omitted else []

    def at(frame: dict[str, Any]) -> str:
        return f"{frame.get('file', '?')}:{frame.get('line', '?')} in {frame.get('function', '?')}"

    if not expanded:
        inner = frames[-1]
        code = f": {inner['code']}" if inner.get("code") else ""
        more = f" ({len(frames)} frames: --traceback shows them)" if len(frames) > 1 else ""
        return [f"raised at {at(inner)}{code}{more}"]
    lines = ["Traceback (most recent call last):"]
    for frame in frames:
        lines.append(f"  {at(frame)}")
        if frame.get("code"):
            lines.append(f"    {frame['code']}")
    if omitted:
        lines.append(f"  ({omitted} frames in Ryusen's SDK or the middle of a deep stack left out)")
    return lines


_OCCURRENCE_LABELS = {  # how a blocker names the two calls it is about
    "duplicate_step_id": (("first", "first call"), ("duplicate", "duplicate call")),
    "concurrent_step": (("first", "open step"), ("second", "then started")),
    "new_step_before_target": (("first", "new step"), ("second", "before target")),
    "compensation_target_not_reached": (("second", "step to undo"),),
    "result_too_large": (("first", "step"),),
    "unstable_step_id": (("first", "step id made"),),
}


class _RunRenderer:
    """One rendering of one run view; remembers the release last shown, so a change of release stands out."""

    def __init__(self, view: dict[str, Any], console: Console, *, tracebacks: bool = False) -> None:
        self.view = view
        self.console = console
        self.tracebacks = tracebacks
        """Show every frame of an error's traceback (else its innermost frame only)."""
        created = parse_time(view.get("created_at"))
        self.day = created.strftime("%Y-%m-%d") if created else None
        self.last_release: str | None = None

    def time(self, value: Any) -> str:
        return _clock_time(value, self.day)

    def indented(self, renderable: Any, indent: int) -> None:
        self.console.print(Padding(renderable, (0, 0, 0, indent), expand=False))

    def render(self) -> None:
        self.header()
        self.blockers()
        self.steps()
        self.unwind()
        self.result()

    def header(self) -> None:
        view, console = self.view, self.console
        outcome = view.get("outcome")
        console.print(Text.assemble(("Run ", "bold"), (str(view.get("id")), "bold"), f"  {view.get('function_id')}"))
        if view.get("app_id"):
            console.print(Text(f"app {view['app_id']}", style="dim"))
        console.print(Text(str(view.get("summary", "")), style=_SUMMARY_STYLE.get(outcome, "bold")))
        console.print(
            Text.assemble(
                "phase ",
                (str(view.get("phase")), "bold"),
                " · outcome ",
                (str(outcome or "—"), "bold"),
                " · recovery ",
                (str(view.get("recovery") or "—"), "bold"),
            )
        )
        deadline = view.get("deadline") or {}
        if deadline.get("at"):
            source = deadline.get("source") or ""
            console.print(Text(f"deadline {_full_time(deadline['at'])} ({_DEADLINE_SOURCE.get(source, source)})"))
        else:
            console.print(Text("no deadline"))
        times = f"created {_full_time(view.get('created_at'))}"
        if view.get("finished_at"):
            times += f" · finished {_full_time(view['finished_at'])}"
        console.print(Text(times))
        stop = view.get("stop_intent")
        if isinstance(stop, dict):
            reason = f": {stop['reason']}" if stop.get("reason") else ""
            console.print(
                Text(f"stop requested: {stop.get('kind', 'stop')} at {self.time(stop.get('at'))}{reason}", "yellow")
            )
        if view.get("input") is not None:
            console.print(Text(f"input {_compact(view['input'])}", style="dim"))

    def blockers(self) -> None:
        blockers = self.view.get("blockers") or []
        if not blockers:
            return
        console = self.console
        console.print()
        console.print(Text(f" BLOCKED ({len(blockers)}) ", style="bold red reverse"))
        for blocker in blockers:
            console.print(
                Text.assemble(
                    ("  ✖ ", "bold red"),
                    (f"{blocker.get('type', 'blocker')}: ", "bold red"),
                    (str(blocker.get("message", "")), "bold"),
                )
            )
            if blocker.get("detail"):
                self.indented(Text(f"cause: {blocker['detail']}"), 6)
            for key, label in _OCCURRENCE_LABELS.get(str(blocker.get("type")), _OCCURRENCE_LABELS["duplicate_step_id"]):
                occurrence = blocker.get(key)
                if isinstance(occurrence, dict) and (occurrence.get("location") or occurrence.get("name")):
                    name = f"  {occurrence['name']}" if occurrence.get("name") else ""
                    step = f" {occurrence['step_id']}" if occurrence.get("step_id") else ""
                    self.indented(Text(f"{label}{step} at {occurrence.get('location') or '?'}{name}"), 6)
            seen = []
            if (blocker.get("count") or 1) > 1:
                seen.append(f"seen {blocker['count']} times")
            if blocker.get("last_seen_at"):
                seen.append(f"last seen {self.time(blocker['last_seen_at'])}")
            if seen:
                self.indented(Text(", ".join(seen), style="dim"), 6)
            for line in self.remedy(blocker):
                self.indented(Text(line, style="yellow"), 6)

    def remedy(self, blocker: dict[str, Any]) -> list[str]:
        """What an operator can do about a blocker: the view's remedy, then each command on a line of its own."""
        run_id = self.view.get("id")
        lines = [str(blocker["remedy"])] if blocker.get("remedy") else []
        resolve = [
            f"  ryusen resolve {run_id} {blocker.get('step_id')} "
            f"--phase {blocker.get('phase')} --generation {blocker.get('generation')}",
            "    (--succeed RESULT_JSON | --fail MESSAGE | --retry)",
        ]
        if blocker.get("type") == "unknown_outcome" and blocker.get("phase") and blocker.get("generation"):
            return [*lines, "once you know what the attempt did:", *resolve]
        held = blocker.get("type") in ("result_too_large", "concurrent_step") and blocker.get("generation")
        if held:  # a callback that ran, whose outcome Ryusen could not take (decisions 23, 25)
            lines += ["once you know what the callback did (or to run it again, with consent):", *resolve]
            if blocker.get("type") == "concurrent_step":
                lines += ["or sync a build that moves the inner step out of the callback"]
            return lines
        if blocker.get("type") == "compensation_target_not_reached" and blocker.get("generation"):
            lines += ["rediscover with current code:", f"  ryusen rediscover {run_id}"]
            lines += ["or, once you have undone the effect yourself (or there is nothing to undo):", resolve[0]]
            return [*lines, "    (--succeed RESULT_JSON | --fail MESSAGE | --skip) --reason TEXT"]
        if blocker.get("type") in DEFINITION_BLOCKERS:
            lines += ["rediscover with current code:", f"  ryusen rediscover {run_id}"]
            if blocker.get("type") == "new_step_before_target" and blocker.get("generation"):
                lines += ["or, once you have undone the effect yourself:", *resolve]
            return lines
        return lines or ["see: ryusen resolve --help"]

    def attempts(self, attempts: list[dict[str, Any]]) -> None:
        table = Table.grid(padding=(0, 2))
        table.add_column(min_width=15, no_wrap=True)
        table.add_column(min_width=9, no_wrap=True)
        table.add_column(min_width=23, no_wrap=True)
        table.add_column(overflow="fold")
        for attempt in attempts:
            status = attempt.get("status")
            if attempt.get("authorized_at"):
                times = f"{self.time(attempt['authorized_at'])} → {self.time(attempt.get('settled_at'))}"
            else:
                times = f"queued {self.time(attempt.get('queued_at'))}"
            what: list[str] = []  # what happened, on the attempt's line
            if attempt.get("error"):
                what.append(_error_line(attempt["error"]))
            if attempt.get("detail"):
                what.append(str(attempt["detail"]))
            if status in ("queued", "retry_authorized") and attempt.get("not_before"):
                what.append(f"not before {self.time(attempt['not_before'])}")
            notes: list[str] = []  # the circumstances, on a line of their own
            if attempt.get("redeliveries"):
                count = attempt["redeliveries"]
                notes.append("redelivered once" if count == 1 else f"redelivered {count} times")
            for submission in attempt.get("stale_submissions") or []:
                notes.append(f"stale result ignored ({submission.get('reason', 'stale')})")
            if dropped := attempt.get("stale_submissions_dropped"):
                notes.append(f"{dropped} more stale result(s) ignored, not recorded")
            if beat := attempt.get("heartbeat"):  # decision 33: the last heartbeat and what it said
                notes.append(f"last heartbeat {self.time(beat.get('at'))}{_heartbeat_details(beat.get('details'))}")
            if unknown := attempt.get("unknown"):  # decisions 28: it stays in the history
                notes.append(f"was unknown from {self.time(unknown.get('at'))}: {unknown.get('reason')}")
            if status == "waiting" and attempt.get("completion_token"):
                notes.append(f"complete it: ryusen complete {attempt['completion_token']} --result JSON")
            if resolution := attempt.get("resolution"):
                by = f" by {resolution['by']}" if resolution.get("by") else ""
                why = f": {resolution['reason']}" if resolution.get("reason") else ""
                notes.append(f"operator {resolution.get('action')}{by} at {self.time(resolution.get('at'))}{why}")
            release = attempt.get("release_id")
            if release and release != self.last_release:
                notes.append(f"release {release}")
                self.last_release = release
            label = f"{attempt.get('phase', '?')} #{attempt.get('generation', '?')}"
            if what:
                table.add_row(Text(label), _status(status), Text(times), Text("; ".join(what)))
                for line in traceback_lines(attempt.get("error"), expanded=self.tracebacks):
                    table.add_row("", "", "", Text(line, style="red"))
                if notes:
                    table.add_row("", "", "", Text(" · ".join(notes), style="dim"))
            else:
                table.add_row(Text(label), _status(status), Text(times), Text(" · ".join(notes), style="dim"))
        self.indented(table, ATTEMPT_INDENT)

    def steps(self) -> None:
        steps = self.view.get("steps") or []
        console = self.console
        console.print()
        console.print(Text(f"Steps ({len(steps)}, in discovery order)", style="bold underline"))
        if not steps:
            console.print(Text("  no steps yet", style="dim"))
        together: dict[Any, int] = {}
        for step in steps:  # decision 30: steps declared together share a group
            if step.get("group") is not None:
                together[step["group"]] = together.get(step["group"], 0) + 1
        for number, step in enumerate(steps, 1):
            line = Text.assemble(f"{number:>3}. ", (str(step.get("id")), "bold"), "  ", _status(step.get("status")))
            if together.get(step.get("group"), 0) > 1:
                line.append(f"  ∥ parallel group {step['group']} ({together[step['group']]} steps)", style="magenta")
            if step.get("location"):
                line.append(f"  {step['location']}")
            if step.get("name") and step["name"] != step.get("id"):
                line.append(f"  {step['name']}", style="dim")
            if step.get("has_compensation"):
                line.append("  ↺ has compensation", style="dim")
            if step.get("wait_until"):  # decision 31: a durable wait, or a step's not_before
                what = "sleeps until" if step.get("sleep") else "starts no earlier than"
                line.append(f"  {what} {self.time(step['wait_until'])}", style="cyan")
            console.print(line)
            forward = [a for a in step.get("attempts") or [] if a.get("phase") != "compensation"]
            if forward:
                self.attempts(forward)
            if step.get("status") == "completed" and step.get("result") is not None:
                self.indented(Text(f"result {_compact(step['result'])}", style="dim"), ATTEMPT_INDENT)
            elif step.get("error") and not forward:
                self.indented(Text(_error_line(step["error"]), style="red"), ATTEMPT_INDENT)

    def unwind(self) -> None:
        view, console = self.view, self.console
        unwind = view.get("unwind") or []
        if view.get("outcome") in (None, "completed") and not unwind:
            return
        console.print()
        console.print(Text("Unwind (reverse completion order)", style="bold underline"))
        if not unwind:
            words = "nothing to compensate" if view.get("recovery") == "not_required" else "not planned yet"
            console.print(Text(f"  {words}", style="dim"))
            return
        steps = {s.get("id"): s for s in view.get("steps") or []}
        for number, entry in enumerate(unwind, 1):
            step = steps.get(entry.get("step_id"), {})
            compensation = step.get("compensation") or {}
            line = Text.assemble(
                f"{number:>3}. ", (str(entry.get("step_id")), "bold"), "  ", _status(entry.get("status"))
            )
            if compensation.get("result") is not None:
                line.append(f"  → {_compact(compensation['result'], 48)}", style="dim")
            console.print(line)
            attempts = [a for a in step.get("attempts") or [] if a.get("phase") == "compensation"]
            if attempts:
                self.attempts(attempts)
            elif compensation.get("error"):
                self.indented(Text(_error_line(compensation["error"]), style="red"), ATTEMPT_INDENT)

    def result(self) -> None:
        view, console = self.view, self.console
        error = view.get("error")
        if isinstance(error, dict):
            console.print()
            console.print(
                Text.assemble(("Error  ", "bold red"), f"{error.get('type', 'error')}: {error.get('message', '')}")
            )
            if error.get("data") is not None:
                self.indented(Text(f"data {_compact(error['data'], 90)}", style="dim"), ATTEMPT_INDENT)
            for line in traceback_lines(error, expanded=self.tracebacks):
                self.indented(Text(line, style="red"), ATTEMPT_INDENT)
        elif view.get("outcome") == "completed":
            console.print()
            console.print(Text("Output", style="bold"))
            console.print(Text(json.dumps(view.get("output"), indent=2, default=str, ensure_ascii=False)))


_CONTROL = str.maketrans({c: f"\\x{c:02x}" for c in (*range(32), *range(0x7F, 0xA0)) if c not in (9, 10)})
"""Control characters a terminal would act on (an escape sequence that moves the cursor or retitles the
window), shown as ``\\x1b`` instead: what a run holds is data, never instructions to the terminal."""


_CONTROL_ALL = str.maketrans({c: f"\\x{c:02x}" for c in (*range(32), *range(0x7F, 0xA0))})


def said(value: Any) -> str:
    """A value someone else chose (an endpoint's release id, a function id), for one line of output: every
    control character shown as ``\\x..``, line breaks included."""
    return str(value).translate(_CONTROL_ALL)


def printable(value: Any) -> Any:
    """A JSON value with every string's control characters made visible (keys too)."""
    if isinstance(value, str):
        return value.translate(_CONTROL)
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable(v) for v in value]
    return value


def render_run(view: dict[str, Any], *, console: Console, tracebacks: bool = False) -> None:
    """Draw a run view (``GET /v1/runs/{id}``): header, blockers, step timeline, unwind, then output or error.
    Every string is drawn as text (``Text``, never rich markup), with its control characters made visible.
    An error's traceback is shown by its innermost frame, or whole with ``tracebacks``."""
    _RunRenderer(printable(view), console, tracebacks=tracebacks).render()


def render_runs(runs: list[dict[str, Any]], *, console: Console) -> None:
    """A table of run summaries (``GET /v1/runs``); the summary already says the phase."""
    table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 2, 0, 0))
    table.add_column("RUN", no_wrap=True)
    table.add_column("FUNCTION")
    table.add_column("SUMMARY", min_width=12)
    table.add_column("STEPS", justify="right", no_wrap=True)
    table.add_column("CREATED")
    for run in printable(runs):
        created = parse_time(run.get("created_at"))
        summary = Text(str(run.get("summary", "")), style=_SUMMARY_STYLE.get(run.get("outcome"), ""))
        if run.get("blocked") and "blocked" not in summary.plain:
            summary.append(" (blocked)", style="bold red")
        table.add_row(
            Text(str(run.get("id"))),
            Text(str(run.get("function_id"))),
            summary,
            Text(str(run.get("steps", ""))),
            Text(created.strftime("%Y-%m-%d %H:%M") if created else str(run.get("created_at", ""))),
        )
    console.print(table)


# --- commands --------------------------------------------------------------------------------------------------------


def parse_json(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """An option's JSON value; invalid JSON is a usage error, before any request is made."""
    if value is None:
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON ({exc}): {value!r}", ctx=ctx, param=param) from None


def _console() -> Console:
    console = Console(highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPE_WIDTH
    return console


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=str, ensure_ascii=False))


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--server",
    envvar="RYUSEN_URL",
    default=DEFAULT_SERVER,
    show_default=True,
    metavar="URL",
    help="The Ryusen server API (env RYUSEN_URL). Not on loopback: requests are signed with SigV4.",
)
@click.pass_context
def cli(ctx: click.Context, server: str) -> None:
    """Ryusen: durable workflows for plain Python functions."""
    if not server.startswith(("http://", "https://")) or not urlsplit(server).hostname:
        raise click.BadParameter(f"{server!r} is not an http:// or https:// URL", ctx=ctx, param_hint="'--server'")
    api = Api(server.rstrip("/"))
    ctx.obj = api
    ctx.call_on_close(api.close)


@cli.command()
@click.option("--port", type=click.IntRange(1, 65535), default=DEFAULT_DEV_PORT, show_default=True)
@click.option(
    "--data",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="RYUSEN_DEV_DATA",
    default=Path(".ryusen"),
    show_default=True,
    help="Where runs, releases and their history are kept across restarts (env RYUSEN_DEV_DATA).",
)
@click.option("--fresh", is_flag=True, help="Forget what --data holds and start with no runs.")
@click.argument("apps", nargs=-1, metavar="[APP]...")
def dev(port: int, data: Path, fresh: bool, apps: tuple[str, ...]) -> None:
    """Run Ryusen locally: the server API, the engine, the development UI, and each APP.

    APP is `path/to/file.py:app` or `package.module:app`. Runs are kept in --data across restarts.
    """
    try:
        from ryusen_server.local.dev import run_dev

        status = run_dev(port=port, apps=list(apps), data=data, fresh=fresh)
    except ModuleNotFoundError as exc:  # moto and watchfiles are imported when the stack starts
        if not exc.name or exc.name.split(".")[0] in ("ryusen", "ryusen_server"):
            raise
        raise CliError(
            f"`ryusen dev` needs the local extra (module {exc.name!r} is missing): pip install 'ryusen[local]'"
        ) from None
    sys.exit(status)


@cli.command()
@click.option("--port", type=click.IntRange(1, 65535), default=8701, show_default=True)
@click.pass_context
def ui(ctx: click.Context, port: int) -> None:
    """Serve the development UI on loopback over --server (a deployed API: its requests signed with SigV4)."""
    from ryusen_server.local.remote_ui import run_remote_ui
    from ryusen_server.local.ui import UiNotBuiltError, check_built

    try:
        check_built()
    except UiNotBuiltError as exc:
        raise CliError(str(exc)) from None
    api = ctx.find_object(Api)
    assert api is not None, "the ryusen group sets the Api"
    sys.exit(run_remote_ui(api.server, port))


@cli.command()
@click.argument("url")
@click.option("--app", "app_id", metavar="APP_ID", help="The app id (default: read from the endpoint's manifest).")
@pass_client
def sync(client: Client, url: str, app_id: str | None) -> None:
    """Record a release of the app served at URL (and wake its blocked runs)."""
    if app_id is None:
        try:
            app_id = str(client.manifest(url)["app_id"])
        except ApiError as exc:
            why = exc.message if isinstance(exc, ConnectionFailedError) or exc.code == "not_a_manifest" else str(exc)
            raise CliError(f"cannot read the manifest at {url}: {why}; pass --app APP_ID to skip it") from None
    release = client.sync(url, app_id=app_id)
    signed = "" if release.get("signed", True) else " (unsigned: the app has no signing key)"
    # every value here is what the endpoint said: one line each, its control characters shown, never acted on
    functions = ", ".join(said(f.get("id")) for f in release.get("functions") or []) or "none"
    click.echo(
        f"synced app {said(release.get('app_id', app_id))}: release {said(release.get('release_id'))} "
        f"(build {said(release.get('build_id'))}){signed}\nfunctions: {functions}"
    )


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the response as JSON.")
@pass_client
def apps(client: Client, as_json: bool) -> None:
    """List the synced apps, each with its newest release."""
    listed = client.apps()
    if as_json:
        _echo_json({"apps": listed})
        return
    if not listed:
        click.echo("no apps synced (serve one with `ryusen dev APP`, or `ryusen sync URL`)")
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("APP", "RELEASE", "BUILD", "SYNCED", "URL", "FUNCTIONS"):
        table.add_column(column, overflow="fold")
    for app in listed:
        table.add_row(
            said(app.get("app_id")),
            said(app.get("release_id")),
            said(app.get("build_id")),
            _full_time(app.get("synced_at")),
            said(app.get("url")),
            ", ".join(said(f) for f in app.get("functions") or []) or "none",
        )
    _console().print(table)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the response as JSON.")
@pass_client
def functions(client: Client, as_json: bool) -> None:
    """List the functions of every synced app, with their newest release."""
    listed = client.functions()
    if as_json:
        _echo_json({"functions": listed})
        return
    if not listed:
        click.echo("no functions (no app is synced)")
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("FUNCTION", "APP", "TIMEOUT", "RELEASE", "SYNCED"):
        table.add_column(column, overflow="fold")
    for fn in sorted(listed, key=lambda f: (str(f.get("app_id")), str(f.get("id")))):
        release = fn.get("release") or {}
        timeout = fn.get("timeout_s")
        table.add_row(
            said(fn.get("id")),
            said(fn.get("app_id")),
            f"{timeout:g} s" if isinstance(timeout, (int, float)) else "-",
            said(release.get("release_id")),
            _full_time(release.get("synced_at")),
        )
    _console().print(table)


@cli.command()
@click.argument("function_id", metavar="FUNCTION")
@click.option(
    "--input", "input_", callback=parse_json, metavar="JSON", help="The run's input, as JSON (default: null)."
)
@click.option("--idempotency-key", metavar="KEY", help="Starting again with the same key returns the same run.")
@click.option(
    "--timeout", "timeout_s", type=click.FloatRange(0, min_open=True), metavar="SECONDS", help="The run's timeout."
)
@click.option("--wait", is_flag=True, help="Wait for the run to finish (or to block), then show it.")
@click.option(
    "--wait-timeout",
    type=click.FloatRange(0, min_open=True),
    default=300.0,
    show_default=True,
    metavar="SECONDS",
    help="With --wait: give up waiting after this long (exit 2).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the run view as JSON.")
@pass_client
def run(
    client: Client,
    function_id: str,
    input_: Any,
    idempotency_key: str | None,
    timeout_s: float | None,
    wait: bool,
    wait_timeout: float,
    as_json: bool,
) -> None:
    """Start a run of FUNCTION. With --wait, exit 0 only if it completes."""
    handle = client.start(function_id, input_, idempotency_key=idempotency_key, timeout=timeout_s)
    assert handle.run is not None
    view, run_id = handle.run.view, handle.id
    if not wait:
        if as_json:
            _echo_json(view)
        else:
            how = "started" if handle.created else "existing run for this idempotency key:"
            click.echo(printable(f"{how} {run_id} ({function_id}): {view.get('summary', view.get('phase'))}"))
            click.echo(f"follow it with: ryusen show {run_id} --follow")
        return
    err = Console(stderr=True, highlight=False)
    try:
        if err.is_terminal:
            with err.status(f"waiting for {run_id}…"):
                view, finished = wait_for_run(client, run_id, timeout_s=wait_timeout)
        else:
            view, finished = wait_for_run(client, run_id, timeout_s=wait_timeout)
    except WaitTimeoutError as timeout:
        _show(timeout.view, as_json)
        raise WaitAbandonedError(
            f"run {run_id} did not finish within {wait_timeout:g} s (it goes on; see `ryusen show {run_id}`)"
        ) from None
    _show(view, as_json)
    if not finished:
        raise CliError(f"run {run_id} is blocked and nothing is moving; waiting stopped (see the blockers above)")
    if view.get("outcome") != "completed":
        sys.exit(1)


def _show(view: dict[str, Any], as_json: bool, *, tracebacks: bool = False) -> None:
    if as_json:
        _echo_json(view)
    else:
        render_run(view, console=_console(), tracebacks=tracebacks)


PREFIX_MIN = 6
"""The shortest run id prefix looked up among recent runs (``run_`` may be left out)."""
PREFIX_SEARCH_PAGES = 5
"""How many pages of the newest runs (200 each) a prefix is looked up in."""


R = TypeVar("R")


def on_run(client: Client, given: str, action: Callable[[str], R], *, reads: bool = False) -> tuple[str, R]:
    """``action(run_id)`` for the run ``given`` names: its id, or else a prefix of one recent run's id (the UI
    shows prefixes). A prefix is looked up only when the id itself is not found, so a full id costs nothing.
    An action that changes a run (not ``reads``) takes a prefix only when every run was searched: one match among
    the newest runs does not show that no older run has the prefix."""
    try:
        return given, action(given)
    except NotFoundError as missing:
        if missing.code != "not_found":
            raise
        run_id = _run_with_prefix(client, given, missing, whole=not reads)
    return run_id, action(run_id)


def _run_with_prefix(client: Client, given: str, missing: NotFoundError, *, whole: bool = True) -> str:
    prefix = given if given.startswith("run_") else "run_" + given
    if len(prefix) - len("run_") < PREFIX_MIN:
        raise missing
    matches: list[str] = []
    cursor: str | None = None
    for _ in range(PREFIX_SEARCH_PAGES):
        page = client.list(limit=200, cursor=cursor)
        matches += [r.id for r in page.runs if r.id.startswith(prefix)]
        cursor = page.cursor
        if not cursor or len(matches) > 1:
            break
    if len(matches) == 1 and cursor and whole:
        raise CliError(
            f"{given!r} matches {matches[0]} among the newest {PREFIX_SEARCH_PAGES * 200} runs, but older runs were"
            " not searched: give the full id"
        )
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise CliError(f"{given!r} names more than one run: {', '.join(matches[:5])}; give more of the id")
    searched = "" if not cursor else f" among the newest {PREFIX_SEARCH_PAGES * 200} runs"
    raise CliError(f"not_found: no run {given!r}, and no run's id starts with it{searched}")


@cli.command()
@click.option("--function", "function_id", metavar="FUNCTION", help="Only runs of this function.")
@click.option("--phase", type=click.Choice(PHASES))
@click.option("--outcome", type=click.Choice(OUTCOMES))
@click.option("--limit", type=click.IntRange(1, 200), default=20, show_default=True)
@click.option("--cursor", metavar="CURSOR", help="The next page, from a previous listing.")
@click.option("--json", "as_json", is_flag=True, help="Print the response as JSON.")
@pass_client
def runs(
    client: Client,
    function_id: str | None,
    phase: str | None,
    outcome: str | None,
    limit: int,
    cursor: str | None,
    as_json: bool,
) -> None:
    """List runs, newest first."""
    page = client.list(function=function_id, phase=phase, outcome=outcome, limit=limit, cursor=cursor)
    if as_json:
        _echo_json({"runs": [r.view for r in page.runs], "cursor": page.cursor})
        return
    if not page.runs:
        click.echo("no runs")
    else:
        render_runs([r.view for r in page.runs], console=_console())
    if page.cursor:
        click.echo(f"more: ryusen runs --limit {limit} --cursor {page.cursor}")


FOLLOW_INTERVAL_S = 1.0


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--json", "as_json", is_flag=True, help="Print the run view as JSON.")
@click.option(
    "--follow", "-f", is_flag=True, help="Show the run again each time it changes, until it finishes (Ctrl-C stops)."
)
@click.option("--traceback", "tracebacks", is_flag=True, help="Show every frame of each error's traceback.")
@pass_client
def show(client: Client, run_id: str, as_json: bool, follow: bool, tracebacks: bool) -> None:
    """Show a run: status, blockers, step timeline, unwind, result. RUN may be a prefix of a recent run's id."""
    run_id, run = on_run(client, run_id, client.get, reads=True)
    view = run.view
    _show(view, as_json, tracebacks=tracebacks)
    if not follow:
        return
    console = _console()
    try:
        while view.get("phase") != "finished":
            client_module.sleep(FOLLOW_INTERVAL_S)
            latest = client.get(run_id).view
            if latest == view:
                continue
            view = latest
            if as_json:
                _echo_json(view)
            else:
                if console.is_terminal:
                    console.clear()
                else:
                    console.rule()
                render_run(view, console=console, tracebacks=tracebacks)
    except KeyboardInterrupt:
        return


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--reason", help="Recorded with the stop intent.")
@pass_client
def cancel(client: Client, run_id: str, reason: str | None) -> None:
    """Cancel a run (it settles, then compensates)."""
    run_id, run = on_run(client, run_id, lambda r: client.cancel(r, reason))
    click.echo(printable(f"cancel requested for {run_id}: {run.summary}"))


@cli.command()
@click.argument("run_id", metavar="RUN")
@pass_client
def rediscover(client: Client, run_id: str) -> None:
    """Retry discovery of a run blocked by a duplicate step id."""
    run_id, run = on_run(client, run_id, client.rediscover)
    click.echo(printable(f"rediscovery queued for {run_id}: {run.summary}"))


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.argument("step_id", metavar="STEP")
@click.option(
    "--phase",
    type=click.Choice(["forward", "compensation"]),
    help="The attempt's phase (default: that of the step's one blocker).",
)
@click.option(
    "--generation",
    type=click.IntRange(min=1),
    metavar="G",
    help="The attempt's generation (default: that of the step's one blocker).",
)
@click.option(
    "--succeed", "result", callback=parse_json, metavar="JSON", help="Declare the attempt succeeded with this result."
)
@click.option(
    "--fail",
    "message",
    metavar="MESSAGE",
    help="Declare the attempt failed: the step's retry policy applies, so a retry may follow (add --final for none).",
)
@click.option(
    "--final",
    is_flag=True,
    help="With --fail: no retry follows; the failure is the step's (the function sees StepFailed, or the unwind"
    " stops partially compensated).",
)
@click.option("--retry", is_flag=True, help="Authorize another attempt (only if the callback is safe to run twice).")
@click.option(
    "--skip",
    is_flag=True,
    help="Skip a compensation the unwind is blocked on because no pass reached it (you undid the effect yourself).",
)
@click.option("--reason", metavar="TEXT", help="Why: kept on the attempt with the resolution.")
@click.pass_context
def resolve(
    ctx: click.Context,
    run_id: str,
    step_id: str,
    phase: str | None,
    generation: int | None,
    result: Any,
    message: str | None,
    retry: bool,
    skip: bool,
    final: bool,
    reason: str | None,
) -> None:
    """Resolve an attempt whose outcome is Unknown, or move on a blocked one.

    Exactly one of --succeed JSON, --fail MESSAGE, --retry or --skip.
    """
    succeed = ctx.get_parameter_source("result") is click.core.ParameterSource.COMMANDLINE
    given = (("--succeed", succeed), ("--fail", message is not None), ("--retry", retry), ("--skip", skip))
    chosen = [name for name, was_given in given if was_given]
    if len(chosen) != 1:
        _usage(
            ctx,
            "give exactly one of --succeed JSON, --fail MESSAGE, --retry, --skip"
            + (f" (got {' '.join(chosen)})" if chosen else ""),
        )
    if final and message is None:
        _usage(ctx, "--final goes with --fail MESSAGE")
    action: ResolveAction = "succeed" if succeed else "fail" if message is not None else "retry" if retry else "skip"
    api = ctx.find_object(Api)
    assert api is not None, "the ryusen group sets the Api"
    client = api.client
    named = phase is not None and generation is not None
    if phase is None or generation is None:
        run_id, blocked = on_run(client, run_id, client.get)
        try:
            attempt = blocker_for(blocked, step_id, phase)
        except ValueError as exc:
            raise CliError(f"{exc} (--phase and --generation)") from None
    else:
        attempt = (phase, generation)
    for follows in range(RESOLVE_FOLLOWS + 1):

        def resolve_on(r: str, attempt: tuple[str, int] = attempt) -> Any:
            return client.resolve(
                r,
                step_id,
                action,
                result=result if succeed else None,
                error=message,
                final=final,
                phase=attempt[0],
                generation=attempt[1],
                reason=reason,
            )

        try:
            run_id, run = on_run(client, run_id, resolve_on)
            break
        except ConflictError as exc:
            # only the step named: its blocker is meant, which a probe of the run may have moved on meanwhile
            moved = (
                None
                if named or follows == RESOLVE_FOLLOWS
                else blocker_moved(exc, attempt, client.get(run_id), step_id, phase)
            )
            if moved is None:
                raise
            attempt = moved
    click.echo(printable(f"resolved {step_id} {attempt[0]} #{attempt[1]} ({action}): {run.summary}"))


@cli.command()
@click.argument("token", metavar="TOKEN")
@click.option(
    "--result", "result", callback=parse_json, metavar="JSON", help="The step's result: the run goes on with it."
)
@click.option("--fail", "message", metavar="MESSAGE", help="Fail the step (its retry policy applies: a new token).")
@click.option("--final", is_flag=True, help="With --fail: no retry follows.")
@click.pass_context
def complete(ctx: click.Context, token: str, result: Any, message: str | None, final: bool) -> None:
    """Complete a step that waits for a completion from outside (completion="external") with its TOKEN.

    Exactly one of --result JSON or --fail MESSAGE. The token is on the waiting attempt (`ryusen show RUN`)."""
    given = ctx.get_parameter_source("result") is click.core.ParameterSource.COMMANDLINE
    if given == (message is not None):
        _usage(ctx, "give exactly one of --result JSON or --fail MESSAGE")
    if final and message is None:
        _usage(ctx, "--final goes with --fail MESSAGE")
    api = ctx.find_object(Api)
    assert api is not None, "the ryusen group sets the Api"
    client = api.client
    run = client.fail(token, message, final=final) if message is not None else client.complete(token, result)
    click.echo(printable(f"completed a step of {run.id}: {run.summary}"))


@cli.group()
def key() -> None:
    """Signing keys (docs/security.md#keys)."""


@key.command()
@click.argument("app_id", metavar="APP_ID")
@click.option(
    "--master-secret",
    metavar="SECRET_ID",
    help="Read the master from this Secrets Manager secret (the stack's MasterKeySecret) instead of RYUSEN_MASTER_KEY.",
)
def derive(app_id: str, master_secret: str | None) -> None:
    """Print APP_ID's signing key, derived from the deployment's master (RYUSEN_MASTER_KEY, or --master-secret).

    Give the app this key (RYUSEN_SIGNING_KEY, or a secret of its own): it signs for that app only. The key id
    that signatures with it carry goes to stderr."""
    from ryusen._internal.signing import app_key, key_id, split_keys

    if not app_id or len(app_id) > 256:
        raise CliError("the app id must be 1 to 256 characters")
    if master_secret:
        import boto3

        master = str(boto3.client("secretsmanager").get_secret_value(SecretId=master_secret)["SecretString"]).strip()
    else:
        masters = split_keys(os.environ.get("RYUSEN_MASTER_KEY"))
        master = masters[0] if masters else ""
    if not master:
        raise CliError("no master key: set RYUSEN_MASTER_KEY, or pass --master-secret SECRET_ID")
    derived = app_key(master, app_id)
    click.echo(derived)
    click.echo(f"key id {key_id(derived)} (app {printable(app_id)})", err=True)


@key.command()
@click.option(
    "--secret", "secret_id", metavar="SECRET_ID", required=True, help="The key secret (the stack's MasterKeySecret)."
)
@click.option(
    "--emergency",
    is_flag=True,
    help="Keep no previous key: the old key is refused from now on (a leaked key). In-flight work may be disturbed.",
)
def rotate(secret_id: str, emergency: bool) -> None:
    """Put a new random key in SECRET_ID (its old value becomes AWSPREVIOUS).

    A normal rotation keeps the old key valid for RYUSEN_PREVIOUS_KEY_WINDOW_S (a day by default) after now;
    --emergency detaches AWSPREVIOUS, so nothing accepts the old key (docs/security.md#keys). The new key is
    never printed: its key id goes to stderr."""
    import secrets as random_secrets

    import boto3

    from ryusen._internal.signing import key_id

    client = boto3.client("secretsmanager")
    new = random_secrets.token_hex(32)
    version = client.put_secret_value(SecretId=secret_id, SecretString=new)["VersionId"]
    if emergency:
        stages = client.describe_secret(SecretId=secret_id).get("VersionIdsToStages") or {}
        for old, labels in stages.items():
            if "AWSPREVIOUS" in labels and old != version:
                client.update_secret_version_stage(
                    SecretId=secret_id, VersionStage="AWSPREVIOUS", RemoveFromVersionId=old
                )
        click.echo(
            f"rotated {printable(secret_id)} in an emergency: version {version}, no previous key kept. Engines"
            " refuse the old key for late results and syncs now and sign with the new key within 5 minutes; give"
            " every app its new key now (ryusen key derive)."
        )
    else:
        click.echo(
            f"rotated {printable(secret_id)}: version {version}. The previous key stays valid for"
            " RYUSEN_PREVIOUS_KEY_WINDOW_S (a day by default), then is refused."
        )
    click.echo(f"key id {key_id(new)}", err=True)


def _usage(ctx: click.Context, message: str) -> NoReturn:
    raise click.UsageError(message, ctx)


def main() -> None:
    cli(prog_name="ryusen")


__all__ = ["Api", "cli", "main", "make_client", "render_run", "render_runs", "wait_for_run"]

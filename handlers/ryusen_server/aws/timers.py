"""Timers as one-time EventBridge Scheduler schedules whose target is the dispatch queue.

Theory of operation. A timer (a run's deadline or probe) becomes a schedule
``at(yyyy-mm-ddThh:mm:ss)`` in UTC, with no flexible window, deleted by the
Scheduler after it fires (``ActionAfterCompletion=DELETE``). Its target is the
dispatch queue and its input is ``{"timer": <TimerRef>}``, which the dispatch
handler (``runtime.process_body``) recognises. The queue adapter also parks
task messages delayed past SQS's 15-minute limit here (``schedule_message``),
with the task message itself as the input.

Schedule names are deterministic (the timer's own name, or a digest of a
delayed message), so scheduling twice is harmless: a ``ConflictException`` for
a name that exists means it is already scheduled. AWS accepts only names of
1-64 characters from ``[0-9a-zA-Z-_.]`` and moto accepts anything, so every
name goes through :func:`schedule_name` first.

moto never fires schedules. :meth:`SchedulerTimers.due` lists the group and
returns the inputs whose time has come; the local runtime sends each to the
dispatch queue (what the real Scheduler's SQS target does) and then
:meth:`SchedulerTimers.delete` s it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from botocore.exceptions import ClientError

from ..core.model import TimerRef
from ..ports import RequestCounter

if TYPE_CHECKING:
    from mypy_boto3_scheduler.client import EventBridgeSchedulerClient

log = logging.getLogger("ryusen.aws.timers")

MAX_NAME_LENGTH = 64
_VALID_NAME = re.compile(r"[0-9A-Za-z_.\-]{1,64}")
_INVALID_CHARS = re.compile(r"[^0-9A-Za-z_.\-]")
_AT_EXPRESSION = re.compile(r"at\((\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})\)")
MIN_LEAD = timedelta(seconds=1)
"""A schedule is never created in the past: a due timer is set this far after now."""


def schedule_name(raw: str) -> str:
    """A name AWS accepts: ``raw`` itself when valid, else a readable prefix and a digest of ``raw``.

    >>> schedule_name("ryusen-deadline-run_1-1700000000")
    'ryusen-deadline-run_1-1700000000'
    >>> len(schedule_name("x" * 100))
    64
    """
    if _VALID_NAME.fullmatch(raw):
        return raw
    digest = hashlib.sha256(raw.encode()).hexdigest()[:16]
    prefix = _INVALID_CHARS.sub("-", raw)[: MAX_NAME_LENGTH - len(digest) - 1]
    return f"{prefix}-{digest}"


def at_expression(moment: datetime) -> str:
    """``at(...)`` in UTC, rounded up to the second so that a schedule never fires early."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    moment = moment.astimezone(UTC)
    if moment.microsecond:
        moment = moment.replace(microsecond=0) + timedelta(seconds=1)
    return f"at({moment:%Y-%m-%dT%H:%M:%S})"


def parse_at_expression(expression: str, timezone: str | None = None) -> datetime | None:
    """The moment of an ``at(...)`` expression (None for rate/cron or anything else)."""
    match = _AT_EXPRESSION.fullmatch(expression)
    if match is None:
        return None
    zone = ZoneInfo(timezone) if timezone and timezone != "UTC" else UTC
    return datetime.fromisoformat(match.group(1)).replace(tzinfo=zone).astimezone(UTC)


def timer_input(timer: TimerRef) -> str:
    """The target input of a timer's schedule: what ``runtime.process_body`` reads as a timer message."""
    return json.dumps({"timer": timer.model_dump(mode="json")}, separators=(",", ":"))


class SchedulerTimers:
    """:class:`~ryusen_server.ports.TimerService` on EventBridge Scheduler (see the module docstring)."""

    def __init__(
        self,
        client: EventBridgeSchedulerClient,
        *,
        group: str,
        target_arn: str,
        role_arn: str,
        dead_letter_arn: str | None = None,
        counter: RequestCounter | None = None,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        self._client = client
        self.group = group
        self.target_arn = target_arn
        self.role_arn = role_arn
        self.dead_letter_arn = dead_letter_arn
        self.counter = counter or RequestCounter()
        self._clock = clock or (lambda: datetime.now(UTC))
        # name -> (moment, input). Names are deterministic and schedules are never updated, so what
        # one GetSchedule returned stays true: ``due`` reads each schedule once, not on every poll.
        self._known: dict[str, tuple[datetime | None, str]] = {}
        self._lock = threading.Lock()

    def schedule(self, timer: TimerRef) -> None:
        self.schedule_message(timer.name, timer.at, timer_input(timer))

    def cancel(self, timer: TimerRef) -> None:
        """The timer will not be needed (its run finished first): delete its schedule, if still there."""
        self.delete(schedule_name(timer.name))

    def schedule_message(self, name: str, at: datetime, body: str, *, target_arn: str | None = None) -> str:
        """Deliver ``body`` to the target (the dispatch queue, or the queue ``target_arn``: an app's own) at ``at``;
        returns the schedule's name."""
        name = schedule_name(name)
        when = max(at if at.tzinfo else at.replace(tzinfo=UTC), self._clock() + MIN_LEAD)
        target: Any = {
            "Arn": target_arn or self.target_arn,
            "RoleArn": self.role_arn,
            "Input": body,
            # a target that keeps failing (a role without permission, a deleted queue) is retried for a day,
            # then its input is kept in the dead-letter queue, where an alarm and an operator find it
            "RetryPolicy": {"MaximumEventAgeInSeconds": 86_400, "MaximumRetryAttempts": 185},
        }
        if self.dead_letter_arn is not None:
            target["DeadLetterConfig"] = {"Arn": self.dead_letter_arn}
        self.counter.add("scheduler.create_schedule")
        try:
            self._client.create_schedule(
                Name=name,
                GroupName=self.group,
                ScheduleExpression=at_expression(when),
                ScheduleExpressionTimezone="UTC",
                FlexibleTimeWindow={"Mode": "OFF"},
                ActionAfterCompletion="DELETE",
                State="ENABLED",
                Target=target,
            )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "ConflictException":
                raise
            log.debug("schedule %s exists already", name)  # the same name is the same timer
        return name

    def due(self, now: datetime) -> list[tuple[str, str]]:
        """(name, input) of every schedule in the group whose moment is at or before ``now``, oldest first."""
        if now.tzinfo is None:
            now = now.replace(tzinfo=UTC)
        listed: list[str] = []
        token: str | None = None
        while True:
            self.counter.add("scheduler.list_schedules")
            page = (
                self._client.list_schedules(GroupName=self.group, NextToken=token)
                if token
                else self._client.list_schedules(GroupName=self.group)
            )
            listed.extend(s["Name"] for s in page.get("Schedules", []) if s.get("State", "ENABLED") == "ENABLED")
            token = page.get("NextToken")
            if not token:
                break
        ready: list[tuple[datetime, str, str]] = []
        for name in listed:
            known = self._read(name)
            if known is not None and known[0] is not None and known[0] <= now:
                ready.append((known[0], name, known[1]))
        with self._lock:
            for gone in set(self._known) - set(listed):
                del self._known[gone]
        return [(name, body) for _, name, body in sorted(ready)]

    def _read(self, name: str) -> tuple[datetime | None, str] | None:
        with self._lock:
            known = self._known.get(name)
        if known is not None:
            return known
        self.counter.add("scheduler.get_schedule")
        try:
            schedule = self._client.get_schedule(Name=name, GroupName=self.group)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "ResourceNotFoundException":
                return None  # deleted since it was listed
            raise
        moment = parse_at_expression(schedule["ScheduleExpression"], schedule.get("ScheduleExpressionTimezone"))
        known = (moment, schedule.get("Target", {}).get("Input", ""))
        with self._lock:
            self._known[name] = known
        return known

    def delete(self, name: str) -> None:
        """Delete a schedule (once its input is delivered); a schedule already gone is fine."""
        with self._lock:
            self._known.pop(name, None)
        self.counter.add("scheduler.delete_schedule")
        try:
            self._client.delete_schedule(Name=name, GroupName=self.group)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "ResourceNotFoundException":
                raise


def create_schedule_group(client: EventBridgeSchedulerClient, group: str) -> None:
    """Create the schedule group if missing.

    It is looked up first because moto's CreateScheduleGroup replaces an
    existing group (dropping its schedules) where AWS raises ConflictException.
    """
    if group == "default":
        return
    try:
        client.get_schedule_group(Name=group)
        return
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") != "ResourceNotFoundException":
            raise
    try:
        client.create_schedule_group(Name=group)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") != "ConflictException":
            raise

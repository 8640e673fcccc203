"""What ``ryusen dev`` keeps across restarts: its table, in a data directory (issue 26).

The embedded moto keeps everything in memory. The table (runs, their journals, releases, idempotency keys) is
what matters: a stopped ``ryusen dev`` saves it to ``DIR/table.jsonl`` (and every few seconds while it runs,
when something was written), and the next one loads it before it serves anything. Queue messages and
schedules are not saved: the engine's sweeper finds every run whose work is due with nothing on its way to
move it, and sends its task again (issue 12), so a restored run goes on. An attempt that was running when the
stack stopped is Unknown when its lease ends, unless its outcome was posted first (the app drains on stop).

Keys are not kept: each session makes its own, as before (docs/security.md).

A stack that is killed (no chance to save at the end) loses at most its last few seconds of writes; among them
may be the write that authorized an attempt whose callback then ran. Sent again after a restart, that callback
would run twice with no one told. So every authorization is also appended to ``DIR/started.jsonl`` before the
endpoint is called (after the write: the engine's ``decided`` hook), and a save drops only what it covered. At
load, an attempt the log names that the saved table still has queued may have run: the engine marks it Unknown
(``StartMayBeLost``) instead of sending it again.

One ``ryusen dev`` at a time uses a directory (a lock file says so).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

FORMAT = 1
TABLE_FILE = "table.jsonl"
STARTED_FILE = "started.jsonl"
LOCK_FILE = "lock"
BATCH = 25
"""Items per BatchWriteItem (DynamoDB's most)."""


class StateDirError(Exception):
    """The data directory cannot be used (another ``ryusen dev`` holds it, or its file is not ours)."""


def _encode(value: Any) -> Any:
    """A low-level DynamoDB attribute value as JSON: binary as base64."""
    if isinstance(value, dict):
        return {k: _encode_typed(k, v) for k, v in value.items()}
    return value


def _encode_typed(kind: str, value: Any) -> Any:
    if kind == "B":
        return base64.b64encode(bytes(value)).decode()
    if kind == "BS":
        return [base64.b64encode(bytes(v)).decode() for v in value]
    if kind == "M":
        return {k: _encode(v) for k, v in value.items()}
    if kind == "L":
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _decode_typed(k, v) for k, v in value.items()}
    return value


def _decode_typed(kind: str, value: Any) -> Any:
    if kind == "B":
        return base64.b64decode(value)
    if kind == "BS":
        return [base64.b64decode(v) for v in value]
    if kind == "M":
        return {k: _decode(v) for k, v in value.items()}
    if kind == "L":
        return [_decode(v) for v in value]
    return value


def encode_item(item: dict[str, Any]) -> str:
    """One item as a line of JSON.

    >>> line = encode_item({"pk": {"S": "RUN#r"}, "body": {"B": b"\\x00z"}, "n": {"N": "3"}})
    >>> decode_item(line) == {"pk": {"S": "RUN#r"}, "body": {"B": b"\\x00z"}, "n": {"N": "3"}}
    True
    """
    return json.dumps({name: _encode(value) for name, value in item.items()}, separators=(",", ":"))


def decode_item(line: str) -> dict[str, Any]:
    return {name: _decode(value) for name, value in json.loads(line).items()}


class DevState:
    """The data directory of one ``ryusen dev``: load the table at start, save it while running and at stop."""

    def __init__(self, directory: Path, dynamodb: Any, table_name: str) -> None:
        self.directory = directory
        self.dynamodb = dynamodb
        self.table_name = table_name
        self._lock_file: IO[str] | None = None
        self._save_lock = threading.Lock()
        self._started_lock = threading.Lock()
        self._started: IO[str] | None = None

    @property
    def table_file(self) -> Path:
        return self.directory / TABLE_FILE

    def acquire(self, *, fresh: bool) -> None:
        """Take the directory (creating it); with ``fresh``, forget what it holds."""
        try:
            created = not self.directory.exists()
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if created:  # it holds every run's input and output: never committed with the project
                (self.directory / ".gitignore").write_text("# ryusen dev's state (runs' inputs and outputs)\n*\n")
            lock = (self.directory / LOCK_FILE).open("a")
        except OSError as exc:
            raise StateDirError(f"cannot use {self.directory} for ryusen dev's state: {exc.strerror}") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise StateDirError(
                f"another ryusen dev is using {self.directory}; stop it, or give this one --data DIR"
            ) from None
        self._lock_file = lock
        if fresh:
            self.table_file.unlink(missing_ok=True)
            self.started_file.unlink(missing_ok=True)

    @property
    def started_file(self) -> Path:
        return self.directory / STARTED_FILE

    def note_started(self, tasks: list[str]) -> None:
        """Append authorized attempts (``TaskRef`` JSON), flushed to the OS before the endpoint is called (a
        killed process loses nothing the OS holds)."""
        if not tasks:
            return
        with self._started_lock:
            if self._started is None:
                self._started = self.started_file.open("a")
            self._started.write("".join(f"{task}\n" for task in tasks))
            self._started.flush()

    def started_since_save(self) -> list[str]:
        """The authorizations the last save did not cover (what a killed stack may have started)."""
        try:
            return [line for line in self.started_file.read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            return []

    def _covered(self, upto: int) -> None:
        """Drop the first ``upto`` bytes of the log: a save that began after they were written covers them."""
        with self._started_lock:
            if self._started is not None:
                self._started.close()
                self._started = None
            try:
                rest = self.started_file.read_bytes()[upto:]
            except FileNotFoundError:
                return
            partial = self.started_file.with_suffix(".partial")
            partial.write_bytes(rest)
            partial.replace(self.started_file)

    def release(self) -> None:
        with self._started_lock:
            if self._started is not None:
                self._started.close()
                self._started = None
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    def load(self) -> list[str]:
        """Write the saved items into the (empty) table; the ids of the runs restored."""
        if not self.table_file.exists():
            return []
        runs: list[str] = []
        batch: list[dict[str, Any]] = []
        with self.table_file.open() as saved:
            header = json.loads(saved.readline() or "{}")
            if header.get("format") != FORMAT:
                raise StateDirError(
                    f"{self.table_file} is not a ryusen dev state file this version reads; move it away, or start"
                    " with --fresh"
                )
            for line in saved:
                if not line.strip():
                    continue
                item = decode_item(line)
                batch.append(item)
                if item.get("sk", {}).get("S") == "RUN":
                    runs.append(str(item["pk"]["S"]).removeprefix("RUN#"))
                if len(batch) == BATCH:
                    self._write(batch)
                    batch = []
        if batch:
            self._write(batch)
        return runs

    def _write(self, items: list[dict[str, Any]]) -> None:
        requests: dict[str, Any] = {self.table_name: [{"PutRequest": {"Item": item}} for item in items]}
        while requests:
            answer = self.dynamodb.batch_write_item(RequestItems=requests)
            requests = answer.get("UnprocessedItems") or {}

    def _scan(self) -> Iterator[dict[str, Any]]:
        start: dict[str, Any] | None = None
        while True:
            page = self.dynamodb.scan(TableName=self.table_name, **({"ExclusiveStartKey": start} if start else {}))
            yield from page.get("Items", [])
            start = page.get("LastEvaluatedKey")
            if not start:
                return

    def save(self) -> int:
        """Write the whole table to the directory, atomically (a crash mid-save leaves the last save)."""
        with self._save_lock:
            with self._started_lock:  # what was started before the scan began is in what it reads
                if self._started is not None:
                    self._started.flush()
                covered = self.started_file.stat().st_size if self.started_file.exists() else 0
            partial = self.table_file.with_suffix(".partial")
            count = 0
            partial.unlink(missing_ok=True)
            with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
                header = {"format": FORMAT, "table": self.table_name, "saved_at": datetime.now(UTC).isoformat()}
                out.write(json.dumps(header) + "\n")
                for item in self._scan():
                    out.write(encode_item(item) + "\n")
                    count += 1
                out.flush()
                os.fsync(out.fileno())
            partial.replace(self.table_file)
            self._covered(covered)
            return count


__all__ = ["DevState", "StateDirError", "decode_item", "encode_item"]

"""The endpoint's memo cache (the ``memo_cache`` feature): what a warm endpoint already holds is not sent again.

Every task request replays the run's memo of recorded step outcomes to the function. Without the cache,
each request carries the whole memo, so the bytes a run sends its endpoint grow with the square of its
length. With it, the server names each memo it sends with a token it mints (``memo_token``), and the
next request for the run carries only what changed since that memo (``memo_base``). This process keeps
the memos it was sent, a few per run and a bounded number in all; one it does not hold (another container,
a restart, an eviction) is a miss: the endpoint runs nothing and answers ``memo_miss``, and the server
sends the whole memo again. A miss costs a round trip, never a wrong memo: a token names exactly one
memo, minted once by one server process, and the count of entries is checked after the change is applied.

A kept pass (``kept.py``) waiting for its run's next attempt holds the memo it was last sent: the same
entries as the memo kept here under that token, which its next request must extend. While it waits, that
memo is *pinned* here: not pushed out, and counted with the result the pass reported on top (``pin``), so
that what the passes hold is within this cache's budget (``max_bytes``) and their next requests always find
their memo.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import pydantic_core

from .wire import MemoEntry, TaskRequest

MEMO_CACHE_ENTRIES = 1024
"""Memos kept by one endpoint process, over all runs (the least recently used goes first)."""
MEMO_CACHE_BYTES = 32 * 1024 * 1024
"""The memory those memos take, at most, as Python objects (a memo over this is used once, not kept)."""
MEMOS_PER_RUN = 2
"""Memos kept per run: the newest, and the one before for a request that was sent again."""


@dataclass(frozen=True, slots=True)
class _Held:
    run_id: str
    input: bytes
    """As JSON: each request gets a fresh copy, which its function may change (as it may a parsed one)."""
    memo: dict[str, MemoEntry]
    size: int
    """The memory it takes: its entries and input as Python objects (:func:`footprint`)."""


class MemoCache:
    """Memos by token, for the requests that extend them."""

    def __init__(self, entries: int = MEMO_CACHE_ENTRIES, max_bytes: int = MEMO_CACHE_BYTES) -> None:
        self.entries = entries
        self.max_bytes = max_bytes
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._bytes = 0
        """What the memos kept take, with what the pins add (``pin``)."""
        self._pins: dict[str, int] = {}
        """The tokens whose memo a kept pass holds, and the bytes it holds on top (the result it reported)."""
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def resolve(self, request: TaskRequest) -> TaskRequest | None:
        """``request`` with its whole memo and input, or None when it extends a memo this process lacks.

        A request with a ``memo_token`` leaves its whole memo here for the next request of its run.
        """
        base = request.memo_base
        if base is None:
            whole, input_json, held_size = request, b"", 0
            if request.memo_token is not None:
                input_json = pydantic_core.to_json(request.input)
                held_size = len(input_json) + sum(footprint(e) for e in request.memo.values())
        else:
            with self._lock:
                held = self._held.get(base.token)
                if held is not None:
                    self._held.move_to_end(base.token)
            if held is None or held.run_id != request.run_id:
                self.misses += 1
                return None
            memo = dict(held.memo)
            for step_id in base.removed:
                memo.pop(step_id, None)
            memo.update(request.memo)
            if len(memo) != base.count:
                self.misses += 1  # not the memo the server meant: it sends the whole one
                return None
            self.hits += 1
            input_json, held_size = held.input, held.size + sum(footprint(e) for e in request.memo.values())
            run_input = pydantic_core.from_json(input_json)
            whole = request.model_copy(update={"memo": memo, "input": run_input, "memo_base": None})
        if request.memo_token is not None:
            # a copy: the memo kept must not be the dict the request's pass holds
            self._keep(request.memo_token, _Held(request.run_id, input_json, dict(whole.memo), held_size))
        return whole

    def _keep(self, token: str, held: _Held) -> None:
        if held.size > self.max_bytes:
            return
        with self._lock:
            previous = self._held.pop(token, None)
            if previous is not None:
                self._bytes -= previous.size
            self._held[token] = held
            self._bytes += held.size
            same_run = [t for t, h in self._held.items() if h.run_id == held.run_id and t not in self._pins]
            for stale in same_run[:-MEMOS_PER_RUN]:
                self._bytes -= self._held.pop(stale).size
            self._make_room()

    def _make_room(self) -> None:
        """Drop the least recently used memos that no pass holds until the count and the bytes are within bounds
        (with the lock held)."""
        if len(self._held) <= self.entries and self._bytes <= self.max_bytes:
            return
        for token in list(self._held):
            if len(self._held) <= self.entries and self._bytes <= self.max_bytes:
                return
            if token not in self._pins:
                self._bytes -= self._held.pop(token).size

    def pin(self, token: str, extra: int, *, within: int) -> bool:
        """Keep the memo under ``token`` while a kept pass holds it, counted with ``extra`` bytes the pass holds
        on top, if all pinned memos then take at most ``within`` bytes. False (nothing pinned): this process
        no longer holds that memo, or it does not fit."""
        with self._lock:
            held = self._held.get(token)
            if held is None or token in self._pins or self._pinned_bytes() + held.size + extra > within:
                return False
            self._pins[token] = extra
            self._bytes += extra
            self._held.move_to_end(token)
            self._make_room()
            return True

    def unpin(self, token: str) -> None:
        """The pass no longer holds the memo: it may be pushed out again, and what it held on top is not counted."""
        with self._lock:
            extra = self._pins.pop(token, None)
            if extra is not None:
                self._bytes -= extra
                self._make_room()

    def _pinned_bytes(self) -> int:
        return sum(self._held[token].size + extra for token, extra in self._pins.items())

    @property
    def pinned_bytes(self) -> int:
        """What the kept passes hold: the memos pinned, and what each holds on top."""
        with self._lock:
            return self._pinned_bytes()

    def pinned(self) -> dict[str, dict[str, MemoEntry]]:
        """The memos pinned, by token."""
        with self._lock:
            return {token: dict(self._held[token].memo) for token in self._pins}

    def hold(self, request: TaskRequest) -> int | None:
        """What the memo of ``request`` (a whole one, as :meth:`resolve` returns it) takes here under its token:
        kept now if this process has not kept it yet (a request run without :meth:`resolve`). None: it has no
        token, or it is over the budget."""
        token = request.memo_token
        if token is None:
            return None
        size = self.size_of(token)
        if size is None and request.memo_base is None:
            input_json = pydantic_core.to_json(request.input)
            held_size = len(input_json) + sum(footprint(e) for e in request.memo.values())
            self._keep(token, _Held(request.run_id, input_json, dict(request.memo), held_size))
            size = self.size_of(token)
        return size

    def size_of(self, token: str) -> int | None:
        """What the memo kept under ``token`` takes (None: this process does not hold it)."""
        with self._lock:
            held = self._held.get(token)
        return None if held is None else held.size

    def held(self, token: str) -> tuple[Any, dict[str, MemoEntry]] | None:
        """The input and memo kept under ``token``, if this process holds it."""
        with self._lock:
            held = self._held.get(token)
        return None if held is None else (pydantic_core.from_json(held.input), dict(held.memo))

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
            self._pins.clear()
            self._bytes = 0


def footprint(entry: MemoEntry) -> int:
    """About how much memory a memo entry takes: ``sys.getsizeof`` over its objects (a small JSON text
    such as ``[{}, {}]`` takes twenty times its length as Python objects, so request bytes would not do)."""
    total = sys.getsizeof(entry) + 64
    stack: list[Any] = [entry.result, entry.error.data if entry.error is not None else None]
    if entry.error is not None:
        total += sys.getsizeof(entry.error) + len(entry.error.message) + len(entry.error.type)
    while stack:
        item = stack.pop()
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total

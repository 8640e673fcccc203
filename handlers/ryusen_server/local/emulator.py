"""What ``ryusen dev`` changes in its embedded moto so that it holds up under load (issue 12's 1,000 runs).

* **One DynamoDB request at a time.** moto's backends are not thread-safe: under load a ``TransactWriteItems`` that
  copies a table while another thread inserts into it raised ``dictionary changed size during iteration``.
  moto shares the one process (and its one GIL) with the engine anyway, so serving its requests one at a time
  costs no parallelism.
* **A failed transaction is undone from the items it named, not a copy of every table it touched.** moto
  deep-copies each table a ``TransactWriteItems`` touches, to restore it if the transaction fails: that is
  the whole table for every step a run takes, so the dev stack slowed as it filled (5 effects/s at 600
  runs). The snapshot made here shares every item with the live table except the ones the transaction
  names (each deep-copied), which are the only items a transaction can change; restoring it gives the
  table back exactly as before. tests/functional/test_dev_emulator.py checks a failed transaction leaves
  the table as it was.
* **A query reads its partition, not the table.** moto answers every ``Query`` by listing the whole table,
  sorted (every run's every item), and keeping the items of the asked partition: with 1,000 runs that was
  most of the dev stack's time. Here a query on the table's own key is given only its partition's items,
  and a query on an index is given the table's items unsorted (moto sorts what it keeps by the index's
  keys). The answer is the same for items whose key attributes have the types the table declares
  (DynamoDB refuses any other; moto stores them, and then orders such items by the order it found them
  in); tests/functional/test_dev_emulator.py checks it against moto's own.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

_installed = False
_install_lock = threading.Lock()


class _Snapshots:
    """Stands in for the ``copy`` module inside moto's DynamoDB backend while a transaction runs."""

    def __init__(self, table_type: type, dynamo_type: Callable[[Any], Any]) -> None:
        self._table_type = table_type
        self._dynamo_type = dynamo_type
        self.local = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(copy, name)

    def deepcopy(self, value: Any, memo: Any = None) -> Any:
        named = getattr(self.local, "items", None)
        if named is None or not isinstance(value, self._table_type) or getattr(value, "stream_shard", None) is not None:
            return copy.deepcopy(value, memo)  # a table with a stream keeps moto's whole copy (its records roll back)
        return self._snapshot(value, named)

    def _snapshot(self, table: Any, named: list[dict[str, Any]]) -> Any:
        snapshot = copy.copy(table)
        ranged = table.range_key_attr is not None
        items: Any = defaultdict(dict)
        for hash_value, value in table.items.items():
            items[hash_value] = dict(value) if ranged else value
        for op in named:
            if op.get("TableName") != table.name:
                continue
            key = op.get("Key") or op.get("Item") or {}
            if table.hash_key_attr not in key:
                continue
            hash_value = self._dynamo_type(key[table.hash_key_attr])
            if ranged:
                if table.range_key_attr not in key:
                    continue
                range_value = self._dynamo_type(key[table.range_key_attr])
                live = table.items.get(hash_value, {}).get(range_value)
                if live is not None:
                    items[hash_value][range_value] = copy.deepcopy(live)
            elif hash_value in table.items:
                items[hash_value] = copy.deepcopy(table.items[hash_value])
        snapshot.items = items
        return snapshot


def install() -> None:
    """Make failed transactions undo only the items they named (idempotent; this process's moto only)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from moto.dynamodb import models
        from moto.dynamodb.models.dynamo_type import DynamoType
        from moto.dynamodb.models.table import Table

        snapshots = _Snapshots(Table, DynamoType)
        original = models.DynamoDBBackend.transact_write_items

        def transact_write_items(self: Any, transact_items: list[dict[str, Any]]) -> None:
            snapshots.local.items = [next(iter(item.values())) for item in transact_items]
            try:
                original(self, transact_items)
            finally:
                snapshots.local.items = None

        models.copy = snapshots  # type: ignore[attr-defined,assignment]
        models.DynamoDBBackend.transact_write_items = transact_write_items  # type: ignore[method-assign]
        _narrow_queries(Table)
        _installed = True


def _narrow_queries(table_type: Any) -> None:
    """While a ``Table.query`` runs on this thread, the table's ``all_items`` lists only what it can match."""
    import inspect

    original_query, original_all_items = table_type.query, table_type.all_items
    signature = inspect.signature(original_query)
    scope = threading.local()

    def all_items(self: Any) -> Any:
        if getattr(scope, "table", None) is self:
            return scope.items
        return original_all_items(self)

    @functools.wraps(original_query)
    def query(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        hash_key, index_name = bound.arguments.get("hash_key"), bound.arguments.get("index_name")
        if index_name:
            narrowed = [item for partition in self.items.values() for item in _items_of(self, partition)]
        elif hash_key is not None:
            partition = self.items.get(hash_key)
            narrowed = [] if partition is None else list(_items_of(self, partition))
        else:
            return original_query(self, *args, **kwargs)
        scope.table, scope.items = self, narrowed
        try:
            return original_query(self, *args, **kwargs)
        finally:
            scope.table, scope.items = None, None

    table_type.query = query
    table_type.all_items = all_items


def _items_of(table: Any, partition: Any) -> Iterable[Any]:
    return partition.values() if table.range_key_attr else (partition,)


def one_at_a_time(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """A WSGI app that serves one DynamoDB request at a time (its whole response is produced under the lock).
    Other services go through as they come: an SQS receive long-polls, and must not hold up the table."""
    lock = threading.Lock()

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not str(environ.get("HTTP_X_AMZ_TARGET", "")).startswith("DynamoDB"):
            return app(environ, start_response)
        with lock:
            return list(app(environ, start_response))

    return serve

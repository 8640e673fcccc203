"""The scale model's check: reads and writes per DynamoDB key, per run, projected to 10, 100 and 1,000 runs/s.

    .venv/bin/python bench/scale.py                 # 20 runs of 10 steps on the DynamoDB store (moto)
    .venv/bin/python bench/scale.py --runs 40 --steps 20

It drives the real engine (ryusen.testing, the DynamoDB store on moto) and counts, with a botocore hook on
every request, the read and write units each partition key takes: base-table keys, and the index partitions
(``RUNS#n``, ``CHECK#n``) a head write also writes. A key shared by runs (a function's release pointers, the
release, the index shards) takes its count per run times the rate; a run's own key (``RUN#id``) takes its
count over the run's life, whatever the rate. It prints a line per key class and rate, and OK or OVER
against a third of a partition's limit (3,000 read units/s, 1,000 write units/s): figures, not a test.
docs/design/scale.md records them.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections import Counter
from typing import Any

RATES = (10, 100, 1000)
READ_LIMIT, WRITE_LIMIT = 3000.0, 1000.0


def key_class(pk: str) -> str:
    """Keys grouped by what they are: a run's own, one function's release pointer copy, an index shard..."""
    for pattern, name in (
        (r"^RUN#", "RUN#<run>"),
        (r"^IDEM#", "IDEM#<key>"),
        (r"^FN#.*#\d+$", "FN#<function>#<copy>"),
        (r"^REL#", "REL#<release>"),
        (r"^RUNS#", "RUNS#<shard> (list index)"),
        (r"^CHECK#", "CHECK#<shard> (sweep index)"),
    ):
        if re.match(pattern, pk):
            return name
    return pk


class KeyCounter:
    """Read and write units by partition key, from the requests a DynamoDB client sends."""

    def __init__(self, client: Any) -> None:
        self.reads: Counter[str] = Counter()
        self.writes: Counter[str] = Counter()
        events = client.meta.events
        events.register("provide-client-params.dynamodb.GetItem", self._get)
        events.register("provide-client-params.dynamodb.Query", self._query)
        events.register("provide-client-params.dynamodb.BatchGetItem", self._batch_get)
        events.register("provide-client-params.dynamodb.PutItem", self._put)
        events.register("provide-client-params.dynamodb.UpdateItem", self._update)
        events.register("provide-client-params.dynamodb.BatchWriteItem", self._batch_write)
        events.register("provide-client-params.dynamodb.TransactWriteItems", self._transact)

    def _get(self, params: dict[str, Any], **_: Any) -> None:
        self.reads[params["Key"]["pk"]["S"]] += 1

    def _query(self, params: dict[str, Any], **_: Any) -> None:
        values = params["ExpressionAttributeValues"]
        pk = next(v["S"] for k, v in values.items() if k in (":pk", ":runs", ":apps", ":fn"))
        self.reads[pk] += 1

    def _batch_get(self, params: dict[str, Any], **_: Any) -> None:
        for request in params["RequestItems"].values():
            for key in request["Keys"]:
                self.reads[key["pk"]["S"]] += 1

    def _item(self, item: dict[str, Any], units: int = 1) -> None:
        from ryusen_server.aws.store import _item_bytes

        size = units * max(1, math.ceil(_item_bytes(item) / 1024))
        self.writes[item["pk"]["S"]] += size
        for index_key in ("list_pk", "check_pk"):  # the index partitions this write also writes
            if index_key in item:
                self.writes[item[index_key]["S"]] += 1

    def _put(self, params: dict[str, Any], **_: Any) -> None:
        self._item(params["Item"])

    def _update(self, params: dict[str, Any], units: int = 1, **_: Any) -> None:
        pk = params["Key"]["pk"]["S"]
        self.writes[pk] += units
        shard = re.sub(r"^RUN#", "", pk)
        if "check_at" in params["UpdateExpression"]:
            self.writes[f"CHECK#<of {shard}>"] += 1
        if "list_pk" in params["UpdateExpression"]:
            self.writes[f"RUNS#<of {shard}>"] += 1
            self.writes[f"CHECK#<of {shard}>"] += 1

    def _batch_write(self, params: dict[str, Any], **_: Any) -> None:
        for requests in params["RequestItems"].values():
            for request in requests:
                self._item(request["PutRequest"]["Item"])

    def _transact(self, params: dict[str, Any], **_: Any) -> None:
        for entry in params["TransactItems"]:
            if "Put" in entry:
                self._item(entry["Put"]["Item"], units=2)
            elif "Update" in entry:
                self._update(entry["Update"], units=2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    from ryusen import Ryusen, Step
    from ryusen.testing import WorkflowEnvironment
    from ryusen_server.aws.store import LIST_SHARDS, DynamoStore

    app = Ryusen("bench")

    @app.function("straight")
    def straight(data: dict[str, Any], step: Step) -> int:
        return sum(step.run(f"step-{i}", lambda i=i: i) for i in range(data["steps"]))

    with WorkflowEnvironment(app, store="moto") as env:
        store = env.store
        assert isinstance(store, DynamoStore)
        env.run("straight", {"steps": args.steps})  # warm: the release read once, the process's caches
        keys = KeyCounter(store._client)
        for n in range(args.runs):
            run = env.run("straight", {"steps": args.steps, "n": n}, idempotency_key=f"order-{n}")
            assert run.outcome == "completed", run.summary
        reads, writes = keys.reads, keys.writes

    # index writes named by the run they came from belong to one of the 16 shards
    for counter in (reads, writes):
        for pk in [k for k in counter if "<of " in k]:
            counter[pk.split("#")[0] + "#<shard>"] += counter.pop(pk) / LIST_SHARDS * LIST_SHARDS
    classes: dict[str, dict[str, float]] = {}
    for counter, kind in ((reads, "read"), (writes, "write")):
        for pk, units in counter.items():
            entry = classes.setdefault(key_class(pk), {"keys": 0.0, "read": 0.0, "write": 0.0, "busiest": 0.0})
            entry[kind] += units
    for counter in (reads, writes):
        for pk in counter:
            classes[key_class(pk)]["keys"] += 1
    runs = args.runs
    print(f"{runs} runs of {args.steps} steps on the DynamoDB store (moto); units per run, by key class")
    print(f"{'key class':32} {'keys':>5} {'reads/run':>10} {'writes/run':>11}  projected busiest key, units/s")
    worst = "OK"
    for name, entry in sorted(classes.items()):
        per_run_r, per_run_w = entry["read"] / runs, entry["write"] / runs
        if name == "RUN#<run>" or name == "IDEM#<key>":
            shared = 1  # one run's own key: its count over the run's life, not per second of the rate
        elif name.startswith(("RUNS#", "CHECK#")):
            shared = LIST_SHARDS
        elif name.startswith("FN#"):
            from ryusen_server.aws.store import RELEASE_COPIES

            shared = RELEASE_COPIES
        else:
            shared = 1
        line = f"{name:32} {int(entry['keys']):>5} {per_run_r:>10.2f} {per_run_w:>11.2f} "
        if name in ("RUN#<run>", "IDEM#<key>"):
            print(
                line + f" per run over its life ({per_run_r / args.steps:.2f} reads, "
                f"{per_run_w / args.steps:.2f} writes a step): independent of the rate"
            )
            continue
        figures = []
        for rate in RATES:
            r, w = per_run_r * rate / shared, per_run_w * rate / shared
            ok = r <= READ_LIMIT / 3 and w <= WRITE_LIMIT / 3
            worst = worst if ok else "OVER"
            figures.append(f"{rate}/s: {r:.0f} R {w:.0f} W {'OK' if ok else 'OVER'}")
        print(line + " | ".join(figures))
    print(f"every shared key within a third of a partition (1,000 RRU/s, 333 WRU/s) at 1,000 runs/s: {worst}")
    return 0 if worst == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())

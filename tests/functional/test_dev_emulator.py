"""``ryusen dev``'s changes to its embedded moto (local/emulator.py): a failed TransactWriteItems still leaves
the table exactly as it was, while its snapshot copies only the items the transaction names."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from ryusen_server.local import emulator

TABLE = "emulated"


@pytest.fixture
def dynamodb() -> Iterator[Any]:
    emulator.install()
    with mock_aws():
        client = boto3.client("dynamodb", region_name="us-east-1")
        client.create_table(
            TableName=TABLE,
            AttributeDefinitions=[
                {"AttributeName": "pk", "AttributeType": "S"},
                {"AttributeName": "sk", "AttributeType": "S"},
            ],
            KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}, {"AttributeName": "sk", "KeyType": "RANGE"}],
            BillingMode="PAY_PER_REQUEST",
        )
        yield client


def item(pk: str, sk: str, **values: str) -> dict[str, Any]:
    return {"pk": {"S": pk}, "sk": {"S": sk}, **{k: {"S": v} for k, v in values.items()}}


def everything(client: Any) -> list[dict[str, Any]]:
    return sorted(client.scan(TableName=TABLE)["Items"], key=lambda i: (i["pk"]["S"], i["sk"]["S"]))


def test_a_failed_transaction_leaves_the_table_as_it_was(dynamodb: Any) -> None:
    for n in range(20):
        dynamodb.put_item(TableName=TABLE, Item=item(f"run#{n}", "head", status="running"))
    before = everything(dynamodb)
    with pytest.raises(ClientError) as raised:
        dynamodb.transact_write_items(
            TransactItems=[
                {"Put": {"TableName": TABLE, "Item": item("run#3", "v#1", entry="new")}},  # a new item
                {
                    "Update": {  # changes an item in place, then the next condition fails
                        "TableName": TABLE,
                        "Key": {"pk": {"S": "run#4"}, "sk": {"S": "head"}},
                        "UpdateExpression": "SET #s = :s",
                        "ExpressionAttributeNames": {"#s": "status"},
                        "ExpressionAttributeValues": {":s": {"S": "finished"}},
                    }
                },
                {
                    "Put": {
                        "TableName": TABLE,
                        "Item": item("run#5", "head", status="replaced"),
                        "ConditionExpression": "attribute_not_exists(pk)",
                    }
                },
            ]
        )
    assert raised.value.response["Error"]["Code"] == "TransactionCanceledException"
    assert everything(dynamodb) == before


def test_a_transaction_that_commits_is_applied(dynamodb: Any) -> None:
    dynamodb.put_item(TableName=TABLE, Item=item("run#1", "head", status="running"))
    dynamodb.transact_write_items(
        TransactItems=[
            {
                "Put": {
                    "TableName": TABLE,
                    "Item": item("run#1", "v#2", entry="e"),
                    "ConditionExpression": "attribute_not_exists(pk)",
                }
            },
            {
                "Update": {
                    "TableName": TABLE,
                    "Key": {"pk": {"S": "run#1"}, "sk": {"S": "head"}},
                    "UpdateExpression": "SET #s = :s",
                    "ConditionExpression": "#s = :r",
                    "ExpressionAttributeNames": {"#s": "status"},
                    "ExpressionAttributeValues": {":s": {"S": "finished"}, ":r": {"S": "running"}},
                }
            },
        ]
    )
    assert everything(dynamodb) == [item("run#1", "head", status="finished"), item("run#1", "v#2", entry="e")]


def test_the_snapshot_copies_only_the_items_the_transaction_names(
    dynamodb: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for n in range(300):
        dynamodb.put_item(TableName=TABLE, Item=item(f"run#{n}", "head", status="running"))
    copied: list[Any] = []
    deepcopy = copy.deepcopy

    def counting(value: Any, memo: Any = None) -> Any:
        copied.append(type(value).__name__)
        return deepcopy(value, memo)

    monkeypatch.setattr(copy, "deepcopy", counting)
    dynamodb.transact_write_items(
        TransactItems=[
            {"Put": {"TableName": TABLE, "Item": item("run#7", "v#1", entry="e")}},
            {
                "Update": {
                    "TableName": TABLE,
                    "Key": {"pk": {"S": "run#7"}, "sk": {"S": "head"}},
                    "UpdateExpression": "SET #s = :s",
                    "ExpressionAttributeNames": {"#s": "status"},
                    "ExpressionAttributeValues": {":s": {"S": "finished"}},
                }
            },
        ]
    )
    assert copied.count("Item") <= 4 and "Table" not in copied, (
        copied
    )  # a few items (moto copies one it updates), not 300


def test_dynamodb_requests_are_served_one_at_a_time_and_others_pass() -> None:
    """An SQS receive long-polls: holding the table's lock while it waits stalled the whole dev stack."""
    import threading

    inside = threading.Event()
    release = threading.Event()
    served: list[str] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        target = environ.get("HTTP_X_AMZ_TARGET", "")
        if target == "DynamoDB_20120810.TransactWriteItems":
            inside.set()
            release.wait(5)
        served.append(target)
        return [b"{}"]

    serve = emulator.one_at_a_time(app)
    slow = threading.Thread(target=serve, args=({"HTTP_X_AMZ_TARGET": "DynamoDB_20120810.TransactWriteItems"}, None))
    slow.start()
    assert inside.wait(5)
    serve({"HTTP_X_AMZ_TARGET": "AmazonSQS.ReceiveMessage"}, None)  # not held up by the table's lock
    blocked = threading.Thread(target=serve, args=({"HTTP_X_AMZ_TARGET": "DynamoDB_20120810.GetItem"}, None))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive() and served == ["AmazonSQS.ReceiveMessage"]  # waits for the transaction
    release.set()
    slow.join(5)
    blocked.join(5)
    assert served == ["AmazonSQS.ReceiveMessage", "DynamoDB_20120810.TransactWriteItems", "DynamoDB_20120810.GetItem"]


def pages(client: Any, **query: Any) -> list[list[dict[str, Any]]]:
    """Every page of a query, as moto answers it."""
    answered: list[list[dict[str, Any]]] = []
    while True:
        response = client.query(TableName=INDEXED, **query)
        answered.append(response["Items"])
        if "LastEvaluatedKey" not in response:
            return answered
        query["ExclusiveStartKey"] = response["LastEvaluatedKey"]


INDEXED = "indexed"

QUERIES: list[dict[str, Any]] = [
    {"KeyConditionExpression": "pk = :p", "ExpressionAttributeValues": {":p": {"S": "run#7"}}},
    {
        "KeyConditionExpression": "pk = :p AND sk BETWEEN :a AND :b",
        "ExpressionAttributeValues": {":p": {"S": "run#3"}, ":a": {"S": "v#0002"}, ":b": {"S": "v#0005"}},
    },
    {
        "KeyConditionExpression": "pk = :p AND begins_with(sk, :v)",
        "ExpressionAttributeValues": {":p": {"S": "run#11"}, ":v": {"S": "v#"}},
        "Limit": 3,
        "ScanIndexForward": False,
    },
    {"KeyConditionExpression": "pk = :p", "ExpressionAttributeValues": {":p": {"S": "run#absent"}}},
    {
        "KeyConditionExpression": "pk = :p",
        "FilterExpression": "#s = :s",
        "ExpressionAttributeNames": {"#s": "status"},
        "ExpressionAttributeValues": {":p": {"S": "run#5"}, ":s": {"S": "running"}},
        "Limit": 2,
    },
    {
        "IndexName": "by-shard",
        "KeyConditionExpression": "shard = :s",
        "ExpressionAttributeValues": {":s": {"S": "shard-1"}},
        "Limit": 4,
    },
    {
        "IndexName": "by-shard",
        "KeyConditionExpression": "shard = :s AND at_time > :t",
        "ExpressionAttributeValues": {":s": {"S": "shard-0"}, ":t": {"S": "2026-12-04T00:00:10"}},
        "ScanIndexForward": False,
        "Limit": 3,
    },
]


def test_a_query_reads_only_what_it_can_match_and_answers_as_moto_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """moto lists (and sorts) the whole table for every query; the emulator gives a query on the table's key only
    its partition, and an index query the items unsorted. Every page must be what moto itself answers."""
    from moto.dynamodb.models.table import Table

    emulator.install()
    with mock_aws():
        client = boto3.client("dynamodb", region_name="us-east-1")
        client.create_table(
            TableName=INDEXED,
            AttributeDefinitions=[
                {"AttributeName": name, "AttributeType": "S"} for name in ("pk", "sk", "shard", "at_time")
            ],
            KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}, {"AttributeName": "sk", "KeyType": "RANGE"}],
            GlobalSecondaryIndexes=[
                {
                    "IndexName": "by-shard",
                    "KeySchema": [
                        {"AttributeName": "shard", "KeyType": "HASH"},
                        {"AttributeName": "at_time", "KeyType": "RANGE"},
                    ],
                    "Projection": {"ProjectionType": "ALL"},
                }
            ],
            BillingMode="PAY_PER_REQUEST",
        )
        for n in range(20):
            head = item(f"run#{n}", "head", status="running" if n % 3 else "finished")
            if n % 2:  # only some runs are in the index
                head |= {"shard": {"S": f"shard-{n % 4 // 2}"}, "at_time": {"S": f"2026-12-04T00:00:{n:02d}"}}
            client.put_item(TableName=INDEXED, Item=head)
            for v in range(8):
                client.put_item(TableName=INDEXED, Item=item(f"run#{n}", f"v#{v:04d}", status="running"))

        listed: list[int] = []  # how many items each query was given to look through
        all_items = Table.all_items

        def counting(self: Any) -> Any:
            items = all_items(self)
            listed.append(len(items))
            return items

        monkeypatch.setattr(Table, "all_items", counting)
        on_the_key = [q for q in QUERIES if "IndexName" not in q]
        narrowed = [pages(client, **copy.deepcopy(query)) for query in on_the_key]
        assert listed and max(listed) <= 9  # a run's partition (a head and 8 versions), not the table's 180
        narrowed += [pages(client, **copy.deepcopy(query)) for query in QUERIES if "IndexName" in query]
        listed.clear()
        monkeypatch.setattr(Table, "query", Table.query.__wrapped__)  # moto's own
        plain = [pages(client, **copy.deepcopy(query)) for query in on_the_key]
        assert min(listed) == 180  # moto's own goes through the whole table: the count above could see it
        plain += [pages(client, **copy.deepcopy(query)) for query in QUERIES if "IndexName" in query]
        assert narrowed == plain
        assert [sum(len(p) for p in answer) for answer in plain] == [9, 4, 8, 0, 9, 5, 2]

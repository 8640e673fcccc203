"""What ``ryusen dev`` writes in its data directory (``.ryusen`` in the working directory by default) holds every
run's input, output and errors: it is kept out of the project's version control and away from other users."""

from __future__ import annotations

import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws

from ryusen_server.aws.store import DynamoStore, create_table
from ryusen_server.local.state import DevState
from ryusen_server.ports import RequestCounter

from .test_store_contract import Runs

TABLE = "ryusen-dev"


@pytest.fixture
def client(aws_env: None) -> Iterator[Any]:
    with mock_aws():
        dynamodb = boto3.client("dynamodb", region_name="us-east-1")
        create_table(dynamodb, TABLE)
        yield dynamodb


def saved_project(client: Any, project: Path) -> Path:
    Runs(DynamoStore(client, TABLE, RequestCounter())).start("run_1", input={"api_token": "secret-token-123"})
    state = DevState(project / ".ryusen", client, TABLE)
    state.acquire(fresh=False)
    try:
        state.save()
    finally:
        state.release()
    create_table(client, "restored")  # the file holds the input (compressed, not encrypted)
    DevState(project / ".ryusen", client, "restored").load()
    restored = DynamoStore(client, "restored", RequestCounter()).get("run_1")
    assert restored is not None and restored.input == {"api_token": "secret-token-123"}
    return project / ".ryusen"


def test_the_data_directory_is_not_committed_with_the_project(client: Any, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    saved_project(client, project)
    untracked = subprocess.run(
        ["git", "-C", str(project), "status", "--porcelain", "--untracked-files=all"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert ".ryusen" not in untracked, f"git add -A would commit the runs' data:\n{untracked}"


def test_the_saved_table_is_readable_only_by_its_owner(client: Any, tmp_path: Path) -> None:
    data = saved_project(client, tmp_path)
    mode = (data / "table.jsonl").stat().st_mode
    assert not mode & (stat.S_IRWXG | stat.S_IRWXO), f"table.jsonl is {stat.filemode(mode)}"

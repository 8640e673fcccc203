"""Review probes of a re-read of the signing key that skips AWSPREVIOUS when AWSCURRENT is the same version.

Found and fixed: ``ryusen key rotate --emergency`` puts the new value, then detaches AWSPREVIOUS; a re-read
between the two held both keys, and every later re-read (same AWSCURRENT version) kept the leaked key for its
whole window. A read that still accepts a previous key now always reads AWSPREVIOUS again. Held: a cold start
fails closed, a failed re-read keeps the keys read before, a secret without VersionId is read in full."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from click.testing import CliRunner
from moto import mock_aws

from ryusen._internal import app as app_module
from ryusen._internal.signing import read_secret
from ryusen_server.cli import cli
from ryusen_server.wiring import SecretKey

OLD = "review-secret-old-0123456789abcdef0123"
NEW = "review-secret-new-fedcba9876543210fedc"


@pytest.fixture
def secret(aws_env: None) -> Iterator[tuple[Any, str]]:
    with mock_aws():
        client = boto3.client("secretsmanager", region_name="us-east-1")
        arn = client.create_secret(Name="ryusen-master", SecretString=OLD)["ARN"]
        yield client, arn


def test_emergency_rotation_read_mid_command_keeps_leaked_key_accepted(secret: tuple[Any, str]) -> None:
    """`ryusen key rotate --emergency` is put_secret_value, then detach AWSPREVIOUS: two calls. An engine
    re-read landing between them caches (new, OLD) under the NEW version id; every later re-read sees the same
    AWSCURRENT version and returns that cache, so the leaked OLD key stays accepted for the whole window."""
    client, arn = secret
    now = [0.0]
    key = SecretKey(client, arn, ttl_s=300, clock=lambda: now[0], recheck_s=10)
    assert key.keys() == (OLD, None)

    def engine_reads_in_the_gap(**_: Any) -> None:  # just before the CLI detaches AWSPREVIOUS
        now[0] += 11
        key.fresh_keys()

    events = boto3._get_default_session().events
    events.register("before-call.secrets-manager.DescribeSecret", engine_reads_in_the_gap)
    try:
        result = CliRunner().invoke(cli, ["key", "rotate", "--secret", arn, "--emergency"])
    finally:
        events.unregister("before-call.secrets-manager.DescribeSecret", engine_reads_in_the_gap)
    assert result.exit_code == 0, result.output
    assert "AWSPREVIOUS" not in str(client.describe_secret(SecretId=arn)["VersionIdsToStages"])
    now[0] += 11
    _, previous = key.fresh_keys()
    assert previous is None, f"emergency rotation finished, but the engine still accepts the old key {previous!r}"


def test_emergency_rotation_read_mid_command_app_side(secret: tuple[Any, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The same race in an app that reads its key from a secret (sdk app._secret_keys)."""
    client, arn = secret
    monkeypatch.setattr(app_module, "_SECRETS", {})
    t = [1000.0]
    assert app_module._secret_keys(arn, t[0]) == (OLD, None)
    client.put_secret_value(SecretId=arn, SecretString=NEW)  # step 1 of --emergency
    t[0] += 301
    app_module._secret_keys(arn, t[0])  # the app's TTL re-read lands here
    old_version = next(
        v for v, s in client.describe_secret(SecretId=arn)["VersionIdsToStages"].items() if "AWSPREVIOUS" in s
    )
    client.update_secret_version_stage(SecretId=arn, VersionStage="AWSPREVIOUS", RemoveFromVersionId=old_version)
    t[0] += 301
    assert app_module._secret_keys(arn, t[0]) == (NEW, None)


def test_by_hand_detach_without_new_version_is_unseen(secret: tuple[Any, str]) -> None:
    """Documented in security.md, but a regression: the old re-read honoured it within recheck_s."""
    client, arn = secret
    now = [0.0]
    key = SecretKey(client, arn, ttl_s=300, clock=lambda: now[0], recheck_s=10)
    client.put_secret_value(SecretId=arn, SecretString=NEW)
    assert key.keys() == (NEW, OLD)
    old_version = next(
        v for v, s in client.describe_secret(SecretId=arn)["VersionIdsToStages"].items() if "AWSPREVIOUS" in s
    )
    client.update_secret_version_stage(SecretId=arn, VersionStage="AWSPREVIOUS", RemoveFromVersionId=old_version)
    now[0] += 11
    assert key.fresh_keys() == (NEW, None)


def test_cold_start_failure_fails_closed_and_reread_failure_keeps_keys(secret: tuple[Any, str]) -> None:
    client, arn = secret
    now = [0.0]
    broken = SecretKey(client, arn + "-missing", clock=lambda: now[0])
    with pytest.raises(client.exceptions.ResourceNotFoundException):
        broken.keys()
    key = SecretKey(client, arn, ttl_s=300, clock=lambda: now[0], recheck_s=10)
    client.put_secret_value(SecretId=arn, SecretString=NEW)
    assert key.keys() == (NEW, OLD)

    def fail(**_: Any) -> None:
        raise RuntimeError("throttled")

    client.meta.events.register("before-call.secrets-manager.GetSecretValue", fail)
    now[0] += 11
    assert key.fresh_keys() == (NEW, OLD)  # kept
    client.meta.events.unregister("before-call.secrets-manager.GetSecretValue", fail)
    # AWSCURRENT ok but AWSPREVIOUS fails after a rotation: keep old read, as before
    client.put_secret_value(SecretId=arn, SecretString="review-third-key-000000000000000000")
    calls = Counter[str]()

    def fail_previous(params: dict[str, Any], **_: Any) -> None:
        calls[params["VersionStage"]] += 1
        if params["VersionStage"] == "AWSPREVIOUS":
            raise RuntimeError("throttled")

    client.meta.events.register("provide-client-params.secrets-manager.GetSecretValue", fail_previous)
    now[0] += 11
    assert key.fresh_keys() == (NEW, OLD)
    assert calls == Counter({"AWSCURRENT": 1, "AWSPREVIOUS": 1})


def test_empty_current_with_known_still_fails_closed_on_cold_start(secret: tuple[Any, str]) -> None:
    client, arn = secret
    first = read_secret(client, arn)
    client.put_secret_value(SecretId=arn, SecretString="   ")
    again = read_secret(client, arn, known=first)
    assert again.current is None and again.previous == OLD


class NoVersionClient:
    """A client whose answers carry no VersionId: both stages are read every time."""

    def __init__(self, inner: Any) -> None:
        self._inner, self.exceptions, self.calls = inner, inner.exceptions, Counter[str]()

    def get_secret_value(self, **kw: Any) -> dict[str, Any]:
        self.calls[kw["VersionStage"]] += 1
        answer = dict(self._inner.get_secret_value(**kw))
        answer.pop("VersionId", None)
        return answer


def test_without_version_id_both_stages_are_read(secret: tuple[Any, str]) -> None:
    client, arn = secret
    stub = NoVersionClient(client)
    first = read_secret(stub, arn)
    assert first.version_id is None
    client.put_secret_value(SecretId=arn, SecretString=NEW)
    again = read_secret(stub, arn, known=first)
    assert (again.current, again.previous) == (NEW, OLD)
    assert stub.calls == Counter({"AWSCURRENT": 2, "AWSPREVIOUS": 2})

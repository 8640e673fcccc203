"""A re-read of the signing key secret costs one request when nothing was rotated, and still sees a rotation.

The result function re-reads the secret at most every 10 s while late results arrive (an emergency rotation
must refuse the old key there within that time), and every function every 5 minutes. Each re-read took two
GetSecretValue requests (AWSCURRENT and AWSPREVIOUS), $0.05 per 10,000: the cost bench charged $1.00 per
million steps to them. A rotation always makes a new version of the secret, so an AWSCURRENT of the version
read before means AWSPREVIOUS is what it was too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto import mock_aws

from ryusen._internal.signing import read_secret
from ryusen_server.wiring import SecretKey

OLD = "secret-reads-test-old-0123456789abcdef"
NEW = "secret-reads-test-new-fedcba9876543210"
NEWER = "secret-reads-test-newer-00112233445566"


@pytest.fixture
def secret(aws_env: None) -> Iterator[tuple[Any, str, Counter[str]]]:
    """(client, secret ARN, GetSecretValue requests by version stage)."""
    with mock_aws():
        client = boto3.client("secretsmanager", region_name="us-east-1")
        arn = client.create_secret(Name="ryusen-master", SecretString=OLD)["ARN"]
        reads: Counter[str] = Counter()

        def count(params: dict[str, Any], **_: Any) -> None:
            reads[str(params.get("VersionStage"))] += 1

        client.meta.events.register("provide-client-params.secrets-manager.GetSecretValue", count)
        yield client, arn, reads


def rotate(client: Any, arn: str, value: str, *, emergency: bool = False) -> None:
    """A new AWSCURRENT; AWSPREVIOUS then labels the old one (moto moves it), or nothing in an emergency."""
    old_version = next(
        v for v, s in client.describe_secret(SecretId=arn)["VersionIdsToStages"].items() if "AWSCURRENT" in s
    )
    client.put_secret_value(SecretId=arn, SecretString=value)
    if emergency:
        client.update_secret_version_stage(SecretId=arn, VersionStage="AWSPREVIOUS", RemoveFromVersionId=old_version)


def test_a_re_read_with_nothing_rotated_is_one_request(secret: tuple[Any, str, Counter[str]]) -> None:
    client, arn, reads = secret
    first = read_secret(client, arn)
    assert (first.current, first.previous) == (OLD, None) and first.version_id
    assert reads == Counter({"AWSCURRENT": 1, "AWSPREVIOUS": 1})
    again = read_secret(client, arn, known=first)
    assert again is first
    assert reads == Counter({"AWSCURRENT": 2, "AWSPREVIOUS": 1})  # one more request, not two


def test_a_re_read_after_a_rotation_reads_both_stages(secret: tuple[Any, str, Counter[str]]) -> None:
    client, arn, reads = secret
    first = read_secret(client, arn)
    rotate(client, arn, NEW)
    after = read_secret(client, arn, known=first)
    assert (after.current, after.previous) == (NEW, OLD) and after.version_id != first.version_id
    rotate(client, arn, NEWER, emergency=True)
    emergency = read_secret(client, arn, known=after)
    assert (emergency.current, emergency.previous) == (NEWER, None)
    assert reads == Counter({"AWSCURRENT": 3, "AWSPREVIOUS": 3})


def test_the_engines_key_re_read_every_ttl_costs_one_request_and_still_refuses_an_emergency_rotations_old_key(
    secret: tuple[Any, str, Counter[str]],
) -> None:
    client, arn, reads = secret
    now = [0.0]
    key = SecretKey(client, arn, ttl_s=300, clock=lambda: now[0], recheck_s=10)
    assert key.keys() == (OLD, None)
    for _ in range(5):  # the result function's fresh reads, 10 s apart, nothing rotated
        now[0] += 11
        assert key.fresh_keys() == (OLD, None)
    assert reads == Counter({"AWSCURRENT": 6, "AWSPREVIOUS": 1})
    rotate(client, arn, NEW)
    rotate(client, arn, NEWER, emergency=True)
    now[0] += 11
    assert key.fresh_keys() == (NEWER, None)  # neither old key is accepted any more

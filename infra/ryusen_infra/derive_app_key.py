"""A CloudFormation custom resource: at deploy, writes an app's signing key, derived from the master, to the
app's own secret, so that the app never holds (or may read) the master.

It runs in a function of its own, the only one besides the engine's that may read the master; the app may read
only its own secret. Deleting the resource changes nothing (the secret goes with the stack). The function sends
CloudFormation its answer itself (a PUT of JSON to the pre-signed ``ResponseURL``); no key is in the answer.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import boto3

from ryusen._internal.signing import app_key, key_id


def handler(event: dict[str, Any], context: Any) -> None:
    status, reason, data = "SUCCESS", "", {}
    try:
        if event["RequestType"] in ("Create", "Update"):
            properties = event["ResourceProperties"]
            secrets = boto3.client("secretsmanager")
            master = str(secrets.get_secret_value(SecretId=properties["MasterKeySecretArn"])["SecretString"]).strip()
            if not master:
                raise ValueError("the master key secret is empty")
            derived = app_key(master, properties["AppId"])
            secrets.put_secret_value(SecretId=properties["AppKeySecretArn"], SecretString=derived)
            data = {"KeyId": key_id(derived)}  # a fingerprint, not the key
    except Exception as exc:  # noqa: BLE001 - CloudFormation waits for an answer: a failure must answer too
        status, reason = "FAILED", f"{type(exc).__name__}: {exc}"[:400]
    answer = {
        "Status": status,
        "Reason": reason or "done",
        "PhysicalResourceId": event.get("PhysicalResourceId") or f"{event['LogicalResourceId']}-app-key",
        "StackId": event["StackId"],
        "RequestId": event["RequestId"],
        "LogicalResourceId": event["LogicalResourceId"],
        "Data": data,
    }
    request = urllib.request.Request(  # noqa: S310 - CloudFormation's pre-signed S3 URL
        event["ResponseURL"], data=json.dumps(answer).encode(), method="PUT", headers={"Content-Type": ""}
    )
    with urllib.request.urlopen(request, timeout=30):  # noqa: S310 - as above
        pass

"""The Lambda code asset, built on this machine: no Docker, no AWS credentials.

The asset is the ``ryusen`` SDK and the ``ryusen_server`` package, with the
runtime's third-party dependencies (pinned, every one) installed by pip for the Lambda platform
(``--platform manylinux2014_aarch64 --only-binary=:all:``: wheels only, so
nothing is compiled here and nothing of this machine's architecture leaks in).
boto3 and botocore come with the Lambda Python runtime and are not bundled.

CDK calls :class:`LocalPip` first; only if it declines would CDK fall back to
Docker, and it never declines. Template tests skip bundling altogether
(context ``aws:cdk:bundling-stacks`` = ``[]``) and get the staged sources.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import jsii
from aws_cdk import aws_lambda

REPO = Path(__file__).resolve().parents[2]
PACKAGES = (REPO / "sdk" / "ryusen", REPO / "handlers" / "ryusen_server")
REQUIREMENTS_FILE = REPO / "infra" / "lambda-requirements.txt"
RUNTIME_REQUIREMENTS = tuple(
    line.strip()
    for line in REQUIREMENTS_FILE.read_text().splitlines()
    if line.strip() and not line.lstrip().startswith("#")
)
"""Every third-party package in the asset, pinned to the version the tests run with (tests/infra/test_synth.py
checks the list is the whole closure and matches the development environment, which scripts/bootstrap installs
with the same file as constraints). pip installs exactly these, with ``--no-deps``: a deploy ships what was
tested, whatever the index holds that day."""
PYTHON_VERSION = "3.14"
PLATFORM = "manylinux2014_aarch64"
RUNTIME = aws_lambda.Runtime.PYTHON_3_14
ARCHITECTURE = aws_lambda.Architecture.ARM_64


BUILD = REPO / "infra" / ".build"


def _staged_sources(name: str = "lambda-src") -> str:
    """A directory holding only the two packages (so the asset's hash follows their sources, nothing else)."""
    stage = BUILD / name
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    for package in PACKAGES:
        shutil.copytree(package, stage / package.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (stage / "requirements.txt").write_text("\n".join(RUNTIME_REQUIREMENTS) + "\n")
    return str(stage)


@jsii.implements(cdk.ILocalBundling)
class LocalPip:
    """Bundles on this machine: copy the packages, then pip-install the wheels for the Lambda platform."""

    def __init__(self, source: str) -> None:
        self._source = Path(source)

    def try_bundle(self, output_dir: str, options: Any = None, **_: Any) -> bool:
        out = Path(output_dir)
        for entry in self._source.iterdir():  # the packages, and an app module staged beside them
            if entry.is_dir():
                shutil.copytree(entry, out / entry.name, dirs_exist_ok=True)
            elif entry.name != "requirements.txt":
                shutil.copy2(entry, out / entry.name)
        command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-compile",
            "--target",
            str(out),
            "--platform",
            PLATFORM,
            "--implementation",
            "cp",
            "--python-version",
            PYTHON_VERSION,
            "--only-binary=:all:",
            "--no-deps",
            "-r",
            str(self._source / "requirements.txt"),
        ]
        subprocess.run(command, check=True)  # noqa: S603 - our own interpreter and arguments
        return True


def lambda_code() -> aws_lambda.Code:
    """The one code asset every Ryusen function runs (each with its own handler)."""
    source = _staged_sources()
    return aws_lambda.Code.from_asset(
        source,
        bundling=cdk.BundlingOptions(
            image=RUNTIME.bundling_image,  # unused: local bundling always succeeds
            local=LocalPip(source),
            command=["false"],
        ),
    )

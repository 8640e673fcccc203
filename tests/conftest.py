"""Shared fixtures. Tests that need the `ryusen dev` stack use the `dev_stack` fixture (tests/stack.py)."""

from __future__ import annotations

import os

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("AWS_ACCOUNT_ID_ENDPOINT_MODE", "disabled")

from hypothesis import settings as _hypothesis

from ryusen_server.core import decide as _core
from ryusen_server.core import model as _model

# Hypothesis: random locally, so each run explores new examples; in CI (CI=true) derandomized, so a run is
# reproducible from its commit alone, and no example database (a clean clone has none to replay).
_hypothesis.register_profile("ci", derandomize=True, database=None, print_blob=True)
_hypothesis.register_profile("dev")
_hypothesis.load_profile("ci" if os.environ.get("CI", "").lower() in ("true", "1") else "dev")

_core.CHECK_PURITY = True  # every decision in the suite proves it left its input unchanged (copy on write)
_model.CHECK_DERIVED = True  # and what a state works out from its origin is what its own steps say

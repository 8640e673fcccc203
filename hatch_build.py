"""A hatch build hook: the wheel carries the dev UI's built files (``handlers/ryusen_server/local/static``).

They are built from ``ui/`` by ``scripts/build-ui`` (Node.js and npm) and not committed (they hold third-party
code); a wheel built from a checkout where they are missing builds them first.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

STATIC = Path("handlers") / "ryusen_server" / "local" / "static"
FILES = ("app.js", "app.css")


class DevUiBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if version == "editable":
            return  # served from the checkout, where scripts/bootstrap builds them
        root = Path(self.root)
        if not all((root / STATIC / name).is_file() for name in FILES):
            subprocess.run([str(root / "scripts" / "build-ui")], check=True, cwd=root)  # noqa: S603
        build_data["artifacts"].extend(f"/{(STATIC / name).as_posix()}" for name in FILES)

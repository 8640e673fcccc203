"""The ``ryusen`` console script: a clear message, not a traceback, when the server extra is missing."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from .cli import main as cli_main
    except ImportError as exc:
        print(
            f"ryusen: the command line needs the server extra ({exc.name or exc} is not installed).\n"
            "  pip install 'ryusen[server]'   # the CLI against a deployed API\n"
            "  pip install 'ryusen[local]'    # also ryusen dev",
            file=sys.stderr,
        )
        sys.exit(1)
    cli_main()

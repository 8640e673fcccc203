"""Serve one app on a loopback port: ``python -m ryusen_server.local.serve_app SPEC --port N``.

``ryusen dev`` runs each APP argument in its own process with this module, so
a reload is a clean restart of the user's code. SPEC is ``path/to/file.py:app``
or ``package.module:app`` (the attribute defaults to ``app``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from ryusen import Ryusen


class AppSpecError(Exception):
    pass


def split_spec(spec: str) -> tuple[str, str]:
    target, _, attr = spec.partition(":")
    if not target:
        raise AppSpecError(f"app spec {spec!r} names no file or module (use file.py:app or package.module:app)")
    return target, attr or "app"


def source_file(spec: str) -> Path | None:
    """The file to watch for a spec, without importing it when it is a path."""
    target, _ = split_spec(spec)
    if target.endswith(".py"):
        return Path(target).resolve()
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        return None
    return Path(found.origin).resolve() if found and found.origin else None


def load_app(spec: str) -> Ryusen:
    target, attr = split_spec(spec)
    module: Any
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise AppSpecError(f"no such file: {target}")
        sys.path.insert(0, str(path.parent))
        module_name = path.stem
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise AppSpecError(f"cannot load {target}")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        loader_spec.loader.exec_module(module)
    else:
        sys.path.insert(0, str(Path.cwd()))
        module = importlib.import_module(target)
    app = getattr(module, attr, None)
    if not isinstance(app, Ryusen):
        raise AppSpecError(f"{spec}: {attr!r} is not a ryusen.Ryusen app (found {type(app).__name__})")
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("spec")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        app = load_app(args.spec)
    except AppSpecError as exc:
        print(f"ryusen: {exc}", file=sys.stderr)
        return 3
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    from .guard import loopback_only

    # only a loopback Host: a page rebound to 127.0.0.1 (DNS rebinding) reaches nothing
    server = make_server("127.0.0.1", args.port, loopback_only(app.wsgi(), lambda: args.port), threaded=True)
    print(f"serving app {app.app_id!r} ({args.spec}) on http://127.0.0.1:{args.port}/", flush=True)

    def stop(signum: int, frame: Any) -> None:
        # ryusen dev stops this process on a reload or a restart: no new requests, then the attempts answered
        # "accepted" end and post their outcomes (up to DRAIN_S), so a reload does not make them Unknown
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    left = app.drain(DRAIN_S)
    if left:
        print(f"ryusen: stopped with {left} acknowledged attempt(s) still running: Unknown at their leases", flush=True)
    return 0


DRAIN_S = 4.0
"""How long a stopping app process waits for its acknowledged attempts (ryusen dev kills it after 5 s)."""


if __name__ == "__main__":
    sys.exit(main())

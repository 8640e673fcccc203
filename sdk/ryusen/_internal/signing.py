"""HMAC-SHA256 signing of task requests and responses (decisions 6.12).

The header ``X-Ryusen-Signature: t=<unix seconds>,v1=<hex>`` signs
``"<t>.<body>"`` with the app's signing key. A verifier refuses a missing
header, a bad digest, and a timestamp more than ``max_skew_s`` from its clock.
With no key configured (local development only) nothing is signed or checked.
"""

from __future__ import annotations

import hashlib
import hmac
import string

SIGNATURE_HEADER = "X-Ryusen-Signature"
MAX_SKEW_S = 300.0


_HEX = frozenset("0123456789abcdef")


def _plain(text: str, alphabet: str | frozenset[str], longest: int) -> bool:
    """``text`` has 1 to ``longest`` characters, all from ``alphabet`` (ASCII): anything else in a signature
    header is malformed, never a reason to fail."""
    return 0 < len(text) <= longest and all(ch in alphabet for ch in text)


class SignatureError(Exception):
    """A request or response whose signature is missing, wrong or stale."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def sign(key: str, body: bytes, *, now: float) -> str:
    """Return the signature header value for ``body`` at time ``now``.

    >>> sign("k", b"{}", now=0.0).startswith("t=0,v1=")
    True
    """
    ts = str(int(now))
    digest = hmac.new(key.encode(), ts.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={ts},v1={digest}"


def verify_any(keys: list[str], body: bytes, header: str | None, *, now: float, max_skew_s: float = MAX_SKEW_S) -> None:
    """Like :func:`verify`, accepting a signature by any of ``keys`` (a key and the one it replaced)."""
    problem = SignatureError("no signing key")
    for key in keys:
        try:
            verify(key, body, header, now=now, max_skew_s=max_skew_s)
        except SignatureError as exc:
            problem = exc
        else:
            return
    raise problem


def verify(key: str, body: bytes, header: str | None, *, now: float, max_skew_s: float = MAX_SKEW_S) -> None:
    """Raise :class:`SignatureError` unless ``header`` signs ``body`` with ``key``, fresh at ``now``."""
    if not header:
        raise SignatureError("missing signature")
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    ts, given = parts.get("t"), parts.get("v1")
    if ts is None or given is None or not _plain(ts, string.digits, 12) or not _plain(given, _HEX, 64):
        raise SignatureError("malformed signature")
    expected = hmac.new(key.encode(), ts.encode() + b"." + body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, given):
        raise SignatureError("signature does not match the body")
    if abs(now - int(ts)) > max_skew_s:
        raise SignatureError("signature timestamp is stale")

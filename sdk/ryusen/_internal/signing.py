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
import threading

SIGNATURE_HEADER = "X-Ryusen-Signature"
ANSWER_BINDING_HEADER = "X-Ryusen-Answer-Binding"
"""Sent (``1``) by a server that checks bound answers: the endpoint then signs its answer for the request.
Removing it only makes the answer unbound, which such a server does not accept."""
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


def _signed(ts: str, body: bytes, answers: str | None) -> bytes:
    """What is signed: the timestamp, for an answer the request's own signature (by digest), and the body."""
    if answers is None:
        return ts.encode() + b"." + body
    return (
        ts.encode()
        + b".answers:"
        + hashlib.sha256(answers.encode("utf-8", "replace")).hexdigest().encode()
        + b"."
        + body
    )


def sign(key: str, body: bytes, *, now: float, answers: str | None = None) -> str:
    """Return the signature header value for ``body`` at time ``now``.

    ``answers`` is the signature header of the request this body answers: the signature then holds only as
    the answer to that request (``a=1`` says so), never to another run's or attempt's.

    >>> sign("k", b"{}", now=0.0).startswith("t=0,v1=")
    True
    >>> sign("k", b"{}", now=0.0, answers="t=0,v1=ab").endswith(",a=1")
    True
    """
    ts = str(int(now))
    digest = hmac.new(key.encode(), _signed(ts, body, answers), hashlib.sha256).hexdigest()
    return f"t={ts},v1={digest}" + (",a=1" if answers is not None else "")


def verify_any(
    keys: list[str],
    body: bytes,
    header: str | None,
    *,
    now: float,
    max_skew_s: float = MAX_SKEW_S,
    answers: str | None = None,
    bound: bool = False,
) -> None:
    """Like :func:`verify`, accepting a signature by any of ``keys`` (a key and the one it replaced)."""
    problem = SignatureError("no signing key")
    for key in keys:
        try:
            verify(key, body, header, now=now, max_skew_s=max_skew_s, answers=answers, bound=bound)
        except SignatureError as exc:
            problem = exc
        else:
            return
    raise problem


def verify(
    key: str,
    body: bytes,
    header: str | None,
    *,
    now: float,
    max_skew_s: float = MAX_SKEW_S,
    answers: str | None = None,
    bound: bool = False,
) -> None:
    """Raise :class:`SignatureError` unless ``header`` signs ``body`` with ``key``, fresh at ``now``.

    An answer signed for a request (``a=1``) holds only for ``answers``, that request's
    :func:`request_binding`; ``bound`` requires that it was (a request that asked for a bound answer).
    """
    parts = _parts(header)
    ts, given = parts["t"], parts["v1"]
    is_answer = "a" in parts
    if bound and not is_answer:
        raise SignatureError("the answer is not signed for the request it answers")
    if is_answer and answers is None:
        raise SignatureError("an answer's signature is not a request's")
    expected = hmac.new(key.encode(), _signed(ts, body, answers if is_answer else None), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, given):
        raise SignatureError("signature does not match the body")
    if abs(now - int(ts)) > max_skew_s:
        raise SignatureError("signature timestamp is stale")


def _parts(header: str | None) -> dict[str, str]:
    """A signature header's parts, which must be exactly ``t=<digits>,v1=<64 hex>`` and, for an answer signed
    for its request, ``,a=1``: nothing else, nothing twice, in that order (one signature, one spelling)."""
    if not header:
        raise SignatureError("missing signature")
    pieces = header.split(",")
    if len(pieces) not in (2, 3) or any("=" not in p for p in pieces):
        raise SignatureError("malformed signature")
    pairs = [p.split("=", 1) for p in pieces]
    names = [name for name, _ in pairs]
    if names not in (["t", "v1"], ["t", "v1", "a"]) or (len(pairs) == 3 and pairs[2][1] != "1"):
        raise SignatureError("malformed signature")
    parts = dict(pairs)
    if not _plain(parts["t"], string.digits, 12) or not _plain(parts["v1"], _HEX, 64):
        raise SignatureError("malformed signature")
    return parts


def signature_digest(header: str) -> str:
    """The HMAC a well-formed signature header carries: what names one signed message, however it is spelt."""
    return _parts(header)["v1"]


def request_binding(header: str, body: bytes) -> str:
    """What an answer is signed for: the request's signature and the body the endpoint received under it, so
    that an answer to another body sent under a captured header does not verify as this request's."""
    return f"{header}|{hashlib.sha256(body).hexdigest()}"


class SeenRequests:
    """The request signatures an endpoint process accepted within the skew window: the same signed request
    again is a replay (the server never sends one request twice), refused before it runs anything."""

    def __init__(self, window_s: float = MAX_SKEW_S, most: int = 100_000) -> None:
        self.window_s = window_s
        self.most = most
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def first_time(self, header: str, now: float) -> bool:
        """Record the signed request ``header`` names (by its HMAC: one request however the header is spelt);
        False if it was seen within the window."""
        header = signature_digest(header)
        with self._lock:
            if len(self._seen) >= self.most:
                self._seen = {h: at for h, at in self._seen.items() if now - at <= self.window_s * 2}
                if len(self._seen) >= self.most:  # still full of fresh ones: forget the oldest half
                    kept = sorted(self._seen.items(), key=lambda item: item[1])[len(self._seen) // 2 :]
                    self._seen = dict(kept)
            if header in self._seen:
                return False
            self._seen[header] = now
            return True

"""HMAC-SHA256 signatures on every message between the server and an app (decisions 21).

A message carries ``X-Ryusen-Signature: v2,k=<key id>,t=<unix seconds>,n=<nonce>,s=<hex>``. The HMAC is over
a :class:`Scope` (the direction, method and path, the app, and the run, step, phase and generation the message
is about), the timestamp, the nonce, for an answer the signature of the request it answers, and the SHA-256
of the body. So a signature proves who sent what about which attempt: it does not hold for another app,
attempt, route or direction, and an answer holds only for its own request.

Keys:

* Each app has its own key. A deployment keeps one master secret and derives every app's key from it and
  the app id (:func:`app_key`), so the key an app holds signs for that app only.
* A key is named by its key id (:func:`key_id`, a fingerprint of the key), and several keys may be valid at
  once: the first signs, any verifies. A rotation adds the new key everywhere before it signs with it, so
  nothing in flight fails.
* A key read from a secret keeps the key it replaced (AWSPREVIOUS) valid for a window after the rotation
  only (:class:`SecretRead`); an emergency rotation leaves no previous version, so the old key is refused.
* What a side sends unasked (a late result, a manifest) it signs with a key the other side holds
  (:func:`choose_key`): mid-rotation an app may hold a newer key than the server does yet.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import string
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal
from urllib.parse import urlsplit

SIGNATURE_HEADER = "X-Ryusen-Signature"
CHALLENGE_HEADER = "X-Ryusen-Challenge"
"""Sent with a manifest request: 32 fresh hex digits the manifest's signature must carry as its nonce, so a
manifest signed earlier (an older release's) cannot be played back to a sync."""
KEY_IDS_HEADER = "X-Ryusen-Key-Ids"
"""Sent with a manifest request: the ids of the app's keys the server holds, the one it signs with first, so
the app signs its manifest with a key the server can verify (mid-rotation the app may already hold a newer
key the server does not)."""
VERSION = "v2"
MAX_SKEW_S = 300.0
PREVIOUS_KEY_WINDOW_S = 86_400.0
"""How long after a rotation a key read from a secret still accepts the key it replaced (AWSPREVIOUS):
``RYUSEN_PREVIOUS_KEY_WINDOW_S``. After it, the previous key is refused."""

_HEX = frozenset("0123456789abcdef")
KEY_ID_LENGTH = 16
NONCE_LENGTH = 32


class SignatureError(Exception):
    """A message whose signature is missing, malformed, wrong, stale or made for another message."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class StaleSignatureError(SignatureError):
    """A signature that is this message's, made with a key this side holds, but outside the skew window: the
    genuine request, too late (or played back late), so whether it ran is not for this side to say."""


class ReplayCheckUnavailableError(Exception):
    """What the endpoint has seen could not be checked or recorded: it runs nothing, and says it cannot tell
    whether the request ran before."""


def key_id(secret: str) -> str:
    """The id a key is named by in signatures: a fingerprint of it (the key cannot be recovered from it).

    >>> key_id("k") == key_id("k") != key_id("j")
    True
    """
    return hashlib.sha256(b"ryusen key id\x00" + secret.encode()).hexdigest()[:KEY_ID_LENGTH]


def app_key(master: str, app_id: str) -> str:
    """The key of app ``app_id`` in a deployment whose master secret is ``master``: what that app is given
    (``ryusen key derive``), and what the server signs that app's tasks with and verifies its answers by."""
    return hmac.new(master.encode(), b"ryusen app key\x00" + app_id.encode(), hashlib.sha256).hexdigest()


def split_keys(value: str | None) -> list[str]:
    """Keys from a setting: comma-separated, the first the one to sign with (empty entries are no key)."""
    return [part.strip() for part in (value or "").split(",") if part.strip()]


def choose_key(keys: Sequence[str], wanted_ids: Sequence[str]) -> str | None:
    """The key to sign an unsolicited message with: the first of ``wanted_ids`` (the ids of keys the other side
    holds, its own signing key first) that is one of ``keys``; else the first of ``keys`` (None: no key).

    >>> choose_key(["new", "old"], [key_id("old")]) == "old"
    True
    >>> choose_key(["new", "old"], ["0" * 16])
    'new'
    """
    by_id = {key_id(key): key for key in keys}
    return next((by_id[wanted] for wanted in wanted_ids if wanted in by_id), keys[0] if keys else None)


def key_ids_header(keys: Sequence[str]) -> str:
    """The value of :data:`KEY_IDS_HEADER` for ``keys``: their ids, comma-separated, in order."""
    return ",".join(key_id(key) for key in keys)


def parse_key_ids(value: str | None) -> list[str]:
    """The key ids a :data:`KEY_IDS_HEADER` names (at most 8; anything malformed is left out)."""
    ids = [part.strip() for part in (value or "").split(",")[:8]]
    return [part for part in ids if _plain(part, _HEX, KEY_ID_LENGTH, exactly=True)]


@dataclass(frozen=True, slots=True)
class SecretRead:
    """A key secret as read: its current key, the key it replaced (None: never rotated, or an emergency
    rotation detached it), and when the current version was made (unix seconds; None: not known)."""

    current: str | None
    previous: str | None
    rotated_at: float | None
    version_id: str | None = None
    """AWSCURRENT's VersionId. A rotation, ordinary or emergency, always makes a new version: the same id on a
    later read means AWSPREVIOUS is still what this read found."""

    def keys(self, now: float, window_s: float) -> tuple[str | None, str | None]:
        """(the key to sign with, the previous key while it is still accepted): the previous key holds for
        ``window_s`` after the rotation (``now`` in unix seconds), then it is refused. A rotation of unknown
        time keeps it (a real secret always says when its version was made)."""
        previous = self.previous
        if previous is not None and self.rotated_at is not None and now - self.rotated_at > window_s:
            previous = None
        return self.current, previous


def read_secret(client: Any, secret_id: str, known: SecretRead | None = None) -> SecretRead:
    """Read a key secret with a boto3 Secrets Manager ``client``: AWSCURRENT, and AWSPREVIOUS when there is one.
    An empty current value is no key: the caller fails closed. With ``known`` (an earlier read whose previous
    key is no longer accepted: none, or past its window), an AWSCURRENT of the same version returns ``known``:
    one request, not two, when nothing was rotated since. A read that still accepts a previous key must not be
    passed: AWSPREVIOUS can be detached without a new version (``ryusen key rotate --emergency`` puts the new
    value, then detaches the old one, and a read between the two holds both), and only reading it again sees
    that."""

    def read(stage: str) -> tuple[str | None, float | None, str | None]:
        try:
            secret = client.get_secret_value(SecretId=secret_id, VersionStage=stage)
        except client.exceptions.ResourceNotFoundException:
            if stage == "AWSPREVIOUS":
                return None, None, None  # never rotated, or rotated in an emergency
            raise
        created = secret.get("CreatedDate")
        made = created.timestamp() if hasattr(created, "timestamp") else None
        version = secret.get("VersionId")
        return str(secret["SecretString"]).strip() or None, made, str(version) if version else None

    current, made, version = read("AWSCURRENT")
    if known is not None and version is not None and version == known.version_id:
        return known
    previous, _, _ = read("AWSPREVIOUS")
    return SecretRead(current=current, previous=previous, rotated_at=made, version_id=version)


@dataclass(frozen=True, slots=True)
class Scope:
    """What a message is about, all of it under the signature.

    ``path`` is the path of the URL the message was sent to (for a task request, the release's endpoint
    URL; for a late result, the result URL the server handed out); ``extra`` is what else a message's
    meaning depends on outside its body (the features announced with a manifest).
    """

    direction: Literal["request", "response"]
    method: str
    path: str
    app_id: str
    run_id: str = ""
    step_id: str = ""
    phase: str = ""
    generation: str = ""
    extra: str = ""

    def answer(self) -> Scope:
        """The scope of the answer to a request of this scope."""
        return replace(self, direction="response")


def url_path(url: str) -> str:
    """The path a message sent to ``url`` is signed for ("/" for none)."""
    return urlsplit(url).path or "/"


@dataclass(frozen=True, slots=True)
class Signature:
    """One parsed signature header."""

    key_id: str
    timestamp: int
    nonce: str
    digest: str

    def header(self) -> str:
        return f"{VERSION},k={self.key_id},t={self.timestamp},n={self.nonce},s={self.digest}"


def answer_binding(header: str, body: bytes) -> str:
    """What an answer is signed for: the request's whole signature header, exactly as it arrived, and the body
    that arrived under it. An answer to a request that did not verify (a refusal) is bound to exactly what
    arrived too, so a refusal of a captured request sent again with another timestamp, key id or body is no
    answer to the real request (a review relayed the real one, which ran, then had the endpoint refuse a
    re-timestamped copy and handed that refusal to the engine, which took it for "nothing ran")."""
    digest = hashlib.sha256(header.encode()).hexdigest()
    return f"{digest}:{hashlib.sha256(body).hexdigest()}"


def _signed(scope: Scope, timestamp: int, nonce: str, answers: str, body: bytes) -> bytes:
    fields = [
        "ryusen-" + VERSION,
        scope.direction,
        scope.method,
        scope.path,
        scope.app_id,
        scope.run_id,
        scope.step_id,
        scope.phase,
        scope.generation,
        scope.extra,
        str(timestamp),
        nonce,
        answers,
        hashlib.sha256(body).hexdigest(),
    ]
    # a JSON array of ASCII strings: one encoding per list of fields, whatever characters they hold
    return json.dumps(fields, ensure_ascii=True, separators=(",", ":")).encode()


def _mac(secret: str, message: bytes) -> str:
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def sign(secret: str, scope: Scope, body: bytes, *, now: float, nonce: str, answers: str = "") -> str:
    """The signature header for ``body`` sent with ``scope`` at ``now`` under key ``secret``.

    ``nonce`` is 32 random hex digits for a request (two sends of one request are two messages), and for an
    answer that of the request; ``answers`` is the request's :func:`answer_binding`, so the answer holds for
    that request only.

    >>> sign("k", Scope("request", "POST", "/", "shop"), b"{}", now=0.0, nonce="0" * 32).startswith("v2,k=")
    True
    """
    timestamp = int(now)
    digest = _mac(secret, _signed(scope, timestamp, nonce, answers, body))
    return Signature(key_id(secret), timestamp, nonce, digest).header()


def parse(header: str | None) -> Signature:
    """A signature header, which must be exactly ``v2,k=<16 hex>,t=<digits>,n=<32 hex>,s=<64 hex>``: nothing
    else, nothing twice, in that order (one signature, one spelling)."""
    if not header:
        raise SignatureError("missing signature")
    pieces = header.split(",")
    if not pieces or pieces[0] != VERSION:
        raise SignatureError(f"not a {VERSION} signature")
    pairs = [p.split("=", 1) for p in pieces[1:]]
    if [p[0] for p in pairs] != ["k", "t", "n", "s"] or any(len(p) != 2 for p in pairs):
        raise SignatureError("malformed signature")
    parts = dict(pairs)
    if (
        not _plain(parts["k"], _HEX, KEY_ID_LENGTH, exactly=True)
        or not _plain(parts["t"], string.digits, 12)
        or not _plain(parts["n"], _HEX, NONCE_LENGTH, exactly=True)
        or not _plain(parts["s"], _HEX, 64, exactly=True)
    ):
        raise SignatureError("malformed signature")
    return Signature(parts["k"], int(parts["t"]), parts["n"], parts["s"])


def is_nonce(text: str | None) -> bool:
    """``text`` is a well-formed nonce (32 lowercase hex digits)."""
    return text is not None and _plain(text, _HEX, NONCE_LENGTH, exactly=True)


def _plain(text: str, alphabet: str | frozenset[str], longest: int, *, exactly: bool = False) -> bool:
    """``text`` has 1 to ``longest`` characters (or exactly ``longest``), all from ``alphabet`` (ASCII):
    anything else in a signature header is malformed, never a reason to fail."""
    fits = len(text) == longest if exactly else 0 < len(text) <= longest
    return fits and all(ch in alphabet for ch in text)


def verify(
    keys: Sequence[str],
    scope: Scope,
    body: bytes,
    header: str | None,
    *,
    now: float,
    answers: str = "",
    nonce: str | None = None,
    max_skew_s: float = MAX_SKEW_S,
) -> tuple[Signature, str]:
    """The signature and the key that made it, if ``header`` signs ``body`` for ``scope`` with one of
    ``keys`` at a time within ``max_skew_s`` of ``now``; else :class:`SignatureError`.

    An answer is verified with ``answers`` (the :func:`answer_binding` of the request it answers) and
    ``nonce`` (that request's nonce): an answer to any other request does not verify.
    """
    if not keys:
        raise SignatureError("no signing key")
    signature = parse(header)
    secret = next((k for k in keys if key_id(k) == signature.key_id), None)
    if secret is None:
        raise SignatureError(f"signed with a key this side does not hold (key id {signature.key_id})")
    if nonce is not None and signature.nonce != nonce:
        raise SignatureError("the answer is not signed for the request it answers")
    expected = _mac(secret, _signed(scope, signature.timestamp, signature.nonce, answers, body))
    if not hmac.compare_digest(expected, signature.digest):
        raise SignatureError("signature does not match this message")
    if abs(now - signature.timestamp) > max_skew_s:
        raise StaleSignatureError("signature timestamp is stale")
    return signature, secret


class SeenRequests:
    """The signed requests an endpoint process accepted within the skew window: the same signed request
    again is a replay (the server signs every send with a fresh nonce), refused before it runs anything."""

    def __init__(self, window_s: float = MAX_SKEW_S, most: int = 100_000) -> None:
        self.window_s = window_s
        self.most = most
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def first_time(self, signature: Signature, now: float) -> bool:
        """Record the request ``signature`` names (by its HMAC); False if it was seen within the window.

        An entry is kept as long as its request could still verify (twice the window); it is never forgotten
        earlier to make room (a review flooded the memory and replayed a forgotten request). When every entry
        is still needed, :class:`ReplayCheckUnavailableError`: the request is not run."""
        digest = signature.digest
        with self._lock:
            if digest in self._seen:
                return False
            if len(self._seen) >= self.most:
                self._seen = {h: at for h, at in self._seen.items() if now - at <= self.window_s * 2}
                if len(self._seen) >= self.most:
                    raise ReplayCheckUnavailableError(
                        f"this endpoint holds {self.most} requests accepted in the last {self.window_s * 2:g}s"
                    )
            self._seen[digest] = now
            return True

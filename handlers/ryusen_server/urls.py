"""What an app may register as its endpoint (decisions 22): the URL policy.

A release's URL is fetched (its manifest) and posted to (its tasks) by the server, from inside the user's
AWS account. Left open, that is a server-side request forgery: any caller of ``PUT /v1/apps/{id}`` could
make the server reach the instance metadata service or a private network. So before any request the URL
must be plain ``http(s)://host[:port]/path`` (no credentials, no whitespace or control characters), its
host name is resolved once, and every address it resolves to must be public unless a network is allowed
by a setting (``RYUSEN_ENDPOINT_ALLOWED_NETWORKS``, CIDRs); the request then goes to that address, so a
second resolution cannot point it elsewhere. ``ryusen dev`` allows loopback, where its apps run.
Link-local addresses (169.254.0.0/16 and fe80::/10: the metadata service) are refused unless a setting
names them explicitly.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from .ports import InvalidRequestError

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
RESOLVED_KEPT_S = 60.0
"""How long a host's checked addresses are reused before it is resolved (and checked) again."""
MAX_URL_LENGTH = 2048


class EndpointRefusedError(InvalidRequestError):
    code = "endpoint_refused"


@dataclass(frozen=True, slots=True)
class Target:
    """Where a request to an endpoint URL goes: the checked address, and the names to present there."""

    url: str
    """The URL with its host replaced by the checked address."""
    host_header: str
    sni_hostname: str | None
    """The name TLS verifies the certificate against (https with a host name)."""


Resolver = Callable[[str, int], list[str]]


def _system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class EndpointPolicy:
    """Checks an endpoint URL and resolves it to an address it may reach."""

    def __init__(self, allowed: tuple[IpNetwork, ...] = (), resolver: Resolver | None = None) -> None:
        self.allowed = allowed
        self.resolver = resolver or _system_resolver
        self._resolved: dict[tuple[str, int], tuple[float, str]] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> EndpointPolicy:
        raw = env.get("RYUSEN_ENDPOINT_ALLOWED_NETWORKS", "")
        networks: list[IpNetwork] = []
        for part in (p.strip() for p in raw.split(",")):
            if not part:
                continue
            try:
                networks.append(ipaddress.ip_network(part, strict=False))
            except ValueError:
                raise ValueError(f"setting RYUSEN_ENDPOINT_ALLOWED_NETWORKS: {part!r} is not a CIDR") from None
        return cls(tuple(networks))

    @classmethod
    def local(cls) -> EndpointPolicy:
        """``ryusen dev`` and tests: loopback too, where the apps run."""
        return cls(LOOPBACK)

    def check(self, url: str) -> Target:
        """The address ``url`` may be reached at, or :class:`EndpointRefusedError` saying why not."""
        scheme, host, port, path = self._parts(url)
        address = self._address(host, port)
        literal = f"[{address}]" if ":" in address else address
        default_port = 443 if scheme == "https" else 80
        netloc = literal if port == default_port and not self._explicit_port(url) else f"{literal}:{port}"
        host_header = host if ":" not in host else f"[{host}]"
        if self._explicit_port(url):
            host_header = f"{host_header}:{port}"
        sni = host if scheme == "https" and not _is_ip(host) else None
        return Target(url=f"{scheme}://{netloc}{path}", host_header=host_header, sni_hostname=sni)

    @staticmethod
    def _explicit_port(url: str) -> bool:
        return urlsplit(url).port is not None

    @staticmethod
    def _parts(url: str) -> tuple[str, str, int, str]:
        if not isinstance(url, str) or not url or len(url) > MAX_URL_LENGTH:
            raise EndpointRefusedError(f"an endpoint URL has 1 to {MAX_URL_LENGTH} characters")
        if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url) or not url.isascii():
            raise EndpointRefusedError("an endpoint URL may not contain whitespace, control or non-ASCII characters")
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise EndpointRefusedError(f"the endpoint URL is malformed: {exc}") from None
        if parts.scheme not in ("http", "https"):
            raise EndpointRefusedError("an endpoint URL must start with http:// or https://")
        if parts.username is not None or parts.password is not None or "@" in parts.netloc:
            raise EndpointRefusedError(
                "an endpoint URL may not carry credentials (user:password@); requests are signed instead"
            )
        host = parts.hostname
        if not host:
            raise EndpointRefusedError("the endpoint URL has no host")
        if "%" in host:  # a zone, or an encoding: either way a name the check would not be the one connected to
            raise EndpointRefusedError("an endpoint host may not contain '%'")
        if not _is_ip(host) and not _is_host_name(host):
            raise EndpointRefusedError(
                "the endpoint host is not a DNS name: labels of 1 to 63 characters, at most 253 in all"
            )
        if parts.fragment:
            raise EndpointRefusedError("an endpoint URL may not have a #fragment")
        path = parts.path or "/"
        if parts.query:
            path = f"{path}?{parts.query}"
        return parts.scheme, host, port or (443 if parts.scheme == "https" else 80), path

    def _address(self, host: str, port: int) -> str:
        now = time.monotonic()
        with self._lock:
            cached = self._resolved.get((host, port))
        if cached is not None and now - cached[0] < RESOLVED_KEPT_S:
            return cached[1]
        if _is_ip(host):
            candidates = [str(ipaddress.ip_address(host))]  # the address as the check reads it, nothing else
        else:
            try:
                candidates = self.resolver(host, port)
            except (OSError, UnicodeError):  # UnicodeError: a name the resolver's IDNA codec cannot encode
                raise EndpointRefusedError(f"the endpoint host {host!r} does not resolve") from None
        if not candidates:
            raise EndpointRefusedError(f"the endpoint host {host!r} does not resolve")
        for candidate in candidates:  # every address the name has must pass, or a later lookup could pick one
            self._permit(host, candidate)
        chosen = candidates[0]
        with self._lock:
            self._resolved[(host, port)] = (now, chosen)
            if len(self._resolved) > 1024:
                self._resolved.clear()
        return chosen

    def _permit(self, host: str, candidate: str) -> None:
        address: IpAddress = ipaddress.ip_address(candidate.split("%", 1)[0])
        if isinstance(address, ipaddress.IPv6Address):
            # an IPv6 address that carries an IPv4 one (mapped, 6to4, Teredo) is judged by that one too
            embedded = address.ipv4_mapped or address.sixtofour or (address.teredo[1] if address.teredo else None)
            if embedded is not None:
                self._permit(host, str(embedded))
            if address.ipv4_mapped is not None:
                return
        if any(address in network for network in self.allowed):
            return
        if address.is_link_local:
            what = "a link-local address (such as the instance metadata service)"
        elif address.is_loopback:
            what = "a loopback address"
        elif address.is_private or address.is_reserved or address.is_unspecified or address.is_multicast:
            what = "a private or reserved address"
        elif not address.is_global:
            what = "an address that is not public"
        else:
            return
        raise EndpointRefusedError(
            f"the endpoint host {host!r} is {what} ({address}); allow its network with"
            " RYUSEN_ENDPOINT_ALLOWED_NETWORKS if the server should reach it"
        )


def _is_host_name(host: str) -> bool:
    """``host`` can be a DNS name: labels of 1 to 63 characters (one trailing dot allowed), 253 in all."""
    name = host[:-1] if host.endswith(".") else host
    return 0 < len(name) <= 253 and all(0 < len(label) <= 63 for label in name.split("."))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True

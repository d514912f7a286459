"""What the server may fetch for an image URL: the policy, the URL's kinds, the address rule.
Sans-IO: no socket and no Trio here (policy_from_config alone looks at the disk and the
environment, once); server.media.fetch applies it.

A URL in a request makes the server a client inside the operator's network. So the
policy refuses what a client could use to reach the operator's own services:

- ``data:`` URLs (base64, an image media type) need no fetch and are always accepted.
- ``http://`` and ``https://`` URLs are fetched. With ``allowed_domains`` set, only
  those host names (exact, case-insensitive) are; another host is refused before any
  resolution. A host must resolve to allowed addresses only (the address rule below):
  each address it resolves to is checked, and the connection goes to a checked one.
- ``file://`` URLs are read only under ``allowed_local_dir`` (symlinks resolved);
  without one they are refused.
- Every other scheme is refused.

The address rule. Loopback, private (RFC 1918, fc00::/7), link-local, shared (CGNAT,
100.64/10) and other non-public unicast addresses are refused. Cloud metadata addresses
(169.254.169.254, fd00:ec2::254), unspecified, multicast and reserved ones are refused
always. An IPv4 address inside IPv6 (``::ffff:a.b.c.d``, ``::a.b.c.d``, 6to4, NAT64)
is judged as that IPv4 address.

Private addresses for named hosts only. ``allow_private_addresses``
(``--allow-private-media-addresses``) lifts the refusal of non-public unicast addresses,
and it needs ``allowed_domains``: a policy with the switch and no list is refused when
built. Why: the switch is for an image server on a trusted network (or a test's
loopback). Alone, it would let any URL reach every service of that network. With the
list, only the hosts the operator named are fetched at all, so the switch reaches them
and nothing else. Two knobs that must go together are simpler to audit than a third
"private hosts" list; metadata addresses stay refused even for a listed host.

Through a proxy (``proxies``: the environment's, server.media.proxy) every rule above
holds. The host is still resolved here and each address checked before the proxy is
asked, so a proxy does not reach by name what a direct fetch may not.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from .errors import MediaRefused, MediaTooLarge
from .proxy import ProxyRoutes, proxy_routes_from_environment

__all__ = [
    "DEFAULT_FETCH_TIMEOUT",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_FETCHES",
    "DEFAULT_MAX_REDIRECTS",
    "DataUrl",
    "FileUrl",
    "MediaPolicy",
    "WebUrl",
    "address_refusal",
    "check_web_url",
    "decode_data_url",
    "normal_host",
    "parse_media_url",
    "policy_from_config",
]

DEFAULT_MAX_BYTES = 20 * 1024 * 1024
#: vLLM's ``VLLM_IMAGE_FETCH_TIMEOUT``.
DEFAULT_FETCH_TIMEOUT = 5.0
DEFAULT_MAX_FETCHES = 16
DEFAULT_MAX_REDIRECTS = 5

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class MediaPolicy:
    """What image URLs the server fetches, and within which limits."""

    #: Host names fetched (lowercase, exact); None: any host with public addresses.
    allowed_domains: frozenset[str] | None = None
    #: The directory ``file://`` URLs are read under; None: they are refused.
    allowed_local_dir: str | None = None
    #: Largest image, in bytes (decoded bytes for a ``data:`` URL).
    max_bytes: int = DEFAULT_MAX_BYTES
    #: Seconds one fetch may take, its wait for a slot included.
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT
    #: Fetches running at once (the rest wait, within their timeout).
    max_fetches: int = DEFAULT_MAX_FETCHES
    #: Redirects followed; one more is a failed fetch.
    max_redirects: int = DEFAULT_MAX_REDIRECTS
    #: Allow loopback, private, link-local and shared addresses (tests, a trusted LAN).
    allow_private_addresses: bool = False
    #: The HTTP proxies fetches go through (server.media.proxy); None: every fetch direct.
    #: A route, not a rule: every check above applies through a proxy too.
    proxies: ProxyRoutes | None = None

    def __post_init__(self) -> None:
        if self.allowed_domains is not None:
            object.__setattr__(self, "allowed_domains",
                               frozenset(normal_host(d) for d in self.allowed_domains))
        if self.allow_private_addresses and not self.allowed_domains:
            raise ValueError("--allow-private-media-addresses needs --allowed-media-domains: "
                             "only the hosts listed there may reach private addresses")
        if self.max_bytes < 1 or self.max_fetches < 1 or self.max_redirects < 0:
            raise ValueError("MediaPolicy: max_bytes and max_fetches must be at least 1, "
                             "max_redirects at least 0")
        if not self.fetch_timeout > 0:
            raise ValueError("MediaPolicy: fetch_timeout must be more than 0")


def policy_from_config(config: Any) -> MediaPolicy:
    """The policy of a :class:`server.config.ServerConfig` (its ``--*media*`` options) and
    of the environment's proxy variables. Raises ValueError naming the option or variable
    that cannot be honoured, or an ``--allowed-local-media-path`` that is not a directory
    (the one look at the disk)."""
    local = config.allowed_local_media_path
    if local is not None and not os.path.isdir(local):
        raise ValueError(f"--allowed-local-media-path {local!r} is not a directory")
    return MediaPolicy(
        allowed_domains=frozenset(config.allowed_media_domains) or None,
        allowed_local_dir=config.allowed_local_media_path,
        max_bytes=config.max_media_bytes,
        fetch_timeout=config.media_fetch_timeout,
        max_fetches=config.max_media_fetches,
        allow_private_addresses=config.allow_private_media_addresses,
        proxies=proxy_routes_from_environment(),
    )


def normal_host(host: str) -> str:
    """A host name as compared: lowercase ASCII (IDNA), no trailing dot."""
    host = host.strip().rstrip(".").lower()
    if host.isascii():
        return host
    return host.encode("idna").decode("ascii")


@dataclass(frozen=True)
class DataUrl:
    """A ``data:`` URL: its declared media type and base64 payload."""

    url: str
    media_type: str
    payload: str


@dataclass(frozen=True)
class FileUrl:
    """A ``file://`` URL: its path, unquoted, not yet resolved."""

    url: str
    path: str


@dataclass(frozen=True)
class WebUrl:
    """An ``http(s)://`` URL, split into what the fetch uses (and nothing else)."""

    url: str
    scheme: str
    #: Normalized (:func:`normal_host`), without brackets.
    host: str
    port: int
    #: The request target: path and query, at least ``/``.
    target: str
    #: The host if it is an IP address literal.
    literal: IPAddress | None

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


#: Whitespace or control characters: never in a URL we fetch (parsers disagree on them).
_UNSAFE = re.compile(r"[\x00-\x20\x7f-\x9f]")
_DATA = re.compile(r"data:(?P<type>[^,;]*)(?P<params>(;[^,;]*)*),(?P<payload>.*)", re.S)


def parse_media_url(url: str, policy: MediaPolicy) -> DataUrl | FileUrl | WebUrl:
    """Classify ``url``; refuse a scheme, shape or host the policy does not allow."""
    if not isinstance(url, str) or not url:
        raise MediaRefused(str(url), "is empty")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url)
    if _UNSAFE.search(url):
        raise MediaRefused(url, "contains whitespace or control characters")
    if scheme in ("http", "https"):
        web = _web_url(url, scheme)
        check_web_url(web, policy)
        return web
    if scheme == "file":
        return _file_url(url, policy)
    raise MediaRefused(url, f"has a scheme that is not fetched ({scheme or 'none'}: "
                       "only http, https, data and, when allowed, file)")


def _data_url(url: str) -> DataUrl:
    match = _DATA.fullmatch(url)
    if match is None:
        raise MediaRefused(url, "is not a data: URL (data:MEDIA-TYPE;base64,DATA)")
    params = [p.strip().lower() for p in match["params"].split(";") if p.strip()]
    if "base64" not in params:
        raise MediaRefused(url, "is a data: URL that is not base64 (';base64,' is needed)")
    media_type = match["type"].strip().lower()
    if not media_type.startswith("image/"):
        raise MediaRefused(url, f"is a data: URL of media type '{media_type or 'none'}', "
                           "not an image")
    return DataUrl(url, media_type, match["payload"])


def decode_data_url(data: DataUrl, policy: MediaPolicy) -> bytes:
    """The bytes of a ``data:`` URL; refused when too large (decoded) or not base64."""
    payload = data.payload
    # (base64 is 4 characters per 3 bytes: refuse before decoding what cannot fit)
    if (len(payload) // 4) * 3 - 2 > policy.max_bytes:
        raise MediaTooLarge(data.url, f"is larger than {policy.max_bytes} bytes")
    try:
        decoded = base64.b64decode(payload, validate=True)
    except ValueError:
        raise MediaRefused(data.url, "is a data: URL whose base64 is invalid") from None
    if len(decoded) > policy.max_bytes:
        raise MediaTooLarge(data.url, f"is larger than {policy.max_bytes} bytes")
    return decoded


def _web_url(url: str, scheme: str) -> WebUrl:
    try:
        split = urlsplit(url)
        port = split.port
    except ValueError as exc:
        raise MediaRefused(url, f"is not a valid URL ({exc})") from None
    if split.username is not None or split.password is not None:
        raise MediaRefused(url, "carries credentials (user@host), which are never sent")
    raw_host = split.hostname or ""
    if not raw_host or "%" in raw_host:
        raise MediaRefused(url, "has no valid host")
    try:
        host = normal_host(raw_host)
    except UnicodeError:
        raise MediaRefused(url, "has a host name that is not valid IDNA") from None
    if port == 0:
        raise MediaRefused(url, "has port 0")
    literal: IPAddress | None
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
        try:  # (an empty or over-long label: no look-up could take it)
            host.encode("idna")
        except UnicodeError:
            raise MediaRefused(url, "has a host name that is not valid IDNA") from None
    target = (split.path or "/") + (f"?{split.query}" if split.query else "")
    return WebUrl(url, scheme, host, port or (443 if scheme == "https" else 80), target,
                  literal)


def check_web_url(web: WebUrl, policy: MediaPolicy) -> None:
    """Refuse ``web`` before any resolution: a host off the allowlist, a refused literal."""
    if policy.allowed_domains is not None and web.host not in policy.allowed_domains:
        raise MediaRefused(web.url, f"names host '{web.host}', which is not in "
                           "--allowed-media-domains")
    if web.literal is not None:
        why = address_refusal(web.literal, policy)
        if why is not None:
            raise MediaRefused(web.url, f"is {why}")


def _file_url(url: str, policy: MediaPolicy) -> FileUrl:
    if policy.allowed_local_dir is None:
        raise MediaRefused(url, "is a file: URL, and no --allowed-local-media-path is set")
    try:
        split = urlsplit(url)
    except ValueError as exc:  # (a "[" in the host part)
        raise MediaRefused(url, f"is not a valid URL ({exc})") from None
    if split.netloc not in ("", "localhost") or split.query:
        raise MediaRefused(url, "is a file: URL that is not file:///PATH")
    path = unquote(split.path)
    if "\x00" in path:
        raise MediaRefused(url, "is a file: URL whose path holds a NUL byte")
    return FileUrl(url, path)


# -- the address rule ------------------------------------------------------------------

#: Cloud metadata services (AWS, GCP, Azure, ... and AWS's IPv6 one): refused always.
METADATA = frozenset(ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254"))
_SHARED = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, compatible, 6to4, NAT64), if any."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64 or (address.packed[:12] == bytes(12) and int(address) > 1):
        return ipaddress.IPv4Address(address.packed[12:])
    return None


def _kind(address: IPAddress) -> tuple[str, bool] | None:
    """(what ``address`` is, whether it is refused even when private ones are allowed),
    or None for a public unicast address."""
    if address in METADATA:
        return "a cloud metadata address", True
    if address.is_unspecified:
        return "an unspecified address", True
    if address.is_multicast:
        return "a multicast address", True
    if address.is_loopback:
        return "a loopback address", False
    if address.is_link_local:
        return "a link-local address", False
    if address.is_reserved:
        return "a reserved address", True
    if address in _SHARED:
        return "a shared (CGNAT) address", False
    if address.is_private:
        return "a private address", False
    if isinstance(address, ipaddress.IPv6Address) and address.is_site_local:
        return "a site-local address", False
    if not address.is_global:
        return "a non-public address", False
    return None


def address_refusal(address: IPAddress, policy: MediaPolicy) -> str | None:
    """Why ``address`` is not connected to ("a private address 10.0.0.5"); None: it may be."""
    embedded = (_embedded_ipv4(address) if isinstance(address, ipaddress.IPv6Address)
                else None)
    judged: IPAddress = embedded if embedded is not None else address
    kind = _kind(judged)
    if kind is None or (policy.allow_private_addresses and not kind[1]):
        return None
    where = f" ({embedded} inside IPv6)" if embedded is not None else ""
    return f"{kind[0]} {address}{where}"

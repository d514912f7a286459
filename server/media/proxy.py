"""Which HTTP proxy an image URL goes through: ``HTTP_PROXY``, ``HTTPS_PROXY``, ``NO_PROXY``.

When: a frontend that reaches the web only through a proxy. The variables are read once,
at start, as vLLM's fetcher reads them (aiohttp with ``trust_env``, which asks Python's
urllib): ``HTTP_PROXY`` for http URLs, ``HTTPS_PROXY`` for https ones, the lowercase
spelling first. ``NO_PROXY`` lists hosts and domains that go direct, as urllib reads it.
``ALL_PROXY`` is not read, as vLLM does not read it; the start log says so.

A proxy is ``http://[user:password@]host[:port]`` (a bare ``host:port`` too, as curl reads
it), or ``https://...``: then the connection to the proxy is TLS, its certificate checked
as an image server's is (curl's and urllib3's reading). Its credentials go as
``Proxy-Authorization: Basic``. Any other scheme (``socks5://``) is refused at start,
naming the variable. Sans-IO: the fetch is server.media.connect's and server.media.http1's.

A URL to ``localhost`` or a loopback address never goes through a proxy, as Go's clients
do. The proxy's loopback is not this host's, and a loopback URL passes the address rule
only when the operator allowed this host's loopback.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit
from urllib.request import getproxies_environment
# (urllib's reading of NO_PROXY, the one aiohttp gets: not in typeshed, public since 2.x)
from urllib.request import proxy_bypass_environment  # type: ignore[attr-defined]

__all__ = ["Proxy", "ProxyRoutes", "all_proxy_ignored", "proxy_routes_from_environment"]


@dataclass(frozen=True)
class Proxy:
    """One HTTP proxy: where it listens, the variable that named it, its credentials."""

    host: str
    port: int
    #: The environment variable it came from (``HTTPS_PROXY``), for messages.
    variable: str
    #: The ``Proxy-Authorization`` value; None: no credentials. Out of ``repr``: its
    #: base64 is the password in clear.
    authorization: str | None = field(default=None, repr=False)
    #: Whether the connection to the proxy is TLS (an ``https://`` proxy URL).
    tls: bool = False

    def __str__(self) -> str:
        """The proxy for messages and logs: never its credentials."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port} ({self.variable})"

    @classmethod
    def parse(cls, value: str, variable: str) -> Proxy:
        """The proxy a variable's ``value`` names; ValueError naming ``variable`` if not
        one this fetcher can use. No message holds anything before the value's last
        ``@``: a password that is not percent-encoded must not reach the log."""
        value = value.strip()  # (as urlsplit strips a leading space: a YAML block's)
        if "://" not in value:  # (curl and requests read a bare host:port as http)
            value = "http://" + value
        scheme, rest = value.split("://", 1)
        scheme = scheme.lower()
        shown = f"{scheme}://" + re.split(r"[?#]", rest.rpartition("@")[2])[0]
        try:
            split = urlsplit(value)
        except ValueError:
            raise ValueError(f"{variable} is not a valid proxy URL ({shown})") from None
        if "@" in split.path + split.query + split.fragment:
            raise ValueError(f"{variable} has an '@' after its host ({shown}): a '/', '?' "
                             "or '#' in its user or password must be percent-encoded")
        try:
            port = split.port
        except ValueError:  # (its text quotes the port, which may be part of a password)
            raise ValueError(f"{variable} is not a valid proxy URL ({shown}): its port "
                             "is not a number from 1 to 65535") from None
        if scheme not in ("http", "https"):
            raise ValueError(f"{variable} names a {scheme}:// proxy ({shown}), which the "
                             "image fetcher does not support: only http:// and https://")
        if not split.hostname or split.path not in ("", "/") or split.query or split.fragment:
            raise ValueError(f"{variable} is not a proxy URL {scheme}://host:port ({shown}"
                             f"{'?...' if split.query else ''})")
        authorization = None
        if split.username is not None:
            pair = f"{unquote(split.username)}:{unquote(split.password or '')}"
            authorization = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
        tls = scheme == "https"
        return cls(split.hostname.lower(), port or (443 if tls else 80), variable,
                   authorization, tls)


@dataclass(frozen=True)
class ProxyRoutes:
    """The proxies of http and https URLs, and the hosts that go direct."""

    http: Proxy | None = None
    https: Proxy | None = None
    #: ``NO_PROXY``'s value as urllib reads it (comma list, ``*``: every host).
    no_proxy: str | None = None

    @classmethod
    def from_proxies(cls, proxies: Mapping[str, str],
                     spelling: Mapping[str, str] | None = None) -> ProxyRoutes | None:
        """The routes of urllib's scheme -> URL map (``getproxies_environment``); None when
        neither http nor https has a proxy. ``spelling``: each scheme's variable name."""
        names = {"http": "HTTP_PROXY", "https": "HTTPS_PROXY", **(spelling or {})}
        http, https = (Proxy.parse(proxies[s], names[s]) if proxies.get(s) else None
                       for s in ("http", "https"))
        if http is None and https is None:
            return None
        return cls(http, https, proxies.get("no"))

    def proxy_for(self, scheme: str, host: str) -> Proxy | None:
        """The proxy a URL of ``scheme`` to ``host`` goes through; None: direct."""
        if host == "localhost" or _loopback(host):
            return None
        proxy = self.https if scheme == "https" else self.http
        if proxy is None or (self.no_proxy is not None
                             and proxy_bypass_environment(host, {"no": self.no_proxy})):
            return None
        return proxy

    def describe(self) -> str:
        """One line for the start log: which proxy each scheme uses (no credentials)."""
        parts = []
        for scheme, proxy in (("http", self.http), ("https", self.https)):
            credentials = " with credentials" if proxy and proxy.authorization else ""
            parts.append(f"{scheme} through {proxy}{credentials}" if proxy else
                         f"{scheme} direct")
        if self.no_proxy:
            parts.append(f"direct to NO_PROXY={self.no_proxy}")
        return "image URLs: " + "; ".join(parts) + "; direct to localhost and loopback"


def proxy_routes_from_environment() -> ProxyRoutes | None:
    """The routes the environment sets (read now, as urllib reads it); None: none.
    ValueError naming the variable of a proxy that cannot be used."""
    proxies = getproxies_environment()
    # (urllib takes the lowercase spelling over the uppercase one: name the one it took)
    spelling = {s: f"{s}_proxy" if os.environ.get(f"{s}_proxy") else f"{s.upper()}_PROXY"
                for s in ("http", "https")}
    return ProxyRoutes.from_proxies(proxies, spelling)


def all_proxy_ignored() -> str | None:
    """The ``ALL_PROXY`` variable's name when it is set (it is not read), else None."""
    for name in ("all_proxy", "ALL_PROXY"):
        if os.environ.get(name):
            return name
    return None


def _loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)

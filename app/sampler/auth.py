"""Where a store's credential may go, and what it is: the origins the user configured, and the header itself.

A credential goes to the origin (scheme, host, port) of the source the user configured, to the hosts a local index
file of theirs lists, and to those ``auth_extra_hosts`` names — never to a host only a remote index names
(docs/security.md). The header is fixed, or read from a file at each request (a mounted Secret that rotates).
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Callable

from ..formats.urls import expand, is_index, is_remote, parse_index


def origin(u: urllib.parse.SplitResult) -> tuple[str, str, int]:
    """(scheme, host, port) of a URL: what a credential is tied to (curl's and requests' rule)."""
    return u.scheme, (u.hostname or "").lower(), u.port or (443 if u.scheme == "https" else 80)


_HOST = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?|[0-9a-f.]*:[0-9a-f:.]*")  # a name, an IPv4 or IPv6 address
AUTH_HOSTS_FORM = ("comma-separated origins: https://host or https://host:port (http://host:port for a store "
                   "without TLS; a bare host means https), no path, no user, no wildcard")


def parse_auth_hosts(text: str) -> frozenset[tuple[str, str, int]]:
    """The origins ``auth_extra_hosts`` names, which the auth header may go to besides the source's own; a
    ValueError naming the entry that is not one. A bare ``host[:port]`` is HTTPS: a token is never sent in the
    clear to a host unless the user wrote ``http://``."""
    out = set()
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        u = urllib.parse.urlsplit(entry if "://" in entry else f"https://{entry}")
        try:
            port = u.port
        except ValueError:
            port = 0
        why = ""
        if u.scheme not in ("http", "https"):
            why = f"{u.scheme}: is not http: or https:"
        elif port == 0:
            why = "its port is not a number in 1..65535"
        elif "@" in u.netloc:
            why = "it names a user; the header is the credential"
        elif u.path not in ("", "/") or u.query or u.fragment:
            why = "it has a path or query: the header goes to a whole origin"
        elif "*" in u.netloc:
            why = "wildcards are not supported: list each host"
        elif not _HOST.fullmatch(u.hostname or ""):
            why = "it names no host"
        if why:
            raise ValueError(f"{entry!r} is not an origin ({why}); give {AUTH_HOSTS_FORM}")
        out.add(origin(u))
    return frozenset(out)


def auth_origins(source: str, extra_hosts: str = "") -> frozenset[tuple[str, str, int]]:
    """Where the source's auth header may go: the origins of the HTTP(S) URLs the source setting names, of
    those a local index file it names lists (the user's own file, as trusted as the setting; a remote index is
    not), and those ``extra_hosts`` (the ``auth_extra_hosts`` setting) names."""
    urls = []
    for name in expand(source.strip()):
        if name.startswith(("http://", "https://")):
            urls.append(name)
        elif not is_remote(name) and is_index(name) and os.path.isfile(name):
            with open(name) as f:
                urls += [e.url for e in parse_index(f.read(), os.path.abspath(name))]
    return frozenset(origin(urllib.parse.urlsplit(u)) for u in urls if u.startswith(("http://", "https://"))) \
        | parse_auth_hosts(extra_hosts)


def auth_headers(header: str, header_file: str) -> Callable[[], dict[str, str]]:
    """The auth header as settings give it: a ``Name: value`` line, or a file holding one (or a bare token)."""

    def parse(line: str) -> dict[str, str]:
        line = line.strip()
        if not line:
            return {}
        name, sep, value = line.partition(":")
        if sep and name and " " not in name.strip():
            return {name.strip(): value.strip()}
        return {"Authorization": f"Bearer {line}"}

    if header_file:
        def from_file() -> dict[str, str]:
            with open(header_file) as f:  # read at each request: a mounted Secret may rotate
                return parse(f.read())
        return from_file
    fixed = parse(header)
    return lambda: fixed

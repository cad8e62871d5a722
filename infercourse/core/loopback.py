"""Load and faults stay on this machine: which hosts count as loopback, checked before any traffic.

A load test aimed at someone else's server is a denial-of-service attack on it, and a fault
drill on it is worse. So every command that sends load or faults (`bench`, `soak`, the fault
lab) refuses a non-loopback target unless the user says they own it (`--allow-remote`), and
`serve` refuses to listen beyond loopback without an API key. The check must come *first*:
building a workload can already talk to the server (a fixed-length prompt asks the server's
`/tokenize`), so a check inside the run would come one request too late. The command line
calls `refuse_remote` while it parses its arguments, before it builds anything.

The set is deliberately narrow: exactly the three names every machine resolves to itself.
127.0.0.2 is loopback too, but nothing here needs it, and a narrow set is one a test can
use: a stand-in listening on 127.0.0.2 is "remote" to this check yet unreachable from
anywhere else.
"""
from __future__ import annotations

from urllib.parse import urlparse

__all__ = ["LOOPBACK_HOSTS", "url_host", "is_loopback", "refuse_remote"]

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def url_host(url: str) -> str:
    """The host of `url` ("http://[::1]:8000/v1" -> "::1"); "" when it has none."""
    return urlparse(str(url)).hostname or ""


def is_loopback(host: str) -> bool:
    """True for the names of this machine's loopback interface (see the module docstring)."""
    return host.lower().strip("[]") in LOOPBACK_HOSTS


def refuse_remote(url: str, *, what: str, allow_remote: bool = False, hint: str | None = None) -> str | None:
    """The reason to refuse `url` as a target of `what` (a sentence), or None when it is fine.

    Returns the reason rather than raising, so a parser can exit with a usage error
    (`p.error(reason)`) and a library call can raise `APILayerError(reason)`.

    Args:
        url: the server root the command would send to.
        what: the command, for the message ("bench", "soak").
        allow_remote: the user said they own that server and mean to load it.
        hint: what to do instead (default: name --allow-remote).
    """
    host = url_host(url)
    if not host:
        return f"{what}: {url!r} is not a URL with a host (e.g. http://127.0.0.1:8080)"
    if allow_remote or is_loopback(host):
        return None
    return (f"{what} targets loopback servers only, got {host}: nothing was sent. "
            + (hint or "Pass --allow-remote if you own that server and mean to load it"))

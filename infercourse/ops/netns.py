"""A network namespace that holds nothing but loopback: where a real coding agent runs.

Claude Code and Codex CLI are programs written to reach their vendors' clouds: telemetry,
auto-update, feature flags, and the model API itself unless told otherwise. In this course
a real agent talks only to a server on 127.0.0.1, and that is made true by the kernel, not
by trusting settings: on Linux the agent, the recording proxy and the model server all run
inside a new network namespace (`unshare -n`) whose only interface is `lo`, brought up by
hand. A packet to anywhere else has no route; nothing can leave the machine.

    argv = netns.wrap([sys.executable, "-m", "infercourse.ops.agent_lab_child", spec])
    subprocess.run(argv)          # the child checks `only_loopback()` before it starts anything

`unshare -n` needs CAP_SYS_ADMIN: root has it; an ordinary user gets it inside a new user
namespace (`unshare -rn`, where the kernel allows unprivileged user namespaces). Where no
namespace can be made, `wrap` refuses (`AgentLayerError`). `host_network=True` (the CLI's
`--no-netns`, which tests and `make course` never pass) asks for no namespace at all: no
`unshare`, the host's network, and the run's manifest says so. macOS has no network
namespaces, so there a sealed run cannot be made: `wrap` refuses unless the learner opts in
with `host_network` (`--no-netns`), and then the agent runs as a normal process on the host's
network (it talks to the loopback server it is given, but nothing stops it reaching the
internet), which the run's manifest and output say. `isolates(host_network)` says which of
the two a run gets, before it starts.

Written by hand (stdlib `fcntl`/`socket`, ~20 lines): bringing `lo` up is one ioctl, so the
lab does not depend on iproute2 being installed, and `socket.if_nameindex()` is the check
that the namespace holds nothing else.
"""
from __future__ import annotations

import fcntl
import functools
import os
import shutil
import socket
import struct
import subprocess
import sys

from infercourse.core.errors import AgentLayerError

__all__ = ["available", "why_not", "isolates", "wrap", "bring_up_loopback", "interfaces", "only_loopback",
           "assert_only_loopback"]

_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def _unshare_argv() -> list[str] | None:
    """`unshare -n` for root, `unshare -rn` (a user namespace too) for anyone else."""
    if not sys.platform.startswith("linux"):
        return None
    exe = shutil.which("unshare")
    if exe is None:
        return None
    return [exe, "-n"] if os.geteuid() == 0 else [exe, "-r", "-n"]


@functools.lru_cache(maxsize=1)
def why_not() -> str | None:
    """None where a loopback-only namespace can be made here, else the reason (tried once)."""
    if sys.platform == "darwin":
        return "macOS has no network namespaces"
    base = _unshare_argv()
    if base is None:
        return "no `unshare` (util-linux) on this Linux machine"
    try:
        out = subprocess.run([*base, "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`{' '.join(base)} true` failed: {e}"
    if out.returncode != 0:
        return (f"`{' '.join(base)} true` failed: {out.stderr.strip()[:200]} (a container without "
                "CAP_SYS_ADMIN, or unprivileged user namespaces switched off)")
    return None


def available() -> bool:
    """Can a loopback-only network namespace be made on this machine?"""
    return why_not() is None


def isolates(host_network: bool = False) -> bool:
    """Does `wrap(argv, host_network=...)` put `argv` in a loopback-only namespace here?
    False with `host_network` (no `unshare` at all) and on macOS; True where one can be made
    on Linux (and where none can, `wrap` refuses)."""
    return not host_network and sys.platform.startswith("linux")


def wrap(argv: list[str], *, host_network: bool = False) -> list[str]:
    """`argv` to run inside a new loopback-only network namespace (`unshare -n`).

    Args:
        argv: the command; it must call `bring_up_loopback()` and `assert_only_loopback()`
            itself before it starts a server or an agent (the agent lab does), when
            `isolates(host_network)`.
        host_network: no namespace: `argv` as it is, on the host's network (the CLI's
            `--no-netns`; on macOS the only way to run at all, so it must be asked for). A
            namespace without `lo` brought up would reach nothing, not even its own server,
            so there is no half-way.
    """
    if host_network:
        return list(argv)
    reason = why_not()
    if reason is None and isolates(host_network):
        return [*_unshare_argv(), *argv]
    risk = ("--no-netns runs it on the host network, at your own risk: it can then reach the internet, "
            "and the run's manifest says so")
    raise AgentLayerError(
        f"cannot make a loopback-only network namespace here: {reason}; a real agent runs only "
        "inside one unless you opt out", hint=risk if sys.platform == "darwin" else
        "run as root or enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1); " + risk)


def bring_up_loopback() -> None:
    """Set `lo` up (a new namespace starts with it down): the ioctl `ip link set lo up` makes."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, ifr))[1]
        if not flags & _IFF_UP:
            fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def interfaces() -> list[str]:
    """The network interfaces this process can see."""
    return [name for _, name in socket.if_nameindex()]


def only_loopback() -> bool:
    return interfaces() == ["lo"]


def assert_only_loopback() -> None:
    """Refuse to go on unless this process's namespace holds `lo` and nothing else."""
    names = interfaces()
    if names != ["lo"]:
        raise AgentLayerError(f"this network namespace has {names}, not only loopback: a real agent "
                              "is not started here")

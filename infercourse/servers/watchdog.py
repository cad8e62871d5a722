"""A tiny guardian process: it runs one server and kills it when its parent goes away.

A notebook kernel that crashes (or is killed with `kill -9`) runs no `atexit` handlers,
so a server it started would otherwise keep its port and its RAM forever. Every server
in `infercourse.servers` is therefore launched as

    python -m infercourse.servers.watchdog -- <server argv...>

with a pipe on stdin whose write end only the parent holds. The watchdog starts the
server in its own process group, then waits. It ends the whole group when

- stdin reaches EOF (the parent died: the kernel closes its fds, on Linux and macOS), or
- its parent pid changes (reparented to init/launchd: a second, poll-based signal), or
- it gets SIGTERM/SIGINT (`Server.stop()`), or the server exits by itself.

On Linux the server also gets `PR_SET_PDEATHSIG(SIGKILL)`, so even a `kill -9` of the
watchdog itself takes the server down. Written by hand because it is ~60 lines and no
well-kept library does "kill my child when my parent dies" portably.
"""
from __future__ import annotations

import ctypes
import os
import select
import signal
import stat
import subprocess
import sys
import time

POLL_S = 0.25      # how often we look at the parent pid when stdin stays quiet
GRACE_S = 5.0      # SIGTERM first, then SIGKILL after this long


def _pdeathsig() -> None:  # runs in the server child, before exec (Linux only)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 == PR_SET_PDEATHSIG
    except OSError:
        pass


def _end(proc: subprocess.Popen) -> int:
    """Stop the server's whole process group (vLLM forks engine workers)."""
    for sig, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, GRACE_S)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
    try:  # children that outlived the leader
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return proc.wait()


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--" or len(argv) < 2:
        print("usage: python -m infercourse.servers.watchdog -- CMD [ARGS...]", file=sys.stderr)
        return 2
    parent = os.getppid()
    stop = {"now": False}

    def _on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    proc = subprocess.Popen(
        argv[1:], stdin=subprocess.DEVNULL, start_new_session=True,
        preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None)
    print(f"[watchdog {os.getpid()}] started server pid {proc.pid} for parent {parent}",
          file=sys.stderr, flush=True)
    # Only a pipe tells us anything; /dev/null or a tty would read as EOF or never.
    watch_stdin = stat.S_ISFIFO(os.fstat(0).st_mode)
    while not stop["now"] and proc.poll() is None:
        if watch_stdin:
            try:
                ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
            except (InterruptedError, ValueError):
                ready = []
            if ready and not os.read(sys.stdin.fileno(), 4096):
                print(f"[watchdog] parent {parent} closed the pipe: stopping server",
                      file=sys.stderr, flush=True)
                break
        else:
            time.sleep(POLL_S)
        if os.getppid() != parent:
            print(f"[watchdog] parent {parent} is gone: stopping server",
                  file=sys.stderr, flush=True)
            break
    if proc.poll() is not None:  # it ended by itself: say how (a negative code is a signal)
        print(f"[watchdog] server exited by itself with code {proc.returncode}",
              file=sys.stderr, flush=True)
    return _end(proc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

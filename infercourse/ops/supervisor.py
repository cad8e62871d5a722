"""A supervisor: notice that a server died, restart it where it was, and count.

Production servers run under one (systemd's `Restart=on-failure`, a Kubernetes
liveness probe): a crash then costs the requests in flight and the restart time, not
the service. A soak needs the same, and needs it *counted*, because "restarted 3 times
in 24 h" is the stability result. `Supervisor` restarts a `servers.Server` on the same
port (clients keep their URL) and writes each start, crash and restart to
`events.jsonl`, fsynced. `kill_server` is the crash drill: SIGKILL, as the OOM killer
sends it.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from infercourse.core.errors import ServerLayerError

__all__ = ["EVENTS", "Supervisor", "kill_server"]

EVENTS = "events.jsonl"


class Supervisor:
    """Keep one server up: notice it died, restart it on the same port, count restarts.

    Args:
        server: a `servers.Server` (started or not); restarts reuse its port, so clients
            keep their URL.
        max_restarts: give up (ServerLayerError) after this many.
        log: path of `events.jsonl` (one line per start, crash and restart).
    """

    def __init__(self, server, *, max_restarts: int = 5, log: str | os.PathLike | None = None):
        self.server, self.max_restarts, self.restarts = server, max_restarts, 0
        self.log, self.events, self.t0 = Path(log) if log else None, [], time.perf_counter()

    def _event(self, kind: str, **kw: Any) -> dict:
        ev = {"t_s": time.perf_counter() - self.t0, "time": time.time(), "event": kind, **kw}
        self.events.append(ev)
        if self.log:
            with open(self.log, "a", encoding="utf-8") as f:
                f.write(json.dumps(ev, default=str) + "\n")
                f.flush()
                os.fsync(f.fileno())
        return ev

    def alive(self) -> bool:
        return self.server.running and self.server._healthy()

    def start(self) -> None:
        t = time.perf_counter()
        self.server.start()
        self._event("start", pid=self.server.pid, port=self.server.port, took_s=time.perf_counter() - t)

    def restart(self, reason: str) -> float:
        """Stop what is left, start again; returns the seconds the restart took."""
        if self.restarts >= self.max_restarts:
            raise ServerLayerError(f"{self.server.name} died {self.restarts + 1} times; not restarting "
                                   f"again (max_restarts={self.max_restarts}). Last log lines:\n"
                                   f"{self.server.log_tail(15)}", hint="read the server log")
        code = self.server.proc.poll() if self.server.proc else None
        self._event("crash", reason=reason, pid=self.server.pid, watchdog_code=code,
                    log_tail=self.server.log_tail(5))
        t = time.perf_counter()
        self.server.stop()
        self.server.start()
        self.restarts += 1
        took = time.perf_counter() - t
        self._event("restart", pid=self.server.pid, took_s=took, n=self.restarts)
        return took


def kill_server(server) -> None:
    """The crash drill: SIGKILL the server process itself (not its watchdog), as the OOM
    killer would."""
    if server.pid:
        try:
            os.kill(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

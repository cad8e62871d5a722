"""Start, health-check, log and always stop local inference servers.

A server here is a child process bound to 127.0.0.1 on a free port, its stdout and stderr
written to a log file under `cache_dir()/logs`. Three guards make sure none outlives the
notebook that started it: `with Server(...)` / `.stop()`, an `atexit` hook, and a
watchdog process (`infercourse.servers.watchdog`) that kills the server when its parent Python
process disappears, even when a crashed kernel is `kill -9`ed and runs no cleanup at all.

    with LlamaServer(n_parallel=4) as srv:            # llama.cpp's C++ llama-server
        engine = OpenAIHTTPEngine(srv.url)
        print(generate(engine, "Why is the sky blue?").text)

A server that exits early or never becomes healthy raises `ServerLayerError` quoting the
last lines of its log, which is where the reason always is.

A workshop's shared server is the one exception to 127.0.0.1: `host=` a LAN address (or
0.0.0.0), which is refused without `api_key=`. The key goes to the server's own option
through the environment variable the server reads for it (llama-server: LLAMA_API_KEY,
vLLM: VLLM_API_KEY), never on the command line, where `ps` shows it to every user; the
server itself checks it on every request. A server without such an option cannot be
shared, and says so. The same variable left in the learner's shell is removed from every
server started without `api_key=`: otherwise /health answers 200 and every request is 401.
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import httpx
import psutil

from infercourse.core.errors import ServerLayerError
from infercourse.core.loopback import is_loopback
from infercourse.models.embedded import cache_dir
from infercourse.servers import watchdog as _watchdog

__all__ = ["HOST", "Server", "free_port", "scrub_argv"]

HOST = "127.0.0.1"
_RUNNING: set["Server"] = set()
SECRET_FLAGS = ("--api-key", "--hf-token")   # their values never reach a log or a manifest


def scrub_argv(argv: list[str]) -> list[str]:
    """`argv` with each secret flag's value (`--api-key K` or `--api-key=K`) shown as ***."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        flag, eq, _ = arg.partition("=")
        if i and argv[i - 1] in SECRET_FLAGS:
            out.append("***")
        else:
            out.append(f"{flag}=***" if eq and flag in SECRET_FLAGS else arg)
    return out


def free_port() -> int:
    """A port nobody listens on right now (the OS picks it; tiny race until the bind)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError:
        return "(no log)"


class Server:
    """Base class: subclasses give `argv()`; this runs it under the watchdog.

    Args:
        port: fixed port, or None for a free one.
        startup_timeout_s: deadline for the health check (model load included).
        env: extra environment variables for the server process.
        host: the address to listen on (default 127.0.0.1); any other needs `api_key`.
        api_key: a key the server checks on every request (`Authorization: Bearer KEY`).
    """

    name = "server"
    health_path = "/health"        # GET answering 200 once the model is loaded
    served_model: str | None = None  # the `model` name requests use (None: ask /v1/models)
    startup_timeout_s = 120.0
    api_key_flag: str | None = None  # the server's flag to check a key itself; None: it cannot
    api_key_env: str | None = None   # the same option as an environment variable (kept out of `ps`)

    def __init__(self, *, port: int | None = None, startup_timeout_s: float | None = None,
                 env: dict[str, str] | None = None, host: str = HOST, api_key: str | None = None):
        if api_key and not self.api_key_flag:
            raise ServerLayerError(f"{self.name} cannot check an API key, so it cannot be a shared server",
                                   hint="share llama-server or vLLM instead; this one serves 127.0.0.1 only")
        if not is_loopback(host) and not api_key:
            raise ServerLayerError(f"refusing to listen on {host} without an API key: anyone who can reach "
                                   "that address could use the server", hint="give api_key= (serve: $INFERCOURSE_API_KEY or --api-key-file)")
        self.host, self.api_key = host, api_key or None
        self.port = port or free_port()
        if startup_timeout_s is not None:
            self.startup_timeout_s = startup_timeout_s
        self.env = dict(env or {})
        if self.api_key and self.api_key_env:
            self.env[self.api_key_env] = self.api_key
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_path = cache_dir() / "logs" / f"{self.name}-{self.port}-{stamp}.log"
        self.proc: subprocess.Popen | None = None     # the watchdog
        self.pid: int | None = None                   # the server itself
        self._version: str | None = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def listen_args(self) -> list[str]:
        """Where the server listens, and the key it must check on every request (if any)."""
        key = [self.api_key_flag, self.api_key] if self.api_key and not self.api_key_env else []
        return ["--host", self.host, "--port", str(self.port), *key]

    @property
    def url(self) -> str:
        # this machine reaches a server on every interface through loopback
        host = {"0.0.0.0": HOST, "::": "::1"}.get(self.host, self.host)
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def engine(self, **kw: Any):
        """An OpenAIHTTPEngine pointed at this server (kw: api=, extra_body=, ...)."""
        from infercourse.engines.openai_http import OpenAIHTTPEngine
        kw.setdefault("api_key", self.api_key)
        return OpenAIHTTPEngine(self.url, model=kw.pop("model", self.served_model), **kw)

    def log_tail(self, n: int = 30) -> str:
        return _tail(self.log_path, n)

    def child_env(self) -> dict[str, str]:
        """The server's environment: ours, less the variable its key option reads, plus `env`.

        A LLAMA_API_KEY (VLLM_API_KEY) exported in the learner's shell, for some other
        server, would make every course server demand it: /health passes (it is public),
        then every request gets 401. So it reaches the server only through `api_key=`.
        """
        env = {k: v for k, v in os.environ.items() if k != self.api_key_env}
        return {**env, **self.env}

    def start(self) -> "Server":
        """Launch under the watchdog and wait until healthy; raises ServerLayerError."""
        if self.running:
            return self
        argv = [str(a) for a in self.argv()]
        self.pid = None             # a restart is a new process: never keep a dead one's pid
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(("$ " + " ".join(scrub_argv(argv)) + "\n").encode())
            log.flush()
            # stdin=PIPE: only we hold the write end, so the watchdog reads EOF when we die
            self.proc = subprocess.Popen(
                [sys.executable, _watchdog.__file__, "--", *argv], stdin=subprocess.PIPE,
                stdout=log, stderr=subprocess.STDOUT, env=self.child_env())
        _RUNNING.add(self)
        self._wait_healthy()
        return self

    def _find_pid(self) -> None:
        try:
            kids = psutil.Process(self.proc.pid).children()
            self.pid = kids[0].pid if kids else None
        except psutil.Error:
            pass

    def _healthy(self) -> bool:
        try:
            auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            return httpx.get(self.url + self.health_path, headers=auth, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.pid is None:
                self._find_pid()
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.stop()
                raise ServerLayerError(
                    f"{self.name} exited (code {rc}) before it became healthy. Last lines of "
                    f"{self.log_path}:\n{self.log_tail()}", hint="the reason is in the log above")
            if self._healthy():
                if self.pid is None:
                    self._find_pid()
                return
            time.sleep(0.25)
        self.stop()
        raise ServerLayerError(
            f"{self.name} not healthy at {self.url}{self.health_path} after "
            f"{self.startup_timeout_s:.0f}s. Last lines of {self.log_path}:\n{self.log_tail()}",
            hint="raise startup_timeout_s for a large model, or read the log")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the watchdog (which stops the server's process group), then make sure."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.pid is not None and psutil.pid_exists(self.pid):  # e.g. macOS: no PDEATHSIG
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.proc.stdin:
            self.proc.stdin.close()
        _RUNNING.discard(self)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def version(self) -> str | None:
        """`<binary> --version`, first lines (cached)."""
        if self._version is None:
            try:
                out = subprocess.run([self.argv()[0], "--version"], capture_output=True,
                                     text=True, timeout=60)
                self._version = (out.stdout + out.stderr).strip()[:300] or None
            except (OSError, subprocess.TimeoutExpired):
                self._version = None
        return self._version

    def describe(self) -> dict[str, Any]:
        """What a result manifest records about this server."""
        argv = scrub_argv([str(a) for a in self.argv()])
        return {"server": self.name, "binary": argv[0], "version": self.version(), "argv": argv,
                "host": self.host, "port": self.port, "api_key_checked": bool(self.api_key), "url": self.url, "pid": self.pid,
                "log_path": str(self.log_path)}


@atexit.register
def _stop_all() -> None:
    for srv in list(_RUNNING):
        srv.stop()

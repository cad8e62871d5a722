"""Faults at start: the server is configured wrong before it ever answers.

Some failures happen before the first request: the process cannot get the memory its
context asks for, the model file is gone or truncated, or the chat template cannot render
the turns an agent sends. The server never becomes healthy (or answers every tool turn
with an error), and the only evidence is its exit code, its log, and what its endpoints
say about the template. Each function here is a context manager used by
`infercourse.ops.faults.inject`; it fills the `Injected` record it is given.
"""
from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from infercourse.core.errors import HardwareLayerError, InferCourseError
from infercourse.models.embedded import embedded_gguf
from infercourse.servers.llama import LlamaServer

__all__ = ["small_server", "memory_limited", "model_file", "template_breaks_tools", "BROKEN_TEMPLATE"]


def small_server(**kw: Any) -> LlamaServer:
    """The lab's server: the embedded model, 1 thread, 2 slots of 512 tokens (kw overrides)."""
    return LlamaServer(**{"threads": 1, "n_parallel": 2, "ctx_size": 1024, **kw})


class _Limited(LlamaServer):
    """llama-server under an address-space limit, set between fork and exec."""

    name = "llama-server-limited"

    def __init__(self, limit_bytes: int, **kw: Any):
        self.limit_bytes = limit_bytes
        super().__init__(**kw)

    def argv(self) -> list[str]:
        wrap = ("import os, resource, sys; n = int(sys.argv[1]); "
                "resource.setrlimit(resource.RLIMIT_AS, (n, n)); os.execv(sys.argv[2], sys.argv[2:])")
        return [sys.executable, "-c", wrap, str(self.limit_bytes), *super().argv()]


def _start_failing(f, srv) -> None:
    try:
        srv.start()
        f.notes["started"] = True   # it should not have: the doctor will say it is healthy
    except InferCourseError as e:
        f.saw(e)
    f.url, f.server = srv.url, srv


@contextlib.contextmanager
def memory_limited(f, server, seconds: float):
    if not sys.platform.startswith("linux"):
        raise HardwareLayerError("RLIMIT_AS is only enforced on Linux", hint="this fault is skipped here")
    import psutil
    healthy = server or small_server().start()   # calibrate: a working server's address space
    try:
        base = psutil.Process(healthy.pid).memory_info().vms
    finally:
        if server is None:
            healthy.stop()
    ctx = 1 << 16                      # 64 Ki tokens: ~1.5 GB of KV cache for SmolLM2-135M
    from infercourse.models.modelcard import model_card
    kv = int(model_card(embedded_gguf()).kv_bytes_per_token() * ctx)
    srv = _Limited(base + kv // 2, threads=1, n_parallel=1, ctx_size=ctx, startup_timeout_s=60)
    f.notes = {"limit_bytes": base + kv // 2, "kv_cache_bytes": kv, "ctx_size": ctx}
    try:
        _start_failing(f, srv)
        yield
    finally:
        srv.stop()


@contextlib.contextmanager
def model_file(f, server, seconds: float, corrupt: bool):
    with tempfile.TemporaryDirectory(prefix="infercourse-fault-") as tmp:
        path = Path(tmp) / "model.gguf"
        with open(embedded_gguf(), "rb") as src, open(path, "wb") as dst:
            dst.write(src.read(4 << 20))   # the header and the first tensors only: truncated
        srv = small_server(model=path, startup_timeout_s=60)
        if not corrupt:
            path.unlink()                 # gone between the configuration and the start
        f.notes = {"model_path": str(path), "kind": "truncated to 4 MiB" if corrupt else "deleted"}
        try:
            _start_failing(f, srv)
            yield
        finally:
            srv.stop()


BROKEN_TEMPLATE = ("{%- for m in messages -%}{%- if m.role == 'tool' or m.tool_calls is defined and m.tool_calls -%}"
                   "{{ raise_exception('this template has no tool role') }}{%- endif -%}"
                   "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor -%}"
                   "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")


@contextlib.contextmanager
def template_breaks_tools(f, server, seconds: float):
    from infercourse.ops.probes import TOOL_TURN
    with tempfile.TemporaryDirectory(prefix="infercourse-fault-") as tmp:
        tpl = Path(tmp) / "broken.jinja"
        tpl.write_text(BROKEN_TEMPLATE)
        with small_server(extra_args=("--jinja", "--chat-template-file", str(tpl))) as srv:
            r = httpx.post(srv.base_url + "/chat/completions", timeout=30,
                           json={**TOOL_TURN, "max_tokens": 8})
            if r.status_code >= 400:
                f.client_error, f.client_layer = f"HTTP {r.status_code}: {r.text[:200]}", "API"
            f.url, f.server, f.notes = srv.url, srv, {"template": str(tpl)}
            yield

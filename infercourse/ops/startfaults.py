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
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from infercourse.core.errors import HardwareLayerError, InferCourseError
from infercourse.models.embedded import embedded_gguf
from infercourse.servers.llama import LlamaServer

__all__ = ["small_server", "memory_limited", "memory_growth", "model_file", "template_breaks_tools",
           "BROKEN_TEMPLATE", "log_evidence"]


def small_server(**kw: Any) -> LlamaServer:
    """The lab's server: the embedded model, 1 thread, 2 slots of 512 tokens (kw overrides)."""
    return LlamaServer(**{"threads": 1, "n_parallel": 2, "ctx_size": 1024, **kw})


class _Limited(LlamaServer):
    """llama-server under an address-space limit, set between fork and exec."""

    name = "llama-server"   # not "...-limited": its log's name and its exit message are a drill's evidence

    def __init__(self, limit_bytes: int, **kw: Any):
        self.limit_bytes = limit_bytes
        super().__init__(**kw)

    def argv(self) -> list[str]:
        wrap = ("import os, resource, sys; n = int(sys.argv[1]); "
                "resource.setrlimit(resource.RLIMIT_AS, (n, n)); os.execv(sys.argv[2], sys.argv[2:])")
        return [sys.executable, "-c", wrap, str(self.limit_bytes), *super().argv()]


# llama.cpp's log lines: "0.00.028.442 E llama_model_load: error loading model: ..."
_LEVEL = re.compile(r"^\s*\d+(?:\.\d+)+\s+([DIWET])\s+(.*)$")
_BAD = re.compile(r"\b(error|failed|cannot|insufficient|out of memory)\b", re.I)


def log_evidence(text: str | None, n: int = 8) -> list[str]:
    """The error lines of a server log's tail, in order, each message once (llama.cpp often
    logs the same failure twice): the evidence a failed start leaves.

    Args:
        text: the log tail.
        n: at most this many lines.
    """
    out, seen = [], set()
    for line in (text or "").splitlines():
        m = _LEVEL.match(line)
        msg = m.group(2).strip() if m else line.strip()
        if (m.group(1) == "E" if m else bool(_BAD.search(line))) and msg not in seen:
            seen.add(msg)
            out.append(line.strip())
    return out[:n]


def _start_failing(f, srv) -> None:
    try:
        srv.start()
        f.notes["started"] = True   # it should not have: the doctor will say it is healthy
    except InferCourseError as e:
        f.saw(e)     # one line, ending "Last lines of LOG:": the lines themselves are kept here
        f.notes.update(log=str(srv.log_path), log_lines=log_evidence(srv.log_tail(60)))
    f.url, f.server = srv.url, srv


@contextlib.contextmanager
def memory_limited(f, server, seconds: float):
    """A server whose address space (RLIMIT_AS) is too small for the context it is asked for.

    Args:
        f: the `Injected` record to fill.
        server: a running embedded-model server to calibrate on (None: a small one, briefly).
        seconds: unused (the fault is over when the server has failed to start).
    """
    if not sys.platform.startswith("linux"):
        raise HardwareLayerError("RLIMIT_AS is only enforced on Linux", hint="this fault is skipped here")
    import psutil
    # calibrate on a working server of the same model: its address space without the big cache
    lent = server is not None and getattr(server, "model_path", None) == embedded_gguf()
    healthy = server if lent else small_server().start()
    try:
        base = psutil.Process(healthy.pid).memory_info().vms
    finally:
        if not lent:
            healthy.stop()
    # 64 Ki tokens of KV cache: 22.5 KiB a token for SmolLM2-135M (f16 K+V, 30 layers x 3 heads x 64),
    # ~1.4 GiB; the limit leaves room for only a third of it
    ctx, margin = 1 << 16, 512 << 20
    srv = _Limited(base + margin, threads=1, n_parallel=1, ctx_size=ctx, startup_timeout_s=60)
    f.notes = {"limit_bytes": base + margin, "calibrated_vms_bytes": base, "ctx_size": ctx}
    try:
        _start_failing(f, srv)
        yield
    finally:
        srv.stop()


@contextlib.contextmanager
def memory_growth(f, server, seconds: float, *, prompts: int = 8, tokens: int = 96, room: int = 3):
    """A server that starts, serves a run, and is killed for its memory *after* it: the host
    prompt cache (`--cache-ram`, 8 GiB by default) copies each replaced prompt's KV into RAM,
    so RSS grows with every new prompt. The kernel's OOM killer (or a container's memory
    limit) is stood in for by one SIGKILL once RSS has grown by `room` prompts' KV over its
    level after the first answer. llama-server itself never crashes here: when an allocation
    for its cache fails it evicts the oldest entry, which is why the limit is outside it.

    Args:
        f: the `Injected` record to fill (notes: RSS before/at the kill, answers served).
        server: unused (the fault starts its own server).
        seconds: unused (the fault is over when the server has been killed).
        prompts, tokens: distinct prompts sent one after another, each `tokens` long.
        room: cached prompts the stand-in limit allows beyond the first answer's RSS.
    """
    import os
    import signal

    from infercourse.core.types import Request, generate
    from infercourse.measure.workloads import exact_length_prompt
    from infercourse.models.embedded import vocab_tokenizer
    from infercourse.models.modelcard import model_card
    from infercourse.ops.sampling import process_rss_mib
    tok = vocab_tokenizer(None)
    step = tokens * model_card(None).kv_bytes_per_token(2) / 2**20
    srv = LlamaServer(threads=1, n_parallel=1, ctx_size=4 * tokens, extra_args=["--cache-ram", "8192"],
                      startup_timeout_s=60)
    f.notes = {"step_mib": step, "answered": 0}
    try:
        srv.start()
        engine = srv.engine(timeout=60)
        for i in range(prompts):
            try:
                generate(engine, Request(prompt=exact_length_prompt(tokens, tok, seed=500 + i), max_tokens=1))
            except InferCourseError as e:
                f.saw(e)
                break
            f.notes["answered"] += 1
            rss = process_rss_mib(srv.pid)
            f.notes.setdefault("rss_first_mib", rss)
            if rss > f.notes["rss_first_mib"] + room * step:    # the OOM killer's moment
                f.notes.update(rss_killed_mib=rss, limit_mib=f.notes["rss_first_mib"] + room * step)
                os.kill(srv.pid, signal.SIGKILL)
                with contextlib.suppress(Exception):
                    srv.proc.wait(10)
                try:        # the next user request after the kill: what the client sees
                    generate(engine, Request(prompt="Say hello.", max_tokens=2))
                except InferCourseError as e:
                    f.saw(e)
                break
        engine.close()
        f.url, f.server = srv.url, srv
        yield
    finally:
        srv.stop()


@contextlib.contextmanager
def model_file(f, server, seconds: float, corrupt: bool):
    """A server pointed at a model file that is deleted (`corrupt=False`) or truncated.

    Args:
        f: the `Injected` record to fill.
        server, seconds: unused (the fault starts its own server).
        corrupt: truncate to 4 MiB instead of deleting.
    """
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
    """A server whose chat template raises on tool turns; a client sends one.

    Args:
        f: the `Injected` record to fill.
        server, seconds: unused (the fault starts its own server, stopped on exit).
    """
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

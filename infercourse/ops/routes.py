"""Routes: one way each to serve the model, opened the same way for every comparison.

A route is an engine plus whatever stands in front of it: llama.cpp in process,
llama-server, transformers, MLX-LM in process, mlx_lm.server, vLLM's CPU build, Ollama.
`open_route` builds one on the embedded model's weights and yields the engine, the
conditions that a fair comparison must record (weights, quantization, threads, context)
and a memory reading; servers always stop when the block ends. A route that cannot run
here is never faked: `route_status` says why (from `ops.doctor.engine_status`), and
`slow_routes` names those that run here only far too slowly for a notebook (MLX's Linux
CPU backend, vLLM's CPU build). Notebooks 13 (a fair benchmark) and 21 (the capstone's
routes A-D) open their routes here.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pandas as pd
import psutil

__all__ = ["ROUTES", "route_status", "slow_routes", "open_route"]

# Static facts per route, from each project's own documentation; `check` is the
# `doctor.engine_status()` entry that says whether it can run here.
_FACTS = {  # route: (doctor check, API, positioning, deployment limits)
    "llama.cpp in process": ("llamacpp", "Python calls (llama-cpp-python)", "the runtime alone, embedded "
                             "in your own program", "one request at a time per loaded model; GGUF files only"),
    "llama-server": ("llama-server", "OpenAI /v1 over HTTP, /metrics, /slots", "llama.cpp's own server: one "
                     "box, CPU/GPU/Metal", "slots fixed at start (-np) share the context (-c); one model"),
    "transformers": ("transformers", "Python generate()", "the reference implementation: research, checks",
                     "no GGUF kernels (float weights here); no continuous batching in generate()"),
    "MLX in process": ("mlx", "Python stream_generate (mlx-lm)", "Apple's runtime for Apple Silicon (Metal, "
                       "unified memory)", "fast on Metal only; the Linux CPU build is slow; one request at a time"),
    "mlx_lm.server": ("mlx", "OpenAI /v1 over HTTP", "MLX-LM's server for a Mac desktop",
                      "its docs: not for production (basic security checks only)"),
    "vLLM CPU": ("vllm", "OpenAI /v1 over HTTP, Prometheus /metrics", "high-throughput serving: "
                 "PagedAttention, continuous batching", "GPU-first; the CPU build: own env, float weights, slow start"),
    "Ollama": ("ollama", "native /api/* and OpenAI /v1", "model manager + server over llama.cpp, desktop",
               "runs models from its own registry (its file, not ours); one box"),
}
ROUTES: dict[str, dict[str, str]] = {n: dict(zip(("check", "api", "positioning", "limits"), f))
                                     for n, f in _FACTS.items()}



def route_status(names: list[str], status: dict[str, dict[str, Any]] | None = None) -> pd.DataFrame:
    """Which routes can run here, and why not (one row per route).

    Args:
        names: route names from `ROUTES`.
        status: `doctor.engine_status()` (None: asked now).
    """
    if status is None:
        from infercourse.ops.doctor import engine_status
        status = engine_status()
    unknown = set(names) - set(ROUTES)
    if unknown:
        raise ValueError(f"unknown route(s) {sorted(unknown)}; choose from {list(ROUTES)}")
    return pd.DataFrame([{"route": n, "here": status[ROUTES[n]["check"]]["usable"],
                          "why": status[ROUTES[n]["check"]]["why"]} for n in names]).set_index("route")


def _tree_rss(pid: int | None) -> float:
    """Resident bytes of a server process and its children (NaN if it is gone)."""
    try:
        p = psutil.Process(pid)
        return float(sum(q.memory_info().rss for q in [p, *p.children(recursive=True)]))
    except (psutil.Error, TypeError, ValueError):
        return float("nan")


def _weights_id() -> str:
    from infercourse.models.embedded import embedded_gguf, file_sha256
    return "SmolLM2-135M-Instruct from GGUF " + file_sha256(embedded_gguf())[:12]


@contextlib.contextmanager
def open_route(name: str, *, threads: int, ctx_size: int,
               ollama_model: str = "smollm2:135m") -> Iterator[tuple[Any, dict[str, Any], Any]]:
    """Build one route on the embedded model's weights; yield (engine, fair conditions,
    memory function). Servers are stopped on exit, even when the block fails.

    Args:
        name: a key of `ROUTES`.
        threads: CPU threads where the runtime takes a number.
        ctx_size: context window (tokens) where the runtime preallocates one.
        ollama_model: the model name Ollama serves (its own file, so `weights` differs).
    """
    from infercourse.models.modelcard import model_card
    me = psutil.Process()
    rss0 = float(me.memory_info().rss)
    in_process = lambda: float(me.memory_info().rss) - rss0      # noqa: E731 - growth of this process
    fair = {"weights": _weights_id(), "threads": threads, "context_tokens": ctx_size}
    with contextlib.ExitStack() as stack:
        if name == "llama.cpp in process":
            from infercourse.engines.llamacpp import LlamaCppEngine
            engine, card, mem = LlamaCppEngine(n_threads=threads, n_ctx=ctx_size), model_card(None), in_process
        elif name == "llama-server":
            from infercourse.servers import LlamaServer
            srv = stack.enter_context(LlamaServer(n_parallel=1, ctx_size=ctx_size, threads=threads))
            engine, card, mem = srv.engine(), model_card(None), lambda: _tree_rss(srv.pid)
        elif name == "transformers":
            from transformers.utils import logging as hf_logging
            from infercourse.engines.transformers_engine import TransformersEngine
            hf_logging.disable_progress_bar()   # its weight-loading bar would land in the notebook
            engine = TransformersEngine(n_threads=threads)
            card, mem = model_card(engine.model_ref.path), in_process
            fair["context_tokens"] = "grows per request"
        elif name in ("MLX in process", "mlx_lm.server"):
            from infercourse.models.formats import mlx_folder
            folder = mlx_folder()
            card = model_card(folder)
            fair.update(threads="MLX's own", context_tokens="grows per request")
            if name == "mlx_lm.server":
                from infercourse.servers import MLXServer
                srv = stack.enter_context(MLXServer(folder))
                engine, mem = srv.engine(), lambda: _tree_rss(srv.pid)
            else:
                from infercourse.engines.mlx_engine import MLXEngine
                engine, mem = MLXEngine(folder), in_process
        elif name == "vLLM CPU":
            from infercourse.models.formats import hf_folder
            from infercourse.servers import VLLMServer
            srv = stack.enter_context(VLLMServer(hf_folder(), max_model_len=ctx_size))
            engine, card, mem = srv.engine(), model_card(hf_folder()), lambda: _tree_rss(srv.pid)
            fair["threads"] = "vLLM's own (OMP)"
        elif name == "Ollama":
            from infercourse.engines.ollama import OllamaEngine
            engine, card, mem = OllamaEngine(ollama_model, num_ctx=ctx_size), None, lambda: float("nan")
            fair.update(weights=f"ollama:{ollama_model}", quantization="Ollama's file", threads="Ollama's own")
        else:
            raise ValueError(f"unknown route {name!r}; choose from {list(ROUTES)}")
        if card is not None:
            fair["quantization"] = card.quantization
        yield engine, fair, mem




def slow_routes() -> dict[str, str]:
    """Routes that can run on this machine but far too slowly for a notebook's time
    budget, and why (MLX off Apple Silicon, vLLM's CPU build off an NVIDIA box)."""
    import platform
    import shutil
    import sys
    out = {}
    if not (sys.platform == "darwin" and platform.machine() == "arm64"):
        why = "MLX's Linux CPU backend: one agent call's prefill alone outlasts this notebook's budget"
        out.update({"MLX in process": why, "mlx_lm.server": why})
    if shutil.which("nvidia-smi") is None:
        out["vLLM CPU"] = "vLLM's CPU build takes minutes to start (load, profiling, warm-up)"
    return out



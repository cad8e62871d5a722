"""The guide's four routes to one model (A to D), started where this machine can, and the
agentic session replayed on one of them.

The reference guide compares four ways to serve a model; exactly what runs for each here:

- **A** Ollama: an Ollama server you run, serving a model created from the course's own GGUF
  (`OllamaEngine.from_gguf`: the same weights as C and D), or `ollama_model` if you name one
  (its own file, said in the route's name);
- **B** `mlx_lm.server` on an MLX folder (`mlx_model`), or vLLM's CPU build on the same
  weights in float32 where its environment exists (`vllm=True`);
- **C** llama-server on the embedded GGUF (the only route a fault can be injected into);
- **D** MLX-LM in process (the guide's D) on the embedded weights converted to MLX, wherever
  MLX imports (`mlx[cpu]` on Linux: slow, but it runs); else llama.cpp in process, named so.

`routes` starts them (each skipped with the reason where absent, never faked) and `replay`
sends the first calls of the agentic session (`measure.workloads.agentic_workload`) to one,
every call however slow the route, so that routes are compared on the same calls. Notebook
21's capstone (`lessons.capstone`) compares and faults them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd

from infercourse.core.errors import InferCourseError
from infercourse.measure import bench
from infercourse.measure.workloads import Workload, agentic_workload

__all__ = ["Route", "routes", "session_calls", "replay", "REPLAY_GUARD_S"]


@dataclass
class Route:
    """One way to serve the model: an engine (and the server behind it, if any)."""

    key: str
    name: str
    engine: Any = None
    server: Any = None
    skipped: str | None = None

    @property
    def url(self) -> str | None:
        return getattr(self.server, "url", None)


def routes(stack: contextlib.ExitStack, *, threads: int = 1, ctx_size: int = 4096,
           ollama_model: str | None = None, mlx_model: str | None = None, vllm: bool = False,
           route_d: str = "auto", status: dict | None = None) -> list[Route]:
    """Every route of the guide, started where possible (servers stopped with `stack`); each
    route's name says exactly what runs, and a skipped one says why.

    Args:
        stack: an ExitStack the caller closes (servers stop with it).
        threads: CPU threads per runtime.
        ctx_size: llama-server context (one slot).
        ollama_model: an Ollama model name for route A (None: a model created from the
            course's GGUF, the same weights as C and D).
        mlx_model: an MLX model folder (route B's mlx_lm.server; None: skipped unless `vllm`).
        vllm: route B is vLLM's CPU build on the embedded weights (float32), where its
            environment exists (minutes to start).
        route_d: "auto" (MLX-LM in process where MLX imports, else llama.cpp in process),
            "mlx" or "llama.cpp".
        status: `doctor.engine_status()` (None: asked now).
    """
    from infercourse.ops.doctor import engine_status
    st, out = status or engine_status(), []
    if route_d not in ("auto", "mlx", "llama.cpp"):
        raise ValueError(f"route_d must be 'auto', 'mlx' or 'llama.cpp', got {route_d!r}")
    if not st["ollama"]["usable"]:
        out.append(Route("A", "Ollama", skipped=st["ollama"]["why"]))
    else:
        from infercourse.engines.ollama import OllamaEngine
        if ollama_model:
            out.append(Route("A", f"Ollama ({ollama_model}: its own file, not the course's)",
                             OllamaEngine(ollama_model)))
        else:
            try:
                eng = OllamaEngine.from_gguf()
                out.append(Route("A", f"Ollama ({eng.model}, created from the course's GGUF)", eng))
            except InferCourseError as e:   # the server refused the file: the row says so
                out.append(Route("A", "Ollama (the course's GGUF)", skipped=str(e)))
    if vllm:
        if not st["vllm"]["usable"]:
            out.append(Route("B", "vLLM CPU (OpenAI server)", skipped=st["vllm"]["why"]))
        else:
            from infercourse.models.formats import hf_folder
            from infercourse.servers import VLLMServer
            srv = stack.enter_context(VLLMServer(hf_folder(), max_model_len=ctx_size))
            out.append(Route("B", "vLLM CPU (OpenAI server, float32 weights)", srv.engine(timeout=60), srv))
    elif not st["mlx"]["usable"] or not mlx_model:
        out.append(Route("B", "mlx_lm.server", skipped=st["mlx"]["why"] if not st["mlx"]["usable"]
                         else "set MLX_MODEL to an MLX model folder (or VLLM = True where vLLM is installed)"))
    else:
        from infercourse.servers.mlx import MLXServer
        srv = stack.enter_context(MLXServer(mlx_model))
        out.append(Route("B", "mlx_lm.server", srv.engine(timeout=60), srv))
    try:
        from infercourse.ops.faults import small_server
        srv = stack.enter_context(small_server(threads=threads, n_parallel=1, ctx_size=ctx_size))
        out.append(Route("C", "llama-server", srv.engine(timeout=60), srv))
    except InferCourseError as e:
        out.append(Route("C", "llama-server", skipped=str(e)))
    out.append(_route_d(route_d, st["mlx"], threads=threads, ctx_size=ctx_size))
    return out


def _on_metal() -> bool:
    """Whether MLX runs on an Apple GPU here (its CPU build on Linux decodes the embedded model at
    ~75 s a call on 2 cores: a route that turns a workshop notebook into a quarter of an hour)."""
    try:
        import mlx.core as mx
        return bool(mx.metal.is_available())
    except Exception:  # noqa: BLE001 - no MLX, or a build without the metal module: not on Metal
        return False


def _route_d(choice: str, mlx: dict[str, Any], *, threads: int, ctx_size: int) -> Route:
    """Route D, named after what runs: MLX-LM in process (the guide's D) where MLX runs on Metal
    ("auto"), or wherever it imports ("mlx"); else llama.cpp in process, saying why."""
    if choice == "mlx" and not mlx["usable"]:
        return Route("D", "MLX-LM in process", skipped=mlx["why"])
    if choice == "mlx" or (choice == "auto" and mlx["usable"] and _on_metal()):
        from infercourse.engines.mlx_engine import MLXEngine
        from infercourse.models.formats import mlx_folder
        return Route("D", "MLX-LM in process (embedded weights as MLX)", MLXEngine(mlx_folder()))
    from infercourse.engines.llamacpp import LlamaCppEngine
    why = "" if choice == "llama.cpp" else (
        f"; not MLX-LM, the guide's D: {mlx['why']}" if not mlx["usable"] else
        "; not MLX-LM, the guide's D: MLX runs here on its CPU build only, ~75 s a call on 2 cores "
        "(ROUTE_D = \"mlx\" runs it anyway)")
    return Route("D", f"llama.cpp in process (llama-cpp-python{why})",
                 LlamaCppEngine(n_ctx=ctx_size, n_threads=threads))


def session_calls(n_calls: int, max_tokens: int) -> Workload:
    """The first `n_calls` calls of the agentic session, each capped at `max_tokens` new tokens."""
    w = agentic_workload()
    reqs = tuple(replace(r, max_tokens=min(r.max_tokens, max_tokens)) for r in w.requests[:n_calls])
    return Workload(f"{w.name}-first{n_calls}", reqs)


# a guard against a hung route, not a budget: every route sends all its calls, so the routes are
# compared on the same calls (a 30-s budget let MLX on a 2-core CPU, ~75 s a call, send one of three)
REPLAY_GUARD_S = 1800


def replay(route: Route, n_calls: int, max_tokens: int, out_dir: str | Path, engine=None) -> pd.DataFrame:
    """The first `n_calls` calls of the agentic session, one after another: one row per call.
    Every call is sent however slow the route (`REPLAY_GUARD_S` only stops a hung one)."""
    r = bench.run(engine or route.engine, session_calls(n_calls, max_tokens), warmup=0, progress=False,
                  max_duration_s=REPLAY_GUARD_S, out_dir=Path(out_dir) / route.key, label=f"route {route.key}")
    return r.df.assign(route=route.key)

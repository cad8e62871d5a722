"""The layers of the stack, and the same request sent through each of them.

user → agent → API → inference server → engine (scheduling, batching, caches) → runtime
(llama.cpp, MLX-LM, transformers) → compute backend (CPU/CUDA/Metal) → hardware → model.

`TOOLS` says which layers each well-known tool covers. `first_answers` streams one answer
from every engine usable here (and says why not for the rest); `through_layers` sends one
greedy request to the runtime in process and then to llama.cpp's HTTP server, so the
learner sees what the server and API layers add to time-to-first-token.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import pandas as pd

from infercourse.core.types import Request, generate
from infercourse.core.trace import record

__all__ = ["LAYERS", "TOOLS", "tools_frame", "first_answers", "through_layers"]

LAYERS = ["API", "server", "engine", "runtime", "backend", "model manager"]

# Which layers each tool covers (from each project's own documentation), the backends it
# runs on, and which infercourse engine / doctor check exercises it here.
TOOLS: dict[str, dict[str, Any]] = {
    "transformers": {"layers": ["runtime"], "backends": "CPU, CUDA, MPS", "check": "transformers"},
    "llama.cpp (in process)": {"layers": ["runtime", "backend"], "backends": "CPU, CUDA, Metal, Vulkan", "check": "llamacpp"},
    "llama-server": {"layers": ["API", "server", "engine", "runtime", "backend"], "backends": "CPU, CUDA, Metal", "check": "llama-server"},
    "MLX": {"layers": ["backend"], "backends": "Metal, CPU", "check": "mlx"},
    "MLX-LM": {"layers": ["runtime"], "backends": "Metal, CPU", "check": "mlx"},
    "mlx_lm.server": {"layers": ["API", "server", "engine"], "backends": "Metal, CPU", "check": "mlx"},
    "oMLX": {"layers": ["API", "server", "engine", "model manager"], "backends": "Metal", "check": None},
    "Ollama": {"layers": ["API", "server", "engine", "model manager"], "backends": "CPU, CUDA, Metal", "check": "ollama"},
    "vLLM": {"layers": ["API", "server", "engine", "runtime"], "backends": "CUDA, ROCm, CPU", "check": "vllm"},
    "SGLang": {"layers": ["API", "server", "engine", "runtime"], "backends": "CUDA, ROCm", "check": None},
    "TGI": {"layers": ["API", "server", "engine"], "backends": "CUDA, ROCm, Gaudi", "check": None},
}


def tools_frame(status: dict[str, dict[str, Any]] | None = None) -> pd.DataFrame:
    """A tools × layers table (✓ where the tool covers the layer), with whether it is
    usable on this machine (from `doctor.engine_status()`)."""
    if status is None:
        from infercourse.ops.doctor import engine_status
        status = engine_status()
    rows = []
    for tool, info in TOOLS.items():
        row = {layer: ("✓" if layer in info["layers"] else "") for layer in LAYERS}
        chk = status.get(info["check"]) if info["check"] else None
        row["backends"] = info["backends"]
        row["here"] = "yes" if chk and chk["usable"] else "no"
        row["why / what"] = chk["why"] if chk else "not installable here (needs its own platform)"
        rows.append({"tool": tool, **row})
    return pd.DataFrame(rows).set_index("tool")


def _timed(engine, request: Request) -> dict[str, Any]:
    from infercourse.core import metrics
    tr = record(engine, request, raise_errors=True)
    return {"text": tr.text, "prompt_tokens": tr.prompt_tokens,
            "completion_tokens": tr.completion_tokens, "ttft_s": metrics.ttft_s(tr),
            "prefill_tok_per_s": metrics.prefill_tok_per_s(tr),
            "decode_tok_per_s": metrics.decode_tok_per_s(tr), "e2e_s": metrics.e2e_s(tr),
            "token_source": tr.token_source}


def first_answers(factories: dict[str, Callable[[], Any]], prompt: str, *,
                  max_tokens: int = 32) -> pd.DataFrame:
    """Stream one greedy answer from each engine; an engine that cannot start gets a row
    with its error (which names the layer) instead of an exception.

    Args:
        factories: {label: zero-argument function that builds the engine}.
        prompt: the user message sent to every engine.
        max_tokens: cap on generated tokens.
    """
    rows = []
    for label, make in factories.items():
        try:
            with contextlib.ExitStack() as stack:
                engine = make()
                if hasattr(engine, "__exit__"):  # a server that must be torn down
                    engine = stack.enter_context(engine).engine()
                row = {"engine": label, "ok": True, "why": "",
                       **_timed(engine, Request(messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens))}
        except Exception as e:  # the row records why; the next engine still runs
            row = {"engine": label, "ok": False, "why": f"{type(e).__name__}: {e}"}
        rows.append(row)
    return pd.DataFrame(rows).set_index("engine")


def through_layers(prompt: str, *, max_tokens: int = 32, repeats: int = 3, n_threads: int = 1,
                   model=None) -> pd.DataFrame:
    """The same greedy request through llama.cpp in process, then through llama-server
    (HTTP + JSON + SSE + the server's scheduler) on the same model, threads and flags.
    Prefix caching is off so every request pays the full prompt. One row per request.
    """
    from infercourse.engines.llamacpp import LlamaCppEngine
    from infercourse.servers import LlamaServer
    req = Request(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                  cache_prompt=False)
    rows = []
    runtime = LlamaCppEngine(model, n_threads=n_threads, n_ctx=2048)
    _timed(runtime, req)  # warm-up: first call pays page-in of the weights
    rows += [{"layer": "runtime (llama.cpp in process)", **_timed(runtime, req)} for _ in range(repeats)]
    del runtime
    with LlamaServer(model, n_parallel=1, ctx_size=2048, threads=n_threads) as server:
        http = server.engine()
        _timed(http, req)
        rows += [{"layer": "server + API (llama-server over HTTP)", **_timed(http, req)}
                 for _ in range(repeats)]
    return pd.DataFrame(rows)


def engine_factories(names: list[str], *, model=None, n_threads: int = 1,
                     ollama_model: str = "smollm2:135m") -> dict[str, Callable[[], Any]]:
    """Zero-argument builders for the named engines, all on the same model where the
    engine can take it ("llama-server" yields a server to start; "ollama" needs a running
    Ollama with `ollama_model` pulled)."""
    from infercourse.engines import make_engine

    def server():
        from infercourse.servers import LlamaServer
        return LlamaServer(model, n_parallel=1, ctx_size=2048, threads=n_threads)

    builders = {
        "llamacpp": lambda: make_engine("llamacpp", model=model, n_threads=n_threads),
        "transformers": lambda: make_engine("transformers", model=model, n_threads=n_threads),
        "mlx": lambda: make_engine("mlx", model=None if model is None else model),
        "llama-server": server,
        "ollama": lambda: make_engine("ollama", model=ollama_model),
    }
    unknown = set(names) - set(builders)
    if unknown:
        raise ValueError(f"unknown engine(s) {sorted(unknown)}; choose from {sorted(builders)}")
    return {n: builders[n] for n in names}


def explain_first_answers(answers: pd.DataFrame, ceiling_tok_per_s: float) -> str:
    """Sentences computed from the measured table (so no number in the prose is typed in)."""
    ok = answers[answers["ok"]]
    if ok.empty:
        return "No engine could run here: see the `why` column."
    best, worst = ok["decode_tok_per_s"].idxmax(), ok["decode_tok_per_s"].idxmin()
    lines = [f"- Fastest decode: **{best}** at {ok.loc[best, 'decode_tok_per_s']:.1f} tok/s, "
             f"{100 * ok.loc[best, 'decode_tok_per_s'] / ceiling_tok_per_s:.0f}% of the "
             f"{ceiling_tok_per_s:.0f} tok/s bandwidth ceiling.",
             f"- Slowest: **{worst}** at {ok.loc[worst, 'decode_tok_per_s']:.1f} tok/s "
             f"({ok.loc[best, 'decode_tok_per_s'] / ok.loc[worst, 'decode_tok_per_s']:.1f}× slower)."]
    for name, row in answers[~answers["ok"]].iterrows():
        lines.append(f"- **{name}** did not run: {row['why'][:200]}")
    return "\n".join(lines)


def chat_template_view(engine, prompt: str, *, max_tokens: int = 24) -> dict[str, Any]:
    """What the API layer adds before the runtime sees anything: the chat template.

    Returns the templated text, token counts with and without it, and the greedy answers
    to the raw prompt and to the templated one (an instruct model fed raw text often
    stops at once or rambles: the template is part of the model's contract).
    """
    chat = Request(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                   cache_prompt=False)
    raw = Request(prompt=prompt, max_tokens=max_tokens, cache_prompt=False)
    raw_c, chat_c = generate(engine, raw), generate(engine, chat)
    return {"templated_text": engine.format_prompt(chat),
            "raw_tokens": raw_c.usage.prompt_tokens, "chat_tokens": chat_c.usage.prompt_tokens,
            "raw_answer": raw_c.text, "raw_finish": raw_c.finish_reason,
            "raw_completion_tokens": raw_c.usage.completion_tokens,
            "chat_answer": chat_c.text, "chat_completion_tokens": chat_c.usage.completion_tokens}


def layer_overheads(df: pd.DataFrame) -> pd.DataFrame:
    """Median TTFT / decode speed / E2E per layer, and what each adds over the runtime."""
    med = df.groupby("layer", sort=False)[["ttft_s", "decode_tok_per_s", "e2e_s"]].median()
    med["ttft_added_ms"] = 1000 * (med["ttft_s"] - med["ttft_s"].iloc[0])
    return med


def explain_layers(df: pd.DataFrame) -> str:
    """The Explain sentence for `through_layers`, computed: what the server and API layers
    added to median TTFT, compared with the runtime's own run-to-run spread (so a
    difference smaller than the noise is called that, not a speed-up or a cost)."""
    med = layer_overheads(df)
    runtime, served = med.index[0], med.index[-1]
    added_ms = float(med.loc[served, "ttft_added_ms"])
    base = df[df["layer"] == runtime]["ttft_s"]
    spread_ms = 1000 * float(base.max() - base.min())
    verdict = (f"adds **{added_ms:.1f} ms**" if abs(added_ms) > spread_ms else
               f"adds no cost we can separate from noise here ({added_ms:+.1f} ms, while the "
               f"runtime's own TTFT varied by {spread_ms:.1f} ms between repeats)")
    return (f"Going through the server and API {verdict} to the median time to first token "
            f"(runtime alone: {1000 * med.loc[runtime, 'ttft_s']:.0f} ms). Decode speed: "
            f"{med.loc[runtime, 'decode_tok_per_s']:.0f} tok/s in process vs "
            f"{med.loc[served, 'decode_tok_per_s']:.0f} tok/s through the server.")

"""The layers of the stack, and the same request sent through each of them.

user → agent → API → inference server → engine (scheduling, batching, caches) → runtime
(llama.cpp, MLX-LM, transformers) → compute backend (CPU/CUDA/Metal) → hardware → model.

`TOOLS` says which layers each well-known tool covers, and `draw_stack` draws the layers
with the notebooks that measure each. `first_answers` streams one answer from every engine
usable here, after a warm-up request each (and says why not for the rest): one run per
engine, an inventory, not a ranking; `explain_first_answers` says so. What the server and
API layers add, measured with repeats and an A/A rerun, is `lessons.plumbing` (notebook 01).

`weights_read` says how many bytes of weights each engine streams per decoded token (the
same model is 4-bit in llama.cpp but float32 in transformers), so every engine gets its
own bandwidth ceiling. `timed_answer` times one llama.cpp request with one setting changed
(threads, prompt or answer length, a system message), for the exercises that predict
before they measure.
"""
from __future__ import annotations

import contextlib
import json
import sys
from typing import Any, Callable

import pandas as pd

from infercourse.core.types import Request
from infercourse.core.trace import record

__all__ = ["LAYERS", "TOOLS", "STACK", "WALK", "tools_frame", "first_answers", "engine_factories",
           "explain_first_answers", "weights_read", "draw_stack", "plot_engine_speeds", "timed_answer"]

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
    "Ollama": {"layers": ["API", "server", "engine", "runtime", "backend", "model manager"],
               "backends": "CPU, CUDA, Metal (llama.cpp's ggml inside)", "check": "ollama"},
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


def weights_read(engine, model_path: Any = None) -> tuple[float | None, str]:
    """Bytes of weights one decode step of `engine` streams from memory, and their format.

    A torch model is measured in memory (what transformers really holds: float32 here,
    tied embeddings counted once); otherwise the card of the model file the engine loaded
    (`model_path`, or the engine's own `describe()["model"]`). (None, why) when unknown,
    e.g. a model behind Ollama's API.
    """
    model, torch = getattr(engine, "model", None), sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        params = list(model.parameters())
        return float(sum(p.numel() * p.element_size() for p in params)), f"torch {params[0].dtype}".replace("torch.", "")
    from infercourse.models.modelcard import model_card
    try:
        card = model_card(model_path or engine.describe()["model"])
    except Exception as e:  # a served name, no file here: no ceiling rather than a wrong one
        return None, f"unknown ({type(e).__name__})"
    return float(card.weight_bytes()), card.quantization


def first_answers(factories: dict[str, Callable[[], Any]], prompt: str, *,
                  max_tokens: int = 32, bandwidth_gbs: float | None = None) -> pd.DataFrame:
    """Stream one greedy answer from each engine, after a one-token warm-up request (the
    first call of an engine pays its page-in and set-up; llama-server warms itself up at
    start, llama.cpp in process does not); an engine that cannot start gets a row with its
    error (which names the layer) instead of an exception. One timed answer per engine.

    Args:
        factories: {label: zero-argument function that builds the engine}.
        prompt: the user message sent to every engine.
        max_tokens: cap on generated tokens.
        bandwidth_gbs: measured bandwidth; each row then gets its own decode ceiling,
            bandwidth / the bytes *that engine* reads per token (`weights_read`).
    """
    rows = []
    for label, make in factories.items():
        try:
            with contextlib.ExitStack() as stack:
                engine, path = make(), None
                if hasattr(engine, "__exit__"):  # a server that must be torn down
                    path = getattr(engine, "model_path", None)
                    engine = stack.enter_context(engine).engine()
                msgs = [{"role": "user", "content": prompt}]
                _timed(engine, Request(messages=msgs, max_tokens=1))   # warm-up, not timed
                row = {"engine": label, "ok": True, "why": "", **_timed(engine, Request(messages=msgs,
                                                                                       max_tokens=max_tokens))}
                nbytes, fmt = weights_read(engine, path)
                row.update(weights=fmt, weight_mb=nbytes / 1e6 if nbytes else float("nan"))
        except Exception as e:  # the row records why; the next engine still runs
            row = {"engine": label, "ok": False, "why": f"{type(e).__name__}: {e}"}
        rows.append(row)
    df = pd.DataFrame(rows).set_index("engine")
    if bandwidth_gbs and "weight_mb" in df:
        df["ceiling_tok_per_s"] = bandwidth_gbs * 1e3 / df["weight_mb"]
        df["pct_of_ceiling"] = 100 * df["decode_tok_per_s"] / df["ceiling_tok_per_s"]
    return df


def timed_answer(prompt: str | None = None, *, n_prompt_tokens: int | None = None,
                 system: str | None = None, model=None, n_threads: int = 1, max_tokens: int = 32,
                 repeats: int = 3) -> dict[str, float]:
    """One greedy request to llama.cpp in process, timed `repeats` times after a warm-up:
    the median `ttft_s`, `decode_tok_per_s`, `e2e_s`, `prompt_tokens` and `completion_tokens`.

    The answer is forced to `max_tokens` (ignore_eos) and the prefix cache is off, so every
    repeat pays the whole prompt and generates the same number of tokens: the exercises'
    one changed setting (threads, answer length, prompt length, a system message) is the
    only difference from the notebook's own measurement.

    Args:
        prompt: the user message, chat template applied (as in `first_answers`).
        n_prompt_tokens: instead of `prompt`, a raw prompt (no template) of exactly this
            many tokens (`workloads.exact_length_prompt`).
        system: a system message sent before `prompt` (a template with a default system
            prompt, like SmolLM2's, then leaves its own out).
        model: None for the embedded GGUF, or a .gguf path.
        n_threads: CPU threads of the engine.
        max_tokens: tokens generated per request (forced).
        repeats: timed requests after the warm-up.
    """
    from infercourse.engines.llamacpp import LlamaCppEngine
    from infercourse.measure.workloads import exact_length_prompt
    if (prompt is None) == (n_prompt_tokens is None):
        raise ValueError("give either prompt or n_prompt_tokens")
    engine = LlamaCppEngine(model, n_threads=n_threads, n_ctx=max(2048, (n_prompt_tokens or 0) + max_tokens + 8))
    opts = dict(max_tokens=max_tokens, ignore_eos=True, cache_prompt=False)
    if n_prompt_tokens is not None:
        req = Request(prompt=exact_length_prompt(n_prompt_tokens, engine.tokenize), **opts)
    else:
        msgs = [{"role": "system", "content": system}] if system else []
        req = Request(messages=msgs + [{"role": "user", "content": prompt}], **opts)
    _timed(engine, req)  # warm-up: the first call pays page-in of the weights
    rows = pd.DataFrame([_timed(engine, req) for _ in range(repeats)])
    cols = ["ttft_s", "decode_tok_per_s", "e2e_s", "prompt_tokens", "completion_tokens"]
    return {c: float(pd.to_numeric(rows[c], errors="coerce").median()) for c in cols}


def engine_factories(names: list[str], *, model=None, n_threads: int = 1,
                     ollama_model: str = "smollm2:135m") -> dict[str, Callable[[], Any]]:
    """Zero-argument builders for the named engines, all on the same model where the
    engine can take it ("llama-server" yields a server to start; "ollama" needs a running
    Ollama with `ollama_model` pulled)."""
    from infercourse.engines import make_engine

    def server():
        from infercourse.servers import LlamaServer
        return LlamaServer(model, n_parallel=1, ctx_size=2048, threads=n_threads)

    def transformers():
        from infercourse.models.quiet import quiet
        quiet()   # its "Loading weights" bar would sit frozen at 0/272 in an executed notebook
        return make_engine("transformers", model=model, n_threads=n_threads)

    builders = {
        "llamacpp": lambda: make_engine("llamacpp", model=model, n_threads=n_threads),
        "transformers": transformers,
        "mlx": lambda: make_engine("mlx", model=None if model is None else model),
        "llama-server": server,
        "ollama": lambda: make_engine("ollama", model=ollama_model),
    }
    unknown = set(names) - set(builders)
    if unknown:
        raise ValueError(f"unknown engine(s) {sorted(unknown)}; choose from {sorted(builders)}")
    return {n: builders[n] for n in names}


def explain_first_answers(answers: pd.DataFrame, same_runtime: tuple[str, str] = ("llamacpp", "llama-server")) -> str:
    """Sentences computed from the measured table (so no number in the prose is typed in):
    the highest and lowest decode rate of this run, each against its own ceiling
    (`first_answers(bandwidth_gbs=)`), said as one run per engine: an inventory, never a
    ranking; and, where both ran, the two engines around the same runtime side by side.

    Args:
        answers: `first_answers` output.
        same_runtime: two engines running the same runtime code (their gap is the layers
            around it plus noise, which one run cannot separate).
    """
    ok = answers[answers["ok"]]
    if ok.empty:
        return "No engine could run here: see the `why` column."

    def vs_ceiling(name):
        row = ok.loc[name]
        if "ceiling_tok_per_s" not in ok or not row["ceiling_tok_per_s"] > 0:
            return "its bytes per token are unknown here, so no ceiling"
        return (f"{row['pct_of_ceiling']:.0f}% of its own {row['ceiling_tok_per_s']:.0f} tok/s ceiling "
                f"({row['weight_mb']:.0f} MB of {row['weights']} weights per token)")
    rate = ok["decode_tok_per_s"]
    hi, lo = rate.idxmax(), rate.idxmin()
    lines = [f"- Highest decode rate of this run: **{hi}** at {rate[hi]:.1f} tok/s, {vs_ceiling(hi)}."]
    if lo != hi:
        lines.append(f"- Lowest: **{lo}** at {rate[lo]:.1f} tok/s ({rate[hi] / rate[lo]:.1f}× below), {vs_ceiling(lo)}.")
    lines.append(f"- One timed answer per engine ({len(ok)} engines), after a warm-up each: an inventory, not a "
                 "ranking; a gap between two engines that read the same bytes is as likely noise as a cost.")
    a, b = same_runtime
    if a in ok.index and b in ok.index:
        lines.append(f"- {a} and {b} run the same llama.cpp code on the same file: {rate[a]:.1f} vs {rate[b]:.1f} "
                     f"tok/s decode, {1e3 * ok.loc[a, 'ttft_s']:.1f} vs {1e3 * ok.loc[b, 'ttft_s']:.1f} ms TTFT here. "
                     "One run each cannot tell what the layers around the runtime add from noise; notebook 01 "
                     "measures it with repeats against an A/A rerun.")
    for name, row in answers[~answers["ok"]].iterrows():
        lines.append(f"- **{name}** did not run: {row['why'][:200]}")
    return "\n".join(lines)


# Which notebooks measure each layer (top to bottom), and the tools that fill the layer; WALK
# walks every layer (troubleshooting). Together they name every notebook of notebooks/README.md.
STACK: list[tuple[str, str, tuple[str, ...]]] = [
    ("user", "a person or a program waiting for text", ("10",)),
    ("agent", "a loop of model calls + tools; re-sends the context", ("02", "16", "19", "20")),
    ("API", "chat template, JSON over HTTP, SSE streaming", ("01", "10", "19", "20")),
    ("inference server", "slots, queue, /metrics (llama-server, vLLM, Ollama)", ("01", "05", "11", "15", "16")),
    ("engine", "scheduling, batching, KV + prefix caches, speculation", ("04", "05", "08", "09", "11", "14")),
    ("runtime", "runs the model's ops: llama.cpp, MLX-LM, transformers", ("00", "03", "13")),
    ("compute backend", "kernels: CPU SIMD, CUDA, Metal; quantized math", ("03", "06", "07")),
    ("hardware", "memory bandwidth, FLOP/s, RAM: ceilings and limits", ("00", "03", "12")),
    ("model", "weights and architecture: params, layers, KV heads", ("00", "04", "06", "07", "09")),
]
WALK = ("17", "18", "21")


def draw_stack(path: Any = None, *, ax=None):
    """Draw the stack as boxes, top (user) to bottom (model), each with the notebooks that
    measure it, and the troubleshooting notebooks (`WALK`) beside every layer; returns the
    Axes (and saves a PNG to `path` when given, its table in the PNG's metadata).

    Args:
        path: where to save the figure (None: don't save).
        ax: an Axes to draw on (None: a new figure).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch
    if ax is None:
        _, ax = plt.subplots(figsize=(13.5, 6.2))
    n, cmap = len(STACK), plt.get_cmap("viridis")

    def tag(x, y, h, nb):   # one notebook's white box
        ax.add_patch(FancyBboxPatch((x, y), 0.56, h, boxstyle="round,pad=0.03", fc="white", ec="0.3"))
        ax.text(x + 0.28, y + h / 2, nb, ha="center", va="center", fontsize=10)
    for i, (name, what, nbs) in enumerate(STACK):
        y = n - 1 - i
        ax.add_patch(FancyBboxPatch((0, y + 0.08), 9.4, 0.84, boxstyle="round,pad=0.02",
                                    fc=cmap(0.1 + 0.55 * i / n), ec="none"))
        ax.text(0.2, y + 0.5, name, va="center", fontsize=12, weight="bold", color="white")
        ax.text(3.2, y + 0.5, what, va="center", fontsize=10, color="white")
        for k, nb in enumerate(nbs):
            tag(9.7 + 0.68 * k, y + 0.22, 0.56, nb)
    right = 9.7 + 0.68 * max(len(nbs) for *_, nbs in STACK) + 0.3
    for k, nb in enumerate(WALK):   # every layer, top to bottom: the walk of notebook 17
        tag(right + 0.68 * k, 0.2, n - 0.4, nb)
    ax.text(right + 0.34 * len(WALK), n + 0.05, "every layer", ha="center", fontsize=10, color="0.3")
    ax.annotate("", xy=(-0.25, 0.2), xytext=(-0.25, n - 0.2), arrowprops=dict(arrowstyle="->", color="0.4", lw=1.5))
    ax.text(-0.45, n / 2, "a request goes down; tokens come back up", rotation=90,
            va="center", ha="center", fontsize=9, color="0.3")
    ax.text((9.7 + right) / 2, n + 0.05, "notebooks", ha="center", fontsize=10, color="0.3")
    ax.set(xlim=(-0.7, right + 0.68 * len(WALK) + 0.1), ylim=(-0.1, n + 0.45))
    ax.axis("off")
    ax.set_title("The LLM inference stack, and which notebook measures each layer", fontsize=12)
    if path is not None:   # the table travels in the PNG, so a test can tell a stale figure
        meta = {"Description": json.dumps({"stack": [[name, list(nbs)] for name, _, nbs in STACK], "walk": list(WALK)})}
        ax.figure.savefig(path, dpi=110, bbox_inches="tight", metadata=meta)
    return ax


def plot_engine_speeds(answers: pd.DataFrame, ax=None):
    """Decode tok/s per engine (bars) against each engine's own ceiling (black ticks)."""
    from infercourse.measure.plots import engine_speeds
    ax = engine_speeds(answers, ax=ax)
    ok = answers[answers["ok"]] if "ok" in answers else answers
    if "ceiling_tok_per_s" in ok:
        ax.scatter(ok["ceiling_tok_per_s"], list(map(str, ok.index)), marker="|", s=400, color="k",
                   label="its bandwidth ceiling (bytes it reads per token)", zorder=3)
        # outside the axes, so the legend never covers a bar
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return ax

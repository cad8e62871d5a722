"""A fair benchmark: one rule, every route on this machine, and a table that says what differed.

"Engine A is faster than engine B" is only true under stated conditions. The rule here:
the same weights, quantization, context, prompts (an agent workload), sampling, hardware,
load pattern and request count on every route, and every number (TTFT, prefill, decode,
memory, prefix-cache hits, error rate) computed the same way, by `bench` and
`core.metrics`, from the client's own clock. Where a condition *cannot* be made equal
(transformers has no Q4_1 kernels, so it runs the same weights in float32; MLX on a CPU
picks its own threads), the comparison must not hide it: `results.differing_conditions`
refuses the comparison unless that condition is explicitly allowed, and the table then
labels it beside the numbers.

A route is an engine plus whatever stands in front of it: llama.cpp in process,
llama-server, transformers, MLX in process, mlx_lm.server, vLLM's CPU build, Ollama.
Each route is built, warmed up with the same short request, measured and torn down in
turn (loaded once). A route that cannot run here still gets a row, saying why (from
`ops.doctor.engine_status`).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

import pandas as pd
import psutil

from infercourse.core import summary
from infercourse.core.trace import record
from infercourse.core.types import Request
from infercourse.measure import bench
from infercourse.measure.importers import load_vllm_bench
from infercourse.measure.results import Run, compare, differing_conditions, load_run, new_run_dir
from infercourse.measure.workloads import DATA_DIR, Workload, agentic_workload

__all__ = ["FAIR_KEYS", "LABELLED", "ROUTES", "PEER_FIXTURE", "WARMUP", "agent_calls", "route_status", "slow_routes",
           "open_route", "measure_routes", "fair_table", "engine_table", "plot_routes", "explain", "peer_run",
           "peer_beside_ours"]

# Manifest keys that must match for two runs' numbers to be compared (dotted, as
# `differing_conditions` flattens them). `fair.*` is what each route records below.
FAIR_KEYS = ("fair.weights", "fair.quantization", "fair.context_tokens", "fair.threads",
             "workload.sha256", "sampling", "load.pattern", "load.concurrency", "load.max_requests",
             "load.max_duration_s", "hardware")
# Conditions some runtimes cannot share: allowed to differ, but always shown.
LABELLED = ("fair.quantization", "fair.threads", "fair.context_tokens")

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

PEER_FIXTURE = DATA_DIR.parent / "tests" / "data" / "vllm_bench_serve_detailed.json"
# The same short, unrelated request warms every route up: pages weights in, builds kernels,
# and leaves no useful prefix in any cache for the measured calls.
WARMUP = Request(messages=[{"role": "user", "content": "Say hello."}], max_tokens=4)


def agent_calls(n_calls: int, max_tokens: int) -> Workload:
    """The first `n_calls` model calls of the recorded coding-agent session (each prompt
    extends the previous one, as an agent's does), every answer forced to `max_tokens`.

    Args:
        n_calls: calls replayed, back to back (no tool think-time: that is notebook 14's).
        max_tokens: forced output length, so decode is timed over the same token count.
    """
    wl = agentic_workload()
    reqs = tuple(Request(messages=r.messages, max_tokens=max_tokens, ignore_eos=True)
                 for r in wl.requests[:n_calls])
    return Workload(f"{wl.name}-first{n_calls}-max{max_tokens}", reqs, cache_workload=True)


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


def _row(name: str, run: Run, mem_bytes: float) -> dict[str, Any]:
    df = run.df
    ok = df[df["status"] == "ok"]
    s = summary.summarize(df, ("ttft_s", "prefill_tok_per_s", "decode_tok_per_s", "e2e_s"))
    p50 = lambda m: float(s.loc[m, "p50"]) if m in s.index and "p50" in s else float("nan")  # noqa: E731
    fair = run.manifest.get("fair", {})
    prompt = float(ok["prompt_tokens"].sum())
    return {"route": name, "ran": True, "why": "", "quantization": fair.get("quantization"),
            "threads": fair.get("threads"), "context": fair.get("context_tokens"),
            "requests": len(df), "prompt_tokens": prompt, "ttft_p50_s": p50("ttft_s"),
            "prefill_tok_per_s": p50("prefill_tok_per_s"), "decode_tok_per_s": p50("decode_tok_per_s"),
            "e2e_p50_s": p50("e2e_s"), "memory_mb": mem_bytes / 1e6,
            # NaN, not 0, when the route reports no cached count (vLLM without its usage detail)
            "cache_hit": float(ok["cached_tokens"].sum()) / prompt if prompt and ok["cached_tokens"].notna().any()
            else float("nan"),
            "error_rate": summary.error_rate(df)}


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


def measure_routes(names: list[str], workload: Workload, *, threads: int, ctx_size: int,
                   results_root: str | Path | None = None, status: dict | None = None,
                   skip: dict[str, str] | None = None) -> tuple[pd.DataFrame, dict[str, Run]]:
    """Every route in turn under the same conditions: warm-up, then the workload once,
    sequentially (in-process engines serve one request at a time, so servers do too).

    Returns (one row per route: conditions and measured numbers, or why it did not run;
    {route: Run} of those that ran, read back from disk with their manifests).

    Args:
        names: routes from `ROUTES`, in the order to run them.
        workload: the same requests for every route (e.g. `agent_calls(4, 16)`).
        threads, ctx_size: as `open_route`.
        results_root: parent folder for one run folder per route (None: bench's default).
        status: `doctor.engine_status()` (None: asked now).
        skip: {route: reason} not to run even if usable (e.g. `slow_routes()`).
    """
    here, skip = route_status(names, status), skip or {}
    rows, runs = [], {}
    for name in names:
        if not here.loc[name, "here"] or name in skip:
            why = here.loc[name, "why"] if not here.loc[name, "here"] else f"skipped: {skip[name]}"
            rows.append({"route": name, "ran": False, "why": why})
            continue
        try:
            with open_route(name, threads=threads, ctx_size=ctx_size) as (engine, fair, mem):
                record(engine, WARMUP, raise_errors=True)
                res = bench.run(engine, workload, pattern="sequential", warmup=0, label=name,
                                out_dir=new_run_dir(results_root, name.replace(" ", "_").replace("/", "_")),
                                progress=False, conditions={"fair": fair}, salt=False)  # same prompts everywhere
                mem_bytes = mem()
            runs[name] = load_run(res.dir)
            rows.append(_row(name, runs[name], mem_bytes))
        except Exception as e:  # noqa: BLE001 - the row records why; the next route still runs
            rows.append({"route": name, "ran": False, "why": f"{type(e).__name__}: {e}"[:300]})
    return pd.DataFrame(rows).set_index("route"), runs


def fair_table(runs: dict[str, Run], *, must_match=FAIR_KEYS, allow=LABELLED) -> pd.DataFrame:
    """`results.compare` of the runs, refused (UnfairComparisonError) if a `must_match`
    condition outside `allow` differs; each row labels how its conditions differ from
    the first run's (the reference).

    Args:
        runs: {label: Run}, the reference first.
        must_match, allow: as `results.differing_conditions`.
    """
    diff = differing_conditions(runs.values(), must_match=must_match, allow=allow)
    ref = next(iter(runs))
    table = compare(runs.values())
    labels = []
    for lab in table.index:
        d = [f"{k.split('.')[-1]}={diff.loc[k, lab]}" for k in diff.index
             if any(k == a or k.startswith(a + ".") for a in allow) and diff.loc[k, lab] != diff.loc[k, ref]]
        labels.append("; ".join(d) if d else "reference" if lab == ref else "same conditions")
    table.insert(0, f"differs from {ref}", labels)
    return table


def engine_table(measured: pd.DataFrame) -> pd.DataFrame:
    """The engine comparison table: positioning, API and deployment limits (from each
    project's documentation) beside what was measured here (or why it was not)."""
    static = pd.DataFrame.from_dict(ROUTES, orient="index").drop(columns="check")
    cols = ["quantization", "ttft_p50_s", "prefill_tok_per_s", "decode_tok_per_s", "memory_mb",
            "cache_hit", "error_rate", "why"]
    return static.join(measured.reindex(columns=cols), how="right")


def plot_routes(rows: pd.DataFrame, ceilings: dict[str, float], axes):
    """Left: TTFT p50 per route (s). Right: decode tok/s per route, with the bandwidth
    ceiling of each weight format (a dashed line per quantization) as the reference.

    Args:
        rows: `measure_routes` rows.
        ceilings: {quantization: decode ceiling tok/s}.
        axes: two matplotlib Axes.
    """
    ran = rows[rows["ran"]]
    axes[0].barh(list(ran.index), ran["ttft_p50_s"], color="tab:orange")
    axes[0].set(xlabel="TTFT p50 (s)", title="Time to first token (agent calls)")
    axes[1].barh(list(ran.index), ran["decode_tok_per_s"], color="tab:blue")
    for (quant, c), style in zip(ceilings.items(), ("--", ":", "-.")):
        axes[1].axvline(c, ls=style, color="tab:red", label=f"ceiling, {quant} weights: {c:.0f} tok/s")
    axes[1].set(xlabel="decode speed p50 (tok/s, log)", xscale="log", title="Decode speed vs bandwidth ceiling")
    axes[1].legend(loc="lower right", fontsize=8)
    return axes


def explain(rows: pd.DataFrame, runs: dict[str, Run], predicted_ratio: float,
            base: str = "llama.cpp in process", other: str = "transformers") -> str:
    """The Explain paragraph, computed from the measured rows and runs (no number typed in).
    The server's TTFT cost is a *paired* difference: the same call on both routes."""
    ran = rows[rows["ran"]]
    if ran.empty:
        return "No route could run here: see the `why` column."
    fast = ran["decode_tok_per_s"].idxmax()
    out = [f"- Fastest decode: **{fast}** at {ran.loc[fast, 'decode_tok_per_s']:.0f} tok/s "
           f"({ran.loc[fast, 'quantization']} weights)."]
    if {base, other} <= set(ran.index):
        r = ran.loc[base, "decode_tok_per_s"] / ran.loc[other, "decode_tok_per_s"]
        out.append(f"- {base} decodes {r:.1f}× faster than {other}; the bytes alone predicted "
                   f"{predicted_ratio:.1f}×. Part of that gap is *quantization*, not engine quality: "
                   f"the table labels it.")
    if {base, "llama-server"} <= set(runs):
        a, b = (runs[n].df.set_index("request_id")["ttft_s"] for n in (base, "llama-server"))
        d = 1e3 * (b - a).dropna()
        verdict = (f"adds {d.median():.0f} ms to TTFT (every call: {d.min():+.0f} to {d.max():+.0f} ms)"
                   if d.min() > 0 else
                   f"reaches the first token {-d.median():.0f} ms sooner than in process (every call: "
                   f"{d.min():+.0f} to {d.max():+.0f} ms): the library around a runtime costs time too"
                   if d.max() < 0 else
                   f"adds nothing we can separate from this machine's noise (per call: {d.min():+.0f} to "
                   f"{d.max():+.0f} ms)")
        out.append(f"- Same runtime behind HTTP, call by call: llama-server {verdict}.")
    hits = ", ".join(f"{n} {v:.0%}" for n, v in ran["cache_hit"].items())
    out.append(f"- Prompt tokens served from a prefix cache: {hits}.")
    out.append(f"- Memory: {', '.join(f'{n} {v:.0f} MB' for n, v in ran['memory_mb'].items())} "
               f"(in-process routes: growth of this Python process; servers: their own RSS).")
    for n, why in rows.loc[~rows["ran"], "why"].items():
        out.append(f"- **{n}** did not run: {str(why)[:160]}")
    return "\n".join(out)


def peer_run(path: str | Path = PEER_FIXTURE) -> Run:
    """A `vllm bench serve --save-detailed` result file as a `Run`: its requests on our
    columns (`importers.load_vllm_bench`) and a manifest built from only what the file
    records, so `differing_conditions` can say what it leaves out (the machine, the
    quantization, the exact prompts)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        head = json.loads(text)
    except json.JSONDecodeError:   # `--append-result`: one document per line; the first names the run
        head = json.loads(text.splitlines()[0])
    df = load_vllm_bench(path)
    manifest = {"label": f"vllm bench serve ({path.name})", "tool": "vllm bench serve",
                "fair": {"weights": head.get("model_id"), "tokenizer": head.get("tokenizer_id")},
                "load": {"pattern": "rate" if head.get("request_rate") not in (None, "inf") else "burst",
                         "concurrency": head.get("max_concurrency"), "max_requests": head.get("num_prompts")},
                "workload": {"input_lens": head.get("input_lens"), "output_lens": head.get("output_lens")}}
    return Run(path, manifest, df, [])


def peer_beside_ours(ours: Run, peer: Run) -> pd.DataFrame:
    """Ours and a peer tool's run on the same axes (one definition of each metric, from
    `core.metrics`), with every condition that differs listed, never silently merged."""
    diff = differing_conditions([ours, peer])
    table = compare([ours, peer], ("ttft_s", "ttft_from_send_s", "tpot_s", "e2e_s"))
    table.insert(0, "conditions that differ", len(diff))
    return table

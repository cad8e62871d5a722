"""Why a 30B-A3B model decodes like a 3B one, what it costs in memory, and what batching does.

A mixture-of-experts (MoE) layer keeps E expert FFNs and sends each token through k of them
(`models.moe` explains the block and how our MoE is upcycled from the embedded model). Three
files make the comparison, all Q4_1 and bit-identical outside the FFN:

- **dense**: the embedded model, quantized to Q4_1 by llama.cpp from its F16: reads all its bytes;
- **moe**: E experts, k used: holds shared + E × FFN bytes, reads shared + k × FFN per token;
- **wide**: a dense model with E× the FFN: holds what the MoE holds and reads all of it.

So memory follows the **total** bytes (moe ≈ wide) and single-stream decode the **active**
bytes (moe between dense and wide): decode tok/s ≤ bandwidth ÷ bytes read per token.

Batching changes that. One decode step of N sequences reads each expert that *any* of them
picked: under uniform, independent routing, E·(1 − (1 − k/E)^N) distinct experts per layer (k at
N = 1, nearly E at N = 8 for k/E = 1/4). So a batched MoE step reads more and more of its total
bytes, and the MoE's advantage over the wide model shrinks, *where the step is bound by bytes*.
Where it is bound by arithmetic (a CPU at larger N) the cost is per token-expert pair, k per
token whatever N is. `step_trials` measures decode steps at batch sizes 1…N with llama.cpp's
batched C API (`measure.batch_steps`: one `llama_decode` per step, N sequences), and
`observed_routing` reads what the router really picked, inside llama.cpp (its eval callback on the
`ffn_moe_argsort` tensors).

Definitions: step_s = the wall time of one `llama_decode` of N tokens (one per sequence), the
median over `n_steps` steps; per-sequence decode tok/s = 1 / step_s; aggregate = N / step_s.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from infercourse.measure.batch_steps import Stepper
from infercourse.models import moe as moe_models_
from infercourse.models.embedded import vocab_tokenizer

__all__ = ["moe_models", "size_table", "rss_fresh", "expected_experts", "step_trials", "observed_routing",
           "batch_table", "plot_steps", "AA"]

AA = " (A/A)"


def moe_models(n_expert: int = 8, n_used: int = 2, qtype: str = "Q4_1") -> dict[str, Path]:
    """{"dense", "moe", "wide"}: the three GGUFs, derived once (the quantizer's log goes to the
    native log file, not the notebook).

    Args:
        n_expert, n_used: E and k of the MoE (the wide model gets E× the FFN).
        qtype: the dense file's type (`models.moe.dense_gguf`).
    """
    from infercourse.ops.logs import native_log_path
    log = native_log_path()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as f, contextlib.redirect_stderr(f):
        return {"dense": moe_models_.dense_gguf(qtype), "moe": moe_models_.moe_gguf(n_expert, n_used, qtype),
                "wide": moe_models_.wide_gguf(n_expert, qtype)}


def size_table(paths: Mapping[str, Path], bandwidth_gbs: float | None = None, context: int = 0) -> pd.DataFrame:
    """Per model, before measuring: file bytes, total and active bytes and parameters
    (`models.moe.weight_split`), and with a bandwidth the two decode ceilings, bandwidth ÷
    total bytes and bandwidth ÷ active bytes (+ the KV cache of `context` tokens).

    Args:
        paths: {name: GGUF}, e.g. `moe_models()`.
        bandwidth_gbs: the bandwidth the decode threads can draw (one thread:
            `roofline.memory_bandwidth_gbs(threads=1)["read_gbs"]`).
        context: tokens already in the KV cache.
    """
    from infercourse.measure.roofline import decode_ceiling_tok_per_s
    rows = []
    for name, path in paths.items():
        row = {"model": name, **moe_models_.weight_split(path)}
        if bandwidth_gbs:
            for which in ("total", "active"):
                row[f"ceiling_{which}_tok_per_s"] = decode_ceiling_tok_per_s(
                    bandwidth_gbs, {**row, "weight_bytes": row[f"{which}_bytes"]}, context)
        rows.append(row)
    return pd.DataFrame(rows).set_index("model")


_CHILD = """
import json, sys, llama_cpp
from infercourse.measure.quant_speed import rss_now
a = json.loads(sys.stdin.read())
before = rss_now()
llm = llama_cpp.Llama(model_path=a["path"], n_ctx=256, n_threads=a["n_threads"], verbose=False)
loaded = rss_now()
llm.eval(llm.tokenize(b"One short forward pass, then a few tokens.", add_bos=True))
print(json.dumps({"load_bytes": loaded - before, "after_eval_bytes": rss_now() - before}))
"""


def rss_fresh(path: str | Path, n_threads: int = 1, timeout_s: float = 300) -> dict[str, int]:
    """Resident-memory growth of loading a GGUF in a new Python process (llama_cpp imported
    first), after the load and after one short prompt: {"load_bytes", "after_eval_bytes"}.
    llama.cpp maps the file and asks the kernel to read it all in (MAP_POPULATE on Linux,
    WILLNEED advice elsewhere), so the growth is about the file, every expert included,
    whatever the router later uses.

    Args:
        path: a GGUF; n_threads: llama.cpp threads; timeout_s: for the child.
    """
    import json
    import subprocess
    import sys

    from infercourse.core.errors import ModelLayerError
    p = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=timeout_s,
                       input=json.dumps({"path": str(path), "n_threads": n_threads}))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise ModelLayerError(f"loading {Path(path).name} in a fresh process failed (exit {p.returncode}): "
                              f"{p.stderr.strip()[-400:]}")
    return json.loads(lines[-1])


def expected_experts(n_expert: int, n_used: int, batch: int | np.ndarray) -> float | np.ndarray:
    """Distinct experts one layer reads in a step of `batch` tokens when each picks `n_used` of
    `n_expert` uniformly and independently: E·(1 − (1 − k/E)^N) (an expert is missed by one
    token with probability 1 − k/E, by all N with that to the N).

    Args:
        n_expert: E; n_used: k; batch: N (a number or an array).
    """
    return n_expert * (1 - (1 - n_used / n_expert) ** np.asarray(batch, float))


def _stepper(path: Path, n_seq: int, n_ctx_seq: int, **kw) -> Stepper:
    """A `measure.batch_steps.Stepper`, its load log sent to the native log file."""
    from infercourse.ops.logs import native_log_path
    log = native_log_path()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as f, contextlib.redirect_stderr(f):
        return Stepper(path, n_seq, n_ctx_seq, **kw)


def _prompts(path: Path, n: int, prompt_tokens: int) -> list[list[int]]:
    """`n` prompts of exactly `prompt_tokens` tokens with no shared prefix (seeds 0..n-1)."""
    from infercourse.measure.workloads import exact_length_prompt
    tok = vocab_tokenizer(path)
    return [tok(exact_length_prompt(prompt_tokens, tok, seed=i)) for i in range(n)]


def observed_routing(path: str | Path, batch_sizes: Sequence[int], *, prompt_tokens: int = 32, n_steps: int = 8,
                     n_threads: int = 1) -> pd.DataFrame:
    """What the router picked, read inside llama.cpp: max(batch_sizes) sequences decoded
    together for `n_steps` steps; for each batch size N, the distinct experts a layer read in
    a step of the first N sequences (mean over layers and steps), beside the uniform
    expectation. `attrs["expert_share"]`: each expert's share of all picks (1/E if even).

    Args:
        path: the MoE GGUF; batch_sizes: the N to report; prompt_tokens: per prompt.
        n_steps: decode steps observed; n_threads: llama.cpp threads.
    """
    split = moe_models_.weight_split(path)
    e, k = split["n_expert"], split["n_used"]
    n = max(batch_sizes)
    prompts = _prompts(Path(path), n, prompt_tokens)
    with _stepper(Path(path), n, prompt_tokens + n_steps + 8, n_threads=n_threads,
                  n_batch=max(512, n * prompt_tokens), observe="ffn_moe_argsort-") as st:
        st.prefill(dict(enumerate(prompts)))
        st.steps(list(range(n)), n_steps)
        # per step and layer, each sequence's E experts ranked by the router: the first k are its picks
        picks = np.array([[a.reshape(n, e)[:, :k] for _, a in step] for step in st.observed])  # step, layer, seq, k
    rows = []
    for b in batch_sizes:
        distinct = [len(np.unique(seqs[:b])) for by_layer in picks for seqs in by_layer]   # per step and layer
        rows.append({"batch": b, "experts_read": float(np.mean(distinct)),
                     "experts_read_uniform": float(expected_experts(e, k, b)), "n_expert": e, "n_used": k})
    df = pd.DataFrame(rows)
    df.attrs["expert_share"] = (np.bincount(picks.ravel(), minlength=e) / picks.size).tolist()
    return df


def step_trials(paths: Mapping[str, Path], batch_sizes: Sequence[int] = (1, 2, 4, 8), *, prompt_tokens: int = 32,
                n_steps: int = 12, repeats: int = 3, n_threads: int = 1, ref: str = "moe",
                only: Mapping[str, Sequence[int]] | None = None, results_root: str | Path | None = None,
                tables: Mapping[str, pd.DataFrame] | None = None) -> pd.DataFrame:
    """Decode steps of every model at every batch size, interleaved (`noise.run_interleaved`:
    block i holds one call of each arm, shuffled), `ref` at batch 1 run twice (an A/A arm).

    Each arm (model, N) owns N sequences, prefilled once (the warm-up call); each call then
    decodes `n_steps` more steps and returns its median step seconds, so block i of every arm
    runs at the same context length. Returns one row per (model, batch, block): `step_s`,
    `decode_tok_per_s` (per sequence), `agg_tok_per_s`; `attrs["values"]` is the Interleaved.

    Args:
        paths: {name: GGUF} (`moe_models()`); batch_sizes: N values.
        prompt_tokens, n_steps, repeats: per arm (repeats = blocks).
        n_threads: llama.cpp threads; ref: the model whose batch-1 arm gets an A/A rerun.
        only: {model: batch sizes} for models measured at fewer sizes (the wide model's steps
            cost ~5 dense ones: {"wide": (1,)} keeps the sweep within a notebook's time).
        results_root: folder for a run (manifest of conditions, steps.csv); None: not saved.
        tables: other tables of the same run to save there as <name>.csv (sizes, routing, rss).
    """
    from infercourse.measure import noise
    sizes_of = {m: list((only or {}).get(m, batch_sizes)) for m in paths}
    arms_of = {m: [(f"{m}@{b}", b) for b in sizes_of[m]] + ([(f"{m}@1{AA}", 1)] if m == ref else [])
               for m in paths}
    seqs, steppers, arms = {}, {}, {}
    try:
        for m, path in paths.items():
            total = sum(b for _, b in arms_of[m])
            prompts = _prompts(Path(path), max(sizes_of[m]), prompt_tokens)
            n_ctx_seq = prompt_tokens + (repeats + 2) * n_steps + 8
            st = steppers[m] = _stepper(Path(path), total, n_ctx_seq, n_threads=n_threads,
                                        n_batch=max(512, max(sizes_of[m]) * prompt_tokens))
            first = 0
            for label, b in arms_of[m]:
                seqs[label] = list(range(first, first + b))
                first += b
                arms[label] = _arm(st, seqs[label], prompts, n_steps)
        vals = noise.run_interleaved(arms, repeats, warmup=1)
    finally:
        for st in steppers.values():
            st.close()
    rows = [{"model": label.split("@")[0], "batch": int(label.split("@")[1].removesuffix(AA)), "arm": label,
             "block": i, "step_s": v} for label, vs in vals.items() for i, v in enumerate(vs)]
    df = pd.DataFrame(rows)
    df["decode_tok_per_s"] = 1 / df["step_s"]
    df["agg_tok_per_s"] = df["batch"] / df["step_s"]
    df.attrs.update(values=vals, ref=ref, aa=f"{ref}@1{AA}")
    if results_root is not None:
        _save(df, paths, dict(batch_sizes=sizes_of, prompt_tokens=prompt_tokens, n_steps=n_steps, repeats=repeats,
                              n_threads=n_threads, order=vals.order, seed=vals.seed), results_root, tables or {})
    return df


def _arm(st: Stepper, seqs: list[int], prompts: list[list[int]], n_steps: int):
    state = {"filled": False}

    def one() -> float:
        if not state["filled"]:     # the warm-up call: prefill this arm's sequences first
            st.prefill({s: prompts[j] for j, s in enumerate(seqs)})
            state["filled"] = True
        return float(np.median(st.steps(seqs, n_steps)))
    return one


def _save(df: pd.DataFrame, paths: Mapping[str, Path], conditions: dict, results_root: str | Path,
          tables: Mapping[str, pd.DataFrame]) -> None:
    from importlib.metadata import version

    from infercourse.measure.results import RunWriter
    from infercourse.models.embedded import file_sha256
    stamp = time.strftime("%Y%m%dT%H%M%S")
    manifest = {"engine": {"engine": "llama.cpp C API (llama_decode, batched)",
                           "llama_cpp_python": version("llama-cpp-python"), "n_threads": conditions["n_threads"]},
                "model": {m: {"path": str(p), "sha256": file_sha256(p)} for m, p in paths.items()},
                "sampling": {"greedy": True, "forced_length": True},
                "load": {"pattern": "interleaved blocks, shuffled", **conditions},
                "workload": {"prompt_tokens": conditions["prompt_tokens"],
                             "prompts": "exact_length_prompt, seeds 0..N-1"}}
    with RunWriter(Path(results_root) / f"{stamp}_moe_steps", manifest) as w:
        df.to_csv(w.dir / "steps.csv", index=False)
        for name, table in tables.items():
            pd.DataFrame(table).to_csv(w.dir / f"{name}.csv")
    df.attrs["run_dir"] = str(w.dir)


def batch_table(trials: pd.DataFrame, sizes: pd.DataFrame, routing: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per batch size: the experts a step reads (observed if `routing` is given, else the
    uniform expectation), the median step of each model, aggregate tok/s, and the MoE's step
    over the dense one's, measured and as two models predict it: *bytes* (shared + distinct
    experts read, over the dense bytes) and *arithmetic* (active over dense parameters,
    whatever the batch).

    Args:
        trials: `step_trials` rows; sizes: `size_table`; routing: `observed_routing` (optional).
    """
    t = trials[~trials["arm"].str.endswith(AA)]
    med = t.groupby(["batch", "model"])["step_s"].median().unstack("model")
    moe, dense = sizes.loc["moe"], sizes.loc["dense"]
    e, k = int(moe["n_expert"]), int(moe["n_used"])
    out = pd.DataFrame(index=med.index)
    if routing is not None:
        out["experts_read"] = routing.set_index("batch")["experts_read"].reindex(med.index)
    else:
        out["experts_read"] = expected_experts(e, k, med.index.to_numpy())
    out["experts_read_uniform"] = expected_experts(e, k, med.index.to_numpy())
    per_expert = moe["expert_bytes"] / e
    out["moe_bytes_per_step"] = moe["shared_bytes"] + moe["router_bytes"] + out["experts_read"] * per_expert
    for m in med.columns:
        out[f"{m}_step_ms"] = 1e3 * med[m]
        out[f"{m}_agg_tok_per_s"] = med.index.to_numpy() / med[m]
    out["moe_over_dense"] = med["moe"] / med["dense"]
    out["bytes_model"] = out["moe_bytes_per_step"] / dense["total_bytes"]
    out["arithmetic_model"] = moe["active_params"] / dense["total_params"]
    return out


def plot_steps(table: pd.DataFrame, ax=None):
    """Median decode step (ms) of each model against the batch size, with the experts a MoE step
    read (observed, and uniform) on a second axis. Returns the Axes.

    Args:
        table: `batch_table`; ax: draw into this Axes (None: a new figure).
    """
    if ax is None:
        import matplotlib.pyplot as plt   # lazy: importing pyplot picks a backend
        _, ax = plt.subplots(figsize=(6.4, 4.0))
    x = table.index.to_numpy()
    for col in [c for c in table.columns if c.endswith("_step_ms")]:
        ax.plot(x, table[col], "o-", label=col.removesuffix("_step_ms") + " step")
    ax.set(xlabel="batch size (sequences per step)", ylabel="median decode step (ms)", xscale="log", xticks=x)
    ax.set_xticklabels([str(v) for v in x])
    ax2 = ax.twinx()
    ax2.plot(x, table["experts_read"], "k--", label="experts read per layer (observed)")
    ax2.plot(x, table["experts_read_uniform"], "k:", label="… uniform routing")
    ax2.set_ylabel("experts read per layer per step")
    lines = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
    ax.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], fontsize=8, loc="upper left")
    return ax

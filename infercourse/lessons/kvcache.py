"""The KV cache: what it saves (recomputation) and what it costs (memory per token).

A transformer turns every token into a key and a value vector in every layer; attention
for the next token needs the keys and values of *all* tokens before it. Without a cache
each decode step runs the whole sequence through the model again, so step i processes
prompt + i tokens and a whole generation does quadratic work. With a cache, each step runs
one new token and reads the stored keys and values: linear work, flat step time, paid for
in memory that grows by `2 x layers x kv_heads x head_dim x dtype bytes` per token.

The two decode loops below are hand-written on purpose, side by side, with `# NEW` on the
lines where the cached one differs (the shape rasbt's LLMs-from-scratch teaches the cache
in): transformers' `generate()` does the same thing under many more switches. They are
generators of token ids, so timing stays outside them (`core.trace.record_stream`, the
recorder bench uses), as for every engine.

The cache object is a `DynamicCache`, passed to the model as `cache=` in current
transformers and as `past_key_values=` in older releases and most tutorials
(`cache_keyword` picks the one the installed version takes).

`state_kv_bytes_per_token` measures what llama.cpp really stores: its state snapshot
(`llama_state_get_size`) serializes the KV cells in use, so its growth per evaluated token
is the engine's KV bytes per token. `kv_table` scales the formula to published models.
`loop_seconds` and `state_bytes` re-measure one loop or one state size with one setting
changed, for the exercises that predict a number first.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterable, Iterator
from infercourse import compat
from infercourse.models.modelcard import kv_bytes_per_token

__all__ = ["naive_decode", "cached_decode", "cache_keyword", "run_loops", "tokens_processed", "step_trend",
           "explain_loops", "loop_seconds", "state_bytes",
           "kv_bytes_per_token", "hf_cache_bytes", "state_kv_bytes_per_token", "PUBLISHED_CONFIGS", "kv_table", "DTYPE_BYTES"]


# -- the two decode loops (greedy), to read side by side -------------------------------------
def naive_decode(model, input_ids, n_new: int) -> Iterator[int]:
    """Greedy decoding with no cache: every step recomputes keys and values for the
    whole sequence so far.

    Args:
        model: a transformers causal LM (e.g. `TransformersEngine(...).model`).
        input_ids: prompt token ids, a (1, n) LongTensor.
        n_new: tokens to generate.
    """
    import torch
    ids = input_ids
    with torch.inference_mode():
        for _ in range(n_new):
            out = model(ids, use_cache=False, logits_to_keep=1)   # the whole sequence, again
            next_id = out.logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)                 # model sees it all next step
            yield int(next_id)


def cache_keyword(model) -> str:
    """The keyword a transformers model's `forward` takes its KV cache under: `cache` in
    current releases (5.24 here), `past_key_values` in older ones and in nearly every
    tutorial (kept as a deprecated alias until 5.40). Read from the signature, because
    an unknown keyword would be swallowed by `**kwargs` and the cache silently ignored."""
    import inspect
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cached_decode(model, input_ids, n_new: int) -> Iterator[int]:
    """Greedy decoding with a KV cache: the prompt is processed once (prefill), then each
    step feeds only the newest token and reuses the stored keys and values.

    Args:
        model: a transformers causal LM.
        input_ids: prompt token ids, a (1, n) LongTensor.
        n_new: tokens to generate.
    """
    import torch
    from transformers import DynamicCache
    ids = input_ids
    cache = DynamicCache()          # NEW: every layer's keys and values live here
    kw = cache_keyword(model)       # NEW: "cache" now; "past_key_values" in older releases
    with torch.inference_mode():
        for _ in range(n_new):
            out = model(ids, **{kw: cache}, use_cache=True,          # NEW: read + extend it
                        logits_to_keep=1)
            next_id = out.logits[:, -1].argmax(-1, keepdim=True)
            ids = next_id                                          # NEW: only the new token
            yield int(next_id)


def run_loops(model, input_ids, n_new: int, *, results_root: str | Path | None = None,
              conditions: dict | None = None):
    """Run both loops on the same prompt; one row per generated token and loop.

    Columns: loop, step (0 = the token the prefill produced), context_tokens (sequence
    length the step ran on), step_s (time since the previous token, or since the start),
    elapsed_s, token. `df.attrs["same_tokens"]` says whether both loops agreed. With
    `results_root`, both runs are saved as `RequestTrace`s through `results.RunWriter`.

    Args:
        model: a transformers causal LM.
        input_ids: prompt ids, (1, n) LongTensor.
        n_new: tokens per loop.
        results_root: folder for the saved run (None: not saved).
        conditions: extra manifest entries (engine, model, ...).
    """
    import pandas as pd
    from infercourse.core.trace import record_stream
    from infercourse.core.types import Event
    n_prompt, rows, traces = int(input_ids.shape[1]), [], []
    for i, (name, loop) in enumerate((("no cache", naive_decode), ("KV cache", cached_decode))):
        # each token is an event stamped on arrival; the same recorder bench uses times it
        events: list = []
        tr = record_stream((Event(t=time.perf_counter(), n_tokens=1, text=f"{tok} ")
                            for tok in loop(model, input_ids, n_new)), request_id=i, events=events, loop=name)
        t0, ts = tr.sent_t, tr.chunk_t
        for k, (tok, t) in enumerate(zip((int(e.text) for e in events), ts)):
            rows.append({"loop": name, "step": k, "context_tokens": n_prompt + k, "token": tok,
                         "step_s": t - (ts[k - 1] if k else t0), "elapsed_s": t - t0})
        traces.append(tr)
    df = pd.DataFrame(rows)
    a, b = (df[df["loop"] == n]["token"].tolist() for n in ("no cache", "KV cache"))
    df.attrs["same_tokens"] = a == b
    if results_root is not None:
        from infercourse.measure.results import RunWriter
        stamp = time.strftime("%Y%m%dT%H%M%S")
        with RunWriter(Path(results_root) / f"{stamp}_decode_loops",
                       {"workload": {"prompt_tokens": n_prompt, "n_new": n_new},
                        "sampling": {"temperature": 0.0}, "load": {"pattern": "sequential"},
                        "engine": {"engine": "kvcache.naive_decode / cached_decode"},
                        "model": getattr(model.config, "_name_or_path", None),
                        **(conditions or {})}) as w:
            for tr in traces:
                w.write(tr)
        df.attrs["run_dir"] = str(w.dir)
    return df


def tokens_processed(prompt_tokens: int, n_new: int, *, cached: bool) -> int:
    """Token positions run through the model to generate `n_new` tokens.

    Without a cache step i (0-based) runs prompt + i positions: the sum is
    n_new * prompt + n_new * (n_new - 1) / 2, quadratic in length. With a cache the prompt
    runs once and each later step runs one position: prompt + n_new - 1.
    """
    if prompt_tokens < 1 or n_new < 1:
        raise ValueError(f"need prompt_tokens >= 1 and n_new >= 1, got {prompt_tokens}, {n_new}")
    if cached:
        return prompt_tokens + n_new - 1
    return n_new * prompt_tokens + n_new * (n_new - 1) // 2


def step_trend(step_s) -> str:
    """"climbs", "falls", "flat" or "too few steps": the last quarter of a loop's decode
    steps against the first quarter (step 0, the prefill, left out). A trend is called only
    when the two quarters do not overlap at all (every late step slower than every early
    one, or the reverse); any overlap is "flat" within this run's step-to-step noise."""
    t = [float(v) for v in list(step_s)[1:]]
    q = len(t) // 4
    if q < 3:
        return "too few steps"
    first, last = t[:q], t[-q:]
    if min(last) > max(first):
        return "climbs"
    if max(last) < min(first):
        return "falls"
    return "flat"


def explain_loops(steps, work_ratio: float) -> str:
    """What the two decode loops showed, from `run_loops`' rows: how each loop's per-step
    time moved with the sequence (`step_trend`), and the time ratio against the work ratio
    (token positions, `tokens_processed`) the Predict step printed.

    Args:
        steps: `run_loops` output; work_ratio: naive positions ÷ cached positions.
    """
    totals = steps.groupby("loop")["elapsed_s"].max()
    time_ratio = float(totals["no cache"] / totals["KV cache"])
    said = {"climbs": "**climbed** with the sequence (every late step took longer than every early one)",
            "falls": "**fell** as the sequence grew (every late step was quicker than every early one)",
            "flat": "stayed **flat** within its step-to-step noise (early and late steps overlap)",
            "too few steps": "cannot be judged: too few steps for a trend"}
    trend = {n: step_trend(steps[steps["loop"] == n].sort_values("step")["step_s"]) for n in ("no cache", "KV cache")}
    out = (f"- After the prefill step, the naive loop's step time {said[trend['no cache']]}; the cached "
           f"loop's {said[trend['KV cache']]}.\n")
    if time_ratio < work_ratio:
        return out + (f"- Without the cache the generation took **{time_ratio:.1f}×** as long, *less* than the "
                      f"{work_ratio:.1f}× work ratio: a step costs a fixed part (reading every weight once) plus a "
                      "part per position, and the naive loop's positions share the fixed part.")
    return out + (f"- Without the cache the generation took **{time_ratio:.1f}×** as long, *not less* than the "
                  f"{work_ratio:.1f}× work ratio: at this length the cost per position, not the fixed per-step "
                  "read of the weights, set the time.")


def loop_seconds(model, input_ids, n_new: int, *, cached: bool = False) -> float:
    """Seconds one decode loop takes from its start to its last token (`naive_decode`, or
    `cached_decode` with `cached=True`), stamped by the recorder `run_loops` uses.

    Args:
        model: a transformers causal LM.
        input_ids: prompt ids, (1, n) LongTensor.
        n_new: tokens to generate.
        cached: which loop.
    """
    from infercourse.core.trace import record_stream
    from infercourse.core.types import Event
    loop = cached_decode if cached else naive_decode
    tr = record_stream((Event(t=time.perf_counter(), n_tokens=1, text=f"{tok} ")
                        for tok in loop(model, input_ids, n_new)), raise_errors=True)
    return float(tr.chunk_t[-1] - tr.sent_t)


# -- what the cache costs --------------------------------------------------------------------
def _block_bytes_per_value(name: str) -> float:
    """Bytes per value of a llama.cpp block type, its scales included, from gguf-py's table
    of llama.cpp's block sizes (q8_0: 34 bytes per block of 32, q4_0: 18 per 32)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]]
    return nbytes / values


# Bytes per cached value. fp8 (vLLM's kv_cache_dtype) is 1 byte a value, its scale one per
# tensor; llama.cpp's q8_0 and q4_0 cache types store a 16-bit scale per block of 32 values.
DTYPE_BYTES = {"f32": 4, "f16/bf16": 2, "fp8": 1, "q8_0": _block_bytes_per_value("q8_0"),
               "q4_0": _block_bytes_per_value("q4_0")}


def hf_cache_bytes(model, input_ids) -> dict[str, Any]:
    """Bytes transformers' DynamicCache holds after a prefill of `input_ids`: the sum of
    every layer's key and value tensors, measured, not computed from the config."""
    import torch
    from transformers import DynamicCache
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1)
    total = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    n = int(input_ids.shape[1])
    return {"tokens": n, "bytes": total, "bytes_per_token": total / n,
            "dtype": str(cache.layers[0].keys.dtype).removeprefix("torch.")}


def state_kv_bytes_per_token(engine, n_tokens: tuple[int, int] = (32, 288)) -> dict[str, Any]:
    """Measure llama.cpp's KV bytes per token from its state snapshot size.

    `llama_state_get_size` counts the bytes `save_state` would write: a fixed part (the
    last token's logits, RNG, headers) plus, for every KV cell in use, its key and value
    rows in every layer (and ~12 bytes of cell metadata). Evaluating two prompt lengths and
    dividing the difference in size by the difference in tokens cancels the fixed part.

    Args:
        engine: a `LlamaCppEngine` (its cache is reset before and after).
        n_tokens: two prompt lengths to evaluate; both must fit in the context window.
    """
    from infercourse.core.errors import ContextLayerError
    llm = engine.llm
    a, b = sorted(n_tokens)
    if a == b or b > llm.n_ctx():
        raise ContextLayerError(f"need two different lengths <= n_ctx {llm.n_ctx()}, got {n_tokens}")
    sizes = {n: _state_size(engine, n) for n in (a, b)}
    return {"tokens": (a, b), "state_bytes": (sizes[a], sizes[b]),
            "kv_bytes_per_token": (sizes[b] - sizes[a]) / (b - a)}


def state_bytes(engine, n_tokens: int) -> int:
    """Bytes of llama.cpp's state snapshot (`llama_state_get_size`) after evaluating one
    exact-length prompt of `n_tokens` from an empty cache: the fixed part plus the KV cells
    in use (the same measurement `state_kv_bytes_per_token` makes at two lengths).

    Args:
        engine: a `LlamaCppEngine` (its cache is reset before and after).
        n_tokens: prompt length; it must fit the context window.
    """
    from infercourse.core.errors import ContextLayerError
    if not 1 < n_tokens <= engine.llm.n_ctx():
        raise ContextLayerError(f"need 1 < n_tokens <= n_ctx {engine.llm.n_ctx()}, got {n_tokens}")
    return _state_size(engine, n_tokens)


def _state_size(engine, n_tokens: int) -> int:
    """`llama_state_get_size` after one exact-length prompt of `n_tokens` from an empty cache
    (the cache reset before, since eval() drops every cell from position 0 on, and after)."""
    from infercourse.measure.workloads import exact_length_prompt
    import llama_cpp as lc
    llm = engine.llm
    engine.reset()
    llm.eval(engine.tokenize(exact_length_prompt(n_tokens, engine.tokenize, seed=n_tokens)))
    size = int(lc.llama_state_get_size(compat.llama_context_ptr(llm)))
    engine.reset()
    return size


# Published configurations, each copied from the model's own config.json on Hugging Face
# (num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim or
# hidden_size / num_attention_heads). The URL is the source.
PUBLISHED_CONFIGS = {
    "Llama-2-7B": dict(n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128,
                       source="https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json"),
    "Mistral-7B-v0.1": dict(n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                            source="https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json"),
    "Qwen2.5-7B": dict(n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128,
                       source="https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json"),
    "Llama-3.1-8B": dict(n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                         source="https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json"),
    "Qwen2.5-32B": dict(n_layers=64, n_heads=40, n_kv_heads=8, head_dim=128,
                        source="https://huggingface.co/Qwen/Qwen2.5-32B/blob/main/config.json"),
    "Llama-3.1-70B": dict(n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                          source="https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json"),
}


def kv_table(configs: dict[str, dict] | None = None, context_tokens: int = 32_768,
             dtypes: Iterable[str] = ("f16/bf16", "fp8", "q8_0", "q4_0")):
    """KV-cache size per model: bytes per token, GiB at `context_tokens` for each cache
    dtype, and what the same model would need with full multi-head attention (one KV
    head per query head, no GQA sharing).

    Args:
        configs: name -> dict(n_layers, n_heads, n_kv_heads, head_dim[, source]);
            default PUBLISHED_CONFIGS. A `modelcard.ModelCard.as_dict()` works too.
        context_tokens: tokens held in the cache (one sequence).
        dtypes: keys of DTYPE_BYTES (block types count their scales: q8_0 is 34/32 bytes a value).
    """
    import pandas as pd
    rows = []
    for name, c in (configs or PUBLISHED_CONFIGS).items():
        per = kv_bytes_per_token(c["n_layers"], c["n_kv_heads"], c["head_dim"], 2)
        row = {"model": name, "layers": c["n_layers"], "heads": c["n_heads"],
               "kv_heads": c["n_kv_heads"], "head_dim": c["head_dim"],
               "kv_kib_per_token_f16": per / 2**10}
        for d in dtypes:
            row[f"kv_gib_{d}"] = per / 2 * DTYPE_BYTES[d] * context_tokens / 2**30
        row["kv_gib_f16_if_mha"] = per * c["n_heads"] / c["n_kv_heads"] * context_tokens / 2**30
        row["source"] = c.get("source", "")
        rows.append(row)
    return pd.DataFrame(rows).set_index("model")

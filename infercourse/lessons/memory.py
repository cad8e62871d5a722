"""Where a server's memory goes, and when it runs out (notebook 12).

A llama.cpp server holds three things, and prints each as it allocates it:

- **weights**: the model file, memory-mapped (`model buffer size`): fixed;
- **KV cache**: `n_ctx` cells (all slots together) × KV bytes per token, allocated and
  zeroed at start (`KV buffer size`), so it is resident from the first second. It grows
  linearly with the context you *configure*, not the one you use;
- **compute buffers**: scratch space for one batch's activations (`compute buffer size`).

So resident memory is a straight line in the context: RSS ≈ fixed + n_ctx × b, where b
should equal the model card's KV bytes per token. `rss_line` fits that line from two
server starts; `max_context` inverts it for a memory budget: the prediction a learner
checks by starting a server at that size.

The KV cache can be stored at lower precision (`-ctk/-ctv q8_0`, `q4_0`; a quantized V
needs flash attention): half or a quarter of the bytes, at some cost in log-likelihood
(`kv_type_nll`) and speed. Reading that cache every step is also why decode slows as
the context grows (`decode_vs_context`). When a slot's context fills, llama-server stops
the generation, unless context shift (`--context-shift`) drops the oldest half and goes
on (`context_shift_demo`). The host-RAM prompt cache (`--cache-ram`) keeps prefixes of
idle slots in RAM so they need not be recomputed (`cache_ram_demo`).
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import httpx
import numpy as np
import pandas as pd

from infercourse.core.types import Request, generate
from infercourse.measure import claims, noise, roofline
from infercourse.measure.workloads import eval_text, exact_length_prompt
from infercourse.servers.llama_log import VERBOSE_ARGS, log_buffers
from infercourse.models.embedded import resolve_model, vocab_tokenizer
from infercourse.ops.sampling import process_rss_mib

__all__ = ["KV_TYPE_BYTES", "log_buffers", "predict_memory", "measure_server", "rss_line", "max_context",
           "kv_type_nll", "kv_type_table", "decode_vs_context", "shapes_vs_context", "shape_sentence",
           "context_shift_demo", "cache_ram_demo", "rss_growth_with_prompts",
           "vocab_tokenizer"]

# Bytes per cached element: ggml block sizes (q8_0: 34 bytes / 32 values; q4_0: 18 / 32).
KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
                 "q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32}
def predict_memory(card: Any, ctx_size: int, kv_type: str = "f16") -> dict[str, float]:
    """Weights + KV cache for `ctx_size` cells, in MiB, from the model card alone.

    Args:
        card: `models.modelcard.ModelCard`; ctx_size: total KV cells (all slots);
        kv_type: llama.cpp cache type (see KV_TYPE_BYTES).
    """
    kv = card.kv_bytes_per_token(KV_TYPE_BYTES[kv_type]) * ctx_size
    return {"weights_mib": card.weight_bytes() / 2**20, "kv_mib": kv / 2**20,
            "total_mib": (card.weight_bytes() + kv) / 2**20}


def _llama(model, ctx: int, n_parallel: int = 1, threads: int | None = None, extra: Sequence[str] = ()):
    from infercourse.servers import LlamaServer
    # -lv 4: this build logs its buffer sizes (model, KV, compute) only above the default verbosity
    return LlamaServer(model, n_parallel=n_parallel, ctx_size=ctx, threads=threads, extra_args=[*VERBOSE_ARGS, *extra])


def measure_server(model=None, ctx_size: int = 2048, n_parallel: int = 1, *, threads: int | None = None,
                   extra_args: Sequence[str] = (), warm_prompt: str = "Hello") -> dict[str, Any]:
    """Start a llama-server, send one short request (so compute buffers are touched), and
    read its resident memory and the buffers its log reports; then stop it.

    Args:
        model: a GGUF (None: embedded); ctx_size, n_parallel, threads: server settings.
        extra_args: more flags (e.g. ["-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"]).
    """
    with _llama(model, ctx_size, n_parallel, threads, extra_args) as srv:
        generate(srv.engine(), Request(prompt=warm_prompt, max_tokens=4))
        time.sleep(0.2)                  # let the kernel account the pages just touched
        rss = process_rss_mib(srv.pid)
        log = srv.log_path.read_text(errors="replace")
    return {"ctx_size": ctx_size, "n_parallel": n_parallel, "rss_mib": rss, "kv_cells": None,
            **log_buffers(log), "flags": " ".join(extra_args)}


def rss_line(points: pd.DataFrame) -> dict[str, float]:
    """Fit RSS = fixed + per_token × ctx through measured (ctx_size, rss_mib) points."""
    slope, fixed = np.polyfit(points["ctx_size"].astype(float), points["rss_mib"].astype(float), 1)
    return {"fixed_mib": float(fixed), "mib_per_token": float(slope), "bytes_per_token": float(slope) * 2**20}


def max_context(line: dict[str, float], budget_mib: float, *, n_parallel: int = 1, pad: int = 256) -> int:
    """Largest total context (a multiple of `pad` × slots: llama.cpp rounds each slot's
    context up to 256) whose predicted RSS fits in `budget_mib`."""
    cells = (budget_mib - line["fixed_mib"]) / line["mib_per_token"]
    step = pad * n_parallel
    return int(cells // step) * step


def kv_type_nll(model=None, kv_type: str = "f16", *, text: str | None = None, n_threads: int = 2) -> float:
    """Mean negative log-likelihood (nats/token) of a fixed text with the KV cache stored as
    `kv_type`: how much the cache's precision costs in quality. In process (llama-cpp-python),
    flash attention on (llama.cpp needs it for a quantized V cache).

    Args:
        model: a GGUF (None: embedded); kv_type: f16, q8_0, q4_0...; text: default eval prose.
    """
    import llama_cpp
    ggml = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
    text = text or eval_text()[:1500]     # ~300 tokens: enough to see the cache type, cheap to score
    llm = llama_cpp.Llama(model_path=str(resolve_model(model).path), n_ctx=1024, n_batch=1024,
                          n_threads=n_threads, logits_all=True, type_k=ggml[kv_type], type_v=ggml[kv_type],
                          flash_attn=True, verbose=False)
    ids = llm.tokenize(text.encode("utf-8"), add_bos=True)[:1000]
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
    logz = logits.max(1) + np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1))
    return float(np.mean(logz - logits[np.arange(len(ids) - 1), ids[1:]]))


def _judged(speeds: dict[str, list[float]], ref: str, aa: str) -> tuple[dict, "noise.NoiseFloor | None"]:
    """Each arm's median, its paired ratio to `ref` and a verdict against the A/A floor."""
    floor = noise.noise_floor(speeds[ref], speeds[aa]) if aa in speeds and len(speeds[ref]) > 1 else None
    out = {}
    for arm, v in speeds.items():
        if arm == aa:
            continue
        iv = noise.paired_interval(speeds[ref], v)
        verdict = "reference" if arm == ref else noise.compare(
            speeds[ref], v, floor, higher_is_better=True, labels=(ref, arm)).verdict if floor else "1 run: not judged"
        out[arm] = {"decode_tok_per_s": float(np.median(v)), f"vs_{ref}": iv.median, f"vs_{ref}_lo": iv.lo,
                    f"vs_{ref}_hi": iv.hi, "verdict": verdict}
    return out, floor


def decode_vs_context(engine, tokenize, contexts: Sequence[int], *, max_tokens: int = 32, card=None,
                      bandwidth_gbs: float | None = None, repeats: int = 1) -> pd.DataFrame:
    """Decode speed (the server's own `predicted_per_second`) after prompts of each length,
    beside the bandwidth ceiling at that context when a card and bandwidth are given.
    With repeats >= 2 the lengths run interleaved (shuffled per round), the shortest twice per round
    (its A/A floor), and each row says whether it is slower than the shortest beyond noise.

    Args:
        engine: an HTTP engine on llama-server (api="completions"); tokenize: text -> ids.
        contexts: prompt lengths in tokens (shortest first).
        repeats: requests per length.
    """
    from infercourse.core.trace import record
    prompts = {f"{n} tokens": exact_length_prompt(n, tokenize, seed=100 + i) for i, n in enumerate(contexts)}

    def one(n: int):
        return lambda: record(engine, Request(prompt=prompts[f"{n} tokens"], max_tokens=max_tokens, ignore_eos=True,
                                              cache_prompt=False)).engine_timings.get("predicted_per_second")
    ref = f"{contexts[0]} tokens"
    arms = {f"{n} tokens": one(n) for n in contexts} | ({"A/A": one(contexts[0])} if repeats > 1 else {})
    speeds = noise.run_interleaved(arms, repeats, warmup=0)
    judged, floor = _judged(speeds, ref, "A/A")
    rows = []
    for n in contexts:
        row = {"context": n, **judged[f"{n} tokens"]}
        if card is not None and bandwidth_gbs:
            row["ceiling_tok_per_s"] = roofline.decode_ceiling_tok_per_s(bandwidth_gbs, card, n + max_tokens // 2)
        rows.append(row)
    out = pd.DataFrame(rows).set_index("context")
    out.attrs["noise_floor_text"] = floor.text() if floor else "repeats = 1: no A/A floor"
    out.attrs["noise_floor"] = floor.floor if floor else None
    return out


def shapes_vs_context(growth: pd.DataFrame) -> pd.DataFrame:
    """The measured decode speed and the bandwidth ceiling, each relative to the shortest
    context. The measured one is the table's own `vs_<shortest>` column (the median of the
    paired per-round ratios), not a ratio of the medians: one estimator, the same number in
    the table, the sentence (`shape_sentence`) and the plot.

    Args:
        growth: `decode_vs_context`'s table (with a card and bandwidth: `ceiling_tok_per_s`).
    """
    ref = f"vs_{growth.index[0]} tokens"
    ceil = growth["ceiling_tok_per_s"]
    return pd.DataFrame({"measured": growth[ref], "bandwidth ceiling": ceil / ceil.iloc[0]}, index=growth.index)


def shape_sentence(growth: pd.DataFrame) -> str:
    """Did the measured decode speed fall with the context as the bandwidth model predicts,
    faster, or slower (`claims.shape_sentence` on `shapes_vs_context`), judged against the
    table's A/A band."""
    rel = shapes_vs_context(growth)
    return claims.shape_sentence(list(rel.index), rel["measured"], rel["bandwidth ceiling"],
                                 floor=growth.attrs.get("noise_floor"))


def kv_type_table(model=None, kv_types: Sequence[str] = ("f16", "q8_0", "q4_0"), *, ctx_size: int = 4096,
                  prompt_tokens: int = 1024, max_tokens: int = 32, threads: int | None = None,
                  repeats: int = 1) -> pd.DataFrame:
    """For each KV-cache type: the KV buffer llama-server allocates (from its log), its RSS,
    decode speed after a `prompt_tokens` prompt (server timings), and the mean NLL of the
    eval text with that cache type (quality; lower is better). The servers run side by side
    and the timed requests interleave (shuffled per round), the first type twice per round for its
    A/A floor: `vs_<first>` (median paired ratio), its interval and `verdict`.

    Args:
        model: a GGUF (None: embedded); kv_types: llama.cpp cache types for both K and V.
        ctx_size: server context; prompt_tokens, max_tokens: the timed request.
        repeats: timed requests per type.
    """
    import contextlib
    tok = vocab_tokenizer(model)
    prompt = exact_length_prompt(prompt_tokens, tok, seed=21)
    rows = {}
    with contextlib.ExitStack() as stack:
        srvs = {t: stack.enter_context(_llama(model, ctx_size, 1, threads, ["-fa", "on", "-ctk", t, "-ctv", t]))
                for t in kv_types}
        for t, srv in srvs.items():
            done = _complete(srv.url, "Hello", 4, cache_prompt=False)     # warm-up: touch the buffers
            rows[t] = {"kv_type": t, "bytes_per_element": KV_TYPE_BYTES[t], "rss_mib": process_rss_mib(srv.pid),
                       **log_buffers(srv.log_path.read_text(errors="replace")), "error": done.get("error")}

        def one(t: str):
            def timed():
                # a short untimed request to the same server first: otherwise the A/A rerun, which
                # an order puts after another server's request, starts colder than its
                # reference (which often follows it on the same server): 11 printed A2/A 0.83
                _complete(srvs[t].url, "Hello", 2, cache_prompt=False)
                return httpx.post(srvs[t].url + "/completion", json={
                    "prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "cache_prompt": False},
                    timeout=300).json()["timings"].get("predicted_per_second")
            return timed
        arms = {t: one(t) for t in kv_types} | ({"A/A": one(kv_types[0])} if repeats > 1 else {})
        speeds = noise.run_interleaved(arms, repeats, warmup=0)
    judged, floor = _judged(speeds, kv_types[0], "A/A")
    for t in kv_types:
        rows[t].update(judged[t], nll=kv_type_nll(model, t, n_threads=threads or 2))
    out = pd.DataFrame(list(rows.values())).set_index("kv_type")
    out["nll_vs_f16"] = out["nll"] - out["nll"].iloc[0]
    out.attrs["noise_floor_text"] = floor.text() if floor else "repeats = 1: no A/A floor"
    return out


def _complete(url: str, prompt: str, n_predict: int, **kw: Any) -> dict[str, Any]:
    r = httpx.post(url + "/completion", json={"prompt": prompt, "n_predict": n_predict, "ignore_eos": True,
                                              "temperature": 0, **kw}, timeout=300)
    body = r.json()
    if r.status_code != 200:
        return {"error": (body.get("error") or {}).get("message", str(body)), "tokens_predicted": 0}
    return {"tokens_predicted": body.get("tokens_predicted"), "stop_type": body.get("stop_type"),
            "truncated": body.get("truncated"), "prompt_n": body["timings"].get("prompt_n"),
            "cache_n": body["timings"].get("cache_n"), "prompt_ms": body["timings"].get("prompt_ms")}


def context_shift_demo(model=None, *, slot_ctx: int = 256, prompt_tokens: int = 64, n_predict: int = 320,
                       threads: int | None = None) -> pd.DataFrame:
    """Ask one slot of `slot_ctx` tokens for more tokens than fit, with and without
    `--context-shift`: without, generation stops when the slot is full; with, the oldest
    half of the context is dropped and it goes on (the model forgets what was dropped)."""
    tok = vocab_tokenizer(model)
    prompt = exact_length_prompt(prompt_tokens, tok, seed=7)
    rows = []
    for flag in ("--no-context-shift", "--context-shift"):
        with _llama(model, slot_ctx, 1, threads, [flag]) as srv:
            rows.append({"setting": flag, "slot_ctx": slot_ctx, "asked": n_predict,
                         **_complete(srv.url, prompt, n_predict)})
            rows[-1]["shift_lines_in_log"] = srv.log_path.read_text(errors="replace").count("context shift")
    return pd.DataFrame(rows).set_index("setting")


def cache_ram_demo(model=None, *, prompt_tokens: int = 600, threads: int | None = None,
                   cache_ram_mib: Sequence[int] = (0, 256)) -> pd.DataFrame:
    """One slot, three requests: A, then B (which evicts A from the slot), then A again.
    With the host-RAM prompt cache off, A's prefix is computed twice; with it on, the
    idle slot's prefix was saved to RAM and is restored (`cache_n`, shorter prompt time)."""
    tok = vocab_tokenizer(model)
    a, b = (exact_length_prompt(prompt_tokens, tok, seed=s) for s in (11, 12))
    rows = []
    for mib in cache_ram_mib:
        from infercourse.servers import LlamaServer
        with LlamaServer(model, n_parallel=1, ctx_size=2 * prompt_tokens + 256, threads=threads,
                         cache_ram_mib=mib) as srv:
            for name, p in (("A", a), ("B", b), ("A again", a)):
                rows.append({"cache_ram_mib": mib, "request": name, **_complete(srv.url, p, 4)})
    return pd.DataFrame(rows)


def rss_growth_with_prompts(model=None, *, n_prompts: int = 6, prompt_tokens: int = 256, threads: int | None = None,
                            cache_ram_mib: Sequence[int | None] = (0, None)) -> pd.DataFrame:
    """Resident memory before and after `n_prompts` distinct prompts on one slot, per
    `--cache-ram` setting (None: llama-server's default, 8,192 MiB in recent builds).

    The KV cache is allocated at start, but the host prompt cache is not: each new prompt
    evicts the slot's previous one, which is saved to host RAM (23,040 bytes per token
    here, the f16 KV size) until the cache reaches its limit. So "a server that starts will
    not run out of memory later" holds for the KV buffer only: with the cache on, RSS grows
    with the requests served. `expected_mib` is the KV size of the evicted prompts.

    Args:
        model: a GGUF (None: embedded); threads: server threads.
        n_prompts, prompt_tokens: distinct prompts sent, and their length in tokens.
        cache_ram_mib: settings to compare (0: off).
    """
    from infercourse.models.modelcard import model_card
    from infercourse.servers import LlamaServer
    tok, kv = vocab_tokenizer(model), model_card(model).kv_bytes_per_token(2)
    prompts = [exact_length_prompt(prompt_tokens, tok, seed=100 + i) for i in range(n_prompts + 1)]
    rows = []
    for mib in cache_ram_mib:
        with LlamaServer(model, n_parallel=1, ctx_size=prompt_tokens + 256, threads=threads,
                         cache_ram_mib=mib) as srv:
            _complete(srv.url, prompts[0], 2)
            time.sleep(0.2)              # let the kernel account the pages just touched
            before = process_rss_mib(srv.pid)
            for p in prompts[1:]:
                _complete(srv.url, p, 2)
            time.sleep(0.2)
            after = process_rss_mib(srv.pid)
        rows.append({"cache_ram_mib": "default" if mib is None else mib, "prompts": n_prompts,
                     "rss_before_mib": before, "rss_after_mib": after, "growth_mib": after - before,
                     "expected_mib": 0.0 if mib == 0 else n_prompts * prompt_tokens * kv / 2**20})
    return pd.DataFrame(rows).set_index("cache_ram_mib")

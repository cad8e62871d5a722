"""The six classic serving problems, each as a small measured case.

Out of memory; slow first token; low decode throughput; P95 jitter; quality drop after
quantization; fast locally, slow in production. Each has a symptom, a first place to look
and the knobs that address it (`PROBLEMS`). The tuning notebook measures what a 2-core
CPU can show of each and says why not for the rest: a real out-of-memory kill is never
provoked on a shared machine; instead the memory a configuration needs is predicted
(weights + KV cache = -c tokens x bytes per token + compute buffers), checked against
what the server logged, and the largest context that would fit in the RAM free right now
is computed.

"Fast locally, slow in production" is mostly queueing: a one-user test sends the next
request after the last one ends; real users arrive independently (a Poisson process), so
bursts queue even when the average rate is below capacity.

A tail percentile needs many requests: a p95 with a 95% interval needs dozens of them
(`core.summary.min_n(0.95)`), so the few requests of a lesson-sized run give a median with its
interval and say "n too small" for the p95 rather than print a number nobody can trust.
Two runs are compared only like with like: `like_for_like` says when they sent different
numbers of requests or a different load, because a shorter queue lowers TTFT by itself.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import psutil

from infercourse.core import summary
from infercourse.core.types import Request
from infercourse.measure import claims, noise
from infercourse.measure.tuning_log import pairing, pairs

__all__ = ["PROBLEMS", "problems_frame", "KV_BYTES", "predicted_kv_mib", "max_context_tokens",
           "quality_drop", "production_workloads", "overflow_request", "percentile_text", "median_text", "tail_text",
           "tail_table", "load_text", "like_for_like", "paired_ratio"]

# symptom, where to look first, knobs (from llama.cpp's server docs and the course's lessons)
PROBLEMS = {
    "out of memory": ("the server dies at start or under load; RSS near the limit",
                      "weights + KV (-c x bytes/token) + compute buffers",
                      "-c, -ctk/-ctv, -np, a smaller quantization"),
    "slow first token": ("TTFT high, decode fine", "queue vs prefill share of TTFT",
                         "-np (queue); -b/-ub, prefix reuse, shorter prompts (prefill)"),
    "low decode throughput": ("tokens/s far under the bandwidth ceiling", "decode share; MBU; threads vs cores",
                              "-t, quantization, batching users (-np)"),
    "P95 jitter": ("p95 far above p50", "queue share per request; noisy neighbours",
                   "-np, admission control, fewer threads than busy cores, max_tokens"),
    "quality drop after quantization": ("answers change or degrade", "perplexity on a fixed text vs the original",
                                        "a bigger quantization (Q8_0/Q6_K), an importance matrix"),
    "fast locally, slow in production": ("one-user test fine, users complain", "TTFT under the real arrival pattern",
                                         "capacity (slots, replicas), prefix caching, the same flags as the test"),
}

# bytes per cached element; block types carry their scales (q8_0: 32 int8 + one f16 scale)
KV_BYTES = {"f16": 2.0, "bf16": 2.0, "f32": 4.0, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
            "q4_1": 20 / 32, "q4_0": 18 / 32}


def problems_frame(evidence: dict[str, str]) -> pd.DataFrame:
    """The six problems as a table, with what was measured for each (or why not).

    Args:
        evidence: {problem: one computed sentence}; missing problems read "not measured here".
    """
    unknown = set(evidence) - set(PROBLEMS)
    if unknown:
        raise ValueError(f"unknown problem(s) {sorted(unknown)}; choose from {list(PROBLEMS)}")
    rows = [{"problem": p, "symptom": s, "look at first": look, "knobs": knobs,
             "measured here": evidence.get(p, "not measured here")} for p, (s, look, knobs) in PROBLEMS.items()]
    return pd.DataFrame(rows).set_index("problem")


def predicted_kv_mib(card, n_ctx: int, cache_type_k: str = "f16", cache_type_v: str = "f16") -> float:
    """KV cache a server allocates for `n_ctx` tokens (all slots), in MiB.

    Args:
        card: a `ModelCard` (its `kv_bytes_per_token(dtype_bytes)`).
        n_ctx: total context, -c (per slot x slots).
        cache_type_k, cache_type_v: -ctk / -ctv element types.
    """
    for t in (cache_type_k, cache_type_v):
        if t not in KV_BYTES:
            raise ValueError(f"unknown cache type {t!r}; choose from {sorted(KV_BYTES)}")
    return card.kv_bytes_per_token((KV_BYTES[cache_type_k] + KV_BYTES[cache_type_v]) / 2) * n_ctx / 2**20


def max_context_tokens(card, *, free_bytes: float | None = None, compute_mib: float = 0.0,
                       cache_type: str = "f16") -> int:
    """The largest -c whose weights + KV cache + compute buffers fit in `free_bytes`.

    Args:
        card: a `ModelCard`.
        free_bytes: memory available (None: what psutil says is available now).
        compute_mib: compute buffers the server logged (they grow with -ub, not -c).
        cache_type: K and V element type.
    """
    free = psutil.virtual_memory().available if free_bytes is None else free_bytes
    room = free - card.tensor_bytes - compute_mib * 2**20
    per_token = card.kv_bytes_per_token(KV_BYTES[cache_type])
    return max(0, int(room // per_token))


def quality_drop(qtype: str = "Q2_K", *, words: int = 150, n_threads: int = 1) -> dict[str, Any]:
    """Perplexity of the original Q4_1 file vs a re-quantized one on the same fixed text,
    and the mean per-token NLL difference with its standard error (paired: same tokens).

    Args:
        qtype: a llama.cpp quantization type, derived once from the F16 GGUF.
        words: words of the course's evaluation prose scored.
        n_threads: CPU threads for the forward passes.
    """
    from infercourse.measure.workloads import eval_text
    from infercourse.models.formats import quantized_gguf
    from infercourse.models.modelcard import model_card
    from infercourse.models.quality import token_nlls
    text = " ".join(eval_text().split()[:words])
    path = quantized_gguf(qtype)
    ids_a, a = token_nlls(None, text, n_threads=n_threads)
    ids_b, b = token_nlls(path, text, n_threads=n_threads)
    if ids_a != ids_b:
        raise ValueError("the two files tokenize the text differently: NLLs are not paired")
    d = b - a
    return {"qtype": qtype, "tokens": len(d), "ppl_original": float(np.exp(a.mean())),
            "ppl_quantized": float(np.exp(b.mean())), "nll_diff": float(d.mean()),
            "nll_diff_se": float(d.std(ddof=1) / math.sqrt(len(d))),
            "bits_original": model_card(None).bits_per_weight, "bits_quantized": model_card(path).bits_per_weight}


def production_workloads(users: list[Request], capacity_rps: float, *, load: float = 0.7,
                         seed: int = 0, n_local: int | None = None) -> dict[str, tuple[list[Request], dict]]:
    """The same requests sent two ways: one user at a time ("local": how a developer
    tests) and as independent arrivals at `load` x the measured capacity ("production").

    Args:
        users: the requests.
        capacity_rps: completed requests per second the server sustained under load.
        load: fraction of capacity the Poisson arrivals average (below 1: it *can* keep up).
        seed: the arrival schedule's seed.
        n_local: requests in the one-user run (None: all; a few give its median).
    """
    if not capacity_rps > 0 or not 0 < load:
        raise ValueError(f"need capacity_rps > 0 and load > 0, got {capacity_rps}, {load}")
    return {"local": (users[:n_local], {"pattern": "sequential"}),
            # the local run warmed the server up: no second warm-up
            "production": (users, {"pattern": "poisson", "rate_rps": load * capacity_rps, "seed": seed,
                                   "warmup": 0})}


def overflow_request(tokenize, ctx_per_slot: int, *, extra: int = 64) -> Request:
    """One request whose prompt is `extra` tokens longer than a slot's context: the server
    must refuse it (llama-server splits -c between its -np slots)."""
    from infercourse.measure.workloads import exact_length_prompt
    return Request(messages=[{"role": "user", "content": exact_length_prompt(ctx_per_slot + extra, tokenize)}],
                   max_tokens=4)


def percentile_text(s: pd.DataFrame, metric: str, p: int, *, unit: str = "s", value: bool = True) -> str:
    """One percentile of a `summary.summarize` row with its interval, or, when the run has too
    few requests for one, "n too small" and no value (a p95 of six requests is one of them).

    Args:
        s: a `summarize` result; metric: its row; p: 50, 90, 95 or 99; unit: seconds shown as is.
        value: False: the interval alone ("[lo, hi]"), for a table that shows the value beside it.
    """
    r = s.loc[metric]
    if np.isnan(r[f"p{p}_lo"]):
        need = summary.min_n(p / 100, s.attrs.get("ci", 0.95))
        return f"{f'p{p}: ' if value else ''}n too small (an interval needs {need} requests, have {int(r['count'])})"
    iv = f"[{r[f'p{p}_lo']:.3g}, {r[f'p{p}_hi']:.3g}]"
    return f"p{p} {r[f'p{p}']:.3g} {unit} {iv}" if value else iv


def median_text(df: pd.DataFrame, metric: str = "ttft_s", unit: str = "s") -> str:
    """A run's median of one metric with its interval, or "n too small" (`percentile_text`)."""
    s = summary.summarize(df, [metric])
    return percentile_text(s, metric, 50, unit=unit) if "p50" in s and s.loc[metric, "count"] else "p50: none finished"


def tail_text(df: pd.DataFrame, metric: str = "ttft_s", name: str = "TTFT") -> str:
    """The median and the tail of one metric, as far as this many requests can show them: p50
    with its interval, p95 with its interval or "n too small", and then (without a p95) only
    the spread of these requests: the slowest over the median.

    Args:
        df: a per-request frame; metric: its column; name: how the sentence calls it.
    """
    s = summary.summarize(df, [metric])
    if "p50" not in s or not s.loc[metric, "count"]:
        return f"{name}: no request finished"
    r = s.loc[metric]
    head = f"{name} {percentile_text(s, metric, 50)}; {percentile_text(s, metric, 95)}"
    if not np.isnan(r["p95_lo"]):
        return f"{head}: p95/p50 = {r['p95'] / r['p50']:.2g}"
    return f"{head}; the slowest of these {int(r['count'])} took {r['max'] / r['p50']:.2g}× their median"


def tail_table(runs: dict[str, Any]) -> pd.DataFrame:
    """max_tokens against the tail: per run, the requests sent, TTFT/TPOT/E2E medians, the
    E2E median's interval and p95 (each "n too small" when the run has too few requests for
    one) and the E2E a request at the cap should take, TTFT + (max_tokens - 1) x TPOT."""
    rows = {}
    for name, r in runs.items():
        s = summary.summarize(r.df, ["ttft_s", "tpot_s", "e2e_s"])
        if "p50" not in s or not s.loc["e2e_s", "count"]:
            continue                      # nothing finished: no latency to show
        m = r.manifest["sampling"]["max_tokens"]
        rows[name] = {"requests": len(r.df), "max_tokens": m, "ttft_p50_s": s.loc["ttft_s", "p50"],
                      "tpot_p50_s": s.loc["tpot_s", "p50"], "e2e_p50_s": s.loc["e2e_s", "p50"],
                      "e2e_p50_interval": percentile_text(s, "e2e_s", 50, value=False),
                      "e2e_p95": percentile_text(s, "e2e_s", 95),
                      "e2e_at_cap_s": s.loc["ttft_s", "p50"] + (m - 1) * s.loc["tpot_s", "p50"]}
    return pd.DataFrame(rows).T


def load_text(load: dict[str, Any]) -> str:
    """How a run sent its requests, from its manifest's `load`."""
    pat = load.get("pattern")
    if pat == "concurrency":
        return f"from {load.get('concurrency')} users at once"
    if pat == "sequential":
        return "one at a time"
    if pat in ("poisson", "rate"):
        kind = "independent" if pat == "poisson" else "evenly spaced"
        return f"as {kind} arrivals at {load.get('rate_rps'):.3g} requests/s"
    return f"as {pat}"


def like_for_like(runs: dict[str, Any], metric: str = "e2e_s", *, floor: float = 0.0, by: str | None = None,
                  what: str = "") -> str:
    """Two runs of (nominally) the same requests compared on one metric, saying first whether
    the comparison is like with like: the same number of requests sent the same way, or not,
    and what a difference there does. Then the paired comparison (`noise.compare` against the
    A/A band ±floor, in `claims.verdict_sentence`'s words).

    Args:
        runs: {name: run} with exactly two runs (a `BenchResult`: `df` and `manifest`); the
            first is the reference.
        metric: the per-request column compared.
        floor: the A/A noise floor (a fraction) the difference must clear.
        by: "request" or "place" (`tuning_log.pairs`; None: `pairing(metric)`): requests whose
            place in the queue is set by a schedule, not by a race, may be paired by request.
        what: the quantity's name in the sentence (default: the metric).
    """
    if len(runs) != 2:
        raise ValueError(f"compare exactly two runs, got {list(runs)}")
    (na, a), (nb, b) = runs.items()
    la, lb = a.manifest.get("load", {}), b.manifest.get("load", {})
    n_a, n_b = len(a.df), len(b.df)
    how_a, how_b = load_text(la), load_text(lb)
    if n_a == n_b and how_a == how_b:
        head = (f"{na} and {nb} each sent {n_a} requests {how_a}: the same queue, so a difference is the "
                f"one change between them.")
    else:
        parts = []
        if n_a != n_b:
            parts.append(f"{na} sent {n_a} requests and {nb} sent {n_b}: only the first {min(n_a, n_b)} pair up, "
                         f"and more requests behind one another make a longer queue, which raises TTFT and E2E "
                         f"by itself")
        if how_a != how_b:
            parts.append(f"{na} sent them {how_a}, {nb} {how_b}: the difference below includes that change")
        head = "Not like with like: " + "; ".join(parts) + "."
    x, y = pairs(a.df, b.df, metric, by or pairing(metric))
    if not x:
        return f"{head} No request finished in both runs: nothing to compare."
    c = noise.compare(x, y, floor, labels=(na, nb), word="faster" if metric.endswith("_s") else "higher")
    return f"{head} {claims.verdict_sentence(c, what or metric)}"


def paired_ratio(runs: dict[str, Any], metric: str = "e2e_s", *, by: str | None = None):
    """The median paired ratio (second run ÷ first, pair by pair) that `like_for_like`'s
    sentence prints, with its interval (`noise.paired_interval`, as `noise.compare` computes
    it), or None when no request finished in both runs. It is not the ratio of the two
    runs' medians.

    Args:
        runs: {name: run} with exactly two runs; metric, by: as `like_for_like`.
    """
    (_, a), (_, b) = runs.items()
    x, y = pairs(a.df, b.df, metric, by or pairing(metric))
    return noise.paired_interval(x, y) if x else None

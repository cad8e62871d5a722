"""Prefix caching: reuse the KV cache of a prompt's leading tokens that an earlier request
already computed, so the next request only prefills what is new.

Every request to a chat model starts with the same tokens: the system prompt, the tool
schemas, project context. An engine with a prefix cache keeps the attention keys and values
(the KV cache) it computed for them and, when a new prompt starts with the *same tokens*,
skips their prefill. The match is exact and from the start: the first differing token ends
the reuse, so one changed character near the top of the system prompt (a timestamp, a
reordered tool list) makes everything after it a miss.

Engines differ in how much they keep: llama.cpp in process keeps the previous request's
tokens only; llama-server keeps each slot's last prompt and, in current builds, many more
prompts in a host-RAM prompt cache (`--cache-ram` MiB) that it restores into a slot on a
match; vLLM hashes blocks of 16 tokens into a shared pool, so many prefixes live at once
on the accelerator. How to see
a hit: llama.cpp's `prompt_n` (tokens evaluated), llama-server's `cached_tokens` /
`timings.cache_n`, vLLM's Prometheus counters `vllm:prefix_cache_queries` and
`vllm:prefix_cache_hits` (tokens, summed over engines) on `/metrics`.

- `cold_warm`: one workload with the cache off, then on; TTFT and cached tokens per request.
- `first_divergence` / `divergence_view`: where two prompts stop sharing tokens.
- `prometheus_counters` / `counter_delta`: read a server's counters before and after a run.
- `with_pasted_text`, `warm_ttft_s`, `interleaved_ttft_s`, `first_vs_rest`: one setting changed
  (a longer new part, another user's prompt in between), for the exercises that predict first.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import httpx
import pandas as pd

from infercourse.core.types import Request, generate
from infercourse.core.errors import APILayerError
from infercourse.measure.results import new_run_dir
from infercourse.measure.workloads import common_prefix_len

__all__ = ["VLLM_PREFIX_COUNTERS", "LLAMA_SERVER_COUNTERS", "first_divergence", "divergence_view",
           "cold_warm", "cold_warm_summary", "cold_warm_sentence", "cache_loss_sentence", "prometheus_counters",
           "counter_delta", "run_with_counters", "hit_rate", "with_pasted_text", "warm_ttft_s",
           "interleaved_ttft_s", "first_vs_rest"]

# Counters as vLLM (v1 engine) declares them; on the wire each gets a `_total` suffix.
VLLM_PREFIX_COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
# llama-server (--metrics): prompt tokens it evaluated (cached ones excluded) and, in newer
# builds, prompt tokens it reused from the cache.
LLAMA_SERVER_COUNTERS = ("llamacpp:prompt_tokens", "llamacpp:prompt_tokens_cached")


def first_divergence(tokens_a: Sequence, tokens_b: Sequence) -> int | None:
    """Index of the first token where two prompts differ, which is also how many tokens a
    prefix cache holding `tokens_a` can reuse for `tokens_b`. None if they are identical;
    the shorter length if one is a prefix of the other."""
    n = common_prefix_len(tokens_a, tokens_b)
    return None if n == len(tokens_a) == len(tokens_b) else n


def _detokenize(engine, tokens: Sequence[int]) -> str:
    llm = getattr(engine, "llm", None)  # llama.cpp in process; transformers has .tokenizer
    if llm is not None:
        return llm.detokenize(list(tokens)).decode("utf-8", errors="replace")
    return engine.tokenizer.decode(list(tokens))


def divergence_view(engine, request_a: Request, request_b: Request, *, context: int = 6) -> dict[str, Any]:
    """Where two requests' prompts (chat template applied) stop sharing tokens, with the
    text of a few tokens on each side, as the engine's tokenizer sees them.

    Args:
        engine: has `prompt_tokens(request)` (LlamaCppEngine, TransformersEngine).
        context: tokens shown before and after the divergence.
    """
    a, b = engine.prompt_tokens(request_a), engine.prompt_tokens(request_b)
    pos = first_divergence(a, b)
    out = {"tokens_a": len(a), "tokens_b": len(b), "first_divergence": pos,
           "shared_pct": 100.0 * (len(a) if pos is None else pos) / max(1, len(b))}
    if pos is not None:
        lo = max(0, pos - context)
        out.update(before=_detokenize(engine, a[lo:pos]),
                   a_after=_detokenize(engine, a[pos:pos + context]),
                   b_after=_detokenize(engine, b[pos:pos + context]))
    return out


def _warm_up(engine) -> None:
    """One unrelated short request: loads kernels and pages, and (in process) leaves no
    useful prefix behind, so the first measured request is truly cold."""
    generate(engine, Request(messages=[{"role": "user", "content": "Say hi."}], max_tokens=2,
                             cache_prompt=False))
    if hasattr(engine, "reset"):
        engine.reset()


def cold_warm(engine, workload, *, label: str = "prefix", results_root: str | Path | None = None,
              settings: Iterable[bool] = (False, True), salt: str | None = None) -> pd.DataFrame:
    """Run the same requests with the prefix cache off, then on, back to back.

    With the cache off every request prefills its whole prompt (cold). With it on, a request
    whose leading tokens match what the engine still holds from the previous one prefills
    only the rest (warm). Requests are forced to their `max_tokens` (ignore_eos) so TTFT
    always exists. Every setting sends the very same tokens: bench's per-run salt, which
    would start each cache-on prompt with new tokens and move every prefix, is off unless
    `salt` is given, and then one salt serves all settings. Returns bench's per-request
    frame with `cache_prompt`, `req_index`, `prompt_n` (tokens evaluated, where the engine
    reports it) and `state` ("warm" when at least half the prompt came from the cache, else
    "cold").

    Args:
        engine: an in-process engine (reset between settings) or an HTTP engine.
        workload: a `workloads.Workload` or a list of Requests.
        label: run name prefix; one run per setting is saved under `results_root`, each
            in a new timestamped folder.
        settings: the cache_prompt values to run, in order.
        salt: None sends the prompts as given (the tokens `divergence_view` counts); a string
            (e.g. `bench.new_salt()`) starts every prompt of every setting with it, so a
            long-lived server's pool cannot serve an earlier run's prefix to the first request.
    """
    from infercourse.measure.bench import run
    reqs = list(getattr(workload, "requests", workload))
    _warm_up(engine)
    frames = []
    for cache in settings:
        if hasattr(engine, "reset"):
            engine.reset()
        name = f"{label}-{'cache' if cache else 'nocache'}"
        res = run(engine, [replace(r, cache_prompt=cache, ignore_eos=True) for r in reqs],
                  pattern="sequential", warmup=0, progress=False, label=name, salt=salt or False,
                  out_dir=new_run_dir(results_root, name),
                  conditions={"cache_prompt": cache, "workload_name": getattr(workload, "name", None)})
        df = res.df.copy()
        df["cache_prompt"] = cache
        df["prompt_n"] = [tr.engine_timings.get("prompt_n") for tr in res.traces]
        frames.append(df)
    df = pd.concat(frames, ignore_index=True)
    df["state"] = ["warm" if f >= 0.5 else "cold" for f in df["cached_fraction"].fillna(0)]
    return df


def cold_warm_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Median TTFT, prompt and cached tokens per (cache setting, cold/warm): the table the
    lesson reads its headline from."""
    g = df.groupby(["cache_prompt", "state"])
    return g.agg(requests=("ttft_s", "size"), ttft_s=("ttft_s", "median"),
                 prompt_tokens=("prompt_tokens", "median"), cached_tokens=("cached_tokens", "median"))


def cold_warm_sentence(df: pd.DataFrame, predicted_share: float, where: str = "In process",
                       even: float = 0.25) -> str:
    """Warm against cold TTFT in words, from `cold_warm`'s rows: the medians, and a ranking
    only when the two groups do not overlap (every warm request quicker than every cold one,
    or the reverse); overlapping times are called that. Then the warm share of cold TTFT
    against the share predicted from the tokens left to prefill.

    Args:
        df: `cold_warm` output (cache off: the cold requests; cache on, state "warm": the warm ones).
        predicted_share: (prompt − prefix) / prompt, from the Predict step.
        where: the sentence's opening words (which engine).
        even: relative band around the predicted share called "about" it.
    """
    cold = df[~df["cache_prompt"].astype(bool)]["ttft_s"]
    warm = df[df["cache_prompt"].astype(bool) & (df["state"] == "warm")]["ttft_s"]
    if cold.empty or warm.empty:
        return f"{where}: no {'cold' if cold.empty else 'warm'} request to compare; see the table."
    c, w = float(cold.median()), float(warm.median())
    head = (f"{where}: warm-prefix TTFT **{w:.3f} s** vs cold **{c:.3f} s** (medians of {len(warm)} warm and "
            f"{len(cold)} cold requests)")
    if warm.max() < cold.min():
        verdict = f": **{c / w:.1f}× faster** warm, and every warm request beat every cold one"
    elif warm.min() > cold.max():
        verdict = f": warm was **slower** ({w / c:.2f}× cold's time), every warm request behind every cold one"
    else:
        verdict = f": the warm and cold times overlap ({c / w:.2f}× between medians), so this run cannot rank them"
    share = w / c
    if share > predicted_share * (1 + even):
        vs = ("more than the predicted share: the part of TTFT a cache cannot remove (one decode step, template, "
              "sampling) weighs in")
    elif share < predicted_share / (1 + even):
        vs = "less than the predicted share: the cold requests cost more than their token count says"
    else:
        vs = "about the predicted share"
    return f"{head}{verdict}. Warm TTFT was {share:.1%} of cold, {vs} ({predicted_share:.1%})."


def cache_loss_sentence(name: str, shared: float, got: float, diverge_at: int) -> str:
    """What a prompt variant did to the cache: its second request's cached tokens against
    the `shared` variant's, and against where the two prompts part (`diverge_at`, from
    `divergence_view`): a prefix cache can serve at most the tokens before that point.

    Args:
        name: the variant, as the sentence opens.
        shared: cached tokens of the shared variant's second request.
        got: cached tokens of this variant's second request.
        diverge_at: the first token where this variant's two prompts differ.
    """
    if got < shared:
        move = f"cached tokens per request fell from **{shared:.0f}** to **{got:.0f}**"
    elif got > shared:
        move = f"cached tokens per request rose from **{shared:.0f}** to **{got:.0f}**"
    else:
        move = f"cached tokens per request stayed at **{got:.0f}**, as many as the shared prefix"
    if got == diverge_at:
        vs = f"exactly the {diverge_at} tokens before the point where the two prompts part"
    elif got < diverge_at:
        vs = (f"{diverge_at - got:.0f} fewer than the {diverge_at} tokens before the point where the two "
              "prompts part (the engine evaluates the last shared token(s) again)")
    else:
        vs = (f"more than the {diverge_at} tokens the two prompts share as tokenized here: the requests "
              "sent were not these prompts")
    return f"- {name}: {move}, {vs}."


def prometheus_counters(source: str, names: Iterable[str]) -> dict[str, float]:
    """Current values of Prometheus counters, each summed over its labels (engines, models).

    Args:
        source: a server URL (its `/metrics` is fetched) or Prometheus text itself.
        names: family names without the `_total` suffix, e.g. VLLM_PREFIX_COUNTERS.
            A name the server does not export is missing from the result.
    """
    from prometheus_client.parser import text_string_to_metric_families
    text = source
    if source.startswith(("http://", "https://")):
        url = source.rstrip("/") + "/metrics"
        try:
            r = httpx.get(url, timeout=10.0)
        except httpx.HTTPError as e:
            raise APILayerError(f"metrics endpoint {url} not reachable: {e}",
                                hint="is the server running? llama-server needs --metrics") from e
        if r.status_code != 200:
            raise APILayerError(f"{url} answered HTTP {r.status_code}",
                                hint="llama-server exports /metrics only when started with --metrics")
        text = r.text
    wanted, out = {n.removesuffix("_total") for n in names}, {}
    for fam in text_string_to_metric_families(text):
        if fam.name in wanted:
            vals = [s.value for s in fam.samples if s.name in (fam.name, fam.name + "_total")]
            out[fam.name] = float(sum(vals))
    return out


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """How much each counter grew between two readings (a run's own share)."""
    return {k: after[k] - before.get(k, 0.0) for k in after}


def run_with_counters(engine, workload, source: str, names: Iterable[str], **kw: Any
                      ) -> tuple[pd.DataFrame, dict[str, float]]:
    """`cold_warm` on a server, reading its Prometheus counters before and after, so the
    server's own bookkeeping can be set next to what the client saw. Returns the frame
    and each counter's growth over the run (cold_warm's short warm-up request included).
    Only this client should use the server meanwhile.

    Args:
        source: the server URL whose /metrics to read.
        names: counter families, e.g. VLLM_PREFIX_COUNTERS or LLAMA_SERVER_COUNTERS.
        kw: passed to `cold_warm` (settings, label, results_root, salt).
    """
    names = list(names)
    before = prometheus_counters(source, names)
    df = cold_warm(engine, workload, **kw)
    return df, counter_delta(before, prometheus_counters(source, names))


def hit_rate(delta: dict[str, float], hits: str = VLLM_PREFIX_COUNTERS[1],
             queries: str = VLLM_PREFIX_COUNTERS[0]) -> float | None:
    """Share of queried prompt tokens served from the prefix cache (None: no queries)."""
    q = delta.get(queries, 0.0)
    return delta.get(hits, 0.0) / q if q else None


# -- one setting changed (the predict-then-measure exercises) ------------------------------------
def with_pasted_text(workload, n_tokens: int, tokenize, *, seed: int = 0) -> list[Request]:
    """The workload's requests, each last message followed by its own `n_tokens` of unrelated
    text (a pasted log, say): the shared prefix stays, the part after it grows.

    Args:
        workload: a `workloads.Workload` or a list of chat Requests.
        n_tokens: tokens of pasted text per request (as `tokenize` counts them; 0: unchanged).
        tokenize: text -> token ids, e.g. `engine.tokenize`.
    """
    from infercourse.measure.workloads import exact_length_prompt
    reqs = list(getattr(workload, "requests", workload))
    if n_tokens <= 0:
        return reqs
    base = len(tokenize(""))   # a BOS the tokenizer adds to any text is not pasted
    out = []
    for i, r in enumerate(reqs):
        text = exact_length_prompt(n_tokens + base, tokenize, seed=seed + 7919 * (i + 1))
        *head, last = r.messages
        out.append(replace(r, messages=[*head, {**last, "content": f"{last['content']}\n\n{text}"}]))
    return out


def warm_ttft_s(engine, requests, *, label: str = "warm", results_root: str | Path | None = None) -> float:
    """Median TTFT (s) of the warm requests when `requests` run back to back with the cache on
    (`cold_warm` with one setting): NaN if none came out warm.

    Args:
        engine: an in-process engine or an HTTP one that reports cached tokens.
        requests: a Workload or a list of Requests sharing a prefix.
        label, results_root: as in `cold_warm`.
    """
    df = cold_warm(engine, requests, settings=(True,), label=label, results_root=results_root)
    warm = df[df["state"] == "warm"]["ttft_s"]
    return float(warm.median()) if len(warm) else float("nan")


def interleaved_ttft_s(engine, workload, other, *, label: str = "interleaved",
                       results_root: str | Path | None = None) -> float:
    """Median TTFT (s) of the workload's requests after its first when one request of `other`
    (another user's prompt) runs between each two of them, cache on, back to back. An engine
    that keeps only the previous request's prefix meets each of them after the other user's.

    Args:
        engine: an in-process engine (or a server with one slot).
        workload: the requests sharing a prefix (a Workload or a list).
        other: as many requests (or more) with another prefix.
    """
    a, b = list(getattr(workload, "requests", workload)), list(getattr(other, "requests", other))
    if len(a) < 2 or len(b) < len(a) - 1:
        raise ValueError(f"need >= 2 workload requests and one other request between each two, "
                         f"got {len(a)} and {len(b)}")
    seq = [a[0]] + [r for pair in zip(b, a[1:]) for r in pair]
    df = cold_warm(engine, seq, settings=(True,), label=label, results_root=results_root)
    return float(df.sort_values("req_index")["ttft_s"].iloc[2::2].median())


def first_vs_rest(df: pd.DataFrame) -> float:
    """First request's TTFT ÷ the median of the rest: the cold-over-warm ratio of a cache-on
    run whose engine does not say which requests hit (vLLM without prompt-token details).
    The first is cold only if the server had not seen the prefix before (a fresh server)."""
    t = df.sort_values("req_index")["ttft_s"] if "req_index" in df else df["ttft_s"]
    if len(t) < 2:
        raise ValueError("need at least two requests")
    return float(t.iloc[0] / t.iloc[1:].median())

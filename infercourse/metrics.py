"""Latency and throughput metrics: pure functions over recorded `RequestTrace`s.

Every number a lesson shows is computed here, the same way for every engine, from
arrival times the client stamped. Definitions (all times in seconds):

- TTFT `ttft_s` = first *token* chunk arrival - **scheduled** send time. Measuring from
  the schedule, not the actual send, keeps client-side queueing in the number (the
  coordinated-omission trap). `ttft_from_send_s` is the same from the actual send.
  vLLM `bench serve` measures TTFT from the actual send (after its concurrency
  semaphore) and reports the wait separately as `queue_times`; GuideLLM from
  `request_start`; AIPerf/GenAI-Perf likewise from send, skipping empty first responses.
- E2E `e2e_s` = end of stream - scheduled send time.
- TPOT `tpot_s` = (E2E - TTFT) / (output tokens - 1): the mean decode step a user saw,
  excluding the first token (vLLM's "TPOT (excl. 1st token)"; AIPerf calls this ITL;
  GuideLLM's `time_per_output_token_ms` *includes* the first token: (last - start) / n).
- ITL `itl_s` = gaps between consecutive token chunks, one per gap. A chunk may hold
  several tokens (speculative decoding, server-side batching of SSE), so ITL is per
  *chunk*, not per token (AIPerf: "inter chunk latency"); vLLM pools these gaps too.
  GuideLLM's `inter_token_latency_ms` is a per-request mean, not a gap series.
- decode speed `decode_tok_per_s` = (output tokens - first chunk's tokens) /
  (last token chunk - first token chunk): tokens made after the first arrived, over the
  time they took. Prefill speed `prefill_tok_per_s` = uncached prompt tokens /
  `ttft_from_send_s` (a lower bound: TTFT also holds network, queue and one decode step).
  inference-perf also reports "normalized TPOT" = E2E / output tokens (first token
  included); llama-bench's pp/tg tok/s time the runtime alone, with no HTTP, sampling
  or queue, so they are ceilings for ours, not equals.

Percentiles come with a seeded bootstrap confidence interval (numpy, hand-written: scipy
is not a dependency and the resampling is five lines).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd

from .trace import RequestTrace

__all__ = [
    "ttft_s", "ttft_from_send_s", "e2e_s", "e2e_from_send_s", "dispatch_delay_s",
    "output_tokens", "tpot_s", "itl_s", "tokens_per_chunk", "prefill_tok_per_s",
    "decode_tok_per_s", "FRAME_COLUMNS", "per_request_frame", "itl_frame", "summarize", "throughput",
    "goodput", "error_rate", "SLO_METRICS", "ENGINE_FIELDS", "engine_view", "reconcile",
    "check_identity",
]

PERCENTILES = (50, 90, 95, 99)


# ---- per request -----------------------------------------------------------------------
def _token_chunks(tr: RequestTrace) -> list[int]:
    """Indices of chunks that carried tokens. An empty first chunk (0 tokens) is not a
    token; if no chunk reports a count at all but tokens were produced, the engine does
    not count per chunk, so every chunk with text counts."""
    idx = [i for i, n in enumerate(tr.chunk_tokens) if n > 0]
    if not idx and (tr.completion_tokens or 0) > 0:
        idx = list(range(len(tr.chunk_t)))
    return idx


def _first_token_t(tr: RequestTrace) -> float | None:
    idx = _token_chunks(tr)
    return tr.chunk_t[idx[0]] if idx else None


def ttft_s(tr: RequestTrace) -> float | None:
    """First token chunk arrival - scheduled send time; None if no token arrived."""
    t = _first_token_t(tr)
    return None if t is None else t - tr.scheduled_t


def ttft_from_send_s(tr: RequestTrace) -> float | None:
    """First token chunk arrival - actual send time (what vLLM bench calls TTFT)."""
    t = _first_token_t(tr)
    return None if t is None else t - tr.sent_t


def e2e_s(tr: RequestTrace) -> float | None:
    """End of stream (or error) - scheduled send time."""
    return None if tr.end_t is None else tr.end_t - tr.scheduled_t


def e2e_from_send_s(tr: RequestTrace) -> float | None:
    """End of stream (or error) - actual send time."""
    return None if tr.end_t is None else tr.end_t - tr.sent_t


def dispatch_delay_s(tr: RequestTrace) -> float:
    """Actual send - scheduled send: how far the load generator (or a full client
    connection pool) fell behind the schedule."""
    return tr.sent_t - tr.scheduled_t


def output_tokens(tr: RequestTrace) -> int:
    """Output tokens: the counted usage if any (see `token_source`), else the chunk sum."""
    return int(tr.completion_tokens) if tr.completion_tokens is not None else int(sum(tr.chunk_tokens))


def tpot_s(tr: RequestTrace) -> float | None:
    """(E2E - TTFT) / (output tokens - 1); None with fewer than 2 tokens."""
    n, ttft, e2e = output_tokens(tr), ttft_s(tr), e2e_s(tr)
    if n < 2 or ttft is None or e2e is None:
        return None
    return (e2e - ttft) / (n - 1)


def itl_s(tr: RequestTrace) -> list[float]:
    """Gaps between consecutive token chunks (one per gap, whatever the chunk size)."""
    t = [tr.chunk_t[i] for i in _token_chunks(tr)]
    return [b - a for a, b in zip(t, t[1:])]


def tokens_per_chunk(tr: RequestTrace) -> float | None:
    """Mean tokens per token chunk: 1.0 for plain streaming, more when chunks batch."""
    idx = _token_chunks(tr)
    return output_tokens(tr) / len(idx) if idx else None


def prefill_tok_per_s(tr: RequestTrace) -> float | None:
    """Uncached prompt tokens (prompt - cached) / TTFT from send. Cached tokens are not
    recomputed, so counting them would credit prefill with work it skipped."""
    ttft = ttft_from_send_s(tr)
    if tr.prompt_tokens is None or not ttft or ttft <= 0:
        return None
    return (tr.prompt_tokens - (tr.cached_tokens or 0)) / ttft


def decode_tok_per_s(tr: RequestTrace) -> float | None:
    """(streamed tokens - first chunk's tokens) / (last token chunk - first token chunk);
    None with a single token chunk (no decode interval to measure). Falls back to the
    usage count when chunks carry no token counts."""
    idx = _token_chunks(tr)
    if len(idx) < 2:
        return None
    dt = tr.chunk_t[idx[-1]] - tr.chunk_t[idx[0]]
    first = tr.chunk_tokens[idx[0]] or 1  # a chunk that reports 0 tokens still held one
    # Tokens that arrived inside the interval: the streamed ones. A stop token counted in
    # usage but never streamed was generated after the last chunk, outside it.
    streamed = sum(tr.chunk_tokens[i] for i in idx)
    n = streamed if streamed >= len(idx) else output_tokens(tr)
    return (n - first) / dt if dt > 0 else None


# ---- per run ---------------------------------------------------------------------------
def _nan(x: Any) -> float:
    return float("nan") if x is None else float(x)


FRAME_COLUMNS = [
    "request_id", "status", "error", "finish_reason", "token_source", "scheduled_t", "sent_t",
    "first_token_t", "end_t", "prompt_tokens", "cached_tokens", "output_tokens", "n_chunks",
    "ttft_s", "ttft_from_send_s", "e2e_s", "e2e_from_send_s", "dispatch_delay_s", "tpot_s",
    "itl_mean_s", "itl_max_s", "tokens_per_chunk", "prefill_tok_per_s", "decode_tok_per_s",
    "cached_fraction"]


def per_request_frame(traces: Iterable[RequestTrace]) -> pd.DataFrame:
    """One tidy row per request: identity, status, token counts, every metric, and tags
    (a tag whose name clashes with a column gets a `tag_` prefix)."""
    rows = []
    for tr in traces:
        itl = itl_s(tr)
        first = _first_token_t(tr)
        row: dict[str, Any] = {
            "request_id": tr.request_id, "status": tr.status, "error": tr.error,
            "finish_reason": tr.finish_reason, "token_source": tr.token_source,
            "scheduled_t": tr.scheduled_t, "sent_t": tr.sent_t,
            "first_token_t": _nan(first), "end_t": _nan(tr.end_t),
            "prompt_tokens": _nan(tr.prompt_tokens), "cached_tokens": _nan(tr.cached_tokens),
            "output_tokens": output_tokens(tr), "n_chunks": len(_token_chunks(tr)),
            "ttft_s": _nan(ttft_s(tr)), "ttft_from_send_s": _nan(ttft_from_send_s(tr)),
            "e2e_s": _nan(e2e_s(tr)), "e2e_from_send_s": _nan(e2e_from_send_s(tr)),
            "dispatch_delay_s": dispatch_delay_s(tr), "tpot_s": _nan(tpot_s(tr)),
            "itl_mean_s": float(np.mean(itl)) if itl else math.nan,
            "itl_max_s": float(np.max(itl)) if itl else math.nan,
            "tokens_per_chunk": _nan(tokens_per_chunk(tr)),
            "prefill_tok_per_s": _nan(prefill_tok_per_s(tr)),
            "decode_tok_per_s": _nan(decode_tok_per_s(tr)),
        }
        row["cached_fraction"] = (row["cached_tokens"] / row["prompt_tokens"]
                                  if row["prompt_tokens"] else math.nan)
        for k, v in tr.tags.items():
            row[f"tag_{k}" if k in row else k] = v
        rows.append(row)
    return pd.DataFrame(rows) if rows else pd.DataFrame(columns=FRAME_COLUMNS)


def itl_frame(traces: Iterable[RequestTrace]) -> pd.DataFrame:
    """Every chunk gap as its own row (request_id, status, gap, itl_s, tokens in the
    arriving chunk, t_s since send): the raw series, so tail stalls stay visible.
    Pooled ITL percentiles: `summarize(itl_frame(traces), ["itl_s"])`."""
    rows = []
    for tr in traces:
        idx = _token_chunks(tr)
        for g, (a, b) in enumerate(zip(idx, idx[1:])):
            rows.append({"request_id": tr.request_id, "status": tr.status, "gap": g,
                         "itl_s": tr.chunk_t[b] - tr.chunk_t[a],
                         "tokens": tr.chunk_tokens[b], "t_s": tr.chunk_t[b] - tr.sent_t})
    return pd.DataFrame(rows, columns=["request_id", "status", "gap", "itl_s", "tokens", "t_s"])


def _bootstrap_ci(x: np.ndarray, qs: tuple, n_boot: int, ci: float,
                  rng: np.random.Generator) -> np.ndarray:
    """Percentile bootstrap: resample with replacement, take each quantile, keep the
    central `ci` mass of the resampled quantiles. Shape (len(qs), 2)."""
    per = max(1, 4_000_000 // len(x))      # resample in batches: bounded memory for ITL series
    boot = np.concatenate([
        np.percentile(x[rng.integers(0, len(x), size=(min(per, n_boot - i), len(x)))], qs, axis=1)
        for i in range(0, n_boot, per)], axis=1)          # (len(qs), n_boot)
    lo, hi = 100 * (1 - ci) / 2, 100 * (1 + ci) / 2
    return np.percentile(boot, [lo, hi], axis=1).T


DEFAULT_SUMMARY = ("ttft_s", "ttft_from_send_s", "tpot_s", "itl_mean_s", "e2e_s",
                   "dispatch_delay_s", "prefill_tok_per_s", "decode_tok_per_s")


def summarize(df: pd.DataFrame, metrics: Iterable[str] = DEFAULT_SUMMARY, *,
              ci: float = 0.95, n_boot: int = 1000, seed: int = 0,
              ok_only: bool = True) -> pd.DataFrame:
    """Distributions, not averages: count, mean, min, p50/p90/p95/p99, max per metric,
    with a seeded bootstrap CI for each percentile (`p99_lo`, `p99_hi`...). `itl_mean_s`
    here is a distribution of per-request means; for pooled gaps summarize `itl_frame`.

    Args:
        df: a `per_request_frame` (or any frame with the metric columns).
        metrics: columns to summarize; missing ones are skipped.
        ci: confidence level of the percentile intervals.
        n_boot: bootstrap resamples.
        seed: the same seed gives the same intervals.
        ok_only: drop errored requests first (their latencies measure the failure).
    """
    if ok_only and "status" in df:
        df = df[df["status"] == "ok"]
    rng = np.random.default_rng(seed)
    out = {}
    for m in metrics:
        if m not in df:
            continue
        x = pd.to_numeric(df[m], errors="coerce").dropna().to_numpy(float)
        row: dict[str, float] = {"count": len(x)}
        if len(x):
            row.update(mean=x.mean(), min=x.min(), max=x.max())
            cis = _bootstrap_ci(x, PERCENTILES, n_boot, ci, rng)
            for p, v, (lo, hi) in zip(PERCENTILES, np.percentile(x, PERCENTILES), cis):
                row.update({f"p{p}": v, f"p{p}_lo": lo, f"p{p}_hi": hi})
        out[m] = row
    return pd.DataFrame.from_dict(out, orient="index")


def throughput(df: pd.DataFrame) -> dict[str, float]:
    """Completed requests and output tokens per second over the run's wall window
    (first scheduled send -> last end). Only `ok` requests count as work done; the
    window still spans every request, since failed ones occupied the run too."""
    wall = float(df["end_t"].max() - df["scheduled_t"].min()) if len(df) else math.nan
    ok = df[df["status"] == "ok"] if len(df) else df
    out_tok = float(ok["output_tokens"].sum()) if len(ok) else 0.0
    in_tok = float(ok["prompt_tokens"].fillna(0).sum()) if len(ok) else 0.0
    per = (lambda v: v / wall) if wall and wall > 0 else (lambda v: math.nan)
    return {"wall_s": wall, "requests": len(df), "completed": len(ok),
            "requests_per_s": per(len(ok)), "output_tok_per_s": per(out_tok),
            "total_tok_per_s": per(out_tok + in_tok)}


def error_rate(df: pd.DataFrame) -> float:
    """Fraction of requests whose status is not `ok`."""
    return float((df["status"] != "ok").mean()) if len(df) else math.nan


# Each SLO names a per-request column and a direction: latencies are upper bounds,
# speeds lower bounds. NaN (undefined) counts as met only where it is legitimate.
SLO_METRICS = {
    "ttft_s": "max", "ttft_from_send_s": "max", "e2e_s": "max", "e2e_from_send_s": "max",
    "tpot_s": "max", "itl_mean_s": "max", "itl_max_s": "max", "dispatch_delay_s": "max",
    "decode_tok_per_s": "min", "prefill_tok_per_s": "min",
}
_NAN_OK = {"tpot_s", "itl_mean_s", "itl_max_s", "decode_tok_per_s"}  # undefined < 2 tokens


def goodput(df: pd.DataFrame, slos: Mapping[str, float]) -> dict[str, float]:
    """Requests that met *every* SLO, as a fraction and per second of wall time.

    An errored request never counts. A metric undefined for a 1-token answer (TPOT,
    ITL, decode speed) does not fail it; a request that produced no token fails every
    SLO it cannot be measured on. (vLLM's goodput treats TPOT as 0 for such requests, to the same effect.)

    Args:
        df: a `per_request_frame`.
        slos: metric name -> target, e.g. {"ttft_s": 0.5, "tpot_s": 0.05}; upper bounds
            for latencies, lower bounds for `*_tok_per_s`. See `SLO_METRICS`.
    """
    if not slos:
        raise ValueError("goodput needs at least one SLO, e.g. {'ttft_s': 0.5}")
    good = (df["status"] == "ok").to_numpy()
    for name, target in slos.items():
        if name not in SLO_METRICS:
            raise ValueError(f"unknown SLO metric {name!r}; choose from {sorted(SLO_METRICS)}")
        if not isinstance(target, (int, float)) or isinstance(target, bool) \
                or not math.isfinite(target) or target <= 0:
            raise ValueError(f"SLO {name} must be a positive finite number, got {target!r}")
        x = pd.to_numeric(df[name], errors="coerce").to_numpy(float)
        met = x <= target if SLO_METRICS[name] == "max" else x >= target
        if name in _NAN_OK:  # undefined because only 1 token came: not a failure
            met |= np.isnan(x) & (df["output_tokens"].to_numpy() >= 1)
        if len(df) and not met.any():
            op = "<=" if SLO_METRICS[name] == "max" else ">="
            warnings.warn(f"no request met SLO {name} {op} {target}; goodput is 0", stacklevel=2)
        good = good & met
    wall = throughput(df)["wall_s"]
    n_good = int(good.sum())
    return {"n": len(df), "n_good": n_good,
            "good_fraction": n_good / len(df) if len(df) else math.nan,
            "goodput_requests_per_s": n_good / wall if wall and wall > 0 else math.nan}


# ---- reconciliation with the engine's own counters -------------------------------------
# engine field -> (our quantity, factor to seconds or tokens). Names as each engine emits:
ENGINE_FIELDS: dict[str, tuple[str, float]] = {
    # llama.cpp perf context (llama_perf_context_data), milliseconds
    "t_p_eval_ms": ("prefill_s", 1e-3), "n_p_eval": ("prefill_tokens", 1),
    "t_eval_ms": ("decode_s", 1e-3), "n_eval": ("decode_tokens", 1),
    # llama-server `timings` block, milliseconds
    "prompt_ms": ("prefill_s", 1e-3), "prompt_n": ("prefill_tokens", 1),
    "predicted_ms": ("decode_s", 1e-3), "predicted_n": ("decode_tokens", 1),
    "cache_n": ("cached_tokens", 1),
    # Ollama final chunk, nanoseconds
    "prompt_eval_duration": ("prefill_s", 1e-9), "prompt_eval_count": ("prefill_tokens", 1),
    "eval_duration": ("decode_s", 1e-9), "eval_count": ("decode_tokens", 1),
}


def engine_view(timings: Mapping[str, Any]) -> dict[str, float]:
    """Translate an engine's own timing fields into our quantities (seconds, tokens)."""
    return {ENGINE_FIELDS[k][0]: float(v) * ENGINE_FIELDS[k][1]
            for k, v in timings.items() if k in ENGINE_FIELDS and v is not None}


def reconcile(tr: RequestTrace, *, rtol: float = 0.25, atol_s: float = 0.02,
              token_slack: int = 1) -> pd.DataFrame:
    """Compare what the client measured with what the engine says it did.

    Token counts must agree within `token_slack` (engines differ by one on whether the
    token sampled from the prefill logits is a "decode eval": llama.cpp's `n_eval`
    usually is n-1, llama-server's `predicted_n` is n). Prefill tokens are compared to
    *uncached* prompt tokens. Times agree when |client - engine| <= atol_s + rtol*engine;
    the client side always holds some extra (HTTP, detokenizing), hence the tolerance.
    Returns one row per quantity both sides know: client, engine, ok.
    """
    eng = engine_view(tr.engine_timings)
    idx = _token_chunks(tr)
    n = output_tokens(tr)
    client: dict[str, float | None] = {
        "prefill_tokens": None if tr.prompt_tokens is None
        else tr.prompt_tokens - (eng.get("cached_tokens", tr.cached_tokens) or 0),
        "decode_tokens": n,
        "prefill_s": ttft_from_send_s(tr),
        "decode_s": tr.chunk_t[idx[-1]] - tr.chunk_t[idx[0]] if len(idx) > 1 else None,
    }
    rows = []
    for q, c in client.items():
        if q not in eng or c is None:
            continue
        e = eng[q]
        if q.endswith("tokens"):
            ok = abs(c - e) <= token_slack
        else:
            ok = abs(c - e) <= atol_s + rtol * e
        rows.append({"quantity": q, "client": float(c), "engine": e, "diff": float(c) - e, "ok": ok})
    return pd.DataFrame(rows, columns=["quantity", "client", "engine", "diff", "ok"])


def check_identity(tr: RequestTrace, tpot: float | None = None, *, rtol: float = 0.05,
                   atol_s: float = 0.005) -> dict[str, Any]:
    """Check E2E ~= TTFT + TPOT * (n - 1), with TPOT taken from the token stream alone
    ((last chunk - first chunk) / (n - 1)) unless given (an engine's or another tool's).

    The residual is the time after the last token: a server holding back its final
    usage event, a slow teardown, or a TPOT from elsewhere that does not match.
    """
    n, ttft, e2e, idx = output_tokens(tr), ttft_s(tr), e2e_s(tr), _token_chunks(tr)
    if n < 2 or ttft is None or e2e is None or len(idx) < 2:
        return {"ok": None, "reason": "needs >= 2 tokens in >= 2 chunks"}
    if tpot is None:
        tpot = (tr.chunk_t[idx[-1]] - tr.chunk_t[idx[0]]) / (n - 1)
    rhs = ttft + tpot * (n - 1)
    resid = e2e - rhs
    return {"e2e_s": e2e, "rhs_s": rhs, "residual_s": resid,
            "ok": abs(resid) <= atol_s + rtol * e2e}

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
  GuideLLM's `inter_token_latency_ms` is a per-request mean, not a gap series. The
  per-request frame keeps `itl_mean_s` (a mean per request) and `itl_max_s`; the pooled
  gap series is `itl_frame`, whose percentiles `summary.summarize(..., itl=...)` reports.
- decode speed `decode_tok_per_s` = (output tokens - first chunk's tokens) /
  (last token chunk - first token chunk): tokens made after the first arrived, over the
  time they took. Prefill speed `prefill_tok_per_s` = uncached prompt tokens /
  `ttft_from_send_s` (a lower bound: TTFT also holds network, queue and one decode step).
  inference-perf also reports "normalized TPOT" = E2E / output tokens (first token
  included); llama-bench's pp/tg tok/s time the runtime alone, with no HTTP, sampling
  or queue, so they are ceilings for ours, not equals.

A run's distributions (percentiles, throughput, goodput) are in `summary`; the client's
numbers checked against the engine's own counters in `reconcile`.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np
import pandas as pd

from infercourse.core.trace import RequestTrace

__all__ = [
    "ttft_s", "ttft_from_send_s", "e2e_s", "e2e_from_send_s", "dispatch_delay_s",
    "output_tokens", "tpot_s", "itl_s", "tokens_per_chunk", "prefill_tok_per_s",
    "decode_tok_per_s", "FRAME_COLUMNS", "per_request_frame", "itl_frame", "token_chunks",
]


# ---- per request -----------------------------------------------------------------------
def token_chunks(tr: RequestTrace) -> list[int]:
    """Indices of chunks that carried tokens. An empty first chunk (0 tokens) is not a
    token; if no chunk reports a count at all but tokens were produced, the engine does
    not count per chunk, so every chunk with text counts."""
    idx = [i for i, n in enumerate(tr.chunk_tokens) if n > 0]
    if not idx and (tr.completion_tokens or 0) > 0:
        idx = list(range(len(tr.chunk_t)))
    return idx


def _first_token_t(tr: RequestTrace) -> float | None:
    idx = token_chunks(tr)
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
    t = [tr.chunk_t[i] for i in token_chunks(tr)]
    return [b - a for a, b in zip(t, t[1:])]


def tokens_per_chunk(tr: RequestTrace) -> float | None:
    """Mean tokens per token chunk: 1.0 for plain streaming, more when chunks batch."""
    idx = token_chunks(tr)
    return output_tokens(tr) / len(idx) if idx else None


def prefill_tok_per_s(tr: RequestTrace) -> float | None:
    """Uncached prompt tokens (prompt - cached) / TTFT from send. Cached tokens are not
    recomputed, so counting them would credit prefill with work it skipped. None when
    nothing was prefilled (the whole prompt came from the cache): a speed of no work is
    undefined, and a 0.0 would drag every median down."""
    ttft = ttft_from_send_s(tr)
    if tr.prompt_tokens is None or not ttft or ttft <= 0:
        return None
    uncached = tr.prompt_tokens - (tr.cached_tokens or 0)
    return uncached / ttft if uncached > 0 else None


def decode_tok_per_s(tr: RequestTrace) -> float | None:
    """(streamed tokens - first chunk's tokens) / (last token chunk - first token chunk);
    None with a single token chunk (no decode interval to measure). Falls back to the
    usage count when chunks carry no token counts."""
    idx = token_chunks(tr)
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
            "output_tokens": output_tokens(tr), "n_chunks": len(token_chunks(tr)),
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
        idx = token_chunks(tr)
        for g, (a, b) in enumerate(zip(idx, idx[1:])):
            rows.append({"request_id": tr.request_id, "status": tr.status, "gap": g,
                         "itl_s": tr.chunk_t[b] - tr.chunk_t[a],
                         "tokens": tr.chunk_tokens[b], "t_s": tr.chunk_t[b] - tr.sent_t})
    return pd.DataFrame(rows, columns=["request_id", "status", "gap", "itl_s", "tokens", "t_s"])

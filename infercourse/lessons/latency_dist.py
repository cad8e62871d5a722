"""Many requests: distributions, the tail, and what each tool's names mean.

A distribution is summarized by percentiles, not an average: a mean hides the tail a user
at p99 lives in. Percentiles from few samples are uncertain; `core.summary` gives them
distribution-free intervals, or says the sample is too small (`distribution_table`).

Those intervals assume independent samples. Pooled token gaps are not: a stall slows
several consecutive gaps of one request. `pooled_tail_by_blocks` resamples the same gaps
twice, one by one and whole requests at a time, so that the two intervals differ only in
whether a request's gaps stay together (`pooled_tail_note` says which to trust).

Peer tools name different quantities alike (`peer_table`): GuideLLM's TPOT includes the
first token, vLLM pools every chunk gap into one ITL series, and a chunk is not a token
(`rechunk` shows the same run as a server that flushes k tokens per chunk would stream it).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from infercourse.core import metrics, summary
from infercourse.core.trace import RequestTrace

__all__ = ["distribution_table", "pooled_tail_by_blocks", "pooled_tail_note", "peer_table", "rechunk",
           "chunking_table"]


def distribution_table(df: pd.DataFrame, itl: pd.DataFrame, ci: float = 0.95) -> pd.DataFrame:
    """Mean beside p50/p95/p99 (ms), each percentile with its interval or "n too small".

    Args:
        df: a per-request frame; itl: its `itl_frame` (pooled gaps).
        ci: confidence level of the intervals.
    """
    s = summary.summarize(df, ["ttft_s", "tpot_s", "e2e_s"], ci=ci, itl=itl)

    def cell(m: str, p: int) -> str:
        v, lo, hi = (s.loc[m, f"p{p}{x}"] * 1e3 for x in ("", "_lo", "_hi"))
        if np.isnan(lo):
            return f"{_ms(v)} (n too small: need {summary.min_n(p / 100, ci)})"
        return f"{_ms(v)} [{_ms(lo)}, {_ms(hi)}]"
    return pd.DataFrame({"n": s["count"].astype(int), "mean (ms)": (s["mean"] * 1e3).round(1),
                         **{f"p{p} (ms)": [cell(m, p) for m in s.index] for p in (50, 95, 99)}}, index=s.index)


def _ms(v: float) -> str:
    """Milliseconds in one fixed-point style (no 1.094e+04 beside 412.3): 2 decimals under
    10 ms, 1 under 1,000, none above, with thousands separators."""
    return "nan" if np.isnan(v) else f"{v:,.2f}" if abs(v) < 10 else f"{v:,.1f}" if abs(v) < 1000 else f"{v:,.0f}"


def pooled_tail_by_blocks(itl: pd.DataFrame, q: float = 99, *, ci: float = 0.95, n_boot: int = 2000,
                          seed: int = 0) -> dict[str, float]:
    """The pooled ITL q-th percentile, resampled two ways that differ in one thing only.

    A stall (the OS preempting the server, a neighbour's burst) slows several consecutive
    gaps of one request, so slow gaps can come in bursts, and then the effective sample is
    nearer the number of requests than the number of gaps. The same percentile bootstrap is
    run twice, with the same resample count and seed: drawing gaps one by one (`iid_lo`,
    `iid_hi`: as if independent) and drawing whole requests (`lo`, `hi`: one block per
    request, bursts kept together). Both share a bootstrap's limits (a resampled p99 never
    passes the largest gap seen), so the ratio of their widths measures the bursts and
    nothing else.

    Args:
        itl: an `itl_frame` (ok requests are used).
        q: the percentile; ci: confidence level; n_boot, seed: resamples and their seed.
    """
    ok = itl[itl["status"] == "ok"]
    blocks = [g["itl_s"].to_numpy(float) for _, g in ok.groupby("request_id")]
    nan = float("nan")
    if len(blocks) < 2:
        return {"p": nan, "lo": nan, "hi": nan, "iid_lo": nan, "iid_hi": nan, "blocks": len(blocks)}
    gaps, a = np.concatenate(blocks), (1 - ci) / 2
    rng = np.random.default_rng(seed)
    by_block = [np.percentile(np.concatenate([blocks[i] for i in rng.integers(0, len(blocks), len(blocks))]), q)
                for _ in range(n_boot)]
    rng = np.random.default_rng(seed)
    by_gap = [np.percentile(gaps[rng.integers(0, len(gaps), len(gaps))], q) for _ in range(n_boot)]
    return {"p": float(np.percentile(gaps, q)), "lo": float(np.quantile(by_block, a)),
            "hi": float(np.quantile(by_block, 1 - a)), "iid_lo": float(np.quantile(by_gap, a)),
            "iid_hi": float(np.quantile(by_gap, 1 - a)), "blocks": len(blocks)}


WIDER = 1.25     # block / gap-by-gap width from which keeping requests together counts as wider, not jitter


def pooled_tail_note(itl: pd.DataFrame, ci: float = 0.95) -> str:
    """One sentence on the pooled ITL p99's interval: the order-statistic one (distribution-
    free, if the gaps were independent); how many requests the gaps at or above the p99
    came from (a count); then the two bootstraps of `pooled_tail_by_blocks` side by side,
    like with like. The block interval at least `WIDER` times as wide says the bursts cost
    precision (trust it); otherwise treating the gaps as independent overstated nothing
    here. Below `summary.min_n` gaps no interval is offered."""
    ok = itl[itl["status"] == "ok"]
    need, n = summary.min_n(0.99, ci), len(ok)
    if n < need:
        return (f"{n} pooled gaps: too few for a p99 interval (need {need}) even if they were independent, and they "
                "may not be: a stall slows several gaps of one request, so the effective sample can be nearer the "
                f"number of requests ({ok['request_id'].nunique()}).")
    row = summary.summarize(ok.assign(status="ok"), [], itl=ok, ci=ci).loc["itl_s"]
    b = pooled_tail_by_blocks(ok, 99, ci=ci)
    slow = ok[ok["itl_s"] >= b["p"]]

    def iv(lo: float, hi: float) -> str:
        return f"[{_ms(lo * 1e3)}, {_ms(hi * 1e3)}]"
    head = (f"p99 {_ms(row['p99'] * 1e3)} ms, {iv(row['p99_lo'], row['p99_hi'])} if the {n} gaps were independent "
            f"(order statistics); the {len(slow)} gaps at or above it came from {slow['request_id'].nunique()} of "
            f"the {b['blocks']} requests. The same bootstrap twice: drawing gaps one by one, "
            f"{iv(b['iid_lo'], b['iid_hi'])}; drawing whole requests, {iv(b['lo'], b['hi'])}")
    w_gap, w_block = b["iid_hi"] - b["iid_lo"], b["hi"] - b["lo"]
    if w_gap <= 0:
        return head + ": the gap-by-gap resamples all gave one value, so there is no width to compare."
    r = w_block / w_gap
    if r >= WIDER:
        return head + (f", {r:.1f}× as wide: keeping each request's gaps together widens it, so the slow gaps came "
                       "in bursts that cost precision; trust the block interval.")
    return head + (f", {r:.2f}× as wide (under {WIDER:g}×): keeping each request's gaps together did not widen it, "
                   "so for this p99 treating the gaps as independent overstated nothing.")


def _p(x, q) -> float:
    x = pd.Series(x, dtype=float).dropna()
    return float(np.percentile(x, q)) * 1e3 if len(x) else float("nan")


def peer_table(df: pd.DataFrame, itl: pd.DataFrame, q: float = 50) -> pd.DataFrame:
    """One run, each tool's definitions side by side (ms, percentile `q` of each series).

    - infercourse: TTFT from the *scheduled* send; TPOT = (E2E - TTFT)/(n - 1); ITL pooled chunk gaps.
    - vLLM `bench serve`: TTFT from the actual send; TPOT excludes the first token; ITL pooled gaps.
    - GuideLLM: TTFT from request start (= send); TPOT = (last token - start) / n, first
      token *included*; ITL = (last - first) / (n - 1), one mean per request.
    - AIPerf / GenAI-Perf: TTFT from send; "ITL" = (E2E - TTFT)/(n - 1) (our TPOT); per-chunk
      gaps are their "inter chunk latency".

    Args:
        df: a per-request frame (ok requests are used); itl: its `itl_frame`.
        q: the percentile shown.
    """
    ok = df[df["status"] == "ok"]
    gaps = itl[itl["status"] == "ok"]["itl_s"]
    n = ok["output_tokens"].astype(float)
    excl_first = (ok["e2e_from_send_s"] - ok["ttft_from_send_s"]) / (n - 1)   # per request
    incl_first = ok["e2e_from_send_s"] / n            # the stream ends with its last token
    tools = {
        "infercourse": (ok["ttft_s"], ok["tpot_s"], gaps, ok["e2e_s"]),
        "vLLM bench serve": (ok["ttft_from_send_s"], excl_first, gaps, ok["e2e_from_send_s"]),
        "GuideLLM": (ok["ttft_from_send_s"], incl_first, excl_first, ok["e2e_from_send_s"]),
        "AIPerf": (ok["ttft_from_send_s"], excl_first, excl_first, ok["e2e_from_send_s"]),
    }
    names = ["TTFT", "TPOT", "ITL", "E2E"]
    return pd.DataFrame({tool: [_p(x, q) for x in series] for tool, series in tools.items()},
                        index=[f"{m} p{q:g} (ms)" for m in names]).round(1)


def rechunk(traces: list[RequestTrace], k: int) -> list[RequestTrace]:
    """The same tokens at the same times, delivered as a server flushing every `k` tokens
    would: each chunk arrives with its last token. Nothing is re-measured; only the
    grouping changes, which is what a chunk-based metric sees."""
    out = []
    for tr in traces:
        idx = metrics.token_chunks(tr)
        t = [tr.chunk_t[i] for i in idx for _ in range(max(1, tr.chunk_tokens[i]))]
        groups = [t[i:i + k] for i in range(0, len(t), k)]
        out.append(replace(tr, chunk_t=[g[-1] for g in groups], chunk_tokens=[len(g) for g in groups]))
    return out


def chunking_table(traces: list[RequestTrace], k: int) -> pd.DataFrame:
    """The run as streamed beside the same run re-grouped `k` tokens per chunk (`rechunk`):
    per-chunk ITL grows about k-fold; TTFT grows by k - 1 token gaps (the first chunk waits
    for its k-th token), so TPOT, which spreads the time after the first chunk over n - 1
    tokens, falls; E2E and decode speed (tokens after the first chunk / their time) hold."""
    cols = {}
    for name, trs in (("as streamed", traces), (f"{k} tokens per chunk", rechunk(traces, k))):
        df, itl = metrics.per_request_frame(trs), metrics.itl_frame(trs)
        ok = df[df["status"] == "ok"]
        cols[name] = {"tokens per chunk": ok["tokens_per_chunk"].median(), "TTFT p50 (ms)": _p(ok["ttft_s"], 50),
                      "ITL p50, per chunk (ms)": _p(itl["itl_s"], 50),
                      "ITL p50 / tokens in chunk (ms)": _p(itl["itl_s"] / itl["tokens"].clip(lower=1), 50),
                      "TPOT p50 (ms)": _p(ok["tpot_s"], 50), "E2E p50 (ms)": _p(ok["e2e_s"], 50),
                      "decode p50 (tok/s)": ok["decode_tok_per_s"].median()}
    return pd.DataFrame(cols).round(2)

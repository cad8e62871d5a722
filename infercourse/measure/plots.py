"""The course's standard plots. Each takes a DataFrame (or a trace) and returns an Axes.

Every axis says its unit; latencies are drawn in milliseconds. Pass `ax=` to draw into
a figure of your own (subplots side by side); otherwise a new figure is made.
Percentile plots use distributions, not means: a p99 is what one user in a hundred sees.
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np
import pandas as pd

from infercourse.core import metrics
from infercourse.core.trace import RequestTrace

__all__ = ["token_timeline", "ttft_vs_prompt", "decode_vs_context", "latency_cdf",
           "throughput_vs_latency", "cache_hit_vs_ttft", "quant_tradeoff", "timeseries"]

MS = 1000.0


def _ax(ax):
    if ax is None:
        import matplotlib.pyplot as plt  # lazy: importing pyplot picks a backend
        _, ax = plt.subplots(figsize=(6.4, 4.0))
    return ax


def _name(metric: str) -> str:
    """`ttft_from_send_s` -> `TTFT from send`, for axis labels (the unit is added apart)."""
    words = metric.removesuffix("_s").split("_")
    return " ".join(w.upper() if w in ("ttft", "tpot", "itl", "e2e") else w for w in words)


def _groups(df: pd.DataFrame, by: str | None):
    return [(None, df)] if by is None else list(df.groupby(by, sort=True))


def token_timeline(trace: RequestTrace, ax=None):
    """Cumulative tokens vs time since send for one request: a long flat prefill gap
    (TTFT), then the decode staircase, one step per chunk."""
    ax = _ax(ax)
    idx = [i for i, n in enumerate(trace.chunk_tokens) if n > 0] or list(range(len(trace.chunk_t)))
    t = [0.0] + [(trace.chunk_t[i] - trace.sent_t) * MS for i in idx]
    y = np.cumsum([0] + [trace.chunk_tokens[i] or 1 for i in idx])
    ax.step(t, y, where="post", marker="o", ms=3, label="tokens received")
    if trace.scheduled_t < trace.sent_t:
        ax.axvline((trace.scheduled_t - trace.sent_t) * MS, ls=":", c="gray", label="scheduled")
    ttft = metrics.ttft_from_send_s(trace)
    if ttft is not None:
        ax.axvspan(0, ttft * MS, alpha=0.15, color="tab:orange", label="prefill (TTFT)")
    ax.set(xlabel="time since send (ms)", ylabel="cumulative output tokens",
           title=f"Token arrivals, request {trace.request_id}")
    ax.legend(loc="upper left")
    return ax


def ttft_vs_prompt(df: pd.DataFrame, by: str | None = None, ax=None, log: bool = False):
    """TTFT against prompt length: prefill work grows with the prompt."""
    ax = _ax(ax)
    for key, g in _groups(df.dropna(subset=["prompt_tokens", "ttft_s"]), by):
        ax.scatter(g["prompt_tokens"], g["ttft_s"] * MS, s=14, label=None if key is None else str(key))
    if log:
        ax.set_xscale("log"); ax.set_yscale("log")
    ax.set(xlabel="prompt length (tokens)", ylabel="TTFT (ms)", title="Time to first token vs prompt length")
    if by:
        ax.legend(title=by)
    return ax


def decode_vs_context(df: pd.DataFrame, x: str = "prompt_tokens",
                      ceiling_tok_per_s: float | Callable[[np.ndarray], np.ndarray] | None = None,
                      by: str | None = None, ax=None):
    """Decode speed against context length, with an optional roofline ceiling: a number
    (tok/s) or a function of context length (e.g. bandwidth / bytes read per token)."""
    ax = _ax(ax)
    d = df.dropna(subset=[x, "decode_tok_per_s"])
    for key, g in _groups(d, by):
        ax.scatter(g[x], g["decode_tok_per_s"], s=14, label=None if key is None else str(key))
    if ceiling_tok_per_s is not None:
        xs = np.linspace(0, max(1.0, float(d[x].max()) if len(d) else 1.0) * 1.05, 100)
        ys = (ceiling_tok_per_s(xs) if callable(ceiling_tok_per_s)
              else np.full_like(xs, float(ceiling_tok_per_s)))
        ax.plot(xs, ys, "k--", label="ceiling (roofline)")
    ax.set(xlabel="context length (tokens)", ylabel="decode speed (tok/s)",
           title="Decode speed vs context length")
    ax.set_ylim(bottom=0)   # speeds compared to a ceiling: keep zero in view
    if by or ceiling_tok_per_s is not None:
        ax.legend()
    return ax


def latency_cdf(df: pd.DataFrame, metric: str = "ttft_s", by: str | None = None, ax=None,
                log: bool = True, percentiles: Iterable[float] = (50, 90, 99)):
    """Empirical CDF of a latency per group, with p50/p90/p99 marked. A CDF shows the
    whole distribution, so a fat tail cannot hide behind a good mean."""
    ax = _ax(ax)
    ok = df[df["status"] == "ok"] if "status" in df else df
    for key, g in _groups(ok.dropna(subset=[metric]), by):
        x = np.sort(g[metric].to_numpy(float)) * MS
        line, = ax.plot(x, np.arange(1, len(x) + 1) / len(x), drawstyle="steps-post",
                        label=None if key is None else str(key))
        for p in percentiles:
            ax.plot(np.percentile(x, p), p / 100, "o", c=line.get_color(), ms=4)
    if log:
        ax.set_xscale("log")
    marks = "/".join(f"p{p:g}" for p in percentiles)
    ax.set(xlabel=f"{_name(metric)} (ms)", ylabel="fraction of requests",
           title=f"{_name(metric)} distribution (dots: {marks})", ylim=(0, 1.02))
    if by:
        ax.legend(title=by)
    return ax


def throughput_vs_latency(runs: pd.DataFrame, x: str = "output_tok_per_s",
                          y: str = "ttft_s_p99", label: str | None = None, ax=None):
    """One point per run (e.g. per concurrency level), joined in order: throughput rises
    until the server saturates, then only latency does.

    Args:
        runs: `results.compare()` output, ordered by load.
        x: a throughput column; y: a latency column in seconds (drawn in ms).
        label: column naming each point (default: the index, the run label).
    """
    ax = _ax(ax)
    ys = runs[y] * MS          # `y` is a latency column in seconds, e.g. ttft_s_p99
    ax.plot(runs[x], ys, "o-")
    names = runs[label] if label else runs.index
    for xi, yi, n in zip(runs[x], ys, names):
        ax.annotate(str(n), (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set(xlabel="output throughput (tok/s)", ylabel=f"{_name(y.replace('_s_', '_'))} (ms)",
           title="Throughput vs latency")
    return ax


def cache_hit_vs_ttft(df: pd.DataFrame, ax=None):
    """TTFT against the fraction of the prompt served from the prefix cache."""
    ax = _ax(ax)
    d = df.dropna(subset=["cached_fraction", "ttft_s"])
    ax.scatter(d["cached_fraction"] * 100, d["ttft_s"] * MS, s=14)
    ax.set(xlabel="prompt served from cache (%)", ylabel="TTFT (ms)",
           title="Prefix cache hits vs time to first token", xlim=(-5, 105))
    return ax


def quant_tradeoff(df: pd.DataFrame, size: str = "size_gb", speed: str = "decode_tok_per_s",
                   quality: str = "perplexity", label: str = "quant", ax=None):
    """Quantization trade-off: file size vs decode speed, colored by perplexity, one
    labeled point per quantization."""
    ax = _ax(ax)
    sc = ax.scatter(df[size], df[speed], c=df[quality], cmap="viridis_r", s=40)
    for _, r in df.iterrows():
        ax.annotate(str(r[label]), (r[size], r[speed]), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
    ax.figure.colorbar(sc, ax=ax, label=f"{quality} (lower is better)")
    ax.set(xlabel="model file size (GB)", ylabel="decode speed (tok/s)",
           title="Quantization: size vs speed vs quality")
    return ax


def timeseries(df: pd.DataFrame, metric: str = "e2e_s", memory: pd.DataFrame | None = None,
               ax=None):
    """A long run over time: per-request latency at its scheduled time, errors as red
    crosses on the axis, and optionally memory (`t_s`, `rss_gb` columns, on a second axis)."""
    ax = _ax(ax)
    t0 = float(df["scheduled_t"].min())
    ok = df[df["status"] == "ok"]
    ax.plot(ok["scheduled_t"] - t0, ok[metric] * MS, ".", ms=4, label=_name(metric))
    err = df[df["status"] != "ok"]
    if len(err):
        ax.plot(err["scheduled_t"] - t0, np.zeros(len(err)), "x", c="red", label="errors")
    ax.set(xlabel="time into run (s)", ylabel=f"{_name(metric)} (ms)",
           title="Latency over the run")
    if memory is not None:
        ax2 = ax.twinx()
        ax2.plot(memory["t_s"], memory["rss_gb"], c="gray", lw=1, label="memory")
        ax2.set_ylabel("memory (GB)")
    ax.legend(loc="upper left")
    return ax



def engine_speeds(df: pd.DataFrame, ceiling: float | None = None, ax=None):
    """Decode tok/s per engine (one bar each, engines that could not run left out), with
    the bandwidth ceiling as a dashed line when given."""
    ax = _ax(ax)
    ok = df[df["ok"]] if "ok" in df else df
    ax.barh(list(map(str, ok.index)), ok["decode_tok_per_s"], color="tab:blue")
    if ceiling is not None:
        ax.axvline(ceiling, ls="--", color="tab:red", label=f"bandwidth ceiling {ceiling:.0f} tok/s")
        ax.legend(loc="lower right")
    ax.set_xlabel("decode speed (tok/s)")
    ax.set_title("Same model, same prompt: decode speed per engine")
    return ax

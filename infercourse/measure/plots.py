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
           "throughput_vs_latency", "cache_hit_vs_ttft", "quant_tradeoff", "timeseries",
           "engine_speeds", "latency_anatomy", "mean_vs_percentiles", "schedule_vs_send",
           "client_vs_server"]

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


# ---- notebook 10: what "fast" means ------------------------------------------------------
def latency_anatomy(trace: RequestTrace, ax=None):
    """One request's metrics drawn on its token timeline (ms since the scheduled send):
    TTFT as the shaded wait, one ITL gap, TPOT as the slope of the decode line, E2E."""
    ax = _ax(ax)
    idx = metrics.token_chunks(trace)
    t = np.array([(trace.chunk_t[i] - trace.scheduled_t) * MS for i in idx])
    y = np.cumsum([trace.chunk_tokens[i] or 1 for i in idx])
    ax.step(np.r_[0.0, t], np.r_[0, y], where="post", lw=1.2, label="tokens received")
    ttft, e2e, tpot = metrics.ttft_s(trace), metrics.e2e_s(trace), metrics.tpot_s(trace)
    ax.axvspan(0, ttft * MS, alpha=0.15, color="tab:orange", label=f"TTFT {ttft * MS:.0f} ms")
    if tpot:
        ax.plot([t[0], e2e * MS], [y[0], y[-1]], "k--", lw=1,
                label=f"TPOT {tpot * MS:.1f} ms/token (slope)")
    if len(t) > 2:
        g = int(np.argmax(np.diff(t)))
        ax.annotate("", (t[g + 1], y[g]), (t[g], y[g]), arrowprops={"arrowstyle": "<->", "color": "tab:red"})
        ax.text(t[g + 1], y[g], f" longest ITL {t[g + 1] - t[g]:.1f} ms", color="tab:red", va="top", fontsize=8)
    ax.axvline(e2e * MS, c="gray", ls=":", label=f"E2E {e2e * MS:.0f} ms")
    ax.set(xlabel="time since scheduled send (ms)", ylabel="cumulative output tokens",
           title=f"Anatomy of request {trace.request_id}")
    ax.set_xlim(left=0)
    ax.legend(loc="upper left", fontsize=8)
    return ax


def mean_vs_percentiles(values, label: str = "ITL", ax=None, bins: int = 40):
    """Histogram of a latency (ms, log-spaced bins) with the mean and p50/p95/p99 drawn:
    where the mean falls against the median and the tail."""
    ax = _ax(ax)
    x = np.asarray(pd.Series(values, dtype=float).dropna()) * MS
    x = x[x > 0]
    ax.hist(x, bins=np.geomspace(x.min(), x.max(), bins), color="lightsteelblue")
    ax.set_xscale("log")
    marks = {"mean": (x.mean(), "k", "-"), "p50": (np.percentile(x, 50), "tab:green", "--"),
             "p95": (np.percentile(x, 95), "tab:orange", "--"), "p99": (np.percentile(x, 99), "tab:red", "--")}
    for name, (v, c, ls) in marks.items():
        ax.axvline(v, c=c, ls=ls, label=f"{name} {v:.1f} ms")
    ax.set(xlabel=f"{label} (ms, log scale)", ylabel="count", title=f"{label}: {len(x)} samples")
    ax.legend(fontsize=8)
    return ax


def schedule_vs_send(df: pd.DataFrame, metric: str = "ttft", reference_s: float | None = None,
                     ax=None, title: str | None = None):
    """Per request, in schedule order: latency from the scheduled send vs from the actual
    send (ms). The gap between the two is the wait a send-clocked tool never sees.

    Args:
        df: a per-request frame of an open-loop run.
        metric: "ttft" or "e2e" (uses `<metric>_s` and `<metric>_from_send_s`).
        reference_s: a reference latency drawn flat (e.g. the unloaded p50).
    """
    ax = _ax(ax)
    d = df[df["status"] == "ok"].sort_values("scheduled_t")
    i = np.arange(len(d))
    ax.plot(i, d[f"{metric}_s"] * MS, "o-", label="from scheduled send (what the user waits)")
    ax.plot(i, d[f"{metric}_from_send_s"] * MS, "s--", label="from actual send")
    if reference_s is not None:
        ax.axhline(reference_s * MS, c="gray", ls=":", label=f"unloaded p50 {reference_s * MS:.0f} ms")
    ax.set(xlabel="request (in schedule order)", ylabel=f"{metric.upper()} (ms)",
           title=title or f"{metric.upper()}: scheduled vs actual send")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return ax


def client_vs_server(rec: pd.DataFrame, ax=None):
    """Client-measured vs server-reported time per request (ms), one colour per quantity
    (`reconcile.reconcile` rows, concatenated), with the y = x line where they agree."""
    ax = _ax(ax)
    d = rec[rec["quantity"].str.endswith("_s")]
    for q, g in d.groupby("quantity"):
        ax.scatter(g["engine"] * MS, g["client"] * MS, s=14, label=q.removesuffix("_s"))
    hi = float(max(d["client"].max(), d["engine"].max())) * MS * 1.05 if len(d) else 1.0
    ax.plot([0, hi], [0, hi], "k--", lw=1, label="client = server")
    ax.set(xlabel="server's own timing (ms)", ylabel="client's clock (ms)",
           title="Client vs server timings", xlim=(0, hi), ylim=(0, hi))
    ax.legend(fontsize=8)
    return ax

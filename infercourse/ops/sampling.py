"""Watching a server over time: what it holds (RAM, KV cache, queue), sampled at a fixed rate.

A latency percentile says how requests went; a time series says how the *server* went.
A soak (notebook 15) needs both, because the failures of long runs are slow: resident
memory that creeps up a few MiB an hour until the OOM killer strikes on day three, a
queue that grows because a slot leaks, a KV cache that fills as agent contexts grow.

`ServerSampler` (from `measure.server_samples`, which bench uses for every run) wakes every
`interval_s` and appends one row to `samples.jsonl`
(flushed and fsynced, so a crash keeps every sample taken):

- `rss_mib`: resident memory of the server process and its children (psutil; vLLM forks
  workers, and the watchdog's child is the server itself);
- llama-server's Prometheus gauges and counters from `/metrics` (`requests_processing`,
  `requests_deferred`, prompt/predicted token counters; cached prompt tokens);
- `kv_used_frac`: tokens held in the slots' KV cache over their total context, from
  `/slots` (this llama-server build exports no KV-usage gauge; vLLM's
  `vllm:kv_cache_usage_perc` is read when present);
- GPU memory, utilisation and power when an NVIDIA GPU is present (`hardware.gpu_stats`).

`drift` turns the RSS series into a slope with a confidence interval: the one number a
memory-leak claim needs; `soak_summary` puts it beside the requests' and restarts' numbers.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from infercourse.core import summary
# the sampler itself lives in measure (bench samples every run with it); re-exported here
from infercourse.measure.server_samples import (SAMPLES, ServerSampler, load_samples, process_rss_mib,
                                                prometheus_values, slots_usage)

__all__ = ["headline", "prometheus_values", "slots_usage", "process_rss_mib", "ServerSampler", "drift",
           "load_samples", "soak_summary", "SAMPLES"]


def drift(t_s, y, *, ci: float = 0.95, n_boot: int = 1000, seed: int = 0,
          skip_frac: float = 0.2) -> dict[str, float]:
    """Least-squares slope of `y` over time, with a moving-block bootstrap interval.

    Successive samples of a server's memory are correlated (the heap grows in steps), so
    the textbook OLS interval, which assumes independent residuals, is too narrow.
    Resampling whole blocks of consecutive samples keeps that correlation. The first
    `skip_frac` of the series is dropped: caches and allocator arenas fill at the start,
    which is warm-up, not a leak.

    Args:
        t_s: sample times (seconds).
        y: the series (e.g. RSS in MiB).
        ci: confidence level of the interval.
        n_boot: bootstrap resamples.
        seed: the same seed gives the same interval.
        skip_frac: leading fraction of the series excluded as warm-up.

    Returns slope per second and per hour with its interval, and the samples used.
    """
    t, v = np.asarray(t_s, float), np.asarray(y, float)
    ok = np.isfinite(t) & np.isfinite(v)
    t, v = t[ok], v[ok]
    t, v = t[int(len(t) * skip_frac):], v[int(len(v) * skip_frac):]
    n = len(t)
    nan = {"slope_per_s": math.nan, "lo_per_s": math.nan, "hi_per_s": math.nan,
           "slope_per_h": math.nan, "lo_per_h": math.nan, "hi_per_h": math.nan, "n": n, "span_s": math.nan}
    if n < 4 or np.ptp(t) <= 0:
        return nan
    slope = float(np.polyfit(t, v, 1)[0])
    block = max(2, int(round(n ** (1 / 3))))           # the usual n^(1/3) block length
    rng, starts = np.random.default_rng(seed), np.arange(n - block + 1)
    k = math.ceil(n / block)
    boots = []
    for _ in range(n_boot):
        idx = (rng.choice(starts, k)[:, None] + np.arange(block)).ravel()[:n]
        tb, vb = t[idx], v[idx]
        if np.ptp(tb) > 0:
            boots.append(np.polyfit(tb, vb, 1)[0])
    lo, hi = np.percentile(boots, [100 * (1 - ci) / 2, 100 * (1 + ci) / 2])
    return {"slope_per_s": slope, "lo_per_s": float(lo), "hi_per_s": float(hi),
            "slope_per_h": slope * 3600, "lo_per_h": float(lo) * 3600, "hi_per_h": float(hi) * 3600,
            "n": n, "span_s": float(np.ptp(t))}


def unplanned_crashes(events: list[dict]) -> int:
    """Crashes of a server the soak's own crash drill did not kill (a drill's kill is logged
    as `drill_kill` with the pid it killed, then as a crash of that pid)."""
    drilled = {e.get("pid") for e in events if e["event"] == "drill_kill"}
    return sum(e["event"] == "crash" and e.get("pid") not in drilled for e in events)


def soak_summary(df: pd.DataFrame, samples: pd.DataFrame, events: list[dict],
                 duration_s: float) -> dict[str, Any]:
    """The soak's headline numbers: requests, error rate, restarts, uptime, latency
    percentiles, prompt-cache hit rate, peak KV use and queue, and RSS drift (MiB/h, with
    its interval) over the longest stretch one server process lived.

    Args:
        df: per-request frame; samples: `load_samples`; events: the supervisor's events.
        duration_s: the soak's planned duration.
    """
    crashes = sum(e["event"] == "crash" for e in events)
    drill = [e["t_s"] for e in events if e["event"] == "drill_kill"]
    unplanned = unplanned_crashes(events)
    out: dict[str, Any] = {"duration_s": duration_s, "requests": len(df), "crashes": crashes,
                           "crashes_unplanned": unplanned, "drill_kills": len(drill),
                           "restarts": sum(e["event"] == "restart" for e in events),
                           "downtime_s": float(sum(e.get("took_s", 0) for e in events if e["event"] == "restart")),
                           # the guide's three: crashes per hour of soak (the drill's planned kill is
                           # not one), failed requests, time serving
                           "crash_rate_per_h": unplanned / (duration_s / 3600) if duration_s else float("nan"),
                           # when a crash drill fired (soak clock, s); NaN: it did not fire inside the soak
                           "drill_at_s": float(drill[0]) if drill else float("nan")}
    # a request cut off by the soak's end is not a server error; count it apart
    cut = df["status"].eq("incomplete") if len(df) else pd.Series(dtype=bool)
    out["incomplete_at_end"] = int(cut.sum())
    out["error_rate"] = summary.error_rate(df[~cut]) if len(df[~cut]) else float("nan")
    out["error_rate_pct"] = 100 * out["error_rate"]
    out.update({k: v for k, v in summary.throughput(df).items() if k in ("requests_per_s", "output_tok_per_s")}
               if len(df) else {})
    ok = df[df["status"] == "ok"] if len(df) else df
    if len(ok):
        for m in ("ttft_s", "e2e_s"):
            out[f"{m}_p50"], out[f"{m}_p95"] = (float(np.nanpercentile(ok[m], q)) for q in (50, 95))
        prompt = ok["prompt_tokens"].sum()
        out["cache_hit_rate"] = float(ok["cached_tokens"].fillna(0).sum() / prompt) if prompt else float("nan")
    if len(samples) and "up" in samples:
        out["uptime_frac"] = float(samples["up"].fillna(False).astype(bool).mean())
        out["uptime_pct"] = 100 * out["uptime_frac"]
    for col, name in (("kv_used_frac", "kv_used_frac_max"), ("llamacpp:requests_deferred", "deferred_max"),
                      ("rss_mib", "rss_mib_max")):
        if len(samples) and col in samples:
            out[name] = float(pd.to_numeric(samples[col], errors="coerce").max())
    if len(samples) and "rss_mib" in samples and "pid" in samples:
        # only while the server answered: a dying or loading process is not a drift
        healthy = samples[samples["up"].fillna(False).astype(bool)] if "up" in samples else samples
        life = healthy.dropna(subset=["rss_mib"]).groupby("pid")
        if len(life):
            longest = max(life, key=lambda g: len(g[1]))[1]
            d = drift(longest["t_s"], longest["rss_mib"])
            out.update(rss_drift_mib_per_h=d["slope_per_h"], rss_drift_lo=d["lo_per_h"],
                       rss_drift_hi=d["hi_per_h"], rss_drift_samples=d["n"])
    return out


def headline(s: dict[str, Any]) -> str:
    """The guide's three stability numbers by name, with units, from a `soak_summary`:
    crash rate (crashes per hour), error rate (% of requests that failed, those cut off by
    the soak's end apart) and uptime (% of samples in which the server answered)."""
    nan = float("nan")
    hours = s.get("duration_s", nan) / 3600
    drill = f", plus {s['drill_kills']} planned drill kill(s)" if s.get("drill_kills") else ""
    return (f"crash rate {s.get('crash_rate_per_h', nan):.3g} /h ({s.get('crashes_unplanned', s.get('crashes', 0))} "
            f"unplanned crash(es) in {hours:.3g} h{drill}) · "
            f"error rate {s.get('error_rate_pct', nan):.1f} % of {s.get('requests', 0) - s.get('incomplete_at_end', 0)} "
            f"requests ({s.get('incomplete_at_end', 0)} cut off at the end, not counted) · "
            f"uptime {s.get('uptime_pct', nan):.1f} % of samples")

"""Watching a server over time: what it holds (RAM, KV cache, queue), sampled at a fixed rate.

A latency percentile says how requests went; a time series says how the *server* went.
A soak (notebook 14) needs both, because the failures of long runs are slow: resident
memory that creeps up a few MiB an hour until the OOM killer strikes on day three, a
queue that grows because a slot leaks, a KV cache that fills as agent contexts grow.

`ServerSampler` wakes every `interval_s` and appends one row to `samples.jsonl`
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

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import numpy as np
import psutil

import pandas as pd

from infercourse.core import summary
from infercourse.measure.hardware import gpu_stats

__all__ = ["headline", "prometheus_values", "slots_usage", "process_rss_mib", "ServerSampler", "drift",
           "load_samples", "soak_summary"]

SAMPLES = "samples.jsonl"
# Gauges and counters worth a column (llama-server `--metrics`, vLLM); others are ignored.
_KEEP = ("llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:prompt_tokens_total",
         "llamacpp:prompt_tokens_cached_total", "llamacpp:tokens_predicted_total", "llamacpp:n_decode_total",
         "llamacpp:n_tokens_max", "llamacpp:n_busy_slots_per_decode",
         "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
         "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def prometheus_values(text: str, keep: tuple[str, ...] = _KEEP) -> dict[str, float]:
    """Sample values of a Prometheus text exposition, summed over labels, by sample name
    (counters keep their `_total` suffix). Only names in `keep` are returned.

    Args:
        text: what `/metrics` answered.
        keep: sample names to return.
    """
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in keep:
                out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def slots_usage(slots: list[dict[str, Any]]) -> dict[str, float]:
    """KV-cache tokens held by llama-server's slots (its `/slots` answer): prompt plus
    generated tokens of each slot's current or last task, over the slots' total context.
    An idle slot keeps its last prompt cached, so it counts as held."""
    n_ctx = sum(int(s.get("n_ctx", 0)) for s in slots)
    used = 0
    for s in slots:
        nxt = (s.get("next_token") or [{}])[0]
        used += int(s.get("n_prompt_tokens", 0)) + int(nxt.get("n_decoded", 0))
    busy = sum(bool(s.get("is_processing")) for s in slots)
    return {"kv_used_tokens": used, "kv_ctx_tokens": n_ctx,
            "kv_used_frac": used / n_ctx if n_ctx else math.nan, "slots_busy": busy}


def process_rss_mib(pid: int | None) -> float:
    """Resident memory (MiB) of a process and all its descendants; NaN if it is gone."""
    if not pid:
        return math.nan
    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
        return sum(q.memory_info().rss for q in procs if q.is_running()) / 2**20
    except psutil.Error:
        return math.nan


class ServerSampler:
    """Sample a server every `interval_s` in a background thread, into `samples.jsonl`.

    Args:
        url: the server root (its /health, /metrics and /slots are read).
        pid: a callable returning the server's current pid (it changes on a restart).
        out: the folder `samples.jsonl` is appended to.
        interval_s: seconds between samples.
        on_sample: called with each row (e.g. to update a live status line).
        gpu: also sample NVIDIA GPUs (`hardware.gpu_stats`).
    """

    def __init__(self, url: str, pid: Callable[[], int | None], out: str | os.PathLike, *,
                 interval_s: float = 1.0, on_sample: Callable[[dict], None] | None = None,
                 gpu: bool = True):
        self.url, self.pid, self.interval_s, self.on_sample = url.rstrip("/"), pid, interval_s, on_sample
        self.path = Path(out) / SAMPLES
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.gpu, self.rows, self.t0 = gpu, [], time.perf_counter()
        self._stop, self._thread = threading.Event(), None
        self._client = httpx.Client(timeout=max(1.0, interval_s))

    def sample(self) -> dict[str, Any]:
        """Take one sample now and append it to disk."""
        row: dict[str, Any] = {"t_s": time.perf_counter() - self.t0, "time": time.time()}
        pid = self.pid()
        row.update(pid=pid, rss_mib=process_rss_mib(pid))
        try:
            row["up"] = self._client.get(self.url + "/health").status_code == 200
            m = self._client.get(self.url + "/metrics")
            if m.status_code == 200:
                row.update(prometheus_values(m.text))
            s = self._client.get(self.url + "/slots")
            if s.status_code == 200 and isinstance(s.json(), list):
                row.update(slots_usage(s.json()))
        except (httpx.HTTPError, ValueError):
            row["up"] = False
        if "vllm:kv_cache_usage_perc" in row:
            row["kv_used_frac"] = row["vllm:kv_cache_usage_perc"]
        if self.gpu:
            for g in gpu_stats():
                for k in ("memory_used_mib", "utilization_pct", "power_w"):
                    row[f"gpu{g['index']}_{k}"] = g.get(k)
        self.rows.append(row)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.on_sample:
            self.on_sample(row)
        return row

    def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            try:
                self.sample()
            except Exception as e:  # noqa: BLE001 - a sampler must never take the soak down
                self.rows.append({"t_s": t - self.t0, "sampler_error": repr(e)})
            self._stop.wait(max(0.0, self.interval_s - (time.perf_counter() - t)))

    def start(self) -> "ServerSampler":
        self._thread = threading.Thread(target=self._loop, name="infercourse-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10 + self.interval_s)
        self._client.close()


def load_samples(directory: str | os.PathLike):
    """A soak folder's samples as a DataFrame (one row per sample; incomplete lines skipped)."""
    import pandas as pd
    rows = []
    path = Path(directory) / SAMPLES
    for line in (path.read_text(encoding="utf-8").splitlines() if path.exists() else []):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return pd.DataFrame(rows)


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
    out: dict[str, Any] = {"duration_s": duration_s, "requests": len(df), "crashes": crashes,
                           "restarts": sum(e["event"] == "restart" for e in events),
                           "downtime_s": float(sum(e.get("took_s", 0) for e in events if e["event"] == "restart")),
                           # the guide's three: crashes per hour of soak, failed requests, time serving
                           "crash_rate_per_h": crashes / (duration_s / 3600) if duration_s else float("nan"),
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
    return (f"crash rate {s.get('crash_rate_per_h', nan):.3g} /h ({s.get('crashes', 0)} crash(es) in {hours:.3g} h) · "
            f"error rate {s.get('error_rate_pct', nan):.1f} % of {s.get('requests', 0) - s.get('incomplete_at_end', 0)} "
            f"requests ({s.get('incomplete_at_end', 0)} cut off at the end, not counted) · "
            f"uptime {s.get('uptime_pct', nan):.1f} % of samples")

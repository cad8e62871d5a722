"""What the server says about itself while a run loads it: `/metrics`, `/slots`, the GPU.

A client sees latencies; only the server sees why. Its queue (`requests_deferred`), its busy
slots, how full its KV cache is and how many prompt tokens it evaluated versus reused are
on its own endpoints, and a GPU's memory and utilisation are on `nvidia-smi`. `bench`
samples them during every HTTP run (`ServerSampler`, one row a second into
`samples.jsonl` beside `requests.jsonl`), and `sampled_summary` folds the rows into the
manifest: counters as growth over the run, gauges as their peak.

What gets sampled:
- llama-server's Prometheus gauges and counters from `/metrics` (needs `--metrics`):
  `requests_processing`, `requests_deferred`, `prompt_tokens_total` (prompt tokens it
  *evaluated*: tokens reused from its cache are not in it), `tokens_predicted_total`...;
  vLLM's running/waiting requests, KV usage and prefix-cache counters;
- `kv_used_frac`: tokens held in llama-server's slots over their total context, from
  `/slots` (this llama-server exports no KV-usage gauge; vLLM's is read when present);
- resident memory of the server process when its pid is known (psutil);
- GPU memory, utilisation and power when an NVIDIA GPU is present (`hardware.gpu_stats`).

An endpoint a server does not serve is skipped: an Ollama or a router answers 404 on
`/slots`, and the row says only what was there. The soak (`ops.soak`, `ops.sampling`) samples
with the same `ServerSampler`.
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
import psutil

from infercourse.measure.hardware import gpu_stats

__all__ = ["SAMPLES", "prometheus_values", "slots_usage", "process_rss_mib", "ServerSampler",
           "load_samples", "sampled_summary", "server_lines"]

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
        pid: a callable returning the server's current pid (it changes on a restart), or
            None when the server is not ours (no RSS column then).
        out: the folder `samples.jsonl` is appended to.
        interval_s: seconds between samples.
        on_sample: called with each row (e.g. to update a live status line).
        gpu: also sample NVIDIA GPUs (`hardware.gpu_stats`).
    """

    def __init__(self, url: str, pid: Callable[[], int | None] | None, out: str | os.PathLike, *,
                 interval_s: float = 1.0, on_sample: Callable[[dict], None] | None = None,
                 gpu: bool = True):
        self.url, self.pid, self.interval_s, self.on_sample = url.rstrip("/"), pid, interval_s, on_sample
        self.path = Path(out) / SAMPLES
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.gpu, self.rows, self.t0 = gpu, [], time.perf_counter()
        self._stop, self._thread, self._missing = threading.Event(), None, set()
        self._client = httpx.Client(timeout=max(1.0, interval_s))
        self._lock = threading.Lock()

    def _get(self, path: str):
        # an endpoint that answered 404/501 once is not asked again (a router has no /slots)
        if path in self._missing:
            return None
        r = self._client.get(self.url + path)
        if r.status_code in (404, 501):
            self._missing.add(path)
        return r if r.status_code == 200 else None

    def sample(self) -> dict[str, Any]:
        """Take one sample now and append it to disk."""
        row: dict[str, Any] = {"t_s": time.perf_counter() - self.t0, "time": time.time()}
        if self.pid is not None:
            pid = self.pid()
            row.update(pid=pid, rss_mib=process_rss_mib(pid))
        with self._lock:   # the run's first and last samples come from the caller's thread
            try:
                h = self._get("/health")
                row["up"] = h is not None
                m = self._get("/metrics")
                if m is not None:
                    row.update(prometheus_values(m.text))
                s = self._get("/slots")
                if s is not None and isinstance(s.json(), list):
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

    def _loop(self, wait_first: bool) -> None:
        if wait_first and self._stop.wait(self.interval_s):
            return
        while not self._stop.is_set():
            t = time.perf_counter()
            try:
                self.sample()
            except Exception as e:  # noqa: BLE001 - a sampler must never take the run down
                self.rows.append({"t_s": t - self.t0, "sampler_error": repr(e)})
            self._stop.wait(max(0.0, self.interval_s - (time.perf_counter() - t)))   # a steady rate

    def start(self, first_sample: bool = False) -> "ServerSampler":
        """Sample now and every interval_s after, in a thread. `first_sample`: take the
        first one on this thread before returning (a run's start: the counters' baseline,
        after any warm-up, is on disk before the first request goes out)."""
        if first_sample:
            self.sample()
        self._thread = threading.Thread(target=self._loop, args=(first_sample,), name="infercourse-sampler",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, final_sample: bool = False) -> None:
        """Stop the thread; `final_sample`: take one last sample first (a run's end)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10 + self.interval_s)
        if final_sample:
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - never fail a finished run over a sample
                pass
        self._client.close()


def load_samples(directory: str | os.PathLike):
    """A folder's samples as a DataFrame (one row per sample; incomplete lines skipped)."""
    import pandas as pd
    rows = []
    path = Path(directory) / SAMPLES
    for line in (path.read_text(encoding="utf-8").splitlines() if path.exists() else []):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return pd.DataFrame(rows)


_PEAKS = ("llamacpp:requests_processing", "llamacpp:requests_deferred", "kv_used_frac", "slots_busy",
          "vllm:num_requests_running", "vllm:num_requests_waiting", "rss_mib")


def sampled_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's server side in a few numbers: each counter's growth from the first sample
    to the last (`*_total` -> `*_delta`), each gauge's peak (`*_max`), GPU peaks, and how
    many samples there were. With llama-server, `llamacpp:prompt_tokens_delta` is the
    prompt tokens it evaluated over the run: the complement of the client's cached tokens.

    Args:
        rows: `ServerSampler.rows` (errors skipped).
    """
    rows = [r for r in rows if "sampler_error" not in r]
    out: dict[str, Any] = {"n_samples": len(rows)}
    if not rows:
        return out
    first, last = rows[0], rows[-1]
    for k, v in last.items():
        if k.endswith("_total") and k in first:
            out[k.removesuffix("_total") + "_delta"] = float(v) - float(first[k])
    for k in _PEAKS + tuple(k for k in last if k.startswith("gpu")):
        vals = [float(r[k]) for r in rows if isinstance(r.get(k), (int, float)) and r[k] == r[k]]
        if vals:
            out[f"{k}_max"] = max(vals)
    out["up_frac"] = sum(bool(r.get("up")) for r in rows) / len(rows)
    return out


def server_lines(manifest: dict[str, Any]) -> list[str]:
    """One line of what the server said during a run (from its manifest), for `report`."""
    s = manifest.get("server_samples") or {}
    if not s.get("n_samples"):
        return []
    keys = [k for k in s if k != "n_samples"]
    return [f"server ({s['n_samples']} samples): " + ", ".join(f"{k}={s[k]:.4g}" for k in keys)]

"""A run's distributions: percentiles with intervals, throughput, error rate, goodput.

Inputs are `metrics.per_request_frame` rows (one per request). Averages lie about tails,
so every metric is summarized as count, mean, min, p50/p90/p95/p99 and max, each
percentile with a confidence interval.

Percentile intervals are a seeded bootstrap (numpy, hand-written: scipy is not a
dependency and the resampling is five lines).
"""
from __future__ import annotations

import math
import warnings
from typing import Iterable, Mapping

import numpy as np
import pandas as pd

__all__ = ["PERCENTILES", "DEFAULT_SUMMARY", "summarize", "throughput", "error_rate", "SLO_METRICS", "goodput"]

PERCENTILES = (50, 90, 95, 99)


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

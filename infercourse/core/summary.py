"""A run's distributions: percentiles with honest intervals, throughput, errors, goodput.

Inputs are `metrics.per_request_frame` rows (one per request). Averages lie about tails,
so every metric is summarized as count, mean, min, p50/p90/p95/p99 and max, each
percentile with a confidence interval.

**Percentile intervals are order statistics, not a bootstrap.** The number of samples
below the true q-quantile is Binomial(n, q) whatever the distribution, so the interval
[x_(l), x_(u)] between two sorted samples covers it with a probability the binomial gives
exactly (distribution-free). A bootstrap from 8–30 samples pretends to know the tail it
never saw; the order-statistic interval says when it cannot: a two-sided 95% interval for
p99 needs at least 368 samples (p95: 72, p90: 36, p50: 6). Below that the bounds are NaN
and the row is flagged "n too small", as GuideLLM does. Hand-written (a cumulative sum of
log factorials): scipy is not a dependency, and the rule is the lesson.

**Every request is counted.** Each summary carries the counts of ok / error / incomplete
requests (`status_counts`). The percentiles themselves are over `ok` requests by
default, and the `excluded` column says how many were left out, so the exclusion is never
silent. `failures="inf"` is the conservative view: a request that errored or was cut off
counts as slower than any that finished (+inf for latencies, 0 for speeds), so a p99 of
inf says "more than 1% never finished", which is what the user at the tail saw. We chose
this over partial timings as lower bounds because a lower bound can only pull a tail
down toward the survivors; GuideLLM reports incomplete and errored requests as separate
groups, which `summarize(df[df.status == "incomplete"])` reproduces.
"""
from __future__ import annotations

import math
import warnings
from typing import Iterable, Mapping

import numpy as np
import pandas as pd

__all__ = ["PERCENTILES", "DEFAULT_SUMMARY", "min_n", "shown", "order_stat_ci", "median_interval", "status_counts",
           "summarize", "ci_text", "throughput", "error_rate", "SLO_METRICS", "goodput"]

PERCENTILES = (50, 90, 95, 99)
DEFAULT_SUMMARY = ("ttft_s", "ttft_from_send_s", "tpot_s", "itl_mean_s", "e2e_s",
                   "dispatch_delay_s", "prefill_tok_per_s", "decode_tok_per_s")


# ---- distribution-free percentile intervals -------------------------------------------
def _binom_cdf(n: int, q: float) -> np.ndarray:
    """P(B <= k) for k = 0..n, B ~ Binomial(n, q), in log space (stable for large n)."""
    k = np.arange(n + 1)
    logfact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1)))])
    logpmf = logfact[n] - logfact[k] - logfact[n - k] + k * math.log(q) + (n - k) * math.log1p(-q)
    return np.minimum(np.cumsum(np.exp(logpmf)), 1.0)


def order_stat_ci(n: int, q: float, ci: float = 0.95) -> tuple[int, int] | None:
    """1-based ranks (l, u) with P(x_(l) <= true q-quantile <= x_(u)) >= ci, each tail
    <= (1 - ci) / 2; None when n is too small for any such pair.

    Args:
        n: number of samples.
        q: the quantile, in (0, 1) (0.99 for p99).
        ci: confidence level.
    """
    if not 0 < q < 1 or not 0 < ci < 1:
        raise ValueError(f"need 0 < q < 1 and 0 < ci < 1, got q={q}, ci={ci}")
    if n < 1:
        return None
    a, cdf = (1 - ci) / 2, _binom_cdf(n, q)
    # x_(l) <= quantile fails when fewer than l samples fall below it: P(B <= l-1) <= a
    lows = np.nonzero(cdf <= a)[0]
    # quantile <= x_(u) fails when u or more fall below it: P(B >= u) = 1 - cdf[u-1] <= a
    highs = np.nonzero(cdf >= 1 - a)[0]
    if not len(lows) or not len(highs) or highs[0] + 1 > n:
        return None
    return int(lows[-1]) + 1, int(highs[0]) + 1


def median_interval(x: Iterable[float], ci: float = 0.95) -> tuple[float, float] | None:
    """The median's distribution-free interval: the sorted values at `order_stat_ci`'s ranks;
    None when there are too few values for one."""
    v = np.sort(np.asarray(list(x), float))
    ranks = order_stat_ci(len(v), 0.5, ci)
    return (float(v[ranks[0] - 1]), float(v[ranks[1] - 1])) if ranks else None


def shown(value: float, percentile: str, too_small: str | float | None, ci: float = 0.95) -> float | str:
    """A percentile as a table prints it: the value, or "n<N" where `too_small` (a
    `summarize` row's `n_too_small`, e.g. "p95,p99") names it: a p99 of 20 requests is the
    largest of them, not an estimate, and the table must not print it as one.

    Args:
        value: the percentile's value; percentile: its name ("p99").
        too_small: the row's `n_too_small`; ci: the interval's confidence.
    """
    names = too_small.split(",") if isinstance(too_small, str) and too_small else []
    return f"n<{min_n(int(percentile[1:]) / 100, ci)}" if percentile in names else value


def min_n(q: float, ci: float = 0.95) -> int:
    """Fewest samples for which `order_stat_ci` gives an interval (p99 at 95%: 368)."""
    a = (1 - ci) / 2
    return math.ceil(math.log(a) / math.log(max(q, 1 - q)) - 1e-9)


def status_counts(df: pd.DataFrame) -> dict[str, int]:
    """Requests per status: ok, error, incomplete (and total); every request counts."""
    st = df["status"] if "status" in df else pd.Series(["ok"] * len(df))
    out = {s: int((st == s).sum()) for s in ("ok", "error", "incomplete")}
    out["total"] = len(df)
    return out


# ---- the summary table -------------------------------------------------------------------
def _view(df: pd.DataFrame, metric: str, failures: str) -> np.ndarray:
    x = pd.to_numeric(df[metric], errors="coerce")
    if "status" not in df or failures == "exclude":
        ok = df["status"] == "ok" if "status" in df else pd.Series(True, index=df.index)
        return x[ok].dropna().to_numpy(float)
    bad = df["status"] != "ok"
    if metric == "dispatch_delay_s":          # measured at send: known for every request
        return x.dropna().to_numpy(float)
    worst = 0.0 if SLO_METRICS.get(metric) == "min" or metric.endswith("_per_s") else math.inf
    return pd.concat([x[~bad].dropna(), pd.Series(worst, index=x[bad].index)]).to_numpy(float)


def _percentiles(x: np.ndarray) -> np.ndarray:
    finite = x[np.isfinite(x)]
    if len(finite) == len(x):
        return np.percentile(x, PERCENTILES)
    # +inf entries (the conservative view): interpolate with a huge stand-in, then any
    # result above every finite value means the percentile fell among the failures
    big = np.where(np.isfinite(x), x, 1e300)
    p = np.percentile(big, PERCENTILES)
    return np.where(p > (finite.max() if len(finite) else -np.inf), np.inf, p)


def summarize(df: pd.DataFrame, metrics: Iterable[str] = DEFAULT_SUMMARY, *,
              ci: float = 0.95, failures: str = "exclude", itl: pd.DataFrame | None = None,
              seed: int | None = None, n_boot: int | None = None) -> pd.DataFrame:
    """Distributions, not averages: count, mean, min, p50/p90/p95/p99, max per metric,
    each percentile with an order-statistic interval (`p99_lo`, `p99_hi`), NaN with
    `n_too_small` naming the percentiles whose interval needs more samples.

    Every row also says how many rows it `excluded` (not ok in the default view, or the
    metric undefined for them, e.g. TPOT of a 1-token answer); `.attrs["status_counts"]`
    holds the ok / error / incomplete counts.

    Args:
        df: a `per_request_frame` (or any frame with the metric columns).
        metrics: columns to summarize; missing ones are skipped.
        ci: confidence level of the percentile intervals.
        failures: "exclude" (percentiles over ok requests; `excluded` says how many were
            not) or "inf" (conservative: errored and incomplete requests count as +inf
            latency / 0 tok/s, so the tail shows them).
        itl: an `itl_frame` of the same run: adds a pooled `itl_s` row (every chunk gap
            of every ok request, as vLLM and GuideLLM report ITL), beside `itl_mean_s`
            (a distribution of per-request means).
        seed, n_boot: ignored; left from the bootstrap this replaced (nothing is random now).
    """
    if failures not in ("exclude", "inf"):
        raise ValueError(f"failures must be 'exclude' or 'inf', got {failures!r}")
    counts = status_counts(df)
    cols = [(m, df) for m in metrics if m in df]
    if itl is not None:
        cols.append(("itl_s", itl))
    out = {}
    for m, frame in cols:
        x = np.sort(_view(frame, m, failures if frame is df else "exclude"))
        # rows left out: not ok (default view), or this metric undefined for them
        row: dict[str, float | str] = {"count": len(x), "excluded": len(frame) - len(x)}
        if len(x):
            row.update(mean=float(np.mean(x)), min=float(x[0]), max=float(x[-1]))
            small = []
            for p, v in zip(PERCENTILES, _percentiles(x)):
                ranks = order_stat_ci(len(x), p / 100, ci)
                lo, hi = (x[ranks[0] - 1], x[ranks[1] - 1]) if ranks else (math.nan, math.nan)
                small += [] if ranks else [f"p{p}"]
                row.update({f"p{p}": float(v), f"p{p}_lo": float(lo), f"p{p}_hi": float(hi)})
            row["n_too_small"] = ",".join(small)
        out[m] = row
    res = pd.DataFrame.from_dict(out, orient="index")
    res.attrs.update(status_counts=counts, failures=failures, ci=ci)
    return res


def ci_text(summary: pd.DataFrame, metric: str, p: int = 99, *, scale: float = 1e3,
            unit: str = "ms") -> str:
    """One percentile as text with its interval, or why there is none: e.g.
    "p99 412 ms [380, 455]" or "p99 412 ms (n too small: a 95% interval needs n >= 368, have 40)".

    Args:
        summary: a `summarize` result.
        metric: its row, e.g. "ttft_s".
        p: the percentile (one of PERCENTILES).
        scale, unit: display units (default seconds shown in ms).
    """
    r = summary.loc[metric]
    v = r[f"p{p}"] * scale
    if np.isnan(r[f"p{p}_lo"]):
        need = min_n(p / 100, summary.attrs.get("ci", 0.95))
        return (f"p{p} {v:.4g} {unit} (n too small: a {summary.attrs.get('ci', 0.95):.0%} interval "
                f"needs n >= {need}, have {int(r['count'])})")
    return f"p{p} {v:.4g} {unit} [{r[f'p{p}_lo'] * scale:.4g}, {r[f'p{p}_hi'] * scale:.4g}]"


# ---- throughput, errors, goodput ---------------------------------------------------------
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
    """Fraction of requests whose status is not `ok` (errors and incomplete alike)."""
    return float((df["status"] != "ok").mean()) if len(df) else math.nan


# Each SLO names a per-request column and a direction: latencies are upper bounds,
# speeds lower bounds.
SLO_METRICS = {
    "ttft_s": "max", "ttft_from_send_s": "max", "e2e_s": "max", "e2e_from_send_s": "max",
    "tpot_s": "max", "itl_mean_s": "max", "itl_max_s": "max", "dispatch_delay_s": "max",
    "decode_tok_per_s": "min", "prefill_tok_per_s": "min",
}


def goodput(df: pd.DataFrame, slos: Mapping[str, float]) -> dict[str, float]:
    """Requests that met *every* SLO, as a fraction and per second of wall time.

    An errored or incomplete request never counts. **An SLO that cannot be measured on a
    request is not met**: TPOT, ITL and decode speed are undefined for a 1-token answer
    or for an answer that arrived in a single chunk (a server that buffers 200 tokens into
    one chunk would otherwise pass every ITL and decode SLO), and TTFT for a request that
    produced no token. Such ok requests are counted in `n_unmeasurable` (they are part of
    `n - n_good`), so a reader sees why goodput fell. vLLM instead counts TPOT as 0 for
    1-token answers (met); set the SLO on `ttft_s`/`e2e_s` alone to compare with that.

    Args:
        df: a `per_request_frame`.
        slos: metric name -> target, e.g. {"ttft_s": 0.5, "tpot_s": 0.05}; upper bounds
            for latencies, lower bounds for `*_tok_per_s`. See `SLO_METRICS`.
    """
    if not slos:
        raise ValueError("goodput needs at least one SLO, e.g. {'ttft_s': 0.5}")
    ok = (df["status"] == "ok").to_numpy()
    good, undefined = ok.copy(), np.zeros(len(df), bool)
    for name, target in slos.items():
        if name not in SLO_METRICS:
            raise ValueError(f"unknown SLO metric {name!r}; choose from {sorted(SLO_METRICS)}")
        if not isinstance(target, (int, float)) or isinstance(target, bool) \
                or not math.isfinite(target) or target <= 0:
            raise ValueError(f"SLO {name} must be a positive finite number, got {target!r}")
        x = pd.to_numeric(df[name], errors="coerce").to_numpy(float)
        met = x <= target if SLO_METRICS[name] == "max" else x >= target   # NaN: False
        undefined |= np.isnan(x)
        if len(df) and not met.any():
            op = "<=" if SLO_METRICS[name] == "max" else ">="
            warnings.warn(f"no request met SLO {name} {op} {target}; goodput is 0", stacklevel=2)
        good &= met
    wall = throughput(df)["wall_s"]
    n_good = int(good.sum())
    return {"n": len(df), "n_good": n_good, "n_failed": int((~ok).sum()),
            "n_unmeasurable": int((undefined & ok).sum()),
            "good_fraction": n_good / len(df) if len(df) else math.nan,
            "goodput_requests_per_s": n_good / wall if wall and wall > 0 else math.nan}

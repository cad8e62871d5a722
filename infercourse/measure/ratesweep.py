"""The open-loop twin of the concurrency sweep: offered rate up, until the server saturates.

A concurrency sweep asks "how fast with N users each waiting for the last answer"; a rate
sweep asks "what happens when requests keep arriving at R per second whether or not the
server keeps up" (real users do not wait for each other). Below saturation the completed
rate follows the offered one and latency stays flat; past it the queue grows for as long
as the run lasts, latency climbs with it, and completed requests per second stop following.
`rate_sweep` runs one open-loop level per rate, low to high, and stops at the first level
that saturates, because every higher one only measures a longer queue.

Saturation is judged by the **backlog**: when each request was due, how many earlier
requests were still unfinished (queued in the client, queued in the server or being
served). A server that keeps up holds a backlog that rises and falls around what its
service time overlaps; one that does not falls behind by a share of every arrival, so its
backlog climbs across the level. A level is saturated when its backlog grows (fitted over
the level) by at least `min_growth` requests *and* by more than `1 - keep_up` per arrival
(completing fewer than `keep_up` of the offered requests adds that share to the queue), or
when its error share passes `max_error_rate`, or when requests waited in the client (at its
in-flight cap) longer than one takes to serve. The backlog reads only end times *before*
later arrivals, so no single request decides: the old rule (completed rate against an ideal
end) let the last request's duration alone call a short level saturated.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from infercourse.core import summary
from infercourse.measure.bench import BenchResult, run

__all__ = ["rate_sweep", "saturated", "backlog", "level_row"]


def backlog(df: pd.DataFrame) -> np.ndarray:
    """For each request in scheduled order, the earlier requests still unfinished when it
    was due (failed ones count until they failed). Pure: a function of recorded times."""
    d = df.sort_values("scheduled_t")
    sched, end = d["scheduled_t"].to_numpy(float), d["end_t"].to_numpy(float)
    return np.array([int(((sched < s) & ~(end <= s)).sum()) for s in sched])   # NaN end: unfinished


def _trend(b: np.ndarray) -> tuple[float, float]:
    """Least-squares slope of the backlog against arrival index (requests added per arrival),
    and the growth it implies over the level (slope x (n - 1))."""
    if len(b) < 2:
        return 0.0, 0.0
    slope = float(np.polyfit(np.arange(len(b)), b, 1)[0])
    return slope, slope * (len(b) - 1)


def saturated(row: dict[str, Any], keep_up: float = 0.9, max_error_rate: float = 0.05,
              min_growth: float = 2.0) -> str | None:
    """Why a rate-sweep level counts as saturated (None: it kept up).

    Args:
        row: one level of `rate_sweep`'s table (`level_row`: backlog_slope, backlog_growth,
            error_rate, dispatch_delay_s_p95, service_s).
        keep_up: the completed/offered share under which the server is behind: its backlog
            then grows by more than 1 - keep_up requests per arrival.
        max_error_rate: the failed share over which it is failing.
        min_growth: requests the backlog must grow by over the level. One request still
            running when the next arrives is ordinary overlap (or one slow answer), not a queue.
    """
    if row["backlog_slope"] > 1 - keep_up and row["backlog_growth"] >= min_growth:
        return (f"backlog grew by {row['backlog_growth']:.1f} requests over the level "
                f"({row['backlog_slope']:.2f} per arrival > {1 - keep_up:.2f}: completing under "
                f"{keep_up:.0%} of what was offered)")
    if row["error_rate"] > max_error_rate:
        return f"error rate {row['error_rate']:.0%} > {max_error_rate:.0%}"
    if row["dispatch_delay_s_p95"] > row["service_s"]:
        return (f"requests waited {row['dispatch_delay_s_p95']:.3g} s (p95) in the client before they could "
                f"be sent, longer than one takes ({row['service_s']:.3g} s)")
    return None


def level_row(df: pd.DataFrame, rate: float, s: pd.DataFrame | None = None) -> dict[str, Any]:
    """One level's row from its per-request frame: offered and completed rate, error rate,
    the fastest service time, the backlog (max, slope per arrival, growth over the level)
    and p50/p95 TTFT, p95 E2E and dispatch delay (`s`: the run's summary; None: computed)."""
    s = summary.summarize(df) if s is None else s
    row = {"offered_rps": rate, **summary.throughput(df), "error_rate": summary.error_rate(df)}
    ok = df[df["status"] == "ok"]
    # the fastest request's service time: what one takes with nothing ahead of it
    row["service_s"] = float(ok["e2e_from_send_s"].min()) if len(ok) else float("nan")
    b = backlog(df) if len(df) else np.array([], int)
    row["backlog_max"] = int(b.max()) if len(b) else 0
    row["backlog_slope"], row["backlog_growth"] = _trend(b)
    for m, q in (("ttft_s", "p50"), ("ttft_s", "p95"), ("e2e_s", "p95"), ("dispatch_delay_s", "p95")):
        row[f"{m}_{q}"] = s.loc[m, q] if len(s) and m in s.index and q in s else float("nan")
    return row


def rate_sweep(engine, workload, rates: Sequence[float], *, pattern: str = "poisson",
               requests_per_level: int | None = None, keep_up: float = 0.9, max_error_rate: float = 0.05,
               min_growth: float = 2.0, out_dir: str | Path | None = None,
               **kw: Any) -> tuple[pd.DataFrame, list[BenchResult]]:
    """One open-loop run per offered rate, stopping after the first saturated level.

    Returns (table, results): one row per level run (`level_row`; `saturated`: the reason
    or empty) and each BenchResult.

    Args:
        rates: offered requests/s, low to high.
        pattern: "poisson" (bursty, as real arrivals are) or "rate" (evenly spaced).
        requests_per_level: requests per level (default max(8, 4 x rate)); a backlog trend
            needs a few arrivals, and a short Poisson level's own burstiness can read as one.
        keep_up, max_error_rate, min_growth: the saturation rule (see `saturated`).
        out_dir: parent folder; each level writes `r<rate>/` under it.
        **kw: passed to `bench.run` (warmup, seed, ignore_eos...).
    """
    rows, results, label = [], [], kw.pop("label", None) or "rate-sweep"
    for rate in rates:
        n = requests_per_level or max(8, int(4 * rate))
        sub = Path(out_dir) / f"r{rate:g}" if out_dir else None
        r = run(engine, workload, pattern=pattern, rate_rps=rate, max_requests=n, out_dir=sub,
                label=f"{label}-r{rate:g}", **kw)
        row = level_row(r.df, rate, r.summary)
        row["saturated"] = saturated(row, keep_up, max_error_rate, min_growth) or ""
        rows.append(row)
        results.append(r)
        if row["saturated"]:
            break
    return pd.DataFrame(rows).set_index("offered_rps"), results

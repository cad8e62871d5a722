"""The open-loop twin of the concurrency sweep: offered rate up, until the server saturates.

A concurrency sweep asks "how fast with N users each waiting for the last answer"; a rate
sweep asks "what happens when requests keep arriving at R per second whether or not the
server keeps up" (real users do not wait for each other). Below saturation the completed
rate follows the offered one and latency stays flat; past it the queue grows for as long
as the run lasts, latency climbs with it, and completed requests per second stop following.
`rate_sweep` runs one open-loop level per rate, low to high, and stops at the first level
that saturates, because every higher one only measures a longer queue.

Saturated means any of: completed requests/s below `keep_up` x what a server keeping up
would complete over the same window (`ideal_rps`); an error
or incomplete share above `max_error_rate`; requests that waited in the client (at its
in-flight cap) longer than one takes to serve (p95 dispatch delay > the fastest service time).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from infercourse.core import summary
from infercourse.measure.bench import BenchResult, run

__all__ = ["rate_sweep", "saturated"]


def saturated(row: dict[str, Any], keep_up: float = 0.9, max_error_rate: float = 0.05) -> str | None:
    """Why a rate-sweep level counts as saturated (None: it kept up).

    Args:
        row: one level of `rate_sweep`'s table (ideal_rps, requests_per_s, error_rate,
            dispatch_delay_s_p95, service_s).
            `ideal_rps`: requests over (the span of their scheduled sends + the fastest
            request's service time), what a server that keeps up completes over the same
            window; a short run of a Poisson schedule never reaches the nominal rate exactly.
        keep_up: the completed/offered ratio under which the server is behind.
        max_error_rate: the failed share over which it is failing.
    """
    if row["requests_per_s"] < keep_up * row["ideal_rps"]:
        return (f"completed {row['requests_per_s']:.3g} req/s < {keep_up:.0%} of the "
                f"{row['ideal_rps']:.3g} a server keeping up would complete")
    if row["error_rate"] > max_error_rate:
        return f"error rate {row['error_rate']:.0%} > {max_error_rate:.0%}"
    if row["dispatch_delay_s_p95"] > row["service_s"]:
        return (f"requests waited {row['dispatch_delay_s_p95']:.3g} s (p95) in the client before they could "
                f"be sent, longer than one takes ({row['service_s']:.3g} s)")
    return None


def rate_sweep(engine, workload, rates: Sequence[float], *, pattern: str = "poisson",
               requests_per_level: int | None = None, keep_up: float = 0.9, max_error_rate: float = 0.05,
               out_dir: str | Path | None = None, **kw: Any) -> tuple[pd.DataFrame, list[BenchResult]]:
    """One open-loop run per offered rate, stopping after the first saturated level.

    Returns (table, results): one row per level run (offered and completed rate, p50/p95
    TTFT and E2E, error rate, `saturated`: the reason or empty) and each BenchResult.

    Args:
        rates: offered requests/s, low to high.
        pattern: "poisson" (bursty, as real arrivals are) or "rate" (evenly spaced).
        requests_per_level: requests per level (default max(8, 4 x rate)).
        keep_up, max_error_rate: the saturation rule (see `saturated`).
        out_dir: parent folder; each level writes `r<rate>/` under it.
        **kw: passed to `bench.run` (warmup, seed, ignore_eos...).
    """
    rows, results, label = [], [], kw.pop("label", None) or "rate-sweep"
    for rate in rates:
        n = requests_per_level or max(8, int(4 * rate))
        sub = Path(out_dir) / f"r{rate:g}" if out_dir else None
        r = run(engine, workload, pattern=pattern, rate_rps=rate, max_requests=n, out_dir=sub,
                label=f"{label}-r{rate:g}", **kw)
        s = r.summary
        row = {"offered_rps": rate, **summary.throughput(r.df), "error_rate": summary.error_rate(r.df),
               }
        ok = r.df[r.df["status"] == "ok"]
        row["service_s"] = float(ok["e2e_from_send_s"].min()) if len(ok) else float("nan")
        span = float(r.df["scheduled_t"].max() - r.df["scheduled_t"].min()) if len(r.df) else 0.0
        # the fastest request's own service time: what each would take on a server keeping up
        row["ideal_rps"] = len(r.df) / (span + float(ok["e2e_from_send_s"].min())) if len(ok) else float("nan")
        for m, q in (("ttft_s", "p50"), ("ttft_s", "p95"), ("e2e_s", "p95"), ("dispatch_delay_s", "p95")):
            row[f"{m}_{q}"] = s.loc[m, q] if len(s) and m in s.index and q in s else float("nan")
        row["saturated"] = saturated(row, keep_up, max_error_rate) or ""
        rows.append(row)
        results.append(r)
        if row["saturated"]:
            break
    return pd.DataFrame(rows).set_index("offered_rps"), results

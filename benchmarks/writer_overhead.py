"""Benchmark: does writing results on the event loop skew the other streams' clocks?

Every finished request is encoded to JSON, appended and fsync'ed, and the progress bar
moves. Done on the event loop (`bench.run(write_inline=True)`, how bench worked before),
that work delays the timestamps of every other stream in flight; done on
`results.RunWriter`'s writer thread (the default), the loop only puts the trace on a
queue. Both modes run here in one process, interleaved (inline, thread, inline,
thread...), open loop with up to 64 requests in flight against `testing.SSESource`, a
local stand-in server whose chunk gap is exact. Two numbers per mode:

- dispatch delay (actual send - scheduled send), p50 and p99: how late the loop sends;
- ITL inflation: pooled chunk gaps as the client stamped them minus the source's exact
  gap, p50 and p99: how much the client's own work stretched the gaps it reports.

    .venv/bin/python benchmarks/writer_overhead.py [--reps 3] [--requests 400] [--rate 200]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from infercourse.core import metrics
from infercourse.core.types import Request
from infercourse.engines.openai_http import OpenAIHTTPEngine
from infercourse.measure import bench
from infercourse.models.embedded import cache_dir
from infercourse.testing import SSESource


def one_run(url: str, out: Path, inline: bool, a) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    engine = OpenAIHTTPEngine(url, model="sse-source", api="completions")
    reqs = [Request(prompt=f"p{i}", max_tokens=a.tokens) for i in range(a.requests)]
    r = bench.run(engine, reqs, pattern="rate", rate_rps=a.rate, max_in_flight=a.in_flight, warmup=2,
                  salt=False, write_inline=inline, out_dir=out, progress=True)
    return r.df, metrics.itl_frame(r.traces), r.manifest["client"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="runs per mode, interleaved")
    ap.add_argument("--requests", type=int, default=400, help="requests per run")
    ap.add_argument("--rate", type=float, default=200.0, help="requests/s (open loop)")
    ap.add_argument("--in-flight", type=int, default=64, help="in-flight cap")
    ap.add_argument("--tokens", type=int, default=16, help="chunks per request")
    ap.add_argument("--gap", type=float, default=0.02, help="the source's exact chunk gap, s")
    a = ap.parse_args()
    # results on the real disk (not a tmpfs, where fsync is free): the cache folder's
    root = Path(tempfile.mkdtemp(prefix="writer-overhead-", dir=cache_dir()))
    got: dict[str, list] = {"inline": [], "thread": []}
    with SSESource(ttft_s=0.0, gap_s=a.gap) as src:
        for rep in range(a.reps):
            for mode in ("inline", "thread"):
                got[mode].append(one_run(src.url, root / f"{mode}-{rep}", mode == "inline", a))
    rows = {}
    for mode, runs in got.items():
        df = pd.concat([d for d, _, _ in runs])
        itl = pd.concat([i for _, i, _ in runs])["itl_s"].to_numpy() - a.gap
        delay = df["dispatch_delay_s"].dropna().to_numpy()
        rows[f"writing {mode}"] = {
            "requests": len(df), "ok": int((df["status"] == "ok").sum()),
            "max_in_flight": max(c["max_in_flight"] for _, _, c in runs),
            "dispatch_p50_ms": 1e3 * np.percentile(delay, 50), "dispatch_p99_ms": 1e3 * np.percentile(delay, 99),
            "itl_infl_p50_ms": 1e3 * np.percentile(itl, 50), "itl_infl_p99_ms": 1e3 * np.percentile(itl, 99),
            "client_cpu": np.mean([c["cpu_frac_of_core"] for _, _, c in runs]),
        }
    table = pd.DataFrame(rows).T
    print(f"open loop {a.rate:g} req/s, cap {a.in_flight}, {a.tokens} chunks {a.gap * 1e3:g} ms apart, "
          f"{a.reps} x {a.requests} requests per mode, interleaved; results under {root}")
    print(table.to_string(float_format=lambda v: f"{v:.3g}"))


if __name__ == "__main__":
    main()

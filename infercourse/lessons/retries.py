"""Notebook 18: what a client's retries do to the tail. Errors become slow successes.

The OpenAI-style API has no retries of its own: a client adds them. Behind a brief outage (a
proxy that answers HTTP 502 for its first seconds, `ops.netfaults.FaultProxy`), the same few
requests are sent one after another without retries and with retries and exponential backoff
(`retry_tail`). Without retries the outage shows as errors, each failing fast; with retries
that outlast it, a request that met the outage waits for its end plus the backoff it was
sleeping when it ended, so the errors move into the latency tail. `retry_sentence` says what
one run's requests did, from its rows.
"""
from __future__ import annotations

import time

import pandas as pd

from infercourse.core.errors import InferCourseError
from infercourse.core.types import Request, generate
from infercourse.ops.netfaults import FaultProxy, client_engine

__all__ = ["retry_tail", "retry_sentence"]


def retry_tail(server, *, n: int = 6, outage_s: float = 2.0, retries: int = 4, backoff_s: float = 0.25,
               max_tokens: int = 8) -> pd.DataFrame:
    """What a client's retries do to the tail: `n` requests one after another through a
    proxy that answers HTTP 502 for its first `outage_s` seconds, without and with retries
    (exponential backoff: backoff_s, 2x, 4x...). One row per request: mode, ok, attempts,
    seconds (send of the first attempt to the end of the last).

    Args:
        server: a running LlamaServer (loopback).
        n, outage_s: requests per mode; how long the proxy fails.
        retries, backoff_s: the client's retries and its first wait.
        max_tokens: answer length (short: the point is the waiting, not the decoding).
    """
    rows, req = [], Request(prompt="Say hello.", max_tokens=max_tokens)
    for mode, k in (("no retry", 0), (f"{retries} retries, backoff from {backoff_s:g} s", retries)):
        with FaultProxy(server.url, "5xx", max_s=outage_s) as proxy:
            engine = client_engine(proxy.url, timeout_s=30)
            for _ in range(n):
                t0, attempt, ok = time.perf_counter(), 0, False
                while True:
                    attempt += 1
                    try:
                        generate(engine, req)
                        ok = True
                        break
                    except InferCourseError:
                        if attempt > k:
                            break
                        time.sleep(backoff_s * 2 ** (attempt - 1))
                rows.append({"mode": mode, "ok": ok, "attempts": attempt, "seconds": time.perf_counter() - t0})
            engine.close()
    df = pd.DataFrame(rows)
    df.attrs.update(outage_s=outage_s, backoff_s=backoff_s)
    return df


def retry_sentence(tail: pd.DataFrame) -> str:
    """What the retries did in `retry_tail`'s run, from its rows: the failures and the slowest
    request without and with retries, and which way each moved (or that it did not). One
    run of a few requests per mode: no noise band, so a small change in the slowest request
    is reported as a number, not as a trend."""
    modes = list(dict.fromkeys(tail["mode"]))
    a, b = (tail[tail["mode"] == m] for m in (modes[0], modes[-1]))
    fa, fb = int((~a["ok"].astype(bool)).sum()), int((~b["ok"].astype(bool)).sum())
    sa, sb = float(a["seconds"].max()), float(b["seconds"].max())
    head = (f"{modes[0]}: {fa} of {len(a)} requests failed, the slowest took {sa:.2f} s. {modes[-1]}: {fb} of "
            f"{len(b)} failed, the slowest took {sb:.2f} s")
    outage = tail.attrs.get("outage_s")
    span = f" (the outage lasted {outage:g} s)" if outage else ""
    if fb < fa:
        moved = (f"the retries turned {fa - fb} failure(s) into successes and the slowest request grew by "
                 f"{sb - sa:.2f} s{span}: the errors moved into the tail" if sb > sa else
                 f"the retries turned {fa - fb} failure(s) into successes without a slower request{span}")
    elif fb == fa == 0:
        moved = f"no request met the outage in either mode{span}, so there was nothing for the retries to do"
    elif fb == fa:
        moved = f"the retries did not change the number of failures{span}: the outage outlasted every retry"
    else:
        moved = f"more requests failed with retries than without{span}: the outage hit the two modes differently"
    return f"{head}: {moved}."

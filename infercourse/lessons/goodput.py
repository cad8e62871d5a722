"""Reading a throughput-latency curve (notebook 11): the knee, goodput, and what limits it.

`concurrency` measures the curve (one point per number of users); this module reads it.

- **The knee**: the last level whose throughput still rose by a useful margin. Past it,
  more users buy latency, not throughput.
- **Goodput** is a *rate*: requests per second that met every SLO (as in the glossary and
  `core.summary.goodput`). The share of requests that met them is **SLO attainment**, a
  different number: a server can keep 100% attainment while its goodput falls, by
  serving fewer requests. SLOs are scaled from the unloaded run (`scaled_slo`): a fixed
  "TTFT <= 1 s" reads 0% everywhere on a slow laptop and 100% on a GPU, and teaches
  nothing on either.
- **What limits the top of the curve** (`limit_sentence`, `regime`) is said from the
  numbers: a roof is named only when the run got at least halfway to it (a rate above a
  roof says that roof is wrong); below both, how the step time grew with the batch says
  whether a per-step overhead the batch shares or each sequence's own arithmetic (the
  kernel) set the pace (`measure.regime`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from infercourse.core import summary
from infercourse.measure import claims
from infercourse.measure import regime as _regime

__all__ = ["knee", "scaled_slo", "goodput_by_level", "regime", "limit_sentence", "plot_throughput_latency"]


def knee(table: pd.DataFrame, *, min_gain: float = 0.15) -> int:
    """The last level whose throughput still rose by at least `min_gain` (15 %) over the
    level before: beyond it, more concurrency buys latency, not throughput."""
    tput = table["output_tok_per_s"].to_numpy(float)
    best = table.index[0]
    for i in range(1, len(tput)):
        if tput[i] >= tput[i - 1] * (1 + min_gain):
            best = table.index[i]
        else:
            break
    return int(best)


def scaled_slo(table: pd.DataFrame, multiples: dict[str, float]) -> dict[str, float]:
    """SLOs as multiples of the unloaded level's p50 (the first row of an `np_sweep` table):
    {"ttft_s": 3} means "TTFT within 3x what one user alone gets". A fixed 1 s SLO reads 0%
    everywhere on a slow machine and 100% on a fast one; a scaled one asks the same question
    on both: how much worse than unloaded may a user's wait get?

    Args:
        table: `np_sweep` output (uses `<metric>_p50` of its first row).
        multiples: metric -> allowed multiple of its unloaded p50.
    """
    return {m: float(x * table[f"{m}_p50"].iloc[0]) for m, x in multiples.items()}


def goodput_by_level(runs: Sequence, slos: dict[str, float]) -> pd.DataFrame:
    """Goodput per run label: **requests per second that met every SLO** (a rate, the
    median over a label's repeats), beside `slo_attainment` (the share that met them,
    pooled) and the throughput it came from."""
    import warnings
    rows = []
    for r in runs:
        with warnings.catch_warnings():      # "no request met ..." shows as a 0 in the table
            warnings.simplefilter("ignore", UserWarning)
            g = summary.goodput(r.df, slos)
        rows.append({"run": str(r.manifest.get("label")).split("-r")[0], "n": g["n"], "n_good": g["n_good"],
                     "goodput_req_per_s": g["goodput_requests_per_s"],
                     "throughput_req_per_s": summary.throughput(r.df)["requests_per_s"]})
    df = pd.DataFrame(rows).groupby("run", sort=False)
    out = df[["goodput_req_per_s", "throughput_req_per_s"]].median()
    out.insert(1, "slo_attainment", df["n_good"].sum() / df["n"].sum())
    return out


def _decode_floor(table: pd.DataFrame) -> float | None:
    """The decode rate's own A/A band (None: one run per level)."""
    return table.attrs.get("decode_noise_floor", table.attrs.get("noise_floor"))


def regime(table: pd.DataFrame, ceil: pd.DataFrame) -> _regime.Regime:
    """What bound the sweep's aggregate decode rate (`measure.regime.decode_regime`): its
    share of each roof at the top level, and how the step time (N ÷ decode rate) grew with N,
    judged against the decode rate's A/A band.

    Args:
        table: `np_sweep`'s table; ceil: `roofline.batch_ceiling` over (at least) its levels.
    """
    d = table["decode_tok_per_s"]
    c = ceil.reindex(d.index)
    return _regime.decode_regime(list(d.index), list(d), list(c["memory_bound_tok_per_s"]),
                                 list(c["compute_bound_tok_per_s"]), floor=_decode_floor(table),
                                 compute_source=ceil.attrs.get("compute_source", ""))


def limit_sentence(table: pd.DataFrame, ceil: pd.DataFrame) -> str:
    """What limits the top of the curve, from the run: the aggregate decode rate (N ÷ TPOT)
    against batch size, judged against its own A/A band; the prefill share of each request
    (the part of end-to-end throughput that is not decode); and the regime (`regime`): the
    share of each roof, the step's fixed and per-sequence parts, and which bound it.

    Args:
        table: `np_sweep`'s table; ceil: `roofline.batch_ceiling` over its levels.
    """
    d = table["decode_tok_per_s"]
    trend = claims.trend_sentence(list(d.index), list(d), _decode_floor(table), what="aggregate decode rate (N ÷ TPOT p50)",
                                  x_name="batch")
    if "decode_verdict" in table:
        trend += f" Paired test at {d.index[-1]} users: {table['decode_verdict'].iloc[-1]}."
    share = table["prefill_share"]
    pre = (f"Before its first token each request spent {share.min():.0%}–{share.max():.0%} of its time (median "
           f"TTFT ÷ E2E), so end-to-end throughput ({table['output_tok_per_s'].iloc[0]:.3g} → "
           f"{table['output_tok_per_s'].iloc[-1]:.3g} tok/s) understates decode by that much.")
    return " ".join([trend, pre, regime(table, ceil).text])


def plot_throughput_latency(table: pd.DataFrame, *, latency: str = "ttft_s_p95", slo_s: float | None = None,
                            ceiling_tok_per_s: float | None = None, ax=None, label: str | None = None):
    """Throughput (x) against tail latency (y), one point per level, labelled; the SLO as a
    horizontal line and the compute ceiling as a vertical one where it is within 3x of the
    data (else a note, so the points are not squeezed into a corner)."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(6.5, 4))[1]
    ax.plot(table["output_tok_per_s"], table[latency], marker="o", label=label)
    for lvl, x, y in zip(table.index, table["output_tok_per_s"], table[latency]):
        ax.annotate(f"{lvl}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if slo_s:
        ax.axhline(slo_s, color="tab:red", ls="--", lw=1, label=f"SLO {latency.split('_s_')[0]} ≤ {slo_s:.3g} s")
    top = float(np.nanmax(table["output_tok_per_s"]))
    if ceiling_tok_per_s and ceiling_tok_per_s <= 3 * top:   # on the axis only if near the data
        ax.axvline(ceiling_tok_per_s, color="grey", ls=":", lw=1, label="compute ceiling")
    elif ceiling_tok_per_s:                                  # else a note: the data would shrink to a dot
        ax.annotate(f"compute ceiling {ceiling_tok_per_s:,.0f} tok/s →\n({ceiling_tok_per_s / top:,.0f}× the "
                    "best level, off this axis)", xy=(0.98, 0.05), xycoords="axes fraction", ha="right", fontsize=8)
    ax.set(xlabel="throughput (output tokens/s)", ylabel=f"{latency.replace('_s_', ' ')} (s)",
           title="Throughput vs latency (labels: concurrent users)", ylim=(0, None), xlim=(0, None))
    ax.legend(fontsize=8)
    return ax

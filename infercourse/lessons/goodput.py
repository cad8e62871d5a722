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
- **What limits the top of the curve** (`ceiling_note`) is said from the numbers: a wall
  is named only when the run got at least halfway to it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from infercourse.core import summary

__all__ = ["knee", "scaled_slo", "goodput_by_level", "ceiling_note", "plot_throughput_latency"]


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


def ceiling_note(table: pd.DataFrame, ceil: pd.DataFrame) -> str:
    """Say what limited the top level, from the numbers: the measured throughput as a share
    of its batch's memory and compute ceilings. Blames a wall only when the run reached at
    least half of it; otherwise says that neither roof explains the flattening."""
    n = int(table.index[-1])
    got = float(table["output_tok_per_s"].iloc[-1])
    row = ceil.loc[n] if n in ceil.index else ceil.iloc[-1]
    mem, comp = got / row["memory_bound_tok_per_s"], got / row["compute_bound_tok_per_s"]
    share = f"{got:.3g} tok/s at {n} users is {mem:.1%} of the memory ceiling and {comp:.1%} of the compute ceiling"
    if max(mem, comp) >= 0.5:
        wall = "compute" if comp >= mem else "memory bandwidth"
        return f"{share}: the run is near the {wall} wall, which is what flattens the curve."
    return (f"{share}: neither roof explains the flattening. The ceilings assume the f32 GEMM rate and "
            "the full bandwidth; what binds here is the few threads llama-server runs its quantized kernels "
            "on (shared with other programs), plus per-step overheads that batching does not divide.")


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

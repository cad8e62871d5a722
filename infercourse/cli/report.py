"""`infercourse report DIR...`: finished runs side by side.

A comparison table (throughput, error rate, latency percentiles), then every recorded
condition that differs between the runs, their warnings and what each server said during
its run: the conditions are what make two numbers comparable, so they are printed with them.
Exit codes as `bench`'s (`cli.bench.clean_errors`).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from infercourse.cli.bench import clean_errors

__all__ = ["report_main"]


@clean_errors
def report_main(argv: list[str] | None = None) -> int:
    """`infercourse report DIR...`: a comparison table and the conditions that differ."""
    p = argparse.ArgumentParser(prog="infercourse report", description=(
        "Compare finished runs: throughput, error rate and p50/p90/p99 latencies side by side, "
        "then every recorded condition that differs between them."))
    p.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="results folders written by bench")
    p.add_argument("--metric", action="append", help="metrics to compare (repeatable; default ttft_s, "
                                                     "tpot_s, e2e_s, decode_tok_per_s)")
    p.add_argument("--plot", type=Path, help="save a latency CDF of all runs to this image file")
    p.add_argument("--plot-metric", default="ttft_s", help="metric of the --plot CDF (default ttft_s)")
    a = p.parse_args(argv)
    missing = [str(d) for d in a.dirs if not (d / "manifest.json").is_file()]
    if missing:
        p.error(f"not a results folder (no manifest.json): {', '.join(missing)}")
    import pandas as pd

    from infercourse.measure import results
    from infercourse.measure.server_samples import server_lines
    runs = [results.load_run(d) for d in a.dirs]
    metric_names = a.metric or ("ttft_s", "tpot_s", "e2e_s", "decode_tok_per_s")
    from infercourse.core.summary import shown
    table = results.compare(runs, metric_names)
    keep = [c for c in table.columns if not c.endswith(("_lo", "_hi", "_n_too_small"))]
    view = table[keep].astype(object)
    for m in metric_names:         # a percentile its sample cannot support is printed as "n<N"
        for c in ("p90", "p99"):
            if f"{m}_{c}" in view and f"{m}_n_too_small" in table:
                view[f"{m}_{c}"] = [shown(v, c, t) for v, t in zip(view[f"{m}_{c}"], table[f"{m}_n_too_small"])]
    with pd.option_context("display.width", 200, "display.max_columns", 50):
        print(view.T.to_string(float_format=lambda v: f"{v:.4g}"))
        if any("n<" in str(v) for v in view.to_numpy().ravel()):
            print("(n<N: fewer requests than that percentile's 95% interval needs; not printed as an estimate)")
        diff = results.differing_conditions(runs)
        print("\nconditions that differ:" if len(diff) else "\nno recorded condition differs")
        if len(diff):
            print(diff.to_string())
    for run in runs:
        for w in run.manifest.get("warnings", []):
            print(f"WARNING [{run.label}]: {w}")
        for line in server_lines(run.manifest):   # what the server said during the run
            print(f"[{run.label}] {line}")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        from infercourse.measure import plots
        df = pd.concat([r.df.assign(run=r.label) for r in runs], ignore_index=True)
        plots.latency_cdf(df, a.plot_metric, by="run").figure.savefig(a.plot, dpi=120, bbox_inches="tight")
        print(f"plot: {a.plot}")
    return 0

"""Results on disk: a manifest of conditions, then one JSON line per finished request.

A number without its conditions (which machine, engine version, flags, model file,
sampling, load pattern) cannot be compared with anything. `RunWriter` (`measure.runwriter`,
named here too) writes `manifest.json` *before* the first request, then appends each finished
request to `requests.jsonl` with flush + fsync, so a crash or a killed server loses nothing
already measured. `load_run` reads a run back (keeping every complete line of a run cut
short), `compare` / `differing_conditions` put runs side by side, and `report_lines` gives the
lines every summary prints (ok / error / incomplete, prompt-cache hits, goodput).

Layout of a run directory::

    manifest.json     conditions; `end_time` and `status` added by close()
    requests.jsonl    one RequestTrace per line, in completion order
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Mapping

import pandas as pd

from infercourse.core import metrics, summary
from infercourse.core.errors import InferCourseError
from infercourse.core.hashing import content_hash
from infercourse.core.trace import RequestTrace
from infercourse.measure.hardware import environment_manifest, hardware_info
from infercourse.measure.model_mix import by_model, by_model_lines
# writing a run is its own module; its names stay importable from here, where every caller finds them
from infercourse.measure.runwriter import CONDITION_KEYS, MANIFEST, REQUESTS, RunWriter, new_run_dir

__all__ = ["new_run_dir", "RunWriter", "Run", "load_run", "STATUSES", "report_lines", "compare",
           "differing_conditions", "UnfairComparisonError", "hardware_info", "environment_manifest", "content_hash",
           "CONDITION_KEYS", "MANIFEST", "REQUESTS"]


@dataclass
class Run:
    """A run read back: its conditions, one row per request, and the raw traces."""

    path: Path
    manifest: dict[str, Any]
    df: pd.DataFrame
    traces: list[RequestTrace]

    @property
    def label(self) -> str:
        return str(self.manifest.get("label") or self.path.name)


_TRACE_FIELDS = {f.name for f in fields(RequestTrace)}


def load_run(directory: str | os.PathLike) -> Run:
    """Read a run directory. A line that is not complete JSON (the run was killed while
    writing it) is skipped with a warning; every complete line is kept."""
    d = Path(directory)
    if not (d / MANIFEST).exists():
        raise FileNotFoundError(f"no {MANIFEST} in {d}: not a run directory")
    manifest = json.loads((d / MANIFEST).read_text())
    traces, bad = [], []
    path = d / REQUESTS
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            traces.append(RequestTrace(**{k: v for k, v in row.items() if k in _TRACE_FIELDS}))
        except (json.JSONDecodeError, TypeError) as e:
            bad.append((i, str(e)[:80]))
    if bad:
        warnings.warn(f"{d / REQUESTS}: skipped {len(bad)} incomplete line(s) {bad[:3]}; "
                      f"kept {len(traces)} complete request(s)", stacklevel=2)
    return Run(d, manifest, metrics.per_request_frame(traces), traces)


STATUSES = ("ok", "error", "incomplete")   # incomplete: in flight (or due) when the run stopped


def report_lines(df: pd.DataFrame, slos: Mapping[str, float] | None = None) -> list[str]:
    """The lines every run summary prints beside its percentiles: requests by status (the
    percentiles are of `ok` ones, so failed and cut-off requests must show somewhere), the
    prompt-cache hits (cached / prompt tokens: a run served from a warm cache looks many
    times faster), and goodput when SLOs are given (`summary.goodput`).

    Args:
        df: a `per_request_frame`.
        slos: metric name -> target, e.g. {"ttft_s": 0.5}; None: no goodput line.
    """
    counts = df["status"].value_counts().to_dict() if len(df) else {}
    names = list(STATUSES) + sorted(set(counts) - set(STATUSES))
    lines = ["requests: " + ", ".join(f"{int(counts.get(s, 0))} {s}" for s in names)]
    known = df[df["cached_tokens"].notna() & df["prompt_tokens"].notna()] if len(df) else df
    if len(known) and known["prompt_tokens"].sum() > 0:
        cached, prompt = float(known["cached_tokens"].sum()), float(known["prompt_tokens"].sum())
        lines.append(f"prompt cache: {cached:.0f} of {prompt:.0f} prompt tokens cached "
                     f"({cached / prompt:.0%}) over {len(known)} requests")
    else:
        lines.append("prompt cache: not reported (cached tokens unknown for this engine)")
    lines += by_model_lines(df) if len(df) else []   # a mix of models: each one's own percentiles
    if slos:
        g = summary.goodput(df, slos)
        ops = ", ".join(f"{k} {'<=' if summary.SLO_METRICS.get(k) == 'max' else '>='} {v:g}"
                        for k, v in slos.items())
        lines.append(f"goodput: {g['n_good']} of {g['n']} requests met every SLO ({ops}): "
                     f"{g['good_fraction']:.0%}, {g['goodput_requests_per_s']:.3g} req/s")
    return lines


def compare(runs: Iterable[Run], metric_names: Iterable[str] = ("ttft_s", "tpot_s", "e2e_s",
            "decode_tok_per_s"), *, seed: int = 0) -> pd.DataFrame:
    """Runs side by side: one row per run with throughput, error rate, and p50/p90/p99
    (with bootstrap CI bounds) of each metric, as `<metric>_p50` etc.; a run that sent a mix
    of models adds one row per model, `label [model]`. The error rate is
    over the requests that finished or failed: one cut off when the run stopped is
    `n_incomplete`, not an error (as the soak counts it: 14 printed 75% there and 83% here
    for the same run)."""
    rows = []
    for run in runs:
        counts = run.df["status"].value_counts() if len(run.df) else {}
        done = run.df[run.df["status"] != "incomplete"] if len(run.df) else run.df
        row: dict[str, Any] = {"run": run.label, **summary.throughput(run.df),
                               "error_rate": summary.error_rate(done),
                               **{f"n_{s}": int(counts.get(s, 0)) for s in STATUSES}}
        s = summary.summarize(run.df, metric_names, seed=seed)
        for m in s.index:
            for col in ("p50", "p90", "p99", "p99_lo", "p99_hi", "mean", "n_too_small"):
                if col in s:
                    row[f"{m}_{col}"] = s.loc[m, col]
        rows.append(row)
        if "model" in run.df and run.df["model"].notna().any():   # a mix: every metric by model too
            t = by_model(run.df, tuple(metric_names), ("p50", "p90", "p99", "mean"))
            rows += [{"run": f"{run.label} [{m}]", **r.to_dict()} for m, r in t.iterrows()]
    return pd.DataFrame(rows).set_index("run")


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = json.dumps(v, sort_keys=True, default=str) if isinstance(v, (list, dict)) else v
    return out


class UnfairComparisonError(InferCourseError):
    """Runs differ in a condition that must be the same for their numbers to be compared."""

    layer = "measurement"


def _under(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def differing_conditions(runs: Iterable[Run], ignore: Iterable[str] = (
        "start_time", "end_time", "n_requests"), *, must_match: Iterable[str] = (),
        allow: Iterable[str] = ()) -> pd.DataFrame:
    """Manifest keys (flattened, dotted: `hardware.cpu`, `sampling.seed`) whose values
    differ between runs; one column per run. A key one run lacks counts as differing.

    Args:
        ignore: keys never compared (times, counts).
        must_match: keys or prefixes (`hardware`, `fair.quantization`) that make a
            comparison unfair when they differ, or when no run records them.
        allow: keys among `must_match` that may differ: they stay in the table, so the
            comparison labels the difference instead of hiding it.

    Raises:
        UnfairComparisonError: naming each `must_match` condition that differs (with its
            value in every run) and each that no run records.
    """
    flat: dict[str, dict[str, Any]] = {}
    for r in runs:
        lab = r.label if r.label not in flat else f"{r.label}#{len(flat)}"
        flat[lab] = _flatten(r.manifest)
    keys = sorted(set().union(*(f.keys() for f in flat.values())) - set(ignore))
    diff = [k for k in keys if len({json.dumps(f.get(k), default=str) for f in flat.values()}) > 1]
    table = pd.DataFrame({lab: [f.get(k) for k in diff] for lab, f in flat.items()}, index=diff)
    must, allowed = list(must_match), list(allow)
    unfair = [k for k in diff if _under(k, must) and not _under(k, allowed)]
    unrecorded = [m for m in must if not any(_under(k, [m]) for k in keys)]
    if unfair or unrecorded:
        why = [f"{k} differs (" + ", ".join(f"{lab}={f.get(k)!r}" for lab, f in flat.items()) + ")"
               for k in unfair] + [f"{m} is recorded by no run" for m in unrecorded]
        raise UnfairComparisonError("unfair comparison: " + "; ".join(why),
                                    hint="rerun under the same conditions, or pass allow=[...] to "
                                         "compare anyway with the difference labelled")
    return table

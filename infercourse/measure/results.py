"""Results on disk: a manifest of conditions, then one JSON line per finished request.

A number without its conditions (which machine, engine version, flags, model file,
sampling, load pattern) cannot be compared with anything. `RunWriter` writes
`manifest.json` *before* the first request, then appends each finished request to
`requests.jsonl` with flush + fsync, so a crash or a killed server loses nothing already
measured. `load_run` reads it back (keeping every complete line of a run cut short), and
`compare` / `differing_conditions` put runs side by side.

Layout of a run directory::

    manifest.json     conditions; `end_time` and `status` added by close()
    requests.jsonl    one RequestTrace per line, in completion order
"""
from __future__ import annotations

import datetime as _dt
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
from infercourse.measure.hardware import environment_manifest, hardware_info, utc_now

__all__ = ["new_run_dir", "RunWriter", "Run", "load_run", "compare", "differing_conditions",
           "UnfairComparisonError",
           "hardware_info", "environment_manifest", "content_hash", "CONDITION_KEYS"]

MANIFEST, REQUESTS = "manifest.json", "requests.jsonl"
# What a caller (bench) should record beside the machine facts; missing ones are warned.
CONDITION_KEYS = ("engine", "model", "sampling", "load", "workload")


def new_run_dir(results_root: str | os.PathLike | None, label: str) -> Path | None:
    """A new folder per run under `results_root` (None: bench's default under
    `cache_dir()/runs`), so re-running a notebook adds runs instead of overwriting them."""
    if results_root is None:
        return None
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    return Path(results_root) / f"{stamp}_{label}"


def _jsonable(o: Any) -> Any:
    """numpy scalars become numbers (not strings); anything else unknown becomes text."""
    return o.item() if hasattr(o, "item") and callable(o.item) else str(o)


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=_jsonable))
    os.replace(tmp, path)   # readers see the old manifest or the new one, never half


class RunWriter:
    """Write one run: the manifest first, then a line per finished request.

    Args:
        directory: a new (or empty) directory; an existing run is never overwritten.
        manifest: the run's conditions (engine, model, sampling, load, workload...);
            machine facts from `environment_manifest()` are added unless already given.

    Use as a context manager: leaving the block closes the run, recording an error
    status if the block raised.
    """

    def __init__(self, directory: str | os.PathLike, manifest: Mapping[str, Any]):
        self.dir = Path(directory)
        if (self.dir / REQUESTS).exists() or (self.dir / MANIFEST).exists():
            raise FileExistsError(f"{self.dir} already holds a run; results are append-only, "
                                  "pick a new directory")
        self.dir.mkdir(parents=True, exist_ok=True)
        missing = [k for k in CONDITION_KEYS if k not in manifest]
        if missing:
            warnings.warn(f"manifest lacks conditions {missing}; the run will be hard to "
                          "compare", stacklevel=2)
        self.manifest = {**environment_manifest(), **manifest, "status": "running"}
        _atomic_json(self.dir / MANIFEST, self.manifest)
        self._f = open(self.dir / REQUESTS, "a", encoding="utf-8")
        self.n = 0

    def write(self, trace: RequestTrace) -> None:
        """Append one finished request and force it to disk before returning."""
        self._f.write(json.dumps(trace.as_row(), default=_jsonable) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.n += 1

    def close(self, status: str = "ok") -> None:
        """Record end time, status and request count in the manifest."""
        if self._f.closed:
            return
        self._f.close()
        self.manifest.update(end_time=utc_now(), status=status, n_requests=self.n)
        _atomic_json(self.dir / MANIFEST, self.manifest)

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, etype, exc, tb) -> None:
        self.close("ok" if exc is None else f"error: {etype.__name__}: {exc}")


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


def compare(runs: Iterable[Run], metric_names: Iterable[str] = ("ttft_s", "tpot_s", "e2e_s",
            "decode_tok_per_s"), *, seed: int = 0) -> pd.DataFrame:
    """Runs side by side: one row per run with throughput, error rate, and p50/p90/p99
    (with bootstrap CI bounds) of each metric, as `<metric>_p50` etc."""
    rows = []
    for run in runs:
        row: dict[str, Any] = {"run": run.label, **summary.throughput(run.df),
                               "error_rate": summary.error_rate(run.df)}
        s = summary.summarize(run.df, metric_names, seed=seed)
        for m in s.index:
            for col in ("p50", "p90", "p99", "p99_lo", "p99_hi", "mean"):
                if col in s:
                    row[f"{m}_{col}"] = s.loc[m, col]
        rows.append(row)
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

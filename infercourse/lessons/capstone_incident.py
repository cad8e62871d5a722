"""Notebook 21: the incident. A hidden fault on one route, the on-call snapshots, your report.

A fault drawn by seed from the fault lab (`HIDDEN`: ones that can be undone at once)
degrades one route that has a llama-server (`ops.guide_routes`), hidden from the learner, while
the agentic session is replayed on every route. A delay fault is scaled to that route's own
baseline (so it shows on a fast GPU and a slow laptop alike). The doctor takes a snapshot of
every route *during* the fault; `Incident.doctor` opens one only once the learner names a
suspect (the faulted route's report would give the answer away). The learner fills an
incident report; `grade_report` checks it and, in instructor mode, reveals the fault. Which
route changed beyond its noise is `capstone.changed_most`.
"""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from infercourse.core.errors import LAYERS
from infercourse.ops.faults import FAULTS, inject
from infercourse.ops.guide_routes import Route, replay, session_calls
from infercourse.ops.layers import doctor_engine, doctor_layers

__all__ = ["HIDDEN", "MAX_DELAY_S", "REPORT_TEMPLATE", "Incident", "run_incident", "grade_report"]

# Faults a route can suffer while the session runs, and still be undone at once.
HIDDEN = ("latency", "slow_first_byte", "cut", "reset", "5xx", "overloaded", "killed")
# the largest delay fault (see run_incident): under the faulted engine's 30-s timeout, and under the 10-s model
# lookup (GET /v1/models) the fault's own first request makes through the delaying proxy (a 12-s delay
# failed it on a busy 2-core machine, with ReadTimeout)
MAX_DELAY_S = 8.0
REPORT_TEMPLATE = {"route": None, "symptom": None, "layer": None, "evidence": None, "fix": None}


@dataclass
class Incident:
    """A replay under a hidden fault: results and the doctor snapshots taken during it."""

    seed: int
    fault: str = field(repr=False)
    route: str = field(repr=False)
    df: pd.DataFrame = field(repr=False, default=None)
    snapshots: dict[str, Any] = field(repr=False, default_factory=dict)
    delay_s: float | None = field(repr=False, default=None)   # a delay fault's size (None: not one, or the default)

    def doctor(self, route: str | None):
        """The doctor's report on `route`, taken while the incident was going on (None: a
        reminder instead; the report of the faulted route would give the answer away)."""
        if route is None:
            return "Name the route you suspect first (SUSPECT = 'C', ...): its snapshot is shown then."
        return self.snapshots[route]


def run_incident(rs: list[Route], seed: int, n_calls: int, max_tokens: int, out_dir: str | Path,
                 baseline: pd.DataFrame | None = None, scale: float = 1.0) -> Incident:
    """Draw a fault by seed, degrade one HTTP route with it, replay every route, take a
    doctor snapshot of each during the fault, undo it.

    Args:
        rs: the routes (`routes`); only ones with a llama-server can be degraded here.
        seed: draws the fault and the route.
        n_calls, max_tokens: the replay's size.
        out_dir: where the runs are saved.
        baseline: the baseline replay; a delay fault then lasts `scale` x the faulted route's
            median end-to-end time there (a fixed 2 s hides under a slow route's own 5 s), at
            most `MAX_DELAY_S`.
        scale: the delay as a multiple of that baseline median.
    """
    live = [r for r in rs if not r.skipped]
    target = random.Random(seed).choice([r for r in live if r.server is not None and hasattr(r.server, "n_parallel")])
    fault = random.Random(seed + 1).choice(HIDDEN)
    inc, frames = Incident(seed, fault, target.key), []
    delay = None
    if fault in ("latency", "slow_first_byte") and baseline is not None:
        base_e2e = baseline.loc[(baseline["route"] == target.key) & (baseline["status"] == "ok"), "e2e_s"].median()
        # capped so that a delayed call still ends inside the faulted engine's 30-s timeout
        delay = float(min(scale * base_e2e, MAX_DELAY_S)) if base_e2e == base_e2e else None   # NaN: default size
    inc.delay_s = delay
    longest = "\n".join(m["content"] for m in session_calls(n_calls, max_tokens).requests[-1].messages)
    for r in live:
        # the fault lasts the whole replay (a slow CPU included); 120 s is only the safety net
        with inject(fault, r.server, seconds=120, delay_s=delay) if r is target else contextlib.nullcontext() as f:
            url = f.url if f is not None else r.url
            # the on-call snapshot first, while the fault is surely in place; then the session
            inc.snapshots[r.key] = (doctor_layers(url, server=r.server, prompt=longest, max_tokens=max_tokens,
                                                  timeout_s=3) if url else doctor_engine(r.engine))
            # the model name from the direct route: a lookup through a delaying proxy would time out
            engine = type(r.engine)(url, model=r.engine.model, timeout=30) if f is not None else None
            frames.append(replay(r, n_calls, max_tokens, Path(out_dir) / "incident", engine=engine))
    inc.df = pd.concat(frames, ignore_index=True)
    return inc


def grade_report(report: dict[str, Any], inc: Incident, *, instructor: bool = False) -> dict[str, Any]:
    """Check an incident report: every field filled, a known layer; in instructor mode,
    reveal the fault and grade the route and the layer.

    Args:
        report: the learner's filled `REPORT_TEMPLATE`.
        inc: the incident.
        instructor: reveal the hidden fault and grade.
    """
    missing = [k for k in REPORT_TEMPLATE if not report.get(k)]
    out: dict[str, Any] = {"missing": missing, "layer_known": report.get("layer") in LAYERS}
    if missing:
        print(f"incomplete report: fill {', '.join(missing)}")
    if report.get("layer") and report.get("layer") not in LAYERS:
        print(f"layer must be one of {LAYERS}")
    if instructor:
        f = FAULTS[inc.fault]
        out.update(fault=f.name, route=inc.route, layer=f.layer, route_right=report.get("route") == inc.route,
                   layer_right=report.get("layer") == f.layer)
        size = f", {inc.delay_s:.2f} s" if inc.delay_s else ""
        print(f"INSTRUCTOR: route {inc.route} suffered '{f.name}' ({f.how}{size}): symptom '{f.symptom}', "
              f"layer {f.layer}.\n"
              f"route {'right' if out['route_right'] else 'wrong'}, layer {'right' if out['layer_right'] else 'wrong'}")
    return out

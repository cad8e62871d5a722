"""Notebook 17: an incident, end to end.

The agentic coding session (`measure.workloads.agentic_workload`) is replayed against every
route this machine has (the guide's A Ollama, B mlx_lm.server, C llama-server, D a runtime
in process), each skipped with the reason where absent. Then a fault drawn by seed from
the fault lab degrades one route, hidden from the learner. The learner compares the
incident replay with the baseline, opens the doctor snapshots taken *during* the incident,
and fills an incident report; `grade_report` checks it (and, in instructor mode, reveals
the fault).
"""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from infercourse.core.errors import LAYERS, InferCourseError
from infercourse.measure import bench
from infercourse.measure.workloads import Workload, agentic_workload
from infercourse.ops.faults import FAULTS, inject
from infercourse.ops.layers import doctor_engine, doctor_layers

__all__ = ["HIDDEN", "REPORT_TEMPLATE", "Route", "routes", "replay", "summarize", "changed_most", "Incident",
           "run_incident", "grade_report", "soak_recipe"]

# Faults a route can suffer while the session runs, and still be undone at once.
HIDDEN = ("latency", "slow_first_byte", "cut", "reset", "5xx", "overloaded", "killed")
REPORT_TEMPLATE = {"route": None, "symptom": None, "layer": None, "evidence": None, "fix": None}


@dataclass
class Route:
    """One way to serve the model: an engine (and the server behind it, if any)."""

    key: str
    name: str
    engine: Any = None
    server: Any = None
    skipped: str | None = None

    @property
    def url(self) -> str | None:
        return getattr(self.server, "url", None)


def routes(stack: contextlib.ExitStack, *, threads: int = 1, ctx_size: int = 4096,
           ollama_model: str | None = None, mlx_model: str | None = None) -> list[Route]:
    """Every route of the guide, started where possible (servers stopped with `stack`).

    Args:
        stack: an ExitStack the caller closes (servers stop with it).
        threads: CPU threads per runtime.
        ctx_size: llama-server context (one slot).
        ollama_model: an Ollama model name (route A; None: skipped).
        mlx_model: an MLX model folder (routes B and D-MLX; None: skipped).
    """
    from infercourse.ops.doctor import engine_status
    st, out = engine_status(), []
    if not st["ollama"]["usable"] or not ollama_model:
        out.append(Route("A", "Ollama", skipped=st["ollama"]["why"] if not st["ollama"]["usable"]
                         else "set OLLAMA_MODEL to a model Ollama has pulled"))
    else:
        from infercourse.engines.ollama import OllamaEngine
        out.append(Route("A", "Ollama", OllamaEngine(ollama_model)))
    if not st["mlx"]["usable"] or not mlx_model:
        out.append(Route("B", "mlx_lm.server", skipped=st["mlx"]["why"] if not st["mlx"]["usable"]
                         else "set MLX_MODEL to an MLX model folder"))
    else:
        from infercourse.servers.mlx import MLXServer
        srv = stack.enter_context(MLXServer(mlx_model))
        out.append(Route("B", "mlx_lm.server", srv.engine(timeout=60), srv))
    try:
        from infercourse.ops.faults import small_server
        srv = stack.enter_context(small_server(threads=threads, n_parallel=1, ctx_size=ctx_size))
        out.append(Route("C", "llama-server", srv.engine(timeout=60), srv))
    except InferCourseError as e:
        out.append(Route("C", "llama-server", skipped=str(e)))
    from infercourse.engines.llamacpp import LlamaCppEngine
    out.append(Route("D", "llama.cpp in process (the guide's D is MLX-LM in process)",
                     LlamaCppEngine(n_ctx=ctx_size, n_threads=threads)))
    return out


def _calls(n_calls: int, max_tokens: int) -> Workload:
    w = agentic_workload()
    reqs = tuple(replace(r, max_tokens=min(r.max_tokens, max_tokens)) for r in w.requests[:n_calls])
    return Workload(f"{w.name}-first{n_calls}", reqs)


def replay(route: Route, n_calls: int, max_tokens: int, out_dir: str | Path, engine=None) -> pd.DataFrame:
    """The first `n_calls` calls of the agentic session, one after another: one row per call."""
    r = bench.run(engine or route.engine, _calls(n_calls, max_tokens), warmup=0, progress=False,
                  max_duration_s=30, out_dir=Path(out_dir) / route.key, label=f"route {route.key}")
    return r.df.assign(route=route.key)


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per route: calls, errors, the first error, TTFT and end-to-end p50."""
    g = df.groupby("route")
    first_err = g["error"].agg(lambda s: next((str(e)[:90] for e in s if isinstance(e, str) and e), ""))
    return pd.DataFrame({"calls": g.size(), "errors": g["status"].agg(lambda s: int((s != "ok").sum())),
                         "ttft_p50_s": g["ttft_s"].median(), "e2e_p50_s": g["e2e_s"].median(),
                         "first error": first_err})


def changed_most(baseline: pd.DataFrame, incident: pd.DataFrame) -> tuple[str, str]:
    """(route, why): the route with the most new errors, else the largest end-to-end slowdown."""
    b, i = summarize(baseline), summarize(incident)
    new_errors = (i["errors"] - b["errors"].reindex(i.index).fillna(0)).sort_values(ascending=False)
    if new_errors.iloc[0] > 0:
        route = new_errors.index[0]
        return route, f"{int(i['errors'][route])} of {int(i['calls'][route])} calls failed ({i['first error'][route]})"
    ratio = (i["e2e_p50_s"] / b["e2e_p50_s"].reindex(i.index)).sort_values(ascending=False)
    return ratio.index[0], f"median end-to-end x{ratio.iloc[0]:.1f} the baseline's"


@dataclass
class Incident:
    """A replay under a hidden fault: results and the doctor snapshots taken during it."""

    seed: int
    fault: str = field(repr=False)
    route: str = field(repr=False)
    df: pd.DataFrame = field(repr=False, default=None)
    snapshots: dict[str, Any] = field(repr=False, default_factory=dict)

    def doctor(self, route: str):
        """The doctor's report on `route`, taken while the incident was going on."""
        return self.snapshots[route]


def run_incident(rs: list[Route], seed: int, n_calls: int, max_tokens: int, out_dir: str | Path) -> Incident:
    """Draw a fault by seed, degrade one HTTP route with it, replay every route, take a
    doctor snapshot of each during the fault, undo it.

    Args:
        rs: the routes (`routes`); only ones with a llama-server can be degraded here.
        seed: draws the fault and the route.
        n_calls, max_tokens: the replay's size.
        out_dir: where the runs are saved.
    """
    live = [r for r in rs if not r.skipped]
    target = random.Random(seed).choice([r for r in live if r.server is not None and hasattr(r.server, "n_parallel")])
    fault = random.Random(seed + 1).choice(HIDDEN)
    inc, frames = Incident(seed, fault, target.key), []
    longest = "\n".join(m["content"] for m in _calls(n_calls, max_tokens).requests[-1].messages)
    for r in live:
        # the fault lasts the whole replay (a slow CPU included); 120 s is only the safety net
        with inject(fault, r.server, seconds=120) if r is target else contextlib.nullcontext() as f:
            url = f.url if f is not None else r.url
            # the on-call snapshot first, while the fault is surely in place; then the session
            inc.snapshots[r.key] = (doctor_layers(url, server=r.server, prompt=longest, max_tokens=max_tokens,
                                                  timeout_s=3) if url else doctor_engine(r.engine))
            engine = type(r.engine)(url, timeout=30) if f is not None else None
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
        print(f"INSTRUCTOR: route {inc.route} suffered '{f.name}' ({f.how}): symptom '{f.symptom}', layer {f.layer}.\n"
              f"route {'right' if out['route_right'] else 'wrong'}, layer {'right' if out['layer_right'] else 'wrong'}")
    return out


def soak_recipe(hours: float = 24.0, url: str | None = None) -> str:
    """The command for a long stability run (notebook 14's soak) on the route you fixed."""
    target = f"--url {url}" if url else "--server llama --parallel 2"
    return (f"infercourse soak {target} --duration {hours:g}h --workload agentic --concurrency 2 "
            f"--out soak-{hours:g}h   # then: infercourse report soak-{hours:g}h")

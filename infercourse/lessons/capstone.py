"""Notebook 21: an incident, end to end.

The agentic coding session (`measure.workloads.agentic_workload`) is replayed against every
route this machine has, each skipped with the reason where absent. The guide's routes, and
exactly what runs for each here:

- **A** Ollama: an Ollama server you run, serving a model created from the course's own GGUF
  (`OllamaEngine.from_gguf`: the same weights as C and D), or `ollama_model` if you name one
  (its own file, said in the route's name);
- **B** `mlx_lm.server` on an MLX folder (`mlx_model`), or vLLM's CPU build on the same
  weights in float32 where its environment exists (`vllm=True`);
- **C** llama-server on the embedded GGUF (the only route a fault can be injected into);
- **D** MLX-LM in process (the guide's D) on the embedded weights converted to MLX, wherever
  MLX imports (`mlx[cpu]` on Linux: slow, but it runs); else llama.cpp in process, named so.

The baseline is replayed twice (A/A): the difference between the two is each route's noise
floor. Then a fault drawn by seed from the fault lab degrades one route, hidden from the
learner, with a delay scaled to that route's own baseline (so it shows on a fast GPU and a
slow laptop alike). The learner compares the incident with the baseline, opens the doctor
snapshot of the route they suspect, and fills an incident report; `grade_report` checks it
(and, in instructor mode, reveals the fault). `changed_most` names a route only when it
changed beyond its floor.
"""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from infercourse.core.errors import LAYERS, InferCourseError
from infercourse.measure import bench, noise
from infercourse.measure.workloads import Workload, agentic_workload
from infercourse.ops.faults import FAULTS, inject
from infercourse.ops.layers import doctor_engine, doctor_layers

__all__ = ["HIDDEN", "REPORT_TEMPLATE", "Route", "routes", "replay", "summarize", "floors", "changed_most", "Incident",
           "run_incident", "grade_report", "soak_recipe"]

# Faults a route can suffer while the session runs, and still be undone at once.
HIDDEN = ("latency", "slow_first_byte", "cut", "reset", "5xx", "overloaded", "killed")
# the largest delay fault (see run_incident): under the replay timeout (30 s), and under the 10-s model
# lookup (GET /v1/models) the fault's own first request makes through the delaying proxy (a 12-s delay
# failed it on a busy 2-core machine, with ReadTimeout)
MAX_DELAY_S = 8.0
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
           ollama_model: str | None = None, mlx_model: str | None = None, vllm: bool = False,
           route_d: str = "auto", status: dict | None = None) -> list[Route]:
    """Every route of the guide, started where possible (servers stopped with `stack`); each
    route's name says exactly what runs, and a skipped one says why.

    Args:
        stack: an ExitStack the caller closes (servers stop with it).
        threads: CPU threads per runtime.
        ctx_size: llama-server context (one slot).
        ollama_model: an Ollama model name for route A (None: a model created from the
            course's GGUF, the same weights as C and D).
        mlx_model: an MLX model folder (route B's mlx_lm.server; None: skipped unless `vllm`).
        vllm: route B is vLLM's CPU build on the embedded weights (float32), where its
            environment exists (minutes to start).
        route_d: "auto" (MLX-LM in process where MLX imports, else llama.cpp in process),
            "mlx" or "llama.cpp".
        status: `doctor.engine_status()` (None: asked now).
    """
    from infercourse.ops.doctor import engine_status
    st, out = status or engine_status(), []
    if route_d not in ("auto", "mlx", "llama.cpp"):
        raise ValueError(f"route_d must be 'auto', 'mlx' or 'llama.cpp', got {route_d!r}")
    if not st["ollama"]["usable"]:
        out.append(Route("A", "Ollama", skipped=st["ollama"]["why"]))
    else:
        from infercourse.engines.ollama import OllamaEngine
        if ollama_model:
            out.append(Route("A", f"Ollama ({ollama_model}: its own file, not the course's)",
                             OllamaEngine(ollama_model)))
        else:
            try:
                eng = OllamaEngine.from_gguf()
                out.append(Route("A", f"Ollama ({eng.model}, created from the course's GGUF)", eng))
            except InferCourseError as e:   # the server refused the file: the row says so
                out.append(Route("A", "Ollama (the course's GGUF)", skipped=str(e)))
    if vllm:
        if not st["vllm"]["usable"]:
            out.append(Route("B", "vLLM CPU (OpenAI server)", skipped=st["vllm"]["why"]))
        else:
            from infercourse.models.formats import hf_folder
            from infercourse.servers import VLLMServer
            srv = stack.enter_context(VLLMServer(hf_folder(), max_model_len=ctx_size))
            out.append(Route("B", "vLLM CPU (OpenAI server, float32 weights)", srv.engine(timeout=60), srv))
    elif not st["mlx"]["usable"] or not mlx_model:
        out.append(Route("B", "mlx_lm.server", skipped=st["mlx"]["why"] if not st["mlx"]["usable"]
                         else "set MLX_MODEL to an MLX model folder (or VLLM = True where vLLM is installed)"))
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
    out.append(_route_d(route_d, st["mlx"], threads=threads, ctx_size=ctx_size))
    return out


def _route_d(choice: str, mlx: dict[str, Any], *, threads: int, ctx_size: int) -> Route:
    """Route D, named after what runs: MLX-LM in process (the guide's D) where MLX imports."""
    if choice == "mlx" and not mlx["usable"]:
        return Route("D", "MLX-LM in process", skipped=mlx["why"])
    if choice == "mlx" or (choice == "auto" and mlx["usable"]):
        from infercourse.engines.mlx_engine import MLXEngine
        from infercourse.models.formats import mlx_folder
        return Route("D", "MLX-LM in process (embedded weights as MLX)", MLXEngine(mlx_folder()))
    from infercourse.engines.llamacpp import LlamaCppEngine
    why = "" if choice == "llama.cpp" else f"; not MLX-LM, the guide's D: {mlx['why']}"
    return Route("D", f"llama.cpp in process (llama-cpp-python{why})",
                 LlamaCppEngine(n_ctx=ctx_size, n_threads=threads))


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


def _per_call(df: pd.DataFrame, route: str, metric: str = "e2e_s") -> pd.Series:
    ok = df[(df["route"] == route) & (df["status"] == "ok")]
    return ok.set_index("request_id")[metric]


def floors(baseline: pd.DataFrame, again: pd.DataFrame, metric: str = "e2e_s") -> dict[str, "noise.NoiseFloor | None"]:
    """Each route's A/A noise floor: the baseline replay against its repeat, call by call.
    The whole `NoiseFloor` (its `.floor` is the band): `changed_most` hands it to
    `noise.compare`, whose paired test needs the A/A trials, not only the band (the band
    alone can never pass with fewer than 6 calls)."""
    out = {}
    for route in sorted(set(baseline["route"]) & set(again["route"])):
        both = pd.concat([_per_call(baseline, route, metric), _per_call(again, route, metric)], axis=1,
                         join="inner").dropna()
        out[route] = noise.noise_floor(both.iloc[:, 0], both.iloc[:, 1]) if len(both) else None
    return out


def changed_most(baseline: pd.DataFrame, incident: pd.DataFrame,
                 floor: dict[str, float] | None = None) -> tuple[str | None, str]:
    """(route, why): the route with the most new errors; else the largest end-to-end slowdown
    that clears that route's A/A floor (`floors`), call by call; else (None, why not).

    Args:
        baseline, incident: `replay` frames (a `route` column), the same calls.
        floor: {route: its `NoiseFloor` from `floors`}; None or a missing route: 0 (no floor, said so).
    """
    b, i = summarize(baseline), summarize(incident)
    new_errors = (i["errors"] - b["errors"].reindex(i.index).fillna(0)).sort_values(ascending=False)
    if new_errors.iloc[0] > 0:
        route = new_errors.index[0]
        return route, f"{int(i['errors'][route])} of {int(i['calls'][route])} calls failed ({i['first error'][route]})"
    beyond = {}
    for route in i.index:
        both = pd.concat([_per_call(baseline, route), _per_call(incident, route)], axis=1, join="inner").dropna()
        if len(both):
            c = noise.compare(both.iloc[:, 0], both.iloc[:, 1], (floor or {}).get(route) or 0.0,
                              labels=("baseline", "incident"))
            if c.verdict == "baseline faster":
                beyond[route] = c
    if not beyond:
        return None, "no route changed beyond its A/A noise floor: look for errors in the doctor snapshots"
    route = max(beyond, key=lambda r: beyond[r].interval.median)
    return route, f"median end-to-end x{beyond[route].interval.median:.1f} the baseline's ({beyond[route].text})"


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
        # capped so that a delayed call still ends inside the replay's 30 s timeout
        delay = float(min(scale * base_e2e, MAX_DELAY_S)) if base_e2e == base_e2e else None   # NaN: default size
    inc.delay_s = delay
    longest = "\n".join(m["content"] for m in _calls(n_calls, max_tokens).requests[-1].messages)
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


def soak_recipe(hours: float = 24.0, url: str | None = None) -> str:
    """The command for a long stability run (notebook 15's soak) on the route you fixed."""
    target = f"--url {url}" if url else "--server llama --parallel 2"
    return (f"infercourse soak {target} --duration {hours:g}h --workload agentic --concurrency 2 "
            f"--out soak-{hours:g}h   # then: infercourse report soak-{hours:g}h")

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
floor. `fastest` names a route only when its TTFT beats every other route's beyond the A/A
noise of both routes compared (else it says no route is distinguishable). Then a fault
drawn by seed from the fault lab degrades one route, hidden from the learner, with a delay
scaled to that route's own baseline (so it shows on a fast GPU and a slow laptop alike). The
learner compares the incident with the baseline, opens the doctor snapshot of the route they
suspect, and fills an incident report; `grade_report` checks it (and, in instructor mode,
reveals the fault). `changed_most` names a route only when it changed beyond its floor.
`delay_trial`, `predicted_e2e` and `delay_exercise` are the exercises' predict, change,
measure: a delay fault of a chosen size on route C, its end-to-end time predicted from the
baseline's own calls, then measured; `ratio_exercise` measures one route's TTFT against
another's, for a guess made before the baseline.
"""
from __future__ import annotations

import contextlib
import itertools
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from infercourse.core.errors import LAYERS, InferCourseError
from infercourse.measure import bench, claims, noise
from infercourse.measure.workloads import Workload, agentic_workload
from infercourse.ops.faults import FAULTS, inject
from infercourse.ops.layers import doctor_engine, doctor_layers

__all__ = ["HIDDEN", "REPORT_TEMPLATE", "Route", "routes", "replay", "summarize", "floors", "route_comparison",
           "fastest", "changed_most", "Incident", "run_incident", "grade_report", "delay_trial", "predicted_e2e",
           "delay_text", "delay_exercise", "ratio_exercise", "soak_recipe"]

# Faults a route can suffer while the session runs, and still be undone at once.
HIDDEN = ("latency", "slow_first_byte", "cut", "reset", "5xx", "overloaded", "killed")
# the largest delay fault (see run_incident): under the faulted engine's 30-s timeout, and under the 10-s model
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


# a guard against a hung route, not a budget: every route sends all its calls, so the routes are
# compared on the same calls (a 30-s budget let MLX on a 2-core CPU, ~75 s a call, send one of three)
REPLAY_GUARD_S = 1800


def replay(route: Route, n_calls: int, max_tokens: int, out_dir: str | Path, engine=None) -> pd.DataFrame:
    """The first `n_calls` calls of the agentic session, one after another: one row per call.
    Every call is sent however slow the route (`REPLAY_GUARD_S` only stops a hung one)."""
    r = bench.run(engine or route.engine, _calls(n_calls, max_tokens), warmup=0, progress=False,
                  max_duration_s=REPLAY_GUARD_S, out_dir=Path(out_dir) / route.key, label=f"route {route.key}")
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


def route_comparison(baseline: pd.DataFrame, again: pd.DataFrame, x: str, y: str,
                     metric: str = "ttft_s") -> tuple["noise.Comparison | None", "noise.Comparison | None"]:
    """Route y against route x on the same calls, tested twice: with x's A/A rerun as data
    (`noise.compare`'s joint test), and with y's. (None, None): no call both answered twice."""
    cols = [_per_call(df, r, metric) for r in (x, y) for df in (baseline, again)]
    both = pd.concat(cols, axis=1, join="inner").dropna()
    if both.empty:
        return None, None
    xb, xa, yb, ya = (both.iloc[:, i].to_numpy(float) for i in range(4))
    cx = noise.compare(xb, yb, noise.noise_floor(xb, xa), labels=(f"route {x}", f"route {y}"))
    cy = noise.compare(yb, xb, noise.noise_floor(yb, ya), labels=(f"route {y}", f"route {x}"))
    return cx, cy


def fastest(baseline: pd.DataFrame, again: pd.DataFrame, metric: str = "ttft_s") -> dict[str, Any]:
    """Which route answered fastest, if this run can tell: a route counts only when its
    `metric` beat every other route's beyond the A/A noise of both routes compared
    (`route_comparison`: both tests agree). Returns {"route": the letter or None, "answer":
    what exercise 1 accepts (the letter; "none" when no route is distinguishable; the only
    route when one ran), "medians", "text": the verdicts in words}.

    Args:
        baseline, again: the baseline replay and its A/A repeat (`replay` frames).
        metric: a per-call column ("ttft_s", "e2e_s").
    """
    live = sorted(r for r in set(baseline["route"]) & set(again["route"])
                  if len(_per_call(baseline, r, metric)) and len(_per_call(again, r, metric)))
    name = {"ttft_s": "TTFT", "e2e_s": "E2E"}.get(metric, metric)
    med = {r: float(_per_call(baseline, r, metric).median()) for r in live}
    meds = ", ".join(f"{r} {v:.3g} s" for r, v in med.items())
    if len(live) < 2:
        only = live[0] if live else None
        text = (f"Only route {only} answered in both replays ({meds}): there is no other route to rank it against."
                if only else "No route answered in both replays: nothing to rank.")
        return {"route": None, "answer": only or "none", "medians": med, "text": text}
    pairs = {(x, y): route_comparison(baseline, again, x, y, metric) for x, y in itertools.combinations(live, 2)}

    def verdicts(x: str, y: str) -> tuple:
        cs = pairs[(x, y)] if (x, y) in pairs else pairs[(y, x)]
        return tuple(c.verdict for c in cs if c is not None)

    def beats(x: str, y: str) -> bool:
        v = verdicts(x, y)
        return len(v) == 2 and all(s == f"route {x} faster" for s in v)

    winner = next((x for x in live if all(beats(x, y) for y in live if y != x)), None)
    lead = winner or min(med, key=med.get)
    lines = [f"Baseline median {name} per route: {meds} (the same calls on each route)."]
    for y in (r for r in live if r != lead):
        cx, cy = pairs[(lead, y)] if (lead, y) in pairs else pairs[(y, lead)][::-1]
        if cx is None:
            lines.append(f"- route {y}: no call answered on both routes in both replays; not compared.")
            continue
        lines.append(f"- {claims.verdict_sentence(cx, name)} With route {y}'s own A/A rerun as the reference: "
                     f"{cy.said} (p = {cy.p:.2g}).")
    if winner:
        lines.append(f"**Route {winner} answered fastest**: its {name} beat every other route's beyond the A/A "
                     "noise of both routes compared.")
    else:
        others = [y for y in live if y != lead]
        pair = {y: (pairs[(lead, y)] if (lead, y) in pairs else pairs[(y, lead)])[0] for y in others}
        few = [y for y in others if pair[y] is None or pair[y].too_few]
        tied = [y for y in others if y not in few and not beats(lead, y) and not beats(y, lead)]
        lost = [y for y in others if beats(y, lead)]
        why = [f"against route {', '.join(tied)} the difference did not clear the A/A noise of both routes"
               ] if tied else []
        why += [f"route {', '.join(few)} answered too few of the same calls in both replays for the test to pass "
                f"(it needs {max(c.fewest for c in pair.values() if c is not None) if any(pair.values()) else 3})"
                ] if few else []
        why += [f"route {', '.join(lost)} beat it call by call (paired ratios) beyond the noise, yet not every other "
                "route"] if lost else []
        lines.append(f"**No route is distinguishable as fastest**: route {lead} had the lowest median, but "
                     + "; ".join(why) + ": this run cannot name one (more calls, `N_CALLS`, give the test more pairs).")
    return {"route": winner, "answer": winner or "none", "medians": med, "text": "\n".join(lines)}


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
    beyond, few = {}, []
    for route in i.index:
        both = pd.concat([_per_call(baseline, route), _per_call(incident, route)], axis=1, join="inner").dropna()
        if len(both):
            c = noise.compare(both.iloc[:, 0], both.iloc[:, 1], (floor or {}).get(route) or 0.0,
                              labels=("baseline", "incident"))
            if c.verdict == "baseline faster":
                beyond[route] = c
            few += [f"{route} ({c.said})"] if c.too_few else []
    if not beyond:
        unjudged = f"; too few calls to judge on {', '.join(few)}" if few else ""
        return None, f"no route changed beyond its A/A noise floor{unjudged}: look for errors in the doctor snapshots"
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
        # capped so that a delayed call still ends inside the faulted engine's 30-s timeout
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


def delay_trial(rs: list[Route], fault: str, delay_s: float, n_calls: int, max_tokens: int, out_dir: str | Path,
                route: str = "C") -> pd.DataFrame | None:
    """The baseline's calls on `route` through a delay fault (`latency` or `slow_first_byte`)
    of `delay_s`, for the exercises (None: that route did not run here)."""
    r = next((r for r in rs if r.key == route and not r.skipped and r.server is not None), None)
    if r is None:
        return None
    with inject(fault, r.server, seconds=120, delay_s=delay_s) as f:
        engine = type(r.engine)(f.url, model=r.engine.model, timeout=30)
        return replay(r, n_calls, max_tokens, Path(out_dir) / f"{fault}-{delay_s:g}s", engine=engine)


def predicted_e2e(baseline: pd.DataFrame, fault: str, delay_s: float, route: str = "C") -> float:
    """Median end-to-end time of the baseline's calls on `route` under a delay fault,
    predicted call by call from what the proxy does: `latency` holds the response and then
    every chunk `delay_s` late, so every call ends `delay_s` later; `slow_first_byte` holds
    the first chunk `delay_s` past its arrival and then sends what queued meanwhile at once,
    so a call ends at max(its own end, its first token + `delay_s`)."""
    ok = baseline[(baseline["route"] == route) & (baseline["status"] == "ok")]
    if fault == "latency":
        per = ok["e2e_s"] + delay_s
    elif fault == "slow_first_byte":
        per = np.maximum(ok["e2e_s"], ok["ttft_s"] + delay_s)
    else:
        raise ValueError(f"only the delay faults have a predicted time, not {fault!r}")
    return float(per.median())


def delay_text(baseline: pd.DataFrame, trial: pd.DataFrame, fault: str, delay_s: float,
               floor: dict[str, Any] | None, route: str = "C") -> str:
    """The delay trial against its prediction and against the route's A/A floor."""
    pred = predicted_e2e(baseline, fault, delay_s, route)
    got = float(trial.loc[trial["status"] == "ok", "e2e_s"].median())
    failed = int((trial["status"] != "ok").sum())
    both = pd.concat([_per_call(baseline, route), _per_call(trial, route)], axis=1, join="inner").dropna()
    head = (f"`{fault}` of {delay_s:g} s on route {route}: median E2E predicted {pred:.3g} s, measured {got:.3g} s "
            f"(measured ÷ predicted {got / pred:.2f}×){f'; {failed} call(s) failed' if failed else ''}.")
    if both.empty:
        return head + " No call answered in both the baseline and the trial: no verdict."
    c = noise.compare(both.iloc[:, 0], both.iloc[:, 1], (floor or {}).get(route) or 0.0,
                      labels=("baseline", fault))
    return f"{head} Against the baseline: {claims.verdict_sentence(c, 'E2E')}"


def delay_exercise(guess: float | None, rs: list[Route], baseline: pd.DataFrame, floor: dict[str, Any] | None,
                   fault: str, delay_s: float, n_calls: int, max_tokens: int, out_dir: str | Path,
                   route: str = "C") -> dict[str, Any] | None:
    """Exercises 4 and 5: `route`'s median E2E under a delay fault, `predicted` from the
    baseline (`predicted_e2e`) and `measured` (`delay_trial`; None: not measured), with
    `delay_text`. Runs nothing, and returns None, while the guess is None."""
    if guess is None:
        print("Not answered yet: write your guess first, then re-run this cell (it injects the fault and measures).")
        return None
    pred = predicted_e2e(baseline, fault, delay_s, route)
    trial = delay_trial(rs, fault, delay_s, n_calls, max_tokens, out_dir, route)
    if trial is None:
        return {"predicted": pred, "measured": None,
                "text": f"Route {route} did not run here (see the routes table): nothing to inject the fault into."}
    ok = trial.loc[trial["status"] == "ok", "e2e_s"]
    if ok.empty:
        return {"predicted": pred, "measured": None,
                "text": f"Every call through the `{fault}` fault failed: {summarize(trial)['first error'].iloc[0]}"}
    return {"predicted": pred, "measured": float(ok.median()),
            "text": delay_text(baseline, trial, fault, delay_s, floor, route)}


def ratio_exercise(guess: float | None, baseline: pd.DataFrame, again: pd.DataFrame, route: str,
                   ref: str = "C") -> dict[str, Any] | None:
    """Exercise 6: `route`'s TTFT over `ref`'s, the `measured` median paired ratio (None:
    not both ran) and its verdict; None while the guess is None."""
    if guess is None:
        print("No guess recorded: set MY_TTFT_RATIO in the Predict cell, before the baseline runs.")
        return None
    c, _ = route_comparison(baseline, again, ref, route)
    if c is None:
        return {"measured": None,
                "text": f"Routes {ref} and {route} did not both answer the baseline twice here: nothing to compare."}
    return {"measured": c.interval.median, "text": claims.verdict_sentence(c, "TTFT")}


def soak_recipe(hours: float = 24.0, url: str | None = None) -> str:
    """The command for a long stability run (notebook 15's soak) on the route you fixed."""
    target = f"--url {url}" if url else "--server llama --parallel 2"
    return (f"infercourse soak {target} --duration {hours:g}h --workload agentic --concurrency 2 "
            f"--out soak-{hours:g}h   # then: infercourse report soak-{hours:g}h")

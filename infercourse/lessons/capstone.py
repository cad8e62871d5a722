"""Notebook 21: an incident, end to end. Which route changed, and beyond what noise?

The agentic coding session is replayed on every route of the guide this machine has
(`ops.guide_routes`: A Ollama, B mlx_lm.server or vLLM, C llama-server, D in process), each
skipped with the reason where absent. The baseline is replayed twice (A/A): the difference
between the two is each route's noise floor (`floors`). `fastest` names a route only when its
TTFT beats every other route's beyond the A/A noise of both routes compared (else it says no
route is distinguishable, and why: inside the noise, or too few pairs for the test). Then a
hidden fault degrades one route (`lessons.capstone_incident`); `changed_most` names the route
with new errors, else the one whose slowdown cleared its own floor, else none, saying why.
`delay_trial`, `predicted_e2e` and `delay_exercise` are the exercises' predict, change,
measure: a delay fault of a chosen size on route C, its end-to-end time predicted from the
baseline's own calls, then measured; `ratio_exercise` measures one route's TTFT against
another's, for a guess made before the baseline.
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from infercourse.measure import claims, noise
from infercourse.ops.faults import inject
# the routes and the replay live in ops.guide_routes; named here too (tests/test_claims.py reads
# capstone.routes and capstone._route_d)
from infercourse.ops.guide_routes import Route, _route_d, replay, routes  # noqa: F401

__all__ = ["Route", "routes", "replay", "summarize", "floors", "route_comparison", "fastest", "changed_most",
           "delay_trial", "predicted_e2e", "delay_text", "delay_exercise", "ratio_exercise", "soak_recipe"]


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
                     f"{cy.said} ({claims.p_text(cy)}).")
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
        n_pairs = {y: pair[y].interval.n if pair[y] is not None else 0 for y in few}
        need = max(c.fewest for c in pair.values() if c is not None) if any(pair.values()) else 3
        why += [f"against route {', '.join(few)} only {', '.join(str(n_pairs[y]) for y in few)} call(s) were answered "
                f"on both routes in both replays: too few of the same calls for the test to pass (it needs {need}; "
                "`N_CALLS` sets how many calls each route replays)"] if few else []
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

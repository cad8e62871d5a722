"""How long will the course take on this machine? Two short probes, scaled by a reference.

The course map's run times were measured on one machine (`data/reference_machine.json`
says which, how loaded it was, and what the probes gave there). Machines differ a lot, and
not in one way: a fresh 2-core Intel VM ran most notebooks faster than the reference while
its single-thread probe was slower (the old one-number forecast said 132 min; the course
took 81). So a learner's machine runs two probes of a few seconds each, on the embedded model
in process:

- `probe_s`: one thread, a ~100-token prompt and 32 forced tokens: what most notebooks do
  (small single-thread prefills and decodes, servers started and stopped);
- `prefill_probe_s`: llama.cpp's own thread count, one cold prefill of `PREFILL_TOKENS`: what
  the notebooks dominated by a real agent's 12k-token prompts do (`PREFILL_BOUND`), whose
  time scales with the machine's prefill speed on all its cores, not with one thread's.

Each notebook's forecast is its reference time times the ratio of its probe (here ÷
reference), and the course's is their sum. A notebook that runs for a set wall-clock time
(15's soak: `SOAK_S` seconds on any machine) keeps that part as it is (`fixed_s`) and scales
the rest: on a machine 1.4x slower by the probe, 15 took 1.07x its reference time.

What no probe sees: a GPU, a faster disk, torch (the probes time llama.cpp: on a second 2-core
machine, forecast ÷ measured ran from 0.78 for 10 to 1.48 for 09, 12 of 22 within 15 %, the
course 0.91), how a real agent behaves (how often it compacts or retries depends on the agent,
not the machine), and load: the load average is printed beside the forecast, and the probes were
timed on the machine as it is now. A shared VM's pace also drifts while the course runs (one
run here took 13-22 % longer per notebook than the same code an hour before, and the probes
read after it saw nothing), so `infercourse course` reads the pace again before each notebook
(`reading`, ~3 s; `run_pace` puts each notebook's time beside the forecast at the run's pace,
the median of its readings against the reference run's, and scales the run to the reference's
pace).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["REFERENCE", "PREFILL_BOUND", "fixed_s", "probe_s", "prefill_probe_s", "probes", "reading", "predict", "forecast_table",
           "readings_median", "run_pace", "run_pace_table",
           "save_reference", "pace_main"]

REFERENCE = Path(__file__).resolve().parents[2] / "data" / "reference_machine.json"
PROMPT = "Explain, step by step, how a compiler turns source code into a program. " * 6
PROBE_TOKENS = 32
PREFILL_TOKENS = 512
# notebooks whose time is mostly long cold prefills on every core (real agents' first requests,
# the long-context prefill curve): scaled by the prefill probe; the rest by the one-thread probe
PREFILL_BOUND = ("03_prefill_vs_decode", "19_coding_agent", "20_real_coding_agent")


def fixed_s(size: str = "full") -> dict[str, float]:
    """Per notebook, the seconds of its run at `size` that are a set wall-clock duration, as long
    on every machine, so no probe scales them: 15's soak (the default profile's `soak_s` at full
    size, notebooks/ci_params.json's `SOAK_S` at CI size)."""
    from infercourse.ops.ci_size import ci_params
    from infercourse.ops.profiles import profile
    soak = ci_params("15_stability").get("SOAK_S") if size == "ci" else profile("cpu").soak_s
    return {"15_stability": float(soak)} if soak else {}


def _timed(engine, request, repeats: int) -> float:
    for _ in engine.stream(request):      # warm-up: page the weights in, build the graph
        pass
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in engine.stream(request):
            pass
        times.append(time.perf_counter() - t0)
    return min(times)     # the machine's speed: interference only ever adds time


def probe_s(repeats: int = 5) -> float:
    """Fastest wall seconds of one fixed request (prefill ~100 tokens, decode 32) on the
    embedded model, llama.cpp in process, one thread. The model load is not timed."""
    from infercourse.core.types import Request
    from infercourse.engines.llamacpp import LlamaCppEngine
    eng = LlamaCppEngine(n_threads=1, n_ctx=512)
    return _timed(eng, Request(prompt=PROMPT, max_tokens=PROBE_TOKENS, ignore_eos=True, cache_prompt=False), repeats)


def prefill_probe_s(repeats: int = 4) -> float:
    """Fastest wall seconds of one cold prefill of `PREFILL_TOKENS` tokens (one output token)
    on the embedded model, llama.cpp in process at its own thread count (the physical cores)."""
    from infercourse.core.types import Request
    from infercourse.engines.llamacpp import LlamaCppEngine
    from infercourse.measure.workloads import exact_length_prompt
    from infercourse.models.embedded import vocab_tokenizer
    eng = LlamaCppEngine(n_threads=None, n_ctx=PREFILL_TOKENS + 64)
    prompt = exact_length_prompt(PREFILL_TOKENS, vocab_tokenizer())
    return _timed(eng, Request(prompt=prompt, max_tokens=1, cache_prompt=False), repeats)


def probes() -> dict[str, float]:
    """Both probes, as `predict` and `save_reference` take them."""
    return {"probe_s": probe_s(), "prefill_probe_s": prefill_probe_s()}


def reading(prefill: bool = False) -> dict[str, float]:
    """The pace now, read between two notebooks of a course run: the one-thread probe once after
    its warm-up (~2 s), and the prefill probe too for a notebook of `PREFILL_BOUND` (`prefill`,
    ~3.5 s). One timed run each: the run is scaled by the median of all its readings
    (`run_pace`), and a second run added ~1.2 s before each notebook (~30 s a course)."""
    r = {"probe_s": probe_s(repeats=1)}
    if prefill:
        r["prefill_probe_s"] = prefill_probe_s(repeats=1)
    return r


def _ratios(probe: dict[str, float], reference: dict[str, Any]) -> dict[str, float]:
    r = {"probe": probe["probe_s"] / reference["probe_s"]}
    if probe.get("prefill_probe_s") and reference.get("prefill_probe_s"):
        r["prefill"] = probe["prefill_probe_s"] / reference["prefill_probe_s"]
    return r


def _scaled(reference_s: float, fixed: float, ratio: float) -> float:
    fixed = min(fixed, reference_s)
    return fixed + (reference_s - fixed) * ratio


def predict(probe: float | dict[str, float], reference: dict[str, Any]) -> dict[str, Any]:
    """Course times on this machine from its probes and the reference's figures: per
    notebook (its reference time × its probe's ratio, but for the set durations of `fixed_s`,
    kept as they are) and in all.

    Args:
        probe: this machine's `probes()` (a bare number: the one-thread probe only).
        reference: the contents of data/reference_machine.json.
    """
    probe = probe if isinstance(probe, dict) else {"probe_s": float(probe)}
    r = _ratios(probe, reference)
    out: dict[str, Any] = {"ratio": r["probe"], "prefill_ratio": r.get("prefill"), **probe}
    for size in ("full", "ci"):
        per = reference.get(f"notebooks_{size}_s") or {}
        if per:
            basis = {nb: "prefill" if nb in PREFILL_BOUND and "prefill" in r else "probe" for nb in per}
            fixed = fixed_s(size)
            out[f"notebooks_{size}_s"] = {nb: _scaled(t, fixed.get(nb, 0.0), r[basis[nb]]) for nb, t in per.items()}
            out[f"basis_{size}"] = basis
            out[f"course_{size}_s"] = sum(out[f"notebooks_{size}_s"].values())
        elif reference.get(f"course_{size}_s"):
            out[f"course_{size}_s"] = reference[f"course_{size}_s"] * r["probe"]
    return out


def forecast_table(prediction: dict[str, Any], measured: dict[str, float] | None = None, size: str = "full",
                   tol: float = 0.15):
    """Each notebook's forecast, its basis, and (given a run's `course_times.json` seconds)
    the measured time and whether the forecast landed within `tol`."""
    import pandas as pd
    rows = []
    for nb, f in (prediction.get(f"notebooks_{size}_s") or {}).items():
        row = {"notebook": nb, "forecast_s": round(f, 1), "basis": prediction[f"basis_{size}"][nb]}
        if measured and nb in measured:
            m = float(measured[nb])
            row.update(measured_s=round(m, 1), forecast_over_measured=round(f / m, 2),
                       within=abs(f / m - 1) <= tol)
        rows.append(row)
    return pd.DataFrame(rows).set_index("notebook")


def readings_median(course_times: dict[str, Any]) -> dict[str, float]:
    """The medians of a run's pace readings (`course_times.json`'s `pace`), per probe."""
    import statistics
    read = list((course_times.get("pace") or {}).values())
    return {k: statistics.median(r[k] for r in read if k in r) for k in ("probe_s", "prefill_probe_s")
            if any(k in r for r in read)}


def run_pace(course_times: dict[str, Any], reference: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per notebook of a run that read the pace before each notebook (`course_times.json`'s
    `pace`): the reading before it (`read`), the run's ratio (the median of its readings ÷ the
    reference run's median, `readings`; the reference's probes where it has none), the
    reference's time forecast at that ratio, the seconds measured, and those seconds at the
    reference's pace (÷ the ratio; the set durations of `fixed_s` as they are).

    One ratio for the run, not each notebook's own reading: a reading is ~3 s of a notebook that
    runs minutes, and single readings jump (0.91 to 1.75 s on one run of 2026-12-06, where
    scaling each notebook by its own put 11 of 22 within 15 % and the median 14). Notebooks
    without a reading or a reference time are left out."""
    size, readings = course_times.get("size", "full"), course_times.get("pace") or {}
    med = readings_median(course_times)
    if not med:
        return {}
    p = predict(med, {**reference, **(reference.get("readings") or {})})   # the forecast at the run's pace
    forecast, basis = p.get(f"notebooks_{size}_s") or {}, p.get(f"basis_{size}") or {}
    ratios, fixed = {"probe": p["ratio"], "prefill": p["prefill_ratio"]}, fixed_s(size)
    out = {}
    for nb, measured in course_times.get("seconds", {}).items():
        if nb not in readings or nb not in forecast:
            continue
        ratio, f = ratios[basis[nb]], min(fixed.get(nb, 0.0), measured)
        out[nb] = {"read": readings[nb]["probe_s"], "ratio": ratio, "forecast_s": forecast[nb],
                   "measured_s": float(measured), "at_reference_s": f + (measured - f) / ratio}
    return out


def run_pace_table(course_times: dict[str, Any], reference: dict[str, Any], tol: float = 0.15):
    """`run_pace` as a table, with forecast ÷ measured and whether it landed within `tol`."""
    import pandas as pd
    df = pd.DataFrame(run_pace(course_times, reference)).T
    if df.empty:
        return df
    df["forecast_over_measured"] = df["forecast_s"] / df["measured_s"]
    df["within"] = (df["forecast_over_measured"] - 1).abs() <= tol
    return df.round({"read": 3, "ratio": 3, "forecast_s": 1, "measured_s": 1, "at_reference_s": 1, "forecast_over_measured": 2})


def save_reference(course_times: str | Path, probe: float | dict[str, float], path: Path = REFERENCE) -> dict:
    """Record this machine as the reference: its probes and a `course_times.json` that
    `infercourse course` wrote (full or CI size), keeping the other size's figures. Where the run
    read the pace before each notebook (its `pace`), the medians of those readings are kept too
    (`readings`: the pace the times were measured at, in the readings' own measure, which
    `run_pace` compares a later run's with; `probe`, read after the run, is what `doctor course`
    compares a learner's `probes()` with)."""
    from infercourse.measure.hardware import hardware_info
    probe = probe if isinstance(probe, dict) else {"probe_s": float(probe)}
    times = json.loads(Path(course_times).read_text())
    med = readings_median(times)
    ref = json.loads(path.read_text()) if path.is_file() else {}
    hw = hardware_info()
    ref.update({"machine": f"{hw.get('cpu')}, {hw.get('cores_logical')} cores, {hw.get('ram_gb')} GB, "
                           f"{hw.get('machine')}",
                **{k: round(v, 4) for k, v in probe.items()}, f"course_{times['size']}_s": times["total_s"],
                f"notebooks_{times['size']}_s": times["seconds"],
                f"load_1m_{times['size']}": times.get("load_1m"),
                **({"readings": {k: round(v, 4) for k, v in med.items()}} if med else {})})
    path.write_text(json.dumps(ref, indent=1) + "\n")
    return ref


def _minutes(s: float) -> str:
    return f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"


def pace_main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="infercourse doctor course",
                                 description="Predict the course's run time here from two short probes.")
    ap.add_argument("--save-reference", metavar="COURSE_TIMES_JSON",
                    help="make this machine the reference, from a course_times.json of `infercourse course`")
    ap.add_argument("--check", metavar="COURSE_TIMES_JSON",
                    help="a run's course_times.json on this machine: print each forecast beside what it measured")
    a = ap.parse_args(argv)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    probe = probes()
    if a.save_reference:
        ref = save_reference(a.save_reference, probe)
        print(f"reference saved to {REFERENCE} (probes {ref['probe_s']:.3f} s and {ref.get('prefill_probe_s', 0):.3f} s, "
              f"load {load:.1f}; the run's readings: {ref.get('readings', 'none')})")
        return 0
    if not REFERENCE.is_file():
        print(f"probes: {probe}; no reference figures ({REFERENCE} missing)")
        return 1
    ref = json.loads(REFERENCE.read_text())
    p = predict(probe, ref)
    pre = (f"; prefill probe {probe['prefill_probe_s']:.2f} s vs {ref['prefill_probe_s']:.2f} s "
           f"({p['prefill_ratio']:.2f}x)") if p.get("prefill_ratio") else ""
    print(f"== course pace: probe {probe['probe_s']:.3f} s here vs {ref['probe_s']:.3f} s on the reference "
          f"({ref['machine']}), {p['ratio']:.2f}x{pre} (load average now {load:.1f} on {os.cpu_count()} CPUs)")
    if "course_full_s" in p:
        print(f"  this machine runs the course in about {_minutes(p['course_full_s'])} "
              f"(`make course`; reference: {_minutes(ref['course_full_s'])})")
    if "course_ci_s" in p:
        print(f"  and its notebooks at CI size in about {_minutes(p['course_ci_s'])} "
              f"(inside `make test`; reference: {_minutes(ref['course_ci_s'])})")
    if p.get("notebooks_full_s"):
        run = json.loads(Path(a.check).read_text()) if a.check else {}
        print(forecast_table(p, run.get("seconds")).to_string())
        if run.get("pace"):
            t = run_pace_table(run, ref)
            print(f"== at that run's pace (the median of the readings before its notebooks, ÷ the reference run's): "
                  f"{int(t['within'].sum())} of {len(t)} "
                  f"forecasts within 15 %; the run at the reference's pace: {_minutes(t['at_reference_s'].sum())} "
                  f"(measured {_minutes(t['measured_s'].sum())})")
            print(t.to_string())
        print(f"  least sure: {', '.join(PREFILL_BOUND[1:])} (real agents: their own behaviour, how often they "
              "compact or retry, does not scale with any probe), notebooks that spend their time outside llama.cpp "
              "(torch, starting servers) or waiting out set timeouts, and any notebook on a busy machine")
    return 0

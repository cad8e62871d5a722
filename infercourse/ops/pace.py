"""How long will the course take on this machine? A short probe, scaled by a reference.

The course map's run times were measured on one machine (`data/reference_machine.json`
says which, how loaded it was, and what the probe gave there). Machines differ a lot:
a fresh 2-core Intel VM ran the notebooks 4-8x slower than the map. So before a
workshop, each learner runs a probe that takes a few seconds: the embedded model,
llama.cpp in process, one thread, a fixed prompt and a forced answer length. The
course's time on this machine is then predicted as

    reference course time x (probe time here / probe time on the reference)

The course is mostly small single-thread decodes and prefills of the embedded model.
So one such probe predicts it better than a FLOP or bandwidth number would. It does not
see what a second core, a GPU or a faster disk change. The load average is printed
beside the prediction: a busy machine is slower, and the probe was timed on it as it is now.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

__all__ = ["REFERENCE", "probe_s", "predict", "save_reference", "pace_main"]

REFERENCE = Path(__file__).resolve().parents[2] / "data" / "reference_machine.json"
PROMPT = "Explain, step by step, how a compiler turns source code into a program. " * 6
PROBE_TOKENS = 32


def probe_s(repeats: int = 3) -> float:
    """Median wall seconds of one fixed request (prefill ~100 tokens, decode 32) on the
    embedded model, llama.cpp in process, one thread. The model load is not timed."""
    from infercourse.core.types import Request
    from infercourse.engines.llamacpp import LlamaCppEngine
    eng = LlamaCppEngine(n_threads=1, n_ctx=512)
    req = Request(prompt=PROMPT, max_tokens=PROBE_TOKENS, ignore_eos=True, cache_prompt=False)
    for _ in eng.stream(req):      # warm-up: page the weights in, build the graph
        pass
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in eng.stream(req):
            pass
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def predict(probe: float, reference: dict[str, Any]) -> dict[str, Any]:
    """Course times on this machine from its probe and the reference's figures.

    Args:
        probe: this machine's `probe_s()`.
        reference: the contents of data/reference_machine.json.
    """
    ratio = probe / reference["probe_s"]
    out = {"ratio": ratio, "probe_s": probe}
    for size in ("full", "ci"):
        if reference.get(f"course_{size}_s"):
            out[f"course_{size}_s"] = reference[f"course_{size}_s"] * ratio
    return out


def save_reference(course_times: str | Path, probe: float, path: Path = REFERENCE) -> dict:
    """Record this machine as the reference: its probe and a `course_times.json` that
    `infercourse course` wrote (full or CI size), keeping the other size's figures."""
    from infercourse.measure.hardware import hardware_info
    times = json.loads(Path(course_times).read_text())
    ref = json.loads(path.read_text()) if path.is_file() else {}
    hw = hardware_info()
    ref.update({"machine": f"{hw.get('cpu')}, {hw.get('cores_logical')} cores, {hw.get('ram_gb')} GB, "
                           f"{hw.get('machine')}",
                "probe_s": round(probe, 4), f"course_{times['size']}_s": times["total_s"],
                f"notebooks_{times['size']}_s": times["seconds"],
                f"load_1m_{times['size']}": times.get("load_1m")})
    path.write_text(json.dumps(ref, indent=1) + "\n")
    return ref


def _minutes(s: float) -> str:
    return f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"


def pace_main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="infercourse doctor course",
                                 description="Predict the course's run time here from a short probe.")
    ap.add_argument("--save-reference", metavar="COURSE_TIMES_JSON",
                    help="make this machine the reference, from a course_times.json of `infercourse course`")
    a = ap.parse_args(argv)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    probe = probe_s()
    if a.save_reference:
        save_reference(a.save_reference, probe)
        print(f"reference saved to {REFERENCE} (probe {probe:.3f} s, load {load:.1f})")
        return 0
    if not REFERENCE.is_file():
        print(f"probe: {probe:.3f} s; no reference figures ({REFERENCE} missing)")
        return 1
    ref = json.loads(REFERENCE.read_text())
    p = predict(probe, ref)
    print(f"== course pace: probe {probe:.3f} s here vs {ref['probe_s']:.3f} s on the reference "
          f"({ref['machine']}), so this machine is {p['ratio']:.2f}x its time "
          f"(load average now {load:.1f} on {os.cpu_count()} CPUs)")
    if "course_full_s" in p:
        print(f"  this machine runs the course in about {_minutes(p['course_full_s'])} "
              f"(`make course`; reference: {_minutes(ref['course_full_s'])})")
    if "course_ci_s" in p:
        print(f"  and its notebooks at CI size in about {_minutes(p['course_ci_s'])} "
              f"(inside `make test`; reference: {_minutes(ref['course_ci_s'])})")
    return 0

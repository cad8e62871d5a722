"""Notebook 16: from what the user sees to what broke. The symptom table, reproduced live.

Each row of the reference guide's symptom table names what a user reports and the layers
that may be at fault. Here every row is reproduced on this machine where it can be: a
fault from the lab (`infercourse.ops.faults`) or a small live measurement, then the layer
the doctor names and the evidence it used. A row that needs what this machine lacks is
skipped with the reason. `write_cheatsheet` turns the rows into a markdown cheat sheet
with the numbers measured in this run.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from infercourse.core.errors import InferCourseError
from infercourse.core.types import Request, generate
from infercourse.measure.hardware import utc_now
from infercourse.ops.faults import FAULTS, run_fault

__all__ = ["SYMPTOMS", "SymptomRow", "reproduce", "context_growth", "cpu_contention", "table", "score",
           "write_cheatsheet"]

# symptom -> (layers to suspect, in the guide's order; how it is reproduced here)
SYMPTOMS = {
    "API failed": (("API", "server"), "5xx"),
    "agent stuck": (("server", "engine"), "frozen"),
    "slower the longer it runs": (("context", "KV cache"), "context_growth"),
    "model exits suddenly": (("server", "memory"), "killed"),
    "API timeout": (("engine", "server"), "overloaded"),
    "tokens slow": (("hardware", "runtime", "engine"), "cpu_contention"),
    "crash after a long run": (("memory", "KV cache"), "memory_limited"),
    "tool calling fails": (("model", "API"), "template_breaks_tools"),
    "streaming fails": (("API", "server"), "cut"),
    "new model will not run": (("model", "runtime", "memory"), "model_corrupt"),
    "model runs but the agent is unstable": (("context", "model"), "context_overflow"),
}


@dataclass
class SymptomRow:
    """One symptom, reproduced (or skipped with the reason)."""

    symptom: str
    suspects: tuple[str, ...]
    how: str
    layer: str | None = None
    evidence: str = ""
    seconds: float = 0.0
    skipped: str | None = None
    values: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"symptom": self.symptom, "check first": " → ".join(self.suspects), "reproduced by": self.how,
                "layer found": self.layer or "—", "evidence (this run)": self.skipped or self.evidence,
                "seconds": round(self.seconds, 1)}


def context_growth(server, lengths=(32, 128, 320)) -> tuple[str, str, dict]:
    """TTFT of prompts growing like an agent's history (no prefix reuse): (layer, evidence, values)."""
    engine, ttft = server.engine(timeout=60), []
    for n in lengths:
        c = generate(engine, Request(prompt=" ".join(["word"] * n), max_tokens=2, cache_prompt=False))
        ttft.append(c.events[0].t - c.t_start)
    engine.close()
    window = server.ctx_size // server.n_parallel
    return "context", (f"TTFT {ttft[0] * 1e3:.0f} → {ttft[-1] * 1e3:.0f} ms as the prompt grows {lengths[0]} → "
                       f"{lengths[-1]} words ({ttft[-1] / ttft[0]:.1f}x); the window is {window} tokens per slot"), \
        {"ttft_s": ttft, "words": list(lengths), "ttft_ratio": ttft[-1] / ttft[0]}


def _spin(until: float) -> None:
    while time.time() < until:
        pass


def cpu_contention(server, seconds: float = 4.0) -> tuple[str, str, dict]:
    """Decode speed alone, then with one busy process per core for `seconds`: (layer, evidence, values)."""
    engine = server.engine(timeout=60)
    req = Request(prompt="Count to fifty.", max_tokens=24, ignore_eos=True)

    def tok_s() -> float:
        c = generate(engine, req)
        return c.n_tokens / max(c.events[-1].t - c.events[0].t, 1e-9)

    alone = tok_s()
    hogs = [mp.Process(target=_spin, args=(time.time() + seconds,), daemon=True) for _ in range(mp.cpu_count())]
    for h in hogs:
        h.start()
    try:
        shared = tok_s()
    finally:
        for h in hogs:
            h.terminate()
            h.join(5)
        engine.close()
    return "hardware", (f"decode {alone:.1f} tok/s alone, {shared:.1f} tok/s with {len(hogs)} busy processes "
                        f"({shared / alone:.0%})"), {"alone_tok_s": alone, "shared_tok_s": shared, "kept": shared / alone}


def reproduce(symptom: str, server, *, seconds: float = 20.0, timeout_s: float = 3.0) -> SymptomRow:
    """Reproduce one row live on `server` (a running LlamaServer lent to it, handed back healthy).

    Args:
        symptom: a key of `SYMPTOMS`.
        server: the lab's LlamaServer.
        seconds: the longest a fault may last.
        timeout_s: how long each doctor probe waits.
    """
    suspects, how = SYMPTOMS[symptom]
    row, t0 = SymptomRow(symptom, suspects, how), time.perf_counter()
    try:
        if how in FAULTS:
            r = run_fault(how, server, seconds=seconds, timeout_s=timeout_s)
            hit = r.report.failed or next((c for c in r.report.checks if c.status == "warn"), None)
            row.layer, row.values = r.named, {"doctor_s": r.doctor_s, "client_error": r.client_error}
            client = (r.client_error or "no error, only slow").split(" (API layer)")[0][:120]
            row.evidence = f"client: {client} | doctor: {(hit.summary if hit else 'nothing')[:160]}"
        else:
            row.layer, row.evidence, row.values = {"context_growth": context_growth,
                                                   "cpu_contention": cpu_contention}[how](server)
    except InferCourseError as e:   # cannot be produced here: say why, never fake it
        row.skipped = f"skipped: {e}"
    row.seconds = time.perf_counter() - t0
    return row


def table(rows: list[SymptomRow]) -> pd.DataFrame:
    return pd.DataFrame([r.as_dict() for r in rows]).set_index("symptom")


def score(mine: dict[str, str | None], rows: list[SymptomRow]) -> pd.DataFrame:
    """Your diagnosis per symptom next to the layer this run found (None: not answered)."""
    df = pd.DataFrame([{"symptom": r.symptom, "yours": mine.get(r.symptom), "found": r.layer} for r in rows])
    df["match"] = [None if y is None else y == f for y, f in zip(df["yours"], df["found"])]
    answered = df["match"].dropna()
    print(f"{int(answered.sum())}/{len(answered)} of your answered diagnoses match" if len(answered)
          else "fill MY_DIAGNOSIS before the Measure cell to score yourself")
    return df.set_index("symptom")


def write_cheatsheet(rows: list[SymptomRow], path: str | Path, *, machine: str = "") -> Path:
    """The symptom table as markdown, with this run's evidence and when/where it was measured.

    Args:
        rows: reproduced rows.
        path: the .md file to write.
        machine: a hardware label for the header.
    """
    df = table(rows).reset_index()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")   # timings mean little without it
    cell = lambda v: str(v).replace("|", "/").replace("\n", " ")
    lines = ["# Symptom cheat sheet: what the user sees → which layer to check", "",
             f"Measured {utc_now()} on {machine or 'this machine'} ({os.cpu_count()} logical cores, 1-min load "
             f"{load:.1f}) by notebook 16 (`16_symptom_lab`): every row reproduced live on the embedded model; "
             "evidence and seconds are what this run saw.", "",
             "| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in df.itertuples(index=False)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path

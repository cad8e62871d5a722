"""Notebook 18, read back: your diagnoses scored, what the run cost, and its cheat sheet.

`symptoms.reproduce` gives one `SymptomRow` per symptom: the guide's suspects, the layer this
run's evidence named, the evidence and the seconds it took. This module reads those rows
only. `score` sets the layer you wrote in `MY_DIAGNOSIS` beside the one found; `table` is the
rows as a frame; `costliest` names the rows that took longest and which of them had to wait
on a deadline or a queue rather than read an error; `kill_record` says what the doctor read of
the kernel's records when the "crash after a long run" server died (an OOM kill leaves no line
in the server's log: `ops.death`); `write_cheatsheet` writes the table with this run's evidence
as markdown.
"""
from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from infercourse.core.errors import LAYERS
from infercourse.measure.hardware import utc_now

__all__ = ["table", "score", "costliest", "kill_record", "write_cheatsheet"]


# rows whose symptom is time: found by a deadline (frozen) or by waiting in a queue (overloaded)
_WAITS = {"frozen": "found only by a timeout", "overloaded": "waits in a queue"}


def costliest(rows: list, k: int = 3) -> str:
    """The `k` rows that took longest to reproduce, diagnose and undo, and which of them
    must wait for something (a timeout, a queue) rather than read an error."""
    top = sorted((r for r in rows if r.skipped is None), key=lambda r: r.seconds, reverse=True)[:k]
    if not top:
        return "No row was reproduced here."
    parts = [f"{r.symptom} ({r.seconds:.1f} s{', ' + _WAITS[r.how] if r.how in _WAITS else ''})" for r in top]
    waiting = sum(r.how in _WAITS for r in top)
    return (f"The costliest rows in this run: {'; '.join(parts)}. {waiting} of these {len(top)} wait on time "
            "(a deadline or a queue) rather than read an error.")


def table(rows: list) -> pd.DataFrame:
    """One row per symptom: the guide's suspects, how it was reproduced, the layer found, why
    it differs, this run's evidence and seconds."""
    return pd.DataFrame([r.as_dict() for r in rows]).set_index("symptom")


def score(mine: dict[str, str | None], rows: list) -> pd.DataFrame:
    """Your layer per symptom beside the guide's suspects and the layer this run found."""
    bad = {v for v in mine.values() if v is not None and v not in LAYERS}
    if bad:
        print(f"not a layer: {sorted(bad)}; choose from {LAYERS}")
    df = pd.DataFrame([{"symptom": r.symptom, "guide's suspects": " → ".join(r.suspects), "yours": mine.get(r.symptom),
                        "found": r.layer, "why it differs": r.differs()} for r in rows])
    df["match"] = [None if y is None else y == f for y, f in zip(df["yours"], df["found"])]
    answered = df["match"].dropna()
    print(f"{int(answered.sum())}/{len(answered)} of your answered diagnoses match the layer found" if len(answered)
          else "fill MY_DIAGNOSIS before the Measure cell to score yourself")
    return df.set_index("symptom")


def kill_record(rows: list) -> str:
    """What the doctor read of the kernel's records when the "crash after a long run" row's
    server died (`ops.death`): an OOM kill (the cgroup's oom_kill counter rose, or the kernel
    log names the pid: memory) or not (a plain SIGKILL such as the lab's stand-in: server).

    Args:
        rows: reproduced rows (the one reproduced by `memory_growth` is read).
    """
    r = next((r for r in rows if r.how == "memory_growth"), None)
    if r is None or r.skipped:
        return f"The crash row did not run here{f' ({r.skipped})' if r else ''}: no kill to read the records of."
    srv, mem = r.values.get("doctor_server") or "", r.values.get("doctor_memory") or ""
    if "killed by the OOM killer" in mem:
        return f"The kernel recorded an OOM kill of the crash row's server, and the doctor named **memory**: {mem}."
    head = f"The crash row's server died without a line in its log, and the doctor named **{r.layer}**: \"{srv}\"."
    if "not the OOM killer" in srv:
        return head + (" The kernel's records show no OOM kill: this kill was the lab's stand-in, a plain SIGKILL. "
                       "A real OOM kill raises the counter, and the doctor then names memory.")
    if "not readable here" in srv:
        return head + " The kernel's records cannot be read here, so an OOM kill and any other SIGKILL look alike."
    return head + " With no reading from before the kill, the counter alone cannot say whether it rose."


def write_cheatsheet(rows: list, path: str | Path, *, machine: str = "") -> Path:
    """The symptom table as markdown, with this run's evidence and when/where it was measured.

    Args:
        rows: reproduced rows.
        path: the .md file to write.
        machine: a hardware label for the header.
    """
    df = table(rows).reset_index()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")   # timings mean little without it
    cell = lambda v: str(v).replace("|", "/").replace("\n", " ")   # noqa: E731
    lines = ["# Symptom cheat sheet: what the user sees → which layer to check", "",
             f"Measured {utc_now()} on {machine or 'this machine'} ({os.cpu_count()} logical cores, 1-min load "
             f"{load:.1f}) by notebook 18 (`18_symptom_lab`): every row reproduced live on the embedded model; "
             "evidence and seconds are what this run saw. \"guide's suspects\" are the reference guide's usual "
             "causes; \"layer found\" is what this run's evidence named, and \"why it differs\" says why where "
             "they disagree.", "",
             "| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in df.itertuples(index=False)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path

"""Notebook 17: which layer is it? The layered procedure, practised on real faults.

The procedure (`PROCEDURE`) confirms the layers from the outside in and stops at the first
one that fails. A drill (`run_drill`) injects one fault from the fault lab, records what a
client saw, runs `doctor layers` while the fault is in place, and undoes it, all in one
call, so no fault ever outlives a cell. The drills are blind (`run_drills`): the lab's fault
names say their layer (`model_corrupt`, `context_overflow`), and an order that follows the
walk would say it too, so each drill runs under a neutral label ("fault A"...) in a shuffled
order, and its fault is named only with the reveal. The notebook shows the evidence first
(the symptom and what a client saw, with the library's own "(... layer)" tags taken out: they
would give the answer away, and, for a server that never started, the error lines of its
log); the learner names a layer; only then does `reveal` name the fault and print the
doctor's report. `doctor_time_story` says, from the run, which diagnoses waited out a probe's
deadline; `skipped_layers` counts what a report skipped (the in-process exercise).
"""
from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from infercourse.core.errors import LAYERS, InferCourseError
from infercourse.ops.faults import FAULTS, run_fault

__all__ = ["PROCEDURE", "NOT_HERE", "OPTIONS", "DRILL_FAULTS", "Drill", "key_of", "procedure_table", "blind",
           "run_drill", "run_drills", "drills_table", "untagged", "reveal", "doctor_time_story", "skipped_layers"]

PROCEDURE = [  # (layer, the question, the evidence that answers it)
    ("API", "Does anything answer, in the OpenAI schema, with a stream and usage?", "/v1/models, one streamed request"),
    ("server", "Is the process alive, running, healthy? What does its log say?", "/health, process state, log tail"),
    ("engine", "Are requests waiting for a slot?", "/slots, requests_deferred"),
    ("runtime", "Which build, backend, threads?", "/props build_info, command line"),
    ("model", "Is the file there, whole, with a template that renders our turns?", "/props, /apply-template"),
    ("context", "Does the prompt plus the answer fit the per-slot window?", "/tokenize vs n_ctx"),
    ("KV cache", "How full is the cache?", "kv_cache_usage_ratio where exported, else the tokens /slots holds"),
    ("memory", "Server RSS, free RAM, swap?", "psutil"),
    ("hardware", "Is the CPU shared? Is the GPU there?", "load average, nvidia-smi"),
]

# Layers no fault of the lab reaches on a CPU-only laptop, and why (said, never faked).
NOT_HERE = {
    "runtime": "a runtime bug needs a broken build; the lab will not ship one (see the runtime check's evidence)",
    "KV cache": "its use is read (from /slots, as notebook 15's soak does), but filling it takes minutes of decoding",
    "hardware": "no GPU here to lose; CPU contention is shown in notebook 18 (tokens slow)",
}

# One fault per layer the lab can break here; run blind (`run_drills`): their names give the layer away.
DRILL_FAULTS = ("cut", "frozen", "overloaded", "model_corrupt", "context_overflow", "memory_limited")

OPTIONS = {chr(ord("a") + i): layer for i, layer in enumerate(LAYERS)}
_TAG = re.compile(r"\s*\((?:%s) layer\)" % "|".join(re.escape(x) for x in LAYERS))
_TAIL = re.compile(r"\s*Last lines of (\S+):\s*$")   # a failed start's message; its lines are in log_lines


def untagged(text: str | None) -> str | None:
    """A client's error without the library's "(context layer)"-style tags: evidence, not the answer."""
    return _TAG.sub("", text) if text else text


def key_of(layer: str) -> str:
    """The `choose` key of a layer, e.g. key_of("server") == "b"."""
    return next(k for k, v in OPTIONS.items() if v == layer)


def procedure_table() -> pd.DataFrame:
    return pd.DataFrame(PROCEDURE, columns=["layer", "question", "evidence"]).set_index("layer")


@dataclass
class Drill:
    """One fault, its symptom, and the doctor's report taken while it was in place."""

    fault: str
    symptom: str
    client_error: str | None
    expected: str
    report: Any = None
    seconds: float = 0.0
    skipped: str | None = None
    log_lines: list[str] = field(default_factory=list)   # a failed start: its log's error lines
    log_path: str | None = None
    label: str | None = None      # the neutral name shown before the guess ("fault A"); None: the fault's

    @property
    def shown(self) -> str:
        """The drill's name before the reveal: its label, never the fault's name when it has one."""
        return self.label or self.fault

    def show_symptom(self) -> None:
        """What the user sees, and nothing more (the fault and its layer come after your guess);
        a server that never started also shows the error lines of its log."""
        if self.skipped:   # the reason can name the layer ("RLIMIT_AS..."): it comes with the reveal
            print(f"[{self.shown}] could not be made on this machine: nothing to diagnose (the reveal says why)")
            return
        if self.label:
            print(f"[{self.label}]")
        said = untagged(self.client_error)
        tail = _TAIL.search(said or "")
        if tail:            # the message ends "Last lines of LOG:"; the lines come below
            said = said[:tail.start()]
        print(f"Symptom: {self.symptom}")
        print(f"A client saw: {said or 'no error, only slowness'}")
        if self.log_lines:
            print(f"Error lines of its log ({self.log_path or (tail.group(1) if tail else 'the server log')}):")
            for line in self.log_lines:
                print(f"    {line}")
        elif tail:
            print(f"Its log ({tail.group(1)}) holds no error line.")

    def why(self) -> str:
        """The reason, shown once the learner has chosen."""
        f = FAULTS[self.fault]
        hit = self.report.failed if self.report else None
        return (f"{self.label or 'the fault'} was '{f.name}' ({f.how}); the first layer whose own evidence fails "
                f"is {f.layer}"
                + (f": {hit.summary}" if hit else ""))

    def row(self) -> dict[str, Any]:
        return {"fault": self.fault, "drill": self.label, "symptom": self.symptom, "expected": self.expected,
                "doctor named": self.report.layer if self.report else None,
                "doctor s": round(self.report.seconds, 2) if self.report else None,
                "inject+diagnose+undo s": round(self.seconds, 2), "skipped": self.skipped}


def run_drill(name: str, server=None, *, seconds: float = 20.0, timeout_s: float = 3.0,
              label: str | None = None) -> Drill:
    """Inject fault `name`, diagnose it, undo it; a fault this machine cannot make is skipped.

    Args:
        name: a fault of `infercourse.ops.faults.FAULTS`.
        server: a running LlamaServer lent to the fault (handed back healthy).
        seconds: the longest the fault may last.
        timeout_s: how long each doctor probe waits.
        label: the neutral name shown before the guess (None: the fault's own name).
    """
    f = FAULTS[name]
    t0 = time.perf_counter()
    try:
        r = run_fault(name, server, seconds=seconds, timeout_s=timeout_s)
    except InferCourseError as e:
        return Drill(name, f.symptom, None, f.layer, skipped=str(e), seconds=time.perf_counter() - t0, label=label)
    return Drill(name, f.symptom, r.client_error, f.layer, r.report, time.perf_counter() - t0,
                 log_lines=list(r.notes.get("log_lines") or []), log_path=r.notes.get("log"), label=label)


def blind(faults=DRILL_FAULTS, seed: int | None = None) -> dict[str, str]:
    """{"fault A": one of `faults`, ...}: neutral labels in a shuffled order, so neither a
    name nor the order of the walk says the layer before the learner guesses.

    Args:
        faults: fault names of the lab.
        seed: the order (None: a new order each run).
    """
    order = random.Random(seed).sample(list(faults), len(faults))
    return {f"fault {chr(ord('A') + i)}": name for i, name in enumerate(order)}


def run_drills(server, seed: int | None = None, *, faults=DRILL_FAULTS, seconds: float = 20.0,
               timeout_s: float = 3.0) -> list[Drill]:
    """Every drill of `faults`, blind (`blind`), one after another on the lent server.

    Args:
        server: a running LlamaServer lent to each fault (handed back healthy).
        seed: the blind order (None: a new one each run).
        faults, seconds, timeout_s: as `run_drill`.
    """
    return [run_drill(name, server, seconds=seconds, timeout_s=timeout_s, label=label)
            for label, name in blind(faults, seed).items()]


def reveal(drill: Drill, my_layer: str | None, grade) -> bool | None:
    """Grade the learner's layer (a key of `OPTIONS`), then show the doctor's report; with no
    guess yet, the report stays hidden (set `MY_LAYER = "?"` to give up and see it).

    Args:
        drill: a `run_drill` result.
        my_layer: the learner's key, "?" to reveal without a guess, or None.
        grade: `exercises.choose` (passed in: no lesson imports another).
    """
    if drill.skipped:
        print(f"[{drill.shown}] was `{drill.fault}` ({drill.expected} layer), skipped here: {drill.skipped}")
        return None
    if my_layer is None:
        print("Name a layer first (MY_LAYER = 'a'...'i'; '?' to give up): the fault and the doctor's report "
              "are shown after.")
        return None
    ok = None if my_layer == "?" else grade(my_layer, OPTIONS, key_of(drill.expected), why=drill.why())
    if my_layer == "?":   # a graded guess is shown `why()`, which names the fault; "?" is not
        print(f"[{drill.shown}] was `{drill.fault}` ({FAULTS[drill.fault].how}).")
    print(drill.report)
    return ok


def drills_table(drills: list[Drill]) -> pd.DataFrame:
    """One row per drill: expected layer, the doctor's answer, and its time."""
    return pd.DataFrame([d.row() for d in drills]).set_index("fault")


def skipped_layers(report) -> list[str]:
    """The layers a doctor's report marks `skip`: ones the target has not (in process: no API,
    no server) and ones the walk never reached after a failure.

    Args:
        report: a `LayerReport`.
    """
    return [c.layer for c in report.checks if c.status == "skip"]


def doctor_time_story(table: pd.DataFrame, timeout_s: float) -> str:
    """Which drills cost the doctor at least one probe deadline and which less, from this run.

    Args:
        table: `drills_table`.
        timeout_s: the probes' deadline (`PROBE_TIMEOUT_S`).
    """
    t = table.dropna(subset=["doctor s"])
    if not len(t):
        return "No drill was diagnosed, so there is no diagnosis time to read."
    fmt = lambda d: ", ".join(f"`{i}` ({v:.1f} s)" for i, v in d["doctor s"].items()) or "none"   # noqa: E731
    waited, quick = t[t["doctor s"] >= timeout_s], t[t["doctor s"] < timeout_s]
    return (f"Diagnoses that took at least one probe deadline ({timeout_s:g} s): {fmt(waited)}. "
            f"Under one deadline: {fmt(quick)}.")

"""Notebook 18: from what the user sees to what broke. The symptom table, reproduced live.

Each row of the reference guide's symptom table names what a user reports and the layers
the guide suspects first. Here every row is reproduced on this machine where it can be: a
fault from the lab (`infercourse.ops.faults`) or a small live measurement, then the layer
this run's evidence names. The two can differ, and `DIFFERS` says why where they do: the
guide lists the *usual* causes of a symptom, the lab reproduces *one* way to cause it. A row
that needs what this machine lacks is skipped with the reason.

The measurements judge their own effect against an A/A floor (`measure.noise`): TTFT that
grows with the prompt, or decode that slows beside busy processes, names a layer only when
the change clears what the same measurement does to itself. `cheatsheet_markdown` is the
cheat sheet before any run, generated from these tables (`notebooks/cheatsheet_symptoms.md`);
`lessons.symptom_sheet` reads a run's rows back (your score, the costliest rows, the sheet with
this run's evidence), and `lessons.retries` shows what a client's retries do to the tail.

"Crash after a long run" is the row where the evidence is easiest to miss: the OOM killer's
SIGKILL leaves no line in the server's log. The kernel records the kill in the cgroup's
`oom_kill` counter and in its own log, and the doctor reads both (`ops.death`); the lab's
stand-in kill is a plain SIGKILL (a real OOM is never provoked on a shared machine), and the
doctor's reading of the counter, before and after, says that too.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from infercourse.core.errors import InferCourseError
from infercourse.core.types import Request, generate
from infercourse.measure import noise
from infercourse.ops.anthropic_probe import cache_buster_check, tool_check
from infercourse.ops.faults import FAULTS, run_fault

__all__ = ["SYMPTOMS", "AGENT_FAILURES", "rows", "DIFFERS", "MEASURED", "SymptomRow", "reproduce", "context_growth",
           "cpu_contention", "blank_sheet", "cheatsheet_markdown", "growth_lengths", "prefill_only_ratio", "ttft_ms",
           "detect_seconds"]

# symptom -> (the guide's suspect layers, in its order; how it is reproduced here)
SYMPTOMS = {
    "API failed": (("API", "server"), "5xx"),
    "agent stuck": (("context", "KV cache", "memory"), "frozen"),
    "slower the longer it runs": (("context", "KV cache"), "context_growth"),
    "model exits suddenly": (("server", "memory"), "killed"),
    "API timeout": (("engine", "server"), "overloaded"),
    "tokens slow": (("runtime", "quantization", "hardware"), "cpu_contention"),
    "crash after a long run": (("memory", "KV cache"), "memory_growth"),
    "tool calling fails": (("model", "API"), "template_breaks_tools"),
    # the coding-agent route (notebook 19): POST /v1/messages, as Claude Code sends it
    "agent slow on every call": (("KV cache", "context"), "cache_buster"),
    "tool calling fails over /v1/messages": (("model", "API"), "anthropic_tools"),
    "streaming fails": (("API", "server"), "cut"),
    "new model will not run": (("model", "runtime", "memory"), "model_corrupt"),
    "model runs but the agent is unstable": (("context", "model"), "context_overflow"),
    # the local-agent failures of notebook 19's "Four failures, live" (reproducers: lessons.agent_failures*)
    "thinking model slow on every new message": (("KV cache", "context"), "reasoning_dropped"),
    "tool calls fail with many tools connected": (("model", "context"), "many_tools"),
    "tool calls break late in a long session": (("KV cache", "context", "model"), "quantized_kv"),
    "tool calls change with speculative decoding": (("engine", "runtime"), "spec_tool_calls"),
}

# notebook 19's four failures: the rows another lesson measures (`reproduce`'s reproducers)
AGENT_FAILURES = ("reasoning_dropped", "many_tools", "quantized_kv", "spec_tool_calls")


def rows(symptoms=None, *, agent_rows: bool = True) -> tuple[str, ...]:
    """The rows to reproduce, in the table's order: `symptoms` (names from `SYMPTOMS`; None:
    every row), less those of `AGENT_FAILURES` when `agent_rows` is False (each starts its own
    server; notebook 19 measures the same four at a larger size)."""
    names = tuple(SYMPTOMS) if symptoms is None else tuple(symptoms)
    unknown = [s for s in names if s not in SYMPTOMS]
    if unknown:
        raise ValueError(f"no symptom row {unknown[0]!r}; the rows: {', '.join(SYMPTOMS)}")
    return tuple(s for s in names if agent_rows or SYMPTOMS[s][1] not in AGENT_FAILURES)


# Why the layer this lab's evidence names can differ from the guide's suspects.
DIFFERS = {
    "agent stuck": "the guide's agent is stuck because a long session fills its context, KV cache or memory; "
                   "the lab reproduces the other common way to hang: a frozen server process (state T)",
    "tokens slow": "quantization is not a layer of the walk: it is a property of the model file (model layer); "
                   "the lab makes tokens slow by taking the CPU away (hardware)",
    "crash after a long run": "the lab's OOM killer is a stand-in, a plain SIGKILL (a real OOM is never provoked on a "
                              "shared machine): no line in the log, no rise in the cgroup's oom_kill counter, so the "
                              "doctor sees a process gone (server); the RSS growth before the kill is what says "
                              "memory (a real OOM kill raises that counter, and the doctor then names memory)",
    "thinking model slow on every new message": "the cache misses (KV cache), but what moved is the chat template, "
                                                "which ships with the model: it stops rendering earlier turns' "
                                                "reasoning once a new user message arrives",
}

# The rows reproduced by a live measurement rather than a fault: (what is measured, the layer it names).
MEASURED = {
    "context_growth": ("TTFT of a short and a long prompt, no prefix reuse, against an A/A floor", "context"),
    "cpu_contention": ("decode tok/s alone and beside two busy processes per core, against an A/A floor",
                       "hardware"),
    "cache_buster": ("cached tokens of the same /v1/messages call with a fixed and with a changing header",
                     "KV cache"),
    "anthropic_tools": ("the doctor's /v1/messages checks: a tool call and its result", "model or API"),
    "reasoning_dropped": ("the first changed token and the cache lost per call of a thinking session, through a "
                          "Qwen3-style template and with reasoning kept", "model"),
    "many_tools": ("the right tool at 1 to 100 tool schemas (tool_choice required); a count past the window sent once",
                   "context or model"),
    "quantized_kv": ("NLL of a reference tool call and the greedy call after a long session, f16 vs q4_0 KV cache",
                     "KV cache"),
    "spec_tool_calls": ("generated tokens of greedy tool calls with and without a draft model", "runtime"),
}

_HTML = re.compile(r"<[^>]+>")


def _clean(text: str, limit: int = 240) -> str:
    """One line of evidence: no HTML tags (a proxy's error page), whitespace collapsed."""
    t = re.sub(r"\s+", " ", _HTML.sub(" ", str(text))).strip()
    return t if len(t) <= limit else t[: limit - 1] + "…"


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

    def differs(self) -> str:
        if self.layer is None or self.layer in self.suspects:
            return ""
        return DIFFERS.get(self.symptom, "the lab reproduces one cause of this symptom, not the guide's usual ones")

    def as_dict(self) -> dict[str, Any]:
        return {"symptom": self.symptom, "guide's suspects": " → ".join(self.suspects), "reproduced by": self.how,
                "layer found": self.layer or "—", "why it differs": self.differs(),
                "evidence (this run)": self.skipped or self.evidence, "seconds": round(self.seconds, 1)}


def _ttft(engine, words: int) -> float:
    c = generate(engine, Request(prompt=" ".join(["word"] * words), max_tokens=2, cache_prompt=False))
    return c.events[0].t - c.t_start


GROWTH_LENGTHS = (32, 320)   # prompt words of the "slower the longer it runs" row


def context_growth(server, lengths=GROWTH_LENGTHS, repeats: int = 3) -> tuple[str | None, str, dict]:
    """TTFT of a short and a long prompt (no prefix reuse), interleaved with an A/A repeat
    of the short one: (layer or None, evidence, values). "context" only beyond noise."""
    engine = server.engine(timeout=60)
    short, long_ = (lambda: _ttft(engine, lengths[0])), (lambda: _ttft(engine, lengths[-1]))
    v = noise.run_interleaved({"short": short, "short (A/A)": short, "long": long_}, repeats, warmup=1)
    engine.close()
    floor = noise.noise_floor(v["short"], v["short (A/A)"])
    c = noise.compare(v["short"], v["long"], floor, labels=("short", "long"))
    ratio = float(np.median(v["long"]) / np.median(v["short"]))
    window = server.ctx_size // server.n_parallel
    evidence = (f"TTFT {1e3 * np.median(v['short']):.0f} → {1e3 * np.median(v['long']):.0f} ms as the prompt grows "
                f"{lengths[0]} → {lengths[-1]} words ({ratio:.1f}x; {c.said}, A/A floor ±{floor.floor:.0%}); "
                f"the window is {window} tokens per slot")
    return ("context" if c.verdict == "short faster" else None), evidence, {**v, "ttft_ratio": ratio}


def growth_lengths() -> tuple[int, ...]:
    """The prompt lengths (words) the "slower the longer it runs" row measures: `context_growth`'s own."""
    return GROWTH_LENGTHS


def prefill_only_ratio(lengths: tuple[int, ...] | None = None) -> float:
    """TTFT(longest) / TTFT(shortest) of the "slower the longer it runs" row if TTFT were
    prefill alone, linear in the prompt's tokens (one per word, plus BOS): the ceiling its
    measured `ttft_ratio` approaches as the fixed part (HTTP, scheduling, a decode step) shrinks
    next to prefill, and falls short of where the fixed part dominates.

    Args:
        lengths: the prompt lengths in words (None: `growth_lengths()`).
    """
    lengths = lengths or growth_lengths()
    return (lengths[-1] + 1) / (lengths[0] + 1)


def ttft_ms(server, words: int, repeats: int = 3) -> float:
    """Median TTFT (ms) of a `words`-word prompt with no prefix reuse, measured as the "slower
    the longer it runs" row measures its two lengths (after one warm-up request).

    Args:
        server: the lab's running LlamaServer.
        words: prompt length in words ("word" repeated: about one token each); prompt and the
            two tokens asked for must fit one slot's window (`ctx_size // n_parallel`).
        repeats: requests whose median is returned.
    """
    window = server.ctx_size // server.n_parallel
    if words + 3 > window:   # + BOS + the 2 tokens asked for
        raise ValueError(f"{words} words do not fit the slot's window of {window} tokens")
    engine = server.engine(timeout=60)
    try:
        _ttft(engine, words)   # warm-up: the first request after a fault pays for more than prefill
        return 1e3 * float(np.median([_ttft(engine, words) for _ in range(repeats)]))
    finally:
        engine.close()


def detect_seconds(server, timeout_s: float, *, fault: str = "frozen", seconds: float = 20.0) -> float:
    """How long the doctor took to name the layer of `fault` when each of its probes waits
    `timeout_s` (`FaultRun.doctor_s`), the fault undone after. A time-shaped fault is found
    only by a deadline, so this time follows the deadline, not the machine.

    Args:
        server: the lab's running LlamaServer (handed back healthy).
        timeout_s: the doctor's per-probe read timeout.
        fault: a key of `FAULTS` (default: the frozen server of "agent stuck").
        seconds: the longest the fault may last; raised to `timeout_s` + 10 s so the fault is
            still in place while the probe waits (a server that resumes mid-probe answers it).
    """
    return float(run_fault(fault, server, seconds=max(seconds, timeout_s + 10.0), timeout_s=timeout_s).doctor_s)


_SPIN = "import time\nend = time.time() + {s}\nwhile time.time() < end:\n    pass\n"


def _hogs(n: int, seconds: float = 30.0) -> list:
    """`n` busy processes, each in its own session. Linux's autogroup shares the CPU
    between sessions before processes: llama-server runs in a session of its own (its
    watchdog starts it so), so busy loops in this notebook's session took almost nothing
    from it (18's 'tokens slow' read 108% of the speed alone, within noise, on a quiet and
    a busy machine alike). One session each competes as any other program would."""
    import subprocess
    import sys
    return [subprocess.Popen([sys.executable, "-c", _SPIN.format(s=seconds)], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(n)]


def cpu_contention(server, repeats: int = 3, max_tokens: int = 24) -> tuple[str | None, str, dict]:
    """Decode speed alone (twice: the A/A floor) and with two busy processes per core,
    each in its own session (`_hogs`), interleaved: (layer or None, evidence, values).
    "hardware" only beyond noise."""
    engine = server.engine(timeout=60)
    req = Request(prompt="Count to fifty.", max_tokens=max_tokens, ignore_eos=True)
    cores = os.cpu_count() or 1

    def tok_s() -> float:
        c = generate(engine, req)
        return (c.n_tokens - 1) / max(c.events[-1].t - c.events[0].t, 1e-9)

    def shared() -> float:
        hogs = _hogs(2 * cores)
        try:
            return tok_s()
        finally:
            for h in hogs:
                h.terminate()
            for h in hogs:
                h.wait(5)

    before = noise.contention()    # busy already: the lab's hogs only add to other programs' load
    v = noise.run_interleaved({"alone": tok_s, "alone (A/A)": tok_s, "shared": shared}, repeats, warmup=0)
    engine.close()
    floor = noise.noise_floor(v["alone"], v["alone (A/A)"])
    c = noise.compare(v["alone"], v["shared"], floor, higher_is_better=True, labels=("alone", "shared"))
    alone, with_hogs = float(np.median(v["alone"])), float(np.median(v["shared"]))
    evidence = (f"decode {alone:.1f} tok/s without the lab's busy processes, {with_hogs:.1f} tok/s with "
                f"{2 * cores} ({with_hogs / alone:.0%}; {c.said}, A/A floor ±{floor.floor:.0%})"
                + (f"; the machine was busy before they started (load {before.load_1m:.1f} on {before.cores} "
                   "cores), so 'without' was already shared" if before.busy and before.load_1m is not None else ""))
    return ("hardware" if c.verdict == "alone faster" else None), evidence, \
        {**v, "alone_tok_s": alone, "shared_tok_s": with_hogs, "kept": with_hogs / alone}


def reproduce(symptom: str, server, *, seconds: float = 20.0, timeout_s: float = 3.0,
              reproducers: dict | None = None) -> SymptomRow:
    """Reproduce one row live on `server` (a running LlamaServer lent to it, handed back healthy).

    Args:
        symptom: a key of `SYMPTOMS`.
        server: the lab's LlamaServer.
        seconds: the longest a fault may last.
        timeout_s: how long each doctor probe waits.
        reproducers: {how: fn(server) -> (layer or None, evidence, values)} for the rows whose
            measurement lives in another lesson (the agent failures: lessons never import each
            other, so notebook 18 passes them in); a row without one is skipped with the reason.
    """
    suspects, how = SYMPTOMS[symptom]
    row, t0 = SymptomRow(symptom, suspects, how), time.perf_counter()
    try:
        if how in FAULTS:
            r = run_fault(how, server, seconds=seconds, timeout_s=timeout_s)
            hit = r.report.failed or next((c for c in r.report.checks if c.status == "warn"), None)
            said = {f"doctor_{c.layer}": c.summary for c in r.report.checks if c.layer in ("server", "memory")}
            row.layer, row.values = r.named, {"doctor_s": r.doctor_s, "client_error": r.client_error, **said}
            client = r.client_error or "no error, only slow"
            row.evidence = f"client: {_clean(client)} / doctor: {_clean(hit.summary if hit else 'nothing')}"
            if "rss_killed_mib" in r.notes:     # memory_growth: the readings the doctor cannot see after the kill
                n = r.notes
                row.evidence += (f" / memory before the kill: RSS {n['rss_first_mib']:.0f} → {n['rss_killed_mib']:.0f} "
                                 f"MiB over {n['answered']} answers (+{n['step_mib']:.1f} MiB of host prompt cache "
                                 f"each), killed at the {n['limit_mib']:.0f}-MiB limit")
        else:
            fn = {"context_growth": context_growth, "cpu_contention": cpu_contention,
                  "cache_buster": lambda s: cache_buster_check(s.url),
                  "anthropic_tools": lambda s: tool_check(s.url), **(reproducers or {})}.get(how)
            if fn is None:
                raise InferCourseError(f"no reproducer given for {how!r} (lessons.agent_failures* has it; "
                                       "notebook 18 passes it as reproducers=)")
            row.layer, row.evidence, row.values = fn(server)
            if row.layer is None:   # the agent rows compare exact counts, not times against noise
                row.evidence = ("not reproduced here: " if how in (reproducers or {}) else
                                "not reproduced beyond noise: ") + row.evidence
    except InferCourseError as e:   # cannot be produced here: say why, never fake it
        row.skipped = f"skipped: {e}"
    row.seconds = time.perf_counter() - t0
    return row


def blank_sheet(symptoms) -> pd.DataFrame:
    """The cheat sheet before the lab runs: each symptom with the guide's suspects and an
    empty column for the layer YOU expect the evidence to name (fill `MY_DIAGNOSIS`)."""
    return pd.DataFrame([{"symptom": s, "guide's suspects": " → ".join(SYMPTOMS[s][0]), "your layer": ""}
                         for s in symptoms]).set_index("symptom")


def cheatsheet_markdown() -> str:
    """The cheat sheet generated from `SYMPTOMS`, `DIFFERS`, `MEASURED` and the fault lab:
    what the user sees, which layers to check first, how the lab reproduces it and the layer
    that names. `notebooks/cheatsheet_symptoms.md` is this text (a test holds it so); notebook
    18 writes the same rows with one run's evidence (`write_cheatsheet`)."""
    cell = lambda v: str(v).replace("|", "/")   # noqa: E731
    lines = ["# Symptom cheat sheet: what the user sees → which layer to check", "",
             "Generated from `infercourse.lessons.symptoms` by `cheatsheet_markdown()` (a test keeps this file "
             "equal to it). Notebook 18 (`18_symptom_lab`) reproduces every row live and writes the same table "
             "with that run's evidence and timings to its results folder (`write_cheatsheet`). \"check first\" "
             "is the reference guide's usual suspects; \"the lab's layer\" is the layer the lab's reproduction "
             "names, and \"why it can differ\" says why a run's evidence can name a layer other than the "
             "guide's.", "",
             "| symptom | check first | reproduced by | how | the lab's layer | why it can differ |",
             "|---|---|---|---|---|---|"]
    for symptom, (suspects, how) in SYMPTOMS.items():
        what, layer = (FAULTS[how].how, FAULTS[how].layer) if how in FAULTS else MEASURED[how]
        kind = f"fault `{how}`" if how in FAULTS else f"measurement `{how}`"
        row = [symptom, " → ".join(suspects), kind, what, layer, DIFFERS.get(symptom, "")]
        lines.append("| " + " | ".join(cell(v) for v in row) + " |")
    return "\n".join(lines) + "\n"

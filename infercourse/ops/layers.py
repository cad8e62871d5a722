"""Which layer is it? The layer-by-layer doctor behind `infercourse doctor layers URL`.

When an inference stack misbehaves, the fastest route to the cause is a fixed walk from
the outside in: confirm the **API** (does anything answer, in the OpenAI schema, with a
stream and usage?), then the **server** (health, process, log), the **engine** (slots,
queue), the **runtime** (build, threads), the **model** (file, chat template, window);
then the resources: **context** (does the prompt fit?), **KV cache**, **memory**,
**hardware**. The first layer that fails is the answer; everything above it is a symptom.

Two rules keep the walk honest:
- A symptom is not a cause. "Nothing answers" is seen at the API, but if the server
  process is dead or stopped the API layer only *warns* and the server layer fails. The
  API layer fails only when the server behind it is healthy (a proxy, a port, the wire).
- A dead server's log names the layer that killed it ("failed to allocate" -> memory,
  "failed to load model" -> model, "Illegal instruction" -> hardware): `classify_log`. The
  OOM killer's SIGKILL leaves no line there; the kernel's own records (the cgroup's
  `oom_kill` counter, the kernel log) say "killed by the OOM killer" instead (`ops.death`).

Grading is a pure function of one evidence snapshot (`infercourse.ops.probes`), so each
rule is tested on synthetic evidence and each verdict comes with the evidence it used.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infercourse.core.errors import LAYERS
from infercourse.ops.death import classify_log, oom_verdict

__all__ = ["LayerCheck", "LayerReport", "NEXT_STEP", "classify_log", "grade", "doctor_layers",
           "doctor_engine"]

# What to look at when a layer fails: the next move of the procedure.
NEXT_STEP = {
    "API": "check the URL, port and anything in between (proxy, tunnel); curl /v1/models and one streamed request",
    "server": "read the server log (state T = stopped; exit code -9 = SIGKILL: the OOM killer's if the cgroup's "
              "oom_kill counter rose or dmesg names the pid); restart it",
    "engine": "compare in-flight requests with slots (-np); lower concurrency or add slots; watch requests_deferred",
    "runtime": "check the runtime build and flags (threads, backend); rerun with the runtime alone (in process)",
    "model": "check the model file (path, size, checksum) and its chat template (tools, roles)",
    "context": "count the prompt's tokens against the per-slot window (-c / -np); trim the history or raise -c",
    "KV cache": "watch KV usage as the session grows; raise -c, lower -np, or enable context shifting",
    "memory": "compare server RSS with free RAM and swap; smaller context, fewer slots or a smaller quant",
    "hardware": "check CPU load and other tenants; the instruction set and the GPU the build expects",
}

@dataclass(frozen=True)
class LayerCheck:
    """One layer's verdict. status: "ok", "warn", "fail", or "skip" (not reached / n.a.)."""

    layer: str
    status: str
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    next_step: str | None = None


@dataclass
class LayerReport:
    """The walk: one check per layer in `LAYERS` order, and the time it took."""

    target: str
    checks: list[LayerCheck]
    seconds: float = 0.0

    @property
    def failed(self) -> LayerCheck | None:
        return next((c for c in self.checks if c.status == "fail"), None)

    @property
    def layer(self) -> str | None:
        """The layer named: the first failing one, else the first warning one, else None."""
        hit = self.failed or next((c for c in self.checks if c.status == "warn"), None)
        return hit.layer if hit else None

    def check(self, layer: str) -> LayerCheck:
        return next(c for c in self.checks if c.layer == layer)

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "layer": self.layer, "seconds": round(self.seconds, 3),
                "checks": [asdict(c) for c in self.checks]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=str)

    def __str__(self) -> str:
        marks = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": " -  "}
        lines = [f"doctor layers: {self.target}"]
        lines += [f"  {marks[c.status]} {c.layer:<9} {c.summary}" for c in self.checks]
        hit = self.failed or next((c for c in self.checks if c.status == "warn"), None)
        lines.append(f"=> {hit.layer} layer: {hit.summary}\n   next: {hit.next_step}" if hit
                     else "=> every layer answered: benchmark again and compare with your baseline")
        lines.append(f"   ({self.seconds:.1f} s)")
        return "\n".join(lines)


def _c(layer: str, status: str, summary: str, **evidence: Any) -> LayerCheck:
    return LayerCheck(layer, status, summary, {k: v for k, v in evidence.items() if v is not None},
                      NEXT_STEP[layer] if status in ("warn", "fail") else None)


def _server_state(ev: dict) -> tuple[str, str, dict]:
    """("healthy" | "dead" | "stopped" | "unhealthy" | "unknown", summary, evidence)."""
    s = ev.get("server") or {}
    proc, health, direct = s.get("process") or {}, s.get("health") or {}, s.get("direct_health")
    probe = direct if direct is not None else health
    dead = proc.get("alive") is False or (proc.get("alive") is None and probe.get("error") == "refused")
    cause = classify_log(s.get("log_tail")) if dead else None   # a live server's log is history
    # SIGKILL leaves no line in the log: the kernel's records say whether it was the OOM killer
    oom, kernel_said = oom_verdict(s.get("oom"), proc.get("pid"), s.get("exit_code")) if dead else (False, "")
    if oom and not cause:
        cause = ("memory", kernel_said)
    evid = {"pid": proc.get("pid"), "state": proc.get("status"), "exit_code": s.get("exit_code"),
            "log": s.get("log_path"), "log_cause": cause, "oom_killed": oom if dead else None,
            "cause_from": "the kernel's record" if oom and cause[1] == kernel_said else "its log"}
    if dead:
        code = s.get("exit_code")
        who = f"process {proc.get('pid')} is gone" if proc.get("pid") else "nothing listens there"
        said = f"; {kernel_said}" if kernel_said and not oom else ""
        return "dead", who + (f" (exit code {code})" if code is not None else "") + said, evid
    if proc.get("status") == "stopped":
        return "stopped", f"process {proc.get('pid')} is stopped (state T): it accepts connections, never answers", evid
    if probe.get("ok"):
        return "healthy", f"/health {probe.get('status')} in {probe.get('seconds', 0):.2f} s", evid
    if probe.get("status") == 503:
        return "unhealthy", f"/health answers 503 (loading?): {str(probe.get('body'))[:80]}", evid
    return ("unhealthy" if proc.get("alive") else "unknown",
            f"/health: {probe.get('error') or probe.get('status')}", evid)


def _api(ev: dict, state: str) -> LayerCheck:
    a = ev["api"]
    st, models = a.get("stream") or {}, a.get("models") or {}
    if st.get("ok"):
        gap = st["ttft_s"] - (st.get("server_prompt_s") or 0.0) if st.get("server_s") is not None else None
        usage_note = "" if st.get("usage_source") == "server" else "; no usage block in the stream"
        # time the server did not account for: the wire, a proxy, or a queue (engine's call)
        if gap is not None and gap > max(0.5, st.get("server_s") or 0) and not _queued(ev):
            return _c("API", "warn", f"streams, but {gap:.2f} s before the first token is not the server's "
                      f"(it reports {st['server_s']:.2f} s): latency between client and server",
                      ttft_s=st["ttft_s"], server_s=st["server_s"], unexplained_s=gap)
        return _c("API", "warn" if usage_note else "ok", f"streams {st['chunks']} chunk(s), TTFT {st['ttft_s']:.2f} s"
                  + usage_note, ttft_s=st["ttft_s"], server_s=st.get("server_s"), unexplained_s=gap)
    err = st.get("error") or models.get("error") or f"HTTP {models.get('status')}"
    if st.get("error_layer") not in (None, "API"):
        return _c("API", "ok", f"answers; the probe failed in the {st['error_layer']} layer", error=err)
    if state in ("dead", "stopped") or (st.get("timed_out") and _queued(ev)):
        return _c("API", "warn", f"no answer ({_short(err)}): the cause lies below", error=err)
    direct = a.get("direct_stream")
    if state == "healthy" and (direct or {}).get("ok") is False:
        return _c("API", "warn", f"no stream through this URL, nor directly from the server: the cause lies "
                  f"below ({_short(err)})", error=err)
    if state == "healthy" and direct is None and st.get("timed_out"):
        return _c("API", "warn", f"/health answers but no first token came: the cause lies below ({_short(err)})",
                  error=err)
    if state == "healthy":
        return _c("API", "fail", "the server is healthy" + (" and streams directly" if direct else "")
                  + f", but the API path fails: {_short(err)}", error=err, models_status=models.get("status"))
    return _c("API", "fail", f"no usable answer: {_short(err)}", error=err)


def _short(text: Any) -> str:
    return str(text).splitlines()[0][:140]


def _queued(ev: dict) -> bool:
    e = ev.get("engine") or {}
    m, slots = e.get("metrics") or {}, e.get("slots") or []
    busy = sum(1 for s in slots if s.get("is_processing"))
    return (m.get("llamacpp:requests_deferred") or 0) > 0 or (bool(slots) and busy == len(slots))


def _engine(ev: dict) -> LayerCheck:
    e = ev.get("engine") or {}
    if ev["kind"] == "engine":
        p = e.get("probe") or {}
        if p.get("ok"):
            return _c("engine", "ok", f"generated {p['chunks']} chunk(s) in {p['seconds']:.2f} s")
        return _c("engine", "fail" if p.get("error_layer") in ("engine", None) else "ok",
                  _short(p.get("error")), error=p.get("error"))
    m, slots = e.get("metrics") or {}, e.get("slots") or []
    busy = sum(1 for s in slots if s.get("is_processing"))
    deferred = m.get("llamacpp:requests_deferred")
    evid = dict(slots=len(slots) or None, busy=busy if slots else None, deferred=deferred,
                processing=m.get("llamacpp:requests_processing"))
    if not slots and not m:
        return _c("engine", "ok", "no /slots or /metrics here: nothing to check", **evid)
    waited = ((ev.get("api") or {}).get("stream") or {}).get("timed_out")   # our probe queued too
    if slots and busy == len(slots) and ((deferred or 0) > 0 or waited):
        return _c("engine", "fail", f"all {len(slots)} slots busy, {deferred or 0:.0f} request(s) deferred"
                  + (", our probe waited its whole timeout" if waited else "") + ": queueing, TTFT grows with "
                  "the queue", **evid)
    if slots and busy == len(slots):
        return _c("engine", "warn", f"all {len(slots)} slots busy (the next request waits)", **evid)
    api = ev.get("api") or {}
    if (api.get("direct_stream") or api.get("stream") or {}).get("timed_out"):
        return _c("engine", "fail", f"no first token within the probe's timeout though no request waits "
                  f"({busy}/{len(slots)} slots busy): generation is stuck or far too slow; check the "
                  "runtime's threads and the hardware's load", **evid)
    return _c("engine", "ok", f"{busy}/{len(slots)} slots busy, {deferred or 0:.0f} deferred", **evid)


def _runtime(ev: dict) -> LayerCheck:
    r = ev.get("runtime") or {}
    cmd, threads = r.get("cmdline") or [], r.get("threads")
    if "-t" in cmd and cmd.index("-t") + 1 < len(cmd):
        threads = int(cmd[cmd.index("-t") + 1])
    cores = (ev.get("memory") or {}).get("cores")
    if threads and cores and threads > cores:
        return _c("runtime", "warn", f"{threads} threads on {cores} logical cores: oversubscribed",
                  build=r.get("build_info"), threads=threads)
    return _c("runtime", "ok", f"{r.get('build_info') or 'build unknown'}, threads {threads or 'default'}",
              build=r.get("build_info"), threads=threads)


def _model(ev: dict) -> LayerCheck:
    m = ev.get("model") or {}
    if m.get("exists") is False:
        return _c("model", "fail", f"model file {m.get('model_path')} is missing", path=m.get("model_path"))
    turn = m.get("tool_turn")
    if turn is not None and not turn.get("ok") and turn.get("status") not in (None, 404):
        return _c("model", "fail", f"the chat template cannot render a tool-calling turn: "
                  f"{_short(turn.get('body'))}", path=m.get("model_path"), template_error=turn.get("body"))
    if ev["kind"] == "engine" and not m.get("chat_template"):
        return _c("model", "warn", "no chat template in the model: chat requests fall back to a default",
                  path=m.get("model_path"))
    tools = "; renders a tool turn" if turn and turn.get("ok") else ""
    if tools and m.get("supports_tools") is False:   # llama.cpp renders it, dropping the tool list
        tools += " (no native tool support: tool definitions are not in the prompt)"
    return _c("model", "ok", f"{Path(m.get('model_path') or 'model').name}, window {m.get('n_ctx') or '?'} "
              f"tokens per slot{tools}", path=m.get("model_path"), supports_tools=m.get("supports_tools"))


def _context(ev: dict) -> LayerCheck:
    c = ev.get("context") or {}
    n, window, want = c.get("prompt_tokens"), c.get("n_ctx_slot"), c.get("max_tokens") or 0
    st = (ev.get("api") or {}).get("stream") or (ev.get("engine") or {}).get("probe") or {}
    if st.get("error_layer") == "context":
        return _c("context", "fail", _short(st.get("error")))
    if n is None or not window:
        return _c("context", "ok", f"window {window or '?'} tokens per slot (no prompt given to check)")
    need = n + want
    status = "fail" if need > window else "warn" if need > 0.9 * window else "ok"
    return _c("context", status, f"prompt {n} + {want} new tokens = {need} of a {window}-token window "
              f"({need / window:.0%})", prompt_tokens=n, max_tokens=want, window=window)


def _kv(ev: dict) -> LayerCheck:
    ratio = (ev.get("kv") or {}).get("usage_ratio")
    if ratio is None:
        return _c("KV cache", "ok", "usage not exported here")
    src = (ev.get("kv") or {}).get("source") or "/metrics"
    return _c("KV cache", "warn" if ratio > 0.95 else "ok", f"{ratio:.0%} of the KV cache in use ({src})",
              usage_ratio=ratio, source=src)


def _memory(ev: dict) -> LayerCheck:
    m = ev.get("memory") or {}
    total, avail = m.get("total_bytes") or 1, m.get("available_bytes") or 0
    swap = (m.get("swap_used_bytes") or 0) / max(m.get("swap_total_bytes") or 1, 1)
    text = (f"server RSS {(m.get('rss_bytes') or 0) / 2**20:.0f} MiB, {avail / 2**30:.1f} of "
            f"{total / 2**30:.1f} GiB available, swap {swap:.0%} used")
    status = "fail" if avail < 0.03 * total else "warn" if avail < 0.10 * total or swap > 0.5 else "ok"
    return _c("memory", status, text, rss_bytes=m.get("rss_bytes"), available_bytes=avail, swap_used=swap)


def _hardware(ev: dict) -> LayerCheck:
    m = ev.get("memory") or {}
    load, cores = m.get("load_1m"), m.get("cores") or 1
    gpus = ", ".join(g.get("name", "?") for g in m.get("gpus") or []) or "no GPU"
    if load is not None and load > 2 * cores:
        return _c("hardware", "warn", f"load {load:.1f} on {cores} cores: other work competes for the CPU; {gpus}",
                  load_1m=load, cores=cores)
    return _c("hardware", "ok", f"load {load if load is None else round(load, 1)} on {cores} cores; {gpus}",
              load_1m=load, cores=cores)


def grade(ev: dict[str, Any]) -> LayerReport:
    """Turn one evidence snapshot into a verdict per layer, stopping at the first failure.

    Args:
        ev: a snapshot from `probes.collect_http` or `probes.collect_engine`.
    """
    checks: list[LayerCheck] = []
    if ev["kind"] == "http":
        state, text, evid = _server_state(ev)
        checks.append(_api(ev, state))
        cause = evid.get("log_cause")
        if state == "dead" and cause and LAYERS.index(cause[0]) > LAYERS.index("server"):
            checks.append(_c("server", "warn", f"{text}; {evid['cause_from']} names the {cause[0]} layer", **evid))
        else:
            status = "ok" if state == "healthy" else "fail"
            checks.append(_c("server", status, text + (f"; log: {cause[1]}" if cause else ""), **evid))
    else:
        checks += [_c("API", "skip", "in process: no API layer"), _c("server", "skip", "in process: no server")]
        cause = None
    graders = {"engine": _engine, "runtime": _runtime, "model": _model, "context": _context,
               "KV cache": _kv, "memory": _memory, "hardware": _hardware}
    for layer, grader in graders.items():
        if cause and cause[0] == layer:
            checks.append(_c(layer, "fail", f"the server died of it: {cause[1]}", log_line=cause[1]))
        elif ev["kind"] == "http" and checks[1].status != "ok" and layer in ("engine", "runtime", "model", "context"):
            checks.append(_c(layer, "skip", "cannot be asked while the server does not answer"))
        else:
            checks.append(grader(ev))
    first = next((i for i, c in enumerate(checks) if c.status == "fail"), None)
    if first is not None:  # the walk stops at the first failure: later layers are not reached
        checks = checks[:first + 1] + [LayerCheck(c.layer, "skip", f"not reached (stopped at {checks[first].layer})",
                                                  c.evidence) for c in checks[first + 1:]]
    return LayerReport(ev.get("target", "?"), checks)


def doctor_layers(url: str, **kw: Any) -> LayerReport:
    """Walk the layers of the server at `url` (see `probes.collect_http` for kw:
    server=, pid=, log_path=, prompt=, max_tokens=, timeout_s=)."""
    from infercourse.ops.probes import collect_http
    t0 = time.perf_counter()
    report = grade(collect_http(url, **kw))
    report.seconds = time.perf_counter() - t0
    return report


def doctor_engine(engine: Any, **kw: Any) -> LayerReport:
    """Walk the layers of an in-process engine (kw: prompt=, max_tokens=)."""
    from infercourse.ops.probes import collect_engine
    t0 = time.perf_counter()
    report = grade(collect_engine(engine, **kw))
    report.seconds = time.perf_counter() - t0
    return report

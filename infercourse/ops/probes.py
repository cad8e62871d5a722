"""What the layer doctor looks at: one snapshot of evidence from every layer of a stack.

Troubleshooting goes wrong when evidence is gathered one hunch at a time. `collect_http`
and `collect_engine` take one snapshot of everything cheap to look at, with short
timeouts, so a frozen or dead server costs seconds, not minutes:

| layer    | evidence (HTTP server)                                                 |
|----------|------------------------------------------------------------------------|
| API      | GET /v1/models; one tiny streamed chat request: chunks, [DONE], usage, |
|          | client TTFT vs the server's own `timings.prompt_ms`                    |
| server   | GET /health (through the URL, and directly when the server is known);  |
|          | the process (alive? stopped?) and its log tail; once it is dead, the   |
|          | kernel's OOM-kill records (`ops.death`: cgroup counter, `dmesg`)       |
| engine   | /slots (busy) and /metrics (`requests_deferred`, `requests_processing`)|
| runtime  | /props `build_info`, the `-t` threads on the command line              |
| model    | /props `model_path`, `chat_template`; /apply-template of a tool turn   |
| context  | /tokenize of the prompt you give vs the per-slot window                |
| KV cache | /metrics `kv_cache_usage_ratio`, else the tokens `/slots` holds         |
| memory   | server RSS, available RAM, swap (psutil)                               |
| hardware | 1-min load per core, GPUs (nvidia-smi)                                 |

Through llama-server's router mode (several models behind one URL, `servers.llama_router`)
every probe names one model: the GETs carry `?model=`, the POSTs a `model` field, as the
router requires; `memory` is then the router's own RSS, not its model children's.

The snapshot is a plain JSON-able dict; `infercourse.ops.layers.grade` turns it into
verdicts. Keeping the two apart means the grading rules are tested on synthetic
snapshots, and a notebook can show the raw evidence behind every verdict.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import psutil

from infercourse.core.errors import InferCourseError

__all__ = ["TOOL_TURN", "collect_http", "collect_engine", "process_info", "machine_info", "parse_metrics"]

# A tool-calling conversation: the turn a broken chat template fails on.
TOOL_TURN = {
    "messages": [{"role": "user", "content": "List the files in src."},
                 {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                     "name": "list_files", "arguments": "{\"path\": \"src\"}"}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "src/a.py"}],
    "tools": [{"type": "function", "function": {"name": "list_files", "description": "List files.",
                                                "parameters": {"type": "object",
                                                               "properties": {"path": {"type": "string"}}}}}]}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value} (labels dropped, samples of one name summed)."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[s.name] = out.get(s.name, 0.0) + float(s.value)
    except ValueError:
        pass
    return out


def process_info(pid: int | None) -> dict[str, Any]:
    """Alive, state (R/S/T=stopped/Z=zombie), RSS and threads of one process."""
    if pid is None:
        return {"pid": None, "alive": None}
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            status = p.status()
            info = {"pid": pid, "alive": status != psutil.STATUS_ZOMBIE, "status": status,
                    "rss_bytes": p.memory_info().rss, "vms_bytes": p.memory_info().vms,
                    "threads": p.num_threads(), "cmdline": p.cmdline()}
        return info
    except psutil.NoSuchProcess:
        return {"pid": pid, "alive": False, "status": "gone"}
    except psutil.Error as e:
        return {"pid": pid, "alive": None, "status": f"unreadable ({type(e).__name__})"}


def machine_info() -> dict[str, Any]:
    """Memory and CPU load of the whole machine, plus GPUs where nvidia-smi exists."""
    vm, sw = psutil.virtual_memory(), psutil.swap_memory()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cores = psutil.cpu_count(logical=True) or 1
    gpus = []
    try:  # live GPU memory/utilisation where the hardware module offers it
        from infercourse.measure import hardware
        gpus = hardware.gpu_stats() if hasattr(hardware, "gpu_stats") else hardware.hardware_info().get("gpus")
    except Exception:  # a GPU probe must never take the report down
        pass
    return {"total_bytes": vm.total, "available_bytes": vm.available, "swap_total_bytes": sw.total,
            "swap_used_bytes": sw.used, "load_1m": load, "cores": cores, "gpus": gpus}


def _get(client: httpx.Client, url: str) -> dict[str, Any]:
    """One GET: status and JSON/text body, or the transport error's kind."""
    t0 = time.perf_counter()
    try:
        r = client.get(url)
    except httpx.ConnectError:
        return {"ok": False, "error": "refused", "seconds": time.perf_counter() - t0}
    except httpx.TimeoutException:
        return {"ok": False, "error": "timeout", "seconds": time.perf_counter() - t0}
    except httpx.HTTPError as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t0}
    try:
        body: Any = r.json()
    except ValueError:
        # a whole /metrics page (a cut one fails to parse wherever the cut falls: its length moves
        # with the counters' digits); an error page only needs its first lines
        body = r.text[:200_000] if r.status_code < 400 else r.text[:300]
    return {"ok": r.status_code < 400, "status": r.status_code, "body": body,
            "seconds": time.perf_counter() - t0}


def _probe_stream(url: str, model: str, timeout_s: float) -> dict[str, Any]:
    """One tiny streamed chat request through OpenAIHTTPEngine: the API as a client sees it."""
    from infercourse.engines.openai_http import OpenAIHTTPEngine
    engine = OpenAIHTTPEngine(url, model=model, timeout=timeout_s)
    t0, events, out = time.perf_counter(), [], {}
    try:
        for ev in engine.stream("Say OK.", max_tokens=4):
            events.append(ev)
        done = events[-1]
        server_s = sum(done.timings.get(k) or 0.0 for k in ("prompt_ms", "predicted_ms")) / 1e3 or None
        first = next((e.t for e in events if not e.done), done.t)
        out = {"ok": True, "chunks": len(events) - 1, "usage_source": done.usage.source if done.usage else None,
               "ttft_s": first - t0, "e2e_s": done.t - t0, "server_s": server_s,
               "server_prompt_s": (done.timings.get("prompt_ms") or 0.0) / 1e3 if done.timings else None}
    except InferCourseError as e:
        out = {"ok": False, "error": str(e), "error_layer": e.layer, "chunks": len(events),
               "timed_out": isinstance(e.__cause__, httpx.TimeoutException),
               "refused": isinstance(e.__cause__, httpx.ConnectError)}
    finally:
        engine.close()
    out["seconds"] = time.perf_counter() - t0
    return out


def _log_info(server: Any, log_path: str | Path | None) -> dict[str, Any]:
    path = Path(log_path) if log_path else getattr(server, "log_path", None)
    if path is None or not Path(path).is_file():
        return {"log_path": str(path) if path else None, "log_tail": None, "exit_code": None}
    from collections import deque
    with open(path, errors="replace") as f:
        tail = "".join(deque(f, maxlen=40))
    m = re.findall(r"exited by itself with code (-?\d+)", tail)
    return {"log_path": str(path), "log_tail": tail, "exit_code": int(m[-1]) if m else None}


def _listener_pid(port: int | None) -> int | None:
    """The pid listening on a local port (our own user's processes), if any."""
    if not port:
        return None
    try:
        for c in psutil.net_connections("tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return c.pid
    except (psutil.Error, OSError):
        pass
    return None


_FIRST_OOM: dict[str, int] = {}   # this process's first reading of its cgroup's OOM-kill counter


def _oom_evidence(pid: int | None, before: int | None, dead: bool) -> dict[str, Any]:
    """The kernel's records of an OOM kill (`ops.death`): the cgroup's counter now and before
    (`before`, else this process's first reading, taken by an earlier walk), and, once the
    server is dead, the kernel log's lines naming its pid."""
    from infercourse.ops.death import kernel_oom_lines, oom_kills_now
    now = oom_kills_now(pid)
    first = _FIRST_OOM.get("oom_kill")
    if now["oom_kill"] is not None:
        _FIRST_OOM.setdefault("oom_kill", now["oom_kill"])
    return {"now": now, "before": before if before is not None else first,
            "kernel": kernel_oom_lines(pid) if dead and pid else {}}


def collect_http(url: str, *, server: Any = None, pid: int | None = None, log_path: str | Path | None = None,
                 prompt: str | None = None, max_tokens: int = 0, timeout_s: float = 5.0,
                 model: str | None = None, oom_before: int | None = None) -> dict[str, Any]:
    """Evidence from an OpenAI-compatible server at `url`.

    Args:
        url: the server root a client uses (may be a proxy in front of the server).
        server: the `infercourse.servers.Server` behind it, when the course started it
            (gives its pid, its log and its direct URL).
        pid, log_path: the same for a server started elsewhere.
        prompt: a prompt whose fit in the context window is checked.
        max_tokens: tokens that prompt asks for (counted against the window too).
        timeout_s: read timeout of every probe (a frozen server costs this, not more).
        model: the model to probe, by name or alias (default: the server's only one; on a
            router, the first loaded one). Through llama-server's router mode the GET probes
            carry `?model=NAME&autoload=false` (a probe must not load or swap a model) and
            the POST ones a `model` field.
        oom_before: the cgroup's OOM-kill counter read before the trouble began (the fault
            lab reads it before each fault); None: this process's first reading, if any.
    """
    root = url.rstrip("/").removesuffix("/v1")
    ev: dict[str, Any] = {"kind": "http", "target": root}
    port = httpx.URL(root).port
    pid = pid or getattr(server, "pid", None) or _listener_pid(port)
    proc = process_info(pid)
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0))) as c:
        models = _get(c, root + "/v1/models")
        data = models.get("body", {}).get("data") if isinstance(models.get("body"), dict) else None
        # llama-server's router lists every preset with a status object; a plain server does not
        routed = bool(data) and isinstance(data[0].get("status"), dict)
        loaded = [m for m in data or [] if routed and (m.get("status") or {}).get("value") == "loaded"]
        model = model or ((loaded or data)[0].get("id", "default") if data else "default")
        q = f"?{urlencode({'model': model, 'autoload': 'false'})}" if routed else ""
        named = {"model": model} if routed else {}
        # a dead, stopped or silent server would make every further probe wait its timeout
        silent = models.get("error") in ("refused", "timeout") or proc.get("status") in ("stopped", "gone")
        ev["api"] = {"models": models, "stream": _probe_stream(root, model, timeout_s) if not silent else
                     {"ok": False, "error": f"not tried: /v1/models {models.get('error') or 'ok'}",
                      "refused": models.get("error") == "refused", "timed_out": models.get("error") == "timeout"}}
        direct = getattr(server, "url", None)
        direct = direct if direct and direct != root else None
        known_down = proc.get("status") in ("stopped", "gone")
        health = models if silent else _get(c, root + "/health")
        ev["server"] = {"health": health, "direct_url": direct, "process": proc, **_log_info(server, log_path),
                        "direct_health": None if not direct else health if known_down else _get(c, direct + "/health"),
                        "oom": _oom_evidence(pid, oom_before,
                                             dead=proc.get("status") == "gone" or models.get("error") == "refused")}
        if direct and not ev["api"]["stream"].get("ok") and ev["server"]["direct_health"].get("ok"):
            ev["api"]["direct_stream"] = _probe_stream(direct, model, timeout_s)   # the wire, or the server?
        base = direct or root   # the server's own endpoints: ask it directly when we can
        answers = bool((ev["server"]["direct_health"] or health).get("status"))
        slots, metrics, props = (_get(c, base + p + q) if answers else {} for p in ("/slots", "/metrics", "/props"))
        ev["engine"] = {"slots": slots.get("body") if isinstance(slots.get("body"), list) else None,
                        "metrics": parse_metrics(metrics["body"]) if isinstance(metrics.get("body"), str) else {}}
        p = props.get("body") if isinstance(props.get("body"), dict) else {}
        ev["runtime"] = {"build_info": p.get("build_info"), "cmdline": ev["server"]["process"].get("cmdline")}
        tmpl = _post(c, base + "/apply-template", {**TOOL_TURN, **named}) if p else None
        ev["model"] = {"model_path": p.get("model_path"), "chat_template": p.get("chat_template"),
                       "tool_turn": tmpl, "n_ctx": (p.get("default_generation_settings") or {}).get("n_ctx"),
                       "supports_tools": (p.get("chat_template_caps") or {}).get("supports_tools")}
        ev["context"] = {"n_ctx_slot": ev["model"]["n_ctx"], "max_tokens": max_tokens, "prompt_tokens": None}
        if prompt is not None:
            tok = _post(c, base + "/tokenize", {"content": prompt, "add_special": True, **named})
            body = (tok or {}).get("body")
            ev["context"]["prompt_tokens"] = len(body["tokens"]) if isinstance(body, dict) and "tokens" in body else None
    ratio, source = ev["engine"]["metrics"].get("llamacpp:kv_cache_usage_ratio"), "/metrics kv_cache_usage_ratio"
    if ratio is None and ev["engine"].get("slots"):
        # this llama-server build exports no KV gauge: tokens the slots hold over their context,
        # as the soak samples it (ops.sampling.slots_usage)
        from infercourse.ops.sampling import slots_usage
        u = slots_usage(ev["engine"]["slots"])
        ratio, source = u["kv_used_frac"], f"/slots: {u['kv_used_tokens']} of {u['kv_ctx_tokens']} tokens held"
    ev["kv"] = {"usage_ratio": ratio, "source": source if ratio is not None else None}
    ev["memory"] = {"rss_bytes": ev["server"]["process"].get("rss_bytes"), **machine_info()}
    return ev


def _post(client: httpx.Client, url: str, body: dict) -> dict[str, Any] | None:
    try:
        r = client.post(url, json=body)
    except httpx.HTTPError as e:
        return {"ok": False, "error": type(e).__name__}
    try:
        out: Any = r.json()
    except ValueError:
        out = r.text[:300]
    return {"ok": r.status_code < 400, "status": r.status_code, "body": out}


def collect_engine(engine: Any, *, prompt: str | None = None, max_tokens: int = 0) -> dict[str, Any]:
    """Evidence from an in-process engine: no API or server layer, the rest as for HTTP.

    Args:
        engine: an engine object (`stream`, `describe`; `tokenize` where it has one).
        prompt: a prompt whose fit in the context window is checked.
        max_tokens: tokens that prompt asks for.
    """
    desc = engine.describe()
    flags = desc.get("flags") or {}
    ev: dict[str, Any] = {"kind": "engine", "target": f"{desc.get('engine', engine.name)} in process"}
    t0 = time.perf_counter()
    try:
        events = list(engine.stream("Say OK.", max_tokens=4))
        ev["engine"] = {"probe": {"ok": True, "chunks": len(events) - 1, "seconds": time.perf_counter() - t0}}
    except InferCourseError as e:
        ev["engine"] = {"probe": {"ok": False, "error": str(e), "error_layer": e.layer}}
    path = desc.get("model")
    ev["runtime"] = {"build_info": f"{desc.get('runtime', '')} {desc.get('version', '')}".strip(),
                     "threads": flags.get("n_threads")}
    ev["model"] = {"model_path": str(path) if path else None,
                   "exists": Path(path).exists() if path else None,   # an MLX or HF model is a folder
                   "chat_template": getattr(engine, "_template", None), "n_ctx": flags.get("n_ctx")}
    n = len(engine.tokenize(prompt)) if prompt is not None and hasattr(engine, "tokenize") else None
    ev["context"] = {"n_ctx_slot": flags.get("n_ctx"), "max_tokens": max_tokens, "prompt_tokens": n}
    me = process_info(os.getpid())
    ev["kv"] = {"usage_ratio": None}
    ev["memory"] = {"rss_bytes": me.get("rss_bytes"), **machine_info()}
    return ev

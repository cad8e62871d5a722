"""`infercourse doctor agent URL --agent claude-code|codex|chat`: is this server ready for a real agent?

A real agent's first call is not a chat message: Claude Code 2.1.328's is ~49 KB (three system
blocks, 12 tool schemas, a `role: "system"` message, `max_tokens: 32000`), about 10,000 tokens
for SmolLM2's tokenizer, and it arrives cold. Each check below asks the server what that call
will meet, and each grade says which layer fails and what fixes it:

| check | how | fails at |
|---|---|---|
| window | the slot's `n_ctx` (`/props`, `/slots`) against the agent's first prompt + output headroom | context |
| count_tokens | `POST /v1/messages/count_tokens` answers | API (warning) |
| system message | a `role: "system"` message inside `messages` is accepted | API |
| header | two calls that differ only in the billing header's suffix: cached tokens of the second | KV cache |
| model IDs | the agent's main and small/fast model IDs each get an answer | API |
| split start | Claude Code: a greedy streamed answer that begins inside a character still starts with `message_start` (`anthropic_probe.probe_split_start`) | API (warning) |
| cold prefill | the first prompt on a prefill curve fitted to one cold prompt grown in three steps (`ops.prefill_probe`), against the agent's timeout | API |

The first prompt's size comes from a capture of the real agent (`--capture DIR`, a lab run's
folder) or from `data/agent_shapes.json` (numbers measured from the pinned versions; no text).
Probing talks to the server (`probe_agent_route`); grading is pure (`grade_agent_route`), and
`fixes` turns the grades into the settings to paste, with values computed from the probe;
`server_fix` names the server's own change where the window is too small for the agent (the
slot window it needs, with the YaRN flags where that passes the model's trained context).
Agents over chat completions (`--agent chat --spec NAME|FILE`) are checked by `ops.chat_doctor`;
the command line is `ops.agent_doctor_cli`.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx

from infercourse.core.errors import InferCourseError
from infercourse.measure.workloads import DATA_DIR
from infercourse.ops.agent_budget import budget_line, claude_budget, padded_window
from infercourse.ops.anthropic_probe import grade_split_start, probe_split_start
from infercourse.ops.anthropic_probe import post_messages as _messages
from infercourse.ops.layers import LayerCheck
from infercourse.ops.prefill_probe import cold_forecast, cold_text, curve_lengths, probe_curve

__all__ = ["SHAPES", "agent_shape", "shape_from_capture", "probe_agent_route", "grade_agent_route", "fixes",
           "server_fix", "window_needed", "report", "DEFAULT_TIMEOUT_S"]

SHAPES = DATA_DIR / "agent_shapes.json"
# the agents' own defaults for how long they wait on a silent stream (Claude Code: API_TIMEOUT_MS,
# 600,000 ms; Codex: stream_idle_timeout_ms, 300,000 ms)
DEFAULT_TIMEOUT_S = {"claude-code": 600.0, "codex": 300.0}
DEFAULT_MODELS = {"claude-code": ("claude-sonnet-4-6", "claude-haiku-4-5"), "codex": ("gpt-5.2-codex", None)}


def agent_shape(agent: str, capture: str | Path | None = None) -> dict[str, Any]:
    """The agent's first request in numbers: prompt tokens, max_tokens, bytes. From a lab
    capture when given (its first generating call; max_tokens stays the agent's own default
    from `data/agent_shapes.json`, not the cap the lab set, so the doctor warns as it would
    for a learner's agent), else from that file."""
    shapes = json.loads(SHAPES.read_text())
    if capture is not None:
        for line in (Path(capture) / "requests.jsonl").read_text().splitlines():
            row = json.loads(line)
            tags = row.get("tags", {})
            if tags.get("api") in ("anthropic", "openai-responses") and row.get("prompt_tokens"):
                own = shapes.get(agent, {}).get("first_request", {}).get("max_tokens")
                return {"source": str(capture), "prompt_tokens": row["prompt_tokens"], "captured_max_tokens":
                        tags.get("max_tokens"), "max_tokens": own or tags.get("max_tokens"), "bytes": tags.get("body_bytes")}
        raise InferCourseError(f"{capture}: no generating call with a prompt size in this capture")
    if agent not in shapes:
        raise InferCourseError(f"no shape for agent {agent!r} in {SHAPES}; one of {sorted(shapes)}")
    s = shapes[agent]["first_request"]
    return {"source": f"{SHAPES.name} ({agent} {shapes[agent]['version']})", **s}


def _server_count(row: dict[str, Any]) -> int | None:
    """The prompt size the server counted: its usage, or the number in its refusal
    ("request (10089 tokens) exceeds the available context size ...")."""
    import re
    if row.get("prompt_tokens"):
        return int(row["prompt_tokens"])
    m = re.search(r"request \((\d+) tokens\)", row.get("error") or "")
    return int(m.group(1)) if m else None


def shape_from_capture(out: str | Path, agent: str) -> dict[str, Any]:
    """Numbers only, from a lab run's first call of `agent`: its size by the server's count,
    bytes, max_tokens, the body's top-level fields, and per part kind the count, bytes and
    tokens (the anatomy). No text of the request is kept: what `data/agent_shapes.json` holds."""
    from infercourse.ops.agent_lab import anatomy
    rows = [json.loads(line) for line in (Path(out) / "requests.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["tags"].get("agent") == agent and r["tags"].get("api") in ("anthropic", "openai-responses")]
    if not rows:
        raise InferCourseError(f"{out}: no generating call of {agent}")
    first = rows[0]
    body = json.loads((Path(out) / "bodies" / f"{first['request_id']:03d}.json").read_text())
    anat = next(a for a in anatomy(out) if a["request_id"] == first["request_id"])
    kinds: dict[str, dict[str, int]] = {}
    for p in anat["parts"]:
        k = kinds.setdefault(p["kind"], {"count": 0, "bytes": 0, "tokens": 0})
        k["count"] += 1
        k["bytes"] += p["bytes"]
        k["tokens"] += p["tokens"]
    manifest = json.loads((Path(out) / "manifest.json").read_text())
    return {"version": manifest["agents"][agent], "api": first["tags"]["api"],
            "first_request": {"prompt_tokens": _server_count(first), "max_tokens": first["tags"].get("max_tokens"),
                              "bytes": first["tags"]["body_bytes"], "fields": sorted(body),
                              "parts": kinds, "tokenizer": "SmolLM2-135M (the embedded model)"}}


def _usage(doc: dict[str, Any]) -> tuple[int | None, int | None]:
    """(prompt, cached) of an Anthropic answer; no cache field reads as 0 cached."""
    from infercourse.ops.agent_capture import usage_tokens
    t = usage_tokens(doc.get("usage") or {})
    return t["prompt_tokens"], (t["cached_tokens"] or 0) if t["prompt_tokens"] is not None else None


def _header_body(model: str, suffix: str, static: str) -> dict[str, Any]:
    return {"model": model, "max_tokens": 1, "stream": False,
            "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.328.{suffix}; "
                                                "cc_entrypoint=sdk-cli;"},
                       {"type": "text", "text": static, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "Say OK."}]}


def probe_agent_route(url: str, agent: str = "claude-code", *, models: tuple[str, str | None] | None = None,
                      probe_tokens: int = 512, timeout_s: float = 300.0) -> dict[str, Any]:
    """Ask the server what the agent's calls will meet (loopback URL; ~4 short calls and one
    uncached prefill of about `probe_tokens`)."""
    from infercourse.ops.agent_lab import served_trained_context
    url = url.rstrip("/")
    ev: dict[str, Any] = {"agent": agent}
    props = httpx.get(url + "/props", timeout=10)
    ev["n_ctx_slot"] = ((props.json().get("default_generation_settings") or {}).get("n_ctx")
                        if props.status_code == 200 else None)
    served = httpx.get(url + "/v1/models", timeout=10)
    data = served.json().get("data", []) if served.status_code == 200 else []
    ev["served_models"] = [m.get("id") for m in data]
    ev["arch"], ev["n_ctx_train"], ev["trained_from"] = served_trained_context(
        props.json() if props.status_code == 200 else {}, data)
    main, small = models or DEFAULT_MODELS[agent]
    r = httpx.post(url + "/v1/messages/count_tokens", timeout=30,
                   json={"model": main, "messages": [{"role": "user", "content": "hello"}]})
    ev["count_tokens_status"] = r.status_code
    st, doc = _messages(url, {"model": main, "max_tokens": 1, "messages": [
        {"role": "system", "content": "You run in a terminal."}, {"role": "user", "content": "Say OK."}]}, timeout_s)
    ev["system_message_status"], ev["system_message_error"] = st, (doc.get("error") or {}).get("message")
    ev["model_status"] = {}
    for mid in (m for m in (main, small) if m):
        st, doc = _messages(url, {"model": mid, "max_tokens": 1, "messages": [{"role": "user", "content": "OK?"}]},
                            timeout_s)
        ev["model_status"][mid] = {"status": st, "error": (doc.get("error") or {}).get("message")}
    if agent == "claude-code":   # its client needs message_start; Codex's Responses stream has no such event
        ev["split_start"] = probe_split_start(url, main, timeout_s)
    if ev["n_ctx_slot"]:   # the probe must fit the window it measures
        probe_tokens = min(probe_tokens, ev["n_ctx_slot"] // 3)
    static = cold_text(probe_tokens)   # new every probe: cold
    t0 = time.perf_counter()
    st, first = _messages(url, _header_body(main, "aaa", static), timeout_s)
    ev["probe_s"] = time.perf_counter() - t0
    ev["probe_prompt_tokens"], _ = _usage(first)
    timings = first.get("timings") or {}
    ev["prefill_tok_per_s"] = timings.get("prompt_per_second") or (
        ev["probe_prompt_tokens"] / ev["probe_s"] if ev["probe_prompt_tokens"] else None)
    _, second = _messages(url, _header_body(main, "bbb", static), timeout_s)   # only the suffix differs
    ev["header_prompt_tokens"], ev["header_cached_tokens"] = _usage(second)
    _, third = _messages(url, _header_body(main, "bbb", static), timeout_s)    # control: identical
    ev["control_prompt_tokens"], ev["control_cached_tokens"] = _usage(third)
    ev["prefill_points"] = probe_curve(url, main, curve_lengths(ev["n_ctx_slot"]), timeout_s)   # the rate falls with n
    return ev


def _check(layer: str, status: str, summary: str, **evidence: Any) -> LayerCheck:
    return LayerCheck(layer, status, summary, evidence)


def grade_agent_route(ev: dict[str, Any], shape: dict[str, Any], *, timeout_s: float | None = None,
                      min_output: int = 1024) -> list[LayerCheck]:
    """Pure: the probe's evidence and the agent's first-request shape -> one check per row of
    the module's table."""
    out, first = [], int(shape["prompt_tokens"])
    n_ctx = ev.get("n_ctx_slot")
    if n_ctx is None:
        out.append(_check("context", "warn", "the slot's window is unknown (no /props): cannot check the fit"))
    elif first >= n_ctx:
        out.append(_check("context", "fail", f"the agent's first request ({first} tokens) does not fit the slot "
                          f"({n_ctx} tokens): every call is refused", first_prompt=first, n_ctx_slot=n_ctx))
    elif n_ctx - first < min_output:
        out.append(_check("context", "warn", f"{first} of {n_ctx} tokens taken by the first request: "
                          f"{n_ctx - first} left for the answer and the session", first_prompt=first, n_ctx_slot=n_ctx))
    else:
        out.append(_check("context", "ok", f"first request {first} of {n_ctx} tokens; {n_ctx - first} left",
                          first_prompt=first, n_ctx_slot=n_ctx))
    asked = shape.get("max_tokens")
    if n_ctx and asked and first < n_ctx and first + asked > n_ctx:   # (a refused request: its failure says it)
        out.append(_check("context", "warn", f"the agent asks for max_tokens {asked}, the window leaves "
                          f"{max(0, n_ctx - first)}: the server clips it and a long answer ends with "
                          "stop_reason max_tokens, silently cut", max_tokens=asked))
    ct = ev.get("count_tokens_status")
    out.append(_check("API", "ok" if ct == 200 else "warn",
                      "count_tokens answers" if ct == 200 else f"no count_tokens (HTTP {ct}): the agent "
                      "estimates its context instead", http_status=ct))
    sm = ev.get("system_message_status")
    out.append(_check("API", "ok" if sm == 200 else "fail",
                      "a role: system message is accepted" if sm == 200 else
                      f"a role: system message is refused (HTTP {sm}: {ev.get('system_message_error')})", http_status=sm))
    prompt, cached = ev.get("header_prompt_tokens"), ev.get("header_cached_tokens")
    ctl_p, ctl_c = ev.get("control_prompt_tokens"), ev.get("control_cached_tokens")
    if prompt and ctl_p:
        share, control = cached / prompt, ctl_c / ctl_p
        if control < 0.5:
            out.append(_check("KV cache", "warn", f"no prefix reuse even for an identical call ({control:.0%} "
                              "cached): the header test says nothing", control_share=control))
        elif share < 0.5:
            out.append(_check("KV cache", "fail", f"a new header suffix busts the cache: {cached} of {prompt} "
                              f"tokens reused (identical call: {ctl_c} of {ctl_p}); each new task re-prefills "
                              "everything", share=share, control_share=control))
        else:
            out.append(_check("KV cache", "ok", f"a new header suffix keeps the cache: {cached} of {prompt} reused",
                              share=share))
    for mid, r in (ev.get("model_status") or {}).items():
        ok = r["status"] == 200
        out.append(_check("API", "ok" if ok else "fail", f"model ID {mid!r} " + (
            "answers" if ok else f"refused (HTTP {r['status']}: {r['error']})"), model=mid, http_status=r["status"],
            error=r["error"]))
    split = grade_split_start(ev.get("split_start") or {})
    if split is not None:
        out.append(split)
    limit, forecast = timeout_s or DEFAULT_TIMEOUT_S.get(ev.get("agent"), 600.0), cold_forecast(first, ev)
    if forecast:
        cold, how = forecast
        out.append(_check("API", "ok" if cold < 0.5 * limit else ("warn" if cold < limit else "fail"),
                          f"a cold first call needs about {cold:.0f} s of prefill ({how}) against the "
                          f"agent's {limit:.0f} s timeout", cold_prefill_s=cold, timeout_s=limit))
    return out


def window_needed(agent: str, shape: dict[str, Any], min_output: int = 1024) -> int:
    """The slot window to ask of the server (steps of 256): the first request and `min_output`;
    for Claude Code `claude_budget`'s (a usable answer cap and room to grow before it compacts)."""
    if agent == "claude-code":
        return int(claude_budget(int(shape["prompt_tokens"]))["window"])
    return padded_window(int(shape["prompt_tokens"]) + min_output)


def server_fix(agent: str, ev: dict[str, Any], shape: dict[str, Any], min_output: int = 1024) -> str | None:
    """What the server must change, computed from the probe (None: nothing): a slot window of
    `window_needed`, extended with YaRN where that passes the model's trained context."""
    from infercourse.ops.agent_lab import EXTEND_CONTEXT
    n_ctx, first, need = ev.get("n_ctx_slot"), int(shape["prompt_tokens"]), window_needed(agent, shape, min_output)
    if not n_ctx or n_ctx >= need or (agent == "claude-code" and claude_budget(first, n_ctx)["fits"]):
        return None
    why = (f"the first request ({first:,} tokens) does not fit the slot's {n_ctx:,}" if n_ctx < first + min_output
           else f"on {n_ctx:,} tokens Claude Code cannot have both an answer cap it can work with and room to grow "
           "under its compaction line: it compacts after a step or two, or at every call")
    flags, train = f"-c {need} -np 1", ev.get("n_ctx_train")
    if train and need > train:
        arch = ev.get("arch") or "ARCH"
        flags += (f" {' '.join(EXTEND_CONTEXT(need, train, arch=arch))}   ("
                  + ("" if ev.get("arch") else "ARCH: the model's general.architecture, llama for SmolLM2; ")
                  + f"past the {train:,} tokens it was trained on, read from {ev.get('trained_from', 'the server')}: "
                  "a quality cost, which notebook 20 measures)")
    return f"server: {why}; start llama-server with a slot window of at least {need:,} tokens: {flags}"


def settings_window(agent: str, ev: dict[str, Any], shape: dict[str, Any]) -> int | None:
    """The window the printed settings name: the slot's, or the one the server's fix asks for."""
    n_ctx = ev.get("n_ctx_slot")
    return max(n_ctx or 0, window_needed(agent, shape)) if server_fix(agent, ev, shape) else n_ctx


def report(agent: str, url: str, ev: dict[str, Any], shape: dict[str, Any], checks: list[LayerCheck],
           served_name: str | None = None) -> str:
    """The checks, one line each, then the server's fix (where one is needed) and the agent's settings."""
    lines = [f"  [{c.status:4}] {c.layer:8} {c.summary}" for c in checks]
    fix = server_fix(agent, ev, shape)
    if agent == "claude-code" and ev.get("n_ctx_slot"):   # the budget on the window the settings name
        w = settings_window(agent, ev, shape)
        lines.append(budget_line(int(shape["prompt_tokens"]), w, "Claude Code on " + (
            "this server's window" if w == ev["n_ctx_slot"] else "the window the server's fix below asks for")))
    return "\n".join(lines + ([fix] if fix else []) + [
        "settings that fix what was found" + (" (with the server's fix)" if fix else "") + ":",
        fixes(agent, url, ev, shape, checks, served_name)])


def fixes(agent: str, url: str, ev: dict[str, Any], shape: dict[str, Any], checks: list[LayerCheck],
          served_name: str | None = None) -> str:
    """The settings that fix what the checks found, with values from the probe: Claude
    Code's `env` block, or Codex's provider block."""
    from infercourse.ops.agents import claude_env, claude_settings, codex_config
    n_ctx = settings_window(agent, ev, shape)
    cold = (cold_forecast(int(shape["prompt_tokens"]), ev) or (None,))[0]   # the forecast the checks print
    timeout_s = max(DEFAULT_TIMEOUT_S[agent], 3 * cold) if cold else DEFAULT_TIMEOUT_S[agent]
    name = served_name or (ev.get("served_models") or ["local-model"])[0]
    if agent == "codex":
        return codex_config(url, name, stream_idle_timeout_ms=int(timeout_s * 1000), stream_max_retries=1,
                            request_max_retries=1, context_window=n_ctx)
    # the pinned Claude Code takes its window from CLAUDE_CODE_MAX_CONTEXT_TOKENS (it reads an
    # AUTO_COMPACT_WINDOW under 100k as 100k); the cap comes with the compaction line (claude_budget)
    return claude_settings(claude_env(url, name, window=n_ctx, first=int(shape["prompt_tokens"]), timeout_s=timeout_s,
                                      header_off=any(c.layer == "KV cache" and c.status == "fail" for c in checks)))

"""`infercourse doctor agent URL --agent chat`: is this server ready for an agent over chat completions?

`ops.agent_doctor` checks a server for Claude Code and Codex. Agents that speak OpenAI chat
completions (`POST /v1/chat/completions`) meet the same failures, and one more: a **side
call** with another system prompt (a title generator, a memory extractor, a next-speaker
check) that, on a one-slot server keeping no prefixes elsewhere, evicts the main prompt, so
every task prefills the main prompt again. Each check asks the server itself:

| check | how | fails at |
|---|---|---|
| window | the slot's `n_ctx` (`/props`) against the agent's first request | context |
| max_tokens | what the agent asks for (or nothing) against what the window leaves, and llama-server's `-n`, which does not cap a request that names `max_tokens` | context |
| side calls | main, main again (control), side, main, side, main: tokens the server evaluated per call, from its own `timings.prompt_n` (per request: right even when calls overlap, unlike `/metrics` deltas) | KV cache |
| slot save/restore | main, save slot 0, side, restore, main (only where `--slot-save-path` is set) | KV cache |
| prefix across tasks | the capture's first main call of each task against the one before with the same system prompt | KV cache |
| cold prefill | the first request on a prefill curve fitted to one cold prompt grown in three steps (`ops.prefill_probe`), against the agent's timeout | API |

The agent's shape (first request, its side calls, where a new task differs) comes from a
capture (`--capture DIR`: a lab run or a recorded session, `chat_shape`) or from
`data/agent_shapes_chat.json` for a shipped spec (numbers only). Probing talks to the server
(`probe_chat_route`; ~10 short calls); grading is pure (`grade_chat_route`); `chat_fixes`
computes the settings: the window, a cap on the answer, a timeout, and the server change that
holds the main prefix (`--cache-ram` sized from the KV bytes per token the server's own slot
save or model file gives, `-np 2` with its window, slot save/restore), in the agent's own
settings file where its spec says where (`settings`).
"""
from __future__ import annotations

import json
import math
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from infercourse.core.errors import InferCourseError
from infercourse.measure.workloads import DATA_DIR
from infercourse.ops.layers import LayerCheck
from infercourse.ops.prefill_probe import cold_forecast, curve_lengths, probe_curve

__all__ = ["CHAT_SHAPES", "chat_shape", "shape_entry", "probe_chat_route", "grade_chat_route", "chat_fixes", "chat_report",
           "evicts", "kv_mib", "doctor_on_fresh_server"]

CHAT_SHAPES = DATA_DIR / "agent_shapes_chat.json"
_FILL = "The agent reads the build log, edits one file and runs the tests again before it answers. "


def chat_shape(agent: str, capture: str | Path | None = None) -> dict[str, Any]:
    """The agent's calls in numbers: its first main request (prompt tokens by the server's
    count, max_tokens, bytes), its side calls (how many per task, their prompt tokens), and
    where a new task's main call first differs from the last one with the same system prompt.
    From a capture (a lab run or a recorded session) when given, else the shipped numbers."""
    if capture is None:
        shapes = json.loads(CHAT_SHAPES.read_text())
        if agent not in shapes:
            raise InferCourseError(f"no shape for {agent!r} in {CHAT_SHAPES}; give --capture DIR (a lab run or a "
                                   f"session recorded with `infercourse agent proxy`); shipped: {sorted(shapes)}")
        return {"source": f"{CHAT_SHAPES.name} ({agent} {shapes[agent]['version']})", **shapes[agent]}
    from infercourse.ops.agent_lab import calls_table, refused_size
    c = calls_table(capture)
    c = c[c["api"] == "openai-chat"]
    if not len(c) or "system" not in c:
        raise InferCourseError(f"{capture}: no chat-completions call with its anatomy in this capture")
    main_key = c.groupby("system")["body_bytes"].sum().idxmax()
    main, side = c[c["system"] == main_key], c[c["system"] != main_key]
    first = main.iloc[0]
    prompt = first["prompt_tokens"] if first["prompt_tokens"] == first["prompt_tokens"] else refused_size(first["error"])
    firsts = main.groupby("task", sort=False).head(1).iloc[1:] if "task" in main else main.iloc[0:0]
    across = None if not len(firsts) else {"first_diff": firsts["first_diff_same_system"].iloc[-1],
                                           "kind": "message" if str(firsts["first_diff_same_system"].iloc[-1])
                                           .startswith("message") else "system or tool"}
    n_tasks = max(1, c["task"].nunique()) if "task" in c else 1
    mt = first.get("max_tokens")
    kinds: dict[str, dict[str, int]] = {}
    from infercourse.ops.agent_lab import anatomy
    for part in next((a["parts"] for a in anatomy(capture) if a["request_id"] == first["request_id"]), []):
        k = kinds.setdefault(part["kind"], {"count": 0, "bytes": 0, "tokens": 0})
        k["count"], k["bytes"], k["tokens"] = k["count"] + 1, k["bytes"] + part["bytes"], k["tokens"] + part["tokens"]
    body = Path(capture) / "bodies" / f"{int(first['request_id']):03d}.json"
    fields = sorted(json.loads(body.read_text())) if body.is_file() else []
    return {"source": str(capture), "first_request": {"prompt_tokens": int(prompt) if prompt == prompt else None,
                                                      "max_tokens": None if mt != mt or mt is None else int(mt),
                                                      "bytes": int(first["body_bytes"]), "fields": fields,
                                                      "parts": kinds},
            "side_calls": {"per_task": len(side) / n_tasks,
                           "prompt_tokens": float(side["prompt_tokens"].median()) if len(side) else None},
            "across_tasks": across}


def shape_entry(capture: str | Path, agent: str) -> dict[str, Any]:
    """`chat_shape` of a lab run as `data/agent_shapes_chat.json` keeps it: numbers, field
    names and part labels only, with the agent's version and the tokenizer that counted."""
    s = chat_shape(agent, capture)
    man = json.loads((Path(capture) / "manifest.json").read_text())
    return {"version": man["agents"][agent], "api": "openai-chat",
            "first_request": {**s["first_request"], "tokenizer": Path(man["model"]["path"]).stem},
            "side_calls": s["side_calls"], "across_tasks": s["across_tasks"]}


def _chat(url: str, system: str, user: str, *, max_tokens: int = 1, timeout: float = 300.0, **extra: Any) -> dict:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": max_tokens, "temperature": 0, "stream": False, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
    doc = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    t, u = doc.get("timings") or {}, doc.get("usage") or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"status": r.status_code, "prompt_tokens": u.get("prompt_tokens"),
            # the server's own count for this request; without timings, prompt less cached
            "evaluated": t.get("prompt_n", (u["prompt_tokens"] - (cached or 0)) if "prompt_tokens" in u else None),
            "prefill_tok_per_s": t.get("prompt_per_second"), "decode_tok_per_s": t.get("predicted_per_second"),
            "error": (doc.get("error") or {}).get("message") if isinstance(doc.get("error"), dict) else None}


def _slots(url: str, action: str, filename: str) -> tuple[int, dict]:
    r = httpx.post(f"{url}/slots/0?action={action}", json={"filename": filename}, timeout=120)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, {}


def probe_chat_route(url: str, *, probe_tokens: int = 512, side_tokens: int = 128,
                     timeout_s: float = 300.0) -> dict[str, Any]:
    """Ask the server what an agent's calls will meet: its window, slots and `-n`, then the
    side-call sequence and (where the server can save slots) save/restore, each call's
    evaluated tokens from the server's own timings (loopback URL; ~10 short calls)."""
    url = url.rstrip("/")
    ev: dict[str, Any] = {}
    props = httpx.get(url + "/props", timeout=10)
    p = props.json() if props.status_code == 200 else {}
    dgs = p.get("default_generation_settings") or {}
    ev.update(n_ctx_slot=dgs.get("n_ctx"), total_slots=p.get("total_slots"), model_path=p.get("model_path"),
              n_predict=(dgs.get("params") or {}).get("n_predict", dgs.get("n_predict")))
    served = httpx.get(url + "/v1/models", timeout=10)
    data = served.json().get("data", []) if served.status_code == 200 else []
    ev["served_models"] = [m.get("id") for m in data]
    from infercourse.ops.agent_lab import served_trained_context   # the server fix extends past it
    ev["arch"], ev["n_ctx_train"], ev["trained_from"] = served_trained_context(p, data)
    if ev["n_ctx_slot"]:   # the probe must fit the window it measures
        probe_tokens, side_tokens = min(probe_tokens, ev["n_ctx_slot"] // 3), min(side_tokens, ev["n_ctx_slot"] // 8)
    tag = uuid.uuid4().hex   # new every probe: the first main call is cold
    main = f"{tag} You are the main coding agent. " + _FILL * max(1, probe_tokens // 18)
    side = f"{tag} You write a short title for the user's request. " + "Keep it under six words. " * max(1, side_tokens // 6)
    seq = [("main", main, "task one"), ("main again", main, "task one"), ("side", side, "task two"),
           ("main", main, "task two"), ("side", side, "task three"), ("main", main, "task three")]
    ev["calls"] = []
    for role, system, user in seq:
        t0 = time.perf_counter()
        r = _chat(url, system, user, timeout=timeout_s)
        ev["calls"].append({"role": role, **r, "wall_s": time.perf_counter() - t0})
    cold = ev["calls"][0]
    ev["prefill_tok_per_s"] = cold["prefill_tok_per_s"] or (
        cold["prompt_tokens"] / cold["wall_s"] if cold["prompt_tokens"] else None)
    ev["decode_tok_per_s"] = _chat(url, main, "task one", max_tokens=16, timeout=timeout_s,
                                   ignore_eos=True)["decode_tok_per_s"]
    ev["prefill_points"] = probe_curve(url, (ev["served_models"] or ["local-model"])[0],
                                       curve_lengths(ev["n_ctx_slot"]), timeout_s)   # the rate falls with n
    ev["save_restore"] = None
    if ev.get("total_slots") == 1:
        name = f"infercourse-doctor-{tag}.bin"
        st, saved = _slots(url, "save", name)
        if st == 200:
            _chat(url, side, "task four", timeout=timeout_s)
            _slots(url, "restore", name)
            after = _chat(url, main, "task four", timeout=timeout_s)
            ev["save_restore"] = {"evaluated": after["evaluated"], "prompt_tokens": after["prompt_tokens"]}
            if saved.get("n_saved"):
                ev["kv_bytes_per_token"] = saved["n_written"] / saved["n_saved"]
        else:
            ev["save_restore"] = {"status": st}
    if not ev.get("kv_bytes_per_token") and ev.get("model_path") and Path(ev["model_path"]).is_file():
        from infercourse.models.modelcard import model_card
        ev["kv_bytes_per_token"] = model_card(ev["model_path"]).kv_bytes_per_token(2)   # F16 K and V
    return ev


def evicts(ev: dict[str, Any]) -> dict[str, Any]:
    """From the probe's calls: the share of the main prompt the server evaluated again after a
    side call, and for an identical call (the control)."""
    calls = ev.get("calls") or []
    mains = [c for c in calls[3:] if c["role"] == "main" and c["prompt_tokens"]]
    again = next((c for c in calls if c["role"] == "main again" and c["prompt_tokens"]), None)
    share = (sum(c["evaluated"] for c in mains) / sum(c["prompt_tokens"] for c in mains)) if mains else None
    return {"after_side": share, "control": again["evaluated"] / again["prompt_tokens"] if again else None,
            "main_tokens": mains[0]["prompt_tokens"] if mains else None,
            "evaluated_per_call": [(c["role"], c["evaluated"]) for c in calls]}


def kv_mib(tokens: float, bytes_per_token: float | None) -> int | None:
    """MiB of KV cache for `tokens` at `bytes_per_token`, rounded up to 64 MiB."""
    if not bytes_per_token or not tokens:
        return None
    return int(math.ceil(tokens * bytes_per_token / 2**20 / 64) * 64)


def _check(layer: str, status: str, summary: str, **evidence: Any) -> LayerCheck:
    return LayerCheck(layer, status, summary, evidence)


def grade_chat_route(ev: dict[str, Any], shape: dict[str, Any], *, timeout_s: float | None = None,
                     min_output: int = 1024) -> list[LayerCheck]:
    """Pure: the probe's evidence and the agent's shape -> one check per row of the module's table."""
    from infercourse.ops.agent_doctor import grade_agent_route
    first, side = shape["first_request"], shape.get("side_calls") or {}
    out = [c for c in grade_agent_route({**ev, "agent": "chat"}, {**first, "max_tokens": None}, timeout_s=timeout_s or 1,
                                        min_output=min_output) if c.layer == "context"]
    n_ctx, asked, n_pred = ev.get("n_ctx_slot"), first.get("max_tokens"), ev.get("n_predict")
    left, rate = max(0, (n_ctx or 0) - int(first["prompt_tokens"])), ev.get("decode_tok_per_s")
    runs = f", about {left / rate:.0f} s at {rate:.1f} tok/s" if rate and left else ""
    if asked is None:
        capped = n_pred is not None and 0 < n_pred < left
        out.append(_check("context", "ok" if capped else "warn", "the agent names no max_tokens: the server's -n "
                          + (f"({n_pred}) caps the answer" if capped else "sets no cap, so an answer can run to the "
                             "window's end" + (f" ({left} tokens{runs})" if left else " (the window has no room left at "
                                               "all: see above)")), n_predict=n_pred))
    elif n_ctx and asked > left:
        out.append(_check("context", "warn", f"the agent asks for max_tokens {asked}, the window leaves {left}: the "
                          f"server clips it at the window (its -n does not cap a request that names max_tokens), and a "
                          f"small model may use it all{runs}", max_tokens=asked, left=left))
    else:
        out.append(_check("context", "ok", f"max_tokens {asked} fits the {left} tokens the window leaves"))
    e = evicts(ev)
    if e["after_side"] is None:
        out.append(_check("KV cache", "warn", "the side-call probe got no usage back: eviction not checked"))
    elif (e["control"] or 0) > 0.5:
        out.append(_check("KV cache", "warn", f"no prefix reuse even for an identical call ({1 - e['control']:.0%} "
                          "reused): the side-call test says nothing", control=e["control"]))
    else:
        sends = side.get("per_task")
        bad = "fail" if sends else "warn"
        who = f"this agent sends {sends:g} per task" if sends else "this agent sent none in the calls measured"
        out.append(_check("KV cache", "ok" if e["after_side"] < 0.5 else bad,
                          f"a call with another system prompt {'keeps' if e['after_side'] < 0.5 else 'evicts'} the main "
                          f"prefix on this server ({ev.get('total_slots')} slot(s)): {e['after_side']:.0%} of the main "
                          f"prompt evaluated again after it (an identical call: {e['control']:.0%}); {who}",
                          after_side=e["after_side"], control=e["control"], per_call=e["evaluated_per_call"]))
    sr = ev.get("save_restore")
    if sr and "evaluated" in sr and sr["prompt_tokens"]:
        held = sr["evaluated"] / sr["prompt_tokens"] < 0.5
        out.append(_check("KV cache", "ok" if held else "warn", f"slot save/restore around the side call "
                          f"{'holds' if held else 'does not hold'} the main prefix: {sr['evaluated']} of "
                          f"{sr['prompt_tokens']} evaluated (it needs a client that calls /slots; the agent does not)"))
    across = shape.get("across_tasks")
    if across is None:
        out.append(_check("KV cache", "warn", "prefix across tasks not checked: give --capture DIR with two tasks"))
    else:
        stable = across["kind"] == "message"
        out.append(_check("KV cache", "ok" if stable else "fail", f"a new task's main call first differs at "
                          f"{across['first_diff']}: " + ("the prefix before the task's words is reused" if stable else
                                                         "a per-task change before the messages busts the cache")))
    forecast, limit = cold_forecast(int(first["prompt_tokens"]), ev), timeout_s or shape.get("timeout_s")
    if forecast and not limit:
        out.append(_check("API", "ok", f"a cold first call needs about {forecast[0]:.0f} s of prefill ({forecast[1]}); "
                          "this agent's timeout does not cover a streamed prefill "
                          f"({shape.get('timeout_note') or 'its spec names none'})", cold_prefill_s=forecast[0]))
    elif forecast:
        cold = forecast[0]
        out.append(_check("API", "ok" if cold < 0.5 * limit else ("warn" if cold < limit else "fail"),
                          f"a cold first call needs about {cold:.0f} s of prefill ({forecast[1]}) against the agent's "
                          f"{limit:.0f} s timeout", cold_prefill_s=cold, timeout_s=limit))
    return out


def _nested(dotted: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        node = out
        *path, last = key.split(".")
        for k in path:
            node = node.setdefault(k, {})
        node[last] = value
    return out


def chat_fixes(ev: dict[str, Any], shape: dict[str, Any], checks: list[LayerCheck],
               spec: dict[str, Any] | None = None, *, timeout_s: float | None = None) -> str:
    """The settings that fix what the checks found, computed from the probe: the server's
    window, the change that holds the main prefix, and the agent's answer cap, timeout and
    window (in its settings file where its spec says where)."""
    from infercourse.ops.agent_doctor import server_fix, window_needed
    first = int(shape["first_request"]["prompt_tokens"])
    lines = [f for f in [server_fix("chat", ev, shape["first_request"])] if f]
    n_ctx = max(ev.get("n_ctx_slot") or 0, window_needed("chat", shape["first_request"]) if lines else 0)
    e = evicts(ev)
    if e["after_side"] is not None and e["after_side"] >= 0.5:
        side_tok = (shape.get("side_calls") or {}).get("prompt_tokens") or 0
        mib = kv_mib(first + side_tok, ev.get("kv_bytes_per_token"))
        lines.append("server: side calls evict the main prefix; any one of: "
                     + (f"--cache-ram {max(mib, 256)} (host RAM for {first + side_tok:,.0f} tokens of prompts at "
                        f"{ev['kv_bytes_per_token'] / 1024:.0f} KiB/token; llama-server's default is 8192)" if mib else
                        "--cache-ram 8192 (llama-server's default; 0 turns it off)")
                     + f"; -np 2 -c {2 * n_ctx} (a slot each, {n_ctx:,} tokens apiece"
                     + (f", {kv_mib(n_ctx, ev.get('kv_bytes_per_token'))} MiB more KV" if ev.get("kv_bytes_per_token")
                        else "") + "); or --slot-save-path DIR with a client that saves the main slot before a side "
                     "call and restores it after (the agent does not)")
    rate, decode = ev.get("prefill_tok_per_s"), ev.get("decode_tok_per_s")
    default = timeout_s or shape.get("timeout_s")
    timeout = (max(default, 3 * first / rate) if rate else default) if default else None
    cap = max(256, (max(0, n_ctx - first) // 256) * 256)
    if decode and timeout:   # an answer must end well inside the agent's timeout
        cap = max(256, min(cap, int(decode * timeout / 2) // 256 * 256))
    want = {"max_tokens": cap, "timeout_ms": int(timeout * 1000) if timeout else None, "context_window": n_ctx or None}
    where = (spec or {}).get("settings")
    if where:
        body = _nested({where[k]: v for k, v in want.items() if k in where and v is not None})
        lines.append(f"agent: in ~/{where['file']}:\n" + json.dumps(body, indent=2))
    else:
        wait = f", wait at least {timeout:.0f} s for a call" if timeout else ""
        lines.append(f"agent: cap its answers at max_tokens {cap}{wait}, and tell it the window is {n_ctx:,} tokens "
                     "(in its own setting names)")
    return "\n".join(lines)


def chat_report(ev: dict[str, Any], shape: dict[str, Any], checks: list[LayerCheck],
                spec: dict[str, Any] | None = None, *, timeout_s: float | None = None) -> str:
    """The checks, one line each, the evaluated tokens per probe call, then the settings."""
    lines = [f"  [{c.status:4}] {c.layer:8} {c.summary}" for c in checks]
    per = ", ".join(f"{role} {n}" for role, n in evicts(ev)["evaluated_per_call"])
    return "\n".join(lines + [f"evaluated tokens per probe call: {per}", "settings that fix what was found:",
                              chat_fixes(ev, shape, checks, spec, timeout_s=timeout_s)])


def doctor_on_fresh_server(ctx: int, spec: str | dict = "qwen-code", capture: str | Path | None = None, *,
                           cache_ram_mib: int | None = 0, slots: int = 1, threads: int | None = 1,
                           model: str | None = None, extend: bool = True, first_from: str | Path | None = None) -> str:
    """`doctor agent --agent chat` against a fresh llama-server of `ctx` tokens a slot (the
    course's tools template; `cache_ram_mib` 0: no host prompt cache, the server a side call
    evicts), with `capture`'s calls (a lab run) or the shipped shape; returns what it printed.
    `first_from`: a lab run whose first request sizes the checks instead (the agent at the size
    the learner runs it, where `capture` is a smaller run kept for its side calls)."""
    from infercourse.measure.workloads import DATA_DIR
    from infercourse.ops import chat_agent
    from infercourse.ops.agent_lab import extend_flags
    from infercourse.servers import LlamaServer
    s = chat_agent.load_spec(spec)
    shape = {**chat_shape(s["name"], capture), "timeout_s": s.get("timeout_s"), "timeout_note": s.get("timeout_note")}
    if first_from is not None:
        shape["first_request"] = chat_shape(s["name"], first_from)["first_request"]
    extra = ["--chat-template-file", str(DATA_DIR / "chatml_tools.jinja"), *(extend_flags(ctx, model) if extend else [])]
    with LlamaServer(model, n_parallel=slots, ctx_size=ctx * slots, threads=threads, jinja=True,
                     cache_ram_mib=cache_ram_mib, extra_args=extra) as srv:
        ev = probe_chat_route(srv.url)
    checks = grade_chat_route(ev, shape)
    return (f"{s['name']} against a llama-server of {ctx:,} tokens a slot, {slots} slot(s), --cache-ram "
            f"{'default' if cache_ram_mib is None else cache_ram_mib}:\n" + chat_report(ev, shape, checks, s))

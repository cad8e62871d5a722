"""Why is my coding agent slow and flaky on a local model? (notebook 19)

A coding agent (Claude Code and its kind) talks to the model through the Anthropic
Messages API: every call re-sends a long system prompt, ~15 tool schemas and the whole
session so far, and expects tool calls back as `tool_use` blocks. On a local server that
shape meets four failure points, each measured here on llama-server through `/v1/messages`:

- **the prefix cache**: later calls should pay only for the new turns; a header block that
  changes on every request (the cache buster) makes each call re-prefill everything;
- **the window**: the session grows until it no longer fits `-c` (per slot: `-c / -np`);
- **the client's patience**: a timeout shorter than a cold prefill reads as "API error";
- **tools**: the embedded SmolLM2's own chat template has no place for tools, so the server
  drops them; with a template that renders them (`data/chatml_tools.jinja`, ours) the server
  parses a call the model starts, and fails the stream when the output breaks the format.

Every number comes from the engines and metrics every other notebook uses
(`AnthropicHTTPEngine`, `core.trace.record`), and cached tokens are checked against an
independent count: llama-server's own `/metrics` counter of prompt tokens it evaluated. The
sentences that say what a run showed are computed from these tables in `coding_agent_claims`.
"""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import httpx
import pandas as pd

from infercourse.core.errors import InferCourseError
from infercourse.core.metrics import ttft_s
from infercourse.core.trace import record
from infercourse.measure.agent_workload import coding_agent_session
from infercourse.measure.workloads import DATA_DIR
from infercourse.ops.probes import parse_metrics

__all__ = ["TOOLS_TEMPLATE", "serve", "prefilled_call", "engines", "request_parts", "run_session", "cache_table",
           "slot_view", "first_overflow", "ask_more_than_fits", "cold_timeout", "tool_route", "api_agreement", "routes",
           "claude_code_settings", "plot_calls", "prompt_tokens_at", "cold_ttft_at", "guesses"]

# llama-server's counter of prompt tokens it actually evaluated (cache hits excluded)
EVALUATED = "llamacpp:prompt_tokens_total"
# ChatML with a place for tools (written for this course): SmolLM2's own template has none
TOOLS_TEMPLATE = DATA_DIR / "chatml_tools.jinja"
_READ = {"name": "read_file", "description": "Read a file.",
         "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


def serve(ctx: int = 8192, *, threads: int | None = None, jinja: bool | None = True,
          tools_template: bool = True, model=None):
    """A started llama-server with one slot (so every call of the session meets its own
    cache), `--metrics`, the Jinja template engine (`jinja=False`: `--no-jinja`) and, with
    `tools_template`, `TOOLS_TEMPLATE` instead of the model's own chat template."""
    from infercourse.servers import LlamaServer
    extra = ["--chat-template-file", str(TOOLS_TEMPLATE)] if tools_template and jinja is not False else []
    return LlamaServer(model, n_parallel=1, ctx_size=ctx, threads=threads, jinja=jinja, extra_args=extra).start()


def prefilled_call(url: str, prefill: str, max_tokens: int = 12) -> dict[str, Any]:
    """Start the assistant's turn with `prefill` (the opening of a call in the template's
    format) and let the model finish it: does the server's parser turn it into `tool_use`?"""
    from infercourse.core.types import Request
    from infercourse.engines.anthropic_http import AnthropicHTTPEngine
    eng = AnthropicHTTPEngine(url, timeout=120.0)
    req = Request(messages=[{"role": "user", "content": "Read a.py"}, {"role": "assistant", "content": prefill}],
                  tools=[_READ], max_tokens=max_tokens)
    try:
        final = list(eng.stream(req))[-1]
        calls = final.timings["tool_calls"]
        return {"prefill": prefill, "tool_use": calls[0]["input"] if calls else None,
                "stop_reason": final.timings["stop_reason"], "error": None}
    except InferCourseError as e:
        return {"prefill": prefill, "tool_use": None, "stop_reason": None, "error": f"{e.layer}: {e.message[:120]}"}
    finally:
        eng.close()


def engines(url: str, timeout: float = 600.0) -> dict[str, Any]:
    """The same server through both APIs: {"anthropic": ..., "openai": ...}."""
    from infercourse.engines.anthropic_http import AnthropicHTTPEngine
    from infercourse.engines.openai_http import OpenAIHTTPEngine
    return {"anthropic": AnthropicHTTPEngine(url, timeout=timeout), "openai": OpenAIHTTPEngine(url, timeout=timeout)}


def request_parts(engine, request) -> pd.DataFrame:
    """What one call sends, part by part: system blocks, tools, turns, with sizes."""
    body, rows = engine.body(request), []
    system = body.get("system") or []
    for i, b in enumerate(system if isinstance(system, list) else [{"text": system}]):
        rows.append({"part": f"system[{i}]", "chars": len(b.get("text", "")), "cache_control": "cache_control" in b,
                     "starts": b.get("text", "")[:48]})
    tools = body.get("tools") or []
    rows.append({"part": f"tools ({len(tools)})", "chars": len(json.dumps(tools)),
                 "cache_control": any("cache_control" in t for t in tools), "starts": ", ".join(
                     t.get("name") or t.get("function", {}).get("name") for t in tools[:5]) + ", ..."})
    for i, m in enumerate(body["messages"]):
        kinds = [c.get("type") for c in m["content"]] if isinstance(m["content"], list) else ["text"]
        rows.append({"part": f"messages[{i}] {m['role']}", "chars": len(json.dumps(m["content"])),
                     "cache_control": False, "starts": "+".join(kinds)})
    return pd.DataFrame(rows)


def _evaluated(url: str) -> float | None:
    try:
        return parse_metrics(httpx.get(url + "/metrics", timeout=5.0).text).get(EVALUATED)
    except httpx.HTTPError:
        return None


def run_session(engine, workload, label: str = "") -> pd.DataFrame:
    """Send the session's calls one by one; one row per call: prompt, cached and new tokens
    (server usage), TTFT, and the tokens the server says it evaluated (`/metrics` delta),
    the independent count that cached tokens are checked against."""
    rows = []
    for i, req in enumerate(workload.requests):
        before = _evaluated(engine.root)
        tr = record(engine, req, request_id=i)
        after = _evaluated(engine.root)
        calls = tr.engine_timings.get("tool_calls") or []
        rows.append({"label": label, "call": i, "status": tr.status, "prompt_tokens": tr.prompt_tokens,
                     "cached_tokens": tr.cached_tokens,
                     "new_tokens": None if tr.prompt_tokens is None else tr.prompt_tokens - (tr.cached_tokens or 0),
                     "evaluated_metrics": None if before is None or after is None else after - before,
                     "ttft_s": ttft_s(tr), "output_tokens": tr.completion_tokens,
                     "tool_call": calls[0]["name"] if calls else tr.engine_timings.get("tool_call_as_text"),
                     "error": tr.error})
    return pd.DataFrame(rows)


def cache_table(runs: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per variant: cached share of the prompt and TTFT p50 over calls after the first,
    and the TTFT ratio to the first variant (the baseline)."""
    rows = []
    for name, df in runs.items():
        later = df[(df["call"] > 0) & (df["status"] == "ok")]
        rows.append({"variant": name, "calls": len(later),
                     "cached_share": (later["cached_tokens"].sum() / later["prompt_tokens"].sum()) if len(later) else None,
                     "new_tokens_mean": later["new_tokens"].mean(), "ttft_p50_s": later["ttft_s"].median()})
    out = pd.DataFrame(rows).set_index("variant")
    out["ttft_vs_first"] = out["ttft_p50_s"] / out["ttft_p50_s"].iloc[0]
    return out


def slot_view(url: str) -> dict[str, Any]:
    """What llama-server's `/slots` says about its slot: context and the tokens it holds."""
    slots = httpx.get(url + "/slots", timeout=5.0).json()
    s = slots[0] if isinstance(slots, list) and slots else {}
    keep = ("id", "n_ctx", "n_past", "n_prompt_tokens", "n_decoded", "is_processing")
    return {k: s.get(k) for k in keep if k in s}


def first_overflow(engine, workload) -> dict[str, Any]:
    """The first call of the session that no longer fits the server's window, sent as the
    agent would send it: which call, its prompt tokens (`count_tokens`) against the slot's
    real context (`/slots` n_ctx: llama-server rounds `-c` up), and the error the agent
    receives with the layer it names. The calls before it fit by count and are not sent."""
    n_ctx = slot_view(engine.root).get("n_ctx")
    need = [engine.count_tokens(r) for r in workload.requests]
    # >=: llama-server refuses a prompt that fills its window (no room left for one token)
    k = next((i for i, n in enumerate(need) if n_ctx is not None and n >= n_ctx), None)
    out = {"slot n_ctx": n_ctx, "call": k, "prompt_tokens": None if k is None else need[k],
           "last_fitting_call": (len(need) if k is None else k) - 1}
    if k is None:
        return {**out, "layer": None, "error": "every call fit"}
    try:
        list(engine.stream(workload.requests[k]))
        return {**out, "layer": None, "error": "the server answered anyway"}
    except InferCourseError as e:
        return {**out, "layer": e.layer, "error": e.message[:160]}


def _call(call: int, **size: Any):
    """Request `call` of the session at `size` (a session built with just enough calls)."""
    wl = coding_agent_session(**{**size, "n_calls": call + 1})
    if call >= len(wl.requests):
        raise ValueError(f"the recorded session has {len(wl.requests)} calls: call {call} does not exist")
    return wl.requests[call]


def prompt_tokens_at(engine, call: int, **size: Any) -> float:
    """The prompt tokens of call `call` of the session, counted by the server
    (`POST /v1/messages/count_tokens`): nothing is generated.

    Args:
        engine: the Anthropic engine of the server (`engines(url)["anthropic"]`).
        call: the call's index (0: the first call, the task alone).
        size: `coding_agent_session` sizes (profile=, n_tools=, static_chars=...); n_calls is set here.
    """
    return float(engine.count_tokens(_call(call, **size)))


def cold_ttft_at(engine, call: int, repeats: int = 2, **size: Any) -> float:
    """Median TTFT (s) of call `call` of the session sent cold: each repeat carries a header
    value no earlier request had (a new salt, header first), so the slot reuses only what
    precedes the header and prefills the rest, as every call of the buster run does.

    Args:
        engine: the Anthropic engine of the server.
        call: the call's index.
        repeats: cold sends whose median is returned.
        size: `coding_agent_session` sizes; n_calls, bust and salt are set here.
    """
    import secrets
    times = []
    for _ in range(repeats):
        tr = record(engine, _call(call, **{**size, "bust": True, "salt": secrets.token_hex(4)}))
        if tr.status != "ok":
            raise InferCourseError(f"call {call} sent cold failed: {tr.error}")
        times.append(ttft_s(tr))
    return float(pd.Series(times).median())


def ask_more_than_fits(engine, request, n_ctx: int) -> dict[str, Any]:
    """One call whose max_tokens is the whole window, more than what is left after its prompt."""
    n = engine.count_tokens(request)
    tr = record(engine, replace(request, max_tokens=n_ctx))
    return {"prompt_tokens": n, "max_tokens": n_ctx, "left_in_window": n_ctx - n, "status": tr.status,
            "finish_reason": tr.finish_reason, "output_tokens": tr.completion_tokens, "error": tr.error}


def cold_timeout(url: str, request, timeout_s: float) -> dict[str, Any]:
    """One cold call (cache busted) with a client read timeout of `timeout_s`."""
    from infercourse.engines.anthropic_http import AnthropicHTTPEngine
    eng = AnthropicHTTPEngine(url, timeout=timeout_s)
    try:
        tr = record(eng, request)
    finally:
        eng.close()
    return {"timeout_s": timeout_s, "status": tr.status, "error": tr.error}


def tool_route(url: str) -> dict[str, Any]:
    """The doctor's Anthropic checks on one server: event types, count_tokens, a tool call."""
    from infercourse.ops.anthropic_probe import grade_messages, probe_messages
    api, model = grade_messages(probe_messages(url, timeout_s=300.0, max_tokens=16))
    return {"API": f"{api.status}: {api.summary}", "model (tools)": f"{model.status}: {model.summary}"
            if model else "not reached"}


def api_agreement(url: str, rounds: int = 2, **size: Any) -> pd.DataFrame:
    """The same session through /v1/messages and /v1/chat/completions, interleaved call by
    call (A, B, B, A...) on one server so drift hits both alike; one row per call and API.

    Args:
        size: `coding_agent_session` sizes (n_calls=, max_tokens=, n_tools=...).
    """
    engs = engines(url)
    work = {api: coding_agent_session(api=api, **size) for api in engs}
    rows = []
    for r in range(rounds):
        for i in range(len(work["openai"].requests)):
            for api in (("anthropic", "openai") if (r + i) % 2 == 0 else ("openai", "anthropic")):
                tr = record(engs[api], work[api].requests[i], request_id=i)
                rows.append({"round": r, "call": i, "api": api, "prompt_tokens": tr.prompt_tokens,
                             "cached_tokens": tr.cached_tokens, "ttft_s": ttft_s(tr),
                             "output_tokens": tr.completion_tokens, "status": tr.status})
    return pd.DataFrame(rows)


def routes(*, ollama_url: str | None = None, vllm_url: str | None = None,
           mlx_url: str | None = None) -> pd.DataFrame:
    """The routes of the reference guide for this workload, and whether each runs here."""
    import platform
    rows = [{"route": "C: llama-server /v1/messages", "runs here": True, "why": "measured above"}]
    for name, url, why in (
            ("A: Ollama /v1/messages (v0.14+)", ollama_url, "no Ollama server given (OLLAMA_URL)"),
            ("vLLM /v1/messages", vllm_url, "no vLLM server given (VLLM_URL): vLLM needs a GPU, or its "
                                            "CPU build, neither installed here"),
            ("B: mlx_lm.server", mlx_url, "MLX runs on Apple Silicon only; this is "
                                          f"{platform.system()} {platform.machine()}")):
        if url is None:
            rows.append({"route": name, "runs here": False, "why": why})
        else:
            rows.append({"route": name, "runs here": True, "why": tool_route(url)["API"]})
    return pd.DataFrame(rows)


def claude_code_settings(url: str, window: int, model: str = "local-model") -> str:
    """The settings that point Claude Code at `url`, to paste into ~/.claude/settings.json,
    and the window arithmetic they imply. Printed, never run. The `env` block is `doctor agent`'s
    (`ops.agents.claude_env`: Claude Code's env-vars reference, code.claude.com/docs/en/env-vars),
    with the billing header off: CLAUDE_CODE_ATTRIBUTION_HEADER=0 drops the per-request
    `x-anthropic-billing-header` block (ollama/ollama PR #14918 sets it in `ollama launch
    claude`; musistudio/claude-code-router PR #1220). llama.cpp PR #21793 (in this build)
    normalises only the header's `cch=` field, which Claude Code 2.1.328 no longer sends; its
    per-task `cc_version` suffix still busts the cache (measured with the real client in
    notebook 20), so the client-side switch is the fix. The answer cap is sized with the window
    and the pinned agent's first request as `data/agent_shapes.json` measured it
    (`agent_budget.claude_budget`); `doctor agent` sizes it from the learner's own.

    Args:
        url: the server's root.
        window: the server's window per slot (`/slots` n_ctx): CLAUDE_CODE_MAX_CONTEXT_TOKENS,
            without which the pinned Claude Code assumes `agents.CLAUDE_ASSUMED_WINDOW`
            (1,000,000) for a model id it does not know and never compacts in time.
        model: the model name the agent sends.
    """
    from infercourse.ops.agent_budget import budget_line, claude_budget
    from infercourse.ops.agent_doctor import agent_shape
    from infercourse.ops.agents import claude_env, claude_settings
    shape = agent_shape("claude-code")
    first = int(shape["prompt_tokens"])
    b = claude_budget(first, int(window))
    lines = [claude_settings(claude_env(url, model, window=int(window), first=first)), "",
             budget_line(first, int(window), f"Claude Code (first request {first:,} tokens, {shape['source']}) "
                                             "on this window")]
    if not b["fits"]:
        lines.append(f"the smallest window with a usable answer cap and room to grow: {claude_budget(first)['window']:,}"
                     " tokens a slot")
    return "\n".join(lines) + ("\n\n# then check the route, and the window against the agent's first request, before "
                               f"starting the agent:\ninfercourse doctor layers {url} --api anthropic\n"
                               f"infercourse doctor agent {url} --agent claude-code")


def guesses(table: pd.DataFrame, ceiling: float) -> dict[str, tuple[float, float, str, str]]:
    """The Predict step's two guesses by their variables' names, each with what
    `exercises.score_guess` scores it against: (the back-of-envelope value, the measurement,
    the unit, what the first is called).

    Args:
        table: `cache_table` (the fixed header first, the buster second).
        ceiling: the TTFT ratio a busted call costs if every prompt token cost the same (the
            mean later prompt over the tokens a warm call adds); a warm call then reuses all
            but 1/ceiling of its prompt.
    """
    busted_over_fixed = float(table["ttft_p50_s"].iloc[1] / table["ttft_p50_s"].iloc[0])
    return {"MY_GUESS_CACHED_SHARE": (1 - 1 / ceiling, float(table["cached_share"].iloc[0]), "of the prompt",
                                      "prediction"),
            "MY_GUESS_TTFT_RATIO": (ceiling, busted_over_fixed, "× the fixed header's TTFT", "ceiling")}


def plot_calls(runs: dict[str, pd.DataFrame]):
    """Prompt, cached tokens and TTFT per call, one line per variant; returns the Axes pair."""
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    for name, df in runs.items():
        a.plot(df["call"], df["prompt_tokens"], "o-", label=f"{name}: prompt")
        a.plot(df["call"], df["cached_tokens"], "x--", label=f"{name}: cached")
        b.plot(df["call"], df["ttft_s"], "o-", label=name)
    a.set(xlabel="call", ylabel="tokens", title="prompt vs cached tokens")
    b.set(xlabel="call", ylabel="TTFT (s)", title="time to first token")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    return a, b

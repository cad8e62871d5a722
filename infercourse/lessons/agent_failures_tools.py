"""Many tools (notebook 19, "Four failures, live"; the other failures in `agent_failures` and
`agent_failures_numerics`, the sentences in `agent_failures_claims`).

Every tool schema an agent connects is prompt: ~80-110 tokens each here, sent on every call.
`tool_counts` offers 1 to 100 tools (`measure.tool_calls.synthetic_tools`: the course's 15, then
MCP-shaped ones) with the same requests, each naming what it needs, and measures per count:

- the prompt tokens, and a cold TTFT (nothing reused: every schema prefilled);
- three ways of asking. `auto`, as an agent sends it: does the model answer with a call at
  all? `free`: the call's opening (`<tool_call>`) prefilled and the rest unconstrained: does
  it parse, name a tool that was offered, with arguments valid against its schema
  (`measure.tool_calls.call_validity`)? `required`: the same opening, and llama-server's
  grammar for `tool_choice: "required"`, which makes every call valid by construction and
  leaves one question: is it the *right* tool? (This build's "required" grammar lets the model
  write free text before it opens a call; a 135M model writing code never gets there within
  a few dozen tokens, hence the prefilled opening.)
- a count whose prompt does not fit the window is sent once, as an agent would, and the
  server's refusal recorded.

The second family (Gemma 3 270M, a *base* model: never taught a chat or a call format; its
GGUF has no chat template, so the course's tools template renders for it too) runs where it is
installed; `family_models` says why it is absent otherwise.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import httpx
import pandas as pd

from infercourse.core.metrics import ttft_s
from infercourse.core.trace import record
from infercourse.core.types import Request
from infercourse.measure import noise
from infercourse.measure.tool_calls import CALL_OPEN, call_validity, synthetic_tools, tool_name
from infercourse.measure.workloads import DATA_DIR
from infercourse.servers import llama_api as api

__all__ = ["TOOLS_TEMPLATE", "TOOL_REQUESTS", "serve", "offered", "prompt_tokens", "tool_counts", "tools_table",
           "ttft_floor", "family_models", "tools_row"]

TOOLS_TEMPLATE = DATA_DIR / "chatml_tools.jinja"
# request -> (the tool it needs, its arguments): each names its file or pattern, so the right call is clear
TOOL_REQUESTS = {"Read the file textstats/cli.py.": ("read_file", {"path": "textstats/cli.py"}),
                 "List the files in the tests folder.": ("list_files", {"path": "tests"}),
                 "Search the code for top_words.": ("grep", {"pattern": "top_words"}),
                 "Run the test suite.": ("run_tests", {})}
_SYSTEM = "You are a coding agent working in the textstats repository. Answer with one tool call."


def serve(*, ctx: int = 8192, threads: int | None = None, model=None):
    """llama-server with the tools template, one slot, no host prompt cache, `--jinja`."""
    from infercourse.servers import LlamaServer
    return LlamaServer(model, n_parallel=1, ctx_size=ctx, threads=threads, cache_ram_mib=0, jinja=True,
                       extra_args=["--chat-template-file", str(TOOLS_TEMPLATE)]).start()


def offered(n: int, target: str) -> list[dict[str, Any]]:
    """The `n` tools offered with a request that needs `target`: `synthetic_tools(n)` when it
    holds the target (the same list for every request, so they share a cached prefix), else
    the target first and the first n − 1 others."""
    tools = synthetic_tools(n)
    if target in {tool_name(t) for t in tools}:
        return tools
    return [next(t for t in synthetic_tools(15) if tool_name(t) == target),
            *[t for t in synthetic_tools(n + 1) if tool_name(t) != target][:n - 1]]


def _messages(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": text}]


def prompt_tokens(url: str, n: int, request: int = 0) -> int:
    """The prompt tokens of request `request` of `TOOL_REQUESTS` with `n` tools offered, as
    the server renders and counts them (nothing is generated)."""
    text, (target, _) = list(TOOL_REQUESTS.items())[request]
    return len(api.tokenize(url, api.apply_template(url, _messages(text), offered(n, target))))


def _ask(url: str, messages: list, tools: list, mode: str, max_tokens: int) -> dict[str, Any]:
    """One request in one way of asking (module docstring): what came back, and how it ended."""
    if mode == "free":   # the raw text after the call's opening, parsed here
        out = api.completion(url, api.apply_template(url, messages, tools) + CALL_OPEN, n_predict=max_tokens,
                             temperature=0, cache_prompt=True, stop=["</tool_call>"])
        return {"output": CALL_OPEN + out["content"], "error": None,
                "finish": "length" if out.get("stop_type") == "limit" else "stop"}
    body = {"messages": messages, "tools": tools, "max_tokens": max_tokens, "temperature": 0, "cache_prompt": True,
            "tool_choice": mode}
    if mode == "required":
        body["messages"] = [*messages, {"role": "assistant", "content": CALL_OPEN}]
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600.0)
    if r.status_code != 200:     # the server's parser refused what the model wrote
        return {"output": None, "error": f"HTTP {r.status_code}: {r.text[:120]}", "finish": None}
    choice = r.json()["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    return {"output": calls[0]["function"] if calls else choice["message"].get("content") or "", "error": None,
            "finish": choice.get("finish_reason")}


def _validity(got: dict[str, Any], mode: str, tools: list, cap: int) -> dict[str, Any]:
    out = got["output"]
    if got["error"]:          # the server refused the model's text
        return {**call_validity(None, tools), "why": got["error"]}
    if mode == "auto" and isinstance(out, str) and CALL_OPEN.strip() not in out:
        return {**call_validity(None, tools), "why": "answered in text, no call"}
    v = call_validity(out, tools)
    if not v["args_valid"] and got["finish"] == "length":   # the cap, not the model, ended it
        v["why"] = f"cut at {cap} tokens: {v['why']}"
    return v


def tool_counts(url: str, counts: Sequence[int] = (1, 3, 10, 30, 100), *, requests: int = 3, window: int = 8192,
                modes: Sequence[str] = ("auto", "free", "required"), max_tokens: int = 48, auto_tokens: int = 12,
                label: str = "") -> pd.DataFrame:
    """Every count of tools offered with the same requests: one row per (count, request, mode)
    with the prompt tokens, the cold TTFT (the first request of each count, `cache_prompt`
    off, streamed), the call's validity (`call_validity`: parses, offered, args_valid, why),
    whether it named the tool the request needs, and the raw output. A count whose prompt does
    not fit `window` is sent once (auto) and its refusal recorded; larger counts are skipped.

    Args:
        url: a server started with `serve()`.
        counts: how many tools to offer, ascending.
        requests: how many of `TOOL_REQUESTS` to send at each count.
        window: the server's window per slot (-c with -np 1).
        modes: "auto", "free", "required" (module docstring).
        max_tokens: cap on a `free` or `required` answer (a call here takes 20-45 tokens: the
            grammar lets it indent its arguments).
        auto_tokens: cap on an `auto` answer: enough to see whether it starts with a call.
        label: the model's name, for the rows.
    """
    from infercourse.engines.openai_http import OpenAIHTTPEngine
    eng, rows = OpenAIHTTPEngine(url, timeout=600.0, extra_body={"tool_choice": "auto"}), []
    caps = {"auto": auto_tokens, "free": max_tokens, "required": max_tokens}
    for n in counts:
        for j, (text, (target, _)) in enumerate(list(TOOL_REQUESTS.items())[:requests]):
            tools, msgs = offered(n, target), _messages(text)
            base = {"model": label, "tools": n, "request": j, "target": target,
                    "prompt_tokens": len(api.tokenize(url, api.apply_template(url, msgs, tools)))}
            if base["prompt_tokens"] + max_tokens > window:   # sent once as an agent would: what comes back?
                r = httpx.post(url + "/v1/chat/completions", json={"messages": msgs, "tools": tools, "max_tokens": 1},
                               timeout=120.0)
                said = r.json().get("error", {}).get("message", "") if r.status_code != 200 else "answered"
                rows.append({**base, "mode": "does not fit", "fits": False, "error": f"HTTP {r.status_code}: {said}"})
                eng.close()
                return pd.DataFrame(rows)
            ttft = None
            if j == 0:   # cold: nothing reused, so the prefill of every schema is in it
                tr = record(eng, Request(messages=msgs, tools=tools, max_tokens=1, cache_prompt=False))
                ttft = ttft_s(tr) if tr.status == "ok" else None
            for mode in modes:
                got = _ask(url, msgs, tools, mode, caps[mode])
                v = _validity(got, mode, tools, caps[mode])
                rows.append({**base, "mode": mode, "fits": True, "ttft_s": ttft, **v, "error": got["error"],
                             "right_tool": v["offered"] and v["name"] == target,
                             "output": json.dumps(got["output"]) if isinstance(got["output"], dict) else got["output"]})
    eng.close()
    return pd.DataFrame(rows)


def tools_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, tools offered): prompt tokens, whether it fit (else the server's
    refusal), the cold TTFT, and per way of asking the share of requests that called a tool
    (`auto`), wrote a valid call (`free`, `required`) and named the tool it needs (`required`)."""
    out = []
    for (model, n), g in rows.groupby(["model", "tools"], sort=False):
        by = dict(list(g.groupby("mode")))
        share = lambda m, col: float(by[m][col].astype(bool).mean()) if m in by else None   # noqa: E731
        fits = bool(g["fits"].iloc[0])
        out.append({"model": model, "tools": n, "prompt_tokens": int(g["prompt_tokens"].iloc[0]), "fits": fits,
                    "ttft_s": g["ttft_s"].dropna().iloc[0] if fits and g["ttft_s"].notna().any() else None,
                    "auto_called": share("auto", "parses"), "free_valid": share("free", "args_valid"),
                    "required_valid": share("required", "args_valid"), "required_right": share("required", "right_tool"),
                    "refused": None if fits else g["error"].iloc[0]})
    return pd.DataFrame(out).set_index(["model", "tools"])


def ttft_floor(url: str, repeats: int = 3) -> noise.NoiseFloor:
    """The A/A noise floor of a cold TTFT: the smallest request (one tool) timed against
    itself, interleaved; the band a TTFT ratio must leave to mean a difference."""
    from infercourse.engines.openai_http import OpenAIHTTPEngine
    eng = OpenAIHTTPEngine(url, timeout=120.0, extra_body={"tool_choice": "auto"})
    text, (target, _) = next(iter(TOOL_REQUESTS.items()))
    req = Request(messages=_messages(text), tools=offered(1, target), max_tokens=1, cache_prompt=False)
    one: Callable[[], float] = lambda: ttft_s(record(eng, req))   # noqa: E731
    v = noise.run_interleaved({"A": one, "A/A": one}, repeats, warmup=0)   # the server is warm: counts ran first
    eng.close()
    return noise.noise_floor(v["A"], v["A/A"])


def family_models() -> dict[str, tuple[Any, str | None]]:
    """{name: (GGUF path, None) or (None, why it is absent)}: the embedded SmolLM2 (path None:
    the embedded GGUF) and the second family, Gemma 3 270M (base), where installed."""
    from infercourse.models import gemma3
    ok, why = gemma3.available()
    return {"SmolLM2-135M-Instruct": (None, None), "Gemma 3 270M (base)": (gemma3.gemma3_gguf(), None) if ok
            else (None, why)}


def tools_row(server=None, *, threads: int | None = 1, counts: Sequence[int] = (1, 10, 100), requests: int = 2,
              ctx: int = 8192):
    """Notebook 18's "tool calls fail with many tools connected" row on the embedded model
    (its own server of `ctx` tokens), as (layer or None, evidence, values): "context" when the
    largest count does not fit the window (the refusal is the failure the agent sees), else
    "model" when the share of right tools fell from the fewest tools to the most, else None."""
    with serve(threads=threads, ctx=ctx) as srv:
        t = tools_table(tool_counts(srv.url, counts, requests=requests, window=ctx, modes=("required",),
                                    label="SmolLM2"))
    t = t.droplevel("model")
    fit, over = t[t["fits"]], t[~t["fits"]]
    right = f"right tool {fit['required_right'].iloc[0]:.0%} → {fit['required_right'].iloc[-1]:.0%} from " \
            f"{fit.index[0]} to {fit.index[-1]} tools (required, valid by construction)"
    if len(over):
        n = over.index[0]
        return "context", f"{n} tools = {over.loc[n, 'prompt_tokens']:,} prompt tokens, past the window: " \
                          f"{over.loc[n, 'refused']}; {right}", {"table": t.reset_index().to_dict("records")}
    fell = fit["required_right"].iloc[-1] < fit["required_right"].iloc[0]
    return ("model" if fell else None), right, {"table": t.reset_index().to_dict("records")}

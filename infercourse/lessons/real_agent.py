"""Your real agent on your server (notebook 20): Claude Code and Codex CLI, captured.

Notebook 19 taught the coding-agent route with the course's stand-in of an agent. Here the
real clients run (pinned versions, installed by `make agents`), against the course's own
llama-server, inside a network namespace that holds nothing but loopback (`ops.netns`), with
every call captured by a recording proxy (`ops.agent_capture`). What they show, and the
stand-in does not:

- **the real first request**: its parts (system blocks, tool schemas, a `role: "system"`
  message), their tokens, and how close the stand-in's shape is;
- **the overflow**: the default server's window is smaller than the first request;
- **cold against warm**: the same task again reuses the whole prefix;
- **the per-task header**: the billing header's version suffix depends on the task, so a
  second task re-prefills everything unless `CLAUDE_CODE_ATTRIBUTION_HEADER=0`;
- **max_tokens against the window**: the agent asks for 32,000; the server clips the answer
  at the window, and the agent's attempt to continue it overflows;
- **compaction**: the agent assumes a 1,000,000-token window for a model it does not know,
  so a session grows until the server refuses it, unless it is told the real window;
- **retry amplification**: a client timeout shorter than a cold prefill re-sends the whole
  request, and the server may pay for the prefill again each time.

Every function here builds lab tasks (`ops.agent_lab.Task`) or reads a lab run's folder; the
sentences that state what a run showed are computed from that run (`*_sentence`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from infercourse.ops import agents, netns
from infercourse.ops.agent_capture import GENERATING_APIS
from infercourse.ops.agent_lab import EXTEND_CONTEXT, LabSpec, Task, calls_table, run_lab, tasks_table

__all__ = ["SIZES", "readiness", "skip_reason", "claude_task", "codex_task", "lab", "first_call_parts",
           "versus_stand_in", "evaluated_by_task", "cold_warm_sentence", "header_sentence", "clip_view",
           "compaction_view", "amplification", "amplification_sentence", "extension_cost", "extension_sentence", "growing_session",
           "compaction_sentence", "doctor_on_fresh_server", "calls_table", "tasks_table", "EXTEND_CONTEXT"]

SHORT_SYSTEM = "You are a coding assistant. Answer in one short sentence."
# The two sizes: "full" sends the agents' own requests; "ci" shrinks them with the agents' own
# flags (Claude Code: --system-prompt and --tools; Codex: model_instructions_file), keeping their
# structure (the billing header block, the role: system message, the tools that remain).
SIZES = {"full": {"claude-code": {}, "codex": {}},
         "ci": {"claude-code": {"system_prompt": SHORT_SYSTEM, "tools": "Read"},
                "codex": {"codex": {"instructions": SHORT_SYSTEM}}}}
SHORT_ANSWER = {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64"}   # where the answer's length is not the lesson


def readiness() -> pd.DataFrame:
    """What the real-agent lab needs, and whether this machine has it."""
    rows = [{"needs": "a loopback-only network namespace", "ready": netns.available(),
             "why not": netns.why_not()}]
    for a in agents.AGENTS:
        why = agents.missing_reason(a)
        rows.append({"needs": f"{a} {agents.PINS.get(a, '')}", "ready": why is None, "why not": why})
    return pd.DataFrame(rows)


def skip_reason(wanted: list[str]) -> str | None:
    """None when every agent in `wanted` can run here (sealed), else the first reason why not."""
    import sys
    if sys.platform.startswith("linux") and not netns.available():
        return f"no loopback-only network namespace here ({netns.why_not()}): a real agent is not run"
    for a in wanted:
        why = agents.missing_reason(a)
        if why:
            return why
    return None


def claude_task(label: str, prompt: str, size: str, *, env: dict[str, str] | None = None,
                timeout_s: float = 900, **kw: Any) -> Task:
    """A Claude Code task at `size` ("ci": its own flags shrink the request; "full": defaults)."""
    return Task(label, "claude-code", prompt, env=dict(env or {}), timeout_s=timeout_s,
                **{**SIZES[size]["claude-code"], **kw})


def codex_task(label: str, prompt: str, size: str, *, timeout_s: float = 900, **codex: Any) -> Task:
    """A Codex CLI task at `size`; `codex` adds config values (timeouts, retries, window)."""
    cfg = {**SIZES[size]["codex"].get("codex", {}), **codex}
    return Task(label, "codex", prompt, codex=cfg, timeout_s=timeout_s)


def lab(root: str | Path, name: str, tasks: list[Task], *, ctx: int, threads: int = 1, extend: bool = False,
        model: str | None = None) -> Path:
    """Run `tasks` on one fresh llama-server of `ctx` tokens (one slot) in the sealed lab;
    `extend`: serve `ctx` to the embedded model trained on 8,192 (YaRN). Returns the folder."""
    spec = LabSpec(str(Path(root) / name), tasks, ctx=ctx, threads=threads, model=model,
                   server_args=EXTEND_CONTEXT(ctx) if extend else [])
    return run_lab(spec)


def first_call_parts(out: str | Path, request_id: int = 0) -> pd.DataFrame:
    """Tokens per part of one captured call (default: the first): each system block, each
    tool schema, each message, by the served model's tokenizer."""
    from infercourse.ops.agent_lab import anatomy
    for a in anatomy(out):
        if a["request_id"] == request_id:
            df = pd.DataFrame(a["parts"])
            df["share"] = df["tokens"] / max(1, df["tokens"].sum())
            return df
    raise ValueError(f"{out}: no captured request {request_id} with a body")


def versus_stand_in(real: pd.DataFrame, profile: str = "cpu", count=None) -> pd.DataFrame:
    """The real first request against the course's stand-in workload (notebook 19's), part
    kind by part kind: parts and tokens of each, and the stand-in's share of the real one."""
    from infercourse.measure.agent_workload import coding_agent_session
    from infercourse.ops.agent_anatomy import compare_parts, dissect
    req = coding_agent_session(profile=profile, api="anthropic", n_calls=1).requests[0]
    body = _anthropic_body(req)
    stand = dissect(body, "anthropic", count or _embedded_counter())
    return compare_parts(real, stand, ("real agent", "stand-in"))


def _anthropic_body(req) -> dict[str, Any]:
    """The wire body the course's Anthropic engine sends for `req` (no server asked)."""
    from infercourse.engines.anthropic_http import AnthropicHTTPEngine
    eng = AnthropicHTTPEngine("http://127.0.0.1:1", model="stand-in")
    return eng.body(req)


def _embedded_counter():
    """Token counts by the embedded model's own tokenizer, in process (vocabulary only):
    the same tokenizer the lab's server counted the real request with."""
    import functools

    from infercourse.models.embedded import vocab_tokenizer
    tok = vocab_tokenizer()

    @functools.lru_cache(maxsize=4096)
    def count(text: str) -> int:
        return len(tok(text)) - 1 if text else 0   # less the BOS the tokenizer adds
    return count


def evaluated_by_task(out: str | Path) -> pd.DataFrame:
    """Per task: its first model call (prompt, cached and evaluated tokens, TTFT, the first part
    that differed from the call before it), then the task's totals: calls, answered calls and
    prompt tokens the server evaluated over the whole task (its /metrics counter). An agent
    whose answer was cut at its max_tokens sends more calls to continue it: the first call is
    the one to compare across tasks, the totals say what the task cost."""
    calls, tasks = calls_table(out), tasks_table(out)
    gen = calls[calls["api"].isin(GENERATING_APIS)]
    rows = []
    for _, t in tasks.iterrows():
        c = gen[gen["task"] == t["task"]]
        first = c.iloc[0] if len(c) else pd.Series(dtype=object)
        rows.append({"task": t["task"], "agent": t["agent"], "exit": t["exit"],
                     "prompt_tokens": first.get("prompt_tokens"), "cached_tokens": first.get("cached_tokens"),
                     "evaluated_tokens": first.get("evaluated_tokens"), "ttft_s": first.get("ttft_s"),
                     "first_diff": first.get("first_diff"), "calls": len(c), "answered": int((c["status"] == "ok").sum()),
                     "task_evaluated_tokens": t["evaluated_tokens"], "wall_s": t["wall_s"]})
    return pd.DataFrame(rows).set_index("task")


def cold_warm_sentence(tab: pd.DataFrame, cold: str, warm: str, again: str) -> str:
    """What the cold and the two warm runs of one task showed, with the warm pair as the A/A
    spread (one pair: a range, not an interval)."""
    c, w, a = (tab.loc[k] for k in (cold, warm, again))
    aa = max(w["ttft_s"], a["ttft_s"]) / min(w["ttft_s"], a["ttft_s"]) - 1
    ratio = c["ttft_s"] / w["ttft_s"]
    beyond = ratio > 1 + aa or ratio < 1 / (1 + aa)
    return (f"The cold call evaluated {c['evaluated_tokens']:.0f} prompt tokens and waited {c['ttft_s']:.1f} s "
            f"for its first token; the same task again evaluated {w['evaluated_tokens']:.0f} and waited "
            f"{w['ttft_s']:.2f} s ({ratio:.0f}x {'faster' if ratio > 1 else 'slower'} warm). The two warm "
            f"runs differ by {aa:.0%} (one A/A pair: a range, not an interval); the cold/warm ratio is "
            + ("beyond it." if beyond else "within it: this run cannot tell them apart."))


def header_sentence(tab: pd.DataFrame, on: str, off: str) -> str:
    """Re-prefill of a second task with the header on against with it off (first calls)."""
    a, b = tab.loc[on], tab.loc[off]

    def of(r) -> str:
        if pd.isna(r["prompt_tokens"]):   # a usage block without input tokens: said, not guessed
            return f"{r['evaluated_tokens']:.0f} prompt tokens (the server's usage gave no prompt size)"
        return (f"{r['evaluated_tokens']:.0f} of its {r['prompt_tokens']:.0f} prompt tokens "
                f"({r['evaluated_tokens'] / r['prompt_tokens']:.0%})")
    more = "more" if a["evaluated_tokens"] > b["evaluated_tokens"] else "fewer"
    return (f"A new task with the header on evaluated {of(a)}; first difference: {a['first_diff']}. With "
            f"CLAUDE_CODE_ATTRIBUTION_HEADER=0 a new task evaluated {of(b)}; first difference: "
            f"{b['first_diff']}. {more.capitalize()} with the header on.")


def clip_view(out: str | Path) -> pd.DataFrame:
    """Each call of the clipped-answer task: what it asked for, what came back, and why it stopped."""
    cols = ["task", "status", "max_tokens", "prompt_tokens", "output_tokens", "stop_reason", "first_diff", "error"]
    df = calls_table(out)
    return df[[c for c in cols if c in df.columns]]


def compaction_view(out: str | Path) -> pd.DataFrame:
    """Each turn of a growing session: prompt size, whether it was answered, and the context
    window the agent said it assumed."""
    calls, tasks = calls_table(out), tasks_table(out).set_index("task")
    gen = calls[calls["api"] == "anthropic"]
    rows = []
    for task, c in gen.groupby("task", sort=False):
        windows = tasks.loc[task].get("assumed_context_window") or {}
        rows.append({"turn": task, "ended": "ok" if tasks.loc[task, "exit"] == 0 else "error",
                     "calls": len(c), "answered": int((c["status"] == "ok").sum()),
                     "largest prompt": c["prompt_tokens"].max(), "refused": int(c["error"].fillna("").str.contains(
                         "exceeds the available context").sum()),
                     "agent's window": max(windows.values()) if isinstance(windows, dict) and windows else None,
                     "agent said": str(tasks.loc[task].get("result_preview", ""))[:60]})
    return pd.DataFrame(rows)


def amplification(out: str | Path) -> pd.DataFrame:
    """Per task: how many copies of its first request the agent sent (the first call and the
    identical re-sends right after it: retries), how many were answered, one copy's prompt
    tokens, what the server evaluated over those copies (its /metrics counter, call by call),
    and their ratio, the retry amplification (1: each prompt token evaluated once)."""
    calls = calls_table(out)
    gen = calls[calls["api"].isin(GENERATING_APIS)]
    rows = []
    for task, c in gen.groupby("task", sort=False):
        n = 1
        while n < len(c) and c["first_diff"].iloc[n] == "identical":
            n += 1
        copies = c.iloc[:n]
        size = copies["prompt_tokens"].max()
        if pd.isna(size):   # no copy answered: the size the agent's shape says
            size = float("nan")
        evaluated = copies["evaluated_tokens"].sum(min_count=1)
        rows.append({"task": task, "copies": n, "answered": int((copies["status"] == "ok").sum()),
                     "request_tokens": size, "server_evaluated": evaluated,
                     "amplification": evaluated / size if size and size == size else float("nan"),
                     "later_calls": len(c) - n})
    return pd.DataFrame(rows).set_index("task")


def amplification_sentence(tab: pd.DataFrame, short: str, fixed: str) -> str:
    """What the short and the long client timeout cost the server, computed from `amplification`."""
    a, b = tab.loc[short], tab.loc[fixed]
    def one(r) -> str:
        retried = f"{r['copies']:.0f} copies of its first request" if r["copies"] > 1 else "its first request once (no retry)"
        return (f"sent {retried}, {r['answered']:.0f} answered; the server evaluated {r['server_evaluated']:.0f} "
                f"prompt tokens for a request of {r['request_tokens']:.0f} ({r['amplification']:.1f}x)")
    return f"With the short timeout the agent {one(a)}. With the long one it {one(b)}."


def extension_cost(ctx: int, trained: int = 8192, model: str | None = None, n_words: int = 600) -> dict[str, Any]:
    """What serving `ctx` tokens to a model trained on `trained` costs it, measured: the mean
    NLL (nats per token) of the course's evaluation text with and without the YaRN settings
    `EXTEND_CONTEXT` gives llama-server, the per-token difference and its 2 standard errors
    (tokens are correlated, so the SE is a floor on the real uncertainty)."""
    import llama_cpp

    from infercourse.measure.workloads import eval_text
    from infercourse.models.quality import token_nlls
    text = " ".join(eval_text().split()[:n_words])
    base_ids, base = token_nlls(model, text, n_threads=1)
    yarn = {"n_ctx": 1024, "rope_scaling_type": llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN,
            "rope_freq_scale": trained / ctx, "yarn_orig_ctx": trained,
            "kv_overrides": {"llama.context_length": int(ctx)}}
    ids, ext = token_nlls(model, text, n_threads=1, gguf_options=yarn)
    assert ids == base_ids
    d = ext - base
    return {"window": ctx, "trained": trained, "tokens": len(d), "nll trained": float(base.mean()),
            "nll extended": float(ext.mean()), "diff": float(d.mean()),
            "2 SE": float(2 * d.std(ddof=1) / np.sqrt(len(d)))}


def extension_sentence(cost: dict[str, Any]) -> str:
    """Whether the extension's quality cost shows beyond its 2 SE on this text."""
    diff, se = cost["diff"], cost["2 SE"]
    verdict = ("worse beyond 2 SE" if diff > se else "better beyond 2 SE" if diff < -se else "within 2 SE of no change")
    return (f"Serving {cost['window']:,} tokens to a model trained on {cost['trained']:,} (YaRN x"
            f"{cost['window'] / cost['trained']:g}) changed the mean NLL on {cost['tokens']} tokens of text by "
            f"{diff:+.3f} nats per token (2 SE {se:.3f}): {verdict}, perplexity x{np.exp(diff):.2f}.")


def growing_session(size: str, turns: int, paste_words: int, env: dict[str, str], timeout_s: float) -> list[Task]:
    """One Claude Code session of `turns` tasks (`--continue`), each pasting `paste_words` words
    of the course's evaluation text: the history grows by about that much every turn."""
    from infercourse.measure.workloads import eval_text
    words = eval_text().split()
    out = []
    for k in range(turns):
        paste = " ".join(words[(k * paste_words) % len(words):][:paste_words])
        out.append(claude_task(f"turn {k}", f"Note {k}:\n{paste}\nSay OK.", size,
                               env=env, timeout_s=timeout_s, session="session", resume=k > 0))
    return out


def compaction_sentence(as_is: pd.DataFrame, told: pd.DataFrame, window: int) -> str:
    """What the two growing sessions showed: turns answered, the first refusal, whether the
    prompt ever shrank (the agent compacted), and the window the agent said it assumed."""
    def read(v: pd.DataFrame) -> str:
        n, ok = len(v), int((v["ended"] == "ok").sum())
        refused = v.index[v["refused"] > 0]
        first = f"first refusal at {v.loc[refused[0], 'turn']}" if len(refused) else "no refusal"
        sizes = v["largest prompt"].tolist()
        shrank = [v["turn"].iloc[i] for i in range(1, n) if sizes[i] < sizes[i - 1]]
        grew = (f"the prompt shrank at {', '.join(map(str, shrank))} (compaction)" if shrank
                else "the prompt never shrank")
        assumed = v["agent's window"].dropna()
        said = f"; the agent assumed a window of {assumed.max():,.0f} tokens" if len(assumed) else ""
        return f"{ok} of {n} turns ended without an error, {first}, {grew}{said}"
    return f"On a {window:,}-token server: as is, {read(as_is)}. Told the window: {read(told)}."


def doctor_on_fresh_server(ctx: int, capture: str | Path, *, threads: int = 1, model: str | None = None,
                           agent: str = "claude-code") -> str:
    """`doctor agent` against a new llama-server of `ctx` tokens (extended above 8,192), sized by
    the captured first request in `capture`: the checks and the settings it prints."""
    from infercourse.measure.workloads import DATA_DIR
    from infercourse.ops.agent_doctor import agent_shape, fixes, grade_agent_route, probe_agent_route
    from infercourse.servers import LlamaServer
    extra = ["--chat-template-file", str(DATA_DIR / "chatml_tools.jinja"), "--alias", "smollm2-135m",
             *(EXTEND_CONTEXT(ctx) if ctx > 8192 else [])]
    shape = agent_shape(agent, capture)
    with LlamaServer(model, n_parallel=1, ctx_size=ctx, threads=threads, jinja=True, extra_args=extra) as srv:
        ev = probe_agent_route(srv.url, agent)
        checks = grade_agent_route(ev, shape)
        lines = [f"doctor agent {srv.url} --agent {agent}   (llama-server -c {ctx}; first request "
                 f"{shape['prompt_tokens']} tokens, from this run's capture)"]
        lines += [f"  [{c.status:4}] {c.layer:8} {c.summary}" for c in checks]
        return "\n".join(lines + ["settings that fix what was found:", fixes(agent, srv.url, ev, shape, checks)])

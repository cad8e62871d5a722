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
  so a session grows until the server refuses it, unless `CLAUDE_CODE_MAX_CONTEXT_TOKENS`
  tells it the real window (`CLAUDE_CODE_AUTO_COMPACT_WINDOW` cannot: this version reads a
  value under 100,000 as 100,000); whether it then compacts, and what the prompt does after,
  is read from the captured calls (`session_view`);
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
           "amplification", "amplification_sentence", "extension_cost", "extension_sentence", "session_pastes",
           "growing_session", "compaction_plan", "told_env", "plan_sentence", "session_view", "compaction_sentence",
           "doctor_on_fresh_server", "calls_table", "tasks_table", "EXTEND_CONTEXT", "first_request_tokens",
           "rerun_evaluated"]

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
        model: str | None = None, n_predict: int | None = 64) -> Path:
    """Run `tasks` on one fresh llama-server of `ctx` tokens (one slot) in the sealed lab;
    `extend`: serve `ctx` to the embedded model trained on 8,192 (YaRN); `n_predict`: the
    server's own output cap (`-n`; None: only the agent's max_tokens bounds an answer).
    Returns the folder."""
    spec = LabSpec(str(Path(root) / name), tasks, ctx=ctx, threads=threads, model=model, n_predict=n_predict,
                   server_args=EXTEND_CONTEXT(ctx) if extend else [])
    return run_lab(spec)


def _unused(root: str | Path, name: str) -> str:
    """`name-1`, `name-2`...: the first that holds no lab run yet (a lab folder is written
    once), so an exercise cell can run again."""
    k = 1
    while (Path(root) / f"{name}-{k}").exists():
        k += 1
    return f"{name}-{k}"


def _model_calls(out: str | Path) -> pd.DataFrame:
    """The lab run's calls that asked the model for an answer (not count_tokens, not probes)."""
    calls = calls_table(out)
    return calls[calls["api"].isin(GENERATING_APIS)]


def _first_call(out: str | Path) -> pd.Series:
    """The first model call a lab run captured."""
    from infercourse.core.errors import AgentLayerError
    gen = _model_calls(out)
    if not len(gen):
        raise AgentLayerError(f"{out}: the agent sent no model call (its log: {Path(out) / 'lab.log'})")
    return gen.iloc[0]


def first_request_tokens(root: str | Path, tools: str, size: str, *, ctx: int, threads: int = 1,
                         model: str | None = None, timeout_s: float = 900, name: str = "tools") -> float:
    """Prompt tokens of Claude Code's first request for a one-line task when it is given only
    `tools`, run in the sealed lab on a fresh server (`lab`): the server's usage, or, where
    the server refused the call as longer than its window, the size its refusal names.

    Args:
        root: the results folder (the run goes to a new `name-k` folder in it).
        tools: Claude Code's `--tools` value, e.g. "Read,Bash" ("": no tools).
        size: "full" or "ci" (`SIZES`; `tools` replaces the size's own list).
        ctx: the server's window (extended with YaRN above 8,192).
        threads, model, timeout_s: as `lab` and `claude_task` take them.
    """
    task = claude_task(f"tools {tools or 'none'}", "Say hello.", size, env=SHORT_ANSWER, timeout_s=timeout_s,
                       tools=tools)
    first = _first_call(lab(root, _unused(root, name), [task], ctx=ctx, threads=threads, extend=ctx > 8192,
                            model=model))
    n = first.get("prompt_tokens")
    return float(n) if pd.notna(n) else _refused_size(first.get("error"))


def rerun_evaluated(root: str | Path, size: str, env: dict[str, str], *, ctx: int, threads: int = 1,
                    model: str | None = None, timeout_s: float = 900, prompt: str = "Say hello.",
                    name: str = "rerun") -> float:
    """One Claude Code task run twice on one fresh server in the sealed lab, the second time
    with `env` added: the prompt tokens the second run's first call made the server evaluate
    (its /metrics counter), i.e. how much of the first run's cached prefix it could not reuse.

    Args:
        root: the results folder (the run goes to a new `name-k` folder in it).
        size: "full" or "ci".
        env: what the second run changes, e.g. {"CLAUDE_CODE_ATTRIBUTION_HEADER": "0"}.
        ctx, threads, model, timeout_s: as `lab` and `claude_task` take them.
        prompt: the task, the same both times.
    """
    tasks = [claude_task("first", prompt, size, env=SHORT_ANSWER, timeout_s=timeout_s),
             claude_task("again, env changed", prompt, size, env={**SHORT_ANSWER, **env}, timeout_s=timeout_s)]
    out = lab(root, _unused(root, name), tasks, ctx=ctx, threads=threads, extend=ctx > 8192, model=model)
    return float(evaluated_by_task(out).loc["again, env changed", "evaluated_tokens"])


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
    gen, tasks = _model_calls(out), tasks_table(out)
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


def amplification(out: str | Path) -> pd.DataFrame:
    """Per task: how many copies of its first request the agent sent (the first call and the
    identical re-sends right after it: retries), how many were answered, one copy's prompt
    tokens, what the server evaluated over those copies (its /metrics counter, call by call),
    and their ratio, the retry amplification (1: each prompt token evaluated once)."""
    gen = _model_calls(out)
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


def session_pastes(turns: int, paste_words: int) -> list[str]:
    """What each turn of the growing session pastes: `paste_words` words of the course's
    evaluation text, read in a cycle (a long paste is longer than the text), each turn going
    on where the one before stopped."""
    from infercourse.measure.workloads import eval_text
    words = eval_text().split()
    return [" ".join(words[(k * paste_words + i) % len(words)] for i in range(paste_words)) for k in range(turns)]


def growing_session(size: str, turns: int, paste_words: int, env: dict[str, str], timeout_s: float) -> list[Task]:
    """One Claude Code session of `turns` tasks (`--continue`), each pasting `session_pastes`:
    the history grows by one paste (and an answer) every turn."""
    return [claude_task(f"turn {k}", f"Note {k}:\n{paste}\nSay OK.", size, env=env, timeout_s=timeout_s,
                        session="session", resume=k > 0) for k, paste in enumerate(session_pastes(turns, paste_words))]


def compaction_plan(first_tokens: int, turns: int, paste_words: int, *, max_output: int, room: int,
                    count=None) -> dict[str, int]:
    """The server window for the growing session, and the pinned agent's limits told it.

    Args:
        first_tokens: a one-line task's first request, measured (each turn adds its paste,
            counted by the embedded model's tokenizer, and an answer).
        max_output: the agents' answer cap (CLAUDE_CODE_MAX_OUTPUT_TOKENS).
        room: tokens left above the first turn, under the told agent's refusal limit.

    The window is the larger of the size the session reaches halfway through its last paste
    (as is, it outgrows the server there) and the smallest window on which the told agent
    still sends its first turn (`agents.claude_window_limits`); when the second is larger, the
    session as is may never outgrow it. Where the told agent's compaction threshold falls is
    what it is: below the first turn on a window under the agent's reserves (then it compacts
    at every call), above it on a larger one."""
    count = count or _embedded_counter()
    pastes = [count(p) for p in session_pastes(turns, paste_words)]
    first_turn = first_tokens + pastes[0]
    reserve = min(max_output, agents.CLAUDE_OUTPUT_RESERVE_CAP) + agents.CLAUDE_BLOCKING_BUFFER
    window = max(first_tokens + sum(pastes[:-1]) + pastes[-1] // 2, first_turn + room + reserve)
    window = -(-window // 256) * 256   # llama-server sizes its cache in steps of 256
    return {**agents.claude_window_limits(window, max_output), "first_turn": first_turn,
            "last_turn": first_tokens + sum(pastes), "paste_tokens": max(pastes)}


def told_env(plan: dict[str, int]) -> dict[str, str]:
    """The setting that gives the pinned Claude Code the server's window (see `agents`)."""
    return {agents.CLAUDE_WINDOW_ENV: str(plan["window"])}


def plan_sentence(plan: dict[str, int]) -> str:
    """The window the session gets and where the told agent's limits fall, from `compaction_plan`."""
    w, t, b, f = plan["window"], plan["compacts_above"], plan["refuses_above"], plan["first_turn"]
    told = ("below the first turn: told, it refuses to send at all" if b < f else
            "below the first turn: told, it compacts at every call" if t < f else
            f"{t - f:,} tokens above the first turn: told, it compacts once the session has grown that much")
    as_is = ("beyond the window: as is, the session outgrows the server in its last turn"
             if plan["last_turn"] > w else "within the window: as is, the session does not outgrow this server")
    return (f"The session's first turn is about {f:,} tokens; each turn pastes up to {plan['paste_tokens']:,}, and "
            f"the last turn holds at least {plan['last_turn']:,}, {as_is}. The server's window: {w:,} tokens. Told "
            f"it, with answers capped at {plan['max_output']:,}, this agent version refuses to send a prompt it counts "
            f"over {b:,} tokens (its own count, which need not match the server's), and its compaction threshold is "
            f"{t:,}, {told}.")


KEPT_SHARE = 0.5   # a first message that keeps less of the one before than this was replaced, not grown


def _refused_size(error: Any) -> float:
    """The prompt size in llama-server's refusal ("request (N tokens) exceeds ..."), or NaN."""
    import re
    m = re.search(r"request \((\d+) tokens\)", error if isinstance(error, str) else "")
    return float(m.group(1)) if m else float("nan")


def _rewrites(gen: pd.DataFrame, out: str | Path) -> pd.DataFrame:
    """Mark the calls that rewrote the history. A session only appends, so its first message
    stays; a compaction replaces it (with the summary) and the messages hold fewer tokens than
    the call before's. So: the first difference is system 0 (the billing header's suffix
    follows the first message) or in message 0, keeping less than `KEPT_SHARE` of the first
    message before it, and the messages shrink. A summary request that edits or drops only
    later messages keeps the first one, and is not a rewrite."""
    from infercourse.ops.agent_lab import anatomy
    shape = {}
    for a in anatomy(out):
        kinds = [p["kind"] for p in a["parts"]]
        first = kinds.index("message") if "message" in kinds else len(kinds)
        shape[a["request_id"]] = (sum(p["tokens"] for p in a["parts"][:first]),
                                  a["parts"][first]["tokens"] if first < len(kinds) else 0,
                                  sum(p["tokens"] for p in a["parts"][first:]))
    s = gen["request_id"].map(shape)
    before_msgs, first_msg = s.map(lambda x: x[0] if isinstance(x, tuple) else float("nan")), \
        s.map(lambda x: x[1] if isinstance(x, tuple) else float("nan"))
    gen["message_tokens"] = s.map(lambda x: x[2] if isinstance(x, tuple) else float("nan"))
    diff = gen["first_diff"].fillna("")
    kept = gen.get("tokens_before_diff", pd.Series(float("nan"), index=gen.index)) - before_msgs
    replaced = (diff == "system 0") | (diff.str.startswith("message 0 ") & (kept < KEPT_SHARE * first_msg.shift()))
    gen["rewrote_history"] = replaced & (gen["message_tokens"] < gen["message_tokens"].shift())
    return gen


def session_view(out: str | Path) -> pd.DataFrame:
    """One row per call of a growing session, and one per turn that sent none (status "not
    sent"; `refused_by` "agent" when the agent judged it too long itself): how the turn ended
    (ok, error, timeout: the task's time bound), prompt tokens (the server's usage, or the
    count in its refusal), output, stop reason, the first part that differs from the call
    before, who refused the call, whether it rewrote the history (a compaction, judged by the
    request's structure, not its text: see `_rewrites`), the window the agent said it assumed,
    and whether its log named a compaction query in that turn (it names one query source per
    process, the first: True says it compacted first thing, False proves nothing)."""
    calls, tasks = calls_table(out), tasks_table(out)
    gen = calls[calls["api"] == "anthropic"].copy()
    gen["prompt_tokens"] = gen["prompt_tokens"].fillna(gen["error"].map(_refused_size))
    gen = _rewrites(gen, out)
    gen["refused_by"] = gen["error"].fillna("").str.contains("exceeds the available context").map(
        {True: "server", False: None})
    rows = []
    for _, t in tasks.iterrows():
        windows, sources = t.get("assumed_context_window"), t.get("query_sources")
        turn = {"turn": t["task"], "ended": {0: "ok", "timeout": "timeout"}.get(t["exit"], "error"),
                "agent_window": max(windows.values()) if isinstance(windows, dict) and windows else float("nan"),
                "compact_logged": isinstance(sources, list) and "compact" in sources}
        c = gen[gen["task"] == t["task"]]
        if not len(c):
            rows.append({**turn, "status": "not sent",
                         "refused_by": "agent" if t.get("terminal_reason") == "blocking_limit" else None})
        for _, r in c.iterrows():
            rows.append({**turn, **{k: r.get(k) for k in ("status", "prompt_tokens", "cached_tokens", "output_tokens",
                                                          "stop_reason", "first_diff", "message_tokens",
                                                          "rewrote_history", "refused_by")}})
    return pd.DataFrame(rows)


def _session_read(v: pd.DataFrame) -> dict[str, Any]:
    """What one growing session showed, from `session_view`."""
    sent = v[v["status"] != "not sent"].reset_index(drop=True)
    by_server = sent[sent["refused_by"] == "server"]
    rewrites = sent.index[sent["rewrote_history"].fillna(False).astype(bool)]
    first = rewrites[0] if len(rewrites) else None
    before = sent["prompt_tokens"].iloc[:first].dropna() if first is not None else pd.Series(dtype=float)
    turns = v.drop_duplicates("turn")
    return {"calls": len(sent), "largest": sent["prompt_tokens"].max(), "server_refused": len(by_server),
            "first_refused": by_server["turn"].iloc[0] if len(by_server) else None,
            "not_sent": int((v["refused_by"] == "agent").sum()), "timeouts": int((turns["ended"] == "timeout").sum()),
            "rewrites": len(rewrites), "rewrite_turn": sent["turn"].iloc[first] if first is not None else None,
            "rewrote_after_refusal": first is not None and len(by_server) > 0 and first > by_server.index[0],
            "before": before.iloc[-1] if len(before) else float("nan"),
            "after": sent["prompt_tokens"].iloc[first] if first is not None else float("nan"),
            "window": v["agent_window"].max(), "compact_logged": list(turns.loc[turns["compact_logged"], "turn"])}


def _session_clause(name: str, r: dict[str, Any]) -> str:
    said = (f"the agent reported a window of {r['window']:,.0f} tokens" if r["window"] == r["window"]
            else "the agent reported no window")
    refused = (f"the server refused {r['server_refused']} of its {r['calls']} calls, the first in {r['first_refused']}"
               if r["server_refused"] else f"the server refused none of its {r['calls']} calls")
    if r["not_sent"]:
        refused += f"; the agent refused to send {r['not_sent']} turn(s) itself"
    if r["rewrites"]:
        move = "dropped" if r["after"] < r["before"] else "did not drop"
        hist = (f"it rewrote its history {r['rewrites']} time(s), first in {r['rewrite_turn']}, and the prompt {move}: "
                f"{r['before']:,.0f} tokens on the call before, {r['after']:,.0f} on the rewritten call")
    elif r["compact_logged"]:
        hist = (f"it logged a compaction query in {', '.join(r['compact_logged'])}, but no call started from a "
                f"summary: its history was never rewritten")
    else:
        hist = "its history was never rewritten"
    bound = f"; {r['timeouts']} turn(s) hit the task's time bound" if r["timeouts"] else ""
    return f"{name}, {said}: {refused}; {hist}; its largest prompt was {r['largest']:,.0f} tokens{bound}"


def compaction_sentence(as_is: pd.DataFrame, told: pd.DataFrame, window: int) -> str:
    """What the two growing sessions (`session_view`s) showed on a `window`-token server: the
    window each agent reported, the refusals (the server's, and the agent's own), whether and
    where the history was rewritten and the prompt size around it, the turns cut by the time
    bound, and what, from these, the run shows about compaction."""
    a, t = _session_read(as_is), _session_read(told)
    if t["rewrites"] and t["after"] < t["before"]:
        verdict = "Told the window, the agent compacted" + (
            f", and still the server refused {t['server_refused']} of its calls" if t["server_refused"]
            else " and the server refused none of its calls") + (
            "; as is, the server refused the session" + (", and the agent compacted only after that refusal."
                                                          if a["rewrote_after_refusal"] else ".") if a["server_refused"] else
            "; as is, the session never outgrew this server, so this run does not show a refusal that compaction prevented.")
    elif t["compact_logged"]:
        verdict = ("Told the window, the agent started compacting but did not finish a compaction in this run: "
                   "no prompt drop to show.")
    else:
        verdict = ("Told the window, the agent did not compact in this run"
                   + (" (it refused to send instead)" if t["not_sent"] else "") + ": no prompt drop to show.")
    return f"On a {window:,}-token server. {_session_clause('As is', a)}. {_session_clause('Told the window', t)}. {verdict}"


def doctor_on_fresh_server(ctx: int, capture: str | Path, *, threads: int = 1, model: str | None = None,
                           agent: str = "claude-code") -> str:
    """`doctor agent` against a new llama-server of `ctx` tokens (extended above 8,192), sized by
    the captured first request in `capture`: the checks and the settings it prints."""
    from infercourse.measure.workloads import DATA_DIR
    from infercourse.ops.agent_doctor import agent_shape, grade_agent_route, probe_agent_route, report
    from infercourse.servers import LlamaServer
    extra = ["--chat-template-file", str(DATA_DIR / "chatml_tools.jinja"), "--alias", "smollm2-135m",
             *(EXTEND_CONTEXT(ctx) if ctx > 8192 else [])]
    shape = agent_shape(agent, capture)
    with LlamaServer(model, n_parallel=1, ctx_size=ctx, threads=threads, jinja=True, extra_args=extra) as srv:
        ev = probe_agent_route(srv.url, agent)
        checks = grade_agent_route(ev, shape)
        lines = [f"doctor agent {srv.url} --agent {agent}   (llama-server -c {ctx}; first request "
                 f"{shape['prompt_tokens']} tokens, from this run's capture)"]
        return "\n".join(lines + [report(agent, srv.url, ev, shape, checks)])

"""The agent loop: why one coding task becomes dozens of model calls that re-send everything.

A coding agent is a loop around a stateless model API. Each turn it sends the *whole*
conversation so far (system prompt, tool schemas, the task, every earlier reply and every
tool result), reads one reply, runs the tool that reply asks for, appends the result, and
calls the model again. So call i+1's prompt is call i's prompt plus a little: the context
grows every turn, and almost all of each request repeats the previous one token for token.

Without a prefix cache the engine recomputes (prefills) that repeated part on every call,
so total prefill work grows with the square of the number of turns. With one, each call
only prefills what is new since the last. This module measures both from a recorded
session (`workloads.build_agentic_session`) and replays it through a real engine.

- `session_stats`: per call, prompt tokens, the prefix shared with the previous call, and
  running totals of prefill work with and without a prefix cache.
- `context_composition`: per call, how many tokens each kind of message contributes.
- `replay_prefill`: replay the first calls through an engine with the cache off or on.
- `cold_call`: one call alone with nothing cached, timed (its whole prompt is prefilled).
- `session_with_extra_calls`: the same task with more turns, tools really run.
- `run_agent`: a tiny live agent loop with a real model and the session's real tools.
"""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from infercourse.core.types import Request, generate
from infercourse.core.errors import ContextLayerError
from infercourse.measure.results import new_run_dir
from infercourse.measure.workloads import common_prefix_len

__all__ = ["session_stats", "prefill_summary", "context_composition",
           "replay_prefill", "cold_call", "session_with_extra_calls", "parse_tool_call", "run_agent"]


def _requests(session: dict) -> list[Request]:
    from infercourse.measure.workloads import replay_calls
    calls = [req for _, req in replay_calls(session)]
    if not calls:
        raise ContextLayerError("the session has no model calls", hint="rebuild it with "
                                "`python -m infercourse.measure.workloads build`")
    return calls


def session_stats(session: dict, prompt_tokens: Callable[[Request], list]) -> pd.DataFrame:
    """One row per model call of a recorded session: what it sent and what repeated.

    Columns: `call`, `tool` (the tool the reply asked for), `n_messages`, `prompt_tokens`,
    `shared_prefix_tokens` (leading tokens identical to the previous call's prompt),
    `new_tokens` (the rest), `repeat_pct`, and cumulative prefill tokens without a prefix
    cache (`cum_prefill_no_cache`: every prompt in full) and with a perfect one
    (`cum_prefill_cached`: only the new tokens).

    Args:
        session: a recorded session dict (data/agentic_session.json).
        prompt_tokens: Request -> token ids as the model sees them, chat template applied,
            e.g. `LlamaCppEngine(...).prompt_tokens`.
    """
    rows, prev = [], []
    for i, (req, call) in enumerate(zip(_requests(session), session["calls"])):
        toks = list(prompt_tokens(req))
        shared = common_prefix_len(prev, toks)
        rows.append({"call": i, "tool": call.get("tool") or "(answer)", "n_messages": call["n_messages"],
                     "prompt_tokens": len(toks), "shared_prefix_tokens": shared,
                     "new_tokens": len(toks) - shared, "repeat_pct": 100.0 * shared / len(toks)})
        prev = toks
    df = pd.DataFrame(rows).set_index("call")
    df["cum_prefill_no_cache"] = df["prompt_tokens"].cumsum()
    df["cum_prefill_cached"] = df["new_tokens"].cumsum()
    return df


def prefill_summary(stats: pd.DataFrame) -> dict[str, Any]:
    """The headline numbers of `session_stats`: calls, tokens sent, share that repeated."""
    sent, repeated = int(stats["prompt_tokens"].sum()), int(stats["shared_prefix_tokens"].sum())
    return {"n_calls": len(stats), "prompt_tokens_sent": sent, "repeated_tokens": repeated,
            "repeat_pct": 100.0 * repeated / sent, "new_tokens": sent - repeated,
            "first_context_tokens": int(stats["prompt_tokens"].iloc[0]),
            "final_context_tokens": int(stats["prompt_tokens"].iloc[-1]),
            "prefill_saving_x": sent / max(1, sent - repeated)}


def _kind(i: int, msg: dict) -> str:
    if msg["role"] == "system":
        return "system + tools"
    if msg["role"] == "assistant":
        return "assistant replies"
    return "tool results" if msg["content"].startswith("<tool_response>") else "task"


def context_composition(session: dict, tokenize: Callable[[str], list]) -> pd.DataFrame:
    """Per call, tokens contributed by each kind of message (system + tools, task, assistant
    replies, tool results), counted on the raw message text. The chat template's own tokens
    (role markers) are not included, so rows sum to slightly less than `prompt_tokens`.

    Args:
        tokenize: text -> token ids; a BOS the tokenizer adds is subtracted.
    """
    bos = len(tokenize(""))
    sizes = [(_kind(i, m), len(tokenize(m["content"])) - bos) for i, m in enumerate(session["messages"])]
    rows = []
    for c in session["calls"]:
        row: dict[str, int] = {}
        for kind, n in sizes[:c["n_messages"]]:
            row[kind] = row.get(kind, 0) + n
        rows.append(row)
    cols = ["system + tools", "task", "assistant replies", "tool results"]
    return pd.DataFrame(rows).reindex(columns=cols).fillna(0).astype(int).rename_axis("call")


def replay_prefill(engine, session: dict, n_calls: int, *, cache_prompt: bool, max_tokens: int = 4,
                   results_root: str | Path | None = None) -> pd.DataFrame:
    """Replay the first `n_calls` calls of a session back to back and record prefill work.

    Each call is cut to `max_tokens` forced output tokens, so the time is mostly prefill.
    An in-process engine is reset first, so call 0 starts cold in both settings. Returns
    bench's per-request frame plus `call`, `cache_prompt` and `prompt_n` (tokens the engine
    says it evaluated: llama.cpp's `prompt_n`; None where the engine does not say).

    Args:
        engine: any engine; `cache_prompt` is honoured by llama.cpp and llama-server.
        n_calls: how many calls from the start of the session (they grow: keep it small on CPU).
        cache_prompt: reuse the longest cached prefix of the previous request, or not.
        max_tokens: output tokens per call (forced with ignore_eos).
        results_root: folder under which bench saves the run (manifest + one line per
            request) in a new timestamped subfolder; e.g. `course.results_dir(...)`.
    """
    from infercourse.measure.bench import run
    reqs = _requests(session)
    if not 1 <= n_calls <= len(reqs):
        raise ValueError(f"n_calls must be between 1 and {len(reqs)}, got {n_calls}")
    reqs = [replace(r, max_tokens=max_tokens, cache_prompt=cache_prompt, ignore_eos=True)
            for r in reqs[:n_calls]]
    if hasattr(engine, "reset"):
        engine.reset()
    label = f"agent-replay-{'cache' if cache_prompt else 'nocache'}-{n_calls}"
    # no salt: both settings must send the same tokens; the reset above makes call 0 cold
    res = run(engine, reqs, pattern="sequential", warmup=0, progress=False, label=label, salt=False,
              out_dir=new_run_dir(results_root, label),
              conditions={"session": session.get("name"), "cache_prompt": cache_prompt})
    df = res.df.copy()
    df["call"] = df["req_index"]
    df["cache_prompt"] = cache_prompt
    df["prompt_n"] = [tr.engine_timings.get("prompt_n") for tr in res.traces]
    return df


def cold_call(engine, session: dict, call: int, *, max_tokens: int = 4) -> dict[str, Any]:
    """Send one call of a recorded session alone, with nothing cached, and time it: its
    whole prompt is prefilled, as on every call without a prefix cache.

    Args:
        engine: any engine; `cache_prompt=False` makes llama.cpp and llama-server forget
            the previous request first.
        session: a recorded session dict (data/agentic_session.json).
        call: which call (0-based); later calls carry longer prompts.
        max_tokens: output tokens (forced with ignore_eos), so the time is mostly prefill.

    Returns {"call", "prompt_tokens", "prompt_n" (tokens the engine says it evaluated),
    "ttft_s"}.
    """
    from infercourse.core import metrics
    from infercourse.core.trace import record
    reqs = _requests(session)
    if not 0 <= call < len(reqs):
        raise ValueError(f"call must be between 0 and {len(reqs) - 1}, got {call}")
    req = replace(reqs[call], max_tokens=max_tokens, cache_prompt=False, ignore_eos=True)
    tr = record(engine, req, raise_errors=True)
    return {"call": call, "prompt_tokens": tr.prompt_tokens, "prompt_n": tr.engine_timings.get("prompt_n"),
            "ttft_s": metrics.ttft_s(tr)}


def session_with_extra_calls(n_extra: int, *, plan_path: str | Path | None = None) -> dict:
    """The recorded task run again with its last tool step done `n_extra` more times before
    the final answer (one more run of the test suite, say). Tools really run, through
    `workloads.build_agentic_session`, and each extra call re-sends the whole conversation.

    Args:
        n_extra: extra calls (0 rebuilds the recorded session).
        plan_path: the scripted plan (default data/agentic_plan.json); its last tool step
            must be repeatable (a read, a grep or a test run, not an edit).
    """
    from infercourse.measure.workloads import DATA_DIR, build_agentic_session
    if n_extra < 0:
        raise ValueError(f"n_extra must be >= 0, got {n_extra}")
    plan = json.loads(Path(plan_path or DATA_DIR / "agentic_plan.json").read_text())
    steps = plan["steps"]
    last = max(i for i, (_, tool, _) in enumerate(steps) if tool is not None)
    plan["steps"] = steps[:last + 1] + [steps[last]] * n_extra + steps[last + 1:]
    return build_agentic_session(plan=plan)


_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def parse_tool_call(text: str) -> tuple[str, dict] | None:
    """The first `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in a reply, or
    None when there is none or its JSON is invalid (what small models often write)."""
    m = _CALL_RE.search(text)
    if not m:
        return None
    try:
        call = json.loads(m.group(1))
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments")
    return call["name"], args if isinstance(args, dict) else {}


def run_agent(engine, task: str, *, max_steps: int = 3, max_tokens: int = 64) -> pd.DataFrame:
    """Drive a real agent loop: the model picks a tool, the tool runs on a scratch copy of
    data/synthetic_repo, its result is appended, and the model is called again, until it
    answers without a tool call or `max_steps` calls were made. One row per model call.

    Tools run through the same implementation that recorded the session
    (`workloads.run_tool`); a failing tool call becomes an error message for the model,
    as in real agents, instead of stopping the loop.
    """
    from infercourse.measure.workloads import DATA_DIR, run_tool, system_prompt
    messages = [{"role": "system", "content": system_prompt()}, {"role": "user", "content": task}]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "repo"
        shutil.copytree(DATA_DIR / "synthetic_repo", root, ignore=shutil.ignore_patterns("__pycache__"))
        for step in range(max_steps):
            c = generate(engine, Request(messages=list(messages), max_tokens=max_tokens))
            call = parse_tool_call(c.text)
            rows.append({"step": step, "prompt_tokens": c.usage.prompt_tokens if c.usage else None,
                         "cached_tokens": c.usage.cached_tokens if c.usage else None,
                         "tool": call[0] if call else None, "reply": c.text.strip()})
            messages.append({"role": "assistant", "content": c.text})
            if call is None:
                break
            try:
                result = run_tool(root, *call)
            except Exception as e:  # noqa: BLE001 - a bad call is the model's error, reported back
                result = f"error: {type(e).__name__}: {e}"
            messages.append({"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"})
    return pd.DataFrame(rows).set_index("step")

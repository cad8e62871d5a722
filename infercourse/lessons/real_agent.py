"""Your real agent on your server (notebook 20): Claude Code and Codex CLI, captured.

Notebook 19 taught the coding-agent route with the course's stand-in of an agent. Here the
real clients run (pinned versions, installed by `make agents`), against the course's own
llama-server, inside a network namespace that holds nothing but loopback (`ops.netns`), with
every call captured by a recording proxy (`ops.agent_capture`). What they show, and the
stand-in does not:

- **the real first request**: its parts (system blocks, tool schemas, a `role: "system"`
  message), their tokens, and how close the stand-in's shape is;
- **the overflow**: the default server's window is smaller than the first request (a window
  that fits, past the model's trained length, costs quality: `context_extension`);
- **cold against warm**: the same task again reuses the whole prefix; **the per-task header**
  (its version suffix follows the task) re-prefills a new task unless turned off;
- **max_tokens against the window**: the agent asks for 32,000; the server clips the answer
  at the window (`clip_lab` pads the task to the window llama.cpp rounds up), and the agent's
  attempt to continue it overflows;
- **compaction**: the agent assumes a 1,000,000-token window for a model it does not know, so
  a session grows until the server refuses it, unless `CLAUDE_CODE_MAX_CONTEXT_TOKENS` tells it
  the real window; whether it then compacts is read from the calls (`real_agent_session`);
- **retry amplification**: a client timeout shorter than a cold prefill may re-send the request.

Every function here builds lab tasks (`ops.agent_lab.Task`), runs them, or reads a lab run's
folder into a table (a session's: `real_agent_session`; sentences: `real_agent_claims`).
"""
from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Any

import pandas as pd

from infercourse.ops import agents
from infercourse.ops.agent_anatomy import embedded_counter, padded_prompt
from infercourse.ops.agent_budget import WINDOW_PAD, padded_window
from infercourse.ops.agent_growth import compaction_plan, session_pastes
from infercourse.ops.agent_capture import GENERATING_APIS
from infercourse.ops.agents import HEADER_OFF, readiness, skip_reason
from infercourse.ops.agent_lab import (EXTEND_CONTEXT, LabSpec, Task, anatomy, calls_table, extend_flags, refused_size,
                                       run_lab, tasks_table)

__all__ = ["SIZES", "SHORT_ANSWER", "HEADER_OFF", "ANSWER_STOP", "readiness", "skip_reason", "claude_task", "codex_task", "lab", "first_call_parts",
           "versus_stand_in", "evaluated_by_task", "clip_view", "amplification", "session_pastes", "growing_session",
           "compaction_plan", "first_tokens_at", "told_env", "doctor_on_fresh_server", "calls_table", "tasks_table", "anatomy",
           "EXTEND_CONTEXT", "extend_flags", "first_request_tokens", "first_request_size", "TOOL_TASK", "TOOL_ANSWER",
           "tool_task", "SIZING_CTX", "LONG_ANSWER", "clip_lab", "clipped_output_tokens"]

SHORT_SYSTEM = "You are a coding assistant. Answer in one short sentence."
# The two sizes: "full" sends the agents' own requests; "ci" shrinks them with the agents' own
# flags (Claude Code: --system-prompt and --tools; Codex: model_instructions_file), keeping their
# structure (the billing header block, the role: system message, the tools that remain).
SIZES = {"full": {"claude-code": {}, "codex": {}},
         "ci": {"claude-code": {"system_prompt": SHORT_SYSTEM, "tools": "Read"},
                "codex": {"codex": {"instructions": SHORT_SYSTEM}}}}
SHORT_ANSWER = {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64"}   # where the answer's length is not the lesson
SIZING_CTX = 512   # a window no first request fits: the server refuses it at once, naming its size (no prefill)
ANSWER_STOP = ["\n", ". "]   # a lab option (Task.answer_stop, tagged on each call): the answer ends at its first line or
# sentence, not at the cap, an API error to the agent (a summary cut there: a failed compaction, asked again);
# ". " because a pasted text echoed back has sentences but no line break
# the tool round trip: a task that asks for a file, its first call forced to Read (ops.agent_lab's
# force_first_tool); room for a call whose path the model writes, and turns for the result
TOOL_TASK, TOOL_ANSWER = "Read the file notes.txt and say what it holds.", {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256"}


def claude_task(label: str, prompt: str, size: str, *, env: dict[str, str] | None = None, timeout_s: float = 900, **kw: Any) -> Task:
    """A Claude Code task at `size` ("ci": its own flags shrink the request; "full": defaults)."""
    return Task(label, "claude-code", prompt, env=dict(env or {}), timeout_s=timeout_s,
                **{**SIZES[size]["claude-code"], **kw})


def tool_task(size: str, *, timeout_s: float = 900) -> Task:
    """The tool round trip: Read alone, forced on the first call (`Task.force_first_tool`), three
    turns; the answers after it end at their first line or sentence (`ANSWER_STOP`, not the forced call)."""
    return claude_task("tool round trip", TOOL_TASK, size, env=TOOL_ANSWER, timeout_s=timeout_s, tools="Read",
                       force_first_tool="Read", max_turns=3, answer_stop=ANSWER_STOP)


def codex_task(label: str, prompt: str, size: str, *, timeout_s: float = 900, **codex: Any) -> Task:
    """A Codex CLI task at `size`; `codex` adds config values (timeouts, retries, window)."""
    cfg = {**SIZES[size]["codex"].get("codex", {}), **codex}
    return Task(label, "codex", prompt, codex=cfg, timeout_s=timeout_s)


def lab(root: str | Path, name: str, tasks: list[Task], *, ctx: int, threads: int = 1, extend: bool = True,
        model: str | None = None, n_predict: int | None = 64) -> Path:
    """Run `tasks` on one fresh llama-server of `ctx` tokens (one slot) in the sealed lab;
    `extend`: serve `ctx` past the model's trained context where it asks more (YaRN, with the
    trained length and architecture read from the model's file: `extend_flags`); `n_predict`: the
    server's own output cap (`-n`; None: only the agent's max_tokens bounds an answer).
    Returns the folder: root/name, or name-1, name-2... when a cell is run again (results are
    append-only, and a rerun must not fail on the folder its first run left)."""
    name = name if not (Path(root) / name).exists() else _unused(root, name)   # a rerun: name-1, name-2...
    spec = LabSpec(str(Path(root) / name), tasks, ctx=ctx, threads=threads, model=model, n_predict=n_predict,
                   server_args=extend_flags(ctx, model) if extend else [])
    return run_lab(spec)


def _unused(root: str | Path, name: str) -> str:
    """`name-1`, `name-2`...: the first with no lab run yet (one is written once), so a cell can run again."""
    return next(f"{name}-{k}" for k in itertools.count(1) if not (Path(root) / f"{name}-{k}").exists())


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


def first_request_tokens(root: str | Path, tools: str | None, size: str, *, ctx: int = SIZING_CTX, threads: int = 1,
                         model: str | None = None, timeout_s: float = 900, name: str = "tools", env: dict[str, str] | None = None) -> float:
    """Prompt tokens of Claude Code's first request for a one-line task when it is given only
    `tools`, run in the sealed lab on a fresh server (`lab`): the server's usage, or, where
    the server refused the call as longer than its window, the size its refusal names.

    Args:
        root: the results folder (the run goes to a new `name-k` folder in it).
        tools: Claude Code's `--tools` value, e.g. "Read,Bash" ("": no tools; None: its own list).
        size: "full" or "ci" (`SIZES`; `tools` replaces the size's own list).
        ctx: the server's window; the default, `SIZING_CTX`, has the request refused unprefilled.
        threads, model, timeout_s: as `lab` and `claude_task` take them; env: settings over `SHORT_ANSWER`.
    """
    label = f"tools {'all' if tools is None else tools or 'none'}"
    task = claude_task(label, "Say hello.", size, env={**SHORT_ANSWER, **(env or {})}, timeout_s=timeout_s, tools=tools)
    return first_request_size(lab(root, _unused(root, name), [task], ctx=ctx, threads=threads, model=model))


def first_request_size(out: str | Path) -> float:
    """A lab run's first model call's prompt tokens: the server's usage, or the size its refusal names."""
    first = _first_call(out)
    n = first.get("prompt_tokens")
    return float(n) if pd.notna(n) else refused_size(first.get("error"))


def first_call_parts(out: str | Path, request_id: int = 0) -> pd.DataFrame:
    """Tokens per part of one captured call (default: the first): each system block, each
    tool schema, each message, by the served model's tokenizer."""
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
    stand = dissect(body, "anthropic", count or embedded_counter())
    return compare_parts(real, stand, ("real agent", "stand-in"))


def _anthropic_body(req) -> dict[str, Any]:
    """The wire body the course's Anthropic engine sends for `req` (no server asked)."""
    from infercourse.engines.anthropic_http import AnthropicHTTPEngine
    eng = AnthropicHTTPEngine("http://127.0.0.1:1", model="stand-in")
    return eng.body(req)


def evaluated_by_task(out: str | Path) -> pd.DataFrame:
    """Per task: its first model call (prompt, cached and evaluated tokens, TTFT, the first part
    that differed from the call before it), then the task's totals: calls, answered calls and
    prompt tokens the server evaluated over the whole task (its /metrics counter). An agent
    whose answer was cut at its max_tokens sends more calls to continue it: the first call is
    the one to compare across tasks, the totals say what the task cost. `cut_by_server`: the
    task's last answer stopped at the server's own cap (`-n`, for a call that named no
    max_tokens: Codex reports such an answer as complete). A first call without the server's
    usage (a stream the agent cut, then sent again unchanged) takes its prompt size from that
    identical copy, and its cached tokens are that size less what the server evaluated for it."""
    gen, tasks = _model_calls(out), tasks_table(out)
    cap = LabSpec.load(Path(out) / "spec.json").n_predict if (Path(out) / "spec.json").exists() else None
    rows = []
    for _, t in tasks.iterrows():
        c = gen[gen["task"] == t["task"]]
        first = c.iloc[0] if len(c) else pd.Series(dtype=object)
        last = c.iloc[-1] if len(c) else pd.Series(dtype=object)
        if pd.isna(first.get("prompt_tokens")) and len(c) > 1:   # a re-sent copy carries the same prompt
            size, ev = _first_copies(c)["prompt_tokens"].max(), first.get("evaluated_tokens")
            first = first.copy()
            first["prompt_tokens"], first["cached_tokens"] = size, size - ev if pd.notna(ev) else float("nan")
        rows.append({"task": t["task"], "agent": t["agent"], "exit": t["exit"], "agent_said": t.get("agent_said"),
                     "prompt_tokens": first.get("prompt_tokens"), "cached_tokens": first.get("cached_tokens"),
                     "evaluated_tokens": first.get("evaluated_tokens"), "ttft_s": first.get("ttft_s"),
                     "first_diff": first.get("first_diff"), "calls": len(c), "answered": int((c["status"] == "ok").sum()),
                     "task_evaluated_tokens": t["evaluated_tokens"], "wall_s": t["wall_s"],
                     "cut_by_server": bool(cap and pd.isna(last.get("max_tokens")) and last.get("output_tokens") == cap)})
    return pd.DataFrame(rows).set_index("task")


LONG_ANSWER = "Count from 1 to 400, one number per line."   # an answer longer than the clipped server's room


def clip_lab(root: str | Path, room: int, size: str, *, threads: int = 1, model: str | None = None,
             timeout_s: float = 900, name: str = "clip") -> Path:
    """The clipped-answer run: the long-answer task on a fresh server whose window leaves `room`
    tokens after the agent's first request at `size`; its folder. llama.cpp rounds a window up to
    a multiple of 256 (`agent_budget.padded_window`), more room than a small model's own answer:
    so the task is sized first (`name`-size: one refused call), then a note of filler words is put
    in front of it (`padded_prompt`) until its first request plus `room` fills a rounded window;
    greedy (`Task.greedy`, stated on each call): sampled, a small model's answer may end first."""
    task = lambda prompt: claude_task("long answer", prompt, size, timeout_s=timeout_s, greedy=True)   # noqa: E731
    first = int(first_request_size(lab(root, f"{name}-size", [task(LONG_ANSWER)], ctx=SIZING_CTX, threads=threads,
                                       model=model)))
    window = padded_window(first + room)
    window += WINDOW_PAD if 0 < window - room - first < 12 else 0   # too few tokens for a note: the next window
    return lab(root, name, [task(padded_prompt(LONG_ANSWER, window - room - first))], ctx=window, threads=threads,
               model=model)


def clipped_output_tokens(root: str | Path, room: int, size: str, **kw: Any) -> float:
    """`output_tokens` of the clipped (first) call on a new `clip_lab` server: exercise 2, `room` changed."""
    return float(clip_view(clip_lab(root, room, size, name="clip-room", **kw))["output_tokens"].iloc[0])


def clip_view(out: str | Path) -> pd.DataFrame:
    """Each call of the clipped-answer task: what it asked for, what came back, and why it stopped."""
    cols = ["task", "status", "max_tokens", "prompt_tokens", "output_tokens", "stop_reason", "greedy", "first_diff", "error"]
    df = calls_table(out)
    return df[[c for c in cols if c in df.columns]]


def amplification(out: str | Path) -> pd.DataFrame:
    """Per task: how many copies of its first request the agent sent (the first call and the
    identical re-sends right after it: retries), how many were answered, one copy's prompt
    tokens, what the server evaluated over those copies (its own per-request count; for copies
    that overlapped and were cut, the task's /metrics counter), and their ratio, the retry amplification (1: each prompt token evaluated once).

    One copy's size is the server's usage where a copy was answered (`size_from` "server
    usage"); where none was (the client gave up on every one), the size the server's refusal
    named ("server refusal"), else the first copy's parts counted from its captured body by the
    served model's tokenizer ("request body": the template's few tokens per part left out)."""
    gen, tasks = _model_calls(out), tasks_table(out)
    task_evaluated = dict(zip(tasks["task"], tasks["evaluated_tokens"])) if "evaluated_tokens" in tasks else {}
    rows = []
    for task, c in gen.groupby("task", sort=False):
        copies = _first_copies(c)
        n = len(copies)
        size, source = _copy_size(out, copies)
        # copies that overlapped have no per-call count of their own: the task's counter holds them
        # all when the task is nothing but copies; else the per-call counts (NaN where one is missing)
        evaluated = (task_evaluated.get(task, float("nan")) if n == len(c) and copies["evaluated_tokens"].isna().any()
                     else copies["evaluated_tokens"].sum(min_count=len(copies)))
        rows.append({"task": task, "copies": n, "answered": int((copies["status"] == "ok").sum()),
                     "request_tokens": size, "size_from": source, "server_evaluated": evaluated,
                     "amplification": evaluated / size if size > 0 else float("nan"), "later_calls": len(c) - n})
    return pd.DataFrame(rows).set_index("task")


def _first_copies(calls: pd.DataFrame) -> pd.DataFrame:
    """A task's first call and the identical re-sends right after it (one request, sent again)."""
    n = 1
    while n < len(calls) and calls["first_diff"].iloc[n] == "identical":
        n += 1
    return calls.iloc[:n]


def _copy_size(out: str | Path, copies: pd.DataFrame) -> tuple[float, str | None]:
    """One copy's prompt tokens and where the number came from (see `amplification`)."""
    size = copies["prompt_tokens"].max()
    if pd.notna(size):
        return float(size), "server usage"
    refused = copies["error"].map(refused_size).max() if "error" in copies else float("nan")
    if pd.notna(refused):
        return float(refused), "server refusal"
    first = copies["request_id"].iloc[0] if "request_id" in copies else None
    body = [sum(p["tokens"] for p in a["parts"]) for a in anatomy(out) if a["request_id"] == first]
    return (float(body[0]), "request body") if body else (float("nan"), None)


def growing_session(size: str, turns: int, paste_words: int, env: dict[str, str], timeout_s: float,
                    last_words: int | None = None, **kw: Any) -> list[Task]:
    """One Claude Code session of `turns` tasks (`--continue`), each pasting `session_pastes`
    (the last `last_words` where given: `compaction_plan`'s outgrow): the history grows by one
    paste (and an answer) every turn; `kw`: Task fields (answer_stop)."""
    pastes = session_pastes(turns, paste_words, last_words)
    return [claude_task(f"turn {k}", f"Note {k}:\n{paste}\nSay OK.", size, env=env, timeout_s=timeout_s,
                        session="session", resume=k > 0, **kw) for k, paste in enumerate(pastes)]


@functools.lru_cache(maxsize=None)
def first_tokens_at(root: str | Path, size: str, main: str | Path, main_size: str, *, threads: int = 1,
                    model: str | None = None, timeout_s: float = 900) -> int:
    """Claude Code's first request (prompt tokens) at `size` with the billing header off, as the sessions
    run: B header off's first answered call in the `main` run if it ran at `size`, else one task at `size`
    sized by a fresh server's refusal (`first_request_tokens` at `SIZING_CTX`), once."""
    if size == main_size:
        calls = _model_calls(main)
        sized = calls.loc[(calls["task"] == "B header off") & (calls["status"] == "ok"), "prompt_tokens"].dropna()
        if len(sized):
            return int(sized.iloc[0])
    return int(first_request_tokens(root, SIZES[size]["claude-code"].get("tools"), size, threads=threads, model=model,
                                    timeout_s=timeout_s, name=f"first-{size}", env=HEADER_OFF))


def told_env(plan: dict[str, int]) -> dict[str, str]:
    """The setting that gives the pinned Claude Code the server's window (see `agents`)."""
    return {agents.CLAUDE_WINDOW_ENV: str(plan["window"])}


def doctor_on_fresh_server(ctx: int, capture: str | Path, *, threads: int = 1, model: str | None = None,
                           agent: str = "claude-code") -> str:
    """`doctor agent` against a new llama-server of `ctx` tokens (extended past the model's
    trained context), sized by the captured first request in `capture`: the checks and the
    settings it prints."""
    from infercourse.measure.workloads import DATA_DIR
    from infercourse.ops.agent_doctor import agent_shape, grade_agent_route, probe_agent_route, report
    from infercourse.ops.prefill_probe import forecast_against_capture
    from infercourse.servers import LlamaServer
    extra = ["--chat-template-file", str(DATA_DIR / "chatml_tools.jinja"), "--alias", "smollm2-135m",
             *extend_flags(ctx, model)]
    shape = agent_shape(agent, capture)
    with LlamaServer(model, n_parallel=1, ctx_size=ctx, threads=threads, jinja=True, extra_args=extra) as srv:
        ev = probe_agent_route(srv.url, agent)
        checks = grade_agent_route(ev, shape)
        lines = [f"doctor agent {srv.url} --agent {agent}   (llama-server -c {ctx}; first request "
                 f"{shape['prompt_tokens']} tokens, from this run's capture)"]
        return "\n".join(lines + [report(agent, srv.url, ev, shape, checks), *forecast_against_capture(ev, capture)])

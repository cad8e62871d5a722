"""Four failures local-agent users report, reproduced live (notebook 19, "Four failures, live"):
reasoning dropped from history here; many tools in `agent_failures_tools`; a quantized KV cache
and speculative decoding in `agent_failures_numerics`; their sentences in `agent_failures_claims`.

**Reasoning dropped from history.** A thinking model writes `<think>...</think>` before its
answer, and the client sends it back as `reasoning_content` (llama-server's OpenAI extension).
Several families' chat templates (Qwen3's shape) render that reasoning only for the assistant
turns *after the last user message*: within one task every call extends the last, but a new
user message re-renders every turn since the one before *without* its reasoning. The slot's
cached tokens (the prompt and what the model wrote) then differ from the new prompt at the first
such turn, and everything after it is prefilled again. `reasoning_replay` sends a thinking
agent's session through such a template (`data/chatml_think.jinja`, ours: its `reasoning_history`
kwarg picks which turns keep their reasoning) and, per call, finds the first token that differs
from what the slot held (`/apply-template` + `/tokenize`, `servers.llama_api`) beside the server's
own `cache_n` / `prompt_n`. The model's answer is written into the slot as it would have generated
it (the template's rendering of that turn with its reasoning, evaluated by `/completion`): a
135M model writes no reasoning of its own. The fixes are measured the same way: a template that
keeps the reasoning in every turn, and one that drops it from every turn (earlier turns then
never change; only the model's own last answer, which had it, is re-read without it). llama-server's
`--reasoning-preserve` sets `preserve_thinking` / `clear_thinking` for templates that read them;
a template that reads neither, like this Qwen3-shaped one, is not changed by it.
"""
from __future__ import annotations

import json
from typing import Any

import pandas as pd

from infercourse.core.errors import InferCourseError
from infercourse.measure.agent_workload import session_turns, static_block, tool_schemas
from infercourse.measure.workloads import DATA_DIR, common_prefix_len
from infercourse.servers import llama_api as api

__all__ = ["THINK_TEMPLATE", "HISTORY", "serve", "thinking_session", "reasoning_replay", "reasoning_table",
           "reasoning_row"]

THINK_TEMPLATE = DATA_DIR / "chatml_think.jinja"
# arm -> the template's `reasoning_history`: which assistant turns render their reasoning
HISTORY = {"Qwen3-style: dropped before the last user message": "after_last_user",
           "fix: kept in every turn": "all", "fix: dropped from every turn": "none"}
_FOLLOW_UPS = ("Good. Keep going with the next failure.", "Thanks. Carry on, and run the tests when you are done.",
               "Fine. Continue.", "OK, next step please.")


def serve(*, ctx: int = 8192, threads: int | None = None, model=None):
    """llama-server with the reasoning template, one slot (every call meets the slot's own
    cache) and no host prompt cache (`--cache-ram 0`: only the slot's prefix counts)."""
    from infercourse.servers import LlamaServer
    return LlamaServer(model, n_parallel=1, ctx_size=ctx, threads=threads, cache_ram_mib=0, jinja=True,
                       extra_args=["--chat-template-file", str(THINK_TEMPLATE)]).start()


def _render(url: str, messages: list, tools: list | None, mode: str) -> str:
    return api.apply_template(url, messages, tools, chat_template_kwargs={"reasoning_history": mode})


def thinking_session(user_turns: int = 3, steps: int = 2) -> dict[str, Any]:
    """A thinking coding agent's session (the recorded textstats bug hunt): `user_turns` user
    messages, each followed by `steps` tool calls and a short answer; every assistant turn
    carries its reasoning. Returns {"tools", "calls"}: each call is the messages sent and the
    assistant message the model answers with, and whether a user message or a tool result
    came last.

    Args:
        user_turns: user messages (the task, then follow-ups).
        steps: tool calls per user message (the recorded session's, in order).
    """
    turns = [t for t in session_turns() if t.tool is not None]
    if user_turns * steps > len(turns):
        raise ValueError(f"the recorded session has {len(turns)} tool calls, not {user_turns * steps}")
    task = json.loads((DATA_DIR / "agentic_plan.json").read_text())["task"]
    history = [{"role": "system", "content": static_block()[:1200]}]
    calls, k = [], 0
    for u in range(user_turns):
        history.append({"role": "user", "content": task if u == 0 else _FOLLOW_UPS[(u - 1) % len(_FOLLOW_UPS)]})
        for s in range(steps + 1):
            if s < steps:
                t = turns[k]
                args = json.dumps(t.args, ensure_ascii=False)
                answer = {"role": "assistant", "content": "", "reasoning_content":
                          f"{t.thought} So far I have made {k} tool calls for this task. Next I call {t.tool} with "
                          f"{args}: its result says whether my guess about the cause holds and what to change next.",
                          "tool_calls": [{"id": f"call_{k:04d}", "type": "function",
                                          "function": {"name": t.tool, "arguments": args}}]}
            else:
                answer = {"role": "assistant", "reasoning_content": "I have what this step needed; a short summary "
                          "for the user, then I wait for the next instruction.",
                          "content": "Done so far: " + " ".join(x.thought for x in turns[k - steps:k])}
            calls.append({"messages": list(history), "answer": answer,
                          "after": "user message" if history[-1]["role"] == "user" else "tool result"})
            history.append(answer)
            if s < steps:
                history.append({"role": "tool", "tool_call_id": f"call_{k:04d}", "content": turns[k].result})
                k += 1
    return {"tools": tool_schemas("openai", 5), "calls": calls}


def _written(url: str, messages: list, answer: dict, tools: list) -> str:
    """What a thinking model writes for `answer` after the generation prompt: the turn as the
    template renders it when it keeps reasoning ("all"), up to its end-of-turn token."""
    before = _render(url, messages, tools, "all")
    after = _render(url, [*messages, answer, {"role": "user", "content": "."}], tools, "all")
    if not after.startswith(before):
        raise InferCourseError("the template re-rendered earlier turns in 'all' mode: cannot isolate the answer")
    tail = after[len(before):]
    return tail[:tail.rindex("\n", 0, tail.rindex("<|im_start|>user"))]


def reasoning_replay(url: str, session: dict[str, Any], mode: str) -> pd.DataFrame:
    """The session's calls through `/v1/chat/completions` with `reasoning_history=mode`, each
    followed by the model's answer written into the slot; one row per call: prompt tokens, the
    tokens the slot held, the first token of the prompt that differs from them (`first_changed`,
    the message it falls in, the text there, held and new), the cache lost (held − first
    changed), and the server's own `cache_n`, `prompt_n` (tokens prefilled) and `prompt_ms`.

    Args:
        url: a server started with `serve()`.
        session: `thinking_session()`.
        mode: a value of `HISTORY`.
    """
    rows, held = [], None
    for i, call in enumerate(session["calls"]):
        text = _render(url, call["messages"], session["tools"], mode)
        prompt = api.tokenize(url, text)
        body = {"messages": call["messages"], "tools": session["tools"], "max_tokens": 1, "temperature": 0,
                "cache_prompt": True, "chat_template_kwargs": {"reasoning_history": mode}}
        t = api.post_json(url, "/v1/chat/completions", body)["timings"]
        row = {"call": i, "after": call["after"], "prompt_tokens": len(prompt), "held_tokens": None,
               "first_changed": None, "changed_in": None, "cache_lost": None, "cache_n": t.get("cache_n"),
               "prompt_n": t.get("prompt_n"), "prompt_ms": t.get("prompt_ms"), "held_text": None, "new_text": None}
        if held is not None:
            first = common_prefix_len(held, prompt)
            k = api.detokenize(url, prompt[:first]).count("<|im_start|>") - 1   # the turn it falls in (0: system)
            row.update(held_tokens=len(held), first_changed=first, cache_lost=len(held) - first)
            if first < len(held):   # where: the message, and the text either side from one token before it
                where = f"message {k} ({call['messages'][k]['role']})" if k < len(call["messages"]) else \
                    "the generation prompt"
                row.update(changed_in=where, held_text=api.detokenize(url, held[first - 1:first + 6]),
                           new_text=api.detokenize(url, prompt[first - 1:first + 6]))
        rows.append(row)
        held = api.tokenize(url, text + _written(url, call["messages"], call["answer"], session["tools"]))
        api.completion(url, held, n_predict=0, cache_prompt=True)   # the answer, in the slot
    return pd.DataFrame(rows)


def reasoning_table(runs: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per arm, over the calls after the first: the slot's cache lost after a user message and
    after a tool result (mean tokens per call), lost in all, tokens prefilled in all and against
    the first arm, the server's prompt time, and whether the server's `cache_n` equals the first
    changed token on every call (its count and the tokens' agree)."""
    out = []
    for name, df in runs.items():
        later = df[df["call"] > 0]
        by = later.groupby("after")["cache_lost"].mean()
        out.append({"history": name, "calls": len(later), "lost_per_user_message": by.get("user message"),
                    "lost_per_tool_result": by.get("tool result"), "cache_lost_total": int(later["cache_lost"].sum()),
                    "prefilled_total": int(later["prompt_n"].sum()), "prompt_ms_total": float(later["prompt_ms"].sum()),
                    "server_agrees": bool((later["cache_n"] == later["first_changed"]).all())})
    table = pd.DataFrame(out).set_index("history")
    table["prefilled_vs_first"] = table["prefilled_total"] / table["prefilled_total"].iloc[0]
    return table


def reasoning_row(server=None, *, threads: int | None = 1, user_turns: int = 2, steps: int = 1):
    """Notebook 18's "thinking model slow on every new message" row: the Qwen3-style arm and
    the kept-reasoning arm on a short session (its own server; the lab's is not used), as
    (layer or None, evidence, values). "model" (the chat template ships with the model) when
    only the Qwen3-style arm lost cache."""
    names = list(HISTORY)[:2]
    with serve(threads=threads) as srv:
        session = thinking_session(user_turns, steps)
        runs = {n: reasoning_replay(srv.url, session, HISTORY[n]) for n in names}
    t = reasoning_table(runs)
    bad, good = t.loc[names[0]], t.loc[names[1]]
    where = runs[names[0]]["changed_in"].dropna()
    evidence = (f"a new user message lost {bad['lost_per_user_message']:.0f} cached tokens through a Qwen3-style "
                f"template (first change in {where.iloc[0] if len(where) else 'no message'}), "
                f"{good['lost_per_user_message']:.0f} with reasoning kept in every turn; the server's cache_n "
                f"{'agrees' if t['server_agrees'].all() else 'disagrees'} with the first changed token")
    layer = "model" if bad["cache_lost_total"] > 0 and good["cache_lost_total"] == 0 else None
    return layer, evidence, {"table": t.reset_index().to_dict("records")}

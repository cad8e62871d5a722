"""A growing session read back from its calls: did the agent compact? (notebook 20)

A session only appends: each call re-sends the one before it and adds a turn, so its first
message stays and its messages grow. A compaction is a model call that summarises the
history, after which the next call starts from the summary: its first message is replaced
and its messages shrink. That is read here from the request's *structure*, never its text
(the bodies are the vendor's prompt text): the anatomy's tokens per part and the first part
that differs from the call before (`ops.agent_anatomy`), with the server's usage and its
refusals (`ops.agent_lab.refused_size`), and what the agent's own output said per turn.

`session_view(out)` is one row per call of a lab run's growing session (and one per turn
that sent none); `real_agent_claims.compaction_sentence` words two of them.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from infercourse.ops.agent_lab import anatomy, calls_table, refused_size, tasks_table

__all__ = ["KEPT_SHARE", "session_view"]

KEPT_SHARE = 0.5   # a first message that keeps less of the one before than this was replaced, not grown



def _rewrites(gen: pd.DataFrame, out: str | Path) -> pd.DataFrame:
    """Mark the calls that rewrote the history. A session only appends, so its first message
    stays; a compaction replaces it (with the summary) and the messages hold fewer tokens than
    the call before's. So: the first difference is system 0 (the billing header's suffix
    follows the first message) or in message 0, keeping less than `KEPT_SHARE` of the first
    message before it, and the messages shrink. A summary request that edits or drops only
    later messages keeps the first one, and is not a rewrite."""
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
    gen["prompt_tokens"] = gen["prompt_tokens"].fillna(gen["error"].map(refused_size))
    gen = _rewrites(gen, out)
    gen["refused_by"] = gen["error"].fillna("").str.contains("exceeds the available context").map(
        {True: "server", False: None})
    rows = []
    for _, t in tasks.iterrows():
        windows, sources = t.get("assumed_context_window"), t.get("query_sources")
        turn = {"turn": t["task"], "ended": {0: "ok", "timeout": "timeout"}.get(t["exit"], "error"),
                "agent_said": t.get("agent_said"),
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

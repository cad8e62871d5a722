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

`replay_session` sends a captured session's own request bodies again, in order, to a fresh
server of another model (each asking for one token): what that server re-evaluates at each
call, read from its per-request timings. On a sliding-window model (Gemma 3, 512-token
window) a prompt that changes *inside* the history, past the window, is evaluated whole
again unless the server keeps the full cache (`--swa-full`); a full-attention model re-reads
only what follows the change. `session_calls` reads the same columns from the session's own
server (its model need not be replayed: the session already sent those requests to it).
`rewrite_table` sets the families and settings side by side, one row per rewrite of the
history. The bodies never leave the results folder; only the counts are shown.

`prefill_ledger(root)` counts what a notebook's lab runs paid in prefill, run by run: the
calls that made the server evaluate a thousand tokens or more (a cold start, a busted prefix,
a rewrite) against the rest, the tokens the server evaluated and each run's wall time:
on a small CPU a real agent's first request is tens of seconds of prefill, so that count is
the notebook's pace.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pandas as pd

from infercourse.ops.agent_stream import usage_tokens
from infercourse.ops.agent_lab import anatomy, calls_table, refused_size, tasks_table
from infercourse.ops.anthropic_probe import post_messages

__all__ = ["KEPT_SHARE", "session_view", "session_calls", "replay_session", "rewrite_table", "prefill_ledger"]

KEPT_SHARE = 0.5   # messages that keep less of the call before's than this were replaced (a compaction), not grown



def _rewrites(gen: pd.DataFrame, out: str | Path) -> pd.DataFrame:
    """Mark the calls that rewrote the history. A session only appends; a compaction replaces the
    history with a summary, so the messages hold fewer tokens than the call before's and little of
    them comes before the first difference. So: the messages shrink, and the message tokens kept
    before the first difference are under `KEPT_SHARE` of the call before's. The difference may sit
    at system 0 (the billing header's suffix follows the first message), in message 0 (a new
    summary), or further down: a summary that came back word for word as the last one (greedy
    answers) keeps the first message, and only what follows it changes. A summary request that
    drops the newest turn keeps most of the history before it, and is not a rewrite; so "kept" is
    judged against the call before's messages less its last one (a long paste refused for size is
    most of its messages). A call that starts from a summary *and* adds a long paste holds more
    message tokens than the summary request before it: a difference inside the messages with
    little kept before it is a rewrite too; at system 0 (the header) it needs the shrink."""
    shape = {}
    for a in anatomy(out):
        kinds = [p["kind"] for p in a["parts"]]
        first = kinds.index("message") if "message" in kinds else len(kinds)
        msgs = [p["tokens"] for p in a["parts"][first:] if p["kind"] == "message"]
        shape[a["request_id"]] = (sum(p["tokens"] for p in a["parts"][:first]),
                                  sum(p["tokens"] for p in a["parts"][first:]), msgs[-1] if len(msgs) > 1 else 0)
    s = gen["request_id"].map(shape)
    at = lambda k: s.map(lambda x: x[k] if isinstance(x, tuple) else float("nan"))   # noqa: E731
    before_msgs, gen["message_tokens"] = at(0), at(1)
    kept = (gen.get("tokens_before_diff", pd.Series(float("nan"), index=gen.index)) - before_msgs).clip(lower=0)
    previous, history = gen["message_tokens"].shift(), (at(1) - at(2)).shift()
    in_messages = gen.get("first_diff", pd.Series("", index=gen.index)).fillna("").astype(str).str.startswith("message")
    gen["rewrote_history"] = ((gen["message_tokens"] < previous) | in_messages) & (kept < KEPT_SHARE * history)
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


def _replayed(out: str | Path, max_calls: int | None, through_rewrites: int | None) -> pd.DataFrame:
    """The session's calls that asked for an answer (not count_tokens), in order, marked where
    they rewrote the history; the first `max_calls`, through the `through_rewrites`-th rewrite."""
    calls = calls_table(out)
    answer = (calls["api"] == "anthropic") & (calls["path"].str.split("?").str[0] == "/v1/messages")
    gen = _rewrites(calls[answer].copy(), out)
    gen = gen.head(max_calls) if max_calls else gen
    if through_rewrites and gen["rewrote_history"].sum() >= through_rewrites:
        gen = gen.iloc[:int(gen["rewrote_history"].cumsum().searchsorted(through_rewrites)) + 1]
    return gen


def session_calls(out: str | Path, *, max_calls: int | None = None, through_rewrites: int | None = None) -> pd.DataFrame:
    """`replay_session`'s columns read from the session's own server: the calls it answered
    (the same selection), the prompt tokens it reused and evaluated (its own usage), and the
    time to the first token (`seconds`: the prefill, nearly all of it). No replay is needed for
    the model the session ran on; a call that failed (refused for size, or cut by the client) has no
    usage (status 400)."""
    gen = _replayed(out, max_calls, through_rewrites)
    ok = gen["status"] == "ok"
    return pd.DataFrame({"request_id": gen["request_id"], "task": gen["task"],
                         "rewrote_history": gen["rewrote_history"].astype(bool), "status": ok.map({True: 200, False: 400}),
                         "prompt_tokens": gen["prompt_tokens"].where(ok), "reused": gen["cached_tokens"].where(ok),
                         "evaluated": gen["evaluated_tokens"].where(ok), "seconds": gen["ttft_s"].where(ok)}
                        ).reset_index(drop=True)


def replay_session(out: str | Path, *, model: str | Path | None = None, ctx: int = 8192, threads: int | None = 1,
                   swa_full: bool = False, template: str | Path | None = None, max_calls: int | None = None,
                   through_rewrites: int | None = None, server_args: list[str] | tuple[str, ...] = (),
                   timeout_s: float = 1800.0) -> pd.DataFrame:
    """The captured session's /v1/messages bodies sent again in order (max_tokens 1, not
    streamed) to one fresh llama-server (one slot, no host prompt cache) of `model`; per call:
    prompt tokens, tokens reused and evaluated (the server's own usage), the call's seconds,
    and whether the call rewrote the history (as `session_view` judges it).

    Args:
        out: a lab run's folder (its calls, anatomy and bodies).
        model: the GGUF to serve (None: the embedded model); ctx: its window; threads: -t.
        swa_full: llama-server --swa-full (a sliding-window model keeps its whole cache).
        template: a chat template file (None: the model's own).
        max_calls: replay only the first this many calls (a long session on a slow machine).
        through_rewrites: stop after the call that is this many-th rewrite of the history (the
            calls after it only repeat what the replay has shown, each at a prefill's price).
        server_args: more llama-server flags (the YaRN flags where `ctx` passes the trained context).
    """
    from infercourse.servers import LlamaServer
    gen = _replayed(out, max_calls, through_rewrites)
    extra = (["--swa-full"] if swa_full else []) + (["--chat-template-file", str(template)] if template else []) \
        + list(server_args)
    rows: list[dict[str, Any]] = []
    with LlamaServer(model, n_parallel=1, ctx_size=ctx, threads=threads, jinja=True, cache_ram_mib=0,
                     extra_args=extra) as srv:
        for r in gen.itertuples():
            path = Path(out) / "bodies" / f"{r.request_id:03d}.json"
            if not path.exists():
                continue
            body = {**json.loads(path.read_text()), "max_tokens": 1, "stream": False}
            t0 = time.perf_counter()
            status, doc = post_messages(srv.url, body, timeout_s)
            wall = time.perf_counter() - t0           # one output token: the prefill, nearly all of it
            u = usage_tokens(doc.get("usage") or {}) if status == 200 else {}
            prompt, reused = u.get("prompt_tokens"), u.get("cached_tokens") or 0
            rows.append({"request_id": r.request_id, "task": r.task, "rewrote_history": bool(r.rewrote_history),
                         "status": status, "prompt_tokens": prompt, "reused": reused if prompt else None,
                         "evaluated": prompt - reused if prompt else None, "seconds": wall})
    return pd.DataFrame(rows)


def rewrite_table(replays: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per replay (family and setting) and rewrite of the history (1, 2...: the calls
    that rewrote it, in order): that call's turn, prompt tokens, tokens reused from the cache and
    evaluated again, and the share reused; `calls` and `seconds_total` are the replay's own (its
    calls answered, their seconds in all). A replay with no rewrite has one row, rewrite 0."""
    rows = []
    for label, df in replays.items():
        ok = df[df["status"] == 200]
        whole = {"calls": len(ok), "seconds_total": ok["seconds"].sum()}
        rw = ok[ok["rewrote_history"]]
        if not len(rw):
            rows.append({"replay": label, "rewrite": 0, **whole})
        for k, r in enumerate(rw.itertuples(), 1):
            rows.append({"replay": label, "rewrite": k, "turn": r.task, "prompt_tokens": r.prompt_tokens,
                         "reused": r.reused, "evaluated": r.evaluated, "reused_share": r.reused / r.prompt_tokens, **whole})
    return pd.DataFrame(rows).set_index(["replay", "rewrite"])


def _numbers(table: pd.DataFrame, column: str) -> pd.Series:
    """`table[column]` as numbers; an empty series where a run has no such column (no calls yet)."""
    return pd.to_numeric(table[column], errors="coerce") if column in table else pd.Series(dtype=float)


def prefill_ledger(root: str | Path, least: int = 1000) -> pd.DataFrame:
    """One row per lab run under `root` (a notebook's results folder), in the order they ran:
    model calls, the calls that made the server evaluate at least `least` prompt tokens
    (`big_prefills`), the prompt tokens all calls made it evaluate (its own count) and the run's
    wall time (its tasks'). A call the client gave up on has no count of its own (the server never
    answered it) while the server prefilled it: what a task's `/metrics` counter holds beyond its
    calls' counts is that prefill, added to the total and, at `least` or more, counted as one more
    big prefill. The fresh servers of the doctors and of `replay_session` hold no lab capture and
    are not in it."""
    from infercourse.ops.agent_stream import GENERATING_APIS
    rows = []
    for d in (m.parent for m in sorted(Path(root).glob("*/manifest.json"), key=lambda m: m.stat().st_mtime)):
        calls, tasks = calls_table(d), tasks_table(d)
        gen = calls[calls["api"].isin(GENERATING_APIS)] if "api" in calls else calls.iloc[:0]
        ev = _numbers(gen, "evaluated_tokens")
        gap = pd.Series(dtype=float)
        if "task" in gen and "evaluated_tokens" in tasks:      # the tasks' counters beyond their calls' counts
            counter = pd.to_numeric(tasks.set_index("task")["evaluated_tokens"], errors="coerce")
            gap = (counter - ev.groupby(gen["task"]).sum().reindex(counter.index).fillna(0)).clip(lower=0)
        rows.append({"run": d.name, "model_calls": len(gen), "big_prefills": int((ev >= least).sum() + (gap >= least).sum()),
                     "evaluated_tokens": pd.concat([ev, gap]).sum(min_count=1),
                     "wall_s": _numbers(tasks, "wall_s").sum(min_count=1)})
    return pd.DataFrame(rows, columns=["run", "model_calls", "big_prefills", "evaluated_tokens", "wall_s"]).set_index("run")

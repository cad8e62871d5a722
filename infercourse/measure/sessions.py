"""Many agents on one server: N live sessions at once, each one growing conversation.

A coding agent's session is one conversation that grows by a turn per model call, and the
server keeps its prefix in a slot's KV cache (and, with `--cache-ram`, in host RAM), so
each call should pay only for its new tokens. Put N agents on one box and the sessions
compete for K slots: while N <= K each keeps its slot and its cache; past that, a session
that comes back after its tool ran finds its slot taken by another session's prefix,
its cached tokens fall to nothing and its TTFT becomes a whole prefill. That knee is what
`run_sessions` and `sweep_sessions` measure.

How a session runs here:
- each session gets its own salt at the very start of its system prompt, so prefixes are
  shared within a session and never between two (nor with an earlier run);
- the model's own reply is carried forward into the next turn's context (`replay="live"`,
  as a real agent does), or the recorded reply is (`replay="exact"`: every run sends the
  same tokens); tool calls and tool results are the recorded ones in both modes;
- between turns the session "runs its tool": it waits the recorded tool latency
  (`think_scale` scales it), and the next turn is scheduled at the end of that wait, so
  latency counts from when the agent was ready, not from when the server got to it;
- a session stops at its first failed turn (an agent would retry or give up; we count it).

Every turn is one `RequestTrace` tagged `session`, `turn` and `n_sessions`, written as bench
writes its runs (a results folder with its manifest and the server's own samples);
`by_turn`, `by_session` and `sessions_summary` are pure functions over that frame.
Cached tokens come from the server's usage block (`prompt_tokens_details.cached_tokens`),
which tests check against llama-server's own `/metrics` counters.
"""
from __future__ import annotations

import asyncio
import datetime as _dt
import json
import time
import warnings
from dataclasses import dataclass, replace
from itertools import accumulate
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from infercourse.core.types import Request
from infercourse.measure.bench import BenchResult, new_salt, server_sampler, warmup_request
from infercourse.measure.loadgen import State, loop_in_thread, send_one, server_address
from infercourse.measure.server_samples import sampled_summary

__all__ = ["SessionTurn", "SessionScript", "agentic_script", "script_from_workload", "salted_script",
           "run_sessions", "sweep_sessions", "by_turn", "by_session", "sessions_summary", "REPLAY"]

REPLAY = ("live", "exact")
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass(frozen=True)
class SessionTurn:
    """One model call of a session.

    Args:
        added: messages appended to the context before this call (the first turn's hold
            the system prompt and the task; later ones the tool result).
        reply: the recorded assistant message after this call (carried forward in exact
            replay; its text is replaced by the model's in live replay).
        max_tokens: output cap of this call.
        think_s: the tool's latency after this call, before the next one.
    """

    added: tuple[dict, ...]
    reply: dict | None
    max_tokens: int
    think_s: float = 0.0


@dataclass(frozen=True)
class SessionScript:
    """A session to replay: its turns, and the tool schemas its requests carry (if any)."""

    name: str
    turns: tuple[SessionTurn, ...]
    tools: tuple[dict, ...] | None = None


def script_from_workload(workload, think_s: Sequence[float] = ()) -> SessionScript:
    """A session from a cumulative workload (request i+1 = request i + reply + tool result),
    such as `agent_workload.coding_agent_session(...)` or `workloads.agentic_workload()`."""
    reqs, turns = list(workload.requests), []
    for i, r in enumerate(reqs):
        prev = reqs[i - 1].messages if i else []
        nxt = reqs[i + 1].messages if i + 1 < len(reqs) else None
        added = r.messages[len(prev) + (1 if i else 0):]   # after the previous call's reply
        reply = nxt[len(r.messages)] if nxt is not None else None
        turns.append(SessionTurn(tuple(added), reply, r.max_tokens, float(think_s[i]) if i < len(think_s) else 0.0))
    tools = tuple(reqs[0].tools) if getattr(reqs[0], "tools", None) else None
    return SessionScript(workload.name, tuple(turns), tools)


def agentic_script(kind: str = "agentic", n_turns: int | None = None, **kw: Any) -> SessionScript:
    """The session the course replays, with think times from its recorded tool latencies.

    Args:
        kind: "agentic" (data/agentic_session.json: tool calls as text, any server) or
            "coding-agent" (`agent_workload.coding_agent_session(api="openai")`: real tool
            schemas and `tool_calls`; llama-server needs `--jinja`).
        n_turns: keep the first n turns (None: all).
        kw: passed to `coding_agent_session` (profile, header...).
    """
    from infercourse.measure.workloads import DATA_DIR, agentic_workload
    calls = json.loads((DATA_DIR / "agentic_session.json").read_text())["calls"]
    if kind == "coding-agent":
        from infercourse.measure.agent_workload import coding_agent_session
        wl = coding_agent_session(api="openai", n_calls=n_turns, **kw)
    elif kind == "agentic":
        wl = agentic_workload()
    else:
        raise ValueError(f"unknown session kind {kind!r}: use agentic or coding-agent")
    script = script_from_workload(wl, [c["tool_latency_s"] for c in calls])
    return replace(script, turns=script.turns[:n_turns]) if n_turns else script


def salted_script(script: SessionScript, salt: str) -> SessionScript:
    """`script` with `salt` on the first line of its first message: no other session's
    (or run's) prefix can match it."""
    first, *rest = script.turns
    msg, *more = first.added
    content = msg["content"]
    content = f"Session {salt}\n{content}" if isinstance(content, str) else \
        [{"type": "text", "text": f"Session {salt}\n"}, *content]
    return replace(script, turns=(replace(first, added=({**msg, "content": content}, *more)), *rest))


def _carried(reply: dict | None, text: str | None) -> dict:
    """The assistant message carried into the next turn: the recorded one (exact replay,
    or no reply text), or the recorded one with the model's text in place of its words."""
    if reply is None:
        return {"role": "assistant", "content": text or ""}
    if text is None:
        return reply
    if isinstance(reply.get("content"), list):   # Anthropic blocks: replace the text block
        return {**reply, "content": [{**b, "text": text} if b.get("type") == "text" else b
                                     for b in reply["content"]]}
    return {**reply, "content": text}


class _SessionState(State):
    """bench's State, remembering each finished turn by request id (its reply is needed)."""

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.by_id: dict[int, Any] = {}

    def done(self, tr) -> None:
        super().done(tr)
        self.by_id[tr.request_id] = tr


async def _sessions(engine, scripts, n_turns, replay, think_scale, stagger_s, deadline_s, seed, warm,
                    st, addr):
    client = engine.async_client(len(scripts))
    async with client:
        for w in warm:
            async for _ in engine.astream(w, client=client):
                pass
        t0 = st.start()
        # request ids: session k's turns follow every turn of sessions 0..k-1 (scripts differ in length)
        first_ids = list(accumulate((len(s.turns[:n_turns]) for s in scripts), initial=0))

        async def session(k: int, script: SessionScript, first_id: int):
            ctx: list[dict] = []
            sched = t0 + k * stagger_s
            await asyncio.sleep(max(0.0, sched - time.perf_counter()))
            for t, turn in enumerate(script.turns[:n_turns]):
                if st.stop_reason or (deadline_s and time.perf_counter() - t0 > deadline_s):
                    return
                ctx += list(turn.added)
                req = Request(messages=list(ctx), max_tokens=turn.max_tokens, seed=seed,
                              tools=list(script.tools) if script.tools else None)
                rid = first_id + t
                await send_one(engine, client, rid, req, sched, st, addr,
                               {"session": k, "turn": t, "n_sessions": len(scripts), "replay": replay})
                tr = st.by_id[rid]
                if tr.status != "ok":
                    return                                  # the agent lost this turn: it stops
                ctx.append(_carried(turn.reply, tr.text if replay == "live" else None))
                await asyncio.sleep(turn.think_s * think_scale)   # the tool runs
                sched = time.perf_counter()                 # the agent is ready: the next call is due
        tasks = [asyncio.create_task(session(k, s, first_ids[k])) for k, s in enumerate(scripts)]
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            st.stop_reason = "interrupted"
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def run_sessions(engine, script: SessionScript | Sequence[SessionScript], n_sessions: int, *,
                 n_turns: int | None = None, replay: str = "live", think_scale: float = 1.0,
                 max_tokens: int | None = None,
                 stagger_s: float = 0.0, seed: int = 0, warmup: int = 1,
                 max_duration_s: float | None = None, out_dir: str | Path | None = None,
                 label: str | None = None, progress: bool = True, allow_remote: bool = False,
                 conditions: Mapping[str, Any] | None = None, sample_s: float | None = 1.0) -> BenchResult:
    """Run `n_sessions` live sessions at once against an HTTP engine; one row per turn.

    Args:
        script: the session (or several, used in turn), e.g. `agentic_script()`.
        n_sessions: sessions running concurrently, each salted apart.
        n_turns: turns per session (None: the whole script).
        replay: "live" (carry the model's reply forward) or "exact" (the recorded one).
        think_scale: multiplies the recorded tool latencies (0: no think time).
        max_tokens: caps every turn's output (None: each turn's own cap).
        stagger_s: session k starts k * stagger_s after the first.
        warmup: warm-up requests (no shared prefix with any session), excluded.
        max_duration_s: no new turn starts after this.
        sample_s: server sampling interval (None: off).
    """
    from infercourse.core import metrics, summary
    from infercourse.core.errors import APILayerError
    from infercourse.measure.results import RunWriter
    from infercourse.models.embedded import cache_dir
    from tqdm.auto import tqdm

    if replay not in REPLAY:
        raise ValueError(f"replay must be one of {REPLAY}, got {replay!r}")
    if n_sessions < 1:
        raise ValueError("n_sessions must be >= 1")
    if not hasattr(engine, "astream"):
        raise APILayerError("sessions run concurrently: they need an HTTP engine (a server)",
                            hint="start one with servers.LlamaServer and use OpenAIHTTPEngine(srv.url)")
    addr = server_address(engine)
    if addr and addr[0] not in _LOOPBACK and not allow_remote:
        raise APILayerError(f"bench targets loopback servers only, got {addr[0]}:{addr[1]}",
                            hint="pass allow_remote=True if you own that server and mean to load it")
    base = [script] if isinstance(script, SessionScript) else list(script)
    run_salt = new_salt()
    if max_tokens:
        base = [replace(b, turns=tuple(replace(t, max_tokens=min(t.max_tokens, max_tokens)) for t in b.turns))
                for b in base]
    scripts = [salted_script(base[k % len(base)], f"{run_salt}-{k}") for k in range(n_sessions)]
    turns = n_turns   # None: every session runs all its turns
    # warm-up: the task message alone, words reversed (short, and no session's prefix)
    task = [m for m in scripts[0].turns[0].added if m["role"] == "user" and isinstance(m["content"], str)]
    warm = [warmup_request(Request(messages=task[-1:] or [{"role": "user", "content": "Warm up now."}],
                                   max_tokens=4), i) for i in range(warmup)]
    load = {"pattern": "sessions", "n_sessions": n_sessions, "n_turns": turns, "replay": replay,
            "think_scale": think_scale, "max_tokens": max_tokens, "stagger_s": stagger_s, "seed": seed, "warmup": warmup,
            "max_duration_s": max_duration_s, "max_in_flight": n_sessions, "executor": "asyncio+httpx"}
    manifest = {"label": label, "engine": engine.describe(), "model": engine.model,
                "sampling": Request(prompt="", seed=seed).sampling(), "load": load,
                "workload": {"name": base[0].name, "sessions": "salted apart", "salt": run_salt},
                **(conditions or {})}
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    out = Path(out_dir) if out_dir else cache_dir() / "runs" / f"{stamp}_{label or 'sessions'}"
    writer = RunWriter(out, manifest)
    pbar = tqdm(total=sum(len(s.turns[:turns]) for s in scripts), desc=label or "sessions", disable=not progress, leave=False)
    writer.start_thread(on_written=pbar.update)
    st = _SessionState(writer, pbar)
    sampler = server_sampler(engine, out, sample_s)
    st.on_start = (lambda: sampler.start(first_sample=True)) if sampler else None   # after warm-up
    status = "ok"
    try:
        if loop_in_thread(lambda: _sessions(engine, scripts, turns, replay, think_scale, stagger_s,
                                             max_duration_s, seed, warm, st, addr)):
            st.stop_reason = "interrupted"
    except BaseException as e:
        status = f"error: {type(e).__name__}: {e}"
        raise
    finally:
        df = metrics.per_request_frame(st.traces)
        if sampler:
            sampler.stop(final_sample=True)
            writer.manifest["server_samples"] = sampled_summary(sampler.rows)
        writer.manifest.update(sessions=sessions_summary(df) if len(df) else {}, stopped=st.stop_reason,
                               warnings=[f"run stopped early: {st.stop_reason}"] if st.stop_reason else [])
        writer.close(status)
        pbar.close()
    return BenchResult(st.traces, df, summary.summarize(df) if len(df) else df, writer.manifest, out)


def sweep_sessions(engine, script, counts: Sequence[int] = (1, 2, 4, 8), *, slos: Mapping[str, float] | None = None,
                   out_dir: str | Path | None = None, **kw: Any) -> tuple[pd.DataFrame, list[BenchResult]]:
    """One `run_sessions` per session count: the table of `sessions_summary` rows, indexed
    by n_sessions, and the runs. The knee is where cache hits fall and TTFT climbs.

    Args:
        counts: session counts, low to high; slos: goodput targets, e.g. {"ttft_s": 2.0}.
        out_dir: parent folder; each count writes `n<count>/` under it.
        kw: passed to `run_sessions`.
    """
    rows, runs, label = [], [], kw.pop("label", None) or "sessions"
    for n in counts:
        r = run_sessions(engine, script, n, out_dir=Path(out_dir) / f"n{n}" if out_dir else None,
                         label=f"{label}-n{n}", **kw)
        rows.append(sessions_summary(r.df, slos))
        runs.append(r)
    return pd.DataFrame(rows).set_index("n_sessions"), runs


def _hit_rate(df: pd.DataFrame) -> float:
    prompt = df["prompt_tokens"].sum()
    return float(df["cached_tokens"].fillna(0).sum() / prompt) if prompt else float("nan")


def _agg(g: pd.DataFrame) -> pd.Series:
    # a p95 is NaN under the 72 samples its interval needs (summary.min_n): of 16 it is their max
    from infercourse.core.summary import min_n
    ok = g[g["status"] == "ok"]
    x = ok["ttft_s"].dropna()
    return pd.Series({"n": len(g), "n_ok": len(ok), "cache_hit_rate": _hit_rate(ok),
                      "prompt_tokens": float(ok["prompt_tokens"].mean()) if len(ok) else float("nan"),
                      "ttft_p50_s": float(np.median(x)) if len(x) else float("nan"),
                      "ttft_p95_s": float(np.percentile(x, 95)) if len(x) >= min_n(0.95) else float("nan")})


def by_turn(df: pd.DataFrame) -> pd.DataFrame:
    """Per turn index over all sessions: requests, cache hit rate (cached / prompt tokens
    of ok turns), mean prompt tokens, TTFT p50 and p95 (NaN under 72 turns)."""
    return df.groupby("turn").apply(_agg, include_groups=False)


def by_session(df: pd.DataFrame) -> pd.DataFrame:
    """Per session: turns sent and ok, cache hit rate, TTFT p50 and p95."""
    return df.groupby("session").apply(_agg, include_groups=False)


def sessions_summary(df: pd.DataFrame, slos: Mapping[str, float] | None = None) -> dict[str, Any]:
    """One run of N sessions in a row: sessions, turns ok / failed, sessions that finished
    every turn they started without a failure, cache hit rate over all turns and over
    turns after the first (the first can never hit: the salt), TTFT p50/p95, goodput (all
    turns, and turns after the first plus every failed turn: 0 when none succeeded; NaN only
    when no turn after the first was planned and none failed) and the turns it judged."""
    from infercourse.core.summary import goodput, throughput
    ok = df[df["status"] == "ok"]
    lost = df.loc[df["status"] != "ok", "session"].nunique()
    later = ok[ok["turn"] > 0]
    out = {"n_sessions": int(df["n_sessions"].iloc[0]) if len(df) else 0, "turns": len(df), "turns_ok": len(ok),
           "sessions_lost": int(lost), "cache_hit_rate": _hit_rate(ok), "cache_hit_rate_later": _hit_rate(later),
           **{k: v for k, v in _agg(df).items() if k.startswith("ttft")},
           "turns_per_s": throughput(df)["requests_per_s"] if len(df) else float("nan")}
    if slos:   # and over later turns: an agent's steady state, once its prefix is cached
        # A failed turn counts wherever it fell: only a first turn's slowness is excused (a cold
        # prefill), never its failure, and a session lost at its first turn sent no later one.
        steady = df[(df["turn"] > 0) | (df["status"] != "ok")]
        with warnings.catch_warnings():   # "no request met the SLO" is this row's 0, not news
            warnings.simplefilter("ignore")
            out["good_fraction"] = goodput(df, slos)["good_fraction"]
            out["good_fraction_later"] = goodput(steady, slos)["good_fraction"] if len(steady) else float("nan")
        out["turns_judged_later"] = len(steady)   # what good_fraction_later is a share of
    return out

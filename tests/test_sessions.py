"""N concurrent agent sessions: salting, carry-forward, think time, traces and the cache
accounting, first on a scripted in-memory engine (exact), then against a real llama-server
whose own /metrics counters must agree with the cached tokens the sessions report."""
import asyncio
import time

import httpx
import numpy as np
import pytest

from infercourse.core.types import Event, Usage
from infercourse.measure import sessions as ss


class ScriptedEngine:
    """An async engine that answers each request with a reply naming its call, records
    every request it got, and counts as cached the prompt it saw before in this session
    (by salt): exact numbers for the bookkeeping tests. No timing of its own beyond `delay_s`."""

    name = "scripted"
    root = None   # no server to sample
    model = "scripted"

    def __init__(self, delay_s: float = 0.0, fail_at: tuple[int, int] | None = None):
        self.got, self.delay_s, self.fail_at, self.seen = [], delay_s, fail_at, {}

    def async_client(self, n):
        return httpx.AsyncClient()

    def describe(self):
        return {"engine": self.name}

    async def astream(self, req, client=None):
        first = req.messages[0]["content"]
        session = first.split("\n", 1)[0]
        self.got.append((time.perf_counter(), session, req))
        text = "".join(str(m["content"]) for m in req.messages)
        prev = self.seen.get(session, "")
        cached = len(prev) if text.startswith(prev) else 0
        self.seen[session] = text
        await asyncio.sleep(self.delay_s)
        turn = sum(1 for _, s, _ in self.got if s == session) - 1
        if self.fail_at == (session, turn):
            raise RuntimeError("scripted failure")
        reply = f"reply {turn} of {session}"
        yield Event(t=time.perf_counter(), text=reply, n_tokens=3)
        yield Event(t=time.perf_counter(), done=True, finish_reason="stop",
                    usage=Usage(len(text), 3, cached, "server"))


def _script(n_turns=3, think_s=0.05):
    turns = [ss.SessionTurn(({"role": "system", "content": "You are terse."}, {"role": "user", "content": "task"}),
                            {"role": "assistant", "content": "recorded 0"}, 4, think_s)]
    for t in range(1, n_turns):
        turns.append(ss.SessionTurn(({"role": "user", "content": f"tool result {t}"},),
                                    {"role": "assistant", "content": f"recorded {t}"}, 4, think_s))
    return ss.SessionScript("toy", tuple(turns))


def test_salted_apart_and_carried_forward(tmp_path):
    eng = ScriptedEngine()
    r = ss.run_sessions(eng, _script(), 3, replay="live", warmup=0, out_dir=tmp_path / "r", progress=False)
    assert len(r.df) == 9 and (r.df["status"] == "ok").all()
    assert sorted(r.df.groupby("session")["turn"].apply(list).tolist()) == [[0, 1, 2]] * 3
    firsts = {req.messages[0]["content"].split("\n")[0] for _, _, req in eng.got}
    assert len(firsts) == 3                      # one salt per session: no shared prefix between two
    for _, s, req in eng.got:                    # live: the model's own replies are in the context
        replies = [m["content"] for m in req.messages if m["role"] == "assistant"]
        assert replies == [f"reply {k} of {s}" for k in range(len(replies))]
    # every later turn extends the previous one: the scripted cache counts it all as cached
    later = r.df[r.df["turn"] > 0]
    assert (later["cached_tokens"] > 0).all()
    assert (r.df.loc[r.df["turn"] == 0, "cached_tokens"] == 0).all()
    bt = ss.by_turn(r.df)
    assert bt.loc[0, "cache_hit_rate"] == 0 and bt.loc[2, "cache_hit_rate"] > bt.loc[1, "cache_hit_rate"] > 0
    assert set(ss.by_session(r.df).index) == {0, 1, 2}
    assert (tmp_path / "r" / "requests.jsonl").read_text().count("\n") == 9


def test_exact_replay_carries_the_recorded_replies(tmp_path):
    eng = ScriptedEngine()
    ss.run_sessions(eng, _script(), 1, replay="exact", warmup=0, out_dir=tmp_path / "r", progress=False)
    last = eng.got[-1][2]
    assert [m["content"] for m in last.messages if m["role"] == "assistant"] == ["recorded 0", "recorded 1"]


def test_think_time_separates_a_sessions_turns(tmp_path):
    """Turn t+1 is sent no earlier than turn t ended plus its think time; and latency is
    measured from when the agent was ready (scheduled), not from when the turn went out."""
    eng = ScriptedEngine()
    r = ss.run_sessions(eng, _script(think_s=0.2), 1, warmup=0, out_dir=tmp_path / "r", progress=False)
    df = r.df.sort_values("turn")
    gaps = df["sent_t"].to_numpy()[1:] - df["end_t"].to_numpy()[:-1]
    assert (gaps >= 0.2).all(), gaps
    assert (df["scheduled_t"].to_numpy()[1:] >= df["end_t"].to_numpy()[:-1] + 0.2).all()


def test_a_failed_turn_ends_its_session_only(tmp_path):
    script = _script()
    eng2 = ScriptedEngine()
    orig = eng2.astream

    async def failing(req, client=None):   # the second session's second turn fails
        if "-1\n" in req.messages[0]["content"] and len(req.messages) > 3:
            raise RuntimeError("replica gone")
        async for ev in orig(req, client):
            yield ev
    eng2.astream = failing
    r = ss.run_sessions(eng2, script, 2, warmup=0, out_dir=tmp_path / "b", progress=False)
    s = ss.sessions_summary(r.df)
    assert s["sessions_lost"] == 1 and s["turns"] == 3 + 2 and s["turns_ok"] == 3 + 1
    assert r.df.loc[r.df["session"] == 0, "status"].eq("ok").all()


def test_request_ids_are_unique_when_scripts_differ_in_length(tmp_path):
    """Sessions drawn from a three-turn and a one-turn script, in turn: every turn gets its
    own id, and each session carries forward its own replies (a shared id would hand one
    session another's turn)."""
    eng = ScriptedEngine()
    r = ss.run_sessions(eng, [_script(n_turns=3), _script(n_turns=1)], 4, warmup=0, out_dir=tmp_path / "r",
                        progress=False)
    assert len(r.df) == 3 + 1 + 3 + 1 and r.df["request_id"].is_unique, r.df[["session", "turn", "request_id"]]
    for _, s, req in eng.got:
        replies = [m["content"] for m in req.messages if m["role"] == "assistant"]
        assert replies == [f"reply {k} of {s}" for k in range(len(replies))]


def _failing(eng, when):
    orig = eng.astream

    async def astream(req, client=None):
        if when(req):
            raise RuntimeError("stand-in: the server refused this turn")
        async for ev in orig(req, client):
            yield ev
    eng.astream = astream
    return eng


@pytest.mark.parametrize("fails, turns", [(lambda req: len(req.messages) > 2, 2 * 2),   # every later turn
                                          (lambda req: True, 2)])                       # every turn, the first too
def test_later_goodput_counts_failed_turns(tmp_path, fails, turns):
    """No later turn succeeded: the steady-state goodput is 0, not NaN (a NaN passed any
    `< target` test, so an overloaded count read as meeting the SLO)."""
    eng = _failing(ScriptedEngine(), fails)
    r = ss.run_sessions(eng, _script(n_turns=3), 2, warmup=0, out_dir=tmp_path / "r", progress=False)
    s = ss.sessions_summary(r.df, {"ttft_s": 60.0})
    assert s["turns"] == turns and s["turns_ok"] == turns - 2, r.df[["session", "turn", "status"]]
    assert s["good_fraction_later"] == 0.0


def test_later_goodput_is_nan_only_with_nothing_to_judge(tmp_path):
    """One-turn sessions that all succeeded: no turn after the first, none failed."""
    r = ss.run_sessions(ScriptedEngine(), _script(n_turns=1), 2, warmup=0, out_dir=tmp_path / "r", progress=False)
    s = ss.sessions_summary(r.df, {"ttft_s": 60.0})
    assert s["good_fraction"] == 1.0 and np.isnan(s["good_fraction_later"])


def test_sweep_tables_by_session_count(tmp_path):
    table, runs = ss.sweep_sessions(ScriptedEngine(), _script(n_turns=2, think_s=0.0), (1, 3), warmup=0,
                                    out_dir=tmp_path, progress=False, slos={"ttft_s": 60.0})
    assert list(table.index) == [1, 3]
    assert table.loc[3, "turns"] == 6 and table.loc[1, "turns"] == 2
    assert table["good_fraction"].tolist() == [1.0, 1.0]
    assert (tmp_path / "n3" / "manifest.json").is_file()


def test_scripts_from_the_recorded_sessions():
    s = ss.agentic_script(n_turns=3)
    assert [len(t.added) for t in s.turns] == [2, 1, 1]
    assert s.turns[0].added[0]["role"] == "system" and all(t.reply["role"] == "assistant" for t in s.turns)
    assert all(t.think_s > 0 for t in s.turns)
    salted = ss.salted_script(s, "abc")
    assert salted.turns[0].added[0]["content"].startswith("Session abc\n")
    assert salted.turns[1:] == s.turns[1:]
    c = ss.agentic_script("coding-agent", n_turns=2)
    assert c.tools and c.turns[1].added[0]["role"] == "tool"
    with pytest.raises(ValueError):
        ss.agentic_script("nope")


def test_http_only(tmp_path):
    from infercourse.core.errors import APILayerError

    class InProcess:
        name = "x"
    with pytest.raises(APILayerError, match="HTTP engine"):
        ss.run_sessions(InProcess(), _script(), 1)


@pytest.mark.slow
def test_sessions_against_llama_server_agree_with_its_counters(tmp_path):
    """Two sessions on a two-slot llama-server: each keeps its slot, so after the first
    turn most of every prompt is cached; and the prompt tokens the server says it
    evaluated (its /metrics counter over the run, sampled by the run itself) are exactly
    the sessions' prompt tokens minus their cached tokens."""
    pytest.importorskip("httpx_sse")
    from infercourse.core.errors import BackendMissingError
    from infercourse.servers import LlamaServer
    try:
        srv = LlamaServer(n_parallel=2, ctx_size=4096, threads=1, cache_ram_mib=0)
    except BackendMissingError as e:
        pytest.skip(f"llama-server not built here: {e}")
    with srv:
        eng = srv.engine()
        r = ss.run_sessions(eng, ss.agentic_script(n_turns=3), 2, think_scale=0.0, warmup=1,
                            out_dir=tmp_path / "r", progress=False)
    ok = r.df[r.df["status"] == "ok"]
    assert len(ok) == 6, r.df[["status", "error"]]
    assert (ok.loc[ok["turn"] > 0, "cached_fraction"] > 0.5).all(), ok[["turn", "prompt_tokens", "cached_tokens"]]
    evaluated = int((ok["prompt_tokens"] - ok["cached_tokens"]).sum())
    server = r.manifest["server_samples"]
    assert server["n_samples"] >= 2
    assert server["llamacpp:prompt_tokens_delta"] == evaluated
    assert (tmp_path / "r" / "samples.jsonl").is_file()


def test_cli_sessions_and_session_counts(tmp_path, capsys):
    """`bench --sessions` and `--session-counts` end to end against the loopback stand-in."""
    from infercourse.cli import bench_main
    from infercourse.testing import SSESource
    base = ["--engine", "http", "--turns", "2", "--think-scale", "0", "--warmup", "0", "--no-progress"]
    with SSESource(ttft_s=0.0, gap_s=0.001) as src:
        assert bench_main([*base, "--url", src.url, "--sessions", "2", "--out", str(tmp_path / "one")]) == 0
        out = capsys.readouterr().out
        assert "by turn:" in out and "by session:" in out and "n_sessions=2" in out
        assert (tmp_path / "one" / "requests.jsonl").read_text().count("\n") == 4
        assert bench_main([*base, "--url", src.url, "--session-counts", "1,2", "--slo", "ttft=60",
                           "--out", str(tmp_path / "sweep")]) == 0
    out = capsys.readouterr().out
    assert "good_fraction_later" in out and (tmp_path / "sweep" / "n2" / "manifest.json").is_file()

"""The agent-loop arithmetic (shared prefixes, cumulative prefill) and a real replay."""
import json
import re

import pytest

from infercourse.lessons import agent
from infercourse.measure import workloads as wl
from infercourse.measure.workloads import DATA_DIR


@pytest.fixture(scope="module")
def session():
    return json.loads((DATA_DIR / "agentic_session.json").read_text())


def word_tokens(text):
    return re.findall(r"\w+|[^\w\s]", text)


def fake_prompt_tokens(req):
    # a toy chat template: role markers + words; the real one behaves alike (append-only)
    return [t for m in req.messages for t in ["<|" + m["role"] + "|>", *word_tokens(m["content"])]] + ["<|assistant|>"]


def test_common_prefix_len():
    assert wl.common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2
    assert wl.common_prefix_len([], [1]) == 0
    assert wl.common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert wl.common_prefix_len([9], [1]) == 0


def test_session_stats_counts_repeats(session):
    df = agent.session_stats(session, fake_prompt_tokens)
    assert len(df) == len(session["calls"]) >= 30
    assert df["prompt_tokens"].is_monotonic_increasing          # the context only grows
    assert df["shared_prefix_tokens"].iloc[0] == 0               # nothing before the first call
    # with an append-only template, everything the previous call sent is repeated: its
    # trailing "<|assistant|>" generation marker is also the recorded reply's first token
    prev = df["prompt_tokens"].shift(1).iloc[1:]
    assert (df["shared_prefix_tokens"].iloc[1:] == prev).all()
    assert (df["new_tokens"] == df["prompt_tokens"] - df["shared_prefix_tokens"]).all()
    assert df["cum_prefill_no_cache"].iloc[-1] == df["prompt_tokens"].sum()
    assert df["cum_prefill_cached"].iloc[-1] == df["prompt_tokens"].iloc[-1]  # telescopes
    s = agent.prefill_summary(df)
    assert s["repeated_tokens"] + s["new_tokens"] == s["prompt_tokens_sent"]
    assert 80 < s["repeat_pct"] < 100 and s["prefill_saving_x"] > 5


def test_session_stats_sees_a_changed_prefix(session):
    # a tokenizer that stamps each call differently at the top: nothing is shared any more
    calls = iter(range(10**6))
    df = agent.session_stats(session, lambda r: [f"t{next(calls)}"] + fake_prompt_tokens(r))
    assert (df["shared_prefix_tokens"] == 0).all()
    assert df["cum_prefill_cached"].iloc[-1] == df["cum_prefill_no_cache"].iloc[-1]


def test_context_composition(session):
    df = agent.context_composition(session, word_tokens)
    assert list(df.columns) == ["system + tools", "task", "assistant replies", "tool results"]
    assert (df["system + tools"] == df["system + tools"].iloc[0]).all()  # same system prompt
    assert df["assistant replies"].iloc[0] == 0 and df["tool results"].iloc[-1] > df["tool results"].iloc[1]
    stats = agent.session_stats(session, fake_prompt_tokens)
    assert (df.sum(axis=1) < stats["prompt_tokens"]).all()  # role markers are not counted


def test_parse_tool_call():
    ok = 'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
    assert agent.parse_tool_call(ok) == ("read_file", {"path": "a.py"})
    assert agent.parse_tool_call("I think the bug is in counts.py.") is None
    assert agent.parse_tool_call("<tool_call>{name: read_file}</tool_call>") is None  # bad JSON
    assert agent.parse_tool_call('<tool_call>{"arguments": {}}</tool_call>') is None


def test_replay_prefill_rejects_bad_n(session):
    with pytest.raises(ValueError, match="n_calls"):
        agent.replay_prefill(object(), session, 0, cache_prompt=True)


def mini_session(n_calls=3):
    """A short session of the same shape as data/agentic_session.json (prefill is slow
    on a shared 2-core CPU, so the slow tests use ~100-token prompts)."""
    msgs = [{"role": "system", "content": "You are a coding assistant. Tools: read_file(path), "
             "grep(pattern), run_tests(). Reply with one tool call per turn."},
            {"role": "user", "content": "Make the tests of textstats pass."}]
    calls = []
    for i in range(n_calls):
        calls.append({"index": i, "n_messages": len(msgs), "offset_s": float(i), "tool": "read_file",
                      "tool_latency_s": 0.0, "max_tokens": 8})
        msgs += [{"role": "assistant", "content": f"Reading file number {i}."},
                 {"role": "user", "content": f"<tool_response>\ndef f{i}(x):\n    return x + {i}\n</tool_response>"}]
    return {"name": "mini", "calls": calls, "messages": msgs}


@pytest.mark.slow
def test_replay_prefill_cache_saves_prefill(llamacpp_engine, tmp_path):
    n, sess = 3, mini_session()
    off = agent.replay_prefill(llamacpp_engine, sess, n, cache_prompt=False, max_tokens=2, results_root=tmp_path)
    on = agent.replay_prefill(llamacpp_engine, sess, n, cache_prompt=True, max_tokens=2, results_root=tmp_path)
    stats = agent.session_stats(sess, llamacpp_engine.prompt_tokens)
    assert list(off["prompt_tokens"]) == list(stats["prompt_tokens"])
    # cache off: every prompt token evaluated; cache on: call 0 cold, later calls reuse
    # the whole previous prompt (llama.cpp re-evaluates at least one token)
    assert list(off["prompt_n"]) == list(stats["prompt_tokens"])
    assert on["prompt_n"].iloc[0] == stats["prompt_tokens"].iloc[0]
    assert (on["cached_tokens"].iloc[1:].values >= stats["shared_prefix_tokens"].iloc[1:].values - 1).all()
    assert (on["prompt_n"].iloc[1:].values <= stats["new_tokens"].iloc[1:].values + 1).all()
    assert on["prompt_n"].iloc[1:].sum() < 0.5 * off["prompt_n"].iloc[1:].sum()
    saved = sorted(tmp_path.glob("*_agent-replay-*/manifest.json"))
    assert len(saved) == 2 and saved[1].parent.name.endswith("agent-replay-cache-3")


@pytest.mark.slow
def test_run_agent_loop_records_each_call(llamacpp_engine):
    df = agent.run_agent(llamacpp_engine, "List the files of the repository.", max_steps=2, max_tokens=24)
    assert 1 <= len(df) <= 2
    assert df["prompt_tokens"].iloc[0] > 400   # system prompt + tools + project context
    if len(df) == 2:  # the model made a tool call: the second prompt re-sends the first
        assert df["prompt_tokens"].iloc[1] > df["prompt_tokens"].iloc[0]
        assert df["cached_tokens"].iloc[1] >= df["prompt_tokens"].iloc[0] - 1


def test_session_with_extra_calls_repeats_the_last_tool_step(session):
    assert agent.session_with_extra_calls(0)["messages"] == session["messages"]   # the recorded run, rebuilt
    k = 2
    more = agent.session_with_extra_calls(k)
    assert len(more["calls"]) == len(session["calls"]) + k
    step = session["messages"][-3:-1]          # the last tool call and its result, before the final answer
    assert more["messages"] == session["messages"][:-1] + step * k + session["messages"][-1:]
    # the solution's arithmetic: k more calls send k x the final context, plus the steps they carry
    before, after = (agent.session_stats(s, fake_prompt_tokens) for s in (session, more))
    last, added = before["prompt_tokens"].iloc[-1], before["new_tokens"].iloc[-1]
    assert after["prompt_tokens"].sum() - before["prompt_tokens"].sum() == k * last + added * k * (k + 1) // 2
    with pytest.raises(ValueError, match="n_extra"):
        agent.session_with_extra_calls(-1)


def test_cold_call_rejects_a_call_the_session_lacks(session):
    with pytest.raises(ValueError, match="call must be"):
        agent.cold_call(object(), session, len(session["calls"]))


@pytest.mark.slow
def test_cold_call_prefills_the_whole_prompt_even_after_a_cached_one(llamacpp_engine, tmp_path):
    sess = mini_session()
    agent.replay_prefill(llamacpp_engine, sess, 3, cache_prompt=True, max_tokens=2,
                         results_root=tmp_path)   # leaves calls 0-2 cached
    r = agent.cold_call(llamacpp_engine, sess, 2, max_tokens=2)
    full = len(llamacpp_engine.prompt_tokens(agent._requests(sess)[2]))
    assert r["call"] == 2 and r["prompt_tokens"] == r["prompt_n"] == full and r["ttft_s"] > 0

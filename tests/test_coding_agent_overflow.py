"""Notebook 19's overflow finder: the first call of a session that no longer fits the
server's window. llama-server refuses a prompt of exactly n_ctx tokens (no room for one
new token), so that call is the first overflow; checked on a stand-in, then against a real
llama-server's own boundary."""
from types import SimpleNamespace

import pytest

from infercourse.core.errors import ContextLayerError
from infercourse.lessons import coding_agent, coding_agent_claims


class _WindowStandIn:
    """A stand-in engine with a `window`-token slot: `count_tokens` reads each request's
    size from its `n` field; `stream` refuses, as llama-server does, any prompt >= window."""

    root = "http://stand-in"

    def __init__(self, window):
        self.window, self.sent = window, []

    def count_tokens(self, req):
        return req.n

    def stream(self, req):
        self.sent.append(req.n)
        if req.n >= self.window:
            raise ContextLayerError(f"request ({req.n} tokens) exceeds the available context size ({self.window})")
        yield from ()


@pytest.mark.parametrize("sizes, call", [([300, 512, 700], 1), ([300, 511, 700], 2), ([100, 200], None)])
def test_a_prompt_that_fills_the_window_is_the_first_overflow(monkeypatch, sizes, call):
    eng = _WindowStandIn(512)
    monkeypatch.setattr(coding_agent, "slot_view", lambda url: {"n_ctx": 512})
    out = coding_agent.first_overflow(eng, SimpleNamespace(requests=[SimpleNamespace(n=n) for n in sizes]))
    assert out["call"] == call, out
    if call is None:
        assert out["error"] == "every call fit" and not eng.sent
    else:   # the call it names is one the server refuses, and the one before is not
        assert out["layer"] == "context" and eng.sent == [sizes[call]]
        assert out["last_fitting_call"] == call - 1 and sizes[call - 1] < 512


@pytest.mark.slow
def test_llama_server_refuses_a_prompt_of_exactly_its_window():
    """The boundary `first_overflow` relies on, read from the server itself: a prompt of
    n_ctx - 1 tokens is answered, one of n_ctx tokens is refused as too long."""
    import httpx

    from infercourse.core.errors import BackendMissingError
    from infercourse.servers import LlamaServer
    try:
        srv = LlamaServer(n_parallel=1, ctx_size=256, threads=1)
    except BackendMissingError as e:
        pytest.skip(f"llama-server not built here: {e}")
    with srv:
        n_ctx = coding_agent.slot_view(srv.url)["n_ctx"]
        tok = httpx.post(srv.url + "/tokenize", json={"content": "hello"}, timeout=30).json()["tokens"][0]

        def send(n):
            return httpx.post(srv.url + "/completion", json={"prompt": [tok] * n, "n_predict": 1,
                                                             "cache_prompt": False}, timeout=120)
        below, at = send(n_ctx - 1), send(n_ctx)
    assert below.status_code == 200, below.text
    assert at.status_code == 400 and "context size" in at.text, at.text


def test_summary_lines_follow_the_cache_table_and_the_api_ratio():
    import pandas as pd
    table = pd.DataFrame({"cached_share": [0.9, 0.05], "ttft_vs_first": [1.0, 4.2]},
                         index=["header fixed", "buster"])
    per_api = pd.DataFrame({"prompt_tokens": [1.0], "cached_tokens": [1.0], "ttft_s": [1.1]},
                           index=["anthropic / openai"])
    text = coding_agent_claims.summary_lines(table, per_api)
    assert "reused **90%**" in text and "**4.2×**" in text and "The cache was busted." in text
    assert "the same prompt tokens" in text and "and the same cached tokens" in text
    table.loc["buster", "cached_share"] = 0.8
    per_api.loc["anthropic / openai", ["prompt_tokens", "cached_tokens"]] = [1.2, 1.15]
    text = coding_agent_claims.summary_lines(table, per_api)
    assert "did not halve the reuse" in text and "different prompt tokens" in text and "cached counts differ" in text


def test_prefill_sentence_says_what_each_prefill_did():
    import pandas as pd
    rows = pd.DataFrame([{"prefill": '<tool_call>\n{"name"', "tool_use": {"path": "a.py"}, "stop_reason": "tool_use", "error": None},
                         {"prefill": "…</tool_call>", "tool_use": None, "stop_reason": None, "error": "API: bad parse"}])
    text = coding_agent_claims.prefill_sentence(rows)
    assert "opening of a call: the server's parser streamed a **tool_use** block {'path': 'a.py'}" in text
    assert "complete call: the stream ended in an **error** (API: bad parse)" in text
    rows.loc[1, "error"] = None
    assert "**no tool_use** block and no error" in coding_agent_claims.prefill_sentence(rows)


class _CountMessages:
    """A stand-in engine whose 'token count' is the number of messages (system, task, steps)."""

    def count_tokens(self, req):
        return len(req.messages)


def test_prompt_tokens_at_counts_the_later_call_of_the_same_session():
    from infercourse.measure.agent_workload import coding_agent_session
    size = dict(profile="cpu", n_calls=2, max_tokens=8, n_tools=5, static_chars=1200)
    whole = coding_agent_session(**{**size, "n_calls": 6}).requests
    for call in (0, 3, 5):   # n_calls in `size` does not cap it: the call is built
        assert coding_agent.prompt_tokens_at(_CountMessages(), call, **size) == len(whole[call].messages)
    assert coding_agent.prompt_tokens_at(_CountMessages(), 3, **size) > coding_agent.prompt_tokens_at(
        _CountMessages(), 2, **size)
    with pytest.raises(ValueError, match="does not exist"):
        coding_agent.prompt_tokens_at(_CountMessages(), 10_000, **size)


def test_cold_ttft_at_sends_every_repeat_with_a_header_never_sent_before(monkeypatch):
    sent = []

    def fake_record(engine, req, **kw):
        sent.append(req)
        return SimpleNamespace(status="ok", error=None, t=len(sent))
    monkeypatch.setattr(coding_agent, "record", fake_record)
    monkeypatch.setattr(coding_agent, "ttft_s", lambda tr: float(tr.t))
    size = dict(profile="cpu", n_calls=2, max_tokens=8, n_tools=5, static_chars=1200)
    assert coding_agent.cold_ttft_at(None, 2, repeats=3, **size) == 2.0   # the median of 1, 2, 3
    system = [str(r.messages[0]) for r in sent]
    assert len(set(system)) == 3, "each repeat must differ at the header, or the second is served warm"
    assert all(len(r.messages) == len(sent[0].messages) for r in sent)


def test_the_printed_settings_name_the_servers_window():
    """Without CLAUDE_CODE_MAX_CONTEXT_TOKENS the pinned Claude Code assumes 1,000,000 tokens for
    a model it does not know: the settings 19 prints carry the window they were given, and they
    are doctor agent's (one source): a dummy token, every alias, and an answer cap sized with the
    window and the agent's first request; 19's had Claude Code's default cap of 32,000, which on
    its 8,192-token server put the compaction line below zero."""
    import json

    from infercourse.ops.agent_budget import claude_budget
    from infercourse.ops.agent_doctor import agent_shape
    from infercourse.ops.agents import claude_env
    first = int(agent_shape("claude-code")["prompt_tokens"])
    for window in (8192, 32768, 65536):
        text = coding_agent.claude_code_settings("http://127.0.0.1:8", window)
        env = json.loads(text[:text.index("\n\n")])["env"]
        assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(window) and "doctor agent http://127.0.0.1:8" in text
        b = claude_budget(first, window)
        assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == str(b["answer_cap"])
        assert env == {k: str(v) for k, v in claude_env("http://127.0.0.1:8", "local-model", window=window,
                                                         first=first).items()}
        assert env["ANTHROPIC_DEFAULT_OPUS_MODEL"] == "local-model" and env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
        assert f"compaction line {b['compacts_above']:,}" in text
        smallest = f"room to grow: {claude_budget(first)['window']:,} tokens a slot"
        assert (smallest in text) == (not b["fits"]), window
    assert not claude_budget(first, 8192)["fits"] and claude_budget(first, 65536)["fits"]


def test_both_predict_guesses_are_scored_against_the_run():
    import pandas as pd
    table = pd.DataFrame({"cached_share": [0.9, 0.05], "ttft_p50_s": [0.5, 2.0]}, index=["fixed", "buster"])
    g = coding_agent.guesses(table, ceiling=10.0)
    assert set(g) == {"MY_GUESS_CACHED_SHARE", "MY_GUESS_TTFT_RATIO"}
    assert g["MY_GUESS_CACHED_SHARE"][:2] == (0.9, 0.9) and g["MY_GUESS_TTFT_RATIO"][:2] == (10.0, 4.0)



@pytest.mark.parametrize("notebook, aliases", [
    ("19_coding_agent", {"ca": "coding_agent", "cc": "coding_agent_claims"}),
    ("20_real_coding_agent", {"ra": "real_agent", "rs": "real_agent_session", "rc": "real_agent_claims",
                              "ce": "context_extension", "rt": "real_agent_tools"})])
def test_every_lesson_name_a_notebook_calls_exists(notebook, aliases):
    """A lesson split in two moves names: each `alias.name` a notebook's code uses must be there
    (the notebook run finds a missing one only minutes in)."""
    import importlib
    import json
    import re
    from pathlib import Path
    nb = json.loads((Path(__file__).parents[1] / "notebooks" / f"{notebook}.ipynb").read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    used = set(re.findall(rf"\b({'|'.join(aliases)})\.([A-Za-z_]\w*)", code))
    assert used
    missing = [f"{a}.{n}" for a, n in sorted(used)
               if not hasattr(importlib.import_module(f"infercourse.lessons.{aliases[a]}"), n)]
    assert not missing, missing

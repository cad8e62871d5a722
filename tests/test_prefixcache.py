"""Prefix caching: where prompts diverge, server counters, and cold vs warm on llama.cpp."""
import pytest

from infercourse.lessons import prefixcache as pc
from infercourse.core.types import Request
from infercourse.core.errors import APILayerError
from infercourse.servers import free_port
from infercourse.measure.workloads import shared_prefix_workload

VLLM_METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 200.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 750.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 150.0
# HELP vllm:prefix_cache_hits_created x
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""


def test_first_divergence():
    assert pc.first_divergence([1, 2, 3], [1, 2, 9]) == 2
    assert pc.first_divergence([5, 2], [1, 2]) == 0
    assert pc.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert pc.first_divergence([1, 2], [1, 2, 3]) == 2       # a prefix of the other


def test_prometheus_counters_sum_labels_and_skip_created():
    got = pc.prometheus_counters(VLLM_METRICS, pc.VLLM_PREFIX_COUNTERS)
    assert got == {"vllm:prefix_cache_queries": 1200.0, "vllm:prefix_cache_hits": 900.0}
    # names with the wire suffix work too; absent names are simply missing
    assert pc.prometheus_counters(VLLM_METRICS, ["vllm:prefix_cache_hits_total", "nope"]) == \
        {"vllm:prefix_cache_hits": 900.0}


def test_counter_delta_and_hit_rate():
    before = {"vllm:prefix_cache_queries": 1000.0, "vllm:prefix_cache_hits": 100.0}
    after = {"vllm:prefix_cache_queries": 1600.0, "vllm:prefix_cache_hits": 550.0}
    d = pc.counter_delta(before, after)
    assert d == {"vllm:prefix_cache_queries": 600.0, "vllm:prefix_cache_hits": 450.0}
    assert pc.hit_rate(d) == pytest.approx(0.75)
    assert pc.hit_rate({"vllm:prefix_cache_queries": 0.0}) is None


def test_prometheus_counters_unreachable_is_api_error():
    with pytest.raises(APILayerError, match="not reachable"):
        pc.prometheus_counters(f"http://127.0.0.1:{free_port()}", pc.VLLM_PREFIX_COUNTERS)


@pytest.mark.slow
def test_divergence_view_finds_what_breaks_the_cache(llamacpp_engine):
    eng = llamacpp_engine
    views = {v: pc.divergence_view(eng, *shared_prefix_workload(2, variant=v).requests[:2])
             for v in ("shared", "timestamp", "reordered_tools")}
    shared, ts, ro = views["shared"], views["timestamp"], views["reordered_tools"]
    assert shared["shared_pct"] > 90 and "Task" in shared["before"] + shared["a_after"]
    assert ts["first_divergence"] < 30                           # the clock on the first line:
    assert ts["a_after"][0].isdigit() and ts["a_after"][0] != ts["b_after"][0]  # a seconds digit
    assert ts["first_divergence"] < ro["first_divergence"] < shared["first_divergence"]


def small_workload(n, header=lambda i: ""):
    """~120-token shared prefix (the course's 530-token one is slow to prefill on a
    contended CPU); `header(i)` puts something per-request on the first line."""
    system = ("You are a careful coding assistant for the textstats repository. " * 8).strip()
    return [Request(messages=[{"role": "system", "content": header(i) + system},
                              {"role": "user", "content": f"Task {i}: explain file {i}."}], max_tokens=2)
            for i in range(n)]


@pytest.mark.slow
def test_cold_warm_llamacpp(llamacpp_engine, tmp_path, monkeypatch):
    # Independent witness of the work done: the token batches llama-cpp-python hands to
    # llama.cpp. A batch of more than one token is a prompt (decode steps are single).
    batches, real_eval = [], llamacpp_engine.llm.eval
    monkeypatch.setattr(llamacpp_engine.llm, "eval", lambda toks: (batches.append(len(toks)), real_eval(toks))[1])
    reqs = small_workload(3)
    df = pc.cold_warm(llamacpp_engine, reqs, results_root=tmp_path)
    off, on = df[~df["cache_prompt"]], df[df["cache_prompt"]]
    assert (off["state"] == "cold").all() and (off["prompt_n"] == off["prompt_tokens"]).all()
    assert on["state"].tolist() == ["cold", "warm", "warm"]          # the 1st fills the cache
    assert (on["prompt_n"].iloc[1:] < 0.3 * on["prompt_tokens"].iloc[1:]).all()
    # llama.cpp's perf counter (prompt_n) = the batches the Python side really sent
    assert [b for b in batches if b > 1][-len(df):] == df["prompt_n"].tolist()
    # what a warm request evaluated = what theory says is left: the tokens after the two
    # prompts' common prefix, from the token ids alone, not from the runtime; and both
    # settings sent exactly these prompts (no salt moved the prefix)
    ids = [llamacpp_engine.prompt_tokens(r) for r in reqs]
    assert off["prompt_tokens"].tolist() == on["prompt_tokens"].tolist() == [len(i) for i in ids]
    assert on["prompt_n"].iloc[1:].tolist() == [len(b) - pc.first_divergence(a, b) for a, b in zip(ids, ids[1:])]
    assert (on["cached_tokens"] + on["prompt_n"] == on["prompt_tokens"]).all()   # the two sources agree
    s = pc.cold_warm_summary(df)
    assert s.loc[(True, "warm"), "requests"] == 2 and s.loc[(False, "cold"), "requests"] == 3
    assert len(list(tmp_path.glob("*_prefix-cache/manifest.json"))) == 1
    # a per-request timestamp on the first line: same engine, cache on, nothing useful reused
    ts_reqs = small_workload(2, lambda i: f"Time: 10:00:{i:02d}\n")
    ts = pc.cold_warm(llamacpp_engine, ts_reqs, settings=(True,), label="ts", results_root=tmp_path)
    a, b = (llamacpp_engine.prompt_tokens(r) for r in ts_reqs)
    assert (ts["state"] == "cold").all() and ts["prompt_n"].iloc[1] == len(b) - pc.first_divergence(a, b)
    assert pc.first_divergence(a, b) < 20     # the seconds digit, on the first line


def _cw(cold, warm):
    import pandas as pd
    rows = [{"cache_prompt": False, "state": "cold", "ttft_s": t} for t in cold]
    rows += [{"cache_prompt": True, "state": "cold", "ttft_s": cold[0]}]     # the cache run's first request
    rows += [{"cache_prompt": True, "state": "warm", "ttft_s": t} for t in warm]
    return pd.DataFrame(rows)


def test_cold_warm_sentence_ranks_only_separated_groups_and_flips():
    text = pc.cold_warm_sentence(_cw([1.0, 1.1], [0.1, 0.12]), predicted_share=0.05)
    assert "**9.5× faster** warm" in text and "more than the predicted share" in text
    text = pc.cold_warm_sentence(_cw([0.1, 0.11], [0.2, 0.3]), predicted_share=0.05)
    assert "warm was **slower**" in text and "faster" not in text
    text = pc.cold_warm_sentence(_cw([0.5, 1.0], [0.6, 0.7]), predicted_share=0.9)
    assert "overlap" in text and "cannot rank" in text and "about the predicted share" in text
    text = pc.cold_warm_sentence(_cw([1.0, 1.0], [0.01, 0.01]), predicted_share=0.1)
    assert "less than the predicted share" in text


def test_cache_loss_sentence_follows_the_counts():
    assert "fell from **500** to **20**" in pc.cache_loss_sentence("timestamp", 500, 20, 19)
    assert "stayed at **500**" in pc.cache_loss_sentence("same", 500, 500, 510)
    assert "rose" in pc.cache_loss_sentence("longer", 500, 600, 610)


def test_cache_loss_sentence_sets_the_cached_tokens_against_the_divergence():
    """Issue 31: 'fell from 522 to 33 (the prompts part at token 25)' went unremarked."""
    import re
    exact = pc.cache_loss_sentence("timestamp", 522, 25, 25)
    assert re.search(r"\bexactly the 25 tokens before\b", exact)
    assert re.search(r"\b2 fewer than the 25 tokens\b", pc.cache_loss_sentence("timestamp", 522, 23, 25))
    over = pc.cache_loss_sentence("timestamp", 522, 33, 25)
    assert re.search(r"\bmore than the 25 tokens\b", over) and "were not these prompts" in over
    assert "exactly" not in over


def test_with_pasted_text_grows_only_the_part_after_the_prefix():
    words = str.split    # a whitespace tokenizer: one token per word, no BOS
    reqs = small_workload(3)
    out = pc.with_pasted_text(reqs, 40, words)
    for r, o in zip(reqs, out):
        assert o.messages[0] == r.messages[0]                          # the shared system prompt
        old, new = r.messages[-1]["content"], o.messages[-1]["content"]
        assert new.startswith(old) and len(words(new)) == len(words(old)) + 40
    pasted = [o.messages[-1]["content"] for o in out]
    assert len(set(p.split(":", 1)[1][25:] for p in pasted)) == 3       # each task pastes its own text
    assert pc.with_pasted_text(reqs, 0, words) == reqs


def test_first_vs_rest_reads_the_first_request_by_index():
    import pandas as pd
    df = pd.DataFrame({"req_index": [2, 0, 1], "ttft_s": [0.2, 1.0, 0.3]})
    assert pc.first_vs_rest(df) == pytest.approx(1.0 / 0.25)
    with pytest.raises(ValueError):
        pc.first_vs_rest(df.head(1))


class OneSequenceEngine:
    """Keeps only the previous request's system prompt, like llama.cpp in process: a request
    whose system prompt differs from the previous one's sleeps (a cold prefill)."""

    name = "fake"

    def __init__(self, cold_s=0.05):
        self.cold_s, self.last, self.seen = cold_s, None, []

    def stream(self, request):
        import time
        from infercourse.core.types import Event, Usage
        system = request.messages[0]["content"]
        self.seen.append(system)
        warm, self.last = system == self.last, system
        if not warm:
            time.sleep(self.cold_s)
        yield Event(t=time.perf_counter(), text="x", n_tokens=1)
        yield Event(t=time.perf_counter(), done=True, finish_reason="length",
                    usage=Usage(100, 1, cached_tokens=90 if warm else 0, source="engine"))

    def describe(self):
        return {"engine": self.name}


def test_interleaved_requests_meet_another_users_prefix(tmp_path):
    eng = OneSequenceEngine()
    a, b = small_workload(3), small_workload(2, lambda i: f"Time: 10:00:{i:02d}\n")
    t = pc.interleaved_ttft_s(eng, a, b, results_root=tmp_path)
    kinds = ["b" if s.startswith("Time") else "a" for s in eng.seen[1:]]  # after the warm-up; no salt
    assert kinds == ["a", "b", "a", "b", "a"]
    assert t >= eng.cold_s          # tasks 2 and 3 each came after the other user's prompt
    with pytest.raises(ValueError):
        pc.interleaved_ttft_s(eng, a, b[:1])
    # the same tasks back to back: the warm ones are reported (a number, from the warm rows only)
    assert pc.warm_ttft_s(eng, a, results_root=tmp_path) > 0


def test_cold_warm_sends_the_same_requests_with_the_cache_off_and_on(tmp_path):
    """Issue 31: bench salted the cache-on run only (a list of Requests is no cache workload),
    so its prompts were 9 tokens longer and parted 8 tokens later than the ones divergence_view
    tokenized, and 'the same requests twice' was not true."""
    reqs = small_workload(3)
    eng = OneSequenceEngine(cold_s=0.0)
    df = pc.cold_warm(eng, reqs, results_root=tmp_path)
    sent = eng.seen[1:]                                    # after the warm-up request
    assert sent == [r.messages[0]["content"] for r in reqs] * 2
    assert df.groupby("cache_prompt").size().tolist() == [3, 3]
    # a salt, when asked for, starts every prompt of every setting alike
    eng = OneSequenceEngine(cold_s=0.0)
    pc.cold_warm(eng, reqs, results_root=tmp_path, salt="s41t")
    assert eng.seen[1:] == [f"s41t\n{r.messages[0]['content']}" for r in reqs] * 2

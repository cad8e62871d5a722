"""The engine contract, checked for real on every in-process engine that runs here.

Each property is one a learner relies on when comparing engines: greedy output is
reproducible, timestamps only move forward, the tokens counted across chunks equal the
usage the engine reports, `generate()` is exactly the joined stream, and forced length
really forces the length.
"""
import pytest

from infercourse import Request, generate
from infercourse.engines import engine_class, make_engine
from infercourse.core.errors import (
    BackendMissingError,
    ContextLayerError,
    InferCourseError,
    ModelLayerError,
)

CHAT = [{"role": "user", "content": "Name three primary colors."}]

ENGINES = ["llamacpp_engine", "transformers_engine", "mlx_engine"]
pytestmark = pytest.mark.slow


@pytest.fixture(params=ENGINES)
def engine(request):
    return request.getfixturevalue(request.param)


def test_greedy_is_deterministic(engine):
    a = generate(engine, Request(messages=CHAT, max_tokens=24, cache_prompt=False))
    b = generate(engine, Request(messages=CHAT, max_tokens=24, cache_prompt=False))
    assert a.text and a.text == b.text


def _retokenize(engine, text: str) -> list:
    """The streamed text counted again by the model's own tokenizer, outside the engine."""
    if hasattr(engine, "llm"):                                         # llama.cpp
        return engine.llm.tokenize(text.encode(), add_bos=False, special=False)
    return engine.tokenizer.encode(text, add_special_tokens=False)   # HF, and MLX's wrapper of it


def test_stream_contract(engine):
    events = list(engine.stream(Request(messages=CHAT, max_tokens=24)))
    ts = [e.t for e in events]
    assert ts == sorted(ts), "arrival times must be monotonic"
    assert events[-1].done and not any(e.done for e in events[:-1])
    usage = events[-1].usage
    assert usage.prompt_tokens > len(CHAT[0]["content"].split())  # template adds tokens
    assert events[-1].finish_reason in ("stop", "length")
    # Independent count: the text that arrived, re-tokenized, holds the tokens the engine
    # says it made (less a stop token, which has no text). Tokenizing text can merge two
    # pieces differently from how they were generated, hence one token of slack.
    text = "".join(e.text for e in events)
    shown = usage.completion_tokens - (events[-1].finish_reason == "stop")
    assert shown > 0 and abs(len(_retokenize(engine, text)) - shown) <= 1
    assert sum(e.n_tokens for e in events) == usage.completion_tokens


def test_generate_is_the_joined_stream(engine):
    req = Request(messages=CHAT, max_tokens=20, cache_prompt=False)
    streamed = "".join(e.text for e in engine.stream(req))
    assert generate(engine, req).text == streamed


@pytest.mark.parametrize("n", [1, 40])
def test_forced_length(engine, n):
    c = generate(engine, Request(messages=[{"role": "user", "content": "Say hi."}],
                                 max_tokens=n, ignore_eos=True))
    assert c.usage.completion_tokens == n == c.n_tokens
    assert c.finish_reason == "length"


def test_without_forcing_a_short_answer_stops_early(llamacpp_engine):
    # The counterpart of forced length: the model's own EOS ends a short answer.
    c = generate(llamacpp_engine, Request(messages=[{"role": "user", "content": "Reply with the single word: yes"}],
                                          max_tokens=100))
    assert c.finish_reason == "stop" and c.usage.completion_tokens < 100


def _evaluated_at_first_token(engine, req):
    """Run `req`; return (the done event's usage, prompt tokens the runtime evaluated
    before the first token, the done event's timings). The second number comes from llama.cpp's perf counters, read when the first
    token arrives: at that moment only the uncached prompt suffix has been evaluated
    (batches of >1 token count as n_p_eval, a single token as n_eval)."""
    import llama_cpp
    from infercourse import compat
    it = iter(engine.stream(req))
    next(it)
    perf = llama_cpp.llama_perf_context(compat.llama_context_ptr(engine.llm))
    # reported as max(1, n): a phase that spent no time evaluated nothing
    evaluated = sum(n if ms > 0 else 0 for n, ms in ((perf.n_p_eval, perf.t_p_eval_ms),
                                                     (perf.n_eval, perf.t_eval_ms)))
    done = [e for e in it if e.done][0]
    return done.usage, evaluated, done.timings


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_llamacpp_prefix_cache_reuse(llamacpp_engine):
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    r1 = Request(messages=[system, {"role": "user", "content": "One."}], max_tokens=4, cache_prompt=False)
    r2 = Request(messages=[system, {"role": "user", "content": "Two."}], max_tokens=4)
    cold, cold_eval, _ = _evaluated_at_first_token(llamacpp_engine, r1)
    warm, warm_eval, _ = _evaluated_at_first_token(llamacpp_engine, r2)
    assert cold.cached_tokens == 0 and cold_eval == cold.prompt_tokens
    # Two independent counts: the shared prefix of the two prompts, tokenized here, and
    # the tokens the runtime actually evaluated before the first token
    shared = _common_prefix(llamacpp_engine.prompt_tokens(r1), llamacpp_engine.prompt_tokens(r2))
    assert shared > 100 and warm.cached_tokens == shared
    assert warm_eval == warm.prompt_tokens - warm.cached_tokens
    off = generate(llamacpp_engine, r2, cache_prompt=False)
    assert off.usage.cached_tokens == 0 and off.text == generate(llamacpp_engine, r2).text


def test_llamacpp_prompt_n_is_this_requests_own(llamacpp_engine):
    # llama.cpp adds a decode's tokens to its perf counters at the next synchronize: a direct
    # llm.eval before a request (as the KV-cache lesson's state-size probe does) was billed
    # to the request's prompt_n (214 for a 54-token prompt, after 16 + 144 probe tokens)
    probe = llamacpp_engine.tokenize("one two three four five six seven eight nine ten " * 3)
    llamacpp_engine.reset()
    llamacpp_engine.llm.eval(probe)
    llamacpp_engine.reset()
    r = Request(prompt="Hello there.", max_tokens=1, cache_prompt=False)
    done = list(llamacpp_engine.stream(r))[-1]
    assert done.timings["prompt_n"] == done.usage.prompt_tokens < len(probe)


def test_llamacpp_cached_tokens_with_one_or_no_uncached_token(llamacpp_engine):
    # §2.7: llama.cpp files a 1-token batch under n_eval, not n_p_eval, and reports every
    # count as max(1, n), so `len - n_p_eval` was right for a 1-token suffix only by luck,
    # and wrong (one short) when nothing at all was evaluated
    base = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    t1, t2 = llamacpp_engine.tokenize(base), llamacpp_engine.tokenize(base + " jumps")
    assert t2[:-1] == t1, "the suffix must be exactly one token"
    _evaluated_at_first_token(llamacpp_engine, Request(prompt=base, max_tokens=1, cache_prompt=False))
    usage, evaluated, _ = _evaluated_at_first_token(llamacpp_engine, Request(prompt=base, max_tokens=1))
    assert evaluated == 0 and usage.cached_tokens == len(t1) == usage.prompt_tokens   # all reused
    usage, evaluated, _ = _evaluated_at_first_token(llamacpp_engine, Request(prompt=base + " jumps", max_tokens=3))
    assert evaluated == 1 and usage.cached_tokens == len(t1) == usage.prompt_tokens - 1


def test_llamacpp_cached_tokens_with_prompt_lookup_drafting():
    # §2.7: prompt-lookup verify batches (several tokens each) inflate n_p_eval, so
    # `len - n_p_eval` undercounted the cache; the matched prefix does not move
    from infercourse.engines.llamacpp import LlamaCppEngine
    eng = LlamaCppEngine(n_threads=1, n_ctx=512, draft="prompt-lookup", draft_tokens=8)
    prompt = "Count: " + " ".join(str(i % 10) for i in range(60))
    req = Request(prompt=prompt, max_tokens=24, ignore_eos=True)
    first, _, _ = _evaluated_at_first_token(eng, Request(prompt=prompt, max_tokens=24, cache_prompt=False))
    usage, evaluated, timings = _evaluated_at_first_token(eng, req)
    assert first.cached_tokens == 0
    assert timings["prompt_n"] > 1, "no verify batch ran: the test did not exercise drafting"
    assert usage.cached_tokens == usage.prompt_tokens - evaluated >= usage.prompt_tokens - 1


def test_llamacpp_state_save_restore(llamacpp_engine):
    req = Request(messages=CHAT, max_tokens=8)
    generate(llamacpp_engine, req)
    state = llamacpp_engine.save_state()
    llamacpp_engine.reset()
    llamacpp_engine.load_state(state)
    again = generate(llamacpp_engine, req)
    assert again.usage.cached_tokens >= again.usage.prompt_tokens - 1


def test_transformers_kv_cache_switch_keeps_the_answer(transformers_engine):
    from infercourse.engines.transformers_engine import TransformersEngine
    on = generate(transformers_engine, Request(messages=CHAT, max_tokens=12))
    off_engine = TransformersEngine.__new__(TransformersEngine)
    off_engine.__dict__.update(transformers_engine.__dict__, use_cache=False)
    off = generate(off_engine, Request(messages=CHAT, max_tokens=12))
    assert off.text == on.text


def test_context_overflow_names_the_context_layer(llamacpp_engine):
    long = "word " * 3000
    with pytest.raises(ContextLayerError, match="context window"):
        generate(llamacpp_engine, long, max_tokens=8)


def test_bad_model_inputs_name_the_model_layer(tmp_path):
    from infercourse.engines.llamacpp import LlamaCppEngine
    with pytest.raises(ModelLayerError, match="not found"):
        LlamaCppEngine(tmp_path / "missing.gguf")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ModelLayerError, match="not a GGUF"):
        LlamaCppEngine(fake)
    truncated = tmp_path / "trunc.gguf"
    from infercourse.models.embedded import embedded_gguf
    truncated.write_bytes(embedded_gguf().read_bytes()[:1_000_000])
    with pytest.raises(ModelLayerError, match="corrupt"):
        LlamaCppEngine(truncated)


def test_unknown_engine_and_missing_backend(monkeypatch):
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("tensorrt")
    import sys
    monkeypatch.setitem(sys.modules, "mlx_lm", None)  # as if MLX-LM were not installed
    with pytest.raises(BackendMissingError) as info:
        engine_class("mlx")()
    assert "runtime layer" in str(info.value)
    assert isinstance(info.value, InferCourseError)


def test_missing_gpu_fails_clearly():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from infercourse.engines.transformers_engine import TransformersEngine
    with pytest.raises(BackendMissingError, match="CUDA"):
        TransformersEngine(device="cuda")


def test_request_validation():
    with pytest.raises(ValueError):
        Request(prompt="a", messages=CHAT)
    with pytest.raises(ValueError):
        Request(prompt="a", max_tokens=0)

"""The two decode loops agree token for token; KV arithmetic matches hand computation;
llama.cpp's measured KV bytes per token match the model card's formula."""
import pytest

from infercourse.lessons import kvcache


def _tiny_model(seed=0):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg).eval(), torch


@pytest.mark.parametrize("seed", [0, 1])
def test_naive_and_cached_loops_give_the_same_greedy_tokens_as_generate(seed):
    model, torch = _tiny_model(seed)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(seed))
    naive = list(kvcache.naive_decode(model, ids, 20))
    cached = list(kvcache.cached_decode(model, ids, 20))
    with torch.inference_mode():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                             do_sample=False, min_new_tokens=20, pad_token_id=0)[0, 12:].tolist()
    assert naive == cached == ref
    assert len(set(naive)) > 1   # a degenerate constant output would make equality trivial


def test_tokens_processed_quadratic_vs_linear():
    # prompt 10, 4 new: naive runs 10 + 11 + 12 + 13 positions; cached 10 + 1 + 1 + 1
    assert kvcache.tokens_processed(10, 4, cached=False) == 46
    assert kvcache.tokens_processed(10, 4, cached=True) == 13
    # doubling the generated length roughly quadruples the naive extra work
    extra = [kvcache.tokens_processed(1, n, cached=False) for n in (100, 200)]
    assert 3.9 < extra[1] / extra[0] < 4.1
    with pytest.raises(ValueError):
        kvcache.tokens_processed(0, 4, cached=True)


def test_kv_table_by_hand():
    t = kvcache.kv_table(context_tokens=32_768)
    # Llama-3.1-8B: 2 * 32 layers * 8 KV heads * 128 dims * 2 bytes = 128 KiB per token
    row = t.loc["Llama-3.1-8B"]
    assert row["kv_kib_per_token_f16"] == 128
    assert row["kv_gib_f16/bf16"] == pytest.approx(4.0)          # 128 KiB * 32768 = 4 GiB
    assert row["kv_gib_fp8"] == pytest.approx(2.0)
    assert row["kv_gib_q8_0"] == pytest.approx(4.0 * 34 / 64)   # 34 bytes per 32 values, scale included
    assert row["kv_gib_f16_if_mha"] == pytest.approx(16.0)       # 32 KV heads instead of 8
    # Llama-2-7B has no GQA: its MHA column equals its actual one
    l2 = t.loc["Llama-2-7B"]
    assert l2["kv_gib_f16_if_mha"] == l2["kv_gib_f16/bf16"] == pytest.approx(16.0)
    # issue 31: q4_0 printed 4.00 GiB here, the 4 bits alone; with its block scales, 4.5
    assert l2["kv_gib_q4_0"] == pytest.approx(4.5)
    assert all(s.startswith("https://huggingface.co/") for s in t["source"])


def test_kv_table_scales_linearly_with_context():
    a = kvcache.kv_table(context_tokens=1000)["kv_gib_f16/bf16"]
    b = kvcache.kv_table(context_tokens=4000)["kv_gib_f16/bf16"]
    assert (b / a).round(9).eq(4).all()


@pytest.mark.slow
def test_loops_match_on_the_embedded_model(transformers_engine):
    import torch
    ids = torch.tensor([transformers_engine.prompt_ids("Name three primary colors.")])
    naive = list(kvcache.naive_decode(transformers_engine.model, ids, 8))
    cached = list(kvcache.cached_decode(transformers_engine.model, ids, 8))
    assert naive == cached


@pytest.mark.slow
def test_llamacpp_state_growth_matches_the_card(llamacpp_engine):
    from infercourse.models.modelcard import model_card
    card = model_card(llamacpp_engine.model.path)
    m = kvcache.state_kv_bytes_per_token(llamacpp_engine, (16, 144))
    predicted = card.kv_bytes_per_token(2)     # llama.cpp's default K and V type is f16
    # the snapshot also stores ~12 bytes of metadata per cell: allow 1 %
    assert m["kv_bytes_per_token"] == pytest.approx(predicted, rel=0.01)
    assert m["state_bytes"][1] > m["state_bytes"][0]


@pytest.mark.slow
def test_state_measure_rejects_lengths_past_the_context(llamacpp_engine):
    from infercourse.core.errors import ContextLayerError
    with pytest.raises(ContextLayerError):
        kvcache.state_kv_bytes_per_token(llamacpp_engine, (16, 10**6))


def test_run_loops_rows_agreement_and_saved_run(tmp_path):
    from infercourse.measure.results import load_run
    model, torch = _tiny_model(0)
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    df = kvcache.run_loops(model, ids, 6, results_root=tmp_path)
    assert df.attrs["same_tokens"] is True
    assert len(df) == 12 and set(df["loop"]) == {"no cache", "KV cache"}
    assert df[df["loop"] == "KV cache"]["context_tokens"].tolist() == list(range(10, 16))
    assert (df["step_s"] > 0).all()
    for _, g in df.groupby("loop"):   # elapsed is the running sum of the step times
        assert g["elapsed_s"].iloc[-1] == pytest.approx(g["step_s"].sum())
    run = load_run(df.attrs["run_dir"])
    assert len(run.traces) == 2 and all(len(t.chunk_t) == 6 for t in run.traces)


def test_hf_cache_bytes_match_the_formula():
    model, torch = _tiny_model(0)   # 3 layers, 2 KV heads, head dim 64/4 = 16, float32
    m = kvcache.hf_cache_bytes(model, torch.zeros((1, 7), dtype=torch.long))
    assert m["dtype"] == "float32" and m["tokens"] == 7
    assert m["bytes_per_token"] == kvcache.kv_bytes_per_token(3, 2, 16, 4) == 768


def test_cache_keyword_is_the_one_forward_takes_and_the_cache_fills():
    model, torch = _tiny_model()
    import inspect
    kw = kvcache.cache_keyword(model)
    assert kw in inspect.signature(model.forward).parameters
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    got = kvcache.hf_cache_bytes(model, ids)
    # 2 (K, V) x 3 layers x 2 KV heads x 16 dims x 4 bytes (float32) per token
    assert got["tokens"] == 7 and got["bytes_per_token"] == 2 * 3 * 2 * 16 * 4


def _loop_rows(naive_steps, cached_steps):
    import pandas as pd
    rows = []
    for name, st in (("no cache", naive_steps), ("KV cache", cached_steps)):
        el = 0.0
        for k, s in enumerate(st):
            el += s
            rows.append({"loop": name, "step": k, "step_s": s, "elapsed_s": el})
    return pd.DataFrame(rows)


def test_step_trend_calls_a_trend_only_when_the_quarters_do_not_overlap():
    rising = [1.0] + [0.01 * (10 + i) for i in range(16)]
    assert kvcache.step_trend(rising) == "climbs"
    assert kvcache.step_trend(rising[:1] + rising[:0:-1]) == "falls"
    assert kvcache.step_trend([1.0] + [0.02, 0.03] * 8) == "flat"
    assert kvcache.step_trend([1.0, 0.1, 0.2, 0.3]) == "too few steps"


def test_explain_loops_flips_with_the_numbers():
    naive = [1.0] + [0.01 * (10 + i) for i in range(16)]       # climbing, 2.8 s in all
    cached = [1.0] + [0.02, 0.03] * 8                          # flat, 1.4 s in all
    text = kvcache.explain_loops(_loop_rows(naive, cached), work_ratio=5.0)
    assert "**climbed**" in text and "cached loop's stayed **flat**" in text and "*less* than the 5.0×" in text
    text = kvcache.explain_loops(_loop_rows(naive, cached), work_ratio=1.5)
    assert "*not less* than the 1.5×" in text
    text = kvcache.explain_loops(_loop_rows(cached, naive), work_ratio=5.0)
    assert "naive loop's step time stayed **flat**" in text and "cached loop's **climbed**" in text


class _SleepyModel:
    """Stands in for a causal LM: sleeps a fixed time per position it is given (a lower
    bound on any machine) and returns zero logits."""

    def __init__(self, s_per_position):
        self.s = s_per_position

    def __call__(self, ids, **kw):
        import time
        import torch
        from types import SimpleNamespace
        time.sleep(self.s * ids.shape[1])
        return SimpleNamespace(logits=torch.zeros((1, 1, 8)))


def test_loop_seconds_times_the_whole_loop():
    torch = pytest.importorskip("torch")
    ids = torch.zeros((1, 10), dtype=torch.long)
    t = kvcache.loop_seconds(_SleepyModel(1e-3), ids, 5)
    # every step's positions were slept through: 10 + 11 + 12 + 13 + 14 of them
    assert t >= 1e-3 * kvcache.tokens_processed(10, 5, cached=False)
    model, _ = _tiny_model(0)
    assert kvcache.loop_seconds(model, torch.randint(0, 256, (1, 8)), 4, cached=True) > 0


@pytest.mark.slow
def test_state_bytes_lies_on_the_measured_line(llamacpp_engine):
    from infercourse.core.errors import ContextLayerError
    m = kvcache.state_kv_bytes_per_token(llamacpp_engine, (16, 80))
    got = kvcache.state_bytes(llamacpp_engine, 144)
    assert got == pytest.approx(m["state_bytes"][1] + m["kv_bytes_per_token"] * (144 - 80), rel=1e-6)
    with pytest.raises(ContextLayerError):
        kvcache.state_bytes(llamacpp_engine, 10**6)


def test_block_cache_types_count_their_scales_like_the_block_lesson():
    """One source of truth for llama.cpp's block sizes: the cache types' bytes per value are
    the block arithmetic of notebook 06 (quant_blocks.block_bytes), not 1 and 0.5."""
    import numpy as np
    from infercourse.lessons import quant_blocks as qb
    x = np.linspace(-1, 1, qb.BLOCK)
    for name, quantize in (("q8_0", qb.quantize_q8_0), ("q4_0", qb.quantize_q4_0)):
        one_block = qb.block_bytes(*quantize(x), name.upper())       # as written into a GGUF
        assert kvcache.DTYPE_BYTES[name] == len(one_block) / qb.BLOCK
    assert kvcache.DTYPE_BYTES["q8_0"] == 34 / 32 and kvcache.DTYPE_BYTES["q4_0"] == 18 / 32

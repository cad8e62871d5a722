"""Prefill sweeps on a fake engine with known per-token costs; intensity arithmetic by hand."""
import time

import pytest

from infercourse.lessons import prefill_decode as sweeps
from infercourse.measure import roofline
from infercourse.core.types import Event, Usage
from infercourse.core.errors import EngineLayerError

PREFILL_S_PER_TOKEN, DECODE_S = 0.0004, 0.002


class FakeEngine:
    """Whitespace tokenizer (plus BOS); prefill sleeps per prompt token, decode per token,
    and reports llama.cpp-style timings."""

    name = "fake"

    def __init__(self):
        self.seen = []

    def tokenize(self, text):
        return [1] + text.split()

    def stream(self, request):
        n = len(self.tokenize(request.prompt))
        self.seen.append((n, request.cache_prompt, request.ignore_eos))
        time.sleep(n * PREFILL_S_PER_TOKEN)
        for _ in range(request.max_tokens):
            yield Event(t=time.perf_counter(), text="x ", n_tokens=1)
            time.sleep(DECODE_S)
        yield Event(t=time.perf_counter(), done=True, usage=Usage(n, request.max_tokens),
                    finish_reason="length",
                    timings={"prompt_n": n, "prompt_ms": n * PREFILL_S_PER_TOKEN * 1e3,
                             "predicted_n": request.max_tokens - 1,
                             "predicted_ms": (request.max_tokens - 1) * DECODE_S * 1e3})

    def describe(self):
        return {"engine": self.name}


def test_prefill_sweep_rows_lengths_and_engine_timings(tmp_path):
    eng = FakeEngine()
    df = sweeps.prefill_sweep(eng, [8, 64, 256], max_tokens=5, repeats=2, results_root=tmp_path)
    assert len(df) == 6 and sorted(df["prompt_len"]) == [8, 8, 64, 64, 256, 256]
    assert (df["prompt_tokens"] == df["prompt_len"]).all()          # exact lengths reached
    assert all(not c and e for _, c, e in eng.seen)                  # no prefix reuse, forced length
    assert len(eng.seen) == 7                                        # + 1 warm-up request
    # The client's clock: a sleep never ends early, so TTFT is at least the prefill; how much
    # later it came depends on how busy this machine is, so no upper bound and no ordering.
    assert (df["ttft_s"] >= df["prompt_len"] * PREFILL_S_PER_TOKEN).all()
    # The engine's own timings are exact: prefill grows with the prompt, per token
    assert df["engine_prefill_s"].tolist() == pytest.approx(df["prompt_len"] * PREFILL_S_PER_TOKEN)
    assert df["engine_decode_tok_per_s"].iloc[0] == pytest.approx(1 / DECODE_S)
    assert (tmp_path / df.attrs["run_dir"].split("/")[-1] / "manifest.json").exists()


def test_prompts_differ_between_repeats():
    reqs = sweeps.length_requests(FakeEngine(), [32], repeats=3)
    assert len({r.prompt for r in reqs}) == 3


def test_timeline_returns_one_trace(tmp_path):
    tr = sweeps.timeline(FakeEngine(), prompt_tokens=100, max_tokens=4, results_root=tmp_path)
    assert tr.prompt_tokens == 100 and len(tr.chunk_t) == 4


def test_engine_without_tokenizer_is_an_engine_layer_error():
    class Remote:
        name = "remote"
    with pytest.raises(EngineLayerError):
        sweeps.length_requests(Remote(), [16])


def test_arithmetic_intensity_and_balance_by_hand():
    card = {"n_params": 100_000_000, "weight_bytes": 50_000_000}
    assert roofline.arithmetic_intensity(card, 1) == pytest.approx(4.0)      # 2e8 FLOP / 5e7 B
    assert roofline.arithmetic_intensity(card, 256) == pytest.approx(1024.0)
    # 100 GFLOP/s over 10 GB/s = 10 FLOP/byte balance; decode does 4, so 2.5 tokens per pass
    assert roofline.balance_tokens(card, 100.0, 10.0) == pytest.approx(2.5)


def test_measure_ceilings_are_positive_and_labelled():
    m = sweeps.measure_ceilings(1, size_mb=32, matmul_n=256)
    assert m["bandwidth_gbs"] > 0.1 and m["gflops"] > 0.1 and m["threads"] == 1


def _sweep(ttft, prefill, decode):
    """A synthetic sweep frame: one row per (length, value) given as {length: [values]}."""
    import pandas as pd
    rows = [{"prompt_len": n, "ttft_s": t, "prefill_tok_per_s": p, "decode_tok_per_s": d}
            for n in ttft for t, p, d in zip(ttft[n], prefill[n], decode[n])]
    return pd.DataFrame(rows)


def test_explain_phases_sentences_flip_with_the_numbers():
    ceil = lambda ctx: 100.0
    # prefill far cheaper per token, TTFT in proportion, decode falling beyond the repeats' spread
    df = _sweep({16: [0.016, 0.016], 1024: [1.024, 1.024]}, {16: [1000, 1000], 1024: [1000, 1000]},
                {16: [50.0, 51.0], 1024: [40.0, 40.5]})
    text = sweeps.explain_phases(df, slope_s=0.001, prefill_ceiling=2000.0, decode_ceiling=ceil)
    assert "about in proportion" in text and "prefill was the cheaper phase here, **19.8×**" in text
    assert "**falling**" in text and "50% of the float32 matmul ceiling" in text
    # a fixed cost dominates TTFT, prefill no cheaper than decode, decode flat in its noise
    df = _sweep({16: [0.5, 0.5], 1024: [1.0, 1.0]}, {16: [30, 30], 1024: [30, 30]},
                {16: [50.0, 60.0], 1024: [55.0, 56.0]})
    text = sweeps.explain_phases(df, slope_s=0.0005, prefill_ceiling=2000.0, decode_ceiling=ceil)
    assert "less than in proportion" in text and "*not* the cheaper phase" in text and "**flat**" in text
    # one request per length: no noise band, so the decode trend is not judged
    df = _sweep({16: [0.01], 1024: [2.0]}, {16: [600], 1024: [600]}, {16: [50.0], 1024: [40.0]})
    text = sweeps.explain_phases(df, slope_s=0.002, prefill_ceiling=2000.0, decode_ceiling=ceil)
    assert "more than in proportion" in text and "not judged" in text and "about the same" not in text


def test_roofline_prediction_is_only_a_prediction():
    card = {"n_params": 100_000_000, "weight_bytes": 50_000_000}       # 4 FLOP/byte per token
    assert sweeps.roofline_prediction(card, 1, balance=10.0) == "predicts bandwidth-bound"
    assert sweeps.roofline_prediction(card, 1, balance=3.0) == "predicts compute-bound"
    assert sweeps.roofline_prediction(card, 256, balance=10.0) == "predicts compute-bound"
    assert not hasattr(sweeps, "bound")            # no label from arithmetic intensity alone


def test_thread_scaling_interleaves_n_its_rerun_and_2n():
    one, two = FakeEngine(), FakeEngine()
    df = sweeps.thread_scaling({1: one, 2: two}, prompt_tokens=12, max_tokens=3, repeats=3)
    assert df.attrs["threads"] == (1, 2) and len(df) == 9
    assert sorted(df["arm"].unique()) == ["1", "1 (A/A)", "2"] and (df.groupby("arm")["rep"].nunique() == 3).all()
    assert len(one.seen) == 1 + 6 and len(two.seen) == 1 + 3       # a warm-up each, then n and its rerun on `one`
    assert all(n == 12 and not cached for n, cached, _ in one.seen)
    assert df["decode_tok_per_s"].gt(0).all() and df["prefill_tok_per_s"].gt(0).all()


def _checks(decode2, prefill2):
    import pandas as pd
    rows = []
    for rep in range(4):
        for arm, d, p in (("1", 50.0, 800.0), ("1 (A/A)", 50.5 - rep % 2, 805.0 - 10 * (rep % 2)), ("2", decode2, prefill2)):
            rows.append({"arm": arm, "rep": rep, "decode_tok_per_s": d + 0.1 * rep, "prefill_tok_per_s": p + rep})
    df = pd.DataFrame(rows)
    df.attrs["threads"] = (1, 2)
    return df


def test_phase_regimes_read_each_phase_from_the_run():
    import pandas as pd
    card = {"n_params": 134.5e6, "weight_bytes": 96.6e6, "n_layers": 30, "n_kv_heads": 3, "head_dim": 64,
            "vocab_size": 49152, "hidden_size": 576}
    by_len = pd.DataFrame({"prefill_tok_per_s": [300.0, 900.0, 800.0], "decode_tok_per_s": [54.1, 53.0, 50.0]},
                          index=pd.Index([16, 256, 1024], name="prompt_len"))
    machine = {"bandwidth_gbs": 16.2, "threads": 1, "gflops": 150.0, "gflops_source": "torch float32 matmul, 1 thread",
               "bandwidth": {"size_mb": 1920, "by_threads": {1: 16.2, 2: 17.0}}}
    roof = sweeps.kernel_roof(by_len, card, machine, float32_kernel=False)
    assert roof[0] == pytest.approx(roofline.achieved_gflops(900.0, card, "prefill")) and "256 tokens" in roof[1]
    assert sweeps.kernel_roof(by_len, card, machine, float32_kernel=True) == (150.0, machine["gflops_source"])
    r = sweeps.phase_regimes(by_len, card, machine, roof, checks=_checks(95.0, 1500.0))
    dec, pre = r["decode"], r["prefill"]
    assert dec.label == "neither: kernel/overhead-bound" and dec.threads.gained and dec.judged
    assert "1,920 MiB array on 1 thread" in dec.text and "1.05× as much on 2 threads" in dec.text
    assert pre.label == "compute-bound" and pre.memory_share < 0.05
    # decode near the bandwidth roof, and a second thread adding no more than noise: bandwidth-bound
    near = by_len.assign(decode_tok_per_s=[140.0, 140.0, 130.0])
    r = sweeps.phase_regimes(near, card, machine, roof, checks=_checks(50.2, 1500.0))
    assert r["decode"].label == "bandwidth-bound" and not r["decode"].threads.gained
    assert sweeps.phase_regimes(by_len, card, machine, roof)["decode"].threads is None


class ShapeRecorder(FakeEngine):
    """FakeEngine that also records each request's output length."""

    def stream(self, request):
        self.max_tokens = getattr(self, "max_tokens", []) + [request.max_tokens]
        yield from super().stream(request)


class SmallContext(FakeEngine):
    flags = {"n_ctx": 100}


def test_ttft_at_sends_one_output_token_and_checks_the_context(tmp_path):
    from infercourse.core.errors import ContextLayerError
    eng = ShapeRecorder()
    t = sweeps.ttft_at(eng, 200, results_root=tmp_path)
    assert len(eng.seen) == 2 and eng.seen[-1][0] == 200 and eng.max_tokens == [1, 1]   # warm-up + measured
    assert t >= 200 * PREFILL_S_PER_TOKEN        # a sleep never ends early: a lower bound only
    with pytest.raises(ContextLayerError, match="n_ctx=100"):
        sweeps.ttft_at(SmallContext(), 100)      # 100 prompt + 1 output token
    assert sweeps.ttft_at(SmallContext(), 99, results_root=tmp_path) > 0


def test_e2e_at_covers_prefill_and_every_decode_step(tmp_path):
    from infercourse.core.errors import ContextLayerError
    eng = ShapeRecorder()
    e = sweeps.e2e_at(eng, 50, 10, results_root=tmp_path)
    assert eng.max_tokens == [10, 10]
    assert e >= 50 * PREFILL_S_PER_TOKEN + 9 * DECODE_S     # TTFT plus nine more steps, at least
    with pytest.raises(ContextLayerError):
        sweeps.e2e_at(SmallContext(), 95, 10)

"""Notebook 12's library: the llama.cpp log's buffers, the memory line and its inverse; real
servers for the KV cache's residency, context shift and the host-RAM prompt cache."""
import pandas as pd
import pytest

from infercourse.lessons import memory as mem
from infercourse.models.modelcard import model_card

# The lines llama.cpp prints while loading (this build's formats), from two loads in one log.
LOG = """llama_model_loader: loaded meta data with 33 key-value pairs
load_tensors:   CPU_Mapped model buffer size =    99.00 MiB
llama_kv_cache:        CPU KV buffer size =    10.00 MiB
llama_context:        CPU compute buffer size =     5.00 MiB
llama_model_loader: loaded meta data with 33 key-value pairs
load_tensors:   CPU_Mapped model buffer size =    85.96 MiB
load_tensors:   CPU_REPACK model buffer size =     2.50 MiB
llama_kv_cache:        CPU KV buffer size =    45.00 MiB
llama_kv_cache: size =   45.00 MiB (  2048 cells,  30 layers,  1/1 seqs), K (f16):   22.50 MiB, V (f16):   22.50 MiB
llama_context:        CPU compute buffer size =    66.51 MiB
"""


def test_log_buffers_reads_the_last_load():
    b = mem.log_buffers(LOG)
    assert b["model_mib"] == pytest.approx(88.46) and b["kv_mib"] == 45.0
    assert b["compute_mib"] == 66.51 and b["kv_cells"] == 2048


def test_prediction_and_its_inverse():
    card = model_card()
    p = mem.predict_memory(card, 2048)
    assert p["kv_mib"] == pytest.approx(card.kv_bytes_per_token(2) * 2048 / 2**20)
    assert mem.predict_memory(card, 2048, "q8_0")["kv_mib"] == pytest.approx(p["kv_mib"] * 17 / 32)
    pts = pd.DataFrame({"ctx_size": [1024, 8192], "rss_mib": [200.0, 200.0 + 7168 * 0.025]})
    line = mem.rss_line(pts)
    assert line["mib_per_token"] == pytest.approx(0.025) and line["fixed_mib"] == pytest.approx(174.4)
    n = mem.max_context(line, 500.0)
    assert n % 256 == 0 and line["fixed_mib"] + n * 0.025 <= 500 < line["fixed_mib"] + (n + 256) * 0.025
    assert mem.max_context(line, 500.0, n_parallel=4) % 1024 == 0


@pytest.mark.slow
def test_kv_cache_is_resident_and_matches_the_card():
    card = model_card()
    small, big = (mem.measure_server(None, c, threads=1) for c in (512, 4096))
    assert big["kv_cells"] == 4096 and big["kv_mib"] == pytest.approx(card.kv_bytes_per_token(2) * 4096 / 2**20, rel=0.01)
    grew = (big["rss_mib"] - small["rss_mib"]) * 2**20 / (4096 - 512)
    assert 0.8 * card.kv_bytes_per_token(2) <= grew <= 2.5 * card.kv_bytes_per_token(2)


@pytest.mark.slow
def test_context_shift_lets_generation_pass_a_full_slot():
    t = mem.context_shift_demo(slot_ctx=256, prompt_tokens=32, n_predict=300, threads=1)
    assert t.loc["--no-context-shift", "tokens_predicted"] < 300
    assert t.loc["--context-shift", "tokens_predicted"] == 300


@pytest.mark.slow
def test_ram_cache_restores_an_evicted_prefix():
    t = mem.cache_ram_demo(prompt_tokens=256, threads=1, cache_ram_mib=(0, 64))
    again = t[t["request"] == "A again"].set_index("cache_ram_mib")
    assert again.loc[64, "cache_n"] > again.loc[0, "cache_n"]
    assert again.loc[64, "prompt_n"] < again.loc[0, "prompt_n"]


@pytest.mark.slow
def test_quantized_kv_costs_little_quality():
    f16, q8 = mem.kv_type_nll(None, "f16", n_threads=1), mem.kv_type_nll(None, "q8_0", n_threads=1)
    assert 0 < f16 < 10 and abs(q8 - f16) < 0.05


def test_decode_speeds_are_judged_against_the_reference_rerun():
    from infercourse.lessons.memory import _judged
    speeds = {"f16": [100, 102, 98, 101, 99, 100], "q4_0": [60, 61, 59, 60, 62, 58],
              "q8_0": [99, 101, 100, 100, 98, 102], "A/A": [97, 103, 100, 99, 101, 100]}
    rows, floor = _judged(speeds, "f16", "A/A")
    assert "A/A" not in rows and rows["f16"]["verdict"] == "reference" and floor.floor > 0.01
    assert rows["q4_0"]["verdict"] == "f16 faster" and rows["q4_0"]["vs_f16"] == pytest.approx(0.6, abs=0.02)
    assert rows["q8_0"]["verdict"] == "within noise"
    one, none = _judged({"f16": [100.0], "q8_0": [90.0]}, "f16", "A/A")
    assert none is None and one["q8_0"]["verdict"] == "1 run: not judged"


def test_context_shape_uses_the_tables_own_estimator(monkeypatch):
    """Issue 31, 12 cell 14: the table said 0.83 [0.79, 0.85] (median of paired ratios) and the
    sentence 'measured 0.84' (a ratio of medians). Both now come from the `vs_` column: speeds
    whose two estimators differ must print the paired one, in the table, sentence and plot."""
    from infercourse.measure import noise
    # paired ratios 0.5, 0.8, 0.9: median 0.8; medians 100 and 50: ratio 0.5
    speeds = {"64 tokens": [100.0, 120.0, 50.0], "1536 tokens": [50.0, 96.0, 45.0], "A/A": [101.0, 119.0, 51.0]}
    monkeypatch.setattr(noise, "run_interleaved", lambda arms, repeats, warmup=0: speeds)
    card = {"n_layers": 30, "n_kv_heads": 3, "head_dim": 64, "weight_bytes": 96_600_000, "n_params": 134_500_000}
    growth = mem.decode_vs_context(None, lambda text: [0] * len(text.split()), [64, 1536], card=card,
                                   bandwidth_gbs=20.0, repeats=3)
    paired = growth.loc[1536, "vs_64 tokens"]
    assert paired == pytest.approx(0.8) and growth.loc[1536, "decode_tok_per_s"] / growth.loc[64, "decode_tok_per_s"] \
        == pytest.approx(0.5)
    rel = mem.shapes_vs_context(growth)
    assert rel.loc[1536, "measured"] == pytest.approx(0.8) and rel.loc[64, "measured"] == pytest.approx(1.0)
    text = mem.shape_sentence(growth)
    assert "measured 0.80" in text and "measured 0.50" not in text

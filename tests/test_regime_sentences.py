"""Issue 32 §1: 06, 07 and 08 label each decode from the run (its share of the bandwidth roof and of
a compute roof of its own data type), and their sentences flip with synthetic numbers."""
from __future__ import annotations

import re

import pandas as pd
import pytest

from infercourse.lessons import quant_explain, quant_regime, spec_claims
from infercourse.measure.stream_regime import NEITHER

CARD = {"n_params": 134.5e6, "weight_bytes": 96.6e6, "vocab_size": 49152, "hidden_size": 576}
BW = 16.2


def says(text: str, label: str) -> bool:
    return re.search(rf"\*\*{re.escape(label)}\*\*", text) is not None


def _ladder(rates: dict[str, float]) -> pd.DataFrame:
    """`measure_ladder`-like rows: each file's ceiling from its weight bytes at BW."""
    size = {"F16": 270e6, "Q8_0": 144e6, "Q2_K": 70e6}
    return pd.DataFrame([{"quant": q, "decode_tok_per_s": r, "decode_ceiling_tok_per_s": BW * 1e9 / size[q]}
                         for q, r in rates.items()])


def test_ladder_regimes_flip_between_memory_and_neither():
    roofs = {"F16": 120.0, "Q8_0": 400.0, "Q2_K": 150.0}        # each file's own prefill roof (tok/s)
    slow = quant_regime.ladder_regimes(_ladder({"F16": 20.0, "Q8_0": 40.0, "Q2_K": 30.0}), roofs, CARD, BW)
    assert {r.label for r in slow.values()} <= {NEITHER, "not bandwidth-bound", "too close to call"}
    assert slow["Q8_0"].label == NEITHER and "its own prefill, 400 tok/s on 256 tokens" in slow["Q8_0"].text
    text = quant_regime.regime_lines(slow)
    assert says(text, "none") and "fewer bytes alone could not make it faster" in text
    fast = quant_regime.ladder_regimes(_ladder({"F16": 50.0, "Q8_0": 95.0, "Q2_K": 30.0}), roofs, CARD, BW)
    assert fast["F16"].label == "bandwidth-bound" and fast["Q8_0"].label == "bandwidth-bound"
    text = quant_regime.regime_lines(fast)
    assert "roof): F16, Q8_0." in text and not says(text, "none")
    # a file without a roof is not split into compute or kernel
    nor = quant_regime.ladder_regimes(_ladder({"Q8_0": 40.0}), {}, CARD, BW)
    assert nor["Q8_0"].label == "not bandwidth-bound" and "no long-prompt prefill" in nor["Q8_0"].text


def test_method_regimes_give_only_fp32_a_compute_roof():
    df = pd.DataFrame([{"format": "fp32", "weight_bytes": 538e6, "decode_tok_per_s": 24.0},
                       {"format": "bnb-nf4", "weight_bytes": 150e6, "decode_tok_per_s": 8.0},
                       {"format": "broken", "weight_bytes": 1e6, "decode_tok_per_s": float("nan")}])
    r = quant_explain.method_regimes(df, 134.5e6, BW, f32_gflops=150.0, f32_source="torch float32 matmul, 1 thread")
    assert set(r) == {"fp32", "bnb-nf4"}                       # a row that did not run is left out
    assert r["fp32"].label == "bandwidth-bound"                 # 24 tok/s x 538 MB = 80 % of 16.2 GB/s
    assert r["fp32"].memory_share > 0.5 and r["bnb-nf4"].label == "not bandwidth-bound"
    assert "no probe runs this format's kernel" in r["bnb-nf4"].text
    text = quant_explain.regime_text(r)
    assert "roof: fp32." in text
    df.loc[0, "decode_tok_per_s"] = 6.0                         # the reference far below its roof
    low = quant_explain.method_regimes(df, 134.5e6, BW, f32_gflops=150.0, f32_source="x")
    assert low["fp32"].label == NEITHER and says(quant_explain.regime_text(low), "no format")


def test_baseline_regimes_say_whether_verification_is_nearly_free():
    machine = {"bandwidth_gbs": BW, "gflops": 150.0, "gflops_source": "torch float32 matmul, 1 thread", "threads": 1,
               "bandwidth": {"size_mb": 1920}}
    weights = {"hf": (538e6, True), "llama.cpp": (96.6e6, False)}
    df = pd.DataFrame({"config": ["hf", "hf", "llama.cpp", "llama.cpp"], "decode_tok_per_s": [25.0, 26.0, 50.0, 54.0]})
    r = spec_claims.baseline_regimes(df, weights, 134.5e6, machine)
    assert r["hf"].label == "bandwidth-bound" and r["llama.cpp"].label == "not bandwidth-bound"
    assert r["hf"].rate == 25.5
    text = spec_claims.regime_text(r)
    assert "holds for hf." in text and "no baseline" not in text
    df["decode_tok_per_s"] = [10.0, 10.0, 50.0, 54.0]
    text = spec_claims.regime_text(spec_claims.baseline_regimes(df, weights, 134.5e6, machine))
    assert says(text, "no baseline") and "holds for hf" not in text


@pytest.mark.slow
def test_kernel_roofs_read_a_prefill_rate_from_llama_cpp():
    from infercourse.models.embedded import embedded_gguf
    roofs = quant_regime.kernel_roofs({"Q4_1": embedded_gguf()}, n_tokens=32, repeats=1)
    assert set(roofs) == {"Q4_1"} and roofs["Q4_1"] > 0

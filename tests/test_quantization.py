"""Quantization ladder: agreement and paired-NLL arithmetic, where a file really came from,
and (slow) a two-rung ladder measured end to end."""
import numpy as np
import pytest

from infercourse.core.errors import ModelLayerError
from infercourse.lessons.quantization import greedy_agreement, levels_per_block, paired_nll_difference


def test_greedy_agreement_stops_at_first_difference():
    ref = ["The", " cat", " sat", " down"]
    assert greedy_agreement(ref, ref) == 1.0
    assert greedy_agreement(ref, ["The", " cat", " ran", " down"]) == 0.5  # later match not counted
    assert greedy_agreement(ref, ["A"]) == 0.0
    with pytest.raises(ValueError):
        greedy_agreement([], ref)


def test_paired_nll_difference():
    a = np.array([1.0, 2.0, 3.0, 4.0])
    m, se = paired_nll_difference(a + 0.5, a)
    assert m == pytest.approx(0.5) and se == pytest.approx(0.0)
    m, se = paired_nll_difference(np.array([1.0, 3.0]), np.array([2.0, 2.0]))
    assert m == pytest.approx(0.0) and se == pytest.approx(1.0)
    with pytest.raises(ModelLayerError):
        paired_nll_difference(a, a[:3])


@pytest.mark.slow
def test_f16_file_holds_4bit_blocks():
    """The derived F16 was dequantized from Q4_1: <= 16 levels per 32-weight block, while
    the Q8_0 embedding (256 levels) fills its blocks."""
    from infercourse.models.formats import f16_gguf
    from infercourse.models.embedded import embedded_gguf
    f16 = f16_gguf()
    lv = levels_per_block(f16, ["blk.3.ffn_up.weight", "token_embd.weight"])
    assert lv["blk.3.ffn_up.weight"]["max"] <= 16
    assert lv["token_embd.weight"]["max"] > 16
    with pytest.raises(ModelLayerError):
        levels_per_block(embedded_gguf(), ["blk.3.ffn_up.weight"])  # stored as Q4_1
    with pytest.raises(ModelLayerError):
        levels_per_block(f16, ["no.such.tensor"])


@pytest.mark.slow
def test_measure_ladder_two_rungs():
    from infercourse.models.embedded import embedded_gguf
    from infercourse.models.quality import PARAGRAPH
    from infercourse.lessons.quantization import ladder_paths, measure_ladder
    paths = ladder_paths(["Q8_0"])
    assert paths["Q4_1 (original)"] == embedded_gguf()
    df = measure_ladder(paths, ["Say hello."], max_tokens=8, eval_text=PARAGRAPH,
                        bandwidth_gbs=10.0).set_index("quant")
    assert df.loc["F16", "greedy_agreement"] == 1.0               # the reference itself
    assert df.loc["Q8_0", "file_bytes"] < 0.7 * df.loc["F16", "file_bytes"]
    assert 15 < df.loc["F16", "bits_per_weight"] < 17 and 8 < df.loc["Q8_0", "bits_per_weight"] < 9
    assert (df["rss_delta_bytes"] > 0).all() and (df["decode_tok_per_s"] > 0).all()
    # MBU is the measured speed over the ceiling that the *given* bandwidth implies; no bound
    # on its size holds on every machine (a fast one beats any fixed bandwidth), so check its
    # definition against the bytes each rung reads, which the file fixes.
    assert df["mbu"].to_numpy() == pytest.approx(
        (df["decode_tok_per_s"] / df["decode_ceiling_tok_per_s"]).to_numpy())
    assert (df["decode_ceiling_tok_per_s"] * df["weight_bytes"] < 10e9).all()   # KV adds bytes
    assert df.loc["F16", "decode_ceiling_tok_per_s"] < df.loc["Q8_0", "decode_ceiling_tok_per_s"]
    # F16 holds exactly Q4_1's weights (rounded to fp16): same perplexity within 1 %
    assert df.loc["F16", "perplexity"] == pytest.approx(df.loc["Q4_1 (original)", "perplexity"], rel=0.01)
    with pytest.raises(ModelLayerError):
        measure_ladder(paths, ["x"], reference="Q9")


@pytest.mark.slow
def test_ladder_table_agrees_with_the_gguf_reader():
    """llama.cpp's loaded weight bytes equal the tensor bytes gguf-py reads from the file."""
    from infercourse.models.modelcard import model_card
    from infercourse.models.embedded import embedded_gguf
    from infercourse.lessons.quantization import ladder_table
    t = ladder_table({"orig": embedded_gguf()}, bandwidth_gbs=10.0).iloc[0]
    card = model_card(embedded_gguf())
    assert t.weight_bytes == card.tensor_bytes and t.file_type == "Q4_1"
    assert t.bits_per_weight == pytest.approx(card.bits_per_weight)
    assert t.decode_ceiling_tok_per_s == pytest.approx(10e9 / card.tensor_bytes)

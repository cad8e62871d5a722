"""Quantization ladder: agreement and paired-NLL arithmetic, where a file really came from,
and (slow) a two-rung ladder measured end to end."""
import numpy as np
import pytest

from infercourse.core.errors import ModelLayerError
from infercourse.lessons.quant_claims import paired_nll_difference
from infercourse.lessons.quantization import greedy_agreement, levels_per_block


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


@pytest.mark.parametrize("seed", range(4))
def test_hand_quantized_blocks_match_gguf_py(seed):
    """Q8_0 and Q4_0 by hand: the block's extreme lands on the grid, errors stay under half a
    step (Q4_0: a full step only when clipped), and the bytes equal gguf-py's quantizer."""
    from gguf import GGMLQuantizationType, quants
    from infercourse.lessons import quant_blocks as qb
    x = np.random.default_rng(seed).normal(0, 0.05, 32).astype(np.float32)
    d, q = qb.quantize_q8_0(x)
    assert np.abs(q).max() == 127 and q.dtype == np.int8
    back = qb.dequantize(d, q, "Q8_0")
    # half a step, plus what storing d in fp16 adds at the far end of the grid (127 x d's rounding)
    assert np.abs(back - x).max() <= abs(float(d)) * (0.5 + 127 * 2 ** -11)
    assert qb.block_bytes(d, q, "Q8_0") == quants.quantize(x[None], GGMLQuantizationType.Q8_0).tobytes()
    d4, q4 = qb.quantize_q4_0(x)
    assert q4.min() >= 0 and q4.max() <= 15 and q4[np.abs(x).argmax()] == 0   # the extreme maps to -8
    err4 = np.abs(qb.dequantize(d4, q4, "Q4_0") - x)
    assert err4.max() <= abs(float(d4)) * 1.01 and np.median(err4) <= abs(float(d4)) / 2
    assert err4.max() > np.abs(back - x).max()                                  # 16 levels vs 255
    assert qb.block_bytes(d4, q4, "Q4_0") == quants.quantize(x[None], GGMLQuantizationType.Q4_0).tobytes()
    with pytest.raises(ValueError):
        qb.quantize_q8_0(x[:16])


@pytest.mark.slow
def test_hand_quantizer_reproduces_llama_quantize():
    """The block llama.cpp's quantizer wrote into the Q8_0 / Q4_0 GGUFs, byte for byte."""
    from infercourse.lessons import quant_blocks as qb
    from infercourse.models.formats import f16_gguf, quantized_gguf
    for qtype in ("Q8_0", "Q4_0"):
        for index in (0, 7):
            r = qb.compare_with_file(f16_gguf(), quantized_gguf(qtype), "blk.0.attn_q.weight", qtype, index)
            assert r["same_bytes_as_llamacpp"] and r["same_bytes_as_gguf_py"] and r["same_weights_as_llamacpp"]
    with pytest.raises(ModelLayerError):
        qb.compare_with_file(f16_gguf(), quantized_gguf("Q8_0"), "blk.0.attn_q.weight", "Q4_0")


def _tiny_gguf(path, x, types=("F32", "F16", "Q8_0")):
    """A GGUF with a 300-entry vocabulary and `x` stored once per type (a tuple of types: each
    tensor named by its type; a dict: {name: type})."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(300)])   # a vocabulary to skip
    for name, kind in (types.items() if isinstance(types, dict) else zip(types, types)):
        q = gguf.GGMLQuantizationType[kind]
        if kind in ("F32", "F16"):
            w.add_tensor(name, x.astype(np.float32 if kind == "F32" else np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, q), raw_dtype=q)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


def test_a_block_is_read_without_parsing_the_vocabulary(tmp_path, monkeypatch):
    """gguf-py's reader takes seconds on a real model's header (it parses every tokenizer
    entry); first_block reads the 32 weights at the offset the header gives, and they are the
    ones gguf-py finds, for every type the lesson reads."""
    import gguf
    from infercourse.lessons import quant_blocks as qb
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    path = _tiny_gguf(tmp_path / "tiny.gguf", x)
    found = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("parsed the whole header"))
    assert qb.first_block(path, "F32", 1)[0] == "F32" and (qb.first_block(path, "F32", 1)[1] == x[1]).all()
    kind, got = qb.first_block(path, "F16", 1)
    assert kind == "F16" and (got == found["F16"].reshape(-1)[32:].astype(np.float32)).all()
    kind, got = qb.first_block(path, "Q8_0", 1)
    assert kind == "Q8_0" and got.tobytes() == found["Q8_0"].reshape(-1).view(np.uint8)[34:68].tobytes()
    with pytest.raises(ModelLayerError):
        qb.first_block(path, "blk.9.attn_q.weight")


def test_the_lessons_read_tensors_from_the_header_as_gguf_py_does(tmp_path, monkeypatch):
    """tensor_types (06's ladder reads it for every file), tensor_rows, levels_per_block and
    07's grid_distance read the header by hand and map the weights at its offsets: the same
    arrays, types and byte counts gguf-py's reader gives, without it (seconds a real file)."""
    import gguf
    from gguf.quants import dequantize
    from infercourse.lessons import quant_grid, quantization as qz
    from infercourse.models.gguf_header import tensor_data, tensor_table
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 64)).astype(np.float32)
    path = _tiny_gguf(tmp_path / "tiny.gguf", x, ("F32", "F16", "BF16", "Q8_0", "Q4_1"))
    other = _tiny_gguf(tmp_path / "other.gguf", x, {"Q4_1": "Q8_0", "F32": "Q8_0"})   # "Q4_1" re-stored
    ref = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    ref_other = {t.name: t for t in gguf.GGUFReader(str(other)).tensors}
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("parsed the whole header"))
    table = tensor_table(path)
    for name, t in ref.items():
        got, want = tensor_data(path, table[name]), np.asarray(t.data)
        if name == "BF16":   # gguf-py gives its bytes; we give its 16 bits
            got = np.asarray(got).view(np.uint8)
        assert got.shape == want.shape and np.array_equal(got, want), name
    assert qz.tensor_types(path) == {t.tensor_type.name: {"count": 1, "bytes": int(t.n_bytes)} for t in ref.values()}
    rows = qz.tensor_rows(path).set_index("tensor")
    assert rows.loc["Q4_1", "types"] == "Q4_1" and rows["row_length"].eq(64).all() and len(rows) == 5
    levels = qz.levels_per_block(path, ["F32", "BF16"])
    bf16 = np.asarray(ref["BF16"].data).view(np.uint16).reshape(-1, 32)      # gguf-py's bytes, as 16 bits
    assert levels["F32"] == {"max": 32, "mean": 32.0, "blocks": 8}
    assert levels["BF16"]["mean"] == pytest.approx(np.mean([len(set(b)) for b in bf16]))
    with pytest.raises(ModelLayerError):
        qz.levels_per_block(path, ["Q4_1"])
    # 07's table: Q4_1 in the original against Q8_0 in the other, from gguf-py's own dequantization
    q41 = dequantize(np.asarray(ref["Q4_1"].data), gguf.GGMLQuantizationType.Q4_1).astype(np.float64)
    q8 = dequantize(np.asarray(ref_other["Q4_1"].data), gguf.GGMLQuantizationType.Q8_0).astype(np.float64)
    grid = quant_grid.grid_distance(path, other).set_index("tensor")
    assert list(grid.index) == ["Q4_1"]          # the one tensor stored as Q4_1 in the original
    row = grid.loc["Q4_1"]
    assert (row["type"], row["bits"], row["n"]) == ("Q8_0", 8, x.size)
    assert row["rms_to_q4_1"] == pytest.approx(np.sqrt(np.mean((q8 - q41) ** 2)), rel=1e-12)


@pytest.mark.slow
def test_tensor_rows_explains_the_fallbacks():
    from infercourse.lessons.quantization import tensor_rows
    from infercourse.models.formats import quantized_gguf
    t = tensor_rows(quantized_gguf("Q2_K")).set_index("tensor")
    assert t.loc["blk.N.ffn_down.weight", "row_length"] == 1536 and t.loc["blk.N.ffn_down.weight", "fits_256"]
    assert t.loc["blk.N.attn_q.weight", "row_length"] == 576 and not t.loc["blk.N.attn_q.weight", "fits_256"]
    # a tensor whose rows do not split into 256 cannot be a K-quant
    assert not t[~t["fits_256"]]["types"].str.contains("_K").any()


def test_cache_line_follows_the_numbers():
    """06 printed "cache 315 MB; the F16 weights are 269 MB, 1x more, so every token streams
    them from memory": the sentence now follows from the sizes and the measured MBU."""
    from infercourse.lessons.quant_claims import cache_line
    big = cache_line(32 * 2**20, 269e6, 0.37)
    assert "8.0× more" in big and "streams them from memory" in big
    fits = cache_line(315e6, 269e6, 0.37)
    assert "could fit" in fits and "85% of it" in fits and "bytes were not its limit" in fits
    assert "more" not in fits.split("(")[0]
    assert "stay cached" in cache_line(315e6, 269e6, 1.4)
    near = cache_line(315e6, 269e6, 0.81)          # issue 32: 81 % is near the ceiling, not "not its limit"
    assert "could be its limit" in near and "bytes were not its limit" not in near
    assert cache_line(None, 269e6, 0.37) == ""


def _ladder(speeds, mbu, agreement, nll_shift):
    """A synthetic `measure_ladder` table: F16, Q8_0, Q2_K, most bytes first; NLLs of Q8_0
    and Q2_K are F16's plus a noisy shift each."""
    import pandas as pd
    rng = np.random.default_rng(0)
    base = rng.uniform(1, 5, 400)
    df = pd.DataFrame({"quant": ["F16", "Q8_0", "Q2_K"], "weight_bytes": [270e6, 145e6, 60e6],
                       "bits_per_weight": [16.0, 8.5, 3.6], "decode_tok_per_s": speeds, "mbu": mbu,
                       "greedy_agreement": [1.0, *agreement]})
    df.attrs["token_nlls"] = {"F16": base, "Q8_0": base + nll_shift[0] + rng.normal(0, 0.05, 400),
                              "Q2_K": base + nll_shift[1] + rng.normal(0, 0.05, 400)}
    return df


def test_ladder_reading_flips_with_the_numbers():
    from infercourse.lessons.quant_claims import ladder_reading
    text = ladder_reading(_ladder([20, 35, 60], [0.5, 0.45, 0.3], [1.0, 0.4], (0.0, 0.5)))
    assert "rose at every step down in bytes" in text and "belongs to Q2_K" in text and "unpacking" in text
    assert "(same); Q2_K +0.49" in text and "clearly worse is **Q2_K**" in text
    assert "No file changed its greedy answers" in text
    text = ladder_reading(_ladder([20, 45, 40], [0.2, 0.6, 0.5], [0.5, 0.3], (0.0, 0.0)))
    assert "did not rise at every step" in text and "belongs to F16" in text and "conversion" in text
    assert "no file scored clearly worse" in text and "Q8_0 (50%), Q2_K (30%) kept F16's perplexity" in text


def test_same_scores_sentence_says_same_or_worse():
    from infercourse.lessons.quant_claims import same_scores_sentence
    a = np.linspace(1, 3, 100)
    assert "**the same**" in same_scores_sentence({"F16": a, "Q4_1": a}, "F16", "Q4_1")
    assert "**worse**" in same_scores_sentence({"F16": a + 0.1, "Q4_1": a}, "F16", "Q4_1")


@pytest.mark.slow
def test_file_bits_per_weight_counts_the_fallbacks():
    """Notebook 06, exercise 7: Q6_K on a 576-wide model is mostly its Q8_0 fallback; Q8_0 is
    34 bytes per 32 weights (8.5 bits) plus a sliver of F32 norms."""
    from infercourse.lessons.quantization import file_bits_per_weight
    q8 = file_bits_per_weight("Q8_0")
    assert 8.5 <= q8 < 8.52
    q6 = file_bits_per_weight("Q6_K")
    assert 7.9 < q6 < q8          # well above the name's 6.5625: only ffn_down rows split into 256


def test_tensor_types_counts_each_block_type_of_a_file():
    """What a file holds per storage type (the Memory line matches a file's excess against these)."""
    import os
    from infercourse.lessons.quantization import tensor_types
    from infercourse.models.embedded import embedded_gguf
    t = tensor_types(embedded_gguf())
    assert (t["Q4_1"]["count"], t["Q8_0"]["count"]) == (210, 1)            # the token embedding at Q8_0
    assert t["Q8_0"]["bytes"] % 34 == 0 and t["Q4_1"]["bytes"] % 20 == 0   # whole blocks
    assert 0.95 < sum(e["bytes"] for e in t.values()) / os.path.getsize(embedded_gguf()) < 1   # + header, vocab

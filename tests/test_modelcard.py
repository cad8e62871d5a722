"""Model cards: numbers read from files must match published facts and a second reader.

SmolLM2-135M (HuggingFaceTB model card / config.json): 30 layers, 9 attention heads,
3 KV heads, head dim 64, hidden 576, FFN 1536, vocab 49152, context 8192, rope theta 1e5,
tied embeddings. Parameter count from those: 134,515,008.
"""
from __future__ import annotations

import json
import shutil

import pytest

from infercourse.core.errors import ModelLayerError
from infercourse.models.modelcard import model_card
from infercourse.models.embedded import embedded_gguf

# Published architecture of SmolLM2-135M.
L, H, KV, HD, D, FFN, V, CTX = 30, 9, 3, 64, 576, 1536, 49152, 8192


@pytest.fixture(scope="session")
def hf_dir():
    """The derived HF folder (built once into the cache, shared with test_formats)."""
    pytest.importorskip("transformers", reason="transformers not installed: no HF folder")
    from infercourse.models.formats import hf_folder
    return hf_folder()


@pytest.fixture(scope="session")
def mlx_q4_dir():
    pytest.importorskip("mlx_lm", reason="mlx-lm not installed: no MLX folder")
    from infercourse.models.formats import mlx_folder
    return mlx_folder(4)


def _params_from_architecture() -> int:
    """Parameter count from the published shapes alone (tied embedding counted once)."""
    attn = D * H * HD + 2 * D * KV * HD + H * HD * D
    mlp = 3 * D * FFN
    return V * D + L * (attn + mlp + 2 * D) + D


def test_embedded_card_matches_published_architecture():
    card = model_card()
    assert card.kind == "gguf" and card.architecture == "llama"
    assert (card.n_layers, card.n_heads, card.n_kv_heads, card.head_dim) == (L, H, KV, HD)
    assert (card.hidden_size, card.vocab_size, card.context_length) == (D, V, CTX)
    assert card.rope_theta == 100000.0
    assert card.n_params == _params_from_architecture() == 134_515_008
    assert card.quantization == "Q4_1"
    # Q4_1 is 5 bits/weight (4 + fp16 scale and min per 32), the Q8_0 embedding 8.5 and the
    # f32 norms 32: the measured mix must lie between 5 and 8.5, and equal bytes/params.
    assert 5.0 < card.bits_per_weight < 8.5
    assert card.bits_per_weight == pytest.approx(8 * card.weight_bytes() / card.n_params)
    assert card.weight_bytes() < card.bytes_on_disk == embedded_gguf().stat().st_size
    assert len(card.sha256) == 64


def test_kv_bytes_per_token_formula():
    card = model_card()
    assert card.kv_bytes_per_token() == 2 * 30 * 3 * 64 * 2 == 23040
    assert card.kv_bytes_per_token(dtype_bytes=1) == 11520


@pytest.mark.slow
def test_gguf_card_agrees_with_llama_cpp():
    """llama.cpp's own loader counts parameters and bytes independently of our reader."""
    import llama_cpp
    card = model_card()
    llm = llama_cpp.Llama(model_path=str(embedded_gguf()), n_ctx=64, n_threads=1, verbose=False)
    try:
        m = llm.model
        assert llama_cpp.llama_model_n_params(m) == card.n_params
        assert llama_cpp.llama_model_size(m) == card.weight_bytes()
        assert llama_cpp.llama_model_n_layer(m) == card.n_layers
        assert llama_cpp.llama_model_n_head(m) == card.n_heads
        assert llama_cpp.llama_model_n_head_kv(m) == card.n_kv_heads
        assert llama_cpp.llama_model_n_embd(m) == card.hidden_size
        assert llama_cpp.llama_model_n_ctx_train(m) == card.context_length
        assert llm.n_vocab() == card.vocab_size
    finally:
        llm.close()


def test_card_outputs_for_manifests_and_notebooks():
    card = model_card()
    d = card.as_dict()
    assert d["n_params"] == card.n_params and d["kv_bytes_per_token_f16"] == 23040
    json.dumps(d)  # manifests are JSON
    frame = card.to_frame()
    assert dict(zip(frame.field, frame.value))["n_layers"] == 30
    assert "n_kv_heads" in card._repr_html_()


def test_truncated_gguf_is_a_model_layer_error(tmp_path):
    bad = tmp_path / "cut.gguf"
    with open(embedded_gguf(), "rb") as f:
        bad.write_bytes(f.read(4096))  # valid magic, header cut off mid-metadata
    with pytest.raises(ModelLayerError, match="not a readable GGUF"):
        model_card(bad)


def test_missing_and_foreign_files_are_model_layer_errors(tmp_path):
    with pytest.raises(ModelLayerError, match="not found"):
        model_card(tmp_path / "nope.gguf")
    fake = tmp_path / "fake.gguf"
    fake.write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ModelLayerError, match="magic"):
        model_card(fake)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLayerError, match="safetensors"):
        model_card(folder)


@pytest.mark.slow
def test_hf_folder_card_agrees_with_gguf_and_torch(hf_dir, tmp_path):
    """Same architecture numbers from config.json; parameter count equals torch's own."""
    import torch
    from transformers import AutoModelForCausalLM
    g, h = model_card(), model_card(hf_dir)
    assert h.kind == "hf"
    for f in ("n_params", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_size",
              "vocab_size", "context_length", "rope_theta"):
        assert getattr(h, f) == getattr(g, f), f
    assert h.quantization == "F32" and h.bits_per_weight == 32.0
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    # parameters() yields the tied embedding once, as the card counts it
    assert sum(p.numel() for p in model.parameters()) == h.n_params
    # a safetensors file cut short is a model-layer error, not a crash
    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copy(hf_dir / "config.json", cut / "config.json")
    with open(hf_dir / "model.safetensors", "rb") as src:
        (cut / "model.safetensors").write_bytes(src.read(1 << 20))
    with pytest.raises(ModelLayerError, match="past the end"):
        model_card(cut)


@pytest.mark.slow
def test_mlx_quantized_card_counts_unpacked_params(mlx_q4_dir):
    """MLX packs eight 4-bit weights per uint32; the card unpacks them to count params."""
    card = model_card(mlx_q4_dir)
    assert card.kind == "mlx" and card.quantization == "MLX 4-bit g64"
    assert card.n_params == 134_515_008
    # 4 bits + one scale and one bias per 64 weights (16 or 32 bits each), norms in float
    assert 4.4 < card.bits_per_weight < 5.2


def test_a_gguf_header_is_read_without_the_vocabulary_and_agrees_with_gguf():
    """models.gguf_header walks the header and skips long arrays; it must agree with llama.cpp's
    own reader on every scalar field and every tensor."""
    import gguf

    from infercourse.models.embedded import embedded_gguf
    from infercourse.models.gguf_header import read_header
    meta, tensors = read_header(embedded_gguf())
    r = gguf.GGUFReader(str(embedded_gguf()))
    assert [t["name"] for t in tensors] == [t.name for t in r.tensors]
    assert [t["n_bytes"] for t in tensors] == [int(t.n_bytes) for t in r.tensors]
    assert meta["tokenizer.ggml.tokens"] == {"array_of": 8, "length": len(r.fields["tokenizer.ggml.tokens"].data)}
    for k, f in r.fields.items():
        if not isinstance(meta.get(k), dict) and k in meta and f.types and f.types[0] != gguf.GGUFValueType.ARRAY:
            assert meta[k] == pytest.approx(f.contents()), k


def test_the_card_names_a_sliding_window_only_where_one_is_used(tmp_path):
    import json as _json

    from infercourse.models.modelcard import _folder_card
    from infercourse.models.embedded import embedded_gguf
    from infercourse.models.modelcard import model_card
    assert model_card(embedded_gguf()).sliding_window is None
    cfg = {"num_attention_heads": 2, "hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 4,
           "sliding_window": 4096, "use_sliding_window": False}
    (tmp_path / "config.json").write_text(_json.dumps(cfg))
    import safetensors.numpy as stn
    import numpy as np
    stn.save_file({"w": np.zeros((2, 2), np.float32)}, str(tmp_path / "model.safetensors"))
    assert _folder_card(tmp_path, "hf")["sliding_window"] is None
    (tmp_path / "config.json").write_text(_json.dumps({**cfg, "use_sliding_window": True}))
    assert _folder_card(tmp_path, "hf")["sliding_window"] == 4096

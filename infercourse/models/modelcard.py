"""A model card read from the model files themselves, never from a name or a web page.

Every ceiling the course computes starts here: decode reads every weight once per token
(`weight_bytes()`), and the KV cache grows by `kv_bytes_per_token()` for every token kept.
So the card counts parameters from tensor shapes and bytes from tensor sizes, and reports
*measured* bits per weight (8 x weight bytes / parameters): a "Q4_K_M" file of a model
whose rows are not multiples of 256 falls back to bigger types and is really ~6 bits.

Readers: GGUF headers with `models.gguf_header` (the layout of llama.cpp's own `gguf` package,
read without decoding the vocabulary, so a 262k-token model's card costs the same as any),
HF and MLX folders from config.json plus safetensors headers.
"""
from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from infercourse.core.errors import BackendMissingError, ModelLayerError
from infercourse.models.embedded import file_sha256, resolve_model
from infercourse.models.gguf_header import read_header

__all__ = ["ModelCard", "model_card"]

# bytes per element of safetensors dtypes (MLX packs quantized weights into U32).
_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4,
             "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: float = 2) -> float:
    """KV-cache bytes one token adds: K and V (the 2), per layer, per KV head, per dim, times
    bytes per element. The one home of this formula; roofline and the KV-cache lesson use it."""
    return 2 * n_layers * n_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class ModelCard:
    """What a model is, measured from its files. Sizes in bytes, counts in units."""

    path: str
    kind: str                 # "gguf", "hf" or "mlx"
    architecture: str
    n_params: int             # from tensor shapes; tied embeddings counted once
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    context_length: int
    rope_theta: float | None
    bytes_on_disk: int        # every file of the model, metadata and tokenizer included
    tensor_bytes: int         # bytes of all weight tensors (scales and biases included)
    quantization: str         # the file's own name for it, e.g. "Q4_1", "F32", "MLX 4-bit g64"
    bits_per_weight: float    # measured: 8 * tensor_bytes / n_params
    sha256: str
    sliding_window: int | None = None   # tokens a local attention layer sees (None: full attention)

    def kv_bytes_per_token(self, dtype_bytes: float = 2) -> float:
        """KV-cache bytes one token adds: K and V, for every layer and KV head.

        Args:
            dtype_bytes: bytes per cached element (2 for f16, 1 for q8_0-ish caches).
        """
        return kv_bytes_per_token(self.n_layers, self.n_kv_heads, self.head_dim, dtype_bytes)

    def weight_bytes(self) -> int:
        """Bytes of weights a decode step streams from memory (all tensors, read once)."""
        return self.tensor_bytes

    def as_dict(self) -> dict:
        """Plain dict for manifests and JSON (and for `roofline`/`kvcache`, which accept
        dicts), with weight_bytes and the f16 KV bytes per token added."""
        return {**asdict(self), "weight_bytes": self.weight_bytes(),
                "kv_bytes_per_token_f16": self.kv_bytes_per_token(2)}

    def to_frame(self):
        """Two-column DataFrame (field, value) for notebooks."""
        import pandas as pd
        return pd.DataFrame(list(self.as_dict().items()), columns=["field", "value"])

    def _repr_html_(self) -> str:
        return self.to_frame().to_html(index=False)


def model_card(model: str | Path | None = None) -> ModelCard:
    """Read the card of a GGUF file, an HF folder or an MLX folder (None: the embedded model).

    Args:
        model: anything `models.resolve_model` accepts, except a served model name.
    """
    ref = resolve_model(model)
    if ref.kind == "gguf":
        card = _gguf_card(ref.path)
    elif ref.kind in ("hf", "mlx"):
        card = _folder_card(ref.path, ref.kind)
    else:
        raise ModelLayerError(f"no files to read a card from for {ref.name!r}")
    files = [ref.path] if ref.path.is_file() else [p for p in ref.path.rglob("*") if p.is_file()]
    return ModelCard(path=str(ref.path), kind=ref.kind, sha256=file_sha256(ref.path),
                     bytes_on_disk=sum(p.stat().st_size for p in files), **card)


def _gguf_card(path: Path) -> dict:
    try:
        import gguf
    except ImportError as e:
        raise BackendMissingError("the `gguf` package (llama.cpp's GGUF reader) is not installed",
                                  hint="pip install gguf") from e
    try:
        meta, tensors = read_header(path)
        n_params = sum(t["n_elements"] for t in tensors)
        tensor_bytes = sum(t["n_bytes"] for t in tensors)
        tokens = meta.get("tokenizer.ggml.tokens")
        n_vocab_tokens = (tokens["length"] if isinstance(tokens, dict) else len(tokens)) if tokens else None
    except (ValueError, IndexError, KeyError, OSError, struct.error) as e:
        raise ModelLayerError(f"{path} is not a readable GGUF file: {e}",
                              hint="it may be truncated; re-derive or re-download it") from e
    arch = meta.get("general.architecture")
    if arch is None or not n_params:
        raise ModelLayerError(f"{path} has no architecture or no tensors in its GGUF header")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    ftype = meta.get("general.file_type")
    try:
        qname = gguf.LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_") if ftype is not None \
            else "unknown"
    except ValueError:
        qname = f"file_type {ftype}"
    rope = get("rope.freq_base")
    return dict(
        architecture=str(arch), n_params=n_params, n_layers=int(get("block_count")),
        n_heads=n_heads, n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        # key_length is written when head_dim != hidden / heads (e.g. Gemma, Qwen3)
        head_dim=int(get("attention.key_length", hidden // n_heads)), hidden_size=hidden,
        vocab_size=int(get("vocab_size", n_vocab_tokens or 0)),
        context_length=int(get("context_length", 0)),
        rope_theta=float(rope) if rope is not None else None,
        sliding_window=int(get("attention.sliding_window")) if get("attention.sliding_window") else None,
        tensor_bytes=tensor_bytes, quantization=qname,
        bits_per_weight=8 * tensor_bytes / n_params)


def _folder_card(folder: Path, kind: str) -> dict:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLayerError(f"{folder}/config.json is unreadable: {e}") from e
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLayerError(f"{folder} has no *.safetensors weights")
    quant = cfg.get("quantization") if kind == "mlx" else None
    n_params = tensor_bytes = 0
    dtypes: dict[str, int] = {}
    for f in files:
        for name, (dtype, shape, nbytes) in _safetensors_header(f).items():
            tensor_bytes += nbytes
            if quant and name.endswith((".scales", ".biases")):
                continue  # quantization overhead: bytes, not parameters
            n = _prod(shape)
            if quant and dtype == "U32":
                # MLX packs 32/bits weights into each uint32 along the last axis
                bits = (quant.get(name.removesuffix(".weight")) or quant)["bits"]
                n = n * 32 // bits
            n_params += n
            dtypes[dtype] = dtypes.get(dtype, 0) + n
    if quant:
        qname = f"MLX {quant['bits']}-bit g{quant['group_size']}"
    elif cfg.get("quantization_config"):
        qname = str(cfg["quantization_config"].get("quant_method", "quantized"))
    else:
        qname = max(dtypes, key=dtypes.get)  # the dtype holding most parameters
    text = cfg.get("text_config", cfg)  # multimodal configs nest the language model
    n_heads = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    rope = text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta")
    return dict(
        architecture=str(text.get("model_type", cfg.get("model_type", "unknown"))),
        n_params=n_params, n_layers=int(text["num_hidden_layers"]), n_heads=n_heads,
        n_kv_heads=int(text.get("num_key_value_heads") or n_heads),
        head_dim=int(text.get("head_dim") or hidden // n_heads), hidden_size=hidden,
        vocab_size=int(text["vocab_size"]),
        context_length=int(text.get("max_position_embeddings", 0)),
        rope_theta=float(rope) if rope is not None else None,
        # Qwen2-style configs name a window they do not use (use_sliding_window false)
        sliding_window=int(text["sliding_window"]) if text.get("sliding_window") and text.get(
            "use_sliding_window", True) else None,
        tensor_bytes=tensor_bytes, quantization=qname,
        bits_per_weight=8 * tensor_bytes / n_params)


def _safetensors_header(path: Path) -> dict[str, tuple[str, list[int], int]]:
    """{name: (dtype, shape, bytes)} from a safetensors header, reading no weights.

    The header is 8 bytes of little-endian length, then JSON naming each tensor's dtype,
    shape and byte range; ten lines read it exactly, with no tensor framework imported.
    """
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n < 100_000_000:
                raise ValueError(f"implausible header length {n}")
            header = json.loads(f.read(n))
        size = path.stat().st_size
        out = {}
        for name, t in header.items():
            if name == "__metadata__":
                continue
            start, end = t["data_offsets"]
            if 8 + n + end > size:
                raise ValueError(f"tensor {name} runs past the end of the file")
            out[name] = (t["dtype"], list(t["shape"]), end - start)
        return out
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLayerError(f"{path} is not a readable safetensors file: {e}",
                              hint="it may be truncated; re-derive it") from e


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


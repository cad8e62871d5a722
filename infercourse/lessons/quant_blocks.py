"""One block by hand: what Q8_0 and Q4_0 store for 32 weights, and what they lose.

A block quantizer cuts a weight row into blocks of 32 and stores, per block, one scale `d`
(as fp16) and 32 small integers `q`; the weight comes back as `d · q` (Q8_0) or
`d · (q − 8)` (Q4_0). Everything else follows from how `d` is chosen:

- **Q8_0**: d = max|x| / 127, q = round(x / d) in −127..127 (8 bits). Every weight is off
  by at most d/2, plus a sliver: d itself is stored as fp16, so the grid the weights come
  back on is stretched by d's rounding (up to 127 × 2⁻¹¹ of a step at the far end).
- **Q4_0**: the weight with the largest magnitude, *with its sign*, is mapped to −8:
  d = x_max / −8, q = trunc(x / d + 8.5) clipped to 0..15 (4 bits). Sixteen levels across
  the block's range: the error bound d/2 is ~16× Q8_0's for the same block.

Storage per block: Q8_0 = 2 + 32 = 34 bytes (8.5 bits a weight), Q4_0 = 2 + 16 = 18 bytes
(4.5 bits; two 4-bit values a byte, the block's first 16 weights in the low nibbles).

These dozen lines of numpy follow llama.cpp's reference quantizers (`quantize_row_q8_0_ref`,
`quantize_row_q4_0_ref` in ggml-quants.c), rounding half away from zero as C's `roundf`
does. `compare_with_file` checks them byte for byte against a block that llama.cpp's own
`llama-quantize` wrote into a GGUF, and against gguf-py's `gguf.quants`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from infercourse.core.errors import ModelLayerError
from infercourse.models.gguf_header import tensor_data, tensor_table

__all__ = ["BLOCK", "quantize_q8_0", "quantize_q4_0", "dequantize", "block_bytes", "first_block",
           "compare_with_file", "plot_block"]

BLOCK = 32


def _round_half_away(v: np.ndarray) -> np.ndarray:
    return np.sign(v) * np.floor(np.abs(v) + 0.5)  # C roundf; numpy's round goes half to even


def quantize_q8_0(x: np.ndarray) -> tuple[np.float16, np.ndarray]:
    """One Q8_0 block: (fp16 scale d, 32 int8 q) with x ≈ d·q.

    Args:
        x: 32 float weights.
    """
    x = _check(x)
    d = np.abs(x).max() / 127
    inv = np.float32(1 / d) if d else np.float32(0)
    return np.float16(d), _round_half_away(x * inv).astype(np.int8)


def quantize_q4_0(x: np.ndarray) -> tuple[np.float16, np.ndarray]:
    """One Q4_0 block: (fp16 scale d, 32 uint4 q in 0..15) with x ≈ d·(q − 8).

    Args:
        x: 32 float weights.
    """
    x = _check(x)
    d = x[np.abs(x).argmax()] / -8  # the largest magnitude, with its sign, becomes q = 0 (-8)
    inv = np.float32(1 / d) if d else np.float32(0)
    return np.float16(d), np.clip(np.trunc(x * inv + np.float32(8.5)), 0, 15).astype(np.uint8)


def dequantize(d: np.float16, q: np.ndarray, qtype: str) -> np.ndarray:
    """The weights a block gives back: d·q (Q8_0) or d·(q − 8) (Q4_0), in float32."""
    offset = {"Q8_0": 0, "Q4_0": 8}[qtype]
    return np.float32(d) * (q.astype(np.float32) - offset)


def block_bytes(d: np.float16, q: np.ndarray, qtype: str) -> bytes:
    """The block as it sits in a GGUF file: fp16 d, then the integers (Q4_0: two a byte,
    weight i in the low nibble and weight i + 16 in the high nibble of byte i)."""
    body = q.astype(np.int8).tobytes() if qtype == "Q8_0" else \
        (q[:16] | (q[16:] << 4)).astype(np.uint8).tobytes()
    return np.float16(d).tobytes() + body


def _check(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if x.size != BLOCK:
        raise ValueError(f"a block holds {BLOCK} weights, got {x.size}")
    return x


def _tensor(path: str | Path, name: str) -> dict:
    # the header's own reader (models.gguf_header): gguf.GGUFReader would parse every
    # tokenizer entry first, seconds a file, for the 32 weights this lesson reads
    found = tensor_table(path)
    if name not in found:
        raise ModelLayerError(f"{name!r} not in {path}", hint=f"tensors look like: {', '.join(list(found)[:5])}...")
    return found[name]


def first_block(path: str | Path, tensor: str, index: int = 0) -> tuple[str, np.ndarray]:
    """(storage type, raw bytes or float values) of block `index` of a tensor in a GGUF:
    float32 values for an F16/F32/BF16 tensor, the block's bytes for a quantized one.

    Args:
        path: the GGUF file.
        tensor: tensor name, e.g. "blk.0.attn_q.weight".
        index: which block of 32 weights (0 = the first 32 weights of row 0).
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    t = _tensor(path, tensor)
    kind, data = t["type"], tensor_data(path, t).reshape(-1)   # mapped: only the block is read
    if kind in ("F16", "F32", "BF16"):
        x = np.array(data[index * BLOCK:(index + 1) * BLOCK])
        # bfloat16 is the top half of a float32
        return kind, (x.astype(np.uint32) << 16).view(np.float32) if kind == "BF16" else x.astype(np.float32)
    per_block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    if per_block != BLOCK:
        raise ModelLayerError(f"{tensor} is {kind} (blocks of {per_block}); this lesson reads 32-weight blocks")
    return kind, np.array(data[index * nbytes:(index + 1) * nbytes])


def compare_with_file(f16_path: str | Path, quant_path: str | Path, tensor: str, qtype: str,
                      index: int = 0) -> dict:
    """Quantize block `index` of `tensor` from the F16 file by hand and compare it with the
    block llama.cpp's quantizer stored in `quant_path`, and with gguf-py's quantizer.

    Args:
        f16_path: GGUF holding the tensor unquantized (the quantizer's input).
        quant_path: GGUF of type `qtype` written by llama-quantize from that F16 file.
        tensor: a tensor stored as `qtype` in `quant_path`.
        qtype: "Q8_0" or "Q4_0".
    Returns the weights, scale, integers, reconstruction and error, and three booleans:
    same_bytes_as_llamacpp, same_bytes_as_gguf_py, same_weights_as_llamacpp (dequantized).
    """
    from gguf import GGMLQuantizationType, quants
    quantize = {"Q8_0": quantize_q8_0, "Q4_0": quantize_q4_0}[qtype]
    kind, x = first_block(f16_path, tensor, index)
    stored_kind, stored = first_block(quant_path, tensor, index)
    if kind not in ("F16", "F32") or stored_kind != qtype:
        raise ModelLayerError(f"{tensor}: expected F16/F32 in {f16_path} and {qtype} in {quant_path}, "
                              f"found {kind} and {stored_kind}", hint="pick a tensor llama-quantize stored as " + qtype)
    d, q = quantize(x)
    ours = block_bytes(d, q, qtype)
    gtype = GGMLQuantizationType[qtype]
    theirs = quants.dequantize(stored, gtype).reshape(-1)
    back = dequantize(d, q, qtype)
    return {"qtype": qtype, "tensor": tensor, "weights": x, "d": float(d), "q": q, "dequantized": back,
            "error": back - x, "max_abs_error": float(np.abs(back - x).max()), "half_step": float(abs(d)) / 2,
            "rms_error": float(np.sqrt(np.mean((back - x) ** 2))),
            "same_bytes_as_llamacpp": ours == stored.tobytes(),
            "same_bytes_as_gguf_py": ours == quants.quantize(x[None], gtype).tobytes(),
            "same_weights_as_llamacpp": bool(np.array_equal(back, theirs.astype(np.float32)))}


def plot_block(blocks: dict, ax=None):
    """The block's 32 weights and what each quantization gives back, with Q4_0's 16
    levels drawn as a grid: the error is the distance from a dot to its marker.

    Args:
        blocks: {qtype: `compare_with_file` result} for the same block.
    """
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(10, 3.8))[1]
    first = next(iter(blocks.values()))
    idx = np.arange(BLOCK)
    if "Q4_0" in blocks:
        d = blocks["Q4_0"]["d"]
        for level in range(16):
            ax.axhline(d * (level - 8), color="0.9", lw=0.8, zorder=0)
    ax.scatter(idx, first["weights"], color="black", s=18, label="weight (F16 file)", zorder=3)
    for (q, b), m in zip(blocks.items(), "x+"):
        ax.scatter(idx, b["dequantized"], marker=m, s=40, label=f"{q} dequantized (max error {b['max_abs_error']:.2g})")
    ax.set(xlabel="weight index within the 32-weight block", ylabel="weight value",
           title=f"One block of {first['tensor']}: grey lines = Q4_0's 16 levels")
    ax.legend(fontsize=8)
    return ax

"""NF4 by hand: the 16-value code book of QLoRA's 4-bit NormalFloat, in numpy.

A trained weight matrix is close to normally distributed. An *integer* 4-bit grid spaces
its 16 levels evenly, so most levels sit in the tails where few weights live. NF4 instead
puts the 16 levels at quantiles of the standard normal distribution, so each level holds
about the same share of the weights: more levels near zero, fewer in the tails.

How the code book is built (Dettmers et al., QLoRA, 2023; bitsandbytes' `create_normal_map`):

- 8 positive levels at the normal quantiles of `linspace(0.5, p, 9)` (the 0.5 one is zero
  and dropped), 7 negative levels at the quantiles of `linspace(0.5, p, 8)`, and an exact
  zero: 16 values, asymmetric so that zero is representable. `p = 0.9677...` keeps the
  outermost quantile finite (half-way between the 15th- and 16th-bin quantile ideas).
- the 16 values are divided by the largest, so the code book spans [-1, 1].

Quantizing a block of 64 weights: divide by the block's absolute maximum (`absmax`, kept
in float32), snap each value to the nearest code-book entry (4 bits: its index), and pack
two indices a byte, the first one in the high nibble. A weight comes back as
`code[q] * absmax`. `compare_with_bitsandbytes` checks these steps against
`bitsandbytes.functional.quantize_4bit` on one real weight row.
"""
from __future__ import annotations

from statistics import NormalDist

import numpy as np

__all__ = ["NF4_OFFSET", "nf4_code_book", "int4_code_book", "quantize_nf4", "dequantize_nf4",
           "pack_nibbles", "compare_with_bitsandbytes", "nf4_text"]

NF4_OFFSET = 0.9677083  # bitsandbytes' `offset`: the outermost quantile probability


def nf4_code_book(offset: float = NF4_OFFSET) -> np.ndarray:
    """The 16 NF4 levels in [-1, 1], sorted (index = the 4-bit code).

    Args:
        offset: probability of the outermost quantile (QLoRA's value by default).
    """
    ppf = NormalDist().inv_cdf
    positive = [ppf(p) for p in np.linspace(offset, 0.5, 9)[:-1]]   # 8 levels above zero
    negative = [-ppf(p) for p in np.linspace(offset, 0.5, 8)[:-1]]  # 7 levels below zero
    levels = np.array(sorted(positive + [0.0] + negative))
    return (levels / levels.max()).astype(np.float32)


def int4_code_book() -> np.ndarray:
    """An evenly spaced symmetric 4-bit grid on [-1, 1] (absmax scaling, like bnb's FP4
    or a plain int4), to compare how the two place their 16 levels."""
    return (np.arange(-8, 8) / 7.0).clip(-1, 1).astype(np.float32)


def quantize_nf4(x: np.ndarray, block: int = 64, code: np.ndarray | None = None):
    """Quantize a flat float array in blocks: returns (absmax per block, 4-bit indices).

    Args:
        x: weights; its size must be a multiple of `block`.
        block: weights per absmax scale (transformers' bitsandbytes default is 64).
        code: the code book (default: `nf4_code_book()`).
    """
    code = nf4_code_book() if code is None else code
    x = np.asarray(x, dtype=np.float32).reshape(-1, block)
    absmax = np.abs(x).max(axis=1)
    scaled = x / np.where(absmax == 0, 1, absmax)[:, None]
    # nearest level: compare with the midpoints between neighbouring levels
    mids = (code[1:] + code[:-1]) / 2
    q = np.searchsorted(mids, scaled, side="right").astype(np.uint8)
    return absmax, q


def dequantize_nf4(absmax: np.ndarray, q: np.ndarray, code: np.ndarray | None = None) -> np.ndarray:
    """The weights that come back: code[q] * absmax, block by block (flat float32)."""
    code = nf4_code_book() if code is None else code
    return (code[q] * absmax[:, None]).reshape(-1)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Two 4-bit indices a byte, the first of each pair in the high nibble (bnb's layout)."""
    q = np.asarray(q, dtype=np.uint8).reshape(-1, 2)
    return (q[:, 0] << 4) | q[:, 1]


def compare_with_bitsandbytes(weight, block: int = 64) -> dict:
    """Quantize `weight` (a 2-D float tensor or array) by hand and with bitsandbytes.

    Returns the code books side by side, the fraction of identical 4-bit codes and
    absmax values, the largest difference of the dequantized weights, and the rms
    error of NF4 vs an evenly spaced 4-bit grid with the same block scales.

    Args:
        weight: e.g. one linear layer's weight from the HF model.
        block: weights per scale.
    """
    from infercourse.models.quiet import quiet
    quiet()   # bitsandbytes logs a missing optional CPU kernel package on import
    import torch
    import bitsandbytes.functional as bf
    w = torch.as_tensor(np.asarray(weight, dtype=np.float32))
    packed, state = bf.quantize_4bit(w, blocksize=block, quant_type="nf4")
    theirs_code = state.code.float().numpy()
    theirs_absmax = state.absmax.float().numpy()
    theirs_back = bf.dequantize_4bit(packed, state).float().numpy().reshape(-1)
    absmax, q = quantize_nf4(w.numpy().reshape(-1), block)
    mine_back = dequantize_nf4(absmax, q)
    byte_match = float(np.mean(pack_nibbles(q) == packed.numpy().reshape(-1)))
    flat = w.numpy().reshape(-1)
    a4, q4 = quantize_nf4(flat, block, int4_code_book())
    return {"code_book": nf4_code_book(), "bnb_code_book": theirs_code[:16],
            "max_code_diff": float(np.abs(nf4_code_book() - theirs_code[:16]).max()),
            "same_absmax": float(np.mean(np.isclose(absmax, theirs_absmax, rtol=1e-6))),
            "same_packed_bytes": byte_match,
            "max_dequant_diff": float(np.abs(mine_back - theirs_back).max()),
            "rms_error_nf4": float(np.sqrt(np.mean((mine_back - flat) ** 2))),
            "rms_error_int4_grid": float(np.sqrt(np.mean((dequantize_nf4(a4, q4, int4_code_book()) - flat) ** 2))),
            "n_weights": int(flat.size), "block": block}


def nf4_text(r: dict) -> str:
    """What `compare_with_bitsandbytes`' result shows, in one paragraph (Markdown)."""
    code = (f"the code book by hand matches bitsandbytes' (largest difference {r['max_code_diff']:.1g})"
            if r["max_code_diff"] < 1e-6 else
            f"the code book by hand differs from bitsandbytes' (by up to {r['max_code_diff']:.3g})")
    packed = ("every packed byte is equal" if r["same_packed_bytes"] == 1.0 else
              f"{r['same_packed_bytes']:.1%} of the packed bytes are equal")
    a, b = r["rms_error_nf4"], r["rms_error_int4_grid"]
    err = (f"NF4's rounding error (rms {a:.3g}) is smaller than an even 4-bit grid's ({b:.3g}) with the same "
           f"scales: its levels crowd where the weights are." if a < b else
           f"NF4's rounding error (rms {a:.3g}) is not smaller than an even 4-bit grid's ({b:.3g}) with the same "
           f"scales: these weights are not spread the way NF4's quantiles assume.")
    return f"On this matrix {code}, and {packed}. {err}"

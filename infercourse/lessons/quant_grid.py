"""Does a GGUF rung re-round the weights, or land back on the grid they came from?

The course's model ships as Q4_1: every linear weight already sits on a 4-bit grid, 16
levels per block of 32 (`min + k * step`). Its "fp32" is that file dequantized, so it is
a *reference*, not an unquantized model. A format whose blocks line up with Q4_1's (32
weights, a scale and an offset each) can land almost exactly back on those levels and lose
almost nothing, which says little about what it does to weights that were never rounded.
A format with other blocks (64 weights, another grid) must round afresh.

A K-quant rung is also a *mix*: llama.cpp keeps some tensors at more bits (Q6_K), and a
row whose length is not a multiple of 256 cannot take a K-quant at all and falls back to
another type (Q5_0 for Q4_K). So "Q4_K_M" may hold many of its weights at 5 or 6 bits.

`grid_distance` measures both on the real weights: for each tensor stored as Q4_1 in the
original, the type and bits the other GGUF stores it in, the rms distance of its
dequantized values from the Q4_1 ones, and the distance a *fresh* rounding at the same
bits would move them (`fresh_round`: min and max per block of 32, round to nearest, the
blocks shifted by 16 so that each straddles two of Q4_1's: unshifted, a 4-bit min-max
rounding would rebuild Q4_1's grid exactly and move nothing).
`grid_text` says what the numbers show.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from infercourse.core.errors import ModelLayerError
from infercourse.models.gguf_header import tensor_data, tensor_table

__all__ = ["fresh_round", "grid_distance", "grid_text"]

# below this share of a fresh rounding's distance, a rung "lands back on the grid"; above
# ~1 it re-rounds like any 4-bit format; between, it is partly aligned
CLOSE, FAR = 0.5, 0.9
BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8,
        "Q2_K": 2, "Q3_K": 3, "IQ4_NL": 4, "IQ4_XS": 4}   # stored bits a weight, scales aside


def fresh_round(w: np.ndarray, group: int = 32, bits: int = 4, shift: int = 0) -> np.ndarray:
    """Round-to-nearest on an even grid of 2**bits levels between each group's min and max,
    the groups of each row (last axis) starting `shift` weights in (wrapping around)."""
    w = np.asarray(w, np.float64)
    g = np.roll(w, -shift, axis=-1).reshape(-1, group)
    lo, hi = g.min(1, keepdims=True), g.max(1, keepdims=True)
    step = np.where(hi > lo, (hi - lo) / (2 ** bits - 1), 1.0)
    return np.roll((np.round((g - lo) / step) * step + lo).reshape(w.shape), shift, axis=-1)


def grid_distance(original: str | Path, other: str | Path, group: int = 32):
    """One row per tensor stored as Q4_1 in `original`: its type and bits in `other`, the
    rms distance of `other`'s values from the Q4_1 ones (`rms_to_q4_1`), the rms distance a
    fresh rounding at those bits moves them (`rms_fresh`), and their ratio (`share_of_fresh`).

    Args:
        original: the Q4_1 GGUF (the embedded model).
        other: a GGUF derived from it (e.g. the Q4_K_M rung).
        group: weights per scale of the fresh rounding (shifted by half a group).
    """
    import pandas as pd
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize
    orig, oth = tensor_table(original), tensor_table(other)   # the headers only: gguf-py's reader
    rows = []                                                 # parses every tokenizer entry first
    for name, t in orig.items():
        if t["type"] != "Q4_1" or name not in oth:
            continue
        u = oth[name]
        bits = BITS.get(u["type"])
        if bits is None:   # stored as a float: nothing to re-round
            continue
        w1 = dequantize(tensor_data(original, t), Q.Q4_1).astype(np.float64)
        w2 = dequantize(tensor_data(other, u), Q[u["type"]]).astype(np.float64).reshape(w1.shape)
        rows.append({"tensor": name, "type": u["type"], "bits": bits, "n": w1.size,
                     "rms_to_q4_1": float(np.sqrt(np.mean((w2 - w1) ** 2))),
                     "rms_fresh": float(np.sqrt(np.mean((fresh_round(w1, group, bits, group // 2) - w1) ** 2)))})
    if not rows:
        raise ModelLayerError(f"{original} holds no Q4_1 tensor that {other} also holds",
                              hint="pass the embedded Q4_1 model as `original`")
    df = pd.DataFrame(rows)
    df["share_of_fresh"] = df.rms_to_q4_1 / df.rms_fresh
    return df


def _pooled(df) -> float:
    """Weight-count-weighted rms ratio over the tensors of `df`."""
    if df.empty:
        return math.nan
    num = np.sqrt(np.sum(df.rms_to_q4_1 ** 2 * df.n) / df.n.sum())
    return float(num / np.sqrt(np.sum(df.rms_fresh ** 2 * df.n) / df.n.sum()))


def grid_text(df, name: str = "Q4_K_M") -> str:
    """What `grid_distance`'s table shows about `name`, in one paragraph (Markdown)."""
    share, four = _pooled(df), _pooled(df[df.bits == 4])
    by_type = df.groupby("type").n.sum().sort_values(ascending=False)
    types = ", ".join(f"{t} {n / by_type.sum():.0%}" for t, n in by_type.items())
    above4 = float(df.n[df.bits > 4].sum() / df.n.sum())
    out = (f"**Does {name} re-round?** Of the weights stored as Q4_1 in the original, {name} stores "
           f"{above4:.0%} at more than 4 bits ({types}). ")
    if above4 >= 0.5:
        out += f"Most of this rung is not 4-bit: its quality row speaks for {name}'s mix, not for 4 bits. "
    out += (f"Its values lie at an rms distance from the Q4_1 ones of {share:.2f}× what a fresh rounding at "
            f"the same bits (blocks of 32 straddling Q4_1's) moves them")
    out += f"; its 4-bit tensors alone at {four:.2f}×. " if math.isfinite(four) else ". "
    key = four if math.isfinite(four) else share
    if key < CLOSE:
        return out + ("Its 4-bit blocks land close to the grid fp32 was made from, so its small loss against "
                      "fp32 says little about 4-bit rounding of weights that were never rounded.")
    if key < FAR:
        return out + ("Its 4-bit blocks are partly aligned with the Q4_1 grid: part of its small loss against "
                      "fp32 may come from that, not from its format alone.")
    return out + ("Its 4-bit blocks move the weights as far as a fresh rounding: the grid explanation does not "
                  "hold here, and its loss against fp32 is that of a real re-rounding.")

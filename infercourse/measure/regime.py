"""Which limit binds a decode step: a roof, or neither, and then which cost.

A decode step of B sequences produces B tokens. Two roofs bound it (`roofline.batch_ceiling`):
memory (bandwidth ÷ the bytes a step reads) and compute (FLOP/s ÷ the FLOPs a token needs). A
run is *bound* by a roof only where it gets near it: here, at least half of it (`NEAR_ROOF`).
Far below both, the roofs do not explain the rate; the step's own time does. Measured at
several batch sizes, it splits into a line:

    step time(B) = fixed + B × per-sequence

`fixed` is paid once per step whatever the batch holds (reading the weights, launching the
step, sampling, the server's loop): the batch shares it, so while it dominates the aggregate
rate B ÷ step time rises with B. `per-sequence` is paid by each sequence (its arithmetic
through every weight, its KV reads): batching does not divide it, so once it dominates the
rate flattens towards 1 ÷ per-sequence. The memory roof splits the same way (the weights once
per step, each sequence's KV on top), so the fixed part can be set beside the time the weights
take to read. The label (`decode_regime`):

- **bandwidth-bound**: the top batch reached at least half the memory roof;
- **compute-bound**: ... at least half the compute roof;
- **per-step overhead**: neither, and the fixed part is most of the top batch's step: a cost
  the batch shares, beyond what reading the weights takes;
- **kernel-bound**: neither, and the per-sequence part is most of it: each token's arithmetic
  runs far below the compute roof, so the kernel, not the machine's peak, sets the pace.

A rate measured *above* a roof means that roof is wrong (its probe under-read this machine):
the sentence says so, and no label is read from it. Where the decode rate's A/A band lets a
share sit on either side of its threshold, the label is "too close to call"; with one run per
batch size (no band) the label is a reading, and says so.

One stream, one phase (notebooks 03, 04, 06-08: MBU, a compute roof of the kernel's own data
type and a thread check) is read by `measure.stream_regime`, with the same `NEAR_ROOF`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["NEAR_ROOF", "Regime", "step_split", "decode_regime", "roof_share_words"]

# A run "is bound by" a roof only once it reaches this share of it (half): below that, the
# roof is not what stops it, whatever the arithmetic says.
NEAR_ROOF = 0.5


@dataclass(frozen=True)
class Regime:
    """What bound the top of a decode-rate curve, with the numbers it was read from."""
    label: str                  # bandwidth-bound, compute-bound, per-step overhead, kernel-bound, neither roof
    #                             (one batch size), too close to call (noise), not judged (a roof is wrong)
    memory_share: float         # measured ÷ memory roof, at the top batch
    compute_share: float        # measured ÷ compute roof, at the top batch
    fixed_s: float              # the step's fixed part (NaN: one batch size)
    per_sequence_s: float       # the step's per-sequence part (NaN: one batch size)
    fixed_share: float          # fixed ÷ step time at the top batch
    wrong: tuple[str, ...]      # roofs a measured rate sat above ("memory", "compute")
    judged: bool                # False: one run per batch size (no noise band), the label is a reading
    text: str

    @property
    def said(self) -> str:
        """The label, with "(a reading: one run per batch size)" when it was not judged."""
        return self.label if self.judged or self.label == "not judged" else f"{self.label} (a reading: one run per " \
            "batch size)"


def step_split(batch: Sequence[float], step_s: Sequence[float]) -> tuple[float, float]:
    """(fixed, per-sequence) of the least-squares line step_s = fixed + batch × per-sequence;
    (NaN, NaN) with fewer than two batch sizes."""
    x, y = np.asarray(batch, float), np.asarray(step_s, float)
    if len(set(x.tolist())) < 2:
        return math.nan, math.nan
    per, fixed = np.polyfit(x, y, 1)
    return float(fixed), float(per)


def roof_share_words(share: float, roof: str = "bandwidth") -> str:
    """"<roof>-bound here" at or above `NEAR_ROOF` of a roof, "not <roof>-bound here" below it,
    "above its <roof> ceiling: that ceiling is wrong" past 1."""
    if not math.isfinite(share):
        return f"no {roof} ceiling to compare with"
    if share > 1:
        return f"above its {roof} ceiling: that ceiling is wrong"
    return f"{roof}-bound here" if share >= NEAR_ROOF else f"not {roof}-bound here"


def _ms(s: float) -> str:
    return f"{max(s, 0.0) * 1e3:.1f} ms"


def _tok(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def _side(lo: float, hi: float, threshold: float) -> str:
    """"above" / "below" `threshold` when the whole range [lo, hi] is, else "unsure"."""
    return "above" if lo >= threshold else "below" if hi < threshold else "unsure"


def _share_range(b: np.ndarray, step: np.ndarray, floor: float) -> tuple[float, float]:
    """The fixed part's share of the top step when the steps are tilted by the noise band (the
    smallest batch's ×(1+floor) and the largest's ÷(1+floor), and the other way round)."""
    out = []
    for sign in (1, -1):
        k = (1 + floor) ** (sign * (1 - 2 * (b - b[0]) / (b[-1] - b[0])))
        fixed, _ = step_split(b, step * k)
        out.append(min(max(fixed / (step[-1] * k[-1]), 0.0), 1.0))
    return min(out), max(out)


def decode_regime(batch: Sequence[int], decode_tok_per_s: Sequence[float], memory_roof: Sequence[float],
                  compute_roof: Sequence[float], *, floor: float | None = None, compute_source: str = "") -> Regime:
    """Say what bound the aggregate decode rate at the top batch, from the run's numbers.

    Args:
        batch: sequences decoded together, ascending (e.g. an `np_sweep` table's levels).
        decode_tok_per_s: the measured aggregate decode rate at each (N ÷ TPOT).
        memory_roof, compute_roof: the roofs at each batch (`roofline.batch_ceiling`).
        floor: the decode rate's A/A noise band (±floor); a share within it of a threshold is
            "too close to call". None: one run per batch size, the label is a reading, not judged.
        compute_source: where the compute roof came from, for the sentence.
    """
    b, r = np.asarray(batch, float), np.asarray(decode_tok_per_s, float)
    mr, cr = np.asarray(memory_roof, float), np.asarray(compute_roof, float)
    top, rate, f = int(b[-1]), float(r[-1]), floor or 0.0
    m_share, c_share = rate / mr[-1], rate / cr[-1]
    src = f", {compute_source}" if compute_source else ""
    out = [f"At batch {top} the aggregate decode rate, {_tok(rate)} tok/s, is {m_share:.0%} of the memory roof "
           f"({_tok(mr[-1])} tok/s) and {c_share:.0%} of the compute roof ({_tok(cr[-1])} tok/s{src})."]
    wrong = []
    for name, roof in (("memory", mr), ("compute", cr)):
        over = np.flatnonzero(r > roof)
        if len(over):
            i = int(over[0])
            wrong.append(name)
            out.append(f"The measured decode rate at batch {int(b[i])} ({_tok(r[i])} tok/s) sits above the {name} roof "
                       f"there ({_tok(roof[i])} tok/s): that roof is wrong (its probe under-read this machine), so no "
                       "regime is read from it.")
    step = b / r                                                   # seconds per step at each batch
    fixed, per = step_split(b, step)
    w_fixed, _ = step_split(b, b / mr)                             # the memory roof's step: weights + B × KV
    fixed_share = min(max(fixed / step[-1], 0.0), 1.0) if math.isfinite(fixed) else math.nan
    if math.isfinite(fixed):
        out.append(f"A step took {step[0] * 1e3:.1f} ms at batch {int(b[0])} and {step[-1] * 1e3:.1f} ms at batch "
                   f"{top}: a fixed {_ms(fixed)} per step, which the batch shares (reading the weights once takes "
                   f"{_ms(w_fixed)} at the probed bandwidth), plus {_ms(per)} per sequence, which it does not"
                   + (f" (so more users approach at most {_tok(1 / per)} tok/s)." if per > 0 else "."))
    mem = _side(m_share / (1 + f), m_share * (1 + f), NEAR_ROOF) if "memory" not in wrong else "wrong"
    comp = _side(c_share / (1 + f), c_share * (1 + f), NEAR_ROOF) if "compute" not in wrong else "wrong"
    band = f"the decode rate's A/A band (±{f:.0%})"
    if mem == "above":
        label, why = "bandwidth-bound", f"the run reached {m_share:.0%} of the memory roof"
    elif comp == "above":
        label, why = "compute-bound", f"the run reached {c_share:.0%} of the compute roof"
    elif "unsure" in (mem, comp):
        label, why = "too close to call", f"within {band}, the run may or may not have reached half a roof"
    elif not math.isfinite(fixed):
        label, why = "neither roof", ("neither roof is near, and with one batch size this run cannot split the "
                                      "step into what the batch shares and what each sequence adds")
    else:
        lo, hi = _share_range(b, step, f)
        side = _side(lo, hi, 0.5)
        if side == "unsure":
            label, why = "too close to call", (f"neither roof is near; within {band} the fixed part could be "
                                               f"{lo:.0%}–{hi:.0%} of the step at batch {top}, more or less than "
                                               "half: this run cannot tell a per-step overhead from the kernel")
        elif side == "above" and mem != "wrong":
            label = "per-step overhead"
            why = (f"neither roof is near; the fixed part is {fixed_share:.0%} of the step at batch {top}, "
                   f"{max(fixed, 0) / w_fixed:.1f}× what reading the weights takes: a per-step overhead spread over "
                   "the batch, which is why the rate rises with it")
        elif side == "below" and comp != "wrong":
            label = "kernel-bound"
            why = (f"neither roof is near; each sequence adds {_ms(per)} per step ({1 - fixed_share:.0%} of the step "
                   f"at batch {top}), {per * cr[-1]:.1f}× what the compute roof allows per token: the kernel's "
                   "per-token arithmetic, not the machine's peak, sets the pace")
        else:
            label, why = "not judged", (f"the {'fixed' if side == 'above' else 'per-sequence'} part dominates the "
                                        f"step, but the {'memory' if side == 'above' else 'compute'} roof it is set "
                                        "beside is wrong")
    if label == "not judged":
        out.append(f"Regime **not judged**: {why}.")
    else:
        unjudged = " (one run per batch size: no noise band, so a reading, not judged)" if floor is None else ""
        out.append(f"The regime is **{label}**{unjudged}: {why}.")
    return Regime(label, m_share, c_share, fixed, per, fixed_share, tuple(wrong), floor is not None, " ".join(out))

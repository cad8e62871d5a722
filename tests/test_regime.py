"""Issue 31, notebook 11: what bound a decode step is read from the run, and flips with it.

Synthetic sweeps, one per regime: the label (bandwidth-bound, compute-bound, per-step
overhead, kernel-bound) comes from the measured share of each roof and from how the step
time grew with the batch; a rate above a roof says that roof is wrong instead of labelling
by it. Whole words are matched (`\\b`): "not judged" must not pass for "judged".
"""
from __future__ import annotations

import math
import re

import pandas as pd
import pytest

from infercourse.lessons import goodput as gp
from infercourse.measure import regime as R
from infercourse.measure import roofline

B = [1, 2, 4]
MEM = [200.0, 400.0, 800.0]           # a memory roof that rises with the batch
COMP = [600.0] * 3                   # a flat compute roof


def rates(fixed_ms: float, per_ms: float) -> list[float]:
    """Aggregate decode rate B / (fixed + B x per) for each batch."""
    return [b / ((fixed_ms + b * per_ms) / 1e3) for b in B]


def says(text: str, word: str) -> bool:
    return re.search(rf"\*\*{re.escape(word)}\*\*", text) is not None


def test_step_split_recovers_the_line():
    fixed, per = R.step_split(B, [(5 + b * 11) / 1e3 for b in B])
    assert fixed == pytest.approx(0.005) and per == pytest.approx(0.011)
    assert all(math.isnan(x) for x in R.step_split([4], [0.05]))


def test_overhead_and_kernel_flip_with_how_the_step_grows():
    """The same roofs; a step that barely grows with B is a shared overhead, one that grows
    with every sequence is the kernel's per-token arithmetic."""
    over = R.decode_regime(B, rates(fixed_ms=40, per_ms=2), MEM, COMP)
    kern = R.decode_regime(B, rates(fixed_ms=2, per_ms=12), MEM, COMP)
    assert over.label == "per-step overhead" and says(over.text, "per-step overhead") and not says(over.text, "kernel-bound")
    assert kern.label == "kernel-bound" and says(kern.text, "kernel-bound") and not says(kern.text, "per-step overhead")
    assert over.fixed_share > 0.5 > kern.fixed_share
    assert "the batch shares" in over.text and "reading the weights once takes 5.0 ms" in over.text


def test_bandwidth_and_compute_bound_only_near_their_roof():
    near_mem = R.decode_regime(B, [150.0, 300.0, 600.0], MEM, [2000.0] * 3)   # 75% of the memory roof
    assert near_mem.label == "bandwidth-bound" and says(near_mem.text, "bandwidth-bound")
    near_comp = R.decode_regime(B, [150.0, 320.0, 450.0], [1000.0, 2000.0, 4000.0], COMP)  # 75% of compute
    assert near_comp.label == "compute-bound" and says(near_comp.text, "compute-bound")
    far = R.decode_regime(B, [50.0, 60.0, 70.0], MEM, COMP)                    # 9% and 12%: neither roof
    assert far.label in ("per-step overhead", "kernel-bound") and not says(far.text, "bandwidth-bound")
    assert re.search(r"\b9% of the memory roof\b", far.text) and re.search(r"\b12% of the compute roof\b", far.text)


def test_a_rate_above_a_roof_says_the_roof_is_wrong_and_labels_nothing_from_it():
    """The issue's run: a compute roof of 49.9 tok/s below batch 1's measured 54.8."""
    low = [49.9] * 3
    r = R.decode_regime(B, [54.8, 66.0, 77.0], MEM, low, compute_source="float32 matmul, 13 GFLOP/s")
    assert r.wrong == ("compute",) and "that roof is wrong" in r.text
    assert "54.8 tok/s) sits above the compute roof" in r.text
    assert not says(r.text, "compute-bound") and not says(r.text, "kernel-bound") and r.label == "not judged"
    ok = R.decode_regime(B, [54.8, 66.0, 77.0], MEM, [560.0] * 3)
    assert ok.wrong == () and "wrong" not in ok.text and ok.label == "kernel-bound"


def test_one_batch_size_cannot_split_the_step():
    r = R.decode_regime([4], [70.0], [800.0], [600.0])
    assert r.label == "neither roof" and "one batch size" in r.text and math.isnan(r.fixed_s)


def test_roof_share_words():
    assert R.roof_share_words(0.2) == "not bandwidth-bound here"
    assert R.roof_share_words(0.7) == "bandwidth-bound here"
    assert "that ceiling is wrong" in R.roof_share_words(1.2)
    assert not re.search(r"(?<!not )\bbandwidth-bound here", R.roof_share_words(0.3))


def _table(decode, floor=0.05):
    t = pd.DataFrame({"decode_tok_per_s": decode, "prefill_share": [0.4, 0.45, 0.5],
                      "output_tok_per_s": [30.0, 38.0, 44.0]}, index=pd.Index(B, name="concurrency"))
    t.attrs.update(noise_floor=0.5, decode_noise_floor=floor)
    return t


def test_limit_sentence_reads_the_regime_and_never_a_share_true_by_construction():
    card = {"n_params": 134.5e6, "weight_bytes": 96.6e6, "n_layers": 30, "n_kv_heads": 3, "head_dim": 64}
    ceil = roofline.batch_ceiling(card, {"bandwidth_gbs": 21.0, "matmul_gflops_f32": 150.0, "matmul_threads": 1}, B,
                                  context=128)
    text = gp.limit_sentence(_table([54.8, 66.0, 77.0]), ceil)
    assert says(text, "rising") and says(text, "kernel-bound") and "100%" not in text
    assert "on 1 thread" in text                            # where the compute roof came from
    flat = gp.limit_sentence(_table([54.8, 56.0, 55.0]), ceil)
    assert says(flat, "flat") and says(flat, "kernel-bound")
    shared = gp.limit_sentence(_table(rates(fixed_ms=40, per_ms=1)), ceil)
    assert says(shared, "per-step overhead") and not says(shared, "kernel-bound")
    # the decode rate is judged against its own A/A band, not the end-to-end rate's (0.5 here)
    assert "[0.95, 1.05]" in text


def test_regime_of_a_sweep_table():
    ceil = pd.DataFrame({"memory_bound_tok_per_s": MEM + [1600.0], "compute_bound_tok_per_s": COMP + [600.0]},
                        index=pd.Index(B + [8], name="batch"))
    r = gp.regime(_table(rates(fixed_ms=2, per_ms=12)), ceil)
    assert r.label == "kernel-bound" and r.memory_share == pytest.approx(rates(2, 12)[-1] / 800.0)


def test_the_noise_band_decides_whether_the_split_can_be_called():
    """A fixed part of ~57 % of the step: a small band calls it an overhead, a wide one cannot
    tell it from the kernel, and no band at all gives a reading that says it is not judged."""
    r = rates(fixed_ms=52, per_ms=20)[:2]                      # the CI run's shape: 72 ms at 1, 92 ms at 2
    narrow = R.decode_regime([1, 2], r, MEM[:2], COMP[:2], floor=0.02)
    wide = R.decode_regime([1, 2], r, MEM[:2], COMP[:2], floor=0.3)
    none = R.decode_regime([1, 2], r, MEM[:2], COMP[:2])
    assert narrow.label == "per-step overhead" and narrow.judged and narrow.said == "per-step overhead"
    assert wide.label == "too close to call" and says(wide.text, "too close to call")
    assert not says(wide.text, "per-step overhead") and not says(wide.text, "kernel-bound")
    assert none.label == "per-step overhead" and not none.judged and "not judged" in none.text
    assert none.said == "per-step overhead (a reading: one run per batch size)"
    # near half a roof, the band decides too: 52 % of the memory roof with a ±10 % band
    edge = R.decode_regime(B, [100.0, 200.0, 416.0], MEM, [5000.0] * 3, floor=0.1)
    assert edge.label == "too close to call"
    assert R.decode_regime(B, [100.0, 200.0, 416.0], MEM, [5000.0] * 3, floor=0.01).label == "bandwidth-bound"

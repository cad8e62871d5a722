"""measure.prefill_curve: the a + b·n + c·n² fit recovers known terms, stays non-negative, and
forecasts with a note past the longest length measured. Pure: synthetic points only."""
import math
import re

import numpy as np
import pytest

from infercourse.measure.prefill_curve import (PrefillFit, fit_prefill, flop_crossover_tokens, predict_prefill_s,
                                               rate_curve)

LENGTHS = [512, 1024, 2048, 4096, 8192, 16384]


def _times(a, b, c, lengths=LENGTHS):
    return [a + b * n + c * n * n for n in lengths]


def test_fit_recovers_known_terms():
    a, b, c = 0.05, 3.0e-3, 4.2e-7               # notebook 20's two agent points, roughly
    fit = fit_prefill(LENGTHS, _times(a, b, c))
    assert fit.a == pytest.approx(a, rel=1e-6) and fit.b == pytest.approx(b, rel=1e-6)
    assert fit.c == pytest.approx(c, rel=1e-6) and fit.pinned == () and fit.rel_rms < 1e-9
    assert fit.crossover_tokens == pytest.approx(b / c) and (fit.n_min, fit.n_max) == (512, 16384)
    terms = fit.terms_at(16384)
    assert terms["quadratic"] == pytest.approx(c * 16384 ** 2) and sum(fit.share_at(16384).values()) == pytest.approx(1)


def test_fit_recovers_terms_through_noise_and_repeats():
    rng = np.random.default_rng(1)
    a, b, c = 0.2, 2.0e-3, 1.0e-7
    n = LENGTHS * 3
    y = np.asarray(_times(a, b, c, n)) * rng.normal(1, 0.01, len(n))   # 1% multiplicative noise
    fit = fit_prefill(n, y)
    assert fit.b == pytest.approx(b, rel=0.05) and fit.c == pytest.approx(c, rel=0.1)
    assert fit.n_points == 18 and 0.001 < fit.rel_rms < 0.03


def test_a_negative_term_is_pinned_at_zero_not_fitted():
    # a rate that *rises* with length (per-token cost shrinking): the free fit wants c < 0
    y = [n * (4e-3 - 1e-8 * n) for n in LENGTHS]
    fit = fit_prefill(LENGTHS, y)
    assert fit.c == 0.0 and "quadratic" in fit.pinned and math.isinf(fit.crossover_tokens)
    assert fit.a >= 0 and fit.b > 0


def test_a_purely_linear_prefill_has_no_quadratic_term():
    fit = fit_prefill(LENGTHS, _times(0.1, 5e-3, 0.0))
    assert fit.c == pytest.approx(0.0, abs=1e-15) and fit.b == pytest.approx(5e-3, rel=1e-6)


def test_fit_needs_three_distinct_lengths():
    with pytest.raises(ValueError, match="3 distinct"):
        fit_prefill([1024, 1024, 2048], [1.0, 1.1, 2.0])
    fit_prefill([1024, 2048, 4096, float("nan")], [1.0, 2.0, 4.5, 3.0])   # a NaN point is dropped


def test_prediction_says_when_it_extrapolates():
    fit = PrefillFit(a=0.0, b=3e-3, c=4e-7, n_min=1024, n_max=8192, n_points=4, rel_rms=0.0)
    inside, beyond, below = (predict_prefill_s(n, fit) for n in (5968, 10650, 256))
    assert float(inside) == pytest.approx(5968 * 3e-3 + 4e-7 * 5968 ** 2)
    assert not inside.extrapolated and "interpolated" in inside.note
    assert beyond.extrapolated and re.search(r"\bextrapolated\b", beyond.note) and "1.30x" in beyond.note
    assert not below.extrapolated and "below the shortest" in below.note
    assert beyond.tok_per_s == pytest.approx(10650 / beyond.seconds)
    assert beyond.tok_per_s < inside.tok_per_s        # the rate falls with length


def test_rate_curve_and_shares():
    fit = PrefillFit(a=0.0, b=1e-3, c=1e-7, n_min=1000, n_max=20000, n_points=5, rel_rms=0.0)
    df = rate_curve(fit, [1000, 10000, 20000])
    row = df.set_index("n_tokens").loc[10000]                 # n* = b / c = 10,000: equal shares
    assert row["linear_share"] == pytest.approx(row["quadratic_share"]) and row["fixed_share"] == 0
    assert list(df["tok_per_s"]) == sorted(df["tok_per_s"], reverse=True)


def test_flop_crossover_of_smollm2_shape():
    # SmolLM2-135M: 30 layers, 9 query heads of 64; 134.5M params less a 49,152 x 576 embedding table
    n = flop_crossover_tokens(134_515_008 - 49_152 * 576, 30, 9, 64)
    assert 6000 < n < 6300
    causal = flop_crossover_tokens(1e8, 30, 9, 64)
    assert flop_crossover_tokens(1e8, 30, 9, 64, full_block=True) == pytest.approx(causal / 2)


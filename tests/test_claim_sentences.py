"""Claim sentences flip when the numbers flip (issue 26 §1).

Every helper in `measure.claims` (and the notebook-specific claim writers built on it) is
fed synthetic results twice, once each way, and must say opposite things; a result inside
the noise must be called "within noise", not ranked.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest

from infercourse.measure import claims
from infercourse.measure import noise


def test_mean_vs_median_flips_with_the_skew():
    rng = np.random.default_rng(0)
    bulk = rng.normal(0.017, 0.0002, 300)
    right = np.concatenate([bulk, np.full(12, 0.060)])       # a few stalls: mean above the median
    left = np.concatenate([bulk, np.full(12, 0.001)])        # a few very fast gaps: mean below
    up, down = claims.mean_vs_median(right, "ITL"), claims.mean_vs_median(left, "ITL")
    assert "**above** the median" in up and "below" not in up.split("median:")[-1].split(".")[1]
    assert "**below** the median" in down and "above" not in down
    same = claims.mean_vs_median(rng.normal(0.017, 0.0002, 300), "ITL")
    assert "cannot tell them apart" in same and "**above**" not in same and "**below**" not in same


def test_mean_vs_median_says_range_when_n_is_small():
    assert "range [" in claims.mean_vs_median([1.0, 2.0, 3.0], "E2E", scale=1, unit="s")


def _cmp(ratio: float, n: int = 6, spread: float = 0.01, higher_is_better: bool = False):
    rng = np.random.default_rng(1)
    a = 1 + rng.normal(0, spread, n)
    a2 = a * (1 + rng.normal(0, spread, n))
    b = a * ratio * (1 + rng.normal(0, spread, n))
    return noise.compare(a, b, noise.noise_floor(a, a2), labels=("batched", "serial"), higher_is_better=higher_is_better)


def says(text: str, phrase: str) -> bool:
    """`phrase` in `text` as whole words: "cb faster" is not in "nocb faster"."""
    return re.search(rf"(?<![\w-]){re.escape(phrase)}(?![\w-])", text) is not None


def test_verdict_sentence_flips_and_says_within_noise():
    slow, fast, same = _cmp(1.5), _cmp(1 / 1.5), _cmp(1.0)
    s, f, n = (claims.verdict_sentence(c, "TTFT p50") for c in (slow, fast, same))
    assert says(s, "batched faster") and not says(s, "serial faster")
    assert says(f, "serial faster") and not says(f, "batched faster")
    assert "within noise" in n and "faster" not in n and "A/A rerun's noise" in n
    assert "95% interval" in s and "at most 0.05 false positives" in s
    few = claims.verdict_sentence(_cmp(1.5, n=2))
    assert "range [" in few and "interval" not in few.split("range")[0]
    assert "too few pairs" in few and "within noise" not in few and "faster" not in few


def test_a_verdict_whose_interval_holds_1_says_so():
    """A test can rank two arms while the median ratio's interval (at 8 pairs, the smallest and
    largest ratio) still holds 1: notebook 20 printed "95% interval [0.88, 1.38]: direct faster,
    beyond the A/A rerun's noise" with nothing between the two; the sentence now says why."""
    a = np.array([1.0, 1.01, 0.99, 1.02, 1.0, 0.98, 1.01, 1.0])
    a2 = a * np.array([1.01, 0.99, 1.0, 1.01, 0.99, 1.0, 1.01, 0.99])
    out = a * np.array([1.1, 1.12, 1.09, 1.11, 1.1, 1.08, 1.1, 0.97])    # one pair the other way
    s = claims.verdict_sentence(noise.compare(a, out, noise.noise_floor(a, a2), labels=("x", "y")))
    assert says(s, "x faster") and "Not every pair agreed: the ratio's 95% interval above still holds 1." in s
    clear = claims.verdict_sentence(noise.compare(a, a * 1.1, noise.noise_floor(a, a2), labels=("x", "y")))
    assert says(clear, "x faster") and "Not every pair agreed" not in clear


def test_verdict_sentence_names_the_test_that_ran():
    """Against a number, not the A/A rerun: the sentence must not claim the rerun's noise, and
    quotes the test's own level (per side for the band test), whatever ci was."""
    a = np.linspace(1.0, 1.2, 8)
    band = claims.verdict_sentence(noise.compare(a, a * 1.5, 0.1))
    assert "A/A rerun" not in band and "beyond the noise band [0.91, 1.10]" in band
    assert "at most 0.025 false positives on that side" in band
    inside = claims.verdict_sentence(noise.compare(a, a * 1.02, 0.1))
    assert "within noise" in inside and "A/A rerun" not in inside and "inside the noise band" in inside
    zero = claims.verdict_sentence(noise.compare(a, a * 1.5, 0.0, ci=0.9))
    assert "beyond chance" in zero and "at most 0.05 false positives on that side" in zero


def test_no_flip_test_uses_labels_that_contain_each_other():
    """A flip test that checks `"cb faster" in s` passes on "nocb faster": every pair of labels
    or names given to a comparison in the tests must be free of each other (or the test must
    match whole words, as `says` does)."""
    bad = []
    for path in Path(__file__).parent.glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg in ("labels", "names") and isinstance(node.value, ast.Tuple):
                vals = [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                if any(x != y and x in y for x in vals for y in vals):
                    bad.append(f"{path.name}:{node.lineno}: {vals}")
    assert not bad, bad


def test_ratio_sentence_flips_and_holds_inside_the_band():
    up = claims.ratio_sentence(1.0, 1.5, 0.1, bigger="slower", smaller="faster")
    down = claims.ratio_sentence(1.0, 0.6, 0.1, bigger="slower", smaller="faster")
    inside = claims.ratio_sentence(1.0, 1.05, 0.1, bigger="slower", smaller="faster")
    assert "slower" in up and "faster" not in up
    assert "faster" in down and "slower" not in down
    assert "within noise" in inside and "slower" not in inside and "faster" not in inside
    assert "not judged" in claims.ratio_sentence(1.0, 1.5, None)


def test_shape_sentence_flips_with_which_curve_fell_faster():
    x = [64, 512, 1536]
    model = [100, 90.5, 74.4]
    steeper = claims.shape_sentence(x, [62, 43, 29], model)
    flatter = claims.shape_sentence(x, [62, 61, 60], model)
    same = claims.shape_sentence(x, [62, 56, 46.5], model)
    assert "fell faster" in steeper and "fell less" not in steeper
    assert "fell less" in flatter and "fell faster" not in flatter
    assert "follows" in same
    noisy = claims.shape_sentence([64, 512], [40, 31.6], [100, 91], floor=0.3)   # 0.79 vs 0.91 inside ±30%
    assert "cannot say" in noisy and "fell faster" not in noisy
    assert "fell faster" in claims.shape_sentence([64, 512], [40, 31.6], [100, 91], floor=0.05)
    import pandas as pd                 # a Series indexed by context (as notebook 12 passes it) reads the same
    idx = pd.Index(x, name="context")
    assert claims.shape_sentence(x, pd.Series([62, 43, 29], idx), pd.Series(model, idx)) == steeper


def test_share_vs_yardstick_has_three_readings():
    # 2 SE of independent positions at p0 = 0.3, n = 800 is 3.2 points; correlated (x sqrt 2): 4.6
    assert claims.share_vs_yardstick(0.40, 0.30, 800).startswith("clear of")
    assert claims.share_vs_yardstick(0.20, 0.30, 800).startswith("below the yardstick (")
    both = claims.share_vs_yardstick(0.337, 0.30, 800)
    assert both.startswith("above") and "may be real, or noise" in both
    assert claims.share_vs_yardstick(0.31, 0.30, 800).startswith("no different")


def test_marginal_cost_tells_a_step_from_a_slope():
    step = claims.marginal_cost_sentence([1, 3, 11], [1.0, 1.95, 2.0])
    slope = claims.marginal_cost_sentence([1, 3, 11], [1.0, 1.2, 2.0])
    assert "**step**" in step and "**slope**" not in step
    assert "**slope**" in slope and "**step**" not in slope
    hedged = claims.marginal_cost_sentence([1, 3, 11], [1.0, 1.95, 2.0], ["reference", "within noise", "within noise"])
    firm = claims.marginal_cost_sentence([1, 3, 11], [1.0, 1.95, 2.0], ["reference", "costs more", "costs more"])
    assert "a hint" in hedged and "a hint" not in firm


def test_trend_sentence_flat_inside_the_band_rising_outside():
    assert "**flat**" in claims.trend_sentence([1, 4], [62, 64], 0.1, what="decode tok/s", x_name="batch")
    assert "**rising**" in claims.trend_sentence([1, 4], [62, 120], 0.1, what="decode tok/s", x_name="batch")
    assert "**falling**" in claims.trend_sentence([1, 4], [62, 30], 0.1, what="decode tok/s", x_name="batch")


@pytest.mark.parametrize("exact,word", [(True, "95% interval"), (False, "range")])
def test_interval_word(exact, word):
    assert claims.interval_word(exact) == word


# ---- notebook 11: the limit and continuous-batching sentences ----------
def _ceil(probe_tok_s=50.0):
    import pandas as pd
    return pd.DataFrame({"memory_bound_tok_per_s": [300.0, 600.0, 1200.0], "compute_bound_tok_per_s": probe_tok_s,
                         "ceiling_tok_per_s": probe_tok_s, "bound": "compute"}, index=pd.Index([1, 2, 4], name="batch"))


def _sweep(decode, floor=0.1):
    import pandas as pd
    t = pd.DataFrame({"decode_tok_per_s": decode, "prefill_share": [0.66, 0.6, 0.55],
                      "output_tok_per_s": [22.5, 30.0, 33.0]}, index=pd.Index([1, 2, 4], name="concurrency"))
    t.attrs["noise_floor"] = floor
    return t


def test_limit_sentence_flips_between_flat_and_rising():
    import pandas as pd
    from infercourse.lessons import goodput as gp
    flat = _sweep([62.0, 67.0, 62.0])
    rising = _sweep([62.0, 120.0, 230.0])
    a = gp.limit_sentence(flat, _ceil())
    b = gp.limit_sentence(rising, _ceil())
    assert "**flat**" in a and "**rising**" not in a
    assert "**rising**" in b and "**flat**" not in b
    assert "55%–66%" in a                       # the prefill share is stated from the table
    assert "measured decode rate" in a


def test_cb_sentence_says_when_the_band_cannot_resolve_the_prediction():
    import pandas as pd
    from infercourse.lessons import concurrency as cc
    pred = cc.cb_prediction(ttft_s=1.0, tpot_s=0.016, max_tokens=32)
    assert pred["ttft_ratio"] > 1 and pred["wait_s"] > 0
    short = cc.cb_prediction(ttft_s=0.05, tpot_s=0.016, max_tokens=32)
    assert short["ttft_ratio"] > pred["ttft_ratio"]          # short prompts make the effect visible
    cb = pd.DataFrame(index=["continuous batching", "no continuous batching"])
    cb.attrs.update(noise_floor=1.12, comparisons={"ttft_s_p50": _cmp(1.0)})
    wide = cc.cb_sentence(cb, pred)
    assert "could **not** resolve" in wide and "within noise" in wide
    cb.attrs.update(noise_floor=0.05, comparisons={"ttft_s_p50": _cmp(short["ttft_ratio"])})
    narrow = cc.cb_sentence(cb, short)
    assert "could resolve" in narrow and says(narrow, "batched faster")
    assert "not compared" in cc.cb_sentence(pd.DataFrame())


def test_service_drift_flips_with_the_direction_of_the_drift():
    """09: S inside the overload run against the unloaded S; the even/odd floor cannot see this."""
    from infercourse.lessons import latency
    slow = latency.service_drift(1.30, {"service_s": 1.542, "overload": 2.5}, 3.0)
    fast = latency.service_drift(1.542, {"service_s": 1.30, "overload": 3.6}, 3.0)
    same = latency.service_drift(1.50, {"service_s": 1.52, "overload": 3.0}, 3.0)
    assert "slower during the overload run" in slow and "2.50× where 3×" in slow
    assert "faster during the overload run" in fast
    assert "about the same speed" in same and "slower" not in same and "faster" not in same


def test_marginal_cost_names_a_knee_when_later_positions_cost_more():
    """09 printed "+0.068 per added position … +0.180 … A slope": the marginal cost rose 2.6×."""
    import re
    knee = claims.marginal_cost_sentence([1, 3, 11], [1.0, 1.136, 2.58])
    slope = claims.marginal_cost_sentence([1, 3, 11], [1.0, 1.136, 1.68])
    assert re.search(r"\*\*knee\*\*", knee) and not re.search(r"\bslope\*\*", knee) and "2.7× the first" in knee
    assert re.search(r"\*\*slope\*\*", slope) and "knee" not in slope
    free_first = claims.marginal_cost_sentence([1, 3, 11], [1.0, 0.99, 1.8])
    assert "**knee**" in free_first and "the first were free" in free_first
    flat = claims.marginal_cost_sentence([1, 3, 11], [1.0, 0.99, 0.98])
    assert "nothing measurable" in flat and "**" not in flat


def test_marginal_cost_hedges_too_few_pairs_as_well_as_noise():
    few = claims.marginal_cost_sentence([1, 3, 11], [1.0, 1.136, 2.58],
                                        ["reference", "too few pairs: 2 pairs cannot pass a test that needs 3",
                                         "costs more than 1 position"])
    firm = claims.marginal_cost_sentence([1, 3, 11], [1.0, 1.136, 2.58],
                                         ["reference", "costs more than 1 position", "costs more than 1 position"])
    assert "a hint" in few and "too few pairs to be judged" in few and "a hint" not in firm

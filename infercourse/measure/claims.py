"""Sentences that state what *this* run showed, written from its numbers.

A notebook's markdown explains mechanisms; it cannot know the outcome, because another
machine, or another run on the same one, may give the opposite. So every sentence that
ranks, compares or quotes a result ("slower", "the mean sits above the median", "fell as
the model predicts") is produced here, from the measured values, and it flips when they
flip. Where the numbers allow more than one reading (a difference inside the noise band,
a mean inside the median's interval, a gap that clears independent-sample error bars but
not correlated ones), the sentence says so instead of picking one.

Each helper returns plain markdown text; a notebook shows it with `Markdown(...)`.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from infercourse.core.summary import median_interval

__all__ = ["band_verdict", "verdict_sentence", "p_text", "mean_vs_median", "ratio_sentence", "shape_sentence", "share_vs_yardstick",
           "marginal_cost_sentence", "trend_sentence", "interval_word"]


def interval_word(exact: bool) -> str:
    """"interval" when the order statistics give a real confidence interval, else "range":
    with too few pairs the bracket is just the smallest and largest value seen."""
    return "95% interval" if exact else "range"


def p_text(c: Any) -> str:
    """A comparison's p, and where it is the smallest its pairs can give, that it is: a relabelling
    test over n pairs has k^n relabellings (k = 3 for A, its A/A rerun and B; 2 for sign flips
    against a band or no change), so p cannot fall below 1/k^n whatever the effect; more pairs,
    not a bigger difference, would lower it. Judged only where every relabelling was enumerated."""
    from infercourse.measure.noise import EXACT_MAX
    k, n = (3 if "relabelled" in c.test else 2), c.interval.n
    floor = k ** -n if n and k ** n <= EXACT_MAX else None
    at_floor = floor is not None and abs(c.p - floor) <= 1e-9 + 1e-6 * floor
    return f"p = {c.p:.2g}" + (f", the smallest p {n} pairs can give" if at_floor else "")


def verdict_sentence(c: Any, what: str = "") -> str:
    """One `noise.Comparison` in words: the median paired ratio, its interval (or range),
    and what the permutation test allows us to say, against what it judged (the A/A rerun,
    a noise band, or no change) and at its own level.

    Args:
        c: a `noise.Comparison` (B against A).
        what: the quantity compared, e.g. "TTFT p50" (optional).
    """
    a, b = c.labels
    iv = c.interval
    head = f"{what + ': ' if what else ''}{b} ÷ {a} = {iv.median:.2f}× (median of {iv.n} paired ratios, " \
           f"{interval_word(iv.exact)} [{iv.lo:.2f}, {iv.hi:.2f}])"
    side = " on that side" if c.against != "the A/A rerun" else ""
    if c.too_few:
        return (f"{head}: too few pairs to judge: with {iv.n} pairs this test ({c.test}) can never pass "
                f"(it needs {c.fewest}), so this run cannot rank them, nor say they are alike.")
    if c.within_noise:
        lean = "above" if iv.median > 1 else "below" if iv.median < 1 else "at"
        src = "the A/A rerun's noise" if c.against == "the A/A rerun" else \
            "chance" if c.against == "no change" else f"noise inside {c.against}"
        return (f"{head}: within noise. The median lies {lean} 1, but a difference this size is one {src} "
                f"can produce (p = {c.p:.2g}, above {c.level:.3g}{side}); this run cannot rank them.")
    beyond = "beyond the A/A rerun's noise" if c.against == "the A/A rerun" else \
        "a change beyond chance" if c.against == "no change" else f"beyond {c.against}"
    split = f" Not every pair agreed: the ratio's {interval_word(iv.exact)} above still holds 1." if iv.lo <= 1 <= iv.hi else ""
    return f"{head}: {c.verdict}, {beyond} ({p_text(c)}; at most {c.level:.3g} false positives{side}).{split}"


def mean_vs_median(x: Sequence[float], name: str, *, scale: float = 1e3, unit: str = "ms",
                   ci: float = 0.95) -> str:
    """Where the mean sits against the median, and what that says about the tail.

    The mean is compared with the median's distribution-free interval: inside it, the run
    cannot tell them apart; above it, a few slow values pull the mean up (a right tail);
    below it, the bulk is slower than a few fast values (a left tail, or two clusters).

    Args:
        x: the samples (e.g. pooled ITL gaps in seconds).
        name: what they are, e.g. "pooled ITL".
        scale, unit: display units.
        ci: confidence level of the median's interval.
    """
    v = np.sort(np.asarray([s for s in x if s is not None and math.isfinite(s)], float))
    if len(v) == 0:
        return f"{name}: no samples."
    mean, med = float(v.mean()), float(np.median(v))
    iv = median_interval(v, ci)
    lo, hi = iv or (v[0], v[-1])
    word = f"{ci:.0%} interval" if iv else "range"
    nums = (f"{name}: mean {mean * scale:.4g} {unit}, median {med * scale:.4g} {unit} "
            f"({word} [{lo * scale:.4g}, {hi * scale:.4g}], n = {len(v)})")
    if lo <= mean <= hi:
        return (f"{nums}. The mean lies inside the median's {word}: this run cannot tell them apart, so it shows "
                "no skew either way (a few slow values may be there, too few or too small to move the mean).")
    if mean > hi:
        return (f"{nums}. The mean sits **above** the median: a few slow values pull the sum up, and the "
                "mean describes no sample anyone saw. A right tail: read the high percentiles.")
    return (f"{nums}. The mean sits **below** the median: most samples are slower than a few fast ones "
            "(a left tail, or two clusters), so here the mean flatters the typical case.")


def ratio_sentence(a: float, b: float, floor: float | None = None, *, names: tuple[str, str] = ("A", "B"),
                   what: str = "", bigger: str = "larger", smaller: str = "smaller") -> str:
    """B against A as a multiple, judged against a noise band ±floor when one is known.

    Args:
        a, b: the two values; names: their labels.
        floor: relative noise band (0.1 = ±10%); None: no band, so no verdict, only the ratio.
        what: the quantity, e.g. "decode tok/s".
        bigger, smaller: the words for B > A and B < A ("slower", "faster" for times).
    """
    if not (a > 0 and math.isfinite(a) and math.isfinite(b)):
        return f"{what + ': ' if what else ''}{names[1]} vs {names[0]}: no ratio (A is {a})."
    r = b / a
    head = f"{what + ': ' if what else ''}{names[1]} is {r:.2f}× {names[0]}"
    if floor is None:
        return f"{head} (one value each: no noise band, so not judged)."
    band = f"[{1 / (1 + floor):.2f}, {1 + floor:.2f}]"
    if 1 / (1 + floor) <= r <= 1 + floor:
        return f"{head}: within noise (inside the band {band}); this run cannot rank them."
    return f"{head}: {bigger if r > 1 else smaller}, outside the noise band {band}."


def shape_sentence(x: Sequence[float], measured: Sequence[float], model: Sequence[float], *,
                   what: str = "decode speed", model_name: str = "the bandwidth model", tol: float = 0.1,
                   floor: float | None = None) -> str:
    """Do two curves fall (or rise) with the same shape? Each is taken relative to its
    first point; the sentence compares where they end, and says which fell faster.

    Args:
        x: the points (e.g. context lengths); measured, model: values at those points.
        tol: relative difference of the end points below which the shapes "agree".
        floor: the measurement's A/A noise band (±floor); a gap inside it is called noise, not a shape.
    """
    m, p = np.asarray(measured, float), np.asarray(model, float)     # positional, whatever the index
    m, p, x = m / m[0], p / p[0], list(x)
    pts = "; ".join(f"at {xi:g}: measured {mi:.2f}, model {pi:.2f}" for xi, mi, pi in zip(x[1:], m[1:], p[1:]))
    head = f"{what} relative to its value at {x[0]:g} ({pts})"
    end_m, end_p = m[-1], p[-1]
    if floor is not None and abs(end_m / end_p - 1) <= floor and abs(end_m / end_p - 1) > tol:
        return (f"{head}: the end points differ by {abs(end_m / end_p - 1):.0%}, inside this run's A/A noise band "
                f"(±{floor:.0%}): the measured shape may follow {model_name} or not; this run cannot say.")
    if abs(end_m / end_p - 1) <= tol:
        return (f"{head}: the measured curve follows {model_name} (within {tol:.0%} at the end), so the reads it "
                "counts are enough to explain the change.")
    if end_m < end_p:
        return (f"{head}: the measured speed **fell faster** than {model_name} predicts, so the bytes it counts are "
                "not the whole cost: something else grows with the context too (attention arithmetic, cache misses).")
    return (f"{head}: the measured speed **fell less** than {model_name} predicts, so another cost that does not "
            "grow with the context (fixed per-step work, arithmetic) dominates the step.")


def share_vs_yardstick(share: float, yardstick: float, positions: int, *, design_effect: float = 2.0,
                       name: str = "the yardstick") -> str:
    """A share (a head's accuracy) against a yardstick, with binomial error bars.

    Neighbouring positions of one text are correlated, so the effective sample is smaller
    than the count: the standard error is widened by sqrt(design_effect). "clear of" needs
    the gap beyond 2 of those wider SEs; a gap beyond 2 independent SEs but not beyond the
    wider ones is reported as both readings.

    Args:
        share: the measured share; yardstick: the share to beat; positions: samples.
        design_effect: variance inflation from correlated positions (1: independent).
        name: what the yardstick is called in the sentence.
    """
    se = (yardstick * (1 - yardstick) / max(positions, 1)) ** 0.5
    wide = se * design_effect ** 0.5
    gap = share - yardstick
    pts = f"{gap * 100:+.1f} points vs {name}'s {yardstick:.1%}"
    if abs(gap) > 2 * wide:
        return f"{'clear of' if gap > 0 else 'below'} {name} ({pts}, beyond 2 SE even allowing for correlated positions)"
    if abs(gap) > 2 * se:
        return (f"{'above' if gap > 0 else 'below'} {name} by 2 SE of independent positions ({pts}, 2 SE = "
                f"{2 * se * 100:.1f}) but not by 2 SE allowing for correlated positions ({2 * wide * 100:.1f}): "
                "it may be real, or noise")
    return f"no different from {name} ({pts}, within 2 SE = {2 * se * 100:.1f})"


def marginal_cost_sentence(widths: Sequence[int], cost: Sequence[float], verdicts: Sequence[str] | None = None) -> str:
    """Where the extra cost of a wider pass comes from: the cost per added position between
    consecutive widths, the first extra positions against the later ones. Four shapes: a
    **step** (later positions nearly free: a fixed cost of passing more than one), a
    **slope** (about the same per position: arithmetic per position), a **knee** (later
    positions more than 1.5× dearer each than the first), or in between. Hedged when a
    verdict did not clear the noise or had too few pairs to try.

    Args:
        widths: positions per pass, the first the reference (1); cost: cost relative to it.
        verdicts: each width's verdict against the reference, to quote (optional).
    """
    w, c = list(widths), [float(v) for v in cost]
    steps = [(w[i - 1], w[i], (c[i] - c[i - 1]) / (w[i] - w[i - 1])) for i in range(1, len(w))]
    parts = "; ".join(f"{a}→{b} positions: {s:+.3f} per added position" for a, b, s in steps)
    extra = f" ({', '.join(f'{k}: {v}' for k, v in zip(w[1:], (verdicts or [])[1:]))})" if verdicts else ""
    head = "pass cost vs 1 position: " + ", ".join(f"{k}: {v:.2f}×" for k, v in zip(w, c)) + extra + f"; {parts}"
    unjudged = [v for v in (verdicts or [])[1:] if "within noise" in v or "too few" in v]
    why = "did not clear the A/A noise" if all("within noise" in v for v in unjudged) else \
        "had too few pairs to be judged" if all("too few" in v for v in unjudged) else "were not shown beyond noise"
    hedge = (f" Some of these costs {why} (the verdicts above), so the shape is a hint from the medians, "
             "not a finding.") if unjudged else ""
    if len(steps) < 2:
        return head + "." + hedge
    first, later = steps[0][2], float(np.mean([s for *_, s in steps[1:]]))
    knee = (". A **knee**: later positions cost clearly more each than the first ones ("
            + (f"{later / first:.1f}× the first extra positions' cost" if first > 0 else "the first were free")
            + "): not a slope, where each would cost the same; cheap while the extra positions ride on work a pass "
            "does anyway, dearer each past some width (the shape a kernel or cache limit gives).")
    if first <= 0:
        return head + (knee if later > 0 else ". Extra positions cost nothing measurable here.") + hedge
    if later > 1.5 * first:
        return head + knee + hedge
    if later < first / 3:
        return (head + ". A **step**: the first extra positions cost the most, later ones were nearly free "
                "(a fixed cost of passing more than one position, not arithmetic per position)." + hedge)
    if later >= first / 1.5:
        return head + (". A **slope**: each added position costs about as much as the first ones "
                       "(arithmetic per position).") + hedge
    return head + ". Neither a clean step nor a clean slope: later positions cost less than the first, but not nothing." + hedge


def trend_sentence(x: Sequence[float], y: Sequence[float], floor: float | None, *, what: str, x_name: str) -> str:
    """Is y flat in x, or rising / falling? The last point against the first, judged against
    a noise band ±floor (None: no band, the ratio only)."""
    x, y = list(x), np.asarray(y, float)          # positional, whatever the index
    r = float(y[-1]) / float(y[0])
    head = f"{what} from {x_name} {x[0]:g} to {x[-1]:g}: {float(y[0]):.3g} → {float(y[-1]):.3g} ({r:.2f}×)"
    if floor is None:
        return head + " (one run per point: no noise band, not judged)."
    if 1 / (1 + floor) <= r <= 1 + floor:
        return head + f": **flat** within the noise band [{1 / (1 + floor):.2f}, {1 + floor:.2f}]."
    return head + f": **{'rising' if r > 1 else 'falling'}**, outside the noise band [{1 / (1 + floor):.2f}, {1 + floor:.2f}]."


def band_verdict(r: float, floor: float | None) -> tuple[str, str]:
    """(kind, text) of a ratio against the noise band [1/(1+floor), 1+floor]: kind is
    "within", "outside" or "unjudged" (no band, or an unbounded one)."""
    if floor is None or not math.isfinite(floor):
        return "unjudged", "no finite A/A noise band was measured, so this gap is not judged"
    band = f"[{1 / (1 + floor):.2f}, {1 + floor:.2f}]"
    if 1 / (1 + floor) <= r <= 1 + floor:
        return "within", f"inside the A/A noise band {band}: this run cannot rank them"
    return "outside", f"outside the A/A noise band {band}"

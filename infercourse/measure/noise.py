"""Is that difference real? A contention gate, interleaved trials, an A/A noise floor, and a
verdict from a permutation test on paired ratios.

A speed-up measured once, on a shared machine, is a guess. Four habits make a comparison
survive the noise:

1. **Check the machine first** (`contention`, see `measure.contention`): a busy machine
   does not forbid a measurement, but the learner must read the conclusions knowing it.
2. **Interleave** (`measure.interleave`: `schedule`, `run_interleaved`, `run_arms`): trial
   i of each arm runs in block i, *pair i*, so a drift between blocks hits all arms alike,
   and the order inside each block is shuffled (seeded, recorded), so that which run of a
   block carries which label is chance, as the test below assumes.
3. **Measure the noise floor** (`noise_floor`): run the *same* configuration twice,
   interleaved (A/A). Whatever difference A/A shows is noise by construction.
4. **Test the paired difference** (`compare`), not "the whole interval clears the A/A
   band": that rule stacked two noisy ranges and, at σ = 0.1, found a 1.35x change 50% of
   the time at 3 pairs, 20% at 6, 10% at 8 (`benchmarks/noise_power.py`).

**Definitions used here** (on ratios, so scale-free: seconds and tok/s alike):

- paired ratio r_i = b_i / a_i for pair i.
- `paired_interval`: the median r_i (of the logs, so r and 1/r agree) and the
  order-statistic interval [r_(l), r_(u)] of the true median ratio (`core.summary.
  order_stat_ci`: the count of r_i below it is Binomial(n, 1/2) whatever the
  distribution). 95% needs 6 pairs; with fewer it is the range and `exact` is False.
- A/A **noise floor** = max(hi, 1/lo) - 1 of that interval for two runs of the same
  configuration, printed as the band [1/(1 + floor), 1 + floor]: for reading.
- **verdict** (`compare`): a permutation test on logs at level 1 - ci (5%), so times and
  speeds get the same verdict.
  - *With the A/A rerun of the same trials* (`compare(a, b, noise_floor(a, a2))`), each
    block holds A, A2 and B; T = mean of log b - (log a + log a2) / 2. If B is only A
    again, which of a block's three runs carries the label B is chance: the 3^n
    relabellings give T's null distribution, and p = the share with |T| at least the
    observed. False positives <= 5% by construction *when the order inside each block was
    chance* (the shuffled schedule; a fixed order lets a position cost read as an effect),
    power that rises with the pairs (3 can reach p = 1/27): the rerun is data, a second
    reference in every block.
  - *With a number for the floor* (or an A/A of other trials), log r_i is sign-flipped
    against the band's edges: B differs when its mean lies beyond ±log(1 + floor) at
    p <= 2.5% on that side (floor 0: "no change"). 2^n patterns: 6 pairs at least.
  With fewer pairs than a test needs (k^n relabellings can never give p <= its level) the
  verdict is "too few pairs", never "within noise": no evidence either way.
  A mean of logs: one wild run pulls every relabelling with it, so it makes the test
  cautious, not credulous. Exact up to 2^17 relabellings, else 20,000 seeded ones (the
  same data always get the same verdict).

Pure numpy and stdlib: the callables passed to `run_interleaved` do the measuring
(engines never time themselves; bench does).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from infercourse.core.summary import median_interval, order_stat_ci
from infercourse.measure.interleave import Interleaved, run_arms, run_interleaved, schedule  # noqa: F401
from infercourse.measure.contention import (MAX_LOAD_PER_CORE, MIN_CPU_SHARE, Contention, contention,  # noqa: F401
                                            cpu_share, judge, load_per_core, runnable_others)

__all__ = ["Contention", "cpu_share", "load_per_core", "runnable_others", "judge", "contention", "schedule",
           "run_interleaved", "PairedInterval", "paired_interval", "NoiseFloor",
           "noise_floor", "band_text", "TOO_FEW", "Comparison", "compare", "run_arms", "compare_arms"]

EXACT_MAX = 1 << 17     # enumerate every relabelling up to this many; sample beyond
SAMPLES = 20_000        # seeded relabellings when there are more


# ---- 3. paired intervals, the A/A floor --------------------------------------------------------
@dataclass(frozen=True)
class PairedInterval:
    """Median of paired ratios b_i / a_i and its distribution-free interval."""
    median: float
    lo: float
    hi: float
    n: int
    ci: float
    exact: bool        # False: too few pairs for `ci`; [lo, hi] is the whole range

    def text(self, name: str = "B/A") -> str:
        note = "" if self.exact else f", n < {_min_pairs(self.ci)}: range, not a {self.ci:.0%} interval"
        return f"median {name} {self.median:.3g} [{self.lo:.3g}, {self.hi:.3g}] ({self.n} pairs{note})"


def _min_pairs(ci: float) -> int:
    n = 1
    while order_stat_ci(n, 0.5, ci) is None:
        n += 1
    return n


def _ratios(a: Sequence[float], b: Sequence[float]) -> np.ndarray:
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.shape != b.shape:
        raise ValueError(f"paired samples need equal lengths, got {len(a)} and {len(b)}")
    keep = np.isfinite(a) & np.isfinite(b) & (a > 0)   # a failed trial leaves no pair
    if not keep.any():
        raise ValueError("no finite pair with a > 0 to compare")
    return np.sort(b[keep] / a[keep])


def paired_interval(a: Sequence[float], b: Sequence[float], ci: float = 0.95) -> PairedInterval:
    """The median paired ratio b/a with an order-statistic interval (see module docstring).

    Args:
        a, b: one value per trial, same length; index i of each is pair i.
        ci: confidence level.
    """
    r = _ratios(a, b)
    iv = median_interval(r, ci)
    lo, hi = iv or (r[0], r[-1])
    # even n: the geometric mean of the middle two, so that median(b/a) = 1 / median(a/b)
    mid = r[(len(r) - 1) // 2: len(r) // 2 + 1]
    med = float(np.sqrt(mid.prod())) if len(mid) == 2 and (mid > 0).all() else float(np.median(r))
    return PairedInterval(med, float(lo), float(hi), len(r), ci, iv is not None)


@dataclass(frozen=True)
class NoiseFloor:
    """The A/A noise floor: relative differences within ±floor are noise. Keeps the two runs
    (`a`, `a2`) so that `compare` can use the rerun as data when it judges the same `a`."""
    floor: float
    interval: PairedInterval
    a: tuple[float, ...] = ()
    a2: tuple[float, ...] = ()

    def __float__(self) -> float:
        return self.floor

    def __format__(self, spec: str) -> str:      # f"{nf:.0%}" formats the band's half-width
        return format(self.floor, spec) if spec else self.text()

    def text(self) -> str:
        return (f"A/A noise floor ±{self.floor:.1%}: ratios in {band_text(self.floor)} are noise "
                f"({self.interval.text('A2/A')})")


def noise_floor(a1: Sequence[float], a2: Sequence[float], ci: float = 0.95) -> NoiseFloor:
    """max(hi, 1/lo) - 1 of the paired interval of two runs of the same configuration.

    Args:
        a1, a2: the same configuration measured twice, interleaved, pair by pair.
        ci: confidence level.
    """
    iv = paired_interval(a1, a2, ci)
    return NoiseFloor(max(iv.hi, 1 / iv.lo if iv.lo > 0 else math.inf) - 1, iv,
                      tuple(np.asarray(a1, float).tolist()), tuple(np.asarray(a2, float).tolist()))


def band_text(floor: float) -> str:
    """The noise band of a floor, as printed beside a ratio: "[0.93, 1.08]"."""
    return f"[{1 / (1 + floor):.2f}, {1 + floor:.2f}]"


# ---- 4. the verdict: permutation tests on log ratios --------------------------------------------
def _null_means(choices: np.ndarray) -> tuple[np.ndarray, bool]:
    """The mean over blocks (rows) of one value picked in each, for every way of picking
    (exact) or for SAMPLES seeded ways; (means, exact)."""
    n, k = choices.shape
    if k ** n <= EXACT_MAX:
        tot = np.zeros(1)
        for row in choices:
            tot = (tot[:, None] + row[None, :]).ravel()
        return tot / n, True
    flat = choices.ravel()[_picks(n, k)]        # one value per block, SAMPLES times
    return flat.mean(1), False


@functools.lru_cache(maxsize=8)
def _picks(n: int, k: int) -> np.ndarray:
    """SAMPLES seeded relabellings of n blocks of k, as flat indices: same data, same verdict."""
    return np.random.default_rng(0).integers(0, k, (SAMPLES, n), dtype=np.int32) + k * np.arange(n, dtype=np.int32)


def _p_value(null: np.ndarray, exact: bool, t: float, side: str) -> float:
    """Share of the null at least as extreme as t: "abs" |x| >= |t|, "ge" x >= t, "le" x <= t.
    Sampled: (hits + 1) / (samples + 1), which keeps the level."""
    tol = 1e-9 * max(1.0, abs(t))            # float sums of the same terms in another order
    hits = {"abs": np.abs(null) >= abs(t) - tol, "ge": null >= t - tol, "le": null <= t + tol}[side]
    return float(hits.mean()) if exact else (int(hits.sum()) + 1) / (len(null) + 1)


def _joint_test(a: np.ndarray, a2: np.ndarray, b: np.ndarray) -> tuple[int, float]:
    """(sign of log b/a, p): A, A2, B relabelled within each block."""
    keep = np.isfinite(a) & np.isfinite(a2) & np.isfinite(b) & (a > 0) & (a2 > 0) & (b > 0)
    if not keep.any():
        raise ValueError("no block with finite, positive A, A/A and B values to compare")
    x = np.log(np.stack([a[keep], a2[keep], b[keep]], 1))
    terms = 1.5 * x - x.sum(1, keepdims=True) / 2     # T's term if run j were B: x_j - (others) / 2
    t = float(terms[:, 2].mean())
    return int(np.sign(t)), _p_value(*_null_means(terms), t=t, side="abs")


def _margin_test(a: np.ndarray, b: np.ndarray, floor: float) -> tuple[int, float]:
    """(direction, p of that side): sign flips of log(b/a) against ±log(1 + floor)."""
    keep = np.isfinite(a) & np.isfinite(b) & (a > 0) & (b > 0)
    if not keep.any():
        raise ValueError("no finite pair with a, b > 0 to compare")
    d, m = np.log(b[keep] / a[keep]), math.log1p(floor)
    if not math.isfinite(m):
        return 0, 1.0                   # an A/A that ranged to 0: no band can be cleared
    p_up, p_down = (_p_value(*_null_means(np.stack([x, -x], 1)), t=float(x.mean()), side=side)
                    for x, side in ((d - m, "ge"), (d + m, "le")))
    return (1, p_up) if p_up <= p_down else (-1, p_down)


def _fewest(k: int, level: float) -> int:
    """Fewest blocks for which k^n relabellings can give p <= level."""
    return max(1, math.ceil(math.log(1 / level) / math.log(k) - 1e-9))


TOO_FEW = "too few pairs"


@dataclass(frozen=True)
class Comparison:
    """The verdict on B against A, and the numbers behind it."""
    verdict: str            # "<A> faster", "<B> faster" (or another `word`), "within noise", or
    #                         "too few pairs": fewer than this test needs ever to call a difference
    interval: PairedInterval
    floor: float
    labels: tuple[str, str]
    p: float = math.nan     # the test's p-value (the side that was tested, for the margin test)
    test: str = ""          # which test: "A, A/A, B relabelled" or "sign flips against the band"
    fewest: int = 0         # pairs below which this test can never say "different"
    level: float = 0.05     # the largest p that calls a difference (per side for the band test)
    against: str = "the A/A rerun"   # what B was judged against: the rerun, a band, or no change

    @property
    def within_noise(self) -> bool:
        """The test could have called a difference and did not."""
        return self.verdict == "within noise"

    @property
    def too_few(self) -> bool:
        """Fewer pairs than this test needs ever to call a difference: no verdict either way."""
        return self.interval.n < self.fewest

    @property
    def decided(self) -> bool:
        """One arm was called better."""
        return not (self.within_noise or self.too_few)

    @property
    def said(self) -> str:
        """The verdict, with the pair count a "too few pairs" rests on."""
        if self.too_few:
            return f"{TOO_FEW}: {self.interval.n} pairs cannot pass a test that needs {self.fewest}"
        return self.verdict

    @property
    def text(self) -> str:
        a, b = self.labels
        return (f"{self.said}: {self.interval.text(f'{b}/{a}')}, noise band {band_text(self.floor)}; "
                f"{self.test}: p = {self.p:.2g}")

    def __str__(self) -> str:
        return self.text


def compare(a: Sequence[float], b: Sequence[float], floor: float | NoiseFloor | None = 0.0, *,
            higher_is_better: bool = False, labels: tuple[str, str] = ("A", "B"),
            ci: float = 0.95, word: str = "faster") -> Comparison:
    """"A faster", "B faster" or "within noise", from a permutation test on log ratios
    ("too few pairs" when there are fewer than the test needs ever to call a difference)
    (module docstring): with the `NoiseFloor` of these same `a` trials, A, its A/A rerun
    and B are relabelled within each block; else log(b/a) is sign-flipped against the
    band ±log(1 + floor). False positives <= 1 - ci either way.

    Args:
        a, b: one value per trial, paired by index (from `run_interleaved`).
        floor: the A/A `NoiseFloor` (its rerun joins the test when it was measured on these
            `a`), or a number: the band B must clear (0: "no change" alone).
        higher_is_better: True for speeds (tok/s), False for times (s).
        labels: names of the two arms in the verdict.
        ci: confidence level (the test's level is 1 - ci).
        word: what "better" means in the verdict ("faster", "smaller", "more accurate").
    """
    f = floor.floor if isinstance(floor, NoiseFloor) else float(floor or 0.0)
    if not f >= 0:
        raise ValueError(f"the noise floor must be >= 0, got {f}")
    iv = paired_interval(a, b, ci)
    a_, b_, alpha = np.asarray(a, float), np.asarray(b, float), 1 - ci
    if isinstance(floor, NoiseFloor) and len(floor.a) == len(a_) and np.array_equal(floor.a, a_, equal_nan=True):
        sign, p = _joint_test(a_, np.asarray(floor.a2, float), b_)
        test = f"{labels[0]}, its A/A rerun, {labels[1]} relabelled in each pair"
        level, fewest, against = alpha, _fewest(3, alpha), "the A/A rerun"
    else:
        sign, p = _margin_test(a_, b_, f)
        test = f"sign flips of log({labels[1]}/{labels[0]})" + (" against the band" if f > 0 else "")
        level, fewest = alpha / 2, _fewest(2, alpha / 2)
        against = f"the noise band {band_text(f)}" if f > 0 else "no change"
    winner = None
    if p <= level and sign:
        winner = labels[1] if (sign > 0) == higher_is_better else labels[0]
    verdict = f"{winner} {word}" if winner else TOO_FEW if iv.n < fewest else "within noise"
    return Comparison(verdict, iv, f, labels, p, test, fewest, level, against)


# ---- 5. whole trials (a server per trial, a row of results each) ------------------------------
def compare_arms(trials: Any, metric: str, ref: str, aa: str | None, *,
                 higher_is_better: bool) -> tuple[dict[str, Comparison], NoiseFloor | None]:
    """Every arm of a `run_arms` frame against `ref` on `metric`, paired by repeat and tested
    with `ref`'s A/A rerun `aa` as a second reference run in every block. ({}, None) when
    there is no A/A arm or fewer than 2 repeats.

    Args:
        trials: `run_arms` rows; metric: the column compared.
        ref: the reference arm; aa: the label of its A/A rerun (or None).
        higher_is_better: True for throughputs, False for latencies.
    """
    wide = trials.pivot(index="rep", columns="arm", values=metric)
    if aa is None or len(wide) < 2:
        return {}, None
    floor = noise_floor(wide[ref], wide[aa])
    return {arm: compare(wide[ref], wide[arm], floor, higher_is_better=higher_is_better, labels=(ref, arm))
            for arm in wide.columns if arm not in (ref, aa)}, floor

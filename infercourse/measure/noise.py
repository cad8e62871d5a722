"""Is that difference real? A contention gate, interleaved trials, an A/A noise floor, and a
verdict on paired differences.

A speed-up measured once, on a shared machine, is a guess. Four habits make a comparison
survive the noise:

1. **Check the machine first** (`contention`, from `measure.contention`, whose docstring
   says what it reads): a busy machine does not forbid a measurement, but the learner must
   read the conclusions knowing it.
2. **Interleave, don't run one after the other** (`schedule`, `run_interleaved`). A, B,
   A, B ... or A, B, B, A (ABBA), so that a drift of the machine (a neighbour starts a
   build, the CPU heats and slows) lands on both arms alike instead of on whichever ran
   second. Trial i of each arm runs in the same block: they form *pair i*.
3. **Measure the noise floor** (`noise_floor`): run the *same* configuration twice,
   interleaved (A/A). Whatever difference A/A shows is noise by construction.
4. **Judge the paired difference, not two overlapping intervals** (`paired_interval`,
   `compare`). With n = 6 trials the order-statistic interval of one arm's median is the
   whole sample, so "intervals do not overlap" almost never happens, and when it fails
   it says nothing. Pairing removes the drift both arms share.

**Definitions used here** (all on ratios, so they are scale-free: seconds and tok/s alike):

- paired ratio r_i = b_i / a_i for pair i.
- `paired_interval`: the median of the r_i and a distribution-free interval for the true
  median ratio: the order statistics [r_(l), r_(u)] from `core.summary.order_stat_ci`
  (the number of r_i below the true median is Binomial(n, 1/2) whatever the
  distribution). A 95% interval needs n >= 6 pairs; with fewer, the interval is the whole
  range [min r, max r] and `exact` is False (its coverage is then below 95%).
- A/A **noise floor** = max(hi, 1/lo) - 1 over that interval for two runs of the same
  configuration: the largest factor, either way, that A/A cannot rule out. A floor of
  0.08 reads "differences within a factor 1.08, up or down, are noise on this machine now".
- **verdict** (`compare`): B differs from A only when the *whole* paired interval lies
  beyond the noise band [1/(1 + floor), 1 + floor]: hi < 1/(1 + floor) or lo > 1 + floor.
  Else "within noise". This asks for both things at once: the interval excludes "no
  change" and the change is larger than what the same configuration does to itself.
  The band is symmetric on a log scale, so the verdict is the same whether times or
  speeds are compared (a time ratio r is a speed ratio 1/r): with a linear band
  [1 - floor, 1 + floor] a 0.58x speed-up against a ±54% floor read "within noise" as a
  speed and "slower" as a time.

Pure numpy and stdlib: the callables passed to `run_interleaved` do the measuring
(engines never time themselves; bench does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from infercourse.core.summary import order_stat_ci
from infercourse.measure.contention import (MAX_LOAD_PER_CORE, MIN_CPU_SHARE, Contention, contention,  # noqa: F401
                                            cpu_share, judge, load_per_core, runnable_others)

__all__ = ["Contention", "cpu_share", "load_per_core", "runnable_others", "judge", "contention", "schedule",
           "run_interleaved", "PairedInterval", "paired_interval", "NoiseFloor",
           "noise_floor", "band_text", "Comparison", "compare", "run_arms", "compare_arms"]


# ---- 2. interleaved scheduling ----------------------------------------------------------------
def schedule(arms: Sequence[str], repeats: int, pattern: str = "ABBA") -> list[tuple[int, str]]:
    """The order to run trials in: a list of (block, arm); block i holds trial i of each arm.

    Args:
        arms: arm labels, e.g. ("A", "B") or ("A", "A2", "B") for A/A and A/B together.
        repeats: trials per arm (blocks).
        pattern: "alternate" (A B, A B, ...), "ABBA" (A B, B A, A B, ...: reverses every
            other block, so a linear drift hits both arms equally), or "rotate" (Latin
            square: block i starts at arm i mod k; the same as ABBA for two arms).
    """
    if pattern not in ("alternate", "ABBA", "rotate"):
        raise ValueError(f"pattern must be 'alternate', 'ABBA' or 'rotate', got {pattern!r}")
    if repeats < 1 or not arms:
        raise ValueError("need at least one arm and one repeat")
    k, out = len(arms), []
    for i in range(repeats):
        order = list(arms)
        if pattern == "ABBA" and i % 2:
            order.reverse()
        elif pattern == "rotate":
            order = order[i % k:] + order[:i % k]
        out += [(i, a) for a in order]
    return out


def run_interleaved(arms: Mapping[str, Callable[[], float]], repeats: int, *,
                    pattern: str = "ABBA", warmup: int = 1) -> dict[str, list[float]]:
    """Run each arm's measurement `repeats` times in interleaved order.

    Returns {arm: [value of block 0, block 1, ...]}: values at the same index form a pair.

    Args:
        arms: label -> a callable that runs one trial and returns one number (a median
            TTFT in s, a tok/s...). Pass the same callable under two labels for A/A.
        repeats: trials per arm.
        pattern: see `schedule`.
        warmup: untimed calls of each arm first (caches, page faults, a cold server).
    """
    for fn in arms.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[float]] = {a: [math.nan] * repeats for a in arms}
    for block, arm in schedule(list(arms), repeats, pattern):
        out[arm][block] = float(arms[arm]())
    return out


# ---- 3. paired intervals, the A/A floor, the verdict -----------------------------------------
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
    ranks = order_stat_ci(len(r), 0.5, ci)
    lo, hi = (r[ranks[0] - 1], r[ranks[1] - 1]) if ranks else (r[0], r[-1])
    return PairedInterval(float(np.median(r)), float(lo), float(hi), len(r), ci, ranks is not None)


@dataclass(frozen=True)
class NoiseFloor:
    """The A/A noise floor: relative differences within ±floor are noise."""
    floor: float
    interval: PairedInterval

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
    return NoiseFloor(max(iv.hi, 1 / iv.lo if iv.lo > 0 else math.inf) - 1, iv)


def band_text(floor: float) -> str:
    """The noise band of a floor, as printed beside a ratio: "[0.93, 1.08]"."""
    return f"[{1 / (1 + floor):.2f}, {1 + floor:.2f}]"


@dataclass(frozen=True)
class Comparison:
    """The verdict on B against A, and the numbers behind it."""
    verdict: str            # "<A> faster", "<B> faster" (or another `word`) or "within noise"
    interval: PairedInterval
    floor: float
    labels: tuple[str, str]

    @property
    def within_noise(self) -> bool:
        return self.verdict == "within noise"

    @property
    def text(self) -> str:
        a, b = self.labels
        return (f"{self.verdict}: {self.interval.text(f'{b}/{a}')}, "
                f"noise band {band_text(self.floor)}")

    def __str__(self) -> str:
        return self.text


def compare(a: Sequence[float], b: Sequence[float], floor: float | NoiseFloor = 0.0, *,
            higher_is_better: bool = False, labels: tuple[str, str] = ("A", "B"),
            ci: float = 0.95, word: str = "faster") -> Comparison:
    """"A faster", "B faster" or "within noise": B differs from A only when the whole
    paired-ratio interval of b/a lies outside [1/(1 + floor), 1 + floor].

    Args:
        a, b: one value per trial, paired by index (from `run_interleaved`).
        floor: the A/A noise floor (a `NoiseFloor` or its `.floor`); 0 judges the
            interval against "no change" alone.
        higher_is_better: True for speeds (tok/s), False for times (s).
        labels: names of the two arms in the verdict.
        ci: confidence level.
        word: what "better" means in the verdict ("faster", "smaller", "more accurate").
    """
    f = floor.floor if isinstance(floor, NoiseFloor) else float(floor)
    if not f >= 0:
        raise ValueError(f"the noise floor must be >= 0, got {f}")
    iv = paired_interval(a, b, ci)
    if iv.hi < 1 / (1 + f):    # b clearly smaller than a
        winner = labels[0] if higher_is_better else labels[1]
    elif iv.lo > 1 + f:        # b clearly larger than a
        winner = labels[1] if higher_is_better else labels[0]
    else:
        winner = None
    return Comparison(f"{winner} {word}" if winner else "within noise", iv, f, labels)


# ---- 4. whole trials (a server per trial, a row of results each) ------------------------------
def run_arms(arms: Mapping[str, Any], repeats: int, trial: Callable[[Any, str], tuple[dict, Any]],
             pattern: str = "ABBA") -> tuple[Any, list]:
    """Run `trial(value, label) -> (row, run)` for every arm, `repeats` times in `schedule`
    order; returns a DataFrame of the rows (with `arm` and `rep` added) and the runs.
    For trials that return many numbers (a bench run's summary row), where
    `run_interleaved` takes one number per call. `label` is the arm, with `-r<rep>` when
    repeats > 1 (for folder and run names).

    Args:
        arms: label -> the value `trial` receives (a level, a flag); put a reference twice,
            under two labels, for its A/A floor.
        repeats: trials per arm.
        trial: runs one trial.
        pattern: see `schedule`.
    """
    import pandas as pd
    rows, runs = [], []
    for rep, arm in schedule(list(arms), repeats, pattern):
        row, r = trial(arms[arm], f"{arm}" + (f"-r{rep}" if repeats > 1 else ""))
        rows.append({**row, "arm": arm, "rep": rep})
        runs.append(r)
    return pd.DataFrame(rows), runs


def compare_arms(trials: Any, metric: str, ref: str, aa: str | None, *,
                 higher_is_better: bool) -> tuple[dict[str, Comparison], NoiseFloor | None]:
    """Every arm of a `run_arms` frame against `ref` on `metric`, paired by repeat and judged
    against the A/A floor of `ref` and `aa` (its rerun). ({}, None) when there is no A/A arm
    or fewer than 2 repeats.

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

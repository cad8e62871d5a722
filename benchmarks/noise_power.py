"""Benchmark: how often does `noise.compare` find a real change, and how often does it
invent one, as the number of pairs grows?

Seeded synthetic trials, no timing: in every block the machine's speed drifts (a shared
log-level, uniform in ±0.3), and each trial adds its own log-normal noise σ. Arm A and its
A/A rerun A2 have the true value 1, arm B has `effect` (a time: B slower). Each cell calls
`noise.noise_floor(a, a2)` and `noise.compare(a, b, floor)` as the lessons do, `trials`
times, and reports

- power: the share of "A faster" verdicts with B truly ×effect;
- false positives: the share of verdicts other than "within noise" with B equal to A.

Three rules side by side:
- old: the rule before issue 25 (B differs when the *whole* paired interval of B/A lies
  beyond the A/A band), rebuilt here from `paired_interval` and the floor, which are
  unchanged;
- new: `compare` with the A/A `NoiseFloor` (A, A/A, B relabelled in each pair);
- band: `compare` with the floor as a number (`.floor`), as `capstone` and `tuning_log`
  pass it: a sign-flip test of B/A against the band's edge.

    .venv/bin/python benchmarks/noise_power.py [--trials 2000] [--effect 1.35] [--sigma 0.1]
"""
from __future__ import annotations

import argparse

import numpy as np

from infercourse.measure import noise

PAIRS = (3, 4, 5, 6, 8, 10, 20)


def old_rule(a, a2, b) -> str:
    """The pre-issue-25 verdict: B differs only when B/A's whole interval clears the A/A band."""
    f = noise.noise_floor(a, a2).floor
    iv = noise.paired_interval(a, b)
    return "B faster" if iv.hi < 1 / (1 + f) else "A faster" if iv.lo > 1 + f else "within noise"


RULES = {"old": old_rule,
         "new": lambda a, a2, b: noise.compare(a, b, noise.noise_floor(a, a2)).verdict,
         "band": lambda a, a2, b: noise.compare(a, b, noise.noise_floor(a, a2).floor).verdict}


def trials(n: int, effect: float, sigma: float, count: int, seed: int):
    """`count` seeded (a, a2, b) triples of n pairs: a shared drift per block, noise per trial."""
    rng = np.random.default_rng([seed, n, round(effect * 1e6)])
    for _ in range(count):
        level = rng.uniform(-0.3, 0.3, n)
        a, a2, b = (np.exp(level + rng.normal(0, sigma, n)) for _ in range(3))
        yield a, a2, b * effect


def rates(rule, n: int, effect: float, sigma: float, count: int, seed: int = 0) -> tuple[float, float]:
    """(power at ×effect, false-positive rate with no effect) of `rule` at n pairs."""
    found = np.mean([rule(*t) == "A faster" for t in trials(n, effect, sigma, count, seed)])
    false = np.mean([rule(*t) != "within noise" for t in trials(n, 1.0, sigma, count, seed + 1)])
    return float(found), float(false)


def table(pairs=PAIRS, effect: float = 1.35, sigma: float = 0.1, count: int = 2000, rules=RULES):
    """{rule: {pairs: (power, false positives)}}."""
    return {name: {n: rates(rule, n, effect, sigma, count) for n in pairs} for name, rule in rules.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=2000)
    p.add_argument("--effect", type=float, default=1.35)
    p.add_argument("--sigma", type=float, default=0.1)
    args = p.parse_args()
    t = table(effect=args.effect, sigma=args.sigma, count=args.trials)
    print(f"x{args.effect} at sigma {args.sigma}, {args.trials} trials a cell: power / false positives")
    print("| pairs | " + " | ".join(f"{r} power | {r} false +" for r in t) + " |")
    print("|---" * (1 + 2 * len(t)) + "|")
    for n in PAIRS:
        print(f"| {n} | " + " | ".join(f"{t[r][n][0]:.1%} | {t[r][n][1]:.2%}" for r in t) + " |")
    # for a repeats policy: the new rule's power by effect (as multiples of sigma on the log scale)
    effects, pairs = (1.05, 1.1, 1.2, 1.35), (2, 4, 6, 8, 10, 20)
    print(f"\nnew rule, power by true change (sigma {args.sigma}), {args.trials} trials a cell")
    print("| pairs | " + " | ".join(f"x{e} ({np.log(e) / args.sigma:.1f} sigma)" for e in effects) + " |")
    print("|---" * (1 + len(effects)) + "|")
    for n in pairs:
        print(f"| {n} | " + " | ".join(f"{rates(RULES['new'], n, e, args.sigma, args.trials)[0]:.1%}"
                                      for e in effects) + " |")


if __name__ == "__main__":
    main()

"""Interleaved trials: the order to run the arms of a comparison in, and the loops that run it.

Trial i of every arm runs in block i, *pair i*, so a drift between blocks hits all arms
alike. What matters next is the order *inside* a block. The verdict (`noise.compare`) is a
permutation test that relabels the runs of a block: it asks "if B were only A again, which
of the block's runs carries the label B is chance". That is true by construction only when
chance chose it. A fixed order breaks it: with A, A2, B run as ABBA, the same arm sits in the
middle of every block, and whatever the middle slot costs (a cache the previous run warmed,
a model swap) reads as an effect. Simulated (tests/test_noise.py, 3,000 trials of 6 blocks,
σ = 0.1, no real effect, B in the middle of every block): 5.2 % false positives with no
position cost, 10 % at a middle-slot cost of 1σ, 16 % at 2σ; shuffled, 4.6-5.6 % at each.

So the default order is **random within each block, seeded and recorded** (`schedule`'s
"random"): the relabelling then matches how runs were assigned, whatever a position costs,
and a slow drift inside a block is a position cost like any other. The fixed patterns stay
for teaching (and for two arms judged against a number, where ABBA cancels a linear drift):

- "ABBA": A B, B A, ... every block followed by its mirror;
- "rotate": a Latin square, each rotation followed by its mirror;
- "alternate": A B, A B, ... (A always first: drift not cancelled, kept to show the bias).

Pure stdlib and numpy: the callables passed in do the measuring (engines never time
themselves; bench does).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

__all__ = ["PATTERNS", "schedule", "Interleaved", "run_interleaved", "run_arms"]

PATTERNS = ("random", "ABBA", "rotate", "alternate")


def schedule(arms: Sequence[str], repeats: int, pattern: str = "random", seed: int = 0) -> list[tuple[int, str]]:
    """The order to run trials in: a list of (block, arm); block i holds trial i of each arm.

    "random" shuffles each block on its own (numpy's generator seeded with `seed`: the same
    call gives the same order, so a run can be repeated and its order printed). "ABBA" and
    "rotate" follow every block with its mirror image, so a linear drift adds opposite
    amounts to consecutive pairs; an odd `repeats` (> 1) is then rounded up to the next even
    number of blocks. Read the block count from the result.

    Args:
        arms: arm labels, e.g. ("A", "B") or ("A", "A2", "B") for A/A and A/B together.
        repeats: trials per arm (blocks).
        pattern: "random" (the default: what the permutation test assumes), "ABBA", "rotate"
            or "alternate" (module docstring).
        seed: the shuffle's seed ("random" only).
    """
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {', '.join(map(repr, PATTERNS))}, got {pattern!r}")
    if repeats < 1 or not arms:
        raise ValueError("need at least one arm and one repeat")
    mirrored = pattern in ("ABBA", "rotate")
    blocks = repeats + (repeats % 2 if mirrored and repeats > 1 else 0)
    k, out, rng = len(arms), [], np.random.default_rng(seed)
    for i in range(blocks):
        order = list(arms)
        if pattern == "random":
            order = [order[j] for j in rng.permutation(k)]
        if pattern == "rotate":
            j = (i // 2) % k
            order = order[j:] + order[:j]
        if mirrored and i % 2:
            order.reverse()
        out += [(i, a) for a in order]
    return out


class Interleaved(dict):
    """{arm: [value of block 0, block 1, ...]} from `run_interleaved`, with the `order`
    [(block, arm), ...] it ran in and its `pattern` and `seed`, so a result says how its
    runs were assigned."""

    def __init__(self, values: Mapping[str, list[float]], order: list[tuple[int, str]], pattern: str, seed: int):
        super().__init__(values)
        self.order, self.pattern, self.seed = order, pattern, seed

    def slots(self) -> dict[str, list[int]]:
        """{arm: [its position inside block 0, block 1, ...]}: 0 ran first."""
        pos: dict[tuple[int, str], int] = {}
        for block, arm in self.order:
            pos[(block, arm)] = sum(1 for b, _ in pos if b == block)
        return {arm: [pos[(b, arm)] for b in range(len(v))] for arm, v in self.items()}


def run_interleaved(arms: Mapping[str, Callable[[], float]], repeats: int, *,
                    pattern: str = "random", seed: int = 0, warmup: int = 1) -> Interleaved:
    """Run each arm's measurement once per block of `schedule`.

    Returns an `Interleaved`: {arm: [value of block 0, block 1, ...]}; values at the same
    index form a pair; `.order` is the order they ran in.

    Args:
        arms: label -> a callable that runs one trial and returns one number (a median
            TTFT in s, a tok/s...). Pass the same callable under two labels for A/A.
        repeats: trials per arm (mirrored patterns round an odd count > 1 up).
        pattern, seed: see `schedule`.
        warmup: untimed calls of each arm first (caches, page faults, a cold server).
    """
    for fn in arms.values():
        for _ in range(warmup):
            fn()
    order = schedule(list(arms), repeats, pattern, seed)
    out: dict[str, list[float]] = {a: [math.nan] * (order[-1][0] + 1) for a in arms}
    for block, arm in order:
        out[arm][block] = float(arms[arm]())
    return Interleaved(out, order, pattern, seed)


def run_arms(arms: Mapping[str, Any], repeats: int, trial: Callable[[Any, str], tuple[dict, Any]],
             pattern: str = "random", seed: int = 0) -> tuple[Any, list]:
    """Run `trial(value, label) -> (row, run)` for every arm, once per block of `schedule`;
    returns a DataFrame of the rows (with `arm`, `rep` and `slot`, the arm's position in its
    block, added) and the runs. For trials that return many numbers (a bench run's summary
    row), where `run_interleaved` takes one number per call. `label` is the arm, with
    `-r<rep>` when repeats > 1 (for folder and run names).

    Args:
        arms: label -> the value `trial` receives (a level, a flag); put a reference twice,
            under two labels, for its A/A floor.
        repeats: trials per arm (mirrored patterns round an odd count > 1 up).
        trial: runs one trial.
        pattern, seed: see `schedule`.
    """
    import pandas as pd
    rows, runs, slot = [], [], {}
    for rep, arm in schedule(list(arms), repeats, pattern, seed):
        row, r = trial(arms[arm], f"{arm}" + (f"-r{rep}" if repeats > 1 else ""))
        slot[rep] = slot.get(rep, -1) + 1
        rows.append({**row, "arm": arm, "rep": rep, "slot": slot[rep]})
        runs.append(r)
    return pd.DataFrame(rows), runs

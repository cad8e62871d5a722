"""How prefill time grows with the prompt: a fixed cost, a linear term and a quadratic one.

Prefilling n prompt tokens costs three kinds of work:

- **fixed** `a` (s): per request, whatever its length: the HTTP round trip, tokenizing,
  scheduling, sampling the one token that ends prefill;
- **linear** `b·n`: every token goes through every weight matrix once, 2 x (non-embedding)
  params FLOPs a token, so this term is the model's size times the prompt's;
- **quadratic** `c·n²`: attention. Token i scores itself against the i tokens before it, so
  a causal prompt of n tokens holds about n²/2 (query, key) pairs, each costing 2 x head_dim
  FLOPs for Q·Kᵀ and as many for the weighted sum of V, in every layer and query head:
  about 2 x layers x heads x head_dim x n² FLOPs in all.

So time(n) = a + b·n + c·n², and the prefill *rate* n / time(n) falls as n grows once the
n² term counts. The two per-token costs are equal at n* = b / c tokens; below it the weights
dominate, above it attention does. From the FLOP counts alone n* = non-embedding params /
(layers x heads x head_dim) (`flop_crossover_tokens`): about 6,100 tokens for SmolLM2-135M.
A kernel that multiplies the whole Q·Kᵀ block and masks the future afterwards (llama.cpp's
unfused path) does twice the causal count, which halves n*; its CPU flash-attention kernel
skips the masked positions.

`fit_prefill` finds a, b, c by least squares on measured (length, seconds) points, none
negative (a negative attention cost is noise, not physics: such a term is pinned at 0 and
the fit says so), each point weighted by its own time so a 1k-token point counts as much
as a 16k one. `predict_prefill_s` turns the fit into a forecast for another length, with a
note when that length lies beyond the longest one measured (an extrapolation: the n² term's
error grows with the square of the stretch). Pure numpy: what `ops.agent_doctor` can use
to forecast an agent's cold first call from a curve measured on the learner's server.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd

__all__ = ["PrefillFit", "PrefillPrediction", "fit_prefill", "predict_prefill_s", "rate_curve",
           "flop_crossover_tokens", "TERMS"]

TERMS = ("fixed", "linear", "quadratic")


@dataclass(frozen=True)
class PrefillFit:
    """time(n) = a + b·n + c·n² seconds, fitted on measured lengths.

    Attributes:
        a: fixed seconds per request; b: seconds per token (weights); c: seconds per token²
            (attention).
        n_min, n_max: the shortest and longest measured lengths (a forecast past n_max
            extrapolates).
        n_points: points fitted; rel_rms: root-mean-square of the relative residuals.
        pinned: terms the fit held at 0 because they came out negative.
    """
    a: float
    b: float
    c: float
    n_min: int
    n_max: int
    n_points: int
    rel_rms: float
    pinned: tuple[str, ...] = ()

    def time_s(self, n: float) -> float:
        """Fitted prefill seconds for `n` tokens."""
        return self.a + self.b * n + self.c * n * n

    def rate(self, n: float) -> float:
        """Fitted prefill rate at `n` tokens (tok/s): n / time(n)."""
        t = self.time_s(n)
        return n / t if t > 0 else math.inf

    def terms_at(self, n: float) -> dict[str, float]:
        """Seconds of each term at `n` tokens: fixed, linear (weights), quadratic (attention)."""
        return {"fixed": self.a, "linear": self.b * n, "quadratic": self.c * n * n}

    def share_at(self, n: float) -> dict[str, float]:
        """Each term's share of the fitted time at `n` tokens (they sum to 1)."""
        t, terms = self.time_s(n), self.terms_at(n)
        return {k: (v / t if t > 0 else math.nan) for k, v in terms.items()}

    @property
    def crossover_tokens(self) -> float:
        """n* = b / c: the length at which attention costs as much as the weights
        (inf when the fit found no n² term; 0 when it found no linear one)."""
        if self.c <= 0:
            return math.inf
        return self.b / self.c

    def as_dict(self) -> dict[str, float | int | str]:
        return {"a_s": self.a, "b_s_per_token": self.b, "c_s_per_token2": self.c,
                "crossover_tokens": self.crossover_tokens, "n_min": self.n_min, "n_max": self.n_max,
                "n_points": self.n_points, "rel_rms": self.rel_rms, "pinned": ", ".join(self.pinned)}


def fit_prefill(n_tokens: Sequence[float], seconds: Sequence[float]) -> PrefillFit:
    """Least-squares a, b, c >= 0 of time(n) = a + b·n + c·n² on measured points.

    Each residual is taken relative to its own time (weight 1/t), so short prompts are not
    drowned by long ones. Non-negative least squares over three terms is solved exactly by
    trying every subset of them (8 small fits) and keeping the best whose coefficients are
    all >= 0: the optimum is one of those.

    Args:
        n_tokens: prompt lengths (tokens prefilled), one per measurement (repeats allowed).
        seconds: prefill times of those measurements (the server's own `prompt_ms` / 1000
            is the cleanest: no HTTP in it).
    """
    n = np.asarray(n_tokens, float)
    y = np.asarray(seconds, float)
    keep = np.isfinite(n) & np.isfinite(y) & (n > 0) & (y > 0)
    n, y = n[keep], y[keep]
    if len(np.unique(n)) < 3:
        raise ValueError(f"a three-term fit needs at least 3 distinct lengths, got {sorted(set(n.tolist()))}")
    scale = float(n.max())             # columns 1, x, x² with x = n / n_max: well conditioned
    x = n / scale
    X = np.stack([np.ones_like(x), x, x * x], 1)
    w = 1.0 / y
    best: tuple[float, np.ndarray] | None = None
    for mask in itertools.product((True, False), repeat=3):
        cols = [i for i in range(3) if mask[i]]
        if not cols:
            continue
        coef, *_ = np.linalg.lstsq(X[:, cols] * w[:, None], y * w, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(3)
        full[cols] = coef
        rss = float(np.sum((w * (X @ full - y)) ** 2))
        if best is None or rss < best[0] * (1 - 1e-12):
            best = (rss, full)
    assert best is not None            # the single best non-negative term always qualifies
    rss, (a, b_x, c_x) = best
    b, c = b_x / scale, c_x / scale ** 2
    pinned = tuple(name for name, v in zip(TERMS, (a, b, c)) if v == 0.0)
    return PrefillFit(float(a), float(b), float(c), int(n.min()), int(n.max()), int(len(n)),
                      math.sqrt(rss / len(n)), pinned)


@dataclass(frozen=True)
class PrefillPrediction:
    """A forecast from a `PrefillFit`: seconds and rate at `n_tokens`, and how far it
    reaches past what was measured. `float(p)` is the seconds."""
    n_tokens: int
    seconds: float
    tok_per_s: float
    extrapolated: bool
    note: str

    def __float__(self) -> float:
        return self.seconds


def predict_prefill_s(n_tokens: int, fit: PrefillFit) -> PrefillPrediction:
    """The fitted cold prefill of `n_tokens`, with a note on where it stands: inside the
    measured lengths (interpolated), or past the longest (extrapolated) or below the
    shortest.

    Args:
        n_tokens: the prompt to forecast (e.g. an agent's first request, in tokens).
        fit: a `fit_prefill` result, from the same server settings the forecast is for.
    """
    n = int(n_tokens)
    t = fit.time_s(n)
    if n > fit.n_max:
        note = (f"extrapolated: {n:,} tokens is {n / fit.n_max:.2f}x the longest length measured "
                f"({fit.n_max:,}); the n² term's error grows with the square of that stretch")
    elif n < fit.n_min:
        note = f"below the shortest length measured ({fit.n_min:,}): the fixed cost weighs most here"
    else:
        note = f"interpolated between measured lengths ({fit.n_min:,} to {fit.n_max:,} tokens)"
    return PrefillPrediction(n, t, n / t if t > 0 else math.inf, n > fit.n_max, note)


def rate_curve(fit: PrefillFit, lengths: Sequence[int]) -> pd.DataFrame:
    """The fitted curve at `lengths`: seconds, rate (tok/s) and each term's share.

    Args:
        fit: a `fit_prefill` result.
        lengths: prompt lengths in tokens.
    """
    rows = []
    for n in lengths:
        share = fit.share_at(n)
        rows.append({"n_tokens": int(n), "time_s": fit.time_s(n), "tok_per_s": fit.rate(n),
                     **{f"{k}_share": v for k, v in share.items()}})
    return pd.DataFrame(rows)


def flop_crossover_tokens(linear_params: float, n_layers: int, n_heads: int, head_dim: int, *,
                          full_block: bool = False) -> float:
    """The length at which attention's FLOPs equal the weights' (module docstring):
    linear_params / (layers x heads x head_dim), for a kernel that skips masked positions;
    half that when `full_block` (Q·Kᵀ computed for every pair, the future masked after).

    Args:
        linear_params: parameters every prompt token multiplies (all but the token-embedding
            table, which is a lookup, and the output head, which prefill runs for the last
            token only).
        n_layers, n_heads, head_dim: the model's attention shape (query heads).
        full_block: count the unfused kernel's whole n x n block instead of the causal half.
    """
    per_pair = n_layers * n_heads * head_dim
    return linear_params / per_pair / (2.0 if full_block else 1.0)

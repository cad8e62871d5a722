"""Draft and verify, by hand: the step at the heart of every speculative decoder.

A drafter guesses the next k tokens. The target runs *once* over the last known token plus
the k guesses; its logits at each of those k+1 positions say what it would have written
after each prefix. Verification keeps guesses while they agree, then adds one token of the
target's own (the correction, or a bonus after a full match), and forgets the keys and
values it computed for the rejected guesses (`DynamicCache.crop`). Each pass therefore
yields between 1 and k+1 tokens.

- `speculative_greedy`: the greedy loop in a dozen lines, on any transformers causal LM.
  The drafter is any function `propose(tokens, hidden)`: prompt lookup ignores `hidden`;
  multi-token-prediction heads (notebook 08) read it. With `propose` returning nothing it
  is plain greedy decoding, one token per pass, the baseline for speed and exactness.
- `rejection_sample`: what keeps the *distribution* exact when sampling (Leviathan et al.
  2023, Chen et al. 2023): accept a drafted token x ~ q with probability min(1, p(x)/q(x));
  after a rejection, sample from the leftover mass max(0, p − q), renormalised. The token
  that comes out is distributed exactly as p, whatever q is; a good q only makes
  rejections rare: a draft is accepted with probability Σ_x min(p(x), q(x)).
  `rejection_demo` checks that by drawing many times.
- `compare_drafters`: the greedy loop with several drafters on one prompt, timed (wall
  clock and process CPU time), with each output compared to plain decoding's.

Hand-written because the libraries that do this (transformers' assisted generation,
llama.cpp's speculative paths) bury the twenty lines under batching and caching.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

__all__ = ["speculative_greedy", "rejection_sample", "rejection_demo", "compare_drafters", "plot_drafters"]

Drafter = Callable[[list, object], Sequence[int]]


def speculative_greedy(model, ids: Sequence[int], max_new: int, propose: Drafter) -> dict:
    """Greedy speculative decoding with one target pass per step; returns the new tokens
    and what it took: passes (target forward calls after the prompt), proposed, accepted.

    Args:
        model: a transformers causal LM (`base_model` gives hidden states, the output
            embeddings turn them into logits). Its KV cache is passed as `cache=`, the
            name transformers 5 uses; older code and most tutorials call it
            `past_key_values`. `crop(-n)` drops the last n cached positions.
        ids: prompt token ids (at least 2: all but the last are prefilled first).
        max_new: tokens to generate (no early stop: runs compare at the same length).
        propose: drafter, (tokens so far, hidden state of the last verified position) ->
            guessed next token ids; return [] for plain decoding.
    """
    import torch
    from transformers import DynamicCache
    if len(ids) < 2 or max_new < 1:
        raise ValueError("speculative_greedy needs a prompt of >= 2 tokens and max_new >= 1")
    trunk, head, cache = model.base_model, model.get_output_embeddings(), DynamicCache()
    with torch.inference_mode():
        h = trunk(torch.tensor([ids[:-1]]), cache=cache).last_hidden_state[0, -1]
        seq, passes, proposed, accepted = list(ids), 0, 0, 0
        while (left := max_new - (len(seq) - len(ids))) > 0:
            draft = [int(t) for t in propose(seq, h)][:left - 1]
            hs = trunk(torch.tensor([[seq[-1]] + draft]), cache=cache).last_hidden_state[0]
            best = head(hs).argmax(-1).tolist()    # the target's own next token after each position
            n = 0
            while n < len(draft) and draft[n] == best[n]:
                n += 1                             # keep guesses while the target agrees
            seq += draft[:n] + [best[n]]           # ... then one token of its own
            cache.crop(len(seq) - 1 - cache.get_seq_length())   # forget rejected guesses' keys/values
            h, passes, proposed, accepted = hs[n], passes + 1, proposed + len(draft), accepted + n
    return {"tokens": seq[len(ids):], "passes": passes, "proposed": proposed, "accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else float("nan"),
            "tokens_per_pass": max_new / passes}


def rejection_sample(p: np.ndarray, q: np.ndarray, drafted: int, rng: np.random.Generator) -> tuple[int, bool]:
    """One speculative sampling decision: keep the drafted token or replace it.

    Args:
        p: the target's next-token probabilities (sums to 1).
        q: the drafter's probabilities, from which `drafted` was sampled.
        drafted: the token the drafter proposed.
        rng: numpy random generator.
    Returns (token, accepted). Over many draws the token follows p exactly.
    """
    p, q = np.asarray(p, float), np.asarray(q, float)
    if p.shape != q.shape or not (np.isclose(p.sum(), 1) and np.isclose(q.sum(), 1)):
        raise ValueError("p and q must be probability vectors over the same vocabulary")
    if q[drafted] <= 0:
        raise ValueError("the drafted token must have q > 0 (it was sampled from q)")
    if rng.random() < min(1.0, p[drafted] / q[drafted]):
        return drafted, True
    leftover = np.maximum(p - q, 0.0)  # where the target wants more than the drafter offered
    return int(rng.choice(p.size, p=leftover / leftover.sum())), False


def rejection_demo(p: Sequence[float], q: Sequence[float], n: int = 20_000, seed: int = 0):
    """Draw n drafted tokens from q, pass each through `rejection_sample` against p, and
    tabulate: per token, p, q and how often it came out. Returns (DataFrame, summary) with
    the measured acceptance rate and the predicted one, Σ min(p, q).

    Args:
        p, q: target and drafter probabilities over a small vocabulary.
        n: draws (the output frequencies approach p as n grows: ~1/sqrt(n) noise).
        seed: numpy seed.
    """
    import pandas as pd
    p, q = np.asarray(p, float), np.asarray(q, float)
    rng = np.random.default_rng(seed)
    out, ok = np.zeros(p.size), 0
    for x in rng.choice(q.size, size=n, p=q):
        tok, accepted = rejection_sample(p, q, int(x), rng)
        out[tok] += 1
        ok += accepted
    df = pd.DataFrame({"target p": p, "drafter q": q, "output frequency": out / n}).rename_axis("token")
    return df, {"acceptance": ok / n, "predicted_acceptance": float(np.minimum(p, q).sum()),
                "max_abs_gap_to_p": float(np.abs(out / n - p).max()), "draws": n}


def compare_drafters(model, ids: Sequence[int], max_new: int, drafters: dict, *, repeats: int = 1):
    """Run `speculative_greedy` once per drafter (plus a warm-up); one row per drafter:
    seconds (wall clock) and cpu_s (this process's CPU time), each the best of `repeats`,
    passes, tokens_per_pass, acceptance_rate, speed_up over the first drafter (from CPU
    time), speed_up_wall (from wall clock) and identical (same tokens as the first).

    Why CPU time: on a machine shared with other programs, they stretch the wall clock of
    a run without changing the work it does; the process's CPU time follows the work. On
    an idle machine with the model on one thread the two agree.

    Args:
        model: a transformers causal LM.
        ids: prompt token ids.
        max_new: tokens to generate.
        drafters: {name: propose(tokens, hidden)}; put plain decoding (`lambda s, h: []`)
            first: it is the reference for speed and output.
        repeats: runs per drafter; the fastest is kept.
    """
    import time

    import pandas as pd
    speculative_greedy(model, ids, 2, lambda s, h: [])  # warm-up: first-call allocations
    rows, ref = [], None
    for name, propose in drafters.items():
        wall = cpu = float("inf")
        for _ in range(max(1, repeats)):
            t0, c0 = time.perf_counter(), time.process_time()
            res = speculative_greedy(model, ids, max_new, propose)
            wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
        ref = ref or {"tokens": res["tokens"], "wall": wall, "cpu": cpu}
        rows.append({"drafter": name, "seconds": wall, "cpu_s": cpu, "passes": res["passes"],
                     "tokens_per_pass": res["tokens_per_pass"], "proposed": res["proposed"],
                     "accepted": res["accepted"], "acceptance_rate": res["acceptance_rate"],
                     "speed_up": ref["cpu"] / cpu, "speed_up_wall": ref["wall"] / wall,
                     "identical": res["tokens"] == ref["tokens"], "tokens": res["tokens"]})
    return pd.DataFrame(rows)


def plot_drafters(df, ceiling: float | None = None, axes=None):
    """Two panels from `compare_drafters` rows (with a "prompt" column): tokens per target
    pass (left, with the all-accepted `ceiling` dashed) and speed-up over plain decoding
    (right, from CPU time; 1 = no gain, dashed)."""
    import matplotlib.pyplot as plt
    axes = axes if axes is not None else plt.subplots(1, 2, figsize=(12, 4))[1]
    tab = {c: df.pivot_table(index="drafter", columns="prompt", values=c, sort=False)
           for c in ("tokens_per_pass", "speed_up")}
    tab["tokens_per_pass"].plot.bar(ax=axes[0], rot=20)
    axes[0].set(ylabel="tokens per target pass", xlabel="", title="Tokens per target pass")
    if ceiling:
        axes[0].axhline(ceiling, ls="--", c="grey", label=f"every guess accepted ({ceiling:g})")
    tab["speed_up"].plot.bar(ax=axes[1], rot=20)
    axes[1].axhline(1, ls="--", c="grey", label="no gain (1×)")
    axes[1].set(ylabel="speed-up vs plain decoding (×, CPU time)", xlabel="", title="Speed-up")
    for ax in axes:
        ax.legend(fontsize=8)
    return axes

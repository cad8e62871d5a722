"""Draft and verify, by hand: the step at the heart of every speculative decoder.

A drafter guesses the next k tokens. The target runs *once* over the last known token plus
the k guesses; its logits at each of those k+1 positions say what it would have written
after each prefix. Verification keeps guesses while they agree, then adds one token of the
target's own (the correction, or a bonus after a full match), and forgets the keys and
values it computed for the rejected guesses (`DynamicCache.crop`). Each pass therefore
yields between 1 and k+1 tokens.

- `speculative_greedy`: the greedy loop in a dozen lines, on any transformers causal LM.
  The drafter is any function `propose(tokens, hidden)`: prompt lookup ignores `hidden`;
  multi-token-prediction heads (notebook 09) read it. With `propose` returning nothing it
  is plain greedy decoding, one token per pass, the baseline for speed and exactness.
- `rejection_sample`: what keeps the *distribution* exact when sampling (Leviathan et al.
  2023, Chen et al. 2023): accept a drafted token x ~ q with probability min(1, p(x)/q(x));
  after a rejection, sample from the leftover mass max(0, p − q), renormalised. The token
  that comes out is distributed exactly as p, whatever q is; a good q only makes
  rejections rare: a draft is accepted with probability Σ_x min(p(x), q(x)).
  `rejection_demo` checks that by drawing many times.
- `compare_drafters`: the greedy loop with several drafters on one prompt, timed (wall
  clock and process CPU time), repeated and interleaved with an A/A rerun of plain
  decoding so each speed-up is judged against the noise floor (`measure.noise`), with each
  output compared to plain decoding's.
- `pass_cost`: the CPU time of one pass over 1, 3, 11 positions: what verifying k guesses
  costs on this hardware, the number that decides whether a drafter pays.

Hand-written because the libraries that do this (transformers' assisted generation,
llama.cpp's speculative paths) bury the twenty lines under batching and caching.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from infercourse.measure import noise

__all__ = ["speculative_greedy", "rejection_sample", "rejection_demo", "rejection_sentence", "compare_drafters", "pass_cost",
           "plot_drafters", "versus_plain"]

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


def rejection_sentence(toy, summary: dict, z: float = 3.0) -> str:
    """`rejection_demo`'s check in words: do the output frequencies sit on p (each within
    `z` standard errors of a frequency, √(p(1−p)/draws)), and does the measured acceptance
    match Σ min(p, q) within `z` of its own standard error? Either can fail, and it says so.

    Args:
        toy, summary: `rejection_demo`'s two results.
    """
    n, p, f = summary["draws"], toy["target p"].to_numpy(float), toy["output frequency"].to_numpy(float)
    worst = float(np.max(np.abs(f - p) / np.sqrt(np.maximum(p * (1 - p), 1e-12) / n)))
    a, pa = summary["acceptance"], summary["predicted_acceptance"]
    za = abs(a - pa) / np.sqrt(max(pa * (1 - pa), 1e-12) / n)
    freq = (f"the output frequencies sit on p (largest gap {worst:.1f} standard errors of a frequency over {n:,} draws)"
            if worst <= z else f"the output frequencies miss p by up to {worst:.1f} standard errors: not the target's distribution")
    acc = (f"the measured acceptance {a:.3f} matches Σ min(p, q) = {pa:.3f} ({za:.1f} standard errors apart)" if za <= z else
           f"the measured acceptance {a:.3f} is {za:.1f} standard errors from Σ min(p, q) = {pa:.3f}")
    return f"Over {n:,} draws, {freq}; {acc}."


def compare_drafters(model, ids: Sequence[int], max_new: int, drafters: dict, *, repeats: int = 1):
    """Run `speculative_greedy` with each drafter, `repeats` times in interleaved (rotating)
    order, the first drafter twice per round (its A/A rerun: the noise floor). One row per
    drafter: seconds (wall) and cpu_s (this process's CPU time), medians over repeats;
    passes, tokens_per_pass, proposed, accepted, acceptance_rate; speed_up_cpu over the
    first drafter (median paired ratio of CPU time) with its interval `speed_up_cpu_lo`/
    `_hi` (a range when `speed_up_cpu_exact` is False: too few of its `speed_up_cpu_pairs`), and `verdict`
    against the A/A floor (`noise_floor`, `measure.noise`); speed_up_wall (same, wall clock); identical
    (same tokens as the first). `attrs["noise_floor_text"]` states the floor.

    Why CPU time: on a machine shared with other programs, they stretch the wall clock of
    a run without changing the work it does; the process's CPU time follows the work. On
    an idle machine with the model on one thread the two agree. Why repeats: one run of
    each is a single draw; two variants with the same passes and tokens per pass can show
    2.09× and 0.98× from noise alone.

    Args:
        model: a transformers causal LM.
        ids: prompt token ids.
        max_new: tokens to generate.
        drafters: {name: propose(tokens, hidden)}; put plain decoding (`lambda s, h: []`)
            first: it is the reference for speed and output.
        repeats: runs per drafter (>= 2 for a floor and verdicts; 6 for a 95% interval).
    """
    import time

    import pandas as pd
    speculative_greedy(model, ids, 2, lambda s, h: [])  # warm-up: first-call allocations
    ref = next(iter(drafters))
    arms = dict(drafters)
    aa = f"{ref} (A/A)" if repeats > 1 else None
    if aa:
        arms[aa] = drafters[ref]
    res, wall = {}, {a: [] for a in arms}

    def timed(label):
        def go():
            t0, c0 = time.perf_counter(), time.process_time()
            res[label] = speculative_greedy(model, ids, max_new, arms[label])
            wall[label].append(time.perf_counter() - t0)    # an arm's trials run in block order
            return time.process_time() - c0
        return go
    cpu = noise.run_interleaved({a: timed(a) for a in arms}, repeats, warmup=0)
    floor = noise.noise_floor(cpu[ref], cpu[aa]) if aa else None
    rows = []
    for name in drafters:
        r, up = res[name], noise.paired_interval(cpu[name], cpu[ref])     # ref / this: > 1 is faster
        cmp = noise.compare(cpu[ref], cpu[name], floor, labels=(ref, name)) if floor else None
        verdict = cmp.verdict if cmp else "1 run: not judged"
        rows.append({"drafter": name, "seconds": float(np.median(wall[name])), "cpu_s": float(np.median(cpu[name])),
                     "passes": r["passes"], "tokens_per_pass": r["tokens_per_pass"], "proposed": r["proposed"],
                     "accepted": r["accepted"], "acceptance_rate": r["acceptance_rate"],
                     "speed_up_cpu": up.median, "speed_up_cpu_lo": up.lo, "speed_up_cpu_hi": up.hi,
                     "speed_up_cpu_exact": up.exact, "speed_up_cpu_pairs": up.n,
                     "fewest_pairs": cmp.fewest if cmp else 0,
                     "verdict": "reference" if name == ref else verdict,
                     "noise_floor": floor.floor if floor else float("nan"),
                     "speed_up_wall": noise.paired_interval(wall[name], wall[ref]).median,
                     "identical": r["tokens"] == res[ref]["tokens"], "tokens": r["tokens"]})
    out = pd.DataFrame(rows)
    out.attrs["noise_floor_text"] = floor.text() if floor else "repeats = 1: no A/A floor"
    return out


def versus_plain(model, ids: Sequence[int], max_new: int, propose: Drafter, *, repeats: int = 2) -> dict:
    """One drafter against plain greedy decoding, as `compare_drafters` measures it (CPU time,
    interleaved, plain decoding's A/A rerun as the floor): that drafter's row as a dict
    (speed_up_cpu, its bracket and verdict, passes, tokens_per_pass, acceptance_rate, cpu_s),
    plus `plain_cpu_s`, the reference's CPU time.

    Args:
        model: a transformers causal LM; ids: prompt token ids; max_new: tokens to generate.
        propose: the drafter, (tokens so far, hidden state) -> guessed ids.
        repeats: runs per arm (>= 2 for a verdict).
    """
    df = compare_drafters(model, ids, max_new, {"plain": lambda s, h: [], "drafter": propose}, repeats=repeats)
    row = df.set_index("drafter").drop(columns="tokens")
    return {**row.loc["drafter"].to_dict(), "plain_cpu_s": float(row.loc["plain", "cpu_s"])}


def pass_cost(model, ids: Sequence[int], widths: Sequence[int] = (1, 3, 11), *, repeats: int = 6,
              passes: int = 4):
    """CPU time of one target pass over k new positions on top of a cached prompt, for each
    k in `widths`: what verifying k - 1 guesses costs, against the plain pass (k = 1).

    Each trial times `passes` passes (the cache cropped back after each); widths run
    interleaved (rotating), with k = 1 twice per round for its A/A floor. One row per width:
    `cpu_ms_per_pass` (median), `cost_vs_1` (median paired ratio) with `_lo`/`_hi`, and
    `verdict` ("costs more than 1 position", "within noise" ...).

    Args:
        model: a transformers causal LM; ids: prompt token ids (at least 2).
        widths: positions per pass to time (1 is the reference; put it first).
        repeats: trials per width; passes: passes per trial (a 135M pass is ~10-30 ms).
    """
    import time

    import pandas as pd
    import torch
    from transformers import DynamicCache
    trunk, head, cache = model.base_model, model.get_output_embeddings(), DynamicCache()
    with torch.inference_mode():
        trunk(torch.tensor([ids[:-1]]), cache=cache)
        n = cache.get_seq_length()

        def timed(k):
            x = torch.tensor([(list(ids) * k)[:k]])
            def go():
                c0 = time.process_time()
                for _ in range(passes):
                    head(trunk(x, cache=cache).last_hidden_state[0])   # logits at every position, as verify does
                    cache.crop(n - cache.get_seq_length())                # negative: drop the k just added
                return (time.process_time() - c0) / passes
            return go
        arms = {f"{k}": timed(k) for k in widths} | {"1 (A/A)": timed(1)}
        cpu = noise.run_interleaved(arms, repeats, warmup=1)
    floor = noise.noise_floor(cpu["1"], cpu["1 (A/A)"])
    rows = []
    for k in widths:
        iv, c = noise.paired_interval(cpu["1"], cpu[f"{k}"]), noise.compare(cpu["1"], cpu[f"{k}"], floor)
        verdict = {"A faster": "costs more than 1 position", "B faster": "cheaper than 1 position",
                   noise.TOO_FEW: c.said}.get(c.verdict, "within noise of 1 position")
        rows.append({"positions": k, "cpu_ms_per_pass": 1e3 * float(np.median(cpu[f"{k}"])), "cost_vs_1": iv.median,
                     "cost_vs_1_lo": iv.lo, "cost_vs_1_hi": iv.hi, "verdict": "reference" if k == 1 else verdict})
    out = pd.DataFrame(rows).set_index("positions")
    out.attrs["noise_floor_text"] = floor.text()
    return out


def plot_drafters(df, ceiling: float | None = None, axes=None):
    """Two panels from `compare_drafters` rows (with a "prompt" column): tokens per target
    pass (left, with the all-accepted `ceiling` dashed) and speed-up over plain decoding
    (right, from CPU time; 1 = no gain, dashed; error bars: the paired interval when the
    rows have one)."""
    import matplotlib.pyplot as plt
    axes = axes if axes is not None else plt.subplots(1, 2, figsize=(12, 4))[1]
    tab = {c: df.pivot_table(index="drafter", columns="prompt", values=c, sort=False)
           for c in ("tokens_per_pass", "speed_up_cpu")}
    tab["tokens_per_pass"].plot.bar(ax=axes[0], rot=20)
    axes[0].set(ylabel="tokens per target pass", xlabel="", title="Tokens per target pass")
    if ceiling:
        axes[0].axhline(ceiling, ls="--", c="grey", label=f"every guess accepted ({ceiling:g})")
    err = None
    if {"speed_up_cpu_lo", "speed_up_cpu_hi"} <= set(df.columns):   # each bar's paired interval, as error bars
        lo, hi = (df.pivot_table(index="drafter", columns="prompt", values=c, sort=False)
                  for c in ("speed_up_cpu_lo", "speed_up_cpu_hi"))
        up = tab["speed_up_cpu"]
        err = np.stack([[(up - lo)[c].to_numpy(), (hi - up)[c].to_numpy()] for c in up.columns]).clip(min=0)
    tab["speed_up_cpu"].plot.bar(ax=axes[1], rot=20, yerr=err, capsize=3)
    axes[1].axhline(1, ls="--", c="grey", label="no gain (1×)")
    axes[1].set(ylabel="speed-up vs plain decoding (×, CPU time)", xlabel="", title="Speed-up")
    for ax in axes:
        ax.legend(fontsize=8)
    return axes

"""Does it still work after hours? Reading a soak (notebook 15).

The soak itself lives in `infercourse.ops.soak` (the same run as `infercourse soak`);
this module turns its three records into what a learner looks at, every sentence
computed from the run's own numbers:

- `plot_soak`: the server over time (RSS with its fitted drift line, KV use and queue,
  per-request latency with errors marked, restarts as vertical lines);
- `hit_rate_by_context` / `hit_rate_story`: how much of each prompt the prefix cache
  served, as the agent's contexts grow, as a table and in words;
- `drift_verdict`: the slope and its interval in words, by one rule: an interval that
  excludes zero says memory grew (or shrank) during the soak; growth alone cannot tell a
  leak from a cache filling, and a slope is projected to 24 h only from a soak of at
  least `PROJECT_MIN_S` (an hour: at most a 24-fold extrapolation, past warm-up);
- `drift_guess_text`: a guess at the drift, scored against this run's interval;
- `prompt_cache_step`: llama-server's host prompt cache (`--cache-ram`, 8 GiB by default)
  keeps an idle slot's prompt in RAM: a step of prompt tokens x KV bytes per token that a
  soak must not call a leak (soaks here run with `--cache-ram 0`);
- `drift_halves`: the drift interval over the first half of the samples vs all of them;
- `load_soak`: a soak folder (yours, from `infercourse soak`) read back as a result;
- `recipe`: the command line for the long version.

Crashes, the crash drill, errors and latency percentiles are `lessons.crash_drill`.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from infercourse.ops.sampling import drift

__all__ = ["plot_soak", "hit_rate_by_context", "hit_rate_story", "drift_verdict", "drift_class", "PROJECT_MIN_S",
           "drift_guess_text", "drift_mib", "recipe", "request_times", "prompt_cache_step", "drift_halves", "load_soak"]

# A slope is projected to 24 h only from a soak this long: at most a 24-fold extrapolation, and
# long past the warm-up (arenas, caches filling) that dominates the first minutes.
PROJECT_MIN_S = 3600.0


def request_times(result) -> pd.DataFrame:
    """Per-request rows with `t_s`: seconds from the soak's start to the scheduled send,
    the same clock as the samples' `t_s`."""
    df = result.df.copy()
    df["t_s"] = df["scheduled_t"] - result.t0 if len(df) else []
    return df.sort_values("t_s") if len(df) else df


def hit_rate_by_context(df: pd.DataFrame, bins: int = 4) -> pd.DataFrame:
    """Cached share of prompt tokens per prompt-length bin (ok requests only)."""
    ok = df[(df["status"] == "ok") & df["prompt_tokens"].notna()].copy()
    if not len(ok):
        return pd.DataFrame(columns=["requests", "shortest", "longest", "prompt_tokens", "cached_tokens", "hit_rate"])
    ok["context"] = pd.cut(ok["prompt_tokens"], bins=min(bins, ok["prompt_tokens"].nunique()))
    g = ok.groupby("context", observed=True)
    out = g.agg(requests=("prompt_tokens", "size"), shortest=("prompt_tokens", "min"),
                longest=("prompt_tokens", "max"), prompt_tokens=("prompt_tokens", "sum"),
                cached_tokens=("cached_tokens", lambda s: s.fillna(0).sum()))
    out["hit_rate"] = out["cached_tokens"] / out["prompt_tokens"]
    return out


def _tokens(row) -> str:
    lo, hi = int(row["shortest"]), int(row["longest"])
    return f"{lo} tokens" if lo == hi else f"{lo}-{hi} tokens"


def hit_rate_story(df: pd.DataFrame, bins: int = 4) -> str:
    """How much of the prompts the prefix cache served, overall and by prompt length, in words
    computed from this run (a gap under 10 points between the shortest and longest prompts is
    called "about as much"; a bin of few requests is said to be one)."""
    t = hit_rate_by_context(df, bins)
    if not len(t):
        return "No request was answered, so there is no prefix-cache hit rate to read."
    total = t["cached_tokens"].sum() / t["prompt_tokens"].sum()
    amount = "most" if total > 0.5 else "under half" if total >= 0.1 else "almost none"
    out = (f"The prefix cache served {total:.0%} of the prompt tokens of the {int(t['requests'].sum())} "
           f"answered request(s) ({amount} of them).")
    if len(t) < 2:
        return out + " All prompts fell in one length bin, so nothing can be said about length."
    short, long_ = t.iloc[0], t.iloc[-1]
    gap = long_["hit_rate"] - short["hit_rate"]
    cmp = ("more from the cache than the short ones" if gap > 0.1 else "less from the cache than the short ones"
           if gap < -0.1 else "about as much from the cache as the short ones (within 10 points)")
    out += (f" The longest prompts ({_tokens(long_)}) were served {long_['hit_rate']:.0%} from cache, "
            f"the shortest ({_tokens(short)}) {short['hit_rate']:.0%}: the long contexts drew {cmp}.")
    few = int(min(short["requests"], long_["requests"]))
    if few < 5:
        out += (f" One of those bins holds only {few} request(s), so one request moves its rate: "
                "read the comparison as a hint, not a trend.")
    return out


def drift_class(summary: dict[str, Any]) -> str | None:
    """"growing" / "shrinking" when the drift interval excludes zero, "flat" when it includes
    it, None without an estimate: the one rule every sentence about drift follows."""
    lo, hi = (summary.get(k, np.nan) for k in ("rss_drift_lo", "rss_drift_hi"))
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return None
    return "growing" if lo > 0 else "shrinking" if hi < 0 else "flat"


def _longest_life(samples: pd.DataFrame) -> pd.DataFrame:
    """The samples of the server process that answered longest (the one the drift is fitted on)."""
    up = samples[samples["up"].fillna(False).astype(bool)] if "up" in samples else samples
    return max(up.dropna(subset=["rss_mib"]).groupby("pid"), key=lambda x: len(x[1]))[1]


def drift_mib(samples: pd.DataFrame, slope_mib_per_h: float) -> str:
    """The drift as the MiB it amounts to: the slope over the time the longest-lived server
    was sampled, beside the lowest and highest RSS it showed (a rate from seconds reads as
    a lot per hour while the memory moved by one MiB)."""
    g = _longest_life(samples)
    span = float(g["t_s"].max() - g["t_s"].min())
    return (f"over the {span:.0f} s the longest-lived server was sampled, that slope amounts to "
            f"{slope_mib_per_h * span / 3600:+.1f} MiB (its RSS ranged {g['rss_mib'].min():.0f}-"
            f"{g['rss_mib'].max():.0f} MiB)")


def drift_verdict(summary: dict[str, Any], duration_s: float, samples: pd.DataFrame | None = None) -> str:
    """The RSS drift in words, by `drift_class`'s rule; projected to 24 h only from a soak of
    at least `PROJECT_MIN_S` (a projection from seconds would be mostly warm-up, times
    thousands); with `samples`, also the MiB the slope amounts to over the life it was fitted
    on (`drift_mib`).

    Args:
        summary: a `soak_summary` (rss_drift_mib_per_h and its interval).
        duration_s: how long the soak ran.
        samples: the soak's samples (`SoakResult.samples`).
    """
    s, lo, hi = (summary.get(k, np.nan) for k in ("rss_drift_mib_per_h", "rss_drift_lo", "rss_drift_hi"))
    kind = drift_class(summary)
    if kind is None or not np.isfinite(s):
        return "Too few memory samples for a drift estimate."
    mib = f"; {drift_mib(samples, s)}" if samples is not None and len(samples) else ""
    head = f"RSS drift {s:+.1f} MiB/h (95 % interval {lo:+.1f} to {hi:+.1f}) over {duration_s / 60:.1f} min{mib}: "
    long_enough = duration_s >= PROJECT_MIN_S
    if kind == "flat":
        out = (head + "**no drift detectable**: the interval includes zero. Growth slower than "
               f"{hi:+.1f} MiB/h could still be there, unseen by a run this long.")
        return out + (f" Over 24 h that bound is {hi * 24:+.0f} MiB." if long_enough and hi > 0 else "")
    out = head + (f"**{kind}**: the interval excludes zero, so memory {'grew' if kind == 'growing' else 'fell'} "
                  "during this soak. ")
    if kind == "shrinking":
        return out + "Buffers released after warm-up are the usual reason; it supports no leak claim."
    out += ("Growth alone cannot tell a leak (it never stops) from a cache or allocator arena filling "
            "(it stops when full). ")
    if not long_enough:
        return out + (f"This soak is too short to project: the rule here projects to 24 h only from a soak "
                      f"of at least {PROJECT_MIN_S / 3600:.0f} h; run it longer and see whether the growth "
                      "continues or flattens.")
    return out + (f"At this pace 24 h would add {lo * 24:+.0f} to {hi * 24:+.0f} MiB; whether the pace "
                  "holds is what the plot (a plateau or not) and a longer soak say.")


def prompt_cache_step(server, prompts, *, settle_s: float = 0.5) -> dict[str, float]:
    """RSS of a one-slot llama-server before and after its slot's prompt is replaced by a
    different one: with `--cache-ram` on, the old prompt's KV is copied to host RAM.

    Args:
        server: a started `LlamaServer` with ONE slot (its `--cache-ram` is the condition).
        prompts: two or more different prompts (text); each is sent once, in turn.
        settle_s: pause before each RSS reading (the copy happens as the next prompt starts).
    """
    import time

    from infercourse.core.types import Request, generate
    from infercourse.ops.sampling import process_rss_mib
    engine, rss, tokens = server.engine(timeout=120), [], []
    for text in prompts:
        c = generate(engine, Request(prompt=text, max_tokens=1, cache_prompt=True))
        tokens.append(c.usage.prompt_tokens if c.usage else np.nan)
        time.sleep(settle_s)
        rss.append(process_rss_mib(server.pid))
    engine.close()
    return {"rss_first_mib": rss[0], "rss_last_mib": rss[-1], "step_mib": rss[-1] - rss[0],
            "saved_prompt_tokens": float(np.nansum(tokens[:-1]))}


def drift_guess_text(guess: float | None, summary: dict[str, Any]) -> str:
    """A guess at the drift (MiB/h), scored against this run's slope and its interval: inside
    the interval the run cannot tell the guess from its own estimate.

    Args:
        guess: the learner's number (None: not answered; nothing else is said).
        summary: a `soak_summary`.
    """
    if guess is None:
        return "Not answered yet: set `MY_GUESS_DRIFT` in the Predict cell, re-run the soak, then this cell."
    s, lo, hi = (summary.get(k, np.nan) for k in ("rss_drift_mib_per_h", "rss_drift_lo", "rss_drift_hi"))
    if not all(np.isfinite(v) for v in (s, lo, hi)):
        return f"Your guess {guess:+g} MiB/h: too few memory samples in this run to score it."
    where = ("inside this run's interval: the run cannot tell it from its own estimate" if lo <= guess <= hi else
             f"{'above' if guess > hi else 'below'} this run's interval")
    return f"Your guess {guess:+g} MiB/h; measured {s:+.1f} MiB/h (95 % interval {lo:+.1f} to {hi:+.1f}): {where}."


def drift_halves(result) -> dict[str, float]:
    """The RSS drift interval's width (MiB/h) over the first half of the longest-lived
    server's samples and over all of them: what a soak twice as long buys."""
    g = _longest_life(result.samples)
    half = g[g["t_s"] <= g["t_s"].min() + (g["t_s"].max() - g["t_s"].min()) / 2]
    w = lambda d: d["hi_per_h"] - d["lo_per_h"]    # noqa: E731
    full, first = drift(g["t_s"], g["rss_mib"]), drift(half["t_s"], half["rss_mib"])
    return {"width_first_half": w(first), "width_all": w(full), "ratio": w(first) / w(full)}


def plot_soak(result, *, axes=None):
    """Four panels over soak time: RSS with the drift fit, KV use and queue, latency per
    request (errors in red), and restarts (vertical lines) on every panel."""
    import matplotlib.pyplot as plt
    if axes is None:
        _, axes = plt.subplots(2, 2, figsize=(13, 7), sharex=True)
    ax = np.asarray(axes).ravel()
    smp, df = result.samples, request_times(result)
    restarts = [e["t_s"] for e in result.events if e["event"] == "restart"]
    if len(smp):
        up = smp[smp["up"].fillna(False).astype(bool)] if "up" in smp else smp
        for pid, g in up.dropna(subset=["rss_mib"]).groupby("pid"):
            ax[0].plot(g["t_s"], g["rss_mib"], marker=".", ms=3, label=f"server pid {int(pid)}")
            d = drift(g["t_s"], g["rss_mib"])
            if np.isfinite(d["slope_per_s"]):
                t = g["t_s"].to_numpy()
                mid = np.median(t)
                ax[0].plot(t, g["rss_mib"].median() + d["slope_per_s"] * (t - mid), "k--", lw=1)
        ax[0].set(ylabel="server RSS (MiB)", title="Resident memory (dashed: fitted drift)")
        ax[0].legend(fontsize=7)
        if "kv_used_frac" in smp:
            ax[1].plot(smp["t_s"], 100 * smp["kv_used_frac"], label="KV cells held (%)")
        for col, name in (("llamacpp:requests_processing", "processing"), ("llamacpp:requests_deferred", "deferred")):
            if col in smp:
                ax[1].step(smp["t_s"], smp[col], where="post", label=f"requests {name}")
        ax[1].axhline(100, color="grey", ls=":", lw=1, label="KV full (100 %)")
        ax[1].set(ylabel="% / requests", title="KV cache use and queue")
        ax[1].legend(fontsize=7)
    if len(df):
        ok, bad = df[df["status"] == "ok"], df[df["status"] != "ok"]
        ax[2].scatter(ok["t_s"], ok["ttft_s"], s=8, label="TTFT (ok)")
        ax[2].scatter(ok["t_s"], ok["e2e_s"], s=8, label="E2E (ok)")
        ax[2].scatter(bad["t_s"], np.zeros(len(bad)), marker="x", color="red", label=f"errors or cut off ({len(bad)})")
        ax[2].set(ylabel="seconds", xlabel="soak time (s)", title="Latency per request")
        ax[2].legend(fontsize=7)
        hit = ok["cached_tokens"].fillna(0) / ok["prompt_tokens"]
        sc = ax[3].scatter(ok["t_s"], 100 * hit, c=ok["prompt_tokens"], s=10, cmap="viridis")
        plt.colorbar(sc, ax=ax[3], label="prompt tokens")
        ax[3].set(ylabel="prompt served from cache (%)", xlabel="soak time (s)", ylim=(-5, 105),
                  title="Prefix-cache hit per request")
    for a in ax:
        for t in restarts:
            a.axvline(t, color="red", lw=1, alpha=0.6)
    if restarts:
        ax[0].text(restarts[0], ax[0].get_ylim()[1], " restart", color="red", va="top", fontsize=8)
    ax[0].figure.tight_layout()
    return ax


def load_soak(folder):
    """A soak folder (`infercourse soak --out FOLDER`, or this notebook's) read back as a
    `SoakResult`, its summary recomputed from the files.

    Args:
        folder: the soak's results folder (requests.jsonl, samples.jsonl, events.jsonl, manifest.json).
    """
    import json
    from pathlib import Path

    from infercourse.measure.results import load_run
    from infercourse.ops.sampling import load_samples, soak_summary
    from infercourse.ops.soak import SoakResult
    from infercourse.ops.supervisor import EVENTS
    d = Path(folder).expanduser()
    man = json.loads((d / "manifest.json").read_text(encoding="utf-8"))
    df, samples = load_run(d).df, load_samples(d)
    ev = d / EVENTS
    events = [json.loads(x) for x in ev.read_text(encoding="utf-8").splitlines() if x.strip()] if ev.exists() else []
    soak = man.get("soak", {})
    return SoakResult(d, df, samples, events, soak_summary(df, samples, events, soak["duration_s"]),
                      soak.get("t0_perf_counter", 0.0))


def recipe(duration: str = "24h", *, concurrency: int = 4, workload: str = "mix") -> str:
    """The command line of a long soak (run it under `nohup` or tmux; every line is on disk
    as it happens, so a look at the folder mid-run is safe)."""
    return (f"nohup infercourse soak --duration {duration} --workload {workload} --concurrency {concurrency} "
            f"--parallel {concurrency} --max-calls 0 --out soak-{duration} --no-progress > soak-{duration}.log 2>&1 &\n"
            f"infercourse report soak-{duration}")

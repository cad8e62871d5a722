"""Does it still work after hours? Reading a soak (notebook 15).

The soak itself lives in `infercourse.ops.soak` (the same run as `infercourse soak`);
this module turns its three records into what a learner looks at:

- `plot_soak`: the server over time (RSS with its fitted drift line, KV use and queue,
  per-request latency with errors marked, restarts as vertical lines);
- `hit_rate_by_context`: how much of each prompt the prefix cache served, as the agent's
  contexts grow;
- `drift_verdict`: the slope and its interval in words. A leak claim needs the interval
  to exclude zero; a short soak usually cannot tell a small leak from noise, which is
  why real soaks run for 24-72 hours;
- `drill_story`: what the crash drill did in this run, in words computed from its events
  (fired or not, inside the window or not, what it cost, whether the load resumed);
- `prompt_cache_step`: llama-server's host prompt cache (`--cache-ram`, 8 GiB by default)
  keeps an idle slot's prompt in RAM: a step of prompt tokens x KV bytes per token that a
  soak must not call a leak (soaks here run with `--cache-ram 0`);
- `drift_halves`: the drift interval over the first half of the samples vs all of them;
- `recipe`: the command line for the long version.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from infercourse.ops.sampling import drift

__all__ = ["plot_soak", "hit_rate_by_context", "drift_verdict", "recipe", "request_times", "drill_story",
           "prompt_cache_step", "drift_halves"]


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
        return pd.DataFrame(columns=["requests", "prompt_tokens", "cached_tokens", "hit_rate"])
    ok["context"] = pd.cut(ok["prompt_tokens"], bins=min(bins, ok["prompt_tokens"].nunique()))
    g = ok.groupby("context", observed=True)
    out = g.agg(requests=("prompt_tokens", "size"), prompt_tokens=("prompt_tokens", "sum"),
                cached_tokens=("cached_tokens", lambda s: s.fillna(0).sum()))
    out["hit_rate"] = out["cached_tokens"] / out["prompt_tokens"]
    return out


def drift_verdict(summary: dict[str, Any], duration_s: float) -> str:
    """The RSS drift in one sentence, honest about what a run this short can say."""
    s, lo, hi = (summary.get(k, np.nan) for k in ("rss_drift_mib_per_h", "rss_drift_lo", "rss_drift_hi"))
    if not np.isfinite(s):
        return "too few memory samples for a drift estimate"
    verdict = ("memory grows: the interval excludes zero" if lo > 0 else
               "memory shrinks: the interval excludes zero" if hi < 0 else
               "no drift detectable: the interval includes zero")
    short = (" A soak this short mostly sees warm-up (buffers and caches filling on the first requests),"
             " so growth here is not yet a leak: run it longer." if duration_s < 600 and lo > 0 else "")
    return (f"RSS drift {s:+.1f} MiB/h (95% interval {lo:+.1f} to {hi:+.1f}) over {duration_s / 60:.1f} min: "
            f"{verdict}. Over 24 h that interval spans {lo * 24:+.0f} to {hi * 24:+.0f} MiB.{short}")


def drill_story(result, kill_after: int | None) -> str:
    """The crash drill in one sentence, from this run's events and requests (never assumed).

    Args:
        result: a `SoakResult`.
        kill_after: the drill's `kill_after_ok` (None: no drill was asked for).
    """
    s, df = result.summary, result.df
    ok = int((df["status"] == "ok").sum()) if len(df) else 0
    if kill_after is None:
        return "No crash drill in this run (`KILL_AFTER = None`)."
    if not np.isfinite(s.get("drill_at_s", np.nan)):
        return (f"The crash drill **did not fire**: {ok} request(s) were answered in the {s['duration_s']:.0f}-s "
                f"window, fewer than `KILL_AFTER = {kill_after}`. This run says nothing about recovery: "
                "lower `KILL_AFTER` or lengthen `SOAK_S`.")
    t = s["drill_at_s"]
    restart = next((e for e in result.events if e["event"] == "restart"), None)
    lost = int((df["status"] == "error").sum()) if len(df) else 0
    if restart is None:
        return (f"The crash drill fired at {t:.1f} s, too late for a restart inside the "
                f"{s['duration_s']:.0f}-s window: restarts 0, so recovery was **not observed** here.")
    after = int(((df["status"] == "ok") & (df["scheduled_t"] - result.t0 > restart["t_s"])).sum()) if len(df) else 0
    resumed = (f"the load resumed: {after} request(s) answered after the restart" if after else
               "no request was answered after the restart before the window closed")
    return (f"The crash drill fired at {t:.1f} s (after {kill_after} answered request(s)); it cost {lost} "
            f"request(s) (errors), the supervisor restarted the server in {restart.get('took_s', np.nan):.1f} s "
            f"({s['restarts']} restart(s)), and {resumed}.")


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


def drift_halves(result) -> dict[str, float]:
    """The RSS drift interval's width (MiB/h) over the first half of the longest-lived
    server's samples and over all of them: what a soak twice as long buys."""
    smp = result.samples
    up = smp[smp["up"].fillna(False).astype(bool)] if "up" in smp else smp
    life = up.dropna(subset=["rss_mib"]).groupby("pid")
    g = max(life, key=lambda x: len(x[1]))[1]
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


def recipe(duration: str = "24h", *, concurrency: int = 4, workload: str = "mix") -> str:
    """The command line of a long soak (run it under `nohup` or tmux; every line is on disk
    as it happens, so a look at the folder mid-run is safe)."""
    return (f"nohup infercourse soak --duration {duration} --workload {workload} --concurrency {concurrency} "
            f"--parallel {concurrency} --max-calls 0 --out soak-{duration} --no-progress > soak-{duration}.log 2>&1 &\n"
            f"infercourse report soak-{duration}")

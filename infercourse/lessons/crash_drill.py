"""Crashes, errors and latency in a soak, read from its records (notebook 15).

A soak (`ops.soak`) counts a crash when its supervisor restarts the server. Some crashes
are planned: the crash drill SIGKILLs the server once N requests were answered, to show what
a crash costs and that the supervisor recovers. Every number here keeps the two apart:

- `headline`: the guide's three (unplanned crashes per hour, the error rate outside the
  drill, uptime); with no unplanned crash, the rate a soak this long cannot rule out (the
  rule of three, 3 / hours soaked, at 95 %);
- `crash_split`, `drill_cost`: planned and unplanned crashes, and the errors the drill
  caused (those of the server life it ended, after that life's last answer);
- `drill_story`: the drill in words, from its events (fired or not, inside the window or
  not, what it cost, whether the load resumed); `lost_guess_text` scores a guess at its cost;
- `summary_table`: the soak's summary for display, its crash rate split into planned and
  unplanned, and no tail percentile its sample cannot support;
- `latency_text`: TTFT and E2E medians with their intervals, and a p95 only from enough
  requests (`core.summary.min_n`: 72 for a p95), else "n too small for a p95".
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from infercourse.core import summary as core_summary
from infercourse.ops.sampling import unplanned_crashes

__all__ = ["headline", "crash_split", "drill_cost", "drill_story", "lost_guess_text", "summary_table",
           "latency_text"]


def _drill_pids(events: list[dict]) -> set:
    return {e.get("pid") for e in events if e["event"] == "drill_kill"}


def drill_cost(result) -> int:
    """Errors the crash drill caused: those of the server life it ended (a `round`) that
    failed after that life's last answer (a request that failed earlier had another cause)."""
    df, events = result.df, result.events
    if not len(df):
        return 0
    crashes = [e for e in events if e["event"] == "crash"]
    drills = _drill_pids(events)
    if "round" not in df:       # a folder without rounds: every error is put on the drill
        return int((df["status"] == "error").sum()) if drills else 0
    n = 0
    for i, c in enumerate(crashes):          # the soak's round i ended with crash i
        if c.get("pid") in drills:
            life = df[df["round"] == i]
            last_ok = life.loc[life["status"] == "ok", "end_t"].max()
            bad = life[life["status"] == "error"]
            n += int((bad["end_t"] >= last_ok).sum()) if np.isfinite(last_ok) else len(bad)
    return n


def crash_split(result) -> dict[str, Any]:
    """Planned (drill) and unplanned crashes, and the errors of each kind."""
    events, df = result.events, result.df
    errors = int((df["status"] == "error").sum()) if len(df) else 0
    cost = drill_cost(result)
    return {"planned": sum(e["event"] == "drill_kill" for e in events),
            "unplanned": unplanned_crashes(events),
            "drill_errors": cost, "other_errors": errors - cost}


def headline(result) -> str:
    """The guide's three stability numbers, the planned drill counted apart: unplanned crashes
    per hour (none seen: the rule of three's 95 % bound, 3 / hours soaked, says what a soak
    this long cannot rule out), the error rate outside the drill, and uptime."""
    s, c = result.summary, crash_split(result)
    hours = s.get("duration_s", np.nan) / 3600
    if c["unplanned"]:
        crash = f"{c['unplanned']} unplanned crash(es) in {hours:.3g} h ({c['unplanned'] / hours:.3g} /h)"
    else:
        crash = (f"0 unplanned crashes in {hours:.3g} h (a rate up to {3 / hours:.3g} /h is not ruled out: "
                 "3 / hours soaked, at 95 %)")
    if c["planned"]:
        crash += f"; the drill's {c['planned']} planned kill(s) not counted"
    n = s.get("requests", 0) - s.get("incomplete_at_end", 0) - c["drill_errors"]
    err = (f"error rate {100 * c['other_errors'] / n:.1f} % of {n} requests outside the drill" if n > 0
           else "error rate: no request outside the drill")
    err += f" ({c['drill_errors']} cut by the drill, {s.get('incomplete_at_end', 0)} cut off at the end: not counted)"
    drill_t = min((e["t_s"] for e in result.events if e["event"] == "drill_kill"), default=np.inf)
    restarted = any(e["event"] == "restart" and e["t_s"] >= drill_t for e in result.events)
    up = f"uptime {s.get('uptime_pct', np.nan):.1f} % of samples" + (" (the drill's restart included)"
                                                                     if restarted else "")
    return " · ".join([crash, err, up])


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
    restart = next((e for e in result.events if e["event"] == "restart" and e["t_s"] >= t), None)
    lost = drill_cost(result)
    if restart is None:
        return (f"The crash drill fired at {t:.1f} s, too late for a restart inside the "
                f"{s['duration_s']:.0f}-s window: restarts 0, so recovery was **not observed** here.")
    after = int(((df["status"] == "ok") & (df["scheduled_t"] - result.t0 > restart["t_s"])).sum()) if len(df) else 0
    resumed = (f"the load resumed: {after} request(s) answered after the restart" if after else
               "no request was answered after the restart before the window closed")
    return (f"The crash drill fired at {t:.1f} s (after {kill_after} answered request(s)); it cost {lost} "
            f"request(s) (errors), the supervisor restarted the server in {restart.get('took_s', np.nan):.1f} s "
            f"({s['restarts']} restart(s)), and {resumed}.")


def lost_guess_text(guess: float | None, result, concurrency: int) -> str:
    """A guess at the requests the drill cost, against the closed-loop arithmetic (one
    request in flight per user) and this run's count (`drill_cost`), when the drill fired.

    Args:
        guess: the learner's number (None: not answered; nothing else is said).
        result: a `SoakResult`; concurrency: the closed-loop users.
    """
    if guess is None:
        return "Not answered yet: set `MY_GUESS_LOST` in the Predict cell, re-run the soak, then this cell."
    if not np.isfinite(result.summary.get("drill_at_s", np.nan)):
        return f"Your guess {guess:g}: the drill did not fire in this run, so there is no cost to score it against."
    lost = drill_cost(result)
    off = "exactly right" if guess == lost else f"{'above' if guess > lost else 'below'} it by {abs(guess - lost):g}"
    why = ("as the closed loop predicts" if lost == concurrency else
           "more than the users in flight: some were sent before the client saw the server gone" if lost > concurrency
           else "fewer than the users: some were between requests (or the drill's own answer) when it struck")
    return (f"Your guess {guess:g}; one request in flight per user predicts {concurrency}; the drill cost {lost} "
            f"({why}). Your guess is {off}.")


def summary_table(result) -> pd.Series:
    """The soak's summary as the notebook shows it: `crash_rate_per_h` counts every crash,
    the drill's planned kill too, so it is replaced by the unplanned and planned counts and
    the unplanned rate; `ttft_s_p95` and `e2e_s_p95` read "n too small (...)" below the ok
    requests a p95 needs (`core.summary.min_n`)."""
    s, c = dict(result.summary), crash_split(result)
    hours = s.get("duration_s", np.nan) / 3600
    s.pop("crash_rate_per_h", None)
    s.update(crashes_unplanned=c["unplanned"], drill_kills=c["planned"],
             crash_rate_unplanned_per_h=c["unplanned"] / hours if hours else np.nan)
    df = result.df
    n_ok = int((df["status"] == "ok").sum()) if len(df) else 0
    need = core_summary.min_n(0.95)
    for k in ("ttft_s_p95", "e2e_s_p95"):
        if k in s and n_ok < need:
            s[k] = f"n too small ({n_ok} ok requests; a p95 needs {need})"
    return pd.Series({k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()}, dtype=object)


def latency_text(df: pd.DataFrame) -> str:
    """TTFT and E2E of the answered requests: the median with its 95 % interval (or its range,
    under 6), and the p95 with its interval, or "n too small for a p95" under the 72 it needs."""
    ok = df[df["status"] == "ok"] if len(df) else df
    if not len(ok):
        return "no request was answered: no latency to read"
    s = core_summary.summarize(ok, ["ttft_s", "e2e_s"])
    parts = []
    for m, name in (("ttft_s", "TTFT"), ("e2e_s", "E2E")):
        r = s.loc[m]
        med = (f"p50 {r['p50']:.2f} s [{r['p50_lo']:.2f}, {r['p50_hi']:.2f}]" if np.isfinite(r["p50_lo"]) else
               f"p50 {r['p50']:.2f} s (range {r['min']:.2f}-{r['max']:.2f}: too few for an interval)")
        tail = (f"p95 {r['p95']:.2f} s [{r['p95_lo']:.2f}, {r['p95_hi']:.2f}]" if np.isfinite(r["p95_lo"]) else
                f"n too small for a p95 (an interval needs {core_summary.min_n(0.95)} requests, have {int(r['count'])})")
        parts.append(f"{name} {med}, {tail}")
    return "; ".join(parts)

"""How many agents fit one server, and how to grow past one (notebook 16).

The measurements come from `measure.sessions` (N live agent sessions against K slots) and
`servers.router` (replicas behind sglang-router); this module turns them into the
notebook's answers:

- `knee`, `knee_sentence`: the largest session count before sessions start evicting each
  other's cached prefixes (the later turns' cache hit rate falls below a threshold), and
  where that fell against the slot count;
- `batch_gain`: notebook 11's throughput curve read at one point: requests/s with K users
  on K slots over requests/s with one, on requests shaped like a cached turn;
- `capacity_sentence`: the predicted capacity against the measured one (the largest session
  count whose later turns met the TTFT SLO), and what the gap means;
- `knee_exercise`, `knee_guess_text`: what a guess at the knee is scored against (the
  arithmetic, and the run);
- `team_table`, `pool_text`, `team_text`: replicas per model's pool for a team, which pool
  binds, and the team's answer on one model and split over two, reconciled in one sentence;
- `plot_knee`: the picture, of what the knee and the capacity are judged on.

The capacity model itself (`predict_capacity`, `pool_capacity`, `pools_from_prediction`,
`measured_capacity`, `replicas_for`) is `measure.capacity_model`, re-exported here: one
formula for one replica, for a pool, and for a team.

Past one replica, how requests are spread over several (policies, the kill drill) is
`lessons.routing`.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd

# the model itself lives in the measure layer; re-exported so the notebook reads one module
from infercourse.measure.capacity_model import (MIN_GOOD, bracket, measured_capacity, next_count,  # noqa: F401
                                                pool_capacity, pools_from_prediction, predict_capacity,
                                                replicas_for, service_ratios)

__all__ = ["knee", "knee_sentence", "knee_guess_text", "batch_gain", "predict_capacity", "measured_capacity",
           "capacity_sentence", "knee_exercise", "replicas_for", "pool_capacity", "pools_from_prediction",
           "service_ratios", "team_table", "pool_text", "team_text", "plot_knee", "MIN_GOOD"]


def knee(table: pd.DataFrame, min_hit: float = 0.5) -> dict[str, Any]:
    """The largest session count whose later turns still hit the cache (>= min_hit),
    and the first one that does not (None: no knee in the range measured).

    Args:
        table: `sessions.sweep_sessions`'s table (index n_sessions, column cache_hit_rate_later).
        min_hit: the hit rate under which sessions are evicting each other.
    """
    ok = table["cache_hit_rate_later"] >= min_hit
    below = [n for n, good in ok.items() if not good]
    first_bad = below[0] if below else None
    fits = [n for n, good in ok.items() if good and (first_bad is None or n < first_bad)]
    return {"sessions_at_knee": max(fits) if fits else 0, "first_evicting": first_bad}


def knee_sentence(label: str, k: Mapping[str, Any], slots: int, counts: Sequence[int]) -> str:
    """Where this run's knee fell against the slot count, from `knee` and the counts tried.

    The knee lies between the largest count that kept its cache and the first that did not
    (counts not tried in between are unknown); the slot mechanism expects it at K.
    """
    first = k["first_evicting"]
    if first is None:
        beyond = (f"; the sweep never went past the {slots} slots, so it could not show one" if max(counts) <= slots
                  else "")
        return (f"{label}: no count tried (up to {max(counts)}) fell below the hit threshold: the knee, if any, lies "
                f"beyond the counts tried{beyond}.")
    last = k["sessions_at_knee"]
    head = f"{label}: sessions kept their cache up to {last}, evicted each other at {first} ({slots} slots)"
    if first <= slots:
        return (f"{head}: evictions began **at or before** the slot count, while slots were free; the slot mechanism "
                "alone does not explain it (a prompt longer than a slot's context, or a slow turn overlapping the "
                "next session's: read `by_turn` on that run).")
    if last > slots:
        return (f"{head}: **past** the slot count, more sessions than slots kept their prefixes: something held "
                "them beyond the slots (the host-RAM prompt cache, or think times so long that sessions rarely "
                "overlapped).")
    if last == slots:
        return (f"{head}: the knee sits **at the slot count**, as the mechanism expects: evictions begin once sessions "
                "outnumber slots.")
    return (f"{head}: **consistent with** the slot count: the knee lies between {last} and {first}, and {slots} "
            "was not tried, so this sweep cannot place it more closely.")


def knee_guess_text(guess: float | None, k: Mapping[str, Any], predicted: float, *, name: str = "MY_GUESS_KNEE_OFF",
                    label: str = "") -> str:
    """A guess at the knee (the most sessions that keep their cache), scored against the
    mechanism's count (`predicted`: the KV limit, slots plus what the RAM cache holds) and
    the run's bracket (kept up to `sessions_at_knee`, evicting at `first_evicting`).

    Args:
        guess: the learner's number (None: not answered; nothing else is said).
        k: `knee`'s dict; predicted: the mechanism's count; name: the guess's variable.
    """
    if guess is None:
        return f"Not answered yet: set `{name}` in the Predict cell, re-run the sweep, then this cell."
    last, first = k["sessions_at_knee"], k["first_evicting"]
    where = (f"kept their cache up to {last} sessions and evicted at {first}" if first is not None else
             f"kept their cache at every count tried (up to {last}): the knee is at least {last}")
    if first is None:
        fits = "consistent with it" if guess >= last else f"below it (the run kept {last})"
    else:
        fits = ("consistent with it" if last <= guess < first else
                f"{'above' if guess >= first else 'below'} it")
    near = ("the KV limit" if abs(guess - predicted) < abs(guess - last) else "the run's knee")
    return (f"{label + ': ' if label else ''}your guess {guess:g}; the KV limit (slots, plus what the RAM cache "
            f"holds) says {predicted:g}; in the run, sessions {where}. Your guess is {fits}, and closer to {near}.")


def batch_gain(srv, slots: int, one: pd.DataFrame, *, rounds: int = 2, model: Any = None,
               out_dir: str | Path | None = None) -> dict[str, float]:
    """Notebook 11's throughput curve read at one point: completed requests/s with `slots`
    closed-loop users over requests/s with one, on one server with `slots` slots, every
    request shaped like a cached turn of the lone session (its median new prompt tokens
    and output tokens). One run per level: an input to the prediction, not a verdict.

    Args:
        srv: a running LlamaServer with `slots` slots.
        one: the per-turn frame of one session alone (new tokens = prompt - cached).
        rounds: requests per user at each level (slots x rounds requests each).
        model: the GGUF whose tokenizer sizes the prompts; out_dir: where the runs are saved.
    """
    from infercourse.core.types import Request
    from infercourse.measure import bench
    from infercourse.measure.workloads import exact_length_prompt
    from infercourse.models.embedded import vocab_tokenizer
    ok = one[one["status"] == "ok"]
    later = ok[ok["turn"] > 0] if (ok["turn"] > 0).any() else ok
    new = int(max(16, (later["prompt_tokens"] - later["cached_tokens"].fillna(0)).median()))
    out = int(max(1, later["output_tokens"].median()))
    n = slots * rounds
    tok = vocab_tokenizer(model)   # distinct prompts of exactly `new` tokens, forced to `out` tokens (as notebook 11's)
    wl = [Request(prompt=exact_length_prompt(new, tok, seed=i), max_tokens=out, ignore_eos=True, seed=0)
          for i in range(2 * n)]
    rps = {}
    for c in (1, slots):
        r = bench.run(srv.engine(api="completions"), wl, pattern="concurrency", concurrency=c, max_requests=n,
                      out_dir=Path(out_dir) / f"c{c}" if out_dir else None, label=f"gain-c{c}", progress=False)
        rps[c] = _rps(r.df)
    return {"gain": rps[slots] / rps[1] if rps[1] > 0 else math.nan, "requests_per_s_1": rps[1],
            f"requests_per_s_{slots}": rps[slots], "new_tokens": new, "output_tokens": out, "requests": n}


def _rps(df: pd.DataFrame) -> float:
    from infercourse.core.summary import throughput
    return float(throughput(df)["requests_per_s"])


def capacity_sentence(label: str, row: Mapping[str, Any], counts: Sequence[int]) -> str:
    """The predicted capacity against the measured one, and what the gap means.

    The sweep brackets the capacity: at least the measured count, and below the next count
    tried (none above: only "at least"). The prediction agrees when it falls in that
    bracket. Otherwise the implied utilisation says how busy the slots ran at the measured
    count, against the `utilisation` the prediction allowed.

    Args:
        label: the setting (e.g. "--cache-ram 0").
        row: `predict_capacity`'s dict with `measured` (`measured_capacity`) added.
        counts: the session counts tried.
    """
    pred, meas = float(row["predicted"]), int(row["measured"])
    nxt = next_count(meas, counts)
    kv_binds = row["kv_limit"] <= row["throughput_limit"]
    head = (f"{label}: predicted {pred:.2f} sessions (bound by the {'KV' if kv_binds else 'throughput'} limit), "
            f"measured {'at least ' if nxt is None else ''}{meas} (one sweep, one run per count: no rerun, so the "
            "measured count is not judged against noise)")
    kind = bracket(pred, meas, counts)
    if kind == "unchecked":
        return f"{head}: even {min(counts)} session(s) missed the SLO; the prediction cannot be checked below that."
    if kind == "agree":
        return (f"{head}: **agree**: the prediction falls between the largest count that met the SLO ({meas}) "
                f"and the first that did not ({nxt}).")
    if kind == "optimistic":
        return (f"{head}: the prediction was **optimistic**: {nxt} sessions already missed the SLO. Something the "
                "model leaves out costs time here: re-prefills after evictions, turns queued behind whole turns, "
                "or a machine busy with other work (the contention line).")
    if kind == "beyond":
        return f"{head}: the prediction lies beyond the counts tried, so this sweep cannot check it."
    ratio = meas / pred if pred > 0 else math.inf
    if kv_binds:
        why = ("sessions past the KV limit still met the SLO: an evicted prefix's re-prefill fit in the TTFT "
               "target, so the KV limit marks where cache hits end (the knee), not where the SLO breaks.")
    else:
        per = row["gain"] * row["think_s"] / row["service_s"] + row["slots"]
        u = meas / per if per > 0 else math.nan
        why = (f"at {meas} sessions the slots ran at an implied utilisation of {u:.2f}, against the "
               f"{row['utilisation']:.2f} the prediction allows: the SLO is on TTFT, and a turn's first token waits "
               "only for its own prefill while a slot is free, so this SLO tolerated busier slots than the headroom "
               "assumes." if u > row["utilisation"] else
               f"the implied utilisation at {meas} sessions is {u:.2f}, within the headroom: the gap comes from the "
               "sweep's counts, not from the model.")
    return f"{head}: the prediction was **conservative** ({ratio:.1f}× below the measurement); {why}"


def knee_exercise(guess: float | None, model: Any, slots: int, slot_ctx: int, threads: int | None, script,
                  slo_ttft_s: float, out_dir: str | Path, **run: Any) -> dict[str, Any] | None:
    """Exercise 7: `slots` slots, --cache-ram 0, `slots` and `slots` + 1 sessions. Returns the
    slot mechanism's first evicting count (`predicted`: slots + 1), the run's (`measured`,
    None: no count evicted) and `knee_sentence`; None (nothing run) while the guess is None."""
    from infercourse.measure import sessions as ss
    from infercourse.servers import LlamaServer
    if guess is None:
        print("Not answered yet: write your guess first, then re-run this cell (it starts a server and measures).")
        return None
    counts = [slots, slots + 1]
    with LlamaServer(model, n_parallel=slots, ctx_size=slots * slot_ctx, threads=threads, cache_ram_mib=0) as srv:
        table, _ = ss.sweep_sessions(srv.engine(), script, counts, slos={"ttft_s": slo_ttft_s}, out_dir=out_dir,
                                     label=f"np{slots}", **run)
    k = knee(table)
    text = knee_sentence(f"{slots} slots, --cache-ram 0", k, slots, counts)
    return {"predicted": slots + 1, "measured": k["first_evicting"],
            "text": text + ("" if k["first_evicting"] else " Nothing to score: no count tried evicted.")}


def team_table(pools: pd.DataFrame, team_sizes) -> pd.DataFrame:
    """Replicas of each pool (columns) for each team size (rows), from `pool_capacity`."""
    return pd.DataFrame({m: [replicas_for(n, r["per_replica"]) for n in team_sizes] for m, r in pools.iterrows()},
                        index=pd.Index(list(team_sizes), name="team size"))


def pool_text(pools: pd.DataFrame, team_size: int) -> str:
    """Which pool needs more replicas per session, and what a team of `team_size` needs."""
    order = pools.sort_values("per_replica")
    tight, loose = order.index[0], order.index[-1]
    why = {m: "its KV limit" if r["kv_limit"] <= r["throughput_limit"] else "its throughput"
           for m, r in pools.iterrows()}
    per = ", ".join(f"{m} {r['per_replica']:.3g} ({why[m]})" for m, r in pools.iterrows())
    need = ", ".join(f"{replicas_for(team_size, r['per_replica'])} of {m}" for m, r in pools.iterrows())
    head = (f"The **{tight}** pool binds: one replica serves fewer sessions than one of {loose}" if
            pools.loc[tight, "per_replica"] < pools.loc[loose, "per_replica"] else
            "Both pools serve as many sessions per replica")
    return f"{head}. Sessions per replica: {per}. A team of {team_size}: {need}."


def team_text(row: Mapping[str, Any], pools: pd.DataFrame, team_size: int, counts: Sequence[int], *,
              ref: str = "main", label: str = "--cache-ram 0") -> str:
    """The team's replicas in one sentence from one capacity model: every call on one model
    (`predict_capacity`'s row with `measured`), then the same model split into pools
    (`pools_from_prediction`), and how far the sweep says to trust the prediction.

    Args:
        row: `predict_capacity`'s dict with `measured` added; pools: `pools_from_prediction`.
        team_size: agents at once; counts: the session counts the sweep tried.
        ref: the model every call goes to in the one-model answer; label: the setting.
    """
    pred, meas = float(row["predicted"]), int(row["measured"])
    one = replicas_for(team_size, pred)
    by_pool = {m: replicas_for(team_size, r["per_replica"]) for m, r in pools.iterrows()}
    moved = ", ".join(f"{pools.loc[m, 'share']:.0%} of the calls on {m} (calls {pools.loc[m, 'service_s'] / pools.loc[ref, 'service_s']:.2g}× as long)"
                      for m in pools.index if m != ref)
    split = " + ".join(f"{n} of {m} ({pools.loc[m, 'per_replica']:.3g} sessions each)" for m, n in by_pool.items())
    total = sum(by_pool.values())
    kind = bracket(pred, meas, counts)
    trust = {"agree": f"the sweep measured {meas}, in agreement, so these counts stand",
             "conservative": f"the sweep served {meas}, more than predicted, so these counts are conservative "
                             f"(it served {meas / pred:.2g}× the one-model prediction)" if pred > 0 else
                             f"the sweep served {meas}, so these counts are conservative",
             "optimistic": f"the sweep already missed the SLO at {next_count(meas, counts)}, so these counts are "
                           "optimistic: plan for more",
             "beyond": f"the sweep met the SLO up to {meas}, every count it tried, so it cannot check them",
             "unchecked": "the sweep met the SLO at no count tried, so nothing checks them"}[kind]
    return (f"One capacity model for a team of {team_size} ({label}): with every call on {ref} it predicts {pred:.3g} "
            f"sessions per replica, so {one} replica(s); with {moved}, the same model gives {split}, {total} in all "
            f"({'fewer' if total < one else 'more' if total > one else 'as many'}); {trust}.")


def plot_knee(tables: Mapping[str, pd.DataFrame], slots: int, min_good: float = MIN_GOOD):
    """What the knee and the capacity are judged on, against the session count, one line per
    setting (e.g. --cache-ram off/on): the later turns' cache hit rate, and the share of
    later turns (plus any failed turn) that met the TTFT SLO, with `min_good` (the share
    `measured_capacity` asks for) and the slot count marked; each point is labelled with the
    turns it judged. Later turns only: a session's first turn is a cold prefill at any load.
    Returns the axes."""
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for label, t in tables.items():
        a.plot(t.index, t["cache_hit_rate_later"], "o-", label=label)
        b.plot(t.index, t["good_fraction_later"], "o-", label=label)
        for n, good, judged in zip(t.index, t["good_fraction_later"], t.get("turns_judged_later", [None] * len(t))):
            if judged is not None and good == good:
                b.annotate(f"{int(judged)}", (n, good), textcoords="offset points", xytext=(4, 4), fontsize=7)
    counts = sorted({int(n) for t in tables.values() for n in t.index} | {slots})
    for ax in (a, b):
        ax.axvline(slots, color="grey", ls=":", label=f"{slots} slots")
        ax.set_xticks(counts)
        ax.set_xlabel("concurrent sessions")
        ax.set_ylim(-0.05, 1.05)
    b.axhline(min_good, color="red", ls="--", label=f"capacity: {min_good:.0%} within the SLO")
    a.set_ylabel("cache hit rate, turns after the first")
    b.set_ylabel("share of later turns within the TTFT SLO")
    b.set_title("labels: turns judged", fontsize=8)
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.tight_layout()
    return a, b

"""How many agents fit one server, and how to grow past one (notebook 16).

The measurements come from `measure.sessions` (N live agent sessions against K slots) and
`servers.router` (replicas behind sglang-router); this module turns them into the
notebook's answers:

- `knee`, `knee_sentence`: the largest session count before sessions start evicting each
  other's cached prefixes (the later turns' cache hit rate falls below a threshold), and
  where that fell against the slot count;
- `batch_gain`: notebook 11's throughput curve read at one point: requests/s with K users
  on K slots over requests/s with one, on requests shaped like a cached turn;
- `predict_capacity`: sessions one replica should serve, predicted before measuring from
  the KV budget (notebook 12: which session prefixes fit in the slots and in the host-RAM
  prompt cache) and the throughput of one replica with K slots (a lone cached turn's
  service time, the think time, the batching gain at K, kept under a utilisation that
  leaves room for bursts);
- `measured_capacity`, `capacity_sentence`: the largest session count whose turns meet the
  TTFT SLO, and how it compares with the prediction (and what the gap means);
- `knee_exercise`: what an exercise scores a guess against (the arithmetic, and the run);
- `replicas_for`: replicas for a team, from one replica's capacity;
- `pool_capacity`, `team_table`, `pool_text`: the same per model, when every session sends
  a share of its calls to each model (a main model and a small/fast one) and each model
  runs in its own pool of replicas;
- `plot_knee`: the picture.

Past one replica, how requests are spread over several (policies, the kill drill) is
`lessons.routing`.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd

__all__ = ["knee", "knee_sentence", "batch_gain", "predict_capacity", "measured_capacity", "capacity_sentence",
           "knee_exercise", "replicas_for", "pool_capacity", "team_table", "pool_text", "plot_knee"]


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


def predict_capacity(one: pd.DataFrame, *, slots: int, slot_ctx: int, kv_bytes_per_token: float,
                     cache_ram_mib: float = 0.0, utilisation: float = 0.7, gain: float = 1.0) -> dict[str, float]:
    """Sessions one replica should serve, from a single session's run, the KV budget and
    the batching gain at K slots.

    A replica keeps up to K turns in service at once. With all K busy, a turn takes
    K x service / gain (gain: throughput with K users over one, `batch_gain`); a session
    holds a slot for that long, then thinks. Keeping the slots busy a share `utilisation`
    of the time allows N = utilisation x K x (think + K·service/gain) / (K·service/gain)
    = utilisation x (gain x think / service + K) sessions. K = 1, gain = 1 is a serial
    server: utilisation x (think + service) / service.

    Args:
        one: the per-turn frame of ONE session alone (its turns' e2e, prompt sizes, the
            think time between them).
        slots: llama-server slots (-np); slot_ctx: context per slot (-c / -np).
        kv_bytes_per_token: from the model card (notebook 12).
        cache_ram_mib: the host-RAM prompt cache (--cache-ram; 0: off).
        utilisation: the busy share the slots may run at; queueing grows without bound
            as it nears 1, so leave headroom for bursts.
        gain: requests/s with K users over one (1: batching buys nothing).

    Returns the KV limit (sessions whose prefixes stay cached: slots, plus those the RAM
    cache holds), the throughput limit (above, with service the lone cached turn's e2e),
    and their minimum, with the inputs.
    """
    ok = one[one["status"] == "ok"].sort_values("turn")
    peak = float(ok["prompt_tokens"].max() + ok["output_tokens"].max())
    service = float(ok.loc[ok["turn"] > 0, "e2e_s"].mean() if (ok["turn"] > 0).any() else ok["e2e_s"].mean())
    think = float((ok["sent_t"].shift(-1) - ok["end_t"]).dropna().mean()) if len(ok) > 1 else 0.0
    fit = slots if peak <= slot_ctx else 0
    in_ram = cache_ram_mib * 2**20 / (peak * kv_bytes_per_token) if cache_ram_mib else 0.0
    kv_limit = fit + math.floor(in_ram)
    tput_limit = utilisation * (gain * think / service + slots) if service > 0 else math.inf
    return {"peak_tokens": peak, "service_s": service, "think_s": think, "slots": slots, "gain": gain,
            "utilisation": utilisation, "kv_limit": kv_limit, "throughput_limit": tput_limit,
            "predicted": min(kv_limit, tput_limit)}


def measured_capacity(table: pd.DataFrame, min_good: float = 0.9, column: str = "good_fraction_later") -> int:
    """The largest session count (before the first failure) whose turns met the SLO in at
    least `min_good` of cases. By default only turns after a session's first count: the
    first is a whole prefill however many sessions run (a new agent's cold start), while
    capacity is about the steady state; failed turns count wherever they fell
    (`sessions_summary`). (`column="good_fraction"`: every turn.)

    A NaN fraction (nothing measured: no turn was judged) fails the level: a count where no
    turn is shown to meet the SLO is not one the server serves."""
    best = 0
    for n, good in table[column].items():
        if not good >= min_good:   # NaN compares False both ways: `good < min_good` let it pass
            break
        best = int(n)
    return best


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
    above = [c for c in sorted(counts) if c > meas]
    nxt = above[0] if above else None
    kv_binds = row["kv_limit"] <= row["throughput_limit"]
    head = (f"{label}: predicted {pred:.2f} sessions (bound by the {'KV' if kv_binds else 'throughput'} limit), "
            f"measured {'at least ' if nxt is None else ''}{meas} (one sweep, one run per count: no rerun, so the "
            "measured count is not judged against noise)")
    if meas == 0:
        return f"{head}: even {min(counts)} session(s) missed the SLO; the prediction cannot be checked below that."
    if nxt is not None and meas <= pred < nxt:
        return (f"{head}: **agree**: the prediction falls between the largest count that met the SLO ({meas}) "
                f"and the first that did not ({nxt}).")
    if pred >= (nxt if nxt is not None else math.inf):
        return (f"{head}: the prediction was **optimistic**: {nxt} sessions already missed the SLO. Something the "
                "model leaves out costs time here: re-prefills after evictions, turns queued behind whole turns, "
                "or a machine busy with other work (the contention line).")
    if nxt is None and pred > meas:
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


def replicas_for(team_size: int, per_replica: float) -> int:
    """Replicas a team needs when one serves `per_replica` sessions (at least one)."""
    return max(1, math.ceil(team_size / per_replica)) if per_replica > 0 else math.inf


def pool_capacity(service_s: Mapping[str, float], shares: Mapping[str, float], think_s: float, *,
                  kv_limit: Mapping[str, float] | None = None, utilisation: float = 0.7) -> pd.DataFrame:
    """Sessions one replica of each model's pool serves, when each session sends `shares` of
    its calls to each model.

    A session's cycle is one call and one think: cycle = think + sum_m share_m x service_m.
    Pool m is busy share_m x service_m of every cycle, for each session, so one replica at
    `utilisation` serves utilisation x cycle / (share_m x service_m) sessions (the
    throughput limit), capped by `kv_limit[m]` where given (the sessions whose prefixes
    stay cached: the main model's long conversations; a small model's one-off calls keep none).

    Args:
        service_s: model -> seconds one call of it takes with the model resident.
        shares: model -> share of the calls (normalised).
        think_s: a session's time between calls (its tools running).
        kv_limit: model -> sessions its replica keeps cached (missing: no limit).
        utilisation: the busy share a replica may run at (headroom for bursts).
    """
    total = sum(shares.values())
    if total <= 0 or set(shares) - set(service_s):
        raise ValueError(f"need a positive share and a service time for every model, got {dict(shares)}, "
                         f"{dict(service_s)}")
    share = {m: s / total for m, s in shares.items()}
    cycle = think_s + sum(share[m] * service_s[m] for m in share)
    rows = {}
    for m in share:
        busy = share[m] * service_s[m]
        tput = utilisation * cycle / busy if busy > 0 else math.inf
        kv = float((kv_limit or {}).get(m, math.inf))
        rows[m] = {"share": share[m], "service_s": service_s[m], "cycle_s": cycle, "throughput_limit": tput,
                   "kv_limit": kv, "per_replica": min(tput, kv)}
    return pd.DataFrame(rows).T


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


def plot_knee(tables: Mapping[str, pd.DataFrame], slots: int, slo_ttft_s: float | None = None):
    """Later-turn cache hit rate and TTFT p95 against the session count, one line per
    setting (e.g. --cache-ram off/on), the slot count marked. Returns the axes."""
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for label, t in tables.items():
        a.plot(t.index, t["cache_hit_rate_later"], "o-", label=label)
        b.plot(t.index, t["ttft_p95_s"], "o-", label=label)
    for ax in (a, b):
        ax.axvline(slots, color="grey", ls=":", label=f"{slots} slots")
        ax.set_xlabel("concurrent sessions")
    if slo_ttft_s:
        b.axhline(slo_ttft_s, color="red", ls="--", label="TTFT SLO")
    a.set_ylabel("cache hit rate, turns after the first")
    a.set_ylim(-0.05, 1.05)
    b.set_ylabel("TTFT p95 (s)")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.tight_layout()
    return a, b

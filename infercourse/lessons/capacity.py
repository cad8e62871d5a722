"""How many agents fit one server, and how to grow past one (notebook 16).

The measurements come from `measure.sessions` (N live agent sessions against K slots) and
`servers.router` (replicas behind sglang-router); this module turns them into the
notebook's answers:

- `knee`: the largest session count before sessions start evicting each other's cached
  prefixes (the later turns' cache hit rate falls below a threshold);
- `predict_capacity`: sessions one replica should serve, predicted before measuring from
  two numbers the course already taught: the KV budget (notebook 12: which session
  prefixes fit in the slots and in the host-RAM prompt cache) and the throughput of one
  replica (notebook 11: one cached turn's service time against a session's think time,
  kept under a utilisation that leaves room for bursts);
- `measured_capacity`: the largest session count whose turns meet the TTFT SLO;
- `replicas_for`: replicas for a team, from one replica's capacity;
- `pool_capacity`, `team_table`, `pool_text`: the same per model, when every session sends
  a share of its calls to each model (a main model and a small/fast one) and each model
  runs in its own pool of replicas;
- `plot_knee`, `policy_table`: the pictures and the routing comparison;
- `KillAfter`: the reliability drill: SIGKILL one replica once N turns have finished
  (an event, not a clock), so the drill lands under load on any machine.
"""
from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from infercourse.ops.supervisor import kill_server

__all__ = ["knee", "predict_capacity", "measured_capacity", "replicas_for", "pool_capacity", "team_table",
           "pool_text", "plot_knee", "policy_table", "KillAfter", "kill_story"]


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


def predict_capacity(one: pd.DataFrame, *, slots: int, slot_ctx: int, kv_bytes_per_token: float,
                     cache_ram_mib: float = 0.0, utilisation: float = 0.7) -> dict[str, float]:
    """Sessions one replica should serve, from a single session's run and the KV budget.

    Args:
        one: the per-turn frame of ONE session alone (its turns' e2e, prompt sizes, the
            think time between them).
        slots: llama-server slots (-np); slot_ctx: context per slot (-c / -np).
        kv_bytes_per_token: from the model card (notebook 12).
        cache_ram_mib: the host-RAM prompt cache (--cache-ram; 0: off).
        utilisation: the busy share a replica may run at; queueing grows without bound
            as it nears 1, so leave headroom for bursts.

    Returns the KV limit (sessions whose prefixes stay cached: slots, plus those the RAM
    cache holds), the throughput limit (utilisation x (think + service) / service, with
    service the cached turn's e2e), and their minimum.
    """
    ok = one[one["status"] == "ok"].sort_values("turn")
    peak = float(ok["prompt_tokens"].max() + ok["output_tokens"].max())
    service = float(ok.loc[ok["turn"] > 0, "e2e_s"].mean() if (ok["turn"] > 0).any() else ok["e2e_s"].mean())
    think = float((ok["sent_t"].shift(-1) - ok["end_t"]).dropna().mean()) if len(ok) > 1 else 0.0
    fit = slots if peak <= slot_ctx else 0
    in_ram = cache_ram_mib * 2**20 / (peak * kv_bytes_per_token) if cache_ram_mib else 0.0
    kv_limit = fit + math.floor(in_ram)
    tput_limit = utilisation * (think + service) / service if service > 0 else math.inf
    return {"peak_tokens": peak, "service_s": service, "think_s": think, "kv_limit": kv_limit,
            "throughput_limit": tput_limit, "predicted": min(kv_limit, tput_limit)}


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


def policy_table(results: Mapping[str, Any]) -> pd.DataFrame:
    """One row per routing policy: turns ok, cache hit rate (later turns), TTFT p50/p95."""
    from infercourse.measure.sessions import sessions_summary
    rows = {p: sessions_summary(r.df) for p, r in results.items()}
    cols = ["n_sessions", "turns", "turns_ok", "cache_hit_rate_later", "ttft_p50_s", "ttft_p95_s"]
    return pd.DataFrame(rows).T[cols]


class KillAfter:
    """SIGKILL `server` once `n_done` requests are on disk in `run_dir` (a watcher thread).

    Args:
        server: the replica to kill (a `servers.Server`).
        run_dir: the results folder the run writes (its requests.jsonl is counted).
        n_done: finished requests before the kill.
    """

    def __init__(self, server, run_dir: str | Path, n_done: int, timeout_s: float = 600.0):
        self.server, self.path, self.n_done = server, Path(run_dir) / "requests.jsonl", n_done
        self.fired_at: int | None = None   # requests on disk when it fired
        self._stop = threading.Event()
        self._deadline = time.monotonic() + timeout_s
        self._thread = threading.Thread(target=self._watch, daemon=True, name="kill-after")

    def _count(self) -> int:
        try:
            return self.path.read_text().count("\n")
        except OSError:
            return 0

    def _watch(self) -> None:
        while not self._stop.wait(0.05) and time.monotonic() < self._deadline:
            n = self._count()
            if n >= self.n_done:
                kill_server(self.server)
                self.fired_at = n
                return

    def __enter__(self) -> "KillAfter":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def kill_story(result, drill: KillAfter) -> dict[str, Any]:
    """What the drill did: when it fired, turns after it ok / failed, sessions lost, and
    that every finished turn is on disk (rows in requests.jsonl == rows in the frame)."""
    df = result.df
    on_disk = sum(1 for line in (Path(result.dir) / "requests.jsonl").read_text().splitlines()
                  if json.loads(line).get("request_id") is not None)
    after = df.sort_values("end_t").iloc[drill.fired_at or len(df):]
    return {"fired_after_turns": drill.fired_at, "turns_after": len(after),
            "ok_after": int((after["status"] == "ok").sum()),
            "errors_after": int((after["status"] == "error").sum()),
            "sessions_lost": int(df.loc[df["status"] != "ok", "session"].nunique()),
            "finished_on_disk": on_disk, "rows": len(df),
            "errors": sorted(set(df.loc[df["status"] == "error", "error"].str.slice(0, 90)))}

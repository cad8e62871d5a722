"""The capacity model: how many agent sessions one replica serves, and how many replicas a
team needs (notebook 16; `lessons.capacity` turns it into sentences).

A replica keeps up to K turns in service at once; with all K busy a call takes
K x service / g, where service is one call alone and g the batching gain at K users
(requests/s with K users over one: notebook 11's curve read at K). A session sends a share
of its calls to a pool of replicas and thinks between calls; keeping a pool's slots busy a
share rho of the time (headroom for bursts: queueing grows without bound as rho nears 1)
allows

    sessions per replica = rho x g x cycle / (share x service),
    cycle = think + sum over pools of share x K x service / g.

With every call on one model this is rho x (g x think / service + K) (`predict_capacity`);
with K = 1 and g = 1, a serial server. The KV limit caps it: sessions whose prefixes stay
cached (K slots, plus what the host-RAM prompt cache holds). `pool_capacity` applies the
same formula per pool, and `pools_from_prediction` feeds it `predict_capacity`'s inputs, so
a team's answer on one model and split over two differ only by the calls that moved.

`measured_capacity` reads a sweep instead; `bracket` says where a prediction sits against
it (the sweep brackets the capacity between the largest count that met the SLO and the next
count tried).
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import pandas as pd

__all__ = ["MIN_GOOD", "predict_capacity", "measured_capacity", "next_count", "bracket", "replicas_for",
           "pool_capacity", "service_ratios", "pools_from_prediction"]

MIN_GOOD = 0.9   # a session count is served when this share of its later turns met the SLO


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


def measured_capacity(table: pd.DataFrame, min_good: float = MIN_GOOD, column: str = "good_fraction_later") -> int:
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


def next_count(meas: int, counts: Sequence[int]) -> int | None:
    """The first session count tried above `meas` (None: `meas` was the largest)."""
    above = [c for c in sorted(counts) if c > meas]
    return above[0] if above else None


def bracket(pred: float, meas: int, counts: Sequence[int]) -> str:
    """How a prediction sits against the sweep's bracket [measured, next count tried):
    "agree", "optimistic" (the next count already missed), "conservative" (below the
    measured count), "beyond" (past every count tried) or "unchecked" (none met the SLO)."""
    nxt = next_count(meas, counts)
    if meas == 0:
        return "unchecked"
    if nxt is not None and meas <= pred < nxt:
        return "agree"
    if nxt is not None and pred >= nxt:
        return "optimistic"
    return "beyond" if pred > meas else "conservative"


def replicas_for(team_size: int, per_replica: float) -> int:
    """Replicas a team needs when one serves `per_replica` sessions (at least one)."""
    return max(1, math.ceil(team_size / per_replica)) if per_replica > 0 else math.inf


def pool_capacity(service_s: Mapping[str, float], shares: Mapping[str, float], think_s: float, *,
                  slots: int = 1, gain: float = 1.0, kv_limit: Mapping[str, float] | None = None,
                  utilisation: float = 0.7) -> pd.DataFrame:
    """Sessions one replica of each model's pool serves, when each session sends `shares` of
    its calls to each model: the module's one capacity model, per pool.

    With its K slots busy a call to m takes K x service_m / gain. A session's cycle is one
    think and one call: cycle = think + sum_m share_m x K x service_m / gain. One replica of
    m completes gain / service_m calls a second at full load, so at `utilisation` it serves
    utilisation x gain x cycle / (share_m x service_m) sessions (the throughput limit),
    capped by `kv_limit[m]` where given (sessions whose prefixes stay cached: the main
    model's long conversations; a small model's one-off calls keep none). With one model
    this is `predict_capacity`'s throughput limit; K = 1, gain = 1 is a serial server.

    Args:
        service_s: model -> seconds one call of it takes alone, with the model resident.
        shares: model -> share of the calls (normalised).
        think_s: a session's time between calls (its tools running).
        slots, gain: K slots per replica and the batching gain at K users (`batch_gain`).
        kv_limit: model -> sessions its replica keeps cached (missing: no limit).
        utilisation: the busy share a replica may run at (headroom for bursts).
    """
    total = sum(shares.values())
    if total <= 0 or set(shares) - set(service_s):
        raise ValueError(f"need a positive share and a service time for every model, got {dict(shares)}, "
                         f"{dict(service_s)}")
    share = {m: s / total for m, s in shares.items()}
    cycle = think_s + sum(share[m] * slots * service_s[m] / gain for m in share)
    rows = {}
    for m in share:
        busy = share[m] * service_s[m]
        tput = utilisation * gain * cycle / busy if busy > 0 else math.inf
        kv = float((kv_limit or {}).get(m, math.inf))
        rows[m] = {"share": share[m], "service_s": service_s[m], "cycle_s": cycle, "throughput_limit": tput,
                   "kv_limit": kv, "per_replica": min(tput, kv)}
    return pd.DataFrame(rows).T


def service_ratios(service_s: Mapping[str, float], ref: str = "main") -> dict[str, float]:
    """Each model's service time over `ref`'s (1.0 for `ref`): how much longer or shorter
    its calls are, from requests that differ only in the model they name."""
    if not service_s.get(ref, 0) > 0:
        raise ValueError(f"need a positive service time for {ref!r}, got {dict(service_s)}")
    return {m: v / service_s[ref] for m, v in service_s.items()}


def pools_from_prediction(row: Mapping[str, Any], ratios: Mapping[str, float], shares: Mapping[str, float],
                          ref: str = "main") -> pd.DataFrame:
    """`pool_capacity` fed `predict_capacity`'s inputs: `ref`'s service time is the one
    session's cached turn, the others' scaled by `ratios` (`service_ratios`); the think
    time, slots, gain and utilisation are the same; `ref` keeps the KV limit. With every
    call on `ref` it returns `predict_capacity`'s prediction.

    Args:
        row: `predict_capacity`'s dict (service_s, think_s, slots, gain, utilisation, kv_limit).
        ratios: model -> service time over `ref`'s; shares: model -> share of the calls.
    """
    svc = {m: float(row["service_s"]) * float(ratios[m]) for m in shares}
    return pool_capacity(svc, shares, float(row["think_s"]), slots=int(row["slots"]), gain=float(row["gain"]),
                         kv_limit={ref: float(row["kv_limit"])}, utilisation=float(row["utilisation"]))

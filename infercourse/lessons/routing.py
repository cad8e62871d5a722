"""Requests spread over several replicas behind a router (notebook 16, after one server's
capacity in `lessons.capacity`).

The replicas and the router are `servers.router` (sglang-router, or its stand-in where it is
absent); the sessions are `measure.sessions`. This module turns their runs into the notebook's
answers:

- `policy_trials`, `judge_policies`, `policy_table`, `policy_text`: round-robin against
  cache-aware routing, interleaved (each order run) with an A/A rerun of cache-aware, judged
  by `measure.noise`; `policy_prediction`: what an exercise scores a guess against;
- `router_counters`, `counters_from_exposition`: the router's own counters (retries, non-200
  answers), read with prometheus_client's parser;
- `KillAfter`, `kill_drill`, `kill_story`, `kill_text`: the reliability drill: SIGKILL one
  replica once N turns have finished (an event, not a clock), then what the client's rows
  and the router's own counters say happened (failures, their errors, retries).
"""
from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from infercourse.measure import claims, noise
from infercourse.ops.supervisor import kill_server

__all__ = ["policy_trials", "judge_policies", "policy_table", "policy_text", "policy_prediction",
           "router_counters", "counters_from_exposition", "KillAfter", "kill_drill", "kill_story", "kill_text"]


# The A/A rerun is cache-aware's: under the null (the policies alike) any arm's rerun is as good a
# second reference, and cache-aware's costs ~16 s a block on 2 cores where round-robin's re-prefills
# cost ~45 s (4 blocks: ~2 min of notebook 16). Round-robin's own spread shows across its blocks.
POLICY_ARMS = {"cache_aware": "cache_aware", "cache_aware-AA": "cache_aware", "round_robin": "round_robin"}


def _fresh_router(group, policy: str) -> None:
    """A new router process with `policy` (the replicas and their caches stay): every run
    then starts on a router of the same age, whichever policy it has."""
    if group.router.policy != policy:
        group.set_policy(policy)          # stops the old router, starts one with the policy
    else:
        group.router.stop()
        group.router.start()


def _policy_row(df: pd.DataFrame) -> dict[str, Any]:
    """One run's routing numbers: turns, cache hit rate and TTFT p50 of the turns after the
    first (the first is a cold prefill under any policy). No p95: a run has tens of turns,
    and a p95 needs 72 for its interval (`summary.min_n`)."""
    from infercourse.measure.sessions import sessions_summary
    s = sessions_summary(df)
    later = df[(df["status"] == "ok") & (df["turn"] > 0)]["ttft_s"].dropna()
    return {"n_sessions": s["n_sessions"], "turns": s["turns"], "turns_ok": s["turns_ok"],
            "cache_hit_rate_later": s["cache_hit_rate_later"],
            "ttft_p50_later_s": float(later.median()) if len(later) else math.nan}


def policy_trials(group, script, n_sessions: int, *, repeats: int = 4, out_dir: str | Path | None = None,
                  **run: Any) -> dict[str, Any]:
    """Round-robin against cache-aware on the same replicas: `repeats` blocks, each running
    cache-aware, its A/A rerun and round-robin once, in a shuffled order (`noise.schedule`:
    which policy sits where is chance, as the verdict's relabelling assumes), each on a fresh
    router.

    Returns {"trials": one row per run (block, arm, policy, `_policy_row`), "runs",
    "verdict": round-robin against cache-aware on the later turns' TTFT p50 (a
    `noise.Comparison`, None under 2 blocks), "floor": cache-aware's A/A `NoiseFloor`}.

    Args:
        group: a running `ReplicaGroup`; script, n_sessions, run: for `sessions.run_sessions`.
        repeats: blocks (the joint test needs 3 ever to call a difference, and then only if
            every block agrees; 4 leave it room).
        out_dir: each run writes `<arm>[-r<block>]/` under it.
    """
    from infercourse.measure import sessions as ss

    def trial(policy: str, label: str):
        _fresh_router(group, policy)
        r = ss.run_sessions(group.engine(), script, n_sessions, out_dir=Path(out_dir) / label if out_dir else None,
                            label=label, **run)
        return {"policy": policy, **_policy_row(r.df)}, r

    trials, runs = noise.run_arms(POLICY_ARMS, repeats, trial)
    return {**judge_policies(trials), "runs": runs}


def judge_policies(trials: pd.DataFrame) -> dict[str, Any]:
    """Round-robin against cache-aware on the later turns' TTFT p50, with cache-aware's A/A
    rerun as data in every block (`noise.compare_arms`; no verdict under 2 blocks).

    Args:
        trials: one row per run with `rep` (the block), `arm` (POLICY_ARMS) and the
            `_policy_row` columns, as `noise.run_arms` returns them.
    """
    verdicts, floor = noise.compare_arms(trials, "ttft_p50_later_s", "cache_aware", "cache_aware-AA",
                                         higher_is_better=False)
    return {"trials": trials.rename(columns={"rep": "block"}), "verdict": verdicts.get("round_robin"), "floor": floor}


def policy_table(routed: Mapping[str, Any]) -> pd.DataFrame:
    """One row per arm of `policy_trials`: runs, and the median over its runs of turns ok,
    the later turns' cache hit rate and TTFT p50."""
    t = routed["trials"]
    cols = ["turns", "turns_ok", "cache_hit_rate_later", "ttft_p50_later_s"]
    out = t.groupby("arm")[cols].median()
    out.insert(0, "runs", t.groupby("arm").size())
    return out.reindex([a for a in POLICY_ARMS if a in out.index])


def policy_text(routed: Mapping[str, Any]) -> str:
    """What the policy trials showed: each run's later-turn hit rate, and the verdict on
    the later turns' TTFT p50 against cache-aware's A/A rerun (or why there is none)."""
    t = routed["trials"]
    wide = t.pivot(index="block", columns="arm", values="cache_hit_rate_later")
    n = len(wide)
    order = " | ".join(" → ".join(t[t["block"] == b]["arm"]) for b in sorted(t["block"].unique()))
    hits = "; ".join(f"{a}: " + ", ".join(f"{v:.2f}" for v in wide[a]) for a in POLICY_ARMS if a in wide)
    lines = [f"- Runs in order, block by block: {order} ({n} block(s), one run of each arm per block, each on a "
             "fresh router).",
             f"- Later turns' cache hit rate, per block: {hits}."]
    if "cache_aware" in wide and "round_robin" in wide:
        more = int((wide["cache_aware"] > wide["round_robin"]).sum())
        lines.append(f"- Cache-aware's hit rate was the higher in {more} of {n} block(s) (no noise test on hit rates: "
                     "read them as counts).")
    c = routed.get("verdict")
    if c is None:
        ttft = t.pivot(index="block", columns="arm", values="ttft_p50_later_s")
        a, b = float(ttft["cache_aware"].median()), float(ttft["round_robin"].median())
        lines.append("- Later turns' TTFT p50: "
                     + claims.ratio_sentence(a, b, None, names=("cache_aware", "round_robin"))
                     + f" With {n} block(s) there is no A/A floor: this run cannot say which policy answered first.")
    else:
        lines.append(f"- {claims.verdict_sentence(c, 'later turns’ TTFT p50')} ({routed['floor'].text()})")
    return "\n".join(lines)


def policy_prediction(routed: Mapping[str, Any]) -> float:
    """Exercise 8's arithmetic: if a later turn's TTFT is its prefill, and its prefill is the
    share of its prompt not served from cache, round-robin ÷ cache-aware TTFT (the verdict's
    ratio) is (1 - hit rate round-robin) / (1 - hit rate cache-aware), from the policies' median hit rates."""
    t = policy_table(routed)["cache_hit_rate_later"]
    miss_rr, miss_ca = 1 - float(t["round_robin"]), 1 - float(t["cache_aware"])
    return miss_rr / miss_ca if miss_ca > 0 else math.inf


def router_counters(group) -> dict[str, float] | None:
    """sglang-router's own counters, from its Prometheus exporter: retries on another
    worker, retries exhausted, upstream answers that were not 200, and non-200 answers it
    gave its clients, at the exporter port of the router's current start
    (`Router.prometheus_port`). None: not an sglang-router, or the exporter did not answer."""
    import httpx
    port = getattr(group.router, "prometheus_port", None)
    if port is None:
        return None
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    return counters_from_exposition(text)


_ROUTER_COUNTERS = {"smg_worker_retries_total": "retries", "smg_worker_retries_exhausted_total": "retries_exhausted",
                    "smg_router_upstream_responses_total": "upstream_not_200",
                    "smg_http_responses_total": "client_not_200"}


def counters_from_exposition(text: str) -> dict[str, float]:
    """The router's counters from a Prometheus exposition page (prometheus_client's parser):
    retries summed over workers, responses summed over every status but 200."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {k: 0.0 for k in _ROUTER_COUNTERS.values()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = _ROUTER_COUNTERS.get(sample.name)
            if key and not (key.endswith("not_200") and sample.labels.get("status_code") == "200"):
                out[key] += sample.value
    return out


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


def kill_drill(group, script, n_sessions: int, kill_after: int, out_dir: str | Path, *, victim: int = 1,
               policy: str = "cache_aware", **run: Any) -> dict[str, Any]:
    """The drill: a fresh router with `policy`, `n_sessions` sessions through it, replica
    `victim` SIGKILLed once `kill_after` turns are on disk; `kill_story` of the run, with
    the router's counters over the drill (None where they cannot be read)."""
    from infercourse.measure import sessions as ss
    _fresh_router(group, policy)
    before = router_counters(group)
    with KillAfter(group.replicas[victim], out_dir, kill_after) as drill:
        result = ss.run_sessions(group.engine(), script, n_sessions, out_dir=out_dir, label="drill", **run)
    after = router_counters(group)
    counters = {k: after[k] - before.get(k, 0.0) for k in after} if before is not None and after is not None else None
    return kill_story(result, drill, counters)


def _error_kind(err: str) -> str:
    """A failed turn's error, in the words of what happened on the wire."""
    if re.search(r"cut mid-way|ended without|incomplete", err):
        return "stream cut after it had started"
    m = re.search(r"HTTP (\d{3})", err)
    return f"HTTP {m.group(1)} answer" if m else "other error"


def kill_story(result, drill: KillAfter, counters: Mapping[str, float] | None = None) -> dict[str, Any]:
    """What the drill did: when it fired, turns after it ok / failed, sessions lost, that
    every finished turn is on disk (rows in requests.jsonl == rows in the frame), the failed
    turns' errors (each kind counted, the first text of each) and the router's counters over
    the drill (`router_counters`; None: not read)."""
    df = result.df
    on_disk = sum(1 for line in (Path(result.dir) / "requests.jsonl").read_text().splitlines()
                  if json.loads(line).get("request_id") is not None)
    after = df.sort_values("end_t").iloc[drill.fired_at or len(df):]
    failed = df.loc[df["status"] != "ok", "error"].fillna("").astype(str)
    kinds = Counter(_error_kind(e) for e in failed)
    return {"fired_after_turns": drill.fired_at, "turns_after": len(after),
            "ok_after": int((after["status"] == "ok").sum()),
            "errors_after": int((after["status"] != "ok").sum()),
            "failed": len(failed), "error_kinds": dict(kinds),
            "sessions_lost": int(df.loc[df["status"] != "ok", "session"].nunique()),
            "finished_on_disk": on_disk, "rows": len(df),
            "errors": sorted(set(failed.str.slice(0, 90))),
            "router": dict(counters) if counters is not None else None}


def kill_text(story: Mapping[str, Any]) -> str:
    """The drill in words, from its rows and the router's counters: how many turns failed,
    with which errors, whether the router retried any request, and what reached the client."""
    if story.get("fired_after_turns") is None:
        return (f"The kill never fired (fewer than the turns it waited for finished): {story['rows']} turns, "
                f"{story['failed']} failed. Nothing here tests the router's failover.")
    kinds = ", ".join(f"{n} × {k}" for k, n in story["error_kinds"].items())
    head = (f"The replica was killed once {story['fired_after_turns']} turns had finished. Of the "
            f"{story['turns_after']} turns that finished after it: {story['ok_after']} ok, "
            f"{story['errors_after']} failed; over the whole drill {story['failed']} turn(s) failed"
            + (f" ({kinds}; first text: {story['errors'][0]!r})" if story["failed"] else "")
            + f", and {story['sessions_lost']} session(s) stopped at their failure.")
    disk = (f" Every finished turn is on disk ({story['finished_on_disk']} of {story['rows']})."
            if story["finished_on_disk"] == story["rows"] else
            f" Only {story['finished_on_disk']} of {story['rows']} finished turns are on disk.")
    r = story.get("router")
    if r is None:
        return (head + " The router's counters could not be read, and the client's rows cannot show a retry (a "
                "retried request that succeeded reads as any other ok turn): this run does not say whether the "
                "router retried anything." + disk)
    retried = int(r["retries"])
    said = (f" The router's counters over the drill: {retried} retr{'y' if retried == 1 else 'ies'} on another "
            f"worker, {int(r['retries_exhausted'])} exhausted, {int(r['upstream_not_200'])} failed upstream "
            f"call(s), {int(r['client_not_200'])} error answer(s) to the client.")
    if story["failed"] == 0:
        meaning = (" No failure reached the client: every request in flight on the dead replica was retried "
                   "elsewhere or had not started there." if retried else
                   " No failure reached the client, and nothing was retried: no request was on the killed replica.")
    elif retried == 0:
        meaning = (" No request was retried: every failure above reached the client as it happened (an agent "
                   "would have to resend the turn itself).")
    else:
        why = (["a stream cut after it had started cannot be retried (its bytes went to the client)"]
               if "stream cut after it had started" in story["error_kinds"] else [])
        why += (["an error answer is what the router passes on when its retries did not save the request"]
                if any(k.startswith("HTTP") for k in story["error_kinds"]) else [])
        meaning = (f" The router retried {retried} request(s), yet {story['failed']} failure(s) still reached the "
                   "client" + (": " + "; ".join(why) if why else "") + ".")
    return head + said + meaning + disk



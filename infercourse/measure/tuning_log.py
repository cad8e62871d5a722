"""Keep or revert, and write it down: the decision rule and the log of a tuning session.

A knob "made it faster" only when the change is larger than what the machine does on its
own. `decide` compares the same requests before and after a change and keeps it only when
the evidence says *better beyond noise*; anything else is a revert, with the reason.
`TuningLog` appends one JSON line per trial (the knob, its old and new value, the whole
configuration, the run folders with their manifests, the numbers, the decision and why),
so a colleague, or you next month, can trust or redo the result.

**Which requests make a pair.** Every trial sends the same requests, but under concurrent
users *which* request waits where is a race: C users send at once, one slot serves them in
the order their requests happened to arrive, and that order changes from run to run. A time
that contains the wait for a slot (TTFT, E2E: `PAIR_BY_PLACE`) is therefore paired by
**place in the queue** (the k-th request to get its first token before and after; with
equal-length prompts and forced answer lengths the k-th place does the same work whichever
prompt holds it). A time without the wait (the service time, E2E minus the wait; the
server's prefill) belongs to the request and is paired **by request**. Pairing a queued
time by request instead compares the first in line with the last whenever the race turns
out differently, and the A/A floor that comes out is the queue, not the machine.

The log does not know what a server is: a *session* is any dict with a `config` (a
dataclass), `runs` ({workload: a run with a per-request `df` and a `dir`}) and scalars
(e.g. `kv_cache_mib`). Notebook 14 fills it with llama-server trials.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandas as pd

from infercourse.measure import noise

__all__ = ["PAIR_BY_PLACE", "pairing", "pairs", "queue_order", "pairing_text", "decide", "p_text", "TuningLog",
           "explain_log"]


# times that include the wait for a slot: under concurrent users, paired by place in the queue
PAIR_BY_PLACE = ("ttft_s", "e2e_s", "queue_s")


def pairing(metric: str) -> str:
    """"place" for a time that contains the wait for a slot (`PAIR_BY_PLACE`), else "request"."""
    return "place" if metric in PAIR_BY_PLACE else "request"


def _keyed(df: pd.DataFrame, metric: str, by: str) -> pd.Series:
    ok = df[df["status"] == "ok"]
    if by == "place":
        if "first_token_t" not in ok:
            raise ValueError("pairing by place needs `first_token_t` (a per_request_frame)")
        # the k-th request to get its first token, k = 0, 1, ... (stable: ties keep row order)
        return ok.sort_values("first_token_t", kind="stable")[metric].reset_index(drop=True)
    return ok.set_index("request_id")[metric] if "request_id" in ok else ok[metric].reset_index(drop=True)


def pairs(before: pd.DataFrame, after: pd.DataFrame, metric: str,
          by: str = "request") -> tuple[list[float], list[float]]:
    """Values of `metric` for the requests that succeeded in both runs, paired.

    Args:
        before, after: per-request frames (`BenchResult.df`) of the same requests.
        metric: the column.
        by: "request" (the same request_id: the same prompt; row order without one) or
            "place" (the k-th request to get its first token in each run: the same place in
            the queue, see the module docstring).
    """
    if by not in ("request", "place"):
        raise ValueError(f"by must be 'request' or 'place', got {by!r}")
    both = pd.concat([_keyed(before, metric, by).rename("a"), _keyed(after, metric, by).rename("b")],
                     axis=1, join="inner").dropna()
    return both["a"].tolist(), both["b"].tolist()


def queue_order(df: pd.DataFrame) -> list:
    """The request_ids of the requests that succeeded, in the order they got their first token."""
    ok = df[df["status"] == "ok"]
    return ok.sort_values("first_token_t", kind="stable")["request_id"].tolist()


def pairing_text(first: pd.DataFrame, rerun: pd.DataFrame, metric: str = "ttft_s") -> str:
    """What pairing by request would have made of an A/A pair of runs, beside pairing by place:
    the queue order of each run and the two floors, from these runs' numbers.

    Args:
        first, rerun: the same configuration and requests, run twice (the A/A pair).
        metric: a time that includes the wait for a slot.
    """
    a, b = queue_order(first), queue_order(rerun)
    by_req, by_place = (noise.noise_floor(*pairs(first, rerun, metric, by)).floor for by in ("request", "place"))
    head = f"Queue order (request ids, first served first): {a} in the first run, {b} in the rerun."
    if a == b:
        return (f"{head} The same order both times: pairing by request and by place are the same pairs here "
                f"(A/A floor on {metric} ±{by_place:.0%} either way); on another run the race may turn out otherwise.")
    moved = sum(x != y for x, y in zip(a, b))
    return (f"{head} {moved} of {min(len(a), len(b))} places changed hands. The A/A floor on {metric}: "
            f"±{by_req:.0%} pairing by request, ±{by_place:.0%} pairing by place in the queue"
            + (": the first reading is mostly the race for the slot, not the machine."
               if by_req > by_place else
               ": here the race did not widen the floor; the machine's own noise dominates."))


def decide(before, after, metric: str = "ttft_s", *, goal: str = "lower",
           floor: float | noise.NoiseFloor = 0.0, aa: pd.DataFrame | None = None,
           pair_by: str = "request") -> dict[str, Any]:
    """Keep or revert, on the *paired* difference: the same requests before and after.

    Each pair i gives a ratio after_i / before_i; `noise.compare` tests it against the A/A
    noise (the baseline measured twice, `aa`), so "better" means better than the machine
    does to itself, and keeps the change only when it is better beyond that noise. Two
    overlapping per-run intervals are NOT the test: with a few requests each interval is
    nearly the whole sample (the first in line waits nothing, the last waits for everyone),
    so even a large consistent cut "overlaps".

    Args:
        before, after: per-request frames (`BenchResult.df`) of the same requests.
        metric: the column that defines "better".
        goal: "lower" (latencies) or "higher" (speeds, counts).
        floor: the A/A `noise.NoiseFloor` of `before` (its rerun then joins the test: A, its
            A/A rerun and B relabelled within each request, which needs 3 pairs where a bare
            band's sign-flip test needs 6), or a bare fraction (0.08: differences within ±8%
            are noise).
        aa: the baseline's repeat run (the same config, the same requests); when given, the
            floor is computed from it (`noise.noise_floor`) and `floor` is ignored.
        pair_by: "request" or "place" (`pairs`; `pairing(metric)` says which a metric needs).
    """
    if goal not in ("lower", "higher"):
        raise ValueError(f"goal must be 'lower' or 'higher', got {goal!r}")
    if aa is not None:
        floor = noise.noise_floor(*pairs(before, aa, metric, pair_by))
    a, b = pairs(before, after, metric, pair_by)
    if isinstance(floor, noise.NoiseFloor) and list(floor.a) != a:
        floor = floor.floor      # the rerun's pairs are not these requests: judge against its band
    c = noise.compare(a, b, floor, higher_is_better=goal == "higher", labels=("before", "after"), word="better")
    iv = c.interval
    out = {"metric": metric, "before": float(pd.Series(a).median()), "after": float(pd.Series(b).median()),
           "ratio": iv.median, "ratio_ci": (iv.lo, iv.hi), "floor": c.floor, "pairs": iv.n,
           "change": iv.median - 1, "verdict": c.text, "test": c.test, "paired_by": pair_by}
    note = "" if iv.exact else f" (only {iv.n} pair{'s' * (iv.n != 1)}: the whole range, not a 95% interval)"
    if c.verdict == "after better":
        return {**out, "decision": "keep", "why": f"better beyond noise ({p_text(c)}){note}"}
    if c.verdict == "before better":
        return {**out, "decision": "revert", "why": f"worse beyond noise ({p_text(c)}){note}"}
    if c.too_few:
        return {**out, "decision": "revert",
                "why": f"{c.said}: this trial cannot show a change either way, so keep the old setting "
                       f"(more requests per trial give the test its pairs){note}"}
    return {**out, "decision": "revert",
            "why": f"within noise: the test cannot tell it from noise ({p_text(c)}; paired interval "
                   f"[{iv.lo:.2f}, {iv.hi:.2f}], band {noise.band_text(c.floor)}), so keep the old setting{note}"}


def p_text(c: noise.Comparison) -> str:
    """A verdict's p beside the threshold its test used: the band test is one-sided on each
    side (0.025 a side at 95 %), the A/A relabelling test two-sided (0.05), so "p = 0.031"
    is within noise for one and would call a difference for the other."""
    side = " per side" if c.against != "the A/A rerun" else ""
    return f"p = {c.p:.2g}, {'at or under' if c.p <= c.level else 'above'} this test's {c.level:.3g}{side}"


def _target(session: dict[str, Any], target: str):
    """`"workload:metric"` -> that run's per-request frame; a plain name -> a session scalar."""
    if ":" in target:
        name, metric = target.split(":", 1)
        if name not in session["runs"]:
            raise ValueError(f"session has no run {name!r}; it has {sorted(session['runs'])}")
        return session["runs"][name].df, metric
    if target not in session:
        raise ValueError(f"session has no scalar {target!r}")
    return float(session[target]), None


class TuningLog:
    """An append-only tuning log: one JSON line per trial in `<folder>/log.jsonl`.

    A *session* is what `serve_and_measure` returns: a config, its runs (each with a
    manifest of conditions on disk) and server scalars (RSS, KV MiB). Each line records
    the time, the knob and its old/new value, the full config, the run folders, the
    target before/after (the median paired ratio with its interval and the A/A floor, or
    a scalar), the guard, the decision and why. `current` / `best` are the config and
    session kept so far.

    The noise floor: when the baseline session also holds `"<workload> A/A"` (the same
    requests run again on the same config), every paired decision on that workload is
    judged against the floor that repeat shows (`noise.noise_floor`), pairing each metric
    the way `pairing` says (a queued time by place, a service time by request).

    Args:
        folder: results folder (created); an existing log is appended to, never rewritten.
        guard: a `"workload:metric"` whose median must not get worse beyond noise for a
            change to be kept, whatever its target (a memory saving that slows users is
            a trade-off to decide knowingly, not a silent keep).
    """

    AA = " A/A"

    def __init__(self, folder: str | Path, *, guard: str = "users:e2e_s"):
        self.path = Path(folder) / "log.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.guard = guard
        self.base: dict[str, Any] | None = None
        self.best: dict[str, Any] | None = None
        self.entries: list[dict[str, Any]] = []

    @property
    def current(self) -> ServerConfig:
        if self.best is None:
            raise ValueError("record a baseline first")
        return self.best["config"]

    def _append(self, entry: dict[str, Any]) -> dict[str, Any]:
        entry = {"time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **entry}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, default=str) + "\n")
        self.entries.append(entry)
        return entry

    @staticmethod
    def _dirs(session: dict[str, Any]) -> dict[str, str]:
        return {k: str(r.dir) for k, r in session["runs"].items()}

    def baseline(self, session: dict[str, Any], note: str = "") -> dict[str, Any]:
        """Record the starting session (its config becomes `current`)."""
        self.best = self.base = session
        return self._append({"trial": "baseline", "knob": None, "config": asdict(session["config"]),
                             "run_dirs": self._dirs(session), "decision": "baseline", "why": note})

    def floor(self, target: str) -> noise.NoiseFloor | float:
        """The A/A `NoiseFloor` of a `"workload:metric"` (the baseline against its repeat, so
        `decide` can use the rerun as data), or 0.0 when the baseline has no repeat."""
        name, metric = target.split(":", 1)
        runs = (self.base or {}).get("runs", {})
        if name + self.AA not in runs:
            return 0.0
        return noise.noise_floor(*pairs(runs[name].df, runs[name + self.AA].df, metric, pairing(metric)))

    def trial(self, knob: str, session: dict[str, Any], *, target: str = "users:e2e_s",
              goal: str = "lower", expected: str = "") -> dict[str, Any]:
        """Compare a one-knob change with the kept session; keep or revert; append the line.

        Args:
            knob: the ServerConfig field that changed (checked: exactly that one).
            session: `serve_and_measure` output under the changed config.
            target: `"workload:metric"` (paired requests, see `decide`) or a session
                scalar such as "kv_cache_mib" (lower by > 1 %).
            goal: "lower" or "higher" is better for the target.
            expected: the hypothesis: why this knob should help (logged).
        """
        cur, new = asdict(self.current), asdict(session["config"])
        changed = [k for k in new if cur[k] != new[k]]
        if changed != [knob]:
            raise ValueError(f"trial must change exactly {knob!r} from the kept config; it changes {changed}")
        (b, metric), (a, _) = _target(self.best, target), _target(session, target)
        if metric is not None:
            d = decide(b, a, metric, goal=goal, floor=self.floor(target), pair_by=pairing(metric))
        else:
            better = a < 0.99 * b if goal == "lower" else a > 1.01 * b
            d = {"metric": target, "q": None, "before": b, "after": a, "change": a / b - 1 if b else math.nan,
                 "decision": "keep" if better else "revert",
                 "why": "better (a deterministic reading)" if better else "not better"}
        gb, gm = _target(self.best, self.guard)
        g = decide(gb, _target(session, self.guard)[0], gm, floor=self.floor(self.guard), pair_by=pairing(gm))
        d["guard"] = f"{self.guard} median {g['before']:.3g} -> {g['after']:.3g} ({g['why'].split(':')[0].split(' (')[0]})"
        if d["decision"] == "keep" and g["why"].startswith("worse beyond noise") and target != self.guard:
            d.update(decision="revert", why=f"target better, but {self.guard} worse beyond noise")
        entry = self._append({"trial": f"{knob}={new[knob]}", "knob": knob, "from": cur[knob], "to": new[knob],
                              "config": new, "run_dirs": self._dirs(session), "target": target,
                              "expected": expected, **d})
        if d["decision"] == "keep":
            self.best = session
        return entry

    def frame(self) -> pd.DataFrame:
        """The log as a table, oldest first (read back from disk: what a colleague sees)."""
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        cols = ["trial", "target", "paired_by", "before", "after", "change", "ratio_ci", "floor", "guard", "decision",
                "why", "expected"]
        return pd.DataFrame(rows).reindex(columns=cols)


def explain_log(frame: pd.DataFrame) -> str:
    """One computed line per trial of a `TuningLog.frame()`: what moved (medians; for paired
    targets the ratio's interval and the A/A floor), and the decision with its reason (so
    the Explain text never claims an outcome)."""
    lines = []
    for _, r in frame[frame["decision"] != "baseline"].iterrows():
        ci = r.get("ratio_ci")
        # paired: the change is the median of the per-request ratios, which is not the ratio
        # of the two medians (14 printed "12.4 -> 7.38 (-28%)" with no word on which)
        by = {"place": " by place in the queue", "request": " by request"}.get(r.get("paired_by"), "")
        paired = (f"median paired change{by} {r['change']:+.0%}, interval [{ci[0]:.2f}, {ci[1]:.2f}], "
                  f"A/A floor ±{r['floor']:.0%}" if isinstance(ci, (list, tuple)) else f"{r['change']:+.0%}")
        lines.append(f"- `{r['trial']}` on {r['target']}: {r['before']:.3g} → {r['after']:.3g} "
                     f"({'medians; ' if isinstance(ci, (list, tuple)) else ''}{paired}): "
                     f"**{r['decision']}**, {r['why']}.")
    return "\n".join(lines) or "No trials ran."



"""Routing by model name: one URL, several models, and what switching between them costs
(notebook 16, its routing half).

A coding agent talks to two models: its main loop to one (Claude Code: a Sonnet ID) and
its small background calls to another (a Haiku ID, `ANTHROPIC_DEFAULT_HAIKU_MODEL`).
llama-server's router mode (`servers.llama_router`) serves both behind one URL, by name
or alias, loading each on demand. What it costs depends on how many fit at once:

- `alias_routing`: which names answer, and what an unknown name gets (HTTP 400);
- `swap_trials`: the same alternating requests at `models_max` 2 (both resident) and 1
  (every switch reloads), in interleaved, shuffled blocks with an A/A rerun of the resident
  arm; the loads as the router's own log times them (`load_times`), and the memory held;
- `sleep_trials`: a model freed after idle seconds pays a reload on its next request
  (what Ollama's `OLLAMA_KEEP_ALIVE` does after 5 minutes), against the same model awake;
- `mixed_trials`: an agent's mix (80 % main, 20 % fast) through `bench` at both settings,
  and `service_by_model`: each model's call time with both resident (capacity per model).

A killed model instance, and what other routers do with model names, are
`lessons.model_failover`; a second model family behind the router, and what each family's chat
template makes of a tool call, `lessons.families` and `lessons.templates`. One timed request
by name is `measure.model_mix.ask`.

The `*_text` functions turn a run's numbers into the notebook's sentences, so what a
sentence says (faster, within noise) comes from the numbers, judged against their A/A
floor (`measure.noise`); a tail percentile is judged only where every trial has the
samples its interval needs. Each measuring function starts its own routers (1 thread,
small context by default: `router_kw` goes to `servers.llama_router.course_router`) and
stops them.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import pandas as pd

from infercourse.core.errors import InferCourseError
from infercourse.core.summary import min_n
from infercourse.core.types import Request
from infercourse.measure import noise
from infercourse.measure.model_mix import ASK_PROMPT, ask
from infercourse.servers.llama_router import ROUTER_DEFAULTS, LlamaRouter, course_router, load_times  # noqa: F401

__all__ = ["ask", "alias_routing", "alias_text", "load_times", "swap_trials", "per_trial", "judge",
           "swap_penalty_s", "swap_text", "read_gb_s", "guess_text", "sleep_trials", "sleep_text",
           "mixed_trials", "mixed_table", "mixed_text", "service_by_model", "ROUTER_DEFAULTS", "SWAP_ARMS",
           "SLEEP_ARMS", "MIX_ARMS"]

SWAP_ARMS = ("resident", "resident A/A", "swap")
SLEEP_ARMS = ("awake", "awake A/A", "after sleep")
MIX_ARMS = ("models_max 2", "models_max 2 A/A", "models_max 1")
_MIB = 2 ** 20


def _loaded(router: LlamaRouter) -> list[str]:
    return [m["name"] for m in router.models() if m["status"] == "loaded"]


def _rss_mib(router: LlamaRouter) -> float:
    return sum(v or 0 for v in router.memory().values()) / _MIB


def alias_routing(router: LlamaRouter | None = None, names: Iterable[str] | None = None,
                  **router_kw: Any) -> pd.DataFrame:
    """Ask every model name and alias once, then an unknown name: who answered, or the error.

    Args:
        router: a started LlamaRouter (None: start the course's two models, models_max 2).
        names: names to ask (default: each preset's name, its aliases, and "nonexistent-model").
    """
    if router is None:
        with course_router(2, None, **router_kw) as r:
            return alias_routing(r, names)
    names = list(names) if names is not None else \
        [n for p in router.presets for n in (p.name, *p.aliases)] + ["nonexistent-model"]
    rows = []
    for n in names:
        row = ask(router, n)
        try:
            row["served_by"] = router.model_status(n)["name"]
        except InferCourseError:
            row["served_by"] = None
        rows.append(row)
    return pd.DataFrame(rows).set_index("asked")


def alias_text(table: pd.DataFrame) -> str:
    """Which model each name reached, and what a name no preset has got (and which layer the
    error names), from `alias_routing`'s table."""
    lines = []
    for name, r in table.iterrows():
        if r["status"] == "ok":
            lines.append(f"- `{name}` reached **{r['served_by'] or 'no preset (yet it answered)'}**")
        else:
            lines.append(f"- `{name}` **failed** at the {r['layer'] or 'unnamed'} layer: {r['error']}")
    ok = int((table["status"] == "ok").sum())
    return f"{ok} of {len(table)} names answered.\n" + "\n".join(lines)


def _state(router: LlamaRouter, model: str) -> str:
    loaded, name = _loaded(router), router.model_status(model)["name"]
    if name in loaded:
        return "resident"
    return "swap" if router.models_max and len(loaded) >= router.models_max else "cold"


def _warm(routers: Iterable[LlamaRouter], models: Sequence[str], max_tokens: int) -> None:
    for r in routers:   # both resident at models_max 2; the last model left loaded at 1
        for m in models:
            ask(r, m, max_tokens=max_tokens)


def swap_trials(presets=None, *, repeats: int = 4, sequence: Sequence[str] = ("fast", "main"),
                max_tokens: int = 8, **router_kw: Any) -> dict[str, Any]:
    """The same alternating `sequence` on two routers at once, in shuffled blocks: models_max 2
    (arm "resident" and its A/A rerun "resident A/A") and models_max 1 (arm "swap": every
    switch evicts one model and loads the other).

    Returns {"requests": one row per request (block, arm, model, state before it, TTFT...),
    "rss_mib": {models_max: resident MiB of router + children at the end}, "held":
    {models_max: models loaded then}, "loads": the swapping router's loads (`load_times`)}.
    """
    with course_router(2, presets, **router_kw) as both, course_router(1, presets, **router_kw) as one:
        routers = dict(zip(SWAP_ARMS, (both, both, one)))
        _warm((both, one), sequence, max_tokens)
        rows = []
        for block, arm in noise.schedule(SWAP_ARMS, repeats):
            r = routers[arm]
            for i, m in enumerate(sequence):
                state = _state(r, m)
                rows.append({"block": block, "arm": arm, "models_max": r.models_max, "step": i, "model": m,
                             "state": state, **ask(r, m, max_tokens=max_tokens)})
        return {"requests": pd.DataFrame(rows), "rss_mib": {2: _rss_mib(both), 1: _rss_mib(one)},
                "held": {2: _loaded(both), 1: _loaded(one)},
                "loads": load_times(one.log_path.read_text(errors="replace"))}


def per_trial(requests: pd.DataFrame, metric: str = "ttft_s", q: float = 0.5,
              arms: Sequence[str] | None = None) -> pd.DataFrame:
    """One number per trial: the `q` quantile of `metric` over the trial's ok requests. Index
    block, one column per arm: `arms` (reference, its A/A rerun, the other), else the order
    they first ran. A trial with no ok request is NaN, and its pair drops out of the test."""
    ok = requests[requests["status"] == "ok"]
    wide = ok.groupby(["block", "arm"])[metric].quantile(q).unstack("arm")
    cols = list(arms) if arms is not None else list(dict.fromkeys(requests["arm"]))
    return wide.reindex(index=sorted(requests["block"].unique()), columns=cols)


def judge(wide: pd.DataFrame) -> tuple[noise.NoiseFloor, noise.Comparison]:
    """The A/A floor of the first arm (its rerun is the second column) and the verdict on the
    third arm against the first (a paired permutation test: `noise.compare`)."""
    a, a2, b = wide.columns[:3]
    floor = noise.noise_floor(wide[a], wide[a2])
    return floor, noise.compare(wide[a], wide[b], floor, labels=(a, b))


def _verdict_lines(wide: pd.DataFrame, what: str, a_wins: str, b_wins: str, neither: str) -> list[str]:
    """A headline chosen by the verdict (each template may use {a} {b}: the arms' median
    trial values in s, {what}), then the floor and the test behind it."""
    floor, cmp = judge(wide)
    a, _, b = wide.columns[:3]
    ma, mb = float(wide[a].median()), float(wide[b].median())
    head = {f"{a} faster": a_wins, f"{b} faster": b_wins}.get(cmp.verdict, neither)
    if cmp.too_few:
        the = "" if what.startswith("the ") else "the "   # "the mix's TTFT p50" carries its own
        head = f"- **No verdict on {the}{{what}}** ({b}: {{b}}, {a}: {{a}}): {cmp.said}; this run cannot rank them."
    return [head.format(a=f"{ma:.3g} s", b=f"{mb:.3g} s", what=what), f"  - {floor.text()}",
            f"  - {cmp.text}"]


def swap_penalty_s(requests: pd.DataFrame) -> float:
    """Median TTFT of the requests that swapped their model in, minus that of resident ones."""
    ok = requests[requests["status"] == "ok"]
    by_state = ok.groupby("state")["ttft_s"].median()
    return float(by_state.get("swap", float("nan")) - by_state.get("resident", float("nan")))


def swap_text(result: Mapping[str, Any]) -> str:
    """What `swap_trials` showed: the verdict on swapping against both resident, the loads
    the router's log timed, and the memory keeping both costs."""
    req, rss, held = result["requests"], result["rss_mib"], result["held"]
    lines = _verdict_lines(
        per_trial(req, arms=SWAP_ARMS), "median TTFT per trial",
        "- **Swapping cost time**: with models_max 1 every switch reloaded: {what} {b}, against {a} with "
        "both resident.",
        "- **The swap arm came out faster** ({what} {b} against {a} resident): a reload cannot speed a request up, "
        "so something else moved between trials; read the contention line.",
        "- **The swap penalty did not clear the A/A floor** here ({what} {b} swapping, {a} resident).")
    loads = result["loads"].groupby("model")["loaded_s"].agg(["median", "size"])
    if len(loads):
        lines.append("- The router's log timed each load (child start to \"model loaded\"): " + ", ".join(
            f"{m} {r['median']:.3g} s (median of {int(r['size'])})" for m, r in loads.iterrows()))
    extra = rss[2] - rss[1]
    keep = (f"keeping the second model resident costs {extra:.0f} MiB" if extra > 0
            else f"keeping both cost no extra resident memory that was measured ({extra:+.0f} MiB)")
    lines.append(f"- Resident memory: {rss[2]:.0f} MiB with {', '.join(held[2]) or 'nothing'} loaded "
                 f"(models_max 2), {rss[1]:.0f} MiB with {', '.join(held[1]) or 'nothing'} (models_max 1): {keep}.")
    return "\n".join(lines)


def read_gb_s(path: str | Path, chunk: int = 16 << 20) -> float:
    """GB/s reading `path` twice and timing the second read (the file is then in the page
    cache, as it is when a router reloads a model it evicted a moment ago)."""
    buf = memoryview(bytearray(chunk))
    for _ in range(2):   # the first read fills the page cache; the second is timed
        t0, n = time.perf_counter(), 0
        with open(path, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
    return n / (time.perf_counter() - t0) / 1e9


def guess_text(guess_s: float | None, floor_s: float, measured_s: float) -> str:
    """Score the learner's swap-penalty guess against the measured penalty (`swap_penalty_s`)
    and the bandwidth floor (file size / read bandwidth)."""
    if guess_s is None:
        return "No guess recorded: set `MY_GUESS_SWAP_S` in the Predict cell, rerun, and compare."
    if not measured_s > 0:
        return (f"The measured swap penalty is {measured_s:.3g} s, not a positive cost: there is no penalty "
                "to score your guess against here (read the verdict above).")
    r = guess_s / measured_s
    how = ("close (within x1.5)" if max(r, 1 / r) <= 1.5 else
           f"{'too high' if r > 1 else 'too low'} by x{max(r, 1 / r):.2g}")
    rest = (f"the load took {measured_s / floor_s:.2g}x what reading the file costs: the rest is starting a "
            "process, parsing the file, allocating the KV cache and warming up" if measured_s > floor_s else
            "the load beat a full read of the file (it is mmapped: a page is read only when touched)")
    return (f"Your guess {guess_s:.3g} s; bandwidth floor {floor_s:.3g} s; measured swap penalty "
            f"{measured_s:.3g} s. Your guess was {how}; {rest}.")


def sleep_trials(presets=None, *, model: str = "fast", sleep_idle_s: int = 1, repeats: int = 4,
                 max_tokens: int = 8, **router_kw: Any) -> dict[str, Any]:
    """Shuffled blocks of a request to `model` awake, its A/A rerun, and one after the model fell
    asleep: we wait until the router reports "sleeping" (an event, not a clock).

    Returns {"requests": one row per request with the status it found, "rss_awake_mib",
    "rss_asleep_mib", "sleep_idle_s"}.
    """
    rows, rss = [], {}
    with course_router(1, presets, sleep_idle_s=sleep_idle_s, **router_kw) as r:
        ask(r, model, max_tokens=max_tokens)   # load it
        for block, arm in noise.schedule(SLEEP_ARMS, repeats):
            if arm == "after sleep":
                r.wait_status(model, ("sleeping",), timeout_s=sleep_idle_s * 10 + 60)
            key = "asleep" if arm == "after sleep" else "awake"
            rss.setdefault(key, _rss_mib(r))
            found = r.model_status(model)["status"]
            rows.append({"block": block, "arm": arm, "found": found, **ask(r, model, max_tokens=max_tokens)})
    return {"requests": pd.DataFrame(rows), "rss_awake_mib": rss["awake"], "rss_asleep_mib": rss["asleep"],
            "sleep_idle_s": sleep_idle_s}


def sleep_text(result: Mapping[str, Any]) -> str:
    """What `sleep_trials` showed: the stall after a break against the same model awake, and
    the memory that keeping it awake holds."""
    req, s = result["requests"], result["sleep_idle_s"]
    lines = _verdict_lines(
        per_trial(req, arms=SLEEP_ARMS), "median TTFT",
        "- **A user back from a break waits**: after " + f"{s} idle s" + " the {what} was {b}, against {a} awake.",
        "- **The request after sleep came out faster** ({what} {b} against {a} awake): waking cannot speed a "
        "request up, so something else moved; read the contention line.",
        "- **The wake-up stall did not clear the A/A floor** here ({what} {b} after sleep, {a} awake).")
    dozed = int(((req["arm"] != "after sleep") & (req["found"] != "loaded")).sum())
    if dozed:
        lines.append(f"- {dozed} 'awake' request(s) found the model {', '.join(set(req['found']) - {'loaded'})}: "
                     "the machine was slow enough between requests for the idle timer to fire.")
    freed = result["rss_awake_mib"] - result["rss_asleep_mib"]
    lines.append(f"- Awake {result['rss_awake_mib']:.0f} MiB, asleep {result['rss_asleep_mib']:.0f} MiB: " + (
        f"staying awake (no `--sleep-idle-seconds`, or a request every < {s} s) holds {freed:.0f} MiB that sleep frees."
        if freed > 0 else
        f"sleep freed no resident memory measured here ({freed:+.0f} MiB), so staying awake costs none."))
    return "\n".join(lines)


def mixed_trials(presets=None, *, shares: Mapping[str, float] | None = None, repeats: int = 4, n: int = 10,
                 max_tokens: int = 8, concurrency: int = 1, seed: int = 0, out_dir: str | Path | None = None,
                 **router_kw: Any) -> pd.DataFrame:
    """An agent's mix of models (default 80 % main, 20 % fast) through `bench.run`, in shuffled
    blocks: models_max 2, its A/A rerun, and models_max 1 (each switch in the mix a swap).
    Block i sends the same assignment of models to every arm (bench salts each run's
    prompts, so no trial hits another's prefix). One row per request, with block and arm."""
    from infercourse.measure import bench
    from infercourse.measure.model_mix import mix
    shares = shares or {"main": 0.8, "fast": 0.2}
    frames = []
    with course_router(2, presets, **router_kw) as both, course_router(1, presets, **router_kw) as one:
        routers = dict(zip(MIX_ARMS, (both, both, one)))
        _warm((both, one), list(shares), max_tokens)
        for block, arm in noise.schedule(MIX_ARMS, repeats):
            r, label = routers[arm], f"mix-{arm.replace(' ', '-').replace('/', '')}-b{block}"
            reqs = mix([Request(messages=[{"role": "user", "content": f"Question {i}: {ASK_PROMPT}"}],
                                max_tokens=max_tokens) for i in range(n)], shares, seed=seed + block)
            res = bench.run(r.engine(), reqs, pattern="concurrency" if concurrency > 1 else "sequential",
                            concurrency=concurrency, warmup=0, progress=False, seed=seed, label=label,
                            out_dir=Path(out_dir) / label if out_dir else None, conditions={"router": r.describe()})
            frames.append(res.df.assign(block=block, arm=arm, models_max=r.models_max))
    return pd.concat(frames, ignore_index=True)


def mixed_table(df: pd.DataFrame) -> pd.DataFrame:
    """TTFT p50 / p95 by model (and "all") at each models_max, pooled over its trials (the
    A/A rerun left out so both settings count the same requests); a p95 of fewer ok
    requests than its interval needs (`summary.min_n`: 72) is left out (NaN)."""
    from infercourse.measure.model_mix import by_model
    cols, out, p95 = ["n_ok", "n_total", "ttft_s_p50", "ttft_s_p95"], [], f"ttft_s_p95 (NaN: n < {min_n(0.95)})"
    for arm in (MIX_ARMS[0], MIX_ARMS[2]):
        g = df[df["arm"] == arm]
        t = by_model(g, ("ttft_s",), ("p50", "p95"))[cols]
        t.loc["all"] = by_model(g.drop(columns=["model"]), ("ttft_s",), ("p50", "p95"))[cols].iloc[0]
        t[p95] = t.pop("ttft_s_p95").where(t["n_ok"] >= min_n(0.95))
        out.append(t.assign(models_max=int(g["models_max"].iloc[0])).reset_index())
    return pd.concat(out, ignore_index=True).set_index(["models_max", "model"])


def mixed_text(df: pd.DataFrame) -> str:
    """The mix's TTFT p50 and p95 at models_max 1 against 2, each judged against its A/A
    floor; a tail percentile only when every trial has the ok requests its interval needs
    (`summary.min_n`: a p95 of 10 requests is their maximum), else "n too small"."""
    lines, ok = [], df[df["status"] == "ok"]
    fewest = int(ok.groupby(["block", "arm"]).size().reindex(
        pd.MultiIndex.from_product([sorted(df["block"].unique()), MIX_ARMS]), fill_value=0).min())
    for q, name in ((0.5, "TTFT p50"), (0.95, "TTFT p95")):
        if q > 0.5 and fewest < min_n(q):
            lines.append(f"- **No verdict on the mix's {name}**: n too small for a p{q * 100:.0f}: a trial had as few "
                         f"as {fewest} ok request(s), and a p{q * 100:.0f} needs {min_n(q)} for its interval "
                         "(more `MIX_REQUESTS` per trial).")
            continue
        lines += _verdict_lines(
            per_trial(df, "ttft_s", q, MIX_ARMS), f"the mix's {name} (median over trials)",
            "- **Both resident beat swapping** on {what}: {a} at models_max 2, {b} at models_max 1.",
            "- **Swapping came out faster** on {what} ({b} against {a}): a reload cannot speed a request up; "
            "read the contention line.",
            "- **No difference beyond the A/A floor** on {what}: {a} at models_max 2, {b} at models_max 1.")
    return "\n".join(lines)


def service_by_model(df: pd.DataFrame, arm: str = MIX_ARMS[0]) -> dict[str, float]:
    """Mean end-to-end seconds of each model's ok requests in one arm of `mixed_trials`
    (default both resident: a call's service time with no reload in it)."""
    ok = df[(df["arm"] == arm) & (df["status"] == "ok")]
    return {str(m): float(v) for m, v in ok.groupby("model")["e2e_s"].mean().items()}

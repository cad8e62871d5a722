"""Routing by model name: one URL, several models, and what switching between them costs
(notebook 19, its routing half).

A coding agent talks to two models: its main loop to one (Claude Code: a Sonnet ID) and
its small background calls to another (a Haiku ID, `ANTHROPIC_DEFAULT_HAIKU_MODEL`).
llama-server's router mode (`servers.llama_router`) serves both behind one URL, by name
or alias, loading each on demand. What it costs depends on how many fit at once:

- `alias_routing`: which names answer, and what an unknown name gets (HTTP 400);
- `swap_cost`: TTFT of a cold load, a swap and a resident model, and the memory held, at
  `models_max` 1 (every switch reloads) and 2 (both stay);
- `idle_sleep_stall`: a model freed after idle seconds pays a reload on its next request
  (what Ollama's `OLLAMA_KEEP_ALIVE` does after 5 minutes);
- `mixed_workload`: a mix (80 % main, 20 % fast) at both settings, every metric by model;
- `killed_instance`: SIGKILL one model's instance mid-stream: what the request in flight
  gets, what the router says, and what the next request pays.

Each function starts its own router (1 thread, small context by default: `router_kw`
goes to `LlamaRouter`) and stops it, so a notebook cell is one call.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Iterator, Mapping, Sequence

import pandas as pd

from infercourse.core import metrics
from infercourse.core.errors import InferCourseError
from infercourse.core.trace import record, record_stream
from infercourse.core.types import Request
from infercourse.servers.llama_router import LlamaRouter, course_presets

__all__ = ["ask", "alias_routing", "swap_cost", "idle_sleep_stall", "mixed_workload", "killed_instance",
           "ROUTER_DEFAULTS"]

ROUTER_DEFAULTS = {"threads": 1, "ctx_size": 1024, "n_parallel": 1}
_PROMPT = "Name one colour of the sky."
_MIB = 2 ** 20


def _router(presets, models_max: int, **router_kw: Any) -> LlamaRouter:
    return LlamaRouter(presets if presets is not None else course_presets(), models_max=models_max,
                       **{**ROUTER_DEFAULTS, **router_kw})


def ask(router: LlamaRouter, model: str, *, prompt: str = _PROMPT, max_tokens: int = 8,
        api: str = "anthropic") -> dict[str, Any]:
    """One request to `model` (a name or alias) through the router, timed as bench times it:
    status, TTFT, end-to-end, output tokens, and the error if any."""
    eng = router.engine(model=model, api=api)
    tr = record(eng, Request(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens))
    return {"asked": model, "status": tr.status, "ttft_s": metrics.ttft_s(tr), "e2e_s": metrics.e2e_s(tr),
            "output_tokens": metrics.output_tokens(tr), "error": (tr.error or "")[:160] or None}


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
        with _router(None, 2, **router_kw) as r:
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


def _state(router: LlamaRouter, model: str) -> str:
    loaded, name = _loaded(router), router.model_status(model)["name"]
    if name in loaded:
        return "resident"
    return "swap" if router.models_max and len(loaded) >= router.models_max else "cold"


def swap_cost(presets=None, *, models_max: Sequence[int] = (1, 2),
              sequence: Sequence[str] = ("fast", "main", "fast", "fast", "main", "main"),
              **router_kw: Any) -> pd.DataFrame:
    """The same sequence of requests at each `models_max`: per request, whether its model was
    cold (nothing to evict), swapped in (evicting another) or resident, its TTFT and
    end-to-end, and the resident memory (router + children) after it.

    Args:
        presets: the models (default: course_presets(): main = F16, fast = Q4_K_M).
        models_max: the settings compared (a fresh router each).
        sequence: model names or aliases, in order.
    """
    rows = []
    for mm in models_max:
        with _router(presets, mm, **router_kw) as r:
            for i, m in enumerate(sequence):
                state = _state(r, m)
                row = ask(r, m)
                rows.append({"models_max": mm, "step": i, "model": m, "state": state, **row,
                             "loaded_after": ",".join(_loaded(r)), "rss_mib": _rss_mib(r)})
    return pd.DataFrame(rows).drop(columns=["asked"])


def idle_sleep_stall(presets=None, *, model: str = "fast", sleep_idle_s: int = 2,
                     **router_kw: Any) -> dict[str, Any]:
    """TTFT of a resident model, then of the same model after it fell asleep (the router
    reports "sleeping" once `sleep_idle_s` idle seconds have passed: we wait for that event,
    not a clock), and the memory held awake and asleep."""
    with _router(presets, 1, sleep_idle_s=sleep_idle_s, **router_kw) as r:
        ask(r, model)                      # load it
        awake = ask(r, model)              # resident
        rss_awake = _rss_mib(r)
        t0 = time.perf_counter()
        r.wait_status(model, ("sleeping",), timeout_s=sleep_idle_s * 10 + 60)
        fell_asleep_s = time.perf_counter() - t0
        rss_asleep = _rss_mib(r)
        woke = ask(r, model)
        return {"model": model, "sleep_idle_s": sleep_idle_s, "resident_ttft_s": awake["ttft_s"],
                "after_sleep_ttft_s": woke["ttft_s"], "stall_s": woke["ttft_s"] - awake["ttft_s"],
                "asleep_after_s": fell_asleep_s, "rss_awake_mib": rss_awake, "rss_asleep_mib": rss_asleep,
                "status_after": r.model_status(model)["status"]}


def mixed_workload(presets=None, *, shares: Mapping[str, float] | None = None,
                   models_max: Sequence[int] = (1, 2), n: int = 20, concurrency: int = 1,
                   max_tokens: int = 16, seed: int = 0, **router_kw: Any) -> pd.DataFrame:
    """A mix of models (default 80 % main, 20 % fast) through `bench.run` at each
    `models_max`: one row per (models_max, model), plus "all", with request counts and
    TTFT / e2e p50 and p95. At models_max 1 every switch in the mix is a swap."""
    from infercourse.measure import bench
    from infercourse.measure.model_mix import by_model, mix
    shares = shares or {"main": 0.8, "fast": 0.2}
    reqs = mix([Request(messages=[{"role": "user", "content": f"Question {i}: {_PROMPT}"}], max_tokens=max_tokens)
                for i in range(n)], shares, seed=seed)
    out = []
    for mm in models_max:
        with _router(presets, mm, **router_kw) as r:
            res = bench.run(r.engine(), reqs, pattern="concurrency" if concurrency > 1 else "sequential",
                            concurrency=concurrency, warmup=0, progress=False, seed=seed,
                            label=f"mix-models-max-{mm}", conditions={"router": r.describe()})
        cols = ["n_ok", "n_total", "ttft_s_p50", "ttft_s_p95", "e2e_s_p50", "e2e_s_p95"]
        t = by_model(res.df, ("ttft_s", "e2e_s"), ("p50", "p95"))[cols]
        whole = by_model(res.df.drop(columns=["model"]), ("ttft_s", "e2e_s"), ("p50", "p95"))[cols]
        t.loc["all"] = whole.iloc[0]
        out.append(t.assign(models_max=mm, run_dir=str(res.dir)).reset_index())
    return pd.concat(out, ignore_index=True).set_index(["models_max", "model"])


def _kill_after_first_chunk(stream: Iterator, router: LlamaRouter, model: str, box: dict) -> Iterator:
    for ev in stream:
        yield ev
        if "pid" not in box:   # an event, not a clock: the instance is mid-stream right now
            box["pid"] = router.kill_instance(model)


def killed_instance(presets=None, *, model: str = "main", n_after: int = 3, **router_kw: Any) -> dict[str, Any]:
    """SIGKILL `model`'s instance while it streams an answer: what that request got, what
    the router reports (`check()`), whether it stayed up, and what the next requests pay
    (the first reloads the model, the rest find it resident)."""
    with _router(presets, 1, **router_kw) as r:
        ask(r, model)
        resident = ask(r, model)
        box: dict[str, Any] = {}
        eng = r.engine(model=model, api="anthropic")
        req = Request(messages=[{"role": "user", "content": "Write a long story about the sea."}], max_tokens=256)
        tr = record_stream(_kill_after_first_chunk(eng.stream(req), r, model, box))
        r.wait_status(model, ("unloaded",))   # the router saw its child die
        try:
            r.check()
            said = None
        except InferCourseError as e:
            said = e.message
        after = [ask(r, model) for _ in range(n_after)]
        return {"model": model, "killed_pid": box.get("pid"), "in_flight_status": tr.status,
                "in_flight_tokens": metrics.output_tokens(tr), "in_flight_error": (tr.error or "")[:200] or None,
                "router_said": said, "router_up": r.running,
                "resident_ttft_s": resident["ttft_s"], "reload_ttft_s": after[0]["ttft_s"],
                "reload_cost_s": after[0]["ttft_s"] - resident["ttft_s"],
                "after_ttft_s": [a["ttft_s"] for a in after], "after_ok": sum(a["status"] == "ok" for a in after),
                "status_now": r.model_status(model)["status"]}

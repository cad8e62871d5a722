"""Load generation that cannot lie: schedules, warm-up, coordinated omission, self-checks.

Every request gets a *scheduled* send time from the load pattern before anything is sent,
and latency is measured from it: a client (or a server) that falls behind shows up as
latency instead of silently slowing the request rate (the "coordinated omission" trap).
The gap between scheduled and actual send is kept per request as the dispatch delay.

Patterns, all bounded by a request count and optionally a duration:
- closed loop: `sequential` (one at a time) and `concurrency` (N workers; a worker's next
  request is scheduled the moment its previous one finishes);
- open loop: `rate` (constant spacing), `poisson` (seeded exponential gaps) and `replay`
  (offsets recorded with a trace); requests go out on time whether or not earlier ones
  have finished.

HTTP engines (those with `astream`) run on one asyncio event loop with one
`httpx.AsyncClient` whose pool fits the concurrency; the loop lives in a worker thread
so the same code works in a script and in a notebook (whose kernel already runs a loop),
and Ctrl-C in the main thread cancels it cleanly. In-process engines run one request at
a time, and the manifest says so. Each finished request goes to `results.RunWriter`'s
writer thread (JSON, fsync and the progress bar stay off the event loop, whose clock
stamps every other stream), and is on disk one fsync later: an interrupt or a dead
server loses nothing finished.

Requests the run did not finish are kept, not dropped. A request in flight when a
deadline, a dead server or Ctrl-C ends the run is a row with status "incomplete" and
the chunks it had received; one due but still queued at the in-flight cap is
"incomplete" and never sent. Convention: like GuideLLM, incomplete requests are counted
apart from errors and from successes (`report_lines`: ok / error / incomplete), and the
percentiles are of ok requests; unlike a tool that discards them, every row is in the
frame and on disk, so a latency view that includes them (their latencies are lower
bounds: they would have taken at least that long) is one filter away. We keep them
apart rather than folding them into "error" because nothing failed: the run stopped.

Cache hygiene: a server keeps prompts it has seen, so a second identical run can be
served from its cache and look many times faster. Unless the workload is a cache
workload (`Workload.cache_workload`: shared prefixes, agentic replay), each prompt starts
with a fresh per-run salt, so nothing is reused across runs; warm-up requests have the
measured ones' shape but share no prefix with them; every summary prints the cached /
prompt tokens (`report_lines`).

The client watches itself (CPU per wall second, dispatch delay): when the load generator
rather than the server is the bottleneck, the result carries a warning saying so.
`roofline.chunks_per_second` measures the client's own ceiling on streamed chunks.
"""
from __future__ import annotations

import datetime as _dt
import secrets
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import psutil

from infercourse.core.errors import APILayerError, EngineLayerError, ServerLayerError
from infercourse.core.loopback import is_loopback
from infercourse.core.trace import RequestTrace
from infercourse.core.types import Request
from infercourse.measure.server_samples import ServerSampler, sampled_summary
from infercourse.measure.model_mix import ModelDispatch, ModelWorkload, request_models
from infercourse.measure.loadgen import (
    State,
    constant_schedule,
    loop_in_thread,
    poisson_schedule,
    run_async,
    run_sync,
    self_check,
    server_address,
)

__all__ = ["BenchResult", "run", "sweep", "replay", "constant_schedule", "poisson_schedule",
           "loop_in_thread", "new_salt", "salted", "warmup_request", "server_sampler", "PATTERNS",
           "MAX_REQUESTS"]

PATTERNS = ("sequential", "concurrency", "rate", "poisson", "replay")
MAX_REQUESTS = 100_000          # a hard bound: no run is open-ended


@dataclass
class BenchResult:
    """One run: raw traces, one row per request, summary, conditions, where it is on disk."""

    traces: list[RequestTrace]
    df: Any                      # pandas DataFrame, metrics.per_request_frame
    summary: Any                 # pandas DataFrame, summary.summarize
    manifest: dict[str, Any]
    dir: Path

    @property
    def warnings(self) -> list[str]:
        return self.manifest.get("warnings", [])

    @property
    def by_model(self):
        """Every metric split by the model each request named (`model_mix.by_model`)."""
        from infercourse.measure.model_mix import by_model
        return by_model(self.df)

    def report(self, slos: dict[str, float] | None = None) -> str:
        """Requests by status, prompt-cache hits, goodput for `slos`, warnings: one per line."""
        from infercourse.measure.results import report_lines
        return "\n".join(report_lines(self.df, slos) + [f"WARNING: {w}" for w in self.warnings])


def new_salt() -> str:
    """A fresh per-run salt (8 random hex digits)."""
    return secrets.token_hex(4)


def salted(req: Request, salt: str) -> Request:
    """`req` with `salt` and a newline at the very start of its prompt (or of its first
    message): no prefix cache can match it with a prompt from another run."""
    if req.prompt is not None:
        return replace(req, prompt=f"{salt}\n{req.prompt}")
    first, *rest = req.messages
    if isinstance(first["content"], list):   # Anthropic-style blocks: the salt is a block first
        return replace(req, messages=[{**first, "content": [{"type": "text", "text": f"{salt}\n"},
                                                            *first["content"]]}, *rest])
    return replace(req, messages=[{**first, "content": f"{salt}\n{first['content']}"}, *rest])


def warmup_request(req: Request, k: int = 0) -> Request:
    """A warm-up twin of `req`: same API, sampling and max tokens, about the same length,
    but its words reversed behind a "Warm-up" tag, so it shares no prefix with any measured
    prompt (warming up with a measured prompt would hand that one a cache hit)."""
    flip = lambda s: f"Warm-up {k}. " + " ".join(reversed(s.split()))  # noqa: E731
    if req.prompt is not None:
        return replace(req, prompt=flip(req.prompt))
    return replace(req, messages=[{**m, "content": _map_text(m.get("content"), flip)} for m in req.messages])


def _map_text(content: Any, f) -> Any:
    """`f` applied to a message's text; Anthropic-style content is a list of blocks whose
    `text` / `content` fields are changed, their structure (tool_use ids) kept."""
    if isinstance(content, list):
        return [{**b, **{k: _map_text(b[k], f) for k in ("text", "content") if k in b}}
                if isinstance(b, dict) else b for b in content]
    return f(content) if isinstance(content, str) else content


def server_sampler(engine, out: Path, interval_s: float | None):
    """A `ServerSampler` on the engine's server (not started), or None (no URL, or off).
    A run starts it after its warm-up, so its counters' baseline excludes the warm-up."""
    root = getattr(engine, "root", None)
    return ServerSampler(root, None, out, interval_s=interval_s) if root and interval_s else None


def run(engine, workload, *, pattern: str = "sequential", concurrency: int = 1,
        rate_rps: float | None = None, offsets_s: Sequence[float] | None = None, seed: int = 0,
        warmup: int = 1, max_requests: int | None = None, max_duration_s: float | None = None,
        ignore_eos: bool | None = None, max_in_flight: int = 256, out_dir: str | Path | None = None,
        label: str | None = None, progress: bool = True, allow_remote: bool = False,
        conditions: dict[str, Any] | None = None, salt: bool | str | None = None,
        write_inline: bool = False, sample_s: float | None = 1.0) -> BenchResult:
    """Run one load pattern against an engine and record every request.

    Args:
        engine: an HTTP engine (has `astream`: concurrent) or an in-process one (sequential).
        workload: a `workloads.Workload` or a list of `Request`s (cycled up to max_requests);
            `model_mix.ModelRequest`s each go to the model they name, a `model` column.
        pattern: one of PATTERNS.
        concurrency: workers for "concurrency" (downgraded to 1 for in-process engines).
        rate_rps: requests per second for "rate" and "poisson".
        offsets_s: send offsets for "replay" (default: the workload's own).
        seed: seeds the Poisson schedule (and is recorded).
        warmup: requests run first on the same path and excluded from the results.
        max_requests / max_duration_s: bounds; no new request is sent past either.
        ignore_eos: force every request to its max_tokens (None: leave requests as given).
        max_in_flight: open-loop cap on concurrent requests (client pool size).
        out_dir: results folder (default: cache_dir()/runs/<time>_<pattern>).
        allow_remote: permit a non-loopback server (off: load tests stay on this machine).
        conditions: extra manifest entries (e.g. server flags).
        salt: None salts every prompt with a fresh per-run salt unless the workload is a
            cache workload (or no request allows caching); True / False force it; a string
            is used as the salt (e.g. prompts built to an exact length with it included).
        sample_s: sample the server's /metrics, /slots and GPU every this many seconds
            into samples.jsonl, summarised in the manifest (HTTP engines; None: off).
        write_inline: encode, fsync and update the progress bar on the event loop instead
            of the writer thread (only to measure what that costs: writer_overhead.py).
    """
    from infercourse.core import metrics, summary
    from infercourse.models.embedded import cache_dir
    from infercourse.measure.results import RunWriter
    from tqdm.auto import tqdm

    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; choose from {', '.join(PATTERNS)}")
    base = list(getattr(workload, "requests", workload))
    if not base:
        raise ValueError("workload has no requests")
    n = min(max_requests or len(base), MAX_REQUESTS)
    if concurrency < 1 or max_in_flight < 1 or n < 1:
        raise ValueError("concurrency, max_in_flight and max_requests must be >= 1")
    models = request_models(base)   # a mix: each request goes to the model it names (model_mix)
    if models:
        engine = ModelDispatch(engine, models)
    if ignore_eos is not None:
        base = [replace(r, ignore_eos=ignore_eos) for r in base]
    if salt is None:   # a cache workload measures reuse; cache_prompt=False reuses nothing
        salt = not getattr(workload, "cache_workload", False) and any(r.cache_prompt for r in base)
    salt = (new_salt() if salt is True else salt) or None
    warm = [warmup_request(base[i % min(n, len(base))], i) for i in range(warmup)]
    if salt:
        base = [salted(r, salt) for r in base]
    reqs = [base[i % len(base)] for i in range(n)]   # changed once per distinct request, then cycled
    offsets = None
    if pattern in ("rate", "poisson"):
        if not rate_rps:
            raise ValueError(f"pattern {pattern!r} needs rate_rps > 0")
        offsets = constant_schedule(n, rate_rps) if pattern == "rate" else poisson_schedule(n, rate_rps, seed)
    elif pattern == "replay":
        offsets = offsets_s if offsets_s is not None else getattr(workload, "offsets_s", None)
        if offsets is None:
            raise ValueError("pattern 'replay' needs offsets_s or a workload with offsets")
        offsets = np.asarray([offsets[i % len(offsets)] + (i // len(offsets)) * (max(offsets) + 1.0)
                              for i in range(n)], float)
    offsets = None if offsets is None else [float(o) for o in offsets]   # plain floats for JSON
    if pattern == "sequential":
        concurrency = 1
    is_async, notes = hasattr(engine, "astream"), []
    if not is_async and concurrency > 1:
        notes.append(f"in-process engine {getattr(engine, 'name', engine)!r} runs one request at a "
                     f"time: concurrency {concurrency} downgraded to 1")
        concurrency = 1
    addr = server_address(engine) if is_async else None
    if addr and not is_loopback(addr[0]) and not allow_remote:   # the CLI checked this at parse time
        raise APILayerError(f"bench targets loopback servers only, got {addr[0]}:{addr[1]}",
                            hint="pass allow_remote=True if you own that server and mean to load it")
    from infercourse.measure.workloads import Workload
    wl = (workload if hasattr(workload, "describe") else
          (ModelWorkload if models else Workload)("ad-hoc", tuple(base))).describe()
    try:
        eng = engine.describe()
    except Exception as e:  # noqa: BLE001 - a describe() failure must not stop the run
        eng = {"engine": getattr(engine, "name", type(engine).__name__), "describe_error": str(e)}
    # HTTP: asks the server, so a dead one fails here; MLX: `.model` is the module, its file is `.model_ref`
    model = getattr(engine, "model_ref", None) or getattr(engine, "model", None)
    model = {"name": model.name, "path": str(model.path), "sha256": model.sha256()} \
        if hasattr(model, "sha256") else model
    load = {"pattern": pattern, "concurrency": concurrency, "rate_rps": rate_rps, "seed": seed,
            "warmup": warmup, "max_requests": n, "max_duration_s": max_duration_s,
            "max_in_flight": max_in_flight if offsets is not None else concurrency,
            "executor": "asyncio+httpx" if is_async else "in-process, one request at a time"}
    manifest = {"label": label, "engine": eng, "model": model, "sampling": reqs[0].sampling(),
                "load": load, "workload": {**wl, "salt": salt}, **(conditions or {})}
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    out = Path(out_dir) if out_dir else cache_dir() / "runs" / f"{stamp}_{label or pattern}"
    writer = RunWriter(out, manifest)
    tags = [{"pattern": pattern, "concurrency": concurrency, "req_index": i % len(base),
             **({"model": models[i % len(base)]} if models else {})} for i in range(n)]
    pbar = tqdm(total=n, desc=label or pattern, disable=not progress, leave=False)
    if not write_inline:
        writer.start_thread(on_written=pbar.update)
    st, status = State(writer, pbar, inline=write_inline), "ok"
    sampler = server_sampler(engine, out, sample_s) if is_async else None
    st.on_start = (lambda: sampler.start(first_sample=True)) if sampler else None   # after warm-up
    try:
        if is_async:
            if loop_in_thread(lambda: run_async(engine, reqs, offsets, concurrency, max_in_flight,
                                                  max_duration_s, warm, st, addr, tags)):
                st.stop_reason = "interrupted"
        else:
            run_sync(engine, reqs, offsets, max_duration_s, warm, st, tags)
    except BaseException as e:
        status = f"error: {type(e).__name__}: {e}"
        raise
    finally:
        wall = time.perf_counter() - (st.t0 or time.perf_counter())
        cpu_frac = (sum(psutil.Process().cpu_times()[:2]) - st.cpu0) / wall if wall > 0 else 0.0
        df = metrics.per_request_frame(st.traces)
        notes += self_check(df, cpu_frac, is_async, st, max_in_flight, offsets is not None) if len(df) else []
        if st.stop_reason:
            notes.append(f"run stopped early: {st.stop_reason} after {len(st.traces)} of {n} requests")
        if sampler:
            sampler.stop(final_sample=True)
            writer.manifest["server_samples"] = sampled_summary(sampler.rows)
        writer.manifest.update(warnings=notes, client={"cpu_frac_of_core": cpu_frac, "wall_s": wall,
                               "cpu_includes_engine": not is_async, "max_in_flight": st.max_in_flight},
                               stopped=st.stop_reason)
        if st.server_error is not None:
            status = f"error: server stopped answering: {st.server_error}"
        writer.close(status if status != "ok" or not st.stop_reason else f"stopped: {st.stop_reason}")
        pbar.close()
    result = BenchResult(st.traces, df, summary.summarize(df) if len(df) else df, writer.manifest, out)
    if st.server_error is not None:
        host = f"{addr[0]}:{addr[1]}" if addr else "the server"
        n_ok = int((df["status"] == "ok").sum())
        raise ServerLayerError(f"server at {host} stopped answering mid-run: {n_ok} requests finished, "
                               f"{len(df) - n_ok} did not ({st.server_error})",
                               hint=f"check the server log; every finished request is in {out}",
                               partial=result)
    return result


def sweep(engine, workload, concurrencies: Sequence[int] = (1, 2, 4, 8), *,
          requests_per_level: int | None = None, out_dir: str | Path | None = None,
          **kw: Any):
    """From one request at a time to saturation: one closed-loop run per concurrency.

    Returns (table, results): one summary row per level (throughput, p50/p95 latencies,
    errors, warnings) and the BenchResult of each level.

    Args:
        concurrencies: levels, low to high; stop adding levels once throughput stops rising.
        requests_per_level: requests per level (default max(4 x level, 8)).
        out_dir: parent folder; each level writes `c<level>/` under it.
        **kw: passed to `run` (warmup, ignore_eos, seed...).
    """
    import pandas as pd

    from infercourse.core import summary
    if not hasattr(engine, "astream") and max(concurrencies) > 1:
        raise EngineLayerError("an in-process engine runs one request at a time; a concurrency "
                               "sweep needs a server", hint="start one with servers.LlamaServer "
                                                            "and use OpenAIHTTPEngine(srv.url)")
    rows, results, label = [], [], kw.pop("label", None)
    for c in concurrencies:
        n = requests_per_level or max(4 * c, 8)
        sub = Path(out_dir) / f"c{c}" if out_dir else None
        r = run(engine, workload, pattern="concurrency", concurrency=c, max_requests=n,
                out_dir=sub, label=f"{label or 'sweep'}-c{c}", **kw)
        counts = r.df["status"].value_counts() if len(r.df) else {}
        s, row = r.summary, {"concurrency": c, **summary.throughput(r.df),
                             "error_rate": summary.error_rate(r.df),
                             **{f"n_{k}": int(counts.get(k, 0)) for k in ("ok", "error", "incomplete")},
                             "cached_fraction": r.df["cached_tokens"].sum() / r.df["prompt_tokens"].sum()
                             if len(r.df) and r.df["cached_tokens"].notna().any() else float("nan")}
        for m, q in (("ttft_s", "p50"), ("ttft_s", "p95"), ("tpot_s", "p50"), ("e2e_s", "p95"),
                     ("dispatch_delay_s", "p95")):
            row[f"{m}_{q}"] = s.loc[m, q] if m in s.index and q in s else float("nan")
        row.update(max_in_flight=r.manifest["client"]["max_in_flight"], warnings=len(r.warnings))
        rows.append(row)
        results.append(r)
    return pd.DataFrame(rows).set_index("concurrency"), results


def replay(engine, timed: Sequence[tuple[float, Request]], **kw: Any) -> BenchResult:
    """Send recorded requests at their recorded offsets: `timed` is [(offset_s, Request)],
    e.g. `list(workloads.replay_calls(session))`. A replayed session is a cache workload
    (each call extends the last), so it is not salted unless `salt=` says otherwise."""
    offsets, reqs = zip(*timed)
    kw.setdefault("salt", False)
    return run(engine, list(reqs), pattern="replay", offsets_s=list(offsets), **kw)


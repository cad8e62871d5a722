"""A soak: does the server still work after hours? Load it for a bounded time and watch.

Short benchmarks miss the failures that take time: memory that creeps up until the OOM
killer strikes, a cache that fills as agent contexts grow, a crash once in ten thousand
requests. A soak runs a realistic workload (the recorded agentic session, or a mix of
it with short chats) for a fixed duration and records three things side by side:

- every request (latency, errors, cached prompt tokens), through the same load loops as
  `bench`, into `requests.jsonl` + `manifest.json`, so `infercourse report DIR` reads it.
  In the closed loop each user cycles the workload in order (`user_position`): an agent's
  call k + 1 extends call k, so it goes out once call k has finished, not while it prefills;
- the server over time (`sampling.ServerSampler`: RSS, queue, KV use, GPU) into
  `samples.jsonl`;
- crashes: a `Supervisor` notices the server died, restarts it on the same port, and
  logs each restart in `events.jsonl`; the load resumes, so one crash costs its
  in-flight requests (recorded as errors) and the downtime, never what was measured.

Every line is fsynced as it is written: killing the soak itself loses nothing finished.
The course default runs minutes; the 24 h / 72 h recipe is `duration_s=24 * 3600` (the
sampling interval grows with the duration, so a long soak keeps ~2,000 samples).
"""
from __future__ import annotations

import datetime as _dt
import itertools
import os
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from infercourse.core.errors import APILayerError
from infercourse.core.types import Request
from infercourse.measure.loadgen import State, loop_in_thread, poisson_schedule, run_async, server_address
from infercourse.measure.results import RunWriter, load_run
from infercourse.measure.workloads import Workload, agentic_workload
from infercourse.ops.sampling import ServerSampler, headline, load_samples, soak_summary
from infercourse.ops.supervisor import EVENTS, Supervisor, kill_server

__all__ = ["SoakResult", "soak", "soak_workload", "soak_summary", "headline", "parse_duration",
           "default_interval", "user_position"]

_SHORT = ("What is a KV cache, in one sentence?", "Name two sorting algorithms.",
          "Say hello in French.", "What does HTTP 503 mean?")


def parse_duration(text: str | float) -> float:
    """Seconds from "90", "90s", "5m", "24h" or "3d" (a number, or one with a unit s/m/h/d)."""
    if isinstance(text, (int, float)):
        return float(text)
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = str(text).strip().lower()
    try:
        return float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90, 5m, 24h)") from None


def default_interval(duration_s: float) -> float:
    """Seconds between samples: 1 s for short soaks, ~2,000 samples for long ones."""
    return max(1.0, duration_s / 2000)


def soak_workload(kind: str = "agentic", *, max_calls: int | None = None) -> Workload:
    """The requests a soak cycles through.

    Args:
        kind: "agentic" (the recorded coding session: contexts grow call after call, so the
            prefix cache and KV use grow with them) or "mix" (those calls interleaved with
            short one-line chats, as a shared server sees).
        max_calls: keep only the first N agentic calls (shorter contexts: a small server).
    """
    wl = agentic_workload()
    calls = list(wl.requests[:max_calls] if max_calls else wl.requests)
    if kind == "agentic":
        return Workload(f"{wl.name}[:{len(calls)}]", tuple(calls))
    if kind != "mix":
        raise ValueError(f"unknown soak workload {kind!r}: use agentic or mix")
    short = [Request(messages=[{"role": "user", "content": q}], max_tokens=16) for q in _SHORT]
    mixed = [r for i, c in enumerate(calls) for r in (c, short[i % len(short)])]
    return Workload(f"mix-{wl.name}[:{len(calls)}]", tuple(mixed))


def user_position(i: int, n: int, users: int) -> int:
    """Closed-loop request i's place in an n-request workload that each of `users` workers
    cycles in order (loadgen's lanes: worker w = i % users sends i, i + users, ...), user w
    starting w places in: users at different points of their sessions, not in lockstep."""
    return (i // users + i % users) % n


class _Lazy(Sequence):
    """reqs[i] / tags[i] for the closed loop without building 100,000 items up front."""
    def __init__(self, n: int, item):
        self.n, self.item = n, item

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.item(i)


class _SoakState(State):
    """bench's request state, numbering requests across rounds (one per server life)."""

    def __init__(self, writer, counter, round_: int, on_done, deadline: float = float("inf")):
        class _Quiet:
            def update(self, n):
                pass
        super().__init__(writer, _Quiet(), inline=True)   # write + fsync as each request finishes
        self.counter, self.round, self.on_done, self.deadline = counter, round_, on_done, deadline

    def done(self, tr) -> None:
        tr.request_id = next(self.counter)
        tr.tags["round"] = self.round
        if tr.status == "error" and time.perf_counter() >= self.deadline:
            # failed after the soak's window closed (its shutdown, or a drill that fired too
            # late to be recovered): cut off by the end, not a failure of the server's service
            tr.status, tr.error = "incomplete", f"incomplete: cut at the soak's end ({tr.error})"
        super().done(tr)
        self.on_done(tr)


@dataclass
class SoakResult:
    """A finished soak: requests, samples, events, the summary, and where it lies on disk."""

    dir: Path
    df: pd.DataFrame
    samples: pd.DataFrame
    events: list[dict] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    t0: float = 0.0              # perf_counter at the soak's start: requests' `scheduled_t - t0`
                                 # is on the samples' `t_s` clock


def soak(server, workload: Workload | None = None, *, duration_s: float = 120.0, concurrency: int = 2,
         rate_rps: float | None = None, interval_s: float | None = None, out_dir: str | os.PathLike | None = None,
         label: str | None = None, kill_at_s: Sequence[float] = (), kill_after_ok: int | None = None,
         max_restarts: int = 5, seed: int = 0,
         ignore_eos: bool | None = None, progress: bool = True, conditions: dict | None = None) -> SoakResult:
    """Run `workload` against a server for `duration_s`, sampling it, restarting it if it dies.

    Args:
        server: a `servers.Server` (supervised: started if needed, restarted on a crash)
            or a URL of a server someone else runs (sampled, never restarted; RSS unknown).
        workload: requests cycled for the whole soak (default: `soak_workload("agentic")`).
        duration_s: how long to send requests (24 h = 86400; see `parse_duration`).
        concurrency: closed-loop users (ignored when `rate_rps` is given).
        rate_rps: open loop instead: Poisson arrivals at this rate (seeded).
        interval_s: seconds between samples (default: `default_interval(duration_s)`).
        out_dir: results folder (default: cache_dir()/runs/<time>_soak).
        kill_at_s: seconds into the soak at which to SIGKILL the server (a crash drill).
        kill_after_ok: or SIGKILL it once this many requests have succeeded (a drill that
            does not depend on how fast this machine is).
        max_restarts: the supervisor gives up after this many restarts.
        ignore_eos: force every request to its max_tokens (None: as the workload says).
        progress: a progress bar with a live status line.
        conditions: extra manifest entries.
    """
    from tqdm.auto import tqdm

    from infercourse.engines.openai_http import OpenAIHTTPEngine
    from infercourse.models.embedded import cache_dir
    if duration_s <= 0 or concurrency < 1:
        raise ValueError("duration_s must be > 0 and concurrency >= 1")
    wl = workload or soak_workload()
    base = [replace(r, ignore_eos=ignore_eos) if ignore_eos is not None else r for r in wl.requests]
    sup = Supervisor(server, max_restarts=max_restarts) if not isinstance(server, str) else None
    if sup and not server.running:
        sup.start()
    url = server if isinstance(server, str) else server.url
    host = (server_address(OpenAIHTTPEngine(url, model="-")) or ("",))[0]
    if host not in ("127.0.0.1", "localhost", "::1"):      # load tests stay on this machine
        raise APILayerError(f"soak targets loopback servers only, got {host}",
                            hint="run the soak on the server's own machine")
    engine = OpenAIHTTPEngine(url, model=None if isinstance(server, str) else server.served_model)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    out = Path(out_dir) if out_dir else cache_dir() / "runs" / f"{stamp}_{label or 'soak'}"
    interval_s = interval_s or default_interval(duration_s)
    load = {"pattern": "poisson" if rate_rps else "concurrency", "concurrency": concurrency, "rate_rps": rate_rps,
            "per_user_order": not rate_rps, "seed": seed, "warmup": 0, "max_duration_s": duration_s,
            "executor": "asyncio+httpx", "soak": True}
    manifest = {"label": label or "soak", "engine": engine.describe(), "model": engine.model,
                "sampling": base[0].sampling(), "load": load, "workload": wl.describe(),
                "server": server.describe() if sup else {"url": url},
                "soak": {"duration_s": duration_s, "interval_s": interval_s, "kill_at_s": list(kill_at_s),
                         "kill_after_ok": kill_after_ok, "max_restarts": max_restarts}, **(conditions or {})}
    writer = RunWriter(out, manifest)
    if sup:
        sup.log = out / EVENTS
    counts = {"ok": 0, "error": 0}
    bar = tqdm(total=round(duration_s), desc=label or "soak", unit="s", disable=not progress, leave=True)

    def status(row: dict) -> None:                  # the live one-line status
        bar.n = min(round(row["t_s"]), bar.total)
        parts = [f"rss {row.get('rss_mib', float('nan')):.0f} MiB"]
        if row.get("kv_used_frac") is not None:
            parts.append(f"kv {row['kv_used_frac']:.0%}")
        if row.get("llamacpp:requests_deferred") is not None:
            parts.append(f"deferred {row['llamacpp:requests_deferred']:.0f}")
        parts += [f"{counts['ok']} ok {counts['error']} err", f"restarts {sup.restarts if sup else 0}",
                  "up" if row.get("up") else "DOWN"]
        bar.set_postfix_str(" · ".join(parts), refresh=True)

    def tally(tr) -> None:
        counts["ok" if tr.status == "ok" else "error"] += 1
        if sup and tr.status == "ok" and counts["ok"] == kill_after_ok:
            sup._event("drill_kill", pid=server.pid, after_ok=kill_after_ok)   # when the drill fired, on the soak clock
            kill_server(server)

    sampler = ServerSampler(url, (lambda: server.pid) if sup else (lambda: None), out,
                            interval_s=interval_s, on_sample=status if progress else None)
    t0 = sampler.t0 = time.perf_counter()
    writer.manifest["soak"]["t0_perf_counter"] = t0
    if sup:                                  # events, samples and requests: one clock
        for e in sup.events:                 # the start before the soak: negative times
            e["t_s"] -= t0 - sup.t0
        sup.t0 = t0
        sup._event("soak_start", pid=server.pid, port=server.port)
    killers = [threading.Timer(k, lambda: (sup._event("drill_kill", pid=server.pid), kill_server(server)))
               for k in kill_at_s if sup]
    counter, addr, rnd, stop = itertools.count(), server_address(engine), 0, None
    n_cap = 100_000
    pos = (lambda i: i % len(base)) if rate_rps else (lambda i: user_position(i, len(base), concurrency))
    reqs = _Lazy(n_cap, lambda i: base[pos(i)])
    offsets = None
    if rate_rps:
        offsets = [float(o) for o in poisson_schedule(min(n_cap, int(rate_rps * duration_s) + 1), rate_rps, seed)]
    status_text = "ok"
    try:
        sampler.start()
        for k in killers:
            k.start()
        while (left := duration_s - (time.perf_counter() - t0)) > 0:
            st = _SoakState(writer, counter, rnd, tally, deadline=t0 + duration_s)
            tags = _Lazy(n_cap, lambda i: {"pattern": load["pattern"], "concurrency": concurrency,
                                           "req_index": pos(i), **({} if rate_rps else {"user": i % concurrency})})
            round_reqs, offs = reqs, None
            if offsets is not None:   # the open loop resumes its schedule where it is now
                offs = [o - (duration_s - left) for o in offsets if o >= duration_s - left]
                round_reqs = _Lazy(len(offs), lambda i: base[i % len(base)])
            if loop_in_thread(lambda: run_async(engine, round_reqs, offs, concurrency, 256, left, [],
                                                st, addr, tags, lanes=offs is None)):
                stop = "interrupted"
                break
            if st.server_error is not None:
                if sup is None:
                    stop = f"server stopped answering: {st.server_error}"
                    break
                if time.perf_counter() - t0 < duration_s:
                    sup.restart(f"{type(st.server_error).__name__}: {st.server_error}")
                    rnd += 1
            elif offs is not None:
                break                          # the open-loop schedule is spent
    except BaseException as e:
        status_text = f"error: {type(e).__name__}: {e}"
        raise
    finally:
        for k in killers:
            k.cancel()
        sampler.stop()
        bar.n = bar.total if status_text == "ok" and not stop else bar.n
        bar.close()
        result = _finish(out, writer, sup, stop, status_text, duration_s, t0)
    return result


def _finish(out: Path, writer: RunWriter, sup: Supervisor | None, stop: str | None, status: str,
            duration_s: float, t0: float) -> SoakResult:
    run = load_run(out) if writer.n else None
    df = run.df if run else pd.DataFrame()
    samples = load_samples(out)
    events = sup.events if sup else []
    s = soak_summary(df, samples, events, duration_s)
    writer.manifest.update(soak_summary=s, stopped=stop)
    writer.close(status if status != "ok" or not stop else f"stopped: {stop}")
    return SoakResult(out, df, samples, events, s, t0)


def soak_main(argv: list[str] | None = None) -> int:
    """`infercourse soak`: 0 when the soak ran its course, 1 when it failed, 2 bad usage."""
    import argparse
    import sys
    p = argparse.ArgumentParser(prog="infercourse soak", description=(
        "Load a server for a bounded time with a realistic workload; sample its memory, queue, KV "
        "use and GPU; restart it if it dies (counting restarts); report memory drift as a slope "
        "with a confidence interval. Writes a results folder `infercourse report` reads."))
    p.add_argument("--url", help="soak a server someone else runs (sampled, never restarted)")
    p.add_argument("--server", choices=["llama"], default="llama",
                   help="else start and supervise this server (default llama: llama-server)")
    p.add_argument("--model", help="a .gguf for llama-server (default: the embedded SmolLM2-135M)")
    p.add_argument("--parallel", type=int, default=2, help="llama-server slots (default 2)")
    p.add_argument("--ctx", type=int, default=8192, help="llama-server context, all slots (default 8192)")
    p.add_argument("--threads", type=int, help="llama-server threads")
    p.add_argument("--duration", default="2m", help="how long: 90, 90s, 5m, 24h, 3d (default 2m)")
    p.add_argument("--workload", choices=["agentic", "mix"], default="mix",
                   help="agentic: the recorded coding session, contexts growing; mix: with short chats")
    p.add_argument("--max-calls", type=int, default=12,
                   help="agentic calls used (shorter contexts for small servers; 0: all 35)")
    p.add_argument("--concurrency", type=int, default=2, help="closed-loop users (default 2)")
    p.add_argument("--rate", type=float, help="open loop instead: Poisson arrivals per second")
    p.add_argument("--interval", type=float, help="seconds between samples (default: ~2000 over the soak)")
    p.add_argument("--kill-at", type=float, action="append", default=[],
                   help="crash drill: SIGKILL the server this many seconds in (repeatable)")
    p.add_argument("--kill-after", type=int, help="crash drill: SIGKILL the server after N answered requests")
    p.add_argument("--max-restarts", type=int, default=5, help="give up after this many restarts")
    p.add_argument("--out", type=Path, help="results folder (default: under the infercourse cache)")
    p.add_argument("--label", help="name of this run in reports")
    p.add_argument("--no-progress", action="store_true", help="no progress bar / live status line")
    a = p.parse_args(argv)
    try:
        duration = parse_duration(a.duration)
    except ValueError as e:
        p.error(str(e))
    if a.url and (a.kill_at or a.kill_after):
        p.error("--kill-at needs a server this command supervises (drop --url)")
    from infercourse.core.loopback import refuse_remote   # before anything is built or sent
    if a.url and (remote := refuse_remote(a.url, what="soak", hint="Run the soak on the server's own machine")):
        p.error(remote)
    from infercourse.core.errors import InferCourseError
    srv = None
    try:
        if not a.url:
            from infercourse.servers import LlamaServer
            # --cache-ram 0: the host prompt cache (8 GiB by default) keeps idle slots' prompts in RAM,
            # a growth of RSS a soak would report as a leak (notebook 15, prompt_cache_step)
            srv = LlamaServer(a.model, n_parallel=a.parallel, ctx_size=a.ctx, threads=a.threads,
                              extra_args=["--cache-ram", "0"])
        r = soak(a.url or srv, soak_workload(a.workload, max_calls=a.max_calls or None), duration_s=duration,
                 concurrency=a.concurrency, rate_rps=a.rate, interval_s=a.interval, out_dir=a.out,
                 label=a.label, kill_at_s=a.kill_at, kill_after_ok=a.kill_after, max_restarts=a.max_restarts,
                 progress=not a.no_progress)
    except InferCourseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if srv is not None:
            srv.stop()
    print(headline(r.summary))
    for k, v in r.summary.items():
        print(f"  {k:<22} {v:.4g}" if isinstance(v, float) else f"  {k:<22} {v}")
    print(f"results: {r.dir}  (infercourse report {r.dir})")
    return 0

"""Tuning: find the bottleneck first, change one knob, measure percentiles, keep or revert.

A knob that "feels faster" after one request proves nothing: timings on a shared machine
move by tens of percent on their own. The discipline:

1. Locate the bottleneck from the traces before touching anything: how much of each
   request's end-to-end time (E2E) was **queueing** (waiting for a free slot), **prefill**
   (the server's own `timings.prompt_ms`) and **decode** (first token to last)?
2. Change exactly one knob aimed at the biggest share.
3. Measure the same workload again and compare it pair by pair against the noise floor
   (the baseline measured twice): keep the change only if it is better beyond that noise;
   otherwise revert. A time that includes the wait for a slot (TTFT, E2E) is paired by
   place in the queue, a time without it (the service time, E2E minus the wait) by request:
   with several users racing for one slot, which request waits where changes from run to
   run (`measure.tuning_log`).
4. Write down what was tried, the numbers and why it was kept or reverted (`TuningLog`,
   an append-only `log.jsonl` beside each trial's run folder with its conditions).

llama-server's knobs, as `ServerConfig` fields: `-np` slots, `-c` (total, split between
slots: per-slot context = c / np), `-b`/`-ub` (logical / physical prompt batch), `-t`
threads, `-ctk` (K-cache type), `--cache-reuse` (reuse cached chunks that moved inside a
prompt). On the client side `max_tokens` caps the tail: a request that hits the cap takes
TTFT + (max_tokens - 1) x TPOT.
"""
from __future__ import annotations

import datetime as _dt
import math
import re
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable

import pandas as pd

from infercourse.core import metrics
from infercourse.core.trace import RequestTrace
from infercourse.core.types import Request
from infercourse.measure import bench
from infercourse.measure.results import new_run_dir
# The keep/revert rule and the log are not llama-server's: they live in the measure layer
# (re-exported here, so the notebook reads one module).
from infercourse.measure.tuning_log import TuningLog, decide, explain_log, pairing_text

__all__ = ["Lab", "setup", "ServerConfig", "serve_and_measure", "tuning_workloads", "stage_shares", "add_stages",
           "bottleneck", "ADVICE", "TARGETS", "predicted_queue_share", "plot_stages", "decide", "TuningLog",
           "explain_log", "pairing_text", "kv_cache_mib_from_log", "compute_mib_from_log"]


@dataclass(frozen=True)
class ServerConfig:
    """One llama-server configuration; every field is a knob (defaults: llama-server's own).

    Args:
        n_parallel: slots (-np): requests decoded together.
        ctx_per_slot: context per slot; the server gets -c = ctx_per_slot x n_parallel.
        threads: -t.
        batch, ubatch: -b / -ub, prompt tokens per logical / physical batch.
        cache_type_k: -ctk, K-cache element type ("f16", "q8_0", "q4_0").
        cache_reuse: --cache-reuse N (0: off): reuse cached chunks of >= N tokens that moved.
    """

    n_parallel: int = 1
    ctx_per_slot: int = 2048
    threads: int = 2
    batch: int = 2048
    ubatch: int = 512
    cache_type_k: str = "f16"
    cache_reuse: int = 0

    def change(self, **knob: Any) -> "ServerConfig":
        """A copy with exactly one knob changed (the discipline, enforced)."""
        if len(knob) != 1:
            raise ValueError(f"change one knob at a time, got {sorted(knob)}")
        return replace(self, **knob)

    def server(self, model=None):
        from infercourse.servers import LlamaServer
        # -lv 4: this llama-server build logs its KV and compute buffer sizes only above default verbosity
        extra = ["-b", self.batch, "-ub", self.ubatch, "-ctk", self.cache_type_k,
                 "--cache-reuse", self.cache_reuse, "-lv", 4]
        return LlamaServer(model, n_parallel=self.n_parallel, ctx_size=self.ctx_per_slot * self.n_parallel,
                           threads=self.threads, extra_args=[str(a) for a in extra])


@dataclass
class Lab:
    """Everything notebook 14 sets up before its first server starts."""

    profile: Any                  # `ops.profiles.profile(...)`
    concurrency: int              # users at once (= the slots the `n_parallel` trial tries)
    trials: dict[str, Any]        # knob -> value, `None` resolved to the profile's slots
    tokenize: Any                 # the model's tokenizer (exact-length prompts)
    max_tokens: int               # the users' forced answer length
    workloads: dict[str, tuple]   # `tuning_workloads`, plus "users A/A" for the baseline
    root: Any                     # this run's results folder
    base_cfg: "ServerConfig"      # the first try: one slot, llama.cpp's defaults
    card: Any                     # the model card (KV bytes per token, ...)

    @property
    def baseline_workloads(self) -> dict[str, tuple]:
        """The trial workloads plus the users' requests once more ("users A/A", right after
        the first run, on the same server): the A/A repeat every decision is judged against."""
        return {"users": self.workloads["users"], "users A/A": self.workloads["users"],
                **{k: v for k, v in self.workloads.items() if k != "users"}}


def setup(profile_name: str, trials: dict[str, Any], *, threads: int | None, n_requests: int | None,
          max_tokens: int | None, long_tokens: int, results_root) -> Lab:
    """The lab of notebook 14: sizes from the profile, the same requests for every trial,
    the baseline configuration and a timestamped results folder.

    Args:
        profile_name: "cpu" | "mac" | "gpu" (`ops.profiles`).
        trials: one knob per trial; `None` as a value means the profile's slots.
        threads: the baseline's -t (None: the profile's).
        n_requests: users' requests per trial (None: slots + 2).
        max_tokens: users' forced answer length (None: half the profile's max_tokens).
        long_tokens: the two documents of the --cache-reuse case, together (tokens).
        results_root: parent folder of this run's folder.
    """
    from pathlib import Path

    from infercourse.models.embedded import vocab_tokenizer
    from infercourse.models.modelcard import model_card
    from infercourse.ops.profiles import profile
    P = profile(profile_name)
    C = P.parallel
    tok = vocab_tokenizer(None)
    mt = max_tokens or P.max_tokens // 2
    W = tuning_workloads(tok, n_requests=n_requests or C + 2, concurrency=C, prompt_tokens=P.prompt_tokens,
                         max_tokens=mt, long_tokens=long_tokens)
    root = Path(results_root) / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = ServerConfig(n_parallel=1, ctx_per_slot=P.ctx_size // P.parallel, threads=threads or P.threads)
    return Lab(P, C, {k: (C if v is None else v) for k, v in trials.items()}, tok, mt, W, root, base,
               model_card(None))


def serve_and_measure(config: ServerConfig, workloads: dict[str, Any], *, results_root=None,
                      model=None, **run_kw: Any) -> dict[str, Any]:
    """Start llama-server with `config`, run each named workload through `bench.run`, stop it.

    Returns {"config", "runs": {name: BenchResult}, "rss_mb": server RSS after the runs,
    "kv_cache_mib": the KV cache size the server logged, "<name>_cached_tokens": prompt
    tokens served from the cache in each run}. Each run's `df` gains `queue_s`, `prefill_s`
    and `service_s` (`add_stages`).

    Args:
        config: the server's knobs (recorded in every run's manifest under `server_config`).
        workloads: {name: (workload, {bench.run keywords})}, run in order on one server.
        results_root: parent folder for the run folders (None: bench's default).
        **run_kw: bench.run keywords shared by every workload (warmup, ignore_eos...).
    """
    import psutil
    out: dict[str, Any] = {"config": config, "runs": {}}
    with config.server(model) as srv:
        engine = srv.engine()
        for name, (wl, kw) in workloads.items():
            r = out["runs"][name] = bench.run(engine, wl, label=name, progress=False,
                                              out_dir=new_run_dir(results_root, re.sub(r"[^\w.-]+", "_", name)),
                                              conditions={"server_config": asdict(config)}, **{**run_kw, **kw})
            add_stages(r)
            # prompt tokens the server reused from its cache: a count, not a noisy timing
            out[f"{name}_cached_tokens"] = float(r.df["cached_tokens"].fillna(0).sum()) if len(r.df) else math.nan
        try:
            out["rss_mb"] = psutil.Process(srv.pid).memory_info().rss / 1e6
        except (psutil.Error, TypeError, ValueError):
            out["rss_mb"] = math.nan
        text = srv.log_path.read_text(errors="replace")
        out["kv_cache_mib"], out["compute_mib"] = kv_cache_mib_from_log(text), compute_mib_from_log(text)
    return out


def tuning_workloads(tokenize, *, n_requests: int, concurrency: int, prompt_tokens: int,
                     max_tokens: int, long_tokens: int) -> dict[str, tuple[list[Request], dict]]:
    """The workloads every trial runs, so before and after are always the same requests.

    - `users`: `n_requests` distinct prompts of `prompt_tokens`, `concurrency` users at once,
      with the prompt cache off (`cache_prompt=False`): every prompt is prefilled in full.
    - `shift`: two requests one after the other: [doc1, doc2, question], then [doc2,
      question] (an agent that dropped an old tool result): doc2's KV is still cached, but
      at another position, which only `--cache-reuse` can use; the first one is also a
      long cold prefill (`long_tokens`) for the prompt-batch knobs.

    Args:
        tokenize: the model's tokenizer (exact-length prompts).
    """
    from infercourse.measure.workloads import exact_length_prompt
    chat = lambda text, n, cache=True: Request(messages=[{"role": "user", "content": text}],  # noqa: E731
                                               max_tokens=n, ignore_eos=True, cache_prompt=cache)
    users = [chat(exact_length_prompt(prompt_tokens, tokenize, seed=i), max_tokens, False) for i in range(n_requests)]
    doc1, doc2 = (exact_length_prompt(long_tokens // 2, tokenize, seed=s) for s in (1001, 1002))
    ask = "\n\nWhich of these words is the longest?"
    shift = [chat(f"{doc1}\n\n{doc2}{ask}", 4), chat(f"{doc2}{ask}", 4)]
    # warmup=0: a warm-up request would put the first prompt in the cache
    return {"users": (users, {"pattern": "concurrency", "concurrency": concurrency}),
            "shift": (shift, {"pattern": "sequential", "warmup": 0})}


def stage_shares(traces: Iterable[RequestTrace]) -> pd.DataFrame:
    """Where each request's E2E went: queueing, prefill, decode (seconds and shares).

    queue = TTFT - the server's prompt time (waiting for a slot, plus HTTP), prefill =
    llama-server's `timings.prompt_ms`, decode = E2E - TTFT. Requests without server
    timings (other engines) get NaN rather than a guess.
    """
    rows = []
    for tr in traces:
        ttft, e2e = metrics.ttft_s(tr), metrics.e2e_s(tr)
        if tr.status != "ok" or ttft is None or e2e is None:
            continue
        pm = tr.engine_timings.get("prompt_ms")
        prefill = float(pm) / 1e3 if pm is not None else math.nan
        row = {"request_id": tr.request_id, "e2e_s": e2e, "queue_s": max(0.0, ttft - prefill) if pm is not None
               else math.nan, "prefill_s": min(prefill, ttft), "decode_s": e2e - ttft}
        rows.append(row)
    df = pd.DataFrame(rows, columns=["request_id", "e2e_s", "queue_s", "prefill_s", "decode_s"])
    for s in ("queue", "prefill", "decode"):
        df[f"{s}_share"] = df[f"{s}_s"] / df["e2e_s"]
    return df


def add_stages(run) -> pd.DataFrame:
    """Add `queue_s`, `prefill_s` and `service_s` (= E2E - queue_s: the time the request
    itself took once a slot had it) to a run's per-request `df`, from `stage_shares` of its
    traces (NaN without server timings). The service time is what a knob acting on the
    work (threads, prompt batches) changes, and it does not depend on the place in the queue.
    """
    st = stage_shares(run.traces).set_index("request_id")
    df = run.df
    for col in ("queue_s", "prefill_s"):
        df[col] = df["request_id"].map(st[col]) if len(df) else pd.Series(dtype=float)
    df["service_s"] = df["e2e_s"] - df["queue_s"] if len(df) else pd.Series(dtype=float)
    return df


ADVICE = {"queue": "more slots (-np) or fewer concurrent users (admission control)",
          "prefill": "prompt batch (-b/-ub), prefix reuse (cache_prompt, --cache-reuse), shorter prompts",
          "decode": "threads (-t), a smaller quantization, batching more users (-np), a lower max_tokens"}


def bottleneck(shares: pd.DataFrame) -> dict[str, Any]:
    """The stage with the largest share of total E2E time, and the knobs aimed at it."""
    totals = {s: float(shares[f"{s}_s"].sum(min_count=1)) for s in ADVICE}
    whole = sum(totals.values())
    if not whole or not math.isfinite(whole):
        raise ValueError("no stage timings: needs llama-server traces with `timings`")
    frac = {s: v / whole for s, v in totals.items()}
    top = max(frac, key=frac.get)
    return {"stage": top, "shares": frac, "advice": ADVICE[top]}


# knob -> (target the trial is judged on, better when, the hypothesis logged with it). A knob
# aimed at the queue is judged on a time that includes the wait (paired by place in the queue),
# a knob aimed at the work on the service time or the server's prefill (paired by request)
TARGETS = {
    "n_parallel": ("users:ttft_s", "lower", "queueing dominates: more slots serve concurrent users together"),
    "ctx_per_slot": ("kv_cache_mib", "lower", "KV memory is allocated for every slot's whole context"),
    "threads": ("users:service_s", "lower", "decode and prefill split their work across threads"),
    "batch": ("users:prefill_s", "lower", "prefill evaluates the prompt in logical batches of -b tokens"),
    "ubatch": ("users:prefill_s", "lower", "smaller physical batches shrink compute buffers: do they slow prefill?"),
    "cache_type_k": ("kv_cache_mib", "lower", "a q8_0 K cache stores ~1 byte per element instead of 2"),
    "cache_reuse": ("shift_cached_tokens", "higher", "the second request's doc2 is cached, at another position"),
}


def predicted_queue_share(concurrency: int, n_requests: int) -> float:
    """Share of E2E spent queueing with ONE slot, `concurrency` closed-loop users and
    equal service times S: the first round waits 0, S, ..., (C-1)S; every later request
    waits for the C-1 others ahead of it. Queue share = total wait / (total wait + N S)."""
    c, n = concurrency, max(n_requests, concurrency)
    wait = c * (c - 1) / 2 + (n - c) * (c - 1)
    return wait / (wait + n)


def plot_stages(sessions: dict[str, dict[str, Any]], ax, workload: str = "users"):
    """Mean seconds per request in queue, prefill and decode, one stacked bar per session,
    with the baseline's mean E2E as the reference line."""
    names, parts = list(sessions), {"queue": [], "prefill": [], "decode": []}
    for n in names:
        sh = stage_shares(sessions[n]["runs"][workload].traces)
        for k in parts:
            parts[k].append(float(sh[f"{k}_s"].mean()))
    left = [0.0] * len(names)
    for k, color in zip(parts, ("tab:red", "tab:orange", "tab:blue")):
        ax.barh(names, parts[k], left=left, color=color, label=k)
        left = [a + b for a, b in zip(left, parts[k])]
    ax.axvline(left[0], ls="--", color="k", label=f"baseline mean E2E {left[0]:.2f} s")
    ax.set(xlabel="mean seconds per request", title=f"Where E2E goes ({workload} workload), per trial")
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize=8)
    return ax


_KV_RE = re.compile(r"llama_kv_cache\S*:\s+size\s*=\s*([\d.]+)\s*MiB")


def kv_cache_mib_from_log(text: str) -> float:
    """KV-cache MiB llama-server allocated, summed over its `llama_kv_cache: size = ...`
    log lines (NaN if the build logs none)."""
    found = [float(x) for x in _KV_RE.findall(text)]
    return float(sum(found)) if found else math.nan


def compute_mib_from_log(text: str) -> float:
    """Compute-buffer MiB (scratch for one forward pass; grows with -ub), NaN if not logged."""
    found = [float(x) for x in re.findall(r"compute buffer size\s*=\s*([\d.]+)\s*MiB", text)]
    return float(sum(found)) if found else math.nan

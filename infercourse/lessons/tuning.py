"""Tuning: find the bottleneck first, change one knob, measure percentiles, keep or revert.

A knob that "feels faster" after one request proves nothing: timings on a shared machine
move by tens of percent on their own. The discipline:

1. Locate the bottleneck from the traces before touching anything: how much of each
   request's end-to-end time (E2E) was **queueing** (waiting for a free slot), **prefill**
   (the server's own `timings.prompt_ms`) and **decode** (first token to last)?
2. Change exactly one knob aimed at the biggest share.
3. Measure the same workload again and compare a percentile *with its interval*: keep the
   change only if the whole bootstrap interval moved the right way; otherwise revert.
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
import json
import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from infercourse.core import metrics, summary
from infercourse.core.trace import RequestTrace
from infercourse.core.types import Request
from infercourse.measure import bench
from infercourse.measure.results import new_run_dir

__all__ = ["ServerConfig", "serve_and_measure", "tuning_workloads", "stage_shares", "bottleneck", "decide", "TuningLog",
           "kv_cache_mib_from_log", "predicted_kv_mib", "PROBLEMS", "problems_frame", "quality_drop",
           "ADVICE"]


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
        extra = ["-b", self.batch, "-ub", self.ubatch, "-ctk", self.cache_type_k,
                 "--cache-reuse", self.cache_reuse]
        return LlamaServer(model, n_parallel=self.n_parallel, ctx_size=self.ctx_per_slot * self.n_parallel,
                           threads=self.threads, extra_args=[str(a) for a in extra])


def serve_and_measure(config: ServerConfig, workloads: dict[str, Any], *, results_root=None,
                      model=None, **run_kw: Any) -> dict[str, Any]:
    """Start llama-server with `config`, run each named workload through `bench.run`, stop it.

    Returns {"config", "runs": {name: BenchResult}, "rss_mb": server RSS after the runs,
    "kv_cache_mib": the KV cache size the server logged}.

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
            out["runs"][name] = bench.run(engine, wl, label=name, progress=False,
                                          out_dir=new_run_dir(results_root, name),
                                          conditions={"server_config": asdict(config)}, **{**run_kw, **kw})
        try:
            out["rss_mb"] = psutil.Process(srv.pid).memory_info().rss / 1e6
        except (psutil.Error, TypeError, ValueError):
            out["rss_mb"] = math.nan
        out["kv_cache_mib"] = kv_cache_mib_from_log(srv.log_path.read_text(errors="replace"))
    return out


def tuning_workloads(tokenize, *, n_requests: int, concurrency: int, prompt_tokens: int,
                     max_tokens: int, long_tokens: int) -> dict[str, tuple[list[Request], dict]]:
    """The workloads every trial runs, so before and after are always the same requests.

    - `users`: `n_requests` distinct prompts of `prompt_tokens`, `concurrency` users at once.
    - `shift`: two requests one after the other: [doc1, doc2, question], then [doc2,
      question] (an agent that dropped an old tool result): doc2's KV is still cached, but
      at another position, which only `--cache-reuse` can use; the first one is also a
      long cold prefill (`long_tokens`) for the prompt-batch knobs.

    Args:
        tokenize: the model's tokenizer (exact-length prompts).
    """
    from infercourse.measure.workloads import exact_length_prompt
    chat = lambda text, n: Request(messages=[{"role": "user", "content": text}],  # noqa: E731
                                   max_tokens=n, ignore_eos=True)
    users = [chat(exact_length_prompt(prompt_tokens, tokenize, seed=i), max_tokens) for i in range(n_requests)]
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


def decide(before, after, metric: str = "ttft_s", q: int = 50, *, goal: str = "lower") -> dict[str, Any]:
    """Keep or revert: keep only if the after-percentile's interval lies wholly on the
    better side of the before-percentile's interval. Overlapping intervals are noise; a
    percentile with too few samples for an interval (p95 needs 72) cannot justify a change.

    Args:
        before, after: `per_request_frame`s (e.g. `BenchResult.df`).
        metric, q: the column and percentile that define "better" (intervals from
            `core.summary`: distribution-free order statistics).
        goal: "lower" (latencies) or "higher" (speeds, counts).
    """
    if goal not in ("lower", "higher"):
        raise ValueError(f"goal must be 'lower' or 'higher', got {goal!r}")
    b, a = (summary.summarize(d, [metric]).loc[metric] for d in (before, after))
    p, lo, hi = f"p{q}", f"p{q}_lo", f"p{q}_hi"
    out = {"metric": metric, "q": q, "before": float(b[p]), "after": float(a[p]),
           "before_ci": (float(b[lo]), float(b[hi])), "after_ci": (float(a[lo]), float(a[hi])),
           "change": float(a[p] / b[p] - 1) if b[p] else math.nan}
    if any(math.isnan(x) for x in (*out["before_ci"], *out["after_ci"])):
        need = summary.min_n(q / 100)
        return {**out, "decision": "revert",
                "why": f"n too small for a p{q} interval (needs {need} requests): no evidence, keep the old setting"}
    better = a[hi] < b[lo] if goal == "lower" else a[lo] > b[hi]
    worse = a[lo] > b[hi] if goal == "lower" else a[hi] < b[lo]
    why = ("better beyond noise" if better else "worse beyond noise" if worse else
           "intervals overlap: within noise, so keep the old setting")
    return {**out, "decision": "keep" if better else "revert", "why": why}


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
    target before/after (a percentile with its interval, or a scalar), the guard, the
    decision and why. `current` / `best` are the config and session kept so far.

    Args:
        folder: results folder (created); an existing log is appended to, never rewritten.
        guard: a `"workload:metric"` whose p50 must not get worse beyond noise for a
            change to be kept, whatever its target (a memory saving that slows users is
            a trade-off to decide knowingly, not a silent keep).
    """

    def __init__(self, folder: str | Path, *, guard: str = "users:e2e_s"):
        self.path = Path(folder) / "log.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.guard = guard
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
        self.best = session
        return self._append({"trial": "baseline", "knob": None, "config": asdict(session["config"]),
                             "run_dirs": self._dirs(session), "decision": "baseline", "why": note})

    def trial(self, knob: str, session: dict[str, Any], *, target: str = "users:e2e_s", q: int = 50,
              goal: str = "lower", expected: str = "") -> dict[str, Any]:
        """Compare a one-knob change with the kept session; keep or revert; append the line.

        Args:
            knob: the ServerConfig field that changed (checked: exactly that one).
            session: `serve_and_measure` output under the changed config.
            target: `"workload:metric"` (percentile `q` with its interval, see
                `decide`) or a session scalar such as "kv_cache_mib" (lower by > 1 %).
            goal: "lower" or "higher" is better for the target.
            expected: the hypothesis: why this knob should help (logged).
        """
        cur, new = asdict(self.current), asdict(session["config"])
        changed = [k for k in new if cur[k] != new[k]]
        if changed != [knob]:
            raise ValueError(f"trial must change exactly {knob!r} from the kept config; it changes {changed}")
        (b, metric), (a, _) = _target(self.best, target), _target(session, target)
        if metric is not None:
            d = decide(b, a, metric, q, goal=goal)
        else:
            better = a < 0.99 * b if goal == "lower" else a > 1.01 * b
            d = {"metric": target, "q": None, "before": b, "after": a, "change": a / b - 1 if b else math.nan,
                 "decision": "keep" if better else "revert",
                 "why": "better (a deterministic reading)" if better else "not better"}
        gb, gm = _target(self.best, self.guard)
        g = decide(gb, _target(session, self.guard)[0], gm, 50)
        d["guard"] = f"{self.guard} p50 {g['before']:.3g} -> {g['after']:.3g} ({g['why']})"
        if d["decision"] == "keep" and g["why"] == "worse beyond noise" and target != self.guard:
            d.update(decision="revert", why=f"target better, but {self.guard} p50 worse beyond noise")
        entry = self._append({"trial": f"{knob}={new[knob]}", "knob": knob, "from": cur[knob], "to": new[knob],
                              "config": new, "run_dirs": self._dirs(session), "target": target,
                              "expected": expected, **d})
        if d["decision"] == "keep":
            self.best = session
        return entry

    def frame(self) -> pd.DataFrame:
        """The log as a table, oldest first (read back from disk: what a colleague sees)."""
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        cols = ["trial", "target", "before", "after", "change", "guard", "decision", "why", "expected"]
        return pd.DataFrame(rows).reindex(columns=cols)


_KV_RE = re.compile(r"llama_kv_cache\S*:\s+size\s*=\s*([\d.]+)\s*MiB")


def kv_cache_mib_from_log(text: str) -> float:
    """KV-cache MiB llama-server allocated, summed over its `llama_kv_cache: size = ...`
    log lines (NaN if the build logs none)."""
    found = [float(x) for x in _KV_RE.findall(text)]
    return float(sum(found)) if found else math.nan


_KV_BYTES = {"f16": 2.0, "bf16": 2.0, "f32": 4.0, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
             "q4_1": 20 / 32, "q4_0": 18 / 32}


def predicted_kv_mib(card, config: ServerConfig) -> float:
    """KV cache the config should allocate: -c tokens x (K bytes + V bytes) per token, with
    K in `cache_type_k` and V in f16 (block types counted with their scales)."""
    if config.cache_type_k not in _KV_BYTES:
        raise ValueError(f"unknown cache type {config.cache_type_k!r}; choose from {sorted(_KV_BYTES)}")
    per_token = card.kv_bytes_per_token((_KV_BYTES[config.cache_type_k] + 2.0) / 2)
    return per_token * config.ctx_per_slot * config.n_parallel / 2**20


# The study plan's six classic problems: symptom -> where to look first -> knobs.
PROBLEMS = {
    "out of memory": ("the server dies at start or under load; RSS near the limit",
                      "memory = weights + KV (-c x bytes/token) + compute buffers", "-c, -ctk/-ctv, -np, a smaller quantization"),
    "slow first token": ("TTFT high, decode fine", "queue vs prefill share of TTFT",
                         "-np (queue), -b/-ub and prefix reuse (prefill), shorter prompts"),
    "low decode throughput": ("tokens/s far under the bandwidth ceiling", "decode share; MBU",
                              "-t threads, quantization, batching (-np with concurrent users)"),
    "P95 jitter": ("p95 far above p50", "queue share per request; noisy neighbours",
                   "-np, admission control, pinning threads, max_tokens"),
    "quality drop after quantization": ("answers change or degrade", "perplexity on a fixed text vs the original",
                                        "a bigger quantization (Q8_0/Q6_K), an imatrix, keep embeddings in 8 bits"),
    "fast locally, slow in production": ("one-user test fine, users complain", "TTFT under the real arrival pattern",
                                         "capacity (slots, replicas), prefix caching, the same flags as the test"),
}


def problems_frame(evidence: dict[str, str]) -> pd.DataFrame:
    """The six problems as a table, with what this notebook measured for each (or why not).

    Args:
        evidence: {problem: one computed sentence}; problems missing get "not measured here".
    """
    unknown = set(evidence) - set(PROBLEMS)
    if unknown:
        raise ValueError(f"unknown problem(s) {sorted(unknown)}; choose from {list(PROBLEMS)}")
    rows = [{"problem": p, "symptom": s, "look at first": look, "knobs": knobs,
             "measured here": evidence.get(p, "not measured here")} for p, (s, look, knobs) in PROBLEMS.items()]
    return pd.DataFrame(rows).set_index("problem")


def quality_drop(qtype: str = "Q2_K", *, words: int = 150, n_threads: int = 2) -> dict[str, Any]:
    """Perplexity of the original Q4_1 file vs a re-quantized one on the same fixed text,
    and the per-token NLL difference with its standard error (paired, same tokens).

    Args:
        qtype: a llama.cpp quantization type, derived once from the F16 GGUF.
        words: words of the course's evaluation prose scored.
    """
    from infercourse.measure.workloads import eval_text
    from infercourse.models.formats import quantized_gguf
    from infercourse.models.modelcard import model_card
    from infercourse.models.quality import token_nlls
    text = " ".join(eval_text().split()[:words])
    path = quantized_gguf(qtype)
    ids_a, a = token_nlls(None, text, n_threads=n_threads)
    ids_b, b = token_nlls(path, text, n_threads=n_threads)
    if ids_a != ids_b:
        raise ValueError("the two files tokenize the text differently: NLLs are not paired")
    d = b - a
    return {"qtype": qtype, "tokens": len(d), "ppl_original": float(np.exp(a.mean())),
            "ppl_quantized": float(np.exp(b.mean())), "nll_diff": float(d.mean()),
            "nll_diff_se": float(d.std(ddof=1) / np.sqrt(len(d))),
            "bits_original": model_card(None).bits_per_weight, "bits_quantized": model_card(path).bits_per_weight}

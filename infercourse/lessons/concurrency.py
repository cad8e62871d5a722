"""Serving many users at once: Little's law, queueing, and why batching pays (notebook 10).

One user sees latency; a server sees *throughput* too, and the two trade against each
other. Three ideas carry the lesson:

- **Little's law**: requests in the system L = arrival rate λ × time each spends W. A
  closed loop of N users always has L = N, so its λ is N / W: throughput is bought with
  concurrency until W starts to grow. An open loop fixes λ; when λ exceeds what the
  server can finish, the queue (and W) grows without bound.
- **Batching pays while decode is memory-bound**: one decode step streams every weight
  from memory for *one* token per sequence. With B sequences in the batch the same read
  serves B tokens, so arithmetic intensity (FLOPs per byte) grows with B, and so does
  throughput, until the machine's FLOP/s, not its bandwidth, is the limit.
  `batch_ceiling` computes both ceilings; quantized weights cost extra arithmetic
  (dequantization) per byte, so a Q4 file reaches the compute wall at a smaller B.
- **Continuous batching**: llama-server's slots join the running batch as soon as a
  request arrives (`-cb`, the default); without it (`-nocb`), a new request waits for
  the batch in flight to finish, and its TTFT shows the wait.

The knee of the throughput-latency curve is where added concurrency stops buying
throughput and only buys latency; goodput (requests that met the SLO, per second) is
the number to tune for.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from infercourse.core import summary
from infercourse.core.types import Request
from infercourse.measure import bench, roofline
from infercourse.measure.workloads import Workload, exact_length_prompt
from infercourse.models.embedded import vocab_tokenizer

__all__ = ["fixed_workload", "batch_ceiling", "np_sweep", "vllm_sweep", "staggered", "littles_law", "cb_compare",
           "open_loop", "knee", "goodput_by_level", "plot_throughput_latency"]


def fixed_workload(prompt_tokens: int, max_tokens: int, n: int, *, model: str | Path | None = None,
                   seed: int = 0) -> Workload:
    """`n` distinct raw prompts of exactly `prompt_tokens` tokens (the GGUF's own vocabulary),
    each forced to `max_tokens` output tokens: every request costs the same, so differences
    come from the load, not the inputs. Send them with `api="completions"`.

    Args:
        prompt_tokens, max_tokens: per request.
        n: how many distinct prompts (distinct first words: no prefix-cache reuse).
        model: the GGUF whose tokenizer counts (None: the embedded model).
    """
    tok = vocab_tokenizer(model)
    reqs = tuple(Request(prompt=exact_length_prompt(prompt_tokens, tok, seed=seed + i), max_tokens=max_tokens,
                         ignore_eos=True, seed=seed) for i in range(n))
    return Workload(f"fixed-{prompt_tokens}in-{max_tokens}out-x{n}", reqs)


def batch_ceiling(card: Any, machine: dict[str, Any], batch_sizes: Sequence[int], context: int = 0) -> pd.DataFrame:
    """Aggregate decode ceiling when B sequences share each pass over the weights.

    memory bound: B x bandwidth / bytes per decoded token (weights + KV read once per step)
    compute bound: FLOP/s / (2 x params)   (every token still costs 2 FLOPs per parameter)
    The ceiling is the lower of the two; the crossover B is the machine's balance point.

    Args:
        card: the model card; machine: `roofline.probe()` output.
        batch_sizes: sequences decoded together.
        context: tokens already cached per sequence.
    """
    per_token = roofline.bytes_per_decoded_token(card, context)
    compute = roofline.prefill_ceiling_tok_per_s(machine["matmul_gflops_f32"], card)
    rows = []
    for b in batch_sizes:
        mem = b * machine["bandwidth_gbs"] * 1e9 / per_token
        rows.append({"batch": b, "flops_per_byte": roofline.arithmetic_intensity(card, b),
                     "memory_bound_tok_per_s": mem, "compute_bound_tok_per_s": compute,
                     "ceiling_tok_per_s": min(mem, compute), "bound": "memory" if mem < compute else "compute"})
    return pd.DataFrame(rows).set_index("batch")


def _server(model, n_parallel: int, ctx_per_slot: int, threads: int | None, extra: Sequence[str]):
    from infercourse.servers import LlamaServer
    return LlamaServer(model, n_parallel=n_parallel, ctx_size=n_parallel * ctx_per_slot, threads=threads,
                       extra_args=extra)


def _row(r: bench.BenchResult, **labels: Any) -> dict[str, Any]:
    ok = r.df[r.df["status"] == "ok"]
    row = {**labels, **summary.throughput(r.df), "error_rate": summary.error_rate(r.df)}
    for m in ("ttft_s", "tpot_s", "e2e_s"):
        for q in (50, 95):
            row[f"{m}_p{q}"] = float(np.nanpercentile(ok[m], q)) if len(ok) else np.nan
    row["e2e_s_mean"] = float(ok["e2e_s"].mean()) if len(ok) else np.nan
    return row


def np_sweep(workload: Workload, levels: Sequence[int], *, requests_per_level: int, model=None,
             threads: int | None = None, ctx_per_slot: int = 512, extra_args: Sequence[str] = (),
             out_dir: str | Path | None = None) -> tuple[pd.DataFrame, list[bench.BenchResult]]:
    """For each level N: a llama-server with N slots (`-np N`) loaded by N closed-loop users.

    Returns one row per level (throughput, p50/p95 TTFT/TPOT/E2E, mean E2E) and the runs.

    Args:
        workload: requests (e.g. `fixed_workload`), cycled.
        levels: concurrent users = slots.
        requests_per_level: requests measured per level (after one warm-up).
        model, threads, ctx_per_slot, extra_args: the servers' settings.
        out_dir: each level saves `np<N>/` under it.
    """
    rows, runs = [], []
    for n in levels:
        with _server(model, n, ctx_per_slot, threads, extra_args) as srv:
            r = bench.run(srv.engine(api="completions"), workload, pattern="concurrency", concurrency=n,
                          max_requests=requests_per_level, out_dir=Path(out_dir) / f"np{n}" if out_dir else None,
                          label=f"np{n}", progress=False, conditions={"server": srv.describe()})
        rows.append(_row(r, concurrency=n))
        runs.append(r)
    return pd.DataFrame(rows).set_index("concurrency"), runs


def vllm_sweep(workload: Workload, levels: Sequence[int], *, requests_per_level: int, url: str | None = None,
               out_dir: str | Path | None = None) -> pd.DataFrame:
    """The same closed-loop sweep on vLLM (PagedAttention, continuous batching over as many
    sequences as its KV blocks hold): a running server at `url` (e.g. a GPU box, which may
    be remote: you own it), else vLLM's CPU build started here from its env (float32;
    minutes to start). Returns `bench.sweep`'s table.

    Args:
        workload, levels, requests_per_level, out_dir: as in `np_sweep`.
        url: an OpenAI-compatible vLLM / SGLang server root.
    """
    from infercourse.engines.openai_http import OpenAIHTTPEngine
    srv = None
    if url is None:
        from infercourse.models.formats import hf_folder
        from infercourse.servers import VLLMServer
        srv = VLLMServer(hf_folder()).start()
    try:
        table, _ = bench.sweep(OpenAIHTTPEngine(url or srv.url, api="completions"), workload, levels,
                               requests_per_level=requests_per_level, out_dir=out_dir,
                               allow_remote=url is not None, progress=False)
    finally:
        if srv is not None:
            srv.stop()
    return table


def littles_law(table: pd.DataFrame) -> pd.DataFrame:
    """L = λ W per level: λ = completed requests/s, W = mean time in system (E2E from the
    scheduled send). In a closed loop L should equal the number of users."""
    out = pd.DataFrame({"lambda_req_per_s": table["requests_per_s"], "W_s": table["e2e_s_mean"]})
    out["L_predicted"] = out["lambda_req_per_s"] * out["W_s"]
    out["users"] = table.index
    return out


def staggered(workload: Workload, factors: Sequence[float] = (0.25, 1.0, 2.0)) -> Workload:
    """The workload with output lengths varied (max_tokens x each factor in turn). Identical
    lengths keep closed-loop users in lockstep: all start together and finish together, so
    there is never a request waiting for a running batch, and continuous batching has
    nothing to do. Real users fall out of step; varied lengths make them."""
    reqs = tuple(replace(r, max_tokens=max(1, round(r.max_tokens * factors[i % len(factors)])))
                 for i, r in enumerate(workload.requests))
    return Workload(workload.name + "-staggered", reqs)


def cb_compare(workload: Workload, concurrency: int, *, requests: int, model=None, threads: int | None = None,
               ctx_per_slot: int = 512, out_dir: str | Path | None = None) -> pd.DataFrame:
    """The same load with continuous batching on (`-cb`) and off (`-nocb`). Pass a
    `staggered` workload: with identical lengths the two cannot differ.

    Args:
        workload: requests; concurrency: users = slots; requests: measured per setting.
        model, threads, ctx_per_slot: the server's settings; out_dir: runs saved under it.
    """
    rows = []
    for flag, name in (("-cb", "continuous batching"), ("-nocb", "no continuous batching")):
        with _server(model, concurrency, ctx_per_slot, threads, [flag]) as srv:
            r = bench.run(srv.engine(api="completions"), workload, pattern="concurrency", concurrency=concurrency,
                          max_requests=requests, out_dir=Path(out_dir) / flag.strip("-") if out_dir else None,
                          label=name, progress=False, conditions={"server": srv.describe()})
        rows.append(_row(r, setting=name, flag=flag))
    return pd.DataFrame(rows).set_index("setting")


def open_loop(engine, workload: Workload, rates: Sequence[float], *, requests: int, seed: int = 0,
              out_dir: str | Path | None = None) -> pd.DataFrame:
    """Poisson arrivals at each rate: offered vs achieved rate, and latency from the
    *scheduled* send (queueing included). Above capacity the queue, and TTFT, keep growing.

    Args:
        engine: an HTTP engine on a running server; rates: requests/s offered.
        requests: per rate; seed: the arrival schedule's seed.
    """
    rows = []
    for rate in rates:
        r = bench.run(engine, workload, pattern="poisson", rate_rps=rate, max_requests=requests, seed=seed,
                      out_dir=Path(out_dir) / f"rate{rate:g}" if out_dir else None, label=f"poisson {rate:g}/s",
                      progress=False)
        rows.append(_row(r, offered_req_per_s=rate))
    return pd.DataFrame(rows).set_index("offered_req_per_s")


def knee(table: pd.DataFrame, *, min_gain: float = 0.15) -> int:
    """The last level whose throughput still rose by at least `min_gain` (15 %) over the
    level before: beyond it, more concurrency buys latency, not throughput."""
    tput = table["output_tok_per_s"].to_numpy(float)
    best = table.index[0]
    for i in range(1, len(tput)):
        if tput[i] >= tput[i - 1] * (1 + min_gain):
            best = table.index[i]
        else:
            break
    return int(best)


def goodput_by_level(runs: Sequence[bench.BenchResult], slos: dict[str, float]) -> pd.DataFrame:
    """Goodput per run: share of requests meeting every SLO, and how many per second."""
    import warnings
    rows = []
    for r in runs:
        with warnings.catch_warnings():      # "no request met ..." shows as a 0 in the table
            warnings.simplefilter("ignore", UserWarning)
            g = summary.goodput(r.df, slos)
        rows.append({"run": r.manifest.get("label"), "good_fraction": g["good_fraction"],
                     "goodput_req_per_s": g["goodput_requests_per_s"],
                     "throughput_req_per_s": summary.throughput(r.df)["requests_per_s"]})
    return pd.DataFrame(rows).set_index("run")


def plot_throughput_latency(table: pd.DataFrame, *, latency: str = "ttft_s_p95", slo_s: float | None = None,
                            ceiling_tok_per_s: float | None = None, ax=None, label: str | None = None):
    """Throughput (x) against tail latency (y), one point per level, labelled; the SLO as a
    horizontal line and the batching ceiling as a vertical one."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(6.5, 4))[1]
    ax.plot(table["output_tok_per_s"], table[latency], marker="o", label=label)
    for lvl, x, y in zip(table.index, table["output_tok_per_s"], table[latency]):
        ax.annotate(f"{lvl}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if slo_s:
        ax.axhline(slo_s, color="tab:red", ls="--", lw=1, label=f"SLO {latency} ≤ {slo_s:g} s")
    if ceiling_tok_per_s:
        ax.axvline(ceiling_tok_per_s, color="grey", ls=":", lw=1, label="compute ceiling")
    ax.set(xlabel="throughput (output tokens/s)", ylabel=f"{latency.replace('_s_', ' ')} (s)",
           title="Throughput vs latency (labels: concurrent users)", ylim=(0, None))
    ax.legend(fontsize=8)
    return ax

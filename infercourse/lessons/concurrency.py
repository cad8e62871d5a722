"""Serving many users at once: Little's law, queueing, and why batching pays (notebook 11).

One user sees latency; a server sees *throughput* too, and the two trade against each
other. Three ideas carry the lesson:

- **Little's law**: requests in the system L = arrival rate λ × time each spends W. A
  closed loop of N users always has L = N, so its λ is N / W: throughput is bought with
  concurrency until W starts to grow. An open loop fixes λ; when λ exceeds what the
  server can finish, the queue (and W) grows without bound.
- **Batching shares whatever a step pays once**: one decode step streams every weight
  for *one* token per sequence, so B sequences share that read (and the step's fixed
  overheads), while each still pays its own arithmetic and KV reads. The roofs per batch
  size are `roofline.batch_ceiling`; what bound a run is read from the run
  (`lessons.goodput.limit_sentence`, `measure.regime`).
- **Continuous batching**: llama-server's slots join the running batch as soon as a
  request arrives (`-cb`, the default); without it (`-nocb`), a new request waits for
  the batch in flight to finish, and its TTFT shows the wait.

Reading the curve this module measures (the knee, goodput, what limits it: the regime) is
in `lessons.goodput`.

Every comparison is repeated and interleaved (`measure.noise`): each level runs
`repeats` times in shuffled blocks (`measure.interleave`: the order inside a block is chance) beside
an A/A rerun of the first level, and a gain counts only when a permutation test of the
level against the first level and its rerun says so (at most 5% false positives). Little's law is checked against an
independent L: llama-server's own `requests_processing + requests_deferred`, sampled
during the run.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from infercourse.core import summary
from infercourse.core.types import Request
from infercourse.measure import bench, noise
from infercourse.measure.workloads import Workload, exact_length_prompt
from infercourse.models.embedded import vocab_tokenizer

__all__ = ["fixed_workload", "np_sweep", "one_level", "vllm_sweep", "staggered", "littles_law", "cb_compare",
           "open_loop", "cb_prediction", "cb_sentence"]


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
    # TTFT p50's distribution-free interval (NaN: n < 6)
    row["ttft_s_p50_lo"], row["ttft_s_p50_hi"] = summary.median_interval(ok["ttft_s"]) or (np.nan, np.nan)
    # the share of a request's time spent before its first token (prefill and queueing): the
    # part of end-to-end throughput that is not decode
    row["prefill_share"] = float((ok["ttft_s"] / ok["e2e_s"]).median()) if len(ok) else np.nan
    users = labels.get("concurrency")
    if users:   # aggregate decode rate: N sequences, one token each per TPOT
        row["decode_tok_per_s"] = users / row["tpot_s_p50"] if row["tpot_s_p50"] > 0 else np.nan
    return row


def _queue_length(srv, run_one) -> tuple[bench.BenchResult, float]:
    """Run `run_one()` while sampling llama-server's `requests_processing + requests_deferred`
    every 0.25 s; returns the run and the mean over samples inside its window (NaN if none):
    the L that Little's law predicts, read from the server instead of computed from λW."""
    import tempfile

    from infercourse.ops.sampling import ServerSampler
    with tempfile.TemporaryDirectory() as tmp:
        smp = ServerSampler(srv.url, lambda: None, tmp, interval_s=0.25, gpu=False).start()
        try:
            r = run_one()
        finally:
            smp.stop()
    lo, hi = r.df["scheduled_t"].min(), r.df["end_t"].max()
    q = [x["llamacpp:requests_processing"] + x.get("llamacpp:requests_deferred", 0.0) for x in smp.rows
         if "llamacpp:requests_processing" in x and lo <= smp.t0 + x["t_s"] <= hi]
    return r, float(np.mean(q)) if q else np.nan


def np_sweep(workload: Workload, levels: Sequence[int], *, requests_per_level: int, model=None,
             threads: int | None = None, ctx_per_slot: int = 512, extra_args: Sequence[str] = (),
             out_dir: str | Path | None = None, repeats: int = 1) -> tuple[pd.DataFrame, list[bench.BenchResult]]:
    """For each level N: a llama-server with N slots (`-np N`) loaded by N closed-loop users,
    `repeats` times in shuffled blocks (`measure.interleave`), plus (repeats >= 2) an A/A
    rerun of the first level.

    Returns one row per level (the median over repeats of: throughput, p50/p95 TTFT/TPOT/E2E,
    mean E2E, and `L_server`, the server's own mean requests processing + deferred) and the
    runs (A/A reruns excluded). With repeats >= 2 each row also has `gain` (median paired
    ratio of output tok/s to the first level), `gain_lo`/`gain_hi` and `verdict`
    (`noise.compare_arms`; the A/A band in `attrs["noise_floor"]`, `attrs["noise_floor_text"]`),
    and the same for the aggregate decode rate (`decode_gain`, `decode_verdict`, its band in
    `attrs["decode_noise_floor"]`).

    Args:
        workload: requests (e.g. `fixed_workload`), cycled.
        levels: concurrent users = slots.
        requests_per_level: requests measured per level and repeat (after one warm-up).
        model, threads, ctx_per_slot, extra_args: the servers' settings.
        out_dir: each trial saves `np<N>[-r<rep>]/` under it.
        repeats: trials per level (>= 2 for a noise floor and verdicts).
    """
    def trial(n: int, label: str):
        with _server(model, n, ctx_per_slot, threads, extra_args) as srv:
            r, L = _queue_length(srv, lambda: bench.run(
                srv.engine(api="completions"), workload, pattern="concurrency", concurrency=n,
                max_requests=requests_per_level, out_dir=Path(out_dir) / label if out_dir else None,
                label=label, progress=False, conditions={"server": srv.describe()}))
        return _row(r, concurrency=n, L_server=L), r

    arms = {f"np{n}": n for n in levels}
    aa = "np%d-A/A" % levels[0] if repeats > 1 else None
    if aa:
        arms[aa] = levels[0]
    trials, runs = noise.run_arms(arms, repeats, lambda n, label: trial(n, label.replace("/", "")))
    keep = trials["arm"] != aa
    table = trials[keep].drop(columns=["arm", "rep"]).groupby("concurrency").median()
    table["requests"] = table["requests"].astype(int)
    verdicts, floor = noise.compare_arms(trials, "output_tok_per_s", f"np{levels[0]}", aa, higher_is_better=True)
    if floor is not None:
        for n in levels:
            c = verdicts.get(f"np{n}")
            table.loc[n, ["gain", "gain_lo", "gain_hi"]] = (c.interval.median, c.interval.lo, c.interval.hi) \
                if c else (1.0, 1.0, 1.0)
            table.loc[n, "verdict"] = c.verdict.replace(" faster", " more tok/s") if c else "reference"
        dv, dfloor = noise.compare_arms(trials, "decode_tok_per_s", f"np{levels[0]}", aa, higher_is_better=True)
        for n in levels:
            c = dv.get(f"np{n}")
            table.loc[n, "decode_gain"] = c.interval.median if c else 1.0
            table.loc[n, "decode_verdict"] = c.verdict.replace(" faster", " more decode tok/s") if c else "reference"
        # each rate is judged against its own A/A band: the decode rate's, not the end-to-end one's
        table.attrs.update(noise_floor=floor.floor, noise_floor_text=floor.text(), decode_noise_floor=dfloor.floor)
    return table, [r for r, k in zip(runs, keep) if k]


def one_level(level: int, *, prompt_tokens: int, max_tokens: int, requests: int, model=None,
              threads: int | None = None, out_dir: str | Path | None = None) -> pd.Series:
    """One closed-loop level measured once, outside the sweep: a llama-server with `level`
    slots and `level` users sending fresh prompts of exactly `prompt_tokens` tokens, each
    answer forced to `max_tokens`. Every user sends at least two requests. Returns the row
    `np_sweep` gives a level (`output_tok_per_s`, `decode_tok_per_s`, p50s, `prefill_share`...),
    one trial, so no verdict: read it against the sweep's A/A band.

    Args:
        level: users = slots; prompt_tokens, max_tokens: the one request shape.
        requests: requests measured (raised to 2 x level when fewer).
        model, threads: the server's settings; out_dir: where the run is saved (None: not).
    """
    wl = fixed_workload(prompt_tokens, max_tokens, 2 * level, model=model)
    table, _ = np_sweep(wl, [level], requests_per_level=max(requests, 2 * level), model=model, threads=threads,
                        ctx_per_slot=prompt_tokens + max_tokens + 64, out_dir=out_dir)
    return table.loc[level]


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
    """L = λ W per level or rate: λ = completed requests/s, W = mean time in system (E2E from
    the scheduled send). In a closed loop λW equals the users by construction (an identity,
    not a test); the independent check is `L_server`, the server's own mean count of
    requests processing + deferred, when the table has it (`law_vs_server` = λW / L_server:
    above 1, the client held requests the server never saw: queueing in the client, HTTP)."""
    out = pd.DataFrame({"lambda_req_per_s": table["requests_per_s"], "W_s": table["e2e_s_mean"]})
    out["L_predicted"] = out["lambda_req_per_s"] * out["W_s"]
    if table.index.name == "concurrency":
        out["users"] = table.index
    if "L_server" in table:
        out["L_server"] = table["L_server"]
        out["law_vs_server"] = out["L_predicted"] / out["L_server"]
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
               ctx_per_slot: int = 512, out_dir: str | Path | None = None, repeats: int = 1) -> pd.DataFrame:
    """The same load with continuous batching on (`-cb`) and off (`-nocb`), `repeats` times
    in shuffled blocks (as in `np_sweep`) with (repeats >= 2) an A/A rerun of `-cb`.
    Pass a `staggered` workload: with identical lengths the two cannot differ. One row per
    setting (median over repeats); `attrs["verdict"]` judges TTFT p50 (`noise.compare_arms`;
    a p95 of a handful of requests has no interval), `attrs["comparisons"]` holds TTFT p50,
    E2E p50 and throughput, each a `noise.Comparison` (for `cb_sentence`).

    Args:
        workload: requests; concurrency: users = slots; requests: measured per setting and repeat.
        model, threads, ctx_per_slot: the server's settings; out_dir: runs saved under it.
        repeats: trials per setting.
    """
    names = {"-cb": "continuous batching", "-nocb": "no continuous batching"}

    def trial(flag: str, label: str):
        with _server(model, concurrency, ctx_per_slot, threads, [flag]) as srv:
            r = bench.run(srv.engine(api="completions"), workload, pattern="concurrency", concurrency=concurrency,
                          max_requests=requests, out_dir=Path(out_dir) / label.strip("-") if out_dir else None,
                          label=names[flag], progress=False, conditions={"server": srv.describe()})
        return _row(r, setting=names[flag], flag=flag), r

    arms = {"continuous batching": "-cb", "no continuous batching": "-nocb"}
    aa = "continuous batching (A/A)" if repeats > 1 else None
    if aa:
        arms[aa] = "-cb"
    trials, _ = noise.run_arms(arms, repeats, lambda flag, label: trial(flag, label.replace(" ", "_").replace("/", "")))
    keep = trials["arm"] != aa
    out = trials[keep].drop(columns=["arm", "rep"]).groupby(["setting", "flag"]).median().reset_index("flag")
    comps = {}
    for metric, hib in (("ttft_s_p50", False), ("e2e_s_p50", False), ("output_tok_per_s", True)):
        v, floor = noise.compare_arms(trials, metric, "continuous batching", aa, higher_is_better=hib)
        if floor is not None:
            comps[metric] = v["no continuous batching"]
            if metric == "ttft_s_p50":
                out.attrs.update(verdict=f"TTFT p50: {v['no continuous batching']}", noise_floor=floor.floor,
                                 noise_floor_text=floor.text())
    out.attrs["comparisons"] = comps
    return out.loc[list(names.values())]


def open_loop(engine, workload: Workload, rates: Sequence[float], *, requests: int, seed: int = 0,
              out_dir: str | Path | None = None, server=None) -> pd.DataFrame:
    """Poisson arrivals at each rate: offered vs achieved rate, and latency from the
    *scheduled* send (queueing included). Above capacity the queue, and TTFT, keep growing.
    With `server` (a running `LlamaServer`), `L_server` is its sampled queue length, for
    Little's law on the open loop.

    Args:
        engine: an HTTP engine on a running server; rates: requests/s offered.
        requests: per rate; seed: the arrival schedule's seed.
        server: the server behind `engine`, to sample its queue (None: no `L_server`).
    """
    rows = []
    for rate in rates:
        def run_one(rate=rate):
            return bench.run(engine, workload, pattern="poisson", rate_rps=rate, max_requests=requests, seed=seed,
                             out_dir=Path(out_dir) / f"rate{rate:g}" if out_dir else None,
                             label=f"poisson {rate:g}/s", progress=False)
        r, L = _queue_length(server, run_one) if server is not None else (run_one(), np.nan)
        rows.append(_row(r, offered_req_per_s=rate, L_server=L))
    return pd.DataFrame(rows).set_index("offered_req_per_s")


def cb_prediction(ttft_s: float, tpot_s: float, max_tokens: int, factors: Sequence[float] = (0.25, 1.0, 2.0)) -> dict:
    """What turning continuous batching off should cost, from the arithmetic. Without it a
    user whose answer ends early sends the next request into a batch still running, and it
    waits until the longest answer of that batch ends: (longest - own length) x TPOT, on
    average (max(f) - mean(f)) x max_tokens x TPOT. With it, the request waits about one
    step. Predicted TTFT ratio (no cb / cb) = (TTFT + wait) / TTFT.

    Args:
        ttft_s, tpot_s: TTFT and TPOT with continuous batching at that load (e.g. the sweep's p50s).
        max_tokens: the workload's base output length; factors: `staggered`'s multiples.
    """
    wait = (max(factors) - float(np.mean(factors))) * max_tokens * tpot_s
    return {"wait_s": wait, "ttft_ratio": (ttft_s + wait) / ttft_s}


def cb_sentence(cb: pd.DataFrame, predicted: dict | None = None) -> str:
    """The continuous-batching comparison in words, every metric in the direction it moved:
    TTFT p50, E2E p50 and throughput, each with its verdict (`claims.verdict_sentence`),
    beside the predicted TTFT ratio and whether the A/A band could resolve it."""
    from infercourse.measure import claims
    comps = cb.attrs.get("comparisons", {})
    if not comps:
        return "One run per setting (REPEATS < 2): no A/A floor, so the two settings are not compared."
    names = {"ttft_s_p50": "TTFT p50", "e2e_s_p50": "E2E p50", "output_tok_per_s": "throughput"}
    parts = [claims.verdict_sentence(c, names[m]) for m, c in comps.items()]
    if predicted:
        f, r = cb.attrs.get("noise_floor", float("nan")), predicted["ttft_ratio"]
        can = r > 1 + f
        parts.insert(0, f"The arithmetic predicts TTFT × {r:.2f} without continuous batching (a wait of "
                        f"{predicted['wait_s'] * 1e3:.0f} ms per request); the A/A band is ±{f:.0%}, so this run "
                        + ("could resolve an effect of that size." if can else
                           "could **not** resolve an effect of that size: whatever the verdict, it is not evidence "
                           "about continuous batching on this machine."))
    return "\n".join(f"- {x}" for x in parts)

"""What "fast" means, in numbers: one request's anatomy, then distributions, definitions,
coordinated omission, and the server's own clock.

One request has a timeline: it is *scheduled*, *sent*, waits through prefill until the
first token (TTFT), then receives tokens one gap after another (ITL; their mean after
the first is TPOT) until the end (E2E). Many requests make distributions of each, and a
distribution is summarized by percentiles, not an average: a mean hides the tail a user
at p99 lives in. Percentiles from few samples are uncertain; `core.summary` gives them
distribution-free intervals, or says the sample is too small.

Peer tools name different quantities alike (`peer_table`): GuideLLM's TPOT includes the
first token, vLLM pools every chunk gap into one ITL series, and a chunk is not a token
(`rechunk` shows the same run as a server that flushes k tokens per chunk would stream it).

Coordinated omission (`overload`): a load generator that waits for a free connection
before sending measures latency from the *actual* send, and so never sees the queue its
own waiting built. Measured from the *scheduled* send, the queue appears. `predicted_wait`
is the queueing arithmetic to predict it; `server_vs_client` sets llama-server's own
`timings` beside the client's clock.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd

from infercourse.core import metrics, reconcile, summary
from infercourse.core.trace import RequestTrace, record
from infercourse.core.types import Request
from infercourse.engines.openai_http import OpenAIHTTPEngine
from infercourse.measure import bench, noise
from infercourse.measure.results import new_run_dir
from infercourse.measure.workloads import exact_length_prompt
from infercourse.ops.profiles import Profile, require
from infercourse.servers import LlamaServer

__all__ = ["serve", "requests_for", "one_request", "anatomy", "sequential", "distribution_table", "pooled_tail_by_blocks", "pooled_tail_note",
           "peer_table", "rechunk", "chunking_table", "predicted_wait", "overload", "measured_wait", "wait_table", "server_vs_client",
           "clock_verdicts", "service_drift", "overload_wait", "e2e_p50_s"]


@contextlib.contextmanager
def serve(p: Profile) -> Iterator[OpenAIHTTPEngine]:
    """An engine on the profile's server: its `server_url` if set, else a llama-server
    with ONE slot (so capacity is one request at a time), stopped when the block ends."""
    require(p)
    if p.server_url:
        yield OpenAIHTTPEngine(p.server_url, api="completions")
        return
    with LlamaServer(p.model, n_parallel=1, ctx_size=p.ctx_size, threads=p.threads,
                     extra_args=("-ngl", str(p.n_gpu_layers)) if p.n_gpu_layers else ()) as srv:
        eng = OpenAIHTTPEngine(srv.url, api="completions")
        try:
            yield eng
        finally:
            eng.close()


def requests_for(engine: OpenAIHTTPEngine, p: Profile, n_prompts: int = 4, *, seed: int = 0) -> list[Request]:
    """`n_prompts` raw prompts of exactly `p.prompt_tokens` tokens (the server's own
    tokenizer), each forced to `p.max_tokens` output tokens, no prefix-cache reuse."""
    tok = engine.server_tokenizer()
    return [Request(prompt=exact_length_prompt(p.prompt_tokens, tok, seed=seed + i), max_tokens=p.max_tokens,
                    ignore_eos=True, cache_prompt=False) for i in range(n_prompts)]


def one_request(engine, req: Request) -> RequestTrace:
    """One warm-up, then one request recorded token by token (the path bench times)."""
    for _ in engine.stream(req):
        pass
    return record(engine, req, raise_errors=True)


def anatomy(tr: RequestTrace) -> dict[str, float]:
    """Every latency metric of one request, in seconds (and tok/s), by our definitions."""
    itl = metrics.itl_s(tr)
    n = metrics.output_tokens(tr)
    return {"ttft_s": metrics.ttft_s(tr), "tpot_s": metrics.tpot_s(tr),
            "itl_mean_s": float(np.mean(itl)), "itl_max_s": float(np.max(itl)),
            "e2e_s": metrics.e2e_s(tr), "output_tokens": n, "decode_tok_per_s": metrics.decode_tok_per_s(tr),
            "e2e_tok_per_s": n / metrics.e2e_s(tr)}


def sequential(engine, reqs: list[Request], n: int, results_root: str | Path | None = None,
               label: str = "latency_sequential") -> bench.BenchResult:
    """`n` requests one after another (closed loop, one user): the unloaded distribution.
    No warm-up of its own: run `one_request` first (it warms the server)."""
    return bench.run(engine, reqs, pattern="sequential", max_requests=n, warmup=0, progress=False,
                     label=label, out_dir=new_run_dir(results_root, label))


def distribution_table(df: pd.DataFrame, itl: pd.DataFrame, ci: float = 0.95) -> pd.DataFrame:
    """Mean beside p50/p95/p99 (ms), each percentile with its interval or "n too small".

    Args:
        df: a per-request frame; itl: its `itl_frame` (pooled gaps).
        ci: confidence level of the intervals.
    """
    s = summary.summarize(df, ["ttft_s", "tpot_s", "e2e_s"], ci=ci, itl=itl)

    def cell(m: str, p: int) -> str:
        v, lo, hi = (s.loc[m, f"p{p}{x}"] * 1e3 for x in ("", "_lo", "_hi"))
        if np.isnan(lo):
            return f"{_ms(v)} (n too small: need {summary.min_n(p / 100, ci)})"
        return f"{_ms(v)} [{_ms(lo)}, {_ms(hi)}]"
    return pd.DataFrame({"n": s["count"].astype(int), "mean (ms)": (s["mean"] * 1e3).round(1),
                         **{f"p{p} (ms)": [cell(m, p) for m in s.index] for p in (50, 95, 99)}}, index=s.index)


def _ms(v: float) -> str:
    """Milliseconds in one fixed-point style (no 1.094e+04 beside 412.3): 2 decimals under
    10 ms, 1 under 1,000, none above, with thousands separators."""
    return "nan" if np.isnan(v) else f"{v:,.2f}" if abs(v) < 10 else f"{v:,.1f}" if abs(v) < 1000 else f"{v:,.0f}"


def pooled_tail_by_blocks(itl: pd.DataFrame, q: float = 99, *, ci: float = 0.95, n_boot: int = 2000,
                          seed: int = 0) -> dict[str, float]:
    """The pooled ITL q-th percentile with an interval that keeps each request's gaps together.

    The order-statistic interval of `summary.summarize` assumes the gaps are independent.
    They are not: a stall (the OS preempting the server, a neighbour's burst) slows several
    consecutive gaps of one request, so the slow gaps come in bursts and the effective
    sample is nearer the number of requests than the number of gaps. Resampling whole
    requests (a block bootstrap, one block per request) keeps the bursts intact; when its
    interval is much wider than the independent one, believe the wider.

    Args:
        itl: an `itl_frame` (ok requests are used).
        q: the percentile; ci: confidence level; n_boot, seed: resamples and their seed.
    """
    ok = itl[itl["status"] == "ok"]
    blocks = [g["itl_s"].to_numpy(float) for _, g in ok.groupby("request_id")]
    if len(blocks) < 2:
        return {"p": float("nan"), "lo": float("nan"), "hi": float("nan"), "blocks": len(blocks)}
    rng = np.random.default_rng(seed)
    boots = [np.percentile(np.concatenate([blocks[i] for i in rng.integers(0, len(blocks), len(blocks))]), q)
             for _ in range(n_boot)]
    a = (1 - ci) / 2
    return {"p": float(np.percentile(np.concatenate(blocks), q)), "lo": float(np.quantile(boots, a)),
            "hi": float(np.quantile(boots, 1 - a)), "blocks": len(blocks)}


def pooled_tail_note(itl: pd.DataFrame, ci: float = 0.95) -> str:
    """One honest sentence on the pooled ITL p99's interval: the order-statistic one assumes
    independent gaps; beside it, the block interval (`pooled_tail_by_blocks`) that keeps
    each request's bursts together. Below `summary.min_n` gaps neither is offered."""
    ok = itl[itl["status"] == "ok"]
    need, n = summary.min_n(0.99, ci), len(ok)
    if n < need:
        return (f"{n} pooled gaps: too few for a p99 interval (need {need}) even if they were independent, and they "
                "are not: a stall slows several gaps of one request, so the effective sample is nearer the number of "
                f"requests ({ok['request_id'].nunique()}).")
    row = summary.summarize(ok.assign(status="ok"), [], itl=ok, ci=ci).loc["itl_s"]
    b = pooled_tail_by_blocks(ok, 99, ci=ci)
    wider = (b["hi"] - b["lo"]) > (row["p99_hi"] - row["p99_lo"])
    return (f"p99 {_ms(row['p99'] * 1e3)} ms: [{_ms(row['p99_lo'] * 1e3)}, {_ms(row['p99_hi'] * 1e3)}] if the {n} gaps were "
            f"independent; [{_ms(b['lo'] * 1e3)}, {_ms(b['hi'] * 1e3)}] resampling whole requests ({b['blocks']} blocks), "
            + ("wider: the stalls came in bursts, so trust the block interval." if wider else
               "no wider: this run's stalls did not cluster within requests."))


def _p(x, q) -> float:
    x = pd.Series(x, dtype=float).dropna()
    return float(np.percentile(x, q)) * 1e3 if len(x) else float("nan")


def peer_table(df: pd.DataFrame, itl: pd.DataFrame, q: float = 50) -> pd.DataFrame:
    """One run, each tool's definitions side by side (ms, percentile `q` of each series).

    - infercourse: TTFT from the *scheduled* send; TPOT = (E2E - TTFT)/(n - 1); ITL pooled chunk gaps.
    - vLLM `bench serve`: TTFT from the actual send; TPOT excludes the first token; ITL pooled gaps.
    - GuideLLM: TTFT from request start (= send); TPOT = (last token - start) / n, first
      token *included*; ITL = (last - first) / (n - 1), one mean per request.
    - AIPerf / GenAI-Perf: TTFT from send; "ITL" = (E2E - TTFT)/(n - 1) (our TPOT); per-chunk
      gaps are their "inter chunk latency".

    Args:
        df: a per-request frame (ok requests are used); itl: its `itl_frame`.
        q: the percentile shown.
    """
    ok = df[df["status"] == "ok"]
    gaps = itl[itl["status"] == "ok"]["itl_s"]
    n = ok["output_tokens"].astype(float)
    excl_first = (ok["e2e_from_send_s"] - ok["ttft_from_send_s"]) / (n - 1)   # per request
    incl_first = ok["e2e_from_send_s"] / n            # the stream ends with its last token
    tools = {
        "infercourse": (ok["ttft_s"], ok["tpot_s"], gaps, ok["e2e_s"]),
        "vLLM bench serve": (ok["ttft_from_send_s"], excl_first, gaps, ok["e2e_from_send_s"]),
        "GuideLLM": (ok["ttft_from_send_s"], incl_first, excl_first, ok["e2e_from_send_s"]),
        "AIPerf": (ok["ttft_from_send_s"], excl_first, excl_first, ok["e2e_from_send_s"]),
    }
    names = ["TTFT", "TPOT", "ITL", "E2E"]
    return pd.DataFrame({tool: [_p(x, q) for x in series] for tool, series in tools.items()},
                        index=[f"{m} p{q:g} (ms)" for m in names]).round(1)


def rechunk(traces: list[RequestTrace], k: int) -> list[RequestTrace]:
    """The same tokens at the same times, delivered as a server flushing every `k` tokens
    would: each chunk arrives with its last token. Nothing is re-measured; only the
    grouping changes, which is what a chunk-based metric sees."""
    out = []
    for tr in traces:
        idx = metrics.token_chunks(tr)
        t = [tr.chunk_t[i] for i in idx for _ in range(max(1, tr.chunk_tokens[i]))]
        groups = [t[i:i + k] for i in range(0, len(t), k)]
        out.append(replace(tr, chunk_t=[g[-1] for g in groups], chunk_tokens=[len(g) for g in groups]))
    return out


def chunking_table(traces: list[RequestTrace], k: int) -> pd.DataFrame:
    """The run as streamed beside the same run re-grouped `k` tokens per chunk (`rechunk`):
    per-chunk ITL grows about k-fold; TTFT grows by k - 1 token gaps (the first chunk waits
    for its k-th token), so TPOT, which spreads the time after the first chunk over n - 1
    tokens, falls; E2E and decode speed (tokens after the first chunk / their time) hold."""
    cols = {}
    for name, trs in (("as streamed", traces), (f"{k} tokens per chunk", rechunk(traces, k))):
        df, itl = metrics.per_request_frame(trs), metrics.itl_frame(trs)
        ok = df[df["status"] == "ok"]
        cols[name] = {"tokens per chunk": ok["tokens_per_chunk"].median(), "TTFT p50 (ms)": _p(ok["ttft_s"], 50),
                      "ITL p50, per chunk (ms)": _p(itl["itl_s"], 50),
                      "ITL p50 / tokens in chunk (ms)": _p(itl["itl_s"] / itl["tokens"].clip(lower=1), 50),
                      "TPOT p50 (ms)": _p(ok["tpot_s"], 50), "E2E p50 (ms)": _p(ok["e2e_s"], 50),
                      "decode p50 (tok/s)": ok["decode_tok_per_s"].median()}
    return pd.DataFrame(cols).round(2)


def predicted_wait(n: int, overload: float) -> float:
    """Latency of the n-th of `n` requests, from its scheduled send, in units of one
    request's service time S, when they are scheduled `overload` times faster than one
    server slot can serve them: each arrives every S/overload but leaves every S, so the
    queue grows by S(1 - 1/overload) per request: 1 + (n - 1)(1 - 1/overload)."""
    if overload <= 1:
        return 1.0
    return 1.0 + (n - 1) * (1.0 - 1.0 / overload)


def overload(engine, reqs: list[Request], service_s: float, *, factor: float, n: int,
             client_queue: bool = True, results_root: str | Path | None = None) -> bench.BenchResult:
    """An open-loop run at `factor` x capacity (capacity = 1 / service_s, one slot).

    Args:
        service_s: one request's time alone (e.g. the unloaded median E2E).
        factor: how many times faster than capacity requests are scheduled (> 1: overload).
        n: requests (bounded: the run lasts about n x service_s).
        client_queue: True caps the client at one request in flight, so requests wait in
            the *client* (a tool that waits for a free connection: coordinated omission);
            False sends each on time, so they wait in the *server's* queue instead.
    """
    label = "overload_client_queue" if client_queue else "overload_server_queue"
    return bench.run(engine, reqs, pattern="rate", rate_rps=factor / service_s, max_requests=n,
                     max_in_flight=1 if client_queue else n, warmup=0, progress=False, label=label,
                     max_duration_s=60 + 4 * n * service_s, out_dir=new_run_dir(results_root, label),
                     conditions={"overload": {"factor": factor, "service_s": service_s}})


def server_vs_client(traces: list[RequestTrace]) -> pd.DataFrame:
    """Per quantity, the client's clock and the server's own (`timings` of llama-server),
    as medians over requests (ms or tokens), the median difference, and how many agreed
    within `reconcile`'s tolerance. The difference is the layer between: HTTP, JSON,
    detokenizing, the event loop."""
    rows = [r for tr in traces if tr.status == "ok" for r in reconcile.reconcile(tr).to_dict("records")]
    if not rows:
        return pd.DataFrame(columns=["client", "server", "client - server", "agree"])
    d = pd.DataFrame(rows)
    scale = np.where(d["quantity"].str.endswith("_s"), 1e3, 1.0)
    d[["client", "engine", "diff"]] = d[["client", "engine", "diff"]].mul(scale, axis=0)
    g = d.groupby("quantity")
    out = pd.DataFrame({"client": g["client"].median(), "server": g["engine"].median(),
                        "client - server": g["diff"].median(),
                        "agree": g["ok"].mean().map("{:.0%}".format)})
    out.index = [q.removesuffix("_s") + " (ms)" if q.endswith("_s") else q for q in out.index]
    return out.round(2)


def measured_wait(res: bench.BenchResult) -> dict[str, float]:
    """The last request of an overload run: latency from its schedule and from its send,
    its dispatch delay, the run's p50s of both TTFTs, the service time this run saw and
    the overload it really applied (rate x that time: the machine may have been faster or
    slower than when S was measured). A saturated single slot finishes one request every
    S, wherever the queue is, so S here is the median gap between completions."""
    df = res.df[res.df["status"] == "ok"].sort_values("scheduled_t")
    last = df.iloc[-1]
    service = float(np.median(np.diff(np.sort(df["end_t"].to_numpy(float))))) if len(df) > 1 \
        else float(last["e2e_from_send_s"])
    return {"last_ttft_s": float(last["ttft_s"]), "last_ttft_from_send_s": float(last["ttft_from_send_s"]),
            "last_e2e_s": float(last["e2e_s"]), "last_dispatch_delay_s": float(last["dispatch_delay_s"]),
            "p50_ttft_s": float(df["ttft_s"].median()), "p50_ttft_from_send_s": float(df["ttft_from_send_s"].median()),
            "service_s": service, "overload": float(res.manifest["load"]["rate_rps"]) * service}


def wait_table(waits: dict[str, dict[str, float]]) -> pd.DataFrame:
    """`measured_wait` results side by side, times in ms."""
    t = pd.DataFrame(waits)
    ms = [k for k in t.index if k.endswith("_s")]
    t.loc[ms] = t.loc[ms] * 1e3
    t.index = [k.removesuffix("_s").replace("_", " ") + (" (ms)" if k in ms else " (x capacity)") for k in t.index]
    return t.round(1)


def clock_verdicts(unloaded: pd.DataFrame, loaded: pd.DataFrame, metric: str = "ttft") -> pd.DataFrame:
    """Does an overload run look slower than the unloaded one, on each clock? The A/A noise
    floor comes from the unloaded run itself: its even and odd requests are the same
    configuration, interleaved. Each clock's loaded values are then paired with unloaded
    ones by position (independent draws: under "no difference" each ratio is as likely
    above 1 as below, which is all the median's interval needs) and judged with
    `noise.compare`. Only the loaded run's second half is judged: its first requests found
    the queue still short, which is the point of the lesson, not noise. A send clock that says "within noise" under overload is coordinated
    omission caught in the act.

    Args:
        unloaded, loaded: per-request frames (ok rows are used).
        metric: "ttft" or "e2e": compares `<metric>_s` (from the schedule) and
            `<metric>_from_send_s`.
    """
    base = unloaded[unloaded["status"] == "ok"][f"{metric}_s"].to_numpy(float)
    load = loaded[loaded["status"] == "ok"].sort_values("scheduled_t")
    load = load.iloc[len(load) // 2:]          # the queue builds over the run: judge its second half
    floor = noise.noise_floor(base[0::2][:len(base) // 2], base[1::2][:len(base) // 2])
    rows = {}
    for clock, col in (("from the scheduled send", f"{metric}_s"), ("from the actual send", f"{metric}_from_send_s")):
        x = load[col].to_numpy(float)
        n = min(len(base), len(x))
        c = noise.compare(base[:n], x[:n], floor, labels=("unloaded", "overload"))
        rows[f"{metric.upper()} {clock}"] = {"median overload / unloaded": c.interval.median, "lo": c.interval.lo,
                                             "hi": c.interval.hi, "pairs": c.interval.n,
                                             "verdict": c.verdict.replace("unloaded faster", "overload slower")}
    out = pd.DataFrame(rows).T
    out.attrs["noise_floor_text"] = floor.text()
    return out


def service_drift(unloaded_s: float, wait: dict[str, float], asked: float) -> str:
    """S as the unloaded run measured it against S inside the overload run (its gap between
    completions), and the overload that was really applied. The A/A floor from one run's
    even and odd requests cannot see this: it is drift *between* runs. The sentence flips
    with the direction of the drift and says when there was none to speak of (within 5%)."""
    s2, r = wait["service_s"], wait["service_s"] / unloaded_s
    head = (f"S was {unloaded_s * 1e3:.0f} ms in the unloaded run and {s2 * 1e3:.0f} ms inside the overload run "
            f"({r:.2f}×), so the overload applied was {wait['overload']:.2f}× where {asked:g}× was asked")
    if abs(r - 1) <= 0.05:
        return head + ": the machine ran at about the same speed in both runs (within 5%)."
    return head + (f": the machine was {'slower' if r > 1 else 'faster'} during the overload run (another program "
                   "starting or stopping, or a warmer cache). Compare the last request's wait with the arithmetic "
                   "at the applied overload; the even/odd A/A floor cannot see this drift between runs.")


def overload_wait(p: Profile, service_s: float, *, factor: float, n: int, client_queue: bool = False,
                  results_root: str | Path | None = None) -> float:
    """One more overload run on a fresh server (after one warm-up request): the last
    request's E2E from its scheduled send, in units of that run's own S (`measured_wait`),
    the number `predicted_wait(n, factor)` predicts.

    Args:
        p: the profile (its server, prompt and answer lengths); service_s: one request's
            time alone, which sets the rate (`factor` / service_s).
        factor, n, client_queue, results_root: as in `overload`.
    """
    with serve(p) as engine:
        reqs = requests_for(engine, p)
        for _ in engine.stream(reqs[-1]):   # warm-up, untimed
            pass
        w = measured_wait(overload(engine, reqs, service_s, factor=factor, n=n, client_queue=client_queue,
                                   results_root=results_root))
    return w["last_e2e_s"] / w["service_s"]


def e2e_p50_s(p: Profile, n: int, *, max_tokens: int, results_root: str | Path | None = None) -> float:
    """Median E2E (s) of `n` unloaded requests, one after another on a fresh server (after
    one warm-up), each answer forced to `max_tokens` tokens: the profile with one length
    changed, for a prediction TTFT + (max_tokens - 1) x TPOT to be checked against.

    Args:
        p: the profile; n: requests; max_tokens: forced output tokens per request.
        results_root: where the run is saved (None: not saved).
    """
    q = p.with_(max_tokens=max_tokens)
    with serve(q) as engine:
        reqs = requests_for(engine, q)
        for _ in engine.stream(reqs[-1]):
            pass
        res = sequential(engine, reqs, n, results_root, label=f"latency_sequential_{max_tokens}tok")
    ok = res.df[res.df["status"] == "ok"]
    return float(ok["e2e_s"].median()) if len(ok) else float("nan")

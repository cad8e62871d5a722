"""What "fast" means, in numbers: one request's anatomy, load that outruns the server
(coordinated omission), and the server's own clock.

One request has a timeline: it is *scheduled*, *sent*, waits through prefill until the
first token (TTFT), then receives tokens one gap after another (ITL; their mean after
the first is TPOT) until the end (E2E). Many requests make distributions of each: their
percentiles, tails and each tool's definitions are in `lessons.latency_dist`.

Coordinated omission (`overload`): a load generator that waits for a free connection
before sending measures latency from the *actual* send, and so never sees the queue its
own waiting built. Measured from the *scheduled* send, the queue appears. `predicted_wait`
is the queueing arithmetic to predict it; `clock_verdicts` judges each clock against the
unloaded run and `clock_sentence` says which one saw the overload; `server_vs_client` sets
llama-server's own `timings` beside the client's clock.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd

from infercourse.core import metrics, reconcile
from infercourse.core.trace import RequestTrace, record
from infercourse.core.types import Request
from infercourse.engines.openai_http import OpenAIHTTPEngine
from infercourse.measure import bench, noise
from infercourse.measure.results import new_run_dir
from infercourse.measure.workloads import exact_length_prompt
from infercourse.ops.profiles import Profile, require
from infercourse.servers import LlamaServer

__all__ = ["serve", "requests_for", "one_request", "anatomy", "sequential", "predicted_wait", "overload", "measured_wait",
           "wait_table", "server_vs_client", "clock_blocks", "clock_verdicts", "clock_sentence", "service_drift",
           "overload_measured", "overload_wait", "e2e_p50_s"]


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


def clock_blocks(n_unloaded: int, n_loaded: int) -> int:
    """Blocks `clock_verdicts` can judge: each holds two unloaded requests (an even and the
    next odd one, the A/A) and one request of the overload run's second half.

    Args:
        n_unloaded, n_loaded: ok requests of the unloaded and of the overload run.
    """
    return min(n_unloaded // 2, n_loaded - n_loaded // 2)


def clock_verdicts(unloaded: pd.DataFrame, loaded: pd.DataFrame, metric: str = "ttft") -> pd.DataFrame:
    """Does an overload run look slower than the unloaded one, on each clock?

    The noise comes from the unloaded run itself: its even and odd requests are the same
    configuration, so block i holds unloaded requests 2i and 2i + 1 and the i-th judged
    request of the overload run. If load changed nothing on a clock, which of a block's
    three requests carries the label "overload" is chance, and `noise.compare` counts the
    3^m relabellings that look as extreme (its A/A-rerun test: 3 blocks can pass at 5%,
    where the sign-flip test against a band needs 6; `clock_blocks` gives m). Only the
    overload run's second half is judged: its first requests found the queue still short,
    which is the point of the lesson, not noise. A send clock judged "within noise" while
    the scheduled one is "overload slower" is coordinated omission caught in the act.

    Args:
        unloaded, loaded: per-request frames (ok rows are used).
        metric: "ttft" or "e2e": compares `<metric>_s` (from the schedule) and
            `<metric>_from_send_s`.
    """
    un = unloaded[unloaded["status"] == "ok"]
    load = loaded[loaded["status"] == "ok"].sort_values("scheduled_t")
    m = clock_blocks(len(un), len(load))
    load = load.iloc[len(load) // 2:]          # the queue builds over the run: judge its second half
    if m < 1:
        raise ValueError(f"need 2 unloaded and 1 judged overload request at least, got {len(un)} and {len(load)}")
    rows, floors = {}, []
    for clock, col in (("from the scheduled send", f"{metric}_s"), ("from the actual send", f"{metric}_from_send_s")):
        base = un[col].to_numpy(float)
        a, a2, x = base[0::2][:m], base[1::2][:m], load[col].to_numpy(float)[:m]
        floor = noise.noise_floor(a, a2)       # this clock's own A/A: the test relabels a, a2 and x in each block
        c = noise.compare(a, x, floor, labels=("unloaded", "overload"))
        rows[f"{metric.upper()} {clock}"] = {"median overload / unloaded": c.interval.median, "lo": c.interval.lo,
                                             "hi": c.interval.hi, "blocks": c.interval.n, "p": c.p,
                                             "needs": c.fewest,
                                             "verdict": c.verdict.replace("unloaded faster", "overload slower")}
        floors.append(f"{metric.upper()} {clock}: {floor.text()}")
    out = pd.DataFrame.from_dict(rows, orient="index")      # one dtype per column, so the notebook can round
    out.attrs["noise_floor_text"] = "\n".join(floors)
    return out


def clock_sentence(t: pd.DataFrame) -> str:
    """Which clock saw the overload, from the two rows of `clock_verdicts` (the scheduled
    send first): each clock's ratio and verdict, then what the pair shows. It says when the
    run cannot tell (too few blocks) and when it does not show one clock hiding the wait."""
    def said(name: str, r) -> str:
        head = f"{name}: {float(r['median overload / unloaded']):.2f}× unloaded ({int(r['blocks'])} blocks)"
        v = r["verdict"]
        if v == "overload slower":
            return head + f", **saw the overload** (p = {float(r['p']):.2g}, beyond the unloaded run's own A/A)"
        if v == "within noise":
            return head + f", **did not see it** (p = {float(r['p']):.2g}: within the unloaded run's own A/A noise)"
        if v == noise.TOO_FEW:
            return head + f", **cannot tell**: {int(r['blocks'])} blocks cannot pass a test that needs {int(r['needs'])}"
        return head + f", **{v}** beyond the A/A noise (p = {float(r['p']):.2g})"
    s, a = t.iloc[0], t.iloc[1]
    out = said(str(s.name), s) + "; " + said(str(a.name), a) + ". "
    vs, va = s["verdict"], a["verdict"]
    if noise.TOO_FEW in (vs, va):
        return out + ("This run cannot say which clock saw the overload: each block needs two unloaded requests and "
                      "one from the overload run's second half, so raise `N_REQUESTS` and `CO_REQUESTS`.")
    if vs != "overload slower":
        return out + ("The scheduled clock did not show the overload beyond noise, so this run does not show one "
                      "clock hiding what the other sees.")
    if va == "within noise":
        return out + "The scheduled clock shows the overload and the send clock hides it: coordinated omission."
    if va == "overload slower":
        less = float(a["median overload / unloaded"]) < float(s["median overload / unloaded"])
        return out + ("Both clocks saw a slowdown: " + ("the send clock's is smaller, so it hid part of the wait, "
                      "not all of it." if less else "the send clock's is as large, so here it hid nothing."))
    return out + "The scheduled clock shows the overload; the send clock even reads faster than unloaded."


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


def overload_measured(p: Profile, service_s: float, *, factor: float, n: int, client_queue: bool = False,
                      results_root: str | Path | None = None) -> dict[str, float]:
    """One more overload run on a fresh server (after one warm-up request), read by
    `measured_wait`: the last request's wait, the p50s of both clocks, and the S that run saw.

    Args:
        p: the profile (its server, prompt and answer lengths); service_s: one request's
            time alone, which sets the rate (`factor` / service_s).
        factor, n, client_queue, results_root: as in `overload`.
    """
    with serve(p) as engine:
        reqs = requests_for(engine, p)
        for _ in engine.stream(reqs[-1]):   # warm-up, untimed
            pass
        return measured_wait(overload(engine, reqs, service_s, factor=factor, n=n, client_queue=client_queue,
                                      results_root=results_root))


def overload_wait(p: Profile, service_s: float, *, factor: float, n: int, client_queue: bool = False,
                  results_root: str | Path | None = None) -> float:
    """The last request's E2E from its scheduled send in units of its run's own S
    (`overload_measured`): the number `predicted_wait(n, factor)` predicts. Arguments as
    in `overload_measured`."""
    w = overload_measured(p, service_s, factor=factor, n=n, client_queue=client_queue, results_root=results_root)
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

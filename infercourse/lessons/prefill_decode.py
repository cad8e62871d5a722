"""Prefill vs decode: sweep the prompt length, and put the two phases against their ceilings.

A request has two phases. *Prefill* runs every prompt token through the model at once:
the weights are read from memory once per pass and used for all its tokens, 2 x params FLOPs
per token. *Decode* makes one token per step: every step reads all the weights (and the KV
cache) to do 2 x params FLOPs for a single token.

Arithmetic intensity (FLOPs per byte read) predicts which limit applies: prefill of n tokens
does about 2 x params x n FLOPs per weight_bytes read, decode n = 1. Against the machine's
balance point (FLOP/s / bytes/s) the roofline *predicts* decode waits on memory and prefill
on arithmetic (`roofline_prediction`). The run then says what happened (`phase_regimes`,
`measure.stream_regime.phase_regime`): each phase's share of the bandwidth roof (MBU) and of a
compute roof of its own kernel's data type, and a thread check (`thread_scaling`: 1 and 2
threads, with an A/A rerun). A GPU at batch 1 streams weights near its bandwidth roof; one CPU
thread running llama.cpp's quantized kernels can leave memory idle much of the time.

`prefill_sweep` sends exact-length prompts (a fixed token count, re-tokenized to check)
through `bench.run`, so warm-up, forced output length and result files are the bench's;
each row also carries the engine's own prefill/decode timings for comparison. `ttft_at` and
`e2e_at` re-run one point of it with one setting changed (a longer prompt, a longer answer),
for the exercises that predict a number before measuring it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import pandas as pd

from infercourse.measure import bench
from infercourse.core import reconcile
from infercourse.core.errors import ContextLayerError
from infercourse.measure import roofline
from infercourse.measure.claims import trend_sentence
from infercourse.core.types import Request
# roofline ideas, re-exported: the prefill lesson reaches them as sweeps.* too
from infercourse.measure.results import new_run_dir
from infercourse.measure.workloads import exact_length_prompt, local_tokenizer

__all__ = ["length_requests", "prefill_sweep", "timeline", "measure_ceilings", "roofline_prediction",
           "explain_phases", "thread_scaling", "kernel_roof", "phase_regimes", "ttft_at", "e2e_at"]


def length_requests(engine, lengths: Sequence[int], *, max_tokens: int = 32, repeats: int = 1,
                    tokenize: Callable[[str], list] | None = None, seed: int = 0) -> list[Request]:
    """Raw-text requests whose prompts are exactly each length in tokens, `repeats` each.

    Raw prompts (no chat template) keep the count exact; every prompt has its own word
    order (seeded), and `cache_prompt=False`, so no request reuses another's prefix.
    `ignore_eos` forces `max_tokens` output tokens, so decode is measured over a fixed span.

    Args:
        engine: supplies the tokenizer (or pass `tokenize`).
        lengths: prompt lengths in tokens (BOS included).
        max_tokens: output tokens per request.
        repeats: requests per length (different prompts).
    """
    tok = tokenize or local_tokenizer(engine)
    return [Request(prompt=exact_length_prompt(n, tok, seed=seed + 1000 * r + n), max_tokens=max_tokens,
                    ignore_eos=True, cache_prompt=False, seed=seed)
            for r in range(repeats) for n in lengths]


def prefill_sweep(engine, lengths: Sequence[int], *, max_tokens: int = 32, repeats: int = 1,
                  results_root: str | Path | None = None, label: str = "prefill_sweep",
                  tokenize: Callable[[str], list] | None = None, seed: int = 0) -> pd.DataFrame:
    """TTFT and decode speed against prompt length: one bench run over exact-length prompts.

    Returns `metrics.per_request_frame` rows plus `prompt_len` (the target length) and,
    where the engine reports them, `engine_prefill_s` and `engine_decode_tok_per_s`.
    The run directory is in `df.attrs["run_dir"]`.

    Args:
        engine: an in-process engine (or HTTP engine with `tokenize=` given).
        lengths: prompt lengths in tokens, e.g. (16, 64, 256, 1024).
        max_tokens: forced output tokens per request (the decode span).
        repeats: requests per length.
        results_root: folder to save the run under (e.g. `course.results_dir(...)`).
    """
    reqs = length_requests(engine, lengths, max_tokens=max_tokens, repeats=repeats,
                           tokenize=tokenize, seed=seed)
    res = bench.run(engine, reqs, pattern="sequential", warmup=1, label=label, progress=False,
                    out_dir=new_run_dir(results_root, label),
                    conditions={"sweep": {"lengths": list(lengths), "repeats": repeats,
                                          "max_tokens": max_tokens}})
    df = res.df.copy()
    df["prompt_len"] = [list(lengths)[i % len(lengths)] for i in df["req_index"]]
    views = [reconcile.engine_view(tr.engine_timings) for tr in res.traces]
    df["engine_prefill_s"] = [v.get("prefill_s", float("nan")) for v in views]
    df["engine_decode_tok_per_s"] = [v["decode_tokens"] / v["decode_s"]
                                     if v.get("decode_s") else float("nan") for v in views]
    df.attrs["run_dir"] = str(res.dir)
    return df


def timeline(engine, prompt_tokens: int = 256, max_tokens: int = 32, *,
             results_root: str | Path | None = None, tokenize: Callable[[str], list] | None = None):
    """One request, warmed up and recorded: returns its `RequestTrace` (for
    `plots.token_timeline`): a prefill gap, then one decode step per token."""
    reqs = length_requests(engine, [prompt_tokens], max_tokens=max_tokens, tokenize=tokenize)
    res = bench.run(engine, reqs, pattern="sequential", warmup=1, label="timeline", progress=False,
                    out_dir=new_run_dir(results_root, "timeline"))
    return res.traces[0]


def measure_ceilings(n_threads: int = 1, *, scaling_threads: int | None = None, size_mb: int | None = None,
                     matmul_n: int = 1024, bandwidth: bool = True) -> dict[str, Any]:
    """This machine's bandwidth and FLOP/s *with the engine's thread count*: the course's one
    probe (`roofline.machine_ceilings`: an array sized from the last-level cache, a float32
    matmul on `n_threads`), with `scaling_threads` read too for the thread check.

    Args:
        n_threads: the engine's thread count; scaling_threads: e.g. 2 x n_threads.
        size_mb: bandwidth probe array (None: sized from the cache).
        matmul_n: matrix size for the FLOP/s probe.
        bandwidth: False: the FLOP/s alone (01, 02 and 05 bound a prefill, not a decode).
    """
    return roofline.machine_ceilings(n_threads, scaling_threads=scaling_threads, size_mb=size_mb,
                                     matmul_n=matmul_n, bandwidth=bandwidth)


def roofline_prediction(card: Any, n_tokens: int, balance: float) -> str:
    """What arithmetic intensity alone predicts for a pass of `n_tokens` tokens against the
    machine balance (FLOP/s ÷ bytes/s): "predicts bandwidth-bound" or "predicts compute-bound".
    A prediction, to set beside what the run shows (`phase_regimes`), never a label."""
    side = "compute" if roofline.arithmetic_intensity(card, n_tokens) > balance else "bandwidth"
    return f"predicts {side}-bound"


def explain_phases(df: pd.DataFrame, *, slope_s: float, prefill_ceiling: float,
                   decode_ceiling: Callable[[int], float], even: float = 0.25) -> str:
    """The Explain bullets of a `prefill_sweep`, written from its numbers: how TTFT grew
    against the token count (in proportion, less, or more), prefill against its ceiling,
    decode at the shortest and longest context (a trend judged against the repeats' spread,
    none with one request per length), and which phase was cheaper per token.

    Args:
        df: `prefill_sweep` rows; slope_s: fitted TTFT seconds per prompt token.
        prefill_ceiling: tok/s; decode_ceiling: context → tok/s.
        even: relative band inside which two ratios are called "about" equal.
    """
    by = df.groupby("prompt_len")[["ttft_s", "prefill_tok_per_s", "decode_tok_per_s"]].median()
    lo, hi = int(by.index.min()), int(by.index.max())
    dec, pre, ttft = by["decode_tok_per_s"], by["prefill_tok_per_s"], by["ttft_s"]
    t_ratio, n_ratio = ttft[hi] / ttft[lo], hi / lo
    if t_ratio < n_ratio / (1 + even):
        shape = ("less than in proportion: a fixed part of TTFT (tokenizing, scheduling, the first decode "
                 "step) weighs most on the short prompt")
    elif t_ratio > n_ratio * (1 + even):
        shape = "more than in proportion: a per-token cost that grows with the length (attention) shows"
    else:
        shape = "about in proportion to the tokens"
    spread = df.groupby("prompt_len")["decode_tok_per_s"].agg(lambda v: v.max() / v.min() - 1 if len(v) > 1 else float("nan"))
    floor = None if spread.isna().all() else float(spread.max())
    per_token = pre[hi] / dec[lo]
    if per_token > 1 + even:
        which = f"per token, prefill was the cheaper phase here, **{per_token:.1f}×** decode's pace."
    elif per_token < 1 / (1 + even):
        which = (f"per token, prefill was *not* the cheaper phase here ({per_token:.2f}× decode's pace): "
                 "its kernels reached too few FLOP/s to profit from sharing each read of the weights.")
    else:
        which = f"per token, the two phases cost about the same here ({per_token:.2f}×)."
    return "\n".join([
        f"- TTFT grows from **{ttft[lo] * 1e3:.0f} ms** at {lo} tokens to **{ttft[hi] * 1e3:.0f} ms** at {hi} "
        f"tokens ({t_ratio:.1f}× for {n_ratio:.0f}× the tokens, {shape}); about **{slope_s * 1e3:.2f} ms per "
        f"extra prompt token** (slope of a fitted line).",
        f"- Prefill runs at **{pre[hi]:,.0f} tok/s** on the longest prompt, {pre[hi] / prefill_ceiling:.0%} of "
        f"the float32 matmul ceiling ({prefill_ceiling:,.0f} tok/s).",
        f"- Decode runs at **{dec[lo]:.1f} tok/s** after {lo} prompt tokens and **{dec[hi]:.1f} tok/s** after {hi}: "
        f"model bandwidth utilization (MBU) {dec[lo] / decode_ceiling(lo):.0%} and "
        f"{dec[hi] / decode_ceiling(hi):.0%} of the bandwidth ceiling. "
        + trend_sentence([lo, hi], [dec[lo], dec[hi]], floor, what="Decode speed", x_name="context"),
        f"- One decode step takes **{1e3 / dec[lo]:.1f} ms** for one token; prefill handles a token in "
        f"**{1e3 / pre[hi]:.2f} ms**: {which}"])


# -- what bound each phase: the run's shares of its roofs, and a thread check ----------------------
def thread_scaling(engines: Mapping[int, Any], *, prompt_tokens: int = 256, max_tokens: int = 32, repeats: int = 4,
                   tokenize: Callable[[str], list] | None = None, seed: int = 0) -> pd.DataFrame:
    """Both phases at n and 2n threads, interleaved with an A/A rerun at n: `repeats` blocks,
    each running "n", "n (A/A)" and "2n" once in a shuffled order (`noise.schedule`) on one
    exact-length prompt of its own (no cache). One row per trial: arm, rep, threads,
    prefill_tok_per_s, decode_tok_per_s (client clocks, as the sweep); attrs["threads"] = (n, 2n).

    Args:
        engines: {n: engine on n threads, 2n: the same model on 2n threads}.
        prompt_tokens, max_tokens: the request's shape (both phases long enough to time).
        repeats: blocks (3 at least for the test ever to call a difference).
    """
    from infercourse.core import metrics
    from infercourse.core.trace import record
    from infercourse.measure import noise
    n, m = sorted(engines)
    arms = {f"{n}": n, f"{n} (A/A)": n, f"{m}": m}
    reqs = {rep: length_requests(engines[n], [prompt_tokens], max_tokens=max_tokens, tokenize=tokenize,
                                 seed=seed + 7919 * rep)[0] for rep in range(-1, repeats)}
    for eng in engines.values():                       # warm-up: page-in, first-call set-up
        record(eng, reqs[-1], raise_errors=True)
    rows = []
    for rep, arm in noise.schedule(list(arms), repeats, seed=seed):
        tr = record(engines[arms[arm]], reqs[rep], raise_errors=True)
        rows.append({"arm": arm, "rep": rep, "threads": arms[arm], "prefill_tok_per_s": metrics.prefill_tok_per_s(tr),
                     "decode_tok_per_s": metrics.decode_tok_per_s(tr)})
    out = pd.DataFrame(rows)
    out.attrs["threads"] = (n, m)
    return out


def kernel_roof(by_len: pd.DataFrame, card: Any, machine: dict[str, Any], *, float32_kernel: bool) -> tuple[float, str]:
    """(GFLOP/s, where from): the compute roof of the engine's own kernels. A float32 model
    (transformers) meets the probe's float32 matmul; llama.cpp's quantized kernels multiply
    int8/int16 blocks, which no probe here runs, so their roof is their own best prefill in
    the sweep (`roofline.achieved_gflops`).

    Args:
        by_len: the sweep's medians by prompt length (prefill_tok_per_s).
        card: the model card; machine: `measure_ceilings` output.
        float32_kernel: the engine multiplies float32 weights.
    """
    if float32_kernel:
        return machine["gflops"], machine["gflops_source"]
    n = by_len["prefill_tok_per_s"].idxmax()
    rate = float(by_len["prefill_tok_per_s"][n])
    return roofline.achieved_gflops(rate, card, "prefill"), (
        f"the engine's own prefill, {rate:,.0f} tok/s at {int(n):,} tokens: the fastest its quantized kernels ran in "
        "this sweep, since no probe multiplies int8 blocks as they do")


def _check(checks: pd.DataFrame | None, col: str, bw_ratio: float | None):
    from infercourse.measure import stream_regime
    if checks is None or checks.empty:
        return None
    n, m = checks.attrs["threads"]
    w = checks.pivot(index="rep", columns="arm", values=col)
    return stream_regime.thread_check(w[f"{n}"], w[f"{m}"], w[f"{n} (A/A)"], threads=(n, m), bandwidth_ratio=bw_ratio)


def phase_regimes(by_len: pd.DataFrame, card: Any, machine: dict[str, Any], roof: tuple[float, str], *,
                  checks: pd.DataFrame | None = None, n_batch: int = 512) -> dict[str, Any]:
    """{"decode": PhaseRegime, "prefill": PhaseRegime} (`measure.stream_regime.phase_regime`): decode
    at the shortest context, prefill at the longest prompt, each against the probed bandwidth
    on the engine's threads and `roof`, with the thread check's verdict and A/A band.

    Args:
        by_len: the sweep's medians by prompt length; card: the model card.
        machine: `measure_ceilings` output (with `scaling_threads` for the bandwidth ratio).
        roof: `kernel_roof` output.
        checks: `thread_scaling` output (None: no thread check).
        n_batch: prompt tokens per pass (the weights are read once per pass).
    """
    from infercourse.measure import stream_regime
    lo, hi = int(by_len.index.min()), int(by_len.index.max())
    bw = machine["bandwidth"]
    ratio = None
    if checks is not None and len(bw["by_threads"]) > 1:
        n, m = checks.attrs["threads"]
        ratio = bw["by_threads"][m] / bw["by_threads"][n]
    src = f"a {bw['size_mb']:,} MiB array on {machine['threads']} thread{'s' if machine['threads'] > 1 else ''}"
    out = {}
    for phase, col, rate, nbytes, flops in (
            ("decode", "decode_tok_per_s", by_len["decode_tok_per_s"][lo], roofline.bytes_per_decoded_token(card, lo),
             2 * roofline.decode_params_per_token(card)),
            ("prefill", "prefill_tok_per_s", by_len["prefill_tok_per_s"][hi],
             roofline.bytes_per_decoded_token(card, 0) / min(hi, n_batch), 2 * roofline.prefill_params_per_token(card))):
        check = _check(checks, col, ratio)
        name = f"Decode after {lo:,} prompt tokens" if phase == "decode" else f"Prefill of {hi:,} tokens"
        out[phase] = stream_regime.phase_regime(name, float(rate), bytes_per_token=nbytes, flops_per_token=flops,
                                         bandwidth_gbs=machine["bandwidth_gbs"], compute_gflops=roof[0],
                                         compute_source=roof[1], bandwidth_source=src,
                                         floor=None if check is None else check.floor, threads=check)
    return out


# -- one point again, with one setting changed (the predict-then-measure exercises) ---------------
def _fits(engine, prompt_tokens: int, max_tokens: int) -> None:
    n_ctx = (getattr(engine, "flags", None) or {}).get("n_ctx")
    if n_ctx and prompt_tokens + max_tokens > n_ctx:
        raise ContextLayerError(f"{prompt_tokens} prompt + {max_tokens} output tokens do not fit n_ctx={n_ctx}",
                                hint="ask for fewer tokens, or build the engine with a larger n_ctx")


def ttft_at(engine, n_tokens: int, *, repeats: int = 1, results_root: str | Path | None = None) -> float:
    """Median client TTFT (s) of `repeats` exact-length prompts of `n_tokens`, cache off, one
    output token each (TTFT needs no more), after `prefill_sweep`'s warm-up request.

    Args:
        engine: the engine the sweep ran on.
        n_tokens: prompt length in tokens; with its first output token it must fit n_ctx.
        repeats: prompts measured (different word orders).
        results_root: folder to save the run under.
    """
    _fits(engine, n_tokens, 1)
    df = prefill_sweep(engine, [n_tokens], max_tokens=1, repeats=repeats, results_root=results_root,
                       label=f"ttft-{n_tokens}")
    return float(df["ttft_s"].median())


def e2e_at(engine, prompt_tokens: int, max_tokens: int, *, repeats: int = 1,
           results_root: str | Path | None = None) -> float:
    """Median end-to-end time (s, send to last token) of `repeats` requests of an exact-length
    prompt forced to `max_tokens` output tokens: one request shape, both phases.

    Args:
        engine: the engine the sweep ran on.
        prompt_tokens: prompt length in tokens.
        max_tokens: forced output tokens (prompt + output must fit n_ctx).
        repeats: requests measured (different prompts).
        results_root: folder to save the run under.
    """
    _fits(engine, prompt_tokens, max_tokens)
    df = prefill_sweep(engine, [prompt_tokens], max_tokens=max_tokens, repeats=repeats,
                       results_root=results_root, label=f"e2e-{prompt_tokens}-{max_tokens}")
    return float(df["e2e_s"].median())

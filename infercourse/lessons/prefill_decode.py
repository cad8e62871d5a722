"""Prefill vs decode: sweep the prompt length, and put the two phases against their ceilings.

A request has two phases. *Prefill* runs every prompt token through the model at once:
the weights are read from memory once and used for all n tokens, so it does 2 x params
FLOPs per token and is limited by arithmetic (compute-bound). *Decode* makes one token per
step: every step reads all the weights (and the KV cache) to do 2 x params FLOPs for a
single token, so it is limited by memory bandwidth (bandwidth-bound).

Arithmetic intensity (FLOPs per byte read) says which limit applies: prefill of n tokens
does about 2 x params x n FLOPs per weight_bytes read, decode n = 1. The machine's balance
point is FLOP/s / (bytes/s); a phase whose intensity is below it waits on memory.

`prefill_sweep` sends exact-length prompts (a fixed token count, re-tokenized to check)
through `bench.run`, so warm-up, forced output length and result files are the bench's;
each row also carries the engine's own prefill/decode timings for comparison. `ttft_at` and
`e2e_at` re-run one point of it with one setting changed (a longer prompt, a longer answer),
for the exercises that predict a number before measuring it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

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

__all__ = ["length_requests", "prefill_sweep", "timeline", "measure_ceilings", "bound", "explain_phases",
           "ttft_at", "e2e_at"]


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


def measure_ceilings(n_threads: int = 1, *, size_mb: int = 128, matmul_n: int = 1024) -> dict[str, Any]:
    """This machine's bandwidth and FLOP/s *with the engine's thread count*.

    `roofline.probe` lets numpy's BLAS use every core; a 1-thread engine cannot, so the
    FLOP/s here come from a float32 torch matmul limited to `n_threads` (torch's thread
    setting is restored after), and bandwidth from `n_threads` reader threads.

    Args:
        n_threads: the engine's thread count.
        size_mb: bandwidth probe array size (far above cache sizes).
        matmul_n: matrix size for the FLOP/s probe.
    """
    bw = roofline.memory_bandwidth_gbs(size_mb, threads=n_threads, budget_s=1.5)
    try:
        import torch
    except ImportError:  # without torch, numpy's BLAS (all cores): an upper bound
        return {"bandwidth_gbs": bw["read_gbs"], "gflops": roofline.matmul_gflops(matmul_n),
                "threads": n_threads, "gflops_source": "numpy BLAS, all cores"}
    before = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        gflops = roofline.matmul_gflops(matmul_n, backend="torch", budget_s=1.5)
    finally:
        torch.set_num_threads(before)
    return {"bandwidth_gbs": bw["read_gbs"], "gflops": gflops, "threads": n_threads,
            "gflops_source": f"torch float32 matmul, {n_threads} thread(s)"}


def bound(card: Any, n_tokens: int, balance: float) -> str:
    """"compute-bound" or "bandwidth-bound": a pass of `n_tokens` tokens against the machine
    balance (FLOP/s ÷ bytes/s), from the arithmetic intensity, not from a label."""
    return "compute-bound" if roofline.arithmetic_intensity(card, n_tokens) > balance else "bandwidth-bound"


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
        f"the compute ceiling ({prefill_ceiling:,.0f} tok/s).",
        f"- Decode runs at **{dec[lo]:.1f} tok/s** after {lo} prompt tokens and **{dec[hi]:.1f} tok/s** after {hi}: "
        f"model bandwidth utilization (MBU) {dec[lo] / decode_ceiling(lo):.0%} and "
        f"{dec[hi] / decode_ceiling(hi):.0%} of the bandwidth ceiling. "
        + trend_sentence([lo, hi], [dec[lo], dec[hi]], floor, what="Decode speed", x_name="context"),
        f"- One decode step takes **{1e3 / dec[lo]:.1f} ms** for one token; prefill handles a token in "
        f"**{1e3 / pre[hi]:.2f} ms**: {which}"])


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

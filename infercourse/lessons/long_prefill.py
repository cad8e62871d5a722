"""Long-context prefill: how the prefill rate falls with the prompt, up to a coding agent's size.

A short probe's prefill rate is an optimistic forecast for a long prompt: attention makes
every token score all the tokens before it, so prefill time grows as a + b·n + c·n²
(`measure.prefill_curve`) and the rate n / time(n) falls as n grows. This lesson measures
that curve on llama-server; `lessons.long_prefill_claims` fits the three terms, judges the
settings against the noise, and uses the fit to forecast a real agent's cold first call
(notebook 20 measured them).

How a point is measured (`prefill_curve_run`):

- every request is a **cold prefill**: one slot, `--cache-ram 0`, `cache_prompt: false`, and
  a prompt of its own words (`exact_length_prompt`, exactly n tokens by the model's own
  vocabulary), one output token;
- the prefill time is the **server's own** `timings.prompt_ms` (no HTTP in it), its token
  count `prompt_n`; the client's TTFT from send is kept beside it;
- past the model's trained context the server is extended as notebook 20 does (the model's
  context-length metadata overridden, YaRN rope scaling: `ops.agent_lab.EXTEND_CONTEXT`);
  that changes what the model predicts there, not how much arithmetic a token costs;
- the reference settings (flash attention on, `-ub 512`, `-b 2048`: llama-server's defaults,
  its `-fa auto` resolving to on for the CPU) run every length; flash attention off and
  `-ub 2048` run a few `compare_at` lengths; the reference runs those again (A/A), whose
  spread is the noise floor every other difference is judged against;
- every point is a **fresh server** and one request, so settings can be interleaved: the
  points of one length form a block, run back to back in a seeded random order, and the
  blocks run in a seeded random order too. A machine whose load changes over minutes (a
  shared laptop) then hits the arms of a pair alike, and no length is always measured last.
  llama-server's own start-up warm-up (an empty run) pages the weights in; a warm-up twin of
  a 16k-token prompt would double the run. All servers use one thread count.
"""
from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from infercourse.core import metrics, reconcile
from infercourse.core.types import Request
from infercourse.engines.openai_http import OpenAIHTTPEngine
from infercourse.measure import bench, noise
from infercourse.measure.prefill_curve import PrefillFit, flop_crossover_tokens
from infercourse.measure.results import new_run_dir
from infercourse.measure.workloads import exact_length_prompt
from infercourse.models.embedded import vocab_tokenizer
from infercourse.models.modelcard import model_card
from infercourse.ops.agent_budget import padded_window
from infercourse.ops.agent_lab import extend_flags
from infercourse.servers import LlamaServer

__all__ = ["PrefillConfig", "REFERENCE", "CONFIGS", "SIZES", "model_crossover_tokens",
           "flop_rate_ratio", "length_prompts", "measure_point", "prefill_curve_run", "prefill_at", "plot_curve"]


@dataclass(frozen=True)
class PrefillConfig:
    """One set of llama-server prefill settings.

    Args:
        label: its name in tables and sentences.
        flash_attn: `-fa` on|off|auto (fused attention kernel).
        ubatch: `-ub`, tokens computed together in one pass (the physical batch).
        batch: `-b`, the logical batch (raised to `ubatch` if smaller).
    """
    label: str
    flash_attn: str = "on"
    ubatch: int = 512
    batch: int = 2048

    def args(self) -> list[str]:
        return ["-fa", self.flash_attn, "-ub", str(self.ubatch), "-b", str(max(self.batch, self.ubatch))]


REFERENCE = PrefillConfig("fa on, ub 512")
CONFIGS = (REFERENCE, PrefillConfig("fa off, ub 512", flash_attn="off"), PrefillConfig("fa on, ub 2048", ubatch=2048))
# full: about 6 minutes on a quiet 2-core laptop CPU (2 threads), the 16k point half of it; the
# settings compared at 3 lengths, the fewest the paired test needs ever to call a difference.
# ci: under a minute.
SIZES = {"full": {"lengths": (512, 1024, 2048, 4096, 8192, 16384), "compare_at": (512, 1024, 2048)},
         "ci": {"lengths": (128, 256, 512), "compare_at": (128, 256, 512)}}
_card = functools.lru_cache(maxsize=4)(model_card)   # reading a GGUF's header takes seconds: once per model


def model_crossover_tokens(model: str | Path | None = None, *, full_block: bool = False) -> float:
    """`flop_crossover_tokens` for a model's card: all parameters but the embedding table."""
    c = _card(model)
    return flop_crossover_tokens(c.n_params - c.vocab_size * c.hidden_size, c.n_layers, c.n_heads, c.head_dim,
                                 full_block=full_block)


def flop_rate_ratio(n_lo: int, n_hi: int, model: str | Path | None = None) -> float:
    """The prefill rate at `n_hi` ÷ the rate at `n_lo` that FLOPs alone predict: time per token
    grows as b·(1 + n / n*) with n* = `model_crossover_tokens`, so the rate falls as 1 / (1 + n / n*)
    (no fixed cost, a kernel that skips the masked half)."""
    n_star = model_crossover_tokens(model)
    return (1 + n_lo / n_star) / (1 + n_hi / n_star)


def length_prompts(lengths: Sequence[int], model: str | Path | None = None, seed: int = 0) -> dict[int, str]:
    """{n: a raw prompt of exactly n tokens}, each with its own word order (no shared prefix)."""
    tok = vocab_tokenizer(model)
    return {n: exact_length_prompt(n, tok, seed=seed + n) for n in sorted(set(lengths))}


def measure_point(config: PrefillConfig, n: int, prompt: str, *, ctx: int, model: str | Path | None = None,
                  threads: int | None = None, extra_args: Sequence[str] = (), label: str | None = None,
                  results_root: str | Path | None = None) -> dict:
    """A fresh server with `config`, one cold prefill of `prompt` (`n` tokens), one row: the
    asked length, the server's prompt_n, cache_n and prefill seconds, the client's TTFT from
    send, both rates, and the machine's load average just before.

    Args:
        config: the prefill settings; n, prompt: the length asked and its prompt (`length_prompts`).
        ctx: the slot's window; extra_args: more server flags (`ops.agent_lab.extend_flags`).
        threads: llama-server `-t` (None: its own choice); label: the arm's name.
        results_root: folder for the bench run (manifest + the request's line).
    """
    label, args = label or config.label, [*config.args(), *extra_args]
    slug = f"prefill-{n}-" + "".join(ch if ch.isalnum() else "-" for ch in label)
    load = noise.load_per_core()[0]
    with LlamaServer(model, n_parallel=1, ctx_size=ctx, threads=threads, cache_ram_mib=0, extra_args=args) as srv:
        eng = OpenAIHTTPEngine(srv.url, api="completions", timeout=3600.0)
        try:
            res = bench.run(eng, [Request(prompt=prompt, max_tokens=1, ignore_eos=True, cache_prompt=False)],
                            pattern="sequential", warmup=0, progress=False, sample_s=None, label=slug,
                            out_dir=new_run_dir(results_root, slug),
                            conditions={"prefill_config": asdict(config), "server_args": args, "ctx": ctx,
                                        "threads": threads, "load_1m": load})
        finally:
            eng.close()
    tr = res.traces[0]
    view, ttft = reconcile.engine_view(tr.engine_timings), metrics.ttft_from_send_s(tr)
    pre, got = view.get("prefill_s", np.nan), view.get("prefill_tokens", np.nan)
    return {"arm": label, "config": config.label, "flash_attn": config.flash_attn, "ubatch": config.ubatch,
            "n_asked": n, "prompt_n": got,
            "cache_n": view.get("cached_tokens", np.nan), "prefill_s": pre, "ttft_s": ttft,
            "tok_per_s": got / pre if pre else np.nan, "ttft_tok_per_s": n / ttft if ttft else np.nan,
            "status": tr.status, "load_1m": load, "run_dir": str(res.dir)}


def prefill_curve_run(lengths: Sequence[int] = SIZES["full"]["lengths"],
                      compare_at: Sequence[int] = SIZES["full"]["compare_at"], *,
                      configs: Sequence[PrefillConfig] = CONFIGS, aa: bool = True, threads: int | None = None,
                      model: str | Path | None = None, results_root: str | Path | None = None,
                      seed: int = 0) -> pd.DataFrame:
    """The whole measurement: the first config at every length, the others (and, with `aa`,
    the first again) at `compare_at`; one block per length, blocks and the points inside
    each in a seeded random order (module docstring).

    Returns one row per point (`measure_point`'s columns, `role`: reference, alternative or
    A/A, `block` and `slot`: its place in the order); `attrs` hold the window, the context
    flags, the threads, the machine's contention before the run, the wall time and the
    model's FLOP crossover length (`model_crossover_tokens`). Read it with
    `lessons.long_prefill_claims`.

    Args:
        lengths: prompt lengths for the reference curve (at least 3 for the fit).
        compare_at: lengths (among `lengths`) where the other settings run.
        configs: the reference first, then the alternatives.
        aa: rerun the reference at `compare_at` for the A/A noise floor.
        threads: llama-server `-t` for every server (one count per run).
        model: a GGUF (None: the embedded SmolLM2-135M); seed: prompts' words and the order.
    """
    if not set(compare_at) <= set(lengths):
        raise ValueError(f"compare_at {sorted(compare_at)} must be among lengths {sorted(lengths)}")
    t0, busy = time.perf_counter(), noise.contention()
    ctx = padded_window(max(lengths) + 256)     # the longest prompt, its one token, and slack (llama.cpp's rounding)
    extra = extend_flags(ctx, model)
    prompts = length_prompts(lengths, model, seed)
    ref, *alts = configs
    rng, rows, slot = np.random.default_rng(seed), [], 0
    for block, n in enumerate(int(v) for v in rng.permutation(sorted(set(lengths)))):
        arms = [(ref.label, ref, "reference")]
        if n in compare_at:
            arms += [(c.label, c, "alternative") for c in alts]
            arms += [(ref.label + " (A/A)", ref, "A/A")] if aa else []
        for i in rng.permutation(len(arms)):
            label, cfg, role = arms[int(i)]
            row = measure_point(cfg, n, prompts[n], ctx=ctx, model=model, threads=threads, extra_args=extra,
                                label=label, results_root=results_root)
            rows.append({**row, "role": role, "block": block, "slot": slot})
            slot += 1
    out = pd.DataFrame(rows)
    out.attrs.update(ctx=ctx, context_flags=extra, threads=threads, contention=busy.message, busy=busy.busy,
                     wall_s=time.perf_counter() - t0, flop_crossover_tokens=model_crossover_tokens(model))
    return out


def prefill_at(n: int, run: pd.DataFrame, *, model: str | Path | None = None, seed: int = 1,
               results_root: str | Path | None = None) -> float:
    """Server prefill seconds of one more cold point, `n` tokens, on the reference settings and
    the window, context flags and threads of `run` (a `prefill_curve_run`): a length it did not
    measure, for a predict-then-measure exercise. `n` must fit the run's window."""
    if n + 1 > run.attrs["ctx"]:
        raise ValueError(f"{n} tokens do not fit the run's window of {run.attrs['ctx']}")
    prompt = length_prompts([n], model, seed)[n]
    return measure_point(REFERENCE, n, prompt, ctx=run.attrs["ctx"], model=model, threads=run.attrs["threads"],
                         extra_args=run.attrs["context_flags"], results_root=results_root)["prefill_s"]


def plot_curve(df: pd.DataFrame, fit: PrefillFit, *, extend_to: int | None = None, ax=None):
    """Measured prefill rate per arm against the prompt length, and the fitted curve (to
    `extend_to` tokens, e.g. an agent's first request, dashed past the longest measured)."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(7, 4))[1]
    for arm, g in df[df["status"] == "ok"].groupby("arm"):
        ax.plot(g["prompt_n"], g["tok_per_s"], "o" if (g["role"] == "reference").all() else "x", label=arm)
    n = np.linspace(fit.n_min, fit.n_max, 200)
    ax.plot(n, [fit.rate(v) for v in n], "-", color="0.3", label="fit a + b·n + c·n²")
    if extend_to and extend_to > fit.n_max:
        n2 = np.linspace(fit.n_max, extend_to, 100)
        ax.plot(n2, [fit.rate(v) for v in n2], "--", color="0.3", label="fit, extrapolated")
    ax.set(xlabel="prompt tokens", ylabel="prefill tok/s (server timings)", xscale="log")
    ax.legend(fontsize=8)
    return ax

"""What bound each rung of a quantization ladder: memory, its kernel's arithmetic, or neither.

Fewer bytes per weight raise the bandwidth ceiling, but a file decodes faster only where its
decode was held by memory. Each rung runs its own kernels (Q8_0's int8 dot products, a
K-quant's unpacking of 2- to 6-bit fields and scales of scales, F16's conversion to F32), so
each has its own compute roof, and none is a float32 matmul: `kernel_roofs` reads it from
llama.cpp itself, the file's prefill rate on a long prompt (arithmetic, not memory, sets
that pace: one read of the weights serves the whole pass). `ladder_regimes` then sets every
rung's decode rate against the probed bandwidth (its MBU, from `measure_ladder`) and against
that roof (`measure.stream_regime.phase_regime`); `regime_lines` words it. One decode run per file:
every label is a reading, and says so.
"""
from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from infercourse.core.types import Request
from infercourse.measure import roofline, stream_regime
from infercourse.measure.regime import NEAR_ROOF
from infercourse.measure.workloads import exact_length_prompt

__all__ = ["kernel_roofs", "ladder_regimes", "regime_lines"]


def kernel_roofs(paths: Mapping[str, str | Path], *, n_tokens: int = 256, n_threads: int = 1, repeats: int = 2,
                 n_ctx: int = 512) -> dict[str, float]:
    """{name: prefill tok/s of an exact `n_tokens`-token prompt}, the fastest of `repeats` cold
    prefills (the prompt cache off) after a short warm-up, each file loaded on its own.

    Args:
        paths: {name: GGUF}, e.g. `quantization.ladder_paths`.
        n_tokens: the long prompt (one `n_batch` pass at 512 or fewer).
        n_threads: llama.cpp threads (the ladder's, so the roofs match its decode).
        repeats: cold prefills per file; n_ctx: the context window.
    """
    from infercourse.core.metrics import prefill_tok_per_s
    from infercourse.core.trace import record
    from infercourse.engines.llamacpp import LlamaCppEngine
    out = {}
    for name, path in paths.items():
        gc.collect()
        engine = LlamaCppEngine(path, n_ctx=n_ctx, n_threads=n_threads)
        try:
            record(engine, Request(prompt="warm up", max_tokens=1, cache_prompt=False), raise_errors=True)
            rates = [prefill_tok_per_s(record(engine, Request(prompt=exact_length_prompt(n_tokens, engine.tokenize, seed=r),
                                                              max_tokens=1, cache_prompt=False), raise_errors=True))
                     for r in range(max(1, repeats))]
            out[name] = max(r for r in rates if r)
        finally:
            engine.llm.close()
            del engine
    return out


def ladder_regimes(df: pd.DataFrame, roofs: Mapping[str, float], card: Any, bandwidth_gbs: float, *,
                   n_tokens: int = 256, bandwidth_source: str = "") -> dict[str, stream_regime.PhaseRegime]:
    """{quant: PhaseRegime} of every rung's decode: bytes a token from its bandwidth ceiling
    (weights + KV at the prompts' context), 2 x params FLOPs a token, its own prefill roof.

    Args:
        df: `measure_ladder` rows (quant, decode_tok_per_s, decode_ceiling_tok_per_s).
        roofs: `kernel_roofs` output; card: the model card (params).
        bandwidth_gbs: the bandwidth the ceilings used; n_tokens: the roofs' prompt length.
        bandwidth_source: how it was probed, for the sentence.
    """
    out = {}
    for r in df.itertuples():
        roof = roofs.get(r.quant)
        out[r.quant] = stream_regime.phase_regime(
            f"{r.quant} decode", r.decode_tok_per_s, bytes_per_token=bandwidth_gbs * 1e9 / r.decode_ceiling_tok_per_s,
            flops_per_token=2 * roofline.decode_params_per_token(card), bandwidth_gbs=bandwidth_gbs,
            compute_gflops=roofline.achieved_gflops(roof, card, "prefill") if roof else None,
            compute_source=(f"its own prefill, {roof:,.0f} tok/s on {n_tokens} tokens" if roof else
                            "no long-prompt prefill of this file"), bandwidth_source=bandwidth_source)
    return out


def regime_lines(regimes: Mapping[str, stream_regime.PhaseRegime]) -> str:
    """One line per rung (its label and shares), then which rungs reached half their bandwidth
    roof: the only ones whose speed fewer bytes could raise."""
    lines = [f"- **{q}**: {r.rate:.1f} tok/s, {r.short}." for q, r in regimes.items()]
    bound = [q for q, r in regimes.items() if r.label == "bandwidth-bound"]
    lines.append(f"- Bandwidth-bound rungs (at least {NEAR_ROOF:.0%} of the bandwidth roof): "
                 + (", ".join(bound) if bound else "**none**: on this machine no rung's decode was held by memory, "
                    "so fewer bytes alone could not make it faster") + ". One decode run per file: each label is a "
                 "reading, not judged against a noise band.")
    return "\n".join(lines)

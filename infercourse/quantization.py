"""What a smaller model costs: one quantization ladder, measured on four axes.

Quantization stores each weight in fewer bits: Q8_0 keeps 8-bit integers with one fp16
scale per block of 32 weights; Q4_1 keeps 4-bit integers with a scale *and* an offset per
block; K-quants (Q6_K, Q4_K_M, Q2_K...) group blocks into super-blocks of 256 and quantize
the scales too. Fewer bits mean a smaller file, fewer bytes read per decoded token (so
faster decode where decode is memory-bound) and a model that is slightly different.

`measure_ladder` loads each file in turn and records, per quantization: bytes on disk and
the process memory the load added, prefill and decode speed, perplexity on a fixed text,
and how often its greedy output agrees with a reference file's, plus the decode ceiling
that its bytes per token imply. `levels_per_block` looks inside a tensor to show where a
file really came from: weights dequantized from 4-bit blocks take at most 16 distinct
values per block, whatever the container's dtype.
"""
from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .errors import ModelLayerError

__all__ = ["measure_ladder", "ladder_paths", "greedy_agreement", "rss_bytes",
           "levels_per_block", "paired_nll_difference"]


def rss_bytes() -> int:
    """Resident memory of this process now (bytes): what the OS actually holds for it,
    including touched pages of memory-mapped model files."""
    import psutil
    return psutil.Process().memory_info().rss


def greedy_agreement(reference: Sequence[str], candidate: Sequence[str]) -> float:
    """Fraction of the reference's tokens that the candidate reproduces before it first
    differs (1.0 = identical). Position-wise matching after a divergence would count
    coincidences in shifted text, so we stop at the first difference.

    Args:
        reference: token pieces (one per decoded token) from the reference model.
        candidate: token pieces from the model being judged.
    """
    if not reference:
        raise ValueError("reference output is empty: nothing to agree with")
    n = 0
    for a, b in zip(reference, candidate):
        if a != b:
            break
        n += 1
    return n / len(reference)


def ladder_paths(qtypes: Iterable[str], *, include_original: bool = True) -> dict[str, Path]:
    """{name: GGUF path}: "F16", the requested re-quantizations (derived once by
    `infercourse.formats`), and the embedded original as "Q4_1 (original)"."""
    from .formats import f16_gguf, quantized_gguf
    from .models import embedded_gguf
    paths = {"F16": f16_gguf()}
    if include_original:
        paths["Q4_1 (original)"] = embedded_gguf()
    for q in qtypes:
        paths[q] = quantized_gguf(q)
    return paths


def _run_prompts(engine, prompts, max_tokens):
    """Greedy, fixed-length runs; returns (traces, token pieces per prompt)."""
    from .engines.base import Request
    from .trace import trace_from_events
    traces, pieces = [], []
    for i, p in enumerate(prompts):
        req = Request(messages=[{"role": "user", "content": p}], max_tokens=max_tokens,
                      ignore_eos=True, cache_prompt=False)
        t0 = time.perf_counter()
        events = list(engine.stream(req))
        traces.append(trace_from_events(events, request_id=i, scheduled_t=t0, sent_t=t0))
        pieces.append([e.text for e in events if not e.done])
    return traces, pieces


def measure_ladder(paths: dict[str, str | Path], prompts: Sequence[str], *, max_tokens: int = 32,
                   eval_text: str | None = None, bandwidth_gbs: float | None = None,
                   reference: str = "F16", n_threads: int = 1, n_ctx: int = 512,
                   writer=None):
    """Measure every GGUF in `paths` the same way; one row per quantization.

    Columns: quant, file_type, file_bytes, size_gb, bits_per_weight (from the tensors),
    rss_delta_bytes (resident memory the load and a first request added: weights touched,
    KV cache of `n_ctx`, compute buffers), prefill_tok_per_s and decode_tok_per_s (median
    over prompts), perplexity (on `eval_text`), greedy_agreement (mean over prompts, vs
    `reference`), decode_ceiling_tok_per_s and mbu (when `bandwidth_gbs` is given).
    `df.attrs["token_nlls"]` holds each file's per-token NLLs of `eval_text`.

    Args:
        paths: {name: GGUF path}, e.g. from `ladder_paths`.
        prompts: user messages; each is decoded greedily for exactly `max_tokens` tokens.
        max_tokens: tokens per prompt.
        eval_text: text for perplexity (None: skip perplexity).
        bandwidth_gbs: memory bandwidth for the decode ceiling (single-thread figure when
            n_threads=1).
        reference: the name in `paths` whose outputs the others are compared with.
        n_threads: llama.cpp threads.
        n_ctx: context window (the KV cache is allocated for all of it).
        writer: optional `results.RunWriter`; every request trace is written to it.
    """
    import pandas as pd

    from .engines.llamacpp import LlamaCppEngine
    from .metrics import decode_tok_per_s, prefill_tok_per_s
    from .modelcard import model_card
    from .quality import token_nlls
    from .roofline import decode_ceiling_tok_per_s

    if reference not in paths:
        raise ModelLayerError(f"reference {reference!r} is not in the ladder {list(paths)}",
                              hint="pass reference= one of the names in paths")
    if not prompts:
        raise ValueError("measure_ladder needs at least one prompt")
    # the reference runs first, so every other row can be compared with it
    order = [reference] + [k for k in paths if k != reference]
    rows, ref_pieces, nlls = {}, None, {}
    for name in order:
        path = Path(paths[name])
        card = model_card(path)
        gc.collect()
        rss0 = rss_bytes()
        engine = LlamaCppEngine(path, n_ctx=n_ctx, n_threads=n_threads)
        try:
            _run_prompts(engine, prompts[:1], 4)  # warm-up: page the weights in
            rss1 = rss_bytes()
            traces, pieces = _run_prompts(engine, prompts, max_tokens)
        finally:
            engine.llm.close()
            del engine
        if writer is not None:
            for tr in traces:
                tr.tags.update(quant=name)
                writer.write(tr)
        if ref_pieces is None:
            ref_pieces = pieces
        prompt_ctx = int(np.mean([tr.prompt_tokens for tr in traces])) + max_tokens // 2
        row = {"quant": name, "file_type": card.quantization, "file_bytes": path.stat().st_size,
               "size_gb": path.stat().st_size / 1e9, "bits_per_weight": card.bits_per_weight,
               "rss_delta_bytes": rss1 - rss0,
               "prefill_tok_per_s": float(np.median([prefill_tok_per_s(t) for t in traces])),
               "decode_tok_per_s": float(np.median([decode_tok_per_s(t) for t in traces])),
               "greedy_agreement": float(np.mean([greedy_agreement(r, c)
                                                  for r, c in zip(ref_pieces, pieces)]))}
        if eval_text is not None:
            nlls[name] = token_nlls(path, eval_text, n_threads=n_threads)[1]
            row.update(mean_nll=float(nlls[name].mean()), perplexity=float(np.exp(nlls[name].mean())))
        if bandwidth_gbs:
            ceiling = decode_ceiling_tok_per_s(bandwidth_gbs, card, context=prompt_ctx)
            row.update(decode_ceiling_tok_per_s=ceiling, mbu=row["decode_tok_per_s"] / ceiling)
        rows[name] = row
    df = pd.DataFrame([rows[k] for k in paths])  # back in the caller's order
    df.attrs["token_nlls"] = nlls  # per-token NLLs, for paired comparisons
    return df


def paired_nll_difference(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mean per-token NLL difference a - b (nats) and its standard error.

    Both models score the same tokens, so the difference is taken token by token: the
    text's own hard and easy tokens cancel, and what remains is the models' difference.

    Args:
        a, b: per-token NLLs of the same text under two models (same tokenizer).
    """
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.shape != b.shape:
        raise ModelLayerError(f"NLL arrays differ in length ({a.size} vs {b.size}): the two "
                              "models tokenized the text differently", hint="compare models with one tokenizer")
    d = a - b
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(d.size))


def levels_per_block(gguf_path: str | Path, tensor: str, block: int = 32) -> dict[str, float]:
    """Distinct values per block of `block` consecutive weights in one tensor.

    A 4-bit quantizer (Q4_0, Q4_1) stores each block of 32 weights as 16 possible levels,
    so weights dequantized from it, even when stored as F16, show at most 16 distinct
    values per block; weights trained in 16-bit show nearly `block`.

    Args:
        gguf_path: a GGUF whose `tensor` is stored unquantized (F16/F32/BF16).
        tensor: tensor name, e.g. "blk.0.ffn_down.weight".
        block: weights per block (32 for Q4_0/Q4_1/Q8_0).
    Returns {"max": ..., "mean": ..., "blocks": ...}.
    """
    from gguf import GGUFReader
    reader = GGUFReader(str(gguf_path))
    found = [t for t in reader.tensors if t.name == tensor]
    if not found:
        names = ", ".join(t.name for t in reader.tensors[:6])
        raise ModelLayerError(f"{tensor!r} not in {gguf_path}", hint=f"tensors look like: {names}...")
    t = found[0]
    if t.tensor_type.name not in ("F16", "F32", "BF16"):
        raise ModelLayerError(f"{tensor} is stored as {t.tensor_type.name}; levels_per_block "
                              "reads unquantized tensors", hint="use the F16 GGUF")
    data = np.asarray(t.data).reshape(-1)
    data = data[: data.size // block * block].reshape(-1, block)
    srt = np.sort(data, axis=1)  # distinct values per row = 1 + number of steps in the sorted row
    counts = (np.diff(srt, axis=1) != 0).sum(axis=1) + 1
    return {"max": int(counts.max()), "mean": float(counts.mean()), "blocks": int(counts.size)}

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
values per block, whatever the container's dtype. `tensor_rows` and `tensor_types` read
what each file stores per tensor (a K-quant falls back to 32-weight types for rows that do
not split into 256), which is also what explains its memory: llama.cpp's CPU backend keeps
some block types a second time, repacked for its interleaved kernels. All three read the
file's header with `models.gguf_header` (gguf-py's reader parses every tokenizer entry first,
seconds a file) and map only the weights they look at.

The sentences that say what a ladder showed live in `quant_claims`.
"""
from __future__ import annotations

import gc
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from infercourse import compat
from infercourse.core.errors import ModelLayerError
from infercourse.models.gguf_header import read_header, tensor_data, tensor_table

__all__ = ["measure_ladder", "ladder_paths", "greedy_agreement", "levels_per_block",
           "ladder_table", "tensor_rows", "tensor_types", "file_bits_per_weight", "file_decode_speed"]


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
    `infercourse.models.formats`), and the embedded original as "Q4_1 (original)".

    The quantizer's log (a line or more per tensor, ~1,500 for a K-quant) goes to the
    native log file (`ops.logs.native_log_path()`), not to the caller's output:
    llama-cpp-python prints llama.cpp's log through Python's `sys.stderr`, where a
    descriptor-level redirect cannot catch it, so we redirect `sys.stderr` itself while
    deriving.
    """
    import contextlib

    from infercourse.models.formats import f16_gguf, quantized_gguf
    from infercourse.models.embedded import embedded_gguf
    from infercourse.ops.logs import native_log_path
    log = native_log_path()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as f, contextlib.redirect_stderr(f):
        paths = {"F16": f16_gguf()}
        if include_original:
            paths["Q4_1 (original)"] = embedded_gguf()
        for q in qtypes:
            paths[q] = quantized_gguf(q)
    return paths


def _facts(llm, path: Path) -> dict:
    """What llama.cpp itself reports for a loaded GGUF: weight bytes, parameters, file
    type and the shape fields the KV-cache arithmetic needs (no separate file parse)."""
    import llama_cpp
    from gguf import LlamaFileType
    m, meta = compat.llama_model_ptr(llm), llm.metadata
    arch = meta["general.architecture"]
    weight_bytes, n_params = llama_cpp.llama_model_size(m), llama_cpp.llama_model_n_params(m)
    n_heads = int(meta[f"{arch}.attention.head_count"])
    hidden = int(meta[f"{arch}.embedding_length"])
    ftype = int(meta.get("general.file_type", -1))
    try:
        name = LlamaFileType(ftype).name.removeprefix("MOSTLY_")
    except ValueError:
        name = f"file_type {ftype}"
    return {"file_type": name, "file_bytes": path.stat().st_size, "weight_bytes": weight_bytes,
            "n_params": n_params, "bits_per_weight": 8 * weight_bytes / n_params,
            "n_layers": int(meta[f"{arch}.block_count"]), "head_dim": hidden // n_heads,
            "n_kv_heads": int(meta.get(f"{arch}.attention.head_count_kv", n_heads))}


def ladder_table(paths: dict[str, str | Path], bandwidth_gbs: float | None = None):
    """The ladder before measuring: per file, its type, bytes on disk, weight bytes and
    real bits per weight as llama.cpp loads them, and (given a bandwidth) the decode
    ceiling those bytes imply. Loading is memory-mapped, so this reads headers only.

    Args:
        paths: {name: GGUF path}, e.g. from `ladder_paths`.
        bandwidth_gbs: memory bandwidth in GB/s for `decode_ceiling_tok_per_s`.
    """
    import llama_cpp
    import pandas as pd

    from infercourse.measure.roofline import decode_ceiling_tok_per_s
    rows = []
    for name, path in paths.items():
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False)
        try:
            facts = _facts(llm, Path(path))
        finally:
            llm.close()
        if bandwidth_gbs:
            facts["decode_ceiling_tok_per_s"] = decode_ceiling_tok_per_s(bandwidth_gbs, facts)
        rows.append({"quant": name, "path": str(path), **facts})
    return pd.DataFrame(rows)


def _run_prompts(engine, prompts, max_tokens):
    """Greedy, fixed-length runs; returns (traces, token pieces per prompt)."""
    from infercourse.core.trace import record
    from infercourse.core.types import Request
    traces, pieces = [], []
    for i, p in enumerate(prompts):
        req = Request(messages=[{"role": "user", "content": p}], max_tokens=max_tokens,
                      ignore_eos=True, cache_prompt=False)
        events: list = []
        traces.append(record(engine, req, request_id=i, raise_errors=True, events=events))
        pieces.append([e.text for e in events if not e.done])
    return traces, pieces


def measure_ladder(paths: dict[str, str | Path], prompts: Sequence[str], *, max_tokens: int = 32,
                   eval_text: str | None = None, bandwidth_gbs: float | None = None,
                   reference: str = "F16", n_threads: int = 1, n_ctx: int = 512,
                   writer=None):
    """Measure every GGUF in `paths` the same way; one row per quantization.

    Columns: quant, file_type, file_bytes, size_gb, weight_bytes and bits_per_weight (as
    llama.cpp loaded the tensors),
    rss_delta_bytes, mapped_bytes and other_bytes (the resident memory that loading the file
    and one short request add in a fresh process: in all, through the file's mapping, and the
    rest; `measure.load_memory`), prefill_tok_per_s and decode_tok_per_s (median
    over prompts), perplexity (on `eval_text`), greedy_agreement (mean over prompts, vs
    `reference`), decode_ceiling_tok_per_s and mbu (when `bandwidth_gbs` is given).
    `df.attrs["token_nlls"]` holds each file's per-token NLLs of `eval_text`, and
    `df.attrs["tensor_types"]` each file's `tensor_types`.

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

    from infercourse.engines.llamacpp import LlamaCppEngine
    from infercourse.core.metrics import decode_tok_per_s, prefill_tok_per_s
    from infercourse.measure.load_memory import gguf_load_memory
    from infercourse.models.quality import token_nlls
    from infercourse.measure.roofline import decode_ceiling_tok_per_s

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
        # in a process of its own: here, the previous file's freed memory would blur the reading
        memory = gguf_load_memory(path, n_ctx=n_ctx, n_threads=n_threads)
        gc.collect()
        engine = LlamaCppEngine(path, n_ctx=n_ctx, n_threads=n_threads)
        try:
            _run_prompts(engine, prompts[:1], 4)  # warm-up: page the weights in
            traces, pieces = _run_prompts(engine, prompts, max_tokens)
            facts = _facts(engine.llm, path)
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
        row = {"quant": name, "file_type": facts["file_type"], "file_bytes": facts["file_bytes"],
               "size_gb": facts["file_bytes"] / 1e9, "weight_bytes": facts["weight_bytes"],
               "bits_per_weight": facts["bits_per_weight"], **memory,
               "prefill_tok_per_s": float(np.median([prefill_tok_per_s(t) for t in traces])),
               "decode_tok_per_s": float(np.median([decode_tok_per_s(t) for t in traces])),
               "greedy_agreement": float(np.mean([greedy_agreement(r, c)
                                                  for r, c in zip(ref_pieces, pieces)]))}
        if eval_text is not None:
            nlls[name] = token_nlls(path, eval_text, n_threads=n_threads)[1]
            row.update(mean_nll=float(nlls[name].mean()), perplexity=float(np.exp(nlls[name].mean())))
        if bandwidth_gbs:
            ceiling = decode_ceiling_tok_per_s(bandwidth_gbs, facts, context=prompt_ctx)
            row.update(decode_ceiling_tok_per_s=ceiling, mbu=row["decode_tok_per_s"] / ceiling)
        rows[name] = row
    df = pd.DataFrame([rows[k] for k in paths])  # back in the caller's order
    df.attrs["token_nlls"] = nlls  # per-token NLLs, for paired comparisons
    df.attrs["tensor_types"] = {k: tensor_types(paths[k]) for k in paths}   # what explains memory
    return df


def levels_per_block(gguf_path: str | Path, tensors: Sequence[str], block: int = 32,
                     max_blocks: int | None = 20_000) -> dict[str, dict[str, float]]:
    """Distinct values per block of `block` consecutive weights, for each named tensor.

    A 4-bit quantizer (Q4_0, Q4_1) stores each block of 32 weights as 16 possible levels,
    so weights dequantized from it, even when stored as F16, show at most 16 distinct
    values per block; weights trained in 16-bit show nearly `block`.

    Args:
        gguf_path: a GGUF whose `tensors` are stored unquantized (F16/F32/BF16).
        tensors: tensor names, e.g. ["blk.0.ffn_down.weight"] (the file is parsed once).
        block: weights per block (32 for Q4_0/Q4_1/Q8_0).
        max_blocks: look at the first this many blocks only (None: all; big embeddings
            have about a million).
    Returns {tensor: {"max": ..., "mean": ..., "blocks": ...}}.
    """
    if isinstance(tensors, str):
        raise TypeError("tensors must be a list of names, e.g. [\"blk.0.attn_q.weight\"]")
    found = tensor_table(gguf_path)
    out = {}
    for name in tensors:
        if name not in found:
            raise ModelLayerError(f"{name!r} not in {gguf_path}",
                                  hint=f"tensors look like: {', '.join(list(found)[:6])}...")
        t = found[name]
        if t["type"] not in ("F16", "F32", "BF16"):
            raise ModelLayerError(f"{name} is stored as {t['type']}; levels_per_block "
                                  "reads unquantized tensors", hint="use the F16 GGUF")
        data = np.asarray(tensor_data(gguf_path, t)).reshape(-1)   # BF16's raw bits: distinct as its values
        data = data[: data.size // block * block].reshape(-1, block)[:max_blocks]
        srt = np.sort(data, axis=1)  # distinct values per row = 1 + steps in the sorted row
        counts = (np.diff(srt, axis=1) != 0).sum(axis=1) + 1
        out[name] = {"max": int(counts.max()), "mean": round(float(counts.mean()), 2),
                     "blocks": int(counts.size)}
    return out


def tensor_rows(gguf_path: str | Path):
    """What each kind of weight matrix is stored as, and why: one row per tensor kind
    (the name without its layer number), with its row length (the first GGUF dimension, the
    one blocks run along), whether that length splits into 256-weight K-quant super-blocks,
    the storage type(s) found and the tensor count.

    Args:
        gguf_path: a GGUF file, e.g. a K-quant from `ladder_paths`.
    """
    import re

    import pandas as pd
    rows = [{"tensor": re.sub(r"^blk\.\d+\.", "blk.N.", t["name"]), "row_length": int(t["shape"][0]),
             "type": t["type"]} for t in read_header(gguf_path)[1] if len(t["shape"]) > 1]
    df = pd.DataFrame(rows)
    out = df.groupby("tensor").agg(row_length=("row_length", "first"),
                                   types=("type", lambda x: ", ".join(sorted(set(x)))), count=("type", "size"))
    out.insert(1, "fits_256", out["row_length"] % 256 == 0)
    return out.reset_index()


def tensor_types(gguf_path: str | Path) -> dict[str, dict[str, int]]:
    """{storage type: {"count": tensors, "bytes": their bytes}} of a GGUF, read from its
    tensor table (no weights are loaded): how much of a file each block type holds.

    Args:
        gguf_path: a GGUF file.
    """
    out: dict[str, dict[str, int]] = {}
    for t in read_header(gguf_path)[1]:
        e = out.setdefault(t["type"], {"count": 0, "bytes": 0})
        e["count"] += 1
        e["bytes"] += int(t["n_bytes"])
    return out


def file_bits_per_weight(qtype: str) -> float:
    """Bits per weight of one more quantization of the course's model, as llama.cpp loads it
    (the ladder's `bits_per_weight`: 8 × weight bytes ÷ parameters), derived once from F16.

    Args:
        qtype: a llama.cpp file type, e.g. "Q6_K" or "Q5_0".
    """
    path = ladder_paths([qtype], include_original=False)[qtype]
    return float(ladder_table({qtype: path})["bits_per_weight"].iloc[0])


def file_decode_speed(qtype: str, prompts: Sequence[str], *, max_tokens: int = 24, n_threads: int = 1,
                      repeats: int = 3, n_ctx: int = 512) -> float:
    """Decode tok/s of one more quantization, measured as `measure_ladder` measures each rung:
    loaded with llama.cpp, warmed up, every prompt decoded greedily for exactly `max_tokens`
    tokens; the median over prompts and `repeats` rounds (a single short run on a shared
    machine can be off by a third).

    Args:
        qtype: a llama.cpp file type, derived once from F16 (e.g. "Q5_0").
        prompts: user messages.
        max_tokens: tokens per prompt (forced length).
        n_threads: llama.cpp threads (the ladder's `N_THREADS`, so the two compare).
        repeats: rounds over the prompts.
        n_ctx: context window.
    """
    from infercourse.core.metrics import decode_tok_per_s
    from infercourse.engines.llamacpp import LlamaCppEngine
    if not prompts:
        raise ValueError("file_decode_speed needs at least one prompt")
    path = ladder_paths([qtype], include_original=False)[qtype]
    gc.collect()
    engine = LlamaCppEngine(path, n_ctx=n_ctx, n_threads=n_threads)
    try:
        _run_prompts(engine, prompts[:1], 4)  # warm-up: page the weights in
        speeds = [decode_tok_per_s(t) for _ in range(max(1, repeats))
                  for t in _run_prompts(engine, prompts, max_tokens)[0]]
    finally:
        engine.llm.close()
    return float(np.median(speeds))

"""Which quantization method, and what does each really cost? One table, every format.

Notebook 06 measured llama.cpp's GGUF ladder. This lesson puts the formats a GPU user
meets (BF16, bitsandbytes int8/NF4, torchao int8/int4, AWQ) beside a few GGUF rungs and
measures all of them the same way, on the same eval text and prompts:

- **bytes**: on disk (the derived folder or file) and the weights as loaded; resident
  memory added by the load;
- **quality**: mean NLL / perplexity of the eval text, the paired NLL difference from the
  unquantized float32 model, and **top-1 agreement**: the share of the text's positions
  where the format's most likely next token equals float32's (teacher-forced, so one
  early difference does not derail the rest, unlike greedy agreement in 06);
- **speed**: TTFT and decode tok/s of one request at a time, and output tok/s with 1 and
  with 4 requests in flight. The HF formats run in process on transformers, whose way to
  serve four at once is one *static batch* of 4; the GGUF rows run on llama-server with
  4 slots (*continuous batching*). The `batching` column says which.

`rss_bytes` is resident memory: for HF rows, the growth of this process's RSS over the
load and the runs (freed heap handed back to the OS first); for GGUF rows, llama-server's
whole RSS (its runtime and 4 slots' KV cache included). `real_kernels` runs the speed
columns on a Mac (MLX) or an NVIDIA GPU (vLLM FP8/GPTQ/AWQ), where those formats' kernels live.

`bytes_speedup` is what the bytes predict (float32 weight bytes / this row's): where decode
streams the weights from memory, a format with half the bytes should decode twice as
fast. `decode_speedup` is what this CPU delivered. They part where a kernel dequantizes in
software or falls back to a slow path: the gap is the lesson.
"""
from __future__ import annotations

import gc
import math
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from infercourse.core.errors import ModelLayerError

__all__ = ["score_hf", "score_gguf", "quality_row", "speed_hf", "speed_gguf", "measure_methods",
           "real_kernels", "predicted_bytes", "status_table"]


def _log_softmax_stats(logits: np.ndarray, ids: Sequence[int]):
    """Per-token NLL (nats) of ids[1:] and the argmax at each position."""
    lg = np.asarray(logits, dtype=np.float64)[: len(ids) - 1]
    top = lg.max(axis=1)
    logz = top + np.log(np.exp(lg - top[:, None]).sum(axis=1))
    return logz - lg[np.arange(len(ids) - 1), ids[1:]], lg.argmax(axis=1)


def score_hf(model, tok, text: str):
    """(token ids, per-token NLL, argmax per position) of `text` under a loaded HF model;
    no special tokens, like `models.quality`, so every format scores the same tokens."""
    import torch
    ids = tok(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
    return (list(ids), *_log_softmax_stats(logits, ids))


def score_gguf(path: str | Path, text: str, n_threads: int = 1):
    """The same as `score_hf` for a GGUF file, through llama.cpp."""
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(path), verbose=False, n_ctx=1024, n_batch=1024, logits_all=True,
                          n_threads=n_threads, n_threads_batch=n_threads)
    try:
        ids = llm.tokenize(text.encode(), add_bos=False, special=False)
        llm.eval(ids)
        return (list(ids), *_log_softmax_stats(np.array(llm.scores[: len(ids)]), ids))
    finally:
        llm.close()


def quality_row(scored, reference) -> dict:
    """NLL, perplexity, paired NLL difference (± 2 s.e.) and top-1 agreement vs `reference`.

    Args:
        scored, reference: (ids, nll, argmax) from `score_hf` / `score_gguf`.
    """
    ids, nll, top = scored
    rids, rnll, rtop = reference
    row = {"mean_nll": float(nll.mean()), "perplexity": float(np.exp(nll.mean()))}
    if list(ids) != list(rids):   # a different tokenizer: no position-wise comparison
        return {**row, "nll_diff": math.nan, "nll_diff_2se": math.nan, "top1_agreement": math.nan}
    d = nll - rnll
    return {**row, "nll_diff": float(d.mean()), "nll_diff_2se": float(2 * d.std(ddof=1) / np.sqrt(d.size)),
            "top1_agreement": float(np.mean(top == rtop))}


def _rss() -> int:
    import ctypes
    import ctypes.util

    import psutil
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc and hasattr(ctypes.CDLL(libc), "malloc_trim"):   # glibc: hand freed heap back to the OS,
        ctypes.CDLL(libc).malloc_trim(0)                     # or a freed model still counts as resident
    return psutil.Process().memory_info().rss


def _requests(prompts, max_tokens):
    from infercourse.core.types import Request
    return [Request(messages=[{"role": "user", "content": p}], max_tokens=max_tokens, ignore_eos=True,
                    cache_prompt=False) for p in prompts]


def _one_at_a_time(engine, reqs, writer=None, fmt: str = "") -> dict:
    from infercourse.core import metrics
    from infercourse.core.trace import record
    from dataclasses import replace
    record(engine, replace(reqs[0], max_tokens=2), raise_errors=True)   # warm-up: page weights in
    traces = [record(engine, r, request_id=i, raise_errors=True, format=fmt) for i, r in enumerate(reqs)]
    for t in traces if writer is not None else ():
        writer.write(t)
    e2e = sum(metrics.e2e_s(t) for t in traces)
    return {"ttft_s": float(np.median([metrics.ttft_s(t) for t in traces])),
            "decode_tok_per_s": float(np.median([metrics.decode_tok_per_s(t) for t in traces])),
            "tput_1_tok_per_s": sum(metrics.output_tokens(t) for t in traces) / e2e}


def speed_hf(engine, model, tok, prompts: Sequence[str], max_tokens: int, concurrency: int = 4,
             writer=None, fmt: str = "") -> dict:
    """TTFT, decode tok/s and throughput at 1 of a loaded HF model (swapped into one
    `TransformersEngine`, so every format runs the same generate loop), then output tok/s
    of one static batch of `concurrency` requests (left-padded, forced to `max_tokens`)."""
    import torch
    engine.model = model
    row = _one_at_a_time(engine, _requests(prompts, max_tokens), writer, fmt)
    chats = [tok.apply_chat_template([{"role": "user", "content": prompts[i % len(prompts)]}],
                                     add_generation_prompt=True, tokenize=False) for i in range(concurrency)]
    tok.padding_side = "left"
    batch = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=pad)
        wall = time.perf_counter() - t0
    row[f"tput_{concurrency}_tok_per_s"] = (out.shape[1] - batch.input_ids.shape[1]) * concurrency / wall
    return {**row, "batching": f"static batch of {concurrency} (transformers)"}


def speed_gguf(path: str | Path, prompts: Sequence[str], max_tokens: int, n_threads: int = 1,
               concurrency: int = 4, writer=None, fmt: str = "") -> dict:
    """The same measures for a GGUF on llama-server with `concurrency` slots: one request
    at a time, then `concurrency` in flight (continuous batching); server RSS after both."""
    from infercourse.servers import LlamaServer
    with LlamaServer(path, n_parallel=concurrency, ctx_size=concurrency * 512, threads=n_threads) as srv:
        row = _served(srv, prompts, max_tokens, concurrency, writer, fmt)
    return {**row, "batching": f"continuous, {concurrency} slots (llama-server)"}


def _served(srv, prompts, max_tokens: int, concurrency: int, writer=None, fmt: str = "") -> dict:
    """Speed columns of a running server: one at a time, then `concurrency` in flight."""
    import psutil

    from infercourse.core.summary import throughput
    from infercourse.measure import bench
    engine = srv.engine()
    row = _one_at_a_time(engine, _requests(prompts, max_tokens), writer, fmt)
    reqs = _requests([prompts[i % len(prompts)] for i in range(concurrency)], max_tokens)
    res = bench.run(engine, reqs, pattern="concurrency", concurrency=concurrency, warmup=0,
                    progress=False, sample_s=None, label="quant_methods")
    row[f"tput_{concurrency}_tok_per_s"] = throughput(res.df)["output_tok_per_s"]
    row["rss_bytes"] = psutil.Process(srv.pid).memory_info().rss if srv.pid else math.nan
    return row


def real_kernels(profile_name: str, prompts: Sequence[str], *, max_tokens: int = 32, concurrency: int = 4,
                 checkpoints: dict[str, str | Path] | None = None):
    """The speed columns again, where each format has the kernels it was made for.

    `mac`: mlx_lm.server on MLX float16, 8-bit and 4-bit folders (Metal's quantized
    matmuls). `gpu`: vLLM on the HF folder in bf16 and with on-the-fly FP8 (`--quantization
    fp8`, Ada/Hopper), plus any GPTQ/AWQ checkpoint folders you made on that GPU (vLLM
    reads their `quantization_config` and picks Marlin/Machete kernels). Quality is not
    re-scored here: the weights are the ones the CPU table scored (or, for a new
    checkpoint, score them with `score_hf` on the GPU).

    Args:
        profile_name: "mac" or "gpu"; raises `HardwareLayerError` (hardware layer) where absent.
        prompts, max_tokens, concurrency: as in `measure_methods`.
        checkpoints: {name: HF folder of a GPTQ/AWQ checkpoint} for the gpu profile.
    """
    import pandas as pd

    from infercourse.ops.profiles import profile, require
    p = require(profile(profile_name))
    if p.needs is None:
        raise ValueError(f"profile {profile_name!r} has no accelerator kernels: use measure_methods")
    if p.name == "mac":
        from infercourse.models.formats import mlx_folder
        from infercourse.servers.mlx import MLXServer
        servers = {f"mlx {'q' + str(b) if b else 'f16'}": (lambda b=b: MLXServer(mlx_folder(b))) for b in (None, 8, 4)}
    else:
        from infercourse.models.formats import hf_folder
        from infercourse.servers.vllm import VLLMServer
        hf = hf_folder()
        servers = {"vllm bf16": lambda: VLLMServer(hf, dtype="bfloat16", enforce_eager=False),
                   "vllm fp8": lambda: VLLMServer(hf, dtype="bfloat16", enforce_eager=False,
                                                  extra_args=["--quantization", "fp8"])}
        servers.update({f"vllm {k}": (lambda f=f: VLLMServer(f, dtype="float16", enforce_eager=False))
                        for k, f in (checkpoints or {}).items()})
    rows = []
    for name, make in servers.items():
        with make() as srv:
            rows.append({"format": name, "profile": p.name, **_served(srv, prompts, max_tokens, concurrency),
                         "batching": f"continuous ({srv.name})"})
    return pd.DataFrame(rows)


def measure_methods(methods: Sequence[str], gguf_paths: dict[str, str | Path], *, eval_text: str,
                    calibration: str, prompts: Sequence[str], max_tokens: int = 16,
                    n_threads: int = 1, concurrency: int = 4, writer=None):
    """One row per format: bytes, memory, quality vs float32, speed at 1 and `concurrency`.

    Args:
        methods: keys of `models.quant_formats.METHODS`; "fp32" (the reference) is added first.
        gguf_paths: {name: GGUF path}, e.g. `quantization.ladder_paths` output (may be empty).
        eval_text: the text scored for NLL and top-1 agreement (disjoint from `calibration`).
        calibration: sample text for calibrated methods (AWQ).
        prompts: user messages, decoded greedily for exactly `max_tokens` tokens.
        n_threads: torch and llama.cpp threads.
        concurrency: requests in flight for the second throughput column.
        writer: optional `results.RunWriter`; the one-at-a-time request traces go to it.
    """
    import pandas as pd

    from infercourse.models import quant_formats as qf
    qf.quiet()   # before transformers imports torchao and bitsandbytes
    from infercourse.engines.transformers_engine import TransformersEngine
    from infercourse.models.derive import manifest
    _check_disjoint(eval_text, calibration)
    order = ["fp32"] + [m for m in methods if m != "fp32"]
    engine = TransformersEngine(qf.derive_method("fp32"), n_threads=n_threads)
    rows, ref = [], None
    for name in order:
        gc.collect()
        rss0 = _rss()
        model, tok = qf.load_method(name, calibration=calibration, n_threads=n_threads)
        scored = score_hf(model, tok, eval_text)
        ref = ref or scored
        folder = qf.derive_method(name, calibration=calibration)
        info = qf.METHODS[name]
        rows.append({"format": name, "family": info.library, "bits": info.bits, "calibrated": info.calibrated,
                     "weight_only": info.weight_only, "file_bytes": manifest(folder)["output_bytes"],
                     "weight_bytes": qf.weight_bytes(model), **quality_row(scored, ref),
                     **speed_hf(engine, model, tok, prompts, max_tokens, concurrency, writer, name),
                     "rss_bytes": _rss() - rss0, "derive_s": manifest(folder)["seconds"]})
        engine.model = None
        del model
    for name, path in gguf_paths.items():
        from infercourse.models.modelcard import model_card
        card = model_card(path)
        rows.append({"format": f"gguf {name}", "family": "llama.cpp", "bits": round(card.bits_per_weight, 2),
                     "calibrated": False, "weight_only": False, "file_bytes": Path(path).stat().st_size,
                     "weight_bytes": card.tensor_bytes,
                     **quality_row(score_gguf(path, eval_text, n_threads), ref),
                     **speed_gguf(path, prompts, max_tokens, n_threads, concurrency, writer, f"gguf {name}")})
    df = pd.DataFrame(rows)
    base = df.set_index("format").loc["fp32"]
    df["bytes_speedup"] = base.weight_bytes / df.weight_bytes   # what the bytes predict for decode
    df["decode_speedup"] = df.decode_tok_per_s / base.decode_tok_per_s   # what the kernels delivered
    return df


def predicted_bytes(methods: Sequence[str]):
    """What the bits predict, before anything is loaded: each method's weight bytes from the
    HF folder's tensor shapes (quantized linear layers at `bits` a weight, plus 0.5 bit of
    scale per weight for 4-bit groups of 64; embedding and norms in the method's float
    dtype) and the decode speedup over fp32 those bytes alone predict."""
    import pandas as pd
    from safetensors import safe_open

    from infercourse.models import quant_formats as qf
    from infercourse.models.formats import hf_folder
    with safe_open(str(hf_folder() / "model.safetensors"), "np") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    linear = sum(int(np.prod(v)) for k, v in shapes.items() if len(v) == 2 and "embed" not in k)
    other = sum(int(np.prod(v)) for k, v in shapes.items()) - linear
    rows = []
    for name in ["fp32", *[m for m in methods if m != "fp32"]]:
        m = qf.METHODS[name]
        float_bytes = 2 if m.dtype in ("bfloat16", "float16") else 4
        bits = m.bits + (0.5 if m.bits == 4 else 0)
        rows.append({"format": name, "bits": m.bits, "predicted_bytes": linear * bits / 8 + other * float_bytes})
    df = pd.DataFrame(rows)
    df["predicted_speedup"] = df.predicted_bytes.iloc[0] / df.predicted_bytes
    return df


def status_table():
    """What quantizes and runs here and what does not, with the reason (a DataFrame)."""
    import pandas as pd

    from infercourse.models.quant_formats import method_status
    return pd.DataFrame(method_status())


def _check_disjoint(eval_text: str, calibration: str) -> None:
    if eval_text and eval_text in calibration:
        raise ModelLayerError("the eval text is inside the calibration text: quality would be flattered")

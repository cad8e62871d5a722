"""Which quantization method, and what does each really cost? One table, every format.

Notebook 06 measured llama.cpp's GGUF ladder. This lesson puts the formats a GPU user
meets (BF16, bitsandbytes int8/NF4, torchao int8/int4, AWQ) beside a few GGUF rungs and
measures all of them the same way, on the same eval text and prompts:

- **the reference**: "fp32" is the course's model, which ships as Q4_1, dequantized to
  float32 (notebook 06). Its linear weights already lie on a 4-bit grid: every quality
  column is a distance from that model, not from an unquantized one, and a format whose
  blocks line up with Q4_1's can land back on its levels (`quant_grid`).
- **bytes**: on disk (the derived folder or file) and the weights as loaded;
  `rss_bytes`: HF rows, the resident growth of loading the format in a fresh process
  (`quant_speed.rss_fresh`); GGUF rows, llama-server's whole process (runtime and KV
  cache included): compare each family within itself.
- **quality**: mean NLL / perplexity of the eval text, the paired NLL difference from fp32,
  and **top-1 agreement**: the share of positions where the format's most likely next
  token equals fp32's (teacher-forced, so one early difference does not derail the rest).
- **speed**, per runtime against its own reference (`quant_speed`): HF formats against
  fp32 in the same transformers loop, GGUF rungs against GGUF F16 on llama-server;
  repeated, interleaved requests with an A/A arm, and `noise.compare`'s verdict.
  Output tok/s with `concurrency` in flight (a static batch in transformers, continuous
  batching on llama-server) is one measurement, not ranked.

`bytes_speedup` is what the bytes predict (the reference's weight bytes / this row's):
where decode streams the weights from memory, half the bytes should decode twice as fast.
`decode_speedup` is what this machine delivered. They part where a kernel dequantizes in
software or the loop's fixed costs dominate: the gap is the lesson.
`real_kernels` runs the speed columns on a Mac (MLX) or an NVIDIA GPU (vLLM FP8/GPTQ/AWQ).
"""
from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Sequence

import numpy as np

from infercourse.core.errors import ModelLayerError

__all__ = ["score_hf", "score_gguf", "quality_row", "measure_methods", "add_speedups",
           "real_kernels", "kernel_speedup", "predicted_bytes", "status_table", "gguf_rung_bits",
           "gguf_rung_speedup", "GGUF_REF"]

GGUF_REF = "gguf F16"   # the GGUF rungs' reference: the same weights, unrounded, on the same runtime


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
    from infercourse.measure.quant_speed import request_trials, served_row
    rows = []
    for name, make in servers.items():   # one server at a time (one GPU): no verdict across rows
        with make() as srv:
            e = srv.engine()
            row = request_trials({name: lambda e=e: e}, name, prompts, max_tokens)[name]
            rows.append({"format": name, "profile": p.name, **{k: v for k, v in row.items() if "speedup" not in k},
                         **served_row(srv, prompts, max_tokens, concurrency), "batching": f"continuous ({srv.name})"})
    return pd.DataFrame(rows)


def kernel_speedup(kernels, fmt: str) -> float:
    """Decode tok/s of row `fmt` of a `real_kernels` table over its first row (the 16-bit
    reference on the same runtime: "mlx f16" on a Mac, "vllm bf16" on a GPU)."""
    speed = kernels.set_index("format")["decode_tok_per_s"]
    if fmt not in speed.index:
        raise ValueError(f"no row {fmt!r} in the kernels table: {list(speed.index)}")
    return float(speed[fmt] / speed.iloc[0])


def gguf_rung_bits(path) -> float:
    """Bits per weight of a GGUF rung as llama.cpp really wrote it: 8 x tensor bytes /
    parameters. The rung's name is the quantizer's *request*; rows whose length is not a
    multiple of 256 fall back to other types (`quant_grid`), and some tensors keep more bits,
    so this can sit far from the name's nominal bits.

    Args:
        path: the rung's GGUF file (`quantization.ladder_paths([qtype])[qtype]`, derived once).
    """
    from infercourse.models.modelcard import model_card
    return float(model_card(path).bits_per_weight)


def gguf_rung_speedup(qtype: str, path, f16_path, prompts: Sequence[str], max_tokens: int, *,
                      n_threads: int = 1, repeats: int = 4) -> dict:
    """One GGUF rung against GGUF F16 on llama-server, measured as `measure_methods`
    measures its GGUF rows (interleaved requests, F16 rerun as the A/A arm; one slot each
    here). Returns the rung's row: `decode_speedup`, its interval and `decode_verdict`.

    Args:
        qtype: a llama.cpp file type, e.g. "Q3_K_M"; path: its GGUF file; f16_path: GGUF F16's
            (both from `quantization.ladder_paths`: a lesson never imports another).
        prompts, max_tokens, n_threads, repeats: as in `measure_methods`.
    """
    from infercourse.measure import quant_speed as qs
    paths = {"gguf F16": f16_path, f"gguf {qtype}": path}
    rows = qs.serve_gguf(paths, GGUF_REF, prompts, max_tokens, n_threads=n_threads, concurrency=1, repeats=repeats)
    return rows[f"gguf {qtype}"]


def measure_methods(methods: Sequence[str], gguf_paths: dict[str, str | Path], *, eval_text: str,
                    calibration: str, prompts: Sequence[str], max_tokens: int = 16, n_threads: int = 1,
                    concurrency: int = 4, repeats: int = 4, fresh_memory: bool = True, writer=None):
    """One row per format: bytes, memory, quality vs fp32, speed against its runtime's reference.

    Args:
        methods: keys of `models.quant_formats.METHODS`; "fp32" (the reference) is added first.
        gguf_paths: {name: GGUF path}, e.g. `quantization.ladder_paths` output; "F16" (the
            GGUF rows' speed reference) must be among them when any other is.
        eval_text: the text scored for NLL and top-1 agreement (disjoint from `calibration`).
        calibration: sample text for calibrated methods (AWQ).
        prompts: user messages, decoded greedily for exactly `max_tokens` tokens.
        n_threads: torch and llama.cpp threads.
        concurrency: requests in flight for the second throughput column.
        repeats: interleaved blocks of the speed trials (`quant_speed.request_trials`).
        fresh_memory: measure each HF format's memory in a fresh process (else NaN).
        writer: optional `results.RunWriter`; the timed request traces go to it.
    """
    import pandas as pd

    from infercourse.models import quant_formats as qf
    from infercourse.models.quant_tensors import weight_bytes
    from infercourse.models.quiet import quiet
    quiet()   # before transformers imports torchao and bitsandbytes
    from infercourse.engines.transformers_engine import TransformersEngine
    from infercourse.measure import quant_speed as qs
    from infercourse.models.derive import manifest
    _check_disjoint(eval_text, calibration)
    gguf_paths = {f"gguf {k}": v for k, v in gguf_paths.items()}
    if gguf_paths and GGUF_REF not in gguf_paths:
        raise ValueError(f"the GGUF rows need {GGUF_REF!r} (their speed reference) in gguf_paths")
    order = ["fp32"] + [m for m in methods if m != "fp32"]
    rows, models, ref = {}, {}, None
    for name in order:   # every format held loaded, so the speed trials can interleave them
        model, tok = qf.load_method(name, calibration=calibration, n_threads=n_threads)
        scored = score_hf(model, tok, eval_text)
        ref = ref or scored
        folder = qf.derive_method(name, calibration=calibration)
        info = qf.METHODS[name]
        models[name] = model
        rows[name] = {"format": name, "family": info.library, "bits": info.bits, "float_dtype": info.dtype,
                      "calibrated": info.calibrated, "weight_only": info.weight_only,
                      "file_bytes": manifest(folder)["output_bytes"], "weight_bytes": weight_bytes(model),
                      **quality_row(scored, ref),
                      f"tput_{concurrency}_tok_per_s": qs.static_batch_tput(model, tok, prompts, max_tokens,
                                                                            concurrency),
                      "batching": f"static batch of {concurrency} (transformers)",
                      "derive_s": manifest(folder)["seconds"]}
    engine = TransformersEngine(qf.derive_method("fp32"), n_threads=n_threads)

    def swap(name):
        def get():
            engine.model = models[name]
            return engine
        return get
    speed = qs.request_trials({n: swap(n) for n in order}, "fp32", prompts, max_tokens, repeats, writer)
    engine.model = None
    models.clear()
    gc.collect()
    for name in order:
        rows[name].update(speed[name], rss_bytes=qs.rss_fresh(name, calibration, n_threads) if fresh_memory
                          else math.nan)
    for name, path in gguf_paths.items():
        from infercourse.models.modelcard import model_card
        card = model_card(path)
        rows[name] = {"format": name, "family": "llama.cpp", "bits": round(card.bits_per_weight, 2),
                      "float_dtype": None, "calibrated": False, "weight_only": False,
                      "file_bytes": Path(path).stat().st_size, "weight_bytes": card.tensor_bytes,
                      **quality_row(score_gguf(path, eval_text, n_threads), ref)}
    if gguf_paths:
        for name, row in qs.serve_gguf(gguf_paths, GGUF_REF, prompts, max_tokens, n_threads=n_threads,
                                       concurrency=concurrency, repeats=repeats, writer=writer).items():
            rows[name].update(row)
    return add_speedups(pd.DataFrame(list(rows.values())))


def add_speedups(df):
    """`bytes_speedup`: each row's reference weight bytes over its own (the reference is
    the row named in `speedup_vs`: fp32 for HF formats, GGUF F16 for GGUF rungs), so the
    bytes' prediction and the delivered `decode_speedup` divide by the same runtime."""
    base = df.set_index("format").weight_bytes
    df = df.copy()
    df["bytes_speedup"] = df.speedup_vs.map(base) / df.weight_bytes
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

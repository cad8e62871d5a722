"""Quantization beyond GGUF: BF16, bitsandbytes, torchao int8/int4, AWQ, and what needs a GPU.

GGUF (notebook 06) is llama.cpp's world. A model hub and vLLM/SGLang/transformers speak
other formats, and they differ in *when* and *how* weights are quantized:

- **BF16**: the same weights in bfloat16 (8 significand bits): half of float32's bytes.
- **bitsandbytes** (LLM.int8, NF4): *on the fly*, at load time, no calibration data.
  LLM.int8 quantizes weights *and* activations to int8 per row, keeping outlier columns
  in 16 bits; NF4 is weight-only, 4-bit on a normal-quantile code book (`nf4_by_hand`).
- **torchao int8 / int4 weight-only**: round-to-nearest with one scale per row (int8) or
  per group of 64 (int4), no calibration; torch's own int8/int4 CPU kernels run them.
- **AWQ** (activation-aware): *calibrated*. It runs sample text through the model, finds
  the input channels with large activations, and scales those weight columns up (and the
  activations down by the same factor) before rounding, so the weights that matter most
  lose least. Here, torchao's AWQ on top of its int4 CPU format.
- **GPTQ**: *calibrated*, quantizes column by column and corrects the not-yet-quantized
  columns for each rounding error, using second-order (Hessian) statistics of the inputs.

What was found on this machine (x86_64, torch 2.13.0 CPU, transformers 5.24, bitsandbytes
0.50.2, torchao 0.18.0), and is what `METHODS` / `NOT_HERE` say:

| method | runs here | note |
|---|---|---|
| bf16, torchao-int8/int4 | yes | int4 via torchao's CPU (`opaque`) packing |
| bnb-int8 | yes (at load) | the CPU backend casts float32 activations to float16 for its int8 matmul |
| bnb-nf4 | yes, slowly | without the optional `kernels` package its CPU path dequantizes each weight before the matmul; a saved NF4 folder reloads broken (NLL 17 vs 3.7), so NF4 is quantized at each load |
| awq-int4 | yes (calibrated, ~1-3 min once) | cached |
| gptq, fp8, Marlin/Machete | **no** | CUDA only (see NOT_HERE): profile `gpu` (vLLM) |
| MLX 4/8-bit | Metal only fast | profile `mac`: `formats.mlx_folder(4)` |

Every derived format is built once from the embedded model's HF folder (`formats.hf_folder`)
into `derived_dir()/<method>/` with a manifest (tool, version, arguments, seconds), like
the GGUF ladder. Calibrated methods take their sample text as an argument (`split_eval_text` cuts
the course's eval prose in two: calibrate on the end, score the start), and the cache key
includes its sha256, so a different sample derives a different folder.
The two methods of one library keep the rest of the model (embedding, norms, activations)
in the same float type, so their 8- vs 4-bit rows differ in the rounding alone:
bitsandbytes float32 (LLM.int8 casts activations to float16 for its matmul), torchao
bfloat16 (its CPU int4 kernel ran AWQ's scale search ~30x slower in float32 here). A
torchao row's loss against fp32 therefore includes bfloat16's own: the bf16 row measures it.
torchao formats are stored as a pickled state dict (`model.pt`: torchao's weight tensor
subclasses); it is our own file, checked against its manifest's sha256 before loading.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from infercourse.core.errors import BackendMissingError, ModelLayerError
from infercourse.models.derive import derive, derived_dir, hash_folder, manifest
# what a loaded model holds and how a saved state goes back in (quant_tensors), and the
# libraries' chatter kept out of cells (quiet): their own modules, re-exported for callers
from infercourse.models.quant_tensors import TIED, load_state, weight_bytes
from infercourse.models.quiet import CHATTY_LOGGERS, quiet

__all__ = ["Method", "METHODS", "NOT_HERE", "CALIBRATION_START_WORD", "split_eval_text",
           "derive_method", "load_method", "method_status",
           "load_state", "weight_bytes", "TIED", "quiet", "CHATTY_LOGGERS"]   # the last five re-exported

CALIBRATION_START_WORD = 400   # calibration reads words [400:] of eval_prose.txt; evaluate on [:400]


@dataclass(frozen=True)
class Method:
    """One quantization method: how it is made and what it stores."""
    name: str
    library: str
    bits: float          # nominal bits per weight of the quantized linear layers
    calibrated: bool     # needs sample data (AWQ, GPTQ) or not (round-to-nearest, bnb)
    weight_only: bool    # activations stay in floating point
    dtype: str           # the dtype of everything not quantized (embeddings, norms, activations)


METHODS = {
    "fp32": Method("fp32", "transformers", 32, False, True, "float32"),
    "bf16": Method("bf16", "transformers", 16, False, True, "bfloat16"),
    "bnb-int8": Method("bnb-int8", "bitsandbytes", 8, False, False, "float32"),
    "bnb-nf4": Method("bnb-nf4", "bitsandbytes", 4, False, True, "float32"),
    "torchao-int8": Method("torchao-int8", "torchao", 8, False, True, "bfloat16"),
    "torchao-int4": Method("torchao-int4", "torchao", 4, False, True, "bfloat16"),
    "awq-int4": Method("awq-int4", "torchao", 4, True, True, "bfloat16"),
}

NOT_HERE = {
    "gptq-int4": "torchao's GPTQ asserts a CUDA device; gptqmodel 7.7 requires torch>=2.14.1 "
                 "(it would replace torch 2.13.0); llmcompressor 0.14 pins transformers<=5.17 and "
                 "pulls datasets, pyarrow and auto-round. Profile `gpu`: vLLM loads GPTQ checkpoints.",
    "awq-int4 (GEMM/Marlin kernels)": "the fast AWQ/GPTQ int4 kernels (Marlin, Machete, ExLlama) are "
                                      "CUDA code; here AWQ runs on torchao's CPU int4 kernel instead.",
    "fp8": "FP8 matmuls need a CUDA GPU of compute capability >= 8.9 (Ada, Hopper): profile `gpu`.",
    "mlx-q4 / mlx-q8": "MLX's quantized matmuls are fast on Metal only: profile `mac` "
                       "(formats.mlx_folder(4) derives the folder anywhere mlx-lm installs).",
}

_GROUP = 64   # weights per scale for the 4-bit methods (bnb's NF4 block, torchao's group)


def split_eval_text(text: str, eval_words: int) -> tuple[str, str]:
    """(evaluation text, calibration text) from one prose text, never overlapping:
    evaluation = the first `eval_words` words, calibration = words from
    CALIBRATION_START_WORD on.

    Args:
        text: e.g. `measure.workloads.eval_text()` (784 words).
        eval_words: words to score; at most CALIBRATION_START_WORD.
    """
    words = text.split()
    if eval_words > CALIBRATION_START_WORD:
        raise ValueError(f"eval_words={eval_words} would overlap the calibration text "
                         f"(words {CALIBRATION_START_WORD}+)")
    if len(words) <= CALIBRATION_START_WORD:
        raise ModelLayerError(f"text has {len(words)} words: too short to hold a calibration part")
    return " ".join(words[:eval_words]), " ".join(words[CALIBRATION_START_WORD:])


def _libs():
    quiet()
    try:
        import torch
        import transformers
    except ImportError as e:
        raise BackendMissingError("transformers/torch not installed", hint="pip install 'infercourse[hf]'") from e
    return torch, transformers


def _need(module: str, method: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise BackendMissingError(f"{method} needs {module.split('.')[0]}, which is not installed",
                                  hint="pip install 'infercourse[quant]'") from e


def _linear_filter(module, fqn: str) -> bool:
    # the tied embedding / lm_head stays in floating point, as bnb and vLLM checkpoints keep it
    import torch
    return isinstance(module, torch.nn.Linear) and "lm_head" not in fqn


def _torchao_config(method: str):
    ao = _need("torchao.quantization", method)
    if method == "torchao-int8":
        return ao.Int8WeightOnlyConfig()
    int4 = _need("torchao.prototype.quantization.int4", method)
    # the CPU int4 kernel's packing ("opaque"); torchao's default Int4 packings are CUDA/XPU ones
    return int4.PrototypeInt4WeightOnlyConfig(group_size=_GROUP)


def _quantize_torchao(model, method: str, calibration_ids=None):
    """Quantize `model` in place with torchao: plain round-to-nearest, or AWQ (calibrated)."""
    torch, _ = _libs()
    from torchao.quantization import quantize_
    base = _torchao_config("torchao-int4" if method == "awq-int4" else method)
    if method != "awq-int4":
        quantize_(model, base, filter_fn=_linear_filter)
        return model
    from torchao.prototype.awq import AWQConfig
    quantize_(model, AWQConfig(base, step="prepare"), filter_fn=_linear_filter)  # observers record inputs
    with torch.no_grad():
        model(calibration_ids)
    quantize_(model, AWQConfig(base, step="convert"), filter_fn=_linear_filter)  # search scales, round
    return model


def _target(method: str, calibration: str | None, source) -> Path:
    import hashlib
    if method not in METHODS:
        why = NOT_HERE.get(method)
        raise ModelLayerError(f"{method!r} cannot be made here: {why}" if why else f"unknown method {method!r}",
                              hint=f"one of {', '.join(METHODS)}")
    name = method
    if METHODS[method].calibrated:
        if not calibration:
            raise ValueError(f"{method} is calibrated: pass calibration= sample text")
        name += "-" + hashlib.sha256(calibration.encode()).hexdigest()[:8]
    return derived_dir(source) / "quant" / name


def derive_method(method: str, *, calibration: str | None = None, source=None, n_threads: int = 2) -> Path:
    """Derive `method` once from the HF folder; returns its folder (with manifest.json).

    bf16 and bitsandbytes are saved with `save_pretrained` (bnb-nf4 only for its bytes:
    it is re-quantized at every load, see the module docstring); torchao methods as a
    state dict of quantized tensors, `model.pt`, beside the config and tokenizer.

    Args:
        method: a key of METHODS ("fp32" is the HF folder itself).
        calibration: sample text for calibrated methods (AWQ); its sha256 is in the folder name.
        source: the GGUF everything derives from (None: the embedded model).
        n_threads: torch threads while quantizing.
    """
    from infercourse.models.formats import hf_folder
    hf = hf_folder(source)
    if method == "fp32":
        return hf
    target = _target(method, calibration, source)
    m = METHODS[method]

    def build(out: Path) -> dict:
        torch, transformers = _libs()
        torch.set_num_threads(n_threads)
        tok = transformers.AutoTokenizer.from_pretrained(hf)
        model = _load_quantized(hf, m, tok, calibration)
        args = {"dtype": m.dtype, "group_size": _GROUP if m.bits == 4 else None,
                "calibration_sha256": target.name.rsplit("-", 1)[-1] if m.calibrated else None}
        if m.library == "torchao":
            torch.save(model.state_dict(), out / "model.pt")
            model.config.save_pretrained(out)
        else:
            model.save_pretrained(out)
        tok.save_pretrained(out)
        lib = {"torchao": "torchao", "bitsandbytes": "bitsandbytes"}.get(m.library, "transformers")
        return {"tool": m.library, "version": _version(lib), "args": args}

    if (target / "manifest.json").is_file() and manifest(target)["args"].get("dtype") != m.dtype:
        import shutil   # made when this method kept another float type: derive it again
        shutil.rmtree(target)
    return derive(target, build, source=hf / "model.safetensors")


def _version(dist: str) -> str:
    from importlib.metadata import version
    return version(dist)


def _load_quantized(hf: Path, m: Method, tok, calibration: str | None):
    """Build the quantized model from the float HF folder (what `derive_method` stores)."""
    torch, transformers = _libs()
    kw = {"dtype": getattr(torch, m.dtype)}
    if m.library == "bitsandbytes":
        _need("bitsandbytes", m.name)
        q = (transformers.BitsAndBytesConfig(load_in_8bit=True) if m.bits == 8 else
             transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_compute_dtype=torch.float32))
        kw.update(quantization_config=q, device_map="cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, **kw).eval()
    if m.library == "torchao":
        ids = tok(calibration, add_special_tokens=False, return_tensors="pt").input_ids if m.calibrated else None
        _quantize_torchao(model, m.name, ids)
    return model


def load_method(method: str, *, calibration: str | None = None, source=None, n_threads: int = 2):
    """(model, tokenizer) for `method`, derived once and cached (bnb-nf4: quantized at load).

    Args:
        method: a key of METHODS.
        calibration: the sample text the method was (or is to be) calibrated on.
        source: the GGUF everything derives from (None: the embedded model).
        n_threads: torch threads.
    """
    torch, transformers = _libs()
    torch.set_num_threads(n_threads)
    folder = derive_method(method, calibration=calibration, source=source, n_threads=n_threads)
    m = METHODS[method]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    if method == "bnb-nf4":   # its saved folder reloads broken here: quantize at load instead
        from infercourse.models.formats import hf_folder
        return _load_quantized(hf_folder(source), m, tok, None), tok
    if m.library != "torchao":
        kw = {"device_map": "cpu"} if m.library == "bitsandbytes" else {"dtype": getattr(torch, m.dtype)}
        return transformers.AutoModelForCausalLM.from_pretrained(folder, **kw).eval(), tok
    _need("torchao.quantization", method)   # registers the tensor subclasses the pickle names
    _need("torchao.prototype.quantization.int4", method)
    if hash_folder(folder) != manifest(folder)["output_sha256"]:
        raise ModelLayerError(f"{folder} does not match its manifest's sha256",
                              hint=f"delete {folder} and derive again")
    from infercourse.models.formats import hf_folder
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_folder(source), dtype=getattr(torch, m.dtype))
    # our own file (sha256 checked above); torchao's tensor subclasses need the full unpickler
    state = torch.load(folder / "model.pt", weights_only=False)
    load_state(model, state, folder)
    model.tie_weights()   # assign=True replaced the tied Parameter objects: tie them again
    return model.eval(), tok


def method_status() -> list[dict]:
    """One row per method: runs here or not, and why (for the notebook's table)."""
    import importlib.util
    rows = []
    for m in METHODS.values():
        lib = {"transformers": "transformers", "bitsandbytes": "bitsandbytes", "torchao": "torchao"}[m.library]
        ok = importlib.util.find_spec(lib) is not None
        rows.append({"method": m.name, "library": m.library, "bits": m.bits, "calibrated": m.calibrated,
                     "weight_only": m.weight_only, "runs_here": ok,
                     "why_not": None if ok else f"{lib} not installed: pip install 'infercourse[quant]'"})
    rows += [{"method": k, "library": None, "bits": None, "calibrated": None, "weight_only": None,
              "runs_here": False, "why_not": v} for k, v in NOT_HERE.items()]
    return rows

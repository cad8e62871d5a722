"""MLX-LM in process: Apple's runtime, Metal on a Mac, its CPU build on Linux.

`mlx_lm.stream_generate` does the decode loop; we keep one prompt cache between requests
and trim it to the longest shared token prefix (what `mlx_lm.server` does), so repeated
system prompts are not recomputed unless `cache_prompt=False`.

On Linux, MLX needs `mlx[cpu]` (plain `mlx` fails to import libmlx.so) and is slow and
effectively single-threaded: fine for correctness, not for speed lessons.
"""
from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any, Iterator

from infercourse.core.errors import BackendMissingError, ContextLayerError, ModelLayerError
from infercourse.models.embedded import resolve_model
from infercourse.core.types import Event, Messages, Request, Usage, as_request

__all__ = ["MLXEngine"]


class MLXEngine:
    """mlx-lm.

    Args:
        model: an MLX folder (from `mlx_lm.convert`), or None for the embedded model's
            MLX conversion (float; pass `quantize_bits=4` for the 4-bit one).
        quantize_bits: with model=None, which derived MLX folder to use (None = float).
    """

    name = "mlx"

    def __init__(self, model: str | Path | None = None, *, quantize_bits: int | None = None):
        try:
            import mlx.core as mx
            import mlx_lm
        except ImportError as e:
            hint = ("pip install 'mlx[cpu]' mlx-lm" if platform.system() == "Linux"
                    else "pip install mlx mlx-lm")
            raise BackendMissingError(f"MLX-LM cannot be imported here: {e}", hint=hint) from e
        self._mx, self._mlx_lm = mx, mlx_lm
        if model is None:
            from infercourse.models.formats import mlx_folder
            model = mlx_folder(quantize_bits=quantize_bits)
        self.model_ref = resolve_model(model)
        if self.model_ref.kind not in ("mlx", "hf"):
            raise ModelLayerError(f"MLXEngine needs an MLX (or HF) folder, got {self.model_ref.kind}")
        self.model, self.tokenizer = mlx_lm.load(str(self.model_ref.path))
        self._cache, self._cache_tokens = None, []
        self.flags = {"device": str(mx.default_device()), "quantize_bits": quantize_bits}

    def prompt_tokens(self, request: Request | str | Messages) -> list[int]:
        req = as_request(request)
        if req.messages is not None:
            return list(self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True,
                                                           tokenize=True))
        return list(self.tokenizer.encode(req.prompt))

    def _reusable_cache(self, tokens: list[int], use: bool):
        """Trim the kept cache to the shared prefix; return (cache, tokens still to evaluate)."""
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
        n = 0
        if use and self._cache is not None and can_trim_prompt_cache(self._cache):
            for a, b in zip(self._cache_tokens, tokens):
                if a != b:
                    break
                n += 1
            n = min(n, len(tokens) - 1)  # at least one token must be evaluated for logits
            trim_prompt_cache(self._cache, len(self._cache_tokens) - n)
        if n == 0:
            self._cache = make_prompt_cache(self.model)
        self._cache_tokens = tokens[:n]
        return n

    def stream(self, request: Request | str | Messages, **overrides: Any) -> Iterator[Event]:
        req = as_request(request, **overrides)
        from mlx_lm.sample_utils import make_sampler
        tokens = self.prompt_tokens(req)
        limit = getattr(getattr(self.model, "args", None), "max_position_embeddings", None)
        if limit and len(tokens) + req.max_tokens > limit:
            raise ContextLayerError(f"prompt of {len(tokens)} tokens + max_tokens "
                                    f"{req.max_tokens} exceeds the {limit}-token context")
        cached = self._reusable_cache(tokens, req.cache_prompt)
        self._mx.random.seed(req.seed)
        processors = []
        if req.ignore_eos:
            eos = sorted(self.tokenizer.eos_token_ids)

            def _no_eos(_toks, logits):  # forced length: EOS can never be sampled
                logits[:, eos] = -float("inf")
                return logits
            processors.append(_no_eos)
        generated, finish, resp = [], "length", None
        for resp in self._mlx_lm.stream_generate(
                self.model, self.tokenizer, self._mx.array(tokens[cached:]),
                max_tokens=req.max_tokens, sampler=make_sampler(temp=req.temperature),
                logits_processors=processors, prompt_cache=self._cache):
            t = time.perf_counter()
            is_token = resp.finish_reason is None or resp.finish_reason == "length"
            if is_token:
                generated.append(resp.token)
            else:
                finish = "stop"
            if is_token or resp.text:
                yield Event(t=t, text=resp.text, n_tokens=1 if is_token else 0)
        # the last sampled token was never fed back, so the cache holds one fewer
        self._cache_tokens = (tokens + generated)[:self._cache[0].offset]
        timings = {}
        if resp is not None:
            timings = {"prompt_tps": resp.prompt_tps, "generation_tps": resp.generation_tps,
                       "peak_memory_gb": resp.peak_memory}
        eog = int(finish == "stop")  # the stop token was generated, counted like servers do
        usage = Usage(prompt_tokens=len(tokens), completion_tokens=len(generated) + eog,
                      cached_tokens=cached, source="engine")
        yield Event(t=time.perf_counter(), n_tokens=eog, done=True, usage=usage, finish_reason=finish,
                    timings=timings)

    def describe(self) -> dict[str, Any]:
        import importlib.metadata as md
        return {"engine": self.name, "runtime": "MLX-LM", "version": md.version("mlx-lm"),
                "mlx": md.version("mlx"), "backend": self.flags["device"],
                "model": str(self.model_ref.path), "model_sha256": self.model_ref.sha256(),
                "quantization": f"{self.flags['quantize_bits']}-bit" if self.flags["quantize_bits"] else "float",
                "flags": dict(self.flags)}

"""llama.cpp in process, through llama-cpp-python: the runtime with nothing in front of it.

The decode loop below is the whole engine: apply the chat template, tokenize, let
`Llama.generate` evaluate the prompt (reusing the longest cached prefix of the previous
request unless told not to) and sample one token at a time. Each token becomes one event.
llama.cpp's own perf counters (`llama_perf_context`) are read after each request so the
client-side timings can be reconciled with what the runtime measured. Cached prompt
tokens come from the runtime's matched-prefix state (`compat.llama_cached_prefix`), not
from the perf counters, which file a 1-token suffix under decode.

The thread count is a visible, recorded setting: on a 2-core machine under contention,
2 threads can collapse to a few tok/s while 1 thread holds steady.
"""
from __future__ import annotations

import codecs
import time
from pathlib import Path
from typing import Any, Iterator

from infercourse import compat
from infercourse.core.errors import BackendMissingError, ContextLayerError, ModelLayerError
from infercourse.models.embedded import resolve_model
from infercourse.core.types import Event, Messages, Request, Usage, as_request

__all__ = ["LlamaCppEngine", "default_threads"]


def default_threads() -> int:
    """Physical cores (not hyper-threads): llama.cpp decode is memory-bound, and extra
    threads on shared cores mostly add contention."""
    import psutil
    return max(1, psutil.cpu_count(logical=False) or 1)


class LlamaCppEngine:
    """llama.cpp in process.

    Args:
        model: None for the embedded Q4_1 GGUF, or a path to any .gguf file.
        n_ctx: context window in tokens (the KV cache is allocated for all of it).
        n_threads: CPU threads for decode and prefill (default: physical cores).
        n_batch: prompt tokens evaluated per forward pass during prefill.
        n_gpu_layers: layers offloaded to Metal/CUDA when llama.cpp was built with them.
        draft: "prompt-lookup" for llama-cpp-python's prompt-lookup speculative decoding.
    """

    name = "llamacpp"

    def __init__(self, model: str | Path | None = None, *, n_ctx: int = 2048,
                 n_threads: int | None = None, n_batch: int = 512, n_gpu_layers: int = 0,
                 draft: str | None = None, draft_tokens: int = 10, seed: int = 0):
        try:
            import llama_cpp
        except ImportError as e:  # pragma: no cover - core dependency
            raise BackendMissingError("llama-cpp-python is not installed",
                                      hint="run `make install`") from e
        self._llama_cpp = llama_cpp
        self.model = resolve_model(model)
        if self.model.kind != "gguf":
            raise ModelLayerError(f"LlamaCppEngine needs a .gguf file, got a {self.model.kind} model "
                                  f"at {self.model.path}", hint="use TransformersEngine or MLXEngine")
        self.n_threads = n_threads or default_threads()
        draft_model = None
        if draft == "prompt-lookup":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            draft_model = LlamaPromptLookupDecoding(num_pred_tokens=draft_tokens)
        elif draft is not None:
            raise ValueError(f"unknown draft {draft!r}; llama-cpp-python supports 'prompt-lookup'")
        self.draft = draft
        self.flags = {"n_ctx": n_ctx, "n_threads": self.n_threads, "n_batch": n_batch,
                      "n_gpu_layers": n_gpu_layers, "draft": draft,
                      "draft_tokens": draft_tokens if draft else None}
        try:
            self.llm = llama_cpp.Llama(model_path=str(self.model.path), n_ctx=n_ctx,
                                       n_threads=self.n_threads, n_threads_batch=self.n_threads,
                                       n_batch=n_batch, n_gpu_layers=n_gpu_layers, seed=seed,
                                       draft_model=draft_model, verbose=False)
        except (ValueError, RuntimeError) as e:
            raise ModelLayerError(f"llama.cpp could not load {self.model.path}: {e}",
                                  hint="the file may be truncated or corrupt; re-derive or re-download it") from e
        meta = self.llm.metadata
        self._template = meta.get("tokenizer.chat_template")
        self._eog: list[int] | None = None

    # -- prompt handling -------------------------------------------------------------
    def format_prompt(self, request: Request) -> str:
        """The exact text the model sees: the chat template applied to the messages."""
        if request.prompt is not None:
            return request.prompt
        if not self._template:
            raise ModelLayerError(f"{self.model.path.name} has no chat template; pass prompt= instead")
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter
        fmt = Jinja2ChatFormatter(template=self._template,
                                  eos_token=compat.llama_token_text(self.llm, self.llm.token_eos()),
                                  bos_token=compat.llama_token_text(self.llm, self.llm.token_bos()))
        return fmt(messages=request.messages).prompt

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=special)

    def prompt_tokens(self, request: Request | str | Messages) -> list[int]:
        return self.tokenize(self.format_prompt(as_request(request)))

    def _eog_tokens(self) -> list[int]:
        if self._eog is None:
            vocab = compat.llama_vocab_ptr(self.llm)
            self._eog = [t for t in range(self.llm.n_vocab())
                         if self._llama_cpp.llama_vocab_is_eog(vocab, t)]
        return self._eog

    # -- the engine interface ----------------------------------------------------------
    def stream(self, request: Request | str | Messages, **overrides: Any) -> Iterator[Event]:
        req = as_request(request, **overrides)
        llm, lc = self.llm, self._llama_cpp
        tokens = self.prompt_tokens(req)
        n_ctx = llm.n_ctx()
        if len(tokens) + req.max_tokens > n_ctx:
            raise ContextLayerError(
                f"prompt of {len(tokens)} tokens + max_tokens {req.max_tokens} exceeds the "
                f"context window of {n_ctx}", hint="shorten the prompt or raise n_ctx")
        if not req.cache_prompt:
            llm.reset()  # forget the previous request: the whole prompt is evaluated again
        llm.set_seed(req.seed)
        processors = None
        if req.ignore_eos:
            import numpy as np
            eog = np.array(self._eog_tokens())

            def _no_eog(_ids, logits):  # forced length: end-of-generation can never win
                logits[eog] = -np.inf
                return logits
            processors = lc.LogitsProcessorList([_no_eog])
        # What generate() will take from the KV cache, read from the runtime's state now.
        # Not `len - n_p_eval`: llama.cpp counts a 1-token batch as a decode step
        # (`n_eval`), and prompt-lookup verify batches land in `n_p_eval`.
        cached = compat.llama_cached_prefix(llm, tokens)
        # llama.cpp files a decode's tokens into the perf counters at the next synchronize, so
        # work done outside stream() (a direct llm.eval) would land in this request's prompt_n
        lc.llama_synchronize(compat.llama_context_ptr(llm))
        lc.llama_perf_context_reset(compat.llama_context_ptr(llm))
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        vocab, generated, finish = compat.llama_vocab_ptr(llm), [], "length"
        gen = llm.generate(tokens, temp=req.temperature, top_k=0 if req.temperature else 1,
                           top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                           reset=True, logits_processor=processors)
        for tok in gen:
            if not req.ignore_eos and lc.llama_vocab_is_eog(vocab, tok):
                finish = "stop"
                break
            piece = llm.detokenize([tok], prev_tokens=tokens + generated)
            generated.append(tok)
            yield Event(t=time.perf_counter(), text=decoder.decode(piece), n_tokens=1)
            if len(generated) >= req.max_tokens:
                break
        gen.close()
        tail = decoder.decode(b"", final=True)
        perf = lc.llama_perf_context(compat.llama_context_ptr(llm))
        # llama.cpp reports each count as max(1, count); a phase that never ran has 0 ms
        timings = {"prompt_n": perf.n_p_eval if perf.t_p_eval_ms > 0 else 0, "prompt_ms": perf.t_p_eval_ms,
                   "predicted_n": perf.n_eval if perf.t_eval_ms > 0 else 0, "predicted_ms": perf.t_eval_ms,
                   "n_reused": perf.n_reused, "n_threads": self.n_threads}
        eog = int(finish == "stop")  # the stop token was generated, counted like servers do
        usage = Usage(prompt_tokens=len(tokens), completion_tokens=len(generated) + eog,
                      cached_tokens=cached, source="engine")
        yield Event(t=time.perf_counter(), text=tail, n_tokens=eog, done=True, usage=usage,
                    finish_reason=finish, timings=timings)

    # -- prompt-cache state (what the prefix-cache lesson saves and restores) ------------
    def save_state(self):
        """Snapshot of the KV cache and evaluated tokens (llama_cpp.LlamaState)."""
        return self.llm.save_state()

    def load_state(self, state) -> None:
        self.llm.load_state(state)

    def reset(self) -> None:
        """Forget all cached prefix state."""
        self.llm.reset()

    def describe(self) -> dict[str, Any]:
        meta = self.llm.metadata
        return {"engine": self.name, "runtime": "llama.cpp (llama-cpp-python)",
                "version": self._llama_cpp.__version__, "backend": _backend(self.flags),
                "model": str(self.model.path), "model_sha256": self.model.sha256(),
                "quantization": _FILE_TYPES.get(int(meta.get("general.file_type", -1)),
                                                meta.get("general.file_type")),
                "flags": dict(self.flags)}


def _backend(flags: dict) -> str:
    return "cpu" if not flags.get("n_gpu_layers") else "gpu-offload"


# llama_ftype values (llama.h) for the names learners meet in file names.
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
               10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S",
               15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}

"""transformers on torch, in process: the reference runtime, with every switch exposed.

This is the engine the concept lessons use to *show* mechanisms: the KV cache can be
turned off (`use_cache=False` recomputes attention over the whole sequence at every step),
and assisted decoding is one argument away (prompt-lookup or a draft model), so accepted
draft tokens arrive as multi-token chunks.

`model.generate` runs in a worker thread; a streamer stamps each batch of new token ids
with `time.perf_counter()` the moment transformers hands it over.
"""
from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from infercourse.core.errors import BackendMissingError, ContextLayerError, RuntimeLayerError
from infercourse.models.embedded import resolve_model
from infercourse.core.types import Event, Messages, Request, Usage, as_request

__all__ = ["TransformersEngine"]


class _StampingStreamer:
    """A transformers streamer (duck-typed BaseStreamer) that queues (time, token ids)."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # transformers first puts the prompt itself
            self._prompt_seen = True
            return
        self.q.put((time.perf_counter(), value.reshape(-1).tolist()))

    def end(self) -> None:
        self.q.put(None)


class TransformersEngine:
    """transformers `generate()` on torch.

    Args:
        model: an HF folder, a .gguf file (converted once through infercourse.models.formats),
            or None for the embedded model's derived HF folder.
        device: "cpu", "cuda" or "mps"; a missing device fails with a clear message.
        dtype: torch dtype name for the weights ("float32", "bfloat16", "float16").
        n_threads: torch intra-op threads (process-wide; recorded with results).
        use_cache: keep the KV cache between decode steps (False = recompute everything).
        assistant: None, "prompt-lookup", or a path to a smaller draft model folder.
        assistant_tokens: tokens proposed per step by the assistant (a draft model always
            proposes exactly this many; prompt lookup proposes up to this many).
    """

    name = "transformers"

    def __init__(self, model: str | Path | None = None, *, device: str = "cpu",
                 dtype: str = "float32", n_threads: int | None = None, use_cache: bool = True,
                 assistant: str | Path | None = None, assistant_tokens: int = 10):
        try:
            import torch
            import transformers
        except ImportError as e:
            raise BackendMissingError("transformers/torch are not installed",
                                      hint="run `make install` (extra `hf`)") from e
        self._torch, self._tf = torch, transformers
        _check_device(torch, device)
        ref = resolve_model(model)
        if ref.kind == "gguf":
            from infercourse.models.formats import hf_folder
            ref = resolve_model(hf_folder(None if model is None else ref.path))
        self.model_ref = ref
        if n_threads:
            torch.set_num_threads(n_threads)
        self.device, self.use_cache = device, use_cache
        from infercourse.models.quiet import quiet
        quiet()    # the "Loading weights" bar an executed notebook keeps frozen at its first frame
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(ref.path)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            ref.path, dtype=getattr(torch, dtype)).to(device).eval()
        self.assistant_model, self.assistant, self.draft_k = None, assistant, None
        if assistant is not None and assistant != "prompt-lookup":
            self.assistant_model = transformers.AutoModelForCausalLM.from_pretrained(
                assistant, dtype=getattr(torch, dtype)).to(device).eval()
            # transformers 5 takes the drafting schedule from the *assistant's* generation
            # config, not from generate() arguments: by default it adapts k (from 20) and
            # stops drafting under 0.4 confidence. Pin k, so every step proposes exactly
            # `assistant_tokens` (fewer only near max_tokens) and acceptance has a known base.
            cfg = self.assistant_model.generation_config
            cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = assistant_tokens, "constant"
            cfg.assistant_confidence_threshold = 0.0
            self.draft_k = assistant_tokens  # proposals per step, for acceptance counting
        self.flags = {"device": device, "dtype": dtype, "n_threads": torch.get_num_threads(),
                      "use_cache": use_cache, "assistant": str(assistant) if assistant else None,
                      "assistant_tokens": assistant_tokens if assistant else None}
        self._assistant_tokens = assistant_tokens

    def prompt_ids(self, request: Request | str | Messages) -> list[int]:
        req = as_request(request)
        if req.messages is not None:
            out = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True,
                                                     tokenize=True)
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        return self.tokenizer(req.prompt)["input_ids"]

    def stream(self, request: Request | str | Messages, **overrides: Any) -> Iterator[Event]:
        req = as_request(request, **overrides)
        torch = self._torch
        ids = self.prompt_ids(req)
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit and len(ids) + req.max_tokens > limit:
            raise ContextLayerError(f"prompt of {len(ids)} tokens + max_tokens {req.max_tokens} "
                                    f"exceeds the model's {limit}-token context")
        eos = set(_as_list(self.model.generation_config.eos_token_id))
        kwargs: dict[str, Any] = dict(max_new_tokens=req.max_tokens, use_cache=self.use_cache,
                                      pad_token_id=self.tokenizer.pad_token_id or next(iter(eos), 0))
        if req.temperature > 0:
            kwargs.update(do_sample=True, temperature=req.temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        if req.ignore_eos:
            kwargs["min_new_tokens"] = req.max_tokens
        if self.assistant == "prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = self._assistant_tokens
        elif self.assistant_model is not None:
            kwargs.update(assistant_model=self.assistant_model,
                          num_assistant_tokens=self._assistant_tokens,
                          num_assistant_tokens_schedule="constant")
        streamer, errors = _StampingStreamer(), []
        input_ids = torch.tensor([ids], device=self.device)

        def work():
            torch.manual_seed(req.seed)
            try:
                with torch.inference_mode():
                    self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                        streamer=streamer, **kwargs)
            except Exception as e:  # surfaced in the caller's thread below
                errors.append(e)
                streamer.end()

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        generated: list[int] = []
        text_so_far, finish = "", "length"
        while (item := streamer.q.get()) is not None:
            t, new = item
            if not req.ignore_eos and any(tok in eos for tok in new):
                new = new[:next(i for i, tok in enumerate(new) if tok in eos)]
                finish = "stop"
            generated.extend(new)
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            if new:
                yield Event(t=t, text=text[len(text_so_far):], n_tokens=len(new))
                text_so_far = text
        worker.join()
        if errors:
            raise RuntimeLayerError(f"transformers generate failed: {errors[0]}") from errors[0]
        eog = int(finish == "stop")  # the stop token was generated, counted like servers do
        usage = Usage(prompt_tokens=len(ids), completion_tokens=len(generated) + eog,
                      cached_tokens=0, source="engine")
        yield Event(t=time.perf_counter(), n_tokens=eog, done=True, usage=usage, finish_reason=finish,
                    timings={"use_cache": self.use_cache, "assistant": self.flags["assistant"]})

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "runtime": "transformers on torch",
                "version": self._tf.__version__, "torch": self._torch.__version__,
                "backend": self.device, "model": str(self.model_ref.path),
                "model_sha256": self.model_ref.sha256(), "quantization": self.flags["dtype"],
                "flags": dict(self.flags)}


def _as_list(x) -> list[int]:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def _check_device(torch, device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BackendMissingError("device='cuda' asked for, but torch sees no CUDA GPU",
                                  hint="use device='cpu', or install a CUDA build of torch on a GPU box")
    if device == "mps" and not torch.backends.mps.is_available():
        raise BackendMissingError("device='mps' asked for, but Metal is not available",
                                  hint="MPS needs an Apple Silicon Mac; use device='cpu'")

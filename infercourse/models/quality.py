"""Does a format still hold the same model? Per-token log-likelihood of a fixed text.

Converting or quantizing a model can break it silently: a dropped config field (rope_theta
falling back to 10000) or a too-coarse quantization still yields fluent-looking text. The
mean negative log-likelihood (NLL, nats per token) of a fixed paragraph catches both: the
same model in any format scores the same within rounding, a damaged one scores worse.
Perplexity is exp(mean NLL).

Each runtime scores the text with its own tokenizer and its own forward pass (llama.cpp,
transformers, MLX), so a tokenizer that drifted between formats shows up too: compare
the returned token ids.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from infercourse.core.errors import BackendMissingError, ModelLayerError
from infercourse.models.embedded import resolve_model

__all__ = ["PARAGRAPH", "token_nlls", "mean_nll", "perplexity"]

PARAGRAPH = (
    "The library opened at nine in the morning, and by ten most of the tables near the "
    "windows were taken. Students spread their notes across the wood and worked in silence, "
    "while the librarian walked between the shelves, returning books to their places. "
    "Outside, it had started to rain, and the sound of water on the glass made the room "
    "feel warmer than it was. Nobody seemed to mind that the coffee machine was broken again. "
    "Around noon a group of children arrived with their teacher, who asked them to whisper "
    "and to choose one book each. One boy wanted a book about volcanoes; his friend could "
    "not decide between a story about a lost dog and an atlas of the oceans. The librarian "
    "helped them find both, then showed the class how the cards in the old wooden catalogue "
    "still pointed to books that had been moved years ago. In the afternoon the rain "
    "stopped, the sun came through the clouds, and the long tables slowly emptied as people "
    "went home for dinner, leaving behind only a few pencils and a forgotten umbrella."
)


def token_nlls(model: str | Path | None, text: str = PARAGRAPH, *,
               n_threads: int = 2, gguf_options: dict | None = None) -> tuple[list[int], np.ndarray]:
    """Token ids of `text` and the NLL (nats) of each token after the first, given those before.

    No BOS or special tokens are added, so every format scores the same token sequence.

    Args:
        model: a GGUF file, HF folder or MLX folder (None: the embedded GGUF).
        text: the text to score; a few hundred tokens at most.
        n_threads: CPU threads for the forward pass.
        gguf_options: more `llama_cpp.Llama` arguments for a GGUF (e.g. YaRN rope scaling and
            a context-length override: what serving a longer window costs the model).
    """
    ref = resolve_model(model)
    scorer = {"gguf": _gguf_logits, "hf": _hf_logits, "mlx": _mlx_logits}.get(ref.kind)
    if scorer is None:
        raise ModelLayerError(f"cannot score a {ref.kind} model {ref.name!r}: need its files")
    if gguf_options and ref.kind != "gguf":
        raise ModelLayerError(f"gguf_options apply to a GGUF model, not a {ref.kind} one")
    ids, logits = scorer(ref.path, text, n_threads, **(gguf_options or {}))
    if len(ids) < 2:
        raise ModelLayerError("text too short to score: need at least two tokens")
    logits = np.asarray(logits, dtype=np.float64)[: len(ids) - 1]
    # log-softmax, shifted by the row max for stability
    logz = logits.max(axis=1) + np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1))
    nll = logz - logits[np.arange(len(ids) - 1), ids[1:]]
    return list(ids), nll


def mean_nll(model: str | Path | None, text: str = PARAGRAPH, *, n_threads: int = 2) -> float:
    """Mean NLL in nats per token of `text` under `model` (see `token_nlls`)."""
    return float(token_nlls(model, text, n_threads=n_threads)[1].mean())


def perplexity(model: str | Path | None, text: str = PARAGRAPH, *, n_threads: int = 2) -> float:
    """exp(mean NLL): the effective number of equally likely next tokens."""
    return math.exp(mean_nll(model, text, n_threads=n_threads))


def _gguf_logits(path: Path, text: str, n_threads: int, **options):
    import llama_cpp
    kw = dict(verbose=False, n_ctx=1024, n_batch=1024, logits_all=True, n_threads=n_threads,
              n_threads_batch=n_threads) | options
    llm = llama_cpp.Llama(model_path=str(path), **kw)
    try:
        ids = llm.tokenize(text.encode(), add_bos=False, special=False)
        llm.eval(ids)
        return ids, np.array(llm.scores[: len(ids)])
    finally:
        llm.close()


def _hf_logits(path: Path, text: str, n_threads: int):
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise BackendMissingError("transformers/torch not installed",
                                  hint="pip install 'infercourse[hf]'") from e
    torch.set_num_threads(n_threads)
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ids = tok(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return ids, logits.float().numpy()


def _mlx_logits(path: Path, text: str, n_threads: int):
    try:
        import mlx.core as mx
        import mlx_lm
    except ImportError as e:
        raise BackendMissingError("mlx-lm not installed", hint="pip install 'infercourse[mlx]'") from e
    model, tok = mlx_lm.load(str(path))
    ids = tok.encode(text, add_special_tokens=False)
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    return ids, np.array(logits)

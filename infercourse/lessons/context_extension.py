"""A window past the model's training: what serving it costs (notebook 20).

A real coding agent's first request does not fit the course's default 8,192-token server,
the length the embedded model was trained on. llama-server can serve more: override the
model's context length in its metadata and stretch the positions with YaRN rope scaling
(`ops.agent_lab.EXTEND_CONTEXT`). The model then sees every position scaled, at any length,
so its predictions change even on a short text. How much is measured, not assumed: the mean
negative log-likelihood (nats per token) of the course's evaluation text, with and without
those settings, token by token on the same tokens, and the difference's standard error.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["extension_cost", "extension_sentence"]


def extension_cost(ctx: int, trained: int | None = None, model: str | None = None, n_words: int = 600,
                   n_threads: int = 2) -> dict[str, Any]:
    """What serving `ctx` tokens to a model trained on `trained` costs it, measured: the mean
    NLL (nats per token) of the course's evaluation text with and without the YaRN settings
    `EXTEND_CONTEXT` gives llama-server, the per-token difference and its 2 standard errors
    (tokens are correlated, so the SE is a floor on the real uncertainty). `trained` None: the
    length, and the architecture whose metadata is overridden, read from the model's file.
    `n_threads`: the two forward passes' threads (each row of a product is one thread's, so
    the NLLs do not depend on it; only the time does)."""
    import llama_cpp

    from infercourse.measure.workloads import eval_text
    from infercourse.models.quality import token_nlls
    from infercourse.ops.agent_lab import trained_context
    arch, own = trained_context(None if model is None else str(model))
    trained = int(trained or own or 8192)
    text = " ".join(eval_text().split()[:n_words])
    base_ids, base = token_nlls(model, text, n_threads=n_threads)
    yarn = {"n_ctx": 1024, "rope_scaling_type": llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN,
            "rope_freq_scale": trained / ctx, "yarn_orig_ctx": trained,
            "kv_overrides": {f"{arch}.context_length": int(ctx)}}
    ids, ext = token_nlls(model, text, n_threads=n_threads, gguf_options=yarn)
    assert ids == base_ids
    d = ext - base
    return {"window": ctx, "trained": trained, "tokens": len(d), "nll trained": float(base.mean()),
            "nll extended": float(ext.mean()), "diff": float(d.mean()),
            "2 SE": float(2 * d.std(ddof=1) / np.sqrt(len(d)))}



def extension_sentence(cost: dict[str, Any]) -> str:
    """Whether the extension's quality cost shows beyond its 2 SE on this text."""
    diff, se = cost["diff"], cost["2 SE"]
    verdict = ("worse beyond 2 SE" if diff > se else "better beyond 2 SE" if diff < -se else "within 2 SE of no change")
    return (f"Serving {cost['window']:,} tokens to a model trained on {cost['trained']:,} (YaRN x"
            f"{cost['window'] / cost['trained']:g}) changed the mean NLL on {cost['tokens']} tokens of text by "
            f"{diff:+.3f} nats per token (2 SE {se:.3f}): {verdict}, perplexity x{math.exp(diff):.2f}.")

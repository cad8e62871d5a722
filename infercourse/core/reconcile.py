"""The client's numbers checked against the engine's own: llama.cpp perf counters,
llama-server `timings`, Ollama's durations. Two independent clocks that agree are the
best evidence a measurement is right; when they disagree, the difference is the layer in
between (HTTP, detokenizing, a server holding back its last event).
"""
from __future__ import annotations

from typing import Any, Mapping

import pandas as pd

from infercourse.core.metrics import e2e_s, output_tokens, token_chunks, ttft_from_send_s, ttft_s
from infercourse.core.trace import RequestTrace

__all__ = ["ENGINE_FIELDS", "engine_view", "reconcile", "check_identity"]


# engine field -> (our quantity, factor to seconds or tokens). Names as each engine emits:
ENGINE_FIELDS: dict[str, tuple[str, float]] = {
    # llama.cpp perf context (llama_perf_context_data), milliseconds
    "t_p_eval_ms": ("prefill_s", 1e-3), "n_p_eval": ("prefill_tokens", 1),
    "t_eval_ms": ("decode_s", 1e-3), "n_eval": ("decode_tokens", 1),
    # llama-server `timings` block, milliseconds
    "prompt_ms": ("prefill_s", 1e-3), "prompt_n": ("prefill_tokens", 1),
    "predicted_ms": ("decode_s", 1e-3), "predicted_n": ("decode_tokens", 1),
    "cache_n": ("cached_tokens", 1),
    # Ollama final chunk, nanoseconds. prompt_eval_count is the evaluated tokens on older
    # servers; where prompt_eval_cached_count is sent it is the whole prompt (see below)
    "prompt_eval_duration": ("prefill_s", 1e-9), "prompt_eval_count": ("prefill_tokens", 1),
    "prompt_eval_cached_count": ("cached_tokens", 1),
    "eval_duration": ("decode_s", 1e-9), "eval_count": ("decode_tokens", 1),
}


def engine_view(timings: Mapping[str, Any]) -> dict[str, float]:
    """Translate an engine's own timing fields into our quantities (seconds, tokens)."""
    out = {ENGINE_FIELDS[k][0]: float(v) * ENGINE_FIELDS[k][1]
           for k, v in timings.items() if k in ENGINE_FIELDS and v is not None}
    if timings.get("prompt_eval_cached_count") is not None and "prefill_tokens" in out:
        out["prefill_tokens"] -= out["cached_tokens"]   # Ollama: count includes the cache
    return out


def reconcile(tr: RequestTrace, *, rtol: float = 0.25, atol_s: float = 0.02,
              token_slack: int = 1) -> pd.DataFrame:
    """Compare what the client measured with what the engine says it did.

    Token counts must agree within `token_slack` (engines differ by one on whether the
    token sampled from the prefill logits is a "decode eval": llama.cpp's `n_eval`
    usually is n-1, llama-server's `predicted_n` is n). Prefill tokens are compared to
    *uncached* prompt tokens. Times agree when |client - engine| <= atol_s + rtol*engine;
    the client side always holds some extra (HTTP, detokenizing), hence the tolerance.
    Returns one row per quantity both sides know: client, engine, ok.
    """
    eng = engine_view(tr.engine_timings)
    idx = token_chunks(tr)
    n = output_tokens(tr)
    client: dict[str, float | None] = {
        "prefill_tokens": None if tr.prompt_tokens is None
        else tr.prompt_tokens - (eng.get("cached_tokens", tr.cached_tokens) or 0),
        "decode_tokens": n,
        "prefill_s": ttft_from_send_s(tr),
        "decode_s": tr.chunk_t[idx[-1]] - tr.chunk_t[idx[0]] if len(idx) > 1 else None,
    }
    rows = []
    for q, c in client.items():
        if q not in eng or c is None:
            continue
        e = eng[q]
        if q.endswith("tokens"):
            ok = abs(c - e) <= token_slack
        else:
            ok = abs(c - e) <= atol_s + rtol * e
        rows.append({"quantity": q, "client": float(c), "engine": e, "diff": float(c) - e, "ok": ok})
    return pd.DataFrame(rows, columns=["quantity", "client", "engine", "diff", "ok"])


def check_identity(tr: RequestTrace, tpot: float | None = None, *, rtol: float = 0.05,
                   atol_s: float = 0.005) -> dict[str, Any]:
    """Check E2E ~= TTFT + TPOT * (n - 1), with TPOT taken from the token stream alone
    ((last chunk - first chunk) / (n - 1)) unless given (an engine's or another tool's).

    The residual is the time after the last token: a server holding back its final
    usage event, a slow teardown, or a TPOT from elsewhere that does not match.
    """
    n, ttft, e2e, idx = output_tokens(tr), ttft_s(tr), e2e_s(tr), token_chunks(tr)
    if n < 2 or ttft is None or e2e is None or len(idx) < 2:
        return {"ok": None, "reason": "needs >= 2 tokens in >= 2 chunks"}
    if tpot is None:
        tpot = (tr.chunk_t[idx[-1]] - tr.chunk_t[idx[0]]) / (n - 1)
    rhs = ttft + tpot * (n - 1)
    resid = e2e - rhs
    return {"e2e_s": e2e, "rhs_s": rhs, "residual_s": resid,
            "ok": abs(resid) <= atol_s + rtol * e2e}

"""This machine's ceilings, and what they imply for a model: predict before you measure.

Decoding one token reads every weight once, plus the KV cache of the context so far, so
decode speed can never beat  memory bandwidth / bytes read per token. Prefill does about
2 FLOPs per parameter per prompt token (one multiply and one add), so it can never beat
FLOP/s / (2 * params multiplied per token: the embedding is a lookup, not a
matmul). The two numbers are probed here (`measure.machine_probe`, re-exported: `probe`,
`machine_ceilings`): a read of an array several times the CPU's last-level cache for
bandwidth, float32 matmuls for FLOP/s, best of N, on the engine's own thread count (a
1-thread server's ceiling is one core's): a simple, repeatable stand-in for STREAM and a
BLAS benchmark, not a tuned record. With B sequences decoded together (`batch_ceiling`) one
read of the weights serves B tokens, so the memory roof rises with B while the compute roof
stays put.

A ceiling is a bound, not a label. Model bandwidth utilisation (MBU) = measured decode tok/s
/ the bandwidth ceiling: report it with every decode number, so "12 tok/s" becomes "12 tok/s
= 40 % of what this memory allows". A phase is *bandwidth-bound* only near that ceiling and
*compute-bound* only near a compute roof of its own kernel's data type (`achieved_gflops`
turns a measured rate into FLOP/s, e.g. llama.cpp's long-prompt prefill as the roof of its
quantized kernels); `measure.stream_regime.phase_regime` reads the label from those shares, never
from arithmetic intensity alone (`arithmetic_intensity` and `balance_tokens` are the
prediction the measurement is set against).

The client has a ceiling too: `chunks_per_second` measures how many streamed chunks one
client process takes in (and the CPU each costs) from `testing.SSESource`, a local server that is
never the bottleneck; a real server streaming far fewer leaves the client idle.
"""
from __future__ import annotations

import time
from typing import Any

from infercourse.measure.machine_probe import (machine_ceilings, matmul_gflops, memory_bandwidth_gbs,  # noqa: F401
                                               probe, probe_text)
from infercourse.models.modelcard import kv_bytes_per_token

__all__ = ["probe", "memory_bandwidth_gbs", "matmul_gflops", "machine_ceilings", "probe_text", "kv_bytes_per_token",
           "bytes_per_decoded_token", "decode_ceiling_tok_per_s", "prefill_ceiling_tok_per_s",
           "prefill_params_per_token", "decode_params_per_token", "batch_ceiling",
           "mbu", "achieved_gflops", "arithmetic_intensity", "balance_tokens", "ceilings", "chunks_per_second"]


# -- model arithmetic ---------------------------------------------------------------------------
def _field(card: Any, key: str) -> Any:
    return card[key] if isinstance(card, dict) else getattr(card, key)


def _weight_bytes(card: Any) -> float:
    if isinstance(card, dict):
        return card["weight_bytes"]
    return card.weight_bytes() if callable(getattr(card, "weight_bytes", None)) else card.weight_bytes


def _params(card: Any) -> float:
    if isinstance(card, dict):
        return card["n_params"] if "n_params" in card else card["params"]
    return card.n_params


def bytes_per_decoded_token(card: Any, context: int, *, kv_dtype_bytes: float = 2) -> float:
    """Bytes streamed from memory for one decode step: all weights + the KV cache of
    `context` tokens.

    Args:
        card: a `modelcard.ModelCard`, or a dict with weight_bytes, n_layers, n_kv_heads, head_dim.
        context: tokens already in the KV cache.
        kv_dtype_bytes: bytes per cached element (2 = f16).
    """
    kv = kv_bytes_per_token(_field(card, "n_layers"), _field(card, "n_kv_heads"),
                            _field(card, "head_dim"), kv_dtype_bytes)
    return _weight_bytes(card) + kv * context


def decode_ceiling_tok_per_s(bandwidth_gbs: float, card: Any, context: int = 0, **kw: Any) -> float:
    """Upper bound on single-stream decode speed: bandwidth / bytes per decoded token."""
    return bandwidth_gbs * 1e9 / bytes_per_decoded_token(card, context, **kw)


def prefill_params_per_token(card: Any) -> float:
    """Parameters a prefilled prompt token is multiplied by: all of them except the
    vocab x hidden embedding, which is a table lookup for input tokens and, as the output
    head, runs only for the last prompt token (one head counted; a card without vocab_size
    and hidden_size keeps every parameter)."""
    p = _params(card)
    try:
        emb = _field(card, "vocab_size") * _field(card, "hidden_size")
    except (KeyError, AttributeError):
        return p
    return p - emb if 0 < emb < p else p


def prefill_ceiling_tok_per_s(gflops: float, card: Any) -> float:
    """Upper bound on prefill speed: FLOP/s / (2 FLOPs x params multiplied per token)."""
    return gflops * 1e9 / (2 * prefill_params_per_token(card))


def decode_params_per_token(card: Any) -> float:
    """Parameters every decoded token is multiplied by: all of them, the LM head included
    (tied embeddings are counted once in the card, and the head multiplies by that matrix
    while the input lookup is free). `prefill_params_per_token` leaves the head out because
    prefill runs it for the last prompt token only; decode runs it every token."""
    return float(_params(card))


def batch_ceiling(card: Any, machine: dict[str, Any], batch_sizes, context: int = 0) -> "Any":
    """Aggregate decode ceiling when B sequences share each pass over the weights.

    memory roof: B x bandwidth / (weights + B x KV bytes per token x context): the weights
        are read once per step for the whole batch, but each sequence reads its own KV cache
    compute roof: FLOP/s / (2 x params), the LM head included (`decode_params_per_token`)
    The ceiling is the lower of the two; the crossover B is the machine's balance point.
    `attrs["compute_source"]` says where the FLOP/s came from.

    Args:
        card: the model card; machine: `probe()` output (or bandwidth_gbs, matmul_gflops_f32).
        batch_sizes: sequences decoded together.
        context: tokens already cached per sequence.
    """
    import pandas as pd
    weights = bytes_per_decoded_token(card, 0)
    kv_ctx = bytes_per_decoded_token(card, context) - weights     # one sequence's KV read
    params = decode_params_per_token(card)
    compute = machine["matmul_gflops_f32"] * 1e9 / (2 * params)
    rows = []
    for b in batch_sizes:
        step_bytes = weights + b * kv_ctx
        mem = b * machine["bandwidth_gbs"] * 1e9 / step_bytes
        rows.append({"batch": b, "flops_per_byte": 2 * params * b / step_bytes,
                     "memory_bound_tok_per_s": mem, "compute_bound_tok_per_s": compute,
                     "ceiling_tok_per_s": min(mem, compute), "bound": "memory" if mem < compute else "compute"})
    out = pd.DataFrame(rows).set_index("batch")
    t = machine.get("matmul_threads")
    out.attrs["compute_source"] = (f"float32 matmul, {machine['matmul_gflops_f32']:.0f} GFLOP/s"
                                   + (f" on {t} thread{'s' if t != 1 else ''}" if t else ""))
    return out


def mbu(decode_tok_per_s: float, bandwidth_gbs: float, card: Any, context: int = 0, **kw: Any) -> float:
    """Model bandwidth utilisation: measured decode tok/s / the bandwidth ceiling (0..1)."""
    return decode_tok_per_s / decode_ceiling_tok_per_s(bandwidth_gbs, card, context, **kw)


def achieved_gflops(tok_per_s: float, card: Any, phase: str = "decode") -> float:
    """The arithmetic a measured rate did, in GFLOP/s: tok/s x 2 x the params a token of that
    phase multiplies (`decode_params_per_token`, `prefill_params_per_token`). A long prompt's
    prefill rate gives what a kernel reaches when arithmetic, not memory, is the limit: the
    compute roof of a quantized kernel that no float32 probe measures.

    Args:
        tok_per_s: the measured rate; card: the model card; phase: "decode" or "prefill".
    """
    if phase not in ("decode", "prefill"):
        raise ValueError(f"phase must be 'decode' or 'prefill', got {phase!r}")
    params = decode_params_per_token(card) if phase == "decode" else prefill_params_per_token(card)
    return tok_per_s * 2 * params / 1e9


def arithmetic_intensity(card: Any, n_tokens: int) -> float:
    """FLOPs per byte of weights read when `n_tokens` tokens share one pass over the weights:
    2 x params x n / weight bytes (1 token = decode; n = a prefill of n tokens)."""
    return 2 * _params(card) * n_tokens / _weight_bytes(card)


def balance_tokens(card: Any, gflops: float, bandwidth_gbs: float) -> float:
    """Tokens per pass at which arithmetic intensity reaches the machine's balance point
    (FLOP/s / bytes/s): below it a pass waits on memory, above it on arithmetic."""
    return (gflops / bandwidth_gbs) / arithmetic_intensity(card, 1)


def ceilings(card: Any, machine: dict[str, Any], contexts: tuple[int, ...] = (0, 512, 2048)) -> dict[str, Any]:
    """The predictions a lesson prints before measuring, for one model on this machine.

    Args:
        card: model card (or dict, see `bytes_per_decoded_token`).
        machine: `probe()` output (uses `bandwidth_gbs` and `matmul_gflops_f32`).
    """
    bw = machine["bandwidth_gbs"]
    out = {f"decode_ceiling_tok_per_s@{c}": decode_ceiling_tok_per_s(bw, card, c) for c in contexts}
    out["prefill_ceiling_tok_per_s"] = prefill_ceiling_tok_per_s(machine["matmul_gflops_f32"], card)
    out.update(bandwidth_gbs=bw, weight_bytes=_weight_bytes(card),
               kv_bytes_per_token=kv_bytes_per_token(_field(card, "n_layers"), _field(card, "n_kv_heads"),
                                                     _field(card, "head_dim")))
    return out


# -- the client's ceiling: can one client process keep up with a fast stream? ---------------
def chunks_per_second(n_chunks: int = 20_000, n_requests: int = 3) -> dict[str, float]:
    """How many streamed chunks per second this client process can take in, and the CPU
    seconds each costs, reading a local source that is never the bottleneck, through the
    same `OpenAIHTTPEngine.astream` path a benchmark uses. Compare with the chunks/s a
    real server sends: if that is far below this, the client is not the bottleneck.

    `chunks_per_s` is what was ingested; when `client_cpu_frac` < 1 the source (sharing
    the CPUs) set that pace, and `client_ceiling_chunks_per_s` = 1 / CPU seconds per
    chunk is what one fully busy client core could take.

    Args:
        n_chunks: chunks per request (one token each).
        n_requests: requests in sequence; the best is reported.
    """
    from infercourse.core.types import Request
    from infercourse.engines.openai_http import OpenAIHTTPEngine
    from infercourse.measure.bench import loop_in_thread
    from infercourse.testing import SSESource
    best: dict[str, float] = {}

    async def probe(engine):
        async with engine.async_client(1) as client:
            for _ in range(n_requests):
                t0, c0, k = time.perf_counter(), time.thread_time(), 0
                async for ev in engine.astream(Request(prompt="x", max_tokens=n_chunks), client=client):
                    k += ev.n_tokens
                wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                if k / wall > best.get("chunks_per_s", 0):
                    best.update(chunks_per_s=k / wall, cpu_s_per_chunk=cpu / k, client_cpu_frac=cpu / wall,
                                client_ceiling_chunks_per_s=k / cpu, chunks=k)

    with SSESource() as src:
        engine = OpenAIHTTPEngine(src.url, model="sse-source", api="completions")
        if loop_in_thread(lambda: probe(engine)):
            raise KeyboardInterrupt
    return best

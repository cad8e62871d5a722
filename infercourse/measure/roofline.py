"""This machine's ceilings, and what they imply for a model: predict before you measure.

Decoding one token reads every weight once, plus the KV cache of the context so far, so
decode speed can never beat  memory bandwidth / bytes read per token. Prefill does about
2 FLOPs per parameter per prompt token (one multiply and one add), so it can never beat
FLOP/s / (2 * params multiplied per token: the embedding is a lookup, not a
matmul). `probe()` measures both ceilings here in a few seconds with numpy
(large-array max and copy for bandwidth, float32 matmul for FLOP/s, best of N): a
simple, repeatable stand-in for STREAM and a BLAS benchmark, not a tuned record.
Both are measured on the engine's own thread count: a 1-thread server's ceiling is one
core's. With B sequences decoded together (`batch_ceiling`) one read of the weights serves
B tokens, so the memory roof rises with B while the compute roof stays put.

The client has a ceiling too: `chunks_per_second` measures how many streamed chunks one
client process takes in (and the CPU each costs) from `testing.SSESource`, a local server that is
never the bottleneck; a real server streaming far fewer leaves the client idle.

Model bandwidth utilisation (MBU) = measured decode tok/s / ceiling: report it with every
decode number, so "12 tok/s" becomes "12 tok/s = 40 % of what this memory allows".
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from infercourse.models.modelcard import kv_bytes_per_token

__all__ = ["probe", "memory_bandwidth_gbs", "matmul_gflops", "kv_bytes_per_token",
           "bytes_per_decoded_token", "decode_ceiling_tok_per_s", "prefill_ceiling_tok_per_s",
           "prefill_params_per_token", "decode_params_per_token", "batch_ceiling",
           "mbu", "arithmetic_intensity", "balance_tokens", "ceilings", "chunks_per_second"]


def _best_time(fn: Callable[[], Any], *, repeats: int, budget_s: float) -> float:
    """Fastest of up to `repeats` runs (after one warm-up), stopping when over budget."""
    fn()
    best, t_end = math.inf, time.perf_counter() + budget_s
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > t_end:
            break
    return best


def memory_bandwidth_gbs(size_mb: int = 256, *, threads: int = 1, repeats: int = 30,
                         budget_s: float = 2.0) -> dict[str, float]:
    """Read bandwidth (max of a large float32 array: a SIMD scan that, unlike the
    pairwise `sum`, is not compute-bound) and copy bandwidth (bytes read + written).

    Args:
        size_mb: array size; far larger than any CPU cache so we measure DRAM.
        threads: split the array across this many threads (numpy releases the GIL).
        repeats: best of this many timed runs (a ceiling is the peak: on a shared machine
            the more short runs, the likelier one meets an idle core).
        budget_s: stop repeating after this long.
    """
    n = size_mb * 2**20 // 4
    src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
    parts = np.array_split(np.arange(n), threads)
    bounds = [(int(p[0]), int(p[-1]) + 1) for p in parts if len(p)]
    pool = ThreadPoolExecutor(threads) if threads > 1 else None

    def run(op):
        if pool is None:
            return op(0, n)
        return list(pool.map(lambda b: op(*b), bounds))

    try:
        t_read = _best_time(lambda: run(lambda a, b: src[a:b].max()), repeats=repeats, budget_s=budget_s / 2)
        t_copy = _best_time(lambda: run(lambda a, b: np.copyto(dst[a:b], src[a:b])), repeats=repeats,
                            budget_s=budget_s / 2)
    finally:
        if pool is not None:
            pool.shutdown()
    return {"read_gbs": src.nbytes / t_read / 1e9, "copy_gbs": 2 * src.nbytes / t_copy / 1e9,
            "threads": threads, "size_mb": size_mb}


# BLAS reads its thread count from these when it loads: a child process started with them
# set runs the matmul on exactly that many threads (numpy has no thread setting of its own)
_BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                     "VECLIB_MAXIMUM_THREADS")
_CHILD = ("import sys; from infercourse.measure.roofline import matmul_gflops as f; "
          "print(f(int(sys.argv[1]), repeats=int(sys.argv[2]), budget_s=float(sys.argv[3])))")


def matmul_gflops(n: int = 512, *, threads: int | None = None, backend: str = "numpy", repeats: int = 200,
                  budget_s: float = 1.0) -> float:
    """float32 n x n matmul throughput, 2 n^3 FLOPs per product, best of up to `repeats`.

    Many short products, keeping the fastest: on a shared machine one of them runs while
    no neighbour holds the core, and a ceiling is the peak, not the average.

    Args:
        threads: BLAS threads (None: the library's default, every core). Give the engine's:
            a 1-thread server's roof is one core's. Every core is also fragile: a BLAS whose
            threads wait for each other collapses when any core is busy (a 2-core VM beside
            one busy loop read 6-50 GFLOP/s on 2 threads, and 150 on 1).
        backend: "numpy" (its BLAS; with `threads`, in a child process whose BLAS starts with
            that many) or "torch" (CPU; its thread setting, restored after).
        repeats, budget_s: best of this many products, stopping after this long.
    """
    if backend not in ("numpy", "torch"):
        raise ValueError(f"backend must be 'numpy' or 'torch', got {backend!r}")
    if backend == "numpy" and threads is not None:
        env = {**os.environ, **{v: str(threads) for v in _BLAS_THREAD_VARS}}
        out = subprocess.run([sys.executable, "-c", _CHILD, str(n), str(repeats), str(budget_s)], env=env,
                             capture_output=True, text=True, timeout=60 + 10 * budget_s, check=True)
        return float(out.stdout.split()[-1])
    if backend == "torch":
        import torch
        a, b = torch.rand(n, n), torch.rand(n, n)
        fn = lambda: torch.mm(a, b)  # noqa: E731
        before = torch.get_num_threads()
        torch.set_num_threads(threads or before)
        try:
            return 2 * n**3 / _best_time(fn, repeats=repeats, budget_s=budget_s) / 1e9
        finally:
            torch.set_num_threads(before)
    rng = np.random.default_rng(0)
    a, b = rng.random((n, n), np.float32), rng.random((n, n), np.float32)
    return 2 * n**3 / _best_time(lambda: a @ b, repeats=repeats, budget_s=budget_s) / 1e9


def probe(*, threads: int | None = None, quick: bool = False) -> dict[str, Any]:
    """Measure this machine's ceilings on `threads` threads: single- and multi-thread read
    bandwidth, and float32 matmul GFLOP/s on that many threads (`matmul_threads`).

    Args:
        threads: the engine's thread count (default: logical cores). Bandwidth is read on
            one thread and on this many; the matmul runs on exactly this many.
        quick: smaller arrays and shorter budgets (numbers are noisier).
    """
    threads = threads or os.cpu_count() or 1
    size = 64 if quick else 256
    one = memory_bandwidth_gbs(size, threads=1, budget_s=1.0 if quick else 2.0)
    out: dict[str, Any] = {"read_gbs_1t": one["read_gbs"], "copy_gbs_1t": one["copy_gbs"]}
    if threads > 1:
        many = memory_bandwidth_gbs(size, threads=threads, budget_s=1.0 if quick else 2.0)
        out.update(read_gbs_mt=many["read_gbs"], copy_gbs_mt=many["copy_gbs"])
    out.update(threads=threads, array_mb=size, matmul_threads=threads,
               matmul_gflops_f32=matmul_gflops(512, threads=threads, budget_s=0.5 if quick else 1.5))
    out["bandwidth_gbs"] = max(v for k, v in out.items() if k.startswith("read_gbs"))
    return out


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

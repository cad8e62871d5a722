"""How fast this machine's memory streams and its cores multiply: the two roofs, probed.

**Bandwidth.** Read a float32 array with numpy's `max` (a SIMD scan that, unlike the
pairwise `sum`, is not compute-bound), best of many passes. The array must be several times
larger than the CPU's last-level cache, or the probe measures the cache: `probe_size_mb`
sizes it at `CACHE_FACTOR` × the cache `hardware.last_level_cache` reads (at least
`MIN_MB`). On this course's 2-core VM the cache reads as 480 MiB: a 64 MB array gave 29
GB/s on one thread and a 128 MB one 15-16 GB/s, so two notebooks put the same Q4_1 file's
ceiling at 294 and 159 tok/s. One sizing, used by every notebook, ends that. A VM can report
the host socket's whole L3 (more than its slice): then the rule over-sizes the array, which
costs a second, not a wrong number. Measure on the engine's own thread count: one core
cannot pull what the whole chip can, and a 1-thread engine's roof is one core's.

**FLOP/s.** Many short float32 n × n matmuls on exactly the engine's threads, the fastest
kept (`matmul_gflops`): the roof of a float32 kernel (transformers on CPU, numpy). It is
*not* the roof of llama.cpp's quantized kernels, which unpack blocks to int8 and multiply
with int8/int16 SIMD dot products; no probe here runs those. What such a kernel can do is
read from llama.cpp itself: its prefill rate on a long prompt (`roofline.achieved_gflops`).

`machine_ceilings` runs both on one thread count and says where each number came from.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np

from infercourse.measure import hardware

__all__ = ["CACHE_FACTOR", "MIN_MB", "probe_size_mb", "memory_bandwidth_gbs", "matmul_gflops", "probe",
           "machine_ceilings", "probe_text"]

CACHE_FACTOR = 4      # the probe array is at least this many times the last-level cache
MIN_MB = 256          # ... and never smaller than this (a machine that reports no cache)


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


def probe_size_mb(llc_bytes: int | None, *, factor: float = CACHE_FACTOR, min_mb: int = MIN_MB,
                  available_bytes: int | None = None) -> int:
    """The bandwidth probe's array size in MiB: `factor` × the last-level cache, at least
    `min_mb`, in steps of 64 MiB, and at most half the memory available.

    Args:
        llc_bytes: the last-level cache (None: unknown, `min_mb`).
        available_bytes: memory free for the array (None: no cap).
    """
    want = max(min_mb, factor * llc_bytes / 2**20 if llc_bytes else 0)
    mb = 64 * math.ceil(want / 64)
    if available_bytes:
        mb = min(mb, max(64, 64 * int(available_bytes / 2 / 2**20 // 64)))
    return int(mb)


def memory_bandwidth_gbs(size_mb: int | None = None, *, threads: int | Sequence[int] = 1, repeats: int = 30,
                         budget_s: float = 1.5) -> dict[str, Any]:
    """Read bandwidth of one array, on each thread count in `threads` (the array split among
    them; numpy releases the GIL). Returns read_gbs (the first thread count's), by_threads
    {threads: GB/s}, threads, size_mb, and the cache it was sized against: llc_bytes,
    llc_source, array_over_llc (array ÷ cache: under `CACHE_FACTOR` the reading may include
    cache hits).

    Args:
        size_mb: array size (None: `probe_size_mb` of this machine's last-level cache).
        threads: a thread count, or several, read in turn on the same array.
        repeats: best of this many timed passes (a ceiling is the peak: on a shared machine
            the more short runs, the likelier one meets an idle core).
        budget_s: stop repeating after this long, per thread count.
    """
    import psutil
    llc = hardware.last_level_cache()
    if size_mb is None:
        size_mb = probe_size_mb(llc["bytes"], available_bytes=psutil.virtual_memory().available)
    counts = [threads] if isinstance(threads, int) else list(threads)
    n = size_mb * 2**20 // 4
    src = np.ones(n, np.float32)
    by: dict[int, float] = {}
    for t in counts:
        bounds = [(i * n // t, (i + 1) * n // t) for i in range(t)]
        with ThreadPoolExecutor(t) as pool:
            run = (lambda: src.max()) if t == 1 else (lambda: list(pool.map(lambda b: src[b[0]:b[1]].max(), bounds)))
            by[t] = src.nbytes / _best_time(run, repeats=repeats, budget_s=budget_s) / 1e9
    return {"read_gbs": by[counts[0]], "by_threads": by, "threads": counts[0], "size_mb": size_mb,
            "llc_bytes": llc["bytes"], "llc_source": llc["source"],
            "array_over_llc": size_mb * 2**20 / llc["bytes"] if llc["bytes"] else math.nan}


def probe_text(bw: dict[str, Any]) -> str:
    """The bandwidth probe in one sentence: what it read, on which array, against the cache.

    Args:
        bw: `memory_bandwidth_gbs` output.
    """
    rates = ", ".join(f"**{g:.1f} GB/s** on {t} thread{'s' if t > 1 else ''}" for t, g in bw["by_threads"].items())
    head = f"Read bandwidth {rates}, on a {bw['size_mb']:,} MiB array"
    if not bw.get("llc_bytes"):
        return head + f" ({bw['llc_source']}: the array could not be sized against the cache)."
    r, llc = bw["array_over_llc"], bw["llc_bytes"] / 2**20
    cache = f"this CPU's last-level cache, {llc:,.0f} MiB ({bw['llc_source']})"
    if r >= CACHE_FACTOR:
        return head + f": {r:.1f}× {cache}, so the reads come from memory, not the cache."
    return head + (f": only {r:.1f}× {cache}, under the {CACHE_FACTOR}× a memory reading needs: part of it may "
                   "have come from the cache, so this ceiling may be too high.")


# BLAS reads its thread count from these when it loads: a child process started with them
# set runs the matmul on exactly that many threads (numpy has no thread setting of its own)
_BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                     "VECLIB_MAXIMUM_THREADS")
_CHILD = ("import sys; from infercourse.measure.machine_probe import matmul_gflops as f; "
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
        before = torch.get_num_threads()
        torch.set_num_threads(threads or before)
        try:
            return 2 * n**3 / _best_time(lambda: torch.mm(a, b), repeats=repeats, budget_s=budget_s) / 1e9
        finally:
            torch.set_num_threads(before)
    rng = np.random.default_rng(0)
    a, b = rng.random((n, n), np.float32), rng.random((n, n), np.float32)
    return 2 * n**3 / _best_time(lambda: a @ b, repeats=repeats, budget_s=budget_s) / 1e9


def probe(*, threads: int | None = None, quick: bool = False) -> dict[str, Any]:
    """This machine's ceilings on `threads` threads: read bandwidth on one thread and on
    `threads` (one array, sized from the cache whatever `quick`), and float32 matmul GFLOP/s
    on exactly `threads` (`matmul_threads`). `bandwidth_gbs` is the larger read; the array's
    size and the cache it was sized against come along (`probe_text`).

    Args:
        threads: the engine's thread count (default: logical cores).
        quick: shorter budgets (numbers are noisier; the array keeps its size, since a
            smaller one would measure the cache).
    """
    threads = threads or os.cpu_count() or 1
    bw = memory_bandwidth_gbs(threads=sorted({1, threads}), budget_s=0.8 if quick else 1.5)
    out: dict[str, Any] = {"read_gbs_1t": bw["by_threads"][1]}
    if threads > 1:
        out["read_gbs_mt"] = bw["by_threads"][threads]
    out.update(threads=threads, array_mb=bw["size_mb"], llc_bytes=bw["llc_bytes"], llc_source=bw["llc_source"],
               bandwidth=bw, matmul_threads=threads,
               matmul_gflops_f32=matmul_gflops(512, threads=threads, budget_s=0.5 if quick else 1.5))
    out["bandwidth_gbs"] = max(v for k, v in out.items() if k.startswith("read_gbs"))
    return out


def machine_ceilings(n_threads: int = 1, *, scaling_threads: int | None = None, matmul_n: int = 1024,
                     size_mb: int | None = None, bandwidth: bool = True) -> dict[str, Any]:
    """Bandwidth and float32 FLOP/s on the engine's thread count: the probe every notebook
    uses. bandwidth_gbs (on `n_threads`), bandwidth (the probe's dict: `probe_text`), gflops
    (torch's float32 matmul on `n_threads`, else numpy's BLAS in a child on that many),
    gflops_source, threads.

    Args:
        n_threads: the engine's thread count.
        scaling_threads: also read the bandwidth on this many threads (same array), for a
            thread-scaling check (`stream_regime.thread_check`).
        matmul_n: matrix size for the FLOP/s probe.
        size_mb: bandwidth array (None: sized from the cache).
        bandwidth: False skips the bandwidth probe (seconds on a cache-sized array) for a
            lesson that needs only the FLOP/s; bandwidth_gbs is then None.
    """
    counts = [n_threads] + ([scaling_threads] if scaling_threads and scaling_threads != n_threads else [])
    bw = memory_bandwidth_gbs(size_mb, threads=counts, budget_s=1.0) if bandwidth else {"read_gbs": None}
    try:
        import torch  # noqa: F401
        gflops, src = matmul_gflops(matmul_n, threads=n_threads, backend="torch", budget_s=1.0), "torch"
    except ImportError:
        gflops, src = matmul_gflops(matmul_n, threads=n_threads, budget_s=1.0), "numpy BLAS"
    return {"bandwidth_gbs": bw["read_gbs"], "bandwidth": bw, "gflops": gflops, "threads": n_threads,
            "gflops_source": f"{src} float32 matmul, {n_threads} thread{'s' if n_threads > 1 else ''}"}

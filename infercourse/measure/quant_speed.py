"""Speed and memory of quantized formats, measured so that a difference can be told from noise.

Two rules keep 07's speed columns honest:

- **Compare like with like.** A format's speed-up is taken against the reference *on the
  same runtime*: HF formats against fp32 in the same transformers loop, GGUF rungs against
  GGUF F16 on the same llama-server build. Dividing llama-server's speed by transformers'
  would mix the runtime with the format.
- **Repeat, interleave, and measure the noise.** Every format of one runtime is held
  loaded (or served) at once and one request of each runs per block, in the shuffled order
  of `measure.noise.schedule`, the reference twice (an A/A arm). `decode_speedup` is the
  median paired ratio of decode tok/s; `decode_verdict` is `noise.compare`'s verdict
  against the A/A rerun ("within noise" unless the test says otherwise).

Memory: with several formats loaded in one process, the growth of its resident memory
depends on what was loaded before (freed pages, allocator caches). `rss_fresh` loads one
format in a new Python process and reports the growth over the load and one short
forward pass, with the libraries already imported.
"""
from __future__ import annotations

import itertools
import json
import math
import statistics
import subprocess
import sys
from typing import Callable, Mapping, Sequence

__all__ = ["AA", "request_trials", "static_batch_tput", "serve_gguf", "served_row", "rss_fresh", "rss_now"]

AA = " (A/A)"   # suffix of the reference's rerun arm


def _requests(prompts, max_tokens):
    from infercourse.core.types import Request
    return [Request(messages=[{"role": "user", "content": p}], max_tokens=max_tokens, ignore_eos=True,
                    cache_prompt=False) for p in prompts]


def request_trials(engines: Mapping[str, Callable[[], object]], ref: str, prompts: Sequence[str],
                   max_tokens: int, repeats: int = 4, writer=None) -> dict[str, dict]:
    """Speed columns for each arm, from `repeats` interleaved blocks of one request each.

    Returns {arm: row}: `ttft_s`, `decode_tok_per_s` (medians over the blocks),
    `tput_1_tok_per_s` (tokens / busy seconds, one at a time), and against `ref`:
    `decode_speedup` (median paired ratio), `decode_speedup_lo`/`_hi` (its interval),
    `decode_verdict`, `decode_floor` (the A/A floor), `speedup_vs`, `repeats`.

    Args:
        engines: arm -> a function returning the engine to send the next request to (for
            in-process models it swaps the arm's model in); must include `ref`.
        ref: the reference arm, also run a second time as `ref + AA`.
        prompts: block k sends prompt k mod len(prompts) to every arm, so pairs match.
        max_tokens: forced output length.
        repeats: blocks.
        writer: optional `results.RunWriter` for every timed trace.
    """
    from infercourse.core import metrics
    from infercourse.core.trace import record
    from infercourse.measure import noise
    reqs, ids = _requests(prompts, max_tokens), itertools.count()
    traces: dict[str, list] = {}
    arms = {**engines, ref + AA: engines[ref]}

    def arm(label, get):
        calls = itertools.count()

        def one() -> float:   # warm-up is call 0 for every arm, so block k is call k + 1 for all
            t = record(get(), reqs[next(calls) % len(reqs)], request_id=next(ids), raise_errors=True, format=label)
            traces.setdefault(label, []).append(t)
            return metrics.decode_tok_per_s(t)
        return one

    vals = noise.run_interleaved({a: arm(a, g) for a, g in arms.items()}, repeats, warmup=1)
    floor = noise.noise_floor(vals[ref], vals[ref + AA])
    rows = {}
    for label in engines:
        timed = traces[label][1:]
        for t in timed if writer is not None else ():
            writer.write(t)
        row = {"ttft_s": statistics.median(metrics.ttft_s(t) for t in timed),
               "decode_tok_per_s": statistics.median(vals[label]),
               "tput_1_tok_per_s": sum(metrics.output_tokens(t) for t in timed) / sum(metrics.e2e_s(t) for t in timed),
               "speedup_vs": ref, "repeats": len(vals[label]), "decode_floor": floor.floor}
        if label == ref:
            row.update(decode_speedup=1.0, decode_speedup_lo=math.nan, decode_speedup_hi=math.nan,
                       decode_verdict="reference")
        else:
            c = noise.compare(vals[ref], vals[label], floor, higher_is_better=True, labels=(ref, label))
            row.update(decode_speedup=c.interval.median, decode_speedup_lo=c.interval.lo,
                       decode_speedup_hi=c.interval.hi, decode_verdict=c.verdict)
        rows[label] = row
    return rows


def static_batch_tput(model, tok, prompts: Sequence[str], max_tokens: int, concurrency: int) -> float:
    """Output tok/s of one static batch of `concurrency` requests (left-padded, forced to
    `max_tokens`) in transformers' generate: one measurement, no repeats."""
    import time

    import torch
    chats = [tok.apply_chat_template([{"role": "user", "content": prompts[i % len(prompts)]}],
                                     add_generation_prompt=True, tokenize=False) for i in range(concurrency)]
    tok.padding_side = "left"
    batch = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=pad)
        wall = time.perf_counter() - t0
    return (out.shape[1] - batch.input_ids.shape[1]) * concurrency / wall


def served_row(srv, prompts, max_tokens: int, concurrency: int) -> dict:
    """Output tok/s of `concurrency` requests in flight on a running server (one run), and
    the server's whole resident memory."""
    import psutil

    from infercourse.core.summary import throughput
    from infercourse.measure import bench
    reqs = _requests([prompts[i % len(prompts)] for i in range(concurrency)], max_tokens)
    res = bench.run(srv.engine(), reqs, pattern="concurrency", concurrency=concurrency, warmup=0,
                    progress=False, sample_s=None, label="quant_methods")
    return {f"tput_{concurrency}_tok_per_s": throughput(res.df)["output_tok_per_s"],
            "rss_bytes": psutil.Process(srv.pid).memory_info().rss if srv.pid else math.nan}


def serve_gguf(paths: Mapping[str, object], ref: str, prompts: Sequence[str], max_tokens: int, *,
               n_threads: int = 1, concurrency: int = 4, repeats: int = 4, writer=None) -> dict[str, dict]:
    """Every GGUF on its own llama-server (same build, `concurrency` slots), all up at once:
    `request_trials` against `ref` (e.g. "gguf F16"), then each server's `served_row`."""
    from contextlib import ExitStack

    from infercourse.servers import LlamaServer
    with ExitStack() as stack:
        srvs = {k: stack.enter_context(LlamaServer(p, n_parallel=concurrency, ctx_size=concurrency * 512,
                                                   threads=n_threads)) for k, p in paths.items()}
        engines = {k: s.engine() for k, s in srvs.items()}
        rows = request_trials({k: (lambda e=e: e) for k, e in engines.items()}, ref, prompts, max_tokens,
                              repeats, writer)
        for k, s in srvs.items():
            rows[k].update(served_row(s, prompts, max_tokens, concurrency),
                           batching=f"continuous, {concurrency} slots (llama-server)")
    return rows


def rss_now() -> int:
    """This process's resident bytes, after freed heap is handed back to the OS."""
    import ctypes
    import ctypes.util
    import gc

    import psutil
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc and hasattr(ctypes.CDLL(libc), "malloc_trim"):   # glibc: hand freed heap back to the OS,
        ctypes.CDLL(libc).malloc_trim(0)                     # or a freed model still counts as resident
    return psutil.Process().memory_info().rss


_CHILD = """
import importlib, json, sys
from infercourse.models import quant_formats as qf
from infercourse.measure.quant_speed import rss_now
args = json.loads(sys.stdin.read())
torch, _ = qf._libs()
for lib in ("torchao.quantization", "torchao.prototype.quantization.int4", "bitsandbytes"):
    try:   # imported before the first reading: the libraries are not the format
        importlib.import_module(lib)
    except ImportError:
        pass
before = rss_now()
model, tok = qf.load_method(args["method"], calibration=args["calibration"], n_threads=args["n_threads"])
with torch.no_grad():
    model(torch.tensor([tok("One short forward pass.", add_special_tokens=False).input_ids]))
print(json.dumps({"rss_bytes": rss_now() - before}))
"""


def rss_fresh(method: str, calibration: str | None = None, n_threads: int = 1, timeout_s: float = 900) -> int:
    """Resident-memory growth of loading `method` (derived already, or derived there) and
    running one short forward pass, in a new Python process: no earlier load in the way."""
    from infercourse.core.errors import ModelLayerError
    p = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=timeout_s,
                       input=json.dumps({"method": method, "calibration": calibration, "n_threads": n_threads}))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise ModelLayerError(f"loading {method} in a fresh process failed (exit {p.returncode}): "
                              f"{p.stderr.strip()[-400:]}")
    return int(json.loads(lines[-1])["rss_bytes"])

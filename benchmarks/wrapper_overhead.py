"""Benchmark: decode tok/s through infercourse's llama.cpp engine vs a bare llama-cpp-python loop.

Target (issue 3): engine >= 0.97 x bare, same model, prompt and threads, measured in one
run. Both share ONE `Llama` instance and alternate trial by trial (ABAB...), so drift in a
shared machine's load hits both sides alike; we report the median of per-pair ratios.

    .venv/bin/python benchmarks/wrapper_overhead.py [--trials 7] [--tokens 128] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

from infercourse import Request
from infercourse.engines.llamacpp import LlamaCppEngine


def engine_decode_tok_per_s(engine: LlamaCppEngine, req: Request) -> float:
    stamps = [e.t for e in engine.stream(req) if not e.done]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    engine = LlamaCppEngine(n_threads=a.threads, n_ctx=1024)
    req = Request(messages=[{"role": "user", "content": "Write a long story about a lighthouse."}],
                  max_tokens=a.tokens, ignore_eos=True, cache_prompt=False)
    tokens = engine.prompt_tokens(req)
    # the bare loop must not stop at EOS either: same forced length, same logits processor
    import llama_cpp
    import numpy as np
    eog = np.array(engine._eog_tokens())

    def no_eog(_ids, logits):
        logits[eog] = -np.inf
        return logits

    def bare():  # the plainest llama-cpp-python loop, timed first token -> n-th
        engine.llm.reset()
        stamps = []
        for i, _ in enumerate(engine.llm.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                                  repeat_penalty=1.0, reset=True,
                                                  logits_processor=llama_cpp.LogitsProcessorList([no_eog]))):
            stamps.append(time.perf_counter())
            if i + 1 >= a.tokens:
                break
        return (a.tokens - 1) / (stamps[-1] - stamps[0])

    bare(); engine_decode_tok_per_s(engine, req)  # warm-up both paths
    pairs = []
    for _ in range(a.trials):
        b, e = bare(), engine_decode_tok_per_s(engine, req)
        pairs.append((b, e))
        print(f"bare {b:7.1f} tok/s   engine {e:7.1f} tok/s   ratio {e / b:.3f}", flush=True)
    ratio = statistics.median(e / b for b, e in pairs)
    print(f"median ratio engine/bare = {ratio:.3f} over {a.trials} pairs "
          f"({a.tokens} tokens, {a.threads} thread(s)); target >= 0.97: {'PASS' if ratio >= 0.97 else 'FAIL'}")


if __name__ == "__main__":
    main()

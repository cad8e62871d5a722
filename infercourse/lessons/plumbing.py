"""The server and API layers by hand, and what they add to the time to the first token.

Before the library hides them: `raw_exchange` sends one streamed chat request as raw HTTP and
keeps every line of the server-sent events (SSE) that come back; `chat_template_view` shows
the API layer's first job, the chat template, and what an instruct model does without it.

`through_layers` then sends the same greedy request to llama.cpp in process (the runtime)
and to llama-server (HTTP + JSON + SSE + the server's scheduler around the same runtime),
both loaded at once. Each block runs the runtime twice and the server once, in a shuffled
order (`noise.run_arms`): the runtime's second run is an A/A rerun of the same
configuration, so whatever separates the two is noise by construction, and the server is
judged against both (`noise.compare_arms`), on TTFT and on decode speed. A difference
inside that noise is called that, never a cost or a speed-up.

`explain_layers` words the result, and sets the runtime's TTFT against the roofline's
compute floor (the prompt's matrix multiplies at a float32 matmul's speed): llama.cpp's
own prompt-eval timer (`prompt_ms`) splits the gap into its kernels' time and the rest
(template, tokenizing, sampling the first token, handing it over).
"""
from __future__ import annotations

import json
from typing import Any

import pandas as pd

from infercourse.core.metrics import per_request_frame
from infercourse.core.trace import record
from infercourse.core.types import Request, generate
from infercourse.measure.claims import verdict_sentence
from infercourse.measure.noise import compare_arms, run_arms

__all__ = ["ARMS", "raw_exchange", "chat_template_view", "through_layers", "layer_overheads", "explain_layers"]

# arm -> what the `layer` column (and the plot) calls it; the runtime's rerun is its A/A arm
ARMS = {"runtime": "runtime (llama.cpp in process)", "runtime A/A": "runtime again (A/A rerun)",
        "server": "server + API (llama-server over HTTP)"}


def raw_exchange(url: str, prompt: str, *, max_tokens: int = 8, model: str = "any") -> dict[str, Any]:
    """One streamed chat request sent by hand: the literal HTTP request and every line
    of the server-sent events (SSE) stream that comes back, before any library parses them
    (`events`: each `data:` JSON; `texts`: the text each one carried).

    Args:
        url: the server's root, e.g. `LlamaServer(...).url` (loopback).
        prompt: the user message.
        max_tokens: tokens to stream (each arrives as one `data: {...}` event).
        model: the `model` field (llama-server serves one model and accepts any name).
    """
    import httpx
    from infercourse.core.errors import APILayerError
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    payload = json.dumps(body)
    host = url.split("://", 1)[-1].rstrip("/")
    request = (f"POST /v1/chat/completions HTTP/1.1\nHost: {host}\nContent-Type: application/json\n"
               f"Content-Length: {len(payload)}\n\n{payload}")
    try:
        with httpx.stream("POST", url.rstrip("/") + "/v1/chat/completions", content=payload,
                          headers={"Content-Type": "application/json"}, timeout=60) as r:
            lines = list(r.iter_lines())
    except httpx.HTTPError as e:
        raise APILayerError(f"raw request to {url} failed: {e}") from e
    events = [json.loads(line[5:]) for line in lines
              if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    texts = [((e.get("choices") or [{}])[0].get("delta") or {}).get("content") or "" for e in events]
    return {"request": request, "status": r.status_code, "content_type": r.headers.get("content-type", ""),
            "lines": lines, "events": events, "texts": texts}


def chat_template_view(engine, prompt: str, *, max_tokens: int = 24) -> dict[str, Any]:
    """What the API layer adds before the runtime sees anything: the chat template.

    Returns the templated text, token counts with and without it, and the greedy answers
    to the raw prompt and to the templated one (an instruct model fed raw text often
    stops at once or rambles: the template is part of the model's contract).
    """
    chat = Request(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                   cache_prompt=False)
    raw = Request(prompt=prompt, max_tokens=max_tokens, cache_prompt=False)
    raw_c, chat_c = generate(engine, raw), generate(engine, chat)
    return {"templated_text": engine.format_prompt(chat),
            "raw_tokens": raw_c.usage.prompt_tokens, "chat_tokens": chat_c.usage.prompt_tokens,
            "raw_answer": raw_c.text, "raw_finish": raw_c.finish_reason,
            "raw_completion_tokens": raw_c.usage.completion_tokens,
            "chat_answer": chat_c.text, "chat_completion_tokens": chat_c.usage.completion_tokens}


def _trial(engine, request: Request) -> dict[str, Any]:
    """One request's row: bench's per-request metrics plus the engine's own prompt-eval time."""
    tr = record(engine, request, raise_errors=True)
    row = per_request_frame([tr]).iloc[0][["prompt_tokens", "ttft_s", "decode_tok_per_s", "e2e_s"]].to_dict()
    return {**row, "prompt_ms": float(tr.engine_timings.get("prompt_ms", float("nan")))}


def through_layers(prompt: str, *, max_tokens: int = 32, repeats: int = 3, n_threads: int = 1,
                   model=None, seed: int = 0) -> pd.DataFrame:
    """The same greedy request through llama.cpp in process and through llama-server on the
    same model, threads and flags, both loaded at once (two copies of the weights): after a
    warm-up of each, `repeats` blocks of runtime, runtime again (A/A) and server, shuffled
    within each block. Prefix caching is off so every request pays the full prompt; the
    answer is forced to `max_tokens`. One row per request: `arm`, `rep`, `slot`, `layer`,
    TTFT, decode speed, E2E, prompt tokens and the engine's own `prompt_ms`.

    Args:
        prompt: the user message (chat template applied by each engine).
        max_tokens: tokens per answer (forced).
        repeats: blocks (3 at least for the A/A test ever to call a difference).
        n_threads: CPU threads of the runtime and of the server.
        model: None for the embedded GGUF, or a .gguf path.
        seed: the shuffle's seed (`noise.schedule`).
    """
    from infercourse.engines.llamacpp import LlamaCppEngine
    from infercourse.servers import LlamaServer
    req = Request(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                  cache_prompt=False, ignore_eos=True)
    runtime = LlamaCppEngine(model, n_threads=n_threads, n_ctx=2048)
    with LlamaServer(model, n_parallel=1, ctx_size=2048, threads=n_threads) as server:
        http = server.engine()
        for engine in (runtime, http):
            _trial(engine, req)   # warm-up: the first call pays page-in of the weights
        engines = {"runtime": runtime, "runtime A/A": runtime, "server": http}
        df, _ = run_arms(engines, repeats, lambda engine, _label: (_trial(engine, req), None), seed=seed)
    df["layer"] = df["arm"].map(ARMS)
    return df


def layer_overheads(df: pd.DataFrame) -> pd.DataFrame:
    """Median TTFT / decode speed / E2E per layer (runtime first, its A/A rerun, then the
    server), and what each adds to the runtime's median TTFT."""
    order = [name for name in ARMS.values() if name in set(df["layer"])]
    order += [name for name in dict.fromkeys(df["layer"]) if name not in order]
    med = df.groupby("layer")[["ttft_s", "decode_tok_per_s", "e2e_s"]].median().reindex(order)
    med["ttft_added_ms"] = 1000 * (med["ttft_s"] - med["ttft_s"].iloc[0])
    return med


def _floor_sentence(df: pd.DataFrame, runtime_ms: float, floor_ms: float) -> str:
    """The runtime's TTFT against the compute floor, split by llama.cpp's prompt-eval timer."""
    ratio = runtime_ms / floor_ms
    out = f" The runtime's median TTFT is **{ratio:.1f}×** the compute floor ({floor_ms:.1f} ms)"
    if ratio < 1:
        return out + ": below it, so the engine's kernels beat the plain float32 matmul the floor was measured with."
    rt = df[df["arm"] == "runtime"] if "arm" in df else df.iloc[0:0]
    prompt_ms = float(rt["prompt_ms"].median()) if "prompt_ms" in rt and rt["prompt_ms"].notna().any() else None
    if prompt_ms is None:
        return out + ": this engine reports no prompt-eval time, so this run cannot say which part holds the gap."
    rest = runtime_ms - prompt_ms
    where = ("the prompt evaluation itself: its kernels (quantized blocks, attention, small operations) ran at "
             f"1/{prompt_ms / floor_ms:.1f} of the float32 matmul speed the floor assumes" if prompt_ms >= rest else
             "outside the prompt evaluation: template, tokenizing, sampling the first token and handing it over")
    return (out + f". llama.cpp's own timer puts **{prompt_ms:.1f} ms** of it in prompt evaluation "
            f"({prompt_ms / floor_ms:.1f}× the floor) and {rest:.1f} ms outside it: most of the gap is {where}.")


def explain_layers(df: pd.DataFrame, floor_ms: float | None = None) -> str:
    """The Explain sentences for `through_layers`, computed: the server against the runtime
    on TTFT and decode speed, each judged against the runtime's A/A rerun
    (`noise.compare_arms`, worded by `claims.verdict_sentence`); whether the plumbing or the
    runtime's own time was the larger part of TTFT; and (with `floor_ms`, the roofline's
    compute floor) where the runtime's TTFT sits against the floor and what its own timer
    says fills the gap.

    Args:
        df: `through_layers` output (columns arm, rep, layer, ttft_s, decode_tok_per_s, prompt_ms).
        floor_ms: the prompt's compute floor in ms (None: no floor sentence).
    """
    med = layer_overheads(df)
    runtime_ms = 1000 * float(med["ttft_s"].iloc[0])
    added_ms = float(med["ttft_added_ms"].iloc[-1])
    ttft, _ = compare_arms(df, "ttft_s", "runtime", "runtime A/A", higher_is_better=False)
    speed, _ = compare_arms(df, "decode_tok_per_s", "runtime", "runtime A/A", higher_is_better=True)
    if "server" in ttft:
        out = (f"- Going through the server and API moved the median time to first token by {added_ms:+.1f} ms "
               f"(runtime alone: {runtime_ms:.0f} ms). {verdict_sentence(ttft['server'], 'TTFT')}\n"
               f"- Decode: {med['decode_tok_per_s'].iloc[0]:.1f} tok/s in process vs "
               f"{med['decode_tok_per_s'].iloc[-1]:.1f} through the server. "
               f"{verdict_sentence(speed['server'], 'decode tok/s')}")
    else:
        out = (f"- Going through the server and API moved the median time to first token by {added_ms:+.1f} ms "
               f"(runtime alone: {runtime_ms:.0f} ms), from fewer than two blocks with an A/A rerun: "
               "no test was run, so this run cannot say whether that is a cost or noise.")
    if added_ms < runtime_ms:
        out += (f"\n\n- Here the runtime's own work ({runtime_ms:.0f} ms) was the larger part of TTFT, "
                f"the plumbing the smaller: a slow served model on loopback points below the server first.")
    else:
        out += (f"\n\n- Here the plumbing ({added_ms:.0f} ms) was not smaller than the runtime's own work "
                f"({runtime_ms:.0f} ms): on this machine the server layer is worth a look before the engine.")
    if floor_ms is not None and floor_ms > 0:
        out += _floor_sentence(df, runtime_ms, floor_ms)
    return out

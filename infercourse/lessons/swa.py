"""Sliding-window attention and the prefix cache: when a prompt that changes in the middle is
prefilled again from the start (the section on a second model family; notebook 05).

A prefix cache reuses the keys and values of a prompt's leading tokens up to the first token
that differs. With full attention (SmolLM2, a Llama) every layer keeps every position, so a
prompt that diverges at token d re-evaluates only from d. A model with **sliding-window
attention** (Gemma 3: five local layers that see only the last 512 tokens, then one global
layer) keeps, in its local layers, only the last window of positions: the cache is smaller,
and it cannot be rewound. If the new prompt diverges *more than a window before the end* of
the cached one, the local layers' state at the divergence point is gone, and llama-server
prefills from the start, unless it saved a **context checkpoint** before that point:

- it makes checkpoints of the local layers' state near the end of a prompt (4 + `-ub` and
  4 tokens before it) and at the start of user messages at least `--checkpoint-min-step`
  (default 8,192) tokens apart, up to `--ctx-checkpoints` (32) per slot;
- so it rescues a divergence just after the end of the last prompt (the client dropped or
  rewrote the answer the model just generated: reasoning removed from history, a tool call
  re-serialised) and nothing earlier than its checkpoints (compaction rewriting the first
  messages, a tool result edited or truncated in the middle of the history);
- `--swa-full` keeps every position in the local layers too: the rewind works like full
  attention, and the local layers' cache grows from a window to the whole context.

`prefix_runs` sends one long prompt, then the same prompt cut at several depths with a new
ending, each followed by the whole prompt again, and records for each request how far before
the end of the cached prompt it diverged and how many tokens the server evaluated
(`timings.prompt_n`); `chat_runs` does the agent's version with chat messages and a long
generated answer; `kv_memory` reads both caches' sizes from the server's log.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import httpx
import pandas as pd

from infercourse.core.trace import record
from infercourse.core.types import Request
from infercourse.measure.results import RunWriter
from infercourse.measure.workloads import common_prefix_len
from infercourse.models.embedded import embedded_gguf
from infercourse.models.gemma3 import available as gemma3_available, gemma3_gguf
from infercourse.models.gguf_header import read_header
from infercourse.servers.llama import LlamaServer
from infercourse.servers.llama_log import VERBOSE_ARGS, kv_caches

__all__ = ["FAMILIES", "families", "sliding_window", "prefix_runs", "chat_runs", "kv_memory", "NEW_ENDING", "CHAT_CASES",
           "divergence_sentence", "chat_sentence", "memory_sentence"]

FAMILIES: dict[str, Callable[[], Path]] = {"SmolLM2-135M (full attention)": embedded_gguf,
                                           "Gemma 3 270M (sliding window)": gemma3_gguf}
NEW_ENDING = " Then the report changed its mind, and said something else entirely."


def families() -> tuple[dict[str, Path], dict[str, str]]:
    """({name: GGUF path} of the families present, {name: why absent})."""
    ok, why = gemma3_available()
    present = {n: f() for n, f in FAMILIES.items() if "Gemma" not in n or ok}
    return present, ({} if ok else {n: why for n in FAMILIES if "Gemma" in n})


def sliding_window(model: str | Path) -> int | None:
    """The model's attention window from its GGUF header (None: full attention)."""
    meta, _ = read_header(model)
    w = meta.get(f"{meta['general.architecture']}.attention.sliding_window")
    return int(w) if w is not None else None


def _server(model, *, swa_full: bool, threads: int | None, ctx_size: int, extra: Sequence[str] = (),
            n_parallel: int = 1) -> LlamaServer:
    # no host prompt cache: what the slot itself keeps is all that can be reused
    return LlamaServer(model, n_parallel=n_parallel, ctx_size=ctx_size, threads=threads, cache_ram_mib=0,
                       extra_args=[*VERBOSE_ARGS, *(["--swa-full"] if swa_full else []), *extra])


def _tokens(url: str, text: str) -> list[int]:
    r = httpx.post(url + "/tokenize", json={"content": text, "add_special": True}, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def _row(trace, *, prev: list[int], now: list[int], window: int | None, **tags: Any) -> dict[str, Any]:
    t = trace.engine_timings or {}
    shared = common_prefix_len(prev, now)
    evaluated = t.get("prompt_n")
    n = (t.get("prompt_n") or 0) + (t.get("cache_n") or 0) or len(now)
    # what a full-attention cache must evaluate: everything after the shared prefix (at least one token)
    must = max(1, n - shared) if prev else n
    return {**tags, "prompt_tokens": n, "prev_tokens": len(prev), "shared_tokens": shared,
            "diverged_before_end": len(prev) - shared if prev else None,
            "beyond_window": (len(prev) - shared > window) if prev and window else False,
            "evaluated": evaluated, "full_attention_needs": must,
            "extra_evaluated": (evaluated - must) if evaluated is not None else None,
            "prompt_ms": t.get("prompt_ms"), "ttft_s": trace.chunk_t[0] - trace.sent_t if trace.chunk_t else None,
            "status": trace.status, "error": trace.error}


def prefix_runs(model: str | Path, *, family: str, swa_full: bool = False, prompt_tokens: int = 1500,
                cuts: Sequence[float] = (0.25, 0.5, 0.75, 0.95), text: str | None = None,
                threads: int | None = None, ctx_size: int = 4096, writer: RunWriter | None = None) -> pd.DataFrame:
    """One long prompt, then for each cut c its first c·`prompt_tokens` tokens with a new
    ending, then the whole prompt again; one row per request (module docstring).

    Args:
        model: a GGUF; family: its label in the rows.
        swa_full: start llama-server with `--swa-full`.
        prompt_tokens: length of the long prompt (tokens).
        cuts: where the cut prompts diverge, as fractions of it.
        text: the prose to cut it from (None: the course's evaluation text, repeated).
        threads, ctx_size: server settings (one slot, `--cache-ram 0`).
        writer: a `RunWriter` for the traces (optional).
    """
    text = text or (Path(__file__).parents[2] / "data" / "eval_prose.txt").read_text() * 4
    window, rows = sliding_window(model), []
    with _server(model, swa_full=swa_full, threads=threads, ctx_size=ctx_size) as srv:
        engine, url = srv.engine(api="completions"), srv.url
        ids = _tokens(url, text)[1:prompt_tokens + 1]          # without BOS: the server adds it
        full = httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=60).json()["content"]
        plan = [("the whole prompt (cold)", full)]
        for c in cuts:
            cut = httpx.post(url + "/detokenize", json={"tokens": ids[:int(c * len(ids))]}, timeout=60).json()["content"]
            plan += [(f"cut at {c:.0%}, new ending", cut + NEW_ENDING), ("the whole prompt again", full)]
        prev: list[int] = []
        for i, (case, prompt) in enumerate(plan):
            now = _tokens(url, prompt)
            tr = record(engine, Request(prompt=prompt, max_tokens=1, cache_prompt=True), request_id=i)
            if writer is not None:
                writer.write(tr)
            rows.append(_row(tr, prev=prev, now=now, window=window, family=family, swa_full=swa_full, step=i,
                             case=case))
            prev = now
        kv = kv_caches(srv.log_path.read_text(errors="replace"))
    out = pd.DataFrame(rows)
    out.attrs.update(window=window, kv=kv)
    return out


def _history(n_turns: int, words_per_turn: int, text: str) -> list[dict[str, str]]:
    """A chat of user/assistant turns cut from prose: a stand-in agent history."""
    words = text.split()
    msgs = [{"role": "system", "content": "You are a careful assistant. " + " ".join(words[:words_per_turn])}]
    for k in range(n_turns):
        chunk = " ".join(words[(k + 1) * words_per_turn:(k + 2) * words_per_turn])
        msgs += [{"role": "user", "content": f"Tool result {k}: {chunk}"}, {"role": "assistant", "content": f"Noted {k}."}]
    return msgs


CHAT_CASES = ("the answer appended verbatim", "the answer's reasoning dropped", "a tool result edited in the middle")


def chat_runs(model: str | Path, *, family: str, swa_full: bool = False, checkpoints: bool = True,
              answer_tokens: int = 700, n_turns: int = 6, words_per_turn: int = 120, text: str | None = None,
              threads: int | None = None, ctx_per_slot: int = 4096, writer: RunWriter | None = None) -> pd.DataFrame:
    """An agent's turn and three ways its next request can differ (module docstring): the
    model writes a long answer (`answer_tokens`, forced, greedy); then the next request (1)
    appends that answer verbatim and a new user message, (2) keeps only the answer's last 40
    words (reasoning dropped from history), (3) edits a tool result in the middle of the
    history. Each case has its own slot (`id_slot`), so the three turns decode together in
    one batch and each next request meets exactly the turn it follows.

    Args:
        model, family, swa_full: as `prefix_runs`.
        checkpoints: False starts the server with `--ctx-checkpoints 0`.
        answer_tokens: the forced length of the generated answer (longer than the window,
            so that the divergence point at its start lies beyond it).
        n_turns, words_per_turn, text: the size of the stand-in history.
        threads, writer: as `prefix_runs`; ctx_per_slot: KV cells per slot.
    """
    from concurrent.futures import ThreadPoolExecutor
    text = text or (Path(__file__).parents[2] / "data" / "eval_prose.txt").read_text() * 4
    window, rows = sliding_window(model), []
    base = _history(n_turns, words_per_turn, text) + [{"role": "user", "content": "Summarise everything above."}]
    middle = [dict(m) for m in base]
    middle[3] = {**middle[3], "content": middle[3]["content"].replace("Tool result 1:", "Tool result 1 (truncated):")}
    extra = [] if checkpoints else ["--ctx-checkpoints", "0"]
    with _server(model, swa_full=swa_full, threads=threads, ctx_size=ctx_per_slot * len(CHAT_CASES),
                 extra=extra, n_parallel=len(CHAT_CASES)) as srv:
        engines = [srv.engine(api="chat", extra_body={"id_slot": k}) for k in range(len(CHAT_CASES))]
        turn = Request(messages=base, max_tokens=answer_tokens, ignore_eos=True, cache_prompt=True)
        with ThreadPoolExecutor(len(engines)) as pool:       # the three turns, batched
            firsts = list(pool.map(lambda k: record(engines[k], turn, request_id=2 * k), range(len(engines))))
        prev_base = _chat_tokens(srv.url, base)
        for k, (case, first) in enumerate(zip(CHAT_CASES, firsts)):
            answer = first.text
            if case == CHAT_CASES[2]:
                nxt = middle + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}]
            else:
                kept = answer if case == CHAT_CASES[0] else " ".join(answer.split()[-40:])
                nxt = base + [{"role": "assistant", "content": kept}, {"role": "user", "content": "Go on."}]
            second = record(engines[k], Request(messages=nxt, max_tokens=1, cache_prompt=True), request_id=2 * k + 1)
            for tr in (first, second):
                if writer is not None:
                    writer.write(tr)
            prev = prev_base + _tokens(srv.url, answer)[1:]
            rows.append(_row(second, prev=prev, now=_chat_tokens(srv.url, nxt), window=window, family=family,
                             swa_full=swa_full, checkpoints=checkpoints, case=case,
                             answer_tokens=first.completion_tokens))
    return pd.DataFrame(rows).assign(window=window)


def _chat_tokens(url: str, messages: list[dict[str, str]]) -> list[int]:
    """The tokens the server's chat template makes of `messages` (with the generation prompt)."""
    r = httpx.post(url + "/apply-template", json={"messages": messages}, timeout=60)
    r.raise_for_status()
    return _tokens(url, r.json()["prompt"])


def kv_memory(model: str | Path, *, ctx_sizes: Sequence[int] = (8192, 32768), threads: int | None = None
              ) -> pd.DataFrame:
    """Each KV cache llama-server makes for `model` at each context size, with and without
    `--swa-full`, from its log (nothing is sent)."""
    rows = []
    for ctx in ctx_sizes:
        for full in (False, True):
            with _server(model, swa_full=full, threads=threads, ctx_size=ctx) as srv:
                caches = kv_caches(srv.log_path.read_text(errors="replace"))
            rows += [{"ctx_size": ctx, "swa_full": full, **c} for c in caches]
    return pd.DataFrame(rows)


# ---- what the run showed, in words -------------------------------------------------------------
def _cfg(fam: str, swa_full: bool, checkpoints: bool | None = None) -> str:
    return fam + (" with `--swa-full`" if swa_full else "") + (" and `--ctx-checkpoints 0`" if checkpoints is False else "")


def divergence_sentence(runs: pd.DataFrame) -> str:
    """Per family and setting, how many requests (after the cold one) the server evaluated
    more of than full attention needs, where they diverged against the window, and how much.

    Args:
        runs: `prefix_runs` frames concatenated (columns family, swa_full, ...).
    """
    lines = []
    for (fam, full), g in runs[runs["prev_tokens"] > 0].groupby(["family", "swa_full"], sort=False):
        extra = g[g["extra_evaluated"] > 0]
        if extra.empty:
            lines.append(f"- **{_cfg(fam, full)}**: every one of {len(g)} requests evaluated only what followed the "
                         "shared prefix, wherever it diverged.")
            continue
        beyond = extra[extra["beyond_window"]]
        inside = extra[~extra["beyond_window"]]
        whole = int((extra["evaluated"] >= extra["prompt_tokens"]).sum())
        parts = [f"{len(extra)} of {len(g)} requests evaluated more than full attention needs "
                 f"({', '.join(f'{int(e):,}' for e in extra['extra_evaluated'])} tokens more; {whole} of them the "
                 "whole prompt)"]
        if len(beyond):
            parts.append(f"{len(beyond)} of the {int(g['beyond_window'].sum())} that diverged more than the window "
                         f"before the end of the cached prompt ({', '.join(f'{int(d):,}' for d in beyond['diverged_before_end'])} "
                         "tokens before)")
        if len(inside):
            parts.append(f"and {len(inside)} within it, where the shared prefix ({', '.join(f'{int(s):,}' for s in inside['shared_tokens'])} "
                         "tokens) was shorter than the window itself: llama-server keeps a local layer's state only "
                         "where the oldest position it holds lies a window before the shared point")
        lines.append(f"- **{_cfg(fam, full)}**: " + "; ".join(parts) + ".")
    return "\n".join(lines)


def chat_sentence(chat: pd.DataFrame) -> str:
    """Per case of `chat_runs` and setting: tokens evaluated against what full attention needs."""
    lines = []
    for case, g in chat.groupby("case", sort=False):
        said = []
        for r in g.itertuples():
            cfg = _cfg(r.family, r.swa_full, r.checkpoints)
            more = (f"{int(r.extra_evaluated):,} more than full attention needs"
                    + (", the whole prompt" if r.evaluated >= r.prompt_tokens else "")) if r.extra_evaluated > 0 \
                else "no more than full attention needs"
            said.append(f"{cfg}: {int(r.evaluated):,} of {int(r.prompt_tokens):,} ({more})")
        d = g["diverged_before_end"].iloc[0]
        lines.append(f"- **{case}** (diverged {int(d):,} tokens before the end of the cached turn): " + "; ".join(said) + ".")
    return "\n".join(lines)


def memory_sentence(kv: pd.DataFrame) -> str:
    """The KV cache with and without `--swa-full` at each context size, from `kv_memory`."""
    out = []
    for ctx, g in kv.groupby("ctx_size"):
        tot = g.groupby("swa_full")["mib"].sum()
        local = g[g["kind"] == "local (SWA)"].set_index("swa_full")["cells"]
        if len(tot) < 2 or local.empty:
            continue
        out.append(f"at a {int(ctx):,}-token context the KV cache is {tot[False]:.0f} MiB as is (local layers keep "
                   f"{int(local[False]):,} cells) and {tot[True]:.0f} MiB with `--swa-full` ({tot[True] / tot[False]:.1f}×, "
                   f"local layers keep all {int(local[True]):,})")
    return ("`--swa-full` costs memory: " + "; ".join(out) + ".") if out else "No sliding-window cache was measured."

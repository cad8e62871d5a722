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
generated answer; `kv_table` reads both caches' sizes from the servers' logs.
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

__all__ = ["FAMILIES", "families", "sliding_window", "prefix_runs", "chat_runs", "kv_table", "NEW_ENDING", "CHAT_CASES",
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


def _row(timings: dict[str, Any], *, prev: list[int], now: list[int], window: int | None,
         ttft_s: float | None = None, **tags: Any) -> dict[str, Any]:
    """One request: what it shared with the slot's cached tokens (`prev`), where it diverged
    against the window, and what the server evaluated (its own `timings`)."""
    shared = common_prefix_len(prev, now)
    evaluated = timings.get("prompt_n")
    n = (timings.get("prompt_n") or 0) + (timings.get("cache_n") or 0) or len(now)
    # what a full-attention cache must evaluate: everything after the shared prefix (at least one token)
    must = max(1, n - shared) if prev else n
    return {**tags, "prompt_tokens": n, "prev_tokens": len(prev), "shared_tokens": shared,
            "diverged_before_end": len(prev) - shared if prev else None,
            "beyond_window": (len(prev) - shared > window) if prev and window else False,
            "evaluated": evaluated, "full_attention_needs": must,
            "extra_evaluated": (evaluated - must) if evaluated is not None else None,
            "prompt_ms": timings.get("prompt_ms"), "ttft_s": ttft_s, "window": window}


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
            ttft = tr.chunk_t[0] - tr.sent_t if tr.chunk_t else None
            rows.append(_row(tr.engine_timings or {}, prev=prev, now=now, window=window, ttft_s=ttft, family=family,
                             swa_full=swa_full, step=i, case=case, status=tr.status))
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


def _apply(url: str, messages: list[dict[str, str]]) -> str:
    """The prompt text the server's chat template makes of `messages` (generation prompt on)."""
    r = httpx.post(url + "/apply-template", json={"messages": messages}, timeout=60)
    r.raise_for_status()
    return r.json()["prompt"]


def _complete(url: str, ids: list[int], n: int) -> dict[str, Any]:
    body = {"prompt": ids, "n_predict": n, "ignore_eos": n > 1, "return_tokens": True,
            "cache_prompt": True, "temperature": 0}
    r = httpx.post(url + "/completion", json=body, timeout=1800)
    r.raise_for_status()
    return r.json()


def chat_runs(model: str | Path, *, family: str, swa_full: bool = False, checkpoints: bool = True,
              answer_tokens: int = 640, n_turns: int = 4, words_per_turn: int = 100, text: str | None = None,
              threads: int | None = None, ctx_size: int = 4096) -> pd.DataFrame:
    """An agent's turn and three ways its next request can differ (module docstring). For each
    case, on one slot: the turn's prompt (its last checkpoints are made near its end), then the
    turn's answer (`answer_tokens` of prose, longer than the window) after it, as a generated
    answer sits in the slot, then the next request: (1) the answer's tokens appended verbatim
    and a new user message, (2) only the answer's last 40 words kept (reasoning dropped from
    history), (3) a tool result edited in the middle of the history. The answer is prefilled,
    not generated: the slot then holds the same tokens a generation leaves, at a fraction of
    the time (decoding 600 tokens costs minutes on 2 cores). Requests go to `/completion` as
    token ids, so what the slot holds and what the next request shares with it are counted
    exactly; the numbers are the server's own (`timings`).

    Args:
        model, family, swa_full: as `prefix_runs`.
        checkpoints: False starts the server with `--ctx-checkpoints 0`.
        answer_tokens: the answer's length (longer than the window, so that the divergence
            point at its start lies beyond it).
        n_turns, words_per_turn, text: the size of the stand-in history.
        threads, ctx_size: as `prefix_runs`.
    """
    text = text or (Path(__file__).parents[2] / "data" / "eval_prose.txt").read_text() * 4
    window, rows = sliding_window(model), []
    base = _history(n_turns, words_per_turn, text) + [{"role": "user", "content": "Summarise everything above."}]
    middle = [dict(m) for m in base]
    middle[3] = {**middle[3], "content": middle[3]["content"].replace("Tool result 1:", "Tool result 1 (truncated):")}
    go_on = [{"role": "user", "content": "Go on."}]
    extra = [] if checkpoints else ["--ctx-checkpoints", "0"]
    with _server(model, swa_full=swa_full, threads=threads, ctx_size=ctx_size, extra=extra) as srv:
        url = srv.url
        strip = lambda ids, ref: ids[1:] if ids[:1] == ref[:1] else ids      # noqa: E731 - the BOS /tokenize adds
        base_ids = _tokens(url, _apply(url, base))
        answer = strip(_tokens(url, text[-6 * answer_tokens:]), base_ids)[-answer_tokens:]
        answer_text = httpx.post(url + "/detokenize", json={"tokens": answer}, timeout=60).json()["content"]
        # the template's text between an assistant message's content and the next prompt's end
        marked = _apply(url, base + [{"role": "assistant", "content": "\x00"}] + go_on)
        tail = strip(_tokens(url, marked.split("\x00", 1)[1]), base_ids)
        for case in CHAT_CASES:
            _complete(url, base_ids, 1)                      # the turn's prompt: checkpoints near its end
            _complete(url, base_ids + answer, 1)             # its answer, as the slot holds it after generating
            if case == CHAT_CASES[0]:
                nxt = base_ids + answer + tail
            elif case == CHAT_CASES[1]:
                nxt = base_ids + strip(_tokens(url, " ".join(answer_text.split()[-40:])), base_ids) + tail
            else:
                nxt = _tokens(url, _apply(url, middle + [{"role": "assistant", "content": answer_text}] + go_on))
            rows.append(_row(_complete(url, nxt, 1)["timings"], prev=base_ids + answer, now=nxt, window=window,
                             family=family, swa_full=swa_full, checkpoints=checkpoints, case=case,
                             answer_tokens=len(answer)))
    return pd.DataFrame(rows)


def kv_table(runs: Sequence[pd.DataFrame], project_to: int = 32768) -> pd.DataFrame:
    """Each KV cache the `prefix_runs` servers made (from their logs), and the same caches
    projected to a `project_to`-token context: arithmetic from the measured MiB per cell, a
    global (or full-attention) cache growing with the context, a local one staying at its
    window unless `--swa-full` made it context-sized too.

    Args:
        runs: `prefix_runs` frames (their `attrs["kv"]`).
        project_to: the context to project to (the reader's: 32k for an agent).
    """
    rows = []
    for r in runs:
        fam, full = r["family"].iloc[0], bool(r["swa_full"].iloc[0])
        ctx = max(c["cells"] for c in r.attrs["kv"])           # the global (or only) cache holds the context
        for c in r.attrs["kv"]:
            grows = c["kind"] != "local (SWA)" or full
            rows.append({"family": fam, "swa_full": full, "kind": c["kind"], "layers": c["layers"],
                         "cells": c["cells"], "mib": c["mib"], "ctx_size": ctx,
                         f"mib_at_{project_to}": c["mib"] * (project_to / ctx if grows else 1.0)})
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
            parts.append(f"and {len(inside)} within it, where the shared prefix "
                         f"({', '.join(f'{int(s):,}' for s in inside['shared_tokens'])} tokens) was "
                         + ("shorter than the window itself: this build then resumes the local layers only from a "
                            "checkpoint that ends before the shared point, and none did"
                            if (inside["shared_tokens"] < inside["window"]).all() else
                            "longer than the window: read the server's log for why it did not resume"))
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


def memory_sentence(kv: pd.DataFrame, project_to: int = 32768) -> str:
    """The sliding-window family's KV cache as measured with and without `--swa-full`, and the
    same at `project_to` tokens (arithmetic from `kv_table`)."""
    g = kv[kv["kind"] != "full"]
    if g.empty or g["swa_full"].nunique() < 2:
        return "No sliding-window cache was measured both ways, so `--swa-full`'s memory cost is not shown here."
    tot = g.groupby("swa_full")[["mib", f"mib_at_{project_to}"]].sum()
    local = g[g["kind"] == "local (SWA)"].set_index("swa_full")["cells"]
    ctx = int(g["ctx_size"].iloc[0])
    return (f"`--swa-full` costs memory: at this run's {ctx:,}-token context the KV cache was {tot.loc[False, 'mib']:.0f} "
            f"MiB as is (the local layers kept {int(local[False]):,} cells) and {tot.loc[True, 'mib']:.0f} MiB with "
            f"`--swa-full` ({tot.loc[True, 'mib'] / tot.loc[False, 'mib']:.1f}×, the local layers kept all "
            f"{int(local[True]):,}); at {project_to:,} tokens the same arithmetic gives "
            f"{tot.loc[False, f'mib_at_{project_to}']:.0f} against {tot.loc[True, f'mib_at_{project_to}']:.0f} MiB "
            f"({tot.loc[True, f'mib_at_{project_to}'] / tot.loc[False, f'mib_at_{project_to}']:.1f}×).")

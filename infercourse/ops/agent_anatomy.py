"""The anatomy of an agent's request: its parts, their tokens, and where a call stops
matching the one before it (the cache-breaker finder).

A server's prefix cache reuses the longest *token prefix* a new prompt shares with the one it
has cached. A chat template renders a request's parts in a fixed order: the system text,
then the tool schemas (in our tools template and in most others), then the messages. So the
first part that differs from the previous call, and how far into it, says how much of the
prompt a server can reuse, and which part broke it: "system block 0" is a header that
changes per request or per task; "tool 3" a schema that moved; "message 5" a rewritten
history (compaction, or a client that edits old turns).

`parts(body, api)` lists a request's parts in that order, for the three APIs agents speak:

| API | system | tools | messages |
|---|---|---|---|
| Anthropic `/v1/messages` | `system` (a string, or each block) | `tools` | `messages` (a `role: "system"` one too) |
| OpenAI `/v1/responses` | `instructions`, `developer`/`system` input items | `tools` | the other `input` items |
| OpenAI `/v1/chat/completions` | `messages` with role system | `tools` | the other `messages` |

Token counts come from a `count(text) -> int` the caller gives: the served model's own
tokenizer (llama-server's `/tokenize`, `tokenizer_of(url)`), so they are the server's tokens,
not an estimate. The position of a difference is counted over the parts as serialized here:
the template adds a few tokens of markup per part, so it is close to, not equal to, the
cached-token count the server reports, and the capture table shows both side by side.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any, Callable

import pandas as pd

__all__ = ["parts", "dissect", "first_difference", "tokenizer_of", "embedded_counter", "compare_parts"]

Part = tuple[str, str, str]   # (kind, label, text)


def _text(x: Any) -> str:
    return x if isinstance(x, str) else json.dumps(x, ensure_ascii=False, separators=(",", ":"))


def parts(body: dict[str, Any], api: str) -> list[Part]:
    """A request's parts in the order a chat template renders them: (kind, label, text)."""
    out: list[Part] = []
    if api == "anthropic":
        system = body.get("system") or []
        blocks = [system] if isinstance(system, str) else system
        out += [("system", f"system {k}", _text(b.get("text", b) if isinstance(b, dict) else b))
                for k, b in enumerate(blocks)]
        out += [("tool", f"tool {j}: {t.get('name', '?')}", _text(t)) for j, t in enumerate(body.get("tools") or [])]
        out += [("message", f"message {i} ({m.get('role', '?')})", _text(m.get("content")))
                for i, m in enumerate(body.get("messages") or [])]
    elif api == "openai-responses":
        if body.get("instructions"):
            out.append(("system", "instructions", _text(body["instructions"])))
        out += [("tool", f"tool {j}: {t.get('name') or t.get('type', '?')}", _text(t))
                for j, t in enumerate(body.get("tools") or [])]
        items = body.get("input") or []
        items = [{"role": "user", "content": items}] if isinstance(items, str) else items
        out += [("system" if m.get("role") in ("system", "developer") else "message",
                 f"input {i} ({m.get('role') or m.get('type', '?')})", _text(m.get("content", m)))
                for i, m in enumerate(items)]
    elif api == "openai-chat":
        msgs = body.get("messages") or []
        out += [("system", f"message {i} (system)", _text(m.get("content"))) for i, m in enumerate(msgs)
                if m.get("role") in ("system", "developer")]
        out += [("tool", f"tool {j}: {(t.get('function') or t).get('name', '?')}", _text(t))
                for j, t in enumerate(body.get("tools") or [])]
        out += [("message", f"message {i} ({m.get('role', '?')})", _text(m.get("content", m)))
                for i, m in enumerate(msgs) if m.get("role") not in ("system", "developer")]
    else:
        raise ValueError(f"no anatomy for API {api!r}; one of anthropic, openai-responses, openai-chat")
    return out


def dissect(body: dict[str, Any], api: str, count: Callable[[str], int]) -> pd.DataFrame:
    """One row per part: kind, label, bytes, tokens (by `count`), and its share of the prompt."""
    rows = [{"kind": k, "part": label, "bytes": len(text.encode()), "tokens": count(text)}
            for k, label, text in parts(body, api)]
    df = pd.DataFrame(rows, columns=["kind", "part", "bytes", "tokens"])
    df["share"] = df["tokens"] / max(1, df["tokens"].sum())
    return df


def compare_parts(a: pd.DataFrame, b: pd.DataFrame, names: tuple[str, str]) -> pd.DataFrame:
    """Two dissections side by side, by kind: parts, bytes, tokens and b's tokens as a share of a's."""
    agg = {name: df.groupby("kind")[["bytes", "tokens"]].agg(["count", "sum"]) for name, df in zip(names, (a, b))}
    out = pd.DataFrame({
        f"{names[0]} parts": agg[names[0]][("tokens", "count")], f"{names[0]} tokens": agg[names[0]][("tokens", "sum")],
        f"{names[1]} parts": agg[names[1]][("tokens", "count")], f"{names[1]} tokens": agg[names[1]][("tokens", "sum")],
    }).fillna(0).astype(int)
    out.loc["total"] = out.sum()
    out[f"{names[1]} / {names[0]}"] = out[f"{names[1]} tokens"] / out[f"{names[0]} tokens"].where(
        out[f"{names[0]} tokens"] > 0)
    return out


def first_difference(prev: list[Part] | None, cur: list[Part], count: Callable[[str], int]) -> dict[str, Any]:
    """Where `cur` stops matching `prev`: the part, its index, and the tokens before it.

    Returns `{"part": label or None (identical / no previous call), "kind", "index",
    "tokens_before": tokens of the matching parts plus the matching start of the differing
    one, "tokens_total"}`. A part that is the same but shorter or longer (a conversation that
    grew) differs at the first part added, so a session that only appends reads as
    "message N", the new turn: nothing to fix.
    """
    total = sum(count(t) for _, _, t in cur)
    if prev is None:
        return {"part": None, "kind": "first call", "index": None, "tokens_before": 0, "tokens_total": total}
    before = 0
    for i, (kind, label, text) in enumerate(cur):
        if i >= len(prev):
            return {"part": label, "kind": kind, "index": i, "tokens_before": before, "tokens_total": total}
        if prev[i] != (kind, label, text):
            same = os.path.commonprefix([prev[i][2], text]) if prev[i][0] == kind else ""
            return {"part": label, "kind": kind, "index": i, "tokens_before": before + (count(same) if same else 0),
                    "tokens_total": total}
        before += count(text)
    return {"part": None, "kind": "identical" if len(cur) == len(prev) else "shorter",
            "index": None, "tokens_before": before, "tokens_total": total}


def tokenizer_of(url: str) -> Callable[[str], int]:
    """A token counter backed by a llama-server's `/tokenize` (the served model's own
    tokenizer), cached per text: an agent re-sends the same parts on every call."""
    import httpx

    @functools.lru_cache(maxsize=4096)
    def count(text: str) -> int:
        if not text:
            return 0
        r = httpx.post(url.rstrip("/") + "/tokenize", json={"content": text}, timeout=60)
        r.raise_for_status()
        return len(r.json()["tokens"])
    return count


def embedded_counter() -> Callable[[str], int]:
    """A token counter by the embedded model's own tokenizer, in process (vocabulary only):
    the tokenizer the lab's server counts with when it serves the embedded model, with no
    server asked (BOS not counted)."""
    from infercourse.models.embedded import vocab_tokenizer
    tok = vocab_tokenizer()

    @functools.lru_cache(maxsize=4096)
    def count(text: str) -> int:
        return len(tok(text)) - 1 if text else 0   # less the BOS the tokenizer adds
    return count

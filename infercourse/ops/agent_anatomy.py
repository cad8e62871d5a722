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

An agent may send calls with *different* system prompts in one task (a title generator
before the main call, a memory extractor after it, a next-speaker check): each of those
differs from the call before at its very first part, and on a one-slot server it evicts the
main prompt's prefix. So each call is compared twice (`write_anatomy`): with the previous
call of its API (what the server's cache meets) and with the previous call that had the
*same* system prompt (`system_key`: is the agent's own prefix stable, call to call and task
to task?).

Token counts come from a `count(text) -> int` the caller gives: the served model's own
tokenizer (llama-server's `/tokenize`, `tokenizer_of(url)`), so they are the server's tokens,
not an estimate. The position of a difference is counted over the parts as serialized here:
the template adds a few tokens of markup per part, so it is close to, not equal to, the
cached-token count the server reports, and the capture table shows both side by side.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import pandas as pd

__all__ = ["parts", "dissect", "first_difference", "tokenizer_of", "embedded_counter", "fewest_words", "compare_parts", "system_key",
           "write_anatomy", "padded_prompt"]

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


def system_key(ps: list[Part]) -> str:
    """A short name for a call's system prompt (its system parts, hashed), "none" without one:
    calls with the same key can share a prefix; a call with another key is a side call."""
    text = "\x00".join(t for k, _, t in ps if k == "system")
    return hashlib.sha256(text.encode()).hexdigest()[:8] if text else "none"


def write_anatomy(out: str | Path, count: Callable[[str], int]) -> Path:
    """Per call of a results folder (requests.jsonl + bodies/): its parts with their tokens,
    its `system_key`, and the first part that differs from the previous call of the same API
    (across tasks too: one server, one cache) and from the previous one with the same system
    prompt. Numbers only, into anatomy.jsonl; returns its path.

    Args:
        out: a lab run's or a recorded session's folder.
        count: a token counter (`tokenizer_of(url)`, or `embedded_counter()`).
    """
    from infercourse.ops.agent_stream import GENERATING_APIS, api_of
    out = Path(out)
    prev: dict[str, list] = {}
    prev_same: dict[tuple[str, str], list] = {}
    with open(out / "anatomy.jsonl", "w") as f:
        for line in (out / "requests.jsonl").read_text().splitlines():
            row = json.loads(line)
            tags = row.get("tags", {})
            api, body_path = api_of(tags.get("path", "")), out / "bodies" / f"{row['request_id']:03d}.json"
            if api not in GENERATING_APIS or not body_path.exists():
                continue
            try:
                ps = parts(json.loads(body_path.read_text()), api)
            except (ValueError, AttributeError, TypeError):   # not a JSON object of that API
                continue
            key = system_key(ps)
            diff, same = first_difference(prev.get(api), ps, count), first_difference(prev_same.get((api, key)), ps, count)
            prev[api], prev_same[(api, key)] = ps, ps
            f.write(json.dumps({"request_id": row["request_id"], "task": tags.get("task"), "api": api, "system_key": key,
                                "parts": [{"kind": k, "part": label, "bytes": len(t.encode()), "tokens": count(t)}
                                          for k, label, t in ps],
                                "first_difference": diff, "first_difference_same_system": same}) + "\n")
    return out / "anatomy.jsonl"


def padded_prompt(prompt: str, extra: int, count: Callable[[str], int] | None = None) -> str:
    """`prompt` with a note of filler words in front (the course's evaluation text), the fewest
    that make it at least `extra` tokens longer by `count` (default: the embedded model's
    tokenizer; another model's differs by its own error); `prompt` itself when `extra` is 0."""
    from infercourse.measure.workloads import eval_text
    if extra <= 0:
        return prompt
    count = count or embedded_counter()
    words, base = eval_text().split(), count(prompt)
    make = lambda n: f"A note (not part of the task): {' '.join(words[:n])}\n\n{prompt}"   # noqa: E731
    return make(fewest_words(make, base + extra, count, len(words)))


def fewest_words(make: Callable[[int], str], target: int, count: Callable[[str], int], most: int) -> int:
    """The fewest words n (0 to `most`) for which `make(n)` counts at least `target` tokens (`most`
    where none does): bisected, as the token count grows with the words."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(make(mid)) < target else (lo, mid)
    return lo

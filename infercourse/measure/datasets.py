"""Your own requests, from a JSONL file: `infercourse bench --dataset FILE.jsonl`.

A benchmark of someone else's prompts answers someone else's question. A dataset file
holds yours: one JSON object per line, each one request, validated before anything is
sent (every bad line is reported with its line number, not just the first).

Fields of a line:
- `prompt` (string) **or** `messages` (a list of `{"role": ..., "content": ...}`, roles
  system / user / assistant / tool; content a string or a list of content blocks): exactly
  one of the two;
- `max_tokens` (integer >= 1, default 64): the output cap;
- `offset_s` (number >= 0): when to send it, in seconds from the run's start (replayed with
  `--pattern replay`); give it on every line or on none;
- `session` (string): lines with the same session are the turns of one conversation, in
  file order. A session line's `messages` are the ones *added* at that turn (the first turn
  carries the system prompt and the task, later ones the tool result or the next user
  message); the model's reply is carried forward between turns (`--sessions N` runs N such
  sessions at once; with `--exact-replay`, `reply` is carried instead);
- `reply` (string, session lines): the recorded assistant reply of that turn;
- `think_s` (number >= 0, session lines): the pause after that turn (the tool's run time);
- `model` (string, request lines): the model to ask, by name or alias, for a server that
  serves several (llama-server's router mode, `servers.llama_router`); lines may name
  different models, so one run sends a mix, and the summary splits every metric by model.
  A line without one goes to the engine's model (`--model`).

    {"prompt": "Why is the sky blue?", "max_tokens": 32}
    {"prompt": "Title this chat in five words.", "max_tokens": 16, "model": "claude-haiku-4-5"}
    {"messages": [{"role": "user", "content": "Summarise RFC 2616 in one line."}], "offset_s": 0.5}
    {"session": "a", "messages": [{"role": "system", "content": "You are..."}, {"role": "user", "content": "Fix the bug."}], "reply": "Reading main.py.", "think_s": 0.1}
    {"session": "a", "messages": [{"role": "user", "content": "<tool_response>...</tool_response>"}]}

A file is either all request lines or all session lines.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from infercourse.core.types import Request
from infercourse.measure.sessions import SessionScript, SessionTurn
from infercourse.measure.model_mix import ModelRequest, ModelWorkload
from infercourse.measure.workloads import Workload, WorkloadError

__all__ = ["DatasetError", "FIELDS", "ROLES", "validate_line", "load_dataset", "dataset_workload",
           "dataset_sessions"]

FIELDS = {"prompt", "messages", "max_tokens", "offset_s", "session", "reply", "think_s", "model"}
ROLES = {"system", "user", "assistant", "tool"}
DEFAULT_MAX_TOKENS = 64
_SHOWN = 20   # bad lines listed in one error


class DatasetError(WorkloadError):
    """A dataset file that cannot be used as it is; the message lists its bad lines."""


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v >= 0


def validate_line(obj: Any) -> list[str]:
    """What is wrong with one parsed line ([] if nothing)."""
    if not isinstance(obj, dict):
        return [f"expected a JSON object, got {type(obj).__name__}"]
    errs = [f"unknown field {k!r} (known: {', '.join(sorted(FIELDS))})" for k in obj if k not in FIELDS]
    if ("prompt" in obj) == ("messages" in obj):
        errs.append("give exactly one of 'prompt' and 'messages'")
    if "prompt" in obj and not (isinstance(obj["prompt"], str) and obj["prompt"]):
        errs.append("'prompt' must be a non-empty string")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            errs.append("'messages' must be a non-empty list")
        else:
            for i, m in enumerate(msgs):
                if not isinstance(m, dict) or m.get("role") not in ROLES or "content" not in m:
                    errs.append(f"messages[{i}] must be {{'role': one of {sorted(ROLES)}, 'content': ...}}")
                elif not isinstance(m["content"], (str, list)):
                    errs.append(f"messages[{i}].content must be a string or a list of blocks")
    mt = obj.get("max_tokens", 1)
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        errs.append("'max_tokens' must be an integer >= 1")
    for k in ("offset_s", "think_s"):
        if k in obj and not _number(obj[k]):
            errs.append(f"'{k}' must be a number >= 0")
    if "session" in obj and not (isinstance(obj["session"], str) and obj["session"]):
        errs.append("'session' must be a non-empty string")
    for k in ("reply", "think_s"):
        if k in obj and "session" not in obj:
            errs.append(f"'{k}' only applies to a session line (one with 'session')")
    if "reply" in obj and not isinstance(obj["reply"], str):
        errs.append("'reply' must be a string")
    if "model" in obj and not (isinstance(obj["model"], str) and obj["model"].strip()):
        errs.append("'model' must be a non-empty string (a model name or alias the server knows)")
    if "model" in obj and "session" in obj:   # a session's turns run on one engine (measure.sessions)
        errs.append("'model' applies to request lines only; a session runs on one model (--model)")
    return errs


def load_dataset(path: str | Path) -> list[dict[str, Any]]:
    """Read and validate a dataset file; its lines as dicts (blank lines skipped).

    Raises DatasetError listing every bad line by number (the first 20), including
    file-level problems (mixed request and session lines, `offset_s` on only some lines).
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset {path} not found")
    rows, bad = [], []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            bad.append(f"line {n}: not valid JSON ({e.msg} at column {e.colno})")
            continue
        bad += [f"line {n}: {e}" for e in validate_line(obj)]
        if isinstance(obj, dict):
            rows.append({**obj, "_line": n})
    if not rows and not bad:
        bad.append("the file holds no requests")
    kinds = {"session" in r for r in rows}
    if len(kinds) > 1:
        first = next(r["_line"] for r in rows if ("session" in r) != ("session" in rows[0]))
        bad.append(f"line {first}: mixes session and request lines (a file is all one or all the other)")
    timed = [r["_line"] for r in rows if "offset_s" in r]
    if timed and len(timed) != len(rows):
        first = next(r["_line"] for r in rows if "offset_s" not in r)
        bad.append(f"line {first}: no 'offset_s' while other lines have one (give it on every line or none)")
    if bad:
        more = f"\n... and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
        raise DatasetError(f"{path}: {len(bad)} problem(s):\n" + "\n".join(bad[:_SHOWN]) + more,
                           hint="the format is in `infercourse bench --help` and infercourse.measure.datasets")
    return rows


def _request(r: dict[str, Any]) -> Request:
    kw = {"prompt": r["prompt"]} if "prompt" in r else {"messages": r["messages"]}
    if "model" in r:   # the model rides on the request: bench sends it and tags the row
        return ModelRequest(**kw, max_tokens=r.get("max_tokens", DEFAULT_MAX_TOKENS), model=r["model"])
    return Request(**kw, max_tokens=r.get("max_tokens", DEFAULT_MAX_TOKENS))


def dataset_workload(path: str | Path) -> Workload:
    """A request file as a Workload (with its offsets when the lines have them)."""
    rows = load_dataset(path)
    if "session" in rows[0]:
        raise DatasetError(f"{path} holds sessions, not requests", hint="run it with --sessions N")
    offsets = tuple(float(r["offset_s"]) for r in rows) if "offset_s" in rows[0] else None
    kind = ModelWorkload if any("model" in r for r in rows) else Workload
    return kind(f"dataset-{Path(path).stem}", tuple(_request(r) for r in rows), offsets)


def dataset_sessions(path: str | Path) -> list[SessionScript]:
    """A session file as SessionScripts, one per distinct `session`, in order of first line."""
    rows = load_dataset(path)
    if "session" not in rows[0]:
        raise DatasetError(f"{path} holds requests, not sessions",
                           hint="give lines a 'session' field, or run it without --sessions")
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["session"], []).append(r)
    out = []
    for name, lines in groups.items():
        turns = tuple(SessionTurn(added=tuple(r["messages"]) if "messages" in r else
                                  ({"role": "user", "content": r["prompt"]},),
                                  reply={"role": "assistant", "content": r["reply"]} if "reply" in r else None,
                                  max_tokens=r.get("max_tokens", DEFAULT_MAX_TOKENS),
                                  think_s=float(r.get("think_s", 0.0))) for r in lines)
        out.append(SessionScript(f"dataset-{Path(path).stem}-{name}", turns))
    return out

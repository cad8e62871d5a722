"""A stand-in of a chat-completions coding agent, for tests and for machines without npm: NOT a real agent.

Run as its own process and only through a spec (`tools/agents/specs/stand-in-chat.json`,
`ops.chat_agent`): the lab knows nothing of it but that file, which is the point; a second
agent works with configuration alone. Its calls follow what real chat-completions agents were
measured to send (issue 34), in our own words:

- a **side call** with its own short system prompt (a title for the task, `--side before`,
  as one agent sends before its main call; `--side after`, as another sends a memory
  extraction after it; `--side none`);
- the **main call**: a long system prompt, a few tool schemas, an environment message, then
  the task, streamed, asking for `--max-tokens` (32,000 by default, as both agents asked;
  on a small model that lets an answer ramble to the window's end).

The main call is byte-stable across tasks up to the task's words. Base URL and model come
from the command line, the key from `STANDIN_CHAT_KEY`. It prints one JSON result line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import httpx

MAIN_SYSTEM = ("You are a stand-in coding agent used by the course's tests. Read files before you edit them, "
               "keep changes small, and run the tests after every edit. ") * 6
SIDE_SYSTEM = {"before": "You write a title of at most six words for the user's request. Reply with the title only.",
               "after": "You extract facts worth remembering from the conversation. Reply with a JSON list."}


def _tools() -> list[dict]:
    return [{"type": "function", "function": {"name": name, "description": f"{name} a file in the working folder.",
                                              "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                             "required": ["path"]}}}
            for name in ("read", "write", "edit")]


def main_body(task: str, model: str, max_tokens: int, cwd: str) -> dict:
    """The main call: system, tools, an environment message, the task."""
    return {"model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
            "tools": _tools(),
            "messages": [{"role": "system", "content": MAIN_SYSTEM},
                         {"role": "user", "content": f"<env>Working folder: {cwd}. Platform: linux.</env>"},
                         {"role": "user", "content": task}]}


def side_body(kind: str, task: str, model: str, max_tokens: int) -> dict:
    """The side call: another system prompt, no tools, the task."""
    return {"model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": SIDE_SYSTEM[kind]}, {"role": "user", "content": task}]}


def _send(base: str, body: dict, key: str) -> str:
    text = ""
    with httpx.stream("POST", base + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=600) as r:
        if r.status_code >= 400:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                for c in json.loads(line[5:]).get("choices") or []:
                    text += (c.get("delta") or {}).get("content") or ""
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="testing_chat_agent", description=__doc__.splitlines()[0])
    p.add_argument("task")
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", default="stand-in-model")
    p.add_argument("--side", choices=("before", "after", "none"), default="before")
    p.add_argument("--max-tokens", type=int, default=32000)
    a = p.parse_args(argv)
    base, key = a.base_url.rstrip("/"), os.environ.get("STANDIN_CHAT_KEY", "")
    main = main_body(a.task, a.model, a.max_tokens, os.getcwd())
    side = [side_body(a.side, a.task, a.model, a.max_tokens)] if a.side != "none" else []
    calls = side + [main] if a.side == "before" else [main] + side
    text, error = "", None
    try:
        for body in calls:
            answer = _send(base, body, key)
            text = answer if body is main else text
    except (httpx.HTTPError, RuntimeError) as e:
        error = f"{type(e).__name__}: {e}"
    print(json.dumps({"type": "result", "subtype": "error" if error else "success", "is_error": bool(error),
                      "num_turns": 1, "result": error or text[:200]}))
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())

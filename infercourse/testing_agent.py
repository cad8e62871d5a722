"""A stand-in of a coding agent, for tests and for machines without npm: NOT Claude Code.

It runs as its own process, the way the agent lab runs a real agent (`python -m
infercourse.testing_agent TASK`), reads the same environment (ANTHROPIC_BASE_URL,
ANTHROPIC_MODEL, CLAUDE_CODE_ATTRIBUTION_HEADER), and sends one streamed
`POST /v1/messages` in the shape measured from Claude Code (`ops.agent_shape`): a
billing-header block first, whose version suffix depends on the task (so a second task busts
the cache, as the real one does), two more system blocks with `cache_control`, a few tool
schemas, a `role: "system"` message, then the task. The text in it is ours, written for
tests; only the structure follows the real client. It prints a JSON result like
`claude -p --output-format json` does.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import httpx

STANDIN_CONTEXT_WINDOW = 1_000_000   # what the real client assumes for a model it does not know


def request_body(task: str, model: str, *, header: bool = True, system_prompt: str | None = None,
                 max_tokens: int = 64) -> dict:
    """The stand-in's request: the real client's structure, our own words."""
    suffix = hashlib.sha256(task.encode()).hexdigest()[:3]   # per task, like cc_version=X.Y.Z.<3 hex>
    blocks = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=0.0.0.{suffix}; cc_entrypoint=sdk-cli;"}] \
        if header else []
    blocks += [{"type": "text", "text": "You are a stand-in coding agent used by the course's tests.",
                "cache_control": {"type": "ephemeral"}},
               {"type": "text", "text": system_prompt or ("Answer briefly. Use the tools when a file must be read. "
                                                          * 8), "cache_control": {"type": "ephemeral"}}]
    tools = [{"name": name, "description": f"{name} a file in the working folder.",
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
             for name in ("Read", "Write", "Edit")]
    messages = [{"role": "system", "content": "Working folder: /work. Platform: linux."},
                {"role": "user", "content": [{"type": "text", "text": task}]}]
    return {"model": model, "max_tokens": max_tokens, "stream": True, "system": blocks, "tools": tools,
            "messages": messages}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="testing_agent", description=__doc__.splitlines()[0])
    p.add_argument("task")
    p.add_argument("--system-prompt")
    a = p.parse_args(argv)
    base = os.environ["ANTHROPIC_BASE_URL"].rstrip("/")
    model = os.environ.get("ANTHROPIC_MODEL", "stand-in-model")
    body = request_body(a.task, model, header=os.environ.get("CLAUDE_CODE_ATTRIBUTION_HEADER") != "0",
                        system_prompt=a.system_prompt, max_tokens=int(os.environ.get("STANDIN_MAX_TOKENS", "64")))
    text, error = "", None
    headers = {"x-api-key": os.environ.get("ANTHROPIC_API_KEY", ""), "anthropic-version": "2023-06-01"}
    try:
        with httpx.stream("POST", base + "/v1/messages?beta=true", json=body, headers=headers,
                          timeout=float(os.environ.get("API_TIMEOUT_MS", "600000")) / 1000) as r:
            if r.status_code >= 400:
                r.read()
                error = f"HTTP {r.status_code}: {r.text[:300]}"
            else:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        doc = json.loads(line[5:])
                        text += (doc.get("delta") or {}).get("text", "")
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    print(json.dumps({"type": "result", "subtype": "error" if error else "success", "is_error": bool(error),
                      "num_turns": 1, "result": error or text,
                      "modelUsage": {model: {"contextWindow": STANDIN_CONTEXT_WINDOW}}}))
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())

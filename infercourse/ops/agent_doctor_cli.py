"""The command line of `infercourse doctor agent URL --agent claude-code|codex|chat`.

The checks are `ops.agent_doctor`'s (Claude Code, Codex) and `ops.chat_doctor`'s (an agent
over chat completions, described by a spec); this module parses the arguments, refuses a
server off loopback unless asked, and prints the report.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from infercourse.ops.agent_doctor import agent_shape, grade_agent_route, probe_agent_route, report

__all__ = ["doctor_agent_main"]


def _doctor_chat(a: Any) -> int:
    """`--agent chat`: the checks of `ops.chat_doctor`, for the agent `--spec` names."""
    from infercourse.ops import chat_agent, chat_doctor
    spec = chat_agent.load_spec(a.spec)
    shape = {**chat_doctor.chat_shape(spec["name"], a.capture), "timeout_s": spec.get("timeout_s"),
             "timeout_note": spec.get("timeout_note")}
    try:
        ev = chat_doctor.probe_chat_route(a.url)
    except httpx.HTTPError as e:
        print(f"error: server at {a.url} not reachable: {e} (API layer)")
        return 1
    checks = chat_doctor.grade_chat_route(ev, shape, timeout_s=a.timeout)
    print(f"{spec['name']} (chat completions) against {a.url} (first request: {shape['first_request']['prompt_tokens']} "
          f"tokens, from {shape['source']})")
    print(chat_doctor.chat_report(ev, shape, checks, spec, timeout_s=a.timeout))
    return 1 if any(c.status == "fail" for c in checks) else 0


def doctor_agent_main(argv: list[str] | None = None) -> int:
    """`infercourse doctor agent URL --agent claude-code|codex|chat [--spec NAME|FILE] [--capture DIR]`."""
    import argparse
    from infercourse.core.loopback import refuse_remote
    p = argparse.ArgumentParser(prog="infercourse doctor agent", description="is this server ready for a real agent?")
    p.add_argument("url")
    p.add_argument("--agent", choices=("claude-code", "codex", "chat"), default="claude-code",
                   help="chat: any agent over chat completions (ops.chat_doctor), described by --spec")
    p.add_argument("--spec", default="qwen-code", help="--agent chat: a shipped spec's name or your spec's JSON file")
    p.add_argument("--capture", type=Path, help="a lab run's (or recorded session's) folder: use its measured calls")
    p.add_argument("--timeout", type=float, help="the agent's stream timeout in seconds (default: its own)")
    p.add_argument("--allow-remote", action="store_true", help="permit a server that is not on loopback")
    a = p.parse_args(argv)
    why = refuse_remote(a.url, what="doctor agent", allow_remote=a.allow_remote)
    if why:
        p.error(why)
    if a.agent == "chat":
        return _doctor_chat(a)
    shape = agent_shape(a.agent, a.capture)
    try:
        ev = probe_agent_route(a.url, a.agent)
    except httpx.HTTPError as e:
        print(f"error: server at {a.url} not reachable: {e} (API layer)")
        return 1
    checks = grade_agent_route(ev, shape, timeout_s=a.timeout)
    print(f"{a.agent} against {a.url} (first request: {shape['prompt_tokens']} tokens, from {shape['source']})")
    print(report(a.agent, a.url, ev, shape, checks))
    return 1 if any(c.status == "fail" for c in checks) else 0

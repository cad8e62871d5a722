"""`infercourse agent ...`: run a real coding agent against the course's server, captured.

    infercourse agent install                       # the pinned agents, scripts off (cache folder)
    infercourse agent status                        # what is installed
    infercourse agent run --agent claude-code --task "Say hello" [--task ...] [--small]
    infercourse agent report DIR                    # the capture table of a finished run

`run` starts llama-server, the recording proxy and the agent inside a loopback-only network
namespace (`ops.agent_lab`), one task after another on one server, and prints one row per
call and one per task, then where the agents ran (the manifest's network line). `--no-netns`
makes no namespace at all (host network: the agent can reach the internet, and the output
says so); `--env` may not name a base URL, a proxy variable, a home or a key: the lab sets
those, so every call goes through the recording proxy (`agents.check_env`). `--small` shrinks Claude Code's request with its own flags (a short
system prompt, one tool); `--extend-context N` serves N tokens of context to a model trained
on fewer (metadata override + YaRN). The results folder holds the request bodies: they are
the vendors' prompt text, and stay there.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["agent_main"]

SMALL_SYSTEM = "You are a coding assistant. Answer in one short sentence."


def _env(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items or []:
        k, eq, v = item.partition("=")
        if not eq or not k:
            raise argparse.ArgumentTypeError(f"--env {item!r}: expected NAME=VALUE")
        out[k] = v
    return out


def _print_tables(out: Path) -> None:
    import pandas as pd

    from infercourse.ops.agent_lab import calls_table, network_line, tasks_table
    with pd.option_context("display.width", 220, "display.max_columns", 30, "display.max_colwidth", 60):
        calls = calls_table(out)
        cols = [c for c in ("task", "api", "path", "model", "status", "ttft_s", "e2e_s", "prompt_tokens",
                            "cached_tokens", "evaluated_tokens", "stop_reason", "first_diff", "tokens_before_diff",
                            "error") if c in calls]
        print(calls[cols].to_string(float_format=lambda v: f"{v:.3g}"))
        print()
        print(tasks_table(out).to_string(float_format=lambda v: f"{v:.3g}"))
    print(f"\n{network_line(out)}\nresults: {out}")


def agent_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="infercourse agent", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help="install the pinned agents with npm into the cache folder")
    sub.add_parser("status", help="which agents are installed")
    rp = sub.add_parser("report", help="the capture table of a lab run")
    rp.add_argument("dir", type=Path)
    r = sub.add_parser("run", help="run agent tasks against a fresh llama-server, captured")
    r.add_argument("--agent", choices=("claude-code", "codex", "stand-in"), default="claude-code")
    r.add_argument("--task", action="append", required=True, help="a task prompt (repeat: run in order)")
    r.add_argument("--small", action="store_true", help="Claude Code: short system prompt and one tool (Read)")
    r.add_argument("--ctx", type=int, default=8192, help="llama-server -c (one slot)")
    r.add_argument("--extend-context", type=int, metavar="N", help="serve N tokens to a model trained on 8192")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--env", action="append", metavar="NAME=VALUE", help="agent environment (repeatable)")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds per task before it is killed")
    r.add_argument("--out", type=Path, help="results folder (default: a new one under build/results/agent)")
    r.add_argument("--no-netns", action="store_true",
                   help="no network namespace: run on the host network (NOT loopback-only; the agent can "
                        "reach the internet)")
    a = p.parse_args(argv)
    from infercourse.core.errors import InferCourseError
    from infercourse.ops import agents
    if a.cmd == "install":
        return agents.main(["install"])
    if a.cmd == "status":
        return agents.main(["status"])
    if a.cmd == "report":
        if not (a.dir / "manifest.json").is_file():
            p.error(f"{a.dir}: not a lab run (no manifest.json)")
        _print_tables(a.dir)
        return 0
    from infercourse.course import results_dir
    from infercourse.ops.agent_lab import EXTEND_CONTEXT, LabSpec, Task, run_lab
    small = dict(system_prompt=SMALL_SYSTEM, tools="Read") if a.small and a.agent == "claude-code" else {}
    try:
        env = _env(a.env)
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    try:
        agents.check_env(env, what="--env")
    except InferCourseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tasks = [Task(f"task {i}", a.agent, t, env=env, timeout_s=a.timeout, **small) for i, t in enumerate(a.task)]
    ctx = a.extend_context or a.ctx
    spec = LabSpec(str(a.out or results_dir("agent")), tasks, ctx=ctx, threads=a.threads,
                   server_args=EXTEND_CONTEXT(ctx) if a.extend_context else [], host_network=a.no_netns)
    try:
        out = run_lab(spec)
    except InferCourseError as e:
        print(f"error: {e}", file=sys.stderr)
        if (Path(spec.out) / "requests.jsonl").exists():
            _print_tables(Path(spec.out))
        return 1
    _print_tables(out)
    return 0

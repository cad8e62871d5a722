"""`infercourse agent ...`: run a real coding agent against the course's server, captured.

    infercourse agent install                       # the pinned agents, scripts off (cache folder)
    infercourse agent status                        # what is installed
    infercourse agent run --agent claude-code --task "Say hello" [--task ...] [--small]
    infercourse agent run --agent qwen-code --task "Say hello" [--size ci]     # a shipped spec
    infercourse agent run --agent chat --spec my-agent.json --task ...        # your agent, by configuration
    infercourse agent run --agent chat --cmd 'mycli -p {task}' --route-env OPENAI_BASE_URL={base_url}/v1 ...
    infercourse agent proxy --upstream http://127.0.0.1:8080 [--port 8788]    # record your own session
    infercourse agent report DIR                    # the capture table and the totals of a run or session

`run` starts llama-server, the recording proxy and the agent inside a loopback-only network
namespace (`ops.agent_lab`), one task after another on one server, and prints one row per
call and one per task, then where the agents ran (the manifest's network line). `--no-netns`
makes no namespace at all (host network: the agent can reach the internet, and the output
says so); `--env` may not name a base URL, a proxy variable, a home or a key: the lab sets
those, so every call goes through the recording proxy (`agents.check_env`). `--small` shrinks Claude Code's request with its own flags (a short
system prompt, one tool); `--extend-context N` serves N tokens of context to a model trained
on fewer (metadata override + YaRN). The results folder holds the request bodies: they are
the vendors' prompt text, and stay there.

Any other agent runs from a spec (`ops.chat_agent`): a shipped one by name (`--agent
qwen-code`), a JSON file (`--agent chat --spec FILE`), or a command line built here (`--cmd`,
with `{base_url}`, `{model}`, `{api_key}`, `{task}` placeholders, and `--route-env` for the
variables the agent reads its base URL, key and model from). `proxy` is the recorder in
front of your own server for your own agent's working session (`ops.agent_session`): it
listens on 127.0.0.1 and forwards to a loopback upstream unless you pass `--allow-remote`;
Ctrl-C ends it, and `report` reads it back.
"""
from __future__ import annotations

import argparse
import signal
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
    from infercourse.ops.agent_session import session_totals, totals_sentence
    from infercourse.ops.lab_options import OPTION_TAGS
    with pd.option_context("display.width", 250, "display.max_columns", 30, "display.max_colwidth", 60):
        calls = calls_table(out)
        cols = [c for c in ("task", "api", "path", "model", "status", "ttft_s", "e2e_s", "prompt_tokens",
                            "cached_tokens", "evaluated_tokens", "prefill_ms", "stop_reason", *OPTION_TAGS,
                            "system", "first_diff", "tokens_before_diff", "first_diff_same_system", "error") if c in calls]
        print(calls[cols].to_string(float_format=lambda v: f"{v:.3g}"))
        tasks = tasks_table(out)
        if len(tasks):
            print()
            print(tasks.to_string(float_format=lambda v: f"{v:.3g}"))
    print(f"\n{totals_sentence(session_totals(out))}\n{network_line(out)}\nresults: {out}")


def _spec(a: argparse.Namespace, p: argparse.ArgumentParser):
    """The spec `run` was given: a shipped name (--agent NAME), --spec FILE, or --cmd."""
    import shlex

    from infercourse.ops import chat_agent
    if a.agent_cmd:
        words = shlex.split(a.agent_cmd)
        return chat_agent.load_spec({"name": a.name or "my-agent", "command": words[0], "argv": ["{bin}", *words[1:]],
                                     "env": _env(a.route_env), "api": a.api})
    if a.agent == "chat" and not a.spec:
        p.error("--agent chat needs --spec NAME|FILE or --cmd '...'")
    return chat_agent.load_spec(a.spec or a.agent)


def _proxy(a: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    from infercourse.core.loopback import refuse_remote
    from infercourse.course import results_dir
    from infercourse.ops.agent_session import SessionRecorder
    why = refuse_remote(a.upstream, what="agent proxy", allow_remote=a.allow_remote)
    if why:
        p.error(why)
    rec = SessionRecorder(a.upstream, a.out or results_dir("agent-session"), port=a.port, allow_remote=a.allow_remote)
    # Ctrl-C ends the session even where the shell started it with SIGINT ignored (a background
    # job, nohup, a test run in one): Python leaves an ignored SIGINT ignored, and it would never end.
    # One that comes while the session's folder is still being written (it listens first: seconds)
    # is held until the folder is there, then ends the session the same way
    held: list[int] = []
    before = signal.signal(signal.SIGINT, lambda *_: held.append(1))
    try:
        rec.start()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            if held:
                raise KeyboardInterrupt
            print(f"recording {a.upstream} at {rec.url}: point your agent's base URL there (with /v1 where it "
                  f"wants one); Ctrl-C ends the session. Bodies go to {rec.out / 'bodies'} and stay there.", flush=True)
            rec.wait(a.duration)
        except KeyboardInterrupt:
            pass
        finally:
            rec.stop()
    finally:
        signal.signal(signal.SIGINT, before)
    _print_tables(rec.out)
    return 0


def agent_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="infercourse agent", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help="install the pinned agents with npm into the cache folder")
    sub.add_parser("status", help="which agents are installed")
    rp = sub.add_parser("report", help="the capture table and totals of a lab run or a recorded session")
    rp.add_argument("dir", type=Path)
    pp = sub.add_parser("proxy", help="record your own agent's session in front of your own server")
    pp.add_argument("--upstream", required=True, help="your server's root, e.g. http://127.0.0.1:8080")
    pp.add_argument("--port", type=int, default=8788, help="where the recorder listens on 127.0.0.1 (0: any)")
    pp.add_argument("--out", type=Path, help="results folder (default: a new one under build/results/agent-session)")
    pp.add_argument("--duration", type=float, help="seconds to record (default: until Ctrl-C)")
    pp.add_argument("--allow-remote", action="store_true", help="forward to a server that is not on loopback")
    from infercourse.ops.chat_agent import spec_names
    r = sub.add_parser("run", help="run agent tasks against a fresh llama-server, captured")
    r.add_argument("--agent", choices=("claude-code", "codex", "stand-in", "chat", *spec_names()), default="claude-code",
                   help="chat: any agent, from --spec or --cmd")
    r.add_argument("--spec", help="--agent chat: a spec's JSON file (or a shipped spec's name)")
    r.add_argument("--cmd", dest="agent_cmd", help="--agent chat: the agent's command line, with {base_url} {model} {api_key} {task}")
    r.add_argument("--route-env", action="append", metavar="NAME=TEMPLATE",
                   help="--cmd: a variable the agent reads, e.g. OPENAI_BASE_URL={base_url}/v1 (repeatable)")
    r.add_argument("--api", choices=("chat", "responses", "messages"), default="chat", help="--cmd: the API it speaks")
    r.add_argument("--name", help="--cmd: the agent's name in the tables")
    r.add_argument("--size", choices=("full", "ci"), default="full", help="a spec's size (ci: its own flags shrink it)")
    r.add_argument("--variant", action="append", default=[], help="a spec's named variant (repeatable)")
    r.add_argument("--slots", type=int, default=1, help="llama-server -np (each slot gets --ctx)")
    r.add_argument("--cache-ram", type=int, help="llama-server --cache-ram MiB (0: off; default: its own)")
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
            p.error(f"{a.dir}: not a lab run or a recorded session (no manifest.json)")
        _print_tables(a.dir)
        return 0
    if a.cmd == "proxy":
        return _proxy(a, p)
    from infercourse.course import results_dir
    from infercourse.ops.agent_lab import LabSpec, Task, extend_flags, run_lab
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
    from infercourse.ops import chat_agent
    try:
        spec_ = chat_agent.sized(_spec(a, p), a.size, *a.variant) if (a.agent_cmd or a.spec or a.agent not in
                                                                        ("claude-code", "codex", "stand-in")) else None
    except (InferCourseError, argparse.ArgumentTypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tasks = [Task(f"task {i}", spec_["name"] if spec_ else a.agent, t, env=env, timeout_s=a.timeout, spec=spec_,
                  **({} if spec_ else small)) for i, t in enumerate(a.task)]
    ctx = a.extend_context or a.ctx
    spec = LabSpec(str(a.out or results_dir("agent")), tasks, ctx=ctx, threads=a.threads, slots=a.slots,
                   cache_ram_mib=a.cache_ram, server_args=extend_flags(ctx) if a.extend_context else [],
                   host_network=a.no_netns)
    try:
        out = run_lab(spec)
    except InferCourseError as e:
        print(f"error: {e}", file=sys.stderr)
        if (Path(spec.out) / "requests.jsonl").exists():
            _print_tables(Path(spec.out))
        return 1
    _print_tables(out)
    return 0

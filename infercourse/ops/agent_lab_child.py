"""The agent lab's child: what runs inside the loopback-only namespace (`ops.agent_lab`).

`ops.agent_lab.run_lab` starts this module as `python -m infercourse.ops.agent_lab_child
SPEC.json` inside `unshare -n` (or, with `--no-netns`, on the host's network). In order:

1. inside a namespace, bring `lo` up and refuse to go on unless it is the only interface;
2. start llama-server (one slot, the course's tools template) and the recording proxy in front
   of it, both on 127.0.0.1, and open the run's `RunWriter` with its manifest (the network
   line says which of the two the run had);
3. play the tasks one after another: each agent gets a throwaway home, the proxy as its only
   route (`agents.sealed_env(route=...)`), a dummy key, and its task's time bound, under the
   servers' watchdog; after each, one line in tasks.jsonl (exit, wall time, calls, the tokens
   the server evaluated, what the agent's own JSON output said);
4. per call, the anatomy: tokens per part and the first part that differs (numbers only).

Everything it measured is in the run's folder however it ended; its own output goes to
lab.log, which the parent reads back only when the child failed.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from infercourse.core.errors import AgentLayerError
from infercourse.ops import netns
from infercourse.ops.agent_lab import LabSpec, Task
from infercourse.ops.lab_options import lab_rewrite

__all__ = ["child_main"]


def _homes(out: Path) -> Path:
    """The tasks' homes: out/homes, a link to a folder outside any git repository where `out`
    lies in one (a results folder in the course's clone): Claude Code finds the repository
    around its working folder by itself and sends its branch, status and recent commits in its
    first message, so the request would depend on where the results are written."""
    link, real = out / "homes", out.resolve()
    if link.exists() or not any((d / ".git").exists() for d in (real, *real.parents)):
        return link
    link.symlink_to(tempfile.mkdtemp(prefix="infercourse-lab-homes-"), target_is_directory=True)
    return link


def _launch(task: Task, i: int, out: Path, proxy_url: str, served: str) -> tuple[list[str], dict, Path]:
    from infercourse.ops import agents
    # one user, one project: every task of a lab shares a HOME and a working folder, as a
    # learner's tasks do (the agent's system prompt names its working folder: a folder per
    # task made every new task differ at Claude Code's third system block)
    home = (_homes(out) / (task.session or "user")).resolve()
    work = home / "work"
    work.mkdir(parents=True, exist_ok=True)
    if task.spec is not None:   # any other agent: its spec says how it is run (ops.chat_agent)
        from infercourse.ops.chat_agent import launch
        argv, env = launch(task.spec, task.prompt, home, work, proxy_url, served, task.env)
        return argv, env, work
    if task.agent == "claude-code":
        env = agents.sealed_env(home, {"ANTHROPIC_MODEL": served, **task.env}, route={"ANTHROPIC_BASE_URL": proxy_url})
        return agents.claude_argv(task.prompt, system_prompt=task.system_prompt, tools=task.tools,
                                  max_turns=task.max_turns, resume=task.resume), env, work
    if task.agent == "codex":
        env = agents.sealed_env(home, task.env)
        (home / ".codex").mkdir(parents=True, exist_ok=True)
        cfg = dict(task.codex)
        if cfg.get("instructions"):   # Codex's own instructions replaced by a short text (the CI size)
            (home / "instructions.md").write_text(cfg.pop("instructions"))
            cfg["instructions_file"] = str(home / "instructions.md")
        (home / ".codex" / "config.toml").write_text(agents.codex_config(proxy_url, served, **cfg))
        return agents.codex_argv(task.prompt, work), env, work
    if task.agent == "stand-in":
        env = agents.sealed_env(home, {"ANTHROPIC_MODEL": served, **task.env}, route={"ANTHROPIC_BASE_URL": proxy_url})
        argv = [sys.executable, "-m", "infercourse.testing_agent", task.prompt]
        if task.system_prompt is not None:
            argv += ["--system-prompt", task.system_prompt]
        return argv, env, work
    raise AgentLayerError(f"unknown agent {task.agent!r}")


def _run_agent(argv: list[str], env: dict, work: Path, timeout_s: float, log: Path) -> tuple[Any, str, str]:
    """The agent under the servers' watchdog (`servers.watchdog`): in a process group of its
    own, which the watchdog kills whole (the agent's own children too: Codex's native binary
    under its node launcher) when the lab dies, or when the task's time bound sends it SIGTERM.
    The agent's stdout and stderr go to `log`.out / .err, read back after it ends."""
    from infercourse.servers import watchdog
    out, err = log.with_suffix(".out"), log.with_suffix(".err")
    with open(out, "wb") as fo, open(err, "wb") as fe:
        p = subprocess.Popen([sys.executable, watchdog.__file__, "--", *argv], env=env, cwd=work,
                             stdout=fo, stderr=fe, stdin=subprocess.DEVNULL)
        try:
            rc: Any = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.terminate()                      # the watchdog stops the agent's whole group
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            rc = "timeout"
    return rc, out.read_text(errors="replace"), err.read_text(errors="replace")


def _agent_json(stdout: str) -> dict[str, Any]:
    """The numbers an agent's own output reports (Claude Code's JSON result; Codex's last
    `turn.completed` event), never its text beyond a short preview."""
    docs: list = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith(("{", "[")):   # one event per line, or one array of them (Qwen Code's -o json)
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            docs += [d for d in (doc if isinstance(doc, list) else [doc]) if isinstance(d, dict)]
    out: dict[str, Any] = {}
    for d in docs:
        if d.get("type") == "result" or "modelUsage" in d:
            # terminal_reason says why the agent stopped: "blocking_limit" is its own refusal to
            # send a prompt it thinks too long for the window ("Prompt is too long"), no call made
            out.update(is_error=d.get("is_error"), num_turns=d.get("num_turns"), subtype=d.get("subtype"),
                       terminal_reason=d.get("terminal_reason"), result_preview=str(d.get("result", ""))[:200])
            windows = {m: u.get("contextWindow") for m, u in (d.get("modelUsage") or {}).items()}
            out["assumed_context_window"] = windows
        if d.get("type") in ("turn.completed", "turn.failed", "error"):
            out["codex_last_event"] = d.get("type")
            out["codex_error"] = str((d.get("error") or {}).get("message", d.get("message", "")))[:300] or None
    return out


def _query_sources(stderr: str) -> list[str]:
    """The query sources Claude Code named on stderr for a model id it does not know
    (`[claude-code:unrecognized_model] {"model": ..., "query_source": "compact"}`): "sdk" for
    the task's own calls, "compact" for a summary of the history. Names only. The pinned
    version warns once per process, so this is the source of its first query, not of all."""
    found = set()
    for line in stderr.splitlines():
        if "unrecognized_model]" in line and "{" in line:
            try:
                found.add(str(json.loads(line[line.index("{"):]).get("query_source")))
            except ValueError:
                continue
    return sorted(found)


def _server(spec: LabSpec):
    from infercourse.measure.workloads import DATA_DIR
    from infercourse.servers import LlamaServer
    extra = ["--chat-template-file", str(DATA_DIR / "chatml_tools.jinja"), "--alias", spec.served_name,
             *(["-n", str(spec.n_predict)] if spec.n_predict else []), *spec.server_args]
    # -c is the whole KV pool: with more slots each gets ctx / slots, so the window per slot stays `ctx`
    return LlamaServer(spec.model, n_parallel=spec.slots, ctx_size=spec.ctx * spec.slots, threads=spec.threads,
                       jinja=True, cache_ram_mib=spec.cache_ram_mib, extra_args=extra)


def _manifest(spec: LabSpec, srv, isolated: bool) -> dict[str, Any]:
    from infercourse.models.embedded import file_sha256
    from infercourse.ops import agents
    from infercourse.ops import chat_agent
    names = sorted({t.agent for t in spec.tasks if t.spec is None})
    specs = {t.agent: chat_agent.version(t.spec) for t in spec.tasks if t.spec is not None}
    return {"label": Path(spec.out).name, "engine": srv.describe(),
            "model": {"path": str(srv.model_path), "sha256": file_sha256(srv.model_path),
                      "served_name": spec.served_name, "ctx": spec.ctx, "server_args": spec.server_args},
            "sampling": "set by the agent: each call's body (bodies/) holds its temperature and max_tokens",
            "load": {"pattern": "one agent task at a time, sequential", "concurrency": "as the agent sends it",
                     "server_slots": spec.slots, "cache_ram_mib": spec.cache_ram_mib},
            "workload": {"tasks": [{k: v for k, v in asdict(t).items() if k != "prompt"} |
                                   {"prompt_chars": len(t.prompt)} for t in spec.tasks]},
            "agents": {**{a: (agents.version(a) if a != "stand-in" else "infercourse.testing_agent") for a in names},
                       **specs},
            "network": {"namespace": "loopback-only" if isolated else _host_words(spec),
                        "interfaces": netns.interfaces()}}


def _host_words(spec: LabSpec) -> str:
    """Why a run had no namespace: the user's --no-netns (on a platform without namespaces,
    the only way to run), or a platform without them."""
    where = "; macOS has none" if sys.platform == "darwin" else ""
    return (f"host (no namespace: --no-netns{where}; the agent could reach the internet)" if spec.host_network
            else f"host (no namespace: {sys.platform} has none)")


def child_main(spec_path: str) -> int:
    """Inside the namespace: check it, start the server and the proxy, play the tasks."""
    spec = LabSpec.load(spec_path)
    out = Path(spec.out)
    isolated = netns.isolates(spec.host_network)   # as `wrap` decided in the parent
    if isolated:
        netns.bring_up_loopback()
        netns.assert_only_loopback()
    from infercourse.measure.results import RunWriter
    from infercourse.ops.agent_capture import RecordingProxy, evaluated_count
    with _server(spec) as srv, RunWriter(out, _manifest(spec, srv, isolated)) as writer, \
            RecordingProxy(srv.url, on_call=writer.write, bodies_dir=out / "bodies") as proxy:
        print(f"server {srv.url} (log {srv.log_path}); proxy {proxy.url}; network "
              f"{'loopback-only namespace' if isolated else _host_words(spec)}", flush=True)
        for i, task in enumerate(spec.tasks):
            argv, env, work = _launch(task, i, out, proxy.url, spec.served_name)
            proxy.tags = {"task": task.label, "agent": task.agent}
            proxy.rewrite = lab_rewrite(task.force_first_tool, task.answer_stop, task.greedy)
            n0, before, t0 = len(proxy.traces), evaluated_count(srv.url), time.perf_counter()
            (out / "agents").mkdir(exist_ok=True)
            rc, stdout, stderr = _run_agent(argv, env, work, task.timeout_s, out / "agents" / f"{i:02d}")
            wall = time.perf_counter() - t0
            proxy.settle()    # the agent's last call recorded before its task's row is written
            after = evaluated_count(srv.url)
            calls = proxy.traces[n0:]
            row = {"task": task.label, "agent": task.agent, "exit": rc, "wall_s": wall, "calls": len(calls),
                   "failed_calls": sum(c.status != "ok" for c in calls),
                   "prompt_tokens": sum(c.prompt_tokens or 0 for c in calls),
                   "evaluated_tokens": (after - before) if None not in (before, after) else None,
                   "server_alive": srv.running, "query_sources": _query_sources(stderr), **_agent_json(stdout)}
            with open(out / "tasks.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"task {task.label}: exit {rc}, {len(calls)} calls, {wall:.1f} s", flush=True)
            for err in proxy.metrics_errors:
                print(f"  /metrics not read: {err}", flush=True)
            proxy.metrics_errors.clear()
        if spec.anatomy:
            from infercourse.ops.agent_anatomy import tokenizer_of, write_anatomy
            write_anatomy(out, tokenizer_of(srv.url))
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1]))

"""Run a real coding agent against the course's own server, sealed, and capture every call.

One lab run is a list of tasks (each: an agent, a prompt, its flags and environment) played
one after another against **one** llama-server, so the second task meets the first one's
cache, as on a learner's machine. The whole run happens in a child process:

    unshare -n  python -m infercourse.ops.agent_lab SPEC.json
        lo up; refuse unless `lo` is the only interface       (ops.netns)
        llama-server on 127.0.0.1                            (servers.LlamaServer)
        RecordingProxy on 127.0.0.1 -> the server             (ops.agent_capture)
        for each task: the agent, HOME=<throwaway>, base URL = the proxy, dummy key
        per-call anatomy: tokens per part, first part that differs (ops.agent_anatomy)

and everything it measured is in the run's folder when it returns, however it ended:

    manifest.json    conditions: machine, server argv and version, model file hash,
                     agents and versions, flags, the namespace's interfaces
    requests.jsonl   one line per call (a RequestTrace: `infercourse report` renders it)
    tasks.jsonl      one line per task: exit code, wall time, calls, evaluated tokens,
                     what the agent's own JSON output says (turns, context window it assumed,
                     why it stopped) and the query source it logged first ("compact": it
                     began by compacting)
    anatomy.jsonl    per call: parts, tokens per part, the first part that differs
    bodies/, homes/  the request bodies and the agents' homes: vendor prompt text, kept in
                     the results folder, never committed
    lab.log          the child's own output (a cell never prints it)

`run_lab(spec)` is the parent's side: it starts the child in the namespace (`ops.netns.wrap`
refuses where none can be made), waits within a bound, and returns the folder.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infercourse.core.errors import AgentLayerError
from infercourse.ops import netns

__all__ = ["Task", "LabSpec", "run_lab", "EXTEND_CONTEXT", "calls_table", "tasks_table", "anatomy"]


def EXTEND_CONTEXT(ctx: int, trained: int = 8192) -> list[str]:
    """llama-server flags that let a model trained on `trained` tokens take `ctx`: the slot is
    capped at the trained length unless the model's own metadata says more, so the metadata is
    overridden, and YaRN rope scaling stretches the positions it never saw (a quality cost
    the notebook measures)."""
    scale = max(1.0, ctx / trained)
    return ["--override-kv", f"llama.context_length=int:{ctx}", "--rope-scaling", "yarn",
            "--rope-scale", f"{scale:g}", "--yarn-orig-ctx", str(trained)]


@dataclass
class Task:
    """One headless agent run.

    Args:
        label: its name in the tables ("A cold", "B header off").
        agent: "claude-code", "codex", or "stand-in" (the course's stand-in client, for tests).
        prompt: the task given to the agent.
        env: extra environment (e.g. {"CLAUDE_CODE_ATTRIBUTION_HEADER": "0"}).
        system_prompt, tools: Claude Code's own flags to shrink its request (None: defaults).
        codex: Codex config values (stream_max_retries, request_max_retries,
            stream_idle_timeout_ms, context_window; instructions: a text that replaces
            Codex's own instructions, the way to shrink its request).
        timeout_s: the task is killed after this long (the bound of every lab run).
        session: the throwaway HOME and working folder the task runs in (None: the lab's one
            "user" home, shared by every task, as one user's tasks share their project);
            `resume` finds the conversation there.
        resume: continue the session's last conversation (Claude Code's `--continue`): the
            history grows task after task, as a long session does.
    """

    label: str
    agent: str
    prompt: str
    env: dict[str, str] = field(default_factory=dict)
    system_prompt: str | None = None
    tools: str | None = None
    max_turns: int | None = 1
    codex: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0
    session: str | None = None
    resume: bool = False


@dataclass
class LabSpec:
    """A lab run: one server, its tasks, and where the results go.

    `n_predict` is llama-server's `-n`: the output cap of a request that names none, and the
    ceiling of one that names more (the server cuts its `max_tokens` to it and logs "exceeds
    server configuration"). Codex sends none, so without a cap an answer the agent has
    abandoned (its stream timeout fired) runs on to the end of the window, holding the only
    slot while the agent's retries queue behind it. None: no server cap, each call's own
    `max_tokens` stands (Claude Code's 32,000 by default)."""

    out: str
    tasks: list[Task]
    ctx: int = 8192
    threads: int | None = 1
    model: str | None = None
    served_name: str = "smollm2-135m"
    server_args: list[str] = field(default_factory=list)
    n_predict: int | None = 64
    anatomy: bool = True
    allow_host_network: bool = False

    def save(self) -> Path:
        path = Path(self.out) / "spec.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "LabSpec":
        d = json.loads(Path(path).read_text())
        d["tasks"] = [Task(**t) for t in d["tasks"]]
        return cls(**d)


def run_lab(spec: LabSpec) -> Path:
    """Run `spec` in a loopback-only namespace (child process); returns the results folder.
    Raises AgentLayerError when the child failed, after everything it wrote is on disk."""
    for t in spec.tasks:
        if t.agent != "stand-in":
            from infercourse.ops.agents import missing_reason
            why = missing_reason(t.agent)
            if why:
                raise AgentLayerError(why)
    out = Path(spec.out)
    if (out / "manifest.json").exists():
        raise FileExistsError(f"{out} already holds a lab run; results are append-only, pick a new folder")
    argv = netns.wrap([sys.executable, "-m", "infercourse.ops.agent_lab", str(spec.save())],
                      allow_host_network=spec.allow_host_network)
    bound = sum(t.timeout_s for t in spec.tasks) + 300   # + server start and anatomy
    with open(out / "lab.log", "ab") as log:
        try:
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                timeout=bound).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0:
        tail = "\n".join((out / "lab.log").read_text(errors="replace").splitlines()[-15:])
        raise AgentLayerError(f"the agent lab ended with {rc}; what it measured is in {out}. "
                              f"Last lines of lab.log:\n{tail}")
    return out


def calls_table(out: str | Path) -> "pd.DataFrame":
    """One row per captured call: task, path, API, model, status, error, TTFT and E2E (the
    proxy's clock), prompt / cached / evaluated tokens (the server's usage; its /metrics
    counter), and the first part that differs from the previous call of the same API."""
    import pandas as pd
    from infercourse.measure.results import load_run
    run = load_run(out)
    df = run.df.copy()
    keep = ["request_id", "task", "agent", "method", "path", "api", "model", "http_status", "status", "error",
            "ttft_s", "e2e_s", "prompt_tokens", "cached_tokens", "evaluated_tokens", "output_tokens",
            "stop_reason", "max_tokens", "body_bytes", "overlapped"]
    df = df[[c for c in keep if c in df.columns]]
    anat = anatomy(out)
    if len(anat):
        diff = pd.DataFrame([{"request_id": a["request_id"], "first_diff": a["first_difference"]["part"]
                              or a["first_difference"]["kind"],
                              "tokens_before_diff": a["first_difference"]["tokens_before"]} for a in anat])
        df = df.merge(diff, on="request_id", how="left")
    return df.sort_values("request_id").reset_index(drop=True)


def tasks_table(out: str | Path) -> "pd.DataFrame":
    """One row per task: exit code, wall time, calls, prompt and evaluated tokens, and what the
    agent's own output said (turns, the context window it assumed)."""
    import pandas as pd
    path = Path(out) / "tasks.jsonl"
    return pd.DataFrame([json.loads(l) for l in path.read_text().splitlines()] if path.exists() else [])


def anatomy(out: str | Path) -> list[dict[str, Any]]:
    """The per-call anatomy the lab wrote (parts and their tokens, first difference)."""
    path = Path(out) / "anatomy.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


# -- the child, inside the namespace --------------------------------------------------------
def _launch(task: Task, i: int, out: Path, proxy_url: str, served: str) -> tuple[list[str], dict, Path]:
    from infercourse.ops import agents
    # one user, one project: every task of a lab shares a HOME and a working folder, as a
    # learner's tasks do (the agent's system prompt names its working folder: a folder per
    # task made every new task differ at Claude Code's third system block)
    home = out / "homes" / (task.session or "user")
    work = home / "work"
    work.mkdir(parents=True, exist_ok=True)
    if task.agent == "claude-code":
        env = agents.sealed_env(home, {"ANTHROPIC_BASE_URL": proxy_url, "ANTHROPIC_MODEL": served,
                                       **task.env})
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
        env = agents.sealed_env(home, {"ANTHROPIC_BASE_URL": proxy_url, "ANTHROPIC_MODEL": served, **task.env})
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
    docs = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                docs.append(json.loads(line))
            except ValueError:
                continue
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
    return LlamaServer(spec.model, n_parallel=1, ctx_size=spec.ctx, threads=spec.threads, jinja=True,
                       extra_args=extra)


def _manifest(spec: LabSpec, srv, isolated: bool) -> dict[str, Any]:
    from infercourse.models.embedded import file_sha256
    from infercourse.ops import agents
    names = sorted({t.agent for t in spec.tasks})
    return {"label": Path(spec.out).name, "engine": srv.describe(),
            "model": {"path": str(srv.model_path), "sha256": file_sha256(srv.model_path),
                      "served_name": spec.served_name, "ctx": spec.ctx, "server_args": spec.server_args},
            "sampling": "set by the agent: each call's body (bodies/) holds its temperature and max_tokens",
            "load": {"pattern": "one agent task at a time, sequential", "concurrency": "as the agent sends it",
                     "server_slots": 1},
            "workload": {"tasks": [{k: v for k, v in asdict(t).items() if k != "prompt"} |
                                   {"prompt_chars": len(t.prompt)} for t in spec.tasks]},
            "agents": {a: (agents.version(a) if a != "stand-in" else "infercourse.testing_agent") for a in names},
            "network": {"namespace": "loopback-only" if isolated else "host (no namespace)",
                        "interfaces": netns.interfaces()}}


def _anatomy(out: Path, url: str) -> None:
    """Per call: tokens per part and the first part that differs from the previous call of
    the same API (across tasks too: one server, one cache). Numbers only."""
    from infercourse.ops.agent_anatomy import first_difference, parts, tokenizer_of
    from infercourse.ops.agent_capture import GENERATING_APIS, api_of
    count = tokenizer_of(url)
    prev: dict[str, list] = {}
    with open(out / "anatomy.jsonl", "w") as f:
        for line in (out / "requests.jsonl").read_text().splitlines():
            row = json.loads(line)
            tags = row.get("tags", {})
            api, body_path = api_of(tags.get("path", "")), out / "bodies" / f"{row['request_id']:03d}.json"
            if api not in GENERATING_APIS or not body_path.exists():
                continue
            body = json.loads(body_path.read_text())
            ps = parts(body, api)
            diff = first_difference(prev.get(api), ps, count)
            prev[api] = ps
            f.write(json.dumps({"request_id": row["request_id"], "task": tags.get("task"), "api": api,
                                "parts": [{"kind": k, "part": label, "bytes": len(t.encode()), "tokens": count(t)}
                                          for k, label, t in ps],
                                "first_difference": diff}) + "\n")


def child_main(spec_path: str) -> int:
    """Inside the namespace: check it, start the server and the proxy, play the tasks."""
    spec = LabSpec.load(spec_path)
    out = Path(spec.out)
    isolated = sys.platform.startswith("linux") and not spec.allow_host_network
    if isolated:
        netns.bring_up_loopback()
        netns.assert_only_loopback()
    from infercourse.measure.results import RunWriter
    from infercourse.ops.agent_capture import RecordingProxy, evaluated_count
    with _server(spec) as srv, RunWriter(out, _manifest(spec, srv, isolated)) as writer, \
            RecordingProxy(srv.url, on_call=writer.write, bodies_dir=out / "bodies") as proxy:
        print(f"server {srv.url} (log {srv.log_path}); proxy {proxy.url}", flush=True)
        for i, task in enumerate(spec.tasks):
            argv, env, work = _launch(task, i, out, proxy.url, spec.served_name)
            proxy.tags = {"task": task.label, "agent": task.agent}
            n0, before, t0 = len(proxy.traces), evaluated_count(srv.url), time.perf_counter()
            (out / "agents").mkdir(exist_ok=True)
            rc, stdout, stderr = _run_agent(argv, env, work, task.timeout_s, out / "agents" / f"{i:02d}")
            wall = time.perf_counter() - t0
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
            _anatomy(out, srv.url)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1]))

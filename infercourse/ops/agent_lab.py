"""Run a real coding agent against the course's own server, sealed, and capture every call.

One lab run is a list of tasks (each: an agent, a prompt, its flags and environment) played
one after another against **one** llama-server, so the second task meets the first one's
cache, as on a learner's machine. The whole run happens in a child process:

    unshare -n  python -m infercourse.ops.agent_lab_child SPEC.json
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

`run_lab(spec)` is the parent's side: it checks every task's environment (`agents.check_env`:
no task may move the route off the recording proxy), starts the child in the namespace
(`ops.netns.wrap` refuses where none can be made), waits within a bound, and returns the
folder; the child's side is `ops.agent_lab_child`. With `host_network` (the CLI's
`--no-netns`) there is no namespace at all: the child runs on the host's network, and the
manifest says so.
"""
from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infercourse.core.errors import AgentLayerError
from infercourse.ops import netns
from infercourse.ops.lab_options import OPTION_TAGS

__all__ = ["Task", "LabSpec", "run_lab", "EXTEND_CONTEXT", "extend_flags", "trained_context", "served_trained_context",
           "calls_table", "tasks_table", "agent_outcome", "anatomy", "refused_size", "refused_window",
           "network_line"]


def EXTEND_CONTEXT(ctx: int, trained: int = 8192, arch: str = "llama") -> list[str]:
    """llama-server flags that let a model trained on `trained` tokens take `ctx`: the slot is
    capped at the trained length unless the model's own metadata says more, so the metadata
    (`ARCH.context_length`, `arch` the GGUF's general.architecture) is overridden, and YaRN rope
    scaling stretches the positions it never saw (a quality cost the notebook measures).
    `extend_flags` reads `trained` and `arch` from a model's own file."""
    scale = max(1.0, ctx / trained)
    return ["--override-kv", f"{arch}.context_length=int:{ctx}", "--rope-scaling", "yarn",
            "--rope-scale", f"{scale:g}", "--yarn-orig-ctx", str(trained)]


@functools.lru_cache(maxsize=8)
def trained_context(model: str | None = None) -> tuple[str, int | None]:
    """(general.architecture, the context length it was trained on) from the model's own file
    (None: the embedded model), read once per model (a GGUF header takes seconds)."""
    from infercourse.models.modelcard import model_card
    card = model_card(model)
    return card.architecture, card.context_length


def served_trained_context(props: dict[str, Any], models: list[dict[str, Any]]) -> tuple[str | None, int | None, str]:
    """(general.architecture, trained context, where it was read) of the model a llama-server
    serves, from `/props` and `/v1/models`' data. Its file where `/props` names one on this
    machine: a server started with `--override-kv ARCH.context_length=...` reports the override
    as `n_ctx_train`, while the file states what the model was trained on. Else the server's own."""
    path = props.get("model_path")
    if path and Path(path).is_file():
        arch, trained = trained_context(str(path))
        return arch, trained, "its model file"
    meta = next((m["meta"] for m in models if (m.get("meta") or {}).get("n_ctx_train")), {})
    return None, meta.get("n_ctx_train"), "the server's n_ctx_train, which an --override-kv changes"


def extend_flags(ctx: int, model: str | Path | None = None) -> list[str]:
    """`EXTEND_CONTEXT` for `model` (None: the embedded one) with the trained context and
    architecture its own file states: no flags where `ctx` is within what it was trained on
    (a model trained on 32,768 tokens gets none at 32,768, not YaRN from 8,192)."""
    arch, trained = trained_context(None if model is None else str(model))
    return [] if not trained or ctx <= trained else EXTEND_CONTEXT(ctx, trained, arch)


@dataclass
class Task:
    """One headless agent run.

    Args:
        label: its name in the tables ("A cold", "B header off").
        agent: "claude-code", "codex", "stand-in" (the course's stand-in client, for tests),
            or, with `spec`, the spec's name.
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
        spec: any other agent, as configuration (`ops.chat_agent`: its command line, the
            environment it reads, its config files); the lab runs it like the named ones.
        force_first_tool: a tool's name (e.g. "Read"): a lab option, stated on the call it
            changes (`forced` in its tags). The recorder makes the task's first call that offers
            that tool ask for it alone (`ops.lab_options.first_tool_forcer`), so llama-server
            (--jinja) constrains the answer to one valid call of it; the agent runs it and sends
            the result back: a tool-call round trip with a model that calls no tool on its own.
            Name a harmless tool: the model writes the arguments.
        answer_stop: stop sequences (e.g. ["\\n"]): a lab option, stated on each call it changes
            (`answer_stop` in its tags): the recorder adds them to every call but a forced one
            (`ops.lab_options.answer_stopper`), so answers end on their own before the agent's
            answer cap, which the agent counts as an API error.
        greedy: a lab option, stated on each call it changes (`greedy` in its tags): the
            recorder sends every call at temperature 0 (`ops.lab_options.greedy_sampler`), so
            an answer's length is the same each run.
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
    spec: dict[str, Any] | None = None
    force_first_tool: str | None = None
    answer_stop: list[str] | None = None
    greedy: bool = False


@dataclass
class LabSpec:
    """A lab run: one server, its tasks, and where the results go.

    `n_predict` is llama-server's `-n`: the output cap of a request that names none. It does
    not cap a request that names `max_tokens` (measured on the course's build: `-n 16` and
    `max_tokens: 100` gave 100 tokens), so only the agent's own setting bounds those (Claude
    Code's 32,000 by default). Codex and Qwen Code send none, so without a cap an answer the
    agent has abandoned (its stream timeout fired) runs on to the end of the window, holding
    the only slot while the agent's retries queue behind it. None: no server cap."""

    out: str
    tasks: list[Task]
    ctx: int = 8192
    threads: int | None = 1
    model: str | None = None
    served_name: str = "smollm2-135m"
    server_args: list[str] = field(default_factory=list)
    n_predict: int | None = 64
    slots: int = 1                 # llama-server -np (2: a side call gets its own slot)
    cache_ram_mib: int | None = None   # --cache-ram (None: the server's default; 0: no host prompt cache)
    anatomy: bool = True
    host_network: bool = False     # no namespace at all (`netns.wrap`): the CLI's --no-netns

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
    Refuses, before anything starts, a missing agent and a task environment that would move
    the agent off the recording proxy (`agents.check_env`). Raises AgentLayerError when the
    child failed, after everything it wrote is on disk."""
    from infercourse.ops import chat_agent
    from infercourse.ops.agents import check_env, missing_reason
    for t in spec.tasks:
        if t.spec is not None:
            chat_agent.check_spec(t.spec)
        why = chat_agent.missing(t.spec) if t.spec is not None else \
            missing_reason(t.agent) if t.agent != "stand-in" else None
        if why:
            raise AgentLayerError(why)
        check_env(t.env, what=f"task {t.label!r}")
    out = Path(spec.out)
    if (out / "manifest.json").exists():
        raise FileExistsError(f"{out} already holds a lab run; results are append-only, pick a new folder")
    argv = netns.wrap([sys.executable, "-m", "infercourse.ops.agent_lab_child", str(spec.save())],
                      host_network=spec.host_network)
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


def network_line(out: str | Path) -> str:
    """Where a lab run's agents ran, from its manifest: "network: loopback-only namespace
    (interfaces: lo)" or "network: host (...)", the words a user of --no-netns must see."""
    net = json.loads((Path(out) / "manifest.json").read_text()).get("network", {})
    return f"network: {net.get('namespace', 'not recorded')} (interfaces: {', '.join(net.get('interfaces', []))})"


def refused_size(error: Any) -> float:
    """The prompt size in llama-server's refusal ("request (N tokens) exceeds ..."), or NaN."""
    m = re.search(r"request \((\d+) tokens\)", error if isinstance(error, str) else "")
    return float(m.group(1)) if m else float("nan")


def refused_window(error: Any) -> float:
    """The window in the same refusal ("... exceeds the available context size (W tokens)"), or NaN."""
    m = re.search(r"available context size \((\d+) tokens\)", error if isinstance(error, str) else "")
    return float(m.group(1)) if m else float("nan")


def _diff_label(d: dict[str, Any] | None) -> str | None:
    return None if d is None else (d["part"] or d["kind"])


def calls_table(out: str | Path) -> "pd.DataFrame":
    """One row per captured call: task, path, API, model, status, error, TTFT and E2E (the
    proxy's clock), prompt / cached / evaluated tokens (the server's usage; its /metrics
    counter or its own per-call timings), prefill time (the server's), and the first part that
    differs from the previous call of the same API (`first_diff`, what the cache meets) and
    from the previous call with the same system prompt (`first_diff_same_system`; `system`
    names the prompt: a call with another is a side call)."""
    import pandas as pd
    from infercourse.measure.results import load_run
    run = load_run(out)
    df = run.df.copy()
    keep = ["request_id", "task", "agent", "method", "path", "api", "model", "http_status", "status", "error",
            "ttft_s", "e2e_s", "prompt_tokens", "cached_tokens", "evaluated_tokens", "prefill_ms", "output_tokens",
            "stop_reason", "max_tokens", "body_bytes", "overlapped", *OPTION_TAGS]
    df = df[[c for c in keep if c in df.columns]]
    anat = anatomy(out)
    if len(anat):
        diff = pd.DataFrame([{"request_id": a["request_id"], "system": a.get("system_key"),
                              "first_diff": _diff_label(a["first_difference"]),
                              "tokens_before_diff": a["first_difference"]["tokens_before"],
                              "first_diff_same_system": _diff_label(a.get("first_difference_same_system")),
                              "tokens_before_same_system": (a.get("first_difference_same_system") or {}).get(
                                  "tokens_before")} for a in anat])
        df = df.merge(diff, on="request_id", how="left")
    return df.sort_values("request_id").reset_index(drop=True)


def agent_outcome(task: dict[str, Any]) -> str:
    """How a task ended in the agent's own words, from its own result (never from the server's
    side): "completed"; "api_error: ..." (the agent reports an API error: a refused call, or an
    answer cut at its output cap, which Claude Code treats as an error; also where it exits 0 and
    calls it a success with "[API Error: ...]" as its answer, as Qwen Code does); "prompt_too_long" (it
    refused to send, or compaction failed: `terminal_reason` blocking_limit); another reason the
    agent names with its words (e.g. "rapid_refill_breaker: Autocompact is thrashing..."); "refused"
    (it answered, declining); "timeout" (the lab's task bound, not the agent's); else "error (exit N)".

    Args:
        task: one row of `tasks_table` (exit, is_error, subtype, terminal_reason, result_preview,
            codex_last_event, codex_error).
    """
    said = str(task.get("result_preview") or "")
    if task.get("exit") == "timeout":
        return "timeout"
    if task.get("terminal_reason") == "blocking_limit" or "Prompt is too long" in said:
        return "prompt_too_long"
    codex = task.get("codex_last_event")
    # Qwen Code (a Gemini CLI fork) exits 0 with subtype success and its API error as the answer
    api_error = "API Error" in said and (task.get("is_error") or said.lstrip().startswith("[API Error"))
    if codex in ("turn.failed", "error") or api_error:
        why = task.get("codex_error") if codex else said
        return "api_error: " + " ".join(str(why or "").split())[:90]
    reason = task.get("terminal_reason")
    if task.get("is_error") and reason and reason not in ("completed", "success", "end_turn"):
        return f"{reason}: " + " ".join(said.split())[:90]     # e.g. rapid_refill_breaker: compaction thrashing
    if codex == "turn.completed" or (task.get("subtype") == "success" and not task.get("is_error")):
        return "refused" if re.match(r"\s*(I can(no|')t|I'm (sorry|unable)|I am unable)", said) else "completed"
    return f"error (exit {task.get('exit')})"


def tasks_table(out: str | Path) -> "pd.DataFrame":
    """One row per task: exit code, wall time, calls, prompt and evaluated tokens, what the
    agent's own output said (turns, the context window it assumed), and `agent_said`: how the
    task ended in its own words (`agent_outcome`)."""
    import pandas as pd
    path = Path(out) / "tasks.jsonl"
    df = pd.DataFrame([json.loads(l) for l in path.read_text().splitlines()] if path.exists() else [])
    if len(df):
        df["agent_said"] = [agent_outcome(r) for r in df.to_dict("records")]
    return df


def anatomy(out: str | Path) -> list[dict[str, Any]]:
    """The per-call anatomy the lab wrote (parts and their tokens, first difference)."""
    path = Path(out) / "anatomy.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []

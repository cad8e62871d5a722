"""The real coding agents: Claude Code, Codex CLI and the ones run from a spec, installed,
configured and launched.

Claude Code and Codex are npm packages that ship a native binary: `@anthropic-ai/claude-code`
(speaks the Anthropic Messages API, `POST /v1/messages`) and `@openai/codex` (the OpenAI
Responses API, `POST /v1/responses`). Agents that speak OpenAI chat completions are run from a
spec (`ops.chat_agent`, `tools/agents/specs/`); the pinned one is Qwen Code
(`@qwen-code/qwen-code`, plain JavaScript run by Node). The course pins one version of each
in `tools/agents/package.json` with its lock file, and `python -m infercourse.ops.agents
install` installs exactly those into `cache_dir()/agents`, never into the repo, with
**install scripts off** (`npm ci --ignore-scripts`): npm fetches on the host's network,
outside any namespace, so no vendor code runs there. The lock's only install script is Claude Code's postinstall, which copies the
native binary of the platform's package (an optional dependency npm picks by os, cpu and libc)
over a placeholder; the lab runs that binary from its platform package instead (`binary`).
Codex's launcher (`bin/codex.js`, run by Node) and Qwen Code's `cli.js` need no script.
Where `npm` is absent it says how to install them (the Node.js version the lock's `engines`
fields ask for, `node_needed`) and every cell that needs them skips with that reason.

Every launch is sealed the same way, whatever the caller passes:

- a throwaway `HOME` (and `CODEX_HOME`): no user settings, credentials or history leak in,
  and the agent's own files (sessions, logs) stay in the run's folder;
- a dummy API key: the server here checks none, and a real key must never be sent;
- `CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1` and `DISABLE_AUTOUPDATER=1` (Claude Code's
  telemetry, error reports and auto-update off); Codex's update check off in its config;
- on Linux, the agent runs only inside a loopback-only network namespace (`ops.netns`), with
  the server it talks to in the same namespace (`ops.agent_lab`).

The settings a learner pastes on their own machine are printed by `claude_settings` and
`codex_config`, with values `ops.agent_doctor` computes from measurements.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from infercourse.core.errors import AgentLayerError
from infercourse.models.embedded import cache_dir
from infercourse.ops import netns

__all__ = ["AGENTS", "PINS", "pinned_packages", "agents_dir", "binary", "node_needed", "version", "missing_reason",
           "readiness", "skip_reason", "install",
           "LAB_ENV", "check_env", "sealed_env", "claude_argv", "codex_argv", "codex_config", "claude_settings", "DUMMY_KEY",
           "CLAUDE_WINDOW_ENV", "CLAUDE_ASSUMED_WINDOW", "CLAUDE_AUTO_COMPACT_WINDOW_FLOOR", "claude_window_limits",
           "claude_budget", "CLAUDE_ANSWER_CAP", "CLAUDE_GROWTH"]

SPEC_DIR = Path(__file__).resolve().parents[2] / "tools" / "agents"


def pinned_packages() -> dict[str, str]:
    """Every npm package tools/agents/package.json pins, with its version."""
    f = SPEC_DIR / "package.json"
    return json.loads(f.read_text())["dependencies"] if f.is_file() else {}


def _spec_packages() -> dict[str, tuple[str, str]]:
    """The agents described by a spec (`ops.chat_agent`) whose program is a pinned package."""
    out = {}
    for f in sorted((SPEC_DIR / "specs").glob("*.json")):
        d = json.loads(f.read_text())
        if d.get("package") in pinned_packages():
            out[d["name"]] = (d["package"], d.get("bin", d["name"]))
    return out


_PKG = {"claude-code": ("@anthropic-ai/claude-code", "claude"), "codex": ("@openai/codex", "codex"), **_spec_packages()}
AGENTS = tuple(_PKG)   # every pinned agent: the two with their own launchers, then those run from a spec
PINS = {a: pinned_packages()[pkg] for a, (pkg, _) in _PKG.items() if pkg in pinned_packages()}
DUMMY_KEY = "sk-local-dummy-not-a-real-key"
# Claude Code's documented switches for a machine with no vendor cloud (code.claude.com/docs/en/env-vars)
QUIET_ENV = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
             "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "NO_COLOR": "1"}
# Claude Code's billing header off: its first system block changes with each task, so a new task
# keeps the cached prefix only without it (the lab's sessions, the doctor's fix, the stand-in's settings)
HEADER_OFF = {"CLAUDE_CODE_ATTRIBUTION_HEADER": "0"}


# the pinned Claude Code's window arithmetic lives in ops.agent_budget (re-exported here)
from infercourse.ops.agent_budget import (  # noqa: F401
    CLAUDE_WINDOW_ENV, CLAUDE_ASSUMED_WINDOW, CLAUDE_OUTPUT_RESERVE_CAP, CLAUDE_COMPACT_BUFFER, CLAUDE_BLOCKING_BUFFER, CLAUDE_AUTO_COMPACT_WINDOW_FLOOR,
    CLAUDE_ANSWER_CAP, CLAUDE_MIN_ANSWER_CAP, CLAUDE_GROWTH, claude_budget, claude_window_limits)


def agents_dir() -> Path:
    return cache_dir() / "agents"


def binary(agent: str) -> Path | None:
    """The installed agent's executable, or None: Claude Code's native binary in its platform
    package (what its skipped postinstall would have copied into place), else the package's
    launcher in node_modules/.bin (Codex, and the agents run from a spec)."""
    pkg, exe = _PKG[agent]
    if agent == "claude-code":
        scope = agents_dir() / "node_modules" / pkg.split("/")[0]
        found = sorted(p for p in scope.glob(f"{pkg.split('/')[1]}-*/{exe}*") if p.name in (exe, exe + ".exe"))
        return found[0] if len(found) == 1 else None   # npm installs the one package this platform takes
    path = agents_dir() / "node_modules" / ".bin" / exe
    return path if path.exists() else None


def node_needed() -> dict[str, str]:
    """The Node.js range each pinned agent's package declares (`engines.node` in the lock)."""
    lock = SPEC_DIR / "package-lock.json"
    pkgs = json.loads(lock.read_text()).get("packages", {}) if lock.is_file() else {}
    return {a: pkgs.get(f"node_modules/{pkg}", {}).get("engines", {}).get("node", "any") for a, (pkg, _) in _PKG.items()}


def _node_words() -> str:
    return "Node.js with npm (the lock asks for node " + ", ".join(f"{r} for {a}" for a, r in node_needed().items()) + ")"


def version(agent: str) -> str | None:
    """The installed package's version (from its package.json: no process started)."""
    f = agents_dir() / "node_modules" / _PKG[agent][0] / "package.json"
    return json.loads(f.read_text())["version"] if f.is_file() else None


def missing_reason(agent: str) -> str | None:
    """None when `agent` is installed at the pinned version, else why not and what to run."""
    if agent not in _PKG:
        raise AgentLayerError(f"unknown agent {agent!r}; one of {', '.join(AGENTS)}")
    if binary(agent) is None:
        how = ("`make agents` (or `python -m infercourse.ops.agents install`)" if shutil.which("npm")
               else f"install {_node_words()}, then `make agents`")
        return f"{agent} is not installed in {agents_dir()}: {how}"
    if PINS and version(agent) != PINS[agent]:
        return f"{agent} {version(agent)} is installed, the course pins {PINS[agent]}: run `make agents`"
    return None


def readiness() -> "pd.DataFrame":
    """What the real-agent lab needs, and whether this machine has it."""
    import pandas as pd
    rows = [{"needs": "a loopback-only network namespace", "ready": netns.available(),
             "why not": netns.why_not()}]
    for a in AGENTS:
        why = missing_reason(a)
        rows.append({"needs": f"{a} {PINS.get(a, '')}", "ready": why is None, "why not": why})
    return pd.DataFrame(rows)


def skip_reason(wanted: list[str]) -> str | None:
    """None when every agent in `wanted` can run here (sealed), else the first reason why not."""
    if not netns.available():           # macOS has none: the lab refuses there unless the learner opts in
        return f"no loopback-only network namespace here ({netns.why_not()}): a real agent is not run"
    for a in wanted:
        why = missing_reason(a)
        if why:
            return why
    return None


def install(quiet: bool = False) -> str:
    """`npm ci --ignore-scripts` of the pinned agents into `agents_dir()`; returns what it did
    (or why not). Raises AgentLayerError when npm fails or an agent is still not runnable."""
    if shutil.which("npm") is None:
        return f"npm not found: the real-agent notebook will skip. Install {_node_words()}, then `make agents`"
    dest = agents_dir()
    dest.mkdir(parents=True, exist_ok=True)
    if all(missing_reason(a) is None for a in AGENTS):
        return f"agents already installed in {dest}: " + ", ".join(f"{a} {version(a)}" for a in AGENTS)
    for name in ("package.json", "package-lock.json"):
        shutil.copyfile(SPEC_DIR / name, dest / name)
    # scripts off: this runs on the host network, outside any namespace (see the docstring)
    out = subprocess.run(["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"], cwd=dest,
                         capture_output=True, text=True, timeout=900)
    (dest / "npm.log").write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        raise AgentLayerError(f"npm ci failed in {dest} (code {out.returncode}); its output is in "
                              f"{dest / 'npm.log'}")
    still = [why for a in AGENTS if (why := missing_reason(a))]
    if still:
        raise AgentLayerError(f"npm ci ran, yet: {'; '.join(still)} (no native package for this platform?)")
    return f"installed in {dest} (install scripts off): " + ", ".join(f"{a} {version(a)}" for a in AGENTS)


# What the lab sets and a task may not: where the agent's calls go (the recording proxy:
# "every call captured" holds only if no base URL or proxy variable moves them), which home
# and config it reads, and its key. A name ending in _BASE_URL or _PROXY is refused whatever
# its prefix (ANTHROPIC_BEDROCK_BASE_URL, https_proxy...).
LAB_ENV = ("HOME", "CODEX_HOME", "XDG_CONFIG_HOME", "CLAUDE_CONFIG_DIR", "ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN",
           "OPENAI_API_KEY", "COURSE_API_KEY", "CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX",
           "CLAUDE_CODE_USE_FOUNDRY")


def check_env(env: dict[str, str] | None, what: str = "the agent's environment") -> None:
    """Refuse (AgentLayerError, agent layer) any name in `env` the lab owns: a base URL or a
    proxy variable (they would send calls past the recording proxy), a home or config folder,
    a key (`LAB_ENV`).

    Args:
        env: the extra environment a task or the CLI's --env asks for.
        what: who asked, named in the error ("task 'A cold'").
    """
    bad = sorted(k for k in (env or {}) if k.upper() in LAB_ENV or k.upper().endswith(("_BASE_URL", "_PROXY")))
    if bad:
        raise AgentLayerError(
            f"{what} sets {', '.join(bad)}: the lab sets where the agent's calls go (the recording proxy, so "
            "every call is captured), its home and config, and a dummy key; a task may not override them",
            hint="Drop these names from the task's env (--env)")


def sealed_env(home: Path, extra: dict[str, str] | None = None, *, route: dict[str, str] | None = None) -> dict[str, str]:
    """The whole environment of an agent process: PATH and locale from ours, nothing else of
    the user's, a throwaway HOME, the quiet switches, a dummy key; `extra` on top (model names,
    a timeout; checked by `check_env`), then `route`, the lab's own (the proxy's base URL).

    Args:
        home: the throwaway home (HOME, CODEX_HOME and XDG_CONFIG_HOME inside it).
        extra: the task's environment; a name the lab owns is refused.
        route: what the lab sets last, e.g. {"ANTHROPIC_BASE_URL": proxy_url}.
    """
    import os
    check_env(extra)
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR", "TZ")}
    env.update(QUIET_ENV, HOME=str(home), CODEX_HOME=str(home / ".codex"), XDG_CONFIG_HOME=str(home / ".config"),
               ANTHROPIC_API_KEY=DUMMY_KEY, COURSE_API_KEY=DUMMY_KEY)
    env.update({k: str(v) for k, v in (extra or {}).items()})
    env.update(route or {})
    return env


def claude_argv(task: str, *, system_prompt: str | None = None, tools: str | None = None,
                max_turns: int | None = 1, resume: bool = False) -> list[str]:
    """`claude -p TASK --output-format json`, shrunk with the agent's own flags when asked:
    `system_prompt` replaces the default system text, `tools` limits the tool list
    (e.g. "Read"); `resume` continues the last conversation in the working folder."""
    exe = binary("claude-code")
    if exe is None:
        raise AgentLayerError(missing_reason("claude-code"))
    argv = [str(exe), "-p", task, "--output-format", "json"]
    if system_prompt is not None:
        argv += ["--system-prompt", system_prompt]
    if tools is not None:
        argv += ["--tools", tools]
    if max_turns is not None:
        argv += ["--max-turns", str(max_turns)]
    if resume:
        argv.append("--continue")
    return argv


def codex_argv(task: str, workdir: Path) -> list[str]:
    """`codex exec TASK` in `workdir`, JSON events on stdout (no git repo needed)."""
    exe = binary("codex")
    if exe is None:
        raise AgentLayerError(missing_reason("codex"))
    return [str(exe), "exec", "--skip-git-repo-check", "--json", "-C", str(workdir), task]


def codex_config(base_url: str, model: str, *, stream_max_retries: int | None = None,
                 request_max_retries: int | None = None, stream_idle_timeout_ms: int | None = None,
                 context_window: int | None = None, instructions_file: str | None = None) -> str:
    """Codex's `config.toml`: one provider block for a local server over the Responses API.
    Keys from Codex's configuration reference (model_providers.<id>: base_url, wire_api,
    env_key, request_max_retries, stream_max_retries, stream_idle_timeout_ms;
    model_context_window and model_instructions_file, which replaces Codex's own instructions
    with a file's text: the CI size's way to shrink the request, at the root)."""
    lines = [f'model = "{model}"', 'model_provider = "course"', "check_for_update_on_startup = false"]
    if instructions_file:
        lines.append(f'model_instructions_file = "{instructions_file}"')
    if context_window:
        lines.append(f"model_context_window = {int(context_window)}")
    lines += ["", "[model_providers.course]", 'name = "course llama-server"', f'base_url = "{base_url.rstrip("/")}/v1"',
              'wire_api = "responses"', 'env_key = "COURSE_API_KEY"']
    for key, value in (("request_max_retries", request_max_retries), ("stream_max_retries", stream_max_retries),
                       ("stream_idle_timeout_ms", stream_idle_timeout_ms)):
        if value is not None:
            lines.append(f"{key} = {int(value)}")
    return "\n".join(lines) + "\n"


def claude_settings(env: dict[str, Any]) -> str:
    """The `env` block of `~/.claude/settings.json` for a learner's own machine."""
    return json.dumps({"env": {k: str(v) for k, v in env.items()}}, indent=2)


def claude_env(url: str, model: str, *, window: int | None = None, first: int | None = None,
               timeout_s: float = 600.0, header_off: bool = True) -> dict[str, Any]:
    """Claude Code's `env` block for a local server, the one source of what `doctor agent` and
    notebook 19 print: a dummy token (without one a fresh install asks for a login), every
    model alias on `model` (subagents ask for sonnet or opus), the request timeout, no
    nonessential traffic, the billing header off where `header_off`, and with `window` the
    window (`CLAUDE_WINDOW_ENV`) and an answer cap sized with it and the agent's `first`
    request (`claude_budget`: the three set apart put the compaction line on the first request).

    Args:
        url: the server's root; model: the name it serves.
        window: the slot's window, or None to leave the agent's own assumption.
        first: the agent's first request in tokens (a capture's, or `data/agent_shapes.json`'s).
        timeout_s: API_TIMEOUT_MS in seconds.
        header_off: drop the per-task billing header (the prefix cache then survives a new task).
    """
    env: dict[str, Any] = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_AUTH_TOKEN": DUMMY_KEY, "ANTHROPIC_MODEL": model,
                           **{f"ANTHROPIC_DEFAULT_{a}_MODEL": model for a in ("HAIKU", "SONNET", "OPUS")},
                           "API_TIMEOUT_MS": int(timeout_s * 1000), "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC":
                           QUIET_ENV["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"]}
    if header_off:
        env.update(HEADER_OFF)
    if window:
        env[CLAUDE_WINDOW_ENV] = window
        if first is not None:
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = claude_budget(int(first), window)["answer_cap"]
    return env


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["install"]:
        try:
            print(install())
        except AgentLayerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    if args[:1] == ["status"]:
        for a in AGENTS:
            print(f"{a}: {missing_reason(a) or f'{version(a)} at {binary(a)}'}")
        return 0
    print("usage: python -m infercourse.ops.agents install|status", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""Any coding agent, by configuration: a command line and the environment it reads, run sealed.

Claude Code and Codex have their own launchers in `ops.agents`. Every other agent (the one a
learner brings, most of which speak OpenAI chat completions to any base URL) is described by
a **spec**, plain JSON, and run by the same lab the same way: inside the loopback-only
namespace, with a throwaway `HOME`, a dummy key, and the recording proxy as its only route.
Nothing in the lab knows any one agent: a spec is all it needs.

    {"name": "qwen-code",
     "package": "@qwen-code/qwen-code", "bin": "qwen",     # pinned in tools/agents' lock; or
     "command": "mycli",                                   # a program you installed (path, or on PATH)
     "api": "openai-chat",
     "argv": ["{bin}", "{task}", "--auth-type", "openai"],
     "env": {"OPENAI_BASE_URL": "{base_url}/v1", "OPENAI_API_KEY": "{api_key}", "OPENAI_MODEL": "{model}"},
     "files": {".qwen/settings.json": {"telemetry": {"enabled": false}}},   # written into HOME
     "sizes": {"ci": {...}}, "variants": {"name": {...}},  # overlays: argv appended, env and files merged
     "settings": {"file": ..., "max_tokens": "a.b.c", ...}, # where `doctor agent` puts its fixes
     "timeout_s": 120}                                     # how long the agent waits for a call

Placeholders, filled by the lab: `{bin}` (the installed program), `{python}`, `{base_url}`
(the recording proxy's root: where every call must go), `{model}` (the served name),
`{api_key}` (a dummy), `{task}`, `{home}` and `{work}` (the throwaway home and working folder).

`check_spec` refuses a spec that could send a call anywhere but the proxy, before anything
starts: a literal URL in `argv` or `env` (in `files` only under "$schema"), a base-URL
variable not built on `{base_url}`, a proxy variable, a key other than `{api_key}`, a home
or config folder (the lab sets them), a file outside the home. The namespace makes the
same guarantee in the kernel; the check makes "every call captured" hold too.

Shipped specs live in `tools/agents/specs/` (`spec_names()`): the pinned `qwen-code`, and
`stand-in-chat`, the course's own stand-in, the second agent that proves a spec is enough.
"""
from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from infercourse.core.errors import AgentLayerError
from infercourse.ops import agents
from infercourse.ops.agent_stream import GENERATING_APIS

__all__ = ["SPECS_DIR", "spec_names", "load_spec", "sized", "check_spec", "executable", "missing", "version", "launch",
           "task", "fill", "skip_reason"]

SPECS_DIR = agents.SPEC_DIR / "specs"
PLACEHOLDERS = ("{bin}", "{python}", "{base_url}", "{model}", "{api_key}", "{task}", "{home}", "{work}")
_OWNED = ("HOME", "CODEX_HOME", "XDG_CONFIG_HOME", "CLAUDE_CONFIG_DIR")   # the lab's folders
_API = {"chat": "openai-chat", "responses": "openai-responses", "messages": "anthropic"}


def spec_names() -> list[str]:
    """The specs the course ships (tools/agents/specs/*.json)."""
    return sorted(p.stem for p in SPECS_DIR.glob("*.json"))


def load_spec(name_or_path: str | Path | dict[str, Any]) -> dict[str, Any]:
    """A spec by shipped name ("qwen-code"), from a JSON file, or as a dict; checked."""
    if isinstance(name_or_path, dict):
        spec = copy.deepcopy(name_or_path)
    else:
        path = Path(name_or_path)
        if not path.suffix and (SPECS_DIR / f"{path}.json").is_file():
            path = SPECS_DIR / f"{path}.json"
        if not path.is_file():
            raise AgentLayerError(f"no agent spec {str(name_or_path)!r}: a JSON file, or one of {', '.join(spec_names())}")
        spec = json.loads(path.read_text())
    spec["api"] = _API.get(spec.get("api", "chat"), spec.get("api", "chat"))
    check_spec(spec)
    return spec


def _merge(a: Any, b: Any) -> Any:
    """`b` over `a`: dicts merged key by key, anything else replaced."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {**a, **{k: _merge(a.get(k), v) for k, v in b.items()}}
    return copy.deepcopy(b)


def sized(spec: dict[str, Any], size: str = "full", *variants: str) -> dict[str, Any]:
    """The spec with its `sizes[size]` overlay and then each named variant's: argv appended,
    env and files merged ("full" has none: the agent as it ships)."""
    out = copy.deepcopy(spec)
    overlays = [spec.get("sizes", {}).get(size, {}) if size != "full" else {}]
    for v in variants:
        if v not in spec.get("variants", {}):
            raise AgentLayerError(f"{spec['name']} has no variant {v!r}; one of {sorted(spec.get('variants', {}))}")
        overlays.append(spec["variants"][v])
    for o in overlays:
        out["argv"] = out["argv"] + list(o.get("argv", []))
        out["env"] = {**out.get("env", {}), **o.get("env", {})}
        out["files"] = _merge(out.get("files", {}), o.get("files", {}))
    out["label"] = "+".join([spec["name"], *([size] if size != "full" else []), *variants])
    return out


def _strings(node: Any, key: str = ""):
    """Every string in a spec's files, with the key it sits under."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, k)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v, key)
    elif isinstance(node, str):
        yield key, node


def check_spec(spec: dict[str, Any]) -> None:
    """Refuse (AgentLayerError, agent layer) a spec that could move a call off the recording
    proxy or into the user's own folders (the module docstring's list); a missing field."""
    name = spec.get("name") or "?"
    bad = [f for f in ("name", "argv") if not spec.get(f)]
    if bad:
        raise AgentLayerError(f"agent spec {name!r} lacks {', '.join(bad)}")
    if spec["api"] not in GENERATING_APIS:
        raise AgentLayerError(f"agent spec {name!r}: api {spec['api']!r}; one of chat, responses, messages")
    why = []
    for v in [*spec["argv"], *spec.get("env", {}).values()]:
        if "://" in str(v):
            why.append(f"a literal URL ({str(v)[:60]}): use {{base_url}}")
    for k, v in spec.get("env", {}).items():
        up = k.upper()
        if up in _OWNED or up.endswith("_PROXY"):
            why.append(f"{k}: the lab sets homes, and no proxy variable may route around the recorder")
        elif up in agents.LAB_ENV or up.endswith(("_API_KEY", "_AUTH_TOKEN")):
            if v != "{api_key}":
                why.append(f"{k} must be {{api_key}} (a dummy key; a real one is never sent)")
        elif up.endswith(("_BASE_URL", "_API_BASE", "_ENDPOINT")) and not str(v).startswith("{base_url}"):
            why.append(f"{k} must start with {{base_url}} (the recording proxy)")
    for rel, content in spec.get("files", {}).items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            why.append(f"file {rel!r}: only paths inside the throwaway home")
        why += [f"file {rel!r}: a literal URL under {k!r}" for k, s in _strings(content) if "://" in s and k != "$schema"]
    if why:
        raise AgentLayerError(f"agent spec {name!r} refused: " + "; ".join(why),
                              hint="every call goes to {base_url}, the recording proxy, with {api_key}")


def executable(spec: dict[str, Any]) -> str | None:
    """The program `{bin}` stands for: the pinned package's (tools/agents' lock, installed by
    `make agents`), or `command` (a path, or a name on PATH); None where there is none."""
    if spec.get("package"):
        exe = agents.agents_dir() / "node_modules" / ".bin" / spec.get("bin", spec["name"])
        return str(exe) if exe.exists() else None
    cmd = spec.get("command")
    return None if not cmd else (cmd if Path(cmd).is_absolute() and Path(cmd).exists() else shutil.which(cmd))


def version(spec: dict[str, Any]) -> str:
    """The installed package's version, or the command's path (what the manifest records)."""
    if spec.get("package"):
        f = agents.agents_dir() / "node_modules" / spec["package"] / "package.json"
        return json.loads(f.read_text())["version"] if f.is_file() else "not installed"
    return executable(spec) or ("python -m " + spec["argv"][2] if spec["argv"][:2] == ["{python}", "-m"] else "?")


def missing(spec: dict[str, Any]) -> str | None:
    """None when the spec's program is here (at the lock's pin, for a package), else why."""
    if "{bin}" not in spec["argv"]:
        return None
    if spec.get("package") and spec["package"] not in agents.pinned_packages():
        return f"{spec['name']}: {spec['package']} is not in tools/agents' lock; install it yourself and give \"command\""
    if executable(spec) is None:
        return (agents.missing_reason(spec["name"]) if spec["name"] in agents.AGENTS else
                f"{spec['name']}: command {spec.get('command')!r} not found")
    if spec.get("package"):
        return agents.missing_reason(spec["name"]) if spec["name"] in agents.AGENTS else None
    return None


def fill(value: Any, values: dict[str, str]) -> Any:
    """`value` with every placeholder replaced (in every string of a dict or list)."""
    if isinstance(value, dict):
        return {k: fill(v, values) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, values) for v in value]
    if isinstance(value, str):
        for k, v in values.items():
            value = value.replace(k, v)
    return value


def launch(spec: dict[str, Any], prompt: str, home: Path, work: Path, base_url: str, model: str,
           extra_env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and whole environment of one run of `spec`, its files written into `home`.

    Args:
        spec: a checked spec (`load_spec`, `sized`).
        prompt: the task; home, work: the throwaway home and working folder.
        base_url: the recording proxy's root; model: the served model's name.
        extra_env: the task's own environment (checked by `agents.check_env`).
    """
    check_spec(spec)
    why = missing(spec)
    if why:
        raise AgentLayerError(why)
    values = {"{bin}": executable(spec) or "", "{python}": sys.executable, "{base_url}": base_url.rstrip("/"),
              "{model}": model, "{api_key}": agents.DUMMY_KEY, "{task}": prompt, "{home}": str(home), "{work}": str(work)}
    for rel, content in spec.get("files", {}).items():
        path = home / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        text = fill(content, values)
        path.write_text(text if isinstance(text, str) else json.dumps(text, indent=1))
    env = agents.sealed_env(home, extra_env, route=fill(spec.get("env", {}), values))
    return fill(list(spec["argv"]), values), env


def task(label: str, prompt: str, spec: str | dict[str, Any], size: str = "full", *variants: str,
         env: dict[str, str] | None = None, timeout_s: float = 900) -> "Any":
    """A lab `Task` that runs `spec` (a name, a file or a dict) at `size` with `variants`."""
    from infercourse.ops.agent_lab import Task
    s = sized(load_spec(spec), size, *variants)
    return Task(label, s["name"], prompt, env=dict(env or {}), timeout_s=timeout_s, spec=s)


def skip_reason(spec: str | dict[str, Any]) -> str | None:
    """None when `spec` can run sealed here, else why not (no namespace, or its program missing)."""
    from infercourse.ops import netns
    if not netns.available():
        return f"no loopback-only network namespace here ({netns.why_not()}): a real agent is not run"
    try:
        return missing(load_spec(spec))
    except AgentLayerError as e:
        return str(e)

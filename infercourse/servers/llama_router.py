"""llama-server's router mode: one front process that serves several models, chosen by name.

A coding agent sends its calls under more than one model name: Claude Code sends the main
loop under a Sonnet ID and its background and small/fast calls under a Haiku ID
(`ANTHROPIC_DEFAULT_HAIKU_MODEL`). A server that does not know a name fails those calls
(llama-server answers HTTP 400 "model 'X' not found"). llama-server started **without
`-m`** is a router: it reads a preset file (an INI, one section per model), starts one
child llama-server per model on a free port of 127.0.0.1 when a request names it, and
forwards each POST by its body's `model` field (GET endpoints by `?model=`):

    [*]                       ; flags every child gets (a section below overrides them)
    threads = 1
    [fast]
    model = /path/SmolLM2.Q4_K_M.gguf
    alias = claude-haiku-4-5,fast-model
    load-on-startup = true

- `--models-max N` caps how many children run at once; loading one more unloads the
  least recently used (LRU). At N = 1 two models that alternate swap on every switch:
  each switch pays a model load, the cost Ollama users meet as `OLLAMA_KEEP_ALIVE` stalls.
- `--sleep-idle-seconds S` (a child flag, so in `[*]`) frees a model's weights and KV cache
  after S idle seconds; the next request wakes it and pays the reload.
- `GET /models` lists every preset with its status (unloaded / loading / loaded /
  sleeping) and, for a child that died, `failed` and its `exit_code`; `POST /models/load`
  and `/models/unload` load and unload by hand. The next request for a dead child's model
  starts a fresh one (autoload), so a killed instance costs its in-flight requests and one
  reload.

Flags given on the router's command line override the preset file, so everything a model
may change (threads, context, slots, idle sleep) goes in `[*]` here, and the command line
keeps only what the router itself reads. `LLAMA_CACHE` points at an empty folder so the
router lists our presets only, not models some other tool downloaded.

Combining with the replicas of notebook 16: the router only forwards to the children it
spawned from its presets (no external upstream), so model routing cannot sit *in front of*
a replica group. The other order works (`servers.router.RouterReplicas`).

`course_router` is the course's two models (`course_presets`) at the small sizes its
lessons run (`ROUTER_DEFAULTS`: one thread, a 1,024-token context, one slot per child).
"""
from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import httpx
import psutil

from infercourse.core.errors import ModelLayerError, ServerLayerError
from infercourse.servers.llama import _gguf, llama_server_binary
from infercourse.servers.process import Server

__all__ = ["Preset", "LlamaRouter", "course_presets", "course_router", "preset_ini", "MAIN_ALIASES",
           "FAST_ALIASES", "ROUTER_DEFAULTS", "load_times"]

# The names Claude Code sends (its main model, and ANTHROPIC_DEFAULT_HAIKU_MODEL's default)
MAIN_ALIASES = ("claude-sonnet-4-6", "main-model")
FAST_ALIASES = ("claude-haiku-4-5", "fast-model")
_SPAWN = re.compile(r"spawning server instance with name=(\S+) on port (\d+)")
# a child's own log line, prefixed by its port: "[PORT] M.SS.mmm.uuu ... model loaded"
_LOADED = re.compile(r"^\[(\d+)\]\s+(\d+)\.(\d+)\.(\d+)\.(\d+)\s.*\bmodel loaded\b")
ROUTER_DEFAULTS = {"threads": 1, "ctx_size": 1024, "n_parallel": 1}   # the lessons' children
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")   # safe as an INI section and an alias


@dataclass(frozen=True)
class Preset:
    """One model the router may serve.

    Args:
        name: the model's name in requests and in `/models`.
        model: its .gguf file (None: the embedded model).
        aliases: further names that route to it (e.g. a Claude model ID).
        load_on_startup: load it when the router starts (else on its first request).
        flags: per-model llama-server flags, long names without dashes, e.g.
            {"ctx-size": 4096, "parallel": 2}; they override the router's `[*]` flags.
    """

    name: str
    model: Any = None
    aliases: tuple[str, ...] = ()
    load_on_startup: bool = False
    flags: Mapping[str, Any] = field(default_factory=dict)


def course_presets(*, load_on_startup: bool = False, flags: Mapping[str, Any] | None = None) -> list[Preset]:
    """The course's two models under Claude Code's names: `main` = the derived F16 GGUF
    (aliases MAIN_ALIASES), `fast` = the derived Q4_K_M (FAST_ALIASES). Derives them on
    first use (`make install` already did)."""
    from infercourse.models.formats import f16_gguf, quantized_gguf
    return [Preset("main", f16_gguf(), MAIN_ALIASES, load_on_startup, dict(flags or {})),
            Preset("fast", quantized_gguf("Q4_K_M"), FAST_ALIASES, load_on_startup, dict(flags or {}))]


def _value(v: Any) -> str:
    s = ("true" if v else "false") if isinstance(v, bool) else str(v)
    if "\n" in s or "\r" in s:
        raise ValueError(f"preset value {s!r} spans lines")
    return s


def preset_ini(presets: Sequence[Preset], global_flags: Mapping[str, Any] | None = None) -> str:
    """The `--models-preset` file for `presets`: `[*]` holds `global_flags`, one section
    per model its file, aliases, `load-on-startup` and own flags. Names are checked here
    (unique, no alias shared), so a clash fails before the router starts."""
    seen: set[str] = set()
    for p in presets:
        for n in (p.name, *p.aliases):
            if not _NAME.match(n):
                raise ValueError(f"model name {n!r}: use letters, digits and . _ : / -")
            if n in seen:
                raise ValueError(f"model name {n!r} is given twice (names and aliases must be unique)")
            seen.add(n)
    lines = ["version = 1", "", "[*]", *(f"{k} = {_value(v)}" for k, v in (global_flags or {}).items())]
    for p in presets:
        lines += ["", f"[{p.name}]", f"model = {_gguf(p.model)}"]
        lines += [f"alias = {','.join(p.aliases)}"] if p.aliases else []
        lines += ["load-on-startup = true"] if p.load_on_startup else []
        lines += [f"{k} = {_value(v)}" for k, v in p.flags.items()]
    return "\n".join(lines) + "\n"


class LlamaRouter(Server):
    """llama-server in router mode, supervised like every server here.

    Args:
        presets: the models (`Preset`s, or a {name: gguf path} dict).
        models_max: children loaded at once (LRU eviction past it; 0: unlimited).
        threads, ctx_size, n_parallel: every child's `-t`, `-c`, `-np` (a preset's flags win).
        sleep_idle_s: children free their model after this many idle seconds (None: never).
        autoload: load a model on its first request (False: only `load()` does).
        stop_timeout_s: grace a child gets to exit on unload before it is killed.
        flags: further `[*]` flags for every child; extra_args: further router flags.
    """

    name = "llama-router"
    api_key_flag, api_key_env = "--api-key", "LLAMA_API_KEY"

    def __init__(self, presets: Sequence[Preset] | Mapping[str, Any], *, models_max: int = 1,
                 threads: int | None = 1, ctx_size: int = 2048, n_parallel: int = 1,
                 sleep_idle_s: int | None = None, autoload: bool = True, stop_timeout_s: int = 5,
                 flags: Mapping[str, Any] | None = None, extra_args: Sequence[str] = (), **kw: Any):
        if isinstance(presets, Mapping):
            presets = [Preset(n, m) for n, m in presets.items()]
        self.presets = [p if p.flags.get("stop-timeout") else
                        Preset(p.name, p.model, p.aliases, p.load_on_startup, {"stop-timeout": stop_timeout_s, **p.flags})
                        for p in presets]
        if not self.presets:
            raise ServerLayerError("a router needs at least one model preset")
        if sleep_idle_s is not None and sleep_idle_s < 1:
            raise ValueError("sleep_idle_s must be >= 1 second (or None: never)")
        self.binary, self.models_max, self.autoload = llama_server_binary(), models_max, autoload
        self.global_flags = {"ctx-size": ctx_size, "parallel": n_parallel, "metrics": True,
                             **({"threads": threads} if threads else {}),
                             **({"sleep-idle-seconds": sleep_idle_s} if sleep_idle_s else {}), **(flags or {})}
        self.ini = preset_ini(self.presets, self.global_flags)   # checks names before anything starts
        self.extra_args = list(extra_args)
        super().__init__(**kw)
        self.preset_path = self.log_path.with_suffix(".ini")
        self.empty_cache = self.log_path.parent / "llama-router-empty-cache"
        self.env.setdefault("LLAMA_CACHE", str(self.empty_cache))

    def argv(self) -> list[str]:
        argv = [self.binary, "--models-preset", self.preset_path, "--models-max", self.models_max,
                "--models-autoload" if self.autoload else "--no-models-autoload", *self.listen_args()]
        return [str(a) for a in argv + self.extra_args]

    def start(self) -> "LlamaRouter":
        if self.running:
            return self
        self.preset_path.parent.mkdir(parents=True, exist_ok=True)
        self.preset_path.write_text(self.ini)
        self.empty_cache.mkdir(parents=True, exist_ok=True)
        super().start()
        try:   # healthy means the router answers; a load-on-startup model is part of "ready"
            for p in self.presets:
                if p.load_on_startup:
                    self.wait_status(p.name, ("loaded",), before={"failed": False, "port": None})
        except BaseException:
            self.stop()
            raise
        return self

    # -- what the router knows -----------------------------------------------------------
    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            return httpx.request(method, self.url + path, headers=auth, timeout=kw.pop("timeout", 30.0), **kw)
        except httpx.HTTPError as e:
            raise ServerLayerError(f"{self.name} at {self.url} not answering ({type(e).__name__}). "
                                   f"Last lines of {self.log_path}:\n{self.log_tail()}",
                                   hint="the router died or hangs: the reason is in its log") from None

    def models(self) -> list[dict[str, Any]]:
        """Every preset as `GET /models` reports it: name, aliases, status, and for a running
        child its port, pid and resident memory; a child that died has failed=True and its
        exit_code (1 when a signal killed it: llama.cpp's subprocess reports no signal)."""
        body = self._call("GET", "/models").json()
        kids = self._children()
        out = []
        for m in body.get("data", []):
            st, args = m.get("status") or {}, (m.get("status") or {}).get("args") or []
            port = int(args[args.index("--port") + 1]) if "--port" in args else None
            pid = kids.get(port) if st.get("value") in ("loading", "loaded", "sleeping") else None
            out.append({"name": m["id"], "aliases": list(m.get("aliases") or []), "status": st.get("value"),
                        "failed": bool(st.get("failed")), "exit_code": st.get("exit_code"),
                        "port": port, "pid": pid, "rss_bytes": _rss(pid)})
        return out

    def _children(self) -> dict[int, int]:
        """port -> pid of the router's child llama-servers (from their command lines)."""
        out: dict[int, int] = {}
        try:
            for c in psutil.Process(self.pid).children() if self.pid else []:
                cmd = c.cmdline()
                if "--port" in cmd:
                    out[int(cmd[cmd.index("--port") + 1])] = c.pid
        except (psutil.Error, ValueError, IndexError):
            pass
        return out

    def model_status(self, name: str) -> dict[str, Any]:
        """One model's row of `models()`, looked up by name or alias."""
        for m in self.models():
            if name == m["name"] or name in m["aliases"]:
                return m
        raise ModelLayerError(f"{self.name} has no model or alias {name!r}",
                              hint=f"known: {', '.join(p.name for p in self.presets)}")

    def wait_status(self, name: str, want: Iterable[str], timeout_s: float | None = None, *,
                    before: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Wait until `name`'s status is one of `want`; a child that fails while we wait, or
        the router dying, raises at once (the deadline is only a safety net).

        Args:
            before: `name`'s row from before the action waited on (default: now); a failure
                it already showed is an old one, unless a new instance (port) failed since.
        """
        want, deadline = tuple(want), time.monotonic() + (timeout_s or self.startup_timeout_s)
        before = before or self.model_status(name)
        seen_loading = False
        while True:
            if not self.running:
                raise ServerLayerError(f"{self.name} died while waiting for {name!r}. Last lines of "
                                       f"{self.log_path}:\n{self.log_tail()}")
            m = self.model_status(name)
            if m["status"] in want:
                return m
            seen_loading |= m["status"] == "loading"
            new = seen_loading or not before["failed"] or m["port"] != before["port"]
            if m["failed"] and new and "unloaded" not in want:
                raise ModelLayerError(f"model {name!r} failed to load in {self.name} (exit code "
                                      f"{m['exit_code']}). Last lines of {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ServerLayerError(f"model {name!r} still {m['status']} after {timeout_s or self.startup_timeout_s:.0f}s "
                                       f"(wanted {'/'.join(want)})", hint=f"read {self.log_path}")
            time.sleep(0.1)

    def load(self, name: str) -> dict[str, Any]:
        """Load `name` now (`POST /models/load`) and wait until it is loaded."""
        before = self.model_status(name)
        self._call("POST", "/models/load", json={"model": before["name"]})
        return self.wait_status(name, ("loaded",), before=before)

    def unload(self, name: str) -> dict[str, Any]:
        """Unload `name` (`POST /models/unload`) and wait until its child has exited."""
        self._call("POST", "/models/unload", json={"model": self.model_status(name)["name"]})
        return self.wait_status(name, ("unloaded",))

    def kill_instance(self, name: str, sig: int = signal.SIGKILL) -> int:
        """The crash drill: send `sig` (SIGKILL, as the OOM killer does) to `name`'s child
        llama-server; returns its pid. The router stays up; `check()` then names it."""
        m = self.model_status(name)
        if not m["pid"]:
            raise ServerLayerError(f"model {name!r} has no running instance (status {m['status']})")
        os.kill(m["pid"], sig)
        return m["pid"]

    def dead_instances(self) -> list[dict[str, Any]]:
        """Instances that exited on their own (crashed, killed, failed to load)."""
        return [m for m in self.models() if m["failed"]]

    def check(self) -> None:
        """Raise ServerLayerError if the router is down or an instance died, naming which."""
        if not self.running:
            raise ServerLayerError(f"{self.name} at {self.url} is not running. Last lines of "
                                   f"{self.log_path}:\n{self.log_tail()}")
        dead = self.dead_instances()
        if dead:
            who = ", ".join(f"{m['name']} (exit code {m['exit_code']})" for m in dead)
            raise ServerLayerError(f"{self.name} at {self.url}: instance(s) died: {who}; the router is up "
                                   "and reloads a dead model on its next request", hint=f"read {self.log_path}")

    def memory(self) -> dict[str, int | None]:
        """Resident memory in bytes: the router itself, and each loaded model's child."""
        return {"router": _rss(self.pid), **{m["name"]: m["rss_bytes"] for m in self.models() if m["pid"]}}

    def engine(self, **kw: Any):
        """A client on the router for one model (model= a name or alias; api="anthropic"
        gives the Messages API engine, else OpenAIHTTPEngine with api= chat / completions)."""
        kw.setdefault("api_key", self.api_key)
        model = kw.pop("model", self.presets[0].name)
        if kw.get("api") == "anthropic":
            from infercourse.engines.anthropic_http import AnthropicHTTPEngine
            kw.pop("api")
            return AnthropicHTTPEngine(self.url, model=model, **kw)
        from infercourse.engines.openai_http import OpenAIHTTPEngine
        return OpenAIHTTPEngine(self.url, model=model, **kw)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mode": "router", "models_max": self.models_max, "autoload": self.autoload,
                "global_flags": self.global_flags, "preset_path": str(self.preset_path),
                "presets": [{"name": p.name, "model": str(_gguf(p.model)), "aliases": list(p.aliases),
                             "load_on_startup": p.load_on_startup, "flags": dict(p.flags)} for p in self.presets]}


def _rss(pid: int | None) -> int | None:
    try:
        return psutil.Process(pid).memory_info().rss if pid else None
    except psutil.Error:
        return None


def course_router(models_max: int, presets: Sequence[Preset] | None = None, **kw: Any) -> LlamaRouter:
    """A LlamaRouter over `presets` (None: `course_presets()`) at `ROUTER_DEFAULTS`, which
    `kw` (threads, ctx_size, sleep_idle_s...) overrides; not started."""
    return LlamaRouter(presets if presets is not None else course_presets(), models_max=models_max,
                       **{**ROUTER_DEFAULTS, **kw})


def load_times(log_text: str) -> pd.DataFrame:
    """Every model load in a router's log: the model, its child's port, and the child's own
    clock when it logged "model loaded" (seconds from its start: process start, reading the
    weights, allocating the KV cache, warm-up)."""
    import pandas as pd
    port_model, rows = {}, []
    for line in log_text.splitlines():
        if s := _SPAWN.search(line):
            port_model[s.group(2)] = s.group(1)   # ports are reused: the latest spawn owns it
        elif m := _LOADED.match(line):
            mi, se, ms, us = (int(g) for g in m.groups()[1:])
            rows.append({"model": port_model.get(m.group(1)), "port": int(m.group(1)),
                         "loaded_s": mi * 60 + se + ms / 1e3 + us / 1e6})
    return pd.DataFrame(rows, columns=["model", "port", "loaded_s"])

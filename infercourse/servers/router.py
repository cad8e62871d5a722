"""Replicas behind a real router: R llama-servers on loopback and one router in front.

One box serves so many sessions; more need more replicas, and a router decides which
replica gets each request. The policy matters because of the prefix cache: round-robin
sends a session's next turn to whichever replica is next, which has never seen that
session's prefix, so every turn is a full prefill; a cache-aware policy sends it back to
the replica that holds its prefix.

We use an existing router and do not write one. Both Rust routers on PyPI were tried in
front of llama-server replicas (sglang-router 0.3.2, vllm-router 0.1.17; ~31 and ~24 MB
wheels, pure-Python deps fastapi/uvicorn/aiohttp/orjson):
- **sglang-router** (`python -m sglang_router.launch_router`) accepts any OpenAI-compatible
  worker with a `/health`: it asks `/server_info` and `/model_info` (404 on llama-server),
  falls back and registers the worker with model "unknown". Policies `round_robin`,
  `random`, `power_of_two`, `cache_aware` (an approximate radix tree of request text per
  worker: a session's turns return to the replica that holds its prefix) and `manual`
  (affinity on the `x-smg-routing-key` header). It retries a failed request on another
  worker (`--retry-max-retries`) and trips a per-worker circuit breaker. It is the default.
  Its multi-model mode (`--enable-igw`) panics offline (it downloads a tokenizer vocab at
  start), and in the regular mode it does not route by model name.
- **vllm-router** (`python -m vllm_router.launch_router`) accepts them too; it adds
  `consistent_hash` (on a session id) and `kv_aware`. Kept as the second choice. It does not
  route by model name either: two workers serving models "A" and "B" got requests for
  "A" and "B" alternately under round-robin, and its /v1/models listed only "A".
Both start a Prometheus exporter on a fixed port unless told otherwise, on 0.0.0.0 for
sglang-router: `Router` gives it a free port on 127.0.0.1.

`ReplicaGroup` starts the replicas and the router as one unit and stops them together
(`with ReplicaGroup(...) as g: g.url`); `infercourse serve llama --replicas R` runs one.
`RouterReplicas` does the same with llama-server routers (several models each) as replicas.
"""
from __future__ import annotations

import importlib.util
import sys
from typing import Any, Sequence

from infercourse.core.errors import BackendMissingError, ServerLayerError
from infercourse.servers.llama import LlamaServer
from infercourse.servers.llama_router import LlamaRouter, Preset
from infercourse.servers.process import HOST, Server, free_port

__all__ = ["ROUTERS", "POLICIES", "AFFINITY_HEADER", "Router", "ReplicaGroup", "RouterReplicas", "router_installed"]

ROUTERS = {"sglang": "sglang_router", "vllm": "vllm_router"}   # kind -> Python module
POLICIES = {
    "sglang": ("round_robin", "random", "power_of_two", "cache_aware", "manual"),
    "vllm": ("round_robin", "random", "power_of_two", "cache_aware", "consistent_hash", "kv_aware",
             "sticky_least_loaded"),
}
AFFINITY_HEADER = {"sglang": "x-smg-routing-key"}   # sglang's `manual` policy routes on it


def router_installed(kind: str = "sglang") -> bool:
    """Whether the router's Python package is importable here."""
    return importlib.util.find_spec(ROUTERS[kind]) is not None


class Router(Server):
    """A router process (sglang-router or vllm-router) in front of `workers`.

    Args:
        workers: the replicas' URLs (http://127.0.0.1:PORT).
        kind: "sglang" (default) or "vllm".
        policy: one of POLICIES[kind]; "cache_aware" keeps a session on the replica
            holding its prefix, "round_robin" ignores the cache.
        retries: retries of a failed request on another worker (0: surface the error).
        extra_args: further router flags.
    """

    health_path = "/health"
    startup_timeout_s = 60.0

    def __init__(self, workers: Sequence[str], kind: str = "sglang", policy: str = "cache_aware", *,
                 retries: int = 3, extra_args: Sequence[str] = (), **kw: Any):
        if kind not in ROUTERS:
            raise ValueError(f"unknown router {kind!r}; choose from {', '.join(ROUTERS)}")
        if policy not in POLICIES[kind]:
            raise ValueError(f"{kind}-router has no policy {policy!r}; choose from {', '.join(POLICIES[kind])}")
        if not router_installed(kind):
            raise BackendMissingError(f"{kind}-router is not installed (server layer)",
                                      hint="pip install 'infercourse[router]'")
        if not workers:
            raise ServerLayerError("a router needs at least one worker URL")
        self.name = f"{kind}-router"
        self.kind, self.policy, self.workers, self.retries = kind, policy, list(workers), retries
        self.extra_args = list(extra_args)
        super().__init__(**kw)

    def argv(self) -> list[str]:
        self.prometheus_port = free_port()   # its exporter (retries, error answers), this start's
        argv = [sys.executable, "-m", f"{ROUTERS[self.kind]}.launch_router", "--host", HOST,
                "--port", self.port, "--worker-urls", *self.workers, "--policy", self.policy,
                "--prometheus-host", HOST, "--prometheus-port", self.prometheus_port, "--log-level", "warn",
                "--health-check-interval-secs", 1, "--worker-startup-check-interval", 1]
        argv += ["--disable-retries"] if not self.retries else ["--retry-max-retries", self.retries]
        return [str(a) for a in argv + self.extra_args]


class ReplicaGroup:
    """R llama-server replicas and a router in front, started and stopped as one.

    Args:
        replicas: how many llama-servers (each on its own free port on 127.0.0.1).
        policy: the router's policy (see `Router`).
        kind: "sglang" or "vllm".
        model: the GGUF every replica serves (None: the embedded model); `models` gives one
            per replica instead (model pools).
        threads: CPU threads per replica. On a small machine replicas share the cores:
            R replicas of t threads each want R x t cores.
        router_args: further router flags; **server_kw: passed to every LlamaServer
            (n_parallel, ctx_size, cache_ram_mib, extra_args...).
    """

    def __init__(self, replicas: int = 2, policy: str = "cache_aware", *, kind: str = "sglang",
                 model: Any = None, models: Sequence[Any] | None = None, threads: int | None = None,
                 retries: int = 3, router_args: Sequence[str] = (), **server_kw: Any):
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        models = list(models) if models is not None else [model] * replicas
        self.replicas = [LlamaServer(m, threads=threads, **server_kw) for m in models]
        self.router = Router([s.url for s in self.replicas], kind, policy, retries=retries,
                             extra_args=router_args)

    # What `infercourse serve` prints and watches: the router is the group's face.
    host, api_key = HOST, None

    @property
    def name(self) -> str:
        return f"{len(self.replicas)} x llama-server behind {self.router.name} ({self.router.policy})"

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def base_url(self) -> str:
        return self.router.base_url

    @property
    def port(self) -> int:
        return self.router.port

    @property
    def pid(self) -> int | None:
        return self.router.pid

    @property
    def log_path(self):
        return self.router.log_path

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(f"== {s.name} {s.url}\n{s.log_tail(n)}" for s in [self.router, *self.replicas])

    @property
    def running(self) -> bool:
        """All up: one replica down counts as the group down (serve stops them all)."""
        return self.router.running and all(s.running for s in self.replicas)

    def engine(self, **kw: Any):
        """An OpenAIHTTPEngine on the router (model name: the first replica's file)."""
        from infercourse.engines.openai_http import OpenAIHTTPEngine
        return OpenAIHTTPEngine(self.url, model=kw.pop("model", "default"), **kw)

    def start(self) -> "ReplicaGroup":
        try:
            for s in self.replicas:
                s.start()
            self.router.start()
        except BaseException:
            try:
                self.stop()     # a partial start: stop what did start, even on Ctrl-C
            except BaseException:  # noqa: BLE001 - the start's own error is the one to report
                pass
            raise
        return self

    def set_policy(self, policy: str) -> None:
        """Restart only the router with another policy; the replicas (and their caches) stay."""
        if policy == self.router.policy:
            return
        was = self.router.running
        self.router.stop()
        self.router = Router([s.url for s in self.replicas], self.router.kind, policy,
                             retries=self.router.retries, extra_args=self.router.extra_args)
        if was:
            self.router.start()

    def stop(self) -> None:
        """Router first (no new requests), then every replica; each stop is attempted.

        A second Ctrl-C while the group stops (KeyboardInterrupt is a BaseException, not an
        Exception) must not leave the remaining replicas running: every child is stopped,
        then the first interruption or error is raised again.
        """
        first: BaseException | None = None
        for s in [self.router, *self.replicas]:
            try:
                s.stop()
            except BaseException as e:  # noqa: BLE001 - one failed stop must not leave the others running
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> "ReplicaGroup":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def describe(self) -> dict[str, Any]:
        return {"router": self.router.name, "policy": self.router.policy, "retries": self.router.retries,
                "replicas": [{"url": s.url, "n_parallel": s.n_parallel, "ctx_size": s.ctx_size,
                              "model": str(s.model_path)} for s in self.replicas]}


class RouterReplicas:
    """R LlamaRouters (every model on each) behind one sglang/vllm router, as one unit.

    A llama-server router forwards only to the children it spawned, so model routing cannot
    sit in front of replicas; this is the other order. sglang-router forwards the body (its
    `model` field included) unchanged (tried: round-robin over two routers served Haiku and
    Sonnet names, and an unknown name got the replica router's 400). Its policies ignore the
    model, so each replica loads every model it is sent: R x the memory, or swaps at
    models_max 1.

    Args:
        presets: the models every replica serves; replicas: R.
        policy, kind: the front router's (see `servers.router.Router`).
        **router_kw: passed to every LlamaRouter (models_max, threads...).
    """

    def __init__(self, presets: Sequence[Preset], replicas: int = 2, *, policy: str = "round_robin",
                 kind: str = "sglang", **router_kw: Any):
        self.replicas = [LlamaRouter(presets, **router_kw) for _ in range(replicas)]
        self.front = Router([r.url for r in self.replicas], kind, policy)

    @property
    def url(self) -> str:
        return self.front.url

    def engine(self, model: str | None = None, **kw: Any):
        """An OpenAIHTTPEngine on the front router for `model` (default: the first preset)."""
        from infercourse.engines.openai_http import OpenAIHTTPEngine
        return OpenAIHTTPEngine(self.url, model=model or self.replicas[0].presets[0].name, **kw)

    def start(self) -> "RouterReplicas":
        try:
            for s in [*self.replicas, self.front]:
                s.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Front first (no new requests), then every replica; each stop is attempted."""
        for s in [self.front, *self.replicas]:
            try:
                s.stop()
            except Exception:  # noqa: BLE001 - one failed stop must not leave the others running
                pass

    def __enter__(self) -> "RouterReplicas":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

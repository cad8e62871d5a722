"""`infercourse serve`: one inference server in the foreground, for a workshop or your own tools.

It is the same `servers.LlamaServer` / `MLXServer` / `VLLMServer` the notebooks start, on
127.0.0.1, with its log in a file and the watchdog behind it, but held open until you
stop it: it prints the URL to point a client at (`OpenAIHTTPEngine(url)`, `curl`, an
agent framework, `infercourse bench --engine http --url ...`), then waits. Ctrl-C or
SIGTERM stops it, and so does the server dying on its own (the exit code says which).

    infercourse serve llama --parallel 4 --ctx 8192 --threads 2
    infercourse serve llama --model ~/models/qwen2.5-7b-q4_k_m.gguf --ngl -1 -- --flash-attn on
    infercourse serve mlx --model ~/.cache/infercourse/.../mlx
    infercourse serve vllm --model ./hf-folder --ctx 4096

Anything after `--` goes to the server unchanged.

A workshop's shared server listens beyond loopback, and then it must check a key:

    INFERCOURSE_API_KEY="$ROOM_KEY" infercourse serve llama --host 0.0.0.0 --parallel 8
    infercourse serve llama --host 0.0.0.0 --api-key-file ~/.room-key --parallel 8

`--host` other than 127.0.0.1 is refused without a key. The key comes from $INFERCOURSE_API_KEY
or a file, never from serve's command line, which `ps` shows to every user of the machine
(`--api-key KEY` is refused for that reason). It goes to the server's own key option, through
the variable the server reads for it, so llama-server and vLLM check it on every request.
Learners pass it the same way: `OpenAIHTTPEngine(url, api_key=...)` in a notebook, and
`bench`, which reads it from `--api-key-file FILE` or $INFERCOURSE_API_KEY and refuses
`--api-key KEY` for the same reason (`KeyFile` reads the file for both).
mlx_lm.server has no such option and is refused as a shared server.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

__all__ = ["serve_parser", "make_server", "serve_main", "KeyFile"]


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infercourse serve", description=(
        "Run one inference server on 127.0.0.1 (a room's shared server: --host with a key) in "
        "the foreground: print its URL, log to a file, stop it on Ctrl-C or SIGTERM. Arguments "
        "after `--` go to the server as they are."))
    p.add_argument("engine", choices=["llama", "mlx", "vllm"],
                   help="llama: llama.cpp's llama-server; mlx: mlx_lm.server; vllm: vLLM's OpenAI server")
    p.add_argument("--model", help="llama: a .gguf (default: the embedded SmolLM2-135M Q4_1); "
                                   "mlx: an MLX folder; vllm: an HF folder (default: the embedded model's)")
    p.add_argument("--port", type=int, help="port to listen on (default: a free one)")
    p.add_argument("--parallel", type=int, default=4, help="llama: slots decoded together (-np, default 4)")
    p.add_argument("--ctx", type=int, default=4096,
                   help="context tokens: llama: total over all slots (-c); vllm: --max-model-len (default 4096)")
    p.add_argument("--threads", type=int, help="llama: CPU threads (-t; default: llama.cpp's choice)")
    p.add_argument("--ngl", type=int, help="llama: layers offloaded to the GPU (-ngl; -1: all)")
    p.add_argument("--cache-ram", type=int, help="llama: host-RAM prompt cache in MiB (0: off)")
    p.add_argument("--startup-timeout", type=float, help="seconds to wait for /health (model load)")
    p.add_argument("--replicas", type=int, default=1,
                   help="llama: R replicas on loopback behind a router, started and stopped together "
                        "(servers.router.ReplicaGroup; needs `pip install 'infercourse[router]'`)")
    p.add_argument("--router", choices=["sglang", "vllm"], default="sglang",
                   help="with --replicas: sglang-router (default) or vllm-router")
    p.add_argument("--policy", default="cache_aware",
                   help="with --replicas: the router's policy (cache_aware, round_robin, power_of_two...)")
    g = p.add_argument_group("a room's shared server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1); a LAN address or 0.0.0.0 needs a key "
                        "($INFERCOURSE_API_KEY or --api-key-file)")
    # The key the server checks on every request (`Authorization: Bearer KEY`): from the
    # environment or a file, never from argv, which `ps` shows to every user of the machine.
    g.add_argument("--api-key-file", metavar="FILE", action=KeyFile, dest="api_key",
                   default=os.environ.get("INFERCOURSE_API_KEY") or None,
                   help="file holding the key the server checks on every request, as `Authorization: "
                        "Bearer KEY` (default: $INFERCOURSE_API_KEY); never written to the log")
    # Kept only to refuse it: without it argparse would take `--api-key K` as an
    # abbreviation of --api-key-file and read a file named K.
    g.add_argument("--api-key", dest="api_key_on_argv", metavar="KEY",
                   help="refused: a key on the command line is visible in `ps`; use $INFERCOURSE_API_KEY "
                        "or --api-key-file")
    return p


class KeyFile(argparse.Action):
    """`--api-key-file FILE` (serve's and bench's): the file's one line becomes the
    argument's `dest`; a file that cannot be read or holds more than one line is a usage error."""

    def __call__(self, parser, namespace, value, option_string=None):
        try:
            key = Path(value).expanduser().read_text().strip()
        except OSError as e:
            parser.error(f"{option_string}: cannot read {value}: {e.strerror or e}")
        if not key or "\n" in key:
            parser.error(f"{option_string}: {value} must hold one key on one line")
        setattr(namespace, self.dest, key)


def _check_sharing(p: argparse.ArgumentParser, a: argparse.Namespace, extra: list[str]) -> None:
    """Refuse, while parsing, a server others could reach that does not check a key."""
    from infercourse.core.loopback import is_loopback
    passed = [f for f in extra if f.split("=")[0] in ("--host", "--api-key", "--api-key-file")]
    if passed:
        p.error(f"give {passed[0].split('=')[0]} to serve itself, not after `--`: serve checks it")
    if getattr(a, "api_key_on_argv", None):
        p.error("--api-key KEY puts the key on serve's command line, visible to every user of this "
                "machine (`ps`): set INFERCOURSE_API_KEY or give --api-key-file FILE")
    if a.engine == "mlx" and (a.api_key or not is_loopback(a.host)):
        p.error("mlx_lm.server cannot check an API key, so it cannot be a shared server: "
                "use `serve llama` or `serve vllm` for the room")
    if getattr(a, "replicas", 1) > 1 and (a.api_key or not is_loopback(a.host)):
        p.error("a replica group's router does not check an API key: share one server (drop --replicas)")
    if not is_loopback(a.host) and not a.api_key:
        p.error(f"--host {a.host} lets anyone who can reach it use the server: set INFERCOURSE_API_KEY "
                "or give --api-key-file FILE")


def make_server(a: argparse.Namespace, extra: list[str]):
    """The `servers.Server` the parsed arguments describe (not started)."""
    kw = {"port": a.port, "startup_timeout_s": a.startup_timeout, "host": a.host, "api_key": a.api_key}
    if a.engine == "llama" and a.replicas > 1:   # the router is what clients see
        from infercourse.servers.router import ReplicaGroup
        return ReplicaGroup(a.replicas, a.policy, kind=a.router, model=a.model, threads=a.threads,
                            n_parallel=a.parallel, ctx_size=a.ctx, cache_ram_mib=a.cache_ram, extra_args=extra)
    if a.engine == "llama":
        from infercourse.servers import LlamaServer
        if a.ngl is not None:
            extra = ["-ngl", str(a.ngl), *extra]
        return LlamaServer(a.model, n_parallel=a.parallel, ctx_size=a.ctx, threads=a.threads,
                           cache_ram_mib=a.cache_ram, extra_args=extra, **kw)
    if a.engine == "mlx":
        from infercourse.models.formats import mlx_folder
        from infercourse.servers import MLXServer
        return MLXServer(Path(a.model) if a.model else mlx_folder(), extra_args=extra, **kw)
    from infercourse.models.formats import hf_folder
    from infercourse.servers import VLLMServer
    return VLLMServer(Path(a.model) if a.model else hf_folder(), max_model_len=a.ctx, extra_args=extra, **kw)


def serve_main(argv: list[str] | None = None) -> int:
    """`infercourse serve`: 0 after Ctrl-C/SIGTERM, 1 if the server failed or died."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = serve_parser()
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    _check_sharing(p, a, extra)
    from infercourse.core.errors import InferCourseError
    stop = threading.Event()
    # SIGTERM (systemd, docker stop, `kill`) ends it like Ctrl-C does; the previous handlers
    # come back on the way out, so a caller embedding serve_main keeps its own.
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    srv = None
    try:
        srv = make_server(a, extra)
        print(f"starting {srv.name} on {getattr(srv, 'host', '127.0.0.1')}:{srv.port} (log: {srv.log_path}) ...",
              flush=True)
        srv.start()
        print(f"serving {srv.name} at {srv.url}  (OpenAI API: {srv.base_url})\n"
              f"pid {srv.pid} · log {srv.log_path}", flush=True)
        if getattr(srv, "api_key", None):   # the key itself is never printed: the room has it already
            print(f"shared on {srv.host}:{srv.port}: every request needs `Authorization: Bearer <key>`",
                  flush=True)
        print("Ctrl-C to stop", flush=True)
        while not stop.wait(0.5):
            if not srv.running:
                print(f"{srv.name} exited by itself; last log lines:\n{srv.log_tail(15)}",
                      file=sys.stderr, flush=True)
                return 1
        print(f"stopping {srv.name} ...", flush=True)
        return 0
    except InferCourseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if srv is not None:
            srv.stop()
        for s, h in old.items():
            signal.signal(s, h)

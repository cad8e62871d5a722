"""`infercourse serve`: a foreground server that prints its URL and is gone after Ctrl-C."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from infercourse.ops import serve
from infercourse.testing import port_closed, process_gone

REPO = Path(__file__).resolve().parents[1]


def test_help_lists_the_engines_and_knobs(capsys):
    with pytest.raises(SystemExit) as e:
        serve.serve_main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in ("llama", "mlx", "vllm", "--parallel", "--ctx", "--threads", "--model", "Ctrl-C"):
        assert word in out


def test_arguments_become_server_flags():
    a = serve.serve_parser().parse_args(["llama", "--parallel", "3", "--ctx", "1536", "--threads", "1",
                                         "--ngl", "-1", "--cache-ram", "0"])
    srv = serve.make_server(a, ["--flash-attn", "on"])
    argv = srv.argv()
    flag = lambda f: argv[argv.index(f) + 1]   # noqa: E731
    assert (flag("-np"), flag("-c"), flag("-t"), flag("-ngl"), flag("--cache-ram")) == ("3", "1536", "1", "-1", "0")
    assert argv[-2:] == ["--flash-attn", "on"] and flag("--host") == "127.0.0.1"


def test_unknown_engine_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        serve.serve_main(["tgi"])
    assert e.value.code == 2


def _start(*extra):
    proc = subprocess.Popen([sys.executable, "-m", "infercourse", "serve", "llama", "--parallel", "1",
                             "--ctx", "512", "--threads", "1", *extra], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    lines, url, pid = [], None, None
    for line in proc.stdout:                 # wait for the banner (model load included)
        lines.append(line)
        if m := re.search(r"serving llama-server at (http://127\.0\.0\.1:(\d+))", line):
            url, port = m.group(1), int(m.group(2))
        if m := re.match(r"pid (\d+)", line):
            pid = int(m.group(1))
        if "Ctrl-C to stop" in line:
            break
    assert url and pid, "".join(lines)
    return proc, url, port, pid


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_serves_until_signalled_then_leaves_nothing(sig):
    proc, url, port, pid = _start()
    try:
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert psutil.pid_exists(pid)
        proc.send_signal(sig)
        rest = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    assert "stopping llama-server" in rest
    assert process_gone(pid, 10.0) and port_closed(port)

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


def _start(*extra, env=None):
    proc = subprocess.Popen([sys.executable, "-m", "infercourse", "serve", "llama", "--parallel", "1",
                             "--ctx", "512", "--threads", "1", *extra], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
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
    proc.banner = "".join(lines)
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


# -- a room's shared server: beyond loopback only with a key the server itself checks ---------
@pytest.mark.parametrize("argv, message", [
    (["llama", "--host", "0.0.0.0"], "set INFERCOURSE_API_KEY or give --api-key-file"),
    (["vllm", "--host", "192.168.1.20"], "set INFERCOURSE_API_KEY or give --api-key-file"),
    (["mlx", "--api-key-file", "{keyfile}"], "mlx_lm.server cannot check an API key"),
    (["mlx", "--host", "0.0.0.0", "--api-key-file", "{keyfile}"], "mlx_lm.server cannot check an API key"),
    (["llama", "--", "--host", "0.0.0.0"], "not after `--`"),
    (["llama", "--host", "0.0.0.0", "--api-key-file", "{keyfile}", "--", "--api-key=other"], "not after `--`"),
    # a key in serve's own argv is readable by every user (`ps`), whatever the server does with it
    (["llama", "--host", "0.0.0.0", "--api-key", "k"], "visible"),
    (["llama", "--api-key=k"], "visible"),
])
def test_sharing_without_a_checked_key_is_refused_while_parsing(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("INFERCOURSE_API_KEY", raising=False)
    monkeypatch.setattr(serve, "make_server", lambda *a: pytest.fail("got past the argument check"))
    (tmp_path / "key").write_text("k\n")
    with pytest.raises(SystemExit) as e:
        serve.serve_main([x.format(keyfile=tmp_path / "key") for x in argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_key_comes_from_the_environment_or_a_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("INFERCOURSE_API_KEY", "from-env")
    assert serve.serve_parser().parse_args(["llama"]).api_key == "from-env"
    (tmp_path / "key").write_text("from-file\n")          # the newline an editor leaves is not part of it
    a = serve.serve_parser().parse_args(["llama", "--api-key-file", str(tmp_path / "key")])
    assert a.api_key == "from-file"                          # the file, named on purpose, wins
    monkeypatch.delenv("INFERCOURSE_API_KEY")
    assert serve.serve_parser().parse_args(["llama"]).api_key is None
    for bad, why in [("missing", "cannot read"), ("empty", "one key on one line")]:
        if bad == "empty":
            (tmp_path / bad).write_text("\n")
        with pytest.raises(SystemExit):
            serve.serve_parser().parse_args(["llama", "--api-key-file", str(tmp_path / bad)])
        assert why in capsys.readouterr().err


def test_the_key_goes_to_the_servers_own_option_and_never_to_the_record(monkeypatch):
    monkeypatch.setenv("INFERCOURSE_API_KEY", "s3cret-room-key")
    a = serve.serve_parser().parse_args(["llama", "--host", "0.0.0.0"])
    srv = serve.make_server(a, [])
    argv = srv.argv()
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    # llama-server reads its --api-key from LLAMA_API_KEY: the key stays off the command line (ps)
    assert srv.env["LLAMA_API_KEY"] == "s3cret-room-key" and "s3cret-room-key" not in argv
    assert srv.url == f"http://127.0.0.1:{srv.port}"            # this machine reaches it on loopback
    d = srv.describe()
    assert "s3cret" not in repr(d) and d["host"] == "0.0.0.0" and d["api_key_checked"] is True
    assert srv.engine().headers == {"Authorization": "Bearer s3cret-room-key"}


def test_a_server_without_a_key_flag_cannot_be_shared():
    from infercourse.core.errors import ServerLayerError
    from infercourse.servers import Server

    class NoKeys(Server):
        name = "no-keys"

    with pytest.raises(ServerLayerError, match="cannot check an API key"):
        NoKeys(api_key="k")
    with pytest.raises(ServerLayerError, match="without an API key"):
        type("Keyed", (Server,), {"name": "keyed", "api_key_flag": "--api-key"})(host="0.0.0.0")
    assert NoKeys().listen_args()[:2] == ["--host", "127.0.0.1"]    # loopback needs no key


@pytest.mark.slow
def test_shared_server_checks_the_key_on_every_request():
    """On loopback (tests never listen beyond it), with the key: a request without it is 401,
    with it 200, and the key is in neither the banner, the log, serve's nor the server's
    command line."""
    proc, url, port, pid = _start("--host", "127.0.0.1", env={"INFERCOURSE_API_KEY": "room-key-123"})
    body = {"prompt": "Hi", "max_tokens": 2}
    try:
        assert "room-key-123" not in " ".join(psutil.Process(pid).cmdline())
        assert "room-key-123" not in " ".join(psutil.Process(proc.pid).cmdline())
        assert httpx.get(url + "/health", timeout=10).status_code == 200   # health stays public
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 401
        bad = {"Authorization": "Bearer wrong"}
        assert httpx.post(url + "/v1/completions", json=body, headers=bad, timeout=60).status_code == 401
        good = {"Authorization": "Bearer room-key-123"}
        assert httpx.post(url + "/v1/completions", json=body, headers=good, timeout=60).status_code == 200
        assert httpx.get(url + "/metrics", timeout=10).status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
    assert "room-key-123" not in proc.banner + rest
    assert "every request needs `Authorization: Bearer <key>`" in proc.banner
    log = Path(re.search(r"· log (\S+)", proc.banner).group(1))
    text = log.read_text(errors="replace")
    assert "room-key-123" not in text

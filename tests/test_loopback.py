"""Load and faults stay on this machine, and the refusal comes before any traffic.

The target is a stand-in that records every TCP connection it is offered, listening on
127.0.0.2: on the loopback interface (nothing leaves this machine), yet "remote" to the
check, whose loopback set is exactly 127.0.0.1, localhost and ::1. A command that refuses
too late (after asking the server's /tokenize, say) leaves a connection in the record.
"""
from __future__ import annotations

import socket
import threading

import pytest

from infercourse.core import loopback


class Recorder:
    """Accepts and records every connection on (host, free port), answers nothing."""

    def __init__(self, host: str = "127.0.0.2"):
        self.sock = socket.socket()
        try:
            self.sock.bind((host, 0))
        except OSError as e:   # macOS routes only 127.0.0.1 unless an alias is added
            self.sock.close()
            pytest.skip(f"cannot listen on {host} here: {e}")
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.seen: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self.seen.append(peer)
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def remote(monkeypatch):
    # the check's set, narrowed to what this test relies on (127.0.0.2 stays outside it)
    monkeypatch.setattr(loopback, "LOOPBACK_HOSTS", frozenset({"127.0.0.1", "localhost", "::1"}))
    rec = Recorder()
    yield rec
    rec.close()


def test_the_recorder_sees_a_connection(remote):
    """The stand-in would notice traffic: otherwise the tests below prove nothing."""
    socket.create_connection(("127.0.0.2", int(remote.url.rsplit(":", 1)[1])), timeout=5).close()
    for _ in range(50):
        if remote.seen:
            break
        threading.Event().wait(0.1)
    assert len(remote.seen) == 1


def test_which_hosts_are_loopback():
    assert loopback.url_host("http://[::1]:8000/v1") == "::1"
    assert all(loopback.is_loopback(h) for h in ("127.0.0.1", "localhost", "LOCALHOST", "::1", "[::1]"))
    assert not any(loopback.is_loopback(h) for h in ("10.1.2.3", "127.0.0.2", "0.0.0.0", "example.com", ""))
    assert loopback.refuse_remote("http://127.0.0.1:8080", what="bench") is None
    assert loopback.refuse_remote("http://10.1.2.3:8080", what="bench", allow_remote=True) is None
    why = loopback.refuse_remote("http://10.1.2.3:8080", what="bench")
    assert "loopback servers only, got 10.1.2.3" in why and "--allow-remote" in why
    assert "not a URL with a host" in loopback.refuse_remote("localhost:8080", what="bench")


@pytest.mark.parametrize("extra", [
    [],                                       # fixed workload: would ask the server's /tokenize
    ["--model", "m", "--workload", "shared-prefix"],
    ["--pattern", "sweep", "--concurrency-list", "1,2"],
])
def test_bench_refuses_a_remote_url_before_sending_anything(remote, extra, capsys):
    from infercourse.cli import bench_main
    with pytest.raises(SystemExit) as ei:
        bench_main(["--engine", "http", "--url", remote.url, "--prompt-tokens", "16", "--no-progress", *extra])
    assert ei.value.code == 2
    assert "loopback servers only, got 127.0.0.2" in capsys.readouterr().err
    assert remote.seen == []


def test_soak_refuses_a_remote_url_before_sending_anything(remote, capsys):
    from infercourse.ops.soak import soak_main
    with pytest.raises(SystemExit) as ei:
        soak_main(["--url", remote.url, "--duration", "5", "--no-progress"])
    assert ei.value.code == 2
    assert "soak targets loopback servers only" in capsys.readouterr().err
    assert remote.seen == []


def test_faults_take_no_target():
    """The fault lab injects faults only into servers it starts itself on 127.0.0.1: there is
    no option to aim it anywhere else."""
    from infercourse.ops.faultlab import faults_main
    for option in ("--url", "--host"):
        with pytest.raises(SystemExit) as ei:
            faults_main(["run", "all", option, "http://127.0.0.2:1"])
        assert ei.value.code == 2

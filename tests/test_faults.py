"""Server faults on a real llama-server (embedded model, 1 thread, 2 slots of 512 tokens):
each is injected for real, the doctor must name the fault's layer, and every fault must be
undone: no process stopped, no server left behind, a lent server handed back healthy."""
from __future__ import annotations

import psutil
import pytest

from infercourse.ops.faults import FAULTS, inject, run_fault, small_server, stopped_pids

pytestmark = pytest.mark.slow
SERVER_FAULTS = ["killed", "frozen", "overloaded", "context_overflow"]
START_FAULTS = ["memory_limited", "model_missing", "model_corrupt", "template_breaks_tools"]


def _servers_of_ours() -> set[int]:
    me = psutil.Process()
    return {p.pid for p in me.children(recursive=True) if "llama-server" in " ".join(p.cmdline()[:3])}


@pytest.fixture(scope="module")
def server():
    with small_server() as srv:
        yield srv


def test_catalogue_names_every_fault_by_symptom_and_layer():
    assert set(SERVER_FAULTS + START_FAULTS) <= set(FAULTS)
    from infercourse.core.errors import LAYERS
    assert all(f.symptom and f.layer in LAYERS for f in FAULTS.values())
    with pytest.raises(ValueError, match="unknown fault"):
        with inject("gremlins"):
            pass


@pytest.mark.parametrize("name", SERVER_FAULTS)
def test_server_fault_is_named_and_undone(server, name):
    r = run_fault(name, server, seconds=30, timeout_s=5)
    print(r.row())
    assert r.named == FAULTS[name].layer, str(r.report)
    assert not stopped_pids()
    proc = psutil.Process(server.pid)       # handed back running, and answering
    assert proc.status() != psutil.STATUS_STOPPED
    assert server.engine(timeout=60).stream("Hi", max_tokens=2) is not None
    assert list(server.engine(timeout=60).stream("Hi", max_tokens=2))[-1].done


def test_killed_mid_stream_client_sees_a_cut_stream_and_log_has_the_signal(server):
    with inject("killed", server) as f:
        assert f.client_layer == "API" and "cut mid-way" in f.client_error
        assert "code -9" in f.server.log_tail()
        assert not psutil.pid_exists(f.notes["pid"]) or psutil.Process(f.notes["pid"]).status() == "zombie"


def test_frozen_server_resumes_even_when_the_block_raises(server):
    with pytest.raises(RuntimeError):
        with inject("frozen", server) as f:
            assert psutil.Process(server.pid).status() == psutil.STATUS_STOPPED
            assert f.client_layer == "API"
            raise RuntimeError("a cell failed")
    assert psutil.Process(server.pid).status() != psutil.STATUS_STOPPED and not stopped_pids()


@pytest.mark.parametrize("name", START_FAULTS)
def test_start_fault_is_named_and_leaves_no_server(name):
    before = _servers_of_ours()
    r = run_fault(name, seconds=30, timeout_s=5)
    print(r.row())
    assert r.named == FAULTS[name].layer, str(r.report)
    assert _servers_of_ours() <= before


def test_cli_lists_every_fault_with_its_layer():
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "infercourse", "faults", "list", "--json"], capture_output=True,
                         text=True, timeout=120)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert out.returncode == 0 and {r["fault"]: r["layer"] for r in rows} == {n: f.layer for n, f in FAULTS.items()}


def test_what_the_client_saw_keeps_the_lines_after_the_first():
    """A failed start appends its log's last lines to the message: they are kept in notes, the
    first line stays the one-line client error."""
    from infercourse.core.errors import ServerLayerError
    from infercourse.ops.faults import Injected
    inj = Injected(next(iter(FAULTS.values())), "http://127.0.0.1:1")
    inj.saw(ServerLayerError("server exited (server layer). Last lines of x.log:\n\nfailed to allocate buffer for kv cache\nmain: exiting"))
    assert inj.client_error.startswith("server exited") and inj.client_layer == "server"
    lines = inj.notes["error_lines"]   # the error's str() appends its layer to the last line
    assert len(lines) == 2 and lines[0] == "failed to allocate buffer for kv cache" and lines[1].startswith("main: exiting")
    inj2 = Injected(next(iter(FAULTS.values())), "http://127.0.0.1:1")
    inj2.saw(ServerLayerError("one line only"))
    assert "error_lines" not in inj2.notes


def test_a_stand_in_kill_is_read_as_not_the_oom_killer():
    """Issue 31: the OOM killer's SIGKILL leaves no line in the log, so the doctor reads the
    kernel's records. The lab's kill is a plain SIGKILL (a real OOM is never provoked here): the
    cgroup's counter, read before the fault and after, did not rise, and the doctor says so."""
    from infercourse.ops.death import oom_kills_now
    r = run_fault("memory_growth", seconds=30, timeout_s=5)
    said = r.report.check("server").summary
    assert r.named == "server" and "(exit code -9)" in said, str(r.report)
    if oom_kills_now()["oom_kill"] is None:
        assert "not readable here" in said
    else:
        assert "not the OOM killer: this cgroup's oom_kill counter stayed at" in said
    assert "killed by the OOM killer" not in str(r.report)

"""Why a server died: the kernel's OOM-kill records, read from synthetic cgroup and proc
folders and a stand-in `dmesg` (a real OOM kill is never provoked here)."""
from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

from infercourse.ops import death

V2 = "0::/user.slice/user-1000.slice/session-3.scope\n"
V1 = "9:name=systemd:/\n5:devices:/\n4:memory:/process_api/abc\n3:cpuset:/\n0::/\n"   # hybrid, as on this VM
EVENTS = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n"
OOM_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n"


def _tree(tmp_path, cgroup: str, files: dict[str, str], pid: int | None = None):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    if pid:
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "cgroup").write_text(cgroup)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return proc, root


def test_parse_cgroup_reads_the_unified_and_the_memory_controllers_paths():
    assert death.parse_cgroup(V2) == {"v2": "/user.slice/user-1000.slice/session-3.scope", "v1": None}
    assert death.parse_cgroup(V1) == {"v2": "/", "v1": "/process_api/abc"}
    assert death.parse_cgroup("4:cpu,memory:/x\n") == {"v2": None, "v1": "/x"}
    assert death.parse_cgroup("") == {"v2": None, "v1": None}


def test_parse_counters_reads_memory_events_and_oom_control():
    assert death.parse_counters(EVENTS)["oom_kill"] == 2 and death.parse_counters(EVENTS)["max"] == 12
    assert death.parse_counters(OOM_CONTROL) == {"oom_kill_disable": 0, "under_oom": 0, "oom_kill": 5}
    assert death.parse_counters("garbage\n\nkey notanumber\n") == {}


def test_the_v2_counter_is_read_in_the_processs_own_cgroup(tmp_path):
    proc, root = _tree(tmp_path, V2, {"user.slice/user-1000.slice/session-3.scope/memory.events": EVENTS,
                                      "memory.events": "oom_kill 99\n"})
    got = death.oom_kills_now(root=root, proc=proc)
    assert got["oom_kill"] == 2 and got["file"].endswith("session-3.scope/memory.events") and got["error"] is None


def test_the_v1_counter_is_read_where_v2_has_no_memory_controller(tmp_path):
    proc, root = _tree(tmp_path, V1, {"unified/cgroup.procs": "", "memory/process_api/abc/memory.oom_control":
                                      OOM_CONTROL}, pid=4242)
    got = death.oom_kills_now(4242, root=root, proc=proc)
    assert got["oom_kill"] == 5 and got["file"].endswith("memory.oom_control") and got["cgroup_of"] == "pid 4242"


def test_a_dead_pid_falls_back_to_this_processs_cgroup_and_nothing_readable_says_so(tmp_path):
    proc, root = _tree(tmp_path, V2, {"memory.events": EVENTS})      # a container: its cgroup at the mount root
    got = death.oom_kills_now(777, root=root, proc=proc)
    assert got["oom_kill"] == 2 and "the pid is gone" in got["cgroup_of"]
    proc, root = _tree(tmp_path / "bare", V2, {})
    got = death.oom_kills_now(root=root, proc=proc)
    assert got["oom_kill"] is None and "no readable memory.events" in got["error"]


KERNEL = """[  10.1] eth0: link up
[ 812.5] llama-server invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0
[ 812.6] oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg=/x,task_memcg=/x,task=llama-server,pid=4242,uid=1000
[ 812.6] Memory cgroup out of memory: Killed process 4242 (llama-server) total-vm:2097152kB, anon-rss:1048576kB
[ 900.0] Out of memory: Killed process 5151 (python3) total-vm:100kB, anon-rss:50kB
"""


def test_the_kernel_logs_oom_lines_are_found_by_pid():
    assert len(death.parse_kernel_log(KERNEL)) == 3
    mine = death.parse_kernel_log(KERNEL, 4242)
    assert len(mine) == 2 and "task=llama-server,pid=4242" in mine[0] and "Killed process 4242" in mine[1]
    assert death.parse_kernel_log(KERNEL, 1) == [] and death.parse_kernel_log("") == []


def test_a_forbidden_dmesg_is_said_never_guessed_past():
    def refused(*a, **k):
        said = "dmesg: read kernel buffer failed: Operation not permitted\n"
        return SimpleNamespace(returncode=1, stdout="", stderr=said)
    got = death.kernel_oom_lines(4242, run=refused)
    assert got["lines"] == [] and "not readable here: dmesg: read kernel buffer failed: Operation not permitted" \
        in got["error"]

    def missing(*a, **k):
        raise FileNotFoundError("dmesg")
    assert death.kernel_oom_lines(run=missing)["error"] == "no dmesg command here"

    def hung(*a, **k):
        raise subprocess.TimeoutExpired("dmesg", 5)
    assert "TimeoutExpired" in death.kernel_oom_lines(run=hung)["error"]
    ok = death.kernel_oom_lines(4242, run=lambda *a, **k: SimpleNamespace(returncode=0, stdout=KERNEL, stderr=""))
    assert ok["error"] is None and len(ok["lines"]) == 2


def _oom(before, now, lines=(), error=None):
    return {"before": before, "now": {"oom_kill": now, "file": "/sys/fs/cgroup/x/memory.events", "error": None},
            "kernel": {"lines": list(lines), "error": error}}


@pytest.mark.parametrize("oom, code, killed, words", [
    (_oom(0, 1), -9, True, r"killed by the OOM killer: this cgroup's oom_kill counter rose 0 → 1 \(memory.events\)"),
    (_oom(0, 0), -9, False, r"\bnot the OOM killer: this cgroup's oom_kill counter stayed at 0\b.*names no OOM kill"),
    (_oom(0, 0, lines=["Killed process 7 (llama-server)"]), -9, True, r"the kernel log says"),
    (_oom(None, 3), -9, False, r"reads 3 .*no reading from before"),
    (_oom(0, 1), 1, False, r"not a SIGKILL's: another process of the cgroup was killed"),
    (_oom(0, 0, error="the kernel log is not readable here: dmesg: x"), -9, False, r"stayed at 0.*not readable here"),
    (_oom(0, None), -9, False, r"counter is not readable here"),
])
def test_the_verdict_flips_with_the_counter_and_the_kernel_log(oom, code, killed, words):
    import re
    got, text = death.oom_verdict(oom, 7, code)
    assert got is killed and re.search(words, text), text
    assert ("killed by the OOM killer" in text) is killed
    assert death.oom_verdict(None, 7, -9) == (False, "")


def test_the_doctors_snapshot_compares_with_the_reading_before_the_fault(monkeypatch):
    """`collect_http`'s OOM evidence: the counter now, the reading the fault lab took before the
    fault (else this process's first reading), and the kernel log only once the server is dead."""
    from infercourse.ops import probes
    counter, asked = iter([0, 1, 1]), []
    monkeypatch.setattr(death, "oom_kills_now",
                        lambda pid=None: {"oom_kill": next(counter), "file": "f", "error": None})
    monkeypatch.setattr(death, "kernel_oom_lines", lambda pid: asked.append(pid) or {"lines": [], "error": None})
    monkeypatch.setattr(probes, "_FIRST_OOM", {})
    first = probes._oom_evidence(42, None, dead=False)            # a healthy walk: its reading is the first
    assert first["before"] is None and first["kernel"] == {} and not asked
    later = probes._oom_evidence(42, None, dead=True)             # no reading from the lab: the first one
    assert (later["before"], later["now"]["oom_kill"]) == (0, 1) and asked == [42]
    assert probes._oom_evidence(42, 1, dead=True)["before"] == 1  # the lab's reading wins


def test_records_here_says_what_this_machine_lets_the_doctor_read(monkeypatch):
    monkeypatch.setattr(death, "oom_kills_now", lambda pid=None: {
        "oom_kill": 3, "file": "/sys/fs/cgroup/a/memory.events", "cgroup_of": "this process", "error": None})
    monkeypatch.setattr(death, "kernel_oom_lines", lambda pid=None: {"lines": ["x"], "error": None})
    text = death.records_here()
    assert re_search(r"\btaken 3 process\(es\) in this process's cgroup \(cgroup v2: ", text)
    assert "the kernel log is readable (`dmesg`) and holds 1 OOM-kill line(s)" in text
    monkeypatch.setattr(death, "oom_kills_now", lambda pid=None: {
        "oom_kill": None, "file": None, "cgroup_of": "this process", "error": "no /proc/.../cgroup here (not Linux?)"})
    monkeypatch.setattr(death, "kernel_oom_lines", lambda pid=None: {
        "lines": [], "error": "the kernel log is not readable here: dmesg: Operation not permitted"})
    text = death.records_here()
    assert text.startswith("The cgroup's OOM-kill counter cannot be read here (no /proc")
    assert "not readable here: dmesg: Operation not permitted" in text and "taken" not in text


def re_search(pattern, text):
    import re
    return re.search(pattern, text)

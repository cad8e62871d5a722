"""Why did the server die? Its own last words, or the kernel's record of killing it.

A server that dies of its own accord usually says why in its log's last lines ("failed to
allocate" -> memory, "failed to load model" -> model, "Illegal instruction" -> hardware):
`classify_log` reads them. A server the kernel's **OOM killer** takes says nothing: SIGKILL
cannot be caught, so the log simply stops and the exit code is -9, exactly as if a person had
run `kill -9`. The kernel records the kill in two places instead:

- the **cgroup's memory counters**. Every process sits in a cgroup (`/proc/<pid>/cgroup`).
  Under cgroup v2 its folder holds `memory.events`, whose `oom_kill N` line counts the
  processes the OOM killer took in that cgroup and below; under cgroup v1 the same counter is
  the `oom_kill` line of `memory.oom_control` in the memory controller's folder. A counter
  only says *how many*, ever: it says "this death was an OOM kill" only when it **rose**
  between a reading taken before and one taken after (`oom_kills_now`, `oom_verdict`).
- the **kernel log** (`dmesg`): "Out of memory: Killed process 4242 (llama-server) ..." or
  "oom-kill:...,task=llama-server,pid=4242,...", naming the pid. Reading it may be forbidden
  (`kernel.dmesg_restrict=1` without CAP_SYSLOG): the evidence then says so
  (`kernel_oom_lines`).

A container's memory limit is a cgroup limit, so its kills show in the same counter. The
course never provokes a real OOM kill on a shared machine: the fault lab stands one in with a
plain SIGKILL (`ops.startfaults.memory_growth`), and the counter, read before and after, says
that it was not the kernel. The parsers here are pure functions, tested on synthetic files.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any, Callable

__all__ = ["classify_log", "parse_cgroup", "counter_files", "parse_counters", "oom_kills_now", "parse_kernel_log",
           "kernel_oom_lines", "oom_verdict", "records_here"]

# Log lines that name the layer a server died of, most specific first.
_LOG_CAUSES = [
    ("memory", r"failed to allocate|insufficient memory|cannot allocate memory|bad_alloc|out of memory|mmap failed"),
    ("hardware", r"illegal instruction|SIGILL|code -4\b|no CUDA-capable device|ggml_cuda_init: failed"),
    ("KV cache", r"failed to find free space in the KV cache|kv cache is full"),
    ("context", r"exceeds the available context size"),
    ("model", r"failed to open GGUF|gguf_init_from_file|failed to load model|error loading model|"
              r"invalid magic|not within the file bounds|unknown model architecture"),
    ("runtime", r"GGML_ASSERT|ggml_abort|segmentation fault|code -11\b|code -6\b"),
]


def classify_log(text: str | None) -> tuple[str, str] | None:
    """(layer, line) of the first known cause of death in a server log, or None.

    Args:
        text: the log tail.
    """
    if not text:
        return None
    for layer, pattern in _LOG_CAUSES:
        for line in text.splitlines():
            if re.search(pattern, line, re.I):
                return layer, line.strip()[:200]
    return None


def parse_cgroup(text: str) -> dict[str, str | None]:
    """`/proc/<pid>/cgroup` -> {"v2": the unified path, "v1": the memory controller's path}
    (either None where absent). v2 lines read `0::/path`; v1 lines `N:memory:/path` (the
    controller list may hold several, e.g. `4:memory,cpu:/path`).

    Args:
        text: the file's content.
    """
    out: dict[str, str | None] = {"v2": None, "v1": None}
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            out["v2"] = parts[2]
        elif "memory" in parts[1].split(","):
            out["v1"] = parts[2]
    return out


def counter_files(cgroup: dict[str, str | None], root: str | Path = "/sys/fs/cgroup") -> list[Path]:
    """Where the OOM-kill counter of that cgroup may be, most likely first: v2's
    `memory.events` (at the mount root, or under `unified/` on a hybrid machine), then v1's
    `memory/.../memory.oom_control`. A container without its own cgroup namespace sees its
    own cgroup at the mount's root while /proc names the host's path: the root comes after.

    Args:
        cgroup: `parse_cgroup`'s result.
        root: the cgroup mount point.
    """
    root, out = Path(root), []
    if cgroup.get("v2") is not None:
        rel = cgroup["v2"].lstrip("/")
        for base in (root, root / "unified"):
            out += [base / rel / "memory.events", base / "memory.events"]
    if cgroup.get("v1") is not None:
        rel = cgroup["v1"].lstrip("/")
        out += [root / "memory" / rel / "memory.oom_control", root / "memory" / "memory.oom_control"]
    return list(dict.fromkeys(out))


def parse_counters(text: str) -> dict[str, int]:
    """`key value` lines (`memory.events`, `memory.oom_control`) -> {key: int}.

    Args:
        text: the file's content.
    """
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def oom_kills_now(pid: int | None = None, *, root: str | Path = "/sys/fs/cgroup",
                  proc: str | Path = "/proc") -> dict[str, Any]:
    """This cgroup's OOM-kill counter now: {"oom_kill": N or None, "file": where it was read,
    "cgroup_of": whose cgroup, "error": why not}. A dead pid's cgroup is gone with it: then this
    process's own is read (a child stays in its parent's cgroup unless something moved it).

    Args:
        pid: the process whose cgroup to read (None: this process).
        root, proc: the cgroup and proc mount points (tests point them at synthetic folders).
    """
    whose = f"pid {pid}" if pid else "this process"
    try:
        text = (Path(proc) / str(pid or "self") / "cgroup").read_text()
    except OSError:
        whose, text = "this process (the pid is gone)", _read(Path(proc) / "self" / "cgroup") or ""
    cg = parse_cgroup(text)
    for path in counter_files(cg, root):
        counters = parse_counters(_read(path) or "")
        if "oom_kill" in counters:
            return {"oom_kill": counters["oom_kill"], "file": str(path), "cgroup_of": whose, "error": None}
    return {"oom_kill": None, "file": None, "cgroup_of": whose,
            "error": "no readable memory.events or memory.oom_control with an oom_kill line" if text
            else "no /proc/.../cgroup here (not Linux?)"}


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


_KILLED = re.compile(r"Killed process (\d+) \(([^)]*)\)")
_OOM_KILL = re.compile(r"oom-kill:.*?\btask=([^,]*),pid=(\d+)")


def parse_kernel_log(text: str, pid: int | None = None) -> list[str]:
    """The kernel log's OOM-kill lines ("Out of memory: Killed process N (name)", "Memory
    cgroup out of memory: ...", "oom-kill:...,task=name,pid=N"), of `pid` only when given.

    Args:
        text: `dmesg` output.
        pid: keep only the lines naming this pid.
    """
    out = []
    for line in text.splitlines():
        m, m2 = _KILLED.search(line), _OOM_KILL.search(line)
        hit = int(m.group(1)) if m else int(m2.group(2)) if m2 else None
        if hit is not None and (pid is None or hit == pid):
            out.append(line.strip()[:200])
    return out


def kernel_oom_lines(pid: int | None = None, *, run: Callable[..., Any] = subprocess.run) -> dict[str, Any]:
    """{"lines": the kernel log's OOM-kill lines (of `pid` when given), "error": why the log
    could not be read, or None}. `dmesg` is refused to a user without CAP_SYSLOG where
    `kernel.dmesg_restrict` is 1 (many distributions' default): said, never guessed past.

    Args:
        pid: keep only the lines naming this pid.
        run: `subprocess.run` (tests pass a stand-in).
    """
    try:
        r = run(["dmesg"], capture_output=True, text=True, timeout=5)
    except FileNotFoundError:
        return {"lines": [], "error": "no dmesg command here"}
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"lines": [], "error": f"dmesg failed: {type(e).__name__}"}
    if r.returncode != 0:
        said = (r.stderr or "").strip().splitlines()
        why = said[-1] if said else f"exit code {r.returncode}"
        restricted = (_read(Path("/proc/sys/kernel/dmesg_restrict")) or "").strip() == "1"
        hint = " (kernel.dmesg_restrict=1: the kernel log needs root or CAP_SYSLOG)" if restricted else ""
        return {"lines": [], "error": f"the kernel log is not readable here: {why}{hint}"}
    return {"lines": parse_kernel_log(r.stdout or "", pid), "error": None}


def oom_verdict(oom: dict[str, Any] | None, pid: int | None, exit_code: int | None) -> tuple[bool, str]:
    """(killed by the OOM killer?, the sentence that says what the kernel's records show) for a
    dead server, from the evidence `probes.collect_http` gathered (`oom`: {"before", "now":
    `oom_kills_now`, "kernel": `kernel_oom_lines`}). Yes when the kernel log names its pid, or
    when the cgroup's counter rose between the two readings and the exit was a SIGKILL's (or
    unknown); a counter with no earlier reading decides nothing, and says so.

    Args:
        oom: the snapshot's `server.oom` (None: not gathered).
        pid: the dead server's pid.
        exit_code: its exit code where known (-9: SIGKILL).
    """
    if not oom:
        return False, ""
    now, before, kernel = oom.get("now") or {}, oom.get("before"), oom.get("kernel") or {}
    n, src = now.get("oom_kill"), Path(now.get("file") or "memory.events").name
    killing = exit_code in (None, -9, 137)
    if kernel.get("lines"):
        return True, f"killed by the OOM killer: the kernel log says \"{kernel['lines'][-1]}\""
    if n is not None and before is not None and n > before and killing:
        return True, f"killed by the OOM killer: this cgroup's oom_kill counter rose {before} → {n} ({src})"
    if n is None:
        counter = f"the cgroup's OOM-kill counter is not readable here ({now.get('error')})"
    elif before is None:
        counter = (f"this cgroup's oom_kill counter reads {n} ({src}), with no reading from before to say whether "
                   "it rose now")
    elif n > before:
        counter = (f"this cgroup's oom_kill counter rose {before} → {n} ({src}), but the exit code {exit_code} is not "
                   "a SIGKILL's: another process of the cgroup was killed")
    else:
        counter = f"not the OOM killer: this cgroup's oom_kill counter stayed at {n} ({src})"
    log = (f"; {kernel['error']}" if kernel.get("error") else
           f"; the kernel log names no OOM kill of pid {pid}" if "lines" in kernel and pid else "")
    return False, counter + log


def records_here(pid: int | None = None) -> str:
    """What this machine lets the doctor read of an OOM kill, in one sentence: the cgroup's
    counter (which file, which cgroup version) and whether the kernel log is readable.

    Args:
        pid: whose cgroup (None: this process's).
    """
    c, k = oom_kills_now(pid), kernel_oom_lines(pid)
    if c["oom_kill"] is None:
        counter = f"The cgroup's OOM-kill counter cannot be read here ({c['error']})"
    else:
        version = "cgroup v2" if c["file"].endswith("memory.events") else "cgroup v1"
        counter = (f"The OOM killer has taken {c['oom_kill']} process(es) in {c['cgroup_of']}'s cgroup "
                   f"({version}: `{c['file']}`)")
    log = (k["error"] if k["error"] else
           f"the kernel log is readable (`dmesg`) and holds {len(k['lines'])} OOM-kill line(s)"
           + (f" naming pid {pid}" if pid else ""))
    return f"{counter}; {log}."

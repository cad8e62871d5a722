"""The contention gate: is this machine busy right now? (Habit 1 of `measure.noise`.)

Three readings: the 1-minute load average per core (how many runnable threads wait for each
core), the threads runnable at this instant (which does not lag as that average does), and
the share of a core this thread actually gets while it spins for a moment (CPU time / wall
time; 1.0 is a whole core). A busy machine does not forbid a measurement, but the
learner must read the conclusions knowing it: `Contention.message` is one line to print above
them. Stdlib only (`measure` sits below `ops`, whose doctor reads the same load average).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MAX_LOAD_PER_CORE", "MIN_CPU_SHARE", "Contention", "load_per_core", "cpu_share",
           "runnable_others", "judge", "contention"]

# Busy when more runnable threads than cores wait (load per core above 1), or when this
# process gets under 80% of a core while it spins: either way timings carry the neighbours.
MAX_LOAD_PER_CORE = 1.0
MIN_CPU_SHARE = 0.8


@dataclass(frozen=True)
class Contention:
    """What the machine looked like just now, and a line to print above conclusions."""
    load_1m: float | None      # 1-minute load average (None where the OS has none)
    cores: int                 # logical cores
    cpu_share: float | None    # share of one core this thread got while spinning (1.0 = all)
    busy: bool
    message: str

    def __str__(self) -> str:
        return self.message


def load_per_core() -> tuple[float | None, int]:
    """(1-minute load average, logical cores): the reading `doctor layers` reports as
    `load_1m`. Read with the stdlib here because `measure` sits below `ops`."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return load, os.cpu_count() or 1


def cpu_share(seconds: float = 0.5) -> float:
    """Spin for `seconds` of wall time and return CPU time / wall time of this thread.

    1.0: this thread had a core to itself; 0.5: it got half of one (the other half went to
    other processes). Thread time, not process time, so threads of an in-process engine
    running beside the probe do not inflate it.

    Args:
        seconds: how long to spin; 0.5 s or more for the scheduler's share to show (a thread
            that wakes from sleep runs ahead of its share for the first tenths of a second).
            Only processes in the same scheduling group compete fairly: with Linux's
            autogroup, a busy loop started in another session (`setsid`, another terminal)
            takes much less from this one, and this probe then rightly reads near 1.0.
    """
    w0, c0 = time.perf_counter(), time.thread_time()
    x = 0
    while time.perf_counter() - w0 < seconds:
        x += 1                 # busy work: a thread that waits would not ask for the CPU
    wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
    return min(cpu / wall, 1.0) if wall > 0 else math.nan


def runnable_others() -> int | None:
    """Threads runnable on the whole machine at this instant, this one not counted (Linux:
    the running count of /proc/loadavg; None elsewhere). Unlike the 1-minute load average
    it does not lag: 11's gate read "load 0.3, quiet" two seconds after two busy loops
    started."""
    try:
        running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(running - 1, 0)


def judge(load_1m: float | None, cores: int, share: float | None, *,
          runnable: int | None = None,
          max_load_per_core: float = MAX_LOAD_PER_CORE,
          min_cpu_share: float = MIN_CPU_SHARE) -> Contention:
    """Say whether readings describe a busy machine (pure: tests inject the readings).

    Args:
        load_1m: 1-minute load average, None where unavailable.
        cores: logical cores.
        share: share of a core from `cpu_share`, None where not probed.
        runnable: other threads runnable right now (`runnable_others`); busy when they
            fill every core. None: not read.
        max_load_per_core: busy above this 1-minute load per core.
        min_cpu_share: busy below this share of a core.
    """
    cores = max(int(cores), 1)
    why = []
    if runnable is not None and runnable >= cores:
        why.append(f"{runnable} other threads runnable right now on {cores} cores")
    if load_1m is not None and load_1m / cores > max_load_per_core:
        why.append(f"load {load_1m:.1f} on {cores} cores ({load_1m / cores:.1f} per core)")
    if share is not None and not math.isnan(share) and share < min_cpu_share:
        why.append(f"this process got {share:.0%} of a core")
    load_txt = "n/a" if load_1m is None else f"{load_1m:.1f}"
    share_txt = "n/a" if share is None or math.isnan(share) else f"{share:.0%}"
    if why:
        msg = (f"BUSY MACHINE: {'; '.join(why)}. Timings below include other programs' work: "
               "read small differences as noise; trust only what clears the A/A floor.")
    else:
        msg = f"machine quiet: load {load_txt} on {cores} cores, this process got {share_txt} of a core."
    return Contention(load_1m, cores, share, bool(why), msg)


def contention(probe_s: float = 0.5, **thresholds: float) -> Contention:
    """Read the machine now (load average, then a `probe_s` CPU-share probe) and `judge` it.

    Args:
        probe_s: seconds of the CPU-share probe. Not much shorter: Linux gives a thread that
            wakes from sleep a head start, so a 0.2 s probe read up to 0.84 of a core beside two
            busy loops on two cores where 0.5 s reads 0.5-0.7 (the fair share is 2/3).
        thresholds: `max_load_per_core` / `min_cpu_share`, passed to `judge`.
    """
    load, cores = load_per_core()
    before = runnable_others()
    share = cpu_share(probe_s)
    after = runnable_others()
    # both readings must show it: one instant can catch a thread that is about to sleep
    runnable = None if before is None or after is None else min(before, after)
    return judge(load, cores, share, runnable=runnable, **thresholds)

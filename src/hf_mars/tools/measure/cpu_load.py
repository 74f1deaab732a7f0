"""How much of this machine's CPU other work holds, and what that means for timing and decoding here.

Torch runs its operators on a team of OpenMP threads, one per core by default, that wait for each other at every
operator. When another process holds one of those cores, the team waits for a thread that is not running: on a
2-core machine with one core busy, a forward over the shipped checkpoint takes 2 to 3 times what it takes on the one
free core alone (docs/benchmarks.md). So the commands that decode for a person (`hf-mars generate`) use the cores
that are free, and timing pass costs on a busy machine is skipped: its figures would be off by tens of times.
"""

from __future__ import annotations

import os
import time

import torch

# Timed with less than this share of its threads on cores of their own (`timing_share`), a process was not alone on
# the CPU: its figures can be off by tens of times (OpenMP threads of two processes spin against each other), so they
# are not trusted.
BUSY_SHARE = 0.75


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _cpu_times() -> tuple[float, float] | None:
    """(busy, total) CPU time of the whole machine so far, in clock ticks (`/proc/stat`); None where there is none."""
    try:
        with open("/proc/stat") as stat:
            fields = [float(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle and iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def free_cores(seconds: float = 0.25) -> float | None:
    """How many cores other processes left idle over the next `seconds` (this process's own use counts as free);
    None where the machine does not say (no `/proc/stat`)."""
    before, own = _cpu_times(), time.process_time()
    if before is None:
        return None
    time.sleep(seconds)
    after, own = _cpu_times(), time.process_time() - own
    busy, total = after[0] - before[0], after[1] - before[1]
    if total <= 0:
        return None
    ticks_per_second = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    share_of_others = max(0.0, busy - own * ticks_per_second) / total
    return cores() * (1.0 - share_of_others)


def busy_cores(threads: int | None = None, probes: int = 2) -> int:
    """How many of torch's `threads` (default: its current count) would wait on cores other work holds now: 0 on an
    idle machine. Busy in each of `probes` looks (a quarter of a second each, the next only where the last found
    work): a burst of the kernel's own (writing back a checkpoint just saved) is not a process that stays."""
    threads = threads or torch.get_num_threads()
    busy = threads
    for _ in range(probes):
        free = free_cores()
        busy = 0 if free is None else min(busy, max(0, threads - max(1, round(free))))
        if not busy:
            break
    return busy


def decode_on_free_cores() -> str | None:
    """Give torch one thread per free core where other work holds some of the cores its threads would use, and say
    so (None: nothing changed). For a command that decodes for a person on a shared machine, not for a server, whose
    load comes and goes."""
    threads = torch.get_num_threads()
    busy = busy_cores(threads)
    if not busy:
        return None
    torch.set_num_threads(threads - busy)
    return (
        f"other work holds {busy} of the {threads} cores torch would use: decoding on {threads - busy} "
        f"thread{'s' * (threads - busy > 1)} (a team of threads waits for its slowest member)"
    )


def clocks() -> tuple[float, float, tuple[float, float] | None]:
    """Wall and CPU clocks now, and the machine's CPU times (`/proc/stat`), for `cpu_share` and `timing_share`."""
    return time.perf_counter(), time.process_time(), _cpu_times()


def cpu_share(started: tuple) -> float:
    """CPU time this process got since `started` (`clocks`), as a share of the wall time its threads span: near 1
    alone on the CPU (waiting OpenMP threads spin, which counts), about 1/2 or less beside another busy process."""
    wall, cpu = time.perf_counter() - started[0], time.process_time() - started[1]
    return cpu / max(wall * torch.get_num_threads(), 1e-9)


def timing_share(started: tuple) -> float:
    """The share of torch's threads that had a core to themselves since `started` (`clocks`): the cores other
    processes left free (`/proc/stat`: the machine's busy time less this process's), over the threads, at most 1.
    Where the machine does not say, `cpu_share`. Not `cpu_share` alone: a small forward (batch 1 of a small model)
    leaves a team of threads waiting for work, not for a core, so on an idle machine it read as busy."""
    machine, after = started[2] if len(started) > 2 else None, _cpu_times()
    if machine is None or after is None or after[1] <= machine[1]:
        return cpu_share(started)
    wall, own = time.perf_counter() - started[0], time.process_time() - started[1]
    ticks_per_second = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    others = max(0.0, (after[0] - machine[0]) / ticks_per_second - own) / max(wall, 1e-9)  # cores they held
    return min(1.0, max(0.0, cores() - others) / torch.get_num_threads())

"""How busy other processes kept this machine's CPUs while something was measured.

A CPU profile measured beside other work holds for that work: beside a numpy job that streams
memory, the small model's steps took 10-20 % longer on the 2-core development VM, while a pure
Python busy loop left them as they were (docs/benchmarks.md). So a profile cached beside one
kind of load and reused without it mispredicts every step by that much, and the reference steps
that should catch it scatter by about as much themselves. The operating system knows what ran,
though: all CPUs' busy time (``/proc/stat``) less the CPU time of this process and its
children (a tensor-parallel run's rank processes are its own work) is what others used, with
the hypervisor's steal time (another guest running on this machine's cores). ``kvsim validate``
records it with a profile it caches and measures it again before using that profile; where the
two differ by more than :func:`load_moved`'s margin, it profiles again.

Linux only: elsewhere (no ``/proc/stat``) the reading is None and nothing is decided on it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
# At least this many CPUs of other processes' load, or this share of the CPUs besides the one the
# measurement runs on, whichever is more, between two readings makes them different machine states.
# A quarter of a CPU: on the 2-core VM a profile measured beside 0.33 CPUs of other work (a test run)
# timed its 256-token prefill 11 % slow, and the quiet run it judged then failed its TTFT check
# (round 3's twenty-third session); a quiet VM reads 0.00-0.02, two busy loops 1.36 within 0.01.
MIN_MOVE_CPUS = 0.25
MOVE_SHARE = 0.25


def cpu_count() -> int:
    """The CPUs this process may run on (its affinity where the platform says, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def busy_seconds() -> float | None:
    """Seconds all CPUs have spent busy since boot (every state but idle and iowait; steal counts as busy:
    another guest held the core), or None off Linux."""
    try:
        line = PROC_STAT.read_text().split("\n", 1)[0]
    except OSError:
        return None
    fields = [int(x) for x in line.split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    guest = sum(fields[8:10])  # guest time is already counted in user and nice
    return (sum(fields) - idle - guest) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    """CPU seconds of this process, its children it has waited for, and its live descendants (their
    ``/proc/<pid>/stat``): a descendant alive at one reading and waited for by the next counts the same."""
    times = os.times()
    return time.process_time() + times.children_user + times.children_system + _live_descendants_seconds()


def _live_descendants_seconds() -> float:
    parents: dict[int, int] = {}
    spent: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone since the listing, or not ours to read
            continue
        pid = int(stat.parent.name)
        parents[pid], spent[pid] = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick  # ppid, utime, stime
    ours, frontier = set(), [os.getpid()]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in ours]
        ours.update(children)
        frontier.extend(children)
    return sum(spent[pid] for pid in ours)


@dataclass
class ForeignLoad:
    """Measures, between ``with`` entry and exit, the CPUs other processes kept busy on average.

    ``cpus`` is None until the block has ended, and stays None off Linux or over a window too
    short for the kernel's clock ticks (under a second) to say anything."""

    cpus: float | None = None

    def __enter__(self) -> ForeignLoad:
        self._start = (busy_seconds(), own_seconds(), time.perf_counter())
        return self

    def __exit__(self, *_) -> None:
        busy, own, wall = busy_seconds(), own_seconds(), time.perf_counter()
        busy0, own0, wall0 = self._start
        elapsed = wall - wall0
        if busy is None or busy0 is None or elapsed < 1.0:
            return
        self.cpus = max(0.0, (busy - busy0 - (own - own0)) / elapsed)


def load_moved(then: float | None, now: float | None, cpus: int | None = None) -> bool:
    """Did other processes' load move between two readings by enough to change what a step costs here?"""
    if then is None or now is None:
        return False
    margin = max(MIN_MOVE_CPUS, MOVE_SHARE * ((cpus or cpu_count()) - 1))
    return abs(now - then) > margin


def describe(cpus: float | None) -> str:
    """'0.93 of 2 CPUs', or 'an unrecorded share of the CPUs' (a line's part)."""
    return "an unrecorded share of the CPUs" if cpus is None else f"{cpus:.2f} of {cpu_count()} CPUs"

"""Other processes' CPU load: measured from the operating system, and what moves a profile's machine state."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvsim.realexec import host_load
from kvsim.realexec.host_load import ForeignLoad, describe, load_moved


@pytest.mark.skipif(host_load.busy_seconds() is None, reason="no /proc/stat on this platform")
def test_a_busy_process_beside_that_is_not_a_child_is_measured():
    burn = "import time\nend = time.time() + 3.0\nwhile time.time() < end: pass"
    subprocess.run(["sh", "-c", f"'{sys.executable}' -c '{burn}' >/dev/null 2>&1 &"], check=True)  # orphaned: not ours
    with ForeignLoad() as load:
        time.sleep(2.0)
    assert load.cpus is not None and load.cpus > 0.5  # its core (about 1.0), and whatever else ran


@pytest.mark.skipif(host_load.busy_seconds() is None, reason="no /proc/stat on this platform")
def test_a_child_process_counts_as_this_processs_own_work():
    """A tensor-parallel run's ranks are its children: their CPU time is the run's, not another process's."""
    burn = ("import sys, time\nwhile time.process_time() < 0.6: pass\nprint('half', flush=True)\n"
            "while time.process_time() < 1.2: pass\nsys.stdin.readline()")
    before = host_load.own_seconds()
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "half"
        alive = host_load.own_seconds()
        child.communicate("\n", timeout=60)
    finally:
        child.kill()
    after = host_load.own_seconds()
    assert alive - before > 0.5 and after - before > 1.1  # counted while it ran (in clock ticks), and once waited for


def test_foreign_load_is_all_cpus_busy_time_less_this_processs_own(monkeypatch):
    readings = iter([(100.0, 10.0, 0.0), (106.0, 12.0, 4.0)])  # (busy, own, wall) at entry and exit
    monkeypatch.setattr(host_load, "busy_seconds", lambda: current[0])
    monkeypatch.setattr(host_load, "own_seconds", lambda: current[1])
    monkeypatch.setattr(host_load.time, "perf_counter", lambda: current[2])
    current = next(readings)
    with ForeignLoad() as load:
        current = next(readings)
    assert load.cpus == pytest.approx((6.0 - 2.0) / 4.0)


def test_no_reading_off_linux_or_over_a_window_under_a_second(monkeypatch):
    monkeypatch.setattr(host_load, "busy_seconds", lambda: None)
    with ForeignLoad() as load:
        pass
    assert load.cpus is None and describe(load.cpus) == "an unrecorded share of the CPUs"
    monkeypatch.setattr(host_load, "busy_seconds", lambda: 5.0)
    with ForeignLoad() as short:
        pass
    assert short.cpus is None


def test_a_move_is_half_a_cpu_or_a_quarter_of_the_other_cpus_whichever_is_more():
    assert load_moved(0.3, 0.0, cpus=2) and not load_moved(0.2, 0.0, cpus=2)
    assert not load_moved(3.0, 0.0, cpus=17) and load_moved(4.5, 0.0, cpus=17)  # a quarter of 16 others: 4
    assert not load_moved(None, 2.0) and not load_moved(2.0, None)  # an unknown reading decides nothing

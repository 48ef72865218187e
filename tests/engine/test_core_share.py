"""CoreShare: the fused decode step's thread count follows what other processes leave free."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from splitserve.engine.core_share import CoreShare

BUSY = "import time\nend = time.time() + 0.8\nwhile time.time() < end: pass\n"


def test_a_busy_process_counts_as_others_and_our_own_work_does_not() -> None:
    share = CoreShare(interval_s=0.05)
    child = subprocess.Popen([sys.executable, "-c", BUSY])
    proc = psutil.Process(child.pid)
    time.sleep(0.1)  # past interpreter start-up
    share.threads(2)  # start a fresh interval
    start, cpu_start = time.monotonic(), sum(proc.cpu_times()[:2])
    time.sleep(0.5)
    child_share = (sum(proc.cpu_times()[:2]) - cpu_start) / (time.monotonic() - start)
    share.threads(2)
    child.wait()
    # /proc/stat counts in 10 ms ticks: allow a few of them over the 0.5 s interval.
    assert share.others >= child_share - 0.1
    if len(share.cpus) == 2 and share.others > 0.5:
        assert share.threads(2) == 1

    me = psutil.Process()
    start, cpu_start = time.monotonic(), sum(me.cpu_times()[:2])
    while time.monotonic() - start < 0.3:  # this process busy: not "others"
        pass
    share.threads(2)
    own_share = (sum(me.cpu_times()[:2]) - cpu_start) / (time.monotonic() - start)
    assert share.others <= len(share.cpus) - own_share + 0.15


def test_threads_stay_within_one_and_the_maximum() -> None:
    share = CoreShare(interval_s=0.01)
    for _ in range(3):
        time.sleep(0.02)
        assert 1 <= share.threads(4) <= min(4, len(share.cpus))
        assert share.threads(1) == 1
    with pytest.raises(ValueError, match="interval_s"):
        CoreShare(interval_s=0)


@pytest.mark.parametrize(
    "kwargs", [{"interval_s": 0}, {"probe_s": 0}, {"probe_s": 4.0, "max_probe_s": 2.0}]
)
def test_bad_intervals_are_refused(kwargs) -> None:
    with pytest.raises(ValueError, match="need interval_s > 0"):
        CoreShare(**kwargs)

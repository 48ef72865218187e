"""quiet_gc: start-up objects frozen out of the collector, collections rarer."""

from __future__ import annotations

import subprocess
import sys


def test_quiet_gc_freezes_start_up_objects_and_raises_the_young_threshold() -> None:
    # In a fresh interpreter: freezing is process-wide and must not touch the test runner.
    code = (
        "import gc\n"
        "from splitserve.common.gc_pauses import GC_GEN0_THRESHOLD, quiet_gc\n"
        "import splitserve.router.app\n"
        "before = gc.get_freeze_count()\n"
        "quiet_gc()\n"
        "assert before == 0 and gc.get_freeze_count() > 10_000, gc.get_freeze_count()\n"
        "assert gc.get_threshold()[0] == GC_GEN0_THRESHOLD\n"
        "assert gc.isenabled()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr

"""The exactness sweep (``tests/sweep_exactness.py``) runs and reports: two seeds of each kind."""

import os
import subprocess
import sys

SWEEP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sweep_exactness.py")


def test_sweep_runs_and_counts():
    for args in (["500000", "2"], ["700002", "1", "--big"]):
        done = subprocess.run([sys.executable, SWEEP, *args], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert f"{args[1]} of {args[1]} within tolerance" in done.stdout, done.stdout[-2000:]

"""na3d.constants: what the launchers and the kernels share, defined once."""

import subprocess
import sys


def test_importing_na3d_loads_no_triton():
    """The launchers take the kernels' constants from ``na3d.constants``, which imports
    nothing: ``import na3d`` loads no Triton (the kernels load at the first launch)."""
    code = "import sys, na3d; print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout

"""``python -m na3d.bench``: the benchmark's command. The code is :mod:`na3d.tools.bench`."""

import sys

from .tools.bench import main

if __name__ == "__main__":
    sys.exit(main())

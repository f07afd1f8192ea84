"""Test setup: on a machine without a GPU, run the Triton kernels in the interpreter.

``TRITON_INTERPRET`` must be set before the kernel modules are imported, so it is
set here, before any test imports ``na3d``. On a GPU machine the kernels compile for
the GPU and the ``gpu`` tests exercise them; without one they are skipped.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    needs_gpu = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(needs_gpu)


@pytest.fixture
def exact_reference_backend(monkeypatch):
    """na3d's CPU calls take its exact PyTorch reference instead of the Triton interpreter.

    ``na3d.api`` asks ``launch.kernels_interpreted()`` to choose; without the interpreter
    CPU tensors go to ``na3d_sdpa_exact``, the documented CPU behavior (what a CPU user
    gets). For model-level tests, where the interpreter would take minutes.
    """
    from na3d import launch

    monkeypatch.setattr(launch, "kernels_interpreted", lambda: False)

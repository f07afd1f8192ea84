"""What the launchers ask of a device: the name of its architecture (which config
table serves it), how many SMs it has, and whether it takes programmatic dependent
launches. Each answer is cached per device."""

from __future__ import annotations

import functools

import torch


def device_arch(device: torch.device) -> str:
    """``sm90`` for a CUDA device of capability 9.0, ``gfx942`` for an MI300X, ...;
    ``default`` for any other device (CPU tensors run the kernels in the Triton
    interpreter, under the default table)."""
    if device.type != "cuda":
        return "default"
    return _arch(_index(device))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (compute units) of a CUDA/ROCm device; 1 for any other."""
    if device.type != "cuda":
        return 1
    return _sm_count(_index(device))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _arch(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    gcn = getattr(props, "gcnArchName", None)
    if torch.version.hip is not None and gcn:
        return gcn.split(":")[0]
    return f"sm{props.major}{props.minor}"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched as programmatic dependents of the
    kernel before them (``griddepcontrol``: NVIDIA, capability 9.0 and up)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return _capability(_index(device)) >= (9, 0)


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    return torch.cuda.get_device_capability(index)

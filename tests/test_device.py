"""na3d.device: what a launch asks of the device (architecture, SM count, dependent launches)."""

import pytest
import torch

from na3d import device


def test_cpu_tensors_get_the_default_table_and_one_sm():
    cpu = torch.device("cpu")
    assert device.device_arch(cpu) == "default"
    assert device.sm_count(cpu) == 1
    assert device.dependent_launch(cpu) is False


@pytest.mark.gpu
def test_a_gpu_names_its_architecture_and_counts_its_sms():
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    arch = device.device_arch(torch.device("cuda"))
    assert arch == device.device_arch(torch.device("cuda", index))
    assert arch == (props.gcnArchName.split(":")[0] if torch.version.hip else f"sm{props.major}{props.minor}")
    assert device.sm_count(torch.device("cuda")) == props.multi_processor_count


@pytest.mark.gpu
def test_dependent_launches_on_hopper_and_later_nvidia_gpus_only():
    major, _ = torch.cuda.get_device_capability()
    assert device.dependent_launch(torch.device("cuda")) == (torch.version.hip is None and major >= 9)

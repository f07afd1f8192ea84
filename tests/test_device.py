"""na3d.device: what a launch asks of the device (architecture, SM count)."""

import pytest
import torch

from na3d import device


def test_cpu_tensors_get_the_default_table_and_one_sm():
    cpu = torch.device("cpu")
    assert device.device_arch(cpu) == "default"
    assert device.sm_count(cpu) == 1


@pytest.mark.gpu
def test_a_gpu_names_its_architecture_and_counts_its_sms():
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    arch = device.device_arch(torch.device("cuda"))
    assert arch == device.device_arch(torch.device("cuda", index))
    assert arch == (props.gcnArchName.split(":")[0] if torch.version.hip else f"sm{props.major}{props.minor}")
    assert device.sm_count(torch.device("cuda")) == props.multi_processor_count

"""Hardware detection with an injected probe: the config wins, detection fills the rest."""

from __future__ import annotations

import logging

import pytest

from launcher.plan.hardware import (
    ASSUMED_GPU_MEMORY,
    DeviceProbe,
    detect_hardware,
    gpu_driver_present,
    peak_flops_for,
)
from trainer.core.config import HardwareConfig

GiB = 2**30
NO_GPU = DeviceProbe(0, 0, "cpu", 64 * GiB)
FOUR_H100 = DeviceProbe(4, 80 * GiB, "NVIDIA H100 80GB HBM3", 512 * GiB)


def _detect(probe: DeviceProbe, env: dict[str, str] | None = None, **hw):
    return detect_hardware(HardwareConfig(**hw), env=env or {}, probe=lambda: probe)


def test_cpu_machine_plans_one_cpu_process_sharing_host_memory():
    hw = _detect(NO_GPU)
    assert (hw.device, hw.nodes, hw.devices_per_node) == ("cpu", 1, 1)
    assert hw.device_memory_bytes == hw.host_memory_bytes == 64 * GiB
    assert hw.peak_flops is None
    two = _detect(NO_GPU, device="cpu", devices_per_node=2)
    assert two.device_memory_bytes == 32 * GiB  # CPU ranks share the host


def test_gpus_found_are_counted_named_and_rated():
    hw = _detect(FOUR_H100)
    assert (hw.device, hw.devices_per_node, hw.device_memory_bytes) == ("cuda", 4, 80 * GiB)
    assert hw.host_memory_bytes == 512 * GiB
    assert hw.peak_flops == 989e12 and hw.world_size == 4


def test_config_values_win_over_detection():
    hw = _detect(FOUR_H100, devices_per_node=2, device_memory=40 * GiB, host_memory=128 * GiB)
    assert (hw.devices_per_node, hw.device_memory_bytes, hw.host_memory_bytes) == (
        2,
        40 * GiB,
        128 * GiB,
    )


def test_a_device_memory_on_a_machine_without_gpus_plans_for_gpus():
    """Planning a GPU job from a login node: `hardware.device_memory` means GPUs."""
    hw = _detect(NO_GPU, devices_per_node=8, device_memory=80 * GiB)
    assert (hw.device, hw.world_size, hw.device_memory_bytes) == ("cuda", 8, 80 * GiB)
    # the login node's 64 GiB say nothing about the GPU node: twice its GPU memory is assumed
    assert hw.host_memory_bytes == 2 * 8 * 80 * GiB
    given = _detect(NO_GPU, devices_per_node=8, device_memory=80 * GiB, host_memory=256 * GiB)
    assert given.host_memory_bytes == 256 * GiB


def test_cuda_without_a_gpu_or_a_size_assumes_80_gib_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="launcher.plan.hardware"):
        hw = _detect(NO_GPU, device="cuda", devices_per_node=8)
    assert hw.device == "cuda" and hw.device_memory_bytes == ASSUMED_GPU_MEMORY == 80 * GiB
    assert "set hardware.device_memory" in caplog.text and "set hardware.host_memory" in caplog.text
    assert hw.host_memory_bytes == 2 * 8 * ASSUMED_GPU_MEMORY


def test_nodes_and_ranks_from_slurm_and_torchrun():
    env = {"SLURM_JOB_NUM_NODES": "4", "LOCAL_WORLD_SIZE": "2"}
    hw = _detect(FOUR_H100, env)
    assert (hw.nodes, hw.devices_per_node, hw.world_size) == (4, 2, 8)
    assert _detect(FOUR_H100, env, nodes=1).nodes == 1  # the config wins


@pytest.mark.parametrize(
    ("name", "flops"),
    [
        ("NVIDIA H100 PCIe", 756e12),  # the longest matching name wins over "H100"
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA GeForce RTX 4090", 165e12),
        ("Some Future Accelerator", None),
    ],
)
def test_peak_flops_table(name, flops):
    assert peak_flops_for(name) == flops


def test_without_a_gpu_driver_no_gpu_is_looked_for(tmp_path):
    assert not gpu_driver_present(tmp_path)
    (tmp_path / "nvidia0").touch()
    assert gpu_driver_present(tmp_path)

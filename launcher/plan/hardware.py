"""What the job runs on. Detection fills what the config leaves out; tests inject fakes.

Detection never allocates device memory: CUDA properties come from the driver
(`torch.cuda.get_device_properties`), host memory from psutil, nodes from the Slurm or torchrun
environment. Every value in the config's `hardware` section wins over detection.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from launcher.plan.calibration import RuntimeFigures
from trainer.core.config import HardwareConfig
from trainer.core.gpus import peak_flops_for
from trainer.core.units import GIB

log = logging.getLogger(__name__)

# Planning for GPUs on a machine without one, with sizes the config leaves out: an 80 GiB device,
# and host RAM twice the node's GPU memory (how GPU servers are usually sized).
ASSUMED_GPU_MEMORY = 80 * GIB
ASSUMED_HOST_PER_GPU_MEMORY = 2


@dataclass(frozen=True)
class Hardware:
    device: str  # cuda | cpu
    nodes: int
    devices_per_node: int
    device_memory_bytes: int  # per device
    host_memory_bytes: int  # per node
    device_name: str = "unknown"
    peak_flops: float | None = None  # dense bf16 FLOP/s per device, when known
    # what launch probes measured on this hardware for this model family, by rung
    # (launcher/plan/calibration.py): the estimate's runtime overhead where present
    calibration: tuple[tuple[str, RuntimeFigures], ...] = ()

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass(frozen=True)
class DeviceProbe:
    """What the machine says about itself."""

    num_cuda_devices: int
    cuda_memory_bytes: int
    cuda_name: str
    host_memory_bytes: int


def gpu_driver_present(dev: Path = Path("/dev")) -> bool:
    """Whether an NVIDIA or AMD (ROCm) driver exposes devices here: without one CUDA cannot be
    available, and the planner need not pay for importing torch to learn that."""
    return (dev / "nvidiactl").exists() or (dev / "kfd").exists() or any(dev.glob("nvidia[0-9]*"))


def probe_machine() -> DeviceProbe:
    import psutil

    host = psutil.virtual_memory().total
    if not gpu_driver_present():
        return DeviceProbe(0, 0, "cpu", host)
    import torch

    if not torch.cuda.is_available():
        return DeviceProbe(0, 0, "cpu", host)
    props = torch.cuda.get_device_properties(0)
    return DeviceProbe(torch.cuda.device_count(), props.total_memory, props.name, host)


def detect_hardware(
    hw: HardwareConfig,
    env: Mapping[str, str] | None = None,
    probe: Callable[[], DeviceProbe] = probe_machine,
) -> Hardware:
    """The hardware to plan for: the config's values, detection for the rest."""
    env = os.environ if env is None else env
    needs_probe = (
        hw.device == "auto"
        or hw.devices_per_node is None
        or hw.device_memory is None
        or hw.host_memory is None
    )
    found = probe() if needs_probe else DeviceProbe(0, 0, "unknown", 0)
    device = hw.device
    if device == "auto":  # a device memory in the config describes GPUs (a login node has none)
        described = hw.device_memory is not None
        device = "cuda" if found.num_cuda_devices or described else "cpu"
    nodes = hw.nodes
    if "SLURM_JOB_NUM_NODES" in env and "nodes" not in hw.model_fields_set:
        nodes = int(env["SLURM_JOB_NUM_NODES"])
    if hw.devices_per_node is not None:
        per_node = hw.devices_per_node
    elif "LOCAL_WORLD_SIZE" in env:
        per_node = int(env["LOCAL_WORLD_SIZE"])
    else:
        per_node = max(1, found.num_cuda_devices) if device == "cuda" else 1
    elsewhere = device == "cuda" and needs_probe and not found.num_cuda_devices
    if hw.device_memory is not None:
        device_memory = hw.device_memory
    elif device == "cuda" and not elsewhere:
        device_memory = found.cuda_memory_bytes
    elif device == "cuda":  # planning for GPUs from a machine without one (a login node)
        device_memory = ASSUMED_GPU_MEMORY
        log.warning(
            "no GPU visible here: planning for %d GiB per device; set hardware.device_memory",
            device_memory // GIB,
        )
    if hw.host_memory is not None:
        host = hw.host_memory
    elif elsewhere:  # this machine's RAM says nothing about the GPU nodes' RAM
        host = ASSUMED_HOST_PER_GPU_MEMORY * per_node * device_memory
        log.warning(
            "no GPU visible here: planning for %d GiB host memory per node (%dx its GPU memory); "
            "set hardware.host_memory",
            host // GIB,
            ASSUMED_HOST_PER_GPU_MEMORY,
        )
    else:
        host = found.host_memory_bytes
    if device == "cpu" and hw.device_memory is None:  # CPU processes share the host's memory
        device_memory = host // per_node
    name = found.cuda_name if device == "cuda" and found.num_cuda_devices else device
    return Hardware(
        device=device,
        nodes=nodes,
        devices_per_node=per_node,
        device_memory_bytes=device_memory,
        host_memory_bytes=host,
        device_name=name,
        peak_flops=peak_flops_for(name) if device == "cuda" else None,
    )

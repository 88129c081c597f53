"""What the job runs on. Detection fills what the config leaves out; tests inject fakes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    device: str  # cuda | cpu
    nodes: int
    devices_per_node: int
    device_memory_bytes: int  # per device
    host_memory_bytes: int  # per node
    device_name: str = "unknown"
    peak_flops: float | None = None  # dense bf16 FLOP/s per device, when known

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

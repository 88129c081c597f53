"""Facts about known GPUs from vendor datasheets. Torch-free: the planner's cost model and the
engine's MFU both read them."""

from __future__ import annotations

# Dense bf16 tensor-core peak per device (vendor datasheets), for MFU and the cost model.
_PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,  # fp16 tensor cores (no bf16)
}


def peak_flops_for(device_name: str) -> float | None:
    """Peak bf16 FLOP/s of a known GPU (longest matching name wins), else None."""
    for key in sorted(_PEAK_BF16_FLOPS, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return _PEAK_BF16_FLOPS[key]
    return None

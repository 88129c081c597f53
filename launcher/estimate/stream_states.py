"""The `stream` rung's model states (trainer/backends/stream.py): pure arithmetic.

Device: the resident parts (embeddings, final norm, head) in the compute dtype, the two layer
buffers (the largest layer, twice, in the compute dtype), and in a layer's backward its
gradients as autograd makes them and the previous layer's still on their way to the host, piece
by piece (two of the largest layer's, compute dtype); the resident parts' gradients in backward
(launcher/estimate/trace_stream.py traces it). Host:
fp32 master weights, fp32 gradients and two fp32 AdamW moments (16 bytes a parameter) and the
pinned staging of one layer in and one out; no compute-dtype copy of the model. The
activations are full recomputation's: every layer's input kept (on the host under activation
offload), one layer's working set in backward (the planner gives the rung `full`).
"""

from __future__ import annotations

from typing import Any

from launcher.estimate.shape import ModelShape
from launcher.estimate.state_flow import GradFlow, ModelStates


def stream_states(row: Any, z: Any, shape: ModelShape, fsdp_every: bool) -> ModelStates:
    """The stream rung's states (`z`: launcher/estimate/model_states.py's `Sizes`)."""
    c, n = z.c, z.n
    on_device = {"params": c * z.root_n + 2 * c * z.top_n, "grads": 0, "optimizer": 0}
    on_host = {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n, "staging": 2 * c * z.top_n}
    flow = GradFlow(in_layer=2 * c * z.top_n, head=c * z.head_n, root_at_embedding=c * z.root_n)
    return ModelStates(on_device, on_host, sum(on_device.values()), 0, flow, flow)


def resident_reason(shape: ModelShape, compute_bytes: int) -> str:
    """The plan's line on what `stream` keeps on the device and what it streams."""
    resident = compute_bytes * shape.num_root_params / 2**30
    layer = compute_bytes * shape.top_layer_params / 2**30
    return (
        f"stream keeps the embeddings, final norm and head resident on the device ({resident:.1f}"
        f" GiB in the compute dtype, copied in once a step) and streams each of the "
        f"{shape.num_layers} decoder layers ({layer:.2f} GiB) from host memory through two "
        "device buffers, twice a micro-batch; fp32 masters, gradients and AdamW live on the host"
    )

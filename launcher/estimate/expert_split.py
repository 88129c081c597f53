"""What one rank of an expert group holds and computes (trainer/parallel/expert.py), as a model
shape the estimate reads like any other. Torch-free.

The persistent states do not change per rank: FSDP shards each rank's experts / N over the N-th
of the token ranks holding copies of them, experts / world either way, and the dense rest over
all of them (launcher/estimate/model_states.py). What changes:

- the layer a rank gathers, and makes unsharded gradients for, holds its own experts / N, not
  all of them (`ModelShape.gathered_layer_params`);
- the rows its experts compute. Unsplit, a rank's experts see its own tokens x top-k rows
  whatever the router picks. Split, a rank receives the rows its experts were picked for from
  the N ranks of its group (transformers' `AllToAllEP`: the experts run top-1 on what they
  received): tokens x top-k on average, and at most N x tokens x min(top-k, experts / N), every
  rank's tokens routed to this rank's experts (each token picks top-k distinct experts, of
  which at most experts / N live on one rank). The estimate bounds the worst case: the traced
  layer's activations (the unsplit layer, tokens x top-k rows) plus the extra rows' bytes.

Per received row a rank's experts keep for backward the row itself (the all-to-all's output, the
grouped matmul's input) and their own tensors, a multiple of their intermediate size I
(`SAVED_PER_ROW`); in forward the expert output (h) waits for the combine; in backward a row's
gradients (2 h + 3 I) are alive at once. Both measured against a traced split rank
(launcher/estimate/expert_trace.py; tests/launcher/test_expert_plans.py): within 1.2% of the
trace at ep 2 for Qwen3-MoE and gpt-oss, micro-batches 1 and 4. I, the experts' intermediate
size, is read from the routed parameter count (3 h I per expert: gate, up, down).
"""

from __future__ import annotations

from dataclasses import replace

from launcher.estimate.layer_fits import Fit
from launcher.estimate.shape import ModelShape


def expert_intermediate_size(shape: ModelShape) -> int:
    """Each routed expert's intermediate size, from the routed parameters (3 h I per expert)."""
    per_expert = shape.num_routed_params // max(1, shape.num_layers * shape.num_experts)
    return per_expert // (3 * shape.hidden_size)


def received_rows_per_token(shape: ModelShape, worst: bool = True) -> int:
    """Rows a rank's experts compute per token it holds under its expert split: N x
    min(top-k, experts / N) at the routing's worst, top-k on average."""
    ep, k = shape.expert_parallel, shape.experts_per_token
    if not worst or ep == 1:
        return k
    return ep * min(k, shape.num_experts // ep)


# What an expert keeps for backward per received row, in multiples of its intermediate size I
# beside the row itself (h), measured by tracing a split rank (launcher/estimate/expert_trace.py):
# a SwiGLU expert keeps gate and up (2 I), the activation and the product (2 I); gpt-oss's
# clamped, biased GLU also its clamps, its sigmoid and the shifted up projection. An
# architecture not measured takes the largest.
SAVED_PER_ROW = {"qwen3_moe": 4, "qwen2_moe": 4, "mixtral": 4, "gpt_oss": 8}


def row_bytes(shape: ModelShape, c: int) -> tuple[int, int, int]:
    """(saved, forward transient, backward transient) bytes of one received row."""
    h, i = shape.hidden_size, expert_intermediate_size(shape)
    kept = SAVED_PER_ROW.get(shape.model_type, max(SAVED_PER_ROW.values()))
    return c * (h + kept * i), c * h, c * (2 * h + 3 * i)


def expert_rank_shape(shape: ModelShape, c: int) -> ModelShape:
    """`shape` as one rank of its expert split holds it, at the routing's worst case (the shape
    itself without a split): its measured layer activations raised by the rows beyond top-k
    per token that its experts may receive, computing in c-byte floats."""
    if shape.expert_parallel == 1 or shape.activations is None:
        return shape
    extra = received_rows_per_token(shape) - shape.experts_per_token
    saved, forward, backward = (extra * b for b in row_bytes(shape, c))
    acts = shape.activations
    raised = replace(
        acts,
        fits=_raised(acts.fits, saved),
        unmasked=_raised(acts.unmasked, saved),
        forward=_raised(acts.forward or {m: Fit(0, 0, 0) for m in acts.fits}, forward),
        backward=_raised(acts.backward or {m: Fit(0, 0, 0) for m in acts.fits}, backward),
    )
    return replace(shape, activations=raised)


def _raised(fits: dict[str, Fit], per_token: int) -> dict[str, Fit]:
    return {m: replace(f, per_token=f.per_token + per_token) for m, f in fits.items()}


def dispatch_reason(shape: ModelShape) -> str:
    """What the estimate bounds under the split, in words."""
    ep, k = shape.expert_parallel, shape.experts_per_token
    return (
        f"expert parallel {ep}: a rank gathers its {shape.num_experts // ep} of "
        f"{shape.num_experts} experts per MoE layer; the estimate bounds the rows they compute "
        f"at the routing's worst, {received_rows_per_token(shape)} per token held "
        f"({ep} ranks x min(top-{k}, {shape.num_experts // ep})) against {k} on average"
    )

"""What one rank of a tensor group holds and computes (trainer/parallel/tensor.py), as a model
shape the estimate reads like any other: transformers' plans split the attention heads, the MLP's
intermediate units, the embedding's rows and the head's columns over the tensor ranks; the norms
and every hidden-size activation (the residual stream, the norms' and the row-wise projections'
outputs) stay whole on each rank, and the head's logits are gathered whole on every rank
(`colwise_gather_output`), so `vocab_size` stays the model's for the loss. Torch-free.
"""

from __future__ import annotations

from dataclasses import replace

from launcher.estimate.shape import ModelShape


def tensor_rank_shape(shape: ModelShape, tensor: int) -> ModelShape:
    """`shape` as one of `tensor` ranks holds it (the shape itself at 1)."""
    if tensor == 1:
        return shape
    h = shape.hidden_size
    whole_in_layer = 2 * h  # the two norms
    layer = whole_in_layer + (shape.num_layer_params - whole_in_layer) // tensor
    largest = shape.largest_layer_params
    if largest:
        largest = whole_in_layer + (largest - whole_in_layer) // tensor
    whole_in_root = h  # the final norm
    root = whole_in_root + (shape.num_root_params - whole_in_root) // tensor
    active = shape.num_active_params
    return replace(
        shape,
        num_heads=shape.num_heads // tensor,
        num_kv_heads=shape.num_kv_heads // tensor,
        intermediate_size=shape.intermediate_size // tensor,
        num_layer_params=layer,
        largest_layer_params=largest,
        num_root_params=root,
        num_params=layer * shape.num_layers + root,
        num_active_params=active // tensor if active else 0,
        tensor_parallel=tensor,
    )

"""What the exact memory levers change in the step's memory phases (launcher/estimate.py) and
its time (launcher/plan.py). Pure arithmetic, torch-free.

- Chunked loss (`trainer/chunked_loss.py`): the logits, their fp32 copy and the loss's tensors
  exist for one chunk of tokens at a time, in forward and again in backward (recomputed); the
  output layer's weight gradient is summed over the chunks, and the chunks' gradients of the
  hidden states are gathered into one tensor. Time: the head's forward matmul runs twice.
- Activation offload (`trainer/offload.py`): what the decoder layers save for backward waits in
  host memory; the device keeps the layer being computed, and in backward the layer being
  back-propagated and the next one (prefetched). Host: every layer's saved bytes, pinned. Time:
  the bytes cross PCIe twice, overlapped with compute.
"""

from __future__ import annotations


def logit_tokens(tokens: int, chunk_tokens: int | None) -> int:
    """Tokens whose logits are alive at once: the micro-batch's, or one chunk's."""
    return tokens if chunk_tokens is None else min(tokens, chunk_tokens)


def chunked_head_backward_extra_bytes(
    tokens: int, hidden: int, head_params: int, c: int, r: int, autocast: bool
) -> int:
    """Transients of the chunked head's backward besides one chunk's loss tensors: a chunk's
    weight gradient next to the sum over the chunks so far (under autocast both 16-bit, and the
    recomputed chunk casts the weight again where the unchunked forward had saved its copy),
    and the chunks' hidden-state gradients joined into one tensor."""
    weight = (2 if autocast else 1) * c * head_params
    return weight + r * tokens * hidden


def recomputed_head_flops_per_token(hidden: int, vocab: int) -> float:
    """Chunked loss runs the output layer's forward matmul again in backward."""
    return 2.0 * hidden * vocab


def offload_pcie_seconds(saved_bytes: int, pcie_bytes_per_s: float, compute_s: float) -> float:
    """Copies out in forward and back in backward, on side streams: what compute does not hide.
    The copies overlap the layers' compute (torchtune measured <1% slowdown at 8B); charge the
    part of the transfer that exceeds the compute time, plus a fixed 2% for the stream syncs."""
    transfer = 2 * saved_bytes / pcie_bytes_per_s
    return max(0.0, transfer - compute_s) + 0.02 * compute_s

"""Chunked loss: the LM head and cross-entropy over chunks of tokens, so the logits of the whole
micro-batch never exist at once.

The model's own forward still runs end to end (the wrappers' hooks see every module: DDP's,
FSDP2's root, ZeRO-3's gather of the head's weight), but the output layer, switched to
`ChunkedLossHead`, computes the summed loss itself from the final hidden states: one chunk of
tokens at a time, each chunk under non-reentrant checkpointing, so its logits are freed as soon as
its loss is known and recomputed in backward. Per token the arithmetic is the unchunked one
(same matmul, the model's final logit transform, the fp32 upcast, cross-entropy); only the order
of the sums over tokens changes.

The head returns a zero "carrier" derived from the loss in place of the logits: whatever the
model does to its logits afterwards (Gemma's soft-capping, Cohere's scale) acts on zeros, and
the loss the engine backpropagates goes through the carrier, so backward enters the head through
its output as it does without chunking (where ZeRO-3 gathers the weight again).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.core.strategies import loss_chunk_tokens

IGNORE_INDEX = -100


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """What each position predicts: the next label (the last position predicts nothing)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


LogitTransform = Callable[[torch.Tensor], torch.Tensor]


def logit_transform(hf_config: object) -> LogitTransform | None:
    """What the model's forward does to the head's output before the loss, op for op: the final
    soft-capping of Gemma 2/3, the logit scale of Cohere, the logit divisor of Granite."""
    cap = getattr(hf_config, "final_logit_softcapping", None)
    if cap is not None:
        return lambda z: torch.tanh(z / cap) * cap
    scale = getattr(hf_config, "logit_scale", None)
    if getattr(hf_config, "model_type", "") in ("cohere", "cohere2") and scale is not None:
        return lambda z: z * scale
    divisor = getattr(hf_config, "logits_scaling", None)
    if divisor is not None:
        return lambda z: z / divisor
    return None


def _chunk_loss_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    transform: LogitTransform | None,
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)
    if transform is not None:
        logits = transform(logits)
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _chunk_row_sums(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    transform: LogitTransform | None,
    rows: torch.Tensor,
    num_rows: int,
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)
    if transform is not None:
        logits = transform(logits)
    losses = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="none")
    return losses.new_zeros(num_rows).index_add(0, rows, losses)


def chunked_loss_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk_tokens: int,
    transform: LogitTransform | None = None,
    per_row: bool = False,
) -> torch.Tensor:
    """Summed cross-entropy of `F.linear(hidden, weight, bias)` (then `transform`) against
    `targets` ([rows, seq]), over chunks of `chunk_tokens` tokens; each chunk recomputed in
    backward. `per_row`: a sum per row of `targets` (the preference objectives' sequences)."""
    hidden_chunks = hidden.reshape(-1, hidden.size(-1)).split(chunk_tokens)
    target_chunks = targets.reshape(-1).split(chunk_tokens)
    num_rows = targets.size(0)
    row_of = torch.arange(targets.numel(), device=targets.device) // targets.size(-1)
    row_chunks = row_of.split(chunk_tokens)
    recompute = torch.is_grad_enabled()
    total: torch.Tensor | None = None
    for h, t, r in zip(hidden_chunks, target_chunks, row_chunks, strict=True):
        fn, extra = (_chunk_row_sums, (r, num_rows)) if per_row else (_chunk_loss_sum, ())
        if recompute:
            part = checkpoint(fn, h, weight, bias, t, transform, *extra, use_reentrant=False)
        else:
            part = fn(h, weight, bias, t, transform, *extra)
        total = part if total is None else total + part
    assert total is not None
    return total


class ChunkedLossHead(nn.Linear):
    """The model's output layer with a loss mode (the same module object, its class switched by
    `apply_chunked_loss`: parameter names, tying and the wrappers' hooks stay as they were).

    Outside `loss_targets` (evaluation, chunking off) it is the plain linear layer.
    """

    enabled: bool
    chunk_tokens: int
    transform: LogitTransform | None
    _targets: torch.Tensor | None
    _per_row: bool
    _loss_sum: torch.Tensor | None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._targets is None:
            return super().forward(hidden)
        loss_sum = chunked_loss_sum(
            hidden,
            self.weight,
            self.bias,
            self._targets,
            self.chunk_tokens,
            self.transform,
            self._per_row,
        )
        self._loss_sum = loss_sum
        # a new tensor, not a view (FSDP2 warns on views)
        return loss_sum.sum().reshape(1, 1, 1) * 0

    @contextlib.contextmanager
    def loss_targets(self, targets: torch.Tensor, per_row: bool = False) -> Iterator[None]:
        """Within: the next forward computes the summed loss against `targets` (aligned with the
        positions, IGNORE_INDEX where a position predicts nothing); `per_row`: one sum per row."""
        self._targets = targets
        self._per_row = per_row
        try:
            yield
        finally:
            self._targets = None

    def take_loss(self, carrier: torch.Tensor) -> torch.Tensor:
        """The summed loss of the last forward, joined to the carrier the model returned (adds
        zero, so backward runs through the head's output)."""
        loss_sum, self._loss_sum = self._loss_sum, None
        if loss_sum is None:
            raise RuntimeError("the output layer computed no loss: was it called in forward?")
        return loss_sum + 0 * carrier.sum()


def _causal_lm(model: nn.Module) -> nn.Module:
    from transformers import PreTrainedModel

    for module in model.modules():  # the outermost HF model (inside DDP or a DeepSpeed engine)
        if isinstance(module, PreTrainedModel) and module.get_output_embeddings() is not None:
            return module
    raise ValueError(f"{type(model).__name__}: no Hugging Face model with an output layer inside")


def chunkable(model: nn.Module) -> str | None:
    """None when chunked loss can switch this model's output layer; else why not."""
    try:
        head = _causal_lm(model).get_output_embeddings()
    except ValueError as err:
        return str(err)
    # a wrapper's subclass that keeps nn.Linear's forward (FSDP2's FSDPLinear) chunks too
    if not isinstance(head, nn.Linear) or type(head).forward not in _PLAIN_FORWARDS:
        return f"its output layer is a {type(head).__name__}, not a plain nn.Linear"
    return None


_PLAIN_FORWARDS = (nn.Linear.forward, ChunkedLossHead.forward)


@functools.cache
def _with_loss_mode(cls: type) -> type:
    """`ChunkedLossHead` over the head's own class: nn.Linear itself, or a wrapper's subclass
    (FSDP2's `FSDPLinear`, whose hooks and FSDPModule methods must stay)."""
    if cls is nn.Linear:
        return ChunkedLossHead
    return type(f"ChunkedLoss{cls.__name__}", (ChunkedLossHead, cls), {})


def apply_chunked_loss(
    model: nn.Module, enabled: bool = True, chunk_tokens: int | None = None
) -> ChunkedLossHead:
    """Switch the output layer of a built model (wrapped or sharded or not) to
    `ChunkedLossHead`, in place, and chunking on or off; again on the same model it only flips
    the switch (the OOM back-off turns it on mid-run). `chunk_tokens` None sizes the chunks by
    the vocabulary."""
    why_not = chunkable(model)
    if why_not is not None:
        raise ValueError(f"chunked loss: {why_not}")
    lm = _causal_lm(model)
    head = lm.get_output_embeddings()
    if not isinstance(head, ChunkedLossHead):
        head.__class__ = _with_loss_mode(type(head))
        head._targets = None
        head._loss_sum = None
    head.enabled = enabled
    head.chunk_tokens = loss_chunk_tokens(head.out_features, chunk_tokens)
    head.transform = logit_transform(lm.config)
    return head


def chunked_head(model: nn.Module) -> ChunkedLossHead | None:
    """The output layer of `model` when chunked loss is on."""
    head = _causal_lm(model).get_output_embeddings()
    return head if isinstance(head, ChunkedLossHead) and head.enabled else None

"""A stand-in for transformers' expert-parallel dispatch in a traced step (launcher/estimate/
trace.py): the real one reads its split sizes with `.tolist()`, which fake tensors cannot run.
The stand-in routes at a fixed bound, the estimate's worst case (launcher/estimate/
expert_split.py): this rank receives N x tokens x min(top-k, experts / N) rows, spread evenly
over its experts, and allocates what `AllToAllEP` allocates for them: the sorted rows it sends,
the received rows, the experts' output, the rows coming back and their weighted sum. The
exchanges allocate their outputs as the fake process group's all-to-all would, and their
backward the input gradients."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from launcher.estimate.trace_patches import patched


class _Exchange(torch.autograd.Function):
    """An all-to-all of rows: `rows` arrive for what is sent; backward sends the gradients of
    what arrived back, as many rows as were sent."""

    @staticmethod
    def forward(ctx: Any, sent: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.sent_rows = sent.shape[0]
        return sent.new_empty((rows, sent.shape[1]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.new_empty((ctx.sent_rows, grad.shape[1])), None


def _dispatch_tokens(self: Any, hidden_states, top_k_index, top_k_weights):
    ep, local = self.ep_mesh.size(), self.num_local_experts
    num_tokens, top_k = hidden_states.size(0), top_k_index.size(-1)
    order = torch.argsort(top_k_index.reshape(-1))
    send_tokens = hidden_states[order // top_k]
    rows = ep * num_tokens * min(top_k, local)
    recv_tokens = _Exchange.apply(send_tokens, rows)
    ids = torch.arange(local, device=hidden_states.device)
    recv_expert_ids = ids.repeat_interleave(rows // local).unsqueeze(-1)
    recv_weights = torch.ones_like(recv_expert_ids, dtype=recv_tokens.dtype)
    return recv_tokens, recv_expert_ids, recv_weights, (top_k_weights, order)


def _combine_tokens(self: Any, expert_output, state):
    top_k_weights, order = state
    recv_out = _Exchange.apply(expert_output, order.numel())
    token_outputs = torch.empty_like(recv_out)
    token_outputs[order] = recv_out
    token_outputs = token_outputs.view(*top_k_weights.shape, expert_output.size(-1))
    return (token_outputs * top_k_weights.unsqueeze(-1)).sum(dim=1)


@contextlib.contextmanager
def worst_case_dispatch() -> Iterator[None]:
    """transformers' all-to-all dispatch routing at the estimate's bound, for a traced step."""
    from transformers.distributed.expert_parallel import AllToAllEP

    with patched(AllToAllEP, _dispatch_tokens=_dispatch_tokens, _combine_tokens=_combine_tokens):
        yield

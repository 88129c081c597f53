"""Ulysses sequence parallelism: the ranks of a sequence group each hold seq_len / sp tokens of
every sequence; around attention an all-to-all swaps that sequence split for a head split.

The world is data x sequence (`ParallelDims`, trainer/core/parallel_dims.py; its process groups
in trainer/parallel/mesh.py): rank r is sequence rank r % sp of data rank r // sp. Every rank of
a sequence group reads the same sequences (those of its data rank) and keeps its slice of each
(`split_sequence`). The weights are replicated (ddp) or sharded (fsdp, ZeRO) over ALL ranks, as
in DeepSpeed's ALST: a sequence group is also data-parallel for the weights, since each of its
ranks computes the gradient of its own tokens. The sum of every rank's gradient is the gradient
of the whole batch, which is the backends' convention already (trainer/backends), so no backend
knows about sequence parallelism: `trainer.parallel.parallelize` applies the split for them.

Attention: every model whose attention goes through transformers' AttentionInterface (Llama,
Qwen2/3, Mistral, Gemma, ...) runs under the name `oomless_ulysses` (registered here), whose
function wraps the model's own implementation (sdpa, eager, flash, flex): q, k, v arrive as
[batch, heads, seq/sp, head_dim]; an all-to-all gives [batch, heads/sp, seq, head_dim]; the
model's implementation runs on that with the mask transformers builds for the WHOLE sequence
(from the whole sequence's position ids, gathered once per forward: packed documents stay apart,
sliding windows stay right); a second all-to-all turns the output back. A model whose own mask
ignores position ids (OPT, BioGPT: packed documents attend to each other on one process) gets
the mask it builds itself, plain causal over the whole window, so the split is exact there too.
Key/value heads fewer than sp (grouped-query attention) are each sent to the sp / kv ranks whose
query heads share it, in sp / kv rounds, so each rank gets one without a copy of them repeated to
sp heads.

Why not DeepSpeed's UlyssesSPAttentionHF (deepspeed.runtime.sequence_parallel.ulysses_sp):
its wrapper drops the attention mask for sdpa and eager and relies on is_causal, so packed
documents (every window here) would attend across their boundaries; it replaces the global
`sdpa` entry of transformers for every model of the process, and needs deepspeed.comm and
DeepSpeed's own process-group state on the ddp and fsdp rungs. Its all-to-all layout is the
same as this one (docs/long-context.md).
"""

from __future__ import annotations

import ast
import copy
import inspect
import sys
from typing import Any

import torch
import torch.distributed as dist

from trainer.core.config import JobConfig
from trainer.core.parallel_dims import AttentionShape, Batch, ParallelDims
from trainer.core.parallel_dims import check_sequence_parallel as check_parallel_dims
from trainer.memory.chunked_loss import shifted_targets

ATTENTION_NAME = "oomless_ulysses"
SHARDED_KEYS = ("input_ids", "position_ids", "doc_ids", "targets")


def concrete_sequence_parallel(cfg: JobConfig) -> int:
    """The config's `sequence_parallel`; `auto` is 1 until the planner writes its choice into
    the resolved config (run_dir/config.yaml) that every rank reads."""
    sp = cfg.sequence_parallel
    return 1 if sp == "auto" else sp


def check_sequence_parallel(dims: ParallelDims, hf_config: Any, seq_len: int) -> None:
    """ConfigError (one line, exit 2) when the sequence cannot be split `dims.sequence` ways
    here (the planner and `train` checked the same before launch: trainer/core/parallel_dims.py)."""
    check_parallel_dims(dims, attention_of(hf_config), seq_len, Batch(global_size=dims.data))


def attention_of(hf_config: Any) -> AttentionShape:
    """The heads of a transformers config object (its text model's)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None)
    return AttentionShape(int(heads) if heads else None, int(kv_heads) if kv_heads else None)


def split_sequence(
    batch: dict[str, torch.Tensor], dims: ParallelDims, rank: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of every sequence of a batch.

    The targets are taken from the labels BEFORE the split (`targets`: what each position
    predicts), so the last token of one slice predicts the first token of the next; position
    ids and document ids are the whole sequence's. At sp=1 the slice is the whole sequence.
    Entries with one value per row (a preference pair's index) are kept whole.
    """
    full = {**batch, "targets": shifted_targets(batch["labels"])}
    _, sequence_rank = dims.coordinates(rank)
    per_row = {key: t for key, t in batch.items() if t.dim() == 1}
    return per_row | {key: _slice(full[key], sequence_rank, dims.sequence) for key in SHARDED_KEYS}


def _slice(t: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    length = t.size(1) // parts
    return t[:, index * length : (index + 1) * length].contiguous()


def apply_sequence_parallel(hf_config: Any, sp: int, group: Any) -> None:
    """Make the models built from `hf_config` attend through the Ulysses all-to-all over the
    sequence group `group` of `sp` ranks, in place (before building them); nothing at sp=1."""
    if sp == 1:
        return
    from transformers import AttentionInterface

    text = hf_config.get_text_config()
    inner = text._attn_implementation or "eager"
    if inner == ATTENTION_NAME:  # applied before (a second backend setup, a rebuilt factory)
        inner = _UlyssesAttention.current.inner_name
    ulysses = _UlyssesAttention(sp, group, text, inner)
    _UlyssesAttention.current = ulysses
    AttentionInterface.register(ATTENTION_NAME, ulysses)
    text._attn_implementation = ATTENTION_NAME


class _UlyssesAttention:
    """The function registered as `oomless_ulysses` (see the module docstring)."""

    current: _UlyssesAttention

    def __init__(self, sp: int, group: Any, text_config: Any, inner_name: str):
        from transformers import AttentionInterface

        self.sp, self.group = sp, group
        self.inner_name = inner_name
        self.inner = None if inner_name == "eager" else AttentionInterface()[inner_name]
        self.mask_config = copy.copy(text_config)  # the masks of the inner implementation
        self.mask_config._attn_implementation = inner_name
        self._seen: torch.Tensor | None = None  # this forward's local position ids
        self._positions: torch.Tensor | None = None  # ... and the whole sequence's
        self._masks: dict[Any, Any] = {}
        self._mask_positions: bool | None = None  # the model's own mask follows position ids

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        sp = self.sp
        if self._mask_positions is None:
            self._mask_positions = mask_follows_position_ids(sys.modules[type(module).__module__])
        positions = self._whole_positions(kwargs.get("position_ids"))
        query = self._heads_to_sequence(query)
        if key.size(1) < sp:  # grouped-query attention: the k/v head of this rank's q heads
            # (the heads this rank holds: the model's, or its tensor rank's share)
            key, value = (self._shared_heads_to_sequence(t) for t in (key, value))
        else:
            key, value = (self._heads_to_sequence(t) for t in (key, value))
        mask = self._mask(query, positions, kwargs.get("sliding_window"))
        inner = self.inner or _eager_of(module)
        groups = getattr(module, "num_key_value_groups", None)
        if groups is not None:  # query heads per k/v head on this rank (one shared k/v head)
            module.num_key_value_groups = query.size(1) // key.size(1)
        try:
            out, weights = inner(
                module, query, key, value, mask, **{**kwargs, "position_ids": positions}
            )
        finally:
            if groups is not None:
                module.num_key_value_groups = groups
        return self._sequence_to_heads(out), weights

    def _heads_to_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """[b, h, s/sp, d] -> [b, h/sp, s, d]: head chunk j goes to rank j."""
        sp, (b, h, s, d) = self.sp, t.shape
        chunks = t.reshape(b, sp, h // sp, s, d).transpose(0, 1).contiguous()
        gathered = all_to_all(chunks, self.group)  # [sp (sequence slice), b, h/sp, s, d]
        return gathered.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)

    def _shared_heads_to_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """[b, kv, s/sp, d] with kv < sp -> [b, 1, s, d]: k/v head i goes to the sp / kv ranks
        whose query heads share it, sent once to each (no copy repeated to sp heads)."""
        sp, (b, _, s, d) = self.sp, t.shape
        gathered = shared_all_to_all(t, self.group, sp // t.size(1))  # [sp, b, s/sp, d]
        return gathered.unsqueeze(2).permute(1, 2, 0, 3, 4).reshape(b, 1, sp * s, d)

    def _sequence_to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """The attention output [b, s, h/sp, d] -> [b, s/sp, h, d]."""
        sp, (b, s, h, d) = self.sp, t.shape
        chunks = t.reshape(b, sp, s // sp, h, d).transpose(0, 1).contiguous()
        gathered = all_to_all(chunks, self.group)  # [sp (head chunk), b, s/sp, h/sp, d]
        return gathered.permute(1, 2, 0, 3, 4).reshape(b, s // sp, sp * h, d)

    def _whole_positions(self, local: torch.Tensor | None) -> torch.Tensor:
        """The whole sequence's position ids, gathered once per forward (every layer of one
        forward, and its recomputation, gets the same local tensor object)."""
        if local is None:
            raise ValueError(
                "sequence parallelism needs the model to pass position_ids to its attention"
            )
        if local is not self._seen:
            parts = [torch.empty_like(local) for _ in range(self.sp)]
            dist.all_gather(parts, local.contiguous(), group=self.group)
            self._seen, self._positions, self._masks = local, torch.cat(parts, dim=1), {}
        assert self._positions is not None
        return self._positions

    def _mask(self, query: torch.Tensor, positions: torch.Tensor, sliding_window: Any) -> Any:
        """The mask transformers builds for the whole sequence and the inner implementation
        (None where it needs none: causal sdpa, flash); one per forward and kind."""
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        kind = (bool(sliding_window), query.dtype)
        if kind not in self._masks:
            build = create_sliding_window_causal_mask if sliding_window else create_causal_mask
            shape_only = query.new_empty((query.size(0), positions.size(1), 0))
            # config, inputs, attention mask, no cache: positional, as the cache's keyword is
            # `past_key_values` before transformers 5.24 and `cache` from it
            self._masks[kind] = build(
                self.mask_config,
                shape_only,
                None,
                None,
                position_ids=positions if self._mask_positions else None,
            )
        return self._masks[kind]


MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask")


def mask_follows_position_ids(modeling: Any) -> bool:
    """Whether a modeling module builds its attention masks from position ids (packed documents
    kept apart): every call of transformers' mask builders in its source (by name, or through a
    name bound to one: `mask_function = create_causal_mask if ...`) passes them. Llama, Qwen,
    Mistral, Gemma do; OPT and BioGPT build plain causal masks."""
    tree = ast.parse(inspect.getsource(modeling))
    builders = set(MASK_BUILDERS)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(n, ast.Name) and n.id in MASK_BUILDERS for n in ast.walk(node.value)
        ):
            builders |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None)) in builders
    ]
    return bool(calls) and all(
        any(k.arg in ("position_ids", None) for k in call.keywords) for call in calls
    )


def _eager_of(module: Any) -> Any:
    """The model's own eager attention (its modeling file's `eager_attention_forward`, which
    the model passes as the default of the interface)."""
    return sys.modules[type(module).__module__].eager_attention_forward


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 in equal chunks; its gradient is the same exchange back."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        t = t.contiguous()
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()  # its strides may be a permutation's; empty_like keeps them
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _SharedAllToAll(torch.autograd.Function):
    """Head i of [b, kv, s, d] to ranks i * copies ... i * copies + copies - 1 of `group`, in
    `copies` rounds of all_to_all_single: round j sends each head to the rank of its copies
    whose index is j (rank % copies == j), which receives one slice from every rank; the other
    ranks receive nothing. The send buffer is the kv heads, not their sp copies. Backward sends
    each rank's gradient back in the same rounds and sums the copies of each head."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: Any, copies: int) -> torch.Tensor:
        sp, me = dist.get_world_size(group), dist.get_rank(group)
        ctx.group, ctx.copies, ctx.sp, ctx.me = group, copies, sp, me
        heads = t.transpose(0, 1).contiguous()  # [kv, b, s, d]
        gathered = heads.new_empty((sp, *heads.shape[1:]))  # [sp (sequence slice), b, s, d]
        for j in range(copies):
            mine = me % copies == j
            received = gathered if mine else heads[:0]
            dist.all_to_all_single(
                received, heads, output_split_sizes=[int(mine)] * sp,
                input_split_sizes=[int(r % copies == j) for r in range(sp)], group=group,
            )  # fmt: skip
        return gathered

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        sp, copies, me = ctx.sp, ctx.copies, ctx.me
        grad = grad.contiguous()
        total: torch.Tensor | None = None
        for j in range(copies):
            mine = me % copies == j
            received = grad.new_empty((sp // copies, *grad.shape[1:]))  # [kv, b, s, d]
            dist.all_to_all_single(
                received, grad if mine else grad[:0],
                output_split_sizes=[int(r % copies == j) for r in range(sp)],
                input_split_sizes=[int(mine)] * sp, group=ctx.group,
            )  # fmt: skip
            total = received if total is None else total.add_(received)
        assert total is not None
        return total.transpose(0, 1), None, None


def shared_all_to_all(t: torch.Tensor, group: Any, copies: int) -> torch.Tensor:
    """[b, kv, s, d] -> [sp, b, s, d]: slice j of the result is sequence rank j's slice of
    this rank's k/v head, head rank // copies (see `_SharedAllToAll`)."""
    return _SharedAllToAll.apply(t, group, copies)


def all_to_all(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Chunk i of dim 0 goes to rank i of `group`; chunk j of the result came from rank j."""
    return _AllToAll.apply(t, group)


__all__ = [
    "ATTENTION_NAME",
    "all_to_all",
    "apply_sequence_parallel",
    "check_sequence_parallel",
    "concrete_sequence_parallel",
    "attention_of",
    "mask_follows_position_ids",
    "shared_all_to_all",
    "split_sequence",
]

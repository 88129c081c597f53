"""The degrees of parallelism of a run and the checks on them, torch-free (torchtitan's
`ParallelDims`): the planner, the config's checks before launch and the engine's device mesh
read the same arithmetic, so a split the planner offers is one the engine can run.

Three dimensions: data, sequence (Ulysses, trainer/parallel/sequence.py) and tensor
(trainer/parallel/tensor.py), the tensor innermost: rank r is tensor rank r % tensor, sequence
rank (r // tensor) % sequence, data rank r // (sequence x tensor). The ranks of a tensor group
are neighbours (within a node: its all-reduces run every layer), then those of a sequence group.
A fourth, expert (trainer/parallel/expert.py), takes its ranks from the data x sequence ranks:
token rank t is expert rank t % expert of expert-data rank t // expert (the ranks of an expert
group are neighbours; each expert-data rank holds a copy of the same experts).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.core.errors import ConfigError


@dataclass(frozen=True)
class AttentionShape:
    """What splitting a sequence around attention needs to know of a model (None: no heads,
    e.g. Mamba)."""

    heads: int | None
    kv_heads: int | None = None

    @classmethod
    def of_hf_config(cls, text_config: dict) -> AttentionShape:
        heads = text_config.get("num_attention_heads")
        kv = text_config.get("num_key_value_heads")
        return cls(int(heads) if heads else None, int(kv) if kv else None)


@dataclass(frozen=True)
class Batch:
    """How the global batch is cut: sequences per step, and per micro-batch (None: auto)."""

    global_size: int
    micro: int | None = None


@dataclass(frozen=True)
class ParallelDims:
    """The world as data x sequence x tensor ranks; `expert` of the data x sequence ranks split
    each MoE layer's experts."""

    world_size: int
    sequence: int = 1
    tensor: int = 1
    expert: int = 1

    @property
    def expert_data(self) -> int:
        """Copies of each expert: the token ranks over the expert degree (FSDP shards each
        expert over them)."""
        return self.token_ranks // self.expert

    @property
    def data(self) -> int:
        """Data-parallel groups: ranks that read different sequences."""
        return self.world_size // (self.sequence * self.tensor)

    @property
    def token_ranks(self) -> int:
        """The ranks that hold different tokens (data x sequence; a tensor group's ranks hold
        the same ones): what FSDP shards over and what a token count sums over."""
        return self.world_size // self.tensor

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(data rank, sequence rank) of a global rank."""
        return divmod(rank // self.tensor, self.sequence)

    def sequence_groups(self) -> list[list[int]]:
        """The global ranks of each sequence group, data rank by data rank."""
        sp, tp = self.sequence, self.tensor
        return [
            [first + s * tp for s in range(sp)]
            for start in range(0, self.world_size, sp * tp)
            for first in range(start, start + tp)
        ]

    def problem(self, attention: AttentionShape, seq_len: int, batch: Batch) -> str | None:
        """Why this sequence split cannot run the job, in words; None when it can (the tensor
        split is checked first, by `tensor_problem`: a tensor rank holds heads / tensor)."""
        sp, tp = self.sequence, self.tensor
        if sp < 1 or self.world_size % (sp * tp):
            ranks = "1 rank" if self.world_size == 1 else f"{self.world_size} ranks"
            split = f"{sp} x tensor {tp}" if tp > 1 else f"{sp}"
            return f"{split} does not divide the world of {ranks}"
        if sp == 1:
            return None if tp == 1 else self.batch_problem(batch)
        heads = attention.heads
        if heads is None:
            return f"{sp}: this model has no attention heads to split the sequence around"
        kv = attention.kv_heads or heads
        whose = "model's" if tp == 1 else f"{tp} tensor ranks' each"
        heads, kv = heads // tp, kv // tp
        if heads % sp:
            return f"{sp} does not divide the {whose} {heads} attention heads"
        if kv % sp and sp % kv:
            return (
                f"{sp} and the {whose} {kv} key/value heads do not divide one another (each "
                "rank needs whole key/value heads, repeated where there are fewer than sp)"
            )
        if seq_len % sp:
            return f"{sp} does not divide data.seq_len={seq_len} (every rank holds seq_len / sp)"
        return self.batch_problem(batch)

    def tensor_problem(self, attention: AttentionShape) -> str | None:
        """Why the tensor split cannot run this model, in words; None when it can: each tensor
        rank holds whole attention and key/value heads (transformers' column-wise q/k/v)."""
        tp = self.tensor
        if tp < 1 or self.world_size % tp:
            ranks = "1 rank" if self.world_size == 1 else f"{self.world_size} ranks"
            return f"{tp} does not divide the world of {ranks}"
        if tp == 1:
            return None
        if attention.heads is None:
            return f"{tp}: this model has no attention heads to split"
        kv = attention.kv_heads or attention.heads
        if attention.heads % tp or kv % tp:
            return (
                f"{tp} does not divide the model's {attention.heads} attention heads and {kv} "
                "key/value heads (each tensor rank holds whole ones)"
            )
        return None

    def expert_problem(self, num_experts: int) -> str | None:
        """Why the expert split cannot run this model, in words; None when it can: each expert
        rank holds whole experts, num_experts / expert of every MoE layer, and the expert ranks
        come from the ranks holding different tokens (data x sequence)."""
        ep = self.expert
        if ep == 1:
            return None
        if self.tensor > 1:
            tp = self.tensor
            return f"{ep} with parallel.tensor={tp}: expert and tensor parallel do not combine"
        if ep < 1 or self.token_ranks % ep:
            return f"{ep} does not divide the {self.token_ranks} data x sequence ranks"
        if num_experts == 0:
            return f"{ep}: this model has no experts to split"
        if num_experts % ep:
            return f"{ep} does not divide the model's {num_experts} experts per MoE layer"
        return None

    def batch_problem(self, batch: Batch) -> str | None:
        """Why the data groups cannot share the global batch evenly; None when they can."""
        cut = f"{self.sequence}" + (f" x tensor {self.tensor}" if self.tensor > 1 else "")
        if batch.global_size % self.data:
            return (
                f"the {self.data} data groups ({self.world_size} ranks / {cut}) do not divide "
                f"train.global_batch_size={batch.global_size}"
            )
        if batch.micro and (batch.global_size // self.data) % batch.micro:
            return (
                f"train.micro_batch_size={batch.micro} does not divide each of the {self.data} "
                f"data groups' {batch.global_size // self.data} sequences"
            )
        return None


def sequence_sizes(
    world_size: int, attention: AttentionShape, seq_len: int, batch: Batch, tensor: int = 1
) -> list[int]:
    """Every sequence group size that runs the job on `world_size` ranks (split `tensor` ways
    too), smallest first (1 wherever the world divides the batch)."""
    sizes = []
    for sp in range(1, world_size // max(1, tensor) + 1):
        dims = ParallelDims(world_size, sp, tensor)
        if dims.problem(attention, seq_len, batch) is None and dims.batch_problem(batch) is None:
            sizes.append(sp)
    return sizes


def check_sequence_parallel(
    dims: ParallelDims, attention: AttentionShape, seq_len: int, batch: Batch
) -> None:
    """ConfigError (one line, exit 2) when `dims` cannot run the job; the fix names only sizes
    that pass this same check."""
    problem = dims.problem(attention, seq_len, batch)
    if problem is None:
        return
    sizes = [
        str(sp) for sp in sequence_sizes(dims.world_size, attention, seq_len, batch, dims.tensor)
    ]
    fix = (
        f"use sequence_parallel={' or '.join(sizes)}"
        if sizes
        else "change the device count or train.global_batch_size"
    )
    raise ConfigError("sequence_parallel", problem, fix)


def tensor_sizes(world_size: int, attention: AttentionShape) -> list[int]:
    """Every tensor degree that splits this model's heads on `world_size` ranks, smallest
    first."""
    return [
        tp
        for tp in range(1, world_size + 1)
        if ParallelDims(world_size, 1, tp).tensor_problem(attention) is None
    ]


def check_tensor_parallel(dims: ParallelDims, attention: AttentionShape) -> None:
    """ConfigError (one line, exit 2) when the tensor degree cannot split this model; the fix
    names the degrees that can."""
    problem = dims.tensor_problem(attention)
    if problem is None:
        return
    sizes = " or ".join(str(tp) for tp in tensor_sizes(dims.world_size, attention))
    raise ConfigError("parallel.tensor", problem, f"use parallel.tensor={sizes}")


def expert_sizes(world_size: int, num_experts: int) -> list[int]:
    """Every expert degree that splits this model's experts on `world_size` ranks (no tensor
    split), smallest first (1 always)."""
    return [
        ep
        for ep in range(1, world_size + 1)
        if ParallelDims(world_size, 1, 1, ep).expert_problem(num_experts) is None
    ]


def check_expert_parallel(dims: ParallelDims, num_experts: int) -> None:
    """ConfigError (one line, exit 2) when the expert degree cannot split this model; the fix
    names the degrees that can."""
    problem = dims.expert_problem(num_experts)
    if problem is None:
        return
    if dims.tensor > 1:
        raise ConfigError("parallel.expert", problem, "set parallel.tensor=1, or parallel.expert=1")
    sizes = " or ".join(str(ep) for ep in expert_sizes(dims.world_size, num_experts))
    raise ConfigError("parallel.expert", problem, f"use parallel.expert={sizes}")

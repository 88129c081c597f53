"""The rank's share of the global batch: which sequences its data rank reads, the slice of each
its sequence rank holds, and how that share is cut into micro-batches (the OOM back-off,
trainer/backoff.py, re-cuts it; the share never changes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.core.parallel_dims import ParallelDims
from trainer.memory.levers import MemoryLevers
from trainer.parallel.sequence import split_sequence


@dataclass
class BatchSplit:
    """How this rank's share of the global batch is cut: the share of its data rank (`dims` and
    `rank`: which sequences, and the slice of every sequence it holds; `sequence_group`: the
    process group its attention exchanges over), micro-batch x accumulation, and which layers
    recompute their activations.

    The OOM back-off changes the cut and the recomputation, never the share: what is learned
    stays the same.
    """

    dims: ParallelDims
    rank: int
    sequence_group: Any  # None at sequence parallel 1
    per_rank: int  # sequences of the data rank's share
    micro_batch_size: int
    activation_checkpointing: str = "none"
    eval_batch_size: int = 0
    levers: MemoryLevers | None = None  # chunked loss, activation offload: set once built
    token_group: Any = None  # the ranks holding other tokens (None: all; trainer/parallel/mesh.py)

    def __post_init__(self) -> None:
        self.eval_batch_size = self.eval_batch_size or self.micro_batch_size

    @property
    def grad_accum(self) -> int:
        return self.per_rank // self.micro_batch_size

    @property
    def data_rank(self) -> int:
        return self.dims.coordinates(self.rank)[0]

    def sliced(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slice of every sequence of `batch` (the whole of each at sp=1)."""
        return split_sequence(batch, self.dims, self.rank)

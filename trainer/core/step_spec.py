"""One training step as the estimator, the cost model and the tracer see it: the rung, the world,
the micro-batch and sequence, precision, checkpointing, the exact levers and the fine-tune method.

A plan makes one `StepSpec` per candidate it weighs; `launcher/estimate/peak.py` turns it into
bytes, `launcher/plan/cost.py` into seconds and `launcher/estimate/trace.py` into a traced step of
the engine. The model's shape travels beside it (`launcher/estimate/shape.py`), derived once per
plan. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.core import strategies
from trainer.core.strategies import Strategy

# Activation offload on CUDA (trainer/memory/offload.py): saved tensors stay on the device until
# their copy to the host is done; at most this many bytes, and at most the tensors of the last
# this many layers, wait so. The estimate counts them (launcher/estimate/peak.py).
OFFLOAD_MAX_IN_FLIGHT_BYTES = 1 << 30
OFFLOAD_LAYERS_IN_FLIGHT = 2


@dataclass(frozen=True)
class Finetune:
    """What trains and how its optimizer stores state and steps (`finetune.*`,
    `train.optimizer`, `train.optimizer_in_backward`)."""

    method: str = "full"
    optimizer: str = "adamw"
    in_backward: bool = False  # each parameter stepped, and its gradient freed, in backward
    r: int = 16
    target_modules: str | tuple[str, ...] = "all-linear"
    dropout: float = 0.0
    pretrained: bool = True  # the base loads from model.name_or_path (random init: False)

    @classmethod
    def of(cls, cfg: Any) -> Finetune:
        lora = cfg.finetune.lora
        targets = lora.target_modules
        return cls(
            method=cfg.finetune.method,
            optimizer=cfg.train.optimizer,
            in_backward=cfg.train.optimizer_in_backward,
            r=lora.r,
            target_modules=targets if isinstance(targets, str) else tuple(targets),
            dropout=lora.dropout,
            pretrained=cfg.model.name_or_path is not None,
        )

    @property
    def adapters(self) -> bool:
        return self.method != "full"

    def words(self) -> str:
        return _words(
            (f"finetune.method={self.method}", self.method != "full"),
            (f"train.optimizer={self.optimizer}", self.optimizer != "adamw"),
            ("train.optimizer_in_backward=true", self.in_backward),
            none="full fine-tuning with AdamW",
        )


FULL = Finetune()


@dataclass(frozen=True)
class Levers:
    """The exact levers of one candidate plan."""

    chunked_loss: bool = False
    offload_activations: bool = False

    def words(self) -> str:
        return _words(
            ("chunked loss", self.chunked_loss), ("activation offload", self.offload_activations)
        )


NO_LEVERS = Levers()


def lever_variants(
    chunked_loss: object, offload_activations: object, device: str = "cuda"
) -> list[Levers]:
    """The combinations the planner tries: each `auto` lever off and on, a forced one as set;
    cheapest first (off before on, chunked loss before offload). CPU ranks keep their
    activations in host memory anyway: `auto` does not offload them."""
    chunked = (False, True) if chunked_loss == "auto" else (bool(chunked_loss),)
    offload = (False, True) if offload_activations == "auto" else (bool(offload_activations),)
    if offload_activations == "auto" and device == "cpu":
        offload = (False,)
    return [Levers(c, o) for o in offload for c in chunked]


def smallest_levers(chunked_loss: object, offload_activations: object) -> Levers:
    """The combination with the smallest footprint (a forced rung that may not fit)."""
    return lever_variants(chunked_loss, offload_activations)[-1]


@dataclass(frozen=True)
class LongContext:
    """How one candidate splits the model's work beyond data parallel: each sequence over
    `sequence_parallel` ranks (Ulysses), the MLP over chunks (`tiled_mlp`), each layer's
    projections over `tensor_parallel` ranks (trainer/parallel/tensor.py)."""

    sequence_parallel: int = 1
    tiled_mlp: bool = False
    tensor_parallel: int = 1

    @classmethod
    def of(cls, cfg: Any) -> LongContext:
        """The config's own: `auto` is 1 and off (what the engine runs without a plan)."""
        sp, tiled, tp = cfg.sequence_parallel, cfg.memory.tiled_mlp, cfg.parallel.tensor
        return cls(
            sp if isinstance(sp, int) else 1, tiled is True, tp if isinstance(tp, int) else 1
        )

    def words(self) -> str:
        return _words(
            (f"tensor parallel {self.tensor_parallel}", self.tensor_parallel > 1),
            (f"sequence parallel {self.sequence_parallel}", self.sequence_parallel > 1),
            ("tiled MLP", self.tiled_mlp),
        )


SHORT = LongContext()


@dataclass(frozen=True)
class StepSpec:
    """What one rank runs in one optimizer step: `grad_accum` micro-batches of
    `micro_batch_size` sequences of `seq_len` tokens on the rung `strategy` over `world_size`
    ranks (`devices_per_node` of them per node; 0: all on one node). With sequence parallelism
    the rank holds `local_seq_len` tokens of each of those sequences."""

    strategy: str
    world_size: int
    micro_batch_size: int
    seq_len: int
    activation_checkpointing: str  # none | selective | full
    precision: str = "bf16"
    grad_accum: int = 1
    devices_per_node: int = 0
    device: str = "cuda"
    packed: bool = True  # windows hold several documents: attention gets a block-causal mask
    # flex_attention on packed windows: a sparse block mask instead of the dense one
    block_mask: bool = False
    # FSDP reduce-scatters after every micro-batch and accumulates sharded gradients, instead of
    # accumulating unsharded ones under no-sync
    fsdp_reduce_every_micro_batch: bool = False
    chunked_loss: bool = False
    offload_activations: bool = False
    loss_chunk_tokens: int | None = None  # memory.loss_chunk_tokens (None: chosen by vocabulary)
    finetune: Finetune = FULL
    # Ulysses (trainer/parallel/sequence.py): each sequence split over this many ranks,
    # each holding seq_len / sequence_parallel tokens of it through every layer
    sequence_parallel: int = 1
    tiled_mlp: bool = False  # trainer/memory/tiled_mlp.py: MLP chunks, recomputed in backward
    # each layer's projections split over this many ranks (trainer/parallel/tensor.py): a rank
    # holds and computes 1/tensor_parallel of them; FSDP shards over the other ranks
    tensor_parallel: int = 1
    mlp_chunk_tokens: int | None = None  # memory.mlp_chunk_tokens (None: the hidden size)
    # sequences per example: 2 under a preference objective (micro-batches count pairs)
    sequences_per_example: int = 1
    # DPO's reference (trainer/core/methods.py): adapters_off adds a no-grad forward per
    # micro-batch; precomputed, one no-grad pass over the data before step 1; None: no reference
    reference: str | None = None
    checkpointed_layers: int | None = None  # selective: how many (None: every other layer)
    # selective at op level: every layer, its matmuls' and attention's outputs saved
    checkpoint_ops: bool = False
    # FlashAttention-2 attends (SDPA's flash kernel on CUDA in 16-bit without a mask, or
    # flash-attn's): its backward allocates buffers (launcher/estimate/attention_kernels.py)
    flash_attention: bool = False
    # train.compile: the decoder layers run torch.compiled (launcher/estimate/compiled_layers.py)
    compiled_layers: bool = False
    # what a launch probe measured of the runtime overhead on this hardware and rung
    # (launcher/plan/calibration.py): the fixed bytes, and on CUDA the allocator's reserve per
    # transient byte; None: the estimate's own figures
    runtime_fixed_bytes: int | None = None
    reserve_ratio: float | None = None

    @property
    def row(self) -> Strategy:
        return strategies.row(self.strategy)

    @property
    def checkpointing_words(self) -> str:
        """'none', 'full', 'selective', or 'selective (24 layers)' with a count."""
        count = self.checkpointed_layers
        level = self.activation_checkpointing
        if level == "selective" and self.checkpoint_ops:
            return f"{level} (matmul and attention outputs saved)"
        if level != "selective" or not count:
            return level
        return f"{level} ({count} layer{'' if count == 1 else 's'})"

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the compute dtype."""
        return 4 if self.precision == "fp32" else 2

    @property
    def trained_bytes(self) -> int:
        """Bytes per element of what trains (weights, gradients, each AdamW moment): fp32
        masters, or bf16 under `precision: bf16_pure` (no fp32 copy anywhere)."""
        return 2 if self.precision == "bf16_pure" else 4

    @property
    def ranks_per_node(self) -> int:
        return min(self.devices_per_node or self.world_size, self.world_size)

    @property
    def num_sequences(self) -> int:
        """Sequences of one micro-batch (a preference pair is two)."""
        return self.micro_batch_size * self.sequences_per_example

    @property
    def local_seq_len(self) -> int:
        """Tokens of each sequence this rank holds: its slice under sequence parallelism."""
        return self.seq_len // max(1, self.sequence_parallel)

    @property
    def data_ranks(self) -> int:
        """Data-parallel groups: the ranks of a sequence or tensor group read the same
        sequences."""
        return max(1, self.world_size // max(1, self.sequence_parallel * self.tensor_parallel))

    @property
    def shard_ranks(self) -> int:
        """The ranks a sharded rung shards over: all of them, or those of one tensor rank."""
        return max(1, self.world_size // max(1, self.tensor_parallel))

    @property
    def levers(self) -> Levers:
        return Levers(self.chunked_loss, self.offload_activations)

    @property
    def long_context(self) -> LongContext:
        return LongContext(self.sequence_parallel, self.tiled_mlp, self.tensor_parallel)


def _words(*named: tuple[str, bool], none: str = "none") -> str:
    """The names whose flag is set, joined with "and"; `none` when no flag is."""
    return " and ".join(name for name, on in named if on) or none


@dataclass(frozen=True)
class OptimizerSpec:
    """AdamW and its hyper-parameters; identical on every rung (escalation never changes them)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    grad_clip: float  # max total grad norm; 0 disables clipping
    name: str = "adamw"  # train.optimizer: adamw | adamw_8bit | paged_adamw_8bit (trainer/optim.py)
    bf16_pure: bool = False  # precision: bf16_pure: bf16 states, stochastically rounded step
    in_backward: bool = False  # train.optimizer_in_backward: step each parameter in backward

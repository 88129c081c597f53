"""The job config's schema: one small pydantic model per section, strict keys.

pydantic v2 rather than dataclasses: it gives strict keys (`extra="forbid"`), typed coercion and
range checks for free, and its error locations name the exact key, which is what the one-line
error message needs. Everything else in oomless reads this tree and never re-validates.

A field marked `Annotated[..., LEARNED]` decides what is learned: a resume refuses a change of it
(trainer/core/config/resume.py derives the list from these marks).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from trainer.core import strategies
from trainer.core.config.base import Section
from trainer.core.config.debug import DebugConfig
from trainer.core.config.paths import is_dir
from trainer.core.units import parse_size


@dataclass(frozen=True)
class Learned:
    """The mark of a key that decides what is learned (its value, or the whole section's)."""


LEARNED = Learned()

_SLURM_TIME_RE = re.compile(r"^(\d+|\d+:\d{2}(:\d{2})?|\d+-\d{1,2}(:\d{2}(:\d{2})?)?)$")
# Kubernetes names (RFC 1123): a label is at most 63 of these; a subdomain joins labels with dots
_K8S_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_K8S_SUBDOMAIN_RE = re.compile(rf"^{_K8S_LABEL}(\.{_K8S_LABEL})*$")


_Section = Section


class ModelConfig(_Section):
    name_or_path: Annotated[str | None, LEARNED] = None
    config: Annotated[dict[str, Any] | None, LEARNED] = None
    tokenizer: str | None = None
    # auto: the planner's (an exact lever: sdpa, or at long context on GPUs an implementation
    # that keeps packed documents apart without a dense mask); sdpa without a plan
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "flex_attention"] = (
        "auto"
    )
    # opt-in context extension: the mapping transformers' config takes (trainer/core/hf_config.py)
    rope_scaling: Annotated[dict[str, Any] | None, LEARNED] = None
    trust_remote_code: bool = False
    revision: Annotated[str | None, LEARNED] = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.name_or_path is None) == (self.config is None):
            raise ValueError(
                "set exactly one of model.name_or_path (pretrained) or model.config (inline HF "
                "config, random init)"
            )
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("model.config needs a model_type (e.g. llama, qwen2, mistral)")
        return self


class DataConfig(_Section):
    path: Annotated[str, LEARNED]
    # preference: {prompt, chosen, rejected} pairs (strings, or chat message lists), for
    # the preference objectives (`objective.type`: dpo, orpo, simpo)
    format: Annotated[Literal["text", "prompt_completion", "chat", "preference"], LEARNED] = "text"
    seq_len: Annotated[int, LEARNED] = Field(2048, ge=8)
    text_field: Annotated[str, LEARNED] = "text"
    prompt_field: Annotated[str, LEARNED] = "prompt"
    completion_field: Annotated[str, LEARNED] = "completion"
    messages_field: Annotated[str, LEARNED] = "messages"
    chosen_field: Annotated[str, LEARNED] = "chosen"
    rejected_field: Annotated[str, LEARNED] = "rejected"
    # .txt files: a file is one document | blocks between blank lines | every non-blank line
    text_unit: Literal["document", "paragraph", "line"] = "document"
    eval_path: str | None = None
    eval_fraction: Annotated[float, LEARNED] = Field(0.0, ge=0.0, lt=1.0)
    pack: Annotated[bool, LEARNED] = True
    on_bad_row: Literal["error", "skip"] = "error"
    cache_dir: str | None = None
    append_eos: Annotated[bool, LEARNED] = True
    # the longest line a jsonl/txt data file may have ("4MiB" or bytes); a longer one exits 2
    max_line_bytes: int = 2**20

    @field_validator("max_line_bytes", mode="before")
    @classmethod
    def _line_size(cls, v: Any) -> int:
        return parse_size(v)


class TrainConfig(_Section):
    steps: int = Field(1000, ge=1)
    global_batch_size: Annotated[int, LEARNED] = Field(64, ge=1, le=2**20)
    micro_batch_size: int | Literal["auto"] = "auto"
    lr: Annotated[float, LEARNED] = Field(2e-5, gt=0.0)
    min_lr_ratio: Annotated[float, LEARNED] = Field(0.1, ge=0.0, le=1.0)
    schedule: Annotated[Literal["cosine", "linear", "constant"], LEARNED] = "cosine"
    warmup_steps: Annotated[int, LEARNED] = Field(0, ge=0)
    weight_decay: Annotated[float, LEARNED] = Field(0.0, ge=0.0)
    betas: Annotated[tuple[float, float], LEARNED] = (0.9, 0.95)
    eps: Annotated[float, LEARNED] = Field(1e-8, gt=0.0)
    grad_clip: Annotated[float, LEARNED] = Field(1.0, ge=0.0)
    seed: Annotated[int, LEARNED] = Field(0, ge=0)
    eval_every: int = Field(0, ge=0)
    eval_batches: int = Field(8, ge=1)
    log_every: int = Field(1, ge=1)
    deterministic: bool = False
    compile: bool = False  # torch.compile each decoder layer (single, ddp, fsdp rungs)
    # adamw: fp32 moments; adamw_8bit: 8-bit moments with block scales (bitsandbytes)
    optimizer: Annotated[Literal["adamw", "adamw_8bit", "paged_adamw_8bit"], LEARNED] = "adamw"
    # opt-in: step each parameter as soon as its gradient is ready and free that gradient
    # (needs accumulation 1 and train.grad_clip=0; trainer/optim.py)
    optimizer_in_backward: bool = False

    @field_validator("micro_batch_size")
    @classmethod
    def _positive_micro(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be >= 1 or auto")
        return v

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("both betas must be in [0, 1)")
        return v


class ObjectiveConfig(_Section):
    """What the loss rewards (docs/preference.md). sft: next-token cross-entropy. On
    {prompt, chosen, rejected} pairs: dpo (the sigmoid loss against a reference's log-probs),
    orpo (the odds-ratio term on top of the chosen half's cross-entropy, no reference), simpo
    (the length-normalised margin, no reference)."""

    type: Literal["sft", "dpo", "orpo", "simpo"] = "sft"
    beta: float = Field(0.1, gt=0.0)
    # SimPO's target margin (gamma, in reward units; TRL's simpo_gamma)
    simpo_gamma: float = Field(0.5, ge=0.0)

    @property
    def preference(self) -> bool:
        return self.type != "sft"

    @property
    def needs_reference(self) -> bool:
        return self.type == "dpo"


class LoraConfig(_Section):
    r: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0.0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # "all-linear" (every linear layer of the decoder blocks) or a list of module names
    target_modules: Literal["all-linear"] | list[str] = "all-linear"

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and not v:
            raise ValueError("is empty; give module names (e.g. [q_proj, v_proj]) or all-linear")
        return v


class FinetuneConfig(_Section):
    # full: every weight trains; lora: low-rank adapters on a frozen base in the compute dtype;
    # qlora: adapters on a 4-bit NF4 base. These change what is learned: the planner never picks
    # them, it names them when a full fine-tune does not fit.
    method: Annotated[Literal["full", "lora", "qlora"], LEARNED] = "full"
    lora: Annotated[LoraConfig, LEARNED] = Field(default_factory=LoraConfig)


class MemoryConfig(_Section):
    activation_checkpointing: Literal["auto", "none", "selective", "full"] = "auto"
    # selective: how many decoder layers are checkpointed, spread over the depth; auto: the
    # fewest that fit (the planner), every other layer where no plan chose
    checkpointed_layers: Literal["auto"] | int = "auto"
    # selective: some layers whole (`layers`), or every layer at op level, the matmuls' and
    # attention's outputs saved and the rest recomputed (`ops`); auto: the planner
    selective: Literal["auto", "layers", "ops"] = "auto"
    # Exact levers (docs/memory.md): the LM head and loss over chunks of tokens; the decoder
    # layers' saved activations in host memory between forward and backward. auto: the planner.
    chunked_loss: Literal["auto"] | bool = "auto"
    offload_activations: Literal["auto"] | bool = "auto"
    # each decoder layer's MLP over chunks of the sequence, each recomputed in backward
    # (trainer/memory/tiled_mlp.py); auto: the planner (off in the engine until it chooses)
    tiled_mlp: Literal["auto"] | bool = "auto"
    mlp_chunk_tokens: int | None = Field(None, ge=1)  # tokens per MLP chunk; None: hidden size
    loss_chunk_tokens: int | None = Field(None, ge=1)  # tokens per chunk; None: by vocabulary
    headroom: float | None = Field(None, ge=0.0, lt=0.9)  # plan.headroom's old name

    @field_validator("checkpointed_layers")
    @classmethod
    def _positive_layers(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be >= 1 or auto")
        return v


class HardwareConfig(_Section):
    device: Literal["auto", "cuda", "cpu"] = "auto"
    nodes: int = Field(1, ge=1)
    devices_per_node: int | None = Field(None, ge=1)
    device_memory: int | None = None
    host_memory: int | None = None
    # Effective bandwidths for the planner's cost model, bytes per second ("150GB" = 150e9/s);
    # defaults in launcher/plan/planner.py (docs/planner.md).
    intra_node_bandwidth: int | None = None
    inter_node_bandwidth: int | None = None
    pcie_bandwidth: int | None = None
    nvme_bandwidth: int | None = None

    @field_validator(
        "device_memory",
        "host_memory",
        "intra_node_bandwidth",
        "inter_node_bandwidth",
        "pcie_bandwidth",
        "nvme_bandwidth",
        mode="before",
    )
    @classmethod
    def _size(cls, v: Any) -> int | None:
        return None if v is None else parse_size(v)


class RunConfig(_Section):
    dir: str = "runs/default"
    checkpoint_every: int = Field(100, ge=0)
    keep_checkpoints: int = Field(2, ge=1)
    async_checkpoint: bool = False
    resume: str = "auto"  # auto | never | a checkpoint directory
    save_final: bool = True
    # experiment trackers rank 0 sends metrics.jsonl's records to (trainer/observe/trackers.py)
    trackers: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        default_factory=list
    )
    name: str | None = None  # the run's name in the trackers (default: run.dir's name)
    # A step that runs longer than this is a hang: every rank's stack to run.dir/hang/, exit 124
    # (trainer/runtime/hang.py). auto: 10 x the slowest step so far, at least 5 minutes.
    hang_timeout_s: int | Literal["auto"] = "auto"
    # `oomless train` restarts from the last checkpoint after a hang or a lost node this many
    # times (auto: 3); an out-of-memory climbs the ladder instead (escalation.max_attempts)
    max_restarts: int | Literal["auto"] = "auto"

    @property
    def num_restarts_allowed(self) -> int:
        """max_restarts with `auto` made concrete (3)."""
        return 3 if self.max_restarts == "auto" else self.max_restarts

    @field_validator("hang_timeout_s", "max_restarts")
    @classmethod
    def _whole_or_auto(cls, v: int | str, info: ValidationInfo) -> int | str:
        least = 1 if info.field_name == "hang_timeout_s" else 0
        if isinstance(v, int) and v < least:
            raise ValueError(f"must be >= {least} or auto")
        return v

    @field_validator("resume")
    @classmethod
    def _resume(cls, v: str) -> str:
        if v not in ("auto", "never") and not is_dir(Path(v).expanduser()):
            raise ValueError(f"'{v}' is neither auto, never nor an existing checkpoint directory")
        return v


class FsdpConfig(_Section):
    reshard_after_forward: bool = True
    hybrid: bool = False
    # Gradient accumulation: false keeps unsharded fp32 gradients on every rank until the last
    # micro-batch and reduce-scatters once (least communication, 4 bytes per parameter more);
    # true reduce-scatters after every micro-batch. auto: the planner picks false if it fits.
    reduce_every_micro_batch: bool | Literal["auto"] = "auto"


class DeepSpeedConfig(_Section):
    nvme_path: str | None = None
    overrides: dict[str, Any] = Field(default_factory=dict)


class DistConfig(_Section):
    timeout_s: int = Field(600, ge=1)
    max_restarts: int = Field(0, ge=0)


class ElasticConfig(_Section):
    """With `min_nodes`, a run that loses nodes goes on with those left (at least min_nodes):
    re-planned for them, same global batch, resumed from the last checkpoint
    (docs/resilience.md)."""

    min_nodes: int | None = Field(None, ge=1)


class EscalationConfig(_Section):
    enabled: bool = True
    max_attempts: int = Field(3, ge=0)


class SlurmConfig(_Section):
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "24:00:00"
    constraint: str | None = None
    grace_s: int = Field(120, ge=10)
    extra: list[str] = Field(default_factory=list)
    setup: list[str] = Field(default_factory=list)

    @field_validator("time", mode="before")
    @classmethod
    def _time(cls, v: object) -> str:
        if isinstance(v, int) and not isinstance(v, bool):
            v = str(v)  # `slurm.time=30` on the command line or `time: 30` in YAML: minutes
        if not isinstance(v, str) or not _SLURM_TIME_RE.match(v):
            raise ValueError(f"'{v}' is not a Slurm time; write MINUTES, HH:MM:SS or D-HH:MM:SS")
        return v


class K8sConfig(_Section):
    """`oomless submit --k8s` / `plan --emit trainjob`: a Kubeflow Trainer v2 TrainJob
    (launcher/k8s/trainjob.py). `image` and `pvc` are required there, checked where used."""

    image: str | None = None  # an image with oomless installed; what every node's pod runs
    pvc: str | None = None  # the PersistentVolumeClaim that holds run.dir (mounted at /runs)
    namespace: str | None = None  # else kubectl's current namespace
    queue: str | None = None  # Kueue LocalQueue: label kueue.x-k8s.io/queue-name

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        if v is not None and (not v or len(v) > 500 or any(c.isspace() for c in v)):
            raise ValueError(
                f"{v!r} is not an image reference; write REGISTRY/IMAGE:TAG (no blanks, at most "
                "500 characters)"
            )
        return v

    @field_validator("pvc", "namespace", "queue")
    @classmethod
    def _kubernetes_name(cls, v: str | None, info: ValidationInfo) -> str | None:
        """A PVC's name is a DNS subdomain (dots allowed, 253); a namespace's a label (63); a
        Kueue queue's is both a LocalQueue name and a label value, so a label too."""
        dots = info.field_name == "pvc"
        longest = 253 if dots else 63
        if v is not None and not (
            len(v) <= longest and _K8S_SUBDOMAIN_RE.match(v) and (dots or "." not in v)
        ):
            chars = (
                "lowercase letters, digits, '-' and '.'"
                if dots
                else "lowercase letters, digits and '-'"
            )
            raise ValueError(
                f"{v!r} is not a Kubernetes name; use at most {longest} {chars}, starting and "
                "ending with a letter or digit"
            )
        return v


def _a_degree(v: int | str) -> int | str:
    if isinstance(v, int) and v < 1:
        raise ValueError("must be >= 1 or auto")
    return v


# ranks that split something; auto: the planner's choice (1 in the engine until it chooses)
Degree = Annotated[Literal["auto"] | int, AfterValidator(_a_degree)]


class PlanConfig(_Section):
    # the share of device and host memory the planner leaves free beyond the estimate (which
    # already holds the allocator's reserve); auto: 10%, 5% on the device once a probe of this
    # hardware calibrated the estimate (launcher/plan/headroom.py)
    headroom: Literal["auto"] | Annotated[float, Field(ge=0.0, lt=0.9)] = "auto"


class ParallelConfig(_Section):
    # ranks that split each sequence (Ulysses, trainer/parallel/sequence.py); changes where
    # tokens live, never what is learned (the degrees of trainer/core/parallel_dims.py)
    sequence: Degree = "auto"
    # ranks that split each layer's projections (transformers' plan for the architecture,
    # trainer/parallel/tensor.py); inside a node; never changes what is learned
    tensor: Degree = "auto"
    # ranks that split each MoE layer's experts, taken from the data x sequence ranks
    # (transformers' plan for the architecture, trainer/parallel/expert.py); never changes what
    # is learned; auto: 1 until the planner weighs it
    expert: Degree = "auto"


class JobConfig(_Section):
    model: ModelConfig
    data: DataConfig
    train: TrainConfig = Field(default_factory=TrainConfig)
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)
    objective: Annotated[ObjectiveConfig, LEARNED] = Field(default_factory=ObjectiveConfig)
    # bf16_pure: opt-in, lossy: bf16 weights, gradients and AdamW state, no fp32 master
    precision: Annotated[Literal["bf16", "fp16", "fp32", "bf16_pure"], LEARNED] = "bf16"
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    plan: PlanConfig = Field(default_factory=PlanConfig)
    strategy: str = "auto"  # auto or a row of trainer/core/strategies.py
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    sequence_parallel: Degree = "auto"  # parallel.sequence's old name (either sets both: checks.py)
    hardware: HardwareConfig = Field(default_factory=HardwareConfig)
    debug: DebugConfig = Field(default_factory=DebugConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig)
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    dist: DistConfig = Field(default_factory=DistConfig)
    escalation: EscalationConfig = Field(default_factory=EscalationConfig)
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    k8s: K8sConfig = Field(default_factory=K8sConfig)

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, v: str) -> str:
        allowed = ("auto", *strategies.names())
        if v not in allowed:
            close = difflib.get_close_matches(v, allowed, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ValueError(f"'{v}' is not a strategy; {hint}use one of {', '.join(allowed)}")
        return v

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

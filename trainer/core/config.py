"""The job config: one typed tree, strict keys, validated once at the boundary.

pydantic v2 rather than dataclasses: it gives strict keys (`extra="forbid"`), typed coercion and
range checks for free, and its error locations name the exact key, which is what the one-line
error message needs. Everything else in oomless reads this tree and never re-validates.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import math
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainer.core import methods, strategies
from trainer.core.contract import CONFIG_FILE
from trainer.core.errors import ConfigError
from trainer.core.hf_config import hf_config_dict
from trainer.core.units import parse_size


class _YamlLoader(yaml.SafeLoader):
    """`yaml.safe_load` without YAML 1.1's base-60 numbers: `time: 12:00:00` stays a string.

    PyYAML reads `12:00:00` as the integer 43200 (sexagesimal), which would turn a Slurm time of
    twelve hours into 43200 minutes; and it reads `1e-4` as a string (no dot). Numbers resolve
    as in YAML 1.2 instead; everything else as in `yaml.safe_load`.
    """


_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(
    _INT_TAG,
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_YamlLoader.add_implicit_resolver(  # after int: YAML 1.2 floats, `1e-4` and `3e5` included
    _FLOAT_TAG,
    re.compile(
        r"^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


# Bounds on a job file: a real one is a few KiB with a few hundred values. A file over the size
# limit, or whose aliases expand past the value limit (a "billion laughs" file is a few hundred
# bytes that expand to 10**9 values), is refused before anything walks the tree.
MAX_CONFIG_BYTES = 2**20
MAX_YAML_VALUES = 100_000


class YamlLimitError(ValueError):
    """YAML that parses but is over a bound (aliases that expand too far, nesting too deep)."""


class _BoundedYamlLoader(_YamlLoader):
    def construct_document(self, node: yaml.Node) -> Any:
        if _num_values(node, {}, set()) > MAX_YAML_VALUES:
            raise YamlLimitError(
                f"expands to more than {MAX_YAML_VALUES:,} values through its aliases (*name)"
            )
        return super().construct_document(node)


def _num_values(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """Values under `node` with every alias expanded, counted once per distinct node (so a
    billion-laughs file costs its size, not its expansion); capped just above the limit."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        raise YamlLimitError("holds an alias that refers to itself")
    open_nodes.add(id(node))
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    total = 1
    for child in children:
        total = min(total + _num_values(child, sizes, open_nodes), MAX_YAML_VALUES + 1)
    open_nodes.discard(id(node))
    sizes[id(node)] = total
    return total


def read_yaml(text: str) -> Any:
    """Parse YAML safely (no Python objects), without base-60 numbers; YamlLimitError when its
    aliases expand past MAX_YAML_VALUES values or it nests too deep to parse."""
    try:
        return yaml.load(text, Loader=_BoundedYamlLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise YamlLimitError("nests too deep to read") from None


_SLURM_TIME_RE = re.compile(r"^(\d+|\d+:\d{2}(:\d{2})?|\d+-\d{1,2}(:\d{2}(:\d{2})?)?)$")


class _Section(BaseModel):
    # allow_inf_nan=False: `lr: inf` or `"nan"` is refused (a non-finite value trains NaN weights)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(_Section):
    name_or_path: str | None = None
    config: dict[str, Any] | None = None
    tokenizer: str | None = None
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = "sdpa"
    trust_remote_code: bool = False
    revision: str | None = None

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
    path: str
    format: Literal["text", "prompt_completion", "chat"] = "text"
    seq_len: int = Field(2048, ge=8)
    text_field: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    # .txt files: a file is one document | blocks between blank lines | every non-blank line
    text_unit: Literal["document", "paragraph", "line"] = "document"
    eval_path: str | None = None
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    pack: bool = True
    on_bad_row: Literal["error", "skip"] = "error"
    cache_dir: str | None = None
    append_eos: bool = True
    # the longest line a jsonl/txt data file may have ("4MiB" or bytes); a longer one exits 2
    max_line_bytes: int = 2**20

    @field_validator("max_line_bytes", mode="before")
    @classmethod
    def _line_size(cls, v: Any) -> int:
        return parse_size(v)


class TrainConfig(_Section):
    steps: int = Field(1000, ge=1)
    global_batch_size: int = Field(64, ge=1, le=2**20)
    micro_batch_size: int | Literal["auto"] = "auto"
    lr: float = Field(2e-5, gt=0.0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0.0)
    grad_clip: float = Field(1.0, ge=0.0)
    seed: int = Field(0, ge=0)
    eval_every: int = Field(0, ge=0)
    eval_batches: int = Field(8, ge=1)
    log_every: int = Field(1, ge=1)
    deterministic: bool = False
    compile: bool = False  # torch.compile each decoder layer (single, ddp, fsdp rungs)
    # adamw: fp32 moments; adamw_8bit: 8-bit moments with block scales (bitsandbytes)
    optimizer: Literal["adamw", "adamw_8bit"] = "adamw"
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
    method: Literal["full", "lora", "qlora"] = "full"
    lora: LoraConfig = Field(default_factory=LoraConfig)


class MemoryConfig(_Section):
    activation_checkpointing: Literal["auto", "none", "selective", "full"] = "auto"
    # Exact levers (docs/memory.md): the LM head and loss over chunks of tokens; the decoder
    # layers' saved activations in host memory between forward and backward. auto: the planner.
    chunked_loss: Literal["auto"] | bool = "auto"
    offload_activations: Literal["auto"] | bool = "auto"
    # each decoder layer's MLP over chunks of the sequence, each recomputed in backward
    # (trainer/memory/tiled_mlp.py); auto: the planner (off in the engine until it chooses)
    tiled_mlp: Literal["auto"] | bool = "auto"
    mlp_chunk_tokens: int | None = Field(None, ge=1)  # tokens per MLP chunk; None: hidden size
    loss_chunk_tokens: int | None = Field(None, ge=1)  # tokens per chunk; None: by vocabulary
    headroom: float = Field(0.10, ge=0.0, lt=0.9)


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


class InjectOomConfig(_Section):
    step: int = Field(ge=0)
    rank: int | None = Field(None, ge=0)
    times: int = Field(1, ge=0)
    where: Literal["setup", "forward", "backward", "optimizer", "eval"] = "backward"
    strategies: list[str] | None = None

    @field_validator("strategies")
    @classmethod
    def _known(cls, v: list[str] | None) -> list[str] | None:
        for name in v or []:
            if name not in strategies.names():
                raise ValueError(
                    f"unknown strategy '{name}'; use one of {', '.join(strategies.names())}"
                )
        return v


class SlowRank0Config(_Section):
    """Seconds added to rank 0's serial work (tests of the waiting ranks)."""

    tokenize_s: float = Field(0.0, ge=0)
    checkpoint_s: float = Field(0.0, ge=0)
    final_save_s: float = Field(0.0, ge=0)


class ProfileConfig(_Section):
    start: int = Field(ge=1)  # the first profiled optimizer step, counted from 1
    steps: int = Field(2, ge=1)


class DebugConfig(_Section):
    inject_oom: InjectOomConfig | None = None
    slow_rank0: SlowRank0Config | None = None
    # torch.profiler over optimizer steps start .. start + steps - 1 -> run.dir/profile/
    profile: ProfileConfig | None = None
    crash_in_save: int | None = Field(None, ge=1)  # SIGKILL at the N-th point inside saves
    # cap the CUDA allocator at this fraction of each device (emulates a smaller card, so an
    # out-of-memory and the escalation after it are real; bench/gpu_validate.sh); inert on CPU
    device_memory_fraction: float | None = Field(None, gt=0, le=1)


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

    @field_validator("resume")
    @classmethod
    def _resume(cls, v: str) -> str:
        if v not in ("auto", "never") and not _is_dir(Path(v).expanduser()):
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


class JobConfig(_Section):
    model: ModelConfig
    data: DataConfig
    train: TrainConfig = Field(default_factory=TrainConfig)
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)
    # bf16_pure: opt-in, lossy: bf16 weights, gradients and AdamW state, no fp32 master
    precision: Literal["bf16", "fp16", "fp32", "bf16_pure"] = "bf16"
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    strategy: str = "auto"  # auto or a row of trainer/core/strategies.py
    # ranks that split each sequence (Ulysses, trainer/memory/sequence_parallel.py); auto: the
    # planner (1 in the engine until it chooses). Changes where tokens live, never what is learned.
    sequence_parallel: Literal["auto"] | int = "auto"
    hardware: HardwareConfig = Field(default_factory=HardwareConfig)
    debug: DebugConfig = Field(default_factory=DebugConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig)
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    dist: DistConfig = Field(default_factory=DistConfig)
    escalation: EscalationConfig = Field(default_factory=EscalationConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)

    @field_validator("sequence_parallel")
    @classmethod
    def _positive_sequence_parallel(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be >= 1 or auto")
        return v

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


# What a resume may change. MATH_KEYS decide what is learned: a checkpoint refuses to resume
# when one of them differs (the message names each key and its two values), and so does a change
# of the training data's content (the tokenised data's fingerprint, trainer/data.py). Every other
# key may change and the change is logged: train.steps (extending a finished run; the schedule
# is then computed over the new total), strategy, world size, micro-batch, checkpointing,
# data.cache_dir, data.on_bad_row (a skipped row changes the data's fingerprint),
# model.attn_implementation, model.tokenizer's path (its tokens are in the fingerprint), eval and
# logging settings, run bookkeeping.
MATH_KEYS = (
    "model.name_or_path",
    "model.config",
    "model.revision",
    "data.path",
    "data.format",
    "data.seq_len",
    "data.text_field",
    "data.prompt_field",
    "data.completion_field",
    "data.messages_field",
    "data.eval_fraction",
    "data.pack",
    "data.append_eos",
    "precision",
    "train.global_batch_size",
    "train.lr",
    "train.min_lr_ratio",
    "train.schedule",
    "train.warmup_steps",
    "train.weight_decay",
    "train.betas",
    "train.eps",
    "train.grad_clip",
    "train.seed",
    "train.optimizer",
    "finetune.method",
    "finetune.lora",
)
_ABSENT = object()


def _get_dotted(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _ABSENT
        tree = tree[part]
    return tree


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict) or prefix in MATH_KEYS:
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def resume_differences(saved: dict[str, Any], cfg: JobConfig) -> tuple[list[str], list[str]]:
    """(math keys that differ, other keys that differ) between a checkpoint's saved config tree
    and `cfg`, each as 'key: old -> new'. Keys the saved tree lacks (an older version) are
    skipped."""
    new = json.loads(json.dumps(cfg.to_dict()))

    def show(key: str, old: Any, value: Any) -> str:
        return f"{key}: {json.dumps(old, default=str)} -> {json.dumps(value, default=str)}"

    math = []
    for key in MATH_KEYS:
        old, value = _get_dotted(saved, key), _get_dotted(new, key)
        if old is not _ABSENT and old != value:
            math.append(show(key, old, value))
    old_leaves, new_leaves = _leaves(saved), _leaves(new)
    other = [
        show(key, old_leaves[key], value)
        for key, value in new_leaves.items()
        if key not in MATH_KEYS
        and key != "run.resume"
        and key in old_leaves
        and old_leaves[key] != value
    ]
    return math, other


def semantic_hash(cfg: JobConfig) -> str:
    """Hash of what determines the learned result (MATH_KEYS; not where bytes live)."""
    d = cfg.to_dict()
    picked = {key: _get_dotted(d, key) for key in MATH_KEYS}
    blob = json.dumps(picked, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# --------------------------------------------------------------------------- loading


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(
                ".".join(parts[: i + 1]),
                f"is a value, not a section, so '{dotted}' cannot be set",
                "override the whole key instead",
            )
        node = child
    node[parts[-1]] = value


_MAX_KEY_PARTS = 32


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=value` overrides in order; values parse as YAML."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        shown = item if len(item) <= 80 else item[:77] + "..."
        if not sep or not key or any(not p for p in key.split(".")):
            raise ConfigError(
                shown, "is not a KEY=VALUE override", "write it like train.lr=1e-4 or strategy=fsdp"
            )
        if key.count(".") >= _MAX_KEY_PARTS:
            raise ConfigError(
                shown, f"has more than {_MAX_KEY_PARTS} dotted parts", "no key is that deep"
            )
        try:
            value = read_yaml(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        except YamlLimitError as err:
            raise ConfigError(key, f"the value {err}", "write the value out in full") from None
        _set_dotted(tree, key.strip(), value)
    return tree


def _known_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names valid at `loc` (for 'did you mean')."""
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        ann = field.annotation
        candidates = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type)]
        sub = next((a for a in candidates if issubclass(a, BaseModel)), None)
        if sub is None:
            return []
        model = sub
    return list(model.model_fields)


def _explain(err: ValidationError) -> ConfigError:
    first = err.errors(include_url=False)[0]
    # pydantic puts union branch names such as 'int' or 'literal[...]' into loc; drop them.
    names = [str(p) for p in first["loc"] if not str(p).startswith(("literal[", "function-"))]
    names = [n for n in names if n not in ("int", "str", "float", "bool", "dict[str,any]")]
    key = ".".join(names) or "config"
    kind, msg = first["type"], first["msg"]
    if kind == "extra_forbidden":
        parent = tuple(names[:-1])
        known = _known_keys(JobConfig, parent)
        close = difflib.get_close_matches(names[-1], known, n=1)
        hint = f"did you mean '{'.'.join([*parent, close[0]])}'?" if close else ""
        valid = f"valid keys here: {', '.join(known)}" if known else "remove it"
        return ConfigError(key, "unknown key", f"{hint} {valid}".strip())
    if kind == "missing":
        return ConfigError(key, "is required", f"add {key}: ... to the config")
    if kind == "literal_error":
        expected = first.get("ctx", {}).get("expected", "")
        got = first.get("input")
        close = difflib.get_close_matches(str(got), re.findall(r"'([^']+)'", expected), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return ConfigError(key, f"'{got}' is not allowed", f"{hint}use one of {expected}")
    if kind == "value_error":
        text = msg.removeprefix("Value error, ")
        return ConfigError(key, text, "fix the value in the config or with an override")
    got = first.get("input")
    if kind in ("model_type", "dict_type"):  # `model=[1,2]`, `train: 5`: a value for a section
        return ConfigError(
            key,
            f"is {_describe(got)}, not a section of keys",
            f"write {key} as a mapping of its keys (or set one key, e.g. {key}.KEY=VALUE)",
        )
    if kind == "finite_number":
        return ConfigError(key, f"is {got} (not a finite number)", "give a finite number")
    shown = json.dumps(got, default=str) if not isinstance(got, dict) else "a mapping"
    return ConfigError(key, f"{msg.lower()} (got {shown})", f"set {key} to a valid value")


def _describe(value: Any) -> str:
    """A value as a short phrase for a message: `a list ([1, 2])`, `null`, `the number 5`."""
    if value is None:
        return "null"
    shown = json.dumps(value, default=str)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    kind = {list: "a list", str: "the text", bool: "the boolean"}.get(type(value), "the number")
    return f"{kind} {shown}"


def _check_finite(tree: Any, key: str = "") -> None:
    """ConfigError naming the first number anywhere in the raw tree that is inf or nan (inline
    model.config and deepspeed.overrides included: nothing in a job is meant to be infinite)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            _check_finite(v, f"{key}.{k}" if key else str(k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            _check_finite(v, f"{key}[{i}]")
    elif isinstance(tree, float) and not math.isfinite(tree):
        raise ConfigError(key, f"is {tree} (not a finite number)", "give a finite number")


def build_config(tree: dict[str, Any]) -> JobConfig:
    """Validate a raw tree; raises ConfigError with the one-line message."""
    _check_finite(tree)
    try:
        cfg = JobConfig.model_validate(tree)
    except ValidationError as err:
        raise _explain(err) from None
    _check_no_secrets(cfg.to_dict())
    _check_across_sections(cfg)
    _check_paths(cfg)
    _check_positions(cfg)
    return cfg


def _check_paths(cfg: JobConfig) -> None:
    def looks_local(p: str) -> bool:
        return (
            p.startswith(("/", "./", "../", "~"))
            or Path(p).suffix != ""
            or _has_local_parent(Path(p))
        )

    for key, value in (("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path)):
        if value and looks_local(value) and not _exists(Path(value).expanduser()):
            raise ConfigError(key, f"'{value}' does not exist", "point it at a data file or dir")
    for key, value in (
        ("model.name_or_path", cfg.model.name_or_path),
        ("model.tokenizer", cfg.model.tokenizer),
    ):
        if value and value.startswith(("/", "./", "../", "~")):
            if not _exists(Path(value).expanduser()):
                raise ConfigError(key, f"'{value}' does not exist", "point it at a local dir")


def _check_across_sections(cfg: JobConfig) -> None:
    """Rules that involve several keys; the message names the key to change."""
    train, hw = cfg.train, cfg.hardware
    micro = train.micro_batch_size
    if isinstance(micro, int) and train.global_batch_size % micro:
        raise ConfigError(
            "train.micro_batch_size",
            f"{micro} does not divide train.global_batch_size={train.global_batch_size}",
            "use a divisor of the global batch, or auto",
        )
    rung = strategies.row(cfg.strategy) if cfg.strategy != "auto" else None
    if rung and rung.needs_nvme and not cfg.deepspeed.nvme_path:
        raise ConfigError(
            "strategy",
            f"{rung.name} needs deepspeed.nvme_path",
            "set deepspeed.nvme_path=/nvme/dir",
        )
    if rung and rung.max_world == 1 and (hw.nodes > 1 or (hw.devices_per_node or 1) > 1):
        raise ConfigError(
            "strategy",
            f"{rung.name} runs one process, but hardware.nodes x devices_per_node is above 1",
            "use ddp, fsdp or a zero rung, or strategy=auto",
        )
    world = hw.nodes * hw.devices_per_node if hw.devices_per_node else None
    sp = cfg.sequence_parallel if isinstance(cfg.sequence_parallel, int) else 1
    if world and world % sp:
        raise ConfigError(
            "sequence_parallel",
            f"{sp} does not divide the {world} ranks (hardware.nodes x devices_per_node)",
            "use a divisor of the rank count, or auto",
        )
    data_ranks = world // sp if world else None  # the ranks of a sequence group share sequences
    if data_ranks and isinstance(micro, int) and train.global_batch_size % (micro * data_ranks):
        raise ConfigError(
            "hardware.devices_per_node",
            f"train.global_batch_size={train.global_batch_size} is not a multiple of "
            f"train.micro_batch_size x ranks = {micro} x {data_ranks}"
            + (f" (the {world} ranks / sequence_parallel {sp})" if sp > 1 else ""),
            "change the device count, the micro-batch or the global batch",
        )
    if cfg.precision == "fp16" and hw.device == "cpu":
        raise ConfigError(
            "precision",
            "fp16 needs a GPU (CPU autocast computes in bf16)",
            "use precision=bf16 or fp32 on CPU",
        )
    _check_finetune(cfg)


def _check_finetune(cfg: JobConfig) -> None:
    """The fine-tune method and optimizer: their libraries installed, their precision, and a
    forced strategy that can run them (trainer/core/methods.py); never trained another way."""
    method, optimizer = cfg.finetune.method, cfg.train.optimizer
    needs = []
    if method != "full":
        needs.append(("finetune.method", method, "peft", "lora"))
    if method == "qlora" or optimizer == "adamw_8bit":
        key, value = (
            ("finetune.method", method) if method == "qlora" else ("train.optimizer", optimizer)
        )
        needs.append((key, value, "bitsandbytes", "lora"))
    if cfg.precision == "bf16_pure":
        needs.append(("precision", "bf16_pure", "torchao", "lowbit"))
    for key, value, module, extra in needs:
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                key,
                f"{value} needs {module}, which is not installed",
                f"pip install 'oomless[{extra}]'",
            )
    if method == "qlora" and cfg.precision != "bf16":
        raise ConfigError(
            "precision",
            f"{cfg.precision} with finetune.method=qlora: the 4-bit base computes in bf16",
            "use precision=bf16",
        )
    _check_in_backward(cfg)
    if cfg.strategy != "auto":
        opt_ins = (method, optimizer, cfg.precision, cfg.train.optimizer_in_backward)
        why = methods.method_support(cfg.strategy, *opt_ins)
        if why is not None:
            rungs = methods.supported_rungs(*opt_ins)
            raise ConfigError(
                "strategy",
                f"{cfg.strategy} cannot run {why}",
                f"use one of {', '.join(rungs)}, or strategy=auto",
            )


def _check_in_backward(cfg: JobConfig) -> None:
    """The step in backward keeps the math only with one micro-batch per step and no global
    gradient-norm clipping (each parameter is stepped before the others' gradients exist)."""
    train, hw = cfg.train, cfg.hardware
    if not train.optimizer_in_backward:
        return
    if train.grad_clip > 0:
        raise ConfigError(
            "train.optimizer_in_backward",
            f"steps each parameter before the global gradient norm is known, so "
            f"train.grad_clip={train.grad_clip:g} cannot clip",
            "set train.grad_clip=0, or train.optimizer_in_backward=false",
        )
    world = hw.nodes * hw.devices_per_node if hw.devices_per_node else None
    micro = train.micro_batch_size
    if world and isinstance(micro, int) and train.global_batch_size > micro * world:
        raise ConfigError(
            "train.optimizer_in_backward",
            f"needs one micro-batch per step, but train.global_batch_size="
            f"{train.global_batch_size} is {train.global_batch_size // (micro * world)} "
            f"micro-batches of {micro} x {world} ranks",
            "set train.micro_batch_size=global_batch_size / ranks, or "
            "train.optimizer_in_backward=false",
        )


def _check_positions(cfg: JobConfig) -> None:
    """data.seq_len within the model's positions, where the shape is known offline."""
    try:
        hf = hf_config_dict(cfg.model.config, cfg.model.name_or_path)
    except ConfigError:  # a hub id without a shipped preset: checked when the model loads
        return
    text = hf.get("text_config") or hf
    limit = text.get("max_position_embeddings") or text.get("n_positions")
    if limit and cfg.data.seq_len > limit:
        raise ConfigError(
            "data.seq_len",
            f"{cfg.data.seq_len} is more than the model's {limit} positions",
            f"use data.seq_len <= {limit}",
        )


def load_config(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """Read YAML (safe_load), apply overrides, validate. Relative paths resolve against the file."""
    path = Path(path)
    text = read_config_text(path)
    try:
        tree = read_yaml(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(str(path), f"is not valid YAML{where}", "fix the syntax") from None
    except YamlLimitError as err:
        raise ConfigError(
            str(path), str(err), "write the values out, without such aliases"
        ) from None
    if not isinstance(tree, dict):
        raise ConfigError(str(path), "top level must be a mapping", "start with model:, data:")
    tree = apply_overrides(tree, overrides or [])
    _resolve_relative(tree, path.parent)
    return build_config(tree)


def read_config_text(path: Path) -> str:
    """A job file's text: a readable UTF-8 file of at most MAX_CONFIG_BYTES, else ConfigError."""
    try:
        if not path.is_file():
            raise ConfigError(
                str(path), "config file not found", "pass the path of a YAML job file"
            )
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ConfigError(str(path), f"cannot be read ({err.strerror})", "check the path") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            str(path),
            f"is over {MAX_CONFIG_BYTES // 2**20} MiB, which no job file needs",
            "pass the job's YAML file (data goes in data.path, not in the config)",
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ConfigError(
            str(path),
            f"line {line} is not UTF-8 text (byte 0x{raw[err.start]:02x})",
            "save the file as UTF-8",
        ) from None


def _resolve_relative(tree: dict[str, Any], base: Path) -> None:
    """Paths in a job file are relative to the file (or the CWD when they exist there)."""
    for section, key in (
        ("data", "path"),
        ("data", "eval_path"),
        ("model", "name_or_path"),
        ("model", "tokenizer"),
    ):
        part = tree.get(section)
        value = part.get(key) if isinstance(part, dict) else None  # else: validation says
        if not isinstance(value, str) or value.startswith(("/", "~")):
            continue
        if _exists(Path(value)):
            tree[section][key] = str(Path(value).resolve())
        elif _exists(base / value):
            tree[section][key] = str((base / value).resolve())
        elif not _has_local_parent(Path(value)) and _has_local_parent(base / value, base):
            # `data/train` beside the job file, missing: a local path, named in full in the error
            tree[section][key] = str((base / value).resolve())


def _exists(path: Path) -> bool:
    """`path.exists()`, False for a name the OS refuses as a path (too long, a NUL byte)."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def _is_dir(path: Path) -> bool:
    """`path.is_dir()`, False for a name the OS refuses as a path."""
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def _has_local_parent(path: Path, base: Path | None = None) -> bool:
    """`data/train` whose `data/` exists here: meant as a local path, not a hub id."""
    parent = path.parent
    return parent != (base or Path(".")) and parent != Path(".") and _is_dir(parent)


# Secrets come from the environment only (docs/config.md names the variables): a config value
# that holds one is refused, so that no run file, checkpoint, sbatch script or log line carries
# it, and the workers read exactly the config that was validated (nothing is redacted).
SECRET_ENV_VARS = ("HF_TOKEN", "WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN")
_SECRET_KEY_RE = re.compile(
    r"^((hf|hub|auth|access|api)_)?token$|secret|password|passwd|api_?key", re.IGNORECASE
)
_TOKEN_VALUE_RES = (
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), "a Hugging Face token", "HF_TOKEN"),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"), "an API key", "the variable its tool reads"),
    (re.compile(r"\b(gh[pousr]|github_pat)_[A-Za-z0-9_]{20,}"), "a GitHub token", "GH_TOKEN"),
    (re.compile(r"\bAKIA[0-9A-Z]{16}\b"), "an AWS access key", "AWS_ACCESS_KEY_ID"),
)
# NAME=VALUE where NAME says token/key/secret/password and VALUE is a literal (not `$VAR`)
_ASSIGNED_SECRET_RE = re.compile(
    r"\b([A-Za-z_]*(?:TOKEN|KEY|SECRET|PASSWORD|PASSWD)[A-Za-z_]*)\s*=\s*"
    r"['\"]?([^\s'\"$][^\s'\"]{11,})",
    re.IGNORECASE,
)


def _check_no_secrets(tree: Any, key: str = "") -> None:
    """ConfigError naming the first config value that holds a secret (never the secret itself)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            child = f"{key}.{k}" if key else str(k)
            if _SECRET_KEY_RE.search(str(k)) and v not in (None, "", [], {}):
                raise _secret_error(child, "holds a secret", _env_var_for(child))
            _check_no_secrets(v, child)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            _check_no_secrets(v, f"{key}[{i}]")
    elif isinstance(tree, str):
        for pattern, what, env in _TOKEN_VALUE_RES:
            if pattern.search(tree):
                raise _secret_error(key, f"holds what looks like {what}", env)
        m = _ASSIGNED_SECRET_RE.search(tree)
        if m and _looks_random(m.group(2)):
            raise _secret_error(key, f"sets {m.group(1)} to a literal secret", m.group(1))


def _env_var_for(key: str) -> str:
    for hint, env in (("wandb", "WANDB_API_KEY"), ("mlflow", "MLFLOW_TRACKING_TOKEN")):
        if hint in key.lower():
            return env
    if re.search(r"\b(hf|hub|huggingface)", key.lower()):
        return "HF_TOKEN"
    return f"the variable its library reads ({', '.join(SECRET_ENV_VARS)}, ...)"


def _looks_random(value: str) -> bool:
    """Letters and digits mixed, as in keys and tokens (not a path or a word)."""
    return (
        any(c.isdigit() for c in value)
        and any(c.isalpha() for c in value)
        and "/" not in value
        and len(set(value)) >= 8
    )


def _secret_error(key: str, problem: str, env: str) -> ConfigError:
    return ConfigError(
        key,
        f"{problem}; config values end up in run files, checkpoints and logs",
        f"put it in the environment as {env} and remove it from the config "
        "(docs/config.md#secrets)",
    )


def dump_config(cfg: JobConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def write_config(cfg: JobConfig, run_dir: str | Path) -> Path:
    """run_dir/config.yaml, replaced in one rename after an fsync (0600: it holds paths)."""
    from trainer.core.files import write_atomic

    return write_atomic(Path(run_dir) / CONFIG_FILE, dump_config(cfg))

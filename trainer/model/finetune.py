"""What trains: LoRA adapters (peft) on a frozen base, QLoRA's 4-bit NF4 base (bitsandbytes), and
a full fine-tune in bf16 without fp32 master (`precision: bf16_pure`). The user's choice in the
config; docs/finetune.md. The optimizers (8-bit AdamW, bf16_pure's) are in trainer/optim.py.

The backends see an ordinary model whose frozen parameters have `requires_grad=False`: they give
the optimizer only what trains, and their canonical state (the checkpoint) holds only that.

- LoRA: `peft.get_peft_model` with adapters on every `nn.Linear` of the decoder blocks
  (`target_modules: all-linear`; never the LM head) or the named modules. The frozen base is in
  the compute dtype (bf16 under `precision: bf16`; fp32 under fp32; pretrained weights load
  straight in it, a random init is drawn in fp32 and cast) and has no fp32 master, no gradient
  and no optimizer state; the adapters are fp32 parameters with their own AdamW state.
  Adapter init (lora_A's Kaiming draw) is seeded by `train.seed` and the tensor's name, so every
  rung starts alike (`initial_adapter`).
- QLoRA: the decoder blocks' linear layers become `bitsandbytes.nn.Linear4bit` holding NF4
  weights (double quantisation, bf16 compute and bf16 quant storage, as a
  `transformers.BitsAndBytesConfig(load_in_4bit=True, ...)` asks for), then the LoRA adapters as
  above; the remaining frozen weights (embeddings, norms, head) are kept in bf16. Layer norms
  stay in their dtype and no input-gradient hook is needed: our recomputation is non-reentrant
  (what `prepare_model_for_kbit_training` arranges for the reentrant kind).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.core.config import ConfigError, FinetuneConfig, JobConfig, ModelConfig

log = logging.getLogger(__name__)

# The dtype the model computes in under each `precision` (and a frozen base is kept in)
COMPUTE_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "bf16_pure": torch.bfloat16,
}
QLORA_COMPUTE_DTYPE = torch.bfloat16
ADAPTER_NAME = "default"  # peft's name for the one adapter a run trains


def require(module: str, key: str, value: str) -> Any:
    """Import `module` (peft, bitsandbytes), or a one-line ConfigError naming the extra."""
    with warnings.catch_warnings():
        # bitsandbytes' CPU backend says once at import that an optional kernel package is absent
        warnings.filterwarnings("ignore", message=".*kernels-community.*")
        warnings.filterwarnings("ignore", message=".*pip install kernels.*")
        try:
            return importlib.import_module(module)
        except ImportError:
            raise ConfigError(
                key,
                f"{value} needs {module}, which is not installed",
                "pip install 'oomless[lora]'",
            ) from None


def trains_adapters(cfg: JobConfig) -> bool:
    return cfg.finetune.method in ("lora", "qlora")


def lora_target_modules(model: nn.Module, target: str | list[str]) -> list[str]:
    """Module names for peft: every nn.Linear (or 4-bit linear) inside the decoder blocks for
    `all-linear`, else the names given (peft matches them as name suffixes)."""
    if target != "all-linear":
        return list(target)
    from trainer.model.build import decoder_layers

    layers = decoder_layers(model)
    inside = {id(m) for layer in layers for m in layer.modules()}
    names = sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, m in model.named_modules()
            if id(m) in inside and _is_linear(m)
        }
    )
    if not names:
        raise ConfigError(
            "finetune.lora.target_modules",
            f"{type(model).__name__}'s decoder blocks have no linear layers",
            "name the modules to adapt, e.g. [q_proj, v_proj]",
        )
    # a name is adapted wherever it occurs: refuse all-linear when one also names a layer
    # outside the blocks (the LM head is never adapted)
    outside = sorted(
        n for n, m in model.named_modules() if id(m) not in inside and n.rsplit(".", 1)[-1] in names
    )
    if outside:
        raise ConfigError(
            "finetune.lora.target_modules",
            f"all-linear would also adapt {outside[0]}, outside the decoder blocks",
            "list the decoder blocks' module names instead",
        )
    return names


def _is_linear(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    return type(module).__name__ in ("Linear4bit", "Linear8bitLt")


def apply_finetune(model: nn.Module, cfg: FinetuneConfig, precision: str, seed: int) -> nn.Module:
    """The model `finetune.method` trains, from a built fp32 model: unchanged for `full`; for
    lora/qlora a peft model with the base frozen (and for qlora quantised). Meta-device models
    get the structure only (qlora: no quantisation, the shapes of the unquantised base)."""
    if cfg.method == "full":
        return model
    peft = require("peft", "finetune.method", cfg.method)
    meta = next(model.parameters()).is_meta
    if cfg.method == "qlora":
        compute = QLORA_COMPUTE_DTYPE
        if not meta:
            quantize_decoder_linears(model)
    else:
        compute = COMPUTE_DTYPES[precision]
    for p in model.parameters():
        p.requires_grad_(False)
        # ZeRO-3 partitions (ds_id) are built in the compute dtype already (a cast would
        # replace the partition with a whole tensor)
        if p.is_floating_point() and p.dtype != compute and not hasattr(p, "ds_id"):
            p.data = p.data.to(compute)
    lora = cfg.lora
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora_target_modules(model, lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft asks transformers' deprecated `is_gradient_checkpointing`; its own draws of the
        # adapters are replaced below, and leave the caller's random state alone
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        peft_model = peft.get_peft_model(model, config, adapter_name=ADAPTER_NAME)
    trained = torch.bfloat16 if precision == "bf16_pure" else torch.float32
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            if not meta:
                p.data = initial_adapter(name, p.shape, seed)
            p.data = p.data.to(trained)  # adapters train in fp32 (bf16 under bf16_pure)
            p.requires_grad_(True)
    return peft_model


def initial_adapter(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The initial fp32 value of the LoRA tensor `name` (a parameter name; wrappers' prefixes
    do not matter): lora_A drawn as peft draws it (Kaiming-uniform, a = sqrt(5)) from a
    generator seeded by `train.seed` and the name, lora_B zero. It depends on nothing else, so
    a rank filling its shard of a meta-built model (trainer/model/qlora_load.py) and a replica built
    whole start from the same adapters."""
    from trainer.model.pretrained import canonical_name

    name = canonical_name(name)
    value = torch.zeros(shape)
    if ".lora_B." in name:
        return value
    if ".lora_A." not in name:
        raise ValueError(f"{name}: not a LoRA A or B matrix")
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)


def quantize_decoder_linears(model: nn.Module) -> None:
    """Replace each nn.Linear of the decoder blocks by a bitsandbytes NF4 `Linear4bit`, in place,
    with the settings of `bnb_config()`; the weights quantise when moved to their device. On the
    meta device each weight takes the shape of its packed 4-bit storage, with nothing in it
    (trainer/model/qlora_load.py quantises into it later)."""
    bnb = require("bitsandbytes", "finetune.method", "qlora")
    from trainer.model.build import decoder_layers

    qc = bnb_config()
    for layer in decoder_layers(model):
        for parent in list(layer.modules()):
            for child_name, child in list(parent.named_children()):
                if type(child) is not nn.Linear:
                    continue
                device = child.weight.device
                q = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    compute_dtype=qc.bnb_4bit_compute_dtype,
                    compress_statistics=qc.bnb_4bit_use_double_quant,
                    quant_type=qc.bnb_4bit_quant_type,
                    quant_storage=qc.bnb_4bit_quant_storage,
                    device=device,
                )
                if device.type == "meta":
                    rows = packed_rows(child.weight.numel())
                    packed = torch.empty(rows, 1, dtype=QLORA_COMPUTE_DTYPE, device=device)
                    q.weight = params_4bit(packed, q, quantized=True)
                else:  # quantised from fp32, whatever it loaded in
                    q.weight = params_4bit(child.weight.data.float(), q)
                if child.bias is not None:
                    q.bias = nn.Parameter(child.bias.data.to(QLORA_COMPUTE_DTYPE), False)
                setattr(parent, child_name, q.to(device))


def params_4bit(data: torch.Tensor, module: nn.Module, quantized: bool = False) -> Any:
    """A bitsandbytes `Params4bit` of `module` with `bnb_config()`'s settings: `data` a
    full-precision weight that quantises when moved to a device, or (`quantized`) packed
    storage. The module keeps the quantisation state: FSDP2's gathered weight has none."""
    bnb = require("bitsandbytes", "finetune.method", "qlora")
    qc = bnb_config()
    return bnb.nn.Params4bit(
        data,
        requires_grad=False,
        compress_statistics=qc.bnb_4bit_use_double_quant,
        quant_type=qc.bnb_4bit_quant_type,
        quant_storage=qc.bnb_4bit_quant_storage,
        module=module,
        bnb_quantized=quantized,
    )


def packed_rows(numel: int) -> int:
    """Rows of a weight's packed NF4 storage (two 4-bit codes a byte, bf16 elements of one
    column), as bitsandbytes lays it out."""
    return (numel + 1) // 2 // QLORA_COMPUTE_DTYPE.itemsize


def bnb_config() -> Any:
    """QLoRA's quantisation, as users write it for transformers: NF4, double quantisation, bf16
    compute, bf16 storage of the packed weights (so 16-bit sharding recipes can carry them)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=QLORA_COMPUTE_DTYPE,
        bnb_4bit_quant_storage=QLORA_COMPUTE_DTYPE,
    )


class FinetuneFactory:
    """A `ModelFactory` that builds what `finetune.method` trains on top of another factory's
    model: the same seed gives every rung the same base and the same initial adapters."""

    def __init__(self, inner: Any, cfg: JobConfig):
        self.inner = inner
        self.finetune = cfg.finetune
        self.precision = cfg.precision
        self.seed = cfg.train.seed
        self.hf_config = inner.hf_config

    def adapt(self, model: nn.Module) -> nn.Module:
        return apply_finetune(model, self.finetune, self.precision, self.seed)

    def build(self, device: str | torch.device) -> nn.Module:
        device = torch.device(device)
        if device.type == "meta":
            return self.adapt(self.inner.build("meta"))
        # pretrained weights load straight in the dtype the frozen base keeps: 2 bytes per
        # parameter on the host instead of 4, the same values as loading fp32 and casting
        base = self.inner.build("cpu", pretrained_dtype=self.base_dtype)
        return self.adapt(base).to(device)

    def build_4bit_skeleton(self) -> nn.Module:
        """QLoRA's model on the meta device in its 4-bit layout (each block linear's weight
        shaped as its packed storage), for FSDP2 to shard before any weight exists; its shards
        are filled by trainer/model/qlora_load.py."""
        model = self.inner.build("meta")
        quantize_decoder_linears(model)
        return self.adapt(model)

    @property
    def quantizes(self) -> bool:
        """The base is quantised from full weights when built (QLoRA): a meta-device model has
        not the 4-bit layout, so a sharded rung shards a built one."""
        return self.finetune.method == "qlora"

    @property
    def base_dtype(self) -> torch.dtype:
        if self.finetune.method == "qlora":
            return QLORA_COMPUTE_DTYPE
        return COMPUTE_DTYPES[self.precision]

    def initial_state_dict(self) -> dict[str, torch.Tensor]:
        if not hasattr(self, "_initial"):
            self._initial = {
                k: v.detach().clone() for k, v in self.build("cpu").state_dict().items()
            }
        return self._initial


class Bf16PureFactory:
    """`precision: bf16_pure` for a full fine-tune: the inner factory's model with its
    parameters in bf16 and no fp32 copy anywhere. Pretrained weights load straight in bf16; a
    random init is drawn in fp32 and rounded, so every rung starts alike. Buffers keep their
    dtype (rotary frequencies stay fp32). Sharded rungs read pretrained files per rank as for
    any full fine-tune (`model_cfg`, `pretrained_checkpoint`)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.hf_config = inner.hf_config
        self.model_cfg = inner.model_cfg

    def build(self, device: str | torch.device) -> nn.Module:
        device = torch.device(device)
        if device.type == "meta":
            return params_to_bf16(self.inner.build("meta"))
        return params_to_bf16(self.inner.build("cpu", pretrained_dtype=torch.bfloat16)).to(device)

    def pretrained_checkpoint(self) -> Any:
        return self.inner.pretrained_checkpoint()

    def initial_state_dict(self) -> dict[str, torch.Tensor]:
        """The inner factory's, parameters rounded to bf16; built on each call, not kept."""
        params = {n for n, _ in self.inner.build("meta").named_parameters()}
        return {
            k: v.to(torch.bfloat16) if k in params and v.is_floating_point() else v
            for k, v in self.inner.initial_state_dict().items()
        }


def params_to_bf16(model: nn.Module) -> nn.Module:
    """Every floating-point parameter in bf16, in place (buffers as they are)."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(torch.bfloat16)
    return model


def build_factory(inner: Any, cfg: JobConfig) -> Any:
    """The model factory of the run: `inner` itself for a full fine-tune in mixed precision."""
    if trains_adapters(cfg):
        return FinetuneFactory(inner, cfg)
    return Bf16PureFactory(inner) if cfg.precision == "bf16_pure" else inner


def describe_method(cfg: JobConfig, model: nn.Module) -> str:
    """For the start line: ' (lora: 1,234 trainable)', or '' for a full fine-tune."""
    if not trains_adapters(cfg):
        return ""
    num = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if p.requires_grad)
    return f" ({cfg.finetune.method}: {num:,} trainable)"


_SAMPLES_PER_FILE = 16
_SAMPLE_BYTES = 4096
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def base_pointer(model_cfg: ModelConfig) -> dict[str, Any]:
    """What a lora/qlora checkpoint says about the base it trained on (it holds no base weights):
    the source (`model.name_or_path`, or "inline config"), its revision, and a fingerprint of
    the weights: for files, their names, sizes and 16 samples of 4 KiB each (cheap for any size;
    None for a hub id not in the local cache); for an inline config, the config itself (its
    weights are the seeded init, and `train.seed` is checked with the other math keys)."""
    if model_cfg.name_or_path is None:
        blob = json.dumps(model_cfg.config, sort_keys=True, default=str).encode()
        return {
            "source": "inline config",
            "revision": None,
            "fingerprint": hashlib.sha256(blob).hexdigest()[:16],
        }
    files = _weight_files(model_cfg.name_or_path, model_cfg.revision)
    return {
        "source": model_cfg.name_or_path,
        "revision": model_cfg.revision,
        "fingerprint": _files_fingerprint(files) if files else None,
    }


def _weight_files(name: str, revision: str | None) -> list[Path]:
    root = Path(name).expanduser()
    if not root.is_dir():
        try:
            from huggingface_hub import snapshot_download

            root = Path(snapshot_download(name, revision=revision, local_files_only=True))
        except Exception:  # not in the local cache: no fingerprint, the source still checked
            return []
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)


def _files_fingerprint(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            for i in range(_SAMPLES_PER_FILE):
                f.seek(size * i // _SAMPLES_PER_FILE)
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def check_same_base(
    saved: dict[str, Any] | None,
    model_cfg: ModelConfig,
    path: Path,
    key: str = "run.resume",
    fix: str = "resume with the base it was trained on, or set run.resume=never (or a new run.dir)",
) -> None:
    """Refuse (one line naming `key`) to use adapters on a base other than the one they trained
    on: resume, and export's --merge."""
    if not saved or saved.get("fingerprint") is None:
        return
    now = base_pointer(model_cfg)
    if now["fingerprint"] is not None and now["fingerprint"] != saved["fingerprint"]:
        raise ConfigError(
            key,
            f"{path} holds adapters trained on another base: the weights of {now['source']} "
            f"changed since (fingerprint {saved['fingerprint']} -> {now['fingerprint']})",
            fix,
        )

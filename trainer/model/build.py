"""Building the model: HF config, seeded init or pretrained weights, activation checkpointing."""

from __future__ import annotations

import contextlib
import logging
from contextlib import AbstractContextManager
from functools import cache, partial
from typing import Any, Protocol

import torch
from torch import nn

from trainer.core.config import ConfigError, ModelConfig
from trainer.core.hf_config import rope_update
from trainer.core.strategies import checkpointed_layers
from trainer.model.pretrained import SafetensorsCheckpoint, resolve_checkpoint

log = logging.getLogger(__name__)


def load_hf_config(model_cfg: ModelConfig) -> Any:
    """The transformers config object, from the inline dict or the pretrained source."""
    from transformers import CONFIG_MAPPING, AutoConfig

    if model_cfg.config is not None:
        params = dict(model_cfg.config)
        config = CONFIG_MAPPING[params.pop("model_type")](**params)
    else:
        config = _from_hub_or_dir(
            AutoConfig.from_pretrained,
            model_cfg.name_or_path,
            trust_remote_code=model_cfg.trust_remote_code,
            revision=model_cfg.revision,
        )
    if model_cfg.rope_scaling is not None:
        apply_rope_scaling(config, model_cfg.rope_scaling)
    config._attn_implementation = _attention_for(config, model_cfg.attn_implementation)
    config.use_cache = False
    return config


def apply_rope_scaling(config: Any, rope_scaling: dict[str, Any]) -> None:
    """`model.rope_scaling` on the transformers config (the decoder's, in a multimodal one):
    its rotary parameters and positions as `trainer.core.hf_config.rope_update` says."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    update = rope_update(text.to_dict(), rope_scaling)
    text.rope_parameters = update["rope_parameters"]
    text.max_position_embeddings = update["max_position_embeddings"]
    _validate_rope(text)
    log.info("model.rope_scaling: %s, %d positions", update["rope_parameters"]["rope_type"],
             update["positions"])  # fmt: skip


def _validate_rope(text_config: Any) -> None:
    """transformers' own check of the rotary parameters (each rope type's required keys), as a
    one-line ConfigError instead of a KeyError where the model first computes its rotary."""
    validate = getattr(text_config, "validate_rope", None)
    if validate is None:  # transformers before RotaryEmbeddingConfigMixin
        from transformers.modeling_rope_utils import rope_config_validation

        validate = partial(rope_config_validation, text_config)
    said_by_transformers = logging.getLogger("transformers.modeling_rope_utils")
    quiet = logging.Filter("nothing")  # its warnings would make a user's one error line two
    said_by_transformers.addFilter(quiet)
    try:
        validate()
    except (KeyError, ValueError, TypeError) as err:
        said = str(err.args[0] if err.args else err)  # a KeyError's str() is quoted
        raise ConfigError(
            "model.rope_scaling",
            f"transformers refuses it ({said})",
            "give the keys its rope_type needs (docs/long-context.md), e.g. llama3: factor, "
            "low_freq_factor, high_freq_factor, original_max_position_embeddings",
        ) from None
    finally:
        said_by_transformers.removeFilter(quiet)


_SAID_EAGER: set[type] = set()


def _attention_for(config: Any, requested: str) -> str:
    """`requested` (`auto`, which no plan resolved: sdpa), except that a model without SDPA
    support (GPT-OSS, Mamba, ...) runs `sdpa` as `eager`, transformers' own implementation of
    it."""
    from transformers import AutoModelForCausalLM

    if requested == "auto":  # the planner's choice, left unresolved: sdpa
        requested = "sdpa"
    if requested != "sdpa":
        return requested
    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if cls is not None and getattr(cls, "_supports_sdpa", True) is False:
        if cls not in _SAID_EAGER:  # once a process: tracing builds the model many times
            _SAID_EAGER.add(cls)
            log.info("%s has no SDPA attention: model.attn_implementation eager", cls.__name__)
        return "eager"
    return requested


def _from_hub_or_dir(loader: Any, name: str, **kwargs: Any) -> Any:
    from transformers.utils import logging as hf_logging

    # "Loading weights", "Fetching files": bars drawn over the run's own lines in its log
    hf_logging.disable_progress_bar()
    try:
        return loader(name, **kwargs)
    except OSError as err:
        raise ConfigError(
            "model.name_or_path",
            f"cannot load '{name}' ({str(err).splitlines()[0]})",
            "give a local model directory, or run where the Hugging Face Hub is reachable",
        ) from None


class HFModelFactory:
    """Implements `trainer.backends.ModelFactory` for HF causal LMs.

    Random init is seeded and done on the CPU in fp32, so every backend and world size starts
    from bit-identical weights.
    """

    def __init__(self, model_cfg: ModelConfig, seed: int):
        self.model_cfg = model_cfg
        self.seed = seed
        self.hf_config = load_hf_config(model_cfg)

    def build(
        self, device: str | torch.device, pretrained_dtype: torch.dtype = torch.float32
    ) -> nn.Module:
        """`pretrained_dtype`: the dtype pretrained weights are loaded in (a frozen LoRA base
        loads straight in the compute dtype: half the host memory of fp32, the same numbers as
        loading fp32 and casting). Random init is always fp32."""
        from transformers import AutoModelForCausalLM

        device = torch.device(device)
        if device.type == "meta":
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(
                    self.hf_config,
                    dtype=torch.float32,
                    trust_remote_code=self.model_cfg.trust_remote_code,
                )
        model = self._build_cpu(pretrained_dtype)
        return model.to(device)

    def _build_cpu(self, pretrained_dtype: torch.dtype = torch.float32) -> nn.Module:
        from transformers import AutoModelForCausalLM

        if self.model_cfg.name_or_path is not None:
            model = _from_hub_or_dir(
                AutoModelForCausalLM.from_pretrained,
                self.model_cfg.name_or_path,
                config=self.hf_config,
                dtype=pretrained_dtype,
                trust_remote_code=self.model_cfg.trust_remote_code,
                revision=self.model_cfg.revision,
            )
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                model = AutoModelForCausalLM.from_config(
                    self.hf_config,
                    dtype=torch.float32,
                    trust_remote_code=self.model_cfg.trust_remote_code,
                )
        model.config.use_cache = False
        return model

    def initial_state_dict(self) -> dict[str, torch.Tensor]:
        """The initial weights, built anew on each call (a random init draws the same values:
        its seed is forked). Not kept: the engine keeps its factory for the whole run, and a
        full fp32 copy of the model held there stays on rank 0's host (docs/memory.md "Host
        memory")."""
        return {k: v.detach() for k, v in self._build_cpu().state_dict().items()}

    def pretrained_checkpoint(self) -> SafetensorsCheckpoint | None:
        """The safetensors files of `model.name_or_path`, which sharded rungs read per rank
        (`trainer.model.pretrained`); None for random init or weights in another format."""
        if self.model_cfg.name_or_path is None:
            return None
        if not hasattr(self, "_checkpoint"):
            self._checkpoint = resolve_checkpoint(
                self.model_cfg.name_or_path, self.model_cfg.revision
            )
        return self._checkpoint


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks: the unit of checkpointing and sharding."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    best: nn.ModuleList | None = None
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        first = module[0]
        if names and type(first).__name__ in names:
            return module
        inner = getattr(first, "_checkpoint_wrapped_module", None)
        if inner is not None and type(inner).__name__ in names:
            return module
        if best is None or len(module) > len(best):
            best = module
    if best is None:
        raise ValueError(f"{type(model).__name__}: no repeated decoder layers found")
    return best


class LayerOffload(Protocol):
    """Where a layer's saved activations go while it runs (`trainer.memory.offload`'s
    `ActivationOffload`): the levers sit above the model and hand one in."""

    def layer(self, index: int) -> AbstractContextManager[None]: ...


class _Recompute:
    """A wrapped layer's checkpoint_fn: non-reentrant recomputation while `enabled`; what the
    layer saves for backward (with recomputation: its inputs) goes to host memory while
    `offload` is set (`trainer.memory.offload`)."""

    def __init__(self, enabled: bool, index: int, ops: bool = False):
        self.enabled = enabled
        self.index = index
        self.ops = ops  # op-level: the matmuls' and attention's outputs saved, not recomputed
        self.offload: LayerOffload | None = None

    def __call__(self, layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
        offloading = self.offload is not None and torch.is_grad_enabled()
        with self.offload.layer(self.index) if offloading else contextlib.nullcontext():
            if self.enabled and torch.is_grad_enabled():
                extra = {"context_fn": save_matmuls_and_attention} if self.ops else {}
                return torch.utils.checkpoint.checkpoint(
                    layer, *args, use_reentrant=False, **extra, **kwargs
                )
            return layer(*args, **kwargs)


@cache
def _saved_ops() -> frozenset:
    """The ops whose outputs op-level checkpointing keeps: matrix products and attention
    (torch's SDPA kernels, flash-attn's where installed)."""
    aten = torch.ops.aten
    names = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    ops = [aten.mm.default, aten.addmm.default]
    ops += [getattr(aten, n).default for n in names if hasattr(aten, n)]
    for name in ("_flash_attn_forward", "_flash_attn_varlen_forward"):
        try:
            ops.append(getattr(torch.ops.flash_attn, name).default)
        except (AttributeError, RuntimeError):
            pass
    return frozenset(ops)


def save_matmuls_and_attention() -> Any:
    """A checkpoint's `context_fn` for op-level checkpointing (torchtitan's `op` policy): the
    outputs of attention and of every other matrix product are saved in forward (for Llama: q,
    v, gate and down projections), the rest is recomputed in backward (k, o and up, the norms,
    rotary, the activation). Counted afresh for each checkpointed call and its recompute."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved, matmuls = _saved_ops(), (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    count = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in matmuls:
            count[mode] += 1
            if count[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if func in saved:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(
    model: nn.Module, level: str, count: int | None = None, ops: bool = False
) -> None:
    """Wrap every decoder layer in switchable checkpointing, in place (before any sharding), and
    switch it on for the layers of `level` (`count` of them under selective: None, every other
    one; with `ops`, every layer at op level: `save_matmuls_and_attention`). Wrapping all of
    them lets the OOM back-off raise the level of a built, sharded model
    (`set_activation_checkpointing`); a switched-off wrapper only calls the layer."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = decoder_layers(model)
    ops = ops and level == "selective"
    on = set(range(len(layers))) if ops else set(checkpointed_layers(len(layers), level, count))
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i], checkpoint_fn=_Recompute(i in on, i, ops))


def checkpoint_count(cfg: Any) -> int | None:
    """The job's `memory.checkpointed_layers` as `apply_activation_checkpointing` takes it."""
    count = cfg.memory.checkpointed_layers
    return count if isinstance(count, int) else None


def checkpoint_ops(cfg: Any) -> bool:
    """Whether selective checkpointing runs at op level (`memory.selective: ops`)."""
    return cfg.memory.selective == "ops"


def checkpointing_words(level: str, cfg: Any) -> str:
    """For the start line: 'full', 'selective (24 layers)' with the job's count, or
    'selective (matmul and attention outputs saved)'."""
    if level == "selective" and checkpoint_ops(cfg):
        return f"{level} (matmul and attention outputs saved)"
    count = checkpoint_count(cfg)
    return f"{level} ({count} layers)" if level == "selective" and count else level


def apply_compile(model: nn.Module) -> None:
    """torch.compile each decoder layer in place (torchtitan's order: after checkpointing, before
    sharding). The layers fuse their elementwise work (norms, rotary, the MLP's gate); the
    checkpointing switch, the sharding hooks and the parameter names stay outside the compiled
    code. The layers are alike, so one compiled graph serves them all."""
    for layer in decoder_layers(model):
        inner = getattr(layer, "_checkpoint_wrapped_module", layer)
        inner.compile()


def num_compiled_layers(model: nn.Module) -> int:
    """How many modules of a (possibly wrapped) model run compiled: what `apply_compile` did."""
    return sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


def _layer_switches(model: nn.Module) -> list[_Recompute]:
    switches = [
        fn.func
        for module in model.modules()
        if isinstance(fn := getattr(module, "checkpoint_fn", None), partial)
        and isinstance(fn.func, _Recompute)
    ]
    if not switches:
        raise ValueError("no switchable checkpointing: apply_activation_checkpointing first")
    return switches


def set_activation_checkpointing(model: nn.Module, level: str) -> None:
    """Switch the layers that `apply_activation_checkpointing` wrapped to `level`, in a model
    that may since have been sharded or wrapped (DDP, FSDP2, a DeepSpeed engine)."""
    switches = _layer_switches(model)
    on = set(checkpointed_layers(len(switches), level))
    for i, switch in enumerate(switches):
        switch.enabled = i in on
        switch.ops = False  # from op level up to whole layers


def set_offload_activations(model: nn.Module, offload: LayerOffload | None) -> None:
    """Offload the saved activations of every decoder layer through `offload` (None: keep them
    on the device), in a model wrapped by `apply_activation_checkpointing` and maybe since
    sharded; the OOM back-off switches it on mid-run."""
    for switch in _layer_switches(model):
        switch.offload = offload


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

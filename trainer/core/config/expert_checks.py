"""`parallel.expert` > 1 where it runs (docs/parallel.md, expert parallel): full fine-tunes and
LoRA with the experts frozen, on fsdp and fsdp_offload, without a tensor split; on a model whose
config is known offline, transformers has an expert-parallel plan for it and the degree divides
its experts and the data x sequence ranks (the fix names the degrees that do)."""

from __future__ import annotations

from trainer.core import strategies
from trainer.core.config.schema import JobConfig
from trainer.core.errors import ConfigError
from trainer.core.expert_plan import (
    check_expert_plan,
    expert_param_names,
    expert_plan,
    num_experts_of,
)
from trainer.core.hf_config import hf_config_dict, text_config
from trainer.core.parallel_dims import ParallelDims, check_expert_parallel

RUNS_ON = "fsdp and fsdp_offload"


def check_expert(cfg: JobConfig) -> None:
    """ConfigError (exit 2, one line) when the job cannot run its forced expert degree."""
    ep = cfg.parallel.expert
    if not isinstance(ep, int) or ep == 1:
        return
    _check_clashes(cfg, ep)
    try:
        text = text_config(hf_config_dict(cfg.model.config, cfg.model.name_or_path))
    except ConfigError:  # a hub id without a shipped preset: checked when the model loads
        return
    model_type = str(text.get("model_type", ""))
    check_expert_plan(model_type, ep)
    _check_adapters(cfg, ep, expert_plan(model_type))
    hw = cfg.hardware
    world = hw.nodes * hw.devices_per_node if hw.devices_per_node else ep
    check_expert_parallel(ParallelDims(world, 1, 1, ep), num_experts_of(text))


def _check_clashes(cfg: JobConfig, ep: int) -> None:
    tp = cfg.parallel.tensor
    rung = strategies.row(cfg.strategy) if cfg.strategy != "auto" else None
    rungs = [r.name for r in strategies.TABLE if r.expert_parallel]
    clash = [
        (isinstance(tp, int) and tp > 1, f"parallel.tensor={tp}",
         "expert and tensor parallel do not combine",
         "set parallel.tensor=1, or parallel.expert=1"),
        (rung is not None and not rung.expert_parallel, f"strategy={cfg.strategy}",
         f"expert parallel runs on {RUNS_ON}, the dense weights sharded over the data ranks",
         f"use strategy={' or '.join(rungs)} (or auto)"),
        (cfg.finetune.method == "qlora", "finetune.method=qlora",
         "4-bit experts cannot be split over expert ranks",
         "use parallel.expert=1 (strategy=fsdp takes QLoRA with whole experts)"),
        (cfg.fsdp.hybrid, "fsdp.hybrid=true", "hybrid sharding is untried with an expert split",
         "leave fsdp.hybrid off"),
        (cfg.train.compile, "train.compile=true",
         "the dispatch reads its split sizes back to the host every layer",
         "set train.compile=false"),
        (cfg.precision == "fp16", "precision=fp16", "the loss scaler is untried with expert shards",
         "use precision=bf16"),
    ]  # fmt: skip
    for hit, what, why, fix in clash:
        if hit:
            raise ConfigError("parallel.expert", f"{ep} with {what}: {why}", fix)


def _check_adapters(cfg: JobConfig, ep: int, plan: tuple[str, ...]) -> None:
    """LoRA under an expert split adapts the attention and dense layers; the experts' 3-D
    parameters stay frozen (an adapter on them would need the split too)."""
    targets = cfg.finetune.lora.target_modules
    if cfg.finetune.method != "lora" or not isinstance(targets, list):
        return
    named = sorted(set(targets) & expert_param_names(plan))
    if named:
        raise ConfigError(
            "finetune.lora.target_modules",
            f"{named[0]} names the experts' 3-D parameters, which parallel.expert={ep} splits "
            "and LoRA leaves frozen",
            "target the attention and dense linear layers (e.g. [q_proj, k_proj, v_proj, "
            "o_proj]) or all-linear, or use parallel.expert=1",
        )

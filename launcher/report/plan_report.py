"""`oomless plan`: the chosen plan, why, what else fits, and the exact command to launch it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from launcher.plan.headroom import plan_headroom
from launcher.plan.job import plan_job
from launcher.plan.planner import NoFitError, Plan
from launcher.run.launch import allocator_env, launch_spec, refuse_control_chars, shell_join
from trainer.core import strategies
from trainer.core.config import ConfigError, JobConfig
from trainer.core.contract import CONFIG_FILE
from trainer.core.units import GIB


def plan_command(cfg: JobConfig, as_json: bool, emit: str | None) -> int:

    try:
        resolved, plan, hw = plan_job(cfg)
    except NoFitError as err:  # the CLI prints the line and exits 3; --json also prints this
        if as_json:
            alternatives = [alt.to_json() for alt in err.alternatives]
            print(json.dumps({"fits": False, "error": str(err), "alternatives": alternatives}))
        raise
    argv, _, _ = launch_spec(resolved, _config_path(cfg))
    if emit == "torchrun":  # with the allocator's setting the launcher gives CUDA ranks
        refuse_control_chars({"run.dir": cfg.run.dir, "python": sys.executable}, "the command")
        print(shell_join(argv, allocator_env(resolved)))
        return 0
    if emit == "accelerate":
        sys.stdout.write(accelerate_config(plan, cfg))
        return 0
    if emit == "deepspeed":
        sys.stdout.write(deepspeed_config_json(plan, resolved))
        return 0
    if emit == "sbatch":
        from launcher.slurm.submit import render_sbatch

        plan_json = plan.to_json(hw, plan_headroom(cfg), argv)
        sys.stdout.write(
            render_sbatch(resolved, plan_json, Path(cfg.run.dir).absolute(), sys.executable)
        )
        return 0
    if emit == "trainjob":
        from launcher.k8s.trainjob import render_trainjob

        sys.stdout.write(render_trainjob(resolved, plan.to_json(hw, plan_headroom(cfg), argv)))
        return 0
    if as_json:
        print(json.dumps(plan.to_json(hw, plan_headroom(cfg), argv), indent=2))
        return 0
    print(render_plan(plan, hw.device_memory_bytes, hw.host_memory_bytes, argv))
    return 0


def _config_path(cfg: JobConfig) -> str:
    return str(Path(cfg.run.dir) / CONFIG_FILE)


def deepspeed_config_json(plan: Plan, resolved: JobConfig) -> str:
    """The DeepSpeed config our backend would use for this plan (a ZeRO rung), as JSON."""
    from trainer.backends.deepspeed_config import build_deepspeed_config

    if strategies.row(plan.strategy).engine != "deepspeed":
        raise ConfigError(
            "--emit deepspeed",
            f"the plan runs '{plan.strategy}', not a DeepSpeed ZeRO rung",
            "force one with strategy=zero2 (or zero1, zero3, zero3_offload, ...)",
        )
    ds = build_deepspeed_config(resolved, plan.world_size, plan.micro_batch_size, plan.grad_accum)
    ds["optimizer"] = {  # what the engine builds itself (torch AdamW or DeepSpeedCPUAdam)
        "type": "AdamW",
        "params": {
            "lr": resolved.train.lr,
            "betas": list(resolved.train.betas),
            "eps": resolved.train.eps,
            "weight_decay": resolved.train.weight_decay,
        },
    }
    return json.dumps(ds, indent=2) + "\n"


def render_plan(plan: Plan, device_bytes: int, host_bytes: int, argv: list[str]) -> str:
    est = plan.estimate
    lines = [
        f"plan: {plan.strategy} on {plan.nodes} node(s) x {plan.devices_per_node} device(s), "
        f"micro-batch {plan.micro_batch_size} x accumulation {plan.grad_accum}, activation "
        f"checkpointing {plan.activation_checkpointing}"
        + (f" ({plan.checkpointed_layers} of the layers)" if plan.checkpointed_layers else "")
        + (" (matmul and attention outputs saved)" if plan.checkpoint_ops else "")
        + (f", {plan.levers.words()}" if plan.levers.words() != "none" else "")
        + (f", {plan.long.words()}" if plan.long.words() != "none" else "")
        + (f", attention {plan.attention}" if plan.attention != "sdpa" else "")
        + (f"; reference {plan.reference}" if plan.reference else ""),
        f"memory per device: {est.device_total_bytes / GIB:.1f} GiB of "
        f"{device_bytes / GIB:.1f} GiB; host per node: {est.host_total_bytes / GIB:.1f} GiB of "
        f"{host_bytes / GIB:.1f} GiB",
        "why:",
        *(f"  - {r}" for r in plan.reasons),
        "rungs:",
    ]
    for alt in plan.alternatives:
        if hasattr(alt, "change"):  # an opt-in method/optimizer change (plan/alternatives.py)
            lines.append(f"  {alt.words()}")
        elif alt.fits:
            lines.append(
                f"  {alt.strategy:<22} fits   x{alt.relative_step_time:<6} step time "
                f"(micro {alt.micro_batch_size}, checkpointing {alt.activation_checkpointing}"
                + (f", {alt.levers}" if alt.levers and alt.levers != "none" else "")
                + ")"
            )
        else:
            lines.append(f"  {alt.strategy:<22} no     {alt.why_not}")
    lines += ["command:", "  " + shell_join(argv)]
    return "\n".join(lines)


_ACCELERATE_TYPES = {"single": "NO", "ddp": "MULTI_GPU", "fsdp": "FSDP", "deepspeed": "DEEPSPEED"}
_ACCELERATE_PLACES = {"device": "none", "cpu": "cpu", "nvme": "nvme"}


def accelerate_config(plan: Plan, cfg: JobConfig) -> str:
    """An `accelerate launch --config_file` YAML for users who run their own script."""
    import yaml

    mixed = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[cfg.precision]
    out: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "machine_rank": 0,
        "num_machines": plan.nodes,
        "num_processes": plan.world_size,
        "mixed_precision": mixed,
        "use_cpu": cfg.hardware.device == "cpu",
    }
    rung = strategies.row(plan.strategy)
    out["distributed_type"] = _ACCELERATE_TYPES[rung.engine]
    if rung.engine == "fsdp":
        out["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": cfg.fsdp.reshard_after_forward,
            "fsdp_offload_params": rung.offloads,
            "fsdp_activation_checkpointing": plan.activation_checkpointing != "none",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        }
    if rung.engine == "deepspeed":
        out["deepspeed_config"] = {
            "zero_stage": rung.zero_stage,
            "gradient_accumulation_steps": plan.grad_accum,
            "gradient_clipping": cfg.train.grad_clip,
            "offload_optimizer_device": _ACCELERATE_PLACES[rung.optimizer_at],
            "offload_param_device": _ACCELERATE_PLACES[rung.params_at],
            "zero3_init_flag": rung.zero_stage == 3,
        }
    tp = plan.long.tensor_parallel
    if tp > 1:  # accelerate's ParallelismConfig: FSDP over the ranks of one tensor rank
        out["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": 1,
            "parallelism_config_dp_shard_size": plan.world_size // tp,
            "parallelism_config_tp_size": tp,
            "parallelism_config_cp_size": 1,
        }
    return _expert_comment(plan.expert_parallel) + yaml.safe_dump(out, sort_keys=False)


def _expert_comment(ep: int) -> str:
    """The plan's expert degree, as comment lines: accelerate's config has no key for it (its
    `parallelism_config` sizes data, tensor, context and sequence groups; a key it does not know
    fails the launch), so the file says what it leaves out and how to keep it."""
    if ep == 1:
        return ""
    return (
        f"# The plan splits each MoE layer's experts over {ep} ranks (parallel.expert={ep}).\n"
        "# accelerate's config has no key for an expert split: launched with this file alone the\n"
        "# experts run whole on every rank. Apply the model's expert-parallel plan in your\n"
        "# script (transformers' base_model_ep_plan), or keep the degree with oomless:\n"
        f"# `oomless train CONFIG parallel.expert={ep}`.\n"
    )

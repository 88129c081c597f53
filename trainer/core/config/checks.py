"""A validated config: the schema's errors as one line, and the rules that involve several keys,
the paths, the model's positions and the secrets (`build_config`)."""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from trainer.core import methods, strategies
from trainer.core.config.expert_checks import check_expert
from trainer.core.config.paths import exists, has_local_parent
from trainer.core.config.schema import JobConfig
from trainer.core.config.secrets import check_no_secrets
from trainer.core.errors import ConfigError
from trainer.core.hf_config import hf_config_dict, model_positions, text_config
from trainer.core.parallel_dims import AttentionShape, ParallelDims, check_tensor_parallel
from trainer.core.tensor_plan import check_tensor_plan


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
        # a union (`auto` or a number): the other branches' kinds of value too
        field = first["loc"][:-1]
        items = [expected] + [
            word
            for e in err.errors(include_url=False)[1:]
            if e["loc"][:-1] == field
            for word in _BRANCH_WORDS.get(str(e["loc"][-1]), ())
        ]
        choices = " or ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)
        shown = json.dumps(got, default=str) if isinstance(got, (dict, list)) else f"'{got}'"
        return ConfigError(key, f"{shown} is not allowed", f"{hint}use one of {choices}")
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


# the branches of a union field, as pydantic names them in an error's location
_BRANCH_WORDS = {
    "int": ("a whole number",),
    "float": ("a number",),
    "bool": ("true", "false"),
    "str": ("a text",),
    "list[str]": ("a list of names",),
}


def _describe(value: Any) -> str:
    """A value as a short phrase for a message: `a list ([1, 2])`, `null`, `the number 5`."""
    if value is None:
        return "null"
    shown = json.dumps(value, default=str)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    kind = {list: "a list", str: "the text", bool: "the boolean"}.get(type(value), "the number")
    return f"{kind} {shown}"


def check_finite(tree: Any, key: str = "") -> None:
    """ConfigError naming the first number anywhere in the raw tree that is inf or nan (inline
    model.config and deepspeed.overrides included: nothing in a job is meant to be infinite)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            check_finite(v, f"{key}.{k}" if key else str(k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            check_finite(v, f"{key}[{i}]")
    elif isinstance(tree, float) and not math.isfinite(tree):
        raise ConfigError(key, f"is {tree} (not a finite number)", "give a finite number")


def build_config(tree: dict[str, Any]) -> JobConfig:
    """Validate a raw tree; raises ConfigError with the one-line message."""
    check_finite(tree)
    try:
        cfg = JobConfig.model_validate(tree)
    except ValidationError as err:
        raise _explain(err) from None
    check_no_secrets(cfg.to_dict())
    _one_sequence_degree(cfg)
    _one_headroom(cfg)
    _check_tensor_model(cfg)
    _check_across_sections(cfg)
    _check_paths(cfg)
    _check_positions(cfg)
    check_expert(cfg)  # last: a module of its own, entered once (tests/test_architecture.py)
    return cfg


def _one_sequence_degree(cfg: JobConfig) -> None:
    """`parallel.sequence` and its old name `sequence_parallel` are one key: either sets both
    (the code reads `sequence_parallel`); both set, they must agree."""
    new, old = cfg.parallel.sequence, cfg.sequence_parallel
    if new != "auto" and old != "auto" and new != old:
        raise ConfigError(
            "parallel.sequence",
            f"{new} disagrees with sequence_parallel={old}, its old name",
            "set one of them",
        )
    if new == "auto":
        cfg.parallel.sequence = old
    else:
        cfg.sequence_parallel = new


def _one_headroom(cfg: JobConfig) -> None:
    """`plan.headroom` and its old name `memory.headroom` are one key (the code reads
    `plan.headroom`); both set, they must agree."""
    new, old = cfg.plan.headroom, cfg.memory.headroom
    if old is None:
        return
    if new != "auto" and new != old:
        raise ConfigError(
            "plan.headroom",
            f"{new} disagrees with memory.headroom={old}, its old name",
            "set one of them",
        )
    cfg.plan.headroom = old


def _check_paths(cfg: JobConfig) -> None:
    def looks_local(p: str) -> bool:
        return (
            p.startswith(("/", "./", "../", "~"))
            or Path(p).suffix != ""
            or has_local_parent(Path(p))
        )

    for key, value in (("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path)):
        if value and looks_local(value) and not exists(Path(value).expanduser()):
            raise ConfigError(key, f"'{value}' does not exist", "point it at a data file or dir")
    for key, value in (
        ("model.name_or_path", cfg.model.name_or_path),
        ("model.tokenizer", cfg.model.tokenizer),
    ):
        if value and value.startswith(("/", "./", "../", "~")):
            if not exists(Path(value).expanduser()):
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
    tp = cfg.parallel.tensor if isinstance(cfg.parallel.tensor, int) else 1
    if rung and rung.max_world == 1 and hw.nodes * (hw.devices_per_node or 1) > tp:
        raise ConfigError(
            "strategy",
            f"{rung.name} runs one process, but hardware.nodes x devices_per_node is above 1"
            + (f" x parallel.tensor {tp}" if tp > 1 else ""),
            "use ddp, fsdp or a zero rung, or strategy=auto",
        )
    _check_tensor(cfg, tp)
    memory = cfg.memory
    if isinstance(memory.checkpointed_layers, int) and memory.activation_checkpointing in (
        "none", "full",
    ):  # fmt: skip
        raise ConfigError(
            "memory.checkpointed_layers",
            f"{memory.checkpointed_layers} with memory.activation_checkpointing="
            f"{memory.activation_checkpointing}: it counts the layers of selective checkpointing",
            "use memory.activation_checkpointing=selective (or auto), or checkpointed_layers=auto",
        )
    _check_op_level(cfg)
    world = hw.nodes * hw.devices_per_node if hw.devices_per_node else None
    sp = cfg.sequence_parallel if isinstance(cfg.sequence_parallel, int) else 1
    if world and world % (sp * tp):
        raise ConfigError(
            "sequence_parallel" if world % tp == 0 else "parallel.tensor",
            f"{sp if world % tp == 0 else tp} does not divide the {world} ranks"
            + (f" / parallel.tensor {tp}" if tp > 1 and world % tp == 0 else "")
            + " (hardware.nodes x devices_per_node)",
            "use a divisor of the rank count, or auto",
        )
    # the ranks of a sequence group share sequences, those of a tensor group the same ones
    data_ranks = world // (sp * tp) if world else None
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
    _check_objective(cfg)
    _check_resilience(cfg)


def _check_objective(cfg: JobConfig) -> None:
    """A preference objective reads preference pairs, and only it does; its sequences are whole
    on one rank (a pair's log-probs are sums over each sequence)."""
    objective, data_format = cfg.objective.type, cfg.data.format
    if cfg.objective.preference and data_format != "preference":
        raise ConfigError(
            "data.format",
            f"is {data_format}, but objective.type={objective} learns from preference pairs",
            "set data.format=preference ({prompt, chosen, rejected} rows), or objective.type=sft",
        )
    if data_format == "preference" and not cfg.objective.preference:
        raise ConfigError(
            "objective.type",
            "is sft, but data.format=preference holds pairs for a preference objective",
            "set objective.type to dpo, orpo or simpo (or use data.format=prompt_completion)",
        )
    if cfg.objective.preference and isinstance(cfg.sequence_parallel, int):
        if cfg.sequence_parallel > 1:
            raise ConfigError(
                "sequence_parallel",
                f"{cfg.sequence_parallel} with objective.type={objective}: preference objectives "
                "keep each sequence on one rank",
                "set sequence_parallel=1 (or auto)",
            )


def _check_resilience(cfg: JobConfig) -> None:
    """elastic.min_nodes within the job's nodes; a hang timeout torch's own timeout leaves room
    for (trainer/runtime/hang.py)."""
    min_nodes, nodes = cfg.elastic.min_nodes, cfg.hardware.nodes
    if min_nodes is not None and min_nodes > nodes:
        raise ConfigError(
            "elastic.min_nodes",
            f"{min_nodes} is above hardware.nodes={nodes}",
            f"use a number from 1 to {nodes}, or leave it unset (a lost node ends the run)",
        )
    timeout = cfg.run.hang_timeout_s
    if isinstance(timeout, int) and timeout >= cfg.dist.timeout_s:
        raise ConfigError(
            "run.hang_timeout_s",
            f"{timeout} is not below dist.timeout_s={cfg.dist.timeout_s}: torch's collective "
            "timeout would end the run before a hang is diagnosed",
            f"use less than {cfg.dist.timeout_s}, or raise dist.timeout_s",
        )


def _check_tensor(cfg: JobConfig, tp: int) -> None:
    """`parallel.tensor` > 1 where it runs: full fine-tunes on single, fsdp and fsdp_offload,
    sharded within each node (docs/parallel.md); the model's own plan is checked by the engine
    and the planner (trainer/parallel/tensor.py)."""
    if tp == 1:
        return
    rung = strategies.row(cfg.strategy) if cfg.strategy != "auto" else None
    runs_on = "single, fsdp and fsdp_offload"
    clash = [
        (rung is not None and not rung.tensor_parallel, f"strategy={cfg.strategy}",
         f"use strategy={runs_on.replace(' and ', ', ').replace(', ', ' or ')} (or auto)"),
        (cfg.finetune.method != "full", f"finetune.method={cfg.finetune.method}",
         "use finetune.method=full, or parallel.tensor=1"),
        (cfg.fsdp.hybrid, "fsdp.hybrid=true",
         "leave fsdp.hybrid off (FSDP shards across the nodes beside the tensor split)"),
        (cfg.train.compile, "train.compile=true", "set train.compile=false"),
        (cfg.precision == "fp16", "precision=fp16", "use precision=bf16"),
    ]  # fmt: skip
    for hit, what, fix in clash:
        if hit:
            raise ConfigError(
                "parallel.tensor",
                f"{tp} with {what}: tensor parallel runs full fine-tunes on {runs_on}, "
                "without compile, hybrid sharding or fp16",
                fix,
            )


def _check_op_level(cfg: JobConfig) -> None:
    """`memory.selective: ops` where the estimate models it: selective checkpointing of a full
    fine-tune, every layer, no tiled MLP, activation offload or sequence split."""
    memory = cfg.memory
    if memory.selective != "ops":
        return
    clash = [
        (memory.activation_checkpointing in ("none", "full"),
         f"memory.activation_checkpointing={memory.activation_checkpointing}"),
        (isinstance(memory.checkpointed_layers, int),
         f"memory.checkpointed_layers={memory.checkpointed_layers} (ops checkpoints every layer)"),
        (cfg.finetune.method != "full", f"finetune.method={cfg.finetune.method}"),
        (memory.tiled_mlp is True, "memory.tiled_mlp=true"),
        (memory.offload_activations is True, "memory.offload_activations=true"),
        (cfg.strategy != "auto" and strategies.row(cfg.strategy).engine == "deepspeed",
         f"strategy={cfg.strategy} (DeepSpeed's rungs are untried with it)"),
        (isinstance(cfg.sequence_parallel, int) and cfg.sequence_parallel > 1,
         f"sequence_parallel={cfg.sequence_parallel}"),
    ]  # fmt: skip
    for hit, what in clash:
        if hit:
            raise ConfigError(
                "memory.selective",
                f"ops with {what}: op-level checkpointing runs selective checkpointing of a "
                "full fine-tune on every layer, without a tiled MLP, activation offload or a "
                "sequence split, on single, ddp and the fsdp rungs",
                "use memory.selective=layers, or auto",
            )


def _check_finetune(cfg: JobConfig) -> None:
    """The fine-tune method and optimizer: their libraries installed, their precision, and a
    forced strategy that can run them (trainer/core/methods.py); never trained another way."""
    method, optimizer = cfg.finetune.method, cfg.train.optimizer
    if method == "qlora" and cfg.precision not in ("bf16", "bf16_pure"):
        raise ConfigError(
            "precision",
            f"{cfg.precision} with finetune.method=qlora: the 4-bit base computes in bf16",
            "use precision=bf16 (fp32 adapters), or bf16_pure (bf16 adapters)",
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


def check_run_time_extras(cfg: JobConfig) -> None:
    """The libraries the job's opt-ins run with, installed HERE: checked by `train` on the
    machine that runs it (and by the engine on every node), not by `plan`, `estimate` or
    `submit`, which may plan for another machine."""
    method, optimizer = cfg.finetune.method, cfg.train.optimizer
    needs = []
    if method != "full":
        needs.append(("finetune.method", method, "peft", "oomless[lora]"))
    if method == "qlora" or optimizer in methods.EIGHT_BIT_OPTIMIZERS:
        key, value = (
            ("finetune.method", method) if method == "qlora" else ("train.optimizer", optimizer)
        )
        needs.append((key, value, "bitsandbytes", "oomless[lora]"))
    if cfg.precision == "bf16_pure":
        needs.append(("precision", "bf16_pure", "torchao", "oomless[lowbit]"))
    if cfg.model.attn_implementation == "flash_attention_2":
        needs.append(("model.attn_implementation", "flash_attention_2", "flash_attn", "flash-attn"))
    for key, value, module, package in needs:
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                key,
                f"{value} needs {module}, which is not installed on this machine",
                f"pip install '{package}'",
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
    """data.seq_len within the model's positions (as `model.rope_scaling` extends them), where
    the shape is known offline; the scaling itself checked against the model."""
    try:
        hf = hf_config_dict(cfg.model.config, cfg.model.name_or_path)
    except ConfigError:  # a hub id without a shipped preset: checked when the model loads
        return
    rope = cfg.model.rope_scaling
    limit = model_positions(hf, rope)
    if not limit or cfg.data.seq_len <= limit:
        return
    if rope is not None:
        raise ConfigError(
            "data.seq_len",
            f"{cfg.data.seq_len} is more than the {limit} positions model.rope_scaling yields",
            f"use data.seq_len <= {limit}, or a larger model.rope_scaling.factor",
        )
    factor = 2 ** math.ceil(math.log2(cfg.data.seq_len / limit))
    raise ConfigError(
        "data.seq_len",
        f"{cfg.data.seq_len} is more than the model's {limit} positions",
        f"use data.seq_len <= {limit}, or extend the positions (opt-in, changes what is learned): "
        f"model.rope_scaling={{rope_type: yarn, factor: {factor}.0}}",
    )


def check_debug_ranks(cfg: JobConfig, world_size: int) -> None:
    """`debug.inject_hang.rank` / `debug.inject_oom.rank` inside the world the job is planned
    on (known once the hardware is): a rank beyond it would leave the injection silently inert."""
    for key, spec in (
        ("debug.inject_hang", cfg.debug.inject_hang),
        ("debug.inject_oom", cfg.debug.inject_oom),
    ):
        rank = getattr(spec, "rank", None)
        if rank is not None and rank >= world_size:
            raise ConfigError(
                f"{key}.rank",
                f"{rank} is not a rank of the job, which runs on {world_size} (ranks 0 to "
                f"{world_size - 1}): nothing would be injected",
                f"use a rank below {world_size}",
            )


def _check_tensor_model(cfg: JobConfig) -> None:
    """`parallel.tensor` > 1 on a model whose config is known offline: transformers has a plan
    for it, and the degree splits its heads over the ranks (the fix names the degrees that do)."""
    tp, hw = cfg.parallel.tensor, cfg.hardware
    if not isinstance(tp, int) or tp == 1:
        return
    try:
        text = text_config(hf_config_dict(cfg.model.config, cfg.model.name_or_path))
    except ConfigError:  # a hub id without a shipped preset: checked when the model loads
        return
    check_tensor_plan(str(text.get("model_type", "")), tp)
    world = hw.nodes * hw.devices_per_node if hw.devices_per_node else tp
    check_tensor_parallel(ParallelDims(world, 1, tp), AttentionShape.of_hf_config(text))

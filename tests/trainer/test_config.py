"""Config: what loads, what overrides do, and one clear line (exit 2) for every bad input."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, TINY_LLAMA, oomless, write_demo_job
from trainer.core.config import ConfigError, load_config, parse_size

TOKENIZER = str(REPO / "configs" / "demo" / "tokenizer")


def _job(tmp_path: Path, **sections) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello"}\n')
    tree = {
        "model": {"config": dict(TINY_LLAMA), "tokenizer": TOKENIZER},
        "data": {"path": "train.jsonl", "seq_len": 64},
        "train": {"steps": 5, "global_batch_size": 8, "micro_batch_size": 2},
    }
    for key, value in sections.items():
        if value is None:
            tree.pop(key, None)
        elif isinstance(value, dict) and isinstance(tree.get(key), dict):
            tree[key] = {**tree[key], **value}
        else:
            tree[key] = value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_a_valid_job_loads_with_defaults_and_relative_paths(tmp_path):
    cfg = load_config(_job(tmp_path))
    assert cfg.data.path == str(tmp_path / "train.jsonl")  # relative to the job file
    assert cfg.precision == "bf16" and cfg.strategy == "auto"
    assert cfg.plan.headroom == "auto" and cfg.run.resume == "auto"


def test_overrides_parse_as_yaml_including_lists_and_nested_keys(tmp_path):
    cfg = load_config(
        _job(tmp_path),
        [
            "train.lr=1e-4",
            "strategy=fsdp",
            "train.betas=[0.8, 0.9]",
            "hardware.device_memory=24GiB",
            "debug.inject_oom={step: 3, rank: 1}",
            "debug.inject_oom.times=2",
            "slurm.time=30",
        ],
    )
    assert cfg.slurm.time == "30"  # YAML reads 30 as an int; Slurm reads it as minutes
    assert cfg.train.lr == 1e-4 and cfg.strategy == "fsdp"
    assert cfg.train.betas == (0.8, 0.9)
    assert cfg.hardware.device_memory == 24 * 2**30
    assert cfg.debug.inject_oom.step == 3 and cfg.debug.inject_oom.times == 2


def test_yaml_numbers_read_as_yaml_1_2(tmp_path):
    """`12:00:00` is a Slurm time, not PyYAML's base-60 integer 43200; `1e-4` is a float."""
    job = _job(tmp_path, slurm={"grace_s": 60})
    job.write_text(job.read_text().replace("grace_s: 60", "time: 12:00:00"))
    cfg = load_config(job, ["train.lr=3e-4"])
    assert cfg.slurm.time == "12:00:00"
    assert cfg.train.lr == 3e-4
    assert load_config(job, ["slurm.time=1-00:00:00"]).slurm.time == "1-00:00:00"


def test_sizes():
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("512 GB") == 512 * 10**9
    assert parse_size(1024) == 1024
    with pytest.raises(ValueError):
        parse_size("lots")


def test_oomless_config_prints_the_resolved_config(tmp_path):
    job = _job(tmp_path, deepspeed={"overrides": {"wandb": {"project": "p1"}}})
    r = oomless("config", str(job), "train.lr=3e-4")
    assert r.returncode == 0, r.stderr
    printed = yaml.safe_load(r.stdout)
    assert printed["train"]["lr"] == 3e-4
    assert printed["data"]["path"] == str(tmp_path / "train.jsonl")
    assert printed["deepspeed"]["overrides"] == {"wandb": {"project": "p1"}}


# (label, job sections or None, overrides, key the message must name, words it must contain)
INVALID = [
    ("unknown top key", {"trian": {"steps": 1}}, [], "trian", "did you mean 'train'"),
    ("unknown nested key", {"train": {"setps": 3}}, [], "train.setps", "did you mean"),
    ("unknown override key", {}, ["train.lrr=1"], "train.lrr", "did you mean 'train.lr'"),
    ("override without =", {}, ["train.lr"], "train.lr", "KEY=VALUE"),
    ("negative lr", {}, ["train.lr=-1"], "train.lr", "greater than 0"),
    ("steps zero", {}, ["train.steps=0"], "train.steps", "greater than or equal to 1"),
    ("lr not a number", {}, ["train.lr=fast"], "train.lr", "number"),
    ("bad precision", {}, ["precision=bf32"], "precision", "bf16"),
    ("bad strategy", {}, ["strategy=zero4"], "strategy", "zero"),
    (
        "bad checkpointing",
        {},
        ["memory.activation_checkpointing=some"],
        "memory.activation_checkpointing",
        "selective",
    ),
    ("bad format", {}, ["data.format=tsv"], "data.format", "prompt_completion"),
    ("bad size", {}, ["hardware.device_memory=lots"], "hardware.device_memory", "80GiB"),
    ("negative size", {}, ["hardware.host_memory=-5"], "hardware.host_memory", "positive"),
    (
        "micro does not divide global",
        {},
        ["train.micro_batch_size=3"],
        "train.micro_batch_size",
        "does not divide",
    ),
    (
        "global not divisible by world",
        {},
        ["hardware.devices_per_node=3", "hardware.device=cpu"],
        "hardware.devices_per_node",
        "micro_batch_size x ranks",
    ),
    (
        "single on many devices",
        {},
        ["strategy=single", "hardware.devices_per_node=2"],
        "strategy",
        "single",
    ),
    ("seq_len past positions", {}, ["data.seq_len=4096"], "data.seq_len", "256 positions"),
    ("missing data", {"data": None}, [], "data", "required"),
    ("missing data path", {"data": {"path": None}}, [], "data.path", ""),
    ("both model sources", {"model": {"name_or_path": "x/y"}}, [], "model", "exactly one"),
    ("no model_type", {"model": {"config": {"hidden_size": 8}}}, [], "model", "model_type"),
    (
        "data path missing on disk",
        {},
        ["data.path=/nonexistent/train.jsonl"],
        "data.path",
        "does not exist",
    ),
    (
        "resume path missing",
        {},
        ["run.resume=/nonexistent/ckpt"],
        "run.resume",
        "checkpoint directory",
    ),
    ("fp16 on cpu", {}, ["precision=fp16", "hardware.device=cpu"], "precision", "fp16"),
    ("zero3_nvme without path", {}, ["strategy=zero3_nvme"], "strategy", "nvme_path"),
    (
        "bad inject strategy",
        {},
        ["debug.inject_oom={step: 1, strategies: [fsdq]}"],
        "debug.inject_oom.strategies",
        "unknown strategy",
    ),
    ("bad slurm time", {}, ["slurm.time=soon"], "slurm.time", "HH:MM:SS"),
    ("betas out of range", {}, ["train.betas=[0.9, 1.5]"], "train.betas", "[0, 1)"),
    ("section given a value", {}, ["train=5"], "train", ""),
    ("eval fraction 1", {}, ["data.eval_fraction=1.0"], "data.eval_fraction", "less than 1"),
    ("lora typo", {}, ["finetune.lora.rr=8"], "finetune.lora.rr", "did you mean"),
    ("no lora targets", {}, ["finetune.lora.target_modules=[]"], "finetune.lora", "module"),
    ("unknown method", {}, ["finetune.method=dora"], "finetune.method", "one of"),
    ("unknown optimizer", {}, ["train.optimizer=sgd"], "train.optimizer", "adamw_8bit"),
    # a forced rung that cannot run the chosen method or optimizer (trainer/core/methods.py)
    (
        "qlora forced onto zero2",
        {},
        ["finetune.method=qlora", "strategy=zero2", "hardware.devices_per_node=2"],
        "strategy",
        "zero2 cannot run qlora: DeepSpeed ZeRO-1/2 cast the 4-bit storage",
    ),
    (
        "adamw_8bit forced onto zero3_offload",
        {},
        ["train.optimizer=adamw_8bit", "strategy=zero3_offload", "hardware.devices_per_node=2"],
        "strategy",
        "zero3_offload cannot run adamw_8bit: DeepSpeed ZeRO",
    ),
    ("qlora in fp32", {}, ["finetune.method=qlora", "precision=fp32"], "precision", "bf16"),
    (
        "no checkpointed layers",
        {},
        ["memory.checkpointed_layers=0"],
        "memory.checkpointed_layers",
        ">= 1",
    ),  # fmt: skip
    (
        "op level under full",
        {},
        ["memory.activation_checkpointing=full", "memory.selective=ops"],
        "memory.selective",
        "use memory.selective=layers",
    ),
    (
        "checkpointed layers under full",
        {},
        ["memory.activation_checkpointing=full", "memory.checkpointed_layers=3"],
        "memory.checkpointed_layers",
        "use memory.activation_checkpointing=selective",
    ),
]


@pytest.mark.parametrize(
    "label, sections, overrides, key, words", INVALID, ids=[c[0] for c in INVALID]
)
def test_invalid_config_is_one_line_exit_2(tmp_path, label, sections, overrides, key, words):
    job = _job(tmp_path, **sections)
    start = time.monotonic()
    r = oomless("config", str(job), *overrides)
    elapsed = time.monotonic() - start
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1, r.stderr  # exactly one line
    assert "Traceback" not in r.stderr
    line = r.stderr.strip()
    assert line.startswith(f"config error: {key}"), line
    assert words in line, line
    assert elapsed < 5, f"{elapsed:.1f} s"


@pytest.mark.parametrize(
    "content, words",
    [
        ("model: [unclosed\n", "not valid YAML at line"),
        ("- a\n- b\n", "top level must be a mapping"),
    ],
)
def test_broken_files_are_one_line_exit_2(tmp_path, content, words):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    r = oomless("config", str(path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr


def test_missing_file_and_bad_usage(tmp_path):
    r = oomless("config", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "config file not found" in r.stderr
    r = oomless("trian", "x.yaml")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_config_error_is_a_value_error_with_key_problem_fix():
    err = ConfigError("train.lr", "must be positive", "set train.lr=1e-4")
    assert str(err) == "config error: train.lr: must be positive; set train.lr=1e-4"


def _alias_tree(levels: int) -> str:
    """YAML whose last key expands, through aliases, to 10**levels numbers."""
    lines = ["l0: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]")
    return "\n".join(lines) + "\n"


def test_yaml_aliases_expand_up_to_the_bound_and_a_bomb_is_refused_at_once():
    from trainer.core.config import MAX_YAML_VALUES, YamlLimitError, read_yaml

    tree = read_yaml(_alias_tree(4))  # about 11,000 values expanded: fine
    assert sum(len(x) for x in tree["l3"]) == 100
    start = time.perf_counter()
    with pytest.raises(YamlLimitError, match=f"more than {MAX_YAML_VALUES:,} values"):
        read_yaml(_alias_tree(9))  # 10**9 values if expanded
    assert time.perf_counter() - start < 2.0


def test_non_finite_numbers_are_refused_wherever_they_are(tiny_llama_config):
    from trainer.core.config import build_config

    base = {"model": {"config": tiny_llama_config}, "data": {"path": "hub/set", "seq_len": 64}}
    build_config(base)  # finite: fine
    inline = {"config": {**tiny_llama_config, "rope_theta": float("-inf")}}
    for key, tree in (
        ("train.lr", {**base, "train": {"lr": float("inf")}}),
        ("train.lr", {**base, "train": {"lr": "nan"}}),
        ("model.config.rope_theta", {**base, "model": inline}),
    ):
        with pytest.raises(ConfigError, match=rf"^config error: {key}: is -?(inf|nan) \(not a"):
            build_config(tree)


def test_the_keys_a_resume_may_not_change_are_marked_on_the_schema():
    """MATH_KEYS is derived from the fields marked LEARNED: what docs/checkpoints.md lists."""
    from trainer.core.config import MATH_KEYS

    data = ["path", "format", "seq_len", "text_field", "prompt_field", "completion_field",
            "messages_field", "chosen_field", "rejected_field", "eval_fraction", "pack",
            "append_eos"]  # fmt: skip
    train = ["global_batch_size", "lr", "min_lr_ratio", "schedule", "warmup_steps",
             "weight_decay", "betas", "eps", "grad_clip", "seed", "optimizer"]  # fmt: skip
    expected = {"model.name_or_path", "model.config", "model.revision", "model.rope_scaling",
                "precision", "finetune.method", "finetune.lora", "objective"}  # fmt: skip
    expected |= {f"data.{k}" for k in data} | {f"train.{k}" for k in train}
    assert set(MATH_KEYS) == expected and len(MATH_KEYS) == len(expected)


def test_a_resume_may_swap_adamw_8bit_and_paged_adamw_8bit(tmp_path):
    """The same math and checkpoint (docs/finetune.md): the swap is logged, not refused; a change
    to or from fp32 moments still is."""
    from trainer.core.config import resume_differences, semantic_hash

    job = write_demo_job(tmp_path / "job.yaml")
    cfgs = {o: load_config(job, [f"train.optimizer={o}"]) for o in ("adamw", "adamw_8bit",
                                                                   "paged_adamw_8bit")}  # fmt: skip
    for old, new in (("adamw_8bit", "paged_adamw_8bit"), ("paged_adamw_8bit", "adamw_8bit")):
        math, other = resume_differences(cfgs[old].to_dict(), cfgs[new])
        assert math == [] and other == [f'train.optimizer: "{old}" -> "{new}"'], (math, other)
        assert semantic_hash(cfgs[old]) == semantic_hash(cfgs[new])
    for old, new in (("adamw", "paged_adamw_8bit"), ("adamw_8bit", "adamw")):
        math, _ = resume_differences(cfgs[old].to_dict(), cfgs[new])
        assert math == [f'train.optimizer: "{old}" -> "{new}"'], math


def test_memory_headroom_is_plan_headroom_old_name_and_both_must_agree():
    demo = REPO / "configs" / "demo.yaml"
    assert load_config(demo, ["memory.headroom=0.2"]).plan.headroom == 0.2
    assert load_config(demo, ["plan.headroom=0.2", "memory.headroom=0.2"]).plan.headroom == 0.2
    with pytest.raises(ConfigError, match="plan.headroom: 0.3 disagrees with memory.headroom=0.2"):
        load_config(demo, ["plan.headroom=0.3", "memory.headroom=0.2"])
    for bad in ("0.95", "lots", "true"):
        with pytest.raises(ConfigError, match="plan.headroom"):
            load_config(demo, [f"plan.headroom={bad}"])
    with pytest.raises(ConfigError, match="debug.probe_scale"):
        load_config(demo, ["debug.probe_scale=0"])

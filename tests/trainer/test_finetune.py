"""LoRA, QLoRA and 8-bit AdamW (trainer/model/finetune.py) on one process: training, what a
checkpoint holds, bit-exact resume, export to a PEFT adapter dir and --merge. The module's runs
are `oomless train` in one process (tests/cli_worker.py); the 2-process rungs are rows of
tests/trainer/dist_runs.py (one shared torchrun launch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.cli_worker import IN_THIS_PROCESS
from tests.conftest import TINY_LLAMA, oomless, train_in_one_process, write_demo_job
from tests.trainer.adapter_checkpoints import engine_model, logits
from trainer.core import methods, strategies

pytestmark = pytest.mark.slow

# wide enough that the adapters are a small share of the weights, and that bitsandbytes keeps
# 8-bit moments for the larger matrices (it keeps fp32 ones under 4096 elements)
WIDE = {**TINY_LLAMA, "vocab_size": 45, "hidden_size": 256, "intermediate_size": 512}
LORA = {"method": "lora", "lora": {"r": 2, "alpha": 4}}
STEPS = 6
ADAMW_8BIT = "train.optimizer=adamw_8bit"


def _job(tmp: Path, name: str, **sections) -> Path:
    sections.setdefault("model", {"config": WIDE})
    return write_demo_job(
        tmp / f"{name}.yaml",
        train={"steps": STEPS, "global_batch_size": 8, "micro_batch_size": 4, "lr": 1e-2},
        run={"checkpoint_every": 2, "keep_checkpoints": 5},
        **sections,
    )


def _train(job: Path, run_dir: Path, *overrides: str) -> tuple[list[str], Path]:
    """A one-process run for train_in_one_process: its arguments and its log."""
    return [str(job), "strategy=single", f"run.dir={run_dir}", *overrides], run_dir / "stderr.txt"


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("finetune")
    lora = _job(work, "lora", finetune=LORA)
    # 8-bit AdamW: LoRA at rank 16 (adapters of 4096+ elements get 8-bit moments) and full
    lora_8bit = _job(work, "lora_8bit", finetune={**LORA, "lora": {"r": 16, "alpha": 32}})
    resume = f"run.resume={work / 'lora_8bit/checkpoints/step_2'}"
    # QLoRA: the 4-bit NF4 base, bf16 compute
    qlora = _job(work, "qlora", finetune={**LORA, "method": "qlora"}, precision="bf16")
    train_in_one_process(  # one after another, in one process (tests/cli_worker.py)
        [
            _train(_job(work, "full"), work / "full", "train.steps=2", "run.checkpoint_every=1"),
            _train(lora, work / "lora", "run.save_final=true"),
            _train(lora, work / "lora_resumed", f"run.resume={work / 'lora/checkpoints/step_4'}"),
            _train(lora_8bit, work / "lora_8bit", "train.optimizer=adamw_8bit", "train.steps=4"),
            _train(
                lora_8bit,
                work / "lora_8bit_resumed",
                "train.optimizer=adamw_8bit",
                "train.steps=4",
                resume,
            ),
            _train(
                _job(work, "full_8bit"),
                work / "full_8bit",
                "train.optimizer=adamw_8bit",
                "train.steps=3",
            ),
            _train(qlora, work / "qlora", "train.steps=3"),
            # torchtune's QLoRA: bf16 adapters and AdamW moments (precision: bf16_pure)
            _train(qlora, work / "qlora_pure", "precision=bf16_pure", "train.steps=4"),
            _train(
                qlora,
                work / "qlora_pure_resumed",
                "precision=bf16_pure",
                "train.steps=4",
                f"run.resume={work / 'qlora_pure/checkpoints/step_2'}",
            ),  # fmt: skip
        ]
    )
    return work


def test_lora_trains_and_its_checkpoint_holds_only_the_adapters(runs):
    losses = _losses(runs / "lora")
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.05, losses
    lora, full = runs / "lora" / "checkpoints" / "step_2", runs / "full" / "checkpoints" / "step_1"
    assert _bytes(lora) < 0.05 * _bytes(full), (_bytes(lora), _bytes(full))
    # the start line says what trains: 7 linear layers x 2 blocks, r=2 (WIDE: 256 -> 256, 128,
    # 128, 256; 256 -> 512, 512; 512 -> 256)
    assert "params (lora: 16,384 trainable)" in (runs / "lora" / "stderr.txt").read_text()
    state = json.loads((lora / "trainer_state.json").read_text())
    assert state["base"]["source"] == "inline config" and len(state["base"]["fingerprint"]) == 16


def test_lora_resume_is_bit_exact(runs):
    assert _losses(runs / "lora_resumed") == _losses(runs / "lora")[4:]


def _optim_dtypes(ckpt: Path) -> dict[str, torch.dtype]:
    from trainer.checkpoint.layout import SafeFileSystemReader

    meta = SafeFileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return {k: m.properties.dtype for k, m in meta.items() if k.startswith("optim/")}


@pytest.mark.parametrize("name", ["lora_8bit", "full_8bit"])
def test_adamw_8bit_trains_with_8bit_moments(runs, name):
    losses = _losses(runs / name)
    assert losses[-1] < losses[0] - 0.05, losses
    dtypes = _optim_dtypes(runs / name / "checkpoints" / "step_2")
    assert any(k.endswith("/state1") and d == torch.uint8 for k, d in dtypes.items()), dtypes
    # tensors under 4096 values keep fp32 moments
    assert all(d == torch.float32 for k, d in dtypes.items() if k.endswith("/exp_avg")), dtypes


def test_adamw_8bit_resume_is_bit_exact(runs):
    assert _losses(runs / "lora_8bit_resumed") == _losses(runs / "lora_8bit")[2:]


def test_qlora_trains_a_4bit_base(runs):
    losses = _losses(runs / "qlora")
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.05, losses
    names = _optim_dtypes(runs / "qlora" / "checkpoints" / "step_2")
    assert names and all(".lora_" in k for k in names)


def test_qlora_under_bf16_pure_trains_bf16_adapters_and_resumes_exactly(runs):
    losses = _losses(runs / "qlora_pure")
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.05, losses
    assert _losses(runs / "qlora_pure_resumed") == losses[2:]
    ckpt = runs / "qlora_pure" / "checkpoints" / "step_2"
    optim = _optim_dtypes(ckpt)
    moments = {d for k, d in optim.items() if k.endswith(("/exp_avg", "/exp_avg_sq"))}
    assert optim and all(".lora_" in k for k in optim) and moments == {torch.bfloat16}, optim
    adapters = {d for k, d in _dtypes(ckpt).items() if ".lora_" in k and not k.startswith("optim/")}
    assert adapters == {torch.bfloat16}, adapters


def _dtypes(ckpt: Path) -> dict[str, torch.dtype]:
    from trainer.checkpoint.layout import SafeFileSystemReader

    meta = SafeFileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return {k: m.properties.dtype for k, m in meta.items() if hasattr(m, "properties")}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().flatten().view(torch.uint8)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_a_pretrained_base_loads_in_its_compute_dtype_with_the_numbers_of_fp32_then_cast(
    tmp_path, method
):
    """A frozen base loads from its files straight in bf16 (2 bytes per parameter on the host,
    not 4): every tensor, the quantised ones of QLoRA included, equals loading fp32 and casting."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainer.core.config import load_config
    from trainer.model.build import HFModelFactory
    from trainer.model.finetune import FinetuneFactory, apply_finetune

    base = tmp_path / "base"
    config = LlamaConfig(**{k: v for k, v in WIDE.items() if k != "model_type"})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(base)
    job = _job(tmp_path, method, finetune={**LORA, "method": method}, precision="bf16")
    cfg = load_config(job, [f"model.name_or_path={base}", "model.config=null"])
    inner = HFModelFactory(cfg.model, cfg.train.seed)

    loaded = FinetuneFactory(inner, cfg).build("cpu")
    cast = apply_finetune(inner.build("cpu"), cfg.finetune, cfg.precision, cfg.train.seed)

    assert loaded.base_model.model.config.dtype == torch.bfloat16  # as from_pretrained loaded it
    assert cast.base_model.model.config.dtype == torch.float32
    got, want = loaded.state_dict(), cast.state_dict()
    assert got.keys() == want.keys()
    for name, t in want.items():  # bit for bit (QLoRA's packed bytes, viewed as bf16, hold NaNs)
        assert got[name].dtype == t.dtype, name
        assert torch.equal(_bits(got[name]), _bits(t)), name
    assert {t.dtype for n, t in got.items() if ".lora_" in n} == {torch.float32}
    assert got["base_model.model.model.norm.weight"].dtype == torch.bfloat16


def test_a_resume_on_another_base_is_refused_in_one_line(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    base = tmp_path / "base"
    config = LlamaConfig(**{k: v for k, v in WIDE.items() if k != "model_type"})
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    job = _job(tmp_path, "pretrained", finetune=LORA)
    tree = yaml.safe_load(job.read_text())
    tree["model"] = {"name_or_path": str(base), "tokenizer": tree["model"]["tokenizer"]}
    job.write_text(yaml.safe_dump(tree))
    train_in_one_process([_train(job, tmp_path / "run", "train.steps=2", "run.checkpoint_every=1")])
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(base)  # same path, other weights
    r = oomless(
        "train", str(job), "strategy=single", f"run.dir={tmp_path / 'run'}", "train.steps=3",
        IN_THIS_PROCESS,
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert "adapters trained on another base" in r.stderr


def test_export_writes_a_peft_adapter_dir_and_merge_a_plain_model(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.core.config import load_config
    from trainer.model.build import HFModelFactory

    ckpt = runs / "lora" / "checkpoints" / "step_4"
    want = logits(engine_model(ckpt))
    r = oomless("export", str(ckpt), str(tmp_path / "adapter"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    cfg = load_config(ckpt / "config.yaml", [])
    base = HFModelFactory(cfg.model, cfg.train.seed).build("cpu")
    got = logits(PeftModel.from_pretrained(base, tmp_path / "adapter").eval())
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()

    r = oomless("export", str(ckpt), str(tmp_path / "merged"), "--merge")
    assert r.returncode == 0, r.stderr[-2000:]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    got = logits(merged.eval())
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    # the run's own final/ is the adapter dir of the last step
    assert (runs / "lora" / "final" / "adapter_model.safetensors").is_file()


def test_every_rung_runs_lora_and_the_replicas_fsdp_and_zero3_qlora_and_adamw_8bit():
    # every rung but `stream`, which trains full fine-tunes only (docs/stream.md)
    assert methods.supported_rungs("lora") == tuple(n for n in strategies.names() if n != "stream")
    assert methods.supported_rungs("qlora") == (
        "single",
        "ddp",
        "fsdp",
        "zero3",
        "fsdp_offload",
        "zero3_offload",
        "zero3_offload_params",
    )
    assert methods.supported_rungs("lora", "adamw_8bit") == (
        "single",
        "ddp",
        "fsdp",
        "fsdp_offload",
    )
    assert methods.method_support("zero2", "qlora").startswith("qlora: DeepSpeed")
    assert methods.method_support("zero3_nvme", "qlora").startswith("qlora: ZeRO-Infinity")


def test_the_planner_leaves_out_the_rungs_that_cannot_run_the_method(tmp_path):
    """Escalation re-plans with the same method: the rungs that cannot run it are never chosen,
    each with the engine's reason (trainer/core/methods.py)."""
    job = _job(tmp_path, "plan", finetune={**LORA, "method": "qlora"}, precision="bf16")
    r = oomless("plan", str(job), "hardware.devices_per_node=2", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(r.stdout)
    assert plan["strategy"] == "ddp"
    why = {a["strategy"]: a["why_not"] for a in plan["alternatives"] if "change" not in a}
    assert why["zero2"] == methods.method_support("zero2", "qlora")
    assert why["zero2"].startswith("qlora: DeepSpeed ZeRO")


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_zero3_holds_a_frozen_base_as_the_estimate_counts(tmp_path, method):
    """ZeRO-3 under bf16 holds a frozen LoRA base in bf16 partitions (it kept the base in fp32,
    twice what the estimate counts) and QLoRA's packed NF4 weights in bf16 partitions with
    their quantisation states beside them; the adapters in fp32 ones. The bytes one rank holds
    are the estimate's parameters for the same job, byte for byte."""
    from launcher.estimate.model_states import model_states
    from launcher.estimate.shape import shape_of
    from tests.conftest import PYTHON, python_env, run_bounded
    from trainer.core.step_spec import Finetune, StepSpec

    r = run_bounded([PYTHON, "-m", "tests.trainer.zero3_lora_worker", str(tmp_path), method],
                    timeout=300, env=python_env())  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    held = json.loads(r.stdout.strip().splitlines()[-1])
    kinds = {"frozen bfloat16", "trained float32"}
    assert set(held) == (kinds | {"quantisation states"} if method == "qlora" else kinds)
    shape = shape_of(json.dumps({**TINY_LLAMA, "vocab_size": 45}, sort_keys=True))
    spec = StepSpec(strategy="zero3", world_size=1, devices_per_node=1, micro_batch_size=2,
                    seq_len=32, activation_checkpointing="none", precision="bf16",
                    finetune=Finetune(method=method, r=4, pretrained=False))  # fmt: skip
    assert model_states(spec, shape).on_device["params"] == sum(held.values())

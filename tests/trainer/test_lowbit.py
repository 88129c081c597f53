"""The opt-in low-bit levers (docs/finetune.md): `precision: bf16_pure` (bf16 weights, gradients
and AdamW state, no fp32 master) and `train.optimizer_in_backward` (each parameter stepped as its
gradient is ready). One-process runs go through `oomless train`, all in one process
(tests/cli_worker.py); the two-process ones share one torchrun launch
(tests/trainer/lowbit_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    PYTHON,
    REPO,
    live_children,
    oomless,
    python_env,
    run_bounded,
    train_in_one_process,
    write_demo_job,
)
from tests.trainer.adapter_checkpoints import engine_model, logits
from tests.trainer.saved_model import PRETRAINED_LINEAR_PARAMS, save_pretrained_model
from trainer.core import methods
from trainer.core.config import ConfigError, load_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
STEPS = 6
# wide enough that bf16's rounding shows if the weights were not stepped as bf16
MODEL = {
    "model_type": "llama",
    "vocab_size": 45,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def _base(tmp: Path) -> Path:
    return write_demo_job(
        tmp / "base.yaml",
        model={"config": MODEL},
        train={
            "steps": STEPS,
            "global_batch_size": 8,
            "micro_batch_size": 4,  # x 2 ranks: one micro-batch per step
            "lr": 1e-2,
            "grad_clip": 0.0,  # the step in backward cannot clip by the global norm
        },
        hardware={"devices_per_node": 2},
        run={"checkpoint_every": 0, "keep_checkpoints": 5},
        dist={"timeout_s": 120},
    )


def _single(base: Path, run_dir: Path, *overrides: str) -> tuple[list[str], Path]:
    """A one-process run for train_in_one_process: its arguments and its log."""
    args = [str(base), "strategy=single", "hardware.devices_per_node=1",
            "train.micro_batch_size=8", f"run.dir={run_dir}", *overrides]  # fmt: skip
    return args, run_dir / "stderr.txt"


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in _metrics(run_dir)]


def _dtypes(ckpt: Path) -> dict[str, torch.dtype]:
    from trainer.checkpoint.layout import SafeFileSystemReader

    meta = SafeFileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return {k: m.properties.dtype for k, m in meta.items() if hasattr(m, "properties")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    from tests.trainer.lowbit_worker import ADAMW_8BIT, LORA_8BIT, ODD_8BIT, RUNS

    work = tmp_path_factory.mktemp("lowbit")
    base = _base(work)
    save_pretrained_model(work / "pretrained")
    # the one-process references, in one process (tests/cli_worker.py)
    train_in_one_process(
        [
            _single(base, work / "single_fp32"),
            _single(base, work / "single_in_backward", "train.optimizer_in_backward=true"),
            _single(
                base, work / "single_bf16_pure", "precision=bf16_pure", "run.checkpoint_every=2"
            ),
            _single(
                base,
                work / "single_bf16_pure_resumed",
                "precision=bf16_pure",
                "run.checkpoint_every=2",
                f"run.resume={work / 'single_bf16_pure/checkpoints/step_2'}",
            ),
            _single(base, work / "single_8bit", *ADAMW_8BIT),
            _single(base, work / "single_8bit_odd", *ODD_8BIT),
            _single(base, work / "single_lora_8bit", *LORA_8BIT),
            _single(base, work / "single_bf16_pure_8bit", *ODD_8BIT, "precision=bf16_pure"),
        ]
    )
    before = {p.pid for p in live_children()}
    r = run_bounded(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(REPO / "tests" / "trainer" / "lowbit_worker.py"), str(base), str(work)],
        env=python_env(), cwd=REPO, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    (work / "launch.log").write_text(r.stderr)
    assert not {p.pid for p in live_children()} - before
    assert all((work / name / "metrics.jsonl").is_file() for name in RUNS)
    # the two ranks' 8-bit shards gathered onto one process
    resume, resume_odd = (
        f"run.resume={work / name / 'checkpoints/step_2'}"
        for name in ("fsdp_8bit", "fsdp_8bit_odd")
    )
    train_in_one_process(
        [
            _single(base, work / "single_8bit_from_fsdp", *ADAMW_8BIT, resume),
            _single(base, work / "single_8bit_odd_from_fsdp", *ODD_8BIT, resume_odd),
        ]
    )
    return work


def _close(got: list[float], want: list[float], tol: float) -> None:
    assert len(got) == len(want) == STEPS
    for step, (a, b) in enumerate(zip(got, want, strict=True), start=1):
        assert abs(a - b) <= tol * abs(b), f"step {step}: {a} vs {b}"


@pytest.mark.parametrize(
    "name", ["single_bf16_pure", "fsdp_bf16_pure", "ddp_bf16_pure",
             "fsdp_offload_bf16_pure_in_backward"],
)  # fmt: skip
def test_bf16_pure_trains_with_falling_loss_close_to_fp32(runs, name):
    """bf16 weights stepped by a stochastically rounded AdamW learn what fp32 learns, to bf16's
    precision (the losses of 6 steps within 2%), and the loss falls."""
    losses = _losses(runs / name)
    assert losses[-1] < losses[0] - 0.5, losses
    _close(losses, _losses(runs / "single_fp32"), 2e-2)


@pytest.mark.parametrize("name", ["single_bf16_pure_8bit", "fsdp_bf16_pure_8bit"])
def test_bf16_pure_with_8bit_moments_learns_what_fp32_weights_with_8bit_moments_learn(runs, name):
    """bitsandbytes' 8-bit step on bf16 weights, rounded stochastically (trainer/optim.py)."""
    losses = _losses(runs / name)
    assert losses[-1] < losses[0] - 0.5, losses
    _close(losses, _losses(runs / "single_8bit_odd"), 2e-2)


@pytest.mark.parametrize("name", ["single_bf16_pure", "fsdp_bf16_pure"])
def test_a_bf16_pure_checkpoint_holds_bf16_weights_and_moments(runs, name):
    dtypes = _dtypes(runs / name / "checkpoints" / "step_2")
    weights = {d for k, d in dtypes.items() if k.startswith("model/")}
    moments = {d for k, d in dtypes.items() if k.endswith(("/exp_avg", "/exp_avg_sq"))}
    assert weights == moments == {torch.bfloat16}, dtypes


def test_bf16_pure_resumes_bit_exact(runs):
    """The weights, the bf16 moments and the RNG the stochastic rounding draws from all come
    back: steps 3..6 resumed from step 2 are the straight run's, bit for bit."""
    assert _losses(runs / "single_bf16_pure_resumed") == _losses(runs / "single_bf16_pure")[2:]


@pytest.mark.parametrize(
    ("name", "against"),
    [("single_in_backward", "single_fp32"), ("fsdp_in_backward", "fsdp_fp32")],
)
def test_the_step_in_backward_is_the_ordinary_step(runs, name, against):
    """Stepping each parameter (each FSDP2 shard) in its gradient hook gives the losses and
    gradient norms of stepping all of them after backward."""
    got, want = _metrics(runs / name), _metrics(runs / against)
    _close([m["loss"] for m in got], [m["loss"] for m in want], 1e-5)
    _close([m["grad_norm"] for m in got], [m["grad_norm"] for m in want], 1e-4)


def test_fsdp_in_backward_matches_one_process(runs):
    _close(_losses(runs / "fsdp_in_backward"), _losses(runs / "single_fp32"), 1e-4)


def test_bf16_pure_and_a_mixed_precision_checkpoint_do_not_resume_each_other(runs, tmp_path):
    """precision is a math key: a bf16_pure run refuses a mixed-precision checkpoint (and the
    other way round) with one line naming the key, before anything trains."""
    r = oomless(
        "train", str(runs / "base.yaml"), "strategy=single", "hardware.devices_per_node=1",
        "train.micro_batch_size=8", "precision=fp32", f"run.dir={tmp_path / 'x'}",
        f"run.resume={runs / 'fsdp_bf16_pure/checkpoints/step_2'}",
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert "precision" in line and "bf16_pure" in line and "fp32" in line, line
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["train.optimizer_in_backward=true", "train.grad_clip=1.0"],
         "train.optimizer_in_backward", "train.grad_clip=0"),
        (["train.optimizer_in_backward=true", "train.micro_batch_size=2"],
         "train.optimizer_in_backward", "one micro-batch per step"),
        (["train.optimizer_in_backward=true", "strategy=ddp"], "strategy", "DDP reduces"),
        (["train.optimizer_in_backward=true", "strategy=zero3"], "strategy", "DeepSpeed owns"),
        (["precision=bf16_pure", "strategy=zero2"], "strategy", "fp32 master copy"),
    ],
)  # fmt: skip
def test_what_cannot_keep_the_math_is_refused_in_one_line(tmp_path, overrides, key, says):
    base = _base(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_config(base, overrides)
    assert err.value.key == key and says in str(err.value), str(err.value)


def test_the_table_says_where_each_opt_in_runs():
    assert methods.supported_rungs(precision="bf16_pure") == (
        "single", "ddp", "fsdp", "fsdp_offload",
    )  # fmt: skip
    assert methods.supported_rungs(in_backward=True) == ("single", "fsdp", "fsdp_offload")
    assert methods.supported_rungs("qlora") == (
        "single", "ddp", "fsdp", "zero3", "fsdp_offload", "zero3_offload", "zero3_offload_params",
    )  # fmt: skip
    assert methods.supported_rungs(optimizer="adamw_8bit") == (
        "single", "ddp", "fsdp", "fsdp_offload",
    )  # fmt: skip


@pytest.mark.parametrize("name", ["fsdp_8bit", "fsdp_offload_8bit"])
def test_adamw_8bit_on_fsdp_shards_learns_what_one_process_learns(runs, name):
    """bitsandbytes' 8-bit step on each rank's rows: every block of 256 is a block of the whole
    matrix, so two shards step as one replica does (to the reduction's rounding)."""
    losses = _losses(runs / name)
    assert losses[-1] < losses[0] - 0.5, losses
    _close(losses, _losses(runs / "single_8bit"), 1e-4)


def test_paged_adamw_8bit_on_two_cpu_ranks_is_adamw_8bit_and_resumes_bit_exact(runs):
    """On CPU processes there is no CUDA memory to page from: the same 8-bit step, said in the
    start line; its checkpoint resumes to the same losses."""
    losses = _losses(runs / "fsdp_paged_8bit")
    assert losses == _losses(runs / "fsdp_8bit") and losses[-1] < losses[0] - 0.5, losses
    assert _losses(runs / "fsdp_paged_8bit_resumed") == losses[2:]
    assert (
        "paged_adamw_8bit (run as adamw_8bit: no CUDA memory to page here)"
        in (runs / "launch.log").read_text()
    )


def test_an_8bit_fsdp_checkpoint_holds_8bit_codes_and_block_scales_per_row(runs):
    from trainer.checkpoint.layout import SafeFileSystemReader

    meta = SafeFileSystemReader(str(runs / "fsdp_8bit/checkpoints/step_2")).read_metadata()
    sizes = {k: tuple(m.size) for k, m in meta.state_dict_metadata.items()}
    dtypes = _dtypes(runs / "fsdp_8bit/checkpoints/step_2")
    down = "optim/model.layers.0.mlp.down_proj.weight"
    assert dtypes[f"{down}/state1"] == dtypes[f"{down}/state2"] == torch.uint8
    assert sizes[f"{down}/state1"] == (256, 512) and sizes[f"{down}/absmax1"] == (256, 2)
    norm = "optim/model.layers.0.input_layernorm.weight"  # small tensors: fp32 moments
    assert dtypes[f"{norm}/exp_avg"] == torch.float32 and f"{norm}/state1" not in dtypes


def test_adamw_8bit_on_fsdp_resumes_bit_exact(runs):
    assert _losses(runs / "fsdp_8bit_resumed") == _losses(runs / "fsdp_8bit")[2:]


@pytest.mark.parametrize(
    ("name", "against"),
    [("fsdp_8bit_from_single", "single_8bit"), ("single_8bit_from_fsdp", "fsdp_8bit")],
)
def test_8bit_moments_move_between_one_process_and_fsdp_shards(runs, name, against):
    got, want = _losses(runs / name), _losses(runs / against)[2:]
    assert len(got) == len(want) == STEPS - 2
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) <= 1e-4 * b, (got, want)


@pytest.mark.parametrize(
    ("name", "against"),
    [
        ("fsdp_8bit_odd_from_ddp", "ddp_8bit_odd"),
        ("ddp_8bit_odd_from_fsdp", "fsdp_8bit_odd"),
        ("fsdp_offload_8bit_odd_from_single", "single_8bit_odd"),
        ("single_8bit_odd_from_fsdp", "fsdp_8bit_odd"),
        ("ddp_lora_8bit_from_fsdp", "fsdp_lora_8bit"),
        ("fsdp_lora_8bit_from_single", "single_lora_8bit"),
    ],
)
def test_8bit_moments_of_any_shape_move_between_every_rung(runs, name, against):
    """A replica quantises every tensor of 4096+ values in blocks that run across rows; an FSDP2
    shard keeps fp32 moments for matrices whose rows do not hold whole blocks. Checkpoints hold
    those moments as fp32 (dequantised), and each rung re-quantises them into its own blocks:
    the steps after the move stay within 2% of the run that did not move (loading the codes as
    fp32 moments put the loss at 7.16 against 2.49)."""
    got, want = _losses(runs / name), _losses(runs / against)[2:]
    assert len(got) == len(want) == STEPS - 2
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) <= 0.02 * b, (got, want)
    norms = [m["grad_norm"] for m in _metrics(runs / name)]
    want_norms = [m["grad_norm"] for m in _metrics(runs / against)[2:]]
    assert max(norms) <= 1.5 * max(want_norms), (norms, want_norms)


def test_an_odd_shaped_8bit_checkpoint_holds_what_its_writer_kept(runs):
    """A replica's codes (blocks over the flattened matrix), an FSDP shard's fp32 moments: each
    rung loads either (the moves above)."""
    q = "optim/model.layers.0.self_attn.q_proj.weight"  # [64, 64]: 8-bit on a replica
    dtypes = _dtypes(runs / "single_8bit_odd" / "checkpoints/step_2")
    assert dtypes[f"{q}/state1"] == torch.uint8 and f"{q}/exp_avg" not in dtypes
    dtypes = _dtypes(runs / "fsdp_8bit_odd" / "checkpoints/step_2")
    assert dtypes[f"{q}/exp_avg"] == torch.float32 and f"{q}/state1" not in dtypes


@pytest.mark.parametrize("name", ["fsdp_qlora", "fsdp_offload_qlora"])
def test_qlora_on_fsdp_shards_learns_what_ddp_replicas_learn(runs, name):
    """The 4-bit base sharded by FSDP2 (bf16 storage of the packed weights, each layer keeping
    its quantisation state): 6 steps with a falling loss, each within 1e-3 of QLoRA on two DDP
    replicas of the same quantised base."""
    losses = _losses(runs / name)
    assert losses[-1] < losses[0] - 0.5, losses
    _close(losses, _losses(runs / "ddp_qlora"), 1e-3)


def test_qlora_on_fsdp_resumes_bit_exact_and_checkpoints_only_the_adapters(runs):
    assert _losses(runs / "fsdp_qlora_resumed") == _losses(runs / "fsdp_qlora")[2:]
    names = _dtypes(runs / "fsdp_qlora/checkpoints/step_2")
    assert names and all(".lora_" in k for k in names if k.startswith(("model/", "optim/")))
    assert (runs / "fsdp_qlora/final/adapter_model.safetensors").is_file()


def test_qlora_on_fsdp_loads_a_saved_model_as_ddp_replicas_load_it(runs):
    """Each fsdp rank quantises the saved model's weights into its own rows: the losses are
    those of two DDP replicas that load it with transformers' from_pretrained and quantise it
    whole."""
    got, want = _losses(runs / "fsdp_qlora_pretrained"), _losses(runs / "ddp_qlora_pretrained")
    assert len(got) == len(want) == 2
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) <= 1e-3 * b, (got, want)


def test_rank0_quantising_its_shard_grows_by_less_than_the_shard_plus_one_tensor(runs):
    """Rank 0's resident set while loading grows by less than what it keeps (its half of the
    4-bit linears, its rows of the rest, the quantisation states) plus the largest weight in
    fp32: the whole 16-bit base (76 MB) never sits on a rank."""
    load = json.loads((runs / "fsdp_qlora_pretrained" / "load_rank0.json").read_text())
    growth = load["rss_peak_bytes"] - load["rss_before_bytes"]
    four_bit_half = PRETRAINED_LINEAR_PARAMS // 4  # 0.5 bytes a weight, half of them
    assert four_bit_half <= load["held_bytes"] <= 1.2 * four_bit_half, load
    assert load["largest_tensor_bytes"] == 4 * 2048 * 1024, load
    assert growth <= load["held_bytes"] + load["largest_tensor_bytes"], load


def test_a_sharded_qlora_checkpoint_exports_an_adapter_peft_loads(runs, tmp_path):
    """`oomless export` of the two ranks' checkpoint: peft puts the adapter on the same 4-bit
    base and gives the engine's logits; --merge writes the unquantised base with the adapters
    merged, as peft merges them."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.model.build import HFModelFactory
    from trainer.model.finetune import QLORA_COMPUTE_DTYPE, quantize_decoder_linears

    ckpt = runs / "fsdp_qlora/checkpoints/step_4"
    want = logits(engine_model(ckpt))
    r = oomless("export", str(ckpt), str(tmp_path / "adapter"))
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = load_config(ckpt / "config.yaml", [])
    base = HFModelFactory(cfg.model, cfg.train.seed).build("cpu")
    quantize_decoder_linears(base)
    for p in base.parameters():
        if p.is_floating_point():
            p.data = p.data.to(QLORA_COMPUTE_DTYPE)
    got = logits(PeftModel.from_pretrained(base, tmp_path / "adapter").eval())
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()

    r = oomless("export", str(ckpt), str(tmp_path / "merged"), "--merge")
    assert r.returncode == 0, r.stderr[-2000:]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    full = HFModelFactory(cfg.model, cfg.train.seed).build("cpu")
    peft_merged = PeftModel.from_pretrained(full, tmp_path / "adapter").merge_and_unload()
    want_merged = logits(peft_merged.eval())
    got = logits(merged)
    assert (got - want_merged).abs().max() <= 1e-4 * want_merged.abs().max()

"""Plans for big models on few small cards: QLoRA and 8-bit AdamW on the FSDP rungs,
`precision: bf16_pure` and the step in backward counted by the estimate, and the exit-3 line that
names the opt-in changes that would fit, each as overrides `oomless plan` accepts. Pure planning
through the command line (no GPU, no torch), on the shipped presets and a 405B-shaped Llama."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from launcher.cli import main
from launcher.estimate.model_states import model_states
from launcher.estimate.peak import estimate
from launcher.estimate.shape import model_shape
from trainer.core.config import load_config
from trainer.core.methods import method_support
from trainer.core.step_spec import Finetune, StepSpec
from trainer.core.units import GIB

PRESET_8B = "configs/models/llama-3.1-8b.yaml"
PRESET_70B = "configs/models/llama-3.1-70b.yaml"
QLORA_JOB = ["finetune.method=qlora", "data.seq_len=2048", "train.global_batch_size=8"]
# Llama-3.1-405B's published dimensions (its config.json on the hub)
LLAMA_405B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_hidden_layers": 126,
    "num_attention_heads": 128,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}  # fmt: skip


def _gpus(count: int, memory: str, host: str) -> list[str]:
    return [
        "hardware.device=cuda",
        "hardware.nodes=1",
        f"hardware.devices_per_node={count}",
        f"hardware.device_memory={memory}",
        f"hardware.host_memory={host}",
    ]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)


def _plan(capsys, *args: str) -> tuple[int, dict, str]:
    """`oomless plan ... --json`: exit code, the JSON, stderr."""
    try:
        rc = main(["plan", *args, "--json"])
    except SystemExit as stop:
        rc = stop.code
    out, err = capsys.readouterr()
    return rc, json.loads(out) if out.strip() else {}, err


def _assert_fits(plan: dict, device_gib: float, host_gib: float) -> None:
    est = plan["estimate"]
    assert est["device"]["total_bytes"] <= device_gib * GIB
    assert est["host"]["total_bytes"] <= host_gib * GIB
    assert est["host"]["breakdown"]["initial_weights"] > 0  # loading is counted


def test_70b_qlora_fits_two_24gib_cards_on_an_fsdp_rung(capsys):
    """Each rank quantises its own rows of the base (trainer/model/qlora_load.py): ~17.5 GB of 4-bit
    weights per card, one tensor in flight on the host while loading."""
    rc, plan, err = _plan(capsys, PRESET_70B, *QLORA_JOB, *_gpus(2, "24GiB", "128GiB"))
    assert rc == 0, err
    assert plan["strategy"] in ("fsdp", "fsdp_offload"), plan["strategy"]
    _assert_fits(plan, 24, 128)
    est = plan["estimate"]
    assert est["host"]["breakdown"]["initial_weights"] < 8 * GIB  # no 16-bit base per rank


def test_405b_shaped_llama_qlora_fits_eight_80gib_cards(capsys, tmp_path):
    job = tmp_path / "405b.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "model": {"config": LLAMA_405B},
                "data": {"path": "HuggingFaceH4/no_robots", "format": "chat"},
            }
        )
    )
    rc, plan, err = _plan(capsys, str(job), *QLORA_JOB, *_gpus(8, "80GiB", "2TiB"))
    assert rc == 0, err
    assert plan["strategy"] in ("fsdp", "fsdp_offload"), plan["strategy"]
    _assert_fits(plan, 80, 2048)


def test_8b_full_in_bf16_pure_with_8bit_adamw_fits_one_24gib_card(capsys):
    hw = _gpus(1, "24GiB", "64GiB")
    rc, plan, err = _plan(capsys, PRESET_8B, *hw, "precision=bf16_pure",
                          "train.optimizer=adamw_8bit")  # fmt: skip
    assert rc == 0, err
    _assert_fits(plan, 24, 64)
    # the same job in mixed precision: 16 bytes of state per parameter do not fit anywhere here
    rc, _, err = _plan(capsys, PRESET_8B, *hw, "train.optimizer=adamw_8bit")
    assert rc == 3 and "precision=bf16_pure" in err


def test_8b_full_that_fits_nowhere_names_bf16_pure_and_8bit_adamw_first_and_each_plans(capsys):
    hw = _gpus(1, "24GiB", "64GiB")
    rc, nofit, err = _plan(capsys, PRESET_8B, *hw)
    assert rc == 3
    line = err.strip().splitlines()[-1]
    first = line.index("precision=bf16_pure and train.optimizer=adamw_8bit would fit on")
    assert first < line.index("finetune.method=lora would fit")
    changes = [alt["overrides"] for alt in nofit["alternatives"]]
    assert changes[0] == ["precision=bf16_pure", "train.optimizer=adamw_8bit"]
    assert ["finetune.method=lora"] in changes
    for alt in nofit["alternatives"]:  # what the line offers, `oomless plan` accepts and fits
        rc, plan, err = _plan(capsys, PRESET_8B, *hw, *alt["overrides"])
        assert rc == 0, (alt["overrides"], err)
        assert plan["strategy"] == alt["strategy"]
        _assert_fits(plan, 24, 64)


def test_the_step_in_backward_is_offered_where_bf16_pure_alone_does_not_fit(capsys):
    # a global batch of one sequence per card: the step in backward needs no accumulation
    hw = _gpus(1, "24GiB", "40GiB")
    job = [PRESET_8B, *hw, "train.global_batch_size=1", "data.seq_len=2048"]
    rc, nofit, err = _plan(capsys, *job)
    assert rc == 3, err
    changes = [alt["overrides"] for alt in nofit["alternatives"]]
    in_backward = [c for c in changes if "train.optimizer_in_backward=true" in c]
    assert in_backward and "train.grad_clip=0" in in_backward[0]
    assert changes.index(in_backward[0]) < changes.index(["finetune.method=lora"])
    rc, plan, err = _plan(capsys, *job, *in_backward[0])
    assert rc == 0, err
    assert plan["grad_accum"] == 1
    assert plan["estimate"]["device"]["breakdown"]["grads"] < 2 * GIB  # one layer's at a time


def test_the_step_in_backward_holds_no_gradients_from_layer_to_layer():
    shape = model_shape(load_config(PRESET_8B).model)
    phases = {}
    for in_backward in (False, True):
        spec = StepSpec("single", 1, 1, 1024, "full", precision="bf16_pure",
                        finetune=Finetune(in_backward=in_backward))  # fmt: skip
        est = estimate(shape, spec)
        phases[in_backward] = est.phases
        grads = est.device_breakdown["grads"]
    bf16_grads = 2 * shape.num_params
    assert phases[False]["optimizer"] - phases[True]["optimizer"] == bf16_grads
    # by the embedding's backward every layer's gradients exist, unless each was stepped
    freed = phases[False]["backward_embedding"] - phases[True]["backward_embedding"]
    assert freed == pytest.approx(2 * shape.num_layers * shape.num_layer_params, rel=0.05)
    assert grads == 2 * shape.num_layer_params  # the layer being back-propagated


HOST_HINT = re.compile(r"(\w+) would fit with (\d+) GiB host memory per node")


@pytest.mark.parametrize(
    "job, host_gib",
    [
        ([PRESET_70B, *QLORA_JOB, *_gpus(2, "6GiB", "128GiB")], 128),
        ([PRESET_8B, "train.optimizer=adamw_8bit", *_gpus(1, "24GiB", "64GiB")], 64),
        ([PRESET_8B, *_gpus(1, "24GiB", "64GiB")], 64),
        ([PRESET_70B, *_gpus(2, "80GiB", "256GiB")], 256),
    ],
)
def test_an_exit_3_host_hint_names_a_rung_that_runs_the_method_and_more_host_than_there_is(
    capsys, job, host_gib
):
    rc, nofit, err = _plan(capsys, *job)
    assert rc == 3, err
    line = err.strip().splitlines()[-1]
    method = next((a.split("=")[1] for a in job if a.startswith("finetune.method=")), "full")
    optimizer = next((a.split("=")[1] for a in job if a.startswith("train.optimizer=")), "adamw")
    for rung, need in HOST_HINT.findall(line):
        assert method_support(rung, method, optimizer) is None, line
        assert int(need) > host_gib, line
    for alt in nofit["alternatives"]:  # an opt-in change is offered on a rung that runs it
        opts = dict(o.split("=", 1) for o in alt["overrides"])
        why = method_support(
            alt["strategy"],
            opts.get("finetune.method", method),
            opts.get("train.optimizer", optimizer),
            opts.get("precision", "bf16"),
            opts.get("train.optimizer_in_backward") == "true",
        )
        assert why is None, alt


def test_bf16_pure_and_8bit_moments_per_shard_are_counted_where_they_live():
    shape = model_shape(load_config(PRESET_8B).model)
    n = shape.num_params

    def states(strategy: str, world: int, optimizer: str = "adamw", precision: str = "bf16_pure"):
        spec = StepSpec(strategy, world, 1, 1024, "full", precision=precision,
                        finetune=Finetune(optimizer=optimizer))  # fmt: skip
        return model_states(spec, shape)

    single = states("single", 1).on_device
    assert (single["params"], single["grads"], single["optimizer"]) == (2 * n, 2 * n, 4 * n)
    mixed = states("fsdp", 4, precision="bf16").on_device
    assert states("fsdp", 4).on_device["params"] * 2 == mixed["params"] == 4 * n // 4
    # fsdp_offload steps the 8-bit moments of each rank's rows on the host
    host = states("fsdp_offload", 4, "adamw_8bit").on_host
    assert host["params"] == 2 * n // 4
    assert host["optimizer"] == pytest.approx(2.03 * n / 4, rel=0.01)


def test_qlora_on_fsdp_loads_one_chunk_at_a_time_beyond_the_shard():
    shape = model_shape(load_config(PRESET_70B).model)
    spec = StepSpec("fsdp", 2, 1, 2048, "full", devices_per_node=2,
                    finetune=Finetune(method="qlora"))  # fmt: skip
    est = estimate(shape, spec)
    shard = est.device_breakdown["params"]
    assert shard < 0.3 * shape.num_params  # ~0.52 bytes per weight, halved
    # per rank one tensor in flight on the host, never the 16-bit base (2 x 141 GB)
    assert est.host_breakdown["initial_weights"] == 2 * 4 * shape.largest_tensor_params
    loading = est.phases["loading"] - model_states(spec, shape).base
    assert 0 < loading < 0.2 * GIB  # a chunk being quantised and one weight's block scales


def test_paged_8bit_moments_keep_only_the_two_largest_tensors_states_on_the_device():
    """paged_adamw_8bit: what one step touches at a time stays on the device (the embedding
    and the head, 8-bit, sharded like them); the rest of the 8-bit states is on the host."""
    shape = model_shape(load_config(PRESET_8B).model)

    def states(strategy: str, world: int, optimizer: str):
        spec = StepSpec(strategy, world, 1, 1024, "full", precision="bf16_pure",
                        finetune=Finetune(optimizer=optimizer))  # fmt: skip
        return model_states(spec, shape)

    embedding = shape.num_embedding_params  # 128256 x 4096, and the untied head the same
    for strategy, world in (("single", 1), ("fsdp", 4)):
        eight = states(strategy, world, "adamw_8bit")
        paged = states(strategy, world, "paged_adamw_8bit")
        working = paged.on_device["optimizer"]
        assert working == pytest.approx(2 * 2.03 * embedding / world, rel=0.01)
        moved = eight.on_device["optimizer"] - working
        assert paged.on_host["optimizer"] == moved and eight.base - paged.base == moved
    # fsdp_offload steps on the host already: nothing to page
    offload = states("fsdp_offload", 4, "paged_adamw_8bit")
    assert offload == states("fsdp_offload", 4, "adamw_8bit")


def test_8b_full_in_bf16_pure_with_paged_8bit_adamw_fits_one_24gib_card_on_single(capsys):
    """What torchtune runs on a 24 GB card (bf16 weights, paged 8-bit AdamW, the step in
    backward): on `single`, which 8-bit states held on the device would not fit."""
    job = [PRESET_8B, *_gpus(1, "24GiB", "64GiB"), "data.seq_len=2048",
           "train.global_batch_size=2", "precision=bf16_pure", "train.grad_clip=0",
           "train.optimizer_in_backward=true", "strategy=single"]  # fmt: skip
    rc, plan, err = _plan(capsys, *job, "train.optimizer=paged_adamw_8bit")
    assert rc == 0 and plan["strategy"] == "single", err
    assert plan["estimate"]["device"]["total_bytes"] <= 24 * GIB
    assert plan["estimate"]["host"]["breakdown"]["optimizer"] > 13 * GIB
    rc, plan, err = _plan(capsys, *job, "train.optimizer=adamw_8bit")
    assert rc == 0 and plan["estimate"]["device"]["total_bytes"] > 24 * GIB, err

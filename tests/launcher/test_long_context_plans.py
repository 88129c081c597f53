"""ALST's setups in the plan (docs/long-context.md): the attention implementation as a planner
lever, offloaded checkpoints costed by their pinned host memory and PCIe time, and how long
memory alone would let a sequence be (`max_seq_len_memory`). Pure planning."""

from __future__ import annotations

import json

import pytest

from launcher.cli import main
from launcher.estimate.analytic_activations import pinned_bytes
from launcher.plan.hardware import Hardware
from launcher.plan.job import resolve_plan
from launcher.plan.planner import make_plan
from trainer.core.config import load_config
from trainer.core.units import GIB

PRESET_8B = "configs/models/llama-3.1-8b.yaml"
ONE_80 = ["hardware.device=cuda", "hardware.devices_per_node=1", "hardware.device_memory=80GiB"]
EIGHT_80 = [*ONE_80[:1], "hardware.devices_per_node=8", "hardware.device_memory=80GiB"]
DEFAULT_128K = ["data.seq_len=131072", "train.global_batch_size=8", "hardware.host_memory=1TiB"]


def _yarn(factor: float) -> str:
    return (f"model.rope_scaling={{rope_type: yarn, factor: {factor}, "
            "original_max_position_embeddings: 131072}")  # fmt: skip


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)


def _plan(capsys, *args: str) -> tuple[dict, str]:
    """(plan --json, the text plan) of the same command."""
    assert main(["plan", PRESET_8B, *args, "--json"]) == 0, capsys.readouterr().err
    plan = json.loads(capsys.readouterr().out)
    assert main(["plan", PRESET_8B, *args]) == 0
    return plan, capsys.readouterr().out


def test_the_default_128k_job_on_one_80gib_gpu_plans_without_the_dense_mask(capsys, tmp_path):
    """It exited 3: sdpa's dense mask of the packed documents (16 GiB of booleans, 32 GiB of
    bias while a layer computes) is more than any rung has left; `auto` attention takes
    flex_attention's block mask instead and says what sdpa would have held."""
    plan, text = _plan(capsys, *ONE_80, *DEFAULT_128K)
    assert plan["attn_implementation"] == "flex_attention"
    assert plan["estimate"]["fits"] and plan["estimate"]["device"]["total_bytes"] <= 72 * GIB
    assert any(r.startswith("attention flex_attention: a block mask of 16.0 MiB keeps the "
                            "packed documents apart, where sdpa builds a dense mask of 48.0 GiB")
               for r in plan["reasons"])  # fmt: skip
    assert ", attention flex_attention" in text.splitlines()[0]
    cfg = load_config(PRESET_8B, [*ONE_80, *DEFAULT_128K, f"run.dir={tmp_path}"])
    assert resolve_plan(cfg)[0].model.attn_implementation == "flex_attention"
    # configured sdpa is kept, and where it does not fit (76 GiB; on 80 it just fits with the
    # tiled MLP) the exit-3 line names the implementation that would
    one_76 = [*ONE_80[:2], "hardware.device_memory=76GiB"]
    assert main(["plan", PRESET_8B, *one_76, *DEFAULT_128K, "model.attn_implementation=sdpa"]) == 3
    assert "model.attn_implementation=flash_attention_2 would fit" in capsys.readouterr().err


def test_short_windows_and_cpu_ranks_keep_sdpa():
    for seq, device in ((4096, "cuda"), (2048, "cpu")):
        cfg = load_config(PRESET_8B, [f"data.seq_len={seq}", f"hardware.device={device}"])
        hw = Hardware(device, 1, 8, 80 * GIB, 1024 * GIB, device, None)
        assert make_plan(cfg, hw).attention == "sdpa"


def test_offloaded_checkpoints_hold_only_the_layer_inputs_and_pinned_memory_is_counted():
    """On a 72 GiB H100 at 128k the plan checkpoints every layer and offloads only its input
    (1 GiB a layer: ALST's offloaded checkpoints); the copies of everything a layer saves would
    not hide behind forward. The host memory counted is the pinned blocks the copies get: each
    rounded up to a power of two by torch's caching host allocator. (On 80 GiB the inputs stay
    on the device: FSDP2 frees the embedding and the head outside their own passes.)"""
    cfg = load_config(PRESET_8B, DEFAULT_128K)
    plan = make_plan(cfg, Hardware("cuda", 1, 1, 72 * GIB, 1024 * GIB, "H100", 989e12))
    assert (plan.activation_checkpointing, plan.levers.offload_activations) == ("full", True)
    assert plan.estimate.offloaded_bytes == 32 * GIB  # 32 layers x [131072, 4096] bf16
    assert plan.estimate.host_breakdown["offloaded_activations"] == 32 * GIB
    assert pinned_bytes(3 * GIB + 1) == 4 * GIB and pinned_bytes(GIB) == GIB


def test_everything_offloaded_is_refused_where_its_pinned_blocks_do_not_fit_the_host():
    """The same job forced to checkpoint nothing: 784.5 GiB of saved tensors per micro-batch,
    whose pinned blocks (the MLP's 3.5 GiB tensors in 4 GiB ones) are more than 1 TiB less
    the headroom can hold; on 2 TiB it plans."""
    forced = ["memory.activation_checkpointing=none", "memory.offload_activations=true",
              "memory.tiled_mlp=false"]  # fmt: skip
    none = load_config(PRESET_8B, [*DEFAULT_128K, *forced])
    tight = Hardware("cuda", 1, 1, 80 * GIB, 1024 * GIB, "cuda", None)
    with pytest.raises(Exception, match="does not fit"):
        make_plan(none, tight)
    roomy = make_plan(none, Hardware("cuda", 1, 1, 80 * GIB, 2048 * GIB, "cuda", None))
    pinned = roomy.estimate.host_breakdown["offloaded_activations"]
    assert roomy.estimate.offloaded_bytes == pytest.approx(784.5 * GIB, rel=1e-3)
    assert pinned == pytest.approx(848.5 * GIB, rel=1e-3)


def test_max_seq_len_memory_says_how_far_memory_alone_goes_beyond_the_positions(capsys):
    """ALST's node (8 x 80 GiB, 2 TiB host) at the model's own 131,072 tokens; with 1 TiB the
    pinned copies of the layer inputs are what stops it (2,097,152: 2 GiB per layer and rank,
    and beyond it 4 GiB blocks)."""
    plan, text = _plan(capsys, *EIGHT_80, *DEFAULT_128K, "hardware.host_memory=2TiB")
    assert plan["max_seq_len"] == 131072  # the model's positions
    assert plan["max_seq_len_memory"] >= 3_000_000
    assert f"longest sequence memory alone allows here: {plan['max_seq_len_memory']:,}" in text
    assert "model.rope_scaling extends them" in text


def test_alst_lengths_plan_with_rope_scaling(capsys):
    """ALST's 1-GPU length with yarn over Llama-3.1's 131,072 positions: it plans, and fits."""
    plan, _ = _plan(capsys, *ONE_80, "data.seq_len=524288", "train.global_batch_size=1",
                    "hardware.host_memory=2TiB", _yarn(4.0))  # fmt: skip
    assert plan["estimate"]["fits"] and plan["max_seq_len"] == 524288
    assert (plan["activation_checkpointing"], plan["offload_activations"]) == ("full", True)


def test_alst_8_gpu_length_plans_with_rope_scaling(capsys):
    """ALST's 3.7M tokens on one node of 8 x 80 GiB, yarn x 32: every rank holds 462,500 tokens
    of the sequence."""
    plan, _ = _plan(capsys, *EIGHT_80, "data.seq_len=3700000", "train.global_batch_size=1",
                    "sequence_parallel=8", "hardware.host_memory=2TiB",
                    "model.attn_implementation=flash_attention_2", _yarn(32.0))  # fmt: skip
    assert plan["estimate"]["fits"] and plan["max_seq_len"] >= 3_700_000
    assert (plan["sequence_parallel"], plan["activation_checkpointing"]) == (8, "full")


# ALST's setups (Llama-3.1-8B full fine-tune, bf16, one sequence, 2 TiB host a node, flash
# attention): the GPUs, the nodes and the length ALST measured (arXiv 2506.13996)
ALST = ((1, 1, 500_000), (8, 1, 3_700_000), (32, 4, 15_000_000))


@pytest.mark.parametrize("gpus, nodes, alst", ALST)
def test_the_longest_lengths_of_alst_setups_reach_alst(capsys, gpus, nodes, alst):
    per_node = gpus // nodes
    split = [f"sequence_parallel={gpus}"] if gpus > 1 else []
    plan, text = _plan(capsys, *EIGHT_80, f"hardware.devices_per_node={per_node}",
                       f"hardware.nodes={nodes}", "data.seq_len=131072",
                       "train.global_batch_size=1", "hardware.host_memory=2TiB",
                       "model.attn_implementation=flash_attention_2", *split)  # fmt: skip
    assert plan["max_seq_len_memory"] >= alst, plan["max_seq_len_memory"]

"""Expert parallel in the planner (launcher/plan/splits.py, launcher/plan/planner.py) and the
estimate (launcher/estimate/expert_split.py): the degree weighed from defaults for Qwen3-30B-A3B,
Qwen3-235B-A22B and gpt-oss-120b, each with its reason; a dense model never split; what one rank
of an expert group gathers and the routing's worst case it is bounded at, against a traced split
rank; `oomless estimate` with a forced degree printing that split rank. Pure planning through the
command line (the MoE layers' activations traced once, cached) and fake-tensor traces: no GPU, no
launch.

On one node of 8 x 80 GiB FSDP's gathers of the experts run at NVLink bandwidth and hide behind
compute, while the split's dispatch and combine all-to-alls (tokens x top-k rows of the hidden
size per MoE layer and pass) are on the critical path, and the worst-case routing bound takes
memory a larger micro-batch would have used. What a split buys there is taller expert matmuls:
gpt-oss-120b (top-4 of 128 experts, 2,048 tokens) gives each expert 512 rows a micro-batch
unsplit, 2,048 split 4 or 8 ways, and is split; the two Qwen3 jobs run micro-batches whose
experts already get 1,024-2,048 rows unsplit and stay unsplit, as measured on one node
(docs/parallel.md). Over two nodes FSDP's gathers cross the network and gpt-oss-120b is split."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import yaml

from launcher.cli import main
from launcher.estimate.activations import with_activations
from launcher.estimate.expert_split import expert_rank_shape, received_rows_per_token, row_bytes
from launcher.estimate.layer_fits import Fit, LayerActivations
from launcher.estimate.peak import estimate
from launcher.estimate.shape import model_shape, shape_of
from launcher.plan.hardware import detect_hardware
from launcher.plan.ladder import job_step
from tests.launcher.test_lowbit_plans import PRESET_8B, _gpus
from trainer.core import strategies
from trainer.core.config import load_config
from trainer.core.expert_plan import expert_plan

pytestmark = pytest.mark.skipif(
    not (expert_plan("qwen3_moe") and expert_plan("gpt_oss")),
    reason="the installed transformers declares no base_model_ep_plan for qwen3_moe and gpt_oss",
)

# The published configs' dimensions (config.json of each hub repository)
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True,
}  # fmt: skip
QWEN3_235B_A22B = {
    **QWEN3_30B_A3B, "hidden_size": 4096, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
}  # fmt: skip
GPT_OSS_120B = {
    "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
    "num_experts_per_tok": 4, "experts_per_token": 4, "vocab_size": 201088,
    "max_position_embeddings": 131072, "sliding_window": 128, "rope_theta": 150000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": True,
    "swiglu_limit": 7.0,
}  # fmt: skip
JOBS = {  # name: (config, seq_len, method)
    "qwen3-30b-a3b-full": (QWEN3_30B_A3B, 4096, "full"),
    "qwen3-235b-a22b-lora": (QWEN3_235B_A22B, 4096, "lora"),
    "gpt-oss-120b-lora": (GPT_OSS_120B, 2048, "lora"),
}

# Split on one node of 8 x 80 GiB: only where the unsplit micro-batch leaves its experts short
# matmuls (the module's doc)
SPLIT_ON_ONE_NODE = {"qwen3-30b-a3b-full": False, "qwen3-235b-a22b-lora": False,
                     "gpt-oss-120b-lora": True}  # fmt: skip


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)


def _job(tmp_path, name: str) -> str:
    config, seq_len, method = JOBS[name]
    job = tmp_path / f"{name}.yaml"
    job.write_text(yaml.safe_dump({
        "model": {"config": config},
        "data": {"path": "HuggingFaceH4/no_robots", "format": "chat", "seq_len": seq_len},
        "finetune": {"method": method},
    }))  # fmt: skip
    return str(job)


def _json_plan(capsys, *args: str) -> dict:
    try:
        rc = main(["plan", *args, "--json"])
    except SystemExit as stop:
        rc = stop.code
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def _degrees(plan: dict) -> tuple[str, dict[int, float]]:
    """The reason line that weighs the expert degrees, and each fitting degree's step time."""
    (line,) = [r for r in plan["reasons"] if "by expert degree" in r]
    times = re.search(r"by expert degree (.*?) \(", line).group(1)
    return line, {int(d): float(t) for d, t in re.findall(r"(\d+): ([\d.]+) s", times)}


def _chosen(times: dict[int, float]) -> int:
    """The degree the planner must keep: a split only where faster than unsplit by 10%."""
    split = min((ep for ep in times if ep > 1), key=times.get)
    return split if times[split] < 0.9 * times[1] else 1


@pytest.mark.parametrize("name", list(JOBS))
def test_one_node_weighs_every_degree_and_keeps_the_fastest_by_the_margin(capsys, tmp_path, name):
    plan = _json_plan(capsys, _job(tmp_path, name), *_gpus(8, "80GiB", "2TiB"))
    line, times = _degrees(plan)
    assert sorted(times) == [1, 2, 4, 8], line  # each divides the 128 experts and the 8 ranks
    assert "150 GB/s intra-node" in line and "10% faster" in line
    assert plan["parallel"]["expert"] == _chosen(times)
    assert (plan["parallel"]["expert"] > 1) == SPLIT_ON_ONE_NODE[name], line


def test_two_nodes_split_gpt_oss_120b_where_fsdp_gathers_cross_the_network(capsys, tmp_path):
    hw = [*_gpus(8, "80GiB", "2TiB"), "hardware.nodes=2"]
    plan = _json_plan(capsys, _job(tmp_path, "gpt-oss-120b-lora"), *hw)
    line, times = _degrees(plan)
    ep = plan["parallel"]["expert"]
    assert ep > 1 and ep == _chosen(times), line
    assert plan["strategy"] in ("fsdp", "fsdp_offload")
    assert plan["parallel"]["tensor"] == 1 and plan["parallel"]["data"] == 16
    assert "20 GB/s inter-node" in line and f"{ep}: 150 GB/s" in line
    (bound,) = [r for r in plan["reasons"] if "routing's worst" in r]
    assert f"{4 * ep} per token held" in bound  # ep ranks x min(top-4, 128 / ep)


def test_a_dense_model_is_never_split(capsys):
    plan = _json_plan(capsys, PRESET_8B, *_gpus(8, "80GiB", "1TiB"))
    assert plan["parallel"]["expert"] == 1
    assert not [r for r in plan["reasons"] if "expert" in r]


TINY_MOE = {
    "model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
    "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2,
    "max_position_embeddings": 256, "tie_word_embeddings": False,
}  # fmt: skip


def test_a_split_rank_gathers_its_own_experts_and_is_bounded_at_the_worst_routing():
    shape = shape_of(json.dumps(TINY_MOE, sort_keys=True))
    experts = 3 * 32 * 16 * 8  # gate, up, down of 8 experts a layer
    assert shape.num_routed_params == 2 * experts
    split = replace(shape, expert_parallel=2)
    assert shape.gathered_layer_params - split.gathered_layer_params == experts // 2
    # 2 ranks x min(top-2, 4 experts a rank) rows per token at worst, 2 on average
    assert received_rows_per_token(split) == 4 and received_rows_per_token(split, False) == 2
    assert received_rows_per_token(replace(shape, expert_parallel=8)) == 8  # min(2, 1) x 8
    fit = Fit(100.0, 1000.0, 0.0)
    acts = LayerActivations("traced", {"autocast": fit}, 128)
    raised = expert_rank_shape(replace(split, activations=acts), 2).activations
    row = 2 * (32 + 4 * 16)  # the row; gate and up, the activation and the product
    assert raised.fits["autocast"].per_token == 1000.0 + 2 * row
    assert expert_rank_shape(replace(shape, activations=acts), 2).activations is acts


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_the_estimate_of_a_split_rank_is_within_3_percent_of_its_trace(monkeypatch, tmp_path,
                                                                        model_type):  # fmt: skip
    """ep 2 on fsdp over 2 ranks, routed at the estimate's worst case by the trace's stand-in
    for transformers' dispatch (launcher/estimate/expert_trace.py), two micro-batch sizes."""
    from bench.models_trace import SEQ_LEN, measured_shape, sized_config
    from launcher.estimate.trace import trace_step
    from trainer.core.step_spec import StepSpec

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    config = sized_config(model_type, "small")
    shape = replace(measured_shape(config), expert_parallel=2)
    for micro in (1, 4):
        common = {"strategy": "fsdp", "world_size": 2, "micro_batch_size": micro,
                  "seq_len": SEQ_LEN, "activation_checkpointing": "none"}  # fmt: skip
        traced = trace_step(config, StepSpec(**common), expert=2).peak_bytes
        unsplit = trace_step(config, StepSpec(**common)).peak_bytes
        assert traced > unsplit * 1.05  # the bound's extra rows are there
        est = estimate(shape, StepSpec(**common, devices_per_node=2, grad_accum=1))
        assert abs(est.peak_tensor_bytes - traced) / traced <= 0.03, (micro, est, traced)


def _tiny_job(tmp_path) -> str:
    job = tmp_path / "moe.yaml"
    job.write_text(yaml.safe_dump({
        "model": {"config": TINY_MOE},
        "data": {"path": "HuggingFaceH4/no_robots", "format": "chat", "seq_len": 128},
        "train": {"global_batch_size": 8, "micro_batch_size": 4},
        "memory": {"activation_checkpointing": "none"},
    }))  # fmt: skip
    return str(job)


CPU_FSDP = ("hardware.device=cpu", "hardware.devices_per_node=2", "strategy=fsdp")


def test_estimate_with_a_forced_degree_estimates_the_split_rank(capsys, tmp_path):
    """`oomless estimate parallel.expert=2` prints one rank of the split and says the degree: the
    worst-case routing rows raise its activations and peak (the 24 KiB less of experts a rank
    gathers is not held at this step's peak); the number is the estimate of the split shape,
    computed here directly."""
    job = _tiny_job(tmp_path)
    args = [job, *CPU_FSDP]
    printed = {}
    for ep in (1, 2):
        assert main(["estimate", *args, f"parallel.expert={ep}", "--json"]) == 0
        printed[ep] = json.loads(capsys.readouterr().out)
    assert printed[1]["model"]["expert_parallel"] == 1
    assert printed[2]["model"]["expert_parallel"] == 2
    assert any(
        "expert parallel 2: a rank gathers its 4 of 8" in n for n in printed[2]["model"]["notes"]
    )
    (whole,), (split,) = printed[1]["strategies"], printed[2]["strategies"]
    # 2 layers x 4 x 128 tokens x 2 rows beyond top-2 (2 ranks x min(2, 4) = 4 at worst)
    cfg = load_config(job, [*CPU_FSDP, "parallel.expert=2"])
    shape = replace(with_activations(model_shape(cfg.model), cfg), expert_parallel=2)
    saved, _, _ = row_bytes(shape, 2)
    rows = 2 * 4 * 128 * (received_rows_per_token(shape) - 2)
    acts = split["device"]["breakdown"]["activations"] - whole["device"]["breakdown"]["activations"]
    assert acts == rows * saved == 2 * 4 * 128 * 2 * 2 * (32 + 4 * 16)
    assert split["device"]["peak_tensor_bytes"] - whole["device"]["peak_tensor_bytes"] == acts
    spec = job_step(cfg, detect_hardware(cfg.hardware), strategies.row("fsdp"), 4, "none")
    assert split["device"]["peak_tensor_bytes"] == estimate(shape, spec).peak_tensor_bytes
    assert main(["estimate", *args, "parallel.expert=2"]) == 0
    assert "bf16; expert parallel 2; 1 node(s) x 2 cpu" in capsys.readouterr().out


def test_the_emitters_carry_the_expert_degree(capsys, tmp_path):
    """accelerate's config has no key for it: the emitted file says so in a comment; the
    TrainJob's resolved config keeps it."""
    job = [_tiny_job(tmp_path), *CPU_FSDP, "parallel.expert=2"]
    assert main(["plan", *job, "--emit", "accelerate"]) == 0
    out = capsys.readouterr().out
    assert "# The plan splits each MoE layer's experts over 2 ranks (parallel.expert=2)." in out
    assert "oomless train CONFIG parallel.expert=2" in out
    assert yaml.safe_load(out)["distributed_type"] == "FSDP"
    assert main(["plan", *job[:-1], "parallel.expert=1", "--emit", "accelerate"]) == 0
    assert "#" not in capsys.readouterr().out
    assert main(["plan", *job, "k8s.image=r/i:1", "k8s.pvc=runs", "--emit", "trainjob"]) == 0
    config_map = next(yaml.safe_load_all(capsys.readouterr().out))
    assert yaml.safe_load(config_map["data"]["config.yaml"])["parallel"]["expert"] == 2

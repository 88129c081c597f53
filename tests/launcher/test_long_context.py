"""Long context in the plan: the sequence split over ranks (sequence_parallel), the MLP tiled,
and the longest sequence a plan fits (launcher/plan/long_context.py). Pure planning."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace

import pytest

from launcher.cli import main
from launcher.estimate.peak import estimate
from launcher.estimate.shape import model_shape, shape_of
from launcher.estimate.trace import trace_step
from launcher.plan.cost import Links, all_to_all_s
from launcher.plan.hardware import Hardware
from launcher.plan.job import resolve_plan
from launcher.plan.ladder import shortfall
from launcher.plan.long_context import max_seq_len
from launcher.plan.planner import NoFitError, make_plan
from tests.launcher.test_estimate_trace import hf_config
from trainer.core.config import ConfigError, build_config, load_config
from trainer.core.step_spec import StepSpec
from trainer.core.units import GIB

PRESET_8B = "configs/models/llama-3.1-8b.yaml"
LONG = ["data.seq_len=131072", "train.global_batch_size=8", "hardware.device=cuda"]
EIGHT_80 = ["hardware.devices_per_node=8", "hardware.device_memory=80GiB"]
# where one 131,072-token sequence under sdpa no longer fits one device (on 80 GiB it does, with
# the tiled MLP, since FSDP2 frees the embedding and the head outside their own passes)
EIGHT_76 = ["hardware.devices_per_node=8", "hardware.device_memory=76GiB"]
SDPA = "model.attn_implementation=sdpa"  # the dense mask of packed windows, as configured


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)


def _plan_json(capsys, *args: str) -> dict:
    rc = main(["plan", *args, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def _hw(devices: int, device_gib: int = 80, host_gib: int = 1024, nodes: int = 1) -> Hardware:
    return Hardware("cuda", nodes, devices, device_gib * GIB, host_gib * GIB, "test GPU", 989e12)


def _job(seq: int, **extra):
    tree = {
        "model": {"name_or_path": "meta-llama/Llama-3.1-8B"},
        "data": {"path": "some/dataset", "seq_len": seq},
        "train": {"global_batch_size": 8},
        "precision": "bf16",
    }
    return build_config(tree | extra)


def test_8b_at_131072_tokens_on_eight_76gib_gpus_splits_each_sequence(capsys):
    plan = _plan_json(capsys, PRESET_8B, *LONG, *EIGHT_76, "hardware.host_memory=1TiB", SDPA)
    sp = plan["sequence_parallel"]
    assert sp > 1 and 8 % sp == 0
    assert plan["estimate"]["device"]["total_bytes"] <= 0.9 * 76 * GIB
    # the global batch splits over 8 / sp data-parallel groups
    assert plan["micro_batch_size"] * plan["grad_accum"] * (8 // sp) == 8
    assert plan["max_seq_len"] >= 131072 and plan["max_seq_len"] % sp == 0
    assert any(r.startswith(f"sequence parallel {sp}: activations of one 131,072-token")
               for r in plan["reasons"])  # fmt: skip
    main(["plan", PRESET_8B, *LONG, *EIGHT_76, "hardware.host_memory=1TiB", SDPA])
    out = capsys.readouterr().out
    assert f"longest sequence that fits this plan: {plan['max_seq_len']:,} tokens" in out


def test_8b_lora_at_131072_tokens_fits_one_80gib_gpu(capsys):
    plan = _plan_json(capsys, PRESET_8B, *LONG, "finetune.method=lora", SDPA,
                      "hardware.devices_per_node=1", "hardware.device_memory=80GiB",
                      "hardware.host_memory=512GiB")  # fmt: skip
    assert plan["sequence_parallel"] == 1  # one device: nothing to split over
    assert plan["estimate"]["device"]["total_bytes"] <= 0.9 * 80 * GIB
    assert plan["activation_checkpointing"] == "full" and plan["chunked_loss"]
    assert plan["max_seq_len"] >= 131072


def test_a_short_job_is_planned_without_a_split():
    plan = make_plan(_job(4096), _hw(8))
    assert (plan.long.sequence_parallel, plan.long.tiled_mlp) == (1, False)
    assert plan.max_seq_len > 4096


def test_a_batch_only_a_sequence_split_shares_is_refused_naming_the_split_that_plans():
    """1,000 sequences on 8,000 GPUs: the fix names the splits whose data groups share them
    beside the multiples of 8,000 (it named only those), and the job with the first plans."""
    job = _job(65536, train={"global_batch_size": 1000})
    hw = _hw(8, host_gib=2048, nodes=1000)
    with pytest.raises(ConfigError) as err:
        make_plan(job, hw)
    assert str(err.value).endswith(
        "use a multiple of 8000 (e.g. 8000, 16000), or split each sequence over ranks: "
        "sequence_parallel=8 or 16 or 32"
    ), err.value
    plan = make_plan(job.model_copy(update={"sequence_parallel": 8}), hw)
    assert plan.long.sequence_parallel == 8
    data_ranks = 8000 // (8 * plan.long.tensor_parallel)  # a sequence or tensor group reads one
    assert plan.micro_batch_size * plan.grad_accum * data_ranks == 1000


def test_the_resolved_config_runs_what_was_planned_and_a_forced_split_is_kept(tmp_path):
    cfg = load_config(PRESET_8B, [*LONG, *EIGHT_76, "hardware.host_memory=1TiB", SDPA,
                                  f"run.dir={tmp_path}"])  # fmt: skip
    resolved, plan = resolve_plan(cfg)
    assert resolved.sequence_parallel == plan["sequence_parallel"] > 1
    assert resolved.memory.tiled_mlp is plan["tiled_mlp"]
    forced = cfg.model_copy(update={"sequence_parallel": 8})
    resolved, plan = resolve_plan(forced)
    assert resolved.sequence_parallel == plan["sequence_parallel"] == 8
    assert plan["micro_batch_size"] * plan["grad_accum"] == 8  # one data-parallel group


def test_parallel_sequence_plans_what_its_old_name_sequence_parallel_plans(capsys, tmp_path):
    """`parallel.sequence=2` and `sequence_parallel=2` are one key: the same plan, the degree of
    each dimension beside the old key in the JSON, both in the resolved config every rank runs."""
    job = (PRESET_8B, *LONG, *EIGHT_76, "hardware.host_memory=1TiB", SDPA)
    new = _plan_json(capsys, *job, "parallel.sequence=2")
    assert new == _plan_json(capsys, *job, "sequence_parallel=2")
    assert new["parallel"] == {"data": 4, "sequence": 2, "tensor": 1, "expert": 1}
    assert new["sequence_parallel"] == 2
    cfg = load_config(PRESET_8B, [*job[1:], "parallel.sequence=2", f"run.dir={tmp_path}"])
    resolved, _ = resolve_plan(cfg)
    assert resolved.parallel.sequence == resolved.sequence_parallel == 2


def test_sequence_parallel_divides_the_activations_per_rank_but_not_the_model_states():
    shape = model_shape(_job(32768).model)
    base = StepSpec("fsdp", 8, 1, 32768, "none", packed=False)
    one, four = estimate(shape, base), estimate(shape, replace(base, sequence_parallel=4))
    acts = one.device_breakdown["activations"], four.device_breakdown["activations"]
    assert acts[1] == pytest.approx(acts[0] / 4, rel=0.02)
    for part in ("params", "grads", "optimizer"):
        assert one.device_breakdown[part] == four.device_breakdown[part]
    # a packed window's block-causal mask is the whole sequence's on every rank
    packed = replace(base, packed=True, sequence_parallel=4)
    mask_phase = estimate(shape, packed).peak_tensor_bytes - four.peak_tensor_bytes
    assert mask_phase >= 32768**2  # the boolean mask alone


def test_tiled_mlp_drops_the_mlp_intermediates():
    shape = model_shape(_job(32768).model)
    plain = StepSpec("fsdp", 8, 1, 32768, "none")
    tiled = estimate(shape, replace(plain, tiled_mlp=True)).device_breakdown["activations"]
    mlp = 4 * 2 * 32768 * shape.intermediate_size * shape.num_layers  # gate, silu, up, product
    # and 4 bytes per token and hidden unit for each recomputed norm: 2 a layer and the final
    norms = 4 * 32768 * shape.hidden_size * (2 * shape.num_layers + 1)
    drop = estimate(shape, plain).device_breakdown["activations"] - tiled
    assert drop == pytest.approx(mlp + norms, rel=0.15)


def test_the_longest_sequence_fits_and_one_more_slice_does_not():
    shape, hw = model_shape(_job(8192).model), _hw(8)
    spec = StepSpec("fsdp", 8, 1, 8192, "full", chunked_loss=True, sequence_parallel=4)
    longest = max_seq_len(shape, spec, hw, 0.1, 1.0)
    assert longest > 8192 and longest % 4 == 0
    assert longest == max_seq_len(shape, replace(spec, seq_len=longest // 8 * 4), hw, 0.1, 1.0)
    assert shortfall(estimate(shape, replace(spec, seq_len=longest)), hw, 0.1) is None
    assert shortfall(estimate(shape, replace(spec, seq_len=longest + 4)), hw, 0.1) is not None


def test_all_to_alls_cost_more_across_nodes_than_within_one():
    shape = model_shape(_job(131072).model)
    links = Links(150e9, 20e9, 12e9, 3e9, 80e9)
    spec = StepSpec("fsdp", 16, 1, 131072, "full", devices_per_node=8, sequence_parallel=8)
    within = all_to_all_s(shape, spec, links)
    across = all_to_all_s(shape, replace(spec, sequence_parallel=16), links)
    assert all_to_all_s(shape, replace(spec, sequence_parallel=1), links) == 0
    # 8 ranks of a node: (7/8) x 2 bytes x 16,384 tokens x (2 x 4,096 + 2 x 8 x 128) x 32 layers
    # x 3 passes (forward, recompute, backward)
    per_layer = 2 * 16384 * (2 * 4096 + 2 * 8 * 128)
    assert within == pytest.approx(7 / 8 * per_layer * 32 * 3 / 150e9)
    assert across > 3 * within


# one rank of a sequence group traced (launcher/estimate/trace.py: a fake process group, the
# engine's Ulysses all-to-alls and tiled MLP under FakeTensorMode) against the estimate
SPLIT_TRACES = (
    ("single", 2, "none", False),
    ("single", 4, "full", True),
    ("fsdp", 2, "full", False),
    ("fsdp", 4, "none", True),
)


def _split_error(arch: str, strategy: str, sp: int, ckpt: str, tiled: bool) -> float:
    config = hf_config(arch, "medium")
    world = 4 if strategy == "fsdp" else sp
    spec = StepSpec(strategy, world, 1, 2048, ckpt, devices_per_node=world, sequence_parallel=sp,
                    tiled_mlp=tiled, mlp_chunk_tokens=256 if tiled else None)  # fmt: skip
    traced = trace_step(config, spec).peak_bytes
    analytic = estimate(shape_of(json.dumps(config, sort_keys=True)), spec).peak_tensor_bytes
    return (analytic - traced) / traced


def test_the_estimate_of_one_rank_of_a_sequence_group_follows_the_trace():
    errors = [
        abs(_split_error(arch, *case)) for arch in ("llama", "qwen2") for case in SPLIT_TRACES
    ]
    assert statistics.median(errors) <= 0.02 and max(errors) <= 0.05, errors


@pytest.mark.slow  # one torchrun launch of 2 CPU ranks, 3 steps
def test_a_sequence_split_the_planner_chooses_is_what_the_ranks_run(tmp_path):
    """The demo on 2 CPU ranks with device memory between what a step needs with each sequence
    whole and split in two: the plan splits it, the resolved config says so, the engine runs
    it (its start line) and trains."""
    from tests.conftest import REPO, oomless

    forced = ["strategy=ddp", "train.micro_batch_size=1", "memory.activation_checkpointing=none",
              "memory.chunked_loss=false", "memory.tiled_mlp=false", "hardware.device=cpu",
              "hardware.devices_per_node=2"]  # fmt: skip
    cfg = load_config(REPO / "configs" / "demo.yaml", forced)
    whole, split = (
        estimate(model_shape(cfg.model),
                 StepSpec("ddp", 2, 1, 64, "none", grad_accum=8 * sp, device="cpu",
                          sequence_parallel=sp)).device_total_bytes
        for sp in (1, 2)
    )  # fmt: skip
    assert split < whole
    memory = int((whole + split) / 2 / 0.9)
    r = oomless("train", str(REPO / "configs" / "demo.yaml"), *forced, "train.steps=3",
                f"hardware.device_memory={memory}", f"run.dir={tmp_path}", timeout=400)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["sequence_parallel"] == 2 and plan["max_seq_len"] >= 64
    assert "sequence_parallel: 2" in (tmp_path / "config.yaml").read_text()
    assert "sequence parallel 2 (a sequence over 2 ranks)" in r.stdout + r.stderr
    losses = [json.loads(line).get("loss") for line in (tmp_path / "metrics.jsonl").open()]
    assert any(loss is not None and loss > 0 for loss in losses)


YARN_32 = {"name_or_path": "meta-llama/Llama-3.1-8B",
           "rope_scaling": {"rope_type": "yarn", "factor": 32.0}}  # fmt: skip


def test_a_sequence_that_fits_only_split_is_split_before_the_batch_is_judged():
    """One 2M-token sequence on 8 GPUs: the batch of 1 splits over no data ranks, but the
    sequence needs splitting to fit anyway, so the planner splits it (it was exit 2 on the
    batch). A sequence that fits whole still leaves sharing the batch to the user."""
    job = _job(2097152, model=YARN_32, train={"global_batch_size": 1})
    plan = make_plan(job, _hw(8))
    assert plan.long.sequence_parallel == 8
    assert plan.micro_batch_size * plan.grad_accum == 1
    with pytest.raises(ConfigError, match="or split each sequence over ranks: sequence_parallel"):
        make_plan(_job(4096, train={"global_batch_size": 1}), _hw(8))


def test_the_longest_sequence_memory_allows_is_the_longest_that_plans():
    """`max_seq_len_memory` at 128k is a length that plans on the same hardware, and one
    group's slice more does not; the exit 3 beyond it names the same limit (it named 262,144,
    from an unsplit sequence)."""
    hw = _hw(8)
    longest = make_plan(_job(131072, model=YARN_32), hw).max_seq_len_memory
    assert longest > 131072
    plan = make_plan(_job(longest, model=YARN_32), hw)
    sp = plan.long.sequence_parallel
    with pytest.raises(NoFitError) as err:
        make_plan(_job(longest + sp, model=YARN_32), hw)
    offered = int(str(err.value).split("data.seq_len=")[1].split()[0])
    assert longest - 1024 < offered <= longest
    make_plan(_job(offered, model=YARN_32), hw)  # the offer plans

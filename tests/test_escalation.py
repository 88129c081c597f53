"""Escalation: a persistent OOM on two CPU processes makes `oomless train` climb rungs, resume
from the checkpoint, and end where an uninterrupted run ends.

One launch covers both hops: the planner's first rung here is `ddp`, its next `fsdp`; a
persistent OOM under `fsdp` then climbs to the next rung whose estimated peak is not above
fsdp's (`fsdp_offload`: zero1, zero2 and zero3 are estimated higher, so they are passed over),
which resumes from the checkpoint and completes."""

from __future__ import annotations

import json

import pytest

from launcher.estimate.activations import with_activations
from launcher.estimate.peak import Estimate, estimate
from launcher.estimate.shape import model_shape
from launcher.plan.hardware import detect_hardware
from launcher.plan.headroom import plan_headroom
from launcher.plan.ladder import job_step
from tests.cli_worker import IN_THIS_PROCESS
from tests.conftest import live_children, oomless, train_in_one_process
from tests.test_cli_train import DEMO, metrics
from trainer.core import strategies
from trainer.core.config import load_config

pytestmark = pytest.mark.slow
COMMON = [
    "hardware.device=cpu",
    "hardware.devices_per_node=2",
    "train.steps=8",
    "train.eval_every=0",
    "precision=fp32",
    "run.save_final=false",
    "run.checkpoint_every=2",
]


def test_persistent_oom_climbs_the_ladder_and_learns_the_same(tmp_path):
    before = {p.pid for p in live_children()}
    run_dir, ref_dir = tmp_path / "escalated", tmp_path / "reference"
    r = oomless(
        "train",
        str(DEMO),
        *COMMON,
        f"run.dir={run_dir}",
        # every attempt at step 4 fails on ddp and on fsdp, whatever the micro-batch
        "debug.inject_oom={step: 4, times: 0, where: forward, strategies: [ddp, fsdp]}",
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "escalating ddp -> fsdp" in r.stderr and "escalating fsdp -> fsdp_offload" in r.stderr
    # torchrun's report of the failed workers is kept in the run dir, not printed
    assert "ChildFailedError" not in r.stderr and "Root Cause" not in r.stderr
    assert (run_dir / "torchrun.log").read_text().count("Root Cause (first observed failure)") == 2
    escalations = [json.loads(x) for x in (run_dir / "escalations.jsonl").read_text().splitlines()]
    assert [(e["from"], e["to"], e["step"]) for e in escalations] == [
        ("ddp", "fsdp", 4),
        ("fsdp", "fsdp_offload", 4),
    ]
    for e in escalations:
        assert e["reason"].startswith("out of memory in forward")
        assert e["estimated_peak_bytes"] > 0 and e["measured_peak_bytes"] > 0
    # both higher rungs resumed from the newest checkpoint (step 2; the OOM comes at step 4)
    resumed = f"resumed from {run_dir / 'checkpoints' / 'step_2'} (step 2"
    assert r.stderr.count(resumed) == 2, r.stderr[-4000:]  # fsdp, then fsdp_offload (rank 0 logs)
    lines = metrics(run_dir)
    assert [m["step"] for m in lines] == list(range(1, 9))
    # metrics.jsonl keeps the lines up to the resumed step: the fsdp attempt's step 3 is gone
    assert [m["strategy"] for m in lines] == ["ddp"] * 2 + ["fsdp_offload"] * 6
    assert lines[-1]["strategy"] == "fsdp_offload"
    assert json.loads((run_dir / "plan.json").read_text())["strategy"] == "fsdp_offload"

    # the uninterrupted run on one process, in the session's one (tests/cli_worker.py): the
    # rungs learn what one process learns (tests/trainer/test_distributed.py)
    one_process = ["strategy=single", "hardware.devices_per_node=1", f"run.dir={ref_dir}"]
    train_in_one_process([([str(DEMO), *COMMON, *one_process], ref_dir / "stderr.txt")])
    reference = metrics(ref_dir)
    assert abs(lines[-1]["loss"] - reference[-1]["loss"]) <= 1e-4 * reference[-1]["loss"]
    left = {p.pid for p in live_children()} - before
    assert not left, f"processes left behind: {left}"


def test_escalation_disabled_stops_with_75(tmp_path):
    r = oomless(
        "train",
        str(DEMO),
        *COMMON,
        f"run.dir={tmp_path / 'run'}",
        "escalation.enabled=false",
        "debug.inject_oom={step: 2, times: 0, where: optimizer, strategies: [ddp]}",
        timeout=600,
    )
    assert r.returncode == 75, r.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "oom-report.json").read_text())
    assert report["strategy"] == "ddp" and report["phase"] == "optimizer"
    assert report["ranks"] == [0, 1] and report["micro_batch_size"] == 1


def test_8bit_moments_survive_an_escalation_from_a_replica_to_shards(tmp_path):
    """adamw_8bit on `single` quantises the demo's 128-wide matrices in blocks that run across
    rows; the fsdp_offload rung it escalates to keeps fp32 moments for them. The checkpoint it
    resumes holds them as fp32 moments, so the run ends where an uninterrupted one ends (the
    codes loaded as moments ended at loss 7.16 against 2.49)."""
    job = [
        "hardware.device=cpu", "precision=fp32", "train.eval_every=0",
        "train.global_batch_size=4", "train.warmup_steps=0", "run.save_final=false",
        "train.optimizer=adamw_8bit", "train.steps=4", "run.checkpoint_every=2",
        "strategy=single",
    ]  # fmt: skip
    run_dir, ref_dir = tmp_path / "escalated", tmp_path / "reference"
    r = oomless(
        "train", str(DEMO), *job, f"run.dir={run_dir}",
        "debug.inject_oom={step: 3, where: backward, strategies: [single], times: 20}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "escalating single -> fsdp_offload" in r.stderr, r.stderr[-3000:]
    # the reference: its engine in the session's one process (the escalated run's is a child)
    train_in_one_process([([str(DEMO), *job, f"run.dir={ref_dir}"], ref_dir / "stderr.txt")])
    got, want = metrics(run_dir), metrics(ref_dir)
    assert [m["strategy"] for m in got] == ["single"] * 2 + ["fsdp_offload"] * 2
    for a, b in zip(got[2:], want[2:], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 0.02 * b["loss"], (got, want)


STREAM_JOB = [
    "hardware.device=cpu", "hardware.devices_per_node=1", "data.seq_len=32",
    "model.config={model_type: llama, vocab_size: 45, hidden_size: 256, intermediate_size: 1024, "
    "num_hidden_layers: 4, num_attention_heads: 4, num_key_value_heads: 2, "
    "max_position_embeddings: 128, tie_word_embeddings: true}",
    "train.global_batch_size=4", "train.micro_batch_size=2", "precision=bf16",
    "memory.activation_checkpointing=full",
]  # fmt: skip


def _between_stream_and_fsdp_offload() -> int:
    """Device bytes at which `stream`'s estimate fits and `fsdp_offload`'s smallest (reducing
    after every micro-batch) does not, with the planner's headroom: 4M parameters in 4 layers,
    of which `stream` holds the two in its buffers and two layers' gradients on their way out,
    `fsdp_offload` a layer's fp32 shard copied in, its 16-bit gather and gradients, and the next
    layer's prefetched."""
    cfg = load_config(DEMO, STREAM_JOB)
    hw = detect_hardware(cfg.hardware)
    shape = with_activations(model_shape(cfg.model), cfg)

    def device_bytes(rung: str, every: bool | None = None) -> Estimate:
        spec = job_step(cfg, hw, strategies.row(rung), 2, "full", reduce_every_micro=every)
        return estimate(shape, spec)

    stream, offload = device_bytes("stream"), device_bytes("fsdp_offload", every=True)
    assert stream.device_total_bytes < offload.device_total_bytes, (stream, offload)
    middle = (stream.device_total_bytes + offload.device_total_bytes) / 2
    return int(middle / (1 - plan_headroom(cfg).device(stream.calibrated)))


def test_an_oom_on_single_climbs_into_stream_on_a_device_too_small_for_fsdp_offload(tmp_path):
    """One process, 4M parameters, `single` forced on a device too small for it and for
    `fsdp_offload`, between the two offload rungs' estimates: after a persistent OOM on
    `single` the one rung that fits is `stream` (`zero3_offload_params` needs more than
    `fsdp_offload` on one rank: its prefetch and reduce buckets); the run climbs into it,
    resumes and finishes."""
    run_dir = tmp_path / "run"
    device = _between_stream_and_fsdp_offload()
    r = oomless(
        "train", str(DEMO), *STREAM_JOB, f"hardware.device_memory={device}", "strategy=single",
        "train.steps=4", "train.eval_every=0", "run.save_final=false", "run.checkpoint_every=2",
        f"run.dir={run_dir}", IN_THIS_PROCESS,
        "debug.inject_oom={step: 3, times: 0, where: forward, strategies: [single]}",
        timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    escalations = [json.loads(x) for x in (run_dir / "escalations.jsonl").read_text().splitlines()]
    assert [(e["from"], e["to"], e["step"]) for e in escalations] == [("single", "stream", 3)]
    lines = metrics(run_dir)
    assert [(m["step"], m["strategy"]) for m in lines] == [
        (1, "single"), (2, "single"), (3, "stream"), (4, "stream")
    ]  # fmt: skip
    plan = json.loads((run_dir / "plan.json").read_text())
    rungs = {a["strategy"]: a for a in plan["alternatives"]}
    assert plan["strategy"] == "stream", rungs
    assert not rungs["fsdp_offload"]["fits"], rungs["fsdp_offload"]
    assert "needs" in rungs["fsdp_offload"]["why_not"], rungs["fsdp_offload"]
    assert not rungs["zero3_offload_params"]["fits"], rungs["zero3_offload_params"]

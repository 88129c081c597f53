"""The launch probe (docs/probe.md): the first step measured against the
plan, a calibration kept for later plans, and a re-plan when the first step is over the budget.

One job throughout: the demo's model at 512 tokens, 32 sequences a step, whose activations
(0.9 GB at micro-batch 32) are most of what it holds, so a smaller micro-batch or checkpointing
brings a re-planned step back under the budget.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import REPO, oomless, python_env

JOB = [str(REPO / "configs" / "demo.yaml"), "data.seq_len=512",
       "model.config.max_position_embeddings=512", "train.global_batch_size=32",
       "train.warmup_steps=0", "train.eval_every=0"]  # fmt: skip


def _losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """`plan --probe` of the job on one CPU process, into a calibration file of this module's."""
    cal = tmp_path_factory.mktemp("cache") / "calibration.json"
    env = {**python_env(), "OOMLESS_CALIBRATION": str(cal)}
    probe = oomless("plan", *JOB, "--probe", env=env, timeout=300)
    return cal, env, probe


def test_plan_probe_prints_measured_against_estimated_and_calibrates_the_next_plan(calibrated):
    cal, env, probe = calibrated
    assert probe.returncode == 0, probe.stderr[-2000:]
    rank, node = (
        line for line in probe.stdout.splitlines() if line.startswith(("rank 0", "node 0"))
    )
    assert rank.endswith("device") and node.endswith("host")
    measured, estimated = (float(x) for x in rank.split()[2:6:2])
    assert 0.3 < measured / estimated < 1.5  # GiB, as printed
    assert "within the budget" in probe.stdout
    kept = json.loads(cal.read_text())
    ((key, figures),) = kept.items()
    assert key.startswith("cpu|") and key.endswith("|single|llama")
    assert figures["reserve_ratio"] is None and figures["fixed_bytes"] > 0

    plan = json.loads(oomless("plan", *JOB, "--json", env=env).stdout)
    reason = next(r for r in plan["reasons"] if r.startswith("calibrated by a launch probe"))
    assert str(cal) in reason
    overhead = plan["estimate"]["device"]["breakdown"]["runtime_overhead"]
    assert overhead == figures["fixed_bytes"]  # the measured process, not the assumed 1 GiB
    assert plan["headroom"] == {"device": 0.05, "host": 0.1, "auto": True}

    os.rename(cal, cal.with_suffix(".kept"))
    try:  # without the file: the uncalibrated plan
        bare = json.loads(oomless("plan", *JOB, "--json", env=env).stdout)
    finally:
        os.rename(cal.with_suffix(".kept"), cal)
    assert not any(r.startswith("calibrated") for r in bare["reasons"])
    assert bare["estimate"]["device"]["breakdown"]["runtime_overhead"] == 2**30
    assert bare["headroom"]["device"] == 0.1


def test_a_first_step_over_budget_replans_and_learns_what_the_right_plan_learns(
    calibrated, tmp_path
):
    """debug.probe_scale=1.5 on a plan at the device's edge: the run stops after step 1, plans
    again with the measured figure and trains what a run planned that way from the start does."""
    cal, env, _ = calibrated
    plan = json.loads(oomless("plan", *JOB, "--json", env=env).stdout)
    assert plan["micro_batch_size"] == 32
    total = plan["estimate"]["device"]["total_bytes"]
    edge = [
        "hardware.device=cpu",
        f"hardware.device_memory={int(total * 1.15 / 0.95)}",
        "train.steps=2",
    ]

    probed = tmp_path / "probed"
    r = oomless("train", *JOB, *edge, "debug.probe_scale=1.5", f"run.dir={probed}", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stderr.splitlines() if "re-planned:" in x)
    assert "(x1.5, debug.probe_scale)" in line and "over the device budget" in line
    replanned = json.loads((probed / "plan.json").read_text())
    assert (replanned["micro_batch_size"], replanned["activation_checkpointing"]) != (32, "none")
    assert replanned["memory_scale"] > 1.1  # measured x1.5 over the (calibrated) estimate
    probe = json.loads((probed / "probe.json").read_text())  # the second launch's: it fits
    assert probe["action"] == "continue" and probe["probe_scale"] == 1.5
    assert probe["replanned"]["memory_scale"] == replanned["memory_scale"]
    changed = probe["replanned"]["changed"]  # what the first launch's probe re-planned
    assert "micro_batch_size 32 ->" in changed or "activation_checkpointing none ->" in changed
    (escalation,) = [json.loads(x) for x in (probed / "escalations.jsonl").read_text().splitlines()]
    assert escalation["reason"].startswith("launch probe: measured")

    right = tmp_path / "right"
    forced = [f"train.micro_batch_size={replanned['micro_batch_size']}",
              f"memory.activation_checkpointing={replanned['activation_checkpointing']}",
              f"strategy={replanned['strategy']}"]  # fmt: skip
    r = oomless("train", *JOB, *edge, *forced, f"run.dir={right}", "run.max_restarts=0", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = _losses(probed), _losses(right)
    assert len(got) == len(want) == 2
    assert got == pytest.approx(want, abs=1e-6)
    # without the debug key the plan at the edge stands: measured within the budget
    plain = tmp_path / "plain"
    r = oomless("train", *JOB, *edge, "train.steps=1", f"run.dir={plain}", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((plain / "plan.json").read_text())["micro_batch_size"] == 32
    assert json.loads((plain / "probe.json").read_text())["action"] == "continue"
    assert not (plain / "escalations.jsonl").exists()


def test_plan_probe_on_two_ranks_measures_each_rank_and_the_node(tmp_path):
    r = oomless("plan", str(REPO / "configs" / "demo.yaml"), "strategy=fsdp",
                "hardware.devices_per_node=2", "--probe", timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [x for x in r.stdout.splitlines() if x.startswith("rank ")]
    nodes = [x for x in r.stdout.splitlines() if x.startswith("node ")]
    assert [x.split()[1] for x in ranks] == ["0", "1"] and len(nodes) == 1
    assert all(float(x.split()[2]) > 0.1 for x in ranks + nodes)  # GiB measured


def test_an_unreadable_calibration_file_is_said_and_planned_without(tmp_path, monkeypatch, caplog):
    """In process: a calibration file that is not JSON (or not an object) is one warning, and the
    plan is the uncalibrated one."""
    from launcher.plan.job import resolve_plan
    from trainer.core.config import load_config

    cal = tmp_path / "calibration.json"
    monkeypatch.setenv("OOMLESS_CALIBRATION", str(cal))
    cfg = load_config(REPO / "configs" / "demo.yaml", ["hardware.device=cpu"])
    for text in ("{not json", "[1, 2]"):
        cal.write_text(text)
        _, plan = resolve_plan(cfg)
        assert plan["estimate"]["device"]["breakdown"]["runtime_overhead"] == 2**30
        assert not any(r.startswith("calibrated") for r in plan["reasons"])
    assert "calibration:" in caplog.text and "unreadable" in caplog.text

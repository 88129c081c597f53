"""`oomless report RUN_DIR` draws the run's loss curves and memory picture as PNG files."""

from __future__ import annotations

import json

from tests.conftest import oomless

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_report_writes_loss_and_memory_pngs(tmp_path):
    lines = []
    for step in range(1, 11):
        rec = {
            "step": step,
            "loss": 3.0 / step,
            "strategy": "fsdp",
            "world_size": 2,
            "micro_batch_size": 2,
            "grad_accum": 4,
            "peak_device_bytes": 3 * 2**30,
        }
        if step % 5 == 0:
            rec |= {"eval_loss": 3.2 / step, "eval_exact_match": step / 10}
        lines.append(json.dumps(rec))
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    breakdown = {"params": 2**30, "grads": 2**30, "optimizer": 2**31, "activations": 2**29}
    plan = {"strategy": "fsdp", "estimate": {"device": {"breakdown": breakdown}}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    r = oomless("report", str(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    for name in ("loss.png", "memory.png"):
        path = tmp_path / name
        assert path.read_bytes()[:8] == PNG_MAGIC
        assert path.stat().st_size > 5_000  # a drawn figure, not an empty canvas
        assert str(path) in r.stdout


def test_report_on_a_dir_without_metrics_is_one_line_exit_2(tmp_path):
    r = oomless("report", str(tmp_path), timeout=120)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "metrics.jsonl" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_preference_run_is_labelled_by_its_objective_with_a_rewards_panel(tmp_path):
    """Before: "loss (token-weighted mean)" and no reward accuracy or margin anywhere."""
    import matplotlib

    matplotlib.use("Agg")
    from launcher.report.run_report import loss_figure, objective_of

    records = [
        {"step": s, "loss": 0.69 - s / 100, "reward_accuracy": s / 10, "reward_margin": s / 50}
        | ({"eval_loss": 0.7, "eval_reward_accuracy": 0.5} if s == 5 else {})
        for s in range(1, 6)
    ]
    (tmp_path / "config.yaml").write_text("objective: {type: dpo, beta: 0.1}\n")
    assert objective_of(tmp_path, records) == "dpo"
    fig = loss_figure(records, "dpo")
    labels = [ax.get_ylabel() for ax in fig.axes]
    assert labels[0] == "DPO loss (mean over pairs)" and "token-weighted" not in str(labels)
    assert "reward accuracy (%)" in labels and "reward margin (chosen - rejected)" in labels
    drawn = {line.get_label() for ax in fig.axes for line in ax.get_lines()}
    assert {"reward accuracy (%)", "reward margin", "eval reward accuracy (%)"} <= drawn, drawn
    sft = loss_figure([{"step": 1, "loss": 3.0}], "sft")
    assert [ax.get_ylabel() for ax in sft.axes] == ["loss (token-weighted mean)"]

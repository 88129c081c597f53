"""`model.rope_scaling` (opt-in context extension): checked against the model's positions, a
yarn-extended tiny Llama trains on windows beyond its own positions, resumes to the same losses,
and its exported config carries the scaling."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from tests.conftest import TINY_LLAMA, oomless, train_in_one_process, write_demo_job
from trainer.core.config import ConfigError, build_config

YARN = {"rope_type": "yarn", "factor": 4.0}
SHORT = {**TINY_LLAMA, "vocab_size": 45, "max_position_embeddings": 16}  # 16 positions of its own


def _tree(seq_len: int, rope: dict | None = None, model: dict = SHORT) -> dict:
    return {
        "model": {"config": model, **({"rope_scaling": rope} if rope else {})},
        "data": {"path": "HuggingFaceH4/no_robots", "format": "chat", "seq_len": seq_len},
    }


def test_a_window_beyond_the_positions_names_the_key_that_extends_them():
    with pytest.raises(ConfigError) as err:
        build_config(_tree(64))
    assert "data.seq_len: 64 is more than the model's 16 positions" in str(err.value)
    assert "model.rope_scaling={rope_type: yarn, factor: 4.0}" in str(err.value)
    assert build_config(_tree(64, YARN)).model.rope_scaling == YARN  # 4 x 16 = 64 positions
    with pytest.raises(ConfigError, match="more than the 64 positions model.rope_scaling yields"):
        build_config(_tree(65, YARN))


@pytest.mark.parametrize(
    ("rope", "model", "says"),
    [
        ({"rope_type": "ntk", "factor": 2.0}, SHORT, "rope_type 'ntk' is not one of yarn"),
        ({"rope_type": "yarn"}, SHORT, "factor None is not a number >= 1"),
        ({"rope_type": "linear", "factor": 0.5}, SHORT, "factor 0.5 is not a number >= 1"),
        (YARN, {"model_type": "gpt2", "n_positions": 16}, "gpt2 has no rotary positions"),
    ],
)
def test_a_scaling_that_cannot_apply_is_one_line(rope, model, says):
    with pytest.raises(ConfigError) as err:
        build_config(_tree(16, rope, model))
    assert f"model.rope_scaling: {says}" in str(err.value)
    assert "\n" not in str(err.value)


def test_the_plan_takes_the_positions_the_scaling_yields():
    """Llama-3.1-8B's 131,072 positions, yarn x 4 over them: 524,288 (the planner's bound)."""
    from launcher.estimate.shape import model_shape

    cfg = build_config(
        {
            "model": {
                "name_or_path": "meta-llama/Llama-3.1-8B",
                "rope_scaling": {**YARN, "original_max_position_embeddings": 131072},
            },
            "data": {"path": "HuggingFaceH4/no_robots", "seq_len": 524288},
        }
    )
    assert model_shape(cfg.model).max_positions == 524288


def _long_documents(path: Path) -> Path:
    """Sums of 12 numbers: documents of about 60 tokens, far beyond 16 positions."""
    rng = random.Random(0)
    rows = []
    for _ in range(200):
        terms = [rng.randrange(100) for _ in range(12)]
        rows.append({"prompt": "+".join(map(str, terms)) + "=", "completion": str(sum(terms))})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("rope")
    job = write_demo_job(
        work / "job.yaml",
        model={"config": SHORT, "rope_scaling": YARN},
        data={"path": str(_long_documents(work / "long.jsonl")), "seq_len": 64},
        train={"steps": 4, "global_batch_size": 4, "micro_batch_size": 2, "lr": 3e-3},
        run={"checkpoint_every": 2, "save_final": True},
    )
    resume = f"run.resume={work / 'run' / 'checkpoints' / 'step_2'}"
    train_in_one_process(
        [
            ([str(job), "strategy=single", f"run.dir={work / 'run'}"], work / "run.txt"),
            (
                [str(job), "strategy=single", f"run.dir={work / 'resumed'}", resume],
                work / "resumed.txt",
            ),
        ]  # fmt: skip
    )
    return work


def test_a_yarn_extended_model_trains_beyond_its_positions_and_resumes(runs):
    losses = _losses(runs / "run")
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert _losses(runs / "resumed") == pytest.approx(losses[2:], abs=1e-5)
    resolved = yaml.safe_load((runs / "run" / "config.yaml").read_text())
    assert resolved["model"]["rope_scaling"] == YARN


def test_the_exported_model_keeps_the_scaling(runs):
    for exported in (runs / "run" / "final", runs / "exported"):
        if exported.name == "exported":
            ckpt = runs / "run" / "checkpoints" / "step_4"
            assert oomless("export", str(ckpt), str(exported)).returncode == 0
        config = json.loads((exported / "config.json").read_text())
        rope = config.get("rope_parameters") or config["rope_scaling"]
        assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0, rope
        assert rope["original_max_position_embeddings"] == 16
        assert config["max_position_embeddings"] == 64

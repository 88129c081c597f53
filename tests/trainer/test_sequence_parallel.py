"""Ulysses sequence parallelism (trainer/sequence_parallel.py) on CPU processes (gloo): the
per-step losses and eval losses of sequence_parallel=2 and 4 equal one process's, under ddp and
fsdp, with activation checkpointing none and full, with LoRA, with the memory levers and the
OOM back-off, on grouped-query attention with fewer key/value heads than ranks, on a second and a
third architecture (Qwen2, Mistral with a sliding window shorter than the window of packed
documents); a checkpoint written at sp=2 resumes at sp=1; bad splits exit 2 in one line.

One torchrun launch serves the two-rank runs and one the four-rank runs (tests/trainer/
sp_worker.py); the one-process references run in one process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO, python_env, run_bounded, write_demo_job

WORKER = str(REPO / "tests" / "trainer" / "sp_worker.py")
STEPS = 6
_SMALL = "vocab_size: 45, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
QWEN2_KV1 = (  # one key/value head for two ranks: repeated, one per rank
    "model.config={model_type: qwen2, " + _SMALL + "num_attention_heads: 4, "
    "num_key_value_heads: 1, max_position_embeddings: 256}"
)
MISTRAL_WINDOW = (  # a sliding window of 4 tokens, shorter than most documents: its mask matters
    "model.config={model_type: mistral, " + _SMALL + "num_attention_heads: 4, "
    "num_key_value_heads: 2, head_dim: 8, sliding_window: 4, max_position_embeddings: 256}"
)
LORA = ("finetune.method=lora", "finetune.lora.r=4", "finetune.lora.alpha=8")
FULL_AC = "memory.activation_checkpointing=full"
LEVERS = (
    "memory.chunked_loss=true",
    "memory.loss_chunk_tokens=5",
    "memory.offload_activations=true",
    "debug.inject_oom={step: 2, rank: 1, times: 1, where: backward}",
)
SINGLE = ("strategy=single", "hardware.devices_per_node=1", "train.micro_batch_size=8")
# name: (overrides, world size, the one-process run it must equal)
RUNS: dict[str, tuple[tuple[str, ...], int, str | None]] = {
    "single": ((*SINGLE, "run.checkpoint_every=3"), 1, None),
    "single_lora": ((*SINGLE, *LORA), 1, None),
    "single_qwen2": ((*SINGLE, QWEN2_KV1), 1, None),
    "single_mistral": ((*SINGLE, MISTRAL_WINDOW), 1, None),
    "ddp_sp2": (("strategy=ddp", "sequence_parallel=2"), 2, "single"),
    "ddp_sp2_full": (("strategy=ddp", "sequence_parallel=2", FULL_AC), 2, "single"),
    "fsdp_sp2": (("strategy=fsdp", "sequence_parallel=2"), 2, "single"),
    "fsdp_sp2_full": (
        ("strategy=fsdp", "sequence_parallel=2", FULL_AC, "run.checkpoint_every=3"),
        2,
        "single",
    ),
    "fsdp_sp2_lora": (("strategy=fsdp", "sequence_parallel=2", *LORA), 2, "single_lora"),
    "ddp_sp2_levers": (("strategy=ddp", "sequence_parallel=2", *LEVERS), 2, "single"),
    "ddp_sp2_qwen2": (("strategy=ddp", "sequence_parallel=2", QWEN2_KV1), 2, "single_qwen2"),
    "fsdp_sp2_mistral": (
        ("strategy=fsdp", "sequence_parallel=2", MISTRAL_WINDOW),
        2,
        "single_mistral",
    ),
    # two sequence groups of two: FSDP2 shards over all four ranks
    "fsdp_sp2_w4": (
        ("strategy=fsdp", "sequence_parallel=2", "train.micro_batch_size=2"),
        4,
        "single",
    ),
    # one group of four: the model's 2 key/value heads repeated to one per rank
    "ddp_sp4_w4": (("strategy=ddp", "sequence_parallel=4"), 4, "single"),
    # the sp=2 checkpoint of step 3, resumed on one process at sp=1
    "resume_sp1": ((*SINGLE, "sequence_parallel=1"), 1, "single"),
}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _base_config(tmp: Path) -> Path:
    return write_demo_job(
        tmp / "base.yaml",
        data={"eval_fraction": 0.02},
        train={
            "steps": STEPS,
            "global_batch_size": 8,
            "micro_batch_size": 4,
            "warmup_steps": 1,
            "eval_every": 3,
            "eval_batches": 50,  # every eval window, whatever the batch size
        },
        hardware={"devices_per_node": 2},
        run={"checkpoint_every": 0},
        dist={"timeout_s": 120},
    )


def _launch(base: Path, work: Path, world_size: int, names: list[str], timeout: float) -> None:
    runs = json.dumps([[name, [*RUNS[name][0], f"hardware.devices_per_node={world_size}"]]
                       for name in names])  # fmt: skip
    argv = [PYTHON, WORKER, str(base), str(work), runs]
    if world_size > 1:
        argv = [PYTHON, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={world_size}", *argv[1:]]  # fmt: skip
    r = run_bounded(argv, env=python_env(), cwd=REPO, timeout=timeout)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("sp")
    base = _base_config(work)
    by_world: dict[int, list[str]] = {}
    for name, (_, world_size, _) in RUNS.items():
        by_world.setdefault(world_size, []).append(name)
    _launch(base, work, 1, [n for n in by_world[1] if n != "resume_sp1"], timeout=600)
    _launch(base, work, 2, by_world[2], timeout=900)
    _launch(base, work, 4, by_world[4], timeout=600)
    checkpoint = "checkpoints/step_3"
    shutil.copytree(work / "fsdp_sp2_full" / checkpoint, work / "resume_sp1" / checkpoint)
    _launch(base, work, 1, ["resume_sp1"], timeout=300)
    return work


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


PARITY = [name for name, (_, _, against) in RUNS.items() if against and name != "resume_sp1"]


@pytest.mark.parametrize("name", PARITY)
def test_losses_equal_one_process(runs: Path, name: str) -> None:
    got, want = _metrics(runs / name), _metrics(runs / RUNS[name][2])
    assert len(got) == len(want) == STEPS
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], abs=1e-4), (g["step"], g["loss"], w["loss"])
        assert g["tokens"] == w["tokens"]
    evals = [(g, w) for g, w in zip(got, want, strict=True) if "eval_loss" in w]
    assert len(evals) == 2
    for g, w in evals:
        assert g["eval_loss"] == pytest.approx(w["eval_loss"], abs=1e-4), (g["step"], g, w)
        assert g["eval_exact_match"] == w["eval_exact_match"], (g["step"], g, w)


def test_the_reference_architectures_learn_different_things(runs: Path) -> None:
    """The parity above is not vacuous: the models differ, and so do their losses."""
    firsts = {
        n: _metrics(runs / n)[-1]["loss"] for n in ("single", "single_qwen2", "single_mistral")
    }
    assert len({round(v, 4) for v in firsts.values()}) == 3, firsts


def test_levers_and_backoff_ran(runs: Path) -> None:
    """The levers run was cut smaller by the injected OOM and kept its levers on."""
    lines = _metrics(runs / "ddp_sp2_levers")
    assert lines[0]["micro_batch_size"] == 4 and lines[-1]["micro_batch_size"] == 2
    assert lines[-1]["chunked_loss"] and lines[-1]["offload_activations"]


def test_sp2_checkpoint_resumes_at_sp1(runs: Path) -> None:
    got, want = _metrics(runs / "resume_sp1"), _metrics(runs / "single")
    assert [g["step"] for g in got] == [4, 5, 6]
    for g, w in zip(got, want[3:], strict=True):
        assert g["loss"] == pytest.approx(w["loss"], abs=1e-4), (g["step"], g["loss"], w["loss"])

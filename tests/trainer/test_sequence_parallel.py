"""Ulysses sequence parallelism (trainer/parallel/sequence.py) on CPU processes (gloo): the
per-step losses and eval losses of sequence_parallel=2 and 4 equal one process's, under ddp and
fsdp, with activation checkpointing none and full, with LoRA, with the memory levers and the
OOM back-off, on grouped-query attention with fewer key/value heads than ranks, on a second and a
third architecture (Qwen2, Mistral with a sliding window shorter than the window of packed
documents), on two whose masks ignore position ids (OPT, BioGPT), with yarn-extended positions
and offloaded checkpoints (fsdp, every layer checkpointed and its input on the host); a
checkpoint written at sp=2
resumes at sp=1; bad splits exit 2 in one line.

One torchrun launch serves the two-rank runs and one the four-rank runs (tests/trainer/
sp_worker.py); the one-process references run through `oomless train` in the session's one
process (tests/cli_worker.py).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    PYTHON,
    REPO,
    TINY_LLAMA,
    python_env,
    run_bounded,
    train_in_one_process,
    write_demo_job,
)
from trainer.core.config import ConfigError
from trainer.core.parallel_dims import ParallelDims
from trainer.loss import IGNORE_INDEX
from trainer.parallel.sequence import (
    check_sequence_parallel,
    mask_follows_position_ids,
    split_sequence,
)

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
# masks built without position ids (packed documents attend to each other on one process): the
# split attends through the same plain causal mask (trainer/parallel/sequence.py)
OPT = (
    "model.config={model_type: opt, vocab_size: 45, hidden_size: 32, ffn_dim: 64, "
    "word_embed_proj_dim: 32, num_hidden_layers: 2, num_attention_heads: 4, dropout: 0.0, "
    "attention_dropout: 0.0, max_position_embeddings: 256}"
)
BIOGPT = (
    "model.config={model_type: biogpt, " + _SMALL + "num_attention_heads: 4, "
    "hidden_dropout_prob: 0.0, attention_probs_dropout_prob: 0.0, layerdrop: 0.0, "
    "max_position_embeddings: 256}"
)
LORA = ("finetune.method=lora", "finetune.lora.r=4", "finetune.lora.alpha=8")
FULL_AC = "memory.activation_checkpointing=full"
LEVERS = (
    "memory.chunked_loss=true",
    "memory.loss_chunk_tokens=5",
    "memory.offload_activations=true",
    "debug.inject_oom={step: 2, rank: 1, times: 1, where: backward}",
)
TILED = ("memory.tiled_mlp=true", "memory.mlp_chunk_tokens=4")
SINGLE = ("strategy=single", "hardware.devices_per_node=1", "train.micro_batch_size=8")
# yarn x 4 over 16 positions of its own: the 32-token windows go beyond them
ROPE = (
    "model.config.max_position_embeddings=16",
    "model.rope_scaling={rope_type: yarn, factor: 4.0}",
)
# ALST's offloaded checkpoints: every layer checkpointed, only its input waits on the host
OFFLOADED_CHECKPOINTS = (FULL_AC, "memory.offload_activations=true")
TP_STEPS = "train.steps=8"
# Qwen2 (biased q/k/v) and Qwen3 (q/k norms, their gradients summed over the tensor group) with
# 2 key/value heads: one a tensor rank
TENSOR_MODELS = {
    model: "model.config={model_type: " + model + ", " + _SMALL + "num_attention_heads: 4, "
    "num_key_value_heads: 2, max_position_embeddings: 256}"
    for model in ("qwen2", "qwen3")
}
# name: (overrides, world size, the one-process run it must equal)
RUNS: dict[str, tuple[tuple[str, ...], int, str | None]] = {
    "single": ((*SINGLE, "run.checkpoint_every=3", "run.save_final=true"), 1, None),
    "single_lora": ((*SINGLE, *LORA), 1, None),
    "single_qwen2": ((*SINGLE, QWEN2_KV1), 1, None),
    "single_mistral": ((*SINGLE, MISTRAL_WINDOW), 1, None),
    "single_opt": ((*SINGLE, OPT), 1, None),
    "single_biogpt": ((*SINGLE, BIOGPT), 1, None),
    "ddp_sp2": (("strategy=ddp", "sequence_parallel=2", "run.save_final=true"), 2, "single"),
    "ddp_sp2_full": (("strategy=ddp", "sequence_parallel=2", FULL_AC), 2, "single"),
    # the new name of sequence_parallel: the same losses as the one-process run, as the old one
    "fsdp_sp2": (("strategy=fsdp", "parallel.sequence=2"), 2, "single"),
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
    "ddp_sp2_opt": (("strategy=ddp", "sequence_parallel=2", OPT), 2, "single_opt"),
    "fsdp_sp2_biogpt": (("strategy=fsdp", "sequence_parallel=2", BIOGPT), 2, "single_biogpt"),
    # two sequence groups of two: FSDP2 shards over all four ranks
    "fsdp_sp2_w4": (
        ("strategy=fsdp", "sequence_parallel=2", "train.micro_batch_size=2"),
        4,
        "single",
    ),
    # one group of four: the model's 2 key/value heads repeated to one per rank
    "ddp_sp4_w4": (("strategy=ddp", "sequence_parallel=4"), 4, "single"),
    # tiled MLP (trainer/memory/tiled_mlp.py): 4 chunks of each rank's 16 / the window's 32 tokens
    "single_tiled": ((*SINGLE, *TILED), 1, None),
    "fsdp_sp2_full_tiled": (("strategy=fsdp", "sequence_parallel=2", FULL_AC, *TILED), 2, None),
    # context extension with offloaded checkpoints (docs/long-context.md)
    "single_rope": ((*SINGLE, *ROPE), 1, None),
    "fsdp_sp2_rope_offloaded": (
        ("strategy=fsdp", "sequence_parallel=2", *ROPE, *OFFLOADED_CHECKPOINTS),
        2,
        "single_rope",
    ),
    # the one-process checkpoint of step 3, resumed at sp=2; the sp=2 one resumed at sp=1
    "resume_sp2": (
        ("strategy=ddp", "sequence_parallel=2", "run.resume={work}/single/checkpoints/step_3"),
        2,
        "single",
    ),
    "resume_sp1": ((*SINGLE, "sequence_parallel=1"), 1, "single"),
    # tensor parallel 2 under FSDP over the other 2 ranks, and with a sequence split of 2 (each
    # tensor rank's one key/value head serves both sequence ranks), against 8 steps of one process
    "single8": ((*SINGLE, TP_STEPS), 1, None),
    "fsdp_tp2_w4": (("strategy=fsdp", "parallel.tensor=2", TP_STEPS), 4, "single8"),
    **{
        name: run
        for model, config in TENSOR_MODELS.items()
        for name, run in (
            (f"single8_{model}", ((*SINGLE, TP_STEPS, config), 1, None)),
            (
                f"fsdp_tp2_{model}_w4",
                (("strategy=fsdp", "parallel.tensor=2", TP_STEPS, config), 4, f"single8_{model}"),
            ),
        )
    },
    "fsdp_sp2_tp2_w4": (
        ("strategy=fsdp", "parallel.tensor=2", "parallel.sequence=2", TP_STEPS),
        4,
        "single8",
    ),
}


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
    """The runs `names` of `world_size` ranks in one torchrun launch (sp_worker.py)."""
    runs = json.dumps([[name, [*RUNS[name][0], f"hardware.devices_per_node={world_size}"]]
                       for name in names])  # fmt: skip
    argv = [PYTHON, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={world_size}", WORKER, str(base), str(work), runs]  # fmt: skip
    r = run_bounded(argv, env=python_env(), cwd=REPO, timeout=timeout)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])


def _one_process(base: Path, work: Path, names: list[str]) -> None:
    """The one-process runs `names` through `oomless train`, in the session's one process
    (tests/cli_worker.py); each one's stderr in its stderr.txt."""
    train_in_one_process(
        [([str(base), *RUNS[name][0], f"run.dir={work / name}"], work / name / "stderr.txt")
         for name in names]
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("sp")
    base = _base_config(work)
    by_world: dict[int, list[str]] = {}
    for name, (_, world_size, _) in RUNS.items():
        by_world.setdefault(world_size, []).append(name)
    _one_process(base, work, [n for n in by_world[1] if n != "resume_sp1"])
    _launch(base, work, 2, by_world[2], timeout=900)
    _launch(base, work, 4, by_world[4], timeout=600)
    checkpoint = "checkpoints/step_3"
    shutil.copytree(work / "fsdp_sp2_full" / checkpoint, work / "resume_sp1" / checkpoint)
    _one_process(base, work, ["resume_sp1"])
    return work


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


PARITY = [
    name
    for name, (overrides, _, against) in RUNS.items()
    if against and "resume" not in name and TP_STEPS not in overrides
]
TENSOR = [
    name for name, (overrides, _, against) in RUNS.items() if against and TP_STEPS in overrides
]


@pytest.mark.slow
@pytest.mark.timeout(1500)
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


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", TENSOR)
def test_a_tensor_split_under_fsdp_and_a_sequence_split_learns_what_one_process_learns(
    runs: Path, name: str
) -> None:
    got, want = _metrics(runs / name), _metrics(runs / RUNS[name][2])
    assert len(got) == len(want) == 8
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], abs=1e-5), (g["step"], g["loss"], w["loss"])
        assert g["tokens"] == w["tokens"]
        assert g.get("eval_loss", 0) == pytest.approx(w.get("eval_loss", 0), abs=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_reference_architectures_learn_different_things(runs: Path) -> None:
    """The parity above is not vacuous: the models differ, and so do their losses."""
    firsts = {
        n: _metrics(runs / n)[-1]["loss"] for n in ("single", "single_qwen2", "single_mistral")
    }
    assert len({round(v, 4) for v in firsts.values()}) == 3, firsts
    # yarn's scaled rotary tables are in force (the demo's short documents barely feel them)
    plain, rope = (_metrics(runs / n) for n in ("single", "single_rope"))
    assert max(abs(p["loss"] - r["loss"]) for p, r in zip(plain, rope, strict=True)) > 1e-5


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_offloaded_checkpoints_moved_only_the_layer_inputs(runs: Path) -> None:
    """Per micro-batch of 4 windows of 16 tokens a rank, 2 layers: only each layer's input
    ([4, 16, 32] fp32) went to the host and came back."""
    lines = _metrics(runs / "fsdp_sp2_rope_offloaded")
    assert all(line["offload_activations"] for line in lines)
    assert lines[0]["activation_checkpointing"] == "full"
    per_step = 2 * 2 * 4 * 16 * 32 * 4  # micro-batches x layers x the input's bytes
    assert [line["offloaded_bytes"] for line in lines] == [per_step] * STEPS
    assert [line["restored_bytes"] for line in lines] == [per_step] * STEPS


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_levers_and_backoff_ran(runs: Path) -> None:
    """The levers run was cut smaller by the injected OOM and kept its levers on."""
    lines = _metrics(runs / "ddp_sp2_levers")
    assert lines[0]["micro_batch_size"] == 4 and lines[-1]["micro_batch_size"] == 2
    assert lines[-1]["chunked_loss"] and lines[-1]["offload_activations"]


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", ["resume_sp1", "resume_sp2"])
def test_a_checkpoint_resumes_at_another_sequence_parallel(runs: Path, name: str) -> None:
    got, want = _metrics(runs / name), _metrics(runs / "single")
    assert [g["step"] for g in got] == [4, 5, 6]
    for g, w in zip(got, want[3:], strict=True):
        assert g["loss"] == pytest.approx(w["loss"], abs=1e-4), (g["step"], g["loss"], w["loss"])


def test_targets_are_shifted_before_the_split() -> None:
    """The last token of slice 0 predicts the first token of slice 1; positions stay global."""
    ids = torch.arange(10, 18).reshape(1, 8)
    labels = ids.clone()
    labels[0, 0] = IGNORE_INDEX
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(8)[None],
             "doc_ids": torch.zeros_like(ids)}  # fmt: skip
    first, second = (split_sequence(batch, ParallelDims(2, 2), r) for r in (0, 1))
    assert first["input_ids"].tolist() == [[10, 11, 12, 13]]
    assert first["targets"].tolist() == [[11, 12, 13, 14]]
    assert second["targets"].tolist() == [[15, 16, 17, IGNORE_INDEX]]
    assert second["position_ids"].tolist() == [[4, 5, 6, 7]]


def _hf(heads: int, kv_heads: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=8 * heads, num_attention_heads=heads,
                       num_key_value_heads=kv_heads)  # fmt: skip


@pytest.mark.parametrize(
    "sp, world, heads, kv_heads, seq_len, words",
    [
        (2, 3, 4, 4, 32, "does not divide the world of 3 ranks"),
        (8, 8, 4, 4, 32, "does not divide the model's 4 attention heads"),
        (4, 4, 12, 6, 32, "6 key/value heads"),
        (4, 4, 4, 4, 30, "data.seq_len=30"),
    ],
)
def test_a_split_the_model_cannot_take_is_a_config_error(
    sp, world, heads, kv_heads, seq_len, words
):
    with pytest.raises(ConfigError) as err:
        check_sequence_parallel(ParallelDims(world, sp), _hf(heads, kv_heads), seq_len)
    line = str(err.value)
    assert line.startswith("config error: sequence_parallel: ") and words in line, line


def test_fewer_key_value_heads_than_ranks_are_repeated_not_refused() -> None:
    check_sequence_parallel(ParallelDims(8, 4), _hf(8, 2), 32)  # 2 kv heads, each twice
    check_sequence_parallel(ParallelDims(4, 4), _hf(8, 8), 32)
    # under a tensor split of 2, each tensor rank's one k/v head serves both sequence ranks
    check_sequence_parallel(ParallelDims(4, 2, 2), _hf(4, 2), 32)


def test_sp_that_does_not_divide_the_ranks_exits_2_in_one_line(tmp_path) -> None:
    job = write_demo_job(tmp_path / "job.yaml", hardware={"devices_per_node": 2},
                         train={"global_batch_size": 8, "micro_batch_size": 4},
                         sequence_parallel=3, strategy="ddp")  # fmt: skip
    r = run_bounded([PYTHON, "-m", "trainer", str(job)], env=python_env(), cwd=REPO, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("config error: sequence_parallel: 3 does not divide the 2 ranks")


def test_sp_the_model_cannot_take_exits_2_from_the_engine(tmp_path) -> None:
    """Three attention heads, two ranks per sequence: refused before anything trains."""
    model = {**TINY_LLAMA, "vocab_size": 45, "hidden_size": 24,
             "num_attention_heads": 3, "num_key_value_heads": 3}  # fmt: skip
    job = write_demo_job(tmp_path / "job.yaml", hardware={"devices_per_node": 2},
                         model={"config": model}, sequence_parallel=2, strategy="ddp",
                         train={"global_batch_size": 8, "micro_batch_size": 4})  # fmt: skip
    env = {**python_env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    r = run_bounded([PYTHON, "-m", "trainer", str(job)], env=env, cwd=REPO, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "config error: sequence_parallel: 2 does not divide the model's 3 attention heads" in (
        r.stderr
    )


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize(
    "tiled, untiled", [("single_tiled", "single"), ("fsdp_sp2_full_tiled", "fsdp_sp2_full")]
)
def test_tiled_mlp_learns_what_the_untiled_mlp_learns(runs: Path, tiled: str, untiled: str) -> None:
    got, want = _metrics(runs / tiled), _metrics(runs / untiled)
    assert len(got) == len(want) == STEPS
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], abs=1e-5), (g["step"], g["loss"], w["loss"])


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_model_trained_at_sp2_is_the_one_process_model(runs: Path) -> None:
    """final/ of an sp=2 run: a plain HF model (no trace of the sequence-parallel attention in
    its config) with the weights one process trains."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(runs / "ddp_sp2" / "final")
    assert config._attn_implementation != "oomless_ulysses"
    assert "oomless" not in (runs / "ddp_sp2" / "final" / "config.json").read_text()
    got = load_file(runs / "ddp_sp2" / "final" / "model.safetensors")
    want = load_file(runs / "single" / "final" / "model.safetensors")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.allclose(got[name], tensor, atol=1e-5), name


class _NextInteger(torch.nn.Module):
    """A 'model' that predicts token + 1 after every token: a document of consecutive integers
    is an exact match, any other is not."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        logits = torch.nn.functional.one_hot((input_ids + 1) % 32, 32).float()
        return type("Out", (), {"logits": logits})


def _row() -> dict[str, torch.Tensor]:
    """One packed window: document 0 (5..11, consecutive, targets in both halves) and document
    1 (20, 21, 23: its last target is a miss)."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 20, 21, 23]])
    labels = ids.clone()
    labels[0, [0, 7]] = IGNORE_INDEX  # nothing predicts a document's first token
    return {"input_ids": ids, "labels": labels,
            "position_ids": torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2]]),
            "doc_ids": torch.tensor([[0] * 7 + [1] * 3])}  # fmt: skip


def _evaluate_half(rank: int, store_dir: str) -> None:
    import torch.distributed as dist

    from trainer.evaluate import evaluate
    from trainer.parallel.mesh import build_mesh

    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank,
                            world_size=2)  # fmt: skip
    dims = ParallelDims(2, 2)
    batches = [split_sequence(_row(), dims, rank)]
    result = evaluate(_NextInteger(), batches, contextlib.nullcontext, torch.device("cpu"),
                      sequence_group=build_mesh(dims, rank).sequence_group)  # fmt: skip
    Path(store_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_exact_match_scores_documents_across_slices(tmp_path) -> None:
    """Document 0 is split over the two slices: it still counts once, and as a match."""
    from trainer.evaluate import evaluate

    whole = evaluate(_NextInteger(), [_row()], contextlib.nullcontext, torch.device("cpu"))
    assert whole["eval_exact_match"] == 0.5
    code = (
        "from tests.trainer.test_sequence_parallel import _evaluate_half; _evaluate_half({}, {!r})"
    )
    procs = [
        subprocess.Popen([PYTHON, "-c", code.format(rank, str(tmp_path))], env=python_env(),
                         cwd=REPO, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]  # fmt: skip
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
    for rank in (0, 1):
        split = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert split["eval_exact_match"] == 0.5, split
        assert split["eval_loss"] == pytest.approx(whole["eval_loss"], abs=1e-6)


def test_which_models_build_their_masks_from_position_ids() -> None:
    import importlib

    def follows(model_type: str) -> bool:
        module = f"transformers.models.{model_type}.modeling_{model_type}"
        return mask_follows_position_ids(importlib.import_module(module))

    assert all(map(follows, ("llama", "mistral", "qwen2", "gemma2")))
    assert not any(map(follows, ("opt", "biogpt")))


def _total_bytes(tracker, kind: str) -> int:
    snapshot = tracker.get_tracker_snapshot(kind)
    return next(v for k, v in next(iter(snapshot.values())).items() if str(k).endswith("Total"))


def test_a_shared_key_value_head_is_sent_once_to_each_rank_not_repeated():
    """2 k/v heads over a sequence group of 8 (rank 0 of a fake process group, real CPU tensors
    under MemTracker): each head goes to the 4 ranks whose query heads share it. The forward
    holds what the rank receives, one head of the whole sequence (the heads of one micro-batch
    are sent in place); its backward the summed gradient, one round's part and the input's
    gradient: kv heads' size each, where repeating them to 8 heads first held twice what is
    received. Its values are those of the repeated exchange (losses of ddp_sp2_qwen2 and
    ddp_sp4_w4 above)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from launcher.estimate.trace import fake_process_group
    from trainer.parallel.sequence import shared_all_to_all

    slice_tokens, head_dim, sp, kv = 64, 16, 8, 2
    heads_bytes = 4 * kv * slice_tokens * head_dim
    received = 4 * sp * slice_tokens * head_dim  # one head of the whole sequence
    with fake_process_group(sp):
        key = torch.randn(1, kv, slice_tokens, head_dim, requires_grad=True)
        grad = torch.ones(sp, 1, slice_tokens, head_dim)
        tracker = MemTracker()
        tracker.track_external(key, grad)
        with tracker:
            inputs = _total_bytes(tracker, "current")
            gathered = shared_all_to_all(key, None, sp // kv)
            forward = _total_bytes(tracker, "peak") - inputs
            gathered.backward(grad)
            step = _total_bytes(tracker, "peak") - inputs
    assert gathered.shape == (sp, 1, slice_tokens, head_dim)
    assert forward == received
    assert step == received + 3 * heads_bytes < 2 * received

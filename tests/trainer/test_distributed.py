"""Two CPU processes under torchrun (gloo): parity of every backend (DDP, FSDP2, DeepSpeed ZeRO
up to ZeRO-Infinity's zero3_nvme) with one process, the in-process OOM back-off agreed by both
ranks (also inside DeepSpeed's optimizer step), and checkpoints moving between strategies and
world sizes: fsdp@2 -> single@1, fsdp@2 -> zero3_offload@2, fsdp@2 -> zero3_nvme@2,
zero3@2 -> single@1, single@1 -> fsdp@2, fsdp@2 -> fsdp@1, expert-split ep2@2 -> fsdp@2,
fsdp@2 -> ep2@2, single@1 -> ep2@2, ep2@2 -> single@1, with the
losses after the resume and the optimizer moments four steps later equal to the straight run's.

One torchrun launch runs all the two-process trainings (tests/trainer/dist_worker.py); the
single-process references run through `oomless train`, all in one process (tests/cli_worker.py)
before that launch and those resumed from its checkpoints in one after it. Module-scoped: the
assertions below share those runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    PYTHON,
    REPO,
    live_children,
    python_env,
    run_bounded,
    train_in_one_process,
    write_demo_job,
)
from tests.trainer.dist_runs import RESUME_AT, RUNS, STEPS, checked
from tests.trainer.saved_model import PRETRAINED_PARAMS, save_pretrained_model

# the first test pays for the module's runs (the fixture): every training of dist_runs.py
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
DEMO = REPO / "configs" / "demo"


def _base_config(tmp: Path) -> Path:
    return write_demo_job(
        tmp / "base.yaml",
        train={
            "steps": STEPS,
            "global_batch_size": 16,
            "micro_batch_size": 4,  # x 2 ranks x accumulation 2
            "warmup_steps": 2,
            "log_every": 5,
        },
        hardware={"devices_per_node": 2},
        # step_4 is resumed from after step_8 and the last step's are written: keep all three
        run={"checkpoint_every": 0, "keep_checkpoints": 3},
        dist={"timeout_s": 120},  # a collective no rank joins fails the test, not the suite
    )


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _single_runs(base: Path, work: Path, runs: list) -> None:
    """`oomless train` of each one-process row, in one process; its stderr in stderr.txt."""
    jobs = []
    for run in runs:
        overrides = [o.replace("{work}", str(work)) for o in run.overrides]
        args = [str(base), "strategy=single", "hardware.devices_per_node=1",
                "train.micro_batch_size=8", f"run.dir={work / run.name}", *overrides]  # fmt: skip
        jobs.append((args, work / run.name / "stderr.txt"))
    train_in_one_process(jobs)


NVME_RUNS = [run.name for run in RUNS if run.needs_nvme]


def async_io_builds() -> bool:
    """Whether DeepSpeed's async_io op (zero3_nvme) can be built here: it needs libaio-dev,
    which .ci/run installs."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder("AsyncIOBuilder").is_compatible(verbose=False)


def _needs_nvme(name: str) -> None:
    if name in NVME_RUNS and not async_io_builds():
        pytest.skip("DeepSpeed's async_io op cannot be built here: install libaio-dev")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("dist")
    base = _base_config(work)
    save_pretrained_model(work / "pretrained")
    pairs = (DEMO / "pairs_train.jsonl").read_text().splitlines(keepends=True)[:16]
    (work / "pairs.jsonl").write_text("".join(pairs))  # dist_runs.py DPO: one global batch
    one_process = [run for run in RUNS if run.world_size == 1]
    _single_runs(base, work, [run for run in one_process if run.copy_from is None])
    before = {p.pid for p in live_children()}
    skip = [] if async_io_builds() else NVME_RUNS
    r = run_bounded(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(REPO / "tests" / "trainer" / "dist_worker.py"), str(base), str(work),
         ",".join(skip)],
        env=python_env(), cwd=REPO, timeout=1200,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    (work / "torchrun_stderr.txt").write_text(r.stderr)  # every two-process run's rank-0 log
    left = {p.pid for p in live_children()} - before
    assert not left, f"processes left behind: {left}"
    resumed = [run for run in one_process if run.copy_from is not None]
    for run in resumed:  # checkpoints of two-process runs resumed on one process
        step = f"checkpoints/step_{RESUME_AT}"
        (work / run.name / "checkpoints").mkdir(parents=True)
        shutil.copytree(work / run.copy_from / step, work / run.name / step)
    _single_runs(base, work, resumed)
    return work


@pytest.mark.parametrize("run", checked("stream"), ids=lambda run: run.name)
def test_stream_learns_what_single_learns(runs, run):
    """Layers streamed from host memory, fp32, accumulation 2, clipping on (train.grad_clip
    1.0 clips every step here): losses and grad norms within 1e-6 of `single`'s, copy threads
    slowed or not, the kept layer inputs on the device or in host memory."""
    ref, got = _metrics(runs / run.against), _metrics(runs / run.name)
    assert len(got) == STEPS and {m["strategy"] for m in got} == {"stream"}
    if "offload" in run.name:  # every kept input went to the host and came back
        assert all(m["offloaded_bytes"] == m["restored_bytes"] > 0 for m in got)
    assert all(m["grad_norm"] > 1.0 for m in ref)  # clipped
    for a, b in zip(got, ref, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-6 * abs(b[key]), (a["step"], key, a[key], b[key])


@pytest.mark.parametrize("name", ["stream_from_single", "fsdp_from_stream"])
def test_stream_checkpoints_resume_within_1e_6(runs, name):
    """single@1 -> stream and stream -> fsdp@2: the resumed losses within 1e-6 of the straight
    run's (the moments: test_resume_carries_the_optimizer_moments)."""
    run = next(r for r in checked("resume") if r.name == name)
    straight, resumed = _metrics(runs / run.against), _metrics(runs / name)
    assert {m["strategy"] for m in resumed} == {name.split("_from_")[0]}
    for a, b in zip(resumed, straight[run.resume_at :], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * b["loss"], (a["step"], a["loss"], b["loss"])


@pytest.mark.parametrize("run", checked("fp32"), ids=lambda run: run.name)
def test_fp32_losses_match_one_process(runs, run):
    _needs_nvme(run.name)
    ref, got = _losses(runs / run.against), _losses(runs / run.name)
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(got, ref, strict=True), start=1):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: {run.name} {a} vs {run.against} {b}"
    assert got[-1] < got[0]
    assert all(m["world_size"] == run.world_size for m in _metrics(runs / run.name))


@pytest.mark.parametrize("run", checked("tensor"), ids=lambda run: run.name)
def test_a_tensor_split_learns_what_one_process_learns(runs, run):
    """Each layer's projections split over the 2 ranks of a tensor group (transformers' plan
    for the architecture): every step's loss within 1e-5 of one process's, the same tokens."""
    ref, got = _metrics(runs / run.against), _metrics(runs / run.name)
    assert len(got) == STEPS
    for a, b in zip(got, ref, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (run.name, a["step"], a["loss"], b["loss"])
        assert a["tokens"] == b["tokens"]
    assert got[-1]["loss"] < got[0]["loss"]


@pytest.mark.parametrize("run", checked("expert"), ids=lambda run: run.name)
def test_an_expert_split_learns_what_one_process_learns(runs, run):
    """Each MoE layer's experts split over the 2 ranks (transformers' plan for the architecture,
    tokens dispatched to their experts by all-to-all), the dense weights under FSDP: every
    step's loss within 1e-5 of one process's and its gradient norm within 1e-5 of it (measured:
    1.4e-7; an expert gradient scaled by the expert or data degree would be far off), the same
    tokens; the split said so at start."""
    ref, got = _metrics(runs / run.against), _metrics(runs / run.name)
    assert len(got) == STEPS
    for a, b in zip(got, ref, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (run.name, a["step"], a["loss"], b["loss"])
        norms = (a["grad_norm"], b["grad_norm"])
        assert abs(norms[0] - norms[1]) <= 1e-5 * norms[1], (run.name, a["step"], norms)
        assert a["tokens"] == b["tokens"]
    assert got[-1]["loss"] < got[0]["loss"]
    split = "expert parallel 2: 2 MoE layers' experts split, 2 per rank"
    runs_split = [r for r in RUNS if r.world_size == 2 and "parallel.expert=2" in r.overrides]
    assert (runs / "torchrun_stderr.txt").read_text().count(split) == len(runs_split)


@pytest.mark.parametrize("run", checked("pretrained"), ids=lambda run: run.name)
def test_pretrained_weights_read_per_rank_give_the_pretrained_loss(runs, run):
    """Fine-tuning from a saved model on two ranks, each reading only its FSDP shard / ZeRO-3
    partition from the safetensors: step 1's loss is the loss of transformers' from_pretrained
    model on that batch (the single run), not a random init's."""
    (got,), (want,) = _losses(runs / run.name), _losses(runs / run.against)
    assert abs(got - want) <= 1e-5 * want, (got, want)
    assert abs(_losses(runs / "single_fp32")[0] - want) > 1e-3  # the weights made a difference
    loads = [json.loads((runs / run.name / f"load_rank{r}.json").read_text()) for r in (0, 1)]
    total = 4 * PRETRAINED_PARAMS  # fp32
    assert all(0.45 * total <= load["held_bytes"] <= 0.55 * total for load in loads), loads


def test_rank0_loading_its_fsdp_shard_stays_below_shard_plus_largest_tensor(runs):
    """Rank 0's resident set while reading its shard (75 MB of a 151 MB model) grows by less
    than the shard plus the largest tensor: no full copy of the model on any rank."""
    load = json.loads((runs / "fsdp_pretrained" / "load_rank0.json").read_text())
    growth = load["rss_peak_bytes"] - load["rss_before_bytes"]
    assert growth <= load["held_bytes"] + load["largest_tensor_bytes"], load


LEVER_RUNS = [(run.name, run.against) for run in checked("levers")]


@pytest.mark.parametrize(("name", "reference"), LEVER_RUNS)
def test_memory_levers_learn_what_the_same_rung_learns_without_them(runs, name, reference):
    """Chunked loss and activation offload (alone, and together under full recomputation) on
    two ranks: per-step losses within 1e-6 of the same rung with the levers off."""
    ref, got = _losses(runs / reference), _losses(runs / name)
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(got, ref, strict=True), start=1):
        assert abs(a - b) <= 1e-6 * abs(b), f"step {step}: {name} {a} vs {reference} {b}"
    metrics = _metrics(runs / name)
    assert all(m["chunked_loss"] == ("offload" not in name) for m in metrics)
    assert all(m["offload_activations"] == ("chunked" not in name) for m in metrics)
    if "chunked" not in name:  # every byte that went to the host came back
        assert all(m["offloaded_bytes"] == m["restored_bytes"] > 0 for m in metrics)


def test_compiled_layers_say_so(runs):
    """train.compile (its losses are checked like every fp32 run's): the startup line says how
    many layers run compiled."""
    assert "2 layers compiled" in (runs / "single_compiled" / "stderr.txt").read_text()


@pytest.mark.parametrize("run", checked("bf16"), ids=lambda run: run.name)
def test_bf16_losses_stay_close_to_one_process(runs, run):
    ref, got = _losses(runs / run.against), _losses(runs / run.name)
    for step, (a, b) in enumerate(zip(got, ref, strict=True), start=1):
        assert abs(a - b) <= 2e-2 * abs(b), f"step {step}: {run.name} {a} vs {run.against} {b}"


@pytest.mark.parametrize("run", checked("learns"), ids=lambda run: run.name)
def test_qlora_learns_on_two_ranks(runs, run):
    losses = _losses(runs / run.name)
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("run", checked("backoff"), ids=lambda run: run.name)
def test_oom_on_rank_1_backs_off_both_ranks_and_learns_the_same(runs, run):
    """An OOM on rank 1 at step 3: both ranks halve the micro-batch (4 -> 2, accumulation
    doubled) and learn what a run cut that way learns (a tensor group's one data rank too);
    under ZeRO its accumulation boundary, reduced partitions and micro-step counter are reset
    too (and nothing hangs)."""
    oom, ref = _metrics(runs / run.name), _metrics(runs / run.against)
    assert [m["micro_batch_size"] for m in oom] == [4, 4] + [2] * (STEPS - 2)
    accum = oom[0]["grad_accum"]  # 2 over two data ranks, 4 over a tensor group's one
    assert [m["grad_accum"] for m in oom][2:] == [2 * accum] * (STEPS - 2)
    for a, b in zip(oom[2:], ref[2:], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (a["step"], a["loss"], b["loss"])


def _canonical(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model/NAME, optim/NAME/{exp_avg,exp_avg_sq,step}), full."""
    from trainer.checkpoint.layout import SafeFileSystemReader

    reader = SafeFileSystemReader(str(checkpoint))
    flat = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in reader.read_metadata().state_dict_metadata.items()
    }
    torch.distributed.checkpoint.load(flat, storage_reader=reader, no_dist=True)
    return flat


def moment_mismatches(got: dict, want: dict, tol: float) -> list[str]:
    """The optimizer entries of `got` that differ from `want` by more than tol, relative to the
    largest magnitude of that tensor in `want` (the second moments are ~1e-6 themselves)."""
    keys = sorted(k for k in want if k.startswith("optim/"))
    if sorted(k for k in got if k.startswith("optim/")) != keys:
        return ["the two checkpoints hold optimizer state for different parameters"]
    bad = []
    for key in keys:
        a, b = got[key].double(), want[key].double()
        scale = float(b.abs().max()) or 1.0
        err = float((a - b).abs().max()) / scale
        if a.shape != b.shape or err > tol:
            bad.append(f"{key}: relative difference {err:.2e}")
    return bad


RESUMED = [(run.name, run.against, run.exact) for run in checked("resume")]
RESUMED_AT = {run.name: run.resume_at for run in checked("resume")}


@pytest.mark.parametrize("name, source, exact", RESUMED)
def test_resume_continues_the_uninterrupted_run(runs, name, source, exact):
    """10 steps straight vs stopped at step 4 (another rung or world) or 6 (the same rung:
    bit-identical), resumed to 10."""
    _needs_nvme(name)
    straight, resumed = _metrics(runs / source), _metrics(runs / name)
    at = RESUMED_AT[name]
    assert [m["step"] for m in resumed] == list(range(at + 1, STEPS + 1))
    for a, b in zip(resumed, straight[at:], strict=True):
        if exact:
            assert a["loss"] == b["loss"], (a["step"], a["loss"], b["loss"])
        else:
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (a, b)


@pytest.mark.parametrize("name, source, exact", RESUMED)
def test_resume_carries_the_optimizer_moments(runs, name, source, exact):
    """Four steps after the resume, the resumed run's AdamW moments (and step) equal the
    straight run's: the moments crossed the strategy change intact, or the drift would show."""
    _needs_nvme(name)
    step = f"checkpoints/step_{2 * RESUME_AT}"
    got, want = _canonical(runs / name / step), _canonical(runs / source / step)
    assert not moment_mismatches(got, want, tol=1e-6)
    assert all(float(got[k]) == 2 * RESUME_AT for k in got if k.endswith("/step"))


def test_a_deepspeed_checkpoint_keeps_each_full_tensor_on_one_rank(runs):
    """Gathering the canonical state, each rank keeps the full weights and moments of its own
    parameters only, about half of the model each at world 2 (every rank keeping all of them
    would need the whole fp32 model and its moments in host memory per rank)."""
    parts = [json.loads((runs / f"zero3_split_rank{r}.json").read_text()) for r in (0, 1)]
    everything = {
        k.removeprefix("model/")
        for k in _canonical(runs / "zero3_fp32" / f"checkpoints/step_{RESUME_AT}")
        if k.startswith("model/")
    }
    names = [set(p["weights"]) for p in parts]
    assert not names[0] & names[1] and names[0] | names[1] == everything
    assert all(sorted(p["weights"]) == p["moments"] for p in parts)
    sizes = [sum(p["weights"].values()) for p in parts]
    assert all(0.4 <= n / sum(sizes) <= 0.6 for n in sizes), sizes


def test_moment_comparison_catches_a_wrong_mapping(runs):
    """The check above can fail: swapped moments of two same-shaped parameters are caught."""
    state = _canonical(runs / "fsdp_fp32" / f"checkpoints/step_{2 * RESUME_AT}")
    wrong = dict(state)
    a, b = "optim/model.layers.0.mlp.up_proj.weight", "optim/model.layers.1.mlp.up_proj.weight"
    wrong[f"{a}/exp_avg"], wrong[f"{b}/exp_avg"] = state[f"{b}/exp_avg"], state[f"{a}/exp_avg"]
    assert len(moment_mismatches(wrong, state, tol=1e-6)) == 2
    assert not moment_mismatches(state, state, tol=1e-6)


@pytest.mark.parametrize("run", checked("full_disk"), ids=lambda run: run.name)
def test_a_full_disk_on_one_rank_is_one_line_on_every_rank(runs, run):
    """ENOSPC on one rank inside its shard of step_4, that rank slowed or not: every rank
    leaves with the same one-line error, step_4.tmp is gone and `latest` names step_2 (before:
    the error DCP passed on had lost its cause, so the ranks raised tracebacks, exit 1, and the
    .tmp stayed)."""
    from trainer.checkpoint.store import checkpoint_damage

    run_dir = runs / run.name
    outcomes = [json.loads((run_dir / f"outcome_rank{r}.json").read_text()) for r in (0, 1)]
    assert [o["raised"] for o in outcomes] == ["ConfigError", "ConfigError"], outcomes
    line = outcomes[0]["line"]
    assert outcomes[1]["line"] == line and "\n" not in line, outcomes
    assert line.startswith("config error: run.dir: could not write checkpoint step_4"), line
    assert "No space left on device" in line and "step_2 is kept" in line, line
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_2"]
    assert (checkpoints / "latest").read_text().strip() == "step_2"
    assert checkpoint_damage(checkpoints / "step_2") is None

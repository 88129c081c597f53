"""Preference tuning (docs/preference.md): the demo model taught addition (SFT, exported), then
tuned on {prompt, chosen, rejected} pairs made from the demo's sums (the right sum chosen, a
near miss rejected) with DPO (full: precomputed reference; LoRA: adapters off), ORPO and SimPO.

One process trains the table once (tests/cli_worker.py); the tests read its runs."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.conftest import REPO, train_in_one_process, write_demo_job
from trainer.core.config import ConfigError, load_config
from trainer.core.rows import check_rows

DEMO = REPO / "configs" / "demo"
NUM_PAIRS = 32  # one global batch: every step sees the same pairs, so their rewards must part
STEPS = 12
LORA = {"method": "lora", "lora": {"r": 4, "alpha": 8}}
ROPE = "{rope_type: linear, factor: 2.0}"


def _preference_job(tmp: Path, name: str, base: Path, pairs: Path, **sections) -> Path:
    return write_demo_job(
        tmp / f"{name}.yaml",
        model={"name_or_path": str(base), "config": None, "tokenizer": None},
        data={
            "path": str(pairs),
            "eval_path": str(DEMO / "pairs_eval.jsonl"),
            "format": "preference",
            "seq_len": 12,
        },
        objective={"type": "dpo", "beta": 0.1},
        train={
            "steps": STEPS,
            "global_batch_size": NUM_PAIRS,
            "micro_batch_size": 16,
            "lr": 1e-2,
            "schedule": "constant",
            "eval_every": STEPS,
            "eval_batches": 2,
        },
        run={"checkpoint_every": STEPS // 2},
        **sections,
    )


def _args(job: Path, run_dir: Path, *overrides: str) -> tuple[list[str], Path]:
    return [str(job), "strategy=single", f"run.dir={run_dir}", *overrides], run_dir / "log.txt"


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in _records(run_dir)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("preference")
    pairs = work / "pairs.jsonl"
    pairs.write_text("".join(open(DEMO / "pairs_train.jsonl").readlines()[:NUM_PAIRS]))
    sft = write_demo_job(
        work / "sft.yaml",
        train={"steps": 100, "global_batch_size": 16, "micro_batch_size": 16, "lr": 1e-2},
        run={"save_final": True, "checkpoint_every": 0},
    )
    base = work / "sft" / "final"
    # 15 pairs and one whose prompt fills seq_len: no answer token is left of it
    cut = work / "pairs_cut.jsonl"
    long_prompt = json.dumps({"prompt": "1234567890+1234567890=", "chosen": "1", "rejected": "2"})
    cut.write_text("".join(open(DEMO / "pairs_train.jsonl").readlines()[:15]) + long_prompt + "\n")
    dpo = _preference_job(work, "dpo", base, pairs)
    dpo_lora = _preference_job(work, "dpo_lora", base, pairs, finetune=LORA)
    resume = f"run.resume={work / 'dpo/checkpoints/step_6'}"
    train_in_one_process(
        [
            _args(sft, work / "sft"),
            _args(dpo, work / "dpo"),
            _args(dpo, work / "dpo_resumed", resume),
            # no cached reference: the pass runs again from the initial weights, then resumes
            _args(dpo, work / "dpo_resumed_cold", resume, f"data.cache_dir={work / 'cold'}"),
            _args(dpo, work / "dpo_chunked", "memory.chunked_loss=true", "train.steps=2"),
            # the same base, data and cache with another rope_scaling: another reference
            _args(dpo, work / "dpo_rope", f"model.rope_scaling={ROPE}", "train.steps=1"),
            # an out-of-memory at step 3: the micro-batch halves (16 -> 8 pairs), same math
            _args(dpo, work / "dpo_oom", "train.steps=4", "debug.inject_oom={step: 3}"),
            _args(dpo_lora, work / "dpo_lora", "train.lr=5e-3"),
            _args(dpo, work / "orpo", "objective.type=orpo", "train.lr=3e-3"),
            _args(dpo, work / "simpo", "objective.type=simpo", "objective.beta=2.0"),
            _args(
                dpo,
                work / "orpo_cut",
                "objective.type=orpo",
                f"data.path={cut}",
                "train.global_batch_size=8",
                "train.micro_batch_size=8",
                "train.steps=2",
            ),
        ]
    )
    return work


def test_the_first_dpo_step_is_ln2_full_and_lora(runs):
    """policy = reference at step 1: every pair's margin is 0, its loss -logsigmoid(0) = ln 2."""
    for name in ("dpo", "dpo_lora"):
        first = _records(runs / name)[0]
        assert abs(first["loss"] - math.log(2)) < 1e-4, (name, first["loss"])
        assert first["reward_margin"] == 0.0 and first["reward_accuracy"] == 0.0, first


def test_dpo_reward_accuracy_rises_and_the_loss_falls(runs):
    for name in ("dpo", "dpo_lora"):
        records = _records(runs / name)
        accuracy = [r["reward_accuracy"] for r in records]
        assert sum(accuracy[-4:]) / 4 > 0.7, (name, accuracy)
        assert records[-1]["loss"] < math.log(2) - 0.05, (name, _losses(runs / name))
        last = records[-1]
        assert last["reward_margin"] > 0 and last["chosen_logp"] < 0, last
        assert {"eval_loss", "eval_reward_accuracy", "eval_reward_margin"} <= set(last), last


def test_the_full_fine_tune_reads_a_precomputed_reference_and_lora_needs_none(runs):
    assert "reference: one no-grad pass over 132 pairs" in (runs / "dpo" / "log.txt").read_text()
    cache = list((runs / "cache" / "reference").glob("*.npy"))
    assert len(cache) == 2, cache  # the resumed and chunked runs read dpo's back; rope its own
    resumed = (runs / "dpo_resumed" / "log.txt").read_text()
    assert "reference: precomputed log-probs read from" in resumed
    assert "reference:" not in (runs / "dpo_lora" / "log.txt").read_text()


def test_dpo_resume_is_exact_with_the_reference_cached_or_computed_again(runs):
    assert _losses(runs / "dpo_resumed") == _losses(runs / "dpo")[STEPS // 2 :]
    cold = runs / "dpo_resumed_cold"
    assert "reference: one no-grad pass over 132 pairs" in (cold / "log.txt").read_text()
    assert _losses(cold) == _losses(runs / "dpo")[STEPS // 2 :]


def test_a_changed_rope_scaling_misses_the_reference_cache(runs):
    """Before, the cache key left out model.rope_scaling: this run read dpo's reference and its
    step 1 was not ln 2."""
    log = (runs / "dpo_rope" / "log.txt").read_text()
    assert "reference: one no-grad pass over 132 pairs" in log, log[-2000:]
    assert abs(_losses(runs / "dpo_rope")[0] - math.log(2)) < 1e-6, _losses(runs / "dpo_rope")


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def test_the_reference_cache_key_sees_every_byte_the_config_and_rope(runs, tmp_path, monkeypatch):
    """A byte of the weights between the 16 x 4 KiB the key sampled before, an rms_norm_eps in
    config.json, a rope_scaling: each is another reference (a cache miss). The weights' hashes
    are cached in oomless's cache, nothing is written beside them."""
    from trainer.objectives.reference_key import reference_cache_key

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    base = tmp_path / "base"
    shutil.copytree(runs / "sft" / "final", base)
    job = _preference_job(tmp_path, "job", base, runs / "pairs.jsonl")
    data = SimpleNamespace(fingerprint="f", eval_fingerprint="e")

    def key(*overrides: str) -> str:
        return reference_cache_key(load_config(job, list(overrides)), data, [32, 100])

    listing = sorted(p.name for p in base.iterdir())
    first = key()
    assert key() == first and len(list((tmp_path / "xdg").rglob("*.json"))) >= 2
    assert sorted(p.name for p in base.iterdir()) == listing
    assert key(f"model.rope_scaling={ROPE}") != first
    weights = base / "model.safetensors"
    size = weights.stat().st_size
    assert size > 16 * 4096 * 1.2, size  # the old samples left gaps
    _flip_byte(weights, size // 16 + 4096 + 64)  # in the gap after the second sample
    changed = key()
    assert changed != first
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert key() not in (first, changed)


def test_a_dpo_resume_from_a_changed_base_is_one_line(runs, tmp_path, monkeypatch):
    """The checkpoint keeps its reference's base by content; resuming it after the base's
    weights or config changed in place is exit 2 in one line (before: the reference was
    computed again from the new base, and steps after the resume drifted)."""
    from trainer.checkpoint.checkpointer import check_resumable

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    step_6 = runs / "dpo" / "checkpoints" / "step_6"
    saved = json.loads((step_6 / "trainer_state.json").read_text())
    assert saved["reference"]["files"].keys() >= {"model.safetensors", "config.json"}
    # the run's base and checkpoint, copied, the copy's config naming the copied base
    base, checkpoint = tmp_path / "base", tmp_path / "step_6"
    shutil.copytree(runs / "sft" / "final", base)
    shutil.copytree(step_6, checkpoint)
    saved_config = yaml.safe_load((checkpoint / "config.yaml").read_text())
    saved_config["model"]["name_or_path"] = str(base)
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(saved_config))
    cfg = load_config(_preference_job(tmp_path, "dpo", base, runs / "pairs.jsonl"))
    check_resumable(checkpoint, cfg)  # the same base: resumes
    weights, config = (base / "model.safetensors").read_bytes(), (base / "config.json").read_text()
    for change, says in (("weights", "model.safetensors changed"), ("config", "config.json")):
        if change == "weights":
            _flip_byte(base / "model.safetensors", 30_000)
        else:
            (base / "model.safetensors").write_bytes(weights)
            (base / "config.json").write_text(json.dumps({**json.loads(config), "rope_theta": 5e5}))
        with pytest.raises(ConfigError) as err:
            check_resumable(checkpoint, cfg)
        said = str(err.value)
        assert "\n" not in said and said.startswith("config error: run.resume: checkpoint"), said
        assert says in said and "other settings" not in said, said


def test_an_out_of_memory_halves_the_pairs_per_micro_batch_and_keeps_the_losses(runs):
    records = _records(runs / "dpo_oom")
    assert [r["micro_batch_size"] for r in records] == [16, 16, 8, 8], records
    got, want = [r["loss"] for r in records], _losses(runs / "dpo")[:4]
    assert all(abs(a - b) < 1e-5 for a, b in zip(got, want, strict=True)), (got, want)


def test_chunked_loss_gives_dpo_the_same_losses(runs):
    chunked, plain = _losses(runs / "dpo_chunked"), _losses(runs / "dpo")[:2]
    assert all(abs(a - b) < 1e-5 for a, b in zip(chunked, plain, strict=True)), (chunked, plain)


@pytest.mark.parametrize("name", ["orpo", "simpo"])
def test_orpo_and_simpo_train_without_a_reference(runs, name):
    records = _records(runs / name)
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 0.01, losses
    assert sum(r["reward_accuracy"] for r in records[-4:]) / 4 > 0.6, records[-4:]
    assert "reference:" not in (runs / name / "log.txt").read_text()


def _strict(line: str) -> dict:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_a_pair_whose_prompt_fills_seq_len_is_dropped_and_orpo_stays_finite(runs):
    """Before: exit 0 with `loss nan` on every step and a bare NaN in metrics.jsonl."""
    log = (runs / "orpo_cut" / "log.txt").read_text()
    dropped = [line for line in log.splitlines() if "dropped 1 preference pair" in line]
    assert len(dropped) == 1 and "pairs_cut.jsonl row 16" in dropped[0], log[-3000:]
    records = [_strict(x) for x in (runs / "orpo_cut" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(math.isfinite(r["loss"]) for r in records), records


def test_metrics_are_strict_json_and_orpo_is_finite_on_a_certain_answer(tmp_path, caplog):
    """A NaN or infinite metric is null (said once in the log); ORPO's log odds of an answer
    whose mean log-probability is exactly 0 are large, not infinite."""
    import torch

    from trainer.objectives.preference import PreferenceObjective
    from trainer.observe.metrics import MetricsLog

    metrics = MetricsLog(tmp_path, 2, enabled=True)
    for step, loss in ((1, float("nan")), (2, float("inf"))):
        record = {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": float("nan")}
        metrics.write({**record, "tokens_per_s": 1.0, "reward_margin": 0.0, "reward_accuracy": 0.0})
    records = [_strict(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["loss"], r["grad_norm"]) for r in records] == [(None, None), (None, None)]
    assert sum("not finite" in r.message for r in caplog.records) == 1
    orpo = PreferenceObjective(_config(tmp_path, objective={"type": "orpo"}).objective)
    logp = torch.tensor([0.0, -3.0], requires_grad=True)  # chosen certain, rejected not
    losses, _ = orpo.pair_losses(logp, torch.tensor([2, 2]), None)
    losses.sum().backward()
    assert torch.isfinite(losses).all() and torch.isfinite(logp.grad).all(), (losses, logp.grad)


# ---------------------------------------------------------------------------------------------
# Bad input: one line, naming the key or the row and field


def _config(tmp_path: Path, rows: str = "", **sections):
    data = tmp_path / "pairs.jsonl"
    data.write_text(rows or '{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n')
    job = {
        "data": {"path": str(data), "format": "preference"},
        "objective": {"type": "dpo"},
        "hardware": {"device": "cpu", "devices_per_node": 2},
        "train": {"global_batch_size": 8},
    }
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values} if isinstance(values, dict) else values
    return load_config(write_demo_job(tmp_path / "job.yaml", **job))


@pytest.mark.parametrize(
    ("sections", "says"),
    [
        ({"objective": {"type": "dpo", "beta": 0}}, "objective.beta"),
        ({"data": {"format": "prompt_completion"}}, "objective.type=dpo learns from preference"),
        ({"objective": {"type": "sft"}}, "data.format=preference holds pairs"),
        ({"sequence_parallel": 2}, "preference objectives keep each sequence on one rank"),
    ],
)
def test_a_preference_config_that_cannot_work_is_one_line(tmp_path, sections, says):
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, **sections)
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ('{"prompt": "1+1=", "chosen": "2"}', "row 2 has no 'rejected' field"),
        ('{"prompt": "1+1=", "chosen": " ", "rejected": "3"}', "row 2 field 'chosen' is empty"),
        ('{"prompt": [{"role": "user", "content": "1+1="}], "chosen": "2", "rejected": "3"}',
         "row 2 field 'chosen' is not a non-empty list of messages"),
    ],
)  # fmt: skip
def test_a_bad_pair_names_its_row_and_field(tmp_path, row, says):
    good = '{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n'
    cfg = _config(tmp_path, rows=good + row + "\n")
    with pytest.raises(ConfigError) as err:
        check_rows(cfg.data)
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_chat_pairs_mask_the_prompt_and_train_on_each_answer(tmp_path):
    from trainer.data import build_tokenizer
    from trainer.data.documents import tokenize_source

    rows = [
        {
            "prompt": [{"role": "user", "content": "1+1="}],
            "chosen": [{"role": "assistant", "content": "2"}],
            "rejected": [{"role": "assistant", "content": "3"}],
        }
    ]
    cfg = _config(tmp_path, rows="".join(json.dumps(r) + "\n" for r in rows))
    docs = tokenize_source(
        cfg.data.path, "data.path", cfg.data, build_tokenizer(cfg.model), tmp_path / "cache"
    )
    assert docs.num_docs == 2  # the pair's two halves
    tokenizer = build_tokenizer(cfg.model)
    for i, answer in enumerate("23"):
        ids, targets = docs.doc(i)
        learned, given = tokenizer.decode(ids[targets]), tokenizer.decode(ids[~targets])
        assert answer in learned and "1+1=" in given and "1+1=" not in learned, (learned, given)


def _tokenised(cfg, tmp_path: Path):
    from trainer.data import build_tokenizer
    from trainer.data.documents import tokenize_source

    tokenizer = build_tokenizer(cfg.model)
    return tokenize_source(cfg.data.path, "data.path", cfg.data, tokenizer, tmp_path / "cache")


def test_pairs_whose_answers_are_all_cut_off_are_one_line(tmp_path):
    rows = '{"prompt": "123456789+123456789=", "chosen": "1", "rejected": "2"}\n' * 2
    cfg = _config(tmp_path, rows=rows, data={"seq_len": 8})
    with pytest.raises(ConfigError) as err:
        _tokenised(cfg, tmp_path)
    said = str(err.value)
    assert "data.seq_len=8 cuts off the answers of every pair" in said and "row 1" in said, said
    assert "\n" not in said


@pytest.mark.parametrize(
    "row",
    [
        {"prompt": "", "chosen": "2", "rejected": "3"},
        {"prompt": " ", "chosen": "2", "rejected": "3"},
        {"prompt": [], "chosen": [{"role": "assistant", "content": "2"}],
         "rejected": [{"role": "assistant", "content": "3"}]},
        {"prompt": "", "chosen": [{"role": "assistant", "content": "2"}],
         "rejected": [{"role": "assistant", "content": "3"}]},
    ],
)  # fmt: skip
def test_an_empty_prompt_is_a_pair_of_answers_alone(tmp_path, row):
    """docs/preference.md: only an empty answer is refused (before: "field 'prompt' is empty")."""
    cfg = _config(tmp_path, rows=json.dumps(row) + "\n")
    check_rows(cfg.data)
    docs = _tokenised(cfg, tmp_path)
    assert docs.num_docs == 2 and all(docs.doc(i)[1][1:].any() for i in range(2))

"""Run files under hostile or broken conditions: a symbolic link planted in run.dir is
replaced or refused, never written through; a side file torn by a kill or malformed costs one
warning, never the resume; what a script wants is on stdout and nothing else is.

One pretrained tiny Llama (sharded safetensors, loaded by transformers) trains 6 steps
(checkpoints at 2 and 4); the other runs resume copies of that run dir from step 4 and must
reproduce its losses at steps 5 and 6.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.cli_worker import IN_THIS_PROCESS
from tests.conftest import REPO, TINY_LLAMA, oomless, write_demo_job
from trainer.core.errors import ConfigError
from trainer.core.files import append_line, read_json_object, read_jsonl, write_atomic
from trainer.core.logs import redact

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VICTIM = b"the user's own file: oomless must never write here\n"


def _victim(tmp: Path, name: str = "victim.txt") -> Path:
    path = tmp / name
    path.write_bytes(VICTIM)
    return path


# -- the primitives -----------------------------------------------------------------------------


def test_append_refuses_a_link_and_leaves_its_target_alone(tmp_path):
    victim = _victim(tmp_path)
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(ConfigError) as err:
        append_line(tmp_path / "metrics.jsonl", '{"step": 1}')
    assert "metrics.jsonl" in str(err.value) and "symbolic link" in str(err.value)
    assert "\n" not in str(err.value)
    assert victim.read_bytes() == VICTIM


def test_write_atomic_replaces_a_link_not_its_target(tmp_path):
    victim = _victim(tmp_path)
    (tmp_path / "plan.json").symlink_to(victim)
    write_atomic(tmp_path / "plan.json", "{}\n")
    assert victim.read_bytes() == VICTIM
    assert not (tmp_path / "plan.json").is_symlink()
    assert (tmp_path / "plan.json").read_text() == "{}\n"


def test_a_torn_line_is_dropped_once_and_the_next_append_stays_whole(tmp_path, caplog):
    path = tmp_path / "escalations.jsonl"
    path.write_text('{"step": 3, "from": "single"}\n{"step": 5, "fr')  # killed mid-line
    append_line(path, json.dumps({"step": 7, "from": "ddp"}))
    with caplog.at_level(logging.WARNING):
        records = read_jsonl(path)
    assert records == [{"step": 3, "from": "single"}, {"step": 7, "from": "ddp"}]
    assert caplog.text.count("escalations.jsonl: dropped line 2 (") == 1, caplog.text


@pytest.mark.parametrize("text", ["[1, 2]", '{"wandb": ', "\xff\xfe", ""])
def test_a_malformed_json_object_file_reads_as_empty_with_a_warning(tmp_path, caplog, text):
    path = tmp_path / "trackers.json"
    path.write_bytes(text.encode("latin-1"))
    with caplog.at_level(logging.WARNING):
        assert read_json_object(path) == {}
    assert "trackers.json" in caplog.text


def test_a_side_file_that_is_a_directory_reads_as_none(tmp_path, caplog):
    (tmp_path / "escalations.jsonl").mkdir()
    (tmp_path / "trackers.json").mkdir()
    with caplog.at_level(logging.WARNING):
        assert read_jsonl(tmp_path / "escalations.jsonl") == []
        assert read_json_object(tmp_path / "trackers.json") == {}
    assert "escalations.jsonl: not read" in caplog.text and "trackers.json: not read" in caplog.text


def test_passwords_in_uris_are_redacted():
    line = "at http://alice:s3cret@mlflow.example:5000/api and https://u:p@ss@wandb.example/x"
    assert (
        redact(line)
        == "at http://alice:***@mlflow.example:5000/api and https://u:***@wandb.example/x"
    )
    assert redact("http://host:5000/path and user@host") == "http://host:5000/path and user@host"


# -- oomless report -----------------------------------------------------------------------------


def test_report_replaces_planted_links_and_reads_a_torn_metrics_file(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    records = [
        {"step": s, "loss": 3.0 / s, "strategy": "single", "world_size": 1,
         "micro_batch_size": 2, "grad_accum": 1, "peak_device_bytes": 2**20}
        for s in range(1, 6)
    ]  # fmt: skip
    text = "".join(json.dumps(r) + "\n" for r in records) + '{"step": 6, "lo'
    (run / "metrics.jsonl").write_text(text)
    (run / "plan.json").write_text(json.dumps({"strategy": "single"}))
    victims = {name: _victim(tmp_path, f"victim-{name}") for name in ("loss.png", "memory.png")}
    for name, victim in victims.items():
        (run / name).symlink_to(victim)
    r = oomless("report", str(run), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    for name, victim in victims.items():
        assert victim.read_bytes() == VICTIM
        assert not (run / name).is_symlink()
        assert (run / name).read_bytes()[:8] == PNG_MAGIC
    assert "Traceback" not in r.stderr


_STEP = {"step": 1, "loss": 2.5, "strategy": "single", "world_size": 1, "micro_batch_size": 2,
         "grad_accum": 1, "peak_device_bytes": 2**20}  # fmt: skip
_HOSTILE_RUNS = {  # name: (metrics.jsonl bytes, plan.json bytes or None, the exit code)
    "a list among the steps": (b"[1, 2]\n" + json.dumps(_STEP).encode() + b"\n", None, 0),
    "invalid UTF-8 in a line": (b"\xff\xfe{\n" + json.dumps(_STEP).encode() + b"\n", None, 0),
    "no loss anywhere": (b'{"step": 1}\n{"step": 2, "loss": "high"}\n', None, 2),
    "only a torn line": (b'{"step": 1, "lo', None, 2),
    "an empty file": (b"", None, 2),
    "steps without the plan's fields": (b'{"step": 1, "loss": 2.0}\n', None, 0),
    "a plan whose estimate is a number": (json.dumps(_STEP).encode(), b'{"estimate": 5}', 0),
    "a plan that is a list": (json.dumps(_STEP).encode(), b"[1]", 0),
    "a peak that is text": (json.dumps({**_STEP, "peak_device_bytes": "x"}).encode(), b"{}", 0),
}


@pytest.mark.parametrize("case", sorted(_HOSTILE_RUNS))
def test_report_on_hostile_run_files_is_0_or_one_line_2(tmp_path, case):
    metrics, plan, code = _HOSTILE_RUNS[case]
    (tmp_path / "metrics.jsonl").write_bytes(metrics)
    if plan is not None:
        (tmp_path / "plan.json").write_bytes(plan)
    r = oomless("report", str(tmp_path), timeout=120)
    assert r.returncode == code, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    if code == 2:
        assert len(r.stderr.strip().splitlines()) == 1 and "metrics.jsonl" in r.stderr, r.stderr
    else:
        assert (tmp_path / "loss.png").read_bytes()[:8] == PNG_MAGIC


# -- train and resume ---------------------------------------------------------------------------


def _pretrained(tmp: Path) -> Path:
    """The tiny Llama saved as transformers saves a pretrained model (6 safetensors shards), with
    the demo's tokenizer beside it."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.utils import logging as hf_logging

    params = {k: v for k, v in {**TINY_LLAMA, "vocab_size": 45}.items() if k != "model_type"}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**params), dtype=torch.float32)
    out = tmp / "pretrained"
    hf_logging.disable_progress_bar()
    model.save_pretrained(out, max_shard_size="20KB")
    for f in (REPO / "configs" / "demo" / "tokenizer").iterdir():
        shutil.copy(f, out)
    return out


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """(job, run dir, the CompletedProcess) of a clean 6-step run of a pretrained model."""
    tmp = tmp_path_factory.mktemp("trust")
    job = write_demo_job(
        tmp / "job.yaml",
        train={"steps": 6, "global_batch_size": 8, "micro_batch_size": 4},
        run={"checkpoint_every": 2},
    )
    spec = yaml.safe_load(job.read_text())
    spec["model"] = {"name_or_path": str(_pretrained(tmp))}
    job.write_text(yaml.safe_dump(spec))
    run = tmp / "clean"
    r = oomless("train", str(job), f"run.dir={run}")
    assert r.returncode == 0, r.stderr[-4000:]
    return job, run, r


def _losses(run: Path) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def _copy_at_step_4(clean_run: Path, dest: Path) -> Path:
    """The run dir as a kill after step 4's checkpoint left it (metrics of steps 1..4)."""
    shutil.copytree(clean_run, dest, symlinks=True)
    kept = [line for line in (dest / "metrics.jsonl").read_text().splitlines(keepends=True)
            if json.loads(line)["step"] <= 4]  # fmt: skip
    (dest / "metrics.jsonl").write_text("".join(kept))
    return dest


def _resume(job: Path, run: Path, *overrides: str):
    """The resume of a copy of the clean run, its engine in `oomless train`'s own process (the
    clean run above runs it as a child, as a user's does)."""
    return oomless("train", str(job), f"run.dir={run}", IN_THIS_PROCESS,
                   f"run.resume={run / 'checkpoints' / 'step_4'}", *overrides)  # fmt: skip


@pytest.mark.slow
def test_train_prints_its_last_metrics_line_on_stdout_and_no_progress_bars(clean):
    _, run, r = clean
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["step"] == 6 and last["loss"] == _losses(run)[6]
    assert r.stdout.strip().count("\n") == 0, r.stdout  # nothing else on stdout
    assert "step 6/6 | loss" in r.stderr  # progress is on stderr
    for bar in ("Loading weights", "Loading checkpoint shards", "it/s]", "%|"):
        assert bar not in r.stderr, r.stderr[-3000:]


@pytest.mark.slow
def test_a_torn_side_file_costs_a_warning_and_the_resume_equals_the_clean_run(clean, tmp_path):
    job, clean_run, _ = clean
    run = _copy_at_step_4(clean_run, tmp_path / "run")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 3.')  # killed while writing step 5
    (run / "escalations.jsonl").write_text(
        '{"step": 3, "from": "single", "to": "ddp", "reason": "x"}\n{"step": 5, "from": "si'
    )
    (run / "trackers.json").write_text('{"tensorboard": ')
    r = _resume(job, run, "run.trackers=[tensorboard]")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "Traceback" not in r.stderr
    assert "metrics.jsonl: dropped an incomplete last line" in r.stderr
    assert "escalations.jsonl: dropped an incomplete last line" in r.stderr
    assert "trackers.json: not read" in r.stderr
    resumed, expected = _losses(run), _losses(clean_run)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert resumed[5] == pytest.approx(expected[5], rel=1e-9)
    assert resumed[6] == pytest.approx(expected[6], rel=1e-9)
    assert json.loads((run / "trackers.json").read_text())["num_escalations_sent"] == 1


@pytest.mark.slow
def test_links_planted_in_run_dir_never_write_their_targets(clean, tmp_path):
    job, clean_run, _ = clean
    run = _copy_at_step_4(clean_run, tmp_path / "run")
    rewritten = ("config.yaml", "plan.json", "trackers.json", "oom-report.json", "load_rank0.json")
    victims = {name: _victim(tmp_path, f"victim-{name}") for name in rewritten}
    for name, victim in victims.items():
        (run / name).unlink(missing_ok=True)
        (run / name).symlink_to(victim)
    r = _resume(job, run, "run.trackers=[tensorboard]")
    assert r.returncode == 0, r.stderr[-4000:]
    for name, victim in victims.items():
        assert victim.read_bytes() == VICTIM, name
    for name in ("config.yaml", "plan.json", "trackers.json"):
        assert not (run / name).is_symlink(), name
    assert _losses(run)[6] == pytest.approx(_losses(clean_run)[6], rel=1e-9)

    # an appended file cannot be replaced without losing its lines: one line, exit 2, nothing run
    appended = _victim(tmp_path, "victim-metrics")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(appended)
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    r = _resume(job, run)
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "metrics.jsonl" in r.stderr and "symbolic link" in r.stderr
    assert appended.read_bytes() == VICTIM
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before


# -- whose directory run.dir is -----------------------------------------------------------------


def _train_in(capsys, job: Path, run: Path, *argv: str) -> tuple[int, str]:
    from launcher.cli import main

    flags = [a for a in argv[1:] if a.startswith("--")]
    overrides = [a for a in argv[1:] if not a.startswith("--")]
    settings = [f"run.dir={run}", "train.steps=1", "run.checkpoint_every=0", *overrides]
    code = main([argv[0], str(job), *settings, *flags])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command", [["train"], ["submit"], ["submit", "--k8s"]])
def test_a_run_never_writes_over_the_users_own_files_in_run_dir(
    capsys, tmp_path, monkeypatch, command
):
    """`oomless train exp/config.yaml run.dir=exp` (the job file itself), or a plan.json the
    user saved in run.dir: exit 2, one line naming it, nothing written anywhere."""
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no sbatch, no kubectl
    k8s = ["k8s.image=ghcr.io/acme/oomless:0.1", "k8s.pvc=runs"] if "--k8s" in command else []
    exp = tmp_path / "exp"
    exp.mkdir()
    job = write_demo_job(exp / "config.yaml")
    job.write_text("# the user's comments\n" + job.read_text())
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "plan.json").write_bytes(VICTIM)  # what `oomless plan --json` printed
    for run, named in ((exp, exp / "config.yaml"), (saved, saved / "plan.json")):
        before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
        code, err = _train_in(capsys, job, run, *command, *k8s)
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith("config error: run.dir: ") and f"holds {named}" in err, err
        assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_a_new_empty_or_marked_run_dir_is_a_runs_and_an_old_runs_dir_is_taken(
    capsys, tmp_path, monkeypatch
):
    """`submit --k8s` (no kubectl here: it writes the manifest and stops) marks the run.dir it
    takes; a run dir from before the marker (metrics.jsonl, checkpoints/latest) is taken and
    marked, and so are one that holds a checkpoint copied in to resume from (checkpoints/step_N)
    and one that holds only files no run writes."""
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    job = write_demo_job(tmp_path / "job.yaml")
    k8s = ["--k8s", "k8s.image=ghcr.io/acme/oomless:0.1", "k8s.pvc=runs"]
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (old / "config.yaml").write_text("run: {dir: old}\n")  # that run's own resolved config
    (tmp_path / "empty").mkdir()
    copied = tmp_path / "copied" / "checkpoints" / "step_2"  # a checkpoint copied in to resume
    copied.mkdir(parents=True)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "log.txt").write_bytes(VICTIM)  # no run writes it: left as it is
    taken = (tmp_path / "new", tmp_path / "empty", tmp_path / "new", old, tmp_path / "copied")
    for run in (*taken, tmp_path / "notes"):
        code, err = _train_in(capsys, job, run, "submit", *k8s)
        assert code == 0, err
        assert (run / ".oomless-run").is_file() and (run / "trainjob.yaml").is_file()
    assert (tmp_path / "notes" / "log.txt").read_bytes() == VICTIM


@pytest.mark.parametrize("name", ["hang", "profile", "tensorboard"])
def test_a_linked_directory_the_run_writes_into_is_refused(capsys, tmp_path, name):
    """hang/ (the stacks), profile/ (traces) or a tracker's directory planted as a link out of
    run.dir: exit 2 in one line naming it, before anything is written there."""
    job = write_demo_job(tmp_path / "job.yaml")
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    (run / ".oomless-run").write_text("")
    (run / name).symlink_to(outside, target_is_directory=True)
    code, err = _train_in(capsys, job, run, "train")
    assert code == 2 and err.count("\n") == 1, err
    assert f"{run / name}: is a symbolic link" in err
    assert list(outside.iterdir()) == []


def test_an_input_where_the_run_writes_is_refused(capsys, tmp_path):
    """Data saved as run.dir/metrics.jsonl, a model in run.dir/final: the run would overwrite
    its own input (appending metrics to the data, saving over the model). Exit 2, one line."""
    job = write_demo_job(tmp_path / "job.yaml")
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    shutil.copy(REPO / "configs" / "demo" / "train.jsonl", run / "metrics.jsonl")
    for tokenizer in (REPO / "configs" / "demo" / "tokenizer").iterdir():
        shutil.copy(tokenizer, run / "final")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for override, key in (
        (f"data.path={run / 'metrics.jsonl'}", "data.path"),
        (f"model.tokenizer={run / 'final'}", "model.tokenizer"),
    ):
        code, err = _train_in(capsys, job, run, "train", override)
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"config error: {key}: ") and "which this run writes" in err, err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before

"""Bad input found before launch: `oomless train` exits 2 with one line, and nothing is written
into run.dir."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.cli_worker import IN_THIS_PROCESS
from tests.conftest import REPO, oomless
from tests.test_cli_train import DEMO, metrics

COMMON = ["hardware.device=cpu", "train.eval_every=0", "run.save_final=false"]


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("", "has no usable rows"),
        (
            '{"prompt": "1+1=", "completion": "2"}\n{"prompt": "1+2=", "completion" "3"}\n',
            "row 2 is not a JSON object",
        ),
    ],
    ids=["empty", "malformed"],
)
def test_bad_data_stops_before_anything_is_written(tmp_path, content, expected):
    data = tmp_path / "train.jsonl"
    data.write_text(content)
    run_dir = tmp_path / "run"
    r = oomless("train", str(DEMO), *COMMON, f"data.path={data}", f"run.dir={run_dir}")
    assert r.returncode == 2, r.stderr[-3000:]
    line = _one_line(r.stderr)
    assert line.startswith("config error: data.path:") and expected in line, line
    assert not run_dir.exists()  # no config.yaml, no plan.json: nothing was launched


@pytest.mark.parametrize("where", ["file", "under_file", "proc"])
def test_a_run_dir_that_cannot_be_a_directory_is_one_line(tmp_path, where):
    afile = tmp_path / "afile"
    afile.write_text("x")
    run_dir = {"file": afile, "under_file": afile / "run", "proc": "/proc/oomless-run"}[where]
    r = oomless("train", str(DEMO), *COMMON, "train.steps=1", f"run.dir={run_dir}")
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith(f"config error: run.dir: '{run_dir}' ")
    assert "Traceback" not in r.stderr


def test_a_missing_local_looking_data_path_is_not_sent_to_the_hub(tmp_path):
    """`data/train` beside the job file's existing `data/` dir is a local path that is missing."""
    job = tmp_path / "job.yaml"
    shutil.copy(DEMO, job)
    shutil.copytree(REPO / "configs" / "demo", tmp_path / "demo")
    (tmp_path / "data").mkdir()
    r = oomless("train", str(job), *COMMON, "data.path=data/train", f"run.dir={tmp_path / 'r'}")
    assert r.returncode == 2, r.stderr[-3000:]
    assert _one_line(r.stderr) == (
        f"config error: data.path: '{tmp_path / 'data' / 'train'}' does not exist; "
        "point it at a data file or dir"
    )


def test_a_directory_of_plain_text_with_blank_lines_trains(tmp_path):
    """Every .txt file is one document by default; blank lines are text, never an error."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        body = "\n\n".join(f"{i}{j}+{j}{i}={int(f'{i}{j}') + int(f'{j}{i}')}" for j in range(9))
        (corpus / f"part-{i}.txt").write_text(body + "\n\n\n")
    run_dir = tmp_path / "run"
    r = oomless(
        "train", str(DEMO), *COMMON, f"data.path={corpus}", "data.format=text",
        "data.eval_path=null", "train.steps=2", "train.global_batch_size=4", f"run.dir={run_dir}",
        IN_THIS_PROCESS,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "4 training documents" in r.stderr
    assert [m["step"] for m in metrics(run_dir)] == [1, 2]
    assert json.loads((run_dir / "plan.json").read_text())["strategy"] == "single"

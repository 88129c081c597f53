"""A resume that would change the math is refused before anything is written; one that does not
(a longer run, another cache dir or attention kernel) continues."""

from __future__ import annotations

import shutil

from launcher.cli import main
from tests.cli_worker import IN_THIS_PROCESS
from tests.conftest import oomless
from tests.test_cli_train import DEMO, metrics


def _snapshot(run_dir) -> dict[str, bytes]:
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def _refused(capsys, *args: str) -> str:
    """`oomless ARGS` in this process (a refusal never launches anything): its one stderr line."""
    capsys.readouterr()
    rc = main(list(args))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err[-3000:]
    return err


def test_item4_refused_resume_writes_nothing_and_math_free_changes_resume(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    shutil.copy(DEMO.parent / "demo" / "train.jsonl", data)
    run_dir = tmp_path / "run"
    base = [
        "train",
        str(DEMO),
        f"data.path={data}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "train.eval_every=0",
        "train.steps=2",
        "run.checkpoint_every=1",
        "run.save_final=false",
        f"run.dir={run_dir}",
        "hardware.device=cpu",
    ]
    r = oomless(*base, IN_THIS_PROCESS)  # the engine in the CLI's process: no child's imports
    assert r.returncode == 0, r.stderr[-3000:]
    before = _snapshot(run_dir)
    assert "config.yaml" in before and "plan.json" in before

    # math changes: refused in one line naming the key and both values; run.dir untouched
    err = _refused(capsys, *base, "train.lr=1e-3", "train.seed=3", "strategy=single")
    assert "train.lr: 0.005 -> 0.001" in err and "train.seed: 0 -> 3" in err
    assert _snapshot(run_dir) == before

    original = data.read_text()
    data.write_text(original.replace('"completion": "152"', '"completion": "153"'))
    err = _refused(capsys, *base)
    assert "other data" in err and "data.path" in err
    assert _snapshot(run_dir) == before
    data.write_text(original)

    # what keeps the math may change: the run is extended from its checkpoint
    r = oomless(
        *base,
        "train.steps=3",
        f"data.cache_dir={tmp_path / 'other_cache'}",
        "model.attn_implementation=eager",
        "data.on_bad_row=skip",
        IN_THIS_PROCESS,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_2'}" in r.stderr  # its last step
    assert "train.steps: 2 -> 3" in r.stderr and "model.attn_implementation" in r.stderr
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3]

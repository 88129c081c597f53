"""What `oomless plan --emit ...` prints cannot be turned into more than it says: every string key
of the config schema, in turn, holds a line break, a command substitution and a YAML document
start, and each of the five targets either exits 2 in one line naming the key or prints exactly
its documents (YAML, JSON) and a command that `shlex.split` gives back as the planned argv.
Nothing is written anywhere, the job file included. In-process: about 10 s on 2 cores."""

from __future__ import annotations

import json
import re
import shlex
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from launcher.cli import main
from trainer.core.config import JobConfig, load_config

REPO = Path(__file__).resolve().parents[2]
TARGETS = ("torchrun", "sbatch", "trainjob", "accelerate", "deepspeed")
# two nodes and elastic.min_nodes: the multi-node torchrun command, which names run.dir twice
SHAPE = {
    "hardware": {"device": "cpu", "nodes": 2, "devices_per_node": 2},
    "elastic": {"min_nodes": 1},
    "strategy": "zero2",
    "k8s": {"image": "ghcr.io/acme/oomless:0.1", "pvc": "runs"},
}


def _has_str(annotation: object) -> bool:
    if annotation is str:
        return True
    if typing.get_origin(annotation) is typing.Literal:
        return False
    return any(_has_str(a) for a in typing.get_args(annotation))


def _string_keys(model: type[BaseModel] = JobConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema whose value may be a free string (or a list of them)."""
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        nested = [a for a in (annotation, *typing.get_args(annotation)) if isinstance(a, type)]
        sections = [a for a in nested if issubclass(a, BaseModel)]
        if sections:
            keys += _string_keys(sections[0], f"{prefix}{name}.")
        elif _has_str(annotation):
            keys.append(f"{prefix}{name}")
    return keys


def _job(tmp_path: Path, key: str, value: str) -> Path:
    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    demo["model"]["tokenizer"] = str(REPO / "configs" / "demo" / "tokenizer")
    demo["data"]["path"] = str(REPO / "configs" / "demo" / "train.jsonl")
    demo["data"]["eval_path"] = str(REPO / "configs" / "demo" / "eval.jsonl")
    demo["run"]["dir"] = str(tmp_path / "runs" / "demo")
    for section, values in SHAPE.items():
        demo[section] = {**demo.get(section, {}), **values} if isinstance(values, dict) else values
    *path, last = key.split(".")
    node = demo
    for part in path:
        node = node.setdefault(part, {})
    annotation = _annotation(key)
    alternatives = typing.get_args(annotation) if typing.get_origin(annotation) else ()
    lists = typing.get_origin(annotation) is list or (
        str not in alternatives and any(typing.get_origin(a) is list for a in alternatives)
    )
    node[last] = [value] if lists else value
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(demo))
    return job


def _annotation(key: str) -> object:
    model: type[BaseModel] = JobConfig
    *path, last = key.split(".")
    for part in path:
        annotation = model.model_fields[part].annotation
        model = next(
            a
            for a in (annotation, *typing.get_args(annotation))
            if isinstance(a, type) and issubclass(a, BaseModel)
        )
    return model.model_fields[last].annotation


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _check_target(capsys, target: str, out: str, job: Path) -> None:
    """`out` of `plan JOB --emit target` is exactly what the target should be."""
    if target == "torchrun":
        code, plan, _ = _run(capsys, ["plan", str(job), "--json"])
        planned = json.loads(plan)["command"]
        words = shlex.split(out)
        env = [w for w in words[: -len(planned)] if re.fullmatch(r"[A-Z_]+=.*", w)]
        assert words == env + planned, (words, planned)
    elif target == "sbatch":
        resolved = load_config(str(job))
        run_dir = Path(resolved.run.dir).absolute()
        command = out[out.index("srun ") : out.index("|| rc=$?")].replace("\\\n", " ")
        srun = shlex.split(command)
        inner = shlex.split(srun[srun.index("-c") + 1])
        assert inner[-3:] == ["-m", "trainer", str(run_dir / "config.yaml")], inner
        (cd,) = [ln for ln in out.splitlines() if ln.startswith("cd ")]
        assert shlex.split(cd) == ["cd", str(run_dir)]
        assert sum(ln.startswith("#!") for ln in out.splitlines()) == 1
    elif target == "trainjob":
        docs = list(yaml.safe_load_all(out))
        assert [d["kind"] for d in docs] == ["ConfigMap", "TrainJob"], docs
        assert out.splitlines()[0].startswith("# Written by oomless")
        assert not [ln for ln in out.splitlines()[1:] if ln.startswith("#")]
        pods = yaml.safe_load(docs[0]["data"]["config.yaml"])
        assert pods["run"]["dir"] == "/runs/" + docs[1]["metadata"]["name"]
        assert docs[1]["spec"]["trainer"]["command"][-3:] == [
            "-m",
            "trainer",
            "/config/config.yaml",
        ]
    elif target == "accelerate":
        (doc,) = yaml.safe_load_all(out)
        assert doc["distributed_type"] == "DEEPSPEED" and doc["num_processes"] == 4
    else:
        assert json.loads(out)["zero_optimization"]["stage"] == 2


VALUES = (
    "v\n$(touch PWNED)\n---\nkind: Pod",  # a line break starts a command, a document
    "v $(touch PWNED) `touch PWNED` --- '\"x",  # blanks and quotes: one word, never run
)


@pytest.mark.parametrize("value", VALUES, ids=["line-breaks", "one-line"])
def test_no_string_key_turns_an_emitted_target_into_more(capsys, tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    keys = _string_keys()
    assert {"run.dir", "data.path", "k8s.image", "slurm.partition", "slurm.setup"} <= set(keys)
    emitted = refused = 0
    for key in keys:
        job = _job(tmp_path, key, value)
        written = job.read_bytes()
        for target in TARGETS:
            code, out, err = _run(capsys, ["plan", str(job), "--emit", target])
            assert code in (0, 2), (key, target, code, err)
            if code == 2:
                assert err.count("\n") == 1 and not out, (key, target, err)
                refused += 1
                continue
            _check_target(capsys, target, out, job)
            emitted += 1
        assert job.read_bytes() == written, key
    assert not list(tmp_path.rglob("PWNED*")) and not (tmp_path / "runs").exists()
    print(f"{len(keys)} keys: {emitted} emitted, {refused} refused")
    assert emitted > len(keys) and refused > 0, (emitted, refused)


def test_a_line_break_in_run_dir_is_refused_where_it_would_land_in_text(capsys, tmp_path):
    job = _job(tmp_path, "run.dir", str(tmp_path / "r\n$(touch PWNED)\n---\nkind: Pod"))
    for target in ("torchrun", "sbatch"):
        code, _, err = _run(capsys, ["plan", str(job), "--emit", target])
        assert code == 2 and err.startswith("config error: run.dir: ") and err.count("\n") == 1
    code, _, err = _run(capsys, ["submit", str(job), "--k8s", "--dry-run"])
    assert code == 2 and "run.dir: " in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "pair",
    [
        ("runs/2024-11-01", "runs/2024-11-02"),
        ("runs/Exp_1", "runs/exp-1"),
        ("a/exp", "b/exp"),
        ("runs/" + "x" * 80, "runs/" + "x" * 81),
    ],
)
def test_distinct_run_dirs_get_distinct_trainjobs_and_claim_dirs(capsys, tmp_path, pair):
    seen = []
    for run_dir in pair:
        job = _job(tmp_path, "run.dir", run_dir)
        code, out, err = _run(capsys, ["plan", str(job), "--emit", "trainjob"])
        assert code == 0, err
        config_map, trainjob = yaml.safe_load_all(out)
        name = trainjob["metadata"]["name"]
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 40, name
        seen.append((name, yaml.safe_load(config_map["data"]["config.yaml"])["run"]["dir"]))
    assert seen[0][0] != seen[1][0] and seen[0][1] != seen[1][1], seen
    again = _run(capsys, ["plan", str(job), "--emit", "trainjob"])[1]
    assert list(yaml.safe_load_all(again))[1]["metadata"]["name"] == seen[1][0]  # stable

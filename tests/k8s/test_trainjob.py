"""The TrainJob `oomless plan --emit trainjob` prints and `oomless submit --k8s` writes: valid for
the TrainJob CRD vendored beside this file, sized by the plan, with the config the pods load.
No cluster runs here: what a cluster would do with it is the CRD's schema and the few rules of
kubeflow/trainer's webhook that the schema does not hold (named where they are checked)."""

from __future__ import annotations

import base64
import copy
import functools
import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from launcher.cli import main
from trainer.core.config import load_config
from trainer.core.units import GIB

HERE = Path(__file__).parent
REPO = HERE.parents[1]
LLAMA_8B = str(REPO / "configs" / "models" / "llama-3.1-8b.yaml")
DEMO = str(REPO / "configs" / "demo.yaml")
TWO_NODES_OF_8 = [
    "hardware.nodes=2",
    "hardware.devices_per_node=8",
    "hardware.device=cuda",
    "hardware.device_memory=80GiB",
    "hardware.host_memory=1TiB",
]
K8S = ["k8s.image=ghcr.io/acme/oomless:0.1", "k8s.pvc=training-runs"]
CPU_2 = ["hardware.device=cpu", "hardware.devices_per_node=2", "strategy=ddp"]


@functools.cache
def _crd() -> dict[str, Any]:
    return yaml.safe_load((HERE / "trainer.kubeflow.org_trainjobs.yaml").read_text())


def _strict(schema: Any) -> Any:
    """The CRD's schema without its `x-kubernetes-*` keys, an unknown field refused where the
    schema lists the fields (kubectl apply's default, --validate=strict, refuses one too)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if "properties" in schema and "additionalProperties" not in schema:
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


@functools.cache
def _validator() -> jsonschema.Draft7Validator:
    (version,) = [v for v in _crd()["spec"]["versions"] if v["name"] == "v1alpha1"]
    return jsonschema.Draft7Validator(_strict(copy.deepcopy(version["schema"]["openAPIV3Schema"])))


def _errors(trainjob: dict) -> list[str]:
    """Every way `trainjob` breaks the CRD: its schema, and its own rules on metadata.name (CEL
    `matches` and `size`, read from the CRD and checked here)."""
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in _validator().iter_errors(trainjob)]
    (version,) = _crd()["spec"]["versions"]
    root_rules = version["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    name = trainjob["metadata"]["name"]
    for rule in (r["rule"] for r in root_rules):
        if m := re.fullmatch(r"self\.metadata\.name\.matches\('(.+)'\)", rule):
            ok = re.search(m.group(1), name) is not None
        elif m := re.fullmatch(r"size\(self\.metadata\.name\) <= (\d+)", rule):
            ok = len(name) <= int(m.group(1))
        else:
            raise AssertionError(f"a rule this test does not read: {rule}")
        errors += [] if ok else [f"metadata.name {name!r} breaks {rule}"]
    return errors


def test_the_validator_refuses_what_a_cluster_would():
    good = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": "ok"},
        "spec": {"runtimeRef": {"name": "torch-distributed"}, "trainer": {"numNodes": 2}},
    }
    assert _errors(good) == []
    bad = copy.deepcopy(good)
    bad["metadata"]["name"] = "Not_A_Label"
    bad["spec"]["trainer"]["numNodes"] = -1
    bad["spec"]["trainer"]["numProcPerNodes"] = 8  # a misspelt field
    bad["spec"]["trainer"]["resourcesPerNode"] = {"limits": {"memory": "lots"}}
    found = " | ".join(_errors(bad))
    for words in ("numNodes", "numProcPerNodes", "'lots' does not match", "Not_A_Label"):
        assert words in found, found


def _emit(capsys, *argv: str) -> tuple[dict, dict]:
    """(ConfigMap, TrainJob) of `oomless plan ARGV --emit trainjob`."""
    assert main(["plan", *argv, "--emit", "trainjob"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.startswith("# Written by oomless")
    config_map, trainjob = yaml.safe_load_all(out)
    return config_map, trainjob


def _named(trainjob: dict, run_dir: Path, readable: str) -> str:
    """The TrainJob's name: `readable` (run.dir's last part as a label) and 8 base-32 characters
    of the resolved run.dir's SHA-256 (distinct run dirs, distinct jobs and claim dirs)."""
    sha = hashlib.sha256(str(run_dir.resolve()).encode()).digest()
    digest = base64.b32encode(sha).decode().lower()[:8]
    assert trainjob["metadata"]["name"] == f"{readable}-{digest}"
    return f"{readable}-{digest}"


def _plan(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama_8b_on_two_nodes_of_8_gpus_validates_and_is_sized_by_the_plan(capsys, tmp_path):
    argv = [LLAMA_8B, *TWO_NODES_OF_8, *K8S, f"run.dir={tmp_path / 'llama_8B sft'}"]
    config_map, trainjob = _emit(capsys, *argv, "k8s.queue=team-a", "k8s.namespace=ml")
    plan = _plan(capsys, *argv)

    assert _errors(trainjob) == []
    name = _named(trainjob, tmp_path / "llama_8B sft", "llama-8b-sft")
    assert trainjob["metadata"] == {
        "name": name,
        "namespace": "ml",
        "labels": {"kueue.x-k8s.io/queue-name": "team-a"},
    }
    assert config_map["metadata"] == {"name": f"{name}-config", "namespace": "ml"}
    spec = trainjob["spec"]
    assert spec["runtimeRef"] == {"name": "torch-distributed"}
    trainer = spec["trainer"]
    assert (plan["nodes"], plan["devices_per_node"]) == (2, 8)
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 8)
    assert trainer["image"] == "ghcr.io/acme/oomless:0.1"
    resources = trainer["resourcesPerNode"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 8
    # host memory: the plan's estimate per node and memory.headroom (0.1), in whole GiB
    wanted = math.ceil(plan["estimate"]["host"]["total_bytes"] * 1.1 / GIB)
    assert resources["limits"]["memory"] == resources["requests"]["memory"] == f"{wanted}Gi"
    # the host estimate (loading the weights, 16 ranks' processes), within a node's 1 TiB
    assert 16 < wanted <= 1024
    # the ranks' caching allocator runs with expandable segments (validated by the CRD above)
    assert trainer["env"] == [
        {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"}
    ]


def test_a_cpu_job_asks_for_no_gpus_and_a_rank_per_process(capsys, tmp_path):
    config_map, trainjob = _emit(capsys, DEMO, *CPU_2, *K8S, f"run.dir={tmp_path / 'demo'}")
    assert _errors(trainjob) == []
    trainer = trainjob["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (1, 2)
    resources = trainer["resourcesPerNode"]
    assert resources == {
        "requests": {"cpu": 2, "memory": "16Gi"},  # the floor: the demo's estimate is tiny
        "limits": {"memory": "16Gi"},
    }
    assert "labels" not in trainjob["metadata"] and "namespace" not in trainjob["metadata"]
    assert "env" not in trainer  # no CUDA allocator to configure


def _volume_of(trainjob: dict, mount_path: str) -> dict:
    """The pod volume mounted at `mount_path` in the runtime's trainer container."""
    (patch,) = trainjob["spec"]["runtimePatches"]
    (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = job["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == mount_path]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume


def test_the_pods_run_torchrun_on_the_config_map_s_config_which_trainer_loads(capsys, tmp_path):
    argv = [DEMO, *CPU_2, *K8S, f"run.dir={tmp_path / 'demo'}", "dist.max_restarts=2"]
    config_map, trainjob = _emit(capsys, *argv)
    command = trainjob["spec"]["trainer"]["command"]
    # torchrun: nodes, ranks per node, node rank and head node come from the runtime's PET_* env
    assert command == [
        "python", "-m", "torch.distributed.run", "--max_restarts", "2",
        "-m", "trainer", "/config/config.yaml",
    ]  # fmt: skip
    assert _volume_of(trainjob, "/config") == {
        "name": "config",
        "configMap": {"name": config_map["metadata"]["name"]},
    }
    assert _volume_of(trainjob, "/runs")["persistentVolumeClaim"] == {"claimName": "training-runs"}
    assert _volume_of(trainjob, "/dev/shm")["emptyDir"] == {"medium": "Memory"}

    path = tmp_path / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"])
    pods = load_config(str(path))  # what `python -m trainer /config/config.yaml` loads first
    plan = _plan(capsys, *argv)
    name = _named(trainjob, tmp_path / "demo", "demo")
    assert pods.run.dir == f"/runs/{name}" and pods.run.resume == "auto"
    assert pods.strategy == plan["strategy"] == "ddp"
    assert pods.train.micro_batch_size == plan["micro_batch_size"]
    assert (pods.hardware.nodes, pods.hardware.devices_per_node) == (1, 2)
    assert pods.k8s.pvc == "training-runs"


def test_the_volumes_go_to_the_runtime_s_own_job_and_container():
    """kubeflow/trainer's webhook (pkg/runtime/framework/plugins/jobset/jobset.go) refuses a patch
    of a job or container the runtime lacks, and a manager that is not a domain-prefixed path."""
    from launcher.k8s.trainjob import NODE, PATCH_MANAGER

    runtime = yaml.safe_load((HERE / "torch_distributed.yaml").read_text())
    assert runtime["metadata"]["name"] == "torch-distributed"
    (job,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    containers = job["template"]["spec"]["template"]["spec"]["containers"]
    assert job["name"] == NODE and [c["name"] for c in containers] == [NODE]
    label = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
    assert re.fullmatch(rf"{label}(\.{label})*/[A-Za-z0-9/._~-]+", PATCH_MANAGER)


def test_submit_dry_run_prints_the_manifest_and_writes_nothing(capsys, tmp_path):
    run = tmp_path / "run"
    code = main(["submit", DEMO, *CPU_2, *K8S, f"run.dir={run}", "--k8s", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"kubectl apply -f {run / 'trainjob.yaml'}" in out.splitlines()[0]
    _, trainjob = yaml.safe_load_all(out)
    assert trainjob["kind"] == "TrainJob" and _errors(trainjob) == []
    assert not run.exists()


def _fake_kubectl(bin_dir: Path, record: Path, code: int = 0) -> None:
    bin_dir.mkdir()
    script = bin_dir / "kubectl"
    answer = "echo 'trainjob.trainer.kubeflow.org/run created'" if code == 0 else ""
    script.write_text(
        "#!/bin/sh\n"
        f"printf '%s\\n' \"$@\" > '{record}'\n"
        f"{answer}\n"
        f"[ {code} = 0 ] || {{ echo 'error: no context is set' >&2; echo 'try again' >&2; }}\n"
        f"exit {code}\n"
    )
    script.chmod(0o755)


def test_submit_without_kubectl_writes_the_file_and_says_how_to_apply_it(
    capsys, tmp_path, monkeypatch
):
    run = tmp_path / "run"
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main(["submit", DEMO, *CPU_2, *K8S, f"run.dir={run}", "--k8s"]) == 0
    path = run / "trainjob.yaml"
    out = capsys.readouterr().out
    assert out == f"wrote {path}; kubectl is not on PATH: apply it with: kubectl apply -f {path}\n"
    assert sorted(p.name for p in run.iterdir()) == [".oomless-run", "trainjob.yaml"]
    _, trainjob = yaml.safe_load_all(path.read_text())
    assert _errors(trainjob) == [] and trainjob["spec"]["trainer"]["numProcPerNode"] == 2


def test_submit_runs_kubectl_apply_on_the_file(capsys, tmp_path, monkeypatch):
    run, record = tmp_path / "run", tmp_path / "argv.txt"
    _fake_kubectl(tmp_path / "bin", record)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert main(["submit", DEMO, *CPU_2, *K8S, f"run.dir={run}", "--k8s"]) == 0
    assert record.read_text().splitlines() == ["apply", "-f", str(run / "trainjob.yaml")]
    assert capsys.readouterr().out == "trainjob.trainer.kubeflow.org/run created\n"


def test_a_failed_kubectl_apply_is_one_line_with_its_exit_code(capsys, tmp_path, monkeypatch):
    run = tmp_path / "run"
    _fake_kubectl(tmp_path / "bin", tmp_path / "argv.txt", code=1)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert main(["submit", DEMO, *CPU_2, *K8S, f"run.dir={run}", "--k8s"]) == 1
    err = capsys.readouterr().err.strip()
    path = run / "trainjob.yaml"
    assert (
        err == f"oomless submit: kubectl apply -f {path} failed: error: no context is set try again"
    )
    assert path.is_file()  # kept, to apply again by hand


@pytest.mark.parametrize(
    "run_dir, name",
    [("runs/My_Run.v2", "my-run-v2"), ("runs/2024-sft", "sft"), ("runs/___", "oomless")],
)
def test_the_job_name_is_run_dir_s_name_as_the_crd_allows(capsys, tmp_path, run_dir, name):
    _, trainjob = _emit(capsys, DEMO, *CPU_2, *K8S, f"run.dir={tmp_path / run_dir}")
    _named(trainjob, tmp_path / run_dir, name)
    assert _errors(trainjob) == []


def test_a_long_run_dir_name_is_cut_to_a_label_the_pods_host_names_can_hold(capsys, tmp_path):
    _, trainjob = _emit(capsys, DEMO, *CPU_2, *K8S, f"run.dir={tmp_path / ('x' * 80)}")
    _named(trainjob, tmp_path / ("x" * 80), "x" * 31)  # 40 characters with its digest
    assert _errors(trainjob) == []


def test_the_manifest_in_the_docs_is_what_the_code_writes(capsys, tmp_path, monkeypatch):
    """docs/kubernetes.md shows the TrainJob of its example command as it is written now."""
    monkeypatch.chdir(tmp_path)
    argv = [LLAMA_8B, *TWO_NODES_OF_8, *K8S, "k8s.queue=team-a", "run.dir=runs/llama-8b-sft"]
    _, trainjob = _emit(capsys, *argv)
    page = (REPO / "docs" / "kubernetes.md").read_text()
    # the name's digest is of the resolved run.dir, which the page cannot know: its own stands
    name = _named(trainjob, tmp_path / "runs" / "llama-8b-sft", "llama-8b-sft")
    (shown,) = set(re.findall(r"llama-8b-sft-[a-z2-7]{8}", page))
    text = yaml.safe_dump(trainjob).replace(name, shown)
    shown_docs = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", page, re.S)]
    assert yaml.safe_load(text) in shown_docs


def test_memory_is_capped_at_the_node_s_host_memory_and_floored_at_16_gib():
    """A plan whose estimate and headroom pass a node's memory asks for the node, not more: a
    request no node can hold would pend for ever."""
    from launcher.k8s.trainjob import resources_per_node

    cfg = load_config(DEMO, [*TWO_NODES_OF_8, "hardware.host_memory=100GiB", *K8S])
    needs = {"estimate": {"host": {"total_bytes": 95 * GIB}}}  # x 1.1 headroom: 104.5 GiB
    assert resources_per_node(cfg, needs)["limits"] == {"memory": "100Gi", "nvidia.com/gpu": 8}
    small = {"estimate": {"host": {"total_bytes": GIB}}}
    assert resources_per_node(cfg, small)["requests"]["memory"] == "16Gi"

"""The Kubeflow Trainer v2 TrainJob for a resolved config and its plan (pure: no cluster).

Two YAML documents in one file: a ConfigMap that holds the resolved config, and the TrainJob on the
`torch-distributed` runtime. The runtime runs the container's command once per node and gives it
`PET_NNODES`, `PET_NPROC_PER_NODE`, `PET_NODE_RANK`, `PET_MASTER_ADDR` and `PET_MASTER_PORT`
(kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go); torchrun reads its options of the
same names from them, so the command is torchrun with none of those options, and torchrun starts
`python -m trainer /config/config.yaml` on each of the node's ranks, as under Slurm.

Sizes come from the plan: `numNodes`, `numProcPerNode`, `nvidia.com/gpu` = devices per node (none
on CPU), memory = the plan's host estimate per node with `memory.headroom` (at least 16 GiB, at
most `hardware.host_memory`). run.dir lives on the PersistentVolumeClaim `k8s.pvc`, mounted at
/runs (run.dir in the pod: /runs/<the job's name>); /dev/shm is a memory-backed volume (a pod's
default is 64 MiB, too small for NCCL and data loaders). The volumes travel as a `runtimePatches`
entry, the TrainJob API's way to add volumes to the runtime's `node` container.

The name is run.dir's last part as a Kubernetes name and 8 base-32 characters of the resolved
run.dir's SHA-256: two run dirs never share a TrainJob or a directory on the claim (`runs/a/exp` and
`runs/b/exp`, `runs/Exp_1` and `runs/exp-1`, `runs/2024-11-01` and `runs/2024-11-02`), and the
same run.dir always names the same job, which `run.resume: auto` continues. Both documents are
written by the YAML library; the one line of text around them, the first comment, refuses a
control character in the path it names (it could start a document of its own).
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from launcher.run.launch import allocator_env, refuse_control_chars
from launcher.slurm.submit import MIN_MEM_BYTES, host_bytes_needed
from trainer.core.config import ConfigError, JobConfig, dump_config
from trainer.core.files import absolute_path
from trainer.core.units import GIB, parse_size

API_VERSION = "trainer.kubeflow.org/v1alpha1"
RUNTIME = "torch-distributed"
NODE = "node"  # the runtime's replicated job and its trainer container
PATCH_MANAGER = "oomless/trainjob"  # the webhook wants a domain-prefixed path
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
RUNS_MOUNT = "/runs"
CONFIG_MOUNT = "/config"
CONFIG_KEY = "config.yaml"
MANIFEST_FILE = "trainjob.yaml"
# RFC 1035 label (the CRD's rule for metadata.name); short enough that the pods' host names,
# `<name>-node-<job>-<index>`, stay within a 63-character label too
MAX_NAME_CHARS = 40


DIGEST_CHARS = 8


def job_name(run_dir: str) -> str:
    """The TrainJob's name, a lowercase RFC 1035 label: run.dir's last part (or 'oomless'), then
    8 base-32 characters of the resolved run.dir's SHA-256: distinct run dirs, distinct names."""
    resolved = absolute_path(run_dir)
    sha = hashlib.sha256(resolved.encode()).digest()
    digest = base64.b32encode(sha).decode().lower()[:DIGEST_CHARS]  # 40 bits
    name = re.sub(r"[^a-z0-9]+", "-", Path(resolved).name.lower())
    name = name.lstrip("-0123456789")[: MAX_NAME_CHARS - DIGEST_CHARS - 1].rstrip("-")
    return f"{name or 'oomless'}-{digest}"


def check_k8s(cfg: JobConfig, what: str) -> None:
    """The keys a TrainJob cannot go without (their values were checked when loaded)."""
    if cfg.k8s.image is None:
        raise ConfigError(
            "k8s.image",
            f"is not set; {what} needs the image every node runs",
            "set k8s.image=REGISTRY/IMAGE:TAG, an image with oomless installed",
        )
    if cfg.k8s.pvc is None:
        raise ConfigError(
            "k8s.pvc",
            f"is not set; {what} keeps run.dir (checkpoints, metrics) on a PersistentVolumeClaim",
            "set k8s.pvc=NAME, a claim every node can mount (ReadWriteMany for several nodes)",
        )


def pod_config(cfg: JobConfig) -> JobConfig:
    """The resolved config as the pods read it: run.dir on the claim, resumed when restarted."""
    run = cfg.run.model_copy(
        update={"dir": f"{RUNS_MOUNT}/{job_name(cfg.run.dir)}", "resume": "auto"}
    )
    return cfg.model_copy(update={"run": run})


def render_trainjob(cfg: JobConfig, plan_json: dict[str, Any], where: str = MANIFEST_FILE) -> str:
    """The ConfigMap and the TrainJob for a resolved config and its plan (docs/interface.md plan
    JSON), as one YAML file; `where` names the file in its first comment line."""
    check_k8s(cfg, "a TrainJob")
    refuse_control_chars({"run.dir": where}, "the manifest's first comment")
    name = job_name(cfg.run.dir)
    metadata: dict[str, Any] = {"name": name}
    if cfg.k8s.namespace:
        metadata["namespace"] = cfg.k8s.namespace
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**metadata, "name": f"{name}-config"},
        "data": {CONFIG_KEY: dump_config(pod_config(cfg))},
    }
    if cfg.k8s.queue:
        metadata["labels"] = {QUEUE_LABEL: cfg.k8s.queue}
    hw = cfg.hardware
    trainjob = {
        "apiVersion": API_VERSION,
        "kind": "TrainJob",
        "metadata": metadata,
        "spec": {
            "runtimeRef": {"name": RUNTIME},
            "trainer": {
                "image": cfg.k8s.image,
                "command": _command(cfg),
                "numNodes": hw.nodes,
                "numProcPerNode": hw.devices_per_node or 1,
                "resourcesPerNode": resources_per_node(cfg, plan_json),
                **_env(cfg),
            },
            "runtimePatches": [_volumes_patch(cfg.k8s.pvc, f"{name}-config")],
        },
    }
    header = (
        f"# Written by oomless from the plan ({plan_json.get('strategy')}, "
        f"{plan_json.get('world_size')} ranks); apply with: kubectl apply -f {shlex.quote(where)}\n"
    )
    docs = [yaml.dump(doc, Dumper=_BlockDumper, sort_keys=False) for doc in (config_map, trainjob)]
    return header + "---\n".join(docs)


class _BlockDumper(yaml.SafeDumper):
    """yaml.safe_dump's dumper, with a text of several lines (the config) as a `|` block."""


def _block_text(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_BlockDumper.add_representer(str, _block_text)


def _env(cfg: JobConfig) -> dict[str, Any]:
    """The ranks' environment: the allocator's configuration on CUDA (launcher/run/launch.py
    `allocator_env`; the submitting shell's own setting does not reach the pods)."""
    env = allocator_env(cfg, environ={})
    return {"env": [{"name": k, "value": v} for k, v in env.items()]} if env else {}


def _command(cfg: JobConfig) -> list[str]:
    """torchrun on each node: nodes, ranks per node, node rank and head node come from PET_*."""
    return [
        "python",
        "-m",
        "torch.distributed.run",
        "--max_restarts",
        str(cfg.dist.max_restarts),
        "-m",
        "trainer",
        f"{CONFIG_MOUNT}/{CONFIG_KEY}",
    ]


def resources_per_node(cfg: JobConfig, plan_json: dict[str, Any]) -> dict[str, Any]:
    """Requests and limits of one node's pod: GPUs as the plan has them, memory as it needs,
    a core per rank (requested, not limited: a limit would throttle the data loaders)."""
    hw = cfg.hardware
    per_node = hw.devices_per_node or 1
    mem_bytes = max(MIN_MEM_BYTES, host_bytes_needed(cfg, plan_json))
    if hw.host_memory is not None:
        mem_bytes = min(mem_bytes, parse_size(hw.host_memory))
    memory = f"{math.ceil(mem_bytes / GIB)}Gi"
    limits: dict[str, Any] = {"memory": memory}
    if hw.device != "cpu":
        limits["nvidia.com/gpu"] = per_node
    return {"requests": {"cpu": per_node, **limits}, "limits": limits}


def _volumes_patch(pvc: str, config_map: str) -> dict[str, Any]:
    """The runtime's `node` container with run.dir's claim, the config and a roomy /dev/shm."""
    volumes = [
        {"name": "runs", "persistentVolumeClaim": {"claimName": pvc}},
        {"name": "config", "configMap": {"name": config_map}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts = [
        {"name": "runs", "mountPath": RUNS_MOUNT},
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    pod_spec = {"volumes": volumes, "containers": [{"name": NODE, "volumeMounts": mounts}]}
    job = {"name": NODE, "template": {"spec": {"template": {"spec": pod_spec}}}}
    return {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [job]}}},
    }

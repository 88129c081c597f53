"""The sbatch script `oomless submit` writes: sized by the plan, node rank read on each node."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.conftest import REPO, oomless

DEMO = REPO / "configs" / "demo.yaml"


def _submit_dry_run(*overrides: str) -> subprocess.CompletedProcess:
    return oomless("submit", str(DEMO), *overrides, "--dry-run", timeout=120)


def test_two_gpu_nodes(tmp_path):
    r = _submit_dry_run(
        f"run.dir={tmp_path / 'run'}",
        "hardware.device=cuda",
        "hardware.nodes=2",
        "hardware.devices_per_node=4",
        "hardware.device_memory=80GiB",
        "hardware.host_memory=512GiB",
        "strategy=fsdp",
        "slurm.account=proj1",
        "slurm.time=02:00:00",
        "slurm.grace_s=300",
        "slurm.extra=[--exclusive]",
        "slurm.setup=[module load cuda/12.4]",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    script = r.stdout
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --account=proj1",
        "#SBATCH --time=02:00:00",
        "#SBATCH --signal=USR1@300",
        "#SBATCH --requeue",
        "#SBATCH --exclusive",
        "module load cuda/12.4",
        "--nproc_per_node 4",
    ):
        assert line in script, line
    assert f"#SBATCH --output={tmp_path / 'run'}/slurm-%j.out" in script
    # $SLURM_NODEID must reach each node unexpanded: it sits inside the single-quoted command.
    srun = script[script.index("srun ") :]
    assert srun.index("'") < srun.index('"$SLURM_NODEID"') < srun.rindex("'")
    assert "head -n1" in script and '--master_addr "$OOMLESS_HEAD_NODE"' in script
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_cpu_nodes_request_no_gpus_and_enough_memory(tmp_path):
    r = _submit_dry_run(
        f"run.dir={tmp_path / 'run'}",
        "hardware.device=cpu",
        "hardware.nodes=2",
        "hardware.devices_per_node=1",
        "strategy=ddp",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--gpus-per-node" not in r.stdout
    mem = next(x for x in r.stdout.splitlines() if x.startswith("#SBATCH --mem="))
    assert int(mem.removeprefix("#SBATCH --mem=").removesuffix("G")) >= 16


def _sbatch_args(line: str) -> list[str]:
    """The arguments sbatch reads from an `#SBATCH` line (its own rule: blanks split, `"` and `'`
    quote, `\\` escapes, an unquoted `#` ends the line)."""
    args, arg, quote, escaped, started = [], "", "", False, False
    for ch in line.removeprefix("#SBATCH"):
        if escaped:
            arg, escaped, started = arg + ch, False, True
        elif ch == "\\":
            escaped = True
        elif quote:
            if ch == quote:
                quote = ""
            else:
                arg += ch
        elif ch in "\"'":
            quote, started = ch, True
        elif ch == "#":
            break
        elif ch.isspace():
            if started:
                args.append(arg)
            arg, started = "", False
        else:
            arg, started = arg + ch, True
    return [*args, arg] if started else args


def test_the_sbatch_script_quotes_every_value(tmp_path):
    from launcher.slurm.submit import render_sbatch
    from trainer.core.config import load_config

    run_dir = tmp_path / "my runs" / 'it\'s "odd" $(touch PWNED) `touch PWNED2` 100%'
    run_dir.mkdir(parents=True)
    stubs = tmp_path / "stub bin"
    stubs.mkdir()
    record = tmp_path / "record"
    for name, body in (
        ("srun", 'while [[ "$1" == --* ]]; do shift; done\nexec "$@"'),
        ("scontrol", "echo node1"),
        ("python", f"pwd > {record}\nprintf '%s\\n' \"$@\" >> {record}"),
    ):
        (stubs / name).write_text(f"#!/bin/bash\n{body}\n")
        (stubs / name).chmod(0o755)
    cfg = load_config(DEMO, ["hardware.device=cpu", "hardware.devices_per_node=1"])
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"dir": str(run_dir)})})
    script = render_sbatch(cfg, {}, run_dir, str(stubs / "python"))
    (tmp_path / "submit.sbatch").write_text(script)

    env = {
        "PATH": f"{stubs}:/usr/bin:/bin",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_CPUS_PER_TASK": "8",
    }
    r = subprocess.run(
        ["bash", str(tmp_path / "submit.sbatch")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    lines = record.read_text().splitlines()
    assert lines[0] == str(run_dir)  # `cd` got exactly one argument: the run dir
    assert lines[1:3] == ["-m", "torch.distributed.run"]
    assert lines[-3:] == ["-m", "trainer", str(run_dir / "config.yaml")]
    assert not list(tmp_path.rglob("PWNED*")), "a value in the script ran as a command"
    # sbatch reads each #SBATCH line back as one argument with the exact path and name
    header = {ln.split("=")[0]: ln for ln in script.splitlines() if ln.startswith("#SBATCH --")}
    out = str(run_dir).replace("%", "%%") + "/slurm-%j.out"
    assert _sbatch_args(header["#SBATCH --output"]) == [f"--output={out}"]
    assert _sbatch_args(header["#SBATCH --job-name"]) == [f"--job-name={run_dir.name}"]


def test_line_breaks_in_slurm_values_exit_2(tmp_path):
    for override in (
        'slurm.partition="gpu\\nrm -rf ~"',
        'slurm.account="a\\u0000b"',
        'slurm.extra=["--exclusive\\necho pwned"]',
        'slurm.setup=["module load x\\rrm -rf ~"]',
    ):
        r = _submit_dry_run(f"run.dir={tmp_path / 'run'}", override)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (override, r.stderr)
        assert "slurm." in r.stderr and "line break" in r.stderr, r.stderr


SINFO = """\
a1|64|515000|gpu:h100:8(S:0-1)|gpu*
a2|64|515000+|gpu:h100:8(S:0-1)|gpu*
a3|32|257000|gpu:4,gpu:a100:2|gpu*
c1|2|24105|(null)|cpu
c2|2|24105|(null)|cpu
"""


def test_sinfo_is_read_per_partition_smallest_node_first():
    from launcher.slurm.nodes import parse_sinfo

    gpu = parse_sinfo(SINFO, None)  # the default partition
    assert (gpu.partition, gpu.num_nodes, gpu.cpus, gpu.gpus) == ("gpu", 3, 32, 6)
    assert gpu.memory_bytes == 257000 * 2**20
    cpu = parse_sinfo(SINFO, "cpu")
    assert (cpu.num_nodes, cpu.cpus, cpu.memory_bytes, cpu.gpus) == (2, 2, 24105 * 2**20, 0)
    assert parse_sinfo(SINFO, "nope") is None


def test_requests_fit_the_nodes_or_exit_3_naming_what_is_missing():
    """--cpus-per-task and --mem at most what a node has; host memory, GPUs or nodes that the
    partition cannot give are NoFitError (exit 3), one line each."""
    from launcher.plan.planner import NoFitError
    from launcher.slurm.nodes import parse_sinfo, size_request

    cpu = parse_sinfo(SINFO, "cpu")
    sized = size_request(cpu, 2, 0, 1, 2**30, cpus_wanted=8, min_mem_bytes=16 * 2**30)
    assert sized.cpus_per_task == 2 and sized.mem_bytes == 16 * 2**30
    capped = size_request(cpu, 2, 0, 1, 23 * 2**30 + 1, cpus_wanted=8, min_mem_bytes=0)
    assert capped.mem_bytes == 24105 * 2**20  # 24 GiB, whole, would not fit: the node's memory
    cases = [
        ((cpu, 2, 0, 1, 30 * 2**30), "needs 30.0 GiB host memory per node and partition cpu's "
         "nodes have 23.5 GiB"),
        ((cpu, 3, 0, 1, 2**30), "needs 3 nodes and partition cpu has 2"),
        ((parse_sinfo(SINFO, "gpu"), 1, 8, 8, 2**30), "needs 8 GPUs per node and partition "
         "gpu's nodes have 6"),
    ]  # fmt: skip
    for args, message in cases:
        with pytest.raises(NoFitError, match=re.escape(message)):
            size_request(*args, cpus_wanted=8, min_mem_bytes=0)

"""The `stream` rung's refusals: what it does not take is one line naming the rungs that do.
(Its parity with `single` is in tests/trainer/test_distributed.py's shared runs.)"""

from __future__ import annotations

import pytest

from tests.conftest import TINY_LLAMA, oomless, write_demo_job
from trainer.core.config import ConfigError, load_config


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["finetune.method=qlora", "precision=bf16"], "stream cannot run qlora"),
        (["train.optimizer=adamw_8bit"], "stream cannot run adamw_8bit"),
        (["train.optimizer_in_backward=true", "train.global_batch_size=8",
          "train.micro_batch_size=8", "train.grad_clip=0"],
         "stream cannot run optimizer_in_backward"),
    ],
)  # fmt: skip
def test_what_stream_does_not_take_is_one_line_naming_the_rungs_that_do(tmp_path, overrides, words):
    job = write_demo_job(tmp_path / "job.yaml", model={"config": {**TINY_LLAMA, "vocab_size": 45}})
    with pytest.raises(ConfigError) as err:
        load_config(job, ["strategy=stream", *overrides])
    line = str(err.value)
    assert "\n" not in line and line.startswith("config error: strategy:"), line
    assert words in line and "use one of single" in line, line


def test_lora_on_stream_exits_2_in_one_line(tmp_path):
    job = write_demo_job(tmp_path / "job.yaml")
    r = oomless("config", str(job), "strategy=stream", "finetune.method=lora")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "stream cannot run lora" in r.stderr and "use one of single" in r.stderr, r.stderr

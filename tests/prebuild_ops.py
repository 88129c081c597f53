"""Build DeepSpeed's CPU ops in the background while the suite's first tests run:
`python tests/prebuild_ops.py STAGE_FILE`, started by tests/conftest.py when a session holds the
slow tier.

DeepSpeed JIT-compiles its ops on first use: on a fresh venv that is about 11 minutes of CPU on
2 cores (CPU Adam and async_io about 5 each). Built inline, they stall whichever test first
starts a DeepSpeed engine while the other core idles; built here, at the lowest priority, they
take the core the single-process tests leave idle. The ops land where the tests' own builds
would (TORCH_EXTENSIONS_DIR, set by conftest), with the same flags, so the engine loads them as
built; a test that needs one while it is still building waits on torch's build lock.

STAGE_FILE gets a line per op built and `common` once every op but async_io is (the slow tests
wait for that line: tests/conftest.py); async_io, which only the zero3_nvme runs load, is last;
`ended` when it stops, built or not.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

COMMON = ("ShareMemCommBuilder", "CPUAdamBuilder", "PinMemoryBuilder")  # every DeepSpeed rung
LAST = ("AsyncIOBuilder",)  # zero3_nvme only


def main() -> int:
    stage = Path(sys.argv[1])
    try:
        return _build(stage)
    finally:  # a failed build too: the waiting tests build inline
        with stage.open("a") as f:
            f.write("ended\n")


def _build(stage: Path) -> int:
    os.nice(19)
    from deepspeed.accelerator import get_accelerator

    from trainer.backends.deepspeed import wait_for_build_locks

    wait_for_build_locks()  # a build another process has under way, or a killed one's lock
    for names in (COMMON, LAST):
        for name in names:
            builder = get_accelerator().create_op_builder(name)
            if builder is not None and builder.is_compatible(verbose=False):
                builder.load(verbose=False)
                with stage.open("a") as f:
                    f.write(f"{builder.NAME}\n")
        if names is COMMON:
            with stage.open("a") as f:
                f.write("common\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`make test`: the fast tier (`-m "not slow"`: units, in-process engine steps, plans, traces)
and the slow tier (`-m slow`: real launches, multi-rank runs, Slurm) as two pytest sessions at
the same time, so that one tier's work fills the core the other leaves idle (a launch waiting
on its ranks' imports, a rank blocked in a collective, a test sleeping on a hang; the fast tier
is one Python thread). The slow tier prints as it goes; the fast tier's output follows it.

    python tests/tiers.py [PYTEST_ARGS...]

Arguments go to both sessions. Exit status: the first failing session's (a tier that selects
no test counts as passed when the other ran some). tests/conftest.py orders each session and
builds DeepSpeed's ops for the slow one.

Both run torch on one thread a process (OMP_NUM_THREADS=1 unless set): with two sessions and
their ranks on two cores, OpenMP's spinning threads cost more than they bring (a 60-step run
of the demo model took 125 s beside the fast tier with a thread per core, 13 s alone).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NO_TESTS = 5  # pytest's exit status when nothing was selected


def main(args: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", "-q"]
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    with tempfile.TemporaryFile("w+") as log:
        fast = subprocess.Popen(
            [*pytest, "--durations=10", "-m", "not slow", *args, "tests"],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True,
        )  # fmt: skip
        try:
            slow = subprocess.run([*pytest, "--durations=15", "-m", "slow", *args, "tests"],
                                  cwd=REPO, env=env).returncode  # fmt: skip
            fast_rc = fast.wait()
        finally:
            if fast.poll() is None:  # interrupted: the fast tier does not outlive the command
                os.killpg(fast.pid, signal.SIGKILL)
                fast.wait()
        log.seek(0)
        print(f"\n{'=' * 30} the fast tier {'=' * 30}", flush=True)
        sys.stdout.write(log.read())
    codes = [rc for rc in (slow, fast_rc) if rc != NO_TESTS] or [NO_TESTS]
    return next((rc for rc in codes if rc != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

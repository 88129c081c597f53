"""`oomless train` several times in ONE process, kept for the session: `python
tests/cli_worker.py`, fed on stdin one line per batch, each a JSON list of {"args": [...],
"log": PATH}.

Each job is `launcher.cli.main(["train", *args])` with the process's stderr (fd 2) going to PATH,
one after another; after each a line `cli_worker done: {"log": PATH, "exit": CODE}` goes to
stdout. The first job that exits non-zero ends the worker with its code; end of input ends it
with 0. The single-process references of the engine-run fixtures train here
(tests/conftest.py `train_in_one_process`): the imports (5-8 s) are paid once a session, not
once per fixture, nor per run. The CLI as its own process is under test in
tests/test_cli_train.py and the escalation tests.

A sharded rung on one process (fsdp at world 1) creates a process group of one that stays for
the rest of the worker's life, as it does in one `oomless train`: `single` runs after it reduce
over that group of one, which changes no value.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# Run as a script, this file's folder would come first on sys.path, and its `launcher` and
# `trainer` test packages would shadow the checkout's own: the checkout's root goes first instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

DONE = "cli_worker done: "  # the line per job on stdout (the CLI prints its last metrics there)
# No restart after a hang: then one rank trains in this process, not in a child of its own
# (launcher/run/launch.py `launch_spec`), and the imports stay paid once; a job may override it.
IN_THIS_PROCESS = "run.max_restarts=0"


def main() -> int:
    from launcher.cli import main as oomless

    saved_stderr = os.dup(2)
    for batch in sys.stdin:
        for job in json.loads(batch):
            sys.stderr.flush()
            with open(job["log"], "w") as log:
                os.dup2(log.fileno(), 2)
                try:
                    config, *overrides = job["args"]
                    code = oomless(["train", config, IN_THIS_PROCESS, *overrides])
                finally:
                    sys.stderr.flush()
                    os.dup2(saved_stderr, 2)
            print(f"{DONE}{json.dumps({'log': job['log'], 'exit': code})}", flush=True)
            if code != 0:
                return code
    return 0


if __name__ == "__main__":
    from trainer.runtime.dist import exit_without_teardown

    exit_without_teardown(main())

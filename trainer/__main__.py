"""`python -m trainer RESOLVED_CONFIG`: what torchrun or srun runs on every rank."""

from __future__ import annotations

import sys

from launcher.config import ConfigError, load_config


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m trainer RESOLVED_CONFIG", file=sys.stderr)
        return 2
    try:
        cfg = load_config(argv[0])
        from trainer.engine import run_training

        return run_training(cfg)
    except ConfigError as err:  # bad data rows, an unreachable model: one line, exit 2
        print(err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The estimate against a traced step for LoRA, QLoRA and 8-bit AdamW on the covering grid.

tests/launcher/test_estimate_trace.py holds the grid used for full fine-tuning and a few cases
per method; this walks the whole covering grid per method (LoRA on `single` and `fsdp` x2/4/8,
QLoRA and `adamw_8bit` on `single`, where the engine runs them among the traceable rungs) and
prints each error with the median and maximum. About 10 minutes on 2 busy CPU cores.

    python -m bench.finetune_trace [--method lora|qlora|adamw_8bit]
"""

from __future__ import annotations

import argparse
import statistics

from tests.launcher.test_estimate_trace import METHODS, covering_grid, relative_error


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=list(METHODS))
    args = p.parse_args()
    for name in [args.method] if args.method else list(METHODS):
        cases = [c for c in covering_grid() if name == "lora" or c[2] == "single"]
        errors = []
        for case in cases:
            err = relative_error(*case, finetune=METHODS[name])
            errors.append(abs(err))
            print(f"{name:<11} {' '.join(map(str, case)):<40} {err:+.2%}", flush=True)
        print(f"{name}: median {statistics.median(errors):.2%}, max {max(errors):.2%}")


if __name__ == "__main__":
    main()

"""`oomless` command line. Parses, loads the config once, dispatches; exit codes: docs/interface.md.

What a script wants goes to stdout (the plan, the resolved config, the export's path, the last
metrics line of a finished `train`); progress and diagnostics go to stderr.

Each subcommand's work lives in the module that owns the concept; this file only wires them, and
imports them lazily so `oomless config` and bad input answer fast.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path

from launcher.plan.planner import NoFitError
from trainer.core.config import ConfigError, dump_config, load_config
from trainer.core.contract import EXIT_CUT_OFF, EXIT_NO_FIT, EXIT_OK, EXIT_USAGE, METRICS_FILE
from trainer.core.files import read_jsonl
from trainer.core.logs import redact, setup_logging


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        print(f"oomless: {message}; see 'oomless --help'", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="oomless", description="Fine-tune HF causal LMs without out-of-memory.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def with_config(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("config", help="job YAML file")
        sp.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
        return sp

    sp = with_config("estimate", "memory per strategy (no GPU needed)")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--trace", action="store_true", help="also trace one real step (FakeTensor)")
    sp = with_config("plan", "the plan oomless would run, and why")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--emit", choices=["torchrun", "deepspeed", "accelerate", "sbatch", "trainjob"])
    sp.add_argument(
        "--probe",
        action="store_true",
        help="also run one step of the job and print measured against estimated (exit 3 over)",
    )
    sp = with_config("train", "plan, launch, escalate on OOM")
    sp.add_argument("--dry-run", action="store_true")
    sp = with_config("submit", "write run_dir/submit.sbatch and sbatch it")
    sp.add_argument("--dry-run", action="store_true")
    sp.add_argument(
        "--k8s",
        action="store_true",
        help="a Kubeflow TrainJob instead: write run_dir/trainjob.yaml and kubectl apply it",
    )
    with_config("config", "print the resolved config")
    sp = sub.add_parser("export", help="checkpoint -> HF model dir (PEFT adapter dir for LoRA)")
    sp.add_argument("checkpoint")
    sp.add_argument("out_dir")
    sp.add_argument(
        "--merge", action="store_true", help="lora/qlora: a plain HF model with the adapters merged"
    )
    sp.add_argument(
        "--overwrite", action="store_true", help="replace the contents of a non-empty OUT_DIR"
    )
    sp.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let the model's own Python code run (never taken from the checkpoint)",
    )
    sp = sub.add_parser("report", help="plots of a run (loss curves, memory breakdown)")
    sp.add_argument("run_dir")
    return p


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "export":
        from trainer.checkpoint.export import export_command

        return export_command(
            args.checkpoint, args.out_dir, args.overwrite, args.trust_remote_code, args.merge
        )
    if args.command == "report":
        from launcher.report.run_report import report_command

        return report_command(args.run_dir)
    cfg = load_config(args.config, args.overrides)
    if args.command == "config":
        sys.stdout.write(dump_config(cfg))
        return EXIT_OK
    if args.command == "estimate":
        from launcher.report.estimate_report import estimate_command

        return estimate_command(cfg, as_json=args.json, trace=args.trace)
    if args.command == "plan":
        from launcher.report.plan_report import plan_command

        if args.probe and (args.json or args.emit):
            raise ConfigError(
                "--probe", "runs one step and prints a table: it takes no --json or --emit",
                "run `oomless plan --probe` and `oomless plan --json` (or --emit) separately",
            )  # fmt: skip
        if args.probe:
            from launcher.report.probe_report import probe_command

            return probe_command(cfg)
        return plan_command(cfg, as_json=args.json, emit=args.emit)
    if args.command == "train":
        from launcher.run.supervisor import train_command

        code = train_command(cfg, dry_run=args.dry_run)
        if code == EXIT_OK and not args.dry_run:
            _print_last_metrics(Path(cfg.run.dir).expanduser())
        return code
    if args.command == "submit" and args.k8s:
        from launcher.k8s.submit import submit_k8s_command

        return submit_k8s_command(cfg, dry_run=args.dry_run)
    if args.command == "submit":
        from launcher.slurm.submit import submit_command

        return submit_command(cfg, dry_run=args.dry_run)
    raise AssertionError(args.command)


def _print_last_metrics(run_dir: Path) -> None:
    """The finished run's last metrics.jsonl record, one JSON line on stdout."""
    records = [r for r in read_jsonl(run_dir / METRICS_FILE) if isinstance(r.get("step"), int)]
    if records:
        print(json.dumps(records[-1]), flush=True)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, flags and KEY=VALUE overrides in any order after CONFIG
    (docs/interface.md): argparse stops a positional list at the first flag, so what it leaves
    over that is not a flag joins the overrides."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    flags = [arg for arg in extra if arg.startswith("-")]
    if flags or not hasattr(args, "overrides"):
        parser.error(f"unrecognized arguments: {' '.join(flags or extra)}")
    args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    args = _parse(argv)
    try:
        return _dispatch(args)
    except ConfigError as err:
        print(redact(str(err)), file=sys.stderr)  # a data or model URL can carry a password
        return EXIT_USAGE
    except NoFitError as err:
        print(f"oomless: {err}", file=sys.stderr)
        return EXIT_NO_FIT
    except KeyboardInterrupt:  # before the engine runs: nothing to checkpoint (143 promises one)
        return EXIT_CUT_OFF
    except BrokenPipeError:  # output piped into `head` and friends
        sys.stderr.close()
        return EXIT_OK


# Commands that only read and print. The `oomless` command leaves the process as soon as their
# output is flushed: the interpreter's teardown of the torch and transformers a traced estimate
# imports takes 1.1-1.4 s on 2 cores (docs/planner.md "How long planning takes").
READ_ONLY_COMMANDS = ("config", "estimate", "plan")


def console_main() -> None:
    """The `oomless` command (pyproject.toml): `main`, then the exit."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv and argv[0] in READ_ONLY_COMMANDS:
        logging.shutdown()
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
